//! Criterion benchmarks of redline's hot paths live in `benches/`; `cargo xtask bench …` runs
//! them and prints their tables. Reference scripts for side-by-side runs (PyTorch, FFCV) live in
//! `benches/pytorch/` as later benchmarks arrive.

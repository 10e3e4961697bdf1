//! redline's benchmarks. Criterion benchmarks of hot paths live in `benches/`; the op benchmark
//! (`ops`, run by the `bench-ops` binary) times whole ops through the tensor API; reference
//! scripts for side-by-side runs live in `benches/pytorch/`. `cargo xtask bench …` runs them and
//! prints their tables.

pub mod ops;

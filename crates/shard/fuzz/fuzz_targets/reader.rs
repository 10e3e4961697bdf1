//! `cargo fuzz run reader` (from crates/shard): arbitrary bytes opened as a shard must never
//! panic. The body lives in `redline_shard::fuzz::reader` so `cargo test` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redline_shard::fuzz::reader(data));

//! The body of the `reader` fuzz target (`crates/shard/fuzz`), shared with a unit test that runs
//! it over the committed corpus so every `cargo test` replays what fuzzing found.

use crate::reader::{OpenOptions, ShardReader};

/// Opens arbitrary bytes as a shard and exercises every read path. Must never panic; when the
/// bytes open, every record read must agree with the verify pass.
pub fn reader(bytes: &[u8]) {
    let Ok(shard) = ShardReader::from_bytes("fuzz.rdl", bytes.to_vec(), OpenOptions::default())
    else {
        return;
    };
    let verified = shard.verify();
    let mut all_records_ok = true;
    for i in 0..shard.len().min(4096) {
        let _ = shard.entry(i);
        all_records_ok &= shard.record_verified(i).is_ok();
    }
    let _ = shard.record(shard.len());
    if verified.is_ok() {
        assert!(all_records_ok, "verify passed but a record failed its CRC");
    }
}

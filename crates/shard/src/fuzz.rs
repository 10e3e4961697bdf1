//! The body of the `reader` fuzz target (`crates/shard/fuzz`), shared with a unit test that runs
//! it over the committed corpus so every `cargo test` replays what fuzzing found.

use crate::format::{HEADER_SIZE, TABLE_CRC_OFFSET};
use crate::reader::{OpenOptions, ShardReader};

/// Opens arbitrary bytes as a shard and exercises every read path. Must never panic; when the
/// bytes open, every record read must agree with the verify pass.
///
/// The bytes are tried twice: as they are, and with the table CRC recomputed, so mutations get
/// past the CRC and reach the index and metadata checks behind it.
pub fn reader(bytes: &[u8]) {
    exercise(bytes.to_vec());
    if let Some(fixed) = with_table_crc_fixed(bytes) {
        exercise(fixed);
    }
}

fn exercise(bytes: Vec<u8>) {
    let Ok(shard) = ShardReader::from_bytes("fuzz.rdl", bytes, OpenOptions::default()) else {
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

/// A copy whose `table_crc32c` matches the header's claimed index and metadata, when those
/// ranges lie inside the bytes.
fn with_table_crc_fixed(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < HEADER_SIZE {
        return None;
    }
    let field = |at: usize| {
        let mut v = [0u8; 8];
        v.copy_from_slice(&bytes[at..at + 8]);
        usize::try_from(u64::from_le_bytes(v)).ok()
    };
    let (index, metadata, metadata_len) = (field(48)?, field(56)?, field(64)?);
    let metadata_end = metadata.checked_add(metadata_len)?;
    if index > metadata || metadata_end > bytes.len() {
        return None;
    }
    let crc = crc32c::crc32c(&bytes[..TABLE_CRC_OFFSET]);
    let crc = crc32c::crc32c_append(crc, &bytes[index..metadata]);
    let crc = crc32c::crc32c_append(crc, &bytes[metadata..metadata_end]);
    let mut fixed = bytes.to_vec();
    fixed[TABLE_CRC_OFFSET..HEADER_SIZE].copy_from_slice(&crc.to_le_bytes());
    Some(fixed)
}

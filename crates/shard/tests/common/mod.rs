//! Helpers shared by the shard integration tests.
#![allow(dead_code)]

use std::path::Path;

use redline_shard::{Encoding, Manifest, RecordInfo, SetOptions, SetWriter};

/// A record for tests: deterministic bytes of `len` from `seed`.
pub fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

pub fn info(label: i32) -> RecordInfo {
    RecordInfo {
        label,
        width: 3,
        height: 2,
        encoding: Encoding::Other,
    }
}

pub fn classes(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("class{i}")).collect()
}

/// Writes `records` (label, bytes) as a set in `dir`, splitting at `shard_bytes`.
pub fn write_set(dir: &Path, records: &[(i32, Vec<u8>)], shard_bytes: u64) -> Manifest {
    let mut options = SetOptions::images("test", classes(4));
    options.shard_bytes = shard_bytes;
    let mut writer = SetWriter::create(dir, options).unwrap();
    for (label, data) in records {
        writer.append(info(*label), data).unwrap();
    }
    writer.finish().unwrap()
}

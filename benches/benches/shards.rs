//! Shard reads (`cargo xtask bench shards`).
//!
//! * `scan`: every record of a 128 MiB set through the reader API (zero-copy), every byte touched
//!   (summed as u64 words), next to `memcpy`: the same record bytes copied into a reused buffer.
//!   Goal: scan ≥ 0.8× memcpy.
//! * `scan_verified`: the same scan with each record's CRC32C checked.
//! * `random_*`: records at shuffled global indices, with and without the CRC check.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use redline_shard::{Access, Encoding, OpenOptions, RecordInfo, SetOptions, SetWriter, ShardSet};

const SET_BYTES: usize = 128 << 20;
const RANDOM_READS: usize = 1024;

/// Record sizes like JPEGs of ImageNet at FFCV's 256–512 px: 40–160 KB.
fn record_len(i: usize) -> usize {
    40_000 + (i * 7919) % 120_000
}

fn write_set(dir: &std::path::Path) -> (u64, u64) {
    let mut options = SetOptions::images("bench", vec!["a".into(), "b".into()]);
    options.shard_bytes = 32 << 20; // several shards, so global lookups cross files
    let mut writer = SetWriter::create(dir, options).unwrap();
    let (mut bytes, mut records) = (0usize, 0u64);
    let mut buffer = Vec::new();
    while bytes < SET_BYTES {
        let len = record_len(records as usize);
        buffer.clear();
        buffer.extend((0..len).map(|j| (j as u8).wrapping_mul(13) ^ records as u8));
        let info = RecordInfo {
            label: (records % 2) as i32,
            width: 0,
            height: 0,
            encoding: Encoding::Other,
        };
        writer.append(info, &buffer).unwrap();
        bytes += len;
        records += 1;
    }
    writer.finish().unwrap();
    (records, bytes as u64)
}

/// Touches every byte: a wrapping sum of little-endian u64 words (vectorises; memory-bound).
fn touch(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut sum = words
        .by_ref()
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .fold(0u64, u64::wrapping_add);
    for &b in words.remainder() {
        sum = sum.wrapping_add(b as u64);
    }
    sum
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let (records, bytes) = write_set(dir.path());
    let open = |verify_reads, access| {
        ShardSet::open_with(
            dir.path(),
            OpenOptions {
                verify_reads,
                access,
            },
        )
        .unwrap()
    };
    let trusting = open(false, Access::Sequential);
    let verifying = open(true, Access::Sequential);
    // Warm the page cache so every variant reads memory, not disk.
    black_box(
        trusting
            .records()
            .map(|r| touch(r.unwrap().bytes))
            .sum::<u64>(),
    );

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("shards");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("scan", |b| {
        b.iter(|| {
            (0..records)
                .map(|g| touch(trusting.record(g).unwrap().bytes))
                .fold(0u64, u64::wrapping_add)
        })
    });
    group.bench_function("scan_verified", |b| {
        b.iter(|| {
            (0..records)
                .map(|g| touch(verifying.record(g).unwrap().bytes))
                .fold(0u64, u64::wrapping_add)
        })
    });
    let mut dest = vec![0u8; 1 << 20];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            for g in 0..records {
                let src = trusting.record(g).unwrap().bytes;
                dest[..src.len()].copy_from_slice(src);
                black_box(&dest);
            }
        })
    });

    // Shuffled global indices (a fixed LCG permutation walk).
    let order: Vec<u64> = (0..RANDOM_READS as u64)
        .map(|i| (i * 2_654_435_761 + 12_345) % records)
        .collect();
    group.throughput(Throughput::Elements(RANDOM_READS as u64));
    let randoms = [
        ("random_unverified", &trusting),
        ("random_verified", &verifying),
    ];
    for (name, set) in randoms {
        set.advise(Access::Random);
        group.bench_function(name, |b| {
            b.iter(|| {
                order
                    .iter()
                    .map(|&g| {
                        let r = set.record(g).unwrap();
                        r.bytes[0] as u64 + r.bytes.len() as u64
                    })
                    .sum::<u64>()
            })
        });
    }
    group.finish();
    c.final_summary();
}

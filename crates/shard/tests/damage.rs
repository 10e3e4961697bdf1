//! Damaged files: every truncation and byte flip gives an error naming the shard (and the
//! record where one is involved) — never a panic, never wrong bytes while verification is on.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{bytes, write_set};
use redline_shard::{format::HEADER_SIZE, OpenOptions, ShardReader, ShardSet};

const SHARD: &str = "shard-00000.rdl";

/// One shard with small, page-straddling, page-sized, large and empty records.
fn sample() -> (tempfile::TempDir, Vec<(i32, Vec<u8>)>) {
    let dir = tempfile::tempdir().unwrap();
    let records = vec![
        (0, bytes(100, 1)),
        (1, bytes(4000, 2)), // does not fit after the first: moves to the next page
        (2, bytes(0, 3)),
        (3, bytes(9000, 4)), // larger than a page: starts on a page boundary
        (-1, bytes(4096, 5)),
        (0, bytes(7, 6)),
    ];
    write_set(dir.path(), &records, 1 << 30);
    (dir, records)
}

struct Damaged {
    dir: tempfile::TempDir,
}

impl Damaged {
    /// A copy of the set in `src` whose shard file is replaced by `shard`.
    fn new(src: &Path, shard: &[u8]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::copy(src.join("manifest.json"), dir.path().join("manifest.json")).unwrap();
        fs::write(dir.path().join(SHARD), shard).unwrap();
        Self { dir }
    }

    fn open(&self) -> Result<ShardSet, String> {
        ShardSet::open(self.dir.path()).map_err(|e| e.to_string())
    }
}

fn original(dir: &Path) -> (Vec<u8>, ShardReader) {
    let path: PathBuf = dir.join(SHARD);
    (fs::read(&path).unwrap(), ShardReader::open(&path).unwrap())
}

fn assert_names_shard(err: &str) {
    assert!(err.contains(SHARD), "error does not name the shard: {err}");
}

#[test]
fn truncation_at_every_boundary_and_random_points_is_an_error() {
    let (dir, _) = sample();
    let (file, reader) = original(dir.path());
    let h = *reader.header();
    let mut cuts = vec![0, 1, 8, 79, HEADER_SIZE as u64, 4095, h.records_offset];
    for i in 0..reader.len() {
        let e = reader.entry(i).unwrap();
        cuts.extend([e.offset, e.offset + 1, e.end()]);
    }
    cuts.extend([
        h.records_end,
        h.index_offset,
        h.index_offset + 31,
        h.metadata_offset,
    ]);
    cuts.extend([h.metadata_offset + 1, file.len() as u64 - 1]);
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        cuts.push(x % file.len() as u64);
    }
    for cut in cuts {
        let damaged = Damaged::new(dir.path(), &file[..cut as usize]);
        let err = damaged
            .open()
            .err()
            .unwrap_or_else(|| panic!("cut at {cut} opened"));
        assert_names_shard(&err);
    }
}

#[test]
fn flips_in_header_index_and_metadata_fail_at_open() {
    let (dir, _) = sample();
    let (file, reader) = original(dir.path());
    let h = *reader.header();
    let header = 0..HEADER_SIZE as u64;
    let index = h.index_offset..h.metadata_offset;
    let metadata = h.metadata_offset..file.len() as u64;
    for at in header.chain(index).chain(metadata) {
        for bit in [0x01u8, 0x80] {
            let mut bad = file.clone();
            bad[at as usize] ^= bit;
            let err = Damaged::new(dir.path(), &bad)
                .open()
                .err()
                .unwrap_or_else(|| panic!("flip {bit:#x} at byte {at} opened"));
            assert_names_shard(&err);
        }
    }
}

#[test]
fn flips_in_records_name_the_record_and_never_return_wrong_bytes() {
    let (dir, records) = sample();
    let (file, reader) = original(dir.path());
    for (i, (_, data)) in records.iter().enumerate() {
        let e = reader.entry(i as u64).unwrap();
        if data.is_empty() {
            continue;
        }
        for at in [e.offset, e.offset + e.length as u64 / 2, e.end() - 1] {
            let mut bad = file.clone();
            bad[at as usize] ^= 0x40;
            let damaged = Damaged::new(dir.path(), &bad);
            // The table CRC does not cover record bytes: the set opens...
            let set = damaged.open().unwrap();
            // ...but the damaged record is refused, by name, and the others read fine.
            for (j, (_, want)) in records.iter().enumerate() {
                match set.record(j as u64) {
                    Ok(r) => {
                        assert_ne!(i, j, "damaged record {i} was returned");
                        assert_eq!(r.bytes, &want[..]);
                    }
                    Err(err) => {
                        assert_eq!(j, i);
                        let err = err.to_string();
                        assert_names_shard(&err);
                        assert!(err.contains(&format!("record {i}:")), "{err}");
                        assert!(err.contains("CRC32C mismatch"), "{err}");
                    }
                }
            }
            let err = set.verify().unwrap_err().to_string();
            assert!(err.contains(&format!("record {i}:")), "{err}");
            // With per-read checks off, verify still catches it.
            let trusting = ShardSet::open_with(
                damaged.dir.path(),
                OpenOptions {
                    verify_reads: false,
                    ..Default::default()
                },
            )
            .unwrap();
            assert!(trusting.verify().is_err());
        }
    }
}

#[test]
fn flips_in_padding_fail_verification_but_not_reads() {
    let (dir, records) = sample();
    let (file, reader) = original(dir.path());
    let h = *reader.header();
    let mut padding: Vec<u64> = vec![HEADER_SIZE as u64, 1000, h.records_offset - 1];
    let mut previous_end = h.records_offset;
    for i in 0..reader.len() {
        let e = reader.entry(i).unwrap();
        if e.offset > previous_end {
            padding.extend([previous_end, e.offset - 1]);
        }
        previous_end = e.end();
    }
    padding.extend([h.records_end, h.index_offset - 1]);
    assert!(
        padding.len() > 6,
        "the sample must have padding between records"
    );
    for at in padding {
        let mut bad = file.clone();
        bad[at as usize] = 0xAA;
        let set = Damaged::new(dir.path(), &bad).open().unwrap();
        for (j, (_, want)) in records.iter().enumerate() {
            assert_eq!(set.record(j as u64).unwrap().bytes, &want[..]);
        }
        let err = set.verify().unwrap_err().to_string();
        assert_names_shard(&err);
        assert!(
            err.contains(&format!("non-zero padding byte at offset {at}")),
            "{err}"
        );
    }
}

#[test]
fn a_manifest_that_disagrees_with_its_shard_is_an_error() {
    let (dir, _) = sample();
    let manifest = fs::read_to_string(dir.path().join("manifest.json")).unwrap();
    for (from, to) in [
        ("\"records\": 6", "\"records\": 7"),
        ("\"format\": \"redline-shard\"", "\"format\": \"other\""),
        ("shard-00000.rdl", "../shard-00000.rdl"),
        ("shard-00000.rdl", "missing.rdl"),
        ("\"class3\"", "\"classX\""),
        ("{", "["),
    ] {
        assert!(manifest.contains(from), "{from}");
        let bad = manifest.replacen(from, to, 1);
        fs::write(dir.path().join("manifest.json"), &bad).unwrap();
        let err = ShardSet::open(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("manifest") || err.contains("missing.rdl"),
            "{from} -> {to}: {err}"
        );
    }
}

#[test]
fn a_missing_set_names_the_path() {
    let err = ShardSet::open("/nonexistent/set")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/nonexistent/set/manifest.json"), "{err}");
}

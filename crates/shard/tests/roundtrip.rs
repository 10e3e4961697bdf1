//! Whatever goes in comes out: any records, across shard boundaries, with O(1) lookup.

mod common;

use common::{bytes, write_set};
use proptest::prelude::*;
use redline_shard::{format::PAGE_SIZE, OpenOptions, ShardSet};

fn record_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => Just(0usize),
        10 => 1usize..64,
        6 => 64usize..5000,
        2 => (PAGE_SIZE as usize - 2)..(PAGE_SIZE as usize + 2),
        2 => 5000usize..20_000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, max_shrink_time: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn records_round_trip_across_shards(
        specs in prop::collection::vec((record_len(), -1i32..4, any::<u8>()), 0..40),
        shard_bytes in prop_oneof![Just(1u64), 4096u64..40_000, Just(1u64 << 30)],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let records: Vec<(i32, Vec<u8>)> =
            specs.iter().map(|&(len, label, seed)| (label, bytes(len, seed))).collect();
        let manifest = write_set(dir.path(), &records, shard_bytes);
        prop_assert_eq!(manifest.records, records.len() as u64);

        for options in [OpenOptions::default(), OpenOptions { verify_reads: false, ..Default::default() }] {
            let set = ShardSet::open_with(dir.path(), options).unwrap();
            prop_assert_eq!(set.len(), records.len() as u64);
            let report = set.verify().unwrap();
            prop_assert_eq!(report.records, records.len() as u64);
            for (g, (label, data)) in records.iter().enumerate() {
                let record = set.record(g as u64).unwrap();
                prop_assert_eq!(record.bytes, &data[..]);
                prop_assert_eq!(record.label, *label);
                prop_assert_eq!((record.width, record.height), (3, 2));
                let (shard, local) = set.locate(g as u64).unwrap();
                prop_assert_eq!(set.shards()[shard].path(), record.shard);
                prop_assert_eq!(local, record.index);
            }
            let scanned: Vec<Vec<u8>> = set.records().map(|r| r.unwrap().bytes.to_vec()).collect();
            prop_assert_eq!(scanned.len(), records.len());
            prop_assert!(set.record(records.len() as u64).is_err());
        }
        // A shard never exceeds the target by more than one record (and its overheads).
        if shard_bytes == 1 {
            prop_assert_eq!(manifest.shards.len(), records.len());
        }
    }
}

#[test]
fn an_empty_set_opens_and_has_no_records() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = write_set(dir.path(), &[], 1 << 20);
    assert!(manifest.shards.is_empty());
    let set = ShardSet::open(dir.path()).unwrap();
    assert!(set.is_empty());
    assert!(set.record(0).is_err());
    assert_eq!(set.verify().unwrap().records, 0);
}

#[test]
fn the_writer_refuses_labels_outside_the_classes() {
    let dir = tempfile::tempdir().unwrap();
    let options = redline_shard::SetOptions::images("t", common::classes(2));
    let mut writer = redline_shard::SetWriter::create(dir.path(), options).unwrap();
    let err = writer
        .append(common::info(2), b"x")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("label 2") && err.contains("shard-00000.rdl"),
        "{err}"
    );
}

#[test]
fn an_unfinished_shard_leaves_no_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.rdl");
    let mut writer =
        redline_shard::ShardWriter::create(&path, redline_shard::Metadata::images(vec![])).unwrap();
    writer.append(common::info(-1), b"abc").unwrap();
    drop(writer);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

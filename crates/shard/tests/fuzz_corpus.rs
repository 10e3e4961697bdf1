//! Replays the fuzz corpus through the fuzz target's body on every `cargo test`.

mod common;

use std::fs;
use std::path::PathBuf;

use redline_shard::{Metadata, OpenOptions, ShardReader, ShardWriter};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/reader")
}

#[test]
fn the_fuzz_body_survives_the_committed_corpus() {
    let mut files = 0;
    let mut valid = 0;
    for entry in fs::read_dir(corpus_dir()).unwrap() {
        let bytes = fs::read(entry.unwrap().path()).unwrap();
        redline_shard::fuzz::reader(&bytes);
        files += 1;
        valid += ShardReader::from_bytes("seed", bytes, OpenOptions::default()).is_ok() as usize;
    }
    assert!(files >= 8, "the corpus has only {files} files");
    assert!(
        valid >= 2,
        "the corpus must hold valid shards too (found {valid})"
    );
}

/// Writes the seed corpus: valid shards and systematically damaged copies.
#[test]
#[ignore = "writes the committed corpus; run by hand when the format changes"]
fn regenerate_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, records: &[(i32, Vec<u8>)]| {
        let path = dir.path().join(name);
        let mut writer = ShardWriter::create(&path, Metadata::images(common::classes(4))).unwrap();
        for (label, data) in records {
            writer.append(common::info(*label), data).unwrap();
        }
        writer.finish().unwrap();
        fs::read(path).unwrap()
    };
    let small = write(
        "small",
        &[
            (0, common::bytes(20, 1)),
            (3, vec![]),
            (-1, common::bytes(4090, 2)),
            (1, common::bytes(5000, 3)),
        ],
    );
    let empty = write("empty", &[]);
    let out = corpus_dir();
    fs::create_dir_all(&out).unwrap();
    let mut seeds = vec![
        ("valid-small", small.clone()),
        ("valid-empty", empty.clone()),
    ];
    for cut in [0, 79, 80, 4096, 4200, small.len() - 1] {
        seeds.push(("truncated", small[..cut].to_vec()));
    }
    for at in [0, 8, 24, 40, 76] {
        let mut bad = small.clone();
        bad[at] ^= 0xFF;
        seeds.push(("flipped-header", bad));
    }
    let mut bad = small.clone();
    bad[4096 + 5] ^= 1;
    seeds.push(("flipped-record", bad));
    let mut bad = small.clone();
    bad[100] = 1;
    seeds.push(("dirty-padding", bad));
    for (n, (name, bytes)) in seeds.into_iter().enumerate() {
        fs::write(out.join(format!("{n:02}-{name}")), bytes).unwrap();
    }
}

//! ImageFolder tree → shards → reader, with the odd files real folders contain.

use std::fs;
use std::path::Path;

use redline_datasets::convert::{convert_folder, ConvertOptions};
use redline_datasets::generate::{synth_folder, SynthOptions};
use redline_shard::{Encoding, ShardSet};

fn small_synth(out: &Path) {
    let options = SynthOptions {
        classes: 3,
        images: 15,
        seed: 5,
        ..SynthOptions::default()
    };
    synth_folder(out, &options).unwrap();
}

fn options() -> ConvertOptions {
    ConvertOptions {
        shard_bytes: 300_000, // several shards
        ..ConvertOptions::default()
    }
}

/// Adds the awkward files of real datasets to `root/train` and `root/val`.
fn add_odd_files(root: &Path) -> Vec<&'static str> {
    let train = root.join("train");
    let class0 = fs::read_dir(&train)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let some_jpeg = fs::read_dir(&class0)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let jpeg = fs::read(&some_jpeg).unwrap();
    fs::write(class0.join("truncated.jpg"), &jpeg[..jpeg.len() / 3]).unwrap();
    fs::write(class0.join("notes.txt"), b"not an image").unwrap();
    let mut garbage = vec![0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x03, 0x00];
    garbage.extend((0..2000u32).map(|i| (i * 7 % 251) as u8));
    garbage.extend([0xFF, 0xD9]);
    fs::write(class0.join("garbage.jpg"), garbage).unwrap();
    fs::write(train.join("README"), b"stray file at the top").unwrap();
    let gray = image::GrayImage::from_fn(50, 40, |x, y| image::Luma([(x * 5 + y) as u8]));
    gray.save(class0.join("gray.png")).unwrap();
    let nested = class0.join("nested");
    fs::create_dir_all(&nested).unwrap();
    gray.save(nested.join("gray.jpg")).unwrap();
    // A validation class the training set does not have.
    let stray = root.join("val/zz_unknown");
    fs::create_dir_all(&stray).unwrap();
    fs::write(stray.join("x.jpg"), &jpeg).unwrap();
    vec![
        "truncated.jpg",
        "garbage.jpg",
        "notes.txt",
        "README",
        "zz_unknown",
    ]
}

#[test]
fn a_train_val_tree_becomes_two_verified_sets_with_originals_kept() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let odd = add_odd_files(src.path());

    let summary = convert_folder(src.path(), out.path(), &options()).unwrap();
    assert_eq!(summary.classes.len(), 3);
    let skipped: Vec<String> = summary
        .skipped
        .iter()
        .map(|s| format!("{}: {}", s.path.display(), s.reason))
        .collect();
    assert_eq!(skipped.len(), odd.len(), "{skipped:#?}");
    for name in odd {
        assert!(
            skipped.iter().any(|s| s.contains(name)),
            "{name} not reported: {skipped:#?}"
        );
    }
    assert!(skipped
        .iter()
        .any(|s| s.contains("truncated.jpg: truncated")));
    assert!(skipped
        .iter()
        .any(|s| s.contains("garbage.jpg: cannot be decoded")));

    let train = ShardSet::open(out.path().join("train")).unwrap();
    let val = ShardSet::open(out.path().join("val")).unwrap();
    assert_eq!(
        train.len(),
        15 + 2,
        "15 synthetic images + the PNG and the nested JPEG"
    );
    assert_eq!(val.len(), 3);
    assert!(train.shards().len() > 1, "the shard size splits the set");
    assert_eq!(
        val.classes(),
        train.classes(),
        "val follows train's class list"
    );
    train.verify().unwrap();
    val.verify().unwrap();

    // Without --max-side the stored bytes are the original files, byte for byte.
    let class0 = &train.classes()[0];
    let first = fs::read_dir(src.path().join("train").join(class0))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg") && !p.ends_with("truncated.jpg"))
        .min()
        .unwrap();
    let record = train.record(0).unwrap();
    assert_eq!(record.bytes, &fs::read(first).unwrap()[..]);
    assert_eq!(record.label, 0);
    assert_eq!(record.encoding, Encoding::Jpeg);
    assert!(record.width >= 300 && record.height >= 300);
    assert!(train
        .records()
        .any(|r| r.unwrap().encoding == Encoding::Png));
    // Every val label names a class from train.
    for r in val.records() {
        let r = r.unwrap();
        assert!((0..3).contains(&r.label));
    }
}

#[test]
fn max_side_resizes_and_reencodes_everything_as_jpeg() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let options = ConvertOptions {
        max_side: Some(128),
        quality: 80,
        ..options()
    };
    let summary = convert_folder(src.path(), out.path(), &options).unwrap();
    assert!(summary.skipped.is_empty());
    let train = ShardSet::open(out.path().join("train")).unwrap();
    for r in train.records() {
        let r = r.unwrap();
        assert_eq!(r.encoding, Encoding::Jpeg);
        assert_eq!(r.width.max(r.height), 128);
        let img = image::load_from_memory(r.bytes).unwrap();
        assert_eq!(
            (img.width(), img.height()),
            (r.width as u32, r.height as u32)
        );
    }
    let params = &train.manifest().params;
    assert_eq!(params["max_side"], 128);
    assert_eq!(params["jpeg_quality"], 80);
}

#[test]
fn strict_mode_stops_at_the_first_unusable_file_and_names_it() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    add_odd_files(src.path());
    let strict = ConvertOptions {
        strict: true,
        ..options()
    };
    let err = convert_folder(src.path(), out.path(), &strict)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--strict"), "{err}");
    assert!(
        ["truncated.jpg", "garbage.jpg", "notes.txt", "README"]
            .iter()
            .any(|n| err.contains(n)),
        "{err}"
    );
}

#[test]
fn a_flat_folder_becomes_one_set() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let summary = convert_folder(&src.path().join("val"), out.path(), &options()).unwrap();
    assert_eq!(summary.sets.len(), 1);
    assert_eq!(ShardSet::open(out.path()).unwrap().len(), 3);
}

#[test]
fn a_folder_without_classes_is_a_clear_error() {
    let src = tempfile::tempdir().unwrap();
    fs::write(src.path().join("a.jpg"), b"x").unwrap();
    let err = convert_folder(src.path(), &src.path().join("out"), &options())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no class sub-folders"), "{err}");
}

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

/// The first entry `read_dir` gives in `dir` (a class folder, an image).
fn first_entry(dir: &Path) -> std::path::PathBuf {
    fs::read_dir(dir).unwrap().next().unwrap().unwrap().path()
}

/// The test options with `--strict`.
fn strict() -> ConvertOptions {
    ConvertOptions {
        strict: true,
        ..options()
    }
}

/// Adds the awkward files of real datasets to `root/train` and `root/val`.
fn add_odd_files(root: &Path) -> Vec<&'static str> {
    let train = root.join("train");
    let class0 = first_entry(&train);
    let some_jpeg = first_entry(&class0);
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
    let err = convert_folder(src.path(), out.path(), &strict())
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

/// Kaggle's ImageNet layout: `ILSVRC/Data/CLS-LOC/{train/<wnid>/, val/*.JPEG}` with
/// `LOC_val_solution.csv` at the top. Val labels are the wnids' indices among train's sorted
/// class folders (torchvision's ImageFolder numbering); an image without a label or of an unknown
/// class is skipped with the reason.
#[test]
fn kaggle_imagenet_with_a_flat_val_folder_and_its_csv() {
    let synth = tempfile::tempdir().unwrap();
    small_synth(synth.path());
    let jpegs: Vec<std::path::PathBuf> = fs::read_dir(synth.path().join("train"))
        .unwrap()
        .flat_map(|c| fs::read_dir(c.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    let root = tempfile::tempdir().unwrap();
    let cls_loc = root.path().join("ILSVRC/Data/CLS-LOC");
    // Wnids whose sorted order differs from the order they are written in.
    let wnids = ["n04589890", "n01440764", "n02119789"];
    for (k, wnid) in wnids.iter().enumerate() {
        let dir = cls_loc.join("train").join(wnid);
        fs::create_dir_all(&dir).unwrap();
        for i in 0..2 {
            fs::copy(&jpegs[k * 2 + i], dir.join(format!("{wnid}_{i}.JPEG"))).unwrap();
        }
    }
    let val = cls_loc.join("val");
    fs::create_dir_all(&val).unwrap();
    let mut csv = String::from("ImageId,PredictionString\n");
    for i in 1..=5 {
        fs::copy(
            &jpegs[6 + i],
            val.join(format!("ILSVRC2012_val_{i:08}.JPEG")),
        )
        .unwrap();
        if i <= 3 {
            csv += &format!("ILSVRC2012_val_{i:08},{} 1 2 3 4\n", wnids[i - 1]);
        }
    }
    csv += "ILSVRC2012_val_00000004,n99999999 1 2 3 4\n";
    fs::write(root.path().join("LOC_val_solution.csv"), csv).unwrap();

    let out = tempfile::tempdir().unwrap();
    let summary = convert_folder(&cls_loc, out.path(), &options()).unwrap();
    assert_eq!(summary.classes, ["n01440764", "n02119789", "n04589890"]);
    let val_set = ShardSet::open(out.path().join("val")).unwrap();
    let labels: Vec<i32> = val_set.records().map(|r| r.unwrap().label).collect();
    // val 1 → n04589890 (index 2), val 2 → n01440764 (0), val 3 → n02119789 (1).
    assert_eq!(labels, [2, 0, 1]);
    let reasons: Vec<String> = summary
        .skipped
        .iter()
        .map(|s| format!("{}: {}", s.path.display(), s.reason))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:#?}");
    assert!(
        reasons[0].contains("00000004.JPEG: its class n99999999 is not among"),
        "{reasons:#?}"
    );
    assert!(
        reasons[1].contains("00000005.JPEG: no label in"),
        "{reasons:#?}"
    );
}

/// The devkit's ground truth with the synsets in the devkit's order; a flat val folder without
/// any labels file is an error that says what to give.
#[test]
fn devkit_ground_truth_labels_a_flat_val_folder_and_no_labels_is_a_clear_error() {
    let src = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let val = src.path().join("val");
    let files: Vec<std::path::PathBuf> = fs::read_dir(&val)
        .unwrap()
        .flat_map(|c| fs::read_dir(c.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    let flat = src.path().join("flat_val");
    fs::create_dir_all(&flat).unwrap();
    for (i, f) in files.iter().enumerate() {
        fs::copy(f, flat.join(format!("ILSVRC2012_val_{:08}.JPEG", i + 1))).unwrap();
    }
    fs::remove_dir_all(&val).unwrap();
    fs::rename(&flat, &val).unwrap();
    let classes = {
        let mut c: Vec<String> = fs::read_dir(src.path().join("train"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        c.sort();
        c
    };
    let out = tempfile::tempdir().unwrap();
    let err = convert_folder(src.path(), out.path(), &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--val-labels") && err.contains("LOC_val_solution.csv"),
        "{err}"
    );

    // The devkit's order here is train's classes reversed; IDs are 1-based.
    let synsets = src.path().join("synsets_in_devkit_order.txt");
    let reversed: Vec<String> = classes.iter().rev().cloned().collect();
    fs::write(&synsets, reversed.join("\n")).unwrap();
    let truth = src.path().join("ILSVRC2012_validation_ground_truth.txt");
    let ids: Vec<usize> = (0..files.len()).map(|i| i % classes.len() + 1).collect();
    fs::write(
        &truth,
        ids.iter().map(|i| format!("{i}\n")).collect::<String>(),
    )
    .unwrap();
    let with_labels = ConvertOptions {
        val_labels: Some(truth),
        val_synsets: Some(synsets),
        ..options()
    };
    convert_folder(src.path(), out.path(), &with_labels).unwrap();
    let val_set = ShardSet::open(out.path().join("val")).unwrap();
    let labels: Vec<i32> = val_set.records().map(|r| r.unwrap().label).collect();
    let want: Vec<i32> = ids
        .iter()
        .map(|&id| classes.iter().position(|c| *c == reversed[id - 1]).unwrap() as i32)
        .collect();
    assert_eq!(labels, want);
}

/// A lenient build that skipped a file, run again with `--strict`, fails naming that file
/// instead of reporting the finished set as good.
#[test]
fn strict_mode_refuses_a_set_an_earlier_lenient_run_built_with_skips() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let class0 = first_entry(&src.path().join("train"));
    fs::write(
        class0.join("truncated.jpg"),
        [0xFF, 0xD8, 0xFF, 0xE0, 0, 16],
    )
    .unwrap();
    let summary = convert_folder(src.path(), out.path(), &options()).unwrap();
    assert_eq!(summary.skipped.len(), 1);
    let err = convert_folder(src.path(), out.path(), &strict())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("truncated.jpg") && err.contains("--strict"),
        "{err}"
    );
}

/// Two builds into one folder at once: the second is refused while the first holds the folder,
/// and goes ahead once it is released.
#[test]
fn a_second_build_into_a_folder_being_written_is_refused() {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    small_synth(src.path());
    let train = out.path().join("train");
    fs::create_dir_all(&train).unwrap();
    let held = redline_datasets::journal::lock(&train).unwrap();
    let err = convert_folder(src.path(), out.path(), &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("build.lock") && err.contains("another build"),
        "{err}"
    );
    drop(held);
    convert_folder(src.path(), out.path(), &options()).unwrap();
}

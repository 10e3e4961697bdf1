//! A set writer that stops part-way (a killed build) resumes from its last finished shard and
//! writes the same set, byte for byte, as one that never stopped.

mod common;

use std::fs;
use std::path::Path;

use common::{bytes, classes, info, write_set};
use redline_shard::{SetOptions, SetWriter, ShardEntry, ShardError, ShardSet};

const SHARD_BYTES: u64 = 3 * 4096;

fn records() -> Vec<(i32, Vec<u8>)> {
    (0..40)
        .map(|i| (i % 4, bytes(900 + i as usize * 37, i as u8)))
        .collect()
}

fn options() -> SetOptions {
    let mut options = SetOptions::images("test", classes(4));
    options.shard_bytes = SHARD_BYTES;
    options
}

/// Writes records until `stop_after` shards are finished and a few records into the next, then
/// drops the writer as a killed process would leave it (its temp file gone, as after a crash the
/// resume removes it); returns the finished shards' lines and the index of the next record.
fn write_until(dir: &Path, stop_after: usize) -> (Vec<ShardEntry>, usize) {
    let mut writer = SetWriter::create(dir, options()).unwrap();
    for (i, (label, data)) in records().iter().enumerate() {
        let before = writer.shards_finished();
        writer.append(info(*label), data).unwrap();
        if writer.shards_finished() > before {
            // The record just appended opened a new shard: everything before it is finished.
            let done = (writer.shard_entries(), i);
            if done.0.len() == stop_after {
                // Leave the partial shard on disk under its temp name, plus a stray later shard.
                fs::write(dir.join("shard-00007.rdl"), b"left over").unwrap();
                std::mem::forget(writer);
                return done;
            }
        }
    }
    panic!("the records fill fewer than {stop_after} shards");
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_resumed_set_is_byte_identical_to_an_uninterrupted_one() {
    let whole = tempfile::tempdir().unwrap();
    write_set(whole.path(), &records(), SHARD_BYTES);

    let resumed = tempfile::tempdir().unwrap();
    let (done, next) = write_until(resumed.path(), 2);
    assert!(
        fs::read_dir(resumed.path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")),
        "the stopped writer should have left its partial shard"
    );
    // A file of the user's beside the set is not the writer's to delete.
    fs::write(resumed.path().join("notes.tmp"), b"mine").unwrap();
    let mut writer = SetWriter::resume(resumed.path(), options(), &done).unwrap();
    for (label, data) in &records()[next..] {
        writer.append(info(*label), data).unwrap();
    }
    writer.finish().unwrap();
    fs::remove_file(resumed.path().join("notes.tmp")).expect("notes.tmp was kept");

    assert!(ShardSet::open(whole.path()).unwrap().shards().len() > 3);
    assert_eq!(files(resumed.path()), files(whole.path()));
}

#[test]
fn resume_refuses_a_damaged_missing_or_foreign_shard_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (done, _) = write_until(dir.path(), 2);

    // Other options (another set name) than the shards were written with.
    let mut other = options();
    other.name = "val".into();
    let err = SetWriter::resume(dir.path(), other, &done).err().unwrap();
    assert!(err.to_string().contains("shard-00000.rdl"), "{err}");
    assert!(err.to_string().contains("other set options"), "{err}");

    // A line that does not match the file.
    let mut wrong = done.clone();
    wrong[1].records += 1;
    let err = SetWriter::resume(dir.path(), options(), &wrong)
        .err()
        .unwrap();
    assert!(err.to_string().contains("shard-00001.rdl"), "{err}");

    // A damaged shard.
    let path = dir.path().join("shard-00001.rdl");
    let mut data = fs::read(&path).unwrap();
    let last = data.len() - 2;
    data[last] ^= 1;
    fs::write(&path, &data).unwrap();
    let err = SetWriter::resume(dir.path(), options(), &done)
        .err()
        .unwrap();
    assert!(matches!(err, ShardError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("shard-00001.rdl"), "{err}");

    // A missing one.
    fs::remove_file(&path).unwrap();
    let err = SetWriter::resume(dir.path(), options(), &done)
        .err()
        .unwrap();
    assert!(err.to_string().contains("shard-00001.rdl"), "{err}");
    // Nothing was removed by the refused resumes: the first shard is still there.
    assert!(dir.path().join("shard-00000.rdl").exists());
}

//! `build.json` beside a set's shards: where its conversion stands, so a build that is killed
//! resumes from its last finished shard, and one that finished is not redone.
//!
//! The journal is written (atomically) when a build starts and each time a shard is finished,
//! and marked complete with the manifest. It names the build by a fingerprint of everything
//! that decides the shards' bytes — the set's options and the sorted input list with labels,
//! sizes and modification times — so only the same build continues a set; another one is
//! refused (`DataError::OtherBuild`, exit code 3 from `redline-data`) instead of mixing the two.

use std::fs;
use std::path::{Path, PathBuf};

use redline_shard::{SetOptions, ShardEntry, MANIFEST_FILE};
use serde::{Deserialize, Serialize};

use crate::DataError;

/// File name of the journal inside a set directory.
pub const JOURNAL_FILE: &str = "build.json";

/// File a build holds an exclusive lock on while it writes a set directory.
pub const LOCK_FILE: &str = "build.lock";

/// Takes the set directory `dir` for one build: an advisory lock on `dir/build.lock`, released
/// when the returned file is dropped or the process ends. A second build into the same folder
/// at the same time would delete the first one's unfinished shard; it is refused instead.
pub fn lock(dir: &Path) -> Result<fs::File, DataError> {
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| DataError::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(DataError::Invalid {
            path,
            what: "another build is writing this folder now".into(),
        }),
        Err(fs::TryLockError::Error(e)) => Err(DataError::io(&path, e)),
    }
}

/// What a build of one set has done so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Journal {
    /// Identifies the build (see [`fingerprint`]).
    pub fingerprint: String,
    /// Inputs the set is built from.
    pub inputs: u64,
    /// Inputs before this one are all in finished shards or skipped: a resumed build starts
    /// here.
    pub next_input: u64,
    /// Images in the finished shards.
    pub images: u64,
    /// Inputs before `next_input` that could not be converted, and why.
    pub skipped: Vec<Skipped>,
    /// The finished shards' manifest lines.
    pub shards: Vec<ShardEntry>,
    /// The manifest is written: the set is complete.
    pub complete: bool,
}

/// A file that was not converted, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub path: PathBuf,
    pub reason: String,
}

impl Journal {
    /// A build that has done nothing yet.
    pub fn start(fingerprint: String, inputs: u64) -> Self {
        Self {
            fingerprint,
            inputs,
            next_input: 0,
            images: 0,
            skipped: Vec::new(),
            shards: Vec::new(),
            complete: false,
        }
    }

    /// The journal in `dir`: `None` when there is none and nothing else of a set either. A
    /// directory holding a manifest or shards without a journal was not made by a resumable
    /// build, and is refused rather than overwritten.
    pub fn find(dir: &Path) -> Result<Option<Self>, DataError> {
        let path = dir.join(JOURNAL_FILE);
        match fs::read(&path) {
            Ok(text) => serde_json::from_slice(&text)
                .map(Some)
                .map_err(|e| DataError::Invalid {
                    path,
                    what: format!("not a build journal: {e}"),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let foreign = match fs::read_dir(dir) {
                    Ok(entries) => entries.flatten().find(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        name == MANIFEST_FILE || name.ends_with(".rdl")
                    }),
                    Err(_) => None,
                };
                match foreign {
                    Some(entry) => Err(DataError::OtherBuild {
                        path: entry.path(),
                        what: format!(
                            "this folder holds shards that no build journal ({JOURNAL_FILE}) \
                             describes"
                        ),
                    }),
                    None => Ok(None),
                }
            }
            Err(e) => Err(DataError::io(path, e)),
        }
    }

    /// Writes the journal into `dir` atomically (temp file, fsync, rename), so a kill leaves
    /// the previous journal or this one, never a torn file.
    pub fn write(&self, dir: &Path) -> Result<(), DataError> {
        let path = dir.join(JOURNAL_FILE);
        let mut json = serde_json::to_vec_pretty(self).map_err(|e| DataError::Invalid {
            path: path.clone(),
            what: format!("journal does not serialise: {e}"),
        })?;
        json.push(b'\n');
        Ok(redline_shard::write_durably(&path, &json)?)
    }
}

/// Identifies a build by what decides its shards' bytes: the set's options (name, classes,
/// parameters, shard size) and every input in order — its path, label, size and modification
/// time (one `stat` each, so a file replaced in place is noticed). Worker count and strictness
/// are left out: they do not change the shards.
pub fn fingerprint(options: &SetOptions, inputs: &[(PathBuf, i32)]) -> String {
    let described = serde_json::json!({
        "name": options.name,
        "schema": options.schema,
        "classes": options.classes,
        "params": options.params,
        "shard_bytes": options.shard_bytes,
    });
    let mut crc = crc32c::crc32c(described.to_string().as_bytes());
    for (path, label) in inputs {
        // An unreadable file counts as size 0, time 0: the build skips it with the reason.
        let (size, modified) = fs::metadata(path).map_or((0, 0), |m| {
            let since_epoch = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            (m.len(), since_epoch.map_or(0, |d| d.as_nanos()))
        });
        // A path never holds a NUL byte: it ends each one unambiguously.
        crc = crc32c::crc32c_append(crc, path.to_string_lossy().as_bytes());
        crc = crc32c::crc32c_append(crc, &[0]);
        crc = crc32c::crc32c_append(crc, &label.to_le_bytes());
        crc = crc32c::crc32c_append(crc, &size.to_le_bytes());
        crc = crc32c::crc32c_append(crc, &modified.to_le_bytes());
    }
    format!("crc32c:{crc:08x}")
}

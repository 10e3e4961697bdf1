//! Errors. Every one names the file, and the record where one is involved.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Anything that can go wrong reading or writing shards.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The operating system refused a read, write, map or rename.
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// The bytes on disk break the format (FORMAT.md); `record` says which record, when one.
    #[error("{}: {}{what}", path.display(), RecordPrefix(*record))]
    Corrupt {
        path: PathBuf,
        record: Option<u64>,
        what: String,
    },
    /// The manifest disagrees with itself or with a shard it lists.
    #[error("{}: manifest: {what}", path.display())]
    Manifest { path: PathBuf, what: String },
    /// A record index past the end.
    #[error("{}: record {index} is out of range ({len} records)", path.display())]
    OutOfRange { path: PathBuf, index: u64, len: u64 },
    /// The caller asked the writer for something the format cannot hold.
    #[error("{}: {what}", path.display())]
    InvalidInput { path: PathBuf, what: String },
}

impl ShardError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.into(),
            record: None,
            what: what.into(),
        }
    }

    pub(crate) fn record(path: impl Into<PathBuf>, record: u64, what: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.into(),
            record: Some(record),
            what: what.into(),
        }
    }

    /// The record the error is about, if any.
    pub fn record_index(&self) -> Option<u64> {
        match self {
            Self::Corrupt { record, .. } => *record,
            Self::OutOfRange { index, .. } => Some(*index),
            _ => None,
        }
    }
}

struct RecordPrefix(Option<u64>);

impl fmt::Display for RecordPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(record) => write!(f, "record {record}: "),
            None => Ok(()),
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = ShardError> = std::result::Result<T, E>;

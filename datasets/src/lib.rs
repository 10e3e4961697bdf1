//! Dataset recipes for redline, and the `redline-data` tool behind `cargo xtask shards …`.
//!
//! * [`synth`] — the embedded default dataset: ImageNet-like JPEGs whose class needs a CNN.
//! * [`generate`] — writes the synthetic set as shards (`train/` + `val/`) or as an ImageFolder tree.
//! * [`val_labels`] — labels of ImageNet's flat validation folder (Kaggle's CSV, the devkit's
//!   ground truth).
//! * [`convert`] — converts ImageFolder trees to shard sets on every core, optionally resizing and
//!   re-encoding, skipping (and reporting) unreadable files; resumable after a kill.
//! * [`journal`] — `build.json`, where a set's conversion stands.
//!
//! Nothing here is needed to *read* shards: that is `redline-shard` alone.

pub mod convert;
pub mod generate;
pub mod journal;
mod parallel;
mod progress;
mod rng;
pub mod synth;
pub mod val_labels;

use std::path::PathBuf;

pub use parallel::{all_cores, ordered_map};

/// What can go wrong making a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Shard(#[from] redline_shard::ShardError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {what}", path.display())]
    Invalid { path: PathBuf, what: String },
    /// The output folder holds another build's set (other inputs or options): it is left alone.
    #[error("{}: {what}; remove it or choose another --out", path.display())]
    OtherBuild { path: PathBuf, what: String },
    /// `--strict` was given and a file could not be used.
    #[error("{}: {reason} (--strict stops at the first unusable file)", path.display())]
    Strict { path: PathBuf, reason: String },
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

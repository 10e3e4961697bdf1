//! Checksummed, memory-mapped dataset shards.
//!
//! The format (see `FORMAT.md` beside this crate, complete enough for an independent reader) is
//! FFCV-class — records in a page-aligned region of a memory-mapped file, found through a
//! fixed-stride index — but safe: a magic and version, u64 offsets, zero padding, a CRC32C per
//! record and one over header, index and metadata, and a manifest that pins every shard of a set.
//!
//! * [`ShardWriter`] / [`SetWriter`] stream records to disk with bounded memory and publish files
//!   atomically (temp file, fsync, rename).
//! * [`ShardReader`] / [`ShardSet`] map files, validate them when opened, and hand out records
//!   zero-copy with O(1) random access; record CRCs are checked per read or in a
//!   [`verify`](ShardSet::verify) pass, as the caller chooses.
//!
//! Bad bytes never panic: every [`ShardError`] names the shard file, the record where one is
//! involved, and what was wrong.
//!
//! ```
//! use redline_shard::{RecordInfo, SetOptions, SetWriter, ShardSet, Encoding};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let mut writer = SetWriter::create(dir.path(), SetOptions::images("train", vec!["a".into(), "b".into()]))?;
//! writer.append(RecordInfo { label: 1, width: 0, height: 0, encoding: Encoding::Other }, b"hello")?;
//! writer.finish()?;
//!
//! let set = ShardSet::open(dir.path())?;
//! let record = set.record(0)?;
//! assert_eq!((record.bytes, record.label), (&b"hello"[..], 1));
//! # Ok(()) }
//! ```

mod error;
pub mod format;
#[doc(hidden)]
pub mod fuzz;
mod manifest;
mod reader;
mod set;
mod writer;

pub use error::{Result, ShardError};
pub use format::{Encoding, IndexEntry, Metadata, ShardInfo, IMAGE_SCHEMA};
pub use manifest::{Manifest, ShardEntry, MANIFEST_FILE};
pub use reader::{Access, OpenOptions, Record, ShardReader, VerifyReport};
pub use set::ShardSet;
pub use writer::{write_durably, RecordInfo, SetOptions, SetWriter, ShardSummary, ShardWriter};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

//! `manifest.json`: the list of shards in a set, with the counts and checksums that pin them.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::format::VERSION;
use crate::writer::write_durably;
use crate::{Result, ShardError};

/// File name of the manifest inside a shard-set directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest's `format` value.
pub const MANIFEST_FORMAT: &str = "redline-shard";

/// A shard set's manifest (FORMAT.md, "Manifest").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub schema: String,
    pub classes: Vec<String>,
    /// Records in all shards.
    pub records: u64,
    /// Bytes of all shard files.
    pub bytes: u64,
    pub shards: Vec<ShardEntry>,
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
}

/// One shard's line in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the set directory.
    pub file: String,
    pub records: u64,
    pub bytes: u64,
    pub table_crc32c: u32,
}

impl Manifest {
    /// A manifest over `shards`, with the totals filled in.
    pub fn new(
        schema: &str,
        classes: Vec<String>,
        shards: Vec<ShardEntry>,
        params: serde_json::Map<String, serde_json::Value>,
    ) -> Self {
        Self {
            format: MANIFEST_FORMAT.into(),
            version: VERSION,
            schema: schema.into(),
            classes,
            records: shards.iter().map(|s| s.records).sum(),
            bytes: shards.iter().map(|s| s.bytes).sum(),
            shards,
            params,
        }
    }

    /// Reads and checks a manifest (its own consistency; the shards are checked when opened).
    pub fn read(path: &Path) -> Result<Self> {
        let text = fs::read(path).map_err(|e| ShardError::io(path, e))?;
        let bad = |what: String| ShardError::Manifest {
            path: path.to_path_buf(),
            what,
        };
        let manifest: Self =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if manifest.format != MANIFEST_FORMAT || manifest.version != VERSION {
            return Err(bad(format!(
                "format {:?} version {} is not {MANIFEST_FORMAT:?} version {VERSION}",
                manifest.format, manifest.version
            )));
        }
        for shard in &manifest.shards {
            let plain = !shard.file.is_empty()
                && !shard.file.contains(['/', '\\'])
                && shard.file != "."
                && shard.file != "..";
            if !plain {
                return Err(bad(format!(
                    "shard file {:?} is not a plain file name",
                    shard.file
                )));
            }
        }
        let records = manifest
            .shards
            .iter()
            .try_fold(0u64, |n, s| n.checked_add(s.records));
        let bytes = manifest
            .shards
            .iter()
            .try_fold(0u64, |n, s| n.checked_add(s.bytes));
        if records != Some(manifest.records) || bytes != Some(manifest.bytes) {
            return Err(bad(format!(
                "totals say {} records / {} bytes but the shards add up to {records:?} / {bytes:?}",
                manifest.records, manifest.bytes
            )));
        }
        Ok(manifest)
    }

    /// Writes the manifest atomically (temp file, fsync, rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut json = serde_json::to_vec_pretty(self).map_err(|e| ShardError::InvalidInput {
            path: path.to_path_buf(),
            what: format!("manifest does not serialise: {e}"),
        })?;
        json.push(b'\n');
        write_durably(path, &json)
    }
}

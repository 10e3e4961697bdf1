//! A whole shard set: the manifest plus every shard, addressed by one global record index.

use std::path::{Path, PathBuf};

use crate::manifest::{Manifest, ShardEntry, MANIFEST_FILE};
use crate::reader::{Access, OpenOptions, Record, ShardReader, VerifyReport};
use crate::{Result, ShardError};

/// How `shard` differs from its manifest line `entry` (and the set's classes and schema), as a
/// sentence naming both; `None` when it is the shard the line describes.
pub(crate) fn entry_mismatch(
    shard: &ShardReader,
    entry: &ShardEntry,
    classes: &[String],
    schema: &str,
) -> Option<String> {
    let header = shard.header();
    let found = if shard.len() != entry.records {
        format!("{} records", shard.len())
    } else if shard.file_len() != entry.bytes {
        format!("{} bytes", shard.file_len())
    } else if header.table_crc32c != entry.table_crc32c {
        format!("table CRC32C {:#010x}", header.table_crc32c)
    } else if shard.metadata().classes != classes {
        "different classes".to_string()
    } else if shard.metadata().schema != schema {
        format!("schema {:?}", shard.metadata().schema)
    } else {
        return None;
    };
    Some(format!(
        "shard {} has {found}, not what the manifest lists ({} records, {} bytes, table CRC32C {:#010x})",
        entry.file, entry.records, entry.bytes, entry.table_crc32c
    ))
}

/// An open shard set. Record `g` (global index) is found in O(1): see [`ShardSet::locate`].
pub struct ShardSet {
    dir: PathBuf,
    manifest: Manifest,
    shards: Vec<ShardReader>,
    /// Global index of each shard's first record, plus the total at the end.
    starts: Vec<u64>,
    /// `block_shard[g >> block_shift]` is the shard holding record `(g >> block_shift) << block_shift`.
    block_shard: Vec<u32>,
    block_shift: u32,
}

impl ShardSet {
    /// Opens the set in `dir` with default options.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(dir, OpenOptions::default())
    }

    /// Opens `dir/manifest.json` and every shard it lists, checking each shard against it.
    pub fn open_with(dir: impl AsRef<Path>, options: OpenOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest = Manifest::read(&manifest_path)?;
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut starts = vec![0u64];
        for entry in &manifest.shards {
            let shard = ShardReader::open_with(dir.join(&entry.file), options)?;
            let mismatch = entry_mismatch(&shard, entry, &manifest.classes, &manifest.schema);
            if let Some(what) = mismatch {
                return Err(ShardError::Manifest {
                    path: manifest_path,
                    what,
                });
            }
            starts.push(starts[starts.len() - 1] + shard.len());
            shards.push(shard);
        }
        let (block_shard, block_shift) = block_table(&starts);
        Ok(Self {
            dir,
            manifest,
            shards,
            starts,
            block_shard,
            block_shift,
        })
    }

    /// The set's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Class names.
    pub fn classes(&self) -> &[String] {
        &self.manifest.classes
    }

    /// Records in all shards.
    pub fn len(&self) -> u64 {
        self.starts[self.starts.len() - 1]
    }

    /// Whether the set holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards, in manifest order.
    pub fn shards(&self) -> &[ShardReader] {
        &self.shards
    }

    /// Which shard holds global record `global`, and its index there. O(1): one table lookup
    /// and at most one step, because a block never spans more than two shards.
    pub fn locate(&self, global: u64) -> Result<(usize, u64)> {
        if global >= self.len() {
            return Err(ShardError::OutOfRange {
                path: self.dir.join(MANIFEST_FILE),
                index: global,
                len: self.len(),
            });
        }
        let mut shard = self.block_shard[(global >> self.block_shift) as usize] as usize;
        while self.starts[shard + 1] <= global {
            shard += 1;
        }
        Ok((shard, global - self.starts[shard]))
    }

    /// Global record `global`.
    pub fn record(&self, global: u64) -> Result<Record<'_>> {
        let (shard, local) = self.locate(global)?;
        self.shards[shard].record(local)
    }

    /// Hints the kernel to read global record `global` ahead of use.
    pub fn prefetch(&self, global: u64) {
        if let Ok((shard, local)) = self.locate(global) {
            self.shards[shard].prefetch(local);
        }
    }

    /// Changes the read-ahead hint on every shard.
    pub fn advise(&self, access: Access) {
        self.shards.iter().for_each(|s| s.advise(access));
    }

    /// Every record in order.
    pub fn records(&self) -> impl Iterator<Item = Result<Record<'_>>> + '_ {
        self.shards.iter().flat_map(|s| s.records())
    }

    /// Verifies every shard (record CRCs, zero padding).
    pub fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        for shard in &self.shards {
            report += shard.verify()?;
        }
        Ok(report)
    }
}

/// Builds the O(1) lookup table: blocks of `2^shift` records, where `2^shift` is no larger than
/// any non-empty shard except possibly the last, so each block starts in the shard the table
/// names and can only run into the next one.
fn block_table(starts: &[u64]) -> (Vec<u32>, u32) {
    let total = starts[starts.len() - 1];
    let sizes = starts.windows(2).map(|w| w[1] - w[0]);
    let interior = sizes.clone().take(starts.len().saturating_sub(2));
    let smallest = interior.filter(|&n| n > 0).min().unwrap_or(total.max(1));
    let shift = 63 - smallest.max(1).leading_zeros();
    let blocks = total.div_ceil(1 << shift) as usize;
    let mut table = Vec::with_capacity(blocks);
    let mut shard = 0usize;
    for block in 0..blocks as u64 {
        let first = block << shift;
        while starts[shard + 1] <= first {
            shard += 1;
        }
        table.push(shard as u32);
    }
    (table, shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locate_slow(starts: &[u64], g: u64) -> usize {
        starts
            .windows(2)
            .position(|w| w[0] <= g && g < w[1])
            .unwrap()
    }

    #[test]
    fn block_table_finds_every_record() {
        for sizes in [
            vec![5u64],
            vec![3, 3, 1],
            vec![7, 0, 2, 9, 1],
            vec![1, 1, 1, 1],
            vec![100, 37, 64, 5],
            vec![0, 0, 4],
        ] {
            let mut starts = vec![0];
            for s in &sizes {
                starts.push(starts.last().unwrap() + s);
            }
            let (table, shift) = block_table(&starts);
            for g in 0..*starts.last().unwrap() {
                let mut shard = table[(g >> shift) as usize] as usize;
                let mut steps = 0;
                while starts[shard + 1] <= g {
                    shard += 1;
                    steps += 1;
                }
                assert_eq!(shard, locate_slow(&starts, g), "sizes {sizes:?} g {g}");
                // Empty shards aside, one step at most.
                assert!(steps <= 1 + sizes.iter().filter(|&&n| n == 0).count());
            }
        }
    }
}

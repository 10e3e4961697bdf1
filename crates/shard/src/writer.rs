//! Streaming, atomic shard writing: one file ([`ShardWriter`]) or a whole set ([`SetWriter`]).

use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::format::{
    align_up, place_record, Encoding, Header, IndexEntry, Metadata, ShardInfo, INDEX_STRIDE,
    PAGE_SIZE, TABLE_CRC_OFFSET,
};
use crate::manifest::{Manifest, ShardEntry, MANIFEST_FILE};
use crate::reader::ShardReader;
use crate::set::entry_mismatch;
use crate::{Result, ShardError};

/// What the index says about a record besides its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordInfo {
    /// Class index, or -1 for none.
    pub label: i32,
    /// Pixels; 0 when unknown. Sizes above 65535 are stored as 0.
    pub width: u32,
    pub height: u32,
    pub encoding: Encoding,
}

impl RecordInfo {
    /// A labelled image whose encoding is sniffed from its bytes.
    pub fn image(label: i32, width: u32, height: u32, bytes: &[u8]) -> Self {
        Self {
            label,
            width,
            height,
            encoding: Encoding::sniff(bytes),
        }
    }
}

/// What a finished shard looks like; also its line in the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSummary {
    pub path: PathBuf,
    pub records: u64,
    pub bytes: u64,
    pub table_crc32c: u32,
}

/// Writes one shard file with bounded memory: record bytes go straight to disk; only the
/// 32-byte index entries are kept until [`finish`](Self::finish).
///
/// The file appears under its name only when `finish` succeeds (temp file, fsync, rename); a
/// writer dropped before that removes its temp file.
pub struct ShardWriter {
    path: PathBuf,
    tmp_path: PathBuf,
    file: Option<BufWriter<File>>,
    metadata: Metadata,
    pos: u64,
    entries: Vec<IndexEntry>,
}

impl ShardWriter {
    /// Starts `path` (written as `path.tmp` until finished).
    pub fn create(path: impl Into<PathBuf>, metadata: Metadata) -> Result<Self> {
        let path = path.into();
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(".tmp");
        let tmp_path = path.with_file_name(tmp_name);
        let file = File::create(&tmp_path).map_err(|e| ShardError::io(&tmp_path, e))?;
        let mut writer = Self {
            path,
            tmp_path,
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            metadata,
            pos: 0,
            entries: Vec::new(),
        };
        // The header is written last; reserve its page with zeros now.
        writer.write_zeros(PAGE_SIZE)?;
        Ok(writer)
    }

    /// Appends a record; returns its index in this shard.
    pub fn append(&mut self, info: RecordInfo, bytes: &[u8]) -> Result<u64> {
        let length = u32::try_from(bytes.len()).map_err(|_| ShardError::InvalidInput {
            path: self.path.clone(),
            what: format!("record of {} bytes exceeds the 4 GiB limit", bytes.len()),
        })?;
        let classes = self.metadata.classes.len();
        if info.label < -1 || (classes > 0 && info.label as i64 >= classes as i64) {
            return Err(ShardError::InvalidInput {
                path: self.path.clone(),
                what: format!(
                    "label {} is not -1 or a class index below {classes}",
                    info.label
                ),
            });
        }
        let offset = place_record(self.pos, length as u64, PAGE_SIZE);
        self.write_zeros(offset - self.pos)?;
        self.write(bytes)?;
        self.entries.push(IndexEntry {
            offset,
            length,
            crc32c: crc32c::crc32c(bytes),
            label: info.label,
            width: u16::try_from(info.width).unwrap_or(0),
            height: u16::try_from(info.height).unwrap_or(0),
            encoding: info.encoding,
        });
        Ok(self.entries.len() as u64 - 1)
    }

    /// Records appended so far.
    pub fn len(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Whether no record was appended yet.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The file size if it were finished now, give or take the metadata and final padding.
    pub fn size_estimate(&self) -> u64 {
        self.pos + PAGE_SIZE + (self.entries.len() * INDEX_STRIDE) as u64
    }

    /// Writes index, metadata and header, fsyncs, and renames the file into place.
    pub fn finish(mut self) -> Result<ShardSummary> {
        let records_end = self.pos;
        let index_offset = align_up(records_end, PAGE_SIZE).unwrap_or(records_end);
        self.write_zeros(index_offset - records_end)?;
        let index: Vec<u8> = self.entries.iter().flat_map(|e| e.encode()).collect();
        let metadata =
            serde_json::to_vec(&self.metadata).map_err(|e| ShardError::InvalidInput {
                path: self.path.clone(),
                what: format!("metadata does not serialise: {e}"),
            })?;
        self.write(&index)?;
        self.write(&metadata)?;
        let mut header = Header {
            page_size: PAGE_SIZE as u32,
            record_count: self.entries.len() as u64,
            records_offset: PAGE_SIZE,
            records_end,
            index_offset,
            metadata_offset: index_offset + index.len() as u64,
            metadata_length: metadata.len() as u64,
            table_crc32c: 0,
        };
        let head = header.encode();
        let crc = crc32c::crc32c(&head[..TABLE_CRC_OFFSET]);
        let crc = crc32c::crc32c_append(crc, &index);
        header.table_crc32c = crc32c::crc32c_append(crc, &metadata);

        let tmp = self.tmp_path.clone();
        let io = |e| ShardError::io(&tmp, e);
        let mut file = self
            .file
            .take()
            .ok_or_else(|| ShardError::io(&tmp, std::io::ErrorKind::BrokenPipe.into()))?
            .into_inner()
            .map_err(|e| io(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header.encode()).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        rename_durably(&self.tmp_path, &self.path)?;
        Ok(ShardSummary {
            path: self.path.clone(),
            records: header.record_count,
            bytes: header.metadata_offset + header.metadata_length,
            table_crc32c: header.table_crc32c,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| ShardError::io(&self.tmp_path, std::io::ErrorKind::BrokenPipe.into()))?;
        file.write_all(bytes)
            .map_err(|e| ShardError::io(&self.tmp_path, e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn write_zeros(&mut self, mut n: u64) -> Result<()> {
        const ZEROS: [u8; PAGE_SIZE as usize] = [0; PAGE_SIZE as usize];
        while n > 0 {
            let chunk = n.min(PAGE_SIZE) as usize;
            self.write(&ZEROS[..chunk])?;
            n -= chunk as u64;
        }
        Ok(())
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // Unfinished, or finishing failed: leave nothing half-written behind. After a successful
        // finish the temp name no longer exists and this does nothing.
        let _ = fs::remove_file(&self.tmp_path);
    }
}

/// The file name of shard `ordinal` in a set.
fn shard_file_name(ordinal: u64) -> String {
    format!("shard-{ordinal:05}.rdl")
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one, never a torn
/// one: a temp file beside it (`NAME.tmp`), fsync, rename, fsync of the directory.
pub fn write_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let mut file = File::create(&tmp).map_err(|e| ShardError::io(&tmp, e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| ShardError::io(&tmp, e))?;
    drop(file);
    rename_durably(&tmp, path)
}

/// Renames `from` to `to` and fsyncs the directory so the rename itself survives a crash.
pub(crate) fn rename_durably(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|e| ShardError::io(to, e))?;
    if let Some(dir) = to.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Directories cannot be opened for fsync on every platform; best effort there.
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(())
}

/// Options of a shard set.
#[derive(Debug, Clone)]
pub struct SetOptions {
    /// The set's name ("train", "val"): recorded in each shard's metadata.
    pub name: String,
    pub schema: String,
    pub classes: Vec<String>,
    /// How the set was made, copied into every shard and the manifest.
    pub params: serde_json::Map<String, serde_json::Value>,
    /// A new shard starts when the current one would grow past this many bytes.
    pub shard_bytes: u64,
}

impl SetOptions {
    /// An image-classification set with the default shard size (256 MiB).
    pub fn images(name: &str, classes: Vec<String>) -> Self {
        Self {
            name: name.into(),
            schema: crate::format::IMAGE_SCHEMA.into(),
            classes,
            params: Default::default(),
            shard_bytes: 256 << 20,
        }
    }
}

/// Writes a shard set: records are split into shards of about `shard_bytes`, and
/// `manifest.json` is written (atomically) last, so a set with a manifest is complete.
pub struct SetWriter {
    dir: PathBuf,
    options: SetOptions,
    current: Option<ShardWriter>,
    finished: Vec<ShardSummary>,
}

impl SetWriter {
    /// Starts a set in `dir` (created if missing).
    pub fn create(dir: impl Into<PathBuf>, options: SetOptions) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| ShardError::io(&dir, e))?;
        Ok(Self {
            dir,
            options,
            current: None,
            finished: Vec::new(),
        })
    }

    /// Appends a record to the current shard, starting a new shard first if it is full.
    pub fn append(&mut self, info: RecordInfo, bytes: &[u8]) -> Result<()> {
        let full = self.current.as_ref().is_some_and(|w| {
            !w.is_empty() && w.size_estimate() + bytes.len() as u64 > self.options.shard_bytes
        });
        if full {
            self.finish_current()?;
        }
        let writer = match &mut self.current {
            Some(writer) => writer,
            None => self.current.insert(self.start_shard()?),
        };
        writer.append(info, bytes).map(|_| ())
    }

    /// Continues a set whose first shards an earlier writer finished before it stopped (a build
    /// that was killed): `done` are those shards' manifest lines, in order, as
    /// [`shard_entries`](Self::shard_entries) returned them. Each is opened and checked against
    /// its line and against the metadata `options` give it; shard files after them (finished or
    /// temporary) and a stale manifest are removed, and nothing else. Appending the records that followed the last
    /// finished shard then writes the same set, byte for byte, as a writer that never stopped.
    pub fn resume(
        dir: impl Into<PathBuf>,
        options: SetOptions,
        done: &[ShardEntry],
    ) -> Result<Self> {
        let dir = dir.into();
        let mut writer = Self {
            dir,
            options,
            current: None,
            finished: Vec::with_capacity(done.len()),
        };
        for (ordinal, entry) in done.iter().enumerate() {
            let path = writer.dir.join(&entry.file);
            let bad = |what: String| ShardError::InvalidInput {
                path: path.clone(),
                what: format!("cannot resume the set: {what}"),
            };
            if entry.file != shard_file_name(ordinal as u64) {
                return Err(bad(format!(
                    "shard {ordinal} is not named {}",
                    shard_file_name(ordinal as u64)
                )));
            }
            let shard = ShardReader::open(&path)?;
            let expected = writer.shard_metadata(ordinal as u64);
            if let Some(what) = entry_mismatch(&shard, entry, &expected.classes, &expected.schema) {
                return Err(bad(what));
            }
            if *shard.metadata() != expected {
                return Err(bad(
                    "the shard was written with other set options (name, parameters or ordinal)"
                        .into(),
                ));
            }
            writer.finished.push(ShardSummary {
                path,
                records: entry.records,
                bytes: entry.bytes,
                table_crc32c: entry.table_crc32c,
            });
        }
        writer.remove_unfinished()?;
        Ok(writer)
    }

    /// Removes what a stopped writer may have left after its last finished shard.
    fn remove_unfinished(&self) -> Result<()> {
        let dir = &self.dir;
        for entry in fs::read_dir(dir).map_err(|e| ShardError::io(dir, e))? {
            let entry = entry.map_err(|e| ShardError::io(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            // Only this writer's own files: later shards, their temp files, the manifest and
            // its temp file. Anything else in the folder is not ours to delete.
            let shard_name = name.strip_suffix(".tmp").unwrap_or(&name);
            let later_shard = shard_name
                .strip_prefix("shard-")
                .and_then(|n| n.strip_suffix(".rdl"))
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n >= self.finished.len() as u64);
            let manifest = shard_name == MANIFEST_FILE;
            if later_shard || manifest {
                let path = entry.path();
                fs::remove_file(&path).map_err(|e| ShardError::io(&path, e))?;
            }
        }
        Ok(())
    }

    /// How many shards are finished; it grows when an append starts a new shard, so everything
    /// appended before that record is in finished shards.
    pub fn shards_finished(&self) -> usize {
        self.finished.len()
    }

    /// The manifest lines of the shards finished so far. A caller that records them (with where
    /// its input stood) can [`resume`](Self::resume) after being stopped.
    pub fn shard_entries(&self) -> Vec<ShardEntry> {
        self.finished
            .iter()
            .map(|s| ShardEntry {
                file: s
                    .path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                records: s.records,
                bytes: s.bytes,
                table_crc32c: s.table_crc32c,
            })
            .collect()
    }

    fn shard_metadata(&self, ordinal: u64) -> Metadata {
        let mut metadata = Metadata::images(self.options.classes.clone());
        metadata.schema = self.options.schema.clone();
        metadata.params = self.options.params.clone();
        metadata.shard = Some(ShardInfo {
            set: self.options.name.clone(),
            ordinal,
        });
        metadata
    }

    fn start_shard(&self) -> Result<ShardWriter> {
        let ordinal = self.finished.len() as u64;
        ShardWriter::create(
            self.dir.join(shard_file_name(ordinal)),
            self.shard_metadata(ordinal),
        )
    }

    /// Finishes the last shard and writes the manifest.
    pub fn finish(mut self) -> Result<Manifest> {
        self.finish_current()?;
        let shards = self.shard_entries();
        let manifest = Manifest::new(
            &self.options.schema,
            self.options.classes.clone(),
            shards,
            self.options.params.clone(),
        );
        manifest.write(&self.dir.join(MANIFEST_FILE))?;
        Ok(manifest)
    }

    fn finish_current(&mut self) -> Result<()> {
        if let Some(writer) = self.current.take() {
            self.finished.push(writer.finish()?);
        }
        Ok(())
    }
}

//! Reading one shard file: validated at open, zero-copy records, optional CRC per read.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::format::{
    placement_ok, Encoding, Header, IndexEntry, Metadata, HEADER_SIZE, INDEX_STRIDE,
    TABLE_CRC_OFFSET,
};
use crate::{Result, ShardError};

/// How records will be read; passed to the kernel as an `madvise` hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Shuffled training reads: no read-ahead beyond the record.
    #[default]
    Random,
    /// Scans: aggressive read-ahead.
    Sequential,
}

/// How a shard is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    /// Check each record's CRC32C when it is read (cheap next to decoding an image). Off, records
    /// are trusted after the open-time checks, and [`ShardReader::verify`] checks them all at once.
    pub verify_reads: bool,
    pub access: Access,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            verify_reads: true,
            access: Access::Random,
        }
    }
}

/// One record, borrowed straight from the mapped file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// The shard file it lives in (for error messages).
    pub shard: &'a Path,
    /// Its index within that shard.
    pub index: u64,
    pub bytes: &'a [u8],
    pub label: i32,
    pub width: u16,
    pub height: u16,
    pub encoding: Encoding,
}

/// What a [`ShardReader::verify`] pass checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub records: u64,
    /// Record bytes whose CRC32C was checked.
    pub record_bytes: u64,
    /// Padding bytes checked to be zero.
    pub padding_bytes: u64,
}

impl std::ops::AddAssign for VerifyReport {
    fn add_assign(&mut self, other: Self) {
        self.records += other.records;
        self.record_bytes += other.record_bytes;
        self.padding_bytes += other.padding_bytes;
    }
}

enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

/// A validated shard file. Opening checks the header, the table CRC, the metadata and every
/// index entry, so afterwards any record can be read in O(1) without further bounds surprises.
pub struct ShardReader {
    path: PathBuf,
    data: Backing,
    header: Header,
    metadata: Metadata,
    verify_reads: bool,
}

impl ShardReader {
    /// Maps and validates `path` with default options (CRC checked on every read).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, OpenOptions::default())
    }

    /// Maps and validates `path`.
    pub fn open_with(path: impl AsRef<Path>, options: OpenOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| ShardError::io(path, e))?;
        let len = file.metadata().map_err(|e| ShardError::io(path, e))?.len();
        if len < HEADER_SIZE as u64 {
            return Err(ShardError::corrupt(
                path,
                format!("file is {len} bytes, shorter than the {HEADER_SIZE}-byte header"),
            ));
        }
        // SAFETY: the mapping is read-only. Like every mmap-based reader we rely on shard files
        // not being modified while open; the format's CRCs catch the damage if they are.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ShardError::io(path, e))?;
        let reader = Self::validate(path.to_path_buf(), Backing::Mapped(map), options)?;
        reader.advise(options.access);
        Ok(reader)
    }

    /// Validates a shard held in memory; `name` appears in errors. Used by tests and fuzzing.
    pub fn from_bytes(
        name: impl Into<PathBuf>,
        bytes: Vec<u8>,
        options: OpenOptions,
    ) -> Result<Self> {
        Self::validate(name.into(), Backing::Owned(bytes), options)
    }

    fn validate(path: PathBuf, data: Backing, options: OpenOptions) -> Result<Self> {
        let bytes: &[u8] = match &data {
            Backing::Mapped(map) => map,
            Backing::Owned(vec) => vec,
        };
        let header =
            Header::decode(bytes, bytes.len() as u64).map_err(|w| ShardError::corrupt(&path, w))?;
        let index = &bytes[header.index_range()];
        let metadata_bytes = &bytes[header.metadata_range()];
        let crc = crc32c::crc32c(&bytes[..TABLE_CRC_OFFSET]);
        let crc = crc32c::crc32c_append(crc, index);
        let crc = crc32c::crc32c_append(crc, metadata_bytes);
        if crc != header.table_crc32c {
            return Err(ShardError::corrupt(
                &path,
                format!(
                    "table CRC32C mismatch (header, index or metadata damaged): stored {:#010x}, computed {crc:#010x}",
                    header.table_crc32c
                ),
            ));
        }
        let metadata: Metadata = serde_json::from_slice(metadata_bytes)
            .map_err(|e| ShardError::corrupt(&path, format!("metadata is not valid: {e}")))?;
        let page = header.page_size as u64;
        let classes = metadata.classes.len() as i64;
        let mut previous_end = header.records_offset;
        for (i, raw) in index.chunks_exact(INDEX_STRIDE).enumerate() {
            let i = i as u64;
            let e = IndexEntry::decode(raw).map_err(|w| ShardError::record(&path, i, w))?;
            let bad = |what: String| ShardError::record(&path, i, what);
            if e.offset < previous_end || e.end() > header.records_end {
                return Err(bad(format!(
                    "bytes {}..{} are outside {previous_end}..{} (out of bounds or overlapping the previous record)",
                    e.offset,
                    e.end(),
                    header.records_end
                )));
            }
            if !placement_ok(e.offset, e.length as u64, page) {
                return Err(bad(format!(
                    "{} bytes at offset {} straddle a page boundary",
                    e.length, e.offset
                )));
            }
            if classes > 0 && e.label as i64 >= classes {
                return Err(bad(format!(
                    "label {} but the metadata has {classes} classes",
                    e.label
                )));
            }
            previous_end = e.end();
        }
        if previous_end != header.records_end {
            return Err(ShardError::corrupt(
                &path,
                format!(
                    "header records_end {} is not where the last record ends ({previous_end})",
                    header.records_end
                ),
            ));
        }
        Ok(Self {
            path,
            data,
            header,
            metadata,
            verify_reads: options.verify_reads,
        })
    }

    fn bytes(&self) -> &[u8] {
        match &self.data {
            Backing::Mapped(map) => map,
            Backing::Owned(vec) => vec,
        }
    }

    /// The shard's file name (or the name given to [`from_bytes`](Self::from_bytes)).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of records.
    pub fn len(&self) -> u64 {
        self.header.record_count
    }

    /// Whether the shard holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard's metadata block.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The decoded header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// File length in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// The index entry of record `index`.
    pub fn entry(&self, index: u64) -> Result<IndexEntry> {
        if index >= self.len() {
            return Err(ShardError::OutOfRange {
                path: self.path.clone(),
                index,
                len: self.len(),
            });
        }
        let at = self.header.index_offset as usize + index as usize * INDEX_STRIDE;
        IndexEntry::decode(&self.bytes()[at..at + INDEX_STRIDE])
            .map_err(|w| ShardError::record(&self.path, index, w))
    }

    /// Record `index`, zero-copy; its CRC is checked when the reader was opened with
    /// `verify_reads`.
    pub fn record(&self, index: u64) -> Result<Record<'_>> {
        self.read(index, self.verify_reads)
    }

    /// Record `index` with its CRC checked, whatever the open options.
    pub fn record_verified(&self, index: u64) -> Result<Record<'_>> {
        self.read(index, true)
    }

    fn read(&self, index: u64, check: bool) -> Result<Record<'_>> {
        let e = self.entry(index)?;
        let bytes = &self.bytes()[e.offset as usize..e.end() as usize];
        if check {
            let crc = crc32c::crc32c(bytes);
            if crc != e.crc32c {
                return Err(ShardError::record(
                    &self.path,
                    index,
                    format!(
                        "CRC32C mismatch over bytes {}..{}: stored {:#010x}, computed {crc:#010x}",
                        e.offset,
                        e.end(),
                        e.crc32c
                    ),
                ));
            }
        }
        Ok(Record {
            shard: &self.path,
            index,
            bytes,
            label: e.label,
            width: e.width,
            height: e.height,
            encoding: e.encoding,
        })
    }

    /// Every record in order.
    pub fn records(&self) -> impl Iterator<Item = Result<Record<'_>>> + '_ {
        (0..self.len()).map(|i| self.record(i))
    }

    /// Checks every record's CRC and that every padding byte is zero.
    pub fn verify(&self) -> Result<VerifyReport> {
        let bytes = self.bytes();
        let mut report = VerifyReport::default();
        let mut check_zero = |from: u64, to: u64, after: Option<u64>| {
            let gap = &bytes[from as usize..to as usize];
            report.padding_bytes += gap.len() as u64;
            match gap.iter().position(|&b| b != 0) {
                None => Ok(()),
                Some(at) => {
                    let what = format!("non-zero padding byte at offset {}", from + at as u64);
                    Err(match after {
                        Some(record) => {
                            ShardError::record(&self.path, record, what + " (after this record)")
                        }
                        None => ShardError::corrupt(&self.path, what),
                    })
                }
            }
        };
        check_zero(HEADER_SIZE as u64, self.header.records_offset, None)?;
        let mut previous_end = self.header.records_offset;
        let mut previous = None;
        for i in 0..self.len() {
            let e = self.entry(i)?;
            check_zero(previous_end, e.offset, previous)?;
            self.record_verified(i)?;
            report.records += 1;
            report.record_bytes += e.length as u64;
            previous_end = e.end();
            previous = Some(i);
        }
        check_zero(previous_end, self.header.index_offset, previous)?;
        Ok(report)
    }

    /// Tells the kernel how the file will be read.
    pub fn advise(&self, access: Access) {
        #[cfg(unix)]
        if let Backing::Mapped(map) = &self.data {
            let advice = match access {
                Access::Random => memmap2::Advice::Random,
                Access::Sequential => memmap2::Advice::Sequential,
            };
            // A hint only: failure changes speed, never results.
            let _ = map.advise(advice);
        }
        #[cfg(not(unix))]
        let _ = access;
    }

    /// Asks the kernel to start reading record `index` in the background (`MADV_WILLNEED`), so a
    /// prefetching loader finds it in the page cache when it gets there.
    pub fn prefetch(&self, index: u64) {
        #[cfg(unix)]
        if let (Backing::Mapped(map), Ok(e)) = (&self.data, self.entry(index)) {
            let page = self.header.page_size as u64;
            let start = e.offset - e.offset % page;
            let _ = map.advise_range(
                memmap2::Advice::WillNeed,
                start as usize,
                (e.end() - start) as usize,
            );
        }
        #[cfg(not(unix))]
        let _ = index;
    }
}

impl std::fmt::Debug for ShardReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardReader")
            .field("path", &self.path)
            .field("records", &self.len())
            .field("bytes", &self.file_len())
            .finish()
    }
}

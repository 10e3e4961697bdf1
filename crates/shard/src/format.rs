//! The on-disk structures of FORMAT.md, as plain structs with explicit little-endian codecs.

use serde::{Deserialize, Serialize};

/// First 8 bytes of every shard file.
pub const MAGIC: [u8; 8] = *b"RDLSHARD";
/// The format version this crate reads and writes.
pub const VERSION: u32 = 1;
/// Bytes of the fixed header.
pub const HEADER_SIZE: usize = 80;
/// Bytes of one index entry.
pub const INDEX_STRIDE: usize = 32;
/// The page size the writer aligns records to.
pub const PAGE_SIZE: u64 = 4096;
/// Offset of `table_crc32c` in the header: the table CRC covers the header up to here.
pub const TABLE_CRC_OFFSET: usize = 76;
/// The `schema` of image-classification sets.
pub const IMAGE_SCHEMA: &str = "redline/image-classification";

/// How a record's bytes are encoded (index `flags` bits 0..=3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Anything else (raw bytes, an unknown image format).
    Other = 0,
    Jpeg = 1,
    Png = 2,
}

impl Encoding {
    /// Recognises JPEG and PNG by their leading bytes.
    pub fn sniff(bytes: &[u8]) -> Self {
        if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Self::Jpeg
        } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Self::Png
        } else {
            Self::Other
        }
    }

    fn from_bits(bits: u32) -> Option<Self> {
        match bits {
            0 => Some(Self::Other),
            1 => Some(Self::Jpeg),
            2 => Some(Self::Png),
            _ => None,
        }
    }
}

/// The fixed header (FORMAT.md, "Header").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub page_size: u32,
    pub record_count: u64,
    pub records_offset: u64,
    pub records_end: u64,
    pub index_offset: u64,
    pub metadata_offset: u64,
    pub metadata_length: u64,
    pub table_crc32c: u32,
}

impl Header {
    /// Encodes all 80 bytes, including the stored `table_crc32c`.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut b, 8, VERSION);
        put_u32(&mut b, 12, HEADER_SIZE as u32);
        put_u32(&mut b, 16, self.page_size);
        put_u32(&mut b, 20, INDEX_STRIDE as u32);
        put_u64(&mut b, 24, self.record_count);
        put_u64(&mut b, 32, self.records_offset);
        put_u64(&mut b, 40, self.records_end);
        put_u64(&mut b, 48, self.index_offset);
        put_u64(&mut b, 56, self.metadata_offset);
        put_u64(&mut b, 64, self.metadata_length);
        put_u32(&mut b, 72, 0);
        put_u32(&mut b, TABLE_CRC_OFFSET, self.table_crc32c);
        b
    }

    /// Decodes and checks every rule that the header alone can check against a file of
    /// `file_len` bytes. Returns a description of the first broken rule.
    pub fn decode(b: &[u8], file_len: u64) -> Result<Self, String> {
        if b.len() < HEADER_SIZE {
            return Err(format!(
                "file is {} bytes, shorter than the {HEADER_SIZE}-byte header",
                b.len()
            ));
        }
        if b[0..8] != MAGIC {
            return Err(format!("bad magic {:02x?} (not a redline shard)", &b[0..8]));
        }
        let fixed = [
            ("version", get_u32(b, 8), VERSION),
            ("header_size", get_u32(b, 12), HEADER_SIZE as u32),
            ("index_stride", get_u32(b, 20), INDEX_STRIDE as u32),
            ("reserved", get_u32(b, 72), 0),
        ];
        for (field, found, want) in fixed {
            if found != want {
                return Err(format!("header {field} is {found}, expected {want}"));
            }
        }
        let h = Self {
            page_size: get_u32(b, 16),
            record_count: get_u64(b, 24),
            records_offset: get_u64(b, 32),
            records_end: get_u64(b, 40),
            index_offset: get_u64(b, 48),
            metadata_offset: get_u64(b, 56),
            metadata_length: get_u64(b, 64),
            table_crc32c: get_u32(b, TABLE_CRC_OFFSET),
        };
        let page = h.page_size as u64;
        if !h.page_size.is_power_of_two() || !(512..=1 << 20).contains(&h.page_size) {
            return Err(format!(
                "header page_size {} is not a power of two in 512..=1048576",
                h.page_size
            ));
        }
        if h.records_offset != page {
            return Err(format!(
                "header records_offset {} is not page_size {page}",
                h.records_offset
            ));
        }
        if h.records_end < h.records_offset {
            return Err(format!(
                "header records_end {} is before records_offset {}",
                h.records_end, h.records_offset
            ));
        }
        let index_offset = align_up(h.records_end, page)
            .ok_or_else(|| format!("header records_end {} overflows", h.records_end))?;
        if h.index_offset != index_offset {
            return Err(format!(
                "header index_offset {} is not records_end {} rounded up to a page ({index_offset})",
                h.index_offset, h.records_end
            ));
        }
        let metadata_offset = h
            .record_count
            .checked_mul(INDEX_STRIDE as u64)
            .and_then(|n| n.checked_add(h.index_offset))
            .ok_or_else(|| format!("header record_count {} overflows", h.record_count))?;
        if h.metadata_offset != metadata_offset {
            return Err(format!(
                "header metadata_offset {} is not index_offset + {} * record_count ({metadata_offset})",
                h.metadata_offset, INDEX_STRIDE
            ));
        }
        let end = h.metadata_offset.checked_add(h.metadata_length);
        if end != Some(file_len) {
            return Err(format!(
                "file is {file_len} bytes but the header says it ends at {} (metadata at {} + {} bytes): truncated or extended",
                end.map_or_else(|| "overflow".to_string(), |e| e.to_string()),
                h.metadata_offset,
                h.metadata_length
            ));
        }
        Ok(h)
    }

    /// Byte range of the index.
    pub fn index_range(&self) -> std::ops::Range<usize> {
        self.index_offset as usize..self.metadata_offset as usize
    }

    /// Byte range of the metadata.
    pub fn metadata_range(&self) -> std::ops::Range<usize> {
        self.metadata_offset as usize..(self.metadata_offset + self.metadata_length) as usize
    }
}

/// One index entry (FORMAT.md, "Index entry"): where a record is and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub offset: u64,
    pub length: u32,
    pub crc32c: u32,
    pub label: i32,
    pub width: u16,
    pub height: u16,
    pub encoding: Encoding,
}

impl IndexEntry {
    pub fn encode(&self) -> [u8; INDEX_STRIDE] {
        let mut b = [0u8; INDEX_STRIDE];
        put_u64(&mut b, 0, self.offset);
        put_u32(&mut b, 8, self.length);
        put_u32(&mut b, 12, self.crc32c);
        put_u32(&mut b, 16, self.label as u32);
        b[20..22].copy_from_slice(&self.width.to_le_bytes());
        b[22..24].copy_from_slice(&self.height.to_le_bytes());
        put_u32(&mut b, 24, self.encoding as u32);
        b
    }

    /// Decodes one entry, checking the fields that need no context (flags, reserved, label >= -1).
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        let flags = get_u32(b, 24);
        let encoding = Encoding::from_bits(flags)
            .ok_or_else(|| format!("index flags {flags:#x} has unknown bits set"))?;
        let reserved = get_u32(b, 28);
        if reserved != 0 {
            return Err(format!("index reserved field is {reserved:#x}, expected 0"));
        }
        let label = get_u32(b, 16) as i32;
        if label < -1 {
            return Err(format!("label {label} is below -1"));
        }
        Ok(Self {
            offset: get_u64(b, 0),
            length: get_u32(b, 8),
            crc32c: get_u32(b, 12),
            label,
            width: u16::from_le_bytes([b[20], b[21]]),
            height: u16::from_le_bytes([b[22], b[23]]),
            encoding,
        })
    }

    /// One past the record's last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.length as u64
    }
}

/// Where the next record of `length` bytes goes when the previous one ended at `pos`
/// (FORMAT.md rule 3: never straddle a page unless larger than one; large ones start a page).
pub fn place_record(pos: u64, length: u64, page: u64) -> u64 {
    if placement_ok(pos, length, page) {
        pos
    } else {
        align_up(pos, page).unwrap_or(pos)
    }
}

/// Whether a record at `offset` of `length` bytes obeys the placement rule.
pub fn placement_ok(offset: u64, length: u64, page: u64) -> bool {
    if length > page {
        offset.is_multiple_of(page)
    } else {
        length == 0 || offset / page == (offset + length - 1) / page
    }
}

/// The smallest multiple of `page` (a power of two) that is >= `x`, or `None` on overflow.
pub fn align_up(x: u64, page: u64) -> Option<u64> {
    Some(x.checked_add(page - 1)? & !(page - 1))
}

/// The metadata block (FORMAT.md, "Metadata"). Unknown keys are ignored when reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub schema: String,
    pub classes: Vec<String>,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub params: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardInfo>,
}

impl Metadata {
    /// Image-classification metadata with the given class names.
    pub fn images(classes: Vec<String>) -> Self {
        Self {
            schema: IMAGE_SCHEMA.into(),
            classes,
            params: Default::default(),
            shard: None,
        }
    }
}

/// Which shard of which set a file is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub set: String,
    pub ordinal: u64,
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_castagnoli() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn placement_never_straddles_a_page_unless_larger() {
        let page = 4096;
        for pos in [4096u64, 4097, 8000, 8191, 8192] {
            for len in [0u64, 1, 95, 4095, 4096, 4097, 10_000] {
                let at = place_record(pos, len, page);
                assert!(at >= pos);
                assert!(placement_ok(at, len, page), "pos {pos} len {len} -> {at}");
                assert!(at - pos < page, "wastes at most one page");
            }
        }
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            page_size: 4096,
            record_count: 2,
            records_offset: 4096,
            records_end: 5000,
            index_offset: 8192,
            metadata_offset: 8192 + 64,
            metadata_length: 10,
            table_crc32c: 0xDEAD_BEEF,
        };
        assert_eq!(Header::decode(&h.encode(), 8192 + 74), Ok(h));
        let err = Header::decode(&h.encode(), 8192 + 73).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
    }
}

//! Decoding stored bytes to RGB, into a worker's reusable buffer.
//!
//! JPEGs go through zune-jpeg (pure Rust, SIMD; colour conversion to RGB for YCbCr, grayscale and
//! CMYK inputs); PNGs and whatever zune refuses go through the `image` crate. A JPEG that does
//! not end with its EOI marker is refused as truncated (decoders otherwise pad the missing rows
//! with grey and report success). Every call decodes: there is no cache of decoded pixels, and
//! [`Decoder::decodes`] counts them.

use std::fmt;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// Largest side accepted, in pixels (a corrupt header must not ask for gigabytes).
pub const MAX_SIDE: usize = 16_384;

/// Why a sample could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

/// An RGB image borrowed from a [`Decoder`]'s buffer.
#[derive(Debug, Clone, Copy)]
pub struct Image<'a> {
    pub width: usize,
    pub height: usize,
    /// `width · height · 3` bytes, rows packed.
    pub pixels: &'a [u8],
}

/// A worker's decoder: its output buffer is reused from one image to the next.
#[derive(Debug, Default)]
pub struct Decoder {
    buffer: Vec<u8>,
    decodes: u64,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// How many images this decoder has decoded.
    pub fn decodes(&self) -> u64 {
        self.decodes
    }

    /// Decodes `bytes` (JPEG, PNG, or another format the `image` crate reads) to RGB.
    pub fn decode(&mut self, bytes: &[u8]) -> Result<Image<'_>, DecodeError> {
        self.decodes += 1;
        let (width, height) = if bytes.starts_with(&[0xFF, 0xD8]) {
            if !bytes.ends_with(&[0xFF, 0xD9]) {
                return Err(DecodeError(format!(
                    "truncated JPEG: {} bytes without the end-of-image marker",
                    bytes.len()
                )));
            }
            match self.jpeg(bytes) {
                Ok(size) => size,
                // zune refuses a few exotic encodings (arithmetic coding, 12-bit): try the image crate.
                Err(zune) => self
                    .fallback(bytes)
                    .map_err(|other| DecodeError(format!("JPEG: {zune}; image crate: {other}")))?,
            }
        } else {
            self.fallback(bytes)?
        };
        Ok(Image {
            width,
            height,
            pixels: &self.buffer[..width * height * 3],
        })
    }

    fn jpeg(&mut self, bytes: &[u8]) -> Result<(usize, usize), DecodeError> {
        let options = DecoderOptions::new_fast()
            .jpeg_set_out_colorspace(ColorSpace::RGB)
            .set_max_width(MAX_SIDE)
            .set_max_height(MAX_SIDE);
        let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
        decoder
            .decode_headers()
            .map_err(|e| DecodeError(format!("JPEG header: {e:?}")))?;
        let (width, height) = decoder
            .dimensions()
            .ok_or_else(|| DecodeError("JPEG without dimensions".into()))?;
        let len = decoder
            .output_buffer_size()
            .ok_or_else(|| DecodeError("JPEG output size unknown".into()))?;
        if len != width * height * 3 {
            return Err(DecodeError(format!(
                "JPEG decodes to {len} bytes, not RGB {width}x{height}"
            )));
        }
        self.buffer.resize(len, 0);
        decoder
            .decode_into(&mut self.buffer[..len])
            .map_err(|e| DecodeError(format!("JPEG data: {e:?}")))?;
        Ok((width, height))
    }

    fn fallback(&mut self, bytes: &[u8]) -> Result<(usize, usize), DecodeError> {
        let image = image::load_from_memory(bytes).map_err(|e| {
            DecodeError(format!(
                "not a decodable image ({} bytes): {e}",
                bytes.len()
            ))
        })?;
        let (width, height) = (image.width() as usize, image.height() as usize);
        if width > MAX_SIDE || height > MAX_SIDE {
            return Err(DecodeError(format!(
                "{width}x{height} exceeds {MAX_SIDE} pixels a side"
            )));
        }
        let rgb = image.into_rgb8();
        self.buffer.clear();
        self.buffer.extend_from_slice(rgb.as_raw());
        Ok((width, height))
    }
}

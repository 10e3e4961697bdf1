//! Decoding stored bytes to RGB, into a worker's reusable buffer.
//!
//! Two JPEG codecs, chosen per [`Decoder`] ([`Codec`]):
//! * **libjpeg-turbo 3** (cargo feature `turbojpeg`, the default choice when built in): decodes
//!   only the region a transform needs (rows above and below the crop are not reconstructed,
//!   columns outside it skip the inverse DCT) and scales by 1/2, 1/4 or 1/8 inside the inverse
//!   DCT when the crop is that much larger than the output ([`scale_denominator`]).
//! * **zune-jpeg** (pure Rust, SIMD; always built): decodes the whole image at full size.
//!
//! Whatever the first codec refuses (CMYK for libjpeg-turbo's RGB output, arithmetic coding or
//! 12-bit for zune) goes to the next: zune, then the `image` crate, which also reads PNGs. A JPEG
//! that does not end with its EOI marker is refused as truncated (decoders otherwise pad the
//! missing rows with grey and report success). Every call decodes: there is no cache of decoded
//! pixels, and [`Decoder::decodes`] counts them.

#[cfg(feature = "turbojpeg")]
mod turbo;
mod zune;

use std::fmt;

use crate::resize::Crop;

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

/// A JPEG codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// zune-jpeg: pure Rust, whole image at full size.
    Zune,
    /// libjpeg-turbo 3: cropped and DCT-scaled decoding (feature `turbojpeg`).
    #[cfg(feature = "turbojpeg")]
    Turbo,
}

impl Codec {
    /// The codecs this build has, fastest first.
    pub fn available() -> &'static [Codec] {
        &[
            #[cfg(feature = "turbojpeg")]
            Codec::Turbo,
            Codec::Zune,
        ]
    }

    /// The fastest codec this build has.
    pub fn best() -> Codec {
        Self::available()[0]
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Zune => "zune-jpeg",
            #[cfg(feature = "turbojpeg")]
            Codec::Turbo => "libjpeg-turbo",
        }
    }
}

/// An RGB image borrowed from a [`Decoder`]'s buffer.
#[derive(Debug, Clone, Copy)]
pub struct Image<'a> {
    pub width: usize,
    pub height: usize,
    /// `width · height · 3` bytes, rows packed.
    pub pixels: &'a [u8],
}

/// What a transform needs of an image: a crop, in full-size pixels, and the size below which
/// the decoder must not shrink it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub crop: Crop,
    pub min_width: usize,
    pub min_height: usize,
}

/// A decoded region: `image` holds at least the requested crop, scaled by `1 / scale`;
/// `crop` is where the requested crop lies in `image`.
#[derive(Debug, Clone, Copy)]
pub struct Decoded<'a> {
    pub image: Image<'a>,
    pub crop: Crop,
    /// 1, 2, 4 or 8: the DCT-domain downscale that was applied.
    pub scale: usize,
    /// The full image's size, in pixels.
    pub full: (usize, usize),
}

/// The largest of 8, 4, 2 (else 1) by which `crop` can be shrunk and still cover
/// `min_width × min_height`: the resampler then reads up to 64× fewer pixels, and its output
/// differs from a full-size resize only by the detail the antialiasing filter removes anyway.
pub fn scale_denominator(crop: Crop, min_width: usize, min_height: usize) -> usize {
    [8, 4, 2]
        .into_iter()
        .find(|&d| crop.width >= min_width * d && crop.height >= min_height * d)
        .unwrap_or(1)
}

/// `crop` clamped into a `width × height` image (at least one pixel).
fn clamp_crop(crop: Crop, width: usize, height: usize) -> Crop {
    let left = crop.left.min(width.saturating_sub(1));
    let top = crop.top.min(height.saturating_sub(1));
    Crop {
        left,
        top,
        width: crop.width.clamp(1, width - left),
        height: crop.height.clamp(1, height - top),
    }
}

/// A worker's decoder: its output buffer (and libjpeg-turbo handle) are reused from one image to
/// the next.
pub struct Decoder {
    codec: Codec,
    buffer: Vec<u8>,
    decodes: u64,
    #[cfg(feature = "turbojpeg")]
    turbo: Option<turbo::Turbo>,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("codec", &self.codec)
            .field("decodes", &self.decodes)
            .finish_non_exhaustive()
    }
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// A decoder with the fastest codec this build has ([`Codec::best`]).
    pub fn new() -> Self {
        Self::with_codec(Codec::best())
    }

    pub fn with_codec(codec: Codec) -> Self {
        Self {
            codec,
            buffer: Vec::new(),
            decodes: 0,
            #[cfg(feature = "turbojpeg")]
            turbo: None,
        }
    }

    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// How many images this decoder has decoded.
    pub fn decodes(&self) -> u64 {
        self.decodes
    }

    /// Decodes all of `bytes` (JPEG, PNG, or another format the `image` crate reads) to RGB at
    /// full size.
    pub fn decode(&mut self, bytes: &[u8]) -> Result<Image<'_>, DecodeError> {
        let decoded = self.decode_region(bytes, |width, height| Region {
            crop: Crop {
                left: 0,
                top: 0,
                width,
                height,
            },
            min_width: width,
            min_height: height,
        })?;
        Ok(decoded.image)
    }

    /// Decodes what `plan` asks for once it knows the image's size: its crop, shrunk in the DCT
    /// domain where [`scale_denominator`] allows (libjpeg-turbo), else the whole image.
    /// `plan` may be called more than once (once per codec tried) and must answer the same.
    pub fn decode_region(
        &mut self,
        bytes: &[u8],
        mut plan: impl FnMut(usize, usize) -> Region,
    ) -> Result<Decoded<'_>, DecodeError> {
        self.decodes += 1;
        let decoded = if bytes.starts_with(&[0xFF, 0xD8]) {
            if !bytes.ends_with(&[0xFF, 0xD9]) {
                return Err(DecodeError(format!(
                    "truncated JPEG: {} bytes without the end-of-image marker",
                    bytes.len()
                )));
            }
            self.jpeg(bytes, &mut plan)?
        } else {
            self.fallback(bytes, &mut plan)?
        };
        let Placed {
            width,
            height,
            crop,
            scale,
            full,
        } = decoded;
        Ok(Decoded {
            image: Image {
                width,
                height,
                pixels: &self.buffer[..width * height * 3],
            },
            crop,
            scale,
            full,
        })
    }

    /// The JPEG codecs in order, each refusal passed on to the next.
    fn jpeg(
        &mut self,
        bytes: &[u8],
        plan: &mut dyn FnMut(usize, usize) -> Region,
    ) -> Result<Placed, DecodeError> {
        let mut refusals = Vec::new();
        #[cfg(feature = "turbojpeg")]
        if self.codec == Codec::Turbo {
            let turbo = match self.turbo.take() {
                Some(turbo) => Ok(turbo),
                None => turbo::Turbo::new(),
            };
            match turbo {
                Ok(mut turbo) => {
                    let result = turbo.decode(bytes, plan, &mut self.buffer);
                    self.turbo = Some(turbo);
                    match result {
                        Ok(placed) => return Ok(placed),
                        Err(e) => refusals.push(format!("libjpeg-turbo: {e}")),
                    }
                }
                Err(e) => refusals.push(format!("libjpeg-turbo: {e}")),
            }
        }
        match zune::decode(bytes, plan, &mut self.buffer) {
            Ok(placed) => return Ok(placed),
            Err(e) => refusals.push(format!("zune-jpeg: {e}")),
        }
        self.fallback(bytes, plan).map_err(|e| {
            refusals.push(format!("image crate: {e}"));
            DecodeError(format!("JPEG: {}", refusals.join("; ")))
        })
    }

    fn fallback(
        &mut self,
        bytes: &[u8],
        plan: &mut dyn FnMut(usize, usize) -> Region,
    ) -> Result<Placed, DecodeError> {
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
        Ok(Placed::whole(width, height, plan(width, height)))
    }
}

/// Where a codec put its output in the decoder's buffer.
struct Placed {
    width: usize,
    height: usize,
    crop: Crop,
    scale: usize,
    full: (usize, usize),
}

impl Placed {
    /// The whole image decoded at full size: the region's crop is where it was asked to be.
    fn whole(width: usize, height: usize, region: Region) -> Self {
        Self {
            width,
            height,
            crop: clamp_crop(region.crop, width, height),
            scale: 1,
            full: (width, height),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn crop(left: usize, top: usize, width: usize, height: usize) -> Crop {
        Crop {
            left,
            top,
            width,
            height,
        }
    }

    #[test]
    fn the_scale_is_the_largest_that_still_covers_the_output() {
        assert_eq!(scale_denominator(crop(0, 0, 448, 448), 224, 224), 2);
        assert_eq!(scale_denominator(crop(0, 0, 447, 448), 224, 224), 1);
        assert_eq!(scale_denominator(crop(0, 0, 900, 1000), 224, 224), 4);
        assert_eq!(scale_denominator(crop(0, 0, 1800, 1792), 224, 224), 8);
        assert_eq!(scale_denominator(crop(0, 0, 4000, 4000), 224, 224), 8);
        assert_eq!(scale_denominator(crop(0, 0, 100, 100), 224, 224), 1);
        assert_eq!(scale_denominator(crop(0, 0, 500, 375), 341, 256), 1);
        assert_eq!(scale_denominator(crop(0, 0, 1000, 750), 341, 256), 2);
    }
}

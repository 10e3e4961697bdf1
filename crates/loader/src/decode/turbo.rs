//! libjpeg-turbo 3 through its TurboJPEG API (`turbojpeg-sys`, built from its bundled source).
//!
//! One handle per decoder, reused for every image. Each decode reads the header, asks the plan
//! for its region, then sets a DCT scaling factor (1/1, 1/2, 1/4, 1/8) and a cropping region:
//! libjpeg-turbo then skips the inverse DCT and colour conversion of rows above the crop (they
//! are only entropy-decoded), stops after the crop's last row, and reconstructs only the iMCU
//! columns that hold the crop. Warnings (corrupt data that libjpeg would paper over with grey)
//! are errors.

use std::ffi::CStr;
use std::ptr::NonNull;

use turbojpeg_sys as tj;

use super::{scale_denominator, DecodeError, Placed, Region, MAX_SIDE};
use crate::resize::Crop;

/// iMCU width in pixels per TJSAMP value (444, 422, 420, GRAY, 440, 411, 441): turbojpeg.h's
/// `tjMCUWidth`, a `static` table in the header that the library does not export.
const MCU_WIDTH: [usize; 7] = [8, 16, 16, 8, 8, 32, 8];

/// A TurboJPEG decompression handle.
pub(super) struct Turbo(NonNull<std::ffi::c_void>);

// A TurboJPEG handle holds no thread-local state: it may move between threads, used by one at a
// time (`&mut self` everywhere).
unsafe impl Send for Turbo {}

impl Drop for Turbo {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed once.
        unsafe { tj::tj3Destroy(self.0.as_ptr()) }
    }
}

impl Turbo {
    pub(super) fn new() -> Result<Self, DecodeError> {
        // SAFETY: tj3Init has no preconditions; a null return is checked.
        let handle = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as _) };
        let turbo =
            Turbo(NonNull::new(handle).ok_or_else(|| DecodeError("tj3Init failed".into()))?);
        turbo.set(tj::TJPARAM_TJPARAM_STOPONWARNING, 1)?;
        turbo.set(
            tj::TJPARAM_TJPARAM_MAXPIXELS,
            (MAX_SIDE * MAX_SIDE).min(i32::MAX as usize) as i32,
        )?;
        Ok(turbo)
    }

    fn set(&self, param: tj::TJPARAM, value: i32) -> Result<(), DecodeError> {
        // SAFETY: a live handle; tj3Set validates the parameter.
        match unsafe { tj::tj3Set(self.0.as_ptr(), param as _, value) } {
            0 => Ok(()),
            _ => Err(self.error("tj3Set")),
        }
    }

    fn get(&self, param: tj::TJPARAM) -> i32 {
        // SAFETY: a live handle; unknown parameters answer -1.
        unsafe { tj::tj3Get(self.0.as_ptr(), param as _) }
    }

    fn error(&self, call: &str) -> DecodeError {
        // SAFETY: tj3GetErrorStr returns a NUL-terminated string owned by the handle, valid
        // until the next call on it; it is copied at once.
        let text = unsafe { CStr::from_ptr(tj::tj3GetErrorStr(self.0.as_ptr())) };
        DecodeError(format!("{call}: {}", text.to_string_lossy()))
    }

    /// Decodes the plan's region of `bytes` into `buffer` (packed RGB).
    pub(super) fn decode(
        &mut self,
        bytes: &[u8],
        plan: &mut dyn FnMut(usize, usize) -> Region,
        buffer: &mut Vec<u8>,
    ) -> Result<Placed, DecodeError> {
        let handle = self.0.as_ptr();
        // SAFETY: `bytes` is a live slice of the given length.
        if unsafe { tj::tj3DecompressHeader(handle, bytes.as_ptr(), bytes.len() as _) } != 0 {
            return Err(self.error("header"));
        }
        let (width, height) = (
            self.get(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            self.get(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        let colorspace = self.get(tj::TJPARAM_TJPARAM_COLORSPACE);
        if colorspace == tj::TJCS_TJCS_CMYK as i32 || colorspace == tj::TJCS_TJCS_YCCK as i32 {
            return Err(DecodeError("CMYK/YCCK has no RGB output here".into()));
        }
        if self.get(tj::TJPARAM_TJPARAM_PRECISION) != 8 {
            return Err(DecodeError("not 8-bit".into()));
        }
        let (width, height) = match (usize::try_from(width), usize::try_from(height)) {
            (Ok(w), Ok(h)) if (1..=MAX_SIDE).contains(&w) && (1..=MAX_SIDE).contains(&h) => (w, h),
            _ => {
                return Err(DecodeError(format!(
                    "{width}x{height} is outside 1..={MAX_SIDE} pixels a side"
                )))
            }
        };

        let region = plan(width, height);
        let crop = super::clamp_crop(region.crop, width, height);
        // Lossless JPEGs have no DCT to scale or crop in.
        let lossy = self.get(tj::TJPARAM_TJPARAM_LOSSLESS) != 1;
        let scale = if lossy {
            scale_denominator(crop, region.min_width, region.min_height)
        } else {
            1
        };
        let wanted = scaled_crop(crop, width, height, scale);
        let (scaled_width, scaled_height) = (width.div_ceil(scale), height.div_ceil(scale));
        // The left edge must fall on an iMCU boundary of the scaled image; an unknown
        // subsampling cannot be cropped at all.
        let subsamp = self.get(tj::TJPARAM_TJPARAM_SUBSAMP);
        let decoded = match usize::try_from(subsamp) {
            Ok(s) if lossy && s < 7 => {
                let mcu = MCU_WIDTH[s];
                let step = mcu.div_ceil(scale);
                let left = wanted.left / step * step;
                Crop {
                    left,
                    top: wanted.top,
                    width: wanted.left + wanted.width - left,
                    height: wanted.height,
                }
            }
            _ => Crop {
                left: 0,
                top: 0,
                width: scaled_width,
                height: scaled_height,
            },
        };
        let whole = decoded.width == scaled_width && decoded.height == scaled_height;
        let factor = tj::tjscalingfactor {
            num: 1,
            denom: scale as i32,
        };
        // The region is inside the scaled image, so every field fits an i32 (sides ≤ MAX_SIDE).
        let cropping = if whole {
            tj::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            }
        } else {
            tj::tjregion {
                x: decoded.left as i32,
                y: decoded.top as i32,
                w: decoded.width as i32,
                h: decoded.height as i32,
            }
        };
        // SAFETY: a live handle whose header was just read.
        unsafe {
            if tj::tj3SetScalingFactor(handle, factor) != 0 {
                return Err(self.error("scaling factor"));
            }
            if tj::tj3SetCroppingRegion(handle, cropping) != 0 {
                return Err(self.error("cropping region"));
            }
        }
        let pitch = decoded.width * 3;
        // Room for the whole image, so random crops and scales stop growing the buffer once an
        // image of this size was seen.
        crate::resize::reserve_total(buffer, width * height * 3);
        buffer.resize(pitch * decoded.height, 0);
        // SAFETY: `buffer` holds `pitch × decoded.height` bytes, exactly what libjpeg-turbo
        // writes for this scaling factor and cropping region.
        let status = unsafe {
            tj::tj3Decompress8(
                handle,
                bytes.as_ptr(),
                bytes.len() as _,
                buffer.as_mut_ptr(),
                pitch as i32,
                tj::TJPF_TJPF_RGB,
            )
        };
        if status != 0 {
            return Err(self.error("data"));
        }
        Ok(Placed {
            width: decoded.width,
            height: decoded.height,
            crop: Crop {
                left: wanted.left - decoded.left,
                top: wanted.top - decoded.top,
                width: wanted.width,
                height: wanted.height,
            },
            scale,
            full: (width, height),
        })
    }
}

/// `crop` of a `width × height` image in the coordinates of that image shrunk by `1 / scale`
/// (libjpeg's scaled size: `ceil(side / scale)`), rounded outwards so it still covers the crop.
fn scaled_crop(crop: Crop, width: usize, height: usize, scale: usize) -> Crop {
    let (sw, sh) = (width.div_ceil(scale), height.div_ceil(scale));
    let (left, top) = (crop.left / scale, crop.top / scale);
    let right = (crop.left + crop.width).div_ceil(scale).min(sw);
    let bottom = (crop.top + crop.height).div_ceil(scale).min(sh);
    Crop {
        left,
        top,
        width: right.saturating_sub(left).max(1),
        height: bottom.saturating_sub(top).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::crop;
    use super::*;

    #[test]
    fn scaled_crops_cover_the_crop_and_stay_inside_the_image() {
        for (c, w, h, s) in [
            (crop(3, 5, 449, 451), 500, 500, 2),
            (crop(0, 0, 500, 375), 500, 375, 8),
            (crop(17, 9, 250, 230), 333, 257, 4),
        ] {
            let sc = scaled_crop(c, w, h, s);
            assert!(sc.left * s <= c.left && sc.top * s <= c.top, "{sc:?}");
            assert!((sc.left + sc.width) * s >= c.left + c.width, "{sc:?}");
            assert!((sc.top + sc.height) * s >= c.top + c.height, "{sc:?}");
            assert!(sc.left + sc.width <= w.div_ceil(s) && sc.top + sc.height <= h.div_ceil(s));
            assert!(sc.width >= c.width / s && sc.height >= c.height / s);
        }
    }
}

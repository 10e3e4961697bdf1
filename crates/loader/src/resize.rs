//! Antialiased bilinear resampling of a crop of an RGB image, as PIL does it (and so as
//! torchvision's `RandomResizedCrop` / `Resize` on PIL images do).
//!
//! PIL's algorithm (`Resample.c`): a triangle filter whose support widens with the downscale
//! factor (antialiasing), coefficients normalised per output pixel and rounded to 22-bit fixed
//! point, a horizontal pass into an 8-bit intermediate, then a vertical pass. A pass whose size
//! does not change is skipped. The crop is taken first, so the filter never reads outside it.
//! Coefficient tables and the intermediate live in a [`Resizer`] that a worker reuses.

/// A rectangle of the source image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crop {
    pub left: usize,
    pub top: usize,
    pub width: usize,
    pub height: usize,
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One axis's filter: for each output pixel, the first input pixel and fixed-point weights.
#[derive(Debug, Default)]
struct Axis {
    /// (first input index, number of taps) per output pixel.
    bounds: Vec<(usize, usize)>,
    /// `ksize` weights per output pixel.
    weights: Vec<i32>,
    ksize: usize,
    /// One output pixel's weights before rounding (kept to reuse its allocation).
    exact: Vec<f64>,
}

impl Axis {
    /// PIL's `precompute_coeffs` for resizing `in_size` pixels to `out_size`.
    fn build(&mut self, in_size: usize, out_size: usize) {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = filterscale; // the bilinear filter's support is 1
        self.ksize = support.ceil() as usize * 2 + 1;
        self.bounds.clear();
        self.weights.clear();
        self.weights.resize(out_size * self.ksize, 0);
        let mut k = std::mem::take(&mut self.exact);
        k.clear();
        k.resize(self.ksize, 0.0);
        for xx in 0..out_size {
            let center = (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let taps = xmax.saturating_sub(xmin);
            let mut total = 0.0;
            for (x, w) in k.iter_mut().enumerate().take(taps) {
                let t = ((x + xmin) as f64 - center + 0.5) / filterscale;
                *w = (1.0 - t.abs()).max(0.0);
                total += *w;
            }
            let row = &mut self.weights[xx * self.ksize..(xx + 1) * self.ksize];
            for (dst, &w) in row.iter_mut().zip(&k).take(taps) {
                let w = if total != 0.0 { w / total } else { w };
                // PIL rounds half away from zero.
                let fixed = w * (1u32 << PRECISION_BITS) as f64;
                *dst = if fixed < 0.0 {
                    (fixed - 0.5) as i32
                } else {
                    (fixed + 0.5) as i32
                };
            }
            self.bounds.push((xmin, taps));
        }
        self.exact = k;
    }
}

#[inline]
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Reusable resampling state (coefficients and the intermediate image).
#[derive(Debug, Default)]
pub struct Resizer {
    horizontal: Axis,
    vertical: Axis,
    between: Vec<u8>,
}

impl Resizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Resamples `crop` of `src` (RGB, `src_width` pixels wide, rows `stride` bytes apart) to
    /// `out_width × out_height` RGB in `out` (tightly packed, `out_width · 3` bytes a row).
    ///
    /// Panics if the crop lies outside the source or `out` is too small (callers compute both).
    pub fn resize(
        &mut self,
        src: &[u8],
        stride: usize,
        crop: Crop,
        out_width: usize,
        out_height: usize,
        out: &mut [u8],
    ) {
        assert!(crop.width > 0 && crop.height > 0 && out_width > 0 && out_height > 0);
        assert!(src.len() >= (crop.top + crop.height - 1) * stride + (crop.left + crop.width) * 3);
        assert!(out.len() >= out_width * out_height * 3);
        let row_of = |y: usize| &src[(crop.top + y) * stride + crop.left * 3..];
        // Horizontal pass into `between` (crop.height rows of out_width), or a plain copy.
        let mid_stride = out_width * 3;
        self.between.resize(crop.height * mid_stride, 0);
        if out_width == crop.width {
            for y in 0..crop.height {
                self.between[y * mid_stride..(y + 1) * mid_stride]
                    .copy_from_slice(&row_of(y)[..mid_stride]);
            }
        } else {
            self.horizontal.build(crop.width, out_width);
            let axis = &self.horizontal;
            for y in 0..crop.height {
                let src_row = row_of(y);
                let dst = &mut self.between[y * mid_stride..(y + 1) * mid_stride];
                for (xx, px) in dst.chunks_exact_mut(3).enumerate() {
                    let (xmin, taps) = axis.bounds[xx];
                    let k = &axis.weights[xx * axis.ksize..xx * axis.ksize + taps];
                    let mut acc = [1i64 << (PRECISION_BITS - 1); 3];
                    for (i, &w) in k.iter().enumerate() {
                        let p = &src_row[(xmin + i) * 3..(xmin + i) * 3 + 3];
                        for c in 0..3 {
                            acc[c] += p[c] as i64 * w as i64;
                        }
                    }
                    for c in 0..3 {
                        px[c] = clip8(acc[c]);
                    }
                }
            }
        }
        // Vertical pass into `out`, or a plain copy.
        if out_height == crop.height {
            out[..crop.height * mid_stride].copy_from_slice(&self.between);
            return;
        }
        self.vertical.build(crop.height, out_height);
        let axis = &self.vertical;
        for yy in 0..out_height {
            let (ymin, taps) = axis.bounds[yy];
            let k = &axis.weights[yy * axis.ksize..yy * axis.ksize + taps];
            let dst = &mut out[yy * mid_stride..(yy + 1) * mid_stride];
            for (x, d) in dst.iter_mut().enumerate() {
                let mut acc = 1i64 << (PRECISION_BITS - 1);
                for (i, &w) in k.iter().enumerate() {
                    acc += self.between[(ymin + i) * mid_stride + x] as i64 * w as i64;
                }
                *d = clip8(acc);
            }
        }
    }
}

/// Mirrors an RGB image left to right in place.
pub fn flip_horizontal(image: &mut [u8], width: usize, height: usize) {
    for row in image.chunks_exact_mut(width * 3).take(height) {
        for x in 0..width / 2 {
            let (a, b) = (x * 3, (width - 1 - x) * 3);
            for c in 0..3 {
                row.swap(a + c, b + c);
            }
        }
    }
}

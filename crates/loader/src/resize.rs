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
    /// Output pixel `i`'s first input pixel and weights.
    #[inline(always)]
    fn taps(&self, i: usize) -> (usize, &[i32]) {
        let (first, taps) = self.bounds[i];
        (first, &self.weights[i * self.ksize..i * self.ksize + taps])
    }

    /// Room for the tables of any `in_size` up to `largest_in` resized to `out_size`.
    fn reserve(&mut self, largest_in: usize, out_size: usize) {
        let widest = largest_in.div_ceil(out_size.max(1)) * 2 + 1;
        reserve_total(&mut self.bounds, out_size);
        reserve_total(&mut self.weights, out_size * widest);
        reserve_total(&mut self.exact, widest);
    }

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

/// Grows `v`'s capacity to at least `total` elements (whatever its length), geometrically.
pub(crate) fn reserve_total<T>(v: &mut Vec<T>, total: usize) {
    if v.capacity() < total {
        v.reserve(total.max(2 * v.capacity()) - v.len());
    }
}

/// The rounding term every accumulator starts from.
const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// PIL accumulates in 32-bit ints: 255 × 2²² plus rounding cannot overflow, since a pixel's
/// weights (all ≥ 0 for the triangle filter) sum to 2²².
#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Reusable resampling state (coefficients and the intermediate image).
#[derive(Debug, Default)]
pub struct Resizer {
    horizontal: Axis,
    vertical: Axis,
    between: Vec<u8>,
    /// One output row's vertical-pass sums.
    accumulator: Vec<i32>,
}

impl Resizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes room for resizing any crop of a `width × height` source to `out_width ×
    /// out_height`, so that random crops stop growing the buffers once a source size was seen.
    pub fn reserve(
        &mut self,
        (width, height): (usize, usize),
        (out_width, out_height): (usize, usize),
    ) {
        reserve_total(&mut self.between, height * out_width * 3);
        reserve_total(&mut self.accumulator, out_width * 3);
        self.horizontal.reserve(width, out_width);
        self.vertical.reserve(height, out_height);
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
        let kernels = Kernels::detect();
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
            for y in 0..crop.height {
                let dst = &mut self.between[y * mid_stride..(y + 1) * mid_stride];
                (kernels.horizontal)(row_of(y), dst, &self.horizontal);
            }
        }
        // Vertical pass into `out`, or a plain copy.
        if out_height == crop.height {
            out[..crop.height * mid_stride].copy_from_slice(&self.between);
            return;
        }
        self.vertical.build(crop.height, out_height);
        let axis = &self.vertical;
        self.accumulator.resize(mid_stride, 0);
        for yy in 0..out_height {
            let (ymin, k) = axis.taps(yy);
            let rows = &self.between[ymin * mid_stride..(ymin + k.len()) * mid_stride];
            let dst = &mut out[yy * mid_stride..(yy + 1) * mid_stride];
            (kernels.vertical)(rows, k, &mut self.accumulator, dst);
        }
    }
}

/// One output row of the horizontal pass: (source row, output row, filter).
type HorizontalRow = fn(&[u8], &mut [u8], &Axis);
/// One output row of the vertical pass: (input rows, weights, accumulator, output row).
type VerticalRow = fn(&[u8], &[i32], &mut [i32], &mut [u8]);

/// The two passes' row kernels, chosen once per call for the CPU at hand.
struct Kernels {
    horizontal: HorizontalRow,
    vertical: VerticalRow,
}

impl Kernels {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return Self {
                horizontal: x86::horizontal_row,
                vertical: x86::vertical_row,
            };
        }
        Self {
            horizontal: horizontal_row,
            vertical: vertical_row,
        }
    }
}

/// The vertical pass for one output row: `rows` holds `k.len()` input rows of `dst.len()` bytes,
/// summed tap by tap in `acc` so the inner loop runs over contiguous bytes and vectorises.
#[inline(always)]
fn vertical_row(rows: &[u8], k: &[i32], acc: &mut [i32], dst: &mut [u8]) {
    let acc = &mut acc[..dst.len()];
    acc.fill(HALF);
    for (row, &w) in rows.chunks_exact(dst.len()).zip(k) {
        for (a, &b) in acc.iter_mut().zip(row) {
            *a += b as i32 * w;
        }
    }
    for (d, &a) in dst.iter_mut().zip(acc.iter()) {
        *d = clip8(a);
    }
}

/// The horizontal pass over one row: each output pixel is `ksize` weights over the pixels from
/// its `xmin`.
fn horizontal_row(row: &[u8], dst: &mut [u8], axis: &Axis) {
    for (xx, px) in dst.chunks_exact_mut(3).enumerate() {
        px.copy_from_slice(&horizontal_pixel(row, axis.taps(xx)));
    }
}

/// One output pixel of the horizontal pass: weights `k` over the pixels from `xmin`.
#[inline(always)]
fn horizontal_pixel(row: &[u8], (xmin, k): (usize, &[i32])) -> [u8; 3] {
    let mut acc = [HALF; 3];
    for (p, &w) in row[xmin * 3..(xmin + k.len()) * 3].chunks_exact(3).zip(k) {
        for c in 0..3 {
            acc[c] += p[c] as i32 * w;
        }
    }
    acc.map(clip8)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{horizontal_pixel, Axis, HALF, PRECISION_BITS};

    // These two are safe to call only on a CPU with AVX2 (hence SSE4.1): `Kernels::detect`
    // hands them out after checking, and nothing else names them.

    pub(super) fn horizontal_row(row: &[u8], dst: &mut [u8], axis: &Axis) {
        // SAFETY: only reached after AVX2 was detected (see above).
        unsafe { horizontal_row_sse41(row, dst, axis) }
    }

    pub(super) fn vertical_row(rows: &[u8], k: &[i32], acc: &mut [i32], dst: &mut [u8]) {
        // SAFETY: only reached after AVX2 was detected (see above).
        unsafe { vertical_row_avx2(rows, k, acc, dst) }
    }

    /// The portable vertical pass compiled for AVX2: LLVM widens it to 8 lanes.
    #[target_feature(enable = "avx2")]
    unsafe fn vertical_row_avx2(rows: &[u8], k: &[i32], acc: &mut [i32], dst: &mut [u8]) {
        super::vertical_row(rows, k, acc, dst)
    }

    /// [`super::horizontal_row`] with a pixel's three sums in one SSE register: each tap loads
    /// 4 bytes (RGB and the next pixel's red, weighted but dropped), widens them to i32 and
    /// multiply-adds. Same integer arithmetic, same bits. Output pixels whose last tap is the
    /// row's last pixel (no fourth byte to read) take the portable path.
    #[target_feature(enable = "sse4.1")]
    unsafe fn horizontal_row_sse41(row: &[u8], dst: &mut [u8], axis: &Axis) {
        for (xx, px) in dst.chunks_exact_mut(3).enumerate() {
            let (xmin, k) = axis.taps(xx);
            if (xmin + k.len()) * 3 >= row.len() {
                px.copy_from_slice(&horizontal_pixel(row, (xmin, k)));
                continue;
            }
            let mut acc = _mm_set1_epi32(HALF);
            for (i, &w) in k.iter().enumerate() {
                let at = (xmin + i) * 3;
                // In bounds: at + 4 <= (xmin + k.len()) * 3 + 1 <= row.len().
                let bytes: [u8; 4] = row[at..at + 4].try_into().expect("a 4-byte slice");
                let pixel = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i32::from_le_bytes(bytes)));
                acc = _mm_add_epi32(acc, _mm_mullo_epi32(pixel, _mm_set1_epi32(w)));
            }
            // >> PRECISION_BITS, then saturate to 0..=255 (PIL's clip8).
            let shifted = _mm_srai_epi32::<{ PRECISION_BITS as i32 }>(acc);
            let packed = _mm_packus_epi16(_mm_packs_epi32(shifted, shifted), shifted);
            let rgb = (_mm_cvtsi128_si32(packed) as u32).to_le_bytes();
            px.copy_from_slice(&rgb[..3]);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The SSE4.1 horizontal pass gives the portable pass's bits, for down- and upscales, odd
    /// widths and a row that ends at the buffer's last byte.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_simd_horizontal_pass_equals_the_portable_one() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let row: Vec<u8> = (0..301 * 3)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        for (width, out) in [(301, 224), (301, 37), (301, 300), (150, 301), (7, 3)] {
            let mut axis = Axis::default();
            axis.build(width, out);
            let src = &row[(301 - width) * 3..];
            let (mut simd, mut plain) = (vec![0; out * 3], vec![0; out * 3]);
            horizontal_row(src, &mut plain, &axis);
            x86::horizontal_row(src, &mut simd, &axis);
            assert_eq!(simd, plain, "{width} -> {out}");
        }
    }
}

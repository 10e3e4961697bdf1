//! Convolution on channels-last data as tiled im2col + SIMD GEMM: forward, input gradient and
//! weight gradient.
//!
//! Everything runs on NHWC (channels-last) buffers, where a kernel tap is `C` contiguous values:
//! a tile of output pixels gathers its receptive fields into an im2col tile sized to stay in L2
//! (from the arena), and one GEMM against the weight matrix `[KH·KW·C, O]` finishes it. The input
//! gradient is the transposed GEMM plus a col2im scatter; the weight gradient accumulates
//! `colsᵀ · g` per thread and sums the partials in thread order. 1×1 stride-1 convolutions skip
//! im2col (the NHWC input already is the matrix). NCHW tensors are converted on the way in and
//! out (PyTorch's oneDNN path does the same): channels-last is the fast layout. Stride-1 f32
//! convolutions on CPUs with our GEMM kernels (AVX-512 or AVX2) skip im2col altogether
//! (`implicit.rs`).

use redline_tensor::backend::Conv2dParams;
use redline_tensor::Layout;

use crate::arena::{Arena, Pooled};
use crate::buffer::{
    as_compute, from_compute, overwritten, recycle, with_compute, zeros, Data, Real,
};
use crate::ops::elementwise::{dense, Dense};
use crate::ops::matmul::{gemm_rows, Mat, SharedB};
use crate::parallel::{self, Disjoint};
use crate::sgemm::PackedB;
use crate::ConvAlgorithm;

mod implicit;
mod winograd;

/// Bytes of one im2col tile: about half a typical L2.
const TILE_BYTES: usize = 512 * 1024;
/// Bytes of a strided input gradient's column buffer, at least (see `input_grad`).
const COLUMN_BUFFER_BYTES: usize = 8 << 20;

/// What a convolution runs with: the device's scratch arena and its algorithm choice.
#[derive(Clone, Copy)]
pub(crate) struct Setup<'a> {
    pub arena: &'a Arena,
    pub algorithm: ConvAlgorithm,
}

impl Setup<'_> {
    fn winograd(&self, g: &Geom) -> bool {
        self.algorithm == ConvAlgorithm::Winograd && winograd::eligible(g)
    }
}

/// Shapes of one convolution.
#[derive(Debug, Clone, Copy)]
struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    p: Conv2dParams,
    /// Input and output channels per group.
    cg: usize,
    og: usize,
}

impl Geom {
    fn new(xs: &[usize], ws: &[usize], ys: &[usize], p: &Conv2dParams) -> Self {
        Self {
            n: xs[0],
            c: xs[1],
            h: xs[2],
            w: xs[3],
            o: ws[0],
            kh: ws[2],
            kw: ws[3],
            ho: ys[2],
            wo: ys[3],
            p: *p,
            cg: ws[1],
            og: ws[0] / p.groups,
        }
    }

    /// Columns of the im2col matrix (per group).
    fn k(&self) -> usize {
        self.kh * self.kw * self.cg
    }

    /// Output pixels (rows of the GEMM).
    fn pixels(&self) -> usize {
        self.n * self.ho * self.wo
    }

    /// A 1×1, stride-1, unpadded convolution: the NHWC input is the im2col matrix.
    fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.p.stride == [1, 1] && self.p.padding == [0, 0]
    }

    /// Output pixels per tile. An im2col tile is sized to stay in L2; a pointwise convolution
    /// reads its input in place, so its tiles only split the work — one per thread, as large
    /// as that allows: each GEMM call packs all of B again (megabytes in the deep layers: two
    /// tiles per thread made 512→2048 and 2048→512 at 7² 5–8% slower forward + backward,
    /// interleaved in one process), and in the weight gradient each tile is a pass over the
    /// accumulator.
    fn tile_rows<C>(&self) -> usize {
        if self.pointwise() {
            let per_tile = self.pixels().div_ceil(parallel::threads());
            return per_tile.next_multiple_of(8).max(16);
        }
        (TILE_BYTES / (self.k() * std::mem::size_of::<C>()).max(1)).clamp(16, 2048) / 8 * 8
    }

    /// For output pixel `r` and tap `(ky, kx)`: the NHWC index of the input pixel, or None in
    /// the padding.
    #[inline]
    fn source(&self, r: usize, ky: usize, kx: usize) -> Option<usize> {
        let (ox, rest) = (r % self.wo, r / self.wo);
        let (oy, b) = (rest % self.ho, rest / self.ho);
        let iy =
            (oy * self.p.stride[0] + ky * self.p.dilation[0]).checked_sub(self.p.padding[0])?;
        let ix =
            (ox * self.p.stride[1] + kx * self.p.dilation[1]).checked_sub(self.p.padding[1])?;
        (iy < self.h && ix < self.w).then(|| (b * self.h + iy) * self.w + ix)
    }

    /// Gathers rows `rows` of group `g`'s im2col matrix into `cols` (row-major, `k()` columns).
    fn im2col<C: Real>(&self, x: &[C], g: usize, rows: std::ops::Range<usize>, cols: &mut [C]) {
        let (cg, k) = (self.cg, self.k());
        for (i, r) in rows.enumerate() {
            let row = &mut cols[i * k..(i + 1) * k];
            for ky in 0..self.kh {
                for kx in 0..self.kw {
                    let at = (ky * self.kw + kx) * cg;
                    let dst = &mut row[at..at + cg];
                    match self.source(r, ky, kx) {
                        Some(px) => {
                            let from = px * self.c + g * cg;
                            dst.copy_from_slice(&x[from..from + cg]);
                        }
                        None => dst.fill(C::ZERO),
                    }
                }
            }
        }
    }
}

impl Geom {
    /// For a stride-1, ungrouped convolution whose padding allows it: the geometry of the
    /// convolution that computes its input gradient (g ⋆ flipped kernel, padding d(k-1) - p).
    fn transposed(&self) -> Option<Geom> {
        if self.p.stride != [1, 1] || self.p.groups != 1 {
            return None;
        }
        let [dh, dw] = self.p.dilation;
        let ph = (dh * (self.kh - 1)).checked_sub(self.p.padding[0])?;
        let pw = (dw * (self.kw - 1)).checked_sub(self.p.padding[1])?;
        Some(Geom {
            n: self.n,
            c: self.o,
            h: self.ho,
            w: self.wo,
            o: self.c,
            kh: self.kh,
            kw: self.kw,
            ho: self.h,
            wo: self.w,
            p: Conv2dParams {
                padding: [ph, pw],
                ..self.p
            },
            cg: self.o,
            og: self.c,
        })
    }
}

/// A convolution's OIHW weights as the GEMM's B matrix: `[KH·KW·C/g, O]` (row `(ky, kx, c)`)
/// for the forward pass, or `flipped` — `[KH·KW·O, C]`, row `(ky, kx, o)` holding
/// `w[o, c, KH-1-ky, KW-1-kx]` — for an input gradient computed as a convolution. Read in place
/// where the GEMM allows (packed straight from OIHW, or a strided view of a 1×1 kernel), so a
/// step does not relayout every weight on the way in.
#[derive(Clone, Copy)]
struct Weights<'a, C> {
    data: &'a [C],
    l: &'a Layout,
    flipped: bool,
}

impl<'a, C: Real> Weights<'a, C> {
    fn new(data: &'a [C], l: &'a Layout, flipped: bool) -> Self {
        Self { data, l, flipped }
    }

    /// `(O, C/g, KH, KW)`.
    fn dims(&self) -> [usize; 4] {
        let s = self.l.shape();
        [s[0], s[1], s[2], s[3]]
    }

    fn rows(&self) -> usize {
        let [o, cg, kh, kw] = self.dims();
        kh * kw * if self.flipped { o } else { cg }
    }

    fn cols(&self) -> usize {
        let [o, cg, ..] = self.dims();
        if self.flipped {
            cg
        } else {
            o
        }
    }

    /// Where row `p` of B starts in `data`.
    fn row(&self, p: usize) -> usize {
        let [o, cg, kh, kw] = self.dims();
        let st = self.l.strides();
        if self.flipped {
            let (tap, oo) = (p / o, p % o);
            let (ky, kx) = (tap / kw, tap % kw);
            self.l.offset() + oo * st[0] + (kh - 1 - ky) * st[2] + (kw - 1 - kx) * st[3]
        } else {
            let (tap, c) = (p / cg, p % cg);
            let (ky, kx) = (tap / kw, tap % kw);
            self.l.offset() + c * st[1] + ky * st[2] + kx * st[3]
        }
    }

    /// Where the tap `(ky, kx)` from input channel `i` to output channel `j` of the
    /// convolution these weights compute lies in `data` (flipped: `i` is an output channel of
    /// the weights and the tap is mirrored).
    fn at(&self, i: usize, j: usize, ky: usize, kx: usize) -> usize {
        let [_, _, kh, kw] = self.dims();
        let st = self.l.strides();
        let (o, c, y, x) = if self.flipped {
            (i, j, kh - 1 - ky, kw - 1 - kx)
        } else {
            (j, i, ky, kx)
        };
        self.l.offset() + o * st[0] + c * st[1] + y * st[2] + x * st[3]
    }

    /// The same weights as f32, when they are.
    fn as_f32(&self) -> Option<Weights<'a, f32>> {
        Some(Weights {
            data: C::as_f32(self.data)?,
            l: self.l,
            flipped: self.flipped,
        })
    }

    /// The distance between B's columns in `data`.
    fn col_stride(&self) -> usize {
        self.l.strides()[if self.flipped { 1 } else { 0 }]
    }

    /// B packed for our GEMM kernels straight from the weights (f32 only).
    fn packed(&self) -> Option<PackedB> {
        let data = C::as_f32(self.data)?;
        let (rows, cols) = (self.rows(), self.cols());
        if rows == 0 || cols == 0 {
            return None;
        }
        let st = self.l.strides();
        let last = self.l.offset()
            + self
                .dims()
                .iter()
                .zip(st)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>();
        assert!(last < data.len(), "conv: weights out of bounds");
        // SAFETY: every row(p) + j·col_stride is an element of the weight layout, whose
        // largest address `last` lies in `data` (checked above).
        Some(unsafe {
            PackedB::from_rows(
                |p| data[self.row(p)..].as_ptr(),
                self.col_stride() as isize,
                rows,
                cols,
            )
        })
    }

    /// B as a matrix: a strided view of a 1×1 kernel (one stride per axis), else a dense
    /// row-major copy.
    fn matrix(&self) -> WeightMatrix<'a, C> {
        let [o, cg, kh, kw] = self.dims();
        let st = self.l.strides();
        if kh == 1 && kw == 1 {
            let strides = if self.flipped {
                [st[0], st[1]]
            } else {
                [st[1], st[0]]
            };
            return WeightMatrix {
                data: Dense::Borrowed(self.data),
                offset: self.l.offset(),
                strides,
            };
        }
        let (rows, cols) = (self.rows(), self.cols());
        if !self.flipped {
            // [O, C/g, KH, KW] → [KH, KW, C/g, O] by the parallel relayout.
            let order = Layout::contiguous(&[kh, kw, cg, o]);
            let permuted = self
                .l
                .permute(&[2, 3, 1, 0])
                .unwrap_or_else(|_| order.clone());
            return WeightMatrix {
                data: dense(self.data, &permuted, &order),
                offset: 0,
                strides: [cols, 1],
            };
        }
        let mut dense = overwritten::<C>(rows * cols);
        for (p, row) in dense.chunks_mut(cols.max(1)).enumerate() {
            let (at, step) = (self.row(p), self.col_stride());
            for (j, v) in row.iter_mut().enumerate() {
                *v = self.data[at + j * step];
            }
        }
        WeightMatrix {
            data: Dense::Owned(dense),
            offset: 0,
            strides: [cols, 1],
        }
    }
}

/// B `[K, N]` of [`Weights::matrix`]: data, offset and strides.
struct WeightMatrix<'a, C: Real> {
    data: Dense<'a, C>,
    offset: usize,
    strides: [usize; 2],
}

impl<C: Real> WeightMatrix<'_, C> {
    /// B's columns from `first` on (a group's block).
    fn block(&self, first: usize) -> Mat<'_, C> {
        Mat {
            data: &self.data,
            offset: self.offset + first * self.strides[1],
            strides: self.strides,
        }
    }

    /// The transpose of [`WeightMatrix::block`]: `[N, K]` from column `first` on.
    fn block_t(&self, first: usize) -> Mat<'_, C> {
        Mat {
            data: &self.data,
            offset: self.offset + first * self.strides[1],
            strides: [self.strides[1], self.strides[0]],
        }
    }
}

/// The weight gradient in OIHW from `count` partials laid out `[KH·KW·C/g, O]` (row
/// `(ky, kx, c)`), summed in partial order (bits fixed for a given partial count). Threads take
/// blocks of 16 input channels: a block's rows (every tap of those channels) are read
/// sequentially and summed into a scratch block (in L2), which is then written out as one
/// contiguous run of `16·KH·KW` per output channel. (An element-wise strided relayout of a
/// deep layer's 9 MB gradient missed the cache on nearly every element.)
fn sum_into_oihw<C: Real>(g: &Geom, parts: &[C], count: usize) -> Vec<C> {
    const BLOCK: usize = 16;
    let (k, o, cg, taps) = (g.k(), g.o, g.cg, g.kh * g.kw);
    let parts = &parts[..count * k * o];
    let mut dw = overwritten::<C>(o * cg * taps);
    let out = Disjoint::new(&mut dw);
    let task = |cb: usize| {
        let cs = cb * BLOCK..((cb + 1) * BLOCK).min(cg);
        let width = cs.len();
        // scratch[(tap, c - cs.start)] is row (tap, c) of the summed gradient.
        let mut scratch = Vec::with_capacity(taps * width * o);
        for tap in 0..taps {
            for c in cs.clone() {
                let at = (tap * cg + c) * o;
                let first = scratch.len();
                scratch.extend_from_slice(&parts[at..at + o]);
                for part in 1..count {
                    let row = &parts[part * k * o + at..part * k * o + at + o];
                    for (s, &v) in scratch[first..].iter_mut().zip(row) {
                        *s += v;
                    }
                }
            }
        }
        for oo in 0..o {
            let start = (oo * cg + cs.start) * taps;
            // SAFETY: output channel oo's input channels `cs`: this block's alone.
            let run = unsafe { out.slice(start..start + width * taps) };
            for (ci, row) in run.chunks_exact_mut(taps).enumerate() {
                for (tap, v) in row.iter_mut().enumerate() {
                    *v = scratch[(tap * width + ci) * o + oo];
                }
            }
        }
    };
    let blocks = cg.div_ceil(BLOCK);
    if count * k * o < 1 << 14 {
        (0..blocks).for_each(task);
    } else {
        parallel::for_each_task(blocks, task);
    }
    dw
}

/// A channels-last (NHWC) copy of a logically NCHW view, borrowed when it already is one.
fn nhwc<'a, C: Real>(src: &'a [C], l: &Layout) -> Dense<'a, C> {
    match Layout::channels_last(l.shape()) {
        Ok(order) => dense(src, l, &order),
        Err(_) => Dense::Borrowed(src),
    }
}

/// An NHWC result written in the caller's dense layout `out` (of the same logical shape).
fn finish<C: Real>(dtype: redline_tensor::DType, values: Vec<C>, out: &Layout) -> Data {
    match Layout::channels_last(out.shape()) {
        Ok(order) => written_in(dtype, values, &order, out),
        Err(_) => from_compute(dtype, values),
    }
}

/// `values`, dense in `order`, written in the caller's dense layout `out` (the same logical
/// shape): handed on as they are when the two agree.
fn written_in<C: Real>(
    dtype: redline_tensor::DType,
    values: Vec<C>,
    order: &Layout,
    out: &Layout,
) -> Data {
    let converted = dense(&values, order, out);
    if let Dense::Borrowed(_) = converted {
        drop(converted);
        return from_compute(dtype, values);
    }
    let converted = converted.into_owned();
    recycle(values);
    from_compute(dtype, converted)
}

/// Runs `f(part, tiles)` over the tiles of `rows` output pixels, split across threads.
fn tiles(rows: usize, tile: usize, f: impl Fn(usize, std::ops::Range<usize>) + Sync) -> usize {
    let count = rows.div_ceil(tile);
    let parts = parallel::parts_for(count, 1);
    parallel::for_parts(count, parts, f);
    parts
}

fn tile_range(t: usize, tile: usize, rows: usize) -> std::ops::Range<usize> {
    t * tile..((t + 1) * tile).min(rows)
}

pub(crate) fn conv2d(
    cx: Setup<'_>,
    x: &Data,
    xl: &Layout,
    w: &Data,
    wl: &Layout,
    p: &Conv2dParams,
    out: &Layout,
) -> Data {
    with_compute!(x.dtype(), C => {
        let g = Geom::new(xl.shape(), wl.shape(), out.shape(), p);
        let (xs, ws) = (as_compute::<C>(x), as_compute::<C>(w));
        let y = forward::<C>(cx, &g, &nhwc(&xs, xl), Weights::new(&ws, wl, false));
        finish(x.dtype(), y, out)
    })
}

fn forward<C: Real + Pooled>(cx: Setup<'_>, g: &Geom, x: &[C], w: Weights<'_, C>) -> Vec<C> {
    let arena = cx.arena;
    if cx.winograd(g) {
        if let (Some(x), Some(w)) = (C::as_f32(x), w.as_f32()) {
            return C::from_f32s(winograd::forward(arena, g, x, &w));
        }
    }
    if implicit::eligible(g) && !g.pointwise() {
        if let (Some(x), Some(b)) = (C::as_f32(x), w.packed()) {
            return C::from_f32s(implicit::forward(g, x, &b));
        }
    }
    let wm = w.matrix();
    let (rows, k, o) = (g.pixels(), g.k(), g.o);
    let tile = g.tile_rows::<C>();
    let mut y = overwritten::<C>(rows * o);
    let out = Disjoint::new(&mut y);
    // The weights are packed once and shared by every tile and thread.
    let weights: Vec<SharedB<C>> = (0..g.p.groups)
        .map(|grp| SharedB::new(wm.block(grp * g.og), k, g.og))
        .collect();
    tiles(rows, tile, |_, range| {
        let mut cols = arena.take::<C>(if g.pointwise() { 0 } else { tile * k });
        for t in range {
            let r = tile_range(t, tile, rows);
            for (grp, b) in weights.iter().enumerate() {
                // SAFETY: tiles are disjoint row ranges of y.
                let dst = unsafe { out.slice(r.start * o + grp * g.og..r.end * o) };
                if g.pointwise() {
                    let a = Mat {
                        data: x,
                        offset: grp * g.cg,
                        strides: [g.c, 1],
                    };
                    b.gemm_rows(a, k, g.og, r.clone(), dst, o, false);
                } else {
                    g.im2col(x, grp, r.clone(), &mut cols);
                    let a = Mat {
                        data: &cols[..],
                        offset: 0,
                        strides: [k, 1],
                    };
                    b.gemm_rows(a, k, g.og, 0..r.len(), dst, o, false);
                }
            }
        }
    });
    y
}

pub(crate) fn conv2d_input_grad(
    cx: Setup<'_>,
    gy: &Data,
    gl: &Layout,
    w: &Data,
    wl: &Layout,
    p: &Conv2dParams,
    out: &Layout,
) -> Data {
    with_compute!(gy.dtype(), C => {
        let g = Geom::new(out.shape(), wl.shape(), gl.shape(), p);
        let (gs, ws) = (as_compute::<C>(gy), as_compute::<C>(w));
        let dx = match g.transposed() {
            // Stride 1, one group: the gradient is itself a convolution — of g by the flipped,
            // transposed kernel — so it runs on the forward path (no col2im scatter).
            Some(t) => {
                forward::<C>(cx, &t, &nhwc(&gs, gl), Weights::new(&ws, wl, true))
            }
            None => {
                let (gs, w) = (nhwc(&gs, gl), Weights::new(&ws, wl, false));
                match (C::as_f32(&gs), w.as_f32()) {
                    (Some(gy), Some(w)) if implicit::eligible_input_grad_phases(&g) => {
                        C::from_f32s(implicit::input_grad_phases(&g, gy, &w))
                    }
                    _ => input_grad::<C>(cx.arena, &g, &gs, w),
                }
            }
        };
        finish(gy.dtype(), dx, out)
    })
}

fn input_grad<C: Real + Pooled>(arena: &Arena, g: &Geom, gy: &[C], w: Weights<'_, C>) -> Vec<C> {
    let (rows, k, o, c) = (g.pixels(), g.k(), g.o, g.c);
    let tile = g.tile_rows::<C>();
    // Pointwise: every element is written by the GEMMs (no fill pass); else col2im adds into it.
    let mut dx = if g.pointwise() {
        overwritten::<C>(g.n * g.h * g.w * c)
    } else {
        zeros::<C>(g.n * g.h * g.w * c)
    };
    let out = Disjoint::new(&mut dx);
    // wmatᵀ of each group, [og, k] (pointwise: k = cg), packed once for every tile and thread.
    let wm = w.matrix();
    let wt: Vec<SharedB<C>> = (0..g.p.groups)
        .map(|grp| {
            SharedB::new(
                wm.block_t(grp * g.og),
                g.og,
                if g.pointwise() { g.cg } else { k },
            )
        })
        .collect();
    if g.pointwise() {
        // dx rows are the output pixels: a plain GEMM, rows split freely.
        tiles(rows, tile, |_, range| {
            for t in range {
                let r = tile_range(t, tile, rows);
                for (grp, wt) in wt.iter().enumerate() {
                    let a = Mat {
                        data: gy,
                        offset: grp * g.og,
                        strides: [o, 1],
                    };
                    // SAFETY: tiles are disjoint row ranges of dx.
                    let dst = unsafe { out.slice(r.start * c + grp * g.cg..r.end * c) };
                    wt.gemm_rows(a, g.og, g.cg, r.clone(), dst, c, false);
                }
            }
        });
        return dx;
    }
    // col2im scatters across tile boundaries within an image: parts own whole images, and a
    // part's tiles run across its images. A tile has at least as many rows as B has (`og`),
    // and a k×k kernel's at least 8 MB of columns: every GEMM call packs B again
    // (matrixmultiply), and a deep layer's B is megabytes (3×3 stride 2 at 512 channels: 9 MB
    // packed per 24-row tile once) — a bigger column buffer costs less (the 3×3 stride-2
    // layers at 256 and 512 channels 5–10% faster forward + backward than with `og` rows).
    let per_image = g.ho * g.wo;
    let min_rows = if g.kh * g.kw > 1 {
        g.og.max(COLUMN_BUFFER_BYTES / (k * std::mem::size_of::<C>()).max(1))
    } else {
        g.og
    };
    parallel::for_parts(g.n, parallel::parts_for(g.n, 1), |_, images| {
        let rows = images.start * per_image..images.end * per_image;
        let tile = tile.max(min_rows).min(rows.len()).max(1);
        let mut cols = arena.take::<C>(tile * k);
        // SAFETY: this part owns the input-gradient planes of `images`.
        let dx = unsafe { out.slice(images.start * g.h * g.w * c..images.end * g.h * g.w * c) };
        let base = images.start * g.h * g.w * c;
        for t in 0..rows.len().div_ceil(tile) {
            let r = tile_range(t, tile, rows.len());
            let r = rows.start + r.start..rows.start + r.end;
            for (grp, wt) in wt.iter().enumerate() {
                let a = Mat {
                    data: gy,
                    offset: grp * g.og,
                    strides: [o, 1],
                };
                wt.gemm_rows(a, g.og, k, r.clone(), &mut cols, k, false);
                g.col2im_at(&cols, grp, r.clone(), dx, base);
            }
        }
    });
    dx
}

impl Geom {
    /// `col2im` into a slice of dx that starts at NHWC element `base`.
    fn col2im_at<C: Real>(
        &self,
        cols: &[C],
        g: usize,
        rows: std::ops::Range<usize>,
        dx: &mut [C],
        base: usize,
    ) {
        let (cg, k) = (self.cg, self.k());
        for (i, r) in rows.enumerate() {
            let row = &cols[i * k..(i + 1) * k];
            for ky in 0..self.kh {
                for kx in 0..self.kw {
                    if let Some(px) = self.source(r, ky, kx) {
                        let at = (ky * self.kw + kx) * cg;
                        let to = px * self.c + g * cg - base;
                        for (d, &s) in dx[to..to + cg].iter_mut().zip(&row[at..at + cg]) {
                            *d += s;
                        }
                    }
                }
            }
        }
    }
}

pub(crate) fn conv2d_weight_grad(
    cx: Setup<'_>,
    x: &Data,
    xl: &Layout,
    gy: &Data,
    gl: &Layout,
    p: &Conv2dParams,
    out: &Layout,
) -> Data {
    with_compute!(x.dtype(), C => {
        let g = Geom::new(xl.shape(), out.shape(), gl.shape(), p);
        let (xs, gs) = (as_compute::<C>(x), as_compute::<C>(gy));
        let dw = weight_grad::<C>(cx, &g, &nhwc(&xs, xl), &nhwc(&gs, gl));
        // Computed OIHW; a channels-last weight's gradient (autocast beside channels-last
        // activations) is reordered in one pass over the weight, small beside the convolution.
        written_in(x.dtype(), dw, &Layout::contiguous(out.shape()), out)
    })
}

fn weight_grad<C: Real + Pooled>(cx: Setup<'_>, g: &Geom, x: &[C], gy: &[C]) -> Vec<C> {
    let arena = cx.arena;
    if cx.winograd(g) {
        if let (Some(x), Some(gy)) = (C::as_f32(x), C::as_f32(gy)) {
            return C::from_f32s(winograd::weight_grad(g, x, gy));
        }
    }
    if implicit::eligible_weight_grad_gathered(g) {
        if let (Some(x), Some(gy)) = (C::as_f32(x), C::as_f32(gy)) {
            return C::from_f32s(implicit::weight_grad_gathered(g, x, gy));
        }
    }
    if implicit::eligible_weight_grad_rows(g) && !g.pointwise() {
        if let (Some(x), Some(gy)) = (C::as_f32(x), C::as_f32(gy)) {
            return C::from_f32s(implicit::weight_grad_rows(g, x, gy));
        }
    }
    if implicit::eligible_weight_grad(g) && !g.pointwise() {
        if let (Some(x), Some(gy)) = (C::as_f32(x), C::as_f32(gy)) {
            return C::from_f32s(implicit::weight_grad(arena, g, x, gy));
        }
    }
    let deep_pointwise = g.pointwise() && 2 * g.cg >= g.pixels();
    if implicit::eligible_weight_grad_by_pixels(g) && !deep_pointwise {
        if let (Some(x), Some(gy)) = (C::as_f32(x), C::as_f32(gy)) {
            return C::from_f32s(implicit::weight_grad_by_pixels(g, x, gy));
        }
    }
    // Deep 1×1 layers (many channels, few pixels): one GEMM over all pixels beats per-tile
    // partials, each a pass over the whole [channels, outputs] accumulator.
    if deep_pointwise {
        return pointwise_weight_grad(g, x, gy);
    }
    let (rows, k, o) = (g.pixels(), g.k(), g.o);
    // Each tile is a pass over the whole [k, o] partial: a k×k kernel's has at least 256 pixels
    // (3×3 stride 2 at 512 channels had 24, each a pass over 9.4 MB).
    let tile = if g.kh * g.kw > 1 {
        g.tile_rows::<C>().max(256)
    } else {
        g.tile_rows::<C>()
    };
    let count = rows.div_ceil(tile);
    let parts = parallel::parts_for(count, 1);
    let mut partials = zeros::<C>(parts * k * o);
    let out = Disjoint::new(&mut partials);
    parallel::for_parts(count, parts, |part, range| {
        // SAFETY: each part owns its own partial.
        let acc = unsafe { out.slice(part * k * o..(part + 1) * k * o) };
        let mut cols = arena.take::<C>(if g.pointwise() { 0 } else { tile * k });
        for t in range {
            let r = tile_range(t, tile, rows);
            for grp in 0..g.p.groups {
                let b = Mat {
                    data: gy,
                    offset: r.start * o + grp * g.og,
                    strides: [o, 1],
                };
                let dst = &mut acc[grp * g.og..];
                if g.pointwise() {
                    // xᵀ of the tile: [cg, rows].
                    let a = Mat {
                        data: x,
                        offset: r.start * g.c + grp * g.cg,
                        strides: [1, g.c],
                    };
                    gemm_rows(a, b, r.len(), g.og, 0..k, dst, o, true);
                } else {
                    g.im2col(x, grp, r.clone(), &mut cols);
                    let a = Mat {
                        data: &cols[..],
                        offset: 0,
                        strides: [1, k],
                    };
                    gemm_rows(a, b, r.len(), g.og, 0..k, dst, o, true);
                }
            }
        }
    });
    // Partials summed in part order: fixed for a given thread count.
    let dw = sum_into_oihw(g, &partials, parts);
    recycle(partials);
    dw
}

/// A 1×1 convolution's weight gradient, per group `dW[cg, og] = xᵀ[cg, pixels] · gy[pixels,
/// og]` as one GEMM over every pixel: gy is packed once and threads split the input channels,
/// so each output element is written once (no per-tile partials to add up). For few pixels:
/// the packed gy is then small.
fn pointwise_weight_grad<C: Real>(g: &Geom, x: &[C], gy: &[C]) -> Vec<C> {
    let (rows, o) = (g.pixels(), g.o);
    let mut dw = overwritten::<C>(g.cg * o);
    let out = Disjoint::new(&mut dw);
    for grp in 0..g.p.groups {
        let b = Mat {
            data: gy,
            offset: grp * g.og,
            strides: [o, 1],
        };
        let b = SharedB::new(b, rows, g.og);
        let parts = parallel::parts_for(g.cg, 16);
        parallel::for_parts(g.cg, parts, |_, channels| {
            if channels.is_empty() {
                return;
            }
            let a = Mat {
                data: x,
                offset: grp * g.cg,
                strides: [1, g.c],
            };
            let start = channels.start * o + grp * g.og;
            let end = (channels.end - 1) * o + grp * g.og + g.og;
            // SAFETY: the rows `channels` of this group's block: disjoint across parts.
            let dst = unsafe { out.slice(start..end) };
            b.gemm_rows(a, rows, g.og, channels, dst, o, false);
        });
    }
    let oihw = sum_into_oihw(g, &dw, 1);
    recycle(dw);
    oihw
}

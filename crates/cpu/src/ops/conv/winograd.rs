//! 3×3 stride-1 f32 convolutions by Winograd's minimal filtering F(4×4, 3×3) (Lavin & Gray,
//! "Fast Algorithms for Convolutional Neural Networks", 2016) — the `winograd` algorithm of
//! cuDNN and oneDNN: 36 multiplications per 4×4 block of outputs and channel pair instead of
//! 144, a quarter of a direct convolution's.
//!
//! Each 4×4 block of outputs (a *tile*) comes from the 6×6 input patch around it: the patch is
//! transformed (`V = Bᵀ d B`), multiplied element-wise by the transformed kernel (`U = G g Gᵀ`),
//! summed over input channels and transformed back (`Y = Aᵀ M A`). Summing over channels at
//! each of the 36 transform positions ξ is a GEMM, `M[ξ] = V[ξ] · U[ξ]` (tiles × C by C × O),
//! so the work is 36 GEMMs on the GEMM kernels plus transforms that are a few adds per value.
//!
//! The interpolation points are 0, ±1, 1/2, −2 and ∞ rather than Lavin's 0, ±1, ±2, ∞: in f32
//! they round about 2.5× less (largest error over the output's RMS, against an f64 direct
//! convolution on ResNet-50's shapes with post-ReLU inputs: 5–7·10⁻⁶, against 1.4–1.6·10⁻⁵;
//! a direct f32 convolution's is ~2·10⁻⁷ there). Rows of `Bᵀ` are scaled to small integer
//! and half coefficients, `G`'s inversely, which leaves the product unchanged.
//!
//! Everything is channels-last: the channels of a pixel are the SIMD lanes of every transform.
//! The forward pass takes tiles in blocks whose `V` and `M` stay in L2; the weight gradient is
//! the adjoint — `dU[ξ] = V[ξ]ᵀ · dM[ξ]` with `dM = A dY Aᵀ`, then `dW = Gᵀ dU G` — one GEMM
//! per ξ over every tile, so no partial sums and no dependence on the thread count. The input
//! gradient is the forward convolution of the output gradient by the flipped kernel
//! (`conv.rs`). Every output element is a fixed sequence of operations: the same bits on every
//! run, whatever the threads do.

use std::ops::Range;

use crate::arena::Arena;
use crate::buffer::{overwritten, recycle};
use crate::ops::matmul::{gemm_rows, packed_gemm_rows, Mat};
use crate::parallel::{self, Disjoint};
use crate::sgemm::{self, PackedBlocks};

use super::{Geom, Weights};

/// Outputs per tile side.
const TILE: usize = 4;
/// Inputs per tile side (the patch): TILE + 3 − 1.
const PATCH: usize = 6;
/// Transform positions ξ per tile: PATCH².
const POSITIONS: usize = PATCH * PATCH;
/// Channels a transform handles at once: the SIMD lanes.
const LANES: usize = 16;
/// Fewer input or output channels than this: the direct convolution (the GEMMs would be
/// thinner than the kernels' tiles).
const MIN_CHANNELS: usize = 16;
/// Bytes of a forward block's `V` and `M` together: about half an L2.
const BLOCK_BYTES: usize = 1 << 20;
/// Tiles per forward block, at least: GEMM rows (a multiple of both kernels' row tiles).
const MIN_BLOCK_TILES: usize = 24;
/// A transformed kernel up to this size stays in cache while blocks of tiles pass over it.
const CACHED_KERNEL_BYTES: usize = 1 << 20;
/// Tiles per forward block when the kernel does not stay in cache: every block streams it, so
/// blocks are as tall as the GEMM's row block (12 × 12).
const STREAMING_BLOCK_TILES: usize = 144;
/// Output channels per column block, at least (one of the kernels' 32-column panels).
const MIN_BLOCK_COLUMNS: usize = 32;
/// Fewer tiles than this (a whole batch's): the direct convolution. The transformed kernel is
/// four times the weights and every tile row of the GEMMs passes over it, so with few tiles
/// (512 channels at 7×7, batch 8: 32) writing and reading it costs more than the
/// multiplications saved (measured 0.6–0.9× there, forward and both gradients).
const MIN_TILES: usize = 64;
/// Bytes of the weight gradient's `V` and `dM` together per chunk of tiles (chunks are
/// accumulated into `dU`): about an L2, so the GEMMs read them from cache …
const GRAD_CHUNK_BYTES: usize = 4 << 20;
/// … but each chunk at least this many times `dU`'s size, which every chunk reads and writes
/// again (a deep layer's `dU` is megabytes).
const GRAD_CHUNK_PER_DU: usize = 8;

type Lanes = [f32; LANES];
/// A tile's 36 transformed values per lane: `[a][b]` is position ξ = 6a + b.
type Square = [[Lanes; PATCH]; PATCH];
const ZERO: Lanes = [0.0; LANES];

/// Whether `g` runs here: 3×3, stride 1, no dilation, one group, enough channels.
pub(super) fn eligible(g: &Geom) -> bool {
    g.kh == 3
        && g.kw == 3
        && g.p.stride == [1, 1]
        && g.p.dilation == [1, 1]
        && g.p.groups == 1
        && g.c >= MIN_CHANNELS
        && g.o >= MIN_CHANNELS
        && Tiles::new(g).count() >= MIN_TILES
}

/// `Bᵀ d` along one axis (rows of `Bᵀ` scaled by 2, 6, 6, 15/16, 15, 2).
#[inline(always)]
fn input_1d(d: &[Lanes; PATCH]) -> [Lanes; PATCH] {
    let mut v = [ZERO; PATCH];
    for l in 0..LANES {
        let [d0, d1, d2, d3, d4, d5] = [d[0][l], d[1][l], d[2][l], d[3][l], d[4][l], d[5][l]];
        v[0][l] = 2.0 * (d0 + d4) - 3.0 * (d1 - d3) - 4.0 * d2;
        v[1][l] = -2.0 * (d1 - d4) + d2 + 5.0 * d3;
        v[2][l] = -2.0 * (d1 + d4) + 5.0 * d2 - d3;
        v[3][l] = 2.0 * (d1 - d3) + d2 - d4;
        v[4][l] = 0.5 * (d1 - d3) - d2 + d4;
        v[5][l] = 2.0 * (d1 + d5) - 3.0 * (d2 - d4) - 4.0 * d3;
    }
    v
}

/// `Aᵀ m` along one axis: 6 transformed values → 4 outputs.
#[inline(always)]
fn output_1d(m: &[Lanes; PATCH]) -> [Lanes; TILE] {
    let mut y = [ZERO; TILE];
    for l in 0..LANES {
        let [m0, m1, m2, m3, m4, m5] = [m[0][l], m[1][l], m[2][l], m[3][l], m[4][l], m[5][l]];
        let (sum, diff) = (m1 + m2, m1 - m2);
        y[0][l] = m0 + sum + m3 + m4;
        y[1][l] = diff + 0.5 * m3 - 2.0 * m4;
        y[2][l] = sum + 0.25 * m3 + 4.0 * m4;
        y[3][l] = diff + 0.125 * m3 - 8.0 * m4 + m5;
    }
    y
}

const SIXTH: f32 = 1.0 / 6.0;
const FIFTEENTH: f32 = 1.0 / 15.0;

/// `G g` along one axis: 3 kernel taps → 6 (rows of `G` scaled inversely to `Bᵀ`'s).
#[inline(always)]
fn kernel_1d(g: &[Lanes; 3]) -> [Lanes; PATCH] {
    let mut u = [ZERO; PATCH];
    for l in 0..LANES {
        let [g0, g1, g2] = [g[0][l], g[1][l], g[2][l]];
        u[0][l] = 0.5 * g0;
        u[1][l] = SIXTH * (g0 + g1 + g2);
        u[2][l] = SIXTH * (g0 - g1 + g2);
        u[3][l] = FIFTEENTH * (16.0 * g0 + 8.0 * g1 + 4.0 * g2);
        u[4][l] = FIFTEENTH * (g0 - 2.0 * g1 + 4.0 * g2);
        u[5][l] = 0.5 * g2;
    }
    u
}

/// `A dy`, the adjoint of [`output_1d`]: 4 output gradients → 6.
#[inline(always)]
fn output_grad_1d(y: &[Lanes; TILE]) -> [Lanes; PATCH] {
    let mut m = [ZERO; PATCH];
    for l in 0..LANES {
        let [y0, y1, y2, y3] = [y[0][l], y[1][l], y[2][l], y[3][l]];
        let (even, odd) = (y0 + y2, y1 + y3);
        m[0][l] = y0;
        m[1][l] = even + odd;
        m[2][l] = even - odd;
        m[3][l] = y0 + 0.5 * y1 + 0.25 * y2 + 0.125 * y3;
        m[4][l] = y0 - 2.0 * y1 + 4.0 * y2 - 8.0 * y3;
        m[5][l] = y3;
    }
    m
}

/// `Gᵀ u`, the adjoint of [`kernel_1d`]: 6 transformed gradients → 3 taps.
#[inline(always)]
fn kernel_grad_1d(u: &[Lanes; PATCH]) -> [Lanes; 3] {
    let mut g = [ZERO; 3];
    for l in 0..LANES {
        let [u0, u1, u2, u3, u4, u5] = [u[0][l], u[1][l], u[2][l], u[3][l], u[4][l], u[5][l]];
        let (sum, diff) = (u1 + u2, u1 - u2);
        g[0][l] = 0.5 * u0 + SIXTH * sum + FIFTEENTH * (16.0 * u3 + u4);
        g[1][l] = SIXTH * diff + FIFTEENTH * (8.0 * u3 - 2.0 * u4);
        g[2][l] = SIXTH * sum + FIFTEENTH * (4.0 * u3 + 4.0 * u4) + 0.5 * u5;
    }
    g
}

/// Runs `f` compiled for AVX-512 where the CPU has it: a lane array is then one zmm register
/// and a transform's operands fit the 32 registers (on AVX2, two ymm each and spills).
#[inline(always)]
fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if sgemm::isa() == Some(sgemm::Isa::Avx512) {
        #[target_feature(enable = "avx512f")]
        unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has AVX-512F.
        return unsafe { run(f) };
    }
    f()
}

/// `len ≤ LANES` values of `src` as lanes (zeros past `len`).
#[inline(always)]
fn load(src: &[f32], len: usize) -> Lanes {
    if len == LANES {
        // A fixed-size copy: vector moves. (The partial copy is a separate function: inlined,
        // LLVM merges both branches into one call to memcpy.)
        let mut lanes = ZERO;
        lanes.copy_from_slice(&src[..LANES]);
        lanes
    } else {
        load_partial(src, len)
    }
}

#[inline(never)]
fn load_partial(src: &[f32], len: usize) -> Lanes {
    let mut lanes = ZERO;
    lanes[..len].copy_from_slice(&src[..len]);
    lanes
}

/// The first `len ≤ LANES` lanes into `dst`.
#[inline(always)]
fn store(dst: &mut [f32], lanes: &Lanes, len: usize) {
    if len == LANES {
        dst[..LANES].copy_from_slice(lanes);
    } else {
        store_partial(dst, lanes, len);
    }
}

#[inline(never)]
fn store_partial(dst: &mut [f32], lanes: &Lanes, len: usize) {
    dst[..len].copy_from_slice(&lanes[..len]);
}

/// The tiles of a convolution's output: `n × th × tw`, tile `t` covering outputs
/// `[4·ty, 4·ty + 4) × [4·tx, 4·tx + 4)` of its image (clipped to the output).
#[derive(Clone, Copy)]
struct Tiles {
    g: Geom,
    th: usize,
    tw: usize,
}

impl Tiles {
    fn new(g: &Geom) -> Self {
        Self {
            g: *g,
            th: g.ho.div_ceil(TILE),
            tw: g.wo.div_ceil(TILE),
        }
    }

    fn count(&self) -> usize {
        self.g.n * self.th * self.tw
    }

    /// Tile `t`'s image and top-left output pixel.
    fn origin(&self, t: usize) -> (usize, usize, usize) {
        let (tx, rest) = (t % self.tw, t / self.tw);
        (rest / self.th, (rest % self.th) * TILE, tx * TILE)
    }

    /// The transformed input of tile `t`, channels `c0..c0 + len`: `v[a][b] = (Bᵀ d B)[a][b]`.
    #[inline(always)]
    fn input(&self, x: &[f32], t: usize, c0: usize, len: usize, v: &mut Square) {
        let g = &self.g;
        let (image, oy, ox) = self.origin(t);
        let mut rows = [[ZERO; PATCH]; PATCH];
        for (i, row) in rows.iter_mut().enumerate() {
            let Some(iy) = (oy + i).checked_sub(g.p.padding[0]).filter(|&iy| iy < g.h) else {
                continue; // a padding row: zeros
            };
            let mut patch = [ZERO; PATCH];
            for (j, lanes) in patch.iter_mut().enumerate() {
                if let Some(ix) = (ox + j).checked_sub(g.p.padding[1]).filter(|&ix| ix < g.w) {
                    *lanes = load(&x[((image * g.h + iy) * g.w + ix) * g.c + c0..], len);
                }
            }
            *row = input_1d(&patch);
        }
        columns_of(&rows, input_1d, v);
    }

    /// `A dY Aᵀ` of tile `t`'s output gradient, channels `k0..k0 + len` (zeros past the
    /// output's edge).
    #[inline(always)]
    fn output_grad(&self, gy: &[f32], t: usize, k0: usize, len: usize, m: &mut Square) {
        let g = &self.g;
        let (image, oy, ox) = self.origin(t);
        let mut rows = [[ZERO; PATCH]; TILE];
        for (i, row) in rows.iter_mut().enumerate().take(g.ho - oy) {
            let mut pixels = [ZERO; TILE];
            for (j, lanes) in pixels.iter_mut().enumerate().take(g.wo - ox) {
                *lanes = load(
                    &gy[((image * g.ho + oy + i) * g.wo + ox + j) * g.o + k0..],
                    len,
                );
            }
            *row = output_grad_1d(&pixels);
        }
        columns_of(&rows, output_grad_1d, m);
    }

    /// Writes tile `t`'s outputs `Aᵀ M A` for channels `k0..k0 + len` into NHWC `y`.
    ///
    /// # Safety
    /// No other thread writes these channels of tile `t`'s pixels.
    #[inline(always)]
    unsafe fn write_output(&self, m: &Square, t: usize, k0: usize, len: usize, y: &Disjoint<f32>) {
        let g = &self.g;
        let (image, oy, ox) = self.origin(t);
        let mut rows = [[ZERO; TILE]; PATCH];
        for (row, ma) in rows.iter_mut().zip(m) {
            *row = output_1d(ma);
        }
        let mut out = [[ZERO; TILE]; TILE];
        columns_of(&rows, output_1d, &mut out);
        for (i, row) in out.iter().enumerate().take(g.ho - oy) {
            for (j, lanes) in row.iter().enumerate().take(g.wo - ox) {
                let at = ((image * g.ho + oy + i) * g.wo + ox + j) * g.o + k0;
                // SAFETY: pixel (oy + i, ox + j) of this tile: the caller's contract.
                store(unsafe { y.slice(at..at + len) }, lanes, len);
            }
        }
    }
}

/// The second pass of a separable 2-D transform: `f` down each column of `rows`
/// (`rows[i][b]` → `out[a][b]`).
#[inline(always)]
fn columns_of<const I: usize, const B: usize, const A: usize>(
    rows: &[[Lanes; B]; I],
    f: impl Fn(&[Lanes; I]) -> [Lanes; A],
    out: &mut [[Lanes; B]; A],
) {
    for b in 0..B {
        let column: [Lanes; I] = std::array::from_fn(|i| rows[i][b]);
        for (a, lanes) in f(&column).into_iter().enumerate() {
            out[a][b] = lanes;
        }
    }
}

/// The distance between consecutive planes of `elems` values: an odd number of cache lines.
/// A transform reads or writes one row of all 36 planes at once; planes a multiple of 2 KiB
/// apart (64 channels × 56 tiles × 4 bytes is 14 KiB) would fall into two L1 sets and evict
/// each other on every access.
fn plane(elems: usize) -> usize {
    (elems.div_ceil(16) | 1) * 16
}

/// Channel chunks of at most [`LANES`]: `(first, len)`.
fn chunks(channels: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..channels)
        .step_by(LANES)
        .map(move |c0| (c0, LANES.min(channels - c0)))
}

/// A transform of one tile to its 36 values, channels `c0..c0 + len`.
trait TileTransform {
    fn tile(&self, t: usize, c0: usize, len: usize, v: &mut Square);
}

/// `Bᵀ d B` of the input's tiles.
struct Inputs<'a> {
    tiles: &'a Tiles,
    x: &'a [f32],
}

impl TileTransform for Inputs<'_> {
    #[inline(always)]
    fn tile(&self, t: usize, c0: usize, len: usize, v: &mut Square) {
        self.tiles.input(self.x, t, c0, len, v)
    }
}

/// `A dY Aᵀ` of the output gradient's tiles.
struct OutputGrads<'a> {
    tiles: &'a Tiles,
    gy: &'a [f32],
}

impl TileTransform for OutputGrads<'_> {
    #[inline(always)]
    fn tile(&self, t: usize, k0: usize, len: usize, m: &mut Square) {
        self.tiles.output_grad(self.gy, t, k0, len, m)
    }
}

/// Transforms of tiles `first..first + rows` into 36 planes of `[rows, width]` in `dst`
/// ([`plane`]`(rows · width)` apart):
/// `transform(tile, c0, len)` gives a tile's 36 values for channels `c0..c0 + len`. Threads
/// split the tiles when `threaded`.
fn transform_tiles(
    rows: usize,
    first: usize,
    width: usize,
    dst: &mut [f32],
    threaded: bool,
    transform: &(impl TileTransform + Sync),
) {
    let stride = plane(rows * width);
    let planes = Disjoint::new(dst);
    let parts = if threaded {
        parallel::parts_for(rows, 8)
    } else {
        1
    };
    parallel::for_parts(rows, parts, |_, range| {
        wide(
            #[inline(always)]
            || {
                let mut v = [[ZERO; PATCH]; PATCH];
                for r in range {
                    for (c0, len) in chunks(width) {
                        transform.tile(first + r, c0, len, &mut v);
                        for (xi, lanes) in v.iter().flatten().enumerate() {
                            let at = xi * stride + r * width + c0;
                            // SAFETY: row r of every plane belongs to this part.
                            store(unsafe { planes.slice(at..at + len) }, lanes, len);
                        }
                    }
                }
            },
        )
    });
}

/// The transformed kernel the GEMMs multiply by: for each ξ, `U[ξ]` (`[cin, cols]`, ξ = 6a + b
/// holding `(G g Gᵀ)[a][b]` for every input channel and the output channels `cols` of the
/// convolution `w` computes), in column blocks of `width` output channels. Written straight
/// into our GEMM kernel's packed layout where that kernel runs (no plain copy to pack
/// afterwards), else as plain planes.
struct Kernel {
    cin: usize,
    cols: Range<usize>,
    width: usize,
    blocks: usize,
    store: Store,
}

enum Store {
    /// Block `b` of ξ at `ξ · blocks + b`.
    Packed(Vec<PackedBlocks>),
    /// 36 row-major `[cin, cols]` planes.
    Plain(Vec<f32>),
}

impl Kernel {
    fn new(w: &Weights<'_, f32>, cin: usize, cols: Range<usize>, width: usize) -> Self {
        let ncols = cols.len();
        let blocks = ncols.div_ceil(width);
        // Output channels of block b, from 0 (relative to `cols`).
        let columns = |b: usize| b * width..((b + 1) * width).min(ncols);
        let packed = sgemm::available();
        let mut planes = if packed {
            let blocks = (0..POSITIONS * blocks)
                .map(|k| PackedBlocks::uninit(cin, columns(k % blocks).len()));
            Store::Packed(blocks.collect())
        } else {
            Store::Plain(overwritten::<f32>(POSITIONS * plane(cin * ncols)))
        };
        let outs: Vec<Disjoint<f32>> = match &mut planes {
            Store::Packed(p) => p.iter_mut().map(|p| Disjoint::new(p.data_mut())).collect(),
            Store::Plain(u) => vec![Disjoint::new(u)],
        };
        let planes_ref = &planes;
        // Where block b's column j of input i goes, for every ξ (each ξ's block has the same
        // layout): 16 lanes from a multiple of 16 are contiguous there. Packed, a block is
        // written over its whole padded width (zeros past its columns).
        let slot = |b: usize, i: usize, j: usize| -> usize {
            match planes_ref {
                Store::Packed(p) => p[b].offset(i, j),
                Store::Plain(_) => i * ncols + columns(b).start + j,
            }
        };
        let slots = |b: usize| {
            let n = columns(b).len();
            if packed {
                n.next_multiple_of(32)
            } else {
                n
            }
        };
        let plain_plane = plane(cin * ncols);
        // Weights are gathered a block of LANES inputs at a time into `g[ii][tap][j]`, read
        // along their contiguous axis (OIHW: a kernel's 9 taps, then its inputs): lane by lane
        // across output channels they would be 18 KiB apart at 512 channels, a page and a TLB
        // miss per value.
        let base = w.at(0, 0, 0, 0);
        let step = |i: usize, j: usize| w.at(i, j, 0, 0) - base;
        let (si, sj) = (step(1.min(cin - 1), 0), step(0, 1.min(ncols.max(2) - 1)));
        let taps: [usize; 9] = std::array::from_fn(|t| w.at(0, cols.start, t / 3, t % 3));
        let parts = parallel::parts_for(POSITIONS * cin * ncols, 1 << 15);
        let input_blocks = cin.div_ceil(LANES);
        parallel::for_parts(input_blocks, parts.min(input_blocks), |_, range| {
            let mut g = overwritten::<f32>(LANES * 9 * ncols);
            let (mut k, mut rows, mut u) =
                ([[ZERO; 3]; 3], [[ZERO; PATCH]; 3], [[ZERO; PATCH]; PATCH]);
            for ib in range {
                let (i0, ni) = (ib * LANES, LANES.min(cin - ib * LANES));
                let mut gather = |ii: usize, j: usize| {
                    let at = (i0 + ii) * si + j * sj;
                    for (t, &off) in taps.iter().enumerate() {
                        g[(ii * 9 + t) * ncols + j] = w.data[at + off];
                    }
                };
                if si <= sj {
                    (0..ncols).for_each(|j| (0..ni).for_each(|ii| gather(ii, j)));
                } else {
                    (0..ni).for_each(|ii| (0..ncols).for_each(|j| gather(ii, j)));
                }
                wide(
                    #[inline(always)]
                    || {
                        for ii in 0..ni {
                            for b in 0..blocks {
                                let block = columns(b);
                                for j in (0..slots(b)).step_by(LANES) {
                                    let len = LANES.min(block.len().saturating_sub(j));
                                    let from = block.start + j.min(block.len());
                                    for (t, lanes) in k.iter_mut().flatten().enumerate() {
                                        *lanes = load(&g[(ii * 9 + t) * ncols + from..], len);
                                    }
                                    for (row, kernel_row) in rows.iter_mut().zip(&k) {
                                        *row = kernel_1d(kernel_row);
                                    }
                                    columns_of(&rows, kernel_1d, &mut u);
                                    let at = slot(b, i0 + ii, j);
                                    let n = if packed { LANES } else { len };
                                    for (xi, lanes) in u.iter().flatten().enumerate() {
                                        let (part, at) = if packed {
                                            (xi * blocks + b, at)
                                        } else {
                                            (0, xi * plain_plane + at)
                                        };
                                        // SAFETY: row i0 + ii of every plane is this part's.
                                        store(unsafe { outs[part].slice(at..at + n) }, lanes, n);
                                    }
                                }
                            }
                        }
                    },
                );
            }
            recycle(g);
        });
        drop(outs);
        Self {
            cin,
            cols,
            width,
            blocks,
            store: planes,
        }
    }

    /// The output channels of column block `b`, relative to the kernel's first.
    fn columns(&self, b: usize) -> Range<usize> {
        b * self.width..((b + 1) * self.width).min(self.cols.len())
    }

    /// `c[rows, block b's columns] = a[rows, cin] · U[ξ]`, `c` row-major with row stride `ldc`.
    fn gemm(&self, xi: usize, b: usize, a: Mat<'_, f32>, rows: usize, c: &mut [f32], ldc: usize) {
        let cols = self.columns(b);
        match &self.store {
            Store::Packed(p) => {
                let p = &p[xi * self.blocks + b];
                packed_gemm_rows(p, a, self.cin, cols.len(), 0..rows, c, ldc, false);
            }
            Store::Plain(u) => {
                let plane = Mat {
                    data: &u[..],
                    offset: xi * plane(self.cin * self.cols.len()) + cols.start,
                    strides: [self.cols.len(), 1],
                };
                gemm_rows(a, plane, self.cin, cols.len(), 0..rows, c, ldc, false);
            }
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        if let Store::Plain(u) = &mut self.store {
            recycle(std::mem::take(u));
        }
    }
}

/// How the forward pass splits its work: tiles in blocks of `rows`, output channels in blocks
/// of `width` (all of them: the kernel is transformed once and shared by tasks over blocks of
/// tiles; fewer: tasks own column blocks, each transforming its slice of the kernel).
#[derive(Clone, Copy, Debug)]
struct Plan {
    rows: usize,
    width: usize,
}

impl Plan {
    fn new(tiles: usize, c: usize, o: usize) -> Self {
        let threads = parallel::threads();
        let kernel_bytes = POSITIONS * c * o * std::mem::size_of::<f32>();
        if kernel_bytes <= CACHED_KERNEL_BYTES {
            // The kernel stays in cache: blocks whose V and M stay in L2, enough for every
            // thread.
            let fit = BLOCK_BYTES / (POSITIONS * (c + o) * std::mem::size_of::<f32>());
            let per_thread = tiles.div_ceil(threads).next_multiple_of(12);
            let rows = fit.max(MIN_BLOCK_TILES).min(per_thread);
            return Self { rows, width: o };
        }
        // A kernel of megabytes (9.4 MB at 256 channels): written whole and read back by
        // every block of tiles, it went to memory and back at store bandwidth (a 256-channel
        // layer's transform took 2–4 ms in a training step). Each task transforms the slice
        // of its column block instead, which stays in cache while it passes over every tile.
        let blocks = (2 * threads).min(o / MIN_BLOCK_COLUMNS).max(1);
        let width = o.div_ceil(blocks).next_multiple_of(MIN_BLOCK_COLUMNS);
        Self {
            rows: STREAMING_BLOCK_TILES.min(tiles),
            width,
        }
    }
}

/// NHWC output of the NHWC input `x` convolved with `w` (the convolution `g`).
pub(super) fn forward(arena: &Arena, g: &Geom, x: &[f32], w: &Weights<'_, f32>) -> Vec<f32> {
    forward_planned(arena, g, x, w, Plan::new(Tiles::new(g).count(), g.c, g.o))
}

/// [`forward`] split as `plan` says.
fn forward_planned(
    arena: &Arena,
    g: &Geom,
    x: &[f32],
    w: &Weights<'_, f32>,
    plan: Plan,
) -> Vec<f32> {
    let (c, o) = (g.c, g.o);
    let tiles = Tiles::new(g);
    let count = tiles.count();
    let input = &Inputs { tiles: &tiles, x };
    let mut y = overwritten::<f32>(g.pixels() * o);
    let out = Disjoint::new(&mut y);
    let tile_blocks = count.div_ceil(plan.rows);
    let block_rows = |tb: usize| tb * plan.rows..((tb + 1) * plan.rows).min(count);
    if plan.width >= o {
        let kernel = Kernel::new(w, c, 0..o, o);
        parallel::for_each_task(tile_blocks, |tb| {
            let rows = block_rows(tb);
            let mut v = arena.take::<f32>(POSITIONS * plane(rows.len() * c));
            transform_tiles(rows.len(), rows.start, c, &mut v, false, input);
            let v = Planes {
                data: &v,
                plane: plane(rows.len() * c),
                row0: 0,
            };
            // SAFETY: the block's tiles are this task's.
            unsafe { multiply_out(arena, &tiles, &kernel, 0, &v, rows, &out) };
        });
    } else {
        // Every column block reads every tile's V: transformed once, up front.
        let mut v = overwritten::<f32>(POSITIONS * plane(count * c));
        transform_tiles(count, 0, c, &mut v, true, input);
        let shared = Planes {
            data: &v,
            plane: plane(count * c),
            row0: 0,
        };
        parallel::for_each_task(o.div_ceil(plan.width), |b| {
            let cols = b * plan.width..((b + 1) * plan.width).min(o);
            let kernel = Kernel::new(w, c, cols.clone(), cols.len());
            for tb in 0..tile_blocks {
                let rows = block_rows(tb);
                let v = Planes {
                    row0: rows.start,
                    ..shared
                };
                // SAFETY: these columns of every tile are this task's.
                unsafe { multiply_out(arena, &tiles, &kernel, 0, &v, rows, &out) };
            }
        });
        recycle(v);
    }
    y
}

/// 36 planes of transformed tiles, `[tiles, C]` each, `plane` apart; row `row0` is the first
/// tile a call reads.
#[derive(Clone, Copy)]
struct Planes<'a> {
    data: &'a [f32],
    plane: usize,
    row0: usize,
}

/// Tiles `rows`' outputs for column block `b` of `kernel`: the 36 GEMMs of their transformed
/// inputs `v` by the kernel, then `Aᵀ M A` into NHWC `y`.
///
/// # Safety
/// No other thread writes these tiles' pixels in these columns.
#[allow(clippy::too_many_arguments)]
unsafe fn multiply_out(
    arena: &Arena,
    tiles: &Tiles,
    kernel: &Kernel,
    b: usize,
    v: &Planes<'_>,
    rows: Range<usize>,
    y: &Disjoint<f32>,
) {
    let c = kernel.cin;
    let cols = kernel.columns(b);
    let (n, width) = (rows.len(), cols.len());
    let first = kernel.cols.start + cols.start;
    let stride = plane(n * width);
    let mut m = arena.take::<f32>(POSITIONS * stride);
    for xi in 0..POSITIONS {
        let a = Mat {
            data: v.data,
            offset: xi * v.plane + v.row0 * c,
            strides: [c, 1],
        };
        kernel.gemm(
            xi,
            b,
            a,
            n,
            &mut m[xi * stride..xi * stride + n * width],
            width,
        );
    }
    wide(
        #[inline(always)]
        || {
            let mut tm = [[ZERO; PATCH]; PATCH];
            for r in 0..n {
                for (k0, len) in chunks(width) {
                    for (xi, lanes) in tm.iter_mut().flatten().enumerate() {
                        *lanes = load(&m[xi * stride + r * width + k0..], len);
                    }
                    // SAFETY: the caller's contract.
                    unsafe { tiles.write_output(&tm, rows.start + r, first + k0, len, y) };
                }
            }
        },
    );
}

/// The weight gradient (OIHW) of the convolution `g` from NHWC `x` and NHWC `gy`.
pub(super) fn weight_grad(g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let (c, o) = (g.c, g.o);
    let fit = GRAD_CHUNK_BYTES / (POSITIONS * (c + o) * std::mem::size_of::<f32>());
    weight_grad_chunked(g, x, gy, fit.max(GRAD_CHUNK_PER_DU * c * o / (c + o)))
}

/// [`weight_grad`] in chunks of `chunk` tiles.
fn weight_grad_chunked(g: &Geom, x: &[f32], gy: &[f32], chunk: usize) -> Vec<f32> {
    let (c, o) = (g.c, g.o);
    let tiles = Tiles::new(g);
    let count = tiles.count();
    let chunk = chunk.clamp(1, count);
    let du_plane = plane(c * o);
    let mut du = overwritten::<f32>(POSITIONS * du_plane);
    let mut v = overwritten::<f32>(POSITIONS * plane(chunk * c));
    let mut dm = overwritten::<f32>(POSITIONS * plane(chunk * o));
    // Fixed chunks (by size alone) accumulated in order: the bits do not depend on threads.
    for first in (0..count).step_by(chunk) {
        let rows = chunk.min(count - first);
        let (inputs, grads) = (
            Inputs { tiles: &tiles, x },
            OutputGrads { tiles: &tiles, gy },
        );
        transform_tiles(rows, first, c, &mut v, true, &inputs);
        transform_tiles(rows, first, o, &mut dm, true, &grads);
        let planes = Disjoint::new(&mut du);
        parallel::for_each_task(POSITIONS, |xi| {
            // dU[ξ] (+)= V[ξ]ᵀ · dM[ξ]: [c, rows] by [rows, o].
            let a = Mat {
                data: &v[..],
                offset: xi * plane(rows * c),
                strides: [1, c],
            };
            let b = Mat {
                data: &dm[..],
                offset: xi * plane(rows * o),
                strides: [o, 1],
            };
            // SAFETY: plane ξ is this task's.
            let dst = unsafe { planes.slice(xi * du_plane..xi * du_plane + c * o) };
            gemm_rows(a, b, rows, o, 0..c, dst, o, first > 0);
        });
    }
    recycle(v);
    recycle(dm);
    // dW[j, i] = Gᵀ dU[·, i, j] G, output channels in chunks of LANES per task, input
    // channels in blocks of LANES gathered in a local block and written as runs of OIHW.
    let mut dw = overwritten::<f32>(o * c * 9);
    let out = Disjoint::new(&mut dw);
    let outputs: Vec<(usize, usize)> = chunks(o).collect();
    parallel::for_each_task(outputs.len(), |task| {
        let (j0, len) = outputs[task];
        // SAFETY: output channels j0..j0 + len are this task's: one contiguous OIHW run.
        let run = unsafe { out.slice(j0 * c * 9..(j0 + len) * c * 9) };
        wide(
            #[inline(always)]
            || {
                let (mut planes, mut taps) = ([[ZERO; PATCH]; PATCH], [[ZERO; 3]; 3]);
                // block[l][(i - i0)·9 + tap]: output channel j0 + l's run for these inputs.
                let mut block = [[0.0f32; LANES * 9]; LANES];
                for (i0, width) in chunks(c) {
                    for ii in 0..width {
                        for (xi, lanes) in planes.iter_mut().flatten().enumerate() {
                            *lanes = load(&du[xi * du_plane + (i0 + ii) * o + j0..], len);
                        }
                        let mut rows = [[ZERO; 3]; PATCH];
                        for (row, pa) in rows.iter_mut().zip(&planes) {
                            *row = kernel_grad_1d(pa);
                        }
                        columns_of(&rows, kernel_grad_1d, &mut taps);
                        for (tap, lanes) in taps.iter().flatten().enumerate() {
                            for (l, &v) in lanes.iter().enumerate() {
                                block[l][ii * 9 + tap] = v;
                            }
                        }
                    }
                    for (l, values) in block.iter().enumerate().take(len) {
                        let at = (l * c + i0) * 9;
                        run[at..at + width * 9].copy_from_slice(&values[..width * 9]);
                    }
                }
            },
        )
    });
    recycle(du);
    dw
}

#[cfg(test)]
mod tests {
    use redline_tensor::backend::Conv2dParams;
    use redline_tensor::Layout;

    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn geom(n: usize, c: usize, side: [usize; 2], o: usize, pad: usize) -> Geom {
        let p = Conv2dParams {
            padding: [pad, pad],
            ..Default::default()
        };
        let out = [side[0] + 2 * pad - 2, side[1] + 2 * pad - 2];
        Geom::new(
            &[n, c, side[0], side[1]],
            &[o, c, 3, 3],
            &[n, o, out[0], out[1]],
            &p,
        )
    }

    /// For each (output pixel, tap): the input pixel it reads, in f64 loops.
    fn taps(g: &Geom, mut f: impl FnMut(usize, usize, usize)) {
        for r in 0..g.pixels() {
            for tap in 0..9 {
                if let Some(px) = g.source(r, tap / 3, tap % 3) {
                    f(r, tap, px);
                }
            }
        }
    }

    /// The direct convolution in f64: NHWC `x`, OIHW `w` → NHWC.
    fn direct(g: &Geom, x: &[f32], w: &[f32]) -> Vec<f64> {
        let mut y = vec![0.0f64; g.pixels() * g.o];
        taps(g, |r, tap, px| {
            for j in 0..g.o {
                for i in 0..g.c {
                    y[r * g.o + j] += x[px * g.c + i] as f64 * w[(j * g.c + i) * 9 + tap] as f64;
                }
            }
        });
        y
    }

    /// The weight gradient in f64: OIHW.
    fn direct_weight_grad(g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f64> {
        let mut dw = vec![0.0f64; g.o * g.c * 9];
        taps(g, |r, tap, px| {
            for j in 0..g.o {
                for i in 0..g.c {
                    dw[(j * g.c + i) * 9 + tap] += x[px * g.c + i] as f64 * gy[r * g.o + j] as f64;
                }
            }
        });
        dw
    }

    /// The largest error relative to the reference's RMS (Winograd's error bound is
    /// norm-wise: a single output can be small while its operands are not).
    fn error(got: &[f32], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
        let worst = got
            .iter()
            .zip(want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0.0, f64::max);
        worst / rms
    }

    fn check(g: &Geom) {
        let x = values(g.n * g.h * g.w * g.c, 1);
        let w = values(g.o * g.c * 9, 2);
        let gy = values(g.pixels() * g.o, 3);
        let layout = Layout::contiguous(&[g.o, g.c, 3, 3]);
        let weights = Weights::new(&w, &layout, false);
        let (want_y, want_dw) = (direct(g, &x, &w), direct_weight_grad(g, &x, &gy));
        // The kernel packed for each of our GEMM kernels, and plain (matrixmultiply).
        let isas = sgemm::supported().into_iter().map(Some).chain([None]);
        for isa in isas {
            let (y, dw) = sgemm::with_isa(isa, || {
                let y = forward(&Arena::default(), g, &x, &weights);
                (y, weight_grad(g, &x, &gy))
            });
            let (fe, we) = (error(&y, &want_y), error(&dw, &want_dw));
            // 6·10⁻⁶ at worst on ResNet-50's shapes; a wrong transform is off by O(1).
            assert!(
                fe < 2e-5 && we < 2e-5,
                "{g:?} on {isa:?}: forward {fe:e}, weight gradient {we:e}"
            );
        }
    }

    #[test]
    fn runs_where_it_pays() {
        let conv = |n, c, side, o, pad| geom(n, c, [side, side], o, pad);
        // ResNet-50's 3×3 stride-1 layers at batch 8 but the last stage's (32 tiles).
        assert!(eligible(&conv(8, 64, 56, 64, 1)) && eligible(&conv(8, 256, 14, 256, 1)));
        assert!(!eligible(&conv(8, 512, 7, 512, 1)) && eligible(&conv(32, 512, 7, 512, 1)));
        // Thin layers, strides, dilation, groups, other kernels: the direct convolution.
        assert!(!eligible(&conv(8, 8, 56, 64, 1)) && !eligible(&conv(8, 64, 56, 8, 1)));
        let mut strided = conv(8, 64, 56, 64, 1);
        strided.p.stride = [2, 2];
        let mut dilated = conv(8, 64, 56, 64, 1);
        dilated.p.dilation = [2, 2];
        let mut grouped = conv(8, 64, 56, 64, 1);
        grouped.p.groups = 2;
        let mut wide = conv(8, 64, 56, 64, 1);
        wide.kw = 5;
        for g in [strided, dilated, grouped, wide] {
            assert!(!eligible(&g), "{:?} {:?}", g.p, [g.kh, g.kw]);
        }
    }

    #[test]
    fn forward_and_weight_gradient_match_the_direct_convolution() {
        // Ragged edges (9×11: tiles past the output), channels that are not a multiple of the
        // lanes, no padding and padding 2, one tile, several forward blocks (98 tiles).
        check(&geom(2, 20, [9, 11], 36, 1));
        check(&geom(1, 64, [14, 14], 32, 0));
        check(&geom(1, 16, [6, 7], 24, 2));
        check(&geom(3, 16, [4, 4], 16, 1));
        check(&geom(2, 32, [28, 28], 32, 1));
    }

    #[test]
    fn the_flipped_kernel_gives_the_input_gradient() {
        // The input gradient of a 3×3 pad-1 convolution is the convolution of gy by the
        // flipped kernel with its channels swapped (what conv.rs runs): compare with the
        // direct input gradient in f64.
        let g = geom(2, 24, [7, 9], 40, 1);
        let t = g.transposed().expect("stride 1");
        let (w, gy) = (values(g.o * g.c * 9, 4), values(g.pixels() * g.o, 5));
        let layout = Layout::contiguous(&[g.o, g.c, 3, 3]);
        let dx = forward(&Arena::default(), &t, &gy, &Weights::new(&w, &layout, true));
        let mut want = vec![0.0f64; g.n * g.h * g.w * g.c];
        taps(&g, |r, tap, px| {
            for j in 0..g.o {
                for i in 0..g.c {
                    want[px * g.c + i] +=
                        gy[r * g.o + j] as f64 * w[(j * g.c + i) * 9 + tap] as f64;
                }
            }
        });
        let e = error(&dx, &want);
        assert!(e < 2e-5, "input gradient {e:e}");
    }

    #[test]
    fn chunked_weight_gradients_add_up() {
        // More tiles than one chunk holds: chunks accumulate into dU in order.
        let g = geom(2, 16, [12, 12], 16, 1);
        let (x, gy) = (
            values(g.n * g.h * g.w * g.c, 6),
            values(g.pixels() * g.o, 7),
        );
        let whole = weight_grad_chunked(&g, &x, &gy, usize::MAX);
        let chunked = weight_grad_chunked(&g, &x, &gy, 5);
        let want = direct_weight_grad(&g, &x, &gy);
        let (ew, ec) = (error(&whole, &want), error(&chunked, &want));
        assert!(ew < 2e-5 && ec < 2e-5, "whole {ew:e}, in chunks {ec:e}");
        assert_ne!(whole, chunked, "five-tile chunks sum in another order");
    }

    #[test]
    fn bits_do_not_depend_on_how_the_forward_splits_its_work() {
        // Blocks split the GEMMs' rows and columns (the column blocks share one V): each
        // output is the same sequence of operations either way.
        let g = geom(2, 32, [16, 16], 48, 1);
        let (x, w) = (values(g.n * g.h * g.w * g.c, 8), values(g.o * g.c * 9, 9));
        let layout = Layout::contiguous(&[g.o, g.c, 3, 3]);
        let weights = Weights::new(&w, &layout, false);
        let arena = Arena::default();
        let plan = |rows, width| Plan { rows, width };
        let once = forward_planned(&arena, &g, &x, &weights, plan(1 << 20, 48));
        for split in [plan(12, 48), plan(12, 32), plan(100, 16)] {
            assert_eq!(
                once,
                forward_planned(&arena, &g, &x, &weights, split),
                "{split:?}"
            );
        }
    }
}

//! Single-group f32 convolution as implicit GEMM (no im2col), on our GEMM kernels.
//!
//! The forward pass gives the kernel one A row pointer per output pixel (its receptive field's
//! first input pixel, in the input padded once into `[N, Hp, Wp, C]`, or in the input itself
//! when there is no padding); each kernel tap is a constant offset from it. Only real outputs
//! are computed and any stride works. The stride-1 weight gradient runs the padded-width
//! addressing transposed: output `q = y·Wp + x` of an image reads input pixel
//! `q + ky·d·Wp + kx·d` for tap `(ky, kx)`, with the output gradient laid out at the padded
//! width (zeros in the dropped columns); deep layers' weight gradients run on row pointers too.

use crate::arena::Arena;
use crate::buffer::{overwritten, recycle, zeros};
use crate::parallel::{self, Disjoint};
use crate::sgemm::{self, PackedB};

use super::{Geom, Weights};

/// Output rows per task (forward: output pixels; weight gradient: padded-width pixels).
const TASK_ROWS: usize = 12 * 16;
/// Weight-gradient rows per task of [`weight_grad_rows`] (a multiple of 12): its packed A
/// block (these rows × 256 pixels) stays in L2.
const WEIGHT_GRAD_TASK_ROWS: usize = 12 * 16;
/// Weight-gradient rows (taps × channels) up to which strided layers split pixels across
/// threads ([`weight_grad_by_pixels`]).
const MAX_BY_PIXELS_ROWS: usize = 512;
/// Tasks per thread below which a layer's row tasks are split by columns as well.
const MIN_TASKS_PER_THREAD: usize = 8;
/// B panels (of 32 gradient columns) per task of [`weight_grad_gathered`].
const GATHERED_PANELS_PER_TASK: usize = 8;
/// Rows of slack kept readable past an image (the kernel reads whole 12-row tiles).
const SLACK_ROWS: usize = 12;

/// Whether `g`'s forward runs here: stride 1, or a stride whose taps cover enough values.
pub(super) fn eligible(g: &Geom) -> bool {
    // (A strided layer whose taps cover few values — 3 channels with horizontal dilation —
    // has short runs per tap: im2col serves it better. The stem's 7×7 runs 21.)
    let strided_ok = row_run(g) >= 16;
    g.p.groups == 1 && sgemm::available() && (g.p.stride == [1, 1] || strided_ok)
}

/// Whether `g`'s weight gradient runs here (stride 1).
pub(super) fn eligible_weight_grad(g: &Geom) -> bool {
    g.p.stride == [1, 1] && g.p.groups == 1 && sgemm::available()
}

/// Each kernel tap's offset into an NHWC input whose rows are `wp` pixels wide.
fn tap_offsets(g: &Geom, wp: usize) -> Vec<usize> {
    let [dh, dw] = g.p.dilation;
    (0..g.kh)
        .flat_map(|ky| (0..g.kw).map(move |kx| ((ky * dh) * wp + kx * dw) * g.c))
        .collect()
}

/// Taps as the row-pointer paths read them, with the run of consecutive values each covers:
/// without horizontal dilation a kernel row's taps are adjacent pixels, so one tap per kernel
/// row spans `KW·C` values (the stem's 7×7 on 3 channels: runs of 21, not 3); otherwise one
/// per (ky, kx) of `C`. Either way B's row `t·run + s` is weight row `(ky, kx, c)`.
fn row_taps(g: &Geom, wp: usize) -> (Vec<usize>, usize) {
    let [dh, dw] = g.p.dilation;
    if dw != 1 {
        return (tap_offsets(g, wp), g.c);
    }
    let taps = (0..g.kh).map(|ky| ky * dh * wp * g.c).collect();
    (taps, g.kw * g.c)
}

/// The run of [`row_taps`].
fn row_run(g: &Geom) -> usize {
    if g.p.dilation[1] == 1 {
        g.kw * g.c
    } else {
        g.c
    }
}

/// The padded input and the tap offsets into it.
struct Padded {
    data: Vec<f32>,
    wp: usize,
    per_image: usize,
    taps: Vec<usize>,
}

fn pad(g: &Geom, x: &[f32]) -> Padded {
    let [ph, pw] = g.p.padding;
    let [_, dw] = g.p.dilation;
    let (hp, wp, c) = (g.h + 2 * ph, g.w + 2 * pw, g.c);
    let per_image = hp * wp * c;
    let slack = (SLACK_ROWS + dw * (g.kw - 1) + 1) * c;
    // Every padded row is written whole (border zeros + the input row), then the slack.
    let mut data = overwritten::<f32>(g.n * per_image + slack);
    let rows = Disjoint::new(&mut data);
    let count = g.n * hp;
    parallel::for_parts(
        count,
        parallel::parts_for(count * wp * c, 1 << 15),
        |_, range| {
            for row in range {
                let (b, y) = (row / hp, row % hp);
                // SAFETY: each part writes its own padded rows.
                let dst = unsafe { rows.slice(row * wp * c..(row + 1) * wp * c) };
                match y.checked_sub(ph).filter(|&iy| iy < g.h) {
                    Some(iy) => {
                        let from = (b * g.h + iy) * g.w * c;
                        dst[..pw * c].fill(0.0);
                        dst[pw * c..(pw + g.w) * c].copy_from_slice(&x[from..from + g.w * c]);
                        dst[(pw + g.w) * c..].fill(0.0);
                    }
                    None => dst.fill(0.0),
                }
            }
        },
    );
    data[g.n * per_image..].fill(0.0);
    let taps = tap_offsets(g, wp);
    Padded {
        data,
        wp,
        per_image,
        taps,
    }
}

/// The input as output pixels read it through row pointers: output pixel `r` reads its
/// receptive field at `row(r) + tap`, where `row(r)` is its top-left input pixel (strided) in
/// the padded input — or in `x` itself when there is no padding.
struct RowSource<'a> {
    padded: Option<Padded>,
    x: &'a [f32],
    wp: usize,
    per_image: usize,
    taps: Vec<usize>,
    /// Values each tap covers ([`row_taps`]).
    run: usize,
}

impl<'a> RowSource<'a> {
    fn new(g: &Geom, x: &'a [f32]) -> Self {
        let padded = (g.p.padding != [0, 0]).then(|| pad(g, x));
        let (wp, per_image) = match &padded {
            Some(p) => (p.wp, p.per_image),
            None => (g.w, g.h * g.w * g.c),
        };
        let (taps, run) = row_taps(g, wp);
        Self {
            padded,
            x,
            wp,
            per_image,
            taps,
            run,
        }
    }

    /// Output pixel `r`'s first input pixel.
    fn row(&self, g: &Geom, r: usize) -> *const f32 {
        let base = self
            .padded
            .as_ref()
            .map_or(self.x, |p| &p.data[..])
            .as_ptr();
        let (ox, rest) = (r % g.wo, r / g.wo);
        let (oy, image) = (rest % g.ho, rest / g.ho);
        let [sh, sw] = g.p.stride;
        base.wrapping_add(image * self.per_image + (oy * sh * self.wp + ox * sw) * g.c)
    }
}

/// NHWC output `[N, Ho, Wo, O]` of `x` (NHWC) by the weight matrix `[KH·KW·C, O]`, over the
/// real outputs only (none over a padded width: 22% of a 7×7 layer's), through [`RowSource`]
/// row pointers.
pub(super) fn forward(g: &Geom, x: &[f32], b: &PackedB) -> Vec<f32> {
    let src = RowSource::new(g, x);
    let o = g.o;
    let m = g.n * g.ho * g.wo;
    let mut y = overwritten::<f32>(m * o);
    if m == 0 {
        return y;
    }
    let out = Disjoint::new(&mut y);
    let c = out.ptr() as usize; // an address, so the closure can be shared across threads
                                // SAFETY: each output pixel's receptive field lies in the source (padded, or unpadded
                                // with every tap inside the input); row r of y is output pixel r.
    unsafe {
        rows_gemm(
            m,
            |r| src.row(g, r),
            &src.taps,
            src.run,
            b,
            |r| (c as *mut f32).add(r * o),
        )
    };
    y
}

/// [`sgemm::implicit_rows`] over rows `0..m` on every thread: tasks of [`TASK_ROWS`] rows,
/// and few rows (a 7×7 layer: 392 at batch 8 — three row tasks for two threads) also split
/// B's columns, so every thread gets an even share. Tasks write disjoint rows and columns.
///
/// # Safety
/// As [`sgemm::implicit_rows`] for every row.
unsafe fn rows_gemm(
    m: usize,
    a_row: impl Fn(usize) -> *const f32 + Sync,
    taps: &[usize],
    run: usize,
    b: &PackedB,
    c_row: impl Fn(usize) -> *mut f32 + Sync,
) {
    if m == 0 {
        return;
    }
    let row_tasks = m.div_ceil(TASK_ROWS);
    let splits = (MIN_TASKS_PER_THREAD * parallel::threads())
        .div_ceil(row_tasks)
        .clamp(1, b.panels());
    parallel::for_each_task(row_tasks * splits, |t| {
        let (t, split) = (t / splits, t % splits);
        let panels = split * b.panels() / splits..(split + 1) * b.panels() / splits;
        let r0 = t * TASK_ROWS;
        let rows = TASK_ROWS.min(m - r0);
        // SAFETY: the caller's contract; this task's rows and panels are its own.
        unsafe {
            let (a, c) = (|i: usize| a_row(r0 + i), |i: usize| c_row(r0 + i));
            sgemm::implicit_rows(rows, a, taps, run, b, panels, c, 0.0);
        }
    });
}

/// Whether a strided convolution's input gradient runs on [`input_grad_phases`]: a k×k
/// kernel (k > 1) with at least 16 input and output channels. Per layer on AVX-512, batch 8,
/// best of three runs each against im2col + col2im: 3×3 stride 2 at 128, 256 and 512 channels
/// 11.4 → 6.7, 8.7 → 6.2 and 13.4 → 8.2 ms; 1×1 stride 2 (whose odd phases are zeros and whose
/// col2im is a plain scatter) measured 0.9× and the stem's 3 channels (a 3-column B) 0.3×.
pub(super) fn eligible_input_grad_phases(g: &Geom) -> bool {
    g.p.groups == 1
        && g.p.stride != [1, 1]
        && g.p.dilation == [1, 1]
        && g.kh * g.kw > 1
        && g.c >= 16
        && g.o >= 16
        && sgemm::available()
}

/// The kernel taps that reach input positions `s·i + a` along one axis, each with the offset
/// `δ` of the output position it reads there (`i + δ`): those with `a + pad − tap` a multiple
/// of the stride.
fn phase_taps(a: usize, stride: usize, pad: usize, kernel: usize) -> Vec<(usize, isize)> {
    let s = stride as isize;
    (0..kernel)
        .filter_map(|t| {
            let d = (a + pad) as isize - t as isize;
            (d.rem_euclid(s) == 0).then_some((t, d / s))
        })
        .collect()
}

/// Input positions `s·i + a` (for `i` below this) of an axis of `len`.
fn phase_len(a: usize, stride: usize, len: usize) -> usize {
    if a >= len {
        0
    } else {
        (len - a).div_ceil(stride)
    }
}

/// The input gradient (NHWC) of a strided convolution from its NHWC output gradient, as one
/// stride-1 correlation per phase `(a, b)` of the input: `dx[s·i + a, s·j + b]` sums the taps
/// that reach it (`phase_taps`), each reading `gy[i + δy, j + δx]`, through row pointers into
/// `gy` padded once. The transposed convolution without im2col's column matrix and col2im's
/// scatter (oneDNN's way); a phase no tap reaches (a 1×1 stride-2 kernel's odd rows and
/// columns) is zeros.
pub(super) fn input_grad_phases(g: &Geom, gy: &[f32], w: &Weights<'_, f32>) -> Vec<f32> {
    let ([sh, sw], [ph, pw]) = (g.p.stride, g.p.padding);
    let (c, o) = (g.c, g.o);
    let rows: Vec<_> = (0..sh).map(|a| phase_taps(a, sh, ph, g.kh)).collect();
    let cols: Vec<_> = (0..sw).map(|b| phase_taps(b, sw, pw, g.kw)).collect();
    // gy padded so that every phase position's taps read inside it: `before` positions ahead
    // of it and `after` past it, per axis.
    let margins = |taps: &[Vec<(usize, isize)>], stride: usize, len: usize, out: usize| {
        let (mut before, mut after) = (0isize, 0isize);
        for (a, phase) in taps.iter().enumerate() {
            let n = phase_len(a, stride, len) as isize;
            for &(_, d) in phase {
                before = before.max(-d);
                if n > 0 {
                    after = after.max(n - 1 + d - (out as isize - 1));
                }
            }
        }
        (before as usize, after as usize)
    };
    let (top, bottom) = margins(&rows, sh, g.h, g.ho);
    let (left, right) = margins(&cols, sw, g.w, g.wo);
    let (hp, wp) = (g.ho + top + bottom, g.wo + left + right);
    let mut padded = zeros::<f32>(g.n * hp * wp * o);
    let dst = Disjoint::new(&mut padded);
    parallel::for_parts(
        g.n * g.ho,
        parallel::parts_for(g.n * g.ho * g.wo * o, 1 << 15),
        |_, range| {
            for row in range {
                let (n, y) = (row / g.ho, row % g.ho);
                let at = ((n * hp + y + top) * wp + left) * o;
                // SAFETY: each part copies its own rows into the padded interior.
                unsafe { dst.slice(at..at + g.wo * o) }
                    .copy_from_slice(&gy[row * g.wo * o..(row + 1) * g.wo * o]);
            }
        },
    );
    let mut dx = overwritten::<f32>(g.n * g.h * g.w * c);
    let out = Disjoint::new(&mut dx);
    // Addresses, so the row closures can be shared across threads.
    let (src, dst) = (padded.as_ptr() as usize, out.ptr() as usize);
    let lane_stride = w.l.strides()[1];
    for (a, phase_rows) in rows.iter().enumerate() {
        for (b, phase_cols) in cols.iter().enumerate() {
            let (hi, wi) = (phase_len(a, sh, g.h), phase_len(b, sw, g.w));
            let m = g.n * hi * wi;
            // Phase position r: image n, i, j.
            let at = move |r: usize| {
                let (j, rest) = (r % wi, r / wi);
                (rest / hi, rest % hi, j)
            };
            let dx_row = move |r: usize| {
                let (n, i, j) = at(r);
                (dst as *mut f32).wrapping_add(((n * g.h + sh * i + a) * g.w + sw * j + b) * c)
            };
            if m == 0 {
                continue;
            }
            if phase_rows.is_empty() || phase_cols.is_empty() {
                parallel::for_parts(m, parallel::parts_for(m * c, 1 << 15), |_, range| {
                    for r in range {
                        // SAFETY: this phase's positions are this part's.
                        unsafe { std::slice::from_raw_parts_mut(dx_row(r), c) }.fill(0.0);
                    }
                });
                continue;
            }
            let taps: Vec<(usize, isize, usize, isize)> = phase_rows
                .iter()
                .flat_map(|&(ky, dy)| phase_cols.iter().map(move |&(kx, dxx)| (ky, dy, kx, dxx)))
                .collect();
            let dy0 = taps.iter().map(|t| t.1).min().unwrap_or(0);
            let dx0 = taps.iter().map(|t| t.3).min().unwrap_or(0);
            let offsets: Vec<usize> = taps
                .iter()
                .map(|&(_, dy, _, dxx)| ((dy - dy0) as usize * wp + (dxx - dx0) as usize) * o)
                .collect();
            // B's row (tap t, output channel oo) holds w[oo, :, ky, kx], read in place.
            let row = |p: usize| {
                let (ky, _, kx, _) = taps[p / o];
                w.data[w.at(0, p % o, ky, kx)..].as_ptr()
            };
            // SAFETY: every row p and column j < c of it are elements of the weights.
            let packed =
                unsafe { PackedB::from_rows(row, lane_stride as isize, taps.len() * o, c) };
            let gy_row = move |r: usize| {
                let (n, i, j) = at(r);
                let (y, x) = (
                    (i as isize + top as isize + dy0) as usize,
                    (j as isize + left as isize + dx0) as usize,
                );
                (src as *const f32).wrapping_add(((n * hp + y) * wp + x) * o)
            };
            // SAFETY: the margins keep every tap of every phase position inside the padded gy;
            // phase positions are distinct pixels of dx, each row of c values.
            unsafe { rows_gemm(m, gy_row, &offsets, o, &packed, dx_row) };
        }
    }
    recycle(padded);
    dx
}

/// Whether the weight gradient runs on [`weight_grad_rows`] rather than the padded-width
/// path: for stride-1 layers with less than half as many output pixels as weight-gradient
/// rows (the deep ones: 392 pixels against 4,608 rows at 7×7 and 512 channels), where
/// per-thread partials would each be a pass over a large gradient for little work and the
/// padded width would add 40% dropped rows (3×3 at 7×7 on AVX2: 1.35–1.55× faster forward +
/// backward, interleaved runs; on AVX-512 the weight gradient 11.9 → 8.3 ms). At 14×14 (1,568
/// pixels, 2,304 rows) it measured 0.97–1.07× on AVX2 and 0.6× on AVX-512. Strided layers
/// measured no better than im2col there.
pub(super) fn eligible_weight_grad_rows(g: &Geom) -> bool {
    g.p.stride == [1, 1] && g.p.groups == 1 && g.c >= 16 && 2 * g.pixels() < g.k()
}

/// The weight gradient (OIHW) through [`RowSource`] row pointers: threads split its rows and
/// each reads every pixel, so there are no partial sums.
pub(super) fn weight_grad_rows(g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let src = RowSource::new(g, x);
    let (o, k, m) = (g.o, g.k(), g.pixels());
    let mut dw = vec![0.0f32; k * o];
    let out = Disjoint::new(&mut dw);
    let per_task = WEIGHT_GRAD_TASK_ROWS;
    parallel::for_each_task(k.div_ceil(per_task), |t| {
        let rows = t * per_task..((t + 1) * per_task).min(k);
        // SAFETY: receptive fields as in forward_rows; gy holds m rows of o; tasks own
        // disjoint rows of dw.
        unsafe {
            let a_row = |q: usize| src.row(g, q);
            let g_row = |q: usize| gy.as_ptr().add(q * o);
            let (taps, run) = (&src.taps, src.run);
            sgemm::implicit_rows_weight_grad(m, a_row, taps, run, g_row, o, out.ptr(), rows);
        }
    });
    super::sum_into_oihw(g, &dw, 1)
}

/// Whether a layer's weight gradient runs on [`weight_grad_gathered`]: the gradient's longer
/// side at least four times the pixels (ResNet-50's last stage, 392 pixels at batch 8).
/// There every other path pays for the gradient's size more than for its work: per-thread
/// partials of megabytes, a zero fill, a relayout into OIHW, and B packed again per task.
/// Weight gradient per layer on a 2-core Zen 4, against the paths before (alternating runs of
/// `resnet50_convs`): 3×3 stride 2 at 512 channels 17.2 → 10.0 ms, 1×1 stride 2 1024→2048
/// 17.5 → 8.0, 3×3 at 512 channels and 7² 15.0 → 9.2, 512→2048 6.3 → 4.5, 2048→512 5.9 →
/// 4.3. At 1,568 pixels (14²) it measured 0.8–1.15× and stays off: each task gathers and
/// packs megabytes of B. Fewer than 16 channels (the stem's 3) would gather B value by value;
/// those stay on the paths below.
pub(super) fn eligible_weight_grad_gathered(g: &Geom) -> bool {
    g.p.groups == 1 && sgemm::available() && g.c >= 16 && 4 * g.pixels() <= g.k().max(g.o)
}

/// The weight gradient straight in OIHW, `dW[o, (c, tap)] = Σ_q gy[q, o] · x_q[tap, c]`: one
/// GEMM over every pixel ([`sgemm::gathered`]) with A the output gradient transposed (packed
/// once) and B the receptive fields gathered through [`RowSource`] row pointers, columns in
/// OIHW order. Threads split the gradient into blocks of rows and columns, each written once:
/// no partial sums, no zero fill, no relayout pass after.
pub(super) fn weight_grad_gathered(g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let src = RowSource::new(g, x);
    let (o, k, m) = (g.o, g.k(), g.pixels());
    let taps = g.kh * g.kw;
    // OIHW column j is (c, tap); its value sits at weight row (tap, c) = t·run + s of the
    // row-pointer layout, i.e. at `taps[t] + s` from a pixel's row pointer.
    let cols: Vec<usize> = (0..k)
        .map(|j| {
            let row = (j % taps) * g.c + j / taps;
            src.taps[row / src.run] + row % src.run
        })
        .collect();
    // SAFETY: gy is [m, o] row-major.
    let a = unsafe { sgemm::PackedA::transposed(gy.as_ptr(), o, o, m) };
    let mut dw = overwritten::<f32>(o * k);
    let out = Disjoint::new(&mut dw);
    let (row_panels, col_panels) = (a.panels(), k.div_ceil(sgemm::PANEL));
    let col_groups = col_panels.div_ceil(GATHERED_PANELS_PER_TASK);
    let row_groups = (4 * parallel::threads())
        .div_ceil(col_groups)
        .clamp(1, row_panels.div_ceil(4));
    parallel::for_each_task(row_groups * col_groups, |t| {
        let (rg, cg) = (t / col_groups, t % col_groups);
        let rows = rg * row_panels / row_groups..(rg + 1) * row_panels / row_groups;
        let panels =
            cg * GATHERED_PANELS_PER_TASK..((cg + 1) * GATHERED_PANELS_PER_TASK).min(col_panels);
        // SAFETY: receptive fields as in forward_rows; tasks write disjoint tiles of dw.
        unsafe {
            sgemm::gathered(&a, |q| src.row(g, q), &cols, rows, panels, out.ptr(), k);
        }
    });
    dw
}

/// Whether a layer's weight gradient runs on [`weight_grad_by_pixels`]: a strided one whose
/// gradient has at most 512 rows (taps × channels), or a 1×1 stride-1 one with at least twice
/// as many outputs as inputs. Per layer on AVX-512, batch 8, best of three runs each: the 7×7
/// stem 19.7 → 10.0 ms, 1×1 stride 2 at 256 and 512 channels 6.4 → 5.4 and 6.0 → 5.5 (against
/// im2col); 1×1 64→256 at 56² 4.8 → 3.7, 128→512 3.0 → 2.85, 256→1024 3.1 → 2.9 (against
/// per-tile GEMMs, which measured better where inputs outnumber outputs); strided ones with
/// more rows (3×3 stride 2: 1,152 and up, 1×1 stride 2 at 1,024 channels) 0.7–0.9×.
pub(super) fn eligible_weight_grad_by_pixels(g: &Geom) -> bool {
    let pointwise_wide = g.pointwise() && g.o >= 2 * g.cg;
    g.p.groups == 1
        && (g.p.stride != [1, 1] || pointwise_wide)
        && row_run(g) >= 16
        && g.k() <= MAX_BY_PIXELS_ROWS
        && sgemm::available()
}

/// The weight gradient (OIHW) through [`RowSource`] row pointers, threads splitting the
/// pixels into fixed parts with a partial gradient each, summed in part order: no im2col
/// matrix (the 7×7 stem's holds 147 values per output pixel, 59 MB at batch 8).
pub(super) fn weight_grad_by_pixels(g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let src = RowSource::new(g, x);
    let (o, k, m) = (g.o, g.k(), g.pixels());
    let parts = parallel::parts_for(m, 256);
    let mut partials = zeros::<f32>(parts * k * o);
    let acc = Disjoint::new(&mut partials);
    parallel::for_parts(m, parts, |part, pixels| {
        // SAFETY: each part owns its partial; receptive fields as in forward_rows; gy holds
        // these pixels' rows of o.
        unsafe {
            let dw = acc.slice(part * k * o..(part + 1) * k * o);
            let a_row = |q: usize| src.row(g, pixels.start + q);
            let g_row = |q: usize| gy.as_ptr().add((pixels.start + q) * o);
            let (taps, run) = (&src.taps, src.run);
            let m = pixels.len();
            sgemm::implicit_rows_weight_grad(m, a_row, taps, run, g_row, o, dw.as_mut_ptr(), 0..k);
        }
    });
    let dw = super::sum_into_oihw(g, &partials, parts);
    recycle(partials);
    dw
}

/// The weight gradient (OIHW), from NHWC `x` and NHWC `gy`.
pub(super) fn weight_grad(arena: &Arena, g: &Geom, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let xp = pad(g, x);
    let (o, wp, k) = (g.o, xp.wp, g.k());
    let per_image = g.ho * wp;
    let per_task = per_image.div_ceil(TASK_ROWS);
    let count = g.n * per_task;
    let parts = parallel::parts_for(count, 1);
    let mut partials = arena.take::<f32>(parts * k * o);
    partials.fill(0.0);
    let acc = Disjoint::new(&mut partials);
    parallel::for_parts(count, parts, |part, range| {
        // SAFETY: each part owns its partial.
        let dw = unsafe { acc.slice(part * k * o..(part + 1) * k * o) };
        for t in range {
            let (image, q0) = (t / per_task, (t % per_task) * TASK_ROWS);
            let rows = TASK_ROWS.min(per_image - q0);
            // SAFETY: reads stay in the padded input (and slack) and in gw's rows.
            unsafe {
                let a = xp.data.as_ptr().add(image * xp.per_image + q0 * g.c);
                // Output-gradient rows in the padded columns are zeros (they were dropped).
                let g_row = |i: usize| {
                    let (y, x) = ((q0 + i) / wp, (q0 + i) % wp);
                    (x < g.wo && y < g.ho)
                        .then(|| gy.as_ptr().add(((image * g.ho + y) * g.wo + x) * o))
                };
                sgemm::implicit_weight_grad(rows, a, g.c, &xp.taps, g.c, g_row, o, dw.as_mut_ptr());
            }
        }
    });
    super::sum_into_oihw(g, &partials, parts)
}

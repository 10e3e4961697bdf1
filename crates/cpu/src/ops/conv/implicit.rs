//! Stride-1, single-group f32 convolution as implicit GEMM (no im2col), on our GEMM kernels.
//!
//! The input is padded once into `[N, Hp, Wp, C]`. Outputs are computed over the padded width:
//! output `q = y·Wp + x` of an image reads input pixel `q + ky·d·Wp + kx·d` for tap `(ky, kx)`,
//! so consecutive outputs read consecutive pixels and each tap is a constant offset — the GEMM
//! kernel reads the input in place. The `Wp - Wo` extra outputs per row are computed and dropped
//! (3.5% for 56-wide 3×3 layers). The weight gradient runs the same addressing transposed, with
//! the output gradient laid out at the padded width (zeros in the dropped columns).

use crate::arena::Arena;
use crate::buffer::overwritten;
use crate::parallel::{self, Disjoint};
use crate::sgemm::{self, PackedB};

use super::Geom;

/// Output rows (padded-width pixels) per task.
const TASK_ROWS: usize = 12 * 16;
/// Rows of slack kept readable past an image (the kernel reads whole 12-row tiles).
const SLACK_ROWS: usize = 12;

/// Whether `g` runs here.
pub(super) fn eligible(g: &Geom) -> bool {
    g.p.stride == [1, 1] && g.p.groups == 1 && sgemm::available()
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
    let [dh, dw] = g.p.dilation;
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
    let taps = (0..g.kh)
        .flat_map(|ky| (0..g.kw).map(move |kx| ((ky * dh) * wp + kx * dw) * c))
        .collect();
    Padded {
        data,
        wp,
        per_image,
        taps,
    }
}

/// Runs `f(image, first row, rows)` over tasks of `TASK_ROWS` padded-width output rows.
fn tasks(g: &Geom, wp: usize, f: impl Fn(usize, usize, usize) + Sync) {
    let per_image = g.ho * wp;
    let per_task = per_image.div_ceil(TASK_ROWS);
    // Tasks write disjoint output rows: claimed dynamically (same bits either way).
    parallel::for_each_task(g.n * per_task, |t| {
        let (image, q0) = (t / per_task, (t % per_task) * TASK_ROWS);
        f(image, q0, TASK_ROWS.min(per_image - q0));
    });
}

/// NHWC output `[N, Ho, Wo, O]` of `x` (NHWC) by the weight matrix `[KH·KW·C, O]`.
pub(super) fn forward(g: &Geom, x: &[f32], b: &PackedB) -> Vec<f32> {
    let xp = pad(g, x);
    let (o, wp) = (g.o, xp.wp);
    let mut y = overwritten::<f32>(g.n * g.ho * g.wo * o);
    let out = Disjoint::new(&mut y);
    tasks(g, wp, |image, q0, rows| {
        // Outputs in the padded columns (x ≥ Wo) land in a scratch row and are dropped.
        let mut scratch = vec![0.0f32; o];
        let drop_row = scratch.as_mut_ptr();
        let c_row = |i: usize| {
            let (y, x) = ((q0 + i) / wp, (q0 + i) % wp);
            if x < g.wo && y < g.ho {
                // SAFETY: inside y (image, y, x < Wo); tasks own disjoint output rows.
                unsafe { out.ptr().add(((image * g.ho + y) * g.wo + x) * o) }
            } else {
                drop_row
            }
        };
        // SAFETY: reads stay in the padded input and its slack; writes as above.
        unsafe {
            let a = xp.data.as_ptr().add(image * xp.per_image + q0 * g.c);
            sgemm::implicit(rows, a, g.c, &xp.taps, g.c, b, c_row, 0.0);
        }
        drop(scratch);
    });
    y
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
    super::sum_into_oihw(g, &mut partials, parts)
}

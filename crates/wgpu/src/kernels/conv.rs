//! Convolution forward, backward-data and backward-filter as implicit GEMMs on the shared tiled
//! GEMM: the im2col matrix is never materialised, each tile reads the input (or gradient) through
//! the convolution's index arithmetic, and padding reads as zero. `z` is the group.

use redline_tensor::{Conv2dParams, DType, Layout, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::gemm::{self, Gemm, HEADER};
use crate::shader;

/// Geometry words after the GEMM header: N C H W O Cg KH KW HO WO sh sw ph pw dh dw.
const GEOMETRY: &str = r#"
fn geo(i: u32) -> u32 { return params[4u + i]; }
fn out_per_group() -> u32 { return geo(4u) / (geo(1u) / geo(5u)); }
"#;
/// The three layouts follow the 16 geometry words.
const L0: usize = HEADER + 16;
const L1: usize = L0 + shader::LAYOUT_WORDS;
const L2: usize = L1 + shader::LAYOUT_WORDS;

fn geometry(x: &[usize], w: &[usize], out_hw: [usize; 2], p: &Conv2dParams) -> Vec<u32> {
    [
        x[0],
        x[1],
        x[2],
        x[3],
        w[0],
        w[1],
        w[2],
        w[3],
        out_hw[0],
        out_hw[1],
        p.stride[0],
        p.stride[1],
        p.padding[0],
        p.padding[1],
        p.dilation[0],
        p.dilation[1],
    ]
    .map(|v| v as u32)
    .to_vec()
}

fn out_hw(x: &[usize], w: &[usize], p: &Conv2dParams) -> [usize; 2] {
    let size = |n: usize, k: usize, i: usize| {
        (n + 2 * p.padding[i] - p.dilation[i] * (k - 1) - 1) / p.stride[i] + 1
    };
    [size(x[2], w[2], 0), size(x[3], w[3], 1)]
}

/// The input pixel a tap reads: shared by forward and backward-filter.
const INPUT_TAP: &str = r#"
fn input_at(n: u32, ch: u32, ho: u32, wo: u32, kh: u32, kw: u32) -> f32 {
    let hi = i32(ho * geo(10u) + kh * geo(14u)) - i32(geo(12u));
    let wi = i32(wo * geo(11u) + kw * geo(15u)) - i32(geo(13u));
    if (hi < 0 || wi < 0 || hi >= i32(geo(2u)) || wi >= i32(geo(3u))) { return 0.0; }
    return load_b(strided4(X_LAYOUT, n, ch, u32(hi), u32(wi)));
}
"#;

#[allow(clippy::too_many_arguments)]
fn launch(
    ctx: &Context,
    name: &str,
    body: &str,
    dtypes: [DType; 3],
    mkn: [usize; 3],
    groups: usize,
    extra: Vec<u32>,
    a: &wgpu::Buffer,
    b: &wgpu::Buffer,
    out_len: usize,
) -> Result<PooledBuffer> {
    let functions = format!("{GEOMETRY}{body}");
    let spec = Gemm {
        name,
        functions: &functions,
        a_dtype: dtypes[0],
        b_dtype: dtypes[1],
        out_dtype: dtypes[2],
        m: mkn[0],
        k: mkn[1],
        n: mkn[2],
        z: groups,
    };
    gemm::run(ctx, &spec, &extra, a, b, out_len)
}

fn layouts(geometry: Vec<u32>, layouts: &[&Layout]) -> Result<Vec<u32>> {
    let mut extra = geometry;
    for l in layouts {
        shader::push_layout(&mut extra, l)?;
    }
    Ok(extra)
}

/// `y = conv2d(x, w)` written in layout `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    ctx: &Context,
    x: (&wgpu::Buffer, &Layout, DType),
    w: (&wgpu::Buffer, &Layout, DType),
    p: &Conv2dParams,
    out: &Layout,
) -> Result<PooledBuffer> {
    let (xs, ws) = (x.1.shape(), w.1.shape());
    let hw = out_hw(xs, ws, p);
    let body = format!(
        r#"
const W_LAYOUT: u32 = {L0}u;
const X_LAYOUT: u32 = {L1}u;
const OUT_LAYOUT: u32 = {L2}u;
{INPUT_TAP}
fn a_at(z: u32, row: u32, kk: u32) -> f32 {{
    let taps = geo(6u) * geo(7u);
    let r = kk % taps;
    return load_a(strided4(W_LAYOUT, z * out_per_group() + row, kk / taps, r / geo(7u), r % geo(7u)));
}}
fn b_at(z: u32, kk: u32, col: u32) -> f32 {{
    let taps = geo(6u) * geo(7u);
    let r = kk % taps;
    let plane = geo(8u) * geo(9u);
    let q = col % plane;
    return input_at(col / plane, z * geo(5u) + kk / taps, q / geo(9u), q % geo(9u), r / geo(7u), r % geo(7u));
}}
fn store_c(z: u32, row: u32, col: u32, v: f32) {{
    let plane = geo(8u) * geo(9u);
    let q = col % plane;
    store_y(strided4(OUT_LAYOUT, col / plane, z * out_per_group() + row, q / geo(9u), q % geo(9u)), v);
}}
"#
    );
    let extra = layouts(geometry(xs, ws, hw, p), &[w.1, x.1, out])?;
    let mkn = [
        ws[0] / p.groups,
        ws[1] * ws[2] * ws[3],
        xs[0] * hw[0] * hw[1],
    ];
    launch(
        ctx,
        "conv2d",
        &body,
        [w.2, x.2, x.2],
        mkn,
        p.groups,
        extra,
        w.0,
        x.0,
        out.numel(),
    )
}

/// The input gradient from the output gradient `g`, written in layout `out` (x's shape).
pub(crate) fn input_grad(
    ctx: &Context,
    g: (&wgpu::Buffer, &Layout, DType),
    w: (&wgpu::Buffer, &Layout, DType),
    p: &Conv2dParams,
    out: &Layout,
) -> Result<PooledBuffer> {
    let (xs, ws) = (out.shape(), w.1.shape());
    let hw = out_hw(xs, ws, p);
    let body = format!(
        r#"
const W_LAYOUT: u32 = {L0}u;
const G_LAYOUT: u32 = {L1}u;
const OUT_LAYOUT: u32 = {L2}u;
fn a_at(z: u32, row: u32, kk: u32) -> f32 {{
    let taps = geo(6u) * geo(7u);
    let r = kk % taps;
    return load_a(strided4(W_LAYOUT, z * out_per_group() + kk / taps, row, r / geo(7u), r % geo(7u)));
}}
fn b_at(z: u32, kk: u32, col: u32) -> f32 {{
    let taps = geo(6u) * geo(7u);
    let r = kk % taps;
    let kh = r / geo(7u);
    let kw = r % geo(7u);
    let plane = geo(2u) * geo(3u);
    let q = col % plane;
    let th = i32(q / geo(3u) + geo(12u)) - i32(kh * geo(14u));
    let tw = i32(q % geo(3u) + geo(13u)) - i32(kw * geo(15u));
    if (th < 0 || tw < 0 || u32(th) % geo(10u) != 0u || u32(tw) % geo(11u) != 0u) {{ return 0.0; }}
    let ho = u32(th) / geo(10u);
    let wo = u32(tw) / geo(11u);
    if (ho >= geo(8u) || wo >= geo(9u)) {{ return 0.0; }}
    return load_b(strided4(G_LAYOUT, col / plane, z * out_per_group() + kk / taps, ho, wo));
}}
fn store_c(z: u32, row: u32, col: u32, v: f32) {{
    let plane = geo(2u) * geo(3u);
    let q = col % plane;
    store_y(strided4(OUT_LAYOUT, col / plane, z * geo(5u) + row, q / geo(3u), q % geo(3u)), v);
}}
"#
    );
    let extra = layouts(geometry(xs, ws, hw, p), &[w.1, g.1, out])?;
    let og = ws[0] / p.groups;
    let mkn = [ws[1], og * ws[2] * ws[3], xs[0] * xs[2] * xs[3]];
    launch(
        ctx,
        "conv2d_input_grad",
        &body,
        [w.2, g.2, g.2],
        mkn,
        p.groups,
        extra,
        w.0,
        g.0,
        out.numel(),
    )
}

/// The weight gradient from `x` and the output gradient `g`, written in layout `out` (the
/// weight's shape).
pub(crate) fn weight_grad(
    ctx: &Context,
    x: (&wgpu::Buffer, &Layout, DType),
    g: (&wgpu::Buffer, &Layout, DType),
    p: &Conv2dParams,
    out: &Layout,
) -> Result<PooledBuffer> {
    let (xs, ws) = (x.1.shape(), out.shape());
    let hw = out_hw(xs, ws, p);
    let body = format!(
        r#"
const G_LAYOUT: u32 = {L0}u;
const X_LAYOUT: u32 = {L1}u;
const OUT_LAYOUT: u32 = {L2}u;
{INPUT_TAP}
fn a_at(z: u32, row: u32, kk: u32) -> f32 {{
    let plane = geo(8u) * geo(9u);
    let q = kk % plane;
    return load_a(strided4(G_LAYOUT, kk / plane, z * out_per_group() + row, q / geo(9u), q % geo(9u)));
}}
fn b_at(z: u32, kk: u32, col: u32) -> f32 {{
    let plane = geo(8u) * geo(9u);
    let q = kk % plane;
    let taps = geo(6u) * geo(7u);
    let r = col % taps;
    return input_at(kk / plane, z * geo(5u) + col / taps, q / geo(9u), q % geo(9u), r / geo(7u), r % geo(7u));
}}
fn store_c(z: u32, row: u32, col: u32, v: f32) {{
    let taps = geo(6u) * geo(7u);
    let r = col % taps;
    store_y(strided4(OUT_LAYOUT, z * out_per_group() + row, col / taps, r / geo(7u), r % geo(7u)), v);
}}
"#
    );
    let extra = layouts(geometry(xs, ws, hw, p), &[g.1, x.1, out])?;
    let og = ws[0] / p.groups;
    let mkn = [og, xs[0] * hw[0] * hw[1], ws[1] * ws[2] * ws[3]];
    let len = out.numel();
    launch(
        ctx,
        "conv2d_weight_grad",
        &body,
        [g.2, x.2, x.2],
        mkn,
        p.groups,
        extra,
        g.0,
        x.0,
        len,
    )
}

//! Softmax, gather/scatter-add, pooling, Philox random numbers and the input op.

use redline_tensor::{DType, Layout, Pool2dParams, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::elementwise::Operand;
use crate::shader::{self, grid, LAYOUT_WORDS, MAIN_1D, STRIDED4};

/// Splits a view into the part outside `axis` (with the offset) and its stride along `axis`.
fn without_axis(layout: &Layout, axis: usize) -> Layout {
    let mut shape = layout.shape().to_vec();
    shape[axis] = 1;
    Layout::new(shape, layout.strides().to_vec(), layout.offset())
}

/// (Log-)softmax along `axis`: one workgroup per row, tree reductions for the max and the sum.
pub(crate) fn softmax(
    ctx: &Context,
    x: &Operand<'_>,
    axis: usize,
    log: bool,
    out: &Layout,
) -> Result<PooledBuffer> {
    let (outer_x, outer_out) = (without_axis(x.layout, axis), without_axis(out, axis));
    let rows = outer_x.numel();
    let len = x.layout.shape()[axis];
    let strides_at = 2 + 2 * LAYOUT_WORDS;
    let key = format!("softmax|{log}|{:?}", x.dtype);
    let finish = if log {
        "v - log(total)"
    } else {
        "exp(v) / total"
    };
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[x.dtype]);
        src.push_str(&shader::input("a", 1, x.dtype));
        src.push_str(&shader::output("y", 2, x.dtype));
        src.push_str(&format!(
            r#"
{trees}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
    let o = wid.x + wid.y * nw.x;
    if (o >= params[0]) {{ return; }}
    let len = params[1];
    let xb = map_index(2u, o);
    let ob = map_index({out_base}u, o);
    let xs = params[{strides_at}u];
    let os = params[{strides_at}u + 1u];
    // From -inf (a row of values below -3.4e38 has a maximum too); a NaN spoils the sum
    // whatever max makes of it.
    var m = neg_inf();
    for (var j = t; j < len; j = j + 64u) {{ m = max(m, load_a(xb + j * xs)); }}
    sh[t] = m;
    tree_max(t);
    let mx = sh[0];
    workgroupBarrier();
    var acc = 0.0;
    for (var j = t; j < len; j = j + 64u) {{ acc = acc + exp(load_a(xb + j * xs) - mx); }}
    sh[t] = acc;
    tree_sum(t);
    let total = sh[0];
    for (var j = t; j < len; j = j + 64u) {{
        let v = load_a(xb + j * xs) - mx;
        store_y(ob + j * os, {finish});
    }}
}}
"#,
            out_base = 2 + LAYOUT_WORDS,
            trees = shader::workgroup_trees(64),
        ));
        src
    });
    let mut params = vec![rows as u32, len as u32];
    shader::push_layout(&mut params, &outer_x)?;
    shader::push_layout(&mut params, &outer_out)?;
    params.extend([x.layout.strides()[axis] as u32, out.strides()[axis] as u32]);
    let y = ctx.alloc(shader::storage_bytes(x.dtype, out.numel()));
    ctx.dispatch(
        &pipeline,
        &params,
        &[x.buffer, y.buffer()],
        None,
        grid(rows, 1),
    )?;
    Ok(y)
}

/// `out[p] = x[p with axis coordinate index[p]]`, contiguous of the index's shape.
pub(crate) fn gather(
    ctx: &Context,
    x: &Operand<'_>,
    axis: usize,
    index: &Operand<'_>,
) -> Result<PooledBuffer> {
    let n = index.layout.numel();
    let x_base = 2 + LAYOUT_WORDS;
    let key = format!("gather|{:?}|{:?}", x.dtype, index.dtype);
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[x.dtype]);
        src.push_str(&shader::input("a", 1, x.dtype));
        src.push_str(&shader::input("b", 2, index.dtype));
        src.push_str(&shader::output("y", 3, x.dtype));
        src.push_str(MAIN_1D);
        src.push_str(&format!(
            r#"    if (i >= params[0]) {{ return; }}
    let k = u32(max(load_b(map_index(2u, i)), 0.0));
    var rest = i;
    var at = params[{x_base}u + 1u];
    for (var d = i32(params[2u]) - 1; d >= 0; d = d - 1) {{
        let size = params[4u + u32(d)];
        var c = rest % size;
        rest = rest / size;
        if (u32(d) == params[1]) {{ c = k; }}
        at = at + c * params[{x_base}u + 8u + u32(d)];
    }}
    store_y(i, load_a(at));
}}
"#
        ));
        src
    });
    let mut params = vec![n as u32, axis as u32];
    shader::push_layout(&mut params, index.layout)?;
    shader::push_layout(&mut params, x.layout)?;
    let y = ctx.alloc(shader::storage_bytes(x.dtype, n));
    ctx.dispatch(
        &pipeline,
        &params,
        &[x.buffer, index.buffer, y.buffer()],
        None,
        grid(n, 256),
    )?;
    Ok(y)
}

/// `dst[.., index[p], ..] += src[p]` in place, deterministically: each destination element pulls
/// the contributions addressed to it (no float atomics, same sum order on every run).
pub(crate) fn scatter_add(
    ctx: &Context,
    dst: (&wgpu::Buffer, &[usize], DType),
    axis: usize,
    index: &Operand<'_>,
    src: &Operand<'_>,
) -> Result<()> {
    let n: usize = dst.1.iter().product();
    let idx_base = 4 + 6;
    let src_base = idx_base + LAYOUT_WORDS;
    let key = format!("scatter_add|{:?}|{:?}|{:?}", dst.2, index.dtype, src.dtype);
    let pipeline = ctx.pipeline(&key, || {
        let mut src_code = shader::prelude(&[dst.2, src.dtype]);
        src_code.push_str(&shader::input("b", 1, index.dtype));
        src_code.push_str(&shader::input("c", 2, src.dtype));
        src_code.push_str(&shader::inout("y", 3, dst.2));
        src_code.push_str(MAIN_1D);
        src_code.push_str(&format!(
            r#"    if (i >= params[0]) {{ return; }}
    let axis = params[1];
    let rank = params[3];
    var coord: array<u32, 6>;
    var rest = i;
    for (var d = i32(rank) - 1; d >= 0; d = d - 1) {{
        let size = params[4u + u32(d)];
        coord[d] = rest % size;
        rest = rest / size;
    }}
    // Positions of this element's row along the axis, in the index and in src.
    var ib = params[{idx_base}u + 1u];
    var sb = params[{src_base}u + 1u];
    for (var d = 0u; d < rank; d = d + 1u) {{
        if (d == axis) {{ continue; }}
        if (coord[d] >= params[{idx_base}u + 2u + d]) {{ return; }}
        ib = ib + coord[d] * params[{idx_base}u + 8u + d];
        sb = sb + coord[d] * params[{src_base}u + 8u + d];
    }}
    var acc = 0.0;
    for (var j = 0u; j < params[2]; j = j + 1u) {{
        let k = load_b(ib + j * params[{idx_base}u + 8u + axis]);
        if (k >= 0.0 && u32(k) == coord[axis]) {{
            acc = acc + load_c(sb + j * params[{src_base}u + 8u + axis]);
        }}
    }}
    if (acc != 0.0) {{ store_y(i, load_y(i) + acc); }}
}}
"#
        ));
        src_code
    });
    let mut params = vec![
        n as u32,
        axis as u32,
        index.layout.shape()[axis] as u32,
        dst.1.len() as u32,
    ];
    params.extend((0..6).map(|d| dst.1.get(d).copied().unwrap_or(1) as u32));
    shader::push_layout(&mut params, index.layout)?;
    shader::push_layout(&mut params, src.layout)?;
    ctx.dispatch(
        &pipeline,
        &params,
        &[index.buffer, src.buffer, dst.0],
        None,
        grid(n, 256),
    )
}

/// Pool geometry words: N C H W HO WO KH KW SH SW PH PW.
fn pool_params(x: &Layout, out: &Layout, p: &Pool2dParams) -> Vec<u32> {
    let (s, o) = (x.shape(), out.shape());
    [
        s[0],
        s[1],
        s[2],
        s[3],
        o[2],
        o[3],
        p.kernel[0],
        p.kernel[1],
        p.stride[0],
        p.stride[1],
        p.padding[0],
        p.padding[1],
    ]
    .map(|v| v as u32)
    .to_vec()
}

const POOL_GEOMETRY: &str = r#"
fn geo(i: u32) -> u32 { return params[1u + i]; }
"#;

/// Max pooling (values and first-maximum positions, i64, both in layout `out`) or average
/// pooling (`positions` false).
pub(crate) fn pool(
    ctx: &Context,
    x: &Operand<'_>,
    p: &Pool2dParams,
    out: &Layout,
    max: bool,
) -> Result<(PooledBuffer, Option<PooledBuffer>)> {
    let n = out.numel();
    let (x_base, out_base) = (13, 13 + LAYOUT_WORDS);
    let key = format!("pool|{max}|{:?}", x.dtype);
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[x.dtype]);
        src.push_str(&shader::input("a", 1, x.dtype));
        src.push_str(&shader::output("y", 2, x.dtype));
        if max {
            src.push_str(&shader::output("q", 3, DType::I64));
        }
        src.push_str(STRIDED4);
        src.push_str(POOL_GEOMETRY);
        src.push_str(MAIN_1D);
        let (init, update, finish) = if max {
            (
                // The window's first element, then the first NaN or a greater value (the
                // reference's): an all -inf window keeps -inf and its first position.
                "var best = 0.0; var at = 0xffffffffu;",
                "if (at == 0xffffffffu || (!is_nan(best) && (is_nan(v) || v > best))) { best = v; at = u32(hi) * geo(3u) + u32(wi); }",
                "store_y(strided4(OUT, n, c, ho, wo), best); store_q(strided4(OUT, n, c, ho, wo), f32(at));",
            )
        } else {
            (
                "var best = 0.0;",
                "best = best + v;",
                "store_y(strided4(OUT, n, c, ho, wo), best / f32(geo(6u) * geo(7u)));",
            )
        };
        src.push_str(&format!(
            r#"    if (i >= params[0]) {{ return; }}
    let wo = i % geo(5u);
    let ho = (i / geo(5u)) % geo(4u);
    let c = (i / (geo(5u) * geo(4u))) % geo(1u);
    let n = i / (geo(5u) * geo(4u) * geo(1u));
    {init}
    for (var kh = 0u; kh < geo(6u); kh = kh + 1u) {{
        for (var kw = 0u; kw < geo(7u); kw = kw + 1u) {{
            let hi = i32(ho * geo(8u) + kh) - i32(geo(10u));
            let wi = i32(wo * geo(9u) + kw) - i32(geo(11u));
            if (hi >= 0 && wi >= 0 && hi < i32(geo(2u)) && wi < i32(geo(3u))) {{
                let v = load_a(strided4(X, n, c, u32(hi), u32(wi)));
                {update}
            }}
        }}
    }}
    {finish}
}}
const X: u32 = {x_base}u;
const OUT: u32 = {out_base}u;
"#
        ));
        src
    });
    let mut params = vec![n as u32];
    params.extend(pool_params(x.layout, out, p));
    shader::push_layout(&mut params, x.layout)?;
    shader::push_layout(&mut params, out)?;
    let y = ctx.alloc(shader::storage_bytes(x.dtype, n));
    if max {
        let q = ctx.alloc(shader::storage_bytes(DType::I64, n));
        ctx.dispatch(
            &pipeline,
            &params,
            &[x.buffer, y.buffer(), q.buffer()],
            None,
            grid(n, 256),
        )?;
        Ok((y, Some(q)))
    } else {
        ctx.dispatch(
            &pipeline,
            &params,
            &[x.buffer, y.buffer()],
            None,
            grid(n, 256),
        )?;
        Ok((y, None))
    }
}

/// The input gradient of pooling, written in layout `out` (the input's shape), as a pull: each
/// input element visits only the outputs whose windows cover it (`ceil((h + pad - k + 1) / s)`
/// to `(h + pad) / s` on each axis, in output order) and sums their gradients — divided by the
/// window area for average pooling; for max pooling only those whose recorded maximum
/// (`positions`, flat in-plane) is this element. No atomics: the same bits on every run.
pub(crate) fn pool_grad(
    ctx: &Context,
    g: &Operand<'_>,
    positions: Option<&Operand<'_>>,
    p: &Pool2dParams,
    out: &Layout,
) -> Result<PooledBuffer> {
    let n = out.numel();
    let (g_base, out_base, at_base) = (13, 13 + LAYOUT_WORDS, 13 + 2 * LAYOUT_WORDS);
    let max = positions.is_some();
    let key = format!("pool_grad|{max}|{:?}", g.dtype);
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[g.dtype]);
        src.push_str(&shader::input("a", 1, g.dtype));
        if max {
            src.push_str(&shader::input("b", 2, DType::I64));
        }
        src.push_str(&shader::output("y", if max { 3 } else { 2 }, g.dtype));
        src.push_str(STRIDED4);
        src.push_str(POOL_GEOMETRY);
        src.push_str(MAIN_1D);
        let (take, finish) = if max {
            (
                "if (u32(load_b(strided4(AT, n, c, ho, wo))) == h * geo(3u) + w) { acc = acc + load_a(strided4(G, n, c, ho, wo)); }",
                "acc",
            )
        } else {
            (
                "acc = acc + load_a(strided4(G, n, c, ho, wo));",
                "acc / f32(geo(6u) * geo(7u))",
            )
        };
        src.push_str(&format!(
            r#"    if (i >= params[0]) {{ return; }}
    let w = i % geo(3u);
    let h = (i / geo(3u)) % geo(2u);
    let c = (i / (geo(3u) * geo(2u))) % geo(1u);
    let n = i / (geo(3u) * geo(2u) * geo(1u));
    // The outputs whose windows cover (h, w).
    let hp = i32(h + geo(10u));
    let wp = i32(w + geo(11u));
    let hn = hp - i32(geo(6u)) + 1;
    let wn = wp - i32(geo(7u)) + 1;
    let ho0 = u32(select(0, (hn + i32(geo(8u)) - 1) / i32(geo(8u)), hn > 0));
    let wo0 = u32(select(0, (wn + i32(geo(9u)) - 1) / i32(geo(9u)), wn > 0));
    let ho1 = min(u32(hp) / geo(8u) + 1u, geo(4u));
    let wo1 = min(u32(wp) / geo(9u) + 1u, geo(5u));
    var acc = 0.0;
    for (var ho = ho0; ho < ho1; ho = ho + 1u) {{
        for (var wo = wo0; wo < wo1; wo = wo + 1u) {{
            {take}
        }}
    }}
    store_y(strided4(OUT, n, c, h, w), {finish});
}}
const G: u32 = {g_base}u;
const OUT: u32 = {out_base}u;
const AT: u32 = {at_base}u;
"#
        ));
        src
    });
    let mut params = vec![n as u32];
    params.extend(pool_params(out, g.layout, p));
    shader::push_layout(&mut params, g.layout)?;
    shader::push_layout(&mut params, out)?;
    let y = ctx.alloc(shader::storage_bytes(g.dtype, n));
    let mut buffers = vec![g.buffer];
    if let Some(at) = positions {
        shader::push_layout(&mut params, at.layout)?;
        buffers.push(at.buffer);
    }
    buffers.push(y.buffer());
    ctx.dispatch(&pipeline, &params, &buffers, None, grid(n, 256))?;
    Ok(y)
}

/// Philox-4x32-10, bit for bit the reference's: element `i` uses counter `(offset + i) / 4` and
/// word `(offset + i) % 4`.
pub(crate) fn random_uniform(
    ctx: &Context,
    dtype: DType,
    len: usize,
    seed: u64,
    offset: u64,
) -> Result<PooledBuffer> {
    let key = format!("random|{dtype:?}");
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[dtype]);
        src.push_str(&shader::output("y", 1, dtype));
        src.push_str(
            r#"
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let ll = (a & 0xffffu) * (b & 0xffffu);
    let lh = (a & 0xffffu) * (b >> 16u);
    let hl = (a >> 16u) * (b & 0xffffu);
    let hh = (a >> 16u) * (b >> 16u);
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    return vec2<u32>(hh + (lh >> 16u) + (hl >> 16u) + (mid >> 16u), (ll & 0xffffu) | (mid << 16u));
}

fn philox(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var r = 0u; r < 10u; r = r + 1u) {
        if (r > 0u) { k = k + vec2<u32>(0x9E3779B9u, 0xBB67AE85u); }
        let p0 = mulhilo(0xD2511F53u, c.x);
        let p1 = mulhilo(0xCD9E8D57u, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
    }
    return c;
}
"#,
        );
        src.push_str(MAIN_1D);
        src.push_str(
            r#"    if (i >= params[0]) { return; }
    let lo = params[3] + i;
    let hi = params[4] + select(0u, 1u, lo < params[3]);
    let words = philox(vec4<u32>((lo >> 2u) | (hi << 30u), hi >> 2u, 0u, 0u), vec2<u32>(params[1], params[2]));
    store_y(i, f32(words[lo & 3u] >> 8u) / 16777216.0);
}
"#,
        );
        src
    });
    let params = [
        len as u32,
        seed as u32,
        (seed >> 32) as u32,
        offset as u32,
        (offset >> 32) as u32,
    ];
    let y = ctx.alloc(shader::storage_bytes(dtype, len));
    ctx.dispatch(&pipeline, &params, &[y.buffer()], None, grid(len, 256))?;
    Ok(y)
}

/// The input op: u8 `[N, H, W, C]` → `(x / 255 - mean[c]) / std[c]`, logically NCHW in `out`.
pub(crate) fn normalize_input(
    ctx: &Context,
    x: &Operand<'_>,
    mean: &[f64],
    std: &[f64],
    dtype: DType,
    out: &Layout,
) -> Result<PooledBuffer> {
    let n = out.numel();
    let (x_base, out_base) = (5, 5 + LAYOUT_WORDS);
    let stats = out_base + LAYOUT_WORDS;
    let key = format!("normalize|{:?}|{dtype:?}", x.dtype);
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[x.dtype, dtype]);
        src.push_str(&shader::input("a", 1, x.dtype));
        src.push_str(&shader::output("y", 2, dtype));
        src.push_str(STRIDED4);
        src.push_str(MAIN_1D);
        src.push_str(&format!(
            r#"    if (i >= params[0]) {{ return; }}
    let w = i % params[4];
    let h = (i / params[4]) % params[3];
    let c = (i / (params[4] * params[3])) % params[2];
    let n = i / (params[4] * params[3] * params[2]);
    let v = load_a(strided4({x_base}u, n, h, w, c));
    // (`std` is a reserved word in WGSL.)
    let centre = param_f32({stats}u + c);
    let spread = param_f32({stats}u + params[2] + c);
    store_y(strided4({out_base}u, n, c, h, w), (v / 255.0 - centre) / spread);
}}
"#
        ));
        src
    });
    let s = out.shape();
    let mut params = vec![n as u32, s[0] as u32, s[1] as u32, s[2] as u32, s[3] as u32];
    shader::push_layout(&mut params, x.layout)?;
    shader::push_layout(&mut params, out)?;
    params.extend(mean.iter().chain(std).map(|&v| (v as f32).to_bits()));
    let y = ctx.alloc(shader::storage_bytes(dtype, n));
    ctx.dispatch(
        &pipeline,
        &params,
        &[x.buffer, y.buffer()],
        None,
        grid(n, 256),
    )?;
    Ok(y)
}

//! Reductions: one workgroup per output element, a strided pass per thread, then a tree in
//! workgroup memory.

use redline_tensor::{DType, Layout, ReduceOp, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::elementwise::Operand;
use crate::shader::{self, LAYOUT_WORDS};

const THREADS: u32 = 64;

pub(crate) fn run(
    ctx: &Context,
    op: ReduceOp,
    x: &Operand<'_>,
    axes: &[usize],
) -> Result<PooledBuffer> {
    let shape = x.layout.shape();
    // Split the view into the kept axes (outer, with the offset) and the reduced ones (inner).
    let keep = |reduced: bool| -> Layout {
        let sizes: Vec<usize> = (0..shape.len())
            .map(|d| {
                if axes.contains(&d) == reduced {
                    shape[d]
                } else {
                    1
                }
            })
            .collect();
        let offset = if reduced { 0 } else { x.layout.offset() };
        Layout::new(sizes, x.layout.strides().to_vec(), offset)
    };
    let (outer, inner) = (keep(false), keep(true));
    let out_dtype = if op == ReduceOp::ArgMax {
        DType::I64
    } else {
        x.dtype
    };
    // -inf to start; a NaN, once met, stays (the first, for argmax), as in the reference and
    // PyTorch.
    let init = match op {
        ReduceOp::Sum => "0.0",
        ReduceOp::Max | ReduceOp::ArgMax => "neg_inf()",
    };
    let combine = match op {
        ReduceOp::Sum => "acc = acc + v;",
        ReduceOp::Max => "if (!is_nan(acc) && (is_nan(v) || v > acc)) { acc = v; }",
        ReduceOp::ArgMax => "if (!is_nan(acc) && (is_nan(v) || v > acc)) { acc = v; arg = j; }",
    };
    let merge = match op {
        ReduceOp::Sum => "sh[t] = sh[t] + sh[t + s];",
        ReduceOp::Max => {
            "if (!is_nan(sh[t]) && (is_nan(sh[t + s]) || sh[t + s] > sh[t])) { sh[t] = sh[t + s]; }"
        }
        // The greater, the earlier of equals, the earlier of two NaNs, a NaN over a number.
        ReduceOp::ArgMax => {
            "let na = is_nan(sh[t]); let nb = is_nan(sh[t + s]); let earlier = sa[t + s] < sa[t];
            var take = sh[t + s] > sh[t] || (sh[t + s] == sh[t] && earlier);
            if (na || nb) { take = nb && (!na || earlier); }
            if (take) { sh[t] = sh[t + s]; sa[t] = sa[t + s]; }"
        }
    };
    let key = format!("reduce|{op:?}|{:?}", x.dtype);
    let inner_base = 2 + LAYOUT_WORDS;
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[x.dtype, out_dtype]);
        src.push_str(&shader::input("a", 1, x.dtype));
        src.push_str(&shader::output("y", 2, out_dtype));
        src.push_str(&format!(
            r#"
var<workgroup> sh: array<f32, {THREADS}>;
var<workgroup> sa: array<u32, {THREADS}>;

@compute @workgroup_size({THREADS})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
    let o = wid.x + wid.y * nw.x;
    if (o >= params[0]) {{ return; }}
    let base = map_index(2u, o);
    var acc: f32 = {init};
    var arg: u32 = 0u;
    for (var j = t; j < params[1]; j = j + {THREADS}u) {{
        let v = load_a(base + map_index({inner_base}u, j));
        {combine}
    }}
    sh[t] = acc;
    sa[t] = arg;
    workgroupBarrier();
    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (t < s) {{ {merge} }}
        workgroupBarrier();
    }}
    if (t == 0u) {{ store_y(o, {out}); }}
}}
"#,
            half = THREADS / 2,
            out = if op == ReduceOp::ArgMax { "f32(sa[0])" } else { "sh[0]" },
        ));
        src
    });
    let outputs = outer.numel();
    let mut params = vec![outputs as u32, inner.numel() as u32];
    shader::push_layout(&mut params, &outer)?;
    shader::push_layout(&mut params, &inner)?;
    let y = ctx.alloc(shader::storage_bytes(out_dtype, outputs));
    let clear = shader::atomic_output(out_dtype).then_some(y.buffer());
    let groups = shader::grid(outputs, 1);
    ctx.dispatch(&pipeline, &params, &[x.buffer, y.buffer()], clear, groups)?;
    Ok(y)
}

/// Σ x² over every element of every tensor in `tensors` (buffer, length; all of `dtype`), as
/// one element of `out_dtype`: a pass per tensor writes the partial sums of up to
/// [`SQUARES_BLOCKS`] workgroups, then one workgroup adds them up in order — deterministic,
/// N + 1 launches where the composition took three ops per tensor.
pub(crate) fn sum_squares(
    ctx: &Context,
    dtype: DType,
    tensors: &[(&wgpu::Buffer, usize)],
    out_dtype: DType,
) -> Result<PooledBuffer> {
    let blocks: Vec<usize> = (tensors.iter())
        .map(|&(_, len)| len.div_ceil(THREADS as usize * 16).clamp(1, SQUARES_BLOCKS))
        .collect();
    let total: usize = blocks.iter().sum();
    let partials = ctx.alloc(shader::storage_bytes(DType::F32, total));
    let tree = |store: &str| {
        format!("    sh[t] = acc;\n    tree_sum(t);\n    if (t == 0u) {{ {store} }}\n}}\n")
    };
    let part = ctx.pipeline(&format!("sum_squares_part|{dtype:?}"), || {
        let mut src = shader::prelude(&[dtype]);
        src.push_str(&shader::input("a", 1, dtype));
        src.push_str(&shader::output("p", 2, DType::F32));
        src.push_str(&format!(
            r#"
{trees}
@compute @workgroup_size({THREADS})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
    let step = params[2] * {THREADS}u;
    var acc: f32 = 0.0;
    for (var j = wid.x * {THREADS}u + t; j < params[0]; j = j + step) {{
        let v = load_a(j);
        acc = acc + v * v;
    }}
"#,
            trees = shader::workgroup_trees(THREADS)
        ));
        src.push_str(&tree("store_p(params[1] + wid.x, sh[0]);"));
        src
    });
    let mut first = 0;
    for (&(buffer, len), &n) in tensors.iter().zip(&blocks) {
        let params = [len as u32, first as u32, n as u32];
        ctx.dispatch(
            &part,
            &params,
            &[buffer, partials.buffer()],
            None,
            [n as u32, 1, 1],
        )?;
        first += n;
    }
    let sum = ctx.pipeline(&format!("sum_squares_total|{out_dtype:?}"), || {
        let mut src = shader::prelude(&[out_dtype]);
        src.push_str(&shader::input("p", 1, DType::F32));
        src.push_str(&shader::output("y", 2, out_dtype));
        src.push_str(&format!(
            r#"
{trees}
@compute @workgroup_size({THREADS})
fn main(@builtin(local_invocation_index) t: u32) {{
    var acc: f32 = 0.0;
    for (var j = t; j < params[0]; j = j + {THREADS}u) {{ acc = acc + load_p(j); }}
"#,
            trees = shader::workgroup_trees(THREADS)
        ));
        src.push_str(&tree("store_y(0u, sh[0]);"));
        src
    });
    let y = ctx.alloc(shader::storage_bytes(out_dtype, 1));
    let params = [total as u32];
    ctx.dispatch(
        &sum,
        &params,
        &[partials.buffer(), y.buffer()],
        None,
        [1, 1, 1],
    )?;
    Ok(y)
}

/// The most workgroups one tensor's pass of [`sum_squares`] uses.
pub(crate) const SQUARES_BLOCKS: usize = 256;

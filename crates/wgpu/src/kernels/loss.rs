//! The label-smoothed cross-entropy in three launches (where the composition takes ~22): the
//! kept samples counted in one workgroup; a workgroup per row for its log-sum-exp, its loss and
//! (when asked) its gradient, already divided by the count; one workgroup adding the rows'
//! losses in order. Deterministic; accumulated in f32.

use redline_tensor::{DType, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::elementwise::Operand;
use crate::shader::{self, grid};

const THREADS: u32 = 64;

/// The loss (one element of the logits' dtype) and, with `grad`, ∂loss/∂logits (`[N, C]`
/// contiguous) of `logits` `[N, C]` (any strides) against the i64 `targets` at element
/// `targets.1` of their buffer.
pub(crate) fn cross_entropy(
    ctx: &Context,
    logits: &Operand<'_>,
    targets: (&wgpu::Buffer, usize),
    smoothing: f64,
    ignore_index: i64,
    grad: bool,
) -> Result<(PooledBuffer, Option<PooledBuffer>)> {
    let dtype = logits.dtype;
    let (n, c) = (logits.layout.shape()[0], logits.layout.shape()[1]);
    let strides = logits.layout.strides();
    let params = [
        n as u32,
        c as u32,
        logits.layout.offset() as u32,
        strides[0] as u32,
        strides[1] as u32,
        targets.1 as u32,
        // Targets are read as i32 (indices below 2^31): an ignore_index beyond that range (the
        // front end's "none", i64::MIN) matches no target.
        i32::try_from(ignore_index).map_or(0, |i| i as u32),
        (smoothing as f32).to_bits(),
        i32::try_from(ignore_index).is_ok() as u32,
    ];
    let head = |src: &mut String| {
        src.push_str(&format!(
            "{}\nfn kept(o: u32) -> bool {{ return params[8] == 0u || i32(load_tg(params[5] + o)) != bitcast<i32>(params[6]); }}\n",
            shader::workgroup_trees(THREADS)
        ));
    };
    // 1: how many samples count (f32 scratch: [count]).
    let count = ctx.alloc(shader::storage_bytes(DType::F32, 1));
    let pipeline = ctx.pipeline("ce_count", || {
        let mut src = shader::prelude(&[DType::I64]);
        src.push_str(&shader::input("tg", 1, DType::I64));
        src.push_str(&shader::output("cnt", 2, DType::F32));
        head(&mut src);
        src.push_str(&format!(
            r#"@compute @workgroup_size({THREADS})
fn main(@builtin(local_invocation_index) t: u32) {{
    var acc = 0.0;
    for (var o = t; o < params[0]; o = o + {THREADS}u) {{ acc = acc + select(0.0, 1.0, kept(o)); }}
    sh[t] = acc;
    tree_sum(t);
    if (t == 0u) {{ store_cnt(0u, sh[0]); }}
}}
"#
        ));
        src
    });
    ctx.dispatch(
        &pipeline,
        &params,
        &[targets.0, count.buffer()],
        None,
        [1, 1, 1],
    )?;
    // 2: a workgroup per row: its loss into `rows`, its gradient scaled by 1/count.
    let rows = ctx.alloc(shader::storage_bytes(DType::F32, n));
    let g = grad.then(|| ctx.alloc(shader::storage_bytes(dtype, n * c)));
    let key = format!("ce_rows|{dtype:?}|{grad}");
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[dtype, DType::I64]);
        src.push_str(&shader::input("x", 1, dtype));
        src.push_str(&shader::input("tg", 2, DType::I64));
        src.push_str(&shader::input("cnt", 3, DType::F32));
        src.push_str(&shader::output("rows", 4, DType::F32));
        if grad {
            src.push_str(&shader::output("g", 5, dtype));
        }
        head(&mut src);
        let gradient = if grad {
            r#"
    let scale = select(0.0, 1.0 / cnt, cnt > 0.0 && keep);
    for (var j = t; j < c; j = j + 64u) {
        let p = exp(load_x(at(o, j)) - mx) / total;
        let hot = select(0.0, 1.0 - eps, i32(j) == tg);
        store_g(o * c + j, scale * (p - hot - eps / f32(c)));
    }"#
        } else {
            ""
        };
        src.push_str(&format!(
            r#"fn at(o: u32, j: u32) -> u32 {{ return params[2] + o * params[3] + j * params[4]; }}

@compute @workgroup_size({THREADS})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
    let o = wid.x + wid.y * nw.x;
    if (o >= params[0]) {{ return; }}
    let c = params[1];
    let eps = param_f32(7u);
    var m = neg_inf();  // as softmax's
    for (var j = t; j < c; j = j + 64u) {{ m = max(m, load_x(at(o, j))); }}
    sh[t] = m;
    tree_max(t);
    let mx = sh[0];
    workgroupBarrier();
    var e = 0.0;
    for (var j = t; j < c; j = j + 64u) {{ e = e + exp(load_x(at(o, j)) - mx); }}
    sh[t] = e;
    tree_sum(t);
    let total = sh[0];
    workgroupBarrier();
    // Σ (x − max): the smoothing term is log Σ e^(x − max) − mean(x − max), as on CUDA.
    var sx = 0.0;
    for (var j = t; j < c; j = j + 64u) {{ sx = sx + (load_x(at(o, j)) - mx); }}
    sh[t] = sx;
    tree_sum(t);
    let sum_x = sh[0];
    let tg = i32(load_tg(params[5] + o));
    let keep = kept(o);
    let cnt = load_cnt(0u);
    if (t == 0u) {{
        var l = 0.0;
        if (keep) {{
            if (tg < 0 || u32(tg) >= c) {{
                l = bitcast<f32>(0x7fc00000u);
            }} else {{
                let lse = mx + log(total);
                // No smoothing term without smoothing: 0 · inf is NaN for a masked (-inf) logit.
                let smoothed = select(eps * (log(total) - sum_x / f32(c)), 0.0, eps == 0.0);
                l = (1.0 - eps) * (lse - load_x(at(o, u32(tg)))) + smoothed;
            }}
        }}
        store_rows(o, l);
    }}{gradient}
}}
"#
        ));
        src
    });
    let mut buffers = vec![logits.buffer, targets.0, count.buffer(), rows.buffer()];
    buffers.extend(g.as_ref().map(PooledBuffer::buffer));
    ctx.dispatch(&pipeline, &params, &buffers, None, grid(n, 1))?;
    // 3: the rows' losses added in order and divided by the count.
    let loss = ctx.alloc(shader::storage_bytes(dtype, 1));
    let pipeline = ctx.pipeline(&format!("ce_total|{dtype:?}"), || {
        let mut src = shader::prelude(&[dtype]);
        src.push_str(&shader::input("rows", 1, DType::F32));
        src.push_str(&shader::input("cnt", 2, DType::F32));
        src.push_str(&shader::output("y", 3, dtype));
        src.push_str(&shader::workgroup_trees(THREADS));
        src.push_str(&format!(
            r#"@compute @workgroup_size({THREADS})
fn main(@builtin(local_invocation_index) t: u32) {{
    var acc = 0.0;
    for (var o = t; o < params[0]; o = o + {THREADS}u) {{ acc = acc + load_rows(o); }}
    sh[t] = acc;
    tree_sum(t);
    let cnt = load_cnt(0u);
    if (t == 0u) {{ store_y(0u, select(0.0, sh[0] / cnt, cnt > 0.0)); }}
}}
"#
        ));
        src
    });
    let buffers = [rows.buffer(), count.buffer(), loss.buffer()];
    ctx.dispatch(&pipeline, &params, &buffers, None, [1, 1, 1])?;
    Ok((loss, g))
}

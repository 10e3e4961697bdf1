//! The optimizer and mixed-precision updates, in place. Each reads the device found-inf flag and
//! does nothing when it is set, so no step needs the host to look at it.

use redline_tensor::{AdamWParams, DType, Result, ScalerParams, SgdParams};

use crate::context::Context;
use crate::shader::{self, grid, MAIN_1D};

/// Whether `v` is inf or NaN, by its exponent bits (immune to fast-math folding).
const NON_FINITE: &str = r#"
fn non_finite(v: f32) -> bool { return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u; }
"#;

/// A one-element device tensor and its dtype: each is read in its own, whatever the tensors
/// it steers hold (a GradScaler's f32 flag and scale beside f16 gradients, PyTorch's too).
#[derive(Clone, Copy)]
pub(crate) struct Scalar<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub dtype: DType,
}

/// The device scalars an update reads: its (already counted) step, the learning rate, and the
/// found-inf flag that skips it.
pub(crate) struct StepScalars<'a> {
    pub step: Scalar<'a>,
    pub lr: Scalar<'a>,
    pub found: Scalar<'a>,
}

/// A pipeline's cache key: its name and every dtype its bindings read.
fn key(name: &str, dtypes: &[DType]) -> String {
    dtypes
        .iter()
        .fold(name.to_string(), |k, d| format!("{k}|{d:?}"))
}

/// One SGD update of `p` (and its momentum buffer `m`) from `g` at learning rate
/// `lr · lr_scale`, filling the buffer on the first applied step, unless `found` is set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd(
    ctx: &Context,
    dtype: DType,
    p: &wgpu::Buffer,
    g: &wgpu::Buffer,
    m: Option<&wgpu::Buffer>,
    at: &StepScalars<'_>,
    len: usize,
    hp: &SgdParams,
) -> Result<()> {
    let momentum = m.is_some();
    let dtypes = [dtype, at.found.dtype, at.step.dtype, at.lr.dtype];
    let pipeline = ctx.pipeline(&key(&format!("sgd|{momentum}"), &dtypes), || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(&shader::inout("p", 1, dtype));
        src.push_str(&shader::input("g", 2, dtype));
        src.push_str(&shader::input("f", 3, at.found.dtype));
        src.push_str(&shader::input("s", 4, at.step.dtype));
        src.push_str(&shader::input("lr", 5, at.lr.dtype));
        if momentum {
            src.push_str(&shader::inout("m", 6, dtype));
        }
        src.push_str(MAIN_1D);
        let update = if momentum {
            r#"
    var b = d;
    if (load_s(0u) != 1.0) { b = param_f32(2u) * load_m(i) + (1.0 - param_f32(3u)) * d; }
    store_m(i, b);
    if (params[5] != 0u) { d = d + param_f32(2u) * b; } else { d = b; }"#
        } else {
            ""
        };
        src.push_str(&format!(
            r#"    if (i >= params[0] || load_f(0u) != 0.0) {{ return; }}
    let w = load_p(i);
    var d = load_g(i) + param_f32(4u) * w;{update}
    store_p(i, w - load_lr(0u) * param_f32(1u) * d);
}}
"#
        ));
        src
    });
    let f = |v: f64| (v as f32).to_bits();
    let params = [
        len as u32,
        f(hp.lr_scale),
        f(hp.momentum),
        f(hp.dampening),
        f(hp.weight_decay),
        hp.nesterov as u32,
    ];
    let mut buffers = vec![p, g, at.found.buffer, at.step.buffer, at.lr.buffer];
    buffers.extend(m);
    ctx.dispatch(&pipeline, &params, &buffers, None, grid(len, 256))
}

/// `step += 1` unless `found` is set (the optimizers count only applied steps).
pub(crate) fn count_step(ctx: &Context, step: Scalar<'_>, found: Scalar<'_>) -> Result<()> {
    let dtypes = [step.dtype, found.dtype];
    let pipeline = ctx.pipeline(&key("count_step", &dtypes), || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(&shader::inout("s", 1, step.dtype));
        src.push_str(&shader::input("f", 2, found.dtype));
        // `params[0]` is always 0; reading it keeps the parameter binding in the layout.
        src.push_str("@compute @workgroup_size(1)\nfn main() {\n    if (params[0] == 0u && load_f(0u) == 0.0) { store_s(0u, load_s(0u) + 1.0); }\n}\n");
        src
    });
    ctx.dispatch(
        &pipeline,
        &[0],
        &[step.buffer, found.buffer],
        None,
        [1, 1, 1],
    )
}

/// One AdamW update of `p`, `m`, `v` from `g` at the (already counted) step and learning rate
/// `lr · lr_scale`, unless `found`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    ctx: &Context,
    dtype: DType,
    p: &wgpu::Buffer,
    g: &wgpu::Buffer,
    m: &wgpu::Buffer,
    v: &wgpu::Buffer,
    at: &StepScalars<'_>,
    len: usize,
    hp: &AdamWParams,
) -> Result<()> {
    let dtypes = [dtype, at.step.dtype, at.found.dtype, at.lr.dtype];
    let pipeline = ctx.pipeline(&key("adamw", &dtypes), || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(&shader::inout("p", 1, dtype));
        src.push_str(&shader::input("g", 2, dtype));
        src.push_str(&shader::inout("m", 3, dtype));
        src.push_str(&shader::inout("sq", 4, dtype));
        src.push_str(&shader::input("s", 5, at.step.dtype));
        src.push_str(&shader::input("f", 6, at.found.dtype));
        src.push_str(&shader::input("lr", 7, at.lr.dtype));
        src.push_str(MAIN_1D);
        src.push_str(
            r#"    if (i >= params[0] || load_f(0u) != 0.0) { return; }
    let lr = load_lr(0u) * param_f32(1u);
    let b1 = param_f32(2u);
    let b2 = param_f32(3u);
    let t = load_s(0u);
    let grad = load_g(i);
    let decayed = load_p(i) * (1.0 - lr * param_f32(5u));
    let first = b1 * load_m(i) + (1.0 - b1) * grad;
    let second = b2 * load_sq(i) + (1.0 - b2) * grad * grad;
    store_m(i, first);
    store_sq(i, second);
    let denom = sqrt(second) / sqrt(1.0 - pow(b2, t)) + param_f32(4u);
    store_p(i, decayed - lr / (1.0 - pow(b1, t)) * first / denom);
}
"#,
        );
        src
    });
    let f = |x: f64| (x as f32).to_bits();
    let params = [
        len as u32,
        f(hp.lr_scale),
        f(hp.beta1),
        f(hp.beta2),
        f(hp.eps),
        f(hp.weight_decay),
    ];
    ctx.dispatch(
        &pipeline,
        &params,
        &[p, g, m, v, at.step.buffer, at.found.buffer, at.lr.buffer],
        None,
        grid(len, 256),
    )
}

/// `g *= inv_scale`, raising `found` on any inf/NaN.
pub(crate) fn unscale_check(
    ctx: &Context,
    dtype: DType,
    g: &wgpu::Buffer,
    inv: Scalar<'_>,
    found: Scalar<'_>,
    len: usize,
) -> Result<()> {
    let dtypes = [dtype, inv.dtype, found.dtype];
    let pipeline = ctx.pipeline(&key("unscale", &dtypes), || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(NON_FINITE);
        src.push_str(&shader::inout("g", 1, dtype));
        src.push_str(&shader::input("s", 2, inv.dtype));
        src.push_str(&shader::inout("f", 3, found.dtype));
        src.push_str(MAIN_1D);
        src.push_str(
            r#"    if (i >= params[0]) { return; }
    let v = load_g(i) * load_s(0u);
    store_g(i, v);
    // Every writer stores the same 1.0: a benign race.
    if (non_finite(load_g(i))) { store_f(0u, 1.0); }
}
"#,
        );
        src
    });
    ctx.dispatch(
        &pipeline,
        &[len as u32],
        &[g, inv.buffer, found.buffer],
        None,
        grid(len, 256),
    )
}

/// GradScaler's update on the device (one thread), then clears `found`.
pub(crate) fn scaler_update(
    ctx: &Context,
    scale: Scalar<'_>,
    tracker: Scalar<'_>,
    found: Scalar<'_>,
    hp: &ScalerParams,
) -> Result<()> {
    let dtypes = [scale.dtype, tracker.dtype, found.dtype];
    let pipeline = ctx.pipeline(&key("scaler", &dtypes), || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(&shader::inout("s", 1, scale.dtype));
        src.push_str(&shader::inout("t", 2, tracker.dtype));
        src.push_str(&shader::inout("f", 3, found.dtype));
        src.push_str(
            r#"@compute @workgroup_size(1)
fn main() {
    if (load_f(0u) != 0.0) {
        store_s(0u, load_s(0u) * param_f32(1u));
        store_t(0u, 0.0);
    } else if (load_t(0u) + 1.0 >= f32(params[2])) {
        store_s(0u, load_s(0u) * param_f32(0u));
        store_t(0u, 0.0);
    } else {
        store_t(0u, load_t(0u) + 1.0);
    }
    store_f(0u, 0.0);
}
"#,
        );
        src
    });
    let params = [
        (hp.growth_factor as f32).to_bits(),
        (hp.backoff_factor as f32).to_bits(),
        hp.growth_interval.min(u32::MAX as u64) as u32,
    ];
    ctx.dispatch(
        &pipeline,
        &params,
        &[scale.buffer, tracker.buffer, found.buffer],
        None,
        [1, 1, 1],
    )
}

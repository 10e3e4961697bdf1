//! Batch norm's per-channel coefficients, one invocation per channel: the forward's scale and
//! shift (and the running statistics' update) from the channel sums, and the backward's input
//! gradient coefficients and the weight and bias gradients. One launch each where composing
//! them from elementwise kernels took about thirty; the math is `BatchNormCoefParams::host` and
//! `host_grad`, in f32.

use redline_tensor::{BatchNormCoefParams, DType, Result};

use crate::context::Context;
use crate::shader::{self, grid, MAIN_1D};

/// A contiguous operand: its buffer and the element its first value is at.
pub(crate) type Operand<'a> = (&'a wgpu::Buffer, usize);

/// Appends `load_<name>` for an optional operand (or a constant when it is absent) and returns
/// its next free binding.
fn optional(
    src: &mut String,
    name: &str,
    binding: u32,
    dtype: DType,
    present: bool,
    or: f32,
) -> u32 {
    if present {
        src.push_str(&shader::input(name, binding, dtype));
        binding + 1
    } else {
        src.push_str(&format!(
            "fn load_{name}(at: u32) -> f32 {{ return {or:?}; }}\n"
        ));
        binding
    }
}

fn offset(o: Option<Operand<'_>>) -> u32 {
    o.map_or(0, |(_, at)| at as u32)
}

/// Forward coefficients: `coef` `[scale; shift; r]` (3·C) and `saved` `[mean; rstd]` (2·C)
/// from `sums` `[Σx; Σx²]` taken about `centre` (0 when absent, or where not finite), updating
/// `running` (mean, variance) in place when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_coef(
    ctx: &Context,
    dtype: DType,
    c: usize,
    sums: Operand<'_>,
    centre: Option<Operand<'_>>,
    weight: Option<Operand<'_>>,
    bias: Option<Operand<'_>>,
    running: Option<(&wgpu::Buffer, &wgpu::Buffer, DType)>,
    coef: &wgpu::Buffer,
    saved: &wgpu::Buffer,
    p: &BatchNormCoefParams,
) -> Result<()> {
    let stats = running.map(|(_, _, d)| d);
    let key = format!(
        "bn_coef|{dtype:?}|{}|{}|{}|{stats:?}",
        centre.is_some(),
        weight.is_some(),
        bias.is_some()
    );
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[dtype, stats.unwrap_or(dtype)]);
        src.push_str(&shader::input("sums", 1, dtype));
        src.push_str(&shader::output("coef", 2, dtype));
        src.push_str(&shader::output("saved", 3, dtype));
        let next = optional(&mut src, "k", 4, dtype, centre.is_some(), 0.0);
        let next = optional(&mut src, "w", next, dtype, weight.is_some(), 1.0);
        let next = optional(&mut src, "b", next, dtype, bias.is_some(), 0.0);
        let update = match stats {
            Some(d) => {
                src.push_str(&shader::inout("rm", next, d));
                src.push_str(&shader::inout("rv", next + 1, d));
                "    let unbiased = n / (max(n, 2.0) - 1.0);
    store_rm(i, (1.0 - m) * load_rm(i) + m * mean);
    store_rv(i, (1.0 - m) * load_rv(i) + m * unbiased * variance);\n"
            }
            None => "",
        };
        src.push_str(MAIN_1D);
        src.push_str(&format!(
            r#"    let c = params[0];
    if (i >= c) {{ return; }}
    let n = param_f32(1u);
    let m = param_f32(3u);
    // The centre the sums were taken about, 0 where it is not finite (NaN fails the test).
    let k = load_k(params[8] + i);
    let offset = load_sums(params[5] + i) / n;
    let mean = select(0.0, k, abs(k) <= 3.4028235e38) + offset;
    // Clamped at 0, NaN included (as the reference; WGSL's max may keep the NaN).
    let raw_variance = load_sums(params[5] + c + i) / n - offset * offset;
    let variance = select(0.0, raw_variance, raw_variance > 0.0);
{update}    let rstd = 1.0 / sqrt(variance + param_f32(2u));
    let scale = rstd * load_w(params[6] + i);
    store_coef(i, scale);
    store_coef(c + i, load_b(params[7] + i) - mean * scale);
    store_coef(2u * c + i, select(0.0, 1.0, params[4] != 0u));
    store_saved(i, mean);
    store_saved(c + i, rstd);
}}
"#
        ));
        src
    });
    let f = |v: f64| (v as f32).to_bits();
    let params = [
        c as u32,
        f(p.count),
        f(p.eps),
        f(p.momentum),
        p.residual as u32,
        sums.1 as u32,
        offset(weight),
        offset(bias),
        offset(centre),
    ];
    let mut buffers = vec![sums.0, coef, saved];
    buffers.extend(centre.map(|(b, _)| b));
    buffers.extend(weight.map(|(b, _)| b));
    buffers.extend(bias.map(|(b, _)| b));
    if let Some((rm, rv, _)) = running {
        buffers.extend([rm, rv]);
    }
    ctx.dispatch(&pipeline, &params, &buffers, None, grid(c, 256))
}

/// Backward coefficients: `coef` `[k0; k1; rw]` (3·C), `dw` and `db` (C each) from `sums`
/// `[Σg; Σ(x−mean)·g]`, the forward's `saved` `[mean; rstd]` and the optional weight.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_grad_coef(
    ctx: &Context,
    dtype: DType,
    c: usize,
    count: f64,
    sums: Operand<'_>,
    saved: Operand<'_>,
    weight: Option<Operand<'_>>,
    outputs: [&wgpu::Buffer; 3],
) -> Result<()> {
    let key = format!("bn_grad_coef|{dtype:?}|{}", weight.is_some());
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[dtype]);
        src.push_str(&shader::input("sums", 1, dtype));
        src.push_str(&shader::input("saved", 2, dtype));
        src.push_str(&shader::output("coef", 3, dtype));
        src.push_str(&shader::output("dw", 4, dtype));
        src.push_str(&shader::output("db", 5, dtype));
        optional(&mut src, "w", 6, dtype, weight.is_some(), 1.0);
        src.push_str(MAIN_1D);
        src.push_str(
            r#"    let c = params[0];
    if (i >= c) { return; }
    let n = param_f32(1u);
    let mean = load_saved(params[3] + i);
    let rstd = load_saved(params[3] + c + i);
    let sum_g = load_sums(params[2] + i);
    let centred = load_sums(params[2] + c + i);
    let rw = rstd * load_w(params[4] + i);
    let k0 = -(rw * rstd * rstd * centred) / n;
    store_coef(i, k0);
    store_coef(c + i, -(rw * sum_g) / n - mean * k0);
    store_coef(2u * c + i, rw);
    store_dw(i, rstd * centred);
    store_db(i, sum_g);
}
"#,
        );
        src
    });
    let params = [
        c as u32,
        (count as f32).to_bits(),
        sums.1 as u32,
        saved.1 as u32,
        offset(weight),
    ];
    let [coef, dw, db] = outputs;
    let mut buffers = vec![sums.0, saved.0, coef, dw, db];
    buffers.extend(weight.map(|(b, _)| b));
    ctx.dispatch(&pipeline, &params, &buffers, None, grid(c, 256))
}

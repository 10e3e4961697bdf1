//! Elementwise kernels: unary, binary, select, convert/copy-into and fill — one template, an
//! expression and the operands' dtypes make each pipeline.

use redline_tensor::{BinaryOp, DType, Layout, Result, UnaryOp};

use crate::context::{Context, PooledBuffer};
use crate::shader::{self, LAYOUT_WORDS};

/// The f32 expression of a unary op in terms of `a`.
pub(crate) fn unary_expr(op: UnaryOp) -> &'static str {
    match op {
        UnaryOp::Neg => "-a",
        UnaryOp::Exp => "exp(a)",
        UnaryOp::Log => "log(a)",
        UnaryOp::Sqrt => "sqrt(a)",
        UnaryOp::Rsqrt => "inverseSqrt(a)",
        // NaN is not above 0, so it goes to 0 as in the reference (`max` may keep either).
        UnaryOp::Relu => "select(0.0, a, a > 0.0)",
        UnaryOp::Gelu => "0.5 * a * (1.0 + erf(a * 0.70710678))",
        UnaryOp::GeluGrad => {
            "0.5 * (1.0 + erf(a * 0.70710678)) + a * exp(-0.5 * a * a) * 0.39894228"
        }
        UnaryOp::Sigmoid => "1.0 / (1.0 + exp(-a))",
        // (clamp may turn a NaN into either bound)
        UnaryOp::Tanh => "select(tanh(clamp(a, -15.0, 15.0)), a, is_nan(a))",
    }
}

/// The f32 expression of a binary op in terms of `a` and `b`.
pub(crate) fn binary_expr(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "a + b",
        BinaryOp::Sub => "a - b",
        BinaryOp::Mul => "a * b",
        BinaryOp::Div => "a / b",
        BinaryOp::Pow => "pow(a, b)",
        // NaN propagates, as PyTorch's maximum and minimum (WGSL's may return the other).
        BinaryOp::Maximum => "select(select(max(a, b), b, is_nan(b)), a, is_nan(a))",
        BinaryOp::Minimum => "select(select(min(a, b), b, is_nan(b)), a, is_nan(a))",
        BinaryOp::ReluGrad => "select(0.0, b, a > 0.0)",
        BinaryOp::Eq => "select(0.0, 1.0, a == b)",
        // Not `a != b`: an ordered comparison, false where either is NaN.
        BinaryOp::Ne => "select(0.0, 1.0, !(a == b))",
        BinaryOp::Lt => "select(0.0, 1.0, a < b)",
        BinaryOp::Le => "select(0.0, 1.0, a <= b)",
        BinaryOp::Gt => "select(0.0, 1.0, a > b)",
        BinaryOp::Ge => "select(0.0, 1.0, a >= b)",
    }
}

/// erf in f32 (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7): WGSL has none.
const ERF: &str = r#"
fn erf(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.3275911 * z);
    let poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;
    return sign(x) * (1.0 - poly * exp(-z * z));
}
"#;

const NAMES: [&str; 3] = ["a", "b", "c"];

/// An operand: a buffer seen through a layout.
pub(crate) struct Operand<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub layout: &'a Layout,
    pub dtype: DType,
}

/// Where the result goes: a fresh buffer, or part of an existing one (`copy_into`).
pub(crate) enum Target<'a> {
    New,
    Into(&'a wgpu::Buffer),
}

/// Runs `y[out(i)] = expr(a[in0(i)], b[in1(i)], ..)` for every logical index `i` of `out`;
/// `scalar` is readable in `expr` as `s`. Returns the fresh buffer (for `Target::New`).
pub(crate) fn run(
    ctx: &Context,
    expr: &str,
    inputs: &[Operand<'_>],
    out: &Layout,
    out_dtype: DType,
    scalar: f32,
    target: Target<'_>,
) -> Result<Option<PooledBuffer>> {
    let mut dtypes: Vec<DType> = inputs.iter().map(|o| o.dtype).collect();
    dtypes.push(out_dtype);
    let key = format!("ew|{expr}|{dtypes:?}");
    let out_base = 1 + LAYOUT_WORDS * inputs.len();
    let scalar_at = out_base + LAYOUT_WORDS;
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&dtypes);
        src.push_str(ERF);
        let mut loads = String::new();
        for (k, operand) in inputs.iter().enumerate() {
            src.push_str(&shader::input(NAMES[k], k as u32 + 1, operand.dtype));
            loads.push_str(&format!(
                "    let {n} = load_{n}(map_index({base}u, i));\n",
                n = NAMES[k],
                base = 1 + LAYOUT_WORDS * k
            ));
        }
        src.push_str(&shader::output("y", inputs.len() as u32 + 1, out_dtype));
        src.push_str(&format!(
            r#"
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let i = gid.x + gid.y * nw.x * 256u;
    if (i >= params[0]) {{ return; }}
    let s = param_f32({scalar_at}u);
{loads}    store_y(map_index({out_base}u, i), {expr});
}}
"#
        ));
        src
    });
    let mut params = vec![out.numel() as u32];
    for operand in inputs {
        shader::push_layout(&mut params, operand.layout)?;
    }
    shader::push_layout(&mut params, out)?;
    params.push(scalar.to_bits());
    let fresh = match target {
        Target::New => Some(ctx.alloc(shader::storage_bytes(
            out_dtype,
            out.storage_extent().max(out.numel()),
        ))),
        Target::Into(_) => None,
    };
    let y = match (&fresh, &target) {
        (Some(b), _) => b.buffer(),
        (None, Target::Into(b)) => *b,
        (None, Target::New) => unreachable!("a fresh buffer was made"),
    };
    let mut buffers: Vec<&wgpu::Buffer> = inputs.iter().map(|o| o.buffer).collect();
    buffers.push(y);
    let clear = (fresh.is_some() && shader::atomic_output(out_dtype)).then_some(y);
    ctx.dispatch(
        &pipeline,
        &params,
        &buffers,
        clear,
        shader::grid(out.numel(), 256),
    )?;
    Ok(fresh)
}

//! Batched matrix products on the shared tiled GEMM; transposed operands are just strides.

use redline_tensor::{DType, Layout, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::elementwise::Operand;
use crate::kernels::gemm::{self, Gemm, HEADER};
use crate::shader::{self, LAYOUT_WORDS};

const A_BATCH: usize = HEADER;
const B_BATCH: usize = A_BATCH + LAYOUT_WORDS;
const STRIDES: usize = B_BATCH + LAYOUT_WORDS;

pub(crate) fn run(
    ctx: &Context,
    a: &Operand<'_>,
    b: &Operand<'_>,
    out_dtype: DType,
) -> Result<PooledBuffer> {
    let r = a.layout.rank();
    let (m, k, n) = (
        a.layout.shape()[r - 2],
        a.layout.shape()[r - 1],
        b.layout.shape()[r - 1],
    );
    let batch_shape = &a.layout.shape()[..r - 2];
    let batches: usize = batch_shape.iter().product();
    let batch = |l: &Layout| {
        Layout::new(
            batch_shape.to_vec(),
            l.strides()[..r - 2].to_vec(),
            l.offset(),
        )
    };
    let functions = format!(
        r#"
fn a_at(z: u32, row: u32, kk: u32) -> f32 {{
    return load_a(map_index({A_BATCH}u, z) + row * params[{STRIDES}u] + kk * params[{STRIDES}u + 1u]);
}}
fn b_at(z: u32, kk: u32, col: u32) -> f32 {{
    return load_b(map_index({B_BATCH}u, z) + kk * params[{STRIDES}u + 2u] + col * params[{STRIDES}u + 3u]);
}}
fn store_c(z: u32, row: u32, col: u32, v: f32) {{
    store_y((z * params[0] + row) * params[2] + col, v);
}}
"#
    );
    let mut extra = Vec::new();
    shader::push_layout(&mut extra, &batch(a.layout))?;
    shader::push_layout(&mut extra, &batch(b.layout))?;
    let (sa, sb) = (a.layout.strides(), b.layout.strides());
    extra.extend([sa[r - 2], sa[r - 1], sb[r - 2], sb[r - 1]].map(|s| s as u32));
    let spec = Gemm {
        name: "matmul",
        functions: &functions,
        a_dtype: a.dtype,
        b_dtype: b.dtype,
        out_dtype,
        m,
        k,
        n,
        z: batches,
    };
    gemm::run(ctx, &spec, &extra, a.buffer, b.buffer, batches * m * n)
}

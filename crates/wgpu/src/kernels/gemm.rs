//! One tiled GEMM template for every matrix-shaped op: matmul, and convolution forward,
//! backward-data and backward-filter as implicit GEMMs. Each op supplies three small WGSL
//! functions — how to read A[row, k] and B[k, col] and where C[row, col] goes — and the tile loop
//! (TILE×TILE blocks of A and B staged in workgroup memory) is shared. `z` indexes the batch or
//! the convolution group.

use redline_tensor::{DType, Result};

use crate::context::{Context, PooledBuffer};
use crate::shader;

/// Tile edge; 16×16 = 256 threads, the WebGPU default limit per workgroup.
pub(crate) const TILE: u32 = 16;

/// Words at the start of the parameters: m, k, n, z. Op-specific parameters follow.
pub(crate) const HEADER: usize = 4;

/// A GEMM-shaped op.
pub(crate) struct Gemm<'a> {
    /// Names the variant in the pipeline cache (with the dtypes).
    pub name: &'a str,
    /// `fn a_at(z: u32, row: u32, kk: u32) -> f32`, `fn b_at(z: u32, kk: u32, col: u32) -> f32`
    /// and `fn store_c(z: u32, row: u32, col: u32, v: f32)`, reading `params` past [`HEADER`].
    pub functions: &'a str,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub out_dtype: DType,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub z: usize,
}

/// Runs `gemm` with op parameters `extra` into a fresh buffer of `out_len` elements.
pub(crate) fn run(
    ctx: &Context,
    gemm: &Gemm<'_>,
    extra: &[u32],
    a: &wgpu::Buffer,
    b: &wgpu::Buffer,
    out_len: usize,
) -> Result<PooledBuffer> {
    if gemm.z > 65_535 {
        return Err(ctx.fail(format!(
            "{}: {} batches exceed one dispatch",
            gemm.name, gemm.z
        )));
    }
    let key = format!(
        "gemm|{}|{TILE}|{:?}|{:?}|{:?}",
        gemm.name, gemm.a_dtype, gemm.b_dtype, gemm.out_dtype
    );
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[gemm.a_dtype, gemm.b_dtype, gemm.out_dtype]);
        src.push_str(&shader::input("a", 1, gemm.a_dtype));
        src.push_str(&shader::input("b", 2, gemm.b_dtype));
        src.push_str(&shader::output("y", 3, gemm.out_dtype));
        src.push_str(shader::STRIDED4);
        src.push_str(gemm.functions);
        src.push_str(&format!(
            r#"
const T: u32 = {TILE}u;
var<workgroup> ta: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tb: array<array<f32, {TILE}>, {TILE}>;

@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let m = params[0];
    let k = params[1];
    let n = params[2];
    let row = wid.y * T + lid.y;
    let col = wid.x * T + lid.x;
    let z = wid.z;
    var acc = 0.0;
    for (var k0 = 0u; k0 < k; k0 = k0 + T) {{
        let ka = k0 + lid.x;
        var va = 0.0;
        if (row < m && ka < k) {{ va = a_at(z, row, ka); }}
        ta[lid.y][lid.x] = va;
        let kb = k0 + lid.y;
        var vb = 0.0;
        if (kb < k && col < n) {{ vb = b_at(z, kb, col); }}
        tb[lid.y][lid.x] = vb;
        workgroupBarrier();
        for (var kk = 0u; kk < T; kk = kk + 1u) {{
            acc = acc + ta[lid.y][kk] * tb[kk][lid.x];
        }}
        workgroupBarrier();
    }}
    if (row < m && col < n) {{ store_c(z, row, col, acc); }}
}}
"#
        ));
        src
    });
    let mut params = vec![gemm.m as u32, gemm.k as u32, gemm.n as u32, gemm.z as u32];
    params.extend_from_slice(extra);
    let y = ctx.alloc(shader::storage_bytes(gemm.out_dtype, out_len));
    let groups = [
        (gemm.n as u32).div_ceil(TILE).max(1),
        (gemm.m as u32).div_ceil(TILE).max(1),
        gemm.z.max(1) as u32,
    ];
    ctx.dispatch(&pipeline, &params, &[a, b, y.buffer()], None, groups)?;
    Ok(y)
}

//! Batched GEMM tiled through workgroup memory: each workgroup computes a TILE×TILE block of C,
//! staging TILE×TILE blocks of A and B; transposed operands are just strides.

use redline_tensor::{DType, Layout, Result};

use crate::context::{Context, PooledBuffer};
use crate::kernels::elementwise::Operand;
use crate::shader::{self, LAYOUT_WORDS};

/// Tile edge; 16×16 = 256 threads, the WebGPU default limit per workgroup.
const TILE: u32 = 16;

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
    let key = format!("matmul|{TILE}|{:?}|{:?}", a.dtype, b.dtype);
    let a_base = 4;
    let b_base = a_base + LAYOUT_WORDS;
    let strides_at = b_base + LAYOUT_WORDS;
    let pipeline = ctx.pipeline(&key, || {
        let mut src = shader::prelude(&[a.dtype, b.dtype, out_dtype]);
        src.push_str(&shader::input("a", 1, a.dtype));
        src.push_str(&shader::input("b", 2, b.dtype));
        src.push_str(&shader::output("y", 3, out_dtype));
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
    let abase = map_index({a_base}u, wid.z);
    let bbase = map_index({b_base}u, wid.z);
    let sam = params[{strides_at}u];
    let sak = params[{strides_at}u + 1u];
    let sbk = params[{strides_at}u + 2u];
    let sbn = params[{strides_at}u + 3u];
    var acc = 0.0;
    for (var k0 = 0u; k0 < k; k0 = k0 + T) {{
        let ka = k0 + lid.x;
        var va = 0.0;
        if (row < m && ka < k) {{ va = load_a(abase + row * sam + ka * sak); }}
        ta[lid.y][lid.x] = va;
        let kb = k0 + lid.y;
        var vb = 0.0;
        if (kb < k && col < n) {{ vb = load_b(bbase + kb * sbk + col * sbn); }}
        tb[lid.y][lid.x] = vb;
        workgroupBarrier();
        for (var kk = 0u; kk < T; kk = kk + 1u) {{
            acc = acc + ta[lid.y][kk] * tb[kk][lid.x];
        }}
        workgroupBarrier();
    }}
    if (row < m && col < n) {{ store_y((wid.z * m + row) * n + col, acc); }}
}}
"#
        ));
        src
    });
    let mut params = vec![m as u32, k as u32, n as u32, batches as u32];
    shader::push_layout(&mut params, &batch(a.layout))?;
    shader::push_layout(&mut params, &batch(b.layout))?;
    let (sa, sb) = (a.layout.strides(), b.layout.strides());
    params.extend([sa[r - 2], sa[r - 1], sb[r - 2], sb[r - 1]].map(|s| s as u32));
    let y = ctx.alloc(shader::storage_bytes(out_dtype, batches * m * n));
    let groups = [
        (n as u32).div_ceil(TILE).max(1),
        (m as u32).div_ceil(TILE).max(1),
        batches.max(1) as u32,
    ];
    ctx.dispatch(
        &pipeline,
        &params,
        &[a.buffer, b.buffer, y.buffer()],
        None,
        groups,
    )?;
    Ok(y)
}

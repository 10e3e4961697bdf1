//! WGSL generation: one template per kernel, specialised by dtype (how a binding loads and
//! stores elements) and tile sizes — never a copy per variant.
//!
//! Device storage is the host's little-endian layout: f32, f16 and i32 natively; u8 packed four
//! to a u32 word (outputs are written with `atomicOr` into a zero-cleared buffer); i64 as two u32
//! words (lo, hi; values are indices below 2^31). Every kernel computes in f32.

use redline_tensor::{DType, Layout, Result, TensorError};

/// Words one layout occupies in the parameters: rank, offset, 6 sizes, 6 strides.
pub(crate) const LAYOUT_WORDS: usize = 14;
/// The highest rank a kernel indexes directly.
pub(crate) const MAX_RANK: usize = 6;

/// Appends `layout` to `params` (see [`LAYOUT_WORDS`]).
pub(crate) fn push_layout(params: &mut Vec<u32>, layout: &Layout) -> Result<()> {
    if layout.rank() > MAX_RANK {
        return Err(TensorError::Shape(format!(
            "the wgpu backend indexes at most {MAX_RANK} axes, got shape {:?}",
            layout.shape()
        )));
    }
    let word = |v: usize| {
        u32::try_from(v).map_err(|_| {
            TensorError::Shape(format!(
                "shape {:?} is too large for 32-bit indexing",
                layout.shape()
            ))
        })
    };
    params.push(layout.rank() as u32);
    params.push(word(layout.offset())?);
    for d in 0..MAX_RANK {
        params.push(layout.shape().get(d).map_or(Ok(1), |&n| word(n))?);
    }
    for d in 0..MAX_RANK {
        params.push(layout.strides().get(d).map_or(Ok(0), |&n| word(n))?);
    }
    Ok(())
}

/// Bytes a storage of `len` elements of `dtype` takes on the device.
pub(crate) fn storage_bytes(dtype: DType, len: usize) -> u64 {
    match dtype {
        DType::U8 => len.div_ceil(4) as u64 * 4,
        d => (len * d.size()) as u64,
    }
}

/// Whether the backend can store `dtype` at all (`f16` only with SHADER_F16).
pub(crate) fn storable(dtype: DType, f16: bool) -> bool {
    match dtype {
        DType::F32 | DType::I32 | DType::U8 | DType::I64 => true,
        DType::F16 => f16,
        DType::F64 | DType::BF16 => false,
    }
}

/// Whether outputs of `dtype` are written with atomics (and need a cleared buffer).
pub(crate) fn atomic_output(dtype: DType) -> bool {
    dtype == DType::U8
}

/// The shared preamble: `enable f16` when needed, the parameters, and strided indexing.
pub(crate) fn prelude(dtypes: &[DType]) -> String {
    let mut s = String::new();
    if dtypes.contains(&DType::F16) {
        s.push_str("enable f16;\n");
    }
    s.push_str(
        r#"
@group(0) @binding(0) var<storage, read> params: array<u32>;

// Storage index of logical element `i` of the layout stored at params[base..].
fn map_index(base: u32, i: u32) -> u32 {
    let rank = params[base];
    var at = params[base + 1u];
    var rest = i;
    for (var d = i32(rank) - 1; d >= 0; d = d - 1) {
        let n = params[base + 2u + u32(d)];
        at = at + (rest % n) * params[base + 8u + u32(d)];
        rest = rest / n;
    }
    return at;
}

fn param_f32(at: u32) -> f32 {
    return bitcast<f32>(params[at]);
}

// NaN by its bits: WGSL lets a compiler assume no NaN in comparisons and min/max.
fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// -inf, which WGSL has no literal for (softmax and max start there, as the reference).
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

// Floats into integers as Rust's `as` (the reference's): toward zero, saturating, NaN to 0.
// WGSL leaves NaN indeterminate and saturates i32 at 2^31 - 128 (the last f32 below 2^31).
fn to_u8(v: f32) -> u32 {
    return u32(select(clamp(v, 0.0, 255.0), 0.0, is_nan(v)));
}
fn to_i32(v: f32) -> i32 {
    if (is_nan(v)) { return 0; }
    if (v >= 2147483648.0) { return 2147483647; }
    if (v <= -2147483648.0) { return bitcast<i32>(0x80000000u); }
    return i32(v);
}

// An i64 as its (low, high) words: the magnitude's integer part split at 2^32 (exact: below
// 2^63 an f32's remainder modulo 2^32 has at most 24 significant bits), then negated in two's
// complement where v is negative.
fn to_i64(v: f32) -> vec2<u32> {
    if (is_nan(v)) { return vec2<u32>(0u, 0u); }
    if (v >= 9223372036854775808.0) { return vec2<u32>(0xffffffffu, 0x7fffffffu); }
    if (v <= -9223372036854775808.0) { return vec2<u32>(0u, 0x80000000u); }
    let m = trunc(abs(v));
    let high = floor(m / 4294967296.0);
    let w = vec2<u32>(u32(m - high * 4294967296.0), u32(high));
    if (v >= 0.0) { return w; }
    let low = ~w.x + 1u;
    return vec2<u32>(low, ~w.y + select(0u, 1u, low == 0u));
}

// Back into f32 with one rounding, as Rust's `as`: the magnitude's words shifted right until
// they fit 32 bits, the bits shifted out kept as a sticky last bit (below the 24 the f32
// keeps), then scaled back by 2^k.
fn from_i64(low: u32, high: u32) -> f32 {
    let negative = (high & 0x80000000u) != 0u;
    var lo = low;
    var hi = high;
    if (negative) {
        lo = ~low + 1u;
        hi = ~high + select(0u, 1u, lo == 0u);
    }
    var v = f32(lo);
    if (hi != 0u) {
        let k = 32u - countLeadingZeros(hi);
        var top = hi;
        var rest = lo;
        if (k < 32u) {
            top = (hi << (32u - k)) | (lo >> k);
            rest = lo << (32u - k);
        }
        v = ldexp(f32(top | select(0u, 1u, rest != 0u)), i32(k));
    }
    return select(v, -v, negative);
}
"#,
    );
    s
}

/// A read-only binding `name` at `binding` with `fn load_<name>(at: u32) -> f32`.
pub(crate) fn input(name: &str, binding: u32, dtype: DType) -> String {
    let (ty, load) = match dtype {
        DType::F32 => ("f32", format!("return {name}[at];")),
        DType::F16 => ("f16", format!("return f32({name}[at]);")),
        DType::I32 => ("i32", format!("return f32({name}[at]);")),
        DType::U8 => (
            "u32",
            format!("return f32(({name}[at / 4u] >> ((at % 4u) * 8u)) & 0xffu);"),
        ),
        DType::I64 | DType::F64 | DType::BF16 => (
            "u32",
            format!("return from_i64({name}[2u * at], {name}[2u * at + 1u]);"),
        ),
    };
    format!(
        "@group(0) @binding({binding}) var<storage, read> {name}: array<{ty}>;\nfn load_{name}(at: u32) -> f32 {{ {load} }}\n"
    )
}

/// A writable binding `name` at `binding` with `fn store_<name>(at: u32, v: f32)` (so no
/// binding may be called `v`: the parameter would shadow it).
pub(crate) fn output(name: &str, binding: u32, dtype: DType) -> String {
    let (ty, store) = match dtype {
        DType::F32 => ("f32".to_string(), format!("{name}[at] = v;")),
        DType::F16 => ("f16".to_string(), format!("{name}[at] = f16(v);")),
        DType::I32 => ("i32".to_string(), format!("{name}[at] = to_i32(v);")),
        DType::U8 => (
            "atomic<u32>".to_string(),
            format!("atomicOr(&{name}[at / 4u], to_u8(v) << ((at % 4u) * 8u));"),
        ),
        DType::I64 | DType::F64 | DType::BF16 => (
            "u32".to_string(),
            format!("let w = to_i64(v); {name}[2u * at] = w.x; {name}[2u * at + 1u] = w.y;"),
        ),
    };
    format!(
        "@group(0) @binding({binding}) var<storage, read_write> {name}: array<{ty}>;\nfn store_{name}(at: u32, v: f32) {{ {store} }}\n"
    )
}

/// Workgroups for `n` invocations of a 1-d kernel with `size` threads per group, spread over
/// x and y so no dimension exceeds 65535.
pub(crate) fn grid(n: usize, size: usize) -> [u32; 3] {
    let groups = n.div_ceil(size).max(1);
    let x = groups.min(65_535);
    [x as u32, groups.div_ceil(x) as u32, 1]
}

/// A read-write binding `name` with both `load_<name>` and `store_<name>` (in-place ops; not u8).
pub(crate) fn inout(name: &str, binding: u32, dtype: DType) -> String {
    let (ty, load, store) = match dtype {
        DType::F16 => (
            "f16",
            format!("return f32({name}[at]);"),
            format!("{name}[at] = f16(v);"),
        ),
        DType::I32 => (
            "i32",
            format!("return f32({name}[at]);"),
            format!("{name}[at] = to_i32(v);"),
        ),
        _ => (
            "f32",
            format!("return {name}[at];"),
            format!("{name}[at] = v;"),
        ),
    };
    format!(
        "@group(0) @binding({binding}) var<storage, read_write> {name}: array<{ty}>;\nfn load_{name}(at: u32) -> f32 {{ {load} }}\nfn store_{name}(at: u32, v: f32) {{ {store} }}\n"
    )
}

/// `strided4(base, i0, i1, i2, i3)`: the storage index of a 4-d element of the layout at
/// `params[base..]`.
pub(crate) const STRIDED4: &str = r#"
fn strided4(base: u32, i0: u32, i1: u32, i2: u32, i3: u32) -> u32 {
    return params[base + 1u] + i0 * params[base + 8u] + i1 * params[base + 9u]
        + i2 * params[base + 10u] + i3 * params[base + 11u];
}
"#;

/// The linear index of a 1-d kernel dispatched with [`grid`] at 256 threads per group.
pub(crate) const MAIN_1D: &str = "@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {\n    let i = gid.x + gid.y * nw.x * 256u;\n";

/// WGSL: the workgroup array `sh` of `threads` f32 (a power of two) and two tree reductions
/// over it. Every invocation puts its value in `sh[t]` and calls `tree_sum(t)` or
/// `tree_max(t)`; the result is in `sh[0]` (read it before `sh` is written again, after a
/// barrier). The order of combination depends only on `threads`: the same bits every run.
pub fn workgroup_trees(threads: u32) -> String {
    let tree = |name: &str, combine: &str| {
        format!(
            r#"fn {name}(t: u32) {{
    workgroupBarrier();
    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (t < s) {{ sh[t] = {combine}; }}
        workgroupBarrier();
    }}
}}
"#,
            half = threads / 2
        )
    };
    format!(
        "var<workgroup> sh: array<f32, {threads}>;\n{}{}",
        tree("tree_sum", "sh[t] + sh[t + s]"),
        tree("tree_max", "max(sh[t], sh[t + s])")
    )
}

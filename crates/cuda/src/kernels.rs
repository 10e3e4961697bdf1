//! The kernel sources (embedded, so a binary carries them) and every instantiation the launchers
//! use, by family. An instantiation is named by its C++ name expression, e.g.
//! `binary<__half, BinaryOp::Mul>`: NVRTC resolves the same text to the lowered symbol and the
//! host emulator's registry takes its address, so both run exactly what a launcher asks for.

use redline_tensor::{BinaryOp, DType, NnOp, Op, ReduceOp, UnaryOp};

/// The GPU architectures every kernel is compiled for: A100, RTX 3090, RTX 4090, H100/H200 and
/// the RTX 5090 (the target).
pub const ARCHITECTURES: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"];

/// A source file of `kernels/`.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

/// Headers every family may include (by these names).
pub const HEADERS: &[Source] = &[
    Source {
        name: "common.cuh",
        text: include_str!("../kernels/common.cuh"),
    },
    Source {
        name: "block.cuh",
        text: include_str!("../kernels/block.cuh"),
    },
];

/// The host emulation header and its stand-ins for NVIDIA's headers (host builds only).
pub const EMULATION: &[Source] = &[
    Source {
        name: "emulate.h",
        text: include_str!("../kernels/emulate.h"),
    },
    Source {
        name: "host/cuda_fp16.h",
        text: include_str!("../kernels/host/cuda_fp16.h"),
    },
    Source {
        name: "host/cuda_bf16.h",
        text: include_str!("../kernels/host/cuda_bf16.h"),
    },
];

/// One `.cu` file and the instantiations launched from it.
#[derive(Debug, Clone)]
pub struct Family {
    pub source: Source,
    pub instantiations: Vec<String>,
    /// On a training step's path: a register spill here fails the NVRTC suite.
    pub hot: bool,
}

/// The C++ type a dtype is stored as in the kernels.
pub fn ctype(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "double",
        DType::F32 => "float",
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        DType::U8 => "u8",
        DType::I32 => "i32",
        DType::I64 => "i64",
    }
}

pub fn unary(dtype: DType, op: UnaryOp) -> String {
    format!("unary<{}, UnaryOp::{op:?}>", ctype(dtype))
}

pub fn binary(dtype: DType, op: BinaryOp) -> String {
    format!("binary<{}, BinaryOp::{op:?}>", ctype(dtype))
}

/// The dtypes unary and binary ops also have `_packed` kernels for (16-byte packs): the
/// training step's activations and gradients.
pub const PACKED_ELEMENTWISE: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// `unary_packed`, where `dtype` has it.
pub fn unary_packed(dtype: DType, op: UnaryOp) -> Option<String> {
    PACKED_ELEMENTWISE
        .contains(&dtype)
        .then(|| format!("unary_packed<{}, UnaryOp::{op:?}>", ctype(dtype)))
}

/// `binary_packed`, where `dtype` has it and `op` writes its operands' dtype (comparisons write u8).
pub fn binary_packed(dtype: DType, op: BinaryOp) -> Option<String> {
    (PACKED_ELEMENTWISE.contains(&dtype) && !op.is_comparison())
        .then(|| format!("binary_packed<{}, BinaryOp::{op:?}>", ctype(dtype)))
}

pub fn select(dtype: DType) -> String {
    format!("select<{}>", ctype(dtype))
}

pub fn convert(from: DType, to: DType) -> String {
    format!("convert<{}, {}>", ctype(from), ctype(to))
}

pub fn fill(dtype: DType) -> String {
    format!("fill<{}>", ctype(dtype))
}

/// `kernel` is `reduce` (a block per output) or `reduce_columns` (a thread per output).
pub fn reduce(kernel: &str, dtype: DType, op: ReduceOp) -> String {
    format!("{kernel}<{}, ReduceOp::{op:?}>", ctype(dtype))
}

pub fn softmax(dtype: DType, log: bool) -> String {
    format!("softmax<{}, {log}>", ctype(dtype))
}

/// The fused cross-entropy's two kernels: `cross_entropy_rows`, `cross_entropy_total`.
pub fn cross_entropy(kernel: &str, dtype: DType) -> String {
    format!("{kernel}<{}>", ctype(dtype))
}

pub fn gather(dtype: DType) -> String {
    format!("gather<{}>", ctype(dtype))
}

pub fn scatter_add(dtype: DType) -> String {
    format!("scatter_add<{}>", ctype(dtype))
}

pub fn random_uniform(dtype: DType) -> String {
    format!("random_uniform<{}>", ctype(dtype))
}

pub fn normalize_input(dtype: DType) -> String {
    format!("normalize_input<{}>", ctype(dtype))
}

pub fn normalize_input_packed(dtype: DType) -> String {
    format!("normalize_input_packed<{}>", ctype(dtype))
}

/// Batch norm's per-channel sums: `batch_norm_stats` (any layout, a block per channel),
/// `batch_norm_stats_rows` or `batch_norm_stats_rows_packed` (dense channels-last, rows ×
/// channels blocks, a channel or a 16-byte pack a thread).
pub fn batch_norm_stats(kernel: &str, dtype: DType, with_y: bool, gate: bool) -> String {
    format!("{kernel}<{}, {with_y}, {gate}>", ctype(dtype))
}

/// Adds `batch_norm_stats_rows`' partials, in statistics dtype `stats`.
pub fn batch_norm_stats_combine(stats: DType) -> String {
    format!("batch_norm_stats_combine<{}>", ctype(stats))
}

/// Batch norm's per-channel coefficients, forward or backward, in statistics dtype `stats`:
/// from the sums, or (`partials`) from `batch_norm_stats_rows`' partials, combined in the same
/// launch.
pub fn batch_norm_coef(stats: DType, backward: bool, partials: bool) -> String {
    let name = match (backward, partials) {
        (false, false) => "batch_norm_coef",
        (true, false) => "batch_norm_grad_coef",
        (false, true) => "batch_norm_combine_coef",
        (true, true) => "batch_norm_combine_grad_coef",
    };
    format!("{name}<{}>", ctype(stats))
}

/// Batch norm's affine: `batch_norm_apply` (any layouts, logical order),
/// `batch_norm_apply_packed` (one dense layout, memory order, 16 bytes a step) or
/// `batch_norm_apply_rows_packed` (dense channels-last, a 16-byte pack of channels a thread).
pub fn batch_norm_apply(
    kernel: &str,
    dtype: DType,
    with_y: bool,
    relu: bool,
    gate: bool,
) -> String {
    format!("{kernel}<{}, {with_y}, {relu}, {gate}>", ctype(dtype))
}

/// Pooling kernels: `max_pool2d`, `max_pool2d_grad`, `avg_pool2d`, `avg_pool2d_grad`.
pub fn pool(kernel: &str, dtype: DType) -> String {
    format!("{kernel}<{}>", ctype(dtype))
}

/// The pooling kernels' names: the four ops' (any layout), then max pooling's packed
/// channels-last pair.
pub const POOL_KERNELS: [&str; 6] = [
    "max_pool2d",
    "max_pool2d_grad",
    "avg_pool2d",
    "avg_pool2d_grad",
    "max_pool2d_packed",
    "max_pool2d_grad_packed",
];

/// Optimizer kernels templated on the parameters' dtype: `sgd`, `adamw`, `unscale_check`.
pub fn optim(kernel: &str, dtype: DType) -> String {
    format!("{kernel}<{}>", ctype(dtype))
}

/// The code of `dtype` in `kernels/optim.cu` (`DTypeCode`: declaration order).
pub fn dtype_code(dtype: DType) -> i32 {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as i32
}

pub fn matmul(dtype: DType) -> String {
    format!("matmul<{}>", ctype(dtype))
}

/// Convolution kernels: `conv2d`, `conv2d_input_grad`, `conv2d_weight_grad`, and the stem's
/// `copy_channels`.
pub fn conv(kernel: &str, dtype: DType) -> String {
    format!("{kernel}<{}>", ctype(dtype))
}

/// The convolution kernels' names (also the ops' names).
pub const CONV_KERNELS: [&str; 3] = ["conv2d", "conv2d_input_grad", "conv2d_weight_grad"];

fn family(name: &'static str, text: &'static str, instantiations: Vec<String>) -> Family {
    Family {
        source: Source { name, text },
        instantiations,
        hot: true,
    }
}

/// The family that holds instantiation `kernel`, looked up in an index built once: every
/// launch asks, and building the list of families names some five hundred kernels.
pub fn family_of(kernel: &str) -> Option<&'static Family> {
    type Index = (Vec<Family>, std::collections::HashMap<String, usize>);
    static INDEX: std::sync::OnceLock<Index> = std::sync::OnceLock::new();
    let (families, by_kernel) = INDEX.get_or_init(|| {
        let families = families();
        let by_kernel = (families.iter().enumerate())
            .flat_map(|(i, f)| f.instantiations.iter().map(move |k| (k.clone(), i)))
            .collect();
        (families, by_kernel)
    });
    by_kernel.get(kernel).map(|&i| &families[i])
}

/// Every family with every instantiation the backend's declared matrix can launch.
pub fn families() -> Vec<Family> {
    let floats = [DType::F64, DType::F32, DType::F16, DType::BF16];
    let mut elementwise = Vec::new();
    for &d in &floats {
        elementwise.extend(UnaryOp::ALL.iter().map(|&op| unary(d, op)));
        elementwise.extend(UnaryOp::ALL.iter().filter_map(|&op| unary_packed(d, op)));
    }
    for d in DType::ALL {
        let ops = BinaryOp::ALL
            .iter()
            .filter(|&&op| crate::matrix::binary(op, d));
        elementwise.extend(ops.clone().map(|&op| binary(d, op)));
        elementwise.extend(ops.filter_map(|&op| binary_packed(d, op)));
        elementwise.push(select(d));
        elementwise.push(fill(d));
        elementwise.extend(DType::ALL.into_iter().map(|to| convert(d, to)));
    }
    let mut reductions = Vec::new();
    for d in DType::ALL {
        let ops = ReduceOp::ALL
            .iter()
            .filter(|&&op| crate::matrix::reduce(op, d));
        for kernel in ["reduce", "reduce_columns"] {
            reductions.extend(ops.clone().map(|&op| reduce(kernel, d, op)));
        }
    }
    let floats_of = |f: fn(DType) -> String| floats.iter().map(|&d| f(d)).collect::<Vec<_>>();
    let mut softmaxes = Vec::new();
    for &d in &floats {
        softmaxes.extend([softmax(d, false), softmax(d, true)]);
        softmaxes
            .extend(["cross_entropy_rows", "cross_entropy_total"].map(|k| cross_entropy(k, d)));
    }
    let mut indexing: Vec<String> = DType::ALL.into_iter().map(gather).collect();
    indexing.extend(
        DType::ALL
            .into_iter()
            .filter(|&d| crate::matrix::supports(Op::Nn(NnOp::ScatterAdd), d))
            .map(scatter_add),
    );
    let mut norms = Vec::new();
    for &d in &floats {
        for (with_y, gate) in [(false, false), (true, false), (true, true)] {
            for kernel in [
                "batch_norm_stats",
                "batch_norm_stats_rows",
                "batch_norm_stats_rows_packed",
            ] {
                norms.push(batch_norm_stats(kernel, d, with_y, gate));
            }
            for relu in [false, true] {
                for kernel in [
                    "batch_norm_apply",
                    "batch_norm_apply_packed",
                    "batch_norm_apply_rows_packed",
                ] {
                    norms.push(batch_norm_apply(kernel, d, with_y, relu, gate));
                }
            }
        }
    }
    for stats in [DType::F32, DType::F64] {
        for partials in [false, true] {
            norms.extend([false, true].map(|backward| batch_norm_coef(stats, backward, partials)));
        }
        norms.push(batch_norm_stats_combine(stats));
    }
    let pools: Vec<String> = floats
        .iter()
        .flat_map(|&d| POOL_KERNELS.iter().map(move |k| pool(k, d)))
        .collect();
    let mut optimizers: Vec<String> = floats
        .iter()
        .flat_map(|&d| ["sgd", "adamw", "unscale_check"].map(|k| optim(k, d)))
        .collect();
    optimizers.extend(floats.iter().map(|&d| optim("sum_squares_partial", d)));
    optimizers.extend(["sum_partials<float>", "sum_partials<double>"].map(String::from));
    optimizers.extend(["count_step".to_string(), "scaler_update".to_string()]);
    let convs: Vec<String> = floats
        .iter()
        .flat_map(|&d| {
            CONV_KERNELS
                .iter()
                .chain(["copy_channels"].iter())
                .map(move |k| conv(k, d))
        })
        .collect();
    vec![
        family(
            "elementwise.cu",
            include_str!("../kernels/elementwise.cu"),
            elementwise,
        ),
        family(
            "reduce.cu",
            include_str!("../kernels/reduce.cu"),
            reductions,
        ),
        family(
            "softmax.cu",
            include_str!("../kernels/softmax.cu"),
            softmaxes,
        ),
        family("index.cu", include_str!("../kernels/index.cu"), indexing),
        family("random.cu", include_str!("../kernels/random.cu"), {
            let mut kernels = floats_of(random_uniform);
            kernels.push("advance".into());
            kernels
        }),
        family(
            "input.cu",
            include_str!("../kernels/input.cu"),
            [
                floats_of(normalize_input),
                floats_of(normalize_input_packed),
            ]
            .concat(),
        ),
        family("norm.cu", include_str!("../kernels/norm.cu"), norms),
        family("pool.cu", include_str!("../kernels/pool.cu"), pools),
        family("optim.cu", include_str!("../kernels/optim.cu"), optimizers),
        family(
            "matmul.cu",
            include_str!("../kernels/matmul.cu"),
            floats_of(matmul),
        ),
        family("conv.cu", include_str!("../kernels/conv.cu"), convs),
    ]
}

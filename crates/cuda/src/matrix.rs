//! The declared (op, dtype) matrix: what this backend runs today. The front end refuses every
//! other pair with `TensorError::Unsupported` before a launcher is reached, and the conformance
//! summary prints the matrix, so what is missing is visible rather than silently slow.
//!
//! Declared: every op on the pairs the host backends declare. Matmul and the convolutions have
//! kernels of our own (a tiled GEMM, direct convolutions) for every declared pair — the host
//! emulator runs them — and on a GPU go through cuBLASLt and cuDNN for f32/f16/bf16 where those
//! take the layouts.

use redline_tensor::{BinaryOp, DType, NnOp, Op, OtherOp, ReduceOp};

pub fn supports(op: Op, dtype: DType) -> bool {
    match op {
        Op::Unary(_) => dtype.is_float(),
        Op::Binary(b) => binary(b, dtype),
        Op::Reduce(r) => reduce(r, dtype),
        Op::Other(o) => o != OtherOp::Matmul || dtype.is_float(),
        Op::Nn(n) => match n {
            NnOp::Softmax
            | NnOp::LogSoftmax
            | NnOp::CrossEntropy
            | NnOp::RandomUniform
            | NnOp::NormalizeInput
            | NnOp::BatchNormStats
            | NnOp::BatchNormApply
            | NnOp::BatchNormCoef
            | NnOp::BatchNormGradCoef
            | NnOp::BatchNormStatsCoef
            | NnOp::BatchNormGradStatsCoef
            | NnOp::MaxPool2d
            | NnOp::MaxPool2dGrad
            | NnOp::AvgPool2d
            | NnOp::AvgPool2dGrad
            | NnOp::Conv2d
            | NnOp::Conv2dInputGrad
            | NnOp::Conv2dWeightGrad => dtype.is_float(),
            NnOp::Gather => true,
            NnOp::ScatterAdd => dtype != DType::U8,
        },
        Op::Optim(_) => dtype.is_float(),
    }
}

/// Integers take exact arithmetic and comparisons; division and powers need floats.
pub fn binary(op: BinaryOp, dtype: DType) -> bool {
    dtype.is_float() || !matches!(op, BinaryOp::Div | BinaryOp::Pow)
}

/// A u8 sum would overflow (PyTorch promotes it to i64): cast first.
pub fn reduce(op: ReduceOp, dtype: DType) -> bool {
    !(op == ReduceOp::Sum && dtype == DType::U8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declares_exactly_what_the_host_backends_declare() {
        for op in Op::all() {
            for d in DType::ALL {
                if supports(op, d) {
                    assert!(
                        redline_tensor::reference::host_matrix(op, d),
                        "{op}/{d} declared but the reference cannot check it"
                    );
                } else if matches!(
                    op,
                    Op::Unary(_) | Op::Binary(_) | Op::Reduce(_) | Op::Other(_)
                ) && op != Op::Other(OtherOp::Matmul)
                {
                    assert!(!redline_tensor::reference::host_matrix(op, d), "{op}/{d}");
                }
            }
        }
    }
}

//! `--precision fp32|fp16|bf16`: what autocast runs convolutions and matmuls in.

use std::fmt;
use std::str::FromStr;

use redline_tensor::DType;

use crate::TrainError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    /// Autocast to f16 with a GradScaler (f16's range needs loss scaling).
    Fp16,
    /// Autocast to bf16; no scaler (bf16 has f32's range), as in PyTorch recipes.
    Bf16,
}

impl Precision {
    /// The autocast dtype, or None for plain f32.
    pub fn autocast(self) -> Option<DType> {
        match self {
            Precision::Fp32 => None,
            Precision::Fp16 => Some(DType::F16),
            Precision::Bf16 => Some(DType::BF16),
        }
    }

    pub fn needs_scaler(self) -> bool {
        self == Precision::Fp16
    }
}

impl FromStr for Precision {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, TrainError> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "fp16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            other => Err(TrainError::Config(format!(
                "precision {other:?}: use fp32, fp16 or bf16"
            ))),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        })
    }
}

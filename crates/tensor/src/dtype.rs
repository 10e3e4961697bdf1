//! Element types.

use std::fmt;

use half::{bf16, f16};

/// The element types a tensor can hold (DESIGN.md, contract 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    U8,
    I32,
    I64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 7] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    /// The smallest positive normal value of this float dtype (f16's 2^-14; bf16's is f32's
    /// 2^-126); None for integer dtypes.
    pub fn smallest_normal(self) -> Option<f64> {
        match self {
            DType::F64 => Some(f64::MIN_POSITIVE),
            DType::F32 | DType::BF16 => Some(f32::MIN_POSITIVE as f64),
            DType::F16 => Some(f16::MIN_POSITIVE.to_f64()),
            DType::U8 | DType::I32 | DType::I64 => None,
        }
    }

    /// Whether `v` is subnormal in this float dtype: non-zero and below its smallest normal
    /// magnitude. False for integer dtypes.
    pub fn is_subnormal(self, v: f64) -> bool {
        self.smallest_normal()
            .is_some_and(|smallest| v != 0.0 && v.abs() < smallest)
    }

    /// Rounds an f64 to the nearest value this dtype can hold (integers truncate toward zero and
    /// saturate, as `as` casts do; NaN becomes 0 for integers).
    pub fn round(self, v: f64) -> f64 {
        match self {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => f16::from_f64(v).to_f64(),
            DType::BF16 => bf16::from_f64(v).to_f64(),
            DType::U8 => v as u8 as f64,
            DType::I32 => v as i32 as f64,
            DType::I64 => v as i64 as f64,
        }
    }

    /// Decodes element `i` of little-endian `bytes` of this dtype.
    pub fn read(self, bytes: &[u8], i: usize) -> f64 {
        let at = i * self.size();
        let b = &bytes[at..at + self.size()];
        match self {
            DType::F64 => f64::from_le_bytes(b.try_into().unwrap_or_default()),
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
            DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::U8 => b[0] as f64,
            DType::I32 => i32::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
            DType::I64 => i64::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
        }
    }

    /// Encodes `v` (rounded to this dtype) as element `i` of little-endian `bytes`.
    pub fn write(self, bytes: &mut [u8], i: usize, v: f64) {
        let at = i * self.size();
        let out = &mut bytes[at..at + self.size()];
        match self {
            DType::F64 => out.copy_from_slice(&v.to_le_bytes()),
            DType::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F16 => out.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::U8 => out[0] = v as u8,
            DType::I32 => out.copy_from_slice(&(v as i32).to_le_bytes()),
            DType::I64 => out.copy_from_slice(&(v as i64).to_le_bytes()),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        })
    }
}

/// A Rust type that is a tensor element.
pub trait Element: Copy + Send + Sync + fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, |$v:ident| $from:expr, |$s:ident| $to:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_f64(self) -> f64 {
                let $s = self;
                $to
            }
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f64, DType::F64, |v| v, |s| s);
element!(f32, DType::F32, |v| v as f32, |s| s as f64);
element!(f16, DType::F16, |v| f16::from_f64(v), |s| s.to_f64());
element!(bf16, DType::BF16, |v| bf16::from_f64(v), |s| s.to_f64());
element!(u8, DType::U8, |v| v as u8, |s| s as f64);
element!(i32, DType::I32, |v| v as i32, |s| s as f64);
element!(i64, DType::I64, |v| v as i64, |s| s as f64);

/// Little-endian bytes of a slice of elements.
pub fn to_bytes<T: Element>(values: &[T]) -> Vec<u8> {
    let mut bytes = vec![0u8; values.len() * T::DTYPE.size()];
    for (i, v) in values.iter().enumerate() {
        T::DTYPE.write(&mut bytes, i, v.to_f64());
    }
    bytes
}

/// Elements decoded from little-endian bytes of `dtype`, converted to `T`.
pub fn from_bytes<T: Element>(bytes: &[u8], dtype: DType) -> Vec<T> {
    (0..bytes.len() / dtype.size())
        .map(|i| T::from_f64(dtype.read(bytes, i)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnormals_are_below_each_float_dtypes_smallest_normal() {
        assert!(DType::F16.is_subnormal(3e-5) && !DType::F16.is_subnormal(6.2e-5));
        assert!(!DType::F32.is_subnormal(3e-5) && DType::F32.is_subnormal(-1e-40));
        assert!(DType::BF16.is_subnormal(1e-39) && !DType::BF16.is_subnormal(2e-38));
        assert!(DType::F64.is_subnormal(1e-310) && !DType::F64.is_subnormal(1e-300));
        assert!(!DType::F32.is_subnormal(0.0) && !DType::F32.is_subnormal(-0.0));
        assert!(!DType::I32.is_subnormal(1e-40));
    }

    #[test]
    fn bytes_round_trip_every_dtype() {
        for d in DType::ALL {
            let mut bytes = vec![0u8; 3 * d.size()];
            for (i, v) in [1.0, -2.5, 100.0].into_iter().enumerate() {
                d.write(&mut bytes, i, v);
                assert_eq!(d.read(&bytes, i), d.round(v), "{d}");
            }
        }
        assert_eq!(DType::F16.round(1.0 + 1e-4), 1.0);
        assert_eq!(DType::U8.round(-3.0), 0.0);
        assert_eq!(
            from_bytes::<f32>(&to_bytes(&[1.5f32, -2.0]), DType::F32),
            [1.5, -2.0]
        );
    }
}

//! Host storage: one typed vector per storage, and the two compute types every kernel runs in.
//!
//! Storages keep their own element type (f16 stays 2 bytes); kernels compute in [`Real`]: f64 for
//! f64 and the integer types (exact, as the reference), f32 for f32, f16 and bf16 (PyTorch's CPU
//! policy for half types). A storage whose type *is* the compute type is read in place.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::{bf16, f16};
use redline_tensor::DType;

use crate::parallel;

/// A storage's elements.
pub(crate) enum Data {
    F64(Vec<f64>),
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U8(Vec<u8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

/// Runs `$body` with `$v` bound to the typed vector inside `$data` (any variant).
macro_rules! with_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::buffer::Data::F64($v) => $body,
            $crate::buffer::Data::F32($v) => $body,
            $crate::buffer::Data::F16($v) => $body,
            $crate::buffer::Data::BF16($v) => $body,
            $crate::buffer::Data::U8($v) => $body,
            $crate::buffer::Data::I32($v) => $body,
            $crate::buffer::Data::I64($v) => $body,
        }
    };
}
pub(crate) use with_data;

/// The inside of a CPU [`Storage`](redline_tensor::Storage). The lock is for the in-place ops
/// (`copy_into`, `scatter_add`, the optimizers); every other op only reads.
pub(crate) struct Buffer(pub RwLock<Data>);

impl Buffer {
    pub fn read(&self) -> RwLockReadGuard<'_, Data> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, Data> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Vectors below this many bytes are left to the system allocator.
const RECYCLE_MIN_BYTES: usize = 1 << 16;
/// At most this many bytes of freed vectors are kept (all element types together). A training
/// step frees every saved activation at the end of backward and allocates the same shapes in
/// the next forward, so the cache must hold a whole step's worth (ResNet-50, batch 8: ~2 GB) —
/// a small cap lets most of them go and every step faults in fresh pages again.
const RECYCLE_MAX_BYTES: usize = 6 << 30;
/// Bytes currently kept for reuse.
static RECYCLED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A freed vector of exactly `len` elements, if one is kept (stale contents).
fn reuse<E: Elem>(len: usize) -> Option<Vec<E>> {
    if len * std::mem::size_of::<E>() < RECYCLE_MIN_BYTES {
        return None;
    }
    let mut free = E::recycled().lock().unwrap_or_else(|p| p.into_inner());
    let i = free.iter().position(|v| v.capacity() == len)?;
    RECYCLED_BYTES.fetch_sub(len * std::mem::size_of::<E>(), Ordering::Relaxed);
    Some(free.swap_remove(i))
}

/// `len` zeros. Large outputs reuse a freed vector of exactly that size when there is one: a
/// training step allocates the same shapes every time, and a fresh multi-megabyte vector costs a
/// page fault per 4 KiB on first touch — more than the op that fills it.
pub(crate) fn zeros<E: Elem>(len: usize) -> Vec<E> {
    match reuse(len) {
        Some(mut v) => {
            v.clear();
            v.resize(len, E::default());
            v
        }
        None => vec![E::default(); len],
    }
}

/// `len` elements that the caller overwrites completely: a recycled vector as it is (no fill
/// pass; stale values of the same type are initialised and about to be replaced), else fresh
/// pages.
pub(crate) fn overwritten<E: Elem>(len: usize) -> Vec<E> {
    match reuse(len) {
        Some(mut v) => {
            v.resize(len, E::default());
            v
        }
        None => vec![E::default(); len],
    }
}

/// Gives a large vector back for [`zeros`] to reuse.
/// Past the byte budget, the oldest kept vectors of this type go first.
pub(crate) fn recycle<E: Elem>(v: Vec<E>) {
    let size = |v: &Vec<E>| v.capacity() * std::mem::size_of::<E>();
    let bytes = size(&v);
    if !(RECYCLE_MIN_BYTES..=RECYCLE_MAX_BYTES).contains(&bytes) {
        return;
    }
    let mut free = E::recycled().lock().unwrap_or_else(|p| p.into_inner());
    free.push(v);
    let mut kept = RECYCLED_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
    while kept > RECYCLE_MAX_BYTES && free.len() > 1 {
        let old = free.remove(0);
        kept = RECYCLED_BYTES.fetch_sub(size(&old), Ordering::Relaxed) - size(&old);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let data = std::mem::replace(
            self.0.get_mut().unwrap_or_else(|p| p.into_inner()),
            Data::U8(Vec::new()),
        );
        with_data!(data, v => recycle(v))
    }
}

/// A storage element type.
pub(crate) trait Elem: Copy + Send + Sync + Default + 'static {
    /// Freed large vectors of this type, for reuse (see [`zeros`]).
    fn recycled() -> &'static Mutex<Vec<Vec<Self>>>;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn wrap(v: Vec<Self>) -> Data;
    fn from_le(b: &[u8]) -> Self;
    /// Writes the little-endian bytes into `out` (exactly this type's size).
    fn write_le(self, out: &mut [u8]);
}

macro_rules! elem {
    ($t:ty, $variant:ident, f64: |$b:ident| $to64:expr, from64: |$d:ident| $from64:expr) => {
        impl Elem for $t {
            fn recycled() -> &'static Mutex<Vec<Vec<Self>>> {
                static FREE: Mutex<Vec<Vec<$t>>> = Mutex::new(Vec::new());
                &FREE
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                let $b = self;
                $to64
            }
            #[inline(always)]
            fn from_f64($d: f64) -> Self {
                $from64
            }
            fn wrap(v: Vec<Self>) -> Data {
                Data::$variant(v)
            }
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap_or_default())
            }
            #[inline(always)]
            fn write_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
        }
    };
}

elem!(f64, F64, f64: |x| x, from64: |v| v);
elem!(f32, F32, f64: |x| x as f64, from64: |v| v as f32);
elem!(f16, F16, f64: |x| x.to_f64(), from64: |v| f16::from_f64(v));
elem!(bf16, BF16, f64: |x| x.to_f64(), from64: |v| bf16::from_f64(v));
// Integers convert as `as` casts do (truncate toward zero, saturate, NaN → 0): DType::round.
elem!(u8, U8, f64: |x| x as f64, from64: |v| v as u8);
elem!(i32, I32, f64: |x| x as f64, from64: |v| v as i32);
elem!(i64, I64, f64: |x| x as f64, from64: |v| v as i64);

/// A compute type: f32 or f64. Arithmetic, the math the ops need, and a single-threaded GEMM.
pub(crate) trait Real:
    Elem
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
{
    const ZERO: Self;
    const ONE: Self;
    fn c(v: f64) -> Self;
    /// The storage's elements, if they already are this type.
    fn borrow(data: &Data) -> Option<&[Self]>;
    fn borrow_mut(data: &mut Data) -> Option<&mut Vec<Self>>;
    /// These values as f32, when `Self` is f32 (the kernels that exist only for f32).
    fn as_f32(values: &[Self]) -> Option<&[f32]>;
    /// f32 results as `Self`.
    fn from_f32s(values: Vec<f32>) -> Vec<Self>;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn is_nan(self) -> bool;
    /// `c = alpha · a·b + beta · c` for row/column-strided `a [m, k]`, `b [k, n]`, `c [m, n]`,
    /// on the calling thread.
    ///
    /// # Safety
    /// The pointers with their strides must address valid memory for the whole matrices, and `c`
    /// must not alias `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        a_strides: [isize; 2],
        b: *const Self,
        b_strides: [isize; 2],
        beta: Self,
        c: *mut Self,
        c_strides: [isize; 2],
    );
}

macro_rules! real {
    ($t:ty, $variant:ident, $gemm:path, |$v:ident| $as_f32:expr, |$w:ident| $from_f32s:expr) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn c(v: f64) -> Self {
                v as $t
            }
            fn borrow(data: &Data) -> Option<&[Self]> {
                match data {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn borrow_mut(data: &mut Data) -> Option<&mut Vec<Self>> {
                match data {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn as_f32($v: &[Self]) -> Option<&[f32]> {
                $as_f32
            }
            fn from_f32s($w: Vec<f32>) -> Vec<Self> {
                $from_f32s
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            unsafe fn gemm(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: *const Self,
                [rsa, csa]: [isize; 2],
                b: *const Self,
                [rsb, csb]: [isize; 2],
                beta: Self,
                c: *mut Self,
                [rsc, csc]: [isize; 2],
            ) {
                // SAFETY: forwarded from the caller's contract.
                unsafe { $gemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
            }
        }
    };
}

real!(f32, F32, crate::sgemm::sgemm_best, |v| Some(v), |v| v);
real!(f64, F64, matrixmultiply::dgemm, |_v| None, |v| v
    .into_iter()
    .map(f64::from)
    .collect());

/// The compute type of a storage type: which of f32/f64 its kernels run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compute {
    F32,
    F64,
}

impl Compute {
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => Compute::F32,
            DType::F64 | DType::U8 | DType::I32 | DType::I64 => Compute::F64,
        }
    }
}

/// Runs the generic expression with `$c` as the compute type of `$dtype`.
macro_rules! with_compute {
    ($dtype:expr, $c:ident => $body:expr) => {
        match $crate::buffer::Compute::of($dtype) {
            $crate::buffer::Compute::F32 => {
                type $c = f32;
                $body
            }
            $crate::buffer::Compute::F64 => {
                type $c = f64;
                $body
            }
        }
    };
}
pub(crate) use with_compute;

/// A [`Data`] of `$dtype` from the generic expression, with `$e` as that dtype's element type.
macro_rules! build_data {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            DType::F64 => {
                type $e = f64;
                Data::F64($body)
            }
            DType::F32 => {
                type $e = f32;
                Data::F32($body)
            }
            DType::F16 => {
                type $e = f16;
                Data::F16($body)
            }
            DType::BF16 => {
                type $e = bf16;
                Data::BF16($body)
            }
            DType::U8 => {
                type $e = u8;
                Data::U8($body)
            }
            DType::I32 => {
                type $e = i32;
                Data::I32($body)
            }
            DType::I64 => {
                type $e = i64;
                Data::I64($body)
            }
        }
    };
}

/// A storage's elements as compute type `C`: borrowed when they already are, converted otherwise.
pub(crate) fn as_compute<C: Real>(data: &Data) -> Cow<'_, [C]> {
    if let Some(v) = C::borrow(data) {
        return Cow::Borrowed(v);
    }
    with_data!(data, v => Cow::Owned(convert_slice(v)))
}

/// Converts a slice element by element, on every core for large slices.
pub(crate) fn convert_slice<A: Elem, B: Elem>(src: &[A]) -> Vec<B> {
    let mut out = zeros::<B>(src.len());
    parallel::chunks_mut(&mut out, 1 << 16, |start, chunk| {
        for (o, &s) in chunk.iter_mut().zip(&src[start..]) {
            *o = B::from_f64(s.to_f64());
        }
    });
    out
}

/// A storage of `dtype` holding `values` (computed in `C`), converted once if needed.
pub(crate) fn from_compute<C: Real>(dtype: DType, values: Vec<C>) -> Data {
    let data = C::wrap(values);
    if data.dtype() == dtype {
        return data;
    }
    let values = C::borrow(&data).unwrap_or_default();
    build_data!(dtype, E => convert_slice::<C, E>(values))
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F64(_) => DType::F64,
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::U8(_) => DType::U8,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
        }
    }

    pub fn len(&self) -> usize {
        with_data!(self, v => v.len())
    }

    /// `len` elements of `dtype`, all `value` rounded to the dtype.
    pub fn filled(dtype: DType, len: usize, value: f64) -> Data {
        build_data!(dtype, E => vec![E::from_f64(value); len])
    }

    /// Σ x² in f64, over fixed parts on every core (the same bits on every run).
    pub fn sum_squares(&self) -> f64 {
        let n = self.len();
        let parts = crate::parallel::parts_for(n, 1 << 16);
        let sums: Vec<std::sync::Mutex<f64>> = (0..parts).map(|_| Default::default()).collect();
        crate::parallel::for_parts(n, parts, |part, range| {
            let s = with_data!(self, v => v[range].iter().map(|e| { let x = e.to_f64(); x * x }).sum::<f64>());
            *sums[part].lock().unwrap_or_else(|p| p.into_inner()) = s;
        });
        sums.into_iter()
            .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()))
            .sum()
    }

    /// Element `i` as f64.
    pub fn get_f64(&self, i: usize) -> f64 {
        with_data!(self, v => v[i].to_f64())
    }

    /// `values` rounded to `dtype` (the per-channel ops' results: a few thousand elements).
    pub fn from_f64s(dtype: DType, values: &[f64]) -> Data {
        build_data!(dtype, E => values.iter().map(|&v| E::from_f64(v)).collect())
    }

    /// Little-endian bytes of `dtype` as a storage.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Data {
        build_data!(dtype, E => bytes.chunks_exact(dtype.size()).map(<E as Elem>::from_le).collect())
    }
}

//! The reference backend: every op as plain loops over f64, obviously correct and slow.
//!
//! Storage holds one f64 per element, always rounded to the storage's dtype, so a reference f16
//! tensor holds exactly the values an f16 can. Kernels compute in f64 and round once on store.
//! Every backend is compared against this one; gradcheck runs on it alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLock;

use crate::backend::{Backend, BinaryOp, HostBytes, Op, OtherOp, ReduceOp, Storage, UnaryOp, View};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::ops;

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// The reference backend. Each instance is its own device.
#[derive(Debug)]
pub struct Reference {
    id: usize,
}

impl Reference {
    pub fn new() -> Self {
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (1 << 48),
        }
    }
}

impl Default for Reference {
    fn default() -> Self {
        Self::new()
    }
}

/// A reference storage: the elements as f64 (already rounded to the dtype).
struct Values(RwLock<Vec<f64>>);

impl Reference {
    fn values<'a>(&self, s: &'a Storage) -> Result<std::sync::RwLockReadGuard<'a, Vec<f64>>> {
        let values = s.downcast::<Values>(self.id).ok_or_else(|| {
            TensorError::Device(
                "a storage from another device was given to the reference backend".into(),
            )
        })?;
        Ok(values.0.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn store(&self, dtype: DType, values: Vec<f64>) -> Storage {
        let values: Vec<f64> = values.into_iter().map(|v| dtype.round(v)).collect();
        Storage::new(dtype, values.len(), self.id, Values(RwLock::new(values)))
    }

    /// Writes `f(i)` for every logical index `i` of `out` at its storage position.
    fn produce(&self, dtype: DType, out: &Layout, f: impl Fn(usize) -> f64) -> Storage {
        let mut values = vec![0.0; out.storage_extent().max(out.numel())];
        for (i, at) in out.indices().enumerate() {
            values[at] = f(i);
        }
        self.store(dtype, values)
    }

    /// The view's elements in logical row-major order.
    fn gather(&self, x: View<'_>) -> Result<Vec<f64>> {
        let values = self.values(x.storage)?;
        Ok(x.layout.indices().map(|at| values[at]).collect())
    }
}

impl Backend for Reference {
    fn name(&self) -> String {
        "reference".into()
    }

    fn id(&self) -> usize {
        self.id
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        if dtype.is_float() {
            return true;
        }
        // Integers: exact arithmetic, comparisons, selection, reductions and copies. A u8 sum
        // would overflow (PyTorch promotes it to i64): cast first.
        match op {
            Op::Unary(_) => false,
            Op::Binary(b) => !matches!(b, BinaryOp::Div | BinaryOp::Pow),
            Op::Reduce(r) => !(r == ReduceOp::Sum && dtype == DType::U8),
            Op::Other(o) => o != OtherOp::Matmul,
        }
    }

    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        Ok(self.store(dtype, vec![value; len]))
    }

    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        let values = (0..bytes.len() / dtype.size())
            .map(|i| dtype.read(&bytes, i))
            .collect();
        // The copy is complete here: `bytes` (maybe a pooled buffer) is dropped on return.
        Ok(self.store(dtype, values))
    }

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        let values = self.gather(x)?;
        let dtype = x.dtype();
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        for (i, v) in values.into_iter().enumerate() {
            dtype.write(&mut bytes, i, v);
        }
        Ok(bytes)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        Ok(self.produce(x.dtype(), out, |i| {
            ops::elementwise::reference::unary(op, xs[i])
        }))
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let (xs, ys) = (self.gather(a)?, self.gather(b)?);
        let dtype = if op.is_comparison() {
            DType::U8
        } else {
            a.dtype()
        };
        Ok(self.produce(dtype, out, |i| {
            ops::elementwise::reference::binary(op, xs[i], ys[i])
        }))
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let values = self.values(x.storage)?;
        let out = ops::reduce::reference::reduce(op, &values, x.layout, axes);
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            x.dtype()
        };
        Ok(self.store(dtype, out))
    }

    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let (va, vb) = (self.values(a.storage)?, self.values(b.storage)?);
        let out = ops::matmul::reference::matmul(&va, a.layout, &vb, b.layout);
        Ok(self.store(a.dtype(), out))
    }

    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let (c, xs, ys) = (self.gather(cond)?, self.gather(a)?, self.gather(b)?);
        Ok(self.produce(a.dtype(), out, |i| if c[i] != 0.0 { xs[i] } else { ys[i] }))
    }

    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        Ok(self.produce(dtype, out, |i| xs[i]))
    }

    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        let values = self.gather(src)?;
        let target = dst.downcast::<Values>(self.id).ok_or_else(|| {
            TensorError::Device("copy_into: the destination belongs to another device".into())
        })?;
        let mut target = target.0.write().unwrap_or_else(|p| p.into_inner());
        if at.storage_extent() > target.len() {
            return Err(TensorError::shape(format!(
                "copy_into: region reaches element {} of a storage of {}",
                at.storage_extent(),
                target.len()
            )));
        }
        for (v, i) in values.into_iter().zip(at.indices()) {
            target[i] = dst.dtype().round(v);
        }
        Ok(())
    }
}

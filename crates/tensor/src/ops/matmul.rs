//! Batched matrix products with broadcast batch axes; transposes are strides.

use crate::backend::{Op, OtherOp, View};
use crate::error::{Result, TensorError};
use crate::layout::{broadcast_shapes, Layout};
use crate::tensor::Tensor;

impl Tensor {
    /// `[.., M, K] @ [.., K, N]` → `[.., M, N]`; batch axes broadcast (NumPy `matmul` rules for
    /// rank ≥ 2).
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.same_device(other, "matmul")?;
        self.same_dtype(other, "matmul")?;
        self.device()
            .check(Op::Other(OtherOp::Matmul), self.dtype())?;
        let (ra, rb) = (self.rank(), other.rank());
        if ra < 2 || rb < 2 || self.shape()[ra - 1] != other.shape()[rb - 2] {
            return Err(TensorError::shape(format!(
                "matmul: {:?} @ {:?} (need [.., M, K] @ [.., K, N])",
                self.shape(),
                other.shape()
            )));
        }
        let batch = broadcast_shapes(&self.shape()[..ra - 2], &other.shape()[..rb - 2])?;
        let full = |t: &Tensor, r: usize| -> Result<Layout> {
            let mut shape = batch.clone();
            shape.extend_from_slice(&t.shape()[r - 2..]);
            t.layout().broadcast_to(&shape)
        };
        let (la, lb) = (full(self, ra)?, full(other, rb)?);
        let storage = self.backend().matmul(
            View {
                storage: self.storage(),
                layout: &la,
            },
            View {
                storage: other.storage(),
                layout: &lb,
            },
        )?;
        let mut shape = batch;
        shape.extend([self.shape()[ra - 2], other.shape()[rb - 1]]);
        let y = Tensor::from_storage(storage, Layout::contiguous(&shape), self.device().clone());
        let (a, b) = (self.detach(), other.detach());
        Ok(y.record("matmul", &[self, other], move |g| {
            let ga = g.matmul(&b.transpose(b.rank() - 2, b.rank() - 1)?)?;
            let gb = a.transpose(a.rank() - 2, a.rank() - 1)?.matmul(g)?;
            Ok(vec![
                Some(ga.sum_to(a.shape())?),
                Some(gb.sum_to(b.shape())?),
            ])
        }))
    }
}

/// The reference kernel: f64 dot products.
pub(crate) mod reference {
    use crate::layout::Layout;

    pub fn matmul(a: &[f64], la: &Layout, b: &[f64], lb: &Layout) -> Vec<f64> {
        let r = la.rank();
        let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
        let batches: usize = la.shape()[..r - 2].iter().product();
        let (sa, sb) = (la.strides(), lb.strides());
        let mut out = vec![0.0; batches * m * n];
        for batch in 0..batches {
            // Offsets of this batch in each operand (broadcast batches have stride 0).
            let (mut oa, mut ob, mut rest) = (la.offset(), lb.offset(), batch);
            for d in (0..r - 2).rev() {
                let i = rest % la.shape()[d];
                rest /= la.shape()[d];
                oa += i * sa[d];
                ob += i * sb[d];
            }
            for i in 0..m {
                for j in 0..n {
                    out[(batch * m + i) * n + j] = (0..k)
                        .map(|p| {
                            a[oa + i * sa[r - 2] + p * sa[r - 1]]
                                * b[ob + p * sb[r - 2] + j * sb[r - 1]]
                        })
                        .sum();
                }
            }
        }
        out
    }
}

//! Reductions over axes: sum, mean, max, var, argmax, and `sum_to` (undoing a broadcast).

use crate::backend::{Op, ReduceOp};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Tensor {
    /// Sorted, unique, in-range axes, or an error naming the shape.
    fn reduce_axes(&self, axes: &[usize], op: &str) -> Result<Vec<usize>> {
        let mut sorted = axes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != axes.len() || sorted.iter().any(|&a| a >= self.rank()) {
            return Err(TensorError::shape(format!(
                "{op}: axes {axes:?} are not distinct axes of shape {:?}",
                self.shape()
            )));
        }
        Ok(sorted)
    }

    fn kept_shape(&self, axes: &[usize]) -> Vec<usize> {
        let mut shape = self.shape().to_vec();
        for &a in axes {
            shape[a] = 1;
        }
        shape
    }

    fn dropped_shape(&self, axes: &[usize]) -> Vec<usize> {
        (0..self.rank())
            .filter(|a| !axes.contains(a))
            .map(|a| self.shape()[a])
            .collect()
    }

    fn reduce_raw(&self, op: ReduceOp, axes: &[usize]) -> Result<Tensor> {
        self.device().check(Op::Reduce(op), self.dtype())?;
        let storage = self.backend().reduce(op, self.view(), axes)?;
        Ok(Tensor::from_storage(
            storage,
            Layout::contiguous(&self.kept_shape(axes)),
            self.device().clone(),
        ))
    }

    fn finish_reduce(y: Tensor, x: &Tensor, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        if keepdim {
            Ok(y)
        } else {
            y.reshape(&x.dropped_shape(axes))
        }
    }

    /// Sum over `axes` (all axes when empty), keeping them as size 1 when `keepdim`.
    pub fn sum(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        let axes = self.all_if_empty(axes, "sum")?;
        let y = self.reduce_raw(ReduceOp::Sum, &axes)?;
        let shape = self.shape().to_vec();
        let kept = y.shape().to_vec();
        let y = y.record("sum", &[self], move |g| {
            Ok(vec![Some(g.reshape(&kept)?.broadcast_to(&shape)?)])
        });
        Self::finish_reduce(y, self, &axes, keepdim)
    }

    /// Mean over `axes` (all when empty).
    pub fn mean(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        let axes = self.all_if_empty(axes, "mean")?;
        let count: usize = axes.iter().map(|&a| self.shape()[a]).product();
        self.sum(&axes, keepdim)?
            .mul_scalar(1.0 / count.max(1) as f64)
    }

    /// Variance over `axes` with `correction` (1: unbiased, as `torch.var`; 0: population).
    pub fn var(&self, axes: &[usize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let axes = self.all_if_empty(axes, "var")?;
        let count: usize = axes.iter().map(|&a| self.shape()[a]).product();
        let centred = self.sub(&self.mean(&axes, true)?)?;
        let denominator = count.saturating_sub(correction).max(1) as f64;
        centred
            .mul(&centred)?
            .sum(&axes, keepdim)?
            .mul_scalar(1.0 / denominator)
    }

    /// Maximum over `axes` (all when empty). The gradient is shared among tied maxima.
    pub fn max(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        let axes = self.all_if_empty(axes, "max")?;
        let y = self.reduce_raw(ReduceOp::Max, &axes)?;
        let (x, yd, axes_c) = (self.detach(), y.detach(), axes.clone());
        let y = y.record("max", &[self], move |g| {
            let hit = x.eq(&yd.broadcast_to(x.shape())?)?.cast(x.dtype())?;
            let ties = hit.sum(&axes_c, true)?;
            let g = g.reshape(yd.shape())?.div(&ties)?;
            Ok(vec![Some(hit.mul(&g)?)])
        });
        Self::finish_reduce(y, self, &axes, keepdim)
    }

    /// Index (i64) of the first maximum along `axis`.
    pub fn argmax(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        let axes = self.reduce_axes(&[axis], "argmax")?;
        let y = self.reduce_raw(ReduceOp::ArgMax, &axes)?;
        debug_assert_eq!(y.dtype(), DType::I64);
        Self::finish_reduce(y, self, &axes, keepdim)
    }

    /// Sums a broadcast result back to `shape` (leading axes and axes of size 1 in `shape`).
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let bad = || {
            TensorError::shape(format!(
                "sum_to: shape {:?} is not a broadcast of {shape:?}",
                self.shape()
            ))
        };
        let lead = self.rank().checked_sub(shape.len()).ok_or_else(bad)?;
        let mut axes: Vec<usize> = (0..lead).collect();
        for (i, &n) in shape.iter().enumerate() {
            match (n, self.shape()[lead + i]) {
                (a, b) if a == b => {}
                (1, _) => axes.push(lead + i),
                _ => return Err(bad()),
            }
        }
        self.sum(&axes, true)?.reshape(shape)
    }

    fn all_if_empty(&self, axes: &[usize], op: &str) -> Result<Vec<usize>> {
        if axes.is_empty() {
            Ok((0..self.rank()).collect())
        } else {
            self.reduce_axes(axes, op)
        }
    }
}

/// The reference kernel: f64 accumulation in a fixed order.
pub(crate) mod reference {
    use crate::backend::ReduceOp;
    use crate::layout::Layout;

    /// Reduces `values` (read through `x`) over `axes` into a row-major keepdim output.
    pub fn reduce(op: ReduceOp, values: &[f64], x: &Layout, axes: &[usize]) -> Vec<f64> {
        let shape = x.shape();
        let mut out_shape = shape.to_vec();
        for &a in axes {
            out_shape[a] = 1;
        }
        let out_strides = crate::layout::contiguous_strides(&out_shape);
        let out_len: usize = out_shape.iter().product();
        let init = match op {
            ReduceOp::Sum => 0.0,
            ReduceOp::Max | ReduceOp::ArgMax => f64::NEG_INFINITY,
        };
        let mut acc = vec![init; out_len];
        let mut arg = vec![0.0; out_len];
        let mut coords = vec![0usize; shape.len()];
        for (i, at) in x.indices().enumerate() {
            // Logical coordinates of element i, and its output slot.
            let mut rest = i;
            for d in (0..shape.len()).rev() {
                coords[d] = rest % shape[d].max(1);
                rest /= shape[d].max(1);
            }
            let slot: usize = (0..shape.len())
                .filter(|d| !axes.contains(d))
                .map(|d| coords[d] * out_strides[d])
                .sum();
            let v = values[at];
            match op {
                ReduceOp::Sum => acc[slot] += v,
                ReduceOp::Max => {
                    if v > acc[slot] || v.is_nan() || acc[slot].is_nan() {
                        acc[slot] = if acc[slot].is_nan() { acc[slot] } else { v };
                    }
                }
                ReduceOp::ArgMax => {
                    let position = coords[axes[0]] as f64;
                    if v > acc[slot] || (v.is_nan() && !acc[slot].is_nan()) {
                        acc[slot] = v;
                        arg[slot] = position;
                    }
                }
            }
        }
        if op == ReduceOp::ArgMax {
            arg
        } else {
            acc
        }
    }
}

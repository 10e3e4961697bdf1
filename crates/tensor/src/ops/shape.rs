//! Views (reshape, permute, transpose, narrow, broadcast, unsqueeze) and concat/stack.

use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

impl Tensor {
    /// The same elements in a new shape (a view when the layout allows, else a copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(TensorError::shape(format!(
                "reshape: {:?} ({} elements) to {shape:?}",
                self.shape(),
                self.numel()
            )));
        }
        let base = match self.layout().reshape(shape) {
            Some(layout) => self.with_layout(layout),
            None => self.contiguous()?.detach().reshape(shape)?,
        };
        let from = self.shape().to_vec();
        Ok(base.record("reshape", &[self], move |g| {
            Ok(vec![Some(g.reshape(&from)?)])
        }))
    }

    /// Collapses everything into one axis.
    pub fn flatten(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])
    }

    /// Inserts a size-1 axis at `axis`.
    pub fn unsqueeze(&self, axis: usize) -> Result<Tensor> {
        if axis > self.rank() {
            return Err(TensorError::shape(format!(
                "unsqueeze({axis}) on shape {:?}",
                self.shape()
            )));
        }
        let mut shape = self.shape().to_vec();
        shape.insert(axis, 1);
        self.reshape(&shape)
    }

    /// Reorders axes (a view).
    pub fn permute(&self, axes: &[usize]) -> Result<Tensor> {
        let y = self.with_layout(self.layout().permute(axes)?);
        let mut inverse = vec![0; axes.len()];
        for (i, &a) in axes.iter().enumerate() {
            inverse[a] = i;
        }
        Ok(y.record("permute", &[self], move |g| {
            Ok(vec![Some(g.permute(&inverse)?)])
        }))
    }

    /// Swaps two axes (a view).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let mut axes: Vec<usize> = (0..self.rank()).collect();
        if a >= self.rank() || b >= self.rank() {
            return Err(TensorError::shape(format!(
                "transpose({a}, {b}) on shape {:?}",
                self.shape()
            )));
        }
        axes.swap(a, b);
        self.permute(&axes)
    }

    /// `len` elements of `axis` from `start` (a view).
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        let y = self.with_layout(self.layout().narrow(axis, start, len)?);
        let shape = self.shape().to_vec();
        Ok(y.record("narrow", &[self], move |g| {
            let full = Tensor::zeros(&shape, g.dtype(), g.device())?;
            full.write_region(&full.layout().narrow(axis, start, len)?, g)?;
            Ok(vec![Some(full)])
        }))
    }

    /// Repeats size-1 axes (and prepends axes) to reach `shape` (a view with zero strides).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        let y = self.with_layout(self.layout().broadcast_to(shape)?);
        let from = self.shape().to_vec();
        Ok(y.record("broadcast", &[self], move |g| {
            Ok(vec![Some(g.sum_to(&from)?)])
        }))
    }

    /// Joins tensors of equal shape but for `axis` along it.
    pub fn concat(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| TensorError::shape("concat of no tensors"))?;
        let mut shape = first.shape().to_vec();
        if axis >= shape.len() {
            return Err(TensorError::shape(format!(
                "concat along axis {axis} of shape {shape:?}"
            )));
        }
        shape[axis] = 0;
        for t in tensors {
            first.same_device(t, "concat")?;
            first.same_dtype(t, "concat")?;
            let fits = t.rank() == first.rank()
                && (0..t.rank()).all(|d| d == axis || t.shape()[d] == first.shape()[d]);
            if !fits {
                return Err(TensorError::shape(format!(
                    "concat along axis {axis}: shapes {:?} and {:?}",
                    first.shape(),
                    t.shape()
                )));
            }
            shape[axis] += t.shape()[axis];
        }
        let out = Tensor::zeros(&shape, first.dtype(), first.device())?;
        let mut start = 0;
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            let len = t.shape()[axis];
            out.write_region(&out.layout().narrow(axis, start, len)?, t)?;
            sizes.push((start, len));
            start += len;
        }
        Ok(out.record("concat", tensors, move |g| {
            sizes
                .iter()
                .map(|&(s, l)| Ok(Some(g.narrow(axis, s, l)?)))
                .collect()
        }))
    }

    /// Stacks tensors of one shape along a new axis.
    pub fn stack(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        let expanded = tensors
            .iter()
            .map(|t| t.unsqueeze(axis))
            .collect::<Result<Vec<_>>>()?;
        Tensor::concat(&expanded.iter().collect::<Vec<_>>(), axis)
    }
}

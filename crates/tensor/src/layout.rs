//! Shapes, strides and views: how a tensor's logical indices map onto its storage.

use crate::error::{Result, TensorError};

/// A strided view of a storage: element `[i0, i1, …]` lives at
/// `offset + i0 * strides[0] + i1 * strides[1] + …` (in elements). A stride of 0 repeats
/// (broadcasting); a dense layout whose strides are a permutation of the contiguous ones is a
/// different memory format (channels-last is NCHW with strides ordered N, H, W, C).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// The row-major (C-contiguous) layout of `shape`.
    pub fn contiguous(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A dense layout of `shape` whose memory order is `order` (outermost first): `[0, 2, 3, 1]`
    /// on NCHW is channels-last.
    pub fn dense_in_order(shape: &[usize], order: &[usize]) -> Self {
        let mut strides = vec![0; shape.len()];
        let mut step = 1;
        for &axis in order.iter().rev() {
            strides[axis] = step;
            step *= shape[axis].max(1);
        }
        Self {
            shape: shape.to_vec(),
            strides,
            offset: 0,
        }
    }

    /// Channels-last for a 4-d NCHW shape (NHWC in memory).
    pub fn channels_last(shape: &[usize]) -> Result<Self> {
        if shape.len() != 4 {
            return Err(TensorError::shape(format!(
                "channels-last needs a 4-d NCHW shape, got {shape:?}"
            )));
        }
        Ok(Self::dense_in_order(shape, &[0, 2, 3, 1]))
    }

    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        Self {
            shape,
            strides,
            offset,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of logical elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether this is the row-major layout with no offset.
    pub fn is_contiguous(&self) -> bool {
        self.offset == 0 && self.is_dense_with(&contiguous_strides(&self.shape))
    }

    /// Whether this view steps through memory as `dense` does — the same strides on every axis
    /// of more than one element — at any offset: a channels-last view of
    /// `Layout::channels_last(shape)`, say.
    pub fn strides_match(&self, dense: &Layout) -> bool {
        self.shape == dense.shape && self.is_dense_with(&dense.strides)
    }

    fn is_dense_with(&self, strides: &[usize]) -> bool {
        self.shape
            .iter()
            .zip(self.strides.iter().zip(strides))
            .all(|(&n, (&a, &b))| n <= 1 || a == b)
    }

    /// The axes from outermost to innermost in memory (ties keep logical order).
    pub fn memory_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.rank()).collect();
        order.sort_by(|&a, &b| self.strides[b].cmp(&self.strides[a]));
        order
    }

    /// Whether the view covers a whole storage of `numel` elements exactly once, in some axis order
    /// (contiguous, channels-last, any permutation) and without offset.
    pub fn is_dense(&self) -> bool {
        self.offset == 0
            && self.is_dense_with(&Self::dense_in_order(&self.shape, &self.memory_order()).strides)
    }

    /// The dense layout an op's output gets: the same memory order as this view when it is dense
    /// (so channels-last stays channels-last), row-major otherwise.
    pub fn output_like(&self) -> Self {
        if self.is_dense() {
            Self::dense_in_order(&self.shape, &self.memory_order())
        } else {
            Self::contiguous(&self.shape)
        }
    }

    /// Storage index of the element at logical linear index `i` (row-major over `shape`).
    pub fn index_of(&self, mut i: usize) -> usize {
        let mut at = self.offset;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n > 0 {
                at += (i % n) * s;
                i /= n;
            }
        }
        at
    }

    /// Storage indices of every element, in logical row-major order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.numel()).map(|i| self.index_of(i))
    }

    /// The largest storage index the view touches plus one (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// Reorders axes.
    pub fn permute(&self, axes: &[usize]) -> Result<Self> {
        let mut seen = vec![false; self.rank()];
        let valid = axes.len() == self.rank()
            && axes
                .iter()
                .all(|&a| a < self.rank() && !std::mem::replace(&mut seen[a], true));
        if !valid {
            return Err(TensorError::shape(format!(
                "permute {axes:?} is not a permutation of the {} axes of {:?}",
                self.rank(),
                self.shape
            )));
        }
        Ok(Self {
            shape: axes.iter().map(|&a| self.shape[a]).collect(),
            strides: axes.iter().map(|&a| self.strides[a]).collect(),
            offset: self.offset,
        })
    }

    /// Swaps two axes.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        let mut axes: Vec<usize> = (0..self.rank()).collect();
        if a >= self.rank() || b >= self.rank() {
            return Err(TensorError::shape(format!(
                "transpose({a}, {b}) on shape {:?} with {} axes",
                self.shape,
                self.rank()
            )));
        }
        axes.swap(a, b);
        self.permute(&axes)
    }

    /// `len` elements of `axis` starting at `start`.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Self> {
        let n = *self.shape.get(axis).ok_or_else(|| {
            TensorError::shape(format!("narrow: axis {axis} of shape {:?}", self.shape))
        })?;
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(TensorError::shape(format!(
                "narrow: {start}..{} is outside axis {axis} of length {n} (shape {:?})",
                start.saturating_add(len),
                self.shape
            )));
        }
        let mut out = self.clone();
        out.shape[axis] = len;
        if len > 0 {
            out.offset += start * self.strides[axis];
        }
        Ok(out)
    }

    /// Repeats size-1 axes (and adds leading axes) to reach `shape`, without copying.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Self> {
        let bad = || {
            TensorError::shape(format!(
                "cannot broadcast shape {:?} to {shape:?}",
                self.shape
            ))
        };
        if shape.len() < self.rank() {
            return Err(bad());
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (i, &n) in shape.iter().enumerate().skip(lead) {
            let (own, stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = match own {
                _ if own == n => stride,
                1 => 0,
                _ => return Err(bad()),
            };
        }
        Ok(Self {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// A new shape over the same elements, when the strides allow it without a copy
    /// (`None` when a copy is needed first).
    pub fn reshape(&self, shape: &[usize]) -> Option<Self> {
        let packed = self.is_dense_with(&contiguous_strides(&self.shape));
        if packed && self.numel() == shape.iter().product::<usize>() {
            return Some(Self {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            });
        }
        None
    }
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The shape two shapes broadcast to (NumPy rules), or an error naming both.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| {
        if i < rank - s.len() {
            1
        } else {
            s[i - (rank - s.len())]
        }
    };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            _ => Err(TensorError::shape(format!(
                "shapes {a:?} and {b:?} do not broadcast (axis {i})"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_map_indices() {
        let l = Layout::contiguous(&[2, 3]);
        assert_eq!(l.indices().collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
        let t = l.transpose(0, 1).unwrap();
        assert_eq!(t.indices().collect::<Vec<_>>(), [0, 3, 1, 4, 2, 5]);
        assert!(!t.is_contiguous() && t.is_dense());
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!(n.indices().collect::<Vec<_>>(), [1, 2, 4, 5]);
        let b = Layout::contiguous(&[3]).broadcast_to(&[2, 3]).unwrap();
        assert_eq!(b.indices().collect::<Vec<_>>(), [0, 1, 2, 0, 1, 2]);
        assert!(Layout::contiguous(&[2]).broadcast_to(&[3]).is_err());
    }

    #[test]
    fn strides_match_ignores_offsets_and_single_element_axes() {
        let cl = Layout::channels_last(&[2, 3, 4, 5]).unwrap();
        let shifted = Layout::new(cl.shape().to_vec(), cl.strides().to_vec(), 7);
        assert!(shifted.strides_match(&cl));
        assert!(!Layout::contiguous(&[2, 3, 4, 5]).strides_match(&cl));
        assert!(!Layout::channels_last(&[2, 3, 4, 6])
            .unwrap()
            .strides_match(&cl));
        // One image, one row: the batch and row strides are free.
        let one = Layout::channels_last(&[1, 3, 1, 5]).unwrap();
        let other = Layout::new(vec![1, 3, 1, 5], vec![99, 1, 42, 3], 0);
        assert!(other.strides_match(&one));
    }

    #[test]
    fn channels_last_is_a_stride_order() {
        let l = Layout::channels_last(&[2, 3, 4, 5]).unwrap();
        assert_eq!(l.strides(), [60, 1, 15, 3]);
        assert!(l.is_dense() && !l.is_contiguous());
        assert_eq!(l.memory_order(), [0, 2, 3, 1]);
        assert_eq!(l.output_like(), l);
    }

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_shapes(&[4, 1, 3], &[5, 1]).unwrap(), [4, 5, 3]);
        let err = broadcast_shapes(&[2, 3], &[4]).unwrap_err().to_string();
        assert!(err.contains("[2, 3]") && err.contains("[4]"), "{err}");
    }
}

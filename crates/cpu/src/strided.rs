//! Walking several strided views of one shape together, in the memory order of the first.
//!
//! An elementwise op over views of any layout (contiguous, channels-last, transposed, broadcast)
//! becomes a few runs along the innermost axis: axes are ordered by the first operand's strides
//! (the output: it is written sequentially) and merged wherever every operand allows, so a
//! contiguous op is one run and a per-channel broadcast on channels-last is runs of C.

use redline_tensor::Layout;

/// The iteration plan of `N` operands over one shape.
pub(crate) struct Plan<const N: usize> {
    /// Axis sizes, outermost first (size-1 axes dropped, mergeable axes merged).
    shape: Vec<usize>,
    /// Per axis, each operand's stride.
    strides: Vec<[usize; N]>,
    offsets: [usize; N],
}

impl<const N: usize> Plan<N> {
    /// A plan over `shape` for `layouts` (each of that shape), ordered by `layouts[0]`.
    pub fn new(layouts: [&Layout; N]) -> Self {
        let shape = layouts[0].shape();
        let mut axes: Vec<usize> = (0..shape.len()).filter(|&a| shape[a] != 1).collect();
        // Outermost first by the first operand's stride; ties keep logical order.
        axes.sort_by(|&a, &b| layouts[0].strides()[b].cmp(&layouts[0].strides()[a]));
        let mut plan_shape: Vec<usize> = Vec::with_capacity(axes.len());
        let mut strides: Vec<[usize; N]> = Vec::with_capacity(axes.len());
        for a in axes {
            let s: [usize; N] = std::array::from_fn(|k| layouts[k].strides()[a]);
            if let (Some(last_n), Some(last_s)) = (plan_shape.last_mut(), strides.last_mut()) {
                // Merge into the outer axis when every operand steps over it uniformly.
                if (0..N).all(|k| last_s[k] == s[k] * shape[a]) {
                    *last_n *= shape[a];
                    *last_s = s;
                    continue;
                }
            }
            plan_shape.push(shape[a]);
            strides.push(s);
        }
        Self {
            shape: plan_shape,
            strides,
            offsets: std::array::from_fn(|k| layouts[k].offset()),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Each operand's stride along the innermost axis (the step inside a run).
    pub fn inner(&self) -> [usize; N] {
        self.strides.last().copied().unwrap_or([0; N])
    }

    /// Calls `f(positions, len)` for the runs covering iteration indices `range`: `len`
    /// consecutive elements of the innermost axis, operand `k`'s `j`-th at
    /// `positions[k] + j * inner()[k]`.
    pub fn runs(&self, range: std::ops::Range<usize>, mut f: impl FnMut([usize; N], usize)) {
        if range.is_empty() {
            return;
        }
        let rank = self.shape.len();
        if rank == 0 {
            f(self.offsets, 1);
            return;
        }
        let inner_len = self.shape[rank - 1];
        // Coordinates of range.start.
        let mut coords = vec![0usize; rank];
        let mut rest = range.start;
        for d in (0..rank).rev() {
            coords[d] = rest % self.shape[d];
            rest /= self.shape[d];
        }
        let mut pos: [usize; N] = std::array::from_fn(|k| {
            self.offsets[k]
                + (0..rank)
                    .map(|d| coords[d] * self.strides[d][k])
                    .sum::<usize>()
        });
        let mut at = range.start;
        while at < range.end {
            let len = (inner_len - coords[rank - 1]).min(range.end - at);
            f(pos, len);
            at += len;
            // Step to the start of the next run.
            coords[rank - 1] += len;
            for (p, s) in pos.iter_mut().zip(&self.strides[rank - 1]) {
                *p += len * s;
            }
            let mut d = rank - 1;
            while coords[d] == self.shape[d] && d > 0 {
                let (outer, inner) = (&self.strides[d - 1], &self.strides[d]);
                for ((p, o), i) in pos.iter_mut().zip(outer).zip(inner) {
                    *p = *p + o - self.shape[d] * i;
                }
                coords[d] = 0;
                coords[d - 1] += 1;
                d -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions<const N: usize>(plan: &Plan<N>, range: std::ops::Range<usize>) -> Vec<[usize; N]> {
        let inner = plan.inner();
        let mut out = Vec::new();
        plan.runs(range, |p, len| {
            for j in 0..len {
                out.push(std::array::from_fn(|k| p[k] + j * inner[k]));
            }
        });
        out
    }

    #[test]
    fn walks_in_the_first_operands_memory_order() {
        let shape = [2, 3, 4, 5];
        let out = Layout::channels_last(&shape).unwrap();
        let x = Layout::contiguous(&shape);
        let plan = Plan::new([&out, &x]);
        let got = positions(&plan, 0..120);
        // The output is written sequentially; x is read at the matching logical element.
        for (i, [o, xi]) in got.iter().enumerate() {
            assert_eq!(*o, i);
            let (c, rest) = (i % 3, i / 3);
            let (w, rest) = (rest % 5, rest / 5);
            let (h, n) = (rest % 4, rest / 4);
            assert_eq!(*xi, ((n * 3 + c) * 4 + h) * 5 + w);
        }
        // Any sub-range gives the same positions as the full walk.
        assert_eq!(positions(&plan, 17..93), got[17..93].to_vec());
    }

    #[test]
    fn contiguous_and_broadcast_operands_merge() {
        let shape = [4, 6];
        let out = Layout::contiguous(&shape);
        let plan = Plan::new([&out, &out]);
        assert_eq!(plan.shape, vec![24]);
        let bias = Layout::new(vec![4, 6], vec![0, 1], 2);
        let plan = Plan::new([&out, &bias]);
        let got = positions(&plan, 0..24);
        assert!(got.iter().enumerate().all(|(i, p)| p[1] == 2 + i % 6));
    }
}

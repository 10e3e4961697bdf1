//! Launchers by op family: each computes a grid and packs a kernel's parameters, nothing else.
//! An op's kernel lives in `kernels/<family>.cu`, beside this file's name.

pub mod conv;
pub mod elementwise;
pub mod matmul;
pub mod nn;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod reduce;

use redline_tensor::Layout;

use crate::gpu::LaunchShape;

/// Threads per block for the grid-stride elementwise kernels.
pub const THREADS: u32 = 256;

/// Enough blocks to give every thread one element, capped: the kernels loop over the rest.
pub fn linear_shape(n: usize) -> LaunchShape {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    LaunchShape::linear(blocks as u32, THREADS)
}

/// Whether every layout covers its elements with no gaps (at any offset) in one and the same
/// axis order, over one shape: then the k-th element in memory of each is the same logical
/// element, and a kernel may walk them all in memory order as flat arrays — coalesced whatever
/// the order (channels-last included), where a walk in logical order strides through memory.
/// Size-1 axes' strides are free.
pub fn share_one_dense_order(layouts: &[&Layout]) -> bool {
    let Some(first) = layouts.first() else {
        return false;
    };
    layouts.iter().all(|l| {
        let dense = Layout::new(l.shape().to_vec(), l.strides().to_vec(), 0).is_dense();
        dense
            && l.shape() == first.shape()
            && l.shape()
                .iter()
                .zip(l.strides().iter().zip(first.strides()))
                .all(|(&n, (&a, &b))| n <= 1 || a == b)
    })
}

/// Operands of one shape, the output last, as an elementwise kernel walks them: axes in the
/// output's memory order (largest stride first; size-1 axes dropped), then, per operand,
/// adjacent axes it steps over as one run merged. Row-major order over the permuted shape is
/// then the output's memory order, so writes are coalesced whatever its layout (a channels-last
/// gradient beside a broadcast one walks channels innermost, not with a stride of C), and each
/// operand divides its index by as few axes as it has runs (a dense one by none). Each operand
/// comes back as (shape, strides, offset); operands of another shape than the output's (which
/// the kernels do not take) come back as they are.
pub fn in_output_order(layouts: &[&Layout]) -> Vec<(Vec<usize>, Vec<usize>, usize)> {
    let as_is = |l: &Layout| (l.shape().to_vec(), l.strides().to_vec(), l.offset());
    let Some(out) = layouts.last() else {
        return Vec::new();
    };
    if layouts.iter().any(|l| l.shape() != out.shape()) {
        return layouts.iter().map(|l| as_is(l)).collect();
    }
    let mut order: Vec<usize> = (0..out.shape().len())
        .filter(|&d| out.shape()[d] != 1)
        .collect();
    // Stable: axes the output does not tell apart keep their logical order.
    order.sort_by_key(|&d| std::cmp::Reverse(out.strides()[d]));
    layouts
        .iter()
        .map(|l| {
            let mut runs: Vec<(usize, usize)> = Vec::with_capacity(order.len());
            for &d in &order {
                let (n, stride) = (l.shape()[d], l.strides()[d]);
                match runs.last_mut() {
                    Some(run) if run.1 == n * stride => *run = (run.0 * n, stride),
                    _ => runs.push((n, stride)),
                }
            }
            let (shape, strides) = runs.into_iter().unzip();
            (shape, strides, l.offset())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_walks_follow_the_outputs_memory_order_with_runs_merged() {
        let shape = [2, 8, 3, 5];
        let cl = Layout::channels_last(&shape).unwrap();
        let nchw = Layout::contiguous(&shape);
        // A channels-last output and operand become one run each; an NCHW operand is walked
        // (n, h·w, c) to match, its h and w merged.
        let walks = in_output_order(&[&nchw, &cl, &cl]);
        assert_eq!(walks[1], (vec![240], vec![1], 0));
        assert_eq!(walks[2], (vec![240], vec![1], 0));
        assert_eq!(walks[0], (vec![2, 15, 8], vec![120, 1, 15], 0));
        // A per-(n, c) gradient broadcast over h and w beside a channels-last one.
        let pooled = Layout::new(shape.to_vec(), vec![8, 1, 0, 0], 3);
        let walks = in_output_order(&[&cl, &pooled, &cl]);
        assert_eq!(walks[1], (vec![2, 15, 8], vec![8, 0, 1], 3));
        assert_eq!(walks[2], (vec![240], vec![1], 0));
        // A narrowed output (the stem's 3 of 4 padded channels): its pixels merge, the channel
        // run stays apart; size-1 axes go whatever their stride.
        let padded = Layout::channels_last(&[2, 4, 3, 5]).unwrap();
        let three = padded.narrow(1, 0, 3).unwrap();
        let src = Layout::channels_last(&[2, 3, 3, 5]).unwrap();
        let walks = in_output_order(&[&src, &three]);
        assert_eq!(walks[0], (vec![90], vec![1], 0));
        assert_eq!(walks[1], (vec![30, 3], vec![4, 1], 0));
        let ones = Layout::new(vec![1, 4, 1], vec![7, 1, 9], 2);
        assert_eq!(in_output_order(&[&ones]), vec![(vec![4], vec![1], 2)]);
        // A scalar has no axes; shapes that differ are left as they are.
        let scalar = Layout::contiguous(&[]);
        assert_eq!(in_output_order(&[&scalar]), vec![(vec![], vec![], 0)]);
        let other = Layout::contiguous(&[2, 8, 15]);
        assert_eq!(
            in_output_order(&[&other, &nchw])[0],
            (vec![2, 8, 15], vec![120, 15, 1], 0)
        );
    }

    #[test]
    fn one_dense_order_is_any_gapless_axis_order_shared_by_all() {
        let shape = [2, 3, 4, 5];
        let nchw = Layout::contiguous(&shape);
        let cl = Layout::channels_last(&shape).unwrap();
        let cl_at = Layout::new(shape.to_vec(), cl.strides().to_vec(), 7);
        assert!(share_one_dense_order(&[&cl, &cl_at, &cl]));
        assert!(share_one_dense_order(&[&nchw, &nchw]));
        assert!(!share_one_dense_order(&[&cl, &nchw]));
        // Gaps, a broadcast (stride 0) and another shape are not one dense order.
        let narrowed = nchw.narrow(3, 0, 4).unwrap();
        assert!(!share_one_dense_order(&[&narrowed, &narrowed]));
        let broadcast = Layout::new(shape.to_vec(), vec![0, 20, 5, 1], 0);
        assert!(!share_one_dense_order(&[&broadcast, &nchw]));
        let other = Layout::contiguous(&[2, 3, 5, 4]);
        assert!(!share_one_dense_order(&[&nchw, &other]));
        // A size-1 axis may carry any stride.
        let odd = Layout::new(vec![2, 1, 5], vec![5, 99, 1], 0);
        assert!(share_one_dense_order(&[
            &odd,
            &Layout::contiguous(&[2, 1, 5])
        ]));
    }
}

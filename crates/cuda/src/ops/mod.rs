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

#[cfg(test)]
mod tests {
    use super::*;

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

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

use crate::gpu::LaunchShape;

/// Threads per block for the grid-stride elementwise kernels.
pub const THREADS: u32 = 256;

/// Enough blocks to give every thread one element, capped: the kernels loop over the rest.
pub fn linear_shape(n: usize) -> LaunchShape {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    LaunchShape::linear(blocks as u32, THREADS)
}

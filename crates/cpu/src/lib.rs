//! The fast CPU backend: SIMD GEMM, implicit-GEMM convolution, fixed work partitions.
//!
//! An empty shell for now: issue 5 (the fast CPU backend) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

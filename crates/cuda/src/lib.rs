//! The CUDA backend (cudarc): NVRTC kernels, cuBLASLt, cuDNN, NCCL, tuned for sm_120.
//!
//! An empty shell for now: a later issue (the CUDA backend) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

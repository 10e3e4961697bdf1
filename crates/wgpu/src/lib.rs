//! The wgpu backend: WGSL kernels for Vulkan, Metal and DX12, tested on software Vulkan.
//!
//! An empty shell for now: issue 4 (the wgpu backend) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

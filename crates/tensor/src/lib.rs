//! Dtypes, shapes, Tensor, Device, the Backend trait, autograd and the f64 reference implementation.
//!
//! An empty shell for now: issue 3 (tensor and autograd core) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

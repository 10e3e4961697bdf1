//! Proptest strategies, gradcheck and the one conformance suite every backend runs.
//!
//! An empty shell for now: issue 3 (tensor and autograd core) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

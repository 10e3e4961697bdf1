//! Sampler and crossbeam pipeline: decode and augment on every core, prefetch into pooled host buffers.
//!
//! An empty shell for now: issue 6 (the prefetch loader) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

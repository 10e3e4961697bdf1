//! Mixed precision: autocast policy, GradScaler, f32 master weights.
//!
//! An empty shell for now: issue 7 (nn, AMP, trainer) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

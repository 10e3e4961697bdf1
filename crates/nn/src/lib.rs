//! Modules, initialisation, the ResNet family, optimizers and LR schedules.
//!
//! An empty shell for now: issue 7 (nn, AMP, trainer) fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

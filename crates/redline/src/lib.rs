//! The redline facade: re-exports and the device registry (Device::best()).
//!
//! An empty shell for now: issues 4, 5 and 7 fills it. The crate exists so the workspace layout of
//! `DESIGN.md` (and its dependency rules) is in place from the first commit.

//! Workspace-level end-to-end tests live in `tests/tests/`: they drive several crates together
//! on real files (JPEGs, PNGs, shards) the way a user's pipeline does.

//! Testing every backend against the reference.
//!
//! * [`strategies`] — proptest strategies for op cases: shapes with size-1 and odd axes,
//!   non-contiguous and channels-last views, broadcasting pairs, values kept away from kinks
//!   (relu at 0, ties of max) and outside domains (log of negatives).
//! * [`gradcheck`](mod@gradcheck) — the reference's backward against central finite differences in f64.
//! * [`conformance`] — the one suite any backend runs with one call: every declared
//!   (op, dtype) pair forward and backward against the reference with dtype-aware tolerances,
//!   undeclared pairs must be refused, invalid inputs must be errors. It prints the matrix.
//! * [`broken`] — a deliberately broken backend, to show the suite can fail.
//! * [`training`] — a tiny CNN and one AMP training step of it, for comparing backends.
//! * [`timing`] — the device-clock contract (timestamps in queue order around the work).
//! * [`events`] — the event contract (downloads ordered after an event, not after everything).
//! * [`graphs`] — the capture contract (a captured training step replays like eager steps).
//! * [`precision`] — digits a backend must keep where statistics cancel (batch norm far from 0).

pub mod broken;
mod cancellation;
pub mod case;
pub mod conformance;
pub mod events;
pub mod gradcheck;
pub mod graphs;
mod non_finite;
pub mod precision;
pub mod strategies;
pub mod timing;
pub mod training;

pub use case::{Case, Input, ViewKind};
pub use conformance::{run_conformance, run_conformance_on, Report, SuiteConfig};
pub use gradcheck::{gradcheck, gradcheck_fn};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

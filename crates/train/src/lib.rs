//! The trainer: one training step as five timed phases (data wait, host-to-device, forward,
//! backward, optimizer) with autocast and GradScaler when the precision asks for them;
//! evaluation with top-1/top-5; the per-step report as JSON, an SVG and a Chrome trace; the
//! op profile behind a report's `ops` section and the doctor that reads a report.

mod chart;
pub mod checkpoint;
pub mod doctor;
mod error;
mod metrics;
mod precision;
pub mod profile;
mod recipe;
mod report;
mod timing;
mod trainer;

pub use chart::svg;
pub use error::TrainError;
pub use metrics::{top_k_correct, Evaluation};
pub use precision::Precision;
pub use recipe::progressive_res;
pub use report::{chrome_trace, Summary};
pub use timing::{percentile, PendingTimes, Phase, PhaseClock, StepTimes};
pub use trainer::{
    GraphStats, Inputs, Step, TrainConfig, Trainer, GRAPH_WARMUP_STEPS, IMAGENET_MEAN,
    IMAGENET_STD, TIMES_LAG,
};

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

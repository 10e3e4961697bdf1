use redline_loader::{LoaderError, OrderError};
use redline_tensor::TensorError;

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error(transparent)]
    Loader(#[from] LoaderError),
    /// Another rank failed, or the group could not form (data-parallel training).
    #[error(transparent)]
    Dist(#[from] redline_dist::DistError),
    /// A setting that cannot work (named, with the value given).
    #[error("training configuration: {0}")]
    Config(String),
    /// A checkpoint that cannot be written or does not fit (path and reason).
    #[error("checkpoint {0}")]
    Checkpoint(String),
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error("the loader ended before the step (an empty epoch?)")]
    NoData,
}

//! What can go wrong when ranks work together: every error names the rank, the variable or the
//! address it is about, so a user of a 64-process job knows where to look.

use std::time::Duration;

/// A failure of the launch environment, the rendezvous or a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A launcher variable (RANK, WORLD_SIZE, MASTER_ADDR, …) is missing or malformed.
    #[error("launch environment: {var}: {message}")]
    Env { var: &'static str, message: String },
    /// Another rank failed: it exited, closed its connection, sent nothing within the timeout
    /// or reported an error of its own.
    #[error("rank {rank} failed during {during}: {message}")]
    Peer {
        rank: usize,
        during: String,
        message: String,
    },
    /// The rendezvous did not complete within its timeout.
    #[error("rendezvous at {address} timed out after {timeout:?}: {message}")]
    Rendezvous {
        address: String,
        timeout: Duration,
        message: String,
    },
    /// The other side spoke something other than the protocol expected.
    #[error("protocol: {0}")]
    Protocol(String),
    /// A network error that no rank can be blamed for (binding a port, resolving an address).
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The arguments do not fit together (tensors that differ between calls, a bad root, …).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Tensor(#[from] redline_tensor::TensorError),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;

impl DistError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

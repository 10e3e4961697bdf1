//! Forming the group from the launch environment: find the store, then connect the ranks.
//!
//! Without torchrun's agent, rank 0 serves the store on MASTER_PORT and the others connect to
//! it (retrying until it is up, within the timeout). Under torchrun's elastic agent a TCPStore
//! already listens there (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank is a client of it.
//! Keys are scoped by the restart count (`TORCHELASTIC_RESTART_COUNT`), so a restarted job
//! never reads a failed attempt's entries. A rank 0 that never comes is named as such: the
//! others find no store it serves, or (under the agent) no address it publishes.

use std::sync::Arc;
use std::time::Duration;

use crate::collective::{Collective, SingleProcess};
use crate::env::Launch;
use crate::error::{DistError, Result};
use crate::store::{StoreClient, StoreServer};
use crate::tcp::TcpCollective;

/// How long a rank waits for the others, unless `REDLINE_DIST_TIMEOUT` (seconds) says otherwise:
/// long enough for a slow rank's checkpoint or a first cuDNN search, short enough that a job
/// with a dead rank ends instead of burning its allocation.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The group's timeout: `REDLINE_DIST_TIMEOUT` in seconds, or [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var("REDLINE_DIST_TIMEOUT") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(DistError::Env {
                var: "REDLINE_DIST_TIMEOUT",
                message: format!("{v:?} is not a positive number of seconds"),
            }),
        },
    }
}

/// The CPU collective for the job `launch` describes ([`SingleProcess`] for a world of one).
pub fn connect(launch: &Launch, timeout: Duration) -> Result<Arc<dyn Collective>> {
    if launch.world == 1 {
        return Ok(Arc::new(SingleProcess));
    }
    let address = format!("{}:{}", launch.master_addr, launch.master_port);
    // Rank 0 serves the store unless torchrun's agent does; the group keeps it.
    let server = match launch.rank == 0 && !launch.agent_store {
        true => Some(StoreServer::bind(&address)?),
        false => None,
    };
    // Without torchrun's agent the store is rank 0's: to the others, no store at an address
    // that resolves, or a store that closes before rank 0 published its own address, is rank
    // 0's absence (an address that does not resolve is nobody's).
    let rank_0_serves = !launch.agent_store && launch.rank != 0;
    let resolves = || {
        use std::net::ToSocketAddrs;
        address
            .to_socket_addrs()
            .is_ok_and(|mut a| a.next().is_some())
    };
    let absent = |what: String| DistError::Peer {
        rank: 0,
        during: "the rendezvous".into(),
        message: format!("it serves the store at {address}, and {what}"),
    };
    let mut store = StoreClient::connect(&address, timeout).map_err(|e| match e {
        DistError::Rendezvous { message, .. } if rank_0_serves && resolves() => absent(format!(
            "no store answered there within {timeout:?} ({message})"
        )),
        other => other,
    })?;
    let prefix = format!("redline/attempt_{}/", launch.restart);
    let collective =
        TcpCollective::connect(&mut store, &prefix, launch.rank, launch.world, timeout).map_err(
            |e| match e {
                DistError::Io { what, source } if rank_0_serves => absent(format!(
                    "the store closed before the group formed ({what}: {source})"
                )),
                other => other,
            },
        )?;
    Ok(Arc::new(collective.keeping(server)))
}

/// The collective for training on `device`: NCCL over the CPU collective's rendezvous when it
/// is a CUDA device (and the `nccl` feature is on), the CPU collective otherwise;
/// [`SingleProcess`] for a world of one.
pub fn connect_device(
    launch: &Launch,
    device: &redline_tensor::Device,
    timeout: Duration,
) -> Result<Arc<dyn Collective>> {
    let host = connect(launch, timeout)?;
    if launch.world == 1 || !device.name().starts_with("cuda:") {
        return Ok(host);
    }
    #[cfg(feature = "nccl")]
    return Ok(Arc::new(crate::nccl::NcclCollective::new(
        host, device, timeout,
    )?));
    #[cfg(not(feature = "nccl"))]
    Ok(host)
}

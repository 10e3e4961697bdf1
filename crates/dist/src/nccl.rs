//! [`NcclCollective`]: the [`Collective`] for CUDA devices.
//!
//! NCCL moves the data, on a stream of its own; a host collective (the job's TCP group) does
//! what NCCL cannot: it carries rank 0's NCCL unique id to the others (the rendezvous, within
//! the group's timeout), runs barriers, and names a rank that never arrives. A bucket's
//! all-reduce waits on the device for the event its gradients are final at and hands back the
//! event its averages are complete at ([`Collective::all_reduce_after`]): the compute stream
//! goes on with backward meanwhile, and the host waits for neither. A peer that dies
//! mid-collective trips the communicator's watchdog after the timeout (NCCL itself would wait
//! forever): it aborts the communicator and every later call fails with the reason.
//!
//! Tensors on other devices (a host-side metric, say) go through the host collective instead.
//!
//! Capturable: a data-parallel step — its buffer broadcast, its gradient buckets issued by the
//! backward thread on NCCL's stream forked from the capture by their events, joined back
//! by the optimizer's wait — is recorded into the step's CUDA graph. A replay runs them out of
//! this collective's sight, so the trainer asks [`Collective::alive`] before each and hands
//! the point after it to [`Collective::watch`]: the watchdog holds it to the timeout.

use std::sync::Arc;
use std::time::Duration;

use redline_cuda::nccl::{self, Communicator, ReduceOp, UniqueId};
use redline_cuda::{cuda_buffer, GpuEvent};
use redline_tensor::{DType, Device, Event, Tensor};

use crate::collective::{check_dense, check_root, Collective, Reduce};
use crate::error::{DistError, Result};

/// One rank's NCCL group member on one CUDA device, beside the job's host collective.
pub struct NcclCollective {
    host: Arc<dyn Collective>,
    comm: Communicator,
    device: Device,
    timeout: Duration,
}

impl NcclCollective {
    /// Joins the NCCL group of the ranks `host` connects: rank 0 makes the unique id and
    /// broadcasts it over `host`, then every rank creates its communicator on `device`
    /// (collective: every rank calls it). An error names what is missing — the library, a CUDA
    /// device — on the rank that lacks it.
    pub fn new(host: Arc<dyn Collective>, device: &Device, timeout: Duration) -> Result<Self> {
        let probe = Tensor::zeros(&[1], DType::F32, device)?;
        let gpu = cuda_buffer(&probe)
            .map(|b| b.gpu().clone())
            .ok_or_else(|| {
                DistError::Usage(format!(
                    "NCCL needs a CUDA device; {} is not one (the CPU collective serves the rest)",
                    device.name()
                ))
            })?;
        let id = Self::unique_id(&*host)?;
        let comm = gpu.nccl(&id, host.rank(), host.world(), timeout)?;
        Ok(Self {
            host,
            comm,
            device: device.clone(),
            timeout,
        })
    }

    /// NCCL's rendezvous: rank 0 makes a unique id and every rank of `host` receives it (a
    /// 128-byte host tensor broadcast over the host collective, within its timeout). Collective.
    pub fn unique_id(host: &dyn Collective) -> Result<UniqueId> {
        let library = nccl::library().map_err(DistError::Usage)?;
        let id = match host.rank() {
            0 => library.unique_id().map_err(DistError::Usage)?,
            _ => UniqueId([0; 128]),
        };
        let carrier = Tensor::from_slice(&id.0, &[id.0.len()], &Device::reference())?;
        host.broadcast(std::slice::from_ref(&carrier), 0)?;
        let mut shared = UniqueId([0; 128]);
        shared.0.copy_from_slice(&carrier.to_vec::<u8>()?);
        Ok(shared)
    }

    /// The library this collective runs on: "NCCL 2.32.6 (…/libnccl.so.2)".
    pub fn describe() -> String {
        match nccl::library() {
            Ok(n) => format!("NCCL {} ({})", n.version, n.path.display()),
            Err(e) => e,
        }
    }

    /// NCCL's view of `tensors`, or `None` when one is not on this collective's device (then
    /// the host collective takes them).
    fn buffers(&self, tensors: &[Tensor]) -> Result<Option<Vec<nccl::Buffer>>> {
        let mut buffers = Vec::with_capacity(tensors.len());
        for t in tensors {
            check_dense(t)?;
            match cuda_buffer(t) {
                Some(b) if *t.device() == self.device => buffers.push(nccl::Buffer {
                    ptr: b.ptr,
                    len: t.numel(),
                    dtype: t.dtype(),
                }),
                _ => return Ok(None),
            }
        }
        Ok(Some(buffers))
    }

    /// The device's event behind `event` (`None`: already reached).
    fn gpu_event<'e>(&self, event: &'e Event) -> Result<Option<&'e GpuEvent>> {
        if event.is_reached() {
            return Ok(None);
        }
        event
            .downcast::<GpuEvent>(self.device.backend().id())
            .map(Some)
            .ok_or_else(|| {
                DistError::Usage(format!(
                    "an event of another device given to the NCCL collective on {}",
                    self.device.name()
                ))
            })
    }

    fn event(&self, done: GpuEvent) -> Event {
        Event::new(self.device.backend().id(), done)
    }

    fn nccl_error(&self, what: &str, message: String) -> DistError {
        DistError::Usage(format!(
            "{what} on {} (rank {} of {}): {message}",
            self.device.name(),
            self.rank(),
            self.world()
        ))
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world(&self) -> usize {
        self.host.world()
    }

    fn all_reduce(&self, tensors: &[Tensor], op: Reduce) -> Result<()> {
        if self.buffers(tensors)?.is_none() {
            return self.host.all_reduce(tensors, op);
        }
        let ready = self.device.record_event()?;
        let done = self.all_reduce_after(tensors, op, &ready)?;
        Ok(self.device.wait_event(&done)?)
    }

    fn all_reduce_after(&self, tensors: &[Tensor], op: Reduce, ready: &Event) -> Result<Event> {
        let Some(buffers) = self.buffers(tensors)? else {
            self.host.all_reduce(tensors, op)?;
            return crate::collective::after_writes(tensors);
        };
        let op = match op {
            Reduce::Sum => ReduceOp::Sum,
            Reduce::Max => ReduceOp::Max,
            Reduce::Avg => {
                if let Some(t) = tensors.iter().find(|t| !t.dtype().is_float()) {
                    return Err(DistError::Usage(format!(
                        "averaging a {} tensor: NCCL averages floating-point tensors only",
                        t.dtype()
                    )));
                }
                ReduceOp::Avg
            }
        };
        let done = self
            .comm
            .all_reduce(&buffers, op, self.gpu_event(ready)?)
            .map_err(|e| self.nccl_error("all-reduce", e))?;
        Ok(self.event(done))
    }

    fn broadcast(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        check_root(root, self.world())?;
        let Some(buffers) = self.buffers(tensors)? else {
            return self.host.broadcast(tensors, root);
        };
        let ready = self.device.record_event()?;
        let done = self
            .comm
            .broadcast(&buffers, root, self.gpu_event(&ready)?)
            .map_err(|e| self.nccl_error("broadcast", e))?;
        Ok(self.device.wait_event(&self.event(done))?)
    }

    fn capturable(&self) -> bool {
        true
    }

    fn alive(&self) -> Result<()> {
        (self.comm.alive()).map_err(|e| self.nccl_error("NCCL", e))
    }

    fn watch(&self, until: &Event) -> Result<()> {
        let Some(event) = self.gpu_event(until)? else {
            return self.alive();
        };
        (self.comm.watch(event, "collectives of a replayed graph"))
            .map_err(|e| self.nccl_error("watching a replay", e))
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn split(&self) -> Result<Arc<dyn Collective>> {
        let host = self.host.split()?;
        Ok(Arc::new(Self::new(host, &self.device, self.timeout)?))
    }
}

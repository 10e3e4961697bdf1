//! Gradient all-reduce in buckets, started during backward (PyTorch DDP's reducer).
//!
//! Parameters are grouped into buckets of about `bucket_bytes` in reverse registration order —
//! roughly the order backward produces their gradients, since the last layer's come first. A
//! gradient-ready hook on every parameter counts down its bucket; when a bucket is complete
//! (and every bucket before it has been started, so all ranks issue the same collectives in the
//! same order) its average across ranks starts while backward goes on with the layers below. A
//! bucket leaves with an event recorded on the device when it completes, so the collective
//! waits for those gradients only, not for the backward ops enqueued since
//! ([`Collective::all_reduce_after`]). A host collective downloads after that event and blocks
//! until the peers answer, so its buckets go to a communication thread; a device collective
//! (NCCL: [`Collective::capturable`]) only enqueues onto its own stream, so the backward thread
//! issues its buckets itself — with synchronised batch norm's sums, which share the group, one
//! thread then issues a rank's every collective in the order autograd runs, the same on every
//! rank, as NCCL requires of collectives that share a device. [`DataParallel::synchronize`]
//! waits for the buckets to be issued and makes the device wait for their events: the
//! optimizer's kernels wait on the device for the reduced gradients, the host for nothing
//! more.
//!
//! Mixed precision needs nothing more: the GradScaler's found-inf check reads gradients that
//! are already the same on every rank (an inf or NaN on one rank reaches all of them through
//! the average), so every rank skips the same steps.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;

use redline_tensor::{Event, GradHook, Tensor};

use crate::collective::{Collective, Reduce};
use crate::error::{DistError, Result};

/// PyTorch DDP's default bucket size (`bucket_cap_mb=25`).
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// One bucket's all-reduce as it was started: which bucket, and how many parameters of the
/// step still had no gradient then (more than zero: it overlapped the rest of backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLaunch {
    pub bucket: usize,
    pub grads_pending: usize,
}

/// Keeps the gradients of one model's parameters the same on every rank.
pub struct DataParallel {
    shared: Arc<Shared>,
    /// The communication thread's queue (a host collective's buckets; `None`: issued by the
    /// backward thread).
    jobs: Option<Sender<(usize, Event)>>,
    worker: Option<JoinHandle<()>>,
}

struct Shared {
    collective: Arc<dyn Collective>,
    /// Parameters with their names (for errors), in registration order.
    params: Vec<(String, Tensor)>,
    /// Parameter indices of each bucket, bucket 0 first to be reduced.
    buckets: Vec<Vec<usize>>,
    /// Each parameter's bucket.
    bucket_of: Vec<usize>,
    state: Mutex<StepState>,
    changed: Condvar,
}

#[derive(Default)]
struct StepState {
    /// Whether this backward's gradients are reduced (off for the inner steps of gradient
    /// accumulation).
    sync: bool,
    ready: Vec<bool>,
    /// Parameters of each bucket still without a gradient.
    pending: Vec<usize>,
    /// The next bucket to start.
    next: usize,
    /// Buckets whose all-reduce has finished, or failed.
    finished: usize,
    failed: usize,
    launches: Vec<BucketLaunch>,
    last_launches: Vec<BucketLaunch>,
    /// Where each finished bucket's results are complete on the device.
    reduced: Vec<Event>,
    /// The first failure of this step (a collective's, or a hook misused).
    error: Option<DistError>,
}

impl StepState {
    fn reset(&mut self, buckets: &[Vec<usize>], params: usize) {
        self.ready = vec![false; params];
        self.pending = buckets.iter().map(Vec::len).collect();
        self.next = 0;
        self.finished = 0;
        self.failed = 0;
        self.reduced.clear();
        self.last_launches = std::mem::take(&mut self.launches);
    }
}

impl DataParallel {
    /// Broadcasts `params` and `buffers` from rank 0 (every rank starts from its weights),
    /// splits the parameters into buckets of at most `bucket_bytes` (a larger parameter gets a
    /// bucket of its own) and hooks their gradients. `params` are in the model's registration
    /// order, named for error messages.
    pub fn new(
        collective: Arc<dyn Collective>,
        params: Vec<(String, Tensor)>,
        buffers: &[Tensor],
        bucket_bytes: usize,
    ) -> Result<Self> {
        if bucket_bytes == 0 {
            return Err(DistError::Usage("a bucket size of 0 bytes".into()));
        }
        let tensors: Vec<Tensor> = (params.iter().map(|(_, t)| t.clone()))
            .chain(buffers.iter().cloned())
            .collect();
        collective.broadcast(&tensors, 0)?;
        let sizes: Vec<usize> = (params.iter())
            .map(|(_, t)| t.numel() * t.dtype().size())
            .collect();
        let buckets = buckets(&sizes, bucket_bytes);
        let mut state = StepState {
            sync: true,
            ..Default::default()
        };
        state.reset(&buckets, params.len());
        let map = bucket_map(&buckets);
        let bucket_of = (0..params.len()).map(|i| map[&i]).collect();
        let shared = Arc::new(Shared {
            collective,
            params,
            buckets,
            bucket_of,
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        let mut dp = Self {
            shared,
            jobs: None,
            worker: None,
        };
        if !dp.shared.collective.capturable() {
            let (jobs, queue) = channel::<(usize, Event)>();
            let worker_shared = dp.shared.clone();
            let worker = std::thread::Builder::new()
                .name("redline-allreduce".into())
                .spawn(move || {
                    for (bucket, ready) in queue {
                        let result = worker_shared.issue(bucket, &ready);
                        worker_shared.record(&mut worker_shared.lock(), result);
                    }
                })
                .map_err(|e| DistError::io("starting the all-reduce thread", e))?;
            dp.jobs = Some(jobs);
            dp.worker = Some(worker);
        }
        dp.hook_all()?;
        Ok(dp)
    }

    fn hook_all(&self) -> Result<()> {
        let jobs = self.jobs.clone();
        for (index, (_, param)) in self.shared.params.iter().enumerate() {
            let shared: Weak<Shared> = Arc::downgrade(&self.shared);
            let jobs = Mutex::new(jobs.clone());
            let hook: GradHook = Arc::new(move |_: &Tensor| {
                if let Some(shared) = shared.upgrade() {
                    let jobs = jobs.lock().unwrap_or_else(|p| p.into_inner());
                    shared.gradient_ready(index, jobs.as_ref());
                }
            });
            param.set_grad_hook(Some(hook))?;
        }
        Ok(())
    }

    /// The parameter indices of each bucket, in the order they are reduced.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.shared.buckets
    }

    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.shared.collective
    }

    /// Whether the next backward passes' gradients are reduced. Off, gradients accumulate
    /// locally (the inner steps of gradient accumulation, DDP's `no_sync`); the first backward
    /// with it on again reduces the accumulated totals.
    pub fn set_sync(&self, sync: bool) {
        self.shared.lock().sync = sync;
    }

    /// Runs `f` (forward and backward of an inner accumulation step) without reducing.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        let previous = std::mem::replace(&mut self.shared.lock().sync, false);
        let result = f();
        self.shared.lock().sync = previous;
        result
    }

    /// Waits until every bucket of this step is averaged across ranks (after backward, before
    /// the optimizer). Every parameter must have received a gradient (as DDP requires without
    /// `find_unused_parameters`); one that did not is named. Does nothing when sync is off.
    pub fn synchronize(&self) -> Result<()> {
        let shared = &self.shared;
        let mut state = shared.lock();
        if !state.sync {
            return Ok(());
        }
        let missing: Vec<&str> = (state.ready.iter().enumerate())
            .filter(|(_, ready)| !**ready)
            .map(|(i, _)| shared.params[i].0.as_str())
            .collect();
        if !missing.is_empty() && state.error.is_none() {
            let shown = missing
                .iter()
                .take(5)
                .copied()
                .collect::<Vec<_>>()
                .join(", ");
            let error = DistError::Usage(format!(
                "{} of {} parameters got no gradient in this step ({shown}{}): data \
                 parallelism reduces every parameter every step, so each must be used",
                missing.len(),
                shared.params.len(),
                if missing.len() > 5 { ", …" } else { "" }
            ));
            state.error = Some(error);
        }
        // Started buckets are waited for even after an error: each ends (a collective fails
        // within the group's timeout), so none completes into the next step's count.
        while state.finished + state.failed < state.next {
            state = shared.wait(state);
        }
        if let Some((_, param)) = shared.params.first() {
            let waited: std::result::Result<(), _> =
                (state.reduced.iter()).try_for_each(|event| param.device().wait_event(event));
            if let Err(e) = waited {
                state.error.get_or_insert(e.into());
            }
        }
        let error = state.error.take();
        state.reset(&shared.buckets, shared.params.len());
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// How the last synchronized step's buckets were started.
    pub fn last_launches(&self) -> Vec<BucketLaunch> {
        self.shared.lock().last_launches.clone()
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        for (_, p) in &self.shared.params {
            let _ = p.set_grad_hook(None);
        }
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, StepState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(
        &self,
        guard: std::sync::MutexGuard<'a, StepState>,
    ) -> std::sync::MutexGuard<'a, StepState> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    /// Parameter `index` has its gradient: start every bucket that is now complete and next in
    /// line, on the communication thread of `jobs`, or here (`None`).
    fn gradient_ready(&self, index: usize, jobs: Option<&Sender<(usize, Event)>>) {
        let mut state = self.lock();
        if !state.sync {
            return;
        }
        if state.ready[index] {
            state.error.get_or_insert(DistError::Usage(format!(
                "{}: a second gradient in one step (two backward passes before synchronize? \
                 use no_sync for the inner steps of gradient accumulation)",
                self.params[index].0
            )));
            return;
        }
        state.ready[index] = true;
        let bucket = self.bucket_of[index];
        state.pending[bucket] -= 1;
        // The point after this gradient's ops: every bucket completed now is final there.
        let mut ready: Option<Event> = None;
        while state.next < self.buckets.len() && state.pending[state.next] == 0 {
            let bucket = state.next;
            let grads_pending = state.ready.iter().filter(|r| !**r).count();
            state.launches.push(BucketLaunch {
                bucket,
                grads_pending,
            });
            state.next += 1;
            let event = match &ready {
                Some(e) => e.clone(),
                None => match self.params[index].1.device().record_event() {
                    Ok(e) => ready.insert(e).clone(),
                    Err(e) => {
                        state.error.get_or_insert(e.into());
                        Event::reached()
                    }
                },
            };
            match jobs {
                // The enqueue returns at once; the state's lock keeps a second hook out.
                None => {
                    let result = self.issue(bucket, &event);
                    self.record(&mut state, result);
                }
                Some(jobs) => {
                    if jobs.send((bucket, event)).is_err() {
                        // Counted as failed, or synchronize would wait for it.
                        let stopped = DistError::Usage("the all-reduce thread has stopped".into());
                        self.record(&mut state, Err(stopped));
                    }
                }
            }
        }
    }

    /// Starts averaging one bucket's gradients (final at `ready`) across ranks; the event its
    /// averages are complete at.
    fn issue(&self, bucket: usize, ready: &Event) -> Result<Event> {
        let grads: Option<Vec<Tensor>> = (self.buckets[bucket].iter())
            .map(|&i| self.params[i].1.grad())
            .collect();
        match grads {
            Some(grads) => self.collective.all_reduce_after(&grads, Reduce::Avg, ready),
            None => Err(DistError::Usage(format!(
                "bucket {bucket} was started with a gradient missing"
            ))),
        }
    }

    /// Counts a started bucket as finished or failed.
    fn record(&self, state: &mut StepState, result: Result<Event>) {
        match result {
            Ok(done) => {
                state.finished += 1;
                state.reduced.push(done);
            }
            Err(e) => {
                state.failed += 1;
                state.error.get_or_insert(e);
            }
        }
        self.changed.notify_all();
    }
}

/// Splits parameters of `sizes` bytes (registration order) into buckets of at most `cap` bytes,
/// walking them last to first.
pub fn buckets(sizes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0;
    for index in (0..sizes.len()).rev() {
        let size = sizes[index];
        match buckets.last_mut() {
            Some(bucket) if filled + size <= cap => {
                bucket.push(index);
                filled += size;
            }
            _ => {
                buckets.push(vec![index]);
                filled = size;
            }
        }
    }
    buckets
}

/// The parameter index → bucket map (for tests and reports).
pub fn bucket_map(buckets: &[Vec<usize>]) -> HashMap<usize, usize> {
    (buckets.iter().enumerate())
        .flat_map(|(b, params)| params.iter().map(move |&p| (p, b)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_from_the_last_parameter_up_to_the_cap() {
        // 10 + 20 fit 32; 8 would not; a 100-byte parameter gets a bucket alone.
        assert_eq!(
            buckets(&[4, 100, 8, 20, 10], 32),
            vec![vec![4, 3], vec![2], vec![1], vec![0]]
        );
        assert_eq!(buckets(&[1, 1, 1], 1 << 20), vec![vec![2, 1, 0]]);
        assert!(buckets(&[], 8).is_empty());
        let map = bucket_map(&buckets(&[4, 100, 8, 20, 10], 32));
        assert_eq!((map[&4], map[&3], map[&0]), (0, 0, 3));
    }
}

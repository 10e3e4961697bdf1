//! The training step and the evaluation pass.

use redline_amp::{autocast, for_f32, GradScaler};
use std::path::Path;
use std::sync::Arc;

use redline_dist::{Collective, DataParallel, Reduce as ReduceOp, SyncBatchStats};

use redline_loader::{Batch, LoaderError, Mode, Position};
use redline_nn::{
    clip_grad_norm, named_parameters, state_dict, zero_grad, Kind, Module, Optimizer, Schedule,
};
use redline_tensor::{no_grad, BinaryOp, DType, Device, Event, Graph, HostBytes, Op, Tensor};

use crate::checkpoint::{self, Progress};
use crate::metrics::{top_k_correct, Evaluation};
use crate::precision::Precision;
use crate::timing::{PendingTimes, Phase, PhaseClock, StepTimes};
use crate::{Result, TrainError};

/// torchvision's normalisation constants (ImageNet RGB mean and standard deviation).
pub const IMAGENET_MEAN: [f64; 3] = [0.485, 0.456, 0.406];
pub const IMAGENET_STD: [f64; 3] = [0.229, 0.224, 0.225];

/// The recipe's knobs the step itself needs.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub precision: Precision,
    /// Label smoothing ε of the training loss (0.1 in the usual ImageNet recipes).
    pub label_smoothing: f64,
    /// Clip gradients to this global L2 norm (after unscaling).
    pub clip_norm: Option<f64>,
    /// The schedule's base (peak) learning rate.
    pub base_lr: f64,
    pub schedule: Schedule,
}

/// A batch on the device.
pub struct Inputs {
    /// Normalised images, `[N, 3, H, W]` (channels-last) in the compute dtype.
    pub x: Tensor,
    /// i64 class labels `[N]`: the trainer's static label buffer, overwritten by its next
    /// upload of a batch of the same size (as a CUDA graph's static inputs are).
    pub y: Tensor,
    /// `Some(-1)` when the loader skipped a sample (its label is -1): left out of the loss.
    pub ignore_index: Option<i64>,
}

/// How many steps late a trainer reads the phase times of a step on a device with a clock:
/// reading them waits for the device to reach that step's end, and two steps back it already
/// has — so the host keeps issuing work and never drains the queue, yet stays at most this many
/// steps ahead of the device.
pub const TIMES_LAG: usize = 2;

/// What one training step did. `loss` stays on the device: reading it waits for the step.
pub struct Step {
    /// Phase times that became known during this step: this step's own on a synchronous
    /// device (timed by the host); on a device with a clock, those of the step
    /// [`TIMES_LAG`] back (none for the first ones) — [`Trainer::take_times`] reads the rest.
    pub times: Option<StepTimes>,
    pub loss: Tensor,
    pub lr: f64,
    pub images: usize,
    /// Host time this call spent waiting for the device: reading the phase times of the step
    /// [`TIMES_LAG`] back, which keeps the host at most that far ahead. In a device-bound run
    /// that is most of the call; the rest is issuing the step.
    pub device_wait: std::time::Duration,
}

/// A model, its optimizer and (for f16) a GradScaler, stepping on one device.
pub struct Trainer {
    model: Box<dyn Module>,
    optimizer: Box<dyn Optimizer>,
    scaler: Option<GradScaler>,
    config: TrainConfig,
    device: Device,
    params: Vec<Tensor>,
    steps: usize,
    /// Where the next training batch starts (after the last one `train_step` took).
    position: Position,
    /// Steps whose phase times are still on the device, oldest first.
    pending_times: std::collections::VecDeque<PendingTimes>,
    /// The device buffers every upload of a batch of this size writes into.
    staged: std::sync::Mutex<Vec<Staged>>,
    /// This trainer as one rank of a data-parallel job.
    data_parallel: Option<Ranked>,
    /// Replaying the step as a captured graph ([`Trainer::with_graph`]).
    graph: Graphing,
    graph_stats: GraphStats,
    /// Loader batches per optimizer step ([`Trainer::with_accumulation`]).
    accumulate: usize,
}

/// Eager steps before the step is captured: libraries pick algorithms and size workspaces, and
/// optimizer state exists, outside the graph.
pub const GRAPH_WARMUP_STEPS: usize = 2;

/// Where graph replay stands.
enum Graphing {
    Off,
    /// Capture once this many more eager steps have run (the warm-up).
    Waiting(usize),
    Active {
        graph: Graph,
        /// The captured loss: each replay rewrites it.
        loss: Tensor,
        /// The staged images' shape the graph reads.
        shape: Vec<usize>,
    },
    /// Not capturable here; every step eager.
    Refused,
}

/// What graph replay did over a trainer's life (the bench report's `graph`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// [`Trainer::with_graph`] was asked for.
    pub requested: bool,
    /// Operations per replay (kernels, library calls, copies); 0 before the capture.
    pub nodes: usize,
    /// Steps run by replaying the graph (the captured step's own first run included).
    pub replays: u64,
    /// Captures: one, plus one per change of resolution (the old graph and its memory are
    /// dropped, a new one captured after a warm-up at the new size).
    pub captures: u64,
    /// Steps run eagerly after the warm-up, and why (no capture on this device, a batch of
    /// another shape than the captured one, data parallelism over a host collective).
    pub eager_steps: u64,
    pub eager_reason: Option<String>,
}

impl GraphStats {
    /// The reports' `graph`, bench and train alike: whether the steps replayed a captured
    /// graph (`active`, which `cargo xtask doctor` reads with `nodes`), its size, and the
    /// eager steps with their reason (the eager fallback, reported as such).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "requested": self.requested,
            "active": self.replays > 0,
            "nodes": self.nodes,
            "replays": self.replays,
            "captures": self.captures,
            "eager_steps_after_warmup": self.eager_steps,
            "eager_reason": self.eager_reason,
            "phases": "under a graph the forward phase holds the whole replayed step (forward, \
                       backward, optimizer)",
        })
    }
}

/// What a rank of a data-parallel job adds to a trainer.
struct Ranked {
    reducer: DataParallel,
    /// The model's floating-point buffers (batch norm's running statistics): rank 0's are
    /// broadcast before every training forward, as DDP's `broadcast_buffers` does, so every
    /// rank evaluates and checkpoints the same model.
    buffers: Vec<Tensor>,
    /// Every group whose collectives a step runs (the reducer's, and synchronised batch
    /// norm's where it has one of its own): a replayed graph runs them out of their sight, so
    /// each is asked whether it is alive before a replay and watches the point after it.
    groups: Vec<Arc<dyn Collective>>,
}

impl Ranked {
    /// Whether every group's collectives can be captured into the step's graph.
    fn capturable(&self) -> bool {
        self.groups.iter().all(|g| g.capturable())
    }

    /// Before a replay: every group still whole.
    fn alive(&self) -> Result<()> {
        Ok(self.groups.iter().try_for_each(|g| g.alive())?)
    }

    /// After a replay (finished at `until`): each group holds it to its timeout.
    fn watch(&self, until: &Event) -> Result<()> {
        Ok(self.groups.iter().try_for_each(|g| g.watch(until))?)
    }
}

/// How one step runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GraphTurn {
    Eager,
    Capture,
    Replay,
}

/// A batch in the static buffers, before the input op.
#[derive(Clone)]
struct StagedBatch {
    images: Tensor,
    y: Tensor,
    ignore_index: Option<i64>,
}

impl StagedBatch {
    /// The input op: u8 NHWC → normalised, in the precision's compute dtype.
    fn normalized(self, precision: Precision) -> Result<Inputs> {
        let dtype = precision.autocast().unwrap_or(DType::F32);
        let x = Tensor::normalize_input(&self.images, &IMAGENET_MEAN, &IMAGENET_STD, dtype)?;
        Ok(Inputs {
            x,
            y: self.y,
            ignore_index: self.ignore_index,
        })
    }
}

/// A batch's raw pixels (u8 NHWC) and labels (i64) in device buffers that stay put: each upload
/// of the same shape overwrites them in place, so a captured step finds its inputs at the
/// addresses it was captured with; a batch of another shape (the last, partial one) has
/// buffers of its own.
struct Staged {
    images: Tensor,
    labels: Tensor,
    /// The point after the last op that read `images` (the input op): the next batch's copy
    /// waits for it alone, so it can run while the rest of that step computes.
    read: Option<Event>,
}

impl Trainer {
    /// The model's parameters must be the ones `optimizer` updates, on `device`.
    pub fn new(
        model: Box<dyn Module>,
        optimizer: Box<dyn Optimizer>,
        config: TrainConfig,
        device: Device,
    ) -> Result<Self> {
        let params: Vec<Tensor> = optimizer
            .groups()
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect();
        if params.is_empty() {
            return Err(TrainError::Config("the optimizer has no parameters".into()));
        }
        let scaler = if config.precision.needs_scaler() {
            Some(GradScaler::new(&device, DType::F32)?)
        } else {
            None
        };
        model.set_training(true);
        Ok(Self {
            model,
            optimizer,
            scaler,
            config,
            device,
            params,
            steps: 0,
            position: Position::default(),
            pending_times: Default::default(),
            staged: Default::default(),
            data_parallel: None,
            graph: Graphing::Off,
            graph_stats: GraphStats::default(),
            accumulate: 1,
        })
    }

    /// Replays the training step as a captured graph (a CUDA graph: one launch instead of
    /// hundreds) once [`GRAPH_WARMUP_STEPS`] eager steps have run: the step after the warm-up
    /// is captured — the input op, forward, loss, backward, unscale and clip, optimizer and
    /// scale update — and every later step of that batch shape copies its batch into the
    /// static input buffers, writes the learning rate and replays it. A new resolution at the
    /// same batch size (progressive resizing) drops the graph and captures again after a
    /// warm-up; a batch of another size (the last, partial one), a device that cannot capture
    /// and data parallelism over a host collective run eagerly, counted in
    /// [`Trainer::graph_stats`] with the reason. A data-parallel step over NCCL is captured
    /// whole: the buffer broadcast, the gradient buckets (issued by the backward thread onto
    /// NCCL's stream, forked from the capture by their events and joined by the optimizer's
    /// wait) and synchronised batch norm's sums are in the graph; each replay
    /// first asks the groups whether they are alive and then has them watch it, so a dead peer
    /// still ends the job within the timeout.
    pub fn with_graph(mut self) -> Self {
        self.graph = Graphing::Waiting(GRAPH_WARMUP_STEPS);
        self.graph_stats.requested = true;
        self
    }

    /// Gradient accumulation: one optimizer step per `batches` loader batches, for an
    /// effective batch `batches` times the loader's. Each batch's forward and backward run in
    /// turn with its loss scaled by 1/`batches`, so the gradients sum in place to those of the
    /// mean loss over all of them; unscale, clip, the optimizer and the scale update run after
    /// the last. A rank of a data-parallel job reduces only the last batch's backward, which
    /// carries the sum (DDP's `no_sync` on the others). The schedule counts optimizer steps, and
    /// [`Step`] reports the batches' mean loss and all their images. Such steps run eagerly
    /// (a captured graph holds one batch's copy); batch norm's running statistics see every
    /// batch, as in PyTorch. `batches` = 0 is refused.
    pub fn with_accumulation(mut self, batches: usize) -> Result<Self> {
        if batches == 0 {
            return Err(TrainError::Config(
                "gradient accumulation over 0 batches a step".into(),
            ));
        }
        self.accumulate = batches;
        Ok(self)
    }

    /// Loader batches per optimizer step (1 without accumulation).
    pub fn accumulation(&self) -> usize {
        self.accumulate
    }

    /// What graph replay did so far.
    pub fn graph_stats(&self) -> &GraphStats {
        &self.graph_stats
    }

    /// Makes this trainer one rank of a data-parallel job over `collective`: rank 0's
    /// parameters and buffers are broadcast now, gradients are averaged across ranks in buckets
    /// of `bucket_bytes` while backward runs ([`DataParallel`]), and rank 0's buffers are
    /// broadcast before each training forward. Each rank feeds its own shard of the data
    /// (the loader's `rank` and `world`); batch norm statistics stay local to a rank's batch.
    pub fn with_data_parallel(
        mut self,
        collective: Arc<dyn Collective>,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let params = named_parameters(self.model.as_ref());
        let buffers: Vec<Tensor> = state_dict(self.model.as_ref())
            .into_iter()
            .filter(|(_, t, kind)| *kind == Kind::Buffer && t.dtype().is_float())
            .map(|(_, t, _)| t)
            .collect();
        let groups = vec![collective.clone()];
        let reducer = DataParallel::new(collective, params, &buffers, bucket_bytes)?;
        self.data_parallel = Some(Ranked {
            reducer,
            buffers,
            groups,
        });
        Ok(self)
    }

    /// Synchronised batch norm for a rank of a data-parallel job: every batch norm takes its
    /// training statistics over all ranks' batches (PyTorch's `SyncBatchNorm`), through the
    /// trainer's collective where it is a device one (NCCL), else a group split from it
    /// ([`SyncBatchStats::install`]). Collective: every rank calls it.
    pub fn with_sync_batch_norm(mut self) -> Result<Self> {
        let ranked = self.data_parallel.as_mut().ok_or_else(|| {
            TrainError::Config("synchronised batch norm needs with_data_parallel first".into())
        })?;
        let group = SyncBatchStats::install(self.model.as_ref(), ranked.reducer.collective())?;
        if !ranked.groups.iter().any(|g| Arc::ptr_eq(g, &group)) {
            ranked.groups.push(group);
        }
        Ok(self)
    }

    /// This trainer's rank and the job's world size ((0, 1) without data parallelism).
    pub fn rank_and_world(&self) -> (usize, usize) {
        match &self.data_parallel {
            Some(r) => (
                r.reducer.collective().rank(),
                r.reducer.collective().world(),
            ),
            None => (0, 1),
        }
    }

    /// The data-parallel reducer, when this trainer is a rank of a job.
    pub fn data_parallel(&self) -> Option<&DataParallel> {
        self.data_parallel.as_ref().map(|r| &r.reducer)
    }

    /// Replaces the GradScaler (another initial scale or growth schedule); fp16 only.
    pub fn with_scaler(mut self, scaler: GradScaler) -> Result<Self> {
        if !self.config.precision.needs_scaler() {
            return Err(TrainError::Config(format!(
                "a GradScaler is for fp16, not {}",
                self.config.precision
            )));
        }
        self.scaler = Some(scaler);
        Ok(self)
    }

    /// Where the next training batch starts: give it to `Loader::new` when resuming.
    pub fn position(&self) -> Position {
        self.position
    }

    /// Ends the loader's epoch (any batches left, fewer than a step takes, are skipped): the
    /// position becomes the next epoch's start. A checkpoint saved there resumes on any
    /// number of processes, where one saved mid-epoch needs a world size that divides the
    /// samples consumed ([`Position::reshard`]).
    pub fn end_epoch(&mut self) {
        self.position = Position {
            epoch: self.position.epoch + 1,
            index: 0,
        };
    }

    /// Every tensor a checkpoint holds: the state dict (torchvision names), then
    /// `optimizer.*` and `scaler.*`.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = state_dict(self.model.as_ref())
            .into_iter()
            .map(|(name, t, _)| (name, t))
            .collect();
        all.extend(
            self.optimizer
                .state()
                .into_iter()
                .map(|(name, t)| (format!("optimizer.{name}"), t)),
        );
        if let Some(s) = &self.scaler {
            all.extend(
                s.state()
                    .into_iter()
                    .map(|(name, t)| (format!("scaler.{name}"), t.clone())),
            );
        }
        all
    }

    /// Saves weights, optimizer and scaler state, the step count and the loader position
    /// (atomically: see [`checkpoint`]).
    pub fn save(&self, path: &Path, seed: u64) -> Result<()> {
        let progress = Progress {
            step: self.steps as u64,
            epoch: self.position.epoch,
            index: self.position.index as u64,
            seed,
            world: self.rank_and_world().1 as u64,
        };
        checkpoint::save(path, &self.checkpoint_tensors(), progress)
    }

    /// Restores what [`Trainer::save`] wrote into this trainer (same model, optimizer and
    /// precision); returns the saved progress (the loader position to resume from is also
    /// [`Trainer::position`] afterwards). A checkpoint of another world size is refused: see
    /// [`Trainer::load_resharded`].
    pub fn load(&mut self, path: &Path) -> Result<Progress> {
        let world = self.rank_and_world().1;
        let progress = checkpoint::load(path, &self.checkpoint_tensors())?;
        if progress.world != world as u64 {
            return Err(TrainError::Checkpoint(format!(
                "{}: written by {} ranks, resumed by {world}: resume with load_resharded and the \
                 loader's order mode",
                path.display(),
                progress.world
            )));
        }
        self.loaded(progress)
    }

    /// [`Trainer::load`] for a checkpoint written by any number of ranks: the loader position is
    /// converted to this job's world size so the data order continues exactly
    /// ([`Position::reshard`]; `mode` is the training loader's order).
    pub fn load_resharded(&mut self, path: &Path, mode: Mode) -> Result<Progress> {
        let world = self.rank_and_world().1;
        let mut progress = checkpoint::load(path, &self.checkpoint_tensors())?;
        let saved = Position {
            epoch: progress.epoch,
            index: progress.index as usize,
        };
        let here = saved.reshard(mode, progress.world as usize, world)?;
        progress.index = here.index as u64;
        progress.world = world as u64;
        self.loaded(progress)
    }

    fn loaded(&mut self, progress: Progress) -> Result<Progress> {
        self.model.state_loaded()?;
        self.optimizer.state_loaded(progress.step);
        self.steps = progress.step as usize;
        self.position = Position {
            epoch: progress.epoch,
            index: progress.index as usize,
        };
        Ok(progress)
    }

    pub fn model(&self) -> &dyn Module {
        self.model.as_ref()
    }

    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Optimizer steps issued so far (skipped AMP steps included: the schedule advances, as
    /// PyTorch's scheduler does when its `step()` follows `scaler.step()`).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Sets [`steps`](Self::steps), where the schedule continues. A job resumed on another
    /// number of processes takes another number of steps per epoch (each sees another global
    /// batch), so its schedule continues from the same share of training, not the same step
    /// count. The optimizer's own step counts (bias corrections, momentum's first step) are
    /// its checkpointed state and stay.
    pub fn set_steps(&mut self, steps: usize) {
        self.steps = steps;
    }

    /// The learning rate of the next step.
    pub fn lr(&self) -> f64 {
        self.config.schedule.lr(self.config.base_lr, self.steps)
    }

    /// A loader batch on the device: the normalised input (the input op, in the compute dtype)
    /// and the i64 labels, the pixels and labels copied into the trainer's static buffers. The
    /// pooled buffer goes with the copy and returns to the loader's pool when it is done.
    pub fn upload(&self, batch: Batch) -> Result<Inputs> {
        let staged = self.stage(batch)?;
        let images = staged.images.clone();
        let inputs = staged.normalized(self.config.precision)?;
        self.images_read(&images)?;
        Ok(inputs)
    }

    /// The batch's pixels and labels copied into the static buffers (no op on them yet).
    fn stage(&self, batch: Batch) -> Result<StagedBatch> {
        let (n, res) = (batch.len, batch.res);
        // Samples the loader skipped carry -1. A device that compares i64 always masks them,
        // so no step depends on what a batch holds; one that does not (wgpu) masks only the
        // batches that need it, known here on the host.
        let masks = (self.device.backend()).supports(Op::Binary(BinaryOp::Ne), DType::I64);
        let ignore_index = (masks || batch.labels().any(|l| l < 0)).then_some(-1);
        let labels = batch.label_bytes();
        let pixels = n * res * res * 3;
        let (images, y, read) = self.staged(n, res)?;
        // Both copies read the loader's (pinned) buffer, which goes back to its pool when the
        // later is done. On CUDA the pixels travel on the copy stream, behind the last step's
        // input op only, and the compute stream waits for them on the device; the labels, a
        // few bytes the last step's loss may still read, on the compute stream in its order.
        let buffer = Arc::new(batch.into_buffer());
        let after = read.unwrap_or_else(Event::reached);
        let copied =
            images.copy_from_host_after(HostBytes::Pooled(buffer.clone(), 0..pixels), &after)?;
        self.device.wait_event(&copied)?;
        y.copy_from_host(HostBytes::Pooled(buffer, labels))?;
        Ok(StagedBatch {
            images,
            y,
            ignore_index,
        })
    }

    /// The static input buffers for a batch of `n` images of `res`², made on the first batch
    /// of that shape and kept: a captured step reads the full batches' buffers at their
    /// addresses however many partial batches (or other resolutions) ran in between.
    /// Also hands over the event after the last read of the images (taken: the caller's copy
    /// replaces it).
    fn staged(&self, n: usize, res: usize) -> Result<(Tensor, Tensor, Option<Event>)> {
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        let shape = [n, res, res, 3];
        let found = staged.iter_mut().find(|s| s.images.shape() == shape);
        let s = match found {
            Some(s) => s,
            None => {
                staged.push(Staged {
                    images: Tensor::zeros(&shape, DType::U8, &self.device)?,
                    labels: Tensor::zeros(&[n], DType::I64, &self.device)?,
                    read: None,
                });
                staged.last_mut().ok_or(TrainError::NoData)?
            }
        };
        Ok((s.images.clone(), s.labels.clone(), s.read.take()))
    }

    /// Marks the point after the input op that read `images` (the next copy into them waits
    /// for it).
    fn images_read(&self, images: &Tensor) -> Result<()> {
        let event = self.device.record_event()?;
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = staged
            .iter_mut()
            .find(|s| s.images.shape() == images.shape())
        {
            s.read = Some(event);
        }
        Ok(())
    }

    /// The logits (in f32) under the precision's autocast scope.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let scope = self.config.precision.autocast().map(autocast).transpose()?;
        let logits = self.model.forward(x)?;
        let logits = for_f32(&logits)?;
        drop(scope);
        Ok(logits)
    }

    /// Forward and the (label-smoothed) training loss; samples labelled -1 (skipped by the
    /// loader) are left out. A rank of a data-parallel job first takes rank 0's buffers.
    pub fn forward(&self, inputs: &Inputs) -> Result<Tensor> {
        if let Some(ranked) = &self.data_parallel {
            (ranked.reducer.collective()).broadcast(&ranked.buffers, 0)?;
        }
        let logits = self.logits(&inputs.x)?;
        let smoothing = self.config.label_smoothing;
        Ok(logits.cross_entropy(&inputs.y, smoothing, inputs.ignore_index)?)
    }

    /// Backward from `loss` (scaled by the GradScaler when there is one).
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        match &self.scaler {
            Some(s) => s.scale(loss)?.backward()?,
            None => loss.backward()?,
        }
        Ok(())
    }

    /// Unscale, clip, step (skipped on the device on overflow), update the scale, clear the
    /// gradients. Nothing here waits for the device. The learning rate is written to its device
    /// scalar first; everything after issues the same launches every step (capturable).
    ///
    /// A rank of a data-parallel job first waits for the last gradient bucket's average: from
    /// then on every rank holds the same gradients, so the GradScaler finds the same inf/NaN on
    /// each (one rank's overflow reaches all through the average) and all skip the same steps.
    pub fn update(&mut self) -> Result<()> {
        if let Some(ranked) = &self.data_parallel {
            ranked.reducer.synchronize()?;
        }
        self.optimizer.set_lr(self.lr())?;
        let found_inf = match &mut self.scaler {
            Some(s) => Some(s.step_flag(&self.params)?.clone()),
            None => None,
        };
        if let Some(max_norm) = self.config.clip_norm {
            clip_grad_norm(&self.params, max_norm)?;
        }
        self.optimizer.update(found_inf.as_ref())?;
        if let Some(s) = &mut self.scaler {
            s.update()?;
        }
        zero_grad(self.optimizer.groups());
        self.steps += 1;
        Ok(())
    }

    /// One training step on the next batch of `batches` (the next
    /// [`accumulation`](Self::accumulation) batches with gradient accumulation), timed phase
    /// by phase.
    pub fn train_step(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
    ) -> Result<Step> {
        if self.accumulate > 1 {
            return self.accumulated_step(batches);
        }
        let device = self.device.clone();
        let mut clock = PhaseClock::start(&device)?;
        let batch = self.next_batch(batches, &mut clock)?;
        let images = batch.len;
        let lr = self.lr();
        let staged = self.stage(batch)?;
        let loss = match self.graph_turn(&staged) {
            GraphTurn::Eager => {
                let images = staged.images.clone();
                let inputs = staged.normalized(self.config.precision)?;
                self.images_read(&images)?;
                clock.lap(Phase::HostToDevice)?;
                let loss = self.forward(&inputs)?;
                clock.lap(Phase::Forward)?;
                if let Err(e) = self.backward(&loss) {
                    self.settle_buckets();
                    return Err(e);
                }
                clock.lap(Phase::Backward)?;
                self.update()?;
                clock.lap(Phase::Optimizer)?;
                loss
            }
            turn => {
                clock.lap(Phase::HostToDevice)?;
                // One graph: its time is the forward phase's; backward and optimizer are in it.
                let images = staged.images.clone();
                let loss = self.graph_step(turn, staged)?;
                self.images_read(&images)?;
                clock.lap(Phase::Forward)?;
                clock.lap(Phase::Backward)?;
                clock.lap(Phase::Optimizer)?;
                loss
            }
        };
        self.finish_step(clock, loss, lr, images)
    }

    /// One optimizer step over the next `accumulate` batches ([`Trainer::with_accumulation`]),
    /// eager. The phases repeat per batch (data wait, copy and input op, forward, backward),
    /// each adding to its total; the optimizer phase ends the step. Running out of batches
    /// part-way is [`TrainError::NoData`], with the part-step's gradients cleared.
    fn accumulated_step(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
    ) -> Result<Step> {
        let k = self.accumulate;
        if self.graph_stats.requested {
            if !matches!(self.graph, Graphing::Refused) {
                self.graph = Graphing::Refused;
                self.graph_stats.eager_reason = Some(format!(
                    "gradient accumulation ({k} batches a step): a graph holds one batch's copy"
                ));
            }
            self.graph_stats.eager_steps += 1;
        }
        let device = self.device.clone();
        let mut clock = PhaseClock::start(&device)?;
        let lr = self.lr();
        let mut images = 0;
        let mut summed: Option<Tensor> = None;
        for i in 0..k {
            let accumulated = self.accumulate_one(batches, &mut clock, i + 1 == k);
            let (loss, n) = match accumulated {
                Ok(done) => done,
                Err(e) => {
                    self.settle_buckets();
                    zero_grad(self.optimizer.groups());
                    return Err(e);
                }
            };
            images += n;
            summed = Some(match summed {
                Some(sum) => sum.add(&loss)?,
                None => loss,
            });
        }
        self.update()?;
        clock.lap(Phase::Optimizer)?;
        let loss = (summed.ok_or(TrainError::NoData)?).mul_scalar(1.0 / k as f64)?;
        self.finish_step(clock, loss, lr, images)
    }

    /// One batch of an accumulated step: forward, and backward of its loss ÷ `accumulate`
    /// (reduced across ranks only for the `last`). Its loss (detached) and image count.
    fn accumulate_one(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
        clock: &mut PhaseClock,
        last: bool,
    ) -> Result<(Tensor, usize)> {
        let batch = self.next_batch(batches, clock)?;
        let images = batch.len;
        let inputs = self.upload(batch)?;
        clock.lap(Phase::HostToDevice)?;
        let loss = self.forward(&inputs)?;
        clock.lap(Phase::Forward)?;
        let share = loss.mul_scalar(1.0 / self.accumulate as f64)?;
        match (&self.data_parallel, last) {
            (Some(ranked), false) => ranked.reducer.no_sync(|| self.backward(&share))?,
            _ => self.backward(&share)?,
        }
        clock.lap(Phase::Backward)?;
        Ok((loss.detach(), images))
    }

    /// After an error once a backward may have started gradient buckets: waits for them (their
    /// own error is dropped: the first one is reported), so no collective still writes
    /// gradients that are about to be cleared and their memory reused (a GPU runs them on
    /// another stream, after the host has moved on).
    fn settle_buckets(&self) {
        if let Some(ranked) = &self.data_parallel {
            let _ = ranked.reducer.synchronize();
        }
    }

    /// The loader's next batch (the data wait phase), its end the trainer's new position.
    fn next_batch(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
        clock: &mut PhaseClock,
    ) -> Result<Batch> {
        let batch = batches.next().ok_or(TrainError::NoData)??;
        self.position = Position {
            epoch: batch.position.epoch,
            index: batch.position.index + batch.len,
        };
        clock.lap_host(Phase::DataWait)?;
        Ok(batch)
    }

    /// Hands the step's phase times to the late-read ring and reads the oldest that is due.
    fn finish_step(
        &mut self,
        clock: PhaseClock,
        loss: Tensor,
        lr: f64,
        images: usize,
    ) -> Result<Step> {
        let device = self.device.clone();
        self.pending_times.push_back(clock.finish_later());
        let known = self.pending_times.len() > TIMES_LAG
            || self
                .pending_times
                .front()
                .is_some_and(PendingTimes::is_ready);
        let waiting = std::time::Instant::now();
        let times = match known {
            true => (self.pending_times.pop_front())
                .map(|t| t.read(&device))
                .transpose()?,
            false => None,
        };
        Ok(Step {
            times,
            loss: loss.detach(),
            lr,
            images,
            device_wait: waiting.elapsed(),
        })
    }

    /// How this step runs under graph replay (and the bookkeeping of eager steps).
    fn graph_turn(&mut self, staged: &StagedBatch) -> GraphTurn {
        let shape = staged.images.shape().to_vec();
        // The warm-up counts this process's steps, not the schedule's (a resumed run warms up
        // too).
        if let Graphing::Waiting(left) = &mut self.graph {
            if *left > 0 {
                *left -= 1;
                return GraphTurn::Eager;
            }
        }
        let (turn, reason) = match &self.graph {
            Graphing::Off => return GraphTurn::Eager,
            Graphing::Waiting(_)
                if self.data_parallel.as_ref().is_some_and(|r| !r.capturable()) =>
            {
                self.graph = Graphing::Refused;
                let why = "data parallelism over a collective that cannot be captured into a \
                           graph (it runs on the host: NCCL's can)";
                (GraphTurn::Eager, Some(why.to_string()))
            }
            Graphing::Waiting(_) => return GraphTurn::Capture,
            Graphing::Active { shape: s, .. } if *s == shape => return GraphTurn::Replay,
            // A new resolution at the same batch size (progressive resizing): one graph at a
            // time — drop this one and its memory, warm up and capture at the new size.
            Graphing::Active { shape: s, .. } if s[0] == shape[0] => {
                self.graph = Graphing::Waiting(GRAPH_WARMUP_STEPS - 1);
                return GraphTurn::Eager;
            }
            Graphing::Active { shape: s, .. } => {
                let why = format!("a batch of shape {shape:?}; the graph was captured for {s:?}");
                (GraphTurn::Eager, Some(why))
            }
            Graphing::Refused => (GraphTurn::Eager, None),
        };
        self.graph_stats.eager_steps += 1;
        if let Some(why) = reason {
            self.graph_stats.eager_reason.get_or_insert(why);
        }
        turn
    }

    /// The input op, forward, backward and update, without phase laps: what a graph holds.
    fn whole_step(&mut self, staged: StagedBatch) -> Result<Tensor> {
        let inputs = staged.normalized(self.config.precision)?;
        let loss = self.forward(&inputs)?;
        self.backward(&loss)?;
        self.update()?;
        Ok(loss)
    }

    /// A step as a graph: captured now (then run by replaying it once) or replayed. A device
    /// that cannot capture says so before anything is recorded, and the step runs eagerly.
    fn graph_step(&mut self, turn: GraphTurn, staged: StagedBatch) -> Result<Tensor> {
        // The rate's copy happens outside the graph; inside, `update` finds it unchanged.
        self.optimizer.set_lr(self.lr())?;
        if let (GraphTurn::Replay, Graphing::Active { graph, loss, .. }) = (turn, &self.graph) {
            self.replay(graph)?;
            self.model.batch_replayed();
            self.steps += 1;
            self.graph_stats.replays += 1;
            // The caller may read it steps later, after more replays rewrote the graph's.
            return Ok(no_grad(|| loss.add_scalar(0.0))?);
        }
        let shape = staged.images.shape().to_vec();
        let backend = self.device.backend();
        // Batch norm's host counters, written to the device so a failed capture can read them
        // back (the visit writes them; nothing is read).
        let steps = self.steps;
        self.model.visit("", &mut |_, _, _| {});
        if let Err(e) = backend.begin_capture() {
            self.graph = Graphing::Refused;
            self.graph_stats.eager_steps += 1;
            self.graph_stats.eager_reason = Some(e.to_string());
            return self.whole_step(staged);
        }
        let captured = self.whole_step(staged.clone());
        let graph = self
            .device
            .backend()
            .end_capture()
            .map_err(TrainError::from);
        // On a failure the step's own error comes first, and whatever was captured (with the
        // memory it holds) is dropped before the step runs again.
        let (loss, graph) = match captured.and_then(|loss| graph.map(|graph| (loss, graph))) {
            Ok(done) => done,
            Err(e) => return self.capture_failed(e, steps, staged),
        };
        self.replay(&graph)?;
        self.graph_stats.nodes = graph.nodes();
        self.graph_stats.replays += 1;
        self.graph_stats.captures += 1;
        let copy = no_grad(|| loss.detach().add_scalar(0.0))?;
        self.graph = Graphing::Active {
            graph,
            loss: loss.detach(),
            shape,
        };
        Ok(copy)
    }

    /// A capture that failed (an op the driver refuses inside one, a capture it invalidated)
    /// ran nothing on the device, but the step's host side moved on: put back what it moved —
    /// the step count, the gradients it recorded, the host's mirrors of device state (batch
    /// norm's counters, read back), the scaler's unscaled mark — and run this step and every
    /// later one eagerly, saying why (the eager fallback, reported as such). A rank of a
    /// data-parallel job fails instead: its peers must not take another path than it.
    fn capture_failed(
        &mut self,
        e: TrainError,
        steps: usize,
        staged: StagedBatch,
    ) -> Result<Tensor> {
        if self.data_parallel.is_some() {
            return Err(e);
        }
        zero_grad(self.optimizer.groups());
        self.steps = steps;
        self.model.state_loaded()?;
        self.optimizer.state_loaded(steps as u64);
        if let Some(s) = &mut self.scaler {
            s.discard_step();
        }
        self.graph = Graphing::Refused;
        self.graph_stats.eager_steps += 1;
        self.graph_stats.eager_reason = Some(format!(
            "the step's capture failed, so it runs eagerly: {e}"
        ));
        self.whole_step(staged)
    }

    /// Enqueues the captured step once. It runs the job's collectives where their groups
    /// cannot see them: a group that failed is not replayed on, and each holds the replay to
    /// its timeout.
    fn replay(&self, graph: &Graph) -> Result<()> {
        if let Some(ranked) = &self.data_parallel {
            ranked.alive()?;
        }
        graph.replay()?;
        if let Some(ranked) = &self.data_parallel {
            ranked.watch(&self.device.record_event()?)?;
        }
        Ok(())
    }

    /// The phase times of the steps not yet reported, oldest first (waiting for the device to
    /// finish them): at the end of a measurement, or to drop the warm-up's.
    pub fn take_times(&mut self) -> Result<Vec<StepTimes>> {
        let device = self.device.clone();
        (self.pending_times.drain(..))
            .map(|t| Ok(t.read(&device)?))
            .collect()
    }

    /// Loss, top-1 and top-5 over `batches` in evaluation mode (running statistics, no tape);
    /// the model is back in training mode afterwards. A rank of a data-parallel job evaluates
    /// its own shard (a loader with `Uneven::Exact`: each sample on exactly one rank) and gets
    /// the figures over every rank's.
    pub fn evaluate(
        &self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
    ) -> Result<Evaluation> {
        self.model.set_training(false);
        let result = no_grad(|| self.evaluate_inner(batches));
        self.model.set_training(true);
        result
    }

    fn evaluate_inner(
        &self,
        batches: &mut dyn Iterator<Item = Result<Batch, LoaderError>>,
    ) -> Result<Evaluation> {
        let (mut loss_sum, mut top1, mut top5, mut images) = (0.0, 0, 0, 0);
        for batch in batches {
            let batch = batch?;
            let labels: Vec<i64> = batch.labels().collect();
            let counted = labels.iter().filter(|&&l| l >= 0).count();
            let inputs = self.upload(batch)?;
            let logits = self.logits(&inputs.x)?;
            let logits = if logits.dtype() == DType::F32 {
                logits
            } else {
                logits.cast(DType::F32)?
            };
            let classes = logits.shape()[1];
            if counted > 0 {
                let loss = logits.cross_entropy(&inputs.y, 0.0, inputs.ignore_index)?;
                loss_sum += loss.item()? * counted as f64;
            }
            let host = logits.to_vec::<f32>()?;
            top1 += top_k_correct(&host, classes, &labels, 1);
            top5 += top_k_correct(&host, classes, &labels, 5.min(classes));
            images += counted;
        }
        // A rank of a data-parallel job evaluated its shard (each sample on one rank): the
        // sums over every rank. Every rank takes part, with or without images of its own.
        if let Some(ranked) = &self.data_parallel {
            let sums = [loss_sum, top1 as f64, top5 as f64, images as f64];
            let t = Tensor::from_slice(&sums, &[4], &Device::reference())?;
            (ranked.reducer.collective()).all_reduce(std::slice::from_ref(&t), ReduceOp::Sum)?;
            let total = t.to_vec::<f64>()?;
            loss_sum = total[0];
            (top1, top5, images) = (total[1] as usize, total[2] as usize, total[3] as usize);
        }
        if images == 0 {
            return Err(TrainError::NoData);
        }
        let n = images as f64;
        Ok(Evaluation {
            loss: loss_sum / n,
            top1: top1 as f64 / n,
            top5: top5 as f64 / n,
            images,
        })
    }
}

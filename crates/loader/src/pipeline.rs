//! The prefetching pipeline: persistent workers build whole batches from shard records into
//! pooled buffers; batches come out in order, at most `prefetch` ahead of the consumer.
//!
//! * A job is one batch: a worker takes a buffer from the `redline-hostmem` pool, decodes and
//!   transforms each sample straight into its slot (`u8 [B, res, res, 3]`, labels after the
//!   pixels as little-endian i64), and sends the batch back. Workers never share a buffer, so no
//!   slot is written by two threads, and a batch is independent of which worker built it: every
//!   random draw is keyed by (seed, epoch, sample).
//! * The consumer issues jobs `prefetch` batches ahead — at least one per worker, so every
//!   core has a batch to build — and reorders what comes back. A buffer
//!   returns to the pool when the consumer (or a device copy holding it) drops the [`Batch`].
//! * Dropping the [`Loader`] mid-epoch closes the job channel and the pool and joins every
//!   worker. A worker's error or panic reaches the consumer as an `Err`, never a hang.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use redline_hostmem::{BufferPool, HostAllocator, PooledBuffer};
use redline_shard::ShardSet;

use crate::augment::{eval_geometry, train_params};
use crate::decode::{Codec, Decoder, Region};
use crate::order::{Mode, Order, Position, Uneven};
use crate::resize::{flip_horizontal, Crop, Resizer};

/// What to do with a record that does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBadSample {
    /// The batch fails with an error naming the shard and record.
    Fail,
    /// The slot is zeroed, its label is -1 (an ignore index), and the batch's statistics say so.
    Skip,
}

/// How to load.
#[derive(Debug, Clone)]
pub struct Config {
    pub batch: usize,
    /// Output side in pixels.
    pub res: usize,
    /// Random resized crop + flip (training) or resize + centre crop (evaluation).
    pub train: bool,
    pub seed: u64,
    pub mode: Mode,
    pub rank: usize,
    pub world: usize,
    pub uneven: Uneven,
    /// Decode threads (default: every core).
    pub workers: usize,
    /// Batches in flight ahead of the consumer (default 3), and never fewer than `workers`: a
    /// batch is one worker's job, so fewer in flight would leave cores idle.
    pub prefetch: usize,
    /// Drop a last, short batch.
    pub drop_last: bool,
    pub on_bad_sample: OnBadSample,
    /// The JPEG codec (default: the fastest built in, [`Codec::best`]).
    pub codec: Codec,
    /// Where batch buffers come from: a device's pinned allocator (`Device::host_allocator`
    /// in redline-tensor) lets batches upload without a staging copy; `None`, page-aligned
    /// memory.
    pub allocator: Option<Arc<dyn HostAllocator>>,
}

impl Config {
    pub fn new(batch: usize, res: usize, train: bool) -> Self {
        Self {
            batch,
            res,
            train,
            seed: 0,
            mode: if train {
                Mode::Random
            } else {
                Mode::Sequential
            },
            rank: 0,
            world: 1,
            uneven: Uneven::Pad,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            prefetch: 3,
            drop_last: train,
            on_bad_sample: OnBadSample::Fail,
            codec: Codec::best(),
            allocator: None,
        }
    }
}

/// Why loading failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoaderError {
    Config(String),
    /// A record could not be read or decoded (with [`OnBadSample::Fail`]).
    Sample {
        shard: String,
        record: u64,
        reason: String,
    },
    /// A worker panicked; the message is the panic's.
    Worker(String),
}

impl fmt::Display for LoaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoaderError::Config(why) => write!(f, "loader configuration: {why}"),
            LoaderError::Sample {
                shard,
                record,
                reason,
            } => write!(f, "{shard}: record {record}: {reason}"),
            LoaderError::Worker(why) => write!(f, "a loader worker panicked: {why}"),
        }
    }
}

impl std::error::Error for LoaderError {}

/// A sample left out under [`OnBadSample::Skip`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub shard: String,
    pub record: u64,
    pub reason: String,
}

/// What building one batch cost.
#[derive(Debug, Clone, Default)]
pub struct BatchStats {
    /// Which worker built it, and its time decoding + transforming.
    pub worker: usize,
    pub work: Duration,
    /// How long the consumer waited for it.
    pub waited: Duration,
    pub skipped: Vec<Skipped>,
}

/// One batch: `len` samples of `u8 [res, res, 3]` and their labels, in a pooled buffer.
pub struct Batch {
    buffer: PooledBuffer,
    /// Where the labels start in the buffer (after the batch's pixel slots).
    labels_at: usize,
    pub len: usize,
    pub res: usize,
    /// Where this batch starts in the rank's order.
    pub position: Position,
    pub stats: BatchStats,
}

impl Batch {
    /// A batch in `buffer`: `len` samples' pixels from its start, their labels (little-endian
    /// i64) from `labels_at`.
    pub(crate) fn from_parts(
        buffer: PooledBuffer,
        labels_at: usize,
        len: usize,
        res: usize,
        position: Position,
        stats: BatchStats,
    ) -> Self {
        Self {
            buffer,
            labels_at,
            len,
            res,
            position,
            stats,
        }
    }

    /// `[len, res, res, 3]` pixels, NHWC.
    pub fn images(&self) -> &[u8] {
        &self.buffer[..self.len * self.res * self.res * 3]
    }

    /// The labels (-1 for a skipped sample).
    pub fn labels(&self) -> impl Iterator<Item = i64> + '_ {
        self.buffer[self.label_bytes()]
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    /// Where the labels lie in the buffer ([`into_buffer`](Self::into_buffer)): `len`
    /// little-endian i64.
    pub fn label_bytes(&self) -> std::ops::Range<usize> {
        self.labels_at..self.labels_at + self.len * 8
    }

    /// Hands the buffer on (to a device upload that returns it to the pool when done).
    pub fn into_buffer(self) -> PooledBuffer {
        self.buffer
    }
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Batch({} x {}², at {:?})",
            self.len, self.res, self.position
        )
    }
}

/// One batch to build.
struct Job {
    number: u64,
    epoch: u64,
    /// Index of its first sample in the epoch's order.
    first: usize,
    order: Arc<Vec<u64>>,
}

/// The loader: an iterator of batches, epoch after epoch.
pub struct Loader {
    config: Config,
    /// Batches kept out: `prefetch`, and at least one per worker.
    in_flight: usize,
    order: Order,
    pool: BufferPool,
    jobs: Option<Sender<Job>>,
    results: Receiver<(u64, Result<Batch, LoaderError>)>,
    workers: Vec<JoinHandle<()>>,
    /// Where the next job starts, and the order it reads.
    next_job: Position,
    epoch_order: Arc<Vec<u64>>,
    issued: u64,
    delivered: u64,
    pending: VecDeque<(u64, Result<Batch, LoaderError>)>,
    waited: Duration,
    busy_since: Option<Instant>,
    busy: Duration,
    decodes: Arc<AtomicU64>,
}

impl Loader {
    /// A loader over `shards`, starting at `start` (an epoch and a sample index in it).
    pub fn new(
        shards: Arc<ShardSet>,
        config: Config,
        start: Position,
    ) -> Result<Self, LoaderError> {
        let bad = |why: String| Err(LoaderError::Config(why));
        if config.batch == 0 || config.res == 0 || config.workers == 0 || config.prefetch == 0 {
            return bad(format!(
                "batch {}, res {}, workers {} and prefetch {} must all be at least 1",
                config.batch, config.res, config.workers, config.prefetch
            ));
        }
        let order = Order::new(shards.len() as usize, config.seed, config.mode)
            .and_then(|o| o.sharded(config.rank, config.world, config.uneven))
            .map_err(|e| LoaderError::Config(e.to_string()))?;
        if order.per_rank() == 0 {
            return bad("the shard set is empty".into());
        }
        let sample = config.res * config.res * 3;
        let in_flight = config.prefetch.max(config.workers);
        let buffers = in_flight + 2;
        // At most `in_flight` batches are out, so this never grows.
        let pending = VecDeque::with_capacity(in_flight + 1);
        let buffer_len = config.batch * (sample + 8);
        let pool = match &config.allocator {
            Some(allocator) => BufferPool::new(buffers, buffer_len, allocator.clone()),
            None => BufferPool::page_aligned(buffers, buffer_len),
        }
        .map_err(|e| LoaderError::Config(e.to_string()))?;
        let (jobs, job_rx) = bounded::<Job>(in_flight);
        let (result_tx, results) = bounded(in_flight + config.workers);
        let decodes = Arc::new(AtomicU64::new(0));
        let workers = (0..config.workers)
            .map(|id| {
                let (rx, tx) = (job_rx.clone(), result_tx.clone());
                let (shards, pool, config) = (shards.clone(), pool.clone(), config.clone());
                let decodes = decodes.clone();
                std::thread::Builder::new()
                    .name(format!("redline-loader-{id}"))
                    .spawn(move || worker(id, &shards, &pool, &config, &rx, &tx, decodes))
                    .map_err(|e| LoaderError::Config(format!("spawning a worker: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let epoch_order = Arc::new(order.epoch(start.epoch));
        Ok(Self {
            config,
            in_flight,
            order,
            pool,
            jobs: Some(jobs),
            results,
            workers,
            next_job: start,
            epoch_order,
            issued: 0,
            delivered: 0,
            pending,
            waited: Duration::ZERO,
            busy_since: None,
            busy: Duration::ZERO,
            decodes,
        })
    }

    /// Images decoded so far by every worker (each draw decodes the stored bytes: nothing
    /// decoded is cached, and this counter is how a test proves it).
    pub fn decodes(&self) -> u64 {
        self.decodes.load(Ordering::Relaxed)
    }

    /// Batches issued to the workers and not yet handed to the consumer (at most
    /// `prefetch.max(workers)`).
    pub fn batches_in_flight(&self) -> usize {
        (self.issued - self.delivered) as usize
    }

    /// Batches per epoch on this rank.
    pub fn batches_per_epoch(&self) -> usize {
        let n = self.order.per_rank();
        if self.config.drop_last {
            n / self.config.batch
        } else {
            n.div_ceil(self.config.batch)
        }
    }

    /// Share of the consumer's time spent waiting for batches (0..1): the data stall.
    pub fn data_stall(&self) -> f64 {
        let total = self.waited + self.busy;
        if total.is_zero() {
            0.0
        } else {
            self.waited.as_secs_f64() / total.as_secs_f64()
        }
    }

    /// Issues jobs until `in_flight` batches are out.
    fn top_up(&mut self) {
        let Some(jobs) = &self.jobs else { return };
        while self.issued - self.delivered < self.in_flight as u64 {
            let per_rank = self.order.per_rank();
            let left = per_rank.saturating_sub(self.next_job.index);
            let fits = if self.config.drop_last {
                left >= self.config.batch
            } else {
                left > 0
            };
            if !fits {
                self.next_job = Position {
                    epoch: self.next_job.epoch + 1,
                    index: 0,
                };
                self.epoch_order = Arc::new(self.order.epoch(self.next_job.epoch));
                continue;
            }
            let job = Job {
                number: self.issued,
                epoch: self.next_job.epoch,
                first: self.next_job.index,
                order: self.epoch_order.clone(),
            };
            if jobs.send(job).is_err() {
                return;
            }
            self.issued += 1;
            self.next_job.index += self.config.batch.min(left);
        }
    }
}

impl Iterator for Loader {
    type Item = Result<Batch, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(since) = self.busy_since.take() {
            self.busy += since.elapsed();
        }
        self.top_up();
        let start = Instant::now();
        let wanted = self.delivered;
        let result = loop {
            if let Some(i) = self.pending.iter().position(|(n, _)| *n == wanted) {
                break self.pending.remove(i).map(|(_, r)| r);
            }
            match self.results.recv() {
                Ok(arrived) => self.pending.push_back(arrived),
                Err(_) => break Some(Err(LoaderError::Worker("every worker has stopped".into()))),
            }
        };
        let waited = start.elapsed();
        self.waited += waited;
        self.delivered += 1;
        self.busy_since = Some(Instant::now());
        result.map(|r| {
            r.map(|mut batch| {
                batch.stats.waited = waited;
                batch
            })
        })
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // No more jobs; wake any worker waiting for a buffer; drain so none blocks on sending.
        self.jobs = None;
        self.pool.close();
        while self.results.try_recv().is_ok() {}
        for handle in self.workers.drain(..) {
            while !handle.is_finished() {
                while self.results.try_recv().is_ok() {}
                std::thread::yield_now();
            }
            let _ = handle.join();
        }
    }
}

/// A worker's loop: build each job's batch until the job channel closes.
fn worker(
    id: usize,
    shards: &ShardSet,
    pool: &BufferPool,
    config: &Config,
    jobs: &Receiver<Job>,
    results: &Sender<(u64, Result<Batch, LoaderError>)>,
    decodes: Arc<AtomicU64>,
) {
    let mut state = WorkerState {
        decodes,
        decoder: Decoder::with_codec(config.codec),
        ..WorkerState::default()
    };
    while let Ok(job) = jobs.recv() {
        // Fails only once the pool is closed: the loader is going away.
        let Ok(buffer) = pool.acquire() else { return };
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            build(id, buffer, shards, config, &job, &mut state)
        }))
        .unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(LoaderError::Worker(why))
        });
        if results.send((job.number, built)).is_err() {
            return;
        }
    }
}

/// A worker's reusable state: decoder buffer, resampler tables, an eval scratch image.
#[derive(Default)]
struct WorkerState {
    decoder: Decoder,
    resizer: Resizer,
    scratch: Vec<u8>,
    decodes: Arc<AtomicU64>,
}

fn build(
    id: usize,
    mut buffer: PooledBuffer,
    shards: &ShardSet,
    config: &Config,
    job: &Job,
    state: &mut WorkerState,
) -> Result<Batch, LoaderError> {
    let started = Instant::now();
    let (res, sample) = (config.res, config.res * config.res * 3);
    let len = config.batch.min(job.order.len() - job.first);
    let labels_at = config.batch * sample;
    let mut stats = BatchStats {
        worker: id,
        ..BatchStats::default()
    };
    for slot in 0..len {
        let index = job.order[job.first + slot];
        let out = &mut buffer[slot * sample..(slot + 1) * sample];
        let label = match one_sample(shards, config, job.epoch, index, out, state) {
            Ok(label) => label as i64,
            Err(e) => match (config.on_bad_sample, e) {
                (
                    OnBadSample::Skip,
                    LoaderError::Sample {
                        shard,
                        record,
                        reason,
                    },
                ) => {
                    out.fill(0);
                    stats.skipped.push(Skipped {
                        shard,
                        record,
                        reason,
                    });
                    -1
                }
                (_, e) => return Err(e),
            },
        };
        buffer[labels_at + slot * 8..labels_at + slot * 8 + 8]
            .copy_from_slice(&label.to_le_bytes());
    }
    stats.work = started.elapsed();
    Ok(Batch {
        buffer,
        labels_at,
        len,
        res,
        position: Position {
            epoch: job.epoch,
            index: job.first,
        },
        stats,
    })
}

/// Decodes and transforms sample `index` into `out`; returns its label.
fn one_sample(
    shards: &ShardSet,
    config: &Config,
    epoch: u64,
    index: u64,
    out: &mut [u8],
    state: &mut WorkerState,
) -> Result<i32, LoaderError> {
    let record = shards.record(index).map_err(|e| LoaderError::Sample {
        shard: shards.dir().display().to_string(),
        record: index,
        reason: e.to_string(),
    })?;
    let fail = |reason: String| LoaderError::Sample {
        shard: record.shard.display().to_string(),
        record: record.index,
        reason,
    };
    state.decodes.fetch_add(1, Ordering::Relaxed);
    let res = config.res;
    if config.train {
        let mut params = None;
        let decoded = state
            .decoder
            .decode_region(record.bytes, |w, h| {
                let p = train_params(config.seed, epoch, index, w, h);
                params = Some(p);
                Region {
                    crop: p.crop,
                    min_width: res,
                    min_height: res,
                }
            })
            .map_err(|e| fail(e.0))?;
        let image = decoded.image;
        state.resizer.reserve(decoded.full, (res, res));
        state
            .resizer
            .resize(image.pixels, image.width * 3, decoded.crop, res, res, out);
        if params.is_some_and(|p| p.flip) {
            flip_horizontal(out, res, res);
        }
    } else {
        let mut geometry = None;
        let decoded = state
            .decoder
            .decode_region(record.bytes, |w, h| {
                let g = eval_geometry(w, h, res);
                geometry = Some(g);
                Region {
                    crop: Crop {
                        left: 0,
                        top: 0,
                        width: w,
                        height: h,
                    },
                    min_width: g.resized_width,
                    min_height: g.resized_height,
                }
            })
            .map_err(|e| fail(e.0))?;
        let Some(g) = geometry else {
            return Err(fail("decoded without a plan".into()));
        };
        let image = decoded.image;
        let (rw, rh) = (g.resized_width, g.resized_height);
        state.resizer.reserve(decoded.full, (rw, rh));
        state.scratch.resize(rw * rh * 3, 0);
        state.resizer.resize(
            image.pixels,
            image.width * 3,
            decoded.crop,
            rw,
            rh,
            &mut state.scratch,
        );
        for (y, row) in out
            .chunks_exact_mut(res * 3)
            .enumerate()
            .take(g.crop.height)
        {
            let from = ((g.crop.top + y) * rw + g.crop.left) * 3;
            row[..g.crop.width * 3].copy_from_slice(&state.scratch[from..from + g.crop.width * 3]);
        }
    }
    Ok(record.label)
}

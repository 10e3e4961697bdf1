//! Sample order: a pure function of (seed, epoch, rank, world size).
//!
//! * [`Mode::Random`]: a full permutation of the dataset each epoch (PyTorch's
//!   `DistributedSampler(shuffle=True)`): the permutation is split across ranks by striding, so
//!   rank `r` of `w` takes positions `r, r + w, r + 2w, …`.
//! * [`Mode::PageGrouped`]: for datasets larger than RAM. Samples are taken in groups of
//!   consecutive records (a group spans a few pages of a shard), groups are shuffled, each rank
//!   takes a contiguous block of the shuffled groups, and samples are shuffled only within a
//!   window of groups — so each rank reads its own pages, page-sequentially, while batches still
//!   mix many groups (FFCV's quasi-random order, extended to several ranks).
//! * [`Mode::Sequential`]: dataset order (evaluation).
//!
//! Uneven splits pad (repeat from the start of the epoch's order, as `DistributedSampler` does)
//! or drop the tail, so every rank gets the same number of samples. [`Position`] is the resume
//! state: `(epoch, index)` within this rank's order, small enough to checkpoint; resuming computes
//! the order and skips to `index` without touching the skipped samples.

use std::fmt;

/// How an epoch's order is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Random,
    /// Groups of `group` consecutive samples, shuffled; samples shuffled within windows of
    /// `window` groups.
    PageGrouped {
        group: usize,
        window: usize,
    },
    Sequential,
}

/// What to do with the samples that do not divide evenly among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uneven {
    /// Repeat samples from the start of the order until every rank has `ceil(len / world)`.
    Pad,
    /// Leave out the tail: every rank gets `floor(len / world)`.
    Drop,
    /// Every sample exactly once: rank `r` takes positions `r, r + w, …` below the length, so
    /// ranks may differ by one sample. For evaluation, where no step keeps the ranks in step
    /// and sums over ranks must count each sample once (random and sequential orders).
    Exact,
}

/// Where a rank is in its stream of samples: the checkpointable resume state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Position {
    pub epoch: u64,
    /// Samples of this epoch already delivered on this rank.
    pub index: usize,
}

impl Position {
    /// This position in a job of `to_world` ranks, for one saved by a job of `from_world` (a
    /// checkpoint resumed on another number of devices).
    ///
    /// In [`Mode::Random`] and [`Mode::Sequential`] the epoch's order is one permutation of the
    /// dataset, a function of (seed, epoch) alone, and rank `r` of `w` takes its positions
    /// `r, r + w, …`: when every rank has taken `index` samples, the job has consumed exactly the
    /// first `index × w` of the permutation, whatever `w` is. Resuming continues that sequence
    /// exactly, provided `to_world` divides it. (Only the padding at an epoch's very end, which
    /// repeats samples to even out the ranks, depends on the world size, as with PyTorch's
    /// `DistributedSampler`.) [`Mode::PageGrouped`] gives each rank a contiguous block of
    /// groups, an order that depends on the world size: it resumes only on the same one.
    pub fn reshard(
        self,
        mode: Mode,
        from_world: usize,
        to_world: usize,
    ) -> Result<Self, OrderError> {
        if from_world == 0 || to_world == 0 {
            return Err(OrderError(format!(
                "resharding a position from {from_world} to {to_world} ranks"
            )));
        }
        if from_world == to_world {
            return Ok(self);
        }
        if let Mode::PageGrouped { .. } = mode {
            return Err(OrderError(format!(
                "a page-grouped order depends on the world size: a position saved by {from_world} \
                 ranks resumes only on {from_world} (this job has {to_world})"
            )));
        }
        let consumed = self.index * from_world;
        if !consumed.is_multiple_of(to_world) {
            return Err(OrderError(format!(
                "epoch {}: {consumed} samples were consumed by {from_world} ranks; {to_world} \
                 ranks cannot continue from there with equal shares (choose a world size that \
                 divides {consumed}, or resume at an epoch boundary)",
                self.epoch
            )));
        }
        Ok(Self {
            epoch: self.epoch,
            index: consumed / to_world,
        })
    }
}

/// A bad order configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderError(String);

impl fmt::Display for OrderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sample order: {}", self.0)
    }
}

impl std::error::Error for OrderError {}

/// The order of one rank's samples, epoch by epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    len: usize,
    seed: u64,
    mode: Mode,
    rank: usize,
    world: usize,
    uneven: Uneven,
}

impl Order {
    /// A single-rank order over `len` samples.
    pub fn new(len: usize, seed: u64, mode: Mode) -> Result<Self, OrderError> {
        if let Mode::PageGrouped { group, window } = mode {
            if group == 0 || window == 0 {
                return Err(OrderError(format!(
                    "page-grouped order needs group and window of at least 1 (got {group}, {window})"
                )));
            }
        }
        Ok(Self {
            len,
            seed,
            mode,
            rank: 0,
            world: 1,
            uneven: Uneven::Pad,
        })
    }

    /// This order, as rank `rank` of `world`.
    pub fn sharded(self, rank: usize, world: usize, uneven: Uneven) -> Result<Self, OrderError> {
        if world == 0 || rank >= world {
            return Err(OrderError(format!(
                "rank {rank} of a world of {world} (ranks count from 0)"
            )));
        }
        if uneven == Uneven::Exact && matches!(self.mode, Mode::PageGrouped { .. }) {
            return Err(OrderError(
                "exact sharding (each sample once) is for random and sequential orders, not \
                 page-grouped"
                    .into(),
            ));
        }
        if uneven == Uneven::Drop && self.len < world {
            return Err(OrderError(format!(
                "dropping the uneven tail of {} samples leaves nothing for {world} ranks",
                self.len
            )));
        }
        Ok(Self {
            rank,
            world,
            uneven,
            ..self
        })
    }

    /// Samples this rank gets each epoch.
    pub fn per_rank(&self) -> usize {
        match self.uneven {
            Uneven::Pad => self.len.div_ceil(self.world),
            Uneven::Drop => self.len / self.world,
            Uneven::Exact => (self.len + self.world - 1 - self.rank) / self.world,
        }
    }

    /// This rank's sample indices for `epoch`, in order.
    pub fn epoch(&self, epoch: u64) -> Vec<u64> {
        if self.len == 0 {
            return Vec::new();
        }
        let mut rng = SplitMix::new(self.seed, epoch);
        let per_rank = self.per_rank();
        let total = match self.uneven {
            Uneven::Exact => self.len,
            _ => per_rank * self.world,
        };
        match self.mode {
            Mode::Sequential | Mode::Random => {
                let mut all: Vec<u64> = (0..self.len as u64).collect();
                if self.mode == Mode::Random {
                    shuffle(&mut all, &mut rng);
                }
                // Pad by repeating the order from its start (or cut the tail), then stride.
                let all: Vec<u64> = all.iter().copied().cycle().take(total).collect();
                all.into_iter()
                    .skip(self.rank)
                    .step_by(self.world)
                    .collect()
            }
            Mode::PageGrouped { group, window } => {
                // The epoch's sequence is the groups in shuffled order, each read front to back;
                // padded (repeating from its start) or cut to `total`, it is split into `world`
                // contiguous blocks: each rank reads whole groups of its own (a group can only
                // be shared at a block boundary) and shuffles samples within windows of groups.
                let groups = self.len.div_ceil(group);
                let mut order: Vec<u64> = (0..groups as u64).collect();
                shuffle(&mut order, &mut rng);
                let sequence = order.iter().flat_map(|&g| {
                    let start = g as usize * group;
                    (start..(start + group).min(self.len)).map(|i| i as u64)
                });
                let mut samples: Vec<u64> = sequence
                    .cycle()
                    .skip(self.rank * per_rank)
                    .take(per_rank)
                    .collect();
                let mut local = rng.fork(self.rank as u64);
                for chunk in samples.chunks_mut(group * window) {
                    shuffle(chunk, &mut local);
                }
                samples
            }
        }
    }

    /// The samples still to come in `at.epoch` from `at.index` on (resuming skips the rest).
    pub fn remaining(&self, at: Position) -> Vec<u64> {
        let mut all = self.epoch(at.epoch);
        all.drain(..at.index.min(all.len()));
        all
    }
}

/// Fisher–Yates with the given generator.
fn shuffle<T>(items: &mut [T], rng: &mut SplitMix) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// SplitMix64 keyed by (seed, epoch): small, fast, and the same on every platform.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64, epoch: u64) -> Self {
        let mut s = Self(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        s.next();
        s
    }

    pub(crate) fn fork(self, stream: u64) -> Self {
        Self::new(self.0, stream.wrapping_add(0xA076_1D64_78BD_642F))
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (Lemire's multiply-shift with rejection: no modulo bias).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        loop {
            let m = (self.next() as u128) * (n as u128);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }
}

//! The `Collective` contract: what data parallelism needs of a communication library (NCCL's
//! vocabulary: all-reduce, broadcast, barrier), over tensors on any device.

use std::sync::Arc;

use redline_tensor::{DType, Event, HostBytes, Tensor};

use crate::error::{DistError, Result};

/// How an all-reduce combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The sum divided by the world size (DDP's gradient average; NCCL's `ncclAvg`).
    Avg,
    /// The largest value (a found-inf flag, the longest step).
    Max,
}

/// A group of processes, one per device, issuing the same collectives in the same order.
///
/// Every call is collective: each rank makes it with tensors of the same shapes and dtypes, and
/// it returns once this rank's tensors hold the result. A rank that fails or does not arrive
/// within the group's timeout makes every other rank's call return an error naming it — a job
/// never hangs on a dead peer. Tensors are updated in place (their storage keeps its device
/// address), so they must each own a whole dense storage, as gradients, parameters and buffers
/// do.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Reduces each tensor element-wise across ranks; every rank ends with the same result.
    fn all_reduce(&self, tensors: &[Tensor], op: Reduce) -> Result<()>;
    /// [`all_reduce`](Self::all_reduce) of tensors whose values are final at `ready` (an event
    /// recorded on their device after the ops that wrote them) and which nothing reads or
    /// writes until the returned event has been waited for ([`Device::wait_event`]). It may
    /// return before the device has the results: the returned event marks them. What a
    /// gradient bucket does while backward goes on. The default reduces at once and returns
    /// an event after its writes; a host collective downloads after `ready` only, a device
    /// collective runs on a stream of its own.
    ///
    /// [`Device::wait_event`]: redline_tensor::Device::wait_event
    fn all_reduce_after(&self, tensors: &[Tensor], op: Reduce, ready: &Event) -> Result<Event> {
        let _ = ready;
        self.all_reduce(tensors, op)?;
        after_writes(tensors)
    }
    /// Whether this group's collectives can be recorded into a captured device graph (a CUDA
    /// graph): issued on the tensors' device in stream order, ordered by events, with no host
    /// round trip and no host-side result — NCCL's are. A host collective downloads, so it is
    /// not (the default). The trainer captures a data-parallel step only over a group that is.
    /// Such a group's [`all_reduce_after`](Self::all_reduce_after) only enqueues, so
    /// [`crate::DataParallel`] issues its buckets from the backward thread and synchronised
    /// batch norm shares the group: one thread, one order of collectives on every rank.
    fn capturable(&self) -> bool {
        false
    }
    /// Fails once this group has failed (a rank died, a collective ran past the timeout): what
    /// enqueues its collectives without calling it — replaying a captured graph — asks first.
    /// The default: a host collective's calls fail by themselves.
    fn alive(&self) -> Result<()> {
        Ok(())
    }
    /// Holds device work that runs this group's collectives out of its sight (a replayed
    /// graph: `until` is recorded after it) to the group's timeout, as a collective it issued:
    /// not reached within it, the group fails (every later call and [`alive`](Self::alive)
    /// say why) and its collectives are ended, so a dead peer stops the job instead of hanging
    /// it. The default does nothing: its collectives never run out of its sight.
    fn watch(&self, until: &Event) -> Result<()> {
        let _ = until;
        Ok(())
    }
    /// Copies `root`'s tensors to every other rank.
    fn broadcast(&self, tensors: &[Tensor], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// A new group of the same ranks with a sequence of collectives of its own (PyTorch's
    /// `new_group`), for collectives issued from another thread than this group's — two
    /// threads sharing one group could issue theirs in different orders on different ranks.
    /// (Two device groups on one device bring their own hazard: NCCL asks that their
    /// collectives be issued in one order on every rank, which two threads do not give.)
    /// Collective: every rank calls it.
    fn split(&self) -> Result<Arc<dyn Collective>>;
}

/// The collective of a job of one process: every operation is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, tensors: &[Tensor], _op: Reduce) -> Result<()> {
        tensors.iter().try_for_each(check_dense)
    }
    fn all_reduce_after(&self, tensors: &[Tensor], _op: Reduce, ready: &Event) -> Result<Event> {
        tensors.iter().try_for_each(check_dense)?;
        Ok(ready.clone())
    }
    fn capturable(&self) -> bool {
        true
    }
    fn broadcast(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        check_root(root, 1)?;
        tensors.iter().try_for_each(check_dense)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn split(&self) -> Result<Arc<dyn Collective>> {
        Ok(Arc::new(SingleProcess))
    }
}

pub(crate) fn check_root(root: usize, world: usize) -> Result<()> {
    match root < world {
        true => Ok(()),
        false => Err(DistError::Usage(format!(
            "broadcast from rank {root} in a world of {world}"
        ))),
    }
}

/// A tensor a collective may overwrite: a whole dense storage of its own.
pub(crate) fn check_dense(t: &Tensor) -> Result<()> {
    match t.layout().is_contiguous() && t.storage().len() == t.numel() {
        true => Ok(()),
        false => Err(DistError::Usage(format!(
            "a collective writes whole tensors in place; this {:?} {} tensor is a view of a \
             {}-element storage",
            t.shape(),
            t.dtype(),
            t.storage().len()
        ))),
    }
}

/// The tensors' elements as one little-endian buffer, in order (a bucket's message): after
/// every op enqueued so far, or only after `after` (started together, waited for in turn).
pub(crate) fn download_all(tensors: &[Tensor], after: Option<&Event>) -> Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(tensors.iter().map(byte_len).sum());
    let Some(after) = after else {
        for t in tensors {
            check_dense(t)?;
            bytes.extend(t.device().backend().download(t.view())?);
        }
        return Ok(bytes);
    };
    let mut downloads = Vec::with_capacity(tensors.len());
    for t in tensors {
        check_dense(t)?;
        downloads.push(t.device().backend().download_after(t.view(), after)?);
    }
    for d in downloads {
        bytes.extend(d.wait()?);
    }
    Ok(bytes)
}

/// An event after the writes enqueued so far on the tensors' device (none: already reached).
pub(crate) fn after_writes(tensors: &[Tensor]) -> Result<Event> {
    match tensors.first() {
        Some(t) => Ok(t.device().record_event()?),
        None => Ok(Event::reached()),
    }
}

/// Writes a buffer made like [`download_all`]'s back into the tensors, in place.
pub(crate) fn upload_all(tensors: &[Tensor], bytes: &[u8]) -> Result<()> {
    let mut at = 0;
    for t in tensors {
        let len = byte_len(t);
        let part = bytes.get(at..at + len).ok_or_else(|| {
            DistError::Protocol(format!(
                "a {}-byte result for tensors of {} bytes",
                bytes.len(),
                tensors.iter().map(byte_len).sum::<usize>()
            ))
        })?;
        t.copy_from_host(HostBytes::Owned(part.to_vec()))?;
        at += len;
    }
    Ok(())
}

pub(crate) fn byte_len(t: &Tensor) -> usize {
    t.numel() * t.dtype().size()
}

/// What the tensors' elements are, in order: checked on every rank's contribution so that a
/// rank issuing a different collective is an error, not a silently mixed result.
pub(crate) fn signature(tensors: &[Tensor]) -> Vec<(DType, usize)> {
    tensors.iter().map(|t| (t.dtype(), t.numel())).collect()
}

/// Combines the ranks' buffers (in rank order) of elements described by `signature`: floats
/// accumulate in f64 and are rounded once, integers in i64 — the same bits on every rank
/// whatever the timing, since one rank computes the result for all.
#[cfg(test)]
pub(crate) fn reduce_host(
    contributions: &[Vec<u8>],
    signature: &[(DType, usize)],
    op: Reduce,
) -> Vec<u8> {
    let world = contributions.len() as f64;
    let mut out = Vec::new();
    for (bytes, dtype) in pieces(signature, usize::MAX) {
        let slices: Vec<&[u8]> = contributions.iter().map(|c| &c[bytes.clone()]).collect();
        out.extend(reduce_piece(&slices, dtype, op, world));
    }
    out
}

/// A buffer of elements described by `signature` cut into pieces of at most `max_bytes` (at
/// least one element), each holding elements of one dtype: the unit a collective streams and
/// combines, so that receiving, combining and sending overlap.
pub(crate) fn pieces(
    signature: &[(DType, usize)],
    max_bytes: usize,
) -> Vec<(std::ops::Range<usize>, DType)> {
    let mut out = Vec::new();
    // Where this tensor's bytes start (tensors of different dtypes share one buffer).
    let mut at = 0;
    for &(dtype, n) in signature {
        let step = (max_bytes / dtype.size()).max(1);
        let mut done = 0;
        while done < n {
            let count = step.min(n - done);
            let start = at + done * dtype.size();
            out.push((start..start + count * dtype.size(), dtype));
            done += count;
        }
        at += n * dtype.size();
    }
    out
}

/// Combines one piece (elements of `dtype`) of every rank's contribution, in rank order:
/// floats in f64, rounded once; integers in i64. `world` divides an average.
pub(crate) fn reduce_piece(slices: &[&[u8]], dtype: DType, op: Reduce, world: f64) -> Vec<u8> {
    let Some(first) = slices.first() else {
        return Vec::new();
    };
    let mut dst = first.to_vec();
    let n = dst.len() / dtype.size();
    if dtype == DType::F32 {
        reduce_f32(slices, &mut dst, op, world);
    } else if dtype.is_float() {
        for i in 0..n {
            let values = slices.iter().map(|s| dtype.read(s, i));
            let v = match op {
                Reduce::Sum => values.sum::<f64>(),
                Reduce::Avg => values.sum::<f64>() / world,
                Reduce::Max => values.fold(f64::NEG_INFINITY, max_nan),
            };
            dtype.write(&mut dst, i, v);
        }
    } else {
        for i in 0..n {
            let values = slices.iter().map(|s| read_int(dtype, s, i));
            let v = match op {
                Reduce::Sum => values.fold(0i64, i64::wrapping_add),
                Reduce::Avg => values.fold(0i64, i64::wrapping_add) / world as i64,
                Reduce::Max => values.max().unwrap_or(0),
            };
            write_int(dtype, &mut dst, i, v);
        }
    }
    dst
}

/// [`reduce_host`] for f32 (gradients, almost always), without the per-element dtype dispatch:
/// the same f64 accumulation in rank order and one rounding, block by block (a cache-sized
/// accumulator instead of one the size of the bucket).
fn reduce_f32(slices: &[&[u8]], dst: &mut [u8], op: Reduce, world: f64) {
    const BLOCK: usize = 4096;
    let mut acc = [0f64; BLOCK];
    for (b, out) in dst.chunks_mut(4 * BLOCK).enumerate() {
        let range = b * 4 * BLOCK..b * 4 * BLOCK + out.len();
        let acc = &mut acc[..out.len() / 4];
        for (r, s) in slices.iter().enumerate() {
            for (a, v) in acc.iter_mut().zip(f32_values(&s[range.clone()])) {
                *a = match (r, op) {
                    (0, _) => v,
                    (_, Reduce::Sum | Reduce::Avg) => *a + v,
                    (_, Reduce::Max) => max_nan(*a, v),
                };
            }
        }
        for (o, &a) in out.chunks_exact_mut(4).zip(acc.iter()) {
            let v = if op == Reduce::Avg { a / world } else { a };
            o.copy_from_slice(&(v as f32).to_le_bytes());
        }
    }
}

/// The f32 elements of little-endian bytes, widened.
fn f32_values(bytes: &[u8]) -> impl Iterator<Item = f64> + '_ {
    (bytes.chunks_exact(4)).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

/// The larger value, NaN winning (a NaN found-inf flag or loss must reach every rank).
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn read_int(dtype: DType, bytes: &[u8], i: usize) -> i64 {
    match dtype {
        DType::I64 => i64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8])),
        _ => dtype.read(bytes, i) as i64,
    }
}

fn write_int(dtype: DType, bytes: &mut [u8], i: usize, v: i64) {
    match dtype {
        DType::I64 => bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes()),
        _ => dtype.write(bytes, i, v as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn pieces_hold_whole_elements_of_one_dtype() {
        let sig = [(DType::U8, 3), (DType::F64, 3), (DType::F32, 1)];
        let cut: Vec<_> = pieces(&sig, 16)
            .into_iter()
            .map(|(r, d)| (r.start, r.end, d))
            .collect();
        assert_eq!(
            cut,
            [
                (0, 3, DType::U8),
                (3, 19, DType::F64),
                (19, 27, DType::F64),
                (27, 31, DType::F32)
            ]
        );
        assert!(pieces(&[], 16).is_empty());
    }

    #[test]
    fn host_reduction_sums_averages_and_maxes_in_rank_order() {
        let a = [f32s(&[1.0, -2.0, 0.5]), f32s(&[3.0, 4.0, f32::NAN])];
        let sig = [(DType::F32, 3)];
        let read = |b: Vec<u8>| redline_tensor::dtype::from_bytes::<f32>(&b, DType::F32);
        assert_eq!(read(reduce_host(&a, &sig, Reduce::Sum))[..2], [4.0, 2.0]);
        assert_eq!(read(reduce_host(&a, &sig, Reduce::Avg))[..2], [2.0, 1.0]);
        let max = read(reduce_host(&a, &sig, Reduce::Max));
        assert_eq!(max[..2], [3.0, 4.0]);
        assert!(max[2].is_nan(), "a NaN reaches every rank");
        // More elements than one accumulation block, three ranks: each element's average.
        let n = 10_000;
        let ranks: Vec<Vec<u8>> = (0..3)
            .map(|r| {
                f32s(
                    &(0..n)
                        .map(|i| (i * (r + 1)) as f32 * 0.25)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let avg = read(reduce_host(&ranks, &[(DType::F32, n)], Reduce::Avg));
        // Streamed in small pieces, the same bits.
        let sig = [(DType::F32, n)];
        let mut streamed = Vec::new();
        for (bytes, dtype) in pieces(&sig, 4000) {
            let slices: Vec<&[u8]> = ranks.iter().map(|c| &c[bytes.clone()]).collect();
            streamed.extend(reduce_piece(&slices, dtype, Reduce::Avg, 3.0));
        }
        assert_eq!(read(streamed), avg);
        assert!((0..n).all(|i| avg[i] == ((i * 6) as f64 * 0.25 / 3.0) as f32));
        // The generic path (f16 then f64 in one buffer): accumulated in f64, rounded once.
        let sig = [(DType::F16, 2), (DType::F64, 1)];
        let buffer = |h: [f32; 2], d: f64| {
            let mut b = vec![0u8; 2 * 2 + 8];
            DType::F16.write(&mut b[..4], 0, h[0] as f64);
            DType::F16.write(&mut b[..4], 1, h[1] as f64);
            b[4..].copy_from_slice(&d.to_le_bytes());
            b
        };
        let sum = reduce_host(
            &[buffer([1.0, 2.0], 0.5), buffer([3.0, -8.0], 0.25)],
            &sig,
            Reduce::Sum,
        );
        assert_eq!(DType::F16.read(&sum[..4], 0), 4.0);
        assert_eq!(DType::F16.read(&sum[..4], 1), -6.0);
        assert_eq!(f64::from_le_bytes(sum[4..].try_into().unwrap()), 0.75);
        let big = [i64::MAX - 1, 7];
        let ints: Vec<Vec<u8>> = big.iter().map(|v| v.to_le_bytes().to_vec()).collect();
        let sum = reduce_host(&ints, &[(DType::I64, 1)], Reduce::Max);
        assert_eq!(i64::from_le_bytes(sum.try_into().unwrap()), i64::MAX - 1);
    }
}

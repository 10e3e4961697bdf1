//! What the backend needs from a GPU, as a trait with two implementations: the CUDA driver, and
//! the host emulator that runs the same kernels on the CPU (see `kernels/emulate.h`). Every
//! launcher in `ops/` talks to this trait only, so CI exercises the launch code (grids, strides,
//! argument packing) and the kernels together, without a GPU.

use std::ffi::c_void;
use std::fmt;

use std::sync::Arc;

use redline_hostmem::HostAllocator;
use redline_tensor::{Download, HostBytes, Result, TensorError};

use crate::convolution::ConvPlan;
use crate::gemm::GemmPlan;
use crate::libs::LibReport;

/// An address in device memory (a host address on the emulator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
}

/// A kernel launch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl LaunchShape {
    /// A 1-d grid of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
        }
    }
}

/// A CUDA event shared between the op that recorded it and those that wait for it.
pub type GpuEvent = Arc<cudarc::driver::CudaEvent>;

pub trait Gpu: Send + Sync + fmt::Debug {
    /// "cuda:0 (NVIDIA H200)", "cuda-emulator".
    fn name(&self) -> String;

    /// `bytes` of device memory (at least one byte is reserved for an empty request).
    fn alloc(&self, bytes: usize) -> Result<DevicePtr>;

    /// Returns memory from [`alloc`](Self::alloc); called once per allocation, after every
    /// launch that uses it has been enqueued.
    fn free(&self, ptr: DevicePtr);

    /// Copies `bytes` to `dst` (stream-ordered; the bytes may be reused once this returns).
    fn upload(&self, dst: DevicePtr, bytes: &[u8]) -> Result<()>;

    /// Copies `out.len()` bytes from `src`, after every enqueued launch has finished.
    fn download(&self, src: DevicePtr, out: &mut [u8]) -> Result<()>;

    /// Copies `bytes` (which the GPU now owns) to `dst`. A pinned pooled buffer is copied
    /// asynchronously and returns to its pool only once its copy has completed; the default
    /// copies as [`Gpu::upload`] does and drops the buffer at once.
    fn upload_owned(&self, dst: DevicePtr, bytes: HostBytes) -> Result<()> {
        self.upload(dst, &bytes)
    }

    /// Starts copying `len` bytes from `src` after every enqueued launch; the returned
    /// [`Download`] waits for them. The default copies at once.
    fn download_async(&self, src: DevicePtr, len: usize) -> Result<Download> {
        let mut bytes = vec![0u8; len];
        self.download(src, &mut bytes)?;
        Ok(Download::ready(bytes))
    }

    /// An event recorded after every launch and copy enqueued so far; `None` where they have
    /// finished when enqueued (the emulator).
    fn record_event(&self) -> Result<Option<GpuEvent>> {
        Ok(None)
    }

    /// [`Gpu::upload_owned`] on the copy stream after `after` (pinned bytes; pageable ones are
    /// copied in stream order), returning the event the copy is complete at; `None` where
    /// copies finish when enqueued (the emulator).
    fn upload_owned_after(
        &self,
        dst: DevicePtr,
        bytes: HostBytes,
        after: &GpuEvent,
    ) -> Result<Option<GpuEvent>> {
        let _ = after;
        self.upload_owned(dst, bytes)?;
        self.record_event()
    }

    /// Launches enqueued after this wait on the device for `event` (which may have been
    /// recorded on another stream).
    fn wait_event(&self, event: &GpuEvent) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// Like [`Gpu::download_async`], ordered after `after` only: the copy runs on a copy
    /// stream that waits for the event, not behind launches enqueued since.
    fn download_after(&self, src: DevicePtr, len: usize, after: &GpuEvent) -> Result<Download> {
        let _ = after;
        self.download_async(src, len)
    }

    /// This device's member, `rank` of `world`, of the NCCL group `id` names, with a stream of
    /// its own; collectives unfinished after `timeout` abort it. The emulator has no NCCL.
    fn nccl(
        &self,
        id: &crate::nccl::UniqueId,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<crate::nccl::Communicator> {
        let _ = (id, rank, world, timeout);
        Err(TensorError::Backend {
            device: self.name(),
            what: "NCCL runs on CUDA devices only; this is not one".into(),
        })
    }

    /// Starts capturing: launches and library calls are recorded into a graph instead of
    /// running, until [`Gpu::end_capture`]. While it runs, host copies, downloads, timestamps
    /// and synchronizations are errors (a graph cannot hold them). `Err`: this GPU cannot.
    fn begin_capture(&self) -> Result<()> {
        Err(TensorError::Backend {
            device: self.name(),
            what: "this GPU cannot capture graphs".into(),
        })
    }

    /// Ends the capture and returns what it recorded, ready to replay.
    fn end_capture(&self) -> Result<Captured> {
        Err(TensorError::Backend {
            device: self.name(),
            what: "no capture to end".into(),
        })
    }

    /// Enqueues captured work again.
    fn replay(&self, captured: &Captured) -> Result<()> {
        let _ = captured;
        Err(TensorError::Backend {
            device: self.name(),
            what: "this GPU cannot replay graphs".into(),
        })
    }

    /// Records the device's clock into timestamp slot `slot` (below [`TIMESTAMP_SLOTS`]) once
    /// every launch enqueued before has finished. `Ok(false)`: this GPU has no clock.
    ///
    /// [`TIMESTAMP_SLOTS`]: redline_tensor::TIMESTAMP_SLOTS
    fn record_clock(&self, slot: usize) -> Result<bool> {
        let _ = slot;
        Ok(false)
    }

    /// The readings of `slots` in nanoseconds on the device's clock, waiting for them.
    fn read_clock(&self, slots: &[usize]) -> Result<Vec<u64>> {
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        Err(TensorError::Backend {
            device: self.name(),
            what: "this GPU takes no timestamps".into(),
        })
    }

    /// Page-locked host memory for loader pools, where the GPU has it.
    fn host_allocator(&self) -> Option<Arc<dyn HostAllocator>> {
        None
    }

    /// Enqueues kernel `kernel` (its name expression, e.g. `unary<float, UnaryOp::Exp>`).
    fn launch(&self, kernel: &str, shape: LaunchShape, args: &KernelArgs) -> Result<()>;

    /// Waits for every enqueued launch and copy.
    fn synchronize(&self) -> Result<()>;

    /// Enqueues `plan` through the vendor BLAS (cuBLASLt) with each operand's first element at
    /// `[a, b, d]` (BLAS's operands: see [`GemmPlan`]). `Ok(false)`: there is none here (the
    /// emulator, or a library that could not be loaded — [`Gpu::libraries`] says why), so the
    /// caller runs its own kernel.
    fn gemm(&self, plan: &GemmPlan, operands: [DevicePtr; 3]) -> Result<bool> {
        let _ = (plan, operands);
        Ok(false)
    }

    /// Enqueues `plan` through cuDNN with cuDNN's `x`, `w` and `y` (first elements) at
    /// `[x, w, y]`; with `accumulate` the result is added to what the written operand holds
    /// (β = 1). `Ok(false)`: no cuDNN here, or it refused this plan (or the addition) — the
    /// caller runs its own kernel ([`Gpu::libraries`] says why), or adds itself.
    fn conv(&self, plan: &ConvPlan, operands: [DevicePtr; 3], accumulate: bool) -> Result<bool> {
        let _ = (plan, operands, accumulate);
        Ok(false)
    }

    /// Whether a half-precision channels-last convolution over 3 input channels (a network's
    /// stem) should run padded to 4 channels: where the convolution goes to cuDNN, whose
    /// tensor-core kernels want the channel count a multiple of 4 (MLPerf's ResNet pads its
    /// input the same way). Our own kernels gain nothing from it.
    fn pads_stem_channels(&self) -> bool {
        false
    }

    /// The vendor libraries behind [`Gpu::gemm`] and [`Gpu::conv`] (loading is attempted here
    /// if it was not yet).
    fn libraries(&self) -> Vec<Library> {
        Vec::new()
    }

    /// Whether the caching allocator should ask for exactly the bytes requested instead of a
    /// size class: the emulator's guard bytes then sit right after each storage's last element.
    fn exact_sizes(&self) -> bool {
        false
    }
}

/// Work a capture recorded: the emulator's launches (replayed one by one, on the host), or a
/// CUDA graph instantiated for the device (replayed with one `cuGraphLaunch`).
pub enum Captured {
    Launches(Vec<(String, LaunchShape, KernelArgs)>),
    Graph { exec: CudaGraph, nodes: usize },
}

impl Captured {
    /// Operations per replay: kernels, library calls and copies.
    pub fn nodes(&self) -> usize {
        match self {
            Captured::Launches(launches) => launches.len(),
            Captured::Graph { nodes, .. } => *nodes,
        }
    }
}

impl fmt::Debug for Captured {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Captured({} nodes)", self.nodes())
    }
}

/// cudarc's instantiated graph, launched by one thread at a time (behind a lock).
pub struct CudaGraph(pub std::sync::Mutex<cudarc::driver::CudaGraph>);

// SAFETY: a CUgraphExec may be launched from any thread; the lock makes launches one at a time.
unsafe impl Send for CudaGraph {}
unsafe impl Sync for CudaGraph {}

/// A vendor library as a device uses it: loaded (file, version, the plans it refused so far,
/// which run on our kernels) or why it is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Library {
    pub name: &'static str,
    pub loaded: std::result::Result<(LibReport, Vec<String>), String>,
    /// How it picks its algorithms, where that is a choice (cuDNN: measured or heuristic).
    pub algorithms: Option<String>,
    /// The algorithm each prepared plan runs, a line each (cuDNN).
    pub choices: Vec<String>,
    /// Calls that added their result into a waiting gradient (cuDNN's β = 1) so far.
    pub added_in_place: u64,
}

impl Library {
    pub fn new(
        name: &'static str,
        loaded: std::result::Result<(LibReport, Vec<String>), String>,
    ) -> Self {
        Self {
            name,
            loaded,
            algorithms: None,
            choices: Vec::new(),
            added_in_place: 0,
        }
    }

    pub fn with_algorithms(mut self, how: Option<String>, choices: Vec<String>) -> Self {
        self.algorithms = how;
        self.choices = choices;
        self
    }

    pub fn with_added_in_place(mut self, calls: u64) -> Self {
        self.added_in_place = calls;
        self
    }
}

/// A kernel's parameters in cuLaunchKernel's form: one pointer per parameter, to its bytes.
/// Every value sits in 8-byte words, so any parameter type is read at its alignment.
#[derive(Debug, Default, Clone)]
pub struct KernelArgs {
    values: Vec<Vec<u64>>,
    /// Each parameter's size in bytes (the emulator checks them against the kernel's).
    sizes: Vec<usize>,
}

impl KernelArgs {
    pub fn new() -> Self {
        Self::default()
    }

    /// A parameter given as its bytes (a struct passed by value).
    pub fn bytes(self, bytes: &[u8]) -> Self {
        self.push_bytes(bytes)
    }

    fn push_bytes(mut self, bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
        // SAFETY: `words` spans at least `bytes.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr().cast(), bytes.len())
        };
        self.values.push(words);
        self.sizes.push(bytes.len());
        self
    }

    pub fn ptr(self, p: DevicePtr) -> Self {
        self.push_bytes(&p.0.to_ne_bytes())
    }
    pub fn i64(self, v: i64) -> Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    pub fn f64(self, v: f64) -> Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    /// An array of doubles passed by value (a kernel parameter that is a struct of doubles).
    pub fn f64s(self, values: &[f64]) -> Self {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.push_bytes(&bytes)
    }
    pub fn u64(self, v: u64) -> Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    pub fn i32(self, v: i32) -> Self {
        self.push_bytes(&v.to_ne_bytes())
    }
    pub fn strided(self, s: &Strided) -> Self {
        // SAFETY: Strided is repr(C) plain data without padding bytes (see its layout test).
        let bytes = unsafe {
            std::slice::from_raw_parts((s as *const Strided).cast::<u8>(), size_of::<Strided>())
        };
        self.push_bytes(bytes)
    }

    /// Each parameter's size in bytes, in order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The `void**` array a launch takes; valid while `self` is.
    pub fn pointers(&self) -> Vec<*mut c_void> {
        self.values
            .iter()
            .map(|w| w.as_ptr() as *mut c_void)
            .collect()
    }
}

/// The most axes an operand may have; mirrors `MAX_RANK` in `kernels/common.cuh`.
pub const MAX_RANK: usize = 8;

/// An operand's layout for a kernel; mirrors `struct Strided` in `kernels/common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided {
    pub offset: i64,
    pub rank: i32,
    /// How the kernel finds element `i`: one of the `WALK_*` constants.
    pub walk: i32,
    pub shape: [i64; MAX_RANK],
    pub stride: [i64; MAX_RANK],
    /// With `shift`, the divisor of each axis: `i / shape[d]` is
    /// `(umulhi(i, magic[d]) + i) >> shift[d]` for `i < 2^31` (see [`divisor`]).
    pub magic: [u32; MAX_RANK],
    pub shift: [u32; MAX_RANK],
}

/// `(magic, shift)` such that `n / d == (umulhi(n, magic) + n) >> shift` for every `n < 2^31`,
/// `1 <= d < 2^31` (Granlund and Montgomery, "Division by invariant integers using
/// multiplication", 1994; the form PyTorch's `IntDivider` uses). A multiply-high, an add and a
/// shift in place of the GPU's software division.
pub fn divisor(d: u32) -> (u32, u32) {
    debug_assert!((1..1 << 31).contains(&d), "divisor {d}");
    let shift = 32 - (d - 1).leading_zeros(); // ceil(log2 d)
    let magic = (((1u64 << shift) - u64::from(d)) << 32) / u64::from(d) + 1;
    (magic as u32, shift)
}

/// What `divide` in `kernels/common.cuh` computes, for the tests.
#[cfg(test)]
fn divide(n: u32, (magic, shift): (u32, u32)) -> u32 {
    let high = ((u64::from(n) * u64::from(magic)) >> 32) as u32;
    (high + n) >> shift
}

impl Strided {
    /// Coordinates by 64-bit division: only for operands of 2^31 elements or more.
    pub const WALK_INDEX64: i32 = 0;
    /// `offset + i`: no index arithmetic.
    pub const WALK_CONTIGUOUS: i32 = 1;
    /// Coordinates by 32-bit multiply-high division (every index below 2^31).
    pub const WALK_INDEX32: i32 = 2;

    /// `layout` for a kernel; more than [`MAX_RANK`] axes is an error naming `what`.
    pub fn new(layout: &redline_tensor::Layout, device: &str, what: &str) -> Result<Self> {
        Self::from_parts(
            layout.shape(),
            layout.strides(),
            layout.offset(),
            device,
            what,
        )
    }

    /// A dense row-major run of `n` elements from `offset`.
    pub fn contiguous(n: usize, offset: usize) -> Self {
        let mut s = Self::empty(offset, 1);
        s.walk = Strided::WALK_CONTIGUOUS;
        s.shape[0] = n.max(1) as i64;
        s.stride[0] = 1;
        s
    }

    fn empty(offset: usize, rank: usize) -> Self {
        Self {
            offset: offset as i64,
            rank: rank as i32,
            walk: Strided::WALK_INDEX64,
            shape: [1; MAX_RANK],
            stride: [0; MAX_RANK],
            magic: [1; MAX_RANK],
            shift: [0; MAX_RANK],
        }
    }

    pub fn from_parts(
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        device: &str,
        what: &str,
    ) -> Result<Self> {
        if shape.len() > MAX_RANK {
            return Err(TensorError::Backend {
                device: device.into(),
                what: format!(
                    "{what}: {} axes, the CUDA kernels take at most {MAX_RANK}",
                    shape.len()
                ),
            });
        }
        let mut s = Self::empty(offset, shape.len());
        for (d, (&n, &st)) in shape.iter().zip(strides).enumerate() {
            s.shape[d] = n.max(1) as i64;
            s.stride[d] = st as i64;
        }
        // Row-major dense (ignoring axes of size 1): the kernel skips the index arithmetic.
        let mut expect = 1usize;
        let mut dense = true;
        for (&n, &st) in shape.iter().zip(strides).rev() {
            if n != 1 && st != expect {
                dense = false;
            }
            expect *= n;
        }
        // Over the sizes the kernel divides by (at least 1 each): every index and every axis
        // then fits the 32-bit walk, an empty operand's long axis included.
        let walked = s.shape[..shape.len()]
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64));
        s.walk = if dense {
            Strided::WALK_CONTIGUOUS
        } else if walked < 1 << 31 {
            for d in 0..shape.len() {
                (s.magic[d], s.shift[d]) = divisor(s.shape[d] as u32);
            }
            Strided::WALK_INDEX32
        } else {
            Strided::WALK_INDEX64
        };
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_matches_the_kernels_struct() {
        // i64 offset, i32 rank, i32 walk, two arrays of MAX_RANK i64, two of MAX_RANK u32:
        // no padding.
        assert_eq!(
            size_of::<Strided>(),
            8 + 4 + 4 + 2 * 8 * MAX_RANK + 2 * 4 * MAX_RANK
        );
    }

    #[test]
    fn dense_layouts_walk_contiguously_others_by_32_bit_division_below_2_31_elements() {
        let dense = Strided::from_parts(&[2, 3, 4], &[12, 4, 1], 5, "t", "x").unwrap();
        assert_eq!(dense.walk, Strided::WALK_CONTIGUOUS);
        let ones = Strided::from_parts(&[2, 1, 4], &[4, 99, 1], 0, "t", "x").unwrap();
        assert_eq!(ones.walk, Strided::WALK_CONTIGUOUS);
        let broadcast = Strided::from_parts(&[2, 3], &[0, 1], 0, "t", "x").unwrap();
        assert_eq!(broadcast.walk, Strided::WALK_INDEX32);
        assert_eq!((broadcast.magic[1], broadcast.shift[1]), divisor(3));
        let transposed = Strided::from_parts(&[3, 2], &[1, 3], 0, "t", "x").unwrap();
        assert_eq!(transposed.walk, Strided::WALK_INDEX32);
        // 2^31 elements (a broadcast view costs no memory): indices past 32-bit division's range.
        let huge = Strided::from_parts(&[1 << 16, 1 << 15], &[0, 1], 0, "t", "x").unwrap();
        assert_eq!(huge.walk, Strided::WALK_INDEX64);
        let below = Strided::from_parts(&[(1 << 16) - 1, 1 << 15], &[0, 1], 0, "t", "x").unwrap();
        assert_eq!(below.walk, Strided::WALK_INDEX32);
        // No elements, but an axis past 32 bits: not a divisor the 32-bit walk can hold.
        let empty = Strided::from_parts(&[5, 0, 1 << 32], &[0, 1, 1], 0, "t", "x").unwrap();
        assert_eq!(empty.walk, Strided::WALK_INDEX64);
        let err = Strided::from_parts(&[1; 9], &[1; 9], 0, "cuda:0", "add").unwrap_err();
        assert!(err.to_string().contains("9 axes"), "{err}");
    }

    #[test]
    fn the_32_bit_divisors_divide_every_index_below_2_31_exactly() {
        // Small divisors exhaustively against the numerators near every multiple's edges, and
        // the divisors around powers of two (where the shift changes) and at the top of the
        // range, against numerators spread over [0, 2^31).
        let top = (1u32 << 31) - 1;
        let mut divisors: Vec<u32> = (1..=4096).collect();
        for k in 1..31 {
            let p = 1u32 << k;
            divisors.extend([p - 1, p, p + 1]);
        }
        divisors.extend([7 * 7 * 2048, 112 * 112 * 64, 224 * 224 * 3, top - 1, top]);
        for &d in &divisors {
            let div = divisor(d);
            let edges = (1..64u32).flat_map(|q| {
                let at = q.saturating_mul(d);
                [at.saturating_sub(1), at, at.saturating_add(1)]
            });
            let spread = (0..2048u32).map(|k| k.wrapping_mul(1_048_573) % (1 << 31));
            for n in edges.chain(spread).chain([0, 1, top - 1, top]) {
                let n = n.min(top);
                assert_eq!(divide(n, div), n / d, "{n} / {d} with {div:?}");
            }
        }
    }
}

//! The CUDA driver behind [`Gpu`]: one context and one created (non-default) stream per device,
//! raw stream-ordered allocations, kernels from CUBIN compiled by NVRTC for the device's exact
//! architecture, launched with `cuLaunchKernel`'s `void**` parameters — the same ones the host
//! emulator takes.
//!
//! Detection never panics: the driver library is found by file (`libcuda.so.1`, see
//! [`crate::libs`]) and loaded before cudarc's first call (cudarc panics when it finds none),
//! and "no NVIDIA driver", "a driver but no device" and "library not found (looked in …)" come
//! back as errors. `CUDA_VISIBLE_DEVICES` is honoured by the driver itself.
//!
//! Not yet run on a GPU: written against cudarc 0.19's API and compiled in CI; the GPU check
//! (`gpu-check`) that proves it is still to come.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use redline_hostmem::HostAllocator;
use redline_tensor::{Download, HostBytes, Result, TensorError};

use crate::compile;
use crate::convolution::ConvPlan;
use crate::cublaslt::{self, CublasLt};
use crate::cudnn::{self, Choosing, Cudnn};
use crate::gemm::GemmPlan;
use crate::gpu::{Captured, CudaGraph, DevicePtr, Gpu, GpuEvent, KernelArgs, LaunchShape, Library};
use crate::kernels;
use crate::libs::{self, LibError, LibReport};
use crate::nvrtc::Nvrtc;
use crate::plans::{self, Declined};
use crate::stream::{Clock, InFlight, PinnedAllocator, Staging};

/// Why there is no CUDA device here: an ordinary answer, never a panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    NoDriver(LibError),
    NoDevice(String),
    Failed(String),
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::NoDriver(e) => write!(f, "no NVIDIA driver: {e}"),
            Unavailable::NoDevice(why) => write!(f, "an NVIDIA driver but no device: {why}"),
            Unavailable::Failed(why) => write!(f, "the CUDA driver failed: {why}"),
        }
    }
}

impl std::error::Error for Unavailable {}

/// The driver library, loaded once from the file [`libs`] chose (kept for the process).
fn driver_library() -> Result<&'static PathBuf, Unavailable> {
    static LOADED: OnceLock<Result<(PathBuf, libloading::Library), LibError>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let path = match libs::find("libcuda.so.1") {
            Ok(path) => path,
            // Not in the folders searched: where the dynamic linker finds it, if anywhere (the
            // error names the folders searched, as before).
            Err(not_found) => return libs::load_by_soname("libcuda.so.1").map_err(|_| not_found),
        };
        let lib = libs::load_global(&path)?;
        Ok((path, lib))
    });
    match loaded {
        Ok((path, _)) => Ok(path),
        Err(e) => Err(Unavailable::NoDriver(e.clone())),
    }
}

/// Runs a cudarc call that may panic on a missing library or symbol, as an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, Unavailable> {
    libs::catch_panic(what, f).map_err(Unavailable::Failed)
}

/// How many devices the driver sees (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize, Unavailable> {
    driver_library()?;
    // SAFETY: the driver library is loaded (above), so cudarc finds it.
    if !guarded("loading the driver", || unsafe { sys::is_culib_present() })? {
        return Err(Unavailable::NoDriver(LibError::Load {
            path: driver_library()?.clone(),
            why: "loaded, but cudarc cannot open it".into(),
        }));
    }
    match guarded("cuDeviceGetCount", CudaContext::device_count)? {
        Ok(0) => Err(Unavailable::NoDevice("the driver reports 0 devices".into())),
        Ok(n) => Ok(n as usize),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(Unavailable::NoDevice(
            "cuInit: CUDA_ERROR_NO_DEVICE (check CUDA_VISIBLE_DEVICES)".into(),
        )),
        Err(e) => Err(Unavailable::Failed(format!("cuInit: {e:?}"))),
    }
}

/// What a device is: for reports and the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// "sm_90" for compute capability 9.0.
    pub arch: String,
    pub total_bytes: usize,
    /// As nvidia-smi prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    pub driver_version: i32,
    pub driver_path: PathBuf,
}

/// 16 UUID bytes in nvidia-smi's form.
fn format_uuid(b: &[u8; 16]) -> String {
    let hex =
        |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// A family's module on this device: each name expression's function.
struct Module {
    _module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
}

// SAFETY: CUDA handles are usable from any thread once the context is current there (every use
// below binds the context first), and a Module is never changed after it is built.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

/// What a user chooses about a device; [`DriverOptions::from_env`] reads the environment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverOptions {
    /// Our GEMM and convolutions instead of cuBLASLt and cuDNN (`REDLINE_CUDA_OWN_KERNELS=1`):
    /// to compare them, or to rule a library out.
    pub own_kernels: bool,
    /// Deterministic cuDNN algorithms only (`REDLINE_CUDA_DETERMINISTIC=1`, as
    /// `torch.backends.cudnn.deterministic`); our kernels always are.
    pub deterministic: bool,
    /// cuDNN's heuristic choice of algorithm instead of measuring each plan's with cuDNN's Find
    /// and keeping it on disk (`REDLINE_CUDNN_FIND=0`).
    pub cudnn_heuristic: bool,
    /// Synchronise after every launch and name the op that failed (`REDLINE_CUDA_LAUNCH_BLOCKING=1`
    /// or `CUDA_LAUNCH_BLOCKING=1`).
    pub launch_blocking: bool,
    /// The 3-channel stem convolution handed to cuDNN as it is, not padded to 4 channels
    /// (`REDLINE_CUDNN_PAD_STEM=0`): to measure what the padding gains.
    pub stem_unpadded: bool,
    /// A convolution's input gradient written fresh and then added to the gradient waiting
    /// for it, not added by cuDNN in place (β = 1; `REDLINE_CUDNN_ACCUMULATE=0`): to measure
    /// what the in-place addition gains, or to rule it out.
    pub no_accumulate: bool,
}

impl DriverOptions {
    pub fn from_env() -> Self {
        let on = |var: &str| std::env::var(var).is_ok_and(|v| v == "1");
        Self {
            own_kernels: on("REDLINE_CUDA_OWN_KERNELS"),
            deterministic: on("REDLINE_CUDA_DETERMINISTIC"),
            cudnn_heuristic: std::env::var("REDLINE_CUDNN_FIND").is_ok_and(|v| v == "0"),
            launch_blocking: on("REDLINE_CUDA_LAUNCH_BLOCKING") || on("CUDA_LAUNCH_BLOCKING"),
            stem_unpadded: std::env::var("REDLINE_CUDNN_PAD_STEM").is_ok_and(|v| v == "0"),
            no_accumulate: std::env::var("REDLINE_CUDNN_ACCUMULATE").is_ok_and(|v| v == "0"),
        }
    }
}

/// cuBLASLt with the workspace it may use.
struct Blas {
    lt: CublasLt,
    workspace: DevicePtr,
}

/// The CUDA version whose bindings this build calls (cudarc's version feature): an older
/// driver lacks some of their entry points, and the libraries and CUBINs of that CUDA need it.
const BUILT_FOR_CUDA: i32 = match cfg!(feature = "cuda-13000") {
    true => 13000,
    false => 12080,
};

/// Why a driver of CUDA `version` (cuDriverGetVersion's 1000 · major + 10 · minor) is refused.
fn too_old(version: i32) -> String {
    let v = |n: i32| format!("{}.{}", n / 1000, n % 1000 / 10);
    format!(
        "the NVIDIA driver supports CUDA {}; this build needs CUDA {} or newer (a driver that \
         supports it, or a build for CUDA 12.8: --no-default-features --features cuda-12080)",
        v(version),
        v(BUILT_FOR_CUDA)
    )
}

/// One CUDA device.
pub struct CudaDriver {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Transfers ordered by events instead of behind every launch (created on first use).
    copy_stream: OnceLock<Arc<CudaStream>>,
    /// Whether the stream is being captured into a graph.
    capturing: AtomicBool,
    info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
    nvrtc: OnceLock<Result<Nvrtc, String>>,
    /// cuBLASLt and its workspace, loaded on the first GEMM (or why not).
    blas: OnceLock<Result<Blas, String>>,
    /// cuDNN, loaded on the first convolution (or why not), and its workspace (grown as plans
    /// need; the lock is held while a call that uses it is enqueued).
    dnn: OnceLock<Result<Cudnn, String>>,
    dnn_workspace: Mutex<(DevicePtr, usize)>,
    /// Blocks never freed while this driver lives, because a captured graph may use them: cuDNN
    /// workspaces outgrown (a graph holds the address it was captured with; freeing the block
    /// would let the pool hand it out while replays still write to it), and blocks freed while
    /// a capture runs (a free there would be a graph free node, which the driver accepts only
    /// for graph allocations). Workspaces grow by powers of two, so they hold less than the
    /// last one's size.
    retired: Mutex<Vec<DevicePtr>>,
    /// Blocks allocated with `cuMemAlloc` (during a capture: not stream-ordered), which
    /// `cuMemFreeAsync` does not take: freed with `cuMemFree` after the stream's work.
    unordered: Mutex<HashSet<u64>>,
    options: DriverOptions,
    clock: Mutex<Clock>,
    in_flight: InFlight,
    staging: Staging,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDriver({:?})", self.info)
    }
}

fn failed(device: &str, what: &str, e: impl std::fmt::Debug) -> TensorError {
    TensorError::Backend {
        device: device.into(),
        what: format!("{what}: {e:?}"),
    }
}

impl CudaDriver {
    /// Device `ordinal` with the options the environment sets.
    pub fn new(ordinal: usize) -> Result<Self, Unavailable> {
        Self::with_options(ordinal, DriverOptions::from_env())
    }

    /// Device `ordinal`: a context, a created stream, the device's description.
    pub fn with_options(ordinal: usize, options: DriverOptions) -> Result<Self, Unavailable> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Unavailable::NoDevice(format!(
                "cuda:{ordinal} asked for, {count} device(s) visible"
            )));
        }
        let fail = |what: &str, e: sys::CUresult| Unavailable::Failed(format!("{what}: {e:?}"));
        let ctx = guarded("cuCtx", || CudaContext::new(ordinal))?
            .map_err(|e| fail("creating the context", e.0))?;
        // Streams the backend created (the legacy default stream cannot be captured later), and
        // no per-allocation events: ordering is the one stream's.
        // SAFETY: called before any allocation of this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| fail("creating a stream", e.0))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| fail("compute capability", e.0))?;
        let mut driver_version = 0;
        // SAFETY: an out-parameter.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        if driver_version < BUILT_FOR_CUDA {
            return Err(Unavailable::Failed(too_old(driver_version)));
        }
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(|e| fail("device name", e.0))?,
            arch: format!("sm_{major}{minor}"),
            total_bytes: ctx.total_mem().map_err(|e| fail("device memory", e.0))?,
            uuid: ctx
                .uuid()
                .map(|u| format_uuid(&u.bytes.map(|b| b as u8)))
                .unwrap_or_else(|e| format!("unknown ({e:?})")),
            driver_version,
            driver_path: driver_library()?.clone(),
        };
        let staging = Staging::new(ctx.clone());
        Ok(Self {
            ctx,
            stream,
            copy_stream: OnceLock::new(),
            capturing: AtomicBool::new(false),
            info,
            modules: Mutex::new(HashMap::new()),
            nvrtc: OnceLock::new(),
            blas: OnceLock::new(),
            dnn: OnceLock::new(),
            dnn_workspace: Mutex::new((DevicePtr(0), 0)),
            retired: Mutex::new(Vec::new()),
            unordered: Mutex::new(HashSet::new()),
            options,
            clock: Mutex::new(Clock::default()),
            in_flight: InFlight::default(),
            staging,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn error(&self, what: &str, e: impl std::fmt::Debug) -> TensorError {
        failed(&self.name(), what, e)
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.error("binding the context", e))
    }

    /// Refuses `what` while the stream is captured (a graph cannot hold it; the driver would
    /// invalidate the capture).
    fn not_capturing(&self, what: &str) -> Result<()> {
        match self.capturing.load(Ordering::Acquire) {
            true => Err(self.error(
                &format!("{what} inside a graph capture"),
                "a graph replays device work only (copy inputs in before a replay, read results \
                 after it)",
            )),
            false => Ok(()),
        }
    }

    /// An event recorded on `stream` after everything enqueued there so far.
    fn event_on(&self, stream: &Arc<CudaStream>) -> Result<GpuEvent> {
        let event = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .and_then(|e| e.record(stream).map(|()| e))
            .map_err(|e| self.error("recording an event", e))?;
        Ok(Arc::new(event))
    }

    /// The copy stream, created on first use.
    fn copy_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.copy_stream.get() {
            return Ok(s);
        }
        let created = self
            .ctx
            .new_stream()
            .map_err(|e| self.error("creating the copy stream", e))?;
        Ok(self.copy_stream.get_or_init(|| created))
    }

    /// cuBLASLt, loaded with its workspace on first use; an error says why it is not used.
    fn blas(&self) -> Result<&Blas, String> {
        self.blas
            .get_or_init(|| {
                if self.options.own_kernels {
                    return Err("not used: REDLINE_CUDA_OWN_KERNELS=1".into());
                }
                self.bind().map_err(|e| e.to_string())?;
                let lt = CublasLt::load()?;
                let workspace = self
                    .alloc(cublaslt::WORKSPACE_BYTES)
                    .map_err(|e| format!("cuBLASLt workspace: {e}"))?;
                Ok(Blas { lt, workspace })
            })
            .as_ref()
            .map_err(|e| e.clone())
    }

    /// cuDNN on this device's stream, loaded on first use (after cuBLASLt, which some of its
    /// engines call, and NVRTC, which its runtime-compiled engines call: without it they are
    /// refused even where our kernels came ahead of time); an error says why it is not used.
    fn dnn(&self) -> Result<&Cudnn, String> {
        self.dnn
            .get_or_init(|| {
                if self.options.own_kernels {
                    return Err("not used: REDLINE_CUDA_OWN_KERNELS=1".into());
                }
                let _ = self.blas();
                let _ = crate::nvrtc::preload();
                self.bind().map_err(|e| e.to_string())?;
                let choosing = match self.options.cudnn_heuristic {
                    true => Choosing::Heuristic,
                    false => Choosing::Measure {
                        device: self.info.name.clone(),
                        arch: self.info.arch.clone(),
                    },
                };
                Cudnn::load(
                    self.stream.cu_stream(),
                    self.options.deterministic,
                    choosing,
                )
            })
            .as_ref()
            .map_err(|e| e.clone())
    }

    /// After a library call: under `REDLINE_CUDA_LAUNCH_BLOCKING` wait, naming `what` on failure
    /// (not while capturing: nothing ran, and a wait would invalidate the capture).
    fn after(&self, what: &str) -> Result<()> {
        if self.options.launch_blocking && !self.capturing.load(Ordering::Acquire) {
            self.stream
                .synchronize()
                .map_err(|e| self.error(&format!("{what} failed"), e))?;
        }
        Ok(())
    }

    /// The module of the family that holds `kernel`, compiled for this device on first use.
    fn module_for(&self, kernel: &str) -> Result<Arc<Module>> {
        let family = kernels::family_of(kernel).ok_or_else(|| {
            self.error("launch", format!("no kernel instantiation named {kernel}"))
        })?;
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = modules.get(family.source.name) {
            return Ok(m.clone());
        }
        let nvrtc = || {
            self.nvrtc
                .get_or_init(|| Nvrtc::load().map_err(|e| e.to_string()))
                .as_ref()
                .map_err(|e| format!("no ahead-of-time CUBIN, and NVRTC cannot be loaded: {e}"))
        };
        let (cubin, origin) = compile::load_or_compile(family, &self.info.arch, nvrtc)
            .map_err(|e| self.error(family.source.name, e))?;
        self.bind()?;
        // SAFETY: a CUBIN NVRTC made for this device's architecture.
        let load = |cubin: &compile::Compiled| unsafe {
            result::module::load_data(cubin.image.as_ptr() as *const c_void)
        };
        let (cubin, module) = match (load(&cubin), origin) {
            (Ok(module), _) => (cubin, module),
            // A pack's CUBIN this driver does not take (made by a newer NVRTC than the
            // driver's CUDA, say): this machine's NVRTC compiles the family instead.
            (Err(refused), compile::Origin::AheadOfTime(dir)) => {
                eprintln!(
                    "redline-cuda: {} from {}: the driver refused it ({refused:?}); compiling it here",
                    family.source.name,
                    dir.display()
                );
                let (cubin, _) = compile::compile_here(family, &self.info.arch, nvrtc)
                    .map_err(|e| self.error(family.source.name, e))?;
                let module = load(&cubin).map_err(|e| self.error("loading the CUBIN", e))?;
                (cubin, module)
            }
            (Err(e), _) => return Err(self.error("loading the CUBIN", e)),
        };
        let mut functions = HashMap::new();
        for (expr, lowered) in &cubin.symbols {
            let name = CString::new(lowered.as_str()).map_err(|e| self.error("symbol", e))?;
            // SAFETY: `module` is loaded; the symbol is one NVRTC lowered for it.
            let f = unsafe { result::module::get_function(module, name) }
                .map_err(|e| self.error(expr, e))?;
            functions.insert(expr.clone(), f);
        }
        let m = Arc::new(Module {
            _module: module,
            functions,
        });
        modules.insert(family.source.name, m.clone());
        Ok(m)
    }
}

impl Gpu for CudaDriver {
    fn name(&self) -> String {
        format!("cuda:{} ({})", self.info.ordinal, self.info.name)
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        self.bind()?;
        if self.capturing.load(Ordering::Acquire) {
            // Not stream-ordered while capturing: an allocation node would tie the block to
            // the graph's launches; the caching allocator gives it to the graph instead.
            // SAFETY: a plain device allocation (allowed in relaxed capture mode).
            let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
                .map(DevicePtr)
                .map_err(|e| self.error(&format!("allocating {bytes} bytes"), e))?;
            self.unordered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ptr.0);
            return Ok(ptr);
        }
        // SAFETY: stream-ordered allocation on this context's stream.
        unsafe { result::malloc_async(self.stream.cu_stream(), bytes.max(1)) }
            .map(DevicePtr)
            .map_err(|e| self.error(&format!("allocating {bytes} bytes"), e))
    }

    fn free(&self, ptr: DevicePtr) {
        if self.capturing.load(Ordering::Acquire) {
            // The caching allocator gives nothing back while capturing; anything else freed
            // now may be read by the graph: kept (see `retired`).
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(ptr);
            return;
        }
        if let Err(e) = self.bind() {
            eprintln!("redline-cuda: not freeing {:#x}: {e}", ptr.0);
            return;
        }
        let unordered = self
            .unordered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr.0);
        // SAFETY: `ptr` came from `alloc`; every launch using it was enqueued before this free,
        // and a `cuMemAlloc` block is freed only once the stream has run them.
        let freed = match unordered {
            true => self
                .stream
                .synchronize()
                .and_then(|()| unsafe { result::free_sync(ptr.0) }),
            false => unsafe { result::free_async(ptr.0, self.stream.cu_stream()) },
        };
        if let Err(e) = freed {
            eprintln!("redline-cuda: freeing {:#x} failed: {e:?}", ptr.0);
        }
    }

    fn upload(&self, dst: DevicePtr, bytes: &[u8]) -> Result<()> {
        self.bind()?;
        self.not_capturing("a copy from host memory")?;
        // SAFETY: `dst` holds at least `bytes.len()` bytes. A copy from pageable memory returns
        // once the bytes are staged, so the caller may reuse them afterwards.
        unsafe { result::memcpy_htod_async(dst.0, bytes, self.stream.cu_stream()) }
            .map_err(|e| self.error("upload", e))
    }

    fn download(&self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        self.not_capturing("a download")?;
        // SAFETY: `src` holds at least `out.len()` bytes; `out` outlives the synchronize below.
        unsafe { result::memcpy_dtoh_async(out, src.0, self.stream.cu_stream()) }
            .map_err(|e| self.error("download", e))?;
        self.synchronize()
    }

    fn launch(&self, kernel: &str, shape: LaunchShape, args: &KernelArgs) -> Result<()> {
        let module = self.module_for(kernel)?;
        let f = *module
            .functions
            .get(kernel)
            .ok_or_else(|| self.error("launch", format!("{kernel} is not in its module")))?;
        self.bind()?;
        let mut params = args.pointers();
        let [gx, gy, gz] = shape.grid;
        let [bx, by, bz] = shape.block;
        // SAFETY: `params` point at the kernel's parameters in order and type (the launchers in
        // `ops/` pack them as the kernel declares them); they live until the call returns, and
        // cuLaunchKernel copies them.
        unsafe {
            result::launch_kernel(
                f,
                (gx, gy, gz),
                (bx, by, bz),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| self.error(kernel, e))?;
        self.after(&format!("kernel {kernel}"))
    }

    fn gemm(&self, plan: &GemmPlan, operands: [DevicePtr; 3]) -> Result<bool> {
        let Ok(blas) = self.blas() else {
            return Ok(false);
        };
        self.bind()?;
        let capturing = self.capturing.load(Ordering::Acquire);
        let stream = self.stream.cu_stream();
        match blas
            .lt
            .gemm(plan, operands, blas.workspace, stream, capturing)
        {
            Ok(()) => {}
            // Our kernel runs a plan cuBLASLt does not take (the refusal is in the report); it
            // never asks for a retry, which would enqueue nothing either.
            Err(Declined::Refused | Declined::Retry) => return Ok(false),
            Err(Declined::Failed(why)) => return Err(self.error("cuBLASLt matmul", why)),
        }
        self.after("cuBLASLt matmul")?;
        Ok(true)
    }

    fn conv(&self, plan: &ConvPlan, operands: [DevicePtr; 3], accumulate: bool) -> Result<bool> {
        let Ok(dnn) = self.dnn() else {
            return Ok(false);
        };
        if accumulate && self.options.no_accumulate {
            return Ok(false);
        }
        // cuDNN's queries and Find run in the context current on this thread.
        self.bind()?;
        // A plan cuDNN refuses runs on our kernels (the refusal is kept for the report).
        // Find allocates and synchronises: never while a graph is captured.
        let capturing = self.capturing.load(Ordering::Acquire);
        // An algorithm cuDNN rejects when run is set aside and the call made again with the
        // next-ranked one (and the workspace it needs): at most one try per algorithm, and as
        // many again for another thread's rejections meanwhile.
        let tries = 2 * cudnn::MOST_ALGORITHMS;
        let mut out_of_memory = None;
        let ran = plans::retrying(tries, || {
            let needed = dnn
                .workspace_for(plan, !capturing)
                .map_err(|_| Declined::Refused)?;
            let mut workspace = self.dnn_workspace.lock().unwrap_or_else(|p| p.into_inner());
            if workspace.1 < needed {
                // The old block is retired, never freed: a captured graph may hold its address.
                if workspace.1 > 0 {
                    self.retired
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(workspace.0);
                }
                *workspace = (DevicePtr(0), 0);
                let grown = needed.next_power_of_two();
                match self.alloc(grown) {
                    Ok(block) => *workspace = (block, grown),
                    Err(e) => {
                        out_of_memory = Some(e);
                        // Answered below, as the allocation's own error.
                        return Err(Declined::Failed(String::new()));
                    }
                }
            }
            dnn.run(plan, operands, *workspace, capturing, accumulate)
        });
        if let Some(e) = out_of_memory {
            return Err(e);
        }
        match ran {
            Ok(()) => {}
            // A plan cuDNN refuses enqueued nothing: our kernels run it.
            Err(Declined::Refused) => return Ok(false),
            // Still rejecting after every try: given up, our kernels run it from now on.
            Err(Declined::Retry) => {
                dnn.give_up(plan, format!("cuDNN still rejected it after {tries} tries"));
                return Ok(false);
            }
            Err(Declined::Failed(why)) => return Err(self.error("cuDNN convolution", why)),
        }
        self.after("cuDNN convolution")?;
        Ok(true)
    }

    fn pads_stem_channels(&self) -> bool {
        !self.options.stem_unpadded && self.dnn().is_ok_and(Cudnn::usable)
    }

    fn libraries(&self) -> Vec<Library> {
        vec![
            Library::new(
                "cuBLASLt",
                self.blas().map(|b| (b.lt.report.clone(), b.lt.refusals())),
            ),
            Library::new(
                "cuDNN",
                self.dnn().map(|d| (d.report.clone(), d.refusals())),
            )
            .with_algorithms(
                self.dnn().ok().map(Cudnn::choosing),
                self.dnn().map(Cudnn::choices).unwrap_or_default(),
            )
            .with_added_in_place(self.dnn().map(Cudnn::added_in_place).unwrap_or(0)),
            // Loaded for cuDNN's runtime-compiled engines; beside cuDNN only.
            Library::new(
                "NVRTC",
                match self.dnn() {
                    Ok(_) => crate::nvrtc::preload()
                        .map(|(path, version)| (LibReport { path, version }, Vec::new()))
                        .map_err(|e| format!("cuDNN's runtime-compiled engines are refused: {e}")),
                    Err(_) => Err("not loaded for cuDNN, which is not used".into()),
                },
            ),
        ]
    }

    fn synchronize(&self) -> Result<()> {
        self.not_capturing("a synchronize")?;
        self.stream
            .synchronize()
            .map_err(|e| self.error("synchronize", e))?;
        Ok(())
    }

    fn upload_owned(&self, dst: DevicePtr, bytes: HostBytes) -> Result<()> {
        self.not_capturing("a copy from host memory")?;
        let pinned = matches!(&bytes, HostBytes::Pooled(buffer, _) if buffer.is_pinned());
        if !pinned {
            // From pageable memory the copy returns once the bytes are staged.
            return self.upload(dst, &bytes);
        }
        self.bind()?;
        // SAFETY: `dst` holds at least `bytes.len()` bytes; the pinned source is kept alive
        // (below) until the copy's event has completed.
        unsafe { result::memcpy_htod_async(dst.0, &bytes, self.stream.cu_stream()) }
            .map_err(|e| self.error("upload", e))?;
        self.in_flight
            .keep(&self.stream, bytes)
            .map_err(|e| self.error("upload event", e))
    }

    fn download_async(&self, src: DevicePtr, len: usize) -> Result<Download> {
        self.bind()?;
        self.not_capturing("a download")?;
        let name = self.name();
        let finish = self
            .staging
            .download(&self.stream, src.0, len)
            .map_err(|e| self.error("download", e))?;
        Ok(Download::pending(move || {
            finish().map_err(|what| TensorError::Backend { device: name, what })
        }))
    }

    fn begin_capture(&self) -> Result<()> {
        if self.capturing.swap(true, Ordering::AcqRel) {
            return Err(self.error("begin_capture", "a capture is already running"));
        }
        // Relaxed: other threads may allocate (cuMemAlloc) meanwhile, as the caching allocator
        // does for the graph.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        self.stream.begin_capture(mode).map_err(|e| {
            self.capturing.store(false, Ordering::Release);
            self.error("beginning a capture", e)
        })
    }

    fn end_capture(&self) -> Result<Captured> {
        if !self.capturing.swap(false, Ordering::AcqRel) {
            return Err(self.error("end_capture", "no capture to end"));
        }
        let flags = sys::CUgraphInstantiate_flags(0);
        let graph = self
            .stream
            .end_capture(flags)
            .map_err(|e| self.error("ending the capture", e))?
            .ok_or_else(|| self.error("ending the capture", "nothing was captured"))?;
        let mut nodes = 0usize;
        // SAFETY: the graph is alive; with a null array the call only counts the nodes.
        unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) }
            .result()
            .map_err(|e| self.error("counting the graph's nodes", e))?;
        Ok(Captured::Graph {
            exec: CudaGraph(Mutex::new(graph)),
            nodes,
        })
    }

    fn replay(&self, captured: &Captured) -> Result<()> {
        self.not_capturing("a replay")?;
        match captured {
            Captured::Graph { exec, .. } => exec
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .launch()
                .map_err(|e| self.error("launching the graph", e)),
            Captured::Launches(_) => Err(self.error("replay", "the emulator's recording")),
        }
    }

    fn record_event(&self) -> Result<Option<GpuEvent>> {
        self.bind()?;
        self.event_on(&self.stream).map(Some)
    }

    fn wait_event(&self, event: &GpuEvent) -> Result<()> {
        self.bind()?;
        self.stream
            .wait(event)
            .map_err(|e| self.error("waiting for an event", e))
    }

    fn upload_owned_after(
        &self,
        dst: DevicePtr,
        bytes: HostBytes,
        after: &GpuEvent,
    ) -> Result<Option<GpuEvent>> {
        self.not_capturing("a copy from host memory")?;
        let pinned = matches!(&bytes, HostBytes::Pooled(buffer, _) if buffer.is_pinned());
        if !pinned {
            // From pageable memory the copy is staged synchronously anyway: on the compute
            // stream, after `after` (which another stream may have recorded).
            self.wait_event(after)?;
            self.upload_owned(dst, bytes)?;
            return self.record_event();
        }
        self.bind()?;
        let copies = self.copy_stream()?;
        copies
            .wait(after)
            .map_err(|e| self.error("ordering an upload after an event", e))?;
        // SAFETY: `dst` holds at least `bytes.len()` bytes; the pinned source is kept alive
        // (below) until the copy's event has completed.
        unsafe { result::memcpy_htod_async(dst.0, &bytes, copies.cu_stream()) }
            .map_err(|e| self.error("upload", e))?;
        self.in_flight
            .keep(copies, bytes)
            .map_err(|e| self.error("upload event", e))?;
        self.event_on(copies).map(Some)
    }

    fn download_after(&self, src: DevicePtr, len: usize, after: &GpuEvent) -> Result<Download> {
        self.bind()?;
        self.not_capturing("a download")?;
        let copies = self.copy_stream()?;
        copies
            .wait(after)
            .map_err(|e| self.error("ordering a download after an event", e))?;
        let name = self.name();
        let finish = self
            .staging
            .download(copies, src.0, len)
            .map_err(|e| self.error("download", e))?;
        Ok(Download::pending(move || {
            finish().map_err(|what| TensorError::Backend { device: name, what })
        }))
    }

    fn nccl(
        &self,
        id: &crate::nccl::UniqueId,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<crate::nccl::Communicator> {
        crate::nccl::Communicator::new(&self.ctx, id, rank, world, timeout)
            .map_err(|e| self.error("NCCL", e))
    }

    fn record_clock(&self, slot: usize) -> Result<bool> {
        self.bind()?;
        self.not_capturing("a timestamp")?;
        let mut clock = self.clock.lock().unwrap_or_else(|p| p.into_inner());
        clock
            .record(&self.stream, slot)
            .map_err(|e| self.error("timestamp", e))?;
        Ok(true)
    }

    fn read_clock(&self, slots: &[usize]) -> Result<Vec<u64>> {
        self.bind()?;
        let clock = self.clock.lock().unwrap_or_else(|p| p.into_inner());
        clock.read(slots).map_err(|e| self.error("timestamps", e))
    }

    fn host_allocator(&self) -> Option<Arc<dyn HostAllocator>> {
        Some(Arc::new(PinnedAllocator::new(self.ctx.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_older_than_the_bindings_is_refused_naming_both_versions() {
        let why = too_old(12040);
        assert!(why.contains("supports CUDA 12.4"), "{why}");
        let built = format!(
            "needs CUDA {}.{}",
            BUILT_FOR_CUDA / 1000,
            BUILT_FOR_CUDA % 1000 / 10
        );
        assert!(why.contains(&built), "{why}");
        assert!(why.contains("cuda-12080"), "{why}");
    }

    /// On a machine without the driver (CI) this is the answer; with one, a device or the
    /// reason there is none. Either way: no panic.
    #[test]
    fn detection_answers_without_panicking() {
        match CudaDriver::new(0) {
            Ok(d) => println!("found {:?}", d.info()),
            Err(e) => {
                let text = e.to_string();
                println!("{text}");
                assert!(
                    text.starts_with("no NVIDIA driver")
                        || text.starts_with("an NVIDIA driver but no device")
                        || text.starts_with("the CUDA driver failed"),
                    "{text}"
                );
                if let Unavailable::NoDriver(LibError::NotFound { looked_in, .. }) = &e {
                    assert!(!looked_in.is_empty());
                    assert!(text.contains("libcuda.so.1"), "{text}");
                }
            }
        }
    }
}

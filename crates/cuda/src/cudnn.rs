//! cuDNN runs a [`ConvPlan`] on the driver's stream: the classic convolution API, one set of
//! descriptors and one algorithm per plan, chosen once per process and kept.
//!
//! Choosing: by default cuDNN's Find times every algorithm of the plan on the device and the
//! fastest acceptable one is taken and saved in the on-disk [`AlgorithmCache`], so later runs
//! read it instead of searching (`torch.backends.cudnn.benchmark`, but kept across runs). A
//! plan first met while a graph is captured (Find allocates and synchronises, which a capture
//! cannot hold), a failed search, and `REDLINE_CUDNN_FIND=0` take cuDNN's heuristic ranking
//! (`_v7`) instead, unmeasured.
//!
//! Math: f32 is true f32 (`CUDNN_FMA_MATH`; cuDNN's default would allow TF32), f16 and bf16
//! use tensor cores and accumulate in f32. Deterministic mode (`REDLINE_CUDA_DETERMINISTIC=1`,
//! as `torch.backends.cudnn.deterministic`) takes only algorithms cuDNN marks deterministic.
//! An algorithm cuDNN rejects when it runs (a parameter it turns out not to take) is set aside
//! for the plan and the next one of the same ranking runs instead (no second search, but for a
//! choice read from the disk cache, which is dropped there and measured afresh). A plan
//! cuDNN refuses (no algorithm within the workspace cap, every one rejected, an unsupported
//! combination) is remembered and runs on our own kernels; the reasons are in the device
//! report. A status saying cuDNN cannot run on this machine at all refuses every plan at once.
//!
//! cuDNN 9 is split into sub-libraries that `libcudnn.so.9` opens by name; they are loaded from
//! the same folder first (by absolute path), so the whole set comes from one place.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cudnn::{result, sys};
use redline_tensor::DType;

use crate::algorithms::{self, AlgorithmCache, Choice};
use crate::convolution::{ConvPlan, Direction, FilterFormat};
use crate::gpu::DevicePtr;
use crate::libs::{self, LibReport};
use crate::plans::{Declined, PlanCache, Verdict};

/// The most workspace one convolution may ask for: algorithms that want more are skipped.
pub const WORKSPACE_CAP: usize = 1 << 30;

/// The most calls one convolution makes: one per algorithm of the largest direction (each
/// rejected in turn), and the one that finds none left and refuses the plan.
pub const MOST_ALGORITHMS: usize = names::FORWARD.len() + 1;

/// cuDNN 9's sub-libraries, in dependency order (each loads after what it links to).
const PARTS: [&str; 7] = [
    "libcudnn_graph.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
    "libcudnn_adv.so.9",
];

/// What cuDNN says of one candidate algorithm: status, workspace bytes, determinism, math type
/// and milliseconds (measured by Find; 0 from the heuristic).
type Candidate = (
    sys::cudnnStatus_t,
    usize,
    sys::cudnnDeterminism_t,
    sys::cudnnMathType_t,
    f32,
);

/// The algorithm chosen for a plan, in its direction's enum.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    InputGrad(sys::cudnnConvolutionBwdDataAlgo_t),
    WeightGrad(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// Every algorithm of each direction and every math type, to read cached names back into
/// cuDNN's enums (never by transmuting a number from a file).
mod names {
    use cudarc::cudnn::sys::{
        cudnnConvolutionBwdDataAlgo_t as D, cudnnConvolutionBwdFilterAlgo_t as W,
        cudnnConvolutionFwdAlgo_t as F, cudnnMathType_t as M,
    };
    pub const FORWARD: [F; 8] = [
        F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        F::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        F::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ];
    pub const INPUT_GRAD: [D; 6] = [
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ];
    pub const WEIGHT_GRAD: [W; 7] = [
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ];
    pub const MATH: [M; 4] = [
        M::CUDNN_DEFAULT_MATH,
        M::CUDNN_TENSOR_OP_MATH,
        M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        M::CUDNN_FMA_MATH,
    ];

    /// The member of `all` whose name is `name`.
    pub fn lookup<T: Copy + std::fmt::Debug>(all: &[T], name: &str) -> Option<T> {
        all.iter().copied().find(|v| format!("{v:?}") == name)
    }
}

impl Algo {
    fn name(self) -> String {
        match self {
            Algo::Forward(a) => format!("{a:?}"),
            Algo::InputGrad(a) => format!("{a:?}"),
            Algo::WeightGrad(a) => format!("{a:?}"),
        }
    }

    /// The algorithm named `name` in `direction`'s enum.
    fn named(direction: Direction, name: &str) -> Option<Self> {
        match direction {
            Direction::Forward => names::lookup(&names::FORWARD, name).map(Algo::Forward),
            Direction::InputGrad => names::lookup(&names::INPUT_GRAD, name).map(Algo::InputGrad),
            Direction::WeightGrad => names::lookup(&names::WEIGHT_GRAD, name).map(Algo::WeightGrad),
        }
    }
}

/// Descriptors, algorithm and workspace size for one plan, made once.
struct Prepared {
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    chosen: Chosen,
    /// Calls enqueued with it so far: a stage's report tells the plans it ran by their change.
    runs: AtomicU64,
    /// Of those, the calls that added into the written operand (β = 1).
    added: AtomicU64,
}

/// The algorithm a plan runs, and where it came from.
#[derive(Clone, Debug)]
struct Chosen {
    algo: Algo,
    math: sys::cudnnMathType_t,
    workspace: usize,
    /// What Find measured it at (now or in an earlier run); `None` from the heuristic.
    millis: Option<f32>,
    /// How it was chosen, for the report.
    how: &'static str,
    /// The ranking it came from (none for a choice read from the disk cache): if cuDNN
    /// rejects it when run, the next is taken from here, with no second search.
    ranking: Option<Ranking>,
}

/// cuDNN's candidates for a plan, best first, and whether Find measured them (else they are
/// the heuristic's, unmeasured).
#[derive(Clone, Debug)]
struct Ranking {
    candidates: Vec<(Algo, Candidate)>,
    measured: bool,
}

/// What cuDNN's rejections when run left for one plan: the algorithms set aside, and the
/// ranking the last one came from.
#[derive(Clone, Debug, Default)]
struct Setback {
    rejected: Vec<Algo>,
    ranking: Option<Ranking>,
}

// SAFETY: descriptors are host objects, never changed after `prepare`.
unsafe impl Send for Prepared {}
unsafe impl Sync for Prepared {}

impl Drop for Prepared {
    fn drop(&mut self) {
        // SAFETY: made in `prepare`, used by nothing once the plan is dropped.
        unsafe {
            let _ = result::destroy_tensor_descriptor(self.x);
            let _ = result::destroy_tensor_descriptor(self.y);
            let _ = result::destroy_filter_descriptor(self.w);
            let _ = result::destroy_convolution_descriptor(self.conv);
        }
    }
}

/// The loaded library and its handle, bound to the driver's stream.
pub struct Cudnn {
    handle: sys::cudnnHandle_t,
    pub report: LibReport,
    deterministic: bool,
    /// Measured choices (cuDNN's Find, kept on disk), or `None` to take the heuristic's.
    measured: Option<AlgorithmCache>,
    /// Each plan's descriptors, or why cuDNN refused it (then our kernels run it).
    plans: PlanCache<ConvPlan, Prepared>,
    /// Plans whose Find failed (they run the heuristic's choice), with why: for the report.
    find_failures: Mutex<Vec<String>>,
    /// Algorithms cuDNN rejected when they ran, per plan: never chosen for it again.
    setbacks: Mutex<HashMap<ConvPlan, Setback>>,
    /// Plans whose algorithm cuDNN would not run with β = 1 (adding into the written
    /// operand), and that algorithm: their callers add separately while the plan keeps it.
    no_accumulate: Mutex<HashMap<ConvPlan, Algo>>,
}

/// Where measured algorithm choices are kept, when they are measured at all.
pub enum Choosing {
    /// cuDNN's heuristic ranking, nothing measured.
    Heuristic,
    /// cuDNN's Find, saved per device: its name and architecture (`sm_90`) name the file.
    Measure { device: String, arch: String },
}

// SAFETY: the handle is used under the driver's stream order; the cache is behind a mutex.
unsafe impl Send for Cudnn {}
unsafe impl Sync for Cudnn {}

fn status(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuDNN {what}: {e:?}")
}

/// What a failed call's status says, by name (the codes differ between cuDNN's versions of
/// the enum):
/// - cuDNN cannot run here at all: a driver or runtime it does not take, a sub-library of
///   another version, not initialised or licensed — every plan would fail alike;
/// - our call failed: a stream or graph mismatch, a null pointer, an unfinalised descriptor, a
///   serialised plan of another version, execution, memory and internal errors;
/// - any other bad or unsupported parameter (cuDNN 9's `BAD_PARAM*`, `INVALID_VALUE` and
///   `NOT_SUPPORTED*`) is the plan's or its algorithm's, and so is a missing runtime
///   prerequisite or sub-library, an architecture without the feature, or a runtime-compiled
///   engine that failed to compile: those hold for some engines (the runtime-compiled ones
///   need NVRTC, a type may need a newer GPU), so the next-ranked algorithm may well run.
fn verdict(e: &result::CudnnError) -> Verdict {
    const MACHINE: [&str; 6] = [
        "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
        "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART",
        "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
        "CUDNN_STATUS_VERSION_MISMATCH",
        "CUDNN_STATUS_NOT_INITIALIZED",
        "CUDNN_STATUS_LICENSE_ERROR",
    ];
    const CALL: [&str; 6] = [
        "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
        "CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH",
        "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API",
        "CUDNN_STATUS_BAD_PARAM_NULL_POINTER",
        "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
        "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH",
    ];
    const PLAN: [&str; 5] = [
        "CUDNN_STATUS_INVALID_VALUE",
        "CUDNN_STATUS_ARCH_MISMATCH",
        "CUDNN_STATUS_RUNTIME_PREREQUISITE_MISSING",
        "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
        "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
    ];
    let name = format!("{:?}", e.0);
    let named = |names: &[&str]| names.contains(&name.as_str());
    if named(&MACHINE) {
        Verdict::Unusable
    } else if named(&CALL) {
        Verdict::Failed
    } else if named(&PLAN) || name.contains("_BAD_PARAM") || name.contains("_NOT_SUPPORTED") {
        Verdict::NotForPlan
    } else {
        Verdict::Failed
    }
}

fn data_type(dtype: DType) -> Option<sys::cudnnDataType_t> {
    match dtype {
        DType::F32 => Some(sys::cudnnDataType_t::CUDNN_DATA_FLOAT),
        DType::F16 => Some(sys::cudnnDataType_t::CUDNN_DATA_HALF),
        DType::BF16 => Some(sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        _ => None,
    }
}

/// The math type candidates are ranked (and measured) under: true f32, tensor ops for halves.
fn search_math(dtype: DType) -> sys::cudnnMathType_t {
    match dtype {
        DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

/// What a candidate algorithm must satisfy: succeeded, fits the cap, deterministic when asked,
/// and no TF32 for f32 data.
fn acceptable(
    dtype: DType,
    deterministic: bool,
    status: sys::cudnnStatus_t,
    memory: usize,
    determinism: sys::cudnnDeterminism_t,
    math: sys::cudnnMathType_t,
) -> bool {
    status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
        && memory <= WORKSPACE_CAP
        && (!deterministic || determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC)
        && (dtype != DType::F32 || math == sys::cudnnMathType_t::CUDNN_FMA_MATH)
}

/// The best-ranked candidate that is [`acceptable`] and not one cuDNN rejected when it ran.
fn first_acceptable(
    ranked: &[(Algo, Candidate)],
    dtype: DType,
    deterministic: bool,
    rejected: &[Algo],
) -> Option<(Algo, Candidate)> {
    ranked
        .iter()
        .copied()
        .find(|&(algo, (s, memory, det, math, _))| {
            acceptable(dtype, deterministic, s, memory, det, math) && !rejected.contains(&algo)
        })
}

/// The next choice for a plan: the first acceptable candidate (`accept`) of `first` (a
/// rejection's leftover ranking, or Find's), else of the heuristic's ranking — asked only then
/// — with the ranking it came from; `None` when neither has one.
#[allow(clippy::type_complexity)]
fn next_choice(
    first: Option<Ranking>,
    heuristic: impl FnOnce() -> Result<Ranking, String>,
    accept: impl Fn(&Ranking) -> Option<(Algo, Candidate)>,
) -> Result<Option<((Algo, Candidate), Ranking)>, String> {
    if let Some(r) = first {
        if let Some(found) = accept(&r) {
            return Ok(Some((found, r)));
        }
    }
    let r = heuristic()?;
    Ok(accept(&r).map(|found| (found, r)))
}

impl Cudnn {
    /// Finds and loads cuDNN 9 (with its sub-libraries) and makes a handle on `stream` (the
    /// driver's context must be current). An error is an ordinary answer: our kernels run.
    pub fn load(
        stream: cudarc::driver::sys::CUstream,
        deterministic: bool,
        choosing: Choosing,
    ) -> Result<Self, String> {
        let main = libs::find("libcudnn.so.9").map_err(|e| e.to_string())?;
        let dir = main.parent().map(|d| d.to_path_buf()).unwrap_or_default();
        for part in PARTS {
            let path = dir.join(part);
            if path.is_file() {
                libs::load_path_for_cudarc(&path).map_err(|e| e.to_string())?;
            }
        }
        libs::load_path_for_cudarc(&main).map_err(|e| e.to_string())?;
        // cudarc opens its own handle (the unversioned name first): a stray copy it would call
        // into is refused before the first call.
        // SAFETY: opening the library runs no code of ours; a missing one panics, caught.
        libs::catch_panic("loading cuDNN", || {
            unsafe { sys::culib() };
        })?;
        libs::check_single_copy(&main, "libcudnn.so")?;
        let handle = libs::catch_panic("cudnnCreate", result::create_handle)?
            .map_err(|e| status("create", e))?;
        // SAFETY: a handle just made; the stream belongs to the current context.
        unsafe { result::set_stream(handle, stream as sys::cudaStream_t) }
            .map_err(|e| status("set stream", e))?;
        let v = result::get_version();
        let version = format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
        let measured = match choosing {
            Choosing::Heuristic => None,
            Choosing::Measure { device, arch } => {
                let file = crate::compile::cache_root()
                    .map(|root| algorithms::file_for(&root, &device, &arch, &version));
                Some(AlgorithmCache::open(file))
            }
        };
        Ok(Self {
            handle,
            report: LibReport {
                path: main,
                version,
            },
            deterministic,
            measured,
            plans: PlanCache::default(),
            find_failures: Default::default(),
            setbacks: Default::default(),
            no_accumulate: Default::default(),
        })
    }

    /// The plans cuDNN refused so far, with why (they run on our kernels).
    pub fn refusals(&self) -> Vec<String> {
        self.plans.refusals()
    }

    /// Each prepared plan's algorithm, sorted: the plan's key, the algorithm and math type,
    /// its workspace, Find's milliseconds where measured, how it was chosen and how many calls
    /// ran it so far — what a slow convolution on a GPU is read against. None once cuDNN
    /// cannot run here (every plan is refused: [`Cudnn::refusals`]).
    pub fn choices(&self) -> Vec<String> {
        if !self.usable() {
            return Vec::new();
        }
        let no_accumulate = self
            .no_accumulate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out: Vec<String> = self
            .plans
            .prepared()
            .into_iter()
            .map(|(plan, p)| {
                let c = &p.chosen;
                let millis = c
                    .millis
                    .map_or("unmeasured".into(), |ms| format!("{ms} ms"));
                let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
                let mut added = match load(&p.added) {
                    0 => String::new(),
                    n => format!(" ({n} adding in place)"),
                };
                if no_accumulate.get(&plan) == Some(&c.algo) {
                    added.push_str(", refuses to add in place (β = 1): its callers add");
                }
                format!(
                    "{}: {} ({:?}), {} B workspace, {millis}, {}, {} runs{added}",
                    algorithms::key(&plan, self.deterministic),
                    c.algo.name(),
                    c.math,
                    c.workspace,
                    c.how,
                    load(&p.runs),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Calls that added into the written operand (β = 1) so far, over every plan.
    pub fn added_in_place(&self) -> u64 {
        let plans = self.plans.prepared();
        plans
            .iter()
            .map(|(_, p)| p.added.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether cuDNN can run here, as far as its calls have said.
    pub fn usable(&self) -> bool {
        self.plans.unusable().is_none()
    }

    /// What cuDNN's rejections when run left for `plan` (nothing, mostly).
    fn setback(&self, plan: &ConvPlan) -> Setback {
        let setbacks = self.setbacks.lock().unwrap_or_else(|p| p.into_inner());
        setbacks.get(plan).cloned().unwrap_or_default()
    }

    /// Refuses `plan` for good: cuDNN kept rejecting it past the driver's patience.
    pub fn give_up(&self, plan: &ConvPlan, why: String) {
        self.plans.refuse(plan, why);
    }

    /// How algorithms are chosen, for the device report, with the algorithms cuDNN rejected
    /// when they ran (the next-ranked ones ran instead).
    pub fn choosing(&self) -> String {
        let failed = self
            .find_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out = match (&self.measured, failed.last()) {
            (Some(cache), None) => format!("measured by cuDNN's Find: {}", cache.describe()),
            (Some(cache), Some(last)) => format!(
                "measured by cuDNN's Find: {}; Find failed for {} plan(s), which took the \
                 heuristic's choice (last: {last})",
                cache.describe(),
                failed.len()
            ),
            (None, _) => "cuDNN's heuristic ranking (REDLINE_CUDNN_FIND=0)".into(),
        };
        let setbacks = self.setbacks.lock().unwrap_or_else(|p| p.into_inner());
        let mut set_aside: Vec<String> = setbacks
            .iter()
            .map(|(plan, setback)| {
                let names: Vec<String> = setback.rejected.iter().map(|a| a.name()).collect();
                format!("{} for {plan:?}", names.join(" and "))
            })
            .collect();
        if !set_aside.is_empty() {
            set_aside.sort();
            out += &format!(
                "; rejected when run, the next-ranked ran instead: {}",
                set_aside.join("; ")
            );
        }
        out
    }

    /// The plan's descriptors and algorithm (made on first use), or why cuDNN refuses it.
    /// `may_measure` is false while a graph is captured: an algorithm not yet measured or
    /// cached is then the heuristic's.
    fn prepared(&self, plan: &ConvPlan, may_measure: bool) -> Result<Arc<Prepared>, String> {
        self.plans
            .get_or_prepare(plan, || self.prepare(plan, may_measure))
    }

    fn prepare(&self, plan: &ConvPlan, may_measure: bool) -> Result<Prepared, String> {
        let dt =
            data_type(plan.dtype).ok_or_else(|| format!("no cuDNN type for {:?}", plan.dtype))?;
        let tensor = |t: &crate::convolution::TensorDesc| -> Result<_, String> {
            let d = result::create_tensor_descriptor().map_err(|e| status("tensor", e))?;
            // SAFETY: a descriptor just made.
            unsafe { result::set_tensor4d_descriptor_ex(d, dt, t.dims, t.strides) }
                .map_err(|e| status(&format!("tensor {t:?}"), e))?;
            Ok(d)
        };
        let x = tensor(&plan.x)?;
        let y = tensor(&plan.y)?;
        let w = result::create_filter_descriptor().map_err(|e| status("filter", e))?;
        let format = match plan.w.format {
            FilterFormat::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            FilterFormat::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        };
        let conv = result::create_convolution_descriptor().map_err(|e| status("convolution", e))?;
        let math = search_math(plan.dtype);
        // SAFETY: descriptors just made; every value comes from the plan.
        unsafe {
            result::set_filter4d_descriptor(w, dt, format, plan.w.dims)
                .map_err(|e| status(&format!("filter {:?}", plan.w), e))?;
            result::set_convolution2d_descriptor(
                conv,
                plan.padding[0],
                plan.padding[1],
                plan.stride[0],
                plan.stride[1],
                plan.dilation[0],
                plan.dilation[1],
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(|e| status("convolution geometry", e))?;
            result::set_convolution_group_count(conv, plan.groups)
                .map_err(|e| status("groups", e))?;
            result::set_convolution_math_type(conv, math).map_err(|e| status("math type", e))?;
        }
        let mut prepared = Prepared {
            x,
            w,
            y,
            conv,
            chosen: Chosen {
                algo: Algo::Forward(
                    sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
                ),
                math,
                workspace: 0,
                millis: None,
                how: "",
                ranking: None,
            },
            runs: Default::default(),
            added: Default::default(),
        };
        let chosen = self.choose(plan, &prepared, may_measure)?;
        // SAFETY: the descriptor made above; the math type cuDNN reported for the algorithm.
        unsafe { result::set_convolution_math_type(conv, chosen.math) }
            .map_err(|e| status("math type", e))?;
        prepared.chosen = chosen;
        Ok(prepared)
    }

    /// The plan's algorithm, math type and workspace, and the ranking it came from: cached,
    /// else the next in the ranking a rejection when run left, else measured (cuDNN's Find)
    /// and cached, else cuDNN's heuristic ranking; the first acceptable candidate not rejected.
    fn choose(&self, plan: &ConvPlan, p: &Prepared, may_measure: bool) -> Result<Chosen, String> {
        let key = algorithms::key(plan, self.deterministic);
        let cache = self.measured.as_ref();
        let setback = self.setback(plan);
        let rejected = &setback.rejected;
        if let Some(chosen) = cache
            .and_then(|c| c.get(&key))
            .and_then(|choice| self.cached(plan, p, &choice))
            .filter(|chosen| !rejected.contains(&chosen.algo))
        {
            return Ok(chosen);
        }
        // A cached choice that did not hold may have left its math type on the descriptor.
        // SAFETY: the descriptor made in `prepare`.
        unsafe { result::set_convolution_math_type(p.conv, search_math(plan.dtype)) }
            .map_err(|e| status("math type", e))?;
        // A search that fails (a symbol missing, memory for its trials) or finds nothing
        // acceptable falls back to the heuristic; the plan still runs, and a failure is
        // reported (`choosing`). After a rejection, its ranking is walked on instead.
        let first = match setback.ranking {
            Some(ranking) => Some(ranking),
            None if cache.is_some() && may_measure => match self.ranked(plan, p, true) {
                Ok(candidates) => Some(Ranking {
                    candidates,
                    measured: true,
                }),
                Err(why) => {
                    let mut failed = self.find_failures.lock().unwrap_or_else(|p| p.into_inner());
                    failed.push(format!("{key}: {why}"));
                    None
                }
            },
            None => None,
        };
        let heuristic = || {
            self.ranked(plan, p, false).map(|candidates| Ranking {
                candidates,
                measured: false,
            })
        };
        let accept =
            |r: &Ranking| first_acceptable(&r.candidates, plan.dtype, self.deterministic, rejected);
        let ((algo, (_, memory, _, math, millis)), ranking) =
            next_choice(first, heuristic, accept)?.ok_or_else(|| {
                let kind = if self.deterministic {
                    "deterministic "
                } else {
                    ""
                };
                let mut why = format!("no {kind}algorithm within {} MiB", WORKSPACE_CAP >> 20);
                if !rejected.is_empty() {
                    let names: Vec<String> = rejected.iter().map(|a| a.name()).collect();
                    why += &format!(" but those rejected when run ({})", names.join(", "));
                }
                why
            })?;
        if let (true, Some(cache)) = (ranking.measured, cache) {
            let choice = Choice {
                algorithm: algo.name(),
                math: format!("{math:?}"),
                workspace: memory,
                millis,
            };
            cache.insert(key, choice);
        }
        let how = match (ranking.measured, rejected.is_empty()) {
            (true, true) => "measured by Find",
            (true, false) => "measured by Find, the next after a rejection",
            (false, true) => "the heuristic's",
            (false, false) => "the heuristic's, the next after a rejection",
        };
        Ok(Chosen {
            algo,
            math,
            workspace: memory,
            millis: ranking.measured.then_some(millis),
            how,
            ranking: Some(ranking),
        })
    }

    /// A cached choice, if cuDNN still takes it for this plan (asked for its workspace, which
    /// must fit the cap): a file from another build or an edit is measured again instead.
    fn cached(&self, plan: &ConvPlan, p: &Prepared, choice: &Choice) -> Option<Chosen> {
        let algo = Algo::named(plan.direction, &choice.algorithm)?;
        let math = names::lookup(&names::MATH, &choice.math)?;
        if plan.dtype == DType::F32 && math != sys::cudnnMathType_t::CUDNN_FMA_MATH {
            return None;
        }
        let h = self.handle;
        // SAFETY: descriptors from `prepare` (the math type set is the one the size is for).
        let size = unsafe {
            result::set_convolution_math_type(p.conv, math).ok()?;
            match algo {
                Algo::Forward(a) => {
                    result::get_convolution_forward_workspace_size(h, p.x, p.w, p.conv, p.y, a)
                }
                Algo::InputGrad(a) => result::get_convolution_backward_data_workspace_size(
                    h, p.w, p.y, p.conv, p.x, a,
                ),
                Algo::WeightGrad(a) => result::get_convolution_backward_filter_workspace_size(
                    h, p.x, p.y, p.conv, p.w, a,
                ),
            }
        }
        .ok()?;
        (size <= WORKSPACE_CAP).then_some(Chosen {
            algo,
            math,
            workspace: size,
            millis: Some(choice.millis),
            how: "measured by Find in an earlier run (disk cache)",
            ranking: None,
        })
    }

    /// cuDNN's candidates for the plan's direction, best first: measured on the device by Find
    /// when `measure` (which allocates its own trial buffers and waits for the device), else
    /// the heuristic's ranking (no times).
    fn ranked(
        &self,
        plan: &ConvPlan,
        p: &Prepared,
        measure: bool,
    ) -> Result<Vec<(Algo, Candidate)>, String> {
        // The three directions' queries differ only in their types and arguments; their perf
        // structs have the same fields, and Find takes the getter's arguments.
        macro_rules! ranked {
            ($perf:ty, $n:literal, $get:path, $find:path, [$($arg:expr),*], $what:literal, $algo:path) => {{
                let mut perf = [std::mem::zeroed::<$perf>(); $n];
                let mut count = 0;
                let asked = match measure {
                    true => libs::catch_panic(concat!("finding ", $what), || {
                        $find($($arg,)* $n, &mut count, perf.as_mut_ptr()).result()
                    })?,
                    false => $get($($arg,)* $n, &mut count, perf.as_mut_ptr()),
                };
                asked.map_err(|e| {
                    let why = status($what, e);
                    // Every plan would fail alike: refuse them all, once.
                    if verdict(&e) == Verdict::Unusable {
                        self.plans.disable(why.clone());
                    }
                    why
                })?;
                perf[..count.clamp(0, $n) as usize]
                    .iter()
                    .map(|r| ($algo(r.algo), (r.status, r.memory, r.determinism, r.mathType, r.time)))
                    .collect::<Vec<_>>()
            }};
        }
        let h = self.handle;
        // Find, not FindEx: it measures on buffers of its own, never on the call's operands —
        // the first call of a plan may be adding into a gradient (β = 1) that must survive.
        // SAFETY: descriptors from `prepare`; each output array holds the requested count, and
        // zeroed perf structs are valid (every enum has a 0 variant).
        #[rustfmt::skip]
        let ranked = unsafe {
            match plan.direction {
                Direction::Forward => ranked!(sys::cudnnConvolutionFwdAlgoPerf_t, 8,
                    result::get_convolution_forward_algorithm,
                    sys::cudnnFindConvolutionForwardAlgorithm, [h, p.x, p.w, p.conv, p.y],
                    "forward algorithms", Algo::Forward),
                Direction::InputGrad => ranked!(sys::cudnnConvolutionBwdDataAlgoPerf_t, 6,
                    result::get_convolution_backward_data_algorithm,
                    sys::cudnnFindConvolutionBackwardDataAlgorithm, [h, p.w, p.y, p.conv, p.x],
                    "input-gradient algorithms", Algo::InputGrad),
                Direction::WeightGrad => ranked!(sys::cudnnConvolutionBwdFilterAlgoPerf_t, 7,
                    result::get_convolution_backward_filter_algorithm,
                    sys::cudnnFindConvolutionBackwardFilterAlgorithm, [h, p.x, p.y, p.conv, p.w],
                    "weight-gradient algorithms", Algo::WeightGrad),
            }
        };
        Ok(ranked)
    }

    /// Sets `p`'s algorithm aside for `plan` (cuDNN rejected it when run), keeping its ranking
    /// for the next choice, and forgets the prepared plan so the next use makes that choice;
    /// a saved choice of that algorithm is dropped from the disk cache.
    fn set_aside(&self, plan: &ConvPlan, p: &Prepared) {
        {
            // Released before the plans' lock: `prepare` reads setbacks under that one.
            let mut setbacks = self.setbacks.lock().unwrap_or_else(|p| p.into_inner());
            let setback = setbacks.entry(*plan).or_default();
            if !setback.rejected.contains(&p.chosen.algo) {
                setback.rejected.push(p.chosen.algo);
            }
            if p.chosen.ranking.is_some() {
                setback.ranking = p.chosen.ranking.clone();
            }
        }
        if let Some(cache) = &self.measured {
            let key = algorithms::key(plan, self.deterministic);
            if cache
                .get(&key)
                .is_some_and(|c| c.algorithm == p.chosen.algo.name())
            {
                cache.forget(key);
            }
        }
        self.plans.forget(plan);
    }

    /// The workspace the plan needs, or why cuDNN refuses the plan (our kernels run it then).
    pub fn workspace_for(&self, plan: &ConvPlan, may_measure: bool) -> Result<usize, String> {
        self.prepared(plan, may_measure).map(|p| p.chosen.workspace)
    }

    /// Enqueues the plan with cuDNN's `x`, `w` and `y` at `[x, w, y]` (first elements) and a
    /// workspace of at least [`Cudnn::workspace_for`] bytes. Outside a capture (`capturing`), a
    /// call cuDNN rejects as not for the plan sets its algorithm aside and asks for the call
    /// again ([`Declined::Retry`]: the plan has the next-ranked algorithm, or none and is
    /// refused), and a status saying cuDNN cannot run here refuses every plan; any other
    /// failure is [`Declined::Failed`]. Nothing was enqueued either way. With `accumulate`
    /// the written operand gets the result added (β = 1); an algorithm that will not do that
    /// is not set aside: that plan's additions are refused ([`Declined::Refused`]) from then on,
    /// and its plain calls go on as before.
    pub fn run(
        &self,
        plan: &ConvPlan,
        [x, w, y]: [DevicePtr; 3],
        (workspace, workspace_bytes): (DevicePtr, usize),
        capturing: bool,
        accumulate: bool,
    ) -> Result<(), Declined> {
        let no_accumulate = || self.no_accumulate.lock().unwrap_or_else(|p| p.into_inner());
        // Prepared by `workspace_for` already (an error: refused). Gone, or wanting more
        // workspace, when another thread set its algorithm aside since: ask again, which
        // prepares its successor (never here, where it could not be measured).
        let p = match self.plans.get(plan) {
            None => return Err(Declined::Retry),
            Some(Err(_)) => return Err(Declined::Refused),
            Some(Ok(p)) if p.chosen.workspace > workspace_bytes => return Err(Declined::Retry),
            Some(Ok(p)) => p,
        };
        if accumulate && no_accumulate().get(plan) == Some(&p.chosen.algo) {
            return Err(Declined::Refused);
        }
        // Scaling factors are f32 for every data type but f64 (cuDNN's rule), and f64 runs on
        // our kernels.
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (one, zero) = (
            (&alpha as *const f32).cast::<c_void>(),
            (&beta as *const f32).cast::<c_void>(),
        );
        let ptr = |d: DevicePtr| d.0 as *mut c_void;
        let ws = (ptr(workspace), p.chosen.workspace);
        // SAFETY: descriptors from `prepare` describe the operands at these pointers (the
        // launcher built the plan from their layouts); the workspace holds `p.chosen.workspace` bytes.
        // Each call reads two operands and writes the third (alpha = 1; beta = 0, or 1 to add).
        #[rustfmt::skip]
        let enqueued = unsafe {
            let (h, c) = (self.handle, p.conv);
            match p.chosen.algo {
                Algo::Forward(a) => result::convolution_forward(
                    h, one, p.x, ptr(x), p.w, ptr(w), c, a, ws.0, ws.1, zero, p.y, ptr(y)),
                Algo::InputGrad(a) => result::convolution_backward_data(
                    h, one, p.w, ptr(w), p.y, ptr(y), c, a, ws.0, ws.1, zero, p.x, ptr(x)),
                Algo::WeightGrad(a) => result::convolution_backward_filter(
                    h, one, p.x, ptr(x), p.y, ptr(y), c, a, ws.0, ws.1, zero, p.w, ptr(w)),
            }
        };
        if enqueued.is_ok() {
            p.runs.fetch_add(1, Ordering::Relaxed);
            if accumulate {
                p.added.fetch_add(1, Ordering::Relaxed);
            }
        }
        enqueued.map_err(|e| {
            let why = status(&format!("{:?}", plan.direction), e);
            match (verdict(&e), capturing) {
                // β = 1 is what this algorithm would not take: the caller adds instead (and
                // its plain call sets the algorithm aside if that was not it). Remembered
                // outside a capture only, as every other verdict.
                (Verdict::NotForPlan, capturing) if accumulate => {
                    if !capturing {
                        no_accumulate().insert(*plan, p.chosen.algo);
                    }
                    Declined::Refused
                }
                (Verdict::NotForPlan, false) => {
                    self.set_aside(plan, &p);
                    Declined::Retry
                }
                (v, _) => self.plans.decline(plan, why, v, capturing),
            }
        })
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: nothing uses the handle after this.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::{cudnnDeterminism_t as Det, cudnnMathType_t as Math, cudnnStatus_t as Status};

    #[test]
    fn statuses_about_the_plan_the_machine_and_the_call_are_told_apart() {
        let of = |s| verdict(&result::CudnnError(s));
        for s in [
            Status::CUDNN_STATUS_BAD_PARAM,
            Status::CUDNN_STATUS_INVALID_VALUE,
            Status::CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER,
            Status::CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH,
            Status::CUDNN_STATUS_NOT_SUPPORTED,
            Status::CUDNN_STATUS_NOT_SUPPORTED_SHAPE,
            Status::CUDNN_STATUS_NOT_SUPPORTED_LAYOUT,
            Status::CUDNN_STATUS_NOT_SUPPORTED_PADDING,
            Status::CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT,
            // Some engines only: a type this GPU lacks, the runtime-compiled engines.
            Status::CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH,
            Status::CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING,
            Status::CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE,
            Status::CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED,
            Status::CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED,
        ] {
            assert_eq!(of(s), Verdict::NotForPlan, "{s:?}");
        }
        for s in [
            Status::CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER,
            Status::CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART,
            Status::CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH,
            Status::CUDNN_STATUS_LICENSE_ERROR,
            Status::CUDNN_STATUS_NOT_INITIALIZED,
        ] {
            assert_eq!(of(s), Verdict::Unusable, "{s:?}");
        }
        for s in [
            Status::CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH,
            Status::CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH,
            Status::CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API,
            Status::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            Status::CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED,
            Status::CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH,
            Status::CUDNN_STATUS_EXECUTION_FAILED,
            Status::CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER,
            Status::CUDNN_STATUS_INTERNAL_ERROR,
            Status::CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED,
            Status::CUDNN_STATUS_RUNTIME_FP_OVERFLOW,
        ] {
            assert_eq!(of(s), Verdict::Failed, "{s:?}");
        }
    }

    #[test]
    fn the_next_ranked_acceptable_algorithm_stands_in_for_one_rejected_when_run() {
        use sys::cudnnConvolutionFwdAlgo_t as F;
        let (ok, nondet) = (Status::CUDNN_STATUS_SUCCESS, Det::CUDNN_NON_DETERMINISTIC);
        let tensor = Math::CUDNN_TENSOR_OP_MATH;
        let candidate =
            |a, status, memory| (Algo::Forward(a), (status, memory, nondet, tensor, 0.5));
        let ranked = vec![
            candidate(F::CUDNN_CONVOLUTION_FWD_ALGO_FFT, ok, 0),
            candidate(
                F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
                Status::CUDNN_STATUS_NOT_SUPPORTED,
                0,
            ),
            candidate(F::CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ok, WORKSPACE_CAP + 1),
            candidate(F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, ok, 64),
            candidate(F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT, ok, 0),
        ];
        let pick = |rejected: &[Algo]| {
            first_acceptable(&ranked, DType::BF16, false, rejected).map(|(a, _)| a)
        };
        let fft = Algo::Forward(F::CUDNN_CONVOLUTION_FWD_ALGO_FFT);
        let implicit = Algo::Forward(F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
        let direct = Algo::Forward(F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT);
        assert_eq!(pick(&[]), Some(fft));
        // The failed and oversized candidates are passed over, not only the rejected one.
        assert_eq!(pick(&[fft]), Some(implicit));
        assert_eq!(pick(&[implicit, fft]), Some(direct));
        assert_eq!(pick(&[fft, implicit, direct]), None);
    }

    /// After a rejection the rest of the ranking it came from is walked, with no new search;
    /// the heuristic is asked only when that ranking (or Find's) has nothing left.
    #[test]
    fn a_rejections_ranking_is_walked_before_the_heuristic_is_asked() {
        use sys::cudnnConvolutionFwdAlgo_t as F;
        let (ok, nondet) = (Status::CUDNN_STATUS_SUCCESS, Det::CUDNN_NON_DETERMINISTIC);
        let tensor = Math::CUDNN_TENSOR_OP_MATH;
        let ranking = |algos: &[F], measured| Ranking {
            candidates: algos
                .iter()
                .map(|&a| (Algo::Forward(a), (ok, 0, nondet, tensor, 1.0)))
                .collect(),
            measured,
        };
        let (fft, gemm, direct) = (
            F::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
            F::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
            F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        );
        let run = |first: Option<Ranking>, rejected: &[F]| {
            let rejected: Vec<Algo> = rejected.iter().map(|&a| Algo::Forward(a)).collect();
            let asked = std::cell::Cell::new(false);
            let chosen = next_choice(
                first,
                || {
                    asked.set(true);
                    Ok(ranking(&[direct, gemm], false))
                },
                |r| first_acceptable(&r.candidates, DType::F16, false, &rejected),
            )
            .unwrap()
            .map(|((algo, _), r)| (algo, r.measured));
            (chosen, asked.get())
        };
        let measured = || Some(ranking(&[fft, gemm], true));
        assert_eq!(
            run(measured(), &[]),
            (Some((Algo::Forward(fft), true)), false)
        );
        assert_eq!(
            run(measured(), &[fft]),
            (Some((Algo::Forward(gemm), true)), false)
        );
        assert_eq!(
            run(measured(), &[fft, gemm]),
            (Some((Algo::Forward(direct), false)), true)
        );
        assert_eq!(run(None, &[]), (Some((Algo::Forward(direct), false)), true));
        assert_eq!(run(measured(), &[fft, gemm, direct]), (None, true));
        let failed = next_choice(None, || Err("heuristic".into()), |_| None);
        assert_eq!(failed.unwrap_err(), "heuristic");
    }

    #[test]
    fn cached_names_read_back_as_the_same_algorithm_in_their_direction_only() {
        let every: Vec<(Direction, Algo)> = names::FORWARD
            .iter()
            .map(|&a| (Direction::Forward, Algo::Forward(a)))
            .chain(
                names::INPUT_GRAD
                    .iter()
                    .map(|&a| (Direction::InputGrad, Algo::InputGrad(a))),
            )
            .chain(
                names::WEIGHT_GRAD
                    .iter()
                    .map(|&a| (Direction::WeightGrad, Algo::WeightGrad(a))),
            )
            .collect();
        // Each enum's members but its COUNT sentinel.
        assert_eq!(every.len(), 8 + 6 + 7);
        for (direction, algo) in every {
            assert_eq!(Algo::named(direction, &algo.name()), Some(algo));
            for other in [
                Direction::Forward,
                Direction::InputGrad,
                Direction::WeightGrad,
            ] {
                if other != direction {
                    assert_eq!(Algo::named(other, &algo.name()), None, "{}", algo.name());
                }
            }
        }
        for math in names::MATH {
            assert_eq!(
                names::lookup(&names::MATH, &format!("{math:?}")),
                Some(math)
            );
        }
        assert_eq!(
            Algo::named(Direction::Forward, "CUDNN_CONVOLUTION_FWD_ALGO_COUNT"),
            None
        );
        assert_eq!(Algo::named(Direction::Forward, "7"), None);
    }

    #[test]
    fn f32_refuses_tf32_and_deterministic_mode_refuses_nondeterministic_algorithms() {
        let ok = Status::CUDNN_STATUS_SUCCESS;
        let det = Det::CUDNN_DETERMINISTIC;
        let nondet = Det::CUDNN_NON_DETERMINISTIC;
        assert!(acceptable(
            DType::F32,
            false,
            ok,
            0,
            nondet,
            Math::CUDNN_FMA_MATH
        ));
        assert!(!acceptable(
            DType::F32,
            false,
            ok,
            0,
            det,
            Math::CUDNN_TENSOR_OP_MATH
        ));
        assert!(!acceptable(
            DType::F32,
            false,
            ok,
            0,
            det,
            Math::CUDNN_DEFAULT_MATH
        ));
        assert!(acceptable(
            DType::BF16,
            false,
            ok,
            0,
            nondet,
            Math::CUDNN_TENSOR_OP_MATH
        ));
        assert!(!acceptable(
            DType::BF16,
            true,
            ok,
            0,
            nondet,
            Math::CUDNN_TENSOR_OP_MATH
        ));
        assert!(acceptable(
            DType::F16,
            true,
            ok,
            0,
            det,
            Math::CUDNN_DEFAULT_MATH
        ));
        assert!(!acceptable(
            DType::F16,
            false,
            Status::CUDNN_STATUS_NOT_SUPPORTED,
            0,
            det,
            Math::CUDNN_DEFAULT_MATH
        ));
        assert!(!acceptable(
            DType::F16,
            false,
            ok,
            WORKSPACE_CAP + 1,
            det,
            Math::CUDNN_DEFAULT_MATH
        ));
    }

    /// Without cuDNN (CI) loading names the file and the folders; never a panic.
    #[test]
    fn loading_answers_without_panicking() {
        if crate::driver::device_count().is_ok() {
            println!("a driver is here; the GPU check covers cuDNN");
            return;
        }
        match libs::find("libcudnn.so.9") {
            Err(e) => assert!(e.to_string().contains("libcudnn.so.9 not found"), "{e}"),
            Ok(path) => println!(
                "cuDNN at {} (no device to make a handle on)",
                path.display()
            ),
        }
    }
}

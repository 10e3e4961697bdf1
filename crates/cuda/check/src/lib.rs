//! `redline-gpu-check`: one prepared command that proves the CUDA backend on whatever NVIDIA GPU
//! it runs on, without cargo, NVRTC or a network there. `cargo xtask gpu-check --pack DIR`
//! builds it with the kernels' CUBINs for every target architecture beside it.
//!
//! Stages, each timed, printed as it goes and written into the JSON right after it ends (a run
//! cut short keeps what finished):
//! 1. `device` — the GPU (name, UUID, architecture, memory), the driver (file, version), where
//!    the kernels come from (the pack's CUBINs, or NVRTC);
//! 2. `conformance` — the conformance suite on CUDA over the declared matrix; it fails if any
//!    declared (op, dtype) pair ran no case; then the event contract (downloads on the copy
//!    stream after an event);
//! 3. `amp` — the AMP training step next to the CPU backend, and the overflow skip;
//! 4. `own-kernels` — matmul and the convolutions again on our own kernels instead of cuBLASLt
//!    and cuDNN (both paths must be right), and cuDNN's deterministic mode giving the same bits
//!    twice;
//! 5. `wgpu` — the wgpu conformance suite and the non-finite check on the NVIDIA Vulkan
//!    adapter (vendor 0x10DE; a software adapter does not count), where the machine offers
//!    one, with what it does to a subnormal product in each dtype (kept, or flushed as WGSL
//!    allows); else skipped, saying why;
//! 6. `nccl` — NCCL's library (file, version), a one-rank communicator's all-reduce (sum,
//!    average, max in f32, bf16 and f16), broadcast and an all-reduce ordered by events while
//!    the compute stream works, then a bucketed ResNet-18 backward under NCCL against a plain
//!    one, and a data-parallel training step captured as a CUDA graph with its collectives and
//!    replayed against eager steps. One rank proves the plumbing, not scaling (NCCL refuses two
//!    ranks on one GPU);
//! 7. `graph` — a small training step (forward, loss, backward, GradScaler, SGD) captured as
//!    a CUDA graph and replayed 20 times against eager steps with new inputs between replays:
//!    the same results, the graph's node count, and an eager step's time next to a replay's;
//! 8. `training` — ResNet-50 (by default) in bf16 on a synthetic set made on the spot: img/s, the phase
//!    breakdown, the host copies and synchronisations of a steady-state step, memory;
//! 9. `speed` — ResNet-50 at 224 px, batch 256, bf16 (`--speed-precision fp16`: fp16 with the
//!    GradScaler, both sides), a replayed graph, fed one pinned batch
//!    from memory, beside PyTorch at its best on the same GPU run by the same command: both
//!    img/s, the ratio, kernels per step, achieved TFLOP/s and its share of the card's tensor
//!    peak ([`speed`]);
//! 10. `scaling` (only with `--nproc N`) — data-parallel ResNet-50 over NCCL on N GPUs of this
//!     machine, one process per GPU started with torchrun's variables, next to one process
//!     alone: both img/s and the scaling efficiency ([`scaling`]).
//!
//! Without a GPU it says why in the JSON and exits non-zero, without a panic.
//!
//! A GPU window is short, so `--skip a,b` leaves stages out (the device report always runs),
//! and a stage still running after `--stage-timeout` seconds (default 420) ends the process
//! with exit code 124: a hung kernel or library call cannot be cancelled from the host, and
//! the JSON then holds every stage that finished and this one marked as timed out, for a rerun
//! that skips it.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use redline_cuda::driver::{CudaDriver, DriverOptions};
use redline_cuda::{compile, kernels, CudaBackend, Gpu};
use redline_tensor::{Backend, Conv2dParams, DType, Device, Layout, NnOp, Op, OtherOp, View};
use redline_train::Precision;
use serde_json::{json, Map, Value};

pub mod scaling;
pub mod speed;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub json: PathBuf,
    /// Conformance cases per declared pair.
    pub cases: u32,
    /// Measured ResNet-50 steps (after two warm-up steps); 0 skips the stage.
    pub steps: usize,
    pub batch: usize,
    pub res: usize,
    /// Give up measuring after this many seconds (what finished is reported).
    pub budget_seconds: f64,
    pub model: String,
    /// Run on the host emulator instead of GPU 0: the stages' own test, without a GPU.
    pub emulate: bool,
    /// Train by replaying a captured graph after the warm-up (`Trainer::with_graph`).
    pub graph: bool,
    /// The speed stage beside PyTorch (`steps` 0 skips it).
    pub speed: speed::SpeedOptions,
    /// Data-parallel scaling over this machine's GPUs (`--nproc N`); None skips it.
    pub scaling: Option<scaling::ScaleOptions>,
    /// Stages left out by name (of [`STAGES`]).
    pub skip: Vec<String>,
    /// The longest one stage may run before the process ends (see the module docs).
    pub stage_timeout: Duration,
}

/// The stages `--skip` may name, in the order they run (the device report always runs first).
pub const STAGES: [&str; 9] = [
    "conformance",
    "amp",
    "own-kernels",
    "wgpu",
    "nccl",
    "graph",
    "training",
    "speed",
    "scaling",
];

impl Default for Options {
    fn default() -> Self {
        Self {
            json: PathBuf::from("gpu-check.json"),
            cases: 8,
            steps: 60,
            batch: 64,
            res: 224,
            budget_seconds: 120.0,
            model: "resnet50".into(),
            emulate: false,
            graph: false,
            speed: speed::SpeedOptions::default(),
            scaling: None,
            skip: Vec::new(),
            stage_timeout: Duration::from_secs(420),
        }
    }
}

/// The JSON document, rewritten whole after every stage (shared with the stage watchdog).
#[derive(Clone)]
struct Journal {
    path: PathBuf,
    doc: Arc<Mutex<Map<String, Value>>>,
}

impl Journal {
    fn new(path: &Path) -> Self {
        let mut doc = Map::new();
        doc.insert(
            "commit".into(),
            option_env!("REDLINE_COMMIT").unwrap_or("unknown").into(),
        );
        doc.insert("binary_sha256".into(), binary_sha256().into());
        doc.insert("stages".into(), json!([]));
        Self {
            path: path.to_path_buf(),
            doc: Arc::new(Mutex::new(doc)),
        }
    }

    fn doc(&self) -> std::sync::MutexGuard<'_, Map<String, Value>> {
        self.doc.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, key: &str, value: Value) {
        self.doc().insert(key.into(), value);
        self.flush();
    }

    /// What stage `name` has measured so far, written at once: a stage that fails or is ended
    /// by its timeout keeps it (as `partial`).
    fn progress(&self, name: &str, detail: &Value) {
        self.set("in_progress", json!({"name": name, "detail": detail}));
    }

    fn stage(&self, name: &str, seconds: f64, result: &Result<Value, String>) {
        let mut doc = self.doc();
        let partial = match doc.remove("in_progress") {
            Some(p) if p["name"] == name => Some(p["detail"].clone()),
            _ => None,
        };
        let entry = match (result, partial) {
            (Ok(detail), _) => {
                json!({"name": name, "passed": true, "seconds": seconds, "detail": detail})
            }
            (Err(e), Some(partial)) => json!({
                "name": name, "passed": false, "seconds": seconds, "error": e, "partial": partial,
            }),
            (Err(e), None) => {
                json!({"name": name, "passed": false, "seconds": seconds, "error": e})
            }
        };
        if let Some(Value::Array(stages)) = doc.get_mut("stages") {
            stages.push(entry);
        }
        drop(doc);
        self.flush();
    }

    fn flush(&self) {
        let doc = Value::Object(self.doc().clone());
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        let partial = self.path.with_extension("json.partial");
        if std::fs::write(&partial, text).is_ok() {
            let _ = std::fs::rename(&partial, &self.path);
        }
    }
}

/// The running executable's SHA-256, hex.
fn binary_sha256() -> String {
    use sha2::{Digest, Sha256};
    match std::env::current_exe().and_then(std::fs::read) {
        Ok(bytes) => Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        Err(e) => format!("unreadable: {e}"),
    }
}

/// Runs every stage; Ok(true) when all passed. Errors only for a JSON that cannot be written.
pub fn run(options: &Options) -> bool {
    let journal = Journal::new(&options.json);
    journal.flush();
    let started = Instant::now();
    let stages = if options.scaling.is_some() { 10 } else { 9 };
    eprintln!("gpu-check: stage 1/{stages}: device");
    let opened = if options.emulate {
        CudaBackend::emulated()
            .map(|b| {
                (
                    b,
                    json!({"name": "cuda-emulator", "note": "the host emulator, not a GPU"}),
                )
            })
            .map_err(|e| e.to_string())
    } else {
        CudaDriver::new(0).map_err(|e| e.to_string()).map(|driver| {
            let report = report_device(&driver);
            (CudaBackend::new(Arc::new(driver)), report)
        })
    };
    let (backend, device_report) = match opened {
        Ok(found) => found,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            journal.set("gpu", Value::Null);
            journal.stage("device", started.elapsed().as_secs_f64(), &Err(e));
            return false;
        }
    };
    eprintln!("gpu-check: {device_report}");
    let name = device_report["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    journal.set("gpu", device_report.clone());
    journal.stage(
        "device",
        started.elapsed().as_secs_f64(),
        &Ok(device_report),
    );
    let backend = Arc::new(backend);
    let device = Device::new(backend.clone());

    let mut passed = true;
    journal.set("skipped", json!(options.skip));
    let mut stage =
        |journal: &Journal, n: usize, name: &str, f: &mut dyn FnMut() -> Result<Value, String>| {
            if options.skip.iter().any(|s| s == name) {
                eprintln!("gpu-check: stage {n}/{stages}: {name} skipped (--skip)");
                return;
            }
            eprintln!("gpu-check: stage {n}/{stages}: {name}");
            let t = Instant::now();
            let watch = watch(journal, name, options.stage_timeout, started);
            let result = caught(f);
            drop(watch);
            let seconds = t.elapsed().as_secs_f64();
            match &result {
                Ok(_) => eprintln!("gpu-check: {name} passed in {seconds:.1}s"),
                Err(e) => eprintln!("gpu-check: {name} FAILED in {seconds:.1}s: {e}"),
            }
            passed &= result.is_ok();
            journal.stage(name, seconds, &result);
        };
    stage(&journal, 2, "conformance", &mut || {
        let mut report = conformance(&device, options.cases, &Op::all())?;
        redline_testkit::events::check_events(&device)?;
        report["events"] = json!("downloads ordered after an event (copy stream): right");
        redline_testkit::conformance::non_finite_values_as_the_reference(&device)?;
        report["non_finite_values"] = json!(
            "NaN and ±inf through casts, subnormals kept, overflowing sums, every unary op, batch norm, every \
             binary op but pow, the reductions, softmax, cross-entropy, matmul, convolutions \
             (no non-finite value lost), max pooling, GradScaler's check and the sum of \
             squares; the optimizers beside f32 scalars: as the reference"
        );
        redline_testkit::conformance::conv_weight_grad_in_the_weights_order(&device)?;
        report["conv_weight_grad_layouts"] =
            json!("OIHW and channels-last (KRSC) weight gradients match the reference");
        // The check matches the reference whoever adds; how many of its additions cuDNN made
        // in place (β = 1) says whether that path ran.
        let added = || -> u64 {
            let libraries = backend.gpu().libraries();
            libraries.iter().map(|library| library.added_in_place).sum()
        };
        let before = added();
        redline_testkit::conformance::conv_input_grad_into_a_waiting_gradient(&device)?;
        // (Saturating: a plan set aside since takes its count with it.)
        let by_cudnn = added().saturating_sub(before);
        report["conv_input_grad_added_in_place"] = json!({
            "matches_the_reference": true,
            "calls_added_by_cudnn": by_cudnn,
            "note": if by_cudnn > 0 {
                "cuDNN added the input gradients into the waiting ones (beta = 1)"
            } else {
                "cuDNN added none in place: no cuDNN, REDLINE_CUDNN_ACCUMULATE=0, or it refused beta = 1 (its plan lines say)"
            },
        });
        Ok(report)
    });
    stage(&journal, 3, "amp", &mut || {
        let cpu = redline_cpu::CpuBackend::device();
        redline_testkit::training::check_amp_step(&device, &cpu)
            .map(|()| json!("matches the CPU backend; overflow skipped"))
    });
    stage(&journal, 4, "own-kernels", &mut || own_kernels(options));
    stage(&journal, 5, "wgpu", &mut || wgpu_on_nvidia(options.cases));
    stage(&journal, 6, "nccl", &mut || nccl(&device, options.emulate));
    stage(&journal, 7, "graph", &mut || {
        // cuDNN may choose other algorithms under capture: equal to rounding, not bits.
        let r = redline_testkit::graphs::check_captured_step(&device, 20, 1e-4)?;
        Ok(json!({
            "nodes": r.nodes, "eager_ms": r.eager_ms, "replay_ms": r.replay_ms,
            "max_difference_relative": r.max_relative,
            "model": "tiny CNN (conv, batch norm, ReLU, pool, linear), batch 2, SGD + GradScaler",
        }))
    });
    if options.steps > 0 {
        stage(&journal, 8, "training", &mut || {
            training(&backend, &device, options)
        });
    }
    if options.speed.steps > 0 {
        let speed = speed::SpeedOptions {
            vs_pytorch: options.speed.vs_pytorch && !options.emulate,
            ..options.speed.clone()
        };
        stage(&journal, 9, "speed", &mut || {
            let deadline = Instant::now() + options.stage_timeout;
            // The plans prepared and refused so far (conformance's odd shapes and unaligned
            // views): not the measured step's.
            let before = libraries(&**backend.gpu());
            // What the earlier stages left cached goes back first, and again before PyTorch's
            // process starts (ResNet-50 at batch 256 reserves tens of GiB).
            let release = || {
                backend.empty_cache();
                device.synchronize().map_err(|e| e.to_string())
            };
            release()?;
            let progress = |so_far: &Value| journal.progress("speed", so_far);
            let sides = speed::Sides {
                release: &release,
                progress: &progress,
                deadline,
            };
            let mut report = speed::stage(&device, &name, &speed, &sides)?;
            report["memory"] = json!(backend.memory_stats().to_string());
            // Whether cuDNN and cuBLASLt ran the stage's convolutions and matmuls, or our
            // kernels did, and which algorithm each of cuDNN's plans the stage ran has.
            report["libraries"] = libraries_since(&before, libraries(&**backend.gpu()));
            // The 3-channel stem run as 4 for cuDNN (REDLINE_CUDNN_PAD_STEM=0: as it is).
            report["stem_padded_to_4_channels"] = json!(backend.gpu().pads_stem_channels());
            Ok(report)
        });
    }
    if let Some(scaling) = &options.scaling {
        stage(&journal, 10, "scaling", &mut || {
            if options.emulate {
                return Ok(json!({"skipped": "the host emulator is one device without NCCL"}));
            }
            // Rank 0 shares GPU 0 with this process: hand back what the earlier stages left
            // cached (ResNet-50 at batch 256 reserves tens of GiB) before the ranks start.
            backend.empty_cache();
            device.synchronize().map_err(|e| e.to_string())?;
            let mut report = scaling::stage(scaling)?;
            report["check_process_memory_while_ranks_ran"] =
                json!(backend.memory_stats().to_string());
            Ok(report)
        });
    }
    // Again at the end: which plans the libraries refused over the whole run (on our kernels).
    journal.set(
        "libraries_at_end",
        plans_counted(libraries(&**backend.gpu())),
    );
    journal.set("memory", json!(backend.memory_stats().to_string()));
    journal.set("passed", json!(passed));
    journal.set("seconds", json!(started.elapsed().as_secs_f64()));
    passed
}

/// Ends the process if stage `name` still runs after `limit` (a hung kernel or library call
/// cannot be cancelled from the host): the stage goes into the JSON as timed out beside those
/// that finished, and the exit code is 124. Dropping the returned sender (the stage ended)
/// ends the watch.
fn watch(journal: &Journal, name: &str, limit: Duration, started: Instant) -> mpsc::Sender<()> {
    let (done, finished) = mpsc::channel::<()>();
    let (journal, name) = (journal.clone(), name.to_string());
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(limit) {
            let why = format!(
                "still running after {} s (--stage-timeout): the process was ended; what \
                 finished before is above (rerun with --skip {name})",
                limit.as_secs()
            );
            eprintln!("gpu-check: {name} TIMED OUT: {why}");
            journal.stage(&name, limit.as_secs_f64(), &Err(why));
            journal.set("timed_out", json!(name));
            journal.set("passed", json!(false));
            journal.set("seconds", json!(started.elapsed().as_secs_f64()));
            // Not `exit`: its handlers (the CUDA libraries' teardown) could wait on the very
            // call that hangs. Child processes end with this one (`scaling::dies_with_parent`).
            // SAFETY: ends the process at once; the JSON is written and renamed above.
            unsafe { libc::_exit(124) }
        }
    });
    done
}

fn report_device(driver: &CudaDriver) -> Value {
    let info = driver.info();
    let aot: Vec<String> = compile::ahead_of_time_dirs()
        .into_iter()
        .filter(|d| d.is_dir())
        .map(|d| d.display().to_string())
        .collect();
    let families = kernels::families();
    let packed = aot.iter().any(|d| {
        families
            .iter()
            .all(|f| compile::read(Path::new(d), f, &info.arch).is_some())
    });
    let nvrtc = redline_cuda::nvrtc::Nvrtc::load()
        .map(|n| json!({"path": n.path.display().to_string(), "version": format!("{}.{}", n.version.0, n.version.1)}))
        .unwrap_or_else(|e| json!({"unavailable": e.to_string()}));
    json!({
        "name": info.name,
        "uuid": info.uuid,
        "arch": info.arch,
        "memory_bytes": info.total_bytes,
        "driver": {
            "path": info.driver_path.display().to_string(),
            "version": format!("{}.{}", info.driver_version / 1000, info.driver_version % 1000 / 10),
        },
        "kernels": if packed { format!("ahead-of-time CUBINs for {} ({})", info.arch, aot.join(", ")) } else { "compiled by NVRTC at run time".to_string() },
        "nvrtc": nvrtc,
        "libraries": libraries(driver),
        "nvtx": match redline_cuda::nvtx::nvtx() {
            Ok(n) => json!({"path": n.path.display().to_string()}),
            Err(why) => json!({"off": why}),
        },
    })
}

/// Each vendor library: where it was loaded from and its version, or why it is not used.
fn libraries(gpu: &dyn Gpu) -> Value {
    let mut out = Map::new();
    for library in gpu.libraries() {
        let entry = match library.loaded {
            Ok((r, refused)) => json!({
                "path": r.path.display().to_string(),
                "version": r.version,
                "algorithms": library.algorithms,
                "plans": library.choices,
                "refused_plans_on_our_kernels": refused,
            }),
            Err(e) => json!({"not_used": e}),
        };
        out.insert(library.name.into(), entry);
    }
    Value::Object(out)
}

/// `now`'s libraries with only the plans refused since `before` and those run since (both from
/// [`libraries`]: a plan's line carries its run count, so one the stage ran again changed).
fn libraries_since(before: &Value, mut now: Value) -> Value {
    const LISTS: [&str; 2] = ["plans", "refused_plans_on_our_kernels"];
    if let Some(libraries) = now.as_object_mut() {
        for (name, library) in libraries.iter_mut() {
            for list in LISTS {
                let earlier = before[name.as_str()][list].as_array().cloned();
                // `get_mut`, not indexing: a library without the list must not gain a null.
                let now = library.get_mut(list).and_then(Value::as_array_mut);
                if let (Some(now), Some(earlier)) = (now, earlier) {
                    now.retain(|plan| !earlier.contains(plan));
                }
            }
        }
    }
    now
}

/// `libraries` with each library's plan list (every shape of every stage: conformance's odd
/// ones are hundreds of lines) cut to its length; the speed stage lists its own plans.
fn plans_counted(mut libraries: Value) -> Value {
    if let Some(libraries) = libraries.as_object_mut() {
        for library in libraries.values_mut() {
            if let Some(object) = library.as_object_mut() {
                if let Some(Value::Array(plans)) = object.remove("plans") {
                    object.insert("plans_prepared".into(), json!(plans.len()));
                }
            }
        }
    }
    libraries
}

/// The ops cuBLASLt and cuDNN serve, which also have our own kernels.
fn library_ops() -> [Op; 4] {
    [
        Op::Other(OtherOp::Matmul),
        Op::Nn(NnOp::Conv2d),
        Op::Nn(NnOp::Conv2dInputGrad),
        Op::Nn(NnOp::Conv2dWeightGrad),
    ]
}

/// Stage 4: the library ops on our own kernels, then cuDNN's deterministic mode.
fn own_kernels(options: &Options) -> Result<Value, String> {
    let open = |own_kernels: bool, deterministic: bool| -> Result<CudaBackend, String> {
        if options.emulate {
            return CudaBackend::emulated().map_err(|e| e.to_string());
        }
        let chosen = DriverOptions {
            own_kernels,
            deterministic,
            ..DriverOptions::from_env()
        };
        let driver = CudaDriver::with_options(0, chosen).map_err(|e| e.to_string())?;
        Ok(CudaBackend::new(Arc::new(driver)))
    };
    let own = Device::new(Arc::new(open(true, false)?));
    let conformance = conformance(&own, options.cases, &library_ops())?;
    redline_testkit::conformance::conv_weight_grad_in_the_weights_order(&own)?;
    let deterministic = open(false, true)?;
    let runs = [
        weight_grad_bits(&deterministic, options.emulate)?,
        weight_grad_bits(&deterministic, options.emulate)?,
    ];
    if runs[0] != runs[1] {
        return Err("deterministic mode: two identical weight gradients differ".into());
    }
    Ok(json!({
        "own_kernels": conformance,
        "deterministic": "two bf16 weight gradients (a 3×3 convolution) are bit-identical",
        "deterministic_libraries": libraries(&**deterministic.gpu()),
    }))
}

/// NVIDIA's PCI vendor id, as Vulkan reports it.
const NVIDIA: u32 = 0x10DE;

/// Stage 5: the wgpu backend's conformance on the NVIDIA Vulkan adapter (its first real GPU),
/// or a skip naming the adapters seen.
fn wgpu_on_nvidia(cases: u32) -> Result<Value, String> {
    let adapters = redline_wgpu::adapters();
    let is_nvidia = |a: &redline_wgpu::AdapterSummary| a.vendor == NVIDIA && !a.software;
    let Some(adapter) = adapters.iter().find(|a| is_nvidia(a)) else {
        let seen: Vec<String> = adapters
            .iter()
            .map(|a| format!("{} (vendor {:#x}, {})", a.name, a.vendor, a.backend))
            .collect();
        return Ok(json!({
            "skipped": format!("no NVIDIA Vulkan adapter; adapters seen: {seen:?} (no Vulkan loader or ICD gives none)"),
        }));
    };
    let backend = redline_wgpu::WgpuBackend::new(is_nvidia).map_err(|e| e.to_string())?;
    let device = Device::new(Arc::new(backend));
    let mut report = wgpu_checks(&device, cases)?;
    report["adapter"] = json!(adapter.name);
    report["backend"] = json!(adapter.backend);
    Ok(report)
}

/// `f`'s result, or its panic as an error: a test helper asserting on a device that breaks
/// its contract fails its stage (or check) instead of ending the run, so the stages after it —
/// the speed stage last — still run in a short GPU window.
fn caught<T>(f: &mut dyn FnMut() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = (payload.downcast_ref::<String>().cloned())
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "(no message)".into());
        Err(format!("panicked: {message}"))
    })
}

/// The wgpu stage's checks on `device`, the first real driver under the wgpu backend: the
/// conformance suite; NaN, ±inf and subnormals against the reference (WGSL lets a driver
/// assume none occurs — its finite-math assumption — and flush subnormals, and GradScaler's
/// skip needs the first two kept); and the contracts lavapipe's suite checks that a driver
/// decides (event-ordered downloads, timestamps, an AMP step against the CPU, convolution
/// gradients' layouts and in-place addition, a steady state that allocates nothing). Every
/// check runs whatever the others give; a failure lists each one's and carries what the device
/// made of a subnormal product.
fn wgpu_checks(device: &Device, cases: u32) -> Result<Value, String> {
    use redline_testkit::{conformance as c, events, timing, training};
    let subnormals = subnormals_seen(device);
    let cpu = redline_cpu::CpuBackend::device();
    type Check<'a> = (&'static str, &'a dyn Fn() -> Result<(), String>);
    let checks: [Check; 7] = [
        ("non_finite_values", &|| {
            c::non_finite_values_as_the_reference(device)
        }),
        ("events", &|| events::check_events(device)),
        ("timestamps", &|| timing::check_timestamps(device)),
        ("amp_step", &|| training::check_amp_step(device, &cpu)),
        ("conv_weight_grad_layouts", &|| {
            c::conv_weight_grad_in_the_weights_order(device)
        }),
        ("conv_input_grad_into_a_waiting_one", &|| {
            c::conv_input_grad_into_a_waiting_gradient(device)
        }),
        ("steady_state_memory", &|| {
            training::check_steady_state_memory(device)
        }),
    ];
    let matrix = caught(&mut || conformance(device, cases, &Op::all()));
    let mut errors: Vec<String> = matrix.as_ref().err().cloned().into_iter().collect();
    let mut passed = Vec::new();
    for (name, check) in checks {
        match caught(&mut || check()) {
            Ok(()) => passed.push(name),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    match (matrix, errors.is_empty()) {
        (Ok(matrix), true) => Ok(json!({
            "conformance": matrix,
            "checks_passed": passed,
            "non_finite_values": "NaN and ±inf as the reference; subnormals kept or flushed to \
                                  zero (declared: WGSL allows it)",
            "subnormals": subnormals,
        })),
        _ => Err(format!(
            "{}\nchecks passed: {passed:?}\nsubnormal products: {subnormals}",
            errors.join("\n")
        )),
    }
}

/// What the device made of a subnormal product in each float dtype it multiplies: the
/// smallest normal value times 0.5, "kept" or "flushed" to zero (the conformance suite
/// accepts the second only from a backend that declares it may: WGSL allows it), or the
/// value where it is neither.
fn subnormals_seen(device: &Device) -> Value {
    let mut seen = Map::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mul = Op::Binary(redline_tensor::BinaryOp::Mul);
        let Some(smallest_normal) = dtype.smallest_normal() else {
            continue;
        };
        if !device.backend().supports(mul, dtype) {
            continue;
        }
        let product = || -> redline_tensor::Result<f64> {
            let value = |v: f64| {
                let mut bytes = vec![0u8; dtype.size()];
                dtype.write(&mut bytes, 0, v);
                redline_tensor::Tensor::from_bytes(bytes, dtype, &[1], device)
            };
            let y = value(smallest_normal)?.mul(&value(0.5)?)?;
            Ok(y.to_f64_vec()?[0])
        };
        let verdict = match product() {
            Ok(v) if v == smallest_normal / 2.0 => "kept".to_string(),
            Ok(0.0) => "flushed".to_string(),
            Ok(v) => format!("{v:e} (want {:e} or 0)", smallest_normal / 2.0),
            Err(e) => format!("failed: {e}"),
        };
        seen.insert(dtype.to_string(), verdict.into());
    }
    Value::Object(seen)
}

/// A bf16 3×3 convolution's weight gradient on fixed random inputs, as bytes (`small` for
/// the emulator): channels-last throughout, as autocast trains.
fn weight_grad_bits(backend: &CudaBackend, small: bool) -> Result<Vec<u8>, String> {
    let err = |e: redline_tensor::TensorError| e.to_string();
    let (n, c, h, k) = if small { (2, 4, 5, 4) } else { (8, 64, 28, 64) };
    let x_layout = Layout::channels_last(&[n, c, h, h]).map_err(err)?;
    let g_layout = Layout::channels_last(&[n, k, h, h]).map_err(err)?;
    let dw_layout = Layout::channels_last(&[k, c, 3, 3]).map_err(err)?;
    let x = backend
        .random_uniform(DType::BF16, n * c * h * h, 1, 0)
        .map_err(err)?;
    let g = backend
        .random_uniform(DType::BF16, n * k * h * h, 2, 0)
        .map_err(err)?;
    let p = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    let dw = backend
        .conv2d_weight_grad(
            View {
                storage: &x,
                layout: &x_layout,
            },
            View {
                storage: &g,
                layout: &g_layout,
            },
            &p,
            &dw_layout,
        )
        .map_err(err)?;
    backend
        .download(View {
            storage: &dw,
            layout: &dw_layout,
        })
        .map_err(err)
}

/// Stage 6: NCCL with one rank on this GPU (see the module docs); skipped on the emulator.
fn nccl(device: &Device, emulate: bool) -> Result<Value, String> {
    use redline_dist::{Collective, DataParallel, NcclCollective, Reduce, SingleProcess};
    use redline_nn::{named_parameters, state_dict, Kind, Module, ResNet, ResNetConfig};
    use redline_tensor::Tensor;
    if emulate {
        return Ok(json!({"skipped": "the host emulator has no NCCL (this stage needs a GPU)"}));
    }
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let library = redline_cuda::nccl::library()?;
    let group = NcclCollective::new(
        Arc::new(SingleProcess),
        device,
        std::time::Duration::from_secs(60),
    )
    .map_err(|e| err(&e))?;
    // An odd length (no vector width divides it) of values exact in every dtype below.
    let values: Vec<f32> = (0..1_000_003)
        .map(|i| (i % 97) as f32 * 0.25 - 12.0)
        .collect();
    let mut checked = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::from_slice(&values, &[values.len()], device)
            .and_then(|t| t.cast(dtype))
            .map_err(|e| err(&e))?;
        for op in [Reduce::Sum, Reduce::Avg, Reduce::Max] {
            group
                .all_reduce(std::slice::from_ref(&x), op)
                .map_err(|e| err(&e))?;
            if x.to_vec::<f32>().map_err(|e| err(&e))? != values {
                return Err(format!(
                    "one-rank {op:?} all-reduce of {dtype} changed the values"
                ));
            }
            checked.push(format!("all-reduce {op:?} {dtype}"));
        }
    }
    let x = Tensor::from_slice(&values, &[values.len()], device).map_err(|e| err(&e))?;
    group
        .broadcast(std::slice::from_ref(&x), 0)
        .map_err(|e| err(&e))?;
    if x.to_vec::<f32>().map_err(|e| err(&e))? != values {
        return Err("one-rank broadcast changed the values".into());
    }
    // Ordered by events: NCCL's stream waits for `doubled`, the compute stream goes on with a
    // matmul, then waits for NCCL before reading.
    let doubled = x.mul_scalar(2.0).map_err(|e| err(&e))?;
    let ready = device.record_event().map_err(|e| err(&e))?;
    let done = group
        .all_reduce_after(std::slice::from_ref(&doubled), Reduce::Sum, &ready)
        .map_err(|e| err(&e))?;
    let m = Tensor::from_slice(&values[..512 * 512], &[512, 512], device).map_err(|e| err(&e))?;
    let busy = m.matmul(&m).map_err(|e| err(&e))?;
    device.wait_event(&done).map_err(|e| err(&e))?;
    let got = doubled.to_vec::<f32>().map_err(|e| err(&e))?;
    if got.iter().zip(&values).any(|(g, v)| *g != v * 2.0) {
        return Err("an all-reduce ordered after an event read or wrote the wrong values".into());
    }
    drop(busy);
    // The bucketed backward under NCCL (1 MiB buckets) against a plain backward.
    let mut config = ResNetConfig::named("resnet18").map_err(|e| err(&e))?;
    config.num_classes = 10;
    let model = ResNet::new(config, device).map_err(|e| err(&e))?;
    let pixels: Vec<f32> = (0..4 * 3 * 32 * 32)
        .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
        .collect();
    let input = Tensor::from_slice(&pixels, &[4, 3, 32, 32], device).map_err(|e| err(&e))?;
    let step = || -> Result<Vec<Vec<f32>>, String> {
        let logits = model.forward(&input).map_err(|e| err(&e))?;
        let loss = logits.mul(&logits).and_then(|l| l.sum(&[], false));
        loss.and_then(|l| l.backward()).map_err(|e| err(&e))?;
        named_parameters(&model)
            .iter()
            .map(|(name, p)| {
                let g = p.grad().ok_or_else(|| format!("{name} got no gradient"))?;
                p.zero_grad();
                g.to_vec::<f32>().map_err(|e| err(&e))
            })
            .collect()
    };
    let plain = step()?;
    let buffers: Vec<Tensor> = state_dict(&model)
        .into_iter()
        .filter(|(_, _, kind)| *kind == Kind::Buffer)
        .map(|(_, t, _)| t)
        .collect();
    let dp = DataParallel::new(Arc::new(group), named_parameters(&model), &buffers, 1 << 20)
        .map_err(|e| err(&e))?;
    let bucketed = {
        let logits = model.forward(&input).map_err(|e| err(&e))?;
        let loss = logits.mul(&logits).and_then(|l| l.sum(&[], false));
        loss.and_then(|l| l.backward()).map_err(|e| err(&e))?;
        dp.synchronize().map_err(|e| err(&e))?;
        named_parameters(&model)
            .iter()
            .map(|(_, p)| p.grad().map(|g| g.to_vec::<f32>()))
            .collect::<Option<Result<Vec<_>, _>>>()
            .ok_or("a parameter got no gradient under NCCL")?
            .map_err(|e| err(&e))?
    };
    let (mut worst, mut largest) = (0f32, 0f32);
    for (a, b) in plain.iter().zip(&bucketed) {
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
            largest = largest.max(x.abs());
        }
    }
    let relative = worst / largest.max(f32::MIN_POSITIVE);
    // cuDNN may pick non-deterministic weight-gradient algorithms: equal to rounding.
    if relative.is_nan() || relative > 1e-4 {
        return Err(format!(
            "bucketed gradients under NCCL differ from a plain backward by {relative:e} \
             (relative to the largest gradient)"
        ));
    }
    let launches = dp.last_launches();
    Ok(json!({
        "library": {"path": library.path.display().to_string(), "version": library.version},
        "one_rank": checked,
        "ordered_by_events": "right",
        "bucketed_step": {
            "model": "resnet18", "buckets": dp.buckets().len(),
            "overlapped_buckets": launches.iter().filter(|l| l.grads_pending > 0).count(),
            "max_difference_relative": relative,
        },
        "captured_step": nccl_captured_step(device).map_err(|e| format!(
            "the captured data-parallel step (after the collectives and the bucketed step had \
             passed): {e}"
        ))?,
        "note": "one rank proves the plumbing, not scaling",
    }))
}

/// Stage 6's last check: a data-parallel training step over a one-rank NCCL group captured as
/// a CUDA graph (the buffer broadcast, the buckets the backward thread issues onto NCCL's
/// stream by events, the optimizer's wait) and replayed, against the same steps run
/// eagerly; then the same with synchronised batch norm, whose sums share the group. The
/// group's watchdog timeout is short and outlived afterwards: a captured collective it tried
/// to watch (its event can never be queried) would abort the group.
fn nccl_captured_step(device: &Device) -> Result<Value, String> {
    let plain = nccl_captured_run(device, false)?;
    let sync_bn = nccl_captured_run(device, true)?;
    let mut report = plain;
    report["sync_batch_norm"] = sync_bn;
    Ok(report)
}

/// [`nccl_captured_step`]'s eager and replayed runs, with synchronised batch norm or not.
fn nccl_captured_run(device: &Device, sync_bn: bool) -> Result<Value, String> {
    use redline_dist::{Collective, NcclCollective, SingleProcess};
    use redline_loader::Resident;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (res, batch, steps) = (64, 16, 6);
    let timeout = std::time::Duration::from_secs(3);
    let run = |graph: bool| -> Result<_, String> {
        let group =
            NcclCollective::new(Arc::new(SingleProcess), device, timeout).map_err(|e| err(&e))?;
        let group: Arc<dyn Collective> = Arc::new(group);
        let (trainer, _) = amp_resnet_trainer(
            device,
            "resnet18",
            speed::CLASSES,
            res,
            graph,
            Precision::Bf16,
        )?;
        let mut trainer =
            (trainer.with_data_parallel(group.clone(), 1 << 20)).map_err(|e| err(&e))?;
        if sync_bn {
            trainer = trainer.with_sync_batch_norm().map_err(|e| err(&e))?;
        }
        let (pixels, labels) = speed::resident_batch(batch, res);
        let mut batches = Resident::new(
            pixels,
            labels,
            res,
            speed::RESIDENT_BUFFERS,
            device.host_allocator(),
        )
        .map_err(|e| err(&e))?;
        let mut losses = Vec::with_capacity(steps);
        for _ in 0..steps {
            let step = trainer.train_step(&mut batches).map_err(|e| err(&e))?;
            losses.push(step.loss.item().map_err(|e| err(&e))?);
        }
        Ok((losses, trainer.graph_stats().clone(), group))
    };
    let what = match sync_bn {
        true => "data-parallel step with synchronised batch norm",
        false => "data-parallel step",
    };
    let (eager, _, _) = run(false)?;
    let (replayed, stats, group) = run(true)?;
    if stats.captures != 1 || stats.eager_steps != 0 {
        return Err(format!(
            "the {what} was not captured once and replayed: {stats:?}"
        ));
    }
    let worst = (eager.iter().zip(&replayed))
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-6))
        .fold(0f64, f64::max);
    // bf16, and cuDNN may pick non-deterministic algorithms: equal to rounding, not in bits.
    if worst.is_nan() || worst > 2e-2 {
        return Err(format!(
            "replayed losses of the {what} {replayed:?} differ from eager {eager:?} by {worst:e}"
        ));
    }
    device.synchronize().map_err(|e| err(&e))?;
    std::thread::sleep(timeout + std::time::Duration::from_millis(500));
    group.alive().map_err(|e| {
        format!("the group failed after the {what}'s captured collectives had finished: {e}")
    })?;
    Ok(json!({
        "model": "resnet18", "res": res, "batch": batch, "steps": steps,
        "graph_nodes": stats.nodes, "replays": stats.replays,
        "losses_eager": eager, "losses_replayed": replayed,
        "max_loss_difference_relative": worst,
        "watchdog_outlived_s": timeout.as_secs_f64() + 0.5,
    }))
}

fn conformance(device: &Device, cases: u32, ops: &[Op]) -> Result<Value, String> {
    let report = redline_testkit::run_conformance_on(
        device,
        &redline_testkit::SuiteConfig {
            cases,
            // A first GPU run may fail many pairs: the failing case, not the smallest one,
            // within a short window.
            max_shrink_ms: 1_000,
        },
        ops,
    );
    let matrix = report.matrix();
    eprintln!("{matrix}");
    let unrun: Vec<String> = report
        .cells
        .iter()
        .filter(|(op, dtype, cell)| {
            device.backend().supports(*op, *dtype)
                && *cell != redline_testkit::conformance::Cell::Passed
        })
        .map(|(op, dtype, _)| format!("{op}/{dtype}"))
        .collect();
    if !report.passed() || !unrun.is_empty() {
        return Err(format!(
            "{} failure(s); declared pairs not passed: {}\n{}",
            report.failures.len(),
            unrun.join(", "),
            report.failures.join("\n")
        ));
    }
    Ok(json!({"matrix": matrix, "cases_per_pair": cases}))
}

fn training(backend: &CudaBackend, device: &Device, options: &Options) -> Result<Value, String> {
    use redline_loader::{Config, Loader};
    use redline_train::Summary;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let classes = 10;
    let (dir, set) = synthetic_set("check", options.batch, classes)?;
    let set = Arc::new(set);
    let (mut trainer, _) = amp_resnet_trainer(
        device,
        &options.model,
        classes,
        options.res,
        options.graph,
        Precision::Bf16,
    )?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let loader_config = Config {
        workers: cores,
        allocator: device.host_allocator(),
        ..Config::new(options.batch, options.res, true)
    };
    let mut loader = Loader::new(set, loader_config, Default::default()).map_err(|e| err(&e))?;
    // Under a graph the capture happens in the warm-up.
    let warmup = match options.graph {
        true => redline_train::GRAPH_WARMUP_STEPS + 1,
        false => 2,
    };
    for _ in 0..warmup {
        trainer
            .train_step(&mut loader)
            .map_err(|e| err(&e))?
            .loss
            .item()
            .map_err(|e| err(&e))?;
    }
    trainer.take_times().map_err(|e| err(&e))?;
    // One steady-state step, counted: host copies and synchronisations beyond the batch upload
    // and the loss read-back are silent round trips.
    let before = backend.transfer_stats();
    let step = trainer.train_step(&mut loader).map_err(|e| err(&e))?;
    let loss = step.loss.item().map_err(|e| err(&e))?;
    let after = backend.transfer_stats();
    let counted = json!({
        "uploads": after.uploads - before.uploads,
        "downloads": after.downloads - before.downloads,
        "synchronizations": after.synchronizations - before.synchronizations,
        "note": "phases are timed by CUDA events read two steps late; the loss is read back with item()",
    });
    trainer.take_times().map_err(|e| err(&e))?;
    let started = Instant::now();
    let mut times = Vec::new();
    let mut steps = 0;
    while steps < options.steps && started.elapsed().as_secs_f64() < options.budget_seconds {
        let step = trainer.train_step(&mut loader).map_err(|e| err(&e))?;
        steps += 1;
        times.extend(step.times);
        if steps % 10 == 0 {
            eprintln!(
                "gpu-check: {} step {steps} loss {:.3}",
                options.model,
                step.loss.item().map_err(|e| err(&e))?
            );
        }
    }
    times.extend(trainer.take_times().map_err(|e| err(&e))?);
    let _ = std::fs::remove_dir_all(&dir);
    if !loss.is_finite() {
        return Err(format!("the loss is {loss}"));
    }
    let summary = Summary::new(&times, options.batch);
    eprintln!(
        "gpu-check: {} {:.1} img/s over {} steps",
        options.model,
        summary.images_per_sec,
        times.len()
    );
    Ok(json!({
        "model": options.model,
        "precision": "bf16",
        "res": options.res,
        "summary": summary.to_json(),
        "steady_state_step": counted,
        "memory": backend.memory_stats().to_string(),
        "completed_steps": times.len(),
        "asked_steps": options.steps,
        "graph": {
            "requested": options.graph,
            "nodes": trainer.graph_stats().nodes,
            "replays": trainer.graph_stats().replays,
            "eager_steps_after_warmup": trainer.graph_stats().eager_steps,
            "eager_reason": trainer.graph_stats().eager_reason,
        },
    }))
}

/// A synthetic JPEG training set of `classes` classes made in a temporary folder named for
/// `purpose`, with enough images for the run whatever the batch (four batches, at least 64):
/// the folder (the caller removes it) and the set.
pub(crate) fn synthetic_set(
    purpose: &str,
    batch: usize,
    classes: usize,
) -> Result<(PathBuf, redline_shard::ShardSet), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let dir = std::env::temp_dir().join(format!("redline-gpu-{purpose}-{}", std::process::id()));
    let synth = redline_datasets::generate::SynthOptions {
        classes: classes as u32,
        images: (batch * 4).max(64) as u64,
        ..Default::default()
    };
    let sets = redline_datasets::generate::synth_shards(&dir, &synth).map_err(|e| err(&e))?;
    let set = redline_shard::ShardSet::open(&sets[0]).map_err(|e| err(&e))?;
    Ok((dir, set))
}

/// A ResNet (`model`, `classes` outputs) under AdamW (lr 1e-3, weight decay 0.01) at
/// `precision` (bf16 AMP in every stage but a speed stage asked for fp16, which adds the
/// GradScaler) on `device`, replaying a captured step after the warm-up when `graph`; with its
/// forward multiply-accumulates per `res × res` image.
pub(crate) fn amp_resnet_trainer(
    device: &Device,
    model: &str,
    classes: usize,
    res: usize,
    graph: bool,
    precision: Precision,
) -> Result<(redline_train::Trainer, u64), String> {
    use redline_nn::{named_parameters, AdamW, ParamGroup, ResNet, ResNetConfig};
    use redline_train::{TrainConfig, Trainer};
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut config = ResNetConfig::named(model).map_err(|e| err(&e))?;
    config.num_classes = classes;
    let resnet = ResNet::new(config, device).map_err(|e| err(&e))?;
    let macs = resnet.macs_per_image(res).map_err(|e| err(&e))?;
    let params = named_parameters(&resnet).into_iter().map(|(_, p)| p);
    let adamw = AdamW::new(
        vec![ParamGroup::new(params.collect(), 0.01)],
        0.9,
        0.999,
        1e-8,
    )
    .map_err(|e| err(&e))?;
    let train = TrainConfig {
        precision,
        label_smoothing: 0.0,
        clip_norm: None,
        base_lr: 1e-3,
        schedule: redline_nn::Schedule::Constant,
    };
    let mut trainer = Trainer::new(Box::new(resnet), Box::new(adamw), train, device.clone())
        .map_err(|e| err(&e))?;
    if graph {
        trainer = trainer.with_graph();
    }
    Ok((trainer, macs))
}

/// Writes the CUBINs of every kernel family for every target architecture into `dir` (run on
/// the machine that builds the pack, where NVRTC is).
pub fn prepare(dir: &Path) -> Result<usize, String> {
    let nvrtc = redline_cuda::nvrtc::Nvrtc::load().map_err(|e| e.to_string())?;
    let (major, minor) = nvrtc.version;
    eprintln!(
        "compiling with NVRTC {major}.{minor} ({})",
        nvrtc.path.display()
    );
    if (major, minor) > (13, 0) {
        // The lent machines' driver is CUDA 13.0 (580): a CUBIN from a newer NVRTC may be
        // refused there, and the driver compiles that family again with the machine's NVRTC.
        eprintln!(
            "note: NVRTC {major}.{minor} is newer than the lent GPU machines' CUDA 13.0 driver; \
             `pip install nvidia-cuda-nvrtc==13.0.88` builds CUBINs that driver surely takes"
        );
    }
    compile::prepare(&nvrtc, dir, kernels::ARCHITECTURES)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI): the JSON says why, the run fails, nothing panics.
    #[test]
    fn without_a_gpu_the_check_says_why_and_fails() {
        if CudaDriver::new(0).is_ok() {
            return; // a GPU is here: the pack's run is the check
        }
        let json = std::env::temp_dir().join(format!("gpu-check-{}.json", std::process::id()));
        let options = Options {
            json: json.clone(),
            ..Options::default()
        };
        assert!(!run(&options));
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(doc["gpu"], Value::Null);
        let stage = &doc["stages"][0];
        assert_eq!(stage["name"], "device");
        assert_eq!(stage["passed"], false);
        assert!(
            stage["error"]
                .as_str()
                .unwrap()
                .starts_with("no NVIDIA driver"),
            "{stage}"
        );
        assert_eq!(doc["binary_sha256"].as_str().map(str::len), Some(64));
        let _ = std::fs::remove_file(&json);
    }

    /// A panic becomes an error with its message, whether formatted or a literal.
    #[test]
    fn a_panic_is_caught_as_an_error_with_its_message() {
        let err = caught(&mut || -> Result<(), String> { panic!("slot {} refused", 3) });
        assert_eq!(err.unwrap_err(), "panicked: slot 3 refused");
        let err = caught(&mut || -> Result<(), String> { panic!("plain") });
        assert_eq!(err.unwrap_err(), "panicked: plain");
        assert_eq!(caught(&mut || Ok(7)), Ok(7));
    }

    /// The wgpu stage's checks: the matrix, every named check and the subnormal note in its
    /// JSON; a device that flushes subnormals without declaring it fails the non-finite check,
    /// named, with what it did to a subnormal product, and the other checks still run.
    #[test]
    fn the_wgpu_stage_runs_the_suite_and_the_drivers_contracts() {
        use redline_testkit::broken::{Broken, Fault};
        // A device with a clock (the emulated GPU) passes every check.
        let emulated = CudaBackend::emulated().unwrap();
        let report = wgpu_checks(&Device::new(Arc::new(emulated)), 1).unwrap();
        assert!(report["conformance"]["matrix"].is_string(), "{report}");
        assert!(report["non_finite_values"].is_string(), "{report}");
        let passed = report["checks_passed"].as_array().map(Vec::len);
        assert_eq!(passed, Some(7), "{report}");
        assert_eq!(report["subnormals"]["f16"], "kept", "{report}");
        // The CPU takes no timestamps: that check alone fails, named, and the rest pass.
        let err = wgpu_checks(&redline_cpu::CpuBackend::device(), 1).unwrap_err();
        assert!(err.starts_with("timestamps: cpu takes no timestamps\nchecks passed: [\"non_finite_values\", \"events\", \"amp_step\""), "{err}");
        let flushing = Device::new(Arc::new(Broken::new(Fault::FlushesSubnormals)));
        let err = wgpu_checks(&flushing, 1).unwrap_err();
        assert!(err.contains("non_finite_values: "), "{err}");
        assert!(err.contains("\"f32\":\"flushed\""), "{err}");
        assert!(err.contains("\"events\""), "the later checks ran: {err}");
        let declared = Broken::new(Fault::FlushesSubnormals).declaring_subnormal_flush();
        let declared = Device::new(Arc::new(declared));
        match wgpu_checks(&declared, 1) {
            Ok(report) => assert_eq!(report["subnormals"]["f32"], "flushed", "{report}"),
            // (The reference takes no timestamps.)
            Err(e) => assert!(!e.contains("non_finite_values: "), "{e}"),
        }
    }

    /// The wgpu stage's note of what the adapter does with subnormal products.
    #[test]
    fn subnormal_products_are_reported_kept_or_flushed() {
        use redline_testkit::broken::{Broken, Fault};
        let cpu = Device::new(Arc::new(redline_cpu::CpuBackend::new()));
        let kept = subnormals_seen(&cpu);
        assert_eq!(kept["f32"], "kept", "{kept}");
        assert_eq!(kept["f16"], "kept", "{kept}");
        assert_eq!(kept["bf16"], "kept", "{kept}");
        let flushing = Device::new(Arc::new(Broken::new(Fault::FlushesSubnormals)));
        let flushed = subnormals_seen(&flushing);
        assert_eq!(flushed["f32"], "flushed", "{flushed}");
        assert_eq!(flushed["f16"], "flushed", "{flushed}");
    }

    /// The speed stage names only the plans refused and run while it ran, not conformance's.
    #[test]
    fn plans_before_a_stage_are_not_its_own() {
        let before = json!({
            "cuDNN": {
                "version": "9",
                "plans": ["odd: ALGO_0, 2 runs", "shared: ALGO_2, 1 runs"],
                "refused_plans_on_our_kernels": ["odd conv"],
            },
            "cuBLASLt": {"not_used": "absent"},
        });
        let now = json!({
            "cuDNN": {
                "version": "9",
                "plans": ["odd: ALGO_0, 2 runs", "shared: ALGO_2, 9 runs", "stem: ALGO_1, 8 runs"],
                "refused_plans_on_our_kernels": ["odd conv", "stem conv"],
            },
            "cuBLASLt": {"not_used": "absent"},
        });
        let since = libraries_since(&before, now);
        assert_eq!(
            since["cuDNN"]["refused_plans_on_our_kernels"],
            json!(["stem conv"])
        );
        // A plan an earlier stage prepared and this one ran again is its too.
        assert_eq!(
            since["cuDNN"]["plans"],
            json!(["shared: ALGO_2, 9 runs", "stem: ALGO_1, 8 runs"])
        );
        assert_eq!(since["cuDNN"]["version"], "9");
        assert_eq!(since["cuBLASLt"], json!({"not_used": "absent"}));
        // At the end of the run: how many plans, the refusals in full.
        let end = plans_counted(since);
        assert_eq!(end["cuDNN"]["plans_prepared"], 2);
        assert!(end["cuDNN"].get("plans").is_none());
        assert_eq!(
            end["cuDNN"]["refused_plans_on_our_kernels"],
            json!(["stem conv"])
        );
        assert_eq!(end["cuBLASLt"], json!({"not_used": "absent"}));
    }

    /// A stage that fails (or is ended by its timeout) keeps what it reported on the way in the
    /// JSON; one that passes, or another stage, does not carry it.
    #[test]
    fn a_failed_stage_keeps_its_progress_as_partial() {
        let path = std::env::temp_dir().join(format!("partial-{}.json", std::process::id()));
        let journal = Journal::new(&path);
        let read =
            || -> Value { serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap() };
        journal.progress("speed", &json!({"redline": {"img_per_s": 3000.0}}));
        // Written at once: a process ended now keeps it.
        assert_eq!(read()["in_progress"]["name"], "speed");
        journal.stage("speed", 1.0, &Err("PyTorch ran past the deadline".into()));
        let doc = read();
        assert_eq!(doc["stages"][0]["partial"]["redline"]["img_per_s"], 3000.0);
        assert!(doc["in_progress"].is_null(), "{doc}");
        journal.progress("speed", &json!({"so": "far"}));
        journal.stage("speed", 1.0, &Ok(json!({"all": "of it"})));
        journal.progress("training", &json!({"so": "far"}));
        journal.stage("graph", 1.0, &Err("failed".into()));
        let doc = read();
        assert!(doc["stages"][1]["partial"].is_null(), "{doc}");
        assert_eq!(doc["stages"][1]["detail"]["all"], "of it");
        assert!(doc["stages"][2]["partial"].is_null(), "{doc}");
        let _ = std::fs::remove_file(&path);
    }

    /// The device, conformance, AMP and own-kernel stages on the host emulator: the check's own code runs
    /// in CI, and its JSON has what a GPU run's has. (The training stage is left out here: even
    /// ResNet-18 at 16 px takes the emulator minutes a step.)
    #[test]
    fn the_stages_pass_on_the_emulator_and_the_json_records_them() {
        let json = std::env::temp_dir().join(format!("gpu-check-emu-{}.json", std::process::id()));
        let options = Options {
            json: json.clone(),
            cases: 2,
            steps: 0,
            emulate: true,
            speed: speed::SpeedOptions {
                steps: 0,
                ..Default::default()
            },
            ..Options::default()
        };
        assert!(
            run(&options),
            "{}",
            std::fs::read_to_string(&json).unwrap_or_default()
        );
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let names: Vec<&str> = doc["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "device",
                "conformance",
                "amp",
                "own-kernels",
                "wgpu",
                "nccl",
                "graph"
            ]
        );
        // This machine's Vulkan adapter (if any) is software: the stage says why it skipped.
        assert!(doc["stages"][4]["detail"]["skipped"]
            .as_str()
            .is_some_and(|s| s.contains("no NVIDIA Vulkan adapter")));
        assert!(doc["stages"][1]["detail"]["matrix"]
            .as_str()
            .unwrap()
            .contains("undeclared f32/f16 pairs: none"));
        // No cuDNN on the emulator: the engine added, and the report says cuDNN did not.
        let added = &doc["stages"][1]["detail"]["conv_input_grad_added_in_place"];
        assert_eq!(added["matches_the_reference"], true);
        assert_eq!(added["calls_added_by_cudnn"], 0);
        assert_eq!(doc["passed"], true);
        let _ = std::fs::remove_file(&json);
    }

    /// The training stage end to end on the emulator, at a size it can afford (ResNet-18,
    /// 16 px, batch 2, one measured step after the warm-up and the counted step): the
    /// loader, the trainer, the phase clock on the backend's timestamps and the step counters.
    #[test]
    fn the_training_stage_runs_on_the_emulator_and_reports_a_steady_step() {
        let options = Options {
            steps: 1,
            batch: 2,
            res: 16,
            model: "resnet18".into(),
            emulate: true,
            ..Options::default()
        };
        let backend = Arc::new(CudaBackend::emulated().unwrap());
        let device = Device::new(backend.clone());
        let report = training(&backend, &device, &options).unwrap();
        assert_eq!(report["completed_steps"], 1, "{report}");
        assert_eq!(
            report["summary"]["phase_clock"], "device timestamps",
            "{report}"
        );
        let steady = &report["steady_state_step"];
        assert_eq!(steady["synchronizations"], 0, "{report}");
        assert_eq!(steady["downloads"], 1, "{report}");
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

//! Stage 9, `speed`: ResNet training throughput beside PyTorch's on the same device, both sides
//! run by this one command so correctness and speed fit one short GPU window.
//!
//! Same model, resolution, batch, precision (bf16; fp16 with `--speed-precision fp16`, which adds
//! the GradScaler on both sides) and classes (1,000) on both sides, both fed
//! one u8 NHWC batch resident in pinned host memory — copied to the device and normalised there
//! every step, no decoding. img/s on both sides = images ÷ wall time between two
//! synchronisations, after a warm-up that absorbs cuDNN's algorithm search, graph capture and
//! PyTorch's `cudnn.benchmark` (and compile). Then our step again, fed by the loader from JPEG
//! shards made on the spot, decoded on every core: its img/s as a share of the memory-fed
//! run's (the goal: within 5%) and the data stall.
//!
//! Ours replays the step as a CUDA graph after the trainer's warm-up. PyTorch runs at its best
//! (`benches/pytorch/gpu_speed.py`, in the pack as `pytorch/gpu_speed.py`): channels_last,
//! `cudnn.benchmark`, `AdamW(fused=True)`, autocast; under `torch.compile` too with
//! `--vs-compile`. The ratio and whether it meets the goal (≥ 1.0× eager) go into the JSON; a
//! shortfall is a measurement, not a failed stage.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use redline_loader::Resident;
use redline_tensor::Device;
use redline_train::profile::{stream_bandwidth, OpProfile, StepProfile};
use redline_train::{Phase, Precision, Summary, GRAPH_WARMUP_STEPS};
use serde_json::{json, Value};

/// What the stage measures.
#[derive(Debug, Clone)]
pub struct SpeedOptions {
    pub model: String,
    pub res: usize,
    pub batch: usize,
    /// bf16 or fp16 autocast (fp16 with a GradScaler), both sides.
    pub precision: Precision,
    /// Warm-up steps on each side (ours runs at least the graph warm-up and the capture).
    pub warmup: usize,
    /// Measured steps on each side; 0 skips the stage.
    pub steps: usize,
    /// Replay the step as a captured graph (ours).
    pub graph: bool,
    /// PyTorch's side under torch.compile as well.
    pub vs_compile: bool,
    /// Run PyTorch's side (not on the emulator: it is no GPU to compare on).
    pub vs_pytorch: bool,
    /// Our step again fed by the loader from JPEG shards made on the spot, on every core: its
    /// img/s next to the memory-fed run's, and the data stall.
    pub vs_loader: bool,
    /// The longest PyTorch's side may take.
    pub pytorch_timeout: Duration,
    /// Eager steps of ours timed op by op on the device ([`op_profile`]); 0 skips it.
    pub profile_steps: usize,
    /// Bytes the stream bandwidth beside the op profile copies: past the L2 of every card we
    /// measure on (RTX 5090: 96 MB; H100, H200: 50 MB).
    pub stream_bytes: usize,
}

impl Default for SpeedOptions {
    fn default() -> Self {
        Self {
            model: "resnet50".into(),
            res: 224,
            batch: 256,
            precision: Precision::Bf16,
            warmup: 10,
            steps: 30,
            graph: true,
            vs_compile: false,
            vs_pytorch: true,
            vs_loader: true,
            pytorch_timeout: Duration::from_secs(240),
            profile_steps: 2,
            stream_bytes: 256 << 20,
        }
    }
}

/// Classes on both sides (ImageNet's, as torchvision's default head).
pub(crate) const CLASSES: usize = 1000;

/// Dense bf16/f16 tensor-core peaks with f32 accumulation (vendor figures, TFLOP/s), by a
/// fragment of the device's name, the first that matches: the achieved share is reported
/// against these. The PCIe and NVL boards (H100, H200) run lower clocks than the SXM ones.
const TENSOR_PEAKS: [(&str, f64); 7] = [
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("RTX 5090", 209.0),
    ("A100", 312.0),
];

fn peak_for(device_name: &str) -> Option<f64> {
    TENSOR_PEAKS
        .iter()
        .find(|(fragment, _)| device_name.contains(fragment))
        .map(|&(_, peak)| peak)
}

/// Pinned buffers behind a resident batch: the host runs up to `TIMES_LAG` steps ahead of
/// the device, so that many copies may be in flight beside the one being filled, plus one
/// spare (a buffer returns to the pool only once the device has read it).
pub(crate) const RESIDENT_BUFFERS: usize = redline_train::TIMES_LAG + 3;

/// A deterministic batch: pixels from a small LCG, labels cycling through the classes.
pub(crate) fn resident_batch(batch: usize, res: usize) -> (Vec<u8>, Vec<i64>) {
    let mut state = 0x2545_f491u32;
    let pixels = (0..batch * res * res * 3)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 24) as u8
        })
        .collect();
    let labels = (0..batch).map(|i| (i * 7 % CLASSES) as i64).collect();
    (pixels, labels)
}

/// [`resident_batch`] in pinned buffers of `device`'s.
fn resident(device: &Device, o: &SpeedOptions) -> Result<Resident, String> {
    let (pixels, labels) = resident_batch(o.batch, o.res);
    Resident::new(
        pixels,
        labels,
        o.res,
        RESIDENT_BUFFERS,
        device.host_allocator(),
    )
    .map_err(|e| e.to_string())
}

/// Our side on `device`: the trainer fed the resident batch, warm-up, then `steps` steps timed
/// between two synchronisations.
pub fn ours(device: &Device, o: &SpeedOptions) -> Result<Value, String> {
    let mut batches = resident(device, o)?;
    let mut report = measure(device, o, &mut batches)?;
    report["pinned_batch"] = json!(batches.is_pinned());
    Ok(report)
}

/// Where our step's device time goes, op by op: a fresh trainer on the device wrapped in an
/// [`OpProfile`] in detail (each op bracketed by two CUDA events), run eagerly — a replayed
/// graph is one launch, timed only as a whole — one step to settle its caches, then
/// `profile_steps` steps counted. The ops launch the replay's kernels; their times are upper
/// bounds on the replay's (an op's events also hold any wait for the host to issue it, as
/// after each reading of the events, every `SETTLE_OPS` ops), so the profiled steps give no
/// step time. Beside it the device's stream bandwidth, the doctor's yardstick for the
/// memory-bound rows.
pub fn op_profile(device: &Device, o: &SpeedOptions) -> Result<Value, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let stream_gb_per_s = stream_bandwidth(device, o.stream_bytes).map_err(|e| err(&e))?;
    let (profiled, profile) = OpProfile::wrap(device.clone(), true);
    let mut batches = resident(&profiled, o)?;
    let (mut trainer, _) =
        crate::amp_resnet_trainer(&profiled, &o.model, CLASSES, o.res, false, o.precision)?;
    trainer.train_step(&mut batches).map_err(|e| err(&e))?;
    profiled.synchronize().map_err(|e| err(&e))?;
    profile.reset();
    for _ in 0..o.profile_steps {
        trainer.train_step(&mut batches).map_err(|e| err(&e))?;
    }
    profiled.synchronize().map_err(|e| err(&e))?;
    let rows = profile.rows();
    let ops = StepProfile::new(&rows, o.profile_steps, false, profile.device_timed(), true);
    for (op, _, calls, ms, bytes) in ops.rows.iter().take(12) {
        let rate = match *bytes > 0.0 {
            true => format!(", {:.0} GB/s", bytes / ms.max(1e-9) / 1e6),
            false => String::new(),
        };
        eprintln!("gpu-check: speed: op profile: {ms:8.3} ms/step {calls:5.0} calls  {op}{rate}");
    }
    Ok(json!({
        "steps": o.profile_steps,
        "from": "eager steps of a fresh trainer, each op between two CUDA events (the replay's kernels; the profiled steps themselves run slower, so no step time is taken from them)",
        "ops": ops.to_json(),
        "stream_gb_per_s": stream_gb_per_s,
        "stream_bytes": o.stream_bytes,
    }))
}

/// Our side fed by the loader: a synthetic JPEG set made in a temporary folder (enough images
/// for the run), decoded and augmented on every core into the device's pinned buffers.
pub fn loader_fed(device: &Device, o: &SpeedOptions) -> Result<Value, String> {
    use redline_loader::{Config, Loader};
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let made = Instant::now();
    let (dir, set) = crate::synthetic_set("speed", o.batch, 100)?;
    let made = made.elapsed().as_secs_f64();
    let measured = (|| {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let config = Config {
            workers,
            allocator: device.host_allocator(),
            ..Config::new(o.batch, o.res, true)
        };
        let mut loader = Loader::new(std::sync::Arc::new(set), config, Default::default())
            .map_err(|e| err(&e))?;
        let mut report = measure(device, o, &mut loader)?;
        // Over the measured steps; the loader's own figure counts its cold start and warm-up.
        report["data_stall"] = report["data_wait_share"].clone();
        report["loader_data_stall_since_start"] = json!(loader.data_stall());
        report["loader_workers"] = json!(workers);
        report["synthetic_set_seconds"] = json!(made);
        Ok(report)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

/// A fresh trainer fed by `batches`: warm-up (with the capture), then `steps` steps timed
/// between two synchronisations.
fn measure(
    device: &Device,
    o: &SpeedOptions,
    batches: &mut dyn Iterator<Item = Result<redline_loader::Batch, redline_loader::LoaderError>>,
) -> Result<Value, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (mut trainer, macs) =
        crate::amp_resnet_trainer(device, &o.model, CLASSES, o.res, o.graph, o.precision)?;
    let gmac = macs as f64 / 1e9;
    let warmup = match o.graph {
        true => o.warmup.max(GRAPH_WARMUP_STEPS + 1),
        false => o.warmup,
    };
    for _ in 0..warmup {
        trainer.train_step(batches).map_err(|e| err(&e))?;
    }
    device.synchronize().map_err(|e| err(&e))?;
    trainer.take_times().map_err(|e| err(&e))?;
    let memory_before = device.memory_stats();
    // Each step's phase times arrive a few steps late (read from CUDA events without waiting).
    let mut times = Vec::new();
    let Timed {
        seconds,
        host_seconds,
        device_wait_seconds,
        loss,
    } = timed_steps(device, &mut trainer, batches, o.steps, |step| {
        times.extend(step.times)
    })?;
    times.extend(trainer.take_times().map_err(|e| err(&e))?);
    // In use and reserved after the measured steps, and what they took from the device (a
    // steady state takes nothing: the caching allocator serves every step).
    let memory = redline_train::profile::memory_json(memory_before, device.memory_stats(), o.steps);
    let img_per_s = (o.batch * o.steps) as f64 / seconds;
    // The device's compute time (forward, backward, optimizer — a replay is all three) from
    // the CUDA events around it, over the wall time: a replay's events bracket one graph
    // launch, so its time is the graph's; an eager phase's also holds any gap inside it.
    let compute: f64 = times
        .iter()
        .map(|t| {
            [Phase::Forward, Phase::Backward, Phase::Optimizer]
                .iter()
                .map(|&p| t.get(p).as_secs_f64())
                .sum::<f64>()
        })
        .sum();
    let device_clock = !times.is_empty() && times.iter().all(|t| t.device_clock);
    // The measured steps' wait for batches (host timers), over their wall time: the data
    // stall of this run alone, not of the loader's warm-up and first batch.
    let data_wait: f64 = times
        .iter()
        .map(|t| t.get(Phase::DataWait).as_secs_f64())
        .sum();
    let busy = match device_clock && times.len() == o.steps {
        true => json!(compute / seconds),
        false => json!(null),
    };
    // Training is about three forwards: the forward, and a backward of twice its work.
    let tflops = img_per_s * gmac * 2.0 * 3.0 / 1e3;
    let stats = trainer.graph_stats();
    // fp16's loss scale after the measured steps (read once, after the last synchronisation):
    // below the initial 65,536 when steps overflowed and were skipped.
    let loss_scale = match trainer.scaler() {
        Some(scaler) => json!(scaler.state()[0]
            .1
            .to_f64_vec()
            .map_err(|e| err(&e))?
            .first()),
        None => json!(null),
    };
    Ok(json!({
        "img_per_s": img_per_s,
        "precision": o.precision.to_string(),
        "loss_scale": loss_scale,
        "seconds": seconds,
        "steps": o.steps,
        "warmup": warmup,
        "loss": loss,
        "gmac_per_image": gmac,
        "host_ms_per_step": 1e3 * host_seconds / o.steps.max(1) as f64,
        "host_share_of_wall": host_seconds / seconds,
        "host_ms_from": "host time inside each train_step call issuing the step (a replay: the batch's copy and one graph launch), a wait for data included, the wait for the device not (device_wait_ms_per_step)",
        "device_wait_ms_per_step": 1e3 * device_wait_seconds / o.steps.max(1) as f64,
        "data_wait_share": data_wait / seconds,
        "achieved_tflops": tflops,
        "busy_fraction": busy,
        "busy_fraction_from": "CUDA events around each step's compute (a replay: one graph launch) ÷ wall time; null without device timestamps",
        "phases": Summary::new(&times, o.batch).to_json(),
        "device_memory": memory,
        "graph": {
            "requested": o.graph,
            "kernels_per_step": stats.nodes,
            "replays": stats.replays,
            "captures": stats.captures,
            "eager_steps_after_warmup": stats.eager_steps,
            "eager_reason": stats.eager_reason,
        },
    }))
}

/// What [`timed_steps`] measured.
pub(crate) struct Timed {
    /// Wall time between the two synchronisations.
    pub seconds: f64,
    /// Host time inside the `train_step` calls issuing each step (a replay: the batch's copy
    /// and one graph launch) and waiting for data, without the wait for the device.
    pub host_seconds: f64,
    /// Host time inside them waiting for the device (`Step::device_wait`: back-pressure).
    pub device_wait_seconds: f64,
    /// The last step's loss (NaN without steps).
    pub loss: f64,
}

/// `steps` training steps timed between two synchronisations (the caller has synchronised
/// before), each step handed to `each`. A loss that is not finite is an error.
pub(crate) fn timed_steps(
    device: &Device,
    trainer: &mut redline_train::Trainer,
    batches: &mut dyn Iterator<Item = Result<redline_loader::Batch, redline_loader::LoaderError>>,
    steps: usize,
    mut each: impl FnMut(redline_train::Step),
) -> Result<Timed, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let started = Instant::now();
    let mut last = None;
    let (mut host, mut waited) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..steps {
        let issued = Instant::now();
        let step = trainer.train_step(batches).map_err(|e| err(&e))?;
        host += issued.elapsed().saturating_sub(step.device_wait);
        waited += step.device_wait;
        last = Some(step.loss.clone());
        each(step);
    }
    device.synchronize().map_err(|e| err(&e))?;
    let seconds = started.elapsed().as_secs_f64();
    let loss = match last {
        Some(loss) => loss.item().map_err(|e| err(&e))?,
        None => f64::NAN,
    };
    if steps > 0 && !loss.is_finite() {
        return Err(format!("the loss is {loss}"));
    }
    Ok(Timed {
        seconds,
        host_seconds: host.as_secs_f64(),
        device_wait_seconds: waited.as_secs_f64(),
        loss,
    })
}

/// Where PyTorch's side is: `REDLINE_GPU_SPEED_SCRIPT`, the pack's `pytorch/gpu_speed.py`
/// beside the executable, or the repository's.
pub fn pytorch_script() -> PathBuf {
    if let Some(p) = std::env::var_os("REDLINE_GPU_SPEED_SCRIPT") {
        return PathBuf::from(p);
    }
    let packed = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("pytorch/gpu_speed.py")));
    match packed {
        Some(p) if p.is_file() => p,
        _ => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../benches/pytorch/gpu_speed.py"
        )),
    }
}

/// PyTorch's side: the script run by `python3` with the same settings, its JSON report.
pub fn pytorch(o: &SpeedOptions, device: &str) -> Result<Value, String> {
    let script = pytorch_script();
    let mut cmd = Command::new(std::env::var("REDLINE_PYTHON").unwrap_or("python3".into()));
    cmd.arg(&script)
        .args([
            "--model",
            &o.model,
            "--precision",
            &o.precision.to_string(),
            "--device",
            device,
        ])
        .args(["--res", &o.res.to_string(), "--batch", &o.batch.to_string()])
        .args(["--warmup", &o.warmup.to_string()])
        .args(["--steps", &o.steps.to_string()]);
    if o.vs_compile {
        cmd.arg("--compile");
    }
    let output = run_with_timeout(cmd, o.pytorch_timeout)
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!(
            "{} exited with {}: {}",
            script.display(),
            output.status,
            tail.join(" | ")
        ));
    }
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or("");
    serde_json::from_str(last).map_err(|e| format!("{}: no JSON report ({e})", script.display()))
}

/// Runs `cmd` to completion, killing it after `timeout`. Its stdout and stderr are read on
/// threads as it runs: a child writing more than a pipe holds (warnings, compile logs) would
/// otherwise block until the timeout killed it.
fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Result<std::process::Output, String> {
    use std::process::Stdio;
    crate::scaling::dies_with_parent(&mut cmd);
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start it: {e}"))?;
    let [stdout, stderr] = crate::scaling::drain(&mut child);
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "still running after {} s: killed",
                    timeout.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(e.to_string()),
        }
    };
    // A grandchild (a compile worker) may still hold a pipe open: wait a little for the
    // readers, then take what there is rather than block.
    let text = |pipe: std::thread::JoinHandle<String>| {
        let waiting = Instant::now();
        while !pipe.is_finished() && waiting.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        match pipe.is_finished() {
            true => pipe.join().unwrap_or_default().into_bytes(),
            false => b"(a pipe still held open by another process)".to_vec(),
        }
    };
    Ok(std::process::Output {
        status,
        stdout: text(stdout),
        stderr: text(stderr),
    })
}

/// What the stage needs of its caller: `release` hands this process's cached device memory
/// back before PyTorch's process starts, so both sides have the card's memory (cuDNN's
/// algorithm choice depends on the workspace it may take); `progress` is told the report so
/// far after each part (a stage ended by its timeout keeps it); PyTorch's side must end by
/// `deadline`.
pub struct Sides<'a> {
    pub release: &'a dyn Fn() -> Result<(), String>,
    pub progress: &'a dyn Fn(&Value),
    pub deadline: Instant,
}

/// The time PyTorch's side leaves for the loader-fed run after it, within the stage's limit:
/// about what our memory-fed run took, within these bounds (PyTorch's comparison comes first).
const AFTER_PYTORCH: [Duration; 2] = [Duration::from_secs(30), Duration::from_secs(90)];

/// The stage: ours fed from memory, then PyTorch's where asked (the comparison the goal is
/// about), then ours fed by the loader; the ratios, the achieved share of the card's tensor
/// peak. `device_name` is the GPU's (for its peak). A loader-fed run that fails fails the
/// stage after everything else has been measured and reported.
pub fn stage(
    device: &Device,
    device_name: &str,
    o: &SpeedOptions,
    sides: &Sides<'_>,
) -> Result<Value, String> {
    let started = Instant::now();
    let ours = ours(device, o)?;
    let ours_took = started.elapsed();
    let ours_ips = ours["img_per_s"].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "gpu-check: speed: redline {:.0} img/s ({} {}px, batch {}, {})",
        ours_ips, o.model, o.res, o.batch, o.precision
    );
    let mut report = json!({
        "model": o.model, "res": o.res, "batch": o.batch, "precision": o.precision.to_string(),
        "data": "one u8 NHWC batch resident in pinned host memory, copied and normalised on the device every step",
        "redline": ours,
    });
    if let Some(peak) = peak_for(device_name) {
        let achieved = report["redline"]["achieved_tflops"].as_f64().unwrap_or(0.0);
        report["tensor_peak_tflops"] = json!(peak);
        report["share_of_peak"] = json!(achieved / peak);
    }
    (sides.progress)(&report);
    match o.vs_pytorch {
        true => {
            (sides.release)()?;
            let left = sides.deadline.saturating_duration_since(Instant::now());
            let after = ours_took.clamp(AFTER_PYTORCH[0], AFTER_PYTORCH[1]);
            let timeout = o.pytorch_timeout.min(left.saturating_sub(after));
            let o = SpeedOptions {
                pytorch_timeout: timeout,
                ..o.clone()
            };
            compare(&mut report, pytorch(&o, "cuda"), ours_ips);
        }
        false => {
            report["pytorch"] = json!({"not_run": "the emulator is not a GPU to compare on"});
        }
    }
    (sides.progress)(&report);
    if o.vs_loader {
        match loader_fed(device, o) {
            Ok(fed) => {
                if let Some(ips) = fed["img_per_s"].as_f64() {
                    eprintln!(
                        "gpu-check: speed: fed by the loader {ips:.0} img/s ({:.1}% of memory-fed), data stall {:.3}",
                        100.0 * ips / ours_ips,
                        fed["data_stall"].as_f64().unwrap_or(f64::NAN)
                    );
                    report["loader_fed_share_of_memory_fed"] = json!(ips / ours_ips);
                }
                report["redline_loader_fed"] = fed;
            }
            Err(why) => {
                report["redline_loader_fed"] = json!({ "error": why });
                (sides.progress)(&report);
                return Err(format!("the loader-fed run failed: {why}"));
            }
        }
        (sides.progress)(&report);
    }
    // Last, as the extra it is: everything above is reported before it starts, and it runs
    // only with PROFILE_MARGIN of the stage's time left. A profile that fails is reported,
    // not the stage's failure.
    if o.profile_steps > 0 {
        let left = sides.deadline.saturating_duration_since(Instant::now());
        report["redline_op_profile"] = match left >= PROFILE_MARGIN {
            true => op_profile(device, o).unwrap_or_else(|why| json!({ "error": why })),
            false => json!({ "error": format!(
                "not run: {:.0} s of the stage's time left, under the {} s it keeps for it",
                left.as_secs_f64(),
                PROFILE_MARGIN.as_secs()
            )}),
        };
    }
    Ok(report)
}

/// The least time left in the stage for the op profile to start (ResNet-50's eager steps at
/// batch 256 take well under a second each on an H100; the margin covers a fresh trainer and
/// its first step).
const PROFILE_MARGIN: Duration = Duration::from_secs(30);

/// PyTorch's report (or why it did not run) into `report`, with the ratios to ours.
fn compare(report: &mut Value, theirs: Result<Value, String>, ours_ips: f64) {
    match theirs {
        Ok(theirs) => {
            for side in ["eager", "compile"] {
                if let Some(ips) = theirs[side]["img_per_s"].as_f64() {
                    let ratio = ours_ips / ips;
                    eprintln!("gpu-check: speed: PyTorch {side} {ips:.0} img/s, redline ÷ PyTorch = {ratio:.2}");
                    report[format!("ratio_vs_{side}")] = json!(ratio);
                }
            }
            if let Some(r) = report["ratio_vs_eager"].as_f64() {
                report["goal_at_least_eager"] = json!(r >= 1.0);
            }
            report["pytorch"] = theirs;
        }
        Err(why) => {
            eprintln!("gpu-check: speed: PyTorch's side did not run: {why}");
            report["pytorch"] = json!({ "not_run": why });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> SpeedOptions {
        SpeedOptions {
            model: "resnet18".into(),
            res: 16,
            batch: 2,
            warmup: 1,
            steps: 2,
            graph: true,
            ..SpeedOptions::default()
        }
    }

    /// Our side on the CPU: the resident batch feeds the trainer, the timing and the report's
    /// fields are there, and a device that cannot capture says so instead of replaying.
    #[test]
    fn our_side_runs_fed_from_memory_and_reports_its_graph() {
        let report = ours(&redline_cpu::CpuBackend::device(), &tiny()).unwrap();
        assert!(report["img_per_s"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report["loss"].as_f64().unwrap().is_finite(), "{report}");
        assert_eq!(report["steps"], 2);
        assert_eq!(report["precision"], "bf16", "{report}");
        assert!(
            report["loss_scale"].is_null(),
            "bf16 has no scaler: {report}"
        );
        // The host's time issuing the steps: all of it on the CPU, which runs them as issued.
        assert!(
            report["host_ms_per_step"].as_f64().unwrap() > 0.0,
            "{report}"
        );
        let share = report["host_share_of_wall"].as_f64().unwrap();
        assert!(share > 0.5 && share <= 1.0, "{report}");
        assert_eq!(report["warmup"], GRAPH_WARMUP_STEPS + 1);
        assert_eq!(report["graph"]["replays"], 0);
        // Both measured steps' phases came back (the CPU times them with host timers).
        assert_eq!(report["phases"]["steps"], 2, "{report}");
        assert!(report["busy_fraction"].is_null(), "{report}");
        assert!(report["graph"]["eager_reason"]
            .as_str()
            .is_some_and(|r| r.contains("cannot capture")));
        // ResNet-18's 1.82 GMAC at 224² scale by area.
        let gmac = report["gmac_per_image"].as_f64().unwrap();
        assert!(
            (gmac - 1.82 * (16.0f64 / 224.0).powi(2)).abs() < 0.01,
            "{gmac}"
        );
    }

    /// The loader-fed run on the CPU: a synthetic set made, decoded by the loader into the
    /// trainer, the data stall reported.
    #[test]
    fn the_loader_fed_run_reports_its_data_stall() {
        let report = loader_fed(&redline_cpu::CpuBackend::device(), &tiny()).unwrap();
        assert!(report["img_per_s"].as_f64().unwrap() > 0.0, "{report}");
        let stall = report["data_stall"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&stall), "{report}");
        assert_eq!(report["phases"]["steps"], 2, "{report}");
    }

    /// PyTorch's side as the stage runs it, on the CPU here (the script's --device): its JSON
    /// comes back whole.
    #[test]
    fn pytorch_side_runs_the_script_and_reads_its_report() {
        let theirs = pytorch(&tiny(), "cpu").unwrap_or_else(|e| panic!("{e}"));
        assert!(
            theirs["eager"]["img_per_s"].as_f64().unwrap() > 0.0,
            "{theirs}"
        );
        assert_eq!(theirs["fused_adamw"], true);
        assert_eq!(theirs["channels_last"], true);
        assert_eq!(theirs["batch"], 2);
    }

    /// `--speed-precision fp16`: our step runs with the GradScaler and reports its loss scale
    /// after the measured steps; PyTorch's side is asked for fp16 (its GradScaler) too.
    #[test]
    fn an_fp16_stage_runs_with_a_grad_scaler_on_both_sides() {
        let o = SpeedOptions {
            precision: Precision::Fp16,
            ..tiny()
        };
        let report = ours(&redline_cpu::CpuBackend::device(), &o).unwrap();
        assert_eq!(report["precision"], "fp16", "{report}");
        assert!(report["loss"].as_f64().unwrap().is_finite(), "{report}");
        let scale = report["loss_scale"].as_f64().unwrap();
        assert!(scale > 0.0 && scale <= 65_536.0, "{report}");
        let theirs = pytorch(&o, "cpu").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(theirs["precision"], "fp16", "{theirs}");
        assert!(theirs["eager"]["img_per_s"].as_f64().unwrap() > 0.0);
    }

    /// A loss that diverges (a learning rate of 1e9 here; once seen at the default under load)
    /// leaves the report valid JSON with a null loss: Python's NaN is not JSON, and the stage
    /// would have lost PyTorch's img/s with it.
    #[test]
    fn pytorch_side_reports_a_diverged_loss_as_null() {
        let output = Command::new(std::env::var("REDLINE_PYTHON").unwrap_or("python3".into()))
            .arg(pytorch_script())
            .args(["--device", "cpu", "--model", "resnet18", "--res", "16"])
            .args([
                "--batch", "2", "--warmup", "2", "--steps", "2", "--lr", "1e9",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        let report: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert!(report["eager"]["loss"].is_null(), "{report}");
        assert!(report["eager"]["img_per_s"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn a_missing_script_or_a_hung_one_is_an_error_naming_it() {
        let mut cmd = Command::new("sleep");
        cmd.arg("5");
        let err = run_with_timeout(cmd, Duration::from_millis(200)).unwrap_err();
        assert!(err.contains("killed"), "{err}");
        let err =
            run_with_timeout(Command::new("/no/such/python"), Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("could not start"), "{err}");
    }

    /// More output than a pipe holds (PyTorch's warnings, a compile log) does not block the
    /// child until the timeout: both pipes are read as it runs.
    #[test]
    fn a_child_writing_more_than_a_pipe_holds_finishes_and_is_read_whole() {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "head -c 300000 /dev/zero | tr '\\0' x >&2; head -c 300000 /dev/zero; echo '{}'",
        ]);
        let output = run_with_timeout(cmd, Duration::from_secs(60)).unwrap();
        assert!(output.status.success());
        assert_eq!(output.stderr.len(), 300_000);
        assert_eq!(output.stdout.len(), 300_003);
        assert!(output.stdout.ends_with(b"{}\n"));
    }

    #[test]
    fn peaks_are_known_for_the_lent_cards_and_the_5090() {
        assert_eq!(peak_for("NVIDIA H200"), Some(989.0));
        assert_eq!(peak_for("NVIDIA H200 NVL"), Some(835.0));
        assert_eq!(peak_for("NVIDIA H100 80GB HBM3"), Some(989.0));
        assert_eq!(peak_for("NVIDIA H100 PCIe"), Some(756.0));
        assert_eq!(peak_for("NVIDIA GeForce RTX 5090"), Some(209.0));
        assert_eq!(peak_for("cuda-emulator"), None);
    }
}

#[cfg(test)]
mod emulated {
    use super::*;
    use std::sync::Arc;

    /// The stage on the emulated CUDA device at a size it affords: our step is captured after
    /// the warm-up and replayed, and PyTorch's side is not run on an emulator.
    #[test]
    fn the_stage_replays_a_graph_on_the_emulator_and_skips_pytorch() {
        let backend = redline_cuda::CudaBackend::emulated().unwrap();
        let device = Device::new(Arc::new(backend));
        let options = SpeedOptions {
            model: "resnet18".into(),
            res: 16,
            batch: 2,
            warmup: 0,
            steps: 1,
            vs_pytorch: false,
            // Covered on the CPU; on the emulator it would double the test's minutes.
            vs_loader: false,
            profile_steps: 1,
            stream_bytes: 1 << 20,
            ..SpeedOptions::default()
        };
        let told = std::sync::Mutex::new(Vec::new());
        let sides = Sides {
            release: &|| Ok(()),
            progress: &|so_far| told.lock().unwrap().push(so_far.clone()),
            deadline: Instant::now() + Duration::from_secs(600),
        };
        let report = stage(&device, "cuda-emulator", &options, &sides).unwrap();
        // Told after our side, and again after PyTorch's (not run here).
        let told = told.into_inner().unwrap();
        assert_eq!(told.len(), 2, "{told:?}");
        assert!(told[0]["redline"]["img_per_s"].is_number() && told[0]["pytorch"].is_null());
        assert!(told[1]["pytorch"]["not_run"].is_string(), "{told:?}");
        let graph = &report["redline"]["graph"];
        // The capture step replays once in the warm-up, the measured step once more.
        assert_eq!(graph["replays"], 2, "{report}");
        assert_eq!(graph["captures"], 1, "{report}");
        // The emulator has device timestamps: a busy fraction, of the one measured step.
        let busy = report["redline"]["busy_fraction"].as_f64().unwrap();
        assert!(busy > 0.0 && busy <= 1.0, "{report}");
        assert_eq!(report["redline"]["phases"]["steps"], 1, "{report}");
        assert_eq!(graph["eager_steps_after_warmup"], 0, "{report}");
        assert!(
            graph["kernels_per_step"].as_u64().unwrap() > 100,
            "{report}"
        );
        // Memory in use and reserved; the replayed step took nothing from the device.
        let memory = &report["redline"]["device_memory"];
        let (in_use, reserved) = (
            memory["in_use_bytes"].as_u64(),
            memory["reserved_bytes"].as_u64(),
        );
        assert!(
            in_use.is_some_and(|u| u > 0) && reserved >= in_use,
            "{report}"
        );
        assert_eq!(memory["device_allocations_measured"], 0, "{report}");
        // Op by op on the emulator's clock, with the stream bandwidth beside it.
        let profile = &report["redline_op_profile"];
        assert_eq!(profile["ops"]["clock"], "device timestamps", "{report}");
        let rows = profile["ops"]["rows"].as_array().unwrap();
        assert!(
            rows.iter()
                .any(|r| r["op"].as_str().unwrap().starts_with("conv ")),
            "{report}"
        );
        assert!(
            profile["stream_gb_per_s"].as_f64().unwrap() > 0.0,
            "{report}"
        );
        // The doctor reads the stage as the check's JSON holds it (its field names).
        let doc = json!({"commit": "test", "gpu": {"name": "cuda-emulator"},
                         "stages": [{"name": "speed", "passed": true, "detail": report.clone()}]});
        let d = redline_train::doctor::diagnose(&doc).unwrap_or_else(|e| panic!("{e}: {report}"));
        assert!(
            d.subject
                .contains("resnet18 at 16px, batch 2, bf16 on cuda-emulator"),
            "{d}"
        );
        // The memory-access finding reads the stage's op profile (the JSON the doctor sees).
        let memory = d.finding(redline_train::doctor::Bottleneck::MemoryAccess);
        assert_ne!(
            memory.status,
            redline_train::doctor::Status::NotMeasured,
            "{d}"
        );
        assert!(memory.evidence.contains("timed op by op"), "{d}");
        let launches = d.finding(redline_train::doctor::Bottleneck::Launches);
        assert!(
            launches.evidence.contains("replayed as one CUDA graph"),
            "{d}"
        );
        assert!(report["pytorch"]["not_run"].is_string(), "{report}");
        assert!(
            report.get("share_of_peak").is_none(),
            "no peak for an emulator"
        );
    }
}

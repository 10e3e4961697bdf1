//! Stage 10, `scaling` (`--nproc N`): data-parallel ResNet training on N GPUs of this machine
//! next to one GPU, as issue 20 measures it — scaling efficiency = img/s with N GPUs ÷ (N ×
//! img/s with one); the goal is ≥ 95% at 8 GPUs for ResNet-50.
//!
//! The stage starts this same executable as `scale-rank` processes, one per GPU, with
//! torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), exactly as a
//! user's job would be launched: first one process alone (the one-GPU figure), then N. Each
//! rank drives `cuda:{LOCAL_RANK}`, meets the others through the rendezvous, and trains in bf16
//! with gradients averaged over NCCL in 25 MB buckets while backward runs. Every rank is fed one
//! u8 batch resident in pinned memory (as the speed stage's memory-fed run), so the figure is
//! compute and communication, not the loader. Both sides replay the captured step after the
//! warm-up — the N processes' graphs hold the NCCL collectives — or, with `--scale-eager`,
//! both run every step eagerly: a fair ratio needs the same step. Each rank's report says how
//! its steps ran (`graph`).
//!
//! A rank reports its own JSON line: images ÷ wall time between two synchronisations that
//! every rank starts together (a barrier after the warm-up). The job's img/s is all ranks'
//! images over the slowest rank's time. A rank that fails, or a job past its timeout, stops the
//! others and the stage's error names the rank and the end of what it printed.

use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redline_dist::{connect_device, timeout_from_env, Launch, DEFAULT_BUCKET_BYTES};
use redline_loader::Resident;
use redline_tensor::Device;
use redline_train::Precision;
use serde_json::{json, Value};

use crate::speed::{self, resident_batch, timed_steps, CLASSES};

/// What one rank trains and measures (also the `scale-rank` command's arguments).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct RankOptions {
    #[arg(long, default_value_t = RankOptions::default().model)]
    pub model: String,
    #[arg(long, default_value_t = RankOptions::default().res)]
    pub res: usize,
    /// Per rank (DDP's convention): N ranks train on N × `batch` images a step.
    #[arg(long, default_value_t = RankOptions::default().batch)]
    pub batch: usize,
    #[arg(long, default_value_t = RankOptions::default().warmup)]
    pub warmup: usize,
    #[arg(long, default_value_t = RankOptions::default().steps)]
    pub steps: usize,
    /// The CPU backend and its TCP collective instead of `cuda:{LOCAL_RANK}` and NCCL: the
    /// stage's own test on a machine without GPUs, not a measurement.
    #[arg(long)]
    pub cpu: bool,
    /// Every step eager instead of replaying the captured step (on both sides).
    #[arg(long)]
    pub eager: bool,
}

impl Default for RankOptions {
    fn default() -> Self {
        Self {
            model: "resnet50".into(),
            res: 224,
            batch: 256,
            warmup: 5,
            steps: 20,
            cpu: false,
            eager: false,
        }
    }
}

impl RankOptions {
    /// The `scale-rank` arguments that give a rank these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["scale-rank".to_string()];
        for (flag, value) in [
            ("--model", self.model.clone()),
            ("--res", self.res.to_string()),
            ("--batch", self.batch.to_string()),
            ("--warmup", self.warmup.to_string()),
            ("--steps", self.steps.to_string()),
        ] {
            args.extend([flag.to_string(), value]);
        }
        if self.cpu {
            args.push("--cpu".into());
        }
        if self.eager {
            args.push("--eager".into());
        }
        args
    }
}

/// The stage: how many processes, what each runs, which executable, and how long a job may
/// take before it is stopped.
#[derive(Debug, Clone)]
pub struct ScaleOptions {
    pub nproc: usize,
    pub rank: RankOptions,
    /// The `redline-gpu-check` executable the ranks run (this one, in the pack).
    pub binary: PathBuf,
    pub timeout: Duration,
}

/// One rank of a job, in the child process: where it stands (torchrun's variables), its
/// device, the collective over the others, then warm-up, a barrier and the measured steps.
pub fn rank(o: &RankOptions) -> Result<Value, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let launch = Launch::from_env()
        .map_err(|e| err(&e))?
        .unwrap_or_else(Launch::single);
    let device = match o.cpu {
        true => redline_cpu::CpuBackend::device(),
        false => {
            let driver =
                redline_cuda::driver::CudaDriver::new(launch.local_rank).map_err(|e| err(&e))?;
            Device::new(Arc::new(redline_cuda::CudaBackend::new(Arc::new(driver))))
        }
    };
    let timeout = timeout_from_env().map_err(|e| err(&e))?;
    let collective = connect_device(&launch, &device, timeout).map_err(|e| err(&e))?;
    let graph = !o.eager;
    let (mut trainer, _) =
        crate::amp_resnet_trainer(&device, &o.model, CLASSES, o.res, graph, Precision::Bf16)?;
    if launch.world > 1 {
        trainer = trainer
            .with_data_parallel(collective.clone(), DEFAULT_BUCKET_BYTES)
            .map_err(|e| err(&e))?;
    }
    let (pixels, labels) = resident_batch(o.batch, o.res);
    let mut batches = Resident::new(
        pixels,
        labels,
        o.res,
        speed::RESIDENT_BUFFERS,
        device.host_allocator(),
    )
    .map_err(|e| err(&e))?;
    for _ in 0..o.warmup {
        trainer.train_step(&mut batches).map_err(|e| err(&e))?;
    }
    device.synchronize().map_err(|e| err(&e))?;
    collective.barrier().map_err(|e| err(&e))?;
    let timed = timed_steps(&device, &mut trainer, &mut batches, o.steps, drop)
        .map_err(|e| format!("rank {}: {e}", launch.rank))?;
    let (seconds, loss) = (timed.seconds, timed.loss);
    let (buckets, overlapped) = match trainer.data_parallel() {
        Some(dp) => {
            let launches = dp.last_launches();
            let overlapped = launches.iter().filter(|l| l.grads_pending > 0).count();
            (dp.buckets().len(), overlapped)
        }
        None => (0, 0),
    };
    let stats = trainer.graph_stats();
    Ok(json!({
        "rank": launch.rank,
        "world": launch.world,
        "local_rank": launch.local_rank,
        "device": device.name(),
        "batch": o.batch,
        "steps": o.steps,
        "seconds": seconds,
        "img_per_s": (o.batch * o.steps) as f64 / seconds,
        "loss": loss,
        "buckets": buckets,
        "overlapped_buckets": overlapped,
        "graph": {
            "requested": stats.requested, "replays": stats.replays, "nodes": stats.nodes,
            "eager_steps": stats.eager_steps, "eager_reason": stats.eager_reason,
        },
    }))
}

/// A free port on the loopback for rank 0's rendezvous.
fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// The last JSON object a rank printed, or what went wrong with it.
fn report_of(
    rank: usize,
    status: std::process::ExitStatus,
    out: &str,
    err: &str,
) -> Result<Value, String> {
    if !status.success() {
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!(
            "rank {rank} exited with {status}: {}",
            tail.join(" | ")
        ));
    }
    let line = out.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
    serde_json::from_str(line).map_err(|e| format!("rank {rank} printed no JSON report ({e})"))
}

/// Reads a child's whole stdout and stderr (on threads, so neither pipe fills and blocks it).
pub(crate) fn drain(child: &mut Child) -> [std::thread::JoinHandle<String>; 2] {
    let take = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    };
    let out = take(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = take(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    [out, err]
}

/// Makes the process `cmd` starts end with this one (Linux's parent-death signal): a check
/// ended by its stage watchdog must not leave PyTorch's side or a rank holding the GPU while
/// the machine's next command runs.
pub(crate) fn dies_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe, the one call made between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Runs a job of `world` ranks to completion and returns each rank's report, in rank order.
/// The first rank to fail stops the others (they would wait on it until their own timeout);
/// past `timeout` every rank is stopped.
pub fn job(o: &ScaleOptions, world: usize) -> Result<Vec<Value>, String> {
    let port = free_port()?;
    let mut ranks = Vec::with_capacity(world);
    for r in 0..world {
        let mut cmd = Command::new(&o.binary);
        cmd.args(o.rank.to_args())
            .envs(Launch::local_vars(r, world, port))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if o.rank.cpu {
            // Each rank's share of the cores, as `cargo xtask train --nproc` gives them.
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            cmd.env("REDLINE_CPU_THREADS", (cores / world).max(1).to_string());
        }
        dies_with_parent(&mut cmd);
        match cmd.spawn() {
            Ok(mut child) => {
                let pipes = drain(&mut child);
                ranks.push((child, pipes));
            }
            Err(e) => {
                stop(&mut ranks);
                return Err(format!(
                    "could not start rank {r} ({}): {e}",
                    o.binary.display()
                ));
            }
        }
    }
    let started = Instant::now();
    let mut status = vec![None; world];
    while status.iter().any(Option::is_none) {
        for (r, (child, _)) in ranks.iter_mut().enumerate() {
            if status[r].is_none() {
                status[r] = child.try_wait().map_err(|e| e.to_string())?;
            }
        }
        let failed = status.iter().position(|s| s.is_some_and(|s| !s.success()));
        if failed.is_some() || started.elapsed() > o.timeout {
            stop(&mut ranks);
            let texts: Vec<[String; 2]> = ranks.into_iter().map(|(_, p)| join(p)).collect();
            return Err(match failed {
                Some(r) => {
                    let s = status[r].expect("a failed rank has a status");
                    report_of(r, s, &texts[r][0], &texts[r][1])
                        .err()
                        .unwrap_or_else(|| format!("rank {r} failed"))
                }
                None => format!(
                    "the job of {world} ranks was still running after {} s: stopped",
                    o.timeout.as_secs()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks
        .into_iter()
        .enumerate()
        .map(|(r, (_, pipes))| {
            let [out, err] = join(pipes);
            report_of(r, status[r].expect("every rank ended"), &out, &err)
        })
        .collect()
}

fn join(pipes: [std::thread::JoinHandle<String>; 2]) -> [String; 2] {
    pipes.map(|p| p.join().unwrap_or_default())
}

fn stop(ranks: &mut [(Child, [std::thread::JoinHandle<String>; 2])]) {
    for (child, _) in ranks.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A job's img/s: every rank's images over the slowest rank's time (the ranks step together).
pub fn job_img_per_s(reports: &[Value]) -> Result<f64, String> {
    let mut images = 0.0;
    let mut slowest = 0f64;
    for r in reports {
        let (batch, steps, seconds) = (
            r["batch"].as_f64(),
            r["steps"].as_f64(),
            r["seconds"].as_f64(),
        );
        let (Some(batch), Some(steps), Some(seconds)) = (batch, steps, seconds) else {
            return Err(format!(
                "a rank's report lacks batch, steps or seconds: {r}"
            ));
        };
        images += batch * steps;
        slowest = slowest.max(seconds);
    }
    match slowest > 0.0 {
        true => Ok(images / slowest),
        false => Err("no rank measured any time".into()),
    }
}

/// The stage: a one-process job, then an N-process job, and the efficiency between them.
pub fn stage(o: &ScaleOptions) -> Result<Value, String> {
    if o.nproc < 2 {
        return Err(format!(
            "--nproc {} : scaling needs at least 2 processes",
            o.nproc
        ));
    }
    if !o.rank.cpu {
        let visible = redline_cuda::driver::device_count().map_err(|e| e.to_string())?;
        if visible < o.nproc {
            return Err(format!(
                "--nproc {} needs {} GPUs, this machine shows {visible} (NCCL refuses two ranks on one GPU)",
                o.nproc, o.nproc
            ));
        }
    }
    // A job that failed while replaying graphs may still be measured eagerly.
    let hint = |e: String| match o.rank.eager {
        true => e,
        false => format!("{e} (--scale-eager measures eager steps on both sides)"),
    };
    let one = job(o, 1).map_err(hint)?;
    let one_ips = job_img_per_s(&one)?;
    eprintln!("gpu-check: scaling: 1 process {one_ips:.0} img/s");
    let many = job(o, o.nproc).map_err(hint)?;
    let many_ips = job_img_per_s(&many)?;
    let efficiency = many_ips / (o.nproc as f64 * one_ips);
    eprintln!(
        "gpu-check: scaling: {} processes {many_ips:.0} img/s, efficiency {:.1}%",
        o.nproc,
        100.0 * efficiency
    );
    Ok(json!({
        "nproc": o.nproc,
        "model": o.rank.model, "res": o.rank.res, "batch_per_rank": o.rank.batch,
        "precision": "bf16", "warmup": o.rank.warmup, "steps": o.rank.steps,
        "device": if o.rank.cpu { "cpu (the harness's own test: not a measurement)" } else { "cuda:{LOCAL_RANK}" },
        "collective": if o.rank.cpu { "TCP on loopback" } else { "NCCL" },
        "graph": !o.rank.eager,
        "bucket_bytes": DEFAULT_BUCKET_BYTES,
        "one_process_img_per_s": one_ips,
        "img_per_s": many_ips,
        "scaling_efficiency": efficiency,
        "goal": "≥ 0.95 at 8 GPUs for ResNet-50",
        "ranks": many,
        "one_process": one,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signal comes when the thread that started the child ends (Linux ties it to the
    /// thread): here a helper thread, in the check the main thread, which ends with the process.
    #[test]
    fn a_child_started_to_die_with_its_parent_does() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("60");
            dies_with_parent(&mut cmd);
            cmd.spawn().unwrap()
        })
        .join()
        .unwrap();
        let started = Instant::now();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}

//! Data parallelism across real processes on loopback, with the CPU collective: each test
//! starts its ranks as child processes (this test binary again, running [`rank_process`] with
//! torchrun's variables set) and checks what they wrote.
//!
//! * K steps on 2 and 4 ranks leave every rank with the same weights, equal (to a stated
//!   tolerance: the gradient average rounds differently from one large batch's mean) to one
//!   process trained on the concatenated batches. The model has no batch norm: local batch
//!   statistics differ from the whole batch's by design.
//! * A rank that is killed, stalls, or never starts makes every other rank fail with an error
//!   naming it, within the timeout (twice it for a stalled rank 0) — rank 0, the hub, included,
//!   with torchrun's agent store or without.
//! * A checkpoint written by 2 ranks resumes on 4 with the same data order and the same result.
//! * With a GradScaler, an overflow in one rank's batch makes every rank skip the step.
//! * With synchronised batch norm, a model with batch norms trains on 2 and 4 ranks as on one
//!   process (weights and running statistics).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redline_amp::GradScaler;
use redline_dist::{Collective, DataParallel, Launch, SingleProcess, SyncBatchStats};
use redline_loader::{Mode, Order, Position, Uneven};
use redline_nn::layers::{BatchNormReLU, GlobalAvgPool};
use redline_nn::{
    named_parameters, state_dict, zero_grad, BatchNorm2d, Conv2d, Init, Linear, Module, Optimizer,
    ParamGroup, ReLU, Sequential, Sgd,
};
use redline_tensor::{Conv2dParams, DType, Device, Tensor};

const DATASET: usize = 96;
const SEED: u64 = 11;
const LR: f64 = 0.2;
/// Small buckets, so that the model's 6 parameters make several.
const BUCKET_BYTES: usize = 2048;

/// A 3×3 convolution with padding 1.
fn conv(init: &mut Init, inputs: usize, outputs: usize, stride: usize) -> Conv2d {
    let p = Conv2dParams {
        stride: [stride; 2],
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    Conv2d::new(init, inputs, outputs, 3, p).unwrap()
}

/// The test network with batch norms (one plain, one fused with its ReLU).
fn model_with_batch_norm(device: &Device) -> Sequential {
    let mut init = Init::new(SEED, device, DType::F32);
    let bn = |init: &Init, c| BatchNorm2d::new(init, c, 1.0).unwrap();
    Sequential::new()
        .push(conv(&mut init, 3, 8, 1))
        .push(bn(&init, 8))
        .push(ReLU)
        .push(conv(&mut init, 8, 16, 2))
        .push(BatchNormReLU(bn(&init, 16)))
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 16, 10).unwrap())
}

fn model(device: &Device) -> Sequential {
    let mut init = Init::new(SEED, device, DType::F32);
    Sequential::new()
        .push(conv(&mut init, 3, 8, 1))
        .push(ReLU)
        .push(conv(&mut init, 8, 16, 2))
        .push(ReLU)
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 16, 10).unwrap())
}

/// Sample `i` of a synthetic dataset: a 3×8×8 image from a hash of `i`, and the class `i % 10`
/// (plus a pattern the class sets, so there is something to learn).
fn sample(i: u64) -> (Vec<f32>, i64) {
    let class = (i % 10) as i64;
    let pixels = (0..192u64)
        .map(|j| {
            let h = (i * 192 + j)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(17);
            let noise = (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            noise + if j % 10 == class as u64 { 1.0 } else { 0.0 }
        })
        .collect();
    (pixels, class)
}

fn batch(indices: &[u64], poison: Option<u64>, device: &Device) -> (Tensor, Tensor) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for &i in indices {
        let (mut p, c) = sample(i);
        if poison == Some(i) {
            p.iter_mut().for_each(|v| *v = f32::INFINITY);
        }
        x.extend(p);
        y.push(c);
    }
    let n = indices.len();
    (
        Tensor::from_slice(&x, &[n, 3, 8, 8], device).unwrap(),
        Tensor::from_slice(&y, &[n], device).unwrap(),
    )
}

/// What a rank does: `steps` steps of `per_rank` samples, optionally from a checkpoint and
/// optionally saving one; returns the weights (flattened) or the error's text.
struct Run {
    collective: Arc<dyn Collective>,
    per_rank: usize,
    steps: usize,
    resume: Option<PathBuf>,
    save: Option<PathBuf>,
    /// This rank exits (as if killed) or stalls after this many steps.
    fail_after: Option<(usize, Failure)>,
    /// Train under a GradScaler, with this dataset sample's pixels made infinite.
    poison: Option<u64>,
    /// The model with batch norms, synchronised across ranks (`Some(true)`) or not.
    batch_norm: Option<bool>,
}

#[derive(Clone, Copy, Debug)]
enum Failure {
    Exit,
    Stall,
}

/// The weights (flattened, then the GradScaler's scale when there is one) and the bucket
/// launches (`bucket pending` per line), or the error's text.
fn train(run: Run) -> Result<(Vec<f32>, Vec<String>), String> {
    let device = redline_cpu::CpuBackend::device();
    let net = match run.batch_norm {
        Some(_) => model_with_batch_norm(&device),
        None => model(&device),
    };
    let named = named_parameters(&net);
    let params: Vec<Tensor> = named.iter().map(|(_, t)| t.clone()).collect();
    let (rank, world) = (run.collective.rank(), run.collective.world());
    let dp = DataParallel::new(run.collective.clone(), named, &[], BUCKET_BYTES)
        .map_err(|e| e.to_string())?;
    if run.batch_norm == Some(true) {
        SyncBatchStats::install(&net, &run.collective).map_err(|e| e.to_string())?;
    }
    let mut opt = Sgd::new(vec![ParamGroup::new(params.clone(), 1e-4)], 0.9, 0.0, false)
        .map_err(|e| e.to_string())?;
    let mut position = Position::default();
    if let Some(path) = &run.resume {
        position = load(path, &params, &opt.state(), world)?;
    }
    let order = Order::new(DATASET, SEED, Mode::Random)
        .and_then(|o| o.sharded(rank, world, Uneven::Drop))
        .map_err(|e| e.to_string())?;
    let mine = order.epoch(position.epoch);
    let mut scaler = match run.poison {
        Some(_) => Some(GradScaler::new(&device, DType::F32).map_err(|e| e.to_string())?),
        None => None,
    };
    let mut launches = Vec::new();
    for step in 0..run.steps {
        if let Some((after, failure)) = run.fail_after {
            if step == after {
                match failure {
                    Failure::Exit => std::process::exit(9),
                    Failure::Stall => std::thread::sleep(Duration::from_secs(3600)),
                }
            }
        }
        let at = position.index;
        let (x, y) = batch(&mine[at..at + run.per_rank], run.poison, &device);
        let loss = net
            .forward(&x)
            .and_then(|logits| logits.cross_entropy(&y, 0.0, None))
            .map_err(|e| e.to_string())?;
        let scaled = match &scaler {
            Some(s) => s.scale(&loss).map_err(|e| e.to_string())?,
            None => loss,
        };
        scaled.backward().map_err(|e| e.to_string())?;
        dp.synchronize().map_err(|e| e.to_string())?;
        launches.extend(
            dp.last_launches()
                .iter()
                .map(|l| format!("{} {}", l.bucket, l.grads_pending)),
        );
        let found_inf = match &mut scaler {
            Some(s) => Some(s.step_flag(&params).map_err(|e| e.to_string())?.clone()),
            None => None,
        };
        opt.step(LR, found_inf.as_ref())
            .map_err(|e| e.to_string())?;
        if let Some(s) = &mut scaler {
            s.update().map_err(|e| e.to_string())?;
        }
        zero_grad(opt.groups());
        position.index += run.per_rank;
    }
    if let (Some(path), 0) = (&run.save, rank) {
        save(path, &params, &opt.state(), position, world)?;
    }
    // Parameters, then (with batch norms) the running statistics.
    let mut weights = Vec::new();
    for (_, t, _) in state_dict(&net) {
        if t.dtype() == DType::F32 {
            weights.extend(t.to_vec::<f32>().map_err(|e| e.to_string())?);
        }
    }
    if let Some(s) = &scaler {
        weights.extend(s.state()[0].1.to_vec::<f32>().map_err(|e| e.to_string())?);
    }
    Ok((weights, launches))
}

/// A checkpoint: the world size, the position, then every tensor's bytes.
fn save(
    path: &Path,
    params: &[Tensor],
    state: &[(String, Tensor)],
    at: Position,
    world: usize,
) -> Result<(), String> {
    let mut bytes = Vec::new();
    for v in [world as u64, at.epoch, at.index as u64] {
        bytes.extend(v.to_le_bytes());
    }
    for t in params.iter().chain(state.iter().map(|(_, t)| t)) {
        let host = t.to_vec::<f64>().map_err(|e| e.to_string())?;
        bytes.extend(host.iter().flat_map(|v| v.to_le_bytes()));
    }
    std::fs::write(path, bytes).map_err(|e| e.to_string())
}

fn load(
    path: &Path,
    params: &[Tensor],
    state: &[(String, Tensor)],
    world: usize,
) -> Result<Position, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    let saved = Position {
        epoch: word(1),
        index: word(2) as usize,
    };
    let mut at = 24;
    for t in params.iter().chain(state.iter().map(|(_, t)| t)) {
        let values: Vec<f64> = (0..t.numel())
            .map(|i| f64::from_le_bytes(bytes[at + i * 8..at + i * 8 + 8].try_into().unwrap()))
            .collect();
        at += values.len() * 8;
        t.copy_from_f64s(&values).map_err(|e| e.to_string())?;
    }
    saved
        .reshard(Mode::Random, word(0) as usize, world)
        .map_err(|e| e.to_string())
}

// --- the rank side ----------------------------------------------------------------------

/// One rank of a job started by the tests below (it fails when run by hand: it needs the
/// variables they set).
#[test]
#[ignore = "a rank of the multi-process tests, which start it with RANK, WORLD_SIZE, … set"]
fn rank_process() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let out = PathBuf::from(var("REDLINE_TEST_OUT"));
    let launch = Launch::from_env()
        .unwrap()
        .expect("started by a multi-process test");
    let timeout = redline_dist::timeout_from_env().unwrap();
    let number = |k: &str| var(k).parse::<usize>().ok();
    if var("REDLINE_TEST_COLLECTIVES") == "1" {
        let outcome = redline_dist::connect(&launch, timeout)
            .map_err(|e| e.to_string())
            .and_then(|c| collectives(c.as_ref()));
        let text = outcome.map_or_else(|e| format!("error: {e}"), |()| "ok".to_string());
        std::fs::write(out.join(format!("rank{}.txt", launch.rank)), text).unwrap();
        return;
    }
    let result = redline_dist::connect(&launch, timeout)
        .map_err(|e| e.to_string())
        .and_then(|collective| {
            let fail_after = match var("REDLINE_TEST_FAIL").as_str() {
                "exit" => Some(Failure::Exit),
                "stall" => Some(Failure::Stall),
                _ => None,
            };
            let fails = number("REDLINE_TEST_FAILING_RANK") == Some(launch.rank);
            train(Run {
                collective,
                per_rank: number("REDLINE_TEST_PER_RANK").unwrap_or(4),
                steps: number("REDLINE_TEST_STEPS").unwrap_or(3),
                resume: std::env::var_os("REDLINE_TEST_RESUME").map(PathBuf::from),
                save: std::env::var_os("REDLINE_TEST_SAVE").map(PathBuf::from),
                fail_after: fail_after.filter(|_| fails).map(|f| (1, f)),
                poison: var("REDLINE_TEST_POISON").parse().ok(),
                batch_norm: match var("REDLINE_TEST_BN").as_str() {
                    "sync" => Some(true),
                    "local" => Some(false),
                    _ => None,
                },
            })
        });
    let rank = launch.rank;
    match result {
        Ok((weights, launches)) => {
            let bytes: Vec<u8> = weights.iter().flat_map(|w| w.to_le_bytes()).collect();
            std::fs::write(out.join(format!("rank{rank}.bin")), bytes).unwrap();
            std::fs::write(
                out.join(format!("rank{rank}.launches")),
                launches.join("\n"),
            )
            .unwrap();
        }
        Err(e) => std::fs::write(out.join(format!("rank{rank}.err")), e).unwrap(),
    }
}

/// Collectives whose buffers stream in several pieces, with mixed dtypes, checked against
/// what every rank can compute itself.
fn collectives(c: &dyn Collective) -> Result<(), String> {
    let err = |e: redline_tensor::TensorError| e.to_string();
    let dist = |e: redline_dist::DistError| e.to_string();
    let (rank, world) = (c.rank(), c.world());
    let device = redline_cpu::CpuBackend::device();
    // 3 MB of f32 (three pieces), then f64 and i64 in the same all-reduce.
    let n = 750_000;
    let big: Vec<f32> = (0..n)
        .map(|i| (i % 1000) as f32 * (rank + 1) as f32)
        .collect();
    let big = Tensor::from_slice(&big, &[n], &device).map_err(err)?;
    let small = Tensor::from_slice(&[0.5f64 * rank as f64, -1.0], &[2], &device).map_err(err)?;
    let ints = Tensor::from_slice(&[rank as i64, 1 << 40], &[2], &device).map_err(err)?;
    let tensors = [big.clone(), small.clone(), ints.clone()];
    c.all_reduce(&tensors, redline_dist::Reduce::Sum)
        .map_err(dist)?;
    let ranks_sum = (world * (world + 1) / 2) as f32;
    let got = big.to_vec::<f32>().map_err(err)?;
    if let Some(i) = (0..n).find(|&i| got[i] != (i % 1000) as f32 * ranks_sum) {
        return Err(format!("all-reduced f32 element {i}: {}", got[i]));
    }
    let half_sum = 0.5 * (world * (world - 1) / 2) as f64;
    if small.to_vec::<f64>().map_err(err)? != [half_sum, -(world as f64)] {
        return Err(format!("all-reduced f64: {:?}", small.to_vec::<f64>()));
    }
    let int_sum = (world * (world - 1) / 2) as i64;
    if ints.to_vec::<i64>().map_err(err)? != [int_sum, (1 << 40) * world as i64] {
        return Err(format!("all-reduced i64: {:?}", ints.to_vec::<i64>()));
    }
    // 1.6 MB from the last rank to everyone.
    let from = world - 1;
    let values: Vec<f32> = (0..400_000).map(|i| (i * (rank + 1)) as f32).collect();
    let b = Tensor::from_slice(&values, &[400_000], &device).map_err(err)?;
    c.broadcast(std::slice::from_ref(&b), from).map_err(dist)?;
    let got = b.to_vec::<f32>().map_err(err)?;
    if (0..400_000).any(|i| got[i] != (i * world) as f32) {
        return Err("broadcast from the last rank".into());
    }
    c.barrier().map_err(dist)
}

// --- the test side ----------------------------------------------------------------------

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `ranks` of a job of `world` with extra variables; returns the children.
fn start(world: usize, ranks: &[usize], out: &Path, extra: &[(&str, String)]) -> Vec<Child> {
    let port = free_port();
    let exe = std::env::current_exe().unwrap();
    ranks
        .iter()
        .map(|&rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([
                "rank_process",
                "--exact",
                "--ignored",
                "--quiet",
                "--test-threads=1",
            ])
            .envs(Launch::local_vars(rank, world, port))
            .env("REDLINE_TEST_OUT", out)
            .env("REDLINE_CPU_THREADS", "1");
            for (k, v) in extra {
                cmd.env(k, v);
            }
            cmd.stdout(std::process::Stdio::null()).spawn().unwrap()
        })
        .collect()
}

fn wait_all(children: Vec<Child>) {
    for mut child in children {
        let _ = child.wait();
    }
}

fn weights_of(out: &Path, rank: usize) -> Vec<f32> {
    let path = out.join(format!("rank{rank}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|_| {
        let err = std::fs::read_to_string(out.join(format!("rank{rank}.err")));
        panic!("rank {rank} wrote no weights; its error: {err:?}")
    });
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn single_process(per_rank: usize, steps: usize, poison: Option<u64>) -> Vec<f32> {
    one_process(per_rank, steps, poison, None)
}

fn one_process(
    per_rank: usize,
    steps: usize,
    poison: Option<u64>,
    batch_norm: Option<bool>,
) -> Vec<f32> {
    train(Run {
        collective: Arc::new(SingleProcess),
        per_rank,
        steps,
        resume: None,
        save: None,
        fail_after: None,
        poison,
        batch_norm,
    })
    .unwrap()
    .0
}

/// The largest difference, relative to the largest weight.
fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The stated tolerance: averaging `world` per-rank means rounds differently (in f32) from one
/// mean over the whole batch; over a few steps that stays within a few parts per million.
const TOLERANCE: f32 = 1e-5;

#[test]
fn two_and_four_ranks_train_like_one_process_on_the_concatenated_batches() {
    for world in [2, 4] {
        let out = tempfile_dir(&format!("equal{world}"));
        let per_rank = 8 / world;
        let steps = 4;
        let extra = [
            ("REDLINE_TEST_PER_RANK", per_rank.to_string()),
            ("REDLINE_TEST_STEPS", steps.to_string()),
            ("REDLINE_DIST_TIMEOUT", "60".to_string()),
        ];
        wait_all(start(world, &(0..world).collect::<Vec<_>>(), &out, &extra));
        let ranks: Vec<Vec<f32>> = (0..world).map(|r| weights_of(&out, r)).collect();
        for (r, w) in ranks.iter().enumerate().skip(1) {
            assert!(w == &ranks[0], "rank {r}'s weights differ from rank 0's");
        }
        let single = single_process(8, steps, None);
        let start_weights = single_process(8, 0, None);
        let moved = max_relative_difference(&single, &start_weights);
        let diff = max_relative_difference(&single, &ranks[0]);
        println!("{world} ranks vs one process: max relative difference {diff:e} (training moved the weights {moved:e})");
        assert!(moved > 1e-3, "training must change the weights ({moved})");
        assert!(
            diff <= TOLERANCE,
            "{world} ranks differ from one process by {diff:e}"
        );
        // Buckets start during backward: the first saw gradients still to come, and every step
        // started every bucket in order.
        let launches = std::fs::read_to_string(out.join("rank0.launches")).unwrap();
        let launches: Vec<(usize, usize)> = launches
            .lines()
            .map(|l| {
                let (b, p) = l.split_once(' ').unwrap();
                (b.parse().unwrap(), p.parse().unwrap())
            })
            .collect();
        let buckets = launches.iter().map(|l| l.0).max().unwrap() + 1;
        assert!(buckets >= 3, "{launches:?}");
        assert_eq!(launches.len(), buckets * steps);
        for (i, &(bucket, pending)) in launches.iter().enumerate() {
            assert_eq!(bucket, i % buckets);
            if bucket == 0 {
                assert!(
                    pending > 0,
                    "the first bucket started after backward ended: {launches:?}"
                );
            }
        }
    }
}

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("redline-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn error_of(out: &Path, rank: usize) -> String {
    std::fs::read_to_string(out.join(format!("rank{rank}.err")))
        .unwrap_or_else(|_| panic!("rank {rank} reported no error"))
}

#[test]
fn a_killed_or_stalled_rank_makes_the_others_fail_naming_it_within_the_timeout() {
    // Rank 2, and rank 0: the hub of the star every collective goes through.
    let timeout = 3.0;
    for (failing, failure) in [(2, "exit"), (2, "stall"), (0, "exit"), (0, "stall")] {
        let what = format!("rank {failing} {failure}");
        let out = tempfile_dir(&format!("fail-{failing}-{failure}"));
        let extra = [
            ("REDLINE_TEST_STEPS", "4".to_string()),
            ("REDLINE_TEST_FAIL", failure.to_string()),
            ("REDLINE_TEST_FAILING_RANK", failing.to_string()),
            ("REDLINE_DIST_TIMEOUT", timeout.to_string()),
        ];
        let begun = Instant::now();
        let mut children = start(3, &[0, 1, 2], &out, &extra);
        let mut stuck = children.remove(failing);
        wait_all(children);
        let took = begun.elapsed();
        let _ = stuck.kill();
        let _ = stuck.wait();
        let others: Vec<usize> = (0..3).filter(|&r| r != failing).collect();
        for &rank in &others {
            let err = error_of(&out, rank);
            assert!(
                err.contains(&format!("rank {failing} failed")),
                "{what}: rank {rank}: {err}"
            );
            let why = match failure {
                "exit" => "closed its connection",
                _ => "sent nothing for",
            };
            assert!(err.contains(why), "{what}: rank {rank}: {err}");
        }
        // Starting up and a few steps before the failure (well under a second here; 5 s
        // allows for a loaded 2-core machine), then: nothing more for an exit; one timeout
        // for a stalled rank 2, which rank 0 names; two for a stalled rank 0, since the others
        // must first give it a timeout to name a stalled rank itself.
        let waits = match (failing, failure) {
            (_, "exit") => 0.0,
            (0, _) => 2.0,
            _ => 1.0,
        };
        let bound = Duration::from_secs_f64(timeout * waits + 5.0);
        assert!(took < bound, "{what}: the others took {took:?} to give up");
        println!(
            "{what}: ranks {others:?} failed after {took:?}: {}",
            error_of(&out, others[1])
        );
    }
}

#[test]
fn a_rank_that_never_starts_is_named_by_the_rendezvous() {
    let out = tempfile_dir("absent");
    let extra = [("REDLINE_DIST_TIMEOUT", "2".to_string())];
    let begun = Instant::now();
    wait_all(start(3, &[0, 1], &out, &extra));
    let took = begun.elapsed();
    for rank in [0, 1] {
        let err = error_of(&out, rank);
        assert!(
            err.contains("rank(s) [2] of 3 did not join"),
            "rank {rank}: {err}"
        );
    }
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn a_rank_0_that_never_starts_is_named_with_or_without_an_agent_store() {
    // Ranks 1 and 2 of 3 alone, with `extra`: each must fail naming rank 0 as `named` says.
    let without_rank_0 = |name: &str, extra: &[(&str, String)], named: &str| {
        let out = tempfile_dir(name);
        let begun = Instant::now();
        wait_all(start(3, &[1, 2], &out, extra));
        assert!(begun.elapsed() < Duration::from_secs(30), "{name}");
        for rank in [1, 2] {
            let err = error_of(&out, rank);
            assert!(err.contains(named), "{name}: rank {rank}: {err}");
        }
    };
    // Without an agent, rank 0 serves the store: nothing answers at MASTER_PORT.
    let timeout = ("REDLINE_DIST_TIMEOUT", "2".to_string());
    without_rank_0(
        "absent-0",
        std::slice::from_ref(&timeout),
        "rank 0 failed during the rendezvous: it serves the store at",
    );
    // Under torchrun's agent (here a store this test serves) the store answers, but rank 0
    // never publishes its address in it.
    let port = free_port();
    let _agent = redline_dist::StoreServer::bind(&format!("127.0.0.1:{port}")).unwrap();
    let agent = [
        timeout,
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
    ];
    without_rank_0(
        "absent-0-agent",
        &agent,
        "rank 0 failed during the rendezvous: it never published its address",
    );
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_four_with_the_same_data_order() {
    let out = tempfile_dir("resume");
    let checkpoint = out.join("checkpoint.bin");
    let first = [
        ("REDLINE_TEST_PER_RANK", "4".to_string()),
        ("REDLINE_TEST_STEPS", "2".to_string()),
        ("REDLINE_TEST_SAVE", checkpoint.display().to_string()),
        ("REDLINE_DIST_TIMEOUT", "60".to_string()),
    ];
    wait_all(start(2, &[0, 1], &out, &first));
    assert!(
        checkpoint.exists(),
        "rank 0 saved no checkpoint: {:?}",
        std::fs::read_to_string(out.join("rank0.err"))
    );
    let second = [
        ("REDLINE_TEST_PER_RANK", "2".to_string()),
        ("REDLINE_TEST_STEPS", "2".to_string()),
        ("REDLINE_TEST_RESUME", checkpoint.display().to_string()),
        ("REDLINE_DIST_TIMEOUT", "60".to_string()),
    ];
    wait_all(start(4, &[0, 1, 2, 3], &out, &second));
    let resumed = weights_of(&out, 0);
    let straight = single_process(8, 4, None);
    let diff = max_relative_difference(&straight, &resumed);
    println!("2 ranks then 4 vs one process: max relative difference {diff:e}");
    assert!(
        diff <= TOLERANCE,
        "resumed on 4 ranks: differs from one process by {diff:e}"
    );
}

#[test]
fn an_overflow_on_one_rank_makes_every_rank_skip_the_step() {
    // The first sample rank 1 takes in step 1 has infinite pixels: its gradients are NaN, the
    // average carries that to rank 0, and both GradScalers skip the step and halve the scale —
    // as one process does with that sample in its batch.
    let (world, per_rank, steps) = (2, 4, 3);
    let rank1 = Order::new(DATASET, SEED, Mode::Random)
        .and_then(|o| o.sharded(1, world, Uneven::Drop))
        .unwrap()
        .epoch(0);
    let poison = rank1[per_rank];
    let out = tempfile_dir("overflow");
    let extra = [
        ("REDLINE_TEST_PER_RANK", per_rank.to_string()),
        ("REDLINE_TEST_STEPS", steps.to_string()),
        ("REDLINE_TEST_POISON", poison.to_string()),
        ("REDLINE_DIST_TIMEOUT", "60".to_string()),
    ];
    wait_all(start(world, &[0, 1], &out, &extra));
    let (a, b) = (weights_of(&out, 0), weights_of(&out, 1));
    assert!(a == b, "the ranks' weights differ");
    assert_eq!(
        *a.last().unwrap(),
        32768.0,
        "the scale was halved once, on every rank"
    );
    assert!(a.iter().all(|w| w.is_finite()), "a NaN step was applied");
    let single = single_process(per_rank * world, steps, Some(poison));
    assert_eq!(*single.last().unwrap(), 32768.0);
    // The weights alone (the scale, last, would dwarf them in the relative difference).
    let n = a.len() - 1;
    let diff = max_relative_difference(&single[..n], &a[..n]);
    let moved = max_relative_difference(&single_process(per_rank * world, 0, None), &a[..n]);
    println!(
        "overflow on rank 1: max relative difference {diff:e} from one process (moved {moved:e})"
    );
    assert!(
        moved > 1e-3,
        "the unskipped steps must change the weights ({moved})"
    );
    assert!(diff <= TOLERANCE, "differs from one process by {diff:e}");
}

#[test]
fn synchronised_batch_norm_on_2_and_4_ranks_trains_like_one_process() {
    // Batch statistics over every rank's batch: the same as one process's over the
    // concatenated batch, so weights and running statistics match it. Local statistics (each
    // rank normalising by its own images, DDP's default) do not: the contrast shows the test
    // can tell them apart.
    let steps = 3;
    let single = one_process(8, steps, None, Some(false));
    let job = |world: usize, bn: &str| {
        let out = tempfile_dir(&format!("bn-{bn}-{world}"));
        let extra = [
            ("REDLINE_TEST_PER_RANK", (8 / world).to_string()),
            ("REDLINE_TEST_STEPS", steps.to_string()),
            ("REDLINE_TEST_BN", bn.to_string()),
            ("REDLINE_DIST_TIMEOUT", "60".to_string()),
        ];
        wait_all(start(world, &(0..world).collect::<Vec<_>>(), &out, &extra));
        let ranks: Vec<Vec<f32>> = (0..world).map(|r| weights_of(&out, r)).collect();
        for (r, w) in ranks.iter().enumerate().skip(1) {
            assert!(
                w[..] == ranks[0][..] || bn == "local",
                "rank {r}'s state differs from rank 0's"
            );
        }
        max_relative_difference(&single, &ranks[0])
    };
    for world in [2, 4] {
        let diff = job(world, "sync");
        println!("synchronised batch norm, {world} ranks vs one process: max relative difference {diff:e}");
        assert!(
            diff <= TOLERANCE,
            "{world} ranks differ from one process by {diff:e}"
        );
    }
    let local = job(2, "local");
    println!("local batch norm, 2 ranks vs one process: {local:e}");
    assert!(
        local > 100.0 * TOLERANCE,
        "local statistics came out like synchronised ones ({local:e})"
    );
}

#[test]
fn collectives_of_several_pieces_and_dtypes_agree_on_three_ranks() {
    let out = tempfile_dir("collectives");
    let extra = [
        ("REDLINE_TEST_COLLECTIVES", "1".to_string()),
        ("REDLINE_DIST_TIMEOUT", "60".to_string()),
    ];
    wait_all(start(3, &[0, 1, 2], &out, &extra));
    for rank in 0..3 {
        let text = std::fs::read_to_string(out.join(format!("rank{rank}.txt"))).unwrap();
        assert_eq!(text, "ok", "rank {rank}");
    }
}

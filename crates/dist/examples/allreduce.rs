//! One rank of a data-parallel job: meets the others, checks an all-reduce, a broadcast and a
//! bucketed gradient average, and prints what it saw. The smallest working example of each
//! way to launch redline on several processes (see the crate README):
//!
//! ```text
//! # torchrun (its elastic agent serves the store; redline joins it as a client)
//! torchrun --standalone --nproc-per-node 2 --no-python target/debug/examples/allreduce
//! # any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//! RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 target/debug/examples/allreduce &
//! RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 target/debug/examples/allreduce
//! # Slurm: SLURM_STEP_NUM_TASKS / SLURM_PROCID / SLURM_LOCALID stand in for WORLD_SIZE / RANK / LOCAL_RANK
//! MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=29500 \
//!   srun --ntasks 8 target/debug/examples/allreduce
//! ```
//!
//! With `REDLINE_EXAMPLE_OUT=DIR` each rank also writes its line to `DIR/rank{RANK}.txt`, or
//! its error to `DIR/rank{RANK}.err`. For the torchrun suite, `REDLINE_EXAMPLE_FAIL=exit` (or
//! `stall`) makes rank `REDLINE_EXAMPLE_FAILING_RANK` exit (or hang) once the group has formed.

use std::sync::Arc;

use redline_dist::{connect, timeout_from_env, DataParallel, Launch, Reduce};
use redline_tensor::{Device, Tensor};

fn main() {
    if let Err(e) = run() {
        eprintln!("allreduce: {e}");
        if let (Some(dir), Ok(rank)) = (out_dir(), std::env::var("RANK")) {
            let _ = std::fs::write(dir.join(format!("rank{rank}.err")), e.to_string());
        }
        std::process::exit(1);
    }
}

fn out_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("REDLINE_EXAMPLE_OUT").map(std::path::PathBuf::from)
}

/// The torchrun suite's failing rank: gone (or hung) right after the group formed.
fn fail_if_asked(rank: usize) {
    let failing = std::env::var("REDLINE_EXAMPLE_FAILING_RANK").ok();
    if failing.and_then(|r| r.parse::<usize>().ok()) != Some(rank) {
        return;
    }
    match std::env::var("REDLINE_EXAMPLE_FAIL").as_deref() {
        Ok("exit") => std::process::exit(3),
        Ok("stall") => loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
        },
        _ => {}
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let launch = Launch::from_env()?.unwrap_or_else(Launch::single);
    let collective = connect(&launch, timeout_from_env()?)?;
    let (rank, world) = (collective.rank(), collective.world());
    fail_if_asked(rank);
    let device = Device::reference();

    // Sum of rank + 1 over the ranks: world (world + 1) / 2 on every rank.
    let x = Tensor::from_slice(&[rank as f32 + 1.0; 4], &[4], &device)?;
    collective.all_reduce(std::slice::from_ref(&x), Reduce::Sum)?;
    let sum = x.to_vec::<f32>()?[0];
    // Rank 0's value reaches everyone.
    let b = Tensor::from_slice(&[rank as f64 * 10.0 + 7.0], &[1], &device)?;
    collective.broadcast(std::slice::from_ref(&b), 0)?;
    let broadcast = b.item()?;
    // A bucketed average of each rank's gradient of sum(w * (rank + 1)): the mean of rank + 1.
    let w = Tensor::from_slice(&[0.5f32; 3], &[3], &device)?.with_requires_grad(true);
    let dp = DataParallel::new(
        Arc::clone(&collective),
        vec![("w".to_string(), w.clone())],
        &[],
        1024,
    )?;
    let scale = Tensor::from_slice(&[rank as f32 + 1.0; 3], &[3], &device)?;
    w.mul(&scale)?.sum(&[], false)?.backward()?;
    dp.synchronize()?;
    let grad = w
        .grad()
        .map(|g| g.to_vec::<f32>())
        .transpose()?
        .unwrap_or_default();
    collective.barrier()?;

    let line = format!(
        "rank {rank} of {world} (local {}, agent store {}): all-reduce sum {sum}, broadcast {broadcast}, averaged gradient {}",
        launch.local_rank,
        launch.agent_store,
        grad.first().copied().unwrap_or(f32::NAN)
    );
    println!("{line}");
    if let Some(dir) = out_dir() {
        std::fs::write(dir.join(format!("rank{rank}.txt")), line)?;
    }
    Ok(())
}

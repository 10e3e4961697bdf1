//! The CPU collective's all-reduce time, one rank of a job (launched by `cargo xtask bench
//! allreduce`, torchrun, or anything that sets torchrun's variables): `--mb` megabytes of f32
//! averaged `--iters` times after two warm-ups, as a DDP gradient bucket is. Rank 0 prints the
//! median and writes `{"world", "mb", "median_ms", "algbw_gb_per_s"}` to `--out`.

use std::time::Instant;

use redline_dist::{connect, timeout_from_env, Launch, Reduce};
use redline_tensor::{DType, Tensor};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    (args.iter().position(|a| a == name))
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("allreduce_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mb: f64 = arg("--mb", "25").parse()?;
    let iters: usize = arg("--iters", "20").parse()?;
    let out = arg("--out", "");
    let launch = Launch::from_env()?.unwrap_or_else(Launch::single);
    let collective = connect(&launch, timeout_from_env()?)?;
    let device = redline_cpu::CpuBackend::device();
    let n = (mb * 1e6 / 4.0) as usize;
    let x = Tensor::full(launch.rank as f64 + 1.0, &[n], DType::F32, &device)?;
    let mut times = Vec::new();
    for i in 0..iters + 2 {
        collective.barrier()?;
        let t = Instant::now();
        collective.all_reduce(std::slice::from_ref(&x), Reduce::Avg)?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let bytes = (n * 4) as f64;
    if collective.rank() == 0 {
        let line = format!(
            "{{\"world\": {}, \"mb\": {mb}, \"median_ms\": {:.3}, \"algbw_gb_per_s\": {:.3}}}",
            collective.world(),
            median * 1e3,
            bytes / median / 1e9
        );
        println!("{line}");
        if !out.is_empty() {
            std::fs::write(&out, line + "\n")?;
        }
    }
    Ok(())
}

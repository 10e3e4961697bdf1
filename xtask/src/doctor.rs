//! `cargo xtask doctor [REPORT...] [--run [-- BENCH OPTIONS]] [--json]`: the bottleneck of a run,
//! named by `redline-doctor` from a bench or train JSON — or from a short `bench imagenet`
//! with `--profile-ops` that `--run` measures first (device time per op where the device has
//! a clock).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser};

use crate::imagenet::ImagenetArgs;
use crate::run;

#[derive(Args)]
pub struct DoctorArgs {
    /// A report: bench-imagenet's JSON (`cargo xtask bench imagenet` writes
    /// target/bench-imagenet.json), redline-train's `--json` or redline-gpu-check's; several
    /// gpu-check reports (a GPU window's runs of one pack) are judged as one.
    reports: Vec<PathBuf>,
    /// Measure first: `bench imagenet --profile-ops --steps 5`, with the options after `--`
    /// (e.g. `-- --device wgpu --model resnet18`), then diagnose its report.
    #[arg(long)]
    run: bool,
    /// Print the diagnosis as JSON.
    #[arg(long)]
    json: bool,
    /// `bench imagenet` options for `--run`.
    #[arg(last = true)]
    bench: Vec<String>,
}

/// `bench imagenet`'s options parsed as its own command line would be (later values win).
#[derive(Parser)]
#[command(args_override_self = true)]
struct BenchLine {
    #[command(flatten)]
    args: ImagenetArgs,
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let reports = match (args.reports.is_empty(), args.run) {
        (false, true) => bail!("give a report or --run, not both"),
        (true, false) => {
            bail!("give a report (a bench or train JSON) or --run to measure a short bench first")
        }
        (false, false) => args.reports.clone(),
        (true, true) => {
            let path = run::target_dir().join("doctor-bench.json");
            let mut line = vec!["bench-imagenet".to_string()];
            line.extend(["--profile-ops", "--warmup", "2", "--steps", "5"].map(String::from));
            line.push("--json".into());
            line.push(path.display().to_string());
            line.extend(args.bench.iter().cloned());
            let bench = BenchLine::try_parse_from(line)?;
            crate::imagenet::run(bench.args)?;
            vec![path]
        }
    };
    let mut cmd = run::cargo();
    cmd.args(["run", "--release", "--quiet", "--package", "redline"])
        .args(["--bin", "redline-doctor", "--"])
        .args(&reports);
    if args.json {
        cmd.arg("--json");
    }
    run::check(&mut cmd)
}

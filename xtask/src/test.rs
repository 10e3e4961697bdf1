//! `cargo xtask test`: every check, each phase timed, and a summary of what ran and what did not.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::run::{self, Profile};

#[derive(Args)]
pub struct TestArgs {
    /// Hardware suites that must run (comma-separated: wgpu, nvrtc, torchrun, cuda); a skip becomes a
    /// failure. `CI=true` requires every hardware suite.
    #[arg(long, value_delimiter = ',')]
    require: Vec<String>,
    /// Skip the fmt and clippy phases (quicker local iterations; CI never skips them).
    #[arg(long)]
    no_lint: bool,
    /// Also build the main job from a scratch target directory with cmake and nasm hidden,
    /// as on a fresh machine (minutes; `CI=true` always does).
    #[arg(long)]
    fresh_build: bool,
}

/// A hardware suite: its own test binary, run when its hardware is present.
struct HardwareSuite {
    name: &'static str,
    kind: SuiteKind,
}

enum SuiteKind {
    /// Built: the ignored tests of test target `test`, run with the workspace's feature set (so
    /// nothing is rebuilt). They print [`SKIP_MARKER`] and return when the hardware is absent
    /// and `REDLINE_HARDWARE_REQUIRED` is not 1; with it set they fail instead.
    Built {
        test: &'static str,
        install: &'static str,
    },
    /// Not written yet: the backend that owns it is still to come.
    Missing(&'static str),
}

/// What a hardware test prints when it finds no hardware (and was not required to).
const SKIP_MARKER: &str = "redline-hardware-skip:";

const HARDWARE_SUITES: &[HardwareSuite] = &[
    HardwareSuite {
        name: "wgpu",
        kind: SuiteKind::Built {
            test: "wgpu_conformance",
            install: "apt-get install -y mesa-vulkan-drivers libvulkan1",
        },
    },
    HardwareSuite {
        name: "nvrtc",
        kind: SuiteKind::Built {
            test: "nvrtc_compile",
            install: "pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96",
        },
    },
    HardwareSuite {
        name: "torchrun",
        kind: SuiteKind::Built {
            test: "torchrun",
            install: "pip install torch==2.15.0",
        },
    },
    HardwareSuite {
        name: "nccl",
        kind: SuiteKind::Built {
            test: "nccl",
            install: "pip install nvidia-nccl-cu13 (PyTorch's wheel pulls it in)",
        },
    },
    HardwareSuite {
        name: "cuda",
        kind: SuiteKind::Missing(
            "the CUDA device suite is the GPU check pack: `cargo xtask gpu-check --pack DIR`, then DIR/run.sh on a machine with an NVIDIA GPU (the kernels run on the host emulator in `cargo test`)",
        ),
    },
];

/// The main job's binary built as a new user's machine would: a scratch target directory and
/// a PATH without cmake and nasm (libjpeg-turbo's build tools), so the pure-Rust decoder path
/// must build on its own.
fn fresh_build() -> Result<String> {
    let hidden = ["cmake", "nasm"];
    let shim = run::target_dir().join("fresh-machine/bin");
    let scratch = run::target_dir().join("fresh-machine/target");
    let _ = std::fs::remove_dir_all(run::target_dir().join("fresh-machine"));
    std::fs::create_dir_all(&shim)?;
    // Every program on PATH but the hidden ones, first occurrence first, as links in one folder.
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let link = shim.join(&name);
            if hidden.iter().any(|h| name == *h) || link.exists() {
                continue;
            }
            let _ = std::os::unix::fs::symlink(entry.path(), link);
        }
    }
    let mut build = run::cargo();
    build
        .args([
            "build",
            "--package",
            "redline-benches",
            "--bin",
            "bench-imagenet",
        ])
        .env("PATH", &shim)
        .env("CARGO_TARGET_DIR", &scratch);
    run::check(&mut build)?;
    let binary = scratch.join("debug/bench-imagenet");
    if !binary.is_file() {
        bail!("{} was not built", binary.display());
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(format!(
        "bench-imagenet built from scratch without {} (pure-Rust JPEG decoding)",
        hidden.join(" or ")
    ))
}

/// Runs one hardware suite. `required` turns "no hardware" into a failure.
fn hardware_suite(suite: &HardwareSuite, required: bool, features: &[&str]) -> Outcome {
    match suite.kind {
        SuiteKind::Missing(why) if required => Outcome::Failed(format!("required, but {why}")),
        SuiteKind::Missing(why) => Outcome::Skipped(why.into()),
        SuiteKind::Built { test, install } => {
            let mut cmd = run::cargo();
            // The workspace phases' features, so nothing is rebuilt for a different feature set.
            cmd.args(["test", "--workspace"])
                .args(features)
                .args(["--test", test, "--", "--ignored", "--nocapture"])
                .env(
                    "REDLINE_HARDWARE_REQUIRED",
                    if required { "1" } else { "0" },
                );
            eprintln!("$ {}", run::describe(&cmd));
            let output = match cmd.output() {
                Ok(o) => o,
                Err(e) => return Outcome::Failed(format!("could not start cargo: {e}")),
            };
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            eprint!("{text}");
            if !output.status.success() {
                Outcome::Failed(output.status.to_string())
            } else if text.contains(SKIP_MARKER) {
                Outcome::Skipped(format!("no {} hardware ({install})", suite.name))
            } else {
                Outcome::Passed(String::new())
            }
        }
    }
}

enum Outcome {
    Passed(String),
    Failed(String),
    Skipped(String),
}

struct Phase {
    name: String,
    outcome: Outcome,
    seconds: f64,
}

pub fn run(args: TestArgs) -> Result<()> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    for name in &args.require {
        if !HARDWARE_SUITES.iter().any(|s| s.name == name) {
            bail!(
                "--require {name}: no such hardware suite (known: {})",
                HARDWARE_SUITES
                    .iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    // libjpeg-turbo's code paths are tested wherever it builds; CI installs its tools, so
    // there a missing one is a failure rather than a quieter test.
    let decoder: Vec<&str> = match run::fast_decoder() {
        Some(_) => vec!["--features", "redline-loader/turbojpeg"],
        None if ci => bail!("CI=true: cmake and nasm must be installed to test libjpeg-turbo"),
        None => Vec::new(),
    };
    let mut phases = Vec::new();
    let mut phase = |name: &str, f: &mut dyn FnMut() -> Outcome| {
        eprintln!("\n=== {name} ===");
        let start = Instant::now();
        let outcome = f();
        let seconds = start.elapsed().as_secs_f64();
        eprintln!("=== {name}: {} in {seconds:.1}s ===", label(&outcome));
        phases.push(Phase {
            name: name.into(),
            outcome,
            seconds,
        });
    };

    if args.no_lint {
        phase("fmt", &mut || Outcome::Skipped("--no-lint".into()));
        phase("clippy", &mut || Outcome::Skipped("--no-lint".into()));
    } else {
        phase("fmt", &mut || {
            cargo_phase(run::cargo().args(["fmt", "--all", "--", "--check"]))
        });
        phase("clippy", &mut || {
            cargo_phase(
                run::cargo()
                    .args(["clippy", "--workspace", "--all-targets"])
                    .args(&decoder)
                    .args(["--", "-D", "warnings"]),
            )
        });
    }
    // Every crate's API docs build without a warning (broken links, stray HTML): what a user
    // of a single crate reads first.
    phase("docs (cargo doc --no-deps)", &mut || {
        cargo_phase(
            run::cargo()
                .args(["doc", "--no-deps", "--workspace"])
                .args(&decoder)
                .env("RUSTDOCFLAGS", "-D warnings"),
        )
    });
    phase("cargo test", &mut || {
        cargo_phase(run::cargo().args(["test", "--workspace"]).args(&decoder))
    });
    // The workspace phases above turn on the loader's libjpeg-turbo feature where it can be
    // built (CI installs cmake and nasm); the loader alone must also pass on pure Rust.
    phase("loader, pure Rust", &mut || {
        let lint = ["clippy", "--package", "redline-loader", "--all-targets"];
        match cargo_phase(run::cargo().args(lint).args(["--", "-D", "warnings"])) {
            Outcome::Passed(_) => {
                cargo_phase(run::cargo().args(["test", "--package", "redline-loader"]))
            }
            failed => failed,
        }
    });
    // CUDA 13 bindings are the default build; the CUDA 12.8 ones must keep compiling too.
    phase("cuda 12.8 bindings (check)", &mut || {
        cargo_phase(run::cargo().args([
            "check",
            "--package",
            "redline-cuda",
            "--no-default-features",
            "--features",
            "cuda-12080",
        ]))
    });
    phase(
        "cuda kernels: mutations",
        &mut || match crate::mutations::run() {
            Ok(note) => Outcome::Passed(note),
            Err(e) => Outcome::Failed(format!("{e:#}")),
        },
    );
    phase("main job on a fresh machine (no cmake, nasm)", &mut || {
        if !(ci || args.fresh_build) {
            return Outcome::Skipped("CI=true or --fresh-build: a build from scratch".into());
        }
        match fresh_build() {
            Ok(note) => Outcome::Passed(note),
            Err(e) => Outcome::Failed(format!("{e:#}")),
        }
    });
    phase("format spec (Python reader)", &mut || match spec_check() {
        Ok(note) => Outcome::Passed(note),
        Err(e) => Outcome::Failed(format!("{e:#}")),
    });
    for suite in HARDWARE_SUITES {
        // Explicitly required suites, and under CI=true every built one, fail when their
        // hardware is missing; otherwise a missing suite or missing hardware is a skip.
        let named = args.require.iter().any(|r| r == suite.name);
        let required = named || (ci && matches!(suite.kind, SuiteKind::Built { .. }));
        phase(&format!("hardware: {}", suite.name), &mut || {
            hardware_suite(suite, required, &decoder)
        });
    }

    eprintln!("\n=== summary ===");
    let mut failed = 0;
    let mut passed = 0;
    let mut skipped = 0;
    let width = phases
        .iter()
        .map(|p| p.name.chars().count())
        .max()
        .unwrap_or(0);
    for p in &phases {
        let note = match &p.outcome {
            Outcome::Passed(n) | Outcome::Failed(n) | Outcome::Skipped(n) => n,
        };
        match p.outcome {
            Outcome::Passed(_) => passed += 1,
            Outcome::Failed(_) => failed += 1,
            Outcome::Skipped(_) => skipped += 1,
        }
        eprintln!(
            "{:<width$} {:<8} {:>7.1}s  {note}",
            p.name,
            label(&p.outcome),
            p.seconds
        );
    }
    let total: f64 = phases.iter().map(|p| p.seconds).sum();
    eprintln!("total {total:.0}s");
    // The plain closing line CI reads: "N passed, N failed, N skipped".
    println!("xtask: {passed} passed, {failed} failed, {skipped} skipped");
    if failed > 0 {
        bail!("{failed} phase(s) failed");
    }
    Ok(())
}

fn label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Passed(_) => "passed",
        Outcome::Failed(_) => "FAILED",
        Outcome::Skipped(_) => "skipped",
    }
}

fn cargo_phase(cmd: &mut Command) -> Outcome {
    match run::status(cmd) {
        Ok(s) if s.success() => Outcome::Passed(String::new()),
        Ok(s) => Outcome::Failed(format!("exit {s}")),
        Err(e) => Outcome::Failed(format!("{e:#}")),
    }
}

/// Proves FORMAT.md is enough: a standard-library Python reader written from it alone must accept
/// a freshly written set and reject a damaged copy.
fn spec_check() -> Result<String> {
    let root = run::root();
    let work = run::target_dir().join("xtask/spec-check");
    let _ = fs::remove_dir_all(&work);
    let mut synth = run::data_tool_command(Profile::Dev);
    synth.args(["synth", "--out"]).arg(&work).args([
        "--classes",
        "3",
        "--images",
        "12",
        "--seed",
        "7",
        "--shard-size",
        "400000",
    ]);
    run::check(&mut synth)?;
    let reader = root.join("crates/shard/tools/read_shards.py");
    let python = |dirs: &[&Path]| -> Result<std::process::Output> {
        let mut cmd = Command::new("python3");
        cmd.arg(&reader).args(dirs);
        eprintln!("$ {}", run::describe(&cmd));
        cmd.output()
            .context("python3 is needed to run crates/shard/tools/read_shards.py")
    };
    let (train, val) = (work.join("train"), work.join("val"));
    let good = python(&[&train, &val])?;
    let stdout = String::from_utf8_lossy(&good.stdout);
    eprint!("{stdout}{}", String::from_utf8_lossy(&good.stderr));
    if !good.status.success() {
        bail!("the Python reader rejected a set the writer just made");
    }
    let shards = stdout.lines().filter(|l| l.starts_with("OK ")).count();
    if shards != 2 {
        bail!("the Python reader printed {shards} OK lines for 2 sets");
    }

    // Damage one record byte in a copy: the reader must refuse it, naming the record.
    let bad = work.join("damaged");
    fs::create_dir_all(&bad)?;
    for entry in fs::read_dir(&train)? {
        let entry = entry?;
        fs::copy(entry.path(), bad.join(entry.file_name()))?;
    }
    let shard = bad.join("shard-00000.rdl");
    let mut bytes = fs::read(&shard)?;
    bytes[4096 + 1000] ^= 0x10;
    fs::write(&shard, bytes)?;
    let refused = python(&[&bad])?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    eprint!("{stderr}");
    if refused.status.success() || !stderr.contains("record 0") {
        bail!("the Python reader accepted a damaged record (or did not name it)");
    }
    Ok("accepts a fresh set, names the damaged record in a copy".into())
}

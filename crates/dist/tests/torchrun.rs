//! The torchrun suite: a real `torchrun` (PyTorch's elastic launcher) starts the `allreduce`
//! example on 2 and 3 processes, and on two agents standing for two nodes; they join the
//! TCPStore its agent serves on MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`) as clients,
//! and all-reduce, broadcast and average a gradient correctly; a rank that dies or hangs ends
//! the job with the others naming it. `cargo xtask test` runs it when PyTorch is installed (the `torchrun`
//! suite; `pip install torch`) and reports it skipped otherwise; `REDLINE_HARDWARE_REQUIRED=1`
//! (CI) makes a missing PyTorch a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

const SKIP_MARKER: &str = "redline-hardware-skip:";

/// The `allreduce` example next to this test binary (`cargo test` builds examples).
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    profile_dir.join("examples").join("allreduce")
}

/// Whether PyTorch is importable; without it the suite prints the skip marker (or fails, when
/// `REDLINE_HARDWARE_REQUIRED=1`).
fn torch_or_skip() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import torch.distributed.run"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let required = std::env::var("REDLINE_HARDWARE_REQUIRED").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "the torchrun suite is required, but `python3 -c 'import torch.distributed.run'` \
             fails (pip install torch)"
        );
        println!("{SKIP_MARKER} no PyTorch (pip install torch): torchrun suite skipped");
    }
    found
}

/// An empty folder for the ranks' lines, named for this run.
fn fresh_dir(name: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("redline-torchrun-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    out
}

/// The example, or None (the suite skipped) without PyTorch.
fn example_or_skip() -> Option<PathBuf> {
    if !torch_or_skip() {
        return None;
    }
    let example = example();
    assert!(example.is_file(), "{} was not built", example.display());
    Some(example)
}

/// torchrun on this machine alone starting `procs` copies of `example`, with `options` of its
/// own; the ranks write into `out` and give up on each other after `timeout` seconds.
fn standalone(procs: usize, options: &[&str], example: &Path, out: &Path, timeout: f64) -> Command {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
    ])
    .arg(format!("--nproc-per-node={procs}"))
    .args(options)
    .arg("--no-python")
    .arg(example)
    .env("REDLINE_EXAMPLE_OUT", out)
    .env("REDLINE_DIST_TIMEOUT", timeout.to_string());
    cmd
}

/// Every rank of `world` wrote the line of a right all-reduce, broadcast and average, with its
/// local rank (torchrun numbers a node's ranks consecutively: rank mod processes per node).
fn check_ranks(out: &std::path::Path, world: usize, per_node: usize, what: &str) {
    let sum = (1..=world).sum::<usize>();
    let mean = sum as f64 / world as f64;
    for rank in 0..world {
        let line = std::fs::read_to_string(out.join(format!("rank{rank}.txt")))
            .unwrap_or_else(|e| panic!("{what}: rank {rank} of {world} wrote nothing: {e}"));
        println!("{what}: {line}");
        let expected = format!(
            "rank {rank} of {world} (local {}, agent store true): all-reduce sum {sum}, \
             broadcast 7, averaged gradient {mean}",
            rank % per_node
        );
        assert_eq!(line, expected, "{what}");
    }
}

#[test]
#[ignore = "the torchrun suite: needs PyTorch (cargo xtask test runs it when installed)"]
fn torchrun_starts_ranks_that_meet_in_its_agent_store() {
    let Some(example) = example_or_skip() else {
        return;
    };
    for world in [2, 3] {
        let out = fresh_dir(&world.to_string());
        let status = standalone(world, &[], &example, &out, 60.0)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "torchrun with {world} processes: {status}"
        );
        check_ranks(&out, world, world, &format!("{world} processes"));
    }
}

/// Under torchrun a rank that dies, or hangs, once the group has formed ends the job: the
/// others fail at once naming it (its connection closed) or within the timeout (it sent
/// nothing), and torchrun reports the failure — never a hang. The agent's own check of its
/// workers runs every 5 s here, so the ranks' errors come first.
#[test]
#[ignore = "the torchrun suite: needs PyTorch (cargo xtask test runs it when installed)"]
fn torchrun_ends_a_job_whose_rank_dies_or_stalls_naming_it() {
    let Some(example) = example_or_skip() else {
        return;
    };
    let timeout = 3.0;
    for failure in ["exit", "stall"] {
        let out = fresh_dir(&format!("fail-{failure}"));
        let begun = std::time::Instant::now();
        let status = standalone(3, &["--monitor-interval=5"], &example, &out, timeout)
            .env("REDLINE_EXAMPLE_FAIL", failure)
            .env("REDLINE_EXAMPLE_FAILING_RANK", "1")
            .status()
            .unwrap();
        let took = begun.elapsed();
        assert!(!status.success(), "{failure}: torchrun succeeded");
        for rank in [0, 2] {
            let err = std::fs::read_to_string(out.join(format!("rank{rank}.err")))
                .unwrap_or_else(|e| panic!("{failure}: rank {rank} reported no error: {e}"));
            println!("{failure}: rank {rank}: {err}");
            assert!(
                err.contains("rank 1 failed"),
                "{failure}: rank {rank}: {err}"
            );
        }
        // torchrun's start and stop (a few seconds), one timeout for the stall, and the
        // agent's 5 s check.
        let bound = std::time::Duration::from_secs_f64(timeout + 5.0 + 30.0);
        assert!(took < bound, "{failure}: torchrun ended after {took:?}");
        println!("{failure}: torchrun ended after {took:?} with {status}");
    }
}

/// A port nothing listens on now (the tiny race with another program is acceptable in a
/// test): a multi-node launch names its master's port up front.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Two torchrun agents on this machine stand for two nodes of 2 GPUs each, as on a cluster:
/// with the static rendezvous (`--node-rank`, `--master-addr`: node 0's agent serves the store,
/// node 1's joins it) and with the c10d rendezvous Slurm and Kubernetes jobs use
/// (`--rdzv-endpoint`, no node rank). Every rank meets the other node's in the one store, knows
/// its global rank apart from its local one (which picks its GPU), and all-reduces right.
#[test]
#[ignore = "the torchrun suite: needs PyTorch (cargo xtask test runs it when installed)"]
fn torchrun_on_two_nodes_gives_every_rank_its_global_and_local_rank() {
    let Some(example) = example_or_skip() else {
        return;
    };
    let (nodes, per_node) = (2, 2);
    let world = nodes * per_node;
    for rendezvous in ["static", "c10d"] {
        let out = fresh_dir(&format!("nodes-{rendezvous}"));
        let port = free_port();
        let agents: Vec<_> = (0..nodes)
            .map(|node| {
                let mut cmd = Command::new("python3");
                cmd.args(["-m", "torch.distributed.run"])
                    .arg(format!("--nnodes={nodes}"))
                    .arg(format!("--nproc-per-node={per_node}"));
                match rendezvous {
                    "static" => cmd
                        .arg(format!("--node-rank={node}"))
                        .arg("--master-addr=127.0.0.1")
                        .arg(format!("--master-port={port}")),
                    _ => cmd
                        .arg("--rdzv-backend=c10d")
                        .arg(format!("--rdzv-endpoint=127.0.0.1:{port}"))
                        .arg("--rdzv-id=redline-two-nodes"),
                };
                cmd.arg("--no-python")
                    .arg(&example)
                    .env("REDLINE_EXAMPLE_OUT", &out)
                    .env("REDLINE_DIST_TIMEOUT", "60")
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (node, mut agent) in agents.into_iter().enumerate() {
            let status = agent.wait().unwrap();
            assert!(
                status.success(),
                "{rendezvous} rendezvous, node {node} of {nodes}: {status}"
            );
        }
        check_ranks(&out, world, per_node, &format!("{rendezvous} rendezvous"));
    }
}

#[test]
#[ignore = "the torchrun suite: needs PyTorch (cargo xtask test runs it when installed)"]
fn pytorchs_store_client_works_with_the_store_rank_0_serves() {
    if !torch_or_skip() {
        return;
    }
    let server = redline_dist::StoreServer::bind("127.0.0.1:0").unwrap();
    let script = format!(
        r#"
import datetime, torch.distributed as d
s = d.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=20))
s.set("key", "value")
s.wait(["key"])
print(s.get("key").decode(), s.add("counter", 3), s.add("counter", 4), s.check(["key"]), s.check(["nope"]),
      s.compare_set("key", "value", "swapped").decode(), s.num_keys(), s.delete_key("counter"))
"#,
        port = server.address().port()
    );
    let output = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim(), "value 3 7 True False swapped 2 True");
}

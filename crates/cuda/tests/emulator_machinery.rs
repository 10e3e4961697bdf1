//! The emulator's machinery on its own: `emulator_machinery.cpp` launches small kernels through
//! `emulate.h` directly — no registry, no backend — and prints each case's outcome. Fibers must
//! keep their registers, stacks and alignment across barriers (the switch between them is
//! hand-written on x86-64) and start afresh after a failed launch, and every synchronisation
//! error must be named (an early exit and a missing barrier in both thread orders), and shared
//! memory a block did not write must read as the poison (NaN). Compiled twice:
//! with the hand-written switch and with glibc's ucontext (`REDLINE_EMU_UCONTEXT`), the path
//! other architectures take. Needs only a host C++ compiler (g++, or `CXX`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// What each case must print: "ok", or text its error must contain.
const EXPECTED: &[(&str, &str)] = &[
    ("tree sum, forward", "ok"),
    ("tree sum, backward", "ok"),
    ("warp sum", "ok"),
    (
        "early exit, forward",
        "__syncthreads() after another thread of the block exited (thread (1,0,0)",
    ),
    (
        "early exit, backward",
        "a thread exited while others wait at __syncthreads() (thread (0,0,0)",
    ),
    ("tree sum after a failed launch", "ok"),
    (
        "crossed barriers",
        "deadlock: threads wait at a barrier that others never reach",
    ),
    (
        "lane outside its mask",
        "__syncwarp: the calling lane is not in its mask",
    ),
    (
        "mask past the block",
        "__syncwarp: the mask names lanes past the block's last thread",
    ),
    (
        "different masks",
        "__syncwarp: lanes of one warp passed different masks",
    ),
    (
        "shuffle from outside the mask",
        "__shfl_sync: reads lane 5, which is not in the mask",
    ),
    (
        "barrier under a data-dependent condition",
        "(a barrier under a data-dependent condition)",
    ),
    (
        "missing barrier, forward",
        "32 of 64 threads read a stale slot",
    ),
    (
        "missing barrier, backward",
        "32 of 64 threads read a stale slot",
    ),
    ("shared memory a block did not write reads as NaN", "ok"),
];

/// Compiles the self-test with `defines`, runs it and returns each case's outcome.
fn outcomes(defines: &[&str], name: &str) -> BTreeMap<String, String> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cxx = redline_cuda::emulator::compiler();
    let output = Command::new(&cxx)
        .args(defines)
        .args(redline_cuda::emulator::compile_flags())
        .arg("-include")
        .arg(here.join("kernels/emulate.h"))
        .arg(here.join("tests/emulator_machinery.cpp"))
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the host C++ compiler `{cxx}`: {e}"));
    assert!(
        output.status.success(),
        "{cxx} {defines:?}:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = Command::new(&binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", binary.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{} {defines:?} ended with {} after:\n{stdout}",
        binary.display(),
        output.status
    );
    let mut outcomes = BTreeMap::new();
    for (case, what) in stdout.lines().filter_map(|line| line.split_once('\t')) {
        let earlier = outcomes.insert(case.to_string(), what.to_string());
        assert!(earlier.is_none(), "case {case:?} printed twice:\n{stdout}");
    }
    outcomes
}

fn check(defines: &[&str], name: &str) {
    let got = outcomes(defines, name);
    let mut wrong = Vec::new();
    for (case, expected) in EXPECTED {
        match got.get(*case) {
            None => wrong.push(format!("{case}: not run")),
            Some(what) if *expected == "ok" && what != "ok" => {
                wrong.push(format!("{case}: {what}"))
            }
            Some(what) if !what.contains(expected) => {
                wrong.push(format!("{case}: {what} (expected {expected:?})"))
            }
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{defines:?}:\n{}", wrong.join("\n"));
    assert_eq!(got.len(), EXPECTED.len(), "cases not expected: {got:?}");
}

#[test]
fn fibers_keep_their_state_and_every_synchronisation_error_is_named() {
    check(&[], "emulator_machinery");
}

#[test]
fn the_ucontext_switch_other_architectures_take_does_the_same() {
    check(&["-DREDLINE_EMU_UCONTEXT"], "emulator_machinery_ucontext");
}

//! `redline-gpu-check [--json PATH] [--cases N] [--steps N] [--batch N] [--res N] [--model M]
//! [--emulate]` on a GPU machine (`--emulate`: on the host emulator instead); `redline-gpu-check prepare DIR` where the pack is built. See the library docs.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("prepare") {
        let Some(dir) = args.get(1) else {
            eprintln!("usage: redline-gpu-check prepare DIR");
            return ExitCode::from(2);
        };
        return match redline_gpu_check::prepare(&PathBuf::from(dir)) {
            Ok(n) => {
                eprintln!("wrote {n} CUBINs into {dir}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("redline-gpu-check prepare: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut options = redline_gpu_check::Options::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--emulate" {
            options.emulate = true;
            continue;
        }
        let value = it.next();
        let number = |v: Option<&String>| v.and_then(|v| v.parse::<usize>().ok());
        let ok = match flag.as_str() {
            "--json" => value.map(|v| options.json = PathBuf::from(v)).is_some(),
            "--cases" => number(value).map(|n| options.cases = n as u32).is_some(),
            "--steps" => number(value).map(|n| options.steps = n).is_some(),
            "--batch" => number(value).map(|n| options.batch = n).is_some(),
            "--res" => number(value).map(|n| options.res = n).is_some(),
            "--model" => value.map(|v| options.model = v.clone()).is_some(),
            _ => false,
        };
        if !ok {
            eprintln!("redline-gpu-check: bad argument {flag} (see the crate docs)");
            return ExitCode::from(2);
        }
    }
    if redline_gpu_check::run(&options) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

//! The device registry: every backend this build has, ranked.
//!
//! Ranking (DESIGN.md, contract 3): CUDA, then a wgpu adapter that is real hardware, then the
//! CPU; a software adapter (Mesa llvmpipe/lavapipe, SwiftShader, WARP) ranks below the CPU and is
//! used only when asked for by name — it is a CPU pretending to be a GPU, slower than the CPU
//! backend itself.
//!
//! The CPU slot is the fast CPU backend (`redline-cpu`); the f64 reference is for tests only.
//! CUDA devices are listed when the driver answers (`cuda:0`, `cuda:1`, … after
//! `CUDA_VISIBLE_DEVICES`); "cuda-emulator" — the CUDA kernels on the host emulator, thousands of
//! times slower than the CPU backend — is a software device, used only by name.

use std::sync::Arc;

use redline_tensor::{Device, Result, TensorError};
use redline_wgpu::{AdapterSummary, WgpuBackend};

/// What kind of device a candidate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Cuda,
    Wgpu,
    Cpu,
}

/// A device this machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The name `by_name` accepts: `"cpu"`, `"wgpu:<adapter name>"`.
    pub name: String,
    pub kind: Kind,
    /// A software rasteriser posing as a GPU.
    pub software: bool,
}

impl Candidate {
    /// Lower is better. Software adapters come after the CPU.
    pub fn rank(&self) -> u8 {
        match (self.kind, self.software) {
            (Kind::Cuda, false) => 0,
            (Kind::Wgpu, false) => 1,
            (Kind::Cpu, _) => 2,
            (Kind::Wgpu, true) => 3,
            (Kind::Cuda, true) => 4,
        }
    }

    /// Whether `best()` may pick it: not a software device.
    pub fn automatic(&self) -> bool {
        !self.software
    }
}

fn wgpu_candidate(a: &AdapterSummary) -> Candidate {
    Candidate {
        name: format!("wgpu:{}", a.name),
        kind: Kind::Wgpu,
        software: a.software,
    }
}

/// The name of the CUDA kernels on the host emulator.
pub const CUDA_EMULATOR: &str = "cuda-emulator";

/// Every device, best first.
pub fn candidates() -> Vec<Candidate> {
    // No driver or no device is an ordinary answer here: there are simply no CUDA candidates.
    let cuda = redline_cuda::driver::device_count().unwrap_or(0);
    let mut all: Vec<Candidate> = (0..cuda)
        .map(|i| Candidate {
            name: format!("cuda:{i}"),
            kind: Kind::Cuda,
            software: false,
        })
        .collect();
    all.extend(redline_wgpu::adapters().iter().map(wgpu_candidate));
    all.push(Candidate {
        name: CUDA_EMULATOR.into(),
        kind: Kind::Cuda,
        software: true,
    });
    all.push(Candidate {
        name: "cpu".into(),
        kind: Kind::Cpu,
        software: false,
    });
    all.sort_by_key(Candidate::rank);
    all
}

fn open(candidate: &Candidate) -> Result<Device> {
    match candidate.kind {
        Kind::Cpu => Ok(redline_cpu::CpuBackend::device()),
        Kind::Wgpu => {
            let wanted = candidate.name.trim_start_matches("wgpu:").to_string();
            let backend = WgpuBackend::new(move |a| a.name == wanted)?;
            Ok(Device::new(Arc::new(backend)))
        }
        Kind::Cuda if candidate.software => Ok(Device::new(Arc::new(
            redline_cuda::CudaBackend::emulated()?,
        ))),
        Kind::Cuda => {
            let ordinal = candidate
                .name
                .trim_start_matches("cuda:")
                .parse::<usize>()
                .map_err(|_| {
                    TensorError::Device(format!("not a CUDA device: {}", candidate.name))
                })?;
            let backend = redline_cuda::CudaBackend::device(ordinal)
                .map_err(|e| TensorError::Device(format!("{}: {e}", candidate.name)))?;
            Ok(Device::new(Arc::new(backend)))
        }
    }
}

/// The best device that is not a software adapter.
pub fn best() -> Result<Device> {
    select(None).map(|(_, device)| device)
}

/// A device by name: "cpu", "cuda" (the first CUDA device), "cuda:N", "cuda-emulator", "wgpu"
/// (the best wgpu adapter, software included), or `"wgpu:<part of an adapter name>"` (e.g.
/// "wgpu:llvmpipe").
pub fn by_name(name: &str) -> Result<Device> {
    select(Some(name)).map(|(_, device)| device)
}

/// [`by_name`] (or [`best`] for `None`), opened, with the candidate it is — so a caller can
/// tell a software adapter and size its work for it.
pub fn select(name: Option<&str>) -> Result<(Candidate, Device)> {
    let all = candidates();
    let matches = |c: &&Candidate| match name {
        None => c.automatic(),
        Some("cpu") => c.kind == Kind::Cpu,
        Some("cuda") => c.kind == Kind::Cuda && !c.software,
        Some("wgpu") => c.kind == Kind::Wgpu,
        Some(exact) if exact.starts_with("cuda") => c.name == exact,
        Some(name) => name
            .strip_prefix("wgpu:")
            .is_some_and(|part| c.kind == Kind::Wgpu && c.name.contains(part)),
    };
    let choice = all.iter().find(matches).ok_or_else(|| {
        TensorError::Device(format!(
            "no device named {:?} (available: {})",
            name.unwrap_or("(best)"),
            all.iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    Ok((choice.clone(), open(choice)?))
}

/// The device a rank of a data-parallel job takes when none is named, among `all` (the GPUs
/// this process sees): `cuda:{local_rank}` on a machine with CUDA devices (one GPU per process
/// — NCCL refuses two ranks on one), the best device (`None`) on one without. A process that
/// sees a single GPU takes it whatever its local rank: the launcher bound that GPU to it
/// (Slurm's `--gpus-per-task=1`, a per-rank `CUDA_VISIBLE_DEVICES`), and if it did not, NCCL
/// names the two ranks on one GPU. A local rank beyond several visible GPUs is an error naming
/// both, never a second rank on another's GPU.
pub fn for_local_rank(local_rank: usize, all: &[Candidate]) -> Result<Option<String>> {
    let gpus: Vec<&str> = (all.iter())
        .filter(|c| c.kind == Kind::Cuda && !c.software)
        .map(|c| c.name.as_str())
        .collect();
    if gpus.is_empty() {
        return Ok(None);
    }
    let name = format!("cuda:{local_rank}");
    if gpus.contains(&name.as_str()) {
        return Ok(Some(name));
    }
    if let [only] = gpus[..] {
        return Ok(Some(only.to_string()));
    }
    Err(TensorError::Device(format!(
        "local rank {local_rank} takes {name}, but this process sees {} CUDA devices ({}): \
         start at most {} process(es) per machine, bind one GPU to each (Slurm's \
         --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank), or name a device with --device",
        gpus.len(),
        gpus.join(", "),
        gpus.len()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(kind: Kind, software: bool) -> Candidate {
        Candidate {
            name: format!("{kind:?}{software}"),
            kind,
            software,
        }
    }

    #[test]
    fn a_rank_takes_the_gpu_of_its_local_rank_and_no_other() {
        let named = |name: &str, kind: Kind, software: bool| Candidate {
            name: name.into(),
            kind,
            software,
        };
        let cpu = named("cpu", Kind::Cpu, false);
        let emulator = named("cuda-emulator", Kind::Cuda, true);
        let gpus = [
            named("cuda:0", Kind::Cuda, false),
            named("cuda:1", Kind::Cuda, false),
            cpu.clone(),
        ];
        assert_eq!(for_local_rank(1, &gpus).unwrap().as_deref(), Some("cuda:1"));
        let err = for_local_rank(2, &gpus).unwrap_err().to_string();
        assert!(
            err.contains(
                "local rank 2 takes cuda:2, but this process sees 2 CUDA devices \
                 (cuda:0, cuda:1): start at most 2 process(es) per machine, bind one GPU"
            ),
            "{err}"
        );
        // A launcher that bound one GPU to each task: local rank 3 sees it as cuda:0.
        let bound = [named("cuda:0", Kind::Cuda, false), cpu.clone()];
        assert_eq!(
            for_local_rank(3, &bound).unwrap().as_deref(),
            Some("cuda:0")
        );
        // Without a GPU (the emulator is none) every rank takes the best device.
        assert_eq!(for_local_rank(3, &[cpu, emulator]).unwrap(), None);
    }

    #[test]
    fn software_adapters_rank_below_the_cpu_and_are_never_automatic() {
        let mut all = [
            candidate(Kind::Wgpu, true),
            candidate(Kind::Cpu, false),
            candidate(Kind::Wgpu, false),
            candidate(Kind::Cuda, false),
            candidate(Kind::Cuda, true),
        ];
        all.sort_by_key(Candidate::rank);
        let order: Vec<(Kind, bool)> = all.iter().map(|c| (c.kind, c.software)).collect();
        assert_eq!(
            order,
            [
                (Kind::Cuda, false),
                (Kind::Wgpu, false),
                (Kind::Cpu, false),
                (Kind::Wgpu, true),
                (Kind::Cuda, true)
            ]
        );
        assert!(!candidate(Kind::Cuda, true).automatic());
        assert!(!candidate(Kind::Wgpu, true).automatic());
        assert!(candidate(Kind::Wgpu, false).automatic());
    }

    #[test]
    fn on_this_machine_best_never_picks_a_software_adapter() {
        let all = candidates();
        let device = best().unwrap();
        let hardware_gpu = all.iter().any(|c| c.kind == Kind::Wgpu && !c.software);
        if !hardware_gpu {
            assert_eq!(
                device.name(),
                "cpu",
                "the CPU slot wins over software adapters"
            );
        }
        if let Some(software) = all.iter().find(|c| c.software) {
            // Asked for by name, a software adapter is used.
            let device = by_name(&software.name).unwrap();
            assert!(device.name().starts_with("wgpu:"), "{}", device.name());
        }
        assert!(by_name("no-such-device").is_err());
        // Without a CUDA driver there is no cuda:0, and asking for it says what there is.
        if !all.iter().any(|c| c.name == "cuda:0") {
            let err = by_name("cuda:0").unwrap_err().to_string();
            assert!(err.contains("no device named \"cuda:0\""), "{err}");
            assert!(err.contains(CUDA_EMULATOR), "{err}");
        }
        let err = by_name("wgpu:no-such-adapter").unwrap_err().to_string();
        assert!(err.contains("available: "), "{err}");
    }
}

//! The NCCL suite, without a GPU: what of the NCCL collective runs on a machine with NCCL's
//! library but no device. The library is found where PyTorch's wheels put it and reports its
//! version; rank 0's unique id reaches every rank of a real TCP group (three threads on
//! loopback) intact, and a second rendezvous gets a fresh id; a device NCCL cannot serve is
//! refused by name (the host emulator, the CPU). The communicator and its collectives run in
//! `gpu-check`'s NCCL stage on a GPU. `cargo xtask test` runs this suite when the library is
//! installed (`pip install nvidia-nccl-cu13`; PyTorch pulls it in) and reports it skipped
//! otherwise; `REDLINE_HARDWARE_REQUIRED=1` (CI) makes a missing library a failure.

use std::sync::Arc;
use std::time::Duration;

use redline_cuda::nccl;
use redline_dist::{Collective, NcclCollective, SingleProcess, StoreClient, StoreServer};
use redline_dist::{TcpCollective, DEFAULT_BUCKET_BYTES};
use redline_tensor::{Device, Tensor};

const SKIP_MARKER: &str = "redline-hardware-skip:";

/// Whether NCCL's library loads; without it the suite prints the skip marker (or fails, when
/// `REDLINE_HARDWARE_REQUIRED=1`).
fn nccl_or_skip() -> bool {
    match nccl::library() {
        Ok(n) => {
            println!("NCCL {} from {}", n.version, n.path.display());
            true
        }
        Err(why) => {
            let required = std::env::var("REDLINE_HARDWARE_REQUIRED").is_ok_and(|v| v == "1");
            assert!(!required, "the nccl suite is required, but {why}");
            println!("{SKIP_MARKER} {why}: nccl suite skipped");
            false
        }
    }
}

/// `world` ranks as threads on loopback, each running `f` with its TCP group.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Arc<dyn Collective>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let address = server.address().to_string();
    let timeout = Duration::from_secs(60);
    let f = Arc::new(f);
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (address, f) = (address.clone(), f.clone());
            std::thread::spawn(move || {
                let mut store = StoreClient::connect(&address, timeout).unwrap();
                let group =
                    TcpCollective::connect(&mut store, "nccl/", rank, world, timeout).unwrap();
                f(Arc::new(group))
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
#[ignore = "the nccl suite: needs NCCL's library (cargo xtask test runs it when installed)"]
fn rank_zeros_unique_id_reaches_every_rank_and_each_rendezvous_gets_a_fresh_one() {
    if !nccl_or_skip() {
        return;
    }
    let ids = on_ranks(3, |group| {
        let first = NcclCollective::unique_id(&*group).unwrap();
        let second = NcclCollective::unique_id(&*group).unwrap();
        (first, second)
    });
    let (first, second) = ids[0];
    assert!(first.0.iter().any(|&b| b != 0), "rank 0 made an empty id");
    assert_ne!(first, second, "two rendezvous shared one id");
    for (rank, ids) in ids.iter().enumerate() {
        assert_eq!(*ids, (first, second), "rank {rank} got another id");
    }
}

#[test]
#[ignore = "the nccl suite: needs NCCL's library (cargo xtask test runs it when installed)"]
fn the_emulator_is_refused_by_name_with_the_reason() {
    if !nccl_or_skip() {
        return;
    }
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let error = NcclCollective::new(Arc::new(SingleProcess), &device, Duration::from_secs(5))
        .err()
        .expect("NCCL on the emulator")
        .to_string();
    assert!(
        error.contains("cuda-emulator") && error.contains("NCCL runs on CUDA devices only"),
        "{error}"
    );
}

/// Without a CUDA device (any machine) the NCCL collective is refused before any rendezvous,
/// naming the device; `connect_device` gives a CPU device the CPU collective.
#[test]
fn a_device_that_is_not_cuda_is_refused_and_gets_the_cpu_collective() {
    let device = redline_cpu::CpuBackend::device();
    let error = NcclCollective::new(Arc::new(SingleProcess), &device, Duration::from_secs(5))
        .err()
        .expect("NCCL on the CPU")
        .to_string();
    assert!(
        error.contains("NCCL needs a CUDA device") && error.contains(&device.name()),
        "{error}"
    );
    let launch = redline_dist::Launch::single();
    let group = redline_dist::connect_device(&launch, &device, Duration::from_secs(5)).unwrap();
    assert_eq!((group.rank(), group.world()), (0, 1));
    // The bucketed reducer runs over it as over any collective.
    let w = bucketed_step(group, &device).unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), [2.0, 4.0]);
}

/// One backward of `w · w` (w = [1, 2]) on `device` under a reducer over `group`; `w` back.
fn bucketed_step(group: Arc<dyn Collective>, device: &Device) -> redline_dist::Result<Tensor> {
    let w = Tensor::from_slice(&[1.0f32, 2.0], &[2], device)?.with_requires_grad(true);
    let named = vec![("w".to_string(), w.clone())];
    let dp = redline_dist::DataParallel::new(group, named, &[], DEFAULT_BUCKET_BYTES)?;
    w.mul(&w)?.sum(&[], false)?.backward()?;
    dp.synchronize()?;
    Ok(w)
}

/// A world of one whose all-reduce hands back an event that is not the device's.
struct ForeignEvents;

impl Collective for ForeignEvents {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, _: &[Tensor], _: redline_dist::Reduce) -> redline_dist::Result<()> {
        Ok(())
    }
    fn all_reduce_after(
        &self,
        _: &[Tensor],
        _: redline_dist::Reduce,
        _: &redline_tensor::Event,
    ) -> redline_dist::Result<redline_tensor::Event> {
        Ok(redline_tensor::Event::new(usize::MAX - 7, ()))
    }
    fn broadcast(&self, _: &[Tensor], _: usize) -> redline_dist::Result<()> {
        Ok(())
    }
    fn barrier(&self) -> redline_dist::Result<()> {
        Ok(())
    }
    fn split(&self) -> redline_dist::Result<Arc<dyn Collective>> {
        Ok(Arc::new(SingleProcess))
    }
}

/// `synchronize` hands each bucket's completion event to the device (the optimizer's kernels
/// wait for it there): the emulated CUDA backend checks every event it is given, so one from
/// elsewhere surfaces as the step's error.
#[test]
fn synchronize_makes_the_device_wait_for_each_buckets_event() {
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let error = bucketed_step(Arc::new(ForeignEvents), &device)
        .unwrap_err()
        .to_string();
    assert!(error.contains("another device"), "{error}");
}

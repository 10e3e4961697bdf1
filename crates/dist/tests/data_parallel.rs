//! The bucketed reducer's logic in one process, through a collective that records what it is
//! asked to reduce (and can be told to fail): bucket order, overlap with backward, gradient
//! accumulation without reduction, the misuses DDP refuses, and which thread issues a rank's
//! collectives beside synchronised batch norm.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use redline_dist::{Collective, DataParallel, DistError, Reduce, Result, SyncBatchStats};
use redline_nn::layers::GlobalAvgPool;
use redline_nn::{named_parameters, BatchNorm2d, Conv2d, Init, Linear, Module, Sequential};
use redline_tensor::{DType, Device, Tensor};

/// A world of one that records each all-reduce's tensor sizes and can be made to fail.
#[derive(Default)]
struct Recording {
    calls: Mutex<Vec<Vec<usize>>>,
    fail: Mutex<bool>,
    /// Claims to be a device collective (as NCCL is).
    device: bool,
    /// Each call's thread, reduction and tensor sizes, whatever its reduction.
    issued: Mutex<Vec<Issued>>,
}

/// One all-reduce as a collective saw it: the calling thread, the reduction, tensor sizes.
type Issued = (ThreadId, Reduce, Vec<usize>);

impl Collective for Recording {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, tensors: &[Tensor], op: Reduce) -> Result<()> {
        let sizes: Vec<usize> = tensors.iter().map(Tensor::numel).collect();
        (self.issued.lock().unwrap()).push((std::thread::current().id(), op, sizes));
        if self.device {
            return Ok(()); // sums of batch norm's statistics too
        }
        assert_eq!(op, Reduce::Avg, "gradients are averaged");
        if *self.fail.lock().unwrap() {
            return Err(DistError::Peer {
                rank: 1,
                during: "AllReduce #1".into(),
                message: "closed its connection".into(),
            });
        }
        self.calls
            .lock()
            .unwrap()
            .push(tensors.iter().map(Tensor::numel).collect());
        Ok(())
    }
    fn capturable(&self) -> bool {
        self.device
    }
    fn broadcast(&self, _tensors: &[Tensor], _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn split(&self) -> Result<Arc<dyn Collective>> {
        Ok(Arc::new(redline_dist::SingleProcess))
    }
}

/// A chain of `sizes.len()` layers y = w_i · y (elementwise, each w_i of its own size, summed
/// down to the next size): parameter 0 is used first, so its gradient is ready last.
struct Chain {
    params: Vec<Tensor>,
}

impl Chain {
    fn new(sizes: &[usize], device: &Device) -> Self {
        let params = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v: Vec<f32> = (0..n).map(|j| 0.5 + (i + j) as f32 * 0.01).collect();
                Tensor::from_slice(&v, &[n], device)
                    .unwrap()
                    .with_requires_grad(true)
            })
            .collect();
        Self { params }
    }

    fn loss(&self, x: f32) -> Tensor {
        let mut y = Tensor::from_slice(&[x], &[1], self.params[0].device()).unwrap();
        for w in &self.params {
            // [1] → [n] (broadcast) → · w → sum → [1]
            y = y
                .mul(w)
                .unwrap()
                .sum(&[], false)
                .unwrap()
                .reshape(&[1])
                .unwrap();
        }
        y.sum(&[], false).unwrap()
    }

    fn named(&self) -> Vec<(String, Tensor)> {
        (self.params.iter().enumerate())
            .map(|(i, p)| (format!("layer{i}.weight"), p.clone()))
            .collect()
    }

    fn grads(&self) -> Vec<Vec<f32>> {
        (self.params.iter())
            .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .collect()
    }

    fn zero_grad(&self) {
        self.params.iter().for_each(Tensor::zero_grad);
    }
}

#[test]
fn buckets_are_reduced_in_order_each_once_and_start_during_backward() {
    let device = Device::reference();
    // 4-byte f32s: buckets of ≤ 64 bytes from the last parameter: [4: 8, 3: 8] [2: 16] [1: 4, 0: 4]
    let chain = Chain::new(&[4, 4, 16, 8, 8], &device);
    let recording = Arc::new(Recording::default());
    let dp = DataParallel::new(recording.clone(), chain.named(), &[], 64).unwrap();
    assert_eq!(dp.buckets(), &[vec![4, 3], vec![2], vec![1, 0]]);
    for step in 0..2 {
        chain.loss(1.0 + step as f32).backward().unwrap();
        dp.synchronize().unwrap();
        let launches = dp.last_launches();
        let order: Vec<usize> = launches.iter().map(|l| l.bucket).collect();
        assert_eq!(order, [0, 1, 2], "step {step}");
        // Bucket 0 started while three parameters were still waiting for their gradients.
        assert_eq!(launches[0].grads_pending, 3, "{launches:?}");
        assert_eq!(launches[2].grads_pending, 0);
        chain.zero_grad();
    }
    let calls = recording.calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        [
            vec![8, 8],
            vec![16],
            vec![4, 4],
            vec![8, 8],
            vec![16],
            vec![4, 4]
        ]
    );
}

#[test]
fn accumulation_steps_reduce_nothing_until_the_last_one_reduces_the_totals() {
    let device = Device::reference();
    let chain = Chain::new(&[3, 5], &device);
    let recording = Arc::new(Recording::default());
    let dp = DataParallel::new(recording.clone(), chain.named(), &[], 1 << 20).unwrap();
    dp.no_sync(|| {
        chain.loss(1.0).backward().unwrap();
        dp.synchronize().unwrap(); // nothing to wait for
    });
    assert!(recording.calls.lock().unwrap().is_empty());
    chain.loss(2.0).backward().unwrap();
    dp.synchronize().unwrap();
    assert_eq!(recording.calls.lock().unwrap().len(), 1);
    let accumulated = chain.grads();
    // The same two passes without data parallelism.
    let plain = Chain::new(&[3, 5], &device);
    plain.loss(1.0).backward().unwrap();
    plain.loss(2.0).backward().unwrap();
    assert_eq!(accumulated, plain.grads());
}

#[test]
fn an_unused_parameter_a_second_backward_and_a_failed_collective_are_errors() {
    let device = Device::reference();
    let chain = Chain::new(&[2, 2, 2], &device);
    let unused = Tensor::from_slice(&[1.0f32], &[1], &device)
        .unwrap()
        .with_requires_grad(true);
    let mut named = chain.named();
    named.push(("head.bias".into(), unused));
    let recording = Arc::new(Recording::default());
    let dp = DataParallel::new(recording.clone(), named, &[], 1 << 20).unwrap();
    chain.loss(1.0).backward().unwrap();
    let err = dp.synchronize().unwrap_err().to_string();
    assert!(
        err.contains("1 of 4 parameters got no gradient") && err.contains("head.bias"),
        "{err}"
    );
    chain.zero_grad();

    let dp = DataParallel::new(recording.clone(), chain.named(), &[], 1 << 20).unwrap();
    chain.loss(1.0).backward().unwrap();
    chain.loss(1.0).backward().unwrap();
    let err = dp.synchronize().unwrap_err().to_string();
    assert!(
        err.contains("a second gradient in one step") && err.contains("no_sync"),
        "{err}"
    );
    chain.zero_grad();

    *recording.fail.lock().unwrap() = true;
    chain.loss(1.0).backward().unwrap();
    let err = dp.synchronize().unwrap_err().to_string();
    assert!(err.contains("rank 1 failed during AllReduce #1"), "{err}");
}

#[test]
fn a_gradient_hook_sees_each_leafs_complete_gradient_once_last_layer_first() {
    let device = Device::reference();
    let chain = Chain::new(&[2, 3, 4], &device);
    let seen = Arc::new(Mutex::new(Vec::new()));
    for (i, p) in chain.params.iter().enumerate() {
        let seen = seen.clone();
        p.set_grad_hook(Some(Arc::new(move |t: &Tensor| {
            let sum: f32 = t.grad().unwrap().to_vec::<f32>().unwrap().iter().sum();
            seen.lock().unwrap().push((i, sum));
        })))
        .unwrap();
    }
    chain.loss(1.0).backward().unwrap();
    let seen = seen.lock().unwrap().clone();
    let order: Vec<usize> = seen.iter().map(|s| s.0).collect();
    assert_eq!(order, [2, 1, 0]);
    for ((i, sum), grad) in seen.iter().zip([2, 1, 0].map(|i| chain.grads()[i].clone())) {
        assert_eq!(*sum, grad.iter().sum::<f32>(), "parameter {i}");
    }
    // Only a leaf that requires gradients takes a hook.
    let plain = Tensor::from_slice(&[1.0f32], &[1], &device).unwrap();
    assert!(plain.set_grad_hook(None).is_err());
}

/// conv → batch norm → pool → linear: five parameters, a batch norm between them.
fn net_with_batch_norm(device: &Device) -> Sequential {
    let mut init = Init::new(3, device, DType::F32);
    let conv = Conv2d::resnet(&mut init, 3, 4, 3, 1, 1).unwrap();
    let bn = BatchNorm2d::new(&init, 4, 1.0).unwrap();
    let head = Linear::new(&mut init, 4, 2).unwrap();
    Sequential::new()
        .push(conv)
        .push(bn)
        .push(GlobalAvgPool)
        .push(head)
}

/// Two steps of `net` (forward, backward, synchronize) over `group` with synchronised batch
/// norm over what `install` gives it; that group and each step's calls as `group` saw them.
fn steps_with_sync_batch_norm(group: &Arc<Recording>) -> (Arc<dyn Collective>, Vec<Vec<Issued>>) {
    let device = Device::reference();
    let net = net_with_batch_norm(&device);
    let shared: Arc<dyn Collective> = group.clone();
    // 4-byte buckets: each parameter is a bucket of its own, started as its gradient lands.
    let dp = DataParallel::new(shared.clone(), named_parameters(&net), &[], 4).unwrap();
    let stats = SyncBatchStats::install(&net, &shared).unwrap();
    let values: Vec<f32> = (0..2 * 3 * 5 * 5).map(|i| (i % 7) as f32 - 3.0).collect();
    let x = Tensor::from_slice(&values, &[2, 3, 5, 5], &device).unwrap();
    let steps = (0..2)
        .map(|_| {
            let loss = net.forward(&x).unwrap().sum(&[], false).unwrap();
            loss.backward().unwrap();
            dp.synchronize().unwrap();
            named_parameters(&net)
                .iter()
                .for_each(|(_, p)| p.zero_grad());
            std::mem::take(&mut *group.issued.lock().unwrap())
        })
        .collect();
    (stats, steps)
}

#[test]
fn a_device_collective_gets_a_ranks_every_collective_from_the_backward_thread_in_one_order() {
    // NCCL asks that collectives sharing a device be issued in one order on every rank: with
    // batch norm's sums and the gradient buckets on one group, issued by one thread in
    // autograd's (deterministic) order, they are.
    let device_group = Arc::new(Recording {
        device: true,
        ..Recording::default()
    });
    let (stats, steps) = steps_with_sync_batch_norm(&device_group);
    let shared: Arc<dyn Collective> = device_group.clone();
    assert!(Arc::ptr_eq(&stats, &shared), "batch norm shares the group");
    let here = std::thread::current().id();
    for (step, calls) in steps.iter().enumerate() {
        assert!(
            calls.iter().all(|(t, ..)| *t == here),
            "step {step}: {calls:?}"
        );
        // Batch norm's backward sums land between the buckets: the head's buckets were issued
        // before them, the convolution's after.
        let ops: Vec<Reduce> = calls.iter().map(|(_, op, _)| *op).collect();
        let first_avg = ops.iter().position(|op| *op == Reduce::Avg).unwrap();
        let last_avg = ops.iter().rposition(|op| *op == Reduce::Avg).unwrap();
        assert!(
            ops[first_avg..last_avg].contains(&Reduce::Sum),
            "step {step}: {ops:?}"
        );
        assert_eq!(ops.iter().filter(|op| **op == Reduce::Avg).count(), 5);
        // Batch norm's sums over 4 channels with the count riding along, then its squares,
        // and their gradients back: no all-reduce of a count on its own (read on the host,
        // it made every step wait for the device).
        let sums: Vec<&[usize]> = (calls.iter())
            .filter(|(_, op, _)| *op == Reduce::Sum)
            .map(|(_, _, sizes)| sizes.as_slice())
            .collect();
        assert_eq!(sums, [[5], [4], [4], [5]], "step {step}: {calls:?}");
    }
    let strip = |calls: &[Issued]| -> Vec<(Reduce, Vec<usize>)> {
        calls.iter().map(|(_, op, n)| (*op, n.clone())).collect()
    };
    assert_eq!(
        strip(&steps[0]),
        strip(&steps[1]),
        "the same order each step"
    );

    // A host collective blocks until its peers answer: its buckets go to a thread of their
    // own, and batch norm gets a group split from it, never sharing one with that thread.
    let host_group = Arc::new(Recording::default());
    let (stats, steps) = steps_with_sync_batch_norm(&host_group);
    let host: Arc<dyn Collective> = host_group.clone();
    assert!(
        !Arc::ptr_eq(&stats, &host),
        "batch norm splits its own group"
    );
    for calls in &steps {
        assert_eq!(calls.len(), 5, "{calls:?}");
        assert!(calls
            .iter()
            .all(|(t, op, _)| *t != here && *op == Reduce::Avg));
    }
}

//! Graph capture on the host emulator: a capture records launches instead of running them and a
//! replay runs them again with the arguments of capture time — addresses and values. So a
//! replayed training step equals eager steps only if nothing in the step is decided on the host
//! or baked into a launch, and only if the memory the graph's ops use stays the graph's while
//! eager ops run between replays (the caching allocator's graph ownership). What a graph cannot
//! hold is refused while capturing.

use std::sync::Arc;

use redline_cuda::CudaBackend;
use redline_nn::{AdamW, Optimizer, ParamGroup};
use redline_tensor::{DType, Device, Tensor};

fn device() -> Device {
    Device::new(Arc::new(
        CudaBackend::emulated().expect("the host emulator"),
    ))
}

/// The shared contract check: bit for bit on the emulator (the same kernels run both ways).
#[test]
fn a_replayed_training_step_equals_eager_steps_with_new_inputs_between_replays() {
    let report = redline_testkit::graphs::check_captured_step(&device(), 5, 0.0).unwrap();
    println!("{report:?}");
    assert!(report.nodes > 20, "{report:?}");
}

#[test]
fn a_replayed_adamw_update_equals_eager_updates() {
    let device = device();
    let values: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<f32> = (0..300).map(|i| (i as f32 * 0.11).cos()).collect();
    let make = || {
        let p = Tensor::from_slice(&values, &[300], &device)
            .unwrap()
            .with_requires_grad(true);
        p.mul(&Tensor::from_slice(&grads, &[300], &device).unwrap())
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
        let mut adamw = AdamW::new(
            vec![ParamGroup::new(vec![p.clone()], 0.01)],
            0.9,
            0.999,
            1e-8,
        )
        .unwrap();
        adamw.set_lr(1e-2).unwrap();
        (p, adamw)
    };
    let ((p_eager, mut eager), (p_captured, mut captured)) = (make(), make());
    let (graph, ()) = device.capture(|| captured.update(None)).unwrap();
    for k in 0..3 {
        eager.update(None).unwrap();
        graph.replay().unwrap();
        assert_eq!(
            p_captured.to_vec::<f32>().unwrap(),
            p_eager.to_vec::<f32>().unwrap(),
            "update {k}"
        );
    }
}

/// A draw from a [`RandomStream`] captured once draws fresh numbers on every replay — its offset
/// is a device scalar the kernel reads and the graph advances — where a host offset would be
/// baked into the launch and repeat: replay k equals the host stream at offset 10·k, and the
/// dropout mask of a captured step changes from replay to replay.
#[test]
fn a_replayed_random_draw_follows_its_device_offset() {
    use redline_tensor::RandomStream;
    let device = device();
    let stream = RandomStream::new(9, &device).unwrap();
    let (graph, drawn) = device
        .capture(|| stream.uniform(&[10], DType::F32))
        .unwrap();
    let x = Tensor::from_slice(&[1.0f32; 64], &[64], &device).unwrap();
    let (masked, dropped) = device
        .capture(|| x.dropout_with(0.5, &stream, true))
        .unwrap();
    let mut masks = Vec::new();
    for k in 0..3u64 {
        graph.replay().unwrap();
        let want = Tensor::random_uniform(&[10], DType::F32, 9, 74 * k, &device).unwrap();
        assert_eq!(
            drawn.to_vec::<f32>().unwrap(),
            want.to_vec::<f32>().unwrap(),
            "replay {k}"
        );
        masked.replay().unwrap();
        masks.push(dropped.to_vec::<f32>().unwrap());
    }
    assert_eq!(stream.offset().to_vec::<i64>().unwrap(), [3 * 74]);
    assert!(
        masks[0] != masks[1] && masks[1] != masks[2],
        "a new mask each replay"
    );
}

/// What a graph cannot hold fails while capturing, naming what and why, and the capture ends
/// (the device works eagerly again).
#[test]
fn a_download_or_a_host_copy_inside_a_capture_is_refused() {
    let device = device();
    let x = Tensor::from_slice(&[1.0f32, 2.0], &[2], &device).unwrap();
    let error = device
        .capture(|| x.mul_scalar(2.0)?.to_vec::<f32>())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("a download inside a graph capture"),
        "{error}"
    );
    let error = device
        .capture(|| x.copy_from_f64s(&[3.0, 4.0]))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("a copy from host memory inside a graph capture"),
        "{error}"
    );
    let error = device
        .capture(|| device.synchronize())
        .unwrap_err()
        .to_string();
    assert!(error.contains("a synchronize inside"), "{error}");
    // Eager again: the ops run.
    assert_eq!(
        x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(),
        [2.0, 4.0]
    );
}

/// The memory a graph's ops use stays the graph's while it lives — also blocks freed during
/// the capture — and returns to the cache when it goes.
#[test]
fn graph_memory_stays_with_the_graph_until_it_drops() {
    let backend = Arc::new(CudaBackend::emulated().unwrap());
    let device = Device::new(backend.clone());
    let x = Tensor::from_slice(&[1.0f32; 256], &[256], &device).unwrap();
    let (graph, y) = device
        .capture(|| {
            let t = x.mul_scalar(3.0)?; // freed inside the capture, used by its next op
            t.add_scalar(1.0)
        })
        .unwrap();
    graph.replay().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![4.0; 256]);
    // Eager allocations of the same size get other blocks: the replay's answer survives them.
    let others: Vec<Tensor> = (0..4)
        .map(|_| Tensor::full(-5.0, &[256], DType::F32, &device).unwrap())
        .collect();
    x.copy_from_f64s(&[2.0; 256]).unwrap();
    graph.replay().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![7.0; 256]);
    for o in &others {
        assert_eq!(o.to_vec::<f32>().unwrap(), vec![-5.0; 256]);
    }
    let memory = backend.memory();
    assert!(
        memory.graph_bytes() >= 2 * 256 * 4,
        "{}",
        memory.graph_bytes()
    );
    drop(graph);
    drop(y);
    assert_eq!(memory.graph_bytes(), 0);
}

/// A block that outlived its graph and is freed during another capture — which may have read
/// it — belongs to the new graph: eager tensors made afterwards never get it.
#[test]
fn a_block_freed_during_a_capture_joins_that_graph_whatever_owned_it_before() {
    let device = device();
    let x = Tensor::full(1.0, &[256], DType::F32, &device).unwrap();
    let (first, y) = device.capture(|| x.mul_scalar(2.0)).unwrap();
    first.replay().unwrap();
    drop(first); // y's block: its graph is gone, y still holds it
    let (second, z) = device
        .capture(move || {
            let z = y.add_scalar(1.0)?;
            drop(y); // freed while capturing; the graph's op reads it at every replay
            Ok(z)
        })
        .unwrap();
    let eager: Vec<Tensor> = (0..4)
        .map(|_| Tensor::full(-5.0, &[256], DType::F32, &device).unwrap())
        .collect();
    second.replay().unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.0; 256]);
    for e in &eager {
        assert_eq!(e.to_vec::<f32>().unwrap(), vec![-5.0; 256]);
    }
}

/// At the memory cap inside a capture the caching allocator keeps its cache: the driver takes
/// no free of ordinary memory while capturing (the emulator fails such a capture, as a GPU
/// would; there the frees failed unseen and the cache leaked). The op's out-of-memory error
/// ends the capture, and the cached block serves the eager request after it.
#[test]
fn the_memory_cap_inside_a_capture_is_an_error_and_the_cache_survives_it() {
    let emulator = Arc::new(redline_cuda::Emulator::new().unwrap());
    let backend = Arc::new(CudaBackend::with_memory_cap(emulator, Some(8192)));
    let device = Device::new(backend.clone());
    drop(Tensor::full(1.0, &[1024], DType::F32, &device).unwrap()); // 4 KiB, now cached
    let before = backend.memory_stats();
    assert_eq!((before.in_use, before.reserved), (0, 4096), "{before}");
    // 6 KiB beside the cached 4 KiB passes the 8 KiB cap; outside a capture the cache would
    // be given back first.
    let err = device
        .capture(|| Tensor::full(2.0, &[1536], DType::F32, &device))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of memory"), "{err}");
    assert!(!err.contains("freed while capturing"), "{err}");
    let after = backend.memory_stats();
    assert_eq!(after.reserved, 4096, "{after}");
    let t = Tensor::full(3.0, &[1024], DType::F32, &device).unwrap();
    let reused = backend.memory_stats();
    assert_eq!(
        reused.device_allocations, after.device_allocations,
        "{reused}"
    );
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 1024]);
}

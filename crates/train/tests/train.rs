//! The trainer end to end on the CPU backend: real JPEG shards from the synthetic set, the
//! real loader, a small CNN. Fixed step counts, no timing assertions.

use std::path::Path;
use std::sync::Arc;

use redline_cpu::CpuBackend;
use redline_datasets::generate::{synth_shards, SynthOptions};
use redline_loader::{Config, Loader, Position};
use redline_nn::layers::GlobalAvgPool;
use redline_nn::{
    decay_groups, named_parameters, AdamW, BatchNorm2d, Conv2d, Init, Linear, MaxPool2d, Optimizer,
    ParamGroup, ReLU, Schedule, Sequential, Sgd,
};
use redline_shard::ShardSet;
use redline_tensor::{DType, Device, Pool2dParams, Tensor};
use redline_train::profile::OpProfile;
use redline_train::{Phase, Precision, TrainConfig, Trainer};

const CLASSES: usize = 4;
const RES: usize = 32;

fn small_cnn(device: &Device) -> Sequential {
    small_cnn_reading_a_gradient(device, false)
}

/// The small CNN, with `host_read` a layer between its blocks whose backward reads its
/// gradient on the host: legal eagerly, refused inside a graph capture.
fn small_cnn_reading_a_gradient(device: &Device, host_read: bool) -> Sequential {
    let mut init = Init::new(3, device, DType::F32);
    let conv =
        |init: &mut Init, i, o, stride| Conv2d::resnet(init, i, o, 3, stride, 1).expect("conv");
    let bn = |init: &Init, c| BatchNorm2d::new(init, c, 1.0).expect("bn");
    let first = Sequential::new()
        .push(conv(&mut init, 3, 16, 1))
        .push(bn(&init, 16))
        .push(ReLU)
        .push(MaxPool2d(Pool2dParams {
            kernel: [2, 2],
            stride: [2, 2],
            padding: [0, 0],
        }));
    let first = match host_read {
        true => first.push(ReadsGradientOnHost),
        false => first,
    };
    first
        .push(conv(&mut init, 16, 32, 2))
        .push(bn(&init, 32))
        .push(ReLU)
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 32, CLASSES).expect("linear"))
}

fn synth(dir: &Path, images: u64) -> (Arc<ShardSet>, Arc<ShardSet>) {
    let options = SynthOptions {
        classes: CLASSES as u32,
        images,
        seed: 11,
        ..SynthOptions::default()
    };
    synth_shards(dir, &options).expect("synthetic shards");
    let open = |split: &str| Arc::new(ShardSet::open(dir.join(split)).expect("shard set"));
    (open("train"), open("val"))
}

fn loader(set: &Arc<ShardSet>, batch: usize, train: bool) -> Loader {
    let config = Config::new(batch, RES, train);
    Loader::new(set.clone(), config, Position::default()).expect("loader")
}

#[test]
fn a_small_cnn_learns_the_synthetic_set_well_above_chance() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = synth(dir.path(), 384);
    let device = CpuBackend::device();
    let model = small_cnn(&device);
    let epochs = 8;
    let mut batches = loader(&train, 32, true);
    let total = epochs * batches.batches_per_epoch();
    let sgd = Sgd::new(decay_groups(&model, 5e-4), 0.9, 0.0, true).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: 0.2,
        schedule: Schedule::one_cycle(total),
    };
    let mut trainer = Trainer::new(Box::new(model), Box::new(sgd), config, device).unwrap();
    let mut losses = Vec::new();
    for _ in 0..total {
        let step = trainer.train_step(&mut batches).unwrap();
        assert_eq!(step.images, 32);
        // The CPU backend is timed on the host: each step's times are known at once.
        let times = step.times.expect("a synchronous device's own step times");
        assert!(times.get(Phase::Backward) > std::time::Duration::ZERO);
        losses.push(step.loss.item().unwrap());
    }
    let mut val_batches = loader(&val, 32, false);
    let n = val_batches.batches_per_epoch();
    let eval = trainer.evaluate(&mut val_batches.by_ref().take(n)).unwrap();
    let first: f64 = losses[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = losses[losses.len() - 5..].iter().sum::<f64>() / 5.0;
    eprintln!("loss {first:.3} → {last:.3}, val {eval:?}");
    assert_eq!(eval.images, val.len() as usize);
    assert!(last < first, "training loss falls: {first} → {last}");
    // Chance is 1/4 (this recipe reaches about 0.78 here).
    assert!(eval.top1 > 0.45, "val top-1 {} (chance 0.25)", eval.top1);
    assert_eq!(eval.top5, 1.0, "4 classes: always in the top 5");
}

fn bits(tensors: Vec<(String, Tensor)>) -> Vec<(String, Vec<u64>)> {
    tensors
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                t.to_f64_vec()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn a_full_fp16_step_with_an_inf_gradient_changes_nothing_but_the_scale() {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 16);
    let device = CpuBackend::device();
    let model = small_cnn(&device);
    let adamw = AdamW::new(decay_groups(&model, 0.05), 0.9, 0.999, 1e-8).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp16,
        label_smoothing: 0.1,
        clip_norm: Some(1.0),
        base_lr: 1e-3,
        schedule: Schedule::Constant,
    };
    let mut trainer = Trainer::new(Box::new(model), Box::new(adamw), config, device).unwrap();
    let mut batches = loader(&train, 8, true);
    trainer.train_step(&mut batches).unwrap();
    let weights = bits(named_parameters(trainer.model()));
    let state = bits(trainer.optimizer().state());
    let scale = trainer.scaler().expect("fp16 has a scaler").state()[0]
        .1
        .item()
        .unwrap();
    assert_eq!(scale, 65536.0);

    let batch = batches.next().unwrap().unwrap();
    let inputs = trainer.upload(batch).unwrap();
    assert_eq!(
        inputs.x.dtype(),
        DType::F16,
        "the input op writes the compute dtype"
    );
    let loss = trainer.forward(&inputs).unwrap();
    assert_eq!(loss.dtype(), DType::F32, "the loss is computed in f32");
    trainer.backward(&loss).unwrap();
    let (_, w) = &named_parameters(trainer.model())[0];
    let g = w.grad().unwrap();
    let mut v = g.to_vec::<f32>().unwrap();
    v[0] = f32::INFINITY;
    g.assign(&Tensor::from_slice(&v, g.shape(), g.device()).unwrap())
        .unwrap();
    trainer.update().unwrap();

    assert_eq!(
        bits(named_parameters(trainer.model())),
        weights,
        "weights bitwise unchanged"
    );
    assert_eq!(
        bits(trainer.optimizer().state()),
        state,
        "moments and step counts unchanged"
    );
    let after = trainer.scaler().unwrap().state()[0].1.item().unwrap();
    assert_eq!(after, scale / 2.0, "scale halved");
    assert_eq!(trainer.steps(), 2, "the schedule still advances");
    for (name, p) in named_parameters(trainer.model()) {
        assert!(
            p.grad().is_none(),
            "{name}: gradients cleared for the next step"
        );
    }
}

/// An fp16 trainer whose first steps overflow (scale 2^20: the logits' gradient alone exceeds
/// f16's range), so runs contain skipped steps.
fn overflowing_trainer(device: &Device, total: usize, sgd: bool) -> Trainer {
    let model = small_cnn(device);
    let optimizer: Box<dyn redline_nn::Optimizer> = if sgd {
        Box::new(Sgd::new(decay_groups(&model, 5e-4), 0.9, 0.0, true).unwrap())
    } else {
        Box::new(AdamW::new(decay_groups(&model, 0.05), 0.9, 0.999, 1e-8).unwrap())
    };
    let config = TrainConfig {
        precision: Precision::Fp16,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: 2e-3,
        schedule: Schedule::one_cycle(total),
    };
    let scaler = redline_amp::GradScaler::with(
        device,
        DType::F32,
        (1u64 << 20) as f64,
        redline_tensor::ScalerParams {
            growth_interval: 3,
            ..Default::default()
        },
    )
    .unwrap();
    Trainer::new(Box::new(model), optimizer, config, device.clone())
        .unwrap()
        .with_scaler(scaler)
        .unwrap()
}

fn resumable_loader(set: &Arc<ShardSet>, at: redline_loader::Position) -> Loader {
    Loader::new(set.clone(), Config::new(8, RES, true), at).expect("loader")
}

/// What a CUDA graph replay needs of the input phase: each batch lands in the same device
/// buffers (the labels' storage is the same tensor storage from batch to batch), holding that
/// batch's values; the loss masks skipped samples without looking at the batch on the host.
#[test]
fn batches_of_one_shape_are_copied_into_the_same_device_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 32);
    let device = CpuBackend::device();
    let trainer = overflowing_trainer(&device, 4, true);
    let mut batches = resumable_loader(&train, Default::default());
    let mut storages = Vec::new();
    for _ in 0..3 {
        let batch = batches.next().unwrap().unwrap();
        let labels: Vec<i64> = batch.labels().collect();
        let inputs = trainer.upload(batch).unwrap();
        assert_eq!(inputs.y.to_vec::<i64>().unwrap(), labels);
        assert_eq!(
            inputs.ignore_index,
            Some(-1),
            "the CPU compares i64: always masked"
        );
        storages.push(Arc::as_ptr(inputs.y.storage()));
    }
    assert!(storages.windows(2).all(|w| std::ptr::eq(w[0], w[1])));
}

/// What a CUDA graph replay needs of the update phase: whatever the learning rate (a one-cycle
/// schedule changes it every step) and whether a step was skipped, every step issues the same
/// optimizer launches with the same baked-in arguments (the op profile's labels carry them), and
/// the rate reaches the device as one write into the scalar the launches read, as the batch
/// does into its static buffers.
#[test]
fn every_step_issues_the_same_optimizer_launches_whatever_the_learning_rate() {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    for sgd in [false, true] {
        let (device, profile) = OpProfile::wrap(CpuBackend::device(), true);
        let steps = 5;
        let mut trainer = overflowing_trainer(&device, steps, sgd);
        profile.reset(); // the model's initial weights were uploads
        let mut batches = resumable_loader(&train, Default::default());
        let mut rates = Vec::new();
        for _ in 0..steps {
            rates.push(trainer.lr());
            trainer.train_step(&mut batches).unwrap();
        }
        rates.dedup();
        assert_eq!(rates.len(), steps, "the schedule moved every step");
        let scale = trainer.scaler().unwrap().state()[0].1.item().unwrap();
        assert!(scale < (1u64 << 20) as f64, "and a step was skipped");
        let rows = profile.rows();
        let name = if sgd { "sgd " } else { "adamw " };
        let updates: Vec<_> = rows.iter().filter(|r| r.label.starts_with(name)).collect();
        // Two parameter groups (decayed and not): two launch signatures, each once a step.
        assert_eq!(updates.len(), 2, "{updates:#?}");
        assert!(
            updates.iter().all(|r| r.calls == steps as u64),
            "{updates:#?}"
        );
        // Writes into storages that stay put, three a step: the pixels (ordered after the last
        // step's input op only), the labels, the rate.
        let calls = |label: &str| rows.iter().find(|r| r.label == label).map(|r| r.calls);
        assert_eq!(calls("upload_into_after"), Some(steps as u64), "{rows:#?}");
        assert_eq!(calls("upload_into"), Some(2 * steps as u64), "{rows:#?}");
        assert!(rows.iter().all(|r| r.label != "upload"), "{rows:#?}");
    }
}

#[test]
fn resuming_mid_epoch_after_skipped_steps_equals_the_uninterrupted_run_bit_for_bit() {
    // AdamW and SGD with Nesterov momentum (both count their applied steps on the device).
    for sgd in [false, true] {
        resume_case(sgd);
    }
}

fn resume_case(sgd: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48); // 6 batches of 8 an epoch
    let device = CpuBackend::device();
    let total = 12;

    let mut straight = overflowing_trainer(&device, total, sgd);
    let mut batches = resumable_loader(&train, Default::default());
    let losses: Vec<f64> = (0..total)
        .map(|_| {
            straight
                .train_step(&mut batches)
                .unwrap()
                .loss
                .item()
                .unwrap()
        })
        .collect();

    let ckpt = dir.path().join("ckpt/step7.safetensors");
    let mut first = overflowing_trainer(&device, total, sgd);
    let mut batches = resumable_loader(&train, Default::default());
    for _ in 0..7 {
        first.train_step(&mut batches).unwrap();
    }
    let scale = first.scaler().unwrap().state()[0].1.item().unwrap();
    assert!(
        scale < (1u64 << 20) as f64,
        "a step was skipped before the checkpoint"
    );
    let moved = first
        .optimizer()
        .state()
        .iter()
        .any(|(_, t)| t.to_f64_vec().unwrap().iter().any(|&v| v != 0.0));
    assert!(
        moved,
        "and a step was applied (the optimizer has state to restore)"
    );
    first.save(&ckpt, 0).unwrap();
    assert!(
        !ckpt.with_extension("safetensors.tmp").exists(),
        "no temporary file left"
    );
    drop((first, batches));

    let mut resumed = overflowing_trainer(&device, total, sgd);
    let progress = resumed.load(&ckpt).unwrap();
    assert_eq!((progress.step, progress.epoch, progress.index), (7, 1, 8));
    let mut batches = resumable_loader(&train, resumed.position());
    let rest: Vec<f64> = (7..total)
        .map(|_| {
            resumed
                .train_step(&mut batches)
                .unwrap()
                .loss
                .item()
                .unwrap()
        })
        .collect();
    assert_eq!(rest, losses[7..], "the same losses after resuming");
    // Weights, batch-norm buffers, AdamW moments and steps, scaler: bit for bit.
    let (got, want) = (
        bits(resumed.checkpoint_tensors()),
        bits(straight.checkpoint_tensors()),
    );
    assert_eq!(got.len(), want.len());
    for ((name, a), (other, b)) in got.iter().zip(&want) {
        assert_eq!(name, other);
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            differ,
            0,
            "sgd {sgd}: {name}: {differ} of {} values differ",
            a.len()
        );
    }
}

#[test]
fn a_checkpoint_of_another_model_or_a_damaged_file_is_refused_naming_what() {
    let dir = tempfile::tempdir().unwrap();
    let device = CpuBackend::device();
    let trainer = overflowing_trainer(&device, 1, false);
    let path = dir.path().join("a.safetensors");
    trainer.save(&path, 7).unwrap();
    // The same state gives the same bytes (the header's keys in a fixed order).
    let again = dir.path().join("again.safetensors");
    for _ in 0..3 {
        trainer.save(&again, 7).unwrap();
        assert!(std::fs::read(&again).unwrap() == std::fs::read(&path).unwrap());
    }

    // Another model: a wider classifier.
    let mut init = Init::new(3, &device, DType::F32);
    let other = Sequential::new().push(Linear::new(&mut init, 32, CLASSES + 1).unwrap());
    let adamw = AdamW::new(decay_groups(&other, 0.0), 0.9, 0.999, 1e-8).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.0,
        clip_norm: None,
        base_lr: 1e-3,
        schedule: Schedule::Constant,
    };
    let mut wrong = Trainer::new(Box::new(other), Box::new(adamw), config, device).unwrap();
    let err = wrong.load(&path).unwrap_err().to_string();
    assert!(
        err.contains("a.safetensors") && err.contains("0.weight"),
        "{err}"
    );

    let mut again = overflowing_trainer(&CpuBackend::device(), 1, false);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(bytes.len() - 4);
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes).unwrap();
    let err = again.load(&cut).unwrap_err().to_string();
    assert!(
        err.contains("cut.safetensors") && err.contains("not a valid safetensors file"),
        "{err}"
    );
    std::fs::write(&cut, b"nonsense").unwrap();
    let err = again.load(&cut).unwrap_err().to_string();
    assert!(
        err.contains("cut.safetensors") && err.contains("not a valid safetensors file"),
        "{err}"
    );
    // The refused loads wrote nothing: the trainer still loads the good file.
    assert_eq!(again.load(&path).unwrap().seed, 7);
}

#[test]
fn on_a_device_with_a_clock_step_times_arrive_two_steps_late() {
    // The CUDA backend on its host emulator: phases timed by its events and read TIMES_LAG
    // steps late (a read of the step just issued would drain the queue), with no
    // synchronisation anywhere in the steps and every batch copied from the loader's buffer.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    let backend = Arc::new(redline_cuda::CudaBackend::emulated().unwrap());
    let device = Device::new(backend.clone());
    let model = small_cnn(&device);
    let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.0,
        clip_norm: None,
        base_lr: 0.1,
        schedule: Schedule::Constant,
    };
    let mut trainer = Trainer::new(Box::new(model), Box::new(sgd), config, device).unwrap();
    let mut batches = loader(&train, 8, true);
    let before = backend.transfer_stats();
    let mut known = Vec::new();
    let mut losses = Vec::new();
    for step in 0..5 {
        let s = trainer.train_step(&mut batches).unwrap();
        assert_eq!(
            s.times.is_some(),
            step >= redline_train::TIMES_LAG,
            "step {step}"
        );
        known.extend(s.times);
        losses.push(s.loss.to_vec_async::<f32>().unwrap());
    }
    let after = backend.transfer_stats();
    assert_eq!(after.synchronizations, before.synchronizations);
    // Each step's pixels and labels both leave from the loader's pooled (on a GPU, pinned)
    // buffer: no label vector staged through pageable memory.
    assert_eq!(after.pooled_uploads - before.pooled_uploads, 2 * 5);
    let rest = trainer.take_times().unwrap();
    assert_eq!(rest.len(), redline_train::TIMES_LAG);
    assert!(trainer.take_times().unwrap().is_empty());
    known.extend(rest);
    assert_eq!(known.len(), 5);
    for t in &known {
        assert!(t.device_clock, "{t:?}");
        assert!(t.get(Phase::Forward) > std::time::Duration::ZERO, "{t:?}");
        assert!(t.get(Phase::Backward) > std::time::Duration::ZERO, "{t:?}");
    }
    for loss in losses {
        assert!(loss.wait().unwrap()[0].is_finite());
    }
}

/// The identity whose backward downloads its gradient.
struct ReadsGradientOnHost;

impl redline_nn::Module for ReadsGradientOnHost {
    fn forward(&self, x: &Tensor) -> redline_tensor::Result<Tensor> {
        Ok(x.clone()
            .with_backward("reads_gradient_on_host", &[x], |g| {
                g.to_f64_vec()?;
                Ok(vec![Some(g.clone())])
            }))
    }
    fn visit(&self, _: &str, _: &mut dyn FnMut(&str, &Tensor, redline_nn::Kind)) {}
    fn shape_and_macs(&self, shape: &[usize]) -> redline_tensor::Result<(Vec<usize>, u64)> {
        Ok((shape.to_vec(), 0))
    }
}

/// The small CNN in fp16 with SGD, gradient clipping and a one-cycle schedule over `steps`.
fn clipped_fp16_trainer(device: &Device, steps: usize) -> Trainer {
    clipped_fp16_trainer_of(small_cnn(device), device, steps)
}

fn clipped_fp16_trainer_of(model: Sequential, device: &Device, steps: usize) -> Trainer {
    let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
    fp16_trainer_with(model, Box::new(sgd), Some(1.0), device, steps)
}

/// `model` in fp16 (a GradScaler) with `optimizer`, clipping at `clip_norm`, a one-cycle
/// schedule over `steps`.
fn fp16_trainer_with(
    model: Sequential,
    optimizer: Box<dyn Optimizer>,
    clip_norm: Option<f64>,
    device: &Device,
    steps: usize,
) -> Trainer {
    let config = TrainConfig {
        precision: Precision::Fp16,
        label_smoothing: 0.1,
        clip_norm,
        base_lr: 0.1,
        schedule: Schedule::one_cycle(steps),
    };
    Trainer::new(Box::new(model), optimizer, config, device.clone()).unwrap()
}

/// SGD that reads the step's overflow flag on the host before each update: a host read that a
/// graph capture refuses, made after the GradScaler unscaled the gradients.
struct ReadsFlagOnHost(Sgd);

impl Optimizer for ReadsFlagOnHost {
    fn set_lr(&mut self, lr: f64) -> redline_tensor::Result<()> {
        self.0.set_lr(lr)
    }
    fn update(&mut self, found_inf: Option<&Tensor>) -> redline_tensor::Result<()> {
        if let Some(flag) = found_inf {
            flag.item()?;
        }
        self.0.update(found_inf)
    }
    fn groups(&self) -> &[ParamGroup] {
        self.0.groups()
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        self.0.state()
    }
    fn state_loaded(&mut self, steps_taken: u64) {
        self.0.state_loaded(steps_taken)
    }
}

/// Losses, the final state's bits and the graph statistics of a run.
type GraphRun = (Vec<f32>, Vec<(String, Vec<u64>)>, redline_train::GraphStats);

/// `steps` fp16 steps of the small CNN on `device`, with graph replay or not; epochs end with
/// a partial batch.
fn graph_run(device: &Device, set: &Arc<ShardSet>, steps: usize, graph: bool) -> GraphRun {
    graph_run_of(small_cnn(device), device, set, steps, graph)
}

fn graph_run_of(
    model: Sequential,
    device: &Device,
    set: &Arc<ShardSet>,
    steps: usize,
    graph: bool,
) -> GraphRun {
    graph_run_on(
        clipped_fp16_trainer_of(model, device, steps),
        set,
        steps,
        graph,
    )
}

fn graph_run_on(mut trainer: Trainer, set: &Arc<ShardSet>, steps: usize, graph: bool) -> GraphRun {
    if graph {
        trainer = trainer.with_graph();
    }
    let mut config = Config::new(8, RES, true);
    config.drop_last = false;
    let mut batches = Loader::new(set.clone(), config, Position::default()).unwrap();
    let losses = (0..steps)
        .map(|_| {
            trainer
                .train_step(&mut batches)
                .unwrap()
                .loss
                .item()
                .unwrap() as f32
        })
        .collect();
    (
        losses,
        bits(trainer.checkpoint_tensors()),
        trainer.graph_stats().clone(),
    )
}

#[test]
fn a_replayed_graph_trains_exactly_as_eager_steps_and_other_shapes_run_eagerly() {
    // The CUDA backend on its host emulator, where a replay runs the captured launches with
    // their capture-time arguments: the same bits as eager steps only if the whole AMP step
    // (input op, forward, loss, scaled backward, unscale, clip, SGD, scale update, a learning
    // rate that changes every step) is capturable.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 52); // 6 batches of 8 and one of 4 per epoch
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let steps = 9;
    let (eager_losses, eager_state, eager_stats) = graph_run(&device, &train, steps, false);
    let (losses, state, stats) = graph_run(&device, &train, steps, true);
    assert_eq!(losses, eager_losses);
    assert_eq!(state, eager_state);
    assert!(!eager_stats.requested && eager_stats.replays == 0);
    assert!(stats.requested && stats.nodes > 50, "{stats:?}");
    // Steps 0-1 warm up, 2-5 and 7-8 replay (2 captures it), 6 is the partial batch.
    assert_eq!((stats.replays, stats.eager_steps), (6, 1), "{stats:?}");
    let why = stats.eager_reason.unwrap_or_default();
    assert!(
        why.contains("[4, 32, 32, 3]") && why.contains("captured for [8, 32, 32, 3]"),
        "{why}"
    );

    // The CPU runs ops as they come: every step eager, saying why.
    let cpu = CpuBackend::device();
    let (_, _, stats) = graph_run(&cpu, &train, 3, true);
    assert_eq!((stats.replays, stats.eager_steps), (0, 1), "{stats:?}");
    assert!(stats
        .eager_reason
        .unwrap()
        .contains("cannot capture graphs"));
}

#[test]
fn a_capture_that_fails_puts_the_step_back_and_trains_on_eagerly_as_eager_steps() {
    // The capture of step 2 fails in backward (a layer reads its gradient on the host), after
    // the forward counted batch norm's batches, autocast cast the weights and most gradients
    // were recorded: the step must run again eagerly from the state before it, and so must
    // every later step — the same losses and the same bits in every weight, buffer (batch
    // norm's counters included) and optimizer state as a run that never asked for a graph.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 52);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let steps = 6;
    let model = || small_cnn_reading_a_gradient(&device, true);
    let (eager_losses, eager_state, _) = graph_run_of(model(), &device, &train, steps, false);
    let run = graph_run_of(model(), &device, &train, steps, true);
    // Steps 0-1 warm up; 2 fails to capture and runs eagerly, as 3-5 do.
    let eager = (eager_losses, eager_state);
    let why = assert_fell_back_to_eager(run, eager, 4);
    assert!(why.contains("inside a graph capture"), "{why}");

    // A capture the driver invalidates at its end, after the whole step was recorded: the step
    // count (the one-cycle rate follows it) and batch norm's counters had moved on too.
    let emulator = redline_cuda::Emulator::new().unwrap();
    let invalidating = Device::new(Arc::new(redline_cuda::CudaBackend::new(Arc::new(
        emulator.invalidate_captures(true),
    ))));
    let plain = small_cnn(&invalidating);
    let run = graph_run_of(plain, &invalidating, &train, steps, true);
    let (eager_losses, eager_state, _) =
        graph_run_of(small_cnn(&device), &device, &train, steps, false);
    let why = assert_fell_back_to_eager(run, (eager_losses, eager_state), 4);
    assert!(why.contains("invalidated"), "{why}");
}

/// Asserts that a graph run whose capture failed trained exactly as the eager run (the same
/// finite losses, the same bits), captured nothing and ran `eager_steps` steps eagerly after
/// the warm-up, saying the capture failed; returns the reason it gave.
fn assert_fell_back_to_eager(
    run: GraphRun,
    eager: (Vec<f32>, Vec<(String, Vec<u64>)>),
    eager_steps: u64,
) -> String {
    let (losses, state, stats) = run;
    assert_eq!(losses, eager.0);
    assert_eq!(state, eager.1);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_eq!(
        (stats.captures, stats.replays, stats.eager_steps),
        (0, 0, eager_steps),
        "{stats:?}"
    );
    let why = stats.eager_reason.unwrap_or_default();
    assert!(why.contains("capture failed"), "{why}");
    why
}

#[test]
fn a_capture_that_fails_after_unscaling_unscales_again_when_the_step_runs_eagerly() {
    // The capture of step 2 fails in the optimizer (it reads the overflow flag on the host),
    // after the GradScaler marked the step's gradients unscaled: nothing it recorded ran, so
    // the eager rerun must unscale its own gradients again (GradScaler::discard_step), or SGD
    // would step with gradients 65,536 times too large. No clipping here: it would hide that
    // by normalising both to the same length.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 52);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let steps = 5;
    let run = |graph: bool| {
        let model = small_cnn(&device);
        let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
        let optimizer = Box::new(ReadsFlagOnHost(sgd));
        let trainer = fp16_trainer_with(model, optimizer, None, &device, steps);
        graph_run_on(trainer, &train, steps, graph)
    };
    let (eager_losses, eager_state, _) = run(false);
    assert_fell_back_to_eager(run(true), (eager_losses, eager_state), 3);
}

#[test]
fn a_new_resolution_drops_the_graph_and_captures_again_after_a_warm_up() {
    // Progressive resizing at one batch size: 5 steps at 32 px, then 5 at 24 px. Each size
    // warms up 2 steps, is captured on the third and replayed after; the run equals eager
    // steps bit for bit (emulated CUDA).
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let run = |graph: bool| {
        let model = small_cnn(&device);
        let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
        let config = TrainConfig {
            precision: Precision::Fp32,
            label_smoothing: 0.1,
            clip_norm: None,
            base_lr: 0.1,
            schedule: Schedule::one_cycle(10),
        };
        let mut trainer =
            Trainer::new(Box::new(model), Box::new(sgd), config, device.clone()).unwrap();
        if graph {
            trainer = trainer.with_graph();
        }
        let mut losses = Vec::new();
        for res in [32, 24] {
            let config = Config::new(8, res, true);
            let mut batches = Loader::new(train.clone(), config, Position::default()).unwrap();
            for _ in 0..5 {
                let step = trainer.train_step(&mut batches).unwrap();
                losses.push(step.loss.item().unwrap() as f32);
            }
        }
        let stats = trainer.graph_stats().clone();
        (losses, bits(trainer.checkpoint_tensors()), stats)
    };
    let (eager_losses, eager_state, _) = run(false);
    let (losses, state, stats) = run(true);
    assert_eq!(losses, eager_losses);
    assert_eq!(state, eager_state);
    assert_eq!(
        (stats.captures, stats.replays, stats.eager_steps),
        (2, 6, 0),
        "{stats:?}"
    );
}

/// A device collective for a world of two whose other rank holds zero gradients: an average
/// halves a tensor in place with device ops (issued on whatever thread calls, recorded into a
/// capture like NCCL's), a sum keeps it, a max clamps it at zero. Counts the trainer's checks
/// around replays, and can report its group failed once it has watched `fail_after` replays.
#[derive(Default)]
struct QuietPeer {
    alive_checks: std::sync::atomic::AtomicUsize,
    watched: std::sync::atomic::AtomicUsize,
    fail_after: Option<usize>,
}

impl redline_dist::Collective for QuietPeer {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        2
    }
    fn all_reduce(&self, tensors: &[Tensor], op: redline_dist::Reduce) -> redline_dist::Result<()> {
        for t in tensors {
            let reduced = match op {
                redline_dist::Reduce::Avg => t.mul_scalar(0.5)?,
                redline_dist::Reduce::Sum => continue,
                redline_dist::Reduce::Max => t.relu()?,
            };
            t.assign(&reduced)?;
        }
        Ok(())
    }
    fn capturable(&self) -> bool {
        true
    }
    fn alive(&self) -> redline_dist::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        self.alive_checks.fetch_add(1, SeqCst);
        match self.fail_after {
            Some(n) if self.watched.load(SeqCst) >= n => Err(redline_dist::DistError::Peer {
                rank: 1,
                during: "a replayed step".into(),
                message: "its collectives ran past the timeout".into(),
            }),
            _ => Ok(()),
        }
    }
    fn watch(&self, _until: &redline_tensor::Event) -> redline_dist::Result<()> {
        // (The emulator runs launches as they come: its events are reached when recorded.)
        self.watched
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn broadcast(&self, _tensors: &[Tensor], _root: usize) -> redline_dist::Result<()> {
        Ok(()) // from rank 0, this one
    }
    fn barrier(&self) -> redline_dist::Result<()> {
        Ok(())
    }
    fn split(&self) -> redline_dist::Result<Arc<dyn redline_dist::Collective>> {
        Ok(Arc::new(QuietPeer::default()))
    }
}

/// `steps` fp16 steps of the small CNN on `device`, data-parallel over `collective` (none:
/// alone) in 1 KiB buckets, with synchronised batch norm or not, with graph replay or not; the
/// steps' results, or the first error.
fn data_parallel_run(
    device: &Device,
    set: &Arc<ShardSet>,
    steps: usize,
    graph: bool,
    collective: Option<Arc<dyn redline_dist::Collective>>,
    sync_bn: bool,
) -> (Result<GraphRun, String>, Option<usize>) {
    let mut trainer = clipped_fp16_trainer(device, steps);
    if let Some(c) = collective {
        trainer = trainer.with_data_parallel(c, 1024).unwrap();
    }
    if sync_bn {
        trainer = trainer.with_sync_batch_norm().unwrap();
    }
    if graph {
        trainer = trainer.with_graph();
    }
    let mut batches = loader(set, 8, true);
    let mut losses = Vec::new();
    for _ in 0..steps {
        match trainer.train_step(&mut batches) {
            Ok(s) => losses.push(s.loss.item().unwrap() as f32),
            Err(e) => {
                return (
                    Err(e.to_string()),
                    Some(trainer.graph_stats().replays as usize),
                )
            }
        }
    }
    let overlapped = (trainer.data_parallel()).map(|dp| {
        dp.last_launches()
            .iter()
            .filter(|l| l.grads_pending > 0)
            .count()
    });
    let run = (
        losses,
        bits(trainer.checkpoint_tensors()),
        trainer.graph_stats().clone(),
    );
    (Ok(run), overlapped)
}

#[test]
fn a_data_parallel_step_is_captured_with_its_collectives_and_replays_as_eager_steps() {
    // Emulated CUDA, a device collective whose averages are device ops issued while backward
    // is being captured: replaying the graph must run them, or the weights would move twice
    // as far as the eager run's. With synchronised batch norm too, whose sums share the group.
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let steps = 6;
    for sync_bn in [false, true] {
        let run = |graph: bool, quiet: &Arc<QuietPeer>| {
            let group = quiet.clone() as Arc<dyn redline_dist::Collective>;
            data_parallel_run(&device, &train, steps, graph, Some(group), sync_bn)
        };
        let (eager_losses, eager_state, _) = run(false, &Arc::default()).0.unwrap();
        let quiet = Arc::new(QuietPeer::default());
        let (graphed, overlapped) = run(true, &quiet);
        let (losses, state, stats) = graphed.unwrap();
        assert_eq!(losses, eager_losses, "sync BN {sync_bn}");
        assert_eq!(state, eager_state, "sync BN {sync_bn}");
        // Steps 0-1 warm up, 2 is captured and run, 3-5 replay; none eager.
        assert_eq!(
            (stats.captures, stats.replays, stats.eager_steps),
            (1, 4, 0),
            "{stats:?}"
        );
        assert_eq!(stats.eager_reason, None);
        // The captured step's buckets started while backward was still being recorded.
        assert!(overlapped.unwrap() > 0, "{overlapped:?}");
        // Every replay was checked before and watched after, once: batch norm's sums are on
        // the same group.
        assert_eq!(
            (quiet.alive_checks.load(SeqCst), quiet.watched.load(SeqCst)),
            (4, 4),
            "sync BN {sync_bn}"
        );
        // The collective did act: alone, the same steps end elsewhere.
        let (alone, _) = data_parallel_run(&device, &train, steps, true, None, false);
        assert_ne!(alone.unwrap().1, eager_state);
    }
}

#[test]
fn a_replay_is_not_enqueued_on_a_group_that_failed_and_the_step_names_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let failing = QuietPeer {
        fail_after: Some(2),
        ..QuietPeer::default()
    };
    let (run, replays) =
        data_parallel_run(&device, &train, 6, true, Some(Arc::new(failing)), false);
    let error = run.expect_err("the step after the group failed fails");
    assert!(
        error.contains("rank 1") && error.contains("a replayed step"),
        "{error}"
    );
    // The capture's own run and one replay; the third was refused before it was enqueued.
    assert_eq!(replays, Some(2));
}

#[test]
fn data_parallelism_over_a_host_collective_runs_eagerly_saying_why() {
    // The TCP collective downloads gradients: nothing a graph can hold. A world of one on the
    // loopback, on emulated CUDA, which could otherwise capture.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 48);
    let device = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
    let server = redline_dist::StoreServer::bind("127.0.0.1:0").unwrap();
    let timeout = std::time::Duration::from_secs(60);
    let mut store =
        redline_dist::StoreClient::connect(&server.address().to_string(), timeout).unwrap();
    let group = redline_dist::TcpCollective::connect(&mut store, "graph/", 0, 1, timeout).unwrap();
    let (run, _) = data_parallel_run(&device, &train, 5, true, Some(Arc::new(group)), false);
    let (losses, _, stats) = run.unwrap();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_eq!((stats.replays, stats.eager_steps), (0, 3), "{stats:?}");
    let why = stats.eager_reason.unwrap_or_default();
    assert!(why.contains("cannot be captured"), "{why}");
}

/// A small CNN without batch norm (whose statistics depend on how a batch is split).
fn cnn_without_batch_norm(device: &Device) -> Sequential {
    let mut init = Init::new(5, device, DType::F32);
    let conv = Conv2d::resnet(&mut init, 3, 8, 3, 2, 1).expect("conv");
    Sequential::new()
        .push(conv)
        .push(ReLU)
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 8, CLASSES).expect("linear"))
}

/// An fp32 SGD trainer (momentum, weight decay, clipping) of the model without batch norm.
fn accumulating_trainer(device: &Device, batches: usize) -> Trainer {
    let model = cnn_without_batch_norm(device);
    let sgd = Sgd::new(decay_groups(&model, 5e-4), 0.9, 0.0, true).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.1,
        clip_norm: Some(1.0),
        base_lr: 0.2,
        schedule: Schedule::one_cycle(6),
    };
    (Trainer::new(Box::new(model), Box::new(sgd), config, device.clone()).unwrap())
        .with_accumulation(batches)
        .unwrap()
}

#[test]
fn two_accumulated_half_batches_step_as_one_batch_of_both() {
    // The loader in evaluation mode (no shuffle, centre crops): batches of 4 hold the batches
    // of 8 split in two. Three steps of 8 against three of 2 × 4.
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 40);
    let device = CpuBackend::device();
    let mut whole = accumulating_trainer(&device, 1);
    let mut halves = accumulating_trainer(&device, 2).with_graph();
    assert_eq!(halves.accumulation(), 2);
    let (mut eights, mut fours) = (loader(&train, 8, false), loader(&train, 4, false));
    for step in 0..3 {
        let a = whole.train_step(&mut eights).unwrap();
        let b = halves.train_step(&mut fours).unwrap();
        assert_eq!((a.images, b.images), (8, 8), "step {step}");
        let (la, lb) = (a.loss.item().unwrap(), b.loss.item().unwrap());
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {step}: loss {la} vs {lb}"
        );
        assert_eq!(a.lr, b.lr, "step {step}");
    }
    assert_eq!((whole.steps(), halves.steps()), (3, 3));
    assert_eq!(whole.position(), halves.position());
    // A sum of two halves' gradients against one sum: equal to f32 rounding.
    for ((name, a), (_, b)) in whole
        .checkpoint_tensors()
        .iter()
        .zip(halves.checkpoint_tensors())
    {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let largest = a.iter().map(|x| x.abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5 * largest.max(1.0), "{name}: {worst:e} apart");
    }
    // Asked for a graph, the accumulated steps ran eagerly, saying why.
    let stats = halves.graph_stats();
    assert_eq!((stats.replays, stats.eager_steps), (0, 3), "{stats:?}");
    let why = stats.eager_reason.clone().unwrap_or_default();
    assert!(
        why.contains("gradient accumulation (2 batches a step)"),
        "{why}"
    );
}

/// A world of one that counts its all-reduces.
#[derive(Default)]
struct CountingGroup(std::sync::atomic::AtomicUsize);

impl redline_dist::Collective for CountingGroup {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, _: &[Tensor], _: redline_dist::Reduce) -> redline_dist::Result<()> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn broadcast(&self, _: &[Tensor], _: usize) -> redline_dist::Result<()> {
        Ok(())
    }
    fn barrier(&self) -> redline_dist::Result<()> {
        Ok(())
    }
    fn split(&self) -> redline_dist::Result<Arc<dyn redline_dist::Collective>> {
        Ok(Arc::new(CountingGroup::default()))
    }
}

#[test]
fn a_data_parallel_rank_reduces_once_per_accumulated_step_and_a_short_step_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (train, _) = synth(dir.path(), 40);
    let device = CpuBackend::device();
    let group = Arc::new(CountingGroup::default());
    let mut trainer = (accumulating_trainer(&device, 3))
        .with_data_parallel(group.clone(), 256)
        .unwrap();
    let buckets = trainer.data_parallel().unwrap().buckets().len();
    assert!(buckets > 1, "{buckets} buckets");
    // Seven batches: two steps of three, then one batch short of a third.
    let mut batches = loader(&train, 4, true).take(7);
    for _ in 0..2 {
        trainer.train_step(&mut batches).unwrap();
    }
    assert_eq!(
        group.0.load(std::sync::atomic::Ordering::SeqCst),
        2 * buckets
    );
    let short = trainer.train_step(&mut batches);
    assert!(
        matches!(short, Err(redline_train::TrainError::NoData)),
        "{:?}",
        short.err()
    );
    assert_eq!(trainer.steps(), 2);
    // The short step's gradients are gone: nothing leaks into the next step.
    let kept: Vec<String> = named_parameters(trainer.model())
        .into_iter()
        .filter(|(_, p)| p.grad().is_some())
        .map(|(n, _)| n)
        .collect();
    assert!(kept.is_empty(), "gradients left: {kept:?}");
    assert!(accumulating_trainer(&device, 1)
        .with_accumulation(0)
        .is_err());
}

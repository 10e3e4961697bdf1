//! The capture contract ([`Device::capture`]): a training step captured once and replayed
//! equals the same steps run eagerly — with new inputs copied into the step's static buffers
//! and the learning rate changed between replays, and eager tensors of every size alive across
//! each replay (the graph's memory must stay the graph's), and an eager convolution far larger
//! than the step's between replays (a library that grows its workspace for it must leave the
//! block the graph captured alive). That holds only if nothing in the step is decided on the
//! host or baked into a launch.

use std::time::Instant;

use redline_amp::GradScaler;
use redline_nn::{named_parameters, state_dict, Module, Optimizer, ParamGroup, Sequential, Sgd};
use redline_tensor::{Conv2dParams, DType, Device, Result, Tensor};

use crate::training::tiny_cnn;

/// What a captured step looked like.
#[derive(Debug, Clone, Copy)]
pub struct GraphReport {
    /// Operations per replay (kernels, library calls, copies).
    pub nodes: usize,
    /// Mean wall time of an eager step and of a replay, each between two synchronisations.
    pub eager_ms: f64,
    pub replay_ms: f64,
    /// The largest difference, relative to the largest value, between replayed and eager
    /// weights, buffers, losses and scaler state.
    pub max_relative: f64,
}

/// The tiny CNN with SGD (momentum) and a GradScaler, stepping on its own static inputs.
struct Loop {
    model: Sequential,
    sgd: Sgd,
    scaler: GradScaler,
    x: Tensor,
    y: Tensor,
}

impl Loop {
    fn new(device: &Device) -> Result<Self> {
        let model = tiny_cnn(device);
        let params = named_parameters(&model)
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        let mut sgd = Sgd::new(vec![ParamGroup::new(params, 1e-4)], 0.9, 0.0, false)?;
        sgd.set_lr(0.05)?;
        let (pixels, labels) = batch(0);
        Ok(Self {
            model,
            sgd,
            scaler: GradScaler::new(device, DType::F32)?,
            x: Tensor::from_slice(&pixels, &[2, 3, 6, 6], device)?,
            y: Tensor::from_slice(&labels, &[2], device)?,
        })
    }

    /// Copies batch `k` into the static inputs (outside any capture).
    fn load(&self, k: usize) -> Result<()> {
        let (pixels, labels) = batch(k);
        self.x
            .copy_from_f64s(&pixels.iter().map(|&v| f64::from(v)).collect::<Vec<_>>())?;
        self.y
            .copy_from_f64s(&labels.iter().map(|&v| v as f64).collect::<Vec<_>>())
    }

    /// Forward, fused cross-entropy, scaled backward, unscale with the inf check, SGD (skipped
    /// on the device when it trips), scale update. The loss stays on the device.
    fn step(&mut self) -> Result<Tensor> {
        let params: Vec<Tensor> = named_parameters(&self.model)
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        params.iter().for_each(Tensor::zero_grad);
        let loss = self
            .model
            .forward(&self.x)?
            .cross_entropy(&self.y, 0.1, Some(-1))?;
        self.scaler.scale(&loss)?.backward()?;
        let flag = self.scaler.step_flag(&params)?.clone();
        self.sgd.update(Some(&flag))?;
        self.scaler.update()?;
        Ok(loss)
    }

    fn weights(&self) -> Result<Vec<Vec<f64>>> {
        let params = named_parameters(&self.model).into_iter();
        params.map(|(_, p)| p.to_f64_vec()).collect()
    }

    /// Weights, buffers (`num_batches_tracked` too) and scaler state.
    fn state(&self) -> Result<Vec<Vec<f64>>> {
        let tensors = state_dict(&self.model).into_iter().map(|(_, t, _)| t);
        let scaler = self.scaler.state().map(|(_, t)| t.clone());
        tensors.chain(scaler).map(|t| t.to_f64_vec()).collect()
    }
}

fn batch(k: usize) -> (Vec<f32>, Vec<i64>) {
    let pixels = (0..2 * 3 * 6 * 6)
        .map(|i| ((i * 37 + k * 101) % 29) as f32 / 14.0 - 1.0)
        .collect();
    (pixels, vec![(k % 3) as i64, ((k + 1) % 3) as i64])
}

/// A 3×3 convolution of 16 channels at 16² over 2 images, eager, kept alive by the caller:
/// larger than any of the step's, so a library may grow its workspace for it (and a freed old
/// one could be handed out for this very output while replays still write it).
fn bystander_conv(device: &Device) -> Result<Tensor> {
    let ramp = |n: usize| {
        (0..n)
            .map(|i| (i % 13) as f32 / 13.0 - 0.5)
            .collect::<Vec<_>>()
    };
    let x = Tensor::from_slice(&ramp(2 * 16 * 16 * 16), &[2, 16, 16, 16], device)?;
    let w = Tensor::from_slice(&ramp(16 * 16 * 9), &[16, 16, 3, 3], device)?;
    let padding = Conv2dParams {
        padding: [1, 1],
        ..Default::default()
    };
    x.conv2d(&w, None, padding)
}

fn relative(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    let (mut worst, mut largest) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        worst = worst.max((x - y).abs());
        largest = largest.max(x.abs());
    }
    if worst == 0.0 {
        0.0
    } else {
        worst / largest.max(f64::MIN_POSITIVE)
    }
}

/// Captures one step and replays it `steps` times against as many eager steps on a twin loop
/// (same initial weights); `Err` says where the two part by more than `tolerance` (relative;
/// 0 asks for the same bits), or what failed.
pub fn check_captured_step(
    device: &Device,
    steps: usize,
    tolerance: f64,
) -> std::result::Result<GraphReport, String> {
    let err = |what: &str, e: redline_tensor::TensorError| format!("{what}: {e}");
    let mut eager = Loop::new(device).map_err(|e| err("eager loop", e))?;
    let mut captured = Loop::new(device).map_err(|e| err("captured loop", e))?;
    // One eager step on both first, as before any capture: libraries size their workspaces
    // and plans outside the graph.
    for run in [&mut eager, &mut captured] {
        run.step().map_err(|e| err("the warm-up step", e))?;
    }
    let initial = captured.weights().map_err(|e| err("weights", e))?;
    let (graph, loss) = device
        .capture(|| captured.step())
        .map_err(|e| err("capturing the step", e))?;
    if captured.weights().map_err(|e| err("weights", e))? != initial {
        return Err("capturing ran the step (the weights moved)".into());
    }
    let mut report = GraphReport {
        nodes: graph.nodes(),
        eager_ms: 0.0,
        replay_ms: 0.0,
        max_relative: 0.0,
    };
    let mut bystander: Option<(Tensor, Vec<f64>)> = None;
    for k in 0..steps {
        if k == steps / 2 {
            let t = bystander_conv(device).map_err(|e| err("the bystander convolution", e))?;
            let values = t
                .to_f64_vec()
                .map_err(|e| err("the bystander convolution", e))?;
            bystander = Some((t, values));
        }
        for run in [&eager, &captured] {
            run.load(k).map_err(|e| err("loading a batch", e))?;
        }
        if k == 2 {
            // A new rate is a 4-byte copy into the device scalar both steps read.
            for run in [&mut eager, &mut captured] {
                run.sgd.set_lr(0.02).map_err(|e| err("set_lr", e))?;
            }
        }
        // Eager tensors of every size the step uses, alive across the replay: the graph must
        // not write them.
        let scratch: Vec<Tensor> = (1..=300)
            .map(|n| Tensor::full(n as f64, &[n], DType::F32, device))
            .collect::<Result<_>>()
            .map_err(|e| err("scratch", e))?;
        device.synchronize().map_err(|e| err("synchronize", e))?;
        let t = Instant::now();
        graph.replay().map_err(|e| err("replaying", e))?;
        device.synchronize().map_err(|e| err("synchronize", e))?;
        if k > 0 {
            // The capture's forward counted the first replay's batch already.
            captured.model.batch_replayed();
        }
        report.replay_ms += t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        for (n, t) in (1..=300).zip(&scratch) {
            let values = t.to_vec::<f32>().map_err(|e| err("scratch", e))?;
            if values.iter().any(|&v| v != n as f32) {
                return Err(format!(
                    "step {k}: a replay wrote an eager tensor of {n} elements"
                ));
            }
        }
        if let Some((t, values)) = &bystander {
            if t.to_f64_vec()
                .map_err(|e| err("the bystander convolution", e))?
                != *values
            {
                return Err(format!(
                    "step {k}: a replay wrote the output of an eager convolution made after the \
                     capture (a library workspace the graph holds was freed and handed out?)"
                ));
            }
        }
        let t = Instant::now();
        let loss_eager = eager.step().map_err(|e| err("an eager step", e))?;
        device.synchronize().map_err(|e| err("synchronize", e))?;
        report.eager_ms += t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let losses = [loss.to_f64_vec(), loss_eager.to_f64_vec()];
        let [Ok(replayed), Ok(eagerly)] = losses else {
            return Err(format!("step {k}: reading the losses failed"));
        };
        let mut a = captured.state().map_err(|e| err("state", e))?;
        let mut b = eager.state().map_err(|e| err("state", e))?;
        a.push(replayed);
        b.push(eagerly);
        let rel = relative(&a, &b);
        report.max_relative = report.max_relative.max(rel);
        if rel > tolerance {
            return Err(format!(
                "step {k}: the replayed step differs from the eager one by {rel:e} (relative; \
                 allowed {tolerance:e})"
            ));
        }
    }
    if captured.weights().map_err(|e| err("weights", e))? == initial {
        return Err("the replays did not train".into());
    }
    Ok(report)
}

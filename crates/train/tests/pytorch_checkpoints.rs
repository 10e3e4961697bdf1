//! Checkpoints across PyTorch and redline, both directions, with ResNet-18 (torchvision's names,
//! 1000 classes) holding deterministic non-zero weights and batch-norm running statistics from
//! `benches/pytorch/checkpoint_fixtures.py`:
//! - a state dict written as PyTorch writes it (the script's `write`, numpy + safetensors) loads
//!   into redline's ResNet-18 and gives, in eval mode, the logits torchvision gave for it (the
//!   committed fixture, made by the script's `fixture` mode with torch);
//! - a redline checkpoint (weights, optimizer and scaler state in one file) has as its model
//!   part exactly torchvision's state dict — keys, shapes, dtypes and values (the script's
//!   `check`; where torch is installed it also runs load_state_dict(strict=True)).
//!
//! They need python3 with numpy and safetensors (`.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

use redline_cpu::CpuBackend;
use redline_nn::{decay_groups, state_dict, Module, ResNet, ResNetConfig, Sgd};
use redline_tensor::{Device, Tensor};
use redline_train::{checkpoint, Precision, TrainConfig, Trainer};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/pytorch/checkpoint_fixtures.py")
}

/// Runs the fixture script; a missing Python package is a failure that says what to install.
fn python(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3 runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "checkpoint_fixtures.py {args:?} failed (it needs `pip install numpy safetensors`):\n{text}"
    );
    text
}

/// A ResNet-18 on the CPU holding the script's state dict, read from the file PyTorch's way.
fn resnet18_from_pytorch_file(device: &Device, dir: &Path) -> ResNet {
    let file = dir.join("torchvision_resnet18.safetensors");
    python(&["write", file.to_str().expect("a UTF-8 path")]);
    let model = ResNet::new(ResNetConfig::new(18), device).expect("resnet18");
    let tensors: Vec<(String, Tensor)> = state_dict(&model)
        .into_iter()
        .map(|(name, t, _)| (name, t))
        .collect();
    checkpoint::load_weights(&file, &tensors).expect("PyTorch's state dict loads");
    model.state_loaded().expect("state loaded");
    model
}

#[test]
fn a_pytorch_state_dict_loads_into_resnet18_and_gives_torchvisions_logits() {
    let dir = tempfile::tempdir().unwrap();
    let device = CpuBackend::device();
    let model = resnet18_from_pytorch_file(&device, dir.path());
    model.set_training(false);
    let n = 2 * 3 * 32 * 32;
    let x: Vec<f32> = (0..n)
        .map(|i| (1.5 * (0.11 * i as f64).sin()) as f32)
        .collect();
    let x = Tensor::from_slice(&x, &[2, 3, 32, 32], &device).unwrap();
    let got = model.forward(&x).unwrap().to_vec::<f32>().unwrap();
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/resnet18_state_logits.json")).unwrap();
    let want: Vec<f64> = fixture["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max);
    println!("worst logit difference {worst:.2e}, largest |logit| {scale:.2}");
    // f32 through 18 layers with other summation orders (and Winograd) than PyTorch's.
    assert!(
        worst <= 1e-4 * scale,
        "logits differ by {worst:.2e} (largest |logit| {scale:.2})"
    );
}

#[test]
fn a_redline_checkpoint_is_torchvisions_state_dict_plus_optimizer_and_scaler() {
    let dir = tempfile::tempdir().unwrap();
    let device = CpuBackend::device();
    let model = resnet18_from_pytorch_file(&device, dir.path());
    let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp16,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: 0.1,
        schedule: redline_nn::Schedule::Constant,
    };
    let trainer = Trainer::new(Box::new(model), Box::new(sgd), config, device).unwrap();
    let ckpt = dir.path().join("redline.safetensors");
    trainer.save(&ckpt, 7).unwrap();
    let report = python(&["check", ckpt.to_str().unwrap()]);
    println!("{report}");
    assert!(
        report.contains("122 model entries as torchvision's"),
        "{report}"
    );
    assert!(
        report.contains("scaler"),
        "the scaler's state is in the same file: {report}"
    );

    // `cargo xtask export` (redline-export): the weights alone, nothing besides them.
    let weights = dir.path().join("weights.safetensors");
    assert_eq!(checkpoint::export_weights(&ckpt, &weights).unwrap(), 122);
    let report = python(&["check", weights.to_str().unwrap()]);
    println!("{report}");
    assert!(
        report.contains("122 model entries as torchvision's; besides them: []"),
        "{report}"
    );
}

//! Times saving, loading and exporting a ResNet-50-sized checkpoint (weights + two AdamW
//! moments, f32, 293 MB): `cargo run --release -p redline-train --example checkpoint_speed`.
//! Written to tmpfs (/dev/shm) where there is one, so it times the codec rather than the disk's
//! fsync.
use std::time::Instant;

use redline_cpu::CpuBackend;
use redline_nn::{state_dict, ResNet, ResNetConfig};
use redline_tensor::Tensor;
use redline_train::checkpoint::{self, Progress};

fn main() {
    let device = CpuBackend::device();
    let model = ResNet::new(ResNetConfig::new(50), &device).unwrap();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, t, _) in state_dict(&model) {
        tensors.push((format!("optimizer.m.{name}"), t.clone()));
        tensors.push((format!("optimizer.v.{name}"), t.clone()));
        tensors.push((name, t));
    }
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let path = dir.path().join("c.safetensors");
    let out = dir.path().join("w.safetensors");
    for round in 0..5 {
        let t0 = Instant::now();
        checkpoint::save(&path, &tensors, Progress::default()).unwrap();
        let t1 = Instant::now();
        checkpoint::load(&path, &tensors).unwrap();
        let t2 = Instant::now();
        checkpoint::export_weights(&path, &out).unwrap();
        let t3 = Instant::now();
        println!(
            "round {round}: {} MB save {:.3} s load {:.3} s export {:.3} s",
            std::fs::metadata(&path).unwrap().len() >> 20,
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64()
        );
    }
}

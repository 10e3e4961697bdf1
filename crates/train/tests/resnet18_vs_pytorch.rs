//! ResNet-18 at 64 px, 3 epochs of the default recipe on the synthetic set, on the CPU backend:
//! validation top-1 within 0.03 of PyTorch's with the same recipe on the same images.
//!
//! PyTorch's figure is a committed fixture, `fixtures/resnet18_64px.json`, written by
//! `benches/pytorch/train.py` (its header has the recipe; the fixture names the command, the
//! versions and every seed's result). The two runs share the images, the recipe and the
//! pipelines' definitions, not the random streams (initial weights, crops, shuffles), so the
//! comparison is of accuracy reached, with PyTorch's seed-to-seed spread in the fixture.

use std::sync::Arc;

use redline_cpu::CpuBackend;
use redline_datasets::generate::{synth_shards, SynthOptions};
use redline_loader::{Config, Loader, Position};
use redline_nn::{decay_groups, ResNet, ResNetConfig, Schedule, Sgd};
use redline_shard::ShardSet;
use redline_train::{Precision, TrainConfig, Trainer};

const FIXTURE: &str = include_str!("fixtures/resnet18_64px.json");

#[test]
fn resnet18_reaches_pytorchs_validation_accuracy_on_the_synthetic_set() {
    let fixture: serde_json::Value = serde_json::from_str(FIXTURE).expect("fixture is JSON");
    let field = |name: &str| fixture[name].as_u64().expect(name) as usize;
    let (res, batch, epochs, classes) = (
        field("res"),
        field("batch"),
        field("epochs"),
        field("classes"),
    );
    let lr = fixture["lr"].as_f64().expect("lr");
    let wd = fixture["wd"].as_f64().expect("wd");
    let pytorch = fixture["final_val_top1"].as_f64().expect("final_val_top1");

    // The images PyTorch saw: `redline-data synth --folder` with these options writes the same
    // JPEGs as an ImageFolder tree.
    let dir = tempfile::tempdir().unwrap();
    let options = SynthOptions {
        classes: classes as u32,
        images: field("images") as u64,
        seed: field("synth_seed") as u64,
        ..SynthOptions::default()
    };
    synth_shards(dir.path(), &options).expect("synthetic shards");
    let open = |split: &str| Arc::new(ShardSet::open(dir.path().join(split)).expect("set"));
    let (train, val) = (open("train"), open("val"));

    // `redline-train`'s default recipe.
    let device = CpuBackend::device();
    let mut config = ResNetConfig::named("resnet18").unwrap();
    config.num_classes = classes;
    config.zero_init_residual = true;
    let model = ResNet::new(config, &device).unwrap();
    let sgd = Sgd::new(decay_groups(&model, wd), 0.9, 0.0, true).unwrap();
    let mut batches =
        Loader::new(train, Config::new(batch, res, true), Position::default()).unwrap();
    let total = epochs * batches.batches_per_epoch();
    let recipe = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: lr,
        schedule: Schedule::one_cycle(total),
    };
    let mut trainer = Trainer::new(Box::new(model), Box::new(sgd), recipe, device).unwrap();
    for _ in 0..total {
        trainer.train_step(&mut batches).unwrap();
    }
    let mut val_batches = Loader::new(
        val.clone(),
        Config::new(batch, res, false),
        Position::default(),
    )
    .unwrap();
    let n = val_batches.batches_per_epoch();
    let eval = trainer.evaluate(&mut val_batches.by_ref().take(n)).unwrap();
    eprintln!(
        "redline val top-1 {:.4} vs PyTorch {pytorch:.4} (seeds: {})",
        eval.top1, fixture["val_top1_per_seed"]
    );
    assert_eq!(
        eval.images,
        val.len() as usize,
        "the whole validation split"
    );
    assert!(
        (eval.top1 - pytorch).abs() <= 0.03,
        "val top-1 {:.4}, PyTorch {pytorch:.4}: more than 0.03 apart",
        eval.top1
    );
}

//! Evaluation sharded across the ranks of a data-parallel job: two trainers in two threads,
//! joined over loopback, each evaluating its own shard of a validation split (every image on
//! exactly one rank, `Uneven::Exact`), report what one trainer reports over the whole split.

use std::sync::Arc;
use std::time::Duration;

use redline_datasets::generate::{synth_shards, SynthOptions};
use redline_dist::{StoreClient, StoreServer, TcpCollective, DEFAULT_BUCKET_BYTES};
use redline_loader::{Config, Loader, Position, Uneven};
use redline_nn::{decay_groups, ResNet, ResNetConfig, Schedule, Sgd};
use redline_shard::ShardSet;
use redline_train::{Evaluation, Precision, TrainConfig, Trainer};

fn trainer() -> Trainer {
    let device = redline_cpu::CpuBackend::device();
    let model = ResNet::new(
        ResNetConfig {
            num_classes: 3,
            seed: 9,
            ..ResNetConfig::new(18)
        },
        &device,
    )
    .unwrap();
    let sgd = Sgd::new(decay_groups(&model, 5e-5), 0.9, 0.0, true).unwrap();
    let config = TrainConfig {
        precision: Precision::Fp32,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: 0.1,
        schedule: Schedule::Constant,
    };
    Trainer::new(Box::new(model), Box::new(sgd), config, device).unwrap()
}

fn evaluate(trainer: &Trainer, val: &Arc<ShardSet>, rank: usize, world: usize) -> Evaluation {
    let config = Config {
        rank,
        world,
        uneven: Uneven::Exact,
        workers: 1,
        ..Config::new(4, 32, false)
    };
    let mut loader = Loader::new(val.clone(), config, Position::default()).unwrap();
    let n = loader.batches_per_epoch();
    trainer.evaluate(&mut loader.by_ref().take(n)).unwrap()
}

#[test]
fn two_ranks_evaluating_their_shards_report_the_whole_splits_figures() {
    let dir = tempfile::tempdir().unwrap();
    let options = SynthOptions {
        classes: 3,
        images: 45,
        seed: 4,
        threads: 2,
        ..SynthOptions::default()
    };
    synth_shards(dir.path(), &options).unwrap();
    let val = Arc::new(ShardSet::open(dir.path().join("val")).unwrap());
    let whole = evaluate(&trainer(), &val, 0, 1);
    // An odd count, so the shards differ in size (one rank reads one image more).
    assert_eq!(whole.images % 2, 1, "{} validation images", whole.images);

    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let address = server.address().to_string();
    let timeout = Duration::from_secs(60);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (address, val) = (address.clone(), val.clone());
            std::thread::spawn(move || {
                let mut store = StoreClient::connect(&address, timeout).unwrap();
                let group = TcpCollective::connect(&mut store, "eval/", rank, 2, timeout).unwrap();
                let trainer = trainer()
                    .with_data_parallel(Arc::new(group), DEFAULT_BUCKET_BYTES)
                    .unwrap();
                evaluate(&trainer, &val, rank, 2)
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let sharded = handle.join().unwrap();
        assert_eq!(sharded.images, whole.images, "rank {rank}");
        assert_eq!(
            (sharded.top1, sharded.top5),
            (whole.top1, whole.top5),
            "rank {rank}"
        );
        // Each batch's loss is an f32 mean over other images than the whole split's batches
        // hold, and the kernels may block a smaller batch differently: equal to f32 rounding.
        let diff = (sharded.loss - whole.loss).abs() / whole.loss.abs().max(1.0);
        assert!(
            diff <= 1e-5,
            "rank {rank}: loss {} vs {} ({diff:e})",
            sharded.loss,
            whole.loss
        );
    }
}

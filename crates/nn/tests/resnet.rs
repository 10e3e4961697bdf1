//! The ResNet family against torchvision: state-dict names, shapes and order (a committed list
//! made by `benches/pytorch/resnet_keys.py`), parameter counts, MACs, and a training-mode
//! forward and backward on the CPU backend.

use redline_cpu::CpuBackend;
use redline_nn::{named_parameters, num_parameters, state_dict, Module, ResNet, ResNetConfig};
use redline_tensor::{DType, Device, Tensor};

fn fixture(depth: usize) -> Vec<(String, Vec<usize>)> {
    let path = format!(
        "{}/tests/fixtures/resnet{depth}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .map(|line| {
            let (key, shape) = line.split_once(' ').expect("`key shape` lines");
            let shape = match shape {
                "scalar" => vec![],
                s => s.split('x').map(|d| d.parse().expect("a size")).collect(),
            };
            (key.to_string(), shape)
        })
        .collect()
}

#[test]
fn names_shapes_and_counts_match_torchvision() {
    let device = CpuBackend::device();
    for (depth, params, gmacs) in [
        (18, 11_689_512, 1.81),
        (34, 21_797_672, 3.66),
        (50, 25_557_032, 4.09),
    ] {
        let model = ResNet::new(ResNetConfig::new(depth), &device).unwrap();
        let ours: Vec<(String, Vec<usize>)> = state_dict(&model)
            .into_iter()
            .map(|(name, t, _)| (name, t.shape().to_vec()))
            .collect();
        assert_eq!(ours, fixture(depth), "ResNet-{depth} state dict");
        assert_eq!(num_parameters(&model), params, "ResNet-{depth} parameters");
        // torchvision's documented "GFLOPS" (multiply-accumulates, in fact) per 224² image.
        let macs = model.macs_per_image(224).unwrap() as f64 / 1e9;
        println!("ResNet-{depth}: {macs:.4} GMAC");
        assert!(
            (macs - gmacs).abs() < 0.01,
            "ResNet-{depth}: {macs:.3} GMAC per 224² image, torchvision's figure is {gmacs}"
        );
    }
}

#[test]
fn initialisation_follows_torchvision_and_the_seed() {
    let device = Device::reference();
    let model = ResNet::new(ResNetConfig::new(18), &device).unwrap();
    let params = named_parameters(&model);
    let get = |name: &str| {
        params
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.to_f64_vec().unwrap())
            .unwrap_or_else(|| panic!("{name}"))
    };
    // He normal, fan-out: std √(2 / (64 · 7 · 7)) for the stem.
    let w = get("conv1.weight");
    let std = (w.iter().map(|v| v * v).sum::<f64>() / w.len() as f64).sqrt();
    let want = (2.0f64 / (64.0 * 49.0)).sqrt();
    assert!(
        (std / want - 1.0).abs() < 0.05,
        "stem std {std}, want {want}"
    );
    assert!(get("bn1.weight").iter().all(|&v| v == 1.0));
    assert!(get("bn1.bias").iter().all(|&v| v == 0.0));
    // PyTorch's Linear default: U(±1/√512).
    assert!(get("fc.weight")
        .iter()
        .all(|v| v.abs() < 1.0 / 512f64.sqrt()));
    assert!(params.iter().all(|(_, t)| t.requires_grad()));

    let again = ResNet::new(ResNetConfig::new(18), &device).unwrap();
    assert_eq!(named_parameters(&again)[0].1.to_f64_vec().unwrap(), w);
    let mut other = ResNetConfig::new(18);
    other.seed = 1;
    let other = ResNet::new(other, &device).unwrap();
    assert_ne!(named_parameters(&other)[0].1.to_f64_vec().unwrap(), w);

    let mut zero = ResNetConfig::new(18);
    zero.zero_init_residual = true;
    let zero = ResNet::new(zero, &device).unwrap();
    for (name, t) in named_parameters(&zero) {
        if name.starts_with("layer") && name.ends_with("bn2.weight") {
            assert!(t.to_f64_vec().unwrap().iter().all(|&v| v == 0.0), "{name}");
        }
    }
    assert!(ResNet::new(ResNetConfig::new(42), &device).is_err());
}

#[test]
fn a_training_step_reaches_every_parameter_and_updates_the_statistics() {
    let device = CpuBackend::device();
    let mut config = ResNetConfig::new(18);
    config.num_classes = 10;
    let model = ResNet::new(config, &device).unwrap();
    let values: Vec<f32> = (0..2 * 3 * 32 * 32)
        .map(|i| ((i * 7919) % 255) as f32 / 255.0)
        .collect();
    let x = Tensor::from_slice(&values, &[2, 3, 32, 32], &device).unwrap();
    let logits = model.forward(&x).unwrap();
    assert_eq!(logits.shape(), [2, 10]);
    assert_eq!(model.shape_and_macs(&[2, 3, 32, 32]).unwrap().0, [2, 10]);
    let targets = Tensor::from_slice(&[3i64, 7], &[2], &device).unwrap();
    let loss = logits.cross_entropy(&targets, 0.0, None).unwrap();
    assert!(loss.item().unwrap().is_finite());
    loss.backward().unwrap();
    for (name, p) in named_parameters(&model) {
        let g = p.grad().unwrap_or_else(|| panic!("{name} got no gradient"));
        assert_eq!(g.shape(), p.shape(), "{name}");
    }
    // One training forward: every batch norm counted one batch and moved its running mean.
    for (name, t, _) in state_dict(&model) {
        if name.ends_with("num_batches_tracked") {
            assert_eq!(t.to_vec::<i64>().unwrap(), [1], "{name}");
        }
        if name == "bn1.running_mean" {
            assert!(t.to_f64_vec().unwrap().iter().any(|&v| v != 0.0));
        }
    }
    // Evaluation uses the running statistics and leaves them alone.
    model.set_training(false);
    let before = state_dict(&model)[3].1.to_f64_vec().unwrap();
    let eval = model.forward(&x).unwrap();
    assert_eq!(eval.shape(), [2, 10]);
    assert_eq!(state_dict(&model)[3].1.to_f64_vec().unwrap(), before);
    assert_eq!(state_dict(&model)[5].1.to_vec::<i64>().unwrap(), [1]);
    assert_eq!(x.dtype(), DType::F32);
}

#[test]
fn models_are_named_as_torchvision_names_them() {
    for depth in [18, 34, 50] {
        let config = redline_nn::ResNetConfig::named(&format!("resnet{depth}")).unwrap();
        assert_eq!(config, redline_nn::ResNetConfig::new(depth));
    }
    for bad in ["resnet101", "vgg16", "resnet"] {
        let err = redline_nn::ResNetConfig::named(bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains(bad) && err.contains("resnet50"), "{err}");
    }
}

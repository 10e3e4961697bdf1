//! Optimizers, LR schedules and gradient clipping against PyTorch on fixed inputs (a committed
//! fixture made by `benches/pytorch/optim_fixtures.py`), on the f64 reference device and on the
//! CPU backend in f32; skipped steps leave every byte of state unchanged.

use redline_cpu::CpuBackend;
use redline_nn::{
    clip_grad_norm, named_parameters, AdamW, Ema, Init, Lars, Linear, ParamGroup, Schedule, Sgd,
};
use redline_tensor::{DType, Device, Tensor};
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("optim.json is JSON")
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

fn tensor(values: &[f64], shape: &[usize], dtype: DType, device: &Device) -> Tensor {
    Tensor::from_slice(values, shape, device)
        .unwrap()
        .cast(dtype)
        .unwrap()
}

/// The fixture's starting point: a decayed weight and an undecayed bias.
fn start(dtype: DType, device: &Device) -> (Tensor, Tensor) {
    let w = tensor(&[0.5, -1.0, 2.0, 0.25, 0.0, -0.75], &[2, 3], dtype, device);
    let b = tensor(&[0.1, -0.2], &[2], dtype, device);
    (w.with_requires_grad(true), b.with_requires_grad(true))
}

/// Gives `w` and `b` the fixture's gradients at `step`, through autograd: the loss
/// `Σ w·gw + Σ b·gb` has exactly those gradients.
fn set_grads(w: &Tensor, b: &Tensor, step: usize) {
    let s = step as f64;
    let gw: Vec<f64> = [1.0, -2.0, 0.5, 0.0, 3.0, -1.0]
        .iter()
        .map(|g| g * (1.0 + 0.5 * s))
        .collect();
    let gb = [0.3 * (s - 1.0), -0.1 * (s - 1.0)];
    w.zero_grad();
    b.zero_grad();
    let (dtype, device) = (w.dtype(), w.device());
    let loss = w
        .mul(&tensor(&gw, &[2, 3], dtype, device))
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .add(
            &b.mul(&tensor(&gb, &[2], dtype, device))
                .unwrap()
                .sum(&[], false)
                .unwrap(),
        )
        .unwrap();
    loss.backward().unwrap();
}

fn groups(w: &Tensor, b: &Tensor) -> Vec<ParamGroup> {
    vec![
        ParamGroup::new(vec![w.clone()], 0.05),
        ParamGroup::new(vec![b.clone()], 0.0),
    ]
}

enum Opt {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl Opt {
    fn make(name: &str, groups: Vec<ParamGroup>) -> (Self, f64) {
        match name {
            "sgd_nesterov" => (Opt::Sgd(Sgd::new(groups, 0.9, 0.0, true).unwrap()), 0.1),
            "sgd_plain" => (Opt::Sgd(Sgd::new(groups, 0.0, 0.0, false).unwrap()), 0.1),
            "sgd_dampened" => (Opt::Sgd(Sgd::new(groups, 0.9, 0.1, false).unwrap()), 0.1),
            "adamw" => (
                Opt::AdamW(AdamW::new(groups, 0.9, 0.999, 1e-8).unwrap()),
                0.01,
            ),
            other => panic!("no optimizer case {other}"),
        }
    }

    fn step(&mut self, lr: f64, found_inf: Option<&Tensor>) {
        match self {
            Opt::Sgd(o) => o.step(lr, found_inf).unwrap(),
            Opt::AdamW(o) => o.step(lr, found_inf).unwrap(),
        }
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        match self {
            Opt::Sgd(o) => o.state(),
            Opt::AdamW(o) => o.state(),
        }
    }
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs PyTorch {w}"
        );
    }
}

#[test]
fn optimizers_match_pytorch() {
    let fx = fixture();
    let cpu = CpuBackend::device();
    for (device, dtype, tol) in [
        (Device::reference(), DType::F64, 1e-12),
        (cpu, DType::F32, 2e-6),
    ] {
        for (name, want) in fx["optimizers"].as_object().unwrap() {
            let (w, b) = start(dtype, &device);
            let (mut opt, lr) = Opt::make(name, groups(&w, &b));
            for step in 0..4 {
                set_grads(&w, &b, step);
                opt.step(lr, None);
            }
            let what = format!("{name} on {} {dtype}", device.name());
            assert_close(
                &format!("{what} w"),
                &w.to_f64_vec().unwrap(),
                &numbers(&want["w"]),
                tol,
            );
            assert_close(
                &format!("{what} b"),
                &b.to_f64_vec().unwrap(),
                &numbers(&want["b"]),
                tol,
            );
        }
    }
}

#[test]
fn skipped_steps_change_nothing() {
    let device = CpuBackend::device();
    let found = Tensor::full(1.0, &[1], DType::F32, &device).unwrap();
    let snapshot = |ts: &[(String, Tensor)]| -> Vec<Vec<f32>> {
        ts.iter().map(|(_, t)| t.to_vec::<f32>().unwrap()).collect()
    };
    for name in ["sgd_nesterov", "sgd_dampened", "adamw"] {
        let (w, b) = start(DType::F32, &device);
        let (mut opt, lr) = Opt::make(name, groups(&w, &b));
        set_grads(&w, &b, 0);
        opt.step(lr, None);
        let params = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
        let (before, state_before) = (snapshot(&params), snapshot(&opt.state()));
        set_grads(&w, &b, 1);
        opt.step(lr, Some(&found));
        assert_eq!(
            snapshot(&params),
            before,
            "{name}: parameters moved on a skipped step"
        );
        assert_eq!(
            snapshot(&opt.state()),
            state_before,
            "{name}: state moved on a skipped step"
        );
    }
}

#[test]
fn a_skipped_adamw_step_does_not_advance_the_step_count() {
    // Skipping step 1 then applying it must equal applying it directly: the bias correction
    // uses the count of applied steps only.
    let device = CpuBackend::device();
    let run = |skip: bool| {
        let (w, b) = start(DType::F32, &device);
        let (mut opt, lr) = Opt::make("adamw", groups(&w, &b));
        for step in 0..4 {
            set_grads(&w, &b, step);
            if skip && step == 1 {
                let found = Tensor::full(1.0, &[1], DType::F32, &device).unwrap();
                opt.step(lr, Some(&found));
                set_grads(&w, &b, step);
            }
            opt.step(lr, None);
        }
        (w.to_vec::<f32>().unwrap(), opt.state())
    };
    let (skipped, state) = run(true);
    assert_eq!(skipped, run(false).0);
    let steps: Vec<f32> = state
        .iter()
        .filter(|(n, _)| n.starts_with("step."))
        .flat_map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect();
    assert_eq!(steps, [4.0, 4.0]);
}

/// Half-precision parameters count their steps in f32: a bf16 count stops at 256 (256 + 1
/// rounds back to 256), which would freeze AdamW's bias correction from there on.
#[test]
fn half_precision_parameters_count_steps_past_their_dtypes_integers() {
    let device = CpuBackend::device();
    for dtype in [DType::BF16, DType::F16] {
        let w = tensor(&[0.5, -1.0], &[2], dtype, &device).with_requires_grad(true);
        let mut opt = AdamW::new(
            vec![ParamGroup::new(vec![w.clone()], 0.0)],
            0.9,
            0.999,
            1e-8,
        )
        .unwrap();
        w.mul(&tensor(&[1.0, -1.0], &[2], dtype, &device))
            .and_then(|l| l.sum(&[], false))
            .and_then(|l| l.backward())
            .unwrap();
        for _ in 0..2_100 {
            opt.step(1e-6, None).unwrap();
        }
        let (_, step) = (opt.state().into_iter())
            .find(|(n, _)| n.starts_with("step."))
            .expect("a step count");
        assert_eq!(step.to_f64_vec().unwrap(), [2_100.0], "{dtype}");
        assert_eq!(step.dtype(), DType::F32, "{dtype}");
    }
}

#[test]
fn lars_scales_each_layer_by_its_trust_ratio() {
    let device = Device::reference();
    let (w, b) = start(DType::F64, &device);
    let mut opt = Lars::new(groups(&w, &b), 0.9, false).unwrap();
    opt.trust_coefficient = 0.02;
    let (lr, wd, eta, m) = (0.5, 0.05, 0.02, 0.9);
    let mut want_w = vec![0.5, -1.0, 2.0, 0.25, 0.0, -0.75];
    let mut want_b = vec![0.1, -0.2];
    let (mut buf_w, mut buf_b) = (vec![0.0; 6], vec![0.0; 2]);
    let l2 = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    for step in 0..3 {
        set_grads(&w, &b, step);
        let gw = w.grad().unwrap().to_f64_vec().unwrap();
        let gb = b.grad().unwrap().to_f64_vec().unwrap();
        opt.step(lr, None).unwrap();
        // timm's formulas, by hand: the decayed group adapts, the other is plain SGD.
        let d: Vec<f64> = gw.iter().zip(&want_w).map(|(g, p)| g + wd * p).collect();
        let ratio = eta * l2(&want_w) / (l2(&d) + wd * l2(&want_w) + 1e-8);
        for i in 0..6 {
            let u = d[i] * ratio;
            buf_w[i] = if step == 0 { u } else { m * buf_w[i] + u };
            want_w[i] -= lr * buf_w[i];
        }
        for i in 0..2 {
            buf_b[i] = if step == 0 {
                gb[i]
            } else {
                m * buf_b[i] + gb[i]
            };
            want_b[i] -= lr * buf_b[i];
        }
    }
    assert_close("lars w", &w.to_f64_vec().unwrap(), &want_w, 1e-12);
    assert_close("lars b", &b.to_f64_vec().unwrap(), &want_b, 1e-12);
}

#[test]
fn schedules_match_pytorch() {
    let fx = fixture();
    let cases = [
        ("one_cycle", Schedule::one_cycle(20), 0.4),
        (
            "step",
            Schedule::Step {
                step_size: 3,
                gamma: 0.5,
            },
            0.4,
        ),
        (
            "warmup_cosine",
            Schedule::WarmupCosine {
                warmup: 4,
                start_factor: 0.1,
                total: 16,
                eta_min: 0.01,
            },
            0.4,
        ),
    ];
    for (name, schedule, base) in cases {
        let want = numbers(&fx["schedules"][name]);
        let got: Vec<f64> = (0..want.len()).map(|s| schedule.lr(base, s)).collect();
        assert_close(name, &got, &want, 1e-12);
    }
}

#[test]
fn clipping_matches_pytorch() {
    let fx = &fixture()["clip"];
    // The reference and CPU backends, and the CUDA kernels on their emulator: the global norm
    // from one multi-tensor sum of squares everywhere.
    let cuda = Device::new(std::sync::Arc::new(
        redline_cuda::CudaBackend::emulated().unwrap(),
    ));
    for (device, dtype, tol) in [
        (Device::reference(), DType::F64, 1e-12),
        (CpuBackend::device(), DType::F32, 1e-6),
        (cuda, DType::F32, 1e-6),
    ] {
        let (w, b) = start(dtype, &device);
        set_grads(&w, &b, 2);
        let norm = clip_grad_norm(&[w.clone(), b.clone()], 1.5)
            .unwrap()
            .unwrap();
        assert_close(
            "norm",
            &norm.to_f64_vec().unwrap(),
            &[fx["norm"].as_f64().unwrap()],
            tol,
        );
        assert_close(
            "w.grad",
            &w.grad().unwrap().to_f64_vec().unwrap(),
            &numbers(&fx["w"]),
            tol,
        );
        assert_close(
            "b.grad",
            &b.grad().unwrap().to_f64_vec().unwrap(),
            &numbers(&fx["b"]),
            tol,
        );
    }
    // Gradients already inside the bound are left as they are.
    let (w, b) = start(DType::F64, &Device::reference());
    set_grads(&w, &b, 2);
    let before = w.grad().unwrap().to_f64_vec().unwrap();
    clip_grad_norm(&[w.clone(), b], 100.0).unwrap();
    assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), before);
}

#[test]
fn ema_follows_the_weights_and_swaps_back() {
    let device = Device::reference();
    let layer = Linear::new(&mut Init::new(7, &device, DType::F64), 3, 2).unwrap();
    let ema = Ema::new(&layer, 0.75).unwrap();
    let params: Vec<Tensor> = named_parameters(&layer)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let first: Vec<Vec<f64>> = params.iter().map(|p| p.to_f64_vec().unwrap()).collect();
    for p in &params {
        p.assign(&p.add_scalar(1.0).unwrap()).unwrap();
    }
    ema.update().unwrap();
    for ((_, avg), start) in ema.averages().zip(&first) {
        let want: Vec<f64> = start.iter().map(|x| 0.75 * x + 0.25 * (x + 1.0)).collect();
        assert_close("ema", &avg.to_f64_vec().unwrap(), &want, 1e-12);
    }
    let live: Vec<Vec<f64>> = params.iter().map(|p| p.to_f64_vec().unwrap()).collect();
    ema.swap().unwrap();
    assert_ne!(params[0].to_f64_vec().unwrap(), live[0]);
    ema.swap().unwrap();
    let back: Vec<Vec<f64>> = params.iter().map(|p| p.to_f64_vec().unwrap()).collect();
    assert_eq!(back, live);
}

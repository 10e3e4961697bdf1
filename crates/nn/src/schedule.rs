//! Learning-rate schedules with PyTorch's formulas (`torch.optim.lr_scheduler`), as pure
//! functions of the step: resuming needs only the step number.

use std::f64::consts::PI;

#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    Constant,
    /// `LinearLR(start_factor, total_iters = warmup)` then `CosineAnnealingLR(T_max = total -
    /// warmup, eta_min)`, chained as `SequentialLR` does.
    WarmupCosine {
        warmup: usize,
        start_factor: f64,
        total: usize,
        eta_min: f64,
    },
    /// `StepLR`: × `gamma` every `step_size` steps.
    Step {
        step_size: usize,
        gamma: f64,
    },
    /// `OneCycleLR` with cosine annealing (two phases): from `max / div_factor` up to the base
    /// rate (the maximum) over `pct_start` of `total` steps, then down to
    /// `max / div_factor / final_div_factor`.
    OneCycle {
        total: usize,
        pct_start: f64,
        div_factor: f64,
        final_div_factor: f64,
    },
}

impl Schedule {
    /// PyTorch's defaults for a one-cycle run of `total` steps.
    pub fn one_cycle(total: usize) -> Self {
        Schedule::OneCycle {
            total,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        }
    }

    /// The learning rate of step `step` (0-based) for a base rate `base`.
    pub fn lr(&self, base: f64, step: usize) -> f64 {
        let t = step as f64;
        match *self {
            Schedule::Constant => base,
            Schedule::WarmupCosine {
                warmup,
                start_factor,
                total,
                eta_min,
            } => {
                if step < warmup {
                    base * (start_factor + (1.0 - start_factor) * t / warmup as f64)
                } else {
                    let span = total.saturating_sub(warmup).max(1) as f64;
                    let done = (t - warmup as f64).min(span);
                    eta_min + (base - eta_min) * (1.0 + (PI * done / span).cos()) / 2.0
                }
            }
            Schedule::Step { step_size, gamma } => {
                base * gamma.powi((step / step_size.max(1)) as i32)
            }
            Schedule::OneCycle {
                total,
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                let initial = base / div_factor;
                let min = initial / final_div_factor;
                let peak = pct_start * total as f64 - 1.0;
                let last = total as f64 - 1.0;
                let anneal = |from: f64, to: f64, pct: f64| {
                    to + (from - to) / 2.0 * ((PI * pct).cos() + 1.0)
                };
                if t <= peak {
                    anneal(initial, base, t / peak)
                } else {
                    anneal(base, min, ((t - peak) / (last - peak)).min(1.0))
                }
            }
        }
    }
}

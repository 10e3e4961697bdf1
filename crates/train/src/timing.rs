//! Where a step's time goes. Each phase ends with a device synchronisation, so an asynchronous
//! device's queued work is charged to the phase that issued it (as `torch.cuda.synchronize()`
//! around each phase does); on the CPU backend every op is already synchronous, and the
//! synchronisation costs nothing.

use std::time::{Duration, Instant};

use redline_tensor::{Device, Result};

/// The phases of a training step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the loader's next batch.
    DataWait,
    /// Uploading it and the input op (u8 NHWC → normalised NCHW on the device).
    HostToDevice,
    /// Forward pass and loss.
    Forward,
    Backward,
    /// Unscaling, clipping, the optimizer update and the scale update.
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::DataWait,
        Phase::HostToDevice,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::DataWait => "data_wait",
            Phase::HostToDevice => "host_to_device",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// One step's phase durations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    pub phases: [Duration; 5],
}

impl StepTimes {
    pub fn get(&self, phase: Phase) -> Duration {
        self.phases[phase as usize]
    }

    pub fn total(&self) -> Duration {
        self.phases.iter().sum()
    }
}

/// Times consecutive phases of one step.
pub(crate) struct PhaseClock<'a> {
    device: &'a Device,
    last: Instant,
    pub times: StepTimes,
}

impl<'a> PhaseClock<'a> {
    pub fn start(device: &'a Device) -> Self {
        Self {
            device,
            last: Instant::now(),
            times: StepTimes::default(),
        }
    }

    /// Ends `phase`: waits for the device, then charges the time since the previous lap.
    pub fn lap(&mut self, phase: Phase) -> Result<()> {
        self.device.synchronize()?;
        let now = Instant::now();
        self.times.phases[phase as usize] += now - self.last;
        self.last = now;
        Ok(())
    }
}

/// The `p`-th percentile (0..=100) of `values` by linear interpolation between order
/// statistics, as `numpy.percentile` computes it; NaN for no values.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 90.0), 4.6);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}

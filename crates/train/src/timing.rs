//! Where a step's time goes. Waiting for data is host time. The device phases are timed on the
//! device where it can: each ends with a timestamp enqueued behind its work (a CUDA event, a
//! Vulkan timestamp query), all read once when the step ends — what the device spent on each
//! phase, with no synchronisation between phases to stall the queue (host timers around
//! asynchronous calls would only time the enqueueing). A device that takes no timestamps runs
//! its ops synchronously (the CPU backend): there each phase ends with a synchronisation, which
//! costs nothing, and a host timer, which is exact.

use std::time::{Duration, Instant};

use redline_tensor::{Annotation, Device, Result, Timestamp};

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
    /// The device phases were read from device timestamps (else host timers after
    /// synchronising).
    pub device_clock: bool,
}

impl StepTimes {
    /// Host-timed phases of the given milliseconds, for tests.
    #[cfg(test)]
    pub(crate) fn from_ms(ms: [u64; 5]) -> Self {
        Self {
            phases: ms.map(Duration::from_millis),
            device_clock: false,
        }
    }

    pub fn get(&self, phase: Phase) -> Duration {
        self.phases[phase as usize]
    }

    pub fn total(&self) -> Duration {
        self.phases.iter().sum()
    }
}

/// Times consecutive phases of one step: [`lap_host`](Self::lap_host) ends a phase of host
/// work, [`lap`](Self::lap) one of device work, [`finish`](Self::finish) gives the times.
pub struct PhaseClock<'a> {
    device: &'a Device,
    last: Instant,
    times: StepTimes,
    /// Where the device phases begin on the device's clock (`None`: it takes no timestamps).
    opened: Option<Timestamp>,
    /// The device phases ended so far, each with its closing timestamp.
    closed: Vec<(Phase, Timestamp)>,
    /// The profiler range (NVTX on CUDA) of the phase under way: phases run in
    /// [`Phase::ALL`]'s order, so a lap opens the next one's.
    range: Annotation,
}

impl<'a> PhaseClock<'a> {
    pub fn start(device: &'a Device) -> Result<Self> {
        Ok(Self {
            device,
            last: Instant::now(),
            times: StepTimes::default(),
            opened: device.timestamp()?,
            closed: Vec::new(),
            range: device.annotate(Phase::ALL[0].name()),
        })
    }

    /// Closes the range of `ended` and opens the next phase's (ranges are a stack: the old one
    /// is popped before the new one is pushed).
    fn next_range(&mut self, ended: Phase) {
        self.range = Annotation::none();
        if let Some(&next) = Phase::ALL.get(ended as usize + 1) {
            self.range = self.device.annotate(next.name());
        }
    }

    fn charge_host_time(&mut self, phase: Phase) {
        let now = Instant::now();
        self.times.phases[phase as usize] += now - self.last;
        self.last = now;
    }

    /// Ends `phase`, spent on the host (the device has nothing of it): the device phases
    /// open after it.
    pub fn lap_host(&mut self, phase: Phase) -> Result<()> {
        self.charge_host_time(phase);
        self.next_range(phase);
        if self.closed.is_empty() {
            self.opened = self.device.timestamp()?;
        }
        Ok(())
    }

    /// Ends `phase`, which enqueued device work: a timestamp behind that work, or (without
    /// timestamps) a synchronisation and the host time since the previous lap.
    pub fn lap(&mut self, phase: Phase) -> Result<()> {
        self.next_range(phase);
        if self.opened.is_some() {
            if let Some(stamp) = self.device.timestamp()? {
                self.closed.push((phase, stamp));
                return Ok(());
            }
        }
        self.device.synchronize()?;
        self.charge_host_time(phase);
        Ok(())
    }

    /// The step's times: device phases are read from their timestamps (waiting until the
    /// device has taken the last).
    pub fn finish(self) -> Result<StepTimes> {
        let device = self.device;
        self.finish_later().read(device)
    }

    /// The step's times without waiting for the device: its device phases are read later
    /// ([`PendingTimes::read`]), once the device has moved on — so the host can issue the next
    /// steps meanwhile instead of draining the queue at every step's end.
    pub fn finish_later(self) -> PendingTimes {
        let stamps = (self.opened)
            .filter(|_| !self.closed.is_empty())
            .map(|opened| (opened, self.closed));
        PendingTimes {
            times: self.times,
            stamps,
        }
    }
}

/// A step's phase times whose device phases are still on the device, as timestamps.
#[derive(Debug)]
pub struct PendingTimes {
    times: StepTimes,
    /// Where the device phases opened, and each one's closing timestamp.
    stamps: Option<(Timestamp, Vec<(Phase, Timestamp)>)>,
}

impl PendingTimes {
    /// Nothing left to read (a synchronous device, timed on the host).
    pub fn is_ready(&self) -> bool {
        self.stamps.is_none()
    }

    /// The times, reading the device phases from `device` (the clock's device), waiting until
    /// it has taken the last of them.
    pub fn read(self, device: &Device) -> Result<StepTimes> {
        let mut times = self.times;
        let Some((opened, closed)) = self.stamps else {
            return Ok(times);
        };
        let stamps: Vec<Timestamp> = std::iter::once(opened)
            .chain(closed.iter().map(|&(_, s)| s))
            .collect();
        let ns = device.read_timestamps(&stamps)?;
        for (&(phase, _), pair) in closed.iter().zip(ns.windows(2)) {
            times.phases[phase as usize] += Duration::from_nanos(pair[1].saturating_sub(pair[0]));
        }
        times.device_clock = true;
        Ok(times)
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
    fn a_synchronous_device_is_timed_by_the_host_clock() {
        // The reference backend takes no timestamps: every phase is host time.
        let device = Device::reference();
        let mut clock = PhaseClock::start(&device).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        clock.lap_host(Phase::DataWait).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        clock.lap(Phase::Forward).unwrap();
        let times = clock.finish().unwrap();
        assert!(!times.device_clock);
        assert!(times.get(Phase::DataWait) >= Duration::from_millis(5));
        assert!(times.get(Phase::Forward) >= Duration::from_millis(5));
        assert!(times.get(Phase::Backward).is_zero());
    }

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

//! A progress line on stderr: redrawn in place on a terminal, every 10% in logs.

use std::io::IsTerminal;
use std::time::Instant;

pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    /// Items already done when this run started (a resumed build): not part of the rate.
    base: u64,
    start: Instant,
    last_draw: Instant,
    last_tenth: u64,
    terminal: bool,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        Self::starting_at(label, total, 0)
    }

    /// A progress line for work of which `done` items were finished before this run.
    pub fn starting_at(label: impl Into<String>, total: u64, done: u64) -> Self {
        let now = Instant::now();
        Self {
            label: label.into(),
            total,
            done,
            base: done,
            start: now,
            last_draw: now,
            last_tenth: done * 10 / total.max(1),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    pub fn inc(&mut self, n: u64) {
        self.done += n;
        let tenth = self.done * 10 / self.total.max(1);
        if self.terminal && self.last_draw.elapsed().as_millis() >= 100 {
            self.draw("\r");
        } else if !self.terminal && tenth > self.last_tenth {
            self.last_tenth = tenth;
            self.draw("");
        }
    }

    pub fn finish(mut self) {
        if self.terminal {
            self.draw("\r");
            eprintln!();
        }
    }

    fn draw(&mut self, prefix: &str) {
        self.last_draw = Instant::now();
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let width = 30;
        let filled = (self.done * width / self.total.max(1)).min(width) as usize;
        let rate = (self.done - self.base) as f64 / secs;
        let line = format!(
            "{prefix}{} [{}{}] {}/{} ({rate:.0}/s, {})",
            self.label,
            "#".repeat(filled),
            "-".repeat(width as usize - filled),
            self.done,
            self.total,
            eta(self.total.saturating_sub(self.done), rate)
        );
        // eprint! (not a raw stderr handle) so test harnesses capture it.
        if self.terminal {
            eprint!("{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

/// "ETA 1h02m", "ETA 3m05s", "ETA 12s" for `left` items at `rate` a second; "done" at the end.
fn eta(left: u64, rate: f64) -> String {
    if left == 0 {
        return "done".into();
    }
    if rate <= 0.0 || !rate.is_finite() {
        return "ETA ?".into();
    }
    let secs = (left as f64 / rate).ceil() as u64;
    match secs {
        s if s >= 3600 => format!("ETA {}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("ETA {}m{:02}s", s / 60, s % 60),
        s => format!("ETA {s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::eta;

    #[test]
    fn the_eta_reads_in_the_largest_sensible_units() {
        assert_eq!(eta(0, 5.0), "done");
        assert_eq!(eta(100, 0.0), "ETA ?");
        assert_eq!(eta(90, 10.0), "ETA 9s");
        assert_eq!(eta(1850, 10.0), "ETA 3m05s");
        // ImageNet's 1.28 M images at 350 images a second.
        assert_eq!(eta(1_281_167, 350.0), "ETA 1h01m");
    }
}

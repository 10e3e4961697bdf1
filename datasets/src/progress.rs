//! A progress line on stderr: redrawn in place on a terminal, every 10% in logs.

use std::io::IsTerminal;
use std::time::Instant;

pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    start: Instant,
    last_draw: Instant,
    last_tenth: u64,
    terminal: bool,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        let now = Instant::now();
        Self {
            label: label.into(),
            total,
            done: 0,
            start: now,
            last_draw: now,
            last_tenth: 0,
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
        let line = format!(
            "{prefix}{} [{}{}] {}/{} ({:.0}/s)",
            self.label,
            "#".repeat(filled),
            "-".repeat(width as usize - filled),
            self.done,
            self.total,
            self.done as f64 / secs
        );
        // eprint! (not a raw stderr handle) so test harnesses capture it.
        if self.terminal {
            eprint!("{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

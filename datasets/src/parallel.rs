//! An ordered parallel map with bounded memory: work runs on every core, results are consumed in
//! input order, and no worker runs more than a small window ahead of the consumer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Condvar, Mutex};

/// Runs `work(i)` for `i in 0..count` on `threads` threads and hands each result to `sink` in
/// order of `i`. Stops early, and returns the error, when `sink` fails.
pub fn ordered_map<T, E>(
    count: usize,
    threads: usize,
    work: impl Fn(usize) -> T + Sync,
    mut sink: impl FnMut(usize, T) -> Result<(), E>,
) -> Result<(), E>
where
    T: Send,
{
    let threads = threads.max(1);
    let window = threads * 4;
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    // How many results the sink has consumed, and a signal when that grows.
    let consumed = Mutex::new(0usize);
    let progressed = Condvar::new();
    let (tx, rx) = mpsc::sync_channel::<(usize, T)>(window);

    std::thread::scope(|scope| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (work, next, stop, consumed, progressed) =
                (&work, &next, &stop, &consumed, &progressed);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return;
                }
                // Back-pressure: wait while this item is too far ahead of the consumer.
                let mut done = consumed.lock().unwrap_or_else(|p| p.into_inner());
                while i >= *done + window && !stop.load(Ordering::Relaxed) {
                    done = progressed.wait(done).unwrap_or_else(|p| p.into_inner());
                }
                drop(done);
                if stop.load(Ordering::Relaxed) || tx.send((i, work(i))).is_err() {
                    return;
                }
            });
        }
        drop(tx);

        let mut pending = BTreeMap::new();
        let mut expected = 0;
        let mut result = Ok(());
        for (i, value) in rx.iter() {
            pending.insert(i, value);
            while let Some(value) = pending.remove(&expected) {
                if let Err(e) = sink(expected, value) {
                    result = Err(e);
                    break;
                }
                expected += 1;
                *consumed.lock().unwrap_or_else(|p| p.into_inner()) = expected;
                progressed.notify_all();
            }
            if result.is_err() {
                break;
            }
        }
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
            let _guard = consumed.lock().unwrap_or_else(|p| p.into_inner());
            progressed.notify_all();
        }
        drop(rx);
        result
    })
}

/// The number of threads to use by default: every core.
pub fn all_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_arrive_in_order() {
        let mut seen = Vec::new();
        ordered_map(
            500,
            4,
            |i| {
                if i % 7 == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                i * 2
            },
            |i, v| {
                seen.push((i, v));
                Ok::<_, ()>(())
            },
        )
        .unwrap();
        assert_eq!(seen, (0..500).map(|i| (i, i * 2)).collect::<Vec<_>>());
    }

    #[test]
    fn a_sink_error_stops_the_workers() {
        let ran = AtomicUsize::new(0);
        let err = ordered_map(
            100_000,
            2,
            |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                i
            },
            |i, _| if i == 10 { Err("stop") } else { Ok(()) },
        );
        assert_eq!(err, Err("stop"));
        assert!(ran.load(Ordering::Relaxed) < 1000, "workers ran on");
    }
}

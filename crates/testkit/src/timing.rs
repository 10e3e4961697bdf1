//! The device-clock contract ([`Device::timestamp`]), checked the same way on every backend
//! that takes timestamps.

use redline_tensor::{Device, Tensor, Timestamp, TIMESTAMP_SLOTS};

/// Timestamps are taken in queue order, bracket the work enqueued between them, read the same
/// twice, and a slot that does not exist is refused by name. Panics (a test helper) on a
/// broken contract; `Err` names a device that takes no timestamps at all.
pub fn check_timestamps(device: &Device) -> Result<(), String> {
    let Some(before) = device.timestamp().map_err(|e| e.to_string())? else {
        return Err(format!("{} takes no timestamps", device.name()));
    };
    let host = std::time::Instant::now();
    // Enough work that the device clock must move: a 96³ matmul, then ten more ops.
    let values: Vec<f32> = (0..96 * 96).map(|i| (i % 7) as f32).collect();
    let x = Tensor::from_slice(&values, &[96, 96], device).expect("upload");
    let mut y = x.matmul(&x).expect("matmul");
    let middle = device.timestamp().unwrap().expect("a second timestamp");
    for _ in 0..10 {
        y = y.add(&x).expect("add");
    }
    let after = device.timestamp().unwrap().expect("a third timestamp");
    let ns = device.read_timestamps(&[before, middle, after]).unwrap();
    let host_ns = host.elapsed().as_nanos() as u64;
    assert!(
        ns[0] < ns[1] && ns[1] < ns[2],
        "readings out of order: {ns:?}"
    );
    // The device work happened between the host's first enqueue and its read.
    assert!(
        ns[2] - ns[0] <= host_ns,
        "device {ns:?} vs host {host_ns} ns"
    );
    assert_eq!(device.read_timestamps(&[middle]).unwrap(), [ns[1]]);
    let err = device
        .read_timestamps(&[Timestamp(TIMESTAMP_SLOTS)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("timestamp slot"), "{err}");
    drop(y);
    Ok(())
}

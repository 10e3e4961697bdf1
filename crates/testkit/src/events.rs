//! The event contract ([`Device::record_event`], [`Backend::download_after`],
//! [`Device::wait_event`], [`Tensor::copy_from_host_after`]), checked the same way on every
//! backend: what a gradient bucket's journey to a collective, and a batch's to the device,
//! rely on.
//!
//! [`Backend::download_after`]: redline_tensor::Backend::download_after

use redline_tensor::{DType, Device, Event, Tensor};

/// A download ordered after an event sees every op enqueued before the event, whatever is
/// enqueued after it; strided views arrive row-major; waiting for the device's own events is
/// fine; an event of another backend is refused by a device that records real events. `Err`
/// says what broke.
pub fn check_events(device: &Device) -> Result<(), String> {
    let fail = |what: &str, e: redline_tensor::TensorError| format!("{what}: {e}");
    let values: Vec<f32> = (0..64 * 64).map(|i| (i % 13) as f32 - 6.0).collect();
    let x = Tensor::from_slice(&values, &[64, 64], device).map_err(|e| fail("upload", e))?;
    let doubled = x.mul_scalar(2.0).map_err(|e| fail("mul", e))?;
    let transposed = doubled.transpose(0, 1).map_err(|e| fail("transpose", e))?;
    let event = device.record_event().map_err(|e| fail("record_event", e))?;
    // Work after the event that the downloads must neither wait for nor see.
    let mut later = x.matmul(&x).map_err(|e| fail("matmul", e))?;
    for _ in 0..4 {
        later = later.matmul(&x).map_err(|e| fail("matmul", e))?;
    }
    let backend = device.backend();
    let dense = backend
        .download_after(doubled.view(), &event)
        .and_then(|d| d.wait())
        .map_err(|e| fail("download_after", e))?;
    let strided = backend
        .download_after(transposed.view(), &event)
        .and_then(|d| d.wait())
        .map_err(|e| fail("download_after of a transposed view", e))?;
    let dense: Vec<f32> = redline_tensor::dtype::from_bytes(&dense, DType::F32);
    let strided: Vec<f32> = redline_tensor::dtype::from_bytes(&strided, DType::F32);
    let want: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
    if dense != want {
        return Err(format!(
            "{}: download_after read other values than the ops before its event wrote",
            device.name()
        ));
    }
    let want_t: Vec<f32> = (0..64 * 64).map(|i| want[(i % 64) * 64 + i / 64]).collect();
    if strided != want_t {
        return Err(format!(
            "{}: download_after of a transposed view is not row-major",
            device.name()
        ));
    }
    // The compute stream waiting for its own event, then more work behind it.
    device
        .wait_event(&event)
        .map_err(|e| fail("wait_event", e))?;
    let after_wait = doubled
        .add(&x)
        .and_then(|t| t.to_vec::<f32>())
        .map_err(|e| fail("an op after wait_event", e))?;
    let want_sum: Vec<f32> = values.iter().map(|v| v * 3.0).collect();
    if after_wait != want_sum {
        return Err(format!(
            "{}: an op after wait_event is wrong",
            device.name()
        ));
    }
    // A reached event orders nothing and is accepted everywhere.
    device
        .wait_event(&Event::reached())
        .map_err(|e| fail("wait_event(reached)", e))?;
    if !event.is_reached() {
        let foreign = Event::new(usize::MAX - 1, ());
        match device.wait_event(&foreign) {
            Err(e) if e.to_string().contains("another device") => {}
            Err(e) => return Err(format!("a foreign event refused without saying so: {e}")),
            Ok(()) => return Err(format!("{} waited for a foreign event", device.name())),
        }
    }
    // A copy ordered after the last op that read the tensor: that op saw the old values, the
    // ops after the copy's event the new ones.
    let read_old = x.mul_scalar(2.0).map_err(|e| fail("mul", e))?;
    let last_read = device.record_event().map_err(|e| fail("record_event", e))?;
    let fresh: Vec<f32> = values.iter().map(|v| v + 100.0).collect();
    let bytes = redline_tensor::dtype::to_bytes(&fresh);
    let copied = x
        .copy_from_host_after(redline_tensor::HostBytes::Owned(bytes), &last_read)
        .map_err(|e| fail("copy_from_host_after", e))?;
    device
        .wait_event(&copied)
        .map_err(|e| fail("wait_event(copy)", e))?;
    let read_new = x.mul_scalar(2.0).map_err(|e| fail("mul", e))?;
    let (old, new) = (read_old.to_vec::<f32>(), read_new.to_vec::<f32>());
    let (Ok(old), Ok(new)) = (old, new) else {
        return Err(format!("{}: reading around a copy failed", device.name()));
    };
    if old != want || new != fresh.iter().map(|v| v * 2.0).collect::<Vec<f32>>() {
        return Err(format!(
            "{}: copy_from_host_after is not ordered between the ops around it",
            device.name()
        ));
    }
    later
        .to_vec::<f32>()
        .map_err(|e| fail("the later work", e))?;
    Ok(())
}

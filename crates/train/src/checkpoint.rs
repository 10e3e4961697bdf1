//! Checkpoints as safetensors files: the model's state dict under torchvision's key names (so
//! `torch`/`safetensors` load the weights as they are), the optimizer's and the scaler's state
//! under `optimizer.` and `scaler.`, and in the metadata the step count, the loader position
//! and the seed — everything a resumed run needs to continue as if it had never stopped (the
//! loader's randomness is keyed by seed, epoch and sample, so the position is its whole state).
//! Written to a temporary file beside the target, synced, then renamed over it: a crash
//! mid-write leaves the previous checkpoint intact.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use redline_tensor::{DType, Tensor};
use serde_json::{json, Value};

use crate::{Result, TrainError};

/// What is saved besides tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Optimizer steps taken (the schedule's position).
    pub step: u64,
    /// Where the next training batch starts: epoch and sample index in it.
    pub epoch: u64,
    pub index: u64,
    pub seed: u64,
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::U8 => "U8",
        DType::I32 => "I32",
        DType::I64 => "I64",
    }
}

fn bad(path: &Path, why: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint(format!("{}: {why}", path.display()))
}

/// Writes `tensors` (name → tensor, row-major) and `progress` to `path` atomically.
pub fn save(path: &Path, tensors: &[(String, Tensor)], progress: Progress) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        let bytes = t.device().backend().download(t.view())?;
        let begin = data.len();
        data.extend_from_slice(&bytes);
        header.insert(
            name.clone(),
            json!({
                "dtype": dtype_name(t.dtype()),
                "shape": t.shape(),
                "data_offsets": [begin, data.len()],
            }),
        );
    }
    let meta = json!({
        "format": "redline-checkpoint",
        "step": progress.step.to_string(),
        "epoch": progress.epoch.to_string(),
        "index": progress.index.to_string(),
        "seed": progress.seed.to_string(),
    });
    header.insert("__metadata__".into(), meta);
    write_file(path, &Value::Object(header), &data)
}

/// Writes a safetensors file (header padded to 8 bytes, then the data) to a temporary file
/// beside `path`, synced, then renamed over it.
fn write_file(path: &Path, header: &Value, data: &[u8]) -> Result<()> {
    let mut text = serde_json::to_string(header).map_err(|e| bad(path, format!("header: {e}")))?;
    // The format pads the header with spaces to a multiple of 8 bytes.
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let tmp = path.with_extension("safetensors.tmp");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&(text.len() as u64).to_le_bytes())?;
        f.write_all(text.as_bytes())?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        bad(path, e)
    })
}

/// Reads `path` into `tensors`, which must match it name for name in dtype and shape (every
/// one of them present: a checkpoint of another model is refused before anything is written).
pub fn load(path: &Path, tensors: &[(String, Tensor)]) -> Result<Progress> {
    let meta = read_into(path, tensors)?;
    let number = |k: &str| -> Result<u64> {
        meta[k]
            .as_str()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(path, format!("metadata has no {k}")))
    };
    Ok(Progress {
        step: number("step")?,
        epoch: number("epoch")?,
        index: number("index")?,
        seed: number("seed")?,
    })
}

/// Reads the tensors of any safetensors file into `tensors` as [`load`] does, without asking
/// for redline's metadata: a state dict PyTorch saved (`safetensors.torch.save_file`), or the
/// weights of a redline checkpoint. Entries the file has beyond `tensors` are ignored.
pub fn load_weights(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    read_into(path, tensors).map(|_| ())
}

/// Writes the model weights of checkpoint `from` alone to `to`: every entry but the optimizer's
/// and the scaler's, bytes unchanged, with the metadata PyTorch's `safetensors.torch.save_file`
/// writes (`{"format": "pt"}`). Returns how many tensors it kept.
pub fn export_weights(from: &Path, to: &Path) -> Result<usize> {
    let bytes = fs::read(from).map_err(|e| bad(from, e))?;
    let (header, data) = split(from, &bytes)?;
    let mut kept = serde_json::Map::new();
    let mut out_data = Vec::new();
    for (name, entry) in &header {
        if name == "__metadata__" || name.starts_with("optimizer.") || name.starts_with("scaler.") {
            continue;
        }
        let range = data_range(from, name, entry, data.len(), None)?;
        let begin = out_data.len();
        out_data.extend_from_slice(&data[range]);
        let mut entry = entry.clone();
        entry["data_offsets"] = json!([begin, out_data.len()]);
        kept.insert(name.clone(), entry);
    }
    let count = kept.len();
    kept.insert("__metadata__".into(), json!({"format": "pt"}));
    write_file(to, &Value::Object(kept), &out_data)?;
    Ok(count)
}

/// A header's JSON array of sizes or offsets (empty when it is not one).
fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        })
        .unwrap_or_default()
}

/// An entry's byte range in a data section of `len` bytes (of exactly `bytes` when given).
fn data_range(
    path: &Path,
    name: &str,
    entry: &Value,
    len: usize,
    bytes: Option<usize>,
) -> Result<std::ops::Range<usize>> {
    let offsets = usizes(&entry["data_offsets"]);
    match offsets[..] {
        [b, e] if b <= e && e <= len && bytes.is_none_or(|n| e - b == n) => Ok(b..e),
        _ => Err(bad(path, format!("{name}: bad data offsets {offsets:?}"))),
    }
}

/// A safetensors file's header (name → entry, `__metadata__` included) and its data bytes.
fn split<'a>(path: &Path, bytes: &'a [u8]) -> Result<(BTreeMap<String, Value>, &'a [u8])> {
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize)
        .ok_or_else(|| bad(path, "shorter than a safetensors header"))?;
    let text = bytes
        .get(8..8usize.saturating_add(n))
        .ok_or_else(|| bad(path, format!("header of {n} bytes runs past the file")))?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(text).map_err(|e| bad(path, format!("header: {e}")))?;
    Ok((header, &bytes[8 + n..]))
}

/// The shared reader: checks every tensor first, then assigns; returns the file's metadata.
fn read_into(path: &Path, tensors: &[(String, Tensor)]) -> Result<Value> {
    let bytes = fs::read(path).map_err(|e| bad(path, e))?;
    let (header, data) = split(path, &bytes)?;
    let mut plan = Vec::new();
    for (name, t) in tensors {
        let entry = header
            .get(name)
            .ok_or_else(|| bad(path, format!("no tensor {name:?}")))?;
        let dtype = entry["dtype"].as_str().unwrap_or("?");
        let shape = usizes(&entry["shape"]);
        if dtype != dtype_name(t.dtype()) || shape != t.shape() {
            return Err(bad(
                path,
                format!(
                    "{name}: {dtype} {shape:?} in the file, {} {:?} here",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        let bytes = t.numel() * t.dtype().size();
        let range = data_range(path, name, entry, data.len(), Some(bytes))?;
        plan.push((t, range));
    }
    for (t, range) in plan {
        let src = Tensor::from_bytes(data[range].to_vec(), t.dtype(), t.shape(), t.device())?;
        redline_tensor::no_grad(|| t.assign(&src))?;
    }
    Ok(header.get("__metadata__").cloned().unwrap_or(Value::Null))
}

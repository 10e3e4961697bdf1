//! Checkpoints as safetensors files (through the `safetensors` crate): the model's state dict
//! under torchvision's key names (so `torch`/`safetensors` load the weights as they are), the
//! optimizer's and the scaler's state under `optimizer.` and `scaler.`, and in the metadata the
//! step count, the loader position and the seed — everything a resumed run needs to continue as
//! if it had never stopped (the loader's randomness is keyed by seed, epoch and sample, so the
//! position is its whole state). Written to a temporary file beside the target, synced, then
//! renamed over it: a crash mid-write leaves the previous checkpoint intact.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::Path;

use redline_tensor::{DType, Tensor, TensorError};
use safetensors::{Dtype, SafeTensors, View};
use serde_json::Value;

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
    /// How many ranks trained (1 without data parallelism): `index` counts one rank's
    /// samples, so resuming on another world size rescales it
    /// ([`redline_loader::Position::reshard`]). Checkpoints without it were single-rank.
    pub world: u64,
}

fn file_dtype(d: DType) -> Dtype {
    match d {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::U8 => Dtype::U8,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
    }
}

fn bad(path: &Path, why: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint(format!("{}: {why}", path.display()))
}

/// Writes `tensors` (name → tensor, row-major) and `progress` to `path` atomically. The same
/// state always gives the same bytes.
pub fn save(path: &Path, tensors: &[(String, Tensor)], progress: Progress) -> Result<()> {
    let failed = RefCell::new(None);
    let views: Vec<(&str, OnDevice)> = tensors
        .iter()
        .map(|(name, t)| {
            let view = OnDevice {
                tensor: t,
                shape: t.shape().to_vec(),
                failed: &failed,
            };
            (name.as_str(), view)
        })
        .collect();
    let metadata = HashMap::from(
        [
            ("format", "redline-checkpoint".to_string()),
            ("step", progress.step.to_string()),
            ("epoch", progress.epoch.to_string()),
            ("index", progress.index.to_string()),
            ("seed", progress.seed.to_string()),
            ("world", progress.world.to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| bad(path, e))?;
    if let Some(e) = failed.into_inner() {
        return Err(e.into());
    }
    write_file(path, bytes)
}

/// A tensor as the serialiser reads it: downloaded only when its bytes are asked for, so saving
/// holds the file's bytes and one tensor at a time, not every tensor twice. `View::data` cannot
/// fail, so a failed download is kept in `failed` (and its place zero-filled) for `save` to
/// return before anything is written.
struct OnDevice<'a> {
    tensor: &'a Tensor,
    shape: Vec<usize>,
    failed: &'a RefCell<Option<TensorError>>,
}

impl View for OnDevice<'_> {
    fn dtype(&self) -> Dtype {
        file_dtype(self.tensor.dtype())
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let t = self.tensor;
        let downloaded = t.device().backend().download(t.view());
        match downloaded {
            Ok(bytes) if bytes.len() == self.data_len() => Cow::Owned(bytes),
            outcome => {
                let e = outcome.err().unwrap_or_else(|| {
                    TensorError::Device(format!(
                        "{} downloaded the wrong number of bytes for {:?}",
                        t.device().name(),
                        t.shape()
                    ))
                });
                self.failed.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0; self.data_len()])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.dtype().size()
    }
}

/// Writes a serialised file to a temporary file beside `path`, synced, then renamed over it.
/// The header is rewritten with its keys in order on the way: the crate writes the metadata
/// from a hash map, whose order changes from run to run.
fn write_file(path: &Path, bytes: Vec<u8>) -> Result<()> {
    let (header, data) = canonical_header(&bytes).map_err(|e| bad(path, e))?;
    let tmp = path.with_extension("safetensors.tmp");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(&header)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        bad(path, e)
    })
}

/// The JSON header of `bytes` (a whole safetensors file) with its keys sorted at every level and
/// padded to 8 bytes as the format asks, and the data section, unchanged (its offsets are
/// relative to its own start).
fn canonical_header(bytes: &[u8]) -> std::result::Result<(Vec<u8>, &[u8]), String> {
    let (n, _) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let (text, data) = bytes.get(8..).ok_or("no header")?.split_at(n);
    let sorted: BTreeMap<String, Value> =
        serde_json::from_slice(text).map_err(|e| e.to_string())?;
    let sorted: BTreeMap<String, Value> = sorted
        .into_iter()
        .map(|(k, v)| (k, sorted_value(v)))
        .collect();
    let mut json = serde_json::to_vec(&sorted).map_err(|e| e.to_string())?;
    json.resize(json.len().next_multiple_of(8), b' ');
    Ok((json, data))
}

/// A JSON value with every object's keys sorted (whatever serde_json's map type is).
fn sorted_value(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let sorted: BTreeMap<String, Value> =
                map.into_iter().map(|(k, v)| (k, sorted_value(v))).collect();
            Value::Object(sorted.into_iter().collect())
        }
        other => other,
    }
}

/// Reads `path` into `tensors`, which must match it name for name in dtype and shape (every
/// one of them present: a checkpoint of another model is refused before anything is written).
pub fn load(path: &Path, tensors: &[(String, Tensor)]) -> Result<Progress> {
    let metadata = read_into(path, tensors)?;
    let number = |k: &str| -> Result<u64> {
        metadata
            .get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(path, format!("metadata has no {k}")))
    };
    Ok(Progress {
        step: number("step")?,
        epoch: number("epoch")?,
        index: number("index")?,
        seed: number("seed")?,
        world: match metadata.contains_key("world") {
            true => number("world")?,
            false => 1,
        },
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
    let file = parse(from, &bytes)?;
    let kept: Vec<_> = file
        .iter()
        .filter(|(name, _)| !name.starts_with("optimizer.") && !name.starts_with("scaler."))
        .collect();
    let count = kept.len();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(kept, Some(metadata)).map_err(|e| bad(to, e))?;
    write_file(to, bytes)?;
    Ok(count)
}

/// The file's header and tensors, checked by the crate: the header's JSON, each tensor's size
/// against its dtype and shape, and that the tensors tile the data section exactly.
fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file: {e}")))
}

/// The shared reader: checks every tensor first, then assigns; returns the file's metadata.
fn read_into(path: &Path, tensors: &[(String, Tensor)]) -> Result<HashMap<String, String>> {
    let bytes = fs::read(path).map_err(|e| bad(path, e))?;
    let file = parse(path, &bytes)?;
    let mut plan = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let view = file
            .tensor(name)
            .map_err(|_| bad(path, format!("no tensor {name:?}")))?;
        if view.dtype() != file_dtype(t.dtype()) || view.shape() != t.shape() {
            return Err(bad(
                path,
                format!(
                    "{name}: {:?} {:?} in the file, {} {:?} here",
                    view.dtype(),
                    view.shape(),
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        plan.push((t, view.data()));
    }
    for (t, data) in plan {
        let src = Tensor::from_bytes(data.to_vec(), t.dtype(), t.shape(), t.device())?;
        redline_tensor::no_grad(|| t.assign(&src))?;
    }
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e))?;
    Ok(header.metadata().clone().unwrap_or_default())
}

//! The module contract: a forward pass, named tensors (PyTorch's state dict), the train/eval
//! switch, and shape + MAC inference without running anything.

use std::sync::Arc;

use redline_tensor::{Result, Tensor};

use crate::layers::BatchStatsSync;

/// What a named tensor of a module is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Trained by the optimizer (requires grad).
    Parameter,
    /// State that is saved but not trained (running statistics, counters).
    Buffer,
}

/// A layer or a network. Parameters are leaf tensors that require grad; optimizers update them
/// in place, so a module keeps the same tensors for its whole life.
pub trait Module: Send + Sync {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Calls `f(name, tensor, kind)` for every named tensor, depth first, in torchvision's
    /// state-dict order; names are `prefix` + the module's own (`layer1.0.conv1.weight`).
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind));

    /// Training mode (batch statistics, running-stat updates) or evaluation mode.
    fn set_training(&self, _training: bool) {}

    /// Synchronised batch norm: every batch norm in the module takes its training statistics
    /// over all processes' batches through `sync` (`None`: over its own batch again).
    /// Containers pass it to their children, as they do `set_training`.
    fn sync_batch_norm(&self, _sync: Option<&Arc<dyn BatchStatsSync>>) {}

    /// A captured training step was replayed: count the batch where the module counts batches
    /// on the host (batch norm's `num_batches_tracked`), as `forward` would have. Containers
    /// pass it to their children.
    fn batch_replayed(&self) {}

    /// Called after new values were written into the named tensors (a checkpoint or state
    /// dict was loaded): refreshes whatever the module mirrors on the host.
    fn state_loaded(&self) -> Result<()> {
        Ok(())
    }

    /// The output shape of a forward on an input of `shape`, and its multiply-accumulates
    /// (convolutions and linear layers; normalisation, activations and pooling count none, as
    /// the usual "GMACs per image" figures do).
    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)>;
}

/// `prefix.name`, or `name` at the top.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Shapes and MACs of `modules` applied one after another to an input of `shape`.
pub(crate) fn chain<'a>(
    shape: &[usize],
    modules: impl IntoIterator<Item = &'a dyn Module>,
) -> Result<(Vec<usize>, u64)> {
    let (mut shape, mut macs) = (shape.to_vec(), 0);
    for m in modules {
        let (next, more) = m.shape_and_macs(&shape)?;
        shape = next;
        macs += more;
    }
    Ok((shape, macs))
}

/// Every named tensor, in state-dict order.
pub fn state_dict(m: &dyn Module) -> Vec<(String, Tensor, Kind)> {
    let mut out = Vec::new();
    m.visit("", &mut |name, t, kind| {
        out.push((name.to_string(), t.clone(), kind))
    });
    out
}

/// The trainable tensors, in state-dict order.
pub fn named_parameters(m: &dyn Module) -> Vec<(String, Tensor)> {
    state_dict(m)
        .into_iter()
        .filter(|(_, _, kind)| *kind == Kind::Parameter)
        .map(|(name, t, _)| (name, t))
        .collect()
}

/// How many trainable elements the module has.
pub fn num_parameters(m: &dyn Module) -> usize {
    named_parameters(m).iter().map(|(_, t)| t.numel()).sum()
}

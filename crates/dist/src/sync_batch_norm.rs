//! Synchronised batch norm's sums over processes (`redline_nn::BatchStatsSync` over a
//! [`Collective`]).

use std::sync::Arc;

use redline_nn::{BatchStatsSync, Module};
use redline_tensor::{Tensor, TensorError};

use crate::collective::{Collective, Reduce};
use crate::error::Result;

/// Sums batch statistics over a group's ranks, on the thread that runs forward and backward.
/// [`install`](Self::install) chooses the group: the gradients' own where that thread issues
/// their buckets too (a device collective), else one split from it.
pub struct SyncBatchStats {
    group: Arc<dyn Collective>,
}

impl SyncBatchStats {
    pub fn new(group: Arc<dyn Collective>) -> Self {
        Self { group }
    }

    /// Makes every batch norm of `model` synchronised over the ranks of `collective`
    /// (collective: every rank calls it), and returns the group its sums use (a step replayed
    /// as a graph runs them too: the trainer watches it).
    ///
    /// A device collective ([`Collective::capturable`]: NCCL) is shared: [`crate::DataParallel`]
    /// issues its gradient buckets from the backward thread too, so one thread issues both in
    /// autograd's order, the same on every rank — two NCCL communicators on one device, their
    /// collectives on two streams in whatever order each GPU runs them, could wait on each
    /// other across ranks. A host collective's buckets go to a thread of their own, so the sums
    /// get a group split from it: one group shared by two threads could see its calls in a
    /// different order on different ranks.
    pub fn install(
        model: &dyn Module,
        collective: &Arc<dyn Collective>,
    ) -> Result<Arc<dyn Collective>> {
        let group = match collective.capturable() {
            true => Arc::clone(collective),
            false => collective.split()?,
        };
        let sync: Arc<dyn BatchStatsSync> = Arc::new(Self::new(group.clone()));
        model.sync_batch_norm(Some(&sync));
        Ok(group)
    }
}

fn tensor_error(e: crate::DistError) -> TensorError {
    TensorError::Device(format!("synchronised batch norm: {e}"))
}

/// `t` summed over the group's ranks into a new tensor of its own.
fn summed(group: &dyn Collective, t: &Tensor) -> redline_tensor::Result<Tensor> {
    // A fresh dense copy: the collective overwrites whole storages in place.
    let out = t.detach().mul_scalar(1.0)?;
    group
        .all_reduce(std::slice::from_ref(&out), Reduce::Sum)
        .map_err(tensor_error)?;
    Ok(out)
}

impl BatchStatsSync for SyncBatchStats {
    fn sum(&self, t: &Tensor) -> redline_tensor::Result<Tensor> {
        let out = summed(self.group.as_ref(), t)?;
        // d(Σ_ranks t_r)/d(t_r) = 1 for every rank's loss: this rank's input gets the sum of
        // every rank's output gradient.
        let group = Arc::clone(&self.group);
        Ok(out.with_backward("all_reduce_sum", &[t], move |grad| {
            Ok(vec![Some(summed(group.as_ref(), grad)?)])
        }))
    }
}

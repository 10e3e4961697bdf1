//! `nn.Sequential`: children named `0`, `1`, … (or given names), applied in order.

use std::sync::Arc;

use redline_tensor::{Result, Tensor};

use crate::layers::BatchStatsSync;

use crate::module::{chain, join, Kind, Module};

#[derive(Default)]
pub struct Sequential {
    children: Vec<(String, Box<dyn Module>)>,
}

impl Sequential {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a child named by its position, as `nn.Sequential(*modules)` does.
    pub fn push(mut self, m: impl Module + 'static) -> Self {
        let name = self.children.len().to_string();
        self.children.push((name, Box::new(m)));
        self
    }

    /// Appends a child with a name of its own (`nn.Sequential(OrderedDict(...))`).
    pub fn named(mut self, name: &str, m: impl Module + 'static) -> Self {
        self.children.push((name.to_string(), Box::new(m)));
        self
    }

    pub fn len(&self) -> usize {
        self.children.len()
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for (_, m) in &self.children {
            y = m.forward(&y)?;
        }
        Ok(y)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        for (name, m) in &self.children {
            m.visit(&join(prefix, name), f);
        }
    }

    fn set_training(&self, training: bool) {
        for (_, m) in &self.children {
            m.set_training(training);
        }
    }

    fn sync_batch_norm(&self, sync: Option<&Arc<dyn BatchStatsSync>>) {
        for (_, m) in &self.children {
            m.sync_batch_norm(sync);
        }
    }

    fn batch_replayed(&self) {
        for (_, m) in &self.children {
            m.batch_replayed();
        }
    }

    fn state_loaded(&self) -> Result<()> {
        self.children.iter().try_for_each(|(_, m)| m.state_loaded())
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        chain(shape, self.children.iter().map(|(_, m)| m.as_ref()))
    }
}

//! Reverse-mode autograd: every op on tensors that need gradients records a node (the tape);
//! `backward()` walks it in reverse topological order and frees it as it goes.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

/// Computes the gradients of an op's inputs from the gradient of its output (one per input;
/// `None` where an input gets none).
pub(crate) type BackwardFn = Box<dyn FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send>;

/// One recorded op. Its inputs and closure are taken (freed) when backward runs through it.
pub(crate) struct Node {
    pub(crate) name: &'static str,
    state: Mutex<Option<(Vec<Tensor>, BackwardFn)>>,
}

impl Node {
    pub(crate) fn new(name: &'static str, inputs: Vec<Tensor>, backward: BackwardFn) -> Arc<Self> {
        Arc::new(Self {
            name,
            state: Mutex::new(Some((inputs, backward))),
        })
    }

    fn inputs(&self) -> Vec<Tensor> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.as_ref().map(|(i, _)| i.clone()).unwrap_or_default()
    }

    fn take(&self) -> Option<(Vec<Tensor>, BackwardFn)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops record the tape on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Runs `f` without recording the tape (evaluation, optimizer updates), like `torch.no_grad()`.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard::new();
    f()
}

/// Disables the tape until dropped.
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    pub fn new() -> Self {
        Self {
            previous: GRAD_ENABLED.with(|g| g.replace(false)),
        }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Backpropagates `grad` (the gradient of `root`) through the tape, accumulating into the
/// `.grad()` of every leaf that requires it.
pub(crate) fn backward(root: &Tensor, grad: Tensor) -> Result<()> {
    if !root.requires_grad() {
        return Err(TensorError::Autograd(
            "backward() on a tensor that does not require grad".into(),
        ));
    }
    if root.is_leaf() {
        root.accumulate_grad(grad)?;
        return Ok(());
    }
    if root.node().is_some_and(|n| n.inputs().is_empty()) {
        return Err(TensorError::Autograd(
            "the graph was already freed by an earlier backward()".into(),
        ));
    }
    let order = topological_order(root);
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    grads.insert(root.key(), grad);
    let _no_grad = NoGradGuard::new();
    for tensor in order.iter().rev() {
        let Some(grad) = grads.remove(&tensor.key()) else {
            continue;
        };
        if tensor.is_leaf() {
            tensor.accumulate_grad(grad)?;
            continue;
        }
        let Some(node) = tensor.node() else { continue };
        let Some((inputs, backward)) = node.take() else {
            return Err(TensorError::Autograd(format!(
                "the graph through {} was already freed by an earlier backward()",
                node.name
            )));
        };
        let input_grads = backward(&grad)?;
        for (input, g) in inputs.iter().zip(input_grads) {
            let Some(g) = g else { continue };
            if !input.requires_grad() {
                continue;
            }
            let g = match grads.remove(&input.key()) {
                Some(previous) => previous.add(&g)?,
                None => g,
            };
            grads.insert(input.key(), g);
        }
    }
    Ok(())
}

/// Tensors reachable from `root` through the tape, each after all its inputs.
fn topological_order(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut visited = std::collections::HashSet::new();
    // Iterative DFS: (tensor, inputs already pushed).
    let mut stack = vec![(root.clone(), false)];
    while let Some((tensor, expanded)) = stack.pop() {
        if expanded {
            order.push(tensor);
            continue;
        }
        if !visited.insert(tensor.key()) {
            continue;
        }
        let inputs = tensor.node().map(|n| n.inputs()).unwrap_or_default();
        stack.push((tensor, true));
        for input in inputs {
            if input.requires_grad() && !visited.contains(&input.key()) {
                stack.push((input, false));
            }
        }
    }
    order
}

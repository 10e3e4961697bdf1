//! Reverse-mode autograd: every op on tensors that need gradients records a node (the tape);
//! `backward()` walks it in reverse topological order and frees it as it goes.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Computes the gradients of an op's inputs from the gradient of its output (one per input;
/// `None` where an input gets none). It may take a gradient already waiting for an input
/// ([`Pending`]) to add its own into; the gradient it returns for that input then includes it.
pub(crate) type BackwardFn =
    Box<dyn FnOnce(&Tensor, &mut Pending<'_>) -> Result<Vec<Option<Tensor>>> + Send>;

/// The gradients already summed for an op's inputs by the ops backward has passed (a residual
/// block's input has the skip connection's before the convolution's). An op whose backward
/// can add into memory in place (cuDNN's β = 1) takes one, saving the engine's separate add: a
/// pass over an activation-sized tensor per residual block.
pub(crate) struct Pending<'a> {
    inputs: &'a [Tensor],
    grads: &'a mut HashMap<usize, Tensor>,
}

impl Pending<'_> {
    /// The gradient waiting for input `i`, when it may be written in place: nothing else holds
    /// it or its memory (an add's backward hands one gradient to both its inputs), and it is
    /// laid out as `layout` in `dtype` from the start of its storage.
    pub(crate) fn exclusive(&self, i: usize, layout: &Layout, dtype: DType) -> Option<&Tensor> {
        let g = self.grads.get(&self.inputs.get(i)?.key())?;
        let alone = g.is_sole_owner();
        (alone && g.layout() == layout && g.dtype() == dtype).then_some(g)
    }

    /// Removes the gradient waiting for input `i`: the caller has added into it (after
    /// [`exclusive`](Self::exclusive)) and returns it as the input's gradient.
    pub(crate) fn take(&mut self, i: usize) -> Option<Tensor> {
        self.grads.remove(&self.inputs.get(i)?.key())
    }
}

/// One recorded op. Its inputs and closure are taken (freed) when backward runs through it.
pub(crate) struct Node {
    pub(crate) name: &'static str,
    /// When the op was recorded: an op's inputs were all recorded before it, so walking ops
    /// from the latest to the earliest is a valid backward order (PyTorch's engine orders its
    /// ready queue by this sequence number too).
    sequence: u64,
    state: Mutex<Option<(Vec<Tensor>, BackwardFn)>>,
}

impl Node {
    pub(crate) fn new(name: &'static str, inputs: Vec<Tensor>, backward: BackwardFn) -> Arc<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Arc::new(Self {
            name,
            sequence: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
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
        root.gradient_ready();
        return Ok(());
    }
    if root.node().is_some_and(|n| n.inputs().is_empty()) {
        return Err(TensorError::Autograd(
            "the graph was already freed by an earlier backward()".into(),
        ));
    }
    let order = topological_order(root);
    // Ops run latest-recorded first, and a leaf is accumulated (and its hook called) as soon
    // as the last op that uses it has passed its gradient back — so the last layer's
    // parameters are ready while backward is still in the first layers, and data parallelism
    // can reduce them meanwhile. (A depth-first order would reach a weight's transpose only
    // after the whole data path below it.)
    let mut walk: Vec<&Tensor> = order.iter().filter(|t| !t.is_leaf()).collect();
    walk.sort_by_key(|t| std::cmp::Reverse(t.node().map(|n| n.sequence)));
    walk.extend(order.iter().rev().filter(|t| t.is_leaf()));
    // How many recorded ops still have to pass a gradient to each tensor.
    let mut consumers: HashMap<usize, usize> = HashMap::new();
    for tensor in &order {
        for input in tensor.node().map(|n| n.inputs()).unwrap_or_default() {
            if input.requires_grad() {
                *consumers.entry(input.key()).or_default() += 1;
            }
        }
    }
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    grads.insert(root.key(), grad);
    let _no_grad = NoGradGuard::new();
    for tensor in walk {
        let Some(grad) = grads.remove(&tensor.key()) else {
            continue;
        };
        if tensor.is_leaf() {
            // A leaf not accumulated early (an op returned fewer gradients than inputs).
            tensor.accumulate_grad(grad)?;
            tensor.gradient_ready();
            continue;
        }
        let Some(node) = tensor.node() else { continue };
        let Some((inputs, backward)) = node.take() else {
            return Err(TensorError::Autograd(format!(
                "the graph through {} was already freed by an earlier backward()",
                node.name
            )));
        };
        let mut pending = Pending {
            inputs: &inputs,
            grads: &mut grads,
        };
        let input_grads = backward(&grad, &mut pending)?;
        for (input, g) in inputs.iter().zip(input_grads) {
            if !input.requires_grad() {
                continue;
            }
            let left = consumers.get_mut(&input.key()).map(|c| {
                *c = c.saturating_sub(1);
                *c
            });
            if let Some(g) = g {
                let g = match grads.remove(&input.key()) {
                    Some(previous) => previous.add(&g)?,
                    None => g,
                };
                grads.insert(input.key(), g);
            }
            if input.is_leaf() && left == Some(0) {
                if let Some(total) = grads.remove(&input.key()) {
                    input.accumulate_grad(total)?;
                    input.gradient_ready();
                }
            }
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

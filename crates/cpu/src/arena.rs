//! Reusable scratch memory: im2col tiles and partial sums come from here and go back when done,
//! so a training step in the steady state allocates no large scratch (the first step sizes the
//! arena; later steps reuse it).

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// Free scratch vectors by element type.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    f32s: Mutex<Vec<Vec<f32>>>,
    f64s: Mutex<Vec<Vec<f64>>>,
}

/// An element type the arena keeps.
pub(crate) trait Pooled: Copy + Default + Send + 'static {
    fn pool(arena: &Arena) -> &Mutex<Vec<Vec<Self>>>;
}

impl Pooled for f32 {
    fn pool(arena: &Arena) -> &Mutex<Vec<Vec<f32>>> {
        &arena.f32s
    }
}

impl Pooled for f64 {
    fn pool(arena: &Arena) -> &Mutex<Vec<Vec<f64>>> {
        &arena.f64s
    }
}

/// Scratch of `len` elements (contents unspecified); returns to the arena on drop.
pub(crate) struct Scratch<'a, T: Pooled> {
    arena: &'a Arena,
    buf: Vec<T>,
    len: usize,
}

impl Arena {
    /// Scratch of at least `len` elements: the smallest free vector that fits, else a new one.
    pub fn take<T: Pooled>(&self, len: usize) -> Scratch<'_, T> {
        let mut free = T::pool(self).lock().unwrap_or_else(|p| p.into_inner());
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i);
        let buf = match best {
            Some(i) => free.swap_remove(i),
            None => vec![T::default(); len],
        };
        Scratch {
            arena: self,
            buf,
            len,
        }
    }

    /// Elements held free (for tests: the steady state stops growing).
    #[cfg(test)]
    pub fn free_elements<T: Pooled>(&self) -> usize {
        let free = T::pool(self).lock().unwrap_or_else(|p| p.into_inner());
        free.iter().map(Vec::len).sum()
    }
}

impl<T: Pooled> Deref for Scratch<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[..self.len]
    }
}

impl<T: Pooled> DerefMut for Scratch<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[..self.len]
    }
}

impl<T: Pooled> Drop for Scratch<'_, T> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut free = T::pool(self.arena)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        free.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_is_reused() {
        let arena = Arena::default();
        for _ in 0..10 {
            let a = arena.take::<f32>(1000);
            let b = arena.take::<f32>(500);
            assert_eq!((a.len(), b.len()), (1000, 500));
        }
        // Two vectors serve every round.
        assert_eq!(arena.free_elements::<f32>(), 1500);
    }
}

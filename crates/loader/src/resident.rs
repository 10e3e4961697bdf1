//! One batch again and again, from memory: a data source with no reading or decoding, to
//! measure a training step on its own and set it beside the same run fed by the [`Loader`]
//! (the difference is the data stall). Each batch is a copy of the resident pixels and labels
//! into a pooled buffer — pinned when the allocator pins, as the loader's — which returns to
//! its pool once the device upload that took it is done.
//!
//! [`Loader`]: crate::Loader

use std::sync::Arc;
use std::time::Instant;

use redline_hostmem::{BufferPool, HostAllocator};

use crate::order::Position;
use crate::pipeline::{Batch, BatchStats, LoaderError};

pub struct Resident {
    pool: BufferPool,
    pixels: Vec<u8>,
    labels: Vec<i64>,
    res: usize,
    position: Position,
}

impl Resident {
    /// `pixels` (`[len, res, res, 3]` u8, NHWC) and their `len` labels, served through
    /// `buffers` buffers from `allocator` (a device's pinned one; page-aligned memory without;
    /// two or more buffers let one upload while the next fills).
    pub fn new(
        pixels: Vec<u8>,
        labels: Vec<i64>,
        res: usize,
        buffers: usize,
        allocator: Option<Arc<dyn HostAllocator>>,
    ) -> Result<Self, LoaderError> {
        let sample = res * res * 3;
        if labels.is_empty() || pixels.len() != labels.len() * sample {
            return Err(LoaderError::Config(format!(
                "a resident batch of {} labels needs {} × {res} × {res} × 3 = {} pixel bytes, got {}",
                labels.len(),
                labels.len(),
                labels.len() * sample,
                pixels.len()
            )));
        }
        let bytes = pixels.len() + labels.len() * 8;
        let pool = match allocator {
            Some(allocator) => BufferPool::new(buffers, bytes, allocator),
            None => BufferPool::page_aligned(buffers, bytes),
        }
        .map_err(|e| LoaderError::Config(format!("resident batch buffers: {e}")))?;
        Ok(Self {
            pool,
            pixels,
            labels,
            res,
            position: Position::default(),
        })
    }

    /// Whether its buffers are pinned (the allocator pins).
    pub fn is_pinned(&self) -> bool {
        self.pool.is_pinned()
    }
}

impl Iterator for Resident {
    type Item = Result<Batch, LoaderError>;

    /// The batch again, in the next free buffer (waiting for one while all are uploading).
    fn next(&mut self) -> Option<Self::Item> {
        let started = Instant::now();
        let mut buffer = match self.pool.acquire() {
            Ok(b) => b,
            Err(e) => return Some(Err(LoaderError::Config(format!("resident batch: {e}")))),
        };
        let waited = started.elapsed();
        let labels_at = self.pixels.len();
        buffer[..labels_at].copy_from_slice(&self.pixels);
        for (slot, label) in self.labels.iter().enumerate() {
            buffer[labels_at + slot * 8..labels_at + slot * 8 + 8]
                .copy_from_slice(&label.to_le_bytes());
        }
        let len = self.labels.len();
        let position = self.position;
        self.position.index += len;
        let stats = BatchStats {
            work: started.elapsed() - waited,
            waited,
            ..BatchStats::default()
        };
        Some(Ok(Batch::from_parts(
            buffer, labels_at, len, self.res, position, stats,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redline_hostmem::PageAligned;

    #[test]
    fn serves_the_same_batch_in_recycled_buffers_with_advancing_positions() {
        let (res, len) = (4, 3);
        let pixels: Vec<u8> = (0..len * res * res * 3)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let labels = vec![5, -1, 9];
        let mut source = Resident::new(pixels.clone(), labels.clone(), res, 2, None).unwrap();
        assert!(!source.is_pinned());
        for step in 0..5 {
            // Each batch is dropped before the next: two buffers serve any number of steps.
            let batch = source.next().unwrap().unwrap();
            assert_eq!(batch.images(), &pixels[..]);
            assert_eq!(batch.labels().collect::<Vec<_>>(), labels);
            assert_eq!((batch.len, batch.res), (len, res));
            assert_eq!(batch.position.index, step * len);
        }
    }

    #[test]
    fn pixels_that_do_not_match_the_labels_are_refused_by_size() {
        let err = Resident::new(vec![0; 47], vec![1, 2], 2, 2, Some(Arc::new(PageAligned)))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("2 × 2 × 2 × 3 = 24") && err.contains("got 47"),
            "{err}"
        );
        assert!(Resident::new(vec![], vec![], 2, 2, None).is_err());
    }
}

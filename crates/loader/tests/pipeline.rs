//! The pipeline end to end on a real shard set of real JPEGs: order, determinism across worker
//! counts, resume, bad samples, shutdown mid-epoch, and statistics.

use std::collections::HashSet;
use std::sync::Arc;

use image::{ImageFormat, RgbImage};
use redline_loader::{Codec, Config, Loader, LoaderError, OnBadSample, Position};
use redline_shard::{RecordInfo, SetOptions, SetWriter, ShardSet};

/// `n` JPEGs of varied sizes; sample i has label i % 10 and a colour that encodes i. Records in
/// `broken` hold garbage instead.
fn shard_set(n: usize, broken: &[usize]) -> (tempfile::TempDir, Arc<ShardSet>) {
    let dir = tempfile::tempdir().unwrap();
    let classes = (0..10).map(|c| format!("class{c}")).collect();
    let mut options = SetOptions::images("train", classes);
    options.shard_bytes = 8_000; // several shards
    let mut writer = SetWriter::create(dir.path().join("set"), options).unwrap();
    for i in 0..n {
        let (w, h) = (40 + (i * 7) % 50, 30 + (i * 11) % 40);
        let img = RgbImage::from_fn(w as u32, h as u32, |x, y| {
            image::Rgb([(i * 20 % 256) as u8, (x * 4) as u8, (y * 4) as u8])
        });
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, ImageFormat::Jpeg).unwrap();
        let mut bytes = bytes.into_inner();
        if broken.contains(&i) {
            bytes = b"\xFF\xD8 not really a jpeg".to_vec();
        }
        let info = RecordInfo::image((i % 10) as i32, w as u32, h as u32, &bytes);
        writer.append(info, &bytes).unwrap();
    }
    writer.finish().unwrap();
    let set = ShardSet::open(dir.path().join("set")).unwrap();
    assert!(set.shards().len() > 1);
    (dir, Arc::new(set))
}

fn config(workers: usize, train: bool) -> Config {
    let mut c = Config::new(4, 16, train);
    c.workers = workers;
    c.seed = 5;
    c
}

/// Every batch of `epochs` epochs: (position, labels, pixels).
fn run(loader: Loader, batches: usize) -> Vec<(Position, Vec<i64>, Vec<u8>)> {
    loader
        .take(batches)
        .map(|b| {
            let b = b.unwrap();
            (b.position, b.labels().collect(), b.images().to_vec())
        })
        .collect()
}

#[test]
fn an_epoch_covers_every_sample_once_in_order_and_labels_match() {
    let (_dir, set) = shard_set(22, &[]);
    let mut c = config(2, false);
    c.drop_last = false;
    let loader = Loader::new(set.clone(), c, Position::default()).unwrap();
    assert_eq!(loader.batches_per_epoch(), 6);
    let batches = run(loader, 6);
    let labels: Vec<i64> = batches.iter().flat_map(|(_, l, _)| l.clone()).collect();
    // Evaluation order is the dataset order: labels cycle 0..9.
    assert_eq!(labels, (0..22).map(|i| i % 10).collect::<Vec<i64>>());
    assert_eq!(batches[5].1.len(), 2, "a short last batch");
    assert_eq!(batches[2].0, Position { epoch: 0, index: 8 });
}

#[test]
fn batches_do_not_depend_on_the_worker_count_and_epochs_differ() {
    let (_dir, set) = shard_set(24, &[]);
    let one = run(
        Loader::new(set.clone(), config(1, true), Position::default()).unwrap(),
        12,
    );
    let three = run(
        Loader::new(set.clone(), config(3, true), Position::default()).unwrap(),
        12,
    );
    assert_eq!(one, three, "same seed, same batches, whatever the workers");
    // Epoch 0 is batches 0..6, epoch 1 is 6..12: the same samples in another order and crops.
    let epoch_labels = |range: std::ops::Range<usize>| -> Vec<i64> {
        let mut l: Vec<i64> = one[range].iter().flat_map(|(_, l, _)| l.clone()).collect();
        l.sort_unstable();
        l
    };
    assert_eq!(epoch_labels(0..6), epoch_labels(6..12));
    // Nothing decoded is cached: two epochs decode every sample twice (or more, counting the
    // batches prefetched beyond them).
    let mut loader = Loader::new(set.clone(), config(2, true), Position::default()).unwrap();
    for _ in 0..12 {
        loader.next().unwrap().unwrap();
    }
    assert!(
        loader.decodes() >= 48,
        "{} decodes for 48 samples",
        loader.decodes()
    );
    assert_ne!(one[0].2, one[6].2);
    assert_eq!(one[6].0, Position { epoch: 1, index: 0 });
}

#[test]
fn resuming_from_a_position_continues_the_same_stream() {
    let (_dir, set) = shard_set(24, &[]);
    let full = run(
        Loader::new(set.clone(), config(2, true), Position::default()).unwrap(),
        9,
    );
    let resumed = run(
        Loader::new(
            set.clone(),
            config(2, true),
            Position {
                epoch: 0,
                index: 12,
            },
        )
        .unwrap(),
        6,
    );
    assert_eq!(&full[3..9], &resumed[..]);
}

#[test]
fn bad_samples_fail_by_name_or_are_skipped_and_counted() {
    let (_dir, set) = shard_set(12, &[5]);
    let mut c = config(2, false);
    c.drop_last = false;
    let results: Vec<_> = Loader::new(set.clone(), c.clone(), Position::default())
        .unwrap()
        .take(3)
        .collect();
    // Named by shard file and record within it (global sample 5 is in a later shard).
    let err = results[1].as_ref().unwrap_err();
    assert!(matches!(err, LoaderError::Sample { .. }), "{err}");
    let text = err.to_string();
    let named = text.contains("shard-") && text.contains(": record ");
    assert!(named && text.contains("truncated"), "{text}");
    assert!(
        results[0].is_ok() && results[2].is_ok(),
        "other batches are unaffected"
    );

    c.on_bad_sample = OnBadSample::Skip;
    let batch = Loader::new(set, c, Position::default())
        .unwrap()
        .nth(1)
        .unwrap()
        .unwrap();
    let labels: Vec<i64> = batch.labels().collect();
    assert_eq!(labels, [4, -1, 6, 7]);
    assert_eq!(batch.stats.skipped.len(), 1);
    assert!(
        batch.stats.skipped[0].reason.contains("truncated"),
        "{:?}",
        batch.stats.skipped
    );
    assert!(batch.images()[16 * 16 * 3..2 * 16 * 16 * 3]
        .iter()
        .all(|&v| v == 0));
}

#[test]
fn dropping_mid_epoch_stops_every_worker_and_stats_add_up() {
    let (_dir, set) = shard_set(40, &[]);
    let mut loader = Loader::new(set.clone(), config(3, true), Position::default()).unwrap();
    let first = loader.next().unwrap().unwrap();
    let second = loader.next().unwrap().unwrap();
    assert!(first.stats.work > std::time::Duration::ZERO);
    let workers: HashSet<usize> = [first.stats.worker, second.stats.worker].into();
    assert!(workers.iter().all(|&w| w < 3));
    let stall = loader.data_stall();
    assert!((0.0..=1.0).contains(&stall), "{stall}");
    // Batches still held by the consumer do not block shutdown; once the loader is dropped,
    // every worker has ended (each held a clone of the shard set).
    assert!(Arc::strong_count(&set) > 1);
    drop(loader);
    assert_eq!(Arc::strong_count(&set), 1, "every worker thread joined");
    drop((first, second));
}

/// Every codec gives the same batches up to decoding differences: libjpeg-turbo's cropped and
/// DCT-scaled decodes (these crops are 2–5× the 16-pixel output, so most are scaled) land on the
/// same pixels as zune-jpeg's full-size decode + crop, for training and evaluation.
#[test]
fn codecs_agree_on_every_batch() {
    let (_dir, set) = shard_set(24, &[]);
    for train in [true, false] {
        let batches = |codec: Codec| {
            let mut c = config(2, train);
            c.codec = codec;
            run(Loader::new(set.clone(), c, Position::default()).unwrap(), 6)
        };
        let reference = batches(Codec::Zune);
        for &codec in Codec::available() {
            let other = batches(codec);
            assert_eq!(other.len(), reference.len());
            for ((p, labels, pixels), (q, their_labels, theirs)) in reference.iter().zip(&other) {
                assert_eq!((p, labels), (q, their_labels), "{codec:?}");
                let err = pixels
                    .iter()
                    .zip(theirs)
                    .map(|(&a, &b)| (a as i32 - b as i32).abs() as f64)
                    .sum::<f64>()
                    / pixels.len() as f64;
                assert!(
                    err < 2.0,
                    "{codec:?} train={train}: {err} levels from zune-jpeg's batch at {p:?}"
                );
            }
        }
    }
}

/// An allocator that counts what it hands out (page-aligned memory underneath).
#[derive(Debug, Default)]
struct Counting {
    allocated: std::sync::atomic::AtomicUsize,
}

// SAFETY: delegates to PageAligned, which meets the contract.
unsafe impl redline_hostmem::HostAllocator for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn is_pinned(&self) -> bool {
        true
    }
    fn allocate(&self, len: usize) -> Result<std::ptr::NonNull<u8>, redline_hostmem::HostMemError> {
        self.allocated
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        redline_hostmem::PageAligned.allocate(len)
    }
    unsafe fn deallocate(&self, ptr: std::ptr::NonNull<u8>, len: usize) {
        unsafe { redline_hostmem::PageAligned.deallocate(ptr, len) }
    }
}

/// A device's allocator (pinned memory on CUDA) backs every batch buffer, and the batches are
/// the same as from page-aligned memory.
#[test]
fn batches_land_in_buffers_from_the_configured_allocator() {
    let (_dir, set) = shard_set(24, &[]);
    let counting = Arc::new(Counting::default());
    let mut pinned = config(2, true);
    pinned.allocator = Some(counting.clone());
    let with = Loader::new(set.clone(), pinned, Position::default()).unwrap();
    let mut batches = with.take(4).map(|b| b.unwrap()).collect::<Vec<_>>();
    assert!(
        counting
            .allocated
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    let first = batches.remove(0);
    let pixels = first.images().to_vec();
    assert!(
        first.into_buffer().is_pinned(),
        "the batch's buffer is the allocator's"
    );
    let plain = run(
        Loader::new(set, config(2, true), Position::default()).unwrap(),
        1,
    );
    assert_eq!(plain[0].2, pixels);
}

/// A batch is one worker's job: the loader keeps at least one per worker out whatever
/// `prefetch` says (16 cores used to build only 3 batches at once at the default), and
/// `prefetch` beyond that when it is larger.
#[test]
fn every_worker_has_a_batch_to_build_whatever_the_prefetch() {
    let (_dir, set) = shard_set(48, &[]);
    for (workers, prefetch, out) in [(4, 1, 4), (2, 5, 5)] {
        let config = Config {
            prefetch,
            ..config(workers, true)
        };
        let mut loader = Loader::new(set.clone(), config, Position::default()).unwrap();
        // The first `out` batches were issued at once; one has been handed out since.
        loader.next().unwrap().unwrap();
        assert_eq!(
            loader.batches_in_flight() + 1,
            out,
            "{workers} workers, prefetch {prefetch}"
        );
    }
}

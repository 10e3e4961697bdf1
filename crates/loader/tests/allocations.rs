//! The steady state allocates nothing in the pipeline itself. A counting global allocator (this
//! test binary only) counts allocations on every thread; the decoder's own allocations (zune-jpeg
//! allocates per image internally) are measured separately on the same images and subtracted.
//! libjpeg-turbo (feature `turbojpeg`) makes no Rust allocations per image once its output
//! buffer has grown; its C-side working memory (libjpeg's per-image pools, through `malloc`) is
//! outside this counter.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use image::{ImageFormat, RgbImage};
use redline_loader::{Config, Decoder, Loader, Position};
use redline_shard::{RecordInfo, SetOptions, SetWriter, ShardSet};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

#[test]
fn steady_state_batches_allocate_only_inside_the_decoder() {
    // 32 JPEGs of one size (so decoder and resampler buffers reach their size at once).
    let dir = tempfile::tempdir().unwrap();
    let mut writer = SetWriter::create(
        dir.path().join("set"),
        SetOptions::images("t", vec!["a".into()]),
    )
    .unwrap();
    let mut jpegs = Vec::new();
    for i in 0..32u32 {
        let img = RgbImage::from_fn(64, 48, |x, y| {
            image::Rgb([(x * 4) as u8, (y * 5) as u8, (i * 8) as u8])
        });
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, ImageFormat::Jpeg).unwrap();
        let bytes = bytes.into_inner();
        writer
            .append(RecordInfo::image(0, 64, 48, &bytes), &bytes)
            .unwrap();
        jpegs.push(bytes);
    }
    writer.finish().unwrap();
    let set = Arc::new(ShardSet::open(dir.path().join("set")).unwrap());

    // What the decoder allocates per image, on its own.
    let mut decoder = Decoder::new();
    decoder.decode(&jpegs[0]).unwrap();
    let before = allocations();
    for bytes in &jpegs {
        decoder.decode(bytes).unwrap();
    }
    let per_decode = (allocations() - before) as f64 / jpegs.len() as f64;

    let mut config = Config::new(8, 32, true);
    config.workers = 2;
    let mut loader = Loader::new(set, config, Position::default()).unwrap();
    // Warm-up: the first epoch sizes every buffer (and the next epoch's order is computed).
    for _ in 0..8 {
        drop(loader.next().unwrap().unwrap());
    }
    let (before, decoded) = (allocations(), loader.decodes());
    // 96 batches of 8 from 32 images: 24 epochs.
    let (batches, epochs) = (96, 24.0);
    for _ in 0..batches {
        drop(loader.next().unwrap().unwrap());
    }
    let during = (allocations() - before) as f64;
    let decodes = (loader.decodes() - decoded) as f64;
    let pipeline = during - per_decode * decodes;
    println!(
        "decoder: {per_decode:.1} allocations per image; pipeline: {during} allocations for \
         {batches} batches, {pipeline:.1} beyond the decoder's"
    );
    // What remains is per epoch, not per batch: each epoch boundary computes the next order (3
    // vectors and an Arc, measured: 4 allocations an epoch). The decode counter ticks as a
    // decode starts, and both counters are read while workers run, so up to a batch and one
    // image per worker of decoder allocations may fall on either side of the window. Beyond
    // that, crossbeam-channel now and then builds a fresh 48-byte waiter context (and a 96-byte
    // waiter list) when a blocking send or receive finds its thread's cached one in use:
    // measured 0–14 per 96 batches, never one per batch. One allocation per batch would put the
    // rate at 1.0 or more.
    let per_epoch = epochs * 4.0;
    let slack = per_decode * (8.0 + 2.0);
    let rate = (pipeline - per_epoch - slack).max(0.0) / batches as f64;
    assert!(
        rate < 0.25,
        "{pipeline:.1} allocations in {batches} batches outside the decoder: {rate:.2} a batch \
         beyond the per-epoch order"
    );
}

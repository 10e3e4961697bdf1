//! The loader on its own, with no tensor library: stream training batches from a shard set and
//! report throughput and data stall.
//!
//! ```sh
//! cargo xtask shards synth --out /tmp/synth        # or shards build from an ImageFolder
//! cargo run --release -p redline-loader --example loader -- /tmp/synth/train 64 224
//! ```

use std::sync::Arc;
use std::time::Instant;

use redline_loader::{Config, Loader, Position};
use redline_shard::ShardSet;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first() else {
        eprintln!("usage: loader SHARD_DIR [BATCH] [RES] [BATCHES]");
        std::process::exit(2);
    };
    let number = |i: usize, default: usize| -> Result<usize, Box<dyn std::error::Error>> {
        Ok(args
            .get(i)
            .map(|s| s.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let (batch, res, batches) = (number(1, 64)?, number(2, 224)?, number(3, 20)?);
    let shards = Arc::new(ShardSet::open(dir)?);
    let loader = Loader::new(
        shards.clone(),
        Config::new(batch, res, true),
        Position::default(),
    )?;
    println!(
        "{} samples in {} shards; batch {batch} at {res}px; {} batches an epoch",
        shards.len(),
        shards.shards().len(),
        loader.batches_per_epoch()
    );
    let start = Instant::now();
    let mut images = 0;
    let mut loader = loader;
    for _ in 0..batches {
        let Some(batch) = loader.next() else { break };
        let batch = batch?;
        images += batch.len;
        // A training step would upload `batch.images()` (u8 NHWC) here.
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "{images} images in {seconds:.2} s: {:.0} img/s, data stall {:.2}",
        images as f64 / seconds,
        loader.data_stall()
    );
    Ok(())
}

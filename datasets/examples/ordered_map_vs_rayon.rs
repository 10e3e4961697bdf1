//! The dataset tools' ordered parallel map against rayon on the conversion's own work (read,
//! decode, resize to 128 px, re-encode at q90, consumed in input order), in one run:
//! `cargo run --release -p redline-datasets --example ordered_map_vs_rayon`.
//!
//! Rayon has no ordered, bounded-memory consumer, so it runs in windows (`par_iter` over a chunk,
//! then the chunk is consumed in order; a barrier per window) or collects everything (memory
//! grows with the dataset: not an option for ImageNet). Each runs on uniform images, and with
//! every 25th image 16× as costly — real folders hold a few huge photos among typical ones.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use redline_datasets::generate::{synth_folder, SynthOptions};
use redline_datasets::{all_cores, ordered_map};

fn work(path: &Path, heavy: bool) -> Vec<u8> {
    let decode = || {
        let bytes = std::fs::read(path).expect("readable");
        image::load_from_memory(&bytes).expect("decodable")
    };
    if heavy {
        for _ in 0..15 {
            decode();
        }
    }
    let small = decode()
        .resize(128, 128, image::imageops::FilterType::CatmullRom)
        .to_rgb8();
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
        .encode_image(&small)
        .expect("encodes");
    out
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = SynthOptions {
        classes: 4,
        images: 600,
        ..SynthOptions::default()
    };
    synth_folder(dir.path(), &options).expect("synthetic folder");
    let mut files: Vec<PathBuf> = Vec::new();
    for class in std::fs::read_dir(dir.path().join("train")).expect("train/") {
        for file in std::fs::read_dir(class.expect("entry").path()).expect("class folder") {
            files.push(file.expect("entry").path());
        }
    }
    files.sort();
    let threads = all_cores();
    let window = 4 * threads; // ordered_map's own look-ahead
    let n = files.len() as f64;
    let mut sink = std::io::sink();
    for skew in [false, true] {
        let heavy = |i: usize| skew && i.is_multiple_of(25);
        for round in 0..3 {
            let t = Instant::now();
            ordered_map(
                files.len(),
                threads,
                |i| work(&files[i], heavy(i)),
                |_, b| sink.write_all(&b),
            )
            .expect("sink");
            let ours = n / t.elapsed().as_secs_f64();
            let mut windows = Vec::new();
            for size in [window, 64] {
                let t = Instant::now();
                for (c, chunk) in files.chunks(size).enumerate() {
                    let out: Vec<Vec<u8>> = chunk
                        .par_iter()
                        .enumerate()
                        .map(|(j, p)| work(p, heavy(c * size + j)))
                        .collect();
                    out.iter().for_each(|b| sink.write_all(b).expect("sink"));
                }
                windows.push(n / t.elapsed().as_secs_f64());
            }
            let t = Instant::now();
            let out: Vec<Vec<u8>> = files
                .par_iter()
                .enumerate()
                .map(|(i, p)| work(p, heavy(i)))
                .collect();
            out.iter().for_each(|b| sink.write_all(b).expect("sink"));
            let all = n / t.elapsed().as_secs_f64();
            println!(
                "{} round {round}: ordered_map {ours:.0} img/s | rayon windows of {window}: {:.0}, \
                 of 64: {:.0} | rayon collecting all: {all:.0}  ({} images, {threads} threads)",
                if skew { "skewed " } else { "uniform" },
                windows[0],
                windows[1],
                files.len()
            );
        }
    }
}

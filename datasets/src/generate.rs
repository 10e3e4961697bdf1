//! Writing the synthetic set: as shard sets (the default) or as an ImageFolder tree of JPEGs.

use std::fs;
use std::path::{Path, PathBuf};

use redline_shard::{Encoding, RecordInfo, SetOptions, SetWriter};

use crate::parallel::ordered_map;
use crate::progress::Progress;
use crate::synth::{class_names, encode_jpeg, SynthImage};
use crate::DataError;

/// Parameters of the synthetic set.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthOptions {
    pub classes: u32,
    /// Training images; the validation split gets a fifth as many (at least one per class).
    pub images: u64,
    pub seed: u64,
    pub quality: u8,
    pub shard_bytes: u64,
    pub threads: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            classes: 10,
            images: 2000,
            seed: 0,
            quality: 90,
            shard_bytes: 64 << 20,
            threads: crate::all_cores(),
        }
    }
}

impl SynthOptions {
    /// (split name, split id, image count).
    pub fn splits(&self) -> [(&'static str, u64, u64); 2] {
        let val = (self.images / 5).max(self.classes as u64);
        [("train", 0, self.images), ("val", 1, val)]
    }

    fn image(&self, split: u64, index: u64) -> SynthImage {
        SynthImage {
            seed: self.seed,
            split,
            index,
            class: (index % self.classes as u64) as u32,
            classes: self.classes,
        }
    }

    fn params(&self, split: &str) -> serde_json::Map<String, serde_json::Value> {
        let mut map = serde_json::Map::new();
        map.insert("source".into(), "redline synth".into());
        map.insert("split".into(), split.into());
        map.insert("seed".into(), self.seed.into());
        map.insert("classes".into(), self.classes.into());
        map.insert("jpeg_quality".into(), self.quality.into());
        map
    }

    fn check(&self, out: &Path) -> Result<(), DataError> {
        if self.classes == 0 || self.images == 0 || !(1..=100).contains(&self.quality) {
            return Err(DataError::Invalid {
                path: out.to_path_buf(),
                what: format!(
                    "need at least one class and one image and a JPEG quality in 1..=100 (got {} classes, {} images, quality {})",
                    self.classes, self.images, self.quality
                ),
            });
        }
        Ok(())
    }
}

/// One rendered and encoded image.
struct Encoded {
    jpeg: Vec<u8>,
    width: u32,
    height: u32,
    class: u32,
}

fn render(options: &SynthOptions, split: u64, index: u64) -> Result<Encoded, String> {
    let spec = options.image(split, index);
    let img = spec.render();
    let jpeg = encode_jpeg(&img, options.quality).map_err(|e| e.to_string())?;
    Ok(Encoded {
        jpeg,
        width: img.width(),
        height: img.height(),
        class: spec.class,
    })
}

/// Writes `out/train` and `out/val` shard sets. Returns the set directories.
pub fn synth_shards(out: &Path, options: &SynthOptions) -> Result<Vec<PathBuf>, DataError> {
    options.check(out)?;
    let classes = class_names(options.classes);
    let mut dirs = Vec::new();
    for (name, split, count) in options.splits() {
        let dir = out.join(name);
        let mut set_options = SetOptions::images(name, classes.clone());
        set_options.params = options.params(name);
        set_options.shard_bytes = options.shard_bytes;
        let mut writer = SetWriter::create(&dir, set_options)?;
        let mut progress = Progress::new(format!("synth {name}"), count);
        ordered_map(
            count as usize,
            options.threads,
            |i| render(options, split, i as u64),
            |i, encoded| {
                let e = encoded.map_err(|what| DataError::Invalid {
                    path: dir.clone(),
                    what: format!("image {i}: {what}"),
                })?;
                let info = RecordInfo {
                    label: e.class as i32,
                    width: e.width,
                    height: e.height,
                    encoding: Encoding::Jpeg,
                };
                writer.append(info, &e.jpeg)?;
                progress.inc(1);
                Ok::<_, DataError>(())
            },
        )?;
        progress.finish();
        writer.finish()?;
        dirs.push(dir);
    }
    Ok(dirs)
}

/// Writes the same images as an ImageFolder tree: `out/{train,val}/<class>/<index>.jpg`.
pub fn synth_folder(out: &Path, options: &SynthOptions) -> Result<(), DataError> {
    options.check(out)?;
    let classes = class_names(options.classes);
    for (name, split, count) in options.splits() {
        for class in &classes {
            let dir = out.join(name).join(class);
            fs::create_dir_all(&dir).map_err(|e| DataError::io(&dir, e))?;
        }
        let mut progress = Progress::new(format!("synth {name} (folder)"), count);
        ordered_map(
            count as usize,
            options.threads,
            |i| render(options, split, i as u64),
            |i, encoded| {
                let path = out.join(name);
                let e = encoded.map_err(|what| DataError::Invalid {
                    path: path.clone(),
                    what: format!("image {i}: {what}"),
                })?;
                let file = path
                    .join(&classes[e.class as usize])
                    .join(format!("{i:07}.jpg"));
                fs::write(&file, &e.jpeg).map_err(|err| DataError::io(&file, err))?;
                progress.inc(1);
                Ok::<_, DataError>(())
            },
        )?;
        progress.finish();
    }
    Ok(())
}

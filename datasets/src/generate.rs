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

/// Renders split `split` on every core and hands each encoded image to `sink` in index order.
fn render_split(
    options: &SynthOptions,
    (name, split, count): (&str, u64, u64),
    dir: &Path,
    mut sink: impl FnMut(usize, Encoded) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let mut progress = Progress::new(format!("synth {name}"), count);
    ordered_map(
        count as usize,
        options.threads,
        |i| render(options, split, i as u64),
        |i, encoded| {
            let encoded = encoded.map_err(|what| DataError::Invalid {
                path: dir.to_path_buf(),
                what: format!("image {i}: {what}"),
            })?;
            sink(i, encoded)?;
            progress.inc(1);
            Ok::<_, DataError>(())
        },
    )?;
    progress.finish();
    Ok(())
}

/// Writes `out/train` and `out/val` shard sets. Returns the set directories.
pub fn synth_shards(out: &Path, options: &SynthOptions) -> Result<Vec<PathBuf>, DataError> {
    options.check(out)?;
    let classes = class_names(options.classes);
    let mut dirs = Vec::new();
    for split in options.splits() {
        let name = split.0;
        let dir = out.join(name);
        let mut set_options = SetOptions::images(name, classes.clone());
        set_options.params = options.params(name);
        set_options.shard_bytes = options.shard_bytes;
        let mut writer = SetWriter::create(&dir, set_options)?;
        render_split(options, split, &dir, |_, e| {
            let info = RecordInfo {
                label: e.class as i32,
                width: e.width,
                height: e.height,
                encoding: Encoding::Jpeg,
            };
            Ok(writer.append(info, &e.jpeg)?)
        })?;
        writer.finish()?;
        dirs.push(dir);
    }
    Ok(dirs)
}

/// Writes the same images as an ImageFolder tree: `out/{train,val}/<class>/<index>.jpg`.
pub fn synth_folder(out: &Path, options: &SynthOptions) -> Result<(), DataError> {
    options.check(out)?;
    let classes = class_names(options.classes);
    for split in options.splits() {
        let dir = out.join(split.0);
        for class in &classes {
            let class_dir = dir.join(class);
            fs::create_dir_all(&class_dir).map_err(|e| DataError::io(&class_dir, e))?;
        }
        render_split(options, split, &dir, |i, e| {
            let file = dir
                .join(&classes[e.class as usize])
                .join(format!("{i:07}.jpg"));
            fs::write(&file, &e.jpeg).map_err(|err| DataError::io(&file, err))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_is_identical_whatever_the_thread_count() {
        let manifests: Vec<_> = [1, 3]
            .iter()
            .map(|&threads| {
                let dir = tempfile::tempdir().unwrap();
                let options = SynthOptions {
                    classes: 3,
                    images: 9,
                    seed: 42,
                    threads,
                    ..SynthOptions::default()
                };
                synth_shards(dir.path(), &options).unwrap();
                ["train", "val"].map(|split| {
                    let path = dir.path().join(split).join(redline_shard::MANIFEST_FILE);
                    redline_shard::Manifest::read(&path).unwrap()
                })
            })
            .collect();
        // The manifests hold each shard's table CRC, which covers every record's CRC.
        assert_eq!(manifests[0], manifests[1]);
        assert_eq!(manifests[0][0].records, 9);
    }

    #[test]
    fn nonsense_options_are_refused_with_the_reason() {
        let options = SynthOptions {
            quality: 0,
            ..SynthOptions::default()
        };
        let err = synth_shards(Path::new("/tmp/unused"), &options).unwrap_err();
        assert!(err.to_string().contains("quality 0"), "{err}");
    }
}

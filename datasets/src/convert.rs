//! ImageFolder trees (class = sub-folder, sorted, as torchvision's `ImageFolder`) to shard sets.

use std::fs;
use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use image::{GenericImageView, ImageFormat};
use redline_shard::{Encoding, RecordInfo, SetOptions, SetWriter};

pub use crate::journal::Skipped;
use crate::journal::{self, Journal, JOURNAL_FILE};
use crate::parallel::ordered_map;
use crate::progress::Progress;
use crate::synth::encode_jpeg;
use crate::DataError;

/// How to convert.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertOptions {
    /// Resize so the longer side is at most this and re-encode as JPEG; `None` stores the
    /// original bytes.
    pub max_side: Option<u32>,
    /// JPEG quality when re-encoding.
    pub quality: u8,
    pub shard_bytes: u64,
    /// Stop at the first unusable file instead of skipping it.
    pub strict: bool,
    pub threads: usize,
    /// Labels of a flat validation folder (`val/*.JPEG`): Kaggle's `LOC_val_solution.csv` or
    /// the devkit's ground truth (see [`crate::val_labels`]); found next to the data if `None`.
    pub val_labels: Option<PathBuf>,
    /// The devkit's synsets in its ID order, for its ground truth.
    pub val_synsets: Option<PathBuf>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self {
            max_side: None,
            quality: 90,
            shard_bytes: 256 << 20,
            strict: false,
            threads: crate::all_cores(),
            val_labels: None,
            val_synsets: None,
        }
    }
}

/// One written set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSummary {
    pub name: String,
    pub dir: PathBuf,
    pub images: u64,
    pub bytes: u64,
    pub shards: usize,
}

/// Everything a conversion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertSummary {
    pub classes: Vec<String>,
    pub sets: Vec<SetSummary>,
    pub skipped: Vec<Skipped>,
}

/// Converts `from` into shard sets under `out`. When `from` has both `train/` and `val/`, each
/// becomes a set (`out/train`, `out/val`) and val's labels follow train's class list; otherwise
/// `from` itself becomes the set `out`.
pub fn convert_folder(
    from: &Path,
    out: &Path,
    options: &ConvertOptions,
) -> Result<ConvertSummary, DataError> {
    if !(1..=100).contains(&options.quality) {
        return Err(DataError::Invalid {
            path: from.to_path_buf(),
            what: format!("JPEG quality {} is not in 1..=100", options.quality),
        });
    }
    let (train, val) = (from.join("train"), from.join("val"));
    let splits = if train.is_dir() && val.is_dir() {
        vec![
            ("train", train, out.join("train")),
            ("val", val, out.join("val")),
        ]
    } else {
        vec![("", from.to_path_buf(), out.to_path_buf())]
    };
    let classes = class_dirs(&splits[0].1)?;
    if classes.is_empty() {
        return Err(DataError::Invalid {
            path: splits[0].1.clone(),
            what: "no class sub-folders (expected DIR/<class>/<image>)".into(),
        });
    }
    let mut summary = ConvertSummary {
        classes: classes.clone(),
        sets: Vec::new(),
        skipped: Vec::new(),
    };
    for (name, src, dst) in splits {
        let flat_val = name == "val" && class_dirs(&src)?.is_empty();
        let (files, skipped) = if flat_val {
            list_flat_val(&src, &classes, options)?
        } else {
            list_images(&src, &classes)?
        };
        if let (true, Some(s)) = (options.strict, skipped.first()) {
            return Err(DataError::Strict {
                path: s.path.clone(),
                reason: s.reason.clone(),
            });
        }
        summary.skipped.extend(skipped);
        summary.sets.push(convert_set(
            name,
            &src,
            &dst,
            &classes,
            files,
            options,
            &mut summary.skipped,
        )?);
    }
    Ok(summary)
}

fn convert_set(
    name: &str,
    src: &Path,
    dst: &Path,
    classes: &[String],
    files: Vec<LabelledFile>,
    options: &ConvertOptions,
    skipped: &mut Vec<Skipped>,
) -> Result<SetSummary, DataError> {
    let label = if name.is_empty() { "set" } else { name };
    let mut set_options =
        SetOptions::images(if name.is_empty() { "all" } else { name }, classes.to_vec());
    set_options.shard_bytes = options.shard_bytes;
    let params = &mut set_options.params;
    params.insert("source".into(), "image-folder".into());
    params.insert("from".into(), src.display().to_string().into());
    params.insert("max_side".into(), options.max_side.into());
    params.insert(
        "jpeg_quality".into(),
        options.max_side.map(|_| options.quality).into(),
    );

    fs::create_dir_all(dst).map_err(|e| DataError::io(dst, e))?;
    // Held until this set is done; the OS releases it when the process dies, so a killed build
    // leaves nothing that blocks its restart.
    let _lock = journal::lock(dst)?;
    let fingerprint = journal::fingerprint(&set_options, &files);
    let mut journal = match Journal::find(dst)? {
        Some(found) if found.fingerprint != fingerprint || found.inputs != files.len() as u64 => {
            return Err(DataError::OtherBuild {
                path: dst.join(JOURNAL_FILE),
                what: format!(
                    "this folder holds a build of other inputs or options ({} of {} inputs; \
                     this build is {} of {})",
                    found.fingerprint,
                    found.inputs,
                    fingerprint,
                    files.len()
                ),
            });
        }
        Some(found) if found.next_input > found.inputs || found.images > found.next_input => {
            return Err(DataError::Invalid {
                path: dst.join(JOURNAL_FILE),
                what: format!(
                    "the journal is damaged: {} images and next input {} of {} inputs",
                    found.images, found.next_input, found.inputs
                ),
            });
        }
        Some(found) => found,
        None => {
            let fresh = Journal::start(fingerprint, files.len() as u64);
            fresh.write(dst)?;
            fresh
        }
    };
    if let (true, Some(s)) = (options.strict, journal.skipped.first()) {
        // The earlier, lenient run skipped this file: --strict does not let it pass unnoticed.
        return Err(DataError::Strict {
            path: s.path.clone(),
            reason: format!("{} (skipped by an earlier run of this build)", s.reason),
        });
    }
    if journal.complete {
        eprintln!(
            "{label}: already built in {} ({JOURNAL_FILE}), nothing to do",
            dst.display()
        );
        skipped.extend(journal.skipped.iter().cloned());
        return Ok(SetSummary {
            name: name.into(),
            dir: dst.to_path_buf(),
            images: journal.images,
            bytes: journal.shards.iter().map(|s| s.bytes).sum(),
            shards: journal.shards.len(),
        });
    }
    let start = journal.next_input as usize;
    if start > 0 {
        eprintln!(
            "{label}: resuming after {} finished shard(s), at input {start} of {}",
            journal.shards.len(),
            files.len()
        );
    }
    // With no shard finished this also clears what a build killed before its first one left.
    let mut writer = SetWriter::resume(dst, set_options, &journal.shards)?;
    let mut progress =
        Progress::starting_at(format!("build {label}"), files.len() as u64, start as u64);
    let mut images = journal.images;
    ordered_map(
        files.len() - start,
        options.threads,
        |i| prepare(&files[start + i].0, options),
        |i, prepared| {
            let i = start + i;
            progress.inc(1);
            let (path, label) = &files[i];
            match prepared {
                Ok(p) => {
                    let finished = writer.shards_finished();
                    writer.append(
                        RecordInfo::image(*label, p.width, p.height, &p.bytes),
                        &p.bytes,
                    )?;
                    if writer.shards_finished() > finished {
                        // This record opened a new shard: every input before it is now in a
                        // finished shard or skipped.
                        journal.next_input = i as u64;
                        journal.images = images;
                        journal.shards = writer.shard_entries();
                        journal.write(dst)?;
                    }
                    images += 1;
                    Ok(())
                }
                Err(reason) if options.strict => Err(DataError::Strict {
                    path: path.clone(),
                    reason,
                }),
                Err(reason) => {
                    journal.skipped.push(Skipped {
                        path: path.clone(),
                        reason,
                    });
                    Ok(())
                }
            }
        },
    )?;
    progress.finish();
    let manifest = writer.finish()?;
    journal.next_input = files.len() as u64;
    journal.images = images;
    journal.shards = manifest.shards.clone();
    journal.complete = true;
    journal.write(dst)?;
    skipped.extend(journal.skipped.iter().cloned());
    Ok(SetSummary {
        name: name.into(),
        dir: dst.to_path_buf(),
        images,
        bytes: manifest.bytes,
        shards: manifest.shards.len(),
    })
}

/// A file and the class index it gets.
type LabelledFile = (PathBuf, i32);

/// The bytes to store for one file, or why it cannot be used.
struct Prepared {
    bytes: Vec<u8>,
    width: u32,
    height: u32,
}

fn prepare(path: &Path, options: &ConvertOptions) -> Result<Prepared, String> {
    let bytes = fs::read(path).map_err(|e| format!("unreadable: {e}"))?;
    let format = match Encoding::sniff(&bytes) {
        Encoding::Jpeg => ImageFormat::Jpeg,
        Encoding::Png => ImageFormat::Png,
        Encoding::Other => return Err("not a JPEG or PNG image".into()),
    };
    if format == ImageFormat::Jpeg && !has_end_marker(&bytes) {
        // Lenient decoders fill a cut-off JPEG with grey instead of failing: catch it here.
        return Err("truncated: the JPEG has no end-of-image marker".into());
    }
    // Decode fully even when storing the original bytes: a truncated or corrupt image is caught
    // here, once, instead of in every epoch of training.
    let img = image::load_from_memory_with_format(&bytes, format)
        .map_err(|e| format!("cannot be decoded: {e}"))?;
    let (width, height) = img.dimensions();
    match options.max_side {
        Some(max) if width.max(height) > max => {
            let scale = max as f64 / width.max(height) as f64;
            let w = ((width as f64 * scale).round() as u32).max(1);
            let h = ((height as f64 * scale).round() as u32).max(1);
            let small = img.resize_exact(w, h, FilterType::CatmullRom).to_rgb8();
            let jpeg = encode_jpeg(&small, options.quality).map_err(|e| e.to_string())?;
            Ok(Prepared {
                bytes: jpeg,
                width: w,
                height: h,
            })
        }
        Some(_) => {
            // Already small enough: a JPEG is kept as it is; anything else is re-encoded so a
            // resized set is uniformly JPEG.
            let jpeg = match format {
                ImageFormat::Jpeg => bytes,
                _ => encode_jpeg(&img.to_rgb8(), options.quality).map_err(|e| e.to_string())?,
            };
            Ok(Prepared {
                bytes: jpeg,
                width,
                height,
            })
        }
        None => Ok(Prepared {
            bytes,
            width,
            height,
        }),
    }
}

/// Whether a JPEG's end-of-image marker (FF D9) is near its end. Trailers some cameras append
/// after the image are allowed, up to 64 KiB.
fn has_end_marker(jpeg: &[u8]) -> bool {
    let tail = &jpeg[jpeg.len().saturating_sub(64 << 10)..];
    tail.windows(2).any(|w| w == [0xFF, 0xD9])
}

/// Sorted names of the sub-folders of `dir`.
fn class_dirs(dir: &Path) -> Result<Vec<String>, DataError> {
    let mut classes = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        if entry.path().is_dir() {
            classes.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    classes.sort();
    Ok(classes)
}

/// Every file of a flat validation folder (sorted), labelled through its labels file by the
/// wnid's index in `classes`; files without a label or of an unknown class are skipped with
/// the reason, and a folder where nothing gets a label is an error.
fn list_flat_val(
    dir: &Path,
    classes: &[String],
    options: &ConvertOptions,
) -> Result<(Vec<LabelledFile>, Vec<Skipped>), DataError> {
    let (wnids, source) = crate::val_labels::find(
        dir,
        options.val_labels.as_deref(),
        options.val_synsets.as_deref(),
    )?;
    let mut all = Vec::new();
    walk(dir, &mut |file| all.push(file))?;
    let (mut files, mut skipped) = (Vec::new(), Vec::new());
    for path in all {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let reason = match wnids.get(&stem) {
            None => format!("no label in {}", source.display()),
            Some(wnid) => match classes.iter().position(|c| c == wnid) {
                Some(label) => {
                    files.push((path, label as i32));
                    continue;
                }
                None => format!("its class {wnid} is not among the training set's classes"),
            },
        };
        skipped.push(Skipped { path, reason });
    }
    if files.is_empty() {
        return Err(DataError::Invalid {
            path: dir.to_path_buf(),
            what: format!("no image here has a label in {}", source.display()),
        });
    }
    Ok((files, skipped))
}

/// Every file under `dir/<class>/` (recursively, sorted), labelled by `classes`; files elsewhere
/// and classes unknown to `classes` are skipped with the reason.
fn list_images(
    dir: &Path,
    classes: &[String],
) -> Result<(Vec<LabelledFile>, Vec<Skipped>), DataError> {
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| DataError::io(dir, e))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !path.is_dir() {
            skipped.push(Skipped {
                path,
                reason: "not inside a class folder".into(),
            });
            continue;
        }
        let Some(label) = classes.iter().position(|c| *c == name) else {
            skipped.push(Skipped {
                path,
                reason: "class is not in the training set's class list".into(),
            });
            continue;
        };
        walk(&path, &mut |file| files.push((file, label as i32)))?;
    }
    Ok((files, skipped))
}

fn walk(dir: &Path, found: &mut dyn FnMut(PathBuf)) -> Result<(), DataError> {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(|e| DataError::io(dir, e))?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, found)?;
        } else {
            found(path);
        }
    }
    Ok(())
}

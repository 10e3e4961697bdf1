//! Labels for ImageNet's validation set as it is usually on disk: flat (`val/*.JPEG`) with a
//! labels file beside it, rather than in class folders.
//!
//! - Kaggle's release: `LOC_val_solution.csv`, `ImageId,PredictionString` where the prediction
//!   string starts with the image's wnid (`ILSVRC2012_val_00000001,n01751748 …`).
//! - The ILSVRC2012 devkit: `ILSVRC2012_validation_ground_truth.txt`, one ILSVRC2012_ID per
//!   line for `ILSVRC2012_val_00000001`, `…02`, …. Those IDs number the synsets in the devkit's
//!   `meta.mat` order, which is *not* sorted-wnid order (ID 1 is n02119789, kit fox), so they
//!   need a synset list in that order (`--val-synsets FILE`: one wnid per line, first token).
//!   `LOC_synset_mapping.txt` is sorted and does not fit those IDs; it is refused by name.
//!
//! Either way a label is the wnid's index among the training set's sorted class folders, as
//! torchvision's `ImageFolder` numbers them, so indices match PyTorch's.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::DataError;

/// Kaggle's validation labels.
pub const KAGGLE_CSV: &str = "LOC_val_solution.csv";
/// The devkit's validation labels.
pub const DEVKIT_TRUTH: &str = "ILSVRC2012_validation_ground_truth.txt";
/// Kaggle's sorted synset list (not the devkit's ID order).
pub const KAGGLE_SYNSETS: &str = "LOC_synset_mapping.txt";

/// Image stem (file name without extension) → wnid.
pub type WnidByImage = HashMap<String, String>;

fn invalid(path: &Path, what: String) -> DataError {
    DataError::Invalid {
        path: path.to_path_buf(),
        what,
    }
}

/// Reads Kaggle's `LOC_val_solution.csv`.
pub fn read_kaggle_csv(path: &Path) -> Result<WnidByImage, DataError> {
    let text = fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
    let mut out = WnidByImage::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("ImageId")) {
            continue;
        }
        let (image, prediction) = line.split_once(',').ok_or_else(|| {
            invalid(
                path,
                format!("line {}: expected ImageId,PredictionString", i + 1),
            )
        })?;
        let wnid = prediction
            .split_whitespace()
            .next()
            .filter(|w| w.starts_with('n'))
            .ok_or_else(|| invalid(path, format!("line {}: no wnid in {prediction:?}", i + 1)))?;
        out.insert(image.trim().to_string(), wnid.to_string());
    }
    Ok(out)
}

/// Reads the devkit's ground truth with `synsets` (wnids in the devkit's ID order).
pub fn read_devkit(truth: &Path, synsets: &Path) -> Result<WnidByImage, DataError> {
    if synsets.file_name().is_some_and(|n| n == KAGGLE_SYNSETS) {
        return Err(invalid(
            synsets,
            format!(
                "{KAGGLE_SYNSETS} lists the synsets sorted by wnid, but {DEVKIT_TRUTH}'s IDs follow the devkit's meta.mat order (ID 1 is n02119789); give the synsets in that order, or use Kaggle's {KAGGLE_CSV}"
            ),
        ));
    }
    let list = fs::read_to_string(synsets).map_err(|e| DataError::io(synsets, e))?;
    let wnids: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let text = fs::read_to_string(truth).map_err(|e| DataError::io(truth, e))?;
    let mut out = WnidByImage::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let id: usize = line
            .trim()
            .parse()
            .map_err(|_| invalid(truth, format!("line {}: {line:?} is not an ID", i + 1)))?;
        let wnid = id
            .checked_sub(1)
            .and_then(|k| wnids.get(k))
            .ok_or_else(|| {
                invalid(
                    truth,
                    format!(
                        "line {}: ID {id} is outside the {} synsets of {}",
                        i + 1,
                        wnids.len(),
                        synsets.display()
                    ),
                )
            })?;
        out.insert(format!("ILSVRC2012_val_{:08}", i + 1), wnid.to_string());
    }
    Ok(out)
}

/// `dir` and up to four folders above it (Kaggle keeps the CSV beside `ILSVRC/`, three levels
/// above `Data/CLS-LOC/val`).
fn nearby(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors().take(5).map(Path::to_path_buf).collect()
}

/// The labels of a flat validation folder `val`: from `labels` (a Kaggle CSV, or the devkit's
/// ground truth with `synsets`) when given, else from a Kaggle CSV found next to the data.
pub fn find(
    val: &Path,
    labels: Option<&Path>,
    synsets: Option<&Path>,
) -> Result<(WnidByImage, PathBuf), DataError> {
    let read = |path: &Path| -> Result<WnidByImage, DataError> {
        if path.extension().is_some_and(|e| e == "csv") {
            return read_kaggle_csv(path);
        }
        let synsets = synsets.ok_or_else(|| {
            invalid(
                path,
                "the devkit's ground truth needs --val-synsets FILE (wnids in the devkit's ID order)".into(),
            )
        })?;
        read_devkit(path, synsets)
    };
    if let Some(path) = labels {
        return Ok((read(path)?, path.to_path_buf()));
    }
    let looked: Vec<PathBuf> = nearby(val).iter().map(|d| d.join(KAGGLE_CSV)).collect();
    if let Some(csv) = looked.iter().find(|p| p.is_file()) {
        return Ok((read_kaggle_csv(csv)?, csv.clone()));
    }
    let devkit = nearby(val)
        .iter()
        .map(|d| d.join(DEVKIT_TRUTH))
        .find(|p| p.is_file());
    if let (Some(truth), Some(_)) = (&devkit, synsets) {
        return Ok((read(truth)?, truth.clone()));
    }
    let hint = match devkit {
        Some(truth) => format!(
            "; found {} — give --val-synsets FILE (wnids in the devkit's ID order) to use it",
            truth.display()
        ),
        None => String::new(),
    };
    Err(invalid(
        val,
        format!(
            "a flat validation folder needs labels: --val-labels FILE, or {KAGGLE_CSV} in one of {}{hint}",
            looked
                .iter()
                .filter_map(|p| p.parent())
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("redline-val-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn kaggle_csv_gives_each_image_its_first_wnid() {
        let d = dir("kaggle");
        let csv = d.join(KAGGLE_CSV);
        fs::write(
            &csv,
            "ImageId,PredictionString\nILSVRC2012_val_00000001,n01751748 10 20 30 40 n01751748 1 2 3 4 \nILSVRC2012_val_00000002,n09193705 1 2 3 4\n",
        )
        .unwrap();
        let got = read_kaggle_csv(&csv).unwrap();
        assert_eq!(got["ILSVRC2012_val_00000001"], "n01751748");
        assert_eq!(got["ILSVRC2012_val_00000002"], "n09193705");
        fs::write(&csv, "ImageId,PredictionString\nbroken line\n").unwrap();
        let err = read_kaggle_csv(&csv).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains(KAGGLE_CSV), "{err}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn devkit_ids_follow_the_given_synset_order_and_the_sorted_list_is_refused() {
        let d = dir("devkit");
        let truth = d.join(DEVKIT_TRUTH);
        fs::write(&truth, "2\n1\n3\n").unwrap();
        // The devkit's order (not sorted): ID 1 kit fox, 2 sea snake, 3 tench.
        let synsets = d.join("devkit_synsets.txt");
        fs::write(
            &synsets,
            "n02119789 kit fox\nn01751748 sea snake\nn01440764 tench\n",
        )
        .unwrap();
        let got = read_devkit(&truth, &synsets).unwrap();
        assert_eq!(got["ILSVRC2012_val_00000001"], "n01751748");
        assert_eq!(got["ILSVRC2012_val_00000002"], "n02119789");
        assert_eq!(got["ILSVRC2012_val_00000003"], "n01440764");
        let sorted = d.join(KAGGLE_SYNSETS);
        fs::write(&sorted, "n01440764 tench\n").unwrap();
        let err = read_devkit(&truth, &sorted).unwrap_err().to_string();
        assert!(err.contains("meta.mat order"), "{err}");
        fs::write(&truth, "2\n9\n").unwrap();
        let err = read_devkit(&truth, &synsets).unwrap_err().to_string();
        assert!(
            err.contains("line 2: ID 9 is outside the 3 synsets"),
            "{err}"
        );
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn without_a_labels_file_the_error_says_where_it_looked_and_what_to_give() {
        let d = dir("none");
        let val = d.join("val");
        fs::create_dir_all(&val).unwrap();
        let err = find(&val, None, None).unwrap_err().to_string();
        assert!(
            err.contains("--val-labels") && err.contains(KAGGLE_CSV),
            "{err}"
        );
        fs::write(d.join(DEVKIT_TRUTH), "1\n").unwrap();
        let err = find(&val, None, None).unwrap_err().to_string();
        assert!(err.contains("--val-synsets"), "{err}");
        let _ = fs::remove_dir_all(&d);
    }
}

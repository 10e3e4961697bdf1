//! `--data PATH` for the commands that train: shards as they are, or an ImageFolder tree
//! converted to shards once (cached, keyed by the tree's path; an interrupted conversion resumes).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::run::{self, Profile};

/// `redline-data build`'s exit code when its output folder holds another build.
const OTHER_BUILD: i32 = 3;

/// `path` if it is a shard set or holds `train/` as one; else `path` as an ImageFolder tree
/// (`<class>/<image>`, or `train/` + `val/` of those) converted under `work` on first use.
/// Returns the set, or the folder holding `train/` (and `val/`).
pub fn shards(path: &Path, work: &Path) -> Result<PathBuf> {
    let is_set = |p: &Path| p.join("manifest.json").exists();
    if is_set(path) || is_set(&path.join("train")) {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        bail!("--data {}: not a directory", path.display());
    }
    let abs = fs::canonicalize(path).with_context(|| format!("--data {}", path.display()))?;
    let key: String = abs
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let out = work.join(format!("folder{key}"));
    // Written once the build exits cleanly. Until then the build is simply run again: it resumes
    // from its journals (build.json), so an interrupted conversion is not started over.
    let converted = out.join("converted");
    let journal = |p: &Path| p.join("build.json").exists();
    let journals = journal(&out) || journal(&out.join("train"));
    if !converted.exists() && !journals && (is_set(&out) || is_set(&out.join("train"))) {
        // A complete cache written before builds kept journals: still good.
        fs::write(&converted, b"").with_context(|| format!("writing {}", converted.display()))?;
    }
    if !converted.exists() {
        eprintln!(
            "converting the ImageFolder tree {} to shards once (resumed if interrupted)",
            abs.display()
        );
        let build = || {
            let mut build = run::data_tool_command(Profile::Release);
            build
                .args(["build", "--from-folder"])
                .arg(&abs)
                .arg("--out")
                .arg(&out);
            build
        };
        let status = run::status(&mut build())?;
        if status.code() == Some(OTHER_BUILD) {
            // The tree changed since an interrupted conversion: the cache is ours to redo.
            eprintln!("the tree changed since the cached conversion began: converting afresh");
            fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
            run::check(&mut build())?;
        } else if !status.success() {
            bail!("`{}` failed ({status})", run::describe(&build()));
        }
        fs::write(&converted, b"").with_context(|| format!("writing {}", converted.display()))?;
    }
    if !is_set(&out) && !is_set(&out.join("train")) {
        bail!("--data {}: no shard set after conversion", path.display());
    }
    Ok(out)
}

//! cuDNN's measured algorithm choices, kept on disk. cuDNN's Find times every algorithm of a
//! convolution on the device; the fastest acceptable one is remembered per plan in a small text
//! file per (GPU, cuDNN version), so a later run — or another rank on the same machine — skips
//! the search (PyTorch's `cudnn.benchmark` searches again in every process).
//!
//! The file is one line per plan: the plan's key, the algorithm and math type by cuDNN's names,
//! the workspace in bytes and the measured milliseconds, separated by tabs; a later line for a
//! key replaces an earlier one, and a key with `-` alone drops it (cuDNN rejected that choice
//! when it ran: measure again). Lines are appended with one write each, so ranks sharing the
//! file interleave whole lines; a line that does not read (a torn write, an edit) is skipped
//! and counted, and that plan is measured again. The cache is an optimisation only: a file that
//! cannot be read or written costs a search.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::convolution::{ConvPlan, TensorDesc};

/// The first line of a cache file; a file that starts otherwise is another format and is left
/// alone (nothing read from it, nothing written to it).
pub const HEADER: &str = "# redline cuDNN algorithm choices v1";

/// One plan's measured choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// cuDNN's name of the algorithm (its enum variant in the plan's direction).
    pub algorithm: String,
    /// cuDNN's name of the math type the measurement ran with.
    pub math: String,
    pub workspace: usize,
    pub millis: f32,
}

/// The plan's key in the file: everything that decides which algorithm is fastest and allowed.
pub fn key(plan: &ConvPlan, deterministic: bool) -> String {
    let t = |d: &TensorDesc| format!("{:?}/{:?}", d.dims, d.strides);
    format!(
        "{} {:?} x={} w={:?}/{:?} y={} pad={:?} stride={:?} dilation={:?} groups={}{}{}",
        plan.dtype,
        plan.direction,
        t(&plan.x),
        plan.w.dims,
        plan.w.format,
        t(&plan.y),
        plan.padding,
        plan.stride,
        plan.dilation,
        plan.groups,
        if plan.aligned { "" } else { " unaligned" },
        if deterministic { " deterministic" } else { "" },
    )
    .replace(' ', "")
}

/// The cache file for one device (its name and architecture) and one cuDNN version, under the
/// CUDA cache root ([`crate::compile::cache_root`]).
pub fn file_for(root: &Path, device: &str, arch: &str, cudnn_version: &str) -> PathBuf {
    let name: String = device
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    root.join(format!("cudnn-{cudnn_version}"))
        .join(format!("{name}-{arch}.algos"))
}

/// The choices read from one file, and the ones measured since (appended to it).
pub struct AlgorithmCache {
    path: Option<PathBuf>,
    entries: Mutex<HashMap<String, Choice>>,
    /// Lines of the file that did not read.
    skipped: usize,
    /// Why the file is not written (an unreadable header, a failed write), if it is not.
    read_only: Mutex<Option<String>>,
}

impl AlgorithmCache {
    /// The choices in `path` (none if it does not exist yet); `None` keeps them in memory only.
    pub fn open(path: Option<PathBuf>) -> Self {
        let mut entries = HashMap::new();
        let mut skipped = 0;
        let mut read_only = None;
        if let Some(p) = &path {
            match std::fs::read_to_string(p) {
                Ok(text) if !text.is_empty() && !text.starts_with(HEADER) => {
                    read_only = Some(format!("{} is not a {HEADER:?} file", p.display()));
                }
                Ok(text) => {
                    for line in text.lines().filter(|l| !l.starts_with('#')) {
                        match parse(line) {
                            Some((k, Some(c))) => {
                                entries.insert(k, c);
                            }
                            Some((k, None)) => {
                                entries.remove(&k);
                            }
                            None => skipped += 1,
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => read_only = Some(format!("reading {}: {e}", p.display())),
            }
        }
        Self {
            path,
            entries: Mutex::new(entries),
            skipped,
            read_only: Mutex::new(read_only),
        }
    }

    pub fn get(&self, key: &str) -> Option<Choice> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.get(key).cloned()
    }

    /// Remembers `choice` for `key` and appends it to the file (a failed write is kept for
    /// [`AlgorithmCache::describe`] and stops later writes; the choice still holds in memory).
    pub fn insert(&self, key: String, choice: Choice) {
        let line = format!(
            "{key}\t{}\t{}\t{}\t{}\n",
            choice.algorithm, choice.math, choice.workspace, choice.millis
        );
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, choice);
        self.append(&line);
    }

    /// Drops the choice for `key`, here and in the file (a line with `-`): cuDNN rejected it
    /// when it ran, so the next run measures the plan again.
    pub fn forget(&self, key: String) {
        let line = format!("{key}\t-\n");
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        self.append(&line);
    }

    /// Appends `line` to the file, unless it is not written (see [`AlgorithmCache::describe`]).
    fn append(&self, line: &str) {
        let Some(path) = &self.path else { return };
        let mut read_only = self.read_only.lock().unwrap_or_else(|p| p.into_inner());
        if read_only.is_none() {
            if let Err(e) = append(path, line) {
                *read_only = Some(format!("writing {}: {e}", path.display()));
            }
        }
    }

    /// How many choices it holds.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One line for the device report: where the choices live, how many, and what went wrong.
    pub fn describe(&self) -> String {
        let mut out = match &self.path {
            Some(p) => format!("{} measured choices in {}", self.len(), p.display()),
            None => format!(
                "{} measured choices in memory (no cache folder)",
                self.len()
            ),
        };
        if self.skipped > 0 {
            out += &format!(", {} unreadable lines skipped", self.skipped);
        }
        if let Some(why) = &*self.read_only.lock().unwrap_or_else(|p| p.into_inner()) {
            out += &format!(", not saved: {why}");
        }
        out
    }
}

/// A line's key and choice, `None` for a dropped key; `None` altogether if it does not read.
fn parse(line: &str) -> Option<(String, Option<Choice>)> {
    let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic());
    if let Some(key) = line.strip_suffix("\t-") {
        return plain(key).then(|| (key.into(), None));
    }
    let mut fields = line.split('\t');
    let (key, algorithm, math) = (fields.next()?, fields.next()?, fields.next()?);
    let workspace = fields.next()?.parse().ok()?;
    let millis: f32 = fields.next()?.parse().ok()?;
    if fields.next().is_some() || !plain(key) || !plain(algorithm) || !plain(math) {
        return None;
    }
    if !millis.is_finite() || millis < 0.0 {
        return None;
    }
    let choice = Choice {
        algorithm: algorithm.into(),
        math: math.into(),
        workspace,
        millis,
    };
    Some((key.into(), Some(choice)))
}

/// Appends `line` in one write, writing the header first into a new file.
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let text = match file.metadata()?.len() {
        0 => format!("{HEADER}\n{line}"),
        _ => line.to_string(),
    };
    file.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convolution::{Direction, FilterDesc, FilterFormat};
    use redline_tensor::DType;

    fn plan(direction: Direction) -> ConvPlan {
        let nhwc = |c: i32, h: i32| TensorDesc {
            dims: [8, c, h, h],
            strides: [h * h * c, 1, h * c, c],
        };
        ConvPlan {
            dtype: DType::BF16,
            direction,
            x: nhwc(64, 56),
            w: FilterDesc {
                dims: [64, 64, 3, 3],
                format: FilterFormat::Nhwc,
            },
            y: nhwc(64, 56),
            padding: [1, 1],
            stride: [1, 1],
            dilation: [1, 1],
            groups: 1,
            aligned: true,
        }
    }

    fn choice(algorithm: &str, millis: f32) -> Choice {
        Choice {
            algorithm: algorithm.into(),
            math: "CUDNN_TENSOR_OP_MATH".into(),
            workspace: 1 << 20,
            millis,
        }
    }

    #[test]
    fn keys_tell_apart_everything_that_decides_the_choice() {
        let base = plan(Direction::Forward);
        let k = key(&base, false);
        assert!(!k.contains(char::is_whitespace), "{k}");
        let mut others = vec![key(&base, true), key(&plan(Direction::WeightGrad), false)];
        let changes: [fn(&mut ConvPlan); 7] = [
            |p| p.dtype = DType::F16,
            |p| p.x.strides = [200704, 3136, 56, 1],
            |p| p.w.format = FilterFormat::Nchw,
            |p| p.padding = [0, 0],
            |p| p.stride = [2, 2],
            |p| p.groups = 2,
            |p| p.aligned = false,
        ];
        for change in changes {
            let mut p = base;
            change(&mut p);
            others.push(key(&p, false));
        }
        others.push(k.clone());
        let distinct: std::collections::HashSet<_> = others.iter().collect();
        assert_eq!(distinct.len(), others.len(), "{others:#?}");
    }

    #[test]
    fn choices_survive_a_reopen_and_ranks_appending_to_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = file_for(dir.path(), "NVIDIA H200 (x)", "sm_90", "9.10.2");
        assert!(path.ends_with("cudnn-9.10.2/NVIDIA_H200__x_-sm_90.algos"));
        let (a, b) = (
            AlgorithmCache::open(Some(path.clone())),
            AlgorithmCache::open(Some(path.clone())),
        );
        a.insert(
            "fwd".into(),
            choice("CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM", 0.5),
        );
        b.insert(
            "bwd".into(),
            choice("CUDNN_CONVOLUTION_BWD_DATA_ALGO_1", 1.25),
        );
        let reopened = AlgorithmCache::open(Some(path.clone()));
        assert_eq!(reopened.len(), 2, "{}", reopened.describe());
        assert_eq!(
            reopened.get("bwd"),
            Some(choice("CUDNN_CONVOLUTION_BWD_DATA_ALGO_1", 1.25))
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches(HEADER).count(), 1, "{text}");
        assert!(reopened.describe().starts_with("2 measured choices in "));
    }

    #[test]
    fn unreadable_lines_are_skipped_and_counted_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.algos");
        let good = "k1\tALGO\tMATH\t0\t0.25";
        let torn = "k2\tALGO\tMA";
        let bad = [
            "k3\tALGO\tMATH\tlots\t1",
            "k4\tALGO\tMATH\t0\tNaN",
            "k5\tA\tM\t0\t1\textra",
        ];
        let text = [HEADER, good, torn, bad[0], bad[1], bad[2], ""].join("\n");
        std::fs::write(&path, text).unwrap();
        let cache = AlgorithmCache::open(Some(path.clone()));
        assert_eq!(cache.len(), 1);
        assert!(cache.get("k1").is_some() && cache.get("k2").is_none());
        assert!(
            cache.describe().contains("4 unreadable lines skipped"),
            "{}",
            cache.describe()
        );
        // A plan measured again is appended and read back next time.
        cache.insert("k2".into(), choice("ALGO", 2.0));
        assert_eq!(AlgorithmCache::open(Some(path)).len(), 2);
    }

    #[test]
    fn a_forgotten_choice_is_gone_after_a_reopen_until_measured_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.algos");
        let cache = AlgorithmCache::open(Some(path.clone()));
        cache.insert("a".into(), choice("FFT", 0.5));
        cache.insert("b".into(), choice("GEMM", 0.7));
        cache.forget("a".into());
        assert!(cache.get("a").is_none());
        let reopened = AlgorithmCache::open(Some(path.clone()));
        assert!(reopened.get("a").is_none());
        assert_eq!(reopened.get("b"), Some(choice("GEMM", 0.7)));
        assert!(
            !reopened.describe().contains("unreadable"),
            "{}",
            reopened.describe()
        );
        // Measured again: the later line holds.
        reopened.insert("a".into(), choice("IMPLICIT_GEMM", 0.6));
        let again = AlgorithmCache::open(Some(path));
        assert_eq!(again.get("a"), Some(choice("IMPLICIT_GEMM", 0.6)));
        assert_eq!(again.len(), 2);
    }

    #[test]
    fn a_file_of_another_format_is_neither_read_nor_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.algos");
        std::fs::write(&path, "something else\tALGO\tMATH\t0\t1\n").unwrap();
        let cache = AlgorithmCache::open(Some(path.clone()));
        assert!(cache.is_empty());
        cache.insert("k".into(), choice("ALGO", 1.0));
        assert_eq!(cache.get("k"), Some(choice("ALGO", 1.0)), "kept in memory");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "something else\tALGO\tMATH\t0\t1\n"
        );
        assert!(
            cache.describe().contains("not saved"),
            "{}",
            cache.describe()
        );
    }

    #[test]
    fn a_cache_that_cannot_be_written_still_answers_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the cache's folder should be.
        let blocker = dir.path().join("cudnn-9");
        std::fs::write(&blocker, "").unwrap();
        let cache = AlgorithmCache::open(Some(blocker.join("gpu.algos")));
        cache.insert("k".into(), choice("ALGO", 1.0));
        assert!(cache.get("k").is_some());
        let said = cache.describe();
        assert!(
            said.contains("not saved: ") && said.contains("cudnn-9"),
            "{said}"
        );
    }
}

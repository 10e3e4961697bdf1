//! Finding NVIDIA's libraries: the one place that knows where they live.
//!
//! Each library is looked up by its exact versioned file name (`libnvrtc.so.13` for a CUDA 13
//! build) in a fixed order of folders, loaded from the absolute path found, and reported (path,
//! version). A library of another major version is an error that says so, never a silent mix —
//! cudarc's own lookup would accept `.so.12` under a CUDA 13 build. Folders searched, in order:
//! 1. `REDLINE_CUDA_LIB_DIR` (colon-separated),
//! 2. `LD_LIBRARY_PATH`,
//! 3. `CUDA_PATH` / `CUDA_HOME` (`lib64`, `lib`), `/usr/local/cuda/lib64`,
//! 4. NVIDIA's Python wheels: `nvidia/*/lib` under the site-packages of `VIRTUAL_ENV`,
//!    `CONDA_PREFIX` and `python3` (where most machines with PyTorch keep cuBLAS, cuDNN, NVRTC),
//! 5. the system's library folders (and `/usr/local/nvidia/lib64`, where NVIDIA's container
//!    runtime mounts the driver); for the driver alone, then, wherever the dynamic linker
//!    finds `libcuda.so.1` (its cache, `/etc/ld.so.conf`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The CUDA major version this build's bindings are for.
pub const CUDA_MAJOR: u32 = if cfg!(feature = "cuda-13000") { 13 } else { 12 };

/// Why a library could not be had: an ordinary answer, printed as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LibError {
    NotFound {
        file: String,
        looked_in: Vec<PathBuf>,
        /// Files of other major versions that were found instead.
        other_versions: Vec<PathBuf>,
    },
    Load {
        path: PathBuf,
        why: String,
    },
}

impl std::fmt::Display for LibError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LibError::NotFound {
                file,
                looked_in,
                other_versions,
            } => {
                write!(f, "library {file} not found (looked in ")?;
                let dirs: Vec<String> = looked_in.iter().map(|d| d.display().to_string()).collect();
                write!(f, "{})", dirs.join(", "))?;
                if !other_versions.is_empty() {
                    let found: Vec<String> = other_versions
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect();
                    write!(
                        f,
                        "; found another major version, which this CUDA {CUDA_MAJOR} build does not use: {}",
                        found.join(", ")
                    )?;
                }
                Ok(())
            }
            LibError::Load { path, why } => write!(f, "cannot load {}: {why}", path.display()),
        }
    }
}

impl std::error::Error for LibError {}

/// `python3`'s site-packages folders (asked once; empty without python3).
fn python_site_packages() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let script = "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]: print(p)";
        Command::new("python3")
            .args(["-c", script])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// `nvidia/*/<leaf>` under a site-packages folder (the wheels' layout: `nvidia/cu13/lib`,
/// `nvidia/cublas/lib`, `nvidia/cudnn/lib`, …).
fn wheel_dirs(site: &Path, leaf: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(site.join("nvidia"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(leaf))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

fn env_dirs(var: &str) -> Vec<PathBuf> {
    std::env::var_os(var)
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Every folder searched for a library, in order, without repeats.
pub fn search_dirs() -> Vec<PathBuf> {
    search_dirs_for("lib")
}

/// The same order for NVIDIA's headers (`include` beside each `lib`).
pub fn include_dirs() -> Vec<PathBuf> {
    search_dirs_for("include")
}

fn search_dirs_for(leaf: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if leaf == "lib" {
        dirs.extend(env_dirs("REDLINE_CUDA_LIB_DIR"));
        dirs.extend(env_dirs("LD_LIBRARY_PATH"));
    } else {
        dirs.extend(env_dirs("REDLINE_CUDA_INCLUDE_DIR"));
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            if leaf == "lib" {
                dirs.push(root.join("lib64"));
            }
            dirs.push(root.join(leaf));
        }
    }
    dirs.push(PathBuf::from(if leaf == "lib" {
        "/usr/local/cuda/lib64"
    } else {
        "/usr/local/cuda/include"
    }));
    let mut sites: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(root) = std::env::var_os(var) {
            let lib = PathBuf::from(root).join("lib");
            for entry in std::fs::read_dir(&lib).into_iter().flatten().flatten() {
                sites.push(entry.path().join("site-packages"));
            }
        }
    }
    sites.extend(python_site_packages().iter().cloned());
    for site in &sites {
        dirs.extend(wheel_dirs(site, leaf));
    }
    if leaf == "lib" {
        for d in [
            // Where NVIDIA's container runtime mounts the driver.
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
        ] {
            dirs.push(PathBuf::from(d));
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// The first `file` (an exact file name) in `dirs`; other major versions of it are reported.
pub fn find_in(file: &str, dirs: &[PathBuf]) -> Result<PathBuf, LibError> {
    if let Some(found) = dirs.iter().map(|d| d.join(file)).find(|p| p.is_file()) {
        return Ok(found);
    }
    // `libnvrtc.so.13` → look for `libnvrtc.so.<anything>` to say what was there instead.
    let stem = file.rsplit_once(".so.").map_or(file, |(s, _)| s);
    let prefix = format!("{stem}.so.");
    let mut other_versions: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n != file)
        })
        .collect();
    other_versions.sort();
    Err(LibError::NotFound {
        file: file.into(),
        looked_in: dirs.to_vec(),
        other_versions,
    })
}

/// `find_in` over [`search_dirs`].
pub fn find(file: &str) -> Result<PathBuf, LibError> {
    find_in(file, &search_dirs())
}

/// The first folder holding header `file` (e.g. `cuda_fp16.h`), for NVRTC at run time.
pub fn find_include(file: &str) -> Result<PathBuf, LibError> {
    let dirs = include_dirs();
    dirs.iter()
        .find(|d| d.join(file).is_file())
        .cloned()
        .ok_or_else(|| LibError::NotFound {
            file: file.into(),
            looked_in: dirs,
            other_versions: Vec::new(),
        })
}

/// Loads `path` with RTLD_GLOBAL, so a later request for its SONAME (by cudarc, or by NVRTC for
/// its builtins) gets this very file.
pub fn load_global(path: &Path) -> Result<libloading::Library, LibError> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: NVIDIA's libraries run no initialisers that depend on us.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| LibError::Load {
            path: path.into(),
            why: e.to_string(),
        })
}

/// Loads `soname` the way the dynamic linker finds it (its cache from `ldconfig`, the folders
/// `/etc/ld.so.conf` names — where containers often mount the driver, e.g.
/// `/usr/local/nvidia/lib64`), with RTLD_GLOBAL, and says which file that was: the last
/// resort after the folders above, for the driver library only.
pub fn load_by_soname(soname: &str) -> Result<(PathBuf, libloading::Library), LibError> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let prefix = soname.split(".so").next().unwrap_or(soname).to_string() + ".so";
    let before = mapped_files(&prefix);
    // SAFETY: as `load_global`.
    let lib = unsafe { Library::open(Some(soname), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| LibError::Load {
            path: soname.into(),
            why: e.to_string(),
        })?;
    let after = mapped_files(&prefix);
    let path = after
        .iter()
        .find(|p| !before.contains(p))
        .or(after.first())
        .cloned()
        .unwrap_or_else(|| PathBuf::from(soname));
    Ok((path, lib))
}

/// A library the backend loaded: where from, and its version as the library reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibReport {
    pub path: PathBuf,
    pub version: String,
}

/// Finds `file` (exact name) and loads it for the process with RTLD_GLOBAL, so cudarc's later
/// request for its SONAME returns this very file; kept loaded for the process's life.
pub fn load_for_cudarc(file: &str) -> Result<LibReport, LibError> {
    let path = find(file)?;
    load_path_for_cudarc(&path)?;
    Ok(LibReport {
        path,
        version: String::new(),
    })
}

/// [`load_for_cudarc`] for a file already chosen.
pub fn load_path_for_cudarc(path: &Path) -> Result<(), LibError> {
    static KEPT: std::sync::Mutex<Vec<libloading::Library>> = std::sync::Mutex::new(Vec::new());
    let lib = load_global(path)?;
    KEPT.lock().unwrap_or_else(|p| p.into_inner()).push(lib);
    Ok(())
}

/// Runs a cudarc call that may panic (a missing library or symbol) and turns the panic into
/// an error naming `what`.
pub fn catch_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic inside cudarc".into());
        format!("{what}: {why}")
    })
}

/// The files mapped into this process whose name starts with `prefix` (from /proc/self/maps).
pub fn mapped_files(prefix: &str) -> Vec<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<PathBuf> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(PathBuf::from)
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    files.sort();
    files.dedup();
    files
}

/// An error unless the only mapped file named `prefix*` is `chosen`: cudarc's own lookup tries
/// the unversioned name first and could have mapped a second, different copy.
pub fn check_single_copy(chosen: &Path, prefix: &str) -> Result<(), String> {
    let chosen = chosen
        .canonicalize()
        .unwrap_or_else(|_| chosen.to_path_buf());
    let others: Vec<String> = mapped_files(prefix)
        .into_iter()
        .filter(|p| p.canonicalize().unwrap_or_else(|_| p.clone()) != chosen)
        .map(|p| p.display().to_string())
        .collect();
    if others.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} was loaded, but so were {} (remove the stray copy from the library path)",
            chosen.display(),
            others.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_the_folders_and_the_other_versions_found() {
        let dir = std::env::temp_dir().join(format!("redline-libs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnvrtc.so.12"), b"").unwrap();
        let err = find_in("libnvrtc.so.13", std::slice::from_ref(&dir)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("libnvrtc.so.13 not found"), "{text}");
        assert!(text.contains(&dir.display().to_string()), "{text}");
        assert!(text.contains("libnvrtc.so.12"), "{text}");
        std::fs::write(dir.join("libnvrtc.so.13"), b"").unwrap();
        assert_eq!(
            find_in("libnvrtc.so.13", std::slice::from_ref(&dir)).unwrap(),
            dir.join("libnvrtc.so.13")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn mapped_files_list_this_process_libraries_and_a_single_copy_passes() {
        let libc = mapped_files("libc.so");
        assert!(!libc.is_empty(), "libc is mapped in every process");
        check_single_copy(&libc[0], "libc.so").expect("one libc");
        let err = check_single_copy(Path::new("/elsewhere/libc.so.6"), "libc.so").unwrap_err();
        assert!(err.contains("so were"), "{err}");
    }

    /// The driver's last resort: the dynamic linker's own search (zlib stands in for libcuda,
    /// which this machine lacks), reporting the file it mapped.
    #[test]
    fn a_library_loaded_by_soname_reports_the_file_the_linker_chose() {
        let (path, _lib) = load_by_soname("libz.so.1").expect("zlib is on every test machine");
        assert!(path.is_absolute(), "{}", path.display());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("libz.so"), "{name}");
        let err = load_by_soname("libredline-nothing.so.7").unwrap_err();
        assert!(err.to_string().contains("libredline-nothing.so.7"), "{err}");
    }

    #[test]
    fn a_panic_in_a_call_is_an_error_naming_it() {
        let err = catch_panic("cudnnCreate", || -> i32 { panic!("Missing symbol x") }).unwrap_err();
        assert_eq!(err, "cudnnCreate: Missing symbol x");
    }

    #[test]
    fn loading_a_file_that_is_not_a_library_is_an_error_not_a_panic() {
        let path = std::env::temp_dir().join(format!("redline-notalib-{}.so", std::process::id()));
        std::fs::write(&path, b"not an ELF file").unwrap();
        let err = load_global(&path).expect_err("not a library");
        assert!(err.to_string().contains("cannot load"), "{err}");
        let _ = std::fs::remove_file(&path);
    }
}

//! Kernel families as CUBIN for a device: ahead of time where possible, else NVRTC at run time
//! with an on-disk cache.
//!
//! A family's CUBIN for an architecture is two files named by the family, the architecture and
//! a hash of the sources that went in (`elementwise-sm_90-<hash>.cubin` and `.symbols`, the
//! latter one `name expression<TAB>lowered symbol` per line), so a stale file is never loaded:
//! a changed kernel has another name. Looked up in order:
//! 1. `REDLINE_CUDA_CUBIN_DIR`, then `cubin/` beside the running executable (the `gpu-check`
//!    pack: a GPU run pays no compile time and needs no NVRTC);
//! 2. the cache, `REDLINE_CUDA_CACHE` or `$XDG_CACHE_HOME/redline/cuda` or
//!    `~/.cache/redline/cuda`, in a folder per NVRTC version;
//! 3. NVRTC, whose result then goes into the cache.

use std::path::{Path, PathBuf};

use crate::kernels::{Family, HEADERS};
use crate::nvrtc::{Cubin, Nvrtc};

/// FNV-1a over the texts: names a build of given sources.
pub fn fingerprint(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.as_bytes().iter().chain(&[0xff]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The file stem of `family` for `arch`: family, architecture and source hash.
pub fn stem(family: &Family, arch: &str) -> String {
    let mut parts: Vec<&str> = vec![family.source.text];
    parts.extend(HEADERS.iter().map(|h| h.text));
    parts.extend(family.instantiations.iter().map(String::as_str));
    let name = family.source.name.trim_end_matches(".cu");
    format!("{name}-{arch}-{:016x}", fingerprint(&parts))
}

/// A family's CUBIN and its symbols, as loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    pub image: Vec<u8>,
    /// (name expression, lowered symbol).
    pub symbols: Vec<(String, String)>,
}

impl From<Cubin> for Compiled {
    fn from(c: Cubin) -> Self {
        Self {
            image: c.image,
            symbols: c.symbols,
        }
    }
}

/// Writes `compiled` as `family`'s files for `arch` into `dir` (the CUBIN gzipped when
/// `gzip`: a pack's CUBINs shrink about sevenfold).
pub fn write(
    dir: &Path,
    family: &Family,
    arch: &str,
    compiled: &Compiled,
    gzip: bool,
) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let stem = stem(family, arch);
    let symbols: String = compiled
        .symbols
        .iter()
        .map(|(expr, lowered)| format!("{expr}\t{lowered}\n"))
        .collect();
    // Symbols last: a reader that finds them finds the CUBIN complete.
    let (name, bytes) = if gzip {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(&compiled.image)?;
        (format!("{stem}.cubin.gz"), encoder.finish()?)
    } else {
        (format!("{stem}.cubin"), compiled.image.clone())
    };
    let partial = dir.join(format!("{name}.{}", std::process::id()));
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, dir.join(name))?;
    let partial = dir.join(format!("{stem}.symbols.{}", std::process::id()));
    std::fs::write(&partial, symbols)?;
    std::fs::rename(partial, dir.join(format!("{stem}.symbols")))
}

/// `family`'s files for `arch` from `dir`, if there (and naming every instantiation).
pub fn read(dir: &Path, family: &Family, arch: &str) -> Option<Compiled> {
    let stem = stem(family, arch);
    let text = std::fs::read_to_string(dir.join(format!("{stem}.symbols"))).ok()?;
    let image = match std::fs::read(dir.join(format!("{stem}.cubin"))) {
        Ok(image) => image,
        Err(_) => {
            use std::io::Read as _;
            let gz = std::fs::read(dir.join(format!("{stem}.cubin.gz"))).ok()?;
            let mut image = Vec::new();
            flate2::read::GzDecoder::new(&gz[..])
                .read_to_end(&mut image)
                .ok()?;
            image
        }
    };
    let symbols: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(e, s)| (e.to_string(), s.to_string()))
        .collect();
    let complete = family
        .instantiations
        .iter()
        .all(|i| symbols.iter().any(|(e, _)| e == i));
    (complete && !image.is_empty()).then_some(Compiled { image, symbols })
}

/// Folders holding ahead-of-time CUBINs, in lookup order.
pub fn ahead_of_time_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("REDLINE_CUDA_CUBIN_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    if let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        dirs.push(exe_dir.join("cubin"));
    }
    dirs
}

/// Where the CUDA backend keeps what it worked out once (compiled kernels, measured cuDNN
/// algorithms): `REDLINE_CUDA_CACHE`, else `$XDG_CACHE_HOME/redline/cuda`, else
/// `~/.cache/redline/cuda`.
pub fn cache_root() -> Option<PathBuf> {
    std::env::var_os("REDLINE_CUDA_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("redline/cuda"))
        })
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/redline/cuda")))
}

/// The run-time compile cache for one NVRTC version.
pub fn cache_dir(nvrtc_version: (i32, i32)) -> Option<PathBuf> {
    Some(cache_root()?.join(format!("nvrtc-{}.{}", nvrtc_version.0, nvrtc_version.1)))
}

/// Where a family's CUBIN came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    AheadOfTime(PathBuf),
    Cache(PathBuf),
    Compiled,
}

/// `family` for `arch`: ahead of time, cached, or compiled now by `nvrtc()` (and cached).
pub fn load_or_compile<'a>(
    family: &Family,
    arch: &str,
    nvrtc: impl FnOnce() -> Result<&'a Nvrtc, String>,
) -> Result<(Compiled, Origin), String> {
    for dir in ahead_of_time_dirs() {
        if let Some(c) = read(&dir, family, arch) {
            return Ok((c, Origin::AheadOfTime(dir)));
        }
    }
    compile_here(family, arch, nvrtc)
}

/// `family` for `arch` from this machine's NVRTC: its cache, or compiled now (and cached) —
/// also what runs when the driver does not take an ahead-of-time CUBIN.
pub fn compile_here<'a>(
    family: &Family,
    arch: &str,
    nvrtc: impl FnOnce() -> Result<&'a Nvrtc, String>,
) -> Result<(Compiled, Origin), String> {
    let nvrtc = nvrtc()?;
    let cache = cache_dir(nvrtc.version);
    if let Some(c) = cache.as_deref().and_then(|d| read(d, family, arch)) {
        return Ok((c, Origin::Cache(cache.unwrap_or_default())));
    }
    let compiled = Compiled::from(nvrtc.compile(family, HEADERS, arch)?);
    if let Some(dir) = &cache {
        // A cache that cannot be written only costs the next run a compile.
        let _ = write(dir, family, arch, &compiled, false);
    }
    Ok((compiled, Origin::Compiled))
}

/// Compiles every family for every one of `archs` with `nvrtc` (a thread per compile) and
/// writes them into `dir`: the ahead-of-time CUBINs of a pack. Returns how many it wrote.
pub fn prepare(nvrtc: &Nvrtc, dir: &Path, archs: &[&str]) -> Result<usize, String> {
    let families = crate::kernels::families();
    let jobs: Vec<(&Family, &str)> = families
        .iter()
        .flat_map(|f| archs.iter().map(move |&a| (f, a)))
        .collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(family, arch)| {
                s.spawn(move || {
                    let compiled = Compiled::from(nvrtc.compile(family, HEADERS, arch)?);
                    write(dir, family, arch, &compiled, true)
                        .map_err(|e| format!("writing {}: {e}", dir.display()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a compile thread panicked".into()))
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, String>>()?;
    Ok(jobs.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::families;

    #[test]
    fn written_cubins_read_back_and_a_changed_source_has_another_name() {
        let dir = std::env::temp_dir().join(format!("redline-cubins-{}", std::process::id()));
        let family = families().remove(0);
        let compiled = Compiled {
            image: vec![1, 2, 3],
            symbols: family
                .instantiations
                .iter()
                .map(|e| (e.clone(), format!("_Z{}", e.len())))
                .collect(),
        };
        write(&dir, &family, "sm_90", &compiled, false).unwrap();
        assert_eq!(read(&dir, &family, "sm_90"), Some(compiled.clone()));
        write(&dir, &family, "sm_80", &compiled, true).unwrap();
        assert_eq!(read(&dir, &family, "sm_80"), Some(compiled), "gzipped");
        assert_eq!(read(&dir, &family, "sm_120"), None, "another architecture");
        let mut changed = family.clone();
        changed.source.text = "// edited\n";
        assert_ne!(stem(&changed, "sm_90"), stem(&family, "sm_90"));
        assert_eq!(
            read(&dir, &changed, "sm_90"),
            None,
            "a stale CUBIN is never loaded"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! NVRTC: kernel sources to CUBIN for one architecture, with what ptxas says about each kernel
//! (registers, shared memory, spills). CUBIN, not PTX: PTX from a newer NVRTC does not load on
//! an older driver, while a CUBIN for the exact architecture does.
//!
//! Bound by hand over `libloading` rather than through cudarc's NVRTC module: the backend picks
//! the library file itself (see [`crate::libs`]) and needs name expressions and CUBIN output,
//! which cudarc's safe layer does not offer. NVRTC needs its builtins library beside it, loaded
//! first with RTLD_GLOBAL so NVRTC's own request for it finds that file.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::kernels::{Family, Source};
use crate::libs::{self, LibError, CUDA_MAJOR};

type Program = *mut std::ffi::c_void;

/// The NVRTC entry points the compiler uses.
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    add_name: unsafe extern "C" fn(Program, *const c_char) -> c_int,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    lowered: unsafe extern "C" fn(Program, *const c_char, *mut *const c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Program) -> c_int,
}

/// A loaded NVRTC and the headers folder its compiles use.
pub struct Nvrtc {
    api: Api,
    pub path: PathBuf,
    pub version: (i32, i32),
    pub include_dir: PathBuf,
}

/// What ptxas reported for one kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    /// The lowered (mangled) name.
    pub symbol: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

impl Resources {
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// One family compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Cubin {
    pub arch: String,
    pub image: Vec<u8>,
    /// (name expression, lowered symbol) for every instantiation.
    pub symbols: Vec<(String, String)>,
    /// Per kernel, by name expression.
    pub resources: Vec<(String, Resources)>,
    pub log: String,
    /// The PTX the CUBIN was assembled from: what instructions a kernel uses (its 128-bit
    /// loads, say) can be checked without a GPU or a disassembler.
    pub ptx: String,
}

impl Cubin {
    /// The PTX of the kernel `expression` names (its `.entry` to the next), if compiled here.
    pub fn kernel_ptx(&self, expression: &str) -> Option<&str> {
        let (_, symbol) = self.symbols.iter().find(|(e, _)| e == expression)?;
        let start = self.ptx.find(&format!(".entry {symbol}("))?;
        let rest = &self.ptx[start..];
        let end = rest[1..].find(".entry ").map_or(rest.len(), |e| e + 1);
        Some(&rest[..end])
    }
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, LibError> {
    // SAFETY: each name is bound to the C signature NVRTC's nvrtc.h declares for it.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| LibError::Load {
            path: PathBuf::from("libnvrtc"),
            why: format!("{name}: {e}"),
        })
}

/// NVRTC of this build's CUDA major version and the builtins beside it, found and loaded once
/// into the process's global namespace and kept for its life: NVRTC's path and library, or why
/// not. Global, because cuDNN's runtime-compiled engines `dlopen` NVRTC by name and, with no
/// wheel folder on the linker's path, find it only as a copy already loaded (by its SONAME).
fn loaded() -> Result<&'static (PathBuf, [libloading::Library; 2]), LibError> {
    static LOADED: OnceLock<Result<(PathBuf, [libloading::Library; 2]), LibError>> =
        OnceLock::new();
    LOADED
        .get_or_init(|| {
            let dirs = libs::search_dirs();
            let path = libs::find_in(&format!("libnvrtc.so.{CUDA_MAJOR}"), &dirs)?;
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            // The builtins are named by the full version: take the one beside libnvrtc.
            let prefix = format!("libnvrtc-builtins.so.{CUDA_MAJOR}.");
            let builtins = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .ok_or_else(|| LibError::NotFound {
                    file: format!("{prefix}*"),
                    looked_in: vec![dir.clone()],
                    other_versions: Vec::new(),
                })?;
            let builtins = libs::load_global(&builtins)?;
            let lib = libs::load_global(&path)?;
            Ok((path, [lib, builtins]))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads NVRTC and its builtins globally for cuDNN, whose runtime-compiled engines find NVRTC
/// only so, even when every kernel of ours comes ahead of time and nothing is compiled: its
/// path and version ("13.0"), or why those engines will be refused.
pub fn preload() -> Result<(PathBuf, String), LibError> {
    let (path, [lib, _]) = loaded()?;
    let version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
        symbol(lib, "nvrtcVersion")?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { version(&mut major, &mut minor) };
    Ok((path.clone(), format!("{major}.{minor}")))
}

impl Nvrtc {
    /// Finds and loads NVRTC of this build's CUDA major version, its builtins and the headers.
    pub fn load() -> Result<Self, LibError> {
        let (path, [lib, _]) = loaded()?;
        let path = path.clone();
        let api = Api {
            version: symbol(lib, "nvrtcVersion")?,
            error_string: symbol(lib, "nvrtcGetErrorString")?,
            create: symbol(lib, "nvrtcCreateProgram")?,
            add_name: symbol(lib, "nvrtcAddNameExpression")?,
            compile: symbol(lib, "nvrtcCompileProgram")?,
            log_size: symbol(lib, "nvrtcGetProgramLogSize")?,
            log: symbol(lib, "nvrtcGetProgramLog")?,
            cubin_size: symbol(lib, "nvrtcGetCUBINSize")?,
            cubin: symbol(lib, "nvrtcGetCUBIN")?,
            ptx_size: symbol(lib, "nvrtcGetPTXSize")?,
            ptx: symbol(lib, "nvrtcGetPTX")?,
            lowered: symbol(lib, "nvrtcGetLoweredName")?,
            destroy: symbol(lib, "nvrtcDestroyProgram")?,
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters.
        unsafe { (api.version)(&mut major, &mut minor) };
        let include_dir = libs::find_include("cuda_fp16.h")?;
        Ok(Self {
            api,
            path,
            version: (major, minor),
            include_dir,
        })
    }

    fn check(&self, status: c_int, what: &str) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status.
        let text = unsafe { CStr::from_ptr((self.api.error_string)(status)) };
        Err(format!("{what}: {}", text.to_string_lossy()))
    }

    /// Compiles `family` (with `headers`) for `arch` ("sm_90"), every instantiation named.
    pub fn compile(
        &self,
        family: &Family,
        headers: &[Source],
        arch: &str,
    ) -> Result<Cubin, String> {
        let cstr = |s: &str| CString::new(s).map_err(|_| format!("NUL byte in {s:?}"));
        let source = cstr(family.source.text)?;
        let name = cstr(family.source.name)?;
        let header_texts: Vec<CString> = headers
            .iter()
            .map(|h| cstr(h.text))
            .collect::<Result<_, _>>()?;
        let header_names: Vec<CString> = headers
            .iter()
            .map(|h| cstr(h.name))
            .collect::<Result<_, _>>()?;
        let header_text_ptrs: Vec<*const c_char> =
            header_texts.iter().map(|c| c.as_ptr()).collect();
        let header_name_ptrs: Vec<*const c_char> =
            header_names.iter().map(|c| c.as_ptr()).collect();
        let options: Vec<CString> = [
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            format!("--include-path={}", self.include_dir.display()),
            // ptxas's report of registers, shared memory and spills, into the log.
            "--ptxas-options=-v".into(),
        ]
        .iter()
        .map(|o| cstr(o))
        .collect::<Result<_, _>>()?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
        let exprs: Vec<CString> = family
            .instantiations
            .iter()
            .map(|e| cstr(e))
            .collect::<Result<_, _>>()?;

        let mut program: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string or an array of them of the
        // given length; `program` is destroyed below on every path.
        unsafe {
            self.check(
                (self.api.create)(
                    &mut program,
                    source.as_ptr(),
                    name.as_ptr(),
                    headers.len() as c_int,
                    header_text_ptrs.as_ptr(),
                    header_name_ptrs.as_ptr(),
                ),
                "nvrtcCreateProgram",
            )?;
        }
        let result = self.compile_program(program, &exprs, &option_ptrs, arch, family);
        // SAFETY: created above.
        unsafe { (self.api.destroy)(&mut program) };
        result
    }

    fn compile_program(
        &self,
        program: Program,
        exprs: &[CString],
        options: &[*const c_char],
        arch: &str,
        family: &Family,
    ) -> Result<Cubin, String> {
        // SAFETY (whole function): `program` is live; buffers are sized from NVRTC's own sizes.
        unsafe {
            for e in exprs {
                self.check(
                    (self.api.add_name)(program, e.as_ptr()),
                    "nvrtcAddNameExpression",
                )?;
            }
            let status = (self.api.compile)(program, options.len() as c_int, options.as_ptr());
            let mut size = 0usize;
            (self.api.log_size)(program, &mut size);
            let mut log = vec![0u8; size.max(1)];
            (self.api.log)(program, log.as_mut_ptr().cast());
            let log = String::from_utf8_lossy(&log[..size.saturating_sub(1)]).into_owned();
            if status != 0 {
                return Err(format!(
                    "{} does not compile for {arch}:\n{log}",
                    family.source.name
                ));
            }
            let mut size = 0usize;
            self.check(
                (self.api.cubin_size)(program, &mut size),
                "nvrtcGetCUBINSize",
            )?;
            let mut image = vec![0u8; size];
            self.check(
                (self.api.cubin)(program, image.as_mut_ptr().cast()),
                "nvrtcGetCUBIN",
            )?;
            let mut size = 0usize;
            self.check((self.api.ptx_size)(program, &mut size), "nvrtcGetPTXSize")?;
            let mut ptx = vec![0u8; size.max(1)];
            self.check(
                (self.api.ptx)(program, ptx.as_mut_ptr().cast()),
                "nvrtcGetPTX",
            )?;
            let ptx = String::from_utf8_lossy(&ptx[..size.saturating_sub(1)]).into_owned();
            let mut symbols = Vec::new();
            for (e, text) in exprs.iter().zip(&family.instantiations) {
                let mut lowered: *const c_char = std::ptr::null();
                self.check((self.api.lowered)(program, e.as_ptr(), &mut lowered), text)?;
                let lowered = CStr::from_ptr(lowered).to_string_lossy().into_owned();
                symbols.push((text.clone(), lowered));
            }
            let reports = parse_ptxas(&log);
            let resources = symbols
                .iter()
                .map(|(text, sym)| {
                    let r = reports.iter().find(|r| &r.symbol == sym).cloned();
                    r.map(|r| (text.clone(), r))
                        .ok_or_else(|| format!("ptxas reported nothing for {text} ({sym})"))
                })
                .collect::<Result<_, _>>()?;
            Ok(Cubin {
                arch: arch.into(),
                image,
                symbols,
                resources,
                log,
                ptx,
            })
        }
    }
}

/// ptxas's verbose lines, kernel by kernel:
/// `Compiling entry function '_Z…' for 'sm_90'`, then `N bytes stack frame, N bytes spill
/// stores, N bytes spill loads` and `Used N registers, used N barriers, N bytes smem`.
pub fn parse_ptxas(log: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let symbol = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Resources {
                symbol,
                ..Resources::default()
            });
            continue;
        }
        let Some(current) = out.last_mut() else {
            continue;
        };
        if line.contains("stack frame") {
            current.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            current.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            current.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used") && line.contains("registers") {
            current.registers = number_before(line, "registers").unwrap_or(0);
            current.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preloading_maps_nvrtc_and_its_builtins_for_cudnn_or_says_what_is_missing() {
        // cuDNN finds NVRTC only as a copy already loaded: both files must be mapped after.
        match preload() {
            Ok((path, version)) => {
                assert!(version.starts_with(&format!("{CUDA_MAJOR}.")), "{version}");
                let name = format!("libnvrtc.so.{CUDA_MAJOR}");
                assert!(path.ends_with(&name), "{}", path.display());
                let mapped = libs::mapped_files("libnvrtc");
                let has = |prefix: &str| {
                    mapped.iter().any(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(prefix))
                    })
                };
                assert!(has(&name), "{mapped:?}");
                assert!(
                    has(&format!("libnvrtc-builtins.so.{CUDA_MAJOR}.")),
                    "{mapped:?}"
                );
                assert_eq!(preload().ok(), Some((path, version)), "found once");
            }
            Err(e) => assert!(e.to_string().contains("libnvrtc"), "{e}"),
        }
    }

    #[test]
    fn reads_registers_shared_memory_and_spills_from_the_ptxas_log() {
        let log = "ptxas info    : Compiling entry function '_Z6reduceIf' for 'sm_120'\n\
                   ptxas info    : Function properties for _Z6reduceIf\n\
                   ptxas         .     8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 50 registers, used 1 barriers, 32 bytes smem\n\
                   ptxas info    : Compiling entry function '_Z4fillIx' for 'sm_120'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 24 registers, used 0 barriers\n";
        let r = parse_ptxas(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            Resources {
                symbol: "_Z6reduceIf".into(),
                registers: 50,
                shared_bytes: 32,
                stack_bytes: 8,
                spill_stores: 12,
                spill_loads: 4,
            }
        );
        assert!(r[0].spills());
        assert_eq!(
            (r[1].registers, r[1].shared_bytes, r[1].spills()),
            (24, 0, false)
        );
    }
}

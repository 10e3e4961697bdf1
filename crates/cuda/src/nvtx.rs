//! NVTX ranges around ops and training phases, for Nsight Systems: `nvtxRangePushA` and
//! `nvtxRangePop` from `libnvToolsExt.so.1`, found like every other library (NVIDIA's
//! `nvidia-nvtx` wheel ships it; Nsight's injection hooks into it when a profile is taken).
//! Without the library, or with `REDLINE_NVTX=0`, ranges cost nothing and do nothing.

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::libs;

/// The two entry points, bound by hand from the exact file found (two functions do not
/// justify a binding crate and its own library lookup).
pub struct Nvtx {
    push: unsafe extern "C" fn(*const c_char) -> c_int,
    pop: unsafe extern "C" fn() -> c_int,
    pub path: PathBuf,
    _library: libloading::Library,
}

/// The library, or why ranges are off (looked up once per process).
pub fn nvtx() -> Result<&'static Nvtx, &'static str> {
    static LOADED: OnceLock<Result<Nvtx, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            if std::env::var("REDLINE_NVTX").is_ok_and(|v| v == "0") {
                return Err("off: REDLINE_NVTX=0".into());
            }
            let path = libs::find("libnvToolsExt.so.1").map_err(|e| e.to_string())?;
            let library = libs::load_global(&path).map_err(|e| e.to_string())?;
            // SAFETY: the NVTX v2 signatures: int nvtxRangePushA(const char*), int nvtxRangePop().
            unsafe {
                let push = *library
                    .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nvtxRangePushA\0")
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let pop = *library
                    .get::<unsafe extern "C" fn() -> c_int>(b"nvtxRangePop\0")
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(Nvtx {
                    push,
                    pop,
                    path,
                    _library: library,
                })
            }
        })
        .as_ref()
        .map_err(String::as_str)
}

impl Nvtx {
    /// Opens range `name` on this thread until the guard drops.
    pub fn range(&'static self, name: &str) -> redline_tensor::Annotation {
        let Ok(name) = CString::new(name) else {
            return redline_tensor::Annotation::none();
        };
        // SAFETY: a NUL-terminated string NVTX copies; push and pop pair up through the guard.
        unsafe { (self.push)(name.as_ptr()) };
        redline_tensor::Annotation::new(move || {
            // SAFETY: closes the range this guard opened.
            unsafe { (self.pop)() };
        })
    }
}

/// A range named `name` when NVTX is here, else nothing.
pub fn range(name: &str) -> redline_tensor::Annotation {
    match nvtx() {
        Ok(n) => n.range(name),
        Err(_) => redline_tensor::Annotation::none(),
    }
}

#[cfg(test)]
mod tests {
    /// Without the library (CI) a range is a no-op guard and the reason names the file.
    #[test]
    fn ranges_are_no_ops_without_the_library() {
        let guard = super::range("conv2d");
        match super::nvtx() {
            Ok(n) => println!("NVTX from {}", n.path.display()),
            Err(why) => {
                assert!(
                    why.contains("libnvToolsExt.so.1") || why.contains("REDLINE_NVTX"),
                    "{why}"
                );
                assert_eq!(format!("{guard:?}"), "Annotation(none)");
            }
        }
    }
}

//! The host emulator: the kernels of `kernels/` compiled by the host C++ compiler with
//! `kernels/emulate.h` in front, loaded as a shared library, and driven through the [`Gpu`]
//! trait like a real device. CI runs the backend's launchers and kernels on it against the f64
//! reference, so indexing, tails, broadcasting and synchronisation are checked without a GPU.
//!
//! Device memory is host memory with guard bytes on both sides of every allocation, checked
//! after every launch (a write past the end is an error naming the kernel), and filled with
//! 0xFF bytes when allocated (NaN, or -1) so a read of memory nothing wrote shows. Launches
//! alternate the order in which a block's threads start.
//!
//! The library is built once per distinct source text and cached (by hash) under the system's
//! temporary folder or `REDLINE_CUDA_EMULATOR_DIR`. `REDLINE_CUDA_KERNELS` names a folder whose
//! `.cu`/`.cuh` files replace the embedded ones: how `cargo xtask test` builds mutated kernels
//! and proves the emulated suite fails on them.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use redline_tensor::{Result, TensorError};

use crate::gpu::{Captured, DevicePtr, Gpu, KernelArgs, LaunchShape};
use crate::kernels::{self, Family};

thread_local! {
    /// Launches made from this thread, whatever the emulator: their parity picks the order in
    /// which a block's threads start. Counted per thread, not per emulator, so a test on an
    /// emulator other tests share alternates the same way on every run (a race the suite finds
    /// is found every time, not as the test threads happen to interleave).
    static LAUNCHES_ON_THIS_THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Guard bytes on each side of an allocation.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const c_uint,
    *const c_uint,
    *mut *mut c_void,
    *const c_ulong,
    c_uint,
    c_int,
    *mut c_char,
    c_ulong,
) -> c_int;

/// 16 aligned bytes: allocations are made of these, so a payload starts 16-byte aligned (after
/// a guard of a multiple of 16) and the kernels' 128-bit packs may be used, as on a GPU.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Chunk([u8; 16]);

/// One allocation: guard, payload, guard, in 16-byte chunks (so any element type is aligned).
struct Allocation {
    words: Vec<Chunk>,
    bytes: usize,
}

impl Allocation {
    fn base(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }

    /// Whether both guards still hold their pattern. Checked for every allocation after every
    /// launch, and the caching allocator keeps thousands in a long soak: slice comparisons
    /// (memcmp), not a byte loop.
    fn guards_intact(&self) -> bool {
        const INTACT: [u8; GUARD] = [GUARD_BYTE; GUARD];
        // SAFETY: the words span GUARD + bytes + GUARD bytes.
        let all =
            unsafe { std::slice::from_raw_parts(self.base().cast_const(), GUARD * 2 + self.bytes) };
        all[..GUARD] == INTACT && all[GUARD + self.bytes..] == INTACT
    }
}

/// The emulated device.
pub struct Emulator {
    /// Keeps the kernels mapped while `launch` points into them.
    _library: libloading::Library,
    launch: LaunchFn,
    path: PathBuf,
    allocations: Mutex<HashMap<u64, Allocation>>,
    /// Serialises launches: a launch reads and writes memory any allocation may share.
    launching: Mutex<()>,
    launches: AtomicU64,
    /// The timestamp slots: launches run when they are enqueued, so the host's clock at
    /// recording time is the device's.
    clock: Mutex<Vec<Option<u64>>>,
    epoch: std::time::Instant,
    /// The launches of the capture in progress: recorded, not run (as on a GPU).
    capture: Mutex<Option<Vec<(String, LaunchShape, KernelArgs)>>>,
    /// Pad 3-channel stems as a GPU with cuDNN does ([`Emulator::pad_stem_channels`]).
    pads_stem: AtomicBool,
    /// End every capture with the driver's "invalidated" ([`Emulator::invalidate_captures`]).
    invalidates_captures: AtomicBool,
    /// Blocks freed while a capture ran: kept, and the capture fails at its end — the driver
    /// takes a free then only for memory the graph itself allocated, which ours never is.
    freed_in_capture: Mutex<Vec<u64>>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Emulator({})", self.path.display())
    }
}

const NAME: &str = "cuda-emulator";

fn error(what: impl Into<String>) -> TensorError {
    TensorError::Backend {
        device: NAME.into(),
        what: what.into(),
    }
}

/// The kernel sources: embedded, or read from `REDLINE_CUDA_KERNELS` (same file names).
fn sources() -> Result<Vec<(String, String)>> {
    let families = kernels::families();
    let mut files: Vec<(String, String)> = Vec::new();
    let embedded = kernels::HEADERS
        .iter()
        .chain(kernels::EMULATION)
        .copied()
        .chain(families.iter().map(|f| f.source));
    let dir = std::env::var_os("REDLINE_CUDA_KERNELS").map(PathBuf::from);
    for source in embedded {
        let text = match &dir {
            Some(dir) => std::fs::read_to_string(dir.join(source.name)).map_err(|e| {
                error(format!(
                    "REDLINE_CUDA_KERNELS: cannot read {}: {e}",
                    dir.join(source.name).display()
                ))
            })?,
            None => source.text.to_string(),
        };
        files.push((source.name.to_string(), text));
    }
    Ok(files)
}

/// The C++ file that includes every family and maps each name expression to its trampoline.
fn registry(families: &[Family]) -> String {
    let mut out = String::from("// Generated by redline-cuda's emulator: do not edit.\n");
    for family in families {
        let _ = writeln!(out, "#include \"{}\"", family.source.name);
    }
    out.push_str(
        "\nstruct RedlineEntry { const char *name; void (*run)(void **); redline_emu::Signature signature; };\n\
         static const RedlineEntry redline_entries[] = {\n",
    );
    for family in families {
        for expr in &family.instantiations {
            let _ = writeln!(out, "    {{\"{expr}\", redline_emu::trampoline<&{expr}>, redline_emu::signature<&{expr}>()}},");
        }
    }
    out.push_str(
        r#"};

extern "C" __attribute__((visibility("default"))) int redline_emu_launch(const char *name, const unsigned *grid, const unsigned *block,
                                  void **args, const unsigned long *sizes, unsigned count, int reverse,
                                  char *error, unsigned long error_len) {
    for (const RedlineEntry &e : redline_entries) {
        if (std::strcmp(e.name, name) != 0) continue;
        std::string why = redline_emu::check_signature(e.signature, sizes, count);
        if (!why.empty()) {
            std::snprintf(error, error_len, "%s", why.c_str());
            return 3;
        }
        why = redline_emu::launch(e.run, dim3(grid[0], grid[1], grid[2]),
                                              dim3(block[0], block[1], block[2]), args, reverse != 0);
        std::snprintf(error, error_len, "%s", why.c_str());
        return why.empty() ? 0 : 1;
    }
    std::snprintf(error, error_len, "no kernel instantiation named %s", name);
    return 2;
}
"#,
    );
    out
}

/// How the kernels are compiled for the host, before `-fPIC -shared` (the emulator's self-test
/// builds an executable with the same): C++17, wrapping signed arithmetic (as the GPU's), no
/// fast-math.
/// - Hidden visibility: the library exports its launcher alone. g++ would otherwise merge
///   function-local statics (`__shared__` arrays, the emulator's own block) across every
///   library loaded in the process (STB_GNU_UNIQUE), so two emulators of different kernel texts
///   would share them.
/// - On x86-64, indirect-branch protection only: a fiber's first switch returns into a function
///   that was never called, which a shadow stack refuses, so the library must not claim
///   shadow-stack support (Ubuntu's g++ marks objects with both by default).
pub fn compile_flags() -> Vec<&'static str> {
    let mut flags = vec!["-std=c++17", "-O1", "-fwrapv", "-fvisibility=hidden"];
    if cfg!(target_arch = "x86_64") {
        flags.push("-fcf-protection=branch");
    }
    flags
}

/// The host C++ compiler: `CXX`, else g++.
pub fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "g++".into())
}

/// Builds (or finds in the cache) the emulator library; returns its path. One build at a time
/// in a process: test threads that start together wait for the first instead of compiling the
/// same kernels side by side.
fn build() -> Result<PathBuf> {
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    let families = kernels::families();
    let files = sources()?;
    let registry = registry(&families);
    let cxx = compiler();
    let mut flags = compile_flags();
    flags.extend(["-fPIC", "-shared"]);
    let mut parts: Vec<&str> = vec![&registry, &cxx];
    parts.extend(&flags);
    for (name, text) in &files {
        parts.push(name);
        parts.push(text);
    }
    let key = crate::compile::fingerprint(&parts);
    let root = std::env::var_os("REDLINE_CUDA_EMULATOR_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("redline-cuda-emulator"));
    let dir = root.join(format!("{key:016x}"));
    let lib = dir.join("kernels.so");
    if lib.exists() {
        return Ok(lib);
    }
    let io = |what: &str, path: &Path, e: std::io::Error| {
        error(format!("{what} {}: {e}", path.display()))
    };
    std::fs::create_dir_all(dir.join("host")).map_err(|e| io("cannot create", &dir, e))?;
    for (name, text) in &files {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| io("cannot write", &path, e))?;
    }
    let registry_path = dir.join("registry.cpp");
    std::fs::write(&registry_path, &registry).map_err(|e| io("cannot write", &registry_path, e))?;
    // Build beside the final name and rename: concurrent builds (test threads, processes) never
    // load half a file.
    static BUILDS: AtomicU64 = AtomicU64::new(0);
    let build = BUILDS.fetch_add(1, Ordering::Relaxed);
    let partial = dir.join(format!("kernels.so.{}.{build}", std::process::id()));
    let mut cmd = Command::new(&cxx);
    cmd.args(&flags)
        .arg("-include")
        .arg(dir.join("emulate.h"))
        .arg("-I")
        .arg(dir.join("host"))
        .arg("-I")
        .arg(&dir)
        .arg(&registry_path)
        .arg("-o")
        .arg(&partial);
    let output = cmd.output().map_err(|e| {
        error(format!(
            "cannot run the host C++ compiler `{cxx}` (set CXX, or install g++): {e}"
        ))
    })?;
    if !output.status.success() {
        return Err(error(format!(
            "the kernels do not compile for the host emulator ({cxx}, {}):\n{}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    std::fs::rename(&partial, &lib).map_err(|e| io("cannot rename", &partial, e))?;
    Ok(lib)
}

impl Emulator {
    /// Builds (or reuses) the kernels for the host and loads them.
    pub fn new() -> Result<Self> {
        let path = build()?;
        // SAFETY: the library is ours, built from the kernel sources and the generated registry;
        // loading it runs no initialisers beyond the C++ runtime's.
        let library = unsafe { libloading::Library::new(&path) }
            .map_err(|e| error(format!("cannot load {}: {e}", path.display())))?;
        // SAFETY: the registry defines redline_emu_launch with exactly this signature.
        let launch = unsafe { library.get::<LaunchFn>(b"redline_emu_launch\0") }
            .map_err(|e| error(format!("{}: {e}", path.display())))
            .map(|f| *f)?;
        Ok(Self {
            _library: library,
            launch,
            path,
            allocations: Mutex::new(HashMap::new()),
            launching: Mutex::new(()),
            launches: AtomicU64::new(0),
            clock: Mutex::new(vec![None; redline_tensor::TIMESTAMP_SLOTS as usize]),
            epoch: std::time::Instant::now(),
            capture: Mutex::new(None),
            pads_stem: AtomicBool::new(false),
            invalidates_captures: AtomicBool::new(false),
            freed_in_capture: Mutex::new(Vec::new()),
        })
    }

    /// Pads 3-channel half-precision stems to 4 channels as a GPU with cuDNN does, so the
    /// padded path runs here (on our direct kernels, which the padding leaves exact).
    pub fn pad_stem_channels(self, on: bool) -> Self {
        self.pads_stem.store(on, Ordering::Relaxed);
        self
    }

    /// Fails every capture at its end, as the driver does one it invalidated (a library call
    /// it cannot hold, say) after every op was accepted: for the callers' recovery.
    pub fn invalidate_captures(self, on: bool) -> Self {
        self.invalidates_captures.store(on, Ordering::Relaxed);
        self
    }

    /// How many launches have run so far (captured ones count when a replay runs them).
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// The shared library the kernels run from.
    pub fn library_path(&self) -> &Path {
        &self.path
    }

    /// Refuses `what` while a capture runs, as the driver does (a graph cannot hold it).
    fn not_capturing(&self, what: &str) -> Result<()> {
        match self
            .capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            true => Err(error(format!(
                "{what} inside a graph capture: a graph replays device work only (copy inputs \
                 in before a replay, read results after it)"
            ))),
            false => Ok(()),
        }
    }

    /// Runs one launch now.
    fn execute(&self, kernel: &str, shape: LaunchShape, args: &KernelArgs) -> Result<()> {
        let name = CString::new(kernel).map_err(|_| error("a kernel name with a NUL byte"))?;
        let _serial = self.launching.lock().unwrap_or_else(|p| p.into_inner());
        self.launches.fetch_add(1, Ordering::Relaxed);
        let reverse = LAUNCHES_ON_THIS_THREAD.replace(LAUNCHES_ON_THIS_THREAD.get() + 1) % 2;
        let mut pointers = args.pointers();
        let sizes: Vec<c_ulong> = args.sizes().iter().map(|&n| n as c_ulong).collect();
        let mut message = vec![0u8; 1024];
        // SAFETY: the registry's launcher checks the parameters' count and sizes against the
        // kernel's signature before reading `pointers` as its parameters; device pointers among
        // them point into live allocations of this emulator.
        let status = unsafe {
            (self.launch)(
                name.as_ptr(),
                shape.grid.as_ptr(),
                shape.block.as_ptr(),
                pointers.as_mut_ptr(),
                sizes.as_ptr(),
                sizes.len() as c_uint,
                reverse as c_int,
                message.as_mut_ptr().cast(),
                message.len() as c_ulong,
            )
        };
        if status != 0 {
            let end = message
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(message.len());
            return Err(error(format!(
                "kernel {kernel} with grid {:?} and block {:?}: {}",
                shape.grid,
                shape.block,
                String::from_utf8_lossy(&message[..end])
            )));
        }
        let allocations = self.allocations.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bad) = allocations.values().find(|a| !a.guards_intact()) {
            return Err(error(format!(
                "kernel {kernel} wrote outside an allocation of {} bytes (its guard bytes changed)",
                bad.bytes
            )));
        }
        Ok(())
    }

    fn with_allocation<R>(
        &self,
        ptr: DevicePtr,
        len: usize,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Result<R> {
        let allocations = self.allocations.lock().unwrap_or_else(|p| p.into_inner());
        let found = allocations.values().find(|a| {
            let start = a.base() as u64 + GUARD as u64;
            ptr.0 >= start && ptr.0 + len as u64 <= start + a.bytes as u64
        });
        match found {
            Some(_) => Ok(f(ptr.0 as *mut u8)),
            None => Err(error(format!(
                "a copy of {len} bytes at {:#x} is not inside one allocation",
                ptr.0
            ))),
        }
    }
}

impl Gpu for Emulator {
    fn name(&self) -> String {
        NAME.into()
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        let total = GUARD * 2 + bytes;
        let words = vec![Chunk([0; 16]); total.div_ceil(16)];
        let allocation = Allocation { words, bytes };
        let base = allocation.base();
        // SAFETY: the words span `total` bytes.
        unsafe {
            std::ptr::write_bytes(base, GUARD_BYTE, GUARD);
            std::ptr::write_bytes(base.add(GUARD), 0xFF, bytes);
            std::ptr::write_bytes(base.add(GUARD + bytes), GUARD_BYTE, GUARD);
        }
        let ptr = DevicePtr(base as u64 + GUARD as u64);
        self.allocations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ptr.0, allocation);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr) {
        let capturing = self
            .capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if capturing {
            self.freed_in_capture
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(ptr.0);
            return;
        }
        self.allocations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr.0);
    }

    fn upload(&self, dst: DevicePtr, bytes: &[u8]) -> Result<()> {
        self.not_capturing("a copy from host memory")?;
        self.with_allocation(dst, bytes.len(), |p| {
            // SAFETY: [dst, dst + len) lies inside one live allocation (checked).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) }
        })
    }

    fn download(&self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.not_capturing("a download")?;
        self.with_allocation(src, out.len(), |p| {
            // SAFETY: [src, src + len) lies inside one live allocation (checked).
            unsafe { std::ptr::copy_nonoverlapping(p.cast_const(), out.as_mut_ptr(), out.len()) }
        })
    }

    fn launch(&self, kernel: &str, shape: LaunchShape, args: &KernelArgs) -> Result<()> {
        if let Some(recorded) = self
            .capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            recorded.push((kernel.to_string(), shape, args.clone()));
            return Ok(());
        }
        self.execute(kernel, shape, args)
    }

    fn synchronize(&self) -> Result<()> {
        self.not_capturing("a synchronize")
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        if capture.is_some() {
            return Err(error("a capture is already running"));
        }
        *capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<Captured> {
        let captured = (self
            .capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take())
        .ok_or_else(|| error("no capture to end"))?;
        let freed = std::mem::take(
            &mut *self
                .freed_in_capture
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        if !freed.is_empty() {
            return Err(error(format!(
                "the capture was invalidated: {} device block(s) freed while capturing (the \
                 driver frees only the graph's own allocations then)",
                freed.len()
            )));
        }
        if self.invalidates_captures.load(Ordering::Relaxed) {
            return Err(error(format!(
                "the capture was invalidated ({} launches recorded; as told to)",
                captured.len()
            )));
        }
        Ok(Captured::Launches(captured))
    }

    fn replay(&self, captured: &Captured) -> Result<()> {
        self.not_capturing("a replay")?;
        match captured {
            Captured::Launches(launches) => launches
                .iter()
                .try_for_each(|(kernel, shape, args)| self.execute(kernel, *shape, args)),
            Captured::Graph { .. } => Err(error("a CUDA graph cannot replay on the emulator")),
        }
    }

    fn record_clock(&self, slot: usize) -> Result<bool> {
        self.not_capturing("a timestamp")?;
        let mut clock = self.clock.lock().unwrap_or_else(|p| p.into_inner());
        let entry = clock
            .get_mut(slot)
            .ok_or_else(|| error(format!("timestamp slot {slot} is out of range")))?;
        *entry = Some(self.epoch.elapsed().as_nanos() as u64);
        Ok(true)
    }

    fn read_clock(&self, slots: &[usize]) -> Result<Vec<u64>> {
        let clock = self.clock.lock().unwrap_or_else(|p| p.into_inner());
        slots
            .iter()
            .map(|&s| {
                clock
                    .get(s)
                    .copied()
                    .flatten()
                    .ok_or_else(|| error(format!("timestamp slot {s} was never recorded")))
            })
            .collect()
    }

    fn exact_sizes(&self) -> bool {
        true
    }

    fn pads_stem_channels(&self) -> bool {
        self.pads_stem.load(Ordering::Relaxed)
    }
}

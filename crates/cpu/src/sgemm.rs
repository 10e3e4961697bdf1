//! f32 GEMM with our own micro-kernels, for x86-64 CPUs with AVX-512F or AVX2 + FMA.
//!
//! This is the classic packed GEMM (BLIS's loop nest): B is packed into 32-column panels of `KC`
//! rows (a micro-panel stays in L1), A into 12-row panels of an `MC × KC` block (in L2), and a
//! 12×32 tile of C is computed in registers. On AVX-512 that is one pass with 24 zmm
//! accumulators; on AVX2 (16 ymm registers) the same tile is four passes of the 6×16 kernel
//! (12 ymm accumulators, two B loads and a broadcast per step: BLIS's Haswell shape), so both
//! ISAs share the packing, the implicit-convolution addressing and every caller. Edges are
//! zero-padded in the packs and written back through masks. Single-threaded: the callers split
//! rows across threads. Without either ISA (or with `REDLINE_CPU_KERNEL=portable`) callers use
//! matrixmultiply and im2col instead.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

mod gathered;
pub(crate) use gathered::{gathered, PackedA};

const MR: usize = 12;
/// zmm vectors per tile row; the tile is MR × (16·NV).
const NV: usize = 2;
const NR: usize = 16 * NV;
/// Columns of a packed B panel (and of the register tile).
pub(crate) const PANEL: usize = NR;
const KC: usize = 256;
const MC: usize = MR * 12;

/// The micro-kernel a CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
}

/// The best micro-kernel of this CPU, checked once; `REDLINE_CPU_KERNEL=avx2` or `portable`
/// (or the older `REDLINE_CPU_NO_AVX512`) step down, for A/B measurements.
pub(crate) fn isa() -> Option<Isa> {
    #[cfg(test)]
    if let Some(forced) = FORCED.with(|f| f.get()) {
        return forced;
    }
    #[cfg(target_arch = "x86_64")]
    {
        static ISA: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let asked = std::env::var("REDLINE_CPU_KERNEL").unwrap_or_default();
            let no_avx512 = asked == "avx2" || std::env::var_os("REDLINE_CPU_NO_AVX512").is_some();
            if asked == "portable" {
                None
            } else if !no_avx512 && is_x86_feature_detected!("avx512f") {
                Some(Isa::Avx512)
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                Some(Isa::Avx2)
            } else {
                None
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Whether this CPU runs one of our kernels: implicit convolutions need one (else callers use
/// im2col and matrixmultiply).
pub(crate) fn available() -> bool {
    isa().is_some()
}

/// Whether plain GEMMs (matmul, im2col and 1×1 convolutions) run our kernel: on AVX-512 only.
/// On AVX2 ours now matches or beats matrixmultiply on one thread (ResNet-50's 1×1 shapes,
/// B packed once), but inside the convolutions, both threads busy, it measured 5–15% slower on
/// the input and weight gradients (Zen 3, alternating runs), so there ours runs just the
/// implicit convolutions, which it serves without im2col. `REDLINE_CPU_GEMM=ours` or
/// `matrixmultiply` overrides the choice, for A/B measurements.
pub(crate) fn for_gemm() -> bool {
    static ASKED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    match ASKED
        .get_or_init(|| std::env::var("REDLINE_CPU_GEMM").unwrap_or_default())
        .as_str()
    {
        "ours" => available(),
        "matrixmultiply" => false,
        _ => isa() == Some(Isa::Avx512),
    }
}

#[cfg(test)]
thread_local! {
    /// A kernel forced on this thread (tests run each ISA the CPU has).
    static FORCED: std::cell::Cell<Option<Option<Isa>>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `isa` as this thread's kernel.
#[cfg(test)]
pub(crate) fn with_isa<R>(isa: Option<Isa>, f: impl FnOnce() -> R) -> R {
    FORCED.with(|c| c.set(Some(isa)));
    let r = f();
    FORCED.with(|c| c.set(None));
    r
}

/// The ISAs this CPU can run, best first (for tests).
#[cfg(test)]
pub(crate) fn supported() -> Vec<Isa> {
    let mut all = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            all.push(Isa::Avx512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            all.push(Isa::Avx2);
        }
    }
    all
}

thread_local! {
    /// Per-thread packing buffers (A block, B block), reused across calls.
    static PACKS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `c = a·b + beta·c` for strided `a [m, k]`, `b [k, n]`, `c [m, n]`.
///
/// # Safety
/// As `matrixmultiply::sgemm`: the pointers and strides address valid, non-overlapping matrices;
/// and [`available`] must be true.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    [rsa, csa]: [isize; 2],
    b: *const f32,
    [rsb, csb]: [isize; 2],
    beta: f32,
    c: *mut f32,
    [rsc, csc]: [isize; 2],
) {
    if m == 0 || n == 0 {
        return;
    }
    PACKS.with(|packs| {
        let (pa, pb) = &mut *packs.borrow_mut();
        let n_panels = n.div_ceil(NR);
        let kc_max = k.clamp(1, KC);
        pb.resize(n_panels * NR * kc_max, 0.0);
        pa.resize(MC * kc_max, 0.0);
        if k == 0 {
            // Nothing to multiply: c = beta · c.
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: within c's matrix (caller's contract).
                    unsafe {
                        let at = c.offset(i as isize * rsc + j as isize * csc);
                        *at = if beta == 0.0 { 0.0 } else { beta * *at };
                    }
                }
            }
            return;
        }
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            for jp in 0..n_panels {
                let src = b.wrapping_offset(k0 as isize * rsb + (jp * NR) as isize * csb);
                let dst = &mut pb[jp * NR * kc..(jp + 1) * NR * kc];
                // SAFETY: rows k0.., columns jp·NR.. of b's matrix.
                unsafe { pack_piece(dst, src, [rsb, csb], kc, NR.min(n - jp * NR)) };
            }
            // The first K block applies beta; later ones accumulate.
            let beta = if k0 == 0 { beta } else { 1.0 };
            // SAFETY: the caller's contract; pb holds this block's panels.
            unsafe { multiply_block(pa, a, [rsa, csa], pb, k0, kc, m, n, beta, c, [rsc, csc]) };
        }
    });
}

/// B `[k, n]` packed once, in the `KC`-row blocks [`sgemm`] multiplies by: for a B shared by
/// many GEMMs (a convolution's weights, across row tiles and threads), so it is not packed
/// again for every tile.
pub(crate) struct PackedBlocks {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl PackedBlocks {
    /// # Safety
    /// `b` with strides `[rsb, csb]` addresses a valid `[k, n]` matrix.
    pub unsafe fn new(b: *const f32, [rsb, csb]: [isize; 2], k: usize, n: usize) -> Self {
        let panels = n.div_ceil(NR);
        let width = panels * NR;
        // Every element is written below (pack_piece zero-fills past the last column).
        let mut data = crate::buffer::overwritten(width * k);
        // Threads split the (K block, panel) pieces: a deep layer's B is megabytes, and one
        // thread packing it before the GEMM left the other idle.
        let out = crate::parallel::Disjoint::new(&mut data);
        let pieces = k.div_ceil(KC) * panels;
        let parts = crate::parallel::parts_for(width * k, 1 << 14);
        let b = b as usize; // an address, so the closure can be shared across threads
        crate::parallel::for_parts(pieces, parts, |_, range| {
            for piece in range {
                let (k0, jp) = (piece / panels * KC, piece % panels);
                let kc = KC.min(k - k0);
                let at = k0 * width + jp * kc * NR;
                // SAFETY: each piece is its own run of the buffer.
                let dst = unsafe { out.slice(at..at + kc * NR) };
                let src =
                    (b as *const f32).wrapping_offset(k0 as isize * rsb + (jp * NR) as isize * csb);
                // SAFETY: the caller's contract (rows k0.., columns jp·NR.. of b).
                unsafe { pack_piece(dst, src, [rsb, csb], kc, NR.min(n - jp * NR)) };
            }
        });
        Self { k, n, data }
    }

    /// A `[k, n]` B whose packed values the caller writes — every one of them, zeros past
    /// column `n` included — through [`PackedBlocks::offset`] and
    /// [`PackedBlocks::data_mut`] (a GEMM operand computed straight into the packed layout).
    pub fn uninit(k: usize, n: usize) -> Self {
        let width = n.div_ceil(NR) * NR;
        Self {
            k,
            n,
            data: crate::buffer::overwritten(width * k),
        }
    }

    /// Columns of the packed layout: `n` rounded up to whole panels.
    pub fn width(&self) -> usize {
        self.n.div_ceil(NR) * NR
    }

    /// Where `B[p, j]` lies in [`PackedBlocks::data_mut`], for `j <` [`PackedBlocks::width`];
    /// `B[p, j..j + 16]` are contiguous when `j` is a multiple of 16.
    pub fn offset(&self, p: usize, j: usize) -> usize {
        let k0 = p / KC * KC;
        let kc = KC.min(self.k - k0);
        k0 * self.width() + (j / NR) * kc * NR + (p - k0) * NR + j % NR
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn n(&self) -> usize {
        self.n
    }
}

impl Drop for PackedBlocks {
    fn drop(&mut self) {
        // A deep layer's packed weights are megabytes, packed on every call: reuse the pages.
        crate::buffer::recycle(std::mem::take(&mut self.data));
    }
}

/// `dst[p·NR + j] = src[p·rsb + j·csb]` for `p < kc`, `j < cols`, zeros past `cols`: one
/// panel of one K block, read along whichever of B's axes is contiguous (a transposed B — a
/// 1×1 convolution's OIHW weights — column by column, not 32 cache lines per row).
///
/// # Safety
/// Those elements of `src` are readable; `dst` holds `kc·NR` values.
unsafe fn pack_piece(
    dst: &mut [f32],
    src: *const f32,
    [rsb, csb]: [isize; 2],
    kc: usize,
    cols: usize,
) {
    if cols < NR {
        for row in dst.chunks_exact_mut(NR).take(kc) {
            row[cols..].fill(0.0);
        }
    }
    if rsb == 1 && csb != 1 {
        for j in 0..cols {
            // SAFETY: column j's kc values are readable.
            let column = unsafe { src.offset(j as isize * csb) };
            for p in 0..kc {
                // SAFETY: as above.
                dst[p * NR + j] = unsafe { *column.add(p) };
            }
        }
        return;
    }
    for p in 0..kc {
        // SAFETY: row p's cols values are readable.
        let row = unsafe { src.offset(p as isize * rsb) };
        for j in 0..cols {
            // SAFETY: as above.
            dst[p * NR + j] = unsafe { *row.offset(j as isize * csb) };
        }
    }
}

/// [`sgemm`] with B already packed: `c = a·B + beta·c` for strided `a [m, B.k]`.
///
/// # Safety
/// As [`sgemm`] for `a` and `c`.
pub(crate) unsafe fn sgemm_packed(
    m: usize,
    a: *const f32,
    [rsa, csa]: [isize; 2],
    b: &PackedBlocks,
    beta: f32,
    c: *mut f32,
    [rsc, csc]: [isize; 2],
) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 || k == 0 {
        // SAFETY: with k = 0 only c is touched (beta · c); b is never read.
        unsafe {
            sgemm(
                m,
                k,
                n,
                a,
                [rsa, csa],
                b.data.as_ptr(),
                [0, 0],
                beta,
                c,
                [rsc, csc],
            )
        };
        return;
    }
    let width = n.div_ceil(NR) * NR;
    PACKS.with(|packs| {
        let (pa, _) = &mut *packs.borrow_mut();
        pa.resize(MC * k.min(KC), 0.0);
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            let beta = if k0 == 0 { beta } else { 1.0 };
            let block = &b.data[k0 * width..k0 * width + width * kc];
            // SAFETY: the caller's contract; the block holds this K block's panels.
            unsafe { multiply_block(pa, a, [rsa, csa], block, k0, kc, m, n, beta, c, [rsc, csc]) };
        }
    });
}

/// One K block of the GEMM: `c (+)= a[:, k0..k0+kc] · pb`, with `pb` this block's packed B
/// panels and `pa` the A packing buffer (`MC × kc`).
///
/// # Safety
/// As [`sgemm`]; `pb` holds `n.div_ceil(NR)` panels of `kc × NR`.
#[allow(clippy::too_many_arguments)]
unsafe fn multiply_block(
    pa: &mut [f32],
    a: *const f32,
    [rsa, csa]: [isize; 2],
    pb: &[f32],
    k0: usize,
    kc: usize,
    m: usize,
    n: usize,
    beta: f32,
    c: *mut f32,
    [rsc, csc]: [isize; 2],
) {
    let n_panels = n.div_ceil(NR);
    for i0 in (0..m).step_by(MC) {
        let mc = MC.min(m - i0);
        // Row-major A is read in place by the kernel (12 streams, one per row); only a
        // ragged last panel is packed (zero-padded). Other A layouts are packed whole, and so
        // is a row-major A whose rows are a multiple of 2 KiB apart: its 12 streams would fall
        // into one or two L1 sets (4 KiB aliasing) and evict each other every step.
        let direct = csa == 1 && rsa % 512 != 0;
        let full = if direct { mc / MR } else { 0 };
        // SAFETY: reads within a's matrix.
        unsafe { pack_a(pa, a, rsa, csa, i0 + full * MR, mc - full * MR, k0, kc) };
        for jp in 0..n_panels {
            let cols = NR.min(n - jp * NR);
            let b_panel = pb[jp * NR * kc..].as_ptr();
            for ip in 0..mc.div_ceil(MR) {
                let rows = MR.min(mc - ip * MR);
                let row0 = i0 + ip * MR;
                // SAFETY: packs sized above; the tile lies within c; direct rows lie in a.
                unsafe {
                    let c_tile = c.offset(row0 as isize * rsc + (jp * NR) as isize * csc);
                    if ip < full {
                        let a_rows = a.offset(row0 as isize * rsa + k0 as isize);
                        let a = ASrc {
                            ptr: a_rows,
                            lda: rsa as usize,
                            taps: &[0],
                            run: kc,
                        };
                        kernel::<true>(a, b_panel, &rows_of(c_tile, rsc), csc, beta, rows, cols);
                    } else {
                        let a_panel = pa.as_ptr().add((ip - full) * MR * kc);
                        let a = ASrc {
                            ptr: a_panel,
                            lda: MR,
                            taps: &[0],
                            run: kc,
                        };
                        kernel::<false>(a, b_panel, &rows_of(c_tile, rsc), csc, beta, rows, cols);
                    }
                }
            }
        }
    }
}

/// B `[k, n]` packed once into `NR`-column panels over all its rows (convolution weights:
/// packed per call, shared by every thread).
pub(crate) struct PackedB {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl PackedB {
    /// Panels of [`PANEL`] columns (the last one zero-padded).
    pub fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// # Safety
    /// `b` with strides `[rsb, csb]` addresses a valid `[k, n]` matrix.
    #[cfg(test)]
    pub unsafe fn new(b: *const f32, [rsb, csb]: [isize; 2], k: usize, n: usize) -> Self {
        // SAFETY: the caller's contract.
        // (An address, so the row function can be shared across threads.)
        let b = b as usize;
        unsafe {
            Self::from_rows(
                |p| (b as *const f32).wrapping_offset(p as isize * rsb),
                csb,
                k,
                n,
            )
        }
    }

    /// B whose row `p` starts at `row(p)` with columns `csb` apart: a matrix read in place
    /// from another layout (a convolution's OIHW weights), without a relayout pass first.
    /// Packed panel by panel, so the reads advance along `n` rows at once rather than all, and
    /// threads split the panels (a deep layer's B is megabytes gathered element by element:
    /// alone, one thread packing it left the other idle for a tenth of the layer).
    ///
    /// # Safety
    /// For `p < k` and `j < n`, `row(p) + j·csb` is readable.
    pub unsafe fn from_rows(
        row: impl Fn(usize) -> *const f32 + Sync,
        csb: isize,
        k: usize,
        n: usize,
    ) -> Self {
        let panels = n.div_ceil(NR);
        // Every value is written below, the last panel's padding columns included: a recycled
        // vector (fresh pages for megabytes of weights per call cost page faults, and their
        // release TLB shootdowns).
        let mut data = crate::buffer::overwritten(panels * NR * k);
        let out = crate::parallel::Disjoint::new(&mut data);
        let parts = crate::parallel::parts_for(panels * k, 1 << 14);
        crate::parallel::for_parts(panels, parts, |_, range| {
            for jp in range {
                // SAFETY: each part writes its own panels.
                let panel = unsafe { out.slice(jp * NR * k..(jp + 1) * NR * k) };
                // SAFETY: the caller's contract.
                unsafe { pack_panel(&row, csb, jp, panel, NR.min(n - jp * NR)) };
            }
        });
        Self { k, n, data }
    }
}

impl Drop for PackedB {
    fn drop(&mut self) {
        crate::buffer::recycle(std::mem::take(&mut self.data));
    }
}

/// Panel `jp` of [`PackedB::from_rows`]: `cols` columns of every row, zeros past them.
///
/// # Safety
/// As [`PackedB::from_rows`].
unsafe fn pack_panel(
    row: &impl Fn(usize) -> *const f32,
    csb: isize,
    jp: usize,
    panel: &mut [f32],
    cols: usize,
) {
    for (p, dst) in panel.chunks_mut(NR).enumerate() {
        dst[cols..].fill(0.0);
        let src = row(p).wrapping_offset((jp * NR) as isize * csb);
        if csb == 1 {
            // SAFETY: as below, `cols` contiguous values.
            dst[..cols].copy_from_slice(unsafe { std::slice::from_raw_parts(src, cols) });
            continue;
        }
        for (j, v) in dst[..cols].iter_mut().enumerate() {
            // SAFETY: the caller's contract (p < k, jp·NR + j < n).
            *v = unsafe { *src.offset(j as isize * csb) };
        }
    }
}

/// Implicit GEMM with a pointer per input and output row:
/// `row_i = Σ_t Σ_s a_row(i)[taps[t] + s] · B[t·run + s, :]` (plus `beta · row_i`) for rows
/// `0..m`, written at `c_row(i)`, in the
/// columns of B's `panels` (of 32 columns: a caller splits a few rows' work
/// across threads by columns). Rows need not be evenly spaced, so a convolution computes only
/// its real outputs (none over the padded width) and any stride is one row pointer per output
/// pixel. A convolution's im2col matrix is never built: each kernel tap is a constant offset
/// from a row's pointer.
///
/// # Safety
/// [`available`]; for `i < m`, every `a_row(i) + taps[t] + s` is readable; `c_row(i)`
/// points at `B.n` writable values that overlap nothing read here nor another row's.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn implicit_rows(
    m: usize,
    a_row: impl Fn(usize) -> *const f32,
    taps: &[usize],
    run: usize,
    b: &PackedB,
    panels: std::ops::Range<usize>,
    c_row: impl Fn(usize) -> *mut f32,
    beta: f32,
) {
    assert!(
        panels.end <= b.panels(),
        "implicit gemm: B has {} panels",
        b.panels()
    );
    assert_eq!(
        taps.len() * run,
        b.k,
        "implicit gemm: taps x run must be B's rows"
    );
    if m == 0 || panels.is_empty() {
        return;
    }
    // B in blocks of taps × panels that stay in L2 while every row tile passes over them (the
    // deep layers' B is megabytes: streamed whole per row tile, it came from L3 or memory);
    // C is read back once per extra block of taps. The blocks follow from B alone, not from
    // the caller's share of its panels: the tap blocks set the order of each output's sum, so
    // its bits do not depend on how threads split the columns.
    let tap_panel = run * NR * std::mem::size_of::<f32>();
    let group = (B_BLOCK_BYTES / tap_panel).clamp(1, b.panels());
    let taps_per_block = (B_BLOCK_BYTES / (tap_panel * group)).clamp(1, taps.len());
    for t0 in (0..taps.len()).step_by(taps_per_block) {
        let block = &taps[t0..(t0 + taps_per_block).min(taps.len())];
        let beta = if t0 == 0 { beta } else { 1.0 };
        for g0 in panels.clone().step_by(group) {
            let group = g0..(g0 + group).min(panels.end);
            for ip in 0..m.div_ceil(MR) {
                let rows = MR.min(m - ip * MR);
                // A ragged tile repeats its last row: every address read is a real row's (and
                // only its `rows` real rows are stored).
                let last = |i: usize| (ip * MR + i).min(m - 1);
                let a: [*const f32; MR] = std::array::from_fn(|i| a_row(last(i)));
                let c: [*mut f32; MR] = std::array::from_fn(|i| c_row(last(i)));
                for jp in group.clone() {
                    let cols = NR.min(b.n - jp * NR);
                    // SAFETY: the caller's contract; the panel holds k·NR values, this block's
                    // from row t0·run; the tile's stored rows are real rows of c.
                    unsafe {
                        let panel = b.data.as_ptr().add(jp * NR * b.k + t0 * run * NR);
                        let tile = c.map(|row| row.wrapping_add(jp * NR));
                        kernel_rows(&a, block, run, panel, &tile, beta, rows, cols);
                    }
                }
            }
        }
    }
}

/// The row-pointer tile of this CPU's kernel.
///
/// # Safety
/// As [`kernel_rows_avx2`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn kernel_rows(
    a: &[*const f32; MR],
    taps: &[usize],
    run: usize,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract; AVX-512 is used only where the CPU has it.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if isa() == Some(Isa::Avx512) {
            return kernel_rows_avx512(a, taps, run, b, c_rows, beta, rows, cols);
        }
        kernel_rows_avx2(a, taps, run, b, c_rows, beta, rows, cols)
    }
}

/// The bytes of B that [`implicit_rows`] keeps in cache across row tiles.
const B_BLOCK_BYTES: usize = 192 << 10;

/// The weight gradient of a stride-1 implicit GEMM over a padded-width input:
/// `dw[t·run + s, :] += Σ_{q<m} a[q·lda + taps[t] + s] ·
/// g_q`, where `g_row(q)` is row `q` of the output gradient (`n` values) or None for a dropped
/// row (zeros), and `dw` is row-major `[taps·run, n]`.
///
/// # Safety
/// [`available`]; the `a` addresses for `q < m` are readable; each `g_row` pointer covers `n`
/// values; `dw` covers `[taps·run, n]` and overlaps neither.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn implicit_weight_grad(
    m: usize,
    a: *const f32,
    lda: usize,
    taps: &[usize],
    run: usize,
    g_row: impl Fn(usize) -> Option<*const f32>,
    n: usize,
    dw: *mut f32,
) {
    let k = taps.len() * run;
    PACKS.with(|packs| {
        let (pa, pb) = &mut *packs.borrow_mut();
        let kc_max = m.clamp(1, KC);
        pb.resize(n.div_ceil(NR) * NR * kc_max, 0.0);
        pa.resize(k.div_ceil(MR) * MR * kc_max, 0.0);
        for q0 in (0..m).step_by(KC) {
            let kc = KC.min(m - q0);
            // SAFETY: rows q0..q0+kc of g; the a addresses are the caller's contract.
            unsafe {
                pack_b(pb, &g_row, 1, q0, kc, n);
                pack_taps(pa, a, lda, taps, run, q0, kc);
            }
            // Every (tap, channel) row at once: 12-row panels run across tap boundaries, so
            // none is padded when taps × channels is a multiple of 12 (3×3 × 64 is). A panel
            // inside one tap is read in place (column-major, stride lda); only panels across a
            // tap boundary were packed.
            for jp in 0..n.div_ceil(NR) {
                let cols = NR.min(n - jp * NR);
                for ip in 0..k.div_ceil(MR) {
                    let rows = MR.min(k - ip * MR);
                    let (t, s0) = ((ip * MR) / run, (ip * MR) % run);
                    let (ptr, ld) = if rows == MR && s0 + MR <= run {
                        // SAFETY: the caller's contract (tap t, channels s0.., columns q0..).
                        (unsafe { a.add(q0 * lda + taps[t] + s0) }, lda)
                    } else {
                        // SAFETY: the pack holds every panel's slot.
                        (unsafe { pa.as_ptr().add(ip * MR * kc) }, MR)
                    };
                    // SAFETY: as above; the tile lies within dw.
                    unsafe {
                        let a = ASrc {
                            ptr,
                            lda: ld,
                            taps: &[0],
                            run: kc,
                        };
                        let panel = pb.as_ptr().add(jp * NR * kc);
                        let tile = rows_of(dw.add(ip * MR * n + jp * NR), n as isize);
                        kernel::<false>(a, panel, &tile, 1, 1.0, rows, cols);
                    }
                }
            }
        }
    });
}

/// The weight gradient of [`implicit_rows`] for dw rows `krows` (a range of `taps·run`, its
/// start a multiple of 12): `dw[t·run + s, :] += Σ_{q<m} a_row(q)[taps[t] + s] · g_row(q)`,
/// with `dw` row-major `[taps·run, n]`. Every pixel is reached through its row pointer, so only
/// real outputs count (none over a padded width) and any stride works; both operands are
/// packed per block of `KC` pixels — A's panels cost `1/n` of the work, so a task can own dw
/// rows and read every pixel (no partial sums to add up).
///
/// # Safety
/// [`available`]; for `q < m`, every `a_row(q) + taps[t] + s` is readable and `g_row(q)`
/// covers `n` values; `dw` covers `[taps·run, n]`, overlapping neither; no other thread writes
/// rows `krows` of `dw`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn implicit_rows_weight_grad(
    m: usize,
    a_row: impl Fn(usize) -> *const f32,
    taps: &[usize],
    run: usize,
    g_row: impl Fn(usize) -> *const f32,
    n: usize,
    dw: *mut f32,
    krows: std::ops::Range<usize>,
) {
    let k = taps.len() * run;
    assert!(
        krows.start.is_multiple_of(MR) && krows.end <= k,
        "weight gradient rows {krows:?} of {k}"
    );
    if m == 0 || krows.is_empty() {
        return;
    }
    let panels = krows.start / MR..krows.end.div_ceil(MR);
    PACKS.with(|packs| {
        let (pa, pb) = &mut *packs.borrow_mut();
        let kc_max = m.min(KC);
        pb.resize(n.div_ceil(NR) * NR * kc_max, 0.0);
        pa.resize(panels.len() * MR * kc_max, 0.0);
        for q0 in (0..m).step_by(KC) {
            let kc = KC.min(m - q0);
            // SAFETY: rows q0..q0+kc of g (the caller's contract).
            unsafe { pack_b(pb, |q| Some(g_row(q)), 1, q0, kc, n) };
            for (i, ip) in panels.clone().enumerate() {
                let panel = &mut pa[i * MR * kc..(i + 1) * MR * kc];
                let r0 = ip * MR;
                let (t, s0) = (r0 / run, r0 % run);
                if r0 + MR <= krows.end && s0 + MR <= run {
                    // Twelve channels of one tap: a copy per pixel.
                    for (p, dst) in panel.chunks_exact_mut(MR).enumerate() {
                        // SAFETY: the caller's contract (tap t, channels s0..s0+12).
                        let src = unsafe { a_row(q0 + p).add(taps[t] + s0) };
                        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src, MR) });
                    }
                    continue;
                }
                // Across a tap boundary or past the last row: element by element, zeros past
                // krows.
                let offsets: [Option<usize>; MR] = std::array::from_fn(|i| {
                    let r = r0 + i;
                    (r < krows.end).then(|| taps[r / run] + r % run)
                });
                for (p, dst) in panel.chunks_exact_mut(MR).enumerate() {
                    let row = a_row(q0 + p);
                    for (d, off) in dst.iter_mut().zip(&offsets) {
                        // SAFETY: the caller's contract.
                        *d = off.map_or(0.0, |off| unsafe { *row.add(off) });
                    }
                }
            }
            for jp in 0..n.div_ceil(NR) {
                let cols = NR.min(n - jp * NR);
                for (i, ip) in panels.clone().enumerate() {
                    let rows = MR.min(krows.end - ip * MR);
                    // SAFETY: the packs hold these panels; the tile lies in dw's rows krows.
                    unsafe {
                        let a = ASrc {
                            ptr: pa.as_ptr().add(i * MR * kc),
                            lda: MR,
                            taps: &[0],
                            run: kc,
                        };
                        let panel = pb.as_ptr().add(jp * NR * kc);
                        let tile = rows_of(dw.add(ip * MR * n + jp * NR), n as isize);
                        kernel::<false>(a, panel, &tile, 1, 1.0, rows, cols);
                    }
                }
            }
        }
    });
}

/// Packs the implicit im2col matrix transposed — row `t·run + s`, column `q` (for `q` in
/// `q0..q0+kc`) is `a[q·lda + taps[t] + s]` — into `MR`-row panels, k-major, zero-padded; only
/// the panels that cross a tap boundary (or the last row): the kernel reads the others in place.
unsafe fn pack_taps(
    pa: &mut [f32],
    a: *const f32,
    lda: usize,
    taps: &[usize],
    run: usize,
    q0: usize,
    kc: usize,
) {
    let k = taps.len() * run;
    for ip in 0..k.div_ceil(MR) {
        let r0 = ip * MR;
        let panel = &mut pa[ip * MR * kc..(ip + 1) * MR * kc];
        if r0 + MR <= k && r0 % run + MR <= run {
            // Inside one tap: the kernel reads it in place.
            continue;
        }
        // Across tap boundaries (or past the last row): each of the 12 rows is (tap, channel)
        // for its own index — with fewer than 6 channels a panel spans three taps or more —
        // and rows past k are zeros.
        let offsets: [Option<usize>; MR] = std::array::from_fn(|i| {
            let r = r0 + i;
            (r < k).then(|| taps[r / run] + r % run)
        });
        for p in 0..kc {
            let column = (q0 + p) * lda;
            for (d, off) in panel[p * MR..(p + 1) * MR].iter_mut().zip(&offsets) {
                // SAFETY: tap and channel of a row below k, column q0 + p (the caller's
                // contract).
                *d = off.map_or(0.0, |off| unsafe { *a.add(column + off) });
            }
        }
    }
}

/// B rows `k0..k0+kc` into `NR`-column panels, k-major, zero-padded past `n`. Row `p` starts
/// at `row(p)` with columns `csb` apart; None is a row of zeros (a dropped output).
unsafe fn pack_b(
    pb: &mut [f32],
    row: impl Fn(usize) -> Option<*const f32>,
    csb: isize,
    k0: usize,
    kc: usize,
    n: usize,
) {
    for p in 0..kc {
        let start = row(k0 + p);
        for jp in 0..n.div_ceil(NR) {
            let cols = NR.min(n - jp * NR);
            let dst = &mut pb[(jp * kc + p) * NR..(jp * kc + p + 1) * NR];
            let Some(start) = start else {
                dst.fill(0.0);
                continue;
            };
            // SAFETY: columns jp·NR.. of the row are inside b for j < cols (the caller's contract).
            let src = unsafe { start.offset((jp * NR) as isize * csb) };
            if csb == 1 && cols == NR {
                // SAFETY: as above; a fixed-size copy (inline moves).
                dst.copy_from_slice(unsafe { &*(src as *const [f32; NR]) });
            } else if csb == 1 {
                // SAFETY: as above, `cols` contiguous elements.
                dst[..cols].copy_from_slice(unsafe { std::slice::from_raw_parts(src, cols) });
            } else {
                for (j, v) in dst[..cols].iter_mut().enumerate() {
                    // SAFETY: as above.
                    *v = unsafe { *src.offset(j as isize * csb) };
                }
            }
            dst[cols..].fill(0.0);
        }
    }
}

/// A rows `i0..i0+mc`, columns `k0..k0+kc` into `MR`-row panels, k-major, zero-padded.
#[allow(clippy::too_many_arguments)]
unsafe fn pack_a(
    pa: &mut [f32],
    a: *const f32,
    rsa: isize,
    csa: isize,
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
) {
    for ip in 0..mc.div_ceil(MR) {
        let panel = &mut pa[ip * MR * kc..(ip + 1) * MR * kc];
        let rows = MR.min(mc - ip * MR);
        if rsa == 1 {
            // Column-major A (a transposed operand): each k step is `rows` contiguous values.
            for p in 0..kc {
                let dst = &mut panel[p * MR..(p + 1) * MR];
                // SAFETY: rows i0 + ip·MR.., column k0 + p are inside a.
                let src = unsafe { a.offset((i0 + ip * MR) as isize + (k0 + p) as isize * csa) };
                if rows == MR {
                    // A fixed-size copy: inline vector moves, not a memmove call per k step.
                    let src: &[f32; MR] = unsafe { &*(src as *const [f32; MR]) };
                    dst.copy_from_slice(src);
                } else {
                    dst[..rows].copy_from_slice(unsafe { std::slice::from_raw_parts(src, rows) });
                    dst[rows..].fill(0.0);
                }
            }
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if rows == MR && csa == 1 && is_x86_feature_detected!("avx2") {
            // SAFETY: the 12 rows' columns k0..k0 + kc are inside a; AVX2 was checked.
            unsafe {
                pack_rows_avx2(
                    panel,
                    a.offset((i0 + ip * MR) as isize * rsa + k0 as isize),
                    rsa,
                    kc,
                )
            };
            continue;
        }
        for i in 0..MR {
            if i >= rows {
                for p in 0..kc {
                    panel[p * MR + i] = 0.0;
                }
                continue;
            }
            // SAFETY: row i0 + ip·MR + i, columns k0.. are inside a.
            let src = unsafe { a.offset((i0 + ip * MR + i) as isize * rsa + k0 as isize * csa) };
            for p in 0..kc {
                // SAFETY: as above.
                panel[p * MR + i] = unsafe { *src.offset(p as isize * csa) };
            }
        }
    }
}

/// Where the kernel reads A. Direct: element (i, p) with `p = t·run + s` is at
/// `ptr[i·lda + taps[t] + s]` — a row-major matrix (`taps = [0]`) or an implicit im2col (one
/// offset per kernel tap). Otherwise column-major: at `ptr[p·lda + i]` with `taps = [0]` and
/// `run = kc` — a packed panel (`lda = MR`) or a transposed operand read in place.
///
/// Safety contract: every address the kernel forms for its `MR` rows is readable (callers of the
/// direct form keep `MR` rows of slack past a ragged edge).
#[derive(Clone, Copy)]
pub(crate) struct ASrc<'t> {
    pub ptr: *const f32,
    pub lda: usize,
    pub taps: &'t [usize],
    pub run: usize,
}

/// The 12×32 register tile: `c[rows, cols] = A·B + beta · c` on this CPU's kernel. A element
/// (i, p) is at `a[i·lda + p]` when `DIRECT` (row-major, read in place), else `a[p·lda + i]` (a
/// packed panel or a column-major operand); B is a packed `NR`-column panel.
///
/// # Safety
/// [`available`]; `ASrc`'s contract; `b` holds the panel's rows; the tile lies within c.
#[cfg(target_arch = "x86_64")]
unsafe fn kernel<const DIRECT: bool>(
    a: ASrc<'_>,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    csc: isize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract; `isa` names a feature set this CPU has.
    unsafe {
        match isa() {
            Some(Isa::Avx512) => kernel_avx512::<DIRECT>(a, b, c_rows, csc, beta, rows, cols),
            Some(Isa::Avx2) => kernel_avx2::<DIRECT>(a, b, c_rows, csc, beta, rows, cols),
            None => unreachable!("sgemm kernels run only when available()"),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const DIRECT: bool>(
    _: ASrc<'_>,
    _: *const f32,
    _: &[*mut f32; MR],
    _: isize,
    _: f32,
    _: usize,
    _: usize,
) {
    unreachable!("available() is false off x86_64")
}

/// The AVX-512 tile: one pass, 24 zmm accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_avx512<const DIRECT: bool>(
    a: ASrc<'_>,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    csc: isize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract.
    let acc = unsafe {
        match (DIRECT, a.lda) {
            (false, MR) => accumulate_avx512::<false, MR>(a, b),
            (false, 64) => accumulate_avx512::<false, 64>(a, b),
            (false, 128) => accumulate_avx512::<false, 128>(a, b),
            (false, 256) => accumulate_avx512::<false, 256>(a, b),
            (false, 512) => accumulate_avx512::<false, 512>(a, b),
            (false, _) => accumulate_avx512::<false, 0>(a, b),
            // The channel counts of common networks (the row stride of implicit convolution).
            (true, 64) => accumulate_avx512::<true, 64>(a, b),
            (true, 128) => accumulate_avx512::<true, 128>(a, b),
            (true, 256) => accumulate_avx512::<true, 256>(a, b),
            (true, 512) => accumulate_avx512::<true, 512>(a, b),
            (true, _) => accumulate_avx512::<true, 0>(a, b),
        }
    };
    // SAFETY: the caller's contract.
    unsafe { store_avx512(&acc, c_rows, csc, beta, rows, cols) }
}

/// Writes (or adds, with `beta`) the tile's accumulators to `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_avx512(
    acc: &[[__m512; NV]; MR],
    c_rows: &[*mut f32; MR],
    csc: isize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    if csc == 1 {
        let masks: [__mmask16; NV] =
            std::array::from_fn(|h| lane_mask(cols.saturating_sub(16 * h)));
        for (i, row) in acc.iter().enumerate().take(rows) {
            for (h, &mask) in masks.iter().enumerate() {
                // SAFETY: the masked lanes are inside c's row i.
                unsafe {
                    let at = c_rows[i].add(h * 16);
                    let v = if beta == 0.0 {
                        row[h]
                    } else {
                        let old = _mm512_maskz_loadu_ps(mask, at);
                        _mm512_fmadd_ps(_mm512_set1_ps(beta), old, row[h])
                    };
                    _mm512_mask_storeu_ps(at, mask, v);
                }
            }
        }
    } else {
        let mut tile = [0.0f32; NR];
        for (i, row) in acc.iter().enumerate().take(rows) {
            for (h, &v) in row.iter().enumerate() {
                // SAFETY: a local array of NR lanes.
                unsafe { _mm512_storeu_ps(tile.as_mut_ptr().add(16 * h), v) };
            }
            for (j, &v) in tile.iter().enumerate().take(cols) {
                // SAFETY: (i, j) is inside c.
                unsafe {
                    let at = c_rows[i].offset(j as isize * csc);
                    *at = if beta == 0.0 { v } else { v + beta * *at };
                }
            }
        }
    }
}

/// The FMA loop of the register tile, apart from the stores so that the 24 accumulators stay in
/// registers (with the stores' row indexing in the same function, LLVM spilled them every step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn accumulate_avx512<const DIRECT: bool, const LDA: usize>(
    a: ASrc<'_>,
    b: *const f32,
) -> [[__m512; NV]; MR] {
    // A known row stride makes the 12 broadcast addresses constant offsets of one pointer.
    let lda = if LDA == 0 { a.lda } else { LDA };
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let mut p = 0;
    for &tap in a.taps {
        for step in 0..a.run {
            // SAFETY: the B panel holds taps·run rows of NR.
            let bv: [__m512; NV] =
                std::array::from_fn(|h| unsafe { _mm512_loadu_ps(b.add(p * NR + 16 * h)) });
            for (i, row) in acc.iter_mut().enumerate() {
                let at = if DIRECT {
                    i * lda + tap + step
                } else {
                    p * lda + i
                };
                // SAFETY: `ASrc`'s contract (packed: MR·kc elements; direct: MR rows readable).
                let ai = _mm512_set1_ps(unsafe { *a.ptr.add(at) });
                for (r, &bh) in row.iter_mut().zip(&bv) {
                    *r = _mm512_fmadd_ps(ai, bh, *r);
                }
            }
            p += 1;
        }
    }
    acc
}

/// Rows and columns of the AVX2 sub-tile (12 ymm accumulators); four make the 12×32 tile.
const MR2: usize = 6;
const NR2: usize = 16;

/// The AVX2 tile: the 12×32 tile as four 6×16 passes over the same packed panels (A rows 0–5
/// and 6–11, B columns 0–15 and 16–31), skipping the passes a ragged edge leaves empty.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2<const DIRECT: bool>(
    a: ASrc<'_>,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    csc: isize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract, for each sub-tile's rows and columns.
    unsafe {
        passes_avx2(c_rows, csc, beta, rows, cols, |r0, c0| {
            // Rows r0.. of the tile: MR2 rows down a row-major A, MR2 values along a packed one.
            let shift = if DIRECT { r0 * a.lda } else { r0 };
            let sub = ASrc {
                ptr: a.ptr.wrapping_add(shift),
                ..a
            };
            let b = b.add(c0);
            match (DIRECT, a.lda) {
                (false, MR) => accumulate_avx2::<false, MR>(sub, b),
                (false, _) => accumulate_avx2::<false, 0>(sub, b),
                (true, 64) => accumulate_avx2::<true, 64>(sub, b),
                (true, 128) => accumulate_avx2::<true, 128>(sub, b),
                (true, 256) => accumulate_avx2::<true, 256>(sub, b),
                (true, 512) => accumulate_avx2::<true, 512>(sub, b),
                (true, _) => accumulate_avx2::<true, 0>(sub, b),
            }
        })
    }
}

/// The 12×32 tile as 6×16 passes: `pass(r0, c0)` accumulates the sub-tile at rows `r0..`,
/// columns `c0..`, stored here; passes a ragged edge leaves empty are skipped.
///
/// # Safety
/// Each `pass` is safe to call for the tile's sub-tiles; the tile lies within c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn passes_avx2(
    c_rows: &[*mut f32; MR],
    csc: isize,
    beta: f32,
    rows: usize,
    cols: usize,
    pass: impl Fn(usize, usize) -> [[__m256; 2]; MR2],
) {
    for r0 in (0..rows).step_by(MR2) {
        for c0 in (0..cols).step_by(NR2) {
            let (n_rows, n_cols) = (MR2.min(rows - r0), NR2.min(cols - c0));
            let acc = pass(r0, c0);
            for (i, row) in acc.iter().enumerate().take(n_rows) {
                let at = c_rows[r0 + i].wrapping_offset(c0 as isize * csc);
                // SAFETY: (r0 + i, c0..c0 + n_cols) is inside c.
                unsafe { store_row_avx2(at, csc, row, n_cols, beta) };
            }
        }
    }
}

/// `c[j] = v[j] + beta · c[j]` for `j < cols` (at most 16), `csc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_row_avx2(c: *mut f32, csc: isize, v: &[__m256; 2], cols: usize, beta: f32) {
    if csc == 1 {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (h, &v) in v.iter().enumerate() {
            let live = cols.saturating_sub(8 * h).min(8);
            if live == 0 {
                break;
            }
            // SAFETY: the masked lanes are inside c's row (the caller's contract).
            unsafe {
                let at = c.add(8 * h);
                if live == 8 {
                    let v = if beta == 0.0 {
                        v
                    } else {
                        _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(at), v)
                    };
                    _mm256_storeu_ps(at, v);
                } else {
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live as i32), lane);
                    let v = if beta == 0.0 {
                        v
                    } else {
                        let old = _mm256_maskload_ps(at, mask);
                        _mm256_fmadd_ps(_mm256_set1_ps(beta), old, v)
                    };
                    _mm256_maskstore_ps(at, mask, v);
                }
            }
        }
    } else {
        let mut tile = [0.0f32; NR2];
        // SAFETY: a local array of 16 lanes.
        unsafe {
            _mm256_storeu_ps(tile.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(tile.as_mut_ptr().add(8), v[1]);
        }
        for (j, &v) in tile.iter().enumerate().take(cols) {
            // SAFETY: column j of the row is inside c.
            unsafe {
                let at = c.offset(j as isize * csc);
                *at = if beta == 0.0 { v } else { v + beta * *at };
            }
        }
    }
}

/// A row-major 12-row panel of A (rows `rsa` apart, `kc` columns) packed k-major, so that
/// `panel[p·12 + i] = a[i·rsa + p]`, by 8×8 transposes in registers (a scalar strided copy
/// cost ~10% of a GEMM with 128 columns).
///
/// # Safety
/// AVX2; `a[i·rsa + p]` is readable for `i < 12`, `p < kc`; `panel` holds `12·kc` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_rows_avx2(panel: &mut [f32], a: *const f32, rsa: isize, kc: usize) {
    assert!(panel.len() >= MR * kc, "pack: panel too small");
    let row = |i: usize| a.wrapping_offset(i as isize * rsa);
    let out = panel.as_mut_ptr();
    let full = kc / 8 * 8;
    for p in (0..full).step_by(8) {
        // SAFETY: columns p..p + 8 of the 12 rows are readable; the panel holds them.
        unsafe {
            // Rows 0–3, 4–7 and 8–11, each as columns (j, j + 4) in a register's halves.
            let load = |first: usize| -> [__m256; 4] {
                std::array::from_fn(|i| _mm256_loadu_ps(row(first + i).add(p)))
            };
            let (lo, hi, tail) = (
                columns_of_4_rows(load(0)),
                columns_of_4_rows(load(4)),
                columns_of_4_rows(load(8)),
            );
            for j in 0..4 {
                let (at, at4) = (out.add((p + j) * MR), out.add((p + j + 4) * MR));
                _mm256_storeu_ps(at, _mm256_permute2f128_ps::<0x20>(lo[j], hi[j]));
                _mm256_storeu_ps(at4, _mm256_permute2f128_ps::<0x31>(lo[j], hi[j]));
                _mm_storeu_ps(at.add(8), _mm256_castps256_ps128(tail[j]));
                _mm_storeu_ps(at4.add(8), _mm256_extractf128_ps::<1>(tail[j]));
            }
        }
    }
    for p in full..kc {
        for i in 0..MR {
            // SAFETY: as above.
            unsafe { *out.add(p * MR + i) = *row(i).add(p) };
        }
    }
}

/// Four rows of 8 values → for `j < 4`, register `j` holds column `j` of the four rows in its
/// low half and column `j + 4` in its high half (the in-lane half of an 8×8 transpose).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn columns_of_4_rows(r: [__m256; 4]) -> [__m256; 4] {
    let (t0, t1) = (
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
    );
    let (t2, t3) = (
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
    );
    [
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xEE>(t0, t2),
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xEE>(t1, t3),
    ]
}

/// The 6×16 FMA loop (B panel rows `NR` apart), apart from the stores so the accumulators stay
/// in registers, as [`accumulate_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn accumulate_avx2<const DIRECT: bool, const LDA: usize>(
    a: ASrc<'_>,
    b: *const f32,
) -> [[__m256; 2]; MR2] {
    let lda = if LDA == 0 { a.lda } else { LDA };
    let mut acc = [[_mm256_setzero_ps(); 2]; MR2];
    let mut p = 0;
    for &tap in a.taps {
        for step in 0..a.run {
            // SAFETY: the B panel holds taps·run rows of NR (this sub-tile reads 16 of them).
            let bv = unsafe {
                [
                    _mm256_loadu_ps(b.add(p * NR)),
                    _mm256_loadu_ps(b.add(p * NR + 8)),
                ]
            };
            for (i, row) in acc.iter_mut().enumerate() {
                let at = if DIRECT {
                    i * lda + tap + step
                } else {
                    p * lda + i
                };
                // SAFETY: `ASrc`'s contract.
                let ai = _mm256_set1_ps(unsafe { *a.ptr.add(at) });
                row[0] = _mm256_fmadd_ps(ai, bv[0], row[0]);
                row[1] = _mm256_fmadd_ps(ai, bv[1], row[1]);
            }
            p += 1;
        }
    }
    acc
}

/// The 12×32 tile of [`implicit_rows`] on AVX-512: one pass, A row `i` read at
/// `a[i] + taps[t] + s`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_rows_avx512(
    a: &[*const f32; MR],
    taps: &[usize],
    run: usize,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let acc = accumulate_rows_avx512(a, taps, run, b);
        store_avx512(&acc, c_rows, 1, beta, rows, cols);
    }
}

/// The FMA loop of [`kernel_rows_avx512`]: twelve row pointers, each advanced by the tap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn accumulate_rows_avx512(
    rows: &[*const f32; MR],
    taps: &[usize],
    run: usize,
    b: *const f32,
) -> [[__m512; NV]; MR] {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let mut p = 0;
    for &tap in taps {
        let r: [*const f32; MR] = std::array::from_fn(|i| rows[i].wrapping_add(tap));
        for step in 0..run {
            // SAFETY: the B panel holds taps·run rows of NR.
            let bv: [__m512; NV] =
                std::array::from_fn(|h| unsafe { _mm512_loadu_ps(b.add(p * NR + 16 * h)) });
            for (row, &ptr) in acc.iter_mut().zip(&r) {
                // SAFETY: the caller's contract (row i's tap run is readable).
                let ai = _mm512_set1_ps(unsafe { *ptr.add(step) });
                for (r, &bh) in row.iter_mut().zip(&bv) {
                    *r = _mm512_fmadd_ps(ai, bh, *r);
                }
            }
            p += 1;
        }
    }
    acc
}

/// The 12×32 tile of [`implicit_rows`] as [`kernel_avx2`]'s four 6×16 passes, A row `i` read
/// at `a[i] + taps[t] + s`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_rows_avx2(
    a: &[*const f32; MR],
    taps: &[usize],
    run: usize,
    b: *const f32,
    c_rows: &[*mut f32; MR],
    beta: f32,
    rows: usize,
    cols: usize,
) {
    // SAFETY: the caller's contract, for each sub-tile's rows and columns.
    unsafe {
        passes_avx2(c_rows, 1, beta, rows, cols, |r0, c0| {
            let sub: [*const f32; MR2] = std::array::from_fn(|i| a[r0 + i]);
            accumulate_rows_avx2(&sub, taps, run, b.add(c0))
        })
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_rows_avx2(
    _: &[*const f32; MR],
    _: &[usize],
    _: usize,
    _: *const f32,
    _: &[*mut f32; MR],
    _: f32,
    _: usize,
    _: usize,
) {
    unreachable!("implicit_rows runs only on x86_64 with AVX2 + FMA")
}

/// The 6×16 FMA loop of [`kernel_rows_avx2`]: six row pointers, each advanced by the tap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn accumulate_rows_avx2(
    rows: &[*const f32; MR2],
    taps: &[usize],
    run: usize,
    b: *const f32,
) -> [[__m256; 2]; MR2] {
    let mut acc = [[_mm256_setzero_ps(); 2]; MR2];
    let mut p = 0;
    for &tap in taps {
        let r: [*const f32; MR2] = std::array::from_fn(|i| rows[i].wrapping_add(tap));
        for step in 0..run {
            // SAFETY: the B panel holds taps·run rows of NR (this sub-tile reads 16 of them).
            let bv = unsafe {
                [
                    _mm256_loadu_ps(b.add(p * NR)),
                    _mm256_loadu_ps(b.add(p * NR + 8)),
                ]
            };
            for (row, &ptr) in acc.iter_mut().zip(&r) {
                // SAFETY: the caller's contract (row i's tap run is readable).
                let ai = _mm256_set1_ps(unsafe { *ptr.add(step) });
                row[0] = _mm256_fmadd_ps(ai, bv[0], row[0]);
                row[1] = _mm256_fmadd_ps(ai, bv[1], row[1]);
            }
            p += 1;
        }
    }
    acc
}

/// The row pointers of a tile at `c` with row stride `rsc`.
fn rows_of(c: *mut f32, rsc: isize) -> [*mut f32; MR] {
    std::array::from_fn(|i| c.wrapping_offset(i as isize * rsc))
}

#[cfg(target_arch = "x86_64")]
fn lane_mask(lanes: usize) -> __mmask16 {
    if lanes >= 16 {
        0xFFFF
    } else {
        ((1u32 << lanes) - 1) as __mmask16
    }
}

/// matrixmultiply's `sgemm` signature, on our kernel when this CPU runs one.
///
/// # Safety
/// As `matrixmultiply::sgemm`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_best(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        if alpha == 1.0 && for_gemm() {
            sgemm(m, k, n, a, [rsa, csa], b, [rsb, csb], beta, c, [rsc, csc]);
        } else {
            matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_products_match_a_plain_triple_loop() {
        for isa in supported() {
            with_isa(Some(isa), check_gathered);
        }
    }

    fn check_gathered() {
        // Ragged panels, several k blocks (k > 512), one column, an empty sum.
        for (m, k, n) in [
            (13, 7, 33),
            (40, 600, 70),
            (5, 1100, 3),
            (24, 0, 40),
            (1, 3, 1),
        ] {
            // A = srcᵀ with src row-major [k, m] (rows m + 3 apart).
            let ld = m + 3;
            let src: Vec<f32> = (0..k * ld)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            // B's row p starts at x[p·width]; the first half of the columns are consecutive
            // offsets (copied per row), the rest scattered (gathered value by value).
            let width = 2 * n + 5;
            let x: Vec<f32> = (0..k * width + 1)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0)
                .collect();
            let cols: Vec<usize> = (0..n)
                .map(|j| {
                    if j < n / 2 {
                        j + 1
                    } else {
                        (j * 7 + 3) % width
                    }
                })
                .collect();
            let a = unsafe { PackedA::transposed(src.as_ptr(), ld, m, k) };
            let row = |p: usize| x[p * width..].as_ptr();
            let (rp, cp) = (a.panels(), n.div_ceil(NR));
            let mut whole = vec![f32::NAN; m * n];
            unsafe { gathered(&a, row, &cols, 0..rp, 0..cp, whole.as_mut_ptr(), n) };
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| src[p * ld + i] as f64 * x[p * width + cols[j]] as f64)
                        .sum();
                    let got = whole[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{m}x{k}x{n} [{i}, {j}]: {got} vs {want}"
                    );
                }
            }
            // Split into blocks of row and column panels (as threads would): the same bits.
            let mut split = vec![f32::NAN; m * n];
            for rows in [0..rp / 2, rp / 2..rp] {
                for panels in [0..cp / 2, cp / 2..cp] {
                    unsafe {
                        gathered(&a, row, &cols, rows.clone(), panels, split.as_mut_ptr(), n)
                    };
                }
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&split), bits(&whole), "{m}x{k}x{n} split");
        }
    }

    #[test]
    fn matches_a_plain_triple_loop_on_ragged_shapes() {
        let isas = supported();
        eprintln!("kernels this CPU runs: {isas:?}");
        for isa in isas {
            with_isa(Some(isa), || check_ragged_shapes(isa));
        }
    }

    fn check_ragged_shapes(isa: Isa) {
        let shapes = [
            (1, 1, 1),
            (13, 7, 33),
            (150, 300, 70),
            (12, 256, 32),
            (5, 600, 3),
            (300, 40, 64),
            (30, 517, 40),
        ];
        for (m, k, n) in shapes {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0)
                .collect();
            // A row-major (read in place), row-major with rows 1024 apart (packed: rows a
            // multiple of 2 KiB apart would alias in L1), or column-major (packed); B row-major
            // or transposed in memory; C accumulating (beta = 1); B packed per call or once.
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let lda = 1024;
            let a_wide: Vec<f32> = (0..m * lda)
                .map(|i| {
                    if i % lda < k {
                        a[i / lda * k + i % lda]
                    } else {
                        f32::NAN
                    }
                })
                .collect();
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let a_layouts = [
                ("row-major", a.as_ptr(), [k as isize, 1]),
                ("rows 1024 apart", a_wide.as_ptr(), [lda as isize, 1]),
                ("column-major", at.as_ptr(), [1, m as isize]),
            ];
            let b_layouts = [
                ("row-major", b.as_ptr(), [n as isize, 1]),
                ("transposed", bt.as_ptr(), [1, k as isize]),
            ];
            for (a_name, ap, a_strides) in a_layouts {
                for (b_name, bp, b_strides) in b_layouts {
                    for packed_once in [false, true] {
                        let mut c = vec![1.0f32; m * n];
                        unsafe {
                            if packed_once {
                                let pb = PackedBlocks::new(bp, b_strides, k, n);
                                sgemm_packed(
                                    m,
                                    ap,
                                    a_strides,
                                    &pb,
                                    1.0,
                                    c.as_mut_ptr(),
                                    [n as isize, 1],
                                );
                            } else {
                                sgemm(
                                    m,
                                    k,
                                    n,
                                    ap,
                                    a_strides,
                                    bp,
                                    b_strides,
                                    1.0,
                                    c.as_mut_ptr(),
                                    [n as isize, 1],
                                );
                            }
                        }
                        for i in 0..m {
                            for j in 0..n {
                                let want: f32 =
                                    1.0 + (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
                                let got = c[i * n + j];
                                assert!(
                                    (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                                    "{isa:?} ({m},{k},{n}) a {a_name}, b {b_name}, \
                                     packed once {packed_once} [{i},{j}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A 1-D convolution as implicit GEMM: output row `i` (of `m`, `n` channels) is
    /// `Σ_t Σ_s x[i + t·dilation][s] · w[t·run + s]` over a signal of `lda`-wide rows read in
    /// place; and its weight gradient. Every ISA this CPU runs, ragged m, n and channel counts.
    #[test]
    fn implicit_gemm_with_row_pointers_matches_plain_loops() {
        for isa in supported() {
            with_isa(Some(isa), || check_rows(isa));
        }
    }

    fn check_rows(isa: Isa) {
        // Rows read out of order and unevenly spaced (as a strided convolution's are), ragged m
        // and n, taps within and across rows.
        for (m, run, lda, n, taps) in [
            (29, 5, 7, 33, vec![0, 7, 14]),
            (13, 64, 64, 64, vec![0, 64, 128]),
            (40, 3, 3, 20, vec![0, 3, 6, 9, 12]),
            (6, 8, 8, 16, vec![0]),
        ] {
            let spots = 3 * m + taps.len() + 2;
            let x: Vec<f32> = (0..spots * lda)
                .map(|i| ((i * 7 % 17) as f32 - 8.0) / 9.0)
                .collect();
            let row_of = |i: usize| (i * 5 + i / 3) % (2 * m + 1);
            let k = taps.len() * run;
            let w: Vec<f32> = (0..k * n)
                .map(|i| ((i * 3 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let ldc = n + 3;
            let mut out = vec![0.5f32; m * ldc];
            unsafe {
                let packed = PackedB::new(w.as_ptr(), [n as isize, 1], k, n);
                let a_row = |i: usize| x.as_ptr().add(row_of(i) * lda);
                // In two column ranges, as a caller splitting columns across threads does.
                let (all, half) = (packed.panels(), packed.panels() / 2);
                let c = out.as_mut_ptr();
                let c_row = |i: usize| c.add(i * ldc);
                implicit_rows(m, a_row, &taps, run, &packed, 0..half, c_row, 1.0);
                implicit_rows(m, a_row, &taps, run, &packed, half..all, c_row, 1.0);
            }
            for i in 0..m {
                for j in 0..ldc {
                    let mut want = 0.5f32;
                    if j < n {
                        for t in 0..taps.len() {
                            for s in 0..run {
                                want += x[row_of(i) * lda + taps[t] + s] * w[(t * run + s) * n + j];
                            }
                        }
                    }
                    let got = out[i * ldc + j];
                    assert!(
                        (got - want).abs() < 1e-3,
                        "{isa:?} out[{i},{j}] {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A B large enough to be walked in blocks of taps (three taps of 512 values, 128 columns):
    /// the output's bits are the same whether one call covers every panel or threads split
    /// them (the blocks follow from B, not from a caller's share).
    #[test]
    fn row_pointer_gemm_bits_do_not_depend_on_the_column_split() {
        let (m, run, n, taps) = (20, 512, 128, [0, 512, 1024]);
        let x: Vec<f32> = (0..(m + 3) * run)
            .map(|i| ((i * 7 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let k = taps.len() * run;
        let w: Vec<f32> = (0..k * n)
            .map(|i| ((i * 3 % 13) as f32 - 6.0) / 7.0)
            .collect();
        let (mut whole, mut split) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        unsafe {
            let packed = PackedB::new(w.as_ptr(), [n as isize, 1], k, n);
            let a_row = |i: usize| x.as_ptr().add(i * run);
            let all = packed.panels();
            let (w, s) = (whole.as_mut_ptr(), split.as_mut_ptr());
            implicit_rows(m, a_row, &taps, run, &packed, 0..all, |i| w.add(i * n), 0.0);
            for panels in [0..1, 1..all] {
                implicit_rows(m, a_row, &taps, run, &packed, panels, |i| s.add(i * n), 0.0);
            }
        }
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&whole), bits(&split));
    }

    /// The weight gradient through row pointers, its rows split into ranges as threads split
    /// them: out-of-order rows, more than one block of pixels, panels across tap boundaries,
    /// ragged n.
    #[test]
    fn weight_gradient_with_row_pointers_matches_plain_loops() {
        for (m, run, lda, n, taps) in [
            (29, 5, 7, 33, vec![0, 7, 14]),
            (300, 20, 24, 40, vec![0, 24, 48]),
            (13, 64, 64, 64, vec![0, 64, 128]),
        ] {
            let spots = 3 * m + taps.len() + 2;
            let x: Vec<f32> = (0..spots * lda)
                .map(|i| ((i * 7 % 17) as f32 - 8.0) / 9.0)
                .collect();
            let row_of = |q: usize| (q * 5 + q / 3) % (2 * m + 1);
            let g: Vec<f32> = (0..m * n)
                .map(|i| ((i * 3 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let k = taps.len() * run;
            let mut dw = vec![0.25f32; k * n];
            let split = (k / 2).next_multiple_of(MR).min(k);
            for rows in [0..split, split..k] {
                unsafe {
                    let a_row = |q: usize| x.as_ptr().add(row_of(q) * lda);
                    let g_row = |q: usize| g.as_ptr().add(q * n);
                    implicit_rows_weight_grad(
                        m,
                        a_row,
                        &taps,
                        run,
                        g_row,
                        n,
                        dw.as_mut_ptr(),
                        rows,
                    );
                }
            }
            for (r, row) in dw.chunks(n).enumerate() {
                let (t, s) = (r / run, r % run);
                for (j, &got) in row.iter().enumerate() {
                    let want = 0.25
                        + (0..m)
                            .map(|q| x[row_of(q) * lda + taps[t] + s] * g[q * n + j])
                            .sum::<f32>();
                    assert!((got - want).abs() < 1e-3, "dw[{r},{j}] {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn padded_width_weight_gradient_matches_plain_loops() {
        for isa in supported() {
            for (m, run, lda, n, taps) in [
                (30, 5, 7, 33, vec![0, 7, 14]),
                (13, 64, 64, 64, vec![0, 64, 128]),
                (40, 3, 3, 20, vec![0, 3, 6, 9, 12]),
            ] {
                let rows = m + MR + taps.len() + 2;
                let x: Vec<f32> = (0..rows * lda)
                    .map(|i| ((i * 7 % 17) as f32 - 8.0) / 9.0)
                    .collect();
                let k = taps.len() * run;
                let at = |i: usize, t: usize, s: usize| x[i * lda + taps[t] + s];
                let mut dw = vec![0.0f32; k * n];
                let g: Vec<f32> = (0..m * n)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) / 6.0)
                    .collect();
                with_isa(Some(isa), || unsafe {
                    let g_row = |q: usize| (q % 5 != 3).then(|| g.as_ptr().add(q * n));
                    implicit_weight_grad(m, x.as_ptr(), lda, &taps, run, g_row, n, dw.as_mut_ptr());
                });
                for t in 0..taps.len() {
                    for s in 0..run {
                        for j in 0..n {
                            let want: f32 = (0..m)
                                .filter(|q| q % 5 != 3)
                                .map(|q| at(q, t, s) * g[q * n + j])
                                .sum();
                            let got = dw[(t * run + s) * n + j];
                            let what = format!("{isa:?} dw[{t},{s},{j}] {got} vs {want}");
                            assert!((got - want).abs() < 1e-3, "{what}");
                        }
                    }
                }
            }
        }
    }
}

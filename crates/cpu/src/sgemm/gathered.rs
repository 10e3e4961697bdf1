//! A GEMM whose B is gathered: `B[p, j] = *(b_row(p) + b_cols[j])`, a row pointer per row and
//! an offset per column. A convolution's weight gradient `dW[o, (c, tap)] = Σ_p gy[p, o] ·
//! x[p + tap, c]` is one such product with A the output gradient transposed and the columns
//! listed in OIHW order, so the gradient is written once, straight in the layout the weights
//! have: no partial sums per thread, no zero fill, no `[(tap, c), o]` matrix turned around
//! afterwards.

use std::ops::Range;

use super::{kernel, rows_of, ASrc, MR, NR, PACKS};

/// Rows of k (pixels) per block: a task's eight B panels then take 512 KB (in L2) and an A
/// panel 24 KB (in L1) while the tiles pass over them.
const KB: usize = 512;

/// A `[m, k]` matrix packed whole into `MR`-row panels, k-major (panel `ip`, element `(i, p)`
/// at `ip·MR·k + p·MR + i`), zeros past row `m`. Shared by every task of a product.
pub(crate) struct PackedA {
    m: usize,
    k: usize,
    data: Vec<f32>,
}

impl PackedA {
    /// A = srcᵀ for a row-major `[k, m]` `src` with rows `ld` apart (`A[i, p] = src[p·ld + i]`):
    /// each of A's k steps is `MR` contiguous values of `src`. Threads split the panels.
    ///
    /// # Safety
    /// `src[p·ld + i]` is readable for `p < k`, `i < m`.
    pub unsafe fn transposed(src: *const f32, ld: usize, m: usize, k: usize) -> Self {
        let panels = m.div_ceil(MR);
        // Every value is written below, the padding rows' zeros included.
        let mut data = crate::buffer::overwritten(panels * MR * k);
        let out = crate::parallel::Disjoint::new(&mut data);
        let src = src as usize; // an address, so the closure can be shared across threads
        let parts = crate::parallel::parts_for(panels * MR * k, 1 << 15);
        crate::parallel::for_parts(panels, parts, |_, range| {
            for ip in range {
                // SAFETY: each part writes its own panels.
                let panel = unsafe { out.slice(ip * MR * k..(ip + 1) * MR * k) };
                let rows = MR.min(m - ip * MR);
                for (p, dst) in panel.chunks_exact_mut(MR).enumerate() {
                    // SAFETY: row p's values ip·MR.. (the caller's contract).
                    let from = unsafe { (src as *const f32).add(p * ld + ip * MR) };
                    dst[..rows].copy_from_slice(unsafe { std::slice::from_raw_parts(from, rows) });
                    dst[rows..].fill(0.0);
                }
            }
        });
        Self { m, k, data }
    }

    /// Panels of `MR` rows (the last one zero-padded).
    pub fn panels(&self) -> usize {
        self.m.div_ceil(MR)
    }
}

impl Drop for PackedA {
    fn drop(&mut self) {
        crate::buffer::recycle(std::mem::take(&mut self.data));
    }
}

/// `c[i, j] = Σ_p A[i, p] · *(b_row(p) + b_cols[j])` for the rows of A's panels `row_panels`
/// and the columns of the `NR`-column panels `col_panels`, over all of A's k: each value is
/// written once (no beta, no accumulation across calls), `c` row-major with rows `ldc` apart.
/// B's panels are gathered per block of k into this thread's buffer — a copy per row where a
/// panel's offsets are consecutive, value by value otherwise — and each A panel stays in L1
/// while it passes over them.
///
/// # Safety
/// [`super::available`]; `b_row(p) + b_cols[j]` is readable for `p < A.k`, `j < b_cols.len()`;
/// the tiles lie within `c` and no other thread writes them.
pub(crate) unsafe fn gathered(
    a: &PackedA,
    b_row: impl Fn(usize) -> *const f32,
    b_cols: &[usize],
    row_panels: Range<usize>,
    col_panels: Range<usize>,
    c: *mut f32,
    ldc: usize,
) {
    let (m, k, n) = (a.m, a.k, b_cols.len());
    assert!(
        row_panels.end <= a.panels() && col_panels.end <= n.div_ceil(NR),
        "gathered gemm: panels {row_panels:?} x {col_panels:?} of a {m} x {n} product"
    );
    if k == 0 || row_panels.is_empty() || col_panels.is_empty() {
        // An empty sum: zeros.
        for i in row_panels.start * MR..(row_panels.end * MR).min(m) {
            let j = col_panels.start * NR..(col_panels.end * NR).min(n);
            // SAFETY: the caller's contract (these tiles lie within c).
            unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc + j.start), j.len()) }.fill(0.0);
        }
        return;
    }
    let blocks = k.div_ceil(KB);
    let kc_max = k.div_ceil(blocks);
    PACKS.with(|packs| {
        let (_, pb) = &mut *packs.borrow_mut();
        pb.resize(col_panels.len() * NR * kc_max, 0.0);
        for block in 0..blocks {
            let q = block * k / blocks..(block + 1) * k / blocks;
            let kc = q.len();
            for (slot, jp) in col_panels.clone().enumerate() {
                let dst = &mut pb[slot * NR * kc..(slot + 1) * NR * kc];
                // SAFETY: the caller's contract.
                unsafe { gather_panel(dst, &b_row, b_cols, jp, q.clone()) };
            }
            // The first block writes, the others add.
            let beta = if block == 0 { 0.0 } else { 1.0 };
            for ip in row_panels.clone() {
                let rows = MR.min(m - ip * MR);
                let a_src = ASrc {
                    // SAFETY: panel ip's values from k step q.start.
                    ptr: unsafe { a.data.as_ptr().add(ip * MR * k + q.start * MR) },
                    lda: MR,
                    taps: &[0],
                    run: kc,
                };
                for (slot, jp) in col_panels.clone().enumerate() {
                    let cols = NR.min(n - jp * NR);
                    // SAFETY: the panel was gathered above; the tile lies within c (the
                    // caller's contract).
                    unsafe {
                        let panel = pb.as_ptr().add(slot * NR * kc);
                        let tile = rows_of(c.add(ip * MR * ldc + jp * NR), ldc as isize);
                        kernel::<false>(a_src, panel, &tile, 1, beta, rows, cols);
                    }
                }
            }
        }
    });
}

/// Panel `jp` of the gathered B for rows `q` into `dst` (`q.len()·NR` values, zeros past the
/// last column).
///
/// # Safety
/// As [`gathered`].
unsafe fn gather_panel(
    dst: &mut [f32],
    b_row: &impl Fn(usize) -> *const f32,
    b_cols: &[usize],
    jp: usize,
    q: Range<usize>,
) {
    let offsets = &b_cols[jp * NR..((jp + 1) * NR).min(b_cols.len())];
    let cols = offsets.len();
    let consecutive = offsets.windows(2).all(|w| w[1] == w[0] + 1);
    for (p, row) in q.zip(dst.chunks_exact_mut(NR)) {
        let from = b_row(p);
        if consecutive {
            // SAFETY: `cols` consecutive values from this column offset (the caller's
            // contract).
            let src = unsafe { std::slice::from_raw_parts(from.add(offsets[0]), cols) };
            row[..cols].copy_from_slice(src);
        } else {
            for (v, &off) in row.iter_mut().zip(offsets) {
                // SAFETY: the caller's contract.
                *v = unsafe { *from.add(off) };
            }
        }
        row[cols..].fill(0.0);
    }
}

//! Batched matrix product on the SIMD GEMM (matrixmultiply), threads splitting rows.
//!
//! Operands are read in place through their strides (a transposed weight is not copied); f16 and
//! bf16 are widened to f32 once. Work is cut into (batch, row block) tasks with fixed boundaries;
//! every output element is one GEMM dot product in a fixed order, so results do not depend on
//! the thread count.

use redline_tensor::Layout;

use crate::buffer::{as_compute, from_compute, overwritten, with_compute, zeros, Data, Real};
use crate::parallel::{self, Disjoint};
use crate::sgemm;

/// Rows per task below which a GEMM is not split further.
const MIN_ROWS: usize = 64;
/// At most this many rows (a classifier's batch) against a B of at least [`FEW_ROWS_MIN_B`]
/// elements: one pass over B instead of a packed GEMM.
const FEW_ROWS: usize = 16;
const FEW_ROWS_MIN_B: usize = 1 << 16;

pub(crate) fn matmul(a: &Data, al: &Layout, b: &Data, bl: &Layout) -> Data {
    with_compute!(a.dtype(), C => {
        let (x, y) = (as_compute::<C>(a), as_compute::<C>(b));
        from_compute(a.dtype(), batched::<C>(&x, al, &y, bl))
    })
}

/// A strided matrix operand: base offset, [row, column] strides.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, C> {
    pub data: &'a [C],
    pub offset: usize,
    pub strides: [usize; 2],
}

impl<C> Mat<'_, C> {
    fn istrides(&self) -> [isize; 2] {
        [self.strides[0] as isize, self.strides[1] as isize]
    }
}

/// `c[m, n] = a[m, k] · b[k, n]` (plus `c` when `accumulate`) for the rows `rows` only,
/// on the calling thread; `c` is row-major with row stride `ldc` starting at row 0.
///
/// Panics (never undefined behaviour) if an operand does not cover its matrix.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_rows<C: Real>(
    a: Mat<'_, C>,
    b: Mat<'_, C>,
    k: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    c: &mut [C],
    ldc: usize,
    accumulate: bool,
) {
    let m = rows.len();
    if m == 0 || n == 0 {
        return;
    }
    let last = |mat: &Mat<'_, C>, r: usize, cols: usize| {
        mat.offset + r.saturating_sub(1) * mat.strides[0] + cols.saturating_sub(1) * mat.strides[1]
    };
    assert!(
        k == 0 || last(&a, rows.end, k) < a.data.len(),
        "gemm: a out of bounds"
    );
    assert!(
        k == 0 || last(&b, k, n) < b.data.len(),
        "gemm: b out of bounds"
    );
    assert!((m - 1) * ldc + n <= c.len(), "gemm: c out of bounds");
    let beta = if accumulate { C::ONE } else { C::ZERO };
    let a_at = a.offset + rows.start * a.strides[0];
    // SAFETY: the bounds were checked above; `c` is a distinct mutable slice.
    unsafe {
        C::gemm(
            m,
            k,
            n,
            C::ONE,
            a.data.as_ptr().add(a_at),
            a.istrides(),
            b.data.as_ptr().add(b.offset),
            b.istrides(),
            beta,
            c.as_mut_ptr(),
            [ldc as isize, 1],
        )
    }
}

/// A GEMM's B operand shared by many calls (a convolution's weights across row tiles and
/// threads): packed once for our f32 kernel when it runs, else read as it is.
pub(crate) enum SharedB<'a, C> {
    Plain(Mat<'a, C>),
    Packed(sgemm::PackedBlocks),
}

impl<'a, C: Real> SharedB<'a, C> {
    /// `b` as a `[k, n]` matrix. Panics if it does not cover it.
    pub fn new(b: Mat<'a, C>, k: usize, n: usize) -> Self {
        let last =
            b.offset + k.saturating_sub(1) * b.strides[0] + n.saturating_sub(1) * b.strides[1];
        assert!(
            k == 0 || n == 0 || last < b.data.len(),
            "gemm: b out of bounds"
        );
        match C::as_f32(b.data) {
            Some(data) if sgemm::for_gemm() && k > 0 && n > 0 => {
                // SAFETY: bounds checked above.
                let ptr = unsafe { data.as_ptr().add(b.offset) };
                Self::Packed(unsafe { sgemm::PackedBlocks::new(ptr, b.istrides(), k, n) })
            }
            _ => Self::Plain(b),
        }
    }

    /// [`gemm_rows`] with this B (`[k, n]` as given to [`SharedB::new`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_rows(
        &self,
        a: Mat<'_, C>,
        k: usize,
        n: usize,
        rows: std::ops::Range<usize>,
        c: &mut [C],
        ldc: usize,
        accumulate: bool,
    ) {
        match self {
            SharedB::Plain(b) => gemm_rows(a, *b, k, n, rows, c, ldc, accumulate),
            SharedB::Packed(p) => packed_gemm_rows(p, a, k, n, rows, c, ldc, accumulate),
        }
    }
}

/// [`gemm_rows`] with B packed for our kernel (f32 operands only).
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_gemm_rows<C: Real>(
    packed: &sgemm::PackedBlocks,
    a: Mat<'_, C>,
    k: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    c: &mut [C],
    ldc: usize,
    accumulate: bool,
) {
    assert!(
        packed.k() == k && packed.n() == n,
        "gemm: B is [{}, {}]",
        packed.k(),
        packed.n()
    );
    assert!(
        C::as_f32(a.data).is_some(),
        "gemm: a packed B takes f32 operands"
    );
    let m = rows.len();
    if m == 0 {
        return;
    }
    let last = a.offset + (rows.end - 1) * a.strides[0] + k.saturating_sub(1) * a.strides[1];
    assert!(k == 0 || last < a.data.len(), "gemm: a out of bounds");
    assert!((m - 1) * ldc + n <= c.len(), "gemm: c out of bounds");
    // C is f32 (checked above): the pointers are f32 pointers.
    let a_ptr = a.data[a.offset + rows.start * a.strides[0]..].as_ptr() as *const f32;
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: bounds checked above; `c` is a distinct mutable slice.
    unsafe {
        sgemm::sgemm_packed(
            m,
            a_ptr,
            a.istrides(),
            packed,
            beta,
            c.as_mut_ptr() as *mut f32,
            [ldc as isize, 1],
        )
    }
}

fn batched<C: Real>(x: &[C], al: &Layout, y: &[C], bl: &Layout) -> Vec<C> {
    let r = al.rank();
    let (m, k, n) = (al.shape()[r - 2], al.shape()[r - 1], bl.shape()[r - 1]);
    let batch_shape = &al.shape()[..r - 2];
    let batches: usize = batch_shape.iter().product();
    let batch_of = |l: &Layout| {
        Layout::new(
            batch_shape.to_vec(),
            l.strides()[..r - 2].to_vec(),
            l.offset(),
        )
    };
    let (ab, bb) = (batch_of(al), batch_of(bl));
    if batches == 1 && m <= FEW_ROWS && k * n >= FEW_ROWS_MIN_B {
        let a = Mat {
            data: x,
            offset: al.offset(),
            strides: [al.strides()[r - 2], al.strides()[r - 1]],
        };
        let b = Mat {
            data: y,
            offset: bl.offset(),
            strides: [bl.strides()[r - 2], bl.strides()[r - 1]],
        };
        return few_rows(a, b, m, k, n);
    }
    let mut out = overwritten::<C>(batches * m * n);
    // Tasks: (batch, row block). Few large matrices split their rows; many small ones don't.
    let blocks = if batches >= parallel::threads() {
        1
    } else {
        parallel::parts_for(m, MIN_ROWS)
    };
    let tasks = batches * blocks;
    let c = Disjoint::new(&mut out);
    let task = |task: usize| {
        let (batch, block) = (task / blocks, task % blocks);
        let rows = parallel::part_range(m, blocks, block);
        let a = Mat {
            data: x,
            offset: ab.index_of(batch),
            strides: [al.strides()[r - 2], al.strides()[r - 1]],
        };
        let b = Mat {
            data: y,
            offset: bb.index_of(batch),
            strides: [bl.strides()[r - 2], bl.strides()[r - 1]],
        };
        let start = (batch * m + rows.start) * n;
        // SAFETY: each task owns the rows `rows` of its batch: disjoint ranges of `out`.
        let dst = unsafe { c.slice(start..start + rows.len() * n) };
        gemm_rows(a, b, k, n, rows, dst, n, false);
    };
    if tasks * m * n * k.max(1) < 1 << 18 {
        (0..tasks).for_each(task);
    } else {
        parallel::for_each_task(tasks, task);
    }
    out
}

/// `a[m, k] · b[k, n]` for few rows `m` (ResNet's classifier: 8 × 2048 by 2048 × 1000): a
/// packed GEMM would copy all of B (8 MB) to multiply it by a handful of rows, on one thread
/// (a task per 64 rows). Instead threads split B's columns and read B once, along its
/// contiguous axis: rows of B (`c_i += a_ik · b_k`) or, for a transposed B (a weight read as
/// `Wᵀ`), its columns (`c_ij = a_i · b_j`). Each output is a fixed sequence of operations.
fn few_rows<C: Real>(a: Mat<'_, C>, b: Mat<'_, C>, m: usize, k: usize, n: usize) -> Vec<C> {
    let mut out = zeros::<C>(m * n);
    let c = Disjoint::new(&mut out);
    // A's rows as slices when they are contiguous (else gathered once: m·k values).
    let a_rows: Vec<Vec<C>> = (0..m)
        .map(|i| {
            (0..k)
                .map(|p| a.data[a.offset + i * a.strides[0] + p * a.strides[1]])
                .collect()
        })
        .collect();
    let parts = parallel::parts_for(n, 64);
    parallel::for_parts(n, parts, |_, cols| {
        // SAFETY: each part writes its own columns of every row.
        let row = |i: usize| unsafe { c.slice(i * n + cols.start..i * n + cols.end) };
        if b.strides[0] == 1 && b.strides[1] != 1 {
            // B's columns are contiguous: one dot product per output, in 16 fixed lanes.
            for j in cols.clone() {
                let column = &b.data[b.offset + j * b.strides[1]..][..k];
                for (i, a_row) in a_rows.iter().enumerate() {
                    row(i)[j - cols.start] = dot(a_row, column);
                }
            }
            return;
        }
        // Along B's rows.
        for p in 0..k {
            let at = b.offset + p * b.strides[0];
            for (i, a_row) in a_rows.iter().enumerate() {
                let aip = a_row[p];
                let dst = row(i);
                if b.strides[1] == 1 {
                    let b_row = &b.data[at + cols.start..at + cols.end];
                    for (v, &bv) in dst.iter_mut().zip(b_row) {
                        *v += aip * bv;
                    }
                } else {
                    for (v, j) in dst.iter_mut().zip(cols.clone()) {
                        *v += aip * b.data[at + j * b.strides[1]];
                    }
                }
            }
        }
    });
    out
}

/// `Σ x_p · y_p` in 16 lanes (`p mod 16`), then the lanes and the tail in order: vectorised,
/// and the same bits on every run.
fn dot<C: Real>(x: &[C], y: &[C]) -> C {
    const L: usize = 16;
    let mut lanes = [C::ZERO; L];
    let (xc, yc) = (x.chunks_exact(L), y.chunks_exact(L));
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for l in 0..L {
            lanes[l] += xs[l] * ys[l];
        }
    }
    let mut sum = C::ZERO;
    for v in lanes {
        sum += v;
    }
    for (&a, &b) in xt.iter().zip(yt) {
        sum += a * b;
    }
    sum
}

//! A matmul as a column-major BLAS call: the plan cuBLASLt runs (see `cublaslt.rs`).
//!
//! BLAS is column-major and redline row-major, so `C[M, N] = A[M, K] · B[K, N]` is computed as
//! its transpose, `Cᵀ[N, M] = Bᵀ · Aᵀ`: BLAS's first operand is our `b`, its second our `a`, and
//! the row-major output `C` is the column-major `Cᵀ` with leading dimension `N`. A row-major
//! operand is a column-major one transposed, so each operand only needs one unit stride among its
//! last two axes; its batch axes must collapse to one stride (0 for a broadcast batch). Anything
//! else (broadcast rows, two strided batch axes) has no plan and runs on our own kernel.
//!
//! Pure data, so the mapping is tested on the host against the reference product
//! (`tests` below runs a plan the way BLAS reads it).

use redline_tensor::{DType, Layout};

/// One BLAS operand: the stored column-major matrix is `rows × cols` with leading dimension
/// `ld`; `transposed` applies op(X) = Xᵀ to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlasMatrix {
    pub transposed: bool,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
    /// Elements between consecutive batch entries (0: every entry reads the same matrix).
    pub batch_stride: i64,
    /// The first element, in elements from the storage's start.
    pub offset: usize,
}

/// `d = op(a) · op(b)` in BLAS terms, `m × n` with inner dimension `k`, `batch` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmPlan {
    pub dtype: DType,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    /// BLAS's first operand: our `b`.
    pub a: BlasMatrix,
    /// BLAS's second operand: our `a`.
    pub b: BlasMatrix,
    /// The contiguous output `[.., M, N]` read column-major: `m` rows (our N), `ld = m`.
    pub d: BlasMatrix,
}

/// A row-major `[rows, cols]` operand with strides `(sr, sc)` as the column-major BLAS operand
/// of its transpose, `cols × rows`: unit column stride is the stored matrix itself, unit row
/// stride its transpose.
fn blas_operand(rows: usize, cols: usize, sr: usize, sc: usize) -> Option<(bool, u64, u64, i64)> {
    // An axis of size 1 is never stepped along, so its stride is free: pick the one that fits.
    if (sc == 1 || cols == 1) && (rows == 1 || sr >= cols.max(1)) {
        // Row-major with ld `sr` is column-major `cols × rows`: already op(X) = Xᵀ's shape.
        let ld = if rows == 1 { cols.max(1) } else { sr };
        Some((false, cols as u64, rows as u64, ld as i64))
    } else if (sr == 1 || rows == 1) && (cols == 1 || sc >= rows.max(1)) {
        // Column-major `rows × cols` with ld `sc`: BLAS transposes it.
        let ld = if cols == 1 { rows.max(1) } else { sc };
        Some((true, rows as u64, cols as u64, ld as i64))
    } else {
        None
    }
}

/// The batch axes of `layout` (all but the last two) as one `(count, stride)`, if they collapse.
fn batch_stride(layout: &Layout) -> Option<i64> {
    let r = layout.shape().len();
    let axes: Vec<(usize, usize)> = layout.shape()[..r - 2]
        .iter()
        .zip(&layout.strides()[..r - 2])
        .filter(|(&n, _)| n != 1)
        .map(|(&n, &s)| (n, s))
        .collect();
    let Some(&(_, innermost)) = axes.last() else {
        return Some(0);
    };
    // Row-major over the batch axes: each stride is the next one's times its size (or all 0).
    for pair in axes.windows(2) {
        let ((_, outer), (n, inner)) = (pair[0], pair[1]);
        if outer != inner * n {
            return None;
        }
    }
    Some(innermost as i64)
}

impl GemmPlan {
    /// The plan for `a [.., M, K] @ b [.., K, N]` (equal batch shapes, as the Backend contract
    /// gives them) into a contiguous `[.., M, N]`, or `None` where BLAS cannot read an operand.
    pub fn new(dtype: DType, a: &Layout, b: &Layout) -> Option<GemmPlan> {
        let (sa, sb) = (a.shape(), b.shape());
        let r = sa.len();
        if r < 2 || sb.len() != r {
            return None;
        }
        let (m, k, n) = (sa[r - 2], sa[r - 1], sb[r - 1]);
        let batch: usize = sa[..r - 2].iter().product();
        let (ta, tb) = (a.strides(), b.strides());
        // Ours b [K, N] → BLAS a (N × K after op); ours a [M, K] → BLAS b (K × M after op).
        let (a_t, a_rows, a_cols, a_ld) = blas_operand(k, n, tb[r - 2], tb[r - 1])?;
        let (b_t, b_rows, b_cols, b_ld) = blas_operand(m, k, ta[r - 2], ta[r - 1])?;
        let matrix = |transposed, rows, cols, ld, batch_stride, offset| BlasMatrix {
            transposed,
            rows,
            cols,
            ld,
            batch_stride,
            offset,
        };
        Some(GemmPlan {
            dtype,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            batch: batch as u64,
            a: matrix(a_t, a_rows, a_cols, a_ld, batch_stride(b)?, b.offset()),
            b: matrix(b_t, b_rows, b_cols, b_ld, batch_stride(a)?, a.offset()),
            d: matrix(
                false,
                n as u64,
                m as u64,
                n.max(1) as i64,
                (m * n) as i64,
                0,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `X(i, j)` of a BLAS operand after op, batch entry `e`, as BLAS reads memory.
    fn read(x: &BlasMatrix, data: &[f64], e: u64, i: u64, j: u64) -> f64 {
        let (r, c) = if x.transposed { (j, i) } else { (i, j) };
        assert!(r < x.rows && c < x.cols, "({r}, {c}) outside {x:?}");
        assert!(x.ld >= x.rows.max(1) as i64, "ld below rows: {x:?}");
        let at = x.offset as i64 + e as i64 * x.batch_stride + r as i64 + c as i64 * x.ld;
        data[at as usize]
    }

    /// Runs `plan` as a column-major BLAS would and returns the row-major `[.., M, N]` output.
    fn run(plan: &GemmPlan, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut d = vec![f64::NAN; (plan.batch * plan.m * plan.n) as usize];
        for e in 0..plan.batch {
            for i in 0..plan.m {
                for j in 0..plan.n {
                    let sum: f64 = (0..plan.k)
                        .map(|l| read(&plan.a, b, e, i, l) * read(&plan.b, a, e, l, j))
                        .sum();
                    let at = e as i64 * plan.d.batch_stride + i as i64 + j as i64 * plan.d.ld;
                    d[at as usize] = sum;
                }
            }
        }
        d
    }

    /// The reference product read through the layouts directly.
    fn reference(a: &Layout, ad: &[f64], b: &Layout, bd: &[f64]) -> Vec<f64> {
        let r = a.shape().len();
        let (m, k, n) = (a.shape()[r - 2], a.shape()[r - 1], b.shape()[r - 1]);
        let batch_shape = &a.shape()[..r - 2];
        let batch: usize = batch_shape.iter().product();
        let at = |l: &Layout, idx: &[usize]| -> usize {
            l.offset()
                + idx
                    .iter()
                    .zip(l.strides())
                    .map(|(i, s)| i * s)
                    .sum::<usize>()
        };
        let mut out = Vec::new();
        for e in 0..batch {
            let mut idx = vec![0; r];
            let mut rest = e;
            for d in (0..r - 2).rev() {
                idx[d] = rest % batch_shape[d];
                rest /= batch_shape[d];
            }
            for i in 0..m {
                for j in 0..n {
                    let mut sum = 0.0;
                    for l in 0..k {
                        let (mut ia, mut ib) = (idx.clone(), idx.clone());
                        (ia[r - 2], ia[r - 1], ib[r - 2], ib[r - 1]) = (i, l, l, j);
                        sum += ad[at(a, &ia)] * bd[at(b, &ib)];
                    }
                    out.push(sum);
                }
            }
        }
        out
    }

    fn layout(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout::new(shape.to_vec(), strides.to_vec(), offset)
    }

    fn data(layout: &Layout, salt: f64) -> Vec<f64> {
        let len = layout.storage_extent().max(1);
        (0..len).map(|i| ((i as f64) * 0.37 + salt).sin()).collect()
    }

    fn check(a: Layout, b: Layout) {
        let plan = GemmPlan::new(DType::F32, &a, &b)
            .unwrap_or_else(|| panic!("no plan for {a:?} @ {b:?}"));
        let (ad, bd) = (data(&a, 0.1), data(&b, 0.7));
        let got = run(&plan, &ad, &bd);
        let want = reference(&a, &ad, &b, &bd);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "{a:?} @ {b:?}: {got:?} vs {want:?}");
        }
    }

    #[test]
    fn contiguous_transposed_and_offset_operands_map_to_blas() {
        let (m, k, n) = (3, 5, 4);
        check(layout(&[m, k], &[k, 1], 0), layout(&[k, n], &[n, 1], 0));
        // aᵀ and bᵀ stored (strides swapped), with offsets and padded leading dimensions.
        check(
            layout(&[m, k], &[1, m + 2], 3),
            layout(&[k, n], &[1, k + 1], 5),
        );
        check(layout(&[m, k], &[k + 3, 1], 1), layout(&[k, n], &[1, k], 0));
        // Vectors: M = 1, N = 1, K = 1, with arbitrary strides on their size-1 axes.
        check(layout(&[1, k], &[99, 1], 0), layout(&[k, 1], &[1, 42], 0));
        check(layout(&[m, 1], &[1, 7], 0), layout(&[1, n], &[3, 1], 2));
        check(layout(&[1, 1], &[5, 9], 1), layout(&[1, 1], &[2, 8], 0));
        // A row of a with a non-unit element stride (a column of a transposed matrix).
        check(layout(&[1, k], &[1, 3], 2), layout(&[k, n], &[n, 1], 0));
    }

    #[test]
    fn batches_collapse_to_one_stride_or_broadcast() {
        let (m, k, n) = (2, 3, 4);
        // Two batch axes, dense; b broadcast over the whole batch (stride 0).
        check(
            layout(&[2, 3, m, k], &[3 * m * k, m * k, k, 1], 0),
            layout(&[2, 3, k, n], &[0, 0, n, 1], 1),
        );
        // A size-1 batch axis with a stray stride, and a transposed batch of b.
        check(
            layout(&[3, 1, m, k], &[m * k, 77, k, 1], 0),
            layout(&[3, 1, k, n], &[k * n, 5, 1, k], 0),
        );
    }

    #[test]
    fn layouts_blas_cannot_read_have_no_plan() {
        let (m, k, n) = (3, 4, 5);
        let a = layout(&[m, k], &[k, 1], 0);
        // b with broadcast rows (stride 0 along K) and with no unit stride at all.
        assert!(GemmPlan::new(DType::F32, &a, &layout(&[k, n], &[0, 1], 0)).is_none());
        assert!(GemmPlan::new(DType::F32, &a, &layout(&[k, n], &[2 * n, 2], 0)).is_none());
        // A batch broadcast on one axis but not the other cannot collapse to one stride.
        let a = layout(&[2, 3, m, k], &[0, m * k, k, 1], 0);
        let b = layout(&[2, 3, k, n], &[3 * k * n, k * n, n, 1], 0);
        assert!(GemmPlan::new(DType::F32, &a, &b).is_none());
    }
}

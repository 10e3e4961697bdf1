//! cuBLASLt runs a [`GemmPlan`] on the driver's stream.
//!
//! f32 is true f32 (`CUBLAS_COMPUTE_32F`, no TF32: cudarc's safe f32 matmul forces TF32, so this
//! goes below it); f16 and bf16 multiply on tensor cores and accumulate in f32. One descriptor
//! set and algorithm per (plan, pointer alignments), chosen by cuBLASLt's heuristic once and
//! cached; the alignments are part of the key because the heuristic assumes 256-byte aligned
//! operands unless told otherwise, and a view's offset can break that. The workspace is one
//! device allocation kept for the device's life, so a steady step allocates nothing.
//!
//! The library is the exact file [`libs`] found (`libcublasLt.so.<CUDA major>`), loaded before
//! cudarc's first call; after the handle exists, the mapped files are checked so that cudarc's own
//! lookup (which tries the unversioned name first) did not bring in a second copy.

use std::ffi::c_void;

use cudarc::cublaslt::{result, sys};
use redline_tensor::DType;

use crate::gemm::{BlasMatrix, GemmPlan};
use crate::gpu::DevicePtr;
use crate::libs::{self, LibReport};
use crate::plans::{Declined, PlanCache, Verdict};

/// cuBLAS's recommended workspace on Hopper and Blackwell.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Descriptors and the algorithm for one plan, made once.
struct Prepared {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: cuBLASLt descriptors are plain host objects, never changed after `prepare`.
unsafe impl Send for Prepared {}
unsafe impl Sync for Prepared {}

impl Drop for Prepared {
    fn drop(&mut self) {
        // SAFETY: made in `prepare`, used by nothing once the plan is dropped.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in [self.a, self.b, self.d] {
                let _ = result::destroy_matrix_layout(l);
            }
        }
    }
}

/// A plan and its operands' alignments (A, B, D), which the chosen algorithm depends on.
type PlanKey = (GemmPlan, [u32; 3]);

/// The loaded library and its handle.
pub struct CublasLt {
    handle: sys::cublasLtHandle_t,
    pub report: LibReport,
    plans: PlanCache<PlanKey, Prepared>,
}

// SAFETY: a cuBLASLt handle may be used from any thread; calls are serialised per plan by the
// caller's stream order, and the cache is behind a mutex.
unsafe impl Send for CublasLt {}
unsafe impl Sync for CublasLt {}

fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The largest power of two (at most 256) that divides `ptr`: what cuBLASLt may assume.
fn alignment(ptr: DevicePtr) -> u32 {
    if ptr.0 == 0 {
        256
    } else {
        (1u64 << ptr.0.trailing_zeros().min(8)) as u32
    }
}

fn status(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuBLASLt {what}: {e:?}")
}

/// What a failed call's status says: an unsupported or invalid parameter, or a type this
/// architecture lacks, is this plan's; a library not set up or not licensed runs no plan here;
/// anything else (execution, memory, internal) is the call's failure.
fn verdict(e: &result::CublasError) -> Verdict {
    use sys::cublasStatus_t::*;
    match e.0 {
        CUBLAS_STATUS_NOT_SUPPORTED | CUBLAS_STATUS_INVALID_VALUE | CUBLAS_STATUS_ARCH_MISMATCH => {
            Verdict::NotForPlan
        }
        CUBLAS_STATUS_NOT_INITIALIZED | CUBLAS_STATUS_LICENSE_ERROR => Verdict::Unusable,
        _ => Verdict::Failed,
    }
}

/// Sets attribute `attr` of descriptor `obj` to `value` through cuBLASLt's setter `set` (`T` is
/// the attribute's type in cuBLASLt's table).
unsafe fn attr<O, A, T>(
    set: unsafe fn(O, A, *const c_void, usize) -> Result<(), result::CublasError>,
    obj: O,
    attr: A,
    value: &T,
) -> Result<(), String> {
    set(
        obj,
        attr,
        (value as *const T).cast(),
        std::mem::size_of::<T>(),
    )
    .map_err(|e| status("attribute", e))
}

impl CublasLt {
    /// Finds and loads `libcublasLt.so.<major>` and creates a handle (the driver's context must
    /// be current). An error is an ordinary answer: the caller uses its own GEMM and says why.
    pub fn load() -> Result<Self, String> {
        let file = format!("libcublasLt.so.{}", libs::CUDA_MAJOR);
        let report = libs::load_for_cudarc(&file).map_err(|e| e.to_string())?;
        // cudarc opens its own handle (the unversioned name first): a stray copy it would call
        // into is refused before the first call.
        // SAFETY: opening the library runs no code of ours; a missing one panics, caught.
        libs::catch_panic("loading cuBLASLt", || {
            unsafe { sys::culib() };
        })?;
        libs::check_single_copy(&report.path, "libcublasLt.so")?;
        let handle = libs::catch_panic("cublasLtCreate", result::create_handle)?
            .map_err(|e| status("create", e))?;
        // SAFETY: the library is loaded (above); cublasLtGetVersion takes no arguments.
        let version = unsafe { sys::cublasLtGetVersion() };
        let report = LibReport {
            version: format!(
                "{}.{}.{}",
                version / 10000,
                version / 100 % 100,
                version % 100
            ),
            ..report
        };
        Ok(Self {
            handle,
            report,
            plans: PlanCache::default(),
        })
    }

    fn layout(
        dtype: sys::cudaDataType,
        m: &BlasMatrix,
        batch: u64,
    ) -> Result<sys::cublasLtMatrixLayout_t, String> {
        use sys::cublasLtMatrixLayoutAttribute_t as Attr;
        let layout = result::create_matrix_layout(dtype, m.rows, m.cols, m.ld)
            .map_err(|e| status("matrix layout", e))?;
        if batch > 1 {
            let count = i32::try_from(batch).map_err(|_| format!("{batch} batches"))?;
            // SAFETY: `layout` was just created; i32 count and i64 stride are cuBLASLt's types.
            unsafe {
                attr(
                    result::set_matrix_layout_attribute,
                    layout,
                    Attr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    &count,
                )?;
                attr(
                    result::set_matrix_layout_attribute,
                    layout,
                    Attr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    &m.batch_stride,
                )?;
            }
        }
        Ok(layout)
    }

    fn prepare(&self, plan: &GemmPlan, align: [u32; 3]) -> Result<Prepared, String> {
        let dtype = data_type(plan.dtype)
            .ok_or_else(|| format!("no cuBLASLt type for {:?}", plan.dtype))?;
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| status("matmul descriptor", e))?;
        // cublasOperation_t as the attribute's int32: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (the
        // enum lives in cuBLAS's bindings, not cuBLASLt's).
        let op = |t: bool| t as i32;
        use sys::cublasLtMatmulDescAttributes_t as Desc;
        // SAFETY: `desc` was just created; an int32 is the attributes' type.
        unsafe {
            attr(
                result::set_matmul_desc_attribute,
                desc,
                Desc::CUBLASLT_MATMUL_DESC_TRANSA,
                &op(plan.a.transposed),
            )?;
            attr(
                result::set_matmul_desc_attribute,
                desc,
                Desc::CUBLASLT_MATMUL_DESC_TRANSB,
                &op(plan.b.transposed),
            )?;
        }
        let a = Self::layout(dtype, &plan.a, plan.batch)?;
        let b = Self::layout(dtype, &plan.b, plan.batch)?;
        let d = Self::layout(dtype, &plan.d, plan.batch)?;
        let pref = result::create_matmul_pref().map_err(|e| status("preference", e))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: `pref` was just created; u64 workspace bytes and u32 alignments are the
        // attributes' types; the descriptors are the ones made above.
        let algo = unsafe {
            let found = (|| {
                attr(
                    result::set_matmul_pref_attribute,
                    pref,
                    Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &workspace,
                )?;
                attr(
                    result::set_matmul_pref_attribute,
                    pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    &align[0],
                )?;
                attr(
                    result::set_matmul_pref_attribute,
                    pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    &align[1],
                )?;
                attr(
                    result::set_matmul_pref_attribute,
                    pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    &align[2],
                )?;
                attr(
                    result::set_matmul_pref_attribute,
                    pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    &align[2],
                )?;
                result::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref)
                    .map_err(|e| status(&format!("no algorithm for {plan:?}"), e))
            })();
            let _ = result::destroy_matmul_pref(pref);
            found?.algo
        };
        Ok(Prepared {
            desc,
            a,
            b,
            d,
            algo,
        })
    }

    /// Enqueues `d = op(a) · op(b)` on `stream` (pointers at each operand's first element).
    /// [`Declined::Refused`]: cuBLASLt does not take this plan (no algorithm, or a call it
    /// rejects as not for it outside a capture; see [`CublasLt::refusals`]) — the caller runs
    /// its own kernel. [`Declined::Failed`]: the call failed. Nothing was enqueued either way.
    pub fn gemm(
        &self,
        plan: &GemmPlan,
        [a, b, d]: [DevicePtr; 3],
        workspace: DevicePtr,
        stream: cudarc::driver::sys::CUstream,
        capturing: bool,
    ) -> Result<(), Declined> {
        let align = [alignment(a), alignment(b), alignment(d)];
        // Offsets are in the pointers already; they must not multiply the cache's entries.
        let mut key = (*plan, align);
        for m in [&mut key.0.a, &mut key.0.b, &mut key.0.d] {
            m.offset = 0;
        }
        let Ok(p) = self
            .plans
            .get_or_prepare(&key, || self.prepare(plan, align))
        else {
            return Err(Declined::Refused);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ptr = |x: DevicePtr| x.0 as *mut c_void;
        // SAFETY: descriptors from `prepare`; the pointers hold the operands the plan describes
        // (the launcher built the plan from their layouts), the workspace holds WORKSPACE_BYTES.
        #[rustfmt::skip]
        let called = unsafe {
            result::matmul(
                self.handle, p.desc, (&alpha as *const f32).cast(), (&beta as *const f32).cast(),
                ptr(a), p.a, ptr(b), p.b, ptr(d), p.d, ptr(d), p.d,
                &p.algo, ptr(workspace), WORKSPACE_BYTES, stream as sys::cudaStream_t,
            )
        };
        called.map_err(|e| {
            let why = status("matmul", e);
            self.plans.decline(&key, why, verdict(&e), capturing)
        })
    }

    /// The plans cuBLASLt refused so far, with why (our kernel runs them).
    pub fn refusals(&self) -> Vec<String> {
        self.plans.refusals()
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: nothing uses the handle after this.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_parameters_refuse_a_plan_a_library_not_set_up_refuses_all_and_failures_fail() {
        use sys::cublasStatus_t::*;
        let of = |s| verdict(&result::CublasError(s));
        for s in [
            CUBLAS_STATUS_NOT_SUPPORTED,
            CUBLAS_STATUS_INVALID_VALUE,
            CUBLAS_STATUS_ARCH_MISMATCH,
        ] {
            assert_eq!(of(s), Verdict::NotForPlan, "{s:?}");
        }
        for s in [CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_LICENSE_ERROR] {
            assert_eq!(of(s), Verdict::Unusable, "{s:?}");
        }
        for s in [
            CUBLAS_STATUS_EXECUTION_FAILED,
            CUBLAS_STATUS_INTERNAL_ERROR,
            CUBLAS_STATUS_ALLOC_FAILED,
            CUBLAS_STATUS_MAPPING_ERROR,
        ] {
            assert_eq!(of(s), Verdict::Failed, "{s:?}");
        }
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(DevicePtr(0x7f00_0000_0000)), 256);
        assert_eq!(alignment(DevicePtr(0x7f00_0000_0002)), 2);
        assert_eq!(alignment(DevicePtr(0x7f00_0000_0010)), 16);
        assert_eq!(alignment(DevicePtr(0x7f00_0000_0180)), 128);
    }

    #[test]
    fn only_float_types_have_a_cublaslt_type() {
        assert!(data_type(DType::F32).is_some());
        assert!(data_type(DType::BF16).is_some());
        assert!(data_type(DType::I64).is_none());
    }

    /// Without the library (CI) loading is an ordinary error naming the file; with it, a handle.
    #[test]
    fn loading_answers_without_panicking() {
        if crate::driver::device_count().is_ok() {
            println!("a driver is here; the GPU check covers cuBLASLt");
            return;
        }
        match CublasLt::load() {
            Ok(lt) => println!("loaded {:?} without a device", lt.report),
            Err(e) => {
                println!("{e}");
                assert!(!e.is_empty());
            }
        }
    }
}

//! Prepared vendor-library plans (descriptors, the chosen algorithm) by key, made once — and
//! the plans the library refused, with why, so our kernels run those and the device report can
//! list them. A refusal is an ordinary answer, never an op's error: planning that finds no
//! algorithm, or a call the library rejects as not for it (a bad or unsupported parameter),
//! both land here. A call that fails for any other reason — a device error, a graph capture
//! the driver invalidated — is the op's error instead ([`Declined::Failed`]): refusing the
//! plan then would hide the cause and move that plan onto our slower kernels for the rest of
//! the process.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// A library call that did not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Declined {
    /// The library does not take the plan: refused for good (listed in the device report), our
    /// kernels run it.
    Refused,
    /// The call failed: the op's error.
    Failed(String),
}

pub struct PlanCache<K, V> {
    entries: Mutex<HashMap<K, Result<Arc<V>, String>>>,
}

impl<K, V> Default for PlanCache<K, V> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone + Debug, V> PlanCache<K, V> {
    /// The prepared plan for `key` (made by `prepare` on first use), or why it was refused.
    pub fn get_or_prepare(
        &self,
        key: &K,
        prepare: impl FnOnce() -> Result<V, String>,
    ) -> Result<Arc<V>, String> {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .entry(key.clone())
            .or_insert_with(|| prepare().map(Arc::new))
            .clone()
    }

    /// Marks `key` refused from now on (its call failed), keeping `why` for the report.
    pub fn refuse(&self, key: &K, why: String) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.insert(key.clone(), Err(why));
    }

    /// After the call on `key` failed with `why`: a refusal for good where the library's status
    /// says the plan is not for it (`not_for_it`) and no capture runs (inside one, a failure
    /// may be the capture's — the eager run after it asks again), else the failure.
    pub fn decline(&self, key: &K, why: String, not_for_it: bool, capturing: bool) -> Declined {
        match not_for_it && !capturing {
            true => {
                self.refuse(key, why);
                Declined::Refused
            }
            false => Declined::Failed(why),
        }
    }

    /// Every refused plan with why, sorted.
    pub fn refusals(&self) -> Vec<String> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<String> = entries
            .iter()
            .filter_map(|(k, r)| r.as_ref().err().map(|e| format!("{k:?}: {e}")))
            .collect();
        out.sort();
        out
    }

    /// Drops every prepared plan (before the library handle they were made with goes).
    pub fn clear(&self) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_prepared_once_and_refusals_stick_and_are_listed() {
        let cache: PlanCache<u32, String> = PlanCache::default();
        let mut made = 0;
        for _ in 0..3 {
            let got = cache.get_or_prepare(&1, || {
                made += 1;
                Ok("desc".to_string())
            });
            assert_eq!(got.as_deref().map(String::as_str), Ok("desc"));
        }
        assert_eq!(made, 1);
        let refused = cache.get_or_prepare(&2, || Err("no algorithm".into()));
        assert_eq!(refused.unwrap_err(), "no algorithm");
        cache.refuse(&1, "CUBLAS_STATUS_NOT_SUPPORTED".into());
        assert!(cache.get_or_prepare(&1, || Ok("again".into())).is_err());
        assert_eq!(
            cache.refusals(),
            ["1: CUBLAS_STATUS_NOT_SUPPORTED", "2: no algorithm"]
        );
    }

    #[test]
    fn only_a_status_saying_the_plan_is_not_for_the_library_outside_a_capture_refuses_it() {
        let cache: PlanCache<u32, String> = PlanCache::default();
        let prepare = || Ok("desc".to_string());
        // A device error, or any failure inside a capture: the op's error, the plan kept.
        let failed = cache.decline(&1, "EXECUTION_FAILED".into(), false, false);
        assert_eq!(failed, Declined::Failed("EXECUTION_FAILED".into()));
        let failed = cache.decline(&1, "NOT_SUPPORTED".into(), true, true);
        assert_eq!(failed, Declined::Failed("NOT_SUPPORTED".into()));
        assert!(cache.get_or_prepare(&1, prepare).is_ok());
        assert!(cache.refusals().is_empty());
        // Not for the library, eagerly: refused from now on.
        assert_eq!(
            cache.decline(&1, "NOT_SUPPORTED".into(), true, false),
            Declined::Refused
        );
        assert!(cache.get_or_prepare(&1, prepare).is_err());
        assert_eq!(cache.refusals(), ["1: NOT_SUPPORTED"]);
    }
}

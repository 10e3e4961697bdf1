//! Prepared vendor-library plans (descriptors, the chosen algorithm) by key, made once — and
//! the plans the library refused, with why, so our kernels run those and the device report can
//! list them. A refusal is an ordinary answer, never an op's error: planning that finds no
//! algorithm, or a call the library rejects as not for it (a bad or unsupported parameter),
//! both land here. A call that fails for any other reason — a device error, a graph capture
//! the driver invalidated — is the op's error instead ([`Declined::Failed`]): refusing the
//! plan then would hide the cause and move that plan onto our slower kernels for the rest of
//! the process.
//!
//! A status that says the library cannot run on this machine at all (a driver or runtime it
//! does not take, no code for this architecture, a sub-library missing) refuses every plan at
//! once, with one line in the report and one warning, instead of each plan failing its first
//! call in turn and landing on our kernels one by one.

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
    /// The library rejected the algorithm chosen for the plan, which now has another: ask for
    /// its workspace and call again.
    Retry,
}

/// What a failed call's status says about the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// This plan (or the algorithm chosen for it) is not for the library: a bad or unsupported
    /// parameter.
    NotForPlan,
    /// The library cannot run on this machine: every plan would fail alike.
    Unusable,
    /// The call failed (the device, an execution, a capture, our own argument): the op's error.
    Failed,
}

/// Runs `call` until it stops asking for another try ([`Declined::Retry`]), at most `limit`
/// times: each retry follows an algorithm set aside and a plan has finitely many, so the bound
/// only guards against a library that keeps rejecting what it offered — then the answer is
/// still `Retry`, and the caller gives the plan up.
pub fn retrying<T>(
    limit: usize,
    mut call: impl FnMut() -> Result<T, Declined>,
) -> Result<T, Declined> {
    let mut answer = Err(Declined::Retry);
    for _ in 0..limit {
        answer = call();
        if !matches!(answer, Err(Declined::Retry)) {
            break;
        }
    }
    answer
}

pub struct PlanCache<K, V> {
    entries: Mutex<HashMap<K, Result<Arc<V>, String>>>,
    /// Why the library cannot run here, once a call said so: every plan is refused.
    unusable: Mutex<Option<String>>,
}

impl<K, V> Default for PlanCache<K, V> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            unusable: Mutex::new(None),
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
        if let Some(why) = self.unusable() {
            return Err(why);
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .entry(key.clone())
            .or_insert_with(|| prepare().map(Arc::new))
            .clone()
    }

    /// The prepared plan for `key` as it stands, preparing nothing: `None` if it has none yet.
    pub fn get(&self, key: &K) -> Option<Result<Arc<V>, String>> {
        if let Some(why) = self.unusable() {
            return Some(Err(why));
        }
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.get(key).cloned()
    }

    /// Every prepared plan (refusals left out), in no particular order.
    pub fn prepared(&self) -> Vec<(K, Arc<V>)> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .iter()
            .filter_map(|(k, v)| v.as_ref().ok().map(|v| (k.clone(), v.clone())))
            .collect()
    }

    /// Marks `key` refused from now on (its call failed), keeping `why` for the report.
    pub fn refuse(&self, key: &K, why: String) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.insert(key.clone(), Err(why));
    }

    /// Drops `key`'s prepared plan, so the next use prepares it again (with another algorithm).
    pub fn forget(&self, key: &K) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.remove(key);
    }

    /// After the call on `key` failed with `why`, by what its status says: outside a capture,
    /// a plan not for the library is refused for good and an unusable library refuses every
    /// plan (saying so once on stderr); inside one, any failure may be the capture's (the eager
    /// run after it asks again), so it is the op's error, as every other failure is.
    pub fn decline(&self, key: &K, why: String, verdict: Verdict, capturing: bool) -> Declined {
        match (verdict, capturing) {
            (Verdict::NotForPlan, false) => {
                self.refuse(key, why);
                Declined::Refused
            }
            (Verdict::Unusable, false) => {
                self.disable(why);
                Declined::Refused
            }
            _ => Declined::Failed(why),
        }
    }

    /// Refuses every plan from now on: the library cannot run here, for `why`.
    pub fn disable(&self, why: String) {
        let mut unusable = self.unusable.lock().unwrap_or_else(|p| p.into_inner());
        if unusable.is_none() {
            let why = format!("every plan: the library cannot run on this machine ({why})");
            eprintln!("redline-cuda: {why}; our own kernels run them");
            *unusable = Some(why);
        }
    }

    /// Why the library cannot run here, if a call said so.
    pub fn unusable(&self) -> Option<String> {
        self.unusable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Every refused plan with why, sorted; first, that every plan is, if it is.
    pub fn refusals(&self) -> Vec<String> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<String> = entries
            .iter()
            .filter_map(|(k, r)| r.as_ref().err().map(|e| format!("{k:?}: {e}")))
            .collect();
        out.sort();
        out.splice(0..0, self.unusable());
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
        let listed: Vec<(u32, String)> = cache
            .prepared()
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect();
        assert_eq!(listed, [(1, "desc".to_string())], "refusals are not listed");
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
        let failed = cache.decline(&1, "EXECUTION_FAILED".into(), Verdict::Failed, false);
        assert_eq!(failed, Declined::Failed("EXECUTION_FAILED".into()));
        for verdict in [Verdict::NotForPlan, Verdict::Unusable] {
            let failed = cache.decline(&1, "NOT_SUPPORTED".into(), verdict, true);
            assert_eq!(failed, Declined::Failed("NOT_SUPPORTED".into()));
        }
        assert!(cache.get_or_prepare(&1, prepare).is_ok());
        assert!(cache.refusals().is_empty());
        // Not for the library, eagerly: refused from now on; other plans are not.
        assert_eq!(
            cache.decline(&1, "NOT_SUPPORTED".into(), Verdict::NotForPlan, false),
            Declined::Refused
        );
        assert!(cache.get_or_prepare(&1, prepare).is_err());
        assert!(cache.get_or_prepare(&2, prepare).is_ok());
        assert_eq!(cache.refusals(), ["1: NOT_SUPPORTED"]);
    }

    #[test]
    fn a_library_that_cannot_run_here_refuses_every_plan_once_and_says_why_first() {
        let cache: PlanCache<u32, String> = PlanCache::default();
        assert!(cache.get_or_prepare(&1, || Ok("desc".into())).is_ok());
        let _ = cache.get_or_prepare(&2, || Err("no algorithm".into()));
        let arch = "NOT_SUPPORTED_ARCH_MISMATCH";
        assert_eq!(
            cache.decline(&1, arch.into(), Verdict::Unusable, false),
            Declined::Refused
        );
        // A later status does not replace the first.
        cache.disable("SUBLIBRARY_UNAVAILABLE".into());
        let mut prepared = 0;
        for key in [1, 3] {
            let refused = cache.get_or_prepare(&key, || {
                prepared += 1;
                Ok("desc".into())
            });
            let why = refused.unwrap_err();
            assert!(why.contains("every plan") && why.contains(arch), "{why}");
        }
        assert_eq!(
            prepared, 0,
            "nothing is prepared for a library that cannot run"
        );
        let listed = cache.refusals();
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert!(listed[0].starts_with("every plan: ") && listed[0].contains(arch));
        assert_eq!(listed[1], "2: no algorithm");
    }

    #[test]
    fn a_call_is_retried_while_it_asks_and_a_library_that_always_asks_fails_it() {
        let mut calls = 0;
        let answers = [Err(Declined::Retry), Err(Declined::Retry), Ok(7)];
        let got = retrying(9, || {
            calls += 1;
            answers[calls - 1].clone()
        });
        assert_eq!((got, calls), (Ok(7), 3));
        for last in [
            Declined::Refused,
            Declined::Failed("EXECUTION_FAILED".into()),
        ] {
            calls = 0;
            let got = retrying(9, || {
                calls += 1;
                match calls {
                    1 => Err::<(), _>(Declined::Retry),
                    _ => Err(last.clone()),
                }
            });
            assert_eq!((got, calls), (Err(last), 2));
        }
        calls = 0;
        let got = retrying(9, || {
            calls += 1;
            Err::<(), _>(Declined::Retry)
        });
        assert_eq!((got, calls), (Err(Declined::Retry), 9));
    }

    #[test]
    fn a_forgotten_plan_is_prepared_again_and_looking_prepares_nothing() {
        let cache: PlanCache<u32, u32> = PlanCache::default();
        assert!(cache.get(&1).is_none());
        assert_eq!(cache.get_or_prepare(&1, || Ok(7)).as_deref(), Ok(&7));
        assert_eq!(cache.get(&1).unwrap().as_deref(), Ok(&7));
        cache.forget(&1);
        assert!(cache.get(&1).is_none());
        assert_eq!(cache.get_or_prepare(&1, || Ok(8)).as_deref(), Ok(&8));
        cache.disable("NOT_INITIALIZED".into());
        assert!(cache.get(&1).unwrap().is_err());
    }
}

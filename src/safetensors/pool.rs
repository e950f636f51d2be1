//! The room's per-file work on threads (reading shard headers, opening shards): at most
//! [`MAX_WORKERS`] scoped threads, each taking the next index until none is left, so a
//! checkpoint of hundreds of shards neither starts hundreds of threads nor holds hundreds of
//! headers in flight.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// The most threads one call runs.
pub(super) const MAX_WORKERS: usize = 16;

/// `f(0)`, …, `f(n - 1)`, in order: on the calling thread when `n <= alone` (stopping at the
/// first error), else on `min(n, MAX_WORKERS)` scoped threads. The error is the first, in index
/// order, of those the indices that ran returned; a panic in `f` is an
/// [`Error::InvalidArgument`] naming it, not a panic of the caller (and no further index
/// starts). A thread the OS refuses is an [`Error::Io`] (`pthread_create`: no further index is
/// started, the threads already running finish theirs) when no index that ran failed (else it
/// is logged).
pub(super) fn map_indexed<T: Send>(
    n: usize,
    alone: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if n <= alone {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let slots: Vec<Mutex<Option<std::thread::Result<Result<T>>>>> =
        (0..n).map(|_| Mutex::new(None)).collect();
    let work = || {
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            let r = catch_unwind(AssertUnwindSafe(|| f(i)));
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
    };
    let spawned = std::thread::scope(|s| {
        for _ in 0..n.min(MAX_WORKERS) {
            #[cfg(test)]
            if tests::spawn_refused() {
                stop.store(true, Ordering::Relaxed);
                return Err(std::io::Error::other("test: spawn refused"));
            }
            if let Err(e) = std::thread::Builder::new().spawn_scoped(s, work) {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
        Ok(())
    });
    let mut out = Vec::with_capacity(n);
    let mut first = None;
    for m in slots {
        match m.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(Ok(v))) => out.push(v),
            Some(Ok(Err(e))) => {
                first.get_or_insert(e);
            }
            Some(Err(p)) => {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                first.get_or_insert(Error::InvalidArgument(format!(
                    "a checkpoint worker thread panicked (a bug in gpudirect, please report it): {what}"
                )));
            }
            // Not started: a refused thread or a panic stopped the workers (reported here).
            None => {}
        }
    }
    match (first, spawned) {
        (Some(e), Err(refusal)) => {
            tracing::warn!(
                "a checkpoint worker thread was refused ({refusal}) after a started one failed; reporting that failure"
            );
            Err(e)
        }
        (Some(e), Ok(())) => Err(e),
        (None, Err(refusal)) => Err(Error::io("pthread_create", None, refusal)),
        (None, Ok(())) if out.len() == n => Ok(out),
        (None, Ok(())) => Err(Error::InvalidArgument(
            "internal: a checkpoint worker thread stopped before its work".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test hook: asked before each worker thread starts; `true` refuses it.
    type SpawnHook = Box<dyn FnMut() -> bool>;

    thread_local! {
        /// The hook of the calling thread's `map_indexed` calls (`None`: no hook).
        static SPAWN_HOOK: std::cell::RefCell<Option<SpawnHook>> = const { std::cell::RefCell::new(None) };
    }

    /// Whether the hook refuses this spawn.
    pub(super) fn spawn_refused() -> bool {
        SPAWN_HOOK.with(|h| h.borrow_mut().as_mut().is_some_and(|f| f()))
    }

    /// A worker that ran an index which failed must be the call's error when the OS refuses a
    /// later worker thread, not the `pthread_create` refusal (which only stopped the workers
    /// from taking further indices). The hook lets one worker start and refuses the second
    /// once that worker has run index 0, which fails; the call's first error, in index order,
    /// must be index 0's. The code before returned the refusal and dropped every result.
    #[test]
    fn a_started_workers_error_is_not_hidden_by_a_refused_thread() {
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        let ran0 = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&ran0);
        let mut spawns = 0;
        SPAWN_HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                spawns += 1;
                if spawns == 1 {
                    return false;
                }
                let t0 = Instant::now();
                while !seen.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                true
            }))
        });
        let r = map_indexed(4, 0, |i| {
            if i == 0 {
                ran0.store(true, Ordering::SeqCst);
                return Err(Error::InvalidArgument("index 0's own error".into()));
            }
            Ok(i)
        });
        SPAWN_HOOK.with(|h| *h.borrow_mut() = None);
        assert!(ran0.load(Ordering::SeqCst), "control: index 0 never ran");
        match r {
            Err(Error::InvalidArgument(m)) if m == "index 0's own error" => {}
            Err(e) => panic!("the call says `{e}`"),
            Ok(v) => panic!("Ok: {v:?}"),
        }
    }

    /// Every index once, results in order, never more than MAX_WORKERS at once; a panic is an
    /// error.
    #[test]
    fn every_index_once_in_order_on_at_most_sixteen_threads() {
        for n in [0, 1, 2, 3, 17, 100] {
            let running = AtomicUsize::new(0);
            let most = AtomicUsize::new(0);
            let threads = Mutex::new(std::collections::HashSet::new());
            let v = map_indexed(n, 1, |i| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                threads.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(std::time::Duration::from_millis(2));
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(i * 3)
            })
            .unwrap();
            assert_eq!(v, (0..n).map(|i| i * 3).collect::<Vec<_>>());
            let most = most.into_inner();
            assert!(most <= MAX_WORKERS, "{most} at once for {n}");
            let threads = threads.into_inner().unwrap().len();
            assert!(threads <= MAX_WORKERS.max(1), "{threads} threads for {n}");
            if n > 1 {
                assert!(!threads_contain_caller(n), "{n}");
            }
        }
        let r = map_indexed(5, 0, |i| {
            if i == 2 {
                panic!("index two")
            }
            Ok(i)
        });
        assert!(
            matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("panicked")),
            "{r:?}"
        );
    }

    fn threads_contain_caller(n: usize) -> bool {
        let me = std::thread::current().id();
        map_indexed(n, 1, |_| Ok(std::thread::current().id() == me))
            .unwrap()
            .into_iter()
            .any(|x| x)
    }
}

//! A persistent pool of IO workers that run one broadcast job at a time.
//!
//! A job is a closure every worker runs once (each pulls tasks from a shared counter until
//! none are left). [`Pool::run`] blocks until every worker has returned from the closure, which
//! is what lets the closure borrow the caller's stack.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::worker::WorkerState;

/// A type-erased pointer to the caller's closure and the function that calls it.
#[derive(Clone, Copy)]
struct JobPtr {
    data: *const (),
    call: unsafe fn(*const (), &mut WorkerState),
}

// SAFETY: the pointee is `Sync` (required by `run`), so sharing the pointer between workers is
// sound; `run` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

/// # Safety
/// `data` must point to a live `F`.
unsafe fn trampoline<F: Fn(&mut WorkerState) + Sync>(data: *const (), ws: &mut WorkerState) {
    // SAFETY: per the contract, `data` came from `&F` and the `F` is still alive.
    let f = unsafe { &*data.cast::<F>() };
    f(ws)
}

struct State {
    job: Option<JobPtr>,
    generation: u64,
    remaining: usize,
    panicked: bool,
}

struct Shared {
    state: Mutex<State>,
    start: Condvar,
    done: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The worker threads of one engine.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    submit: Mutex<()>,
}

impl Pool {
    /// Starts `threads` workers; each runs `init` first (to pin itself) and then owns a
    /// [`WorkerState`] for its lifetime. The threads live as long as the process (pools are
    /// never dropped: their CUDA resources must not be torn down at exit).
    pub fn new(
        threads: usize,
        name: &str,
        init: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Pool> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                generation: 0,
                remaining: 0,
                panicked: false,
            }),
            start: Condvar::new(),
            done: Condvar::new(),
        });
        let init = Arc::new(init);
        for i in 0..threads {
            let shared = shared.clone();
            let init = init.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    init(i);
                    let mut ws = WorkerState::new(i);
                    let mut seen = 0u64;
                    loop {
                        let job = {
                            let mut st = lock(&shared.state);
                            while st.generation == seen {
                                st = shared.start.wait(st).unwrap_or_else(|p| p.into_inner());
                            }
                            seen = st.generation;
                            st.job
                        };
                        let ok = match job {
                            // SAFETY: `run` published this pointer and waits for `remaining`
                            // to reach zero before its closure goes out of scope; we decrement
                            // only after the call returns.
                            Some(j) => catch_unwind(AssertUnwindSafe(|| unsafe {
                                (j.call)(j.data, &mut ws)
                            }))
                            .is_ok(),
                            None => true,
                        };
                        if !ok {
                            // A panicking job may have left the worker's buffers mid-copy.
                            ws = WorkerState::new(i);
                        }
                        let mut st = lock(&shared.state);
                        st.panicked |= !ok;
                        st.remaining -= 1;
                        if st.remaining == 0 {
                            shared.done.notify_all();
                        }
                    }
                })?;
        }
        Ok(Pool {
            shared,
            threads,
            submit: Mutex::new(()),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` once on every worker and returns when all have finished. Returns false when a
    /// worker panicked inside `f`.
    pub fn run<F: Fn(&mut WorkerState) + Sync>(&self, f: &F) -> bool {
        let _one_job = self.submit.lock().unwrap_or_else(|p| p.into_inner());
        // The pointer is withdrawn below, after every worker has finished calling it and
        // before `f`'s borrow ends.
        let job = JobPtr {
            data: (f as *const F).cast(),
            call: trampoline::<F>,
        };
        let mut st = lock(&self.shared.state);
        st.job = Some(job);
        st.remaining = self.threads;
        st.panicked = false;
        st.generation += 1;
        self.shared.start.notify_all();
        while st.remaining > 0 {
            st = self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.job = None;
        !st.panicked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_worker_runs_each_job_once_and_borrows_work() {
        let pool = Pool::new(5, "test-pool", |_| {}).unwrap();
        for round in 0..50 {
            let hits = AtomicUsize::new(0);
            let local = [round; 3];
            assert!(pool.run(&|_ws| {
                hits.fetch_add(local[0] + 1 - round, Ordering::Relaxed);
            }));
            assert_eq!(hits.load(Ordering::Relaxed), 5);
        }
    }

    #[test]
    fn a_panicking_job_is_reported_and_the_pool_survives() {
        let pool = Pool::new(3, "test-pool", |_| {}).unwrap();
        assert!(!pool.run(&|ws| {
            if ws.id == 1 {
                panic!("boom");
            }
        }));
        let n = AtomicUsize::new(0);
        assert!(pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(n.load(Ordering::Relaxed), 3);
    }
}

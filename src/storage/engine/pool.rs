//! A pool of IO workers that run one broadcast job at a time.
//!
//! A job is a closure that each participating worker runs once (each pulls tasks from a shared
//! counter until none are left). [`Pool::run`] blocks until every participant has returned from
//! the closure, which is what lets the closure borrow the caller's stack.
//!
//! - **Lazy threads**: workers are started by the first job that needs them, *after* that job
//!   is published, so the first worker starts on the first task while the others are still
//!   being spawned (thread creation never sits in front of the first byte). A job asks for `n`
//!   workers; the pool grows to the largest `n` asked for (at most `max`).
//! - **Parallel start** ([`spawn_list`]): the calling thread starts one thread; each new
//!   thread starts half of the threads still to start (a tree) before it joins the job, so 16
//!   threads are up after about log2(16) thread creations instead of 16 in a row on the caller
//!   (what a creation costs: CONTRIBUTING.md, "Costs behind the storage engine's design"), and
//!   the caller is free at once for what it does beside the workers (allocate, page-lock).
//! - **Start together** ([`START_WAIT`]): a thread started for a job enters it once every
//!   thread the job starts is started (or after `START_WAIT`), not as soon as it is up: a
//!   thread creation is fast (~0.13 ms each for the first on the H200 machine) until the
//!   workers already running fault in fresh memory, then ~1 ms or more (16 threads took 5.6 to
//!   9.9 ms to start while the first ones read), so starting together gets every worker
//!   reading sooner (`GPUDIRECT_TRACE=timing`: "started N worker threads from … to … ms").
//! - **Spawn failures** shrink the job (it runs on the workers that did start; on the calling
//!   thread if none did); the threads a failed one was to start are started by its starter; no
//!   thread is left waiting for a job that never comes.
//! - **Panics**: a worker that panicked inside a job first drains its streams (no copy may use
//!   a buffer it is about to reuse or free, nor the job's memory, which may be borrowed); when
//!   a synchronize fails it waits until the copies are known complete or their context dead
//!   ([`crate::cuda::settle`]); a dead context's state is leaked, never dropped, and the job
//!   learns its error ([`Ran::dead`]).
//!   A thread that unwinds outside the job's closure (its start-up, or a `tracing` layer that
//!   panics) gives back its count and those of the threads it had yet to start, so no job waits
//!   for it ([`Owed`], `Exit`); a caller that unwinds between publishing a job and waiting for
//!   it first waits for every worker to leave the closure ([`Published`]), or aborts.
//! - **Release**: [`Pool::shutdown`] stops and joins every worker (each frees its state);
//!   with an idle timeout, workers that saw no job for that long free their state and exit, and
//!   the last one to leave calls the pool's `on_idle` hook. The next job starts them again.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::worker::WorkerState;
use crate::cuda::settle::Patience;
use crate::error::Error;

/// A type-erased pointer to the caller's closure and the function that calls it.
#[derive(Clone, Copy)]
struct JobPtr {
    data: *const (),
    call: unsafe fn(*const (), &mut WorkerState),
}

// SAFETY: the pointee is `Sync` (required by `run`), so sharing the pointer between workers is
// sound; `run` keeps it alive until every participant is done with it.
unsafe impl Send for JobPtr {}

/// # Safety
/// `data` must point to a live `F`.
unsafe fn trampoline<F: Fn(&mut WorkerState) + Sync>(data: *const (), ws: &mut WorkerState) {
    // SAFETY: per the contract, `data` came from `&F` and the `F` is still alive.
    let f = unsafe { &*data.cast::<F>() };
    f(ws)
}

/// What [`Pool::run`] reports: whether the closure panicked somewhere, and the error of a
/// panicked worker whose context turned out dead (see [`recover_after_panic`]).
#[must_use]
pub(in crate::storage) struct Ran {
    panicked: bool,
    dead: Option<Error>,
}

impl Ran {
    /// No participant panicked.
    pub fn ok(&self) -> bool {
        !self.panicked
    }

    /// The error of a panicked worker whose streams' context is dead (its state was leaked).
    pub fn dead(self) -> Option<Error> {
        self.dead
    }
}

impl State {
    /// Records how a participant's call ended.
    fn note(&mut self, c: Called) {
        match c {
            Called::Returned => {}
            Called::Panicked => self.panicked = true,
            Called::PanickedDead(e) => {
                self.panicked = true;
                self.dead.get_or_insert(e);
            }
        }
    }
}

struct State {
    job: Option<JobPtr>,
    generation: u64,
    /// Workers with an id below this run the current job.
    want: usize,
    /// Participants of the current job that have not returned yet.
    remaining: usize,
    panicked: bool,
    /// The first error of a panicked worker whose context turned out dead ([`Called`]).
    dead: Option<Error>,
    /// `alive[id]`: worker `id`'s thread is in its loop (or about to enter it).
    alive: Vec<bool>,
    /// Set by [`Pool::shutdown`]: every worker frees its state and exits.
    shutdown: bool,
    /// Threads of the current job that could not be started.
    failed: usize,
}

/// How long a thread started for a job waits for the job's other threads to be started
/// before it enters the job anyway (see the module's "Start together").
pub(in crate::storage) const START_WAIT: Duration = Duration::from_micros(1500);

struct Shared {
    /// Ids of the current job still to be started or given back ("Start together"), and its
    /// condition (notified when it reaches 0).
    starting: Mutex<usize>,
    all_started: Condvar,
    /// [`START_WAIT`] (tests set it).
    start_wait: Duration,
    state: Mutex<State>,
    start: Condvar,
    done: Condvar,
    /// Threads currently running a worker loop (for tests and reporting).
    live: AtomicUsize,
    /// Workers with no job for this long free their state and exit.
    idle: Option<Duration>,
    /// Called (on a worker thread, no lock held) when the last worker left for idleness.
    on_idle: Option<Box<dyn Fn() + Send + Sync>>,
    /// Thread name prefix (`<name>-<id>`).
    name: String,
    /// Run by each worker first (to pin itself).
    init: Arc<dyn Fn(usize) + Send + Sync>,
    /// The join handle of each worker thread (stored by whoever started it).
    handles: Mutex<Vec<Option<JoinHandle<()>>>>,
    /// Trace: threads started for the current job, and when the last start returned (µs since
    /// the trace epoch).
    started: AtomicUsize,
    started_end: AtomicU64,
    /// Test hook: spawning worker `id >= n` fails.
    #[cfg(test)]
    fail_spawn_from: Option<usize>,
    /// Test hook: (worker started, name of the thread that started it).
    #[cfg(test)]
    started_by: Mutex<Vec<(usize, String)>>,
    /// Test hook: when each start returned.
    #[cfg(test)]
    started_at: Mutex<Vec<std::time::Instant>>,
    /// Test hook: worker `id` panics in its prologue, at that point.
    #[cfg(test)]
    prologue_panic: Option<(usize, PrologueAt)>,
    /// Test hook: the calling thread panics after publishing a job and starting its threads,
    /// before it waits for them.
    #[cfg(test)]
    caller_panic: bool,
}

/// Test hook: where in its prologue a worker panics.
#[cfg(test)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(in crate::storage) enum PrologueAt {
    /// Before it starts its children.
    BeforeStarts,
    /// After starting its children, before `init`.
    BeforeInit,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a pool starts its threads.
pub(in crate::storage) struct PoolConfig {
    /// Thread name prefix (`<name>-<id>`).
    pub name: String,
    /// Most workers a job may get.
    pub max: usize,
    /// Idle time after which workers free their state and exit (`None`: never).
    pub idle: Option<Duration>,
    /// Run by each worker first (to pin itself).
    pub init: Arc<dyn Fn(usize) + Send + Sync>,
    /// Called when the last worker left for idleness.
    pub on_idle: Option<Box<dyn Fn() + Send + Sync>>,
    /// How long a new thread waits for its job's other starts ([`START_WAIT`]).
    pub start_wait: Duration,
    /// Test hook: spawning worker `id >= n` fails.
    #[cfg(test)]
    pub fail_spawn_from: Option<usize>,
    /// Test hook: worker `id` panics in its prologue, at that point.
    #[cfg(test)]
    pub prologue_panic: Option<(usize, PrologueAt)>,
    /// Test hook: the calling thread panics between publishing a job and waiting for it.
    #[cfg(test)]
    pub caller_panic: bool,
}

impl PoolConfig {
    pub fn new(name: impl Into<String>, max: usize) -> Self {
        PoolConfig {
            name: name.into(),
            max: max.max(1),
            idle: None,
            init: Arc::new(|_| {}),
            on_idle: None,
            start_wait: START_WAIT,
            #[cfg(test)]
            fail_spawn_from: None,
            #[cfg(test)]
            prologue_panic: None,
            #[cfg(test)]
            caller_panic: false,
        }
    }
}

/// The worker threads of one engine.
pub(in crate::storage) struct Pool {
    shared: Arc<Shared>,
    max: usize,
    /// Held for the whole of a job (one job at a time) and by `shutdown`.
    submit: Mutex<()>,
    /// The caller's state when no worker thread could be started at all.
    fallback: Mutex<WorkerState>,
    /// Trace (`GPUDIRECT_TRACE=timing`): threads the last job started, and when (µs since
    /// the trace epoch).
    spawned: Mutex<(usize, u64, u64)>,
}

/// What a worker does with its state after a job panicked inside it: drain its streams so no
/// copy still uses its buffers (or the job's, which may be borrowed: waiting until the copies
/// are known complete or their context dead, see [`WorkerState::quiesce`]), and keep it; when
/// a context turns out dead, leak it (never unregister or free what its copies named) and
/// return that error. It waits ([`Patience::Wait`]) also inside a job whose caller owns its
/// destinations and could leak them instead: the pool does not know the job's patience, so
/// there a panicked worker whose drain fails with unknown answers aborts the process after a
/// minute where the job itself would have given up and leaked.
pub(in crate::storage) fn recover_after_panic(ws: &mut WorkerState) -> Option<Error> {
    let e = ws.quiesce(Patience::Wait).err()?;
    // Leaked before the log line, which may unwind (a `tracing` layer) and drop `ws`.
    let id = ws.id;
    std::mem::forget(std::mem::replace(ws, WorkerState::new(id)));
    tracing::error!(
        worker = id,
        %e,
        "an IO worker panicked and its streams could not be drained: leaking its buffers"
    );
    Some(e)
}

/// How a worker's call of a job ended.
enum Called {
    Returned,
    Panicked,
    /// Panicked, and a context of its streams is dead (its state leaked): this error.
    PanickedDead(Error),
}

/// Runs the job on `ws`, catching a panic (then recovering the state).
fn call(job: JobPtr, ws: &mut WorkerState) -> Called {
    // SAFETY: `run` published this pointer and waits for every participant to return before
    // its closure goes out of scope; we report back only after the call returned.
    let ok = catch_unwind(AssertUnwindSafe(|| unsafe {
        (job.call)(job.data, &mut *ws)
    }))
    .is_ok();
    if ok {
        return Called::Returned;
    }
    match recover_after_panic(ws) {
        None => Called::Panicked,
        Some(e) => Called::PanickedDead(e),
    }
}

/// Frees a worker's state at exit: drained first; leaked unless its copies are known complete
/// or their context dead (no job's memory is borrowed any more: no wait past the first unknown
/// answer, [`Patience::UntilUnknown`]).
fn release_state(ws: WorkerState) {
    let mut ws = ws;
    match ws.quiesce(Patience::UntilUnknown) {
        Ok(()) => drop(ws),
        Err(e) => {
            let id = ws.id;
            std::mem::forget(ws);
            tracing::error!(
                worker = id,
                %e,
                "an IO worker's streams could not be drained at exit: leaking its buffers"
            );
        }
    }
}

struct LiveGuard(Arc<Shared>);
impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Ids counted in the current job (marked alive, in `remaining`) that this thread has yet to
/// start or give back. Whatever is left when it drops (an unwind: a panicking `tracing` layer,
/// a test hook) leaves the job: marked dead, counted as failed, its count given back, so the
/// job, `run_with` waiting for it, later jobs and `shutdown` never wait for a thread that will
/// not come.
struct Owed<'a> {
    shared: &'a Shared,
    ids: Vec<usize>,
}

impl Drop for Owed<'_> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            give_back(self.shared, &self.ids);
        }
    }
}

/// `n` of the current job's ids were started or given back.
fn count_starts(shared: &Shared, n: usize) {
    let mut g = shared.starting.lock().unwrap_or_else(|p| p.into_inner());
    *g = g.saturating_sub(n);
    if *g == 0 {
        shared.all_started.notify_all();
    }
}

/// Waits until every id of the current job was started or given back, at most until
/// `deadline`.
fn wait_all_started(shared: &Shared, deadline: std::time::Instant) {
    let mut g = shared.starting.lock().unwrap_or_else(|p| p.into_inner());
    while *g > 0 {
        let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
            return;
        };
        g = shared
            .all_started
            .wait_timeout(g, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// `ids` leave the current job without running it (see [`Owed`]).
fn give_back(shared: &Shared, ids: &[usize]) {
    count_starts(shared, ids.len());
    let mut st = lock(&shared.state);
    for &id in ids {
        st.alive[id] = false;
        st.failed += 1;
        st.remaining -= 1;
    }
    if st.remaining == 0 {
        shared.done.notify_all();
    }
}

/// Starts the worker threads in `owed` for a job of generation `seen + 1`: the first id is
/// started with the first half of the rest to start in its turn, then the next, and so on (a
/// tree: each thread starts about half of what is left). An id that cannot be started leaves
/// the job (its count given back) and the ids it was to start are started here. Every start is
/// attempted before this returns, so the job (and `Pool::run_with`, which waits for it)
/// outlives every thread it counts on. An id passes from `owed` to the new thread in the same
/// step as the thread starts (nothing between can unwind), so each count has exactly one owner.
fn spawn_list(shared: &Arc<Shared>, owed: &mut Owed<'_>, seen: u64) {
    while !owed.ids.is_empty() {
        let half = (owed.ids.len() - 1) / 2;
        start_first(shared, owed, half, seen);
    }
}

/// Starts the first id of `owed`, which in turn starts the `children` ids after it. True when
/// it started (those ids are its now); false when it could not (its count given back; the
/// children stay in `owed`). An id passes from `owed` to the new thread in the same step as the
/// thread starts (nothing between can unwind), so each count has exactly one owner.
fn start_first(shared: &Arc<Shared>, owed: &mut Owed<'_>, children: usize, seen: u64) -> bool {
    let id = owed.ids[0];
    let theirs = owed.ids[1..1 + children].to_vec();
    // A thread of this id that left its loop (idle) is exiting or gone.
    let old = lock_handles(shared)[id].take();
    if let Some(old) = old {
        let _ = old.join();
    }
    match spawn_thread(shared, id, theirs, seen) {
        Ok(h) => {
            // Handed over: the new thread owes these now (its own `Exit` and `Owed`).
            owed.ids.drain(..1 + children);
            started(shared, id, h);
            true
        }
        Err(e) => {
            // Given back before anything that may unwind.
            owed.ids.remove(0);
            give_back(shared, &[id]);
            tracing::warn!(%e, worker = id, "could not start an IO worker; the job runs on fewer");
            false
        }
    }
}

/// Starts the thread of worker `id`, which starts `children` first.
fn spawn_thread(
    shared: &Arc<Shared>,
    id: usize,
    children: Vec<usize>,
    seen: u64,
) -> std::io::Result<JoinHandle<()>> {
    #[cfg(test)]
    if shared.fail_spawn_from.is_some_and(|n| id >= n) {
        return Err(std::io::Error::other("test: spawn refused"));
    }
    let sh = shared.clone();
    std::thread::Builder::new()
        .name(format!("{}-{id}", shared.name))
        .spawn(move || worker_loop(sh, id, seen, children))
}

/// Records a started thread (its handle; the trace).
fn started(shared: &Shared, id: usize, h: JoinHandle<()>) {
    lock_handles(shared)[id] = Some(h);
    #[cfg(test)]
    {
        shared
            .started_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, std::thread::current().name().unwrap_or("").to_string()));
        shared
            .started_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(std::time::Instant::now());
    }
    count_starts(shared, 1);
    if super::trace::on() {
        shared.started.fetch_add(1, Ordering::Relaxed);
        shared
            .started_end
            .fetch_max(super::trace::now_us(), Ordering::Relaxed);
    }
}

fn lock_handles(shared: &Shared) -> MutexGuard<'_, Vec<Option<JoinHandle<()>>>> {
    shared.handles.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker's own count, given back if its thread unwinds outside a job's closure (its
/// prologue, or the bookkeeping around a job): before its loop it leaves the job as failed
/// (it never ran it); inside, it counts as a panic of the job it was in. Either way it is
/// marked dead, so the next job starts it again.
struct Exit<'a> {
    shared: &'a Shared,
    id: usize,
    /// Counted in the current job's `remaining` and not yet given back.
    owes: bool,
    /// Has entered its loop.
    looping: bool,
}

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut st = lock(&self.shared.state);
        st.alive[self.id] = false;
        if self.owes {
            if self.looping {
                st.panicked = true;
            } else {
                st.failed += 1;
            }
            st.remaining -= 1;
            if st.remaining == 0 {
                self.shared.done.notify_all();
            }
        }
    }
}

fn worker_loop(shared: Arc<Shared>, id: usize, mut seen: u64, children: Vec<usize>) {
    // Nothing before these guards can unwind: the counts this thread was started with are
    // owned from its first step.
    let mut exit = Exit {
        shared: &shared,
        id,
        owes: true,
        looping: false,
    };
    let mut owed = Owed {
        shared: &shared,
        ids: children,
    };
    shared.live.fetch_add(1, Ordering::Relaxed);
    let _live = LiveGuard(shared.clone());
    #[cfg(test)]
    if shared.prologue_panic == Some((id, PrologueAt::BeforeStarts)) {
        panic!("test: worker {id} panics before starting its children");
    }
    // Start the threads this one is responsible for before joining the job (they count on
    // the job this one counts in; see spawn_list).
    spawn_list(&shared, &mut owed, seen);
    drop(owed);
    #[cfg(test)]
    if shared.prologue_panic == Some((id, PrologueAt::BeforeInit)) {
        panic!("test: worker {id} panics before init");
    }
    (shared.init)(id);
    let mut ws = WorkerState::new(id);
    exit.looping = true;
    // Started for a job: enter it together with the job's other new threads.
    let mut together = Some(std::time::Instant::now() + shared.start_wait);
    loop {
        let job = {
            let mut st = lock(&shared.state);
            loop {
                if st.shutdown {
                    st.alive[id] = false;
                    drop(st);
                    release_state(ws);
                    return;
                }
                if st.generation != seen {
                    seen = st.generation;
                    if id < st.want {
                        exit.owes = true;
                        break st.job;
                    }
                    continue;
                }
                match shared.idle {
                    None => st = shared.start.wait(st).unwrap_or_else(|p| p.into_inner()),
                    Some(d) => {
                        let (g, to) = shared
                            .start
                            .wait_timeout(st, d)
                            .unwrap_or_else(|p| p.into_inner());
                        st = g;
                        if to.timed_out() && st.generation == seen && !st.shutdown {
                            st.alive[id] = false;
                            let last = st.alive.iter().all(|a| !a);
                            drop(st);
                            release_state(ws);
                            if last {
                                if let Some(f) = &shared.on_idle {
                                    f();
                                }
                            }
                            return;
                        }
                    }
                }
            }
        };
        if let (Some(deadline), Some(_)) = (together.take(), job) {
            wait_all_started(&shared, deadline);
        }
        let called = match job {
            Some(j) => call(j, &mut ws),
            None => Called::Returned,
        };
        let mut st = lock(&shared.state);
        st.note(called);
        st.remaining -= 1;
        exit.owes = false;
        if st.remaining == 0 {
            shared.done.notify_all();
        }
    }
}

/// Held by `run_with` from publishing a job until it has waited for it: if the calling thread
/// unwinds in between, its drop waits for every participant to leave the job's closure and
/// withdraws the job before the closure (on the unwinding frame) goes away; if even that
/// cannot be done it aborts the process. Never a use-after-free of the closure.
struct Published<'a> {
    shared: &'a Shared,
    armed: bool,
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let waited = catch_unwind(AssertUnwindSafe(|| {
            let mut st = lock(&self.shared.state);
            while st.remaining > 0 {
                st = self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            st.job = None;
        }));
        if waited.is_err() {
            // Workers may still call the closure this frame owns: stop the process.
            std::process::abort();
        }
    }
}

impl Pool {
    /// A pool that starts no thread until its first job.
    pub fn new(cfg: PoolConfig) -> Pool {
        let shared = Arc::new(Shared {
            starting: Mutex::new(0),
            all_started: Condvar::new(),
            start_wait: cfg.start_wait,
            state: Mutex::new(State {
                job: None,
                generation: 0,
                want: 0,
                remaining: 0,
                panicked: false,
                dead: None,
                alive: vec![false; cfg.max],
                shutdown: false,
                failed: 0,
            }),
            start: Condvar::new(),
            done: Condvar::new(),
            live: AtomicUsize::new(0),
            idle: cfg.idle,
            on_idle: cfg.on_idle,
            name: cfg.name,
            init: cfg.init,
            handles: Mutex::new((0..cfg.max).map(|_| None).collect()),
            started: AtomicUsize::new(0),
            started_end: AtomicU64::new(0),
            #[cfg(test)]
            fail_spawn_from: cfg.fail_spawn_from,
            #[cfg(test)]
            started_by: Mutex::new(Vec::new()),
            #[cfg(test)]
            started_at: Mutex::new(Vec::new()),
            #[cfg(test)]
            prologue_panic: cfg.prologue_panic,
            #[cfg(test)]
            caller_panic: cfg.caller_panic,
        });
        Pool {
            shared,
            max: cfg.max,
            submit: Mutex::new(()),
            fallback: Mutex::new(WorkerState::new(usize::MAX)),
            spawned: Mutex::new((0, 0, 0)),
        }
    }

    /// Trace: `(threads started, from, to)` of the last job (µs since the trace epoch; zeros
    /// when tracing is off).
    pub fn last_spawn(&self) -> (usize, u64, u64) {
        *self.spawned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Worker threads running now.
    pub fn live_threads(&self) -> usize {
        self.shared.live.load(Ordering::Relaxed)
    }

    /// Runs `f` once on each of `n` workers (clamped to `1..=max`) and returns when all have
    /// finished. Workers not yet running are started after the job is published. Reports
    /// whether `f` panicked somewhere (the state involved was drained or leaked, never dropped
    /// with a copy in flight; [`Ran`]).
    pub fn run<F: Fn(&mut WorkerState) + Sync>(&self, n: usize, f: &F) -> Ran {
        self.run_with(n, f, || {})
    }

    /// [`run`](Self::run), and `caller` runs on the calling thread once the job is published
    /// and its workers started, while they work (it may produce what they wait for: it must
    /// not wait for them). A panic in `caller` is propagated after every worker returned from
    /// `f` (so `f`'s borrows end first); `caller` must leave the workers able to finish.
    pub fn run_with<F: Fn(&mut WorkerState) + Sync, C: FnOnce()>(
        &self,
        n: usize,
        f: &F,
        caller: C,
    ) -> Ran {
        let submit = self.submit.lock().unwrap_or_else(|p| p.into_inner());
        let n = n.clamp(1, self.max);
        // The pointer is withdrawn below, after every participant has finished calling it and
        // before `f`'s borrow ends.
        let job = JobPtr {
            data: (f as *const F).cast(),
            call: trampoline::<F>,
        };
        let (gen, missing) = {
            let mut st = lock(&self.shared.state);
            st.job = Some(job);
            st.want = n;
            st.remaining = n;
            st.panicked = false;
            st.dead = None;
            st.failed = 0;
            st.generation += 1;
            let missing: Vec<usize> = (0..n).filter(|&id| !st.alive[id]).collect();
            for &id in &missing {
                st.alive[id] = true;
            }
            self.shared.start.notify_all();
            (st.generation, missing)
        };
        // From here until the wait below, an unwind waits for the workers (or aborts).
        let mut published = Published {
            shared: &self.shared,
            armed: true,
        };
        *self
            .shared
            .starting
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = missing.len();
        let mut owed = Owed {
            shared: &self.shared,
            ids: missing,
        };
        let t_spawn = super::trace::now_us();
        self.shared.started.store(0, Ordering::Relaxed);
        self.shared.started_end.store(0, Ordering::Relaxed);
        // One thread from here (it starts half of the rest, and so on: spawn_list), so the
        // caller is soon free; only when that start fails does the caller go on.
        let to_start = owed.ids.len();
        if to_start > 0 && !start_first(&self.shared, &mut owed, to_start - 1, gen - 1) {
            spawn_list(&self.shared, &mut owed, gen - 1);
        }
        drop(owed);
        #[cfg(test)]
        if self.shared.caller_panic {
            panic!("test: the caller panics before waiting for its job");
        }
        let by_caller = catch_unwind(AssertUnwindSafe(caller));
        let mut st = lock(&self.shared.state);
        while st.remaining > 0 {
            st = self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        // Every participant has left the closure; the fallback below runs it on this thread.
        published.armed = false;
        if super::trace::on() {
            *self.spawned.lock().unwrap_or_else(|p| p.into_inner()) = (
                self.shared.started.load(Ordering::Relaxed),
                t_spawn,
                self.shared.started_end.load(Ordering::Relaxed),
            );
        }
        if st.failed == n {
            // No worker at all: the calling thread does the job.
            drop(st);
            let mut ws = self.fallback.lock().unwrap_or_else(|p| p.into_inner());
            let called = call(job, &mut ws);
            st = lock(&self.shared.state);
            st.note(called);
        }
        st.job = None;
        let ran = Ran {
            panicked: st.panicked,
            dead: st.dead.take(),
        };
        drop(st);
        drop(submit);
        if let Err(p) = by_caller {
            std::panic::resume_unwind(p);
        }
        ran
    }

    /// Stops every worker (each drains and frees its state) and joins them; waits for a running
    /// job first. The next job starts workers again.
    pub fn shutdown(&self) {
        let _submit = self.submit.lock().unwrap_or_else(|p| p.into_inner());
        lock(&self.shared.state).shutdown = true;
        self.shared.start.notify_all();
        // No start is under way: a job's starts all end before its run returns.
        let handles: Vec<JoinHandle<()>> = lock_handles(&self.shared)
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        for h in handles {
            let _ = h.join();
        }
        let mut st = lock(&self.shared.state);
        st.shutdown = false;
        st.alive.iter_mut().for_each(|a| *a = false);
        drop(st);
        let mut fb = self.fallback.lock().unwrap_or_else(|p| p.into_inner());
        release_state(std::mem::replace(&mut *fb, WorkerState::new(usize::MAX)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    fn pool(max: usize) -> Pool {
        Pool::new(PoolConfig::new("test-pool", max))
    }

    fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "timed out waiting: {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn every_worker_runs_each_job_once_and_borrows_work() {
        let pool = pool(5);
        assert_eq!(pool.live_threads(), 0, "no thread before the first job");
        for round in 0..50 {
            let hits = AtomicUsize::new(0);
            let local = [round; 3];
            assert!(pool
                .run(5, &|_ws| {
                    hits.fetch_add(local[0] + 1 - round, Ordering::Relaxed);
                })
                .ok());
            assert_eq!(hits.load(Ordering::Relaxed), 5);
        }
        assert_eq!(pool.live_threads(), 5);
    }

    #[test]
    fn a_job_runs_on_as_many_workers_as_asked_and_the_pool_is_bounded() {
        let pool = pool(4);
        for (ask, expect) in [(2, 2), (1, 1), (100, 4), (0, 1), (3, 3)] {
            let ids = Mutex::new(Vec::new());
            assert!(pool.run(ask, &|ws| ids.lock().unwrap().push(ws.id)).ok());
            let mut ids = ids.into_inner().unwrap();
            ids.sort();
            assert_eq!(ids, (0..expect).collect::<Vec<_>>(), "asked {ask}");
        }
        assert!(pool.live_threads() <= 4);
    }

    #[test]
    fn a_panicking_job_is_reported_and_the_pool_survives() {
        let pool = pool(3);
        assert!(!pool
            .run(3, &|ws| {
                if ws.id == 1 {
                    panic!("boom");
                }
            })
            .ok());
        let n = AtomicUsize::new(0);
        assert!(pool
            .run(3, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
            .ok());
        assert_eq!(n.load(Ordering::Relaxed), 3);
    }

    /// Issue 9 item 7: a worker that panicked with a copy in flight must not drop (free) the
    /// state that copy uses. The in-flight marker stands for an enqueued copy; `quiesce` is
    /// where a real state synchronizes its streams.
    #[test]
    fn a_panic_with_a_copy_in_flight_never_drops_the_worker_state_undrained() {
        let pool = pool(2);
        let before = super::super::worker::dropped_in_flight();
        let ran = pool.run(2, &|ws| {
            if ws.id == 0 {
                ws.test_in_flight = true;
                panic!("after enqueuing a copy");
            }
        });
        assert!(!ran.ok());
        assert!(ran.dead().is_none(), "drained: nothing dead to report");
        assert!(pool.run(2, &|_| {}).ok());
        pool.shutdown();
        assert_eq!(
            super::super::worker::dropped_in_flight(),
            before,
            "a worker state was dropped while a copy could still use it"
        );
    }

    /// A state whose streams cannot be drained is leaked, not dropped.
    #[test]
    fn an_undrainable_state_is_leaked() {
        let pool = pool(1);
        let before = super::super::worker::dropped_in_flight();
        let ran = pool.run(1, &|ws| {
            ws.test_in_flight = true;
            ws.test_drain_fails = true;
            panic!("copy in flight, stream broken");
        });
        assert!(!ran.ok());
        // The job learns why: its copies' context is dead (drain review, finding 1).
        assert!(
            matches!(ran.dead(), Some(Error::Cuda { .. })),
            "a panicked worker that could not be drained is reported with its CUDA error"
        );
        pool.shutdown();
        assert_eq!(super::super::worker::dropped_in_flight(), before);
    }

    /// Issue 9 (smaller findings): a failed spawn must not leave threads blocked forever, and the
    /// job still runs (on the workers that started, or on the caller).
    #[test]
    fn failed_spawns_shrink_the_job_and_leave_no_thread_behind() {
        let mut cfg = PoolConfig::new("test-pool", 8);
        cfg.fail_spawn_from = Some(3);
        let pool = Pool::new(cfg);
        let n = AtomicUsize::new(0);
        assert!(pool
            .run(8, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
            .ok());
        assert_eq!(n.load(Ordering::Relaxed), 3);
        assert_eq!(pool.live_threads(), 3);
        pool.shutdown();
        assert_eq!(pool.live_threads(), 0, "threads left behind after shutdown");

        let mut cfg = PoolConfig::new("test-pool", 4);
        cfg.fail_spawn_from = Some(0);
        let pool = Pool::new(cfg);
        let on = Mutex::new(Vec::new());
        assert!(pool
            .run(4, &|_| on.lock().unwrap().push(std::thread::current().id()))
            .ok());
        assert_eq!(*on.lock().unwrap(), vec![std::thread::current().id()]);
        assert_eq!(pool.live_threads(), 0);
    }

    /// Start together: the threads a job starts enter it only once every one of them is
    /// started, so none reads while another is still being created (the wait is set to 30 s,
    /// so a count that never reaches 0 shows as a slow job, not as a pass); threads already
    /// running enter at once; a job whose starts fail does not wait for the threads that
    /// never came.
    #[test]
    fn new_threads_enter_their_first_job_together() {
        let long = Duration::from_secs(30);
        for n in [2usize, 7, 16] {
            let mut cfg = PoolConfig::new("test-pool", n);
            cfg.start_wait = long;
            let pool = Pool::new(cfg);
            let t0 = Instant::now();
            let entered = Mutex::new(Vec::new());
            assert!(pool
                .run(n, &|_| entered.lock().unwrap().push(Instant::now()))
                .ok());
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "n = {n}: {:?}",
                t0.elapsed()
            );
            let last = *pool.shared.started_at.lock().unwrap().iter().max().unwrap();
            for &e in entered.lock().unwrap().iter() {
                assert!(
                    e >= last,
                    "n = {n}: a worker entered its job {:?} before the last start returned",
                    last - e
                );
            }
            // The same threads again: nobody waits for a start.
            let t1 = Instant::now();
            assert!(pool.run(n, &|_| {}).ok());
            assert!(
                t1.elapsed() < Duration::from_secs(10),
                "a warm job took {:?}",
                t1.elapsed()
            );
            pool.shutdown();
        }
        let mut cfg = PoolConfig::new("test-pool", 8);
        cfg.fail_spawn_from = Some(2);
        cfg.start_wait = long;
        let pool = Pool::new(cfg);
        let n = AtomicUsize::new(0);
        let t0 = Instant::now();
        assert!(pool
            .run(8, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
            .ok());
        assert_eq!(n.load(Ordering::Relaxed), 2);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the started threads waited {:?} for starts that had failed",
            t0.elapsed()
        );
        pool.shutdown();
    }

    /// Item 2 of the speed brief: the calling thread starts one worker thread, and the
    /// workers start the rest in a tree (each starts about half of what is left), so no thread
    /// creation chain is longer than about log2(n) + 1 and the caller is free at once.
    #[test]
    fn workers_start_each_other_in_a_tree_and_the_caller_starts_one() {
        for n in [1usize, 2, 3, 7, 16, 33] {
            let pool = pool(n);
            let hits = AtomicUsize::new(0);
            assert!(pool
                .run(n, &|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                })
                .ok());
            assert_eq!(hits.load(Ordering::Relaxed), n);
            let by = pool.shared.started_by.lock().unwrap().clone();
            assert_eq!(by.len(), n, "every worker started once");
            let me = std::thread::current().name().unwrap_or("").to_string();
            let from_caller = by.iter().filter(|(_, p)| *p == me).count();
            assert_eq!(
                from_caller, 1,
                "n = {n}: the caller started {from_caller} threads"
            );
            // Depth of the start chain of each worker.
            let parent = |id: usize| -> Option<usize> {
                let (_, p) = by.iter().find(|(c, _)| *c == id).unwrap();
                p.strip_prefix("test-pool-").map(|x| x.parse().unwrap())
            };
            let bound = (usize::BITS - n.leading_zeros()) as usize + 1;
            for id in 0..n {
                let (mut d, mut at) = (1, id);
                while let Some(p) = parent(at) {
                    d += 1;
                    at = p;
                }
                assert!(
                    d <= bound,
                    "n = {n}: worker {id} is {d} starts deep (bound {bound})"
                );
            }
            pool.shutdown();
            assert_eq!(pool.live_threads(), 0);
        }
    }

    #[test]
    fn shutdown_joins_every_worker_and_the_pool_restarts() {
        let pool = pool(6);
        assert!(pool.run(6, &|_| {}).ok());
        assert_eq!(pool.live_threads(), 6);
        pool.shutdown();
        assert_eq!(pool.live_threads(), 0);
        let n = AtomicUsize::new(0);
        assert!(pool
            .run(6, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
            .ok());
        assert_eq!(n.load(Ordering::Relaxed), 6);
        pool.shutdown();
    }

    #[test]
    fn idle_workers_exit_and_the_last_one_calls_the_hook() {
        let hook = Arc::new(AtomicUsize::new(0));
        let mut cfg = PoolConfig::new("test-pool", 3);
        cfg.idle = Some(Duration::from_millis(30));
        let h = hook.clone();
        cfg.on_idle = Some(Box::new(move || {
            h.fetch_add(1, Ordering::Relaxed);
        }));
        let pool = Pool::new(cfg);
        assert!(pool.run(3, &|_| {}).ok());
        wait_until("idle workers exit", || pool.live_threads() == 0);
        wait_until("idle hook", || hook.load(Ordering::Relaxed) == 1);
        // Started again by the next job.
        let n = AtomicUsize::new(0);
        assert!(pool
            .run(3, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            })
            .ok());
        assert_eq!(n.load(Ordering::Relaxed), 3);
        pool.shutdown();
    }

    /// Runs `pool.run(n, ..)` on another thread and waits (bounded) for it to return; the
    /// number of workers that ran the job, or a timeout panic (the job hung).
    fn run_bounded(pool: &Arc<Pool>, n: usize) -> (bool, usize) {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = pool.clone();
        std::thread::spawn(move || {
            let hits = AtomicUsize::new(0);
            let ok = p
                .run(n, &|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                })
                .ok();
            let _ = tx.send((ok, hits.load(Ordering::Relaxed)));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the job hung: a worker that died before its loop kept its count")
    }

    /// Review finding 3 (worker side): a worker that unwinds before its loop gives back its
    /// own count and those of the children it had not started, so the job, later jobs and
    /// shutdown complete; a later job starts it again.
    #[test]
    fn a_worker_that_panics_before_its_loop_neither_hangs_the_job_nor_the_pool() {
        for at in [PrologueAt::BeforeStarts, PrologueAt::BeforeInit] {
            // Worker 0 is started by the caller and starts all the others, so `BeforeStarts`
            // leaves none started (the job runs on the caller) and `BeforeInit` all but 0.
            let mut cfg = PoolConfig::new("test-pool", 8);
            cfg.prologue_panic = Some((0, at));
            let pool = Arc::new(Pool::new(cfg));
            let (ok, hits) = run_bounded(&pool, 8);
            assert!(ok, "{at:?}: no job panicked");
            let expect = if at == PrologueAt::BeforeInit { 7 } else { 1 };
            assert_eq!(hits, expect, "{at:?}: the job ran {hits} times");
            // Later jobs (worker 0 is started again and dies again) and shutdown complete.
            let (ok, again) = run_bounded(&pool, 8);
            assert!(
                ok && (1..8).contains(&again),
                "{at:?}: second job ran on {again}"
            );
            let p = pool.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                p.shutdown();
                let _ = tx.send(());
            });
            rx.recv_timeout(Duration::from_secs(10))
                .expect("shutdown hung");
            wait_until("no worker left", || pool.live_threads() == 0);
        }
    }

    static IN_JOB: AtomicUsize = AtomicUsize::new(0);
    static LEFT_JOB: AtomicUsize = AtomicUsize::new(0);

    /// Review finding 3 (caller side): the caller that unwinds between publishing a job and
    /// waiting for it must not leave while a worker may still call the job's closure (it would
    /// call through a dangling pointer). The closure captures only statics, so the old code's
    /// use-after-free reads nothing here; the counters show it.
    #[test]
    fn a_caller_that_panics_before_waiting_outlives_the_workers_in_its_job() {
        let mut cfg = PoolConfig::new("test-pool-caller", 4);
        cfg.caller_panic = true;
        let pool = Pool::new(cfg);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(4, &|_| {
                IN_JOB.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
                LEFT_JOB.fetch_add(1, Ordering::SeqCst);
            })
            .ok()
        }));
        assert!(r.is_err(), "the caller's panic propagates");
        let (inn, left) = (
            IN_JOB.load(Ordering::SeqCst),
            LEFT_JOB.load(Ordering::SeqCst),
        );
        assert_eq!(
            inn,
            left,
            "run unwound while {} workers were still inside the job's closure",
            inn - left
        );
        assert!(inn >= 1, "no worker ran the job");
        // Nobody enters the withdrawn job later.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(IN_JOB.load(Ordering::SeqCst), inn);
        pool.shutdown();
        assert_eq!(pool.live_threads(), 0);
    }
}

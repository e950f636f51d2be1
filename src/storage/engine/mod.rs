//! gpudirect's parallel POSIX engine: files ↔ host or device memory through one pool of workers
//! per device, so that the file IO of one piece overlaps the DMA of the previous one.
//!
//! - **Jobs** ([`Job`]): any number of files and buffers; each task is a piece of one file
//!   landing in (or coming from) one buffer, and belongs to one *item* (the caller's unit of
//!   success: a file IO error fails its item, a CUDA error fails the job).
//! - **Planning** ([`plan`]): an item's range is cut at multiples of the piece size
//!   (`min(task size, bounce size)`) in file-offset space, so every piece's aligned span fits a
//!   bounce buffer; workers pull pieces from a shared counter, in order (load balancing).
//! - **Segments** ([`segment`], the default for reads to the GPU): workers `pread` into
//!   disjoint spans of a ring of large pinned segments; one copy per run of payload contiguous
//!   in the segment and in one destination buffer is issued on a dedicated copy stream. A
//!   destination the job allocates itself (`read_to_gpu`) is allocated on the calling thread
//!   while the workers start and read ([`Engine::run_deferred`], [`DstGate`]); no slot is
//!   page-locked during the allocation (the driver serializes the two).
//! - **Lanes** (reads with [`Pipeline::Lanes`](crate::storage::Pipeline::Lanes)): each worker
//!   double-buffers two pinned bounce buffers on its own stream.
//! - **Gather writes** ([`gather`], every write from the GPU): the items are cut into large
//!   sequential segments whatever their sizes and alignment, each staged whole by device→host
//!   copies and written with one `pwrite` (O_DIRECT for the aligned part); the copies of
//!   segment k+1 overlap the write of segment k.
//! - **O_DIRECT**: reads over-read the aligned span into aligned memory; writes send unaligned
//!   heads and tails through the page cache. EINVAL from an O_DIRECT call switches the file to
//!   buffered IO for good. A short O_DIRECT read finishes through the page cache (it is not
//!   taken as end of file).
//! - **Placement**: workers of a device's pool are pinned to the CPUs of the GPU's NUMA node
//!   and fault in (first touch) the memory they stage through.
//! - **Bounded, lazy, releasable**: one engine per device (and one for host memory), created on
//!   first use; a job asks for `n` workers and the pool grows to the largest `n` asked (at most
//!   [`MAX_THREADS`]); threads start after the job is published; pinned memory is faulted in by
//!   the reads and page-locked slot by slot as the job goes. Nothing page-locked is freed
//!   during a job: a slot locked further gets one more registration, a ring replaced by a
//!   larger one, a worker's staging buffer replaced by a larger one and the small-transfer
//!   buffers (at most 64 page-locked; more at once use unlocked ones) are kept until the
//!   release (with `GPUDIRECT_ENGINE_IDLE_MS` set, workers that sit out a job may time out and
//!   free their staging meanwhile; a thread that unwinds outside a job frees its state).
//!   [`release_all`]
//!   stops the workers and frees every pinned byte; with `GPUDIRECT_ENGINE_IDLE_MS` set,
//!   engines idle that long do the same by themselves (off by default: freeing pinned memory
//!   waits for all the GPU's work, and stalls other threads' `cuEventCreate` meanwhile, so it
//!   happens only when the caller asks).
//! - Every stream is synchronized before a job returns: no copy outlives the call. A
//!   synchronize that fails says nothing for sure about the queued copies, so they are settled
//!   ([`crate::cuda::settle`]): a job that borrows memory waits until they completed or their
//!   context is dead (the process aborts after a minute of unknown answers); one whose caller
//!   owns every destination ([`Job::owning_destinations`]) waits while they run but gives up at
//!   the first unknown answer and, when they may still run then, fails undrained
//!   ([`Failed::drained`]): the caller leaks the destinations. The error of a drain whose
//!   copies may still run or whose context is dead wins over every other error of the job; one
//!   whose copies were found complete fails only a job nothing else failed.
//! - **Timing trace** ([`trace`], `GPUDIRECT_TRACE=timing`): each job prints where its time
//!   went (workers, IO, waits, page-locking, copies with GPU times); off, every probe is one
//!   relaxed atomic load.
//! - **Control** ([`Control`], from the caller): events every copy stream waits for before its
//!   first copy (the buffers' pending work, instead of synchronizing the caller's stream), a
//!   cancel flag (no new piece is taken; the pieces taken finish and are drained), and a
//!   callback per finished piece (progress).

pub(in crate::storage) mod bounce;
pub(in crate::storage) mod gather;
pub(in crate::storage) mod io;
pub(in crate::storage) mod numa;
pub(in crate::storage) mod plan;
pub(in crate::storage) mod pool;
pub(in crate::storage) mod segment;
pub(in crate::storage) mod small;
pub(in crate::storage) mod trace;
pub(in crate::storage) mod window;
pub(in crate::storage) mod worker;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use crate::cuda::settle::{Patience, Settled};
use crate::cuda::CurrentContext;
use crate::error::{Error, Result};
use crate::storage::config::DIRECT_ALIGN;
use io::Fds;
use plan::{direct_read_span, Task};
use pool::{Pool, PoolConfig};
use window::FdWindow;
use worker::WorkerState;

/// The most workers one engine runs (the cap of `GPUDIRECT_NTHREADS` and
/// `GpuFileOptions::threads`).
pub(in crate::storage) const MAX_THREADS: usize = 1024;

/// One buffer of a job.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) enum Mem {
    /// Host memory at this address.
    Host(*mut u8),
    /// Device memory of the job's context at this address.
    Dev(sys::CUdeviceptr),
    /// Device memory of the job's context allocated while the job runs: the address the
    /// job's gate of this index is given (copies into it wait for it; see
    /// [`Engine::run_deferred_each`]).
    Deferred(u32),
}

/// The address of a destination that is allocated while its job already reads
/// ([`Mem::Deferred`]): the calling thread allocates and opens the gate; a worker that is about
/// to copy into the destination waits here (its slot already page-locked), so the allocation
/// overlaps the first reads instead of preceding them.
pub(in crate::storage) struct DstGate {
    /// `None`: not decided yet; `Some(None)`: the allocation failed; `Some(Some(p))`: ready.
    st: Mutex<Option<Option<sys::CUdeviceptr>>>,
    cv: Condvar,
}

impl DstGate {
    pub fn new() -> Self {
        DstGate {
            st: Mutex::new(None),
            cv: Condvar::new(),
        }
    }

    /// Opens the gate with the destination's address, or with `None` when its allocation
    /// failed (fail the job first, so waiters see the abort).
    pub fn set(&self, p: Option<sys::CUdeviceptr>) {
        let mut g = self.st.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(p);
        }
        self.cv.notify_all();
    }

    /// The address once set.
    pub fn get(&self) -> Option<sys::CUdeviceptr> {
        self.st.lock().unwrap_or_else(|p| p.into_inner()).flatten()
    }

    /// Waits until the gate opens or `aborted()`; the address, or `None` (failed, aborted).
    pub fn wait(&self, aborted: impl Fn() -> bool) -> Option<sys::CUdeviceptr> {
        let mut g = self.st.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(p) = *g {
                return p;
            }
            if aborted() {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The direction of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) enum Op {
    /// File → memory.
    Read,
    /// Memory → file.
    Write,
}

/// Where the bytes of a one-buffer job go to or come from.
pub(in crate::storage) enum Target {
    /// Host memory, file → memory.
    HostRead(*mut u8),
    /// Host memory, memory → file.
    HostWrite(*const u8),
    /// Device memory in `ctx`, file → device.
    DevRead {
        ctx: Arc<CudaContext>,
        dptr: sys::CUdeviceptr,
    },
    /// Device memory in `ctx`, device → file.
    DevWrite {
        ctx: Arc<CudaContext>,
        dptr: sys::CUdeviceptr,
    },
}

/// A file of a job.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) enum JobFile<'a> {
    /// Open for the whole job.
    Open(&'a Fds),
    /// File `k` of the job's [`FdWindow`]: opened when a piece of it is read (see
    /// [`window`]).
    Lazy(usize),
}

/// A task's file, open while the task holds it.
pub(in crate::storage) enum FileRef<'j> {
    Open(&'j Fds),
    Held(window::Held<'j>),
}

impl std::ops::Deref for FileRef<'_> {
    type Target = Fds;
    fn deref(&self) -> &Fds {
        match self {
            FileRef::Open(f) => f,
            FileRef::Held(h) => h,
        }
    }
}

/// One transfer in flight: the files, the buffers, the plan and the results per task and item.
pub(in crate::storage) struct Job<'a> {
    files: Vec<JobFile<'a>>,
    /// Where the [`JobFile::Lazy`] files are opened.
    window: Option<&'a FdWindow>,
    tasks: Vec<Task>,
    piece: usize,
    op: Op,
    ctx: Option<Arc<CudaContext>>,
    bufs: Vec<Mem>,
    next: AtomicUsize,
    abort: AtomicBool,
    error: Mutex<Option<Error>>,
    /// The error is a drain's ([`Job::fail_drain`]): no later error replaces it.
    drain_failed: AtomicBool,
    /// The first error of a drain whose copies were then found complete: the job's error
    /// only when nothing else failed ([`Job::fail_drain`]).
    complete_drain_error: Mutex<Option<Error>>,
    /// A drain failed and copies of the job may still run.
    undrained: AtomicBool,
    /// How long a failed drain waits for the copies ([`Job::owning_destinations`]).
    patience: Patience,
    item_failed: Vec<AtomicBool>,
    item_errors: Mutex<Vec<(usize, Error)>>,
    done: Vec<AtomicUsize>,
    used_direct: AtomicBool,
    seg: Option<SegParams>,
    ctl: Control<'a>,
    /// The cancel flag stopped the job with tasks left.
    cut: AtomicBool,
    /// One per [`Mem::Deferred`] index.
    gates: &'a [DstGate],
    trace: Option<Box<trace::JobTrace>>,
}

/// What a caller adds to a job (see [`Job::with_control`]).
#[derive(Clone, Copy, Default)]
pub(in crate::storage) struct Control<'a> {
    /// Events (recorded on the buffers' streams) that every copy stream of a device job waits
    /// for before its first copy: the job's copies order after that work without the caller
    /// synchronizing anything.
    pub after: &'a [CudaEvent],
    /// When set, workers take no new task; the tasks taken finish (their copies drained) and
    /// the outcome says [`Outcome::cancelled`].
    pub cancel: Option<&'a AtomicBool>,
    /// Called on a worker with the bytes of each finished task (progress; must be quick).
    pub on_piece: Option<&'a (dyn Fn(usize) + Sync)>,
}

/// The shape of a segment pipeline (see [`segment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct SegParams {
    /// Bytes per segment (rounded down to a multiple of the piece, at least one piece).
    pub segment_size: usize,
    /// Segments in the ring (at least 2).
    pub segments: usize,
    /// Copy streams.
    pub streams: usize,
}

// SAFETY: the raw pointers in `bufs` address the caller's buffers, which outlive the job (the
// caller blocks in `Engine::run`); tasks cover disjoint ranges of them and each task is taken
// by exactly one worker (atomic counter), so no two threads touch the same bytes. The files are
// shared read-only (`pread`/`pwrite` take `&File`); the window that opens the lazy ones is
// `Sync` itself (its state is behind a mutex, its files behind `Arc`s).
unsafe impl Sync for Job<'_> {}

/// What a job did, per item.
#[derive(Debug)]
pub(in crate::storage) struct ItemOutcome {
    /// Bytes moved as a contiguous prefix of the item's range (a task that came up short ends
    /// it: end of file).
    pub prefix: usize,
    /// Bytes moved in all (more than `prefix` when a cancelled job left holes).
    pub moved: usize,
    /// Every task of the item moved all its bytes.
    pub complete: bool,
    /// The item's file error, if one happened.
    pub error: Option<Error>,
}

/// What a job did.
#[derive(Debug)]
pub(in crate::storage) struct Outcome {
    pub items: Vec<ItemOutcome>,
    /// Whether any byte went through O_DIRECT.
    pub odirect: bool,
    /// Host→device copies issued (segment pipeline).
    #[allow(dead_code)] // reported by the batch API
    pub copies: usize,
    /// The job's cancel flag stopped it before every task was done.
    pub cancelled: bool,
}

/// A job that failed: its error, and whether copies it issued may still run.
#[derive(Debug)]
pub(in crate::storage) struct Failed {
    /// What failed. The error of a drain whose copies may still run or whose context is dead
    /// (always an [`Error::Cuda`]) wins over every other: a caller that decides by the variant
    /// stays on the safe side. A drain whose copies were found complete is the error only of
    /// a job that nothing else failed.
    pub error: Error,
    /// No copy the job issued can run any more: each completed, or its context is dead
    /// (runs no more work). Always true for a job that waits ([`Patience::Wait`], the
    /// default); false only for one whose caller owns every destination
    /// ([`Job::owning_destinations`]) when a drain failed and the copies' state is unknown:
    /// that caller must leak the destinations.
    pub drained: bool,
}

impl Failed {
    /// The error of a job that waited for its copies (any job but one that
    /// [owns its destinations](Job::owning_destinations)): none can still run, so the
    /// caller may free or hand back the memory the job used.
    pub fn into_error(self) -> Error {
        if !self.drained {
            // Unreachable: a waiting job returns once its copies completed or their context
            // died. Returning would let the caller free memory they may still write.
            let msg = format!(
                "gpudirect: a storage job that borrowed its buffers returned with copies that may still run ({}): a bug in gpudirect, please report it; aborting",
                self.error
            );
            tracing::error!("{msg}");
            eprintln!("{msg}");
            std::process::abort();
        }
        self.error
    }
}

/// A failure before or beside the job's copies, after which none is in flight: every call of
/// the crate but the engine's jobs waits for its copies (or its context is dead) before it
/// returns an error.
impl From<Error> for Failed {
    fn from(error: Error) -> Self {
        Failed {
            error,
            drained: true,
        }
    }
}

impl<'a> Job<'a> {
    /// A one-file, one-buffer, one-item job over `tasks`; `piece` is the bounce-buffer size the
    /// plan was made for.
    ///
    /// # Safety
    /// The pointers in `target` must be valid (for writes for `HostRead`, reads for
    /// `HostWrite`, device memory of `ctx` for the device targets) for every task's
    /// `[buf_off, buf_off + len)`, until [`Engine::run`] returns.
    pub unsafe fn new(fds: &'a Fds, tasks: Vec<Task>, piece: usize, target: Target) -> Self {
        let (op, ctx, mem) = match target {
            Target::HostRead(p) => (Op::Read, None, Mem::Host(p)),
            Target::HostWrite(p) => (Op::Write, None, Mem::Host(p.cast_mut())),
            Target::DevRead { ctx, dptr } => (Op::Read, Some(ctx), Mem::Dev(dptr)),
            Target::DevWrite { ctx, dptr } => (Op::Write, Some(ctx), Mem::Dev(dptr)),
        };
        // SAFETY: forwarded contract.
        unsafe { Self::batch(vec![fds], vec![mem], 1, tasks, piece, op, ctx) }
    }

    /// A job over several files and buffers: task `t` moves `[t.file_off, + t.len)` of
    /// `files[t.file]` to or from `[t.buf_off, + t.len)` of `bufs[t.buf]`, for item `t.item`
    /// (`< items`). Host buffers of a write job are only read.
    ///
    /// # Safety
    /// Every task's buffer range must be valid memory (writable for reads, readable for writes;
    /// device memory of `ctx` for [`Mem::Dev`]) until [`Engine::run`] returns, and the ranges of
    /// a read job's tasks must not overlap.
    pub unsafe fn batch(
        files: Vec<&'a Fds>,
        bufs: Vec<Mem>,
        items: usize,
        tasks: Vec<Task>,
        piece: usize,
        op: Op,
        ctx: Option<Arc<CudaContext>>,
    ) -> Self {
        let files = files.into_iter().map(JobFile::Open).collect();
        // SAFETY: forwarded contract.
        unsafe { Self::batch_windowed(files, None, bufs, items, tasks, piece, op, ctx) }
    }

    /// [`batch`](Self::batch) over files of which the [`JobFile::Lazy`] ones are opened by
    /// `window` as the job reads them (read jobs only: a write job's files are all open).
    ///
    /// # Safety
    /// As [`batch`](Self::batch).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn batch_windowed(
        files: Vec<JobFile<'a>>,
        window: Option<&'a FdWindow>,
        bufs: Vec<Mem>,
        items: usize,
        tasks: Vec<Task>,
        piece: usize,
        op: Op,
        ctx: Option<Arc<CudaContext>>,
    ) -> Self {
        debug_assert!(tasks.iter().all(|t| (t.file as usize) < files.len()
            && (t.buf as usize) < bufs.len()
            && (t.item as usize) < items));
        debug_assert!(files.iter().all(|f| match f {
            JobFile::Open(_) => true,
            JobFile::Lazy(k) => op == Op::Read && window.is_some_and(|w| *k < w.len()),
        }));
        let done = tasks.iter().map(|_| AtomicUsize::new(0)).collect();
        Job {
            files,
            window,
            tasks,
            piece,
            op,
            ctx,
            bufs,
            next: AtomicUsize::new(0),
            abort: AtomicBool::new(false),
            error: Mutex::new(None),
            drain_failed: AtomicBool::new(false),
            complete_drain_error: Mutex::new(None),
            undrained: AtomicBool::new(false),
            patience: Patience::Wait,
            item_failed: (0..items).map(|_| AtomicBool::new(false)).collect(),
            item_errors: Mutex::new(Vec::new()),
            done,
            used_direct: AtomicBool::new(false),
            seg: None,
            ctl: Control::default(),
            cut: AtomicBool::new(false),
            gates: &[],
            trace: None,
        }
    }

    /// Orders the job after `ctl.after`, lets `ctl.cancel` stop it, reports pieces to
    /// `ctl.on_piece`.
    pub fn with_control(mut self, ctl: Control<'a>) -> Self {
        self.ctl = ctl;
        self
    }

    /// Every destination of the job is its caller's own allocation, which the caller leaks
    /// when the job fails undrained ([`Failed::drained`] false): a drain that fails then
    /// waits for copies that run but gives up at the first unknown answer
    /// ([`Patience::UntilUnknown`]) instead of waiting until the copies are known complete (a
    /// job that borrows memory waits, [`Patience::Wait`], and aborts the process when that
    /// stays unknown).
    pub fn owning_destinations(mut self) -> Self {
        self.patience = Patience::UntilUnknown;
        self
    }

    /// How long a failed drain of this job waits for its copies.
    fn patience(&self) -> Patience {
        self.patience
    }

    /// Makes `stream` wait for the events the job is ordered after (before its first copy).
    fn order(&self, stream: &CudaStream) -> Result<()> {
        for e in self.ctl.after {
            stream
                .wait(e)
                .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    /// The events the job is ordered after (see [`Control::after`]).
    fn after(&self) -> &[CudaEvent] {
        self.ctl.after
    }

    /// True when the control asks the job to stop (no new piece is taken).
    fn cancel_requested(&self) -> bool {
        self.ctl.cancel.is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// Records that the cancel flag stopped the job with work left.
    fn cut_short(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    /// Whether the cancel flag stopped the job with tasks left.
    fn was_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }

    /// Records that task `i` moved `n` bytes.
    fn finish(&self, i: usize, n: usize) {
        self.done[i].store(n, Ordering::Release);
        if let Some(f) = self.ctl.on_piece {
            f(n);
        }
    }

    /// The job's one [`Mem::Deferred`]`(0)` buffer gets its address from `gate`.
    pub fn with_gate(self, gate: &'a DstGate) -> Self {
        self.with_gates(std::slice::from_ref(gate))
    }

    /// Buffers [`Mem::Deferred`]`(k)` get their address from `gates[k]`.
    pub fn with_gates(mut self, gates: &'a [DstGate]) -> Self {
        self.gates = gates;
        self
    }

    /// The job's trace (`GPUDIRECT_TRACE=timing` only).
    fn trace(&self) -> Option<&trace::JobTrace> {
        self.trace.as_deref()
    }

    /// The trace clock when the job is traced, else 0 (no clock read).
    fn t_now(&self) -> u64 {
        if self.trace.is_some() {
            trace::now_us()
        } else {
            0
        }
    }

    /// Starts this job's trace, labelled `what`, for `threads` workers.
    fn start_trace(&mut self, what: impl FnOnce() -> String, threads: usize) {
        if trace::on() && self.trace.is_none() {
            let (n, bytes) = (
                self.tasks.len(),
                self.tasks.iter().map(|t| t.len).sum::<usize>(),
            );
            self.trace = trace::JobTrace::new(
                || {
                    format!(
                        "{} ({n} tasks, {bytes} B planned, {threads} workers)",
                        what()
                    )
                },
                n,
                threads,
            );
        }
    }

    /// Prints the trace's block (bytes: what the tasks moved).
    fn finish_trace(&self, gpu_done: &[Option<u64>]) {
        if let Some(t) = &self.trace {
            let bytes = self.done.iter().map(|d| d.load(Ordering::Relaxed)).sum();
            t.finish(bytes, gpu_done);
        }
    }

    /// Waits until the buffers `bufs` exist: true at once for buffers that are not deferred;
    /// false when an allocation failed or the job aborted.
    fn wait_dst(&self, bufs: impl IntoIterator<Item = u32>) -> Result<bool> {
        for b in bufs {
            if let Some(Mem::Deferred(k)) = self.bufs.get(b as usize) {
                let g = self
                    .gates
                    .get(*k as usize)
                    .ok_or_else(|| internal("a deferred buffer without its gate"))?;
                if g.wait(|| self.aborted()).is_none() {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Runs a device read through the segment pipeline (ignored for other jobs).
    pub fn with_segments(mut self, p: SegParams) -> Self {
        self.seg = Some(p);
        self
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }

    fn next(&self) -> Option<(usize, Task)> {
        if self.abort.load(Ordering::Relaxed) {
            return None;
        }
        if self.ctl.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            if self.next.load(Ordering::Relaxed) < self.tasks.len() {
                self.cut.store(true, Ordering::Relaxed);
            }
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.tasks.get(i).map(|t| (i, *t))
    }

    /// Fails the job after draining a stream of its copies failed with `e` (a CUDA error)
    /// and the settle found `s`. Copies that may still run ([`Settled::Pending`]) or whose
    /// context is dead: `e` replaces any earlier error but an earlier such drain's (an Io-kind
    /// error, a failed allocation, a panic), so that the caller sees that its copies could not
    /// be drained, and every worker stops; pending copies leave the job undrained. Copies all
    /// complete: the failure said nothing about them, so `e` replaces nothing and stops no
    /// worker; it is the job's error only when nothing else failed (no job error, no item
    /// error, no cancellation: see [`outcome`](Self::outcome)).
    fn fail_drain(&self, e: Error, s: Settled) {
        if s == Settled::Complete {
            self.complete_drain_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
            return;
        }
        self.abort.store(true, Ordering::Relaxed);
        if !s.quiet() {
            self.undrained.store(true, Ordering::Relaxed);
        }
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if !self.drain_failed.swap(true, Ordering::Relaxed) {
            *g = Some(e);
        }
    }

    /// After a stream of the job's copies was drained (`d`): nothing when that succeeded;
    /// otherwise settles them with the job's patience (`settle`, see
    /// [`crate::cuda::settle::settle`]) and fails the job with the drain's error
    /// ([`fail_drain`](Self::fail_drain)). What the settle found (`Complete` when the drain
    /// succeeded).
    fn drained(&self, d: Result<()>, settle: impl FnOnce(Patience) -> Settled) -> Settled {
        match d {
            Ok(()) => Settled::Complete,
            Err(e) => {
                let s = settle(self.patience());
                tracing::error!(%e, settled = ?s, "a storage job could not drain a stream of its copies");
                self.fail_drain(e, s);
                s
            }
        }
    }

    /// Fails the whole job (a CUDA error, a bug): every worker stops. The first error stays
    /// (a drain's always, see [`fail_drain`](Self::fail_drain)).
    fn fail(&self, e: Error) {
        self.abort.store(true, Ordering::Relaxed);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
    }

    /// After the pool ran the job: a panic fails it; a panicked worker whose streams turned
    /// out dead (its state leaked) fails it as a drain that failed (the context runs no more
    /// work: the copies are drained in that sense).
    fn ran(&self, ran: pool::Ran) {
        if !ran.ok() {
            if let Some(e) = ran.dead() {
                let code = match &e {
                    Error::Cuda { source, .. } => source.0,
                    _ => sys::CUresult::CUDA_ERROR_UNKNOWN,
                };
                self.fail_drain(e, Settled::Dead(code));
            }
            self.fail(panicked());
        }
    }

    fn item_failed(&self, item: u32) -> bool {
        self.item_failed[item as usize].load(Ordering::Relaxed)
    }

    /// Records a file error for `item` (its other tasks are skipped; other items go on).
    /// Errors other than file IO fail the job: returned for the caller to propagate.
    fn fail_item(&self, item: u32, e: Error) -> Result<()> {
        if !matches!(e, Error::Io { .. }) {
            return Err(e);
        }
        if !self.item_failed[item as usize].swap(true, Ordering::Relaxed) {
            self.item_errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((item as usize, e));
        }
        Ok(())
    }

    /// Task `t`'s file, for the task to read: opened by the job's window when it is lazy
    /// (an [`Error::Io`] naming it when it does not open: a file error of the task's item).
    /// Every task that is taken either holds this while it reads or calls
    /// [`skip_file`](Self::skip_file), so that the window closes each file after its last
    /// piece.
    fn file(&self, t: &Task) -> Result<FileRef<'_>> {
        match self.files[t.file as usize] {
            JobFile::Open(f) => Ok(FileRef::Open(f)),
            JobFile::Lazy(k) => match self.window {
                Some(w) => w.acquire(k).map(FileRef::Held),
                None => Err(internal("a lazily opened file without its window")),
            },
        }
    }

    /// Task `t` is taken but not read (its item failed already).
    fn skip_file(&self, t: &Task) {
        if let (JobFile::Lazy(k), Some(w)) = (self.files[t.file as usize], self.window) {
            w.skip(k);
        }
    }

    /// Task `t`'s file when it is open for the whole job (every file of a write job).
    fn open_fds(&self, t: &Task) -> Result<&Fds> {
        match self.files[t.file as usize] {
            JobFile::Open(f) => Ok(f),
            JobFile::Lazy(_) => Err(internal("a write to a lazily opened file")),
        }
    }

    /// An [`Error::Io`] of `op` on task `t`'s file.
    fn file_err(&self, t: &Task, op: &'static str, e: std::io::Error) -> Error {
        match (self.files[t.file as usize], self.window) {
            (JobFile::Open(f), _) => f.err(op, e),
            (JobFile::Lazy(k), Some(w)) => Error::io(op, Some(w.path(k).to_path_buf()), e),
            (JobFile::Lazy(_), None) => Error::io(op, None, e),
        }
    }

    fn dev_ptr(&self, buf: u32, off: usize) -> Result<sys::CUdeviceptr> {
        match self.bufs[buf as usize] {
            Mem::Dev(p) => Ok(p + off as u64),
            Mem::Deferred(k) => match self.gates.get(k as usize).and_then(DstGate::get) {
                Some(p) => Ok(p + off as u64),
                None => Err(internal("a copy into a destination not allocated yet")),
            },
            Mem::Host(_) => Err(internal("a host buffer in a device copy")),
        }
    }

    /// Reads task `t` of file `fds` (its [`file`](Self::file)) into the span that starts at
    /// `span` (an O_DIRECT task: its aligned over-read span, `span` aligned; a buffered one:
    /// its payload). Returns the payload bytes, which start at `span + head` for tasks planned
    /// direct (also when they fall back to buffered IO) and at `span` otherwise; short only at
    /// end of file.
    ///
    /// # Safety
    /// `span` must be writable for the task's span length ([`direct_read_span`] for direct
    /// tasks, `t.len` otherwise) and not be touched by anyone else during the call.
    unsafe fn read_span(&self, fds: &Fds, t: &Task, span: *mut u8) -> Result<usize> {
        if !t.direct {
            // SAFETY: span holds t.len bytes (contract).
            return unsafe { io::pread_full(&fds.buffered, span, t.len, t.file_off) }
                .map_err(|e| fds.err("pread", e));
        }
        let (io_off, io_len, head) = direct_read_span(t);
        if let Some(d) = fds.direct() {
            debug_assert_eq!(span as usize % DIRECT_ALIGN, 0);
            // SAFETY: span holds io_len bytes (contract).
            match unsafe { io::pread_direct_full(d, &fds.buffered, span, io_len, io_off) } {
                Ok(got) => {
                    self.used_direct.store(true, Ordering::Relaxed);
                    return Ok(got.saturating_sub(head).min(t.len));
                }
                Err(e) if is_einval(&e) => {
                    tracing::debug!(path = %fds.path.display(), "O_DIRECT read refused (EINVAL); using buffered IO");
                    fds.direct_broken.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(fds.err("pread", e)),
            }
        }
        // SAFETY: span + head + t.len <= span + io_len (the payload lies inside its span).
        unsafe { io::pread_full(&fds.buffered, span.add(head), t.len, t.file_off) }
            .map_err(|e| fds.err("pread", e))
    }

    /// The outcome per item, or the job's error (and whether its copies may still run).
    fn outcome(self, copies: usize) -> Result<Outcome, Failed> {
        if let Some(error) = self.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(Failed {
                error,
                drained: !self.undrained.load(Ordering::Relaxed),
            });
        }
        let mut items: Vec<ItemOutcome> = (0..self.item_failed.len())
            .map(|_| ItemOutcome {
                prefix: 0,
                moved: 0,
                complete: true,
                error: None,
            })
            .collect();
        let mut in_prefix = vec![true; items.len()];
        for (t, d) in self.tasks.iter().zip(&self.done) {
            let (d, k) = (d.load(Ordering::Relaxed), t.item as usize);
            items[k].moved += d;
            if in_prefix[k] {
                items[k].prefix += d;
            }
            if d < t.len {
                in_prefix[k] = false;
                items[k].complete = false;
            }
        }
        for (k, e) in self
            .item_errors
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
        {
            items[k].complete = false;
            items[k].error = Some(e);
        }
        let cancelled = self.cut.load(Ordering::Relaxed) && items.iter().any(|i| !i.complete);
        let complete_drain = self
            .complete_drain_error
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(error) = complete_drain {
            if !cancelled && items.iter().all(|i| i.error.is_none()) {
                // Nothing else failed: the drain's error (its copies completed).
                return Err(Failed {
                    error,
                    drained: true,
                });
            }
        }
        Ok(Outcome {
            items,
            odirect: self.used_direct.load(Ordering::Relaxed),
            copies,
            cancelled,
        })
    }
}

impl Outcome {
    /// For a one-item job: `(bytes moved as a prefix, used O_DIRECT)`, or the item's error.
    pub fn single(mut self) -> Result<(usize, bool)> {
        let it = self.items.swap_remove(0);
        match it.error {
            Some(e) => Err(e),
            None => Ok((it.prefix, self.odirect)),
        }
    }
}

fn internal(what: &str) -> Error {
    Error::Io {
        op: "IO engine",
        path: None,
        source: std::io::Error::other(format!("{what} (a bug in gpudirect: please report it)")),
    }
}

fn panicked() -> Error {
    internal("an IO worker panicked")
}

/// A pool of workers for one device (or for host memory only) and its pinned ring.
pub(in crate::storage) struct Engine {
    pool: Pool,
    seg: Mutex<Option<segment::SegRes>>,
    /// Rings replaced by a larger (or another context's) one, freed only by [`release_all`] or
    /// the idle release: dropping one unregisters it, which waits for all the context's work.
    /// A later job that one of them fits takes it back, so this holds at most one ring per
    /// context and shape the process grew through.
    retired: Mutex<Vec<segment::SegRes>>,
    /// Test hook: rings this engine built.
    #[cfg(test)]
    rings_built: AtomicUsize,
}

#[derive(Clone, PartialEq, Eq)]
struct Key {
    device: Option<usize>,
    numa_pin: bool,
}

fn registry() -> &'static Mutex<Vec<(Key, Arc<Engine>)>> {
    static ENGINES: Mutex<Vec<(Key, Arc<Engine>)>> = Mutex::new(Vec::new());
    &ENGINES
}

/// CPUs to pin a device's workers to (empty: do not pin).
fn device_cpus(device: Option<usize>, numa_pin: bool) -> Vec<usize> {
    match (device, numa_pin) {
        (Some(d), true) => numa::placement(d).cpus,
        _ => Vec::new(),
    }
}

/// The default worker count: the CPUs of the GPU's NUMA node this process may use (all
/// usable CPUs for host memory or when unknown), at least 4 and at most 16. Page-cached reads
/// are memory copies: a few busy workers saturate memory bandwidth and more only contend
/// (BENCHMARKS.md, "Default worker count"). 4 keeps a small machine's disk queue fed.
pub(in crate::storage) fn default_threads(device: Option<usize>, numa_pin: bool) -> usize {
    let mut n = device_cpus(device, numa_pin).len();
    if n == 0 {
        n = numa::allowed_cpus().len();
    }
    n.clamp(4, 16)
}

/// Workers for jobs that wait on the disk (O_DIRECT) when the thread count is not set: at
/// least this many, because for them threads are queue depth, not CPU.
pub(in crate::storage) const MIN_DIRECT_THREADS: usize = 32;

/// How long an engine waits without a job before it frees its threads and pinned memory
/// (`GPUDIRECT_ENGINE_IDLE_MS`; unset or `0`: never). Off by default: the release unregisters
/// pinned memory, and `cuMemHostUnregister` waits for all the context's work, other streams'
/// kernels included, while other threads' `cuEventCreate` waits for it (the H200:
/// `scripts/probes/pin2.py`; tests/storage_gpu_stall.rs). Done behind the caller's back, that
/// stalls the caller's CUDA calls, or deadlocks when the caller's GPU work waits for the caller.
pub(in crate::storage) fn idle_timeout() -> Result<Option<Duration>> {
    Ok(idle_ms()?.filter(|&ms| ms > 0).map(Duration::from_millis))
}

/// How long a non-blocking transfer's thread (`storage::Transfer`) waits for work before it
/// exits: `GPUDIRECT_ENGINE_IDLE_MS` when set (`0`: never), else 5 s. These threads hold no
/// pinned memory, so their exit calls nothing that waits for the GPU.
pub(in crate::storage) fn transfer_thread_idle() -> Result<Option<Duration>> {
    let ms = idle_ms()?.unwrap_or(5000);
    Ok((ms > 0).then(|| Duration::from_millis(ms)))
}

fn idle_ms() -> Result<Option<u64>> {
    crate::env::Env::process().parse(
        "GPUDIRECT_ENGINE_IDLE_MS",
        "a number of milliseconds (0: never)",
        |v| v.trim().parse::<u64>().ok(),
    )
}

/// The process-wide engine for `device` (`None`: host memory only), created on first use (no
/// thread starts until its first job). At most one per device and pinning choice.
pub(in crate::storage) fn engine(device: Option<usize>, numa_pin: bool) -> Result<Arc<Engine>> {
    let numa_pin = numa_pin && device.is_some();
    let key = Key { device, numa_pin };
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, e)) = reg.iter().find(|(k, _)| *k == key) {
        return Ok(e.clone());
    }
    let idle = idle_timeout()?;
    trace::init()?;
    let t0 = trace::now_us();
    let cpus = device_cpus(device, numa_pin);
    let name = match device {
        Some(d) => format!("gpudirect-io{d}"),
        None => "gpudirect-io".to_string(),
    };
    let e = Arc::new_cyclic(|weak: &Weak<Engine>| {
        let mut cfg = PoolConfig::new(name, MAX_THREADS);
        cfg.idle = idle;
        cfg.init = Arc::new(move |_| {
            if !cpus.is_empty() && !numa::pin_current_thread(&cpus) {
                tracing::debug!("could not pin an IO worker to the GPU's NUMA node");
            }
            // A device engine's workers call CUDA while the caller may capture a graph on
            // another thread (a non-blocking transfer's caller, say).
            if device.is_some() {
                crate::cuda::ignore_other_threads_captures();
            }
        });
        let weak = weak.clone();
        cfg.on_idle = Some(Box::new(move || {
            if let Some(e) = weak.upgrade() {
                // A job that holds the ring keeps it; the next idle period frees it. The ring
                // is taken out under the lock and dropped after it: its `cuMemHostUnregister`
                // waits for the device's other work (a stream held by a host function holds it
                // up: CONTRIBUTING.md, "CUDA pointer facts"), and a job starting meanwhile must
                // not wait for that behind the lock; it builds a ring of its own.
                // The retired rings only while no job holds the ring lock either (a job takes
                // `retired` under it): never beside a starting job.
                let (ring, retired) = match e.seg.try_lock() {
                    Ok(mut g) => {
                        let retired = e
                            .retired
                            .try_lock()
                            .ok()
                            .map(|mut r| std::mem::take(&mut *r));
                        (g.take(), retired)
                    }
                    Err(_) => (None, None),
                };
                drop((ring, retired));
            }
        }));
        Engine {
            pool: Pool::new(cfg),
            seg: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            #[cfg(test)]
            rings_built: AtomicUsize::new(0),
        }
    });
    reg.push((key, e.clone()));
    trace::mark(|| {
        format!(
            "engine for {} created ({:.3} ms: NUMA placement, no thread yet)",
            device.map_or("host memory".to_string(), |d| format!("GPU {d}")),
            (trace::now_us() - t0) as f64 / 1e3
        )
    });
    Ok(e)
}

/// What [`release_all`] gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(in crate::storage) struct Released {
    /// Worker threads stopped.
    pub threads: usize,
    /// Bytes of host memory unmapped (page-locked or not).
    pub ring_bytes: usize,
}

/// Stops every engine's workers (waiting for running jobs) and frees their pinned memory. The
/// engines stay usable: the next job starts them again.
pub(in crate::storage) fn release_all() -> Released {
    let engines: Vec<Arc<Engine>> = registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(_, e)| e.clone())
        .collect();
    let mut r = Released::default();
    for e in engines {
        r.threads += e.pool.live_threads();
        e.pool.shutdown();
        // Taken out under the lock, unregistered after it (see the engine's idle release).
        let ring = e.seg.lock().unwrap_or_else(|p| p.into_inner()).take();
        let retired = std::mem::take(&mut *e.retired.lock().unwrap_or_else(|p| p.into_inner()));
        for s in ring.into_iter().chain(retired) {
            r.ring_bytes += s.bytes();
        }
    }
    r.ring_bytes += small::release();
    r
}

impl Engine {
    /// Runs `job` to completion on up to `threads` workers. A host job of one task runs on the
    /// calling thread.
    pub fn run(&self, mut job: Job<'_>, threads: usize) -> Result<Outcome, Failed> {
        if !job.gates.is_empty() || job.bufs.iter().any(|b| matches!(b, Mem::Deferred(_))) {
            return Err(internal("a deferred destination outside Engine::run_deferred").into());
        }
        if job.tasks.is_empty() {
            return job.outcome(0);
        }
        let threads = threads.clamp(1, MAX_THREADS).min(job.tasks.len());
        if job.op == Op::Read && job.ctx.is_some() {
            if let Some(p) = job.seg {
                return self.run_segments(job, p, threads, |_| {});
            }
        }
        if job.op == Op::Write && job.ctx.is_some() {
            return self.run_gather(job, threads);
        }
        let what = match (job.op, job.ctx.is_some()) {
            (Op::Read, true) => "read to the GPU (lanes)",
            (Op::Write, true) => "write from the GPU",
            (Op::Read, false) => "read to host memory",
            (Op::Write, false) => "write from host memory",
        };
        job.start_trace(|| what.to_string(), threads);
        if job.tasks.len() == 1 && job.ctx.is_none() {
            // Host memory only: no copy can be in flight when this unwinds.
            let mut ws = WorkerState::new(usize::MAX);
            work(&mut ws, &job);
        } else {
            let ran = self
                .pool
                .run(threads, &|ws: &mut WorkerState| work(ws, &job));
            self.note_spawns(&job);
            job.ran(ran);
            #[cfg(test)]
            if let Some(e) =
                fail_drain::fire(&job, job.done.iter().any(|d| d.load(Ordering::Relaxed) > 0))
            {
                // The lanes were drained for real: the hook's answers, then idle.
                job.drained(Err(e), |p| {
                    crate::cuda::settle::settle(
                        1,
                        |_| fail_drain::next_query().unwrap_or(sys::CUresult::CUDA_SUCCESS),
                        p,
                        "test",
                    )
                });
            }
        }
        job.finish_trace(&[]);
        job.outcome(0)
    }

    /// Runs a write from device memory as a gather write ([`gather`]): big sequential
    /// segments, each staged whole through a worker's two pinned buffers, on up to `threads`
    /// workers (segments of [`gather::segment_bytes`]).
    fn run_gather(&self, mut job: Job<'_>, threads: usize) -> Result<Outcome, Failed> {
        let ctx = job.ctx.clone().expect("device job");
        let seg = gather::segment_bytes(threads);
        let direct = job.tasks.iter().any(|t| t.direct);
        let gather::WLayout { tasks, segs } = gather::plan(&job.tasks, seg, direct);
        let threads = threads.min(segs.len()).max(1);
        job.done = tasks.iter().map(|_| AtomicUsize::new(0)).collect();
        job.tasks = tasks;
        job.start_trace(
            || {
                format!(
                    "write from GPU {} (gather: {} writes of up to {} MiB{})",
                    ctx.ordinal(),
                    segs.len(),
                    seg >> 20,
                    if direct { ", O_DIRECT" } else { "" }
                )
            },
            threads,
        );
        let gj = gather::GatherJob::new(segs);
        let ran = self.pool.run(threads, &|ws: &mut WorkerState| {
            let _f = FailOnUnwind(&job);
            if let Some(t) = job.trace() {
                t.entered(ws.id);
            }
            let r = (|| -> Result<()> {
                let li = ws.lane(&ctx)?;
                // The copies out of the sources wait for the work pending on them.
                job.order(&ws.lanes[li].stream)?;
                ws.ensure_slot(0, seg, true)?;
                ws.ensure_slot(1, seg, true)?;
                let bufs = [ws.slot_ptr(0), ws.slot_ptr(1)];
                gj.work(&job, &mut ws.lanes[li], bufs, ws.id)
            })();
            if let Err(e) = r {
                job.fail(e);
            }
        });
        self.note_spawns(&job);
        job.ran(ran);
        job.finish_trace(&[]);
        job.outcome(gj.copies.load(Ordering::Relaxed))
    }

    /// Trace: the threads the last pool run started.
    fn note_spawns(&self, job: &Job<'_>) {
        if let Some(t) = job.trace() {
            let (n, a, b) = self.pool.last_spawn();
            if n > 0 {
                t.note(format!(
                    "started {n} worker threads from {:.3} to {:.3} ms (after the job was published; the caller starts one, they start each other)",
                    a.saturating_sub(t.start()) as f64 / 1e3,
                    b.saturating_sub(t.start()) as f64 / 1e3
                ));
            }
        }
    }

    /// Runs `f(i)` for every `i < n` on up to `threads` workers and the calling thread
    /// (opening or closing many files in parallel). False when `f` panicked, on a worker or
    /// on the calling thread alike (the calling thread then stops taking items and the workers
    /// take the rest; this returns once every worker returned), so a caller has one way to
    /// learn of a panic whichever thread took the item.
    pub fn for_each(&self, n: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if n == 0 {
            return true;
        }
        let next = AtomicUsize::new(0);
        let t0 = trace::now_us();
        let threads = threads.clamp(1, MAX_THREADS).min(n);
        let take = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
        };
        // The calling thread takes items too (from the first moment: the workers start
        // meanwhile); it waits for no worker, so the pool's contract holds.
        let mut by_caller = true;
        let ok = self
            .pool
            .run_with(threads, &|_ws: &mut WorkerState| take(), || {
                by_caller = catch_unwind(AssertUnwindSafe(take)).is_ok();
            })
            .ok();
        let ok = ok && by_caller;
        trace::mark(|| {
            let (spawned, _, _) = self.pool.last_spawn();
            format!(
                "for_each of {n} on {threads} workers ({spawned} threads started): {:.3} ms",
                (trace::now_us() - t0) as f64 / 1e3
            )
        });
        ok
    }

    /// Sets up (or reuses, or grows) this engine's segment ring for `ctx`, with no job running.
    fn seg_res<'g>(
        &self,
        g: &'g mut Option<segment::SegRes>,
        ctx: &Arc<CudaContext>,
        seg_bytes: usize,
        p: SegParams,
    ) -> Result<&'g segment::SegRes> {
        if !g
            .as_ref()
            .is_some_and(|r| r.fits(ctx, seg_bytes, p.segments, p.streams))
        {
            let shape = match g.as_ref() {
                Some(r) if r.fits(ctx, 0, 0, 0) => r.grown(seg_bytes, p.segments, p.streams),
                _ => (seg_bytes, p.segments, p.streams),
            };
            // The old ring's copies were drained when its last job ended; it is kept, not
            // dropped (its unregister would wait for the context's other work), and taken back
            // when a later job fits it.
            let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
            let again = retired
                .iter()
                .position(|r| r.fits(ctx, seg_bytes, p.segments, p.streams));
            let next = match again {
                Some(i) => retired.swap_remove(i),
                None => {
                    crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
                    #[cfg(test)]
                    self.rings_built.fetch_add(1, Ordering::SeqCst);
                    segment::SegRes::new(ctx, shape.0, shape.1, shape.2)?
                }
            };
            if let Some(old) = g.replace(next) {
                retired.push(old);
            }
        }
        Ok(g.as_ref().expect("set above"))
    }

    /// Allocates and page-locks the segment ring for `ctx` now, in parallel on the workers (no
    /// IO), so that even the first job's first slot is pinned already.
    pub fn prepare_segments(
        &self,
        ctx: &Arc<CudaContext>,
        piece: usize,
        p: SegParams,
        threads: usize,
    ) -> Result<()> {
        let seg_bytes = segment::tasks_per_segment(p.segment_size, piece) * piece;
        let mut g = self.seg.lock().unwrap_or_else(|p| p.into_inner());
        let res = self.seg_res(&mut g, ctx, seg_bytes, p)?;
        res.pin_all(&self.pool, threads)
    }

    /// Builds (or reuses) the segment ring for `ctx` and faults in and page-locks, whole, as
    /// many of its first slots as `bytes` fill (at most the ring's), on up to `threads`
    /// workers, while the calling thread runs `caller` and each worker, once it has faulted
    /// in its share, runs `beside` (a batch checks its files by path on both meanwhile).
    /// Starts the workers too; `beside` is not run when this fails before they start. The job
    /// that follows finds those slots locked and copies a segment as soon as it is read.
    /// `caller` runs exactly once whatever this returns (on an error before the workers
    /// start, on the calling thread before returning). A caller panic propagates (after the
    /// workers are done); a worker panic is an `Err`. An error leaves the ring unbuilt or
    /// partly locked: the job that follows builds and locks what it needs and reports its own
    /// error, so a caller may treat this as best effort.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_segments_beside(
        &self,
        ctx: &Arc<CudaContext>,
        piece: usize,
        p: SegParams,
        bytes: usize,
        threads: usize,
        caller: impl FnOnce(),
        beside: &(dyn Fn() + Sync),
    ) -> Result<()> {
        let t0 = trace::now_us();
        let seg_bytes = segment::tasks_per_segment(p.segment_size, piece) * piece;
        let slots = (bytes / seg_bytes.max(1)).min(p.segments);
        let mut g = self.seg.lock().unwrap_or_else(|p| p.into_inner());
        let built = CurrentContext::bind(ctx).and_then(|current| {
            let res = self.seg_res(&mut g, ctx, seg_bytes, p)?;
            Ok((current, res))
        });
        let r = match built {
            Ok((_current, res)) => res.pin_first(&self.pool, threads, slots, caller, beside),
            Err(e) => {
                caller();
                Err(e)
            }
        };
        trace::mark(|| {
            format!(
                "ring prepared beside the caller: {slots} slots of {} MiB faulted in on the workers and page-locked in {:.3} ms{}",
                seg_bytes >> 20,
                (trace::now_us() - t0) as f64 / 1e3,
                if r.is_err() { " (failed)" } else { "" }
            )
        });
        r
    }

    /// Starts `threads` workers and binds `ctx` on each (so their first job does not pay it).
    pub fn prepare_workers(&self, ctx: &Arc<CudaContext>, threads: usize) {
        // A panic (none is possible here) only loses the warm-up.
        let _ = self.pool.run(threads, &|_ws: &mut WorkerState| {
            let _ = crate::cuda::bind(ctx);
        });
    }

    /// Runs a device read through the segment ring; `caller` runs on the calling thread while
    /// the workers read (see [`run_deferred`](Self::run_deferred)).
    fn run_segments(
        &self,
        mut job: Job<'_>,
        p: SegParams,
        threads: usize,
        caller: impl FnOnce(&Job<'_>),
    ) -> Result<Outcome, Failed> {
        let ctx = job.ctx.clone().expect("device job");
        // The calling thread builds the ring, allocates a deferred destination and drains
        // the copy streams in `ctx`; its own current context is put back when this returns.
        let _current = CurrentContext::bind(&ctx)?;
        let t_ring = trace::now_us();
        let seg_bytes = segment::tasks_per_segment(p.segment_size, job.piece) * job.piece;
        let mut g = self.seg.lock().unwrap_or_else(|p| p.into_inner());
        trace::mark(|| {
            format!(
                "ring lock taken in {:.3} ms",
                (trace::now_us() - t_ring) as f64 / 1e3
            )
        });
        let res = self.seg_res(&mut g, &ctx, seg_bytes, p)?;
        job.start_trace(
            || format!("read to GPU {} (segments)", ctx.ordinal()),
            threads,
        );
        if let Some(t) = job.trace() {
            t.note(format!(
                "ring ready: {} slots of {} MiB, {:.3} ms{}",
                segment::Ring::slots(res),
                segment::Ring::slot_bytes(res) >> 20,
                (trace::now_us() - t_ring) as f64 / 1e3,
                if self.pool.live_threads() == 0 {
                    ", no worker thread running yet"
                } else {
                    ""
                }
            ));
            let segs = segment::layout(&job.tasks, seg_bytes).segs.len();
            if let Err(e) = res.start_timing(segs) {
                t.note(format!("no GPU timing: {e}"));
            }
        }
        let end = segment::run(&self.pool, &job, res, p, threads, || caller(&job));
        #[cfg(test)]
        let end = fail_drain::apply(end, &job);
        #[cfg(test)]
        let end = match end {
            mut end if faults::fired(&job) == Some(faults::Fault::DrainFails) => {
                if end.drained.is_ok() {
                    end.drained = Err(faults::drain_error());
                }
                end
            }
            end => end,
        };
        self.note_spawns(&job);
        // A failed synchronize says nothing for sure about the queued copies (a stale error in
        // cudarc's context, a binding that failed, or the context's sticky error): the job
        // settles them (waits until they completed or the context is dead, unless its caller
        // owns and leaks the destinations). The ring lock `g` is held meanwhile: the engine's
        // other jobs wait for this one as they would for its copies (the settle takes no
        // lock, so nothing waits in a circle).
        let settled = job.drained(end.drained, |p| {
            // SAFETY: the ring's streams are alive (the ring owns them) in its live context.
            res.settle(p, |c, st| unsafe { query(&job, c, st) })
        });
        if settled != Settled::Complete {
            // The ring may still be named by copies (queued, or in a dead context that will
            // not unregister it): never unmapped.
            tracing::error!("could not drain the segment ring; leaking it");
            std::mem::forget(g.take());
        } else if job.trace.is_some() {
            let done = res.finish_timing();
            job.finish_trace(&done);
        }
        drop(g);
        if let Some(p) = end.panic {
            if settled.quiet() {
                // No copy can run any more: the destination may go now.
                std::panic::resume_unwind(p);
            }
            // Unwinding would free destinations that queued copies may still write: the
            // panic (a bug) is logged and the drain's CUDA error returned (undrained), so the
            // caller leaks them.
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(
                panic = %msg,
                "a storage job's calling thread panicked and its copies could not be drained (a bug in gpudirect: please report it)"
            );
        }
        job.outcome(end.copies)
    }

    /// Runs a device read (through the segment ring) whose one destination buffer,
    /// [`Mem::Deferred`]`(0)`, does not exist yet (its address comes from the job's gate):
    /// `alloc` runs on the calling thread at once (one worker thread is started first; the
    /// others start each other), and returns the destination's address (or fails the job).
    /// Workers read into the ring meanwhile; a segment's copies wait for the address, and only
    /// then page-lock its slot. When `alloc` fails or panics, no copy into the destination was
    /// issued.
    ///
    /// The ring keeps its configured slots (a larger ring is slower in steady state; see
    /// [`segment`]'s "Ring size"): the workers read that far ahead while the allocation runs.
    pub fn run_deferred(
        &self,
        job: Job<'_>,
        threads: usize,
        alloc: impl FnOnce() -> Result<sys::CUdeviceptr>,
    ) -> Result<Outcome, Failed> {
        if job.gates.len() != 1 {
            return Err(internal("a deferred destination without its one gate").into());
        }
        let mut alloc = Some(alloc);
        self.run_deferred_each(job, threads, |_| match alloc.take() {
            Some(f) => f(),
            None => Err(internal("a single deferred destination allocated twice")),
        })
    }

    /// [`run_deferred`](Self::run_deferred) for a job with one gate per deferred buffer:
    /// `alloc(k)` runs on the calling thread for `k` = 0, 1, … in turn (order the gates as
    /// the tasks first use their buffers, so the first copies wait least) and returns buffer
    /// `k`'s address, opening gate `k`. A segment's copies wait only for the buffers they write,
    /// and its slot is page-locked after those exist: page-lockings may overlap later
    /// allocations (which they slow down, not the copies waiting). When `alloc(k)` fails or
    /// panics, the job fails and gates `k..` open empty; no copy into those buffers was issued.
    pub fn run_deferred_each(
        &self,
        job: Job<'_>,
        threads: usize,
        alloc: impl FnMut(usize) -> Result<sys::CUdeviceptr>,
    ) -> Result<Outcome, Failed> {
        let Some(p) = job.seg.filter(|_| !job.gates.is_empty()) else {
            return Err(
                internal("a deferred destination without the segment pipeline or a gate").into(),
            );
        };
        if job.ctx.is_none() || job.op != Op::Read {
            return Err(internal("a deferred destination outside a device read").into());
        }
        if job
            .bufs
            .iter()
            .any(|b| matches!(b, Mem::Deferred(k) if *k as usize >= job.gates.len()))
        {
            return Err(internal("a deferred buffer without its gate").into());
        }
        if job.tasks.is_empty() {
            // Nothing to copy: the destinations are still allocated (the caller hands them out).
            open_gates(&job, alloc);
            return job.outcome(0);
        }
        let threads = threads.clamp(1, MAX_THREADS).min(job.tasks.len());
        self.run_segments(job, p, threads, |job| open_gates(job, alloc))
    }
}

/// Calls `alloc(k)` for each of the job's gates in turn and opens gate `k` with its address;
/// on a failure (or a panic in `alloc`) fails the job first and opens the gates not yet open
/// empty, so no worker waits for them forever.
fn open_gates(job: &Job<'_>, mut alloc: impl FnMut(usize) -> Result<sys::CUdeviceptr>) {
    /// Opens the gates from `from` on empty when dropped, failing the job first (a no-op
    /// for a job that failed already, as the first error stays): after an allocation's error,
    /// a failed job, or a panic in `alloc`.
    struct Resolve<'j, 'a> {
        job: &'j Job<'a>,
        from: usize,
    }
    impl Drop for Resolve<'_, '_> {
        fn drop(&mut self) {
            let rest = &self.job.gates[self.from..];
            if !rest.is_empty() {
                self.job.fail(panicked());
                for g in rest {
                    g.set(None);
                }
            }
        }
    }
    let mut guard = Resolve { job, from: 0 };
    let t0 = trace::now_us();
    let n = job.gates.len();
    // Trace: when the first gate opened, and the slowest allocation (µs).
    let (mut first_open, mut slowest) = (0u64, (0u64, 0usize));
    for (k, g) in job.gates.iter().enumerate() {
        // A failed job (its error is set) allocates nothing more. (Not on a cancel: a segment
        // read in full still has its copies issued, and they wait for their destinations.)
        if job.aborted() {
            break;
        }
        let ta = trace::now_us();
        match alloc(k) {
            Ok(p) => {
                g.set(Some(p));
                let tb = trace::now_us();
                if k == 0 {
                    first_open = tb;
                }
                if tb - ta > slowest.0 {
                    slowest = (tb - ta, k);
                }
            }
            Err(e) => {
                job.fail(e);
                break;
            }
        }
        guard.from = k + 1;
    }
    let failed = guard.from < n;
    drop(guard);
    if let Some(t) = job.trace() {
        let from = t0.saturating_sub(t.start()) as f64 / 1e3;
        let fail = if failed { " (failed)" } else { "" };
        t.note(if n == 1 {
            format!("destination allocated on the calling thread from {from:.3} ms{fail}")
        } else {
            format!(
                "{n} destinations allocated on the calling thread from {from:.3} to {:.3} ms{fail}; the first ready at {:.3} ms, the slowest #{} took {:.3} ms",
                trace::now_us().saturating_sub(t.start()) as f64 / 1e3,
                first_open.saturating_sub(t.start()) as f64 / 1e3,
                slowest.1,
                slowest.0 as f64 / 1e3
            )
        });
    }
}

/// Fails the job when dropped during a panic (so that no worker waits for a slot, a pin or a
/// destination the panicking thread would have provided, and no item counts as done).
pub(in crate::storage) struct FailOnUnwind<'j, 'a>(pub &'j Job<'a>);

impl Drop for FailOnUnwind<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(panicked());
        }
    }
}

fn work(ws: &mut WorkerState, job: &Job<'_>) {
    if let Some(t) = job.trace() {
        t.entered(ws.id);
    }
    let r = match (job.op, job.ctx.as_ref()) {
        (Op::Read, None) => host_read(ws, job),
        (Op::Write, None) => host_write(ws, job),
        (Op::Read, Some(ctx)) => dev_read(ws, job, ctx),
        (Op::Write, Some(_)) => Err(internal("a device write outside Engine::run_gather")),
    };
    if let Err(e) = r {
        job.fail(e);
    }
}

fn is_einval(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Writes task `t` from `buf` (`t.len` bytes; aligned when `t.direct`).
fn write_task(job: &Job<'_>, t: &Task, buf: *const u8) -> Result<()> {
    let fds = job.open_fds(t)?;
    if t.direct && (buf as usize).is_multiple_of(DIRECT_ALIGN) {
        if let Some(d) = fds.direct() {
            // SAFETY: buf is readable for t.len bytes (caller).
            match unsafe { io::pwrite_full(d, buf, t.len, t.file_off) } {
                Ok(()) => {
                    job.used_direct.store(true, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if is_einval(&e) => {
                    tracing::debug!(path = %fds.path.display(), "O_DIRECT write refused (EINVAL); using buffered IO");
                    fds.direct_broken.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(fds.err("pwrite", e)),
            }
        }
    }
    // SAFETY: buf is readable for t.len bytes (caller).
    unsafe { io::pwrite_full(&fds.buffered, buf, t.len, t.file_off) }
        .map_err(|e| fds.err("pwrite", e))
}

fn host_ptr(job: &Job<'_>, t: &Task) -> Result<*mut u8> {
    match job.bufs[t.buf as usize] {
        // SAFETY: buf_off + len lies inside the caller's buffer (Job::batch contract).
        Mem::Host(p) => Ok(unsafe { p.add(t.buf_off) }),
        Mem::Dev(_) | Mem::Deferred(_) => Err(internal("a device buffer in a host job")),
    }
}

fn host_read(ws: &mut WorkerState, job: &Job<'_>) -> Result<()> {
    while let Some((i, t)) = job.next() {
        if job.item_failed(t.item) {
            job.skip_file(&t);
            continue;
        }
        let user = host_ptr(job, &t)?;
        let t0 = job.t_now();
        let fds = match job.file(&t) {
            Ok(f) => f,
            Err(e) => {
                job.fail_item(t.item, e)?;
                continue;
            }
        };
        let straight = !t.direct
            || fds.direct().is_none()
            || (plan::is_aligned(t.file_off)
                && t.len.is_multiple_of(DIRECT_ALIGN)
                && (user as usize).is_multiple_of(DIRECT_ALIGN));
        let r = if straight && !(t.direct && fds.direct().is_some()) {
            // SAFETY: user is writable for t.len bytes.
            unsafe { io::pread_full(&fds.buffered, user, t.len, t.file_off) }
                .map_err(|e| fds.err("pread", e))
        } else if straight {
            // Aligned: O_DIRECT straight into the caller's memory (the span is the task).
            // SAFETY: the span is exactly [user, user + t.len), writable.
            unsafe { job.read_span(&fds, &t, user) }
        } else {
            ws.ensure_slot(0, job.piece, false)?;
            let b = ws.slot_ptr(0);
            let head = direct_read_span(&t).2;
            // SAFETY: b holds piece >= the span's bytes; only this worker uses it.
            unsafe { job.read_span(&fds, &t, b) }.inspect(|&n| {
                // SAFETY: b[head..head+n] was just filled; user has room for t.len >= n
                // bytes; the bounce buffer and the caller's memory do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(b.add(head), user, n) };
            })
        };
        drop(fds);
        if let Some(tr) = job.trace() {
            tr.io(ws.id, i, t0);
        }
        match r {
            Ok(n) => job.finish(i, n),
            Err(e) => job.fail_item(t.item, e)?,
        }
    }
    Ok(())
}

fn host_write(ws: &mut WorkerState, job: &Job<'_>) -> Result<()> {
    while let Some((i, t)) = job.next() {
        if job.item_failed(t.item) {
            continue;
        }
        let t0 = job.t_now();
        let r = write_host_task(ws, job, &t);
        if let Some(tr) = job.trace() {
            tr.io(ws.id, i, t0);
        }
        match r {
            Ok(()) => job.finish(i, t.len),
            Err(e) => job.fail_item(t.item, e)?,
        }
    }
    Ok(())
}

/// Writes a task whose source is host memory (through a bounce buffer when O_DIRECT needs an
/// aligned address the caller's memory does not have).
fn write_host_task(ws: &mut WorkerState, job: &Job<'_>, t: &Task) -> Result<()> {
    let user = host_ptr(job, t)?.cast_const();
    if t.direct
        && job.open_fds(t)?.direct().is_some()
        && !(user as usize).is_multiple_of(DIRECT_ALIGN)
    {
        ws.ensure_slot(0, job.piece, false)?;
        let b = ws.slot_ptr(0);
        // SAFETY: user is readable for t.len bytes; b holds piece >= t.len bytes.
        unsafe { std::ptr::copy_nonoverlapping(user, b, t.len) };
        write_task(job, t, b)
    } else {
        write_task(job, t, user)
    }
}

/// Test hook: a device read whose drain fails (a context that can no longer synchronize), for
/// the job run next on the arming thread only (tests share the engine; a job's workers are
/// waited for on its calling thread).
#[cfg(test)]
pub(in crate::storage) mod fail_drain {
    use std::cell::Cell;

    use cudarc::driver::{sys, DriverError};

    use super::{segment::RunEnd, DstGate, Job, Mem, Op};
    use crate::error::Error;

    thread_local! {
        static ARMED: Cell<bool> = const { Cell::new(false) };
        static HIT: Cell<Option<(sys::CUdeviceptr, bool)>> = const { Cell::new(None) };
        /// Stream-query answers left for the settle after the failed drain.
        static QUERIES: Cell<usize> = const { Cell::new(0) };
    }

    /// How many stream queries after the failed drain answer `CUDA_ERROR_UNKNOWN`.
    const UNKNOWN_ANSWERS: usize = 3;

    /// The next device read this thread runs (segment ring or lanes) fails as if draining its
    /// copies had failed, with a CUDA error, after the real drain (so every copy did complete
    /// and nothing writes freed memory even where the caller frees its buffers), and the first
    /// [`UNKNOWN_ANSWERS`] stream queries of the settle that follows answer
    /// `CUDA_ERROR_UNKNOWN` (a job that owns its destinations gives up at the first: its
    /// copies stay undrained; one that waits gets the real answers next); the segment ring's
    /// engine leaks its ring then, as on a real failure.
    pub fn arm() {
        ARMED.set(true);
        HIT.set(None);
        QUERIES.set(0);
    }

    /// The next scripted stream-query answer of this thread's settle, if any is left.
    pub(in crate::storage::engine) fn next_query() -> Option<sys::CUresult> {
        let n = QUERIES.get();
        (n > 0).then(|| {
            QUERIES.set(n - 1);
            sys::CUresult::CUDA_ERROR_UNKNOWN
        })
    }

    /// The job the hook failed on this thread: its first destination's address (0: a deferred
    /// one never allocated) and whether it had issued a copy.
    pub fn hit() -> Option<(sys::CUdeviceptr, bool)> {
        HIT.get()
    }

    /// The error to fail `job` with when the hook is armed and `job` is a device read.
    pub(in crate::storage::engine) fn fire(job: &Job<'_>, issued: bool) -> Option<Error> {
        if job.op != Op::Read || job.ctx.is_none() || !ARMED.replace(false) {
            return None;
        }
        let dst = match job.bufs.first() {
            Some(Mem::Dev(p)) => *p,
            Some(Mem::Deferred(k)) => job
                .gates
                .get(*k as usize)
                .and_then(DstGate::get)
                .unwrap_or(0),
            _ => 0,
        };
        HIT.set(Some((dst, issued)));
        QUERIES.set(UNKNOWN_ANSWERS);
        Some(Error::cuda(
            "cuStreamSynchronize",
            DriverError(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED),
        ))
    }

    /// A segment run's end with its drain failed, when the hook fires.
    pub(in crate::storage::engine) fn apply(mut end: RunEnd, job: &Job<'_>) -> RunEnd {
        if let Some(e) = fire(job, end.copies > 0) {
            if end.drained.is_ok() {
                end.drained = Err(e);
            }
        }
        end
    }
}

/// Test hook: faults injected into the device read of one file (keyed by the path of the job's
/// first file: tests share the engine and run in parallel), and what the job did. Its
/// `arm`/`disarm` are the crate's tests' (`crate::storage::faults`: the checkpoint room's tests
/// fail storage jobs under a load); the rest is the engine's.
#[cfg(test)]
pub(crate) mod faults {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};

    use cudarc::driver::{sys, CudaContext, DriverError};

    use super::{Job, Mem};
    use crate::error::Error;

    /// What goes wrong in the job.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Fault {
        /// Lanes: the first worker to issue a copy of the job fails right after it with an
        /// Io-kind error, and its lane's drain then reports `CUDA_ERROR_UNKNOWN` (after the
        /// real drain: every copy did complete, so nothing writes freed memory even where the
        /// code under test frees it). Segments: the first worker to issue copies fails right
        /// after them with an Io-kind error, and the ring's drain reports `CUDA_ERROR_UNKNOWN`
        /// (after the real drain).
        DrainFails,
        /// Every worker of the job fails with a CUDA error before it issues any copy, after
        /// the destination exists: lanes, as if creating the worker's stream failed
        /// (`cuStreamCreate`: out of memory, in `Lane::new`); segments, as if page-locking a
        /// slot failed (`cuMemHostRegister`: out of memory) once the destination was
        /// allocated. Every copy is drained: there is none.
        FailsBeforeCopy,
        /// A small transfer's (`engine::small`) synchronize of its copy reports
        /// `CUDA_ERROR_UNKNOWN`, after the real one (the copy did complete).
        SmallSyncFails,
        /// Right before the first drain of the job (a lane's, or the segment ring's), an
        /// error is recorded in the cudarc context object that the drain binds through (the
        /// lane stream's, the ring's), as a failed free of a cudarc slice records one: an
        /// earlier error that says nothing about the copies being drained. Disarming clears
        /// what is left of it.
        StaleError,
    }

    /// What the job did.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Hit {
        /// The base address of the destination the fault hit.
        pub dst: sys::CUdeviceptr,
        /// The copy issued before the fault: (destination offset, file offset, bytes).
        pub copied: Option<(usize, u64, usize)>,
    }

    struct Armed {
        path: PathBuf,
        fault: Fault,
        hit: Option<Hit>,
        /// What the stream queries made after a failed drain answer, in turn, before the
        /// real answers.
        queries: Vec<sys::CUresult>,
        /// The context object [`Fault::StaleError`] recorded its error in.
        stale: Option<Arc<CudaContext>>,
    }

    static ARMED: Mutex<Vec<Armed>> = Mutex::new(Vec::new());

    fn armed() -> std::sync::MutexGuard<'static, Vec<Armed>> {
        ARMED.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arms `fault` for the device reads of the file at `path`; the queries of a settle after
    /// its failed drain answer `queries` first.
    pub fn arm(path: &Path, fault: Fault, queries: &[sys::CUresult]) {
        armed().push(Armed {
            path: path.to_path_buf(),
            fault,
            hit: None,
            queries: queries.to_vec(),
            stale: None,
        });
    }

    /// Disarms the fault for `path`: where it hit, and how many of its scripted query answers
    /// were never asked for. An error [`Fault::StaleError`] recorded that no call took is
    /// cleared.
    pub fn disarm(path: &Path) -> (Option<Hit>, usize) {
        let mut a = armed();
        match a.iter().position(|x| x.path == path) {
            Some(i) => {
                let x = a.swap_remove(i);
                if let Some(c) = &x.stale {
                    let _ = c.check_err();
                }
                (x.hit, x.queries.len())
            }
            None => (None, 0),
        }
    }

    /// [`Fault::StaleError`], right before a drain of `job`'s copies that binds through the
    /// context object `obj`: records `CUDA_ERROR_UNKNOWN` in it (once per job).
    pub(in crate::storage::engine) fn stale_before_drain(job: &Job<'_>, obj: &Arc<CudaContext>) {
        let Some(k) = key(job) else { return };
        if pending_at(k) != Some(Fault::StaleError) {
            return;
        }
        let dst = base(job, 0);
        if fire_at(k, Hit { dst, copied: None }) {
            obj.record_err::<()>(Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)));
            if let Some(x) = armed().iter_mut().find(|x| x.path == k) {
                x.stale = Some(obj.clone());
            }
        }
    }

    fn key<'j>(job: &'j Job<'_>) -> Option<&'j Path> {
        match job.files.first()? {
            super::JobFile::Open(f) => Some(f.path.as_path()),
            super::JobFile::Lazy(k) => job.window.map(|w| w.path(*k)),
        }
    }

    /// The fault armed for `job`'s file.
    pub(in crate::storage::engine) fn pending(job: &Job<'_>) -> Option<Fault> {
        pending_at(key(job)?)
    }

    /// The fault armed for the file at `path`.
    pub(in crate::storage::engine) fn pending_at(path: &Path) -> Option<Fault> {
        armed().iter().find(|x| x.path == path).map(|x| x.fault)
    }

    /// The next scripted stream-query answer for a settle of `job`'s copies, if any is left.
    pub(in crate::storage::engine) fn next_query(job: &Job<'_>) -> Option<sys::CUresult> {
        next_query_at(key(job)?)
    }

    /// The next scripted stream-query answer for a settle of a transfer of the file at
    /// `path`, if any is left.
    pub(in crate::storage::engine) fn next_query_at(path: &Path) -> Option<sys::CUresult> {
        let mut a = armed();
        let x = a.iter_mut().find(|x| x.path == path)?;
        (!x.queries.is_empty()).then(|| x.queries.remove(0))
    }

    /// The fault armed for `job`'s file that fired already.
    pub(in crate::storage::engine) fn fired(job: &Job<'_>) -> Option<Fault> {
        let k = key(job)?;
        armed()
            .iter()
            .find(|x| x.path == k && x.hit.is_some())
            .map(|x| x.fault)
    }

    /// Fires `job`'s fault once (false when another worker fired it), recording `hit`.
    pub(in crate::storage::engine) fn fire(job: &Job<'_>, hit: Hit) -> bool {
        key(job).is_some_and(|k| fire_at(k, hit))
    }

    /// Fires the fault of the file at `path` once (false when it fired), recording `hit`.
    pub(in crate::storage::engine) fn fire_at(path: &Path, hit: Hit) -> bool {
        let mut a = armed();
        match a.iter_mut().find(|x| x.path == path && x.hit.is_none()) {
            Some(x) => {
                x.hit = Some(hit);
                true
            }
            None => false,
        }
    }

    /// The base address of buffer `buf` of `job` (0 when not known yet).
    pub(in crate::storage::engine) fn base(job: &Job<'_>, buf: u32) -> sys::CUdeviceptr {
        match job.bufs.get(buf as usize) {
            Some(Mem::Dev(p)) => *p,
            Some(Mem::Deferred(_)) => job.dev_ptr(buf, 0).unwrap_or(0),
            _ => 0,
        }
    }

    /// The Io-kind error the fault fails a worker with.
    pub(in crate::storage::engine) fn io_error() -> Error {
        super::internal("test: an Io-kind worker error after a copy")
    }

    /// The CUDA error [`Fault::FailsBeforeCopy`] fails a worker with (`op` failed: out of
    /// memory).
    pub(in crate::storage::engine) fn oom(op: &'static str) -> Error {
        Error::cuda(op, DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))
    }

    /// The drain error the fault reports.
    pub(in crate::storage::engine) fn drain_error() -> Error {
        Error::cuda(
            "cuStreamSynchronize",
            DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN),
        )
    }
}

/// Test hook: the next lanes read into the device buffer at this address (0: none) panics
/// right after enqueuing its copy (keyed by the buffer: tests share the engine).
#[cfg(test)]
pub(in crate::storage) static PANIC_AFTER_COPY: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

fn dev_read(ws: &mut WorkerState, job: &Job<'_>, ctx: &Arc<CudaContext>) -> Result<()> {
    let w = ws.id;
    #[cfg(test)]
    if faults::pending(job) == Some(faults::Fault::FailsBeforeCopy) {
        let dst = faults::base(job, 0);
        faults::fire(job, faults::Hit { dst, copied: None });
        return Err(faults::oom("cuStreamCreate"));
    }
    let li = ws.lane(ctx)?;
    job.order(&ws.lanes[li].stream)?;
    ws.ensure_slot(0, job.piece, true)?;
    ws.ensure_slot(1, job.piece, true)?;
    let bufs = [ws.slot_ptr(0), ws.slot_ptr(1)];
    let lane = &mut ws.lanes[li];
    let mut s = 0usize;
    #[cfg(test)]
    let mut drain_fails = false;
    let r = (|| -> Result<()> {
        while let Some((i, t)) = job.next() {
            if job.item_failed(t.item) {
                job.skip_file(&t);
                continue;
            }
            let t0 = job.t_now();
            lane.wait_slot(s)?;
            if let Some(tr) = job.trace() {
                tr.waited(w, t0);
            }
            let t0 = job.t_now();
            // SAFETY: the bounce buffer holds piece >= the task's span bytes and is free of
            // copies (wait_slot); only this worker uses it.
            let got = job
                .file(&t)
                .and_then(|f| unsafe { job.read_span(&f, &t, bufs[s]) });
            if let Some(tr) = job.trace() {
                tr.io(w, i, t0);
            }
            let n = match got {
                Ok(n) => n,
                Err(e) => {
                    job.fail_item(t.item, e)?;
                    continue;
                }
            };
            if n > 0 {
                let head = if t.direct { direct_read_span(&t).2 } else { 0 };
                let dst = job.dev_ptr(t.buf, t.buf_off)?;
                // SAFETY: the source is n payload bytes of our registered bounce buffer,
                // untouched until the event recorded below completes; the destination lies
                // inside the task's range of the caller's device buffer (Job::batch contract);
                // ctx is current (lane()).
                unsafe {
                    crate::cuda::result::mem::memcpy_htod_async(
                        dst,
                        bufs[s].add(head),
                        n,
                        lane.stream.cu_stream(),
                    )
                }?;
                lane.record_slot(s)?;
                #[cfg(test)]
                // Only the job into the test's own buffer (its base address): other tests'
                // jobs on the shared engine run on.
                if PANIC_AFTER_COPY
                    .compare_exchange(
                        dst - t.buf_off as u64,
                        0,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
                {
                    panic!("test: panic with a copy in flight");
                }
                #[cfg(test)]
                if faults::pending(job) == Some(faults::Fault::DrainFails) {
                    let hit = faults::Hit {
                        dst: dst - t.buf_off as u64,
                        copied: Some((t.buf_off, t.file_off, n)),
                    };
                    if faults::fire(job, hit) {
                        drain_fails = true;
                        return Err(faults::io_error());
                    }
                }
            }
            job.finish(i, n);
            s ^= 1;
        }
        Ok(())
    })();
    #[cfg(test)]
    faults::stale_before_drain(job, lane.stream.context());
    let d = lane.drain();
    #[cfg(test)]
    let d = match d {
        Ok(()) if drain_fails => Err(faults::drain_error()),
        d => d,
    };
    // A failed drain fails the job whatever `r` is (its error wins: Job::fail_drain), after
    // the lane's copies were settled.
    // SAFETY: the lane's stream is alive (the lane owns it) in its live context.
    job.drained(d, |p| lane.settle(p, |c, st| unsafe { query(job, c, st) }));
    r
}

/// `cuStreamQuery` of `stream` in `ctx` for a settle of `job`'s copies (in tests, the answers
/// a fault armed for the job scripts come first).
///
/// # Safety
/// `stream` must be a live stream of the live context `ctx`.
unsafe fn query(job: &Job<'_>, ctx: sys::CUcontext, stream: sys::CUstream) -> sys::CUresult {
    #[cfg(test)]
    if let Some(r) = faults::next_query(job).or_else(fail_drain::next_query) {
        return r;
    }
    #[cfg(not(test))]
    let _ = job;
    // SAFETY: the caller's contract.
    unsafe { worker::query(ctx, stream) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::DevicePtrMut;

    use crate::storage::testkit::{gpu, random_file};

    /// Issue 9 item 7, on the device: a worker that panics right after enqueuing a 32 MiB
    /// host→device copy out of its pinned bounce buffer must drain that copy before its state
    /// (bounce buffers, stream) can go; the job fails with a typed error and the engine keeps
    /// working.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_engine_panic_mid_copy_drains_before_the_buffers_go() {
        let ctx = gpu();
        let len = 64 << 20;
        let (p, data) = random_file("panic.bin", len, 7);
        let fds = Fds::open_with(
            &p,
            io::OpenMode {
                write: false,
                create: false,
                truncate: false,
            },
            true,
        )
        .unwrap();
        let stream = ctx.new_stream().unwrap();
        let mut dev = stream.alloc_zeros::<u8>(len).unwrap();
        let piece = 32 << 20;
        let eng = engine(Some(0), false).unwrap();
        let busy_before = worker::lanes_dropped_busy();
        for inject in [true, false] {
            let (dptr, _g) = dev.device_ptr_mut(&stream);
            stream.synchronize().unwrap();
            let tasks = plan::plan(0, len, piece, plan::Dir::Read, false);
            // SAFETY: dptr..dptr+len is `dev`, held for the call; tasks lie within [0, len).
            let job = unsafe {
                Job::new(
                    &fds,
                    tasks,
                    piece,
                    Target::DevRead {
                        ctx: ctx.clone(),
                        dptr,
                    },
                )
            };
            PANIC_AFTER_COPY.store(if inject { dptr } else { 0 }, Ordering::SeqCst);
            let r = eng.run(job, 1);
            if inject {
                assert!(r.is_err(), "a panicking job reported success");
                assert_eq!(
                    worker::lanes_dropped_busy(),
                    busy_before,
                    "a worker's stream and bounce buffers were dropped with a copy in flight"
                );
            } else {
                assert_eq!(r.unwrap().single().unwrap().0, len);
            }
        }
        let back = stream.clone_dtoh(&dev).unwrap();
        assert!(
            back == data,
            "the read after the panic differs from the file"
        );
        std::fs::remove_file(&p).unwrap();
    }

    /// Review (drain, finding 1): the error of a drain whose copies may still run, or whose
    /// context is dead, wins over every other error of the job, before or after it (the first
    /// such drain's stays), and a drain whose copies may still run leaves the job undrained; a
    /// job waits ([`Patience::Wait`]) unless its caller owns its destinations. Review of the
    /// branch (helper-32, finding 5): a drain that failed but whose copies were then found
    /// complete replaces nothing: the job's earlier (or later) error stays, and so do item
    /// errors; only a job that nothing else failed fails with it. Before that fix a complete
    /// drain's error replaced the Io one and the item's.
    #[test]
    fn a_failed_drain_wins_over_other_errors_unless_its_copies_completed() {
        use cudarc::driver::DriverError;
        use sys::CUresult as R;
        let io = || internal("test: an Io-kind error");
        let cuda = |r| Error::cuda("cuStreamSynchronize", DriverError(r));
        let is_code =
            |e: &Error, r| matches!(e, Error::Cuda { source: DriverError(c), .. } if *c == r);
        for (owning, settled, drained) in [
            (false, Settled::Complete, true),
            (false, Settled::Dead(R::CUDA_ERROR_LAUNCH_FAILED), true),
            (true, Settled::Pending(R::CUDA_ERROR_UNKNOWN), false),
            (true, Settled::Complete, true),
        ] {
            // SAFETY: (test) a job without tasks: it touches no memory.
            let mut job = unsafe { Job::batch(vec![], vec![], 1, vec![], 4096, Op::Read, None) };
            if owning {
                job = job.owning_destinations();
            }
            let want = if owning {
                Patience::UntilUnknown
            } else {
                Patience::Wait
            };
            job.fail(io());
            let s = job.drained(Err(cuda(R::CUDA_ERROR_UNKNOWN)), |p| {
                assert_eq!(p, want);
                settled
            });
            assert_eq!(s, settled);
            job.drained(Err(cuda(R::CUDA_ERROR_INVALID_CONTEXT)), |_| {
                Settled::Complete
            });
            job.fail(io());
            let s = job.drained(Ok(()), |_| panic!("no settle after a drain that succeeded"));
            assert_eq!(s, Settled::Complete);
            let f = job.outcome(0).expect_err("the job failed");
            if settled == Settled::Complete {
                assert!(
                    matches!(f.error, Error::Io { .. }),
                    "{settled:?}: the earlier Io error, not {}",
                    f.error
                );
            } else {
                assert!(
                    is_code(&f.error, R::CUDA_ERROR_UNKNOWN),
                    "{settled:?}: the first drain's error, not {}",
                    f.error
                );
            }
            assert_eq!(f.drained, drained, "{settled:?}");
        }
        // An error without a drain's: no copy in flight.
        // SAFETY: (test) a job without tasks: it touches no memory.
        let job = unsafe { Job::batch(vec![], vec![], 1, vec![], 4096, Op::Read, None) };
        job.fail(io());
        let f = job.outcome(0).expect_err("the job failed");
        assert!(f.drained && matches!(f.error, Error::Io { .. }));
        // A complete drain's error after an item's error: the item's stays, the job runs on.
        // SAFETY: (test) a job without tasks: it touches no memory.
        let job = unsafe { Job::batch(vec![], vec![], 2, vec![], 4096, Op::Read, None) };
        job.fail_item(1, io()).unwrap();
        job.drained(Err(cuda(R::CUDA_ERROR_UNKNOWN)), |_| Settled::Complete);
        assert!(!job.aborted(), "a complete drain stops no other worker");
        let out = job
            .outcome(0)
            .map_err(|f| f.error)
            .expect("the items' outcome");
        assert!(out.items[0].error.is_none());
        assert!(matches!(out.items[1].error, Some(Error::Io { .. })));
        // A complete drain's error in a job nothing else failed: the job fails with it.
        for owning in [false, true] {
            // SAFETY: (test) a job without tasks: it touches no memory.
            let mut job = unsafe { Job::batch(vec![], vec![], 1, vec![], 4096, Op::Read, None) };
            if owning {
                job = job.owning_destinations();
            }
            job.drained(Err(cuda(R::CUDA_ERROR_UNKNOWN)), |_| Settled::Complete);
            let f = job.outcome(0).expect_err("a drain failed");
            assert!(f.drained && is_code(&f.error, R::CUDA_ERROR_UNKNOWN));
        }
    }

    /// Review (docs of finding 5): `for_each` reports a panic the same way whichever thread
    /// took the item: `false`, never an unwind out of it; every other item is still done once.
    #[test]
    fn for_each_reports_a_panic_on_the_caller_like_one_on_a_worker() {
        let eng = engine(None, false).unwrap();
        let me = std::thread::current().id();
        for on_caller in [true, false] {
            let n = 400;
            let done: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let fired = AtomicBool::new(false);
            let r = catch_unwind(AssertUnwindSafe(|| {
                eng.for_each(n, 4, &|i| {
                    std::thread::sleep(Duration::from_micros(200));
                    let here = std::thread::current().id() == me;
                    if here == on_caller && !fired.swap(true, Ordering::SeqCst) {
                        panic!("test: item {i} panics");
                    }
                    done[i].fetch_add(1, Ordering::SeqCst);
                })
            }));
            assert_eq!(
                r.ok(),
                Some(false),
                "on_caller {on_caller}: not a plain `false`"
            );
            assert!(fired.load(Ordering::SeqCst));
            let counts: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
            assert_eq!(
                counts.iter().filter(|&&c| c == 0).count(),
                1,
                "on_caller {on_caller}"
            );
            assert!(counts.iter().all(|&c| c <= 1), "an item ran twice");
        }
    }

    /// Issue 9 (smaller findings): reads with two different segment shapes, in turn, must not
    /// rebuild (and re-pin) the engine's ring every time: it grows once to fit both.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_engine_ring_is_not_rebuilt_for_alternating_shapes() {
        let ctx = gpu();
        let len = 48 << 20;
        let (p, data) = random_file("shapes.bin", len, 8);
        let fds = Fds::open(
            &p,
            io::OpenMode {
                write: false,
                create: false,
                truncate: false,
            },
        )
        .unwrap();
        let stream = ctx.new_stream().unwrap();
        let mut dev = stream.alloc_zeros::<u8>(len).unwrap();
        let eng = engine(Some(0), false).unwrap();
        let piece = 2 << 20;
        let shapes = [
            SegParams {
                segment_size: 16 << 20,
                segments: 4,
                streams: 1,
            },
            SegParams {
                segment_size: 32 << 20,
                segments: 2,
                streams: 2,
            },
        ];
        let before = eng.rings_built.load(Ordering::SeqCst);
        for round in 0..6 {
            let (dptr, _g) = dev.device_ptr_mut(&stream);
            stream.synchronize().unwrap();
            let tasks = plan::plan(0, len, piece, plan::Dir::Read, false);
            // SAFETY: dptr..dptr+len is `dev`, held for the call; tasks lie within [0, len).
            let job = unsafe {
                Job::new(
                    &fds,
                    tasks,
                    piece,
                    Target::DevRead {
                        ctx: ctx.clone(),
                        dptr,
                    },
                )
            }
            .with_segments(shapes[round % 2]);
            assert_eq!(eng.run(job, 8).unwrap().single().unwrap().0, len);
        }
        let built = eng.rings_built.load(Ordering::SeqCst) - before;
        assert!(
            built <= 2,
            "rings were built {built} times for 6 alternating jobs"
        );
        assert!(stream.clone_dtoh(&dev).unwrap() == data);
        std::fs::remove_file(&p).unwrap();
    }
}

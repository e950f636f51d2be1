//! gpudirect's parallel POSIX engine: file ↔ host or device memory through a persistent pool
//! of workers, each with two pinned bounce buffers and its own CUDA stream, so that the file
//! IO of one piece overlaps the DMA of the previous one.
//!
//! - **Planning** ([`plan`]): the range is cut at multiples of the piece size
//!   (`min(task size, bounce size)`) in file-offset space, so every piece's aligned span fits a
//!   bounce buffer; workers pull pieces from a shared counter (load balancing).
//! - **Reads to the GPU**: `pread` into bounce buffer A, `cuMemcpyHtoDAsync` on the worker's
//!   stream, event on A; next piece into B while A's copy runs; wait for A's event only
//!   before reusing it.
//! - **Writes from the GPU**: `cuMemcpyDtoHAsync` of piece k+1 is enqueued before `pwrite` of
//!   piece k.
//! - **O_DIRECT**: reads over-read the aligned span into the aligned bounce buffer; writes
//!   send unaligned heads and tails through the page cache. EINVAL from an O_DIRECT call
//!   switches the file to buffered IO for good.
//! - **Placement**: workers of a device's pool are pinned to the CPUs of the GPU's NUMA node
//!   and allocate (first touch) their bounce buffers there.
//! - **Segments** ([`segment`], the default for reads to the GPU): workers `pread` into
//!   disjoint slices of a ring of large pinned segments and one copy per full segment is
//!   issued on a dedicated copy stream: few large DMA transfers instead of many small ones.
//! - Every stream is synchronized before a job returns: no copy outlives the call.

pub(crate) mod bounce;
pub(crate) mod io;
pub(crate) mod numa;
pub(crate) mod plan;
pub(crate) mod pool;
pub(crate) mod segment;
pub(crate) mod worker;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};
use crate::storage::config::DIRECT_ALIGN;
use io::Fds;
use plan::{direct_read_span, Task};
use pool::Pool;
use worker::WorkerState;

/// Where the bytes of a job go to or come from.
pub(crate) enum Target {
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

/// One transfer in flight: the plan, the target and the results per task.
pub(crate) struct Job<'a> {
    fds: &'a Fds,
    tasks: Vec<Task>,
    piece: usize,
    target: Target,
    next: AtomicUsize,
    abort: AtomicBool,
    error: Mutex<Option<Error>>,
    done: Vec<AtomicUsize>,
    used_direct: AtomicBool,
    seg: Option<SegParams>,
}

/// The shape of a segment pipeline (see [`segment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegParams {
    /// Bytes per segment (rounded down to a multiple of the piece, at least one piece).
    pub segment_size: usize,
    /// Segments in the ring (at least 2).
    pub segments: usize,
    /// Copy streams.
    pub streams: usize,
}

// SAFETY: the raw pointers in `target` address the caller's buffer, which outlives the job
// (the caller blocks in `Engine::run`); tasks cover disjoint ranges and each task is taken by
// exactly one worker (atomic counter), so no two threads touch the same bytes.
unsafe impl Sync for Job<'_> {}

impl<'a> Job<'a> {
    /// A job over `tasks`; `piece` is the bounce-buffer size the plan was made for.
    ///
    /// # Safety
    /// The pointers in `target` must be valid (for writes for `HostRead`, reads for
    /// `HostWrite`, device memory of `ctx` for the device targets) for every task's
    /// `[buf_off, buf_off + len)`, until [`Engine::run`] returns.
    pub unsafe fn new(fds: &'a Fds, tasks: Vec<Task>, piece: usize, target: Target) -> Self {
        let done = tasks.iter().map(|_| AtomicUsize::new(0)).collect();
        Job {
            fds,
            tasks,
            piece,
            target,
            next: AtomicUsize::new(0),
            abort: AtomicBool::new(false),
            error: Mutex::new(None),
            done,
            used_direct: AtomicBool::new(false),
            seg: None,
        }
    }

    /// Runs a device read through the segment pipeline (ignored for other targets).
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
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.tasks.get(i).map(|t| (i, *t))
    }

    fn fail(&self, e: Error) {
        self.abort.store(true, Ordering::Relaxed);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
    }

    /// The outcome: bytes moved as a contiguous prefix of the range (a task that came up short
    /// ends it: end of file), and whether any byte went through O_DIRECT.
    fn outcome(self) -> Result<(usize, bool)> {
        if let Some(e) = self.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        let mut total = 0usize;
        for (t, d) in self.tasks.iter().zip(&self.done) {
            let d = d.load(Ordering::Relaxed);
            total += d;
            if d < t.len {
                break;
            }
        }
        Ok((total, self.used_direct.load(Ordering::Relaxed)))
    }
}

/// A pool of workers for one device (or for host memory only).
pub(crate) struct Engine {
    pool: Pool,
    inline: Mutex<WorkerState>,
    seg: Mutex<Option<segment::SegRes>>,
}

#[derive(Clone, PartialEq, Eq)]
struct Key {
    device: Option<usize>,
    threads: usize,
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
/// (measured on 2×H200, 32 cores, 4 GiB page-cached file into GPU 0: 8 workers 36.8 GB/s,
/// 16 workers 53.7, 24 workers 53.2, 32 workers 52.8, against a 55.4 GB/s pinned H2D limit;
/// BENCHMARKS.md). 4 keeps a small machine's disk queue fed.
pub(crate) fn default_threads(device: Option<usize>, numa_pin: bool) -> usize {
    let mut n = device_cpus(device, numa_pin).len();
    if n == 0 {
        n = numa::allowed_cpus().len();
    }
    n.clamp(4, 16)
}

/// Workers for jobs that wait on the disk (O_DIRECT) when the thread count is not set: at
/// least this many, because for them threads are queue depth, not CPU.
pub(crate) const MIN_DIRECT_THREADS: usize = 32;

/// The process-wide engine for `device` (`None`: host memory only) with `threads` workers;
/// created on first use and kept for the life of the process.
pub(crate) fn engine(
    device: Option<usize>,
    threads: Option<usize>,
    numa_pin: bool,
) -> Result<Arc<Engine>> {
    let threads = threads
        .unwrap_or_else(|| default_threads(device, numa_pin))
        .max(1);
    let key = Key {
        device,
        threads,
        numa_pin,
    };
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, e)) = reg.iter().find(|(k, _)| *k == key) {
        return Ok(e.clone());
    }
    let cpus = device_cpus(device, numa_pin);
    let name = match device {
        Some(d) => format!("gpudirect-io{d}"),
        None => "gpudirect-io".to_string(),
    };
    let pool = Pool::new(threads, &name, move |_| {
        if !cpus.is_empty() && !numa::pin_current_thread(&cpus) {
            tracing::debug!("could not pin an IO worker to the GPU's NUMA node");
        }
    })
    .map_err(|e| Error::io("spawn IO worker", None, e))?;
    let e = Arc::new(Engine {
        pool,
        inline: Mutex::new(WorkerState::new(usize::MAX)),
        seg: Mutex::new(None),
    });
    reg.push((key, e.clone()));
    Ok(e)
}

impl Engine {
    /// Worker threads in this engine.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Runs `job` to completion: `(bytes, used O_DIRECT)`. A one-task job runs on the calling
    /// thread; larger ones on every worker.
    pub fn run(&self, job: Job<'_>) -> Result<(usize, bool)> {
        if job.tasks.is_empty() {
            return Ok((0, false));
        }
        if let (Some(p), Target::DevRead { ctx, dptr }) = (job.seg, &job.target) {
            if job.tasks.len() > 1 {
                let (ctx, dptr) = (ctx.clone(), *dptr);
                return self.run_segments(job, &ctx, dptr, p);
            }
        }
        if job.tasks.len() == 1 {
            let mut ws = self.inline.lock().unwrap_or_else(|p| p.into_inner());
            work(&mut ws, &job);
        } else if !self.pool.run(&|ws: &mut WorkerState| work(ws, &job)) {
            job.fail(Error::Io {
                op: "IO worker",
                path: Some(job.fds.path.clone()),
                source: std::io::Error::other(
                    "an IO worker panicked (a bug in gpudirect: please report it)",
                ),
            });
        }
        job.outcome()
    }
}

impl Engine {
    /// Sets up (or reuses) this engine's segment ring for `ctx`, with no job running.
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
            // The old ring's copies were drained when its last job ended.
            *g = None;
            ctx.bind_to_thread()
                .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
            *g = Some(segment::SegRes::new(ctx, seg_bytes, p.segments, p.streams)?);
        }
        Ok(g.as_ref().expect("set above"))
    }

    /// Allocates the segment ring for `ctx` now (no IO), so a first transfer does not pay it.
    pub fn prepare_segments(
        &self,
        ctx: &Arc<CudaContext>,
        piece: usize,
        p: SegParams,
    ) -> Result<()> {
        let seg_bytes = segment::tasks_per_segment(p.segment_size, piece) * piece;
        let mut g = self.seg.lock().unwrap_or_else(|p| p.into_inner());
        self.seg_res(&mut g, ctx, seg_bytes, p).map(|_| ())
    }

    /// Binds `ctx` on every worker (so their first job does not pay it).
    pub fn prepare_workers(&self, ctx: &Arc<CudaContext>) {
        self.pool.run(&|_ws: &mut WorkerState| {
            let _ = ctx.bind_to_thread();
        });
    }

    fn run_segments(
        &self,
        job: Job<'_>,
        ctx: &Arc<CudaContext>,
        dptr: sys::CUdeviceptr,
        p: SegParams,
    ) -> Result<(usize, bool)> {
        let per = segment::tasks_per_segment(p.segment_size, job.piece);
        let seg_bytes = per * job.piece;
        let mut g = self.seg.lock().unwrap_or_else(|p| p.into_inner());
        let res = self.seg_res(&mut g, ctx, seg_bytes, p)?;
        let sj = segment::SegJob::new(res, job.tasks.len(), per, dptr);
        let ok = self.pool.run(&|_ws: &mut WorkerState| {
            if let Err(e) = sj.work(&job) {
                job.fail(e);
            }
        });
        if !ok {
            job.fail(Error::Io {
                op: "IO worker",
                path: Some(job.fds.path.clone()),
                source: std::io::Error::other(
                    "an IO worker panicked (a bug in gpudirect: please report it)",
                ),
            });
        }
        // Every copy completes before the caller's buffer is released.
        if let Err(e) = res.drain() {
            job.fail(e);
        }
        job.outcome()
    }
}

fn work(ws: &mut WorkerState, job: &Job<'_>) {
    let r = match &job.target {
        Target::HostRead(p) => host_read(ws, job, *p),
        Target::HostWrite(p) => host_write(ws, job, *p),
        Target::DevRead { ctx, dptr } => dev_read(ws, job, ctx, *dptr),
        Target::DevWrite { ctx, dptr } => dev_write(ws, job, ctx, *dptr),
    };
    if let Err(e) = r {
        job.fail(e);
    }
}

fn is_einval(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Reads task `t` into `buf` (aligned, at least `piece` bytes): returns `(head, n)`, the
/// payload being `buf[head..head + n]` (`n < t.len` only at end of file).
fn read_task(job: &Job<'_>, t: &Task, buf: *mut u8) -> Result<(usize, usize)> {
    let fds = job.fds;
    if t.direct {
        if let Some(d) = fds.direct() {
            let (io_off, io_len, head) = direct_read_span(t);
            debug_assert!(io_len <= job.piece);
            // SAFETY: buf holds at least `piece` >= io_len bytes (bounce buffer).
            match unsafe { io::pread_full(d, buf, io_len, io_off) } {
                Ok(got) => {
                    job.used_direct.store(true, Ordering::Relaxed);
                    return Ok((head, got.saturating_sub(head).min(t.len)));
                }
                Err(e) if is_einval(&e) => {
                    tracing::debug!(path = %fds.path.display(), "O_DIRECT read refused (EINVAL); using buffered IO");
                    fds.direct_broken.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(fds.err("pread", e)),
            }
        }
    }
    // SAFETY: buf holds at least piece >= t.len bytes.
    let n = unsafe { io::pread_full(&fds.buffered, buf, t.len, t.file_off) }
        .map_err(|e| fds.err("pread", e))?;
    Ok((0, n))
}

/// Writes task `t` from `buf` (`t.len` bytes; aligned when `t.direct`).
fn write_task(job: &Job<'_>, t: &Task, buf: *const u8) -> Result<()> {
    let fds = job.fds;
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

fn host_read(ws: &mut WorkerState, job: &Job<'_>, base: *mut u8) -> Result<()> {
    while let Some((i, t)) = job.next() {
        // SAFETY: buf_off + len lies inside the caller's buffer (Job::new contract).
        let user = unsafe { base.add(t.buf_off) };
        let straight = !t.direct
            || job.fds.direct().is_none()
            || (plan::is_aligned(t.file_off)
                && t.len % DIRECT_ALIGN == 0
                && (user as usize).is_multiple_of(DIRECT_ALIGN));
        let n = if straight && !t.direct {
            // SAFETY: user is writable for t.len bytes.
            unsafe { io::pread_full(&job.fds.buffered, user, t.len, t.file_off) }
                .map_err(|e| job.fds.err("pread", e))?
        } else if straight {
            // Aligned: O_DIRECT straight into the caller's memory (read_task's span == task).
            read_task(job, &t, user)?.1
        } else {
            ws.ensure_slot(0, job.piece, false)?;
            let b = ws.slot_ptr(0);
            let (head, n) = read_task(job, &t, b)?;
            // SAFETY: b[head..head+n] was just filled; user has room for t.len >= n bytes;
            // the bounce buffer and the caller's memory do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(b.add(head), user, n) };
            n
        };
        job.done[i].store(n, Ordering::Relaxed);
    }
    Ok(())
}

fn host_write(ws: &mut WorkerState, job: &Job<'_>, base: *const u8) -> Result<()> {
    while let Some((i, t)) = job.next() {
        // SAFETY: inside the caller's buffer (Job::new contract).
        let user = unsafe { base.add(t.buf_off) };
        if t.direct && job.fds.direct().is_some() && !(user as usize).is_multiple_of(DIRECT_ALIGN) {
            ws.ensure_slot(0, job.piece, false)?;
            let b = ws.slot_ptr(0);
            // SAFETY: user is readable for t.len bytes; b holds piece >= t.len bytes.
            unsafe { std::ptr::copy_nonoverlapping(user, b, t.len) };
            write_task(job, &t, b)?;
        } else {
            write_task(job, &t, user)?;
        }
        job.done[i].store(t.len, Ordering::Relaxed);
    }
    Ok(())
}

fn dev_read(
    ws: &mut WorkerState,
    job: &Job<'_>,
    ctx: &Arc<CudaContext>,
    dptr: sys::CUdeviceptr,
) -> Result<()> {
    let li = ws.lane(ctx)?;
    ws.ensure_slot(0, job.piece, true)?;
    ws.ensure_slot(1, job.piece, true)?;
    let bufs = [ws.slot_ptr(0), ws.slot_ptr(1)];
    let lane = &mut ws.lanes[li];
    let mut s = 0usize;
    let r = (|| -> Result<()> {
        while let Some((i, t)) = job.next() {
            lane.wait_slot(s)?;
            let (head, n) = read_task(job, &t, bufs[s])?;
            if n > 0 {
                // SAFETY: the source is n bytes of our registered bounce buffer, untouched
                // until the event recorded below completes; the destination lies inside the
                // caller's device buffer (Job::new contract); ctx is current (lane()).
                unsafe {
                    crate::cuda::result::mem::memcpy_htod_async(
                        dptr + t.buf_off as u64,
                        bufs[s].add(head),
                        n,
                        lane.stream.cu_stream(),
                    )
                }?;
                lane.record_slot(s)?;
            }
            job.done[i].store(n, Ordering::Relaxed);
            s ^= 1;
        }
        Ok(())
    })();
    let d = lane.drain();
    r.and(d)
}

fn dev_write(
    ws: &mut WorkerState,
    job: &Job<'_>,
    ctx: &Arc<CudaContext>,
    dptr: sys::CUdeviceptr,
) -> Result<()> {
    let li = ws.lane(ctx)?;
    ws.ensure_slot(0, job.piece, true)?;
    ws.ensure_slot(1, job.piece, true)?;
    let bufs = [ws.slot_ptr(0), ws.slot_ptr(1)];
    let lane = &mut ws.lanes[li];
    let mut pending: Option<(usize, usize, Task)> = None;
    let mut s = 0usize;
    let r = (|| -> Result<()> {
        loop {
            let next = job.next();
            if let Some((_, t)) = &next {
                // SAFETY: the destination is our registered bounce buffer (piece >= t.len
                // bytes), not read until the event below completes; the source lies inside
                // the caller's device buffer (Job::new contract); ctx is current.
                unsafe {
                    crate::cuda::result::mem::memcpy_dtoh_async(
                        bufs[s],
                        dptr + t.buf_off as u64,
                        t.len,
                        lane.stream.cu_stream(),
                    )
                }?;
                lane.record_slot(s)?;
            }
            if let Some((ps, pi, pt)) = pending.take() {
                lane.wait_slot(ps)?;
                write_task(job, &pt, bufs[ps])?;
                job.done[pi].store(pt.len, Ordering::Relaxed);
            }
            match next {
                Some((i, t)) => {
                    pending = Some((s, i, t));
                    s ^= 1;
                }
                None => return Ok(()),
            }
        }
    })();
    let d = lane.drain();
    r.and(d)
}

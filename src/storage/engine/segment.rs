//! The segment pipeline for reads into device memory ([`Pipeline::Segments`]).
//!
//! **Layout** ([`layout`], pure): the job's tasks, in order, are packed into *segments* of
//! `seg_bytes`. Each task reserves a span of its segment for its IO: the aligned over-read span
//! for an O_DIRECT task (placed at an aligned offset), its payload for a buffered one. A task is
//! placed right after the previous task's payload when that keeps it legal (no overlap with an
//! earlier IO span, alignment), so payloads that are contiguous in the file (one big file) or
//! packed back to back (many small files) are contiguous in the segment too; otherwise it
//! starts at the next legal offset; a task that does not fit starts the next segment.
//!
//! **Copies** ([`copy_runs`], pure): when every task of segment `g` is read (in the ring's
//! first pass: each read prefix of it that is large enough, see "No warm-up tax"), one
//! `cuMemcpyHtoDAsync` is issued per maximal run of payload that is contiguous both in the
//! segment (or the part) and in one destination buffer: a single big file gets one copy per
//! segment, 10k small files packed into one buffer get one copy per segment, a checkpoint
//! whose device layout pads tensors gets one copy per tensor piece (copies are also cut where
//! the slot's registrations start). Only bytes a task read are copied, each
//! into its own task's destination range: no destination byte outside the items is written.
//!
//! **Ring**: a ring of `K` slots; the first pass's segments `g < K` are staged in slot `g`,
//! and each later segment claims a slot, in segment order, when a worker takes its first task:
//! among the slots whose segment's copies were issued, the one holding the oldest segment
//! ([`SegJob::claim`]). Workers pull tasks in order from the job's counter and read each into
//! its span of its segment's slot; the worker that finishes the last task of a segment issues
//! its copies (the rest of them, in the first pass) on copy stream `g % streams` and records
//! the slot's event. A worker that fills a claimed slot first waits until the copies of the
//! segment staged there before completed (the slot's event). So a slow read (a preempted
//! worker, a page-cache miss) holds up its own slot only: the other slots keep taking later
//! segments, where a fixed slot `g % K` would stop the ring at segment `g + K` (on a noisy
//! H200 instance, second calls of a 4 GiB read went from 28 to 38 GB/s with this alone, to 50
//! with it and 6 slots of 16 MiB; CONTRIBUTING.md). No deadlock: every slot a claim can wait
//! for is held by an earlier segment, whose tasks were all taken before any of `g`'s (tasks
//! are taken in order and segments are contiguous ranges of tasks) and are read by workers
//! that wait for no claim; once they are read, that segment's copies are issued and its slot
//! can be claimed. Errors abort the job; waiters poll the abort flag.
//!
//! **No warm-up tax**: the ring is one anonymous mapping (2 MiB aligned, transparent huge pages
//! advised) that nobody touches up front: the first reads into a slot fault its pages in, in
//! parallel, on the workers (which sit on the GPU's NUMA node). A slot is page-locked
//! (`cuMemHostRegister`, far cheaper than allocating pinned memory with `cuMemHostAlloc`) by
//! the workers that read the first segment staged there, in a few parts, as that segment's
//! reads come in: whenever a prefix of its tasks is read that holds at least an eighth of the
//! segment and at least as much as its earlier parts together, the worker that completed it
//! locks the slot that far (one more registration) and issues that part's copies; the last
//! part locks the slot as far as any of the job's segments staged there reads. The pages are
//! faulted in by the reads by then (locking untouched memory would fault it in on the
//! locking thread, one thread instead of all workers). So the first copy waits neither for the
//! slowest read of the first segment nor for a whole slot's locking, and the slots' lockings
//! overlap the first pass's reads instead of running one after another once each slot is
//! full. After the first pass every slot is locked for the job and a segment's copies go out
//! in one part, once it is all read. Page-lockings of a job never run at once (one lock per
//! job): the driver serializes them anyway, and concurrent ones only contend with the job's
//! reads and copies. Reading starts at once and no copy waits for the whole ring. A caller
//! with nothing better to do may lock the ring beforehand, with no job running
//! ([`Engine::prepare_segments`](super::Engine::prepare_segments) for `GpuFile::warm_up`,
//! [`Engine::prepare_segments_beside`](super::Engine::prepare_segments_beside) while a batch
//! checks its files); those lockings run on several workers at once
//! ([`SegRes::pin_first`]), as there is no job for them to slow down.
//!
//! **Ring size**: a larger ring is slower in steady state, so a job never grows the ring beyond
//! its configured slots, a deferred destination included.
//!
//! **Deferred destination**: when the job allocates its destination itself
//! ([`Engine::run_deferred`](super::Engine::run_deferred), `read_to_gpu`), the calling thread
//! allocates it at once while the workers start and read; a segment's copies wait for the
//! address ([`DstGate`](super::DstGate)) *before* its slot is page-locked, so no
//! `cuMemHostRegister` contends with the allocation for the driver (which slows the
//! allocation down). A failed allocation fails the job before any copy. A job may have one
//! deferred destination per buffer ([`Engine::run_deferred_each`](super::Engine::run_deferred_each):
//! a checkpoint's tensors, each in its own allocation): the calling thread allocates them in
//! the order the tasks use them, and a segment's copies wait only for the buffers they write,
//! so the first copies wait for the first allocations only.
//!
//! The measurements behind these choices: CONTRIBUTING.md, "Costs behind the storage engine's
//! design".
//!
//! **Ordering rules** (checked on the host by `pipeline_tests`, on a ring whose copies run
//! late): a copy is enqueued only after its slot is page-locked as far as it reads and after
//! its destination exists; no slot is page-locked while a job's one deferred destination is
//! being allocated (with several, only after the ones the copies it serves write exist), nor
//! two at once, and a locking only extends the slot's registrations; a slot is read into
//! again only after the copies out of it completed;
//! a panic on any thread fails the job, so no worker waits for what the panicking one would
//! have done.
//!
//! [`Pipeline::Segments`]: crate::storage::config::Pipeline::Segments

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::plan::{direct_read_span, Task};
use super::trace::{self, CopyTrace};
use super::{io, Job};
use crate::cuda::result::mem;
use crate::cuda::settle::{settle, Patience, Settled};
use crate::error::{Error, Result};
use crate::storage::config::DIRECT_ALIGN;

/// Tasks per segment for a segment of about `segment_size` bytes and pieces of `piece`.
pub(in crate::storage) fn tasks_per_segment(segment_size: usize, piece: usize) -> usize {
    (segment_size / piece.max(1)).max(1)
}

/// Where one task's IO goes: its segment, the offset of its IO span in the segment, and where
/// its payload starts inside that span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct Place {
    pub seg: u32,
    pub io_off: usize,
    pub head: usize,
}

impl Place {
    /// Offset of the task's payload in its segment.
    pub fn payload(&self) -> usize {
        self.io_off + self.head
    }
}

/// The placement of every task of a job ([`layout`]).
#[derive(Debug, Clone, Default)]
pub(in crate::storage) struct Layout {
    /// Per task.
    pub place: Vec<Place>,
    /// Per segment: its tasks (consecutive, in order).
    pub segs: Vec<Range<usize>>,
    /// Per segment: the end of its furthest payload in its slot (what its copies read at most).
    pub ends: Vec<usize>,
}

impl Layout {
    /// Per slot of a ring of `slots`: the furthest payload end of every segment that may be
    /// staged there (what the slot must be page-locked for, once, for the whole job): segment
    /// `g` in slot `g` when the job has no more segments than slots; otherwise a segment past
    /// the first pass may land in any slot ([`SegJob::claim`]), so every slot needs the
    /// furthest end of all.
    pub fn slot_needs(&self, slots: usize) -> Vec<usize> {
        let slots = slots.max(1);
        if self.ends.len() > slots {
            let most = self.ends.iter().copied().max().unwrap_or(0);
            return vec![most; slots];
        }
        let mut need = vec![0usize; slots];
        need[..self.ends.len()].copy_from_slice(&self.ends);
        need
    }
}

/// `(IO length, payload head, alignment)` of task `t` in a segment.
fn io_shape(t: &Task) -> (usize, usize, usize) {
    if t.direct {
        let (_, io_len, head) = direct_read_span(t);
        (io_len, head, DIRECT_ALIGN)
    } else {
        (t.len, 0, 1)
    }
}

/// Packs `tasks` (in order) into segments of `seg_bytes` (see the module docs). Every task's
/// IO span must fit an empty segment (tasks come from [`plan_item`](super::plan::plan_item)
/// with a piece of at most `seg_bytes`).
pub(in crate::storage) fn layout(tasks: &[Task], seg_bytes: usize) -> Layout {
    let mut place = Vec::with_capacity(tasks.len());
    let mut segs = Vec::new();
    let mut ends = Vec::new();
    let mut end = 0usize;
    let (mut start, mut g) = (0usize, 0u32);
    // Payload end of the last task placed, and the end of the furthest IO span so far.
    let (mut c, mut io_end) = (0usize, 0usize);
    for (i, t) in tasks.iter().enumerate() {
        let (io_len, head, align) = io_shape(t);
        debug_assert!(
            io_len <= seg_bytes,
            "{t:?} does not fit a segment of {seg_bytes}"
        );
        let mut s = if head == 0 && c == io_end && c % align == 0 {
            c
        } else {
            io_end.div_ceil(align) * align
        };
        if s + io_len > seg_bytes && i > start {
            segs.push(start..i);
            ends.push(end);
            end = 0;
            start = i;
            g += 1;
            (io_end, s) = (0, 0);
        }
        place.push(Place {
            seg: g,
            io_off: s,
            head,
        });
        c = s + head + t.len;
        end = end.max(c);
        io_end = io_end.max(s + io_len);
    }
    if tasks.len() > start {
        segs.push(start..tasks.len());
        ends.push(end);
    }
    Layout { place, segs, ends }
}

/// One host→device copy out of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct Run {
    pub slot_off: usize,
    pub buf: u32,
    pub buf_off: usize,
    pub len: usize,
}

/// The copies for the tasks `range` of a segment, given the bytes each task read (`done`):
/// maximal runs contiguous in the segment and in one destination buffer; a task that came up
/// short ends its run (its bytes are copied, nothing after them joins).
pub(in crate::storage) fn copy_runs(
    tasks: &[Task],
    place: &[Place],
    range: Range<usize>,
    done: impl Fn(usize) -> usize,
) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut joinable = false;
    for i in range {
        let (t, d) = (&tasks[i], done(i).min(tasks[i].len));
        if d == 0 {
            joinable = false;
            continue;
        }
        let p = place[i].payload();
        match runs.last_mut() {
            Some(r)
                if joinable
                    && r.buf == t.buf
                    && r.buf_off + r.len == t.buf_off
                    && r.slot_off + r.len == p =>
            {
                r.len += d
            }
            _ => runs.push(Run {
                slot_off: p,
                buf: t.buf,
                buf_off: t.buf_off,
                len: d,
            }),
        }
        joinable = d == t.len;
    }
    runs
}

const HUGE_PAGE: usize = 2 << 20;

/// The ring's host memory: one anonymous mapping, 2 MiB aligned, huge pages advised, untouched
/// until the reads fault it in.
struct RingMem {
    map: *mut u8,
    map_len: usize,
    base: *mut u8,
}

impl RingMem {
    fn new(len: usize) -> Result<RingMem> {
        let map_len = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::io("mmap", None, std::io::Error::last_os_error()));
        }
        let map = p.cast::<u8>();
        let pad = (HUGE_PAGE - map as usize % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: pad < HUGE_PAGE, so base..base+len lies inside the mapping of len + HUGE_PAGE.
        let base = unsafe { map.add(pad) };
        // SAFETY: advice on our own mapping; failure only loses the hint.
        unsafe { libc::madvise(base.cast(), len, libc::MADV_HUGEPAGE) };
        Ok(RingMem { map, map_len, base })
    }
}

impl Drop for RingMem {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our mapping; SegRes::drop unregistered every slot first (or
        // leaked this value when it could not).
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

/// What the segment pipeline needs from its ring: slots of host memory, page-locking, copies on
/// streams and one completion marker per slot. [`SegRes`] is the CUDA ring; the tests run the
/// same pipeline ([`SegJob`], [`run`]) on a host-memory ring whose copies complete late, so the
/// ordering rules below are checked without a GPU:
/// - a slot's copies are enqueued only after the slot is page-locked as far as they read
///   ([`ensure_registered`](Ring::ensure_registered) before [`copy`](Ring::copy)) and after the
///   job's destination exists (a destination allocated while the job starts is waited for);
/// - a slot is read into again only after the copies out of it completed (its marker).
pub(in crate::storage) trait Ring: Sync {
    /// Slots in the ring.
    fn slots(&self) -> usize;
    /// Copy streams.
    fn streams(&self) -> usize;
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// The start of slot `r` (`r < slots()`).
    fn slot_ptr(&self, r: usize) -> *mut u8;
    /// Makes the ring's context current on the calling thread.
    fn bind(&self) -> Result<()>;
    /// Page-locks at least the first `need` bytes of slot `r`; returns the bytes locked by this
    /// call (0: they already were). One caller per slot at a time (the job's pin lock). A
    /// slot locked less far is extended by one more registration over the bytes past it: no
    /// copy reads those yet (the job issues a copy only once the slot is locked as far as it
    /// reads; earlier jobs' copies were drained), while copies out of the bytes locked before
    /// may be in flight. Workers may be reading into the slot meanwhile (the pages' contents
    /// are not touched).
    fn ensure_registered(&self, r: usize, need: usize) -> Result<usize>;
    /// Whether the first `end` bytes of slot `r` are page-locked.
    fn is_registered(&self, r: usize, end: usize) -> bool;
    /// Enqueues a copy of `len` bytes from `src` to device address `dst` on copy stream
    /// `stream`.
    ///
    /// # Safety
    /// `[src, src + len)` lies in a page-locked part of one slot and is not rewritten until the slot's next
    /// marker completed; `dst` is device memory of the ring's context writable for `len` bytes
    /// until then, touched by nothing else.
    unsafe fn copy(
        &self,
        dst: sys::CUdeviceptr,
        src: *const u8,
        len: usize,
        stream: usize,
    ) -> Result<()>;
    /// Makes copy stream `stream` wait for `events` (the work pending on the job's buffers)
    /// before anything enqueued on it later.
    fn wait_events(&self, stream: usize, events: &[CudaEvent]) -> Result<()>;
    /// Records slot `r`'s marker on `stream`, after the copies enqueued there so far.
    fn record(&self, r: usize, stream: usize) -> Result<()>;
    /// Blocks until slot `r`'s last recorded marker completed.
    fn sync_slot(&self, r: usize) -> Result<()>;
    /// Trace hook: segment `g`'s copies are enqueued on `stream` (a timing event, when traced).
    fn mark_done(&self, _g: usize, _stream: usize) -> Result<()> {
        Ok(())
    }
    /// Waits for every copy on every stream.
    fn drain(&self) -> Result<()>;
    /// Test hook: the cudarc context object [`drain`](Self::drain) binds through, if any.
    #[cfg(test)]
    fn context_object(&self) -> Option<&Arc<CudaContext>> {
        None
    }
    /// Test hook: how long the read of task `i` is held up before it starts (a slow read).
    #[cfg(test)]
    fn read_delay(&self, _i: usize) -> Duration {
        Duration::ZERO
    }
    /// Test hook: segment `g`'s copies are all issued and its slot's marker recorded.
    #[cfg(test)]
    fn issued_hook(&self, _g: usize) {}
}

/// Timing events of one traced job: a base event recorded when the job started and one per
/// segment recorded after its copies (`GPUDIRECT_TRACE=timing` only).
struct GpuTimes {
    base: CudaEvent,
    base_host: u64,
    done: Vec<Option<CudaEvent>>,
    spare: Vec<CudaEvent>,
}

/// Pinned segments, copy streams and slot events of one engine, reused across jobs that fit.
pub(in crate::storage) struct SegRes {
    ctx: Arc<CudaContext>,
    mem: RingMem,
    /// Bytes per slot (the slot stride).
    seg_bytes: usize,
    nseg: usize,
    streams: Vec<Arc<CudaStream>>,
    events: Vec<CudaEvent>,
    /// `registered[r]`: bytes of slot `r` page-locked from its start (0: none). Only ever
    /// extended (one more registration over bytes past it, which no copy reads before it
    /// exists), by one thread at a time: during a job under the job's one pin lock, before the
    /// copies that read the new bytes ([`SegJob::pin_to`]; copies out of the bytes locked
    /// before may be in flight); with no job running (the engine's ring lock held) by the one
    /// worker the slot counter handed `r` to ([`SegRes::pin_first`]).
    registered: Vec<AtomicUsize>,
    /// `regions[r]`: where each of slot `r`'s registrations starts (offsets in the slot,
    /// ascending; the last one ends at `registered[r]`). A slot locked further is locked in one
    /// more registration after the ones it has, never unregistered and locked again: an
    /// unregister waits for all the context's work, including other streams' kernels, and
    /// meanwhile other threads' `cuEventCreate` waits too (tests/storage_gpu_stall.rs).
    regions: Vec<Mutex<Vec<usize>>>,
    /// The running job's timing events, when it is traced.
    timing: Mutex<Option<GpuTimes>>,
    timing_on: AtomicBool,
}

// SAFETY: shared use only reads the mapping's address; the bytes behind it are written by one
// worker per task span (spans of one segment are disjoint, tasks are taken once) and read by
// the DMA only after the tasks whose payload it copies are done (a segment's last task, or in
// the first pass a read prefix of its tasks; the tasks still being read write other spans);
// a slot is rewritten only after its event completed (the ring protocol in the module docs);
// a slot's registration is only extended over bytes no copy reads yet, never replaced or
// removed while a job runs, by one thread at a time: in a job under the job's one pin lock
// (SegJob::pin_to); with no job running (the engine's ring lock held) by the one worker the
// slot counter handed it to (SegRes::pin_first). Streams and events are Send + Sync.
unsafe impl Sync for SegRes {}
// SAFETY: as above; the mapping is plain memory owned by this value.
unsafe impl Send for SegRes {}

impl SegRes {
    /// After a failed drain: what the copies on the ring's streams can still do, asked
    /// through `query(context, stream)` (`cuStreamQuery`; [`crate::cuda::settle::settle`]
    /// with `patience`).
    pub fn settle(
        &self,
        patience: Patience,
        mut query: impl FnMut(sys::CUcontext, sys::CUstream) -> sys::CUresult,
    ) -> Settled {
        let ctx = self.ctx.cu_ctx();
        settle(
            self.streams.len(),
            |i| query(ctx, self.streams[i].cu_stream()),
            patience,
            "the storage engine's segment ring",
        )
    }

    /// Maps `nseg` slots of `seg_bytes` (not touched, not pinned yet) and creates `nstreams`
    /// streams and one event per slot. The caller bound `ctx`.
    pub fn new(
        ctx: &Arc<CudaContext>,
        seg_bytes: usize,
        nseg: usize,
        nstreams: usize,
    ) -> Result<SegRes> {
        let len = seg_bytes.checked_mul(nseg).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{nseg} segments of {seg_bytes} bytes overflow the address space: use smaller segments"
            ))
        })?;
        let t0 = super::trace::now_us();
        let ms = |t: u64| (super::trace::now_us() - t) as f64 / 1e3;
        let mem = RingMem::new(len)?;
        let t1 = super::trace::now_us();
        let streams = (0..nstreams.max(1))
            .map(|_| crate::cuda::own_stream(ctx))
            .collect::<Result<Vec<_>>>()?;
        let t2 = super::trace::now_us();
        // Through gpudirect's own object, as the streams and the lanes' events are: cudarc's
        // `new_event` binds through the object it is called on (`bind_to_thread`), which takes
        // an error stored in the caller's object and fails the job with it.
        let own = crate::cuda::own_object(ctx);
        let events = (0..nseg)
            .map(|_| {
                own.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| Error::cuda("cuEventCreate", e))
            })
            .collect::<Result<Vec<_>>>()?;
        super::trace::mark(|| {
            format!(
                "ring of {nseg} x {} MiB built: memory {:.3} ms, {} streams {:.3} ms, events {:.3} ms",
                seg_bytes >> 20,
                (t1 - t0) as f64 / 1e3,
                streams.len(),
                (t2 - t1) as f64 / 1e3,
                ms(t2)
            )
        });
        Ok(SegRes {
            ctx: ctx.clone(),
            mem,
            seg_bytes,
            nseg,
            streams,
            events,
            registered: (0..nseg).map(|_| AtomicUsize::new(0)).collect(),
            regions: (0..nseg).map(|_| Mutex::new(Vec::new())).collect(),
            timing: Mutex::new(None),
            timing_on: AtomicBool::new(false),
        })
    }

    fn regions_of(&self, r: usize) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.regions[r].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when these resources can serve a job for `ctx` of this shape (the ring grows to
    /// the largest shape asked for, so jobs of different shapes do not rebuild it in turn).
    pub fn fits(
        &self,
        ctx: &Arc<CudaContext>,
        seg_bytes: usize,
        nseg: usize,
        nstreams: usize,
    ) -> bool {
        self.ctx.cu_ctx() == ctx.cu_ctx()
            && self.seg_bytes >= seg_bytes
            && self.nseg >= nseg
            && self.streams.len() >= nstreams.max(1)
    }

    /// The shape of a ring that serves both this one's jobs and `(seg_bytes, nseg, nstreams)`.
    pub fn grown(&self, seg_bytes: usize, nseg: usize, nstreams: usize) -> (usize, usize, usize) {
        (
            self.seg_bytes.max(seg_bytes),
            self.nseg.max(nseg),
            self.streams.len().max(nstreams),
        )
    }

    /// Host bytes this ring maps.
    pub fn bytes(&self) -> usize {
        self.seg_bytes * self.nseg
    }

    /// Trace: records a timing base event on the first copy stream and creates one timing event
    /// per segment of the next job (`segs`). The ring's streams are idle (no job runs).
    pub fn start_timing(&self, segs: usize) -> Result<()> {
        let own = crate::cuda::own_object(&self.ctx);
        let ev = || {
            own.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::cuda("cuEventCreate", e))
        };
        let base = ev()?;
        let spare = (0..segs).map(|_| ev()).collect::<Result<Vec<_>>>()?;
        base.record(&self.streams[0])
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        let base_host = super::trace::now_us();
        *self.timing.lock().unwrap_or_else(|p| p.into_inner()) = Some(GpuTimes {
            base,
            base_host,
            done: (0..segs).map(|_| None).collect(),
            spare,
        });
        self.timing_on.store(true, Ordering::Release);
        Ok(())
    }

    /// Trace: when the GPU finished each segment's copies (µs since the trace epoch), after the
    /// job was drained.
    pub fn finish_timing(&self) -> Vec<Option<u64>> {
        self.timing_on.store(false, Ordering::Release);
        let Some(t) = self.timing.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Vec::new();
        };
        t.done
            .iter()
            .map(|e| {
                let e = e.as_ref()?;
                let ms = t.base.elapsed_ms(e).ok()?;
                Some(t.base_host + (f64::from(ms.max(0.0)) * 1e3) as u64)
            })
            .collect()
    }

    /// Faults in and page-locks every slot now, on `threads` workers of `pool` (for
    /// `GpuFile::warm_up`; jobs do it lazily otherwise).
    pub fn pin_all(&self, pool: &super::pool::Pool, threads: usize) -> Result<()> {
        self.pin_first(pool, threads, self.nseg, || {}, &|| {})
    }

    /// Faults in (in parallel, on `threads` workers of `pool`) and page-locks the first
    /// `slots` slots whole, while the calling thread runs `caller` (beside the faulting; it
    /// must not wait for the workers; it runs whatever this returns). Each worker runs
    /// `beside` once it has no more memory to fault in (work it shares with `caller`, such as
    /// a batch's checks of its files; it must not wait for the calling thread). No job runs
    /// (the caller holds the engine's ring lock). Unlike a job's lockings (one at a time), these run on up
    /// to `threads.min(slots)` workers at once: nothing waits for them but the caller, which
    /// has its own work beside them. An error (a failed bind or `cuMemHostRegister`, a worker
    /// that panicked) leaves the slots it did not lock for the next job to lock lazily.
    pub fn pin_first(
        &self,
        pool: &super::pool::Pool,
        threads: usize,
        slots: usize,
        caller: impl FnOnce(),
        beside: &(dyn Fn() + Sync),
    ) -> Result<()> {
        const CHUNK: usize = 8 << 20;
        let slots = slots.min(self.nseg);
        let len = slots * self.seg_bytes;
        let chunks = len.div_ceil(CHUNK);
        let next = AtomicUsize::new(0);
        let page = io::page_size();
        let fault = |_ws: &mut super::worker::WorkerState| {
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= chunks {
                    break;
                }
                let end = ((c + 1) * CHUNK).min(len);
                for off in (c * CHUNK..end).step_by(page) {
                    // SAFETY: off < len <= the mapping's length; no job runs (the caller holds
                    // the engine's ring lock), so no one else touches these bytes.
                    unsafe { self.mem.base.add(off).write_volatile(0) };
                }
            }
            beside();
        };
        // A worker that panicked faulting or locking fails the preparation (the job that
        // follows locks what is left itself); it never counts as done.
        if !pool.run_with(threads, &fault, caller).ok() {
            return Err(super::panicked());
        }
        if slots == 0 {
            return Ok(());
        }
        let next = AtomicUsize::new(0);
        let err: Mutex<Option<Error>> = Mutex::new(None);
        let ran = pool.run(threads.min(slots), &|_ws| {
            if let Err(e) = crate::cuda::bind(&self.ctx) {
                *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.into());
                return;
            }
            loop {
                let r = next.fetch_add(1, Ordering::Relaxed);
                if r >= slots {
                    break;
                }
                if let Err(e) = self.ensure_registered(r, self.seg_bytes) {
                    *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    break;
                }
            }
        });
        match err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None if !ran.ok() => Err(super::panicked()),
            None => Ok(()),
        }
    }
}

impl Ring for SegRes {
    fn slots(&self) -> usize {
        self.nseg
    }

    fn streams(&self) -> usize {
        self.streams.len()
    }

    fn slot_bytes(&self) -> usize {
        self.seg_bytes
    }

    fn slot_ptr(&self, r: usize) -> *mut u8 {
        debug_assert!(r < self.nseg);
        // SAFETY: r < nseg, so the offset stays inside the mapping of seg_bytes * nseg bytes.
        unsafe { self.mem.base.add(r * self.seg_bytes) }
    }

    fn bind(&self) -> Result<()> {
        crate::cuda::bind(&self.ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))
    }

    /// Page-locks in 2 MiB steps (at most the slot); a slot locked less far than asked is
    /// locked further by one more registration (see `regions`), never unlocked first.
    fn ensure_registered(&self, r: usize, need: usize) -> Result<usize> {
        let have = self.registered[r].load(Ordering::Acquire);
        if have >= need {
            return Ok(0);
        }
        let want = need
            .div_ceil(HUGE_PAGE)
            .saturating_mul(HUGE_PAGE)
            .min(self.seg_bytes);
        // SAFETY: [slot + have, slot + want) lies inside our mapping, which stays mapped until
        // Drop unregisters it, and overlaps none of the slot's registrations (they end at
        // `have`).
        unsafe { mem::host_register(self.slot_ptr(r).add(have), want - have) }?;
        self.regions_of(r).push(have);
        self.registered[r].store(want, Ordering::Release);
        Ok(want - have)
    }

    fn is_registered(&self, r: usize, end: usize) -> bool {
        self.registered[r].load(Ordering::Acquire) >= end
    }

    unsafe fn copy(
        &self,
        dst: sys::CUdeviceptr,
        src: *const u8,
        len: usize,
        stream: usize,
    ) -> Result<()> {
        // One copy per registration the source spans (a copy's host range lies in one
        // page-locked registration, as CUDA takes it for pinned memory).
        let at = (src as usize).wrapping_sub(self.mem.base as usize);
        let (r, off) = (at / self.seg_bytes, at % self.seg_bytes);
        debug_assert!(
            r < self.nseg && off + len <= self.seg_bytes,
            "a copy spans two slots"
        );
        let parts = match self.regions.get(r) {
            Some(m) => split_at_regions(&m.lock().unwrap_or_else(|p| p.into_inner()), off, len),
            None => vec![(0, len)],
        };
        for (at, n) in parts {
            // SAFETY: the caller's contract (page-locked source, device destination of our
            // context, which the calling worker bound) for [src, src + len), of which
            // [src + at, src + at + n) is a part; the stream is ours and live.
            unsafe {
                mem::memcpy_htod_async(
                    dst + at as u64,
                    src.add(at),
                    n,
                    self.streams[stream].cu_stream(),
                )
            }?;
        }
        Ok(())
    }

    fn wait_events(&self, stream: usize, events: &[CudaEvent]) -> Result<()> {
        for e in events {
            self.streams[stream]
                .wait(e)
                .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    fn record(&self, r: usize, stream: usize) -> Result<()> {
        self.events[r]
            .record(&self.streams[stream])
            .map_err(|e| Error::cuda("cuEventRecord", e))
    }

    fn sync_slot(&self, r: usize) -> Result<()> {
        self.events[r]
            .synchronize()
            .map_err(|e| Error::cuda("cuEventSynchronize", e))
    }

    fn mark_done(&self, g: usize, stream: usize) -> Result<()> {
        if !self.timing_on.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut t = self.timing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = t.as_mut() {
            if let (Some(slot), Some(ev)) = (t.done.get_mut(g), t.spare.pop()) {
                ev.record(&self.streams[stream])
                    .map_err(|e| Error::cuda("cuEventRecord", e))?;
                *slot = Some(ev);
            }
        }
        Ok(())
    }

    /// Synchronizes every stream, also past one that fails (the first error is returned),
    /// each through the result layer ([`crate::cuda::settle::synchronize`]: an error an
    /// earlier call left in a cudarc context object does not fail the drain).
    fn drain(&self) -> Result<()> {
        let mut first = None;
        for s in &self.streams {
            if let Err(e) = crate::cuda::settle::synchronize(s) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    #[cfg(test)]
    fn context_object(&self) -> Option<&Arc<CudaContext>> {
        Some(&self.ctx)
    }
}

/// `[off, off + len)` of a slot cut where its registrations start (`starts`, ascending): the
/// parts as (offset from `off`, length), in order, covering it exactly, none empty when `len`
/// is not 0.
fn split_at_regions(starts: &[usize], off: usize, len: usize) -> Vec<(usize, usize)> {
    let mut parts = Vec::new();
    let mut from = off;
    for end in starts
        .iter()
        .copied()
        .filter(|&b| b > off && b < off + len)
        .chain(std::iter::once(off + len))
    {
        parts.push((from - off, end - from));
        from = end;
    }
    parts
}

impl Drop for SegRes {
    fn drop(&mut self) {
        // Every copy was drained when the last job ended (a ring whose drain failed is leaked,
        // never dropped).
        let _ = crate::cuda::bind(&self.ctx);
        let mut ok = true;
        for r in 0..self.nseg {
            let starts = std::mem::take(&mut *self.regions_of(r));
            for at in starts {
                // SAFETY: registered by ensure_registered at this offset; no copy uses it any
                // more (above).
                if let Err(e) = unsafe { mem::host_unregister(self.slot_ptr(r).add(at)) } {
                    tracing::warn!(%e, "leaking a pinned segment that CUDA would not unregister");
                    ok = false;
                }
            }
        }
        if !ok {
            // Unmapping registered memory would leave CUDA a dangling registration.
            std::mem::forget(std::mem::replace(
                &mut self.mem,
                RingMem {
                    map: std::ptr::null_mut(),
                    map_len: 0,
                    base: std::ptr::null_mut(),
                },
            ));
        }
    }
}

/// A first-pass segment's progress (the first segment staged in each slot): which of its
/// tasks are read, and how far its copies were issued.
#[derive(Default)]
struct Early {
    /// Per task of the segment (offset from its first task): read.
    read: Vec<bool>,
    /// Tasks from the segment's first one that are all read.
    prefix: usize,
    /// Tasks from the segment's first one whose copies were issued.
    issued: usize,
    /// Payload bytes issued so far.
    issued_bytes: usize,
    /// A worker is issuing this segment's copies (it issues whatever the others read
    /// meanwhile before it lets go).
    busy: bool,
    /// Trace: when the first part was ready and issued, and the parts and runs so far.
    first: Option<(u64, u64)>,
    parts: usize,
    runs: usize,
    copied: usize,
}

/// One job's progress through the ring.
pub(in crate::storage) struct SegJob<'r, R: Ring + ?Sized> {
    res: &'r R,
    /// Slots this job uses (at most the ring's).
    nseg: usize,
    /// Copy streams this job uses.
    nstreams: usize,
    layout: Layout,
    /// Per slot: the bytes it is page-locked for, for every segment of the job at once (so a
    /// slot is locked only in the first pass, in a few parts, and never unlocked under a copy
    /// of the job).
    need: Vec<usize>,
    /// Held while a slot is being page-locked (by the worker issuing its first segment's
    /// copies): one at a time, and whoever comes second for a slot finds it done.
    pin_lock: Mutex<()>,
    remaining: Vec<AtomicUsize>,
    /// The first pass: per segment `g < nseg` (the first staged in slot `g`), its progress.
    /// Its copies are issued in parts, as a prefix of its tasks is read, each part after the
    /// slot is page-locked that far (one more registration): the first copy does not wait
    /// for the slowest of the first pass's reads (into memory they fault in) nor for a
    /// whole slot's locking, and the slots' lockings overlap the first pass's reads instead
    /// of running one after the other once each slot is full.
    early: Vec<Mutex<Early>>,
    /// Per slot: the last segment whose copies out of it are known complete (held while a
    /// worker waits for them, so the others for the same slot find them done).
    synced: Vec<Mutex<Option<usize>>>,
    /// Per segment past the first pass: the slot it is staged in, once claimed
    /// ([`UNCLAIMED`] before), and the segment staged there before it.
    slot_of: Vec<(AtomicUsize, AtomicUsize)>,
    /// Slots claimed by the segments past the first pass, in segment order ([`claim`](Self::claim)).
    claims: Mutex<Claims>,
    claims_cv: Condvar,
    /// Per slot: the last segment whose copies out of it were issued ([`UNCLAIMED`]: none),
    /// which [`claim`](Self::claim) reads to find the slots that may be claimed.
    issued_last: Vec<AtomicUsize>,
    /// Copies issued (for tests and reports).
    pub copies: AtomicUsize,
}

/// A segment's slot before it was claimed.
const UNCLAIMED: usize = usize::MAX;

/// The claims of slots by the segments past the first pass ([`SegJob::claim`]).
struct Claims {
    /// The next segment to claim a slot.
    next: usize,
    /// Per slot: the segment staged there last.
    holder: Vec<usize>,
}

impl<'r, R: Ring + ?Sized> SegJob<'r, R> {
    pub fn new(res: &'r R, layout: Layout, nseg: usize, nstreams: usize) -> Self {
        let nseg = nseg.clamp(1, res.slots());
        let need = layout.slot_needs(nseg);
        SegJob {
            slot_of: (0..layout.segs.len())
                .map(|g| {
                    let r = if g < nseg { g } else { UNCLAIMED };
                    (AtomicUsize::new(r), AtomicUsize::new(UNCLAIMED))
                })
                .collect(),
            claims: Mutex::new(Claims {
                next: nseg,
                holder: (0..nseg).collect(),
            }),
            claims_cv: Condvar::new(),
            issued_last: (0..nseg).map(|_| AtomicUsize::new(UNCLAIMED)).collect(),
            res,
            nseg,
            nstreams: nstreams.clamp(1, res.streams()),
            remaining: layout
                .segs
                .iter()
                .map(|r| AtomicUsize::new(r.len()))
                .collect(),
            early: layout
                .segs
                .iter()
                .take(nseg)
                .map(|r| {
                    Mutex::new(Early {
                        read: vec![false; r.len()],
                        ..Early::default()
                    })
                })
                .collect(),
            layout,
            need,
            pin_lock: Mutex::new(()),
            synced: (0..nseg).map(|_| Mutex::new(None)).collect(),
            copies: AtomicUsize::new(0),
        }
    }

    /// Waits until the copies of segment `want` out of slot `r` completed (the slot's marker).
    /// They were issued: a slot is claimed only once its last segment's were ([`claim`](Self::claim)).
    fn wait(&self, r: usize, want: usize) -> Result<()> {
        debug_assert_eq!(self.issued_last[r].load(Ordering::Acquire), want);
        let mut synced = self.synced[r].lock().unwrap_or_else(|p| p.into_inner());
        if synced.is_none_or(|x| x < want) {
            self.res.sync_slot(r)?;
            *synced = Some(want);
        }
        Ok(())
    }

    /// Page-locks slot `r` at least as far as `end` (a no-op when it already is), as worker
    /// `w`. Under the job's pin lock: one page-locking at a time; anyone else for the same
    /// slot waits for it and finds it done. No copy of this job out of the slot's bytes past
    /// what is locked exists (copies are issued only after this returned), and the earlier
    /// jobs' copies were drained. A smaller registration is extended by one more, never
    /// replaced (see `SegRes::regions`).
    fn pin_to(&self, job: &Job<'_>, r: usize, end: usize, w: usize) -> Result<()> {
        if end == 0 || self.res.is_registered(r, end) {
            return Ok(());
        }
        let _g = self.pin_lock.lock().unwrap_or_else(|p| p.into_inner());
        let t0 = job.t_now();
        let locked = self.res.ensure_registered(r, end)?;
        if let (Some(t), true) = (job.trace(), locked > 0) {
            t.pinned(r, w, t0, locked);
        }
        Ok(())
    }

    /// Issues the copies of tasks `tasks` of segment `g` (all read), as worker `w`: the
    /// destinations they write are waited for first (when they are allocated while the job
    /// runs: no page-locking contends with a job's one allocation), then the slot is
    /// page-locked as far as they read (their pages were faulted in by the reads; for the
    /// segment's last part, as far as any segment staged in the slot reads), then the copies
    /// are enqueued. After the segment's last part (`last`), the slot's marker is recorded:
    /// its parts are all on one stream, so the marker completes after every one of them.
    /// Returns the runs and bytes copied; `Ok(None)`: an allocation failed (the job is failed
    /// and aborting) and nothing was enqueued.
    fn issue_part(
        &self,
        job: &Job<'_>,
        g: usize,
        tasks: Range<usize>,
        last: bool,
        w: usize,
    ) -> Result<Option<(usize, usize)>> {
        let r = self.slot(g);
        let runs = copy_runs(&job.tasks, &self.layout.place, tasks, |i| {
            job.done[i].load(Ordering::Acquire)
        });
        let stream = g % self.nstreams;
        if !runs.is_empty() {
            let t0 = job.t_now();
            if !job.wait_dst(runs.iter().map(|x| x.buf))? {
                return Ok(None);
            }
            if let Some(t) = job.trace() {
                t.gate_waited(w, t0);
            }
            #[cfg(test)]
            if super::faults::pending(job) == Some(super::faults::Fault::FailsBeforeCopy) {
                let dst = super::faults::base(job, runs[0].buf);
                super::faults::fire(job, super::faults::Hit { dst, copied: None });
                return Err(super::faults::oom("cuMemHostRegister"));
            }
            let end = if last {
                self.need[r]
            } else {
                runs.iter().map(|x| x.slot_off + x.len).max().unwrap_or(0)
            };
            self.pin_to(job, r, end, w)?;
        }
        let slot = self.res.slot_ptr(r);
        for run in &runs {
            let dst = job.dev_ptr(run.buf, run.buf_off)?;
            debug_assert!(self.res.is_registered(r, run.slot_off + run.len));
            // SAFETY: the source is `run.len` payload bytes read into slot r (layout:
            // slot_off + len <= the segment's bytes <= the slot), page-locked that far
            // (pin_to above), not rewritten until the marker recorded after the segment's
            // last part completes (wait()); the destination is inside the task's own range of
            // a caller's device buffer (Job::batch contract), allocated (wait_dst above); the
            // context is current on this worker.
            unsafe { self.res.copy(dst, slot.add(run.slot_off), run.len, stream) }?;
        }
        self.copies.fetch_add(runs.len(), Ordering::Relaxed);
        if last {
            self.res.record(r, stream)?;
            self.res.mark_done(g, stream)?;
        }
        #[cfg(test)]
        if let Some(run) = runs.first() {
            use super::faults;
            if faults::pending(job) == Some(faults::Fault::DrainFails) {
                // The first run's bytes in the file (the task whose payload it starts in).
                let file_off = job
                    .tasks
                    .iter()
                    .find(|t| {
                        t.buf == run.buf
                            && t.buf_off <= run.buf_off
                            && run.buf_off < t.buf_off + t.len
                    })
                    .map_or(0, |t| t.file_off + (run.buf_off - t.buf_off) as u64);
                let hit = faults::Hit {
                    dst: faults::base(job, run.buf),
                    copied: Some((run.buf_off, file_off, run.len)),
                };
                if faults::fire(job, hit) {
                    return Err(faults::io_error());
                }
            }
        }
        Ok(Some((runs.len(), runs.iter().map(|x| x.len).sum())))
    }

    /// Issues segment `g`'s copies (all its tasks are read) in one part, as worker `w`.
    fn issue(&self, job: &Job<'_>, g: usize, w: usize) -> Result<()> {
        let ready = job.t_now();
        let Some((runs, bytes)) = self.issue_part(job, g, self.layout.segs[g].clone(), true, w)?
        else {
            return Ok(());
        };
        if let Some(t) = job.trace() {
            t.copied(CopyTrace {
                seg: g,
                slot: self.slot(g),
                stream: g % self.nstreams,
                ready,
                issued: trace::now_us(),
                bytes,
                runs,
                parts: 1,
            });
        }
        self.issued(g);
        Ok(())
    }

    /// Segment `g`'s copies are all enqueued and its slot's marker recorded: its slot may be
    /// claimed again, and whoever waits to claim one is woken.
    fn issued(&self, g: usize) {
        let r = self.slot(g);
        self.issued_last[r].store(g, Ordering::Release);
        #[cfg(test)]
        self.res.issued_hook(g);
        // Under the claims' lock: a claimer that found no slot free is either waiting already
        // or has not looked yet (it reads `issued_last` under that lock).
        let _c = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        self.claims_cv.notify_all();
    }

    /// The slot segment `g` is staged in (claimed: the first pass's, or one a worker of `g`
    /// claimed before reading).
    fn slot(&self, g: usize) -> usize {
        let r = self.slot_of[g].0.load(Ordering::Acquire);
        debug_assert!(r != UNCLAIMED, "segment {g} has no slot yet");
        r
    }

    /// The slot of segment `g` past the first pass and the segment staged there before it:
    /// claimed now if no worker of `g` claimed it yet. Claims go in segment order; segment
    /// `g` takes, among the slots whose last segment's copies were issued, the one holding the
    /// oldest segment (so one slot held up by a slow read does not hold up the ring). No
    /// deadlock: every slot is held by an earlier segment, whose tasks were all taken before
    /// any of `g`'s and are read by workers that wait for no claim. `None`: the job aborted.
    fn claim(&self, job: &Job<'_>, g: usize) -> Option<(usize, usize)> {
        let got = |s: &Self| {
            let r = s.slot_of[g].0.load(Ordering::Acquire);
            (r != UNCLAIMED).then(|| (r, s.slot_of[g].1.load(Ordering::Acquire)))
        };
        if let Some(x) = got(self) {
            return Some(x);
        }
        let mut c = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(x) = got(self) {
                return Some(x);
            }
            if job.aborted() {
                return None;
            }
            if c.next == g {
                let pick = (0..self.nseg)
                    .filter(|&r| self.issued_last[r].load(Ordering::Acquire) == c.holder[r])
                    .min_by_key(|&r| c.holder[r]);
                if let Some(r) = pick {
                    let prev = std::mem::replace(&mut c.holder[r], g);
                    self.slot_of[g].1.store(prev, Ordering::Release);
                    self.slot_of[g].0.store(r, Ordering::Release);
                    c.next += 1;
                    self.claims_cv.notify_all();
                    return Some((r, prev));
                }
            }
            c = self
                .claims_cv
                .wait_timeout(c, Duration::from_millis(2))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// First pass: task `i` of segment `g < nseg` is read, as worker `w`. Issues the copies of
    /// the segment's read prefix not issued yet once it holds at least an eighth of the
    /// segment and at least as many bytes as were issued before (so a slot gets a handful of
    /// registrations: each part's copies are cut where registrations start, for as long as
    /// the ring lives), and the rest when the segment is all read. One worker issues a
    /// segment's parts at a time; it issues what the others read meanwhile before letting go.
    fn early_read(&self, job: &Job<'_>, g: usize, i: usize, w: usize) -> Result<()> {
        let seg = self.layout.segs[g].clone();
        let min = (self.layout.ends[g] / 8).max(1);
        let mut st = self.early[g].lock().unwrap_or_else(|p| p.into_inner());
        st.read[i - seg.start] = true;
        if st.busy {
            return Ok(());
        }
        loop {
            let mut p = st.prefix;
            while p < seg.len() && st.read[p] {
                p += 1;
            }
            st.prefix = p;
            let last = p == seg.len();
            let part = seg.start + st.issued..seg.start + p;
            let bytes: usize = job.tasks[part.clone()].iter().map(|t| t.len).sum();
            if !last && (part.is_empty() || bytes < min.max(st.issued_bytes)) {
                st.busy = false;
                return Ok(());
            }
            st.busy = true;
            drop(st);
            let ready = job.t_now();
            // An error or a panic leaves `busy` set: the job is failed, and no one issues
            // after a part that may be half enqueued.
            let Some((runs, n)) = self.issue_part(job, g, part, last, w)? else {
                return Ok(());
            };
            st = self.early[g].lock().unwrap_or_else(|p| p.into_inner());
            st.issued = p;
            st.issued_bytes += bytes;
            st.first.get_or_insert((ready, trace::now_us()));
            st.parts += 1;
            st.runs += runs;
            st.copied += n;
            if last {
                if let (Some(t), Some((ready, issued))) = (job.trace(), st.first) {
                    t.copied(CopyTrace {
                        seg: g,
                        slot: self.slot(g),
                        stream: g % self.nstreams,
                        ready,
                        issued,
                        bytes: st.copied,
                        runs: st.runs,
                        parts: st.parts,
                    });
                }
                drop(st);
                self.issued(g);
                return Ok(());
            }
        }
    }

    /// Makes the copy streams this job uses wait for the events it is ordered after (before
    /// any copy is issued).
    pub fn order_streams(&self, job: &Job<'_>) -> Result<()> {
        for s in 0..self.nstreams {
            self.res.wait_events(s, job.after())?;
        }
        Ok(())
    }

    /// After a cancelled job (every worker returned): the tasks of segments whose copies were
    /// never issued (the job stopped taking tasks before the segment was full) were read into
    /// the ring but moved nothing to the device, so they count 0 bytes.
    pub fn forget_unissued(&self, job: &Job<'_>) {
        for (g, r) in self.layout.segs.iter().enumerate() {
            if self.remaining[g].load(Ordering::Acquire) > 0 {
                // A first-pass segment's parts issued before the job stopped did move their
                // bytes.
                let from = self
                    .early
                    .get(g)
                    .map_or(0, |e| e.lock().unwrap_or_else(|p| p.into_inner()).issued);
                for i in r.start + from..r.end {
                    job.done[i].store(0, Ordering::Relaxed);
                }
            }
        }
    }

    /// Worker `w`'s loop: read tasks into their spans, issue full segments.
    pub fn work(&self, job: &Job<'_>, w: usize) -> Result<()> {
        self.res.bind()?;
        if let Some(t) = job.trace() {
            t.entered(w);
        }
        while let Some((i, t)) = job.next() {
            let p = self.layout.place[i];
            let g = p.seg as usize;
            let mut r = g;
            if g >= self.nseg {
                let t0 = job.t_now();
                let Some((slot, prev)) = self.claim(job, g) else {
                    return Ok(());
                };
                r = slot;
                self.wait(r, prev)?;
                if let Some(tr) = job.trace() {
                    tr.waited(w, t0);
                }
            }
            let n = if job.item_failed(t.item) {
                job.skip_file(&t);
                0
            } else {
                let t0 = job.t_now();
                #[cfg(test)]
                std::thread::sleep(self.res.read_delay(i));
                // SAFETY: the task's span [io_off, io_off + io_len) lies inside the slot
                // (layout; checked by the planning tests) and no other task of this segment
                // overlaps it; the slot is free of earlier copies (wait above).
                let got = job.file(&t).and_then(|f| unsafe {
                    job.read_span(&f, &t, self.res.slot_ptr(r).add(p.io_off))
                });
                if let Some(tr) = job.trace() {
                    tr.io(w, i, t0);
                }
                match got {
                    Ok(n) => n,
                    Err(e) => {
                        job.fail_item(t.item, e)?;
                        0
                    }
                }
            };
            job.finish(i, n);
            let last = self.remaining[g].fetch_sub(1, Ordering::AcqRel) == 1;
            if g < self.early.len() {
                self.early_read(job, g, i, w)?;
            } else if last {
                self.issue(job, g, w)?;
            }
        }
        Ok(())
    }
}

/// What [`run`] leaves its caller.
pub(in crate::storage) struct RunEnd {
    /// Copies issued.
    pub copies: usize,
    /// The drain's outcome: when draining failed, copies may still read the ring and the
    /// caller must never unmap it.
    pub drained: Result<()>,
    /// A panic on the calling thread (in `caller`), caught so that every copy was drained
    /// first: the caller re-raises it once it handled `drained`.
    pub panic: Option<Box<dyn std::any::Any + Send>>,
}

/// Runs `job` (a read into device memory) through ring `res` on up to `threads` workers of
/// `pool`, while the calling thread runs `caller` (it may allocate the job's deferred
/// destination and open its gate; the caller bound the ring's context). A panic on a worker or in
/// `caller` fails the job, so no other worker waits for what the panicking one would have
/// done. Every copy is drained before this returns. Returns the copies issued and the drain's
/// outcome: when draining failed, copies may still read the ring and the caller must never
/// unmap it.
pub(in crate::storage) fn run<R: Ring + ?Sized>(
    pool: &super::pool::Pool,
    job: &Job<'_>,
    res: &R,
    p: super::SegParams,
    threads: usize,
    caller: impl FnOnce(),
) -> RunEnd {
    let per = tasks_per_segment(p.segment_size, job.piece);
    let seg_bytes = per * job.piece;
    debug_assert!(seg_bytes <= res.slot_bytes());
    let layout = layout(&job.tasks, seg_bytes);
    if let Some(t) = job.trace() {
        let nseg = p.segments.clamp(1, res.slots());
        let first_pass = layout.segs.get(nseg).map_or(job.tasks.len(), |r| r.start);
        t.set_first_pass(first_pass);
        t.note(format!(
            "layout: {} segments of {} MiB in a ring of {} slots, {} copy streams; first pass = tasks 0..{first_pass}",
            layout.segs.len(),
            seg_bytes >> 20,
            nseg,
            p.streams.clamp(1, res.streams())
        ));
    }
    let sj = SegJob::new(res, layout, p.segments, p.streams);
    // No copy is issued yet: an error here leaves nothing in flight (the ring stays usable).
    if let Err(e) = sj.order_streams(job) {
        job.fail(e);
        return RunEnd {
            copies: 0,
            drained: Ok(()),
            panic: None,
        };
    }
    let mut panic = None;
    let ran = pool.run_with(
        threads,
        &|ws: &mut super::worker::WorkerState| {
            let _f = super::FailOnUnwind(job);
            if let Err(e) = sj.work(job, ws.id) {
                job.fail(e);
            }
        },
        || {
            // Caught here and re-raised by the caller of `run` after the drain: copies may be
            // in flight into a destination the unwinding would free.
            let r = catch_unwind(AssertUnwindSafe(caller));
            if let Err(p) = r {
                job.fail(super::panicked());
                panic = Some(p);
            }
        },
    );
    job.ran(ran);
    if job.was_cut() {
        sj.forget_unissued(job);
    }
    // Every copy completes before the caller's buffers are released.
    let copies = sj.copies.load(Ordering::Relaxed);
    drop(sj);
    #[cfg(test)]
    if let Some(c) = res.context_object() {
        super::faults::stale_before_drain(job, c);
    }
    RunEnd {
        copies,
        drained: res.drain(),
        panic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy out of a slot locked in several registrations is cut exactly where they start:
    /// random registrations (2 MiB steps from the slot's start) and random copies inside the
    /// registered part give parts that are back to back, cover the copy, and each lie inside
    /// one registration.
    #[test]
    fn copies_are_cut_at_every_registration_they_span_and_nowhere_else() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        const STEP: usize = 2 << 20;
        for _ in 0..2000 {
            let mut starts = vec![0usize];
            let mut end = 0;
            for _ in 0..rng.random_range(1..6) {
                end += STEP * rng.random_range(1..5);
                starts.push(end);
            }
            // The last start is the registered end; registrations are starts[..last].
            let registered = starts.pop().unwrap();
            let off = rng.random_range(0..registered);
            let len = rng.random_range(0..=registered - off);
            let parts = split_at_regions(&starts, off, len);
            let mut at = 0;
            for &(o, n) in &parts {
                assert_eq!(o, at, "parts are back to back: {parts:?}");
                assert!(n > 0 || len == 0, "no empty part: {parts:?}");
                let (lo, hi) = (off + o, off + o + n);
                let reg = starts.iter().rposition(|&s| s <= lo).unwrap();
                let reg_end = starts.get(reg + 1).copied().unwrap_or(registered);
                assert!(
                    hi <= reg_end,
                    "part {lo}..{hi} spans registrations {starts:?}"
                );
                at += n;
            }
            assert_eq!(at, len, "the parts cover the copy: {parts:?}");
            let spans = starts.iter().filter(|&&s| s > off && s < off + len).count();
            assert_eq!(
                parts.len(),
                spans + 1,
                "cut only at registrations: {parts:?}"
            );
        }
    }
    use crate::storage::engine::plan::{plan, plan_item, Dir};
    use rand::{Rng, SeedableRng};

    #[test]
    fn segments_group_tasks_in_order() {
        assert_eq!(tasks_per_segment(32 << 20, 2 << 20), 16);
        assert_eq!(tasks_per_segment(1 << 20, 2 << 20), 1);
        let t = plan(0, 10 << 20, 1 << 20, Dir::Read, false);
        let l = layout(&t, 4 << 20);
        assert_eq!(l.segs, vec![0..4, 4..8, 8..10]);
        assert!(l.place.iter().all(|p| p.head == 0));
    }

    type Span = (usize, u32, usize, usize, usize);

    fn merged(mut v: Vec<Span>) -> Vec<Span> {
        v.sort();
        let mut out: Vec<Span> = Vec::new();
        for x in v {
            match out.last_mut() {
                Some(y) if y.0 == x.0 && y.1 == x.1 && y.2 + y.4 == x.2 && y.3 + y.4 == x.3 => {
                    y.4 += x.4
                }
                _ => out.push(x),
            }
        }
        out
    }

    /// Checks every invariant of a layout and its copy runs, for the read of every task in
    /// full and with random short reads.
    fn check_layout(tasks: &[Task], seg: usize, rng: &mut impl Rng) -> Layout {
        let l = layout(tasks, seg);
        assert_eq!(l.place.len(), tasks.len());
        // Segments: consecutive ranges covering every task, in order.
        let mut next = 0;
        for (g, r) in l.segs.iter().enumerate() {
            assert_eq!(r.start, next);
            assert!(r.end > r.start);
            next = r.end;
            let mut spans: Vec<(usize, usize)> = Vec::new();
            for i in r.clone() {
                let (t, p) = (&tasks[i], l.place[i]);
                assert_eq!(p.seg as usize, g);
                let (io_len, head, align) = io_shape(t);
                assert_eq!(p.head, head);
                assert!(p.io_off + io_len <= seg, "{t:?} {p:?} seg {seg}");
                assert_eq!(p.io_off % align, 0, "direct span not aligned: {t:?} {p:?}");
                // A buffered fallback of a direct task lands inside its span too.
                assert!(p.payload() + t.len <= p.io_off + io_len);
                spans.push((p.io_off, p.io_off + io_len));
            }
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].1 <= w[1].0, "IO spans overlap: {spans:?}");
            }
        }
        assert_eq!(next, tasks.len());
        // Copy runs move exactly the bytes read, each into its own task's destination range.
        for full in [true, false] {
            let done: Vec<usize> = tasks
                .iter()
                .map(|t| {
                    if full || rng.random_bool(0.7) {
                        t.len
                    } else {
                        rng.random_range(0..t.len)
                    }
                })
                .collect();
            // Intervals (segment, buffer, buffer offset, segment offset, length), merged where
            // contiguous in both spaces: what was copied must equal what was read.
            let mut got = Vec::new();
            let mut expect = Vec::new();
            for (g, r) in l.segs.iter().enumerate() {
                for run in copy_runs(tasks, &l.place, r.clone(), |i| done[i]) {
                    got.push((g, run.buf, run.buf_off, run.slot_off, run.len));
                }
                for i in r.clone() {
                    if done[i] > 0 {
                        let p = l.place[i].payload();
                        expect.push((g, tasks[i].buf, tasks[i].buf_off, p, done[i]));
                    }
                }
            }
            assert!(
                merged(got) == merged(expect),
                "copies differ from the bytes read"
            );
        }
        l
    }

    #[test]
    fn one_big_file_gets_one_copy_per_segment() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for (off, direct) in [(0u64, false), (0, true), (12_345, true), (777, false)] {
            let t = plan(off, 4 << 30, 2 << 20, Dir::Read, direct);
            let l = check_layout(&t, 32 << 20, &mut rng);
            let copies: usize = l
                .segs
                .iter()
                .map(|r| copy_runs(&t, &l.place, r.clone(), |i| t[i].len).len())
                .sum();
            assert_eq!(copies, l.segs.len(), "off {off} direct {direct}");
            assert!(l.segs.len() <= (4usize << 30).div_ceil(32 << 20) + 1);
        }
    }

    #[test]
    fn small_files_packed_in_one_buffer_get_one_copy_per_segment() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for direct in [false, true] {
            let mut t = Vec::new();
            for f in 0..10_000u32 {
                let at = Task {
                    file: f,
                    item: f,
                    buf_off: f as usize * 102_400,
                    ..Task::default()
                };
                plan_item(&mut t, at, 0, 102_400, 2 << 20, Dir::Read, direct);
            }
            let l = check_layout(&t, 32 << 20, &mut rng);
            let copies: usize = l
                .segs
                .iter()
                .map(|r| copy_runs(&t, &l.place, r.clone(), |i| t[i].len).len())
                .sum();
            assert_eq!(copies, l.segs.len());
            // Packed: each segment holds as many files as fit.
            assert_eq!(l.segs[0].len(), (32 << 20) / 102_400);
        }
    }

    #[test]
    fn padded_destinations_get_one_copy_per_piece() {
        // Tensors back to back in the file, padded to 256 bytes on the device, in two buffers.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut t = Vec::new();
        let (mut foff, mut doff) = (8u64 + 1234, [0usize; 2]);
        let mut pieces = 0;
        for k in 0..200u32 {
            let len = rng.random_range(1..3 << 20);
            let buf = k % 2;
            let at = Task {
                buf,
                item: k,
                buf_off: doff[buf as usize],
                ..Task::default()
            };
            let before = t.len();
            plan_item(&mut t, at, foff, len, 2 << 20, Dir::Read, rng.random());
            pieces += t.len() - before;
            foff += len as u64;
            doff[buf as usize] += len.div_ceil(256) * 256;
        }
        let l = check_layout(&t, 8 << 20, &mut rng);
        let copies: usize = l
            .segs
            .iter()
            .map(|r| copy_runs(&t, &l.place, r.clone(), |i| t[i].len).len())
            .sum();
        // One per tensor per segment it spans, never one per task beyond that.
        assert!(
            copies <= pieces && copies >= 200,
            "{copies} copies for {pieces} pieces"
        );
    }

    /// Random batches: many files, several buffers, direct and buffered, random segment sizes.
    #[test]
    fn random_layouts_keep_every_invariant() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        for _ in 0..400 {
            let piece = rng.random_range(1..=64usize) * DIRECT_ALIGN;
            let seg = tasks_per_segment(rng.random_range(1..(4usize << 20)), piece) * piece;
            let mut t = Vec::new();
            // Destination ranges never overlap (the batch refuses overlaps before planning);
            // sometimes they are back to back, sometimes apart.
            let mut end = [0usize; 3];
            for item in 0..rng.random_range(1..40u32) {
                let buf = rng.random_range(0..3);
                let len = rng.random_range(1..1 << 20);
                let gap = if rng.random() {
                    0
                } else {
                    rng.random_range(1..5000)
                };
                let at = Task {
                    file: rng.random_range(0..5),
                    buf: buf as u32,
                    item,
                    buf_off: end[buf] + gap,
                    ..Task::default()
                };
                end[buf] += gap + len;
                let off = rng.random_range(0..1u64 << 40);
                plan_item(&mut t, at, off, len, piece, Dir::Read, rng.random());
            }
            check_layout(&t, seg, &mut rng);
        }
    }
}

/// The pipeline's ordering rules, run on the host: a ring of plain memory whose "copies" are
/// executed late, in order per stream, by a thread each (random delays), into a host buffer
/// that stands for device memory. A copy enqueued before its slot was page-locked or before
/// its destination existed fails the job; a slot read into again before its copies ran would
/// corrupt the bytes they carry, which the byte-for-byte check finds.
#[cfg(test)]
mod pipeline_tests {
    use super::*;
    use crate::storage::engine::io::{Fds, OpenMode};
    use crate::storage::engine::plan::{plan_item, Dir};
    use crate::storage::engine::pool::{Pool, PoolConfig};
    use crate::storage::engine::{DstGate, Mem, Op, SegParams};
    use rand::{Rng, SeedableRng};
    use std::alloc::Layout as AllocLayout;
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicBool;

    enum Cmd {
        Copy { dst: usize, src: usize, len: usize },
        Mark { slot: usize, ticket: u64 },
        Flush(std::sync::mpsc::Sender<()>),
        Quit,
    }

    struct Stream {
        q: Mutex<VecDeque<Cmd>>,
        cv: Condvar,
    }

    struct Shared {
        streams: Vec<Stream>,
        /// Per slot: (last ticket recorded, last ticket executed).
        marks: Mutex<Vec<(u64, u64)>>,
        marks_cv: Condvar,
        copies_run: AtomicUsize,
    }

    /// One page-locking of the fake ring: (slot, by a pool worker, locked from, to).
    type Pinned = (usize, bool, usize, usize);

    struct FakeRing {
        /// Slot memory, aligned for O_DIRECT spans.
        mem: *mut u8,
        mem_layout: AllocLayout,
        slot_bytes: usize,
        nslots: usize,
        registered: Vec<AtomicUsize>,
        /// The "device" buffer: [base, base + len).
        dev: (usize, usize),
        /// Set when the destination exists (a deferred one: after its allocation).
        dev_exists: AtomicBool,
        /// With one deferred buffer per item: each buffer's range of the "device" memory and
        /// whether it exists yet (a copy must land in one that does).
        bufs: Vec<(usize, usize, AtomicBool)>,
        copies_enqueued: AtomicUsize,
        /// Workers wait this long when they bind (start a job): holds them back.
        worker_bind_delay: Duration,
        /// The copy with this index (in enqueue order) panics instead (`usize::MAX`: none).
        panic_at_copy: usize,
        /// Every page-locking, in order: (slot, done by a pool worker rather than the calling
        /// thread, locked from, to).
        pins: Mutex<Vec<Pinned>>,
        /// Page-lockings under way.
        pinning: AtomicUsize,
        /// Per page-locking: its slot, where it ends, and which of `bufs` existed then.
        pin_made: Mutex<Vec<(usize, usize, Vec<bool>)>>,
        /// The read of this task is held up this long.
        slow: Option<(usize, Duration)>,
        /// The segments whose copies were issued, in order.
        issue_order: Mutex<Vec<usize>>,
        shared: Arc<Shared>,
        threads: Vec<std::thread::JoinHandle<()>>,
    }

    // SAFETY: (test) the slots are written by one worker per span and read by the copy threads
    // only after their segment is complete; the protocol under test keeps them apart.
    unsafe impl Sync for FakeRing {}

    impl FakeRing {
        fn new(slot_bytes: usize, nslots: usize, nstreams: usize, dev: (usize, usize)) -> Self {
            let shared = Arc::new(Shared {
                streams: (0..nstreams)
                    .map(|_| Stream {
                        q: Mutex::new(VecDeque::new()),
                        cv: Condvar::new(),
                    })
                    .collect(),
                marks: Mutex::new(vec![(0, 0); nslots]),
                marks_cv: Condvar::new(),
                copies_run: AtomicUsize::new(0),
            });
            let threads = (0..nstreams)
                .map(|s| {
                    let sh = shared.clone();
                    std::thread::spawn(move || {
                        let mut rng = rand::rngs::StdRng::seed_from_u64(s as u64 + 11);
                        loop {
                            let cmd = {
                                let st = &sh.streams[s];
                                let mut q = st.q.lock().unwrap();
                                loop {
                                    if let Some(c) = q.pop_front() {
                                        break c;
                                    }
                                    q = st.cv.wait(q).unwrap();
                                }
                            };
                            match cmd {
                                Cmd::Copy { dst, src, len } => {
                                    // Late: the workers go on reading meanwhile.
                                    std::thread::sleep(Duration::from_micros(
                                        rng.random_range(0..400),
                                    ));
                                    // SAFETY: (test) both ranges were checked at enqueue time
                                    // and stay alive until the ring is drained.
                                    unsafe {
                                        std::ptr::copy_nonoverlapping(
                                            src as *const u8,
                                            dst as *mut u8,
                                            len,
                                        )
                                    };
                                    sh.copies_run.fetch_add(1, Ordering::SeqCst);
                                }
                                Cmd::Mark { slot, ticket } => {
                                    let mut m = sh.marks.lock().unwrap();
                                    m[slot].1 = m[slot].1.max(ticket);
                                    sh.marks_cv.notify_all();
                                }
                                Cmd::Flush(ack) => {
                                    let _ = ack.send(());
                                }
                                Cmd::Quit => return,
                            }
                        }
                    })
                })
                .collect();
            let mem_layout =
                AllocLayout::from_size_align(slot_bytes * nslots, DIRECT_ALIGN).unwrap();
            // SAFETY: (test) a non-zero size layout; freed in Drop.
            let mem = unsafe { std::alloc::alloc_zeroed(mem_layout) };
            assert!(!mem.is_null());
            FakeRing {
                mem,
                mem_layout,
                slot_bytes,
                nslots,
                registered: (0..nslots).map(|_| AtomicUsize::new(0)).collect(),
                dev,
                dev_exists: AtomicBool::new(true),
                bufs: Vec::new(),
                worker_bind_delay: Duration::ZERO,
                slow: None,
                issue_order: Mutex::new(Vec::new()),
                panic_at_copy: usize::MAX,
                pins: Mutex::new(Vec::new()),
                pinning: AtomicUsize::new(0),
                pin_made: Mutex::new(Vec::new()),
                copies_enqueued: AtomicUsize::new(0),
                shared,
                threads,
            }
        }

        fn push(&self, s: usize, c: Cmd) {
            let st = &self.shared.streams[s];
            st.q.lock().unwrap().push_back(c);
            st.cv.notify_one();
        }
    }

    impl Drop for FakeRing {
        fn drop(&mut self) {
            for s in 0..self.shared.streams.len() {
                self.push(s, Cmd::Quit);
            }
            for t in self.threads.drain(..) {
                t.join().unwrap();
            }
            // SAFETY: (test) allocated in new with this layout; no copy runs any more.
            unsafe { std::alloc::dealloc(self.mem, self.mem_layout) };
        }
    }

    impl Ring for FakeRing {
        fn slots(&self) -> usize {
            self.nslots
        }
        fn streams(&self) -> usize {
            self.shared.streams.len()
        }
        fn slot_bytes(&self) -> usize {
            self.slot_bytes
        }
        fn slot_ptr(&self, r: usize) -> *mut u8 {
            assert!(r < self.nslots);
            // SAFETY: (test) inside the allocation.
            unsafe { self.mem.add(r * self.slot_bytes) }
        }
        fn bind(&self) -> Result<()> {
            if on_worker() {
                std::thread::sleep(self.worker_bind_delay);
            }
            Ok(())
        }
        fn ensure_registered(&self, r: usize, need: usize) -> Result<usize> {
            assert!(need <= self.slot_bytes);
            let have = self.registered[r].load(Ordering::SeqCst);
            if have >= need {
                return Ok(0);
            }
            assert!(
                self.dev_exists.load(Ordering::SeqCst),
                "slot {r} page-locked while the destination was being allocated (they contend for the driver)"
            );
            // Which per-item buffers exist as the locking starts.
            let made: Vec<bool> = self
                .bufs
                .iter()
                .map(|b| b.2.load(Ordering::SeqCst))
                .collect();
            assert_eq!(
                self.pinning.fetch_add(1, Ordering::SeqCst),
                0,
                "two slots page-locked at once"
            );
            // Widen the window in which a second page-locking would overlap this one.
            std::thread::sleep(Duration::from_millis(2));
            self.pinning.fetch_sub(1, Ordering::SeqCst);
            self.pins.lock().unwrap().push((r, on_worker(), have, need));
            self.pin_made.lock().unwrap().push((r, need, made));
            // Extended, never replaced: nobody else changed it meanwhile.
            assert_eq!(
                self.registered[r].swap(need, Ordering::SeqCst),
                have,
                "slot {r} locked by two threads at once"
            );
            Ok(need - have)
        }
        fn is_registered(&self, r: usize, end: usize) -> bool {
            self.registered[r].load(Ordering::SeqCst) >= end
        }
        unsafe fn copy(
            &self,
            dst: sys::CUdeviceptr,
            src: *const u8,
            len: usize,
            stream: usize,
        ) -> Result<()> {
            let base = self.mem as usize;
            let off = src as usize - base;
            let (r, in_slot) = (off / self.slot_bytes, off % self.slot_bytes);
            assert!(
                self.is_registered(r, in_slot + len),
                "a copy out of slot {r} [{in_slot}, +{len}) before it was page-locked that far"
            );
            assert!(
                self.dev_exists.load(Ordering::SeqCst),
                "a copy enqueued before its destination existed"
            );
            let dst = dst as usize;
            assert!(
                dst >= self.dev.0 && dst + len <= self.dev.0 + self.dev.1,
                "a copy outside the destination"
            );
            if !self.bufs.is_empty() {
                assert!(
                    self.bufs.iter().any(|(at, n, made)| dst >= *at
                        && dst + len <= at + n
                        && made.load(Ordering::SeqCst)),
                    "a copy of {len} bytes to {dst:#x} outside every buffer allocated by then"
                );
            }
            if self.copies_enqueued.fetch_add(1, Ordering::SeqCst) == self.panic_at_copy {
                panic!("test: a worker panics while it issues a segment's copies");
            }
            self.push(
                stream,
                Cmd::Copy {
                    dst,
                    src: src as usize,
                    len,
                },
            );
            Ok(())
        }
        fn wait_events(&self, _stream: usize, events: &[CudaEvent]) -> Result<()> {
            assert!(events.is_empty(), "the host tests order after nothing");
            Ok(())
        }
        fn record(&self, r: usize, stream: usize) -> Result<()> {
            let ticket = {
                let mut m = self.shared.marks.lock().unwrap();
                m[r].0 += 1;
                m[r].0
            };
            self.push(stream, Cmd::Mark { slot: r, ticket });
            Ok(())
        }
        fn sync_slot(&self, r: usize) -> Result<()> {
            let mut m = self.shared.marks.lock().unwrap();
            let want = m[r].0;
            while m[r].1 < want {
                m = self.shared.marks_cv.wait(m).unwrap();
            }
            Ok(())
        }
        fn drain(&self) -> Result<()> {
            for s in 0..self.shared.streams.len() {
                let (tx, rx) = std::sync::mpsc::channel();
                self.push(s, Cmd::Flush(tx));
                rx.recv().unwrap();
            }
            Ok(())
        }
        fn read_delay(&self, i: usize) -> Duration {
            match self.slow {
                Some((t, d)) if t == i => d,
                _ => Duration::ZERO,
            }
        }
        fn issued_hook(&self, g: usize) {
            self.issue_order.lock().unwrap().push(g);
        }
    }

    /// Whether the calling thread is a worker of a test pool (named `test-seg*`).
    fn on_worker() -> bool {
        std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("test-seg"))
    }

    fn scratch(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "gpudirect-pipeline-{name}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn open(p: &std::path::Path) -> Fds {
        Fds::open(
            p,
            OpenMode {
                write: false,
                create: false,
                truncate: false,
            },
        )
        .unwrap()
    }

    #[derive(Clone)]
    struct Case {
        /// (file index, file offset, length, destination offset) per item.
        items: Vec<(usize, u64, usize, usize)>,
        files: Vec<Vec<u8>>,
        dev_len: usize,
        piece: usize,
        seg: SegParams,
        threads: usize,
        direct: bool,
    }

    fn random_case(rng: &mut impl Rng, many_files: bool) -> Case {
        let piece = rng.random_range(1..=16usize) * DIRECT_ALIGN;
        let seg = SegParams {
            segment_size: piece * rng.random_range(1..6usize),
            segments: rng.random_range(2..5),
            streams: rng.random_range(1..3),
        };
        let mut files = Vec::new();
        let mut items = Vec::new();
        let mut end = 0usize;
        if many_files {
            for f in 0..rng.random_range(20..120usize) {
                let mut d = vec![0u8; rng.random_range(1..3 * piece)];
                rng.fill_bytes(&mut d);
                let off = rng.random_range(0..d.len() as u64);
                let len = d.len() - off as usize;
                let gap = if rng.random() {
                    0
                } else {
                    rng.random_range(1..3000)
                };
                items.push((f, off, len, end + gap));
                end += gap + len;
                files.push(d);
            }
        } else {
            let mut d = vec![0u8; rng.random_range(20 * piece..60 * piece)];
            rng.fill_bytes(&mut d);
            let off = rng.random_range(0..5000u64);
            items.push((0, off, d.len() - off as usize, 0));
            end = d.len() - off as usize;
            files.push(d);
        }
        Case {
            items,
            files,
            dev_len: end + 100,
            piece,
            seg,
            threads: rng.random_range(1..6),
            direct: rng.random_bool(0.3),
        }
    }

    /// What the run returned, the "device" bytes, copies enqueued and run, the page-lockings
    /// (slot, by a worker) and the job's segments.
    struct Ran {
        result: Result<super::super::Outcome>,
        dev: Vec<u8>,
        enqueued: usize,
        run: usize,
        pins: Vec<Pinned>,
        segs: usize,
        /// Per segment: its tasks' payload ends in their slot, in order.
        ends: Vec<Vec<usize>>,
        /// With one deferred buffer per item: page-lockings done before a buffer existed that
        /// a task of the first segment staged in that slot writes from below where the locking
        /// ends (slot, buffer).
        pinned_early: Vec<(usize, u32)>,
        /// The segments whose copies were issued, in order.
        issue_order: Vec<usize>,
    }

    /// Runs a case through the real SegJob on a real pool; `deferred`: the destination is
    /// allocated by the caller hook after `alloc_delay`, failing when `alloc_fails`.
    fn run_case(c: &Case, deferred: bool, alloc_delay: Duration, alloc_fails: bool) -> Ran {
        run_case_with(
            c,
            &Knobs {
                deferred,
                alloc_delay,
                alloc_fails,
                ..Knobs::default()
            },
        )
    }

    /// How [`run_case_with`] runs a case.
    #[derive(Clone, Default)]
    struct Knobs {
        /// The destination is allocated by the caller hook after `alloc_delay`, failing when
        /// `alloc_fails`.
        deferred: bool,
        alloc_delay: Duration,
        alloc_fails: bool,
        /// Workers are held back this long when they start.
        bind_delay: Duration,
        /// The copy with this index (0-based, in enqueue order) panics on its worker.
        panic_at_copy: Option<usize>,
        /// One deferred buffer per item (`run_deferred_each`), each allocated after
        /// `alloc_delay`; the allocation of this item fails.
        per_item: bool,
        fail_item: Option<usize>,
        /// The job's cancel flag is set once this many tasks finished.
        cancel_after: Option<usize>,
        /// The read of this task is held up this long.
        slow_task: Option<(usize, Duration)>,
    }

    /// [`run_case`] with every knob.
    fn run_case_with(c: &Case, k: &Knobs) -> Ran {
        let (deferred, alloc_delay, alloc_fails) = (k.deferred, k.alloc_delay, k.alloc_fails);
        let per_item = k.per_item;
        let paths: Vec<_> = c
            .files
            .iter()
            .enumerate()
            .map(|(i, d)| scratch(&i.to_string(), d))
            .collect();
        let fds: Vec<Fds> = paths.iter().map(|p| open(p)).collect();
        let mut dev = vec![0xA5u8; c.dev_len];
        let mut tasks = Vec::new();
        for (k, &(f, off, len, at)) in c.items.iter().enumerate() {
            // Per item: buffer k starts at the item's destination offset.
            let t = Task {
                file: f as u32,
                item: k as u32,
                buf: if per_item { k as u32 } else { 0 },
                buf_off: if per_item { 0 } else { at },
                ..Task::default()
            };
            plan_item(&mut tasks, t, off, len, c.piece, Dir::Read, c.direct);
        }
        let base = dev.as_mut_ptr() as usize;
        let seg_bytes = tasks_per_segment(c.seg.segment_size, c.piece) * c.piece;
        let mut ring = FakeRing::new(seg_bytes, c.seg.segments, c.seg.streams, (base, c.dev_len));
        ring.worker_bind_delay = k.bind_delay;
        ring.slow = k.slow_task;
        ring.panic_at_copy = k.panic_at_copy.unwrap_or(usize::MAX);
        if per_item {
            ring.bufs = c
                .items
                .iter()
                .map(|&(_, _, len, at)| (base + at, len, AtomicBool::new(false)))
                .collect();
        }
        let lay = layout(&tasks, seg_bytes);
        let segs = lay.segs.len();
        let ends: Vec<Vec<usize>> = lay
            .segs
            .iter()
            .map(|r| {
                r.clone()
                    .map(|i| lay.place[i].payload() + tasks[i].len)
                    .collect()
            })
            .collect();
        let task_buf: Vec<u32> = tasks.iter().map(|t| t.buf).collect();
        let gates: Vec<DstGate> = (0..if per_item { c.items.len() } else { 1 })
            .map(|_| DstGate::new())
            .collect();
        let gate = &gates[0];
        let mems = if per_item {
            (0..c.items.len() as u32).map(Mem::Deferred).collect()
        } else if deferred {
            vec![Mem::Deferred(0)]
        } else {
            vec![Mem::Dev(base as u64)]
        };
        // SAFETY: (test) the buffer is `dev`, alive until the job ended; tasks lie inside the
        // items' ranges, which fit it and do not overlap.
        let job = unsafe {
            super::super::Job::batch(
                fds.iter().collect(),
                mems,
                c.items.len(),
                tasks,
                c.piece,
                Op::Read,
                None,
            )
        }
        .with_segments(c.seg)
        .with_gates(&gates);
        let cancel = AtomicBool::new(false);
        let finished = AtomicUsize::new(0);
        let on_piece = |_n: usize| {
            if k.cancel_after
                .is_some_and(|at| finished.fetch_add(1, Ordering::SeqCst) + 1 >= at)
            {
                cancel.store(true, Ordering::SeqCst);
            }
        };
        let job = if k.cancel_after.is_some() {
            job.with_control(super::super::Control {
                after: &[],
                cancel: Some(&cancel),
                on_piece: Some(&on_piece),
            })
        } else {
            job
        };
        if deferred {
            ring.dev_exists.store(false, Ordering::SeqCst);
        } else if !per_item {
            gate.set(Some(base as u64));
        }
        let pool = Pool::new(PoolConfig::new("test-seg", 8));
        let end = run(&pool, &job, &ring, c.seg, c.threads, || {
            if per_item {
                super::super::open_gates(&job, |i| {
                    std::thread::sleep(alloc_delay);
                    if k.fail_item == Some(i) {
                        return Err(Error::InvalidArgument("test: allocation refused".into()));
                    }
                    ring.bufs[i].2.store(true, Ordering::SeqCst);
                    Ok(ring.bufs[i].0 as u64)
                })
            } else if deferred {
                super::super::open_gates(&job, |_| {
                    std::thread::sleep(alloc_delay);
                    if alloc_fails {
                        return Err(Error::InvalidArgument("test: allocation refused".into()));
                    }
                    ring.dev_exists.store(true, Ordering::SeqCst);
                    Ok(base as u64)
                })
            }
        });
        end.drained.unwrap();
        assert!(end.panic.is_none());
        let result = job.outcome(end.copies).map_err(|f| f.error);
        let enqueued = ring.copies_enqueued.load(Ordering::SeqCst);
        let run = ring.shared.copies_run.load(Ordering::SeqCst);
        let pins = std::mem::take(&mut *ring.pins.lock().unwrap());
        let issue_order = std::mem::take(&mut *ring.issue_order.lock().unwrap());
        let mut pinned_early = Vec::new();
        if per_item {
            for (r, to, made) in ring.pin_made.lock().unwrap().iter() {
                // The first segment staged in slot r is the one whose copies locked it; a
                // locking as far as `to` serves the copies of its tasks whose payload starts
                // below `to`.
                if let Some(g) = (0..segs).find(|g| g % c.seg.segments == *r) {
                    for i in lay.segs[g].clone() {
                        let b = task_buf[i];
                        if lay.place[i].payload() < *to && !made[b as usize] {
                            pinned_early.push((*r, b));
                        }
                    }
                }
            }
        }
        drop(ring);
        pool.shutdown();
        for p in &paths {
            std::fs::remove_file(p).unwrap();
        }
        Ran {
            result,
            dev,
            enqueued,
            run,
            pins,
            segs,
            ends,
            pinned_early,
            issue_order,
        }
    }

    fn check_bytes(c: &Case, dev: &[u8]) {
        let mut expect = vec![0xA5u8; c.dev_len];
        for &(f, off, len, at) in &c.items {
            expect[at..at + len].copy_from_slice(&c.files[f][off as usize..off as usize + len]);
        }
        if let Some(i) = (0..c.dev_len).find(|&i| dev[i] != expect[i]) {
            panic!(
                "byte {i} of the destination is {:#x}, expected {:#x} (piece {}, {:?}, {} threads, direct {})",
                dev[i], expect[i], c.piece, c.seg, c.threads, c.direct
            );
        }
    }

    /// The run succeeded with every item complete and every destination byte right.
    fn assert_landed(c: &Case, r: &Ran) {
        let out = r.result.as_ref().unwrap();
        assert!(out.items.iter().all(|i| i.complete && i.error.is_none()));
        check_bytes(c, &r.dev);
    }

    #[test]
    fn late_copies_never_see_a_slot_reused_and_every_byte_lands() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2024);
        for round in 0..24 {
            let c = random_case(&mut rng, round % 2 == 1);
            let r = run_case(&c, false, Duration::ZERO, false);
            assert_landed(&c, &r);
            assert_eq!(
                r.enqueued, r.run,
                "a copy was still queued when the job returned"
            );
        }
    }

    /// A slow read holds up its own slot only: with one read of the second pass held up for
    /// 300 ms (a preempted worker, a page-cache miss), the other slots keep taking later
    /// segments, and most of the job's segments are issued before the slow one; every byte
    /// lands. With each segment staged in slot `g % K`, segment `g + K` waits for the slow
    /// segment's slot and at most `K - 1` later segments are issued before it.
    #[test]
    fn a_slow_read_holds_up_its_own_slot_only() {
        let piece = DIRECT_ALIGN;
        let mut d = vec![0u8; 60 * 4 * piece];
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        rand::RngCore::fill_bytes(&mut rng, &mut d);
        let c = Case {
            items: vec![(0, 0, d.len(), 0)],
            dev_len: d.len(),
            files: vec![d],
            piece,
            seg: SegParams {
                segment_size: 4 * piece,
                segments: 3,
                streams: 1,
            },
            threads: 4,
            direct: false,
        };
        // Task 13: in segment 3, the first one past the first pass.
        let r = run_case_with(
            &c,
            &Knobs {
                slow_task: Some((13, Duration::from_millis(300))),
                ..Knobs::default()
            },
        );
        assert_landed(&c, &r);
        assert_eq!(r.segs, 60);
        let slow_at = r.issue_order.iter().position(|&g| g == 3).unwrap();
        let later = r.issue_order[..slow_at].iter().filter(|&&g| g > 3).count();
        assert!(
            later >= 40,
            "only {later} later segments issued before the slow one: {:?}",
            r.issue_order
        );
    }

    /// Slot claims under stress: random cases on rings of 1 to 4 slots and 1 or 2 copy
    /// streams, small segments (many passes), one read held up 0-15 ms, workers held back at
    /// their start, and in half the rounds a cancel at a random point (past the first pass
    /// too). No job hangs (30 s each), no copy is left queued, every destination byte is
    /// untouched or the file's, each item's moved count lies between the bytes that changed
    /// and those that are right, and a job that was not cancelled is exact.
    #[test]
    fn slot_claims_survive_slow_reads_cancels_and_two_streams() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        for round in 0..40 {
            let mut c = random_case(&mut rng, round % 2 == 1);
            c.seg.segment_size = c.piece * rng.random_range(1..4usize);
            c.seg.segments = rng.random_range(1..5);
            c.seg.streams = rng.random_range(1..3);
            c.threads = rng.random_range(1..8);
            let ntasks = 30;
            let k = Knobs {
                slow_task: Some((
                    rng.random_range(0..ntasks),
                    Duration::from_millis(rng.random_range(0..15)),
                )),
                cancel_after: if rng.random_bool(0.5) {
                    Some(rng.random_range(1..60))
                } else {
                    None
                },
                bind_delay: Duration::from_millis(rng.random_range(0..3)),
                ..Knobs::default()
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let c2 = c.clone();
            let k2 = k.clone();
            std::thread::spawn(move || {
                let r = run_case_with(&c2, &k2);
                let _ = tx.send(r);
            });
            let r = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| {
                    panic!("round {round} hung: {:?} threads {}", c.seg, c.threads)
                });
            assert_eq!(r.enqueued, r.run, "round {round}: a copy still queued");
            let out = r.result.as_ref().unwrap();
            for (kk, &(f, off, len, at)) in c.items.iter().enumerate() {
                let got = &r.dev[at..at + len];
                let want = &c.files[f][off as usize..off as usize + len];
                let differs = got.iter().filter(|&&b| b != 0xA5).count();
                let equal = got.iter().zip(want).filter(|(a, b)| a == b).count();
                let moved = out.items[kk].moved;
                assert!(
                    differs <= moved && moved <= equal,
                    "round {round} item {kk}: {moved} {differs} {equal}"
                );
                for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                    assert!(g == 0xA5 || g == w, "round {round}, item {kk}, byte {i}");
                }
                if !out.cancelled {
                    assert!(out.items[kk].complete, "round {round} item {kk} incomplete");
                    assert!(got == want, "round {round} item {kk} bytes");
                }
            }
        }
    }

    /// A random case (many small files in odd rounds) on a ring of 3 slots whose segments hold
    /// 4 to 6 tasks, so that a first-pass segment can come in parts.
    fn parted_case(rng: &mut impl Rng, round: usize) -> Case {
        let mut c = random_case(rng, round % 2 == 1);
        c.seg.segments = 3;
        c.seg.segment_size = c.piece * (4 + round % 3);
        c
    }

    /// Each slot the job uses is page-locked by workers only (the reads fault its pages in),
    /// one locking at a time (the fake ring asserts no two overlap, and that a copy never
    /// reads past what is locked), each locking extending the slot's last one: first as the
    /// reads of the first segment staged there come in, in a few parts (at least an eighth of
    /// the segment each, each at least as large as the ones before together, so the ring
    /// keeps a handful of registrations per slot), then as far as the slot's segments need;
    /// after the first pass, never again.
    #[test]
    fn each_slot_is_page_locked_by_workers_in_a_few_growing_parts_one_at_a_time() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let mut parted = 0;
        for round in 0..12 {
            let mut c = parted_case(&mut rng, round);
            c.threads = 6;
            let r = run_case_with(
                &c,
                &Knobs {
                    bind_delay: Duration::from_millis(5),
                    ..Knobs::default()
                },
            );
            assert_landed(&c, &r);
            let slots = 3.min(r.segs);
            assert!(
                r.pins.iter().all(|p| p.1),
                "a page-locking off the workers: {:?}",
                r.pins
            );
            for s in 0..slots {
                let mine: Vec<_> = r.pins.iter().filter(|p| p.0 == s).collect();
                // Past the first pass any segment may be staged in any slot.
                let need = if r.segs > 3 {
                    (0..r.segs).map(|g| *r.ends[g].iter().max().unwrap()).max()
                } else {
                    r.ends[s].iter().max().copied()
                }
                .unwrap();
                assert_eq!(mine.first().map(|p| p.2), Some(0), "slot {s}: {mine:?}");
                assert_eq!(mine.last().map(|p| p.3), Some(need), "slot {s}: {mine:?}");
                let first_end = *r.ends[s].iter().max().unwrap();
                let min = (first_end / 8).max(1);
                for (k, p) in mine.iter().enumerate() {
                    assert!(
                        k == 0 || p.2 == mine[k - 1].3,
                        "slot {s} not extended: {mine:?}"
                    );
                    // Every part but the last: at least an eighth of the segment and at least
                    // what was locked before it.
                    if k + 1 < mine.len() {
                        assert!(
                            p.3 - p.2 >= min.min(first_end - p.2)
                                && p.3 - p.2 >= p.2.min(first_end - p.2),
                            "slot {s}: part {k} too small: {mine:?} (segment end {first_end})"
                        );
                    }
                }
                if mine.len() > 1 {
                    parted += 1;
                }
            }
        }
        assert!(
            parted > 0,
            "no first-pass segment came in parts: the test checks nothing"
        );
    }

    /// A job cancelled while the ring's first pass issues its segments' copies in parts: the
    /// bytes it reports per item are exactly the ones that reached the destination (tasks in
    /// parts whose copies were issued count; tasks read but not issued count 0), every byte
    /// that reached it is right, and no copy is still queued. Random data can equal the
    /// sentinel, so "reached" is bounded: the bytes that differ from the sentinel at most, the
    /// bytes that equal the file at least.
    #[test]
    fn a_job_cancelled_in_the_first_pass_reports_exactly_the_parts_it_copied() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(53);
        let mut cut_rounds = 0;
        for round in 0..16 {
            let mut c = parted_case(&mut rng, round);
            c.threads = 1 + round % 4;
            let r = run_case_with(
                &c,
                &Knobs {
                    cancel_after: Some(1 + round % 7),
                    ..Knobs::default()
                },
            );
            assert_eq!(
                r.enqueued, r.run,
                "a copy was still queued when the job returned"
            );
            let out = r.result.as_ref().unwrap();
            if out.cancelled {
                cut_rounds += 1;
            }
            for (k, &(f, off, len, at)) in c.items.iter().enumerate() {
                let got = &r.dev[at..at + len];
                let want = &c.files[f][off as usize..off as usize + len];
                let differs = got.iter().filter(|&&b| b != 0xA5).count();
                let equal = got.iter().zip(want).filter(|(a, b)| a == b).count();
                let moved = out.items[k].moved;
                assert!(
                    differs <= moved && moved <= equal,
                    "round {round}, item {k}: {moved} bytes reported, {differs} differ from the sentinel, {equal} equal the file"
                );
                for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        g == 0xA5 || g == w,
                        "round {round}, item {k}, byte {i}: {g:#x}, not the file's {w:#x}"
                    );
                }
                assert!(
                    got[..out.items[k].prefix] == want[..out.items[k].prefix],
                    "round {round}, item {k}: the reported prefix is not the file's"
                );
            }
        }
        assert!(cut_rounds > 0, "no job was cut: the test checks nothing");
    }

    /// A deferred destination: no slot is page-locked while it is being allocated (the fake
    /// ring asserts it), however long the allocation takes and however far the workers read.
    #[test]
    fn no_slot_is_page_locked_while_the_destination_is_allocated() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        for round in 0..6 {
            let mut c = random_case(&mut rng, round % 2 == 1);
            c.threads = 4;
            let r = run_case(&c, true, Duration::from_millis(30), false);
            assert_landed(&c, &r);
            assert!(!r.pins.is_empty() || r.segs == 0);
        }
    }

    /// A worker that panics while it issues a segment's copies (a bug, or a failed assertion)
    /// fails the job: the workers waiting for that segment's slot stop instead of waiting for
    /// it forever, the job returns an error, every copy issued is drained, and the pool still
    /// works. (Before, the job was failed only after every worker returned: a hang.)
    #[test]
    fn a_panicking_worker_fails_the_job_instead_of_hanging_the_others() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        for round in 0..4 {
            let mut c = random_case(&mut rng, false);
            // Several passes over a small ring, several workers: someone waits for the slot.
            c.seg.segments = 2;
            c.threads = 4;
            let k = Knobs {
                panic_at_copy: Some(round),
                ..Knobs::default()
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let c2 = c.clone();
            std::thread::spawn(move || {
                let r = run_case_with(&c2, &k);
                let _ = tx.send((r.result.map(|_| ()), r.enqueued, r.run));
            });
            let (result, enqueued, run) = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("the job hung after a worker panicked");
            match result {
                Err(Error::Io { source, .. }) => {
                    assert!(source.to_string().contains("panicked"), "{source}")
                }
                other => panic!("expected the panic's error, got {other:?}"),
            }
            // The panicking copy was counted but never enqueued; every other one ran.
            assert_eq!(
                enqueued,
                run + 1,
                "a copy was still queued when the job returned"
            );
        }
    }

    #[test]
    fn a_deferred_destination_is_copied_into_only_once_it_exists() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(77);
        for round in 0..12 {
            let c = random_case(&mut rng, round % 2 == 0);
            // The allocation takes longer than filling the ring: workers wait for it.
            let r = run_case(
                &c,
                true,
                Duration::from_millis(rng.random_range(1..30)),
                false,
            );
            assert_landed(&c, &r);
            assert_eq!(r.enqueued, r.run);
        }
    }

    #[test]
    fn a_failed_deferred_allocation_fails_the_job_and_copies_nothing() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..6 {
            let c = random_case(&mut rng, false);
            let r = run_case(&c, true, Duration::from_millis(5), true);
            match r.result {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("allocation refused"), "{m}"),
                other => panic!("expected the allocation's error, got {other:?}"),
            }
            assert_eq!(
                r.enqueued, 0,
                "a copy was enqueued into a destination that never existed"
            );
            assert!(
                r.dev.iter().all(|&b| b == 0xA5),
                "the destination was written"
            );
        }
    }

    /// One deferred destination per item (a checkpoint's tensors, each allocated while the
    /// job reads): every copy lands in a buffer that exists by then (the fake ring asserts
    /// it), every byte lands, and no copy is still queued when the job returns.
    #[test]
    fn deferred_destinations_each_are_copied_into_only_once_they_exist() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(91);
        for round in 0..10 {
            let c = random_case(&mut rng, true);
            let r = run_case_with(
                &c,
                &Knobs {
                    per_item: true,
                    alloc_delay: Duration::from_micros(rng.random_range(0..600)),
                    bind_delay: Duration::from_millis(round % 3),
                    ..Knobs::default()
                },
            );
            assert_landed(&c, &r);
            assert_eq!(
                r.enqueued, r.run,
                "a copy was still queued when the job returned"
            );
            assert!(
                r.pinned_early.is_empty(),
                "slots page-locked before the buffers their segment writes existed (slot, buffer): {:?}",
                r.pinned_early
            );
        }
    }

    /// A failed allocation of one of several deferred destinations fails the job: nothing is
    /// copied into it or any buffer after it (they were never allocated), no worker waits
    /// for them forever, and every copy issued into the earlier ones has run.
    #[test]
    fn a_failed_allocation_among_several_fails_the_job_and_writes_no_later_buffer() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(93);
        for _ in 0..8 {
            let c = random_case(&mut rng, true);
            let fail = rng.random_range(0..c.items.len());
            let r = run_case_with(
                &c,
                &Knobs {
                    per_item: true,
                    alloc_delay: Duration::from_micros(200),
                    fail_item: Some(fail),
                    ..Knobs::default()
                },
            );
            match r.result {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("allocation refused"), "{m}"),
                other => panic!("expected the allocation's error, got {other:?}"),
            }
            assert_eq!(
                r.enqueued, r.run,
                "a copy was still queued after the failure"
            );
            for &(_, _, len, at) in &c.items[fail..] {
                assert!(
                    r.dev[at..at + len].iter().all(|&b| b == 0xA5),
                    "a buffer at or after the failed allocation was written"
                );
            }
        }
    }

    /// A panic on the calling thread after the destination was handed out (copies into it are
    /// being issued) comes back only once every copy enqueued has completed: unwinding frees
    /// the destination, so the panic must not overtake the drain.
    #[test]
    fn a_panic_after_the_allocation_waits_for_the_copies_before_it_unwinds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for _ in 0..4 {
            let mut c = random_case(&mut rng, false);
            c.threads = 4;
            let p = scratch("late-panic", &c.files[0]);
            let fds = open(&p);
            let (f, off, len, at) = c.items[0];
            assert_eq!(f, 0);
            let mut tasks = Vec::new();
            let t = Task {
                buf_off: at,
                ..Task::default()
            };
            plan_item(&mut tasks, t, off, len, c.piece, Dir::Read, c.direct);
            let mut dev = vec![0u8; c.dev_len];
            let base = dev.as_mut_ptr() as usize;
            let seg_bytes = tasks_per_segment(c.seg.segment_size, c.piece) * c.piece;
            let ring = FakeRing::new(seg_bytes, c.seg.segments, c.seg.streams, (base, c.dev_len));
            let gate = DstGate::new();
            // SAFETY: (test) the destination is `dev`, alive until the run returned (drained).
            let job = unsafe {
                super::super::Job::batch(
                    vec![&fds],
                    vec![Mem::Deferred(0)],
                    1,
                    tasks,
                    c.piece,
                    Op::Read,
                    None,
                )
            }
            .with_segments(c.seg)
            .with_gate(&gate);
            let pool = Pool::new(PoolConfig::new("test-seg-late-panic", 4));
            let end = run(&pool, &job, &ring, c.seg, c.threads, || {
                super::super::open_gates(&job, |_| Ok(base as u64));
                // Let the workers issue copies into the destination, then panic.
                std::thread::sleep(Duration::from_millis(3));
                panic!("test: the calling thread panics after the allocation");
            });
            let (enqueued, ran) = (
                ring.copies_enqueued.load(Ordering::SeqCst),
                ring.shared.copies_run.load(Ordering::SeqCst),
            );
            assert!(end.panic.is_some(), "the panic was swallowed");
            assert!(job.aborted(), "the job was not failed");
            assert_eq!(
                enqueued, ran,
                "the panic came back with copies still queued"
            );
            drop(ring);
            pool.shutdown();
            drop(dev);
            std::fs::remove_file(&p).unwrap();
        }
    }

    /// A panic while allocating must not leave workers waiting for the destination: the job
    /// fails, the workers finish, and the panic is handed back to be re-raised (after every
    /// borrow of the job ended).
    #[test]
    fn a_panicking_deferred_allocation_releases_the_workers_then_unwinds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let c = random_case(&mut rng, false);
        let d = vec![0u8; c.files[0].len()];
        let p = scratch("panic", &c.files[0]);
        let fds = open(&p);
        let mut tasks = Vec::new();
        plan_item(
            &mut tasks,
            Task::default(),
            0,
            d.len(),
            c.piece,
            Dir::Read,
            false,
        );
        let seg_bytes = tasks_per_segment(c.seg.segment_size, c.piece) * c.piece;
        let ring = FakeRing::new(seg_bytes, c.seg.segments, c.seg.streams, (0, 0));
        ring.dev_exists.store(false, Ordering::SeqCst);
        let gate = DstGate::new();
        // SAFETY: (test) no copy can be issued (the destination never exists).
        let job = unsafe {
            super::super::Job::batch(
                vec![&fds],
                vec![Mem::Deferred(0)],
                1,
                tasks,
                c.piece,
                Op::Read,
                None,
            )
        }
        .with_segments(c.seg)
        .with_gate(&gate);
        let pool = Pool::new(PoolConfig::new("test-seg-panic", 4));
        let end = run(&pool, &job, &ring, c.seg, 4, || {
            super::super::open_gates(&job, |_| panic!("test: allocation panicked"))
        });
        assert!(end.panic.is_some(), "the allocation's panic was swallowed");
        assert!(job.aborted(), "the job was not failed");
        assert_eq!(ring.copies_enqueued.load(Ordering::SeqCst), 0);
        // The pool still works.
        assert!(pool.run(4, &|_| {}).ok());
        drop(ring);
        pool.shutdown();
        std::fs::remove_file(&p).unwrap();
    }
}

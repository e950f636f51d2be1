//! The segment pipeline for reads into device memory ([`Pipeline::Segments`]).
//!
//! The plan's tasks (pieces cut at multiples of the piece size in file-offset space) are
//! grouped, `per` consecutive tasks at a time, into *segments*. Segment `g` is staged in slot
//! `g % K` of a ring of `K` pinned buffers of `per × piece` bytes each. Workers pull tasks in
//! order from the job's counter and `pread` each into its own slice of its segment's slot; the
//! worker that fills the last slice of a segment issues ONE `cuMemcpyHtoDAsync` for the whole
//! segment on copy stream `g % streams` and records the slot's event. A worker that wants to
//! fill slot `r` for segment `g ≥ K` first waits until segment `g − K`'s copy was issued and
//! has completed (the slot's event).
//!
//! No deadlock: tasks are taken in order, so every task of segment `g − K` was taken before
//! any task of `g`; each of those is being read by a worker that waits at most for segment
//! `g − 2K` (induction). Errors abort the job; waiters poll the abort flag.
//!
//! Layout: segment `g`'s bytes are placed relative to `base = align_down(first.file_off)`, so
//! an O_DIRECT over-read of the aligned span of a task lands at `io_off − base` (aligned) and
//! its payload at `file_off − base`; the payload of the segment is contiguous from
//! `first.file_off − base`, and the device range is contiguous from `first.buf_off`.
//!
//! [`Pipeline::Segments`]: crate::storage::config::Pipeline::Segments

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::bounce::BounceBuf;
use super::plan::{align_down, direct_read_span, Task};
use super::{io, is_einval, Job};
use crate::error::{Error, Result};

/// Tasks per segment for a segment of about `segment_size` bytes and pieces of `piece`.
pub(crate) fn tasks_per_segment(segment_size: usize, piece: usize) -> usize {
    (segment_size / piece.max(1)).max(1)
}

/// The task indices of segment `g` among `ntasks` tasks.
pub(crate) fn seg_tasks(ntasks: usize, per: usize, g: usize) -> Range<usize> {
    (g * per).min(ntasks)..((g + 1) * per).min(ntasks)
}

/// Where task `t` goes in a segment whose base file offset is `base`:
/// `(buffer offset of the IO, file offset of the IO, IO length, payload head)`. Buffered IO
/// reads exactly the payload; O_DIRECT reads the aligned span.
pub(crate) fn slice_io(t: &Task, base: u64, direct: bool) -> (usize, u64, usize, usize) {
    if direct {
        let (io_off, io_len, head) = direct_read_span(t);
        ((io_off - base) as usize, io_off, io_len, head)
    } else {
        ((t.file_off - base) as usize, t.file_off, t.len, 0)
    }
}

/// Bytes of a segment's payload that are valid: the contiguous prefix of its tasks, stopping
/// after the first that came up short (end of file).
pub(crate) fn prefix_len(tasks: &[Task], done: impl Fn(usize) -> usize) -> usize {
    let mut len = 0;
    for (k, t) in tasks.iter().enumerate() {
        let d = done(k);
        len += d;
        if d < t.len {
            break;
        }
    }
    len
}

/// Pinned segments, copy streams and slot events of one engine, reused across jobs with the
/// same shape.
pub(crate) struct SegRes {
    ctx: Arc<CudaContext>,
    buf: BounceBuf,
    seg_bytes: usize,
    nseg: usize,
    streams: Vec<Arc<CudaStream>>,
    events: Vec<CudaEvent>,
}

// SAFETY: shared use only reads the buffer's address; the bytes behind it are written by one
// worker per slice (tasks are disjoint and taken once) and read by the DMA only after the
// segment's last slice is done; a slot is rewritten only after its event completed (the ring
// protocol in the module docs). Streams and events are Sync.
unsafe impl Sync for SegRes {}

impl SegRes {
    /// Allocates `nseg` page-locked segments of `seg_bytes` (one mapping, one registration),
    /// `nstreams` streams and one event per segment. The caller bound `ctx`.
    pub fn new(
        ctx: &Arc<CudaContext>,
        seg_bytes: usize,
        nseg: usize,
        nstreams: usize,
    ) -> Result<SegRes> {
        let mut buf = BounceBuf::new(seg_bytes * nseg)?;
        buf.register()?;
        let streams = (0..nstreams.max(1))
            .map(|_| {
                ctx.new_stream()
                    .map_err(|e| Error::cuda("cuStreamCreate", e))
            })
            .collect::<Result<Vec<_>>>()?;
        let events = (0..nseg)
            .map(|_| {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| Error::cuda("cuEventCreate", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SegRes {
            ctx: ctx.clone(),
            buf,
            seg_bytes,
            nseg,
            streams,
            events,
        })
    }

    /// True when these resources serve `ctx` with this shape.
    pub fn fits(
        &self,
        ctx: &Arc<CudaContext>,
        seg_bytes: usize,
        nseg: usize,
        nstreams: usize,
    ) -> bool {
        self.ctx.cu_ctx() == ctx.cu_ctx()
            && self.seg_bytes == seg_bytes
            && self.nseg == nseg
            && self.streams.len() == nstreams.max(1)
    }

    fn slot_ptr(&self, r: usize) -> *mut u8 {
        // SAFETY: r < nseg, so the offset stays inside the mapping of seg_bytes * nseg bytes.
        unsafe { self.buf.ptr().add(r * self.seg_bytes) }
    }

    /// Waits for every copy issued on the copy streams.
    pub fn drain(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct SlotState {
    /// The last segment whose copy out of this slot was issued.
    issued: Option<usize>,
    /// The last segment whose copy out of this slot is known complete.
    synced: Option<usize>,
}

/// One job's progress through the ring.
pub(crate) struct SegJob<'r> {
    res: &'r SegRes,
    per: usize,
    dptr: sys::CUdeviceptr,
    remaining: Vec<AtomicUsize>,
    slots: Vec<(Mutex<SlotState>, Condvar)>,
}

impl<'r> SegJob<'r> {
    pub fn new(res: &'r SegRes, ntasks: usize, per: usize, dptr: sys::CUdeviceptr) -> Self {
        let nsegs = ntasks.div_ceil(per);
        SegJob {
            res,
            per,
            dptr,
            remaining: (0..nsegs)
                .map(|g| AtomicUsize::new(seg_tasks(ntasks, per, g).len()))
                .collect(),
            slots: (0..res.nseg)
                .map(|_| (Mutex::new(SlotState::default()), Condvar::new()))
                .collect(),
        }
    }

    /// Waits until slot `r` is free of segment `want`'s copy. Ok(false): the job aborted.
    fn wait(&self, job: &Job<'_>, r: usize, want: usize) -> Result<bool> {
        let (m, cv) = &self.slots[r];
        let mut st = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.issued.is_some_and(|x| x >= want) {
                break;
            }
            if job.aborted() {
                return Ok(false);
            }
            st = cv
                .wait_timeout(st, Duration::from_millis(2))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if st.synced.is_none_or(|x| x < want) {
            self.res.events[r]
                .synchronize()
                .map_err(|e| Error::cuda("cuEventSynchronize", e))?;
            st.synced = Some(want);
        }
        Ok(true)
    }

    /// Issues segment `g`'s copy (all its tasks are read).
    fn issue(&self, job: &Job<'_>, g: usize) -> Result<()> {
        let r = g % self.res.nseg;
        let range = seg_tasks(job.tasks.len(), self.per, g);
        let tasks = &job.tasks[range.clone()];
        let first = tasks[0];
        let base = align_down(first.file_off);
        let len = prefix_len(tasks, |k| job.done[range.start + k].load(Ordering::Acquire));
        let stream = &self.res.streams[g % self.res.streams.len()];
        if len > 0 {
            // SAFETY: the source is `len` payload bytes inside slot r (layout in the module
            // docs; len <= the segment's payload), not rewritten until the event recorded
            // below completes (wait()); the destination lies inside the caller's device buffer
            // (Job::new contract); the context is current on this worker.
            unsafe {
                crate::cuda::result::mem::memcpy_htod_async(
                    self.dptr + first.buf_off as u64,
                    self.res.slot_ptr(r).add((first.file_off - base) as usize),
                    len,
                    stream.cu_stream(),
                )
            }?;
        }
        self.res.events[r]
            .record(stream)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        let (m, cv) = &self.slots[r];
        m.lock().unwrap_or_else(|p| p.into_inner()).issued = Some(g);
        cv.notify_all();
        Ok(())
    }

    /// A worker's loop: read tasks into their slices, issue full segments.
    pub fn work(&self, job: &Job<'_>) -> Result<()> {
        self.res
            .ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let nseg = self.res.nseg;
        while let Some((i, t)) = job.next() {
            let g = i / self.per;
            let r = g % nseg;
            if g >= nseg && !self.wait(job, r, g - nseg)? {
                return Ok(());
            }
            let first = job.tasks[g * self.per];
            let base = align_down(first.file_off);
            let n = read_into_slot(job, &t, self.res.slot_ptr(r), base, self.res.seg_bytes)?;
            job.done[i].store(n, Ordering::Release);
            if self.remaining[g].fetch_sub(1, Ordering::AcqRel) == 1 {
                self.issue(job, g)?;
            }
        }
        Ok(())
    }
}

/// Reads task `t` into its slice of a slot (`seg` bytes at `slot`, segment base `base`):
/// returns the payload bytes (short only at end of file).
fn read_into_slot(job: &Job<'_>, t: &Task, slot: *mut u8, base: u64, seg: usize) -> Result<usize> {
    let fds = job.fds;
    if t.direct {
        if let Some(d) = fds.direct() {
            let (boff, io_off, io_len, head) = slice_io(t, base, true);
            debug_assert!(boff + io_len <= seg);
            // SAFETY: [boff, boff + io_len) lies inside the slot (module docs; checked by the
            // planning tests); no other task's slice overlaps it.
            match unsafe { io::pread_full(d, slot.add(boff), io_len, io_off) } {
                Ok(got) => {
                    job.used_direct
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    return Ok(got.saturating_sub(head).min(t.len));
                }
                Err(e) if is_einval(&e) => {
                    tracing::debug!(path = %fds.path.display(), "O_DIRECT read refused (EINVAL); using buffered IO");
                    fds.direct_broken
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => return Err(fds.err("pread", e)),
            }
        }
    }
    let (boff, io_off, io_len, _) = slice_io(t, base, false);
    debug_assert!(boff + io_len <= seg);
    // SAFETY: as above, for the payload's own slice.
    unsafe { io::pread_full(&fds.buffered, slot.add(boff), io_len, io_off) }
        .map_err(|e| fds.err("pread", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::config::DIRECT_ALIGN;
    use crate::storage::engine::plan::{plan, Dir};
    use rand::{Rng, SeedableRng};

    #[test]
    fn segments_group_tasks_in_order() {
        assert_eq!(tasks_per_segment(32 << 20, 2 << 20), 16);
        assert_eq!(tasks_per_segment(1 << 20, 2 << 20), 1);
        assert_eq!(seg_tasks(10, 4, 0), 0..4);
        assert_eq!(seg_tasks(10, 4, 2), 8..10);
        assert_eq!(seg_tasks(10, 4, 3), 10..10);
    }

    #[test]
    fn prefix_stops_after_a_short_task() {
        let t = plan(0, 3 * 4096, 4096, Dir::Read, false);
        assert_eq!(prefix_len(&t, |_| 4096), 3 * 4096);
        assert_eq!(prefix_len(&t, |k| if k == 1 { 10 } else { 4096 }), 4106);
        assert_eq!(prefix_len(&t, |_| 0), 0);
    }

    /// Every task's IO (buffered or O_DIRECT over-read) lies inside its segment's slot, slices
    /// of one segment never overlap, direct IO is aligned in memory and file, and the
    /// payload of each segment is contiguous in the slot and in the device buffer.
    #[test]
    fn random_segment_layouts_fit_their_slots() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        for _ in 0..3000 {
            let off = rng.random_range(0..1u64 << 40);
            let len = rng.random_range(1..48 << 20);
            let piece = rng.random_range(1..=512usize) * DIRECT_ALIGN;
            let per = tasks_per_segment(rng.random_range(1..64usize << 20), piece);
            let seg = per * piece;
            let direct = rng.random();
            let tasks = plan(off, len, piece, Dir::Read, direct);
            let nsegs = tasks.len().div_ceil(per);
            for g in 0..nsegs {
                let r = seg_tasks(tasks.len(), per, g);
                let first = tasks[r.start];
                let base = align_down(first.file_off);
                let mut spans: Vec<(usize, usize)> = Vec::new();
                let mut payload = (first.file_off - base) as usize;
                let mut dev = first.buf_off;
                for t in &tasks[r] {
                    let (boff, io_off, io_len, head) = slice_io(t, base, t.direct);
                    assert!(boff + io_len <= seg, "{t:?} base {base} seg {seg}");
                    assert_eq!(boff + head, (t.file_off - base) as usize);
                    assert_eq!(boff as u64, io_off - base);
                    if t.direct {
                        assert_eq!(boff % DIRECT_ALIGN, 0);
                        assert_eq!(io_off % DIRECT_ALIGN as u64, 0);
                    }
                    let (pb, _, pl, _) = slice_io(t, base, false);
                    assert!(pb + pl <= seg);
                    assert_eq!(pb, payload, "payload not contiguous");
                    assert_eq!(t.buf_off, dev, "device range not contiguous");
                    payload += t.len;
                    dev += t.len;
                    spans.push((boff, boff + io_len));
                }
                spans.sort();
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0, "slices overlap: {spans:?}");
                }
            }
        }
    }
}

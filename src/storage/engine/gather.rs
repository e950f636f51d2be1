//! Writes from device memory in large sequential pieces: *gather writes*.
//!
//! **Plan** ([`plan`], pure): a write job's tasks (any cut of its items) are merged back into
//! *runs*, byte ranges of one file its items cover without a gap, and each run is cut into
//! *segments* of at most `seg_bytes` on a grid of multiples of `seg_bytes` in file-offset
//! space. With O_DIRECT a run's unaligned head and tail (less than a block each) are buffered
//! segments of their own and everything between them is aligned. A segment holds one task
//! per piece of an item inside it, in file order.
//!
//! **Run** ([`GatherJob::work`], per worker, two staging buffers on one stream): a segment is
//! staged whole in one pinned buffer (one device→host copy per device piece; host pieces, such
//! as a header, are copied by the CPU) and written with one `pwrite`. The copies of segment
//! `k + 1` are enqueued before segment `k` is written; a buffer is written only after its
//! copies completed (its marker) and refilled only after its write returned.
//!
//! So a safetensors save (a header and tensors back to back, none of them block-aligned) is a
//! stream of `seg_bytes` O_DIRECT writes in file order and one buffered tail, whatever the
//! tensors' sizes, instead of per-item pieces (sub-block page-cache writes and many concurrent
//! small direct ones). Why this request stream: BENCHMARKS.md, the durable save's raw-write
//! variants (section "Storage, one-shot").

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys;

use super::plan::{align_down, align_up, Task};
use super::{internal, write_task, Job, Mem};
use crate::cuda::settle::{Patience, Settled};
use crate::error::{Error, Result};
use crate::storage::config::DIRECT_ALIGN;

/// Writers of a gather write with O_DIRECT when the thread count is not set: one sequential
/// stream of [`WRITE_SEGMENT`] requests (with the copies of the next segment overlapping each
/// write, one writer keeps the disk busy).
pub(in crate::storage) const DIRECT_WRITERS: usize = 1;
/// Bytes per segment of a gather write with one or two writers (the request size BENCHMARKS.md's
/// raw-write variants favour; see the module doc).
pub(in crate::storage) const WRITE_SEGMENT: usize = 16 << 20;
/// Most staging memory (pinned) a gather write uses over all its workers: more writers get
/// smaller segments.
pub(in crate::storage) const WRITE_STAGING_MAX: usize = 256 << 20;

/// Segment size for a gather write on `threads` workers: [`WRITE_SEGMENT`], smaller when two
/// buffers per worker would pass [`WRITE_STAGING_MAX`]; a multiple of [`DIRECT_ALIGN`].
pub(in crate::storage) fn segment_bytes(threads: usize) -> usize {
    let per = WRITE_STAGING_MAX / (2 * threads.max(1));
    (per.min(WRITE_SEGMENT) / DIRECT_ALIGN).max(1) * DIRECT_ALIGN
}

/// One write of a gather job: `[off, off + len)` of job file `file`, from the tasks `tasks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::storage) struct WSeg {
    pub file: u32,
    pub off: u64,
    pub len: usize,
    /// Aligned (offset, length) and meant for O_DIRECT.
    pub direct: bool,
    pub tasks: Range<usize>,
}

/// A gather write's tasks (pieces of items, none crossing a segment) and segments.
#[derive(Debug, Clone, Default)]
pub(in crate::storage) struct WLayout {
    pub tasks: Vec<Task>,
    pub segs: Vec<WSeg>,
}

/// Plans `tasks` (a write job's, file ranges that do not overlap) into gather segments of at
/// most `seg_bytes` (a multiple of [`DIRECT_ALIGN`]); `direct`: the aligned middle of each run
/// is written with O_DIRECT (see the module docs).
pub(in crate::storage) fn plan(tasks: &[Task], seg_bytes: usize, direct: bool) -> WLayout {
    debug_assert!(seg_bytes >= DIRECT_ALIGN && seg_bytes.is_multiple_of(DIRECT_ALIGN));
    let seg = seg_bytes as u64;
    let mut order: Vec<usize> = (0..tasks.len()).filter(|&i| tasks[i].len > 0).collect();
    order.sort_by_key(|&i| (tasks[i].file, tasks[i].file_off));
    let end = |i: usize| tasks[i].file_off + tasks[i].len as u64;
    let mut out = WLayout::default();
    let mut k = 0;
    while k < order.len() {
        let file = tasks[order[k]].file;
        let a = tasks[order[k]].file_off;
        let mut b = end(order[k]);
        let mut j = k + 1;
        while j < order.len() && tasks[order[j]].file == file && tasks[order[j]].file_off <= b {
            debug_assert_eq!(tasks[order[j]].file_off, b, "overlapping write tasks");
            b = b.max(end(order[j]));
            j += 1;
        }
        let run = &order[k..j];
        let parts = if direct {
            let h = align_up(a).min(b);
            let t = align_down(b).max(h);
            [(a, h, false), (h, t, true), (t, b, false)]
        } else {
            [(a, b, false), (b, b, false), (b, b, false)]
        };
        // First task of the run that may still intersect the next segment.
        let mut p = 0usize;
        for (s0, e0, d) in parts {
            let mut s = s0;
            while s < e0 {
                let e = ((s / seg + 1) * seg).min(e0);
                let first = out.tasks.len();
                while p < run.len() && end(run[p]) <= s {
                    p += 1;
                }
                let mut q = p;
                while q < run.len() && tasks[run[q]].file_off < e {
                    let t = &tasks[run[q]];
                    let x = t.file_off.max(s);
                    let y = end(run[q]).min(e);
                    if y > x {
                        out.tasks.push(Task {
                            file,
                            buf: t.buf,
                            item: t.item,
                            file_off: x,
                            buf_off: t.buf_off + (x - t.file_off) as usize,
                            len: (y - x) as usize,
                            direct: d,
                        });
                    }
                    q += 1;
                }
                out.segs.push(WSeg {
                    file,
                    off: s,
                    len: (e - s) as usize,
                    direct: d,
                    tasks: first..out.tasks.len(),
                });
                s = e;
            }
        }
        k = j;
    }
    out
}

/// What a gather writer needs from the device side: copies from device memory into its two
/// staging buffers on one stream, and a completion marker per buffer. The CUDA one is a
/// worker's [`Lane`](super::worker::Lane); the tests use a host stand-in whose copies
/// complete late.
pub(in crate::storage) trait Stage {
    /// Enqueues a copy of `len` bytes from device address `src` to `dst`.
    ///
    /// # Safety
    /// `dst` must be writable for `len` bytes (page-locked for the copy to be asynchronous)
    /// and untouched by anyone else until the marker recorded next completes; `src` device
    /// memory readable for `len` bytes until then.
    unsafe fn d2h(&mut self, dst: *mut u8, src: sys::CUdeviceptr, len: usize) -> Result<()>;
    /// Marks staging buffer `slot` as used by the copies enqueued so far.
    fn record(&mut self, slot: usize) -> Result<()>;
    /// Waits until the copies marked for `slot` completed.
    fn wait(&mut self, slot: usize) -> Result<()>;
    /// Waits for every copy enqueued.
    fn drain(&mut self) -> Result<()>;
    /// After a failed [`drain`](Self::drain): what the copies can still do, settled with
    /// `job`'s patience ([`crate::cuda::settle::settle`]).
    fn settle(&mut self, job: &Job<'_>, patience: Patience) -> Settled;
}

impl Stage for super::worker::Lane {
    unsafe fn d2h(&mut self, dst: *mut u8, src: sys::CUdeviceptr, len: usize) -> Result<()> {
        // SAFETY: the caller's contract; the lane's stream is live in the context the worker
        // bound (Engine::run_gather).
        unsafe {
            crate::cuda::result::mem::memcpy_dtoh_async(dst, src, len, self.stream.cu_stream())
        }
    }
    fn record(&mut self, slot: usize) -> Result<()> {
        self.record_slot(slot)
    }
    fn wait(&mut self, slot: usize) -> Result<()> {
        self.wait_slot(slot)
    }
    fn drain(&mut self) -> Result<()> {
        super::worker::Lane::drain(self)
    }
    fn settle(&mut self, job: &Job<'_>, patience: Patience) -> Settled {
        // SAFETY: the lane's stream is alive (the lane owns it) in its live context.
        super::worker::Lane::settle(self, patience, |c, s| unsafe { super::query(job, c, s) })
    }
}

/// One gather write in flight: its segments (over the job's tasks, which are the layout's) and
/// the next one to take.
pub(in crate::storage) struct GatherJob {
    segs: Vec<WSeg>,
    next: AtomicUsize,
    /// Device→host copies enqueued.
    pub copies: AtomicUsize,
}

impl GatherJob {
    pub fn new(segs: Vec<WSeg>) -> Self {
        GatherJob {
            segs,
            next: AtomicUsize::new(0),
            copies: AtomicUsize::new(0),
        }
    }

    /// The next segment to write; none when every one was taken, the job aborted or its
    /// control asked it to stop (then the job counts as cut short if segments were left).
    fn next_seg(&self, job: &Job<'_>) -> Option<usize> {
        if job.aborted() {
            return None;
        }
        if job.cancel_requested() {
            if self.next.load(Ordering::Relaxed) < self.segs.len() {
                job.cut_short();
            }
            return None;
        }
        let g = self.next.fetch_add(1, Ordering::Relaxed);
        (g < self.segs.len()).then_some(g)
    }

    /// Copies segment `g`'s pieces into `buf` (device pieces enqueued on `stage`).
    fn stage_seg(
        &self,
        job: &Job<'_>,
        stage: &mut dyn Stage,
        buf: *mut u8,
        g: usize,
    ) -> Result<()> {
        let seg = &self.segs[g];
        for t in &job.tasks[seg.tasks.clone()] {
            let at = (t.file_off - seg.off) as usize;
            debug_assert!(at + t.len <= seg.len);
            // SAFETY: at + len <= seg.len <= the staging buffer's bytes (Engine::run_gather
            // sizes both buffers for the largest segment).
            let dst = unsafe { buf.add(at) };
            match job.bufs[t.buf as usize] {
                Mem::Dev(p) => {
                    // SAFETY: dst..dst+len is this worker's pinned staging buffer, not read
                    // (written to the file) before the marker recorded after this segment's
                    // copies completes and not refilled before that write returned; the source
                    // lies inside the task's item range of a caller's device buffer (Job::batch
                    // contract).
                    unsafe { stage.d2h(dst, p + t.buf_off as u64, t.len) }?;
                    self.copies.fetch_add(1, Ordering::Relaxed);
                }
                Mem::Host(p) => {
                    // SAFETY: the caller's host buffer holds the task's range (Job::batch
                    // contract); dst holds len bytes of our staging buffer, disjoint from it.
                    unsafe { std::ptr::copy_nonoverlapping(p.add(t.buf_off), dst, t.len) };
                }
                Mem::Deferred(_) => return Err(internal("a deferred buffer in a write")),
            }
        }
        Ok(())
    }

    /// Writes segment `g` from `buf` (staged and its copies complete). An IO error fails the
    /// items in it (every one of them: they were written in one piece); other errors are
    /// returned (they fail the job).
    fn write_seg(&self, job: &Job<'_>, buf: *const u8, g: usize, w: usize) -> Result<()> {
        let seg = &self.segs[g];
        let whole = Task {
            file: seg.file,
            file_off: seg.off,
            len: seg.len,
            direct: seg.direct,
            ..Task::default()
        };
        let t0 = job.t_now();
        let r = write_task(job, &whole, buf);
        if let Some(tr) = job.trace() {
            tr.io(w, seg.tasks.start, t0);
        }
        match r {
            Ok(()) => {
                for i in seg.tasks.clone() {
                    job.finish(i, job.tasks[i].len);
                }
                Ok(())
            }
            Err(e) => {
                let (kind, text) = match &e {
                    Error::Io { source, .. } => (source.kind(), e.to_string()),
                    _ => return Err(e),
                };
                let mut first = Some(e);
                for i in seg.tasks.clone() {
                    let item = job.tasks[i].item;
                    let err = first.take().unwrap_or_else(|| {
                        job.file_err(
                            &whole,
                            "pwrite",
                            std::io::Error::new(
                                kind,
                                format!(
                                    "written in one piece with another item, which failed: {text}"
                                ),
                            ),
                        )
                    });
                    job.fail_item(item, err)?;
                }
                Ok(())
            }
        }
    }

    /// Worker `w`'s loop over segments, staging through `bufs` (two buffers of at least the
    /// largest segment, page-locked when `stage` copies from a GPU). Every copy it enqueued
    /// has completed when this returns (also on error), or its context is dead: a drain that
    /// fails is settled and fails the job (`Job::drained`). The job's cancel flag is looked at
    /// before each segment is staged and again before each staged one is written: a cancel
    /// stops the job between two writes (a staged segment is dropped, not written).
    pub fn work(
        &self,
        job: &Job<'_>,
        stage: &mut dyn Stage,
        bufs: [*mut u8; 2],
        w: usize,
    ) -> Result<()> {
        let mut pending: Option<(usize, usize)> = None;
        let mut s = 0usize;
        let r = (|| -> Result<()> {
            loop {
                let g = self.next_seg(job);
                if let Some(g) = g {
                    // Buffer `s` last held the segment written two rounds ago (that write
                    // returned): free.
                    self.stage_seg(job, stage, bufs[s], g)?;
                    stage.record(s)?;
                }
                if let Some((ps, pg)) = pending.take() {
                    let t0 = job.t_now();
                    stage.wait(ps)?;
                    if let Some(tr) = job.trace() {
                        tr.waited(w, t0);
                    }
                    // Staged is not written: a cancel asked for since stops here, between
                    // two writes (each worker stages one segment ahead, so on few segments
                    // every one is taken before the first write returns).
                    if job.cancel_requested() {
                        job.cut_short();
                    } else {
                        self.write_seg(job, bufs[ps], pg, w)?;
                    }
                }
                match g {
                    Some(g) => {
                        pending = Some((s, g));
                        s ^= 1;
                    }
                    None => return Ok(()),
                }
            }
        })();
        // A failed drain fails the job whatever `r` is (its error wins: Job::fail_drain), once
        // the copies were settled: the sources are the caller's borrowed device memory.
        let d = stage.drain();
        job.drained(d, |p| stage.settle(job, p));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::engine::plan::{plan_item, Dir};
    use rand::{Rng, RngCore, SeedableRng};

    /// Items as (file, file offset, length), planned like the batch plans them.
    fn tasks_of(items: &[(u32, u64, usize)], piece: usize, direct: bool) -> Vec<Task> {
        let mut t = Vec::new();
        for (k, &(file, off, len)) in items.iter().enumerate() {
            let at = Task {
                file,
                buf: k as u32 % 3,
                item: k as u32,
                buf_off: 1000 * k,
                ..Task::default()
            };
            plan_item(&mut t, at, off, len, piece, Dir::Write, direct);
        }
        t
    }

    type Span = (u32, u64, u32, u32, usize, usize);

    /// Tasks as maximal intervals (file, file offset, item, buffer, buffer offset, length).
    fn merged(mut v: Vec<Task>) -> Vec<Span> {
        v.retain(|t| t.len > 0);
        v.sort_by_key(|t| (t.file, t.file_off));
        let mut out: Vec<Span> = Vec::new();
        for t in v {
            match out.last_mut() {
                Some(y)
                    if (y.0, y.2, y.3) == (t.file, t.item, t.buf)
                        && y.1 + y.5 as u64 == t.file_off
                        && y.4 + y.5 == t.buf_off =>
                {
                    y.5 += t.len
                }
                _ => out.push((t.file, t.file_off, t.item, t.buf, t.buf_off, t.len)),
            }
        }
        out
    }

    /// Every invariant of a gather layout against the tasks it came from.
    fn check(tasks: &[Task], seg: usize, direct: bool) -> WLayout {
        let l = plan(tasks, seg, direct);
        // The same bytes, each from the same place: (file, file offset, item, buffer, buffer
        // offset, length) intervals, merged where contiguous, equal on both sides.
        let mut got = Vec::new();
        let mut covered = 0usize;
        for (g, s) in l.segs.iter().enumerate() {
            assert!(s.len > 0 && s.len <= seg, "segment {g}: {s:?}");
            if s.direct {
                assert!(
                    s.off.is_multiple_of(DIRECT_ALIGN as u64) && s.len.is_multiple_of(DIRECT_ALIGN),
                    "direct segment not aligned: {s:?}"
                );
            }
            // No segment crosses a grid line.
            assert_eq!(
                s.off / seg as u64,
                (s.off + s.len as u64 - 1) / seg as u64,
                "{s:?}"
            );
            // Its tasks tile it exactly, in file order.
            let mut at = s.off;
            for t in &l.tasks[s.tasks.clone()] {
                assert_eq!(
                    (t.file, t.file_off, t.direct),
                    (s.file, at, s.direct),
                    "{s:?}"
                );
                at += t.len as u64;
                got.push(*t);
            }
            assert_eq!(at, s.off + s.len as u64, "tasks do not fill {s:?}");
            covered += s.len;
        }
        assert_eq!(
            covered,
            tasks.iter().map(|t| t.len).sum::<usize>(),
            "bytes written twice or not at all"
        );
        assert!(
            merged(tasks.to_vec()) == merged(got),
            "the layout moves other bytes than the tasks"
        );
        // Every task belongs to exactly one segment, segments in order.
        let mut next = 0;
        for s in &l.segs {
            assert_eq!(s.tasks.start, next);
            next = s.tasks.end;
        }
        assert_eq!(next, l.tasks.len());
        l
    }

    #[test]
    fn a_checkpoint_is_written_in_whole_aligned_segments_and_one_tail() {
        // A header of 8 + 4096 + 77 bytes, then 320 tensors of odd sizes back to back.
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut items = vec![(0u32, 0u64, 8 + 4096 + 77)];
        let mut off = items[0].2 as u64;
        for _ in 0..320 {
            let len = rng.random_range(1..(27 << 20));
            items.push((0, off, len));
            off += len as u64;
        }
        let seg = 16 << 20;
        let l = check(&tasks_of(&items, 2 << 20, true), seg, true);
        let direct: Vec<&WSeg> = l.segs.iter().filter(|s| s.direct).collect();
        assert_eq!(
            direct.len() as u64,
            (off / 4096 * 4096).div_ceil(seg as u64)
        );
        assert!(direct[..direct.len() - 1].iter().all(|s| s.len == seg));
        let buffered: Vec<&WSeg> = l.segs.iter().filter(|s| !s.direct).collect();
        assert_eq!(
            buffered.len(),
            usize::from(!off.is_multiple_of(4096)),
            "{buffered:?}"
        );
    }

    #[test]
    fn gaps_files_and_buffered_writes_keep_every_invariant() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(10);
        for _ in 0..300 {
            let seg = rng.random_range(1..=8usize) * DIRECT_ALIGN;
            let piece = rng.random_range(1..=4usize) * DIRECT_ALIGN;
            let mut items = Vec::new();
            for f in 0..rng.random_range(1..4u32) {
                let mut off = rng.random_range(0..20_000u64);
                for _ in 0..rng.random_range(1..12) {
                    let len = rng.random_range(1..40_000usize);
                    items.push((f, off, len));
                    off += len as u64;
                    if rng.random_bool(0.3) {
                        off += rng.random_range(1..9000);
                    }
                }
            }
            let direct = rng.random();
            check(&tasks_of(&items, piece, direct), seg, direct);
        }
    }

    /// A stand-in for a CUDA stream: "device" memory is host memory, copies run late (random
    /// delays) and in order on a thread of their own; a marker completes after the copies
    /// before it.
    struct LateStage {
        tx: std::sync::mpsc::Sender<Cmd>,
        /// Per slot: (markers recorded, markers completed).
        marks: std::sync::Arc<Marks>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    /// Per slot: (markers recorded, markers completed), and its condition variable.
    type Marks = (std::sync::Mutex<[(u64, u64); 2]>, std::sync::Condvar);

    enum Cmd {
        Copy(usize, usize, usize),
        Mark(usize, u64),
    }

    impl LateStage {
        fn new(seed: u64) -> Self {
            let (tx, rx) = std::sync::mpsc::channel::<Cmd>();
            let marks = std::sync::Arc::new((
                std::sync::Mutex::new([(0u64, 0u64); 2]),
                std::sync::Condvar::new(),
            ));
            let m = marks.clone();
            let thread = std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                for c in rx {
                    match c {
                        Cmd::Copy(dst, src, len) => {
                            std::thread::sleep(std::time::Duration::from_micros(
                                rng.random_range(0..300),
                            ));
                            // SAFETY: (test) checked live by the protocol under test (the
                            // staging buffer and the source outlive the drained stage).
                            unsafe {
                                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len)
                            };
                        }
                        Cmd::Mark(slot, n) => {
                            let mut g = m.0.lock().unwrap();
                            g[slot].1 = g[slot].1.max(n);
                            m.1.notify_all();
                        }
                    }
                }
            });
            LateStage {
                tx,
                marks,
                thread: Some(thread),
            }
        }
    }

    impl Drop for LateStage {
        fn drop(&mut self) {
            let (tx, _) = std::sync::mpsc::channel();
            drop(std::mem::replace(&mut self.tx, tx));
            self.thread.take().unwrap().join().unwrap();
        }
    }

    impl Stage for LateStage {
        unsafe fn d2h(&mut self, dst: *mut u8, src: sys::CUdeviceptr, len: usize) -> Result<()> {
            self.tx
                .send(Cmd::Copy(dst as usize, src as usize, len))
                .unwrap();
            Ok(())
        }
        fn record(&mut self, slot: usize) -> Result<()> {
            let n = {
                let mut g = self.marks.0.lock().unwrap();
                g[slot].0 += 1;
                g[slot].0
            };
            self.tx.send(Cmd::Mark(slot, n)).unwrap();
            Ok(())
        }
        fn wait(&mut self, slot: usize) -> Result<()> {
            let mut g = self.marks.0.lock().unwrap();
            let want = g[slot].0;
            while g[slot].1 < want {
                g = self.marks.1.wait(g).unwrap();
            }
            Ok(())
        }
        fn drain(&mut self) -> Result<()> {
            for slot in 0..2 {
                self.record(slot)?;
                self.wait(slot)?;
            }
            Ok(())
        }
        fn settle(&mut self, _: &Job<'_>, _: Patience) -> Settled {
            // Its drain never fails.
            Settled::Complete
        }
    }

    /// A [`LateStage`] whose drain reports `CUDA_ERROR_UNKNOWN` after draining for real, whose
    /// settle then finds the context dead, and that records the patience it is settled with.
    struct DrainFails {
        inner: LateStage,
        settled_with: Option<Patience>,
    }

    impl Stage for DrainFails {
        unsafe fn d2h(&mut self, dst: *mut u8, src: sys::CUdeviceptr, len: usize) -> Result<()> {
            // SAFETY: the caller's contract.
            unsafe { self.inner.d2h(dst, src, len) }
        }
        fn record(&mut self, slot: usize) -> Result<()> {
            self.inner.record(slot)
        }
        fn wait(&mut self, slot: usize) -> Result<()> {
            self.inner.wait(slot)
        }
        fn drain(&mut self) -> Result<()> {
            self.inner.drain()?;
            Err(Error::cuda(
                "cuStreamSynchronize",
                cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN),
            ))
        }
        fn settle(&mut self, _: &Job<'_>, patience: Patience) -> Settled {
            self.settled_with = Some(patience);
            // A drain whose copies were found complete replaces no error (drain review 5):
            // a dead context does.
            Settled::Dead(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED)
        }
    }

    /// Review (drain, finding 1, on the gather writer): a worker whose staging failed with an
    /// Io-kind error after it had enqueued a copy, and whose stage then could not drain (its
    /// context found dead), fails the job with the drain's CUDA error, not the earlier Io one,
    /// after settling the copies with [`Patience::Wait`] (the sources are the caller's
    /// borrowed device memory). Before
    /// the fix, `r.and(d)` dropped the drain's error: the job reported the Io error, and no
    /// one waited for the copies.
    #[test]
    fn a_drain_that_fails_after_an_earlier_error_fails_the_gather_job_after_waiting() {
        use crate::storage::engine::io::{Fds, OpenMode};
        use crate::storage::engine::{Job, Op};
        let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("gpudirect-gather-drain-{}", std::process::id()));
        let fds = Fds::open(
            &path,
            OpenMode {
                write: true,
                create: true,
                truncate: true,
            },
        )
        .unwrap();
        let mut dev = vec![0u8; 3 * DIRECT_ALIGN];
        rand::rngs::StdRng::seed_from_u64(14).fill_bytes(&mut dev);
        // Item 0 from "device" memory, then item 1 from a deferred buffer (refused, an Io-kind
        // error) in the same segment: the first copy is enqueued before the error.
        let mut tasks = Vec::new();
        for (k, (buf, off)) in [(0u32, 0u64), (1, DIRECT_ALIGN as u64)]
            .into_iter()
            .enumerate()
        {
            let at = Task {
                buf,
                item: k as u32,
                ..Task::default()
            };
            plan_item(&mut tasks, at, off, DIRECT_ALIGN, 8192, Dir::Write, false);
        }
        let seg = 4 * DIRECT_ALIGN;
        let l = plan(&tasks, seg, false);
        assert_eq!(l.segs.len(), 1);
        // SAFETY: (test) `dev` outlives the job and holds item 0's range; the deferred buffer
        // is never addressed (staging it fails); a write job only reads.
        let job = unsafe {
            Job::batch(
                vec![&fds],
                vec![Mem::Dev(dev.as_ptr() as sys::CUdeviceptr), Mem::Deferred(0)],
                2,
                l.tasks.clone(),
                8192,
                Op::Write,
                None,
            )
        };
        let gj = GatherJob::new(l.segs.clone());
        let mut stage = DrainFails {
            inner: LateStage::new(15),
            settled_with: None,
        };
        let layout = std::alloc::Layout::from_size_align(seg, DIRECT_ALIGN).unwrap();
        // SAFETY: (test) non-zero sizes; freed below, after the stage drained.
        let bufs = unsafe { [std::alloc::alloc(layout), std::alloc::alloc(layout)] };
        let r = gj.work(&job, &mut stage, bufs, 0);
        drop(stage.inner);
        // SAFETY: (test) allocated above with this layout; the stage is drained and gone.
        unsafe {
            std::alloc::dealloc(bufs[0], layout);
            std::alloc::dealloc(bufs[1], layout);
        }
        assert!(
            matches!(&r, Err(Error::Io { .. })),
            "the worker's own error is its staging's: {r:?}"
        );
        if let Err(e) = r {
            job.fail(e);
        }
        assert_eq!(
            gj.copies.load(Ordering::Relaxed),
            1,
            "item 0's copy was enqueued"
        );
        let f = job.outcome(1).expect_err("the job failed");
        assert!(
            matches!(
                &f.error,
                Error::Cuda {
                    op: "cuStreamSynchronize",
                    ..
                }
            ),
            "the drain's error must win: {}",
            f.error
        );
        assert!(f.drained, "settled dead: no copy runs any more");
        assert_eq!(
            stage.settled_with,
            Some(Patience::Wait),
            "a job that borrows its sources waits for copies it could not drain"
        );
        drop(fds);
        std::fs::remove_file(&path).unwrap();
    }

    /// The run's ordering rules on the host: copies into the staging buffers complete late,
    /// yet every byte of every item (device pieces and host ones, e.g. a header) reaches its
    /// place in the file, on several writers, with and without O_DIRECT; a write that read a
    /// buffer before its copies completed, or a buffer refilled before its write returned,
    /// would put other bytes there.
    /// Runs `gj` on `writers` threads, each with a [`LateStage`] (seeded `seed + w`) and two
    /// `seg`-byte aligned buffers, freed after its stage drained.
    fn run_writers(job: &Job<'_>, gj: &GatherJob, writers: usize, seg: usize, seed: u64) {
        std::thread::scope(|sc| {
            for w in 0..writers {
                sc.spawn(move || {
                    let mut stage = LateStage::new(w as u64 + seed);
                    let layout = std::alloc::Layout::from_size_align(seg, DIRECT_ALIGN).unwrap();
                    // SAFETY: (test) non-zero sizes; freed below, after the stage drained.
                    let bufs = unsafe { [std::alloc::alloc(layout), std::alloc::alloc(layout)] };
                    gj.work(job, &mut stage, bufs, w).unwrap();
                    drop(stage);
                    // SAFETY: (test) allocated above with this layout; no copy is queued.
                    unsafe {
                        std::alloc::dealloc(bufs[0], layout);
                        std::alloc::dealloc(bufs[1], layout);
                    }
                });
            }
        });
    }

    #[test]
    fn late_copies_never_reach_the_file_early_and_every_byte_lands() {
        use crate::storage::engine::io::{Fds, OpenMode};
        use crate::storage::engine::{Job, Op};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        for round in 0..16 {
            let seg = rng.random_range(1..=6usize) * DIRECT_ALIGN;
            let direct = round % 2 == 0;
            // "Device" memory and a host buffer (the header, say).
            let mut dev = vec![0u8; 400_000];
            rng.fill_bytes(&mut dev);
            let mut host = vec![0u8; 20_000];
            rng.fill_bytes(&mut host);
            let mut items: Vec<(u32, usize, u64, usize)> = Vec::new(); // (buf, buf_off, file_off, len)
            let (mut doff, mut hoff, mut foff) = (0usize, 0usize, rng.random_range(0..9000u64));
            for _ in 0..rng.random_range(1..30) {
                let len = rng.random_range(1..12_000usize);
                if rng.random_bool(0.15) && hoff + len <= host.len() {
                    items.push((1, hoff, foff, len));
                    hoff += len;
                } else if doff + len <= dev.len() {
                    items.push((0, doff, foff, len));
                    doff += len + rng.random_range(0..100);
                }
                foff += len as u64;
                if rng.random_bool(0.2) {
                    foff += rng.random_range(1..5000);
                }
            }
            let mut tasks = Vec::new();
            for (k, &(buf, buf_off, off, len)) in items.iter().enumerate() {
                let at = Task {
                    buf,
                    item: k as u32,
                    buf_off,
                    ..Task::default()
                };
                plan_item(&mut tasks, at, off, len, 8192, Dir::Write, direct);
            }
            let l = plan(&tasks, seg, direct);
            let path = dir.join(format!(
                "gpudirect-gather-{}-{round}-{:x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            let fds = Fds::open(
                &path,
                OpenMode {
                    write: true,
                    create: true,
                    truncate: true,
                },
            )
            .unwrap();
            // SAFETY: (test) `dev` and `host` outlive the job and hold every task's range; a
            // write job only reads them.
            let job = unsafe {
                Job::batch(
                    vec![&fds],
                    vec![
                        Mem::Dev(dev.as_ptr() as sys::CUdeviceptr),
                        Mem::Host(host.as_mut_ptr()),
                    ],
                    items.len(),
                    l.tasks.clone(),
                    8192,
                    Op::Write,
                    None,
                )
            };
            let gj = GatherJob::new(l.segs.clone());
            let writers = rng.random_range(1..4usize);
            run_writers(&job, &gj, writers, seg, 100 * round as u64);
            let out = job.outcome(gj.copies.load(Ordering::Relaxed)).unwrap();
            assert!(
                out.items.iter().all(|i| i.complete && i.error.is_none()),
                "round {round}"
            );
            let file = std::fs::read(&path).unwrap();
            for (k, &(buf, buf_off, off, len)) in items.iter().enumerate() {
                let src = if buf == 0 { &dev[..] } else { &host[..] };
                let (off, end) = (off as usize, off as usize + len);
                assert!(
                    file.len() >= end && file[off..end] == src[buf_off..buf_off + len],
                    "item {k} differs in the file (round {round}, segments of {seg}, direct {direct}, {writers} writers)"
                );
            }
            drop(fds);
            std::fs::remove_file(&path).unwrap();
        }
    }

    /// Cancellation between writes: a write job cancelled when its first segment was written
    /// stops before the next write, on one writer and on several, with every segment already
    /// taken (each worker stages one ahead: 1 writer and 2 segments, 4 writers and 8). The
    /// outcome says cancelled, counts exactly the bytes that reached the file (they are the
    /// only ones that changed) and leaves at least one segment unwritten. Before the fix the
    /// staged segments were written after the cancel: 1 writer on 2 segments returned the
    /// whole job, not cancelled (gpu-run-3's gpu_transfer_cancelled_write_reports_what_moved).
    #[test]
    fn a_cancelled_gather_write_stops_between_writes_and_counts_what_reached_the_file() {
        use crate::storage::engine::io::{Fds, OpenMode};
        use crate::storage::engine::{Control, Job, Op};
        use std::sync::atomic::AtomicBool;
        let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for (writers, segs, direct) in [
            (1usize, 2usize, true),
            (1, 2, false),
            (1, 6, true),
            (4, 8, true),
            (3, 8, false),
        ] {
            let seg = 4 * DIRECT_ALIGN;
            let total = segs * seg;
            let mut dev = vec![0u8; total];
            rng.fill_bytes(&mut dev);
            let old: Vec<u8> = dev.iter().map(|b| !b).collect();
            let path = dir.join(format!(
                "gpudirect-gather-cancel-{}-{writers}-{segs}-{:x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::write(&path, &old).unwrap();
            let fds = Fds::open(
                &path,
                OpenMode {
                    write: true,
                    create: false,
                    truncate: false,
                },
            )
            .unwrap();
            let mut tasks = Vec::new();
            plan_item(
                &mut tasks,
                Task::default(),
                0,
                total,
                DIRECT_ALIGN,
                Dir::Write,
                direct,
            );
            let l = plan(&tasks, seg, direct);
            assert_eq!(l.segs.len(), segs);
            // Cancel as soon as the first bytes reach the file (TransferControl::add's rule).
            let cancel = AtomicBool::new(false);
            let on_piece = |_n: usize| cancel.store(true, Ordering::Relaxed);
            // SAFETY: (test) `dev` outlives the job and holds every task's range; a write job
            // only reads it.
            let job = unsafe {
                Job::batch(
                    vec![&fds],
                    vec![Mem::Dev(dev.as_ptr() as sys::CUdeviceptr)],
                    1,
                    l.tasks.clone(),
                    DIRECT_ALIGN,
                    Op::Write,
                    None,
                )
            }
            .with_control(Control {
                after: &[],
                cancel: Some(&cancel),
                on_piece: Some(&on_piece),
            });
            let gj = GatherJob::new(l.segs.clone());
            run_writers(&job, &gj, writers, seg, 7);
            let out = job.outcome(gj.copies.load(Ordering::Relaxed)).unwrap();
            let case = format!("{writers} writers, {segs} segments, direct {direct}");
            let it = &out.items[0];
            assert!(
                out.cancelled && !it.complete && it.error.is_none(),
                "{case}: a write cancelled after its first segment ran to the end: {out:?}"
            );
            assert!(
                (seg..total).contains(&it.moved) && it.moved % seg == 0,
                "{case}: moved {}",
                it.moved
            );
            assert!(
                it.moved <= writers * seg,
                "{case}: {} bytes written after a cancel that came after the first segment",
                it.moved
            );
            let file = std::fs::read(&path).unwrap();
            assert_eq!(file.len(), total);
            let changed = file.iter().zip(&old).filter(|(a, b)| a != b).count();
            let new = file.iter().zip(&dev).filter(|(a, b)| a == b).count();
            assert_eq!(
                (changed, new),
                (it.moved, it.moved),
                "{case}: the file's changed bytes are not the bytes reported moved"
            );
            drop(fds);
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn segment_sizes_bound_the_staging_memory() {
        assert_eq!(segment_bytes(1), WRITE_SEGMENT);
        assert_eq!(segment_bytes(8), WRITE_SEGMENT);
        assert_eq!(segment_bytes(32), 4 << 20);
        assert!(segment_bytes(1 << 20) >= DIRECT_ALIGN);
        for n in [1, 3, 7, 32, 100, 1024] {
            assert!(segment_bytes(n).is_multiple_of(DIRECT_ALIGN));
            assert!(2 * n * segment_bytes(n) <= WRITE_STAGING_MAX.max(2 * n * DIRECT_ALIGN));
        }
    }
}

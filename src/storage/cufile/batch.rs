//! Batch IO (`cuFileBatchIOSetUp` / `Submit` / `GetStatus` / `Cancel` / `Destroy`).
//!
//! [`BatchIo::run`] is the safe form: it submits, waits for every completion (cancelling on
//! error or timeout) and returns only when nothing of the batch is in flight, so nothing the
//! device touches outlives the borrow. [`BatchIo::submit`] + [`BatchIo::poll`] is the
//! overlapping form and is `unsafe`: the caller keeps buffers and handles alive until their
//! completions are reaped (or a [`BatchIo::cancel`] returned `Ok`).
//!
//! # What a cancel guarantees
//!
//! cuFile's API reference says only that `cuFileBatchIOCancel` cancels the batch's operations.
//! What it does, in libcufile 1.15 (the one the GPU machine runs, read in its code): for each
//! IO engine it cancels what has not started and *waits inside the call* for what has (the
//! io_uring engine polls the pending operations for up to 30 s, the mixed engine up to 5 s,
//! the aio/P2PDMA engine cancels and reaps with `io_getevents`), frees the batch's work items
//! and sets the batch idle; then it returns `CU_FILE_SUCCESS`, or
//! `CU_FILE_INTERNAL_BATCH_CANCEL_ERROR` (5042, "retry later") when an engine could not cancel.
//! The operations it ended are **never reported** by `cuFileBatchIOGetStatus` afterwards (a
//! batch that waited for them forever hung the GPU suite), and NVIDIA's own sample
//! (`NVIDIA/MagnumIO: gds/samples/3_cuFile_Batch/batch_cancel.cc`) treats a successful cancel as
//! the end of the batch's IO: it expects "Got events: 0" from `GetStatus` after it and frees the
//! buffers. So gpudirect does the same: after a successful cancel every operation not reported
//! yet is over, and gets a completion with status `CUFILE_CANCELED` (its destination's bytes are
//! unspecified). A cancel that fails leaves the operations running: gpudirect then waits for
//! their own completions and retries the cancel, and if
//! neither ends them within 30 s it aborts the process with a message — returning would release buffers the
//! device may still write, and waiting without bound is a hang.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cufile_sys as sys;

use super::buffer::allocation_range;
use super::file_handle::{clamp_to_eof, protected_tail, HandleInner, Scratch, READ_OVERRUN};
use super::status::IoReturn;
use super::{result, CuFileHandle, Driver};
use crate::error::{Error, Result};

/// One operation of a batch: read into or write from a device view, at a file offset.
#[derive(Debug)]
pub enum BatchOp<'a> {
    /// Read `dst.len()` bytes at `file_offset` into `dst`, stopping at end of file as it is at
    /// submission (bytes of `dst` past it are not written; a read at or past it completes at
    /// once with 0 bytes). No byte outside `dst` is written either: as for
    /// [`CuFileHandle::read`], the read's last bytes (up to 68 KiB) go through a scratch device
    /// buffer (allocated at submission on `dst`'s stream), which takes a second of cuFile's
    /// entries, and are copied into place on `dst`'s stream when the operation's completion is
    /// collected ([`BatchIo::poll`], [`BatchIo::run`]); the rest is read in place.
    Read {
        /// The file.
        handle: &'a CuFileHandle,
        /// The destination.
        dst: CudaViewMut<'a, u8>,
        /// Offset in the file.
        file_offset: u64,
    },
    /// Write `src` at `file_offset`.
    Write {
        /// The file.
        handle: &'a CuFileHandle,
        /// The source.
        src: CudaView<'a, u8>,
        /// Offset in the file.
        file_offset: u64,
    },
}

/// The outcome of one batch operation (`CUfileIOEvents_t`), in submission order for
/// [`BatchIo::run`].
#[derive(Debug)]
pub struct BatchCompletion {
    /// The submission the operation belongs to: the number [`BatchIo::submit`] returned.
    pub submission: u64,
    /// Index of the operation in its submitted slice.
    pub index: usize,
    /// Raw `CUfileStatus_t` (`CUFILE_COMPLETE` = 0x10, `CUFILE_CANCELED` = 0x8,
    /// `CUFILE_FAILED` = 0x40, ...). An operation ended by a successful [`BatchIo::cancel`]
    /// before cuFile reported it has `CUFILE_CANCELED`.
    pub status: u32,
    /// Bytes moved, or the decoded error.
    pub result: Result<usize>,
}

/// A batch context of fixed capacity (`cuFileBatchIOSetUp`), destroyed on drop
/// (`cuFileBatchIODestroy`, after cancelling anything in flight).
pub struct BatchIo {
    handle: sys::CUfileBatchHandle_t,
    capacity: u32,
    /// The cookies of the cuFile entries submitted and neither reported nor ended by a cancel
    /// (one or two per operation, see [`cookie`]). A completion whose cookie is not here is not
    /// counted (see `get_status`).
    outstanding: HashSet<usize>,
    /// The operations with entries in `outstanding`, by `(submission, index)`: what their
    /// entries reported so far, and where a read's scratch bytes go.
    ops: HashMap<(u64, usize), Pending>,
    /// The number the next submission gets; part of every cookie (see [`cookie`]).
    next_submission: u64,
    /// Completions not handed out yet: reads that start at or past end of file (never
    /// submitted, nothing to move), those a cancel collected or ended; the next
    /// [`poll`](Self::poll) returns them.
    ready: Vec<BatchCompletion>,
    // Registrations used by in-flight operations stay alive until nothing is in flight.
    holds: Vec<Arc<HandleInner>>,
    driver: Arc<Driver>,
}

impl std::fmt::Debug for BatchIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchIo")
            .field("capacity", &self.capacity)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

// SAFETY: the batch handle is an opaque cuFile context, and cuFile's API reference states that
// all cuFile APIs are thread-safe, so it may be polled, cancelled and destroyed from another
// thread than the one that set it up. `BatchIo` is not `Sync`: every state change takes
// `&mut self`. Moving it with operations in flight moves their registrations (`holds`) with it,
// and its Drop cancels them on whichever thread runs it (or aborts, see `cancel_and_drain`);
// `mem::forget` leaks the context and registrations with the IO still running, which `run`
// never allows (it returns only with nothing in flight) and `submit`'s contract covers.
unsafe impl Send for BatchIo {}

impl BatchIo {
    /// Creates a batch context for up to `capacity` operations in flight
    /// (`cuFileBatchIOSetUp` of `2 * capacity` entries: a read takes up to two, see
    /// [`BatchOp::Read`]); `2 * capacity` must be within the driver's `max_batch_io_size`.
    pub fn new(driver: Arc<Driver>, capacity: u32) -> Result<Self> {
        let max = driver.properties().max_batch_io_size();
        let entries = capacity.saturating_mul(ENTRIES_PER_OP);
        if capacity == 0 || (max > 0 && entries > max) || capacity as usize > MAX_INDEX {
            return Err(Error::InvalidArgument(format!(
                "batch capacity {capacity} is outside 1..={} (half the driver's \
                 max_batch_io_size {max}: a read takes up to two of cuFile's entries, its last \
                 bytes going through a scratch buffer)",
                max / ENTRIES_PER_OP
            )));
        }
        let handle = result::batch_setup(driver.lib(), entries)?;
        Ok(BatchIo {
            handle,
            capacity,
            outstanding: HashSet::new(),
            ops: HashMap::new(),
            next_submission: 0,
            ready: Vec::new(),
            holds: Vec::new(),
            driver,
        })
    }

    /// Creates a batch context of the driver's maximum capacity: half its `max_batch_io_size`
    /// (see [`new`](Self::new)).
    pub fn with_max_capacity(driver: Arc<Driver>) -> Result<Self> {
        let cap = (driver.properties().max_batch_io_size() / ENTRIES_PER_OP).max(1);
        Self::new(driver, cap)
    }

    /// The capacity given at setup (operations).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Operations submitted and not yet reaped by [`poll`](Self::poll) (including reads that
    /// start at end of file, which complete at once with 0 bytes, and operations a cancel
    /// ended, whose completions the next poll hands out).
    pub fn in_flight(&self) -> usize {
        self.ops.len() + self.ready.len()
    }

    /// Submits `ops`, waits for all of them (each poll waits up to `timeout`; the whole run
    /// fails after `timeout` without progress) and returns their completions in order.
    ///
    /// Synchronous and safe: on any error or timeout the batch is cancelled before returning,
    /// and `run` returns (`Ok` or `Err`) only when no operation can still touch a buffer (see
    /// the module's "What a cancel guarantees": a cancel that cuFile refuses for
    /// 30 s while the operations do not finish aborts the process with a message). Each view's stream is synchronised before submission. Refused
    /// ([`Error::InvalidArgument`], nothing submitted) while operations of an earlier
    /// [`submit`](Self::submit) are in flight: reap them with [`poll`](Self::poll); and
    /// ([`Error::Unsupported`], nothing enqueued or submitted) when a view's stream is capturing
    /// a CUDA graph.
    pub fn run(
        &mut self,
        ops: &mut [BatchOp<'_>],
        timeout: Duration,
    ) -> Result<Vec<BatchCompletion>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        if self.in_flight() > 0 {
            // Waiting for "everything in flight" would take the earlier submission's
            // completions; refuse before submitting anything.
            return Err(Error::InvalidArgument(format!(
                "{} operations of an earlier BatchIo::submit are still in flight: reap them with \
                 poll before calling run",
                self.in_flight()
            )));
        }
        // SAFETY: every buffer and handle is borrowed by `ops` for this call, and this call
        // does not return before every operation has completed or been ended by a successful
        // cancel (or the process aborts, see `cancel_and_drain`).
        let mine = unsafe { self.submit_as(ops, "BatchIo::run") }?;
        let mut done: Vec<Option<BatchCompletion>> = (0..ops.len()).map(|_| None).collect();
        let take = |done: &mut Vec<Option<BatchCompletion>>, got: Vec<BatchCompletion>| {
            for c in got {
                let i = c.index;
                if c.submission == mine && i < done.len() {
                    done[i] = Some(c);
                }
            }
        };
        take(&mut done, std::mem::take(&mut self.ready));
        let mut last_progress = Instant::now();
        while !self.outstanding.is_empty() {
            match self.get_status(1, Some(timeout)) {
                Ok(got) => {
                    if got.is_empty() && last_progress.elapsed() >= timeout {
                        self.cancel_and_drain();
                        self.ready.clear();
                        return Err(Error::Io {
                            op: "cuFileBatchIOGetStatus",
                            path: None,
                            source: std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                format!("no batch completion within {timeout:?}; the batch was cancelled"),
                            ),
                        });
                    }
                    if !got.is_empty() {
                        last_progress = Instant::now();
                    }
                    take(&mut done, got);
                }
                Err(e) => {
                    self.cancel_and_drain();
                    self.ready.clear();
                    return Err(e);
                }
            }
        }
        Ok(done
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                c.unwrap_or(BatchCompletion {
                    submission: mine,
                    index,
                    status: 0,
                    result: Err(Error::InvalidArgument(format!(
                        "batch operation {index} produced no completion"
                    ))),
                })
            })
            .collect())
    }

    /// Submits `ops` (`cuFileBatchIOSubmit`) without waiting and returns the submission's
    /// number: each [`BatchCompletion`] of these operations carries it, with the operation's
    /// index in `ops`, so completions of different submissions never mix.
    ///
    /// # Safety
    /// Every buffer named in `ops` must stay allocated and unaccessed by anything else until
    /// its completion has been returned by [`poll`](Self::poll) (which copies a read's last
    /// bytes into place on the buffer's stream first, see [`BatchOp::Read`]), or until
    /// [`cancel`](Self::cancel) has returned `Ok` (dropping the `BatchIo` cancels: its drop
    /// returns only when nothing is in flight, or aborts as [`run`](Self::run) does). A
    /// `BatchIo` passed to `mem::forget` with operations in flight never cancels them: their
    /// buffers must then never be freed or reused. The file registrations are held by the batch
    /// itself.
    ///
    /// A view's stream capturing a CUDA graph → [`Error::Unsupported`], before anything is
    /// enqueued or submitted (each view's stream is synchronised first, which a capture
    /// forbids).
    pub unsafe fn submit(&mut self, ops: &mut [BatchOp<'_>]) -> Result<u64> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.submit_as(ops, "BatchIo::submit") }
    }

    /// [`submit`](Self::submit), its refusal of a capturing stream naming `call`.
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    unsafe fn submit_as(&mut self, ops: &mut [BatchOp<'_>], call: &str) -> Result<u64> {
        let _restore = crate::cuda::CurrentContext::save();
        let free = self.capacity as usize - self.ops.len();
        if ops.len() > free {
            return Err(Error::InvalidArgument(format!(
                "{} operations exceed the batch's free capacity {free}",
                ops.len()
            )));
        }
        // Before any view's pointer is taken (cudarc enqueues its event waits) or anything is
        // submitted.
        crate::cuda::refuse_capturing_any(
            ops.iter().map(|op| match op {
                BatchOp::Read { dst, .. } => dst.stream(),
                BatchOp::Write { src, .. } => src.stream(),
            }),
            call,
        )?;
        let submission = self.next_submission;
        let mut params = Vec::with_capacity(ops.len() * ENTRIES_PER_OP as usize);
        let mut pending = Vec::with_capacity(ops.len());
        let mut holds = Vec::with_capacity(ops.len());
        let mut ready = Vec::new();
        // SAFETY: all-zero is valid for CUfileIOParams_t (integers and null pointers).
        let zero: sys::CUfileIOParams_t = unsafe { std::mem::zeroed() };
        let entry = |handle: &CuFileHandle,
                     opcode,
                     ptr: cudarc::driver::sys::CUdeviceptr,
                     base: cudarc::driver::sys::CUdeviceptr,
                     file_offset: u64,
                     size: usize,
                     cookie| {
            let mut p = zero;
            p.mode = sys::CUFILE_BATCH;
            p.u.batch = sys::CUfileIOParams__bindgen_ty_1__bindgen_ty_1 {
                devPtr_base: base as *mut c_void,
                file_offset: file_offset as i64,
                devPtr_offset: (ptr - base) as i64,
                size,
            };
            p.fh = handle.inner().fh;
            p.opcode = opcode;
            p.cookie = cookie;
            p
        };
        for (i, op) in ops.iter_mut().enumerate() {
            let (handle, ptr, len, file_offset, opcode, stream) = match op {
                BatchOp::Read {
                    handle,
                    dst,
                    file_offset,
                } => {
                    let stream: Arc<CudaStream> = Arc::clone(dst.stream());
                    let len = dst.len();
                    // Its waits for the view's users elsewhere made, or the batch fails before
                    // anything is submitted (`ordered_access`).
                    let p = crate::cuda::ordered::ordered_access(&stream, || {
                        dst.device_ptr_mut(&stream)
                    })?
                    .0;
                    (*handle, p, len, *file_offset, sys::CUFILE_READ, stream)
                }
                BatchOp::Write {
                    handle,
                    src,
                    file_offset,
                } => {
                    let stream: Arc<CudaStream> = Arc::clone(src.stream());
                    let len = src.len();
                    // As for a read.
                    let p =
                        crate::cuda::ordered::ordered_access(&stream, || src.device_ptr(&stream))?
                            .0;
                    (*handle, p, len, *file_offset, sys::CUFILE_WRITE, stream)
                }
            };
            if file_offset
                .checked_add(len as u64)
                .is_none_or(|e| e > i64::MAX as u64)
            {
                return Err(Error::InvalidArgument(format!(
                    "operation {i}: file offset {file_offset} is too large"
                )));
            }
            let write = opcode == sys::CUFILE_WRITE;
            self.driver.enter(&stream, write)?;
            // Reads stop at end of file as it is now, as CuFileHandle::read's do: cuFile's
            // compatibility path may write past what it reports when a read crosses it.
            let len = if write {
                len
            } else {
                clamp_to_eof(handle.file(), handle.path(), file_offset, len)?
            };
            if len == 0 {
                ready.push(BatchCompletion {
                    submission,
                    index: i,
                    status: sys::CUFILE_COMPLETE,
                    result: Ok(0),
                });
                continue;
            }
            let (base, _) = allocation_range(ptr)?;
            if write {
                params.push(entry(
                    handle,
                    opcode,
                    ptr,
                    base,
                    file_offset,
                    len,
                    cookie(submission, i, PART_IN_PLACE),
                ));
                pending.push(((submission, i), Pending::new(len, None)));
                holds.push(Arc::clone(handle.inner()));
                continue;
            }
            // As CuFileHandle::read_inside: the last bytes through a scratch buffer with
            // READ_OVERRUN bytes to spare, the rest in place (what cuFile may write past it
            // lands in the last bytes of `dst`, which the copy from scratch writes after both
            // entries completed).
            let tail = protected_tail(file_offset, len);
            let body = len - tail;
            let scratch = Scratch::alloc(&stream, tail + READ_OVERRUN)?;
            let (sbase, _) = allocation_range(scratch.ptr())?;
            // After the scratch allocation, which is ordered on `stream`.
            self.driver.enter(&stream, true)?;
            if body > 0 {
                params.push(entry(
                    handle,
                    opcode,
                    ptr,
                    base,
                    file_offset,
                    body,
                    cookie(submission, i, PART_IN_PLACE),
                ));
            }
            params.push(entry(
                handle,
                opcode,
                scratch.ptr(),
                sbase,
                file_offset + body as u64,
                tail,
                cookie(submission, i, PART_SCRATCH),
            ));
            let t = Tail {
                scratch,
                stream,
                dst: ptr + body as u64,
                len: tail,
            };
            pending.push(((submission, i), Pending::new(body, Some(t))));
            holds.push(Arc::clone(handle.inner()));
        }
        if !params.is_empty() {
            // SAFETY: the caller keeps the buffers valid until completion (this fn's contract);
            // the handles are held in `self.holds`; `params` is read during the call. A failed
            // submission submits nothing (cuFile's batch submit is all or nothing: its reference
            // names no partial outcome), so nothing is in flight on the error path.
            unsafe { result::batch_submit(self.driver.lib(), self.handle, &mut params) }?;
        }
        self.ready.extend(ready);
        self.outstanding
            .extend(params.iter().map(|p| p.cookie as usize));
        self.ops.extend(pending);
        self.holds.extend(holds);
        self.next_submission = self.next_submission.wrapping_add(1);
        Ok(submission)
    }

    /// Waits for at least `min_nr` completions or `timeout` (`cuFileBatchIOGetStatus`) and
    /// returns those that arrived (possibly fewer on timeout). Completions a
    /// [`cancel`](Self::cancel) collected or ended come first, without waiting.
    pub fn poll(&mut self, min_nr: u32, timeout: Option<Duration>) -> Result<Vec<BatchCompletion>> {
        if !self.ready.is_empty() {
            return Ok(std::mem::take(&mut self.ready));
        }
        self.get_status(min_nr, timeout)
    }

    /// `cuFileBatchIOGetStatus` for the operations cuFile still runs: their completions, each
    /// counted once. A finished event whose cookie is not outstanding (reported twice, or for
    /// an operation a cancel ended) is logged and dropped.
    fn get_status(
        &mut self,
        min_nr: u32,
        timeout: Option<Duration>,
    ) -> Result<Vec<BatchCompletion>> {
        if self.outstanding.is_empty() {
            return Ok(Vec::new());
        }
        let _restore = crate::cuda::CurrentContext::save();
        // SAFETY: all-zero is valid for CUfileIOEvents_t.
        let zero: sys::CUfileIOEvents_t = unsafe { std::mem::zeroed() };
        let mut events = vec![zero; self.outstanding.len()];
        let min_nr = min_nr.min(self.outstanding.len() as u32);
        // SAFETY: the batch handle is live.
        let n = unsafe {
            result::batch_get_status(self.driver.lib(), self.handle, min_nr, &mut events, timeout)
        }?;
        let mut out = Vec::with_capacity(n);
        for ev in &events[..n] {
            let status = ev.status;
            let finished = status
                & (sys::CUFILE_COMPLETE
                    | sys::CUFILE_FAILED
                    | sys::CUFILE_CANCELED
                    | sys::CUFILE_INVALID
                    | sys::CUFILE_TIMEOUT)
                != 0;
            if !finished {
                continue;
            }
            if !self.outstanding.remove(&(ev.cookie as usize)) {
                tracing::warn!(
                    cookie = ev.cookie as usize,
                    status,
                    "cuFileBatchIOGetStatus reported an operation that is not in flight; ignored"
                );
                continue;
            }
            let result = if status & sys::CUFILE_COMPLETE != 0 {
                match IoReturn::decode_event(ev.ret) {
                    IoReturn::Bytes(b) => Ok(b),
                    IoReturn::Os(e) => Err(Error::io("cuFileBatchIOGetStatus", None, e)),
                    IoReturn::CuFile(s) => Err(Error::CuFile {
                        op: "cuFileBatchIOSubmit",
                        source: s,
                    }),
                }
            } else {
                match IoReturn::decode_event(ev.ret) {
                    IoReturn::CuFile(s) => Err(Error::CuFile {
                        op: "cuFileBatchIOSubmit",
                        source: s,
                    }),
                    IoReturn::Os(e) => Err(Error::io("cuFileBatchIOSubmit", None, e)),
                    IoReturn::Bytes(_) => Err(Error::io(
                        "cuFileBatchIOSubmit",
                        None,
                        std::io::Error::other(format!(
                            "batch operation ended with status {status:#x}"
                        )),
                    )),
                }
            };
            let (submission, index, part) = decode_cookie(ev.cookie);
            let key = (submission, index);
            let Some(op) = self.ops.get_mut(&key) else {
                tracing::warn!(
                    submission,
                    index,
                    "cuFileBatchIOGetStatus reported an entry of no operation in flight; ignored"
                );
                continue;
            };
            if !op.record(part, status, result) {
                continue;
            }
            let op = self.ops.remove(&key).expect("found above");
            let status = op.status;
            out.push(BatchCompletion {
                submission,
                index,
                status,
                result: op.finish(),
            });
        }
        if self.outstanding.is_empty() {
            self.holds.clear();
        }
        Ok(out)
    }

    /// Cancels everything in flight (`cuFileBatchIOCancel`).
    ///
    /// `Ok` means nothing of this batch runs any more (see the module's "What a cancel
    /// guarantees"): completions that had arrived keep their result, every other operation gets
    /// one with status `CUFILE_CANCELED` and an error (its destination's bytes are
    /// unspecified); the next [`poll`](Self::poll) hands them all out. `Err` (e.g. cuFile's
    /// "retry later") means the operations may still run: keep polling, or cancel again.
    pub fn cancel(&mut self) -> Result<()> {
        if self.outstanding.is_empty() {
            return Ok(());
        }
        let _restore = crate::cuda::CurrentContext::save();
        // What has arrived keeps its real result.
        self.collect_now();
        if self.outstanding.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        // SAFETY: the batch handle is live.
        unsafe { result::batch_cancel(self.driver.lib(), self.handle) }?;
        let took = t.elapsed();
        if took >= SLOW_CANCEL {
            // cuFile 1.15 waits only so long for in-flight IO inside the cancel (5 s in its
            // mixed engine, 30 s in its io_uring one): say so when it came close.
            tracing::warn!(
                ?took,
                "cuFileBatchIOCancel took long: the storage is stalling; cuFile bounds how long \
                 it waits for in-flight IO before it reports the cancel done"
            );
        }
        // A cuFile that does report the operations it cancelled: take those reports.
        self.collect_now();
        self.outstanding.clear();
        // Their scratch buffers are freed here: nothing of the batch runs any more.
        let ended = end_all(self.ops.drain().map(|(key, _)| key));
        self.ready.extend(ended);
        self.holds.clear();
        Ok(())
    }

    /// Moves the completions that have arrived, without waiting, into `ready`; a failing poll is
    /// only logged (the caller goes on to cancel, or has cancelled).
    fn collect_now(&mut self) {
        match self.get_status(0, Some(Duration::ZERO)) {
            Ok(got) => self.ready.extend(got),
            Err(e) => {
                tracing::debug!(error = %e, "polling a batch before or after its cancel failed")
            }
        }
    }

    /// Cancels until nothing is in flight; never returns before (see [`cancel_and_drain`]).
    fn cancel_and_drain(&mut self) {
        cancel_and_drain(self, &DrainPolicy::DEFAULT)
    }
}

/// A cancel that takes this long met IO cuFile had to wait for (see [`BatchIo::cancel`]).
const SLOW_CANCEL: Duration = Duration::from_secs(1);

/// Completions for the operations `(submission, index)` of `ended`, which a successful cancel
/// ended before cuFile reported all their entries (status `CUFILE_CANCELED`), in order.
fn end_all(ended: impl Iterator<Item = (u64, usize)>) -> Vec<BatchCompletion> {
    let mut keys: Vec<(u64, usize)> = ended.collect();
    keys.sort_unstable();
    keys.into_iter()
        .map(|(submission, index)| BatchCompletion {
            submission,
            index,
            status: sys::CUFILE_CANCELED,
            result: Err(Error::Io {
                op: "cuFileBatchIOCancel",
                path: None,
                source: std::io::Error::new(
                    std::io::ErrorKind::Interrupted,
                    "the operation was cancelled before cuFile reported it; the bytes of its \
                         destination are unspecified",
                ),
            }),
        })
        .collect()
}

/// Bits of a cookie holding the operation's index in its submission (the capacity is bounded
/// to fit), above the entry's part (bit 0); the bits above hold the submission's number,
/// modulo what fits.
const INDEX_BITS: u32 = 24;
const MAX_INDEX: usize = (1 << INDEX_BITS) - 1;

/// cuFile entries an operation takes at most (a read: in place, and its last bytes through
/// scratch).
const ENTRIES_PER_OP: u32 = 2;
/// The part of an operation an entry is: all of a write, a read's bytes read in place.
const PART_IN_PLACE: usize = 0;
/// A read's last bytes, read into its scratch buffer.
const PART_SCRATCH: usize = 1;

/// The cookie of part `part` of operation `index` of submission `submission`: distinct for
/// every entry of the last 2^39 submissions (64-bit), so completions of one submission are
/// never taken for another's.
fn cookie(submission: u64, index: usize, part: usize) -> *mut c_void {
    debug_assert!(index <= MAX_INDEX && part <= 1);
    let sub = (submission as usize) & (usize::MAX >> (INDEX_BITS + 1));
    ((sub << (INDEX_BITS + 1)) | ((index & MAX_INDEX) << 1) | (part & 1)) as *mut c_void
}

/// The inverse of [`cookie`]: `(submission, index, part)`, the submission modulo the bits it
/// has.
fn decode_cookie(c: *mut c_void) -> (u64, usize, usize) {
    let v = c as usize;
    ((v >> (INDEX_BITS + 1)) as u64, (v >> 1) & MAX_INDEX, v & 1)
}

/// An operation submitted and not finished: what its entries reported so far (a write's one;
/// a read's in-place entry, when it has bytes before its last ones, and its scratch entry), and
/// where a read's scratch bytes go.
struct Pending {
    /// Bytes asked of the in-place entry; 0 when there is none.
    body: usize,
    /// What the in-place entry reported, once it did.
    body_got: Option<Result<usize>>,
    /// A read's last bytes, and what their entry reported, once it did.
    tail: Option<(Tail, Option<Result<usize>>)>,
    /// Entries not reported yet.
    left: u8,
    /// `CUFILE_COMPLETE`, or the status of an entry that did not complete.
    status: u32,
}

/// A read's last bytes: `len` bytes read into `scratch`, copied to `dst` on `stream` (the
/// destination's) when the read completes.
struct Tail {
    scratch: Scratch,
    stream: Arc<CudaStream>,
    dst: cudarc::driver::sys::CUdeviceptr,
    len: usize,
}

impl Pending {
    /// An operation of `body` bytes in place (0: none) and, for a read, its last bytes.
    fn new(body: usize, tail: Option<Tail>) -> Pending {
        Pending {
            body,
            body_got: None,
            left: u8::from(body > 0) + u8::from(tail.is_some()),
            tail: tail.map(|t| (t, None)),
            status: sys::CUFILE_COMPLETE,
        }
    }

    /// Records what the entry of `part` reported; true when every entry has.
    fn record(&mut self, part: usize, status: u32, r: Result<usize>) -> bool {
        if status & sys::CUFILE_COMPLETE == 0 && self.status == sys::CUFILE_COMPLETE {
            self.status = status;
        }
        let slot = match (part, &mut self.tail) {
            (PART_SCRATCH, Some((_, got))) => got,
            _ => &mut self.body_got,
        };
        if slot.is_none() {
            self.left = self.left.saturating_sub(1);
        }
        *slot = Some(r);
        self.left == 0
    }

    /// The operation's result once every entry reported: for a read whose last bytes arrived,
    /// after copying them into place (and waiting for the copy).
    fn finish(self) -> Result<usize> {
        let (tail, tail_got) = match self.tail {
            Some((t, got)) => (Some(t), got),
            None => (None, None),
        };
        let reported = tail.as_ref().map(|t| t.len).zip(tail_got);
        match settle(self.body, self.body_got, reported) {
            Settled::Done(r) => r,
            Settled::Copy { before, len } => {
                let t = tail.expect("settle copies only a read's last bytes");
                copy_into_place(&t, len).map(|()| before + len)
            }
        }
    }
}

/// What a finished operation still needs.
#[derive(Debug)]
enum Settled {
    /// Nothing: this is its result.
    Done(Result<usize>),
    /// Its first `len` scratch bytes copied into place; then `before + len` bytes are in.
    Copy { before: usize, len: usize },
}

/// The outcome of an operation whose entries all reported: `body` bytes asked in place and
/// what that entry reported (`None`: there was none), and the scratch entry's length and
/// report (`None`: none). The bytes in place come first: an error there, or fewer than asked
/// (the file shrank), is the result, and the scratch bytes are not copied.
fn settle(
    body: usize,
    body_got: Option<Result<usize>>,
    tail: Option<(usize, Result<usize>)>,
) -> Settled {
    let before = match body_got {
        Some(Err(e)) => return Settled::Done(Err(e)),
        Some(Ok(b)) if b < body || tail.is_none() => return Settled::Done(Ok(b.min(body))),
        Some(Ok(_)) => body,
        None => 0,
    };
    match tail {
        None => Settled::Done(Ok(before)),
        Some((_, Err(e))) => Settled::Done(Err(e)),
        Some((_, Ok(0))) => Settled::Done(Ok(before)),
        Some((len, Ok(t))) => Settled::Copy {
            before,
            len: t.min(len),
        },
    }
}

/// Copies the first `len` bytes of a read's scratch buffer to its place on the destination's
/// stream and waits for the copy. A stream capturing a CUDA graph by now cannot run it:
/// [`Error::Unsupported`] (the destination's last bytes are then unspecified).
fn copy_into_place(t: &Tail, len: usize) -> Result<()> {
    crate::cuda::refuse_capturing(&t.stream, "BatchIo: copying a read's last bytes into place")?;
    crate::cuda::bind(t.stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
    // SAFETY: `dst .. + len` lies inside the operation's destination (its last bytes, which
    // the batch borrows until this completion is handed out) and `scratch .. + len` inside the
    // scratch buffer, both in the stream's context, which is current; every entry of the
    // operation has completed; the copy is waited for below, before the scratch buffer is freed.
    unsafe {
        crate::cuda::result::mem::memcpy_dtod_async(
            t.dst,
            t.scratch.ptr(),
            len,
            t.stream.cu_stream(),
        )
    }?;
    // Through the result layer: cudarc's synchronize returns (and takes) an error stored in the
    // caller's object without synchronizing, and the scratch buffer would be freed while the
    // copy out of it is still queued.
    crate::cuda::settle::synchronize(&t.stream)
}

/// What draining needs from a batch: the seam that lets the drain policy be tested without
/// cuFile.
pub(in crate::storage) trait Reap {
    /// Operations that may still touch memory.
    fn in_flight(&self) -> usize;
    /// Cancels everything in flight; `Ok` means nothing is in flight any more.
    fn cancel(&mut self) -> Result<()>;
    /// Waits up to `wait` for at least one completion and reaps what arrived.
    fn reap(&mut self, wait: Duration) -> Result<()>;
}

impl Reap for BatchIo {
    fn in_flight(&self) -> usize {
        self.outstanding.len()
    }
    fn cancel(&mut self) -> Result<()> {
        BatchIo::cancel(self)
    }
    fn reap(&mut self, wait: Duration) -> Result<()> {
        let got = self.get_status(1, Some(wait))?;
        self.ready.extend(got);
        Ok(())
    }
}

/// How [`cancel_and_drain`] waits when cuFile refuses to cancel.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) struct DrainPolicy {
    /// Each poll for the operations' own completions waits up to this long.
    pub(in crate::storage) poll: Duration,
    /// How long the operations are polled before the cancel is tried again.
    pub(in crate::storage) retry: Duration,
    /// How long, in all, cancels may fail while operations stay in flight before the process
    /// aborts (30 s by default).
    pub(in crate::storage) patience: Duration,
}

impl DrainPolicy {
    /// What [`BatchIo::run`] and `BatchIo`'s drop use: polls of 100 ms, a new cancel every
    /// second, abort after 30 s.
    pub(in crate::storage) const DEFAULT: DrainPolicy = DrainPolicy {
        poll: Duration::from_millis(100),
        retry: Duration::from_secs(1),
        patience: Duration::from_secs(30),
    };
}

/// Cancels and returns only when nothing is in flight; never waits without bound.
///
/// The operations touch buffers the batch only borrows, so returning earlier would let the
/// caller free or reuse memory the device may still write. A successful cancel ends them all
/// (module doc). While cuFile refuses to cancel, the operations may still finish on their own:
/// they are polled, and the cancel retried every `policy.retry`; when after `policy.patience`
/// neither has ended them, nothing can tell any more whether the device is done with the
/// buffers, and the process aborts with a message.
pub(in crate::storage) fn cancel_and_drain(b: &mut impl Reap, policy: &DrainPolicy) {
    if b.in_flight() == 0 {
        return;
    }
    let start = Instant::now();
    let mut last_error: Option<Error> = None;
    loop {
        match b.cancel() {
            Ok(()) if b.in_flight() == 0 => return,
            Ok(()) => {
                last_error = Some(Error::InvalidArgument(format!(
                    "cuFileBatchIOCancel succeeded with {} operations still in flight",
                    b.in_flight()
                )))
            }
            Err(e) => {
                if last_error.is_none() {
                    tracing::warn!(error = %e, "cuFileBatchIOCancel failed; waiting for the operations and retrying");
                }
                last_error = Some(e);
            }
        }
        let round = Instant::now();
        while b.in_flight() > 0 && round.elapsed() < policy.retry {
            if let Err(e) = b.reap(policy.poll) {
                last_error = Some(e);
                std::thread::sleep(policy.poll);
            }
        }
        if b.in_flight() == 0 {
            return;
        }
        if start.elapsed() >= policy.patience {
            abort_in_flight(b.in_flight(), start.elapsed(), last_error.as_ref());
        }
    }
}

/// Ends the process: batch IO may still write borrowed memory and cuFile neither cancels it
/// nor reports it finished.
#[cold]
fn abort_in_flight(in_flight: usize, waited: Duration, e: Option<&Error>) -> ! {
    let why = e.map_or_else(|| "no error".to_string(), |e| e.to_string());
    let msg = format!(
        "gpudirect: cuFile batch IO may still be in flight ({in_flight} operations) after \
         {waited:?} of failed cancels and polls (last: {why}); aborting, because returning would \
         release buffers the device may still write"
    );
    tracing::error!("{msg}");
    eprintln!("{msg}");
    std::process::abort()
}

impl Drop for BatchIo {
    fn drop(&mut self) {
        // Returns only when nothing is in flight (or aborts): `submit`'s callers rely on the
        // drop to keep their borrowed buffers safe.
        self.cancel_and_drain();
        let _restore = crate::cuda::CurrentContext::save();
        // Empty by now (the drain ended every operation); freed inside the guard otherwise.
        self.ops.clear();
        // SAFETY: the handle is live and nothing is in flight.
        unsafe { result::batch_destroy(self.driver.lib(), self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch whose cancel fails `cancel_failures` times and then ends everything (as
    /// cuFile's does), and whose operations complete one per `reap` after `stall` empty polls
    /// (`usize::MAX`: never), polls failing `failures` times first.
    struct Fake {
        in_flight: usize,
        cancel_failures: usize,
        stall: usize,
        failures: usize,
        cancels: usize,
        reaps: usize,
    }

    impl Fake {
        fn new(in_flight: usize) -> Fake {
            Fake {
                in_flight,
                cancel_failures: 0,
                stall: 0,
                failures: 0,
                cancels: 0,
                reaps: 0,
            }
        }
    }

    impl Reap for Fake {
        fn in_flight(&self) -> usize {
            self.in_flight
        }
        fn cancel(&mut self) -> Result<()> {
            self.cancels += 1;
            if self.cancel_failures > 0 {
                self.cancel_failures -= 1;
                return Err(Error::InvalidArgument("fake cancel failure".into()));
            }
            self.in_flight = 0;
            Ok(())
        }
        fn reap(&mut self, wait: Duration) -> Result<()> {
            self.reaps += 1;
            if self.failures > 0 {
                self.failures -= 1;
                return Err(Error::InvalidArgument("fake poll failure".into()));
            }
            if self.stall > 0 {
                self.stall = self.stall.saturating_sub(1);
                std::thread::sleep(wait);
                return Ok(());
            }
            self.in_flight -= 1;
            Ok(())
        }
    }

    const FAST: DrainPolicy = DrainPolicy {
        poll: Duration::from_millis(2),
        retry: Duration::from_millis(10),
        patience: Duration::from_millis(60),
    };

    /// Runs the drain on another thread and gives the fake back, or fails the test if the drain
    /// does not return within 10 s (a hang must fail, not hang the suite).
    fn drain_bounded(mut b: Fake) -> (Fake, Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t = Instant::now();
            cancel_and_drain(&mut b, &FAST);
            let _ = tx.send((b, t.elapsed()));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("cancel_and_drain did not return within 10 s")
    }

    #[test]
    fn cookies_are_distinct_across_submissions_and_decode() {
        let mut seen = std::collections::HashSet::new();
        for sub in [0u64, 1, 2, 77, (1 << 39) - 1] {
            for i in [0usize, 1, 2, 255, MAX_INDEX] {
                for part in [PART_IN_PLACE, PART_SCRATCH] {
                    let c = cookie(sub, i, part);
                    assert!(
                        seen.insert(c as usize),
                        "cookie of ({sub}, {i}, {part}) repeats"
                    );
                    assert_eq!(decode_cookie(c), (sub, i, part));
                }
            }
        }
        // The first operation of two submissions: the collision the old cookies (the index
        // alone) had.
        assert_ne!(cookie(0, 0, 0), cookie(1, 0, 0));
    }

    /// Review N2: a batch read's result from its entries (in place, then its last bytes through
    /// scratch): the last bytes are copied only when the bytes before them all arrived, and the
    /// result counts what is in place, never a byte past a gap.
    #[test]
    fn a_split_read_settles_to_the_bytes_in_place() {
        let err = || Error::InvalidArgument("entry failed".into());
        let done = |s: Settled| match s {
            Settled::Done(r) => r.map_err(|e| e.to_string()),
            Settled::Copy { before, len } => panic!("copies {len} after {before}"),
        };
        let copy = |s: Settled| match s {
            Settled::Copy { before, len } => (before, len),
            Settled::Done(r) => panic!("no copy: {r:?}"),
        };
        // Both entries whole: the tail is copied after the body.
        assert_eq!(
            copy(settle(100, Some(Ok(100)), Some((70, Ok(70))))),
            (100, 70)
        );
        // Only a scratch entry (a read of at most 68 KiB).
        assert_eq!(copy(settle(0, None, Some((5000, Ok(5000))))), (0, 5000));
        // The file shrank: a short tail is copied as far as it got, a short body ends it.
        assert_eq!(
            copy(settle(100, Some(Ok(100)), Some((70, Ok(30))))),
            (100, 30)
        );
        assert_eq!(done(settle(100, Some(Ok(40)), Some((70, Ok(70))))), Ok(40));
        assert_eq!(done(settle(100, Some(Ok(100)), Some((70, Ok(0))))), Ok(100));
        // A failed entry fails the operation.
        assert!(done(settle(100, Some(Err(err())), Some((70, Ok(70))))).is_err());
        assert!(done(settle(100, Some(Ok(100)), Some((70, Err(err()))))).is_err());
        // A write: its one entry.
        assert_eq!(done(settle(4096, Some(Ok(4096)), None)), Ok(4096));
    }

    /// cuFile 1.15 never reports the operations a successful cancel ended (the GPU suite hung on
    /// a drain that waited for them): the cancel's success ends the drain at once, and every
    /// operation not reported gets exactly one `CUFILE_CANCELED` completion.
    #[test]
    fn a_successful_cancel_ends_every_operation_it_did_not_see_reported() {
        let mut b = Fake::new(8);
        b.stall = usize::MAX; // cuFile reports nothing, ever
        let (b, took) = drain_bounded(b);
        assert_eq!(b.in_flight, 0);
        assert_eq!((b.cancels, b.reaps), (1, 0), "one cancel, no waiting");
        assert!(took < Duration::from_secs(1), "{took:?}");

        let mut left: HashSet<(u64, usize)> = (0..5).map(|i| (3, i)).collect();
        left.remove(&(3, 2)); // reported before the cancel
        let ended = end_all(left.into_iter());
        let idx: Vec<(u64, usize)> = ended.iter().map(|c| (c.submission, c.index)).collect();
        assert_eq!(idx, [(3, 0), (3, 1), (3, 3), (3, 4)]);
        for c in &ended {
            assert_eq!(c.status, sys::CUFILE_CANCELED);
            let e = c.result.as_ref().unwrap_err().to_string();
            assert!(
                e.contains("cuFileBatchIOCancel") && e.contains("unspecified"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_refused_cancel_waits_for_the_operations_own_completions() {
        let mut b = Fake::new(3);
        b.cancel_failures = usize::MAX;
        b.stall = 4;
        let (b, _) = drain_bounded(b);
        assert_eq!(
            b.in_flight, 0,
            "returned with operations in flight (their buffers may still be written)"
        );
        assert!(b.cancels >= 1);
    }

    #[test]
    fn a_refused_cancel_is_retried_until_cufile_takes_it() {
        let mut b = Fake::new(2);
        b.cancel_failures = 2;
        b.stall = usize::MAX;
        let (b, _) = drain_bounded(b);
        assert_eq!(b.in_flight, 0);
        assert_eq!(b.cancels, 3);
    }

    #[test]
    fn poll_errors_during_a_refused_cancel_are_survived() {
        let mut b = Fake::new(2);
        b.cancel_failures = usize::MAX;
        b.failures = 3;
        let (b, _) = drain_bounded(b);
        assert_eq!(b.in_flight, 0);
        assert_eq!(b.reaps, 5);
    }

    const ABORT_CHILD: &str = "GPUDIRECT_TEST_DRAIN_ABORT_CHILD";

    /// Runs `test` (this binary, filtered to it) in a child with `ABORT_CHILD=case`, waits at
    /// most 20 s, and checks that it died of SIGABRT with the abort's message, within bounded
    /// time.
    fn expect_abort_in_child(test: &str, case: &str) {
        use std::os::unix::process::ExitStatusExt;
        use std::process::{Command, Stdio};
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ABORT_CHILD, case)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{case}: the drain neither returned nor aborted within 20 s (a hang)");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert_eq!(
            status.signal(),
            Some(libc::SIGABRT),
            "{case}: the drain returned instead of aborting (status {status:?}); stderr:\n{stderr}"
        );
        assert!(
            stderr.contains("cuFile batch IO may still be in flight"),
            "{case}: {stderr}"
        );
    }

    /// Nothing can prove the device is done with the buffers when cuFile refuses every cancel
    /// and the operations never finish (or polls keep failing): the process aborts, after the
    /// bounded patience, rather than return or wait forever.
    #[test]
    fn drain_aborts_when_cancels_keep_failing_and_nothing_finishes() {
        const NAME: &str = "storage::cufile::batch::tests::drain_aborts_when_cancels_keep_failing_and_nothing_finishes";
        if let Some(case) = std::env::var_os(ABORT_CHILD) {
            let mut b = Fake::new(1);
            b.cancel_failures = usize::MAX;
            if case == "stall" {
                b.stall = usize::MAX;
            } else {
                b.failures = usize::MAX;
            }
            cancel_and_drain(&mut b, &FAST);
            // Reaching this line is the failure the parent detects (exit status 0).
            return;
        }
        expect_abort_in_child(NAME, "stall");
        expect_abort_in_child(NAME, "poll-errors");
    }
}

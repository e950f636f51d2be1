//! Batch IO (`cuFileBatchIOSetUp` / `Submit` / `GetStatus` / `Cancel` / `Destroy`).
//!
//! [`BatchIo::run`] is the safe form: it submits, waits for every completion (cancelling and
//! draining on error, blocking until the drain ends or aborting the process when cuFile stops
//! answering) and returns, so nothing the device touches outlives the borrow.
//! [`BatchIo::submit`] + [`BatchIo::poll`] is the overlapping form and is `unsafe`: the caller
//! keeps buffers and handles alive until their completions are reaped.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cufile_sys as sys;

use super::buffer::allocation_range;
use super::file_handle::{clamp_to_eof, HandleInner};
use super::status::IoReturn;
use super::{result, CuFileHandle, Driver};
use crate::error::{Error, Result};

/// One operation of a batch: read into or write from a device view, at a file offset.
#[derive(Debug)]
pub enum BatchOp<'a> {
    /// Read `dst.len()` bytes at `file_offset` into `dst`, stopping at end of file as it is at
    /// submission (bytes of `dst` past it are not written; a read at or past it completes at
    /// once with 0 bytes).
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
    /// Raw `CUfileStatus_t` (`CUFILE_COMPLETE` = 0x10, `CUFILE_FAILED` = 0x40, ...).
    pub status: u32,
    /// Bytes moved, or the decoded error.
    pub result: Result<usize>,
}

/// A batch context of fixed capacity (`cuFileBatchIOSetUp`), destroyed on drop
/// (`cuFileBatchIODestroy`, after cancelling and draining anything in flight).
pub struct BatchIo {
    handle: sys::CUfileBatchHandle_t,
    capacity: u32,
    in_flight: usize,
    /// The number the next submission gets; part of every cookie (see [`cookie`]).
    next_submission: u64,
    /// Completions of reads that start at or past end of file: never submitted (nothing to
    /// move), handed out by the next [`poll`](Self::poll).
    ready: Vec<BatchCompletion>,
    // Registrations used by in-flight operations stay alive until they are drained.
    holds: Vec<Arc<HandleInner>>,
    driver: Arc<Driver>,
}

impl std::fmt::Debug for BatchIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchIo")
            .field("capacity", &self.capacity)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

// SAFETY: the batch handle is an opaque cuFile context, and cuFile's API reference states that
// all cuFile APIs are thread-safe, so it may be polled, cancelled and destroyed from another
// thread than the one that set it up. `BatchIo` is not `Sync`: every state change takes
// `&mut self`. Moving it with operations in flight moves their registrations (`holds`) with it,
// and its Drop drains them on whichever thread runs it (or aborts, see `cancel_and_drain`);
// `mem::forget` leaks the context and registrations with the IO still running, which `run`
// never allows (it returns only with nothing in flight) and `submit`'s contract covers.
unsafe impl Send for BatchIo {}

impl BatchIo {
    /// Creates a batch context for up to `capacity` operations (`cuFileBatchIOSetUp`);
    /// `capacity` must be within the driver's `max_batch_io_size`.
    pub fn new(driver: Arc<Driver>, capacity: u32) -> Result<Self> {
        let max = driver.properties().max_batch_io_size();
        if capacity == 0 || (max > 0 && capacity > max) || capacity as usize > MAX_INDEX {
            return Err(Error::InvalidArgument(format!(
                "batch capacity {capacity} is outside 1..={max} (the driver's max_batch_io_size)"
            )));
        }
        let handle = result::batch_setup(driver.lib(), capacity)?;
        Ok(BatchIo {
            handle,
            capacity,
            in_flight: 0,
            next_submission: 0,
            ready: Vec::new(),
            holds: Vec::new(),
            driver,
        })
    }

    /// Creates a batch context of the driver's maximum capacity.
    pub fn with_max_capacity(driver: Arc<Driver>) -> Result<Self> {
        let cap = driver.properties().max_batch_io_size().max(1);
        Self::new(driver, cap)
    }

    /// The capacity given at setup.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Operations submitted and not yet reaped by [`poll`](Self::poll) (including reads that
    /// start at end of file, which complete at once with 0 bytes).
    pub fn in_flight(&self) -> usize {
        self.in_flight + self.ready.len()
    }

    /// Submits `ops`, waits for all of them (each poll waits up to `timeout`; the whole run
    /// fails after `timeout` without progress) and returns their completions in order.
    ///
    /// Synchronous and safe: on any error the batch is cancelled and drained before returning,
    /// so no operation can still write a buffer once `run` returns, `Ok` or `Err`. If cancelled
    /// operations do not finish, `run` keeps waiting (logging every 30 s); if cuFile's polls
    /// keep failing for 30 s, nothing can tell whether the device is done with the buffers, and
    /// the process aborts rather than return. Each view's stream is synchronised before
    /// submission. Refused ([`Error::InvalidArgument`], nothing submitted) while operations of
    /// an earlier [`submit`](Self::submit) are in flight: reap them with [`poll`](Self::poll).
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
        // does not return before every operation has completed or been cancelled and drained.
        let mine = unsafe { self.submit(ops) }?;
        let mut done: Vec<Option<BatchCompletion>> = (0..ops.len()).map(|_| None).collect();
        for c in std::mem::take(&mut self.ready) {
            let i = c.index;
            if c.submission == mine && i < done.len() {
                done[i] = Some(c);
            }
        }
        let mut last_progress = Instant::now();
        while self.in_flight > 0 {
            match self.poll(1, Some(timeout)) {
                Ok(got) => {
                    if got.is_empty() && last_progress.elapsed() >= timeout {
                        self.cancel_and_drain();
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
                    for c in got {
                        let i = c.index;
                        if c.submission == mine && i < done.len() {
                            done[i] = Some(c);
                        }
                    }
                }
                Err(e) => {
                    self.cancel_and_drain();
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
    /// its completion has been returned by [`poll`](Self::poll), or until [`cancel`](Self::cancel)
    /// followed by polls has drained the batch (dropping the `BatchIo` does that: its drop
    /// blocks until nothing is in flight, or aborts as [`run`](Self::run) does). A `BatchIo`
    /// passed to `mem::forget` with operations in flight never drains: their buffers must then
    /// never be freed or reused. The file registrations are held by the batch itself.
    pub unsafe fn submit(&mut self, ops: &mut [BatchOp<'_>]) -> Result<u64> {
        let _restore = crate::cuda::CurrentContext::save();
        let free = self.capacity as usize - self.in_flight;
        if ops.len() > free {
            return Err(Error::InvalidArgument(format!(
                "{} operations exceed the batch's free capacity {free}",
                ops.len()
            )));
        }
        let submission = self.next_submission;
        let mut params = Vec::with_capacity(ops.len());
        let mut holds = Vec::with_capacity(ops.len());
        let mut ready = Vec::new();
        for (i, op) in ops.iter_mut().enumerate() {
            let (handle, ptr, len, file_offset, opcode, stream) = match op {
                BatchOp::Read {
                    handle,
                    dst,
                    file_offset,
                } => {
                    let stream: Arc<CudaStream> = Arc::clone(dst.stream());
                    let len = dst.len();
                    let p = dst.device_ptr_mut(&stream).0;
                    (*handle, p, len, *file_offset, sys::CUFILE_READ, stream)
                }
                BatchOp::Write {
                    handle,
                    src,
                    file_offset,
                } => {
                    let stream: Arc<CudaStream> = Arc::clone(src.stream());
                    let len = src.len();
                    let p = src.device_ptr(&stream).0;
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
            self.driver.enter(&stream, true)?;
            // Reads stop at end of file as it is now, as CuFileHandle::read's do: cuFile's
            // compatibility path may write past what it reports when a read crosses it.
            let len = if opcode == sys::CUFILE_READ {
                clamp_to_eof(handle.file(), handle.path(), file_offset, len)?
            } else {
                len
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
            // SAFETY: all-zero is valid for CUfileIOParams_t (integers and null pointers).
            let mut p: sys::CUfileIOParams_t = unsafe { std::mem::zeroed() };
            p.mode = sys::CUFILE_BATCH;
            p.u.batch = sys::CUfileIOParams__bindgen_ty_1__bindgen_ty_1 {
                devPtr_base: base as *mut c_void,
                file_offset: file_offset as i64,
                devPtr_offset: (ptr - base) as i64,
                size: len,
            };
            p.fh = handle.inner().fh;
            p.opcode = opcode;
            p.cookie = cookie(submission, i);
            params.push(p);
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
        self.in_flight += params.len();
        self.holds.extend(holds);
        self.next_submission = self.next_submission.wrapping_add(1);
        Ok(submission)
    }

    /// Waits for at least `min_nr` completions or `timeout` (`cuFileBatchIOGetStatus`) and
    /// returns those that arrived (possibly fewer on timeout).
    pub fn poll(&mut self, min_nr: u32, timeout: Option<Duration>) -> Result<Vec<BatchCompletion>> {
        if !self.ready.is_empty() {
            return Ok(std::mem::take(&mut self.ready));
        }
        if self.in_flight == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: all-zero is valid for CUfileIOEvents_t.
        let zero: sys::CUfileIOEvents_t = unsafe { std::mem::zeroed() };
        let mut events = vec![zero; self.in_flight];
        let min_nr = min_nr.min(self.in_flight as u32);
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
            self.in_flight = self.in_flight.saturating_sub(1);
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
            let (submission, index) = decode_cookie(ev.cookie);
            out.push(BatchCompletion {
                submission,
                index,
                status,
                result,
            });
        }
        if self.in_flight == 0 {
            self.holds.clear();
        }
        Ok(out)
    }

    /// Cancels everything in flight (`cuFileBatchIOCancel`); completions (cancelled or not)
    /// still have to be reaped with [`poll`](Self::poll).
    pub fn cancel(&mut self) -> Result<()> {
        if self.in_flight == 0 {
            return Ok(());
        }
        // SAFETY: the batch handle is live.
        unsafe { result::batch_cancel(self.driver.lib(), self.handle) }
    }

    /// Cancels and reaps until nothing is in flight; never returns before (see
    /// [`cancel_and_drain`]).
    fn cancel_and_drain(&mut self) {
        cancel_and_drain(self, &DrainPolicy::DEFAULT)
    }
}

/// Bits of a cookie holding the operation's index in its submission (the capacity is bounded
/// to fit); the bits above hold the submission's number, modulo what fits.
const INDEX_BITS: u32 = 24;
const MAX_INDEX: usize = (1 << INDEX_BITS) - 1;

/// The cookie of operation `index` of submission `submission`: distinct for every operation
/// of the last 2^40 submissions (64-bit), so completions of one submission are never taken for
/// another's.
fn cookie(submission: u64, index: usize) -> *mut c_void {
    debug_assert!(index <= MAX_INDEX);
    let sub = (submission as usize) & (usize::MAX >> INDEX_BITS);
    ((sub << INDEX_BITS) | (index & MAX_INDEX)) as *mut c_void
}

/// The inverse of [`cookie`]: `(submission, index)`, the submission modulo the bits it has.
fn decode_cookie(c: *mut c_void) -> (u64, usize) {
    let v = c as usize;
    ((v >> INDEX_BITS) as u64, v & MAX_INDEX)
}

/// What draining needs from a batch: the seam that lets the drain policy be tested without
/// cuFile.
pub(in crate::storage) trait Reap {
    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Cancels everything in flight.
    fn cancel(&mut self) -> Result<()>;
    /// Waits up to `wait` for at least one completion and reaps what arrived.
    fn reap(&mut self, wait: Duration) -> Result<()>;
}

impl Reap for BatchIo {
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    fn cancel(&mut self) -> Result<()> {
        BatchIo::cancel(self)
    }
    fn reap(&mut self, wait: Duration) -> Result<()> {
        self.poll(1, Some(wait)).map(|_| ())
    }
}

/// How [`cancel_and_drain`] waits.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) struct DrainPolicy {
    /// Each poll waits up to this long.
    pub(in crate::storage) poll: Duration,
    /// How often a drain without progress is logged (and the cancel repeated), and how long
    /// polls may keep failing before the process aborts.
    pub(in crate::storage) patience: Duration,
}

impl DrainPolicy {
    pub(in crate::storage) const DEFAULT: DrainPolicy = DrainPolicy {
        poll: Duration::from_millis(100),
        patience: Duration::from_secs(30),
    };
}

/// Cancels and reaps until nothing is in flight, and only then returns.
///
/// The operations write buffers the batch only borrows, so returning earlier would let the
/// caller free or reuse memory the device may still write. Hence: while polls succeed without
/// a completion (a hung storage target), it keeps waiting, logging and cancelling again every
/// `policy.patience`; when polls keep failing for `policy.patience` (nothing can tell any more
/// whether the device is done), it aborts the process with a message.
pub(in crate::storage) fn cancel_and_drain(b: &mut impl Reap, policy: &DrainPolicy) {
    if b.in_flight() == 0 {
        return;
    }
    if let Err(e) = b.cancel() {
        tracing::warn!(error = %e, "cuFileBatchIOCancel failed");
    }
    let start = Instant::now();
    let mut last_log = start;
    let mut failing_since: Option<Instant> = None;
    while b.in_flight() > 0 {
        match b.reap(policy.poll) {
            Ok(()) => failing_since = None,
            Err(e) => {
                let since = *failing_since.get_or_insert_with(|| {
                    tracing::warn!(error = %e, "polling a cancelled cuFile batch failed; retrying");
                    Instant::now()
                });
                if since.elapsed() >= policy.patience {
                    abort_in_flight(b.in_flight(), &e);
                }
                std::thread::sleep(policy.poll);
            }
        }
        if b.in_flight() > 0 && last_log.elapsed() >= policy.patience {
            tracing::warn!(
                in_flight = b.in_flight(),
                waited = ?start.elapsed(),
                "a cancelled cuFile batch still has operations in flight; waiting for them \
                 (their buffers are borrowed, so returning before they finish is not safe)"
            );
            if let Err(e) = b.cancel() {
                tracing::warn!(error = %e, "cuFileBatchIOCancel failed");
            }
            last_log = Instant::now();
        }
    }
}

/// Ends the process: batch IO may still write borrowed memory and cuFile no longer answers.
#[cold]
fn abort_in_flight(in_flight: usize, e: &Error) -> ! {
    let msg = format!(
        "gpudirect: cuFile batch IO may still be in flight ({in_flight} operations) and polling \
         it keeps failing ({e}); aborting, because returning would release buffers the device \
         may still write"
    );
    tracing::error!("{msg}");
    eprintln!("{msg}");
    std::process::abort()
}

impl Drop for BatchIo {
    fn drop(&mut self) {
        // Blocks until nothing is in flight (or aborts): `submit`'s callers rely on the drop to
        // keep their borrowed buffers safe.
        self.cancel_and_drain();
        // SAFETY: the handle is live and nothing is in flight.
        unsafe { result::batch_destroy(self.driver.lib(), self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch whose operations complete one per `reap` after `stall` empty polls, and whose
    /// polls fail `failures` times first.
    struct Fake {
        in_flight: usize,
        stall: usize,
        failures: usize,
        cancels: usize,
        reaps: usize,
    }

    impl Reap for Fake {
        fn in_flight(&self) -> usize {
            self.in_flight
        }
        fn cancel(&mut self) -> Result<()> {
            self.cancels += 1;
            Ok(())
        }
        fn reap(&mut self, wait: Duration) -> Result<()> {
            self.reaps += 1;
            if self.failures > 0 {
                self.failures -= 1;
                return Err(Error::InvalidArgument("fake poll failure".into()));
            }
            if self.stall > 0 {
                self.stall -= 1;
                std::thread::sleep(wait);
                return Ok(());
            }
            self.in_flight -= 1;
            Ok(())
        }
    }

    #[test]
    fn cookies_are_distinct_across_submissions_and_decode() {
        let mut seen = std::collections::HashSet::new();
        for sub in [0u64, 1, 2, 77, (1 << 40) - 1] {
            for i in [0usize, 1, 2, 255, MAX_INDEX] {
                let c = cookie(sub, i);
                assert!(seen.insert(c as usize), "cookie of ({sub}, {i}) repeats");
                assert_eq!(decode_cookie(c), (sub, i));
            }
        }
        // The first operation of two submissions: the collision the old cookies (the index
        // alone) had.
        assert_ne!(cookie(0, 0), cookie(1, 0));
    }

    const FAST: DrainPolicy = DrainPolicy {
        poll: Duration::from_millis(2),
        patience: Duration::from_millis(40),
    };

    #[test]
    fn drain_does_not_return_while_io_is_in_flight_after_a_long_stall() {
        // 60 empty polls of 2 ms: longer than the patience.
        let mut b = Fake {
            in_flight: 3,
            stall: 60,
            failures: 0,
            cancels: 0,
            reaps: 0,
        };
        cancel_and_drain(&mut b, &FAST);
        assert_eq!(
            b.in_flight, 0,
            "cancel_and_drain returned with operations in flight (their buffers may still be written)"
        );
        assert!(b.cancels >= 1);
    }

    #[test]
    fn drain_does_not_return_while_io_is_in_flight_after_a_poll_error() {
        let mut b = Fake {
            in_flight: 2,
            stall: 0,
            failures: 3,
            cancels: 0,
            reaps: 0,
        };
        cancel_and_drain(&mut b, &FAST);
        assert_eq!(
            b.in_flight, 0,
            "cancel_and_drain returned after a poll error with operations in flight"
        );
        assert_eq!(b.reaps, 5);
    }

    const ABORT_CHILD: &str = "GPUDIRECT_TEST_DRAIN_ABORT_CHILD";

    /// Polls that keep failing: nothing can prove the device is done with the buffers, so the
    /// process aborts rather than return. Runs the drain in a child process (this test binary,
    /// filtered to this test) and checks that it died of SIGABRT with a message.
    #[test]
    fn drain_aborts_when_polls_keep_failing() {
        if std::env::var_os(ABORT_CHILD).is_some() {
            let mut b = Fake {
                in_flight: 1,
                stall: 0,
                failures: usize::MAX,
                cancels: 0,
                reaps: 0,
            };
            cancel_and_drain(&mut b, &FAST);
            // Reaching this line is the failure the parent detects (exit status 0).
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "storage::cufile::batch::tests::drain_aborts_when_polls_keep_failing",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ABORT_CHILD, "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "the drain returned instead of aborting (status {:?}); stderr:\n{stderr}",
            out.status
        );
        assert!(
            stderr.contains("cuFile batch IO may still be in flight"),
            "{stderr}"
        );
    }
}

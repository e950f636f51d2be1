//! After a synchronize failed: can the work queued on a stream still run?
//!
//! `cuStreamSynchronize` fails for reasons that say nothing about the work queued on the
//! stream (the context could not be made current, a lying handle) as well as for the
//! context's sticky errors, after which it runs no more work. ([`synchronize`] binds through
//! the result layer, so an error an earlier call left in a cudarc context object is not one of
//! them.) A call that borrowed memory the queued work uses may return only once no piece of
//! that work can touch the memory any more (conventions, "Lessons"): [`settle`] asks
//! `cuStreamQuery` ([`query_stream`], for streams only gpudirect feeds) or `cuEventQuery` of
//! an event recorded after the failure ([`Mark`], for a stream the caller shares) until the
//! work is done or the context is dead, and aborts the process when the answer stays unknown
//! for [`UNKNOWN_BOUND`]. A caller that owns the memory (and leaks it when in doubt) waits as
//! long as the work runs, but gives up at the first unknown answer
//! ([`Patience::UntilUnknown`]).

use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaStream};

use crate::error::Result;

/// What one `cuStreamQuery` result says about the work queued on the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamState {
    /// Every piece of work completed (`CUDA_SUCCESS`).
    Idle,
    /// Work is still queued or running (`CUDA_ERROR_NOT_READY`).
    Busy,
    /// The context hit an error after which it runs no more work (the sticky family): what is
    /// queued never runs.
    Dead,
    /// Any other error: nothing is known about the queued work.
    Unknown,
}

/// The one classification of a `cuStreamQuery` (or failed `cuStreamSynchronize`) result.
///
/// Dead are the codes cuda.h documents as leaving the context unusable: "This leaves the
/// process in an inconsistent state and any further CUDA work will return the same error"
/// (illegal address, launch timeout, hardware stack error, illegal instruction, misaligned
/// address, invalid address space, invalid PC, launch failed, external device, contained,
/// tensor memory leak), "The context cannot be used anymore" (assert), "the process must be
/// terminated and relaunched" (MPS client terminated); and a context "destroyed using
/// cuCtxDestroy, or ... a primary context which has not yet been initialized" (it has no
/// streams left to run work on). Nothing else:
/// cuda.h says of uncorrectable ECC and NVLink errors only that they were "detected during
/// execution", and of a deinitialized driver that it "is in the process of shutting down",
/// not that queued work will not run, so they are unknown.
pub(crate) fn stream_state(r: sys::CUresult) -> StreamState {
    use sys::CUresult as R;
    match r {
        R::CUDA_SUCCESS => StreamState::Idle,
        R::CUDA_ERROR_NOT_READY => StreamState::Busy,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
        | R::CUDA_ERROR_LAUNCH_TIMEOUT
        | R::CUDA_ERROR_HARDWARE_STACK_ERROR
        | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | R::CUDA_ERROR_MISALIGNED_ADDRESS
        | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
        | R::CUDA_ERROR_INVALID_PC
        | R::CUDA_ERROR_LAUNCH_FAILED
        | R::CUDA_ERROR_EXTERNAL_DEVICE
        | R::CUDA_ERROR_ASSERT
        | R::CUDA_ERROR_CONTEXT_IS_DESTROYED => StreamState::Dead,
        // Named only by bindings newer than some gpudirect builds with (cuda.h 12.x):
        // CUDA_ERROR_CONTAINED, CUDA_ERROR_TENSOR_MEMORY_LEAK, CUDA_ERROR_MPS_CLIENT_TERMINATED.
        r if matches!(r as u32, 226 | 721 | 810) => StreamState::Dead,
        _ => StreamState::Unknown,
    }
}

/// How long [`settle`] waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Patience {
    /// Waits out busy answers (the work runs: as long as a synchronize would wait) and gives
    /// up at the first unknown one: for a caller that leaks the memory the work may use unless
    /// the answer is [`Settled::Complete`] or [`Settled::Dead`].
    UntilUnknown,
    /// Until every stream is idle or the context is dead: for a caller that borrowed the
    /// memory. Aborts the process after [`UNKNOWN_BOUND`] of unknown answers in a row.
    Wait,
}

/// What [`settle`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Every piece of work on the streams completed.
    Complete,
    /// The context is dead (this code, [`StreamState::Dead`]): what is queued never runs.
    Dead(sys::CUresult),
    /// Work may still run (an unknown answer: this code); only with
    /// [`Patience::UntilUnknown`].
    Pending(sys::CUresult),
}

impl Settled {
    /// No piece of the work can run any more: it completed, or its context is dead.
    pub(crate) fn quiet(self) -> bool {
        !matches!(self, Settled::Pending(_))
    }
}

/// How long [`settle`] with [`Patience::Wait`] accepts unknown answers in a row before it
/// aborts the process.
pub(crate) const UNKNOWN_BOUND: Duration = Duration::from_secs(60);

/// Asks `query(i)` (a `cuStreamQuery` of stream `i`, see [`query_stream`], or a
/// `cuEventQuery` of its [`Mark`]) for each of `streams` streams of one context until each is
/// idle, or until one says the context is
/// dead. Busy answers are waited out however long they last (as `cuStreamSynchronize` would);
/// unknown ones, with [`Patience::Wait`], for at most [`UNKNOWN_BOUND`] in a row, after which
/// the process aborts with a message naming `what` and the last code: returning would let the
/// caller free memory the work may still write; with [`Patience::UntilUnknown`] the first
/// unknown answer ends the wait ([`Settled::Pending`]).
pub(crate) fn settle(
    streams: usize,
    query: impl FnMut(usize) -> sys::CUresult,
    patience: Patience,
    what: &str,
) -> Settled {
    match poll(streams, query, patience, UNKNOWN_BOUND) {
        Ok(s) => s,
        Err(code) => {
            let msg = format!(
                "gpudirect: {what}: the CUDA streams answer {code:?} since {} s after a failed synchronize, so whether work still queued on them (copies into memory the caller may free next) completed is unknown; aborting rather than returning (check the driver: dmesg for Xid errors, nvidia-smi)",
                UNKNOWN_BOUND.as_secs()
            );
            tracing::error!("{msg}");
            eprintln!("{msg}");
            std::process::abort();
        }
    }
}

/// [`settle`]'s loop with its bound as a parameter: `Err(code)` when the answers stayed
/// unknown for `bound` in a row (the last one `code`).
fn poll(
    streams: usize,
    mut query: impl FnMut(usize) -> sys::CUresult,
    patience: Patience,
    bound: Duration,
) -> Result<Settled, sys::CUresult> {
    let mut i = 0;
    let mut unknown_since: Option<Instant> = None;
    let mut nap = Duration::from_micros(20);
    while i < streams {
        let r = query(i);
        match stream_state(r) {
            StreamState::Idle => {
                i += 1;
                unknown_since = None;
                continue;
            }
            StreamState::Dead => return Ok(Settled::Dead(r)),
            StreamState::Busy => unknown_since = None,
            StreamState::Unknown if patience == Patience::UntilUnknown => {
                return Ok(Settled::Pending(r))
            }
            StreamState::Unknown => {
                if unknown_since.get_or_insert_with(Instant::now).elapsed() >= bound {
                    return Err(r);
                }
            }
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    }
    Ok(Settled::Complete)
}

/// Makes `ctx` current on this thread (`cuCtxSetCurrent`, unless it is) through the result
/// layer: cudarc's `bind_to_thread` first returns (and clears) an error an earlier, unrelated
/// call recorded in its context object (a failed free of a cudarc slice records one), which
/// would read as this call's failure.
///
/// # Safety
/// `ctx` must be a live context.
pub(super) unsafe fn make_current(ctx: sys::CUcontext) -> sys::CUresult {
    if super::result::ctx::current() == Some(ctx) {
        return sys::CUresult::CUDA_SUCCESS;
    }
    // SAFETY: `ctx` is live (the caller's contract).
    unsafe { super::result::ctx::set_current(ctx) }
}

/// `cuStreamSynchronize` of `stream` after making its context current, both through the
/// result layer (see [`make_current`]): a drain's synchronize, whose failure then says
/// something about this stream's work, not about an earlier call's.
pub(crate) fn synchronize(stream: &CudaStream) -> Result<()> {
    // SAFETY: the stream holds its context alive.
    let r = unsafe { make_current(stream.context().cu_ctx()) };
    super::result::check("cuCtxSetCurrent", r)?;
    // SAFETY: `stream` is alive (borrowed) in the context now current.
    unsafe { super::result::stream::synchronize(stream.cu_stream()) }
}

/// `cuStreamQuery` of `stream` after making `ctx` current (`cuCtxSetCurrent`, not cudarc's
/// binding, which would take and report an error an earlier call left in cudarc's context);
/// a failed binding answers its own code (unknown).
///
/// # Safety
/// `stream` must be a live stream of the live context `ctx` (or null: its legacy default
/// stream).
pub(crate) unsafe fn query_stream(ctx: sys::CUcontext, stream: sys::CUstream) -> sys::CUresult {
    // SAFETY: `ctx` is live (the caller's contract).
    let r = unsafe { make_current(ctx) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return r;
    }
    // SAFETY: `stream` is a live stream of the now current `ctx` (the caller's contract).
    unsafe { super::result::stream::query(stream) }
}

/// An event recorded on a stream after a failed synchronize, for a wait that must end with
/// the work queued so far, not with the stream: a stream the caller shares may be fed more
/// work by other threads for as long as they like, while the event completes once the work
/// queued before it did ([`query`](Self::query)). Destroyed on drop.
pub(crate) struct Mark {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    event: Option<sys::CUevent>,
    recorded: bool,
}

impl Mark {
    /// A mark for `stream` of `ctx`, not recorded yet.
    ///
    /// # Safety
    /// `stream` must be a live stream of the live context `ctx` (or null: its legacy default
    /// stream), both alive until the mark is dropped.
    pub(crate) unsafe fn new(ctx: sys::CUcontext, stream: sys::CUstream) -> Mark {
        Mark {
            ctx,
            stream,
            event: None,
            recorded: false,
        }
    }

    /// One answer for [`settle`]: records the event on the stream if it is not yet
    /// (`cuEventCreate`, `cuEventRecord`), then asks it (`cuEventQuery`). A creation or record
    /// that fails answers its own code (unknown, or dead when the context is: the next answer
    /// tries again); the context is made current first, through the result layer.
    pub(crate) fn query(&mut self) -> sys::CUresult {
        // SAFETY: `ctx` is live (`new`'s contract).
        let r = unsafe { make_current(self.ctx) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return r;
        }
        if !self.recorded {
            let e = match self.event {
                Some(e) => e,
                // SAFETY: `ctx` is current.
                None => match unsafe { super::result::event::create() } {
                    Ok(e) => *self.event.insert(e),
                    Err(r) => return r,
                },
            };
            // SAFETY: `e` and `stream` are live in the current context (`new`'s contract).
            let r = unsafe { super::result::event::record(e, self.stream) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return r;
            }
            self.recorded = true;
        }
        match self.event {
            // SAFETY: the event is live (created above, destroyed only on drop).
            Some(e) => unsafe { super::result::event::query(e) },
            None => sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
        }
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            // SAFETY: `ctx` is live (`new`'s contract); the event is live and not used again.
            unsafe {
                if make_current(self.ctx) == sys::CUresult::CUDA_SUCCESS {
                    let _ = super::result::event::destroy(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::CUresult as R;

    #[test]
    fn stream_states_name_the_sticky_family_dead_and_nothing_else() {
        assert_eq!(stream_state(R::CUDA_SUCCESS), StreamState::Idle);
        assert_eq!(stream_state(R::CUDA_ERROR_NOT_READY), StreamState::Busy);
        for r in [
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_HARDWARE_STACK_ERROR,
            R::CUDA_ERROR_ILLEGAL_INSTRUCTION,
            R::CUDA_ERROR_MISALIGNED_ADDRESS,
            R::CUDA_ERROR_INVALID_ADDRESS_SPACE,
            R::CUDA_ERROR_INVALID_PC,
            R::CUDA_ERROR_LAUNCH_TIMEOUT,
            R::CUDA_ERROR_ASSERT,
            R::CUDA_ERROR_EXTERNAL_DEVICE,
            R::CUDA_ERROR_CONTEXT_IS_DESTROYED,
        ] {
            assert_eq!(stream_state(r), StreamState::Dead, "{r:?}");
        }
        // Errors that say nothing about the queued work: a binding that failed, a handle,
        // memory, a stale error left in cudarc's context, the driver's catch-all; and those
        // whose documentation does not say the context runs no more work (uncorrectable ECC
        // and NVLink errors, "detected during execution"; a driver "in the process of
        // shutting down").
        for r in [
            R::CUDA_ERROR_ECC_UNCORRECTABLE,
            R::CUDA_ERROR_NVLINK_UNCORRECTABLE,
            R::CUDA_ERROR_DEINITIALIZED,
            R::CUDA_ERROR_INVALID_CONTEXT,
            R::CUDA_ERROR_INVALID_HANDLE,
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_NOT_INITIALIZED,
            R::CUDA_ERROR_NOT_PERMITTED,
            R::CUDA_ERROR_NOT_SUPPORTED,
            R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            R::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
            R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            R::CUDA_ERROR_TIMEOUT,
            R::CUDA_ERROR_UNKNOWN,
        ] {
            assert_eq!(stream_state(r), StreamState::Unknown, "{r:?}");
        }
    }

    /// Scripted answers per stream, then idle.
    fn script(
        per_stream: Vec<Vec<R>>,
    ) -> (impl FnMut(usize) -> R, std::rc::Rc<std::cell::Cell<usize>>) {
        let asked = std::rc::Rc::new(std::cell::Cell::new(0));
        let a = asked.clone();
        let mut left: Vec<std::collections::VecDeque<R>> =
            per_stream.into_iter().map(Into::into).collect();
        let q = move |i: usize| {
            a.set(a.get() + 1);
            left[i].pop_front().unwrap_or(R::CUDA_SUCCESS)
        };
        (q, asked)
    }

    #[test]
    fn waiting_outlasts_busy_and_unknown_answers_until_every_stream_is_idle() {
        let (q, asked) = script(vec![
            vec![
                R::CUDA_ERROR_UNKNOWN,
                R::CUDA_ERROR_NOT_READY,
                R::CUDA_ERROR_INVALID_CONTEXT,
            ],
            vec![],
            vec![R::CUDA_ERROR_NOT_READY; 5],
        ]);
        let bound = Duration::from_secs(10);
        assert_eq!(poll(3, q, Patience::Wait, bound), Ok(Settled::Complete));
        // 3 + 1 for stream 0, 1 for stream 1, 5 + 1 for stream 2.
        assert_eq!(asked.get(), 11);
    }

    #[test]
    fn a_dead_context_ends_the_wait_at_once() {
        let (q, asked) = script(vec![
            vec![R::CUDA_ERROR_NOT_READY, R::CUDA_ERROR_UNKNOWN],
            vec![R::CUDA_ERROR_ILLEGAL_ADDRESS],
            vec![R::CUDA_ERROR_NOT_READY; 100],
        ]);
        let s = poll(3, q, Patience::Wait, Duration::from_secs(10));
        assert_eq!(s, Ok(Settled::Dead(R::CUDA_ERROR_ILLEGAL_ADDRESS)));
        assert!(s.unwrap().quiet());
        assert_eq!(asked.get(), 4, "stream 2 was never asked");
    }

    /// Review (drain, finding 4): a caller that owns the memory (and leaks it unless the
    /// copies are known complete or dead) waits out busy answers, as a synchronize would: a
    /// busy stream says the copies run, nothing worse, and giving up there leaks a file-sized
    /// buffer (`read_to_new`) for work that completes a moment later. It gives up at the first
    /// unknown answer, with that code. On the code before the fix it gave up at the first busy
    /// answer (`Pending(NOT_READY)` after 2 queries here).
    #[test]
    fn owning_callers_wait_out_busy_answers_and_give_up_at_the_first_unknown_one() {
        let (q, asked) = script(vec![vec![], vec![R::CUDA_ERROR_NOT_READY; 3], vec![]]);
        assert_eq!(
            poll(3, q, Patience::UntilUnknown, Duration::ZERO),
            Ok(Settled::Complete)
        );
        // 1 for stream 0, 3 + 1 for stream 1, 1 for stream 2.
        assert_eq!(asked.get(), 6);
        let (q, asked) = script(vec![
            vec![R::CUDA_ERROR_NOT_READY, R::CUDA_ERROR_INVALID_CONTEXT],
            vec![],
        ]);
        let s = poll(2, q, Patience::UntilUnknown, Duration::ZERO).unwrap();
        assert_eq!(s, Settled::Pending(R::CUDA_ERROR_INVALID_CONTEXT));
        assert!(!s.quiet());
        assert_eq!(asked.get(), 2, "stream 1 was never asked");
        let (q, _) = script(vec![vec![], vec![]]);
        assert_eq!(
            poll(2, q, Patience::UntilUnknown, Duration::ZERO),
            Ok(Settled::Complete)
        );
        let (q, _) = script(vec![vec![
            R::CUDA_ERROR_NOT_READY,
            R::CUDA_ERROR_LAUNCH_FAILED,
        ]]);
        assert_eq!(
            poll(1, q, Patience::UntilUnknown, Duration::ZERO),
            Ok(Settled::Dead(R::CUDA_ERROR_LAUNCH_FAILED))
        );
    }

    /// Unknown answers in a row past the bound: the wait gives up (and `settle` aborts); a
    /// busy answer in between starts the count again, however long the whole wait lasts.
    #[test]
    fn unknown_answers_past_the_bound_give_up_and_busy_ones_restart_the_count() {
        let bound = Duration::from_millis(100);
        let t = Instant::now();
        let r = poll(1, |_| R::CUDA_ERROR_INVALID_HANDLE, Patience::Wait, bound);
        assert_eq!(r, Err(R::CUDA_ERROR_INVALID_HANDLE));
        assert!(t.elapsed() >= bound);
        // Unknown, busy, 60 times, then idle: 120 naps (of up to 5 ms, longer on a loaded
        // machine: at least 0.55 s in all), far more than the bound, while no unknown answer
        // follows another (each is measured the moment it comes, so no nap, however long,
        // falls inside a run of unknown answers). Were the count not restarted by the busy
        // answers, an unknown answer past the bound would end the wait.
        let bound = Duration::from_millis(200);
        let mut answers: Vec<R> = (0..60)
            .flat_map(|_| [R::CUDA_ERROR_UNKNOWN, R::CUDA_ERROR_NOT_READY])
            .collect();
        answers.reverse();
        let t = Instant::now();
        let q = |_| answers.pop().unwrap_or(R::CUDA_SUCCESS);
        assert_eq!(poll(1, q, Patience::Wait, bound), Ok(Settled::Complete));
        assert!(t.elapsed() > bound, "{:?}", t.elapsed());
    }
}

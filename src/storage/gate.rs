//! The gate of a non-blocking device transfer: where, at the call, the transfer sits in its
//! buffer's stream ([`gate_dst`], [`gate_src`], on the caller's thread, of the view the
//! transfer then uses: `super::lent`), and the checks that the transfer thread works on the
//! buffer of the call ([`work_on`], [`same_buffer`]). The transfer's [`Ctl`] waits for the
//! gate; see [`Transfer`](super::Transfer)'s "Stream order".

use cudarc::driver::{
    sys, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};

#[cfg(doc)]
use super::transfer::Ctl;
use crate::error::{Error, Result};

/// Where a buffer's stream stood at a transfer's call, and which buffer that was. The mark is
/// a host-visible fence (`crate::cuda::fences`: a flag word of the context's pool that the
/// stream writes once its work before the call completed), or, where the device has no stream
/// memory operations, the context's pooled event recorded there (`crate::cuda::events`). The
/// call makes no event; the gate gives its mark back when dropped, after the IO that waited for
/// it.
pub(super) struct Gate {
    pub(super) mark: crate::cuda::fences::Mark,
    /// `(context, stream)` handles of the buffer's stream, as addresses.
    pub(super) on: (usize, usize),
    /// The buffer's device address and length in bytes.
    pub(super) buf: (sys::CUdeviceptr, usize),
}

/// `(context, stream)` handles of `s`, as addresses. One key is one stream on every thread:
/// the per-thread stream's handle, which names another stream on each thread, never gets here
/// (the call refuses it first, [`refuse_per_thread`]).
pub(super) fn stream_key(s: &CudaStream) -> (usize, usize) {
    (s.context().cu_ctx() as usize, s.cu_stream() as usize)
}

/// The handle of cudarc's per-thread stream (`CudaContext::per_thread_stream`: CUDA's
/// `CU_STREAM_PER_THREAD`), as an address.
const PER_THREAD_STREAM: usize = 0x2;

/// Refuses, at a non-blocking call (`what` names it and what it does), a buffer whose stream
/// handle (`stream`, as an address) is the per-thread stream's ([`Error::Unsupported`], saying
/// what to use instead). That handle names a different stream on every thread: the gate's
/// waits and fence would go on the calling thread's per-thread stream, not the one the
/// buffer's pending work may have been queued on from another thread (which then still runs
/// when the transfer thread reads or writes the buffer), and a buffer dropped on the transfer
/// thread (a transfer dropped or cancelled before its fence landed) is freed by cudarc's
/// `CudaSlice::drop` with `cuMemFreeAsync` on the transfer thread's per-thread stream, not
/// after the caller's work on it: a use after free on the device. Checked before anything is
/// queued. The legacy default stream (the null handle, cudarc's `default_stream`, and
/// `CU_STREAM_LEGACY`) is one stream on every thread, and is not refused. The blocking calls
/// take a per-thread stream: they do their CUDA work on the calling thread (as cudarc's own
/// calls do), where the handle names the caller's stream, and they only borrow the buffer.
pub(super) fn refuse_per_thread(stream: usize, what: &str) -> Result<()> {
    if stream != PER_THREAD_STREAM {
        return Ok(());
    }
    Err(Error::Unsupported {
        what: format!(
            "{what} on the per-thread stream (CudaContext::per_thread_stream, CU_STREAM_PER_THREAD)"
        ),
        cause: crate::Cause::Other {
            message: "the per-thread stream's handle names another stream on every thread: the \
                      transfer thread, which moves the bytes (and drops the buffer, with \
                      cuMemFreeAsync on its own per-thread stream, when the transfer is dropped \
                      early), would not be ordered after the work queued on the buffer from the \
                      caller's thread"
                .into(),
            fix: "put the buffer on a stream that is the same on every thread (CudaContext::\
                  new_stream, or CudaContext::default_stream), or use the blocking call \
                  (read_to_device, read_exact_to_device, write_from_device), which runs on the \
                  calling thread"
                .into(),
        },
    })
}

/// Where a call's own CUDA work on its buffer goes ([`Ctl::work_stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkOn {
    /// The buffer's stream (a blocking call, on the caller's thread).
    Buffer,
    /// A stream of gpudirect's (a transfer ordered at its call: the caller's stream is not
    /// touched after the call).
    Own,
}

/// [`Ctl::work_stream`]'s choice for a buffer on the stream `now` (`(context, stream)`
/// addresses), `gated` the stream of the call's gate (`None`: a blocking call).
pub(super) fn work_on(gated: Option<(usize, usize)>, now: (usize, usize)) -> Result<WorkOn> {
    match gated {
        None => Ok(WorkOn::Buffer),
        Some(at) if at == now => Ok(WorkOn::Own),
        Some(_) => Err(other_buffer("on another stream")),
    }
}

/// [`Ctl::same_buffer`]'s check: the buffer the transfer thread works on, `now` (device
/// address, bytes), against the call's, `at`. The transfer thread uses the view the call gated
/// (`super::lent`: `as_dst` / `as_src` is asked once), so they are the same by construction;
/// this check, like [`work_on`]'s, says so where the address is used.
pub(super) fn same_buffer(
    at: (sys::CUdeviceptr, usize),
    now: (sys::CUdeviceptr, usize),
) -> Result<()> {
    if at == now {
        Ok(())
    } else {
        Err(other_buffer("at another address or of another length"))
    }
}

/// The refusal of a buffer the transfer thread was handed that is not the call's (`how`). Since
/// the transfer thread uses the call's own view (`super::lent`), only a bug of gpudirect's could
/// make it; the wording dates from when the transfer thread asked the buffer again.
fn other_buffer(how: &str) -> Error {
    Error::InvalidArgument(format!(
        "the buffer's as_dst / as_src handed the transfer thread another buffer than at the call ({how}): a non-blocking transfer orders after its buffer's users only at the call (it never touches the buffer's stream afterwards); hand out the same buffer each time"
    ))
}

/// Marks, on the caller's thread at the call, where a device transfer sits in its buffer's
/// stream: the stream is made to wait for the buffer's users elsewhere (cudarc's
/// `device_ptr_mut` for a read, which writes the buffer; `device_ptr` for a write: its
/// `cuStreamWaitEvent`s), then a fence is queued on it ([`crate::cuda::fences::mark`]). The
/// only time a non-blocking transfer touches the buffer's stream, and no call made here waits
/// while another thread of the process unregisters host memory (`cuStreamIsCapturing`,
/// `cuCtxGetCurrent`, `cuStreamWaitEvent`, `cuStreamWriteValue32`; see `crate::cuda::fences`),
/// except where the fence falls back to an event. A stream capturing a CUDA graph is refused
/// first ([`Error::Unsupported`]): the waits and the fence would go into the caller's graph;
/// so is a buffer on the per-thread stream, before that ([`refuse_per_thread`]).
/// cudarc's access runs through [`waits_made`]: an error stored in the caller's `CudaContext`
/// object would skip its waits silently; one stored before the call is set aside while they are
/// made, one stored by the access fails the call ([`Error::Cuda`]), both put back.
///
/// cudarc's access guard is not dropped here but forgotten ([`forget_access`]): its drop would
/// record the buffer's cudarc event on the stream (`cuEventRecord`, which waits beside an
/// unregister).
///
/// `v` is the view the transfer then uses (`super::lent::LentDst`: the buffer's `as_dst` is
/// asked once, at the call, so the buffer gated here is the one the transfer thread moves
/// bytes to).
pub(super) fn gate_dst<T>(v: &mut CudaViewMut<'_, T>, call: &str) -> Result<Gate> {
    let stream = v.stream().clone();
    refuse_at_call(&stream, &format!("{call}: a read into device memory"))?;
    let bytes = v.num_bytes();
    gate_after(&stream, bytes, || v.device_ptr_mut(&stream))
}

/// [`gate_dst`] for a write from device memory (cudarc's `device_ptr`: the stream waits for
/// the buffer's writers), of the view the transfer then uses (`super::lent::LentSrc`).
pub(super) fn gate_src<T>(v: &CudaView<'_, T>, call: &str) -> Result<Gate> {
    let stream = v.stream().clone();
    refuse_at_call(&stream, &format!("{call}: a write from device memory"))?;
    gate_after(&stream, v.num_bytes(), || v.device_ptr(&stream))
}

/// The refusals [`gate_dst`] and [`gate_src`] make before the gate touches `stream` (a query,
/// a wait, the fence): a per-thread stream ([`refuse_per_thread`]), then a capturing one
/// (the waits and the fence would go into the capture).
fn refuse_at_call(stream: &CudaStream, what: &str) -> Result<()> {
    refuse_per_thread(stream.cu_stream() as usize, what)?;
    crate::cuda::refuse_capturing(stream, what)
}

/// The part [`gate_dst`] and [`gate_src`] share once the call's refusals passed: cudarc's
/// `access` to the `bytes`-byte buffer on `stream` ([`waits_made`], its guard forgotten,
/// [`forget_access`]), then the fence (or the fallback's event) queued there.
fn gate_after<'a>(
    stream: &'a CudaStream,
    bytes: usize,
    access: impl FnOnce() -> (sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>),
) -> Result<Gate> {
    let (ptr, record) = ordered_access(stream, access)?;
    forget_access(record);
    Ok(Gate {
        mark: crate::cuda::fences::mark(stream)?,
        on: stream_key(stream),
        buf: (ptr, bytes),
    })
}

/// Runs cudarc's access to a gated buffer (`access`: `device_ptr(_mut)`, whose
/// `cuStreamWaitEvent`s order the buffer's stream after its users elsewhere) so that its waits
/// are made, or the call fails. cudarc's wait first binds the context, which fails on an error
/// stored in the caller's `CudaContext` object (cudarc's `check_err`, an error an earlier call
/// could not return): the wait is then skipped and the error stored again, silently. So the
/// stored error is taken out first (`take`: cudarc's `check_err`), the access made, and what it
/// stored taken out too: an error then (a wait that failed, or one stored meanwhile by another
/// thread, which skips waits as well) is returned, and the call fails instead of proceeding
/// unordered. Either way the error is put back (`put`: cudarc's `record_err`; the newer one
/// when there are two, as cudarc keeps one) so the caller still sees it. An error that was
/// stored before the call does not fail it: the waits were made with it taken out. (Another
/// thread of the caller's that asks the same object in that window does not see the error:
/// cudarc's stored error is a report, not a lock.)
pub(super) fn waits_made<E: Copy>(
    take: impl Fn() -> std::result::Result<(), E>,
    put: impl Fn(std::result::Result<(), E>),
    access: impl FnOnce(),
) -> std::result::Result<(), E> {
    let stale = take();
    access();
    let now = take();
    put(stale);
    put(now);
    now
}

/// cudarc's access to the buffer of a transfer that does its own copies on `on`
/// (`access`: `device_ptr(_mut)` on `on`, whose `cuStreamWaitEvent`s order `on` after the
/// buffer's users on other streams), through [`waits_made`] as the gates do: cudarc's waits
/// bind through `on`'s `CudaContext` object and are skipped silently when an error is stored
/// there; the error stored before is set aside while they are made, one the access stores
/// fails the transfer ([`Error::Cuda`], nothing moved), both put back. Before `c682809` the
/// transfer's own bind (cudarc's `bind_to_thread`) failed it on such an error after a skipped
/// wait; since, the binds leave stored errors alone, so the access must say whether its waits
/// were made. The guard is returned (its drop records the buffer's event on `on`).
pub(super) fn ordered_access<'a>(
    on: &CudaStream,
    access: impl FnOnce() -> (sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>),
) -> Result<(sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>)> {
    let ctx = on.context();
    let mut got = None;
    let waited = waits_made(
        || ctx.check_err(),
        |r| ctx.record_err(r),
        || got = Some(access()),
    );
    let got = got.expect("the access ran");
    match waited {
        Ok(()) => Ok(got),
        Err(e) => {
            // Its record would be skipped or fail too: nothing was queued after the waits.
            forget_access(got.1);
            Err(skipped_wait(e))
        }
    }
}

/// The call's error when cudarc's access to its buffer stored one ([`waits_made`]).
fn skipped_wait(e: cudarc::driver::DriverError) -> Error {
    Error::cuda(
        "cudarc's wait for the buffer's other users at the call (cuStreamWaitEvent, or the \
         cuCtxSetCurrent before it; an error stored in the stream's CudaContext object skips \
         the wait): the transfer would not be ordered after them",
        e,
    )
}

/// Drops cudarc's access guard of a gated buffer without its record (`std::mem::forget`: it
/// only borrows the buffer's event and stream, so nothing leaks). Its waits were made when the
/// access was (the buffer's stream waits for the buffer's earlier users elsewhere, before the
/// fence), and the record is not needed for what comes after:
/// - the transfer owns the buffer until its copies completed (the transfer thread waits for
///   them; `Transfer::wait` hands the buffer back only then), so no later user of the buffer
///   can exist while any of its work is pending;
/// - the work the record would have covered (the buffer's stream up to the call, and through
///   its waits the buffer's earlier users) has completed before the transfer's first copy: the
///   transfer thread waits for the fence (or the fallback's event) first;
/// - so a later user on any stream that waits for the buffer's earlier cudarc records waits for
///   work that completed, and the bytes it reads (or overwrites) are the transfer's, complete.
///   The transfer thread's own access (on its side stream) makes that stream wait for the same
///   earlier records; it records nothing for a primary context (the side stream is gpudirect's
///   own object's, which tracks no events), else it records on the side stream, after those
///   waits, on the transfer thread: either way later users order after completed work.
///
/// A gate that fails after the access (the fence could not be queued) hands the buffer back at
/// once with its earlier records, nothing of the transfer's having touched it.
fn forget_access(record: cudarc::driver::SyncOnDrop<'_>) {
    std::mem::forget(record);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cudarc's access at the gate ([`waits_made`], no GPU needed: a fake stored error): an
    /// error stored before the call is taken out while the access runs (so its waits are made,
    /// not skipped) and put back, the call going on; an error the access stores (a failed or
    /// skipped wait) fails the call and is put back too; with none, nothing is stored.
    #[test]
    fn a_stored_error_never_skips_the_gates_waits_silently() {
        use std::cell::Cell;
        type R = std::result::Result<(), u32>;
        let state = Cell::new(0u32);
        let take = || -> R {
            match state.replace(0) {
                0 => Ok(()),
                e => Err(e),
            }
        };
        let put = |r: R| {
            if let Err(e) = r {
                state.set(e);
            }
        };
        // A stale error: the access sees none (its waits run), the call goes on, the error is
        // back.
        state.set(700);
        let seen = Cell::new(u32::MAX);
        assert_eq!(waits_made(take, put, || seen.set(state.get())), Ok(()));
        assert_eq!(
            seen.get(),
            0,
            "the access ran with the stale error in place"
        );
        assert_eq!(state.get(), 700, "the stale error was not put back");
        // The access stores one (its wait failed): the call fails with it; it stays stored,
        // the newer one kept.
        assert_eq!(waits_made(take, put, || state.set(999)), Err(999));
        assert_eq!(state.get(), 999);
        state.set(0);
        assert_eq!(waits_made(take, put, || state.set(4)), Err(4));
        assert_eq!(state.get(), 4);
        // Nothing stored: nothing changes.
        state.set(0);
        assert_eq!(waits_made(take, put, || {}), Ok(()));
        assert_eq!(state.get(), 0);
    }

    /// A non-blocking call refuses a buffer on the per-thread stream (no GPU needed: the
    /// check is of the handle): [`Error::Unsupported`] naming the call and the per-thread
    /// stream, whose fix names streams that are one stream on every thread and the blocking
    /// call; the null handle (cudarc's default stream), `CU_STREAM_LEGACY` and other handles
    /// pass.
    #[test]
    fn a_non_blocking_call_refuses_the_per_thread_stream() {
        match refuse_per_thread(0x2, "GpuFile::read_async: a read into device memory") {
            Err(e @ Error::Unsupported { .. }) => {
                let m = e.to_string();
                for part in [
                    "GpuFile::read_async: a read into device memory",
                    "per_thread_stream",
                    "another stream on every thread",
                    "new_stream",
                    "default_stream",
                    "blocking call",
                ] {
                    assert!(m.contains(part), "{part:?} is not in: {m}");
                }
            }
            r => panic!("the per-thread stream gave {r:?}"),
        }
        for handle in [0x0, 0x1, 0x3, 0x7f00_1234_5000] {
            refuse_per_thread(handle, "a call").unwrap();
        }
    }

    /// Where a call's own CUDA work on its buffer goes (no GPU needed): a blocking call's on
    /// the buffer's stream; a transfer ordered at its call on a stream of gpudirect's, never
    /// the caller's; a buffer that the transfer thread is handed on another stream than at the
    /// call (another stream handle, or another context's stream of the same handle: every
    /// context's default stream is the null handle), or at another address or of another
    /// length, is refused, saying what to do.
    #[test]
    fn a_transfer_ordered_at_its_call_never_works_on_the_callers_stream() {
        let refused = |r: Result<()>, what: &str| match r {
            Err(Error::InvalidArgument(m)) => assert!(
                m.contains("another buffer than at the call")
                    && m.contains(what)
                    && m.contains("hand out the same buffer"),
                "{m}"
            ),
            r => panic!("{what}: a buffer other than the call's gave {r:?}"),
        };
        let at = (0x1000, 0x2000);
        assert_eq!(work_on(None, at).unwrap(), WorkOn::Buffer);
        assert_eq!(work_on(Some(at), at).unwrap(), WorkOn::Own);
        for now in [(0x1000, 0x3000), (0x1100, 0x2000)] {
            refused(work_on(Some(at), now).map(|_| ()), "on another stream");
        }
        let buf = (0x7f00_0000_0000, 4096 + 13);
        same_buffer(buf, buf).unwrap();
        for now in [(buf.0 + 512, buf.1), (buf.0, buf.1 - 1)] {
            refused(
                same_buffer(buf, now),
                "at another address or of another length",
            );
        }
    }
}

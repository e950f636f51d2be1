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
/// cudarc's access runs through [`waits_made`](crate::cuda::ordered::waits_made): an error
/// stored in the caller's `CudaContext` object would skip its waits silently; one stored before
/// the call is set aside while they are made, one stored by the access fails the call
/// ([`Error::Cuda`]), both put back.
///
/// cudarc's access guard is not dropped here but forgotten
/// ([`forget_access`](crate::cuda::ordered::forget_access); why: [`gate_after`]): its drop
/// would record the buffer's cudarc event on the stream (`cuEventRecord`, which waits beside an
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
/// `access` to the `bytes`-byte buffer on `stream`
/// ([`ordered_access`](crate::cuda::ordered::ordered_access), its guard forgotten), then the
/// fence (or the fallback's event) queued there.
///
/// cudarc's access guard of a gated buffer is forgotten
/// ([`forget_access`](crate::cuda::ordered::forget_access)): its waits were made when the
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
fn gate_after<'a>(
    stream: &'a CudaStream,
    bytes: usize,
    access: impl FnOnce() -> (sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>),
) -> Result<Gate> {
    let (ptr, record) = crate::cuda::ordered::ordered_access(stream, access)?;
    crate::cuda::ordered::forget_access(record);
    Ok(Gate {
        mark: crate::cuda::fences::mark(stream)?,
        on: stream_key(stream),
        buf: (ptr, bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! Stream-ordered IO (`cuFileReadAsync` / `cuFileWriteAsync`).
//!
//! cuFile dereferences the size and offset arguments, and writes the byte count, when the
//! stream *executes* the operation, not when it is enqueued. The guard here owns all of them in
//! one heap block, owns the device buffer, and holds the file registration; its `Drop`
//! synchronises the stream. `mem::forget` on a guard leaks the block, the buffer and the
//! registration — never a use-after-free.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::buffer::{allocation_range, BufferError};
use super::file_handle::{clamp_to_eof, HandleInner};
use super::{result, CuFileHandle};
use crate::error::{Error, Result};

/// The parameter block cuFile reads and writes at execution time.
#[repr(C)]
struct Params {
    size: usize,
    file_offset: i64,
    buf_offset: i64,
    bytes: isize,
}

/// An enqueued stream-ordered read or write. Call [`wait`](Self::wait) to get the byte count
/// and the buffer back; dropping it synchronises the stream (errors are logged).
#[must_use = "dropping the guard blocks until the IO completes"]
pub struct StreamIo {
    // Drop order: synchronise (Drop body), then the block, buffer and registration go.
    params: Option<Box<Params>>,
    buf: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
    handle: Arc<HandleInner>,
    write: bool,
}

impl std::fmt::Debug for StreamIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamIo")
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

impl CuFileHandle {
    /// Enqueues a read of `len` bytes at `file_offset` into `buf[buf_offset..]` on `buf`'s
    /// stream (`cuFileReadAsync`). The guard owns `buf` until [`StreamIo::wait`] returns it.
    ///
    /// Errors before anything is enqueued: a range outside `buf` → [`Error::InvalidArgument`];
    /// a capturing stream (cuFile's stream API does not work in CUDA graphs) →
    /// [`Error::Unsupported`]; a handle whose IO takes cuFile's compatibility path (no nvidia-fs
    /// or P2PDMA) → [`Error::Unsupported`] (cuFile 1.15 fails stream-ordered IO there with `EIO`,
    /// aligned or not, while the synchronous calls work: see [`STREAM_COMPAT_ODIRECT_ALIGN`]);
    /// cuFile's refusal (e.g. `CU_FILE_ASYNC_NOT_SUPPORTED`
    /// without a `cufile.json`) → [`Error::CuFile`]. Each comes in a [`BufferError`] that gives
    /// `buf` back unchanged (no IO was enqueued); [`CuFileHandle::read`] is the synchronous
    /// path.
    ///
    /// A read is clamped to the file's size at enqueue time, so bytes of `buf` past the end of
    /// file are not written (on an O_DIRECT handle in compatibility mode, the clamp stops at the
    /// end of the 4 KiB block holding end of file); the byte count says how many were read.
    pub fn read_async(
        &self,
        buf: CudaSlice<u8>,
        buf_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<StreamIo, BufferError> {
        StreamIo::enqueue(self, false, buf, buf_offset, len, file_offset)
    }

    /// Enqueues a write of `buf[buf_offset..buf_offset+len]` at `file_offset` on `buf`'s stream
    /// (`cuFileWriteAsync`). See [`read_async`](Self::read_async): its errors, each with `buf`
    /// given back in a [`BufferError`].
    pub fn write_async(
        &self,
        buf: CudaSlice<u8>,
        buf_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<StreamIo, BufferError> {
        StreamIo::enqueue(self, true, buf, buf_offset, len, file_offset)
    }
}

/// The alignment stream-ordered IO needs on an O_DIRECT handle in cuFile's compatibility mode:
/// size and file offset must be multiples of it (4 KiB covers every logical block size in use,
/// 512 B and 4 KiB); the device buffer is not constrained. cuFile's stream path hands the file
/// range to the kernel unaligned, and fails with `EIO` otherwise; gpudirect refuses
/// stream-ordered IO outside GDS altogether. The measurements: [CONTRIBUTING.md, "cuFile
/// stream-ordered IO in compatibility
/// mode"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cufile-stream-ordered-io-in-compatibility-mode).
pub const STREAM_COMPAT_ODIRECT_ALIGN: u64 = 4096;

/// True for a handle whose IO takes cuFile's compatibility path, where gpudirect refuses
/// stream-ordered IO (see `check_alignment`).
fn odirect_compat(h: &CuFileHandle) -> bool {
    h.path_report().path != crate::TransferPath::Gds
}

/// Refuses, before cuFile sees it, stream-ordered IO on a handle whose IO takes cuFile's
/// compatibility path, where `cuFileReadAsync` fails with `EIO` even on fully aligned requests
/// (CONTRIBUTING.md, "cuFile stream-ordered IO in compatibility mode").
fn check_alignment(
    h: &CuFileHandle,
    write: bool,
    len: usize,
    file_offset: u64,
    dev_addr: u64,
) -> Result<()> {
    if !odirect_compat(h) {
        return Ok(());
    }
    Err(Error::Unsupported {
        what: format!(
            "stream-ordered {} of {len} bytes at file offset {file_offset} (device address {dev_addr:#x}) on {} ({}) in cuFile's compatibility mode",
            if write { "write" } else { "read" },
            h.path().display(),
            if h.is_o_direct() { "O_DIRECT" } else { "buffered" },
        ),
        cause: crate::Cause::Other {
            message: "cuFile 1.15's compatibility path fails stream-ordered IO with EIO, aligned \
                      or not (measured)"
                .into(),
            fix: "use the synchronous CuFileHandle::read/write or gpudirect::storage::GpuFile, \
                  or load nvidia-fs so that IO takes the direct path"
                .into(),
        },
    })
}

/// The device pointer of `buf` for stream-ordered IO on `stream`, with cudarc's guard, taken
/// with the IO's real intent: a write reads the buffer (`device_ptr`: the stream waits for
/// pending writes of it), a read writes it (`device_ptr_mut`: the stream also waits for pending
/// reads on other streams). Drop the guard only after the IO is enqueued, so the event cudarc
/// records then covers the IO. Through `crate::cuda::ordered::ordered_access`: with an error
/// stored in the buffer's cudarc object cudarc would skip those waits silently; the call fails
/// instead, before anything is enqueued.
fn io_pointer<'a>(
    buf: &'a mut CudaSlice<u8>,
    stream: &'a CudaStream,
    write: bool,
) -> Result<(
    cudarc::driver::sys::CUdeviceptr,
    cudarc::driver::SyncOnDrop<'a>,
)> {
    crate::cuda::ordered::ordered_access(stream, || {
        if write {
            buf.device_ptr(stream)
        } else {
            buf.device_ptr_mut(stream)
        }
    })
}

impl StreamIo {
    fn enqueue(
        h: &CuFileHandle,
        write: bool,
        mut buf: CudaSlice<u8>,
        buf_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<StreamIo, BufferError> {
        // `enter` binds the buffer's context: the caller's is put back after.
        let _restore = crate::cuda::CurrentContext::save();
        match Self::start(h, write, &mut buf, buf_offset, len, file_offset) {
            Ok(params) => Ok(StreamIo {
                params: Some(params),
                stream: Arc::clone(buf.stream()),
                buf: Some(buf),
                handle: Arc::clone(h.inner()),
                write,
            }),
            Err(e) => Err(BufferError::new(e, buf)),
        }
    }

    /// Checks the request and enqueues the IO on `buf`'s stream: the parameter block, which
    /// the caller must own (with `buf` and the handle's registration) until the stream has been
    /// synchronised. Nothing is enqueued when it fails.
    fn start(
        h: &CuFileHandle,
        write: bool,
        buf: &mut CudaSlice<u8>,
        buf_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<Box<Params>> {
        if buf_offset
            .checked_add(len)
            .is_none_or(|end| end > buf.len())
        {
            return Err(Error::InvalidArgument(format!(
                "range {buf_offset}..{buf_offset}+{len} is outside the {}-byte buffer",
                buf.len()
            )));
        }
        if file_offset > i64::MAX as u64 - len as u64 {
            return Err(Error::InvalidArgument(format!(
                "file offset {file_offset} is too large"
            )));
        }
        let stream = Arc::clone(buf.stream());
        h.driver().enter(&stream, false)?;
        // SAFETY: the stream is alive (we hold its Arc), its context current (`enter`).
        let status = unsafe { crate::cuda::result::stream::capture_status(stream.cu_stream()) };
        crate::cuda::capture_refusal(
            if write {
                "CuFileHandle::write_async"
            } else {
                "CuFileHandle::read_async"
            },
            "cuFile's stream API does not work during CUDA graph capture",
            status,
        )?;
        // `record` lives until the IO is enqueued (see io_pointer).
        let (ptr, record) = io_pointer(buf, &stream, write)?;
        let (base, _) = allocation_range(ptr)?;
        let dev_offset = ptr - base + buf_offset as u64;
        check_alignment(h, write, len, file_offset, ptr + buf_offset as u64)?;
        // Reads stop at the end of file as it is now (see CuFileHandle::read); on an O_DIRECT
        // handle in compatibility mode only at the block holding it, to stay aligned (the
        // kernel then returns the short count itself).
        let size = if write {
            len
        } else {
            let to_eof = clamp_to_eof(h.file(), h.path(), file_offset, len)? as u64;
            if odirect_compat(h) {
                let a = STREAM_COMPAT_ODIRECT_ALIGN;
                (to_eof.div_ceil(a) * a).min(len as u64) as usize
            } else {
                to_eof as usize
            }
        };
        let mut params = Box::new(Params {
            size,
            file_offset: file_offset as i64,
            buf_offset: dev_offset as i64,
            bytes: 0,
        });
        let p: *mut Params = &mut *params;
        // SAFETY: the block is heap memory (malloc) that `enqueue` moves into the guard, which
        // owns it until after the stream is synchronised (Drop/wait), or leaks it if the guard
        // is forgotten; likewise the buffer (`buf`, moved into the guard) and the handle
        // registration (an Arc held by the guard).
        // `bytes` starts at 0 in host memory as cuFile requires. The context is current.
        unsafe {
            result::io_async(
                h.driver().lib(),
                write,
                h.inner().fh,
                base as *mut c_void,
                &raw mut (*p).size,
                &raw mut (*p).file_offset,
                &raw mut (*p).buf_offset,
                &raw mut (*p).bytes,
                stream.cu_stream().cast(),
            )
        }?;
        drop(record);
        Ok(params)
    }

    /// Synchronises the stream and returns `(bytes moved, buffer)`.
    ///
    /// Errors, in a [`WaitError`]: the IO ran and failed (cuFile's decoded count: an
    /// [`Error::Io`] or [`Error::CuFile`]) → [`WaitError::Io`], whose [`BufferError`] gives the
    /// buffer back (a failed read may have written part of the range it was given); the stream
    /// did not synchronise → [`WaitError::Sync`], and the buffer is not given back: cuFile may
    /// still write it, so the guard's drop synchronises again and frees it only if that
    /// succeeds, else leaks it. `?` turns either into an [`Error`].
    pub fn wait(mut self) -> Result<(usize, CudaSlice<u8>), WaitError> {
        let _restore = crate::cuda::CurrentContext::save();
        // Through the result layer: cudarc's synchronize returns (and takes) an error stored in
        // the caller's object without synchronizing, and the IO would be reported done while
        // cuFile may still write the buffer.
        if let Err(e) = crate::cuda::settle::synchronize(&self.stream) {
            // `buf` stays in the guard, for Drop to free or leak.
            return Err(WaitError::Sync(e));
        }
        let bytes = self.params.as_ref().map_or(0, |p| p.bytes);
        let buf = self.buf.take().expect("buffer present until wait or drop");
        settle(self.write, bytes, buf).map_err(|(e, buf)| WaitError::Io(BufferError::new(e, buf)))
    }

    /// The stream the IO is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// The error of [`StreamIo::wait`]: the IO failed, with the buffer given back, or the stream
/// did not synchronise, and the buffer could not be.
///
/// `?` (through `From<WaitError> for Error`) and [`into_error`](Self::into_error) keep the
/// error (and free a given-back buffer, as [`BufferError`] does); match to keep the buffer:
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use std::path::Path;
/// use gpudirect::storage::cufile::{CuFileHandle, Driver, OpenMode, WaitError};
/// let stream = gpudirect::cuda::context(0)?.new_stream()?;
/// let h = CuFileHandle::open(Driver::open()?, Path::new("weights.bin"), OpenMode::Read)?;
/// let buf = stream.alloc_zeros::<u8>(1 << 20)?;
/// let (n, buf) = match h.read_async(buf, 0, 1 << 20, 0)?.wait() {
///     Ok(done) => done,
///     Err(WaitError::Io(failed)) => {
///         eprintln!("stream-ordered read failed: {failed}");
///         // Still ours (part of it may have been written): read it synchronously instead.
///         let mut buf = failed.into_buffer();
///         (h.read(&mut buf, 0)?, buf)
///     }
///     Err(broken) => return Err(broken.into()),
/// };
/// # drop((n, buf)); Ok(()) }
/// ```
///
/// Display and `source` are the error's own, as [`BufferError`]'s.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The stream synchronised and the IO had failed: the decoded error, with the buffer given
    /// back. A failed read may have written part of the range it was given; a failed write
    /// leaves the buffer unchanged.
    #[error(transparent)]
    Io(BufferError),
    /// The stream did not synchronise (`cuStreamSynchronize` failed: [`Error::Cuda`]). cuFile
    /// may still read or write the buffer, so it is not given back: [`StreamIo`]'s drop
    /// synchronises once more and frees it only if that succeeds, else leaks it.
    #[error(transparent)]
    Sync(Error),
}

impl WaitError {
    /// Why the wait failed.
    pub fn error(&self) -> &Error {
        match self {
            WaitError::Io(failed) => failed.error(),
            WaitError::Sync(e) => e,
        }
    }

    /// The error; a given-back buffer is freed (see [`BufferError`]).
    pub fn into_error(self) -> Error {
        match self {
            WaitError::Io(failed) => failed.into_error(),
            WaitError::Sync(e) => e,
        }
    }
}

impl From<WaitError> for Error {
    fn from(e: WaitError) -> Self {
        e.into_error()
    }
}

/// What [`StreamIo::wait`] hands back once the stream has synchronised: the byte count and the
/// buffer, or the IO's decoded error ([`decode_bytes`]) and the buffer. Generic over the buffer
/// so that host tests can check that a failure keeps it.
fn settle<B>(write: bool, bytes: isize, buf: B) -> std::result::Result<(usize, B), (Error, B)> {
    match decode_bytes(write, bytes) {
        Ok(n) => Ok((n, buf)),
        Err(e) => Err((e, buf)),
    }
}

/// Decodes the byte count cuFile wrote into the parameter block when the stream executed the
/// IO. cuFile's rule is that of the synchronous calls, except for `-1`: the `errno` that goes
/// with it was set on whichever thread executed the operation, long before `wait`, so this
/// thread's `errno` says nothing about it and is never read.
fn decode_bytes(write: bool, bytes: isize) -> Result<usize> {
    let op = if write {
        "cuFileWriteAsync"
    } else {
        "cuFileReadAsync"
    };
    if bytes == -1 {
        return Err(Error::io(
            op,
            None,
            std::io::Error::other(
                "the operation failed with -1, whose errno cuFile set on the thread that executed \
                 it (not recoverable here); the synchronous CuFileHandle::read/write reports the \
                 OS error",
            ),
        ));
    }
    result::decode_ssize(op, bytes)
}

impl Drop for StreamIo {
    fn drop(&mut self) {
        if self.buf.is_none() {
            return; // `wait` synchronised already.
        }
        let _restore = crate::cuda::CurrentContext::save();
        // Through the result layer (as in `wait`).
        if let Err(e) = crate::cuda::settle::synchronize(&self.stream) {
            // The stream is broken: cuFile may still touch the block and the buffer, so leak
            // them rather than free memory the device might write.
            tracing::warn!(error = %e, "stream sync failed in StreamIo::drop; leaking its buffer");
            std::mem::forget(self.params.take());
            std::mem::forget(self.buf.take());
            std::mem::forget(Arc::clone(&self.handle));
            return;
        }
        // The buffer is freed here, inside the guard and with its context bound: cudarc's
        // `CudaSlice` drop frees without binding (and fails with no current context), and a
        // field dropped after this body would run after the guard put the caller's context back.
        let _ = crate::cuda::bind(self.stream.context());
        drop(self.buf.take());
    }
}

/// A stream registered with cuFile (`cuFileStreamRegister`, flags 0) to cut per-call setup
/// cost of stream-ordered IO; deregistered on drop (`cuFileStreamDeregister`), which cuFile
/// requires before the stream is destroyed — holding the stream's `Arc` guarantees that order.
pub struct StreamRegistration {
    // `ManuallyDrop`: released in Drop's body, inside the current-context guard (the last
    // `Arc` destroys the stream, which binds its context), or leaked if the registration could
    // not be ended (cuFile must not see a registered stream destroyed).
    stream: std::mem::ManuallyDrop<Arc<CudaStream>>,
    driver: Arc<super::Driver>,
}

impl std::fmt::Debug for StreamRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRegistration").finish_non_exhaustive()
    }
}

impl StreamRegistration {
    /// Registers `stream` (`cuFileStreamRegister`).
    pub fn register(driver: Arc<super::Driver>, stream: Arc<CudaStream>) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        driver.enter(&stream, false)?;
        // SAFETY: the stream is alive and stays so (its Arc is held) until deregistration in Drop.
        unsafe { result::stream_register(driver.lib(), stream.cu_stream().cast(), 0) }?;
        Ok(StreamRegistration {
            stream: std::mem::ManuallyDrop::new(stream),
            driver,
        })
    }

    /// The registered stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for StreamRegistration {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        let _ = crate::cuda::bind(self.stream.context());
        // Stream-ordered IO still queued on the stream uses the registration: let it finish
        // (through the result layer, as in `StreamIo::wait`).
        if let Err(e) = crate::cuda::settle::synchronize(&self.stream) {
            tracing::warn!(error = %e, "stream sync failed before cuFileStreamDeregister; the registration and the stream leak");
            return; // `stream` stays undropped: a registered stream is never destroyed.
        }
        let raw = self.stream.cu_stream().cast();
        // SAFETY: registered in `register`, deregistered once here; the stream is alive and idle.
        let rc = unsafe { result::stream_deregister(self.driver.lib(), raw) };
        if let Err(e) = rc {
            tracing::warn!(error = %e, "cuFileStreamDeregister failed; the stream leaks");
            return;
        }
        // SAFETY: dropped once, here; the field is not used after this.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.stream) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::time::Duration;

    use cudarc::driver::sys as cu;

    use super::*;

    /// Holds a stream at a host function until released (or 30 s pass).
    struct Gate(Option<Sender<()>>);

    unsafe extern "C" fn wait_for_release(data: *mut c_void) {
        // SAFETY: `data` is the Box<Receiver> leaked by `Gate::block`, handed over exactly once;
        // the callback makes no CUDA call.
        let rx = unsafe { Box::from_raw(data.cast::<Receiver<()>>()) };
        let _ = rx.recv_timeout(Duration::from_secs(30));
    }

    impl Gate {
        fn block(stream: &CudaStream) -> Gate {
            let (tx, rx) = channel::<()>();
            let rx = Box::into_raw(Box::new(rx));
            // SAFETY: the stream is alive; on success the callback owns `rx`.
            let rc = unsafe {
                cu::cuLaunchHostFunc(stream.cu_stream(), Some(wait_for_release), rx.cast())
            };
            if rc != cu::CUresult::CUDA_SUCCESS {
                // SAFETY: a failed launch did not hand `rx` over.
                drop(unsafe { Box::from_raw(rx) });
                panic!("cuLaunchHostFunc: {rc:?}");
            }
            Gate(Some(tx))
        }
        fn release(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }

    impl Drop for Gate {
        fn drop(&mut self) {
            self.release();
        }
    }

    #[test]
    fn stream_io_failure_does_not_report_the_waiting_threads_errno() {
        // cuFile sets errno on the thread that executed the IO; the thread that waits has its
        // own, unrelated one (here: EACCES from something else).
        // SAFETY: __errno_location returns this thread's errno slot.
        unsafe { *libc::__errno_location() = libc::EACCES };
        let e = decode_bytes(false, -1).unwrap_err();
        if let Error::Io { source, .. } = &e {
            assert_ne!(
                source.raw_os_error(),
                Some(libc::EACCES),
                "the waiting thread's stale errno was reported as the IO's error: {e}"
            );
        }
        let msg = e.to_string();
        assert!(msg.contains("cuFileReadAsync"), "{msg}");
        // -errno and cuFile codes are carried in the value itself and still decode.
        match decode_bytes(true, -(libc::ENOSPC as isize)) {
            Err(Error::Io { op, source, .. }) => {
                assert_eq!(op, "cuFileWriteAsync");
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode_bytes(false, -5011),
            Err(Error::CuFile {
                op: "cuFileReadAsync",
                ..
            })
        ));
        assert_eq!(decode_bytes(false, 4099).unwrap(), 4099);
    }

    /// Once the stream has synchronised, a failed IO's decoded error comes with the buffer
    /// (here a host stand-in: it must come back as it went in), for [`StreamIo::wait`] to give
    /// back in a [`WaitError::Io`]; a count of bytes comes with it too. On the code before the
    /// fix `wait` returned the bare error and dropped the buffer (there was no way to get it).
    #[test]
    fn a_failed_stream_io_keeps_its_buffer() {
        let buf = vec![7u8, 1, 250, 3, 99];
        let cases = [
            (false, -(libc::EIO as isize), "cuFileReadAsync"),
            (true, -(libc::ENOSPC as isize), "cuFileWriteAsync"),
            (false, -1, "cuFileReadAsync"),
            (true, -5011, "cuFileWriteAsync"),
        ];
        for (write, bytes, op) in cases {
            match settle(write, bytes, buf.clone()) {
                Err((e, back)) => {
                    assert_eq!(back, buf, "count {bytes}: the buffer came back changed");
                    let msg = e.to_string();
                    assert!(msg.contains(op), "count {bytes}: {msg}");
                }
                Ok((n, _)) => panic!("count {bytes} decoded as {n} bytes moved"),
            }
        }
        match settle(true, -(libc::ENOSPC as isize), ()) {
            Err((Error::Io { op, source, .. }, ())) => {
                assert_eq!(op, "cuFileWriteAsync");
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            settle(false, 4099, buf.clone()).unwrap(),
            (4099, buf.clone())
        );
        assert_eq!(settle(true, 0, buf.clone()).unwrap(), (0, buf));
    }

    /// [`StreamIo::wait`] of an IO that ran and failed gives the buffer back: a
    /// [`WaitError::Io`] with the decoded error, and the buffer with its length and bytes
    /// (nothing wrote them). The failure is planted: a guard made here over a registered
    /// handle, a real buffer and stream, with the count cuFile would have written in its
    /// parameter block and no IO enqueued, so the check runs on either cuFile path (gpudirect
    /// refuses real stream-ordered IO in compatibility mode). On the code before the fix `wait`
    /// returned a bare `Error` and freed the buffer. Needs the cuFile driver to register a file:
    /// run with `GPUDIRECT_TEST_UDEV_FIX=1` (as root) where `/run/udev` is missing; without it,
    /// a registration refused for the missing udev record (the machine's documented state) is
    /// reported and checks nothing further.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_stream_io_wait_gives_back_the_buffer_of_a_failed_io() {
        use crate::storage::cufile::{classify_registration_failure, Driver, OpenMode};
        use crate::storage::testkit;
        let ctx = testkit::gpu();
        let stream = ctx.new_stream().unwrap();
        let driver = Driver::open().unwrap_or_else(|e| {
            panic!(
                "the cuFile driver did not open: {e} (set GPUDIRECT_CUFILE_LIB to libcufile.so.0)"
            )
        });
        let (path, _) = testkit::random_file("stream-wait-failed", 4096, 151);
        testkit::udev_fix(&path);
        let opened = CuFileHandle::open(Arc::clone(&driver), &path, OpenMode::ReadWrite);
        let h = match opened {
            Ok(h) => h,
            Err(e) => {
                let cause = classify_registration_failure(&e, &path);
                std::fs::remove_file(&path).unwrap();
                let fixed = std::env::var("GPUDIRECT_TEST_UDEV_FIX").is_ok_and(|v| v == "1");
                if !fixed && matches!(cause, crate::Cause::UdevDataMissing { .. }) {
                    eprintln!("registration refused as this machine's state predicts ({cause}); set GPUDIRECT_TEST_UDEV_FIX=1 (as root) to run this check");
                    return;
                }
                panic!("cuFile registration failed: {e} (cause: {cause})");
            }
        };
        let cases = [
            (false, -(libc::EIO as isize), "cuFileReadAsync"),
            (true, -5011, "cuFileWriteAsync"),
        ];
        for (i, (write, bytes, op)) in cases.into_iter().enumerate() {
            let sent = testkit::random(70_001, 152 + i as u64);
            let buf = stream.clone_htod(&sent).unwrap();
            stream.synchronize().unwrap();
            let io = StreamIo {
                params: Some(Box::new(Params {
                    size: sent.len(),
                    file_offset: 0,
                    buf_offset: 0,
                    bytes,
                })),
                stream: Arc::clone(buf.stream()),
                buf: Some(buf),
                handle: Arc::clone(h.inner()),
                write,
            };
            match io.wait() {
                Err(WaitError::Io(failed)) => {
                    let msg = failed.to_string();
                    assert!(msg.contains(op), "count {bytes}: {msg}");
                    let (e, back) = failed.into_parts();
                    match (&e, write) {
                        (Error::Io { source, .. }, false) => {
                            assert_eq!(source.raw_os_error(), Some(libc::EIO), "{e}")
                        }
                        (Error::CuFile { .. }, true) => {}
                        _ => panic!("count {bytes} decoded as {e:?}"),
                    }
                    assert_eq!(
                        back.len(),
                        sent.len(),
                        "the buffer came back with another length"
                    );
                    assert!(
                        stream.clone_dtoh(&back).unwrap() == sent,
                        "the buffer came back changed"
                    );
                }
                Err(other) => panic!("count {bytes}: not an IO failure: {other:?}"),
                Ok((n, _)) => panic!("count {bytes} decoded as {n} bytes moved"),
            }
        }
        drop(h);
        std::fs::remove_file(&path).unwrap();
    }

    /// A stream-ordered *read* writes the buffer, so its stream must wait for reads of the
    /// buffer still pending on other streams (cudarc's `device_ptr_mut`), not only for writes
    /// (`device_ptr`, the old behaviour: a write-after-read race with cuFile's DMA); and it
    /// records its write, so a later reader on another stream waits for it (cudarc 0.19.10:
    /// `device_ptr_mut` returns `SyncOnDrop::record_event(write, stream)`, and `memcpy_dtod`
    /// takes its source with `device_ptr`, which makes the copying stream wait for that event).
    /// Controls before each verdict: the gated stream is still busy, so "complete" can only
    /// mean a missing wait.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_stream_read_waits_for_pending_readers_on_other_streams() {
        let _gates = crate::cuda::HOST_FUNCTION_GATES
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let ctx = crate::cuda::context(0).unwrap_or_else(|e| {
            panic!("this test needs a CUDA GPU (run gpu_* tests on a GPU machine): {e}")
        });
        let io_stream = ctx.new_stream().unwrap();
        let reader = ctx.new_stream().unwrap();
        assert!(
            ctx.is_managing_stream_synchronization(),
            "cudarc event tracking is off"
        );
        // SAFETY: the streams are alive; the query has no other precondition.
        let busy = |s: &CudaStream| !unsafe { crate::cuda::result::stream::is_idle(s.cu_stream()) };
        let mut buf = io_stream.alloc_zeros::<u8>(1 << 20).unwrap();
        let mut copy = reader.alloc_zeros::<u8>(1 << 20).unwrap();
        io_stream.synchronize().unwrap();
        reader.synchronize().unwrap();
        // A reader of `buf` on another stream, held behind a gate: cudarc records `buf`'s read
        // event after it.
        let mut gate = Gate::block(&reader);
        reader.memcpy_dtod(&buf, &mut copy).unwrap();
        let marker = ctx.new_event(None).unwrap();
        {
            let (_ptr, _record) = io_pointer(&mut buf, &io_stream, false).unwrap();
            // Where the IO would be enqueued.
            marker.record(&io_stream).unwrap();
        }
        std::thread::sleep(Duration::from_millis(200));
        let gate_held = busy(&reader);
        let pending = marker.try_is_complete();
        gate.release();
        reader.synchronize().unwrap();
        io_stream.synchronize().unwrap();
        assert!(
            gate_held,
            "control: the gate did not hold the reader's stream"
        );
        assert_eq!(
            pending,
            Ok(false),
            "the IO stream ran ahead of a pending reader of the buffer on another stream: \
             a stream-ordered read must take the pointer with write intent (device_ptr_mut)"
        );
        // The write intent is recorded after the IO, so a later reader elsewhere waits for it.
        let later = ctx.new_event(None).unwrap();
        let io_done = ctx.new_event(None).unwrap();
        let mut gate = Gate::block(&io_stream);
        {
            let (_ptr, _record) = io_pointer(&mut buf, &io_stream, false).unwrap();
            // Where the IO would be enqueued, behind the gate.
            io_done.record(&io_stream).unwrap();
        }
        reader.memcpy_dtod(&buf, &mut copy).unwrap();
        later.record(&reader).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let io_busy = busy(&io_stream);
        let io_done_query = io_done.try_is_complete();
        let pending = later.try_is_complete();
        gate.release();
        io_stream.synchronize().unwrap();
        reader.synchronize().unwrap();
        assert!(
            io_busy && io_done_query == Ok(false),
            "control: the gate did not hold the IO stream (nothing to judge the reader by): \
             stream busy {io_busy}, the event after the IO complete {io_done_query:?}"
        );
        assert_eq!(
            pending,
            Ok(false),
            "a reader on another stream did not wait for the stream-ordered read's write"
        );
    }
}

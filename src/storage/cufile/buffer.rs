//! Device pointers as cuFile wants them, and registered buffers (`cuFileBufRegister`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys as cu, CudaSlice, CudaView, CudaViewMut};

use super::{result, Driver};
use crate::error::{Error, Result};

/// The allocation containing `ptr`: `(base, size in bytes)` (`cuMemGetAddressRange`).
///
/// cuFile wants the allocation (or registered) base plus an offset, not an interior pointer.
/// Only called with pointers of live cudarc buffers, whose context exists, so libcuda is loaded.
pub(in crate::storage) fn allocation_range(
    ptr: cu::CUdeviceptr,
) -> Result<(cu::CUdeviceptr, usize)> {
    // SAFETY: a cudarc buffer exists, so libcuda is loaded and initialised (crate::cuda's door
    // was passed to create its context).
    unsafe { crate::cuda::result::mem::get_address_range(ptr) }
}

/// The error of a cuFile call that was handed a device buffer by value and did not keep it
/// ([`CuFileHandle::read_async`](super::CuFileHandle::read_async),
/// [`write_async`](super::CuFileHandle::write_async), [`RegisteredBuffer::register`], and
/// [`StreamIo::wait`](super::StreamIo::wait) of an IO that failed): the [`Error`], and the
/// buffer given back.
///
/// `read_async`, `write_async` and `register` fail before any IO is enqueued or anything is
/// registered, so the buffer comes back with its bytes unchanged and usable (and a refused
/// capturing stream untouched), instead of being dropped inside the call: cudarc's `CudaSlice`
/// drop frees with `cuMemFreeAsync` on the buffer's stream, which on a stream capturing a CUDA
/// graph (a refusal's most likely cause) would put the free into the caller's graph or fail.
/// `wait` gives it back once the stream has synchronised and the IO is over (in a
/// [`WaitError::Io`](super::WaitError::Io)): after a failed write it is unchanged, after a
/// failed read part of the range it was given may have been written. As
/// `std::io::IntoInnerError` and `String::from_utf8`'s `FromUtf8Error` hand back what they were
/// given, and as [`GpuFile`](crate::storage::GpuFile)'s transfers give back their buffer with
/// their result:
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use std::path::Path;
/// use gpudirect::storage::cufile::{CuFileHandle, Driver, OpenMode};
/// let stream = gpudirect::cuda::context(0)?.new_stream()?;
/// let h = CuFileHandle::open(Driver::open()?, Path::new("weights.bin"), OpenMode::Read)?;
/// let buf = stream.alloc_zeros::<u8>(1 << 20)?;
/// let (n, buf) = match h.read_async(buf, 0, 1 << 20, 0) {
///     Ok(io) => io.wait()?, // a failed IO: see WaitError to keep the buffer
///     Err(refused) => {
///         eprintln!("not enqueued: {refused}");
///         // Still ours, its bytes unchanged: read it synchronously instead.
///         let mut buf = refused.into_buffer();
///         (h.read(&mut buf, 0)?, buf)
///     }
/// };
/// # drop((n, buf)); Ok(()) }
/// ```
///
/// `?` (through `From<BufferError> for Error`) and [`into_error`](Self::into_error) keep the
/// error and free the buffer, as dropping the `BufferError` does: with the buffer's context
/// bound (cudarc's drop does not bind it), on the buffer's stream, so into a graph if that
/// stream is still capturing. Take the buffer back first ([`into_buffer`](Self::into_buffer),
/// [`into_parts`](Self::into_parts)) to keep it, or to free it after the capture.
pub struct BufferError(Option<Box<(Error, CudaSlice<u8>)>>);

impl BufferError {
    pub(super) fn new(error: Error, buffer: CudaSlice<u8>) -> Self {
        BufferError(Some(Box::new((error, buffer))))
    }

    fn parts(&self) -> &(Error, CudaSlice<u8>) {
        self.0.as_deref().expect("present until consumed")
    }

    /// Why the call failed.
    pub fn error(&self) -> &Error {
        &self.parts().0
    }

    /// The buffer the call was given: unchanged, except after a failed stream-ordered read
    /// ([`StreamIo::wait`](super::StreamIo::wait)), which may have written part of its range.
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.parts().1
    }

    /// The error and the buffer.
    pub fn into_parts(mut self) -> (Error, CudaSlice<u8>) {
        *self.0.take().expect("present until consumed")
    }

    /// The buffer (see [`buffer`](Self::buffer)); the error is dropped.
    pub fn into_buffer(self) -> CudaSlice<u8> {
        self.into_parts().1
    }

    /// The error; the buffer is freed (see the type's docs).
    pub fn into_error(self) -> Error {
        let (error, buffer) = self.into_parts();
        free_bound(buffer);
        error
    }
}

/// Drops `buf` with its context bound (cudarc's `CudaSlice` drop frees with `cuMemFreeAsync`
/// without binding, which fails and leaks on a thread with no current context), then puts the
/// thread's current context back.
fn free_bound(buf: CudaSlice<u8>) {
    let _restore = crate::cuda::CurrentContext::save();
    let _ = crate::cuda::bind(buf.context());
    drop(buf);
}

impl Drop for BufferError {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let (_error, buffer) = *p;
            free_bound(buffer);
        }
    }
}

impl From<BufferError> for Error {
    fn from(e: BufferError) -> Self {
        e.into_error()
    }
}

impl std::fmt::Debug for BufferError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (error, buffer) = self.parts();
        f.debug_struct("BufferError")
            .field("error", error)
            .field("buffer_len", &buffer.len())
            .finish()
    }
}

/// The error's message (the buffer is not part of it).
impl std::fmt::Display for BufferError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self.error(), f)
    }
}

/// Transparent, as the message: the error's own source.
impl std::error::Error for BufferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(self.error())
    }
}

/// A device buffer registered with cuFile (`cuFileBufRegister`) for the life of this value.
///
/// Owns the [`CudaSlice`] so the memory cannot be freed while registered. The registration
/// covers the whole allocation that holds the slice (its base, as cuFile requires), in bytes.
/// IO through [`CuFileHandle`](super::CuFileHandle) into any view of it uses the registration
/// automatically (cuFile then skips its bounce buffers when the GDS path is active).
///
/// Dropping it calls `cuFileBufDeregister` (failures are logged, never panic), then frees the
/// slice.
///
/// The slice is reachable only through views ([`as_view`](Self::as_view),
/// [`as_view_mut`](Self::as_view_mut)) and `&CudaSlice` ([`slice`](Self::slice)), never as
/// `&mut CudaSlice`: with one, `mem::replace` could move the registered allocation out and free
/// it while cuFile keeps it registered ([CONTRIBUTING.md, "cuFile
/// quirks"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cufile-quirks)).
/// Kernels and copies take the mutable view:
///
/// ```no_run
/// # use gpudirect::storage::cufile::RegisteredBuffer;
/// fn fill(rb: &mut RegisteredBuffer, stream: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>) {
///     let mut view = rb.as_view_mut();
///     stream.memset_zeros(&mut view).unwrap();
/// }
/// ```
///
/// ```compile_fail,E0599
/// # use gpudirect::storage::cufile::RegisteredBuffer;
/// # use gpudirect::cudarc::driver::CudaSlice;
/// fn swap(rb: &mut RegisteredBuffer, other: CudaSlice<u8>) -> CudaSlice<u8> {
///     std::mem::replace(rb.slice_mut(), other) // no `&mut CudaSlice` to swap
/// }
/// ```
#[derive(Debug)]
pub struct RegisteredBuffer {
    // Field order: deregistration happens in Drop's body, then `slice` is freed.
    base: cu::CUdeviceptr,
    registered_len: usize,
    driver: Arc<Driver>,
    slice: Option<CudaSlice<u8>>,
}

impl RegisteredBuffer {
    /// Registers `slice`'s allocation with cuFile (`cuFileBufRegister`, flags 0).
    ///
    /// Errors: `CU_FILE_MEMORY_ALREADY_REGISTERED`, `CU_FILE_GPU_MEMORY_PINNING_FAILED` (budget:
    /// [`DriverProperties::max_device_pinned_mem_kb`](super::DriverProperties::max_device_pinned_mem_kb)),
    /// CUDA errors — all as [`Error::CuFile`]; the slice's stream capturing a CUDA graph →
    /// [`Error::Unsupported`], before anything is enqueued or registered (the call synchronises
    /// the stream, which a capture forbids); an empty slice → [`Error::InvalidArgument`]. Each
    /// comes in a [`BufferError`] that gives the slice back unchanged (nothing stays
    /// registered).
    pub fn register(driver: Arc<Driver>, slice: CudaSlice<u8>) -> Result<Self, BufferError> {
        Self::register_checking(driver, slice, Some("RegisteredBuffer::register"))
    }

    /// [`register`](Self::register), refusing a capturing stream (naming `call`) unless `call`
    /// is `None` (the caller refused it).
    fn register_checking(
        driver: Arc<Driver>,
        slice: CudaSlice<u8>,
        call: Option<&str>,
    ) -> Result<Self, BufferError> {
        // `enter` binds the slice's context: the caller's is put back after.
        let _restore = crate::cuda::CurrentContext::save();
        match Self::pin(&driver, &slice, call) {
            Ok((base, len)) => Ok(RegisteredBuffer {
                base,
                registered_len: len,
                driver,
                slice: Some(slice),
            }),
            Err(e) => Err(BufferError::new(e, slice)),
        }
    }

    /// Registers the allocation holding `slice`: its `(base, length)`. Nothing is registered
    /// when it fails.
    fn pin(
        driver: &Driver,
        slice: &CudaSlice<u8>,
        call: Option<&str>,
    ) -> Result<(cu::CUdeviceptr, usize)> {
        if slice.is_empty() {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer with cuFile: allocate at least one byte".into(),
            ));
        }
        if let Some(call) = call {
            crate::cuda::refuse_capturing(slice.stream(), call)?;
        }
        let stream = Arc::clone(slice.stream());
        // Finish pending work (e.g. the allocation itself, stream-ordered) before pinning.
        driver.enter(&stream, true)?;
        let ptr = {
            let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(slice, &stream);
            p
        };
        let (base, len) = allocation_range(ptr)?;
        // SAFETY: `base..base+len` is the live allocation holding `slice`, which the caller
        // moves into the `RegisteredBuffer` that deregisters it in Drop before freeing it.
        unsafe { result::buf_register(driver.lib(), base as *const c_void, len, 0) }?;
        Ok((base, len))
    }

    /// Allocates `len` bytes on `stream`'s device and registers them. A `stream` capturing a
    /// CUDA graph → [`Error::Unsupported`], before anything is allocated.
    pub fn alloc(
        driver: Arc<Driver>,
        stream: &Arc<cudarc::driver::CudaStream>,
        len: usize,
    ) -> Result<Self> {
        crate::cuda::refuse_capturing(stream, "RegisteredBuffer::alloc")?;
        // SAFETY: the bytes are uninitialised device memory; reading them before a write
        // returns unspecified values but is not undefined behaviour for u8.
        let slice = unsafe { stream.alloc::<u8>(len) }.map_err(|e| Error::cuda("cuMemAlloc", e))?;
        // A refused allocation is freed (its stream is not capturing: refused above).
        Self::register_checking(driver, slice, None).map_err(BufferError::into_error)
    }

    /// The registered base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes registered (the whole allocation, at least [`len`](Self::len)).
    pub fn registered_len(&self) -> usize {
        self.registered_len
    }

    /// Length of the owned slice in bytes.
    pub fn len(&self) -> usize {
        self.slice().len()
    }

    /// True for an empty slice (never: registration refuses it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The owned slice.
    pub fn slice(&self) -> &CudaSlice<u8> {
        self.slice.as_ref().expect("slice is present until drop")
    }

    /// A view of the whole buffer.
    pub fn as_view(&self) -> CudaView<'_, u8> {
        self.slice().as_view()
    }

    /// A mutable view of the whole buffer (pass it to `CuFileHandle::read`).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, u8> {
        // A view, never `&mut CudaSlice`: it cannot be swapped for another allocation.
        self.slice
            .as_mut()
            .expect("slice is present until drop")
            .as_view_mut()
    }

    /// Deregisters and returns the slice; a failed `cuFileBufDeregister` gives the buffer back.
    pub fn into_inner(mut self) -> std::result::Result<CudaSlice<u8>, Box<(Self, Error)>> {
        match self.deregister() {
            Ok(()) => Ok(self.slice.take().expect("slice is present until drop")),
            Err(e) => Err(Box::new((self, e))),
        }
    }

    fn deregister(&mut self) -> Result<()> {
        if self.base == 0 {
            return Ok(());
        }
        let _restore = crate::cuda::CurrentContext::save();
        if let Some(s) = self.slice.as_ref() {
            // cuFile requires no IO in flight; sync IO is complete on return, and the stream
            // may still hold kernels touching the memory, which is harmless for deregistration.
            let _ = crate::cuda::bind(s.context());
        }
        // SAFETY: `base` was registered by `register` and has not been deregistered (set to 0
        // after success). Synchronous IO has completed; stream and batch IO guards borrow the
        // buffer, so none is in flight while `&mut self` exists.
        unsafe { result::buf_deregister(self.driver.lib(), self.base as *const c_void) }?;
        self.base = 0;
        Ok(())
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // The slice is freed inside the guard too: cudarc's `CudaSlice` drop binds its context
        // to the thread, and the caller's current context is put back only after it.
        let _restore = crate::cuda::CurrentContext::save();
        if let Err(e) = self.deregister() {
            // The memory stays registered with cuFile: freeing it would let a later allocation
            // at the same address be served through the stale registration, so it leaks.
            tracing::warn!(error = %e, "cuFileBufDeregister failed; the registered memory leaks");
            std::mem::forget(self.slice.take());
            return;
        }
        drop(self.slice.take());
    }
}

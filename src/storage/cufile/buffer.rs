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
    /// the stream, which a capture forbids). A refused slice is freed.
    pub fn register(driver: Arc<Driver>, slice: CudaSlice<u8>) -> Result<Self> {
        Self::register_checking(driver, slice, Some("RegisteredBuffer::register"))
    }

    /// [`register`](Self::register), refusing a capturing stream (naming `call`) unless `call`
    /// is `None` (the caller refused it).
    fn register_checking(
        driver: Arc<Driver>,
        slice: CudaSlice<u8>,
        call: Option<&str>,
    ) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        // A local after the guard: a refused slice is freed before the guard puts the caller's
        // context back (parameters drop after locals), with its context bound (cudarc's drop
        // frees without binding, which fails and leaks on a thread with no current context).
        let slice = slice;
        let _ = slice.context().bind_to_thread();
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
            let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&slice, &stream);
            p
        };
        let (base, len) = allocation_range(ptr)?;
        // SAFETY: `base..base+len` is the live allocation holding `slice`, which this value owns
        // until after cuFileBufDeregister in Drop.
        unsafe { result::buf_register(driver.lib(), base as *const c_void, len, 0) }?;
        Ok(RegisteredBuffer {
            base,
            registered_len: len,
            driver,
            slice: Some(slice),
        })
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
        Self::register_checking(driver, slice, None)
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
            let _ = s.context().bind_to_thread();
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

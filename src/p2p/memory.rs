//! [`DeviceBuffer`]: `cuMemAlloc` memory (not the stream-ordered pool cudarc allocates from),
//! seen as a cudarc [`CudaSlice`]. Needed for legacy CUDA IPC (`cuIpcGetMemHandle` accepts only
//! `cuMemAlloc` memory) and to exercise the context-peer-access path.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};

use crate::cuda::result as r;
use crate::error::{Error, Result};

/// A zero-initialised `cuMemAlloc` allocation of `len` elements, usable wherever cudarc takes a
/// `CudaSlice`/`CudaView` (through [`DeviceBuffer::slice`], [`DeviceBuffer::as_view`],
/// [`DeviceBuffer::as_view_mut`]). Freed with `cuMemFree` on drop, after its stream finished.
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    /// Never dropped by cudarc: leaked in our Drop before `cuMemFree`.
    slice: ManuallyDrop<CudaSlice<T>>,
    ptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceBuffer<T> {
    /// Allocates `len` zeroed elements with `cuMemAlloc` in `stream`'s context.
    pub fn alloc_zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow usize")))?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the stream's context is current (bound above).
        let ptr = unsafe { r::mem::alloc(bytes) }?;
        // SAFETY: `ptr` is a fresh allocation of at least `bytes` bytes in this context; it is
        // zeroed right below, and the CudaSlice is never dropped by cudarc (ManuallyDrop).
        let mut slice = ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) });
        let buf_zero = stream.memset_zeros(&mut *slice);
        let buf = DeviceBuffer {
            slice,
            ptr,
            stream: stream.clone(),
        };
        buf_zero.map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        Ok(buf)
    }
}

impl<T> DeviceBuffer<T> {
    slice_accessors!();

    /// The raw device address (`CUdeviceptr`).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The stream the buffer was allocated on (and is freed after).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: taken exactly once, here; the field is not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        // Orders the stream after the slice's recorded uses and releases cudarc's events.
        let _ = slice.leak();
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(%e, "gpudirect DeviceBuffer: stream synchronize failed before cuMemFree");
        }
        if let Err(e) = self.stream.context().bind_to_thread() {
            tracing::warn!(%e, "gpudirect DeviceBuffer: cannot bind context; leaking allocation");
            return;
        }
        // SAFETY: `ptr` came from cuMemAlloc in this context and the stream has finished all
        // work that used it; cudarc no longer owns it (leaked above).
        if let Err(e) = unsafe { r::mem::free(self.ptr) } {
            tracing::warn!(%e, "gpudirect DeviceBuffer: cuMemFree failed");
        }
    }
}

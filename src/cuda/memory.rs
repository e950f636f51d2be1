//! Device memory of our own: [`DeviceBuffer`], the one `cuMemAlloc` allocation type (its two
//! layouts a constructor choice carried in the type), and [`DeviceMemory`], the one trait for
//! "device memory a room may hand to the driver or a NIC by address".

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};

use super::result as r;
use super::AnyBitPattern;
use crate::error::{Error, Result};

/// The GPU page size (64 KiB) that peer-memory clients pin at; [`GdrBuffer`] starts on it.
pub const GPU_PAGE_SIZE: usize = 64 * 1024;

mod sealed {
    pub trait Sealed {}
}

/// How a [`DeviceBuffer`] sits in its `cuMemAlloc` allocation: [`Plain`] or
/// [`GpuPageAligned`]. Sealed.
pub trait Layout: sealed::Sealed + Send + Sync + 'static {
    /// Start on a 64 KiB GPU page, size rounded up to one, `SYNC_MEMOPS` set.
    const GPU_PAGE_ALIGNED: bool;
}

/// The allocation as `cuMemAlloc` returns it (256-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plain;

/// Aligned to a 64 KiB GPU page with `SYNC_MEMOPS` set: GPUDirect-RDMA ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPageAligned;

impl sealed::Sealed for Plain {}
impl Layout for Plain {
    const GPU_PAGE_ALIGNED: bool = false;
}
impl sealed::Sealed for GpuPageAligned {}
impl Layout for GpuPageAligned {
    const GPU_PAGE_ALIGNED: bool = true;
}

/// A `cuMemAlloc` allocation of `T`s, usable wherever cudarc takes a `CudaSlice`/`CudaView`,
/// freed with `cuMemFree` on drop after its stream finished.
///
/// The drop waits for all of the context's work, other streams' included (`cuMemFree` does):
/// do not drop one while another stream waits for the dropping thread (a host function or a
/// kernel waiting for a flag it sets later), which would never return. A free in the order of
/// the buffer's stream would not wait, but it is not sound here: cudarc keeps one read and one
/// write event per slice, so a buffer read on two streams would be freed after the last read
/// only (CONTRIBUTING.md, "CUDA pointer facts").
///
/// cudarc allocates from the stream-ordered pool (`cuMemAllocAsync`); some jobs need
/// `cuMemAlloc` memory instead: legacy CUDA IPC (`cuIpcGetMemHandle` accepts only `cuMemAlloc`
/// memory), the context-peer-access path, and GPUDirect RDMA (pool memory reports
/// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 0`: [CONTRIBUTING.md, "CUDA pointer
/// facts"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cuda-pointer-facts)).
/// The layout is a constructor choice, carried in the type:
/// - `DeviceBuffer<T>` ([`Plain`]): the allocation as `cuMemAlloc` returns it, zeroed
///   ([`DeviceBuffer::alloc_zeros`]); what legacy IPC needs.
/// - [`GdrBuffer<T>`] ([`GpuPageAligned`]): starts on a 64 KiB GPU page, size rounded up to one,
///   `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` set ([`GdrBuffer::alloc`], [`GdrBuffer::zeroed`]), so
///   peer-memory clients (which pin whole GPU pages) and dma-buf export (host-page aligned)
///   never reach memory that belongs to someone else, and synchronous copies complete before a
///   NIC can read the bytes.
///
/// cudarc code sees either as a [`CudaSlice`] ([`as_slice`](Self::as_slice)) or views, so
/// kernels, `memcpy_htod`/`memcpy_dtoh` and `launch_builder` work unchanged. The slice is never
/// dropped by cudarc (which would free it with `cuMemFreeAsync`).
///
/// Which of gpudirect's allocation types (and cudarc's) for what: [the crate
/// docs](crate#which-allocation-type-for-what).
#[derive(Debug)]
pub struct DeviceBuffer<T = u8, L: Layout = Plain> {
    /// Never dropped by cudarc: leaked in our Drop before `cuMemFree`.
    slice: ManuallyDrop<CudaSlice<T>>,
    /// What cuMemAlloc returned (may precede `start` by the alignment padding).
    base: sys::CUdeviceptr,
    /// `slice`'s pointer: the first element.
    start: sys::CUdeviceptr,
    /// Bytes from `start` to the end of the allocation.
    capacity: usize,
    layout: PhantomData<L>,
}

/// A GPUDirect-RDMA-capable device allocation (`cuMemAlloc`, 64 KiB aligned, `SYNC_MEMOPS`
/// set): [`DeviceBuffer`] with the [`GpuPageAligned`] layout.
pub type GdrBuffer<T = u8> = DeviceBuffer<T, GpuPageAligned>;

fn round_up(x: usize, to: usize) -> Option<usize> {
    x.checked_add(to - 1).map(|v| v / to * to)
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceBuffer<T, Plain> {
    /// Allocates `len` zeroed elements with `cuMemAlloc` in `stream`'s context (the zeroing is
    /// ordered on `stream`).
    pub fn alloc_zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let _restore = super::CurrentContext::save();
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow usize")))?;
        crate::cuda::bind(stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the stream's context is current (bound above).
        let ptr = unsafe { r::mem::alloc(bytes) }?;
        // SAFETY: `ptr` is a fresh allocation of at least `bytes` bytes in this context; it is
        // zeroed right below, and the CudaSlice is never dropped by cudarc (ManuallyDrop).
        let mut slice = ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) });
        let buf_zero = stream.memset_zeros(&mut *slice);
        let buf = DeviceBuffer {
            slice,
            base: ptr,
            start: ptr,
            capacity: bytes.max(1),
            layout: PhantomData,
        };
        buf_zero.map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        Ok(buf)
    }
}

impl<T> DeviceBuffer<T, Plain> {
    /// The memory as a cudarc slice (as [`as_slice`](Self::as_slice); the name p2p code uses).
    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T: DeviceRepr> DeviceBuffer<T, GpuPageAligned> {
    /// Allocates `len` elements of `T` with `cuMemAlloc` on `stream`'s device, 64 KiB aligned
    /// with `SYNC_MEMOPS` set; the buffer's cudarc operations are ordered on `stream`. The
    /// contents are unspecified: use [`GdrBuffer::zeroed`] or copy into it.
    ///
    /// Errors: [`Error::InvalidArgument`] for `len == 0`, CUDA absence errors from
    /// [`crate::cuda`], [`Error::Cuda`] naming `cuMemAlloc` (out of memory, ...).
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        super::driver_version()?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a GdrBuffer needs 1 or more elements that fit in memory, not {len}"
                ))
            })?;
        let rounded = round_up(bytes, GPU_PAGE_SIZE)
            .ok_or_else(|| Error::InvalidArgument(format!("{bytes} bytes is too large")))?;
        let ctx = stream.context();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: a context is current (bound above); the memory is only handed out as
        // `T: DeviceRepr` through cudarc, whose users must initialize it before reading (doc).
        let mut base = unsafe { r::mem::alloc(rounded) }?;
        let mut alloc_bytes = rounded;
        if base % GPU_PAGE_SIZE as u64 != 0 {
            // cuMemAlloc guarantees 256 B alignment only: over-allocate by one GPU page and start
            // on the next boundary (as GDRCopy's tests do).
            // SAFETY: `base` came from cuMemAlloc above and nothing else refers to it.
            if let Err(e) = unsafe { r::mem::free(base) } {
                tracing::warn!(error = %e, "cuMemFree of a misaligned GdrBuffer attempt failed");
            }
            alloc_bytes = rounded + GPU_PAGE_SIZE;
            // SAFETY: as above.
            base = unsafe { r::mem::alloc(alloc_bytes) }?;
        }
        let start = base.next_multiple_of(GPU_PAGE_SIZE as u64);
        let capacity = (base + alloc_bytes as u64 - start) as usize;
        debug_assert!(capacity >= bytes);
        // SYNC_MEMOPS: synchronous cuMemcpy/cuMemset complete before a NIC can read the bytes.
        if let Err(e) = super::set_sync_memops(start) {
            // SAFETY: `base` came from cuMemAlloc above; nothing refers to it yet.
            let _ = unsafe { r::mem::free(base) };
            return Err(e);
        }
        // SAFETY: `start..start + bytes` lies inside the cuMemAlloc allocation (capacity >=
        // rounded >= bytes); the slice is never dropped by cudarc (ManuallyDrop, taken back with
        // `leak` in Drop), so cudarc never frees it with the wrong call.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(start, len) };
        Ok(DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            base,
            start,
            capacity,
            layout: PhantomData,
        })
    }

    /// [`GdrBuffer::alloc`], then zero-filled on the stream (synchronized before returning).
    pub fn zeroed(stream: &Arc<CudaStream>, len: usize) -> Result<Self>
    where
        T: ValidAsZeroBits,
    {
        let mut b = Self::alloc(stream, len)?;
        stream
            .memset_zeros(&mut b.as_view_mut())
            .map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        Ok(b)
    }

    /// Copies `src` into the start of the buffer and waits for the copy
    /// (`cuMemcpyHtoDAsync` + `cuStreamSynchronize`).
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        if src.len() > self.len() {
            return Err(Error::InvalidArgument(format!(
                "{} elements do not fit in a GdrBuffer of {}",
                src.len(),
                self.len()
            )));
        }
        let stream = self.slice.stream().clone();
        let mut view = self.slice.slice_mut(0..src.len());
        stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))
    }

    /// Copies the start of the buffer into `dst` and waits for the copy
    /// (`cuMemcpyDtoHAsync` + `cuStreamSynchronize`).
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        if dst.len() > self.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot read {} elements from a GdrBuffer of {}",
                dst.len(),
                self.len()
            )));
        }
        let stream = self.slice.stream().clone();
        let view = self.slice.slice(0..dst.len());
        stream
            .memcpy_dtoh(&view, dst)
            .map_err(|e| Error::cuda("cuMemcpyDtoHAsync", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))
    }
}

impl<T> DeviceBuffer<T, GpuPageAligned> {
    /// A read-only sub-view, in elements (panics out of bounds, as cudarc's `slice` does).
    pub fn slice(&self, range: Range<usize>) -> CudaView<'_, T> {
        self.slice.slice(range)
    }

    /// A writable sub-view, in elements (panics out of bounds, as cudarc's `slice_mut` does).
    pub fn slice_mut(&mut self, range: Range<usize>) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(range)
    }
}

impl<T, L: Layout> DeviceBuffer<T, L> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Length in bytes.
    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    /// The device address of the first element (`CUdeviceptr`; 64 KiB aligned for
    /// [`GdrBuffer`]).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.start
    }

    /// Bytes from the first element to the end of the allocation (for [`GdrBuffer`], the
    /// length rounded up to 64 KiB: what a peer-memory client pins).
    pub fn capacity_bytes(&self) -> usize {
        self.capacity
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.slice.ordinal()
    }

    /// The stream the buffer was allocated on: its cudarc operations are ordered on it, and it
    /// is freed after it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// The buffer as cudarc's slice, for kernels and copies that take `&CudaSlice<T>`
    /// (`clone_dtoh`, `memcpy_dtod`, kernel arguments, ...).
    ///
    /// Only a shared reference is handed out: the slice cannot be swapped out or dropped.
    pub fn as_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The whole buffer as a read-only cudarc view.
    pub fn as_view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    /// The whole buffer as a writable cudarc view (kernels, `memcpy_htod`, `memset_zeros`,
    /// `copy_peer` destinations).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }
}

impl<T, L: Layout> Drop for DeviceBuffer<T, L> {
    fn drop(&mut self) {
        let _restore = super::CurrentContext::save();
        // SAFETY: the slice is taken exactly once, here; it is not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = slice.stream().clone();
        // Orders the stream after the slice's recorded uses and releases cudarc's events.
        let ptr = slice.leak();
        debug_assert_eq!(ptr, self.start);
        // Through the result layer: cudarc's synchronize returns (and takes) an error stored in
        // the caller's object without synchronizing.
        if let Err(e) = super::settle::synchronize(&stream) {
            tracing::warn!(error = %e, "gpudirect DeviceBuffer: cuStreamSynchronize before cuMemFree failed");
        }
        if let Err(e) = crate::cuda::bind(stream.context()) {
            tracing::warn!(error = %e, "gpudirect DeviceBuffer: cannot bind the context to free the buffer; leaking it");
            return;
        }
        // SAFETY: `base` came from cuMemAlloc in this context, is freed only here, and the
        // stream that ordered all cudarc work on it was synchronized above; cudarc no longer
        // owns it (leaked above).
        if let Err(e) = unsafe { r::mem::free(self.base) } {
            tracing::warn!(error = %e, "gpudirect DeviceBuffer: cuMemFree failed");
        }
    }
}

/// Device memory that a room may hand to the driver or a NIC by address: the pointer and length
/// always describe a live allocation owned by the value.
///
/// Sealed: implemented for [`DeviceBuffer`] (both layouts), cudarc's [`CudaSlice`] (pool memory:
/// RDMA registration refuses it unless forced) and `Arc`s of them. (`rdma::GpuMemory` is this
/// trait.)
///
/// A NIC or another device writes such memory with whatever bytes a peer sends, so the element
/// type must accept any bit pattern ([`AnyBitPattern`]): integers and floats register and
/// export,
///
/// ```no_run
/// # use std::sync::Arc;
/// # use gpudirect::cudarc::driver::CudaSlice;
/// # use gpudirect::rdma::{GdrBuffer, GpuMemoryRegion, GpuRegisterOptions, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, a: GdrBuffer<f32>, b: CudaSlice<u16>) -> gpudirect::Result<()> {
///     let _dmabuf = gpudirect::cuda::export_dmabuf(&a, 0..4096)?;
///     let _a = GpuMemoryRegion::register(pd, a)?;
///     let opts = GpuRegisterOptions { force_non_gdr_memory: true, ..Default::default() };
///     let len = b.num_bytes();
///     let _b = GpuMemoryRegion::register_with(pd, b, 0..len, opts)?;
///     Ok(())
/// }
/// ```
///
/// `bool` does not (an RDMA write of byte 2 into a `GdrBuffer<bool>` would make
/// `copy_to_host` return invalid `bool`s):
///
/// ```compile_fail,E0277
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{GdrBuffer, GpuMemoryRegion, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, buf: GdrBuffer<bool>) -> gpudirect::Result<()> {
///     let _mr = GpuMemoryRegion::register(pd, buf)?; // error: not every byte is a bool
///     Ok(())
/// }
/// ```
///
/// ```compile_fail,E0277
/// # use std::sync::Arc;
/// # use gpudirect::cudarc::driver::CudaSlice;
/// # use gpudirect::rdma::{GpuMemoryRegion, GpuRegisterOptions, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, b: CudaSlice<bool>) -> gpudirect::Result<()> {
///     let opts = GpuRegisterOptions { force_non_gdr_memory: true, ..Default::default() };
///     let len = b.num_bytes();
///     let _mr = GpuMemoryRegion::register_with(pd, b, 0..len, opts)?; // error: as above
///     Ok(())
/// }
/// ```
///
/// ```compile_fail,E0277
/// # use gpudirect::cuda::DeviceBuffer;
/// fn f(buf: &DeviceBuffer<bool>) -> gpudirect::Result<()> {
///     let _fd = gpudirect::cuda::export_dmabuf(buf, 0..4096)?; // error: as above
///     Ok(())
/// }
/// ```
pub trait DeviceMemory: sealed::Sealed + Send + Sync {
    /// The device address of the first byte.
    fn device_ptr(&self) -> sys::CUdeviceptr;
    /// Length in bytes.
    fn num_bytes(&self) -> usize;
    /// The CUDA context the memory belongs to.
    fn context(&self) -> &Arc<CudaContext>;
    /// Blocks until the GPU work cudarc ordered as writing this memory is done: everything
    /// queued on the memory's stream, and a write cudarc recorded from another stream (its
    /// event tracking, on when a context uses several streams). What a device outside CUDA (a
    /// NIC) must wait for before it reads the memory by address.
    fn wait_for_writes(&self) -> Result<()>;
}

/// [`DeviceMemory::wait_for_writes`] for the cudarc slice behind the memory: everything queued
/// on the slice's stream (its allocation and zeroing included), and a write cudarc recorded
/// from another stream. Binds the slice's context (callers restore the current one).
pub(crate) fn wait_for_slice_writes<T>(slice: &CudaSlice<T>) -> Result<()> {
    let stream = slice.stream();
    {
        // Read intent on the slice's own stream: cudarc makes the stream wait for the last
        // write recorded on another stream (cuStreamWaitEvent).
        let (_ptr, _record) = cudarc::driver::DevicePtr::device_ptr(slice, stream);
    }
    // cudarc records a failed cuStreamWaitEvent in the context instead of returning it.
    stream
        .context()
        .check_err()
        .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
    stream
        .synchronize()
        .map_err(|e| Error::cuda("cuStreamSynchronize", e))
}

impl<T: AnyBitPattern, L: Layout> sealed::Sealed for DeviceBuffer<T, L> {}
impl<T: AnyBitPattern, L: Layout> DeviceMemory for DeviceBuffer<T, L> {
    fn device_ptr(&self) -> sys::CUdeviceptr {
        self.start
    }
    fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }
    fn context(&self) -> &Arc<CudaContext> {
        self.slice.context()
    }
    fn wait_for_writes(&self) -> Result<()> {
        wait_for_slice_writes(&self.slice)
    }
}

impl<T: AnyBitPattern> sealed::Sealed for CudaSlice<T> {}
impl<T: AnyBitPattern> DeviceMemory for CudaSlice<T> {
    fn device_ptr(&self) -> sys::CUdeviceptr {
        let (ptr, _guard) = cudarc::driver::DevicePtr::device_ptr(self, self.stream());
        ptr
    }
    fn num_bytes(&self) -> usize {
        CudaSlice::num_bytes(self)
    }
    fn context(&self) -> &Arc<CudaContext> {
        CudaSlice::context(self)
    }
    fn wait_for_writes(&self) -> Result<()> {
        wait_for_slice_writes(self)
    }
}

impl<M: DeviceMemory + ?Sized> sealed::Sealed for Arc<M> {}
impl<M: DeviceMemory + ?Sized> DeviceMemory for Arc<M> {
    fn device_ptr(&self) -> sys::CUdeviceptr {
        (**self).device_ptr()
    }
    fn num_bytes(&self) -> usize {
        (**self).num_bytes()
    }
    fn context(&self) -> &Arc<CudaContext> {
        (**self).context()
    }
    fn wait_for_writes(&self) -> Result<()> {
        (**self).wait_for_writes()
    }
}

/// A device buffer gpudirect allocates for a read (`read_to_gpu`, a checkpoint's one
/// allocation, a batch's destination) of at least this many bytes comes from `cuMemAlloc`;
/// smaller ones from cudarc's stream-ordered pool. A large pool allocation is slow, the first
/// time in a process most (a 4 GiB `cuMemAllocAsync` took 5.6–7.5 ms in a loop, 17 ms as the
/// pool's first, and 6.5–10 ms beside a starting `read_to_gpu`, on the H200, against
/// 0.36–0.53 ms for `cuMemAlloc`: CONTRIBUTING.md, "CUDA pointer facts"), and a one-shot
/// read's copies wait for it. Freeing is no dearer in a loop: cudarc's `cuMemFreeAsync` of a
/// written 4 GiB `cuMemAlloc` buffer took 0.01 ms and the stream sync after it 2.4–2.9 ms
/// (the process's first such free 11.2 ms), against 0.01 ms and 7.6–9.9 ms for pool memory
/// (the pool gives it back at the sync: release threshold 0). `cuMemAlloc` memory is also
/// GPUDirect RDMA capable and exports as a dma-buf, which pool memory is not.
pub(crate) const DIRECT_ALLOC_MIN: usize = 64 << 20;

/// `len` uninitialised `T`s in `stream`'s context, as a cudarc slice: `cuMemAlloc` from
/// [`DIRECT_ALLOC_MIN`] bytes on (usable by work on any stream at once), cudarc's stream-ordered
/// pool below (ordered on `stream`, as `stream.alloc`); no allocation for `len` 0 (cudarc's
/// empty slice). The calling thread's current context is left as it was. A `cuMemAlloc` that
/// runs out of memory is tried once more after synchronizing `stream` (frees cudarc queued on
/// it complete; frees queued on other streams are not waited for); its error when that fails
/// too.
///
/// The slice is cudarc's and cudarc frees it: with `cuMemFreeAsync` on its stream, which the
/// CUDA programming guide allows for `cuMemAlloc` memory ("Stream Ordered Memory Allocator":
/// the same guarantee that accesses completed before the free), or `cuMemFree` where the
/// device has no pools.
///
/// # Safety
/// As cudarc's `CudaStream::alloc`: the memory is uninitialised, so `T` must be valid for
/// every bit pattern, or every element written before it is read.
pub(crate) unsafe fn alloc_uninit<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow usize")))?;
    if bytes == 0 {
        return stream.null::<T>().map_err(|e| Error::cuda("cuMemAlloc", e));
    }
    let _restore = super::CurrentContext::save();
    if bytes < DIRECT_ALLOC_MIN {
        // SAFETY: the caller's contract (uninitialised memory).
        return unsafe { stream.alloc::<T>(len) }.map_err(|e| Error::cuda("cuMemAllocAsync", e));
    }
    crate::cuda::bind(stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
    // SAFETY: the stream's context is current (bound above).
    let ptr = match unsafe { r::mem::alloc(bytes) } {
        Err(Error::Cuda { source, .. }) if source.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            // cudarc frees its slices with `cuMemFreeAsync` on their streams: a dropped buffer's
            // memory comes back only once its stream reached the free (where a pool allocation
            // on that stream would reuse it at once). Wait for `stream`'s queued frees (a
            // `read_to_gpu` / drop loop frees on the stream it reads on) and try once more.
            // Only `stream`, never the whole context: another stream may hold work that never
            // ends while this runs (a persistent kernel, a collective waiting for a peer), and
            // the caller's work is ordered after `stream`'s anyway.
            stream
                .synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
            crate::cuda::bind(stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
            // SAFETY: as above (the stream's context is current: bound right above).
            unsafe { r::mem::alloc(bytes) }?
        }
        other => other?,
    };
    // SAFETY: `ptr` is a fresh `cuMemAlloc` allocation of `bytes` = `len` elements in the
    // stream's context, owned by the slice from here on (cudarc frees it on drop); the
    // contents are the caller's contract.
    Ok(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) })
}

/// [`alloc_uninit`] for work on any stream at once (an engine job's destination allocated while
/// it reads, written on the engine's own streams): a pool allocation (below
/// [`DIRECT_ALLOC_MIN`]) is ordered on `stream`, so `stream` is synchronized first;
/// `cuMemAlloc` memory is usable as soon as it exists. Returns the slice and its address.
///
/// # Safety
/// As [`alloc_uninit`].
pub(crate) unsafe fn alloc_uninit_ready<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<(CudaSlice<T>, sys::CUdeviceptr)> {
    // SAFETY: the caller's contract.
    let mut b = unsafe { alloc_uninit::<T>(stream, len) }?;
    let (dptr, record) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut b, stream);
    drop(record);
    if b.num_bytes() < DIRECT_ALLOC_MIN {
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
    }
    Ok((b, dptr))
}

/// Lets go of cudarc's view of memory gpudirect will unmap or free itself: orders `stream`
/// after the view's recorded uses and releases cudarc's events (`CudaSlice::leak`), then waits
/// for `stream`, so that no queued work touches the memory when the caller's unmap runs. A
/// failed synchronisation is logged (naming `what`); the caller goes on.
pub(crate) fn release_slice_view<T>(slice: CudaSlice<T>, stream: &CudaStream, what: &str) {
    let _ = slice.leak();
    if let Err(e) = stream.synchronize() {
        tracing::warn!(%e, "gpudirect {what}: stream synchronize failed before unmap");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_pages_round_up() {
        assert!(round_up(1, GPU_PAGE_SIZE) == Some(GPU_PAGE_SIZE));
        assert!(round_up(GPU_PAGE_SIZE, GPU_PAGE_SIZE) == Some(GPU_PAGE_SIZE));
        assert!(round_up(usize::MAX, GPU_PAGE_SIZE).is_none());
    }

    /// Blocks the stream it is enqueued on for [`GATE`].
    unsafe extern "C" fn gate(_: *mut std::ffi::c_void) {
        std::thread::sleep(GATE);
    }
    const GATE: std::time::Duration = std::time::Duration::from_millis(300);

    /// Issue 9 item 15, the GPU half (needs no NIC): the wait that RDMA's post-and-wait helpers
    /// run before the NIC reads GPU memory (`rdma::GpuMemoryRegion::prepare_for_nic`, i.e.
    /// [`DeviceMemory::wait_for_writes`]) returns only after a copy into the memory that is
    /// still queued behind a 300 ms host function: on the memory's own stream, and on another
    /// stream (cudarc's write event). Control: right after enqueueing, the stream is busy,
    /// which is when the helpers used to post.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_nic_reads_wait_for_pending_gpu_writes() {
        use rand::RngCore;
        use std::time::{Duration, Instant};
        let _gates = crate::cuda::HOST_FUNCTION_GATES
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        const N: usize = (1 << 20) + 7;
        let ctx = crate::cuda::context(0).unwrap_or_else(|e| {
            panic!("needs a CUDA GPU (driver and device 0; see CUDA_VISIBLE_DEVICES): {e}")
        });
        let own = ctx.default_stream();
        let other = ctx.new_stream().unwrap();
        assert!(
            ctx.is_managing_stream_synchronization(),
            "cudarc event tracking is off"
        );
        let mut pattern = vec![0u8; N];
        rand::rng().fill_bytes(&mut pattern);
        for (case, stream) in [("the memory's stream", &own), ("another stream", &other)] {
            let mut src = GdrBuffer::<u8>::alloc(&own, N).unwrap();
            src.copy_from_host(&pattern).unwrap();
            let mut buf = GdrBuffer::<u8>::zeroed(&own, N).unwrap();
            // SAFETY: `gate` only sleeps (no CUDA call); it takes no argument.
            unsafe {
                cudarc::driver::result::stream::launch_host_function(
                    stream.cu_stream(),
                    gate,
                    std::ptr::null_mut(),
                )
            }
            .unwrap();
            stream
                .memcpy_dtod(&src.as_view(), &mut buf.as_view_mut())
                .unwrap();
            // SAFETY: the stream is live; the query has no other precondition.
            let busy = !unsafe { r::stream::is_idle(stream.cu_stream()) };
            assert!(busy, "{case}: control: the gate did not hold the stream");
            let t0 = Instant::now();
            buf.wait_for_writes().unwrap();
            let waited = t0.elapsed();
            // SAFETY: as above.
            let idle = unsafe { r::stream::is_idle(stream.cu_stream()) };
            println!("{case}: wait_for_writes returned after {waited:?}; stream idle: {idle}");
            assert!(
                idle,
                "{case}: the copy was still queued when wait_for_writes returned"
            );
            assert!(
                waited >= GATE - Duration::from_millis(50),
                "{case}: waited only {waited:?}"
            );
            let mut back = vec![0u8; N];
            buf.copy_to_host(&mut back).unwrap();
            assert!(
                back == pattern,
                "{case}: the buffer does not hold the copied bytes"
            );
        }
    }

    /// Review 13, finding 5 (fixed by 04b415c), at the buffers' drop: a [`DeviceBuffer`]'s
    /// drop synchronizes its stream before `cuMemFree`; through cudarc's
    /// `CudaStream::synchronize` that first ran the object's `check_err` (in its
    /// `bind_to_thread`), which takes an error stored in the caller's object, returns it
    /// without synchronizing, and the drop only logged it: the caller's error was gone. The
    /// error is the caller's (an earlier call of its could not return it, `record_err`): the
    /// drop must leave it in the object. Through an object of the test's own over device 0's
    /// primary context (`CudaContext::new`) holding `CUDA_ERROR_UNKNOWN`: a 1 MiB
    /// `DeviceBuffer` and a 1 MiB `GdrBuffer` on its default stream, each dropped with no
    /// context current and with the buffer's. On the code before the fix (f8400dd) every case
    /// is expected to fail: "a DeviceBuffer, no context current: the caller's stored error is
    /// gone from its object (taken by the drop)". (The synchronize the old code skipped is not
    /// seen here: `cuMemFree` waits for the context's work itself.)
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_device_buffer_drops_leave_the_callers_stored_error_alone() {
        use cudarc::driver::DriverError;
        let _ = crate::cuda::context(0).unwrap_or_else(|e| {
            panic!("needs a CUDA GPU (driver and device 0; see CUDA_VISIBLE_DEVICES): {e}")
        });
        const N: usize = 1 << 20;
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        let mut bad = Vec::new();
        for kind in ["a DeviceBuffer", "a GdrBuffer"] {
            for bound in [false, true] {
                let case = format!(
                    "{kind}, {}",
                    if bound {
                        "the context current"
                    } else {
                        "no context current"
                    }
                );
                let buf: Box<dyn std::any::Any> = match kind {
                    "a DeviceBuffer" => {
                        Box::new(DeviceBuffer::<u8>::alloc_zeros(&stream, N).unwrap())
                    }
                    _ => Box::new(GdrBuffer::<u8>::zeroed(&stream, N).unwrap()),
                };
                // SAFETY: null unbinds; the context is alive (`ctx`).
                let rc = unsafe {
                    r::ctx::set_current(if bound {
                        ctx.cu_ctx()
                    } else {
                        std::ptr::null_mut()
                    })
                };
                assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuCtxSetCurrent");
                let _ = ctx.check_err();
                ctx.record_err::<()>(Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)));
                drop(buf);
                match ctx.check_err() {
                    Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)) => {}
                    Err(e) => bad.push(format!("{case}: another error is stored now: {e:?}")),
                    Ok(()) => bad.push(format!(
                        "{case}: the caller's stored error is gone from its object (taken by the drop)"
                    )),
                }
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }
}

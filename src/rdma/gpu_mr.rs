//! GPU memory a NIC can reach: [`GdrBuffer`] (a GPUDirect-RDMA-capable allocation of our own),
//! the [`GpuMemory`] trait that [`GpuMemoryRegion`] registers, pointer
//! classification ([`pointer_info`]) and the dma-buf export half ([`export_dmabuf`]), which needs
//! no NIC and so can be tested on a GPU-only machine.
//!
//! Why our own allocation: cudarc allocates from the stream-ordered pool (`cuMemAllocAsync`)
//! whenever the device supports pools, and pool memory reports
//! `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 0` (measured on H200, driver 580).
//! [`GdrBuffer`] allocates with `cuMemAlloc`, which reports 1.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr};
use serde::Serialize;

use crate::cuda;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::path::{Cause, Path, PathReport};

use super::mr::{AccessFlags, MemoryRegion, RemoteMemory, Sge};
use super::pd::ProtectionDomain;

/// The GPU page size (64 KiB) that peer-memory clients pin at; [`GdrBuffer`] starts on it.
pub const GPU_PAGE_SIZE: usize = 64 * 1024;

/// The host page size, which `cuMemGetHandleForAddressRange` requires the exported range to be
/// aligned to (`sysconf(_SC_PAGESIZE)`, 4 KiB on x86-64).
pub fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Device memory that can be registered with an RDMA protection domain.
///
/// Sealed: implemented for [`GdrBuffer`], cudarc's [`CudaSlice`] (pool memory, refused unless
/// forced) and `Arc`s of both, so that the pointer and length always describe a live
/// allocation owned by the value.
pub trait GpuMemory: sealed::Sealed + Send + Sync {
    /// The device address of the first byte.
    fn device_ptr(&self) -> sys::CUdeviceptr;
    /// Length in bytes.
    fn num_bytes(&self) -> usize;
    /// The CUDA context the memory belongs to.
    fn context(&self) -> &Arc<CudaContext>;
}

// ---------------------------------------------------------------------------------------------
// GdrBuffer
// ---------------------------------------------------------------------------------------------

/// A GPUDirect-RDMA-capable device allocation (`cuMemAlloc`), usable from cudarc code.
///
/// It starts on a 64 KiB GPU page and its size is rounded up to one, so that peer-memory
/// clients (which pin whole GPU pages) and dma-buf export (host-page aligned) never reach
/// memory that belongs to someone else. `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` is set on it.
///
/// cudarc code sees it as a [`CudaSlice`] ([`GdrBuffer::as_slice`]) or as views
/// ([`GdrBuffer::as_view`], [`GdrBuffer::as_view_mut`], [`GdrBuffer::slice`]), so kernels,
/// `memcpy_htod`/`memcpy_dtoh` and `launch_builder` work unchanged. The slice is never
/// dropped by cudarc (which would free it with `cuMemFreeAsync`): `Drop` takes it back and
/// calls `cuMemFree` after synchronizing its stream.
#[derive(Debug)]
pub struct GdrBuffer<T = u8> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// What cuMemAlloc returned (may precede `start` by the alignment padding).
    base: sys::CUdeviceptr,
    /// `slice`'s pointer: the first element, 64 KiB aligned.
    start: sys::CUdeviceptr,
    /// Bytes from `slice`'s pointer to the end of the allocation (a multiple of 64 KiB).
    capacity: usize,
}

impl<T: DeviceRepr> GdrBuffer<T> {
    /// Allocates `len` elements of `T` with `cuMemAlloc` on `stream`'s device; the buffer's
    /// cudarc operations are ordered on `stream`. The contents are unspecified: use
    /// [`GdrBuffer::zeroed`] or copy into it.
    ///
    /// Errors: [`Error::InvalidArgument`] for `len == 0`, CUDA absence errors from
    /// [`crate::cuda`], [`Error::Cuda`] naming `cuMemAlloc` (out of memory, ...).
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        cuda::driver_version()?;
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
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: a context is current (bound above); the memory is only handed out as
        // `T: DeviceRepr` through cudarc, whose users must initialize it before reading (doc).
        let mut base = unsafe { cuda::result::mem::alloc(rounded) }?;
        let mut alloc_bytes = rounded;
        if base % GPU_PAGE_SIZE as u64 != 0 {
            // cuMemAlloc guarantees 256 B alignment only: over-allocate by one GPU page and start
            // on the next boundary (as GDRCopy's tests do).
            // SAFETY: `base` came from cuMemAlloc above and nothing else refers to it.
            if let Err(e) = unsafe { cuda::result::mem::free(base) } {
                tracing::warn!(error = %e, "cuMemFree of a misaligned GdrBuffer attempt failed");
            }
            alloc_bytes = rounded + GPU_PAGE_SIZE;
            // SAFETY: as above.
            base = unsafe { cuda::result::mem::alloc(alloc_bytes) }?;
        }
        let start = base.next_multiple_of(GPU_PAGE_SIZE as u64);
        let capacity = (base + alloc_bytes as u64 - start) as usize;
        debug_assert!(capacity >= bytes);
        // SYNC_MEMOPS: synchronous cuMemcpy/cuMemset complete before a NIC can read the bytes.
        if let Err(e) = set_sync_memops(start) {
            // SAFETY: `base` came from cuMemAlloc above; nothing refers to it yet.
            let _ = unsafe { cuda::result::mem::free(base) };
            return Err(e);
        }
        // SAFETY: `start..start + bytes` lies inside the cuMemAlloc allocation (capacity >=
        // rounded >= bytes); the slice is never dropped by cudarc (ManuallyDrop, taken back with
        // `leak` in Drop), so cudarc never frees it with the wrong call.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(start, len) };
        Ok(GdrBuffer {
            slice: ManuallyDrop::new(slice),
            base,
            start,
            capacity,
        })
    }

    /// [`GdrBuffer::alloc`], then zero-filled on the stream (synchronized before returning).
    pub fn zeroed(stream: &Arc<CudaStream>, len: usize) -> Result<Self>
    where
        T: cudarc::driver::ValidAsZeroBits,
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

impl<T> GdrBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// True when the buffer has no elements (never: allocation refuses 0).
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// Length in bytes.
    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    /// The device address of the first element (64 KiB aligned).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.start
    }

    /// Bytes from the first element to the end of the allocation (the length rounded up to
    /// 64 KiB): what a peer-memory client pins.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.slice.ordinal()
    }

    /// The stream the buffer's cudarc operations are ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// The buffer as cudarc's slice, for kernels and copies that take `&CudaSlice<T>`.
    ///
    /// Only a shared reference is handed out: the slice cannot be swapped out or dropped.
    pub fn as_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The whole buffer as a read-only cudarc view.
    pub fn as_view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    /// The whole buffer as a writable cudarc view (kernels, `memcpy_htod`, `memset_zeros`).
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// A read-only sub-view, in elements (panics out of bounds, as cudarc's `slice` does).
    pub fn slice(&self, range: Range<usize>) -> CudaView<'_, T> {
        self.slice.slice(range)
    }

    /// A writable sub-view, in elements (panics out of bounds, as cudarc's `slice_mut` does).
    pub fn slice_mut(&mut self, range: Range<usize>) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(range)
    }
}

impl<T> Drop for GdrBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken exactly once, here; it is not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = slice.stream().clone();
        let ptr = slice.leak(); // waits (on the stream) for the slice's pending reads/writes
        debug_assert_eq!(ptr, self.start);
        if let Err(e) = stream.synchronize() {
            tracing::warn!(error = %e, "GdrBuffer: cuStreamSynchronize before cuMemFree failed");
        }
        if let Err(e) = stream.context().bind_to_thread() {
            tracing::warn!(error = %e, "GdrBuffer: cannot bind the context to free the buffer; leaking it");
            return;
        }
        // SAFETY: `base` came from cuMemAlloc in `alloc`, is freed only here, and the stream
        // that ordered all cudarc work on it was synchronized above.
        if let Err(e) = unsafe { cuda::result::mem::free(self.base) } {
            tracing::warn!(error = %e, "GdrBuffer: cuMemFree failed");
        }
    }
}

impl<T> sealed::Sealed for GdrBuffer<T> {}
impl<T> GpuMemory for GdrBuffer<T> {
    fn device_ptr(&self) -> sys::CUdeviceptr {
        self.start
    }
    fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }
    fn context(&self) -> &Arc<CudaContext> {
        self.slice.context()
    }
}

impl<T> sealed::Sealed for CudaSlice<T> {}
impl<T> GpuMemory for CudaSlice<T> {
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
}

impl<M: GpuMemory + ?Sized> sealed::Sealed for Arc<M> {}
impl<M: GpuMemory + ?Sized> GpuMemory for Arc<M> {
    fn device_ptr(&self) -> sys::CUdeviceptr {
        (**self).device_ptr()
    }
    fn num_bytes(&self) -> usize {
        (**self).num_bytes()
    }
    fn context(&self) -> &Arc<CudaContext> {
        (**self).context()
    }
}

fn round_up(x: usize, to: usize) -> Option<usize> {
    x.checked_add(to - 1).map(|v| v / to * to)
}

// ---------------------------------------------------------------------------------------------
// Pointer classification
// ---------------------------------------------------------------------------------------------

pub use crate::cuda::{pointer_info, PointerInfo};

/// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation holding `ptr`
/// (`cuPointerSetAttribute`): synchronous copies and memsets complete before they return, so a
/// NIC reading right after sees the bytes. Idempotent.
pub fn set_sync_memops(ptr: sys::CUdeviceptr) -> Result<()> {
    cuda::driver_version()?;
    // SAFETY: libcuda is initialised (checked above); the driver validates `ptr`.
    unsafe { cuda::result::pointer::set_sync_memops(ptr) }
}

// ---------------------------------------------------------------------------------------------
// dma-buf export
// ---------------------------------------------------------------------------------------------

/// Where a registration's bytes sit inside the exported dma-buf.
///
/// `cuMemGetHandleForAddressRange` wants a host-page-aligned range, so the export covers the
/// enclosing aligned range and `ibv_reg_dmabuf_mr` gets the offset inside it, with the CUDA
/// address as iova (remote peers then use CUDA addresses as `remote_addr`, as NCCL and
/// perftest do). iova and offset share their page offset, as `ibv_reg_dmabuf_mr(3)` requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DmaBufPlan {
    /// First byte of the exported range (aligned down to the page).
    pub export_start: u64,
    /// Length of the exported range (a multiple of the page).
    pub export_len: u64,
    /// Offset of the registration inside the dma-buf (`ibv_reg_dmabuf_mr`'s `offset`).
    pub offset: u64,
    /// Bytes registered.
    pub len: u64,
    /// The registration's iova: the CUDA address of its first byte.
    pub iova: u64,
}

impl DmaBufPlan {
    /// Plans the export of `len` bytes at device address `addr` with `page`-aligned bounds.
    ///
    /// Errors: [`Error::InvalidArgument`] for `len == 0`, a `page` that is not a power of two,
    /// or a range that wraps the address space.
    pub fn new(addr: u64, len: u64, page: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot export or register an empty range".into(),
            ));
        }
        if !page.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "page size {page} is not a power of two"
            )));
        }
        let end = addr.checked_add(len).ok_or_else(|| {
            Error::InvalidArgument(format!("range {addr:#x}+{len} wraps the address space"))
        })?;
        let start = addr & !(page - 1);
        let end_aligned = end
            .checked_add(page - 1)
            .map(|e| e & !(page - 1))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("range {addr:#x}+{len} wraps the address space"))
            })?;
        Ok(DmaBufPlan {
            export_start: start,
            export_len: end_aligned - start,
            offset: addr - start,
            len,
            iova: addr,
        })
    }
}

/// An exported dma-buf: the fd (closed on drop) and where the requested range sits in it.
#[derive(Debug)]
pub struct DmaBufExport {
    /// The dma-buf file descriptor from `cuMemGetHandleForAddressRange`.
    pub fd: OwnedFd,
    /// The aligned range and the offset inside it.
    pub plan: DmaBufPlan,
}

/// Exports `range` (bytes, relative to the memory's start) of `mem` as a dma-buf fd
/// (`cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` on the enclosing
/// host-page-aligned range), after setting `SYNC_MEMOPS`. Needs no NIC: this is the half of
/// dma-buf registration a GPU-only machine can prove.
///
/// The device must report `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 1` (NVIDIA's open kernel
/// module); otherwise [`Error::Unsupported`] with [`Cause::DmaBufUnsupported`].
pub fn export_dmabuf<M: GpuMemory + ?Sized>(mem: &M, range: Range<usize>) -> Result<DmaBufExport> {
    check_range(mem, &range)?;
    let ctx = mem.context();
    let ordinal = ctx.ordinal();
    let supported = cuda::device_attribute(
        ordinal,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
    )?;
    if supported != 1 {
        return Err(Error::Unsupported {
            what: format!("dma-buf export of GPU {ordinal} memory"),
            cause: Cause::DmaBufUnsupported {
                detail: format!(
                    "GPU {ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED={supported} (the proprietary kernel module has no dma-buf export)"
                ),
            },
        });
    }
    ctx.bind_to_thread()
        .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
    let addr = mem.device_ptr() + range.start as u64;
    let plan = DmaBufPlan::new(addr, range.len() as u64, host_page_size() as u64)?;
    set_sync_memops(addr)?;
    // SAFETY: the range lies in memory `mem` owns (checked above), aligned to the host page as
    // the call requires; the context is current (bound above).
    let (rc, fd) =
        unsafe { cuda::result::mem::get_dmabuf_fd(plan.export_start, plan.export_len as usize) };
    match rc {
        sys::CUresult::CUDA_SUCCESS if fd >= 0 => Ok(DmaBufExport {
            // SAFETY: the driver returned a new fd that nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            plan,
        }),
        sys::CUresult::CUDA_SUCCESS => Err(Error::Cuda {
            op: "cuMemGetHandleForAddressRange",
            source: cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN),
        }),
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => Err(Error::Unsupported {
            what: format!("dma-buf export of GPU {ordinal} memory"),
            cause: Cause::DmaBufUnsupported {
                detail:
                    "cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED (driver or platform)"
                        .into(),
            },
        }),
        // Measured on H200 / driver 580: a 3 MiB sub-allocation of the default stream-ordered
        // pool is refused with INVALID_VALUE even when page-aligned (a 1 GiB pool allocation
        // exports). Pool memory is not GDR-capable anyway: name that cause.
        sys::CUresult::CUDA_ERROR_INVALID_VALUE
            if pointer_info(mem.device_ptr()).is_ok_and(|i| i.from_pool) =>
        {
            Err(Error::Unsupported {
                what: format!(
                    "dma-buf export of {} bytes of stream-ordered pool memory on GPU {ordinal} (cuMemGetHandleForAddressRange: CUDA_ERROR_INVALID_VALUE)",
                    plan.export_len
                ),
                cause: Cause::PoolMemoryNotGdrCapable,
            })
        }
        rc => Err(Error::cuda(
            "cuMemGetHandleForAddressRange",
            cudarc::driver::DriverError(rc),
        )),
    }
}

fn check_range<M: GpuMemory + ?Sized>(mem: &M, range: &Range<usize>) -> Result<()> {
    if range.start >= range.end || range.end > mem.num_bytes() {
        return Err(Error::InvalidArgument(format!(
            "byte range {}..{} is empty or outside the {}-byte allocation",
            range.start,
            range.end,
            mem.num_bytes()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// GpuMemoryRegion
// ---------------------------------------------------------------------------------------------

/// How [`GpuMemoryRegion`] registers GPU memory with the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Strategy {
    /// dma-buf first, then the peer-memory client (as NCCL and UCX order them). The
    /// environment can rule a path out: `GPUDIRECT_DMABUF_ENABLE=0`, `GPUDIRECT_PEERMEM_ENABLE=0`.
    #[default]
    Auto,
    /// Only dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`).
    DmaBuf,
    /// Only the peer-memory client (`ibv_reg_mr` on the device pointer), tried even when no
    /// client is visible in sysfs.
    PeerMem,
}

/// Options for [`GpuMemoryRegion::register_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRegisterOptions {
    /// Which registration path(s) to try.
    pub strategy: Strategy,
    /// Access rights of the region.
    pub access: AccessFlags,
    /// Register memory the driver says is not GPUDirect-RDMA capable (stream-ordered pool
    /// memory, as cudarc allocates) instead of refusing it with
    /// [`Cause::PoolMemoryNotGdrCapable`]. Whether a NIC then reaches it is unverified.
    pub force_non_gdr_memory: bool,
}

impl Default for GpuRegisterOptions {
    fn default() -> Self {
        GpuRegisterOptions {
            strategy: Strategy::Auto,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            force_non_gdr_memory: false,
        }
    }
}

/// GPU memory registered with a protection domain, so a NIC reads and writes it directly.
///
/// Owns the memory `M` (a [`GdrBuffer`], an `Arc` of one, or a cudarc [`CudaSlice`] when
/// forced) and, on the dma-buf path, the exported fd. Teardown order is the field order:
/// deregister, close the dma-buf, release the memory. [`GpuMemoryRegion::path`] says which
/// path registered it and [`GpuMemoryRegion::refused`] why the others were not used.
pub struct GpuMemoryRegion<M: GpuMemory> {
    mr: MemoryRegion<()>,
    dmabuf: Option<DmaBufExport>,
    mem: M,
    range: Range<usize>,
    path: Path,
    refused: Vec<(Path, Cause)>,
}

impl<M: GpuMemory> fmt::Debug for GpuMemoryRegion<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMemoryRegion")
            .field("mr", &self.mr)
            .field("path", &self.path)
            .field("range", &self.range)
            .field("dmabuf", &self.dmabuf.as_ref().map(|d| d.plan))
            .finish()
    }
}

/// `Some("VAR=value")` when the environment turns a registration path off (`var` false by
/// the one boolean table); an unparsable value is [`Error::InvalidEnvironment`].
fn env_disabled(var: &'static str) -> Result<Option<String>> {
    let env = Env::process();
    Ok(match env.flag(var)? {
        Some(false) => env.raw(var).map(|v| format!("{var}={v}")),
        _ => None,
    })
}

impl<M: GpuMemory> GpuMemoryRegion<M> {
    /// Registers all of `mem` with [`Strategy::Auto`] and local-write, remote-write and
    /// remote-read access.
    pub fn register(pd: &Arc<ProtectionDomain>, mem: M) -> Result<Self> {
        let len = mem.num_bytes();
        Self::register_with(pd, mem, 0..len, GpuRegisterOptions::default())
    }

    /// Registers `range` (bytes from the start of `mem`) of `mem`.
    ///
    /// Errors: [`Error::Unsupported`] when no path works, with [`Cause::PoolMemoryNotGdrCapable`]
    /// (pool memory, not forced), [`Cause::DmaBufUnsupported`] (EOPNOTSUPP: the provider or
    /// kernel lacks dma-buf, as rxe does), [`Cause::NoPeerMemoryClient`] (EFAULT from
    /// `ibv_reg_mr`), [`Cause::Misaligned`] or, when both paths were tried,
    /// [`Cause::GdrPathsRefused`] carrying both causes. A forced strategy returns its own
    /// path's error as is.
    pub fn register_with(
        pd: &Arc<ProtectionDomain>,
        mem: M,
        range: Range<usize>,
        opts: GpuRegisterOptions,
    ) -> Result<Self> {
        check_range(&mem, &range)?;
        let ordinal = mem.context().ordinal();
        let what = format!(
            "GPUDirect RDMA registration of GPU {ordinal} memory on {}",
            pd.context().name()
        );
        mem.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let addr = mem.device_ptr() + range.start as u64;
        let len = range.len();
        let info = pointer_info(addr)?;
        if let Some(cause) = info.gdr_refusal() {
            if !opts.force_non_gdr_memory {
                return Err(Error::Unsupported { what, cause });
            }
            tracing::warn!(%cause, "registering memory that is not GPUDirect-RDMA capable, as forced");
        }
        let mut refused: Vec<(Path, Cause)> = Vec::new();
        let forced = opts.strategy != Strategy::Auto;
        let (dmabuf_off, peermem_off) = if forced {
            (None, None)
        } else {
            (
                env_disabled("GPUDIRECT_DMABUF_ENABLE")?,
                env_disabled("GPUDIRECT_PEERMEM_ENABLE")?,
            )
        };

        // ---- dma-buf ----
        if opts.strategy == Strategy::PeerMem {
            // not asked for
        } else if let Some(setting) = dmabuf_off {
            refused.push((Path::RdmaDmaBuf, Cause::ForcedByConfig { setting }));
        } else {
            match Self::try_dmabuf(pd, &mem, &range, &info, opts.access) {
                Ok((mr, exp)) => {
                    tracing::info!(
                        addr = format_args!("{addr:#x}"),
                        len,
                        export_start = format_args!("{:#x}", exp.plan.export_start),
                        export_len = exp.plan.export_len,
                        offset = exp.plan.offset,
                        lkey = mr.lkey(),
                        rkey = mr.rkey(),
                        "GDR: registered via dma-buf (SYNC_MEMOPS set)"
                    );
                    return Ok(GpuMemoryRegion {
                        mr,
                        dmabuf: Some(exp),
                        mem,
                        range,
                        path: Path::RdmaDmaBuf,
                        refused,
                    });
                }
                Err(e) if forced => return Err(e),
                Err(e) => refused.push((Path::RdmaDmaBuf, cause_of(e))),
            }
        }

        // ---- peer-memory client ----
        if opts.strategy == Strategy::DmaBuf {
            // not asked for
        } else if let Some(setting) = peermem_off {
            refused.push((Path::RdmaPeerMem, Cause::ForcedByConfig { setting }));
        } else if !forced && !super::probe::PeerMemoryClient::detect().present() {
            refused.push((Path::RdmaPeerMem, Cause::NoPeerMemoryClient));
        } else {
            if let Err(e) = set_sync_memops(addr) {
                tracing::warn!(error = %e, "GDR: could not set SYNC_MEMOPS before peermem registration");
            }
            // SAFETY: `addr..addr+len` lies inside `mem` (checked above), which the returned
            // region owns and releases only after deregistering (field order).
            let r = unsafe { pd.register_raw(addr as *mut std::ffi::c_void, len, opts.access) };
            match r {
                Ok(mr) => {
                    tracing::info!(
                        addr = format_args!("{addr:#x}"),
                        len,
                        lkey = mr.lkey(),
                        rkey = mr.rkey(),
                        "GDR: registered via peermem ibv_reg_mr"
                    );
                    return Ok(GpuMemoryRegion {
                        mr,
                        dmabuf: None,
                        mem,
                        range,
                        path: Path::RdmaPeerMem,
                        refused,
                    });
                }
                Err(Error::Verbs { source, .. }) if source.raw_os_error() == Some(libc::EFAULT) => {
                    if forced {
                        return Err(Error::Unsupported {
                            what,
                            cause: Cause::NoPeerMemoryClient,
                        });
                    }
                    refused.push((Path::RdmaPeerMem, Cause::NoPeerMemoryClient));
                }
                Err(e) if forced => return Err(e),
                Err(e) => refused.push((Path::RdmaPeerMem, cause_of(e))),
            }
        }

        let cause = match refused.len() {
            2 => {
                let peermem = refused.pop().map(|r| r.1);
                let dmabuf = refused.pop().map(|r| r.1);
                match (dmabuf, peermem) {
                    (Some(d), Some(p)) => Cause::GdrPathsRefused {
                        dmabuf: Box::new(d),
                        peermem: Box::new(p),
                    },
                    _ => unreachable_cause(),
                }
            }
            _ => refused.pop().map(|r| r.1).unwrap_or_else(unreachable_cause),
        };
        Err(Error::Unsupported { what, cause })
    }

    fn try_dmabuf(
        pd: &Arc<ProtectionDomain>,
        mem: &M,
        range: &Range<usize>,
        info: &PointerInfo,
        access: AccessFlags,
    ) -> Result<(MemoryRegion<()>, DmaBufExport)> {
        let addr = mem.device_ptr() + range.start as u64;
        let page = host_page_size() as u64;
        let plan = DmaBufPlan::new(addr, range.len() as u64, page)?;
        // The aligned export must stay inside the allocation (pool slices at odd offsets may
        // not): otherwise the dma-buf would cover memory this region does not own.
        let alloc_end = info.range_start.saturating_add(info.range_size);
        if info.range_size > 0
            && (plan.export_start < info.range_start
                || plan.export_start + plan.export_len > alloc_end)
        {
            return Err(Error::Unsupported {
                what: "dma-buf export".into(),
                cause: Cause::Misaligned {
                    required: page as usize,
                },
            });
        }
        let exp = export_dmabuf(mem, range.clone())?;
        debug_assert_eq!(exp.plan, plan);
        // SAFETY: the fd is an open dma-buf of `export_len >= offset + len` bytes; it and the
        // memory behind it are owned by the GpuMemoryRegion that takes this MR and released
        // only after the MR is deregistered (field order).
        let mr = unsafe {
            pd.register_dmabuf_raw(
                exp.plan.offset,
                range.len(),
                exp.plan.iova,
                exp.fd.as_raw_fd(),
                access,
            )
        }?;
        Ok((mr, exp))
    }

    /// The path the registration took: [`Path::RdmaDmaBuf`] or [`Path::RdmaPeerMem`].
    pub fn path(&self) -> Path {
        self.path
    }

    /// The paths tried before the one taken, and why each was refused.
    pub fn refused(&self) -> &[(Path, Cause)] {
        &self.refused
    }

    /// The path taken as a report (always direct).
    pub fn report(&self) -> PathReport {
        PathReport::direct(self.path)
    }

    /// The verbs memory region (keys, address, scatter/gather entries).
    pub fn mr(&self) -> &MemoryRegion<()> {
        &self.mr
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The region's address as the NIC sees it: the CUDA address of its first byte (the
    /// dma-buf path registers with iova = CUDA address, the peermem path with the pointer).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// True for an empty region (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// What a peer needs to RDMA-write or -read this region.
    pub fn remote(&self) -> RemoteMemory {
        self.mr.remote()
    }

    /// A scatter/gather entry for bytes `range` of the region (bounds-checked).
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        self.mr.sge(range)
    }

    /// The registered byte range of the memory.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The dma-buf plan, on the dma-buf path.
    pub fn dmabuf_plan(&self) -> Option<DmaBufPlan> {
        self.dmabuf.as_ref().map(|d| d.plan)
    }

    /// The registered memory (read access; cudarc views come from it).
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Deregisters, closes the dma-buf and returns the memory.
    pub fn into_inner(self) -> M {
        let GpuMemoryRegion {
            mr, dmabuf, mem, ..
        } = self;
        drop(mr);
        drop(dmabuf);
        mem
    }
}

impl<T> GpuMemoryRegion<GdrBuffer<T>> {
    /// The registered buffer as a writable cudarc view (for kernels that fill or consume it).
    /// The NIC may write the same bytes whenever a peer holding the rkey does so: order the
    /// two with completions.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.mem.as_view_mut()
    }
}

fn unreachable_cause() -> Cause {
    Cause::Other {
        message: "no registration path was tried".into(),
        fix: "pick Strategy::DmaBuf or Strategy::PeerMem".into(),
    }
}

/// The cause to report for a failed path (keeps typed causes, wraps anything else).
fn cause_of(e: Error) -> Cause {
    match e {
        Error::Unsupported { cause, .. } => cause,
        Error::Verbs { op, source } if source.raw_os_error() == Some(libc::EINVAL) => {
            Cause::Other {
                message: format!("{op} failed: {source} (alignment, access flags or a VMM range)"),
                fix: "register a GdrBuffer with the default access flags".into(),
            }
        }
        other => Cause::Other {
            message: other.to_string(),
            fix: "see the error above".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmabuf_plan_aligned_range_is_exported_as_is() {
        let p = DmaBufPlan::new(0x7f00_0001_0000, 1 << 20, 4096).unwrap();
        assert_eq!(p.export_start, 0x7f00_0001_0000);
        assert_eq!(p.export_len, 1 << 20);
        assert_eq!(p.offset, 0);
        assert_eq!(p.iova, 0x7f00_0001_0000);
    }

    #[test]
    fn dmabuf_plan_unaligned_range_takes_the_enclosing_pages() {
        // 100 bytes in, 4096 long: spans two pages
        let p = DmaBufPlan::new(0x10000 + 100, 4096, 4096).unwrap();
        assert_eq!(p.export_start, 0x10000);
        assert_eq!(p.export_len, 8192);
        assert_eq!(p.offset, 100);
        assert_eq!(p.len, 4096);
        assert_eq!(
            p.iova % 4096,
            p.offset % 4096,
            "iova and offset share the page offset"
        );
        // odd size ending exactly on a boundary
        let p = DmaBufPlan::new(0x20000 + 4095, 1, 4096).unwrap();
        assert_eq!(
            (p.export_start, p.export_len, p.offset),
            (0x20000, 4096, 4095)
        );
        let p = DmaBufPlan::new(0x20000 + 4095, 2, 4096).unwrap();
        assert_eq!(
            (p.export_start, p.export_len, p.offset),
            (0x20000, 8192, 4095)
        );
    }

    #[test]
    fn dmabuf_plan_rejects_empty_wrapping_and_bad_pages() {
        assert!(matches!(
            DmaBufPlan::new(0x1000, 0, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(u64::MAX - 10, 100, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(u64::MAX - 4000, 100, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(0x1000, 1, 3000),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn both_paths_refused_names_both_causes_and_fixes() {
        let c = Cause::GdrPathsRefused {
            dmabuf: Box::new(Cause::DmaBufUnsupported {
                detail: "the rxe0 provider does not implement dma-buf memory regions".into(),
            }),
            peermem: Box::new(Cause::NoPeerMemoryClient),
        };
        let s = c.to_string();
        assert!(s.starts_with("no GPUDirect RDMA registration path: dma-buf refused (dma-buf registration unsupported: the rxe0 provider"), "{s}");
        assert!(s.contains("peermem refused (no peer-memory client)"), "{s}");
        assert!(s.contains("load nvidia_peermem"), "{s}");
        assert!(s.contains("mlx5"), "{s}");
        assert!(!s.ends_with('.'), "{s}");
        // errors from a path keep their typed cause; others are wrapped with their text
        let e = Error::Unsupported {
            what: "x".into(),
            cause: Cause::PoolMemoryNotGdrCapable,
        };
        assert_eq!(cause_of(e), Cause::PoolMemoryNotGdrCapable);
        let e = Error::Verbs {
            op: "ibv_reg_dmabuf_mr",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert!(
            matches!(cause_of(e), Cause::Other { message, .. } if message.contains("alignment"))
        );
        assert_eq!(Strategy::default(), Strategy::Auto);
        let o = GpuRegisterOptions::default();
        assert!(o
            .access
            .contains(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE));
        assert!(!o.force_non_gdr_memory);
    }

    #[test]
    fn host_page_is_a_power_of_two() {
        assert!(host_page_size().is_power_of_two());
        assert!(round_up(1, GPU_PAGE_SIZE) == Some(GPU_PAGE_SIZE));
        assert!(round_up(GPU_PAGE_SIZE, GPU_PAGE_SIZE) == Some(GPU_PAGE_SIZE));
        assert!(round_up(usize::MAX, GPU_PAGE_SIZE).is_none());
    }
}

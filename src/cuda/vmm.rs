//! [`VmmBuffer`]: device memory from the CUDA virtual memory management API (`cuMemCreate`,
//! `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`), created exportable as a POSIX file
//! descriptor and seen as a cudarc [`CudaSlice`]; re-exported as `p2p::VmmBuffer`. Peer access
//! to VMM memory is per mapping ([`VmmBuffer::grant_access`]), not per context, and observable
//! (`cuMemGetAccess`): [`copy_peer`](crate::p2p::copy_peer) reports the path from it.
//!
//! The allocation half lives here, on the ground floor: [`VmmRange`] (reserve, map, access,
//! teardown) also maps what another process exported. The IPC half (`cuMemExportToShareableHandle`,
//! [`VmmBuffer::export_fd`], and [`VmmImport`](crate::p2p::ipc::VmmImport)) is `p2p::ipc`'s.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};

use crate::cuda::result as r;
use crate::error::{Error, Result};
use crate::path::Cause;

/// A reserved virtual range with one allocation mapped at its start. Partial states (handle
/// only, handle + reservation) are torn down as far as they got: unmap, address free, release.
#[derive(Debug)]
pub(crate) struct VmmRange {
    pub(crate) handle: sys::CUmemGenericAllocationHandle,
    /// 0 until reserved.
    pub(crate) ptr: sys::CUdeviceptr,
    /// The padded size (a multiple of the granularity).
    pub(crate) size: usize,
    mapped: bool,
    ctx: Arc<CudaContext>,
}

impl VmmRange {
    /// Takes ownership of `handle` (released on every error path), reserves `size` bytes
    /// aligned to `granularity`, maps the handle there and grants `ctx`'s device read/write.
    pub(crate) fn map(
        ctx: &Arc<CudaContext>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        granularity: usize,
    ) -> Result<Self> {
        let mut range = VmmRange {
            handle,
            ptr: 0,
            size,
            mapped: false,
            ctx: ctx.clone(),
        };
        range.ptr = r::vmm::address_reserve(size, granularity)?;
        // SAFETY: the range was just reserved with `size` bytes and nothing is mapped there; the
        // handle is live (we own it) and holds `size` bytes (the caller's padded size).
        unsafe { r::vmm::map(range.ptr, size, handle) }?;
        range.mapped = true;
        range.set_access(ctx.ordinal())?;
        Ok(range)
    }

    /// `cuMemSetAccess` read/write for device `ordinal` on the whole range.
    pub(crate) fn set_access(&self, ordinal: usize) -> Result<()> {
        // SAFETY: the range is mapped (only called after a successful cuMemMap) and lives as
        // long as `self`.
        unsafe {
            r::vmm::set_access(
                self.ptr,
                self.size,
                ordinal as i32,
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            )
        }
    }
}

impl Drop for VmmRange {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        if let Err(e) = crate::cuda::bind(&self.ctx) {
            tracing::warn!(%e, "gpudirect VMM: cannot bind context before unmapping");
        }
        if self.mapped {
            // Every stream of the context, not only the owner's: cudarc keeps one read event per
            // slice, so a read on another stream may be unseen, and cuMemUnmap is not documented
            // to wait for queued work.
            if let Err(e) = self.ctx.synchronize() {
                tracing::warn!(%e, "gpudirect VMM: cuCtxSynchronize failed; range and memory leaked rather than unmapped under queued work");
                return;
            }
            // SAFETY: mapped by us with this size; all the context's queued work finished
            // (synchronized above), so none uses it.
            if let Err(e) = unsafe { r::vmm::unmap(self.ptr, self.size) } {
                tracing::warn!(%e, "gpudirect VMM: cuMemUnmap failed; range and memory leaked");
                return;
            }
        }
        if self.ptr != 0 {
            // SAFETY: reserved by us with this size; nothing is mapped in it any more.
            if let Err(e) = unsafe { r::vmm::address_free(self.ptr, self.size) } {
                tracing::warn!(%e, "gpudirect VMM: cuMemAddressFree failed");
            }
        }
        // SAFETY: we own the handle and release it once; an importer's or exporter's other
        // references keep the physical memory alive as long as they need it.
        if let Err(e) = unsafe { r::vmm::release(self.handle) } {
            tracing::warn!(%e, "gpudirect VMM: cuMemRelease failed");
        }
    }
}

/// Fails with [`Error::Unsupported`] when device `ordinal` lacks VMM or POSIX fd handles.
fn check_support(ordinal: usize) -> Result<()> {
    use sys::CUdevice_attribute as A;
    let vmm = crate::cuda::device_attribute(
        ordinal,
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
    )?;
    let fd = crate::cuda::device_attribute(
        ordinal,
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    )?;
    if vmm == 0 || fd == 0 {
        return Err(Error::Unsupported {
            what: format!("exportable VMM memory on GPU {ordinal}"),
            cause: Cause::Other {
                message: format!(
                    "virtual memory management supported: {}, POSIX fd handles supported: {}",
                    vmm != 0,
                    fd != 0
                ),
                fix: "use a DeviceBuffer with IpcMemHandle, or a SharedPool, on this device".into(),
            },
        });
    }
    Ok(())
}

/// `n` rounded up to a multiple of `g` (at least `g`).
pub(crate) fn round_up(n: usize, g: usize) -> Result<usize> {
    n.max(1)
        .checked_next_multiple_of(g)
        .ok_or_else(|| Error::InvalidArgument(format!("{n} bytes overflow usize when padded")))
}

/// A zero-initialised VMM allocation of `len` elements on one device (`cuMemCreate` with the
/// POSIX fd handle type, padded to the allocation granularity, reserved, mapped and
/// `cuMemSetAccess`ed for its own device), usable wherever cudarc takes a `CudaSlice`/`CudaView`
/// ([`VmmBuffer::slice`], [`VmmBuffer::as_view`], [`VmmBuffer::as_view_mut`]). On drop, after
/// all the work queued in its context finished (`cuCtxSynchronize`: a read on another stream
/// may be one cudarc's single read event per slice no longer shows): `cuMemUnmap`,
/// `cuMemAddressFree`, `cuMemRelease` (importers in other processes keep the physical memory
/// alive until they unmap it). As for a [`DeviceBuffer`](crate::cuda::DeviceBuffer), do not
/// drop one while another stream of its context waits for the dropping thread.
///
/// Which of gpudirect's allocation types (and cudarc's) for what: [the crate
/// docs](crate#which-allocation-type-for-what).
#[derive(Debug)]
pub struct VmmBuffer<T> {
    /// Never dropped by cudarc: leaked in our Drop before the range is unmapped.
    slice: ManuallyDrop<CudaSlice<T>>,
    stream: Arc<CudaStream>,
    range: VmmRange,
}

impl VmmBuffer<u8> {
    /// The allocation granularity (`cuMemGetAllocationGranularity`, minimum) for exportable
    /// pinned memory on device `ordinal`: every VmmBuffer's bytes are padded to it.
    ///
    /// Errors: [`Error::LibraryUnavailable`] without libcuda, [`Error::NoDevice`] without such a
    /// device, [`Error::Unsupported`] when the device lacks VMM or POSIX fd handles.
    pub fn granularity(ordinal: usize) -> Result<usize> {
        check_support(ordinal)?;
        r::vmm::granularity(&r::vmm::prop(ordinal as i32))
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> VmmBuffer<T> {
    /// [`VmmBuffer::alloc_zeros`] on the default stream of device `ordinal`'s primary context.
    pub fn alloc_zeros_on(ordinal: usize, len: usize) -> Result<Self> {
        let ctx = crate::cuda::context(ordinal)?;
        Self::alloc_zeros(&ctx.default_stream(), len)
    }

    /// Allocates `len` zeroed elements on `stream`'s device.
    pub fn alloc_zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        let ctx = stream.context();
        let ordinal = ctx.ordinal();
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow usize")))?;
        let g = VmmBuffer::<u8>::granularity(ordinal)?;
        let size = round_up(bytes, g)?;
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let handle = r::vmm::create(size, &r::vmm::prop(ordinal as i32))?;
        let range = VmmRange::map(ctx, handle, size, g)?;
        // SAFETY: `range.ptr` maps `size >= bytes` bytes readable and writable by this device;
        // it is zeroed right below, and the CudaSlice is never dropped by cudarc (ManuallyDrop,
        // leaked in our Drop before the range is unmapped).
        let mut slice =
            ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(range.ptr, len) });
        let zeroed = stream.memset_zeros(&mut *slice);
        let buf = VmmBuffer {
            slice,
            stream: stream.clone(),
            range,
        };
        zeroed.map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        Ok(buf)
    }
}

impl<T> VmmBuffer<T> {
    /// Grants device `peer` read/write access to this memory (`cuMemSetAccess`), so peer copies
    /// executed by that device read/write it directly ([`copy_peer`](crate::p2p::copy_peer) then
    /// reports [`TransferPath::PeerDirect`](crate::TransferPath::PeerDirect)). Lasts as long as
    /// the buffer.
    ///
    /// Errors: [`Error::NoDevice`] for a bad ordinal, [`Error::Unsupported`] when the two
    /// devices cannot access each other (`cuDeviceCanAccessPeer`).
    pub fn grant_access(&self, peer: usize) -> Result<()> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::check_ordinal(peer)?;
        let me = self.stream.context().ordinal();
        if peer != me && !r::device::can_access_peer(r::device::get(peer)?, r::device::get(me)?)? {
            return Err(Error::Unsupported {
                what: format!("access from GPU {peer} to VMM memory of GPU {me}"),
                cause: Cause::PeerUnsupported { src: peer, dst: me },
            });
        }
        crate::cuda::bind(self.stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        self.range.set_access(peer)
    }

    slice_accessors!();

    /// The allocation's generic handle, for the IPC half's export (`p2p::ipc`).
    pub(crate) fn allocation_handle(&self) -> sys::CUmemGenericAllocationHandle {
        self.range.handle
    }

    /// The size in bytes the elements occupy (what an importer passes to
    /// [`VmmImport::open`](crate::p2p::ipc::VmmImport::open)).
    pub fn len_bytes(&self) -> u64 {
        (self.slice.len() * std::mem::size_of::<T>()) as u64
    }

    /// The mapped size in bytes (the elements' bytes padded to the granularity).
    pub fn mapped_bytes(&self) -> usize {
        self.range.size
    }

    /// The raw device address (`CUdeviceptr`).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.range.ptr
    }

    /// The stream the buffer was allocated on (and is unmapped after).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> Drop for VmmBuffer<T> {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        // SAFETY: taken exactly once, here; the field is not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        crate::cuda::release_slice_view(slice, &self.stream, "VmmBuffer");
        // `range` is dropped right after this: unmap, address free, release.
    }
}

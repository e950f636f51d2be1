//! Legacy (`cuMemAlloc`) IPC: [`IpcMemHandle`] (`cuIpcGetMemHandle`) and [`IpcMapping`], the
//! mapping that legacy handles and pool pointers are opened as.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, CudaView, CudaViewMut};

use super::pool::PoolHandle;
use super::{
    add_mapping, check_mapped_len, elements, owner_device, records, remove_mapping, Records,
};
use crate::cuda::result as r;
use crate::cuda::{slice_accessors, AnyBitPattern, DeviceBuffer};
use crate::error::{Error, Result};
use crate::path::{PathReport, TransferPath};

/// A `cuIpcGetMemHandle` handle plus the allocation's size: 72 bytes to send to another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle {
    /// The opaque `CUipcMemHandle`.
    pub handle: [u8; 64],
    /// Size of the shared range in bytes.
    pub len_bytes: u64,
}

impl IpcMemHandle {
    /// Exports `buf` (`cuIpcGetMemHandle`). Only `cuMemAlloc` memory can be exported this way;
    /// for pool memory use a [`SharedPool`](super::SharedPool).
    ///
    /// Waits first for the work cudarc ordered as writing `buf` (everything queued on its
    /// stream, [`DeviceBuffer::alloc_zeros`]'s zeroing included, and a write recorded from
    /// another stream), so an importer that opens the handle right away sees the buffer as it
    /// is now.
    ///
    /// Exporting is `unsafe`: nothing on this side knows when an importer closes its mapping,
    /// so the caller promises that the buffer outlives it:
    ///
    /// ```no_run
    /// # use gpudirect::p2p::{ipc::IpcMemHandle, DeviceBuffer};
    /// fn f(buf: &DeviceBuffer<u8>) -> gpudirect::Result<IpcMemHandle> {
    ///     // SAFETY: `buf` is dropped only after the importer said its mapping is gone.
    ///     unsafe { IpcMemHandle::export(buf) }
    /// }
    /// ```
    ///
    /// ```compile_fail,E0133
    /// # use gpudirect::p2p::{ipc::IpcMemHandle, DeviceBuffer};
    /// fn f(buf: &DeviceBuffer<u8>) -> gpudirect::Result<IpcMemHandle> {
    ///     IpcMemHandle::export(buf) // error: `export` is an `unsafe fn`
    /// }
    /// ```
    ///
    /// The importer writes the memory with whatever bytes it likes, so the element type must
    /// accept any bit pattern ([`AnyBitPattern`]), as on the importing side:
    ///
    /// ```compile_fail,E0277
    /// # use gpudirect::p2p::{ipc::IpcMemHandle, DeviceBuffer};
    /// fn f(buf: &DeviceBuffer<bool>) -> gpudirect::Result<IpcMemHandle> {
    ///     // SAFETY: as above.
    ///     unsafe { IpcMemHandle::export(buf) } // error: not every byte is a bool
    /// }
    /// ```
    ///
    /// # Safety
    ///
    /// `buf` must not be dropped (`cuMemFree`) before every [`IpcMapping`] opened from the
    /// returned handle, in any process, has been dropped (`cuIpcCloseMemHandle`): CUDA calls a
    /// free of exported memory before the importer's close undefined behaviour, and the freed
    /// range may be reused for other data that the importer then reads and writes. Hand the
    /// handle only to processes that tell you (a message, their exit) when their mapping is
    /// gone, and keep `buf` until then. [`VmmBuffer::export_fd`](crate::p2p::VmmBuffer::export_fd)
    /// needs no such promise: the driver keeps VMM memory alive for as long as an importer maps
    /// it.
    pub unsafe fn export<T: AnyBitPattern>(buf: &DeviceBuffer<T>) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::wait_for_slice_writes(buf.as_slice())?;
        crate::cuda::bind(buf.stream().context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: `buf` owns a live cuMemAlloc allocation starting at `device_ptr()`; the caller
        // keeps it alive for as long as importers map it (this function's contract).
        let handle = unsafe { r::ipc::get_mem_handle(buf.device_ptr()) }?;
        Ok(IpcMemHandle {
            handle,
            len_bytes: (buf.len() * std::mem::size_of::<T>()) as u64,
        })
    }

    /// The 72 bytes to send.
    pub fn to_bytes(&self) -> [u8; 72] {
        let mut b = [0u8; 72];
        b[..64].copy_from_slice(&self.handle);
        b[64..].copy_from_slice(&self.len_bytes.to_le_bytes());
        b
    }

    /// Parses [`IpcMemHandle::to_bytes`]'s output.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != 72 {
            return Err(Error::InvalidArgument(format!(
                "an IPC handle is 72 bytes, got {}: send IpcMemHandle::to_bytes unchanged",
                b.len()
            )));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[..64]);
        let mut len = [0u8; 8];
        len.copy_from_slice(&b[64..]);
        Ok(IpcMemHandle {
            handle,
            len_bytes: u64::from_le_bytes(len),
        })
    }
}

#[derive(Debug)]
pub(super) enum Release {
    /// `cuIpcCloseMemHandle`.
    Legacy,
    /// `cuMemFree` of an imported pool pointer; keeps the pool alive.
    Pool(#[allow(dead_code)] Arc<PoolHandle>),
}

/// Another process's device memory mapped into this one, as a cudarc slice. Unmapped on drop
/// (`cuIpcCloseMemHandle`, or `cuMemFree` for pool memory) after all the work queued in its
/// context finished.
///
/// The drop waits for every stream of the mapping's context (`cuCtxSynchronize`), not only the
/// mapping's own: cudarc keeps one read and one write event per slice, so a read on another
/// stream followed by one on the mapping's stream would otherwise be forgotten, and neither
/// `cuIpcCloseMemHandle` nor `cuMemFree` of pool memory waits for queued work. It is the wait a
/// [`DeviceBuffer`]'s drop makes (`cuMemFree` of `cuMemAlloc` memory waits for the context's
/// work), with its caveat: do not drop a mapping while another stream of its context waits for
/// the dropping thread (a host function or a kernel waiting for a flag it sets later). Work
/// another device queued on the mapping is covered by the calls that queue it
/// ([`copy_peer`](crate::p2p::copy_peer) waits for its copy; the `unsafe` async copies make it the
/// caller's promise). If the wait fails, the mapping is leaked rather than released under
/// queued work.
///
/// The bytes come from another process, so the element type must accept any bit pattern
/// ([`AnyBitPattern`]): integers and floats, not `bool` (a byte 2
/// read as `bool` is undefined behaviour):
///
/// ```no_run
/// # use gpudirect::p2p::ipc::{IpcMapping, IpcMemHandle};
/// # fn f(s: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>, h: &IpcMemHandle) -> gpudirect::Result<()> {
/// let m = IpcMapping::<f32>::open(s, h)?;
/// # Ok(()) }
/// ```
///
/// ```compile_fail
/// # use gpudirect::p2p::ipc::{IpcMapping, IpcMemHandle};
/// # fn f(s: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>, h: &IpcMemHandle) -> gpudirect::Result<()> {
/// let m = IpcMapping::<bool>::open(s, h)?; // not every byte is a bool
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct IpcMapping<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    ptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
    owner_device: usize,
    path: PathReport,
    release: Release,
}

impl<T> IpcMapping<T> {
    /// Opens a legacy handle in `stream`'s context (`cuIpcOpenMemHandle` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`).
    ///
    /// The handle's `len_bytes` came from another process and is checked against the mapping
    /// the driver made (`cuMemGetAddressRange`): a length past it is [`Error::InvalidArgument`]
    /// (the mapping is closed again); a shorter one maps a prefix.
    ///
    /// Opening a handle again in the same context gives a second mapping of the same pointer
    /// (CUDA counts the opens); each mapping closes once, and the other stays usable.
    pub fn open(stream: &Arc<CudaStream>, handle: &IpcMemHandle) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        let _restore = crate::cuda::CurrentContext::save();
        let len = elements::<T>(handle.len_bytes)?;
        let ctx = stream.context();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the stream's context is current.
        let ptr = unsafe { r::ipc::open_mem_handle(&handle.handle) }?;
        if let Err(e) = check_mapped_len(ptr, handle.len_bytes, "IpcMemHandle") {
            // SAFETY: opened above, closed once on this error path; nothing used it.
            if let Err(c) = unsafe { r::ipc::close_mem_handle(ptr) } {
                tracing::warn!(%c, "gpudirect IpcMapping: closing a refused mapping failed");
            }
            return Err(e);
        }
        let owner = owner_device(ptr, ctx);
        // With LAZY_ENABLE_PEER_ACCESS the driver enables peer access from this context to the
        // owner's: reads and writes go straight over the link.
        let path = if owner == ctx.ordinal() {
            PathReport::direct(TransferPath::PeerDirect {
                link: crate::path::Link::Unknown,
            })
        } else {
            PathReport::direct(TransferPath::PeerDirect {
                link: crate::p2p::topology::link_between(ctx.ordinal(), owner),
            })
        };
        Ok(Self::new(
            &mut records(),
            stream,
            ptr,
            len,
            owner,
            path,
            Release::Legacy,
        ))
    }

    /// Wraps a mapping made at `ptr` and enters it in `records` (one entry per mapping).
    pub(super) fn new(
        records: &mut Records,
        stream: &Arc<CudaStream>,
        ptr: sys::CUdeviceptr,
        len: usize,
        owner_device: usize,
        path: PathReport,
        release: Release,
    ) -> Self {
        add_mapping(
            records,
            ptr,
            len * std::mem::size_of::<T>(),
            path.is_direct(),
        );
        // SAFETY: `ptr` maps `len` elements' bytes in the stream's context; the slice is never
        // dropped by cudarc (ManuallyDrop, leaked in our Drop before the unmap).
        let slice = ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) });
        IpcMapping {
            slice,
            ptr,
            stream: stream.clone(),
            owner_device,
            path,
            release,
        }
    }

    slice_accessors!();

    /// The device the memory lives on, in this process's numbering.
    pub fn owner_device(&self) -> usize {
        self.owner_device
    }

    /// How this process's device reaches the memory.
    pub fn path(&self) -> &PathReport {
        &self.path
    }
}

impl<T> Drop for IpcMapping<T> {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        // SAFETY: taken exactly once, here.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        crate::cuda::release_slice_view(slice, &self.stream, "IpcMapping");
        // Every stream of the context, not only the mapping's own (see the type's docs).
        if let Err(e) = self.stream.context().synchronize() {
            tracing::warn!(%e, "gpudirect IpcMapping: cuCtxSynchronize failed; mapping leaked rather than released under queued work");
            return;
        }
        if let Err(e) = crate::cuda::bind(self.stream.context()) {
            tracing::warn!(%e, "gpudirect IpcMapping: cannot bind context; mapping leaked");
            return;
        }
        let res = match &self.release {
            Release::Legacy => {
                // CUDA counts the opens of one handle (the same pointer each time): every
                // mapping closes once, and only its own entry goes.
                remove_mapping(self.ptr);
                // SAFETY: `ptr` came from cuIpcOpenMemHandle and no queued work of this
                // context uses it any more (synchronized above).
                unsafe { r::ipc::close_mem_handle(self.ptr) }
            }
            Release::Pool(_) => {
                // A repeated import may return an address already imported: the last mapping
                // of the address frees it, under the record's lock (see `records`).
                let mut records = records();
                if records.remove_one(self.ptr) > 0 {
                    Ok(())
                } else {
                    // SAFETY: `ptr` came from cuMemPoolImportPointer in this context (current:
                    // bound above), no other mapping of it is left (the record, locked), and all
                    // the context's work finished (synchronized above), which cuMemFree of pool
                    // memory requires of its caller.
                    unsafe { r::mem::free(self.ptr) }
                }
            }
        };
        if let Err(e) = res {
            tracing::warn!(%e, "gpudirect IpcMapping: unmapping failed");
        }
    }
}

//! VMM (`cuMemCreate`) IPC: a [`VmmBuffer`]'s allocation exported as a POSIX fd
//! ([`VmmBuffer::export_fd`]) and mapped in another process as a [`VmmImport`].

use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, CudaView, CudaViewMut};

use super::elements;
use crate::cuda::result as r;
use crate::cuda::vmm::VmmBuffer;
use crate::cuda::{slice_accessors, AnyBitPattern};
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};

/// Another process's [`VmmBuffer`](crate::p2p::VmmBuffer) mapped into this one from its POSIX file
/// descriptor: `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap` and
/// `cuMemSetAccess` for the importer's device; seen as a cudarc slice of the importer's
/// context. On drop, after all the work queued in its context finished (`cuCtxSynchronize`,
/// as for [`IpcMapping`](super::IpcMapping)): `cuMemUnmap`, `cuMemAddressFree`, `cuMemRelease`.
///
/// The mapping is VMM memory of the exporter's device, so [`copy_peer`](crate::p2p::copy_peer)
/// reports [`MemoryKind::Vmm`](crate::p2p::MemoryKind::Vmm) and derives the path from
/// `cuMemGetAccess`, as for any VMM peer copy; [`VmmImport::path`] tells it directly.
#[derive(Debug)]
pub struct VmmImport<T> {
    /// Never dropped by cudarc: leaked in our Drop before the range is unmapped.
    slice: ManuallyDrop<CudaSlice<T>>,
    stream: Arc<CudaStream>,
    owner_device: usize,
    path: PathReport,
    range: crate::cuda::vmm::VmmRange,
}

impl<T> VmmImport<T> {
    /// Maps the allocation behind `fd` (from
    /// [`VmmBuffer::export_fd`](crate::p2p::VmmBuffer::export_fd), received with
    /// [`recv_fd`](super::recv_fd)) in `stream`'s context as `len_bytes` bytes (the exporter's
    /// [`VmmBuffer::len_bytes`](crate::p2p::VmmBuffer::len_bytes)) and grants this device
    /// read/write access. The owner device is read from the allocation's properties
    /// (`cuMemGetAllocationPropertiesFromHandle`). The fd is closed afterwards (the imported
    /// handle keeps the memory alive).
    ///
    /// Errors: [`Error::InvalidArgument`] when `len_bytes` is not a multiple of the element size
    /// or exceeds the allocation; the driver's error for a descriptor that is not an exported
    /// allocation.
    pub fn open(stream: &Arc<CudaStream>, fd: OwnedFd, len_bytes: u64) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        let _restore = crate::cuda::CurrentContext::save();
        let len = elements::<T>(len_bytes)?;
        let ctx = stream.context();
        let me = ctx.ordinal();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: `fd` is an open descriptor we own for the call's duration.
        let handle = unsafe { r::vmm::import_fd(fd.as_raw_fd()) }?;
        drop(fd);
        // SAFETY: `handle` is live (imported above).
        let props = match unsafe { r::vmm::allocation_props(handle) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: imported above, released once on this error path.
                let _ = unsafe { r::vmm::release(handle) };
                return Err(e);
            }
        };
        let owner = usize::try_from(r::location_id(&props.location)).unwrap_or(me);
        let padded = r::vmm::granularity(&props)
            .and_then(|g| crate::cuda::vmm::round_up(len_bytes as usize, g).map(|s| (s, g)));
        let (size, g) = match padded {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: imported above, released once on this error path.
                let _ = unsafe { r::vmm::release(handle) };
                return Err(e);
            }
        };
        // Maps exactly the exporter's padded size (the same granularity query on the same
        // properties); a larger `len_bytes` than the allocation makes cuMemMap fail.
        let range = crate::cuda::vmm::VmmRange::map(ctx, handle, size, g)
            .map_err(|e| match e {
                Error::Cuda { op: "cuMemMap", .. } => Error::InvalidArgument(format!(
                    "mapping {size} bytes of the imported VMM allocation failed ({e}): pass the exporter's VmmBuffer::len_bytes"
                )),
                other => other,
            })?;
        let path = if owner == me {
            PathReport::direct(TransferPath::PeerDirect {
                link: crate::path::Link::Unknown,
            })
        } else {
            // SAFETY: the range is mapped and lives in `range`.
            match unsafe { r::vmm::get_access(range.ptr, me as i32) } {
                Ok(bits) if bits & 3 == 3 => PathReport::direct(TransferPath::PeerDirect {
                    link: crate::p2p::topology::link_between(me, owner),
                }),
                _ => PathReport::fallback(
                    TransferPath::StagedThroughHost,
                    Cause::Other {
                        message: format!(
                            "imported VMM memory of GPU {owner} is not mapped for GPU {me} (cuMemGetAccess)"
                        ),
                        fix: "check that the two GPUs can access each other (nvidia-smi topo -p2p r)"
                            .into(),
                    },
                ),
            }
        };
        // SAFETY: `range.ptr` maps `size >= len_bytes` bytes readable and writable by this
        // device; the slice is never dropped by cudarc (ManuallyDrop, leaked in our Drop before
        // the range is unmapped).
        let slice = ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(range.ptr, len) });
        Ok(VmmImport {
            slice,
            stream: stream.clone(),
            owner_device: owner,
            path,
            range,
        })
    }

    slice_accessors!();

    /// The device the memory lives on, in this process's numbering.
    pub fn owner_device(&self) -> usize {
        self.owner_device
    }

    /// How this process's device reaches the memory (`cuMemGetAccess` after the import).
    pub fn path(&self) -> &PathReport {
        &self.path
    }

    /// The raw device address (`CUdeviceptr`) in this process.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.range.ptr
    }
}

impl<T> Drop for VmmImport<T> {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        // SAFETY: taken exactly once, here.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        crate::cuda::release_slice_view(slice, &self.stream, "VmmImport");
        // `range` is dropped right after this: unmap, address free, release.
    }
}

impl<T: AnyBitPattern> VmmBuffer<T> {
    /// Exports the allocation as a POSIX file descriptor (`cuMemExportToShareableHandle`), to
    /// send with [`send_fd`](super::send_fd) to a process that maps it with
    /// [`VmmImport::open`], together with [`VmmBuffer::len_bytes`].
    ///
    /// Waits first for the work cudarc ordered as writing the buffer (everything queued on its
    /// stream, [`VmmBuffer::alloc_zeros`]'s zeroing included, and a write recorded from another
    /// stream), so an importer that maps it right away sees the buffer as it is now.
    ///
    /// The importer writes the memory with whatever bytes it likes, so the element type must
    /// accept any bit pattern ([`AnyBitPattern`]), as on the importing side:
    ///
    /// ```no_run
    /// # use gpudirect::p2p::VmmBuffer;
    /// fn f(buf: &VmmBuffer<i32>) -> gpudirect::Result<std::os::fd::OwnedFd> {
    ///     buf.export_fd()
    /// }
    /// ```
    ///
    /// ```compile_fail,E0599
    /// # use gpudirect::p2p::VmmBuffer;
    /// fn f(buf: &VmmBuffer<bool>) -> gpudirect::Result<std::os::fd::OwnedFd> {
    ///     buf.export_fd() // error: not every byte is a bool
    /// }
    /// ```
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::wait_for_slice_writes(self.slice())?;
        // SAFETY: the handle is live (the buffer owns it) and was created with the POSIX fd type.
        let fd = unsafe { r::vmm::export_fd(self.allocation_handle()) }?;
        // SAFETY: the driver returned a fresh fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

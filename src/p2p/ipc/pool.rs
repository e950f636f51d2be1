//! Pool IPC: a [`SharedPool`] exported as a POSIX fd, imported as an [`ImportedPool`]; each
//! allocation travels as a [`PoolPointer`] and is mapped as an [`IpcMapping`].

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};

use super::legacy::{IpcMapping, IpcMemHandle, Release};
use super::{check_mapped_len, elements, owner_device, records};
use crate::cuda::result as r;
use crate::cuda::AnyBitPattern;
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};

/// A pool handle destroyed on drop (allocations still outstanding keep the driver's pool alive
/// until they are freed: `cuMemPoolDestroy`'s documented behaviour).
#[derive(Debug)]
pub(super) struct PoolHandle {
    pool: sys::CUmemoryPool,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUmemoryPool is an opaque driver handle usable from any thread (CUDA Programming
// Guide: multiple host threads may use the driver API concurrently); the context is Send +
// Sync. The pool is destroyed once, in Drop, when the last `Arc` goes (mappings of its memory
// hold one); allocations still outstanding then keep the driver's pool alive
// (`cuMemPoolDestroy`'s documented behaviour). `mem::forget` leaks the pool.
unsafe impl Send for PoolHandle {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for PoolHandle {}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        let _restore = crate::cuda::CurrentContext::save();
        if let Err(e) = crate::cuda::bind(&self.ctx) {
            tracing::warn!(%e, "gpudirect pool: cannot bind context; pool leaked");
            return;
        }
        // SAFETY: we created or imported this pool and destroy it once.
        if let Err(e) = unsafe { r::mem_pool::destroy(self.pool) } {
            tracing::warn!(%e, "gpudirect pool: cuMemPoolDestroy failed");
        }
    }
}

/// A device memory pool exportable to other processes (`cuMemPoolCreate` with
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). cudarc's default pool is not exportable.
#[derive(Debug)]
pub struct SharedPool {
    inner: Arc<PoolHandle>,
    /// Whether [`SharedPool::export_fd`] succeeded once: the driver exports an allocation
    /// only of a pool that is already shared.
    exported: std::sync::atomic::AtomicBool,
}

impl SharedPool {
    /// Creates an exportable pool on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let pool = r::mem_pool::create_exportable(ctx.ordinal() as i32)?;
        Ok(SharedPool {
            inner: Arc::new(PoolHandle {
                pool,
                ctx: ctx.clone(),
            }),
            exported: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The raw pool, e.g. for [`PeerAccess::with_pool`](crate::p2p::PeerAccess::with_pool).
    pub fn handle(&self) -> sys::CUmemoryPool {
        self.inner.pool
    }

    /// Allocates `len` zeroed elements from the pool on `stream` (`cuMemAllocFromPoolAsync`).
    /// The slice is freed by cudarc (`cuMemFreeAsync`) like any cudarc allocation; free it only
    /// after importers have unmapped it, on a thread where its context is current (cudarc's drop
    /// does not bind it; with no current context the free fails and the memory leaks).
    pub fn alloc_zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let _restore = crate::cuda::CurrentContext::save();
        if stream.context() != &self.inner.ctx {
            return Err(Error::InvalidArgument(format!(
                "the stream is on GPU {} but the pool on GPU {}: allocate on a stream of the pool's device",
                stream.context().ordinal(),
                self.inner.ctx.ordinal()
            )));
        }
        if !self.inner.ctx.has_async_alloc() {
            return Err(Error::Unsupported {
                what: "stream-ordered pools".into(),
                cause: Cause::Other {
                    message: "this device does not support memory pools".into(),
                    fix: "use a DeviceBuffer and IpcMemHandle instead".into(),
                },
            });
        }
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow usize")))?;
        crate::cuda::bind(&self.inner.ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: pool and stream are live; the stream's context is current.
        let ptr = unsafe { r::mem_pool::alloc_async(bytes, self.inner.pool, stream.cu_stream()) }?;
        // SAFETY: `ptr` holds `bytes` bytes of pool memory on this stream; cudarc frees it with
        // cuMemFreeAsync (the context has async alloc), which is how pool memory is freed.
        let mut slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        stream
            .memset_zeros(&mut slice)
            .map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        Ok(slice)
    }

    /// Exports the pool as a POSIX file descriptor (`cuMemPoolExportToShareableHandle`).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        // SAFETY: the pool is live and was created with the POSIX fd handle type.
        let fd = unsafe { r::mem_pool::export_fd(self.inner.pool) }?;
        self.exported
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the driver returned a fresh fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports one allocation of this pool (`cuMemPoolExportPointer`). Export the pool first
    /// ([`SharedPool::export_fd`]): the driver shares allocations only of a pool already
    /// shared (on the H200 it refused one of a pool not yet exported with
    /// `CUDA_ERROR_INVALID_VALUE`; this call then says so as [`Error::InvalidArgument`]).
    ///
    /// Waits first for the work cudarc ordered as writing `slice` (everything queued on its
    /// stream, the stream-ordered allocation and [`SharedPool::alloc_zeros`]'s zeroing
    /// included, and a write recorded from another stream): CUDA forbids an importer to access
    /// the memory before the allocation completed in the exporting process.
    ///
    /// Exporting is `unsafe`: nothing on this side knows when an importer frees its mapping,
    /// so the caller promises that the allocation outlives it:
    ///
    /// ```no_run
    /// # use gpudirect::cudarc::driver::CudaSlice;
    /// # use gpudirect::p2p::ipc::{PoolPointer, SharedPool};
    /// fn f(pool: &SharedPool, s: &CudaSlice<u8>) -> gpudirect::Result<PoolPointer> {
    ///     // SAFETY: `s` is dropped only after the importer said its mapping is gone.
    ///     unsafe { pool.export_pointer(s) }
    /// }
    /// ```
    ///
    /// ```compile_fail,E0133
    /// # use gpudirect::cudarc::driver::CudaSlice;
    /// # use gpudirect::p2p::ipc::{PoolPointer, SharedPool};
    /// fn f(pool: &SharedPool, s: &CudaSlice<u8>) -> gpudirect::Result<PoolPointer> {
    ///     pool.export_pointer(s) // error: `export_pointer` is an `unsafe fn`
    /// }
    /// ```
    ///
    /// The importer writes the memory with whatever bytes it likes, so the element type must
    /// accept any bit pattern ([`AnyBitPattern`]), as on the importing side:
    ///
    /// ```compile_fail,E0277
    /// # use gpudirect::cudarc::driver::CudaSlice;
    /// # use gpudirect::p2p::ipc::{PoolPointer, SharedPool};
    /// fn f(pool: &SharedPool, s: &CudaSlice<bool>) -> gpudirect::Result<PoolPointer> {
    ///     // SAFETY: as above.
    ///     unsafe { pool.export_pointer(s) } // error: not every byte is a bool
    /// }
    /// ```
    ///
    /// # Safety
    ///
    /// `slice` must not be dropped (cudarc frees it with `cuMemFreeAsync`) before every
    /// [`IpcMapping`] imported from the returned pointer, in any process, has been dropped:
    /// CUDA requires imported pool memory to be freed in every importing process before the
    /// exporter frees it, and the pool hands a freed range to the next allocation, whose data
    /// the importer would then read and write. Hand the pointer only to processes that tell you
    /// (a message, their exit) when their mapping is gone, and keep `slice` until then.
    pub unsafe fn export_pointer<T: AnyBitPattern>(
        &self,
        slice: &CudaSlice<T>,
    ) -> Result<PoolPointer> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::wait_for_slice_writes(slice)?;
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(slice, slice.stream());
        // SAFETY: `ptr` is a live allocation (borrowed for the call); the driver checks that it
        // belongs to an exportable pool; the caller keeps it alive for as long as importers map
        // it (this function's contract).
        let data = match unsafe { r::mem_pool::export_pointer(ptr) } {
            Ok(d) => d,
            Err(_) if !self.exported.load(std::sync::atomic::Ordering::Relaxed) => {
                return Err(Error::InvalidArgument(
                    "cuMemPoolExportPointer shares an allocation of an already shared pool, and this pool was not exported: call SharedPool::export_fd (and send the pool to the importer) before exporting its allocations".into(),
                ))
            }
            Err(e) => return Err(e),
        };
        Ok(PoolPointer {
            data,
            len_bytes: (slice.len() * std::mem::size_of::<T>()) as u64,
        })
    }
}

/// `cuMemPoolExportPointer` data plus the allocation's size: 72 bytes to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolPointer {
    /// The opaque `CUmemPoolPtrExportData`.
    pub data: [u8; 64],
    /// Size of the allocation in bytes.
    pub len_bytes: u64,
}

impl PoolPointer {
    /// The 72 bytes to send.
    pub fn to_bytes(&self) -> [u8; 72] {
        let mut b = [0u8; 72];
        b[..64].copy_from_slice(&self.data);
        b[64..].copy_from_slice(&self.len_bytes.to_le_bytes());
        b
    }

    /// Parses [`PoolPointer::to_bytes`]'s output.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let h = IpcMemHandle::from_bytes(b)?;
        Ok(PoolPointer {
            data: h.handle,
            len_bytes: h.len_bytes,
        })
    }
}

/// Another process's [`SharedPool`], imported from its file descriptor.
#[derive(Debug)]
pub struct ImportedPool {
    inner: Arc<PoolHandle>,
}

impl ImportedPool {
    /// Imports a pool fd received from the exporter (`cuMemPoolImportFromShareableHandle`).
    /// The fd is closed afterwards (the driver keeps its own reference).
    pub fn from_fd(ctx: &Arc<CudaContext>, fd: OwnedFd) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: `fd` is an open descriptor we own for the call's duration.
        let pool = unsafe { r::mem_pool::import_fd(fd.as_raw_fd()) }?;
        drop(fd);
        Ok(ImportedPool {
            inner: Arc::new(PoolHandle {
                pool,
                ctx: ctx.clone(),
            }),
        })
    }

    /// Maps one exported allocation (`cuMemPoolImportPointer`) in `stream`'s context and, when
    /// the memory lives on another device, grants this device access to the imported pool
    /// (`cuMemPoolSetAccess`). The mapping's [`IpcMapping::path`] says what `cuMemPoolGetAccess`
    /// then reports.
    ///
    /// The pointer's `len_bytes` came from another process and is checked against the imported
    /// allocation (`cuMemGetAddressRange`): a length past it is [`Error::InvalidArgument`] (the
    /// import is freed again); a shorter one maps a prefix.
    ///
    /// A pointer imported again while an earlier mapping of it lives may come back at the same
    /// address: the mappings then share it, and the last one dropped frees it (once).
    pub fn import<T: AnyBitPattern>(
        &self,
        stream: &Arc<CudaStream>,
        ptr: &PoolPointer,
    ) -> Result<IpcMapping<T>> {
        let _restore = crate::cuda::CurrentContext::save();
        let len = elements::<T>(ptr.len_bytes)?;
        let ctx = stream.context();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // Held until the mapping's entry is in: a repeated import that returns an address
        // already imported is then counted before another mapping's drop can free it.
        let mut records = records();
        // SAFETY: the imported pool is live (we hold it).
        let p = unsafe { r::mem_pool::import_pointer(self.inner.pool, &ptr.data) }?;
        if let Err(e) = check_mapped_len(p, ptr.len_bytes, "PoolPointer") {
            if records.count(p) == 0 {
                // SAFETY: imported above in this context (current) and used by nothing, no live
                // mapping shares the address (the record, locked); freed once on this error path.
                if let Err(f) = unsafe { r::mem::free(p) } {
                    tracing::warn!(%f, "gpudirect ImportedPool: freeing a refused import failed");
                }
            }
            return Err(e);
        }
        let owner = owner_device(p, ctx);
        let me = ctx.ordinal();
        // Grant this device access even when the driver names it as the owner (it then refuses
        // harmlessly): access settings of the exporter's pool do not travel with the fd.
        // SAFETY: the imported pool is live (we hold it).
        let granted = unsafe {
            r::mem_pool::set_access(
                self.inner.pool,
                me as i32,
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            )
        };
        let path = if owner == me {
            PathReport::direct(TransferPath::PeerDirect {
                link: crate::path::Link::Unknown,
            })
        } else {
            if let Err(e) = &granted {
                tracing::warn!(%e, "gpudirect ImportedPool: granting access to the imported pool failed");
            }
            // SAFETY: the imported pool is live (we hold it).
            match unsafe { r::mem_pool::get_access(self.inner.pool, me as i32) } {
                Ok(sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE) => {
                    PathReport::direct(TransferPath::PeerDirect {
                        link: crate::p2p::topology::link_between(me, owner),
                    })
                }
                _ => PathReport::fallback(
                    TransferPath::StagedThroughHost,
                    Cause::PoolAccessNotGranted {
                        accessor: me,
                        owner,
                    },
                ),
            }
        };
        Ok(IpcMapping::new(
            &mut records,
            stream,
            p,
            len,
            owner,
            path,
            Release::Pool(self.inner.clone()),
        ))
    }
}

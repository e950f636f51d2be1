//! Device memory shared across processes (communication layers run one process per GPU).
//!
//! - `cuMemAlloc` memory ([`DeviceBuffer`]): [`IpcMemHandle`] from `cuIpcGetMemHandle`, opened
//!   in the other process with `cuIpcOpenMemHandle` (with
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so a peer importer maps it directly) as an
//!   [`IpcMapping`].
//! - Pool memory: a [`SharedPool`] created exportable as a POSIX file descripter
//!   (`cuMemPoolExportToShareableHandle`); the fd travels over a Unix socket with
//!   [`send_fd`]/[`recv_fd`] (`SCM_RIGHTS`), is imported as an [`ImportedPool`], and each
//!   allocation travels as a [`PoolPointer`] (`cuMemPoolExportPointer` /
//!   `cuMemPoolImportPointer`). The importer grants its own device access to the imported pool.
//! - VMM memory ([`VmmBuffer`](super::VmmBuffer), `cuMemCreate`): the allocation itself
//!   travels as a POSIX fd (`cuMemExportToShareableHandle`, sent with [`send_fd`]) and is
//!   mapped as a [`VmmImport`] (`cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`
//!   for the importer's device); its path is observed with `cuMemGetAccess` like any VMM memory.
//!
//! Every mapping records the path its importer reaches the memory by, so
//! [`copy_peer`](super::copy_peer) reports it like any peer copy, and [`IpcMapping::path`]
//! tells it directly.

use std::io::{IoSlice, IoSliceMut};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};

use crate::cuda::result as r;
use crate::cuda::{AnyBitPattern, DeviceBuffer};
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};

// ---- process-wide record of mapped ranges ------------------------------------------------

/// (start, end, direct) of every live mapping in this process.
static MAPPINGS: Mutex<Vec<(u64, u64, bool)>> = Mutex::new(Vec::new());

/// `Some(direct)` when `ptr` lies in a live IPC mapping of this process.
pub(in crate::p2p) fn lookup_mapping(ptr: sys::CUdeviceptr) -> Option<bool> {
    let m = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    m.iter()
        .find(|(s, e, _)| ptr >= *s && ptr < (*e).max(*s + 1))
        .map(|(_, _, d)| *d)
}

fn add_mapping(start: u64, bytes: usize, direct: bool) {
    let mut m = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    m.push((start, start + bytes as u64, direct));
}

fn remove_mapping(start: u64) {
    let mut m = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    m.retain(|(s, _, _)| *s != start);
}

// ---- legacy (cuMemAlloc) IPC -------------------------------------------------------------

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
    /// for pool memory use a [`SharedPool`].
    pub fn export<T>(buf: &DeviceBuffer<T>) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        buf.stream()
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: `buf` owns a live cuMemAlloc allocation starting at `device_ptr()`.
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
enum Release {
    /// `cuIpcCloseMemHandle`.
    Legacy,
    /// `cuMemFreeAsync` of an imported pool pointer; keeps the pool alive.
    Pool(#[allow(dead_code)] Arc<PoolHandle>),
}

/// Another process's device memory mapped into this one, as a cudarc slice. Unmapped on drop
/// (`cuIpcCloseMemHandle`, or `cuMemFreeAsync` for pool memory) after its stream finished.
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
    pub fn open(stream: &Arc<CudaStream>, handle: &IpcMemHandle) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        let _restore = crate::cuda::CurrentContext::save();
        let len = elements::<T>(handle.len_bytes)?;
        let ctx = stream.context();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
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
                link: super::topology::link_between(ctx.ordinal(), owner),
            })
        };
        Ok(Self::new(stream, ptr, len, owner, path, Release::Legacy))
    }

    fn new(
        stream: &Arc<CudaStream>,
        ptr: sys::CUdeviceptr,
        len: usize,
        owner_device: usize,
        path: PathReport,
        release: Release,
    ) -> Self {
        add_mapping(ptr, len * std::mem::size_of::<T>(), path.is_direct());
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
        let _ = slice.leak();
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(%e, "gpudirect IpcMapping: stream synchronize failed before unmap");
        }
        remove_mapping(self.ptr);
        if let Err(e) = self.stream.context().bind_to_thread() {
            tracing::warn!(%e, "gpudirect IpcMapping: cannot bind context; mapping leaked");
            return;
        }
        let res = match &self.release {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and no queued work uses it any more.
            Release::Legacy => unsafe { r::ipc::close_mem_handle(self.ptr) },
            Release::Pool(_) => {
                // SAFETY: `ptr` came from cuMemPoolImportPointer; the stream finished using it.
                unsafe { r::mem_pool::free_async(self.ptr, self.stream.cu_stream()) }.and_then(
                    |()| {
                        self.stream
                            .synchronize()
                            .map_err(|e| Error::cuda("cuStreamSynchronize", e))
                    },
                )
            }
        };
        if let Err(e) = res {
            tracing::warn!(%e, "gpudirect IpcMapping: unmapping failed");
        }
    }
}

/// Checks that `len_bytes` (from a handle: another process's word) fits the memory the driver
/// mapped at `ptr` (`cuMemGetAddressRange`), so a slice of that length stays inside it.
fn check_mapped_len(ptr: sys::CUdeviceptr, len_bytes: u64, what: &str) -> Result<()> {
    // SAFETY: a context is current (the caller just mapped `ptr` in it).
    let (base, size) = unsafe { r::mem::get_address_range(ptr) }?;
    let avail = (base + size as u64).saturating_sub(ptr);
    if len_bytes > avail {
        return Err(Error::InvalidArgument(format!(
            "the {what} claims {len_bytes} bytes, but the driver mapped {avail} bytes at this \
             address: send the exporter's {what} unchanged (a wrong length would let the slice \
             run past the shared memory)"
        )));
    }
    Ok(())
}

fn elements<T>(bytes: u64) -> Result<usize> {
    let size = std::mem::size_of::<T>().max(1) as u64;
    if !bytes.is_multiple_of(size) {
        return Err(Error::InvalidArgument(format!(
            "the shared range has {bytes} bytes, not a multiple of the element size {size}: import with the exporter's element type"
        )));
    }
    Ok((bytes / size) as usize)
}

fn owner_device(ptr: sys::CUdeviceptr, ctx: &CudaContext) -> usize {
    // SAFETY: DEVICE_ORDINAL writes an int; read from a zeroed u64 (see copy::inspect).
    unsafe {
        r::pointer::get_attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            0u64,
        )
    }
    .map(|v| (v & 0xffff_ffff) as usize)
    .unwrap_or(ctx.ordinal())
}

// ---- pool IPC ----------------------------------------------------------------------------

/// A pool handle destroyed on drop (allocations still outstanding keep the driver's pool alive
/// until they are freed: `cuMemPoolDestroy`'s documented behaviour).
#[derive(Debug)]
struct PoolHandle {
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
        if let Err(e) = self.ctx.bind_to_thread() {
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
}

impl SharedPool {
    /// Creates an exportable pool on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let _restore = crate::cuda::CurrentContext::save();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let pool = r::mem_pool::create_exportable(ctx.ordinal() as i32)?;
        Ok(SharedPool {
            inner: Arc::new(PoolHandle {
                pool,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The raw pool, e.g. for [`PeerAccess::with_pool`](super::PeerAccess::with_pool).
    pub fn handle(&self) -> sys::CUmemoryPool {
        self.inner.pool
    }

    /// Allocates `len` zeroed elements from the pool on `stream` (`cuMemAllocFromPoolAsync`).
    /// The slice is freed by cudarc (`cuMemFreeAsync`) like any cudarc allocation; free it only
    /// after importers have unmapped it.
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
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
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
        // SAFETY: the driver returned a fresh fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports one allocation of this pool (`cuMemPoolExportPointer`).
    pub fn export_pointer<T>(&self, slice: &CudaSlice<T>) -> Result<PoolPointer> {
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(slice, slice.stream());
        // SAFETY: `ptr` is a live allocation (borrowed for the call); the driver checks that it
        // belongs to an exportable pool.
        let data = unsafe { r::mem_pool::export_pointer(ptr) }?;
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
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
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
    pub fn import<T: AnyBitPattern>(
        &self,
        stream: &Arc<CudaStream>,
        ptr: &PoolPointer,
    ) -> Result<IpcMapping<T>> {
        let _restore = crate::cuda::CurrentContext::save();
        let len = elements::<T>(ptr.len_bytes)?;
        let ctx = stream.context();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the imported pool is live (we hold it).
        let p = unsafe { r::mem_pool::import_pointer(self.inner.pool, &ptr.data) }?;
        if let Err(e) = check_mapped_len(p, ptr.len_bytes, "PoolPointer") {
            // SAFETY: imported above and used by nothing; freed once on this error path, and the
            // stream is synchronised before returning.
            let freed = unsafe { r::mem_pool::free_async(p, stream.cu_stream()) }.and_then(|()| {
                stream
                    .synchronize()
                    .map_err(|e| Error::cuda("cuStreamSynchronize", e))
            });
            if let Err(f) = freed {
                tracing::warn!(%f, "gpudirect ImportedPool: freeing a refused import failed");
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
                        link: super::topology::link_between(me, owner),
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
            stream,
            p,
            len,
            owner,
            path,
            Release::Pool(self.inner.clone()),
        ))
    }
}

// ---- fd passing --------------------------------------------------------------------------

/// Sends `payload` (at least one byte) and the descriptor `fd` over a Unix stream socket
/// (`sendmsg` with `SCM_RIGHTS`).
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> Result<()> {
    if payload.is_empty() {
        return Err(Error::InvalidArgument(
            "send at least one payload byte with the descriptor".into(),
        ));
    }
    let iov = [IoSlice::new(payload)];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to `space` bytes of 8-aligned buffer, enough for one cmsghdr
    // carrying one int (CMSG_SPACE); CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd.as_raw_fd());
    }
    // SAFETY: `msg` references live buffers for the call's duration.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    if n < 0 {
        return Err(Error::io("sendmsg", None, std::io::Error::last_os_error()));
    }
    if (n as usize) != payload.len() {
        return Err(Error::io(
            "sendmsg",
            None,
            std::io::Error::new(std::io::ErrorKind::WriteZero, "short write"),
        ));
    }
    Ok(())
}

/// Receives a payload of up to `buf.len()` bytes and one descriptor sent with [`send_fd`];
/// returns the descriptor and the payload length.
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> Result<(OwnedFd, usize)> {
    let mut iov = [IoSliceMut::new(buf)];
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: `msg` references live, writable buffers for the call's duration.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::io("recvmsg", None, std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_FIRSTHDR checks the length.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: `c` is checked for null first and otherwise points into `cbuf`.
    let ok = !c.is_null()
        && unsafe { (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS };
    if !ok {
        return Err(Error::io(
            "recvmsg",
            None,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no SCM_RIGHTS descriptor in the message: the peer must send with send_fd",
            ),
        ));
    }
    // SAFETY: an SCM_RIGHTS message carries at least one int after the header.
    let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int) };
    // SAFETY: the kernel installed `fd` in this process for us.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, n as usize))
}

// ---- VMM (cuMemCreate) IPC ---------------------------------------------------------------

/// Another process's [`VmmBuffer`](super::VmmBuffer) mapped into this one from its POSIX file
/// descriptor: `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap` and
/// `cuMemSetAccess` for the importer's device; seen as a cudarc slice of the importer's
/// context. On drop, after its stream finished: `cuMemUnmap`, `cuMemAddressFree`,
/// `cuMemRelease`.
///
/// The mapping is VMM memory of the exporter's device, so [`copy_peer`](super::copy_peer)
/// reports [`MemoryKind::Vmm`](super::MemoryKind::Vmm) and derives the path from
/// `cuMemGetAccess`, as for any VMM peer copy; [`VmmImport::path`] tells it directly.
#[derive(Debug)]
pub struct VmmImport<T> {
    /// Never dropped by cudarc: leaked in our Drop before the range is unmapped.
    slice: ManuallyDrop<CudaSlice<T>>,
    stream: Arc<CudaStream>,
    owner_device: usize,
    path: PathReport,
    range: super::vmm::VmmRange,
}

impl<T> VmmImport<T> {
    /// Maps the allocation behind `fd` (from [`VmmBuffer::export_fd`](super::VmmBuffer::export_fd),
    /// received with [`recv_fd`]) in `stream`'s context as `len_bytes` bytes (the exporter's
    /// [`VmmBuffer::len_bytes`](super::VmmBuffer::len_bytes)) and grants this device read/write
    /// access. The owner device is read from the allocation's properties
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
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
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
            .and_then(|g| super::vmm::round_up(len_bytes as usize, g).map(|s| (s, g)));
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
        let range = super::vmm::VmmRange::map(ctx, handle, size, g)
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
                    link: super::topology::link_between(me, owner),
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
        let _ = slice.leak();
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(%e, "gpudirect VmmImport: stream synchronize failed before unmap");
        }
        // `range` is dropped right after this: unmap, address free, release.
    }
}

//! Protection domains (`ibv_alloc_pd`) and memory registration entry points.

use std::ffi::c_void;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_gdr_sys as sys;

use super::context::Context;
use super::mr::{AccessFlags, HostMemory, MemoryRegion, MrHandle, Scoped};
use super::result;
use crate::error::{Error, Result};
use crate::path::Cause;

/// A protection domain (`struct ibv_pd`). Memory regions and queue pairs hold an `Arc` of it;
/// it holds its [`Context`]. Deallocated (`ibv_dealloc_pd`) when the last `Arc` goes.
pub struct ProtectionDomain {
    raw: NonNull<sys::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: verbs are thread-safe (rdma-core libibverbs.md); the PD pointer is only passed to verbs.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see Send.
unsafe impl Sync for ProtectionDomain {}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.ctx.name())
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx` (`ibv_alloc_pd`).
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is live (we hold an Arc).
        let raw = unsafe { result::alloc_pd(ctx.lib(), ctx.as_ptr()) }?;
        Ok(Arc::new(ProtectionDomain {
            raw,
            ctx: ctx.clone(),
        }))
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(in crate::rdma) fn as_ptr(&self) -> NonNull<sys::ibv_pd> {
        self.raw
    }

    /// Registers host memory (`ibv_reg_mr`) and keeps it: the returned [`MemoryRegion`] owns
    /// `buf` (a `Vec<u8>`, `Box<[u8]>`, a leaked `&'static mut [u8]`) and deregisters before
    /// releasing it. Memory you only borrow: [`with_registered`](Self::with_registered).
    ///
    /// `REMOTE_WRITE` and `REMOTE_ATOMIC` need `LOCAL_WRITE` (ibv_reg_mr(3)); asking for them
    /// without it is [`Error::InvalidArgument`]. An empty buffer is refused the same way.
    ///
    /// ```no_run
    /// use gpudirect::rdma::{AccessFlags, Context, ProtectionDomain};
    /// let ctx = Context::open_first()?;
    /// let pd = ProtectionDomain::new(&ctx)?;
    /// let mr = pd.register_host(vec![7u8; 4096], AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    /// println!("rkey {:#x} at {:#x}", mr.rkey(), mr.addr());
    /// # Ok::<(), gpudirect::Error>(())
    /// ```
    pub fn register_host<B: HostMemory>(
        self: &Arc<Self>,
        mut buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<B>> {
        let (ptr, len) = {
            let s: &mut [u8] = &mut buf;
            (s.as_mut_ptr(), s.len())
        };
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer: pass at least one byte".into(),
            ));
        }
        // SAFETY: `buf` is moved into the MemoryRegion, and HostMemory guarantees that moving it
        // keeps the bytes at `ptr`; the region deregisters (field order) before `buf` drops.
        let handle = unsafe { self.register_raw(ptr.cast(), len, access) }?;
        Ok(handle.attach_owner(buf))
    }

    /// Registers `buf` (`ibv_reg_mr`) for the length of `f`: `f` gets the region, and the
    /// registration is gone (`ibv_dereg_mr`) before this returns, also when `f` panics, so no
    /// peer and no work request can reach `buf` once the borrow ends. The post-and-wait helpers
    /// of [`QueuePair`](super::QueuePair) work on the region as on any other.
    ///
    /// Errors: as [`register_host`](Self::register_host), before `f` runs. If deregistration
    /// keeps failing (retried for about a second), the process aborts: returning would let
    /// the NIC write memory whose borrow ended.
    ///
    /// ```no_run
    /// use gpudirect::rdma::{AccessFlags, Context, ProtectionDomain};
    /// let ctx = Context::open_first()?;
    /// let pd = ProtectionDomain::new(&ctx)?;
    /// let mut buf = [0u8; 4096];
    /// let rkey = pd.with_registered(&mut buf, AccessFlags::LOCAL_WRITE, |mr| mr.rkey())?;
    /// println!("was registered with rkey {rkey:#x}");
    /// # Ok::<(), gpudirect::Error>(())
    /// ```
    pub fn with_registered<'a, R>(
        self: &Arc<Self>,
        buf: &'a mut [u8],
        access: AccessFlags,
        f: impl FnOnce(&mut MemoryRegion<Scoped<'a>>) -> R,
    ) -> Result<R> {
        if buf.is_empty() {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer: pass at least one byte".into(),
            ));
        }
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let scoped = Scoped::new(buf);
        // SAFETY: `buf` is borrowed for 'a, which outlasts this call, and the guard below
        // deregisters before the call returns or unwinds (or aborts the process).
        let raw = unsafe { self.register_raw(ptr.cast(), len, access) }?;
        let mut guard = ScopeGuard(ManuallyDrop::new(MemoryRegion::scoped(raw, scoped)));
        Ok(f(&mut guard.0))
    }

    /// Registers `len` bytes at `addr` (`ibv_reg_mr`): host memory, or device memory through a
    /// peer-memory client (nvidia-peermem). The region keeps nothing alive; attach an owner with
    /// [`MemoryRegion::attach`].
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must stay mapped (and, for device memory, allocated) until the returned
    /// region is dropped: the NIC may read or write it any time a work request or a remote peer
    /// holding the rkey says so, and registration pins it.
    pub unsafe fn register_raw(
        self: &Arc<Self>,
        addr: *mut c_void,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion<()>> {
        check_access(access)?;
        // SAFETY: forwarded from the caller.
        let raw = unsafe { result::reg_mr(self.ctx.lib(), self.raw, addr, len, access.bits()) }?;
        Ok(MemoryRegion::from_handle(MrHandle::new(raw, self.clone())))
    }

    /// Registers `len` bytes at `offset` of the dma-buf `fd` (`ibv_reg_dmabuf_mr`, rdma-core ≥ 34),
    /// addressed by remote peers at `iova` (which must have the same page offset as `offset`).
    /// This is the GPU-memory path: `fd` comes from `cuMemGetHandleForAddressRange`.
    ///
    /// Errors: EOPNOTSUPP/EPROTONOSUPPORT (provider or kernel without dma-buf: rxe, siw, old
    /// mlx5) → [`Error::Unsupported`] with [`Cause::DmaBufUnsupported`]; a libibverbs older
    /// than 34 → [`Error::SymbolUnavailable`].
    ///
    /// # Safety
    ///
    /// `fd` must be an open dma-buf fd whose object holds at least `offset + len` bytes and stays
    /// allocated until the returned region is dropped (the region keeps its own reference to the
    /// dma-buf, so the fd itself may be closed after this call, as NCCL does; the memory behind
    /// it, e.g. a CUDA allocation, must not be freed).
    pub unsafe fn register_dmabuf_raw(
        self: &Arc<Self>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: AccessFlags,
    ) -> Result<MemoryRegion<()>> {
        check_access(access)?;
        // SAFETY: forwarded from the caller.
        let r = unsafe {
            result::reg_dmabuf_mr(
                self.ctx.lib(),
                self.raw,
                offset,
                len,
                iova,
                fd,
                access.bits(),
            )
        };
        match r {
            Ok(raw) => Ok(MemoryRegion::from_handle(MrHandle::new(raw, self.clone()))),
            Err(Error::Verbs { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT)
                ) =>
            {
                Err(Error::Unsupported {
                    what: format!("ibv_reg_dmabuf_mr on {}", self.ctx.name()),
                    cause: Cause::DmaBufUnsupported {
                        detail: format!(
                            "the {} provider or its kernel driver does not implement dma-buf memory regions ({source})",
                            self.ctx.name()
                        ),
                    },
                })
            }
            Err(e) => Err(e),
        }
    }
}

/// Deregisters a scoped registration when its scope ends, normally or by unwinding.
struct ScopeGuard<'a>(ManuallyDrop<MemoryRegion<Scoped<'a>>>);

impl Drop for ScopeGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the region is taken once, here; the guard is not used afterwards.
        let mut mr = unsafe { ManuallyDrop::take(&mut self.0) };
        for attempt in 0..20u32 {
            match mr.close() {
                Ok(_) => return,
                Err((m, e)) => {
                    tracing::warn!(error = %e, attempt, "ibv_dereg_mr of a scoped registration failed; retrying");
                    mr = m;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        // The region must neither drop (its Drop would leak the registration while the borrow
        // ends) nor outlive the scope.
        let msg = format!(
            "gpudirect: ibv_dereg_mr keeps failing for a scoped registration of {} bytes at {:#x}; the NIC could write the buffer after its borrow ends, so the process aborts",
            mr.len(),
            mr.addr()
        );
        tracing::error!("{msg}");
        eprintln!("{msg}");
        std::process::abort();
    }
}

fn check_access(access: AccessFlags) -> Result<()> {
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !access.contains(AccessFlags::LOCAL_WRITE)
    {
        return Err(Error::InvalidArgument(
            "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE (ibv_reg_mr(3)): add AccessFlags::LOCAL_WRITE".into(),
        ));
    }
    Ok(())
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc of this PD, so none is left; freed once.
        if let Err(e) = unsafe { result::dealloc_pd(self.ctx.lib(), self.raw) } {
            tracing::warn!(device = %self.ctx.name(), error = %e, "ibv_dealloc_pd failed");
        }
    }
}

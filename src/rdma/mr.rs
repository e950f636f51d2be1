//! Memory regions: [`MemoryRegion`], generic over what it keeps alive (a host buffer, a GPU
//! allocation, or nothing), deregistered (`ibv_dereg_mr`) on drop before that owner is released.

use std::fmt;
use std::ops::{DerefMut, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_gdr_sys as sys;

use super::pd::ProtectionDomain;
use super::result;
use crate::error::{Error, Result};

bitflags::bitflags! {
    /// Memory-region and QP access flags (`enum ibv_access_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// `IBV_ACCESS_LOCAL_WRITE`: the NIC may write (receives, read responses).
        const LOCAL_WRITE = sys::IBV_ACCESS_LOCAL_WRITE;
        /// `IBV_ACCESS_REMOTE_WRITE`: remote peers holding the rkey may write.
        const REMOTE_WRITE = sys::IBV_ACCESS_REMOTE_WRITE;
        /// `IBV_ACCESS_REMOTE_READ`: remote peers holding the rkey may read.
        const REMOTE_READ = sys::IBV_ACCESS_REMOTE_READ;
        /// `IBV_ACCESS_REMOTE_ATOMIC`.
        const REMOTE_ATOMIC = sys::IBV_ACCESS_REMOTE_ATOMIC;
        /// `IBV_ACCESS_RELAXED_ORDERING` (optional: ignored by kernels without it).
        const RELAXED_ORDERING = sys::IBV_ACCESS_RELAXED_ORDERING;
    }
}

/// Host memory that may be registered: a byte slice whose address does not change when the
/// value is moved, and that stays valid while the value lives.
///
/// # Safety
///
/// Implementors guarantee that the slice returned by `deref_mut` has the same address and length
/// for the value's whole life, moves included, and is not freed before the value drops.
pub unsafe trait HostMemory: DerefMut<Target = [u8]> {}

// SAFETY: a Vec's heap buffer does not move when the Vec moves; only &mut [u8] is handed out, so
// it cannot be resized while registered.
unsafe impl HostMemory for Vec<u8> {}
// SAFETY: a boxed slice's heap buffer does not move when the Box moves.
unsafe impl HostMemory for Box<[u8]> {}
// SAFETY: the borrow keeps the slice in place for 'a, which bounds the region's life.
unsafe impl HostMemory for &mut [u8] {}

/// The registration itself: deregistered on drop; holds its PD.
pub(crate) struct MrHandle {
    raw: NonNull<sys::ibv_mr>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: verbs are thread-safe (rdma-core libibverbs.md); the MR is immutable after registration.
unsafe impl Send for MrHandle {}
// SAFETY: see Send.
unsafe impl Sync for MrHandle {}

impl MrHandle {
    pub(crate) fn new(raw: NonNull<sys::ibv_mr>, pd: Arc<ProtectionDomain>) -> Self {
        MrHandle { raw, pd }
    }

    fn mr(&self) -> &sys::ibv_mr {
        // SAFETY: the MR is live until Drop and libibverbs never changes these fields.
        unsafe { self.raw.as_ref() }
    }
}

impl Drop for MrHandle {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once, here.
        if let Err(e) = unsafe { result::dereg_mr(self.pd.context().lib(), self.raw) } {
            tracing::warn!(error = %e, "ibv_dereg_mr failed; the registration leaks");
        }
    }
}

/// A registered memory region (`struct ibv_mr`) and `B`, what it keeps alive: the host buffer
/// ([`ProtectionDomain::register_host`]), a GPU allocation, or `()` for a raw registration.
/// Teardown order is fixed by field order: deregister first, then release `B`, then the PD.
///
/// A borrowed buffer stays borrowed while it is registered, so it cannot be freed or touched
/// behind the NIC's back:
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{AccessFlags, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>) -> gpudirect::Result<()> {
///     let mut buf = vec![0u8; 4096];
///     let mr = pd.register_host(&mut buf[..], AccessFlags::LOCAL_WRITE)?;
///     drop(buf); // error: `buf` is borrowed by the registration
///     drop(mr);
///     Ok(())
/// }
/// ```
///
/// and the post-and-wait helpers borrow the region for the whole operation:
///
/// ```compile_fail
/// # use gpudirect::rdma::{MemoryRegion, QueuePair, RemoteMemory};
/// fn f(qp: &QueuePair, mut mr: MemoryRegion<Vec<u8>>, remote: RemoteMemory) {
///     let done = std::thread::scope(|s| {
///         let h = s.spawn(|| qp.read(&mut mr, 0..64, remote));
///         mr.as_mut_slice()[0] = 1; // error: `mr` is mutably borrowed by the read
///         h.join()
///     });
/// }
/// ```
pub struct MemoryRegion<B = ()> {
    handle: MrHandle,
    owner: B,
}

impl<B> fmt::Debug for MemoryRegion<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

impl MemoryRegion<()> {
    pub(crate) fn from_handle(handle: MrHandle) -> Self {
        MemoryRegion { handle, owner: () }
    }

    /// Makes the region keep `owner` alive (a GPU allocation, a dma-buf fd, a buffer) and
    /// release it only after deregistering.
    pub fn attach<T>(self, owner: T) -> MemoryRegion<T> {
        MemoryRegion {
            handle: self.handle,
            owner,
        }
    }
}

impl<B> MemoryRegion<B> {
    /// The local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.handle.mr().lkey
    }

    /// The remote key: whoever holds it (with [`MemoryRegion::addr`]) may access the region as
    /// its access flags allow.
    pub fn rkey(&self) -> u32 {
        self.handle.mr().rkey
    }

    /// The address remote peers use (the iova; for host memory, the virtual address).
    pub fn addr(&self) -> u64 {
        self.handle.mr().addr as u64
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.handle.mr().length
    }

    /// True for a zero-length region (never produced by this crate).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.handle.pd
    }

    /// Deregisters now (`ibv_dereg_mr`) and returns what the region kept alive; on failure
    /// the region comes back intact with the error (Drop would only log it).
    pub fn close(self) -> std::result::Result<B, (Self, Error)> {
        // SAFETY: the MR is live; on success it is not deregistered again (see below).
        match unsafe { result::dereg_mr(self.handle.pd.context().lib(), self.handle.raw) } {
            Ok(()) => {
                let MemoryRegion { handle, owner } = self;
                let handle = std::mem::ManuallyDrop::new(handle);
                // SAFETY: the registration is gone, so MrHandle::drop must not run; the PD Arc
                // is moved out exactly once and dropped here.
                drop(unsafe { std::ptr::read(&handle.pd) });
                Ok(owner)
            }
            Err(e) => Err((self, e)),
        }
    }

    /// What the region keeps alive.
    pub fn owner(&self) -> &B {
        &self.owner
    }

    /// What remote peers need to target the whole region.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }

    /// A scatter/gather entry for `range` (byte offsets inside the region). The whole region
    /// with `..`-like `0..len()`.
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "range {}..{} is outside the {}-byte memory region",
                range.start,
                range.end,
                self.len()
            )));
        }
        let len = u32::try_from(range.end - range.start).map_err(|_| {
            Error::InvalidArgument("a scatter/gather entry holds at most 4 GiB - 1".into())
        })?;
        Ok(Sge {
            addr: self.addr() + range.start as u64,
            len,
            lkey: self.lkey(),
        })
    }
}

impl<B: HostMemory> MemoryRegion<B> {
    /// The registered bytes.
    ///
    /// The NIC may change them while a remote peer holds the rkey with write access: read them
    /// after the completion (or message) that says the write landed.
    pub fn as_slice(&self) -> &[u8] {
        &self.owner
    }

    /// The registered bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.owner
    }

    /// Deregisters and gives the buffer back.
    pub fn into_inner(self) -> B {
        let MemoryRegion { handle, owner } = self;
        drop(handle);
        owner
    }
}

/// One scatter/gather entry (`struct ibv_sge`): local registered memory a work request reads
/// or writes. Made by [`MemoryRegion::sge`], which checks the bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (in the region's address space).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The region's lkey.
    pub lkey: u32,
}

impl Sge {
    pub(crate) fn to_raw(self) -> sys::ibv_sge {
        sys::ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.lkey,
        }
    }
}

/// Remote memory a peer exposed: where to RDMA-write or -read, and the key that allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteMemory {
    /// Remote address (iova).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteMemory {
    /// The part starting `offset` bytes in. Not bounds-checked against the peer's region: the
    /// responder's NIC checks, and an access outside completes with
    /// `IBV_WC_REM_ACCESS_ERR`.
    pub fn offset(self, offset: u64) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr.wrapping_add(offset),
            len: self.len.saturating_sub(offset),
            rkey: self.rkey,
        }
    }
}

//! Memory regions: [`MemoryRegion`], generic over what it keeps alive (a host buffer, a GPU
//! allocation, or nothing), deregistered (`ibv_dereg_mr`) on drop before that owner is released.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
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

/// Host memory that may be registered for as long as the value lives: a byte slice whose
/// address does not change when the value is moved, and that only the value's own `Drop` can
/// release.
///
/// Implemented for `Vec<u8>`, `Box<[u8]>` and `&'static mut [u8]` (memory that is never freed,
/// e.g. from `Box::leak`). Not for `&'a mut [u8]`: [`std::mem::forget`] on the region would end
/// the borrow while the registration, and the NIC's access, stays; register borrowed memory for
/// the length of a scope with [`ProtectionDomain::with_registered`] instead.
///
/// # Safety
///
/// Implementors guarantee that the slice returned by `deref`/`deref_mut` has the same address
/// and length for the value's whole life, moves included, and that its memory stays allocated
/// and used for nothing else until the value is dropped, and forever if it never is
/// (`mem::forget` may leak the memory, never free it).
pub unsafe trait HostMemory: DerefMut<Target = [u8]> {}

// SAFETY: a Vec's heap buffer does not move when the Vec moves, and only Vec's Drop frees it;
// only &mut [u8] is handed out (never the Vec), so it cannot be resized while registered.
unsafe impl HostMemory for Vec<u8> {}
// SAFETY: a boxed slice's heap buffer does not move when the Box moves; only its Drop frees it.
unsafe impl HostMemory for Box<[u8]> {}
// SAFETY: a `'static` unique borrow: the memory is never freed (safe code gets one only from
// leaked memory), and while the region holds the borrow nothing else can reach the bytes.
unsafe impl HostMemory for &'static mut [u8] {}

/// What a scoped registration ([`ProtectionDomain::with_registered`]) holds: the unique borrow
/// of the caller's buffer, for `'a`. It exists only inside the scope, which deregisters the
/// region before the borrow can end.
pub struct Scoped<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: `Scoped` stands for the `&'a mut [u8]` it was made from (its only pointer), and
// `&mut [u8]` is Send.
unsafe impl Send for Scoped<'_> {}
// SAFETY: as for Send: `&mut [u8]` is Sync; shared access only copies bytes out.
unsafe impl Sync for Scoped<'_> {}

impl Scoped<'_> {
    pub(in crate::rdma) fn new(buf: &mut [u8]) -> Scoped<'_> {
        Scoped {
            len: buf.len(),
            ptr: NonNull::from(buf).cast(),
            _borrow: PhantomData,
        }
    }
}

impl fmt::Debug for Scoped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scoped").field("len", &self.len).finish()
    }
}

/// The registration itself (no `Drop`: [`MemoryRegion`] deregisters, and decides what happens
/// to the memory when that fails). Holds its PD.
pub(in crate::rdma) struct MrHandle {
    raw: NonNull<sys::ibv_mr>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: libibverbs is thread-safe ("all verbs are thread safe", rdma-core
// Documentation/libibverbs.md); the ibv_mr fields we read (lkey, rkey, addr, length) are
// written once by ibv_reg_mr, before the pointer reaches us, and never again.
unsafe impl Send for MrHandle {}
// SAFETY: see Send; `&MrHandle` only reads those fields.
unsafe impl Sync for MrHandle {}

impl MrHandle {
    pub(in crate::rdma) fn new(raw: NonNull<sys::ibv_mr>, pd: Arc<ProtectionDomain>) -> Self {
        MrHandle { raw, pd }
    }

    fn mr(&self) -> &sys::ibv_mr {
        // SAFETY: the MR is registered while a MrHandle exists (MemoryRegion deregisters only
        // when it drops or takes the handle apart), and libibverbs never changes these fields.
        unsafe { self.raw.as_ref() }
    }

    /// `ibv_dereg_mr`.
    ///
    /// # Safety
    ///
    /// Called at most once with success; the handle is not used afterwards except to drop it.
    unsafe fn deregister(&self) -> Result<()> {
        // SAFETY: the MR is live (caller: not deregistered yet).
        unsafe { result::dereg_mr(self.pd.context().lib(), self.raw) }
    }
}

/// A registered memory region (`struct ibv_mr`) and `B`, what it keeps alive: the host buffer
/// ([`ProtectionDomain::register_host`]), the borrow of a scoped registration ([`Scoped`],
/// [`ProtectionDomain::with_registered`]), a GPU allocation, or `()` for a raw registration
/// ([`Attached`] once [`attach`](MemoryRegion::attach) gave it an owner).
/// Dropping it deregisters first, then releases `B`, then the PD. If `ibv_dereg_mr` fails, `B`
/// and the PD are leaked (logged): releasing memory the NIC can still reach is never an option.
///
/// The bytes of host memory are reached by copying ([`copy_out`](Self::copy_out),
/// [`copy_in`](Self::copy_in), [`to_vec`](Self::to_vec)), not by reference: a peer holding the
/// rkey may write them at any time, and a Rust reference promises they do not change. The
/// reference forms [`as_slice`](Self::as_slice) / [`as_mut_slice`](Self::as_mut_slice) are
/// `unsafe`.
///
/// Borrowed memory cannot be registered beyond a scope (`mem::forget` would end the borrow and
/// leave the registration):
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{AccessFlags, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, buf: &mut [u8]) -> gpudirect::Result<()> {
///     let mr = pd.register_host(buf, AccessFlags::LOCAL_WRITE)?; // error: `&mut [u8]` is not `HostMemory`
///     std::mem::forget(mr);
///     Ok(())
/// }
/// ```
///
/// and registered bytes are not handed out as references (a peer may write them any time):
///
/// ```compile_fail
/// # use gpudirect::rdma::MemoryRegion;
/// fn f(mr: &MemoryRegion<Vec<u8>>) -> u8 {
///     mr.as_slice()[0] // error: `as_slice` is an `unsafe fn`
/// }
/// ```
///
/// A scoped registration cannot leave its scope:
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{AccessFlags, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, buf: &mut [u8]) -> gpudirect::Result<()> {
///     let mut keep = None;
///     pd.with_registered(buf, AccessFlags::LOCAL_WRITE, |mr| keep = Some(mr))?; // error: `mr` escapes the closure
///     Ok(())
/// }
/// ```
///
/// The byte accessors belong to regions whose owner is the registered memory
/// ([`ProtectionDomain::register_host`], [`ProtectionDomain::with_registered`]). An owner
/// attached to a raw registration keeps whatever it is alive, but its bytes are not the
/// region's (a 16-byte `Vec` attached to a 1 MiB registration), so such a region has no byte
/// accessors:
///
/// ```no_run
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{AccessFlags, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, p: *mut std::ffi::c_void) -> gpudirect::Result<()> {
///     // SAFETY: (this example's contract) `p` is 1 MiB that stays mapped for the region's life.
///     let raw = unsafe { pd.register_raw(p, 1 << 20, AccessFlags::LOCAL_WRITE) }?;
///     let _kept = raw.attach(vec![0u8; 16]);
///     let mut mr = pd.register_host(vec![0u8; 16], AccessFlags::LOCAL_WRITE)?;
///     mr.copy_in(0, &[0xAB; 16])?;
///     Ok(())
/// }
/// ```
///
/// ```compile_fail
/// # use std::sync::Arc;
/// # use gpudirect::rdma::{AccessFlags, ProtectionDomain};
/// fn f(pd: &Arc<ProtectionDomain>, p: *mut std::ffi::c_void) -> gpudirect::Result<()> {
///     // SAFETY: (this example's contract) `p` is 1 MiB that stays mapped for the region's life.
///     let raw = unsafe { pd.register_raw(p, 1 << 20, AccessFlags::LOCAL_WRITE) }?;
///     let mut mr = raw.attach(vec![0u8; 16]);
///     mr.copy_in(0, &[0xAB; 1 << 20])?; // error: the attached Vec is not the registered memory
///     Ok(())
/// }
/// ```
///
/// The post-and-wait helpers borrow the region for the whole operation:
///
/// ```compile_fail
/// # use gpudirect::rdma::{MemoryRegion, QueuePair, RemoteMemory};
/// fn f(qp: &QueuePair, mut mr: MemoryRegion<Vec<u8>>, remote: RemoteMemory) {
///     let done = std::thread::scope(|s| {
///         let h = s.spawn(|| qp.read(&mut mr, 0..64, remote));
///         mr.copy_in(0, &[1]).unwrap(); // error: `mr` is mutably borrowed by the read
///         h.join()
///     });
/// }
/// ```
pub struct MemoryRegion<B = ()> {
    handle: MrHandle,
    owner: ManuallyDrop<B>,
    /// What the post-and-wait helpers run before the NIC reads the region (GPU memory: wait
    /// for the GPU's pending writes).
    before_nic_read: Option<fn(&B) -> Result<()>>,
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

impl<B> Drop for MemoryRegion<B> {
    fn drop(&mut self) {
        // SAFETY: the region is registered until here (`into_parts` skips this Drop), and it
        // is deregistered once.
        match unsafe { self.handle.deregister() } {
            // SAFETY: the owner is dropped once, here, after the NIC lost access to it.
            Ok(()) => unsafe { ManuallyDrop::drop(&mut self.owner) },
            Err(e) => {
                // The NIC may still reach the memory: leak it, and the PD the MR lives in.
                std::mem::forget(self.handle.pd.clone());
                tracing::error!(error = %e, addr = format_args!("{:#x}", self.addr()), len = self.len(),
                    "ibv_dereg_mr failed: the registration, its memory and its protection domain are leaked");
            }
        }
    }
}

impl MemoryRegion<()> {
    pub(in crate::rdma) fn from_handle(handle: MrHandle) -> Self {
        MemoryRegion {
            handle,
            owner: ManuallyDrop::new(()),
            before_nic_read: None,
        }
    }

    /// Makes the region keep `owner` alive (a GPU allocation, a dma-buf fd, a buffer) and
    /// release it only after deregistering.
    ///
    /// The owner comes back wrapped in [`Attached`]: gpudirect cannot tell whether its bytes are
    /// the registered ones, so the region has none of the byte accessors a
    /// [`register_host`](ProtectionDomain::register_host) region has (which would check bounds
    /// against the registration and write through the owner). Reach the memory through the
    /// pointer you registered, or register host memory with `register_host` instead.
    pub fn attach<T>(self, owner: T) -> MemoryRegion<Attached<T>> {
        self.attach_owner(Attached(owner))
    }

    /// Makes the region keep `owner` alive; for owners this room made sure are the registered
    /// memory itself (or hold no bytes the accessors reach).
    pub(in crate::rdma) fn attach_owner<T>(self, owner: T) -> MemoryRegion<T> {
        let (handle, ()) = self.into_parts();
        MemoryRegion {
            handle,
            owner: ManuallyDrop::new(owner),
            before_nic_read: None,
        }
    }
}

impl<B> MemoryRegion<B> {
    /// Makes the post-and-wait helpers call `f` on the owner before every work request that
    /// lets the NIC read the region.
    pub(in crate::rdma) fn with_before_nic_read(mut self, f: fn(&B) -> Result<()>) -> Self {
        self.before_nic_read = Some(f);
        self
    }

    /// Runs the owner's preparation for a NIC read (see `with_before_nic_read`).
    pub(in crate::rdma) fn prepare_nic_read(&self) -> Result<()> {
        match self.before_nic_read {
            Some(f) => f(&self.owner),
            None => Ok(()),
        }
    }

    pub(in crate::rdma) fn owner_ref(&self) -> &B {
        &self.owner
    }

    pub(in crate::rdma) fn owner_mut(&mut self) -> &mut B {
        &mut self.owner
    }

    /// Takes the region apart without deregistering.
    fn into_parts(self) -> (MrHandle, B) {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never used or dropped again, so each field is moved out exactly once.
        unsafe {
            (
                std::ptr::read(&me.handle),
                ManuallyDrop::take(&mut me.owner),
            )
        }
    }

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
    /// the region comes back intact with the error (dropping it then leaks the memory).
    pub fn close(self) -> std::result::Result<B, (Self, Error)> {
        // SAFETY: the MR is live; on success it is taken apart without running Drop, so it is
        // not deregistered again.
        match unsafe { self.handle.deregister() } {
            Ok(()) => {
                let (handle, owner) = self.into_parts();
                drop(handle); // the PD Arc
                Ok(owner)
            }
            Err(e) => Err((self, e)),
        }
    }

    /// What the region keeps alive.
    ///
    /// # Safety
    ///
    /// If `B` reaches the registered bytes (host memory), no reference to them obtained through
    /// it may be used while the NIC may write them (see [`as_slice`](Self::as_slice)).
    pub unsafe fn owner(&self) -> &B {
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

fn check_bytes(region: usize, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > region) {
        return Err(Error::InvalidArgument(format!(
            "range {offset}..{} is outside the {region}-byte memory region",
            offset.wrapping_add(len)
        )));
    }
    Ok(())
}

/// Copies `dst.len()` bytes from `src` with volatile reads: the NIC may write them meanwhile
/// (the copy is then torn, never undefined behaviour), and the compiler must not reuse an
/// earlier read.
///
/// # Safety
///
/// `src..src + dst.len()` is readable.
unsafe fn volatile_copy_out(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let mut i = 0;
    while i < n && !(src as usize + i).is_multiple_of(8) {
        // SAFETY: `i < n`: inside the caller's readable range.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: inside the range; 8-aligned after the loop above.
        let w = unsafe { src.add(i).cast::<u64>().read_volatile() };
        dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
        i += 8;
    }
    while i < n {
        // SAFETY: `i < n`: inside the range.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
}

/// Copies `src` to `dst` with volatile writes (see [`volatile_copy_out`]).
///
/// # Safety
///
/// `dst..dst + src.len()` is writable and no Rust reference to it is in use.
unsafe fn volatile_copy_in(dst: *mut u8, src: &[u8]) {
    let n = src.len();
    let mut i = 0;
    while i < n && !(dst as usize + i).is_multiple_of(8) {
        // SAFETY: `i < n`: inside the caller's writable range.
        unsafe { dst.add(i).write_volatile(src[i]) };
        i += 1;
    }
    while i + 8 <= n {
        let w = u64::from_ne_bytes(src[i..i + 8].try_into().expect("8 bytes"));
        // SAFETY: `i + 8 <= n`: inside the range; 8-aligned after the loop above.
        unsafe { dst.add(i).cast::<u64>().write_volatile(w) };
        i += 8;
    }
    while i < n {
        // SAFETY: `i < n`: inside the range.
        unsafe { dst.add(i).write_volatile(src[i]) };
        i += 1;
    }
}

/// The byte accessors of regions over host memory, for both owners ([`HostMemory`] and
/// [`Scoped`]); `$ptr` / `$ptr_mut` give the first byte from `&self` / `&mut self`.
macro_rules! host_accessors {
    ($($impl:tt)*) => {
        $($impl)* {
            /// Copies the region's bytes from `offset` into `dst` (volatile reads). Bytes the NIC
            /// writes during the copy may be torn: copy after the completion or message that says
            /// a write landed.
            ///
            /// Errors: [`Error::InvalidArgument`] when `offset..offset + dst.len()` is not inside
            /// the region.
            pub fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
                check_bytes(self.len(), offset, dst.len())?;
                // SAFETY: the range is inside the registered bytes (checked), which the owner
                // keeps allocated while `self` lives.
                unsafe { volatile_copy_out(self.host_ptr().add(offset), dst) };
                Ok(())
            }

            /// Copies `src` into the region at `offset` (volatile writes). The region is borrowed
            /// mutably, so no post-and-wait helper is sending it meanwhile; a peer holding the rkey
            /// can still write the same bytes.
            ///
            /// Errors: [`Error::InvalidArgument`] when `offset..offset + src.len()` is not inside
            /// the region.
            pub fn copy_in(&mut self, offset: usize, src: &[u8]) -> Result<()> {
                check_bytes(self.len(), offset, src.len())?;
                // SAFETY: the range is inside the registered bytes (checked); `&mut self`
                // excludes every other access from this process's safe code.
                unsafe { volatile_copy_in(self.host_ptr_mut().add(offset), src) };
                Ok(())
            }

            /// A copy of all the region's bytes ([`copy_out`](Self::copy_out)).
            pub fn to_vec(&self) -> Vec<u8> {
                let mut v = vec![0u8; self.len()];
                // SAFETY: `v` is exactly the region's length.
                unsafe { volatile_copy_out(self.host_ptr(), &mut v) };
                v
            }

            /// The registered bytes as a reference.
            ///
            /// # Safety
            ///
            /// While the reference lives the bytes must not change: no peer may write the region
            /// through its rkey (it was registered without `REMOTE_WRITE`/`REMOTE_ATOMIC`, or its
            /// rkey was given to no one, or every peer is known to be done, e.g. by a message), and
            /// no RDMA read or receive into it may be in flight (posted with the `unsafe` posting
            /// functions). Use [`copy_out`](Self::copy_out) otherwise.
            pub unsafe fn as_slice(&self) -> &[u8] {
                // SAFETY: the bytes are allocated while `self` lives; the caller guarantees that
                // nothing changes them while the reference lives.
                unsafe { std::slice::from_raw_parts(self.host_ptr(), self.len()) }
            }

            /// The registered bytes as a mutable reference.
            ///
            /// # Safety
            ///
            /// As [`as_slice`](Self::as_slice), and moreover nothing else may read them while the
            /// reference lives (no send or RDMA write from them posted with the `unsafe` posting
            /// functions, no peer reading them through the rkey), or it may read a torn update.
            pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
                // SAFETY: as above; `&mut self` excludes other references from safe code.
                unsafe { std::slice::from_raw_parts_mut(self.host_ptr_mut(), self.len()) }
            }
        }
    };
}

host_accessors!(impl<B: HostMemory> MemoryRegion<B>);
host_accessors!(impl MemoryRegion<Scoped<'_>>);

impl<B: HostMemory> MemoryRegion<B> {
    fn host_ptr(&self) -> *const u8 {
        // A shared reborrow of the owner, turned into a pointer at once: the bytes are read
        // only through volatile reads.
        (**self.owner).as_ptr()
    }

    fn host_ptr_mut(&mut self) -> *mut u8 {
        (**self.owner).as_mut_ptr()
    }
}

impl MemoryRegion<Scoped<'_>> {
    fn host_ptr(&self) -> *const u8 {
        self.owner.ptr.as_ptr()
    }

    fn host_ptr_mut(&mut self) -> *mut u8 {
        self.owner.ptr.as_ptr()
    }

    /// Turns a raw registration of `buf` into the scope's region.
    pub(in crate::rdma) fn scoped(
        raw: MemoryRegion<()>,
        buf: Scoped<'_>,
    ) -> MemoryRegion<Scoped<'_>> {
        raw.attach_owner(buf)
    }
}

/// What [`MemoryRegion::attach`] keeps alive: an owner attached to a raw registration,
/// released after the region is deregistered. Not [`HostMemory`], whatever `T` is: the region's
/// byte accessors would reach the owner's bytes with the registration's bounds.
#[derive(Debug)]
pub struct Attached<T>(T);

impl<T> Attached<T> {
    /// The owner.
    pub fn get(&self) -> &T {
        &self.0
    }

    /// The owner, once the region gave it back ([`MemoryRegion::close`]).
    pub fn into_inner(self) -> T {
        self.0
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
    pub(in crate::rdma) fn to_raw(self) -> sys::ibv_sge {
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

//! [`PeerAccess`]: RAII peer access between two devices' contexts **and** memory pools, with a
//! process-wide reference count so two holders never revoke each other's access.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use cudarc::driver::{sys, CudaContext};

use crate::cuda::result as r;
use crate::cuda::CurrentContext;
use crate::error::{Error, Result};
use crate::path::Cause;

/// A context pair (accessor context, owner context), by raw handle value.
type CtxKey = (usize, usize);
/// A pool and the device granted access to it.
type PoolKey = (usize, i32);

/// A context grant with live holders. The entry exists only while a [`PeerAccess`] holds the
/// grant (each holds both contexts' `Arc`, so neither context can be destroyed and its handle
/// value reused meanwhile): gpudirect vouches for the access only then.
#[derive(Debug, Default)]
struct CtxEntry {
    /// Live [`PeerAccess`] holders of this grant (at least 1).
    holders: usize,
    /// True when gpudirect enabled the access (and so disables it after the last holder).
    enabled_by_us: bool,
    accessor_ordinal: usize,
    owner_ordinal: usize,
    /// Holds taken so far (never decreases): a revocation that drained the accessor's work
    /// sees from it whether the grant was taken (and perhaps used and released) meanwhile.
    taken: u64,
}

#[derive(Debug)]
struct PoolEntry {
    holders: usize,
    /// The access flags before gpudirect first granted access, restored after the last holder.
    previous: sys::CUmemAccess_flags,
    /// As [`CtxEntry::taken`].
    taken: u64,
}

#[derive(Debug, Default)]
struct Registry {
    ctx: HashMap<CtxKey, CtxEntry>,
    pool: HashMap<PoolKey, PoolEntry>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    REG.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held (shared) by gpudirect's synchronous peer copies from before they look at the access
/// until the copy has run, and by grants; (exclusive) by the revocation of a grant, so a
/// revocation never lands under a copy, nor races a new grant of the same access. Revocations
/// drain the accessor's context before they take it (not while holding it), so no copy waits
/// for another device's work. Lock order: this before the registry.
static REVOKE: RwLock<()> = RwLock::new(());

/// Shared hold of [`REVOKE`]: no revocation happens while it is held.
pub(in crate::p2p) fn no_revocation() -> RwLockReadGuard<'static, ()> {
    REVOKE.read().unwrap_or_else(|p| p.into_inner())
}

fn revocation() -> RwLockWriteGuard<'static, ()> {
    REVOKE.write().unwrap_or_else(|p| p.into_inner())
}

/// What gpudirect knows about context peer access from `accessor` to `owner` (raw context
/// handles): `Some(true)` while a [`PeerAccess`] holds it (granted, or found already enabled),
/// `None` otherwise (CUDA has no query for it).
pub(in crate::p2p) fn context_access_known(
    accessor: sys::CUcontext,
    owner: sys::CUcontext,
) -> Option<bool> {
    let reg = registry();
    reg.ctx
        .get(&(accessor as usize, owner as usize))
        .map(|e| e.holders > 0)
}

/// One grant a [`PeerAccess`] holds.
#[derive(Debug)]
enum Grant {
    Context {
        accessor: Arc<CudaContext>,
        owner: Arc<CudaContext>,
    },
    Pool {
        /// Keeps the accessor's driver state alive while the grant exists.
        accessor: Arc<CudaContext>,
        pool: sys::CUmemoryPool,
    },
}

/// Peer access from one device to another's memory, held until dropped.
///
/// [`PeerAccess::enable`] does what a peer copy of cudarc buffers needs, in one place:
/// - `cuCtxEnablePeerAccess` from the accessor's context to the owner's (for `cuMemAlloc`
///   memory and kernels dereferencing peer pointers);
/// - `cuMemPoolSetAccess` on the owner's **default memory pool**, which cudarc allocates from
///   (`cuMemAllocAsync`). Without it, peer copies of cudarc buffers are staged through the host
///   (the rates: [BENCHMARKS.md, "P2P"](https://github.com/gpudirect-rs/gpudirect/blob/main/BENCHMARKS.md)).
///
/// Grants are reference-counted process-wide: two `PeerAccess` values for the same pair share
/// the grant, and the last one dropped restores the state found before the first. Access that
/// was already enabled by someone else (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`) or already
/// granted on the pool is left on, and so are pool access flags someone changed since gpudirect
/// granted them.
///
/// # Revocation
/// Dropping the last holder of a grant gpudirect made waits for all work queued in the
/// accessor's context (`cuCtxSynchronize`) and then for gpudirect's own synchronous copies in
/// progress ([`copy_peer`](super::copy_peer)) before it revokes, so copies and kernels enqueued
/// there before the drop finish with the access they were planned with. The first wait holds
/// no lock: gpudirect's copies between any devices go on meanwhile (a copy planned on the
/// grant during the wait is waited for by the second); if the grant was taken and released
/// during the wait, the wait is repeated. Work enqueued on the accessor's device after (or
/// while) the last holder drops must not rely on the access.
///
/// The driver cannot tell gpudirect's grant from the same grant made later by another library
/// (enabling an access that is already on changes nothing it reports). If other code in the
/// process (NCCL, PyTorch) relies on the same peer access, keep a `PeerAccess` for as long as
/// it does, or [`std::mem::forget`] one to leave the access on for the life of the process.
///
/// ```no_run
/// use gpudirect::p2p::PeerAccess;
/// let (a, b) = (gpudirect::cuda::context(0)?, gpudirect::cuda::context(1)?);
/// let _access = PeerAccess::both_ways(&a, &b)?;
/// // peer copies between a's and b's cudarc buffers now go direct
/// # Ok::<(), gpudirect::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "peer access is revoked when the PeerAccess is dropped"]
pub struct PeerAccess {
    /// Grants in the order taken; released in reverse.
    grants: Vec<Grant>,
}

// SAFETY: the raw pool handles are opaque driver handles; the CUDA driver API is thread-safe
// (CUDA Programming Guide, "Multiple host threads may use the driver API concurrently"), and all
// bookkeeping goes through the registry's mutex (revocations also through REVOKE), so a
// `PeerAccess` may be dropped on another thread than the one that made it (Drop binds the
// accessor's context on its own thread and puts the previous one back). `mem::forget` keeps
// its holds forever: the access stays granted, never revoked under anyone.
unsafe impl Send for PeerAccess {}
// SAFETY: as above; `PeerAccess` has no interior mutability outside the mutex-guarded registry.
unsafe impl Sync for PeerAccess {}

impl PeerAccess {
    /// Grants `accessor` access to `owner`'s memory (one way): `cuCtxEnablePeerAccess` from the
    /// accessor's context and `cuMemPoolSetAccess(owner's default pool, accessor, READWRITE)`.
    ///
    /// Errors: [`Error::Unsupported`] with [`Cause::SameDevice`] for self access,
    /// [`Cause::PeerUnsupported`] when `cuDeviceCanAccessPeer` says no (or the driver answers
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`), [`Cause::TooManyPeers`] on
    /// `CUDA_ERROR_TOO_MANY_PEERS`; [`Error::Cuda`] for other driver failures.
    pub fn enable(accessor: &Arc<CudaContext>, owner: &Arc<CudaContext>) -> Result<Self> {
        let mut pa = PeerAccess { grants: Vec::new() };
        pa.grant_context(accessor, owner)?;
        let pool = r::device::default_mem_pool(owner.cu_device())?;
        pa.grant_pool(accessor, owner.ordinal(), pool)?;
        Ok(pa)
    }

    /// Grants access both ways between `a` and `b` (context and default pools).
    pub fn both_ways(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<Self> {
        let mut pa = PeerAccess::enable(a, b)?;
        let other = PeerAccess::enable(b, a)?;
        pa.absorb(other);
        Ok(pa)
    }

    /// [`PeerAccess::both_ways`] between the primary contexts of two device ordinals.
    ///
    /// Errors: [`Error::NoDevice`] for an ordinal this process does not see, besides
    /// `both_ways`'s.
    pub fn between(a: usize, b: usize) -> Result<Self> {
        let ca = crate::cuda::context(a)?;
        let cb = crate::cuda::context(b)?;
        PeerAccess::both_ways(&ca, &cb)
    }

    /// Also grants every accessor of this `PeerAccess` whose owner is `owner` access to `pool`,
    /// a memory pool the caller created on device `owner` (`cuMemPoolSetAccess`).
    ///
    /// # Safety
    /// `pool` must be a live memory pool of device `owner` and must outlive the returned value.
    pub unsafe fn with_pool(mut self, pool: sys::CUmemoryPool, owner: usize) -> Result<Self> {
        let accessors: Vec<Arc<CudaContext>> = self
            .grants
            .iter()
            .filter_map(|g| match g {
                Grant::Context { accessor, owner: o } if o.ordinal() == owner => {
                    Some(accessor.clone())
                }
                _ => None,
            })
            .collect();
        if accessors.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "this PeerAccess grants no device access to GPU {owner}: create it with GPU {owner} as the owner"
            )));
        }
        for a in accessors {
            self.grant_pool(&a, owner, pool)?;
        }
        Ok(self)
    }

    /// The (accessor, owner) device ordinals this value grants context access for.
    pub fn pairs(&self) -> Vec<(usize, usize)> {
        self.grants
            .iter()
            .filter_map(|g| match g {
                Grant::Context { accessor, owner } => Some((accessor.ordinal(), owner.ordinal())),
                Grant::Pool { .. } => None,
            })
            .collect()
    }

    fn absorb(&mut self, mut other: PeerAccess) {
        self.grants.append(&mut other.grants);
    }

    fn grant_context(
        &mut self,
        accessor: &Arc<CudaContext>,
        owner: &Arc<CudaContext>,
    ) -> Result<()> {
        let (ao, oo) = (accessor.ordinal(), owner.ordinal());
        if accessor.cu_device() == owner.cu_device() {
            return Err(Error::Unsupported {
                what: format!("peer access from GPU {ao} to itself"),
                cause: Cause::SameDevice,
            });
        }
        if !r::device::can_access_peer(accessor.cu_device(), owner.cu_device())? {
            return Err(Error::Unsupported {
                what: format!("peer access from GPU {ao} to GPU {oo}"),
                cause: Cause::PeerUnsupported { src: ao, dst: oo },
            });
        }
        let key = (accessor.cu_ctx() as usize, owner.cu_ctx() as usize);
        let _no_revocation = no_revocation();
        let mut reg = registry();
        let holders = reg.ctx.get(&key).map_or(0, |e| e.holders);
        let mut enabled_now = false;
        if holders == 0 {
            let _current = CurrentContext::bind(accessor)?;
            // SAFETY: the accessor's context is current (bound above) and the owner's context is
            // alive (we hold its Arc).
            match unsafe { r::ctx::enable_peer_access(owner.cu_ctx()) } {
                Ok(r::ctx::Enabled::Now) => enabled_now = true,
                // Already on: enabled by someone else (never disable what we did not enable).
                Ok(r::ctx::Enabled::Already) => {}
                Err(code) => return Err(map_enable_error(code, ao, oo)),
            }
        }
        let entry = reg.ctx.entry(key).or_default();
        entry.accessor_ordinal = ao;
        entry.owner_ordinal = oo;
        if enabled_now {
            entry.enabled_by_us = true;
        }
        entry.holders += 1;
        entry.taken += 1;
        drop(reg);
        self.grants.push(Grant::Context {
            accessor: accessor.clone(),
            owner: owner.clone(),
        });
        Ok(())
    }

    fn grant_pool(
        &mut self,
        accessor: &Arc<CudaContext>,
        owner_ordinal: usize,
        pool: sys::CUmemoryPool,
    ) -> Result<()> {
        let dev = accessor.ordinal() as i32;
        let key = (pool as usize, dev);
        let _no_revocation = no_revocation();
        let mut reg = registry();
        if let Some(e) = reg.pool.get_mut(&key) {
            e.holders += 1;
            e.taken += 1;
        } else {
            // SAFETY: `pool` is the owner's default pool (alive as long as the device) or a pool
            // the caller guaranteed live (`with_pool`'s contract).
            let previous = unsafe { r::mem_pool::get_access(pool, dev) }?;
            if previous != sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
                // SAFETY: as above.
                unsafe {
                    r::mem_pool::set_access(
                        pool,
                        dev,
                        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    )
                }
                .map_err(|e| match e {
                    Error::Cuda { source, .. }
                        if source.0 == sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS =>
                    {
                        map_enable_error(source.0, dev as usize, owner_ordinal)
                    }
                    other => other,
                })?;
            }
            reg.pool.insert(
                key,
                PoolEntry {
                    holders: 1,
                    previous,
                    taken: 1,
                },
            );
        }
        drop(reg);
        self.grants.push(Grant::Pool {
            accessor: accessor.clone(),
            pool,
        });
        Ok(())
    }
}

fn map_enable_error(code: sys::CUresult, accessor: usize, owner: usize) -> Error {
    match code {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Error::Unsupported {
            what: format!("peer access from GPU {accessor} to GPU {owner}"),
            cause: Cause::PeerUnsupported {
                src: accessor,
                dst: owner,
            },
        },
        sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS => Error::Unsupported {
            what: format!("peer access from GPU {accessor} to GPU {owner}"),
            cause: Cause::TooManyPeers { accessor, owner },
        },
        other => Error::cuda("cuCtxEnablePeerAccess", cudarc::driver::DriverError(other)),
    }
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        while let Some(g) = self.grants.pop() {
            match g {
                Grant::Context { accessor, owner } => release_context(&accessor, &owner),
                Grant::Pool { accessor, pool } => release_pool(&accessor, pool),
            }
        }
    }
}

/// How many times a revocation drains the accessor's work again, outside [`REVOKE`], when the
/// grant was taken and released meanwhile (whose copies may be queued after the first drain),
/// before it drains under [`REVOKE`] instead (the bounded fallback).
const DRAINS_OUTSIDE_THE_LOCK: usize = 3;

/// What a revocation found under [`REVOKE`] and the registry after draining the accessor.
enum Recheck {
    /// Another holder holds the grant now (this hold was dropped): it revokes later.
    StillHeld,
    /// The entry is gone (nothing to revoke).
    Gone,
    /// The grant was taken and released since the drain began: drain again.
    TakenMeanwhile(u64),
    /// This is still the last hold and nobody took the grant since the drain: revoke now.
    Revoke,
}

/// Waits for all work queued in the accessor's context (`cuCtxSynchronize`), restoring the
/// calling thread's current context.
fn drain(accessor: &Arc<CudaContext>) -> std::result::Result<(), cudarc::driver::DriverError> {
    let _current = CurrentContext::save();
    accessor.synchronize()
}

/// Releases one hold of the context grant from `accessor` to `owner`; the last holder of a
/// grant gpudirect made revokes it (see [`PeerAccess`]'s "Revocation").
///
/// The accessor's queued work drains first, with no lock held, so copies between other devices
/// go on meanwhile; then, under [`REVOKE`] (which waits for every gpudirect copy in progress:
/// each holds it shared from its plan until it has synchronized), the grant is revoked if no
/// one took it since the drain began. Copies that started during the drain are either done
/// (they finished under the shared hold) or were planned on a grant taken meanwhile, which
/// the `taken` count shows: the drain is then repeated.
fn release_context(accessor: &Arc<CudaContext>, owner: &Arc<CudaContext>) {
    let key = (accessor.cu_ctx() as usize, owner.cu_ctx() as usize);
    let mut seen = {
        let mut reg = registry();
        let Some(e) = reg.ctx.get_mut(&key) else {
            tracing::warn!("gpudirect PeerAccess: no registry entry for a held context grant");
            return;
        };
        if e.holders > 1 {
            e.holders -= 1;
            return;
        }
        if !e.enabled_by_us {
            // Someone else's access: left on, and no longer vouched for.
            reg.ctx.remove(&key);
            return;
        }
        e.taken
    };
    let recheck = |seen: u64| {
        let mut reg = registry();
        let Some(e) = reg.ctx.get_mut(&key) else {
            return Recheck::Gone;
        };
        if e.holders > 1 {
            e.holders -= 1;
            return Recheck::StillHeld;
        }
        if e.taken != seen {
            return Recheck::TakenMeanwhile(e.taken);
        }
        reg.ctx.remove(&key);
        Recheck::Revoke
    };
    let mut attempt = 0;
    let _no_copies = loop {
        let last = attempt >= DRAINS_OUTSIDE_THE_LOCK;
        // The bounded fallback drains under REVOKE, as a revocation did before.
        let locked = last.then(revocation);
        if let Err(err) = drain(accessor) {
            tracing::warn!(%err, "gpudirect PeerAccess: the accessor's context did not synchronise; peer access stays on rather than be revoked under queued work");
            forget_hold_ctx(key);
            return;
        }
        let guard = locked.unwrap_or_else(revocation);
        match recheck(seen) {
            Recheck::StillHeld | Recheck::Gone => return,
            Recheck::TakenMeanwhile(now) if !last => {
                seen = now;
                attempt += 1;
            }
            Recheck::TakenMeanwhile(_) => {
                // Drained under REVOKE: no gpudirect copy or grant ran since. Revoke.
                registry().ctx.remove(&key);
                break guard;
            }
            Recheck::Revoke => break guard,
        }
    };
    let _current = match CurrentContext::bind(accessor) {
        Ok(c) => c,
        Err(err) => {
            tracing::warn!(%err, "gpudirect PeerAccess: cannot bind the context; peer access stays on");
            return;
        }
    };
    // SAFETY: the accessor's context is current and the owner's context alive (Arc held); the
    // accessor's queued work has finished (drained above, and no gpudirect copy or grant used
    // the access since: REVOKE is held exclusively and the grant was not taken meanwhile).
    if let Err(err) = unsafe { r::ctx::disable_peer_access(owner.cu_ctx()) } {
        tracing::warn!(%err, "gpudirect PeerAccess: revoking peer access failed");
    }
}

/// Drops this hold of a context grant without revoking it (the access stays on, no longer
/// vouched for once no holder is left).
fn forget_hold_ctx(key: CtxKey) {
    let mut reg = registry();
    if let Some(e) = reg.ctx.get_mut(&key) {
        if e.holders > 1 {
            e.holders -= 1;
        } else {
            reg.ctx.remove(&key);
        }
    }
}

/// Releases one hold of `accessor`'s access to `pool`; the last holder restores the flags found
/// before the first grant, unless they were already read/write or someone changed them since
/// (see [`PeerAccess`]'s "Revocation"). The accessor drains outside [`REVOKE`], as in
/// [`release_context`].
fn release_pool(accessor: &Arc<CudaContext>, pool: sys::CUmemoryPool) {
    let dev = accessor.ordinal() as i32;
    let key = (pool as usize, dev);
    let mut seen = {
        let mut reg = registry();
        let Some(e) = reg.pool.get_mut(&key) else {
            tracing::warn!("gpudirect PeerAccess: no registry entry for a held pool grant");
            return;
        };
        if e.holders > 1 {
            e.holders -= 1;
            return;
        }
        if e.previous == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
            reg.pool.remove(&key);
            return;
        }
        e.taken
    };
    // (Some(previous) to restore, or why not.)
    let recheck = |seen: u64| {
        let mut reg = registry();
        let Some(e) = reg.pool.get_mut(&key) else {
            return (Recheck::Gone, None);
        };
        if e.holders > 1 {
            e.holders -= 1;
            return (Recheck::StillHeld, None);
        }
        if e.taken != seen {
            return (Recheck::TakenMeanwhile(e.taken), Some(e.previous));
        }
        let previous = e.previous;
        reg.pool.remove(&key);
        (Recheck::Revoke, Some(previous))
    };
    let mut attempt = 0;
    let (_no_copies, previous) = loop {
        let last = attempt >= DRAINS_OUTSIDE_THE_LOCK;
        let locked = last.then(revocation);
        if let Err(err) = drain(accessor) {
            tracing::warn!(%err, "gpudirect PeerAccess: the accessor's context did not synchronise; pool access stays on rather than be revoked under queued work");
            forget_hold_pool(key);
            return;
        }
        let guard = locked.unwrap_or_else(revocation);
        match recheck(seen) {
            (Recheck::StillHeld | Recheck::Gone, _) | (_, None) => return,
            (Recheck::TakenMeanwhile(now), _) if !last => {
                seen = now;
                attempt += 1;
            }
            (Recheck::TakenMeanwhile(_), Some(previous)) => {
                registry().pool.remove(&key);
                break (guard, previous);
            }
            (Recheck::Revoke, Some(previous)) => break (guard, previous),
        }
    };
    // SAFETY: the pool is the owner's default pool or one the caller keeps alive for the
    // PeerAccess's lifetime (`with_pool`'s contract).
    match unsafe { r::mem_pool::get_access(pool, dev) } {
        Ok(sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE) => {}
        Ok(other) => {
            tracing::debug!(
                ?other,
                "gpudirect PeerAccess: pool access was changed since gpudirect granted it; left as it is"
            );
            return;
        }
        Err(err) => {
            tracing::warn!(%err, "gpudirect PeerAccess: cannot read pool access; left as it is");
            return;
        }
    }
    // SAFETY: as above; the accessor's queued work has finished (drained above, and no
    // gpudirect copy or grant used the access since: REVOKE is held exclusively and the grant
    // was not taken meanwhile).
    if let Err(err) = unsafe { r::mem_pool::set_access(pool, dev, previous) } {
        tracing::warn!(%err, "gpudirect PeerAccess: restoring pool access failed");
    }
}

/// Drops this hold of a pool grant without restoring the flags.
fn forget_hold_pool(key: PoolKey) {
    let mut reg = registry();
    if let Some(e) = reg.pool.get_mut(&key) {
        if e.holders > 1 {
            e.holders -= 1;
        } else {
            reg.pool.remove(&key);
        }
    }
}

/// Snapshot of the registry for one pair, for tests and diagnostics: `(holders, enabled_by_us)`
/// of the context grant from `accessor` to `owner`, `None` without an entry.
pub fn registry_state(accessor: &CudaContext, owner: &CudaContext) -> Option<(usize, bool)> {
    let reg = registry();
    reg.ctx
        .get(&(accessor.cu_ctx() as usize, owner.cu_ctx() as usize))
        .map(|e| (e.holders, e.enabled_by_us))
}

//! Which context an entry of gpudirect's per-context caches serves (the fence pages of
//! [`super::fences`], the event pools of [`super::events`], the transfer threads' side
//! streams), held so that the cache never keeps a context alive that its caller let go of, and
//! the [`Registry`] that drops the entries of dead contexts.
//!
//! Why: cudarc's `CudaContext::new_non_primary` (and `from_raw_context`) makes an object that
//! destroys its context (`cuCtxDestroy`, which frees the context's device memory) when its last
//! `Arc` drops. The caches held that object (their events and streams were made through it),
//! so a program that made a context per job and did a non-blocking transfer in it kept every
//! context, and its device memory, for the process.
//!
//! How:
//! - The device's primary context: gpudirect's own object retains it for the process
//!   ([`super::own_object`]); its entries ([`ContextRef::primary`]) never die. (A reset of the
//!   primary context, `cuDevicePrimaryCtxReset` or another library's `cudaDeviceReset`, is not
//!   seen.)
//! - Any other context ([`ContextRef::other`]): the entry holds the caller's object weakly, as
//!   the context's identity (the context lives exactly as long as that object), and the cache
//!   makes its events and streams through an object of gpudirect's over the same handle that
//!   never destroys the context ([`super::own_unpinned`]). Nothing a cache holds then keeps the
//!   context alive.
//! - A cache makes a CUDA call through what an entry holds only while its context is known to
//!   be alive: during a call that borrows the caller's object (or a stream, or a buffer of its),
//!   or under a pin ([`ContextRef::pin`]: the caller's object, upgraded from the weak
//!   reference), as a non-blocking transfer's gate holds one until the transfer's last top-up.
//! - An entry whose context is dead (its caller's object is gone: the context was destroyed, or
//!   is being) is dropped without a CUDA call ([`OfContext::context_died`]): the events, streams
//!   and host registrations the entry held went with the context (a context's destruction ends
//!   its work and frees what it owns), and a call on their handles could reach another context
//!   or object that was given the same handle since (handles are addresses, and the driver
//!   reuses them). So cudarc's wrappers of a dead context's events and streams are leaked, not
//!   dropped (their drop would destroy the dead handles), and a fence page stays allocated (no
//!   page is ever freed, see [`super::fences`]): a few KiB per context that died.

use std::sync::{Arc, Weak};

use cudarc::driver::{sys, CudaContext};

use crate::error::Error;

/// What identifies a context to a [`ContextRef`]: its handle (for the primary context, which
/// every object of it shares).
pub(crate) trait Identity: Send + Sync + 'static {
    /// The context's handle, as an address.
    fn handle(&self) -> usize;
}

impl Identity for CudaContext {
    fn handle(&self) -> usize {
        self.cu_ctx() as usize
    }
}

/// Which context a cache entry serves, without keeping it alive (see the module's docs).
pub(crate) struct ContextRef<T: Identity = CudaContext> {
    handle: usize,
    /// `None`: the device's primary context (gpudirect's own object retains it).
    other: Option<Other<T>>,
}

/// A context that is not its device's primary one.
struct Other<T> {
    /// The caller's object: the context lives exactly as long as it does. Held weakly, it also
    /// keeps the object's allocation, so no other object can have its address while this lives.
    caller: Weak<T>,
    /// The object the cache makes things through (gpudirect's, which never destroys the
    /// context; the caller's own only where that could not be made, and then the context is
    /// kept as before).
    ours: Arc<T>,
}

impl<T: Identity> Clone for ContextRef<T> {
    fn clone(&self) -> Self {
        ContextRef {
            handle: self.handle,
            other: self.other.as_ref().map(|o| Other {
                caller: o.caller.clone(),
                ours: o.ours.clone(),
            }),
        }
    }
}

/// Keeps a context alive while it lives (a strong reference of the caller's object; nothing for
/// the primary context, which gpudirect's own object retains). The last one dropped may be the
/// last reference to the caller's object, and its drop then destroys the context.
pub(crate) struct Alive<T: Identity = CudaContext>(#[allow(dead_code)] Option<Arc<T>>);

impl<T: Identity> Clone for Alive<T> {
    fn clone(&self) -> Self {
        Alive(self.0.clone())
    }
}

impl<T: Identity> ContextRef<T> {
    /// The device's primary context, of handle `handle`.
    pub(crate) fn primary(handle: usize) -> Self {
        ContextRef {
            handle,
            other: None,
        }
    }

    /// Another context: `caller`'s, held weakly; `ours` is the object the cache makes things
    /// through.
    pub(crate) fn other(caller: &Arc<T>, ours: Arc<T>) -> Self {
        ContextRef {
            handle: caller.handle(),
            other: Some(Other {
                caller: Arc::downgrade(caller),
                ours,
            }),
        }
    }

    /// Whether `ctx` is an object of this context: for the primary context any object of its
    /// handle; for another, the caller's object or ours, by address (a later context given the
    /// same handle has other objects).
    pub(crate) fn is(&self, ctx: &Arc<T>) -> bool {
        match &self.other {
            None => ctx.handle() == self.handle,
            Some(o) => {
                std::ptr::eq(o.caller.as_ptr(), Arc::as_ptr(ctx)) || Arc::ptr_eq(&o.ours, ctx)
            }
        }
    }

    /// False once the context is dead (for good: its caller's object is gone).
    pub(crate) fn alive(&self) -> bool {
        self.other
            .as_ref()
            .is_none_or(|o| o.caller.strong_count() > 0)
    }

    /// Keeps the context alive while the returned value lives; `None` once it is dead.
    pub(crate) fn pin(&self) -> Option<Alive<T>> {
        match &self.other {
            None => Some(Alive(None)),
            Some(o) => o.caller.upgrade().map(|c| Alive(Some(c))),
        }
    }

    /// The object a cache makes things through, for another context (`None` for the primary
    /// context: gpudirect's own object).
    pub(crate) fn ours(&self) -> Option<&Arc<T>> {
        self.other.as_ref().map(|o| &o.ours)
    }
}

/// What becomes of a cache's value when its context is dead: called instead of its drop, with
/// no CUDA call (see the module's docs).
pub(crate) trait OfContext {
    /// The value's context died (its handles are dead, or another context's by now).
    fn context_died(self);
}

impl OfContext for () {
    fn context_died(self) {}
}

/// A cache's values, one per context, each with the [`ContextRef`] of its context. Every lookup
/// drops the entries of dead contexts first ([`prune`](Self::prune)); dropping the registry (a
/// thread's, at its exit) drops the values of live contexts under a pin and hands the others to
/// [`OfContext::context_died`].
pub(crate) struct Registry<V: OfContext, T: Identity = CudaContext> {
    entries: Vec<(ContextRef<T>, V)>,
}

impl<V: OfContext, T: Identity> Registry<V, T> {
    /// An empty registry.
    pub(crate) const fn new() -> Self {
        Registry {
            entries: Vec::new(),
        }
    }

    /// Drops the entries of dead contexts ([`OfContext::context_died`] for their values).
    pub(crate) fn prune(&mut self) {
        if self.entries.iter().all(|(r, _)| r.alive()) {
            return;
        }
        let (live, dead): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|(r, _)| r.alive());
        self.entries = live;
        for (_, v) in dead {
            v.context_died();
        }
    }

    /// The entry of `ctx`'s context, the dead ones dropped first.
    pub(crate) fn find(&mut self, ctx: &Arc<T>) -> Option<(&ContextRef<T>, &V)> {
        self.prune();
        self.entries
            .iter()
            .find(|(r, _)| r.is(ctx))
            .map(|(r, v)| (r, v))
    }

    /// Adds `v` for the context `r` refers to (which has no entry yet).
    pub(crate) fn insert(&mut self, r: ContextRef<T>, v: V) -> (&ContextRef<T>, &V) {
        self.entries.push((r, v));
        let (r, v) = self.entries.last().expect("just pushed");
        (r, v)
    }

    /// Every entry, live or not (see [`ContextRef::pin`]).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&ContextRef<T>, &V)> {
        self.entries.iter().map(|(r, v)| (r, v))
    }

    /// Entries now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

impl<V: OfContext, T: Identity> Drop for Registry<V, T> {
    fn drop(&mut self) {
        for (r, v) in std::mem::take(&mut self.entries) {
            match r.pin() {
                Some(alive) => {
                    drop(v);
                    drop(alive);
                }
                None => v.context_died(),
            }
        }
    }
}

/// The error of a cache asked for a context that is dead already (through gpudirect's object
/// for it, after the caller's was dropped): what the driver would answer.
pub(crate) fn destroyed() -> Error {
    Error::cuda(
        "a per-context cache of gpudirect's (the context's CudaContext object was dropped)",
        cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED),
    )
}

/// A non-primary context of device `ordinal` for the GPU tests (`cuCtxCreate_v2`, looked up in
/// libcuda: cudarc binds it only for some CUDA versions, and every driver keeps the symbol),
/// owned by the returned cudarc object, whose drop destroys it. The thread's current context
/// is put back.
#[cfg(test)]
pub(crate) fn non_primary_context(ordinal: usize) -> Arc<CudaContext> {
    type Create = unsafe extern "C" fn(*mut sys::CUcontext, u32, sys::CUdevice) -> sys::CUresult;
    super::check_ordinal(ordinal).unwrap_or_else(|e| {
        panic!("this test needs a CUDA GPU ({e}): run it on a GPU machine, see CONTRIBUTING.md")
    });
    let _restore = super::CurrentContext::save();
    let dev = super::result::device::get(ordinal).expect("cuDeviceGet");
    // SAFETY: libcuda is loaded already (the ordinal was checked through it); loading it again
    // runs no initialiser of ours.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.expect("libcuda.so.1");
    // SAFETY: cuCtxCreate_v2's C signature (cuda.h).
    let create: libloading::Symbol<Create> =
        unsafe { lib.get(b"cuCtxCreate_v2\0") }.expect("cuCtxCreate_v2 in libcuda");
    let mut raw: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, flags 0, a device handle from the driver.
    let rc = unsafe { create(&mut raw, 0, dev) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuCtxCreate_v2");
    // SAFETY: `raw` was just created for `dev` and is handed over to the object, which destroys
    // it on its drop; nothing else destroys it.
    unsafe { CudaContext::from_raw_context(ordinal, dev, raw) }.expect("wrapping the new context")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A fake context object: its handle only.
    struct Fake(usize);

    impl Identity for Fake {
        fn handle(&self) -> usize {
            self.0
        }
    }

    /// A cache value that logs whether it was dropped or handed to `context_died`, and whether
    /// its context was alive when it was dropped.
    struct Val {
        id: usize,
        ctx: Weak<Fake>,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Drop for Val {
        fn drop(&mut self) {
            let alive = self.ctx.strong_count() > 0;
            self.log
                .lock()
                .unwrap()
                .push(format!("dropped {} alive={alive}", self.id));
        }
    }

    impl OfContext for Val {
        fn context_died(self) {
            self.log.lock().unwrap().push(format!("died {}", self.id));
            std::mem::forget(self);
        }
    }

    fn val(id: usize, ctx: &Arc<Fake>, log: &Arc<Mutex<Vec<String>>>) -> Val {
        Val {
            id,
            ctx: Arc::downgrade(ctx),
            log: log.clone(),
        }
    }

    /// A non-primary context's entry is found for the caller's object and for gpudirect's over
    /// its handle, never for another object of the same handle (a later context that was given
    /// the handle, or another object); the primary context's for any object of its handle.
    #[test]
    fn an_entry_is_its_contexts_objects_and_no_others() {
        let caller = Arc::new(Fake(0x1000));
        let ours = Arc::new(Fake(0x1000));
        let r = ContextRef::other(&caller, ours.clone());
        assert!(r.is(&caller) && r.is(&ours));
        assert!(
            !r.is(&Arc::new(Fake(0x1000))),
            "another object of the same handle"
        );
        assert!(!r.is(&Arc::new(Fake(0x2000))));
        let p = ContextRef::<Fake>::primary(0x2000);
        assert!(p.is(&Arc::new(Fake(0x2000))) && p.is(&Arc::new(Fake(0x2000))));
        assert!(!p.is(&caller));
    }

    /// A pin keeps the context alive after the caller dropped its object, and none is given
    /// once the context is dead; the primary context's are always given.
    #[test]
    fn a_pin_keeps_its_context_alive_and_a_dead_context_gives_none() {
        let caller = Arc::new(Fake(0x1000));
        let r = ContextRef::other(&caller, Arc::new(Fake(0x1000)));
        let pin = r.pin().expect("a live context");
        drop(caller);
        assert!(r.alive(), "the pin did not keep the context");
        assert!(r.pin().is_some());
        drop(pin);
        assert!(!r.alive() && r.pin().is_none(), "a dead context was pinned");
        let p = ContextRef::<Fake>::primary(0x2000);
        assert!(p.alive() && p.pin().is_some());
    }

    /// Review (non-primary contexts kept): a lookup drops the entries of dead contexts, their
    /// values handed to `context_died` (never dropped: their handles are dead), and keeps the
    /// live ones and the primary context's; a later context with the same handle gets an entry
    /// of its own. Dropping the registry drops the values of live contexts while their context
    /// is alive, and hands the others to `context_died`.
    #[test]
    fn dead_contexts_entries_are_dropped_without_their_values_drop() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (a, b) = (Arc::new(Fake(0x1000)), Arc::new(Fake(0x3000)));
        let p = Arc::new(Fake(0x2000));
        let mut reg: Registry<Val, Fake> = Registry::new();
        reg.insert(
            ContextRef::other(&a, Arc::new(Fake(0x1000))),
            val(1, &a, &log),
        );
        reg.insert(ContextRef::primary(0x2000), val(2, &p, &log));
        reg.insert(
            ContextRef::other(&b, Arc::new(Fake(0x3000))),
            val(3, &b, &log),
        );
        assert_eq!(reg.find(&a).map(|(_, v)| v.id), Some(1));
        assert!(log.lock().unwrap().is_empty(), "a live entry was dropped");
        drop(a);
        let later = Arc::new(Fake(0x1000));
        assert!(
            reg.find(&later).is_none(),
            "a later context of the same handle found the dead one's entry"
        );
        assert_eq!(*log.lock().unwrap(), ["died 1"]);
        assert_eq!(reg.len(), 2);
        assert_eq!(reg.find(&p).map(|(_, v)| v.id), Some(2));
        reg.insert(
            ContextRef::other(&later, Arc::new(Fake(0x1000))),
            val(4, &later, &log),
        );
        assert_eq!(reg.find(&later).map(|(_, v)| v.id), Some(4));
        drop(b);
        drop(reg);
        let mut got = log.lock().unwrap().clone();
        got.sort();
        assert_eq!(
            got,
            [
                "died 1",
                "died 3",
                "dropped 2 alive=true",
                "dropped 4 alive=true"
            ]
        );
    }
}

//! Events made ahead of the transfers that use them and used again: one pool per context.
//!
//! Why: `cuEventCreate` waits while another thread of the process is in
//! `cuMemHostUnregister`, and that call waits for all the context's work (H200, driver 580:
//! the unregister 291 ms behind a stream held 300 ms, another thread's `cuEventCreate`
//! meanwhile 241 ms; CONTRIBUTING.md, "What we measured", page-locking). A transfer that made
//! its events when it was called (a non-blocking call's gate, a blocking engine transfer's
//! ordering event, a batch's) then waited for the other thread's unregister, and so for kernels
//! it has nothing to do with. `cuEventRecord` waits there too (`scripts/probes/stall-calls.py`:
//! 1.43 s inside a 1.48 s unregister; `cuStreamWaitEvent` and `cuEventQuery` do not), so the
//! pool does not remove the stall for a call that records: a non-blocking call's gate is a
//! host-visible fence instead ([`super::fences`]), and the pooled events serve blocking
//! transfers, batches and the fences' fallback, whose callers wait for their copies anyway.
//!
//! An event taken from the pool ([`record`], [`record_each`], [`take`]) is the taker's alone
//! until the [`Lent`] is dropped, which gives it back. CUDA documents reuse: "`cuEventRecord()`
//! can be called multiple times on the same event and will overwrite the previously captured
//! state. Other APIs such as `cuStreamWaitEvent()` use the most recently captured state at the
//! time of the API call, and are not affected by later calls to `cuEventRecord()`" (CUDA Driver
//! API, Event Management, `cuEventRecord`). So an event may be recorded again, by its next
//! taker, once every `cuStreamWaitEvent` on it was made (they keep the state they saw) and every
//! host wait on it (`cuEventQuery`, `cuEventSynchronize`, which look at the latest record)
//! returned. A holder gives its events back only then: each user in gpudirect keeps its `Lent`
//! until its job (whose waits borrow the events) is over, and a record still pending when it is
//! given back (a cancelled transfer's) is simply overwritten by the next one.
//!
//! Bounds: a pool keeps at most [`KEEP`] idle events (more given back at once are destroyed);
//! [`top_up`] makes up to [`SPARE`] idle ones off the transfers' paths (after a non-blocking
//! transfer completed, in `GpuFile::warm_up`); the events lent out are the transfers in flight.
//! One pool per context used (a process has one per GPU in practice); [`release_idle`]
//! (`storage::release_engines`) destroys the idle events of all of them. Events are made
//! through gpudirect's own context object ([`super::own_unpinned`]), never a caller's, so that an
//! error an earlier call left in a caller's cudarc object never fails another caller's
//! transfer, and so that a pool does not keep a context alive that is not its device's primary
//! one (see [`super::contexts`]): events lent out keep it alive until they are given back
//! ([`Events`]), a top-up is made while it lives, and the pool of a context that died is
//! dropped without destroying its idle events ([`Pool::abandon`]: they went with the context).
//!
//! Events still made inside a storage transfer (not pooled): the segment ring's one per slot
//! and the workers' lanes' two per worker and context, made with the ring or lane they belong
//! to (a context's first ring read, a larger ring; a worker's first GPU write or lane read) and
//! kept with it (`GpuFile::warm_up` builds the ring ahead); the timing events of a job traced
//! with `GPUDIRECT_TRACE=timing`; the mark after a failed synchronize (`settle::Mark`); a batch
//! whose streams span several contexts ([`record_each`]); and cudarc's two per `CudaSlice`
//! that a transfer allocates for its caller (`read_to_gpu`, a batch's new destination, a
//! checkpoint's tensors), which the slice owns.

use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::contexts::{Alive, ContextRef, OfContext, Registry};

use crate::error::{Error, Result};

/// Idle events a pool keeps at most; an event given back beyond that is destroyed.
pub(crate) const KEEP: usize = 64;

/// Idle events [`top_up`] keeps ready.
pub(crate) const SPARE: usize = 8;

/// How a pool makes what it lends (events; counters in the host tests).
pub(crate) trait Make: Send + Sync + 'static {
    /// What the pool lends.
    type Item: Send + 'static;
    /// Makes one.
    fn make(&self) -> Result<Self::Item>;
}

struct Shelf<T> {
    idle: Vec<T>,
    /// Items lent out now.
    lent: usize,
}

/// Items made by `M`, lent out one holder at a time ([`take`](Self::take)) and kept when given
/// back, at most `keep` idle.
pub(crate) struct Pool<M: Make> {
    make: M,
    keep: usize,
    spare: usize,
    shelf: Mutex<Shelf<M::Item>>,
}

/// Items lent by a [`Pool`]: the holder's alone; dropping this gives them back (or drops them,
/// once [`retire`](Self::retire)d).
pub(crate) struct Lent<M: Make> {
    items: Vec<M::Item>,
    pool: Arc<Pool<M>>,
    /// Dropped, not given back ([`retire`](Self::retire)).
    retired: std::sync::atomic::AtomicBool,
}

impl<M: Make> Pool<M> {
    /// An empty pool keeping at most `keep` idle items, topped up to `spare` (at most `keep`).
    pub(crate) fn new(make: M, keep: usize, spare: usize) -> Arc<Self> {
        Arc::new(Pool {
            make,
            keep,
            spare: spare.min(keep),
            shelf: Mutex::new(Shelf {
                idle: Vec::new(),
                lent: 0,
            }),
        })
    }

    fn shelf(&self) -> MutexGuard<'_, Shelf<M::Item>> {
        self.shelf.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `n` items: idle ones first, the rest made now (outside the pool's lock). On an error
    /// the idle ones taken go back.
    pub(crate) fn take(self: &Arc<Self>, n: usize) -> Result<Lent<M>> {
        let mut items = {
            let mut s = self.shelf();
            let at = s.idle.len().saturating_sub(n);
            let items = s.idle.split_off(at);
            s.lent += items.len();
            items
        };
        let mut lent = Lent {
            items: Vec::new(),
            pool: self.clone(),
            retired: std::sync::atomic::AtomicBool::new(false),
        };
        while items.len() < n {
            match self.make.make() {
                Ok(it) => {
                    self.shelf().lent += 1;
                    items.push(it);
                }
                Err(e) => {
                    lent.items = items;
                    return Err(e);
                }
            }
        }
        lent.items = items;
        Ok(lent)
    }

    /// Makes idle items (outside the lock) until `spare` are idle, for takers to come; returns
    /// how many it made. Call it where nothing waits for it.
    pub(crate) fn top_up(&self) -> Result<usize> {
        let want = self.spare.saturating_sub(self.shelf().idle.len());
        let mut made = Vec::with_capacity(want);
        for _ in 0..want {
            made.push(self.make.make()?);
        }
        let n = made.len();
        let surplus = {
            let mut s = self.shelf();
            let room = self.keep.saturating_sub(s.idle.len()).min(made.len());
            s.idle.extend(made.drain(..room));
            made
        };
        drop(surplus);
        Ok(n)
    }

    /// Drops every idle item (outside the lock); returns how many. Items lent out come back
    /// as usual.
    pub(crate) fn drain(&self) -> usize {
        let idle = std::mem::take(&mut self.shelf().idle);
        idle.len()
    }

    /// Leaks every idle item, never dropping it; returns how many. For the pool of a context
    /// that died: its events went with it, and their drop would destroy dead handles (which a
    /// later context's events may have been given).
    pub(crate) fn abandon(&self) -> usize {
        let idle = std::mem::take(&mut self.shelf().idle);
        let n = idle.len();
        std::mem::forget(idle);
        n
    }

    /// Idle items now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.shelf().idle.len()
    }

    /// Items lent out now.
    #[cfg(test)]
    pub(crate) fn lent(&self) -> usize {
        self.shelf().lent
    }

    /// Takes back lent items that are not to be lent again: dropped (outside the lock).
    fn drop_lent(&self, items: Vec<M::Item>) {
        self.shelf().lent -= items.len();
        drop(items);
    }

    fn give_back(&self, mut items: Vec<M::Item>) {
        let surplus = {
            let mut s = self.shelf();
            s.lent -= items.len();
            let room = self.keep.saturating_sub(s.idle.len()).min(items.len());
            s.idle.extend(items.drain(..room));
            items
        };
        drop(surplus);
    }
}

impl<M: Make> Lent<M> {
    /// The pool these came from.
    pub(crate) fn pool(&self) -> &Arc<Pool<M>> {
        &self.pool
    }

    /// Never lend these again: dropped when this is, not given back (events a capture took,
    /// whose last record is in a CUDA graph, say).
    pub(crate) fn retire(&self) {
        self.retired
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<M: Make> Deref for Lent<M> {
    type Target = [M::Item];

    fn deref(&self) -> &[M::Item] {
        &self.items
    }
}

impl<M: Make> Drop for Lent<M> {
    fn drop(&mut self) {
        let items = std::mem::take(&mut self.items);
        if self.retired.load(std::sync::atomic::Ordering::Relaxed) {
            self.pool.drop_lent(items);
        } else {
            self.pool.give_back(items);
        }
    }
}

/// Makes events (`CU_EVENT_DISABLE_TIMING`) of one context through gpudirect's own object for
/// it.
pub(crate) struct MakeEvent(Arc<CudaContext>);

impl Make for MakeEvent {
    type Item = CudaEvent;

    fn make(&self) -> Result<CudaEvent> {
        // cudarc binds the event's context: put back what was current.
        let _restore = super::CurrentContext::save();
        self.0
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::cuda("cuEventCreate", e))
    }
}

/// Events of one context, lent by its pool; they keep the context alive until they are given
/// back (a context that is not its device's primary one is not kept by its pool: see
/// [`super::contexts`]), so that an event given back beyond the pool's bound is destroyed in a
/// live context.
pub(crate) struct Events {
    lent: Lent<MakeEvent>,
    /// Dropped after `lent` (field order).
    alive: Alive,
}

impl Events {
    /// The pool these came from.
    pub(crate) fn pool(&self) -> &Arc<EventPool> {
        self.lent.pool()
    }

    /// What keeps their context alive (for a top-up of their pool after they are given back).
    pub(crate) fn alive(&self) -> &Alive {
        &self.alive
    }

    /// Never lend these again ([`Lent::retire`]): they are destroyed when these are dropped,
    /// their context alive then.
    pub(crate) fn retire(&self) {
        self.lent.retire();
    }
}

impl Deref for Events {
    type Target = [CudaEvent];

    fn deref(&self) -> &[CudaEvent] {
        &self.lent
    }
}

/// The pool of one context.
pub(crate) type EventPool = Pool<MakeEvent>;

/// A context died: its pool's idle events went with it.
impl OfContext for Arc<EventPool> {
    fn context_died(self) {
        self.abandon();
    }
}

fn pools() -> MutexGuard<'static, Registry<Arc<EventPool>>> {
    static POOLS: Mutex<Registry<Arc<EventPool>>> = Mutex::new(Registry::new());
    POOLS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pool of `ctx`'s context, made empty on first use, and what keeps the context alive
/// meanwhile (an error when it is dead already: `ctx` is gpudirect's object of a context whose
/// caller let go of it).
fn pool(ctx: &Arc<CudaContext>) -> Result<(Arc<EventPool>, Alive)> {
    let pinned = |(r, p): (&ContextRef, &Arc<EventPool>)| {
        r.pin()
            .map(|a| (p.clone(), a))
            .ok_or_else(super::contexts::destroyed)
    };
    if let Some(found) = pools().find(ctx) {
        return pinned(found);
    }
    // Outside the registry's lock: the first use of a context may make gpudirect's own object
    // for it (cudarc's `CudaContext::new`).
    let own = super::own_unpinned(ctx);
    let mut v = pools();
    if let Some(found) = v.find(ctx) {
        return pinned(found);
    }
    let found = v.insert(own.of, Pool::new(MakeEvent(own.obj), KEEP, SPARE));
    pinned(found)
}

/// `n` events of `ctx`'s context, not recorded by their taker yet (an idle event may hold an
/// earlier taker's record: record before any wait).
pub(crate) fn take(ctx: &Arc<CudaContext>, n: usize) -> Result<Events> {
    let (pool, alive) = pool(ctx)?;
    Ok(Events {
        lent: pool.take(n)?,
        alive,
    })
}

/// An event of `stream`'s context recorded on `stream` now (`cuEventRecord` through the result
/// layer, after making the stream's context current: an error an earlier call left in a cudarc
/// object does not fail it).
pub(crate) fn record(stream: &CudaStream) -> Result<Events> {
    let e = take(stream.context(), 1)?;
    record_on(&e[0], stream)?;
    Ok(e)
}

/// Events recorded now, one on each of some streams ([`record_each`]): pooled when the streams
/// share a context, made for the call otherwise.
pub(crate) enum Recorded {
    /// From the streams' context's pool.
    Pooled(Events),
    /// Made now (streams of several contexts, or none).
    Made(Vec<CudaEvent>),
}

impl Recorded {
    /// No event (no stream to order after).
    pub(crate) fn none() -> Recorded {
        Recorded::Made(Vec::new())
    }
}

impl Deref for Recorded {
    type Target = [CudaEvent];

    fn deref(&self) -> &[CudaEvent] {
        match self {
            Recorded::Pooled(e) => e,
            Recorded::Made(v) => v,
        }
    }
}

/// An event recorded now on each distinct stream of `streams` (by context and handle: every
/// context's default stream is the null handle), in the order they first appear. From the
/// pool of their context when they share one (the batches': one context per batch); made now,
/// as cudarc's `record_event` does, when they span several.
pub(crate) fn record_each<S: AsRef<CudaStream>>(
    streams: impl IntoIterator<Item = S>,
) -> Result<Recorded> {
    let mut distinct: Vec<S> = Vec::new();
    for s in streams {
        let key = |s: &CudaStream| (s.context().cu_ctx(), s.cu_stream());
        if !distinct.iter().any(|d| key(d.as_ref()) == key(s.as_ref())) {
            distinct.push(s);
        }
    }
    let Some(first) = distinct.first() else {
        return Ok(Recorded::none());
    };
    let ctx = first.as_ref().context();
    if distinct
        .iter()
        .all(|s| s.as_ref().context().cu_ctx() == ctx.cu_ctx())
    {
        let events = take(ctx, distinct.len())?;
        for (e, s) in events.iter().zip(&distinct) {
            record_on(e, s.as_ref())?;
        }
        return Ok(Recorded::Pooled(events));
    }
    distinct
        .iter()
        .map(|s| {
            s.as_ref()
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| Error::cuda("cuEventRecord", e))
        })
        .collect::<Result<Vec<_>>>()
        .map(Recorded::Made)
}

/// `cuEventRecord` of `event` on `stream` (of the same context), through the result layer.
pub(crate) fn record_on(event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    // SAFETY: the stream holds its context alive.
    let r = unsafe { super::settle::make_current(stream.context().cu_ctx()) };
    super::result::check("cuCtxSetCurrent", r)?;
    // SAFETY: the event and the stream are alive (borrowed), of the context now current (the
    // callers take the event from the stream's context's pool).
    let r = unsafe { super::result::event::record(event.cu_event(), stream.cu_stream()) };
    super::result::check("cuEventRecord", r)
}

/// `cuEventSynchronize` of `event` after making its context current, both through the result
/// layer (an error an earlier call left in the cudarc object the event was made through does
/// not fail it).
pub(crate) fn synchronize(event: &CudaEvent) -> Result<()> {
    // SAFETY: the event holds its context alive.
    let r = unsafe { super::settle::make_current(event.context().cu_ctx()) };
    super::result::check("cuCtxSetCurrent", r)?;
    // SAFETY: the event is alive (borrowed), of the context now current.
    unsafe { super::result::event::synchronize(event.cu_event()) }
}

/// Makes idle events in `ctx`'s pool until [`SPARE`] are idle (see [`Pool::top_up`]); for
/// places nothing waits on (after a transfer completed, a warm-up).
pub(crate) fn top_up(ctx: &Arc<CudaContext>) -> Result<usize> {
    let (pool, _alive) = pool(ctx)?;
    pool.top_up()
}

/// Destroys the idle events of every live context's pool (each kept alive meanwhile); returns
/// how many. The pools of dead contexts are dropped, their events left alone (see
/// [`Pool::abandon`]). Makes no CUDA call when no pool exists (a process without libcuda may
/// call it).
pub(crate) fn release_idle() -> usize {
    let pools: Vec<(Arc<EventPool>, Alive)> = {
        let mut v = pools();
        v.prune();
        v.iter()
            .filter_map(|(r, p)| Some((p.clone(), r.pin()?)))
            .collect()
    };
    if pools.is_empty() {
        return 0;
    }
    // cudarc's event drop binds the event's context (and the drop of a context's last object,
    // which may be a pin here, destroys it): put back what was current.
    let _restore = super::CurrentContext::save();
    let n = pools.iter().map(|(p, _)| p.drain()).sum();
    drop(pools);
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    /// Numbered items; counts what was made and dropped, and fails on request.
    #[derive(Default)]
    struct Counter {
        made: AtomicUsize,
        dropped: Arc<AtomicUsize>,
        fail_after: Option<usize>,
    }

    struct Item {
        id: usize,
        dropped: Arc<AtomicUsize>,
    }

    impl Drop for Item {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, SeqCst);
        }
    }

    impl Make for Counter {
        type Item = Item;
        fn make(&self) -> Result<Item> {
            let id = self.made.fetch_add(1, SeqCst);
            if self.fail_after.is_some_and(|n| id >= n) {
                self.made.fetch_sub(1, SeqCst);
                return Err(Error::InvalidArgument("made too many".into()));
            }
            Ok(Item {
                id,
                dropped: self.dropped.clone(),
            })
        }
    }

    fn ids(l: &Lent<Counter>) -> Vec<usize> {
        let mut v: Vec<usize> = l.iter().map(|i| i.id).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn an_item_given_back_is_lent_again_and_nothing_new_is_made() {
        let p = Pool::new(Counter::default(), 4, 2);
        let a = p.take(1).unwrap();
        let first = a[0].id;
        assert_eq!((p.lent(), p.idle()), (1, 0));
        drop(a);
        assert_eq!((p.lent(), p.idle()), (0, 1));
        for _ in 0..10 {
            let b = p.take(1).unwrap();
            assert_eq!(b[0].id, first, "the idle item was not lent again");
        }
        assert_eq!(
            p.make.made.load(SeqCst),
            1,
            "an item was made while one was idle"
        );
        let three = p.take(3).unwrap();
        assert_eq!(ids(&three), vec![0, 1, 2], "one idle item and two made");
        drop(three);
        let two = p.take(2).unwrap();
        assert_eq!(p.make.made.load(SeqCst), 3);
        assert_eq!(two.len(), 2);
        assert_eq!(p.make.dropped.load(SeqCst), 0);
    }

    /// Retired items (events a capture took) are dropped with their lend, never lent again, and
    /// no longer counted as lent; the pool makes new ones.
    #[test]
    fn retired_items_are_dropped_not_lent_again() {
        let p = Pool::new(Counter::default(), 4, 2);
        let a = p.take(2).unwrap();
        let gone = ids(&a);
        a.retire();
        drop(a);
        assert_eq!((p.lent(), p.idle()), (0, 0));
        assert_eq!(
            p.make.dropped.load(SeqCst),
            2,
            "the retired items were not dropped"
        );
        let b = p.take(2).unwrap();
        assert!(
            ids(&b).iter().all(|i| !gone.contains(i)),
            "a retired item was lent again"
        );
        drop(b);
        assert_eq!((p.lent(), p.idle()), (0, 2));
    }

    #[test]
    fn items_lent_at_once_are_distinct_and_held_until_given_back() {
        let p = Pool::new(Counter::default(), 8, 0);
        let a = p.take(3).unwrap();
        let b = p.take(2).unwrap();
        drop(p.take(1).unwrap());
        let c = p.take(2).unwrap();
        let mut all: Vec<usize> = [&a, &b, &c].iter().flat_map(|l| ids(l)).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 7, "an item was lent to two holders: {all:?}");
        assert_eq!((p.lent(), p.idle()), (7, 0));
        drop(b);
        assert_eq!((p.lent(), p.idle()), (5, 2));
        drop((a, c));
        assert_eq!((p.lent(), p.idle()), (0, 7));
    }

    #[test]
    fn the_pool_keeps_at_most_keep_idle_and_destroys_the_rest() {
        let p = Pool::new(Counter::default(), 4, 8);
        let many = p.take(10).unwrap();
        assert_eq!(p.lent(), 10);
        drop(many);
        assert_eq!((p.lent(), p.idle()), (0, 4));
        assert_eq!(p.make.dropped.load(SeqCst), 6, "the surplus was kept");
        // Given back one holder at a time, the same bound.
        let l: Vec<Lent<Counter>> = (0..6).map(|_| p.take(1).unwrap()).collect();
        drop(l);
        assert_eq!(p.idle(), 4);
        assert_eq!(p.make.dropped.load(SeqCst), 8);
        // A top-up never goes past the bound (its spare, 8, is clamped to keep).
        assert_eq!(p.top_up().unwrap(), 0, "a full pool made more");
        let q = Pool::new(Counter::default(), 4, 8);
        assert_eq!(q.top_up().unwrap(), 4);
        assert_eq!(q.idle(), 4);
    }

    #[test]
    fn a_top_up_makes_what_is_missing_to_spare_and_takers_use_it() {
        let p = Pool::new(Counter::default(), 16, 3);
        assert_eq!(p.top_up().unwrap(), 3);
        assert_eq!(p.top_up().unwrap(), 0);
        let a = p.take(2).unwrap();
        assert_eq!(
            p.make.made.load(SeqCst),
            3,
            "a taker made items while spares were idle"
        );
        assert_eq!(p.top_up().unwrap(), 2);
        drop(a);
        assert_eq!(
            p.idle(),
            5,
            "items given back after a top-up are kept (up to keep)"
        );
        assert_eq!(p.lent(), 0);
    }

    #[test]
    fn a_failed_make_gives_back_what_was_taken_and_counts_nothing_lent() {
        let p = Pool::new(
            Counter {
                fail_after: Some(3),
                ..Counter::default()
            },
            8,
            0,
        );
        drop(p.take(2).unwrap());
        assert!(p.take(5).is_err(), "made more than the maker allows");
        assert_eq!(
            (p.lent(), p.idle()),
            (0, 3),
            "the items of the failed take were lost"
        );
        assert!(p.top_up().is_ok());
        let three = p.take(3).unwrap();
        assert_eq!(ids(&three), vec![0, 1, 2]);
    }

    #[test]
    fn a_drained_pool_takes_back_what_was_lent_before() {
        let p = Pool::new(Counter::default(), 8, 0);
        let a = p.take(2).unwrap();
        drop(p.take(3).unwrap());
        assert_eq!(p.drain(), 3);
        assert_eq!(p.make.dropped.load(SeqCst), 3);
        assert_eq!(p.idle(), 0);
        drop(a);
        assert_eq!((p.lent(), p.idle()), (0, 2));
        assert!(Arc::ptr_eq(p.take(1).unwrap().pool(), &p));
    }

    /// The pool of a context that died leaks its idle items (their handles are dead), never
    /// dropping one; items lent out still come back (none are, for a dead context: lent events
    /// keep it alive).
    #[test]
    fn an_abandoned_pool_leaks_its_idle_items_without_dropping_them() {
        let p = Pool::new(Counter::default(), 8, 0);
        let lent = p.take(2).unwrap();
        drop(p.take(3).unwrap());
        assert_eq!(p.abandon(), 3);
        assert_eq!(p.idle(), 0);
        assert_eq!(
            p.make.dropped.load(SeqCst),
            0,
            "an abandoned item was dropped"
        );
        drop(lent);
        assert_eq!((p.lent(), p.idle()), (0, 2));
    }

    /// Threads take and give back at random; each marks its items in use while it holds them:
    /// no item is ever held by two at once, items are reused (few made), and all come back.
    #[test]
    fn threads_never_hold_one_item_at_once() {
        const THREADS: usize = 8;
        const MOST: usize = 3;
        let p = Pool::new(Counter::default(), 64, 2);
        let in_use: Arc<Vec<AtomicBool>> = Arc::new(
            (0..THREADS * MOST + 64)
                .map(|_| AtomicBool::new(false))
                .collect(),
        );
        let clash = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (p, in_use, clash) = (&p, &in_use, &clash);
                s.spawn(move || {
                    let mut x = t as u64 * 7919 + 1;
                    for _ in 0..2000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let l = p.take(1 + (x as usize % MOST)).unwrap();
                        for it in l.iter() {
                            if in_use[it.id].swap(true, SeqCst) {
                                clash.fetch_add(1, SeqCst);
                            }
                        }
                        if x.is_multiple_of(3) {
                            std::thread::yield_now();
                        }
                        if x.is_multiple_of(5) {
                            p.top_up().unwrap();
                        }
                        for it in l.iter() {
                            in_use[it.id].store(false, SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(
            clash.load(SeqCst),
            0,
            "an item was lent to two holders at once"
        );
        assert_eq!(p.lent(), 0);
        let made = p.make.made.load(SeqCst);
        assert!(
            made <= THREADS * (MOST + 2),
            "{made} items made for at most {} held at once (and each thread's top-up of 2): not reused",
            THREADS * MOST
        );
        assert_eq!(p.idle() + p.make.dropped.load(SeqCst), made);
    }

    /// Waits (at most 30 s) for the sender of the channel whose receiver `data` is.
    unsafe extern "C" fn hold(data: *mut std::ffi::c_void) {
        // SAFETY: `data` is the Box<Receiver> leaked by the test, handed over once; no CUDA
        // call is made here.
        let rx = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
        let _ = rx.recv_timeout(std::time::Duration::from_secs(30));
    }

    /// What the pool relies on, on the hardware: an event given back and recorded again by its
    /// next taker (here on an idle stream, so the new record completes at once) leaves a
    /// `cuStreamWaitEvent` made on its earlier record as it was: work queued after that wait
    /// still waits for the held stream the earlier record was on, and runs once it is released.
    /// The pool is one of the test's own (other tests' transfers use the context's).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_an_event_recorded_again_leaves_the_waits_on_its_earlier_record_alone() {
        use std::time::Duration;
        let _gates = crate::cuda::HOST_FUNCTION_GATES
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let ctx = crate::cuda::context(0).unwrap_or_else(|e| {
            panic!("needs a CUDA GPU (driver and device 0; see CUDA_VISIBLE_DEVICES): {e}")
        });
        let (held, waiter, idle) = (
            ctx.new_stream().unwrap(),
            ctx.new_stream().unwrap(),
            ctx.new_stream().unwrap(),
        );
        let mut after = waiter.alloc_zeros::<u8>(1 << 20).unwrap();
        waiter.synchronize().unwrap();
        let p = Pool::new(MakeEvent(crate::cuda::own_object(&ctx)), 4, 0);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Box::into_raw(Box::new(rx));
        // SAFETY: the stream is alive; `hold` makes no CUDA call and owns `rx` once it runs.
        if let Err(e) = unsafe {
            crate::cuda::result::stream::launch_host_func(held.cu_stream(), hold, rx.cast())
        } {
            // SAFETY: a failed launch did not hand `rx` over.
            drop(unsafe { Box::from_raw(rx) });
            panic!("cuLaunchHostFunc: {e}");
        }
        let first = p.take(1).unwrap();
        record_on(&first[0], &held).unwrap();
        let handle = first[0].cu_event();
        waiter.wait(&first[0]).unwrap();
        waiter.memset_zeros(&mut after).unwrap();
        drop(first);
        let again = p.take(1).unwrap();
        assert_eq!(
            again[0].cu_event(),
            handle,
            "the pool did not lend its event again"
        );
        record_on(&again[0], &idle).unwrap();
        idle.synchronize().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            again[0].try_is_complete().unwrap(),
            "control: the new record on an idle stream did not complete"
        );
        // SAFETY: the stream is alive.
        let released_early = unsafe { crate::cuda::result::stream::is_idle(waiter.cu_stream()) };
        drop(tx);
        waiter.synchronize().unwrap();
        held.synchronize().unwrap();
        assert!(
            !released_early,
            "the work queued after a wait on the event's earlier record ran while that record's stream was held: recording the event again released the wait"
        );
    }
}

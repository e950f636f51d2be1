//! A device buffer lent to a non-blocking transfer together with the one view of it that the
//! transfer uses ([`LentDst`], [`LentSrc`]): the `*_async` call asks the buffer for its view
//! once (`DeviceDst::as_dst` / `DeviceSrc::as_src`, on the calling thread), gates that view
//! (`super::gate`), and the transfer thread moves the bytes through the same view. So the
//! buffer the gate ordered the transfer after is the buffer the IO uses, on every path (the
//! engine's, a small copy, cuFile, an upload): a [`DeviceDst`] or [`DeviceSrc`] is never asked
//! again, and cannot hand the transfer thread another buffer (one it freed and allocated again
//! at the same address, whose work on its stream the gate did not see) because nothing asks it.
//!
//! The view borrows the buffer, which the transfer owns meanwhile: the buffer is boxed
//! ([`Boxed`], a box held through its raw pointer, so that moving the lend moves no borrowed
//! bytes), the view made from an unbounded borrow of the box, and the view is dropped before
//! the buffer is handed back or dropped. The views the transfer thread gets are reborrows of
//! the lend ([`LentDst::view_mut`], [`LentSrc::view`]), never the unbounded one. The view is
//! kept in a `MaybeUninit` (always initialised): moving a lend, or passing it to a function by
//! value, then retags none of the view's references to the buffer, which under Stacked Borrows
//! (Miri's default, fields retagged) would protect them for the call and make freeing the
//! buffer inside `into_inner(self)` undefined behaviour, as Miri reported on a model of this
//! module before the view was kept so.

use std::mem::{ManuallyDrop, MaybeUninit};
use std::ptr::NonNull;

use cudarc::driver::{CudaView, CudaViewMut};

use super::file::{DeviceDst, DeviceSrc};

/// `B` in a box owned through its raw pointer: a borrow of the box's contents made through
/// [`borrow`](Self::borrow) stays valid while the `Boxed` moves, which a `Box<B>` (whose moves
/// assert it is the one pointer to its contents) does not promise. Dropping it drops `B`.
struct Boxed<B>(NonNull<B>);

impl<B> Boxed<B> {
    fn new(b: B) -> Self {
        Boxed(NonNull::from(Box::leak(Box::new(b))))
    }

    /// An exclusive borrow of the contents, of any lifetime the caller picks.
    ///
    /// # Safety
    /// The borrow (and everything made from it) must be dead before
    /// [`into_inner`](Self::into_inner) or drop, and no other borrow of the contents may be
    /// made while it lives.
    unsafe fn borrow<'x>(&self) -> &'x mut B {
        // SAFETY: the pointer comes from a leaked box, so it is valid and aligned until
        // into_inner or drop, and the caller keeps this borrow exclusive and ends it before.
        unsafe { &mut *self.0.as_ptr() }
    }

    /// The contents, the box freed.
    ///
    /// # Safety
    /// No borrow made by [`borrow`](Self::borrow) is alive.
    unsafe fn into_inner(self) -> B {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: the pointer came from Box::leak and is freed once: `me` is not dropped; the
        // caller ended every borrow of the contents.
        *unsafe { Box::from_raw(me.0.as_ptr()) }
    }
}

impl<B> Drop for Boxed<B> {
    fn drop(&mut self) {
        // SAFETY: the pointer came from Box::leak and is freed once (into_inner does not drop
        // `self`); the lends below drop their view (the one borrow of the contents) in their own
        // Drop, which runs before their fields' drops.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// A destination buffer lent to a non-blocking read with its one view (module docs).
pub(super) struct LentDst<D: DeviceDst + 'static> {
    /// `as_dst`'s view of `buf`, always initialised (a `MaybeUninit` only so that moves do not
    /// retag it: module docs), dropped before `buf` (this type's Drop, `into_inner`). Its
    /// lifetime is not `'static`: it borrows `buf` until this value is dropped or handed back.
    view: MaybeUninit<CudaViewMut<'static, D::Elem>>,
    buf: Boxed<D>,
}

impl<D: DeviceDst + 'static> LentDst<D> {
    /// Lends `dst`: its `as_dst`, called here once. A panic there drops `dst`.
    pub(super) fn new(dst: D) -> Self {
        let buf = Boxed::new(dst);
        // SAFETY: the view is the only borrow of the contents made while the lend lives; it
        // is dropped before the contents (Drop, into_inner), and it is reached only through
        // view_mut, whose views borrow the lend.
        let view = MaybeUninit::new(unsafe { buf.borrow() }.as_dst());
        LentDst { view, buf }
    }

    /// The view of the call (a reborrow of it, bounded by this borrow of the lend).
    pub(super) fn view_mut(&mut self) -> CudaViewMut<'_, D::Elem> {
        // SAFETY: `view` is initialised in `new` and dropped only by Drop / into_inner.
        unsafe { self.view.assume_init_mut() }.slice_mut(..)
    }

    /// The buffer, handed back (its view dropped first).
    pub(super) fn into_inner(self) -> D {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `view` is initialised and dropped here once (`me` is never dropped); `buf` is
        // read out once and then owned by this call alone; the view, the one borrow of the
        // contents, is dead before `Boxed::into_inner`.
        unsafe {
            me.view.assume_init_drop();
            std::ptr::read(&me.buf).into_inner()
        }
    }
}

impl<D: DeviceDst + 'static> Drop for LentDst<D> {
    fn drop(&mut self) {
        // SAFETY: `view` is initialised (into_inner, which drops it too, never drops `self`);
        // `buf` is dropped after this, with the view dead.
        unsafe { self.view.assume_init_drop() }
    }
}

// SAFETY: a `LentDst` owns its `D` as a `Box<D>` would (which is `Send` for `D: Send`), and its
// view is an exclusive borrow of that `D` (a `&mut D` is `Send` for `D: Send`) made of a device
// address, a length, and references to cudarc's `Option<CudaEvent>` and `Arc<CudaStream>`,
// which cudarc makes `Send` and `Sync` (cudarc 0.19, driver/safe/core.rs). The view's
// `PhantomData<&mut [T]>` stands for device memory: no host value of `D::Elem` is reachable
// through it, so whether `D::Elem` is `Send` does not matter. The transfer uses the view on
// one thread at a time (the caller's at the call, then the transfer thread's).
unsafe impl<D: DeviceDst + Send + 'static> Send for LentDst<D> {}

/// A source buffer lent to a non-blocking write with its one view (module docs).
pub(super) struct LentSrc<S: DeviceSrc + 'static> {
    /// `as_src`'s view of `buf`, kept as [`LentDst`]'s is.
    view: MaybeUninit<CudaView<'static, S::Elem>>,
    buf: Boxed<S>,
}

impl<S: DeviceSrc + 'static> LentSrc<S> {
    /// Lends `src`: its `as_src`, called here once. A panic there drops `src`.
    pub(super) fn new(src: S) -> Self {
        let buf = Boxed::new(src);
        // SAFETY: as in LentDst::new: the view is the one borrow of the contents while the
        // lend lives, dropped before them, reached only through `view`, whose reference
        // borrows the lend.
        let view = MaybeUninit::new(unsafe { buf.borrow() }.as_src());
        LentSrc { view, buf }
    }

    /// The view of the call (its lifetime shortened to this borrow of the lend).
    pub(super) fn view(&self) -> &CudaView<'_, S::Elem> {
        // SAFETY: as in LentDst::view_mut.
        unsafe { self.view.assume_init_ref() }
    }

    /// The buffer, handed back (its view dropped first).
    pub(super) fn into_inner(self) -> S {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: as in LentDst::into_inner.
        unsafe {
            me.view.assume_init_drop();
            std::ptr::read(&me.buf).into_inner()
        }
    }
}

impl<S: DeviceSrc + 'static> Drop for LentSrc<S> {
    fn drop(&mut self) {
        // SAFETY: as in LentDst's Drop.
        unsafe { self.view.assume_init_drop() }
    }
}

// SAFETY: as for LentDst: the lend owns its `S` (`S: Send`), and its view is a shared borrow of
// it made of cudarc's `Send + Sync` references and a marker of device memory; `as_src` takes
// `&self`, so the view is a `&S`, which the lend's owner (one thread at a time) alone holds.
unsafe impl<S: DeviceSrc + Send + 'static> Send for LentSrc<S> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// Counts its drops, and whether its borrower was dropped before it.
    struct Owner {
        drops: Rc<Cell<usize>>,
        borrower_dropped: Rc<Cell<bool>>,
        bytes: Vec<u8>,
    }
    impl Drop for Owner {
        fn drop(&mut self) {
            assert!(
                self.borrower_dropped.get(),
                "the owner was dropped while its borrower lived"
            );
            self.drops.set(self.drops.get() + 1);
        }
    }
    struct Borrower<'a>(&'a mut Owner, Rc<Cell<bool>>);
    impl Drop for Borrower<'_> {
        fn drop(&mut self) {
            self.1.set(true);
        }
    }

    /// The box the lends are made of (no GPU needed: a host owner and a borrower of it, as a
    /// lend holds a buffer and its view): the borrow stays valid while the box moves to another
    /// place and into a closure; the borrower is dropped before the owner; the owner is
    /// dropped exactly once, handed back with its bytes, or dropped with the box; a borrower
    /// that panics while it is made leaves the owner dropped once (unwinding), never freed
    /// twice.
    #[test]
    fn a_lent_buffer_outlives_its_view_and_is_freed_once() {
        let drops = Rc::new(Cell::new(0));
        let done = Rc::new(Cell::new(false));
        let owner = || Owner {
            drops: drops.clone(),
            borrower_dropped: done.clone(),
            bytes: (0..=255).collect(),
        };
        // Handed back: the borrower first, then the owner, intact.
        done.set(false);
        let b = Boxed::new(owner());
        // SAFETY: the borrower is dropped before into_inner, the one borrow.
        let v = Borrower(unsafe { b.borrow() }, done.clone());
        let moved = vec![b];
        let b = std::hint::black_box(moved).pop().unwrap();
        v.0.bytes[7] = 99;
        drop(v);
        // SAFETY: the borrower was dropped.
        let back = unsafe { b.into_inner() };
        assert_eq!(
            drops.get(),
            0,
            "the owner was dropped before it was handed back"
        );
        assert_eq!(back.bytes[7], 99);
        assert_eq!(back.bytes[8], 8);
        drop(back);
        assert_eq!(drops.get(), 1);
        // Dropped with the box, after its borrower.
        done.set(false);
        let b = Boxed::new(owner());
        // SAFETY: dropped before the box.
        let v = Borrower(unsafe { b.borrow() }, done.clone());
        drop(v);
        drop(b);
        assert_eq!(drops.get(), 2);
        // A borrower that panics while it is made: the box unwinds, the owner dropped once.
        done.set(true);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let b = Boxed::new(owner());
            // SAFETY: the borrow dies in the panic, before the box is dropped by unwinding.
            let o: &mut Owner = unsafe { b.borrow() };
            if o.bytes.len() == 256 {
                panic!("as_dst panicked");
            }
            drop(b);
        }));
        assert!(r.is_err());
        assert_eq!(
            drops.get(),
            3,
            "a panicking view maker freed the owner {} times",
            drops.get() - 2
        );
    }
}

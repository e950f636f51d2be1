//! cudarc's access to a caller's buffer (`device_ptr` / `device_ptr_mut`), made so that its
//! waits for the buffer's other users are made or the call fails ([`ordered_access`]).
//!
//! cudarc orders an access after the buffer's users on other streams with
//! `cuStreamWaitEvent`s, which first bind the context through the stream's `CudaContext` object
//! (cudarc's `bind_to_thread`, whose `check_err` fails on an error stored there, one an earlier
//! call could not return); the wait is then skipped and the error stored again, silently.
//! [`waits_made`] is the rule that closes this, kept apart from CUDA so that it is tested
//! without a GPU.

use cudarc::driver::{sys, CudaStream};

use crate::error::{Error, Result};

/// Runs cudarc's access to a gated buffer (`access`: `device_ptr(_mut)`, whose
/// `cuStreamWaitEvent`s order the buffer's stream after its users elsewhere) so that its waits
/// are made, or the call fails. cudarc's wait first binds the context, which fails on an error
/// stored in the caller's `CudaContext` object (cudarc's `check_err`, an error an earlier call
/// could not return): the wait is then skipped and the error stored again, silently. So the
/// stored error is taken out first (`take`: cudarc's `check_err`), the access made, and what it
/// stored taken out too: an error then (a wait that failed, or one stored meanwhile by another
/// thread, which skips waits as well) is returned, and the call fails instead of proceeding
/// unordered. Either way the error is put back (`put`: cudarc's `record_err`; the newer one
/// when there are two, as cudarc keeps one) so the caller still sees it. An error that was
/// stored before the call does not fail it: the waits were made with it taken out. (Another
/// thread of the caller's that asks the same object in that window does not see the error:
/// cudarc's stored error is a report, not a lock.)
pub(crate) fn waits_made<E: Copy>(
    take: impl Fn() -> std::result::Result<(), E>,
    put: impl Fn(std::result::Result<(), E>),
    access: impl FnOnce(),
) -> std::result::Result<(), E> {
    let stale = take();
    access();
    let now = take();
    put(stale);
    put(now);
    now
}

/// cudarc's access to the buffer of a transfer that does its own copies on `on`
/// (`access`: `device_ptr(_mut)` on `on`, whose `cuStreamWaitEvent`s order `on` after the
/// buffer's users on other streams), through [`waits_made`] as the gates do: cudarc's waits
/// bind through `on`'s `CudaContext` object and are skipped silently when an error is stored
/// there; the error stored before is set aside while they are made, one the access stores
/// fails the transfer ([`Error::Cuda`], nothing moved), both put back. Before `c682809` the
/// transfer's own bind (cudarc's `bind_to_thread`) failed it on such an error after a skipped
/// wait; since, the binds leave stored errors alone, so the access must say whether its waits
/// were made. The guard is returned (its drop records the buffer's event on `on`).
pub(crate) fn ordered_access<'a>(
    on: &CudaStream,
    access: impl FnOnce() -> (sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>),
) -> Result<(sys::CUdeviceptr, cudarc::driver::SyncOnDrop<'a>)> {
    let ctx = on.context();
    let mut got = None;
    let waited = waits_made(
        || ctx.check_err(),
        |r| ctx.record_err(r),
        || got = Some(access()),
    );
    let got = got.expect("the access ran");
    match waited {
        Ok(()) => Ok(got),
        Err(e) => {
            // Its record would be skipped or fail too: nothing was queued after the waits.
            forget_access(got.1);
            Err(skipped_wait(e))
        }
    }
}

/// The call's error when cudarc's access to its buffer stored one ([`waits_made`]).
fn skipped_wait(e: cudarc::driver::DriverError) -> Error {
    Error::cuda(
        "cudarc's wait for the buffer's other users at the call (cuStreamWaitEvent, or the \
         cuCtxSetCurrent before it; an error stored in the stream's CudaContext object skips \
         the wait): the transfer would not be ordered after them",
        e,
    )
}

/// Drops cudarc's access guard without its record (`std::mem::forget`: it only borrows the
/// buffer's event and stream, so nothing leaks). Its waits were made when the access was; the
/// caller says why the record is not needed for what comes after (the gates of the storage
/// room's non-blocking transfers; [`ordered_access`] after a failed access, which queued
/// nothing the record would cover).
pub(crate) fn forget_access(record: cudarc::driver::SyncOnDrop<'_>) {
    std::mem::forget(record);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cudarc's access at the gate ([`waits_made`], no GPU needed: a fake stored error): an
    /// error stored before the call is taken out while the access runs (so its waits are made,
    /// not skipped) and put back, the call going on; an error the access stores (a failed or
    /// skipped wait) fails the call and is put back too; with none, nothing is stored.
    #[test]
    fn a_stored_error_never_skips_the_gates_waits_silently() {
        use std::cell::Cell;
        type R = std::result::Result<(), u32>;
        let state = Cell::new(0u32);
        let take = || -> R {
            match state.replace(0) {
                0 => Ok(()),
                e => Err(e),
            }
        };
        let put = |r: R| {
            if let Err(e) = r {
                state.set(e);
            }
        };
        // A stale error: the access sees none (its waits run), the call goes on, the error is
        // back.
        state.set(700);
        let seen = Cell::new(u32::MAX);
        assert_eq!(waits_made(take, put, || seen.set(state.get())), Ok(()));
        assert_eq!(
            seen.get(),
            0,
            "the access ran with the stale error in place"
        );
        assert_eq!(state.get(), 700, "the stale error was not put back");
        // The access stores one (its wait failed): the call fails with it; it stays stored,
        // the newer one kept.
        assert_eq!(waits_made(take, put, || state.set(999)), Err(999));
        assert_eq!(state.get(), 999);
        state.set(0);
        assert_eq!(waits_made(take, put, || state.set(4)), Err(4));
        assert_eq!(state.get(), 4);
        // Nothing stored: nothing changes.
        state.set(0);
        assert_eq!(waits_made(take, put, || {}), Ok(()));
        assert_eq!(state.get(), 0);
    }
}

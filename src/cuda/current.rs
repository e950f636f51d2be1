//! The calling thread's current CUDA context, put back as it was.

use cudarc::driver::{sys, CudaContext, DriverError};

use super::result as r;
use crate::error::Result;

/// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`, when another context or none
/// is current) and leaves it current, as cudarc's `bind_to_thread` does, but without taking an
/// error stored in the object: `bind_to_thread` first runs cudarc's `check_err`, which takes an
/// error an earlier call of the object's owner could not return (`record_err`, e.g. from a
/// `Drop`) and returns it as its own, so a gpudirect call binding the caller's object failed
/// with a `cuCtxSetCurrent` error that was not one, and the caller's error was gone. The
/// stored error is the caller's: it stays where it is. Every bind of gpudirect's goes through
/// this (or [`CurrentContext::bind`], which also puts the previous context back).
pub(crate) fn bind(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    // SAFETY: the object (borrowed) holds its context alive.
    match unsafe { super::settle::make_current(ctx.cu_ctx()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        rc => Err(DriverError(rc)),
    }
}

/// Makes a context current on the calling thread (`cuCtxSetCurrent`) and, when dropped, makes
/// the context that was current before current again, so a gpudirect call leaves the caller's
/// thread as it found it (cudarc binds contexts and leaves them bound; code that mixes raw
/// driver calls relies on its own current context).
///
/// Created and dropped on the same thread (it is neither `Send` nor `Sync`).
#[must_use = "the previous context is restored when this is dropped"]
pub(crate) struct CurrentContext {
    previous: Option<sys::CUcontext>,
    changed: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CurrentContext {
    /// Makes `ctx` current; remembers the thread's current context first. Through the result
    /// layer (`cuCtxSetCurrent`), never cudarc's `bind_to_thread`: that first takes an error
    /// stored in the object (cudarc's `check_err`, an error an earlier call of the caller's
    /// could not return) and returns it as its own, so a call that binds the caller's context
    /// (a capture check of the caller's stream, `refuse_capturing`) failed with a
    /// `cuCtxSetCurrent` error that was not one, and the caller's error was gone from its
    /// object. The stored error is the caller's: it stays where it is.
    pub(crate) fn bind(ctx: &CudaContext) -> Result<CurrentContext> {
        let previous = r::ctx::current();
        let changed = previous != Some(ctx.cu_ctx());
        if changed {
            // SAFETY: the object (borrowed) holds its context alive.
            let rc = unsafe { r::ctx::set_current(ctx.cu_ctx()) };
            r::check("cuCtxSetCurrent", rc)?;
        }
        Ok(CurrentContext {
            previous,
            changed,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Remembers the thread's current context, to be restored on drop, without changing it
    /// (for scopes in which cudarc calls bind contexts of their own).
    pub(crate) fn save() -> CurrentContext {
        CurrentContext {
            previous: r::ctx::current(),
            changed: true,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if !self.changed {
            return;
        }
        let previous = self.previous.unwrap_or(std::ptr::null_mut());
        if r::ctx::current() == self.previous {
            return;
        }
        // SAFETY: `previous` was current on this thread when the guard was made (or null: no
        // context). A context destroyed meanwhile by another thread makes the driver answer
        // CUDA_ERROR_INVALID_CONTEXT / CONTEXT_IS_DESTROYED, which is only logged.
        let rc = unsafe { r::ctx::set_current(previous) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            tracing::debug!(
                ?rc,
                "gpudirect: restoring the caller's current context failed"
            );
        }
    }
}

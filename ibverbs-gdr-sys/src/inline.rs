//! Rust equivalents of the `static inline` functions and function-like macros of rdma-core's
//! `<infiniband/verbs.h>` (rdma-core 44) that gpudirect uses, named exactly like C and
//! dispatching exactly as the header does: through the context's op table (`ctx->ops`) or, for
//! extended ops, through `struct verbs_context` found with [`verbs_get_ctx`] /
//! [`verbs_get_ctx_op!`](crate::verbs_get_ctx_op).
//!
//! Where the header would call a NULL op (a provider that lacks it), these return the errno
//! the library uses for unsupported ops (`EOPNOTSUPP`) instead of jumping to address 0.
//! Functions that need an exported symbol as a fallback are methods of [`Ibverbs`].

use core::ffi::{c_int, c_uint, c_void};
use core::mem::{offset_of, size_of};

use crate::bindings::*;
use crate::loader::Ibverbs;

/// `__VERBS_ABI_IS_EXTENDED`: the value of `ibv_context::abi_compat` when the context is the
/// last member of a `struct verbs_context` (`((void *)UINTPTR_MAX)` in verbs.h).
pub const __VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

/// `IBV_ACCESS_OPTIONAL_RANGE` (`IB_UVERBS_ACCESS_OPTIONAL_RANGE`, an enum value bindgen does not
/// emit through the alias): the access bits a kernel may ignore, computed as the header does.
pub const IBV_ACCESS_OPTIONAL_RANGE: u32 =
    ((IB_UVERBS_ACCESS_OPTIONAL_LAST << 1) - 1) & !(IB_UVERBS_ACCESS_OPTIONAL_FIRST - 1);

/// `verbs_get_ctx(ctx)`: the `struct verbs_context` that contains `ctx`, or NULL when the
/// context is not extended.
///
/// # Safety
///
/// `ctx` must point to a live `ibv_context` returned by `ibv_open_device`.
pub unsafe fn verbs_get_ctx(ctx: *mut ibv_context) -> *mut verbs_context {
    // SAFETY: the caller guarantees `ctx` is a live context; reading `abi_compat` is what C does.
    if unsafe { (*ctx).abi_compat } != __VERBS_ABI_IS_EXTENDED {
        return core::ptr::null_mut();
    }
    // container_of, as verbs.h open-codes it: the context is the last member of verbs_context.
    // SAFETY: abi_compat == __VERBS_ABI_IS_EXTENDED means libibverbs allocated `ctx` inside a
    // verbs_context, so stepping back by the member offset stays inside that allocation.
    unsafe {
        ctx.cast::<u8>()
            .sub(offset_of!(verbs_context, context))
            .cast::<verbs_context>()
    }
}

/// `verbs_get_ctx_op(ctx, op)`: the extended context when it is large enough to hold the op
/// `op` and that op is set, else NULL. Must be used inside `unsafe`, with `ctx` a live
/// `*mut ibv_context`.
#[macro_export]
macro_rules! verbs_get_ctx_op {
    ($ctx:expr, $op:ident) => {{
        let vctx = $crate::verbs_get_ctx($ctx);
        if vctx.is_null()
            || (*vctx).sz
                < ::core::mem::size_of::<$crate::verbs_context>()
                    - ::core::mem::offset_of!($crate::verbs_context, $op)
            || (*vctx).$op.is_none()
        {
            ::core::ptr::null_mut()
        } else {
            vctx
        }
    }};
}

/// `ibv_post_send`: `qp->context->ops.post_send(qp, wr, bad_wr)`.
///
/// # Safety
///
/// `qp` must be a live QP; `wr` a valid NULL-terminated list whose scatter/gather entries
/// name registered memory that stays valid until the work requests complete; `bad_wr` a valid
/// out-pointer.
pub unsafe fn ibv_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: `qp` is live (caller), so its context and op table are.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the provider's op, called with the caller's valid arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_recv`: `qp->context->ops.post_recv(qp, wr, bad_wr)`.
///
/// # Safety
///
/// As [`ibv_post_send`], for receive work requests.
pub unsafe fn ibv_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is live (caller), so its context and op table are.
    match unsafe { (*(*qp).context).ops.post_recv } {
        // SAFETY: the provider's op, called with the caller's valid arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_poll_cq`: `cq->context->ops.poll_cq(cq, num_entries, wc)`; returns the number of
/// completions written to `wc` (≥ 0) or a negative value on failure.
///
/// # Safety
///
/// `cq` must be a live CQ and `wc` must point to at least `num_entries` writable `ibv_wc`.
pub unsafe fn ibv_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: `cq` is live (caller), so its context and op table are.
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: the provider's op, called with the caller's valid arguments.
        Some(f) => unsafe { f(cq, num_entries, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: `cq->context->ops.req_notify_cq(cq, solicited_only)`.
///
/// # Safety
///
/// `cq` must be a live CQ.
pub unsafe fn ibv_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: `cq` is live (caller), so its context and op table are.
    match unsafe { (*(*cq).context).ops.req_notify_cq } {
        // SAFETY: the provider's op, called with the caller's valid arguments.
        Some(f) => unsafe { f(cq, solicited_only) },
        None => libc::EOPNOTSUPP,
    }
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, always valid on Linux.
    unsafe { *libc::__errno_location() = e };
}

impl Ibverbs {
    /// `ibv_query_port` (the verbs.h macro, i.e. `___ibv_query_port`): the extended op
    /// `query_port(ctx, port, attr, sizeof(*attr))` when the context has it, else the exported
    /// compat symbol `ibv_query_port` after zeroing `attr`. Returns 0 or an errno
    /// (`ENOSYS` when neither exists).
    ///
    /// # Safety
    ///
    /// `context` must be a live context opened through this library; `port_attr` must be
    /// valid for writes.
    pub unsafe fn ibv_query_port(
        &self,
        context: *mut ibv_context,
        port_num: u8,
        port_attr: *mut ibv_port_attr,
    ) -> c_int {
        // SAFETY: `context` is live (caller).
        let vctx = unsafe { crate::verbs_get_ctx_op!(context, query_port) };
        if vctx.is_null() {
            // SAFETY: `port_attr` is valid for writes (caller).
            unsafe { core::ptr::write_bytes(port_attr, 0, 1) };
            return match self.fns().ibv_query_port {
                // SAFETY: the compat entry point takes the same layout prefix, as verbs.h's
                // cast `(struct _compat_ibv_port_attr *)port_attr` relies on.
                Some(f) => unsafe { f(context, port_num, port_attr.cast()) },
                None => libc::ENOSYS,
            };
        }
        // SAFETY: verbs_get_ctx_op checked that `query_port` is present in this context.
        match unsafe { (*vctx).query_port } {
            // SAFETY: the provider's op with the caller's valid arguments.
            Some(f) => unsafe { f(context, port_num, port_attr, size_of::<ibv_port_attr>()) },
            None => libc::ENOSYS,
        }
    }

    /// `ibv_reg_mr` (the verbs.h macro, i.e. `__ibv_reg_mr` with constant access flags): the
    /// exported `ibv_reg_mr` when no flag of `IBV_ACCESS_OPTIONAL_RANGE` is set, else
    /// `ibv_reg_mr_iova2(pd, addr, length, addr, access)`, which masks optional flags the kernel
    /// lacks. NULL with errno set on failure (`ENOSYS` when the symbol is missing).
    ///
    /// # Safety
    ///
    /// `pd` must be a live PD of this library; `addr..addr+length` must be memory the process
    /// owns and keeps mapped until the MR is deregistered.
    pub unsafe fn ibv_reg_mr(
        &self,
        pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_uint,
    ) -> *mut ibv_mr {
        if access & IBV_ACCESS_OPTIONAL_RANGE == 0 {
            match self.fns().ibv_reg_mr {
                // SAFETY: forwarded caller guarantees; the flags fit in an int (checked above
                // that no optional bit, the highest ones, is set).
                Some(f) => unsafe { f(pd, addr, length, access as c_int) },
                None => {
                    set_errno(libc::ENOSYS);
                    core::ptr::null_mut()
                }
            }
        } else {
            // SAFETY: forwarded caller guarantees.
            unsafe { self.ibv_reg_mr_iova(pd, addr, length, addr as u64, access) }
        }
    }

    /// `ibv_reg_mr_iova` (the verbs.h macro, i.e. `__ibv_reg_mr_iova` with constant access
    /// flags): the exported `ibv_reg_mr_iova` without optional flags, else `ibv_reg_mr_iova2`.
    ///
    /// # Safety
    ///
    /// As [`Ibverbs::ibv_reg_mr`].
    pub unsafe fn ibv_reg_mr_iova(
        &self,
        pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        iova: u64,
        access: c_uint,
    ) -> *mut ibv_mr {
        let f = if access & IBV_ACCESS_OPTIONAL_RANGE == 0 {
            self.fns()
                .ibv_reg_mr_iova
                // SAFETY: forwarded caller guarantees; no optional (high) bit is set.
                .map(|f| unsafe { f(pd, addr, length, iova, access as c_int) })
        } else {
            self.fns()
                .ibv_reg_mr_iova2
                // SAFETY: forwarded caller guarantees.
                .map(|f| unsafe { f(pd, addr, length, iova, access) })
        };
        f.unwrap_or_else(|| {
            set_errno(libc::ENOSYS);
            core::ptr::null_mut()
        })
    }

    /// `ibv_query_gid_ex`: `_ibv_query_gid_ex(ctx, port, index, entry, flags, sizeof(*entry))`.
    /// Returns 0 or an errno (`ENOSYS` when the symbol is missing: rdma-core < 32).
    ///
    /// # Safety
    ///
    /// `context` must be live; `entry` valid for writes.
    pub unsafe fn ibv_query_gid_ex(
        &self,
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
    ) -> c_int {
        match self.fns()._ibv_query_gid_ex {
            // SAFETY: forwarded caller guarantees; the size is that of our ibv_gid_entry.
            Some(f) => unsafe {
                f(
                    context,
                    port_num,
                    gid_index,
                    entry,
                    flags,
                    size_of::<ibv_gid_entry>(),
                )
            },
            None => libc::ENOSYS,
        }
    }

    /// `ibv_query_gid_table`: `_ibv_query_gid_table(ctx, entries, max, flags,
    /// sizeof(*entries))`; the number of valid entries, or a negative errno
    /// (`-ENOSYS` when the symbol is missing).
    ///
    /// # Safety
    ///
    /// `context` must be live; `entries` valid for `max_entries` writes.
    pub unsafe fn ibv_query_gid_table(
        &self,
        context: *mut ibv_context,
        entries: *mut ibv_gid_entry,
        max_entries: usize,
        flags: u32,
    ) -> isize {
        match self.fns()._ibv_query_gid_table {
            // SAFETY: forwarded caller guarantees; the size is that of our ibv_gid_entry.
            Some(f) => unsafe {
                f(
                    context,
                    entries,
                    max_entries,
                    flags,
                    size_of::<ibv_gid_entry>(),
                )
            },
            None => -(libc::ENOSYS as isize),
        }
    }
}

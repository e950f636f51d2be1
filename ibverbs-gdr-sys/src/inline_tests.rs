//! The static-inline equivalents dispatch through the op tables exactly as verbs.h does:
//! checked here with a fake provider (a hand-built `verbs_context` whose ops are Rust
//! functions), no device needed.

use core::ffi::c_int;
use core::mem::{offset_of, size_of, MaybeUninit};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::*;

static CALLS: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn fake_post_send(
    _qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    _bad: *mut *mut ibv_send_wr,
) -> c_int {
    CALLS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: the test passes a valid WR.
    unsafe { (*wr).wr_id as c_int }
}

unsafe extern "C" fn fake_post_recv(
    _qp: *mut ibv_qp,
    _wr: *mut ibv_recv_wr,
    _bad: *mut *mut ibv_recv_wr,
) -> c_int {
    CALLS.fetch_add(10, Ordering::SeqCst);
    0
}

unsafe extern "C" fn fake_poll_cq(_cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the test passes `n` writable entries.
    unsafe { (*wc).wr_id = 77 };
    n - 1
}

unsafe extern "C" fn fake_req_notify(_cq: *mut ibv_cq, solicited: c_int) -> c_int {
    100 + solicited
}

unsafe extern "C" fn fake_query_port(
    _ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    assert_eq!(
        len,
        size_of::<ibv_port_attr>(),
        "sizeof(*port_attr) is passed"
    );
    // SAFETY: the caller passes a valid attr.
    unsafe {
        (*attr).lid = 0x1234;
        (*attr).link_layer = IBV_LINK_LAYER_ETHERNET as u8;
    }
    port as c_int - 1
}

/// A zeroed verbs_context (all ops NULL), extended, with `sz` = the full struct.
fn fake_context() -> Box<verbs_context> {
    // SAFETY: verbs_context is C data (pointers, Option<fn>, integers, a pthread mutex whose
    // all-zero value is PTHREAD_MUTEX_INITIALIZER on glibc).
    let mut v: Box<verbs_context> = Box::new(unsafe { MaybeUninit::zeroed().assume_init() });
    v.sz = size_of::<verbs_context>();
    v.context.abi_compat = __VERBS_ABI_IS_EXTENDED;
    v.context.ops.post_send = Some(fake_post_send);
    v.context.ops.post_recv = Some(fake_post_recv);
    v.context.ops.poll_cq = Some(fake_poll_cq);
    v.context.ops.req_notify_cq = Some(fake_req_notify);
    v
}

#[test]
fn data_path_ops_dispatch_through_the_context_op_table() {
    let mut v = fake_context();
    let ctx: *mut ibv_context = &mut v.context;
    // SAFETY: plain C data; all-zero is valid.
    let mut qp: ibv_qp = unsafe { MaybeUninit::zeroed().assume_init() };
    qp.context = ctx;
    // SAFETY: as above.
    let mut cq: ibv_cq = unsafe { MaybeUninit::zeroed().assume_init() };
    cq.context = ctx;
    // SAFETY: as above.
    let mut wr: ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
    wr.wr_id = 5;
    let mut bad = core::ptr::null_mut();
    let before = CALLS.load(Ordering::SeqCst);
    // SAFETY: every pointer is valid; the ops are the fakes above.
    unsafe {
        assert_eq!(ibv_post_send(&mut qp, &mut wr, &mut bad), 5);
        let mut rwr: ibv_recv_wr = MaybeUninit::zeroed().assume_init();
        let mut rbad = core::ptr::null_mut();
        assert_eq!(ibv_post_recv(&mut qp, &mut rwr, &mut rbad), 0);
        let mut wc = [MaybeUninit::<ibv_wc>::zeroed().assume_init(); 4];
        assert_eq!(ibv_poll_cq(&mut cq, 4, wc.as_mut_ptr()), 3);
        assert_eq!(wc[0].wr_id, 77);
        assert_eq!(ibv_req_notify_cq(&mut cq, 1), 101);
    }
    assert_eq!(CALLS.load(Ordering::SeqCst) - before, 11);

    // A provider without the op: an errno, not a jump to address 0.
    v.context.ops.post_send = None;
    v.context.ops.poll_cq = None;
    // SAFETY: as above.
    unsafe {
        assert_eq!(ibv_post_send(&mut qp, &mut wr, &mut bad), libc::EOPNOTSUPP);
        let mut wc = [MaybeUninit::<ibv_wc>::zeroed().assume_init(); 1];
        assert!(ibv_poll_cq(&mut cq, 1, wc.as_mut_ptr()) < 0);
    }
}

#[test]
fn verbs_get_ctx_op_checks_abi_size_and_presence() {
    let mut v = fake_context();
    let vp: *mut verbs_context = &mut *v;
    let ctx: *mut ibv_context = &mut v.context;
    // SAFETY: `ctx` is the last member of a live verbs_context.
    unsafe {
        assert_eq!(
            verbs_get_ctx(ctx),
            vp,
            "container_of finds the verbs_context"
        );
        assert!(verbs_get_ctx_op!(ctx, query_port).is_null(), "op not set");
        (*vp).query_port = Some(fake_query_port);
        assert_eq!(verbs_get_ctx_op!(ctx, query_port), vp);
        // A provider built against an older, smaller verbs_context: the op is beyond `sz`.
        (*vp).sz = size_of::<verbs_context>() - offset_of!(verbs_context, query_port) - 1;
        assert!(verbs_get_ctx_op!(ctx, query_port).is_null(), "op beyond sz");
        (*vp).sz = size_of::<verbs_context>();
        // A legacy (non-extended) context.
        (*ctx).abi_compat = core::ptr::null_mut();
        assert!(verbs_get_ctx(ctx).is_null());
        assert!(verbs_get_ctx_op!(ctx, query_port).is_null());
    }
}

#[test]
fn query_port_uses_the_extended_op_with_the_struct_size() {
    // Needs a loaded libibverbs only for the method's receiver; the fake op answers.
    let lib = match Ibverbs::get() {
        Ok(lib) => lib,
        Err(e) => {
            // The machine has no libibverbs: then that must be what it was told to expect.
            let expect =
                std::env::var("GPUDIRECT_EXPECT_VERBS").unwrap_or_else(|_| "absent".into());
            assert_eq!(expect, "absent", "libibverbs did not load: {e}");
            assert_eq!(e.library, "libibverbs.so.1");
            return;
        }
    };
    let mut v = fake_context();
    v.query_port = Some(fake_query_port);
    let ctx: *mut ibv_context = &mut v.context;
    // SAFETY: plain C data; all-zero is valid.
    let mut attr: ibv_port_attr = unsafe { MaybeUninit::zeroed().assume_init() };
    // SAFETY: `ctx` is an extended context whose query_port is the fake; `attr` is valid.
    let rc = unsafe { lib.ibv_query_port(ctx, 3, &mut attr) };
    assert_eq!(rc, 2, "the extended op was called with the port number");
    assert_eq!(attr.lid, 0x1234);
    assert_eq!(attr.link_layer as u32, IBV_LINK_LAYER_ETHERNET);
}

#[test]
fn reg_mr_picks_the_entry_point_like_the_macro() {
    assert_eq!(
        IBV_ACCESS_OPTIONAL_RANGE & IBV_ACCESS_RELAXED_ORDERING,
        IBV_ACCESS_RELAXED_ORDERING
    );
    assert_eq!(
        IBV_ACCESS_OPTIONAL_RANGE
            & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ),
        0
    );
}

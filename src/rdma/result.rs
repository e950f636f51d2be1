//! The thin private result layer over ibverbs-gdr-sys: one `unsafe fn` per C call, turning the
//! raw return (NULL + errno, an errno, a negative count) into [`Result`]. Safe types call only
//! these.

use std::ffi::c_void;
use std::io;
use std::ptr::NonNull;

use ibverbs_gdr_sys as sys;
use sys::Ibverbs;

use crate::error::{Error, Result};

/// The hint attached to a missing libibverbs.
pub(in crate::rdma) const IBVERBS_HINT: &str =
    "install rdma-core's user-space verbs library (apt-get install libibverbs1 ibverbs-providers) or set GPUDIRECT_IBVERBS_LIB to its path";

/// Converts a loader error into the crate's error.
pub(in crate::rdma) fn unavailable(e: sys::LoadError, hint: &str) -> Error {
    Error::LibraryUnavailable {
        name: e.library,
        tried: e.tried,
        hint: hint.to_string(),
    }
}

/// The process-wide libibverbs.
pub(in crate::rdma) fn ibverbs() -> Result<&'static Ibverbs> {
    Ibverbs::get().map_err(|e| unavailable(e, IBVERBS_HINT))
}

/// A symbol of the table, or `SymbolUnavailable`.
macro_rules! sym {
    ($lib:expr, $name:ident) => {
        $lib.$name
            .ok_or_else(|| $crate::error::Error::SymbolUnavailable {
                library: "libibverbs.so.1",
                symbol: stringify!($name),
                hint: "update rdma-core (libibverbs1) to a release that has it".into(),
            })?
    };
}

fn errno() -> io::Error {
    io::Error::last_os_error()
}

fn clear_errno() {
    // SAFETY: this thread's errno slot is always valid on Linux.
    unsafe { *libc::__errno_location() = 0 };
}

/// An error from a call that returned NULL; errno 0 (a provider that forgot to set it) becomes
/// EIO so the error never reads "success".
fn null_err(op: &'static str) -> Error {
    let e = errno();
    let e = if e.raw_os_error() == Some(0) {
        io::Error::from_raw_os_error(libc::EIO)
    } else {
        e
    };
    Error::Verbs { op, source: e }
}

/// An error from a call that returns an errno (0 = success).
pub(in crate::rdma) fn rc(op: &'static str, code: i32) -> Result<()> {
    match code {
        0 => Ok(()),
        // Some providers return -errno or -1 with errno set; normalise.
        -1 => Err(Error::Verbs {
            op,
            source: errno(),
        }),
        c => Err(Error::Verbs {
            op,
            source: io::Error::from_raw_os_error(c.abs()),
        }),
    }
}

fn nonnull<T>(op: &'static str, p: *mut T) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| null_err(op))
}

/// `ibv_get_device_list`: the list and its length. The list must be freed with
/// [`free_device_list`].
pub(in crate::rdma) unsafe fn get_device_list(
    lib: &Ibverbs,
) -> Result<(NonNull<*mut sys::ibv_device>, usize)> {
    let f = sym!(lib, ibv_get_device_list);
    let mut n = 0;
    clear_errno();
    // SAFETY: `n` is a valid out-pointer.
    let p = unsafe { f(&mut n) };
    let p = nonnull("ibv_get_device_list", p)?;
    Ok((p, n.max(0) as usize))
}

/// `ibv_free_device_list`.
pub(in crate::rdma) unsafe fn free_device_list(lib: &Ibverbs, list: NonNull<*mut sys::ibv_device>) {
    if let Some(f) = lib.ibv_free_device_list {
        // SAFETY: `list` came from ibv_get_device_list (caller).
        unsafe { f(list.as_ptr()) }
    }
}

/// `ibv_get_device_guid` (network byte order in C; returned in host order).
pub(in crate::rdma) unsafe fn get_device_guid(lib: &Ibverbs, dev: *mut sys::ibv_device) -> u64 {
    match lib.ibv_get_device_guid {
        // SAFETY: `dev` is an entry of a live device list (caller).
        Some(f) => u64::from_be(unsafe { f(dev) }),
        None => 0,
    }
}

/// `ibv_open_device`.
pub(in crate::rdma) unsafe fn open_device(
    lib: &Ibverbs,
    dev: *mut sys::ibv_device,
) -> Result<NonNull<sys::ibv_context>> {
    let f = sym!(lib, ibv_open_device);
    clear_errno();
    // SAFETY: `dev` is an entry of a live device list (caller).
    nonnull("ibv_open_device", unsafe { f(dev) })
}

/// `ibv_close_device`.
pub(in crate::rdma) unsafe fn close_device(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
) -> Result<()> {
    let f = sym!(lib, ibv_close_device);
    // SAFETY: `ctx` is a live context with no remaining children (caller).
    rc("ibv_close_device", unsafe { f(ctx.as_ptr()) })
}

/// `ibv_query_device`.
pub(in crate::rdma) unsafe fn query_device(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
) -> Result<sys::ibv_device_attr> {
    let f = sym!(lib, ibv_query_device);
    // SAFETY: ibv_device_attr is plain C data; all-zero is a valid value.
    let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is live (caller), `attr` a valid out-pointer.
    rc("ibv_query_device", unsafe { f(ctx.as_ptr(), &mut attr) })?;
    Ok(attr)
}

/// `ibv_query_port` (the header's macro, through the sys crate's equivalent).
pub(in crate::rdma) unsafe fn query_port(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
    port: u8,
) -> Result<sys::ibv_port_attr> {
    // SAFETY: ibv_port_attr is plain C data; all-zero is a valid value.
    let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is live (caller), `attr` a valid out-pointer.
    rc("ibv_query_port", unsafe {
        lib.ibv_query_port(ctx.as_ptr(), port, &mut attr)
    })?;
    Ok(attr)
}

/// `ibv_query_gid_ex`.
pub(in crate::rdma) unsafe fn query_gid_ex(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
    port: u8,
    index: u32,
) -> Result<sys::ibv_gid_entry> {
    // SAFETY: ibv_gid_entry is plain C data; all-zero is a valid value.
    let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is live (caller), `e` a valid out-pointer.
    rc("ibv_query_gid_ex", unsafe {
        lib.ibv_query_gid_ex(ctx.as_ptr(), port.into(), index, &mut e, 0)
    })?;
    Ok(e)
}

/// `ibv_query_gid_table`.
pub(in crate::rdma) unsafe fn query_gid_table(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
    max: usize,
) -> Result<Vec<sys::ibv_gid_entry>> {
    // SAFETY: ibv_gid_entry is plain C data; all-zero is a valid value.
    let mut v: Vec<sys::ibv_gid_entry> = vec![unsafe { std::mem::zeroed() }; max];
    // SAFETY: `ctx` is live (caller), `v` holds `max` writable entries.
    let n = unsafe { lib.ibv_query_gid_table(ctx.as_ptr(), v.as_mut_ptr(), max, 0) };
    if n < 0 {
        return Err(Error::Verbs {
            op: "ibv_query_gid_table",
            source: io::Error::from_raw_os_error((-n) as i32),
        });
    }
    v.truncate(n as usize);
    Ok(v)
}

/// `ibv_query_gid` (the IB-era call, no GID type).
pub(in crate::rdma) unsafe fn query_gid(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
    port: u8,
    index: i32,
) -> Result<[u8; 16]> {
    let f = sym!(lib, ibv_query_gid);
    // SAFETY: ibv_gid is a plain 16-byte union.
    let mut g: sys::ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is live (caller), `g` a valid out-pointer.
    rc("ibv_query_gid", unsafe {
        f(ctx.as_ptr(), port, index, &mut g)
    })?;
    // SAFETY: every bit pattern is a valid [u8; 16].
    Ok(unsafe { g.raw })
}

/// `ibv_alloc_pd`.
pub(in crate::rdma) unsafe fn alloc_pd(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
) -> Result<NonNull<sys::ibv_pd>> {
    let f = sym!(lib, ibv_alloc_pd);
    clear_errno();
    // SAFETY: `ctx` is live (caller).
    nonnull("ibv_alloc_pd", unsafe { f(ctx.as_ptr()) })
}

/// `ibv_dealloc_pd`.
pub(in crate::rdma) unsafe fn dealloc_pd(lib: &Ibverbs, pd: NonNull<sys::ibv_pd>) -> Result<()> {
    let f = sym!(lib, ibv_dealloc_pd);
    // SAFETY: `pd` is live and unused (caller).
    rc("ibv_dealloc_pd", unsafe { f(pd.as_ptr()) })
}

/// `ibv_reg_mr` (the header's macro, through the sys crate's equivalent).
pub(in crate::rdma) unsafe fn reg_mr(
    lib: &Ibverbs,
    pd: NonNull<sys::ibv_pd>,
    addr: *mut c_void,
    len: usize,
    access: u32,
) -> Result<NonNull<sys::ibv_mr>> {
    clear_errno();
    // SAFETY: forwarded from the caller (memory stays mapped until dereg).
    nonnull("ibv_reg_mr", unsafe {
        lib.ibv_reg_mr(pd.as_ptr(), addr, len, access)
    })
}

/// `ibv_reg_dmabuf_mr` (rdma-core ≥ 34).
pub(in crate::rdma) unsafe fn reg_dmabuf_mr(
    lib: &Ibverbs,
    pd: NonNull<sys::ibv_pd>,
    offset: u64,
    len: usize,
    iova: u64,
    fd: i32,
    access: u32,
) -> Result<NonNull<sys::ibv_mr>> {
    let f = lib
        .ibv_reg_dmabuf_mr
        .ok_or_else(|| Error::SymbolUnavailable {
            library: "libibverbs.so.1",
            symbol: "ibv_reg_dmabuf_mr",
            hint: "dma-buf registration needs rdma-core >= 34: update libibverbs1".into(),
        })?;
    clear_errno();
    // SAFETY: forwarded from the caller (fd is a dma-buf it keeps open as long as needed).
    nonnull("ibv_reg_dmabuf_mr", unsafe {
        f(pd.as_ptr(), offset, len, iova, fd, access as i32)
    })
}

/// `ibv_dereg_mr`.
pub(in crate::rdma) unsafe fn dereg_mr(lib: &Ibverbs, mr: NonNull<sys::ibv_mr>) -> Result<()> {
    let f = sym!(lib, ibv_dereg_mr);
    // SAFETY: `mr` is live (caller).
    rc("ibv_dereg_mr", unsafe { f(mr.as_ptr()) })
}

/// `ibv_create_comp_channel`.
pub(in crate::rdma) unsafe fn create_comp_channel(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
) -> Result<NonNull<sys::ibv_comp_channel>> {
    let f = sym!(lib, ibv_create_comp_channel);
    clear_errno();
    // SAFETY: `ctx` is live (caller).
    nonnull("ibv_create_comp_channel", unsafe { f(ctx.as_ptr()) })
}

/// `ibv_destroy_comp_channel`.
pub(in crate::rdma) unsafe fn destroy_comp_channel(
    lib: &Ibverbs,
    ch: NonNull<sys::ibv_comp_channel>,
) -> Result<()> {
    let f = sym!(lib, ibv_destroy_comp_channel);
    // SAFETY: `ch` is live with no CQ left on it (caller).
    rc("ibv_destroy_comp_channel", unsafe { f(ch.as_ptr()) })
}

/// `ibv_create_cq`.
pub(in crate::rdma) unsafe fn create_cq(
    lib: &Ibverbs,
    ctx: NonNull<sys::ibv_context>,
    cqe: i32,
    channel: *mut sys::ibv_comp_channel,
    comp_vector: i32,
) -> Result<NonNull<sys::ibv_cq>> {
    let f = sym!(lib, ibv_create_cq);
    clear_errno();
    // SAFETY: `ctx` is live; `channel` NULL or live (caller).
    nonnull("ibv_create_cq", unsafe {
        f(
            ctx.as_ptr(),
            cqe,
            std::ptr::null_mut(),
            channel,
            comp_vector,
        )
    })
}

/// `ibv_destroy_cq`.
pub(in crate::rdma) unsafe fn destroy_cq(lib: &Ibverbs, cq: NonNull<sys::ibv_cq>) -> Result<()> {
    let f = sym!(lib, ibv_destroy_cq);
    // SAFETY: `cq` is live, no QP uses it (caller).
    rc("ibv_destroy_cq", unsafe { f(cq.as_ptr()) })
}

/// `ibv_poll_cq`: the number of completions written to the first entries of `wc`.
pub(in crate::rdma) unsafe fn poll_cq(
    cq: NonNull<sys::ibv_cq>,
    wc: &mut [std::mem::MaybeUninit<sys::ibv_wc>],
) -> Result<usize> {
    let n = wc.len().min(i32::MAX as usize) as i32;
    // SAFETY: `cq` is live (caller); `wc` holds `n` writable entries (MaybeUninit has the
    // layout of ibv_wc).
    let r = unsafe { sys::ibv_poll_cq(cq.as_ptr(), n, wc.as_mut_ptr().cast()) };
    if r < 0 {
        return Err(Error::Verbs {
            op: "ibv_poll_cq",
            source: io::Error::from_raw_os_error(if r == -1 { libc::EIO } else { -r }),
        });
    }
    Ok(r as usize)
}

/// `ibv_req_notify_cq`.
pub(in crate::rdma) unsafe fn req_notify_cq(
    cq: NonNull<sys::ibv_cq>,
    solicited_only: bool,
) -> Result<()> {
    // SAFETY: `cq` is live (caller).
    rc("ibv_req_notify_cq", unsafe {
        sys::ibv_req_notify_cq(cq.as_ptr(), solicited_only as i32)
    })
}

/// `ibv_get_cq_event`: blocks (unless the channel fd is non-blocking) for the next event.
pub(in crate::rdma) unsafe fn get_cq_event(
    lib: &Ibverbs,
    ch: NonNull<sys::ibv_comp_channel>,
) -> Result<*mut sys::ibv_cq> {
    let f = sym!(lib, ibv_get_cq_event);
    let mut cq = std::ptr::null_mut();
    let mut cq_ctx = std::ptr::null_mut();
    // SAFETY: `ch` is live (caller); out-pointers valid.
    let r = unsafe { f(ch.as_ptr(), &mut cq, &mut cq_ctx) };
    if r != 0 {
        return Err(Error::Verbs {
            op: "ibv_get_cq_event",
            source: errno(),
        });
    }
    Ok(cq)
}

/// `ibv_ack_cq_events`.
pub(in crate::rdma) unsafe fn ack_cq_events(lib: &Ibverbs, cq: NonNull<sys::ibv_cq>, n: u32) {
    if let Some(f) = lib.ibv_ack_cq_events {
        // SAFETY: `cq` is live (caller).
        unsafe { f(cq.as_ptr(), n) }
    }
}

/// `ibv_create_qp`.
pub(in crate::rdma) unsafe fn create_qp(
    lib: &Ibverbs,
    pd: NonNull<sys::ibv_pd>,
    attr: &mut sys::ibv_qp_init_attr,
) -> Result<NonNull<sys::ibv_qp>> {
    let f = sym!(lib, ibv_create_qp);
    clear_errno();
    // SAFETY: `pd` and the CQs named in `attr` are live (caller).
    nonnull("ibv_create_qp", unsafe { f(pd.as_ptr(), attr) })
}

/// `ibv_modify_qp`.
pub(in crate::rdma) unsafe fn modify_qp(
    lib: &Ibverbs,
    qp: NonNull<sys::ibv_qp>,
    attr: &mut sys::ibv_qp_attr,
    mask: u32,
) -> Result<()> {
    let f = sym!(lib, ibv_modify_qp);
    // SAFETY: `qp` is live (caller); `attr` valid.
    rc("ibv_modify_qp", unsafe {
        f(qp.as_ptr(), attr, mask as i32)
    })
}

/// `ibv_query_qp`: the attributes and the init attributes.
pub(in crate::rdma) unsafe fn query_qp(
    lib: &Ibverbs,
    qp: NonNull<sys::ibv_qp>,
    mask: u32,
) -> Result<sys::ibv_qp_attr> {
    let f = sym!(lib, ibv_query_qp);
    // SAFETY: plain C data; all-zero is valid.
    let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    // SAFETY: plain C data; all-zero is valid.
    let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `qp` is live (caller); out-pointers valid.
    rc("ibv_query_qp", unsafe {
        f(qp.as_ptr(), &mut attr, mask as i32, &mut init)
    })?;
    Ok(attr)
}

/// `ibv_destroy_qp`.
pub(in crate::rdma) unsafe fn destroy_qp(lib: &Ibverbs, qp: NonNull<sys::ibv_qp>) -> Result<()> {
    let f = sym!(lib, ibv_destroy_qp);
    // SAFETY: `qp` is live (caller).
    rc("ibv_destroy_qp", unsafe { f(qp.as_ptr()) })
}

/// `ibv_post_send`.
pub(in crate::rdma) unsafe fn post_send(
    qp: NonNull<sys::ibv_qp>,
    wr: &mut sys::ibv_send_wr,
) -> Result<()> {
    let mut bad = std::ptr::null_mut();
    // SAFETY: forwarded from the caller (WR and its buffers valid until completion).
    rc("ibv_post_send", unsafe {
        sys::ibv_post_send(qp.as_ptr(), wr, &mut bad)
    })
}

/// `ibv_post_recv`.
pub(in crate::rdma) unsafe fn post_recv(
    qp: NonNull<sys::ibv_qp>,
    wr: &mut sys::ibv_recv_wr,
) -> Result<()> {
    let mut bad = std::ptr::null_mut();
    // SAFETY: forwarded from the caller (WR and its buffers valid until completion).
    rc("ibv_post_recv", unsafe {
        sys::ibv_post_recv(qp.as_ptr(), wr, &mut bad)
    })
}

// ---- librdmacm ---------------------------------------------------------------------------

/// The hint attached to a missing librdmacm.
pub(in crate::rdma) const RDMACM_HINT: &str =
    "install rdma-core's connection manager library (apt-get install librdmacm1) or set GPUDIRECT_RDMACM_LIB to its path";

/// The process-wide librdmacm.
pub(in crate::rdma) fn rdmacm() -> Result<&'static sys::Rdmacm> {
    sys::Rdmacm::get().map_err(|e| unavailable(e, RDMACM_HINT))
}

/// A librdmacm symbol, or `SymbolUnavailable`.
macro_rules! cm_sym {
    ($lib:expr, $name:ident) => {
        $lib.$name.ok_or_else(|| Error::SymbolUnavailable {
            library: "librdmacm.so.1",
            symbol: stringify!($name),
            hint: "update rdma-core (librdmacm1) to a release that has it".into(),
        })?
    };
}

/// librdmacm calls return 0 or -1 with errno set.
fn cm_rc(op: &'static str, r: i32) -> Result<()> {
    if r == 0 {
        Ok(())
    } else {
        let e = errno();
        let e = if e.raw_os_error() == Some(0) {
            io::Error::from_raw_os_error(if r > 0 { r } else { libc::EIO })
        } else {
            e
        };
        Err(Error::Verbs { op, source: e })
    }
}

/// `rdma_create_event_channel`.
pub(in crate::rdma) unsafe fn cm_create_event_channel(
    lib: &sys::Rdmacm,
) -> Result<NonNull<sys::rdma_event_channel>> {
    let f = cm_sym!(lib, rdma_create_event_channel);
    clear_errno();
    // SAFETY: no arguments.
    nonnull("rdma_create_event_channel", unsafe { f() })
}

/// `rdma_get_devices`: librdmacm's NULL-terminated list of the device contexts it opened, and
/// its length. Each listed device's reference count is raised (librdmacm closes a removed
/// device's context only once no list and no id refers to it) until
/// [`cm_free_devices`] gives the list back.
pub(in crate::rdma) unsafe fn cm_get_devices(
    lib: &sys::Rdmacm,
) -> Result<(NonNull<*mut sys::ibv_context>, usize)> {
    let f = cm_sym!(lib, rdma_get_devices);
    let mut n = 0;
    clear_errno();
    // SAFETY: `n` is a valid out-pointer.
    let list = nonnull("rdma_get_devices", unsafe { f(&mut n) })?;
    Ok((list, usize::try_from(n).unwrap_or(0)))
}

/// `rdma_free_devices`.
///
/// # Safety
///
/// `list` came from [`cm_get_devices`] with the same library and is freed once; no context
/// taken from it is used afterwards unless something else keeps its device.
pub(in crate::rdma) unsafe fn cm_free_devices(
    lib: &sys::Rdmacm,
    list: NonNull<*mut sys::ibv_context>,
) {
    if let Some(f) = lib.rdma_free_devices {
        // SAFETY: the caller's contract.
        unsafe { f(list.as_ptr()) }
    }
}

/// `rdma_destroy_event_channel`.
pub(in crate::rdma) unsafe fn cm_destroy_event_channel(
    lib: &sys::Rdmacm,
    ch: NonNull<sys::rdma_event_channel>,
) {
    if let Some(f) = lib.rdma_destroy_event_channel {
        // SAFETY: `ch` is live with no id left on it (caller).
        unsafe { f(ch.as_ptr()) }
    }
}

/// `rdma_create_id` (`RDMA_PS_TCP`: reliable connected).
pub(in crate::rdma) unsafe fn cm_create_id(
    lib: &sys::Rdmacm,
    ch: NonNull<sys::rdma_event_channel>,
) -> Result<NonNull<sys::rdma_cm_id>> {
    let f = cm_sym!(lib, rdma_create_id);
    let mut id = std::ptr::null_mut();
    clear_errno();
    // SAFETY: `ch` is live (caller); `id` a valid out-pointer.
    cm_rc("rdma_create_id", unsafe {
        f(ch.as_ptr(), &mut id, std::ptr::null_mut(), sys::RDMA_PS_TCP)
    })?;
    nonnull("rdma_create_id", id)
}

/// `rdma_destroy_id`.
pub(in crate::rdma) unsafe fn cm_destroy_id(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_destroy_id);
    // SAFETY: `id` is live, all its events acknowledged (caller).
    cm_rc("rdma_destroy_id", unsafe { f(id.as_ptr()) })
}

/// `rdma_bind_addr`.
pub(in crate::rdma) unsafe fn cm_bind_addr(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    addr: *mut libc::sockaddr,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_bind_addr);
    clear_errno();
    // SAFETY: `id` live, `addr` a valid sockaddr (caller).
    cm_rc("rdma_bind_addr", unsafe { f(id.as_ptr(), addr) })
}

/// `rdma_resolve_addr`.
pub(in crate::rdma) unsafe fn cm_resolve_addr(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    timeout_ms: i32,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_resolve_addr);
    clear_errno();
    // SAFETY: `id` live; `src` NULL or valid; `dst` valid (caller).
    cm_rc("rdma_resolve_addr", unsafe {
        f(id.as_ptr(), src, dst, timeout_ms)
    })
}

/// `rdma_resolve_route`.
pub(in crate::rdma) unsafe fn cm_resolve_route(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    timeout_ms: i32,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_resolve_route);
    clear_errno();
    // SAFETY: `id` live (caller).
    cm_rc("rdma_resolve_route", unsafe { f(id.as_ptr(), timeout_ms) })
}

/// `rdma_listen`.
pub(in crate::rdma) unsafe fn cm_listen(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    backlog: i32,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_listen);
    clear_errno();
    // SAFETY: `id` live and bound (caller).
    cm_rc("rdma_listen", unsafe { f(id.as_ptr(), backlog) })
}

/// `rdma_connect`.
pub(in crate::rdma) unsafe fn cm_connect(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    p: &mut sys::rdma_conn_param,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_connect);
    clear_errno();
    // SAFETY: `id` live with a resolved route; `p` valid for the call (caller).
    cm_rc("rdma_connect", unsafe { f(id.as_ptr(), p) })
}

/// `rdma_accept`.
pub(in crate::rdma) unsafe fn cm_accept(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    p: &mut sys::rdma_conn_param,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_accept);
    clear_errno();
    // SAFETY: `id` is a connect-request id; `p` valid for the call (caller).
    cm_rc("rdma_accept", unsafe { f(id.as_ptr(), p) })
}

/// `rdma_reject`.
pub(in crate::rdma) unsafe fn cm_reject(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    data: &[u8],
) -> Result<()> {
    let f = cm_sym!(lib, rdma_reject);
    clear_errno();
    // SAFETY: `id` is a connect-request id; `data` valid for the call.
    cm_rc("rdma_reject", unsafe {
        f(id.as_ptr(), data.as_ptr().cast(), data.len() as u8)
    })
}

/// `rdma_establish`.
pub(in crate::rdma) unsafe fn cm_establish(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_establish);
    clear_errno();
    // SAFETY: `id` got CONNECT_RESPONSE (caller).
    cm_rc("rdma_establish", unsafe { f(id.as_ptr()) })
}

/// `rdma_disconnect`.
pub(in crate::rdma) unsafe fn cm_disconnect(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_disconnect);
    clear_errno();
    // SAFETY: `id` live (caller).
    cm_rc("rdma_disconnect", unsafe { f(id.as_ptr()) })
}

/// `rdma_get_cm_event`.
pub(in crate::rdma) unsafe fn cm_get_event(
    lib: &sys::Rdmacm,
    ch: NonNull<sys::rdma_event_channel>,
) -> Result<NonNull<sys::rdma_cm_event>> {
    let f = cm_sym!(lib, rdma_get_cm_event);
    let mut ev = std::ptr::null_mut();
    clear_errno();
    // SAFETY: `ch` live (caller); `ev` a valid out-pointer.
    cm_rc("rdma_get_cm_event", unsafe { f(ch.as_ptr(), &mut ev) })?;
    nonnull("rdma_get_cm_event", ev)
}

/// `rdma_ack_cm_event`.
pub(in crate::rdma) unsafe fn cm_ack_event(
    lib: &sys::Rdmacm,
    ev: NonNull<sys::rdma_cm_event>,
) -> Result<()> {
    let f = cm_sym!(lib, rdma_ack_cm_event);
    // SAFETY: `ev` came from rdma_get_cm_event and is acked once (caller).
    cm_rc("rdma_ack_cm_event", unsafe { f(ev.as_ptr()) })
}

/// `rdma_init_qp_attr`: the attributes and mask for moving a QP to `attr.qp_state`.
pub(in crate::rdma) unsafe fn cm_init_qp_attr(
    lib: &sys::Rdmacm,
    id: NonNull<sys::rdma_cm_id>,
    attr: &mut sys::ibv_qp_attr,
) -> Result<u32> {
    let f = cm_sym!(lib, rdma_init_qp_attr);
    let mut mask = 0;
    clear_errno();
    // SAFETY: `id` live (caller); out-pointers valid.
    cm_rc("rdma_init_qp_attr", unsafe {
        f(id.as_ptr(), attr, &mut mask)
    })?;
    Ok(mask as u32)
}

/// `rdma_event_str`.
pub(in crate::rdma) fn cm_event_str(lib: &sys::Rdmacm, ev: u32) -> Option<String> {
    let f = lib.rdma_event_str?;
    // SAFETY: rdma_event_str returns a static string for any value.
    let p = unsafe { f(ev) };
    if p.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated static string.
    Some(
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned(),
    )
}

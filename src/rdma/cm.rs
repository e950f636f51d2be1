//! Connection setup through librdmacm (`rdma_cm`, loaded at run time from `librdmacm.so.1`):
//! IP address and route resolution, listen / connect / accept, events. This is what
//! `ib_write_bw -R` and `rping` use, and the only way to connect iWARP (siw) QPs.
//!
//! gpudirect creates its own [`QueuePair`] on the context the CM id resolved to
//! ([`CmId::context`]) and moves it through the states the CM computes
//! ([`CmId::transition`], `rdma_init_qp_attr`), so the QP stays an ordinary `QueuePair`.
//! Private data carries a [`ConnectionRecord`](super::ConnectionRecord) (46 bytes fit in
//! the 56 bytes a connect request can carry) to hand out an rkey; see the exposure note in
//! [`connect`](super::connect).
//!
//! The flow (a complete example is the `rdma_cm_*` test):
//! - passive side: [`EventChannel::new`], [`CmId::new`], [`bind`](CmId::bind),
//!   [`listen`](CmId::listen); [`EventChannel::get_event`] gives `CONNECT_REQUEST` and
//!   [`CmEvent::take_id`] the new id; create the QP on its context, `transition(RTR)`,
//!   [`accept`](CmId::accept); on `ESTABLISHED`, `transition(RTS)`;
//! - active side: [`resolve_addr`](CmId::resolve_addr) (`ADDR_RESOLVED`),
//!   [`resolve_route`](CmId::resolve_route) (`ROUTE_RESOLVED`), create the QP,
//!   [`connect`](CmId::connect); on `CONNECT_RESPONSE`, `transition(RTR)`, `transition(RTS)`,
//!   [`establish`](CmId::establish).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ibverbs_gdr_sys as sys;

use super::context::Context;
use super::qp::{QpState, QueuePair};
use super::result;
use crate::error::{Error, Result};

/// An RDMA CM event channel (`rdma_create_event_channel`): events of every [`CmId`] made on it.
/// Its descriptor ([`AsRawFd`]) is non-blocking, for `poll`/`epoll`; [`get_event`](Self::get_event)
/// and [`expect`](Self::expect) wait for it themselves, so several threads may wait on one
/// channel.
pub struct EventChannel {
    raw: NonNull<sys::rdma_event_channel>,
    lib: &'static sys::Rdmacm,
    /// Events handed out and not acknowledged yet, per id: `rdma_destroy_id` blocks until every
    /// event of its id is acknowledged, so an id dropped before its events is destroyed by the
    /// last of them instead.
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    /// Unacknowledged events per id (keyed by the id's address).
    unacked: HashMap<usize, usize>,
    /// Ids dropped while they had unacknowledged events.
    doomed: Vec<NonNull<sys::rdma_cm_id>>,
}

// SAFETY: librdmacm is thread-safe (its calls lock internally; rdma_cm(7) allows events to be
// retrieved from any thread); the Rust state (including the doomed ids' pointers, which only
// this channel's Mutex-guarded code touches) is behind the Mutex.
unsafe impl Send for EventChannel {}
// SAFETY: see Send.
unsafe impl Sync for EventChannel {}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

impl EventChannel {
    /// Opens librdmacm (once per process) and creates a channel.
    pub fn new() -> Result<Arc<EventChannel>> {
        let lib = result::rdmacm()?;
        // SAFETY: plain call; destroyed in Drop.
        let raw = unsafe { result::cm_create_event_channel(lib) }.map_err(|e| match e {
            Error::Verbs { source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENODEV) | Some(libc::ENOENT) | Some(libc::ENOSYS)
                ) =>
            {
                // librdmacm reports a kernel without RDMA as ENODEV; say which it is.
                match super::devices() {
                    Err(e @ Error::NoRdmaSubsystem { .. }) => e,
                    _ => Error::NoDevice {
                        what: "RDMA connection manager (/dev/infiniband/rdma_cm)".into(),
                        detail: format!("{source}: load rdma_ucm and an RDMA device driver"),
                    },
                }
            }
            e => e,
        })?;
        let ch = EventChannel {
            raw,
            lib,
            pending: Mutex::new(Pending::default()),
        };
        // Non-blocking reads (librdmacm's documented way to poll a channel): a thread that was
        // woken for an event another thread took gets EAGAIN instead of blocking.
        let fd = ch.as_raw_fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL take no pointer.
        let set = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !set {
            return Err(Error::Verbs {
                op: "fcntl(O_NONBLOCK) on the rdma_cm event channel",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Arc::new(ch))
    }

    /// The next event if one is queued (`rdma_get_cm_event` on the non-blocking channel),
    /// `None` when none is.
    fn try_get_event(self: &Arc<Self>) -> Result<Option<CmEvent>> {
        // SAFETY: the channel is live while `self` is.
        let raw = match unsafe { result::cm_get_event(self.lib, self.raw) } {
            Ok(raw) => raw,
            Err(Error::Verbs { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EAGAIN) | Some(libc::EINTR)
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        Ok(Some(self.adopt(raw)))
    }

    /// Waits until the channel is readable or `timeout` (None: forever) passed; true when
    /// readable.
    fn wait_readable(&self, timeout: Option<Duration>) -> Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Rounded up, so a wait never ends early and spins.
        let ms = timeout.map_or(-1, |t| {
            i32::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
        });
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                return Ok(false);
            }
            return Err(Error::Verbs {
                op: "poll(rdma_cm event channel)",
                source: e,
            });
        }
        Ok(n > 0)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        // Nothing panics while holding the lock; a poisoned lock still holds consistent data.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An event of the id at `key` was acknowledged: destroys the id if it was dropped and this
    /// was its last event.
    fn acked(&self, key: usize) {
        let doomed = {
            let mut p = self.pending();
            match p.unacked.get_mut(&key) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    return;
                }
                Some(_) => {
                    p.unacked.remove(&key);
                }
                None => return,
            }
            let i = p.doomed.iter().position(|d| d.as_ptr() as usize == key);
            i.map(|i| p.doomed.swap_remove(i))
        };
        if let Some(id) = doomed {
            destroy_id(self.lib, id);
        }
    }

    /// Destroys `id` now, or, while events of it are unacknowledged (`rdma_destroy_id` would
    /// block until they are), when the last of them is.
    fn release_id(&self, id: NonNull<sys::rdma_cm_id>) {
        {
            let mut p = self.pending();
            if p.unacked.contains_key(&(id.as_ptr() as usize)) {
                p.doomed.push(id);
                return;
            }
        }
        destroy_id(self.lib, id);
    }

    /// Blocks until the next event (`rdma_get_cm_event`); the event is acknowledged when
    /// dropped (`rdma_ack_cm_event`).
    pub fn get_event(self: &Arc<Self>) -> Result<CmEvent> {
        loop {
            if let Some(ev) = self.try_get_event()? {
                return Ok(ev);
            }
            self.wait_readable(None)?;
        }
    }

    /// Takes charge of an event librdmacm handed out: counts it against the id whose
    /// destruction waits for its ack.
    fn adopt(self: &Arc<Self>, raw: NonNull<sys::rdma_cm_event>) -> CmEvent {
        // The id whose `rdma_destroy_id` waits for this event's ack. librdmacm counts a connect
        // request against the listener, not the new id: `rdma_get_cm_event` sets the event's
        // `id_priv` from the kernel's uid (the listener's) and `rdma_ack_cm_event` completes
        // `id_priv` (rdma-core librdmacm/cma.c), while `event->id` is the new id.
        // SAFETY: the event is live until acknowledged; both fields are set by librdmacm.
        let id_key = unsafe {
            let ev = raw.as_ref();
            if ev.event == sys::RDMA_CM_EVENT_CONNECT_REQUEST {
                ev.listen_id
            } else {
                ev.id
            }
        } as usize;
        if id_key != 0 {
            *self.pending().unacked.entry(id_key).or_insert(0) += 1;
        }
        CmEvent {
            raw,
            id_key,
            channel: self.clone(),
        }
    }

    /// Waits up to `timeout` for the next event and checks it is `want`: the event, or
    /// [`Error::Verbs`] naming what came instead (`ETIMEDOUT` when nothing did). Returns within
    /// the timeout also when other threads take events from the same channel meanwhile.
    pub fn expect(self: &Arc<Self>, want: CmEventType, timeout: Duration) -> Result<CmEvent> {
        let deadline = super::qp::deadline(timeout);
        let ev = loop {
            if let Some(ev) = self.try_get_event()? {
                break ev;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(Error::Verbs {
                    op: "rdma_get_cm_event",
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no {want} within {timeout:?}"),
                    ),
                });
            }
            self.wait_readable(Some(left))?;
        };
        if ev.event_type() != want {
            return Err(Error::Verbs {
                op: "rdma_get_cm_event",
                source: std::io::Error::other(format!(
                    "expected {want}, got {} (status {})",
                    ev.event_type(),
                    ev.status()
                )),
            });
        }
        Ok(ev)
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is live while `self` is.
        unsafe { self.raw.as_ref().fd }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id and event on this channel holds an Arc of it; destroyed once.
        unsafe { result::cm_destroy_event_channel(self.lib, self.raw) }
    }
}

/// An RDMA CM event type (`enum rdma_cm_event_type`), kept as its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmEventType(pub u32);

impl CmEventType {
    /// `RDMA_CM_EVENT_ADDR_RESOLVED`.
    pub const ADDR_RESOLVED: Self = Self(sys::RDMA_CM_EVENT_ADDR_RESOLVED);
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED`.
    pub const ROUTE_RESOLVED: Self = Self(sys::RDMA_CM_EVENT_ROUTE_RESOLVED);
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`.
    pub const CONNECT_REQUEST: Self = Self(sys::RDMA_CM_EVENT_CONNECT_REQUEST);
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE` (active side, QP not owned by the CM).
    pub const CONNECT_RESPONSE: Self = Self(sys::RDMA_CM_EVENT_CONNECT_RESPONSE);
    /// `RDMA_CM_EVENT_REJECTED`.
    pub const REJECTED: Self = Self(sys::RDMA_CM_EVENT_REJECTED);
    /// `RDMA_CM_EVENT_ESTABLISHED`.
    pub const ESTABLISHED: Self = Self(sys::RDMA_CM_EVENT_ESTABLISHED);
    /// `RDMA_CM_EVENT_DISCONNECTED`.
    pub const DISCONNECTED: Self = Self(sys::RDMA_CM_EVENT_DISCONNECTED);

    /// The C name, e.g. `"RDMA_CM_EVENT_ESTABLISHED"`.
    pub fn name(self) -> Option<&'static str> {
        const NAMES: [&str; 16] = [
            "RDMA_CM_EVENT_ADDR_RESOLVED",
            "RDMA_CM_EVENT_ADDR_ERROR",
            "RDMA_CM_EVENT_ROUTE_RESOLVED",
            "RDMA_CM_EVENT_ROUTE_ERROR",
            "RDMA_CM_EVENT_CONNECT_REQUEST",
            "RDMA_CM_EVENT_CONNECT_RESPONSE",
            "RDMA_CM_EVENT_CONNECT_ERROR",
            "RDMA_CM_EVENT_UNREACHABLE",
            "RDMA_CM_EVENT_REJECTED",
            "RDMA_CM_EVENT_ESTABLISHED",
            "RDMA_CM_EVENT_DISCONNECTED",
            "RDMA_CM_EVENT_DEVICE_REMOVAL",
            "RDMA_CM_EVENT_MULTICAST_JOIN",
            "RDMA_CM_EVENT_MULTICAST_ERROR",
            "RDMA_CM_EVENT_ADDR_CHANGE",
            "RDMA_CM_EVENT_TIMEWAIT_EXIT",
        ];
        NAMES.get(self.0 as usize).copied()
    }
}

impl fmt::Display for CmEventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "rdma_cm event {}", self.0),
        }
    }
}

/// One RDMA CM event; acknowledged (`rdma_ack_cm_event`) on drop. Its id may be dropped
/// first: the id is then destroyed when the event is acknowledged. For a `CONNECT_REQUEST` that
/// id is the listener (librdmacm counts the request against it); the new id
/// ([`take_id`](Self::take_id)) can be dropped at any time.
pub struct CmEvent {
    raw: NonNull<sys::rdma_cm_event>,
    /// The address of the id whose destruction waits for this event's ack (the listener for a
    /// connect request), for the channel's bookkeeping.
    id_key: usize,
    channel: Arc<EventChannel>,
}

// SAFETY: the event is only read (through `&self`), and acked once from whichever thread drops
// it; librdmacm allows acknowledging from any thread.
unsafe impl Send for CmEvent {}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("event", &self.event_type())
            .field("status", &self.status())
            .finish()
    }
}

impl CmEvent {
    fn ev(&self) -> &sys::rdma_cm_event {
        // SAFETY: the event is live until acked in Drop.
        unsafe { self.raw.as_ref() }
    }

    /// The event type.
    pub fn event_type(&self) -> CmEventType {
        CmEventType(self.ev().event)
    }

    /// librdmacm's own name for the type (`rdma_event_str`).
    pub fn describe(&self) -> String {
        result::cm_event_str(self.channel.lib, self.ev().event)
            .unwrap_or_else(|| self.event_type().to_string())
    }

    /// The event status (0, or a negative errno / reject reason).
    pub fn status(&self) -> i32 {
        self.ev().status
    }

    /// The private data the peer sent with connect / accept / reject (copied).
    pub fn private_data(&self) -> Vec<u8> {
        // SAFETY: for connection events `param.conn` is the active member; for others
        // private_data is NULL with length 0.
        let c = unsafe { &self.ev().param.conn };
        if c.private_data.is_null() || c.private_data_len == 0 {
            return Vec::new();
        }
        // SAFETY: librdmacm guarantees `private_data_len` readable bytes until the ack.
        unsafe {
            std::slice::from_raw_parts(c.private_data.cast::<u8>(), c.private_data_len as usize)
        }
        .to_vec()
    }

    /// For `CONNECT_REQUEST`: the new id representing the incoming connection (it must be
    /// accepted or rejected). `None` for other events or if already taken.
    pub fn take_id(&mut self) -> Option<CmId> {
        if self.event_type() != CmEventType::CONNECT_REQUEST {
            return None;
        }
        // SAFETY: the event is live; we take the id out once (set NULL afterwards so a second
        // call returns None). librdmacm does not read `event->id` on ack.
        let id = unsafe { std::ptr::replace(&mut (*self.raw.as_ptr()).id, std::ptr::null_mut()) };
        NonNull::new(id).map(|raw| CmId {
            raw,
            channel: self.channel.clone(),
        })
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // SAFETY: acked once.
        match unsafe { result::cm_ack_event(self.channel.lib, self.raw) } {
            Ok(()) => self.channel.acked(self.id_key),
            // Unacknowledged, the event's id can never be destroyed without blocking: it leaks.
            Err(e) => {
                tracing::warn!(error = %e, "rdma_ack_cm_event failed; its id will not be destroyed")
            }
        }
    }
}

/// Connection parameters (`struct rdma_conn_param`) for [`CmId::connect`] / [`CmId::accept`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// Private data for the peer (≤ 56 bytes on connect, ≤ 196 on accept for RC over IB CM).
    pub private_data: Vec<u8>,
    /// RDMA reads this side serves at once. Default 1.
    pub responder_resources: u8,
    /// RDMA reads this side issues at once. Default 1.
    pub initiator_depth: u8,
    /// Transport retries. Default 7.
    pub retry_count: u8,
    /// RNR retries (7 = infinite). Default 7.
    pub rnr_retry_count: u8,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }
}

impl ConnParam {
    fn raw(&self, qp_num: u32) -> Result<sys::rdma_conn_param> {
        let len = u8::try_from(self.private_data.len()).map_err(|_| {
            Error::InvalidArgument("rdma_cm private data holds at most 255 bytes".into())
        })?;
        Ok(sys::rdma_conn_param {
            private_data: if len == 0 {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num,
        })
    }
}

/// An RDMA CM identifier (`struct rdma_cm_id`, port space TCP = reliable connected),
/// destroyed (`rdma_destroy_id`) on drop.
pub struct CmId {
    raw: NonNull<sys::rdma_cm_id>,
    channel: Arc<EventChannel>,
}

// SAFETY: librdmacm calls on one id may come from any thread (they lock internally).
unsafe impl Send for CmId {}
// SAFETY: see Send.
unsafe impl Sync for CmId {}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId").field("port", &self.port()).finish()
    }
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage, which is suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn ms(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

impl CmId {
    /// Creates an id on `channel` (`rdma_create_id`, `RDMA_PS_TCP`).
    pub fn new(channel: &Arc<EventChannel>) -> Result<CmId> {
        // SAFETY: the channel is live (we hold an Arc); destroyed in Drop.
        let raw = unsafe { result::cm_create_id(channel.lib, channel.raw) }?;
        Ok(CmId {
            raw,
            channel: channel.clone(),
        })
    }

    /// Binds to a local address (`rdma_bind_addr`): the IP of the RDMA netdev, port for a
    /// listener. Binding to the unspecified address listens on every RDMA device.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: the id is live; `ss` is a valid sockaddr for the call.
        unsafe {
            result::cm_bind_addr(
                self.channel.lib,
                self.raw,
                (&mut ss as *mut libc::sockaddr_storage).cast(),
            )
        }
    }

    /// Listens for connection requests (`rdma_listen`).
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: the id is live.
        unsafe { result::cm_listen(self.channel.lib, self.raw, backlog) }
    }

    /// Starts resolving `dst` (and optionally the source) to an RDMA device
    /// (`rdma_resolve_addr`); completes with `ADDR_RESOLVED` on the channel.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let (mut d, _) = sockaddr(dst);
        let mut s = src.map(sockaddr);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), |(ss, _)| {
            (ss as *mut libc::sockaddr_storage).cast()
        });
        // SAFETY: the id is live; the sockaddrs are valid for the call.
        unsafe {
            result::cm_resolve_addr(
                self.channel.lib,
                self.raw,
                sp,
                (&mut d as *mut libc::sockaddr_storage).cast(),
                ms(timeout),
            )
        }
    }

    /// Starts resolving the route (`rdma_resolve_route`); completes with `ROUTE_RESOLVED`.
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        // SAFETY: the id is live.
        unsafe { result::cm_resolve_route(self.channel.lib, self.raw, ms(timeout)) }
    }

    /// The device context this id is bound to (after address resolution, or for an incoming
    /// connection). librdmacm owns it; the returned value keeps it open (a device list of
    /// librdmacm's, `rdma_get_devices`) for as long as it and the PD, CQs and QP made on it
    /// live, also after the id is dropped and the device removed.
    ///
    /// Errors: [`Error::InvalidArgument`] before the id is bound to a device;
    /// [`Error::NoDevice`] when librdmacm no longer lists the device (removed).
    pub fn context(&self) -> Result<Arc<Context>> {
        // SAFETY: the id is live.
        let verbs = unsafe { self.raw.as_ref().verbs };
        let verbs = NonNull::new(verbs).ok_or_else(|| {
            Error::InvalidArgument(
                "this rdma_cm id is not bound to a device yet: resolve the address (or bind to a device's IP) first".into(),
            )
        })?;
        // SAFETY: librdmacm opened `verbs` and keeps it open while this id (alive: `&self`) is
        // bound to it; `borrowed` pins it beyond that.
        unsafe { Context::borrowed(self.channel.lib, verbs) }
    }

    /// The device port the id is bound to (use it as [`QpOptions::port`](super::QpOptions)).
    pub fn port(&self) -> u8 {
        // SAFETY: the id is live.
        unsafe { self.raw.as_ref().port_num }
    }

    /// Moves `qp` to `state` with the attributes the CM computed (`rdma_init_qp_attr` then
    /// `ibv_modify_qp`): RTR and RTS after the connection exchange (addresses, QPN, PSN, MTU,
    /// timeouts all come from the CM).
    pub fn transition(&self, qp: &QueuePair, state: QpState) -> Result<()> {
        let raw_state = match state {
            QpState::Init => sys::IBV_QPS_INIT,
            QpState::Rtr => sys::IBV_QPS_RTR,
            QpState::Rts => sys::IBV_QPS_RTS,
            s => {
                return Err(Error::InvalidArgument(format!(
                    "the CM computes attributes for INIT, RTR and RTS, not {s}"
                )))
            }
        };
        // SAFETY: plain C data; all-zero is valid.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = raw_state;
        // SAFETY: the id is live; `a` a valid out-block.
        let mask = unsafe { result::cm_init_qp_attr(self.channel.lib, self.raw, &mut a) }?;
        a.qp_state = raw_state;
        let op = match state {
            QpState::Init => "ibv_modify_qp(rdma_cm INIT)",
            QpState::Rtr => "ibv_modify_qp(rdma_cm RTR)",
            _ => "ibv_modify_qp(rdma_cm RTS)",
        };
        qp.modify(op, &mut a, mask | sys::IBV_QP_STATE)
    }

    /// Sends a connection request for `qp` (`rdma_connect`); the peer answers with
    /// `CONNECT_RESPONSE` (accepted: move the QP to RTR and RTS, then
    /// [`establish`](Self::establish)) or `REJECTED`.
    pub fn connect(&self, qp: &QueuePair, param: &ConnParam) -> Result<()> {
        let mut p = param.raw(qp.qpn())?;
        // SAFETY: the id is live; `p` and its private data live across the call.
        unsafe { result::cm_connect(self.channel.lib, self.raw, &mut p) }
    }

    /// Accepts a connection request for `qp` (`rdma_accept`), which should be in RTR already;
    /// `ESTABLISHED` follows (then move the QP to RTS).
    pub fn accept(&self, qp: &QueuePair, param: &ConnParam) -> Result<()> {
        let mut p = param.raw(qp.qpn())?;
        // SAFETY: the id is a connect-request id; `p` and its data live across the call.
        unsafe { result::cm_accept(self.channel.lib, self.raw, &mut p) }
    }

    /// Rejects a connection request (`rdma_reject`) with optional private data.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > 255 {
            return Err(Error::InvalidArgument(
                "rdma_cm private data holds at most 255 bytes".into(),
            ));
        }
        // SAFETY: the id is a connect-request id.
        unsafe { result::cm_reject(self.channel.lib, self.raw, private_data) }
    }

    /// Completes the active side after `CONNECT_RESPONSE` (`rdma_establish`).
    pub fn establish(&self) -> Result<()> {
        // SAFETY: the id is live.
        unsafe { result::cm_establish(self.channel.lib, self.raw) }
    }

    /// Disconnects (`rdma_disconnect`); both sides get `DISCONNECTED`.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is live.
        unsafe { result::cm_disconnect(self.channel.lib, self.raw) }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.channel.release_id(self.raw);
    }
}

/// `rdma_destroy_id` for an id whose events are all acknowledged (so it does not block).
fn destroy_id(lib: &sys::Rdmacm, id: NonNull<sys::rdma_cm_id>) {
    // SAFETY: called once per id (from its CmId's drop, or for a doomed id from the ack of its
    // last event, never both: `release_id` and `acked` decide under the channel's lock), after
    // every event of the id handed out was acknowledged; we never associate a QP with an id.
    if let Err(e) = unsafe { result::cm_destroy_id(lib, id) } {
        tracing::warn!(error = %e, "rdma_destroy_id failed");
    }
}

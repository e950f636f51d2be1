//! Reliable-connected queue pairs (`ibv_create_qp`, `IBV_QPT_RC`): INIT → RTR → RTS from a
//! [`ConnectionRecord`], posting RDMA write / write-with-immediate / read / send / receive.

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ibverbs_gdr_sys as sys;

use super::context::{Gid, GidEntry, LinkLayer, Mtu};
use super::cq::CompletionQueue;
use super::mr::{AccessFlags, MemoryRegion, RemoteMemory, Sge};
use super::pd::ProtectionDomain;
use super::result;
use super::wc::WorkCompletion;
use crate::error::{Error, Result};

/// What one side of an RC connection tells the other (out of band: TCP, a file, rdma_cm private
/// data): its QP number and starting PSN, its address (LID on InfiniBand, GID on RoCE), and
/// optionally one memory region the peer may access (`rkey`, `addr`, `len`; zeros when none).
///
/// **The `rkey` grants access**: a peer holding it may write or read the region as its access
/// flags allow, for as long as it is registered. Exchange records only with peers you trust.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ConnectionRecord {
    /// QP number (24 bits).
    pub qpn: u32,
    /// First packet sequence number the sender will use (24 bits).
    pub psn: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (mandatory on RoCE; all zeros on InfiniBand without GRH).
    pub gid: Gid,
    /// Remote key of the exposed memory region (0: none).
    pub rkey: u32,
    /// Address (iova) of the exposed memory region.
    pub addr: u64,
    /// Length of the exposed memory region.
    pub len: u64,
}

impl ConnectionRecord {
    /// Size of the binary encoding ([`to_bytes`](Self::to_bytes)).
    pub const WIRE_LEN: usize = 4 + 4 + 2 + 16 + 4 + 8 + 8;

    /// The exposed memory region as a write/read target.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr,
            len: self.len,
            rkey: self.rkey,
        }
    }

    /// Fixed big-endian binary encoding: qpn, psn, lid, gid, rkey, addr, len.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_be_bytes());
        b[4..8].copy_from_slice(&self.psn.to_be_bytes());
        b[8..10].copy_from_slice(&self.lid.to_be_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        b[26..30].copy_from_slice(&self.rkey.to_be_bytes());
        b[30..38].copy_from_slice(&self.addr.to_be_bytes());
        b[38..46].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); refuses a wrong length or a QPN/PSN beyond 24 bits.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != Self::WIRE_LEN {
            return Err(Error::InvalidArgument(format!(
                "a connection record is {} bytes, got {}",
                Self::WIRE_LEN,
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let r = ConnectionRecord {
            qpn: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid: Gid(b[10..26].try_into().expect("16 bytes")),
            rkey: u32_at(26),
            addr: u64_at(30),
            len: u64_at(38),
        };
        r.validate()?;
        Ok(r)
    }

    /// Decodes a record from the start of `b`, ignoring what follows: rdma_cm private data
    /// arrives padded to the CM message's full size (56 bytes for a connect request).
    pub fn from_prefix(b: &[u8]) -> Result<Self> {
        match b.get(..Self::WIRE_LEN) {
            Some(p) => Self::from_bytes(p),
            None => Self::from_bytes(b),
        }
    }

    pub(in crate::rdma) fn validate(&self) -> Result<()> {
        if self.qpn > 0xff_ffff || self.psn > 0xff_ffff {
            return Err(Error::InvalidArgument(format!(
                "connection record has qpn {:#x} / psn {:#x}: both are 24-bit values",
                self.qpn, self.psn
            )));
        }
        Ok(())
    }
}

/// A QP state (`enum ibv_qp_state`); unknown values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpState {
    /// `IBV_QPS_RESET`.
    Reset,
    /// `IBV_QPS_INIT`: receives may be posted.
    Init,
    /// `IBV_QPS_RTR`: ready to receive.
    Rtr,
    /// `IBV_QPS_RTS`: ready to send.
    Rts,
    /// `IBV_QPS_SQD`.
    Sqd,
    /// `IBV_QPS_SQE`.
    Sqe,
    /// `IBV_QPS_ERR`: outstanding work requests are flushed.
    Err,
    /// A value this crate does not know.
    Other(u32),
}

impl From<u32> for QpState {
    fn from(v: u32) -> Self {
        match v {
            sys::IBV_QPS_RESET => QpState::Reset,
            sys::IBV_QPS_INIT => QpState::Init,
            sys::IBV_QPS_RTR => QpState::Rtr,
            sys::IBV_QPS_RTS => QpState::Rts,
            sys::IBV_QPS_SQD => QpState::Sqd,
            sys::IBV_QPS_SQE => QpState::Sqe,
            sys::IBV_QPS_ERR => QpState::Err,
            v => QpState::Other(v),
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QpState::Reset => f.write_str("RESET"),
            QpState::Init => f.write_str("INIT"),
            QpState::Rtr => f.write_str("RTR"),
            QpState::Rts => f.write_str("RTS"),
            QpState::Sqd => f.write_str("SQD"),
            QpState::Sqe => f.write_str("SQE"),
            QpState::Err => f.write_str("ERR"),
            QpState::Other(v) => write!(f, "state {v}"),
        }
    }
}

/// How to create a QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpOptions {
    /// The port (1-based). Default 1.
    pub port: u8,
    /// The GID index to send from; `None` selects one ([`Context::select_gid`](super::Context::select_gid)).
    pub gid_index: Option<u32>,
    /// Send queue depth. Default 128.
    pub max_send_wr: u32,
    /// Receive queue depth. Default 128.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request. Default 1.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive work request. Default 1.
    pub max_recv_sge: u32,
    /// What the remote peer may do through this QP. Default LOCAL_WRITE | REMOTE_WRITE |
    /// REMOTE_READ.
    pub access: AccessFlags,
    /// How long the post-and-wait helpers ([`QueuePair::write`], [`QueuePair::recv`], ...)
    /// wait for a completion. Default 30 s. When it passes (or polling fails), the helper moves
    /// the QP to ERR, waits for the flushed completion so that the device is done with the
    /// borrowed buffer, and returns the error; the QP must then be replaced.
    pub wait_timeout: Duration,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            port: 1,
            gid_index: None,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            wait_timeout: Duration::from_secs(30),
        }
    }
}

/// Connection parameters for INIT → RTR → RTS (defaults from rc_pingpong and perftest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Path MTU; `None`: the port's active MTU.
    pub path_mtu: Option<Mtu>,
    /// RNR NAK timer code. Default 12.
    pub min_rnr_timer: u8,
    /// Local ACK timeout code: 4.096 µs · 2^timeout. Default 14 (≈ 67 ms).
    pub timeout: u8,
    /// Transport retries. Default 7.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite). Default 7.
    pub rnr_retry: u8,
    /// Outstanding RDMA reads this side initiates. Default 1.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads this side serves. Default 1.
    pub max_dest_rd_atomic: u8,
    /// GRH hop limit. Default 64.
    pub hop_limit: u8,
    /// GRH traffic class. Default 0.
    pub traffic_class: u8,
    /// Service level. Default 0.
    pub service_level: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            path_mtu: None,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            hop_limit: 64,
            traffic_class: 0,
            service_level: 0,
        }
    }
}

/// A scatter/gather list for one post, on the stack for up to 4 entries (the posting hot path
/// allocates nothing).
enum SgList {
    Stack([sys::ibv_sge; 4], usize),
    Heap(Vec<sys::ibv_sge>),
}

impl SgList {
    fn new(sges: &[Sge]) -> SgList {
        if sges.len() <= 4 {
            let mut a = [sys::ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }; 4];
            for (d, s) in a.iter_mut().zip(sges) {
                *d = s.to_raw();
            }
            SgList::Stack(a, sges.len())
        } else {
            SgList::Heap(sges.iter().map(|s| s.to_raw()).collect())
        }
    }

    fn as_mut_slice(&mut self) -> &mut [sys::ibv_sge] {
        match self {
            SgList::Stack(a, n) => &mut a[..*n],
            SgList::Heap(v) => v,
        }
    }
}

/// Work-request ids used by the post-and-wait helpers have this bit set: the posting functions
/// refuse ids with it, and [`CompletionQueue::poll`] never returns completions with it.
pub const HELPER_WR_ID_BIT: u64 = 1 << 63;

/// A reliable-connected queue pair (`struct ibv_qp`, `IBV_QPT_RC`). It holds its PD and CQs
/// (`Arc`), so they outlive it; it is destroyed (`ibv_destroy_qp`) on drop.
pub struct QueuePair {
    raw: NonNull<sys::ibv_qp>,
    state: AtomicU32,
    port: u8,
    lid: u16,
    link_layer: LinkLayer,
    active_mtu: Mtu,
    gid: Option<GidEntry>,
    psn: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    wait_timeout: Duration,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: verbs, including posting from several threads to one QP, are thread-safe
// (rdma-core Documentation/libibverbs.md: "all verbs are thread safe"); Rust-side state is
// atomic or immutable.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn())
            .field("state", &self.cached_state())
            .field("port", &self.port)
            .field("gid", &self.gid)
            .finish()
    }
}

fn initial_psn(qpn: u32) -> u32 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t ^ qpn.rotate_left(8)).wrapping_mul(0x9E37_79B1) & 0xff_ffff
}

impl QueuePair {
    /// Creates an RC QP on `pd` and moves it to INIT (`ibv_create_qp`, `ibv_modify_qp`):
    /// receives may be posted from now on, sends after [`connect`](Self::connect).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        opts: &QpOptions,
    ) -> Result<QueuePair> {
        let ctx = pd.context();
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(cq.context(), ctx) {
                return Err(Error::InvalidArgument(
                    "the CQs and the PD must come from the same Context".into(),
                ));
            }
        }
        let port = ctx.query_port(opts.port)?;
        let gid = match opts.gid_index {
            Some(i) => Some(ctx.query_gid(opts.port, i)?),
            None if port.link_layer == LinkLayer::Ethernet => Some(ctx.select_gid(opts.port)?),
            None => ctx.query_gid(opts.port, 0).ok(),
        };
        // SAFETY: plain C data; all-zero is valid.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_ptr().as_ptr();
        init.recv_cq = recv_cq.as_ptr().as_ptr();
        init.qp_type = sys::IBV_QPT_RC;
        init.cap.max_send_wr = opts.max_send_wr;
        init.cap.max_recv_wr = opts.max_recv_wr;
        init.cap.max_send_sge = opts.max_send_sge;
        init.cap.max_recv_sge = opts.max_recv_sge;
        // SAFETY: the PD and CQs are live (we hold Arcs) and belong to one context.
        let raw = unsafe { result::create_qp(ctx.lib(), pd.as_ptr(), &mut init) }?;
        // SAFETY: the QP is live; qp_num is set at creation.
        let qpn = unsafe { raw.as_ref().qp_num };
        let qp = QueuePair {
            raw,
            state: AtomicU32::new(sys::IBV_QPS_RESET),
            port: opts.port,
            lid: port.lid,
            link_layer: port.link_layer,
            active_mtu: port.active_mtu.unwrap_or(Mtu::Mtu1024),
            gid,
            psn: initial_psn(qpn),
            max_send_sge: opts.max_send_sge,
            max_recv_sge: opts.max_recv_sge,
            wait_timeout: opts.wait_timeout,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            pd: pd.clone(),
        };
        // SAFETY: plain C data; all-zero is valid.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = opts.port;
        a.qp_access_flags = opts.access.bits();
        qp.modify(
            "ibv_modify_qp(RESET->INIT)",
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_PKEY_INDEX
                | sys::IBV_QP_PORT
                | sys::IBV_QP_ACCESS_FLAGS,
        )?;
        Ok(qp)
    }

    pub(in crate::rdma) fn modify(
        &self,
        op: &'static str,
        a: &mut sys::ibv_qp_attr,
        mask: u32,
    ) -> Result<()> {
        // SAFETY: the QP is live while `self` is; `a` is a valid attribute block.
        unsafe { result::modify_qp(self.pd.context().lib(), self.raw, a, mask) }.map_err(|e| {
            match e {
                Error::Verbs { source, .. } => Error::Verbs { op, source },
                e => e,
            }
        })?;
        self.state.store(a.qp_state, Ordering::Release);
        Ok(())
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the QP is live; qp_num is set at creation and never changes.
        unsafe { self.raw.as_ref().qp_num }
    }

    /// The port.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The GID this QP sends from (RoCE), with its index and type.
    pub fn gid(&self) -> Option<&GidEntry> {
        self.gid.as_ref()
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<CompletionQueue> {
        &self.recv_cq
    }

    /// The state this QP was last moved to by this object (no system call).
    pub fn cached_state(&self) -> QpState {
        QpState::from(self.state.load(Ordering::Acquire))
    }

    /// The state as the device reports it (`ibv_query_qp`): e.g. ERR after a failed completion.
    pub fn state(&self) -> Result<QpState> {
        // SAFETY: the QP is live while `self` is.
        let a = unsafe { result::query_qp(self.pd.context().lib(), self.raw, sys::IBV_QP_STATE) }?;
        Ok(QpState::from(a.qp_state))
    }

    /// What the peer needs to connect to this QP, exposing `memory` (or nothing) to it.
    /// See the warning on [`ConnectionRecord`]: the rkey grants access.
    pub fn local_record(&self, memory: Option<RemoteMemory>) -> ConnectionRecord {
        let m = memory.unwrap_or(RemoteMemory {
            addr: 0,
            len: 0,
            rkey: 0,
        });
        ConnectionRecord {
            qpn: self.qpn(),
            psn: self.psn,
            lid: self.lid,
            gid: self.gid.as_ref().map(|g| g.gid).unwrap_or_default(),
            rkey: m.rkey,
            addr: m.addr,
            len: m.len,
        }
    }

    /// Connects to the peer described by `remote` (INIT → RTR → RTS) with default options.
    pub fn connect(&mut self, remote: &ConnectionRecord) -> Result<()> {
        self.connect_with(remote, &ConnectOptions::default())
    }

    /// Connects to the peer described by `remote` (INIT → RTR → RTS).
    ///
    /// Errors: [`Error::InvalidArgument`] when the QP is not in INIT (connect works once) or
    /// the record is malformed; [`Error::Verbs`] with the errno of `ibv_modify_qp` otherwise
    /// (on RoCE, ETIMEDOUT/ENETUNREACH at RTR usually mean the remote GID is not reachable
    /// from the local GID's network).
    pub fn connect_with(&mut self, remote: &ConnectionRecord, opts: &ConnectOptions) -> Result<()> {
        remote.validate()?;
        let st = self.cached_state();
        if st != QpState::Init {
            return Err(Error::InvalidArgument(format!(
                "QP {} is in state {st}: connect works once, on a QP in INIT",
                self.qpn()
            )));
        }
        let roce = self.link_layer == LinkLayer::Ethernet;
        if roce && remote.gid.is_zero() {
            return Err(Error::InvalidArgument(
                "the remote record has no GID, which RoCE needs (GRH is mandatory on Ethernet)"
                    .into(),
            ));
        }
        // SAFETY: plain C data; all-zero is valid.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTR;
        a.path_mtu = opts.path_mtu.unwrap_or(self.active_mtu).raw();
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = opts.max_dest_rd_atomic;
        a.min_rnr_timer = opts.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = opts.service_level;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.port;
        if roce || !remote.gid.is_zero() && remote.lid == 0 {
            let sgid = self.gid.as_ref().ok_or_else(|| {
                Error::InvalidArgument(
                    "no local GID to send from: pass QpOptions::gid_index".into(),
                )
            })?;
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = remote.gid.to_raw();
            a.ah_attr.grh.sgid_index = u8::try_from(sgid.index).map_err(|_| {
                Error::InvalidArgument(format!("GID index {} does not fit in 8 bits", sgid.index))
            })?;
            a.ah_attr.grh.hop_limit = opts.hop_limit;
            a.ah_attr.grh.traffic_class = opts.traffic_class;
        }
        let r = self.modify(
            "ibv_modify_qp(INIT->RTR)",
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER,
        );
        if let Err(Error::Verbs { source, .. }) = &r {
            if matches!(
                source.raw_os_error(),
                Some(libc::ETIMEDOUT) | Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH)
            ) {
                tracing::warn!(
                    remote_gid = %remote.gid,
                    local_gid_index = self.gid.as_ref().map(|g| g.index),
                    "INIT->RTR failed: on RoCE this usually means the remote GID does not answer on the network of the local GID, or a firewall drops RoCE (UDP 4791)"
                );
            }
        }
        r?;
        // SAFETY: plain C data; all-zero is valid.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTS;
        a.timeout = opts.timeout;
        a.retry_cnt = opts.retry_cnt;
        a.rnr_retry = opts.rnr_retry;
        a.sq_psn = self.psn;
        a.max_rd_atomic = opts.max_rd_atomic;
        self.modify(
            "ibv_modify_qp(RTR->RTS)",
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to ERR (`ibv_modify_qp`): every outstanding work request completes with
    /// `IBV_WC_WR_FLUSH_ERR`, after which the device no longer touches their buffers.
    pub fn set_error(&self) -> Result<()> {
        // SAFETY: plain C data; all-zero is valid.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_ERR;
        self.modify("ibv_modify_qp(->ERR)", &mut a, sys::IBV_QP_STATE)
    }

    fn check_send(&self, what: &str, sges: &[Sge]) -> Result<()> {
        let st = self.cached_state();
        if st != QpState::Rts {
            return Err(Error::InvalidArgument(format!(
                "{what} on QP {} in state {st}: connect it first (INIT -> RTR -> RTS)",
                self.qpn()
            )));
        }
        if sges.len() > self.max_send_sge as usize {
            return Err(Error::InvalidArgument(format!(
                "{what} with {} scatter/gather entries; the QP was created with max_send_sge {}",
                sges.len(),
                self.max_send_sge
            )));
        }
        Ok(())
    }

    /// # Safety
    ///
    /// See the public posting functions.
    #[allow(clippy::too_many_arguments)]
    unsafe fn post(
        &self,
        what: &str,
        wr_id: u64,
        opcode: u32,
        sges: &[Sge],
        remote: Option<RemoteMemory>,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        self.check_send(what, sges)?;
        let mut sg = SgList::new(sges);
        let sg = sg.as_mut_slice();
        // SAFETY: plain C data; all-zero is valid.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.next = std::ptr::null_mut();
        wr.sg_list = if sg.is_empty() {
            std::ptr::null_mut()
        } else {
            sg.as_mut_ptr()
        };
        wr.num_sge = sg.len() as i32;
        wr.opcode = opcode;
        wr.send_flags = if signaled { sys::IBV_SEND_SIGNALED } else { 0 };
        if let Some(imm) = imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        if let Some(r) = remote {
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
        }
        // SAFETY: the WR and its SGE array live across the call (the provider copies them into
        // the send queue); the caller guarantees the buffers they name outlive the WR.
        unsafe { result::post_send(self.raw, &mut wr) }
    }

    /// Posts an RDMA write of `local` to `remote` (`ibv_post_send`, `IBV_WR_RDMA_WRITE`).
    /// A completion with `wr_id` arrives on the send CQ when `signaled`.
    ///
    /// Errors: [`Error::InvalidArgument`] when the QP is not connected, for too many
    /// scatter/gather entries, or for a `wr_id` with [`HELPER_WR_ID_BIT`] set; [`Error::Verbs`]
    /// when `ibv_post_send` fails. Nothing is posted on error.
    ///
    /// # Safety
    ///
    /// The memory named by `local` (registered, from [`MemoryRegion::sge`]) must stay
    /// registered, allocated and unmodified until the work request completes (its completion is
    /// polled, or, unsignaled, a later signaled WR on this QP completes, or the QP is destroyed
    /// after [`set_error`](Self::set_error) flushed it). The remote side is checked by the
    /// remote NIC, not here.
    pub unsafe fn post_write(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteMemory,
        signaled: bool,
    ) -> Result<()> {
        user_wr_id(wr_id)?;
        // SAFETY: forwarded from the caller.
        unsafe {
            self.post(
                "RDMA write",
                wr_id,
                sys::IBV_WR_RDMA_WRITE,
                local,
                Some(remote),
                None,
                signaled,
            )
        }
    }

    /// Posts an RDMA write with immediate (`IBV_WR_RDMA_WRITE_WITH_IMM`): like
    /// [`post_write`](Self::post_write), and it consumes a receive posted at the peer, which
    /// completes there with `imm` (opcode `IBV_WC_RECV_RDMA_WITH_IMM`): the way to tell the
    /// peer the data landed without it polling memory.
    ///
    /// # Safety
    ///
    /// As [`post_write`](Self::post_write).
    pub unsafe fn post_write_with_imm(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteMemory,
        imm: u32,
        signaled: bool,
    ) -> Result<()> {
        user_wr_id(wr_id)?;
        // SAFETY: forwarded from the caller.
        unsafe {
            self.post(
                "RDMA write with immediate",
                wr_id,
                sys::IBV_WR_RDMA_WRITE_WITH_IMM,
                local,
                Some(remote),
                Some(imm),
                signaled,
            )
        }
    }

    /// Posts an RDMA read of `remote` into `local` (`IBV_WR_RDMA_READ`).
    ///
    /// # Safety
    ///
    /// As [`post_write`](Self::post_write); moreover the device writes `local`, so nothing may
    /// read or write it until the work request completes, and its region needs LOCAL_WRITE.
    pub unsafe fn post_read(
        &self,
        wr_id: u64,
        local: &[Sge],
        remote: RemoteMemory,
        signaled: bool,
    ) -> Result<()> {
        user_wr_id(wr_id)?;
        // SAFETY: forwarded from the caller.
        unsafe {
            self.post(
                "RDMA read",
                wr_id,
                sys::IBV_WR_RDMA_READ,
                local,
                Some(remote),
                None,
                signaled,
            )
        }
    }

    /// Posts a SEND of `local` (`IBV_WR_SEND`, or `IBV_WR_SEND_WITH_IMM` with `imm`), consuming
    /// a receive posted at the peer.
    ///
    /// # Safety
    ///
    /// As [`post_write`](Self::post_write).
    pub unsafe fn post_send(
        &self,
        wr_id: u64,
        local: &[Sge],
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        user_wr_id(wr_id)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.post_send_raw(wr_id, local, imm, signaled) }
    }

    /// # Safety
    ///
    /// As [`post_send`](Self::post_send).
    unsafe fn post_send_raw(
        &self,
        wr_id: u64,
        local: &[Sge],
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        let op = if imm.is_some() {
            sys::IBV_WR_SEND_WITH_IMM
        } else {
            sys::IBV_WR_SEND
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.post("send", wr_id, op, local, None, imm, signaled) }
    }

    /// Posts a receive (`ibv_post_recv`) into `local` (may be empty, for write-with-immediate
    /// notifications). Allowed from INIT on.
    ///
    /// # Safety
    ///
    /// The device writes `local` when a message arrives, at any time until the receive
    /// completes (or is flushed by [`set_error`](Self::set_error)): the memory must stay
    /// registered and allocated, and nothing may access it, until then.
    pub unsafe fn post_recv(&self, wr_id: u64, local: &[Sge]) -> Result<()> {
        user_wr_id(wr_id)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.post_recv_raw(wr_id, local) }
    }

    /// # Safety
    ///
    /// As [`post_recv`](Self::post_recv).
    unsafe fn post_recv_raw(&self, wr_id: u64, local: &[Sge]) -> Result<()> {
        let st = self.cached_state();
        if st == QpState::Reset {
            return Err(Error::InvalidArgument(format!(
                "post_recv on QP {} in state RESET: receives need INIT or later",
                self.qpn()
            )));
        }
        if local.len() > self.max_recv_sge as usize {
            return Err(Error::InvalidArgument(format!(
                "receive with {} scatter/gather entries; the QP was created with max_recv_sge {}",
                local.len(),
                self.max_recv_sge
            )));
        }
        let mut sg = SgList::new(local);
        let sg = sg.as_mut_slice();
        // SAFETY: plain C data; all-zero is valid.
        let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = if sg.is_empty() {
            std::ptr::null_mut()
        } else {
            sg.as_mut_ptr()
        };
        wr.num_sge = sg.len() as i32;
        // SAFETY: the WR lives across the call; the caller guarantees the buffers.
        unsafe { result::post_recv(self.raw, &mut wr) }
    }

    /// Waits for the helper work request `wr_id` on `cq`. On a timeout or a poll error the work
    /// request may still be posted while the caller's borrow of its buffer ends with this call:
    /// the QP is moved to ERR, which makes the device complete (flush) it, and this returns only
    /// once its completion arrived. If that cannot be confirmed within [`FLUSH_WAIT`] (the device
    /// is dead, or the CQ overran), the process aborts: returning could let the device write
    /// memory that is no longer borrowed. The same if the wait unwinds (a panicking tracing
    /// subscriber): the borrow would end with the work request in flight.
    fn finish(
        &self,
        what: &'static str,
        cq: &CompletionQueue,
        wr_id: u64,
    ) -> Result<WorkCompletion> {
        let in_flight = InFlight {
            what,
            qpn: self.qpn(),
            wr_id,
        };
        let r = self.wait_or_flush(what, cq, wr_id);
        std::mem::forget(in_flight);
        r
    }

    fn wait_or_flush(
        &self,
        what: &'static str,
        cq: &CompletionQueue,
        wr_id: u64,
    ) -> Result<WorkCompletion> {
        let cause = match cq.wait_helper(wr_id, deadline(self.wait_timeout)) {
            Ok(Some(wc)) => return wc.ok(),
            Ok(None) => Error::Verbs {
                op: what,
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no completion within {:?} (QpOptions::wait_timeout); the QP was moved to ERR to flush the work request",
                        self.wait_timeout
                    ),
                ),
            },
            Err(e) => e,
        };
        tracing::warn!(
            qpn = self.qpn(),
            wr_id,
            error = %cause,
            "{what}: moving the QP to ERR to flush the work request before returning"
        );
        if let Err(e) = self.set_error() {
            tracing::warn!(qpn = self.qpn(), error = %e, "could not move the QP to ERR; still waiting for the completion");
        }
        let deadline = deadline(FLUSH_WAIT);
        loop {
            match cq.wait_helper(wr_id, deadline) {
                // Completed or flushed: the device is done with the buffer.
                Ok(Some(_)) => return Err(cause),
                Ok(None) => break,
                Err(e) => {
                    if Instant::now() >= deadline {
                        break;
                    }
                    tracing::warn!(qpn = self.qpn(), wr_id, error = %e, "poll failed while waiting for the flush; retrying");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        device_keeps_buffer(what, self.qpn(), wr_id, &cause)
    }

    /// RDMA-writes `local[range]` to `remote` and waits for the completion. The borrow of the
    /// region lasts until the device is done with it, also on error (see [`QpOptions::wait_timeout`]).
    /// For GPU memory ([`GpuMemoryRegion::mr`](super::GpuMemoryRegion::mr)) it first waits for
    /// the GPU's pending writes to it ([`GpuMemoryRegion::prepare_for_nic`](super::GpuMemoryRegion::prepare_for_nic));
    /// so do [`write_with_imm`](Self::write_with_imm) and [`send`](Self::send).
    pub fn write<B>(
        &self,
        local: &MemoryRegion<B>,
        range: Range<usize>,
        remote: RemoteMemory,
    ) -> Result<WorkCompletion> {
        let sge = local.sge(range)?;
        local.prepare_nic_read()?;
        let id = helper_wr_id();
        // SAFETY: `local` is borrowed until `finish` returns, which happens only after the
        // device completed (or flushed) the work request.
        unsafe {
            self.post(
                "RDMA write",
                id,
                sys::IBV_WR_RDMA_WRITE,
                &[sge],
                Some(remote),
                None,
                true,
            )
        }?;
        self.finish("RDMA write", &self.send_cq, id)
    }

    /// RDMA-writes `local[range]` to `remote` with immediate `imm`, and waits for the local
    /// completion (the peer sees a receive completion carrying `imm`).
    pub fn write_with_imm<B>(
        &self,
        local: &MemoryRegion<B>,
        range: Range<usize>,
        remote: RemoteMemory,
        imm: u32,
    ) -> Result<WorkCompletion> {
        let sge = local.sge(range)?;
        local.prepare_nic_read()?;
        let id = helper_wr_id();
        // SAFETY: as in `write`.
        unsafe {
            self.post(
                "RDMA write with immediate",
                id,
                sys::IBV_WR_RDMA_WRITE_WITH_IMM,
                &[sge],
                Some(remote),
                Some(imm),
                true,
            )
        }?;
        self.finish("RDMA write with immediate", &self.send_cq, id)
    }

    /// RDMA-reads `remote` into `local[range]` and waits for the completion.
    pub fn read<B>(
        &self,
        local: &mut MemoryRegion<B>,
        range: Range<usize>,
        remote: RemoteMemory,
    ) -> Result<WorkCompletion> {
        let sge = local.sge(range)?;
        let id = helper_wr_id();
        // SAFETY: `local` is mutably borrowed until the device completed or flushed the WR.
        unsafe {
            self.post(
                "RDMA read",
                id,
                sys::IBV_WR_RDMA_READ,
                &[sge],
                Some(remote),
                None,
                true,
            )
        }?;
        self.finish("RDMA read", &self.send_cq, id)
    }

    /// Sends `local[range]` (with optional immediate) and waits for the completion, which
    /// needs a receive posted at the peer.
    pub fn send<B>(
        &self,
        local: &MemoryRegion<B>,
        range: Range<usize>,
        imm: Option<u32>,
    ) -> Result<WorkCompletion> {
        let sge = local.sge(range)?;
        local.prepare_nic_read()?;
        let id = helper_wr_id();
        // SAFETY: as in `write`.
        unsafe { self.post_send_raw(id, &[sge], imm, true) }?;
        self.finish("send", &self.send_cq, id)
    }

    /// Posts a receive into `local[range]` and waits until a message (SEND or RDMA write with
    /// immediate) consumes it. `byte_len` and `imm_data` of the result say what arrived.
    pub fn recv<B>(
        &self,
        local: &mut MemoryRegion<B>,
        range: Range<usize>,
    ) -> Result<WorkCompletion> {
        let sges = if range.is_empty() {
            Vec::new()
        } else {
            vec![local.sge(range)?]
        };
        let id = helper_wr_id();
        // SAFETY: `local` is mutably borrowed until the device completed or flushed the WR.
        unsafe { self.post_recv_raw(id, &sges) }?;
        self.finish("receive", &self.recv_cq, id)
    }
}

/// How long a helper waits for the flush of a work request after moving its QP to ERR. Flush
/// completions come within microseconds on a live device.
pub(in crate::rdma) const FLUSH_WAIT: Duration = Duration::from_secs(10);

/// `now + wait`, or (for a wait too long to represent, e.g. `Duration::MAX`) a century from now.
pub(in crate::rdma) fn deadline(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Armed while a helper's work request may still be in flight; dropped only if the wait
/// unwinds, which would end the borrow of the buffer the device may still access.
struct InFlight {
    what: &'static str,
    qpn: u32,
    wr_id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let msg = format!(
            "gpudirect: waiting for {} work request {:#x} on QP {:#x} unwound while the device may still access the borrowed buffer, so the process aborts",
            self.what, self.wr_id, self.qpn
        );
        eprintln!("{msg}");
        std::process::abort();
    }
}

/// Helper work-request ids: [`HELPER_WR_ID_BIT`] and a process-wide counter, so that QPs sharing a
/// CQ never use the same id.
fn helper_wr_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    HELPER_WR_ID_BIT | NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Refuses user work-request ids the helpers' routing would take for their own.
fn user_wr_id(wr_id: u64) -> Result<()> {
    if wr_id & HELPER_WR_ID_BIT != 0 {
        return Err(Error::InvalidArgument(format!(
            "work request id {wr_id:#x} has HELPER_WR_ID_BIT (1 << 63) set, which the post-and-wait helpers reserve: use ids below 1 << 63"
        )));
    }
    Ok(())
}

/// A helper's work request may still be posted and its completion cannot be had: returning
/// would end the borrow of a buffer the device may still write, so the process aborts.
#[cold]
fn device_keeps_buffer(what: &str, qpn: u32, wr_id: u64, cause: &Error) -> ! {
    let msg = format!(
        "gpudirect: {what} on QP {qpn:#x} failed ({cause}) and the device did not confirm the flush of work request {wr_id:#x} within {FLUSH_WAIT:?} after the QP was moved to ERR; the device may still access the borrowed buffer, so the process aborts"
    );
    tracing::error!("{msg}");
    eprintln!("{msg}");
    std::process::abort()
}

impl QueuePair {
    /// Destroys the QP now (`ibv_destroy_qp`); on failure the QP comes back intact with the
    /// error (Drop would only log it). Outstanding work requests are discarded: move the QP to
    /// ERR with [`set_error`](Self::set_error) and drain the CQ first if their buffers matter.
    // The (Self, Error) shape is the convention for fallible teardown; it is returned rarely.
    #[allow(clippy::result_large_err)]
    pub fn close(self) -> std::result::Result<(), (Self, Error)> {
        // SAFETY: the QP is live; on success it is not destroyed again (see below).
        match unsafe { result::destroy_qp(self.pd.context().lib(), self.raw) } {
            Ok(()) => {
                let me = std::mem::ManuallyDrop::new(self);
                // SAFETY: the QP is gone, so Drop must not run; each Arc is moved out once and
                // dropped here (QP first, then CQs, then PD, as Drop would).
                unsafe {
                    drop(std::ptr::read(&me.send_cq));
                    drop(std::ptr::read(&me.recv_cq));
                    drop(std::ptr::read(&me.pd));
                }
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the PD and CQs (Arcs in our fields) are dropped after this.
        if let Err(e) = unsafe { result::destroy_qp(self.pd.context().lib(), self.raw) } {
            tracing::warn!(qpn = self.qpn(), error = %e, "ibv_destroy_qp failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_record_wire_roundtrip_and_validation() {
        let r = ConnectionRecord {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: Gid([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
            rkey: 0xdead_beef,
            addr: 0x7fff_0000_1000,
            len: 1 << 20,
        };
        let b = r.to_bytes();
        assert_eq!(b.len(), ConnectionRecord::WIRE_LEN);
        assert_eq!(ConnectionRecord::from_bytes(&b).unwrap(), r);
        assert!(ConnectionRecord::from_bytes(&b[..45]).is_err());
        let mut bad = r;
        bad.qpn = 0x100_0000;
        assert!(matches!(
            ConnectionRecord::from_bytes(&bad.to_bytes()),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(r.remote().rkey, 0xdead_beef);
    }

    #[test]
    fn psn_is_24_bits() {
        for q in [0, 1, 0xff_ffff, 12345] {
            assert!(initial_psn(q) <= 0xff_ffff);
        }
    }
}

/// Tests on a real RDMA device (the Soft-RoCE VM runs the lib's `rdma_*` tests too); they use
/// the CQ's test seam that makes polls fail.
#[cfg(test)]
mod device_tests {
    use super::*;
    use crate::rdma::{Context, ProtectionDomain};
    use rand::RngCore;

    fn open() -> Arc<Context> {
        let r = match std::env::var("GPUDIRECT_RDMA_DEV") {
            Ok(d) if !d.is_empty() => Context::open(&d),
            _ => Context::open_first(),
        };
        r.unwrap_or_else(|e| panic!("needs an RDMA device: run scripts/rdma-vm-test (Soft-RoCE VM) or set GPUDIRECT_RDMA_DEV / GPUDIRECT_RDMA_GIDX: {e}"))
    }

    fn pair() -> (Arc<ProtectionDomain>, QueuePair, QueuePair) {
        let ctx = open();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let opts = QpOptions {
            gid_index: std::env::var("GPUDIRECT_RDMA_GIDX")
                .ok()
                .map(|v| v.trim().parse().unwrap()),
            wait_timeout: Duration::from_secs(10),
            ..QpOptions::default()
        };
        let (ca, cb) = (
            CompletionQueue::new(&ctx, 64).unwrap(),
            CompletionQueue::new(&ctx, 64).unwrap(),
        );
        let mut a = QueuePair::new(&pd, &ca, &ca, &opts).unwrap();
        let mut b = QueuePair::new(&pd, &cb, &cb, &opts).unwrap();
        let (ra, rb) = (a.local_record(None), b.local_record(None));
        a.connect(&rb).unwrap();
        b.connect(&ra).unwrap();
        (pd, a, b)
    }

    /// Issue 9 item 9: a poll error inside a helper must not return with the work request still
    /// posted (the borrow of the buffer ends with the call).
    #[test]
    #[ignore = "needs an RDMA device"]
    fn rdma_helper_poll_error_leaves_no_receive_posted() {
        const N: usize = 4096;
        let (pd, a, b) = pair();
        let mut dst = pd
            .register_host(vec![0x11u8; N], AccessFlags::LOCAL_WRITE)
            .unwrap();
        b.recv_cq().fail_polls.store(1, Ordering::SeqCst);
        let r = b.recv(&mut dst, 0..N);
        println!("recv with a failing poll: {r:?}; QP b now {:?}", b.state());
        match &r {
            Err(Error::Verbs { op, .. }) => assert!(op.contains("injected"), "{r:?}"),
            other => panic!("expected the poll error, got {other:?}"),
        }
        // The borrow of `dst` has ended: nothing may write it any more.
        let mut data = vec![0u8; N];
        rand::rng().fill_bytes(&mut data);
        let src = pd.register_host(data, AccessFlags::LOCAL_WRITE).unwrap();
        let sent = a.send(&src, 0..N, None);
        std::thread::sleep(Duration::from_millis(200));
        let changed = dst.to_vec().iter().filter(|&&x| x != 0x11).count();
        assert_eq!(
            changed, 0,
            "the NIC wrote {changed} of {N} bytes into the buffer after recv returned {r:?} (send after it: {sent:?})"
        );
        assert_eq!(
            b.state().unwrap(),
            QpState::Err,
            "the helper flushed through ERR"
        );
        assert!(sent.is_err(), "a send to a QP in ERR succeeded: {sent:?}");
    }

    /// Issue 9 item 9, the last resort: when the flush of a helper's work request can never be
    /// confirmed (every poll fails), the helper neither returns nor hangs: the process aborts
    /// with a message. Runs itself as a child process.
    #[test]
    #[ignore = "needs an RDMA device"]
    fn rdma_helper_aborts_when_the_flush_cannot_be_confirmed() {
        const CHILD: &str = "GPUDIRECT_TEST_ABORT_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let (pd, _a, b) = pair();
            let mut dst = pd
                .register_host(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
                .unwrap();
            b.recv_cq().fail_polls.store(u32::MAX, Ordering::SeqCst);
            let r = b.recv(&mut dst, 0..64);
            println!("CHILD RETURNED {r:?}");
            return;
        }
        let t0 = Instant::now();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "rdma::qp::device_tests::rdma_helper_aborts_when_the_flush_cannot_be_confirmed",
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        println!(
            "child after {:?}: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            t0.elapsed(),
            out.status
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{:?}", out.status);
        assert!(!stdout.contains("CHILD RETURNED"), "the helper returned");
        assert!(
            stderr.contains("did not confirm the flush") && stderr.contains("the process aborts"),
            "{stderr}"
        );
        assert!(t0.elapsed() >= FLUSH_WAIT, "aborted before the flush wait");
    }

    /// The posting functions refuse user ids with the helpers' bit (their completions would
    /// never reach `poll`).
    #[test]
    #[ignore = "needs an RDMA device"]
    fn rdma_user_work_requests_cannot_take_helper_ids() {
        let (pd, a, b) = pair();
        let mr = pd
            .register_host(vec![1u8; 64], AccessFlags::LOCAL_WRITE)
            .unwrap();
        let sge = mr.sge(0..64).unwrap();
        // SAFETY: refused before anything is posted.
        let r = unsafe { b.post_recv(HELPER_WR_ID_BIT | 5, &[sge]) };
        assert!(
            matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("HELPER_WR_ID_BIT")),
            "{r:?}"
        );
        // SAFETY: as above.
        let r = unsafe { a.post_send(HELPER_WR_ID_BIT, &[sge], None, true) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: as above.
        let r = unsafe { a.post_write(u64::MAX, &[sge], mr.remote(), true) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: as above.
        let r = unsafe { a.post_read(u64::MAX, &[sge], mr.remote(), true) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: as above.
        let r = unsafe { a.post_write_with_imm(u64::MAX, &[sge], mr.remote(), 1, true) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }

    static HOOK_CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    static HOOK_REFUSES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    fn counting_hook(_: &Vec<u8>) -> Result<()> {
        HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
        if HOOK_REFUSES.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument("refused by the test hook".into()));
        }
        Ok(())
    }

    /// Issue 9 item 15, the NIC half: the helpers that let the NIC read a region (write,
    /// write_with_imm, send) run the region's preparation (for GPU memory: waiting for the
    /// GPU's pending writes) before posting, and post nothing when it fails.
    #[test]
    #[ignore = "needs an RDMA device"]
    fn rdma_helpers_prepare_the_region_before_the_nic_reads_it() {
        const N: usize = 4096;
        let (pd, a, b) = pair();
        let mut data = vec![0u8; N];
        rand::rng().fill_bytes(&mut data);
        let src = pd
            .register_host(data.clone(), AccessFlags::LOCAL_WRITE)
            .unwrap()
            .with_before_nic_read(counting_hook);
        let mut dst = pd
            .register_host(
                vec![0u8; N],
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        HOOK_REFUSES.store(true, Ordering::SeqCst);
        let before = HOOK_CALLS.load(Ordering::SeqCst);
        for r in [
            a.write(&src, 0..N, dst.remote()),
            a.write_with_imm(&src, 0..N, dst.remote(), 7),
            a.send(&src, 0..N, None),
        ] {
            assert!(
                matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("test hook")),
                "{r:?}"
            );
        }
        assert_eq!(HOOK_CALLS.load(Ordering::SeqCst) - before, 3);
        assert_eq!(a.state().unwrap(), QpState::Rts, "nothing was posted");
        assert!(
            dst.to_vec().iter().all(|&x| x == 0),
            "a refused write moved bytes"
        );
        HOOK_REFUSES.store(false, Ordering::SeqCst);
        a.write(&src, 0..N, dst.remote()).unwrap();
        assert_eq!(dst.to_vec(), data);
        std::thread::scope(|s| {
            let h = s.spawn(|| b.recv(&mut dst, 0..N));
            a.send(&src, 0..N, None).unwrap();
            h.join().unwrap().unwrap();
        });
        assert_eq!(HOOK_CALLS.load(Ordering::SeqCst) - before, 5);
        // The NIC writing into the region (read, recv) does not use the read preparation.
        let mut back = pd
            .register_host(vec![0u8; N], AccessFlags::LOCAL_WRITE)
            .unwrap()
            .with_before_nic_read(counting_hook);
        b.read(&mut back, 0..N, dst.remote()).unwrap();
        assert_eq!(back.to_vec(), data);
        assert_eq!(HOOK_CALLS.load(Ordering::SeqCst) - before, 5);
    }
}

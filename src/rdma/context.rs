//! An open RDMA device ([`Context`]): device, port and GID queries, link layer, RoCE v2 GID
//! selection.

use std::fmt;
use std::net::Ipv6Addr;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_gdr_sys as sys;
use sys::Ibverbs;

use super::device::{DeviceInfo, DeviceList, Verbs};
use super::result;
use crate::error::{Error, Result};

/// An open RDMA device (`struct ibv_context`), closed with `ibv_close_device` when the last
/// `Arc` (held by every PD, CQ and QP made from it) is dropped.
pub struct Context {
    lib: &'static Ibverbs,
    raw: NonNull<sys::ibv_context>,
    info: DeviceInfo,
    /// False for a context librdmacm opened (librdmacm closes it).
    owned: bool,
    /// For a context librdmacm opened: its device list, which keeps the device (and so the
    /// context) open while this value lives, even after a hot-removal.
    _pin: Option<CmDevices>,
}

/// A list from `rdma_get_devices`, given back with `rdma_free_devices` on drop. While it lives,
/// librdmacm keeps every listed device's context open (it closes a removed device's context
/// once no list and no id refers to it).
struct CmDevices {
    lib: &'static sys::Rdmacm,
    list: NonNull<*mut sys::ibv_context>,
}

// SAFETY: the list is an array of pointers librdmacm reads only in rdma_free_devices, under its
// own lock (librdmacm is thread-safe); Rust only reads it while holding `&self`.
unsafe impl Send for CmDevices {}
// SAFETY: as above.
unsafe impl Sync for CmDevices {}

impl Drop for CmDevices {
    fn drop(&mut self) {
        // SAFETY: from rdma_get_devices with this library, freed once (here).
        unsafe { result::cm_free_devices(self.lib, self.list) }
    }
}

impl CmDevices {
    /// True when `ctx` is among the list's `len` contexts.
    fn contains(&self, ctx: NonNull<sys::ibv_context>, len: usize) -> bool {
        (0..len).any(|i| {
            // SAFETY: the list holds `len` entries before its NULL terminator.
            unsafe { *self.list.as_ptr().add(i) == ctx.as_ptr() }
        })
    }
}

// SAFETY: libibverbs is thread-safe: "all verbs are thread safe" (rdma-core
// Documentation/libibverbs.md, ibv_open_device(3)); the context pointer is only passed to verbs.
unsafe impl Send for Context {}
// SAFETY: see Send; no interior state is mutated from Rust.
unsafe impl Sync for Context {}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.info.name)
            .finish()
    }
}

impl Context {
    /// Opens the device named `name` (`ibv_open_device`), e.g. `"mlx5_0"` or `"rxe0"`.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        Verbs::get()?.open(name)
    }

    /// Opens the first device of the list.
    pub fn open_first() -> Result<Arc<Context>> {
        Verbs::get()?.open_first()
    }

    /// The device's name and identity.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    pub(in crate::rdma) fn lib(&self) -> &'static Ibverbs {
        self.lib
    }

    pub(in crate::rdma) fn as_ptr(&self) -> NonNull<sys::ibv_context> {
        self.raw
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttributes> {
        // SAFETY: the context is live while `self` is.
        let a = unsafe { result::query_device(self.lib, self.raw) }?;
        Ok(DeviceAttributes {
            fw_ver: {
                // SAFETY: c_char and u8 have the same layout.
                let b = unsafe {
                    std::slice::from_raw_parts(a.fw_ver.as_ptr().cast::<u8>(), a.fw_ver.len())
                };
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).into_owned()
            },
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_mr_size: a.max_mr_size,
            max_qp: a.max_qp.max(0) as u32,
            max_qp_wr: a.max_qp_wr.max(0) as u32,
            max_sge: a.max_sge.max(0) as u32,
            max_cq: a.max_cq.max(0) as u32,
            max_cqe: a.max_cqe.max(0) as u32,
            max_mr: a.max_mr.max(0) as u32,
            max_qp_rd_atom: a.max_qp_rd_atom.max(0) as u32,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.max(0) as u32,
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// Port attributes (`ibv_query_port`, the header's macro: the extended op when present).
    pub fn query_port(&self, port: u8) -> Result<PortAttributes> {
        // SAFETY: the context is live while `self` is.
        let a = unsafe { result::query_port(self.lib, self.raw, port) }?;
        Ok(PortAttributes {
            port,
            state: PortState::from(a.state),
            max_mtu: Mtu::try_from(a.max_mtu).ok(),
            active_mtu: Mtu::try_from(a.active_mtu).ok(),
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            lid: a.lid,
            link_layer: LinkLayer::from(a.link_layer),
            active_width: a.active_width,
            active_speed: a.active_speed,
        })
    }

    /// One GID table entry with its type (`ibv_query_gid_ex`; falls back to `ibv_query_gid`,
    /// type unknown, on an rdma-core without it).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<GidEntry> {
        // SAFETY: the context is live while `self` is.
        match unsafe { result::query_gid_ex(self.lib, self.raw, port, index) } {
            Ok(e) => Ok(GidEntry::from_raw(&e)),
            Err(Error::Verbs { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
                ) =>
            {
                // SAFETY: the context is live while `self` is.
                let raw = unsafe { result::query_gid(self.lib, self.raw, port, index as i32) }?;
                Ok(GidEntry {
                    gid: Gid(raw),
                    index,
                    port,
                    gid_type: GidType::Other(u32::MAX),
                    ndev_ifindex: 0,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The valid GID entries of `port` (`ibv_query_gid_table`, or entry by entry with
    /// `ibv_query_gid_ex` when the table call is unavailable).
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let p = self.query_port(port)?;
        let max = p.gid_tbl_len.max(1) as usize;
        // SAFETY: the context is live while `self` is.
        match unsafe { result::query_gid_table(self.lib, self.raw, max) } {
            Ok(v) => Ok(v
                .iter()
                .map(GidEntry::from_raw)
                .filter(|e| e.port == port)
                .collect()),
            Err(_) => Ok((0..p.gid_tbl_len)
                .filter_map(|i| self.query_gid(port, i).ok())
                .filter(|e| !e.gid.is_zero())
                .collect()),
        }
    }

    /// The GID to use on `port`, as perftest and NCCL choose it: on Ethernet (RoCE), a RoCE v2
    /// GID holding an IPv4-mapped address, else any RoCE v2 GID, else RoCE v1; on InfiniBand,
    /// GID index 0. [`Error::NoDevice`] when the port has no usable GID (on RoCE: the netdev has
    /// no IP address).
    pub fn select_gid(&self, port: u8) -> Result<GidEntry> {
        let p = self.query_port(port)?;
        if p.link_layer != LinkLayer::Ethernet {
            return self.query_gid(port, 0);
        }
        let table = self.gid_table(port)?;
        select_roce_gid(&table).cloned().ok_or_else(|| Error::NoDevice {
            what: format!("usable RoCE GID on {} port {port}", self.info.name),
            detail: "give the RDMA device's netdev an IP address (ip addr add ...) or pass a GID index (GPUDIRECT_RDMA_GIDX)".into(),
        })
    }
}

/// The preference order of [`Context::select_gid`] on RoCE.
pub(in crate::rdma) fn select_roce_gid(table: &[GidEntry]) -> Option<&GidEntry> {
    let usable = || table.iter().filter(|e| !e.gid.is_zero());
    usable()
        .find(|e| e.gid_type == GidType::RoceV2 && e.gid.is_ipv4_mapped())
        .or_else(|| usable().find(|e| e.gid_type == GidType::RoceV2))
        .or_else(|| usable().find(|e| e.gid_type == GidType::RoceV1))
}

impl Drop for Context {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: every child holds an Arc<Context>, so none is left; closed once.
        if let Err(e) = unsafe { result::close_device(self.lib, self.raw) } {
            tracing::warn!(device = %self.info.name, error = %e, "ibv_close_device failed");
        }
    }
}

impl Verbs {
    /// Opens the device named `name` with this library.
    pub fn open(&self, name: &str) -> Result<Arc<Context>> {
        let list = DeviceList::get(self.lib())?;
        let mut names = Vec::new();
        for d in list.iter() {
            // SAFETY: `d` is an entry of `list`, alive for this loop.
            let info = unsafe { DeviceInfo::from_raw(self.lib(), d) };
            if info.name == name {
                return self.open_raw(d, info);
            }
            names.push(info.name);
        }
        Err(Error::NoDevice {
            what: format!("RDMA device named {name}"),
            detail: format!(
                "the devices here are: {} (see ibv_devices)",
                names.join(", ")
            ),
        })
    }

    /// Opens the first device of the list.
    pub fn open_first(&self) -> Result<Arc<Context>> {
        let list = DeviceList::get(self.lib())?;
        let d = list
            .iter()
            .next()
            .expect("DeviceList::get refuses empty lists");
        // SAFETY: `d` is an entry of `list`, alive for this function.
        let info = unsafe { DeviceInfo::from_raw(self.lib(), d) };
        self.open_raw(d, info)
    }

    fn open_raw(&self, d: *mut sys::ibv_device, info: DeviceInfo) -> Result<Arc<Context>> {
        // SAFETY: `d` is an entry of the live list held by the caller.
        let raw = unsafe { result::open_device(self.lib(), d) }?;
        Ok(Arc::new(Context {
            lib: self.lib(),
            raw,
            info,
            owned: true,
            _pin: None,
        }))
    }
}

impl Context {
    /// A context librdmacm opened (`rdma_cm_id::verbs`), not closed on drop, kept open by a
    /// device list of librdmacm's (`rdma_get_devices`, given back with `rdma_free_devices`
    /// when the value goes): librdmacm closes the context of a hot-removed device once no list
    /// and no id refers to it, which the id the context came from cannot promise after it is
    /// dropped.
    ///
    /// Errors: [`Error::NoDevice`] when librdmacm no longer lists the context (its device was
    /// removed).
    ///
    /// # Safety
    ///
    /// `raw` must be a context librdmacm opened that is open now and stays open for the call
    /// (the id it came from is alive and bound to it).
    pub(in crate::rdma) unsafe fn borrowed(
        rdmacm: &'static sys::Rdmacm,
        raw: NonNull<sys::ibv_context>,
    ) -> Result<Arc<Context>> {
        let lib = result::ibverbs()?;
        // SAFETY: plain call; the list is given back by `CmDevices`' Drop.
        let (list, len) = unsafe { result::cm_get_devices(rdmacm) }?;
        let pin = CmDevices { lib: rdmacm, list };
        if !pin.contains(raw, len) {
            return Err(Error::NoDevice {
                what: "the RDMA device this rdma_cm id is bound to".into(),
                detail: "librdmacm no longer lists it (removed?): resolve the address again".into(),
            });
        }
        // SAFETY: `raw` is a live context (caller), so its device is a valid ibv_device.
        let dev = unsafe { raw.as_ref().device };
        Ok(Arc::new(Context {
            lib,
            raw,
            // SAFETY: the device of an open context, which the list keeps open.
            info: unsafe { DeviceInfo::from_raw(lib, dev) },
            owned: false,
            _pin: Some(pin),
        }))
    }
}

/// What `ibv_query_device` reports (the fields gpudirect uses).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceAttributes {
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID, host byte order.
    pub node_guid: u64,
    /// PCI vendor id (0x15b3: Mellanox/NVIDIA).
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Largest registrable memory region.
    pub max_mr_size: u64,
    /// Max QPs.
    pub max_qp: u32,
    /// Max outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Max scatter/gather entries per work request.
    pub max_sge: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max entries per CQ.
    pub max_cqe: u32,
    /// Max memory regions.
    pub max_mr: u32,
    /// Max outstanding RDMA reads/atomics a QP can be the target of.
    pub max_qp_rd_atom: u32,
    /// Max outstanding RDMA reads/atomics a QP can initiate.
    pub max_qp_init_rd_atom: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

/// A port's state (`enum ibv_port_state`); unknown values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum PortState {
    /// `IBV_PORT_NOP`.
    Nop,
    /// `IBV_PORT_DOWN`: no link.
    Down,
    /// `IBV_PORT_INIT`: link up, not yet configured by the subnet manager.
    Init,
    /// `IBV_PORT_ARMED`.
    Armed,
    /// `IBV_PORT_ACTIVE`: ready for traffic.
    Active,
    /// `IBV_PORT_ACTIVE_DEFER`.
    ActiveDefer,
    /// A value this crate does not know.
    Other(u32),
}

impl From<u32> for PortState {
    fn from(v: u32) -> Self {
        match v {
            sys::IBV_PORT_NOP => PortState::Nop,
            sys::IBV_PORT_DOWN => PortState::Down,
            sys::IBV_PORT_INIT => PortState::Init,
            sys::IBV_PORT_ARMED => PortState::Armed,
            sys::IBV_PORT_ACTIVE => PortState::Active,
            sys::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            v => PortState::Other(v),
        }
    }
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum LinkLayer {
    /// Not reported (old drivers: treat as InfiniBand).
    Unspecified,
    /// InfiniBand: addressed by LID, GRH optional.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, GRH mandatory.
    Ethernet,
    /// A value this crate does not know.
    Other(u8),
}

impl From<u8> for LinkLayer {
    fn from(v: u8) -> Self {
        match u32::from(v) {
            sys::IBV_LINK_LAYER_UNSPECIFIED => LinkLayer::Unspecified,
            sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
            sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            _ => LinkLayer::Other(v),
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkLayer::Unspecified => f.write_str("unspecified"),
            LinkLayer::InfiniBand => f.write_str("InfiniBand"),
            LinkLayer::Ethernet => f.write_str("Ethernet"),
            LinkLayer::Other(v) => write!(f, "link layer {v}"),
        }
    }
}

/// A path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128 << self.raw()
    }

    pub(in crate::rdma) fn raw(self) -> u32 {
        match self {
            Mtu::Mtu256 => sys::IBV_MTU_256,
            Mtu::Mtu512 => sys::IBV_MTU_512,
            Mtu::Mtu1024 => sys::IBV_MTU_1024,
            Mtu::Mtu2048 => sys::IBV_MTU_2048,
            Mtu::Mtu4096 => sys::IBV_MTU_4096,
        }
    }
}

impl TryFrom<u32> for Mtu {
    type Error = Error;
    fn try_from(v: u32) -> Result<Self> {
        Ok(match v {
            sys::IBV_MTU_256 => Mtu::Mtu256,
            sys::IBV_MTU_512 => Mtu::Mtu512,
            sys::IBV_MTU_1024 => Mtu::Mtu1024,
            sys::IBV_MTU_2048 => Mtu::Mtu2048,
            sys::IBV_MTU_4096 => Mtu::Mtu4096,
            v => {
                return Err(Error::InvalidArgument(format!(
                    "{v} is not an ibv_mtu value (1..=5)"
                )))
            }
        })
    }
}

/// What `ibv_query_port` reports (the fields gpudirect uses).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PortAttributes {
    /// The port number (1-based).
    pub port: u8,
    /// Port state; traffic needs [`PortState::Active`].
    pub state: PortState,
    /// Largest MTU the port supports (`None`: a value this crate does not know).
    pub max_mtu: Option<Mtu>,
    /// Active MTU.
    pub active_mtu: Option<Mtu>,
    /// GID table length.
    pub gid_tbl_len: u32,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active width (IB encoding).
    pub active_width: u8,
    /// Active speed (IB encoding).
    pub active_speed: u8,
}

/// A 16-byte GID, shown as an IPv6 address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zeros (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `::ffff:a.b.c.d`: the RoCE v2 GID of an IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10..12] == [0xff, 0xff]
    }

    pub(in crate::rdma) fn to_raw(self) -> sys::ibv_gid {
        sys::ibv_gid { raw: self.0 }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The type of a GID table entry (`enum ibv_gid_type`); unknown values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet L2).
    RoceV1,
    /// RoCE v2 (UDP/IP, port 4791): routable, the one to use.
    RoceV2,
    /// A value this crate does not know (`u32::MAX`: not reported).
    Other(u32),
}

impl From<u32> for GidType {
    fn from(v: u32) -> Self {
        match v {
            sys::IBV_GID_TYPE_IB => GidType::Ib,
            sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            v => GidType::Other(v),
        }
    }
}

/// One GID table entry (`struct ibv_gid_entry`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its index in the port's table (the `sgid_index` to connect with).
    pub index: u32,
    /// The port.
    pub port: u8,
    /// Its type.
    pub gid_type: GidType,
    /// The netdev's interface index (RoCE), 0 when none.
    pub ndev_ifindex: u32,
}

impl GidEntry {
    pub(in crate::rdma) fn from_raw(e: &sys::ibv_gid_entry) -> Self {
        GidEntry {
            // SAFETY: every bit pattern is a valid [u8; 16].
            gid: Gid(unsafe { e.gid.raw }),
            index: e.gid_index,
            port: e.port_num as u8,
            gid_type: GidType::from(e.gid_type),
            ndev_ifindex: e.ndev_ifindex,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: [u8; 16], t: GidType) -> GidEntry {
        GidEntry {
            gid: Gid(gid),
            index,
            port: 1,
            gid_type: t,
            ndev_ifindex: 2,
        }
    }

    #[test]
    fn roce_v2_ipv4_mapped_gid_is_preferred() {
        let link_local = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = 1;
            g
        };
        let v4: [u8; 16] = Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x0a4d, 0x0001]).octets();
        let table = vec![
            entry(0, link_local, GidType::RoceV1),
            entry(1, link_local, GidType::RoceV2),
            entry(2, v4, GidType::RoceV1),
            entry(3, v4, GidType::RoceV2),
        ];
        assert_eq!(select_roce_gid(&table).unwrap().index, 3);
        assert_eq!(select_roce_gid(&table[..3]).unwrap().index, 1);
        assert_eq!(select_roce_gid(&table[..1]).unwrap().index, 0);
        assert!(select_roce_gid(&[entry(0, [0; 16], GidType::RoceV2)]).is_none());
        assert_eq!(Gid(v4).to_string(), "::ffff:10.77.0.1");
        assert!(Gid(v4).is_ipv4_mapped());
        assert!(!Gid(link_local).is_ipv4_mapped());
    }

    #[test]
    fn mtu_and_enums_decode_without_transmute() {
        assert_eq!(Mtu::try_from(3).unwrap().bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert!(Mtu::try_from(9).is_err());
        assert_eq!(LinkLayer::from(2), LinkLayer::Ethernet);
        assert_eq!(LinkLayer::from(77), LinkLayer::Other(77));
        assert_eq!(PortState::from(4), PortState::Active);
        assert_eq!(PortState::from(42), PortState::Other(42));
        assert_eq!(GidType::from(2), GidType::RoceV2);
    }
}

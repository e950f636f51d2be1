//! GPU topology as CUDA and NVML see it: for every ordered device pair, whether and how the
//! two GPUs reach each other, printable as the familiar `nvidia-smi topo -m` matrix.
//!
//! CUDA answers `cuDeviceCanAccessPeer` and `cuDeviceGetP2PAttribute`; NVML (loaded at run time
//! through nvml-wrapper, never by parsing nvidia-smi) adds the link type, NVLink count and speed
//! and its P2P status. CUDA ordinals are matched to NVML devices by PCI bus ID, because the two
//! orders differ unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`. Without NVML the topology still works from
//! CUDA alone, with [`NvmlStatus::Unavailable`] saying why.

use std::fmt;
use std::sync::OnceLock;

use cudarc::driver::sys;
use serde::Serialize;

use crate::cuda::result as r;
use crate::error::Result;
use crate::path::Link;

/// How two GPUs are connected, in `nvidia-smi topo -m` terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
#[serde(rename_all = "snake_case")]
pub enum Connection {
    /// A bonded set of this many NVLinks (`NV#`).
    #[serde(rename = "nvlink")]
    NvLink(u32),
    /// Through at most one PCIe bridge (`PIX`).
    Pix,
    /// Through several PCIe bridges, not the host bridge (`PXB`).
    Pxb,
    /// Through a PCIe host bridge (`PHB`).
    Phb,
    /// Between PCIe host bridges within a NUMA node (`NODE`).
    Node,
    /// Across the interconnect between NUMA nodes (`SYS`).
    Sys,
    /// Not known (NVML unavailable or it did not answer).
    Unknown,
}

impl fmt::Display for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Connection::NvLink(n) => write!(f, "NV{n}"),
            Connection::Pix => f.write_str("PIX"),
            Connection::Pxb => f.write_str("PXB"),
            Connection::Phb => f.write_str("PHB"),
            Connection::Node => f.write_str("NODE"),
            Connection::Sys => f.write_str("SYS"),
            Connection::Unknown => f.write_str("?"),
        }
    }
}

/// One cell of `nvidia-smi topo -p2p r|w|n|a` (`nvmlDeviceGetP2PStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
#[serde(rename_all = "snake_case")]
pub enum P2pState {
    /// `OK`.
    Ok,
    /// `CNS`: chipset not supported.
    ChipsetNotSupported,
    /// `GNS`: GPU not supported.
    GpuNotSupported,
    /// `TNS`: topology not supported.
    TopologyNotSupported,
    /// `DR`: disabled by a registry key.
    DisabledByRegkey,
    /// `NS`: not supported.
    NotSupported,
    /// `U`: unknown.
    Unknown,
}

impl fmt::Display for P2pState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            P2pState::Ok => "OK",
            P2pState::ChipsetNotSupported => "CNS",
            P2pState::GpuNotSupported => "GNS",
            P2pState::TopologyNotSupported => "TNS",
            P2pState::DisabledByRegkey => "DR",
            P2pState::NotSupported => "NS",
            P2pState::Unknown => "U",
        })
    }
}

/// NVML's P2P status for one ordered pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NvmlP2p {
    /// `NVML_P2P_CAPS_INDEX_READ`.
    pub read: P2pState,
    /// `NVML_P2P_CAPS_INDEX_WRITE`.
    pub write: P2pState,
    /// `NVML_P2P_CAPS_INDEX_NVLINK`.
    pub nvlink: P2pState,
    /// `NVML_P2P_CAPS_INDEX_ATOMICS`.
    pub atomics: P2pState,
}

/// Whether NVML could be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmlStatus {
    /// NVML loaded and initialised.
    Available {
        /// `nvmlSystemGetDriverVersion`.
        driver_version: String,
    },
    /// NVML could not be used; the topology comes from CUDA alone.
    Unavailable {
        /// Why (library missing, init failed, ...), with the fix.
        reason: String,
    },
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// PCI bus ID as CUDA reports it (`cuDeviceGetPCIBusId`).
    pub pci_bus_id: String,
    /// NVML device index with the same PCI bus ID, when NVML is available.
    pub nvml_index: Option<u32>,
    /// NUMA node of the GPU's PCI device (sysfs `numa_node`); `None` when unknown or -1.
    pub numa_node: Option<i32>,
    /// CPUs close to the GPU (sysfs `local_cpulist`, e.g. `0-31`).
    pub cpu_affinity: Option<String>,
}

/// What CUDA and NVML say about one ordered device pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairInfo {
    /// The accessing device (CUDA ordinal).
    pub src: usize,
    /// The device whose memory is accessed.
    pub dst: usize,
    /// `cuDeviceCanAccessPeer(src, dst)`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is better).
    pub performance_rank: Option<i32>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: Option<bool>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: Option<bool>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED`.
    pub cuda_array_access: Option<bool>,
    /// The connection (NVML).
    pub connection: Connection,
    /// Per-link NVLink speed in GB/s (NVML's common link speed), when known.
    pub nvlink_gbps_per_link: Option<f64>,
    /// NVML's P2P status, when NVML is available.
    pub nvml_p2p: Option<NvmlP2p>,
}

impl PairInfo {
    /// The [`Link`] a direct copy between the pair runs over.
    pub fn link(&self) -> Link {
        match self.connection {
            Connection::NvLink(n) => Link::NvLink { links: n },
            Connection::Unknown => Link::Unknown,
            _ => Link::Pcie,
        }
    }

    /// The raw one-direction link rate in GB/s (NVLink count × per-link speed), when known.
    pub fn link_limit_gbps(&self) -> Option<f64> {
        match self.connection {
            Connection::NvLink(n) => self.nvlink_gbps_per_link.map(|s| s * n as f64),
            _ => None,
        }
    }
}

/// Every GPU and every ordered pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Topology {
    /// The GPUs, by CUDA ordinal.
    pub devices: Vec<GpuInfo>,
    /// Every ordered pair `(src, dst)` with `src != dst`.
    pub pairs: Vec<PairInfo>,
    /// Whether NVML contributed.
    pub nvml: NvmlStatus,
}

impl Topology {
    /// Probes CUDA (and NVML when present).
    ///
    /// Errors: [`crate::Error::LibraryUnavailable`] without libcuda, [`crate::Error::NoDevice`]
    /// without a GPU. A missing NVML is not an error: see [`Topology::nvml`].
    pub fn probe() -> Result<Topology> {
        let n = crate::cuda::device_count()?;
        let mut devices = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        for i in 0..n {
            let dev = r::device::get(i)?;
            handles.push(dev);
            let name = r::device::name(dev)?;
            let pci_bus_id = r::device::pci_bus_id(dev)?;
            let (numa_node, cpu_affinity) = sysfs_affinity(&pci_bus_id);
            devices.push(GpuInfo {
                ordinal: i,
                name,
                pci_bus_id,
                nvml_index: None,
                numa_node,
                cpu_affinity,
            });
        }
        let mut pairs = Vec::new();
        for i in 0..n {
            for j in 0..n {
                if i == j {
                    continue;
                }
                let (a, b) = (handles[i], handles[j]);
                let attr = |x: sys::CUdevice_P2PAttribute| r::device::p2p_attribute(x, a, b).ok();
                use sys::CUdevice_P2PAttribute as A;
                pairs.push(PairInfo {
                    src: i,
                    dst: j,
                    can_access_peer: r::device::can_access_peer(a, b)?,
                    performance_rank: attr(A::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK),
                    access_supported: attr(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)
                        .map(|v| v != 0),
                    native_atomics: attr(A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
                        .map(|v| v != 0),
                    cuda_array_access: attr(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_ACCESS_SUPPORTED)
                        .map(|v| v != 0),
                    connection: Connection::Unknown,
                    nvlink_gbps_per_link: None,
                    nvml_p2p: None,
                });
            }
        }
        let mut topo = Topology {
            devices,
            pairs,
            nvml: NvmlStatus::Unavailable {
                reason: String::new(),
            },
        };
        topo.nvml = nvml::fill(&mut topo);
        Ok(topo)
    }

    /// The pair `(src, dst)`, if both ordinals exist and differ.
    pub fn pair(&self, src: usize, dst: usize) -> Option<&PairInfo> {
        self.pairs.iter().find(|p| p.src == src && p.dst == dst)
    }
}

/// Whether NVML loads and initialises here (no CUDA needed): [`NvmlStatus::Unavailable`] says
/// why not, never a panic.
pub fn nvml_status() -> NvmlStatus {
    nvml::status()
}

/// The process-wide cached topology (probed once), for path reports and expectations.
pub(in crate::p2p) fn cached() -> Option<&'static Topology> {
    static TOPO: OnceLock<Option<Topology>> = OnceLock::new();
    TOPO.get_or_init(|| Topology::probe().ok()).as_ref()
}

/// The link between two devices as far as the cached topology knows.
pub(in crate::p2p) fn link_between(src: usize, dst: usize) -> Link {
    cached()
        .and_then(|t| t.pair(src, dst))
        .map_or(Link::Unknown, PairInfo::link)
}

pub use crate::cuda::device::parse_pci_bus_id;

/// NUMA node and `local_cpulist` of the GPU's PCI device, from sysfs.
fn sysfs_affinity(bus_id: &str) -> (Option<i32>, Option<String>) {
    let Some(dir) = crate::cuda::device::sysfs_dir(bus_id) else {
        return (None, None);
    };
    let numa = crate::cuda::device::sysfs_numa_node(bus_id).and_then(|n| i32::try_from(n).ok());
    let cpus = std::fs::read_to_string(format!("{dir}/local_cpulist"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    (numa, cpus)
}

mod nvml {
    use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    use nvml_wrapper::Nvml;

    use super::*;

    /// `NVML_NVLINK_MAX_LINKS` in nvml.h (12.x/13.x).
    const NVLINK_MAX_LINKS: u32 = 18;

    fn init() -> std::result::Result<Nvml, String> {
        // Driver-only installs ship libnvidia-ml.so.1 without the unversioned development link.
        let mut errors = Vec::new();
        for name in ["libnvidia-ml.so.1", "libnvidia-ml.so"] {
            match Nvml::builder().lib_path(std::ffi::OsStr::new(name)).init() {
                Ok(n) => return Ok(n),
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(format!(
            "NVML could not be initialised ({}): install the NVIDIA driver's libnvidia-ml or add its directory to LD_LIBRARY_PATH",
            errors.join("; ")
        ))
    }

    fn state(s: std::result::Result<P2pStatus, nvml_wrapper::error::NvmlError>) -> P2pState {
        match s {
            Ok(P2pStatus::Ok) => P2pState::Ok,
            Ok(P2pStatus::ChipsetNotSupported) => P2pState::ChipsetNotSupported,
            Ok(P2pStatus::GpuNotSupported) => P2pState::GpuNotSupported,
            Ok(P2pStatus::IohTopologyNotSupported) => P2pState::TopologyNotSupported,
            Ok(P2pStatus::DisabledByRegkey) => P2pState::DisabledByRegkey,
            Ok(P2pStatus::NotSupported) => P2pState::NotSupported,
            Ok(P2pStatus::Unknown) | Err(_) => P2pState::Unknown,
        }
    }

    pub(super) fn status() -> NvmlStatus {
        match init() {
            Ok(n) => NvmlStatus::Available {
                driver_version: n.sys_driver_version().unwrap_or_default(),
            },
            Err(reason) => NvmlStatus::Unavailable { reason },
        }
    }

    /// Fills NVML's view into `topo`; returns the NVML status.
    pub(super) fn fill(topo: &mut Topology) -> NvmlStatus {
        let nvml = match init() {
            Ok(n) => n,
            Err(reason) => return NvmlStatus::Unavailable { reason },
        };
        let driver_version = nvml.sys_driver_version().unwrap_or_default();
        let count = nvml.device_count().unwrap_or(0);
        // NVML index and PCI address of every NVML device.
        let mut nvml_pci = Vec::new();
        for idx in 0..count {
            if let Ok(d) = nvml.device_by_index(idx) {
                if let Ok(pci) = d.pci_info() {
                    nvml_pci.push((idx, parse_pci_bus_id(&pci.bus_id)));
                }
            }
        }
        for g in topo.devices.iter_mut() {
            let want = parse_pci_bus_id(&g.pci_bus_id);
            g.nvml_index = nvml_pci
                .iter()
                .find(|(_, p)| p.is_some() && *p == want)
                .map(|(i, _)| *i);
        }
        let gpu_pcis: Vec<Option<(u32, u32, u32, u32)>> =
            nvml_pci.iter().map(|(_, p)| *p).collect();
        // Remote PCI addresses of a device's active NVLinks.
        let remotes = |d: &nvml_wrapper::Device<'_>| -> Vec<Option<(u32, u32, u32, u32)>> {
            (0..NVLINK_MAX_LINKS)
                .map(|l| d.link_wrapper_for(l))
                .filter(|link| matches!(link.is_active(), Ok(true)))
                .map(|link| {
                    link.remote_pci_info()
                        .ok()
                        .and_then(|r| parse_pci_bus_id(&r.bus_id))
                })
                .collect()
        };
        let index_of = |ordinal: usize| topo.devices.get(ordinal).and_then(|g| g.nvml_index);
        let pci_of = |ordinal: usize| {
            topo.devices
                .get(ordinal)
                .and_then(|g| parse_pci_bus_id(&g.pci_bus_id))
        };
        let mut updates = Vec::new();
        for (k, p) in topo.pairs.iter().enumerate() {
            let (Some(ia), Some(ib)) = (index_of(p.src), index_of(p.dst)) else {
                continue;
            };
            let (Ok(da), Ok(db)) = (nvml.device_by_index(ia), nvml.device_by_index(ib)) else {
                continue;
            };
            let peer_pci = pci_of(p.dst);
            let (ra, rb) = (remotes(&da), remotes(&db));
            // Links straight to the peer GPU ...
            let direct = ra
                .iter()
                .filter(|r| peer_pci.is_some() && **r == peer_pci)
                .count();
            // ... or, on NVSwitch systems (HGX), links to a switch on both sides: nvidia-smi
            // shows NV# with the GPU's link count for every pair behind the switches.
            let via_switch = |rs: &[Option<(u32, u32, u32, u32)>]| {
                rs.iter()
                    .filter(|r| r.is_some() && !gpu_pcis.contains(r))
                    .count()
            };
            let (sa, sb) = (via_switch(&ra), via_switch(&rb));
            let nvlink_ok = matches!(
                da.p2p_status(&db, P2pCapabilitiesIndex::NvLink),
                Ok(nvml_wrapper::enum_wrappers::device::P2pStatus::Ok)
            );
            let links = if direct > 0 {
                direct as u32
            } else if sa > 0 && sb > 0 {
                sa.min(sb) as u32
            } else if nvlink_ok {
                // NVML says the pair talks over NVLink but no link's remote PCI address names
                // the peer: in virtual machines the links report the host's physical addresses
                // (or none). Share the active links among the GPUs NVML calls NVLink peers.
                let peers = (0..count)
                    .filter(|&j| j != ia)
                    .filter_map(|j| nvml.device_by_index(j).ok())
                    .filter(|dj| {
                        matches!(
                            da.p2p_status(dj, P2pCapabilitiesIndex::NvLink),
                            Ok(nvml_wrapper::enum_wrappers::device::P2pStatus::Ok)
                        )
                    })
                    .count()
                    .max(1);
                let active = (0..NVLINK_MAX_LINKS)
                    .filter(|&l| matches!(da.link_wrapper_for(l).is_active(), Ok(true)))
                    .count();
                // At least one link: NVML vouched for the NVLink path even if it hides the count.
                ((active / peers) as u32).max(1)
            } else {
                0
            };
            let connection = if links > 0 {
                Connection::NvLink(links)
            } else {
                match nvml
                    .device_by_index(ib)
                    .ok()
                    .map(|db2| da.topology_common_ancestor(db2))
                {
                    Some(Ok(TopologyLevel::Internal | TopologyLevel::Single)) => Connection::Pix,
                    Some(Ok(TopologyLevel::Multiple)) => Connection::Pxb,
                    Some(Ok(TopologyLevel::HostBridge)) => Connection::Phb,
                    Some(Ok(TopologyLevel::Node)) => Connection::Node,
                    Some(Ok(TopologyLevel::System)) => Connection::Sys,
                    _ => Connection::Unknown,
                }
            };
            let speed = if links > 0 {
                da.field_values_for(&[FieldId(
                    nvml_wrapper::sys_exports::field_id::NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON,
                )])
                .ok()
                .and_then(|mut v| v.pop())
                .and_then(|s| s.ok())
                .and_then(|s| s.value.ok())
                .map(|v| match v {
                    SampleValue::U32(x) => x as f64,
                    SampleValue::U64(x) => x as f64,
                    SampleValue::I64(x) => x as f64,
                    SampleValue::F64(x) => x,
                })
                .filter(|mbps| *mbps > 0.0)
                .map(|mbps| mbps / 1000.0)
            } else {
                None
            };
            let p2p = NvmlP2p {
                read: state(da.p2p_status(&db, P2pCapabilitiesIndex::Read)),
                write: state(da.p2p_status(&db, P2pCapabilitiesIndex::Write)),
                nvlink: state(da.p2p_status(&db, P2pCapabilitiesIndex::NvLink)),
                atomics: state(da.p2p_status(&db, P2pCapabilitiesIndex::Atomics)),
            };
            updates.push((k, connection, speed, p2p));
        }
        for (k, connection, speed, p2p) in updates {
            let p = &mut topo.pairs[k];
            p.connection = connection;
            p.nvlink_gbps_per_link = speed;
            p.nvml_p2p = Some(p2p);
        }
        NvmlStatus::Available { driver_version }
    }
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "?",
    }
}

impl fmt::Display for Topology {
    /// The `nvidia-smi topo -m` matrix, then one P2P status row per ordered pair.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.devices.len();
        write!(f, "{:<8}", "")?;
        for g in &self.devices {
            write!(f, "{:<8}", format!("GPU{}", g.ordinal))?;
        }
        writeln!(f, "{:<16}{:<14}", "CPU Affinity", "NUMA Affinity")?;
        for g in &self.devices {
            write!(f, "{:<8}", format!("GPU{}", g.ordinal))?;
            for j in 0..n {
                let cell = if j == g.ordinal {
                    " X".to_string()
                } else {
                    self.pair(g.ordinal, j)
                        .map_or_else(|| "?".to_string(), |p| p.connection.to_string())
                };
                write!(f, "{cell:<8}")?;
            }
            writeln!(
                f,
                "{:<16}{:<14}",
                g.cpu_affinity.as_deref().unwrap_or("N/A"),
                g.numa_node
                    .map_or_else(|| "N/A".to_string(), |x| x.to_string())
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "Legend: X = self, NV# = # bonded NVLinks, PIX/PXB/PHB/NODE/SYS = PCIe path, ? = unknown"
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<14}{:<8}{:<6}{:<9}{:<8}| NVML {:<6}{:<6}{:<7}{:<8}link",
            "P2P", "access", "rank", "atomics", "arrays", "read", "write", "nvlink", "atomics"
        )?;
        for p in &self.pairs {
            let (r, w, nl, a) = match &p.nvml_p2p {
                Some(s) => (
                    s.read.to_string(),
                    s.write.to_string(),
                    s.nvlink.to_string(),
                    s.atomics.to_string(),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            let limit = match (p.connection, p.nvlink_gbps_per_link) {
                (Connection::NvLink(k), Some(s)) => {
                    format!("{k} x {s:.3} GB/s = {:.1} GB/s", s * k as f64)
                }
                (c, _) => c.to_string(),
            };
            writeln!(
                f,
                "{:<14}{:<8}{:<6}{:<9}{:<8}|      {:<6}{:<6}{:<7}{:<8}{}",
                format!("GPU{} -> GPU{}", p.src, p.dst),
                if p.can_access_peer { "yes" } else { "no" },
                p.performance_rank
                    .map_or_else(|| "?".to_string(), |x| x.to_string()),
                yes_no(p.native_atomics),
                yes_no(p.cuda_array_access),
                r,
                w,
                nl,
                a,
                limit
            )?;
        }
        match &self.nvml {
            NvmlStatus::Available { driver_version } => {
                writeln!(f, "NVML: available (driver {driver_version})")
            }
            NvmlStatus::Unavailable { reason } => {
                writeln!(f, "NVML: unavailable, link types unknown: {reason}")
            }
        }
    }
}

//! The GDR probe: can a NIC on this machine read and write this machine's GPU memory, and if
//! not, why not. The doctor prints it ([`GdrProbe`]'s `Display`); programs read its fields.
//!
//! It collects, each piece independently and never panicking (a missing GPU, libibverbs or
//! sysfs only blanks its own part and adds a finding):
//! - the peer-memory client: `/sys/kernel/mm/memory_peers/nv_mem{,_nc}/version` and
//!   `/sys/module/nvidia_peermem/version` (the paths NCCL and UCX check);
//! - the NVIDIA kernel module's version and flavour (`/proc/driver/nvidia/version`: only the
//!   open flavour exports dma-bufs);
//! - per GPU: `GPU_DIRECT_RDMA_SUPPORTED`, `DMA_BUF_SUPPORTED`,
//!   `GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`, `GPU_DIRECT_RDMA_WRITES_ORDERING`,
//!   `GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` and its PCI address;
//! - RDMA devices, their ports' state and link layer (sysfs `/sys/class/infiniband`);
//! - each GPU↔NIC PCIe distance (PIX/PXB/PHB/NODE/SYS, from the sysfs device paths and NUMA
//!   nodes) and an NCCL-like decision: GDR is allowed up to [`GdrLevel`] (default PXB, as
//!   NCCL's `NCCL_NET_GDR_LEVEL`), overridable with `GPUDIRECT_GDR_LEVEL`.

use std::fmt;
use std::path::Path;

use serde::Serialize;

use super::flush::{FlushOptions, WritesOrdering};
use crate::cuda;

/// Environment variable that overrides the largest GPU↔NIC distance GDR is used at.
pub const GDR_LEVEL_ENV: &str = "GPUDIRECT_GDR_LEVEL";

// ---------------------------------------------------------------------------------------------
// PCIe distance
// ---------------------------------------------------------------------------------------------

/// How far apart two PCI devices are, in nvidia-smi / NCCL terms (ordered: nearer is smaller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PciDistance {
    /// The same device (only meaningful as a level: allow nothing but local).
    Loc,
    /// At most one PCIe switch between them.
    Pix,
    /// Several PCIe switches, without crossing the host bridge.
    Pxb,
    /// Through the PCIe host bridge (the CPU's root complex).
    Phb,
    /// Between host bridges of one NUMA node.
    Node,
    /// Across NUMA nodes (the inter-socket link).
    Sys,
}

impl PciDistance {
    /// Parses `LOC|PIX|PXB|PHB|NODE|SYS` (any case) or NCCL's legacy integers 0–4
    /// (LOC, PIX, PXB, PHB, SYS).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "LOC" | "0" => Some(PciDistance::Loc),
            "PIX" | "1" => Some(PciDistance::Pix),
            "PXB" | "2" => Some(PciDistance::Pxb),
            "PHB" | "3" => Some(PciDistance::Phb),
            "NODE" => Some(PciDistance::Node),
            "SYS" | "4" => Some(PciDistance::Sys),
            _ => None,
        }
    }

    /// The short name (`PIX`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            PciDistance::Loc => "LOC",
            PciDistance::Pix => "PIX",
            PciDistance::Pxb => "PXB",
            PciDistance::Phb => "PHB",
            PciDistance::Node => "NODE",
            PciDistance::Sys => "SYS",
        }
    }
}

impl fmt::Display for PciDistance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The largest GPU↔NIC distance at which GDR is used, and where that choice came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GdrLevel {
    /// The level.
    pub level: PciDistance,
    /// `"default"` or `"GPUDIRECT_GDR_LEVEL=<value>"`.
    pub source: String,
}

impl GdrLevel {
    /// NCCL's default: PXB (GDR only when GPU and NIC share a PCIe switch hierarchy).
    pub const DEFAULT: PciDistance = PciDistance::Pxb;

    /// The level from `GPUDIRECT_GDR_LEVEL` (read once per process), or the default. Errors:
    /// [`Error::InvalidEnvironment`](crate::Error::InvalidEnvironment) for a value that is not
    /// a level.
    pub fn from_env() -> crate::Result<Self> {
        Self::from_value(crate::env::Env::process().raw(GDR_LEVEL_ENV))
    }

    fn from_value(v: Option<&str>) -> crate::Result<Self> {
        match v {
            None => Ok(GdrLevel {
                level: Self::DEFAULT,
                source: "default".into(),
            }),
            Some(v) => match PciDistance::parse(v) {
                Some(level) => Ok(GdrLevel {
                    level,
                    source: format!("{GDR_LEVEL_ENV}={v}"),
                }),
                None => Err(crate::env::invalid(
                    GDR_LEVEL_ENV,
                    v,
                    "LOC, PIX, PXB, PHB, NODE or SYS (or 0 to 4)",
                )),
            },
        }
    }
}

/// The distance between two PCI devices from their sysfs device paths (realpaths under
/// `/sys/devices`, e.g. `/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`) and NUMA nodes.
///
/// Different root complexes: NODE on the same (or an unknown) NUMA node, else SYS. Same root
/// complex: PHB when they meet only at the host bridge, PIX when each is at most two levels
/// (a switch's upstream and downstream port) below the deepest common bridge, else PXB.
pub fn pci_distance(a: &str, a_numa: Option<i32>, b: &str, b_numa: Option<i32>) -> PciDistance {
    fn chain(p: &str) -> (Option<&str>, Vec<&str>) {
        let mut parts = p.split('/').filter(|s| !s.is_empty());
        let root = parts.by_ref().find(|s| s.starts_with("pci"));
        (root, parts.collect())
    }
    let (ra, ca) = chain(a);
    let (rb, cb) = chain(b);
    if ra.is_none() || ra != rb {
        return if a_numa == b_numa {
            PciDistance::Node
        } else {
            PciDistance::Sys
        };
    }
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return PciDistance::Phb;
    }
    let (da, db) = (ca.len() - common, cb.len() - common);
    if da <= 2 && db <= 2 {
        PciDistance::Pix
    } else {
        PciDistance::Pxb
    }
}

// ---------------------------------------------------------------------------------------------
// Probe data
// ---------------------------------------------------------------------------------------------

/// Peer-memory clients seen in sysfs (each field: the `version` file's content, if present).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PeerMemoryClient {
    /// `/sys/kernel/mm/memory_peers/nv_mem/version`.
    pub nv_mem: Option<String>,
    /// `/sys/kernel/mm/memory_peers/nv_mem_nc/version`.
    pub nv_mem_nc: Option<String>,
    /// `/sys/module/nvidia_peermem/version` (the in-driver client).
    pub nvidia_peermem: Option<String>,
    /// `/sys/module/nv_peer_mem/version` (the legacy Mellanox client).
    pub nv_peer_mem: Option<String>,
}

impl PeerMemoryClient {
    /// Reads the live sysfs.
    pub fn detect() -> Self {
        Self::detect_in(Path::new("/sys"))
    }

    /// Reads a sysfs tree rooted at `sys` (for tests).
    pub fn detect_in(sys: &Path) -> Self {
        let rd = |p: &str| {
            std::fs::read_to_string(sys.join(p))
                .ok()
                .map(|s| s.trim().to_string())
        };
        PeerMemoryClient {
            nv_mem: rd("kernel/mm/memory_peers/nv_mem/version"),
            nv_mem_nc: rd("kernel/mm/memory_peers/nv_mem_nc/version"),
            nvidia_peermem: rd("module/nvidia_peermem/version"),
            nv_peer_mem: rd("module/nv_peer_mem/version"),
        }
    }

    /// True when a client is registered with ib_core (what `ibv_reg_mr` on GPU memory needs);
    /// the module alone counts too, as NCCL ≥ 2.23 counts it.
    pub fn present(&self) -> bool {
        self.nv_mem.is_some()
            || self.nv_mem_nc.is_some()
            || self.nvidia_peermem.is_some()
            || self.nv_peer_mem.is_some()
    }
}

impl fmt::Display for PeerMemoryClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = |o: &Option<String>| o.clone().unwrap_or_else(|| "absent".into());
        write!(
            f,
            "nvidia_peermem={} nv_peer_mem={}, memory_peers: nv_mem={} nv_mem_nc={}",
            v(&self.nvidia_peermem),
            v(&self.nv_peer_mem),
            v(&self.nv_mem),
            v(&self.nv_mem_nc)
        )
    }
}

/// Which NVIDIA kernel module is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverFlavour {
    /// The open kernel module (dma-buf export works, R515+).
    Open,
    /// The proprietary kernel module (`DMA_BUF_SUPPORTED = 0`).
    Proprietary,
    /// `/proc/driver/nvidia/version` exists but names neither.
    Unknown,
}

/// The NVIDIA kernel driver, from `/proc/driver/nvidia/version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NvidiaDriver {
    /// The version, e.g. `580.159.04`.
    pub version: Option<String>,
    /// Open or proprietary.
    pub flavour: DriverFlavour,
}

impl NvidiaDriver {
    /// Parses the content of `/proc/driver/nvidia/version`.
    pub fn parse(text: &str) -> Self {
        let line = text
            .lines()
            .find(|l| l.contains("NVRM version"))
            .unwrap_or("");
        let flavour = if line.contains("Open Kernel Module") {
            DriverFlavour::Open
        } else if line.contains("Kernel Module") {
            DriverFlavour::Proprietary
        } else {
            DriverFlavour::Unknown
        };
        let version = line
            .split_whitespace()
            .find(|t| {
                t.contains('.')
                    && t.split('.').count() >= 2
                    && t.split('.')
                        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(str::to_string);
        NvidiaDriver { version, flavour }
    }
}

/// What one GPU says about GPUDirect RDMA. Attribute fields are `None` when they could not be
/// read (then `error` says why).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuGdr {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: Option<String>,
    /// PCI address as sysfs spells it (`0000:3b:00.0`).
    pub pci_bus_id: Option<String>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gdr_supported: Option<i32>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf_supported: Option<i32>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub vmm_gdr_supported: Option<i32>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub writes_ordering: Option<WritesOrdering>,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`.
    pub flush_options: Option<FlushOptions>,
    /// The first error met while reading this GPU.
    pub error: Option<String>,
}

/// One port of an RDMA device (sysfs `ports/<n>/{state,link_layer}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaPort {
    /// Port number (from 1).
    pub port: u32,
    /// State, e.g. `ACTIVE` (sysfs `4: ACTIVE`).
    pub state: String,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaDeviceInfo {
    /// Name, e.g. `mlx5_0`, `rxe0`.
    pub name: String,
    /// Its ports.
    pub ports: Vec<RdmaPort>,
    /// PCI address (`None` for software devices: rxe, siw).
    pub pci_bus_id: Option<String>,
    /// sysfs device path (realpath), used for the distance.
    #[serde(skip)]
    pub sysfs_path: Option<String>,
    /// NUMA node of the PCI device.
    pub numa_node: Option<i32>,
    /// Whether the provider and kernel register dma-bufs (`ibv_reg_dmabuf_mr` with fd -1:
    /// EBADF means supported, EOPNOTSUPP/EPROTONOSUPPORT not, as NCCL and UCX probe it);
    /// `None` when libibverbs could not be asked.
    pub dmabuf_registration: Option<bool>,
    /// What that probe answered.
    pub dmabuf_detail: Option<String>,
}

/// Whether this kernel has RDMA at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RdmaStatus {
    /// No RDMA subsystem in this kernel (what `ibv_get_device_list` reports as ENOSYS).
    NoSubsystem {
        /// How that was determined.
        detail: String,
    },
    /// The subsystem is there, with no device.
    NoDevices,
    /// One or more devices.
    Devices,
}

/// A GPU↔NIC pair and whether GDR would be used between them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GdrPair {
    /// GPU ordinal.
    pub gpu: usize,
    /// RDMA device name.
    pub nic: String,
    /// The PCIe distance, when both sides are PCI devices with known paths.
    pub distance: Option<PciDistance>,
    /// True when GDR is allowed at this distance.
    pub allowed: bool,
    /// Why (one line, with the fix when refused).
    pub reason: String,
}

/// Everything the GDR probe found. Build with [`GdrProbe::run`]; print with `Display`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GdrProbe {
    /// Peer-memory clients.
    pub peer_memory: PeerMemoryClient,
    /// The NVIDIA kernel driver (`None`: no `/proc/driver/nvidia/version`).
    pub driver: Option<NvidiaDriver>,
    /// The CUDA driver API version, when libcuda loaded.
    pub cuda_driver_api: Option<i32>,
    /// Why CUDA could not be asked, when it could not.
    pub cuda_error: Option<String>,
    /// Per-GPU attributes.
    pub gpus: Vec<GpuGdr>,
    /// RDMA subsystem status.
    pub rdma: RdmaStatus,
    /// RDMA devices.
    pub rdma_devices: Vec<RdmaDeviceInfo>,
    /// What libibverbs says (`ibv_get_device_list`): a device count, or the typed error
    /// (ENOSYS: no RDMA subsystem; library absent).
    pub verbs: String,
    /// The distance limit in force.
    pub gdr_level: GdrLevel,
    /// Every GPU × NIC pair.
    pub pairs: Vec<GdrPair>,
    /// Conclusions, one line each, with what to do. Not serialized: they restate the fields
    /// above in prose, and the doctor's JSON states each fact once (as its own findings).
    #[serde(skip_serializing)]
    pub findings: Vec<String>,
}

impl GdrProbe {
    /// Probes the live machine (`/sys`, `/proc`, libcuda).
    pub fn run() -> Self {
        Self::run_in(Path::new("/sys"), Path::new("/proc"), true)
    }

    /// Probes with sysfs at `sys` and procfs at `proc`; `live = false` skips libcuda and
    /// libibverbs (for tests on fake trees).
    pub fn run_in(sys: &Path, proc: &Path, live: bool) -> Self {
        let mut findings = Vec::new();
        let peer_memory = PeerMemoryClient::detect_in(sys);
        let driver = std::fs::read_to_string(proc.join("driver/nvidia/version"))
            .ok()
            .map(|t| NvidiaDriver::parse(&t));

        let (cuda_driver_api, cuda_error, gpus) = if live {
            probe_gpus(sys)
        } else {
            (None, Some("not probed".into()), Vec::new())
        };
        let (mut rdma, mut rdma_devices) = probe_rdma(sys);
        let verbs = if live {
            probe_verbs(&mut rdma, &mut rdma_devices)
        } else {
            "not probed".to_string()
        };
        let gdr_level = GdrLevel::from_env().unwrap_or_else(|e| {
            // The probe reports, it does not fail: the bad value is a finding, and the pairs
            // below are judged at the default level.
            findings.push(e.to_string());
            GdrLevel {
                level: GdrLevel::DEFAULT,
                source: format!("default ({GDR_LEVEL_ENV} is invalid)"),
            }
        });

        let mut pairs = Vec::new();
        for g in &gpus {
            for n in &rdma_devices {
                pairs.push(decide_pair(sys, g, n, &gdr_level));
            }
        }

        // ---- findings ----
        if let Some(e) = &cuda_error {
            findings.push(format!("no GPU side: {e}"));
        }
        match &rdma {
            RdmaStatus::NoSubsystem { detail } => findings.push(format!(
                "kernel has no RDMA subsystem ({detail}): GPUDirect RDMA cannot be used here; load ib_core/ib_uverbs and a NIC driver, or rdma_rxe for software RDMA"
            )),
            RdmaStatus::NoDevices => findings.push(
                "no RDMA device (/sys/class/infiniband is empty): GPUDirect RDMA cannot be used here; load the NIC's driver (mlx5_ib, ...) or create a Soft-RoCE device with `rdma link add rxe0 type rxe netdev <if>`".into(),
            ),
            RdmaStatus::Devices => {}
        }
        if let Some(d) = &driver {
            if d.flavour == DriverFlavour::Proprietary {
                findings.push("the proprietary NVIDIA kernel module cannot export dma-bufs: install the open flavour (R515+) for the dma-buf path".into());
            }
        }
        if peer_memory.nvidia_peermem.is_some()
            && peer_memory.nv_mem.is_none()
            && peer_memory.nv_mem_nc.is_none()
        {
            findings.push("nvidia_peermem is loaded but registered no memory_peers client (NCCL #1939): ibv_reg_mr on GPU memory may still fail with EFAULT".into());
        }
        let any_dmabuf_gpu = gpus.iter().any(|g| g.dma_buf_supported == Some(1));
        if !gpus.is_empty() {
            if any_dmabuf_gpu {
                findings.push("dma-buf export: supported by the GPU driver (the NIC's provider must also implement ibv_reg_dmabuf_mr)".into());
            } else {
                findings.push(
                    "dma-buf export: not supported by any GPU here (DMA_BUF_SUPPORTED=0)".into(),
                );
            }
            if !peer_memory.present() {
                findings.push(format!(
                    "peer-memory client absent: ibv_reg_mr on GPU memory would fail with EFAULT; {}",
                    if any_dmabuf_gpu {
                        "only the dma-buf path can work"
                    } else {
                        "load nvidia_peermem (needs MOFED peer-memory symbols) or use the open kernel module for dma-buf"
                    }
                ));
            }
        }
        for n in &rdma_devices {
            if n.pci_bus_id.is_none() {
                findings.push(format!(
                    "{} is a software RDMA device (no PCI function): it moves host memory only; GPU memory registration goes through the same calls and is refused by its provider",
                    n.name
                ));
            }
        }

        GdrProbe {
            peer_memory,
            driver,
            cuda_driver_api,
            cuda_error,
            gpus,
            rdma,
            rdma_devices,
            verbs,
            gdr_level,
            pairs,
            findings,
        }
    }
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn realpath(p: &Path) -> Option<String> {
    std::fs::canonicalize(p)
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

fn probe_gpus(_sys: &Path) -> (Option<i32>, Option<String>, Vec<GpuGdr>) {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let api = match cuda::driver_version() {
        Ok(v) => v,
        Err(e) => return (None, Some(e.to_string()), Vec::new()),
    };
    let n = match cuda::device_count() {
        Ok(n) => n,
        Err(e) => return (Some(api), Some(e.to_string()), Vec::new()),
    };
    let mut gpus = Vec::new();
    for ordinal in 0..n {
        let mut error = None;
        let mut attr = |a: A| match cuda::device_attribute(ordinal, a) {
            Ok(v) => Some(v),
            Err(e) => {
                error.get_or_insert_with(|| e.to_string());
                None
            }
        };
        let gdr_supported = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
        let dma_buf_supported = attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED);
        let vmm_gdr_supported =
            attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED);
        let writes_ordering =
            attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING).map(WritesOrdering);
        let flush_options =
            attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS).map(FlushOptions);
        let dev = cuda::result::device::get(ordinal).ok();
        let name = dev.and_then(|d| cuda::result::device::name(d).ok());
        let pci_bus_id = cuda::device::sysfs_bus_id(ordinal).ok();
        gpus.push(GpuGdr {
            ordinal,
            name,
            pci_bus_id,
            gdr_supported,
            dma_buf_supported,
            vmm_gdr_supported,
            writes_ordering,
            flush_options,
            error,
        });
    }
    (Some(api), None, gpus)
}

fn probe_rdma(sys: &Path) -> (RdmaStatus, Vec<RdmaDeviceInfo>) {
    let class = sys.join("class/infiniband");
    let entries = match std::fs::read_dir(&class) {
        Ok(e) => e,
        Err(e) => {
            return (
                RdmaStatus::NoSubsystem {
                    detail: format!("{}: {e}", class.display()),
                },
                Vec::new(),
            )
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let devices: Vec<RdmaDeviceInfo> = names
        .into_iter()
        .map(|name| {
            let dir = class.join(&name);
            let mut ports = Vec::new();
            if let Ok(rd) = std::fs::read_dir(dir.join("ports")) {
                let mut nums: Vec<u32> = rd
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect();
                nums.sort_unstable();
                for port in nums {
                    let pd = dir.join("ports").join(port.to_string());
                    let state = read_trim(&pd.join("state")).unwrap_or_default();
                    // "4: ACTIVE" -> "ACTIVE"
                    let state = state
                        .split_once(':')
                        .map(|(_, s)| s.trim().to_string())
                        .unwrap_or(state);
                    ports.push(RdmaPort {
                        port,
                        state,
                        link_layer: read_trim(&pd.join("link_layer")).unwrap_or_default(),
                    });
                }
            }
            let sysfs_path = realpath(&dir.join("device"))
                .filter(|p| p.split('/').any(|c| c.starts_with("pci")));
            let pci_bus_id = sysfs_path
                .as_deref()
                .and_then(|p| p.rsplit('/').next())
                .map(str::to_string);
            let numa_node = sysfs_path
                .as_deref()
                .and_then(|p| read_trim(&Path::new(p).join("numa_node")))
                .and_then(|s| s.parse().ok())
                .filter(|n: &i32| *n >= 0);
            RdmaDeviceInfo {
                name,
                ports,
                pci_bus_id,
                sysfs_path,
                numa_node,
                dmabuf_registration: None,
                dmabuf_detail: None,
            }
        })
        .collect();
    let status = if devices.is_empty() {
        RdmaStatus::NoDevices
    } else {
        RdmaStatus::Devices
    };
    (status, devices)
}

/// Asks libibverbs: the device list (ENOSYS → no RDMA subsystem) and, per device, whether
/// dma-buf registration is implemented.
fn probe_verbs(rdma: &mut RdmaStatus, devices: &mut [RdmaDeviceInfo]) -> String {
    use crate::error::Error;
    let list = match super::devices() {
        Ok(l) => l,
        Err(Error::NoRdmaSubsystem { source }) => {
            if !matches!(rdma, RdmaStatus::NoSubsystem { .. }) {
                *rdma = RdmaStatus::NoSubsystem {
                    detail: format!("ibv_get_device_list: {source}"),
                };
            }
            return format!("ibv_get_device_list: {source} (kernel has no RDMA subsystem)");
        }
        Err(e) => return e.to_string(),
    };
    for d in devices.iter_mut() {
        if !list.iter().any(|i| i.name == d.name) {
            continue;
        }
        let (ok, detail) = match dmabuf_mr_support(&d.name) {
            Ok((ok, detail)) => (Some(ok), detail),
            Err(e) => (None, e.to_string()),
        };
        d.dmabuf_registration = ok;
        d.dmabuf_detail = Some(detail);
    }
    format!("libibverbs: {} device(s)", list.len())
}

fn dmabuf_mr_support(name: &str) -> crate::Result<(bool, String)> {
    use crate::error::Error;
    let ctx = super::Context::open(name)?;
    let pd = super::ProtectionDomain::new(&ctx)?;
    // SAFETY: fd -1 is never an open file: the provider refuses the call before any memory is
    // touched (EOPNOTSUPP when it has no dma-buf support, else EBADF from the kernel's
    // dma_buf_get); were it ever accepted, the region would be deregistered at once.
    let r = unsafe { pd.register_dmabuf_raw(0, 4096, 0, -1, super::AccessFlags::LOCAL_WRITE) };
    Ok(match r {
        Ok(_mr) => (
            true,
            "ibv_reg_dmabuf_mr(fd=-1) was accepted (unexpected)".into(),
        ),
        Err(Error::Unsupported { cause, .. }) => (false, cause.to_string()),
        Err(Error::Verbs { source, .. }) if source.raw_os_error() == Some(libc::EBADF) => (
            true,
            "ibv_reg_dmabuf_mr(fd=-1) → EBADF: the provider and kernel implement dma-buf".into(),
        ),
        Err(Error::SymbolUnavailable { .. }) => (
            false,
            "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)".into(),
        ),
        Err(e) => (false, format!("ibv_reg_dmabuf_mr(fd=-1): {e}")),
    })
}

fn decide_pair(sys: &Path, g: &GpuGdr, n: &RdmaDeviceInfo, level: &GdrLevel) -> GdrPair {
    let refuse = |distance, reason: String| GdrPair {
        gpu: g.ordinal,
        nic: n.name.clone(),
        distance,
        allowed: false,
        reason,
    };
    if g.gdr_supported == Some(0) {
        return refuse(
            None,
            format!("GPU {} reports GPU_DIRECT_RDMA_SUPPORTED=0", g.ordinal),
        );
    }
    let Some(nic_path) = &n.sysfs_path else {
        return refuse(
            None,
            format!(
                "{} is not a PCI device (software RDMA): a NIC must DMA into the GPU",
                n.name
            ),
        );
    };
    let gpu_path = g
        .pci_bus_id
        .as_deref()
        .and_then(|b| realpath(&sys.join("bus/pci/devices").join(b)));
    let Some(gpu_path) = gpu_path else {
        return refuse(
            None,
            format!(
                "GPU {}'s PCI device is not in sysfs: distance unknown",
                g.ordinal
            ),
        );
    };
    let gpu_numa = read_trim(&Path::new(&gpu_path).join("numa_node"))
        .and_then(|s| s.parse().ok())
        .filter(|n: &i32| *n >= 0);
    let d = pci_distance(&gpu_path, gpu_numa, nic_path, n.numa_node);
    if d <= level.level {
        GdrPair {
            gpu: g.ordinal,
            nic: n.name.clone(),
            distance: Some(d),
            allowed: true,
            reason: format!("distance {d} within {} ({})", level.level, level.source),
        }
    } else {
        refuse(
            Some(d),
            format!(
                "distance {d} beyond {} ({}); override with {GDR_LEVEL_ENV}={d} or pick a closer NIC",
                level.level, level.source
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn distance_follows_nvidia_smi_terms() {
        let rp = "/sys/devices/pci0000:00/0000:00:01.0";
        // same switch: root port / USP / DSP / device
        let gpu = format!("{rp}/0000:01:00.0/0000:02:00.0/0000:03:00.0");
        let nic = format!("{rp}/0000:01:00.0/0000:02:04.0/0000:04:00.0");
        assert_eq!(pci_distance(&gpu, Some(0), &nic, Some(0)), PciDistance::Pix);
        // two switch levels on the GPU side
        let deep = format!("{rp}/0000:01:00.0/0000:02:08.0/0000:05:00.0/0000:06:00.0/0000:07:00.0");
        assert_eq!(
            pci_distance(&deep, Some(0), &nic, Some(0)),
            PciDistance::Pxb
        );
        // different root ports of one host bridge
        let other_rp = "/sys/devices/pci0000:00/0000:00:02.0/0000:08:00.0";
        assert_eq!(
            pci_distance(&gpu, Some(0), other_rp, Some(0)),
            PciDistance::Phb
        );
        // different host bridges, same / different NUMA node
        let other_root = "/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0";
        assert_eq!(
            pci_distance(&gpu, Some(0), other_root, Some(0)),
            PciDistance::Node
        );
        assert_eq!(
            pci_distance(&gpu, None, other_root, None),
            PciDistance::Node
        );
        assert_eq!(
            pci_distance(&gpu, Some(0), other_root, Some(1)),
            PciDistance::Sys
        );
        assert!(PciDistance::Pix < PciDistance::Pxb && PciDistance::Phb < PciDistance::Sys);
    }

    #[test]
    fn gdr_level_parses_names_and_legacy_integers() {
        let level = |v| GdrLevel::from_value(v).unwrap().level;
        assert_eq!(level(None), PciDistance::Pxb);
        assert_eq!(level(Some("sys")), PciDistance::Sys);
        assert_eq!(level(Some("PHB")), PciDistance::Phb);
        assert_eq!(level(Some("1")), PciDistance::Pix);
        assert_eq!(level(Some("4")), PciDistance::Sys);
        match GdrLevel::from_value(Some("far")) {
            Err(e @ crate::Error::InvalidEnvironment { variable, .. }) => {
                assert_eq!(variable, GDR_LEVEL_ENV);
                assert!(e.to_string().contains("PXB"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn driver_flavour_from_proc_text() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct 2 2025\nGCC version:  gcc version 12.3.0\n";
        let d = NvidiaDriver::parse(open);
        assert_eq!(d.flavour, DriverFlavour::Open);
        assert_eq!(d.version.as_deref(), Some("580.159.04"));
        let prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n";
        let d = NvidiaDriver::parse(prop);
        assert_eq!(d.flavour, DriverFlavour::Proprietary);
        assert_eq!(d.version.as_deref(), Some("535.104.05"));
        assert_eq!(NvidiaDriver::parse("").flavour, DriverFlavour::Unknown);
    }

    /// A fake sysfs: a GPU and a NIC under one switch, rxe0 without a PCI device, peermem absent.
    #[test]
    fn probe_on_a_fake_sysfs_tree() {
        let t = tempfile::tempdir().unwrap();
        let sys = t.path().join("sys");
        let proc_ = t.path().join("proc");
        let rp = sys.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let gpu = rp.join("0000:02:00.0/0000:03:00.0");
        let nic = rp.join("0000:02:04.0/0000:04:00.0");
        for d in [&gpu, &nic] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("numa_node"), "0\n").unwrap();
        }
        std::fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
        symlink(&gpu, sys.join("bus/pci/devices/0000:03:00.0")).unwrap();
        for (name, dev) in [("mlx5_0", Some(&nic)), ("rxe0", None)] {
            let p = sys.join("class/infiniband").join(name).join("ports/1");
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("state"), "4: ACTIVE\n").unwrap();
            std::fs::write(p.join("link_layer"), "Ethernet\n").unwrap();
            if let Some(dev) = dev {
                symlink(dev, sys.join("class/infiniband").join(name).join("device")).unwrap();
            }
        }
        std::fs::create_dir_all(sys.join("module/nvidia_peermem")).unwrap();
        std::fs::write(sys.join("module/nvidia_peermem/version"), "580.159.04\n").unwrap();
        std::fs::create_dir_all(proc_.join("driver/nvidia")).unwrap();
        std::fs::write(
            proc_.join("driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n",
        )
        .unwrap();

        let mut p = GdrProbe::run_in(&sys, &proc_, false);
        assert_eq!(p.rdma, RdmaStatus::Devices);
        assert_eq!(p.rdma_devices.len(), 2);
        let mlx = &p.rdma_devices[0];
        assert_eq!(mlx.name, "mlx5_0");
        assert_eq!(mlx.pci_bus_id.as_deref(), Some("0000:04:00.0"));
        assert_eq!(mlx.numa_node, Some(0));
        assert_eq!(mlx.ports[0].state, "ACTIVE");
        assert_eq!(p.rdma_devices[1].pci_bus_id, None);
        assert!(p.peer_memory.present());
        assert_eq!(p.driver.as_ref().unwrap().flavour, DriverFlavour::Open);
        assert!(
            p.findings
                .iter()
                .any(|f| f.contains("registered no memory_peers")),
            "{:?}",
            p.findings
        );

        // the pair decision, with a GPU filled in by hand (no CUDA here)
        let g = GpuGdr {
            ordinal: 0,
            name: Some("fake".into()),
            pci_bus_id: Some("0000:03:00.0".into()),
            gdr_supported: Some(1),
            dma_buf_supported: Some(1),
            vmm_gdr_supported: Some(1),
            writes_ordering: Some(WritesOrdering::OWNER),
            flush_options: Some(FlushOptions(1)),
            error: None,
        };
        let pxb = GdrLevel::from_value(None).unwrap();
        let pair = decide_pair(&sys, &g, &p.rdma_devices[0], &pxb);
        assert_eq!(pair.distance, Some(PciDistance::Pix));
        assert!(pair.allowed, "{pair:?}");
        let loc = GdrLevel::from_value(Some("LOC")).unwrap();
        let pair = decide_pair(&sys, &g, &p.rdma_devices[0], &loc);
        assert!(
            !pair.allowed && pair.reason.contains("GPUDIRECT_GDR_LEVEL=PIX"),
            "{pair:?}"
        );
        let soft = decide_pair(&sys, &g, &p.rdma_devices[1], &pxb);
        assert!(
            !soft.allowed && soft.reason.contains("software"),
            "{soft:?}"
        );
        p.gpus.push(g);
        p.pairs.push(pair);
        let text = p.to_string();
        assert!(
            text.contains(
                "GDR: GPU0 fake pci=0000:03:00.0 GPU_DIRECT_RDMA_SUPPORTED=1 DMA_BUF_SUPPORTED=1"
            ),
            "{text}"
        );
        assert!(
            text.contains("GDR: RDMA device mlx5_0 pci=0000:04:00.0 numa=0 port1 ACTIVE Ethernet"),
            "{text}"
        );
        assert!(text.contains("flavour=open"), "{text}");
        serde_json::to_string(&p).unwrap();
    }

    /// This machine's RDMA state, as `.ci/run` tells it: GPUDIRECT_EXPECT_VERBS=absent|enosys
    /// (default: CI and the dev machine have no RDMA subsystem) | nodevice | present. The probe
    /// reads sysfs, so libibverbs' presence does not matter here. Never panics.
    #[test]
    fn probe_live_machine_matches_expectation() {
        let p = GdrProbe::run();
        let text = p.to_string();
        assert!(text.contains("GDR: peer-memory client:"), "{text}");
        let expect = std::env::var("GPUDIRECT_EXPECT_VERBS").unwrap_or_else(|_| "absent".into());
        match expect.as_str() {
            "absent" | "enosys" => assert!(
                matches!(
                    p.rdma,
                    RdmaStatus::NoSubsystem { .. } | RdmaStatus::NoDevices
                ),
                "{text}"
            ),
            "nodevice" => assert_eq!(p.rdma, RdmaStatus::NoDevices, "{text}"),
            "present" => assert_eq!(p.rdma, RdmaStatus::Devices, "{text}"),
            other => {
                panic!("GPUDIRECT_EXPECT_VERBS must be absent|enosys|nodevice|present, not {other}")
            }
        }
        if std::env::var("GPUDIRECT_EXPECT_CUDA").unwrap_or_else(|_| "absent".into()) == "absent" {
            assert!(p.gpus.is_empty() && p.cuda_error.is_some(), "{text}");
        }
    }
}

//! The doctor's GDR section: the GDR probe's findings per GPU and per GPU↔NIC pair.

use std::fmt;

use super::{Report, Section, Status};
use crate::rdma::{DriverFlavour, GdrLevel, GdrProbe, RdmaStatus};
use crate::Cause;

impl Report {
    /// Runs the [`GdrProbe`] (never fails: each missing piece becomes a finding). The findings
    /// come from the probe's data, not from its prose conclusions ([`GdrProbe::findings`]), so
    /// nothing the CUDA or RDMA-device findings already say is said again, and nothing is
    /// claimed that the probe did not try (it registers no GPU memory).
    pub fn check_gdr(&mut self) {
        let probe = GdrProbe::run();
        let s = Section::Gdr;
        let pm = &probe.peer_memory;
        if pm.nvidia_peermem.is_some() && pm.nv_mem.is_none() && pm.nv_mem_nc.is_none() {
            self.push(
                s,
                "peer-memory client",
                Status::Absent,
                format!("{pm}: nvidia_peermem is loaded but registered no memory_peers client (NCCL #1939)"),
                Some(Cause::NoPeerMemoryClient.fix()),
            );
        } else if pm.present() {
            self.push(s, "peer-memory client", Status::Ok, pm.to_string(), None);
        } else {
            self.push(
                s,
                "peer-memory client",
                Status::Absent,
                format!(
                    "{}: neither nvidia_peermem, nv_peer_mem nor a memory_peers client is loaded, so only the dma-buf path can register GPU memory",
                    Cause::NoPeerMemoryClient.what()
                ),
                Some(Cause::NoPeerMemoryClient.fix()),
            );
        }
        if let Err(e) = GdrLevel::from_env() {
            self.push(
                s,
                "GPU-NIC distance limit",
                Status::Failed,
                e.to_string(),
                None,
            );
        }
        match &probe.driver {
            Some(d) => {
                let (status, detail, fix) = match d.flavour {
                    DriverFlavour::Open => (
                        Status::Ok,
                        "open flavour: can export GPU memory as dma-buf",
                        None,
                    ),
                    DriverFlavour::Proprietary => (
                        Status::Absent,
                        "proprietary flavour: cannot export dma-bufs",
                        Some(
                            "install NVIDIA's open kernel module (R515+) for the dma-buf path"
                                .to_string(),
                        ),
                    ),
                    DriverFlavour::Unknown => (Status::Ok, "flavour unknown", None),
                };
                self.push(
                    s,
                    "NVIDIA kernel module",
                    status,
                    format!(
                        "{} {detail}",
                        d.version.as_deref().unwrap_or("(version unreadable)")
                    ),
                    fix,
                );
            }
            None => self.push(
                s,
                "NVIDIA kernel module",
                Status::Absent,
                "no /proc/driver/nvidia/version",
                None,
            ),
        }
        let flag = |v: Option<i32>| match v {
            Some(1) => "yes".to_string(),
            Some(0) => "no".to_string(),
            Some(x) => x.to_string(),
            None => "?".to_string(),
        };
        for g in &probe.gpus {
            let supported = g.gdr_supported == Some(1) || g.dma_buf_supported == Some(1);
            self.push(
                s,
                format!("GPU{}", g.ordinal),
                if g.error.is_some() { Status::Failed } else if supported { Status::Ok } else { Status::Absent },
                format!(
                    "GPUDirect RDMA {}, dma-buf {}, VMM GDR {}, writes ordering {}, flush options {}{}",
                    flag(g.gdr_supported),
                    flag(g.dma_buf_supported),
                    flag(g.vmm_gdr_supported),
                    g.writes_ordering.map_or("?".into(), |w| w.to_string()),
                    g.flush_options.map_or("?".into(), |w| w.to_string()),
                    g.error.as_deref().map(|e| format!(" (error: {e})")).unwrap_or_default()
                ),
                None,
            );
        }
        match &probe.rdma {
            RdmaStatus::NoSubsystem { detail } => self.push(
                s,
                "RDMA devices",
                Status::Absent,
                format!("none: the kernel has no RDMA subsystem ({detail})"),
                Some("load ib_core/ib_uverbs and a NIC driver (or rdma_rxe for Soft-RoCE)".into()),
            ),
            RdmaStatus::NoDevices => self.push(
                s,
                "RDMA devices",
                Status::Absent,
                "none (/sys/class/infiniband is empty): no NIC can read or write GPU memory here",
                Some("install an RDMA NIC and its driver (mlx5_ib, ...)".into()),
            ),
            RdmaStatus::Devices => {
                for n in &probe.rdma_devices {
                    let ports: Vec<String> = n
                        .ports
                        .iter()
                        .map(|p| format!("port {} {} {}", p.port, p.state, p.link_layer))
                        .collect();
                    self.push(
                        s,
                        format!("RDMA device {}", n.name),
                        Status::Ok,
                        format!(
                            "pci {} numa {}; {}",
                            n.pci_bus_id
                                .as_deref()
                                .unwrap_or("none (a software device: it moves host memory only)"),
                            n.numa_node.map_or("?".into(), |v| v.to_string()),
                            ports.join(", ")
                        ),
                        None,
                    );
                }
            }
        }
        for p in &probe.pairs {
            let distance = p.distance.map_or("?".into(), |d| d.to_string());
            self.push(
                s,
                format!("GPU{} <-> {}", p.gpu, p.nic),
                if p.allowed {
                    Status::Direct
                } else {
                    Status::Fallback
                },
                format!(
                    "PCIe distance {distance}, limit {} ({}): GDR {}: {}",
                    probe.gdr_level.level,
                    probe.gdr_level.source,
                    if p.allowed {
                        "allowed"
                    } else {
                        "refused, transfers stage through host memory"
                    },
                    p.reason
                ),
                (!p.allowed).then(|| {
                    Cause::PcieDistance {
                        distance: distance.clone(),
                        allowed: probe.gdr_level.level.to_string(),
                    }
                    .fix()
                }),
            );
        }
        self.gdr = Some(probe);
    }
}

/// The probe as text, one fact per line (tests print it on failure); the doctor renders its
/// verdicts as findings ([`Report::check_gdr`]). Rendering lives here, in the doctor's room.
impl fmt::Display for GdrProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "GDR: peer-memory client: {}", self.peer_memory)?;
        match &self.driver {
            Some(d) => writeln!(
                f,
                "GDR: NVIDIA kernel module {} flavour={} (/proc/driver/nvidia/version)",
                d.version.as_deref().unwrap_or("(version unreadable)"),
                match d.flavour {
                    DriverFlavour::Open => "open",
                    DriverFlavour::Proprietary => "proprietary",
                    DriverFlavour::Unknown => "unknown",
                }
            )?,
            None => writeln!(
                f,
                "GDR: NVIDIA kernel module: absent (no /proc/driver/nvidia/version)"
            )?,
        }
        match (&self.cuda_driver_api, &self.cuda_error) {
            (Some(v), _) => writeln!(f, "GDR: CUDA driver API {}.{}", v / 1000, v % 1000 / 10)?,
            (None, Some(e)) => writeln!(f, "GDR: CUDA: {e}")?,
            (None, None) => {}
        }
        let o = |v: Option<i32>| v.map_or("?".to_string(), |v| v.to_string());
        for g in &self.gpus {
            writeln!(
                f,
                "GDR: GPU{} {} pci={} GPU_DIRECT_RDMA_SUPPORTED={} DMA_BUF_SUPPORTED={} VMM_GDR={} WRITES_ORDERING={} FLUSH_OPTIONS={}{}",
                g.ordinal,
                g.name.as_deref().unwrap_or("?"),
                g.pci_bus_id.as_deref().unwrap_or("?"),
                o(g.gdr_supported),
                o(g.dma_buf_supported),
                o(g.vmm_gdr_supported),
                g.writes_ordering.map_or("?".into(), |w| w.to_string()),
                g.flush_options.map_or("?".into(), |w| w.to_string()),
                g.error.as_deref().map(|e| format!(" (error: {e})")).unwrap_or_default()
            )?;
        }
        match &self.rdma {
            RdmaStatus::NoSubsystem { detail } => writeln!(
                f,
                "GDR: RDMA devices: none (kernel has no RDMA subsystem: {detail})"
            )?,
            RdmaStatus::NoDevices => writeln!(f, "GDR: RDMA devices: none")?,
            RdmaStatus::Devices => {
                for n in &self.rdma_devices {
                    let ports: Vec<String> = n
                        .ports
                        .iter()
                        .map(|p| format!("port{} {} {}", p.port, p.state, p.link_layer))
                        .collect();
                    writeln!(
                        f,
                        "GDR: RDMA device {} pci={} numa={} {}",
                        n.name,
                        n.pci_bus_id.as_deref().unwrap_or("none (software)"),
                        n.numa_node.map_or("?".into(), |v| v.to_string()),
                        ports.join(", ")
                    )?;
                    if let Some(d) = &n.dmabuf_detail {
                        writeln!(
                            f,
                            "GDR: {} dma-buf registration: {} ({d})",
                            n.name,
                            match n.dmabuf_registration {
                                Some(true) => "supported",
                                Some(false) => "unsupported",
                                None => "unknown",
                            }
                        )?;
                    }
                }
            }
        }
        writeln!(f, "GDR: verbs: {}", self.verbs)?;
        for p in &self.pairs {
            writeln!(
                f,
                "GDR: GPU{} <-> {} path={} -> GDR {}: {}",
                p.gpu,
                p.nic,
                p.distance.map_or("?".into(), |d| d.to_string()),
                if p.allowed { "allowed" } else { "refused" },
                p.reason
            )?;
        }
        writeln!(
            f,
            "GDR: level limit {} ({})",
            self.gdr_level.level, self.gdr_level.source
        )?;
        for x in &self.findings {
            writeln!(f, "GDR finding: {x}")?;
        }
        Ok(())
    }
}

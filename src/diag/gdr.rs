//! The doctor's GDR section: the GDR probe's findings per GPU and per GPU↔NIC pair.

use super::{Report, Section, Status};
use crate::rdma::probe::{DriverFlavour, GdrLevel, GdrProbe, RdmaStatus};
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

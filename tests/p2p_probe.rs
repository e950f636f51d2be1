//! Tier 1 (runs everywhere, CI included): P2P probing without a GPU returns typed errors per
//! `GPUDIRECT_EXPECT_CUDA` (absent|nodevice|present, default absent) and
//! `GPUDIRECT_EXPECT_NVML` (absent|present, default absent); Display/serde of a synthetic
//! topology; handle encodings; fd passing over a Unix socket.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use gpudirect::p2p::{
    ipc, nvml_status, parse_pci_bus_id, Connection, GpuInfo, NvmlP2p, NvmlStatus, P2pState,
    PairInfo, PeerAccess, Topology, VmmBuffer,
};
use gpudirect::Error;

fn expect_cuda() -> String {
    std::env::var("GPUDIRECT_EXPECT_CUDA").unwrap_or_else(|_| "absent".into())
}

#[test]
fn probing_matches_cuda_expectation() {
    let topo = Topology::probe();
    let pa = PeerAccess::between(0, 1);
    let rep = gpudirect::diag::p2p_report(&gpudirect::diag::P2pReportOptions::default());
    match expect_cuda().as_str() {
        "absent" => {
            assert!(
                matches!(topo, Err(Error::LibraryUnavailable { .. })),
                "{topo:?}"
            );
            assert!(
                matches!(pa, Err(Error::LibraryUnavailable { .. })),
                "{pa:?}"
            );
            assert!(
                matches!(rep, Err(Error::LibraryUnavailable { .. })),
                "{rep:?}"
            );
            let msg = topo.unwrap_err().to_string();
            assert!(msg.contains("libcuda"), "{msg}");
        }
        "nodevice" => {
            assert!(matches!(topo, Err(Error::NoDevice { .. })), "{topo:?}");
            assert!(matches!(pa, Err(Error::NoDevice { .. })), "{pa:?}");
            assert!(matches!(rep, Err(Error::NoDevice { .. })), "{rep:?}");
        }
        "present" => {
            let t = topo.expect("GPUDIRECT_EXPECT_CUDA=present but Topology::probe failed");
            assert!(!t.devices.is_empty());
            assert_eq!(t.pairs.len(), t.devices.len() * (t.devices.len() - 1));
            // A bad ordinal is a typed error, never a panic.
            let bad = PeerAccess::between(0, t.devices.len() + 7);
            assert!(matches!(bad, Err(Error::NoDevice { .. })), "{bad:?}");
        }
        other => panic!("GPUDIRECT_EXPECT_CUDA must be absent|present|nodevice, not {other}"),
    }
}

#[test]
fn nvml_probe_matches_expectation() {
    let expect = std::env::var("GPUDIRECT_EXPECT_NVML").unwrap_or_else(|_| "absent".into());
    let st = nvml_status();
    match expect.as_str() {
        "absent" => match st {
            NvmlStatus::Unavailable { reason } => {
                assert!(reason.contains("libnvidia-ml"), "{reason}");
                assert!(reason.contains("install the NVIDIA driver"), "{reason}");
            }
            other => {
                panic!("expected NVML unavailable (GPUDIRECT_EXPECT_NVML=absent), got {other:?}")
            }
        },
        "present" => assert!(matches!(st, NvmlStatus::Available { .. }), "{st:?}"),
        other => panic!("GPUDIRECT_EXPECT_NVML must be absent|present, not {other}"),
    }
}

fn synthetic() -> Topology {
    let gpu = |i: usize, bus: &str| GpuInfo {
        ordinal: i,
        name: "NVIDIA H200".into(),
        pci_bus_id: bus.into(),
        nvml_index: Some(i as u32),
        numa_node: Some(0),
        cpu_affinity: Some("0-31".into()),
    };
    let ok = NvmlP2p {
        read: P2pState::Ok,
        write: P2pState::Ok,
        nvlink: P2pState::Ok,
        atomics: P2pState::Ok,
    };
    let pair = |s, d, conn| PairInfo {
        src: s,
        dst: d,
        can_access_peer: true,
        performance_rank: Some(0),
        access_supported: Some(true),
        native_atomics: Some(true),
        cuda_array_access: Some(true),
        connection: conn,
        nvlink_gbps_per_link: Some(26.5625),
        nvml_p2p: Some(ok),
    };
    Topology {
        devices: vec![gpu(0, "0000:18:00.0"), gpu(1, "0000:2A:00.0")],
        pairs: vec![
            pair(0, 1, Connection::NvLink(18)),
            pair(1, 0, Connection::NvLink(18)),
        ],
        nvml: NvmlStatus::Available {
            driver_version: "580.159.04".into(),
        },
    }
}

#[test]
fn synthetic_topology_prints_like_nvidia_smi() {
    let t = synthetic();
    let s = t.to_string();
    let lines: Vec<&str> = s.lines().collect();
    assert!(
        lines[0].starts_with("        GPU0    GPU1    CPU Affinity"),
        "{s}"
    );
    assert!(lines[1].starts_with("GPU0     X      NV18    0-31"), "{s}");
    assert!(lines[2].starts_with("GPU1    NV18     X      0-31"), "{s}");
    assert!(
        s.contains("GPU0 -> GPU1  yes     0     yes      yes"),
        "{s}"
    );
    assert!(s.contains("OK    OK    OK     OK"), "{s}");
    assert!(s.contains("18 x 26.562 GB/s = 478.1 GB/s"), "{s}");
    assert!(s.contains("NVML: available (driver 580.159.04)"), "{s}");
    let p = t.pair(0, 1).unwrap();
    assert_eq!(p.link(), gpudirect::Link::NvLink { links: 18 });
    assert!((p.link_limit_gbps().unwrap() - 478.125).abs() < 1e-9);
    let json = serde_json::to_value(&t).unwrap();
    assert_eq!(json["pairs"][0]["connection"]["nvlink"], 18);
    assert_eq!(json["devices"][1]["pci_bus_id"], "0000:2A:00.0");

    let mut unknown = t.clone();
    unknown.pairs[0].connection = Connection::Unknown;
    unknown.pairs[0].nvml_p2p = None;
    unknown.nvml = NvmlStatus::Unavailable {
        reason: "NVML could not be initialised".into(),
    };
    let s = unknown.to_string();
    assert!(s.contains("GPU0     X      ?"), "{s}");
    assert!(s.contains("NVML: unavailable, link types unknown"), "{s}");
}

#[test]
fn pci_bus_ids_from_cuda_and_nvml_match() {
    assert_eq!(parse_pci_bus_id("0000:18:00.0"), Some((0, 0x18, 0, 0)));
    assert_eq!(
        parse_pci_bus_id("00000000:18:00.0"),
        parse_pci_bus_id("0000:18:00.0")
    );
    assert_eq!(parse_pci_bus_id("0001:AB:1f.3"), Some((1, 0xab, 0x1f, 3)));
    assert_eq!(parse_pci_bus_id("garbage"), None);
}

#[test]
fn ipc_handles_round_trip_and_reject_bad_lengths() {
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = (i * 37 + 11) as u8;
    }
    let h = ipc::IpcMemHandle {
        handle,
        len_bytes: 3 * (1 << 20) + 77,
    };
    assert_eq!(ipc::IpcMemHandle::from_bytes(&h.to_bytes()).unwrap(), h);
    let p = ipc::PoolPointer {
        data: handle,
        len_bytes: 12345,
    };
    assert_eq!(ipc::PoolPointer::from_bytes(&p.to_bytes()).unwrap(), p);
    let e = ipc::IpcMemHandle::from_bytes(&[0u8; 71]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
}

#[test]
fn fd_passing_over_a_unix_socket() {
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let mut file = tempfile::tempfile_in(&dir).unwrap();
    std::io::Write::write_all(&mut file, b"peer memory travels as an fd").unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    ipc::send_fd(&a, file.as_fd(), b"pool").unwrap();
    let mut buf = [0u8; 16];
    let (fd, n) = ipc::recv_fd(&b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"pool");
    let mut got = std::fs::File::from(fd);
    std::io::Seek::seek(&mut got, std::io::SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    got.read_to_string(&mut s).unwrap();
    assert_eq!(s, "peer memory travels as an fd");
    // A message without a descriptor is a typed error.
    std::io::Write::write_all(&mut &a, b"x").unwrap();
    let e = ipc::recv_fd(&b, &mut buf).unwrap_err();
    assert!(matches!(e, Error::Io { op: "recvmsg", .. }), "{e:?}");
    // An empty payload is refused before sending.
    assert!(matches!(
        ipc::send_fd(&a, file.as_fd(), b""),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn vmm_types_match_cuda_expectation() {
    let g = VmmBuffer::granularity(0);
    let buf = VmmBuffer::<u8>::alloc_zeros_on(0, 3 * (1 << 20) + 12345);
    match expect_cuda().as_str() {
        "absent" => {
            assert!(matches!(g, Err(Error::LibraryUnavailable { .. })), "{g:?}");
            assert!(
                matches!(buf, Err(Error::LibraryUnavailable { .. })),
                "{buf:?}"
            );
        }
        "nodevice" => {
            assert!(matches!(g, Err(Error::NoDevice { .. })), "{g:?}");
            assert!(matches!(buf, Err(Error::NoDevice { .. })), "{buf:?}");
        }
        "present" => {
            let g = g.expect("GPUDIRECT_EXPECT_CUDA=present but VMM granularity failed");
            assert!(g > 0 && g.is_power_of_two(), "{g}");
            let buf = buf.expect("GPUDIRECT_EXPECT_CUDA=present but VmmBuffer failed");
            assert_eq!(buf.mapped_bytes() % g, 0);
            let bad = VmmBuffer::<u8>::alloc_zeros_on(1000, 1);
            assert!(matches!(bad, Err(Error::NoDevice { .. })), "{bad:?}");
        }
        other => panic!("GPUDIRECT_EXPECT_CUDA must be absent|present|nodevice, not {other}"),
    }
}

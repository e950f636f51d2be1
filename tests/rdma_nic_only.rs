//! GPUDirect-RDMA pieces that need an RDMA device but no GPU: the GDR probe's RDMA half and
//! the refusals a GPU registration meets on a software RDMA device. Run in the Soft-RoCE VM
//! (`scripts/rdma-vm-test`), which sets GPUDIRECT_RDMA_DEV (default rxe0).
//! Without an RDMA device each test fails with a setup hint.

use gpudirect::rdma::{GdrProbe, RdmaStatus};

fn rdma_dev() -> String {
    std::env::var("GPUDIRECT_RDMA_DEV").unwrap_or_else(|_| "rxe0".into())
}

fn need_device(p: &GdrProbe) {
    assert_eq!(
        p.rdma,
        RdmaStatus::Devices,
        "this test needs an RDMA device (a NIC, or Soft-RoCE: scripts/rdma-vm-test runs it in a VM)\n{p}"
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_gdr_probe_sees_the_device_and_its_ports() {
    let p = GdrProbe::run();
    println!("{p}");
    need_device(&p);
    let name = rdma_dev();
    let d = p
        .rdma_devices
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("{name} not in the probe (set GPUDIRECT_RDMA_DEV)\n{p}"));
    assert!(!d.ports.is_empty(), "{p}");
    assert_eq!(d.ports[0].port, 1);
    assert_eq!(d.ports[0].state, "ACTIVE", "{p}");
    if name.starts_with("rxe") || name.starts_with("siw") {
        if name.starts_with("rxe") {
            assert_eq!(d.ports[0].link_layer, "Ethernet", "{p}");
        }
        // rxe and siw implement no dma-buf registration (rdma-core 44, Debian kernels): the
        // probe asks libibverbs the way NCCL does and gets EOPNOTSUPP, the same refusal a GPU
        // registration meets on this device.
        assert_eq!(d.dmabuf_registration, Some(false), "{p}");
        let detail = d.dmabuf_detail.as_deref().unwrap_or("");
        assert!(
            detail.contains("dma-buf registration unsupported"),
            "{detail}"
        );
        assert_eq!(
            d.pci_bus_id, None,
            "software devices have no PCI function\n{p}"
        );
        assert!(
            p.findings
                .iter()
                .any(|f| f.contains(&name) && f.contains("software RDMA")),
            "{p}"
        );
    }
    let text = p.to_string();
    assert!(
        text.contains(&format!("GDR: RDMA device {name} ")),
        "{text}"
    );
    // No GPU in the VM: the GPU half is absent, typed, and does not stop the rest.
    if std::env::var("GPUDIRECT_EXPECT_CUDA").as_deref() == Ok("absent") {
        assert!(p.gpus.is_empty() && p.cuda_error.is_some(), "{p}");
        assert!(p.pairs.is_empty());
    }
}

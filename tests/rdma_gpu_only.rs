//! GPU-side GPUDirect RDMA tests: what a GPU machine without an RDMA device can prove.
//!
//! GdrBuffer allocation and cudarc interop, pointer classification (IS_GPU_DIRECT_RDMA_CAPABLE
//! 1 for cuMemAlloc, 0 for pool memory), the dma-buf export half of registration (aligned and
//! unaligned ranges, cuMemAlloc and pool memory), the flush helper, the probe's GPU half, and
//! the typed error a registration meets without an RDMA device.
//!
//! Run on the GPU machine: `cargo test --test rdma_gpu_only -- --include-ignored gpu_gdr_`.
//! The names avoid `rdma_` so that `--skip rdma_` (the RDMA-device tests) keeps them.
//! Without a GPU every test fails with a setup hint.

mod common;

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use gpudirect::cudarc::driver::{CudaContext, CudaStream};
use gpudirect::rdma::{export_dmabuf, pointer_info, GdrBuffer, GpuMemory};
use gpudirect::rdma::{host_page_size, GPU_PAGE_SIZE};
use gpudirect::rdma::{DriverFlavour, GdrProbe};
use gpudirect::rdma::{FlushOutcome, FlushScope, RdmaWriteFlush};
use gpudirect::{Cause, Error};

use common::random;

fn gpu() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = common::need_gpu(common::test_gpu());
    let stream = ctx.default_stream();
    (ctx, stream)
}

/// The fd is an open dma-buf (its /proc link names the dma-buf anon inode).
fn assert_dmabuf_fd(fd: i32) {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).expect("fd is open");
    let link = link.to_string_lossy();
    assert!(link.contains("dmabuf"), "fd {fd} is {link}, not a dma-buf");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_buffer_roundtrip_interop_and_attributes() {
    let (_ctx, stream) = gpu();
    let n = 1_000_003; // odd size
    let mut buf = GdrBuffer::<u8>::alloc(&stream, n).unwrap();
    assert_eq!(buf.len(), n);
    assert_eq!(buf.device_ptr() % GPU_PAGE_SIZE as u64, 0, "64 KiB aligned");
    assert!(buf.capacity_bytes() >= n && buf.capacity_bytes().is_multiple_of(GPU_PAGE_SIZE));

    let data = random(n);
    buf.copy_from_host(&data).unwrap();
    let mut back = vec![0u8; n];
    buf.copy_to_host(&mut back).unwrap();
    assert!(back == data, "host -> GdrBuffer -> host changed bytes");

    // cudarc interop: a view into cudarc's own copies, both directions, at an odd offset
    let src = stream.clone_htod(&data[..4097]).unwrap(); // pool (or cuMemAlloc) CudaSlice
    {
        let mut dst = buf.slice_mut(12_345..12_345 + 4097);
        stream.memcpy_dtod(&src, &mut dst).unwrap();
    }
    let got = stream
        .clone_dtoh(&buf.slice(12_345..12_345 + 4097))
        .unwrap();
    assert!(got == data[..4097], "dtod into a GdrBuffer view");
    let whole = stream.clone_dtoh(buf.as_slice()).unwrap();
    assert!(whole[..12_345] == data[..12_345] && whole[12_345 + 4097..] == data[12_345 + 4097..]);

    let info = pointer_info(buf.device_ptr()).unwrap();
    assert!(info.is_device && !info.is_managed, "{info:?}");
    assert!(
        info.gdr_capable,
        "cuMemAlloc memory reports IS_GPU_DIRECT_RDMA_CAPABLE=1: {info:?}"
    );
    assert!(!info.from_pool, "{info:?}");
    assert_eq!(info.gdr_refusal(), None);
    // typed elements too
    let mut f = GdrBuffer::<f32>::zeroed(&stream, 1000).unwrap();
    let vals: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    f.copy_from_host(&vals).unwrap();
    let mut out = vec![0f32; 1000];
    f.copy_to_host(&mut out).unwrap();
    assert_eq!(out, vals);
    assert!(matches!(
        GdrBuffer::<u8>::alloc(&stream, 0),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_pool_memory_is_classified_not_gdr_capable() {
    let (ctx, stream) = gpu();
    let slice = stream.clone_htod(&random(1 << 20)).unwrap();
    let info = pointer_info(GpuMemory::device_ptr(&slice)).unwrap();
    eprintln!(
        "cudarc allocation (has_async_alloc={}): {info:?}",
        ctx.has_async_alloc()
    );
    if ctx.has_async_alloc() {
        assert!(
            info.from_pool,
            "cudarc's pool memory has a mempool handle: {info:?}"
        );
        assert!(
            !info.gdr_capable,
            "pool memory reports IS_GPU_DIRECT_RDMA_CAPABLE=0 (measured): {info:?}"
        );
        assert_eq!(info.gdr_refusal(), Some(Cause::PoolMemoryNotGdrCapable));
    } else {
        assert!(info.gdr_capable, "{info:?}");
    }
}

fn check_export<M: GpuMemory>(mem: &M, range: Range<usize>) {
    let page = host_page_size() as u64;
    let exp = export_dmabuf(mem, range.clone())
        .unwrap_or_else(|e| panic!("export of bytes {range:?} failed: {e}"));
    let addr = mem.device_ptr() + range.start as u64;
    let p = exp.plan;
    assert_eq!(p.export_start % page, 0, "{p:?}");
    assert_eq!(p.export_len % page, 0, "{p:?}");
    assert_eq!(p.export_start + p.offset, addr, "{p:?}");
    assert!(p.offset < page, "{p:?}");
    assert!(p.offset + p.len <= p.export_len, "{p:?}");
    assert_eq!(p.iova, addr);
    assert_eq!(p.len, range.len() as u64);
    assert_dmabuf_fd(exp.fd.as_raw_fd());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_dmabuf_export_of_gdr_buffer_aligned_and_unaligned() {
    let (_ctx, stream) = gpu();
    let buf = GdrBuffer::<u8>::alloc(&stream, 3 * GPU_PAGE_SIZE + 777).unwrap();
    let n = buf.num_bytes();
    for r in [
        0..n,
        0..4096,
        100..100 + 4096,
        4095..4097,
        65_536 + 1..65_536 + 12_345,
        n - 1..n,
    ] {
        check_export(&buf, r);
    }
    // export through an Arc (how a region shares a buffer)
    let shared = Arc::new(buf);
    check_export(&shared, 1..2);
    // bad ranges are refused before CUDA is asked
    assert!(matches!(
        export_dmabuf(&*shared, 5..5),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        export_dmabuf(&*shared, 0..n + 1),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_dmabuf_export_of_pool_memory() {
    let (_ctx, stream) = gpu();
    // The driver exports some pool allocations (1 GiB measured) and refuses others (3 MiB
    // measured, CUDA_ERROR_INVALID_VALUE): an export either works and is checked like any
    // other, or fails with the typed pool cause — never a raw driver error.
    let mut exported = 0;
    for size in [3usize << 20, 256 << 20] {
        let slice = stream.clone_htod(&random(size)).unwrap();
        let n = slice.num_bytes();
        for r in [0..n, 100..100 + 65_536, n - 4097..n - 1] {
            match export_dmabuf(&slice, r.clone()) {
                Ok(_) => {
                    check_export(&slice, r);
                    exported += 1;
                }
                Err(Error::Unsupported {
                    cause: Cause::PoolMemoryNotGdrCapable,
                    what,
                }) => {
                    eprintln!("pool export of {size} bytes, range {r:?} refused as typed: {what}")
                }
                Err(e) => panic!("pool export of {size} bytes, range {r:?}: untyped failure {e}"),
            }
        }
    }
    eprintln!("pool exports that succeeded: {exported} of 6");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_flush_helper_follows_the_ordering_attribute() {
    let (ctx, _stream) = gpu();
    let fl = RdmaWriteFlush::new(&ctx).unwrap();
    eprintln!(
        "writes ordering {}, flush options {}",
        fl.ordering(),
        fl.options()
    );
    let owner = fl.flush(FlushScope::Owner).unwrap();
    assert_eq!(
        owner == FlushOutcome::NotNeeded,
        !fl.needed(FlushScope::Owner)
    );
    match fl.flush(FlushScope::AllDevices) {
        Ok(o) => assert_eq!(
            o == FlushOutcome::Flushed,
            fl.needed(FlushScope::AllDevices)
        ),
        Err(Error::Unsupported { .. }) => assert!(!fl.options().host()),
        Err(e) => panic!("cuFlushGPUDirectRDMAWrites failed: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_probe_reports_the_gpu_half() {
    let (_ctx, _stream) = gpu();
    let p = GdrProbe::run();
    println!("{p}");
    assert!(p.cuda_error.is_none(), "{p}");
    assert!(!p.gpus.is_empty(), "{p}");
    for g in &p.gpus {
        assert_eq!(g.error, None, "{p}");
        assert_eq!(g.gdr_supported, Some(1), "{p}");
        assert_eq!(
            g.dma_buf_supported,
            Some(1),
            "the open kernel module exports dma-bufs: {p}"
        );
        assert!(
            g.writes_ordering.is_some() && g.flush_options.is_some(),
            "{p}"
        );
        let bdf = g.pci_bus_id.as_deref().expect("PCI bus id");
        assert!(
            std::path::Path::new("/sys/bus/pci/devices")
                .join(bdf)
                .exists(),
            "{bdf} is not in sysfs: {p}"
        );
    }
    let d = p.driver.as_ref().expect("/proc/driver/nvidia/version");
    assert_eq!(d.flavour, DriverFlavour::Open, "{p}");
    assert!(d.version.is_some(), "{p}");
    serde_json::to_string(&p).unwrap();
}

/// GpuMemoryRegion needs a protection domain, which needs an RDMA device: on a GPU machine
/// without one, the way there fails with a typed absence error (never a panic), while the GPU
/// half (allocation, export) works.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdr_registration_without_rdma_device_is_a_typed_error() {
    let (_ctx, stream) = gpu();
    let buf = GdrBuffer::<u8>::alloc(&stream, 1 << 20).unwrap();
    check_export(&buf, 0..buf.num_bytes());
    let expect = std::env::var("GPUDIRECT_EXPECT_VERBS").unwrap_or_else(|_| "nodevice".into());
    match gpudirect::rdma::Context::open_first() {
        Ok(ctx) => {
            assert_eq!(
                expect,
                "present",
                "an RDMA device exists here ({}); set GPUDIRECT_EXPECT_VERBS=present",
                ctx.name()
            );
            let pd = gpudirect::rdma::ProtectionDomain::new(&ctx).unwrap();
            match gpudirect::rdma::GpuMemoryRegion::register(&pd, buf) {
                Ok(mr) => println!("registered via {} rkey {:#x}", mr.path(), mr.rkey()),
                Err(e) => println!("registration refused: {e}"),
            }
        }
        Err(e) => {
            println!("as expected without an RDMA device: {e}");
            assert!(e.is_absence(), "not an absence error: {e:?}");
            assert!(
                matches!(
                    e,
                    Error::NoDevice { .. }
                        | Error::NoRdmaSubsystem { .. }
                        | Error::LibraryUnavailable { .. }
                ),
                "{e:?}"
            );
            assert_ne!(expect, "present", "GPUDIRECT_EXPECT_VERBS=present but: {e}");
        }
    }
}

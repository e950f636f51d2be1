//! gpudirect's own streams must not make a transfer wait for other work either. cudarc's
//! `CudaContext::new_stream` runs `cuCtxSynchronize` (all the context's work, every stream of
//! the process) when it creates the first stream of a `CudaContext` object that tracks events,
//! and a user who works through `default_stream()` (as the README's examples do) hands the
//! transfer exactly such an object. The engine creates its ring's stream, its workers' lane
//! streams and small transfers' side streams on first use, inside a transfer: through the
//! user's object each of those would wait for every other stream (`crate::cuda::own_stream`
//! creates them through an object of gpudirect's own instead). Seen on the H200 machine as a
//! ring built "in 3000.630 ms" while another stream was held (`GPUDIRECT_TRACE=timing`).
//!
//! Its own binary: the engine must be fresh (no ring, lane or side stream yet). Each transfer
//! gets a fresh `CudaContext` object of the device (`gpudirect::cuda::context` makes one per
//! call), used only through its default stream.
//!
//! Run on a GPU machine: `bash .device/run --include-ignored gpu_storage_stall`.

mod common;

use std::time::{Duration, Instant};

use common::StreamGate;
use gpudirect::storage::{Backend, GpuFile, ODirect, Pipeline};

const LIMIT: Duration = Duration::from_millis(1000);

/// While a stream of another `CudaContext` object is held (a host function waiting for this
/// thread's say-so, opened after 3 s), a small read, a 64 MiB read through the segment ring and
/// a 32 MiB write from the GPU, each into or from memory of a fresh context object used only
/// through its default stream, return at once with every byte in place.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_stall_first_streams_wait_for_no_other_stream() {
    let gpu = common::test_gpu();
    common::need_gpu(gpu);
    let held = gpudirect::cuda::context(gpu).unwrap();
    let other = held.new_stream().unwrap();
    let fresh = || gpudirect::cuda::context(gpu).unwrap().default_stream();

    let (small, big) = (64usize << 10, 64usize << 20);
    let (ps, pb, pw) = (
        common::scratch("stall-ctx-small"),
        common::scratch("stall-ctx-big"),
        common::scratch("stall-ctx-write"),
    );
    let (ds, db) = (
        common::random_seeded(small, 801),
        common::random_seeded(big, 802),
    );
    std::fs::write(&ps, &ds).unwrap();
    std::fs::write(&pb, &db).unwrap();
    let (s1, s2, s3) = (fresh(), fresh(), fresh());
    let mut b1 = s1.alloc_zeros::<u8>(small).unwrap();
    let mut b2 = s2.alloc_zeros::<u8>(big).unwrap();
    let dw = common::random_seeded(32 << 20, 803);
    let src = s3.clone_htod(&dw).unwrap();
    for s in [&s1, &s2, &s3] {
        s.synchronize().unwrap();
    }
    let fs = GpuFile::options()
        .backend(Backend::Engine)
        .open(&ps)
        .unwrap();
    let fb = GpuFile::options()
        .backend(Backend::Engine)
        .pipeline(Pipeline::Segments)
        .open(&pb)
        .unwrap();
    let fw = GpuFile::options()
        .backend(Backend::Engine)
        .odirect(ODirect::Off)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&pw)
        .unwrap();

    let opener = StreamGate::block(&other).release_after(Duration::from_secs(3));
    let mut took = Vec::new();
    let t = Instant::now();
    assert_eq!(fs.read_exact_to_device(&mut b1, 0).unwrap().bytes, small);
    took.push(("small read", t.elapsed()));
    let t = Instant::now();
    assert_eq!(fb.read_exact_to_device(&mut b2, 0).unwrap().bytes, big);
    took.push(("64 MiB read", t.elapsed()));
    let t = Instant::now();
    assert_eq!(fw.write_from_device(&src, 0).unwrap().bytes, dw.len());
    took.push(("32 MiB write", t.elapsed()));
    opener.join().unwrap();
    other.synchronize().unwrap();

    assert!(
        s1.clone_dtoh(&b1).unwrap() == ds,
        "the small read's bytes differ"
    );
    assert!(
        s2.clone_dtoh(&b2).unwrap() == db,
        "the 64 MiB read's bytes differ"
    );
    drop(fw);
    assert!(
        std::fs::read(&pw).unwrap() == dw,
        "the written file differs"
    );
    for (what, d) in &took {
        assert!(
            *d < LIMIT,
            "the {what} took {d:?} while another stream was held: it waited for that stream's work (all: {took:?})"
        );
    }
    for p in [ps, pb, pw] {
        std::fs::remove_file(&p).unwrap();
    }
}

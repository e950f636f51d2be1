//! Tier 2: P2P on real GPUs. `gpu_*` need one CUDA GPU, `multi_gpu_*` two peer-capable GPUs
//! (ordinals 0 and 1). Run on the GPU machine with
//! `cargo test --release --test p2p_multi_gpu -- --ignored --test-threads=1`
//! (the tests also serialize themselves: peer access is process-wide state).
//! Without the hardware they fail with a setup hint.

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use gpudirect::cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use gpudirect::p2p::{
    self, copy_peer, copy_peer_with, plan_copy, registry_state, timed_copy_peer, CopyOptions,
    DeviceBuffer, MemoryKind, PeerAccess, Topology,
};
#[cfg(feature = "bench")]
use gpudirect::p2p::{PairBench, SmDirection};
use gpudirect::{Cause, Error, FallbackPolicy, TransferPath};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

use common::{need_two_gpus as two_gpus, random, GPU_HINT as HINT1};

fn one_gpu() -> Arc<CudaContext> {
    common::need_gpu(0)
}

fn pool_buf(s: &Arc<CudaStream>, data: &[u8]) -> CudaSlice<u8> {
    s.clone_htod(data).unwrap()
}

/// Raw context peer access toggles, standing in for "someone else" in the process.
fn raw_ctx_access(accessor: &CudaContext, owner: &CudaContext, on: bool) -> sys::CUresult {
    accessor.bind_to_thread().unwrap();
    // SAFETY: the accessor's context is current and the owner's alive.
    unsafe {
        if on {
            sys::cuCtxEnablePeerAccess(owner.cu_ctx(), 0)
        } else {
            sys::cuCtxDisablePeerAccess(owner.cu_ctx())
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_topology_shows_devices() {
    let _g = serial();
    one_gpu();
    let t = Topology::probe().expect(HINT1);
    println!("{t}");
    assert!(!t.devices.is_empty());
    assert!(!t.devices[0].pci_bus_id.is_empty());
    assert_eq!(t.pairs.len(), t.devices.len() * (t.devices.len() - 1));
    let s = t.to_string();
    assert!(s.contains("GPU0     X"), "{s}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_peer_access_to_self_is_typed_error() {
    let _g = serial();
    let a = one_gpu();
    let e = PeerAccess::enable(&a, &a).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unsupported {
                cause: Cause::SameDevice,
                ..
            }
        ),
        "{e:?}"
    );
    let n = gpudirect::cuda::device_count().unwrap();
    let e = PeerAccess::between(0, n + 3).unwrap_err();
    assert!(matches!(e, Error::NoDevice { .. }), "{e:?}");
    // A copy between two buffers of one device is refused, not silently done.
    let s = a.default_stream();
    let src = pool_buf(&s, &random(1000));
    let mut dst = s.alloc_zeros::<u8>(1000).unwrap();
    let e = copy_peer(&src, &mut dst, &s).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_peer_access_refcount_and_restore() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let src = pool_buf(&sa, &random(4096));
    let mut dst = sb.alloc_zeros::<u8>(4096).unwrap();
    let before = plan_copy(&src, &mut dst, &sb).unwrap();
    assert_eq!(before.src_memory, MemoryKind::Pool);
    assert_eq!(
        before.path.path,
        TransferPath::StagedThroughHost,
        "{}",
        before.path
    );
    assert_eq!(
        before.path.cause,
        Some(Cause::PoolAccessNotGranted {
            accessor: 1,
            owner: 0
        })
    );
    assert_eq!(registry_state(&b, &a).map_or(0, |s| s.0), 0);

    let first = PeerAccess::both_ways(&a, &b).unwrap();
    assert_eq!(registry_state(&b, &a), Some((1, true)));
    assert!(plan_copy(&src, &mut dst, &sb).unwrap().path.is_direct());
    let second = PeerAccess::enable(&b, &a).unwrap();
    assert_eq!(registry_state(&b, &a), Some((2, true)));
    drop(first);
    // The second holder keeps both the context and the pool grant alive.
    assert_eq!(registry_state(&b, &a), Some((1, true)));
    let mid = plan_copy(&src, &mut dst, &sb).unwrap();
    assert!(mid.path.is_direct(), "{}", mid.path);
    drop(second);
    assert_eq!(registry_state(&b, &a), None, "no record without holders");
    let after = plan_copy(&src, &mut dst, &sb).unwrap();
    assert_eq!(
        after.path.path,
        TransferPath::StagedThroughHost,
        "{}",
        after.path
    );
    // Context access was really revoked: enabling it again succeeds (not 704).
    assert_eq!(raw_ctx_access(&b, &a, true), sys::CUresult::CUDA_SUCCESS);
    assert_eq!(raw_ctx_access(&b, &a, false), sys::CUresult::CUDA_SUCCESS);

    // Access enabled by someone else (704 on our enable) is left on after the last holder.
    assert_eq!(raw_ctx_access(&b, &a, true), sys::CUresult::CUDA_SUCCESS);
    let held = PeerAccess::enable(&b, &a).unwrap();
    assert_eq!(registry_state(&b, &a), Some((1, false)));
    drop(held);
    assert_eq!(
        raw_ctx_access(&b, &a, true),
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    );
    assert_eq!(raw_ctx_access(&b, &a, false), sys::CUresult::CUDA_SUCCESS);
}

/// Measures one 256 MiB copy; returns GB/s and the reported path.
fn timed(src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>, s: &Arc<CudaStream>) -> (f64, TransferPath) {
    // Warm up, then take the best of three (robust against a first-touch outlier).
    let _ = timed_copy_peer(src, dst, s).unwrap();
    let mut best = 0.0f64;
    let mut path = TransferPath::Unknown;
    for _ in 0..3 {
        let t = timed_copy_peer(src, dst, s).unwrap();
        best = best.max(t.gbps);
        path = t.report.path.path;
    }
    (best, path)
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_pool_path_verified_by_timing() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let n = 256 << 20;
    let src = pool_buf(&sa, &random(n));
    let mut dst = sb.alloc_zeros::<u8>(n).unwrap();

    let (staged, p0) = timed(&src, &mut dst, &sb);
    assert_eq!(p0, TransferPath::StagedThroughHost);

    // Context access alone does not open the pool: still staged, and reported so.
    assert_eq!(raw_ctx_access(&b, &a, true), sys::CUresult::CUDA_SUCCESS);
    let ctx_only = plan_copy(&src, &mut dst, &sb).unwrap();
    assert_eq!(
        ctx_only.path.cause,
        Some(Cause::PoolAccessNotGranted {
            accessor: 1,
            owner: 0
        })
    );
    let (ctx_only_gbps, _) = timed(&src, &mut dst, &sb);
    assert_eq!(raw_ctx_access(&b, &a, false), sys::CUresult::CUDA_SUCCESS);

    let access = PeerAccess::both_ways(&a, &b).unwrap();
    let (direct, p1) = timed(&src, &mut dst, &sb);
    assert!(matches!(p1, TransferPath::PeerDirect { .. }), "{p1:?}");
    drop(access);
    println!("pool 256 MiB: staged {staged:.1} GB/s, ctx-only {ctx_only_gbps:.1} GB/s, direct {direct:.1} GB/s");
    assert!(
        direct > 3.0 * staged,
        "direct {direct:.1} vs staged {staged:.1} GB/s"
    );
    assert!(
        direct > 3.0 * ctx_only_gbps,
        "direct {direct:.1} vs ctx-only {ctx_only_gbps:.1} GB/s"
    );
    assert_eq!(sb.clone_dtoh(&dst).unwrap(), sa.clone_dtoh(&src).unwrap());
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_cumemalloc_path_verified_by_timing() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let n = 256 << 20;
    let data = random(n);
    let mut src = DeviceBuffer::<u8>::alloc_zeros(&sa, n).unwrap();
    sa.memcpy_htod(&data, &mut src.as_view_mut()).unwrap();
    let mut dst = DeviceBuffer::<u8>::alloc_zeros(&sb, n).unwrap();

    let plan = plan_copy(&src.as_view(), &mut dst.as_view_mut(), &sb).unwrap();
    assert_eq!(plan.src_memory, MemoryKind::Legacy);
    assert_eq!(plan.dst_memory, MemoryKind::Legacy);
    let time = |dst: &mut DeviceBuffer<u8>| {
        let _ = timed_copy_peer(&src.as_view(), &mut dst.as_view_mut(), &sb).unwrap();
        let t = timed_copy_peer(&src.as_view(), &mut dst.as_view_mut(), &sb).unwrap();
        (t.gbps, t.report.path.path)
    };
    if plan.path.is_direct() {
        // Context peer access for cuMemAlloc memory cannot be revoked once another holder in
        // this process found it already enabled (the registry then leaves it on): the report
        // must then be direct, and the clock must agree.
        let (gbps, p) = time(&mut dst);
        println!(
            "cuMemAlloc 256 MiB: access already enabled in this process, {gbps:.1} GB/s via {p:?}"
        );
        assert!(matches!(p, TransferPath::PeerDirect { .. }), "{p:?}");
        assert!(gbps > 150.0, "reported direct but ran at {gbps:.1} GB/s");
        assert_eq!(sb.clone_dtoh(dst.slice()).unwrap(), data);
        return;
    }
    assert_eq!(
        plan.path.cause,
        Some(Cause::PeerAccessNotEnabled {
            accessor: 1,
            owner: 0
        })
    );
    let (staged, p0) = time(&mut dst);
    assert_eq!(p0, TransferPath::StagedThroughHost);
    let access = PeerAccess::both_ways(&a, &b).unwrap();
    let (direct, p1) = time(&mut dst);
    assert!(matches!(p1, TransferPath::PeerDirect { .. }), "{p1:?}");
    drop(access);
    println!("cuMemAlloc 256 MiB: staged {staged:.1} GB/s, direct {direct:.1} GB/s");
    assert!(
        direct > 3.0 * staged,
        "direct {direct:.1} vs staged {staged:.1} GB/s"
    );
    assert_eq!(sb.clone_dtoh(dst.slice()).unwrap(), data);
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_random_odd_sizes_and_offsets_both_ways() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let cases = [
        (1usize, 0usize, 0usize),
        (3, 1, 13),
        (4097, 13, 1),
        ((1 << 20) + 13, 511, 7),
        (7_777_777, 3, 4093),
    ];
    for with_access in [true, false] {
        let access = with_access.then(|| PeerAccess::both_ways(&a, &b).unwrap());
        for &(n, so, doff) in &cases {
            for (from_s, to_s) in [(&sa, &sb), (&sb, &sa)] {
                // Pool (cudarc) source and destination.
                let data = random(so + n);
                let src = pool_buf(from_s, &data);
                let guard = random(doff + n + 5);
                let mut dst = pool_buf(to_s, &guard);
                let rep = {
                    let mut dv = dst.slice_mut(doff..doff + n);
                    copy_peer(&src.slice(so..so + n), &mut dv, to_s).unwrap()
                };
                assert_eq!(rep.bytes, n);
                assert_eq!(rep.path.is_direct(), with_access, "{}", rep.path);
                let got = to_s.clone_dtoh(&dst).unwrap();
                assert_eq!(
                    &got[..doff],
                    &guard[..doff],
                    "bytes before the range changed"
                );
                assert_eq!(
                    &got[doff..doff + n],
                    &data[so..so + n],
                    "n={n} so={so} doff={doff}"
                );
                assert_eq!(
                    &got[doff + n..],
                    &guard[doff + n..],
                    "bytes after the range changed"
                );

                // cuMemAlloc source into a pool destination.
                let mut lsrc = DeviceBuffer::<u8>::alloc_zeros(from_s, so + n).unwrap();
                from_s.memcpy_htod(&data, &mut lsrc.as_view_mut()).unwrap();
                let mut dst2 = to_s.alloc_zeros::<u8>(n).unwrap();
                let rep = copy_peer(&lsrc.slice().slice(so..so + n), &mut dst2, to_s).unwrap();
                assert_eq!(rep.src_memory, MemoryKind::Legacy);
                assert_eq!(rep.path.is_direct(), with_access, "{}", rep.path);
                assert_eq!(to_s.clone_dtoh(&dst2).unwrap(), &data[so..so + n]);
            }
        }
        drop(access);
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_typed_errors() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    // Self access.
    let e = PeerAccess::enable(&b, &b).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unsupported {
                cause: Cause::SameDevice,
                ..
            }
        ),
        "{e:?}"
    );
    // Bad ordinals.
    let e = PeerAccess::between(0, 64).unwrap_err();
    assert!(matches!(e, Error::NoDevice { .. }), "{e:?}");
    assert!(e.to_string().contains("ordinal 64"), "{e}");
    let src = pool_buf(&sa, &random(1001));
    // Mismatched lengths.
    let mut short = sb.alloc_zeros::<u8>(1000).unwrap();
    let e = copy_peer(&src, &mut short, &sb).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("1001")),
        "{e:?}"
    );
    // Stream of the wrong context.
    let mut dst = sb.alloc_zeros::<u8>(1001).unwrap();
    let e = copy_peer(&src, &mut dst, &sa).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("stream")),
        "{e:?}"
    );
    // Buffers not on the stated devices.
    let wrong = CopyOptions {
        src_device: Some(1),
        dst_device: Some(0),
        ..CopyOptions::default()
    };
    let e = copy_peer_with(&src, &mut dst, &sb, &wrong).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("source buffer is on GPU 0")),
        "{e:?}"
    );
    // Same device.
    let mut same = sa.alloc_zeros::<u8>(1001).unwrap();
    let e = copy_peer(&src, &mut same, &sa).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("both buffers")),
        "{e:?}"
    );
    // Deny refuses a staged copy before any byte moves.
    let deny = CopyOptions {
        policy: Some(FallbackPolicy::Deny),
        ..CopyOptions::default()
    };
    let e = copy_peer_with(&src, &mut dst, &sb, &deny).unwrap_err();
    assert!(
        matches!(
            e,
            Error::FallbackRefused {
                path: TransferPath::StagedThroughHost,
                cause: Cause::PoolAccessNotGranted { .. }
            }
        ),
        "{e:?}"
    );
    assert!(
        sb.clone_dtoh(&dst).unwrap().iter().all(|&x| x == 0),
        "bytes moved"
    );
    // With access, Deny lets the direct copy through.
    let _access = PeerAccess::both_ways(&a, &b).unwrap();
    copy_peer_with(&src, &mut dst, &sb, &deny).unwrap();
    assert_eq!(sb.clone_dtoh(&dst).unwrap(), sa.clone_dtoh(&src).unwrap());
}

#[cfg(feature = "bench")]
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_sm_copy_and_latency() {
    let _g = serial();
    two_gpus();
    let mut bench = PairBench::new(0, 1, 64 << 20).unwrap();
    // Without access the kernel path is refused (a kernel would fault), not attempted.
    let e = bench.sm_copy(SmDirection::Read, 1).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
    let (a, b) = (bench.contexts().0.clone(), bench.contexts().1.clone());
    let _access = PeerAccess::both_ways(&a, &b).unwrap();
    for dir in [SmDirection::Read, SmDirection::Write] {
        let g = bench.sm_copy(dir, 4).unwrap();
        println!("SM {dir:?}: {g:.1} GB/s");
        assert!(g > 50.0, "{dir:?} {g:.1} GB/s");
        assert!(
            bench.destination_matches().unwrap(),
            "{dir:?} copied wrong bytes"
        );
    }
    let ce = bench.ce_gpudirect(4).unwrap();
    let (ab, ba) = bench.ce_bidirectional_raw(4).unwrap();
    let lat = bench.sm_latency_ns(2000).unwrap();
    let ce_lat = bench.ce_latency_us(200).unwrap();
    println!("CE {ce:.1} GB/s, bidir {ab:.1}+{ba:.1} GB/s, SM latency {lat:.0} ns, CE 8-byte {ce_lat:.2} us");
    assert!(ce > 100.0 && ab > 100.0 && ba > 100.0);
    assert!(lat > 50.0 && lat < 100_000.0, "{lat}");
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_report_detects_staged_copies() {
    let _g = serial();
    two_gpus();
    let withheld = gpudirect::diag::p2p_report(&gpudirect::diag::P2pReportOptions {
        measure: true,
        measure_bytes: 256 << 20,
        withhold_peer_access: true,
    })
    .unwrap();
    let granted = gpudirect::diag::p2p_report(&gpudirect::diag::P2pReportOptions {
        measure: true,
        measure_bytes: 256 << 20,
        withhold_peer_access: false,
    })
    .unwrap();
    println!("{}", serde_json::to_string_pretty(&granted).unwrap());
    for (w, g) in withheld.pairs.iter().zip(&granted.pairs) {
        assert!(w.error.is_none() && g.error.is_none(), "{w:?} {g:?}");
        let wm = w.measured.as_ref().unwrap();
        let gm = g.measured.as_ref().unwrap();
        assert_eq!(wm.path.path, TransferPath::StagedThroughHost);
        assert!(wm.flagged);
        assert!(g.with_peer_access.as_ref().unwrap().is_direct());
        assert!(gm.path.is_direct() && !gm.flagged, "{gm:?}");
        assert!(gm.gbps > 3.0 * wm.gbps, "{} vs {}", gm.gbps, wm.gbps);
    }
}

/// Issue 9 item 14: the last `PeerAccess` dropped while a `copy_peer_async` that relies on it
/// is still queued must not revoke the access under the copy: its drop waits for the
/// accessor's context first (before the fix it revoked at once: a device fault or a copy of
/// wrong bytes). The copy is held behind a gate on the destination's stream; the drop runs on
/// another thread and must still be waiting 300 ms later; after the gate opens, the copy
/// completes and every byte arrives.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_peer_access_drop_waits_for_an_in_flight_copy() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let data = random((64 << 20) + 48);
    let src = pool_buf(&sa, &data);
    let mut dst = sb.alloc_zeros::<u8>(data.len()).unwrap();
    sa.synchronize().unwrap();
    sb.synchronize().unwrap();
    assert_eq!(
        registry_state(&b, &a).map_or(0, |s| s.0),
        0,
        "no holder yet"
    );
    let access = PeerAccess::enable(&b, &a).unwrap();
    let mut gate = common::StreamGate::block(&sb);
    // SAFETY: `src` and `dst` outlive the synchronisation of `sb` below; no other stream touches
    // them meanwhile; the access is held until the drop, which (the point of this test) waits.
    let report = unsafe { p2p::copy_peer_async(&src, &mut dst, &sb) }.unwrap();
    assert!(report.path.is_direct(), "{}", report.path);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(access);
        let _ = done_tx.send(());
    });
    let early = done_rx.recv_timeout(std::time::Duration::from_millis(300));
    gate.release();
    let finished = done_rx.recv_timeout(std::time::Duration::from_secs(30));
    dropper.join().unwrap();
    let synced = sb.synchronize();
    assert!(
        early.is_err(),
        "the last PeerAccess was dropped (access revoked) while a copy relying on it was queued"
    );
    assert!(
        finished.is_ok(),
        "the drop never returned after the copy ran"
    );
    synced.unwrap_or_else(|e| panic!("the copy failed after the access was revoked: {e}"));
    assert!(
        sb.clone_dtoh(&dst).unwrap() == data,
        "the copy's bytes differ"
    );
    assert_eq!(registry_state(&b, &a).map_or(0, |s| s.0), 0);
}

/// Review of 2026-12-02, item 9: revoking a grant waits for the accessor's context
/// (`cuCtxSynchronize`), and that wait must not hold up gpudirect's copies between other
/// streams: with work queued behind a host action that another thread performs after its own
/// `copy_peer`, that would never end. The accessor's (GPU 1's) work is held by a gate while the
/// last holder is dropped on another thread (control: still waiting 300 ms later); a
/// `copy_peer` from GPU 1's memory into GPU 0's on an unrelated stream then runs. On the code
/// before the fix the drop held the process-wide revocation lock across the wait, so the copy
/// returned only when the gate's 5 s timer opened it (about 4.7 s here); after it, at once
/// (milliseconds), with the drop still waiting, and every byte arrives. The access is revoked
/// once the gate opens.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_peer_access_revocation_holds_up_no_other_copy() {
    use std::time::{Duration, Instant};
    let _g = serial();
    let (a, b) = two_gpus();
    common::grow_streams_past_the_drivers_first_growth(&a);
    common::grow_streams_past_the_drivers_first_growth(&b);
    let held = b.new_stream().unwrap();
    let sa = a.new_stream().unwrap();
    let sb = b.new_stream().unwrap();
    let data = random((8 << 20) + 3);
    let src = pool_buf(&sb, &data);
    let mut dst = sa.alloc_zeros::<u8>(data.len()).unwrap();
    sb.synchronize().unwrap();
    sa.synchronize().unwrap();
    let access = PeerAccess::enable(&b, &a).unwrap();
    let gate = common::StreamGate::block(&held);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(access);
        let _ = done_tx.send(());
    });
    let early = done_rx.recv_timeout(Duration::from_millis(300));
    let opener = gate.release_after(Duration::from_secs(5));
    assert!(
        early.is_err(),
        "control: the last holder's drop returned while the accessor's context was held"
    );
    let opts = CopyOptions {
        policy: Some(FallbackPolicy::Allow),
        ..CopyOptions::default()
    };
    let t0 = Instant::now();
    let copied = copy_peer_with(&src, &mut dst, &sa, &opts);
    let took = t0.elapsed();
    let drop_still_waiting = done_rx.try_recv().is_err();
    opener.join().unwrap();
    let finished = done_rx.recv_timeout(Duration::from_secs(30));
    dropper.join().unwrap();
    let report = copied.unwrap();
    println!(
        "copy_peer GPU1 -> GPU0 during the revocation's wait returned after {took:?} ({}); the drop still waiting then: {drop_still_waiting}",
        report.path
    );
    assert!(
        finished.is_ok(),
        "the drop never returned after the gate opened"
    );
    assert!(
        took < Duration::from_secs(2),
        "copy_peer waited {took:?} for another pair's revocation (the gate opened after 5 s)"
    );
    assert!(
        sa.clone_dtoh(&dst).unwrap() == data,
        "the copy's bytes differ"
    );
    assert_eq!(registry_state(&b, &a), None, "the grant was not released");
}

/// Review of 2026-12-02 (minor): cudarc orders a copy after its buffers' pending work with
/// `cuStreamWaitEvent` and, failing, only records the error in the stream's context; a copy
/// enqueued anyway would run unordered. `copy_peer` must return that error before copying.
/// The failure is stood in for by recording one in the destination's context (what cudarc
/// does when the wait fails): on the code before the fix the copy ran and returned `Ok`; after
/// it, `Error::Cuda` naming `cuStreamWaitEvent`, and nothing is copied.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_copy_peer_returns_a_failed_wait_for_its_buffers() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.new_stream().unwrap(), b.new_stream().unwrap());
    let data = random((1 << 20) + 17);
    let src = pool_buf(&sa, &data);
    let mut dst = sb.alloc_zeros::<u8>(data.len()).unwrap();
    sa.synchronize().unwrap();
    sb.synchronize().unwrap();
    b.record_err::<()>(Err(gpudirect::cudarc::driver::DriverError(
        sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
    )));
    let opts = CopyOptions {
        policy: Some(FallbackPolicy::Allow),
        ..CopyOptions::default()
    };
    let r = copy_peer_with(&src, &mut dst, &sb, &opts);
    let leftover = b.check_err();
    println!("copy_peer with a failed wait recorded: {r:?}; left in the context: {leftover:?}");
    match r {
        Err(Error::Cuda { op, .. }) => assert_eq!(op, "cuStreamWaitEvent"),
        other => panic!("the copy ran past a failed cuStreamWaitEvent: {other:?}"),
    }
    assert!(
        sb.clone_dtoh(&dst).unwrap().iter().all(|&x| x == 0),
        "bytes were copied after the failed wait"
    );
}

/// Issue 9 item 16: a grant found already enabled (by someone else) leaves no record behind
/// once its last holder is gone, so a later copy of `cuMemAlloc` memory is not reported direct
/// on gpudirect's say-so after the access was turned off by its owner (old: `known_on` stayed
/// true, keyed by the raw context handle).
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_peer_access_record_does_not_outlive_its_holders() {
    let _g = serial();
    let (a, b) = two_gpus();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let src = DeviceBuffer::<u8>::alloc_zeros(&sa, 4096).unwrap();
    let mut dst = DeviceBuffer::<u8>::alloc_zeros(&sb, 4096).unwrap();
    // "Someone else" enables context access; a PeerAccess then finds it on.
    assert_eq!(raw_ctx_access(&b, &a, true), sys::CUresult::CUDA_SUCCESS);
    let held = PeerAccess::enable(&b, &a).unwrap();
    let r = plan_copy(&src.as_view(), &mut dst.as_view_mut(), &sb).unwrap();
    assert_eq!(r.src_memory, MemoryKind::Legacy);
    assert!(r.path.is_direct(), "{}", r.path);
    drop(held);
    // Its owner turns it off again: gpudirect must not still vouch for it.
    assert_eq!(raw_ctx_access(&b, &a, false), sys::CUresult::CUDA_SUCCESS);
    let r = plan_copy(&src.as_view(), &mut dst.as_view_mut(), &sb).unwrap();
    assert!(
        !r.path.is_direct(),
        "a copy is reported direct on a record that outlived its holders: {}",
        r.path
    );
    assert_eq!(
        registry_state(&b, &a),
        None,
        "the record outlived its holders"
    );
}

/// The calling thread's current CUDA context, raw (null: none).
fn current_context() -> sys::CUcontext {
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; libcuda is initialised (a context exists).
    assert_eq!(
        unsafe { sys::cuCtxGetCurrent(&mut c) },
        sys::CUresult::CUDA_SUCCESS
    );
    c
}

fn unbind_context() {
    // SAFETY: null unbinds the calling thread's context.
    assert_eq!(
        unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) },
        sys::CUresult::CUDA_SUCCESS
    );
}

/// Issue 9 item 16: P2P allocation and IPC export calls leave the calling thread's current
/// context as they found it (before: the stream's context stayed bound). One GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_p2p_calls_leave_the_current_context_alone() {
    let _g = serial();
    let a = one_gpu();
    let s = a.default_stream();
    let check = |what: &str| {
        let c = current_context();
        assert!(
            c.is_null(),
            "{what} left a context ({c:?}) current on a thread that had none"
        );
    };
    unbind_context();
    let buf = DeviceBuffer::<u8>::alloc_zeros(&s, 4096).unwrap();
    check("DeviceBuffer::alloc_zeros");
    // SAFETY: the handle goes to no other process.
    let _h = unsafe { p2p::ipc::IpcMemHandle::export(&buf) }.unwrap();
    check("IpcMemHandle::export");
    drop(buf);
    check("DeviceBuffer's drop");
    let pool = p2p::ipc::SharedPool::new(&a).unwrap();
    check("SharedPool::new");
    let slice = pool.alloc_zeros::<u8>(&s, 4096).unwrap();
    check("SharedPool::alloc_zeros");
    // cudarc frees a slice with cuMemFreeAsync without binding its context: on a thread with no
    // current context that free fails and leaks (compute-sanitizer listed it). Bind first.
    a.bind_to_thread().unwrap();
    drop(slice);
    unbind_context();
    drop(pool);
    check("SharedPool's drop");
    let v = p2p::VmmBuffer::<u8>::alloc_zeros(&s, 4096).unwrap();
    check("VmmBuffer::alloc_zeros");
    drop(v);
    check("VmmBuffer's drop");
}

//! `read_to_gpu` in a loop with the device nearly full (`gpu_*`: one CUDA GPU). Run on the GPU
//! machine: `.device/run --include-ignored gpu_storage_near_full`.
//!
//! A binary of its own: it fills the device's memory, so no other test may run beside it (the
//! tests of `storage_gpu_memory` measure the free memory, and would fail it or it them).

mod common;

use gpudirect::storage::read_to_gpu;
use gpudirect::TransferPath;

/// Buffers of 64 MiB or more that `read_to_gpu` allocates are `cuMemAlloc` memory, and cudarc
/// frees them with `cuMemFreeAsync` on their stream: the memory comes back only once the stream
/// reached the free, where a stream-ordered pool allocation on the same stream would reuse it at
/// once. With the device filled so that one buffer of the file's size fits and a second does
/// not (a filler leaves room for one plus a margin smaller than one), a loop of 20
/// `read_to_gpu` calls, each result checked byte for byte and dropped with no synchronize of
/// its own, must never fail: a `cuMemAlloc` that runs out of memory waits for its stream's
/// queued frees and tries once more.
///
/// On the code before the retry (`2a3c340`) it failed on the H200 (sixth session of
/// 2026-12-01): "iteration 1: read_to_gpu failed with one buffer's room free: cuMemAlloc
/// failed: CUDA_ERROR_OUT_OF_MEMORY"; with the retry (then after a `cuCtxSynchronize`) it
/// passed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_near_full_read_to_gpu_loop_reuses_dropped_buffers() {
    let ctx = common::need_gpu(common::test_gpu());
    let stream = ctx.new_stream().expect("cuStreamCreate");
    let path = common::scratch("near-full");
    // Not a multiple of 2 MiB (the allocation granularity) nor of 4 KiB.
    let n: usize = (192 << 20) + 4096 * 3 + 17;
    let model = common::random(n);
    std::fs::write(&path, &model).unwrap();
    let free = || ctx.mem_get_info().expect("cuMemGetInfo").0;
    // A first read creates what stays for the process (the engine, its ring and streams, the
    // driver's own allocations), so the filler is sized without them.
    let (b, r) = read_to_gpu::<u8>(&path, &stream).unwrap();
    assert_eq!(
        r.path.path,
        TransferPath::Posix,
        "this test needs gpudirect's engine (its segment ring allocates the buffer with cuMemAlloc), not {}",
        r.path
    );
    assert!(
        stream.clone_dtoh(&b).unwrap() == model,
        "the first read differs"
    );
    drop(b);
    ctx.synchronize().unwrap();
    let margin = n / 2;
    let room = free();
    assert!(
        room > n + margin + (256 << 20),
        "too little free device memory for this test: {} MiB",
        room >> 20
    );
    let filler = stream
        .alloc_zeros::<u8>(room - n - margin)
        .expect("allocating the filler");
    stream.synchronize().unwrap();
    let left = free();
    eprintln!(
        "filler of {} MiB: {} MiB free, for buffers of {} MiB",
        filler.len() >> 20,
        left >> 20,
        n >> 20
    );
    assert!(
        left >= n && left < 2 * n,
        "the filler did not leave room for exactly one buffer of {n} B: {left} B free"
    );
    for i in 0..20 {
        let (b, r) = read_to_gpu::<u8>(&path, &stream).unwrap_or_else(|e| {
            panic!("iteration {i}: read_to_gpu failed with one buffer's room free: {e}")
        });
        assert_eq!((r.bytes, b.len()), (n, n), "iteration {i}");
        assert!(
            stream.clone_dtoh(&b).unwrap() == model,
            "iteration {i}: the buffer differs from the file"
        );
        drop(b);
    }
    drop(filler);
    stream.synchronize().unwrap();
    ctx.check_err()
        .unwrap_or_else(|e| panic!("an error was recorded in the context: {e}"));
    std::fs::remove_file(&path).unwrap();
}

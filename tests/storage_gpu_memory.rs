//! Device memory that storage calls allocate for their caller is given back (`gpu_*`: one CUDA
//! GPU). Run on the GPU machine: `.device/run --include-ignored gpu_storage_memory`.
//!
//! A binary of its own: it asks the driver for the free memory (`cuMemGetInfo`) between its
//! reads, and next to the stream-ordering tests of `storage_gpu` (which hold streams with host
//! functions) those tests failed in 4 of 5 passes of that binary on the H200 and passed in the
//! one pass without this test (which call of this test waited behind the held streams is not established).

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gpudirect::storage::read_to_gpu;

const HINT: &str = "needs a CUDA GPU: run on the GPU machine with `.device/run --include-ignored gpu_storage_memory`";

fn gpu(ordinal: usize) -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = gpudirect::cuda::context(ordinal)
        .unwrap_or_else(|e| panic!("{HINT} ({}): {e}", common::GPU_HINT));
    let stream = ctx.new_stream().expect("cuStreamCreate");
    (ctx, stream)
}

fn to_host(stream: &Arc<CudaStream>, dev: &CudaSlice<u8>) -> Vec<u8> {
    if dev.is_empty() {
        return Vec::new();
    }
    stream.clone_dtoh(dev).unwrap()
}

use common::random_seeded as random;

/// Runs `round(0)` (which creates what stays for the process: the engine, the driver's own
/// allocations for the copies), then six more rounds, and asserts that the free device memory
/// came back to within 150 MiB of what it was after round 0 (`what`: what a round does, for
/// the message). The free memory is the device's, so the tests of this binary take turns: one
/// test's rounds would hold memory inside another's measurement. Both failed under
/// compute-sanitizer on the H200 without the turns (512 and 706 MiB short; the rounds run
/// slowly there and overlap).
fn assert_given_back(ctx: &CudaContext, what: &str, round: impl Fn(usize)) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let free = || ctx.mem_get_info().expect("cuMemGetInfo").0;
    round(0);
    let before = free();
    for k in 1..=6 {
        round(k);
    }
    let after = free();
    assert!(
        after + (150 << 20) >= before,
        "device memory was not given back: {} MiB free before six more {what}, {} MiB after",
        before >> 20,
        after >> 20
    );
}

/// The buffers `read_to_gpu` allocates are cudarc's to free: a large one (allocated while the
/// engine already reads) and a small one, read and dropped again and again, give their memory
/// back with no error recorded in the context, and each round's bytes are the file's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_memory_read_to_gpu_buffers_are_given_back_on_drop() {
    let (ctx, stream) = gpu(0);
    let d = common::scratch_dir("gpu-given-back");
    let big = d.join("big.bin");
    let small = d.join("small.bin");
    let big_model = random((200 << 20) + 4 * 777, 31);
    let small_model = random((1 << 20) + 5, 32);
    std::fs::write(&big, &big_model).unwrap();
    std::fs::write(&small, &small_model).unwrap();
    let expect: Vec<u32> = big_model
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    let round = |round: usize| {
        let (b, r) = read_to_gpu::<u32>(&big, &stream).unwrap();
        assert_eq!(r.bytes, big_model.len(), "round {round}");
        assert!(
            stream.clone_dtoh(&b).unwrap() == expect,
            "round {round}: big file's data differs"
        );
        let (s, _) = read_to_gpu::<u8>(&small, &stream).unwrap();
        assert!(
            to_host(&stream, &s) == small_model,
            "round {round}: small file's data differs"
        );
        drop((b, s));
        stream.synchronize().unwrap();
        ctx.check_err()
            .unwrap_or_else(|e| panic!("round {round}: freeing the buffers failed: {e}"));
    };
    assert_given_back(&ctx, "rounds of 200 MiB reads", round);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A checkpoint's one allocation (`cuMemAlloc` from 64 MiB, freed by cudarc) is given back
/// when the `Checkpoint` drops: a 200 MiB checkpoint loaded and dropped again and again leaves
/// the free memory where it was, with no error recorded in the context, and each round's
/// tensors are the file's bytes.
#[cfg(feature = "safetensors")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_memory_checkpoint_allocation_is_given_back_on_drop() {
    use gpudirect::safetensors::LoadOptions;
    let (ctx, stream) = gpu(0);
    let d = common::scratch_dir("gpu-ck-given-back");
    let path = d.join("model.safetensors");
    let a = random(150 << 20, 41);
    let b = random((50 << 20) + 3, 42);
    let views = vec![
        (
            "a".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![a.len()], &a)
                .unwrap(),
        ),
        (
            "b".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![b.len()], &b)
                .unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let round = |round: usize| {
        let ck = LoadOptions::new().load(&path, &stream).unwrap();
        for (name, want) in [("a", &a), ("b", &b)] {
            let v = ck.tensor(name).unwrap().bytes();
            assert!(
                stream.clone_dtoh(&v).unwrap() == *want,
                "round {round}: tensor {name} differs"
            );
        }
        drop(ck);
        stream.synchronize().unwrap();
        ctx.check_err()
            .unwrap_or_else(|e| panic!("round {round}: freeing the checkpoint failed: {e}"));
    };
    assert_given_back(&ctx, "loads of a 200 MiB checkpoint", round);
    std::fs::remove_dir_all(&d).unwrap();
}

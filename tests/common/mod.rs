//! Fixtures shared by the integration tests: random data, scratch paths under
//! `GPUDIRECT_TEST_DIR`, and openers for the hardware a test needs. An opener panics with a
//! setup hint when the hardware is missing: a hardware test run without it fails, it never
//! passes by skipping (CONTRIBUTING.md, "Tests").
//!
//! Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use gpudirect::cudarc::driver::CudaContext;
use rand::{RngCore, SeedableRng};

/// What a `gpu_*` test needs and how to get it.
pub const GPU_HINT: &str = "needs a CUDA GPU: run on a machine with the NVIDIA driver and a GPU \
                            (check nvidia-smi, CUDA_VISIBLE_DEVICES) with --include-ignored \
                            (see CONTRIBUTING.md, \"Tests\")";

/// What a `multi_gpu_*` test needs.
pub const TWO_GPU_HINT: &str = "needs 2 peer-capable CUDA GPUs (ordinals 0 and 1): run on the \
                                2-GPU machine (check nvidia-smi topo -m, CUDA_VISIBLE_DEVICES)";

/// `n` random bytes (never all zeros in practice): test data whose every byte is checked.
pub fn random(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}

/// `n` random bytes from `seed`, the same on every run.
pub fn random_seeded(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// `GPUDIRECT_TEST_DIR` (created if missing), else the system temp dir.
pub fn test_dir() -> PathBuf {
    let d = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A file path in [`test_dir`] unique to this process and `name` (not created).
pub fn scratch(name: &str) -> PathBuf {
    test_dir().join(format!("gpudirect-{name}-{}", std::process::id()))
}

/// A fresh, empty directory in [`test_dir`] unique to this process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = scratch(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The GPU the tests run on: `GPUDIRECT_TEST_GPU`, else 0.
pub fn test_gpu() -> usize {
    std::env::var("GPUDIRECT_TEST_GPU")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The primary context of GPU `ordinal`, or a panic with [`GPU_HINT`].
pub fn need_gpu(ordinal: usize) -> Arc<CudaContext> {
    gpudirect::cuda::context(ordinal).unwrap_or_else(|e| panic!("{GPU_HINT}: {e}"))
}

/// GPUs 0 and 1, or a panic with [`TWO_GPU_HINT`].
pub fn need_two_gpus() -> (Arc<CudaContext>, Arc<CudaContext>) {
    let n = gpudirect::cuda::device_count().unwrap_or_else(|e| panic!("{TWO_GPU_HINT}: {e}"));
    assert!(n >= 2, "{TWO_GPU_HINT}: this process sees {n} device(s)");
    (need_gpu(0), need_gpu(1))
}

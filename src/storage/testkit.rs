//! Fixtures the storage room's own unit tests share (`cfg(test)`): the GPU a `gpu_*` test
//! needs (or a panic with the setup hint), random data, and scratch files under
//! `GPUDIRECT_TEST_DIR`.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use rand::{RngCore, SeedableRng};

/// GPU 0's context, or a panic that says how to run a `gpu_*` test.
pub(crate) fn gpu() -> Arc<CudaContext> {
    crate::cuda::context(0).unwrap_or_else(|e| {
        panic!("this test needs a CUDA GPU ({e}): run it on a GPU machine, see CONTRIBUTING.md")
    })
}

/// `n` random bytes from `seed`.
pub(crate) fn random(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// `gpudirect-{name}-{pid}` in `GPUDIRECT_TEST_DIR` (else the temporary directory), which is
/// created.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("gpudirect-{name}-{}", std::process::id()))
}

/// A scratch file `name` of `n` random bytes from `seed`: its path and its bytes.
pub(crate) fn random_file(name: &str, n: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let p = scratch(name);
    let data = random(n, seed);
    std::fs::write(&p, &data).unwrap();
    (p, data)
}

/// Runs the lib test `test` (its full path) alone in a child process of this test binary with
/// `env` set to `value`, and returns the child's stdout and stderr together, after asserting
/// that it exited successfully (the message holds that output).
pub(crate) fn run_test_in_child(test: &str, env: &str, value: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env(env, value)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child failed:\n{text}");
    text
}

/// Lowers this process's soft `RLIMIT_NOFILE` to `n`: only in a child process that runs one
/// test alone ([`run_test_in_child`]), as the limit is the whole process's.
pub(crate) fn set_soft_nofile_limit(n: libc::rlim_t) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out- and in-pointers.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = n;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

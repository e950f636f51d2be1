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

/// Held by tests of one binary that hold a stream at a [`StreamGate`] while other tests of the
/// same process may wait for all the context's work (a drop that calls `cuCtxSynchronize`). On
/// the H200, twice in the parallel suite, `p2p_ipc` ran until its gate's 30 s limit with the
/// VMM export case misreported, most likely because its `VmmBuffer::alloc_zeros` waited in the
/// driver, beside such a drop, behind the gate it had not yet released: such tests run one at a
/// time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Grows `ctx` past the driver's first wait, at a context's 36th stream: on the H200 (driver
/// 580) creating that stream, and every 43rd or so after it (79th, 122nd, ...), waited for all
/// of the context's work (`scripts/probes/streams.py`; CONTRIBUTING.md, "CUDA facts"), whoever
/// created it. Tests that hold a stream and time gpudirect's calls call this first, so that the
/// calls they time do not make that stream: what they time is then gpudirect's own waits (as
/// long as the binary makes fewer than about 40 more streams per context).
/// Creates 40 streams in `ctx` (kept for the process) the first time per context.
pub fn grow_streams_past_the_drivers_first_growth(ctx: &Arc<CudaContext>) {
    type Grown = Vec<(usize, Vec<Arc<gpudirect::cudarc::driver::CudaStream>>)>;
    static GROWN: std::sync::Mutex<Grown> = std::sync::Mutex::new(Vec::new());
    let mut g = GROWN.lock().unwrap_or_else(|p| p.into_inner());
    let key = ctx.cu_ctx() as usize;
    if !g.iter().any(|(k, _)| *k == key) {
        let streams = (0..40)
            .map(|_| ctx.new_stream().expect("cuStreamCreate"))
            .collect();
        g.push((key, streams));
    }
}

/// Holds a stream at a host function until released (or 30 s pass), like a long kernel:
/// work queued on the stream after [`StreamGate::block`] waits for [`StreamGate::release`] (or
/// the drop).
pub struct StreamGate(Option<std::sync::mpsc::Sender<()>>);

unsafe extern "C" fn wait_for_release(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the Box<Receiver> leaked by `StreamGate::block`, handed over exactly
    // once; the callback makes no CUDA call.
    let rx = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
    let _ = rx.recv_timeout(std::time::Duration::from_secs(30));
}

impl StreamGate {
    pub fn block(stream: &gpudirect::cudarc::driver::CudaStream) -> StreamGate {
        use gpudirect::cudarc::driver::sys;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Box::into_raw(Box::new(rx));
        // SAFETY: the stream is alive; on success the callback owns `rx`.
        let rc =
            unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(wait_for_release), rx.cast()) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: a failed launch did not hand `rx` over.
            drop(unsafe { Box::from_raw(rx) });
            panic!("cuLaunchHostFunc: {rc:?}");
        }
        StreamGate(Some(tx))
    }

    pub fn release(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }

    /// Releases the gate from another thread after `after` (so a test that waits behind it
    /// fails in seconds, not at the gate's 30 s limit); join the handle to wait for that.
    pub fn release_after(mut self, after: std::time::Duration) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            self.release();
        })
    }
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        self.release();
    }
}

/// Writes `dir/huge.safetensors`: one `U8` tensor `huge` of 1 TiB, claimed by a sparse file
/// (the header, then a hole): a checkpoint larger than any GPU, for the memory refusals.
pub fn huge_sparse_checkpoint(dir: &std::path::Path) -> PathBuf {
    let h = r#"{"huge":{"dtype":"U8","shape":[1099511627776],"data_offsets":[0,1099511627776]}}"#;
    let p = dir.join("huge.safetensors");
    let mut f = std::fs::File::create(&p).unwrap();
    std::io::Write::write_all(&mut f, &(h.len() as u64).to_le_bytes()).unwrap();
    std::io::Write::write_all(&mut f, h.as_bytes()).unwrap();
    f.set_len(8 + h.len() as u64 + (1u64 << 40)).unwrap();
    p
}

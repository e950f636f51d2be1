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

/// With `GPUDIRECT_TEST_UDEV_FIX=1` (as root), the udev record cuFile looks for, for the
/// block device holding `path` (see tests/storage_cufile_gpu.rs).
pub(crate) fn udev_fix(path: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    if std::env::var("GPUDIRECT_TEST_UDEV_FIX").map_or(true, |v| v != "1") {
        return;
    }
    let dev = std::fs::metadata(path).unwrap().dev();
    let record = format!("/run/udev/data/b{}:{}", libc::major(dev), libc::minor(dev));
    if std::path::Path::new(&record).exists() {
        return;
    }
    let fs = crate::storage::cufile::filesystem_type(path).unwrap_or_else(|| "ext4".into());
    std::fs::create_dir_all("/run/udev/data").expect("mkdir /run/udev/data (run as root)");
    let tmp = format!("{record}.tmp{}", std::process::id());
    std::fs::write(
        &tmp,
        format!("E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE={fs}\n"),
    )
    .unwrap();
    std::fs::rename(&tmp, &record).unwrap();
}

/// Runs the lib test `test` (its full path) alone in a child process of this test binary (an
/// ignored one too: `--include-ignored`) with the environment variables `envs` set, and
/// returns the child's stdout and stderr together, after asserting that it exited
/// successfully (the message holds that output).
pub(crate) fn run_test_in_child(test: &str, envs: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--include-ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .envs(envs.iter().copied())
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

/// Ends the capture this thread began on `stream` (`cuStreamEndCapture`, no instantiation) and
/// says what it captured: the graph's node count, or why ending it failed (a capture that the
/// call invalidated, say). A call refused up front captures nothing: `Ok(0)`.
pub(crate) fn end_capture_counting(
    stream: &cudarc::driver::CudaStream,
) -> std::result::Result<usize, String> {
    // SAFETY: the stream is alive and capturing, begun on this thread (its context current).
    unsafe { crate::cuda::result::stream::end_capture_node_count(stream.cu_stream()) }
        .map_err(|e| format!("ending the capture failed: {e}"))
}

/// One call under test by [`refused_on_a_capturing_stream`]: `(case, file, its path, a path it
/// may save to, the device buffer, its stream, the length)` → the bytes it moved.
pub(crate) type CaptureCall<'a> = dyn Fn(
        &str,
        &Arc<crate::storage::GpuFile>,
        &std::path::Path,
        &std::path::Path,
        &mut cudarc::driver::CudaSlice<u8>,
        &Arc<cudarc::driver::CudaStream>,
        usize,
    ) -> crate::error::Result<usize>
    + Sync
    + 'a;

/// Turns a [`refused_on_a_capturing_stream`] case's random bytes into its file: `(case, path,
/// bytes)` → the file's bytes.
pub(crate) type CapturePrepare<'a> = dyn Fn(&str, &std::path::Path, Vec<u8>) -> Vec<u8> + 'a;

/// The capture harness of the batch and checkpoint tests: for each `(case, len)`, a random file
/// of `len` bytes (turned into what the case reads by `prepare(case, path, bytes)`, which
/// returns the file's bytes), a device buffer of other random bytes on a new stream, a capture
/// begun on that stream (relaxed mode), and `call` made on another thread; after 5 s without
/// an answer the capture is ended here. Each call must answer within the 5 s with
/// [`Error::Unsupported`](crate::error::Error::Unsupported) naming the call (the case's name up
/// to " (") and the capture, put nothing into the caller's graph (the capture ends with no
/// node: [`end_capture_counting`]), leave the buffer and the file as they were, write no file at
/// the save path and leave no temporary beside it, and leave the stream usable. Returns what
/// went wrong, one line per finding.
pub(crate) fn refused_on_a_capturing_stream(
    ctx: &Arc<CudaContext>,
    cases: &[(&str, usize)],
    prepare: &CapturePrepare<'_>,
    call: &CaptureCall<'_>,
) -> Vec<String> {
    use crate::error::Error;
    use crate::storage::{Backend, GpuFile};
    use cudarc::driver::sys::CUstreamCaptureMode;
    use std::time::{Duration, Instant};
    let mut bad = Vec::new();
    for &(case, len) in cases {
        let what = format!("{case}, {len} B");
        // A stale error an earlier case left in the context object would fail this case's
        // setup: taken here.
        let _ = ctx.check_err();
        let stream = ctx.new_stream().unwrap();
        let name = format!(
            "capturing-batch-{}-{len}",
            case.replace([':', ' ', '(', ')'], "")
        );
        let (p, data) = random_file(&name, len, 103);
        let data = prepare(case, &p, data);
        let out = scratch(&format!("{name}-saved"));
        let f = Arc::new(
            GpuFile::options()
                .backend(Backend::Engine)
                .write(true)
                .open(&p)
                .unwrap(),
        );
        let other = random(len, 104);
        let mut dev = stream.clone_htod(&other).unwrap();
        stream.synchronize().unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        let t0 = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        let (r, late, captured) = std::thread::scope(|sc| {
            let (f, p, out, dev, s, call) = (&f, &p, &out, &mut dev, &stream, &call);
            sc.spawn(move || {
                let _ = tx.send(call(case, f, p, out, dev, s, len));
            });
            let early = rx.recv_timeout(Duration::from_secs(5));
            // Ended by the thread that began it; a call waiting for the stream can return.
            let captured = end_capture_counting(&stream);
            match early {
                Ok(r) => (r, None, captured),
                Err(_) => {
                    let r = rx
                        .recv_timeout(Duration::from_secs(120))
                        .expect("no answer two minutes after the capture ended");
                    (r, Some(t0.elapsed()), Ok(0))
                }
            }
        });
        match captured {
            Ok(0) => {}
            Ok(n) => bad.push(format!(
                "{what}: {n} operations went into the caller's graph before the call returned"
            )),
            Err(e) => bad.push(format!("{what}: {e}")),
        }
        if let Some(t) = late {
            bad.push(format!(
                "{what}: returned only {t:?} after the call, once the capture was ended: {r:?}"
            ));
        }
        let name_of = case.split(" (").next().unwrap();
        match &r {
            Err(e @ Error::Unsupported { what: w, .. }) => {
                if !w.contains(name_of) || !w.contains("capturing a CUDA graph") {
                    bad.push(format!("{what}: the refusal does not name the call: {e}"));
                }
            }
            r => bad.push(format!("{what}: not refused as unsupported: {r:?}")),
        }
        // Reported, not unwrapped: on the code before the fix the capture leaves errors
        // behind, and every case's message should come out.
        if let Err(e) = stream.synchronize() {
            bad.push(format!("{what}: the stream after the capture: {e}"));
        } else {
            match stream.clone_dtoh(&dev) {
                Ok(back) if back == other => {}
                Ok(_) => bad.push(format!("{what}: the buffer changed")),
                Err(e) => bad.push(format!("{what}: reading the buffer back: {e}")),
            }
        }
        if std::fs::read(&p).unwrap() != data {
            bad.push(format!("{what}: the file changed"));
        }
        if out.exists() {
            bad.push(format!("{what}: {} was written", out.display()));
            std::fs::remove_file(&out).unwrap();
        }
        let tmp = format!(".{}.", out.file_name().unwrap().to_string_lossy());
        for e in std::fs::read_dir(out.parent().unwrap()).unwrap().flatten() {
            if e.file_name().to_string_lossy().starts_with(&tmp) {
                bad.push(format!("{what}: the save left {:?} behind", e.path()));
                let _ = std::fs::remove_file(e.path());
            }
        }
        drop(f);
        std::fs::remove_file(&p).unwrap();
    }
    bad
}

/// Holds a stream at a host function until released (or 30 s pass), like a long kernel: work
/// queued on the stream after [`StreamGate::block`] waits for [`StreamGate::release`] (or the
/// drop). Hold [`HOST_FUNCTION_GATES`](crate::cuda::HOST_FUNCTION_GATES) while one is in use:
/// CUDA may run every host function of the process on one thread.
pub(crate) struct StreamGate(Option<std::sync::mpsc::Sender<()>>);

/// The host function of a [`StreamGate`]: waits for the release (30 s at most).
unsafe extern "C" fn wait_for_release(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the Box<Receiver> leaked by `StreamGate::block`, handed over exactly
    // once; the callback makes no CUDA call.
    let rx = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
    let _ = rx.recv_timeout(std::time::Duration::from_secs(30));
}

impl StreamGate {
    /// Holds `stream` from now on (its context is made current on this thread).
    pub(crate) fn block(stream: &cudarc::driver::CudaStream) -> StreamGate {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Box::into_raw(Box::new(rx));
        stream.context().bind_to_thread().unwrap();
        // SAFETY: the stream is alive, its context current; the callback makes no CUDA call
        // and owns `rx` once launched.
        let launched = unsafe {
            crate::cuda::result::stream::launch_host_func(
                stream.cu_stream(),
                wait_for_release,
                rx.cast(),
            )
        };
        if let Err(e) = launched {
            // SAFETY: a failed launch did not hand `rx` over.
            drop(unsafe { Box::from_raw(rx) });
            panic!("{e}");
        }
        StreamGate(Some(tx))
    }

    /// Lets the stream go on.
    pub(crate) fn release(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        self.release();
    }
}

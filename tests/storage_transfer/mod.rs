//! Non-blocking, stream-ordered transfers on a GPU (`gpu_transfer_*`): `GpuFile::read_async`,
//! `read_exact_async` and `write_async` order after the work pending on the buffer (on its
//! stream, and on other streams through cudarc's events) without synchronizing the caller's
//! stream, the bytes are in place when the buffer comes back, later work sees them, and an
//! a waiting transfer holds up no other and can be cancelled. (A module of the storage_gpu
//! test binary, so the GPU machine stages no extra binary. The tokio stall is measured in
//! tests/storage_async.rs, a binary of its own, so no other test loads the CPUs meanwhile.)
//!
//! Pending work is held with a host-function gate on a stream (`cuLaunchHostFunc` waiting
//! for a channel), as in `src/storage/cufile/stream.rs`'s tests.
//!
//! Run on a GPU machine from the project root: `bash scripts/gpu-suite async` (these tests
//! one at a time, and the stall), or `bash .device/run --include-ignored gpu_transfer`.

use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use gpudirect::storage::GpuFile;

use crate::common::{self, StreamGate};

fn gpu() -> (Arc<CudaStream>, Arc<CudaStream>) {
    let ctx = common::need_gpu(common::test_gpu());
    (ctx.new_stream().unwrap(), ctx.new_stream().unwrap())
}

/// The sizes each test runs: the engine (segment ring; lanes for writes) and the small path.
const SIZES: [usize; 2] = [(48 << 20) + 4096 + 17, 200 << 10];

/// A read queued behind pending work on the buffer's stream (a gate, then a copy of other
/// bytes into the buffer) returns at once, is not done while the gate holds, and after the
/// gate opens the buffer holds the file's bytes: the read ran after the pending copy, not
/// before it (which would leave the copy's bytes). Later work on the stream sees the bytes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_read_orders_after_pending_work_on_its_stream() {
    let (s, _) = gpu();
    for (k, &len) in SIZES.iter().enumerate() {
        let p = common::scratch(&format!("xfer-order-read-{k}"));
        let data = common::random_seeded(len, 100 + k as u64);
        std::fs::write(&p, &data).unwrap();
        let f = Arc::new(GpuFile::open(&p).unwrap());
        let other = s
            .clone_htod(&common::random_seeded(len, 200 + k as u64))
            .unwrap();
        let mut buf = s.alloc_zeros::<u8>(len).unwrap();
        s.synchronize().unwrap();
        let mut gate = StreamGate::block(&s);
        s.memcpy_dtod(&other, &mut buf).unwrap();
        let t0 = Instant::now();
        let t = f.read_exact_async(buf, 0);
        let call = t0.elapsed();
        std::thread::sleep(Duration::from_millis(300));
        let early = t.is_done();
        gate.release();
        let (r, buf) = t.wait();
        let r = r.unwrap();
        assert!(
            !early,
            "{len} bytes: the read finished while work queued before it was held"
        );
        assert!(
            call < Duration::from_millis(50),
            "{len} bytes: read_exact_async blocked {call:?} behind the stream's pending work"
        );
        assert_eq!(r.bytes, len);
        assert!(r.elapsed >= Duration::from_millis(300), "{r:?}");
        // Later work on the stream (a copy out of the buffer) sees the file's bytes.
        let mut copy = s.alloc_zeros::<u8>(len).unwrap();
        s.memcpy_dtod(&buf, &mut copy).unwrap();
        let back = s.clone_dtoh(&copy).unwrap();
        assert!(
            back == data,
            "{len} bytes: the buffer does not hold the file: the read did not order after the copy queued before it"
        );
        eprintln!("{len} bytes: read_exact_async returned in {call:?}; {r}");
        std::fs::remove_file(&p).unwrap();
    }
}

/// The blocking call orders the same way: a read behind a gate (opened by another thread
/// after 200 ms) and a copy on the buffer's stream returns the file's bytes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_blocking_read_orders_after_pending_work_on_its_stream() {
    let (s, _) = gpu();
    for (k, &len) in SIZES.iter().enumerate() {
        let p = common::scratch(&format!("xfer-order-blocking-{k}"));
        let data = common::random_seeded(len, 300 + k as u64);
        std::fs::write(&p, &data).unwrap();
        let f = GpuFile::open(&p).unwrap();
        let other = s
            .clone_htod(&common::random_seeded(len, 400 + k as u64))
            .unwrap();
        let mut buf = s.alloc_zeros::<u8>(len).unwrap();
        s.synchronize().unwrap();
        let gate = StreamGate::block(&s);
        s.memcpy_dtod(&other, &mut buf).unwrap();
        let opener = gate.release_after(Duration::from_millis(200));
        let r = f.read_exact_to_device(&mut buf, 0).unwrap();
        opener.join().unwrap();
        assert_eq!(r.bytes, len);
        assert!(
            s.clone_dtoh(&buf).unwrap() == data,
            "{len} bytes: the blocking read did not order after the copy queued before it"
        );
        std::fs::remove_file(&p).unwrap();
    }
}

/// A read of a buffer that another stream is still reading (behind a gate) waits for that
/// reader (cudarc's read event: write-after-read), and a later reader on the other stream sees
/// the file's bytes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_read_waits_for_readers_of_the_buffer_on_other_streams() {
    let (s, t) = gpu();
    for (k, &len) in SIZES.iter().enumerate() {
        let p = common::scratch(&format!("xfer-order-cross-{k}"));
        let data = common::random_seeded(len, 500 + k as u64);
        std::fs::write(&p, &data).unwrap();
        let f = Arc::new(GpuFile::open(&p).unwrap());
        let old = common::random_seeded(len, 600 + k as u64);
        let buf: CudaSlice<u8> = s.clone_htod(&old).unwrap();
        let mut snapshot = t.alloc_zeros::<u8>(len).unwrap();
        s.synchronize().unwrap();
        t.synchronize().unwrap();
        let mut gate = StreamGate::block(&t);
        t.memcpy_dtod(&buf, &mut snapshot).unwrap();
        let tr = f.read_exact_async(buf, 0);
        std::thread::sleep(Duration::from_millis(200));
        let early = tr.is_done();
        gate.release();
        let (r, buf) = tr.wait();
        r.unwrap();
        assert!(
            !early,
            "{len} bytes: the read finished while a reader of the buffer was held"
        );
        assert!(
            t.clone_dtoh(&snapshot).unwrap() == old,
            "{len} bytes: the other stream's earlier reader saw the file's bytes: the read overwrote the buffer under it"
        );
        let mut later = t.alloc_zeros::<u8>(len).unwrap();
        t.memcpy_dtod(&buf, &mut later).unwrap();
        assert!(
            t.clone_dtoh(&later).unwrap() == data,
            "{len} bytes: a later reader elsewhere"
        );
        std::fs::remove_file(&p).unwrap();
    }
}

/// A write queued behind pending work that fills the source (a gate, then a copy into it)
/// writes the copied bytes, not what the buffer held before.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_write_orders_after_pending_writers_of_its_source() {
    let (s, _) = gpu();
    for (k, &len) in SIZES.iter().enumerate() {
        let p = common::scratch(&format!("xfer-order-write-{k}"));
        let data = common::random_seeded(len, 700 + k as u64);
        let f = Arc::new(GpuFile::create(&p).unwrap());
        let filled = s.clone_htod(&data).unwrap();
        let mut src = s
            .clone_htod(&common::random_seeded(len, 800 + k as u64))
            .unwrap();
        s.synchronize().unwrap();
        let mut gate = StreamGate::block(&s);
        s.memcpy_dtod(&filled, &mut src).unwrap();
        let t0 = Instant::now();
        let t = f.write_async(src, 0);
        let call = t0.elapsed();
        std::thread::sleep(Duration::from_millis(300));
        let early = t.is_done();
        gate.release();
        let (r, _src) = t.wait();
        assert_eq!(r.unwrap().bytes, len);
        assert!(
            !early,
            "{len} bytes: the write finished while its source's writer was held"
        );
        assert!(
            call < Duration::from_millis(50),
            "write_async blocked {call:?}"
        );
        assert!(
            std::fs::read(&p).unwrap() == data,
            "{len} bytes: the file does not hold the copied bytes: the write did not order after the copy queued before it"
        );
        std::fs::remove_file(&p).unwrap();
    }
}

/// A blocking read on another thread, its buffer handed back with its result and how long it
/// took (so the test can bound its wait instead of blocking behind a held stream).
type Timed = (
    gpudirect::Result<gpudirect::storage::IoReport>,
    CudaSlice<u8>,
    Duration,
);

fn read_on_a_thread(f: &Arc<GpuFile>, mut buf: CudaSlice<u8>) -> Receiver<Timed> {
    let (tx, rx) = channel();
    let f = f.clone();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = f.read_exact_to_device(&mut buf, 0);
        let _ = tx.send((r, buf, t0.elapsed()));
    });
    rx
}

/// A read waiting for held work on its buffer's stream does not hold up a read into a buffer
/// of another stream of the same GPU (it waits outside the engine, which runs one job per GPU
/// at a time), and cancelling it ends it while the work is still held: nothing moved, the
/// buffer untouched.
///
/// The file has an engine of its own (`numa_pin(false)`: no other test of this binary uses
/// that engine), warmed up before the stream is held: page-locking memory
/// (`cuMemHostRegister`, which the engine does when its ring is new or grows) is one of the
/// operations CUDA lists as implicitly synchronizing, so a cold engine's first job may wait
/// for any work pending on the device. That cold case is measured first and only printed.
/// No wait is open-ended: a read still running after 5 s is reported as held up, and one
/// still running 10 s after the held stream was released as hung (before, the gate's 30 s
/// timeout released the stream and a hang read as a 30 s wait).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_a_read_waiting_for_its_stream_holds_up_no_other_and_can_be_cancelled() {
    let (s, t) = gpu();
    let len = 48 << 20;
    let p = common::scratch("xfer-hol");
    let data = common::random_seeded(len, 1000);
    std::fs::write(&p, &data).unwrap();
    let f = Arc::new(GpuFile::options().numa_pin(false).open(&p).unwrap());
    let mut other = t.alloc_zeros::<u8>(len).unwrap();
    t.synchronize().unwrap();

    // Cold engine (diagnostic, printed): a read on `t` while `s` is held by a gate.
    let mut cold_gate = StreamGate::block(&s);
    let rx = read_on_a_thread(&f, other);
    other = match rx.recv_timeout(Duration::from_secs(3)) {
        Ok((r, buf, took)) => {
            r.unwrap();
            eprintln!(
                "cold engine: a read on another stream took {took:?} while a stream was held"
            );
            buf
        }
        Err(_) => {
            let t1 = Instant::now();
            cold_gate.release();
            let (r, buf, took) = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("cold engine: a read on another stream still runs 10 s after the held stream was released: a hang");
            r.unwrap();
            eprintln!(
                "cold engine: a read on another stream waited for a held stream: {took:?}, {:?} after the stream was released (the engine's first job page-locks its ring)",
                t1.elapsed()
            );
            buf
        }
    };
    cold_gate.release();
    s.synchronize().unwrap();
    assert!(
        t.clone_dtoh(&other).unwrap() == data,
        "the read on the cold engine"
    );

    // Warm engine: the contract.
    f.warm_up(common::test_gpu()).unwrap();
    let old = common::random_seeded(len, 1001);
    let held: CudaSlice<u8> = s.clone_htod(&old).unwrap();
    let other = t.alloc_zeros::<u8>(len).unwrap();
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    let mut gate = StreamGate::block(&s);
    let waiting = f.read_exact_async(held, 0);
    std::thread::sleep(Duration::from_millis(50));
    let rx = read_on_a_thread(&f, other);
    let (r, other, took) = match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(x) => x,
        Err(_) => {
            let t1 = Instant::now();
            gate.release();
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(_) => panic!(
                    "a read on another stream waited behind a read whose stream is held: still running after 5 s, done {:?} after the stream was released",
                    t1.elapsed()
                ),
                Err(_) => panic!(
                    "a read on another stream hung: still running 10 s after the held stream was released"
                ),
            }
        }
    };
    r.unwrap();
    assert!(
        !waiting.is_done(),
        "the read behind the held stream finished before its work ran"
    );
    assert!(
        t.clone_dtoh(&other).unwrap() == data,
        "the read on the other stream"
    );
    waiting.cancel();
    let ended = waiting.wait_timeout(Duration::from_secs(5));
    gate.release();
    assert!(
        ended,
        "cancelling a read that waits for its stream's work did not end it while the work was held"
    );
    let (r, held) = waiting.wait();
    assert!(
        matches!(r, Err(gpudirect::Error::Cancelled { moved: 0, .. })),
        "{r:?}"
    );
    assert!(
        s.clone_dtoh(&held).unwrap() == old,
        "a read cancelled before it started wrote the buffer"
    );
    eprintln!("a read on another stream took {took:?} while the first waited for its stream");
    std::fs::remove_file(&p).unwrap();
}

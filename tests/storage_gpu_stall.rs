//! A transfer must not wait for GPU work it has nothing to do with, and the engine must do
//! nothing behind the caller's back that does. `cuMemHostUnregister` waits for all the work of
//! the context (`scripts/probes/alloc3.py`: 291 ms behind a stream held for 300 ms) and, while
//! it waits, other threads' `cuEventCreate` waits too (`scripts/probes/pin2.py`: 241 ms). So an
//! unregister in the middle of a read (a slot page-locked for a small job, locked again larger
//! for a bigger one) makes that read wait for another stream's kernels; one at the engine's idle
//! release makes the caller's next event wait. When the other stream waits for the caller (a
//! host function, a flag), either is a deadlock.
//!
//! Its own binary: it needs a fresh engine (nothing page-locked yet) and quiet streams.
//! Run on a GPU machine: `bash .device/run --include-ignored gpu_storage_stall`.

mod common;

use std::time::{Duration, Instant};

use common::StreamGate;
use gpudirect::storage::GpuFile;

/// While another stream is held (a host function waiting for this thread's say-so), a 4 MiB
/// read, then a 64 MiB read (which needs whole slots of the ring the first one locked only in
/// part), each return at once with the file's bytes; then, after longer than the old 5 s idle
/// release, creating an event on this thread does not wait for the held stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_stall_reads_and_idle_engines_wait_for_no_other_stream() {
    let ctx = common::need_gpu(common::test_gpu());
    let stream = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let limit = Duration::from_millis(1000);
    let mut t_reads = Vec::new();
    for (k, len) in [(4usize << 20) + 17, 64 << 20].into_iter().enumerate() {
        let p = common::scratch(&format!("stall-{k}"));
        let data = common::random_seeded(len, 500 + k as u64);
        std::fs::write(&p, &data).unwrap();
        let f = GpuFile::open(&p).unwrap();
        let mut buf = stream.alloc_zeros::<u8>(len).unwrap();
        stream.synchronize().unwrap();
        let opener = StreamGate::block(&other).release_after(Duration::from_secs(3));
        let t0 = Instant::now();
        let r = f.read_exact_to_device(&mut buf, 0).unwrap();
        let took = t0.elapsed();
        assert_eq!(r.bytes, len);
        assert!(
            stream.clone_dtoh(&buf).unwrap() == data,
            "{len} bytes: the buffer does not hold the file"
        );
        opener.join().unwrap();
        other.synchronize().unwrap();
        t_reads.push(took);
        assert!(
            took < limit,
            "a {len}-byte read took {took:?} while another stream was held: it waited for that stream's work (reads so far: {t_reads:?})"
        );
        std::fs::remove_file(&p).unwrap();
    }
    // The engine is idle now. Hold the other stream past the old idle release (5 s), then
    // create an event here.
    let opener = StreamGate::block(&other).release_after(Duration::from_secs(9));
    std::thread::sleep(Duration::from_millis(6000));
    let t0 = Instant::now();
    let ev = stream.record_event(None).unwrap();
    let took = t0.elapsed();
    opener.join().unwrap();
    other.synchronize().unwrap();
    drop(ev);
    assert!(
        took < limit,
        "creating an event took {took:?} while another stream was held and the engine idle: something in the background waited for that stream"
    );
    eprintln!("reads {t_reads:?}; event after the idle wait {took:?}");
}

//! Dropping gpudirect's device buffers must not wait for other streams' work. `cuMemFree` waits
//! for all of the device's work (a probe held another stream 300 ms with a host function and
//! `cuMemFree` of an unrelated buffer took 290.6 ms: CONTRIBUTING.md, "CUDA pointer facts"), so
//! a `DeviceBuffer` or `GdrBuffer` dropped while another stream runs a long kernel would wait
//! for it, and one dropped while another stream waits for this thread would never return.
//! They are freed in the order of their own stream instead, as cudarc frees its slices.
//!
//! Run on a GPU machine: `bash .device/run --include-ignored gpu_device_buffer`.

mod common;

use std::time::{Duration, Instant};

use common::StreamGate;
use gpudirect::cuda::{DeviceBuffer, GdrBuffer};
use gpudirect::cudarc::driver::result::mem_get_info;

const LIMIT: Duration = Duration::from_millis(1000);

/// While another stream of the same context is held (a host function waiting for this thread's
/// say-so, opened after 3 s), a 1 GiB `DeviceBuffer` and a 1 GiB `GdrBuffer` are dropped: each
/// drop returns at once, and once the buffers' own stream is synchronized (it is not held) the
/// device has their memory back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_device_buffer_drops_wait_for_no_other_stream() {
    let gpu = common::test_gpu();
    common::need_gpu(gpu);
    let ctx = gpudirect::cuda::context(gpu).unwrap();
    let other = ctx.new_stream().unwrap();
    let s = ctx.new_stream().unwrap();
    let big = 1usize << 30;
    let plain = DeviceBuffer::<u8>::alloc_zeros(&s, big).unwrap();
    let gdr = GdrBuffer::<u8>::zeroed(&s, big).unwrap();
    s.synchronize().unwrap();
    ctx.bind_to_thread().unwrap();
    let (free_before, _) = mem_get_info().unwrap();

    let opener = StreamGate::block(&other).release_after(Duration::from_secs(3));
    let t = Instant::now();
    drop(plain);
    let plain_took = t.elapsed();
    let t = Instant::now();
    drop(gdr);
    let gdr_took = t.elapsed();
    let t = Instant::now();
    s.synchronize().unwrap();
    let sync_took = t.elapsed();
    ctx.bind_to_thread().unwrap();
    let (free_after, _) = mem_get_info().unwrap();
    let still_held = !opener.is_finished();
    opener.join().unwrap();

    assert!(
        plain_took < LIMIT && gdr_took < LIMIT && sync_took < LIMIT,
        "the drops waited for the held stream: DeviceBuffer {plain_took:?}, GdrBuffer {gdr_took:?}, their stream's sync {sync_took:?} (limit {LIMIT:?})"
    );
    assert!(
        still_held,
        "the other stream was released before the checks: the test proved nothing"
    );
    // Other processes may allocate meanwhile; 64 MiB of slack.
    assert!(
        free_after + (64 << 20) >= free_before + 2 * big,
        "the buffers' memory was not given back: {free_before} B free before the drops, {free_after} B after"
    );
}

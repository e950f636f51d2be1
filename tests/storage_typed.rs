//! Typed device buffers (`CudaSlice<T>`, `CudaView<T>`, `CudaViewMut<T>`) through every storage
//! call, and files whose `st_size` lies (issue 10 item 4, issue 9 item 11).
//!
//! GPU tests (`gpu_*`) run on the GPU machine: `.device/run --include-ignored gpu_storage_typed`.
//! Scratch files go under `GPUDIRECT_TEST_DIR`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use gpudirect::storage::{read_to_gpu, GpuFile};
use gpudirect::Error;

const HINT: &str =
    "needs a CUDA GPU: run on the GPU machine with `.device/run --include-ignored gpu_storage_typed`";

fn gpu() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = gpudirect::cuda::context(0)
        .unwrap_or_else(|e| panic!("{HINT} ({}): {e}", common::GPU_HINT));
    let stream = ctx.new_stream().expect("cuStreamCreate");
    (ctx, stream)
}

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir(&format!("typed-{name}"))
}

use common::random_seeded as random;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(v);
    // SAFETY: reading the initialized bytes of a slice of plain numbers.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), n) }.to_vec()
}

/// Every storage call takes typed buffers; lengths are bytes, checked exactly; a file tail
/// that is not a whole element is refused before any byte moves.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_typed_buffers_read_and_write_every_byte() {
    let (_ctx, stream) = gpu();
    let d = scratch("rw");
    // Large (engine) and small (fast path) sizes, in f32 elements.
    for (i, elems) in [(0usize, 3_000_017usize), (1, 1023), (2, 1)].into_iter() {
        let p = d.join(format!("f{i}.bin"));
        let model = random(elems * 4, 40 + i as u64);
        std::fs::write(&p, &model).unwrap();
        let (buf, r) = read_to_gpu::<f32>(&p, &stream).unwrap();
        assert_eq!((buf.len(), r.bytes), (elems, elems * 4));
        let back = stream.clone_dtoh(&buf).unwrap();
        assert!(
            bytes_of(&back) == model,
            "read_to_gpu::<f32> differs ({elems})"
        );
        // read_to_device into a u32 view at an element offset, from a file offset.
        let f = GpuFile::open(&p).unwrap();
        let mut dst = stream.alloc_zeros::<u32>(elems + 8).unwrap();
        let sentinel = vec![0xA5A5_A5A5u32; elems + 8];
        stream.memcpy_htod(&sentinel, &mut dst).unwrap();
        let take = elems.saturating_sub(1).max(1);
        {
            let mut v = dst.slice_mut(3..3 + take);
            let r = f
                .read_exact_to_device(&mut v, (elems - take) as u64 * 4)
                .unwrap();
            assert_eq!(r.bytes, take * 4);
        }
        let got = stream.clone_dtoh(&dst).unwrap();
        let mut expect = sentinel.clone();
        for k in 0..take {
            let o = (elems - take + k) * 4;
            expect[3 + k] = u32::from_ne_bytes(model[o..o + 4].try_into().unwrap());
        }
        assert!(
            got == expect,
            "typed read_exact_to_device differs ({elems})"
        );
        // write_from_device from a CudaView<f64> (the f32 bytes seen as f64 where they fit).
        let w = d.join(format!("w{i}.bin"));
        let wf = GpuFile::create(&w).unwrap();
        let doubles: Vec<f64> = f32s(&model).iter().map(|&x| x as f64 * 3.5).collect();
        let dev = stream.clone_htod(&doubles).unwrap();
        let r = wf.write_from_device(&dev.slice(..), 8).unwrap();
        assert_eq!(r.bytes, doubles.len() * 8);
        let file = std::fs::read(&w).unwrap();
        assert_eq!(file.len(), 8 + doubles.len() * 8);
        assert!(file[8..] == bytes_of(&doubles)[..], "typed write differs");
    }
    // A file tail that is not a whole element: refused before anything moves.
    let p = d.join("odd.bin");
    let model = random(4 * 1000 + 2, 50);
    std::fs::write(&p, &model).unwrap();
    match read_to_gpu::<u32>(&p, &stream) {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidData => {}
        other => panic!("a 4002-byte file read as u32: {other:?}"),
    }
    let f = GpuFile::open(&p).unwrap();
    for (elems, off) in [(1001usize, 0u64), (2, 3996)] {
        let mut dst = stream.clone_htod(&vec![7u32; elems]).unwrap();
        match f.read_to_device(&mut dst, off) {
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidData => {}
            other => panic!("a read ending inside an element: {other:?}"),
        }
        assert!(
            stream.clone_dtoh(&dst).unwrap() == vec![7u32; elems],
            "a refused read moved bytes"
        );
    }
    // Whole elements up to end of file are fine (short by whole elements).
    let mut dst = stream.alloc_zeros::<u16>(3000).unwrap();
    let r = f.read_to_device(&mut dst, 0).unwrap();
    assert_eq!(r.bytes, model.len());
    std::fs::remove_dir_all(&d).unwrap();
}

/// Issue 9 item 11: a file whose `st_size` is 0 but that has content (`/proc`) is read to end
/// of file, never an empty `Ok`.
#[test]
fn zero_size_files_with_content_are_read_to_the_end() {
    for p in ["/proc/version", "/proc/self/cmdline"] {
        let expect = std::fs::read(p).unwrap();
        assert!(!expect.is_empty(), "{p} is empty here");
        assert_eq!(
            std::fs::metadata(p).unwrap().len(),
            0,
            "{p} has a size here"
        );
        let f = GpuFile::open(p).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let r = f.pread_host(&mut buf, 0).unwrap();
        assert_eq!(
            r.bytes,
            expect.len(),
            "{p}: pread_host moved {} bytes",
            r.bytes
        );
        assert!(buf[..r.bytes] == expect[..]);
        // From an offset, and into a buffer shorter than the content.
        let r = f.pread_host(&mut buf[..5], 2).unwrap();
        assert_eq!(r.bytes, 5.min(expect.len() - 2));
        assert!(buf[..r.bytes] == expect[2..2 + r.bytes]);
        // Past the content: 0 bytes, and that is the truth.
        let r = f.pread_host(&mut buf, expect.len() as u64 + 10).unwrap();
        assert_eq!(r.bytes, 0);
    }
    // A truly empty regular file still reads as empty.
    let d = scratch("empty");
    let e = d.join("e");
    std::fs::write(&e, b"").unwrap();
    let f = GpuFile::open(&e).unwrap();
    assert_eq!(f.pread_host(&mut [0u8; 16], 0).unwrap().bytes, 0);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The same on the device: `read_to_gpu` and `read_to_device` of `/proc` files.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_typed_zero_size_files_with_content_reach_the_gpu() {
    let (_ctx, stream) = gpu();
    let expect = std::fs::read("/proc/version").unwrap();
    let (buf, r) = read_to_gpu::<u8>("/proc/version", &stream).unwrap();
    assert_eq!(r.bytes, expect.len());
    assert!(stream.clone_dtoh(&buf).unwrap() == expect);
    let f = GpuFile::open("/proc/version").unwrap();
    let mut dst = stream.alloc_zeros::<u8>(expect.len() + 100).unwrap();
    let r = f.read_to_device(&mut dst, 1).unwrap();
    assert_eq!(r.bytes, expect.len() - 1);
    let got = stream.clone_dtoh(&dst).unwrap();
    assert!(got[..expect.len() - 1] == expect[1..]);
    assert!(got[expect.len() - 1..].iter().all(|&b| b == 0));
}

//! File ↔ GPU through every path the machine allows (`gpu_*`: one CUDA GPU; `multi_gpu_*`: two).
//!
//! Run on the GPU machine: `.device/run --include-ignored gpu_storage` (and `multi_gpu_storage`
//! with two GPUs). Scratch files go under `GPUDIRECT_TEST_DIR`. With
//! `GPUDIRECT_TEST_UDEV_FIX=1` (as root) the cuFile test writes the udev record cuFile needs for
//! the test directory's block device and drives cuFile's compat path; without it the test
//! asserts that cuFile refuses the file because of the missing udev data.
//!
//! Non-blocking, stream-ordered transfers (`gpu_transfer_*`) are in the `storage_transfer`
//! module of this binary.

mod common;
mod storage_transfer;

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gpudirect::storage::{read_to_gpu, Backend, CompatMode, GpuFile, ODirect, Pipeline};
use gpudirect::{Cause, Error, FallbackPolicy, TransferPath};
use rand::{Rng, SeedableRng};

const HINT: &str =
    "needs a CUDA GPU: run on the GPU machine with `.device/run --include-ignored gpu_storage`";

fn gpu(ordinal: usize) -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = gpudirect::cuda::context(ordinal)
        .unwrap_or_else(|e| panic!("{HINT} ({}): {e}", common::GPU_HINT));
    let stream = ctx.new_stream().expect("cuStreamCreate");
    (ctx, stream)
}

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir(&format!("gpu-{name}"))
}

use common::random_seeded as random;

/// A device buffer filled with random bytes (never zeros), and its host copy.
fn device_random(stream: &Arc<CudaStream>, len: usize, seed: u64) -> (CudaSlice<u8>, Vec<u8>) {
    let host = random(len, seed);
    let dev = if len == 0 {
        stream.null::<u8>().unwrap()
    } else {
        stream.clone_htod(&host).unwrap()
    };
    (dev, host)
}

fn to_host(stream: &Arc<CudaStream>, dev: &CudaSlice<u8>) -> Vec<u8> {
    if dev.is_empty() {
        return Vec::new();
    }
    stream.clone_dtoh(dev).unwrap()
}

/// Reads at random offsets into odd-sized sub-views and checks every byte, including that
/// bytes past end of file and outside the view are untouched.
fn read_round(
    f: &GpuFile,
    stream: &Arc<CudaStream>,
    model: &[u8],
    rng: &mut impl Rng,
    rounds: usize,
) {
    for _ in 0..rounds {
        let size = model.len();
        let off = if rng.random() {
            rng.random_range(0..size as u64 + 100)
        } else {
            rng.random_range(0..size as u64 / 4096) * 4096
        };
        let len = rng.random_range(1..(size / 2).max(2));
        let pad = rng.random_range(0..999usize);
        let (mut dev, before) = device_random(stream, len + 2 * pad, rng.random());
        let r = {
            let mut view = dev.slice_mut(pad..pad + len);
            f.read_to_device(&mut view, off).unwrap()
        };
        let expect = if off as usize >= size {
            0
        } else {
            len.min(size - off as usize)
        };
        assert_eq!(r.bytes, expect, "off {off} len {len}");
        let after = to_host(stream, &dev);
        assert!(
            after[..pad] == before[..pad],
            "bytes before the view changed"
        );
        assert!(
            after[pad..pad + expect] == model[off as usize..off as usize + expect],
            "data differs (off {off} len {len})"
        );
        assert!(
            after[pad + expect..] == before[pad + expect..],
            "bytes past end of file or the view changed"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_engine_round_trips_random_data() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("engine");
    let src = d.join("src.bin");
    let size = (37 << 20) + 12345;
    let model = random(size, 11);
    std::fs::write(&src, &model).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for (threads, task, od) in [
        (None, None, ODirect::Auto),
        (Some(1), Some(4096), ODirect::Off),
        (Some(5), Some(100_000), ODirect::On),
        (Some(16), Some(1 << 20), ODirect::On),
        (Some(33), Some(3 << 20), ODirect::Off),
    ] {
        let mut o = GpuFile::options().backend(Backend::Engine).odirect(od);
        if let Some(t) = threads {
            o = o.threads(t);
        }
        if let Some(t) = task {
            o = o.task_size(t).bounce_size(t);
        }
        let f = o.open(&src).unwrap();
        assert_eq!(f.path_report().path, TransferPath::Posix);
        read_round(&f, &stream, &model, &mut rng, 12);
        // Whole file → GPU → another file at an odd offset → back, byte for byte.
        let mut dev = stream.alloc_zeros::<u8>(size).unwrap();
        let r = f.read_to_device(&mut dev, 0).unwrap();
        assert_eq!(r.bytes, size);
        if od == ODirect::On {
            assert_eq!(r.odirect, f.odirect_refused().is_none());
        }
        let dst = d.join("dst.bin");
        let w = GpuFile::options()
            .create(true)
            .truncate(true)
            .backend(Backend::Engine)
            .odirect(od)
            .open(&dst)
            .unwrap();
        let woff = 4097u64;
        let wr = w.write_from_device(&dev, woff).unwrap();
        assert_eq!(wr.bytes, size);
        // And a sub-view at an odd offset, overwriting the middle.
        let (mid, mid_host) = device_random(&stream, 777_777, rng.random());
        w.write_from_device(&mid.slice(3..), woff + 1_000_001)
            .unwrap();
        let disk = std::fs::read(&dst).unwrap();
        assert_eq!(disk.len() as u64, woff + size as u64);
        assert!(disk[..woff as usize].iter().all(|&b| b == 0));
        let mut expect = model.clone();
        expect[1_000_001..1_000_001 + 777_774].copy_from_slice(&mid_host[3..]);
        assert!(
            disk[woff as usize..] == expect[..],
            "file written from the GPU differs"
        );
    }
    // Both read pipelines; small segments and rings so the ring wraps many times.
    for (pipe, seg, ring, streams, od) in [
        (Pipeline::Lanes, 1 << 20, 2, 1, ODirect::Off),
        (Pipeline::Segments, 300_000, 2, 1, ODirect::Off),
        (Pipeline::Segments, 300_000, 3, 2, ODirect::On),
        (Pipeline::Segments, 1 << 20, 4, 3, ODirect::On),
    ] {
        let f = GpuFile::options()
            .backend(Backend::Engine)
            .odirect(od)
            .threads(7)
            .task_size(65_536 + 4096)
            .pipeline(pipe)
            .segment_size(seg)
            .segments(ring)
            .copy_streams(streams)
            .open(&src)
            .unwrap();
        f.warm_up(0).unwrap();
        read_round(&f, &stream, &model, &mut rng, 10);
        let mut dev = stream.alloc_zeros::<u8>(size + 3).unwrap();
        let r = f.read_to_device(&mut dev, 0).unwrap();
        assert_eq!(r.bytes, size, "{pipe:?}");
        let back = to_host(&stream, &dev);
        assert!(
            back[..size] == model[..],
            "{pipe:?} {seg} {ring} {streams}: data differs"
        );
        assert_eq!(&back[size..], &[0, 0, 0], "bytes past end of file changed");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_read_to_gpu_reads_a_whole_file() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("quick");
    let p = d.join("q.bin");
    let model = random((5 << 20) + 3, 21);
    std::fs::write(&p, &model).unwrap();
    let (buf, r) = read_to_gpu(&p, &stream).unwrap();
    assert_eq!(r.bytes, model.len());
    assert!(to_host(&stream, &buf) == model);
    let e = d.join("empty.bin");
    std::fs::write(&e, b"").unwrap();
    let (buf, r) = read_to_gpu::<u8>(&e, &stream).unwrap();
    assert_eq!((buf.len(), r.bytes), (0, 0));
    std::fs::remove_dir_all(&d).unwrap();
}

/// `read_to_gpu` allocates its buffer while the engine already reads (the deferred destination):
/// a file of many segments (the ring wraps), odd-sized and typed, lands byte for byte, again and
/// again in one process (the ring grown for the first call serves the others), and a second
/// buffer allocated meanwhile on the same stream is untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_read_to_gpu_allocates_while_reading() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("deferred");
    let p = d.join("big.bin");
    // 10 segments of the default 32 MiB and a partial one; a multiple of 4 bytes for the u32 read.
    let model = random((330 << 20) + 4 * 12_345, 23);
    std::fs::write(&p, &model).unwrap();
    let (guard, guard_host) = device_random(&stream, 1 << 20, 24);
    for round in 0..3 {
        let (buf, r) = read_to_gpu::<u8>(&p, &stream).unwrap();
        assert_eq!(
            (r.bytes, buf.len()),
            (model.len(), model.len()),
            "round {round}"
        );
        assert!(
            to_host(&stream, &buf) == model,
            "round {round}: data differs"
        );
        let (words, r) = read_to_gpu::<u32>(&p, &stream).unwrap();
        assert_eq!((r.bytes, words.len()), (model.len(), model.len() / 4));
        let back = stream.clone_dtoh(&words).unwrap();
        let expect: Vec<u32> = model
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert!(back == expect, "round {round}: u32 data differs");
    }
    assert!(
        to_host(&stream, &guard) == guard_host,
        "another buffer changed"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_concurrent_readers() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("concurrent");
    let p = d.join("c.bin");
    let model = Arc::new(random(24 << 20, 31));
    std::fs::write(&p, &*model).unwrap();
    let f = Arc::new(
        GpuFile::options()
            .backend(Backend::Engine)
            .threads(6)
            .task_size(256 << 10)
            .open(&p)
            .unwrap(),
    );
    let hs: Vec<_> = (0..6u64)
        .map(|t| {
            let (f, model, stream) = (
                f.clone(),
                model.clone(),
                stream.context().new_stream().unwrap(),
            );
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(300 + t);
                read_round(&f, &stream, &model, &mut rng, 8);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    drop(stream);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_zero_length_eof_and_bad_input_are_typed() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("bad");
    let p = d.join("b.bin");
    let model = random(100_000, 41);
    std::fs::write(&p, &model).unwrap();
    let f = GpuFile::options()
        .backend(Backend::Engine)
        .open(&p)
        .unwrap();
    // Zero length, either direction.
    let mut empty = stream.null::<u8>().unwrap();
    assert_eq!(f.read_to_device(&mut empty, 0).unwrap().bytes, 0);
    // At and past end of file: 0 bytes, buffer untouched; read_exact: UnexpectedEof.
    let (mut dev, before) = device_random(&stream, 4096, 42);
    assert_eq!(f.read_to_device(&mut dev, 100_000).unwrap().bytes, 0);
    assert_eq!(f.read_to_device(&mut dev, 1 << 40).unwrap().bytes, 0);
    assert!(to_host(&stream, &dev) == before);
    match f.read_exact_to_device(&mut dev, 99_000) {
        Err(Error::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof)
        }
        other => panic!("read_exact past end of file: {other:?}"),
    }
    // Offset overflow.
    assert!(matches!(
        f.read_to_device(&mut dev, u64::MAX - 10),
        Err(Error::InvalidArgument(_))
    ));
    // Write through a read-only handle: typed error, file unchanged.
    match f.write_from_device(&dev, 0) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("read-only"), "{m}"),
        other => panic!("read-only write: {other:?}"),
    }
    let w = GpuFile::options()
        .write(true)
        .backend(Backend::Engine)
        .open(&p)
        .unwrap();
    assert!(matches!(
        w.write_from_device(&dev, i64::MAX as u64),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(w.write_from_device(&empty, 1 << 30).unwrap().bytes, 0);
    // Fallback refused before any byte moves.
    let deny = GpuFile::options()
        .write(true)
        .backend(Backend::Engine)
        .fallback(FallbackPolicy::Deny)
        .open(&p)
        .unwrap();
    match deny.read_to_device(&mut dev, 0) {
        Err(Error::FallbackRefused {
            path: TransferPath::Posix,
            cause: Cause::ForcedByConfig { .. },
        }) => {}
        other => panic!("deny: {other:?}"),
    }
    assert!(matches!(
        deny.write_from_device(&dev, 0),
        Err(Error::FallbackRefused { .. })
    ));
    assert!(
        to_host(&stream, &dev) == before,
        "a refused read moved bytes"
    );
    assert_eq!(
        std::fs::read(&p).unwrap(),
        model,
        "a refused write changed the file"
    );
    // Directory and FIFO.
    assert!(matches!(GpuFile::open(&d), Err(Error::InvalidArgument(_))));
    std::fs::remove_dir_all(&d).unwrap();
}

/// `major:minor` of the block device holding `dir`.
fn block_device_of(dir: &std::path::Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).unwrap().dev();
    (libc_major(dev), libc_minor(dev))
}

fn libc_major(dev: u64) -> u32 {
    (((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff)) as u32
}

fn libc_minor(dev: u64) -> u32 {
    (((dev >> 12) & 0xffff_ff00) | (dev & 0xff)) as u32
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_cufile_compat_path_or_udev_cause() {
    let (_ctx, stream) = gpu(0);
    let d = scratch("cufile");
    let p = d.join("cf.bin");
    let size = (9 << 20) + 77;
    let model = random(size, 51);
    std::fs::write(&p, &model).unwrap();
    let (maj, min) = block_device_of(&d);
    let fix = std::env::var("GPUDIRECT_TEST_UDEV_FIX").is_ok_and(|v| v == "1");
    if fix {
        std::fs::create_dir_all("/run/udev/data").expect("creating /run/udev/data needs root");
        std::fs::write(
            format!("/run/udev/data/b{maj}:{min}"),
            "E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n",
        )
        .unwrap();
        let f = GpuFile::options()
            .write(true)
            .backend(Backend::CuFile)
            .open(&p)
            .unwrap();
        assert!(f.uses_cufile());
        assert!(
            matches!(
                f.path_report().path,
                TransferPath::CuFileCompat | TransferPath::Gds
            ),
            "{}",
            f.path_report()
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(52);
        read_round(&f, &stream, &model, &mut rng, 6);
        let (src, host) = device_random(&stream, 1_234_567, 53);
        let r = f.write_from_device(&src.slice(5..), 12_345).unwrap();
        assert_eq!(r.bytes, 1_234_562);
        let mut expect = model.clone();
        expect[12_345..12_345 + 1_234_562].copy_from_slice(&host[5..]);
        assert!(
            std::fs::read(&p).unwrap() == expect,
            "file written through cuFile differs"
        );
        // AUTO takes cuFile only for a DMA path.
        let a = GpuFile::options()
            .compat_mode(CompatMode::Auto)
            .open(&p)
            .unwrap();
        assert_eq!(a.uses_cufile(), a.path_report().path == TransferPath::Gds);
    } else {
        // The machine's real state: cuFile cannot register, for want of udev data.
        match GpuFile::options().backend(Backend::CuFile).open(&p) {
            Err(e) => eprintln!("cuFile refused as expected: {e}"),
            Ok(f) => panic!(
                "cuFile registered {} without udev data: {}",
                p.display(),
                f.path_report()
            ),
        }
        let a = GpuFile::options()
            .compat_mode(CompatMode::Auto)
            .open(&p)
            .unwrap();
        assert!(!a.uses_cufile());
        assert_eq!(a.path_report().path, TransferPath::Posix);
        assert!(
            matches!(a.path_report().cause, Some(Cause::UdevDataMissing { .. })),
            "expected UdevDataMissing for {maj}:{min}, got {}",
            a.path_report()
        );
        match GpuFile::options()
            .compat_mode(CompatMode::CuFileRequired)
            .open(&p)
        {
            Err(Error::Unsupported {
                cause: Cause::UdevDataMissing { .. },
                ..
            }) => {}
            other => panic!("CuFileRequired without udev data: {other:?}"),
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(54);
        read_round(&a, &stream, &model, &mut rng, 4);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_storage_buffer_of_another_device() {
    let n = gpudirect::cuda::device_count().unwrap_or(0);
    assert!(n >= 2, "needs 2 CUDA GPUs (found {n}): run on the 2-GPU machine with `.device/run --include-ignored multi_gpu_storage`");
    let (_c0, _s0) = gpu(0);
    let (_c1, s1) = gpu(1);
    let d = scratch("multi");
    let p = d.join("m.bin");
    let model = random(3 << 20, 61);
    std::fs::write(&p, &model).unwrap();
    let (mut dev1, before) = device_random(&s1, 1 << 20, 62);
    let pinned = GpuFile::options()
        .backend(Backend::Engine)
        .device(0)
        .open(&p)
        .unwrap();
    match pinned.read_to_device(&mut dev1, 0) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("GPU 1"), "{m}"),
        other => panic!("buffer of another device: {other:?}"),
    }
    assert!(to_host(&s1, &dev1) == before);
    // Unrestricted: device 1 gets its own pool.
    let any = GpuFile::options()
        .backend(Backend::Engine)
        .open(&p)
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(63);
    read_round(&any, &s1, &model, &mut rng, 4);
    std::fs::remove_dir_all(&d).unwrap();
}

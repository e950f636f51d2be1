//! cuFile on a CUDA GPU (`gpu_cufile_*`, ignored by default: `-- --include-ignored`).
//!
//! Needs one CUDA GPU and libcufile (`GPUDIRECT_CUFILE_LIB`); scratch files go under
//! `GPUDIRECT_TEST_DIR` (default: the system temp dir). Run without a GPU they fail with a hint.
//!
//! Registration depends on the machine: in containers without `/run/udev` cuFile refuses every
//! file. Without `GPUDIRECT_TEST_UDEV_FIX=1` the tests assert that refusal is classified as
//! [`Cause::UdevDataMissing`] for the file's block device (the machine's real state) and check
//! nothing further; with `GPUDIRECT_TEST_UDEV_FIX=1` (root needed) they first write the udev
//! record cuFile looks for — `/run/udev/data/b<major>:<minor>` with `E:ID_FS_USAGE=filesystem`
//! and `E:ID_FS_TYPE=<fs>` for the device holding the test directory (what `mountpoint -d`
//! prints) — and then require registration to succeed and every byte to round-trip.

mod common;

use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpudirect::cudarc::driver::{CudaSlice, CudaStream};
use gpudirect::storage::cufile::{
    classify_registration_failure, filesystem_type, BatchIo, BatchOp, BufferError, CuFileHandle,
    Driver, OpenMode, RegisteredBuffer, Stats,
};
use gpudirect::{Cause, Error};

fn gpu() -> Arc<CudaStream> {
    common::need_gpu(0).new_stream().expect("cuStreamCreate")
}

fn driver() -> Arc<Driver> {
    Driver::open().unwrap_or_else(|e| {
        panic!("the cuFile driver did not open: {e} (set GPUDIRECT_CUFILE_LIB to libcufile.so.0)")
    })
}

use common::random;

fn scratch(name: &str) -> PathBuf {
    common::scratch(&format!("cufile-{name}"))
}

fn udev_fix_requested() -> bool {
    std::env::var("GPUDIRECT_TEST_UDEV_FIX").is_ok_and(|v| v == "1")
}

/// The udev record cuFile looks for, for the block device holding `path`.
fn udev_record(path: &Path) -> (String, PathBuf) {
    let dev = std::fs::metadata(path).unwrap().dev();
    let device = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let record = PathBuf::from(format!("/run/udev/data/b{device}"));
    (device, record)
}

/// With `GPUDIRECT_TEST_UDEV_FIX=1`, writes the udev record for `path`'s device.
fn apply_udev_fix(path: &Path) {
    if !udev_fix_requested() {
        return;
    }
    let (_, record) = udev_record(path);
    if record.exists() {
        return;
    }
    let fs = filesystem_type(path).unwrap_or_else(|| "ext4".into());
    std::fs::create_dir_all("/run/udev/data").expect("mkdir /run/udev/data (run as root)");
    // Write to a temporary name and rename, so parallel tests never see a partial record.
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = record.with_extension(format!("tmp{}-{seq}", std::process::id()));
    std::fs::write(
        &tmp,
        format!("E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE={fs}\n"),
    )
    .unwrap();
    std::fs::rename(&tmp, &record).unwrap();
}

/// Opens and registers `path` (created with `content`), or asserts the machine's documented
/// refusal (udev data missing) and returns `None`.
fn register(driver: &Arc<Driver>, path: &Path, content: &[u8]) -> Option<CuFileHandle> {
    std::fs::write(path, content).unwrap();
    apply_udev_fix(path);
    match CuFileHandle::open(Arc::clone(driver), path, OpenMode::ReadWrite) {
        Ok(h) => {
            let r = h.path_report();
            eprintln!(
                "registered {} (o_direct {}): {r}",
                path.display(),
                h.is_o_direct()
            );
            if !driver.nvfs_loaded() && !driver.p2pdma_enabled() {
                assert_eq!(r.path, gpudirect::TransferPath::CuFileCompat, "{r}");
                assert!(r.cause.is_some(), "{r}");
            }
            Some(h)
        }
        Err(e) => {
            let cause = classify_registration_failure(&e, path);
            assert!(
                matches!(
                    &e,
                    Error::CuFile {
                        op: "cuFileHandleRegister",
                        ..
                    }
                ),
                "registration must fail with a typed cuFile error: {e:?}"
            );
            if udev_fix_requested() {
                panic!("registration failed although the udev record is in place: {e} (cause: {cause})");
            }
            let (device, record) = udev_record(path);
            assert!(
                !record.exists(),
                "registration failed with the udev record present: {e}"
            );
            assert_eq!(cause, Cause::UdevDataMissing { device }, "{e}");
            eprintln!(
                "registration refused as this machine's state predicts ({cause}); \
                 set GPUDIRECT_TEST_UDEV_FIX=1 (as root) to run the IO checks"
            );
            None
        }
    }
}

fn dtoh(stream: &Arc<CudaStream>, s: &CudaSlice<u8>) -> Vec<u8> {
    stream.clone_dtoh(s).expect("cuMemcpyDtoH")
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_driver_opens_and_reports_properties() {
    let _stream = gpu();
    let d = driver();
    let p = d.properties();
    eprintln!("cuFile {} properties: {p:#?}", d.version());
    eprintln!(
        "nvidia-fs loaded: {}, p2pdma: {}, log: {:?}",
        d.nvfs_loaded(),
        d.p2pdma_enabled(),
        d.log_file()
    );
    assert_eq!(
        d.version(),
        gpudirect::storage::cufile::library_version().unwrap()
    );
    assert!(d.version() >= 1150);
    assert_eq!(d.nvfs_loaded(), p.nvfs_version().is_some());
    assert!(p.max_batch_io_size() > 0, "{p:?}");
    assert!(d.use_count().unwrap() >= 1);
    // Same driver again; a setting after open is refused, not ignored.
    assert!(Arc::ptr_eq(&d, &driver()));
    match Driver::builder().max_direct_io_size_kb(4096).open() {
        Err(Error::TooLate {
            before: "cuFileDriverOpen",
            ..
        }) => {}
        other => panic!("expected TooLate, got {other:?}"),
    }
    // The log is where the driver says (the tests run on several threads, so that is cuFile's
    // own place unless CUFILE_LOGFILE_PATH names one): a cufile.log in the working directory
    // is never left unreported.
    let log = d.log_file().map(Path::to_path_buf);
    if let Some(user) = std::env::var_os("CUFILE_LOGFILE_PATH").filter(|v| !v.is_empty()) {
        assert_eq!(log.as_deref(), Some(Path::new(&user)));
    }
    if Path::new("cufile.log").exists() {
        let here = std::fs::canonicalize("cufile.log").unwrap();
        assert_eq!(
            log.as_deref().and_then(|l| std::fs::canonicalize(l).ok()),
            Some(here.clone()),
            "cuFile logs into {} but the driver reports {log:?}",
            here.display()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_registration_matches_machine_state() {
    let _stream = gpu();
    let d = driver();
    let path = scratch("register");
    let h = register(&d, &path, &random(4096 + 17));
    if let Some(h) = h {
        assert_eq!(h.path(), path);
        drop(h); // deregisters, then closes
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_round_trip_odd_sizes_and_offsets() {
    let stream = gpu();
    let d = driver();
    let path = scratch("roundtrip");
    let file = random((3 << 20) + 12345);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    for &(size, file_off, buf_off) in &[
        (1usize, 0u64, 0usize),
        (4095, 1, 3),
        (4097, 4096, 4095),
        ((1 << 20) + 13, 12345, 7),
        ((2 << 20) + 511, 777, 4096),
    ] {
        let sentinel = random(buf_off + size + 5);
        let mut buf = stream.clone_htod(&sentinel).unwrap();
        let n = h
            .read(&mut buf.slice_mut(buf_off..buf_off + size), file_off)
            .unwrap();
        assert_eq!(n, size);
        let got = dtoh(&stream, &buf);
        let fo = file_off as usize;
        assert!(
            got[buf_off..buf_off + size] == file[fo..fo + size],
            "read {size}@{file_off}"
        );
        assert_eq!(
            got[..buf_off],
            sentinel[..buf_off],
            "bytes before the view changed"
        );
        assert_eq!(
            got[buf_off + size..],
            sentinel[buf_off + size..],
            "bytes after the view changed"
        );
    }
    // Writes of odd sizes at odd offsets; the rest of the file must not change.
    let mut expect = file.clone();
    for &(size, file_off) in &[(1usize, 5u64), (4099, 8191), ((1 << 20) + 77, 100_003)] {
        let data = random(size + 9);
        let src = stream.clone_htod(&data).unwrap();
        let n = h.write(&src.slice(9..), file_off).unwrap();
        assert_eq!(n, size);
        expect[file_off as usize..file_off as usize + size].copy_from_slice(&data[9..]);
    }
    h.file().sync_data().unwrap();
    assert!(
        std::fs::read(&path).unwrap() == expect,
        "file differs after cuFileWrite"
    );
    // Past end of file: short, then 0; read_exact reports UnexpectedEof.
    let mut buf = stream.clone_htod(&random(100)).unwrap();
    let end = expect.len() as u64;
    assert_eq!(h.read(&mut buf, end - 37).unwrap(), 37);
    assert_eq!(&dtoh(&stream, &buf)[..37], &expect[expect.len() - 37..]);
    assert_eq!(h.read(&mut buf, end + 10).unwrap(), 0);
    match h.read_exact(&mut buf, end - 37) {
        Err(Error::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof)
        }
        other => panic!("expected UnexpectedEof, got {other:?}"),
    }
    drop(h);
    // The same through an O_DIRECT descriptor, 4 KiB-aligned (what the GDS path wants).
    let h = CuFileHandle::open_with(Arc::clone(&d), &path, OpenMode::ReadWrite, true).unwrap();
    eprintln!(
        "O_DIRECT handle: o_direct {}, {}",
        h.is_o_direct(),
        h.path_report()
    );
    let data = random(256 << 10);
    let src = stream.clone_htod(&data).unwrap();
    assert_eq!(h.write(&src, 1 << 20).unwrap(), 256 << 10);
    let mut back = stream.clone_htod(&random(256 << 10)).unwrap();
    assert_eq!(h.read(&mut back, 1 << 20).unwrap(), 256 << 10);
    assert!(dtoh(&stream, &back) == data, "O_DIRECT round trip differs");
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_registered_buffer() {
    let stream = gpu();
    let d = driver();
    let path = scratch("regbuf");
    let file = random((1 << 20) + 4321);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let mut reg = match RegisteredBuffer::alloc(Arc::clone(&d), &stream, (1 << 20) + 3) {
        Ok(r) => r,
        Err(e) if !d.nvfs_loaded() => {
            // Without nvidia-fs there is nothing to pin for; cuFile may refuse with its code.
            assert!(
                matches!(
                    e,
                    Error::CuFile {
                        op: "cuFileBufRegister",
                        ..
                    }
                ),
                "{e:?}"
            );
            eprintln!("cuFileBufRegister refused without nvidia-fs: {e}");
            drop(h);
            return std::fs::remove_file(&path).unwrap();
        }
        Err(e) => panic!("cuFileBufRegister failed with nvidia-fs loaded: {e}"),
    };
    assert!(reg.registered_len() >= reg.len());
    let n = h.read(&mut reg.as_view_mut().slice_mut(3..), 1000).unwrap();
    assert_eq!(n, 1 << 20);
    let got = dtoh(&stream, reg.slice());
    assert!(got[3..] == file[1000..1000 + (1 << 20)]);
    // Another allocation registers too (or, if the driver pools small allocations into one
    // range, is refused with a typed cuFile error that gives the allocation back unchanged).
    let small = random(8);
    match RegisteredBuffer::register(Arc::clone(&d), stream.clone_htod(&small).unwrap()) {
        Ok(b) => drop(b),
        Err(e) => {
            assert!(
                matches!(
                    e.error(),
                    Error::CuFile {
                        op: "cuFileBufRegister",
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(dtoh(&stream, &e.into_buffer()) == small);
        }
    }
    let slice = reg.into_inner().map_err(|b| b.1).unwrap();
    assert_eq!(slice.len(), (1 << 20) + 3);
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_stream_ordered_io() {
    let stream = gpu();
    let d = driver();
    let path = scratch("stream");
    let file = random((1 << 20) + 999);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let compat = h.path_report().path != gpudirect::TransferPath::Gds;
    eprintln!(
        "stream IO on {} (o_direct {}): {}",
        path.display(),
        h.is_o_direct(),
        h.path_report()
    );
    // 1. In compatibility mode stream-ordered IO needs 4 KiB-aligned size and file offset
    //    (cuFile 1.15 fails the rest with EIO, O_DIRECT or not): gpudirect refuses unaligned
    //    requests with a typed error, and aligned ones must move the right bytes.
    if compat {
        // cuFile 1.15's compatibility path fails stream-ordered IO with EIO, aligned or not
        // (measured): gpudirect refuses it, typed, before cuFile sees it.
        let sent = random(80_000);
        let buf = stream.clone_htod(&sent).unwrap();
        let off = aligned_offset(&buf);
        match h
            .read_async(buf, off, 65_536, 8192)
            .map_err(BufferError::into_parts)
        {
            Err((Error::Unsupported { what, cause }, back)) => {
                let msg = format!("{what}: {cause}");
                eprintln!("refused as expected: {msg}");
                assert!(
                    msg.contains("compatibility") && msg.contains("EIO"),
                    "{msg}"
                );
                assert!(
                    dtoh(&stream, &back) == sent,
                    "the refused buffer came back changed"
                );
            }
            other => panic!("stream IO in compat mode: {other:?}"),
        }
    }
    // Odd sizes and offsets where the path is direct.
    if !compat {
        let buf = stream.clone_htod(&random(70_001)).unwrap();
        let sentinel = dtoh(&stream, &buf);
        let (n, buf) = h
            .read_async(buf, 11, 65_537, 4097)
            .map_err(Error::from)
            .and_then(|io| io.wait().map_err(Error::from))
            .unwrap_or_else(|e| panic!("unaligned cuFileReadAsync on {}: {e}", h.path_report()));
        assert_eq!(n, 65_537);
        let got = dtoh(&stream, &buf);
        assert!(
            got[11..11 + 65_537] == file[4097..4097 + 65_537],
            "read bytes differ"
        );
        assert!(got[..11] == sentinel[..11] && got[11 + 65_537..] == sentinel[11 + 65_537..]);
        // A guard dropped without wait synchronises; the buffer is then freed safely.
        drop(h.read_async(buf, 0, 4099, 100).unwrap());
        // Across end of file: short, and the bytes past it are untouched.
        let tail = stream.clone_htod(&random(5000)).unwrap();
        let before = dtoh(&stream, &tail);
        let (n, tail) = h
            .read_async(tail, 0, 5000, file.len() as u64 - 1000)
            .map_err(Error::from)
            .and_then(|io| io.wait().map_err(Error::from))
            .unwrap();
        assert_eq!(n, 1000);
        let got = dtoh(&stream, &tail);
        assert!(got[..1000] == file[file.len() - 1000..]);
        assert!(
            got[1000..] == before[1000..],
            "bytes past end of file changed"
        );
        // Stream-ordered write at an odd offset, then the file holds the bytes.
        let data = random(4099);
        let src = stream.clone_htod(&data).unwrap();
        let (n, _) = h
            .write_async(src, 0, 4099, 100)
            .map_err(Error::from)
            .and_then(|io| io.wait().map_err(Error::from))
            .unwrap_or_else(|e| panic!("unaligned cuFileWriteAsync: {e}"));
        assert_eq!(n, 4099);
        h.file().sync_data().unwrap();
        assert!(std::fs::read(&path).unwrap()[100..100 + 4099] == data[..]);
    }
    // Out-of-range requests are refused before cuFile sees them, the buffer given back.
    let sent = random(10);
    let small = stream.clone_htod(&sent).unwrap();
    match h
        .read_async(small, 5, 6, 0)
        .map_err(BufferError::into_parts)
    {
        Err((Error::InvalidArgument(_), back)) => assert!(dtoh(&stream, &back) == sent),
        other => panic!("an out-of-range stream read: {other:?}"),
    }
    drop(h);

    // 2. An O_DIRECT handle: in compatibility mode cuFile's stream path needs 4 KiB-aligned
    //    size and file offset; gpudirect refuses the rest with a typed error.
    let expect = std::fs::read(&path).unwrap();
    let h = CuFileHandle::open_with(Arc::clone(&d), &path, OpenMode::ReadWrite, true).unwrap();
    let compat = h.path_report().path != gpudirect::TransferPath::Gds;
    eprintln!(
        "O_DIRECT stream handle: o_direct {}, {}",
        h.is_o_direct(),
        h.path_report()
    );
    let a = gpudirect::storage::cufile::STREAM_COMPAT_ODIRECT_ALIGN as usize;
    if compat {
        let buf = stream.clone_htod(&random(3 * a + 64 * 1024)).unwrap();
        let a0 = aligned_offset(&buf);
        match h
            .read_async(buf, a0, 64 * 1024, 2 * a as u64)
            .map_err(BufferError::into_error)
        {
            Err(Error::Unsupported { what, cause }) => {
                eprintln!("refused as expected: {what}: {}", cause.what());
                assert!(what.contains("O_DIRECT"), "{what}");
            }
            other => panic!("stream IO on an O_DIRECT compat handle: {other:?}"),
        }
        drop(h);
        std::fs::remove_file(&path).unwrap();
        return;
    }
    let buf = stream.clone_htod(&random(3 * a + 64 * 1024)).unwrap();
    let sentinel = dtoh(&stream, &buf);
    let a0 = aligned_offset(&buf); // device address of buf[a0] is 4 KiB aligned
    let (n, buf) = h
        .read_async(buf, a0, 64 * 1024, 2 * a as u64)
        .map_err(Error::from)
        .and_then(|io| io.wait().map_err(Error::from))
        .unwrap_or_else(|e| panic!("aligned cuFileReadAsync on O_DIRECT: {e}"));
    assert_eq!(n, 64 * 1024);
    let got = dtoh(&stream, &buf);
    assert!(
        got[a0..a0 + 64 * 1024] == expect[2 * a..2 * a + 64 * 1024],
        "aligned read differs"
    );
    assert!(got[..a0] == sentinel[..a0] && got[a0 + 64 * 1024..] == sentinel[a0 + 64 * 1024..]);
    let data = random(3 * a);
    let src = stream.clone_htod(&data).unwrap();
    let a0 = aligned_offset(&src);
    let (n, _) = h
        .write_async(src, a0, 2 * a, 3 * a as u64)
        .map_err(Error::from)
        .and_then(|io| io.wait().map_err(Error::from))
        .unwrap_or_else(|e| panic!("aligned cuFileWriteAsync on O_DIRECT: {e}"));
    assert_eq!(n, 2 * a);
    h.file().sync_data().unwrap();
    let mut expect = expect;
    expect[3 * a..5 * a].copy_from_slice(&data[a0..a0 + 2 * a]);
    assert!(
        std::fs::read(&path).unwrap() == expect,
        "file differs after the aligned write"
    );
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_batch_io() {
    let stream = gpu();
    let d = driver();
    let path = scratch("batch");
    let file = random((2 << 20) + 77);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let mut batch = match BatchIo::new(Arc::clone(&d), 4) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("batch setup refused: {e}");
            assert!(
                matches!(
                    e,
                    Error::CuFile {
                        op: "cuFileBatchIOSetUp",
                        ..
                    }
                ),
                "{e:?}"
            );
            return std::fs::remove_file(&path).unwrap();
        }
    };
    let sizes = [4096usize, 5000, (1 << 20) + 1];
    let offsets = [0u64, 4096 * 3, 999_999];
    let mut bufs: Vec<CudaSlice<u8>> = sizes
        .iter()
        .map(|&n| stream.clone_htod(&random(n)).unwrap())
        .collect();
    let results = {
        let mut ops: Vec<BatchOp<'_>> = bufs
            .iter_mut()
            .zip(offsets)
            .map(|(b, file_offset)| BatchOp::Read {
                handle: &h,
                dst: b.as_view_mut(),
                file_offset,
            })
            .collect();
        batch.run(&mut ops, Duration::from_secs(30))
    };
    match results {
        Ok(done) => {
            assert_eq!(done.len(), 3);
            for (i, c) in done.iter().enumerate() {
                match &c.result {
                    Ok(n) => {
                        assert_eq!(*n, sizes[i]);
                        let got = dtoh(&stream, &bufs[i]);
                        let o = offsets[i] as usize;
                        assert!(got == file[o..o + sizes[i]], "batch op {i}");
                    }
                    Err(e) => {
                        eprintln!("batch op {i} failed: {e}");
                        assert!(
                            matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                            "{e:?}"
                        );
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("batch submission refused: {e}");
            assert!(
                matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                "{e:?}"
            );
        }
    }
    assert_eq!(batch.in_flight(), 0);
    drop(batch);
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_stats_name_the_path() {
    let stream = gpu();
    let d = driver();
    let stats = match Stats::start(Arc::clone(&d), 3) {
        Ok(s) => s,
        Err(e) => {
            // The symbols exist from 1.15 on; the library may still refuse the level at run time.
            assert!(
                matches!(e, Error::CuFile { .. }),
                "cuFile 1.15+ has statistics: {e:?}"
            );
            return eprintln!("statistics refused by the library: {e}");
        }
    };
    let path = scratch("stats");
    let file = random(1 << 20);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let before = stats.snapshot().unwrap();
    let mut buf = stream.clone_htod(&random(1 << 20)).unwrap();
    assert_eq!(h.read(&mut buf, 0).unwrap(), 1 << 20);
    let after = stats.snapshot().unwrap();
    eprintln!("stats before {before:?}\nafter {after:?}");
    assert!(
        after.l1.read_bytes >= before.l1.read_bytes + (1 << 20),
        "{after:?}"
    );
    assert!(after.l1.read_ops.ok > before.l1.read_ops.ok);
    let observed = Stats::path_between(&before, &after);
    eprintln!(
        "observed path: {observed:?}; registration said {}",
        h.path_report()
    );
    if let Some(r) = observed {
        if !d.nvfs_loaded() && !d.p2pdma_enabled() {
            assert_eq!(r.path, gpudirect::TransferPath::CuFileCompat);
        }
    }
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_bad_input_gives_typed_errors() {
    let stream = gpu();
    let d = driver();
    // A directory and a FIFO: refused before cuFile sees them.
    let dir = scratch("dir");
    std::fs::create_dir_all(&dir).unwrap();
    let e = CuFileHandle::register(Arc::clone(&d), std::fs::File::open(&dir).unwrap(), &dir)
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("directory")),
        "{e:?}"
    );
    let fifo = scratch("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let e = CuFileHandle::register(Arc::clone(&d), f, &fifo).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("fifo")),
        "{e:?}"
    );
    std::fs::remove_file(&fifo).unwrap();
    std::fs::remove_dir(&dir).unwrap();

    // A file opened read-only: writing fails with a typed error and changes nothing.
    let path = scratch("readonly");
    let content = random(8192 + 3);
    std::fs::write(&path, &content).unwrap();
    apply_udev_fix(&path);
    match CuFileHandle::register(Arc::clone(&d), std::fs::File::open(&path).unwrap(), &path) {
        Ok(h) => {
            let src = stream.clone_htod(&random(4096)).unwrap();
            let e = h.write(&src, 0).unwrap_err();
            eprintln!("write to a read-only file: {e}");
            assert!(
                matches!(e, Error::Io { .. } | Error::CuFile { .. }),
                "{e:?}"
            );
            // Zero length: nothing happens.
            let mut empty = stream.clone_htod(&random(16)).unwrap();
            assert_eq!(h.read(&mut empty.slice_mut(3..3), 0).unwrap(), 0);
            assert_eq!(h.write(&src.slice(0..0), 0).unwrap(), 0);
            // A buffer on another device, when there is one: cuFile takes any device's memory
            // (gpudirect makes its context current), so the bytes must be right.
            if gpudirect::cuda::device_count().unwrap() >= 2 {
                let other = gpudirect::cuda::context(1).unwrap().new_stream().unwrap();
                let mut b1 = other.clone_htod(&random(5000)).unwrap();
                match h.read(&mut b1, 7) {
                    Ok(n) => {
                        assert_eq!(n, 5000);
                        assert!(other.clone_dtoh(&b1).unwrap() == content[7..5007]);
                    }
                    Err(e) => assert!(
                        matches!(e, Error::CuFile { .. } | Error::Cuda { .. }),
                        "{e:?}"
                    ),
                }
            }
            drop(h);
        }
        Err(e) => {
            let cause = classify_registration_failure(&e, &path);
            assert!(
                !udev_fix_requested(),
                "registration failed with the udev fix: {e}"
            );
            assert!(matches!(cause, Cause::UdevDataMissing { .. }), "{cause:?}");
        }
    }
    assert!(
        std::fs::read(&path).unwrap() == content,
        "a refused write changed the file"
    );
    std::fs::remove_file(&path).unwrap();
}

/// The workload of [`gpu_cufile_process_exits_cleanly`]'s child process: what the test binary
/// did before it crashed at exit (context taken and dropped, driver, statistics, registration,
/// IO). On its own it is an ordinary GPU test.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_exit_child() {
    let stream = gpu();
    let d = driver();
    let stats = Stats::start(Arc::clone(&d), 3).ok();
    let path = scratch("exit-child");
    let file = random((1 << 20) + 5);
    if let Some(h) = register(&d, &path, &file) {
        let mut buf = stream.clone_htod(&random(file.len())).unwrap();
        assert_eq!(h.read(&mut buf, 0).unwrap(), file.len());
        assert!(dtoh(&stream, &buf) == file);
        let abuf = stream.clone_htod(&random(8192)).unwrap();
        let _ = h
            .read_async(abuf, 0, 8192, 4096)
            .map_err(Error::from)
            .and_then(|io| io.wait().map_err(Error::from));
    }
    drop(stats);
    std::fs::remove_file(&path).unwrap();
    eprintln!("retained contexts: {}", d.retained_contexts());
    // `stream` drops here: the last reference to GPU 0's context in this test.
}

/// Runs [`gpu_cufile_exit_child`] in a child process (this test binary, filtered to that one
/// test) and checks the process exits cleanly: with the default exit strategy it must; with
/// `GPUDIRECT_CUFILE_EXIT_STRATEGY=none` (the old behaviour) the status is only reported.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_process_exits_cleanly() {
    use std::os::unix::process::ExitStatusExt;
    let _stream = gpu();
    let exe = std::env::current_exe().unwrap();
    for strategy in [None, Some("none")] {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args([
            "--ignored",
            "--exact",
            "gpu_cufile_exit_child",
            "--nocapture",
        ]);
        match strategy {
            Some(s) => cmd.env(gpudirect::storage::cufile::EXIT_STRATEGY_ENV, s),
            None => cmd.env_remove(gpudirect::storage::cufile::EXIT_STRATEGY_ENV),
        };
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let label = strategy.unwrap_or("default (retain-ctx)");
        eprintln!(
            "exit strategy {label}: {:?} (signal {:?})\n{stderr}",
            out.status,
            out.status.signal()
        );
        assert!(
            stdout.contains("1 passed"),
            "the child did not run gpu_cufile_exit_child:\n{stdout}\n{stderr}"
        );
        if strategy.is_none() {
            assert!(
                out.status.success(),
                "a process that used cuFile did not exit cleanly with the default strategy: \
                 {:?} (signal {:?})",
                out.status,
                out.status.signal()
            );
        }
    }
}

/// The offset into `buf` at which its device address is 4 KiB aligned (cuFile's compatibility
/// path needs aligned stream-ordered requests).
fn aligned_offset(buf: &gpudirect::cudarc::driver::CudaSlice<u8>) -> usize {
    let addr = gpudirect::rdma::GpuMemory::device_ptr(buf);
    ((4096 - addr % 4096) % 4096) as usize
}

/// A cancelled batch ends: every operation is reported exactly once by `poll` — completed (with
/// the right bytes) or `CUFILE_CANCELED` — within seconds, and once the cancel returned `Ok`,
/// no buffer is written any more (cuFile 1.15 never reports what a successful cancel ended; a
/// drain that waited for those reports hung the suite). The reads are large and the file is
/// out of the page cache, so the cancel meets IO in flight; a pattern written into every buffer
/// after the cancel must survive 500 ms untouched. The batch is usable again afterwards.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_batch_cancel_reports_every_operation() {
    const OPS: usize = 8;
    let stream = gpu();
    let d = driver();
    let path = scratch("batch-cancel");
    let size = 8 << 20;
    let file = random(OPS * size + 333);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    // Out of the page cache, so that the reads take a while.
    // SAFETY: the descriptor is the handle's, open for its life; both calls only take it.
    unsafe {
        let fd = std::os::fd::AsRawFd::as_raw_fd(h.file());
        libc::fsync(fd);
        libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    // The buffers outlive the batch (declared first, dropped last): the batch's drop ends its
    // IO before they go, also when an assertion below unwinds.
    let mut bufs: Vec<CudaSlice<u8>> = (0..OPS)
        .map(|_| stream.clone_htod(&random(size)).unwrap())
        .collect();
    let mut batch = match BatchIo::new(Arc::clone(&d), OPS as u32) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("batch setup refused: {e}");
            assert!(matches!(e, Error::CuFile { .. }), "{e:?}");
            return std::fs::remove_file(&path).unwrap();
        }
    };
    let mut statuses = Vec::new();
    let cancel_took;
    {
        let mut ops: Vec<BatchOp<'_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| BatchOp::Read {
                handle: &h,
                dst: b.as_view_mut(),
                file_offset: (i * size) as u64,
            })
            .collect();
        // SAFETY: `ops` borrows every buffer and `h` until the end of this block, and the block
        // ends only after a successful cancel (or the batch's drop, which ends the IO or
        // aborts, runs first when it unwinds: `batch` is declared after `bufs`).
        if let Err(e) = unsafe { batch.submit(&mut ops) } {
            eprintln!("batch submission refused: {e}");
            assert!(
                matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                "{e:?}"
            );
            drop(batch);
            return std::fs::remove_file(&path).unwrap();
        }
        let t = std::time::Instant::now();
        batch.cancel().expect("cuFileBatchIOCancel");
        cancel_took = t.elapsed();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while batch.in_flight() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} operations were not reported within 10 s of a successful cancel",
                batch.in_flight()
            );
            for c in batch.poll(1, Some(Duration::from_millis(100))).unwrap() {
                statuses.push((c.index, c.status, c.result.map_err(|e| e.to_string())));
            }
        }
    }
    let completed = statuses.iter().filter(|s| s.2.is_ok()).count();
    eprintln!(
        "cancel took {cancel_took:?}; {completed} of {OPS} completed, {} cancelled: {statuses:?}",
        OPS - completed
    );
    let mut seen: Vec<usize> = statuses.iter().map(|s| s.0).collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..OPS).collect::<Vec<_>>(),
        "each operation reported once"
    );
    for (i, status, result) in &statuses {
        let got = dtoh(&stream, &bufs[*i]);
        match result {
            Ok(n) => {
                assert_eq!(*n, size, "op {i}");
                assert!(got == file[i * size..(i + 1) * size], "op {i}: wrong bytes");
            }
            Err(e) => {
                assert!(
                    *status & gpudirect::ffi::cufile::CUFILE_CANCELED != 0
                        || *status & gpudirect::ffi::cufile::CUFILE_FAILED != 0,
                    "op {i}: status {status:#x}: {e}"
                );
                eprintln!("op {i} (status {status:#x}) ended without data: {e}");
            }
        }
    }
    // Nothing writes the buffers once the cancel returned: a pattern put there now survives.
    let patterns: Vec<Vec<u8>> = (0..OPS).map(|_| random(size)).collect();
    for (b, p) in bufs.iter_mut().zip(&patterns) {
        stream.memcpy_htod(p, b).unwrap();
    }
    stream.synchronize().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    for (i, (b, p)) in bufs.iter().zip(&patterns).enumerate() {
        assert!(
            dtoh(&stream, b) == *p,
            "op {i}'s buffer was written after cuFileBatchIOCancel returned success: the \
             cancelled IO was still running (gpudirect's BatchIo would then release memory the \
             device writes)"
        );
    }
    // The batch works again, and no stale completion of the cancelled submission mixes in.
    {
        let mut ops = vec![BatchOp::Read {
            handle: &h,
            dst: bufs[0].as_view_mut(),
            file_offset: 0,
        }];
        let got = batch.run(&mut ops, Duration::from_secs(30)).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(*got[0].result.as_ref().unwrap(), size);
    }
    assert_eq!(batch.in_flight(), 0);
    assert!(
        dtoh(&stream, &bufs[0]) == file[..size],
        "the read after the cancel"
    );
    drop(batch);
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

/// `BatchIo::run` while operations of an earlier `unsafe submit` are in flight would wait for
/// them too and take their completions as its own (both submissions' cookies started at 0): it
/// is refused before anything is submitted, and the earlier submission's completions keep their
/// own submission number and index.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_batch_run_after_submit_is_refused() {
    let stream = gpu();
    let d = driver();
    let path = scratch("batch-cookies");
    let file = random((2 << 20) + 5);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let sizes = [300_000usize, 4096 + 1];
    let offsets = [0u64, 1 << 20];
    let mut first_bufs: Vec<CudaSlice<u8>> = sizes
        .iter()
        .map(|&n| stream.clone_htod(&random(n)).unwrap())
        .collect();
    let mut second_buf = stream.clone_htod(&random(8192)).unwrap();
    let second_before = dtoh(&stream, &second_buf);
    // After the buffers, so that it drops (ending its IO) before them, also when unwinding.
    let mut batch = match BatchIo::new(Arc::clone(&d), 4) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("batch setup refused: {e}");
            assert!(matches!(e, Error::CuFile { .. }), "{e:?}");
            return std::fs::remove_file(&path).unwrap();
        }
    };
    let mut reaped = Vec::new();
    {
        let mut first: Vec<BatchOp<'_>> = first_bufs
            .iter_mut()
            .zip(offsets)
            .map(|(b, file_offset)| BatchOp::Read {
                handle: &h,
                dst: b.as_view_mut(),
                file_offset,
            })
            .collect();
        // SAFETY: `first` borrows its buffers and `h` until the end of this block, which polls
        // until nothing is in flight (a panic drops the batch first, which drains it).
        let submission = match unsafe { batch.submit(&mut first) } {
            Ok(s) => s,
            Err(e) => {
                eprintln!("batch submission refused: {e}");
                assert!(
                    matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                    "{e:?}"
                );
                drop(batch);
                return std::fs::remove_file(&path).unwrap();
            }
        };
        let mut second = vec![BatchOp::Read {
            handle: &h,
            dst: second_buf.as_view_mut(),
            file_offset: 12345,
        }];
        match batch.run(&mut second, Duration::from_secs(30)) {
            Err(Error::InvalidArgument(msg)) => {
                eprintln!("refused as expected: {msg}");
                assert!(msg.contains("in flight"), "{msg}");
            }
            other => panic!(
                "run with an earlier submission in flight must be refused before it submits \
                 (it would take that submission's completions for its own): {other:?}"
            ),
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while batch.in_flight() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "batch never completed"
            );
            reaped.extend(batch.poll(1, Some(Duration::from_millis(100))).unwrap());
        }
        assert!(
            reaped.iter().all(|c| c.submission == submission),
            "{reaped:?}"
        );
    }
    let mut idx: Vec<usize> = reaped.iter().map(|c| c.index).collect();
    idx.sort_unstable();
    assert_eq!(idx, vec![0, 1], "{reaped:?}");
    for c in &reaped {
        let i = c.index;
        let n = *c.result.as_ref().unwrap_or_else(|e| panic!("op {i}: {e}"));
        assert_eq!(n, sizes[i]);
        let o = offsets[i] as usize;
        assert!(
            dtoh(&stream, &first_bufs[i]) == file[o..o + sizes[i]],
            "op {i}"
        );
    }
    assert!(
        dtoh(&stream, &second_buf) == second_before,
        "the refused run moved bytes"
    );
    drop(batch);
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

/// Bytes of guard on each side of the view in the overrun checks: twice the 64 KiB that
/// `GpuFile`'s workaround assumes cuFile may write past a read.
const GUARD: usize = 128 << 10;

/// What [`registered_scratch`] sets up: GPU 0's stream, the driver, and the scratch file's path
/// and bytes.
type Scratch = (Arc<CudaStream>, Arc<Driver>, PathBuf, Vec<u8>);

/// The setup of the tests that check reads stay inside their views: scratch file `name`
/// holding `(1 << 20) + 333` random bytes, registered once (writing the udev record when asked)
/// and the handle dropped, so that the test measures with one registration of the file at a
/// time. `None` (the file removed) where [`register`] reports the machine's documented refusal.
fn registered_scratch(name: &str) -> Option<Scratch> {
    let stream = gpu();
    let d = driver();
    let path = scratch(name);
    let file = random((1 << 20) + 333);
    let Some(first) = register(&d, &path, &file) else {
        std::fs::remove_file(&path).unwrap();
        return None;
    };
    drop(first);
    Some((stream, d, path, file))
}

/// How far outside `[start, start + n)` the bytes of `after` differ from `before` (which was
/// random, so a write of file bytes shows with probability 255/256 per byte): `(bytes before
/// the range, bytes past it)`, each the distance to the furthest changed byte.
fn overrun(before: &[u8], after: &[u8], start: usize, n: usize) -> (usize, usize) {
    let head = (0..start)
        .find(|&i| before[i] != after[i])
        .map_or(0, |i| start - i);
    let tail = (start + n..before.len())
        .rev()
        .find(|&i| before[i] != after[i])
        .map_or(0, |i| i + 1 - (start + n));
    (head, tail)
}

/// `cuFileRead` called directly (not through gpudirect), on a descriptor of our own, into
/// `buf[start..start + len]`: returns the raw result. Measures cuFile itself.
fn raw_cufile_read(
    path: &Path,
    o_direct: bool,
    buf: &mut CudaSlice<u8>,
    start: usize,
    len: usize,
    file_offset: u64,
) -> isize {
    use gpudirect::cudarc::driver::{sys as cu, DevicePtrMut};
    use gpudirect::ffi::cufile as sys;
    use std::os::fd::AsRawFd;
    let lib = sys::library().expect("libcufile loads");
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if o_direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = opts.open(path).unwrap();
    let stream = Arc::clone(buf.stream());
    stream.synchronize().unwrap();
    let (ptr, _rec) = buf.device_ptr_mut(&stream);
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid out-pointers; `ptr` is a live allocation of this context (current: the
    // stream's operations bound it).
    let rc = unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    assert_eq!(rc, cu::CUresult::CUDA_SUCCESS);
    // SAFETY: all-zero is a valid descriptor (null fs_ops).
    let mut descr: sys::CUfileDescr_t = unsafe { std::mem::zeroed() };
    descr.type_ = sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    descr.handle.fd = file.as_raw_fd();
    let mut fh: sys::CUfileHandle_t = std::ptr::null_mut();
    // SAFETY: valid pointers; the driver is open (the caller opened it through gpudirect).
    let e = unsafe { lib.cuFileHandleRegister.unwrap()(&mut fh, &mut descr) };
    assert_eq!(e.err, 0, "raw cuFileHandleRegister: {}", e.err);
    // SAFETY: the range `base + (ptr - base) + start .. + len` lies in `buf`, which the guard
    // borrows mutably; the stream is idle; `fh` is registered; the call is synchronous.
    let got = unsafe {
        lib.cuFileRead.unwrap()(
            fh,
            base as *mut std::ffi::c_void,
            len,
            file_offset as i64,
            (ptr - base) as i64 + start as i64,
        )
    };
    // SAFETY: registered above, no IO in flight.
    unsafe { lib.cuFileHandleDeregister.unwrap()(fh) };
    drop(file);
    got
}

/// Issue 9 item 13: does a cuFile read write device bytes outside the range it was given (in
/// compatibility mode, which moves whole 4 KiB blocks)? Three cases from the audit, on a
/// buffered and an O_DIRECT descriptor: an unaligned interior read, a read crossing end of
/// file, one block at file offset 1 — plus an aligned control. Each view sits inside a larger
/// random buffer with 128 KiB of guard on each side.
///
/// Prints, per case, what raw `cuFileRead` (no gpudirect protection) wrote outside its range
/// ("RAW ... outside: head H, tail T"; any non-zero T or H means cuFile overruns and the
/// protection is needed), then asserts that `CuFileHandle::read` wrote exactly its view's bytes:
/// on code without the protection this fails wherever the raw line shows an overrun.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_read_stays_inside_the_view() {
    let Some((stream, d, path, file)) = registered_scratch("overrun") else {
        return;
    };
    let size = file.len() as u64;
    // (name, length asked, file offset, extra offset of the view inside the guard)
    let cases: [(&str, usize, u64, usize); 4] = [
        ("interior unaligned", 5000, 4097, 13),
        ("crossing end of file", 10_000, size - 3000, 7),
        ("one block at offset 1", 4096, 1, 0),
        ("aligned control", 8192, 8192, 0),
    ];
    let total_for = |len: usize| 2 * GUARD + len + 8192;
    let mut raw_overruns = Vec::new();
    let mut failures = Vec::new();
    for o_direct in [false, true] {
        let kind = if o_direct { "O_DIRECT" } else { "buffered" };
        // Raw cuFile first, on a descriptor and registration of its own.
        for &(name, len, off, skew) in &cases {
            let mut buf = stream.clone_htod(&random(total_for(len))).unwrap();
            // The view starts at a 4 KiB-aligned device address plus `skew`.
            let start = GUARD + aligned_offset(&buf) + skew;
            let before = dtoh(&stream, &buf);
            let got = raw_cufile_read(&path, o_direct, &mut buf, start, len, off);
            let after = dtoh(&stream, &buf);
            let n = got.max(0) as usize;
            let (head, tail) = overrun(&before, &after, start, n);
            eprintln!(
                "RAW cuFileRead {kind} {name}: asked {len} at {off}, returned {got}, outside: \
                 head {head}, tail {tail}"
            );
            if got >= 0 && after[start..start + n] != file[off as usize..off as usize + n] {
                eprintln!("RAW cuFileRead {kind} {name}: the returned bytes differ from the file");
            }
            if head > 0 || tail > 0 {
                raw_overruns.push(format!("{kind} {name}: head {head}, tail {tail}"));
            }
        }
        // Then gpudirect's handle, on fresh random bytes.
        let h = CuFileHandle::open_with(Arc::clone(&d), &path, OpenMode::Read, o_direct).unwrap();
        eprintln!(
            "handle {kind} (o_direct {}): {}",
            h.is_o_direct(),
            h.path_report()
        );
        for &(name, len, off, skew) in &cases {
            let expect = (size - off).min(len as u64) as usize;
            let mut buf = stream.clone_htod(&random(total_for(len))).unwrap();
            let start = GUARD + aligned_offset(&buf) + skew;
            let before = dtoh(&stream, &buf);
            let n = h
                .read(&mut buf.slice_mut(start..start + len), off)
                .unwrap_or_else(|e| panic!("CuFileHandle::read {kind} {name}: {e}"));
            let after = dtoh(&stream, &buf);
            assert_eq!(n, expect, "{kind} {name}: byte count");
            assert!(
                after[start..start + n] == file[off as usize..off as usize + n],
                "{kind} {name}: the bytes read differ from the file"
            );
            let (head, tail) = overrun(&before, &after, start, n);
            if head > 0 || tail > 0 {
                failures.push(format!(
                    "{kind} {name}: CuFileHandle::read wrote outside its range (head {head}, \
                     tail {tail} bytes)"
                ));
            }
        }
        drop(h);
    }
    eprintln!(
        "RAW verdict: {}",
        if raw_overruns.is_empty() {
            "cuFile wrote nothing outside any range (the tail protection is not needed here)"
                .to_string()
        } else {
            format!("cuFile overran: {raw_overruns:?}")
        }
    );
    assert!(failures.is_empty(), "{failures:#?}");
    std::fs::remove_file(&path).unwrap();
}

/// The calling thread's current CUDA context, raw (null: none).
fn current_context() -> gpudirect::cudarc::driver::sys::CUcontext {
    use gpudirect::cudarc::driver::sys;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; libcuda is initialised (a context exists).
    let rc = unsafe { sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    c
}

fn unbind_context() {
    use gpudirect::cudarc::driver::sys;
    // SAFETY: null unbinds the calling thread's context.
    let rc = unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
}

/// Issue 9 item 16: cuFile calls leave the calling thread's current context as they found it
/// (before: the buffer's context stayed bound, surprising code that mixes raw driver calls).
/// The thread has no current context; after every call it still has none.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_calls_leave_the_current_context_alone() {
    let stream = gpu();
    let d = driver();
    let path = scratch("current-ctx");
    let file = random((1 << 20) + 99);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let mut buf = stream.clone_htod(&random(file.len())).unwrap();
    let src = stream.clone_htod(&random(5000)).unwrap();
    stream.synchronize().unwrap();
    let check = |what: &str| {
        let c = current_context();
        assert!(
            c.is_null(),
            "{what} left a context ({c:?}) current on a thread that had none"
        );
    };
    unbind_context();
    assert_eq!(h.read(&mut buf, 0).unwrap(), file.len());
    check("CuFileHandle::read");
    h.read_exact(&mut buf.slice_mut(..4096), 4096).unwrap();
    check("CuFileHandle::read_exact");
    assert_eq!(h.write(&src, 7).unwrap(), 5000);
    check("CuFileHandle::write");
    let slice = stream.clone_htod(&random(8192)).unwrap();
    unbind_context();
    match RegisteredBuffer::register(Arc::clone(&d), slice) {
        Ok(rb) => {
            check("RegisteredBuffer::register");
            drop(rb);
            check("RegisteredBuffer's drop");
        }
        Err(e) => {
            eprintln!("cuFileBufRegister refused ({e}); checked the error path");
            check("a refused RegisteredBuffer::register");
            // The slice it gave back is freed with its context bound, then unbound again.
            drop(e);
            check("dropping a refused RegisteredBuffer::register's BufferError");
        }
    }
    let abuf = stream.clone_htod(&random(8192)).unwrap();
    unbind_context();
    match h.read_async(abuf, 0, 8192, 0) {
        Ok(io) => {
            check("CuFileHandle::read_async");
            // The returned buffer is ours to drop: keep it until after the check, then drop it
            // with its context bound (cudarc's free does not bind it).
            let waited = io.wait();
            check("StreamIo::wait");
            let _ = stream.context().bind_to_thread();
            drop(waited);
        }
        Err(refused) => {
            check("a refused CuFileHandle::read_async");
            drop(refused);
            check("dropping a refused CuFileHandle::read_async's BufferError");
        }
    }
    // Batch IO, each call on its own: in cuFile's compatibility path GetStatus copies the data
    // to the GPU itself, on a context it makes current.
    let mut b2 = stream.clone_htod(&random(4096)).unwrap();
    let mut b3 = stream.clone_htod(&random(4096)).unwrap();
    unbind_context();
    match BatchIo::new(Arc::clone(&d), 2) {
        Ok(mut batch) => {
            check("BatchIo::new");
            {
                let mut ops = vec![BatchOp::Read {
                    handle: &h,
                    dst: b2.as_view_mut(),
                    file_offset: 0,
                }];
                let _ = batch.run(&mut ops, Duration::from_secs(30));
            }
            check("BatchIo::run");
            {
                let mut ops = vec![BatchOp::Read {
                    handle: &h,
                    dst: b3.as_view_mut(),
                    file_offset: 4096,
                }];
                // SAFETY: `ops` borrows `b3` until the end of this block, which ends the
                // operation first (the cancel's Ok); an unwinding panic drops `batch` before
                // `b3`.
                if unsafe { batch.submit(&mut ops) }.is_ok() {
                    check("BatchIo::submit");
                    batch.cancel().expect("cuFileBatchIOCancel");
                    check("BatchIo::cancel");
                    while batch.in_flight() > 0 {
                        let _ = batch.poll(1, Some(Duration::from_millis(100)));
                    }
                    check("BatchIo::poll");
                }
            }
            drop(batch);
            check("BatchIo's drop");
        }
        Err(e) => {
            eprintln!("cuFileBatchIOSetUp refused ({e}); checked the error path");
            check("a refused BatchIo::new");
        }
    }
    // Registering a file and deregistering it.
    let path2 = scratch("current-ctx-2");
    std::fs::write(&path2, &file[..8192]).unwrap();
    match CuFileHandle::open(Arc::clone(&d), &path2, OpenMode::Read) {
        Ok(h2) => {
            check("CuFileHandle::open");
            drop(h2);
            check("CuFileHandle's drop");
        }
        Err(e) => {
            eprintln!("cuFileHandleRegister refused ({e}); checked the error path");
            check("a refused CuFileHandle::open");
        }
    }
    std::fs::remove_file(&path2).unwrap();
    drop(h);
    check("the last CuFileHandle's drop");
    std::fs::remove_file(&path).unwrap();
}

/// `readv`/`writev` (cuFile 1.19+): on an older library a typed `SymbolUnavailable` before any
/// byte moves; otherwise scattered views filled in order, clamped at end of file, with no byte
/// written outside the views (guards around each) or past end of file.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_readv_stays_inside_its_views() {
    let stream = gpu();
    let d = driver();
    let path = scratch("readv");
    let file = random((1 << 20) + 4321);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let lens = [5000usize, 1, 70_000, 100_000];
    let g = 4096 + 13;
    // One buffer per view, with `g` guard bytes on each side of it.
    let mut bufs: Vec<CudaSlice<u8>> = lens
        .iter()
        .map(|&n| stream.clone_htod(&random(n + 2 * g)).unwrap())
        .collect();
    let before: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
    // Starts near the end of the file: the last view crosses end of file.
    let off = (file.len() - 150_000) as u64;
    let got = {
        let mut views: Vec<_> = bufs
            .iter_mut()
            .zip(lens)
            .map(|(b, n)| b.slice_mut(g..g + n))
            .collect();
        h.readv(&mut views, off)
    };
    let after: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
    match got {
        Err(Error::SymbolUnavailable { symbol, .. }) => {
            assert_eq!(symbol, "cuFileReadv");
            assert!(
                d.version() < 1190,
                "cuFile {} lacks cuFileReadv",
                d.version()
            );
            assert!(after == before, "bytes moved before the refusal");
        }
        Ok(n) => {
            let want = file.len() - off as usize;
            assert_eq!(n, want.min(lens.iter().sum()), "bytes read");
            let mut fpos = off as usize;
            for (i, &l) in lens.iter().enumerate() {
                let mut expect = before[i].clone();
                let k = l.min(file.len().saturating_sub(fpos));
                expect[g..g + k].copy_from_slice(&file[fpos..fpos + k]);
                fpos += l;
                assert!(
                    after[i] == expect,
                    "readv view {i}: wrong bytes, or bytes written outside the view or past end of file"
                );
            }
        }
        Err(e) => panic!("readv: {e}"),
    }
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

/// Batch reads stop at end of file like `CuFileHandle::read`: one crossing it moves the bytes up
/// to it and leaves the rest of its view alone, one starting at it completes with 0 bytes and
/// touches nothing, an interior one moves every byte.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_batch_reads_stop_at_end_of_file() {
    let stream = gpu();
    let d = driver();
    let path = scratch("batch-eof");
    let file = random((1 << 20) + 777);
    let Some(h) = register(&d, &path, &file) else {
        return std::fs::remove_file(&path).unwrap();
    };
    let mut batch = match BatchIo::new(Arc::clone(&d), 4) {
        Ok(b) => b,
        Err(e) => {
            assert!(matches!(e, Error::CuFile { .. }), "{e:?}");
            return std::fs::remove_file(&path).unwrap();
        }
    };
    let size = file.len() as u64;
    let cases = [(10_000usize, size - 3000), (4096, size), (5000, 4097)];
    let mut bufs: Vec<CudaSlice<u8>> = cases
        .iter()
        .map(|&(n, _)| stream.clone_htod(&random(n)).unwrap())
        .collect();
    let before: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
    let done = {
        let mut ops: Vec<BatchOp<'_>> = bufs
            .iter_mut()
            .zip(cases)
            .map(|(b, (_, file_offset))| BatchOp::Read {
                handle: &h,
                dst: b.as_view_mut(),
                file_offset,
            })
            .collect();
        batch.run(&mut ops, Duration::from_secs(30))
    };
    let done = match done {
        Ok(d) => d,
        Err(e) => {
            eprintln!("batch submission refused: {e}");
            assert!(
                matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                "{e:?}"
            );
            drop(batch);
            return std::fs::remove_file(&path).unwrap();
        }
    };
    assert_eq!(batch.in_flight(), 0);
    for (i, c) in done.iter().enumerate() {
        let (n, off) = cases[i];
        let want = (size - off).min(n as u64) as usize;
        let got = *c.result.as_ref().unwrap_or_else(|e| panic!("op {i}: {e}"));
        assert_eq!(got, want, "op {i}: bytes");
        let after = dtoh(&stream, &bufs[i]);
        let o = off as usize;
        assert!(after[..want] == file[o..o + want], "op {i}: wrong bytes");
        assert!(
            after[want..] == before[i][want..],
            "op {i}: bytes past end of file were written"
        );
    }
    drop(batch);
    drop(h);
    std::fs::remove_file(&path).unwrap();
}

/// One view of a case in [`gpu_cufile_readv_and_batch_reads_stay_inside_their_views`]: buffer
/// `buf`, bytes `start .. start + len` (`start` counted from the buffer's first 4 KiB-aligned
/// device address), receiving the file's bytes from `file_pos`.
#[derive(Clone, Copy)]
struct View {
    buf: usize,
    start: usize,
    len: usize,
    file_pos: u64,
}

/// Calls `f` with the views `views` of `bufs`, in the order of `views` (at most two per
/// buffer, the second after the first).
fn with_views<R>(
    bufs: &mut [CudaSlice<u8>],
    views: &[View],
    f: impl for<'x> FnOnce(Vec<gpudirect::cudarc::driver::CudaViewMut<'x, u8>>) -> R,
) -> R {
    use gpudirect::cudarc::driver::CudaViewMut;
    let mine = |b: usize| -> Vec<(usize, View)> {
        let m: Vec<(usize, View)> = views
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, v)| v.buf == b)
            .collect();
        assert!(m.len() <= 2, "at most two views per buffer");
        assert!(m.len() < 2 || m[0].1.start + m[0].1.len <= m[1].1.start);
        m
    };
    // Each buffer with two views split at the second's start.
    let mut halves: Vec<(CudaViewMut<'_, u8>, Option<CudaViewMut<'_, u8>>)> = bufs
        .iter_mut()
        .enumerate()
        .map(|(b, s)| match mine(b).get(1) {
            Some(&(_, second)) => {
                let (lo, hi) = s.split_at_mut(second.start);
                (lo, Some(hi))
            }
            None => (s.as_view_mut(), None),
        })
        .collect();
    let mut out: Vec<(usize, CudaViewMut<'_, u8>)> = Vec::new();
    for (b, (lo, hi)) in halves.iter_mut().enumerate() {
        let m = mine(b);
        let Some(&(i0, v0)) = m.first() else {
            continue;
        };
        out.push((i0, lo.slice_mut(v0.start..v0.start + v0.len)));
        if let (Some(hi), Some(&(i1, v1))) = (hi.as_mut(), m.get(1)) {
            out.push((i1, hi.slice_mut(..v1.len)));
        }
    }
    out.sort_by_key(|x| x.0);
    f(out.into_iter().map(|x| x.1).collect())
}

/// What went wrong in `after` (one copy of each buffer), given `before` and the views: bytes
/// outside every view that changed (an overrun: `outside`), and view bytes that are not the
/// file's (`wrong`); every view gets the file's bytes up to end of file, nothing past it.
fn check_views(
    name: &str,
    file: &[u8],
    views: &[View],
    before: &[Vec<u8>],
    after: &[Vec<u8>],
) -> Vec<String> {
    let mut problems = Vec::new();
    for (b, (pre, post)) in before.iter().zip(after).enumerate() {
        let mut expect = pre.clone();
        let mut inside = vec![false; pre.len()];
        for v in views.iter().filter(|v| v.buf == b) {
            let k = v.len.min(file.len().saturating_sub(v.file_pos as usize));
            let f = v.file_pos as usize;
            expect[v.start..v.start + k].copy_from_slice(&file[f..f + k]);
            inside[v.start..v.start + v.len]
                .iter_mut()
                .for_each(|x| *x = true);
        }
        let changed: Vec<usize> = (0..pre.len()).filter(|&i| post[i] != expect[i]).collect();
        let outside: Vec<usize> = changed.iter().copied().filter(|&i| !inside[i]).collect();
        let wrong = changed.len() - outside.len();
        if !outside.is_empty() {
            problems.push(format!(
                "{name}: buffer {b}: {} bytes outside the views were written (offsets {}..={} \
                 of the buffer; views of it: {:?})",
                outside.len(),
                outside[0],
                outside[outside.len() - 1],
                views
                    .iter()
                    .filter(|v| v.buf == b)
                    .map(|v| v.start..v.start + v.len)
                    .collect::<Vec<_>>()
            ));
        }
        if wrong > 0 {
            problems.push(format!(
                "{name}: buffer {b}: {wrong} bytes inside the views differ from the file (or \
                 bytes past end of file were written)"
            ));
        }
    }
    problems
}

/// Review N2: `CuFileHandle::read` writes no byte outside its view (the tail of the read
/// goes through a scratch buffer, see [`gpu_cufile_read_stays_inside_the_view`]); `readv` and
/// batch reads must not either. A cuFile that writes past an element (its compatibility path
/// moves whole 4 KiB blocks, and gpudirect guards 64 KiB past every read) would land outside
/// the caller's views: for `readv`, past any view but the last (the brief's
/// `readv(&mut [a.slice_mut(0..5000), b.slice_mut(..)], 0)`), for a batch read, past its
/// view (only end of file was clamped). Each case's views sit in random buffers with 128 KiB
/// of guard around them (or a random gap between views of one buffer), on a buffered and an
/// O_DIRECT descriptor; every buffer byte is checked: the views hold the file's bytes up to end
/// of file, nothing else changed.
///
/// Prints the handle's path (`handle buffered ...`: GDS, or compatibility mode and why): the
/// cases check what that path does. On code without the protection they fail wherever cuFile
/// writes past an element on that path (`gpu_cufile_read_stays_inside_the_view`'s RAW lines
/// show whether raw `cuFileRead` does); with it they pass either way. `readv` needs cuFile 1.19+:
/// with an older library it is refused before any byte moves, which is checked and printed
/// ("readv not checked"), and only the batch cases run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cufile_readv_and_batch_reads_stay_inside_their_views() {
    let Some((stream, d, path, file)) = registered_scratch("overrun-v") else {
        return;
    };
    let size = file.len() as u64;
    let g = GUARD;
    let v = |buf, start, len, file_pos| View {
        buf,
        start,
        len,
        file_pos,
    };
    // (name, buffer sizes, views in file order from the first view's file position).
    let readv_cases: Vec<(&str, Vec<usize>, Vec<View>)> = vec![
        (
            "interior view of 5000 bytes, then another allocation",
            vec![2 * g + 5000, 2 * g + 70_000],
            vec![v(0, g + 13, 5000, 4097), v(1, g, 70_000, 4097 + 5000)],
        ),
        (
            "two views of one allocation with a gap between them",
            vec![3 * g + 25_000],
            vec![
                v(0, g + 13, 5000, 4097),
                v(0, 2 * g + 5013, 20_000, 4097 + 5000),
            ],
        ),
        (
            "adjacent views of one allocation",
            vec![2 * g + 105_000],
            vec![v(0, g, 5000, 1), v(0, g + 5000, 100_000, 5001)],
        ),
        (
            "small views of four allocations, crossing end of file",
            vec![2 * g + 1, 2 * g + 4096, 2 * g + 5000, 2 * g + 9000],
            vec![
                v(0, g + 7, 1, size - 10_097),
                v(1, g, 4096, size - 10_096),
                v(2, g + 3, 5000, size - 6000),
                v(3, g, 9000, size - 1000),
            ],
        ),
        (
            "aligned control",
            vec![2 * g + 8192, 2 * g + 8192],
            vec![v(0, g, 8192, 8192), v(1, g, 8192, 16_384)],
        ),
    ];
    // Batch operations (each its own view, in file order of nothing: any offsets).
    let batch_cases: Vec<(&str, Vec<usize>, Vec<View>)> = vec![
        (
            "interior unaligned, one byte, 100 000 bytes, crossing end of file, aligned",
            vec![
                2 * g + 5000,
                2 * g + 1,
                2 * g + 100_000,
                2 * g + 10_000,
                2 * g + 8192,
            ],
            vec![
                v(0, g + 13, 5000, 4097),
                v(1, g + 5, 1, 7),
                v(2, g + 1, 100_000, 13),
                v(3, g, 10_000, size - 3000),
                v(4, g, 8192, 8192),
            ],
        ),
        (
            "adjacent views of one allocation, other file offsets",
            vec![2 * g + 10_000],
            vec![v(0, g, 5000, 4097), v(0, g + 5000, 5000, 100_001)],
        ),
    ];
    // Random buffers with their views' starts moved to a 4 KiB-aligned device address.
    let make = |sizes: &[usize], views: &[View]| {
        let bufs: Vec<CudaSlice<u8>> = sizes
            .iter()
            .map(|&n| stream.clone_htod(&random(n + 4096)).unwrap())
            .collect();
        let views: Vec<View> = views
            .iter()
            .map(|x| View {
                start: x.start + aligned_offset(&bufs[x.buf]),
                ..*x
            })
            .collect();
        let before: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
        (bufs, views, before)
    };
    let mut failures = Vec::new();
    let mut readv_checked = 0;
    for o_direct in [false, true] {
        let kind = if o_direct { "O_DIRECT" } else { "buffered" };
        let h = CuFileHandle::open_with(Arc::clone(&d), &path, OpenMode::Read, o_direct).unwrap();
        eprintln!(
            "handle {kind} (o_direct {}): {}",
            h.is_o_direct(),
            h.path_report()
        );
        for (name, sizes, views) in &readv_cases {
            let name = format!("readv {kind} {name}");
            let (mut bufs, views, before) = make(sizes, views);
            let got = with_views(&mut bufs, &views, |mut vs| {
                h.readv(&mut vs, views[0].file_pos)
            });
            let after: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
            match got {
                Err(Error::SymbolUnavailable { symbol, .. }) => {
                    assert_eq!(symbol, "cuFileReadv");
                    assert!(
                        d.version() < 1190,
                        "cuFile {} lacks cuFileReadv",
                        d.version()
                    );
                    assert!(after == before, "{name}: bytes moved before the refusal");
                }
                Ok(n) => {
                    readv_checked += 1;
                    let total: usize = views.iter().map(|x| x.len).sum();
                    let want = (size - views[0].file_pos).min(total as u64) as usize;
                    if n != want {
                        failures.push(format!("{name}: read {n} bytes, not {want}"));
                    }
                    let p = check_views(&name, &file, &views, &before, &after);
                    eprintln!(
                        "{name}: {}",
                        if p.is_empty() { "inside" } else { "OUTSIDE" }
                    );
                    failures.extend(p);
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
        match BatchIo::new(Arc::clone(&d), 8) {
            Err(e) => {
                eprintln!("batch setup refused: {e}");
                assert!(matches!(e, Error::CuFile { .. }), "{e:?}");
            }
            Ok(mut batch) => {
                for (name, sizes, views) in &batch_cases {
                    let name = format!("batch {kind} {name}");
                    let (mut bufs, views, before) = make(sizes, views);
                    let done = with_views(&mut bufs, &views, |vs| {
                        let mut ops: Vec<BatchOp<'_>> = vs
                            .into_iter()
                            .zip(&views)
                            .map(|(dst, x)| BatchOp::Read {
                                handle: &h,
                                dst,
                                file_offset: x.file_pos,
                            })
                            .collect();
                        batch.run(&mut ops, Duration::from_secs(30))
                    });
                    assert_eq!(batch.in_flight(), 0);
                    let after: Vec<Vec<u8>> = bufs.iter().map(|b| dtoh(&stream, b)).collect();
                    match done {
                        Err(e) => {
                            eprintln!("{name}: batch submission refused: {e}");
                            assert!(
                                matches!(e, Error::CuFile { .. } | Error::Io { .. }),
                                "{e:?}"
                            );
                            continue;
                        }
                        Ok(done) => {
                            for (i, c) in done.iter().enumerate() {
                                let x = views[i];
                                let want = (size - x.file_pos).min(x.len as u64) as usize;
                                match &c.result {
                                    Ok(n) if *n == want => {}
                                    other => failures.push(format!(
                                        "{name}: op {i}: {other:?}, not {want} bytes"
                                    )),
                                }
                            }
                        }
                    }
                    let p = check_views(&name, &file, &views, &before, &after);
                    eprintln!(
                        "{name}: {}",
                        if p.is_empty() { "inside" } else { "OUTSIDE" }
                    );
                    failures.extend(p);
                }
            }
        }
        drop(h);
    }
    if readv_checked == 0 {
        eprintln!(
            "readv not checked: cuFile {} has no cuFileReadv (1.19+)",
            d.version()
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
    std::fs::remove_file(&path).unwrap();
}

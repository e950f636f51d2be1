//! Many reads and writes in one job (issue 10 item 3): `ReadBatch`, `read_many`,
//! `GpuFile::read_ranges`, `WriteBatch`; bad input refused with nothing moved. Typed device
//! buffers through every storage call (issue 10 item 4), and files whose `st_size` lies (issue
//! 9 item 11).
//!
//! GPU tests: `.device/run --include-ignored gpu_storage_batch` and `gpu_storage_typed`.
//! Scratch files go under `GPUDIRECT_TEST_DIR`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::random_seeded as random;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gpudirect::storage::{
    read_many, GpuFile, GpuFileOptions, ODirect, Pipeline, ReadBatch, ReadItem, WriteBatch,
};
use gpudirect::{Error, TransferPath};
use rand::{Rng, SeedableRng};

fn gpu() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = common::need_gpu(common::test_gpu());
    let stream = ctx.new_stream().expect("cuStreamCreate");
    (ctx, stream)
}

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir(&format!("batch-{name}"))
}

const SENTINEL: u8 = 0xA5;

fn sentinel_buf(stream: &Arc<CudaStream>, len: usize) -> CudaSlice<u8> {
    stream.clone_htod(&vec![SENTINEL; len]).unwrap()
}

/// Thousands of files of random sizes packed (with random gaps) into one buffer, under the
/// segment and lane pipelines, buffered and O_DIRECT: every byte in place, every gap byte
/// untouched, one report.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_many_files_into_one_buffer() {
    let (_ctx, stream) = gpu();
    let d = scratch("many");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let n = 3000;
    let mut files = Vec::new();
    let mut expect = Vec::new();
    for i in 0..n {
        let len = match i % 4 {
            0 => 100 << 10,
            1 => rng.random_range(1..4096),
            2 => rng.random_range(4096..300 << 10),
            _ => rng.random_range(1..2 << 20),
        };
        let p = d.join(format!("f{i}.bin"));
        let data = random(len, 100 + i as u64);
        std::fs::write(&p, &data).unwrap();
        files.push(p);
        expect.push(data);
    }
    for (opts, name) in [
        (GpuFile::options(), "default"),
        (GpuFile::options().odirect(ODirect::On), "odirect"),
        (GpuFile::options().pipeline(Pipeline::Lanes), "lanes"),
        (
            GpuFile::options()
                .segment_size(4 << 20)
                .segments(2)
                .threads(3),
            "small ring",
        ),
    ] {
        // Layout: file i at offset[i], gaps of 0..64 bytes between (sometimes none).
        let mut offsets = Vec::new();
        let mut at = 0usize;
        for (i, e) in expect.iter().enumerate() {
            at += if i % 3 == 0 {
                0
            } else {
                rng.random_range(1..64)
            };
            offsets.push(at);
            at += e.len();
        }
        let total = at + 17;
        let mut dst = sentinel_buf(&stream, total);
        let mut b = ReadBatch::with_options(opts);
        let h = b.destination(&mut dst);
        for (i, p) in files.iter().enumerate() {
            b.read(p, 0, expect[i].len(), h, offsets[i]);
        }
        let r = b.run().unwrap_or_else(|e| panic!("{name}: {e}"));
        let sum: usize = expect.iter().map(Vec::len).sum();
        assert_eq!((r.items, r.bytes, r.files), (n, sum, n), "{name}");
        assert_eq!(r.path.path, TransferPath::Posix, "{name}: {}", r.path);
        assert!(r.path.cause.is_some());
        eprintln!("{name}: {r}; {} copies", r.copies);
        let got = stream.clone_dtoh(&dst).unwrap();
        let mut model = vec![SENTINEL; total];
        for (i, e) in expect.iter().enumerate() {
            model[offsets[i]..offsets[i] + e.len()].copy_from_slice(e);
        }
        if got != model {
            let k = got.iter().zip(&model).position(|(a, b)| a != b).unwrap();
            panic!("{name}: byte {k} differs");
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Ranges of a few files (one large, read direct and buffered) into several typed destination
/// buffers, padded as a checkpoint's device layout pads tensors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_several_typed_destinations() {
    let (_ctx, stream) = gpu();
    let d = scratch("typed");
    let big = random((96 << 20) + 1234, 7);
    let small = random(70_000, 8);
    let (pb, ps) = (d.join("big.bin"), d.join("small.bin"));
    std::fs::write(&pb, &big).unwrap();
    std::fs::write(&ps, &small).unwrap();
    let fb = GpuFile::options().odirect(ODirect::On).open(&pb).unwrap();
    let fs = GpuFile::open(&ps).unwrap();
    let mut bytes = sentinel_buf(&stream, 40 << 20);
    let mut floats = stream.clone_htod(&vec![-1.5f32; 8 << 20]).unwrap();
    let mut words = stream.clone_htod(&vec![7u32; 30_000]).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut b = ReadBatch::new();
    let hb = b.destination(&mut bytes);
    let hf = b.destination(&mut floats);
    let mut wview = words.slice_mut(1000..);
    let hw = b.destination(&mut wview);
    // (file, file offset, len, dest, dest byte offset)
    let mut plan: Vec<(u8, u64, usize, u8, usize)> = Vec::new();
    let mut ends = [0usize; 3];
    for _ in 0..60 {
        let which = rng.random_range(0..3u8);
        let (file, flen) = if rng.random_bool(0.8) {
            (0u8, big.len())
        } else {
            (1u8, small.len())
        };
        let room = [40usize << 20, 32 << 20, 29_000 * 4][which as usize];
        let len = rng.random_range(1..(1usize << 20).min(flen));
        let pad = ends[which as usize].next_multiple_of(256);
        if pad + len > room {
            continue;
        }
        let off = rng.random_range(0..(flen - len) as u64);
        plan.push((file, off, len, which, pad));
        ends[which as usize] = pad + len;
    }
    for &(file, off, len, which, at) in &plan {
        let f = if file == 0 { &fb } else { &fs };
        let h = [hb, hf, hw][which as usize];
        b.read_file(f, off, len, h, at);
    }
    let r = b.run().unwrap();
    assert_eq!(r.items, plan.len());
    assert_eq!(r.files, 2);
    eprintln!("{r}; {} copies for {} items", r.copies, plan.len());
    let got = [
        stream.clone_dtoh(&bytes).unwrap(),
        bytemuck_f32(&stream.clone_dtoh(&floats).unwrap()),
        bytemuck_u32(&stream.clone_dtoh(&words).unwrap()[1000..]),
    ];
    let mut model = [
        vec![SENTINEL; 40 << 20],
        bytemuck_f32(&vec![-1.5f32; 8 << 20]),
        bytemuck_u32(&[7u32; 29_000]),
    ];
    for &(file, off, len, which, at) in &plan {
        let src = if file == 0 { &big } else { &small };
        model[which as usize][at..at + len].copy_from_slice(&src[off as usize..off as usize + len]);
    }
    for k in 0..3 {
        assert!(got[k] == model[k], "destination {k} differs");
    }
    assert!(stream.clone_dtoh(&words).unwrap()[..1000]
        .iter()
        .all(|&w| w == 7));
    std::fs::remove_dir_all(&d).unwrap();
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn bytemuck_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// `read_many` and `GpuFile::read_ranges`: the sugar over `ReadBatch`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_sugar_read_many_and_read_ranges() {
    let (_ctx, stream) = gpu();
    let d = scratch("sugar");
    let paths: Vec<PathBuf> = (0..50).map(|i| d.join(format!("s{i}"))).collect();
    let datas: Vec<Vec<u8>> = (0..50)
        .map(|i| random(4096 * (i + 1) + i, 30 + i as u64))
        .collect();
    for (p, x) in paths.iter().zip(&datas) {
        std::fs::write(p, x).unwrap();
    }
    let mut off = 0;
    let items: Vec<ReadItem> = paths
        .iter()
        .zip(&datas)
        .map(|(p, x)| {
            let it = ReadItem {
                path: p,
                file_offset: 0,
                len: x.len(),
                dst_offset: off,
            };
            off += x.len();
            it
        })
        .collect();
    let mut dst = stream.alloc_zeros::<u8>(off).unwrap();
    let r = read_many(&mut dst, &items).unwrap();
    assert_eq!(r.bytes, off);
    assert!(stream.clone_dtoh(&dst).unwrap() == datas.concat());
    // read_ranges: a file's ranges reversed into a typed buffer.
    let f = GpuFile::open(&paths[49]).unwrap();
    let x = &datas[49];
    let mut out = stream.alloc_zeros::<u16>(1000).unwrap();
    let r = f
        .read_ranges(
            &mut out,
            &[(1000, 600, 0), (0, 1000, 600), (5000, 400, 1600)],
        )
        .unwrap();
    assert_eq!(r.bytes, 2000);
    let got = bytemuck_u16(&stream.clone_dtoh(&out).unwrap());
    assert!(got[..600] == x[1000..1600]);
    assert!(got[600..1600] == x[..1000]);
    assert!(got[1600..] == x[5000..5400]);
    std::fs::remove_dir_all(&d).unwrap();
}

fn bytemuck_u16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

extern "C" {
    #[link_name = "mkfifo"]
    fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
}

/// Bad input refuses the whole batch with the item's index, and no destination byte moves:
/// item past end of file, overlapping destinations, a destination too small, a directory, a
/// FIFO, a file deleted after planning, a /proc file of unknown size. A file deleted after it
/// was opened is still read correctly.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_bad_input_is_refused_and_moves_nothing() {
    let (_ctx, stream) = gpu();
    let d = scratch("bad");
    let good = d.join("good.bin");
    let data = random(3 << 20, 11);
    std::fs::write(&good, &data).unwrap();
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
    let doomed = d.join("doomed.bin");
    std::fs::write(&doomed, &data[..5000]).unwrap();
    type Case<'p> = (
        &'static str,
        usize,
        Vec<(&'p std::path::Path, u64, usize, usize)>,
    );
    let cases: Vec<Case> = vec![
        (
            "past end of file",
            1,
            vec![(&good, 0, 4096, 0), (&good, (3 << 20) - 10, 11, 8192)],
        ),
        (
            "overlapping destinations",
            2,
            vec![
                (&good, 0, 100, 0),
                (&good, 0, 100, 200),
                (&good, 0, 100, 250),
            ],
        ),
        (
            "destination too small",
            0,
            vec![(&good, 0, 1 << 20, (4 << 20) - 1000)],
        ),
        ("directory", 1, vec![(&good, 0, 10, 0), (&d, 0, 10, 100)]),
        ("fifo", 1, vec![(&good, 0, 10, 0), (&fifo, 0, 10, 100)]),
        ("deleted before run", 0, vec![(&doomed, 0, 5000, 0)]),
        (
            "size unknown (/proc)",
            0,
            vec![(std::path::Path::new("/proc/version"), 0, 10, 0)],
        ),
        (
            "offset past the largest",
            0,
            vec![(&good, u64::MAX - 5, 10, 0)],
        ),
    ];
    let mut dst = sentinel_buf(&stream, 4 << 20);
    for (name, bad, items) in cases {
        let mut b = ReadBatch::new();
        let h = b.destination(&mut dst);
        for &(p, off, len, at) in &items {
            b.read(p, off, len, h, at);
        }
        if name == "deleted before run" {
            std::fs::remove_file(&doomed).unwrap();
        }
        match b.run() {
            Err(Error::BatchRefused { index, source }) => {
                assert_eq!(index, bad, "{name}: {source}");
                eprintln!("{name}: refused: {source}");
            }
            other => panic!("{name}: {other:?}"),
        }
        assert!(
            stream
                .clone_dtoh(&dst)
                .unwrap()
                .iter()
                .all(|&x| x == SENTINEL),
            "{name}: a refused batch moved bytes"
        );
    }
    // A file deleted after it was opened is still whole.
    let gone = d.join("gone.bin");
    std::fs::write(&gone, &data).unwrap();
    let f = GpuFile::open(&gone).unwrap();
    std::fs::remove_file(&gone).unwrap();
    let r = f.read_ranges(&mut dst, &[(0, 3 << 20, 0)]).unwrap();
    assert_eq!(r.bytes, 3 << 20);
    assert!(stream.clone_dtoh(&dst).unwrap()[..3 << 20] == data[..]);
    // Destinations on two GPUs are refused (only with two).
    std::fs::remove_dir_all(&d).unwrap();
}

/// The sugar's refusals, through the paths the host seam of `storage::batch` does not take: an
/// open file's ranges (`GpuFile::read_ranges`: past its end, overlapping, a destination too
/// small) and `read_many` with a directory and a FIFO among its files (the file named, which
/// the host seam's test checks with its wording) are refused at the bad item with its typed
/// error, and no destination byte moves; an open file's range past an end it shrank to after
/// it was opened is refused too. The same calls without the bad item read every byte.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_sugar_refusals_move_nothing() {
    let (_ctx, stream) = gpu();
    let d = scratch("sugar-bad");
    let p = d.join("f.bin");
    let data = random(100_000, 61);
    std::fs::write(&p, &data).unwrap();
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
    let len = 64 << 10;
    let mut dst = sentinel_buf(&stream, len);
    let untouched = |dst: &CudaSlice<u8>, what: &str| {
        assert!(
            stream
                .clone_dtoh(dst)
                .unwrap()
                .iter()
                .all(|&x| x == SENTINEL),
            "{what}: a refused batch moved bytes"
        );
    };
    let f = GpuFile::open(&p).unwrap();
    let good = [(0u64, 1000usize, 0usize), (50_000, 2000, 4096)];
    // (what, the bad range (added third), what its refusal says)
    let cases: [(&str, (u64, usize, usize), &str); 3] = [
        (
            "a range past the open file's end",
            (99_000, 1001, 8192),
            "ends after",
        ),
        (
            "a range overlapping an earlier one's destination",
            (0, 100, 5000),
            "overlaps item 1's",
        ),
        (
            "a destination too small",
            (0, 1000, len - 999),
            "do not fit",
        ),
    ];
    for (what, bad, says) in cases {
        let mut ranges = good.to_vec();
        ranges.push(bad);
        ranges.push((1000, 1000, 20_000));
        match f.read_ranges(&mut dst, &ranges) {
            Err(Error::BatchRefused { index: 2, source }) => {
                assert!(source.to_string().contains(says), "{what}: {source}")
            }
            other => panic!("{what}: {other:?}"),
        }
        untouched(&dst, what);
    }
    // read_many with a directory, then a FIFO, as item 1: refused naming it, without blocking.
    for (what, bad) in [("a directory", d.as_path()), ("a FIFO", fifo.as_path())] {
        let items = [
            ReadItem {
                path: &p,
                file_offset: 0,
                len: 1000,
                dst_offset: 0,
            },
            ReadItem {
                path: bad,
                file_offset: 0,
                len: 10,
                dst_offset: 2000,
            },
        ];
        match read_many(&mut dst, &items) {
            Err(Error::BatchRefused { index: 1, source }) => {
                let m = source.to_string();
                eprintln!("{what}: refused: {m}");
                assert!(m.contains(&*bad.to_string_lossy()), "{what}: {m}");
            }
            other => panic!("{what}: {other:?}"),
        }
        untouched(&dst, what);
    }
    // The open file shrinks to 60_000 bytes after it was opened: a range past that end is
    // refused, nothing moved.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(60_000)
        .unwrap();
    match f.read_ranges(&mut dst, &[(0, 1000, 0), (59_000, 1001, 2000)]) {
        Err(Error::BatchRefused { index: 1, source }) => match *source {
            Error::Io {
                path: Some(ref at),
                source: ref e,
                ..
            } if at == &p && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                assert!(e.to_string().contains("ends after 1000"), "shrunk: {e}")
            }
            e => panic!("shrunk: not an end of file naming the file: {e:?}"),
        },
        other => panic!("shrunk: {other:?}"),
    }
    untouched(&dst, "shrunk");
    // The good ranges: every byte, every other byte untouched.
    let mut ranges = good.to_vec();
    ranges.push((1000, 1000, 20_000));
    let r = f.read_ranges(&mut dst, &ranges).unwrap();
    assert_eq!(r.bytes, 4000);
    let mut want = vec![SENTINEL; len];
    for &(off, n, at) in &ranges {
        want[at..at + n].copy_from_slice(&data[off as usize..off as usize + n]);
    }
    assert!(
        stream.clone_dtoh(&dst).unwrap() == want,
        "the good ranges differ"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// `WriteBatch`: a host header and ranges of typed device buffers into one file, one fsync;
/// overlapping file ranges and a read-only file refused with the file untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_writes_device_and_host_sources() {
    let (_ctx, stream) = gpu();
    let d = scratch("write");
    let header = b"{\"a\": [0, 1], \"b\": [2, 3]}        ".to_vec();
    let a_host: Vec<f32> = (0..3_000_000).map(|i| i as f32 * 0.25 - 7.0).collect();
    let b_host = random(777_777, 12);
    let a = stream.clone_htod(&a_host).unwrap();
    let bdev = stream.clone_htod(&b_host).unwrap();
    for (name, opts) in [
        ("default", GpuFileOptions::default()),
        ("odirect", GpuFile::options().odirect(ODirect::On)),
    ] {
        let p = d.join(format!("w-{name}.bin"));
        let out = opts.create(true).truncate(true).open(&p).unwrap();
        let a_bytes = bytemuck_f32(&a_host);
        let a_at = 4096u64;
        let b_at = a_at + a_bytes.len() as u64 + 13;
        let mut w = WriteBatch::new(&out);
        let sa = w.source(&a);
        let bview = bdev.slice(1..);
        let sb = w.source(&bview);
        w.write_host(&header, 0)
            .write(sa, 0, a_bytes.len() / 2, a_at)
            .write(
                sa,
                a_bytes.len() / 2,
                a_bytes.len() / 2,
                a_at + (a_bytes.len() / 2) as u64,
            )
            .write(sb, 0, b_host.len() - 1, b_at)
            .durable(true);
        let r = w.run().unwrap();
        assert_eq!(r.items, 4);
        eprintln!("{name}: {r}");
        let file = std::fs::read(&p).unwrap();
        let mut model = vec![0u8; b_at as usize + b_host.len() - 1];
        model[..header.len()].copy_from_slice(&header);
        model[a_at as usize..a_at as usize + a_bytes.len()].copy_from_slice(&a_bytes);
        model[b_at as usize..].copy_from_slice(&b_host[1..]);
        assert_eq!(file.len(), model.len(), "{name}");
        assert!(file == model, "{name}: file differs");
        // Overlapping items: refused, file untouched.
        let mut w = WriteBatch::new(&out);
        let sa = w.source(&a);
        w.write(sa, 0, 100, 10).write_host(&header, 50);
        match w.run() {
            Err(Error::BatchRefused { index: 1, .. }) => {}
            other => panic!("{name}: overlapping writes: {other:?}"),
        }
        assert!(
            std::fs::read(&p).unwrap() == model,
            "{name}: a refused batch wrote"
        );
    }
    let ro = GpuFile::open(d.join("w-default.bin")).unwrap();
    let mut w = WriteBatch::new(&ro);
    w.write_host(b"x", 0);
    assert!(matches!(w.run(), Err(Error::BatchRefused { index: 0, .. })));
    std::fs::remove_dir_all(&d).unwrap();
}

/// The refusal a `WriteBatch` returned: its index and its source's message, which must be an
/// `Error::InvalidArgument`.
fn refused_write(
    what: &str,
    r: gpudirect::Result<gpudirect::storage::BatchReport>,
) -> (usize, String) {
    match r {
        Err(Error::BatchRefused { index, source }) => match *source {
            Error::InvalidArgument(m) => (index, m),
            e => panic!("{what}: refused, but not with an InvalidArgument: {e:?}"),
        },
        other => panic!("{what}: {other:?}"),
    }
}

/// A `WriteBatch` of host items (no GPU needed) refuses bad input at the first bad item before
/// any byte is written: two file ranges that overlap (the later item refused, the earlier one
/// named; back to back is fine), a file offset past the largest, a file opened read-only (item
/// 0, the file named). The file keeps every byte and its length; the same batch without its bad
/// item writes every byte.
#[test]
fn write_batch_refusals_leave_the_file_untouched() {
    let d = scratch("write-refused");
    let p = d.join("w.bin");
    let old = random(64 << 10, 21);
    let parts: Vec<Vec<u8>> = (0..4).map(|k| random(3000 + k, 30 + k as u64)).collect();
    let bad_item = random(500, 40);
    // (what, the bad item's bytes and file offset (added third), what the refusal says)
    let cases: [(&str, &[u8], u64, &str); 3] = [
        (
            "a file range overlapping an earlier item's",
            &bad_item,
            10_000 + 2999,
            "overlaps item 1's",
        ),
        (
            "a file range swallowing an earlier item's",
            &parts[3][..],
            4000 - 1,
            "overlaps item 0's",
        ),
        (
            "a file offset past the largest",
            &bad_item,
            u64::MAX - 100,
            "passes the largest file offset",
        ),
    ];
    // Two good items: at 4000 (item 0), at 10_000 (item 1).
    fn good<'a>(w: &mut WriteBatch<'a>, parts: &'a [Vec<u8>]) {
        w.write_host(&parts[0], 4000).write_host(&parts[1], 10_000);
    }
    for (what, bytes, at, says) in cases {
        std::fs::write(&p, &old).unwrap();
        let f = GpuFile::options().write(true).open(&p).unwrap();
        let mut w = WriteBatch::new(&f);
        good(&mut w, &parts);
        w.write_host(bytes, at).write_host(&parts[2], 30_000);
        let (index, m) = refused_write(what, w.run());
        assert_eq!(index, 2, "{what}: {m}");
        assert!(m.contains(says), "{what}: {m}");
        drop(f);
        assert!(
            std::fs::read(&p).unwrap() == old,
            "{what}: a refused batch wrote"
        );
    }
    // A file opened read-only: refused at item 0, naming the file.
    std::fs::write(&p, &old).unwrap();
    let ro = GpuFile::open(&p).unwrap();
    let mut w = WriteBatch::new(&ro);
    good(&mut w, &parts);
    let (index, m) = refused_write("a read-only file", w.run());
    assert_eq!(index, 0, "{m}");
    assert!(
        m.contains("read-only") && m.contains(&*p.to_string_lossy()),
        "{m}"
    );
    drop(ro);
    assert!(
        std::fs::read(&p).unwrap() == old,
        "a read-only file was written"
    );
    // The good items, plus two back to back at the end (the file grows): every byte.
    let f = GpuFile::options().write(true).open(&p).unwrap();
    let mut w = WriteBatch::new(&f);
    good(&mut w, &parts);
    let end = old.len() as u64;
    w.write_host(&parts[2], end)
        .write_host(&parts[3], end + parts[2].len() as u64);
    let r = w.run().unwrap();
    assert_eq!((r.items, r.bytes), (4, parts.iter().map(Vec::len).sum()));
    drop(f);
    let mut want = old.clone();
    want[4000..4000 + parts[0].len()].copy_from_slice(&parts[0]);
    want[10_000..10_000 + parts[1].len()].copy_from_slice(&parts[1]);
    want.extend_from_slice(&parts[2]);
    want.extend_from_slice(&parts[3]);
    assert!(
        std::fs::read(&p).unwrap() == want,
        "the good batch's file differs"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A `WriteBatch` from device memory refuses a source range outside its buffer (its end past
/// the buffer, an offset past it, an end that overflows) and a source registered with another
/// batch, at the item, with the file untouched (every byte); overlapping ranges of a device
/// item and a host item too. The same batch without its bad item writes every byte.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_write_refusals_leave_the_file_untouched() {
    let (_ctx, stream) = gpu();
    let d = scratch("write-refused-gpu");
    let p = d.join("w.bin");
    let old = random(1 << 20, 51);
    let a_host = random(100_000, 52);
    let b_host = random(5000, 53);
    let a = stream.clone_htod(&a_host).unwrap();
    let b = stream.clone_htod(&b_host).unwrap();
    let header = random(64, 54);
    // An unrelated batch's handle: the second source it registers is index 1, which the
    // batch below (one source) does not have.
    let spare = d.join("spare.bin");
    std::fs::write(&spare, b"spare").unwrap();
    let other = GpuFile::open(&spare).unwrap();
    let foreign = {
        let mut w = WriteBatch::new(&other);
        w.source(&a);
        w.source(&b)
    };
    // (what, the bad item (added third): its source (false: the foreign one), source offset,
    // length and file offset; what the refusal says)
    type Case = (&'static str, bool, usize, usize, u64, &'static str);
    let cases: [Case; 5] = [
        (
            "a source range ending past its buffer",
            true,
            99_000,
            1001,
            300_000,
            "are not inside its 100000-byte source",
        ),
        (
            "a source offset past its buffer",
            true,
            100_001,
            0,
            300_000,
            "are not inside its 100000-byte source",
        ),
        (
            "a source range whose end overflows",
            true,
            usize::MAX - 3,
            10,
            300_000,
            "are not inside its 100000-byte source",
        ),
        (
            "a source of another batch",
            false,
            0,
            10,
            300_000,
            "was not registered with this batch",
        ),
        (
            "a device range overlapping the header",
            true,
            0,
            100,
            63,
            "overlaps item 0's",
        ),
    ];
    for (what, mine, src_off, len, at, says) in cases {
        std::fs::write(&p, &old).unwrap();
        let f = GpuFile::options().write(true).open(&p).unwrap();
        let mut w = WriteBatch::new(&f);
        let s = w.source(&a);
        w.write_host(&header, 0).write(s, 0, 50_000, 4096);
        w.write(if mine { s } else { foreign }, src_off, len, at);
        w.write(s, 50_000, 50_000, 600_000);
        let (index, m) = refused_write(what, w.run());
        assert_eq!(index, 2, "{what}: {m}");
        assert!(m.contains(says), "{what}: {m}");
        drop(f);
        assert!(
            std::fs::read(&p).unwrap() == old,
            "{what}: a refused batch wrote"
        );
    }
    drop(other);
    // Without the bad item: every byte.
    std::fs::write(&p, &old).unwrap();
    let f = GpuFile::options().write(true).open(&p).unwrap();
    let mut w = WriteBatch::new(&f);
    let s = w.source(&a);
    let sb = w.source(&b);
    w.write_host(&header, 0)
        .write(s, 0, 50_000, 4096)
        .write(s, 50_000, 50_000, 600_000)
        .write(sb, 1, 4999, (1 << 20) - 10);
    let r = w.run().unwrap();
    assert_eq!(r.bytes, 64 + 100_000 + 4999);
    drop(f);
    let mut want = old.clone();
    want[..64].copy_from_slice(&header);
    want[4096..54_096].copy_from_slice(&a_host[..50_000]);
    want[600_000..650_000].copy_from_slice(&a_host[50_000..]);
    want.truncate((1 << 20) - 10);
    want.extend_from_slice(&b_host[1..]);
    assert!(
        std::fs::read(&p).unwrap() == want,
        "the good batch's file differs"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

// ---- typed buffers, zero-size files -------------------------------------------------------

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
        let (buf, r) = gpudirect::storage::read_to_gpu::<f32>(&p, &stream).unwrap();
        assert_eq!((buf.len(), r.bytes), (elems, elems * 4));
        let back = stream.clone_dtoh(&buf).unwrap();
        assert!(
            bytes_of(&back) == model,
            "gpudirect::storage::read_to_gpu::<f32> differs ({elems})"
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
    match gpudirect::storage::read_to_gpu::<u32>(&p, &stream) {
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
    let (buf, r) = gpudirect::storage::read_to_gpu::<u8>("/proc/version", &stream).unwrap();
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

/// Set in the child process of `gpu_storage_batch_reads_more_files_than_the_process_may_hold_open`.
const FD_LIMIT_CHILD: &str = "GPUDIRECT_TEST_BATCH_FD_CHILD";

/// A `ReadBatch` of 3000 files by path (1 byte to 160 KiB, random gaps between them in one
/// buffer) in a process whose soft `RLIMIT_NOFILE` is 256: every byte in place, every gap byte
/// untouched, one report naming the POSIX path, under the segment and lane pipelines. The test
/// runs itself in a child process with the lowered limit (so no other test shares it); run
/// without a GPU, the child fails with the setup hint and so does this test. Before the
/// descriptor window the batch opened every file first and was refused with `EMFILE` (the host
/// test `storage::batch::tests::a_batch_reads_more_files_than_the_process_may_hold_open`
/// showed that on the batch's own code).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_storage_batch_reads_more_files_than_the_process_may_hold_open() {
    if std::env::var_os(FD_LIMIT_CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "gpu_storage_batch_reads_more_files_than_the_process_may_hold_open",
                "--include-ignored",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(FD_LIMIT_CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "the child failed:\n{text}");
        assert!(text.contains("child: 3000 files"), "{text}");
        eprintln!("{text}");
        return;
    }
    let (_ctx, stream) = gpu();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid pointers; this child process runs this test alone.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = 256;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    let d = scratch("fdlimit");
    let mut rng = rand::rngs::StdRng::seed_from_u64(256);
    let n = 3000;
    let mut files = Vec::new();
    let mut offsets = Vec::new();
    let mut at = 0usize;
    for i in 0..n {
        let p = d.join(format!("f{i}"));
        let data = random(rng.random_range(1..=160 << 10), 7000 + i as u64);
        std::fs::write(&p, &data).unwrap();
        at += if i % 2 == 0 {
            0
        } else {
            rng.random_range(1..64)
        };
        offsets.push(at);
        at += data.len();
        files.push((p, data));
    }
    for (opts, name) in [
        (GpuFile::options(), "segments"),
        (GpuFile::options().pipeline(Pipeline::Lanes), "lanes"),
    ] {
        let mut dst = sentinel_buf(&stream, at + 9);
        let mut b = ReadBatch::with_options(opts);
        let h = b.destination(&mut dst);
        for (i, (p, data)) in files.iter().enumerate() {
            b.read(p, 0, data.len(), h, offsets[i]);
        }
        let r = b.run().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((r.items, r.files), (n, n), "{name}");
        assert_eq!(r.path.path, TransferPath::Posix, "{name}: {}", r.path);
        let got = stream.clone_dtoh(&dst).unwrap();
        let mut model = vec![SENTINEL; at + 9];
        for (i, (_, data)) in files.iter().enumerate() {
            model[offsets[i]..offsets[i] + data.len()].copy_from_slice(data);
        }
        if got != model {
            let k = got.iter().zip(&model).position(|(a, b)| a != b).unwrap();
            panic!("{name}: byte {k} differs");
        }
        eprintln!("child: {n} files under a soft RLIMIT_NOFILE of 256, {name}: {r}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

//! One-shot storage benchmark (issue 10): what a **fresh process** gets on its **first**
//! transfer, side by side with the limits and the best peer, in one command (about 5 minutes
//! on nvidia-h200 with the defaults). Every sample of a "fresh" row is its own child process
//! (this binary run with `--child`), CUDA initialised before the clock; rows are medians.
//!
//! Run on the GPU machine from the project root (after `../shared/tools/device-stage`; peers'
//! wheels in `.whl/`, see `scripts/gpu-suite`'s `wheels()`):
//!   bash scripts/gpu-suite bench-oneshot       (or: .device/benches/storage --oneshot)
//! (A mode of `benches/storage.rs`, so the staged binaries stay few.)
//! Here (no GPU) it checks its own harness and prints what it could not measure.
//!
//! Rows (GB/s = 10^9 bytes/s):
//! - `fresh ext4 cached`: a 4 GiB file in the page cache → GPU, `storage::read_to_gpu` as the
//!   first call of a fresh process (open, allocation, engine start and pinning included), vs
//!   the pinned host→device copy limit (one `cuMemcpyHtoD` of 1 GiB from pinned memory) and vs
//!   InstantTensor's backends on the same file (it is a safetensors file of one big tensor).
//! - `fresh tmpfs`: the same from `/dev/shm`.
//! - `fresh cold`: caches dropped (`echo 3 > /proc/sys/vm/drop_caches`) before each load, vs
//!   the best raw O_DIRECT read of that file (our own loop: threads × block variants).
//! - `fresh 10k files`: 10,000 files of 100 KiB → one GPU buffer with `storage::read_many`
//!   (files opened by the batch), vs std threads (8 and 16, `read_exact` into one host Vec)
//!   plus one host→device copy; files/s too.
//! - `4 KiB random read latency`: `GpuFile::read_to_device` of 4 KiB at random aligned offsets
//!   of the cached file, vs `pread` into pinned memory + `cuMemcpyHtoD`; medians and p99.
//! - `warm` rows beside each: the same call again in the same process (steady state).
//! - Not a row: `--child rand4k-parts FILE OPS`, a probe of where a 4 KiB read's time goes
//!   (`pread`, the copy, its synchronisation on the null and on an own stream, cudarc's events,
//!   `read_to_device` on both streams, a copy from a buffer registered as the small path's is,
//!   the small path's driver calls mirrored by hand), interleaved, one JSON line of medians
//!   and p99s.
//! - Not a row: `--child regcost`, what `cuMemHostRegister` costs in a fresh process with
//!   nothing else running (4 KiB twice, then 4 MiB, 28 MiB, 4 MiB of touched memory), in µs.
//! - Not a row: `--child rand4k-kernel FILE OPS`, a 4 KiB read whose host-to-device step is the
//!   SM copy kernel (`src/p2p/kernels.ptx`'s `gd_copy_v4`) reading the pinned buffer through its
//!   device address, against `pread` + `cuMemcpyHtoD(Async)` from pinned and from pageable
//!   memory; medians, p99s, the module's load.
//! - Probe knobs of the `gd` child (not used by the table): `GPUDIRECT_BENCH_PREHEAT=KIND:MS`
//!   (`host`, `gpu`, `h2d`: keep that busy for MS ms before the clock, then idle
//!   `GPUDIRECT_BENCH_PREHEAT_IDLE_MS`) and `GPUDIRECT_BENCH_DIAG=1` (after the first call, the
//!   threads' last CPUs and the large mappings' huge pages and NUMA nodes, on stderr); of the
//!   `h2d` child: `GPUDIRECT_BENCH_H2D_IDLE_MS` (idle between the host fill and the first copy).
//! - One more fresh sample of the page-cached 4 GiB row and of the 10k-files row runs with
//!   `GPUDIRECT_TRACE=timing` (out of the medians, as `... (traced)`); its trace lines (both
//!   calls of the child) are printed after the table: where a fresh process's first call spends
//!   its time against the warm second.
//!
//! Environment: `GPUDIRECT_BENCH_DIR` (default `GPUDIRECT_TEST_DIR`, else /var/tmp/gpudirect-test),
//! `GPUDIRECT_BENCH_SIZE` (4G), `GPUDIRECT_BENCH_RUNS` (5), `GPUDIRECT_BENCH_FILES` (10000),
//! `GPUDIRECT_BENCH_FILE_SIZE` (100K), `GPUDIRECT_BENCH_PEERS` (peers in the page-cached rows,
//! default `instanttensor,instanttensor:MMAP,instanttensor:BUFFERED`; `0`: none),
//! `GPUDIRECT_BENCH_PEERS_TMPFS` (default `instanttensor,instanttensor:MMAP`),
//! `GPUDIRECT_BENCH_PYTHON` (python3), `GPUDIRECT_BENCH_SHM` (/dev/shm), `GPUDIRECT_BENCH_KEEP=1`
//! keeps the files. Peers run through `scripts/bench_safetensors_peers.py load` (the checkpoint
//! room's harness).
//!
//! Output: progress on stderr; a markdown table with ratios and target checks on stdout, then one
//! JSON line per sample (`"bench":"storage_oneshot"`).

#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use gpudirect::cudarc::driver::{result, sys, DevicePtr};
use gpudirect::storage::{read_many, read_to_gpu, GpuFile, ReadItem};
use rand::{Rng, RngCore, SeedableRng};
use serde_json::{json, Value};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_string())
}

fn size_env(name: &str, default: &str) -> Res<usize> {
    let v = env(name, default);
    gpudirect::storage::config::parse_size(&v)
        .ok_or_else(|| format!("{name}={v:?} is not a size").into())
}

fn emit(v: Value) {
    println!("{v}");
}

// ---- children: one measurement each, one JSON line -------------------------------------------

fn cuda() -> Res<std::sync::Arc<gpudirect::cudarc::driver::CudaStream>> {
    let ctx = gpudirect::cuda::context(0)?;
    let stream = ctx.default_stream();
    // Initialise the context and its memory pool before any clock.
    let x = stream.alloc_zeros::<u8>(1 << 20)?;
    stream.synchronize()?;
    drop(x);
    Ok(stream)
}

fn child(args: &[String]) -> Res<()> {
    let mode = args.first().map(String::as_str).unwrap_or("");
    match mode {
        "gd" => {
            let path = Path::new(&args[1]);
            let stream = cuda()?;
            preheat(&stream)?;
            let t0 = Instant::now();
            let (mut buf, r) = read_to_gpu::<u8>(path, &stream)?;
            stream.synchronize()?;
            let first = t0.elapsed().as_secs_f64();
            if env("GPUDIRECT_BENCH_DIAG", "0") == "1" {
                eprintln!("diag {}", diag());
            }
            let f = GpuFile::open(path)?;
            let t1 = Instant::now();
            let w = f.read_to_device(&mut buf, 0)?;
            let warm = t1.elapsed().as_secs_f64();
            assert_eq!(w.bytes, r.bytes);
            // Spot check: three random 64 KiB windows against the file.
            let mut rng = rand::rngs::StdRng::seed_from_u64(first.to_bits());
            let host = File::open(path)?;
            for _ in 0..3 {
                let off = rng.random_range(0..r.bytes.saturating_sub(65536).max(1));
                let n = 65536.min(r.bytes - off);
                let dev = stream.clone_dtoh(&buf.slice(off..off + n))?;
                let mut exp = vec![0u8; n];
                std::os::unix::fs::FileExt::read_exact_at(&host, &mut exp, off as u64)?;
                if dev != exp {
                    return Err(format!("data differs at offset {off}").into());
                }
            }
            emit(
                json!({"gbps": r.bytes as f64 / first / 1e9, "seconds": first,
                "warm_gbps": r.bytes as f64 / warm / 1e9, "bytes": r.bytes,
                "path": r.path.to_string(), "odirect": r.odirect}),
            );
        }
        "parts" => {
            let path = Path::new(&args[1]);
            let stream = cuda()?;
            let t = Instant::now();
            let f = GpuFile::open(path)?;
            let open = t.elapsed().as_secs_f64();
            let len = f.len()? as usize;
            let t = Instant::now();
            // SAFETY: filled by the read below before anything reads it.
            let mut buf = unsafe { stream.alloc::<u8>(len) }?;
            stream.synchronize()?;
            let alloc = t.elapsed().as_secs_f64();
            let t = Instant::now();
            f.read_to_device(&mut buf, 0)?;
            let first = t.elapsed().as_secs_f64();
            let t = Instant::now();
            f.read_to_device(&mut buf, 0)?;
            let second = t.elapsed().as_secs_f64();
            emit(json!({"open_ms": open * 1e3, "alloc_ms": alloc * 1e3,
                "first_read_gbps": len as f64 / first / 1e9, "second_read_gbps": len as f64 / second / 1e9,
                "first_read_ms": first * 1e3, "second_read_ms": second * 1e3}));
        }
        "regcost" => {
            // What cuMemHostRegister costs in a fresh process (nothing else running): the
            // process's first registration against the next ones, on touched memory.
            let _stream = cuda()?;
            let mut out = serde_json::Map::new();
            let map = |n: usize| -> *mut u8 {
                // SAFETY: a fresh private anonymous mapping, touched, never unmapped.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        n,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                        -1,
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED);
                p.cast()
            };
            for (i, n) in [4096usize, 4096, 4 << 20, 28 << 20, 4 << 20]
                .into_iter()
                .enumerate()
            {
                let p = map(n);
                let t = Instant::now();
                // SAFETY: our mapping of n bytes, registered once, never unregistered.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(p.cast(), n, sys::CU_MEMHOSTREGISTER_PORTABLE)
                };
                out.insert(
                    format!("reg{i}_{n}_us"),
                    json!(t.elapsed().as_secs_f64() * 1e6),
                );
                assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
            }
            emit(Value::Object(out));
        }
        "h2d" => {
            let n: usize = 1 << 30;
            let stream = cuda()?;
            // SAFETY: written below before use; freed at the end.
            let pinned = unsafe { result::malloc_host(n, 0) }?.cast::<u8>();
            // SAFETY: pinned holds n bytes.
            unsafe { std::ptr::write_bytes(pinned, 7, n) };
            // SAFETY: the copies below fill it.
            let dev = unsafe { stream.alloc::<u8>(n) }?;
            stream.synchronize()?;
            let (p, _g) = dev.device_ptr(&stream);
            // Probe knob: idle this long between the host's fill and the first copy.
            let idle: u64 = env("GPUDIRECT_BENCH_H2D_IDLE_MS", "0").parse()?;
            std::thread::sleep(std::time::Duration::from_millis(idle));
            let mut v = Vec::new();
            for _ in 0..7 {
                let t = Instant::now();
                // SAFETY: both hold n bytes.
                unsafe { sys::cuMemcpyHtoD_v2(p, pinned.cast(), n) }.result()?;
                v.push(n as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            // SAFETY: allocated above; the copies were synchronous.
            unsafe { result::free_host(pinned.cast()) }?;
            // The process's first copy beside the steady rate: what a fresh process's first
            // DMA costs, apart from any staging.
            let first = v[0];
            v.sort_by(f64::total_cmp);
            emit(json!({"gbps": v[v.len() / 2], "best_gbps": v[v.len() - 1], "first_gbps": first}));
        }
        "batch" => {
            let (dir, n, fsize) = (
                PathBuf::from(&args[1]),
                args[2].parse::<usize>()?,
                args[3].parse::<usize>()?,
            );
            let stream = cuda()?;
            let paths: Vec<PathBuf> = (0..n).map(|i| small_path(&dir, i)).collect();
            let items: Vec<ReadItem> = paths
                .iter()
                .enumerate()
                .map(|(i, p)| ReadItem {
                    path: p,
                    file_offset: 0,
                    len: fsize,
                    dst_offset: i * fsize,
                })
                .collect();
            let mut dst = stream.alloc_zeros::<u8>(n * fsize)?;
            stream.synchronize()?;
            let t = Instant::now();
            let r = read_many(&mut dst, &items)?;
            let first = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let r2 = read_many(&mut dst, &items)?;
            let warm = t.elapsed().as_secs_f64();
            for i in [0, n / 2, n - 1] {
                let dev = stream.clone_dtoh(&dst.slice(i * fsize..(i + 1) * fsize))?;
                if dev != std::fs::read(&paths[i])? {
                    return Err(format!("file {i} differs on the GPU").into());
                }
            }
            let bytes = n * fsize;
            emit(
                json!({"gbps": bytes as f64 / first / 1e9, "files_per_s": n as f64 / first,
                "seconds": first, "warm_gbps": bytes as f64 / warm / 1e9, "warm_files_per_s": n as f64 / warm,
                "copies": r.copies, "warm_copies": r2.copies, "path": r.path.to_string()}),
            );
        }
        "stdthreads" => {
            let (dir, n, fsize, threads) = (
                PathBuf::from(&args[1]),
                args[2].parse::<usize>()?,
                args[3].parse::<usize>()?,
                args[4].parse::<usize>()?,
            );
            let stream = cuda()?;
            let mut dst = stream.alloc_zeros::<u8>(n * fsize)?;
            stream.synchronize()?;
            let t = Instant::now();
            let mut host = vec![0u8; n * fsize];
            let per = n.div_ceil(threads);
            std::thread::scope(|s| -> Res<()> {
                let hs: Vec<_> = host
                    .chunks_mut(per * fsize)
                    .enumerate()
                    .map(|(k, chunk)| {
                        let dir = &dir;
                        s.spawn(move || -> std::io::Result<()> {
                            for (j, slot) in chunk.chunks_mut(fsize).enumerate() {
                                let mut f = File::open(small_path(dir, k * per + j))?;
                                std::io::Read::read_exact(&mut f, slot)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().map_err(|_| "reader thread panicked")??;
                }
                Ok(())
            })?;
            stream.memcpy_htod(&host, &mut dst)?;
            stream.synchronize()?;
            let secs = t.elapsed().as_secs_f64();
            emit(
                json!({"gbps": (n * fsize) as f64 / secs / 1e9, "files_per_s": n as f64 / secs, "seconds": secs}),
            );
        }
        "rand4k" => {
            let path = Path::new(&args[1]);
            let ops: usize = args[2].parse()?;
            let stream = cuda()?;
            let f = GpuFile::open(path)?;
            let len = f.len()?;
            let blocks = len / 4096;
            let mut buf = stream.alloc_zeros::<u8>(4096)?;
            let raw = File::open(path)?;
            // SAFETY: written by pread before use; freed at the end.
            let pinned = unsafe { result::malloc_host(4096, 0) }?.cast::<u8>();
            let base_buf = stream.alloc_zeros::<u8>(4096)?;
            let (dptr, _g) = base_buf.device_ptr(&stream);
            let mut rng = rand::rngs::StdRng::seed_from_u64(4096);
            let (mut ours, mut base) = (Vec::with_capacity(ops), Vec::with_capacity(ops));
            for round in 0..(ops / 250 + 2) {
                for _ in 0..250 {
                    let off = rng.random_range(0..blocks) * 4096;
                    let t = Instant::now();
                    // SAFETY: pinned holds 4096 bytes.
                    unsafe { pread_4k(&raw, pinned, off) }?;
                    // SAFETY: both hold 4096 bytes.
                    unsafe { sys::cuMemcpyHtoD_v2(dptr, pinned.cast(), 4096) }.result()?;
                    if round > 1 {
                        base.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                for _ in 0..250 {
                    let off = rng.random_range(0..blocks) * 4096;
                    let t = Instant::now();
                    f.read_to_device(&mut buf, off)?;
                    if round > 1 {
                        ours.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
            }
            // SAFETY: allocated above; every copy was synchronous.
            unsafe { result::free_host(pinned.cast()) }?;
            let q = |v: &mut Vec<f64>, p: f64| {
                v.sort_by(f64::total_cmp);
                v[((v.len() as f64 - 1.0) * p) as usize]
            };
            emit(
                json!({"ours_median_us": q(&mut ours, 0.5), "ours_p99_us": q(&mut ours, 0.99),
                "base_median_us": q(&mut base, 0.5), "base_p99_us": q(&mut base, 0.99), "ops": ours.len()}),
            );
        }
        "rand4k-parts" => {
            // Probe (not a table row): where a 4 KiB read's time goes. Each variant runs 250
            // reads per round at random aligned offsets, interleaved, rounds 0-1 discarded;
            // medians in µs. `base` is the table's baseline; `ours_*` is read_to_device.
            let path = Path::new(&args[1]);
            let ops: usize = args[2].parse()?;
            let stream = cuda()?;
            let own = stream.context().new_stream()?;
            let f = GpuFile::open(path)?;
            let blocks = f.len()? / 4096;
            let raw = File::open(path)?;
            // SAFETY: written by pread before use; freed at the end.
            let pinned = unsafe { result::malloc_host(4096, 0) }?.cast::<u8>();
            let mut buf0 = stream.alloc_zeros::<u8>(4096)?;
            let mut buf_own = own.alloc_zeros::<u8>(4096)?;
            let plain = stream.alloc_zeros::<u8>(4096)?;
            let (dptr, _g) = plain.device_ptr(&stream);
            let cs = own.cu_stream();
            // A buffer made as the small path makes its own (an anonymous populated mapping of
            // 1 MiB + 8 KiB, cuMemHostRegister PORTABLE), to tell a registered buffer's copy
            // from a cuMemHostAlloc one's; `mirror` makes the small path's driver calls
            // (two cuCtxGetCurrent, cuStreamIsCapturing) around the same pread and copy.
            let reg_len = (1usize << 20) + 8192;
            // SAFETY: a fresh private anonymous mapping, registered below, never freed (a probe).
            let reg = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    reg_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                    -1,
                    0,
                )
            };
            if reg == libc::MAP_FAILED {
                return Err("mmap".into());
            }
            let reg = reg.cast::<u8>();
            // SAFETY: our live mapping of reg_len bytes, never unmapped.
            unsafe {
                sys::cuMemHostRegister_v2(reg.cast(), reg_len, sys::CU_MEMHOSTREGISTER_PORTABLE)
            }
            .result()?;
            let names = [
                "base",
                "pread",
                "h2d_sync",
                "h2d_async_null",
                "h2d_async_own",
                "pread_async_own",
                "devptr_events",
                "ours_null",
                "ours_own",
                "reg_h2d_async_null",
                "reg_pread_async_null",
                "mirror",
                "pread_async_null",
            ];
            // SAFETY: pinned holds 4096 bytes, freed only at the end.
            let pread = |off: u64| unsafe { pread_4k(&raw, pinned, off) };
            let v = interleaved(ops, names.len(), 4097, blocks, |k, off| {
                // SAFETY: pinned and the device buffers hold 4096 bytes; every copy
                // is waited for before the next use.
                unsafe {
                    match k {
                        0 => {
                            pread(off)?;
                            sys::cuMemcpyHtoD_v2(dptr, pinned.cast(), 4096).result()?;
                        }
                        1 => pread(off)?,
                        2 => sys::cuMemcpyHtoD_v2(dptr, pinned.cast(), 4096).result()?,
                        3 => {
                            sys::cuMemcpyHtoDAsync_v2(
                                dptr,
                                pinned.cast(),
                                4096,
                                std::ptr::null_mut(),
                            )
                            .result()?;
                            sys::cuStreamSynchronize(std::ptr::null_mut()).result()?;
                        }
                        4 => {
                            sys::cuMemcpyHtoDAsync_v2(dptr, pinned.cast(), 4096, cs).result()?;
                            sys::cuStreamSynchronize(cs).result()?;
                        }
                        5 => {
                            pread(off)?;
                            sys::cuMemcpyHtoDAsync_v2(dptr, pinned.cast(), 4096, cs).result()?;
                            sys::cuStreamSynchronize(cs).result()?;
                        }
                        6 => {
                            use gpudirect::cudarc::driver::DevicePtrMut;
                            let (_p, g) = buf_own.device_ptr_mut(&own);
                            drop(g);
                        }
                        7 => {
                            f.read_to_device(&mut buf0, off)?;
                        }
                        8 => {
                            f.read_to_device(&mut buf_own, off)?;
                        }
                        9 => {
                            sys::cuMemcpyHtoDAsync_v2(dptr, reg.cast(), 4096, std::ptr::null_mut())
                                .result()?;
                            sys::cuStreamSynchronize(std::ptr::null_mut()).result()?;
                        }
                        10 | 11 => {
                            if k == 11 {
                                let mut c = std::ptr::null_mut();
                                sys::cuCtxGetCurrent(&mut c).result()?;
                                let mut st =
                                    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                                sys::cuStreamIsCapturing(std::ptr::null_mut(), &mut st).result()?;
                                sys::cuCtxGetCurrent(&mut c).result()?;
                            }
                            pread_4k(&raw, reg, off)?;
                            sys::cuMemcpyHtoDAsync_v2(dptr, reg.cast(), 4096, std::ptr::null_mut())
                                .result()?;
                            sys::cuStreamSynchronize(std::ptr::null_mut()).result()?;
                        }
                        _ => {
                            pread(off)?;
                            sys::cuMemcpyHtoDAsync_v2(
                                dptr,
                                pinned.cast(),
                                4096,
                                std::ptr::null_mut(),
                            )
                            .result()?;
                            sys::cuStreamSynchronize(std::ptr::null_mut()).result()?;
                        }
                    }
                }
                Ok(())
            })?;
            own.synchronize()?;
            // SAFETY: allocated above; every copy was waited for.
            unsafe { result::free_host(pinned.cast()) }?;
            let mut out = serde_json::Map::new();
            quantiles(&names, v, &mut out);
            emit(Value::Object(out));
        }
        "rand4k-kernel" => {
            // Probe (not a table row): a 4 KiB read whose host->device step is the SM copy
            // kernel reading the pinned buffer through its device address, against the
            // copy engine. Medians in µs; module load time in ms.
            let path = Path::new(&args[1]);
            let ops: usize = args[2].parse()?;
            let stream = cuda()?;
            let ctx = stream.context().clone();
            let t = Instant::now();
            let module = ctx.load_module(gpudirect::cudarc::nvrtc::Ptx::from_src(include_str!(
                "../../src/p2p/kernels.ptx"
            )))?;
            let kern = module.load_function("gd_copy_v4")?;
            let load_ms = t.elapsed().as_secs_f64() * 1e3;
            let raw = File::open(path)?;
            let blocks = raw.metadata()?.len() / 4096;
            // SAFETY: written by pread before use; freed at the end.
            let pinned = unsafe { result::malloc_host(4096, 0) }?.cast::<u8>();
            let plain = stream.alloc_zeros::<u8>(4096)?;
            let (dptr, _g) = plain.device_ptr(&stream);
            let src = pinned as u64;
            let n16: u64 = 4096 / 16;
            let names = [
                "base",
                "pread_async_null",
                "kernel_only",
                "pread_kernel",
                "pread_kernel_1warp",
                "pageable_sync",
                "pageable_async_null",
            ];
            // A pageable (not page-locked) buffer: the driver stages its copies itself.
            let mut pageable = vec![0u8; 4096];
            // SAFETY: pinned holds 4096 bytes, freed only at the end.
            let pread = |off: u64| unsafe { pread_4k(&raw, pinned, off) };
            let launch = |threads: u32| -> Res<()> {
                use gpudirect::cudarc::driver::{LaunchConfig, PushKernelArg};
                let cfg = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut lb = stream.launch_builder(&kern);
                lb.arg(&src).arg(&dptr).arg(&n16);
                // SAFETY: gd_copy_v4 copies n16 16-byte elements from the pinned buffer (its
                // device address under UVA) into `plain`; both hold 4096 bytes.
                unsafe { lb.launch(cfg) }?;
                stream.synchronize()?;
                Ok(())
            };
            // The kernel's result checked once against the file.
            pread(0)?;
            launch(256)?;
            let mut exp = vec![0u8; 4096];
            std::os::unix::fs::FileExt::read_exact_at(&raw, &mut exp, 0)?;
            if stream.clone_dtoh(&plain)? != exp {
                return Err("the kernel's copy differs from the file".into());
            }
            let v = interleaved(ops, names.len(), 4098, blocks, |k, off| {
                match k {
                    0 => {
                        pread(off)?;
                        // SAFETY: both hold 4096 bytes.
                        unsafe { sys::cuMemcpyHtoD_v2(dptr, pinned.cast(), 4096) }.result()?;
                    }
                    1 => {
                        pread(off)?;
                        // SAFETY: both hold 4096 bytes; synchronized right below.
                        unsafe {
                            sys::cuMemcpyHtoDAsync_v2(
                                dptr,
                                pinned.cast(),
                                4096,
                                std::ptr::null_mut(),
                            )
                        }
                        .result()?;
                        // SAFETY: the legacy stream.
                        unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result()?;
                    }
                    2 => launch(256)?,
                    3 => {
                        pread(off)?;
                        launch(256)?;
                    }
                    4 => {
                        pread(off)?;
                        launch(32)?;
                    }
                    _ => {
                        std::os::unix::fs::FileExt::read_exact_at(&raw, &mut pageable, off)?;
                        if k == 5 {
                            // SAFETY: both hold 4096 bytes; synchronous.
                            unsafe { sys::cuMemcpyHtoD_v2(dptr, pageable.as_ptr().cast(), 4096) }
                                .result()?;
                        } else {
                            // SAFETY: both hold 4096 bytes; synchronized right below,
                            // before `pageable` is written again.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(
                                    dptr,
                                    pageable.as_ptr().cast(),
                                    4096,
                                    std::ptr::null_mut(),
                                )
                            }
                            .result()?;
                            // SAFETY: the legacy stream.
                            unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result()?;
                        }
                    }
                }
                Ok(())
            })?;
            // SAFETY: allocated above; every copy was waited for.
            unsafe { result::free_host(pinned.cast()) }?;
            let mut out = serde_json::Map::new();
            out.insert("module_load_ms".into(), json!(load_ms));
            quantiles(&names, v, &mut out);
            emit(Value::Object(out));
        }
        "raw" => {
            let (path, threads, block) = (
                PathBuf::from(&args[1]),
                args[2].parse::<usize>()?,
                args[3].parse::<usize>()?,
            );
            emit(json!({"gbps": raw_read(&path, threads, block)?}));
        }
        other => return Err(format!("unknown child mode {other:?}").into()),
    }
    Ok(())
}

/// `pread` of 4096 bytes of `file` at `off` into `buf`.
///
/// # Safety
/// `buf` must be writable for 4096 bytes.
unsafe fn pread_4k(file: &File, buf: *mut u8, off: u64) -> Res<()> {
    // SAFETY: buf is writable for 4096 bytes (the caller's contract).
    let r = unsafe { libc::pread(file.as_raw_fd(), buf.cast(), 4096, off as libc::off_t) };
    if r == 4096 {
        Ok(())
    } else {
        Err("pread".into())
    }
}

/// The 4 KiB probes' loop: `variants` variants, 250 calls of each per round, interleaved, at
/// random 4 KiB-aligned offsets below `blocks` blocks (one generator seeded with `seed`), for
/// `ops / 250 + 2` rounds, rounds 0-1 discarded. `f(variant, offset)` is one call; returns each
/// variant's times in µs.
fn interleaved(
    ops: usize,
    variants: usize,
    seed: u64,
    blocks: u64,
    mut f: impl FnMut(usize, u64) -> Res<()>,
) -> Res<Vec<Vec<f64>>> {
    let mut v: Vec<Vec<f64>> = vec![Vec::new(); variants];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for round in 0..(ops / 250 + 2) {
        for (k, samples) in v.iter_mut().enumerate() {
            for _ in 0..250 {
                let off = rng.random_range(0..blocks) * 4096;
                let t = Instant::now();
                f(k, off)?;
                if round > 1 {
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
    }
    Ok(v)
}

/// Each variant's median and p99 into `out` (`NAME_median_us`, `NAME_p99_us`).
fn quantiles(names: &[&str], v: Vec<Vec<f64>>, out: &mut serde_json::Map<String, Value>) {
    for (name, mut s) in names.iter().zip(v) {
        s.sort_by(f64::total_cmp);
        out.insert(format!("{name}_median_us"), json!(s[s.len() / 2]));
        out.insert(format!("{name}_p99_us"), json!(s[(s.len() - 1) * 99 / 100]));
    }
}

/// Probe knob `GPUDIRECT_BENCH_PREHEAT=KIND:MS` (not used by the table): before a `gd` child's
/// clock, keep the host's memory (`host`: memset of 256 MiB), the GPU (`gpu`: device memset of
/// 1 GiB) or the host-to-device path (`h2d`: pinned 64 MiB copies) busy for MS ms, then idle
/// `GPUDIRECT_BENCH_PREHEAT_IDLE_MS` (0): tells which warm-up a fresh process's first call pays.
fn preheat(stream: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>) -> Res<()> {
    let v = env("GPUDIRECT_BENCH_PREHEAT", "");
    let Some((kind, ms)) = v.split_once(':') else {
        return Ok(());
    };
    let until = Instant::now() + std::time::Duration::from_millis(ms.parse()?);
    match kind {
        "host" => {
            let mut m = vec![0u8; 256 << 20];
            let mut k = 0u8;
            while Instant::now() < until {
                k = k.wrapping_add(1);
                m.fill(k);
                std::hint::black_box(&m);
            }
        }
        "gpu" => {
            let d = stream.alloc_zeros::<u8>(1 << 30)?;
            let (p, _g) = d.device_ptr(stream);
            while Instant::now() < until {
                // SAFETY: d holds 1 GiB.
                unsafe { sys::cuMemsetD8_v2(p, 7, 1 << 30) }.result()?;
                stream.synchronize()?;
            }
        }
        "h2d" => {
            let n = 64usize << 20;
            // SAFETY: written below before use; freed at the end.
            let h = unsafe { result::malloc_host(n, 0) }?.cast::<u8>();
            // SAFETY: h holds n bytes.
            unsafe { std::ptr::write_bytes(h, 3, n) };
            let d = stream.alloc_zeros::<u8>(n)?;
            let (p, _g) = d.device_ptr(stream);
            while Instant::now() < until {
                // SAFETY: both hold n bytes.
                unsafe { sys::cuMemcpyHtoD_v2(p, h.cast(), n) }.result()?;
            }
            // SAFETY: allocated above; the copies were synchronous.
            unsafe { result::free_host(h.cast()) }?;
        }
        other => return Err(format!("GPUDIRECT_BENCH_PREHEAT: unknown kind {other:?}").into()),
    }
    let idle: u64 = env("GPUDIRECT_BENCH_PREHEAT_IDLE_MS", "0").parse()?;
    std::thread::sleep(std::time::Duration::from_millis(idle));
    Ok(())
}

/// Probe knob `GPUDIRECT_BENCH_DIAG=1` (not used by the table): after a `gd` child's first
/// call, where its threads last ran and how its large mappings (the engine's ring) are backed
/// (transparent huge pages, NUMA nodes), one JSON object on stderr.
fn diag() -> Value {
    let mut threads = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc/self/task") {
        for e in rd.flatten() {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            // Fields after the ")" of comm: state is field 3; processor is field 39.
            let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let cpu = f.get(36).copied().unwrap_or("?");
            let utime = f.get(11).copied().unwrap_or("?");
            threads.push(json!([comm.trim(), cpu, utime]));
        }
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut maps = Vec::new();
    let mut cur: Option<(String, u64, u64, u64)> = None;
    for l in smaps.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            if let Some(m) = cur.take() {
                if m.1 >= 60 << 10 {
                    maps.push(json!({"range": m.0, "size_kb": m.1, "rss_kb": m.2, "thp_kb": m.3}));
                }
            }
            cur = Some((first.to_string(), 0, 0, 0));
        } else if let Some(m) = cur.as_mut() {
            let v = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0)
            };
            if l.starts_with("Size:") {
                m.1 = v(l);
            } else if l.starts_with("Rss:") {
                m.2 = v(l);
            } else if l.starts_with("AnonHugePages:") {
                m.3 = v(l);
            }
        }
    }
    let numa: Vec<String> = std::fs::read_to_string("/proc/self/numa_maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.contains("anon=")
                && l.split_whitespace()
                    .any(|w| w.starts_with("anon=") && w[5..].parse::<u64>().unwrap_or(0) > 10000)
        })
        .map(str::to_string)
        .collect();
    let allowed = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list"))
        .unwrap_or("")
        .to_string();
    json!({"threads": threads, "maps": maps, "numa": numa, "allowed": allowed})
}

fn small_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("f{i:05}.bin"))
}

struct Aligned(*mut u8, usize);
impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null());
        Aligned(p, len)
    }
}
impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout.
        unsafe {
            std::alloc::dealloc(
                self.0,
                std::alloc::Layout::from_size_align(self.1, 4096).unwrap(),
            )
        };
    }
}

/// `threads` threads read the file with O_DIRECT in `block`-byte requests taken from a shared
/// counter, into host memory.
fn raw_read(path: &Path, threads: usize, block: usize) -> Res<f64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let size = f.metadata()?.len() as usize;
    let blocks = size.div_ceil(block);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> Res<()> {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let (f, next) = (&f, &next);
                s.spawn(move || -> std::io::Result<()> {
                    let buf = Aligned::new(block);
                    loop {
                        let b = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if b >= blocks {
                            return Ok(());
                        }
                        // SAFETY: buf holds `block` bytes, aligned.
                        let r = unsafe {
                            libc::pread(
                                f.as_raw_fd(),
                                buf.0.cast(),
                                block,
                                (b * block) as libc::off_t,
                            )
                        };
                        if r < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "raw reader panicked")??;
        }
        Ok(())
    })?;
    Ok(size as f64 / t.elapsed().as_secs_f64() / 1e9)
}

// ---- the parent: files, children, table ------------------------------------------------------

struct Runner {
    exe: PathBuf,
    python: String,
    t0: Instant,
    samples: Vec<Value>,
    /// Traced samples: (row, the child's `gpudirect-trace` lines).
    traces: Vec<(String, Vec<String>)>,
}

impl Runner {
    fn log(&self, s: &str) {
        eprintln!("[{:6.1}s] {s}", self.t0.elapsed().as_secs_f64());
    }

    /// Runs one child; its JSON (or an error) is recorded under `row`.
    fn run(&mut self, row: &str, mut cmd: Command) -> Option<Value> {
        let out = cmd.output();
        self.record(row, &out)
    }

    /// Records a child's outcome under `row`: its last JSON line when it succeeded, else an
    /// error (the JSON's `error`, or the tail of its stderr).
    fn record(&mut self, row: &str, out: &std::io::Result<std::process::Output>) -> Option<Value> {
        let v = match out {
            Ok(o) => {
                let text = String::from_utf8_lossy(&o.stdout);
                match text
                    .lines()
                    .rev()
                    .find(|l| l.starts_with('{'))
                    .and_then(|l| serde_json::from_str::<Value>(l).ok())
                {
                    Some(v) if o.status.success() && v.get("error").is_none() => Some(v),
                    Some(v) => {
                        self.note(
                            row,
                            &format!("{}", v.get("error").cloned().unwrap_or(Value::Null)),
                        );
                        None
                    }
                    None => {
                        let err = String::from_utf8_lossy(&o.stderr);
                        let tail: Vec<&str> = err.lines().rev().take(3).collect();
                        self.note(row, &format!("{} ({})", tail.join(" | "), o.status));
                        None
                    }
                }
            }
            Err(e) => {
                self.note(row, &format!("could not start: {e}"));
                None
            }
        };
        if let Some(v) = &v {
            self.log(&format!("{row}: {v}"));
            self.samples
                .push(json!({"bench": "storage_oneshot", "row": row, "sample": v}));
        }
        v
    }

    /// Runs one more child with `GPUDIRECT_TRACE=timing` and keeps its trace lines (stderr,
    /// `gpudirect-trace ...`) for the report; its sample is recorded under `row (traced)`, out of
    /// the medians.
    fn traced(&mut self, row: &str, mut cmd: Command) {
        cmd.env("GPUDIRECT_TRACE", "timing");
        let name = format!("{row} (traced)");
        let out = cmd.output();
        self.record(&name, &out);
        let Ok(out) = out else { return };
        let lines: Vec<String> = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.starts_with("gpudirect-trace"))
            .map(str::to_string)
            .collect();
        self.traces.push((name, lines));
    }

    fn note(&mut self, row: &str, msg: &str) {
        self.log(&format!("{row}: FAILED: {msg}"));
        self.samples
            .push(json!({"bench": "storage_oneshot", "row": row, "error": msg}));
    }

    fn me(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--oneshot").arg("--child").args(args);
        c
    }

    fn peer(&self, peer: &str, path: &Path) -> Command {
        let mut c = Command::new(&self.python);
        c.args(["scripts/bench_safetensors_peers.py", "load", peer])
            .arg(path);
        c
    }
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn field(v: &[Value], k: &str) -> Vec<f64> {
    v.iter()
        .filter_map(|x| x.get(k).and_then(Value::as_f64))
        .collect()
}

/// A safetensors file of one BF16 tensor of `size` bytes of random data (so peers can load it
/// and `read_to_gpu` reads it as bytes).
fn make_file(path: &Path, size: usize) -> Res<usize> {
    let header = {
        let h = format!(
            "{{\"t\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[0,{size}]}}}}",
            size / 2
        );
        let pad = (8 - h.len() % 8) % 8;
        format!("{h}{}", " ".repeat(pad))
    };
    let total = 8 + header.len() + size;
    if std::fs::metadata(path).is_ok_and(|m| m.len() as usize == total) {
        return Ok(total);
    }
    let mut f = File::create(path)?;
    f.write_all(&(header.len() as u64).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    let block = 256 << 20;
    let mut buf = vec![0u8; block.min(size)];
    let mut done = 0;
    let mut seed = 1u64;
    while done < size {
        let n = block.min(size - done);
        std::thread::scope(|s| {
            for (i, c) in buf[..n].chunks_mut(16 << 20).enumerate() {
                let seed = seed * 1000 + i as u64;
                s.spawn(move || rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(c));
            }
        });
        f.write_all(&buf[..n])?;
        done += n;
        seed += 1;
    }
    Ok(total)
}

fn make_small_files(dir: &Path, n: usize, fsize: usize) -> Res<()> {
    std::fs::create_dir_all(dir)?;
    if std::fs::metadata(small_path(dir, n - 1)).is_ok_and(|m| m.len() as usize == fsize) {
        return Ok(());
    }
    std::thread::scope(|s| -> Res<()> {
        let hs: Vec<_> = (0..16)
            .map(|t| {
                s.spawn(move || -> std::io::Result<()> {
                    let mut buf = vec![0u8; fsize];
                    for i in (t..n).step_by(16) {
                        rand::rngs::SmallRng::seed_from_u64(i as u64 + 77).fill_bytes(&mut buf);
                        std::fs::write(small_path(dir, i), &buf)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "writer panicked")??;
        }
        Ok(())
    })
}

fn warm_cache(path: &Path) -> Res<()> {
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; 64 << 20];
    while std::io::Read::read(&mut f, &mut buf)? > 0 {}
    Ok(())
}

fn drop_caches() -> bool {
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

fn parent() -> Res<()> {
    let dir = PathBuf::from(env(
        "GPUDIRECT_BENCH_DIR",
        &env("GPUDIRECT_TEST_DIR", "/var/tmp/gpudirect-test"),
    ))
    .join("oneshot");
    let size = size_env("GPUDIRECT_BENCH_SIZE", "4G")?;
    let runs: usize = env("GPUDIRECT_BENCH_RUNS", "5").parse()?;
    let nfiles: usize = env("GPUDIRECT_BENCH_FILES", "10000").parse()?;
    let fsize = size_env("GPUDIRECT_BENCH_FILE_SIZE", "100K")?;
    let list = |v: String| -> Vec<String> {
        if v == "0" {
            Vec::new()
        } else {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        }
    };
    let peers = list(env(
        "GPUDIRECT_BENCH_PEERS",
        "instanttensor,instanttensor:MMAP,instanttensor:BUFFERED",
    ));
    let peers_tmpfs = list(env(
        "GPUDIRECT_BENCH_PEERS_TMPFS",
        "instanttensor,instanttensor:MMAP",
    ));
    let shm = PathBuf::from(env("GPUDIRECT_BENCH_SHM", "/dev/shm")).join("gpudirect-oneshot");
    let keep = env("GPUDIRECT_BENCH_KEEP", "0") == "1";
    let mut r = Runner {
        exe: std::env::current_exe()?,
        python: env("GPUDIRECT_BENCH_PYTHON", "python3"),
        t0: Instant::now(),
        samples: Vec::new(),
        traces: Vec::new(),
    };
    std::fs::create_dir_all(&dir)?;
    let big = dir.join("one-tensor.safetensors");
    let small = dir.join("small");
    r.log(&format!(
        "files in {} ({} bytes; {nfiles} x {fsize})",
        dir.display(),
        size
    ));
    let total = make_file(&big, size / 2 * 2)?;
    make_small_files(&small, nfiles, fsize)?;
    let has_gpu = gpudirect::cuda::device_count().unwrap_or(0) > 0;
    if !has_gpu {
        r.log("no CUDA GPU: the children will fail with their reason; the table shows what is missing");
    }
    let big_s = big.to_string_lossy().to_string();
    let small_s = small.to_string_lossy().to_string();
    let (n_s, f_s) = (nfiles.to_string(), fsize.to_string());

    // Limits.
    let h2d: Vec<Value> = (0..1)
        .filter_map(|_| r.run("pinned H2D limit", r.me(&["h2d"])))
        .collect();

    // Page-cached ext4 (or whatever GPUDIRECT_BENCH_DIR is on).
    warm_cache(&big)?;
    let mut rows: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for _ in 0..runs {
        let v = r.run("gd fresh cached", r.me(&["gd", &big_s]));
        rows.entry("gd fresh cached".into()).or_default().extend(v);
        let v = r.run("gd parts cached", r.me(&["parts", &big_s]));
        rows.entry("gd parts cached".into()).or_default().extend(v);
        for p in &peers {
            let name = format!("{p} cached");
            let v = r.run(&name, r.peer(p, &big));
            rows.entry(name).or_default().extend(v);
        }
    }
    r.traced("gd fresh cached", r.me(&["gd", &big_s]));
    // tmpfs.
    let shm_file = shm.join("one-tensor.safetensors");
    let tmpfs_ok = std::fs::create_dir_all(&shm).is_ok() && std::fs::copy(&big, &shm_file).is_ok();
    if tmpfs_ok {
        let s = shm_file.to_string_lossy().to_string();
        for _ in 0..runs {
            let v = r.run("gd fresh tmpfs", r.me(&["gd", &s]));
            rows.entry("gd fresh tmpfs".into()).or_default().extend(v);
            for p in &peers_tmpfs {
                let name = format!("{p} tmpfs");
                let v = r.run(&name, r.peer(p, &shm_file));
                rows.entry(name).or_default().extend(v);
            }
        }
        let _ = std::fs::remove_dir_all(&shm);
    } else {
        r.note(
            "tmpfs",
            &format!("could not copy the file to {}", shm.display()),
        );
    }
    // Cold.
    let can_drop = drop_caches();
    let mut raw_best: Option<(String, Vec<f64>)> = None;
    if can_drop {
        let mut best = (String::new(), 0.0, 0usize, 0usize);
        for (t, b) in [
            (1usize, 4usize << 20),
            (4, 4 << 20),
            (16, 4 << 20),
            (32, 4 << 20),
            (64, 1 << 20),
        ] {
            drop_caches();
            let name = format!("raw O_DIRECT t{t} b{}M", b >> 20);
            if let Some(v) = r.run(
                &name,
                r.me(&["raw", &big_s, &t.to_string(), &b.to_string()]),
            ) {
                let g = v["gbps"].as_f64().unwrap_or(0.0);
                if g > best.1 {
                    best = (name, g, t, b);
                }
            }
        }
        if best.2 > 0 {
            let mut v = vec![best.1];
            for _ in 1..runs {
                drop_caches();
                if let Some(x) = r.run(
                    &best.0,
                    r.me(&["raw", &big_s, &best.2.to_string(), &best.3.to_string()]),
                ) {
                    v.extend(x["gbps"].as_f64());
                }
            }
            raw_best = Some((best.0, v));
        }
        for _ in 0..runs {
            drop_caches();
            let v = r.run("gd fresh cold", r.me(&["gd", &big_s]));
            rows.entry("gd fresh cold".into()).or_default().extend(v);
        }
    } else {
        r.note(
            "cold",
            "drop_caches not permitted (run as root): no cold rows",
        );
    }
    // Many small files.
    for _ in 0..runs {
        let v = r.run("gd fresh 10k files", r.me(&["batch", &small_s, &n_s, &f_s]));
        rows.entry("gd fresh 10k files".into())
            .or_default()
            .extend(v);
        for t in ["8", "16"] {
            let name = format!("std {t} threads + htod");
            let v = r.run(&name, r.me(&["stdthreads", &small_s, &n_s, &f_s, t]));
            rows.entry(name).or_default().extend(v);
        }
    }
    r.traced("gd fresh 10k files", r.me(&["batch", &small_s, &n_s, &f_s]));
    // Latency.
    warm_cache(&big)?;
    let lat = r.run("4 KiB random reads", r.me(&["rand4k", &big_s, "4000"]));

    // ---- the table ----
    let med = |rows: &BTreeMap<String, Vec<Value>>, k: &str, f: &str| {
        rows.get(k).and_then(|v| median(&field(v, f)))
    };
    let h2d_g = median(&field(&h2d, "gbps"));
    let best_peer = |rows: &BTreeMap<String, Vec<Value>>, suffix: &str| -> Option<(String, f64)> {
        rows.iter()
            .filter(|(k, _)| k.ends_with(suffix) && !k.starts_with("gd "))
            .filter_map(|(k, v)| Some((k.clone(), median(&field(v, "gbps"))?)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    };
    let gib = format!("{:.2} GiB", total as f64 / (1u64 << 30) as f64);
    let fmt = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "—".into());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "—".into(),
    };
    let mut checks: Vec<(String, Option<bool>)> = Vec::new();
    let mut check = |what: String, got: Option<f64>, want: f64, higher: bool| {
        let ok = got.map(|g| if higher { g >= want } else { g <= want });
        checks.push((
            format!(
                "{what}: {} (target {} {want})",
                fmt(got),
                if higher { "≥" } else { "≤" }
            ),
            ok,
        ));
    };
    println!("\n## storage one-shot ({} bytes file, {nfiles} x {fsize} files, {runs} fresh processes per row, medians)\n", total);
    println!("| row | gpudirect first call GB/s | same process, second call GB/s | baseline | baseline GB/s | ratio |");
    println!("|---|---:|---:|---|---:|---:|");
    for (cond, suffix) in [("cached", " cached"), ("tmpfs", " tmpfs")] {
        let gd = med(&rows, &format!("gd fresh {cond}"), "gbps");
        let warm = med(&rows, &format!("gd fresh {cond}"), "warm_gbps");
        println!(
            "| fresh {gib} {cond} → GPU | {} | {} | pinned H2D limit | {} | {} |",
            fmt(gd),
            fmt(warm),
            fmt(h2d_g),
            ratio(gd, h2d_g)
        );
        check(
            format!("{cond}: first call / pinned H2D"),
            gd.zip(h2d_g).map(|(a, b)| a / b),
            0.9,
            true,
        );
        for (k, v) in rows
            .iter()
            .filter(|(k, _)| k.ends_with(suffix) && !k.starts_with("gd "))
        {
            let p = median(&field(v, "gbps"));
            println!("| | | | {k} | {} | {} |", fmt(p), ratio(gd, p));
        }
        if let Some((pk, pv)) = best_peer(&rows, suffix) {
            check(
                format!("{cond}: first call / best peer ({pk})"),
                gd.map(|g| g / pv),
                1.4,
                true,
            );
        }
    }
    let cold = med(&rows, "gd fresh cold", "gbps");
    let raw = raw_best.as_ref().and_then(|(_, v)| median(v));
    println!(
        "| fresh {gib} cold → GPU | {} | — | best raw O_DIRECT read ({}) | {} | {} |",
        fmt(cold),
        raw_best.as_ref().map(|b| b.0.as_str()).unwrap_or("—"),
        fmt(raw),
        ratio(cold, raw)
    );
    check(
        "cold: first call / best raw O_DIRECT read".into(),
        cold.zip(raw).map(|(a, b)| a / b),
        0.95,
        true,
    );
    let b = med(&rows, "gd fresh 10k files", "gbps");
    let bw = med(&rows, "gd fresh 10k files", "warm_gbps");
    let bf = med(&rows, "gd fresh 10k files", "files_per_s");
    let base = ["std 8 threads + htod", "std 16 threads + htod"]
        .iter()
        .filter_map(|k| {
            Some((
                k.to_string(),
                med(&rows, k, "gbps")?,
                med(&rows, k, "files_per_s")?,
            ))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1));
    println!(
        "| fresh {nfiles} × {} KiB files → one buffer | {} ({} files/s) | {} | {} | {} ({} files/s) | {} |",
        fsize >> 10,
        fmt(b),
        fmt(bf).replace(".00", ""),
        fmt(bw),
        base.as_ref().map(|x| x.0.as_str()).unwrap_or("std threads + htod"),
        fmt(base.as_ref().map(|x| x.1)),
        fmt(base.as_ref().map(|x| x.2)),
        ratio(b, base.as_ref().map(|x| x.1))
    );
    check(
        "10k files: first call / std threads + htod".into(),
        b.zip(base.as_ref().map(|x| x.1)).map(|(a, c)| a / c),
        3.0,
        true,
    );
    let (lo, lb) = (
        lat.as_ref().and_then(|v| v["ours_median_us"].as_f64()),
        lat.as_ref().and_then(|v| v["base_median_us"].as_f64()),
    );
    println!(
        "| 4 KiB random read latency, µs (median; p99 {} vs {}) | {} | — | pread + pinned cuMemcpyHtoD | {} | {} |",
        fmt(lat.as_ref().and_then(|v| v["ours_p99_us"].as_f64())),
        fmt(lat.as_ref().and_then(|v| v["base_p99_us"].as_f64())),
        fmt(lo),
        fmt(lb),
        ratio(lo, lb)
    );
    check(
        "4 KiB latency: ours / pread + pinned H2D".into(),
        lo.zip(lb).map(|(a, b)| a / b),
        1.0,
        false,
    );
    if let Some(p) = rows.get("gd parts cached") {
        println!(
            "\nfirst-call parts (fresh process, medians): open {} ms, {gib} pool allocation (cudarc stream.alloc) {} ms, first read {} GB/s, second read {} GB/s",
            fmt(median(&field(p, "open_ms"))),
            fmt(median(&field(p, "alloc_ms"))),
            fmt(median(&field(p, "first_read_gbps"))),
            fmt(median(&field(p, "second_read_gbps")))
        );
    }
    if let Some(v) = rows.get("gd fresh cached").and_then(|v| v.first()) {
        println!("path: {}", v["path"].as_str().unwrap_or("?"));
    }
    println!();
    for (what, ok) in &checks {
        println!(
            "{} {what}",
            match ok {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "N/A ",
            }
        );
    }
    println!(
        "(GB/s = 1e9 bytes/s; elapsed {:.0} s)\n",
        r.t0.elapsed().as_secs_f64()
    );
    for (row, lines) in &r.traces {
        println!("## timing trace: {row} (GPUDIRECT_TRACE=timing; the first call, then the same process's second)\n");
        println!("```");
        for l in lines {
            println!("{l}");
        }
        if lines.is_empty() {
            println!("(no trace lines)");
        }
        println!("```\n");
    }
    for s in &r.samples {
        println!("{s}");
    }
    if !keep {
        let _ = std::fs::remove_file(&big);
        let _ = std::fs::remove_dir_all(&small);
    }
    Ok(())
}

/// `--oneshot`: the parent (the table); `--child MODE ...`: one measurement.
pub fn main(args: &[String]) -> Res<()> {
    let args: Vec<String> = args.iter().filter(|a| *a != "--oneshot").cloned().collect();
    if args.first().map(String::as_str) == Some("--child") {
        if let Err(e) = child(&args[1..]) {
            emit(json!({"error": e.to_string()}));
            std::process::exit(1);
        }
        return Ok(());
    }
    parent()
}

//! Reads a file into GPU memory in three lines and prints the path the bytes took
//! (GPUDirect Storage by DMA, cuFile's compat path, or gpudirect's parallel engine, with why).
//!
//! Needs a CUDA GPU (without one it reads the file into host memory through the same engine
//! and says so). With no argument it reads a 256 MiB random file it writes under
//! `GPUDIRECT_TEST_DIR` (default: the temp dir), and checks every byte.
//!
//!     cargo run --release --example read-file-to-gpu [-- PATH]

use std::io::Read;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "\
usage: read-file-to-gpu [PATH]

Reads PATH into GPU 0 and prints the path the bytes took (GPUDirect Storage, cuFile's compat
path or gpudirect's POSIX engine, with why), then checks every byte. Without PATH it writes a
256 MiB random file under GPUDIRECT_TEST_DIR (default: the temp dir) and removes it afterwards.
Without a GPU it reads into host memory through the same engine and says so.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if let Some(bad) = args.iter().find(|a| a.starts_with('-')).or(args.get(1)) {
        eprintln!("read-file-to-gpu: unexpected argument {bad}\n\n{USAGE}");
        return ExitCode::from(64);
    }
    let path = args.into_iter().next().map(std::path::PathBuf::from);
    match run(path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("read-file-to-gpu: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: Option<std::path::PathBuf>) -> gpudirect::Result<()> {
    let (path, made) = match path {
        Some(p) => (p, false),
        None => (make_sample()?, true),
    };
    match gpudirect::cuda::context(0) {
        Ok(ctx) => {
            // The three lines:
            let stream = ctx.default_stream();
            let t0 = Instant::now();
            let (buf, report) = gpudirect::storage::read_to_gpu::<u8>(&path, &stream)?;
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "read {} ({} bytes) into GPU 0 in {:.1} ms ({:.2} GB/s) -- first call: includes \
                 one-time setup (cuFile probe, IO threads, pinning staging memory) and the \
                 device allocation",
                path.display(),
                report.bytes,
                secs * 1e3,
                report.bytes as f64 / secs / 1e9
            );
            println!("path: {}", report.path);
            if report.odirect {
                println!("O_DIRECT: yes (the file was not in the page cache)");
            }
            // Steady state: the file open and the engine warmed up, then one timed read into
            // the same buffer (what a loader pays per file once the process is running).
            let mut buf = buf;
            let f = gpudirect::storage::GpuFile::open(&path)?;
            f.warm_up(0)?;
            let t1 = Instant::now();
            let r2 = f.read_to_device(&mut buf, 0)?;
            let s2 = t1.elapsed().as_secs_f64();
            println!(
                "again, steady state (file open, engine warm): {:.1} ms ({:.2} GB/s{})",
                s2 * 1e3,
                r2.bytes as f64 / s2 / 1e9,
                if r2.odirect {
                    ", O_DIRECT"
                } else {
                    ", page cache"
                }
            );
            let back = stream.clone_dtoh(&buf)?; // cudarc errors convert with `?`
            let disk = read_all(&path)?;
            println!(
                "verified: {}",
                if back == disk {
                    "every byte matches the file"
                } else {
                    "MISMATCH"
                }
            );
            if back != disk {
                std::process::exit(1);
            }
        }
        Err(e) => {
            println!("no CUDA GPU here ({e})");
            println!("reading into host memory through the same engine instead:");
            let f = gpudirect::storage::GpuFile::open(&path)?;
            let mut host = vec![0u8; f.len()? as usize];
            let r = f.pread_host(&mut host, 0)?;
            println!("{r}");
            println!(
                "verified: {}",
                if host == read_all(&path)? {
                    "every byte matches the file"
                } else {
                    "MISMATCH"
                }
            );
        }
    }
    if made {
        let _ = std::fs::remove_file(&path);
    }
    Ok(())
}

fn read_all(p: &std::path::Path) -> gpudirect::Result<Vec<u8>> {
    let mut v = Vec::new();
    std::fs::File::open(p)
        .and_then(|mut f| f.read_to_end(&mut v))
        .map_err(|source| gpudirect::Error::Io {
            op: "read",
            path: Some(p.to_path_buf()),
            source,
        })?;
    Ok(v)
}

fn make_sample() -> gpudirect::Result<std::path::PathBuf> {
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let p = dir.join(format!("gpudirect-example-{}.bin", std::process::id()));
    let mut data = vec![0u8; (256 << 20) + 4097];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for c in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    std::fs::write(&p, &data).map_err(|source| gpudirect::Error::Io {
        op: "write",
        path: Some(p.clone()),
        source,
    })?;
    Ok(p)
}

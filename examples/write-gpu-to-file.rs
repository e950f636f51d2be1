//! Writes GPU memory to a file (durably: fsync before returning) and prints the path the bytes
//! took, then checks the file byte for byte.
//!
//! Needs a CUDA GPU (without one it says so and exits cleanly). Writes 256 MiB + 1 byte of
//! random data to PATH (default: a file under `GPUDIRECT_TEST_DIR`, removed afterwards).
//!
//!     cargo run --release --example write-gpu-to-file [-- PATH]

use std::process::ExitCode;
use std::time::Instant;

use gpudirect::storage::GpuFile;

const USAGE: &str = "\
usage: write-gpu-to-file [PATH]

Writes 256 MiB + 1 byte of random data from GPU 0 to PATH durably (fsync before returning),
prints the path the bytes took and checks the file byte for byte. Without PATH it writes a
file under GPUDIRECT_TEST_DIR (default: the temp dir) and removes it afterwards. Without a GPU
it says so and exits 0.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if let Some(bad) = args.iter().find(|a| a.starts_with('-')).or(args.get(1)) {
        eprintln!("write-gpu-to-file: unexpected argument {bad}\n\n{USAGE}");
        return ExitCode::from(64);
    }
    let arg = args.into_iter().next();
    match run(arg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("write-gpu-to-file: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(arg: Option<String>) -> gpudirect::Result<()> {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("no CUDA GPU here ({e}): nothing to write from; run this on a GPU machine");
            return Ok(());
        }
    };
    let path = arg
        .clone()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(std::env::temp_dir);
            dir.join(format!(
                "gpudirect-example-write-{}.bin",
                std::process::id()
            ))
        });
    let mut host = vec![0u8; (256 << 20) + 1];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for c in host.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    let stream = ctx.default_stream();
    let dev = stream.clone_htod(&host)?; // cudarc errors convert with `?`

    let file = GpuFile::options()
        .create(true)
        .truncate(true)
        .durable(true)
        .open(&path)?;
    let t0 = Instant::now();
    let report = file.write_from_device(&dev, 0)?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "wrote {} bytes from GPU 0 to {} in {:.1} ms ({:.2} GB/s, fsync included)",
        report.bytes,
        path.display(),
        secs * 1e3,
        report.bytes as f64 / secs / 1e9
    );
    println!("path: {}", report.path);
    println!("O_DIRECT: {}", if report.odirect { "yes" } else { "no" });
    let disk = std::fs::read(&path).map_err(|source| gpudirect::Error::Io {
        op: "read",
        path: Some(path.clone()),
        source,
    })?;
    let ok = disk == host;
    println!(
        "verified: {}",
        if ok { "every byte matches" } else { "MISMATCH" }
    );
    if arg.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

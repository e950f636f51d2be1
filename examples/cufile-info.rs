//! cufile-info: what libcufile is loaded, its driver properties, and whether a file registers.
//!
//! Shows: the library gpudirect loads (path, `cuFileGetVersion`, symbols it lacks), the driver's
//! properties (nvidia-fs version, supported filesystems, controls, features, limits), and the
//! registration of a scratch file in `GPUDIRECT_TEST_DIR` (default: the temp dir): the path its
//! IO would take, or the classified cause of the refusal (e.g. udev data missing in containers).
//!
//! Needs: nothing. Without libcufile, libcuda or a GPU it prints why and exits 0
//! (set `GPUDIRECT_CUFILE_LIB` to point at a libcufile.so.0).
//!
//! ```text
//! cargo run --release --example cufile-info
//! ```

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use gpudirect::ffi::cufile as sys;
use gpudirect::storage::cufile::{
    classify_registration_failure, filesystem_type, library_version, CuFileHandle, Driver, OpenMode,
};

const USAGE: &str = "\
usage: cufile-info

Prints the libcufile gpudirect loads (path, cuFileGetVersion, symbols it lacks), the cuFile
driver's properties, and whether a scratch file in GPUDIRECT_TEST_DIR (default: the temp dir)
registers with cuFile (the path its IO would take, or why not). GPUDIRECT_CUFILE_LIB names the
library. Without libcufile, libcuda or a GPU it prints why and exits 0.";

fn main() -> std::process::ExitCode {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("cufile-info: unexpected argument {other}\n\n{USAGE}");
            return std::process::ExitCode::from(64);
        }
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cufile-info: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    match sys::library() {
        Ok(lib) => {
            println!("libcufile: {}", lib.path().display());
            let missing = lib.missing_symbols();
            if !missing.is_empty() {
                println!("  lacks (newer releases): {}", missing.join(", "));
            }
        }
        Err(e) => {
            println!("libcufile: not loaded: {e}");
            return Ok(());
        }
    }
    let v = library_version()?;
    println!(
        "cuFileGetVersion: {v} (cuFile {}.{})",
        v / 1000,
        v % 1000 / 10
    );

    if let Err(e) = gpudirect::cuda::device_count() {
        println!("driver: not opened, because CUDA is not usable here: {e}");
        println!("        (gpudirect never calls cuFileDriverOpen without libcuda and a GPU)");
        return Ok(());
    }
    let driver = match Driver::open() {
        Ok(d) => d,
        Err(e) => {
            println!("driver: cuFileDriverOpen failed: {e}");
            return Ok(());
        }
    };
    let p = driver.properties();
    println!(
        "driver: open (use count {})",
        driver.use_count().unwrap_or(-1)
    );
    match p.nvfs_version() {
        Some((major, minor)) => println!("  nvidia-fs: {major}.{minor}"),
        None => println!("  nvidia-fs: not loaded (IO uses cuFile's compatibility mode)"),
    }
    println!("  PCI P2PDMA enabled: {}", driver.p2pdma_enabled());
    println!("  supported storage (dstatusflags): {:?}", p.fs_support());
    println!("  controls (dcontrolflags): {:?}", p.control());
    println!("  features (fflags): {:?}", p.features());
    println!("  poll threshold: {} KiB", p.poll_threshold_kb());
    println!("  max direct IO size: {} KiB", p.max_direct_io_kb());
    println!("  max device cache: {} KiB", p.max_device_cache_kb());
    println!("  per-buffer cache: {} KiB", p.per_buffer_cache_kb());
    println!("  max pinned memory: {} KiB", p.max_device_pinned_mem_kb());
    println!(
        "  batch IO: up to {} ops, timeout {} ms",
        p.max_batch_io_size(),
        p.max_batch_io_timeout_ms()
    );
    if let Ok(kb) = driver.bar_size_kb(0) {
        println!("  GPU 0 BAR1: {} MiB", kb / 1024);
    }
    if let Some(log) = driver.log_file() {
        println!("  cuFile log: {}", log.display());
    }

    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let file = dir.join(format!("gpudirect-cufile-info-{}", std::process::id()));
    if let Err(e) = std::fs::write(&file, vec![0x5au8; 4096]) {
        println!("registration check: cannot create {}: {e}", file.display());
        return Ok(());
    }
    let dev = std::fs::metadata(&file)?.dev();
    println!(
        "file {} on {} (device {}:{})",
        file.display(),
        filesystem_type(&file).unwrap_or_else(|| "unknown".into()),
        libc::major(dev),
        libc::minor(dev)
    );
    match CuFileHandle::open(driver, &file, OpenMode::Read) {
        Ok(h) => println!(
            "  registers (O_DIRECT {}): IO takes {}",
            h.is_o_direct(),
            h.path_report()
        ),
        Err(e) => println!(
            "  registration refused: {e}\n  cause: {}",
            classify_registration_failure(&e, &file)
        ),
    }
    let _ = std::fs::remove_file(&file);
    Ok(())
}

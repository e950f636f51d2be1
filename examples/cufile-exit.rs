//! cufile-exit: does a process that used cuFile exit cleanly? One strategy per run.
//!
//! Shows: gpudirect's exit strategies for cuFile ([`ExitStrategy`]) side by side. The program
//! does what the test binaries did when they crashed at exit — take GPU 0's context, open the
//! cuFile driver, optionally turn on statistics, register a file and move bytes (sync, with a
//! registered buffer, stream-ordered), then drop its context — and returns from `main`. The exit
//! status tells the story: 0 is a clean exit, 139 (128 + SIGSEGV) the crash.
//!
//! `GPUDIRECT_CUFILE_EXIT_STRATEGY` picks the strategy (default: the library's default,
//! `retain-ctx`):
//! - `none`: the behaviour before the fix (no context is retained, the driver is never closed);
//! - `retain-ctx`: the driver keeps every context cuFile used alive until exit;
//! - `close-at-exit`: `retain-ctx` plus `cuFileDriverClose_v2` from an `atexit` handler;
//! - `close-in-main` (this example): `none`, but the program deregisters everything and calls
//!   `cuFileDriverClose_v2` itself before dropping its context;
//! - `leak-all` (this example): `retain-ctx`, and every handle, buffer, stream and context is
//!   leaked (`mem::forget`).
//!
//! `GPUDIRECT_CUFILE_EXIT_WORKLOAD` picks what runs: `open` (driver only), `stats` (driver and
//! level-3 statistics), `io` (the default: registration and IO where the machine allows it),
//! `thread` (`io` on a spawned thread, joined before `main` returns, as test harnesses do).
//!
//! Needs: a CUDA GPU and libcufile (`GPUDIRECT_CUFILE_LIB`); scratch files go under
//! `GPUDIRECT_TEST_DIR` (default: the temp dir). Without them it prints why and exits 0.
//! `scripts/cufile-exit-matrix` runs every strategy and workload and prints a table.
//!
//! ```text
//! GPUDIRECT_CUFILE_EXIT_STRATEGY=none cargo run --release --example cufile-exit; echo rc=$?
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use gpudirect::ffi::cufile as sys;
use gpudirect::storage::cufile::{
    classify_registration_failure, CuFileHandle, Driver, ExitStrategy, OpenMode, RegisteredBuffer,
    Stats, EXIT_STRATEGY_ENV,
};
use rand::RngCore;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Strategy {
    Library(ExitStrategy),
    CloseInMain,
    LeakAll,
}

fn strategy() -> Res<(String, Strategy)> {
    let name = std::env::var(EXIT_STRATEGY_ENV).unwrap_or_else(|_| "default".into());
    let s = match name.as_str() {
        "close-in-main" => Strategy::CloseInMain,
        "leak-all" => Strategy::LeakAll,
        other => Strategy::Library(other.parse::<ExitStrategy>().map_err(|_| {
            format!(
                "{EXIT_STRATEGY_ENV}={other:?}: use none, retain-ctx, close-at-exit, \
                 close-in-main or leak-all"
            )
        })?),
    };
    Ok((name, s))
}

fn random(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}

const USAGE: &str = "\
usage: cufile-exit

Does a process that used cuFile exit cleanly? Opens the cuFile driver on GPU 0, registers a file
and moves bytes, then returns from main: exit status 0 is a clean exit, 139 the crash.
GPUDIRECT_CUFILE_EXIT_STRATEGY: none, retain-ctx (default), close-at-exit, close-in-main or
leak-all. GPUDIRECT_CUFILE_EXIT_WORKLOAD: open, stats, io (default) or thread. Needs a CUDA GPU
and libcufile (GPUDIRECT_CUFILE_LIB); without them it prints why and exits 0.";

fn main() -> std::process::ExitCode {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("cufile-exit: unexpected argument {other}\n\n{USAGE}");
            return std::process::ExitCode::from(64);
        }
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cufile-exit: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let (name, strategy) = strategy()?;
    let workload = std::env::var("GPUDIRECT_CUFILE_EXIT_WORKLOAD").unwrap_or_else(|_| "io".into());
    if !matches!(workload.as_str(), "open" | "stats" | "io" | "thread") {
        return Err(format!(
            "GPUDIRECT_CUFILE_EXIT_WORKLOAD={workload:?}: use open, stats, io or thread"
        )
        .into());
    }
    if let Err(e) = sys::library() {
        println!("cufile-exit: libcufile not loaded ({e}); nothing to test");
        return Ok(());
    }
    if let Err(e) = gpudirect::cuda::device_count() {
        println!("cufile-exit: no usable CUDA GPU ({e}); nothing to test");
        return Ok(());
    }
    // The library-level strategy for this run (the examples' own strategies build on one).
    let library = match strategy {
        Strategy::Library(s) => s,
        Strategy::CloseInMain => ExitStrategy::Nothing,
        Strategy::LeakAll => ExitStrategy::RetainContexts,
    };
    let w = workload.clone();
    if workload == "thread" {
        std::thread::spawn(move || work(&w, strategy, library).map_err(|e| e.to_string()))
            .join()
            .map_err(|_| "the worker thread panicked")??;
    } else {
        work(&w, strategy, library)?;
    }
    println!("cufile-exit: strategy {name}, workload {workload}: main returns now");
    Ok(())
}

fn work(workload: &str, strategy: Strategy, library: ExitStrategy) -> Res<()> {
    let ctx = gpudirect::cuda::context(0)?;
    let stream = ctx.new_stream()?;
    let driver = match Driver::builder().exit_strategy(library).open() {
        Ok(d) => d,
        Err(e) => {
            println!("cufile-exit: cuFileDriverOpen failed: {e}");
            return Ok(());
        }
    };
    println!(
        "driver open (cuFile {}, nvidia-fs {}, exit strategy {:?})",
        driver.version(),
        if driver.nvfs_loaded() {
            "loaded"
        } else {
            "not loaded"
        },
        driver.exit_strategy()
    );
    let mut leaks: Vec<Box<dyn std::any::Any>> = Vec::new();
    if workload == "stats" {
        match Stats::start(Arc::clone(&driver), 3) {
            Ok(s) => println!("statistics on: {:?}", s.snapshot().map(|s| s.l1.read_ops)),
            Err(e) => println!("statistics refused: {e}"),
        }
    }
    if workload == "io" || workload == "thread" {
        let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("gpudirect-cufile-exit-{}", std::process::id()));
        let content = random((1 << 20) + 17);
        std::fs::write(&path, &content)?;
        match CuFileHandle::open(Arc::clone(&driver), &path, OpenMode::ReadWrite) {
            Ok(h) => {
                println!("registered: {}", h.path_report());
                let mut buf = stream.clone_htod(&random(content.len()))?;
                let n = h.read(&mut buf, 0)?;
                let ok = n == content.len() && stream.clone_dtoh(&buf)? == content;
                println!("cuFileRead: {n} bytes, bytes match: {ok}");
                let n = h.write(&buf.slice(7..4103), 4096)?;
                println!("cuFileWrite: {n} bytes");
                match RegisteredBuffer::alloc(Arc::clone(&driver), &stream, 1 << 20) {
                    Ok(mut reg) => {
                        let n = h.read(&mut reg.as_view_mut(), 0)?;
                        println!("read into a registered buffer: {n} bytes");
                        if strategy == Strategy::LeakAll {
                            leaks.push(Box::new(reg));
                        }
                    }
                    Err(e) => println!("cuFileBufRegister refused: {e}"),
                }
                let abuf = stream.clone_htod(&random(1 << 16))?;
                match h
                    .read_async(abuf, 0, 1 << 16, 4096)
                    .map_err(gpudirect::Error::from)
                    .and_then(|io| io.wait().map_err(gpudirect::Error::from))
                {
                    Ok((n, b)) => {
                        println!("cuFileReadAsync: {n} bytes");
                        if strategy == Strategy::LeakAll {
                            leaks.push(Box::new(b));
                        }
                    }
                    Err(e) => println!("cuFileReadAsync refused: {e}"),
                }
                if strategy == Strategy::LeakAll {
                    leaks.push(Box::new(h));
                }
            }
            Err(e) => println!(
                "registration refused: {e} (cause: {})",
                classify_registration_failure(&e, &path)
            ),
        }
        std::fs::remove_file(&path)?;
    }
    if strategy == Strategy::CloseInMain {
        // Every handle and buffer above is dropped (deregistered) by now; the context is alive.
        let lib = sys::library()?;
        match lib.cuFileDriverClose_v2 {
            Some(close) => {
                // SAFETY: this process opened the driver; nothing registered remains and no IO is
                // in flight; CUDA is fully alive (the context is still held).
                let st = unsafe { close() };
                println!("cuFileDriverClose_v2: status {}", st.err);
            }
            None => println!("cuFileDriverClose_v2 missing from this libcufile"),
        }
    }
    println!("retained contexts: {}", driver.retained_contexts());
    if strategy == Strategy::LeakAll {
        leaks.push(Box::new(driver));
        std::mem::forget(leaks);
        std::mem::forget(stream);
        std::mem::forget(ctx);
    } else {
        drop(leaks);
        drop(stream);
        drop(ctx); // the last reference of this program: cudarc releases the primary context
    }
    Ok(())
}

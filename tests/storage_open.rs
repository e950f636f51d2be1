//! Issue 10 item 1: `GpuFile::open` decides the path from cheap facts (filesystem, udev record,
//! nvidia-fs / P2PDMA) and never pays for `cuFileDriverOpen` (~0.5 s on the H200 machine) when
//! they rule DMA out; the report still names the cause.
//!
//! One test per binary on purpose: it checks that this process never opened cuFile's driver.
//! Runs everywhere (CI and the GPU machine, where the old code opened the driver).

use std::time::{Duration, Instant};

use gpudirect::storage::{CompatMode, GpuFile};
use gpudirect::{Cause, TransferPath};

#[test]
fn auto_open_decides_from_cheap_facts_without_opening_the_cufile_driver() {
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("gpudirect-open-{}.bin", std::process::id()));
    std::fs::write(&p, [7u8; 4096]).unwrap();
    let dma_host = std::path::Path::new("/proc/driver/nvidia-fs").exists();

    let t0 = Instant::now();
    let f = GpuFile::options()
        .compat_mode(CompatMode::Auto)
        .open(&p)
        .unwrap();
    let first = t0.elapsed();
    let mut times: Vec<Duration> = (0..31)
        .map(|_| {
            let t = Instant::now();
            let g = GpuFile::options()
                .compat_mode(CompatMode::Auto)
                .open(&p)
                .unwrap();
            let e = t.elapsed();
            assert_eq!(g.path_report(), f.path_report());
            e
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];
    eprintln!(
        "first open {first:?}, median of 31 {median:?}: {}",
        f.path_report()
    );
    if dma_host {
        // nvidia-fs is loaded: the facts allow DMA, so cuFile decides (and may be paid for).
        eprintln!("this host has nvidia-fs: the probe ran; only the report is checked");
        assert!(f.path_report().is_direct() || f.path_report().cause.is_some());
    } else {
        assert_eq!(f.path_report().path, TransferPath::Posix);
        assert!(
            matches!(
                f.path_report().cause,
                Some(
                    Cause::FilesystemUnsupported { .. }
                        | Cause::UdevDataMissing { .. }
                        | Cause::NoNvidiaFs
                )
            ),
            "the cause must come from the cheap facts, got {}",
            f.path_report()
        );
        assert!(
            gpudirect::storage::cufile::Driver::get().is_none(),
            "GpuFile::open opened cuFile's driver although nvidia-fs is absent"
        );
        assert!(
            first < Duration::from_millis(50),
            "first open took {first:?}"
        );
        assert!(
            median < Duration::from_millis(2),
            "open on a cached verdict took {median:?}"
        );
    }
    std::fs::remove_file(&p).unwrap();
}

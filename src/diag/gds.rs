//! The doctor's GDS section: libcufile, nvidia-fs, cuFile's configuration, whether a file in a
//! directory registers with cuFile (and why not), and a short measured read through the path
//! gpudirect would choose.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{Report, Section, Status};
use crate::storage::cufile::{self, CuFileHandle, Driver, OpenMode};
use crate::storage::GpuFile;
use crate::{Cause, Error};

/// Size of the file the doctor writes and reads back in `dir`.
const PROBE_BYTES: usize = 64 << 20;

/// A scratch file removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn nvidia_fs_module() -> Option<String> {
    std::fs::read_to_string("/proc/driver/nvidia-fs/version")
        .ok()
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
}

fn cufile_json() -> String {
    match cufile::config_file() {
        Some(c) if c.from_env => format!("{} (CUFILE_ENV_PATH_JSON)", c.path.display()),
        Some(c) => c.path.display().to_string(),
        None => "none found (cuFile defaults)".into(),
    }
}

impl Report {
    /// Checks GPUDirect Storage: the library, the kernel driver, registration of a file in
    /// `dir`, and (unless `quick`) a short measured read into GPU `device` through the path
    /// [`GpuFile`] chooses. Needs a GPU for everything past the library check.
    pub fn check_gds(&mut self, dir: &Path, device: Option<usize>, quick: bool) {
        match cufile::library_version() {
            Ok(v) => self.push(
                Section::Gds,
                "libcufile",
                Status::Ok,
                format!("version {}.{} ({v})", v / 1000, v % 1000 / 10),
                None,
            ),
            Err(e) => {
                self.push_error(Section::Gds, "libcufile", &e);
                if device.is_none() {
                    return;
                }
                self.push(
                    Section::Gds,
                    "file IO to GPU",
                    Status::Fallback,
                    "every read and write uses gpudirect's POSIX engine (staged through pinned host memory)",
                    Some(Cause::CuFileUnavailable { reason: "libcufile is not loadable".into() }.fix()),
                );
                return;
            }
        }
        match nvidia_fs_module() {
            Some(v) => self.push(Section::Gds, "nvidia-fs", Status::Ok, format!("loaded: {v}"), None),
            None => self.push(
                Section::Gds,
                "nvidia-fs",
                Status::Absent,
                "not loaded (/proc/driver/nvidia-fs/version missing): cuFile can only use its compatibility mode unless the kernel offers PCI P2PDMA",
                Some(Cause::NoNvidiaFs.fix()),
            ),
        }
        self.push(
            Section::Gds,
            "cuFile configuration",
            Status::Ok,
            cufile_json(),
            None,
        );
        let Some(device) = device else {
            self.push(
                Section::Gds,
                "cuFile driver",
                Status::Absent,
                "not opened: no CUDA GPU (cuFileDriverOpen needs one)",
                None,
            );
            return;
        };
        let driver = match Driver::open() {
            Ok(d) => d,
            Err(e) => {
                self.push_error(Section::Gds, "cuFile driver", &e);
                return;
            }
        };
        let p = driver.properties();
        self.push(
            Section::Gds,
            "cuFile driver",
            Status::Ok,
            format!(
                "open; nvfs {}; compat mode {}; P2PDMA {}; max direct IO {} KiB; log {}",
                p.nvfs_version()
                    .map(|(a, b)| format!("{a}.{b}"))
                    .unwrap_or_else(|| "absent".into()),
                if p.compat_mode_allowed() {
                    "allowed"
                } else {
                    "not allowed"
                },
                if driver.p2pdma_enabled() { "on" } else { "off" },
                p.max_direct_io_kb(),
                driver
                    .log_file()
                    .map(|l| l.display().to_string())
                    .unwrap_or_else(|| "default".into()),
            ),
            None,
        );

        let scratch = Scratch(dir.join(format!(".gpudirect-doctor-{}.bin", std::process::id())));
        if let Err(e) = write_probe_file(&scratch.0) {
            self.push_error(
                Section::Gds,
                format!("scratch file in {}", dir.display()),
                &e,
            );
            return;
        }
        let fs = cufile::filesystem_type(&scratch.0).unwrap_or_else(|| "unknown".into());
        let subject = format!("cuFile registration in {} ({fs})", dir.display());
        match CuFileHandle::open(driver.clone(), &scratch.0, OpenMode::Read) {
            Ok(h) => {
                let r = h.path_report();
                let status = if r.is_direct() {
                    Status::Direct
                } else {
                    Status::Fallback
                };
                self.push(
                    Section::Gds,
                    subject,
                    status,
                    format!(
                        "registers; IO takes {}{}",
                        r.path,
                        r.cause
                            .as_ref()
                            .map(|c| format!(" because {}", c.what()))
                            .unwrap_or_default()
                    ),
                    r.cause.as_ref().map(Cause::fix),
                );
            }
            Err(e) => {
                let cause = cufile::classify_registration_failure(&e, &scratch.0);
                self.push(
                    Section::Gds,
                    subject,
                    Status::Fallback,
                    format!("cuFileHandleRegister fails: {}", cause.what()),
                    Some(cause.fix()),
                );
            }
        }
        if quick {
            return;
        }
        match measured_read(&scratch.0, device) {
            Ok((report, gbps)) => {
                let status = if report.path.is_direct() {
                    Status::Direct
                } else {
                    Status::Fallback
                };
                self.push(
                    Section::Gds,
                    format!("read {} MiB into GPU{device}", PROBE_BYTES >> 20),
                    status,
                    format!(
                        "{gbps:.1} GB/s (page-cached) via {}{}",
                        report.path.path,
                        report
                            .path
                            .cause
                            .as_ref()
                            .map(|c| format!(" because {}", c.what()))
                            .unwrap_or_default()
                    ),
                    report.path.cause.as_ref().map(Cause::fix),
                );
            }
            Err(e) => self.push_error(Section::Gds, "measured read", &e),
        }
    }
}

fn write_probe_file(path: &Path) -> Result<(), Error> {
    // A cheap non-constant pattern (xorshift), so a wrong read cannot pass by accident.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut data = vec![0u8; PROBE_BYTES];
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(path, &data).map_err(|e| Error::io("write", Some(path.to_path_buf()), e))
}

fn measured_read(path: &Path, device: usize) -> Result<(crate::storage::IoReport, f64), Error> {
    let stream = crate::cuda::context(device)?.default_stream();
    let f = GpuFile::options().device(device).open(path)?;
    // SAFETY: the read below writes every byte before the buffer is read.
    let mut buf = unsafe { stream.alloc::<u8>(PROBE_BYTES) }
        .map_err(|e| Error::cuda("cuMemAllocAsync", e))?;
    f.read_to_device(&mut buf, 0)?; // warm-up: page cache, pools, threads
    let t = Instant::now();
    let r = f.read_to_device(&mut buf, 0)?;
    let secs = t.elapsed().as_secs_f64();
    Ok((r.clone(), r.bytes as f64 / secs / 1e9))
}

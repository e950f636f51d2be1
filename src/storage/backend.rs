//! Which implementation moves a [`GpuFile`](super::GpuFile)'s device bytes: the [`Backend`]
//! choice at open, and where `GpuFile` meets the cuFile layer.

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut};
use serde::Serialize;

use super::config::{CompatMode, StorageConfig};
use super::engine::io::Fds;
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};
use crate::storage::cufile::CuFileHandle;

/// Which implementation moves a [`GpuFile`](super::GpuFile)'s device bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Backend {
    /// Decided by [`CompatMode`] (`GPUDIRECT_COMPAT_MODE`, default AUTO): cuFile when it moves
    /// bytes by DMA, else gpudirect's engine.
    #[default]
    Auto,
    /// gpudirect's parallel engine, always.
    Engine,
    /// cuFile, always, including cuFile's own compatibility path; opening fails when cuFile
    /// cannot register the file. Useful to test cuFile itself.
    CuFile,
}

fn forced(setting: String) -> PathReport {
    PathReport::fallback(TransferPath::Posix, Cause::ForcedByConfig { setting })
}

// ---- Deciding before paying ---------------------------------------------------------------------
//
// `cuFileDriverOpen` is expensive (CONTRIBUTING.md, "Costs behind the storage engine's
// design") and, without
// nvidia-fs or P2PDMA, buys only cuFile's compatibility path, which [`CompatMode::Auto`] would not
// take anyway. So Auto first asks cheap facts: the file's filesystem (`fstatfs`), the udev record
// cuFile needs for its block device, and whether this host has a DMA path at all (nvidia-fs
// loaded, or P2PDMA configured for cuFile). Only when every fact allows DMA does it open the
// driver and register the file. Verdicts are cached per (device, filesystem) for the life of
// the process, so `GpuFile::open` on a known filesystem costs a few system calls.

/// What cheap facts say about cuFile DMA for a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::storage) enum Verdict {
    /// cuFile cannot move this file's bytes by DMA, for this cause: the engine it is.
    Engine(Cause),
    /// Every cheap fact allows DMA: open the driver and register the file to find out.
    Probe,
}

/// Whether this host has a GPUDirect Storage DMA path at all, read once per process: the
/// nvidia-fs module (`/proc/driver/nvidia-fs`), or cuFile configured for the kernel's PCI
/// P2PDMA (`"use_pci_p2pdma": true` in cufile.json), or an already open driver that says so.
fn host_has_dma_path() -> bool {
    static DMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if let Some(d) = crate::storage::cufile::Driver::get() {
        return d.nvfs_loaded() || d.p2pdma_enabled();
    }
    *DMA.get_or_init(|| {
        Path::new("/proc/driver/nvidia-fs").exists() || cufile_json_enables_p2pdma()
    })
}

/// True when the cufile.json cuFile will read ([`config_file`](crate::storage::cufile::config_file))
/// sets `use_pci_p2pdma` to true (outside `//` comments).
fn cufile_json_enables_p2pdma() -> bool {
    crate::storage::cufile::config_file()
        .is_some_and(|c| std::fs::read_to_string(c.path).is_ok_and(|s| json_enables_p2pdma(&s)))
}

fn json_enables_p2pdma(s: &str) -> bool {
    s.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .any(|l| {
            l.split_once("\"use_pci_p2pdma\"")
                .and_then(|(_, rest)| rest.trim_start().strip_prefix(':'))
                .is_some_and(|v| v.trim_start().starts_with("true"))
        })
}

/// The cheap facts of one file, in the order cuFile itself fails on them: a filesystem without
/// GDS support, a block device without the udev record cuFile registers through, a host
/// without a DMA path.
pub(in crate::storage) fn cheap_verdict(fs: &str, dev: u64, host_dma: bool) -> Verdict {
    use crate::storage::cufile::file_handle::{gds_capable_fs, udev_record};
    if !gds_capable_fs(fs) {
        return Verdict::Engine(Cause::FilesystemUnsupported { fs: fs.to_string() });
    }
    if libc::major(dev) != 0 {
        let (device, record) = udev_record(dev);
        if !record.exists() {
            return Verdict::Engine(Cause::UdevDataMissing { device });
        }
    }
    if !host_dma {
        return Verdict::Engine(Cause::NoNvidiaFs);
    }
    Verdict::Probe
}

type VerdictCache = std::sync::Mutex<Vec<((u64, i64), Verdict)>>;

/// Cached verdicts, per (st_dev, statfs magic); bounded (a process rarely sees more than a few
/// filesystems; past the bound verdicts are computed each time, which is cheap).
fn verdicts() -> &'static VerdictCache {
    static CACHE: VerdictCache = std::sync::Mutex::new(Vec::new());
    &CACHE
}
const VERDICTS_MAX: usize = 256;

fn fs_magic(f: &std::fs::File) -> Option<i64> {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero is a valid statfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open; `st` is a valid out-pointer.
    if unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_type as i64)
}

/// The filesystem type (`statfs` magic) of the file at `path`.
pub(in crate::storage) fn fs_magic_of_path(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: all-zero is a valid statfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_type as i64)
}

/// The verdict for an open file (cached per device and filesystem).
pub(in crate::storage) fn verdict(fds: &Fds) -> Verdict {
    verdict_for(fds.dev, fs_magic(&fds.buffered))
}

/// The verdict for a file on device `dev` (`st_dev`) of the filesystem type `magic` (`None`:
/// unknown), cached per device and filesystem.
pub(in crate::storage) fn verdict_for(dev: u64, magic: Option<i64>) -> Verdict {
    let Some(magic) = magic else {
        // Facts unavailable: let cuFile answer.
        return Verdict::Probe;
    };
    let key = (dev, magic);
    let mut cache = verdicts().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, v)) = cache.iter().find(|(k, _)| *k == key) {
        return v.clone();
    }
    let fs = crate::storage::cufile::file_handle::fs_name(magic);
    let v = cheap_verdict(&fs, dev, host_has_dma_path());
    if cache.len() < VERDICTS_MAX {
        cache.push((key, v.clone()));
    }
    v
}

/// Records what the full probe found for `fds`'s filesystem, when it is a fallback that holds
/// for the whole filesystem (so later opens there do not pay the probe again).
fn remember(fds: &Fds, cause: &Cause) {
    if !matches!(
        cause,
        Cause::NoNvidiaFs
            | Cause::UdevDataMissing { .. }
            | Cause::FilesystemUnsupported { .. }
            | Cause::ODirectRefused { .. }
            | Cause::CuFileUnavailable { .. }
    ) {
        return;
    }
    let Some(magic) = fs_magic(&fds.buffered) else {
        return;
    };
    let key = (fds.dev, magic);
    let mut cache = verdicts().lock().unwrap_or_else(|p| p.into_inner());
    let v = Verdict::Engine(cause.clone());
    match cache.iter().position(|(k, _)| *k == key) {
        Some(i) => cache[i].1 = v,
        None if cache.len() < VERDICTS_MAX => cache.push((key, v)),
        None => {}
    }
}

/// The setting that chose `cfg.compat_mode`, as a cause names it: the variable or the builder
/// call that set it, else a `StorageConfig` built in code (`GpuFileOptions::config`).
fn mode_setting(cfg: &StorageConfig) -> String {
    cfg.compat_source.clone().unwrap_or_else(|| {
        format!(
            "StorageConfig::compat_mode = CompatMode::{:?} (GpuFileOptions::config)",
            cfg.compat_mode
        )
    })
}

/// The path report of a file that `backend` and `cfg` send to the engine without opening it:
/// [`Backend::Engine`], [`CompatMode::PosixOnly`], or [`CompatMode::Auto`] on a filesystem
/// (`dev`, `magic`: see [`verdict_for`]) whose cheap facts rule cuFile DMA out; the same report
/// [`decide_backend`] gives such a file once open. `None` when only opening the file (and
/// registering it with cuFile) can tell.
pub(in crate::storage) fn engine_report_unopened(
    backend: Backend,
    cfg: &StorageConfig,
    dev: u64,
    magic: Option<i64>,
) -> Option<PathReport> {
    match (backend, cfg.compat_mode) {
        (Backend::Engine, _) => Some(forced("Backend::Engine".into())),
        (Backend::CuFile, _) | (Backend::Auto, CompatMode::CuFileRequired) => None,
        (Backend::Auto, CompatMode::PosixOnly) => Some(forced(mode_setting(cfg))),
        (Backend::Auto, CompatMode::Auto) => match verdict_for(dev, magic) {
            Verdict::Engine(cause) => Some(PathReport::fallback(TransferPath::Posix, cause)),
            Verdict::Probe => None,
        },
    }
}

/// Chooses cuFile or the engine for device transfers (see [`Backend`]). cuFile registers a
/// duplicate of a descriptor in `fds` (the file `GpuFile` opened), never `path` again.
///
/// [`CompatMode::Auto`] decides from cheap facts first ([`verdict`]) and pays for
/// `cuFileDriverOpen` and a registration only when they allow DMA; [`Backend::CuFile`] and
/// [`CompatMode::CuFileRequired`] always open cuFile (they require it).
pub(super) fn decide_backend(
    backend: Backend,
    cfg: &StorageConfig,
    path: &Path,
    fds: &Fds,
    write: bool,
) -> Result<(Option<CuFileHandle>, PathReport)> {
    match backend {
        Backend::Engine => Ok((None, forced("Backend::Engine".into()))),
        Backend::CuFile => {
            let h = cufile_glue::open(path, fds, write)?;
            let r = h.path_report().clone();
            Ok((Some(h), r))
        }
        Backend::Auto => match cfg.compat_mode {
            CompatMode::PosixOnly => Ok((None, forced(mode_setting(cfg)))),
            CompatMode::CuFileRequired => match cufile_glue::open(path, fds, write) {
                Ok(h) => {
                    let r = h.path_report().clone();
                    Ok((Some(h), r))
                }
                Err(e) => Err(Error::Unsupported {
                    what: format!(
                        "cuFile for {} ({} requires it)",
                        path.display(),
                        mode_setting(cfg)
                    ),
                    cause: cufile_glue::cause_of(&e, path),
                }),
            },
            CompatMode::Auto => {
                if let Verdict::Engine(cause) = verdict(fds) {
                    return Ok((None, PathReport::fallback(TransferPath::Posix, cause)));
                }
                match cufile_glue::open(path, fds, write) {
                    Ok(h) => {
                        let r = h.path_report().clone();
                        if r.path == TransferPath::Gds {
                            Ok((Some(h), r))
                        } else {
                            let cause = r.cause.clone().unwrap_or(Cause::NoNvidiaFs);
                            remember(fds, &cause);
                            Ok((None, PathReport::fallback(TransferPath::Posix, cause)))
                        }
                    }
                    Err(e) => {
                        let cause = cufile_glue::cause_of(&e, path);
                        remember(fds, &cause);
                        Ok((None, PathReport::fallback(TransferPath::Posix, cause)))
                    }
                }
            }
        },
    }
}

/// Where [`GpuFile`](super::GpuFile) meets the cuFile layer (`storage::cufile`).
pub(super) mod cufile_glue {
    use super::*;

    use crate::storage::cufile::{classify_registration_failure, Driver};

    /// Reads exactly `n` bytes (`n` ≤ the view, `off + n` ≤ the file's size: the caller
    /// clamped to end of file) through cuFile into the start of `view`. No byte of `view` past
    /// `n` (nor outside it) is written: [`CuFileHandle::read`] sends the tail of every read
    /// through a scratch buffer, because cuFile's compat path was seen writing device bytes
    /// past what it reported. The call's own CUDA work goes on `on`, a stream of the view's
    /// context (see [`CuFileHandle::read_after_capture_check`]).
    pub(in crate::storage) fn read_clamped(
        cf: &CuFileHandle,
        view: &mut CudaViewMut<'_, u8>,
        off: u64,
        n: usize,
        on: &Arc<CudaStream>,
    ) -> Result<usize> {
        // The callers (GpuFile's reads, ReadBatch) refused a capturing stream already.
        cf.read_after_capture_check(&mut view.slice_mut(..n), off, on)
    }

    /// Opens the driver and registers the file `GpuFile` opened with cuFile: a duplicate of
    /// its O_DIRECT descriptor when the driver can take a direct path and the filesystem gave
    /// one (as [`CuFileHandle::open`] chooses), else of its buffered descriptor. Never the path
    /// again: it may name another file by now. `path` names the file in reports.
    pub(in crate::storage) fn open(path: &Path, fds: &Fds, write: bool) -> Result<CuFileHandle> {
        let driver = Driver::open()?;
        debug_assert_eq!(write, fds.writable);
        let direct = driver.nvfs_loaded() || driver.p2pdma_enabled();
        let (fd, refused) = match (direct, fds.direct()) {
            (true, Some(d)) => (d, None),
            (true, None) => (&fds.buffered, fds.direct_refused.clone()),
            (false, _) => (&fds.buffered, None),
        };
        let file = fd
            .try_clone()
            .map_err(|e| Error::io("dup", Some(path.to_path_buf()), e))?;
        CuFileHandle::register_file(driver, file, path, refused)
    }

    /// The cause to report when cuFile could not be used.
    pub(in crate::storage) fn cause_of(e: &Error, path: &Path) -> Cause {
        match e {
            Error::Unsupported { cause, .. } => cause.clone(),
            Error::LibraryUnavailable { .. }
            | Error::SymbolUnavailable { .. }
            | Error::NoDevice { .. } => Cause::CuFileUnavailable {
                reason: e.to_string(),
            },
            other => classify_registration_failure(other, path),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::storage::engine::io::OpenMode;

    /// Issue 9 item 16 (double open): cuFile registers the descriptor `GpuFile` opened, not the
    /// path again. The path is replaced by another file between `GpuFile`'s open and cuFile's
    /// registration; the cuFile handle must still read the first file (before: it opened the
    /// path a second time and read the other file, while sizes came from the first).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_cufile_backend_registers_the_descriptor_gpufile_opened() {
        let stream = crate::cuda::context(0)
            .unwrap_or_else(|e| {
                panic!("this test needs a CUDA GPU (run gpu_* tests on a GPU machine): {e}")
            })
            .default_stream();
        let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("gpudirect-toctou-{}", std::process::id()));
        let other = dir.join(format!("gpudirect-toctou-other-{}", std::process::id()));
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        };
        let first = bytes(10_000);
        let second = bytes(10_000);
        std::fs::write(&path, &first).unwrap();
        std::fs::write(&other, &second).unwrap();
        crate::storage::testkit::udev_fix(&path);
        let fds = Fds::open(
            &path,
            OpenMode {
                write: false,
                create: false,
                truncate: false,
            },
        )
        .unwrap();
        // The path now names another file.
        std::fs::rename(&other, &path).unwrap();
        let got = decide_backend(
            Backend::CuFile,
            &StorageConfig::default(),
            &path,
            &fds,
            false,
        );
        let (h, report) = match got {
            Ok(v) => v,
            Err(e) => {
                let cause = cufile_glue::cause_of(&e, &path);
                let fixed = std::env::var("GPUDIRECT_TEST_UDEV_FIX").is_ok_and(|v| v == "1");
                // The machine's documented state without the hand-made record (containers
                // without /run/udev): the IO check needs GPUDIRECT_TEST_UDEV_FIX=1.
                if !fixed && matches!(cause, Cause::UdevDataMissing { .. }) {
                    eprintln!("registration refused as this machine's state predicts ({cause}); set GPUDIRECT_TEST_UDEV_FIX=1 (as root) to run this check");
                    std::fs::remove_file(&path).unwrap();
                    return;
                }
                panic!("cuFile registration failed: {e} (cause: {cause})");
            }
        };
        let h = h.expect("Backend::CuFile gives a handle");
        eprintln!("cuFile handle: {report}");
        assert_eq!(
            h.file().metadata().unwrap().ino(),
            fds.buffered.metadata().unwrap().ino(),
            "cuFile registered another file than the one GpuFile opened"
        );
        let mut dst = stream.alloc_zeros::<u8>(first.len()).unwrap();
        assert_eq!(h.read(&mut dst, 0).unwrap(), first.len());
        assert!(
            stream.clone_dtoh(&dst).unwrap() == first,
            "cuFile read the file that replaced the path"
        );
        drop(h);
        drop(fds);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn cheap_facts_decide_in_cufiles_order() {
        let ext4_dev = libc::makedev(254, 77);
        assert_eq!(
            cheap_verdict("tmpfs", libc::makedev(0, 40), true),
            Verdict::Engine(Cause::FilesystemUnsupported { fs: "tmpfs".into() })
        );
        assert_eq!(
            cheap_verdict("overlay", libc::makedev(0, 41), true),
            Verdict::Engine(Cause::FilesystemUnsupported {
                fs: "overlay".into()
            })
        );
        // A block device without its udev record (254:77 has none anywhere we run).
        assert_eq!(
            cheap_verdict("ext4", ext4_dev, true),
            Verdict::Engine(Cause::UdevDataMissing {
                device: "254:77".into()
            })
        );
        // NFS has no block device: only the host's DMA path matters.
        assert_eq!(
            cheap_verdict("nfs", libc::makedev(0, 50), false),
            Verdict::Engine(Cause::NoNvidiaFs)
        );
        assert_eq!(
            cheap_verdict("nfs", libc::makedev(0, 50), true),
            Verdict::Probe
        );
    }

    /// A mode set in a `StorageConfig` built in code is named as such (it was reported as
    /// `GPUDIRECT_COMPAT_MODE=ON` / `=OFF`, a variable nobody had set).
    #[test]
    fn a_mode_from_a_hand_built_config_names_the_config_not_the_variable() {
        let in_code = |m| StorageConfig {
            compat_mode: m,
            ..Default::default()
        };
        assert_eq!(
            mode_setting(&in_code(CompatMode::CuFileRequired)),
            "StorageConfig::compat_mode = CompatMode::CuFileRequired (GpuFileOptions::config)"
        );
        let from_env = StorageConfig {
            compat_source: Some("GPUDIRECT_COMPAT_MODE=off".into()),
            ..in_code(CompatMode::CuFileRequired)
        };
        assert_eq!(mode_setting(&from_env), "GPUDIRECT_COMPAT_MODE=off");

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        let f = crate::storage::GpuFile::options()
            .config(in_code(CompatMode::PosixOnly))
            .fallback(crate::FallbackPolicy::Allow)
            .open(&p)
            .unwrap();
        assert_eq!(f.path_report().path, TransferPath::Posix);
        assert_eq!(
            f.path_report().cause,
            Some(Cause::ForcedByConfig {
                setting: "StorageConfig::compat_mode = CompatMode::PosixOnly \
                          (GpuFileOptions::config)"
                    .into()
            })
        );
        let mut b = [0u8; 10];
        assert_eq!(f.pread_host(&mut b, 0).unwrap().bytes, 10);
        assert_eq!(&b, b"0123456789");
    }

    #[test]
    fn cufile_json_p2pdma_setting_is_found_outside_comments() {
        assert!(json_enables_p2pdma(
            "{\n \"properties\": {\n  \"use_pci_p2pdma\" : true,\n }\n}"
        ));
        assert!(!json_enables_p2pdma("{ \"use_pci_p2pdma\": false }"));
        assert!(!json_enables_p2pdma("  // \"use_pci_p2pdma\": true,\n"));
        assert!(!json_enables_p2pdma("{ \"allow_compat_mode\": true }"));
    }
}

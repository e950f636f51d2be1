//! Which implementation moves a [`GpuFile`](super::GpuFile)'s device bytes: the [`Backend`]
//! choice at open, and where `GpuFile` meets the cuFile layer.

use std::path::Path as FsPath;

use cudarc::driver::CudaViewMut;
use serde::Serialize;

use super::config::{CompatMode, StorageConfig};
use super::engine::io::Fds;
use crate::error::{Error, Result};
use crate::path::{Cause, Path, PathReport};
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
    PathReport::fallback(Path::Posix, Cause::ForcedByConfig { setting })
}

/// Chooses cuFile or the engine for device transfers (see [`Backend`]). cuFile registers a
/// duplicate of a descriptor in `fds` (the file `GpuFile` opened), never `path` again.
pub(super) fn decide_backend(
    backend: Backend,
    cfg: &StorageConfig,
    path: &FsPath,
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
            CompatMode::On => Ok((
                None,
                forced(
                    cfg.compat_source
                        .clone()
                        .unwrap_or_else(|| "GPUDIRECT_COMPAT_MODE=ON".into()),
                ),
            )),
            CompatMode::Off => match cufile_glue::open(path, fds, write) {
                Ok(h) => {
                    let r = h.path_report().clone();
                    Ok((Some(h), r))
                }
                Err(e) => Err(Error::Unsupported {
                    what: format!(
                        "cuFile for {} ({} requires it)",
                        path.display(),
                        cfg.compat_source
                            .as_deref()
                            .unwrap_or("GPUDIRECT_COMPAT_MODE=OFF")
                    ),
                    cause: cufile_glue::cause_of(&e, path),
                }),
            },
            CompatMode::Auto => match cufile_glue::open(path, fds, write) {
                Ok(h) => {
                    let r = h.path_report().clone();
                    if r.path == Path::Gds {
                        Ok((Some(h), r))
                    } else {
                        let cause = r.cause.clone().unwrap_or(Cause::NoNvidiaFs);
                        Ok((None, PathReport::fallback(Path::Posix, cause)))
                    }
                }
                Err(e) => Ok((
                    None,
                    PathReport::fallback(Path::Posix, cufile_glue::cause_of(&e, path)),
                )),
            },
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
    /// past what it reported.
    pub(crate) fn read_clamped(
        cf: &CuFileHandle,
        view: &mut CudaViewMut<'_, u8>,
        off: u64,
        n: usize,
    ) -> Result<usize> {
        cf.read(&mut view.slice_mut(..n), off)
    }

    /// Opens the driver and registers the file `GpuFile` opened with cuFile: a duplicate of
    /// its O_DIRECT descriptor when the driver can take a direct path and the filesystem gave
    /// one (as [`CuFileHandle::open`] chooses), else of its buffered descriptor. Never the path
    /// again: it may name another file by now. `path` names the file in reports.
    pub(crate) fn open(path: &FsPath, fds: &Fds, write: bool) -> Result<CuFileHandle> {
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
    pub(crate) fn cause_of(e: &Error, path: &FsPath) -> Cause {
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

    /// With `GPUDIRECT_TEST_UDEV_FIX=1` (as root), the udev record cuFile looks for, for the
    /// block device holding `path` (see tests/cufile_gpu.rs).
    fn udev_fix(path: &FsPath) {
        if std::env::var("GPUDIRECT_TEST_UDEV_FIX").map_or(true, |v| v != "1") {
            return;
        }
        let dev = std::fs::metadata(path).unwrap().dev();
        let record = format!("/run/udev/data/b{}:{}", libc::major(dev), libc::minor(dev));
        if FsPath::new(&record).exists() {
            return;
        }
        let fs = crate::storage::cufile::filesystem_type(path).unwrap_or_else(|| "ext4".into());
        std::fs::create_dir_all("/run/udev/data").expect("mkdir /run/udev/data (run as root)");
        let tmp = format!("{record}.tmp{}", std::process::id());
        std::fs::write(
            &tmp,
            format!("E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE={fs}\n"),
        )
        .unwrap();
        std::fs::rename(&tmp, &record).unwrap();
    }

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
        udev_fix(&path);
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
        let (h, report) = decide_backend(
            Backend::CuFile,
            &StorageConfig::default(),
            &path,
            &fds,
            false,
        )
        .unwrap_or_else(|e| panic!("cuFile registration failed (set GPUDIRECT_TEST_UDEV_FIX=1 as root where udev data is missing): {e}"));
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
}

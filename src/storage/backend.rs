//! Which implementation moves a [`GpuFile`](super::GpuFile)'s device bytes: the [`Backend`]
//! choice at open, and where `GpuFile` meets the cuFile layer.

use std::path::Path as FsPath;

use cudarc::driver::CudaViewMut;
use serde::Serialize;

use super::config::{CompatMode, StorageConfig};
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

/// Chooses cuFile or the engine for device transfers (see [`Backend`]).
pub(super) fn decide_backend(
    backend: Backend,
    cfg: &StorageConfig,
    path: &FsPath,
    write: bool,
) -> Result<(Option<CuFileHandle>, PathReport)> {
    match backend {
        Backend::Engine => Ok((None, forced("Backend::Engine".into()))),
        Backend::CuFile => {
            let h = cufile_glue::open(path, write)?;
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
            CompatMode::Off => match cufile_glue::open(path, write) {
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
            CompatMode::Auto => match cufile_glue::open(path, write) {
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

    use crate::storage::cufile::{classify_registration_failure, Driver, OpenMode};

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

    /// Opens the driver and registers `path` with cuFile (the file already exists: `GpuFile`
    /// created or truncated it).
    pub(crate) fn open(path: &FsPath, write: bool) -> Result<CuFileHandle> {
        let driver = Driver::open()?;
        let mode = if write {
            OpenMode::ReadWrite
        } else {
            OpenMode::Read
        };
        CuFileHandle::open(driver, path, mode)
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

//! Which implementation moves a [`GpuFile`](super::GpuFile)'s device bytes: the [`Backend`]
//! choice at open, and where `GpuFile` meets the cuFile layer.

use std::path::Path as FsPath;

use cudarc::driver::{CudaViewMut, DeviceSlice};
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

    /// Bytes a cuFile read may write past the range it was asked for (cuFile's compat path
    /// moves whole 4 KiB blocks); the tail of every read goes through a scratch buffer
    /// this much larger than the tail, so the caller's bytes past the range stay untouched.
    const CUFILE_OVERRUN: usize = 64 << 10;

    /// Reads exactly `n` bytes (`n` ≤ the view, `off + n` ≤ the file's size: the caller
    /// clamped to end of file) through cuFile. The last up-to-64 KiB piece goes through a
    /// scratch device buffer with room to spare and is copied into place, because cuFile's
    /// compat path was seen writing device bytes past what it reported.
    pub(crate) fn read_clamped(
        cf: &CuFileHandle,
        view: &mut CudaViewMut<'_, u8>,
        off: u64,
        n: usize,
    ) -> Result<usize> {
        let tail = n.min(CUFILE_OVERRUN + ((off as usize + n) % 4096));
        let body = n - tail;
        let mut got = 0;
        if body > 0 {
            let mut v = view.slice_mut(..body);
            got = cf.read(&mut v, off)?;
            if got < body {
                return Ok(got);
            }
        }
        let stream = view.stream().clone();
        let mut scratch = stream
            .alloc_zeros::<u8>(tail + CUFILE_OVERRUN)
            .map_err(|e| Error::cuda("cuMemAlloc", e))?;
        let t = {
            let mut sv = scratch.slice_mut(..tail);
            cf.read(&mut sv, off + body as u64)?
        };
        if t > 0 {
            let mut dst = view.slice_mut(body..body + t);
            stream
                .memcpy_dtod(&scratch.slice(..t), &mut dst)
                .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))?;
        }
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        got += t;
        Ok(got)
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

//! [`GpuFileOptions`]: how to open a [`GpuFile`] (access mode, backend, engine settings).

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::backend::{decide_backend, Backend};
use super::config::{CompatMode, ODirect, Pipeline, StorageConfig};
use super::engine::io::{Fds, OpenMode};
use super::file::GpuFile;
use crate::error::Result;
use crate::path::FallbackPolicy;

/// How to open a [`GpuFile`]; from [`GpuFile::options`].
///
/// Engine settings start from the environment's ([`StorageConfig::from_env`], read once per
/// process); each setter overrides one of them and [`config`](Self::config) replaces them all.
/// [`open`](Self::open) checks them by the rules the environment is checked by
/// ([`StorageConfig::validate`]): a value out of range is an error, never clamped.
#[derive(Debug, Clone)]
pub struct GpuFileOptions {
    write: bool,
    create: bool,
    truncate: bool,
    backend: Backend,
    config: StorageConfig,
    /// The environment's settings did not parse (`open` reports why) and no
    /// [`config`](Self::config) replaced them.
    env_invalid: bool,
    fallback: Option<FallbackPolicy>,
    device: Option<usize>,
    durable: bool,
}

/// What [`GpuFileOptions::unopened`] gives.
#[derive(Debug, Clone)]
pub(super) struct Unopened {
    pub backend: Backend,
    pub cfg: StorageConfig,
    pub policy: FallbackPolicy,
    pub device: Option<usize>,
}

impl Default for GpuFileOptions {
    /// As [`GpuFile::options`].
    fn default() -> Self {
        let (config, env_invalid) = match StorageConfig::from_env() {
            Ok(c) => (c, false),
            Err(_) => (StorageConfig::default(), true),
        };
        GpuFileOptions {
            write: false,
            create: false,
            truncate: false,
            backend: Backend::Auto,
            config,
            env_invalid,
            fallback: None,
            device: None,
            durable: false,
        }
    }
}

impl GpuFileOptions {
    /// Open for writing too.
    pub fn write(mut self, yes: bool) -> Self {
        self.write = yes;
        self
    }
    /// Create the file if missing (implies `write`).
    pub fn create(mut self, yes: bool) -> Self {
        self.create = yes;
        self.write |= yes;
        self
    }
    /// Truncate to zero length on open (implies `write`).
    pub fn truncate(mut self, yes: bool) -> Self {
        self.truncate = yes;
        self.write |= yes;
        self
    }
    /// Which implementation moves device bytes (default [`Backend::Auto`]).
    pub fn backend(mut self, b: Backend) -> Self {
        self.backend = b;
        self
    }
    /// Every engine setting at once, instead of the environment's (which is then not consulted
    /// for them); later setters override single fields of it.
    pub fn config(mut self, config: StorageConfig) -> Self {
        self.config = config;
        self.env_invalid = false;
        self
    }
    /// The mode [`Backend::Auto`] follows (default: `GPUDIRECT_COMPAT_MODE`, else AUTO).
    pub fn compat_mode(mut self, m: CompatMode) -> Self {
        self.config.compat_mode = m;
        self.config.compat_source =
            Some(format!("CompatMode::{m:?} (GpuFileOptions::compat_mode)"));
        self
    }
    /// Engine worker threads for every transfer, 1 to 1024 (default: `GPUDIRECT_NTHREADS`, else
    /// one per CPU of the GPU's NUMA node, 4 to 16, and at least 32 for O_DIRECT transfers).
    pub fn threads(mut self, n: usize) -> Self {
        self.config.threads = Some(n);
        self
    }
    /// Bytes per task, 1 byte to 1 GiB, rounded up to 4 KiB (default `GPUDIRECT_TASK_SIZE`,
    /// else 4 MiB).
    pub fn task_size(mut self, n: usize) -> Self {
        self.config.task_size = n;
        self
    }
    /// Bytes per pinned bounce buffer, 1 byte to 1 GiB, rounded up to 4 KiB (default
    /// `GPUDIRECT_BOUNCE_SIZE`, else 2 MiB). Device transfers move `min(task size, bounce
    /// size)` per step.
    pub fn bounce_size(mut self, n: usize) -> Self {
        self.config.bounce_size = n;
        self
    }
    /// O_DIRECT for reads and writes (default `GPUDIRECT_ODIRECT*`, else [`ODirect::Auto`]).
    pub fn odirect(mut self, m: ODirect) -> Self {
        self.config.odirect_read = m;
        self.config.odirect_write = m;
        self
    }
    /// O_DIRECT for reads only.
    pub fn odirect_read(mut self, m: ODirect) -> Self {
        self.config.odirect_read = m;
        self
    }
    /// O_DIRECT for writes only.
    pub fn odirect_write(mut self, m: ODirect) -> Self {
        self.config.odirect_write = m;
        self
    }
    /// Pin workers to the GPU's NUMA node (default `GPUDIRECT_NUMA_PIN`, else on).
    pub fn numa_pin(mut self, yes: bool) -> Self {
        self.config.numa_pin = yes;
        self
    }
    /// How reads to the GPU are staged (default `GPUDIRECT_PIPELINE`, else
    /// [`Pipeline::Segments`]).
    pub fn pipeline(mut self, p: Pipeline) -> Self {
        self.config.pipeline = p;
        self
    }
    /// [`Pipeline::Segments`]: bytes per pinned segment, one host→device copy each, 1 byte to
    /// 1 GiB (rounded up to 4 KiB, then down to a multiple of the piece size, at least one
    /// piece; default `GPUDIRECT_SEGMENT_SIZE`, else 16 MiB).
    pub fn segment_size(mut self, n: usize) -> Self {
        self.config.segment_size = n;
        self
    }
    /// [`Pipeline::Segments`]: segments in the ring, 2 to 64 (default `GPUDIRECT_SEGMENTS`,
    /// else 3).
    pub fn segments(mut self, n: usize) -> Self {
        self.config.segments = n;
        self
    }
    /// [`Pipeline::Segments`]: CUDA streams the segment copies go on, 1 to 16 (default
    /// `GPUDIRECT_COPY_STREAMS`, else 1).
    pub fn copy_streams(mut self, n: usize) -> Self {
        self.config.copy_streams = n;
        self
    }
    /// What a device transfer does when it would not take a direct path (default
    /// [`FallbackPolicy::global`]). Host-memory transfers have no direct path and ignore it.
    pub fn fallback(mut self, p: FallbackPolicy) -> Self {
        self.fallback = Some(p);
        self
    }
    /// Accept only buffers of this device; others are an [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// (default: any device).
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }
    /// `fsync` after every write call, so a
    /// write that returns `Ok` is on stable storage.
    ///
    /// Partly written ranges: a write that fails, or a process that dies during one, can leave
    /// its range partly written: some pieces new, others old, and where an O_DIRECT write first
    /// extended the file (`fallocate`), zeros. Readers running during a write can see the same.
    /// `durable` does not change that; it makes a write that completed survive a crash. Write to
    /// a temporary file and rename it (after a durable write) when readers must never see a
    /// partial file.
    pub fn durable(mut self, yes: bool) -> Self {
        self.durable = yes;
        self
    }

    /// The settings so far (not yet checked).
    pub(super) fn config_ref(&self) -> &StorageConfig {
        &self.config
    }

    /// What [`open`](Self::open) would decide before opening any file, for a batch that reads
    /// files by path without opening them up front: the backend, the checked settings and the
    /// fallback policy (their errors are `open`'s), and the device. `Ok(None)` when `open`
    /// would write, create or truncate (such a batch opens its files up front, as `open`).
    pub(super) fn unopened(&self) -> Result<Option<Unopened>> {
        if self.write || self.create || self.truncate {
            return Ok(None);
        }
        if self.env_invalid {
            StorageConfig::from_env()?;
        }
        let cfg = self
            .config
            .clone()
            .checked()
            .map_err(super::config::OutOfRange::api_error)?;
        let policy = match self.fallback {
            Some(p) => p,
            None => FallbackPolicy::global()?,
        };
        Ok(Some(Unopened {
            backend: self.backend,
            cfg,
            policy,
            device: self.device,
        }))
    }

    /// Opens `path` and decides the backend for device transfers.
    ///
    /// Errors: [`Error::InvalidEnvironment`](crate::Error::InvalidEnvironment) for an unparsable
    /// `GPUDIRECT_*` variable (unless [`config`](Self::config) replaced the environment's
    /// settings); [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a setting out of
    /// range or anything but a regular file (directory, FIFO, socket, device node);
    /// [`Error::Io`](crate::Error::Io) when `open` fails; with [`Backend::CuFile`] or
    /// [`CompatMode::CuFileRequired`], the cuFile error or
    /// [`Error::Unsupported`](crate::Error::Unsupported) with its cause.
    pub fn open(self, path: impl AsRef<Path>) -> Result<GpuFile> {
        self.open_with(path.as_ref(), true)
    }

    /// [`open`](Self::open); without an O_DIRECT descriptor unless `want_direct` (a batch that
    /// knows none of its reads of this file will use one saves the second `open`).
    pub(super) fn open_with(self, path: &Path, want_direct: bool) -> Result<GpuFile> {
        if self.env_invalid {
            // The snapshot is fixed for the process: this returns the same error again.
            StorageConfig::from_env()?;
        }
        let cfg = self
            .config
            .checked()
            .map_err(super::config::OutOfRange::api_error)?;
        let policy = match self.fallback {
            Some(p) => p,
            None => FallbackPolicy::global()?,
        };
        let fds = Fds::open_with(
            path,
            OpenMode {
                write: self.write,
                create: self.create,
                truncate: self.truncate,
            },
            want_direct,
        )?;
        let (cufile, report) = decide_backend(self.backend, &cfg, path, &fds, self.write)?;
        Ok(GpuFile {
            fds: Arc::new(fds),
            cufile,
            report,
            cfg,
            policy,
            device: self.device,
            durable: self.durable,
            warned: AtomicBool::new(false),
        })
    }
}

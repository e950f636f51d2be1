//! [`GpuFileOptions`]: how to open a [`GpuFile`] (access mode, backend, engine settings).

use std::path::Path as FsPath;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::backend::{decide_backend, Backend};
use super::config::{CompatMode, ODirect, Pipeline, StorageConfig};
use super::engine::io::{Fds, OpenMode};
use super::file::GpuFile;
use crate::error::Result;
use crate::path::FallbackPolicy;

/// How to open a [`GpuFile`]; from [`GpuFile::options`]. Unset engine settings come from the
/// environment (see [`config`](super::config)).
#[derive(Debug, Clone, Default)]
pub struct GpuFileOptions {
    write: bool,
    create: bool,
    truncate: bool,
    backend: Backend,
    compat_mode: Option<CompatMode>,
    threads: Option<usize>,
    task_size: Option<usize>,
    bounce_size: Option<usize>,
    odirect_read: Option<ODirect>,
    odirect_write: Option<ODirect>,
    numa_pin: Option<bool>,
    pipeline: Option<Pipeline>,
    segment_size: Option<usize>,
    segments: Option<usize>,
    copy_streams: Option<usize>,
    fallback: Option<FallbackPolicy>,
    device: Option<usize>,
    durable: bool,
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
    /// The mode [`Backend::Auto`] follows (default: `GPUDIRECT_COMPAT_MODE`, else AUTO).
    pub fn compat_mode(mut self, m: CompatMode) -> Self {
        self.compat_mode = Some(m);
        self
    }
    /// Engine worker threads for every transfer (default: `GPUDIRECT_NTHREADS`, else one per
    /// CPU of the GPU's NUMA node, 4 to 16, and at least 32 for O_DIRECT transfers).
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = Some(n.max(1));
        self
    }
    /// Bytes per task (rounded up to 4 KiB; default `GPUDIRECT_TASK_SIZE`, else 4 MiB).
    pub fn task_size(mut self, n: usize) -> Self {
        self.task_size = Some(super::config::round_size(n));
        self
    }
    /// Bytes per pinned bounce buffer (rounded up to 4 KiB; default `GPUDIRECT_BOUNCE_SIZE`,
    /// else 2 MiB). Device transfers move `min(task size, bounce size)` per step.
    pub fn bounce_size(mut self, n: usize) -> Self {
        self.bounce_size = Some(super::config::round_size(n));
        self
    }
    /// O_DIRECT for reads and writes (default `GPUDIRECT_ODIRECT*`, else [`ODirect::Auto`]).
    pub fn odirect(mut self, m: ODirect) -> Self {
        self.odirect_read = Some(m);
        self.odirect_write = Some(m);
        self
    }
    /// O_DIRECT for reads only.
    pub fn odirect_read(mut self, m: ODirect) -> Self {
        self.odirect_read = Some(m);
        self
    }
    /// O_DIRECT for writes only.
    pub fn odirect_write(mut self, m: ODirect) -> Self {
        self.odirect_write = Some(m);
        self
    }
    /// Pin workers to the GPU's NUMA node (default `GPUDIRECT_NUMA_PIN`, else on).
    pub fn numa_pin(mut self, yes: bool) -> Self {
        self.numa_pin = Some(yes);
        self
    }
    /// How reads to the GPU are staged (default `GPUDIRECT_PIPELINE`, else
    /// [`Pipeline::Segments`]).
    pub fn pipeline(mut self, p: Pipeline) -> Self {
        self.pipeline = Some(p);
        self
    }
    /// [`Pipeline::Segments`]: bytes per pinned segment, one host→device copy each (rounded
    /// down to a multiple of the piece size, at least one piece; default
    /// `GPUDIRECT_SEGMENT_SIZE`, else 32 MiB).
    pub fn segment_size(mut self, n: usize) -> Self {
        self.segment_size = Some(super::config::round_size(n));
        self
    }
    /// [`Pipeline::Segments`]: segments in the ring, 2 to 64 (default `GPUDIRECT_SEGMENTS`,
    /// else 4).
    pub fn segments(mut self, n: usize) -> Self {
        self.segments = Some(n.clamp(2, 64));
        self
    }
    /// [`Pipeline::Segments`]: CUDA streams the segment copies go on, 1 to 16 (default
    /// `GPUDIRECT_COPY_STREAMS`, else 1).
    pub fn copy_streams(mut self, n: usize) -> Self {
        self.copy_streams = Some(n.clamp(1, 16));
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
    /// `fsync` after every write, so a write that returns is on stable storage.
    pub fn durable(mut self, yes: bool) -> Self {
        self.durable = yes;
        self
    }

    /// Opens `path` and decides the backend for device transfers.
    ///
    /// Errors: [`Error::InvalidArgument`](crate::Error::InvalidArgument) for anything but a regular file (directory, FIFO,
    /// socket, device node) or an unparsable `GPUDIRECT_*` variable; [`Error::Io`](crate::Error::Io) when
    /// `open` fails; with [`Backend::CuFile`] or mode OFF, the cuFile error or
    /// [`Error::Unsupported`](crate::Error::Unsupported) with its cause.
    pub fn open(self, path: impl AsRef<FsPath>) -> Result<GpuFile> {
        let path = path.as_ref();
        let mut cfg = StorageConfig::from_env()?;
        if let Some(m) = self.compat_mode {
            cfg.compat_mode = m;
            cfg.compat_source = Some(format!("CompatMode::{m:?} (GpuFileOptions::compat_mode)"));
        }
        if self.threads.is_some() {
            cfg.threads = self.threads;
        }
        if let Some(n) = self.task_size {
            cfg.task_size = n;
        }
        if let Some(n) = self.bounce_size {
            cfg.bounce_size = n;
        }
        if let Some(m) = self.odirect_read {
            cfg.odirect_read = m;
        }
        if let Some(m) = self.odirect_write {
            cfg.odirect_write = m;
        }
        if let Some(p) = self.numa_pin {
            cfg.numa_pin = p;
        }
        if let Some(p) = self.pipeline {
            cfg.pipeline = p;
        }
        if let Some(n) = self.segment_size {
            cfg.segment_size = n;
        }
        if let Some(n) = self.segments {
            cfg.segments = n;
        }
        if let Some(n) = self.copy_streams {
            cfg.copy_streams = n;
        }
        let fds = Fds::open(
            path,
            OpenMode {
                write: self.write,
                create: self.create,
                truncate: self.truncate,
            },
        )?;
        let (cufile, report) = decide_backend(self.backend, &cfg, path, self.write)?;
        Ok(GpuFile {
            fds: Arc::new(fds),
            cufile,
            report,
            cfg,
            policy: self.fallback.unwrap_or_else(FallbackPolicy::global),
            device: self.device,
            durable: self.durable,
            warned: AtomicBool::new(false),
        })
    }
}

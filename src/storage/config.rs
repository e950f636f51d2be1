//! Storage settings: which backend a [`GpuFile`](super::GpuFile) uses and how the parallel
//! engine runs, set by API ([`GpuFileOptions`](super::GpuFileOptions)) or by environment.
//!
//! # Environment variables
//!
//! Read once per [`StorageConfig::from_env`] call (every `GpuFile::open` without explicit
//! settings calls it). A value that does not parse is an [`Error::InvalidArgument`] naming
//! the variable, never silently ignored.
//!
//! | Variable | Values | Default | Meaning |
//! |---|---|---|---|
//! | `GPUDIRECT_COMPAT_MODE` | `auto`, `on`, `off` (also `1/0`, `true/false`, `yes/no`) | `auto` | `auto`: cuFile only when it moves bytes by DMA ([`Path::Gds`](crate::Path::Gds)), else gpudirect's engine; `on`: always gpudirect's engine; `off`: cuFile required (its compat path allowed), an error otherwise |
//! | `GPUDIRECT_NTHREADS` | integer ≥ 1 | CPUs of the GPU's NUMA node this process may run on (at least 4, at most 16); O_DIRECT transfers at least 32 | worker threads of the engine (set: used for every transfer) |
//! | `GPUDIRECT_TASK_SIZE` | bytes, suffixes `K`, `M`, `G` (powers of 1024) | `4M` | the unit of work one worker takes at a time (rounded up to 4 KiB) |
//! | `GPUDIRECT_BOUNCE_SIZE` | bytes, as above | `2M` | each pinned bounce buffer (two per worker); device IO moves at most this much per step |
//! | `GPUDIRECT_ODIRECT` | `auto`, `on`, `off` | `auto` | O_DIRECT for both directions (see [`ODirect`]) |
//! | `GPUDIRECT_ODIRECT_READ`, `GPUDIRECT_ODIRECT_WRITE` | as above | `GPUDIRECT_ODIRECT` | per direction |
//! | `GPUDIRECT_NUMA_PIN` | `1`/`0` | `1` | pin workers (and so their bounce buffers) to the GPU's NUMA node |
//! | `GPUDIRECT_PIPELINE` | `segments`, `lanes` | `segments` | how reads to the GPU are staged (see [`Pipeline`]) |
//! | `GPUDIRECT_SEGMENT_SIZE` | bytes, as above | `32M` | [`Pipeline::Segments`]: bytes per pinned segment, one host→device copy each (a multiple of the piece size) |
//! | `GPUDIRECT_SEGMENTS` | integer 2 to 64 | `4` | [`Pipeline::Segments`]: segments in the ring |
//! | `GPUDIRECT_COPY_STREAMS` | integer 1 to 16 | `1` | [`Pipeline::Segments`]: CUDA streams the segment copies are issued on (round robin) |
//!
//! `GPUDIRECT_REQUIRE_DIRECT` and `GPUDIRECT_FALLBACK` choose the
//! [`FallbackPolicy`](crate::FallbackPolicy) (see there).

use std::fmt;

use serde::Serialize;

use crate::error::{Error, Result};

/// Alignment gpudirect uses for O_DIRECT: file offsets, lengths and buffer addresses of
/// direct IO are multiples of this (4 KiB covers 512-byte and 4K-sector devices).
pub const DIRECT_ALIGN: usize = 4096;

/// Default task size (4 MiB).
pub const DEFAULT_TASK_SIZE: usize = 4 << 20;
/// Default bounce-buffer size (2 MiB): small enough that a worker's two buffers can stay in the
/// CPU's last-level cache between the `pread` that fills them and the DMA that drains them.
pub const DEFAULT_BOUNCE_SIZE: usize = 2 << 20;
/// Largest count one `pread`/`pwrite` moves on Linux (`0x7ffff000`, 2 GiB − 4 KiB): engine
/// tasks and cuFile requests never exceed it.
pub const MAX_IO_PER_CALL: usize = 0x7fff_f000;

/// KvikIO-style mode: may a [`GpuFile`](super::GpuFile) use cuFile, and must it?
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum CompatMode {
    /// Use cuFile only when it gives a direct (DMA) path; otherwise gpudirect's engine,
    /// with the cause reported.
    #[default]
    Auto,
    /// Always gpudirect's engine (cause: forced by config).
    On,
    /// cuFile is required (its own compat path is accepted); opening fails when cuFile
    /// cannot register the file.
    Off,
}

impl CompatMode {
    /// Parses `auto`, `on`/`true`/`yes`/`1`, `off`/`false`/`no`/`0` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(CompatMode::Auto),
            "on" | "true" | "yes" | "1" => Some(CompatMode::On),
            "off" | "false" | "no" | "0" => Some(CompatMode::Off),
            _ => None,
        }
    }
}

impl fmt::Display for CompatMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CompatMode::Auto => "AUTO",
            CompatMode::On => "ON",
            CompatMode::Off => "OFF",
        })
    }
}

/// Whether the engine uses O_DIRECT (bypassing the page cache).
///
/// O_DIRECT is always opportunistic: when the filesystem refuses it (e.g. some tmpfs), the
/// engine uses buffered IO and says so in [`IoReport::odirect`](super::IoReport::odirect).
/// Unaligned heads and tails of writes always go through the page cache; reads over-read into
/// aligned bounce buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum ODirect {
    /// Writes: O_DIRECT for the aligned part. Reads: O_DIRECT only when a sample of the range
    /// shows it is mostly not in the page cache (cold data), buffered otherwise (a page-cached
    /// read is a memory copy and much faster than the disk).
    #[default]
    Auto,
    /// Always O_DIRECT where the filesystem allows it.
    On,
    /// Never O_DIRECT.
    Off,
}

impl ODirect {
    /// Parses `auto`, `on`/`1`/`true`/`yes`, `off`/`0`/`false`/`no` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(ODirect::Auto),
            "on" | "true" | "yes" | "1" => Some(ODirect::On),
            "off" | "false" | "no" | "0" => Some(ODirect::Off),
            _ => None,
        }
    }
}

/// How the engine stages a read into device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Pipeline {
    /// Workers `pread` pieces into disjoint slices of a ring of large pinned segments; when a
    /// segment is full, one `cuMemcpyHtoDAsync` moves all of it on a dedicated copy stream.
    /// Few, large copies keep the copy engine streaming; readers run ahead by the ring.
    #[default]
    Segments,
    /// Each worker double-buffers its own two bounce buffers and issues one copy per piece on
    /// its own stream (many small copies on many streams).
    Lanes,
}

impl Pipeline {
    /// Parses `segments` (`seg`) or `lanes` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "segments" | "segment" | "seg" => Some(Pipeline::Segments),
            "lanes" | "lane" => Some(Pipeline::Lanes),
            _ => None,
        }
    }
}

/// Default segment size of [`Pipeline::Segments`] (32 MiB).
pub const DEFAULT_SEGMENT_SIZE: usize = 32 << 20;
/// Default number of segments in the ring of [`Pipeline::Segments`].
pub const DEFAULT_SEGMENTS: usize = 4;
/// Default number of copy streams of [`Pipeline::Segments`].
pub const DEFAULT_COPY_STREAMS: usize = 1;

/// Settings of a [`GpuFile`](super::GpuFile): backend mode and engine parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StorageConfig {
    /// cuFile or gpudirect's engine (`GPUDIRECT_COMPAT_MODE`).
    pub compat_mode: CompatMode,
    /// Worker threads (`GPUDIRECT_NTHREADS`); `None` = the default for the device.
    pub threads: Option<usize>,
    /// Bytes per task (`GPUDIRECT_TASK_SIZE`), a multiple of [`DIRECT_ALIGN`].
    pub task_size: usize,
    /// Bytes per bounce buffer (`GPUDIRECT_BOUNCE_SIZE`), a multiple of [`DIRECT_ALIGN`].
    pub bounce_size: usize,
    /// O_DIRECT for reads (`GPUDIRECT_ODIRECT_READ`, else `GPUDIRECT_ODIRECT`).
    pub odirect_read: ODirect,
    /// O_DIRECT for writes (`GPUDIRECT_ODIRECT_WRITE`, else `GPUDIRECT_ODIRECT`).
    pub odirect_write: ODirect,
    /// Pin workers to the GPU's NUMA node (`GPUDIRECT_NUMA_PIN`).
    pub numa_pin: bool,
    /// How reads to the GPU are staged (`GPUDIRECT_PIPELINE`).
    pub pipeline: Pipeline,
    /// [`Pipeline::Segments`]: bytes per segment (`GPUDIRECT_SEGMENT_SIZE`).
    pub segment_size: usize,
    /// [`Pipeline::Segments`]: segments in the ring (`GPUDIRECT_SEGMENTS`).
    pub segments: usize,
    /// [`Pipeline::Segments`]: copy streams (`GPUDIRECT_COPY_STREAMS`).
    pub copy_streams: usize,
    /// Which variable set `compat_mode` (for the `ForcedByConfig` cause), if any.
    #[serde(skip)]
    pub(crate) compat_source: Option<String>,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            compat_mode: CompatMode::Auto,
            threads: None,
            task_size: DEFAULT_TASK_SIZE,
            bounce_size: DEFAULT_BOUNCE_SIZE,
            odirect_read: ODirect::Auto,
            odirect_write: ODirect::Auto,
            numa_pin: true,
            pipeline: Pipeline::Segments,
            segment_size: DEFAULT_SEGMENT_SIZE,
            segments: DEFAULT_SEGMENTS,
            copy_streams: DEFAULT_COPY_STREAMS,
            compat_source: None,
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn bad(name: &str, value: &str, expected: &str) -> Error {
    Error::InvalidArgument(format!(
        "{name}={value:?} is not valid: expected {expected}; fix or unset the variable"
    ))
}

/// Parses a byte size: a plain integer or one with a `K`, `M`, `G` suffix (×1024ⁿ, an
/// optional trailing `B`/`iB` allowed).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim().to_ascii_uppercase();
    let t = t
        .strip_suffix("IB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(&t);
    let (num, mult) = match t.chars().last()? {
        'K' => (&t[..t.len() - 1], 1usize << 10),
        'M' => (&t[..t.len() - 1], 1 << 20),
        'G' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

impl StorageConfig {
    /// Defaults overridden by the `GPUDIRECT_*` environment variables listed in the module
    /// docs. Errors: [`Error::InvalidArgument`] naming a variable whose value does not parse.
    pub fn from_env() -> Result<Self> {
        let mut c = StorageConfig::default();
        if let Some(v) = env("GPUDIRECT_COMPAT_MODE") {
            c.compat_mode = CompatMode::parse(&v)
                .ok_or_else(|| bad("GPUDIRECT_COMPAT_MODE", &v, "auto, on or off"))?;
            c.compat_source = Some(format!("GPUDIRECT_COMPAT_MODE={v}"));
        }
        if let Some(v) = env("GPUDIRECT_NTHREADS") {
            let n = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=1024).contains(n))
                .ok_or_else(|| bad("GPUDIRECT_NTHREADS", &v, "an integer from 1 to 1024"))?;
            c.threads = Some(n);
        }
        if let Some(v) = env("GPUDIRECT_PIPELINE") {
            c.pipeline = Pipeline::parse(&v)
                .ok_or_else(|| bad("GPUDIRECT_PIPELINE", &v, "segments or lanes"))?;
        }
        for (name, slot, lo, hi) in [
            ("GPUDIRECT_SEGMENTS", &mut c.segments, 2usize, 64usize),
            ("GPUDIRECT_COPY_STREAMS", &mut c.copy_streams, 1, 16),
        ] {
            if let Some(v) = env(name) {
                *slot = v
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (lo..=hi).contains(n))
                    .ok_or_else(|| bad(name, &v, &format!("an integer from {lo} to {hi}")))?;
            }
        }
        for (name, slot) in [
            ("GPUDIRECT_TASK_SIZE", &mut c.task_size),
            ("GPUDIRECT_BOUNCE_SIZE", &mut c.bounce_size),
            ("GPUDIRECT_SEGMENT_SIZE", &mut c.segment_size),
        ] {
            if let Some(v) = env(name) {
                let n = parse_size(&v)
                    .filter(|n| (1..=1 << 30).contains(n))
                    .ok_or_else(|| bad(name, &v, "a size from 1 byte to 1G, e.g. 4M"))?;
                *slot = round_size(n);
            }
        }
        if let Some(v) = env("GPUDIRECT_ODIRECT") {
            let m = ODirect::parse(&v)
                .ok_or_else(|| bad("GPUDIRECT_ODIRECT", &v, "auto, on or off"))?;
            c.odirect_read = m;
            c.odirect_write = m;
        }
        if let Some(v) = env("GPUDIRECT_ODIRECT_READ") {
            c.odirect_read = ODirect::parse(&v)
                .ok_or_else(|| bad("GPUDIRECT_ODIRECT_READ", &v, "auto, on or off"))?;
        }
        if let Some(v) = env("GPUDIRECT_ODIRECT_WRITE") {
            c.odirect_write = ODirect::parse(&v)
                .ok_or_else(|| bad("GPUDIRECT_ODIRECT_WRITE", &v, "auto, on or off"))?;
        }
        if let Some(v) = env("GPUDIRECT_NUMA_PIN") {
            c.numa_pin = match v.trim().to_ascii_lowercase().as_str() {
                "1" | "on" | "true" | "yes" => true,
                "0" | "off" | "false" | "no" => false,
                _ => return Err(bad("GPUDIRECT_NUMA_PIN", &v, "1 or 0")),
            };
        }
        Ok(c)
    }

    /// The size one pipeline step moves through a bounce buffer: `min(task, bounce)`.
    pub(crate) fn piece_size(&self) -> usize {
        self.task_size.min(self.bounce_size).max(DIRECT_ALIGN)
    }
}

/// Rounds a size up to a multiple of [`DIRECT_ALIGN`], capped below [`MAX_IO_PER_CALL`].
pub(crate) fn round_size(n: usize) -> usize {
    let r = n.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
    r.min(MAX_IO_PER_CALL / DIRECT_ALIGN * DIRECT_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("4M"), Some(4 << 20));
        assert_eq!(parse_size("16MiB"), Some(16 << 20));
        assert_eq!(parse_size(" 1G "), Some(1 << 30));
        assert_eq!(parse_size("2MB"), Some(2 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
    }

    #[test]
    fn modes_parse() {
        assert_eq!(CompatMode::parse("AUTO"), Some(CompatMode::Auto));
        assert_eq!(CompatMode::parse("yes"), Some(CompatMode::On));
        assert_eq!(CompatMode::parse("0"), Some(CompatMode::Off));
        assert_eq!(CompatMode::parse("maybe"), None);
        assert_eq!(ODirect::parse("On"), Some(ODirect::On));
        assert_eq!(ODirect::parse("nope"), None);
        assert_eq!(Pipeline::parse("Segments"), Some(Pipeline::Segments));
        assert_eq!(Pipeline::parse("lanes"), Some(Pipeline::Lanes));
        assert_eq!(Pipeline::parse("fast"), None);
    }

    #[test]
    fn rounding_keeps_alignment() {
        assert_eq!(round_size(1), 4096);
        assert_eq!(round_size(4096), 4096);
        assert_eq!(round_size(4097), 8192);
        assert_eq!(round_size(usize::MAX / 2) % DIRECT_ALIGN, 0);
        assert!(round_size(usize::MAX / 2) <= MAX_IO_PER_CALL);
    }
}

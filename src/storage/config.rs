//! Storage settings: which backend a [`GpuFile`](super::GpuFile) uses and how the parallel
//! engine runs, set by API ([`GpuFileOptions`](super::GpuFileOptions)) or by environment.
//!
//! # Environment variables
//!
//! Read once per process: [`GpuFile::open`](super::GpuFile::open)
//! and [`GpuFile::options`](super::GpuFile::options) start from [`StorageConfig::from_env`];
//! setting a variable after the first use has no effect. A value that does not parse, or lies
//! outside its range, is an [`Error::InvalidEnvironment`] naming the variable and the accepted
//! values, never silently ignored or clamped. [`GpuFileOptions`](super::GpuFileOptions)'s
//! setters are checked by the same rules ([`StorageConfig::validate`]).
//!
//! The variables (`GPUDIRECT_COMPAT_MODE`, `GPUDIRECT_NTHREADS`, `GPUDIRECT_TASK_SIZE`,
//! `GPUDIRECT_BOUNCE_SIZE`, `GPUDIRECT_ODIRECT`, `GPUDIRECT_ODIRECT_READ`,
//! `GPUDIRECT_ODIRECT_WRITE`, `GPUDIRECT_NUMA_PIN`, `GPUDIRECT_PIPELINE`,
//! `GPUDIRECT_SEGMENT_SIZE`, `GPUDIRECT_SEGMENTS`, `GPUDIRECT_COPY_STREAMS`), their accepted
//! values and defaults are in the one table of the README, [Environment
//! variables](https://github.com/gpudirect-rs/gpudirect#environment-variables); each
//! [`StorageConfig`] field names its variable.
//!
//! `GPUDIRECT_REQUIRE_DIRECT` and `GPUDIRECT_FALLBACK` choose the
//! [`FallbackPolicy`](crate::FallbackPolicy) (see there).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::env::{self, Env, ParseValueError};
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

/// May a [`GpuFile`](super::GpuFile) use cuFile, and must it? What
/// [`Backend::Auto`](super::Backend::Auto) follows (`GPUDIRECT_COMPAT_MODE`,
/// [`GpuFileOptions::compat_mode`](super::GpuFileOptions::compat_mode)).
///
/// The environment keeps KvikIO's spellings (`KVIKIO_COMPAT_MODE`), in which "compatibility
/// mode on" means POSIX IO instead of cuFile; the variants say what they do:
///
/// | variant | `GPUDIRECT_COMPAT_MODE` | also accepted | what a `GpuFile` uses |
/// |---|---|---|---|
/// | [`Auto`](Self::Auto) | `AUTO` | | cuFile when it moves bytes by DMA, else gpudirect's POSIX engine with the cause |
/// | [`PosixOnly`](Self::PosixOnly) | `ON` (any boolean true) | `posix_only` | never cuFile: gpudirect's POSIX engine |
/// | [`CuFileRequired`](Self::CuFileRequired) | `OFF` (any boolean false) | `cufile_required` | cuFile, its own compat path included; opening fails without it |
///
/// [`FromStr`] takes every spelling in the table, any case, `-` for `_`; [`Display`](fmt::Display)
/// and `Serialize` write the `snake_case` name (`auto`, `posix_only`, `cufile_required`), which
/// parses back. The old variant names [`CompatMode::On`] and [`CompatMode::Off`] remain as
/// deprecated constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CompatMode {
    /// Use cuFile only when it gives a direct (DMA) path; otherwise gpudirect's engine,
    /// with the cause reported. `GPUDIRECT_COMPAT_MODE=AUTO`.
    #[default]
    Auto,
    /// Never cuFile: always gpudirect's POSIX engine
    /// ([`TransferPath::Posix`](crate::TransferPath::Posix), cause: forced by config).
    /// `GPUDIRECT_COMPAT_MODE=ON` (KvikIO's "compatibility mode on").
    PosixOnly,
    /// cuFile is required (its own compat path is accepted); opening fails when cuFile
    /// cannot register the file. `GPUDIRECT_COMPAT_MODE=OFF`.
    #[serde(rename = "cufile_required")]
    CuFileRequired,
}

#[allow(non_upper_case_globals)] // the old variant names, so `CompatMode::On` keeps compiling
impl CompatMode {
    /// The old name of [`CompatMode::PosixOnly`] (KvikIO's `COMPAT_MODE=ON`: no cuFile).
    ///
    /// ```
    /// #![allow(deprecated)]
    /// use gpudirect::storage::CompatMode;
    /// assert_eq!(CompatMode::On, CompatMode::PosixOnly);
    /// assert_eq!(CompatMode::Off, CompatMode::CuFileRequired);
    /// let uses_cufile = |m: CompatMode| match m {
    ///     CompatMode::Auto | CompatMode::Off => true,
    ///     CompatMode::On => false,
    /// };
    /// assert!(!uses_cufile(CompatMode::PosixOnly));
    /// ```
    ///
    /// ```compile_fail
    /// #![deny(deprecated)]
    /// let _ = gpudirect::storage::CompatMode::On;
    /// ```
    #[deprecated(
        note = "renamed to CompatMode::PosixOnly (GPUDIRECT_COMPAT_MODE=ON: never cuFile)"
    )]
    pub const On: CompatMode = CompatMode::PosixOnly;

    /// The old name of [`CompatMode::CuFileRequired`] (KvikIO's `COMPAT_MODE=OFF`).
    ///
    /// ```compile_fail
    /// #![deny(deprecated)]
    /// let _ = gpudirect::storage::CompatMode::Off;
    /// ```
    #[deprecated(
        note = "renamed to CompatMode::CuFileRequired (GPUDIRECT_COMPAT_MODE=OFF: cuFile or an error)"
    )]
    pub const Off: CompatMode = CompatMode::CuFileRequired;
}

/// `auto`, or a boolean (`on` = [`ODirect::On`]).
const AUTO_OR_BOOL: &str = "auto, or on/off (1/0, true/false, yes/no)";

/// `GPUDIRECT_COMPAT_MODE`'s spellings: KvikIO's and the variants' names.
const COMPAT_MODE_SPELLINGS: &str =
    "auto, on/posix_only (or 1, true, yes), off/cufile_required (or 0, false, no)";

/// `auto`, else the one boolean table: `true` is `on`, `false` is `off`.
fn auto_or_bool<T>(s: &str, auto: T, on: T, off: T) -> std::result::Result<T, ParseValueError> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(auto);
    }
    match env::parse_bool(s) {
        Some(true) => Ok(on),
        Some(false) => Ok(off),
        None => Err(ParseValueError::new(s, AUTO_OR_BOOL)),
    }
}

impl FromStr for CompatMode {
    type Err = ParseValueError;
    /// Parses `auto`, `posix_only` or `on`/`true`/`yes`/`1`, `cufile_required` or
    /// `off`/`false`/`no`/`0` (any case, `-` for `_`).
    fn from_str(s: &str) -> std::result::Result<Self, ParseValueError> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "auto" => Ok(CompatMode::Auto),
            "posix_only" => Ok(CompatMode::PosixOnly),
            "cufile_required" => Ok(CompatMode::CuFileRequired),
            _ => match env::parse_bool(s) {
                Some(true) => Ok(CompatMode::PosixOnly),
                Some(false) => Ok(CompatMode::CuFileRequired),
                None => Err(ParseValueError::new(s, COMPAT_MODE_SPELLINGS)),
            },
        }
    }
}

impl CompatMode {
    /// Parses `auto`, `on`/`true`/`yes`/`1`, `off`/`false`/`no`/`0` (any case).
    #[deprecated(note = "use str::parse (FromStr), whose error lists the spellings")]
    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

impl fmt::Display for CompatMode {
    /// The `snake_case` name, a spelling [`FromStr`] accepts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CompatMode::Auto => "auto",
            CompatMode::PosixOnly => "posix_only",
            CompatMode::CuFileRequired => "cufile_required",
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

impl FromStr for ODirect {
    type Err = ParseValueError;
    /// Parses `auto`, `on`/`1`/`true`/`yes`, `off`/`0`/`false`/`no` (any case).
    fn from_str(s: &str) -> std::result::Result<Self, ParseValueError> {
        auto_or_bool(s, ODirect::Auto, ODirect::On, ODirect::Off)
    }
}

impl ODirect {
    /// Parses `auto`, `on`/`1`/`true`/`yes`, `off`/`0`/`false`/`no` (any case).
    #[deprecated(note = "use str::parse (FromStr), whose error lists the spellings")]
    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok()
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

impl FromStr for Pipeline {
    type Err = ParseValueError;
    /// Parses `segments` (`segment`, `seg`) or `lanes` (`lane`), any case.
    fn from_str(s: &str) -> std::result::Result<Self, ParseValueError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "segments" | "segment" | "seg" => Ok(Pipeline::Segments),
            "lanes" | "lane" => Ok(Pipeline::Lanes),
            _ => Err(ParseValueError::new(s, "segments or lanes")),
        }
    }
}

impl Pipeline {
    /// Parses `segments` (`seg`) or `lanes` (any case).
    #[deprecated(note = "use str::parse (FromStr), whose error lists the spellings")]
    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

/// Default segment size of [`Pipeline::Segments`] (16 MiB).
pub const DEFAULT_SEGMENT_SIZE: usize = 16 << 20;
/// Default number of segments in the ring of [`Pipeline::Segments`] (6: the ring's 96 MiB in
/// more, smaller slots, so a slot held up by a slow read leaves more of the ring working).
pub const DEFAULT_SEGMENTS: usize = 6;
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
    /// [`Pipeline::Segments`]: segments in the ring (`GPUDIRECT_SEGMENTS`), also for
    /// [`read_to_gpu`](super::read_to_gpu) (a larger ring is slower in steady state:
    /// [CONTRIBUTING.md, "Costs behind the storage engine's
    /// design"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#costs-behind-the-storage-engines-design)).
    pub segments: usize,
    /// [`Pipeline::Segments`]: copy streams (`GPUDIRECT_COPY_STREAMS`).
    pub copy_streams: usize,
    /// Which variable set `compat_mode` (for the `ForcedByConfig` cause), if any.
    #[serde(skip)]
    pub(in crate::storage) compat_source: Option<String>,
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

/// One bounded setting: its variable, its builder method, its range and the range's text.
#[derive(Debug)]
struct Bound {
    var: &'static str,
    setter: &'static str,
    lo: usize,
    hi: usize,
    expected: &'static str,
}

const THREADS: Bound = Bound {
    var: "GPUDIRECT_NTHREADS",
    setter: "threads",
    lo: 1,
    hi: 1024,
    expected: "an integer from 1 to 1024",
};
const SEGMENTS: Bound = Bound {
    var: "GPUDIRECT_SEGMENTS",
    setter: "segments",
    lo: 2,
    hi: 64,
    expected: "an integer from 2 to 64",
};
const COPY_STREAMS: Bound = Bound {
    var: "GPUDIRECT_COPY_STREAMS",
    setter: "copy_streams",
    lo: 1,
    hi: 16,
    expected: "an integer from 1 to 16",
};
/// Sizes: 1 byte to 1 GiB, rounded up to [`DIRECT_ALIGN`] once checked.
const SIZE_EXPECTED: &str = "a size from 1 byte to 1G, e.g. 4M";
const TASK_SIZE: Bound = Bound {
    var: "GPUDIRECT_TASK_SIZE",
    setter: "task_size",
    lo: 1,
    hi: 1 << 30,
    expected: SIZE_EXPECTED,
};
const BOUNCE_SIZE: Bound = Bound {
    var: "GPUDIRECT_BOUNCE_SIZE",
    setter: "bounce_size",
    lo: 1,
    hi: 1 << 30,
    expected: SIZE_EXPECTED,
};
const SEGMENT_SIZE: Bound = Bound {
    var: "GPUDIRECT_SEGMENT_SIZE",
    setter: "segment_size",
    lo: 1,
    hi: 1 << 30,
    expected: SIZE_EXPECTED,
};

/// A setting outside its range: which one, and the accepted range.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) struct OutOfRange {
    bound: &'static Bound,
    value: usize,
}

impl OutOfRange {
    /// As the environment's error (the value came from `GPUDIRECT_*`).
    pub(in crate::storage) fn env_error(self) -> Error {
        env::invalid(self.bound.var, &self.value.to_string(), self.bound.expected)
    }

    /// As an API error (the value came from a `GpuFileOptions` setter or a `StorageConfig`).
    pub(in crate::storage) fn api_error(self) -> Error {
        Error::InvalidArgument(format!(
            "{} = {} is out of range: expected {} (GpuFileOptions::{}, or {})",
            self.bound.setter, self.value, self.bound.expected, self.bound.setter, self.bound.var
        ))
    }
}

impl Bound {
    fn contains(&self, value: usize) -> bool {
        (self.lo..=self.hi).contains(&value)
    }
}

fn check(bound: &'static Bound, value: usize) -> std::result::Result<(), OutOfRange> {
    if bound.contains(value) {
        Ok(())
    } else {
        Err(OutOfRange { bound, value })
    }
}

impl StorageConfig {
    /// The defaults overridden by the `GPUDIRECT_*` environment variables listed in the module
    /// docs (read once per process). Errors: [`Error::InvalidEnvironment`] naming a variable
    /// whose value does not parse or is out of range.
    pub fn from_env() -> Result<Self> {
        Self::from_source(Env::process())
    }

    pub(in crate::storage) fn from_source(env: Env<'_>) -> Result<Self> {
        let mut c = StorageConfig::default();
        if let Some(m) = env.var::<CompatMode>("GPUDIRECT_COMPAT_MODE")? {
            c.compat_mode = m;
            c.compat_source = env
                .raw("GPUDIRECT_COMPAT_MODE")
                .map(|v| format!("GPUDIRECT_COMPAT_MODE={v}"));
        }
        // Range-checked here too, so the error quotes the variable's own text.
        let int = |b: &'static Bound| {
            env.parse(b.var, b.expected, |v| {
                v.trim().parse::<usize>().ok().filter(|n| b.contains(*n))
            })
        };
        let size = |b: &'static Bound| {
            env.parse(b.var, b.expected, |v| {
                parse_size(v).filter(|n| b.contains(*n))
            })
        };
        if let Some(n) = int(&THREADS)? {
            c.threads = Some(n);
        }
        if let Some(p) = env.var::<Pipeline>("GPUDIRECT_PIPELINE")? {
            c.pipeline = p;
        }
        if let Some(n) = int(&SEGMENTS)? {
            c.segments = n;
        }
        if let Some(n) = int(&COPY_STREAMS)? {
            c.copy_streams = n;
        }
        if let Some(n) = size(&TASK_SIZE)? {
            c.task_size = n;
        }
        if let Some(n) = size(&BOUNCE_SIZE)? {
            c.bounce_size = n;
        }
        if let Some(n) = size(&SEGMENT_SIZE)? {
            c.segment_size = n;
        }
        if let Some(m) = env.var::<ODirect>("GPUDIRECT_ODIRECT")? {
            c.odirect_read = m;
            c.odirect_write = m;
        }
        if let Some(m) = env.var::<ODirect>("GPUDIRECT_ODIRECT_READ")? {
            c.odirect_read = m;
        }
        if let Some(m) = env.var::<ODirect>("GPUDIRECT_ODIRECT_WRITE")? {
            c.odirect_write = m;
        }
        if let Some(p) = env.flag("GPUDIRECT_NUMA_PIN")? {
            c.numa_pin = p;
        }
        c.checked().map_err(OutOfRange::env_error)
    }

    /// Checks every bounded setting against its documented range (the same rule for the
    /// environment, [`GpuFileOptions`](super::GpuFileOptions) and a `StorageConfig` built by
    /// hand): threads 1 to 1024, sizes 1 byte to 1 GiB, segments 2 to 64, copy streams 1 to 16.
    /// Nothing is clamped. Errors: [`Error::InvalidArgument`] naming the setting and its range.
    pub fn validate(&self) -> Result<()> {
        self.clone()
            .checked()
            .map(drop)
            .map_err(OutOfRange::api_error)
    }

    /// [`validate`](Self::validate), then sizes rounded up to a multiple of [`DIRECT_ALIGN`].
    pub(in crate::storage) fn checked(mut self) -> std::result::Result<Self, OutOfRange> {
        if let Some(n) = self.threads {
            check(&THREADS, n)?;
        }
        check(&SEGMENTS, self.segments)?;
        check(&COPY_STREAMS, self.copy_streams)?;
        check(&TASK_SIZE, self.task_size)?;
        check(&BOUNCE_SIZE, self.bounce_size)?;
        check(&SEGMENT_SIZE, self.segment_size)?;
        self.task_size = round_size(self.task_size);
        self.bounce_size = round_size(self.bounce_size);
        self.segment_size = round_size(self.segment_size);
        Ok(self)
    }

    /// The size one pipeline step moves through a bounce buffer: `min(task, bounce)`.
    pub(in crate::storage) fn piece_size(&self) -> usize {
        self.task_size.min(self.bounce_size).max(DIRECT_ALIGN)
    }
}

/// Rounds a size up to a multiple of [`DIRECT_ALIGN`], capped below [`MAX_IO_PER_CALL`].
pub(in crate::storage) fn round_size(n: usize) -> usize {
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
        assert_eq!("AUTO".parse(), Ok(CompatMode::Auto));
        assert_eq!("yes".parse(), Ok(CompatMode::PosixOnly));
        assert_eq!("0".parse(), Ok(CompatMode::CuFileRequired));
        let e = "maybe".parse::<CompatMode>().unwrap_err();
        assert!(e.to_string().contains("on/posix_only"), "{e}");
        assert_eq!("On".parse(), Ok(ODirect::On));
        assert!("nope".parse::<ODirect>().is_err());
        assert_eq!("Segments".parse(), Ok(Pipeline::Segments));
        assert_eq!("lanes".parse(), Ok(Pipeline::Lanes));
        let e = "fast".parse::<Pipeline>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"fast\" is not valid: expected segments or lanes"
        );
    }

    #[test]
    fn compat_mode_old_and_new_spellings_parse_and_round_trip() {
        use CompatMode::*;
        for (text, mode) in [
            // KvikIO's spellings (GPUDIRECT_COMPAT_MODE=ON|OFF|AUTO) and the boolean table.
            ("AUTO", Auto),
            ("ON", PosixOnly),
            ("OFF", CuFileRequired),
            ("on", PosixOnly),
            ("true", PosixOnly),
            ("1", PosixOnly),
            ("Yes", PosixOnly),
            ("off", CuFileRequired),
            ("false", CuFileRequired),
            ("0", CuFileRequired),
            ("NO", CuFileRequired),
            // The variants' names.
            ("auto", Auto),
            ("posix_only", PosixOnly),
            ("POSIX-ONLY", PosixOnly),
            (" posix_only ", PosixOnly),
            ("cufile_required", CuFileRequired),
            ("CuFile-Required", CuFileRequired),
        ] {
            assert_eq!(text.parse::<CompatMode>(), Ok(mode), "{text:?}");
        }
        for mode in [Auto, PosixOnly, CuFileRequired] {
            let shown = mode.to_string();
            assert_eq!(shown.parse::<CompatMode>(), Ok(mode), "{shown}");
            let json = serde_json::to_string(&mode).unwrap();
            assert_eq!(json, format!("\"{shown}\""));
        }
        #[allow(deprecated)]
        {
            assert_eq!(CompatMode::On, PosixOnly);
            assert_eq!(CompatMode::Off, CuFileRequired);
        }
        for bad in ["posix", "cufile", "required", "on_posix", "", "2"] {
            let e = bad.parse::<CompatMode>().unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("{bad:?} is not valid: expected {COMPAT_MODE_SPELLINGS}")
            );
        }
    }

    fn from_pairs(pairs: &[(&str, &str)]) -> Result<StorageConfig> {
        let m = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        StorageConfig::from_source(Env::from_map(&m))
    }

    #[test]
    fn environment_sets_every_knob() {
        assert_eq!(from_pairs(&[]).unwrap(), StorageConfig::default());
        let d = StorageConfig::default();
        assert_eq!((d.task_size, d.bounce_size), (4 << 20, 2 << 20));
        assert_eq!(
            (d.pipeline, d.segment_size, d.segments, d.copy_streams),
            (Pipeline::Segments, 16 << 20, 6, 1)
        );
        let c = from_pairs(&[
            ("GPUDIRECT_PIPELINE", "lanes"),
            ("GPUDIRECT_SEGMENT_SIZE", "16M"),
            ("GPUDIRECT_SEGMENTS", "8"),
            ("GPUDIRECT_COPY_STREAMS", "2"),
        ])
        .unwrap();
        assert_eq!(
            (c.pipeline, c.segment_size, c.segments, c.copy_streams),
            (Pipeline::Lanes, 16 << 20, 8, 2)
        );
        let c = from_pairs(&[
            ("GPUDIRECT_COMPAT_MODE", "on"),
            ("GPUDIRECT_NTHREADS", "12"),
            ("GPUDIRECT_TASK_SIZE", "8M"),
            ("GPUDIRECT_BOUNCE_SIZE", "1000"),
            ("GPUDIRECT_ODIRECT", "off"),
            ("GPUDIRECT_ODIRECT_WRITE", "on"),
            ("GPUDIRECT_NUMA_PIN", "0"),
        ])
        .unwrap();
        assert_eq!(c.compat_mode, CompatMode::PosixOnly);
        assert_eq!(c.compat_source.as_deref(), Some("GPUDIRECT_COMPAT_MODE=on"));
        assert_eq!(c.threads, Some(12));
        assert_eq!(c.task_size, 8 << 20);
        assert_eq!(c.bounce_size, 4096, "rounded up to 4 KiB");
        assert_eq!(
            (c.odirect_read, c.odirect_write),
            (ODirect::Off, ODirect::On)
        );
        assert!(!c.numa_pin);
        assert!(from_pairs(&[("GPUDIRECT_NUMA_PIN", "OFF")]).is_ok_and(|c| !c.numa_pin));
    }

    #[test]
    fn environment_garbage_and_out_of_range_values_are_typed_errors() {
        for (var, val, expected) in [
            ("GPUDIRECT_COMPAT_MODE", "sometimes", "auto, on/posix_only"),
            ("GPUDIRECT_NTHREADS", "0", "1 to 1024"),
            ("GPUDIRECT_NTHREADS", "many", "1 to 1024"),
            ("GPUDIRECT_NTHREADS", "2000", "1 to 1024"),
            ("GPUDIRECT_TASK_SIZE", "4Q", "1G"),
            ("GPUDIRECT_TASK_SIZE", "2G", "1G"),
            ("GPUDIRECT_ODIRECT", "maybe", "auto, or on/off"),
            ("GPUDIRECT_ODIRECT_READ", "maybe", "auto, or on/off"),
            ("GPUDIRECT_NUMA_PIN", "2", "true"),
            ("GPUDIRECT_PIPELINE", "fast", "segments or lanes"),
            ("GPUDIRECT_SEGMENTS", "1", "2 to 64"),
            ("GPUDIRECT_SEGMENTS", "100", "2 to 64"),
            ("GPUDIRECT_COPY_STREAMS", "0", "1 to 16"),
            ("GPUDIRECT_SEGMENT_SIZE", "huge", "1G"),
        ] {
            match from_pairs(&[(var, val)]) {
                Err(e @ Error::InvalidEnvironment { variable, .. }) => {
                    assert_eq!(variable, var);
                    let m = e.to_string();
                    assert!(m.contains(val) && m.contains(expected), "{m}");
                }
                other => panic!("{var}={val}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_api_path_uses_the_same_ranges_without_clamping() {
        StorageConfig::default().validate().unwrap();
        for (c, setter) in [
            (
                StorageConfig {
                    segments: 100,
                    ..Default::default()
                },
                "segments",
            ),
            (
                StorageConfig {
                    segments: 1,
                    ..Default::default()
                },
                "segments",
            ),
            (
                StorageConfig {
                    copy_streams: 17,
                    ..Default::default()
                },
                "copy_streams",
            ),
            (
                StorageConfig {
                    threads: Some(0),
                    ..Default::default()
                },
                "threads",
            ),
            (
                StorageConfig {
                    task_size: usize::MAX,
                    ..Default::default()
                },
                "task_size",
            ),
            (
                StorageConfig {
                    bounce_size: 0,
                    ..Default::default()
                },
                "bounce_size",
            ),
        ] {
            match c.validate() {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(setter), "{m}"),
                other => panic!("{setter}: {other:?}"),
            }
        }
        let c = StorageConfig {
            task_size: 1000,
            ..Default::default()
        }
        .checked()
        .unwrap();
        assert_eq!(c.task_size, 4096);
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

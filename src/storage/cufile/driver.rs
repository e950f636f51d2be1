//! The process-wide cuFile driver: opened once, configured before opening, never closed, and
//! kept safe to tear down at process exit (see [`ExitStrategy`]).

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};

use crate::cuda::result as cu;

use cufile_sys as sys;

use super::result;
use super::status::{self, CuFileStatus};
use crate::error::{Error, Result};

bitflags::bitflags! {
    /// `nvfs.dstatusflags` (`CUfileDriverStatusFlags`): the storage kinds the nvidia-fs driver
    /// supports. Unknown bits of newer releases are kept.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct FsSupport: u32 {
        /// DDN Lustre (`CU_FILE_LUSTRE_SUPPORTED`).
        const LUSTRE = 1 << 0;
        /// WekaFS.
        const WEKAFS = 1 << 1;
        /// NFS.
        const NFS = 1 << 2;
        /// IBM Spectrum Scale (GPFS).
        const GPFS = 1 << 3;
        /// Local NVMe.
        const NVME = 1 << 4;
        /// NVMe over Fabrics.
        const NVMEOF = 1 << 5;
        /// SCSI.
        const SCSI = 1 << 6;
        /// ScaleFlux computational storage.
        const SCALEFLUX_CSD = 1 << 7;
        /// NVMesh block devices.
        const NVMESH = 1 << 8;
        /// BeeGFS.
        const BEEGFS = 1 << 9;
        /// NVMe through the kernel's PCI P2PDMA (deprecated in newer headers).
        const NVME_P2P = 1 << 11;
        /// ScaTeFS.
        const SCATEFS = 1 << 12;
        /// virtiofs (cuFile 1.19+).
        const VIRTIOFS = 1 << 13;
        /// PanFS (cuFile 1.19+).
        const PANFS = 1 << 14;
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// `nvfs.dcontrolflags` (`CUfileDriverControlFlags`): the driver's active controls.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct ControlFlags: u32 {
        /// `CU_FILE_USE_POLL_MODE`: small IOs poll instead of sleeping.
        const USE_POLL_MODE = 1 << 0;
        /// `CU_FILE_ALLOW_COMPAT_MODE`: cuFile may fall back to its POSIX path.
        const ALLOW_COMPAT_MODE = 1 << 1;
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// `fflags` (`CUfileFeatureFlags`): library features.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct FeatureFlags: u32 {
        /// Dynamic routing across PCIe bridges.
        const DYN_ROUTING = 1 << 0;
        /// Batch IO.
        const BATCH_IO = 1 << 1;
        /// Stream-ordered IO.
        const STREAMS = 1 << 2;
        /// Parallel IO.
        const PARALLEL_IO = 1 << 3;
        /// PCI P2PDMA (1.15+ headers).
        const P2P = 1 << 4;
        const _ = !0;
    }
}

/// `CUfileDrvProps_t`, decoded. Sizes are as cuFile reports them, in KiB; the `*_bytes`
/// accessors convert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverProperties {
    nvfs_major: u32,
    nvfs_minor: u32,
    poll_threshold_kb: usize,
    max_direct_io_kb: usize,
    fs_support: FsSupport,
    control: ControlFlags,
    features: FeatureFlags,
    max_device_cache_kb: u32,
    per_buffer_cache_kb: u32,
    max_device_pinned_mem_kb: u32,
    max_batch_io_size: u32,
    max_batch_io_timeout_ms: u32,
}

impl DriverProperties {
    /// Decodes the raw struct.
    pub fn from_raw(p: &sys::CUfileDrvProps_t) -> Self {
        DriverProperties {
            nvfs_major: p.nvfs.major_version,
            nvfs_minor: p.nvfs.minor_version,
            poll_threshold_kb: p.nvfs.poll_thresh_size,
            max_direct_io_kb: p.nvfs.max_direct_io_size,
            fs_support: FsSupport::from_bits_retain(p.nvfs.dstatusflags),
            control: ControlFlags::from_bits_retain(p.nvfs.dcontrolflags),
            features: FeatureFlags::from_bits_retain(p.fflags),
            max_device_cache_kb: p.max_device_cache_size,
            per_buffer_cache_kb: p.per_buffer_cache_size,
            max_device_pinned_mem_kb: p.max_device_pinned_mem_size,
            max_batch_io_size: p.max_batch_io_size,
            max_batch_io_timeout_ms: p.max_batch_io_timeout_msecs,
        }
    }

    /// The nvidia-fs kernel driver's version, `None` when it is not loaded (cuFile reports 0.0).
    pub fn nvfs_version(&self) -> Option<(u32, u32)> {
        self.nvfs_loaded()
            .then_some((self.nvfs_major, self.nvfs_minor))
    }

    /// True when the nvidia-fs kernel driver is loaded (version other than 0.0).
    pub fn nvfs_loaded(&self) -> bool {
        self.nvfs_major != 0 || self.nvfs_minor != 0
    }

    /// Storage kinds nvidia-fs supports (`nvfs.dstatusflags`).
    pub fn fs_support(&self) -> FsSupport {
        self.fs_support
    }

    /// Active controls (`nvfs.dcontrolflags`).
    pub fn control(&self) -> ControlFlags {
        self.control
    }

    /// Library features (`fflags`).
    pub fn features(&self) -> FeatureFlags {
        self.features
    }

    /// True when cuFile may use its compatibility (POSIX) path.
    pub fn compat_mode_allowed(&self) -> bool {
        self.control.contains(ControlFlags::ALLOW_COMPAT_MODE)
    }

    /// Poll-mode threshold in KiB (`nvfs.poll_thresh_size`).
    pub fn poll_threshold_kb(&self) -> usize {
        self.poll_threshold_kb
    }

    /// Largest request sent to nvidia-fs, in KiB (`nvfs.max_direct_io_size`).
    pub fn max_direct_io_kb(&self) -> usize {
        self.max_direct_io_kb
    }

    /// Largest request sent to nvidia-fs, in bytes.
    pub fn max_direct_io_bytes(&self) -> usize {
        self.max_direct_io_kb.saturating_mul(1024)
    }

    /// Per-GPU device memory for cuFile's bounce buffers, in KiB.
    pub fn max_device_cache_kb(&self) -> u32 {
        self.max_device_cache_kb
    }

    /// Size of one bounce buffer, in KiB.
    pub fn per_buffer_cache_kb(&self) -> u32 {
        self.per_buffer_cache_kb
    }

    /// Budget of pinned GPU memory for `cuFileBufRegister`, in KiB.
    pub fn max_device_pinned_mem_kb(&self) -> u32 {
        self.max_device_pinned_mem_kb
    }

    /// Budget of pinned GPU memory for `cuFileBufRegister`, in bytes.
    pub fn max_device_pinned_mem_bytes(&self) -> u64 {
        u64::from(self.max_device_pinned_mem_kb) * 1024
    }

    /// Largest batch (`cuFileBatchIOSetUp`'s `nr`).
    pub fn max_batch_io_size(&self) -> u32 {
        self.max_batch_io_size
    }

    /// Batch IO timeout in milliseconds.
    pub fn max_batch_io_timeout_ms(&self) -> u32 {
        self.max_batch_io_timeout_ms
    }
}

/// Where cuFile writes its log.
///
/// cuFile 1.15 takes its log's place from two sources only, both read when the driver opens:
/// the `CUFILE_LOGFILE_PATH` environment variable (a file), else `"logging": {"dir": ...}` of
/// the `cufile.json` it reads (`/etc/cufile.json`, or `CUFILE_ENV_PATH_JSON`; the file is then
/// `cufile_<pid>_<date>.<time>.log` there), else `cufile.log` in the working directory. The
/// log-directory parameter (`CUFILE_PARAM_LOG_DIR` through `cuFileSetParameterString`) is
/// accepted before `cuFileDriverOpen` and then ignored: cuFile opens its log before it applies
/// staged parameters, so gpudirect does not use it ([CONTRIBUTING.md, "cuFile
/// quirks"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cufile-quirks)).
///
/// A program may change its environment only while no other thread runs (C code on other
/// threads — libcuda, NVML, cuFile's own — calls `getenv` without Rust's lock). So gpudirect
/// sets `CUFILE_LOGFILE_PATH` only when the driver opens in a process with a single thread;
/// with other threads running, the log goes where cuFile puts it by itself, and
/// [`Driver::log_file`] says where that is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// The default: `CUFILE_LOGFILE_PATH` if the user set it; else, when the process has one
    /// thread at open, the file `gpudirect-cufile-<pid>.log` in the temporary directory; else
    /// cuFile's own place (the `cufile.json` log directory, or `cufile.log` in the working
    /// directory), reported by [`Driver::log_file`].
    TempDir,
    /// This file. Needs the process to have a single thread when the driver opens (the file
    /// can only be named through the environment); otherwise opening the driver fails with
    /// [`Error::Unsupported`] saying what to do.
    File(PathBuf),
    /// `cufile.log` in this directory, with the same condition and refusal as
    /// [`LogTarget::File`] (cuFile takes a directory only from its `cufile.json`).
    Dir(PathBuf),
    /// Whatever cuFile does on its own, reported by [`Driver::log_file`].
    CuFileDefault,
}

/// The environment variable that chooses the [`ExitStrategy`] when the builder does not:
/// `retain-ctx` (the default), `close-at-exit` or `none`.
pub const EXIT_STRATEGY_ENV: &str = "GPUDIRECT_CUFILE_EXIT_STRATEGY";

/// What gpudirect does so that a process that used cuFile exits cleanly.
///
/// cuFile tears itself down at process exit and calls into CUDA as it does, so the contexts it
/// adopted must still be alive then; cudarc releases a primary context when its last
/// `Arc<CudaContext>` drops. The evidence (a segfault after every test had passed, and the
/// experiment that explains it): [CONTRIBUTING.md, "cuFile at process
/// exit"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cufile-at-process-exit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExitStrategy {
    /// The default. The driver keeps a reference (`Arc<CudaContext>`, i.e. a retained primary
    /// context) to the context that was current when it opened and to every context whose memory
    /// went through cuFile, for the life of the process: they are never released, so cuFile's
    /// teardown at exit finds them alive. Costs nothing but the contexts staying resident until
    /// exit, which cuFile needs anyway. A non-primary context (`cuCtxCreate`) current at open
    /// cannot be retained this way: keep it alive yourself, or open the driver first.
    ///
    /// Once cuFile's statistics are turned on ([`Stats::start`](super::Stats::start)) the
    /// driver is also closed from an `atexit` handler, as with [`CloseAtExit`](Self::CloseAtExit):
    /// a process with statistics on crashes at exit when the driver stays open (the evidence is
    /// in the section linked above).
    #[default]
    RetainContexts,
    /// [`RetainContexts`](Self::RetainContexts), plus an `atexit` handler, registered right after
    /// `cuFileDriverOpen`, that calls `cuFileDriverClose_v2` before libcuda's own exit handlers
    /// run. Experimental: IO still running on other threads at exit then fails with
    /// `CU_FILE_DRIVER_CLOSING`.
    CloseAtExit,
    /// Neither; for experiments and comparisons only (`examples/cufile-exit.rs`).
    Nothing,
}

impl std::str::FromStr for ExitStrategy {
    type Err = crate::ParseValueError;
    /// Parses the values of [`EXIT_STRATEGY_ENV`]: `retain-ctx` (also `retain`, `default`),
    /// `close-at-exit`, `none` (any case).
    fn from_str(s: &str) -> std::result::Result<Self, crate::ParseValueError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "retain-ctx" | "retain" | "default" | "" => Ok(ExitStrategy::RetainContexts),
            "close-at-exit" => Ok(ExitStrategy::CloseAtExit),
            "none" => Ok(ExitStrategy::Nothing),
            _ => Err(crate::ParseValueError::new(
                s,
                "retain-ctx, close-at-exit or none",
            )),
        }
    }
}

impl ExitStrategy {
    /// Parses the values of [`EXIT_STRATEGY_ENV`]: `retain-ctx`, `close-at-exit`, `none`.
    #[deprecated(note = "use str::parse (FromStr), whose error lists the spellings")]
    pub fn parse(s: &str) -> Option<ExitStrategy> {
        s.parse().ok()
    }

    /// The strategy [`EXIT_STRATEGY_ENV`] names (read once per process; the default when
    /// unset); an unknown value is [`Error::InvalidEnvironment`].
    pub fn from_env() -> Result<ExitStrategy> {
        Ok(crate::env::Env::process()
            .var::<ExitStrategy>(EXIT_STRATEGY_ENV)?
            .unwrap_or_default())
    }

    fn retains(self) -> bool {
        self != ExitStrategy::Nothing
    }
}

/// One setting staged by the builder, applied before `cuFileDriverOpen`.
#[derive(Debug, Clone)]
enum Setting {
    PollMode { poll: bool, threshold_kb: usize },
    MaxDirectIoKb(usize),
    MaxCacheKb(usize),
    MaxPinnedMemKb(usize),
    SizeT { param: u32, value: usize },
    Bool { param: u32, value: bool },
    Str { param: u32, value: String },
}

impl Setting {
    fn name(&self) -> &'static str {
        match self {
            Setting::PollMode { .. } => "poll mode (cuFileDriverSetPollMode)",
            Setting::MaxDirectIoKb(_) => "max direct io size (cuFileDriverSetMaxDirectIOSize)",
            Setting::MaxCacheKb(_) => "max cache size (cuFileDriverSetMaxCacheSize)",
            Setting::MaxPinnedMemKb(_) => "max pinned memory (cuFileDriverSetMaxPinnedMemSize)",
            Setting::SizeT { .. } => "a size parameter (cuFileSetParameterSizeT)",
            Setting::Bool { .. } => "a bool parameter (cuFileSetParameterBool)",
            Setting::Str { .. } => "a string parameter (cuFileSetParameterString)",
        }
    }

    fn apply(&self, lib: &sys::Library) -> Result<()> {
        match self {
            Setting::PollMode { poll, threshold_kb } => {
                result::driver_set_poll_mode(lib, *poll, *threshold_kb)
            }
            Setting::MaxDirectIoKb(kb) => result::driver_set_max_direct_io_size(lib, *kb),
            Setting::MaxCacheKb(kb) => result::driver_set_max_cache_size(lib, *kb),
            Setting::MaxPinnedMemKb(kb) => result::driver_set_max_pinned_mem_size(lib, *kb),
            Setting::SizeT { param, value } => result::set_parameter_size_t(lib, *param, *value),
            Setting::Bool { param, value } => result::set_parameter_bool(lib, *param, *value),
            Setting::Str { param, value } => {
                result::set_parameter_string(lib, *param, &result::c_string("parameter", value)?)
            }
        }
    }
}

const TOO_LATE_HINT: &str =
    "configure the driver with Driver::builder() before anything opens it (the first Driver::open or cuFile call)";

/// Settings cuFile honours only before its driver opens (`Driver::builder()`).
#[derive(Debug, Clone)]
#[must_use]
pub struct DriverBuilder {
    settings: Vec<Setting>,
    log: LogTarget,
    force_compat: bool,
    exit: Option<ExitStrategy>,
}

impl Default for DriverBuilder {
    fn default() -> Self {
        DriverBuilder {
            settings: Vec::new(),
            log: LogTarget::TempDir,
            force_compat: false,
            exit: None,
        }
    }
}

impl DriverBuilder {
    /// Poll (instead of sleeping) for IOs up to `threshold_kb` KiB (`cuFileDriverSetPollMode`).
    pub fn poll_mode(mut self, poll: bool, threshold_kb: usize) -> Self {
        self.settings.push(Setting::PollMode { poll, threshold_kb });
        self
    }

    /// Largest request sent to nvidia-fs, in KiB (`cuFileDriverSetMaxDirectIOSize`).
    pub fn max_direct_io_size_kb(mut self, kb: usize) -> Self {
        self.settings.push(Setting::MaxDirectIoKb(kb));
        self
    }

    /// Per-GPU bounce-buffer memory, in KiB (`cuFileDriverSetMaxCacheSize`).
    pub fn max_cache_size_kb(mut self, kb: usize) -> Self {
        self.settings.push(Setting::MaxCacheKb(kb));
        self
    }

    /// Budget of pinned GPU memory for registered buffers, in KiB
    /// (`cuFileDriverSetMaxPinnedMemSize`).
    pub fn max_pinned_mem_size_kb(mut self, kb: usize) -> Self {
        self.settings.push(Setting::MaxPinnedMemKb(kb));
        self
    }

    /// Any `size_t` parameter (`cuFileSetParameterSizeT`, cuFile 1.14+), e.g.
    /// `cufile_sys::CUFILE_PARAM_EXECUTION_MAX_IO_THREADS`.
    pub fn parameter_size_t(
        mut self,
        param: sys::CUFileSizeTConfigParameter_t,
        value: usize,
    ) -> Self {
        self.settings.push(Setting::SizeT { param, value });
        self
    }

    /// Any `bool` parameter (`cuFileSetParameterBool`, cuFile 1.14+), e.g.
    /// `cufile_sys::CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE`.
    pub fn parameter_bool(mut self, param: sys::CUFileBoolConfigParameter_t, value: bool) -> Self {
        if param == sys::CUFILE_PARAM_FORCE_COMPAT_MODE {
            self.force_compat = value;
        }
        self.settings.push(Setting::Bool { param, value });
        self
    }

    /// Any string parameter (`cuFileSetParameterString`, cuFile 1.14+), e.g.
    /// `cufile_sys::CUFILE_PARAM_LOGGING_LEVEL`.
    pub fn parameter_string(
        mut self,
        param: sys::CUFileStringConfigParameter_t,
        value: impl Into<String>,
    ) -> Self {
        self.settings.push(Setting::Str {
            param,
            value: value.into(),
        });
        self
    }

    /// Sends all IO through cuFile's compatibility (POSIX) path
    /// (`CUFILE_PARAM_FORCE_COMPAT_MODE`).
    pub fn force_compat_mode(self, on: bool) -> Self {
        self.parameter_bool(sys::CUFILE_PARAM_FORCE_COMPAT_MODE, on)
    }

    /// Where cuFile's log goes (default: [`LogTarget::TempDir`], never the working directory).
    pub fn log(mut self, target: LogTarget) -> Self {
        self.log = target;
        self
    }

    /// How the process stays safe at exit (default: `$GPUDIRECT_CUFILE_EXIT_STRATEGY`, else
    /// [`ExitStrategy::RetainContexts`]). Like every setting, it applies only when this call
    /// opens the driver.
    pub fn exit_strategy(mut self, strategy: ExitStrategy) -> Self {
        self.exit = Some(strategy);
        self
    }

    /// True when the builder stages any driver setting (the log target is not one: it applies
    /// only when this call opens the driver, and is ignored otherwise, like the exit strategy).
    fn has_settings(&self) -> bool {
        !self.settings.is_empty()
    }

    /// Opens the driver with these settings (`cuFileDriverOpen`), or returns the process's open
    /// driver when there are no settings. Settings given after the driver is open are
    /// [`Error::TooLate`], never silently ignored.
    ///
    /// Before any call into cuFile's driver this checks, through [`crate::cuda`], that libcuda
    /// loads and a CUDA device exists; without them it returns that typed error and does not
    /// call `cuFileDriverOpen` (cuFile 1.15 would write `cufile.log` into the working directory
    /// and fail with 5033; 1.20 spins at 100% CPU).
    pub fn open(self) -> Result<Arc<Driver>> {
        let mut slot = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = slot.as_ref() {
            if let Some(s) = self.settings.first() {
                return Err(Error::TooLate {
                    setting: s.name(),
                    before: "cuFileDriverOpen",
                    hint: TOO_LATE_HINT,
                });
            }
            return Ok(Arc::clone(d));
        }
        let lib = result::lib()?;
        let version = result::get_version(lib)?;
        status::set_loaded_version(version);
        // Our check, before anything that needs libcuda.
        crate::cuda::device_count()?;
        let exit = match self.exit {
            Some(e) => e,
            None => ExitStrategy::from_env()?,
        };

        if self.has_settings() && result::use_count(lib).unwrap_or(0) > 0 {
            return Err(Error::TooLate {
                setting: self.settings[0].name(),
                before: "cuFileDriverOpen",
                hint: TOO_LATE_HINT,
            });
        }
        // Decided (and refused, if it must be) before any setting reaches cuFile.
        let log_plan = plan_log(
            &self.log,
            process_is_single_threaded(),
            super::env::logfile(),
        )?;
        if let LogPlan::SetEnv(path) = &log_plan {
            // The process runs this one thread (checked just now), so nothing reads the
            // environment meanwhile, and no thread can start but through this one.
            std::env::set_var(super::env::LOGFILE, OsString::from(path.as_os_str()));
        }
        for s in &self.settings {
            s.apply(lib).map_err(|e| match e {
                Error::CuFile { source, .. }
                    if source.code() == CuFileStatus::DRIVER_ALREADY_OPEN =>
                {
                    Error::TooLate {
                        setting: s.name(),
                        before: "cuFileDriverOpen",
                        hint: TOO_LATE_HINT,
                    }
                }
                other => other,
            })?;
        }
        // The context cuFile will adopt at open (the thread's current one), retained first so
        // that it outlives cuFile's exit-time teardown.
        let mut retained = Vec::new();
        if exit.retains() {
            retained.extend(retain_current_primary_context());
        }
        // SAFETY: crate::cuda::device_count() succeeded above: libcuda loads and a device exists.
        unsafe { result::driver_open(lib) }?;
        if exit == ExitStrategy::CloseAtExit {
            register_close_at_exit();
        }
        let log_file = match log_plan {
            LogPlan::SetEnv(p) | LogPlan::Known(p) => Some(p),
            LogPlan::CuFileDefault => cufile_default_log(),
        };
        // SAFETY: as above.
        let raw = unsafe { result::driver_get_properties(lib) }?;

        let force_compat = self.force_compat || super::env::force_compat();
        let p2pdma =
            result::get_parameter_bool(lib, sys::CUFILE_PARAM_USE_PCIP2PDMA).unwrap_or(false);
        let driver = Arc::new(Driver {
            lib,
            version,
            properties: DriverProperties::from_raw(&raw),
            force_compat,
            p2pdma,
            log_file,
            exit,
            retained: Mutex::new(retained),
        });
        *slot = Some(Arc::clone(&driver));
        Ok(driver)
    }
}

/// True when this process runs exactly one thread (the caller), counted in `/proc/self/task`;
/// false when it cannot tell. With one thread, nothing can read the environment while this
/// thread changes it, and no other thread can start meanwhile but through this one.
fn process_is_single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|d| d.take(2).count() == 1)
}

/// What the driver's open does about cuFile's log.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LogPlan {
    /// Set `CUFILE_LOGFILE_PATH` to this file first (only ever planned for a single-threaded
    /// process).
    SetEnv(PathBuf),
    /// It goes to this file without gpudirect doing anything (the user's variable).
    Known(PathBuf),
    /// It goes where cuFile puts it by itself; found after the open ([`cufile_default_log`]).
    CuFileDefault,
}

/// Decides where cuFile's log goes for `target` (see [`LogTarget`]). Never plans to change the
/// environment unless `single_threaded`; a target that needs it is refused otherwise.
fn plan_log(target: &LogTarget, single_threaded: bool, user: Option<PathBuf>) -> Result<LogPlan> {
    let needs_env = |what: String| Error::Unsupported {
        what,
        cause: crate::Cause::Other {
            message: "cuFile takes its log's place only from CUFILE_LOGFILE_PATH or from its \
                      cufile.json (it ignores the log-directory parameter), and changing the \
                      environment while other threads run is undefined behaviour"
                .into(),
            fix: "set CUFILE_LOGFILE_PATH (or logging.dir in the cufile.json cuFile reads) \
                  before the program starts threads, open the driver before starting any, or \
                  use LogTarget::TempDir, which then reports where cuFile logs"
                .into(),
        },
    };
    Ok(match target {
        LogTarget::CuFileDefault => user.map_or(LogPlan::CuFileDefault, LogPlan::Known),
        LogTarget::File(p) if single_threaded => LogPlan::SetEnv(p.clone()),
        LogTarget::File(p) => return Err(needs_env(format!("cuFile's log in {}", p.display()))),
        LogTarget::Dir(d) if single_threaded => LogPlan::SetEnv(d.join("cufile.log")),
        LogTarget::Dir(d) => {
            return Err(needs_env(format!(
                "cuFile's log in the directory {}",
                d.display()
            )))
        }
        LogTarget::TempDir => match user {
            Some(u) => LogPlan::Known(u),
            None if single_threaded => LogPlan::SetEnv(
                std::env::temp_dir().join(format!("gpudirect-cufile-{}.log", std::process::id())),
            ),
            None => {
                tracing::debug!(
                    "other threads run: cuFile's log goes where cuFile puts it (Driver::log_file \
                     says where); set CUFILE_LOGFILE_PATH before starting threads to choose"
                );
                LogPlan::CuFileDefault
            }
        },
    })
}

/// Where cuFile 1.15 put its log by itself, after `cuFileDriverOpen`: `CUFILE_LOGFILE_PATH`;
/// else the newest `cufile_<pid>_*.log` in the `logging.dir` of the `cufile.json` it read
/// (`None` when there is none yet); else `cufile.log` in the working directory.
fn cufile_default_log() -> Option<PathBuf> {
    if let Some(p) = super::env::logfile() {
        return Some(p);
    }
    let json_dir = super::config_file()
        .and_then(|c| std::fs::read_to_string(&c.path).ok())
        .and_then(|s| json_logging_dir(&s));
    if let Some(dir) = json_dir {
        let prefix = format!("cufile_{}_", std::process::id());
        return std::fs::read_dir(&dir)
            .ok()?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with(&prefix) && n.ends_with(".log")
            })
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
            .map(|e| e.path());
    }
    std::env::current_dir().ok().map(|d| d.join("cufile.log"))
}

/// The `"dir"` of the `"logging"` object of a `cufile.json` (which allows `//` comments), when
/// set and not empty.
fn json_logging_dir(json: &str) -> Option<PathBuf> {
    let text: String = json
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let after = &text[text.find("\"logging\"")? + "\"logging\"".len()..];
    let body = after
        .trim_start()
        .strip_prefix(':')?
        .trim_start()
        .strip_prefix('{')?;
    let body = &body[..body.find('}')?];
    let rest = &body[body.find("\"dir\"")? + "\"dir\"".len()..];
    let value = rest
        .trim_start()
        .strip_prefix(':')?
        .trim_start()
        .strip_prefix('"')?;
    let value = &value[..value.find('"')?];
    (!value.is_empty()).then(|| PathBuf::from(value))
}

/// A retained reference to the primary context of the device whose context is current on this
/// thread, when that current context *is* the primary one (`None` when no context is current,
/// or for a non-primary context, which cannot be retained through cudarc). The thread's current
/// context is left as it was.
fn retain_current_primary_context() -> Option<Arc<CudaContext>> {
    // crate::cuda::device_count() succeeded, so libcuda is loaded and initialised.
    let cur = cu::ctx::current()?;
    // SAFETY: a context is current (`cur`).
    let dev = unsafe { cu::ctx::device() }.ok()?;
    let n = crate::cuda::device_count().ok()?;
    let ordinal = (0..n).find(|&i| cu::device::get(i).is_ok_and(|d| d == dev))?;
    // cudarc retains the primary context and binds it to this thread; put the caller's back.
    let ctx = crate::cuda::context(ordinal).ok();
    // SAFETY: `cur` was current a moment ago and is still alive (its owner holds it).
    unsafe { cu::ctx::set_current(cur) };
    let ctx = ctx?;
    if ctx.cu_ctx() != cur {
        tracing::debug!(
            "the context current at cuFileDriverOpen is not device {ordinal}'s primary context; \
             gpudirect cannot retain it: keep it alive for the life of the process"
        );
        return None;
    }
    Some(ctx)
}

extern "C" fn close_driver_at_exit() {
    // Runs from exit(), before the handlers libcuda registered earlier (at cuInit). The Driver
    // and the contexts it retained are never dropped, so they are still alive here.
    if let Ok(lib) = sys::library() {
        if let Some(close) = lib.cuFileDriverClose_v2 {
            // SAFETY: the driver was opened by this process (the handler is registered only after
            // cuFileDriverOpen succeeded) and libcuda has not been torn down yet (see above).
            let _ = unsafe { close() };
        }
    }
}

pub(super) fn register_close_at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `close_driver_at_exit` is a plain `extern "C" fn()` that never unwinds.
        if unsafe { libc::atexit(close_driver_at_exit) } != 0 {
            tracing::warn!(
                "atexit refused the cuFile close handler; the driver stays open at exit"
            );
        }
    });
}

static DRIVER: Mutex<Option<Arc<Driver>>> = Mutex::new(None);

/// The open cuFile driver of this process.
///
/// There is one per process, shared through `Arc`; every [`CuFileHandle`](super::CuFileHandle)
/// and [`RegisteredBuffer`](super::RegisteredBuffer) holds it.
///
/// **The driver is never closed** — not in `Drop`, not at exit. `cuFileDriverClose` calls into
/// CUDA, and at process exit CUDA may already be torn down: KvikIO and cuDF segfaulted that way
/// (rapidsai/kvikio#159, #497; NVIDIA/cudf#17121) and now deliberately leak the driver, as
/// gpudirect does. The operating system reclaims everything at exit.
///
/// **Exit safety.** Not closing is not enough: libcufile's own static destructors still tear
/// the driver down at exit and call CUDA on the contexts it adopted. So, by default
/// ([`ExitStrategy::RetainContexts`]), the driver also holds a reference to the context current
/// when it opened and to the context of every buffer that went through cuFile (registration,
/// sync, stream-ordered, batch and vectored IO), and never releases them: the `Driver` lives in
/// a static that is never dropped, and the libcufile `Library` handle likewise (it is never
/// `dlclose`d). A user's own `CudaContext`s may therefore drop at any time. Choose another
/// strategy with [`DriverBuilder::exit_strategy`] or `GPUDIRECT_CUFILE_EXIT_STRATEGY`
/// (`examples/cufile-exit.rs` compares them).
///
/// `fork()` after the driver is open is undefined behaviour in the child (cuFile's API
/// reference).
#[derive(Debug)]
pub struct Driver {
    lib: &'static sys::Library,
    version: i32,
    properties: DriverProperties,
    force_compat: bool,
    p2pdma: bool,
    log_file: Option<PathBuf>,
    exit: ExitStrategy,
    /// Contexts kept alive for cuFile's exit-time teardown; never released (see above).
    retained: Mutex<Vec<Arc<CudaContext>>>,
}

impl Driver {
    /// Settings for the driver, applied before it opens.
    pub fn builder() -> DriverBuilder {
        DriverBuilder::default()
    }

    /// The process's driver, opened on first call (`cuFileDriverOpen`) with default settings;
    /// idempotent. See [`DriverBuilder::open`] for the checks made first.
    pub fn open() -> Result<Arc<Driver>> {
        DriverBuilder::default().open()
    }

    /// The already open driver, if any (never opens).
    pub fn get() -> Option<Arc<Driver>> {
        DRIVER.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The driver's properties as read right after opening (`cuFileDriverGetProperties`).
    pub fn properties(&self) -> &DriverProperties {
        &self.properties
    }

    /// The library's version, `1000*major + 10*minor` (`cuFileGetVersion`; 1150 for 1.15).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// True when the nvidia-fs kernel driver is loaded.
    pub fn nvfs_loaded(&self) -> bool {
        self.properties.nvfs_loaded()
    }

    /// True when cuFile is configured to use the kernel's PCI P2PDMA
    /// (`CUFILE_PARAM_USE_PCIP2PDMA`), a GPUDirect path without nvidia-fs.
    pub fn p2pdma_enabled(&self) -> bool {
        self.p2pdma
    }

    /// True when compatibility mode was forced (builder or `CUFILE_FORCE_COMPAT_MODE`).
    pub fn compat_forced(&self) -> bool {
        self.force_compat
    }

    /// Where cuFile writes its log (see [`LogTarget`]): the file gpudirect named through
    /// `CUFILE_LOGFILE_PATH` (a single-threaded open), the user's `CUFILE_LOGFILE_PATH`, or
    /// the place cuFile chose itself — its `cufile.json` log directory's
    /// `cufile_<pid>_*.log`, else `cufile.log` in the working directory at open. `None` when
    /// cuFile logs into a `cufile.json` directory that holds no file of this process (yet).
    pub fn log_file(&self) -> Option<&std::path::Path> {
        self.log_file.as_deref()
    }

    /// The driver's use count in this process (`cuFileUseCount`).
    pub fn use_count(&self) -> Result<i64> {
        result::use_count(self.lib)
    }

    /// Reads the properties again (`cuFileDriverGetProperties`).
    pub fn refresh_properties(&self) -> Result<DriverProperties> {
        // SAFETY: the driver is open, so libcuda was checked before.
        let raw = unsafe { result::driver_get_properties(self.lib) }?;
        Ok(DriverProperties::from_raw(&raw))
    }

    /// A `size_t` parameter's live value (`cuFileGetParameterSizeT`, 1.14+).
    pub fn parameter_size_t(&self, param: sys::CUFileSizeTConfigParameter_t) -> Result<usize> {
        result::get_parameter_size_t(self.lib, param)
    }

    /// A `bool` parameter's live value (`cuFileGetParameterBool`, 1.14+).
    pub fn parameter_bool(&self, param: sys::CUFileBoolConfigParameter_t) -> Result<bool> {
        result::get_parameter_bool(self.lib, param)
    }

    /// A string parameter's live value (`cuFileGetParameterString`, 1.14+).
    pub fn parameter_string(&self, param: sys::CUFileStringConfigParameter_t) -> Result<String> {
        result::get_parameter_string(self.lib, param)
    }

    /// The settable range of a `size_t` parameter (`cuFileGetParameterMinMaxValue`, 1.15+).
    pub fn parameter_range(
        &self,
        param: sys::CUFileSizeTConfigParameter_t,
    ) -> Result<(usize, usize)> {
        result::get_parameter_min_max(self.lib, param)
    }

    /// The BAR1 size of GPU `ordinal` in KiB (`cuFileGetBARSizeInKB`, 1.15+).
    pub fn bar_size_kb(&self, ordinal: usize) -> Result<usize> {
        result::get_bar_size_kb(self.lib, ordinal as i32)
    }

    /// True when the loaded library exports `symbol` (e.g. `"cuFileReadv"`).
    pub fn has_symbol(&self, symbol: &str) -> bool {
        !self.lib.missing_symbols().contains(&symbol)
    }

    pub(in crate::storage) fn lib(&self) -> &'static sys::Library {
        self.lib
    }

    /// The exit strategy this driver opened with.
    pub fn exit_strategy(&self) -> ExitStrategy {
        self.exit
    }

    /// How many distinct CUDA contexts the driver keeps alive for exit (see
    /// [`ExitStrategy::RetainContexts`]).
    pub fn retained_contexts(&self) -> usize {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Prepares `stream`'s memory to be handed to cuFile: retains the stream's context (see
    /// [`Driver::retain_context`]), makes it current (cuFile needs a valid context) and, when
    /// `synchronize` is set, waits for the stream's pending work (cuFile is ordered with no
    /// stream).
    pub(in crate::storage) fn enter(&self, stream: &CudaStream, synchronize: bool) -> Result<()> {
        self.retain_context(stream.context());
        crate::cuda::bind(stream.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        if synchronize {
            // Through the result layer: cudarc's synchronize returns (and takes) an error
            // stored in the caller's object without synchronizing.
            crate::cuda::settle::synchronize(stream)?;
        }
        Ok(())
    }

    /// Keeps `ctx` alive for the life of the process (once per context), unless the strategy is
    /// [`ExitStrategy::Nothing`]. Called by every operation that hands cuFile device memory.
    pub(in crate::storage) fn retain_context(&self, ctx: &Arc<CudaContext>) {
        if !self.exit.retains() {
            return;
        }
        let mut v = self.retained.lock().unwrap_or_else(|p| p.into_inner());
        if !v.iter().any(|c| c.cu_ctx() == ctx.cu_ctx()) {
            v.push(Arc::clone(ctx));
        }
    }
}

/// The loaded libcufile's version (`cuFileGetVersion`, `1000*major + 10*minor`) without opening
/// the driver; needs neither libcuda nor a GPU.
pub fn library_version() -> Result<i32> {
    let lib = result::lib()?;
    let v = result::get_version(lib)?;
    status::set_loaded_version(v);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `set_var` while other threads run races with C code calling `getenv` (libcuda, NVML,
    /// cuFile's threads): with other threads the plan never changes the environment; a target
    /// only the environment can reach is refused, typed, saying what to do.
    #[test]
    fn log_plan_never_sets_the_environment_while_other_threads_run() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || rx.recv());
        let single = process_is_single_threaded();
        tx.send(()).unwrap();
        other.join().unwrap().unwrap();
        assert!(!single, "another thread was running");
        let file = PathBuf::from("/some/dir/x.log");
        let dir = PathBuf::from("/some/dir");
        let user = PathBuf::from("/user/chose.log");
        for t in [
            LogTarget::TempDir,
            LogTarget::CuFileDefault,
            LogTarget::File(file.clone()),
            LogTarget::Dir(dir.clone()),
        ] {
            for u in [None, Some(user.clone())] {
                match plan_log(&t, false, u.clone()) {
                    Ok(LogPlan::SetEnv(p)) => {
                        panic!(
                            "{t:?}: plans to set CUFILE_LOGFILE_PATH={} with threads",
                            p.display()
                        )
                    }
                    Ok(LogPlan::Known(p)) => assert_eq!(Some(p), u, "{t:?}"),
                    Ok(LogPlan::CuFileDefault) => {
                        assert!(u.is_none(), "{t:?}: the user's variable is where it goes");
                        assert!(matches!(t, LogTarget::TempDir | LogTarget::CuFileDefault));
                    }
                    Err(Error::Unsupported { cause, .. }) => {
                        assert!(matches!(t, LogTarget::File(_) | LogTarget::Dir(_)), "{t:?}");
                        let c = cause.to_string();
                        assert!(
                            c.contains("CUFILE_LOGFILE_PATH") && c.contains("cufile.json"),
                            "{c}"
                        );
                    }
                    Err(e) => panic!("{t:?}: {e}"),
                }
            }
        }
        // A single thread: the environment names the file, unless the user's variable does.
        assert_eq!(
            plan_log(&LogTarget::File(file.clone()), true, None).unwrap(),
            LogPlan::SetEnv(file)
        );
        assert_eq!(
            plan_log(&LogTarget::Dir(dir), true, None).unwrap(),
            LogPlan::SetEnv(PathBuf::from("/some/dir/cufile.log"))
        );
        match plan_log(&LogTarget::TempDir, true, None).unwrap() {
            LogPlan::SetEnv(p) => assert!(p.starts_with(std::env::temp_dir()), "{}", p.display()),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            plan_log(&LogTarget::TempDir, true, Some(user.clone())).unwrap(),
            LogPlan::Known(user)
        );
    }

    #[test]
    fn cufile_json_logging_dir_is_found_outside_comments() {
        let j = r#"{
            // "logging": { "dir": "/commented/out" },
            "logging": {
                // "dir": "/home/<xxxx>",
                "dir": "/var/log/cufile",
                "level": "ERROR"
            },
            "profile": { "dir": "/not/this" }
        }"#;
        assert_eq!(json_logging_dir(j), Some(PathBuf::from("/var/log/cufile")));
        // NVIDIA's default cufile.json: the directory is commented out.
        let default = r#"{ "logging": {
                // log directory, if not enabled will create log file under current working directory
                //"dir": "/home/<xxxx>",
                // NOTICE|ERROR|WARN|INFO|DEBUG|TRACE (in decreasing order of severity)
                "level": "ERROR"
            }, "profile": { "nvtx": false } }"#;
        assert_eq!(json_logging_dir(default), None);
        assert_eq!(json_logging_dir(r#"{"logging": {"dir": ""}}"#), None);
        assert_eq!(json_logging_dir("{}"), None);
        assert_eq!(json_logging_dir("not json at all"), None);
    }

    #[test]
    fn exit_strategy_parses_and_defaults_to_retaining() {
        assert_eq!(ExitStrategy::default(), ExitStrategy::RetainContexts);
        assert_eq!("retain-ctx".parse(), Ok(ExitStrategy::RetainContexts));
        assert_eq!(" Close-At-Exit ".parse(), Ok(ExitStrategy::CloseAtExit));
        assert_eq!("none".parse(), Ok(ExitStrategy::Nothing));
        let e = "leak".parse::<ExitStrategy>().unwrap_err();
        assert!(
            e.to_string().contains("retain-ctx, close-at-exit or none"),
            "{e}"
        );
        assert!(ExitStrategy::RetainContexts.retains() && ExitStrategy::CloseAtExit.retains());
        assert!(!ExitStrategy::Nothing.retains());
    }

    #[test]
    fn properties_decode_flags_and_units() {
        // SAFETY: all-zero is a valid CUfileDrvProps_t.
        let mut raw: sys::CUfileDrvProps_t = unsafe { std::mem::zeroed() };
        let p = DriverProperties::from_raw(&raw);
        assert!(!p.nvfs_loaded());
        assert_eq!(p.nvfs_version(), None);
        raw.nvfs.major_version = 2;
        raw.nvfs.minor_version = 26;
        raw.nvfs.max_direct_io_size = 16384;
        raw.nvfs.dstatusflags = (1 << 4) | (1 << 2) | (1 << 20);
        raw.nvfs.dcontrolflags = 0b10;
        raw.fflags = 0b110;
        raw.max_device_pinned_mem_size = 33_554_432;
        raw.max_batch_io_size = 128;
        let p = DriverProperties::from_raw(&raw);
        assert_eq!(p.nvfs_version(), Some((2, 26)));
        assert!(p.fs_support().contains(FsSupport::NVME | FsSupport::NFS));
        assert_eq!(
            p.fs_support().bits() & (1 << 20),
            1 << 20,
            "unknown bits are kept"
        );
        assert!(p.compat_mode_allowed());
        assert!(!p.control().contains(ControlFlags::USE_POLL_MODE));
        assert!(p
            .features()
            .contains(FeatureFlags::BATCH_IO | FeatureFlags::STREAMS));
        assert_eq!(p.max_direct_io_bytes(), 16 << 20);
        assert_eq!(p.max_device_pinned_mem_bytes(), 32 << 30);
        assert_eq!(p.max_batch_io_size(), 128);
    }
}

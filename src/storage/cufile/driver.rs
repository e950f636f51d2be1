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

/// Where cuFile writes its log (`cufile.log`, by default into the working directory).
///
/// cuFile takes a log *file* only from the `CUFILE_LOGFILE_PATH` environment variable, and a
/// program may change its environment only while no other thread runs (C code on other
/// threads — libcuda, NVML, cuFile's own — calls `getenv` without Rust's lock). So gpudirect
/// sets that variable only when the driver opens in a process with a single thread; otherwise
/// it sets cuFile's log *directory* (`CUFILE_PARAM_LOG_DIR`, cuFile 1.14+) before
/// `cuFileDriverOpen`, and the environment is never touched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// `CUFILE_LOGFILE_PATH` if the user set it, else the temporary directory: the file
    /// `gpudirect-cufile-<pid>.log` there when the process has one thread at open, else
    /// `cufile.log` in the directory `gpudirect-cufile-<uid>` there. The default.
    TempDir,
    /// This file. Needs the process to have a single thread when the driver opens (the file
    /// can only be named through the environment); otherwise opening the driver fails with
    /// [`Error::Unsupported`] saying what to do.
    File(PathBuf),
    /// `cufile.log` in this directory (`CUFILE_PARAM_LOG_DIR`), with any number of threads.
    Dir(PathBuf),
    /// Whatever cuFile does on its own (the working directory unless configured).
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
    /// a process with statistics on crashes at exit when the driver stays open (measured on cuFile
    /// 1.15; see the link above).
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
        let log_file = direct_log(&self.log, process_is_single_threaded(), |dir| {
            result::set_parameter_string(
                lib,
                sys::CUFILE_PARAM_LOG_DIR,
                &result::c_string("log directory", &dir.to_string_lossy())?,
            )
        })?;
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
        // SAFETY: as above.
        let raw = unsafe { result::driver_get_properties(lib) }?;
        let force_compat = self.force_compat
            || std::env::var("CUFILE_FORCE_COMPAT_MODE")
                .map(|v| v.eq_ignore_ascii_case("true") || v == "1")
                .unwrap_or(false);
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

/// The name cuFile gives its log file in the log directory.
const LOG_NAME: &str = "cufile.log";

/// True when this process runs exactly one thread (the caller), counted in `/proc/self/task`;
/// false when it cannot tell. With one thread, nothing can read the environment while this
/// thread changes it, and no other thread can start meanwhile but through this one.
fn process_is_single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|d| d.take(2).count() == 1)
}

/// Points cuFile's log away from the working directory (unless asked not to) and returns where
/// it goes. `CUFILE_LOGFILE_PATH`, which libcufile reads at `cuFileDriverOpen` (verified on
/// 1.15.1.6; the `CUFILE_PARAM_ENV_LOGFILE_PATH` parameter did not move the log), is set only
/// when `single_threaded` (see [`LogTarget`]); otherwise `set_log_dir` sets cuFile's log
/// directory.
fn direct_log(
    target: &LogTarget,
    single_threaded: bool,
    set_log_dir: impl FnOnce(&std::path::Path) -> Result<()>,
) -> Result<Option<PathBuf>> {
    const VAR: &str = "CUFILE_LOGFILE_PATH";
    let user = std::env::var_os(VAR).filter(|v| !v.is_empty());
    match target {
        LogTarget::CuFileDefault => Ok(user.map(PathBuf::from)),
        LogTarget::File(p) if single_threaded => {
            std::env::set_var(VAR, OsString::from(p.as_os_str()));
            Ok(Some(p.clone()))
        }
        LogTarget::File(p) => Err(Error::Unsupported {
            what: format!("cuFile's log in {}", p.display()),
            cause: crate::Cause::Other {
                message: "cuFile takes a log file only from CUFILE_LOGFILE_PATH, and changing \
                          the environment while other threads run is undefined behaviour"
                    .into(),
                fix: "set CUFILE_LOGFILE_PATH before the program starts threads, open the \
                      driver before starting any, or use LogTarget::Dir"
                    .into(),
            },
        }),
        LogTarget::Dir(d) => {
            set_log_dir(d)?;
            Ok(Some(d.join(LOG_NAME)))
        }
        LogTarget::TempDir => {
            if let Some(user) = user {
                return Ok(Some(PathBuf::from(user)));
            }
            let tmp = std::env::temp_dir();
            if single_threaded {
                let path = tmp.join(format!("gpudirect-cufile-{}.log", std::process::id()));
                std::env::set_var(VAR, OsString::from(path.as_os_str()));
                return Ok(Some(path));
            }
            // SAFETY: getuid has no preconditions and cannot fail.
            let dir = tmp.join(format!("gpudirect-cufile-{}", unsafe { libc::getuid() }));
            let applied = std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io("mkdir", Some(dir.clone()), e))
                .and_then(|()| set_log_dir(&dir));
            match applied {
                Ok(()) => Ok(Some(dir.join(LOG_NAME))),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "could not point cuFile's log at {}; it goes where cuFile puts it \
                         (the working directory unless configured): set CUFILE_LOGFILE_PATH \
                         before starting threads to choose",
                        dir.display()
                    );
                    Ok(None)
                }
            }
        }
    }
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

    /// Where cuFile writes its log, when gpudirect knows.
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
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        if synchronize {
            stream
                .synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
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
    /// cuFile's threads): the driver must never change the environment then.
    #[test]
    fn log_redirect_never_sets_the_environment_while_other_threads_run() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || rx.recv());
        let before = std::env::var_os("CUFILE_LOGFILE_PATH");
        let mut dir_set = None;
        let single = process_is_single_threaded();
        assert!(!single, "another thread is running");
        let got = direct_log(&LogTarget::TempDir, single, |d| {
            dir_set = Some(d.to_path_buf());
            Ok(())
        });
        let after = std::env::var_os("CUFILE_LOGFILE_PATH");
        tx.send(()).unwrap();
        other.join().unwrap().unwrap();
        assert_eq!(
            after, before,
            "CUFILE_LOGFILE_PATH was set while another thread was running"
        );
        if before.is_none() {
            // The log directory was set instead, in the temporary directory.
            let dir = dir_set.expect("cuFile's log directory is set instead");
            assert!(dir.starts_with(std::env::temp_dir()), "{}", dir.display());
            assert_eq!(got.unwrap(), Some(dir.join(LOG_NAME)));
        }
        // A log file by name needs the environment: refused, typed, with other threads.
        let file = std::env::temp_dir().join("x.log");
        match direct_log(&LogTarget::File(file), false, |_| unreachable!()) {
            Err(Error::Unsupported { cause, .. }) => {
                assert!(cause.to_string().contains("CUFILE_LOGFILE_PATH"), "{cause}")
            }
            other => panic!("{other:?}"),
        }
        let mut asked = None;
        let got = direct_log(&LogTarget::Dir("/some/dir".into()), false, |d| {
            asked = Some(d.to_path_buf());
            Ok(())
        });
        assert_eq!(got.unwrap(), Some(PathBuf::from("/some/dir/cufile.log")));
        assert_eq!(asked, Some(PathBuf::from("/some/dir")));
        assert_eq!(after, std::env::var_os("CUFILE_LOGFILE_PATH"));
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

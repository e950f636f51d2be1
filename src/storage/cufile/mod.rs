//! The safe cuFile (GPUDirect Storage) layer over `cufile_sys`.
//!
//! - [`Driver`]: the process-wide driver (`Arc`), configured by [`Driver::builder`] before it
//!   opens, never closed (see its docs for why).
//! - [`CuFileHandle`]: a registered file that owns its [`std::fs::File`]; synchronous
//!   read/write into cudarc device buffers; a [`PathReport`](crate::PathReport) saying whether
//!   IO goes direct ([`TransferPath::Gds`](crate::TransferPath::Gds)) or through cuFile's
//!   compatibility mode, and why.
//! - [`RegisteredBuffer`]: a device buffer registered with cuFile for its lifetime.
//! - [`StreamIo`]: stream-ordered IO whose guard owns its parameter block and buffer.
//! - [`BatchIo`]: batch IO; [`BatchIo::run`] is safe and blocking, `submit`/`poll` overlap.
//! - [`Stats`]: cuFile's process-wide counters, including which path each GPU's IO took.
//! - `CuFileHandle::readv`/`writev` where the library has them (cuFile 1.19+).
//!
//! Every C call goes through the private `result` module; statuses decode through
//! [`CuFileStatus`] (`status.rs`).
//!
//! Before the driver opens, gpudirect checks that libcuda loads and a GPU exists (through
//! [`crate::cuda`]): without them cuFile misbehaves (5033 plus a `cufile.log` in the working
//! directory in 1.15, a 100% CPU spin in 1.20), so gpudirect returns the typed CUDA error
//! instead and never calls `cuFileDriverOpen`. cuFile's log goes to the temporary directory by
//! default when the driver opens in a single-threaded process, else where cuFile puts it by
//! itself ([`LogTarget`]); [`Driver::log_file`] says where.

mod batch;
mod buffer;
mod driver;
pub(in crate::storage) mod env;
pub(in crate::storage) mod file_handle;
pub(in crate::storage) mod result;
mod stats;
mod status;
mod stream;
mod vectored;

pub use batch::{BatchCompletion, BatchIo, BatchOp};
pub use stats::{OpCounter, PerGpuStats, Stats, StatsL1, StatsSnapshot};
pub use status::{CuFileStatus, IoReturn};
pub use stream::{StreamIo, StreamRegistration, STREAM_COMPAT_ODIRECT_ALIGN};

pub use buffer::RegisteredBuffer;
pub use driver::{
    library_version, ControlFlags, Driver, DriverBuilder, DriverProperties, ExitStrategy,
    FeatureFlags, FsSupport, LogTarget, EXIT_STRATEGY_ENV,
};
/// For tests and diagnostics (the doctor, `cufile-info`): not part of the stable API.
#[doc(hidden)]
pub use file_handle::{classify_registration_failure, filesystem_type};
pub use file_handle::{CuFileHandle, OpenMode, MAX_IO_PER_CALL};

/// Where cuFile reads its configuration from (see [`config_file`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    /// The file.
    pub path: std::path::PathBuf,
    /// True when `CUFILE_ENV_PATH_JSON` named it (the file may not exist).
    pub from_env: bool,
}

/// The `cufile.json` cuFile reads at driver open: `$CUFILE_ENV_PATH_JSON` when set, else
/// `/etc/cufile.json` when it exists; `None` means cuFile's built-in defaults.
pub fn config_file() -> Option<ConfigFile> {
    match env::config_json() {
        Some(path) => Some(ConfigFile {
            path,
            from_env: true,
        }),
        None => {
            let etc = std::path::Path::new("/etc/cufile.json");
            etc.exists().then(|| ConfigFile {
                path: etc.to_path_buf(),
                from_env: false,
            })
        }
    }
}

//! The crate's one error type.
//!
//! Variants that callers branch on are promoted (`LibraryUnavailable`, `NoDevice`,
//! `NoRdmaSubsystem`, `Unsupported`, `FallbackRefused`, `InvalidArgument`,
//! `InvalidEnvironment`); every other failure names the C operation that failed and keeps the
//! raw code as its `source`.

use std::path::PathBuf;

use crate::path::{Cause, TransferPath};

#[cfg(feature = "safetensors")]
pub(crate) mod checkpoint;
pub(crate) mod cufile;
mod verbs;

pub use cufile::CuFileStatus;
pub use verbs::WcStatus;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A raw CUDA driver error, as cudarc reports it.
pub use cudarc::driver::DriverError as CudaDriverError;

/// Everything that can go wrong in gpudirect.
///
/// Messages are lowercase, carry no trailing period and say what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shared library could not be opened; `tried` lists every name or path attempted.
    #[error("{name} is not available (tried {}): {hint}", tried.join(", "))]
    LibraryUnavailable {
        /// The library, e.g. `libcufile.so.0`.
        name: &'static str,
        /// Every name or path that was tried, with the loader's message for each.
        tried: Vec<String>,
        /// What to do about it.
        hint: String,
    },

    /// A library loaded but lacks a symbol (usually: it is older than the call needs).
    #[error("{library} has no symbol {symbol}: {hint}")]
    SymbolUnavailable {
        /// The library the symbol was looked up in.
        library: &'static str,
        /// The missing symbol.
        symbol: &'static str,
        /// What to do about it (which version introduced the symbol).
        hint: String,
    },

    /// No device of the kind asked for exists (no CUDA GPU, no RDMA device, bad ordinal).
    #[error("no {what}: {detail}")]
    NoDevice {
        /// What was looked for, e.g. `"CUDA GPU"`, `"CUDA GPU with ordinal 3"`, `"RDMA device"`.
        what: String,
        /// Why, and what to do.
        detail: String,
    },

    /// The running kernel has no RDMA subsystem (`ibv_get_device_list` failed with ENOSYS).
    #[error("this kernel has no RDMA subsystem (ibv_get_device_list: {source}): load ib_core/ib_uverbs and a NIC or Soft-RoCE (rdma_rxe) driver")]
    NoRdmaSubsystem {
        /// The raw errno from libibverbs.
        #[source]
        source: std::io::Error,
    },

    /// The operation cannot be done on this machine, for the cause given.
    #[error("{what} is not supported here: {cause}")]
    Unsupported {
        /// The operation or feature.
        what: String,
        /// Why not, and what would fix it.
        cause: Cause,
    },

    /// The [`FallbackPolicy`](crate::FallbackPolicy) is `Deny` and the operation would not take a
    /// direct path. Nothing was transferred.
    #[error("refused to fall back to {path}: {cause} (fallback policy is deny; unset GPUDIRECT_REQUIRE_DIRECT or allow fallback to proceed)")]
    FallbackRefused {
        /// The path the transfer would have taken.
        path: TransferPath,
        /// Why it would not have been direct.
        cause: Cause,
    },

    /// A caller-supplied argument is wrong; nothing was done.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A `GPUDIRECT_*` environment variable has a value gpudirect does not accept (see the
    /// table in CONTRIBUTING.md); nothing was done.
    #[error("{variable}={value:?} is not valid: expected {expected}; fix or unset the variable")]
    InvalidEnvironment {
        /// The variable, e.g. `"GPUDIRECT_FALLBACK"`.
        variable: &'static str,
        /// Its value.
        value: String,
        /// The accepted values, e.g. `"allow, warn or deny"`.
        expected: String,
    },

    /// A CUDA driver call failed.
    #[error("{op} failed: {}", CudaCode(source))]
    Cuda {
        /// The driver function, e.g. `"cuCtxEnablePeerAccess"`, or `"a cudarc call"` for a
        /// cudarc error converted with `?` (`From<DriverError>`).
        op: &'static str,
        /// The raw `CUresult`.
        #[source]
        source: CudaDriverError,
    },

    /// A cuFile call returned a cuFile status.
    #[error("{op} failed: {source}")]
    CuFile {
        /// The cuFile function, e.g. `"cuFileHandleRegister"`.
        op: &'static str,
        /// The raw status, decoded.
        #[source]
        source: CuFileStatus,
    },

    /// A verbs or rdma_cm call failed with an errno.
    #[error("{op} failed: {source}")]
    Verbs {
        /// The libibverbs / librdmacm function, e.g. `"ibv_reg_dmabuf_mr"`.
        op: &'static str,
        /// The errno.
        #[source]
        source: std::io::Error,
    },

    /// A work request completed with an error status.
    #[error("work request {wr_id} completed with {status}")]
    WorkCompletion {
        /// The work request id given when posting.
        wr_id: u64,
        /// The decoded completion status.
        status: WcStatus,
    },

    /// The peer of an out-of-band connection exchange refused it or spoke another protocol
    /// (wrong shared token, wrong version, not a gpudirect peer).
    #[error("connection exchange with {peer} refused: {reason}")]
    ExchangeRefused {
        /// The peer's address.
        peer: String,
        /// Why, and what to do.
        reason: String,
    },

    /// An operating-system call on a file or socket failed.
    #[error("{op}{} failed: {source}", path.as_ref().map(|p| format!(" on {}", p.display())).unwrap_or_default())]
    Io {
        /// The call, e.g. `"pread"`, `"open"`.
        op: &'static str,
        /// The file involved, when there is one.
        path: Option<PathBuf>,
        /// The errno.
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint (safetensors file, index or model directory) is wrong, or cannot be loaded
    /// or saved as asked; nothing partial was reported as success.
    #[cfg(feature = "safetensors")]
    #[error("{}{}: {problem}", file.display(), tensor.as_ref().map(|t| format!(": tensor {t:?}")).unwrap_or_default())]
    Checkpoint {
        /// The file (or directory) concerned.
        file: PathBuf,
        /// The tensor to blame, when there is one.
        tensor: Option<String>,
        /// What is wrong.
        problem: checkpoint::Problem,
    },

    /// A batch (`storage::ReadBatch`, `WriteBatch`) was refused before any byte moved, because
    /// of the item named (its index in the order the items were added): no item was transferred.
    #[error("batch item {index} refused, nothing was transferred: {source}")]
    BatchRefused {
        /// The item's index.
        index: usize,
        /// What is wrong with it.
        #[source]
        source: Box<Error>,
    },

    /// Items of a batch failed while it ran (a file error, a file that shrank); every item not
    /// listed was transferred completely. The bytes of a failed item's range are unspecified.
    #[error("{}", batch_failed_msg(*.total, .failed))]
    BatchFailed {
        /// Items in the batch.
        total: usize,
        /// The failed items (index, error), in index order; never empty.
        failed: Vec<(usize, Error)>,
    },

    /// A transfer was cancelled (`storage::Transfer::cancel`, `storage::TransferControl`)
    /// before every byte moved. Nothing is in flight any more: every piece that was started
    /// finished (its copies drained) before this was returned. For a read, the first `prefix`
    /// bytes of the destination hold the file's bytes; of the rest, `moved - prefix` bytes in
    /// pieces further on were written too, and the other bytes are as they were. For a write,
    /// the file's range is partly written.
    #[error("transfer cancelled after {moved} of {total} bytes ({prefix} in place from the start); nothing is in flight: run it again for the rest")]
    Cancelled {
        /// Bytes that moved in all.
        moved: usize,
        /// Bytes that moved as one run from the start of the range.
        prefix: usize,
        /// Bytes the transfer was asked to move.
        total: usize,
    },

    /// A setting was given after the point where the library still honours it.
    #[error("{setting} must be set before {before}: {hint}")]
    TooLate {
        /// The setting.
        setting: &'static str,
        /// The event after which it is ignored (e.g. `"cuFileDriverOpen"`).
        before: &'static str,
        /// What to do.
        hint: &'static str,
    },
}

/// Prints a `CUresult` by name and number. cudarc's own `Display` is its `Debug`, which asks
/// libcuda for a description (`cuGetErrorString`) and so cannot run without the library.
struct CudaCode<'a>(&'a CudaDriverError);

impl std::fmt::Display for CudaCode<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ({})", self.0 .0, self.0 .0 as i32)
    }
}

/// A cudarc call's error, for `?` in code that mixes cudarc and gpudirect: an [`Error::Cuda`]
/// with the raw `CUresult` as its source (cudarc's error does not say which call failed).
impl From<CudaDriverError> for Error {
    fn from(source: CudaDriverError) -> Self {
        Error::Cuda {
            op: "a cudarc call",
            source,
        }
    }
}

/// The message of [`Error::BatchFailed`].
fn batch_failed_msg(total: usize, failed: &[(usize, Error)]) -> String {
    match failed.first() {
        Some((i, e)) => format!(
            "{} of {total} batch items failed (every other item was transferred completely); first: item {i}: {e}",
            failed.len()
        ),
        None => format!("a batch of {total} items failed"),
    }
}

impl Error {
    /// Wraps a CUDA driver error with the name of the failing call.
    pub(crate) fn cuda(op: &'static str, source: CudaDriverError) -> Self {
        Error::Cuda { op, source }
    }

    /// Wraps an errno from an OS call.
    pub(crate) fn io(op: &'static str, path: Option<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { op, path, source }
    }

    /// True for errors that mean "the hardware or library is not here", as opposed to a
    /// failure of something that is: programs use it to decide to fall back quietly.
    pub fn is_absence(&self) -> bool {
        matches!(
            self,
            Error::LibraryUnavailable { .. }
                | Error::SymbolUnavailable { .. }
                | Error::NoDevice { .. }
                | Error::NoRdmaSubsystem { .. }
                | Error::Unsupported { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn cudarc_errors_convert_with_their_code_and_print_without_libcuda() {
        let e: Error = CudaDriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY).into();
        assert!(matches!(
            &e,
            Error::Cuda { op: "a cudarc call", source } if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
        ));
        assert_eq!(
            e.to_string(),
            "a cudarc call failed: CUDA_ERROR_OUT_OF_MEMORY (2)"
        );
        assert!(
            std::error::Error::source(&e).is_some(),
            "the source is kept"
        );
        let e = Error::cuda(
            "cuMemAlloc",
            CudaDriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        assert_eq!(
            e.to_string(),
            "cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE (1)"
        );
    }
}

//! cuFile status codes (`CUfileOpError`): the boundary value the core's
//! [`Error::CuFile`](super::Error) carries, decoded here so the error type needs no room (the
//! storage wing re-exports it as `storage::cufile::CuFileStatus`).
//!
//! Codes are kept as numbers, never turned into a Rust `enum`: cuFile renumbered its table in
//! 1.15 (code 5039 was the `CU_FILE_IO_MAX_ERROR` sentinel up to 1.14 and is
//! `CU_FILE_INTERNAL_BATCH_SETUP_ERROR` from 1.15 on; 5040–5050 are new in 1.15), so a code is
//! decoded against the version of the library that returned it. Codes this table does not know
//! are kept and printed as numbers.

use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};

/// `CUFILEOP_BASE_ERR`: cuFile codes are above this value.
pub(crate) const CUFILEOP_BASE_ERR: i32 = 5000;

/// The first cuFile version (`1000*major + 10*minor`) with the 1.15 code table.
pub(crate) const TABLE_1_15: i32 = 1150;

/// The version of the libcufile this process loaded, 0 until it is known.
static LOADED_VERSION: AtomicI32 = AtomicI32::new(0);

/// Records the loaded library's `cuFileGetVersion`, so statuses decode against its table.
pub(crate) fn set_loaded_version(version: i32) {
    LOADED_VERSION.store(version, Ordering::Relaxed);
}

/// The loaded library's version, when known.
pub(crate) fn loaded_version() -> Option<i32> {
    match LOADED_VERSION.load(Ordering::Relaxed) {
        0 => None,
        v => Some(v),
    }
}

/// One row of the code table: name, what it means (lowercase), and what to do (if anything).
struct Entry {
    name: &'static str,
    message: &'static str,
    fix: Option<&'static str>,
}

const fn e(name: &'static str, message: &'static str, fix: Option<&'static str>) -> Entry {
    Entry { name, message, fix }
}

/// Codes whose meaning is the same in every release from 1.7 to 1.20.
fn common_entry(code: i32) -> Option<Entry> {
    Some(match code {
        0 => e("CU_FILE_SUCCESS", "success", None),
        5001 => e(
            "CU_FILE_DRIVER_NOT_INITIALIZED",
            "the nvidia-fs driver is not loaded and compatibility mode is off",
            Some("load nvidia-fs (modprobe nvidia-fs) or set properties.allow_compat_mode to true in cufile.json"),
        ),
        5002 => e("CU_FILE_DRIVER_INVALID_PROPS", "invalid driver property", Some("check the values given to the driver builder and cufile.json")),
        5003 => e(
            "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
            "driver property out of range",
            Some("pick a value inside the range cuFileGetParameterMinMaxValue reports"),
        ),
        5004 => e(
            "CU_FILE_DRIVER_VERSION_MISMATCH",
            "the nvidia-fs driver version does not match libcufile",
            Some("install the nvidia-fs release that matches this libcufile"),
        ),
        5005 => e(
            "CU_FILE_DRIVER_VERSION_READ_ERROR",
            "the nvidia-fs driver version could not be read",
            Some("check that /dev/nvidia-fs* exists and is readable"),
        ),
        5006 => e("CU_FILE_DRIVER_CLOSING", "the driver is shutting down", Some("finish all IO before the driver is closed")),
        5007 => e(
            "CU_FILE_PLATFORM_NOT_SUPPORTED",
            "gpudirect storage is not supported on this platform",
            Some("run gdscheck -p, or allow cuFile's compatibility mode"),
        ),
        5008 => e(
            "CU_FILE_IO_NOT_SUPPORTED",
            "gpudirect storage is not supported on this file",
            Some("place the file on a gds-capable filesystem (ext4 or xfs on nvme) or allow compatibility mode"),
        ),
        5009 => e(
            "CU_FILE_DEVICE_NOT_SUPPORTED",
            "gpudirect storage is not supported on this gpu",
            Some("use a gds-capable gpu or allow compatibility mode"),
        ),
        5010 => e("CU_FILE_NVFS_DRIVER_ERROR", "an nvidia-fs ioctl failed", Some("check dmesg for nvidia-fs errors")),
        5011 => e("CU_FILE_CUDA_DRIVER_ERROR", "a cuda driver api call failed", None),
        5012 => e("CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer", Some("pass memory allocated by cuMemAlloc or cudaMalloc")),
        5013 => e(
            "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
            "invalid pointer memory type",
            Some("pass device memory, or enable properties.allow_system_memory for host memory"),
        ),
        5014 => e(
            "CU_FILE_CUDA_POINTER_RANGE_ERROR",
            "the pointer range exceeds the allocation",
            Some("keep buffer offset plus size within the allocation"),
        ),
        5015 => e("CU_FILE_CUDA_CONTEXT_MISMATCH", "cuda context mismatch", Some("make the buffer's context current on the calling thread")),
        5016 => e(
            "CU_FILE_INVALID_MAPPING_SIZE",
            "access beyond the maximum pinned size",
            Some("raise max_device_pinned_mem_size_kb or register a smaller buffer"),
        ),
        5017 => e("CU_FILE_INVALID_MAPPING_RANGE", "access beyond the mapped size", Some("keep the io within the registered buffer")),
        5018 => e("CU_FILE_INVALID_FILE_TYPE", "unsupported file type", Some("register a regular file, not a directory, fifo or device")),
        5019 => e(
            "CU_FILE_INVALID_FILE_OPEN_FLAG",
            "unsupported file open flags",
            Some("open the file with O_DIRECT and without O_APPEND or O_PATH"),
        ),
        5020 => e("CU_FILE_DIO_NOT_SET", "the file descriptor is not opened with O_DIRECT", Some("open the file with O_DIRECT")),
        5021 => e("CU_FILE_EXPECTED_FILE_MODE", "unexpected file mode (code of cuFile 1.7 and older)", None),
        5022 => e("CU_FILE_INVALID_VALUE", "invalid arguments", None),
        5023 => e(
            "CU_FILE_MEMORY_ALREADY_REGISTERED",
            "the device pointer is already registered",
            Some("reuse the existing registration or deregister it first"),
        ),
        5024 => e(
            "CU_FILE_MEMORY_NOT_REGISTERED",
            "the device pointer is not registered",
            Some("pass the base pointer that was registered"),
        ),
        5025 => e(
            "CU_FILE_PERMISSION_DENIED",
            "driver or file access denied",
            Some("check the file's permissions and access to /dev/nvidia-fs*"),
        ),
        5026 => e(
            "CU_FILE_DRIVER_ALREADY_OPEN",
            "the driver is already open",
            Some("give driver settings before the driver is opened"),
        ),
        5027 => e("CU_FILE_HANDLE_NOT_REGISTERED", "the file descriptor is not registered", Some("register the file first")),
        5028 => e("CU_FILE_HANDLE_ALREADY_REGISTERED", "the file descriptor is already registered", Some("reuse the existing handle")),
        5029 => e(
            "CU_FILE_DEVICE_NOT_FOUND",
            "gpu device not found",
            Some("check nvidia-smi, CUDA_VISIBLE_DEVICES and CUFILE_VISIBLE_DEVICES"),
        ),
        5030 => e(
            "CU_FILE_INTERNAL_ERROR",
            "internal cuFile error",
            Some("read cufile.log (see CUFILE_LOGFILE_PATH); in a container, bind-mount the host's /run/udev"),
        ),
        5031 => e("CU_FILE_GETNEWFD_FAILED", "failed to obtain a new file descriptor", Some("raise the open-files limit (ulimit -n)")),
        5033 => e(
            "CU_FILE_NVFS_SETUP_ERROR",
            "driver initialization failed",
            Some("check that libcuda loads and a gpu is visible, then read cufile.log"),
        ),
        5034 => e(
            "CU_FILE_IO_DISABLED",
            "gpudirect storage is disabled by configuration for this file",
            Some("remove the file's mount, filesystem or device from the cufile.json denylist"),
        ),
        5035 => e("CU_FILE_BATCH_SUBMIT_FAILED", "batch submission failed", None),
        5036 => e(
            "CU_FILE_GPU_MEMORY_PINNING_FAILED",
            "failed to pin gpu memory",
            Some("raise max_device_pinned_mem_size_kb or deregister unused buffers"),
        ),
        5037 => e("CU_FILE_BATCH_FULL", "the batch queue is full", Some("wait for completions before submitting more")),
        5038 => e(
            "CU_FILE_ASYNC_NOT_SUPPORTED",
            "stream-ordered io is not supported here",
            Some("use synchronous io, or provide a cufile.json (CUFILE_ENV_PATH_JSON) for stream io"),
        ),
        _ => return None,
    })
}

/// Codes 5039–5050 as cuFile 1.15 and later define them.
fn entry_1_15(code: i32) -> Option<Entry> {
    const RETRY: Option<&str> = Some("retry later");
    Some(match code {
        5039 => e(
            "CU_FILE_INTERNAL_BATCH_SETUP_ERROR",
            "internal batch setup error",
            RETRY,
        ),
        5040 => e(
            "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR",
            "internal batch submit error",
            RETRY,
        ),
        5041 => e(
            "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
            "internal batch get-status error",
            RETRY,
        ),
        5042 => e(
            "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR",
            "internal batch cancel error",
            RETRY,
        ),
        5043 => e("CU_FILE_NOMEM_ERROR", "cuFile is out of memory", RETRY),
        5044 => e("CU_FILE_IO_ERROR", "cuFile io error", None),
        5045 => e(
            "CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
            "internal buffer registration error",
            None,
        ),
        5046 => e(
            "CU_FILE_HASH_OPR_ERROR",
            "internal hash operation error",
            None,
        ),
        5047 => e(
            "CU_FILE_INVALID_CONTEXT_ERROR",
            "invalid cuda context",
            Some("make the buffer's context current on the calling thread"),
        ),
        5048 => e(
            "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
            "nvidia-fs internal driver error",
            Some("check dmesg for nvidia-fs errors"),
        ),
        5049 => e(
            "CU_FILE_BATCH_NOCOMPAT_ERROR",
            "batch io needs compatibility mode, which is off",
            Some("set properties.allow_compat_mode to true or use a gds-capable file"),
        ),
        5050 => e(
            "CU_FILE_IO_MAX_ERROR",
            "end-of-table sentinel (not a real error)",
            None,
        ),
        _ => return None,
    })
}

/// Codes 5039 and up as cuFile 1.14 and earlier define them.
fn entry_1_14(code: i32) -> Option<Entry> {
    match code {
        5039 => Some(e(
            "CU_FILE_IO_MAX_ERROR",
            "end-of-table sentinel (not a real error)",
            None,
        )),
        _ => None,
    }
}

fn lookup(code: i32, version: Option<i32>) -> Option<Entry> {
    common_entry(code).or_else(|| match version {
        Some(v) if v < TABLE_1_15 => entry_1_14(code),
        // Unknown version: the table of the header the bindings are generated from (1.15).
        _ => entry_1_15(code),
    })
}

/// A cuFile status (`CUfileError_t`): the `CUfileOpError` code, the CUDA driver error when the
/// code is `CU_FILE_CUDA_DRIVER_ERROR`, and the library version the code is decoded against.
///
/// `Display` gives one lowercase line with the fix when there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuFileStatus {
    code: i32,
    cu_err: u32,
    version: Option<i32>,
}

impl CuFileStatus {
    /// `CU_FILE_SUCCESS`.
    pub const SUCCESS: i32 = 0;
    /// `CU_FILE_DRIVER_NOT_INITIALIZED`.
    pub const DRIVER_NOT_INITIALIZED: i32 = 5001;
    /// `CU_FILE_PLATFORM_NOT_SUPPORTED`.
    pub const PLATFORM_NOT_SUPPORTED: i32 = 5007;
    /// `CU_FILE_IO_NOT_SUPPORTED`.
    pub const IO_NOT_SUPPORTED: i32 = 5008;
    /// `CU_FILE_DEVICE_NOT_SUPPORTED`.
    pub const DEVICE_NOT_SUPPORTED: i32 = 5009;
    /// `CU_FILE_CUDA_DRIVER_ERROR`.
    pub const CUDA_DRIVER_ERROR: i32 = 5011;
    /// `CU_FILE_INVALID_FILE_TYPE`.
    pub const INVALID_FILE_TYPE: i32 = 5018;
    /// `CU_FILE_INVALID_FILE_OPEN_FLAG`.
    pub const INVALID_FILE_OPEN_FLAG: i32 = 5019;
    /// `CU_FILE_DIO_NOT_SET`.
    pub const DIO_NOT_SET: i32 = 5020;
    /// `CU_FILE_INVALID_VALUE`.
    pub const INVALID_VALUE: i32 = 5022;
    /// `CU_FILE_MEMORY_ALREADY_REGISTERED`.
    pub const MEMORY_ALREADY_REGISTERED: i32 = 5023;
    /// `CU_FILE_PERMISSION_DENIED`.
    pub const PERMISSION_DENIED: i32 = 5025;
    /// `CU_FILE_DRIVER_ALREADY_OPEN`.
    pub const DRIVER_ALREADY_OPEN: i32 = 5026;
    /// `CU_FILE_INTERNAL_ERROR`.
    pub const INTERNAL_ERROR: i32 = 5030;
    /// `CU_FILE_NVFS_SETUP_ERROR`.
    pub const NVFS_SETUP_ERROR: i32 = 5033;
    /// `CU_FILE_IO_DISABLED`.
    pub const IO_DISABLED: i32 = 5034;
    /// `CU_FILE_ASYNC_NOT_SUPPORTED`.
    pub const ASYNC_NOT_SUPPORTED: i32 = 5038;
    /// `CU_FILE_BATCH_NOCOMPAT_ERROR` (1.15+).
    pub const BATCH_NOCOMPAT_ERROR: i32 = 5049;

    /// A status code, decoded against the loaded library's version (the 1.15 table while no
    /// library has been loaded).
    pub fn new(code: i32) -> Self {
        CuFileStatus {
            code,
            cu_err: 0,
            version: loaded_version(),
        }
    }

    /// A status code decoded against the table of cuFile `version` (`1000*major + 10*minor`,
    /// as `cuFileGetVersion` reports it).
    pub fn for_version(code: i32, version: i32) -> Self {
        CuFileStatus {
            code,
            cu_err: 0,
            version: Some(version),
        }
    }

    /// A whole `CUfileError_t`: `err` and `cu_err` (kept only for `CU_FILE_CUDA_DRIVER_ERROR`,
    /// the only code for which cuFile defines it).
    pub fn from_parts(err: i32, cu_err: u32, version: Option<i32>) -> Self {
        CuFileStatus {
            code: err,
            cu_err: if err == Self::CUDA_DRIVER_ERROR {
                cu_err
            } else {
                0
            },
            version: version.or_else(loaded_version),
        }
    }

    /// The raw `CUfileOpError` value.
    pub fn code(&self) -> i32 {
        self.code
    }

    /// True for `CU_FILE_SUCCESS`.
    pub fn is_success(&self) -> bool {
        self.code == Self::SUCCESS
    }

    /// The raw `CUresult` behind a `CU_FILE_CUDA_DRIVER_ERROR` (`None` for other codes).
    pub fn cuda_error(&self) -> Option<u32> {
        (self.code == Self::CUDA_DRIVER_ERROR).then_some(self.cu_err)
    }

    /// The library version this code is decoded against (`None`: not known, 1.15 table used).
    pub fn version(&self) -> Option<i32> {
        self.version
    }

    /// The C name, e.g. `"CU_FILE_IO_NOT_SUPPORTED"`; `None` for a code this table does not know.
    pub fn name(&self) -> Option<&'static str> {
        lookup(self.code, self.version).map(|e| e.name)
    }

    /// What the code means, lowercase; `None` for a code this table does not know.
    pub fn message(&self) -> Option<&'static str> {
        lookup(self.code, self.version).map(|e| e.message)
    }

    /// What to do about it, when there is something to do.
    pub fn fix(&self) -> Option<&'static str> {
        lookup(self.code, self.version).and_then(|e| e.fix)
    }

    /// True for codes cuFile documents as transient ("retry later").
    pub fn is_retryable(&self) -> bool {
        self.fix() == Some("retry later")
    }
}

impl fmt::Display for CuFileStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match lookup(self.code, self.version) {
            Some(entry) => {
                write!(
                    f,
                    "cuFile {} ({}): {}",
                    entry.name, self.code, entry.message
                )?;
                if let Some(cu) = self.cuda_error() {
                    write!(f, " ({})", CudaResultName(cu))?;
                }
                if let Some(fix) = entry.fix {
                    write!(f, "; fix: {fix}")?;
                }
                Ok(())
            }
            None => {
                write!(f, "cuFile status {} (not a code of ", self.code)?;
                match self.version {
                    Some(v) => write!(f, "cuFile {}.{}", v / 1000, v % 1000 / 10)?,
                    None => f.write_str("cuFile 1.14 or 1.15")?,
                }
                f.write_str("; look it up in the cufile.h of the loaded library)")
            }
        }
    }
}

impl std::error::Error for CuFileStatus {}

/// Formats a raw `CUresult` with its name for the codes cuFile's CUDA errors usually carry.
struct CudaResultName(u32);

impl fmt::Display for CudaResultName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            0 => "CUDA_SUCCESS",
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            201 => "CUDA_ERROR_INVALID_CONTEXT",
            205 => "CUDA_ERROR_MAP_FAILED",
            206 => "CUDA_ERROR_UNMAP_FAILED",
            208 => "CUDA_ERROR_ALREADY_MAPPED",
            217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            500 => "CUDA_ERROR_NOT_FOUND",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            999 => "CUDA_ERROR_UNKNOWN",
            n => return write!(f, "cuda driver error {n}"),
        };
        write!(f, "{name} = {}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code of the 1.15.1.6 header, with its C name.
    const TABLE_115: &[(i32, &str)] = &[
        (0, "CU_FILE_SUCCESS"),
        (5001, "CU_FILE_DRIVER_NOT_INITIALIZED"),
        (5002, "CU_FILE_DRIVER_INVALID_PROPS"),
        (5003, "CU_FILE_DRIVER_UNSUPPORTED_LIMIT"),
        (5004, "CU_FILE_DRIVER_VERSION_MISMATCH"),
        (5005, "CU_FILE_DRIVER_VERSION_READ_ERROR"),
        (5006, "CU_FILE_DRIVER_CLOSING"),
        (5007, "CU_FILE_PLATFORM_NOT_SUPPORTED"),
        (5008, "CU_FILE_IO_NOT_SUPPORTED"),
        (5009, "CU_FILE_DEVICE_NOT_SUPPORTED"),
        (5010, "CU_FILE_NVFS_DRIVER_ERROR"),
        (5011, "CU_FILE_CUDA_DRIVER_ERROR"),
        (5012, "CU_FILE_CUDA_POINTER_INVALID"),
        (5013, "CU_FILE_CUDA_MEMORY_TYPE_INVALID"),
        (5014, "CU_FILE_CUDA_POINTER_RANGE_ERROR"),
        (5015, "CU_FILE_CUDA_CONTEXT_MISMATCH"),
        (5016, "CU_FILE_INVALID_MAPPING_SIZE"),
        (5017, "CU_FILE_INVALID_MAPPING_RANGE"),
        (5018, "CU_FILE_INVALID_FILE_TYPE"),
        (5019, "CU_FILE_INVALID_FILE_OPEN_FLAG"),
        (5020, "CU_FILE_DIO_NOT_SET"),
        (5022, "CU_FILE_INVALID_VALUE"),
        (5023, "CU_FILE_MEMORY_ALREADY_REGISTERED"),
        (5024, "CU_FILE_MEMORY_NOT_REGISTERED"),
        (5025, "CU_FILE_PERMISSION_DENIED"),
        (5026, "CU_FILE_DRIVER_ALREADY_OPEN"),
        (5027, "CU_FILE_HANDLE_NOT_REGISTERED"),
        (5028, "CU_FILE_HANDLE_ALREADY_REGISTERED"),
        (5029, "CU_FILE_DEVICE_NOT_FOUND"),
        (5030, "CU_FILE_INTERNAL_ERROR"),
        (5031, "CU_FILE_GETNEWFD_FAILED"),
        (5033, "CU_FILE_NVFS_SETUP_ERROR"),
        (5034, "CU_FILE_IO_DISABLED"),
        (5035, "CU_FILE_BATCH_SUBMIT_FAILED"),
        (5036, "CU_FILE_GPU_MEMORY_PINNING_FAILED"),
        (5037, "CU_FILE_BATCH_FULL"),
        (5038, "CU_FILE_ASYNC_NOT_SUPPORTED"),
        (5039, "CU_FILE_INTERNAL_BATCH_SETUP_ERROR"),
        (5040, "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR"),
        (5041, "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR"),
        (5042, "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR"),
        (5043, "CU_FILE_NOMEM_ERROR"),
        (5044, "CU_FILE_IO_ERROR"),
        (5045, "CU_FILE_INTERNAL_BUF_REGISTER_ERROR"),
        (5046, "CU_FILE_HASH_OPR_ERROR"),
        (5047, "CU_FILE_INVALID_CONTEXT_ERROR"),
        (5048, "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR"),
        (5049, "CU_FILE_BATCH_NOCOMPAT_ERROR"),
        (5050, "CU_FILE_IO_MAX_ERROR"),
    ];

    fn assert_lowercase_line(s: &str) {
        assert!(s.starts_with("cuFile "), "{s}");
        assert!(!s.ends_with('.'), "{s}");
        assert!(!s.contains('\n'), "{s}");
        assert!(
            !s.contains("CuFileStatus {"),
            "Display must not print Debug: {s}"
        );
    }

    #[test]
    fn every_1_15_code_has_its_name_and_message() {
        for &(code, name) in TABLE_115 {
            let s = CuFileStatus::for_version(code, 1150);
            assert_eq!(s.name(), Some(name), "code {code}");
            let msg = s.message().unwrap();
            assert!(!msg.is_empty());
            assert!(msg.starts_with(|c: char| c.is_lowercase()), "{msg}");
            let text = s.to_string();
            assert_lowercase_line(&text);
            assert!(
                text.contains(name) && text.contains(&code.to_string()),
                "{text}"
            );
            // Newer libraries keep the same table.
            assert_eq!(CuFileStatus::for_version(code, 1200).name(), Some(name));
        }
    }

    #[test]
    fn the_1_14_table_differs_from_5039_on() {
        for &(code, name) in TABLE_115.iter().filter(|(c, _)| *c < 5039) {
            assert_eq!(CuFileStatus::for_version(code, 1140).name(), Some(name));
            assert_eq!(CuFileStatus::for_version(code, 1070).name(), Some(name));
        }
        let s = CuFileStatus::for_version(5039, 1140);
        assert_eq!(s.name(), Some("CU_FILE_IO_MAX_ERROR"));
        assert!(!s.is_retryable());
        let s = CuFileStatus::for_version(5039, 1150);
        assert_eq!(s.name(), Some("CU_FILE_INTERNAL_BATCH_SETUP_ERROR"));
        assert!(s.is_retryable());
        for code in 5040..=5050 {
            let s = CuFileStatus::for_version(code, 1140);
            assert_eq!(s.name(), None, "{code} does not exist in 1.14");
            let text = s.to_string();
            assert!(
                text.contains(&code.to_string()) && text.contains("cuFile 1.14"),
                "{text}"
            );
        }
    }

    #[test]
    fn unknown_codes_are_kept_as_numbers() {
        for code in [1, 4999, 5032, 5051, 6001, 9999, i32::MAX, -3] {
            let s = CuFileStatus::for_version(code, 1150);
            assert_eq!(s.code(), code);
            assert_eq!(s.name(), None);
            assert_eq!(s.message(), None);
            let text = s.to_string();
            assert!(
                text.starts_with(&format!("cuFile status {code} ")),
                "{text}"
            );
            assert!(text.contains("cuFile 1.15"), "{text}");
        }
        let s = CuFileStatus::from_parts(5032, 0, None);
        assert_eq!(s.code(), 5032);
        assert_eq!(s.name(), None);
    }

    #[test]
    fn cuda_driver_error_carries_cu_err() {
        let s = CuFileStatus::from_parts(5011, 201, Some(1150));
        assert_eq!(s.cuda_error(), Some(201));
        let text = s.to_string();
        assert!(text.contains("CUDA_ERROR_INVALID_CONTEXT = 201"), "{text}");
        let s = CuFileStatus::from_parts(5011, 4242, Some(1150));
        assert!(s.to_string().contains("cuda driver error 4242"), "{s}");
        // cu_err is meaningless for any other code and is dropped.
        let s = CuFileStatus::from_parts(5030, 201, Some(1150));
        assert_eq!(s.cuda_error(), None);
        assert!(!s.to_string().contains("201"), "{s}");
    }

    #[test]
    fn fixes_are_given_where_there_is_one() {
        let s = CuFileStatus::for_version(5001, 1150).to_string();
        assert!(s.contains("; fix: load nvidia-fs"), "{s}");
        let s = CuFileStatus::for_version(5030, 1150).to_string();
        assert!(s.contains("/run/udev"), "{s}");
        let s = CuFileStatus::for_version(5033, 1150).to_string();
        assert!(s.contains("libcuda"), "{s}");
        assert_eq!(CuFileStatus::for_version(5022, 1150).fix(), None);
        for code in 5039..=5043 {
            assert!(
                CuFileStatus::for_version(code, 1150).is_retryable(),
                "{code}"
            );
        }
        assert!(CuFileStatus::for_version(0, 1150).is_success());
    }
}

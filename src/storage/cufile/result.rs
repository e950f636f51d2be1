//! The thin private result layer: one function per cuFile C call, turning its raw status into
//! [`Result`]. Safe types call only these; nothing else in the crate touches `cufile_sys`'s
//! function pointers.
//!
//! Functions whose arguments the library dereferences (pointers, handles, buffers) are
//! `unsafe fn` with the C contract spelled out; the rest are safe.

use std::ffi::{c_void, CStr, CString};
use std::time::Duration;

use cufile_sys as sys;

use super::status::{self, CuFileStatus, IoReturn};
use crate::error::{Error, Result};

/// The soname reported in errors.
pub(in crate::storage) const LIB: &str = "libcufile.so.0";

/// The process-wide libcufile, or `LibraryUnavailable` naming every path tried.
pub(in crate::storage) fn lib() -> Result<&'static sys::Library> {
    sys::library().map_err(|e| Error::LibraryUnavailable {
        name: LIB,
        tried: e
            .tried
            .iter()
            .map(|(name, why)| format!("{name} ({why})"))
            .collect(),
        hint: format!(
            "install it (pip install nvidia-cufile, or the CUDA toolkit's gds package) or set {} to its path",
            sys::LIBRARY_ENV
        ),
    })
}

/// The cuFile release that introduced `symbol`, for error hints.
fn introduced_in(symbol: &str) -> &'static str {
    match symbol {
        "cuFileReadv" | "cuFileWritev" => "1.19",
        "cuFileDriverGetP2PFlags" | "cuFileDriverSetP2PFlags" => "1.16",
        "cuFileGetParameterMinMaxValue"
        | "cuFileSetParameterPosixPoolSlabArray"
        | "cuFileGetParameterPosixPoolSlabArray"
        | "cuFileSetStatsLevel"
        | "cuFileGetStatsLevel"
        | "cuFileStatsStart"
        | "cuFileStatsStop"
        | "cuFileStatsReset"
        | "cuFileGetStatsL1"
        | "cuFileGetStatsL2"
        | "cuFileGetStatsL3"
        | "cuFileGetBARSizeInKB" => "1.15",
        s if s.starts_with("cuFileGetParameter") || s.starts_with("cuFileSetParameter") => "1.14",
        _ => "1.7",
    }
}

/// Unwraps an optional symbol, or `SymbolUnavailable` saying which release has it.
pub(in crate::storage) fn sym<T>(f: Option<T>, symbol: &'static str) -> Result<T> {
    f.ok_or_else(|| Error::SymbolUnavailable {
        library: LIB,
        symbol,
        hint: format!(
            "{symbol} needs cuFile {} or newer{}; install a newer nvidia-cufile",
            introduced_in(symbol),
            match status::loaded_version() {
                Some(v) => format!(" (loaded: {}.{})", v / 1000, v % 1000 / 10),
                None => String::new(),
            }
        ),
    })
}

/// `CUfileError_t` to `Result`, naming the call.
pub(in crate::storage) fn check(op: &'static str, e: sys::CUfileError_t) -> Result<()> {
    if e.err == sys::CU_FILE_SUCCESS {
        Ok(())
    } else {
        Err(cufile_error(op, e.err as i32, e.cu_err))
    }
}

/// An `Error::CuFile` for `op` with the given code.
pub(in crate::storage) fn cufile_error(op: &'static str, code: i32, cu_err: u32) -> Error {
    Error::CuFile {
        op,
        source: CuFileStatus::from_parts(code, cu_err, None),
    }
}

/// Decodes an `ssize_t` data-path return (`errno` read immediately for `-1`).
pub(in crate::storage) fn decode_ssize(op: &'static str, ret: isize) -> Result<usize> {
    match IoReturn::decode(ret, || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    }) {
        IoReturn::Bytes(n) => Ok(n),
        IoReturn::Os(e) => Err(Error::io(op, None, e)),
        IoReturn::CuFile(s) => Err(Error::CuFile { op, source: s }),
    }
}

/// Puts the calling thread's current CUDA context back as it was when the guard drops. Every
/// call below that can touch CUDA takes one: cuFile binds contexts of its own (at driver open,
/// when it registers a handle or buffer, and in its compatibility path's copies, e.g. inside
/// `cuFileBatchIOGetStatus`), and a gpudirect call must leave the caller's thread as it found
/// it. Only used once libcuda is known to load (the driver is open or opening).
fn keep_context() -> crate::cuda::CurrentContext {
    crate::cuda::CurrentContext::save()
}

// ---- Library and driver -----------------------------------------------------------------------

/// `cuFileGetVersion`; a library without the symbol is treated as 1.7 (1070), as KvikIO does.
pub(in crate::storage) fn get_version(lib: &sys::Library) -> Result<i32> {
    let Some(f) = lib.cuFileGetVersion else {
        return Ok(1070);
    };
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the call; cuFileGetVersion only writes it and
    // needs neither the driver nor libcuda (verified against 1.15.1.6 without a GPU).
    check("cuFileGetVersion", unsafe { f(&mut v) })?;
    Ok(v)
}

/// `cuFileDriverOpen`.
///
/// # Safety
/// libcuda must be loadable and a CUDA device must exist (checked through `crate::cuda`): without
/// them cuFile 1.15 fails after writing `cufile.log` into the working directory and 1.20 spins
/// at 100% CPU. `fork()` after this call is undefined behaviour in the child.
pub(in crate::storage) unsafe fn driver_open(lib: &sys::Library) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileDriverOpen, "cuFileDriverOpen")?;
    // SAFETY: no arguments; the caller guarantees libcuda and a device exist.
    check("cuFileDriverOpen", unsafe { f() })
}

/// `cuFileUseCount`: the driver's open count in this process (0: not open).
pub(in crate::storage) fn use_count(lib: &sys::Library) -> Result<i64> {
    let f = sym(lib.cuFileUseCount, "cuFileUseCount")?;
    // SAFETY: no arguments, reads an internal counter.
    Ok(unsafe { f() } as i64)
}

/// `cuFileDriverGetProperties`.
///
/// # Safety
/// As [`driver_open`]: libcuda must be loadable (without it the call prints a dlopen error
/// and returns `CU_FILE_CUDA_DRIVER_ERROR`).
pub(in crate::storage) unsafe fn driver_get_properties(
    lib: &sys::Library,
) -> Result<sys::CUfileDrvProps_t> {
    let _context = keep_context();
    let f = sym(lib.cuFileDriverGetProperties, "cuFileDriverGetProperties")?;
    // SAFETY: all-zero is a valid CUfileDrvProps_t (plain integers).
    let mut props: sys::CUfileDrvProps_t = unsafe { std::mem::zeroed() };
    // SAFETY: `props` is a valid out-pointer of the right size (layout-tested: 56 bytes).
    check("cuFileDriverGetProperties", unsafe { f(&mut props) })?;
    Ok(props)
}

/// `cuFileDriverSetPollMode(poll, threshold_kb)`.
pub(in crate::storage) fn driver_set_poll_mode(
    lib: &sys::Library,
    poll: bool,
    threshold_kb: usize,
) -> Result<()> {
    let f = sym(lib.cuFileDriverSetPollMode, "cuFileDriverSetPollMode")?;
    // SAFETY: plain values.
    check("cuFileDriverSetPollMode", unsafe { f(poll, threshold_kb) })
}

/// `cuFileDriverSetMaxDirectIOSize(kb)`.
pub(in crate::storage) fn driver_set_max_direct_io_size(
    lib: &sys::Library,
    kb: usize,
) -> Result<()> {
    let f = sym(
        lib.cuFileDriverSetMaxDirectIOSize,
        "cuFileDriverSetMaxDirectIOSize",
    )?;
    // SAFETY: plain value.
    check("cuFileDriverSetMaxDirectIOSize", unsafe { f(kb) })
}

/// `cuFileDriverSetMaxCacheSize(kb)`.
pub(in crate::storage) fn driver_set_max_cache_size(lib: &sys::Library, kb: usize) -> Result<()> {
    let f = sym(
        lib.cuFileDriverSetMaxCacheSize,
        "cuFileDriverSetMaxCacheSize",
    )?;
    // SAFETY: plain value.
    check("cuFileDriverSetMaxCacheSize", unsafe { f(kb) })
}

/// `cuFileDriverSetMaxPinnedMemSize(kb)`.
pub(in crate::storage) fn driver_set_max_pinned_mem_size(
    lib: &sys::Library,
    kb: usize,
) -> Result<()> {
    let f = sym(
        lib.cuFileDriverSetMaxPinnedMemSize,
        "cuFileDriverSetMaxPinnedMemSize",
    )?;
    // SAFETY: plain value.
    check("cuFileDriverSetMaxPinnedMemSize", unsafe { f(kb) })
}

/// `cuFileSetParameterSizeT(param, value)`.
pub(in crate::storage) fn set_parameter_size_t(
    lib: &sys::Library,
    param: u32,
    value: usize,
) -> Result<()> {
    let f = sym(lib.cuFileSetParameterSizeT, "cuFileSetParameterSizeT")?;
    // SAFETY: plain values; an unknown `param` is answered with INVALID_VALUE.
    check("cuFileSetParameterSizeT", unsafe { f(param, value) })
}

/// `cuFileSetParameterBool(param, value)`.
pub(in crate::storage) fn set_parameter_bool(
    lib: &sys::Library,
    param: u32,
    value: bool,
) -> Result<()> {
    let f = sym(lib.cuFileSetParameterBool, "cuFileSetParameterBool")?;
    // SAFETY: plain values.
    check("cuFileSetParameterBool", unsafe { f(param, value) })
}

/// `cuFileSetParameterString(param, value)`.
pub(in crate::storage) fn set_parameter_string(
    lib: &sys::Library,
    param: u32,
    value: &CStr,
) -> Result<()> {
    let f = sym(lib.cuFileSetParameterString, "cuFileSetParameterString")?;
    // SAFETY: `value` is NUL-terminated and outlives the call; cuFile copies it.
    check("cuFileSetParameterString", unsafe {
        f(param, value.as_ptr())
    })
}

/// `cuFileGetParameterSizeT(param, &value)`.
pub(in crate::storage) fn get_parameter_size_t(lib: &sys::Library, param: u32) -> Result<usize> {
    let f = sym(lib.cuFileGetParameterSizeT, "cuFileGetParameterSizeT")?;
    let mut v = 0usize;
    // SAFETY: `v` is a valid out-pointer.
    check("cuFileGetParameterSizeT", unsafe { f(param, &mut v) })?;
    Ok(v)
}

/// `cuFileGetParameterBool(param, &value)`.
pub(in crate::storage) fn get_parameter_bool(lib: &sys::Library, param: u32) -> Result<bool> {
    let f = sym(lib.cuFileGetParameterBool, "cuFileGetParameterBool")?;
    let mut v = false;
    // SAFETY: `v` is a valid out-pointer to a C `bool` (one byte, 0 or 1).
    check("cuFileGetParameterBool", unsafe { f(param, &mut v) })?;
    Ok(v)
}

/// `cuFileGetParameterString(param, buf, len)`.
pub(in crate::storage) fn get_parameter_string(lib: &sys::Library, param: u32) -> Result<String> {
    let f = sym(lib.cuFileGetParameterString, "cuFileGetParameterString")?;
    let mut buf = vec![0 as std::os::raw::c_char; 4096];
    // SAFETY: `buf` has `len` writable bytes; cuFile writes at most `len` including the NUL.
    check("cuFileGetParameterString", unsafe {
        f(param, buf.as_mut_ptr(), buf.len() as i32)
    })?;
    // Guarantee termination even if the library filled the buffer.
    *buf.last_mut().unwrap_or(&mut 0) = 0;
    // SAFETY: `buf` is NUL-terminated (set above) and lives for the borrow.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cuFileGetParameterMinMaxValue(param, &min, &max)` (1.15+).
pub(in crate::storage) fn get_parameter_min_max(
    lib: &sys::Library,
    param: u32,
) -> Result<(usize, usize)> {
    let f = sym(
        lib.cuFileGetParameterMinMaxValue,
        "cuFileGetParameterMinMaxValue",
    )?;
    let (mut lo, mut hi) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    check("cuFileGetParameterMinMaxValue", unsafe {
        f(param, &mut lo, &mut hi)
    })?;
    Ok((lo, hi))
}

/// `cuFileGetBARSizeInKB(gpu, &kb)` (1.15+).
pub(in crate::storage) fn get_bar_size_kb(lib: &sys::Library, gpu: i32) -> Result<usize> {
    let f = sym(lib.cuFileGetBARSizeInKB, "cuFileGetBARSizeInKB")?;
    let mut kb = 0usize;
    // SAFETY: valid out-pointer; an invalid index is answered with an error code.
    check("cuFileGetBARSizeInKB", unsafe { f(gpu, &mut kb) })?;
    Ok(kb)
}

// ---- Handles and buffers ----------------------------------------------------------------------

/// `cuFileHandleRegister` for a Linux file descriptor.
///
/// # Safety
/// The driver must be open (see [`driver_open`]). `fd` must stay open until the handle is
/// given to [`handle_deregister`].
pub(in crate::storage) unsafe fn handle_register(
    lib: &sys::Library,
    fd: i32,
) -> Result<sys::CUfileHandle_t> {
    let _context = keep_context();
    let f = sym(lib.cuFileHandleRegister, "cuFileHandleRegister")?;
    // SAFETY: all-zero is valid for the descriptor (null fs_ops, as DALI and PyTorch do).
    let mut descr: sys::CUfileDescr_t = unsafe { std::mem::zeroed() };
    descr.type_ = sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    descr.handle.fd = fd;
    let mut fh: sys::CUfileHandle_t = std::ptr::null_mut();
    // SAFETY: both pointers are valid for the call; cuFile copies the descriptor.
    check("cuFileHandleRegister", unsafe { f(&mut fh, &mut descr) })?;
    Ok(fh)
}

/// `cuFileHandleDeregister` (returns nothing).
///
/// # Safety
/// `fh` came from [`handle_register`], is deregistered once, and no IO on it is in flight.
pub(in crate::storage) unsafe fn handle_deregister(lib: &sys::Library, fh: sys::CUfileHandle_t) {
    let _context = keep_context();
    if let Some(f) = lib.cuFileHandleDeregister {
        // SAFETY: per the caller's contract.
        unsafe { f(fh) }
    }
}

/// `cuFileBufRegister(base, len, flags)`.
///
/// # Safety
/// `base..base+len` is device (or host) memory that stays allocated until
/// [`buf_deregister`] is called with the same `base`.
pub(in crate::storage) unsafe fn buf_register(
    lib: &sys::Library,
    base: *const c_void,
    len: usize,
    flags: i32,
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileBufRegister, "cuFileBufRegister")?;
    // SAFETY: per the caller's contract.
    check("cuFileBufRegister", unsafe { f(base, len, flags) })
}

/// `cuFileBufDeregister(base)`.
///
/// # Safety
/// `base` was registered with [`buf_register`] and no IO on it is in flight.
pub(in crate::storage) unsafe fn buf_deregister(
    lib: &sys::Library,
    base: *const c_void,
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileBufDeregister, "cuFileBufDeregister")?;
    // SAFETY: per the caller's contract.
    check("cuFileBufDeregister", unsafe { f(base) })
}

// ---- Synchronous IO ---------------------------------------------------------------------------

/// One `cuFileRead` call, decoded (may be short; 0 at end of file).
///
/// # Safety
/// `fh` is registered; `base + buf_offset .. + size` is writable device or host memory with no
/// other access in flight, and the memory's CUDA context is current on this thread.
pub(in crate::storage) unsafe fn read(
    lib: &sys::Library,
    fh: sys::CUfileHandle_t,
    base: *mut c_void,
    size: usize,
    file_offset: i64,
    buf_offset: i64,
) -> Result<usize> {
    let _context = keep_context();
    let f = sym(lib.cuFileRead, "cuFileRead")?;
    // SAFETY: per the caller's contract.
    let ret = unsafe { f(fh, base, size, file_offset, buf_offset) };
    decode_ssize("cuFileRead", ret)
}

/// One `cuFileWrite` call, decoded (may be short).
///
/// # Safety
/// As [`read`], with the memory readable instead of writable.
pub(in crate::storage) unsafe fn write(
    lib: &sys::Library,
    fh: sys::CUfileHandle_t,
    base: *const c_void,
    size: usize,
    file_offset: i64,
    buf_offset: i64,
) -> Result<usize> {
    let _context = keep_context();
    let f = sym(lib.cuFileWrite, "cuFileWrite")?;
    // SAFETY: per the caller's contract.
    let ret = unsafe { f(fh, base, size, file_offset, buf_offset) };
    decode_ssize("cuFileWrite", ret)
}

/// `cuFileReadv` (1.19+), decoded.
///
/// # Safety
/// As [`read`] for every element of `iov`.
pub(in crate::storage) unsafe fn readv(
    lib: &sys::Library,
    fh: sys::CUfileHandle_t,
    iov: &[sys::CUfileIOVec_t],
    file_offset: i64,
) -> Result<usize> {
    let _context = keep_context();
    let f = sym(lib.cuFileReadv, "cuFileReadv")?;
    // SAFETY: per the caller's contract; `iov` is valid for `iov.len()` elements.
    let ret = unsafe { f(fh, iov.as_ptr(), iov.len(), file_offset, 0) };
    decode_ssize("cuFileReadv", ret)
}

/// `cuFileWritev` (1.19+), decoded.
///
/// # Safety
/// As [`write`] for every element of `iov`.
pub(in crate::storage) unsafe fn writev(
    lib: &sys::Library,
    fh: sys::CUfileHandle_t,
    iov: &[sys::CUfileIOVec_t],
    file_offset: i64,
) -> Result<usize> {
    let _context = keep_context();
    let f = sym(lib.cuFileWritev, "cuFileWritev")?;
    // SAFETY: per the caller's contract.
    let ret = unsafe { f(fh, iov.as_ptr(), iov.len(), file_offset, 0) };
    decode_ssize("cuFileWritev", ret)
}

// ---- Stream-ordered IO ------------------------------------------------------------------------

/// `cuFileReadAsync` / `cuFileWriteAsync`.
///
/// # Safety
/// `fh` is registered; every pointer argument, the memory at `base`, and the handle stay
/// valid until `stream` has executed the operation (cuFile dereferences `size_p`,
/// `file_offset_p`, `buf_offset_p` and writes `bytes_p` at execution time); `bytes_p` points to
/// host memory that starts at 0; the stream's context is current.
#[allow(clippy::too_many_arguments)]
pub(in crate::storage) unsafe fn io_async(
    lib: &sys::Library,
    write: bool,
    fh: sys::CUfileHandle_t,
    base: *mut c_void,
    size_p: *mut usize,
    file_offset_p: *mut i64,
    buf_offset_p: *mut i64,
    bytes_p: *mut isize,
    stream: sys::CUstream,
) -> Result<()> {
    let _context = keep_context();
    if write {
        let f = sym(lib.cuFileWriteAsync, "cuFileWriteAsync")?;
        // SAFETY: per the caller's contract.
        check("cuFileWriteAsync", unsafe {
            f(
                fh,
                base,
                size_p,
                file_offset_p,
                buf_offset_p,
                bytes_p,
                stream,
            )
        })
    } else {
        let f = sym(lib.cuFileReadAsync, "cuFileReadAsync")?;
        // SAFETY: per the caller's contract.
        check("cuFileReadAsync", unsafe {
            f(
                fh,
                base,
                size_p,
                file_offset_p,
                buf_offset_p,
                bytes_p,
                stream,
            )
        })
    }
}

/// `cuFileStreamRegister(stream, flags)`.
///
/// # Safety
/// `stream` is a live stream; [`stream_deregister`] must run before it is destroyed.
pub(in crate::storage) unsafe fn stream_register(
    lib: &sys::Library,
    stream: sys::CUstream,
    flags: u32,
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileStreamRegister, "cuFileStreamRegister")?;
    // SAFETY: per the caller's contract.
    check("cuFileStreamRegister", unsafe { f(stream, flags) })
}

/// `cuFileStreamDeregister(stream)`.
///
/// # Safety
/// `stream` was registered and is still alive.
pub(in crate::storage) unsafe fn stream_deregister(
    lib: &sys::Library,
    stream: sys::CUstream,
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileStreamDeregister, "cuFileStreamDeregister")?;
    // SAFETY: per the caller's contract.
    check("cuFileStreamDeregister", unsafe { f(stream) })
}

// ---- Batch IO ---------------------------------------------------------------------------------

/// `cuFileBatchIOSetUp(&h, nr)`.
pub(in crate::storage) fn batch_setup(
    lib: &sys::Library,
    nr: u32,
) -> Result<sys::CUfileBatchHandle_t> {
    let _context = keep_context();
    let f = sym(lib.cuFileBatchIOSetUp, "cuFileBatchIOSetUp")?;
    let mut h: sys::CUfileBatchHandle_t = std::ptr::null_mut();
    // SAFETY: `h` is a valid out-pointer.
    check("cuFileBatchIOSetUp", unsafe { f(&mut h, nr) })?;
    Ok(h)
}

/// `cuFileBatchIOSubmit(h, n, params, 0)`.
///
/// # Safety
/// `h` is a live batch; every buffer and file handle named in `params` stays valid until its
/// completion has been reaped or a cancel of the batch has succeeded.
pub(in crate::storage) unsafe fn batch_submit(
    lib: &sys::Library,
    h: sys::CUfileBatchHandle_t,
    params: &mut [sys::CUfileIOParams_t],
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileBatchIOSubmit, "cuFileBatchIOSubmit")?;
    // SAFETY: per the caller's contract; `params` is valid for its length.
    check("cuFileBatchIOSubmit", unsafe {
        f(h, params.len() as u32, params.as_mut_ptr(), 0)
    })
}

/// `cuFileBatchIOGetStatus(h, min_nr, &nr, events, timeout)`: fills a prefix of `events`.
///
/// # Safety
/// `h` is a live batch.
pub(in crate::storage) unsafe fn batch_get_status(
    lib: &sys::Library,
    h: sys::CUfileBatchHandle_t,
    min_nr: u32,
    events: &mut [sys::CUfileIOEvents_t],
    timeout: Option<Duration>,
) -> Result<usize> {
    let _context = keep_context();
    let f = sym(lib.cuFileBatchIOGetStatus, "cuFileBatchIOGetStatus")?;
    let mut nr = events.len() as u32;
    let mut ts = timeout.map(|d| libc::timespec {
        // Saturates: a huge timeout (Duration::MAX) must not wrap to a negative one.
        tv_sec: d.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_p = ts
        .as_mut()
        .map_or(std::ptr::null_mut(), |t| t as *mut libc::timespec);
    // SAFETY: `nr` is in/out (capacity in, count out), `events` has `nr` slots, `ts_p` is null
    // or valid for the call.
    check("cuFileBatchIOGetStatus", unsafe {
        f(h, min_nr, &mut nr, events.as_mut_ptr(), ts_p)
    })?;
    Ok((nr as usize).min(events.len()))
}

/// `cuFileBatchIOCancel(h)`.
///
/// # Safety
/// `h` is a live batch.
pub(in crate::storage) unsafe fn batch_cancel(
    lib: &sys::Library,
    h: sys::CUfileBatchHandle_t,
) -> Result<()> {
    let _context = keep_context();
    let f = sym(lib.cuFileBatchIOCancel, "cuFileBatchIOCancel")?;
    // SAFETY: per the caller's contract.
    check("cuFileBatchIOCancel", unsafe { f(h) })
}

/// `cuFileBatchIODestroy(h)` (returns nothing).
///
/// # Safety
/// `h` is a live batch with nothing in flight; it is not used again.
pub(in crate::storage) unsafe fn batch_destroy(lib: &sys::Library, h: sys::CUfileBatchHandle_t) {
    let _context = keep_context();
    if let Some(f) = lib.cuFileBatchIODestroy {
        // SAFETY: per the caller's contract.
        unsafe { f(h) }
    }
}

// ---- Statistics (1.15+) -----------------------------------------------------------------------

/// `cuFileSetStatsLevel(level)`.
pub(in crate::storage) fn set_stats_level(lib: &sys::Library, level: i32) -> Result<()> {
    let f = sym(lib.cuFileSetStatsLevel, "cuFileSetStatsLevel")?;
    // SAFETY: plain value.
    check("cuFileSetStatsLevel", unsafe { f(level) })
}

/// `cuFileGetStatsLevel(&level)`.
pub(in crate::storage) fn get_stats_level(lib: &sys::Library) -> Result<i32> {
    let f = sym(lib.cuFileGetStatsLevel, "cuFileGetStatsLevel")?;
    let mut level = 0;
    // SAFETY: valid out-pointer.
    check("cuFileGetStatsLevel", unsafe { f(&mut level) })?;
    Ok(level)
}

/// `cuFileStatsStart` / `cuFileStatsStop` / `cuFileStatsReset`.
pub(in crate::storage) fn stats_control(lib: &sys::Library, which: StatsControl) -> Result<()> {
    let (f, op) = match which {
        StatsControl::Start => (lib.cuFileStatsStart, "cuFileStatsStart"),
        StatsControl::Stop => (lib.cuFileStatsStop, "cuFileStatsStop"),
        StatsControl::Reset => (lib.cuFileStatsReset, "cuFileStatsReset"),
    };
    let f = sym(f, op)?;
    // SAFETY: no arguments.
    check(op, unsafe { f() })
}

/// Which statistics control call to make.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) enum StatsControl {
    Start,
    Stop,
    Reset,
}

/// `cuFileGetStatsL1` / `L3` into an over-sized buffer (the structs grew in 1.19).
pub(in crate::storage) fn get_stats(
    lib: &sys::Library,
    level: u8,
) -> Result<Box<sys::StatsBuffer>> {
    let mut buf = Box::new(sys::StatsBuffer::zeroed());
    let p = buf.0.as_mut_ptr();
    let rc = match level {
        1 => {
            let f = sym(lib.cuFileGetStatsL1, "cuFileGetStatsL1")?;
            // SAFETY: `buf` is 8 KiB, 8-aligned: larger than CUfileStatsLevel1_t of any
            // release (512 B in 1.15, 624 B in 1.19).
            unsafe { f(p.cast()) }
        }
        2 => {
            let f = sym(lib.cuFileGetStatsL2, "cuFileGetStatsL2")?;
            // SAFETY: as above (1024 B / 1136 B).
            unsafe { f(p.cast()) }
        }
        _ => {
            let f = sym(lib.cuFileGetStatsL3, "cuFileGetStatsL3")?;
            // SAFETY: as above (5000 B / 5112 B).
            unsafe { f(p.cast()) }
        }
    };
    check(
        match level {
            1 => "cuFileGetStatsL1",
            2 => "cuFileGetStatsL2",
            _ => "cuFileGetStatsL3",
        },
        rc,
    )?;
    Ok(buf)
}

/// A `CString` for a cuFile string parameter, or `InvalidArgument`.
pub(in crate::storage) fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
}

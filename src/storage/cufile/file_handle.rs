//! Files registered with cuFile (`cuFileHandleRegister`), synchronous IO, and the path report.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cufile_sys as sys;

use super::buffer::allocation_range;
use super::status::CuFileStatus;
use super::{result, Driver};
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};

/// Largest request per cuFile call: Linux moves at most 2 GiB − 4 KiB per read/write, which
/// bounds cuFile's POSIX path too (the one constant the engine uses as well).
pub use crate::storage::config::MAX_IO_PER_CALL;

/// A registered cuFile handle plus the file it belongs to. Shared (`Arc`) with in-flight
/// stream-ordered and batch IO, so the registration outlives every operation that uses it.
pub(in crate::storage) struct HandleInner {
    // Drop order: deregister (Drop body), then `file` closes, then `driver` is released.
    pub(in crate::storage) fh: sys::CUfileHandle_t,
    file: File,
    pub(in crate::storage) driver: Arc<Driver>,
}

// SAFETY: `fh` is an opaque cuFile handle; NVIDIA's API reference states that all cuFile APIs
// are thread-safe, so the handle may be used concurrently and deregistered from any thread.
// Deregistration happens once, in Drop, when the last `Arc` goes: every synchronous call
// borrows the handle for its duration and every stream-ordered or batch operation holds an
// `Arc` until it has completed, so none is in flight then. `mem::forget` of a handle or of an
// IO guard only leaks the registration and the descriptor; a panic unwinds through Drop.
unsafe impl Send for HandleInner {}
// SAFETY: as above; `HandleInner` has no interior mutability of its own (`File` is `Sync`).
unsafe impl Sync for HandleInner {}

impl Drop for HandleInner {
    fn drop(&mut self) {
        // SAFETY: `fh` was returned by cuFileHandleRegister and is deregistered only here; all
        // IO that used it holds this `Arc` and has completed (sync IO) or been synchronised by
        // its guard's Drop before releasing it.
        unsafe { result::handle_deregister(self.driver.lib(), self.fh) };
    }
}

/// How to open a file for [`CuFileHandle::open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Read only.
    Read,
    /// Read and write, creating the file if needed (not truncating).
    ReadWrite,
    /// Read and write, creating or truncating.
    Create,
}

/// A file registered with cuFile (`cuFileHandleRegister`); deregistered on drop
/// (`cuFileHandleDeregister`), then the owned [`File`] closes.
///
/// IO is synchronous and ordered against the buffer's cudarc stream: each call first
/// synchronises that stream (so kernels that produced or will read the buffer are done), and on
/// return the bytes are in place (cuFile's sync calls complete before returning). cuFile is not
/// ordered with any stream by itself. So a stream capturing a CUDA graph, which cannot be
/// synchronised, is refused up front ([`Error::Unsupported`]).
pub struct CuFileHandle {
    inner: Arc<HandleInner>,
    path: PathBuf,
    report: PathReport,
    o_direct: bool,
}

impl std::fmt::Debug for CuFileHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CuFileHandle")
            .field("path", &self.path)
            .field("o_direct", &self.o_direct)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl CuFileHandle {
    /// Registers an open file with cuFile (`cuFileHandleRegister`) and decides the path its IO
    /// will take. `path` names the file in errors and reports.
    ///
    /// The file may or may not be opened with `O_DIRECT` (cuFile 1.7+ opens its own O_DIRECT
    /// descriptor when needed); [`CuFileHandle::open`] tries O_DIRECT first.
    ///
    /// Errors: a directory, FIFO or other non-regular file → [`Error::InvalidArgument`] (no
    /// cuFile call); a refused registration → [`Error::CuFile`] with op
    /// `"cuFileHandleRegister"` — [`classify_registration_failure`] names its cause (on
    /// containers: udev data missing).
    pub fn register(driver: Arc<Driver>, file: File, path: &Path) -> Result<CuFileHandle> {
        Self::register_inner(driver, file, path, None)
    }

    /// Opens `path` and registers it. The descriptor is opened with O_DIRECT when the driver can
    /// take a direct path (nvidia-fs loaded or PCI P2PDMA enabled) and the filesystem accepts
    /// it (otherwise without, recording [`Cause::ODirectRefused`]); when only cuFile's
    /// compatibility (POSIX) path exists, O_DIRECT buys nothing, so the file is opened buffered
    /// and keeps the page cache. [`open_with`](Self::open_with) chooses explicitly.
    pub fn open(driver: Arc<Driver>, path: &Path, mode: OpenMode) -> Result<CuFileHandle> {
        let direct = driver.nvfs_loaded() || driver.p2pdma_enabled();
        Self::open_with(driver, path, mode, direct)
    }

    /// Opens `path` with (`o_direct = true`, falling back to buffered when the filesystem
    /// refuses, recorded as [`Cause::ODirectRefused`]) or without O_DIRECT, and registers it.
    pub fn open_with(
        driver: Arc<Driver>,
        path: &Path,
        mode: OpenMode,
        o_direct: bool,
    ) -> Result<CuFileHandle> {
        let mut opts = std::fs::OpenOptions::new();
        match mode {
            OpenMode::Read => opts.read(true),
            OpenMode::ReadWrite => opts.read(true).write(true).create(true),
            OpenMode::Create => opts.read(true).write(true).create(true).truncate(true),
        };
        let open_plain = |refused: Option<String>| {
            let f = opts
                .open(path)
                .map_err(|e| Error::io("open", Some(path.to_path_buf()), e))?;
            Self::register_inner(Arc::clone(&driver), f, path, refused)
        };
        if !o_direct {
            return open_plain(None);
        }
        let mut direct = opts.clone();
        direct.custom_flags(libc::O_DIRECT);
        match direct.open(path) {
            Ok(f) => Self::register_inner(Arc::clone(&driver), f, path, None),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open_plain(Some(e.to_string())),
            Err(e) => Err(Error::io("open", Some(path.to_path_buf()), e)),
        }
    }

    /// [`register`](Self::register), with the reason O_DIRECT was refused for `file` when the
    /// caller tried it (recorded in the path report).
    pub(in crate::storage) fn register_file(
        driver: Arc<Driver>,
        file: File,
        path: &Path,
        o_direct_refused: Option<String>,
    ) -> Result<CuFileHandle> {
        Self::register_inner(driver, file, path, o_direct_refused)
    }

    fn register_inner(
        driver: Arc<Driver>,
        file: File,
        path: &Path,
        o_direct_refused: Option<String>,
    ) -> Result<CuFileHandle> {
        let meta = file
            .metadata()
            .map_err(|e| Error::io("fstat", Some(path.to_path_buf()), e))?;
        let ft = meta.file_type();
        if !ft.is_file() {
            let kind = if ft.is_dir() {
                "a directory"
            } else if ft.is_fifo() {
                "a fifo"
            } else if ft.is_socket() {
                "a socket"
            } else if ft.is_block_device() || ft.is_char_device() {
                "a device node"
            } else {
                "not a regular file"
            };
            return Err(Error::InvalidArgument(format!(
                "{} is {kind}: cuFile registers regular files only",
                path.display()
            )));
        }
        let fd = file.as_raw_fd();
        // SAFETY: F_GETFL on a descriptor we own has no side effects.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        let o_direct = flags >= 0 && flags & libc::O_DIRECT != 0;
        // SAFETY: the driver is open (an Arc<Driver> exists only after cuFileDriverOpen
        // succeeded); `fd` stays open inside `HandleInner` until after deregistration.
        let fh =
            unsafe { result::handle_register(driver.lib(), fd) }.map_err(|e| with_path(e, path))?;
        let report = decide_path(&driver, path, meta.dev(), o_direct_refused);
        Ok(CuFileHandle {
            inner: Arc::new(HandleInner { fh, file, driver }),
            path: path.to_path_buf(),
            report,
            o_direct,
        })
    }

    /// The path this handle's IO takes, decided at registration from the driver's properties,
    /// the filesystem and the open flags. Per-call truth comes from cuFile's statistics
    /// ([`super::Stats`]), which are process-wide.
    pub fn path_report(&self) -> &PathReport {
        &self.report
    }

    /// The file's path as given at registration.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The owned file.
    pub fn file(&self) -> &File {
        &self.inner.file
    }

    /// True when the owned descriptor is open with O_DIRECT.
    pub fn is_o_direct(&self) -> bool {
        self.o_direct
    }

    /// The driver this handle is registered with.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.inner.driver
    }

    pub(in crate::storage) fn inner(&self) -> &Arc<HandleInner> {
        &self.inner
    }

    /// Reads up to `dst.len()` bytes from `file_offset` into device memory (`cuFileRead`,
    /// looped over short transfers and split at [`MAX_IO_PER_CALL`]). Returns the bytes read:
    /// fewer than asked only at end of file, 0 at or past it (as `pread`). A zero-length `dst`
    /// returns 0 without calling cuFile. The read is clamped to the file's size at the time of
    /// the call (`fstat`), so bytes of `dst` past the end of file are never written, and no byte
    /// outside `dst` is written either: the last piece of every read (up to 68 KiB) goes through
    /// a scratch device buffer and is copied into place, because cuFile's compatibility path
    /// moves whole blocks and was seen writing past what it reported.
    ///
    /// Ordering: `dst`'s stream is synchronised first; the bytes are in place on return.
    ///
    /// Errors: `dst`'s stream capturing a CUDA graph → [`Error::Unsupported`], before anything
    /// is enqueued (the call synchronises the stream, which a capture forbids).
    pub fn read<D: DevicePtrMut<u8>>(&self, dst: &mut D, file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing(dst.stream(), "CuFileHandle::read")?;
        let on = Arc::clone(dst.stream());
        self.read_after_capture_check(dst, file_offset, &on)
    }

    /// [`read`](Self::read) without its capture check, for the storage engine's calls, which
    /// refused a capturing stream once per call already. The call's own CUDA work (cudarc's
    /// access to `dst`, the synchronize before cuFile, the tail's scratch buffer and its copy)
    /// goes on `on`, a stream of `dst`'s context: `dst`'s own stream for [`read`](Self::read).
    pub(in crate::storage) fn read_after_capture_check<D: DevicePtrMut<u8>>(
        &self,
        dst: &mut D,
        file_offset: u64,
        on: &Arc<CudaStream>,
    ) -> Result<usize> {
        let len = dst.len();
        if len == 0 {
            return Ok(0);
        }
        check_range(file_offset, len)?;
        // Taken before cudarc's pointer and dropped after its record (both bind the buffer's
        // context): the caller's current context is put back as it was, also when none was.
        let _restore = crate::cuda::CurrentContext::save();
        // Its waits for `dst`'s users elsewhere made, or the call fails (`ordered_access`: an
        // error stored in the caller's object would skip them silently).
        let (ptr, sync) = crate::cuda::ordered::ordered_access(on, || dst.device_ptr_mut(on))?;
        let done = self.sync_io(false, on, ptr, len, file_offset, false);
        drop(sync);
        done
    }

    /// Like [`read`](Self::read) but fails unless exactly `dst.len()` bytes were read: a file
    /// that ends first gives [`Error::Io`] with `ErrorKind::UnexpectedEof`.
    pub fn read_exact<D: DevicePtrMut<u8>>(&self, dst: &mut D, file_offset: u64) -> Result<()> {
        crate::cuda::refuse_capturing(dst.stream(), "CuFileHandle::read_exact")?;
        let len = dst.len();
        if len == 0 {
            return Ok(());
        }
        check_range(file_offset, len)?;
        let stream: Arc<CudaStream> = Arc::clone(dst.stream());
        // Taken before cudarc's pointer and dropped after its record (both bind the buffer's
        // context): the caller's current context is put back as it was, also when none was.
        let _restore = crate::cuda::CurrentContext::save();
        // As in `read_after_capture_check`.
        let (ptr, sync) =
            crate::cuda::ordered::ordered_access(&stream, || dst.device_ptr_mut(&stream))?;
        let done = self.sync_io(false, &stream, ptr, len, file_offset, true);
        drop(sync);
        done.map(|_| ())
    }

    /// Writes `src` at `file_offset` (`cuFileWrite`, looped over short transfers). Returns the
    /// bytes written, always `src.len()` on success. Not durable until `file().sync_data()`.
    ///
    /// Ordering: `src`'s stream is synchronised first, so kernels that produced it are done.
    ///
    /// Errors: `src`'s stream capturing a CUDA graph → [`Error::Unsupported`], before anything
    /// is enqueued (as for [`read`](Self::read)).
    pub fn write<S: DevicePtr<u8>>(&self, src: &S, file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing(src.stream(), "CuFileHandle::write")?;
        self.write_after_capture_check(src, file_offset, src.stream())
    }

    /// [`write`](Self::write) without its capture check, for the storage engine's calls, which
    /// refused a capturing stream once per call already. The call's own CUDA work (cudarc's
    /// access to `src`, the synchronize before cuFile) goes on `on`, a stream of `src`'s
    /// context: `src`'s own stream for [`write`](Self::write).
    pub(in crate::storage) fn write_after_capture_check<S: DevicePtr<u8>>(
        &self,
        src: &S,
        file_offset: u64,
        on: &Arc<CudaStream>,
    ) -> Result<usize> {
        let len = src.len();
        if len == 0 {
            return Ok(0);
        }
        check_range(file_offset, len)?;
        // Taken before cudarc's pointer and dropped after its record (both bind the buffer's
        // context): the caller's current context is put back as it was, also when none was.
        let _restore = crate::cuda::CurrentContext::save();
        // As in `read_after_capture_check`.
        let (ptr, sync) = crate::cuda::ordered::ordered_access(on, || src.device_ptr(on))?;
        let done = self.sync_io(true, on, ptr, len, file_offset, true);
        drop(sync);
        done
    }

    /// Positional read, the same as [`read`](Self::read) (every cuFile call is positional; the
    /// name matches `pread(2)` for readers coming from POSIX).
    pub fn pread<D: DevicePtrMut<u8>>(&self, dst: &mut D, file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing(dst.stream(), "CuFileHandle::pread")?;
        let on = Arc::clone(dst.stream());
        self.read_after_capture_check(dst, file_offset, &on)
    }

    /// Positional write, the same as [`write`](Self::write).
    pub fn pwrite<S: DevicePtr<u8>>(&self, src: &S, file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing(src.stream(), "CuFileHandle::pwrite")?;
        self.write_after_capture_check(src, file_offset, src.stream())
    }

    fn sync_io(
        &self,
        write: bool,
        stream: &Arc<CudaStream>,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        file_offset: u64,
        exact: bool,
    ) -> Result<usize> {
        let op = if write { "cuFileWrite" } else { "cuFileRead" };
        self.inner.driver.enter(stream, true)?;
        let (base, _) = allocation_range(ptr)?;
        let buf_offset = ptr - base;
        let want = len;
        let done = if write {
            self.transfer(true, base, buf_offset, len, file_offset)?
        } else {
            // Reads stop at the file's end as it is now: cuFile's compatibility path may write
            // past the bytes it reports when a read crosses end of file, so gpudirect never
            // asks it to.
            let len = clamp_to_eof(&self.inner.file, &self.path, file_offset, len)?;
            self.read_inside(stream, ptr, len, file_offset)?
        };
        if exact && done < want {
            return Err(Error::io(
                op,
                Some(self.path.clone()),
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "{} {done} of {want} bytes at offset {file_offset}: the file ends first",
                        if write { "wrote" } else { "read" }
                    ),
                ),
            ));
        }
        Ok(done)
    }

    /// cuFile calls moving `len` bytes between the file at `file_offset` and the device
    /// memory at `base + buf_offset` (`base` the allocation's), looped over short transfers and
    /// split at [`MAX_IO_PER_CALL`]; stops early at a 0 return (end of file).
    fn transfer(
        &self,
        write: bool,
        base: cudarc::driver::sys::CUdeviceptr,
        buf_offset: u64,
        len: usize,
        file_offset: u64,
    ) -> Result<usize> {
        let lib = self.inner.driver.lib();
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(MAX_IO_PER_CALL);
            let foff = (file_offset + done as u64) as i64;
            let boff = (buf_offset + done as u64) as i64;
            // SAFETY: `base + boff .. + n` lies inside the live allocation behind `ptr` (the
            // caller's view of `len` bytes, borrowed for this call, or the scratch buffer of
            // `read_inside`); the context is current; the stream was synchronised so no kernel
            // touches the bytes concurrently; the handle is registered (owned by `inner`).
            let got = unsafe {
                if write {
                    result::write(lib, self.inner.fh, base as *const c_void, n, foff, boff)
                } else {
                    result::read(lib, self.inner.fh, base as *mut c_void, n, foff, boff)
                }
            }
            .map_err(|e| with_path(e, &self.path))?;
            if got == 0 {
                break;
            }
            done += got.min(n);
        }
        Ok(done)
    }

    /// Reads `len` bytes (already clamped to end of file) from `file_offset` into device memory
    /// at `ptr`, writing no device byte outside `ptr .. ptr + len`.
    ///
    /// cuFile's compatibility path moves whole 4 KiB blocks and was seen writing device bytes
    /// past what it reported (commit 00dac31; `gpu_cufile_read_stays_inside_the_view` measures
    /// raw `cuFileRead`), which would land in memory outside the caller's view — another view
    /// of the same allocation, or memory a kernel is reading. So the last piece (up to
    /// [`READ_OVERRUN`] plus the bytes to the next 4 KiB file boundary) goes through a scratch
    /// buffer with [`READ_OVERRUN`] bytes to spare, and is copied into place; everything before
    /// it is read directly (any overrun of it lands inside the range, where the tail read then
    /// writes the right bytes).
    pub(super) fn read_inside(
        &self,
        stream: &Arc<CudaStream>,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        file_offset: u64,
    ) -> Result<usize> {
        if len == 0 {
            return Ok(0);
        }
        let tail = protected_tail(file_offset, len);
        let body = len - tail;
        let mut got = 0;
        if body > 0 {
            let (base, _) = allocation_range(ptr)?;
            got = self.transfer(false, base, ptr - base, body, file_offset)?;
            if got < body {
                return Ok(got);
            }
        }
        // Allocated, used and freed on `stream` alone (for a non-blocking transfer, its side
        // stream), through the result layer (see `Scratch`).
        let scratch = Scratch::alloc(stream, tail + READ_OVERRUN)?;
        let sp = scratch.ptr();
        // The allocation is stream-ordered: it must exist before cuFile (unordered) uses it.
        // Through the result layer: cudarc's synchronize returns (and takes) an error stored in
        // the caller's object without synchronizing.
        crate::cuda::settle::synchronize(stream)?;
        let t = {
            let (sbase, _) = allocation_range(sp)?;
            self.transfer(false, sbase, sp - sbase, tail, file_offset + body as u64)?
        };
        if t > 0 {
            // SAFETY: `ptr + body .. + t` lies inside the caller's range (t <= tail); `sp .. + t`
            // inside the scratch buffer; both in the stream's context, which is current; the
            // stream is synchronised below, before the scratch buffer is freed or we return.
            unsafe {
                crate::cuda::result::mem::memcpy_dtod_async(
                    ptr + body as u64,
                    sp,
                    t,
                    stream.cu_stream(),
                )
            }?;
        }
        // As above: a skipped synchronize would return while the copy into the caller's memory
        // is still queued.
        crate::cuda::settle::synchronize(stream)?;
        Ok(got + t)
    }
}

/// Bytes a cuFile read may write past its range, as far as gpudirect guards against (see
/// `CuFileHandle::read_inside`).
pub(super) const READ_OVERRUN: usize = 64 << 10;

/// The last bytes of a read of `len` bytes at `file_offset` that go through a scratch buffer
/// (see `CuFileHandle::read_inside`): [`READ_OVERRUN`] plus the bytes from the last 4 KiB file
/// boundary to the end, or all of the read when it is shorter. Whatever cuFile writes past
/// the rest (up to `READ_OVERRUN`) lands in these bytes, which the copy from scratch then
/// writes.
pub(super) fn protected_tail(file_offset: u64, len: usize) -> usize {
    let to_block = ((file_offset + len as u64) % 4096) as usize;
    len.min(READ_OVERRUN + to_block)
}

/// Device memory that the protected last bytes of a read go through (see
/// `CuFileHandle::read_inside`), with [`READ_OVERRUN`] bytes to spare after what cuFile is asked
/// to write: allocated and freed in the order of a stream (`cuMemAllocAsync` /
/// `cuMemFreeAsync`; `cuMemAlloc` / `cuMemFree` where the device has no memory pools) through
/// gpudirect's result layer with the stream's context bound by `crate::cuda::bind`, never
/// through cudarc's `CudaStream::alloc` or `CudaSlice` drop: their `bind_to_thread` runs the
/// object's `check_err`, which takes an error stored in the caller's cudarc object (an error an
/// earlier call of the caller's could not return) and fails the read with it, and a
/// `CudaSlice` frees without binding, which fails (and leaks) on a thread whose current context
/// is another device's or none. The calling thread's current context is the caller's business:
/// every caller holds a `CurrentContext` guard that puts it back.
pub(super) struct Scratch {
    stream: Arc<CudaStream>,
    ptr: cudarc::driver::sys::CUdeviceptr,
    pooled: bool,
}

impl Scratch {
    /// `len` bytes on `stream` (stream-ordered: `stream` must be synchronised before cuFile,
    /// which is ordered with no stream, uses them). Leaves the stream's context current.
    pub(super) fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Scratch> {
        use crate::cuda::result as r;
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
        let ctx = stream.context();
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let pooled =
            r::device::attribute(ctx.cu_device(), CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? > 0;
        let ptr = if pooled {
            // SAFETY: the stream is alive (borrowed) in its context, current since the bind
            // above; its device has memory pools (asked above).
            unsafe { r::mem::alloc_async(len, stream.cu_stream()) }?
        } else {
            // SAFETY: the stream's context is current (bound above).
            unsafe { r::mem::alloc(len) }?
        };
        Ok(Scratch {
            stream: Arc::clone(stream),
            ptr,
            pooled,
        })
    }

    /// The device address of the first byte.
    pub(super) fn ptr(&self) -> cudarc::driver::sys::CUdeviceptr {
        self.ptr
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        use crate::cuda::result as r;
        if let Err(e) = crate::cuda::bind(self.stream.context()) {
            tracing::warn!(error = %e, "gpudirect: binding a scratch buffer's context failed; the buffer leaks");
            return;
        }
        let freed = if self.pooled {
            // SAFETY: `ptr` is this scratch buffer's live allocation in the stream's context,
            // current since the bind above; every use of it (cuFile's read, which its caller
            // waited for, and the copy out of it, queued on `stream`) is ordered before the free
            // on `stream` or finished.
            unsafe { r::mem::free_async(self.ptr, self.stream.cu_stream()) }
        } else {
            // SAFETY: as above; `cuMemFree` of `cuMemAlloc` memory waits for the work that may
            // use it.
            unsafe { r::mem::free(self.ptr) }
        };
        if let Err(e) = freed {
            tracing::warn!(error = %e, "gpudirect: freeing a scratch buffer failed");
        }
    }
}

/// `len`, shortened so that `file_offset + len` does not pass the end of `file` (0 at or past
/// it), from `fstat` at the time of the call.
pub(in crate::storage) fn clamp_to_eof(
    file: &File,
    path: &Path,
    file_offset: u64,
    len: usize,
) -> Result<usize> {
    let size = file
        .metadata()
        .map_err(|e| Error::io("fstat", Some(path.to_path_buf()), e))?
        .len();
    Ok(size.saturating_sub(file_offset).min(len as u64) as usize)
}

fn check_range(file_offset: u64, len: usize) -> Result<()> {
    let end = file_offset.checked_add(len as u64);
    if end.is_none_or(|e| e > i64::MAX as u64) {
        return Err(Error::InvalidArgument(format!(
            "file offset {file_offset} + {len} bytes exceeds the largest file offset (i64::MAX)"
        )));
    }
    Ok(())
}

fn with_path(e: Error, path: &Path) -> Error {
    match e {
        Error::Io {
            op,
            path: None,
            source,
        } => Error::Io {
            op,
            path: Some(path.to_path_buf()),
            source,
        },
        other => other,
    }
}

// ---- Path decision and failure classification --------------------------------------------------

/// The name of the filesystem holding `path` (`statfs` magic), e.g. `"ext4"`, `"overlay"`.
pub fn filesystem_type(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: all-zero is a valid statfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated; `st` is a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(fs_name(st.f_type as i64))
}

/// Names a `statfs` magic number.
pub(in crate::storage) fn fs_name(magic: i64) -> String {
    let name = match magic as u32 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x8584_58f6 => "ramfs",
        0x794c_7630 => "overlay",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x2fc1_2fc1 => "zfs",
        0x0BD0_0BD0 => "lustre",
        0x1983_0326 => "beegfs",
        0x4750_4653 => "gpfs",
        0x7371_7368 => "squashfs",
        0x0102_1997 => "9p",
        0xFF53_4D42 => "cifs",
        0xFE53_4D42 => "smb2",
        0x6a65_6a62 => "virtiofs",
        0x9fa0 => "proc",
        0x6265_6572 => "sysfs",
        0x1373 => "devtmpfs",
        0x4d44 => "vfat",
        0x5346_544e => "ntfs",
        0xF2F5_2010 => "f2fs",
        _ => return format!("unknown filesystem (statfs magic {magic:#x})"),
    };
    name.to_string()
}

/// Filesystems on which cuFile can do GPUDirect (with nvidia-fs or P2PDMA).
pub(in crate::storage) fn gds_capable_fs(fs: &str) -> bool {
    matches!(
        fs,
        "ext4" | "xfs" | "nfs" | "lustre" | "beegfs" | "gpfs" | "virtiofs"
    ) || fs.starts_with("wekafs")
}

pub(in crate::storage) fn udev_record(dev: u64) -> (String, PathBuf) {
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let device = format!("{maj}:{min}");
    let record = PathBuf::from(format!("/run/udev/data/b{device}"));
    (device, record)
}

fn decide_path(
    driver: &Driver,
    path: &Path,
    dev: u64,
    o_direct_refused: Option<String>,
) -> PathReport {
    let fs = filesystem_type(path).unwrap_or_else(|| "unknown".into());
    if driver.compat_forced() {
        return PathReport::fallback(
            TransferPath::CuFileCompat,
            Cause::ForcedByConfig {
                setting: "cuFile force_compat_mode (CUFILE_FORCE_COMPAT_MODE)".into(),
            },
        );
    }
    if !driver.nvfs_loaded() && !driver.p2pdma_enabled() {
        return PathReport::fallback(TransferPath::CuFileCompat, Cause::NoNvidiaFs);
    }
    if !gds_capable_fs(&fs) {
        return PathReport::fallback(
            TransferPath::CuFileCompat,
            Cause::FilesystemUnsupported { fs },
        );
    }
    if let Some(reason) = o_direct_refused {
        return PathReport::fallback(TransferPath::CuFileCompat, Cause::ODirectRefused { reason });
    }
    let _ = dev;
    PathReport::direct(TransferPath::Gds)
}

/// Names the cause of a failed [`CuFileHandle::register`] (or open) of `file`.
///
/// Checks, in order: a missing nvidia-fs where cuFile requires it (status 5001); O_DIRECT
/// refused (`EINVAL` from `open`, or status 5019/5020); a filesystem cuFile cannot use (virtual
/// filesystems — tmpfs, overlay, fuse, … — or status 5008); missing udev data for the file's
/// block device (`/run/udev/data/b<major>:<minor>` absent — cuFile's usual failure in
/// containers, reported as an internal error); otherwise [`Cause::CuFileRegistrationFailed`]
/// with the error's text.
pub fn classify_registration_failure(err: &Error, file: &Path) -> Cause {
    let code = match err {
        Error::CuFile { source, .. } => Some(source.code()),
        _ => None,
    };
    if code == Some(CuFileStatus::DRIVER_NOT_INITIALIZED) {
        return Cause::NoNvidiaFs;
    }
    if let Error::Io { source, .. } = err {
        if source.raw_os_error() == Some(libc::EINVAL) {
            return Cause::ODirectRefused {
                reason: source.to_string(),
            };
        }
    }
    if matches!(
        code,
        Some(CuFileStatus::INVALID_FILE_OPEN_FLAG | CuFileStatus::DIO_NOT_SET)
    ) {
        return Cause::ODirectRefused {
            reason: err.to_string(),
        };
    }
    let meta = std::fs::metadata(file).ok();
    let fs = filesystem_type(file);
    if let (Some(meta), Some(fs)) = (meta.as_ref(), fs.as_ref()) {
        let (maj, _) = (libc::major(meta.dev()), libc::minor(meta.dev()));
        // Major 0: an anonymous device (tmpfs, overlay, fuse, …) has no block device for
        // cuFile to look up.
        let virtual_fs = maj == 0
            && !matches!(
                fs.as_str(),
                "nfs" | "lustre" | "beegfs" | "gpfs" | "virtiofs"
            );
        if virtual_fs || code == Some(CuFileStatus::IO_NOT_SUPPORTED) {
            return Cause::FilesystemUnsupported { fs: fs.clone() };
        }
        if maj != 0 {
            let (device, record) = udev_record(meta.dev());
            if !record.exists() {
                return Cause::UdevDataMissing { device };
            }
        }
    }
    Cause::CuFileRegistrationFailed {
        reason: err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_names() {
        assert_eq!(fs_name(0xEF53), "ext4");
        assert_eq!(fs_name(0x0102_1994), "tmpfs");
        assert_eq!(fs_name(0x794c_7630), "overlay");
        assert!(fs_name(0x1234).contains("0x1234"));
        assert!(gds_capable_fs("ext4") && gds_capable_fs("xfs"));
        assert!(!gds_capable_fs("tmpfs") && !gds_capable_fs("overlay"));
    }

    #[test]
    fn classifier_names_causes() {
        let dir = std::env::temp_dir();
        let f = dir.join(format!("gpudirect-classify-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let nvfs = Error::CuFile {
            op: "cuFileHandleRegister",
            source: CuFileStatus::for_version(5001, 1150),
        };
        assert_eq!(classify_registration_failure(&nvfs, &f), Cause::NoNvidiaFs);
        let flags = Error::CuFile {
            op: "cuFileHandleRegister",
            source: CuFileStatus::for_version(5019, 1150),
        };
        assert!(matches!(
            classify_registration_failure(&flags, &f),
            Cause::ODirectRefused { .. }
        ));
        let einval = Error::io(
            "open",
            Some(f.clone()),
            std::io::Error::from_raw_os_error(libc::EINVAL),
        );
        assert!(matches!(
            classify_registration_failure(&einval, &f),
            Cause::ODirectRefused { .. }
        ));
        // An internal error: the answer depends on where the temp dir lives, and each answer
        // must be consistent with the machine.
        let internal = Error::CuFile {
            op: "cuFileHandleRegister",
            source: CuFileStatus::for_version(5030, 1150),
        };
        let meta = std::fs::metadata(&f).unwrap();
        let fs = filesystem_type(&f).unwrap();
        let cause = classify_registration_failure(&internal, &f);
        let maj = libc::major(meta.dev());
        match &cause {
            Cause::FilesystemUnsupported { fs: got } => {
                assert_eq!(got, &fs);
                assert_eq!(maj, 0, "{cause:?}");
            }
            Cause::UdevDataMissing { device } => {
                assert_eq!(device, &format!("{}:{}", maj, libc::minor(meta.dev())));
                assert!(!std::path::Path::new(&format!("/run/udev/data/b{device}")).exists());
            }
            Cause::CuFileRegistrationFailed { reason } => {
                assert!(reason.contains("5030"), "{reason}");
                let (_, rec) = udev_record(meta.dev());
                assert!(rec.exists(), "{cause:?}");
            }
            other => panic!("unexpected cause {other:?}"),
        }
        std::fs::remove_file(&f).unwrap();
    }
}

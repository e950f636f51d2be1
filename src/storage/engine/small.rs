//! The fast path for small device transfers: on the calling thread, through a pooled pinned
//! buffer, with the copy enqueued on the caller's own stream (so it is ordered after the work
//! already queued there without a separate synchronization) and one `cuStreamSynchronize`.
//! No engine, no thread, no dispatch: a 4 KiB read costs a `pread` plus a pinned copy.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

use super::io::{self, Fds};
use super::is_einval;
use super::plan::{align_down, align_up};
use crate::cuda::result::{mem, stream as cu_stream};
use crate::cuda::settle::{settle, Mark, Patience, Settled};
use crate::error::{Error, Result};
use crate::storage::config::DIRECT_ALIGN;

/// Transfers of at most this many bytes take the fast path (when the piece size is at least
/// this large: smaller pieces ask for parallelism).
pub(in crate::storage) const SMALL_MAX: usize = 1 << 20;

/// Buffer size: a small transfer plus the O_DIRECT over-read at both ends.
const BUF_LEN: usize = SMALL_MAX + 2 * DIRECT_ALIGN;

/// Page-locked small-transfer buffers at most (kept until `release`, never freed during a
/// transfer); more small transfers at once use unlocked buffers (their copies are staged by
/// the driver; freeing one is an `munmap`, which waits for no GPU work).
const PINNED_MAX: usize = 64;

/// Page-locked buffers in existence (kept or in use).
static PINNED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A page-aligned mapping of [`BUF_LEN`] bytes, page-locked (portable) when `.1`.
struct SmallBuf(*mut u8, bool);

// SAFETY: plain memory owned by this value; used by one transfer at a time.
unsafe impl Send for SmallBuf {}

impl SmallBuf {
    /// Needs a current context when `pinned`.
    fn new(pinned: bool) -> Result<SmallBuf> {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BUF_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::io("mmap", None, std::io::Error::last_os_error()));
        }
        let p = p.cast::<u8>();
        if !pinned {
            return Ok(SmallBuf(p, false));
        }
        // SAFETY: our live mapping of BUF_LEN bytes, unregistered before it is unmapped.
        if let Err(e) = unsafe { mem::host_register(p, BUF_LEN) } {
            // SAFETY: unmapping exactly the mapping made above.
            unsafe { libc::munmap(p.cast(), BUF_LEN) };
            return Err(e);
        }
        Ok(SmallBuf(p, true))
    }
}

impl Drop for SmallBuf {
    fn drop(&mut self) {
        // SAFETY: registered in new when `.1`; no copy uses it (every transfer synchronized,
        // or leaked the buffer).
        if !self.1 || unsafe { mem::host_unregister(self.0) }.is_ok() {
            if self.1 {
                PINNED.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
            // SAFETY: unmapping exactly our mapping.
            unsafe { libc::munmap(self.0.cast(), BUF_LEN) };
        }
    }
}

fn free_list() -> &'static Mutex<Vec<SmallBuf>> {
    static FREE: Mutex<Vec<SmallBuf>> = Mutex::new(Vec::new());
    &FREE
}

/// Frees the kept buffers (see `storage::release_engines`); returns the bytes freed.
pub(in crate::storage) fn release() -> usize {
    let bufs = std::mem::take(&mut *free_list().lock().unwrap_or_else(|p| p.into_inner()));
    let n = bufs.len();
    drop(bufs);
    n * BUF_LEN
}

/// Runs `f` with a pinned buffer of [`BUF_LEN`] bytes. `f` returns whether the buffer may be
/// reused: false when a copy out of or into it may still be in flight (it is then leaked).
fn with_buf<R>(f: impl FnOnce(*mut u8) -> (Result<R>, bool)) -> Result<R> {
    let buf = free_list().lock().unwrap_or_else(|p| p.into_inner()).pop();
    let buf = match buf {
        Some(b) => b,
        None => {
            use std::sync::atomic::Ordering::Relaxed;
            let pinned = PINNED
                .fetch_update(Relaxed, Relaxed, |n| (n < PINNED_MAX).then_some(n + 1))
                .is_ok();
            SmallBuf::new(pinned).inspect_err(|_| {
                if pinned {
                    PINNED.fetch_sub(1, Relaxed);
                }
            })?
        }
    };
    let (r, reusable) = f(buf.0);
    if !reusable {
        tracing::error!(
            "a small transfer could not drain its copy (its context is dead): leaking its pinned buffer"
        );
        std::mem::forget(buf);
    } else {
        // Every page-locked buffer is kept (at most PINNED_MAX) until `release`: dropping one
        // here would unregister it, and `cuMemHostUnregister` waits for all the context's work,
        // other streams' kernels included (tests/storage_gpu_stall_buffers.rs). An unlocked one
        // is unmapped (no GPU wait).
        if buf.1 {
            free_list()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(buf);
        }
    }
    r
}

/// Reads `[off, off + n)` (`n <= SMALL_MAX`; short at end of file, which `pread` finds: no
/// `fstat`) into device memory `dst` of `ctx`, the copy on `stream` (a live stream of `ctx`, or
/// null), waiting for it. `check(bytes read)` may refuse the bytes before they are copied.
/// Returns `(bytes, used O_DIRECT)`.
///
/// # Safety
/// `dst` must be device memory of `ctx` writable for `n` bytes, and `stream` ordered after
/// every access to it the caller needs respected (cudarc's `device_ptr_mut` on that stream).
#[allow(clippy::too_many_arguments)]
pub(in crate::storage) unsafe fn read(
    fds: &Fds,
    direct: bool,
    off: u64,
    n: usize,
    check: &dyn Fn(usize) -> Result<()>,
    ctx: &Arc<CudaContext>,
    dst: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<(usize, bool)> {
    debug_assert!(n <= SMALL_MAX);
    // The caller's thread is left as it was found (its current context put back).
    let _current = crate::cuda::CurrentContext::bind(ctx)?;
    with_buf(|buf| {
        let (got, head, odirect) = match read_host(fds, direct, off, n, buf) {
            Ok(x) => x,
            Err(e) => return (Err(e), true),
        };
        if let Err(e) = check(got) {
            return (Err(e), true);
        }
        if got == 0 {
            return (Ok((0, odirect)), true);
        }
        // SAFETY: buf[head..head + got] holds the payload, page-locked; dst has room for
        // n >= got bytes (contract); the copy is waited for right below.
        if let Err(e) = unsafe { mem::memcpy_htod_async(dst, buf.add(head), got, stream) } {
            return (Err(e), true);
        }
        // SAFETY: stream is live in the current context (contract).
        let synced = unsafe { cu_stream::synchronize(stream) };
        #[cfg(test)]
        let synced = hook_sync(fds, dst, off, got, synced);
        match synced {
            Ok(()) => (Ok((got, odirect)), true),
            // SAFETY: stream is live in ctx (contract).
            Err(e) => (Err(e), unsafe { settled(fds, ctx, stream) }),
        }
    })
}

/// After the synchronize of a small transfer's copy failed: waits until the copy completed or
/// its context is dead ([`crate::cuda::settle::settle`], [`Patience::Wait`]: the device memory
/// is the caller's, borrowed for the call), and says whether the pinned buffer may be reused
/// (the copy completed; after a dead context it is leaked, never unregistered). It waits on
/// an event recorded now ([`Mark`]), not on the stream: the stream is the caller's, which
/// other threads may keep feeding.
///
/// # Safety
/// `stream` must be a live stream of `ctx` (or null: its legacy default stream).
unsafe fn settled(fds: &Fds, ctx: &CudaContext, stream: sys::CUstream) -> bool {
    #[cfg(not(test))]
    let _ = fds;
    // SAFETY: the caller's contract; both outlive the mark (dropped in this function).
    let mut mark = unsafe { Mark::new(ctx.cu_ctx(), stream) };
    let s = settle(
        1,
        |_| {
            #[cfg(test)]
            if let Some(r) = super::faults::next_query_at(&fds.path) {
                return r;
            }
            mark.query()
        },
        Patience::Wait,
        "a small transfer's copy",
    );
    s == Settled::Complete
}

/// Test hook ([`super::faults::Fault::SmallSyncFails`]): the synchronize of a small transfer
/// of the file `fds` (its copy at device address `dev`, of `n` bytes at file offset `off`)
/// fails after the real one.
#[cfg(test)]
fn hook_sync(
    fds: &Fds,
    dev: sys::CUdeviceptr,
    off: u64,
    n: usize,
    synced: Result<()>,
) -> Result<()> {
    use super::faults::{self, Fault, Hit};
    if synced.is_ok() && faults::pending_at(&fds.path) == Some(Fault::SmallSyncFails) {
        let hit = Hit {
            dst: dev,
            copied: Some((0, off, n)),
        };
        if faults::fire_at(&fds.path, hit) {
            return Err(faults::drain_error());
        }
    }
    synced
}

/// Reads into the pinned buffer: `(payload bytes, head, used O_DIRECT)`.
fn read_host(
    fds: &Fds,
    direct: bool,
    off: u64,
    n: usize,
    buf: *mut u8,
) -> Result<(usize, usize, bool)> {
    if direct {
        if let Some(d) = fds.direct() {
            let io_off = align_down(off);
            let io_len = (align_up(off + n as u64) - io_off) as usize;
            let head = (off - io_off) as usize;
            // SAFETY: io_len <= n + 2 * DIRECT_ALIGN <= BUF_LEN; buf is page aligned.
            match unsafe { io::pread_direct_full(d, &fds.buffered, buf, io_len, io_off) } {
                Ok(got) => return Ok((got.saturating_sub(head).min(n), head, true)),
                Err(e) if is_einval(&e) => {
                    fds.direct_broken
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => return Err(fds.err("pread", e)),
            }
        }
    }
    // SAFETY: n <= BUF_LEN.
    let got =
        unsafe { io::pread_full(&fds.buffered, buf, n, off) }.map_err(|e| fds.err("pread", e))?;
    Ok((got, 0, false))
}

/// Writes `n <= SMALL_MAX` bytes of device memory `src` of `ctx` at `off`: copied on `stream`
/// into a pinned buffer, waited for, then written (O_DIRECT when `direct` and the range is
/// aligned). Returns whether O_DIRECT was used.
///
/// # Safety
/// `src` must be device memory of `ctx` readable for `n` bytes, `stream` ordered after every
/// write to it (cudarc's `device_ptr` on that stream).
pub(in crate::storage) unsafe fn write(
    fds: &Fds,
    direct: bool,
    off: u64,
    n: usize,
    ctx: &Arc<CudaContext>,
    src: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<bool> {
    debug_assert!(n <= SMALL_MAX);
    // The caller's thread is left as it was found (its current context put back).
    let _current = crate::cuda::CurrentContext::bind(ctx)?;
    with_buf(|buf| {
        // SAFETY: buf holds BUF_LEN >= n bytes, page-locked; src is readable for n bytes
        // (contract); waited for right below.
        if let Err(e) = unsafe { mem::memcpy_dtoh_async(buf, src, n, stream) } {
            return (Err(e), true);
        }
        // SAFETY: stream is live in the current context (contract).
        let synced = unsafe { cu_stream::synchronize(stream) };
        #[cfg(test)]
        let synced = hook_sync(fds, src, off, n, synced);
        if let Err(e) = synced {
            // SAFETY: stream is live in ctx (contract).
            return (Err(e), unsafe { settled(fds, ctx, stream) });
        }
        let aligned = off.is_multiple_of(DIRECT_ALIGN as u64) && n.is_multiple_of(DIRECT_ALIGN);
        if direct && aligned {
            if let Some(d) = fds.direct() {
                // SAFETY: buf holds n bytes, page aligned.
                match unsafe { io::pwrite_full(d, buf, n, off) } {
                    Ok(()) => return (Ok(true), true),
                    Err(e) if is_einval(&e) => {
                        fds.direct_broken
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => return (Err(fds.err("pwrite", e)), true),
                }
            }
        }
        // SAFETY: buf holds n bytes.
        let r = unsafe { io::pwrite_full(&fds.buffered, buf, n, off) }
            .map(|()| false)
            .map_err(|e| fds.err("pwrite", e));
        (r, true)
    })
}

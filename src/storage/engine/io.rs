//! File descriptors and the raw POSIX loops the engine runs on them.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::storage::config::{DIRECT_ALIGN, MAX_IO_PER_CALL};

/// How a file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct OpenMode {
    pub write: bool,
    pub create: bool,
    pub truncate: bool,
}

/// The two descriptors of one file: buffered (always) and O_DIRECT (when the filesystem
/// accepts it), both on the same inode.
#[derive(Debug)]
pub(in crate::storage) struct Fds {
    pub buffered: File,
    pub direct: Option<File>,
    /// Why O_DIRECT is unavailable, when it is.
    pub direct_refused: Option<String>,
    /// Set when an O_DIRECT call failed with EINVAL at run time: stop trying.
    pub direct_broken: AtomicBool,
    pub path: PathBuf,
    pub writable: bool,
    /// The file's size when it was opened (the `fstat` that checked its type).
    pub len_at_open: u64,
    /// The device of its filesystem (`st_dev`, fixed for an open file).
    pub dev: u64,
    /// Its inode number (`st_ino`): with `dev`, which file it is.
    pub ino: u64,
    /// Its `st_ctime` when it was opened (seconds, nanoseconds): see [`FileId`].
    pub ctime: (i64, i64),
}

impl Fds {
    /// Opens `path` (regular files only: directories, FIFOs, sockets and devices are an
    /// [`Error::InvalidArgument`]; a FIFO is opened non-blocking so the check cannot hang),
    /// with its O_DIRECT descriptor when the filesystem allows one.
    #[cfg_attr(not(test), allow(dead_code))] // the library opens through open_with
    pub fn open(path: &FsPath, mode: OpenMode) -> Result<Fds> {
        Self::open_with(path, mode, true)
    }

    /// [`open`](Self::open), opening the O_DIRECT descriptor only when `want_direct` (else it
    /// is absent, with the reason "not asked for").
    pub fn open_with(path: &FsPath, mode: OpenMode, want_direct: bool) -> Result<Fds> {
        let mut oo = std::fs::OpenOptions::new();
        oo.read(true)
            .write(mode.write)
            .create(mode.create)
            .truncate(mode.truncate)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC);
        if mode.create {
            oo.mode(0o644);
        }
        let buffered = match oo.open(path) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                return Err(not_regular(path, "a directory"))
            }
            Err(e) => return Err(Error::io("open", Some(path.to_path_buf()), e)),
        };
        let meta = buffered
            .metadata()
            .map_err(|e| Error::io("fstat", Some(path.to_path_buf()), e))?;
        if let Some(what) = not_a_file(meta.file_type()) {
            return Err(not_regular(path, what));
        }
        clear_nonblock(&buffered, path)?;
        let (direct, direct_refused) = if !want_direct {
            (
                None,
                Some("not asked for (no read of this batch would use it)".into()),
            )
        } else {
            match open_direct(&buffered, path, mode.write) {
                Ok(f) => (Some(f), None),
                Err(e) => (None, Some(e.to_string())),
            }
        };
        Ok(Fds {
            buffered,
            direct,
            direct_refused,
            direct_broken: AtomicBool::new(false),
            path: path.to_path_buf(),
            writable: mode.write,
            len_at_open: meta.len(),
            dev: std::os::unix::fs::MetadataExt::dev(&meta),
            ino: std::os::unix::fs::MetadataExt::ino(&meta),
            ctime: FileId::of(&meta).ctime,
        })
    }

    /// Which file this is, as it was when opened (see [`FileId`]).
    pub fn id(&self) -> FileId {
        FileId {
            dev: self.dev,
            ino: self.ino,
            ctime: self.ctime,
        }
    }

    /// The O_DIRECT descriptor, unless unavailable or broken.
    pub fn direct(&self) -> Option<&File> {
        if self.direct_broken.load(Ordering::Relaxed) {
            None
        } else {
            self.direct.as_ref()
        }
    }

    /// Current file size (`fstat`).
    pub fn size(&self) -> Result<u64> {
        self.buffered
            .metadata()
            .map(|m| m.len())
            .map_err(|e| self.err("fstat", e))
    }

    pub fn err(&self, op: &'static str, e: io::Error) -> Error {
        Error::io(op, Some(self.path.clone()), e)
    }
}

/// What a file of type `ft` is when it is not a regular file (`None` for a regular file), as
/// the errors name it.
fn not_a_file(ft: std::fs::FileType) -> Option<&'static str> {
    if ft.is_file() {
        None
    } else if ft.is_dir() {
        Some("a directory")
    } else if ft.is_fifo() {
        Some("a FIFO")
    } else if ft.is_socket() {
        Some("a socket")
    } else if ft.is_block_device() || ft.is_char_device() {
        Some("a device node")
    } else {
        Some("not a regular file")
    }
}

/// A file as a check found it: `st_dev` and `st_ino` (which file) and `st_ctime` (seconds,
/// nanoseconds: when its inode last changed). A later open that finds another `FileId` at the
/// path found another file or the same one changed: a file deleted and written again (ext4
/// gives the new file the freed inode number at once, so `st_ino` alone does not tell),
/// rewritten, truncated, renamed over. Not told apart: a change within the same tick of the
/// filesystem's clock as the file's last change before the check (a few ms on a kernel
/// without fine-grained timestamps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct FileId {
    pub dev: u64,
    pub ino: u64,
    pub ctime: (i64, i64),
}

impl FileId {
    pub fn of(m: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// What the check of a file by path found (see [`stat_readable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct PathStat {
    /// `st_size`.
    pub len: u64,
    /// Which file it is, as it was (see [`FileId`]).
    pub id: FileId,
}

/// Checks `path` for reading without opening it: `stat` (following links, as `open` does), a
/// regular file (else the [`Error::InvalidArgument`] [`Fds::open_with`] gives), readable by this
/// process (`faccessat` with the effective ids, `R_OK`: the permission check `open` would
/// make). A path that does not exist is the `stat`'s [`Error::Io`], one that is not readable
/// the `faccessat`'s (the errno `open` would give).
pub(in crate::storage) fn stat_readable(path: &FsPath) -> Result<PathStat> {
    use std::os::unix::ffi::OsStrExt;
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io("stat", Some(path.to_path_buf()), e))?;
    if let Some(what) = not_a_file(meta.file_type()) {
        return Err(not_regular(path, what));
    }
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::io(
            "open",
            Some(path.to_path_buf()),
            io::Error::new(io::ErrorKind::InvalidInput, "the path holds a NUL byte"),
        )
    })?;
    // SAFETY: a NUL-terminated path; no other pointer.
    if unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::R_OK, libc::AT_EACCESS) } != 0 {
        return Err(Error::io(
            "faccessat",
            Some(path.to_path_buf()),
            io::Error::last_os_error(),
        ));
    }
    Ok(PathStat {
        len: meta.len(),
        id: FileId::of(&meta),
    })
}

fn not_regular(path: &FsPath, what: &str) -> Error {
    Error::InvalidArgument(format!(
        "{} is {what}, not a regular file: pass the path of a regular file",
        path.display()
    ))
}

fn clear_nonblock(f: &File, path: &FsPath) -> Result<()> {
    // One F_SETFL of no flags, not F_GETFL then F_SETFL: F_SETFL sets only O_APPEND,
    // O_NONBLOCK, O_DIRECT, O_NOATIME (and FASYNC), and `open_with` opens with none of them
    // but O_NONBLOCK, so this clears exactly that (one syscall less per file: a batch of 10k
    // files opens each). The access mode and O_LARGEFILE are kept by the kernel.
    // SAFETY: fcntl on an fd we own; F_SETFL takes no pointer.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) } < 0 {
        return Err(Error::io(
            "fcntl",
            Some(path.to_path_buf()),
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Reopens the same inode with O_DIRECT (through /proc/self/fd, so a renamed or replaced path
/// cannot give another file; through the path when /proc is missing).
fn open_direct(f: &File, path: &FsPath, write: bool) -> io::Result<File> {
    let mut oo = std::fs::OpenOptions::new();
    oo.read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC);
    let proc = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
    let d = match oo.open(&proc) {
        Ok(d) => d,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => oo.open(path)?,
        Err(e) => return Err(e),
    };
    // The reopened descriptor must be the same file.
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (f.metadata()?, d.metadata()?);
    if a.dev() != b.dev() || a.ino() != b.ino() {
        return Err(io::Error::other("the path now names another file"));
    }
    Ok(d)
}

/// Makes room in this process's descriptor table for `extra` more open files at once, in one
/// step, before a batch opens them.
///
/// The kernel grows the table by doubling when an open needs a slot past its end, and in a
/// process with more than one thread each growth waits for an RCU grace period
/// (`expand_fdtable` calls `synchronize_rcu`). Opening 10,000 files from 16 threads grows it
/// 8 times; one growth straight to the final size waits once (CONTRIBUTING.md, "Costs behind
/// the storage engine's design"). Best effort and cheap when the
/// table is already large enough (one `fcntl`): capped below `RLIMIT_NOFILE`; errors ignored.
pub(in crate::storage) fn reserve_fds(extra: usize) {
    if extra < 64 {
        return;
    }
    let Some(low) = lowest_free_fd() else {
        return;
    };
    // Room for what is open now (about the lowest free descriptor), the batch, and a margin.
    grow_fd_table(low.saturating_add(extra).saturating_add(64), extra);
}

/// The lowest free descriptor number (`None` when it cannot be found): the one an `open`
/// gets, given back at once.
fn lowest_free_fd() -> Option<usize> {
    // SAFETY: a NUL-terminated path; O_PATH opens nothing for IO.
    let fd = unsafe { libc::open(c"/".as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: closing the descriptor just made.
    unsafe { libc::close(fd) };
    Some(fd as usize)
}

/// The soft `RLIMIT_NOFILE` (`usize::MAX` when unknown or unlimited).
fn soft_fd_limit() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        usize::MAX
    }
}

/// Grows the descriptor table in one step so that it holds descriptor `target` (capped below
/// the soft `RLIMIT_NOFILE`): best effort, errors ignored; a no-op when it is that large
/// already. `files` is for the trace line only.
fn grow_fd_table(target: usize, files: usize) {
    let target = target
        .min(soft_fd_limit().saturating_sub(1))
        .min(i32::MAX as usize);
    // SAFETY: a NUL-terminated path; O_PATH opens nothing for IO.
    let src = unsafe { libc::open(c"/".as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if src < 0 {
        return;
    }
    if target > src as usize {
        let t0 = super::trace::now_us();
        // SAFETY: fcntl on our descriptor, no pointers; the kernel allocates the lowest free
        // descriptor >= target, growing the table to hold it, and closes nothing.
        let high = unsafe { libc::fcntl(src, libc::F_DUPFD_CLOEXEC, target as libc::c_int) };
        if high >= 0 {
            // SAFETY: closing the descriptor just made.
            unsafe { libc::close(high) };
        }
        super::trace::mark(|| {
            format!(
                "descriptor table: room for {target} made in {:.3} ms ({files} files to open)",
                (super::trace::now_us() - t0) as f64 / 1e3
            )
        });
    }
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(src) };
}

/// This process's descriptor table now, as far as a batch's window needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) struct FdRoom {
    /// Descriptor slots the table has (`FDSize` in `/proc/self/status`; `None` when unknown).
    pub table: Option<usize>,
    /// Descriptors open (`/proc/self/fd`; else the lowest free descriptor).
    pub open: usize,
    /// The soft `RLIMIT_NOFILE` (`usize::MAX`: unlimited or unknown).
    pub limit: usize,
}

/// The process's descriptor table: its size, what is open, the soft limit (about 50 µs: two
/// small `/proc` reads).
pub(in crate::storage) fn fd_room() -> FdRoom {
    let table = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("FDSize:"))
                .and_then(|v| v.trim().parse().ok())
        });
    let open = match std::fs::read_dir("/proc/self/fd") {
        // Less the descriptor that lists them.
        Ok(d) => d.count().saturating_sub(1),
        Err(_) => lowest_free_fd().unwrap_or(64),
    };
    FdRoom {
        table,
        open,
        limit: soft_fd_limit(),
    }
}

/// Descriptors kept free beside a batch's window, for the rest of the process.
const FD_MARGIN: usize = 8;

/// How many files a job's window holds open at once, `per_file` descriptors each, for
/// `threads` workers, in a process whose table is `room`: twice the workers while the free
/// slots of the table allow it (no growth), at least one per worker when the table must grow
/// for that (then it grows once, here: `grow`), and fewer only when `RLIMIT_NOFILE` allows no
/// more (at least 1). Returns the window and whether the table must grow to hold it.
pub(in crate::storage) fn window_size(
    threads: usize,
    per_file: usize,
    room: FdRoom,
) -> (usize, bool) {
    let per = per_file.max(1);
    let threads = threads.max(1);
    let want = 2 * threads;
    let under_limit = room.limit.saturating_sub(room.open + FD_MARGIN) / per;
    // Without a known table size, assume the smallest the kernel keeps (64 slots).
    let table = room.table.unwrap_or(64);
    let in_table = table.saturating_sub(room.open + FD_MARGIN) / per;
    let fits = in_table.min(under_limit);
    if fits >= threads {
        (want.min(fits), false)
    } else if under_limit >= threads {
        (want.min(under_limit), true)
    } else {
        (under_limit.max(1), false)
    }
}

/// Grows the table (once) to hold a window of `files` files of `per_file` descriptors beside
/// what is open now.
pub(in crate::storage) fn grow_for_window(files: usize, per_file: usize, room: FdRoom) {
    grow_fd_table(room.open + files * per_file.max(1) + FD_MARGIN, files);
}

/// One positional read (`pread(2)`), the seam the read loops are tested through.
pub(in crate::storage) trait PositionalRead {
    /// Reads at most `len` bytes at `off` into `buf`.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes.
    unsafe fn pread_once(&self, buf: *mut u8, len: usize, off: u64) -> io::Result<usize>;
}

impl PositionalRead for File {
    unsafe fn pread_once(&self, buf: *mut u8, len: usize, off: u64) -> io::Result<usize> {
        if off > i64::MAX as u64 {
            return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
        }
        // SAFETY: the caller guarantees buf[..len] is writable.
        let r = unsafe { libc::pread(self.as_raw_fd(), buf.cast(), len, off as libc::off_t) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

/// Reads until `len` bytes or a read returns 0 (end of file); EINTR retried. Returns the
/// bytes read (short only at end of file).
fn read_loop(fd: &impl PositionalRead, buf: *mut u8, len: usize, off: u64) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(MAX_IO_PER_CALL);
        // SAFETY: the caller of the pub fns guarantees buf[..len] is writable; done + n <= len.
        match unsafe { fd.pread_once(buf.wrapping_add(done), n, off + done as u64) } {
            Ok(0) => break,
            Ok(r) => done += r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// `pread` until `len` bytes or end of file; EINTR retried. Returns the bytes read (short only
/// at end of file).
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes for the duration of the call.
pub(in crate::storage) unsafe fn pread_full(
    fd: &impl PositionalRead,
    buf: *mut u8,
    len: usize,
    off: u64,
) -> io::Result<usize> {
    read_loop(fd, buf, len, off)
}

/// An O_DIRECT read of the aligned span `[off, off + len)` into aligned `buf`, finished
/// through `buffered` (the same file without O_DIRECT) when the direct descriptor returns a
/// count that is not a multiple of [`DIRECT_ALIGN`]: such a short read is end of file on most
/// filesystems, but some (NFS, FUSE) return short direct reads before the end, and the next
/// O_DIRECT read at the unaligned position would fail. Short only at end of file.
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes for the duration of the call.
pub(in crate::storage) unsafe fn pread_direct_full(
    direct: &impl PositionalRead,
    buffered: &impl PositionalRead,
    buf: *mut u8,
    len: usize,
    off: u64,
) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(MAX_IO_PER_CALL / DIRECT_ALIGN * DIRECT_ALIGN);
        // SAFETY: buf[..len] is writable (contract); done + n <= len.
        match unsafe { direct.pread_once(buf.wrapping_add(done), n, off + done as u64) } {
            Ok(0) => return Ok(done),
            Ok(r) => {
                done += r;
                if !r.is_multiple_of(DIRECT_ALIGN) {
                    // Unaligned position now: the rest (if any) through the page cache.
                    let rest = read_loop(
                        buffered,
                        buf.wrapping_add(done),
                        len - done,
                        off + done as u64,
                    )?;
                    return Ok(done + rest);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// `pwrite` all `len` bytes; EINTR retried; a zero-byte write is an error.
///
/// # Safety
/// `buf` must be valid for reads of `len` bytes for the duration of the call.
pub(in crate::storage) unsafe fn pwrite_full(
    fd: &File,
    buf: *const u8,
    len: usize,
    off: u64,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(MAX_IO_PER_CALL);
        let pos = off + done as u64;
        // SAFETY: the caller guarantees buf[..len] is readable; done + n <= len.
        let r =
            unsafe { libc::pwrite(fd.as_raw_fd(), buf.add(done).cast(), n, pos as libc::off_t) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwrite wrote 0 bytes",
            ));
        }
        done += r as usize;
    }
    Ok(())
}

/// Preallocates `[off, off + len)` (`fallocate` mode 0) so parallel O_DIRECT writes are
/// overwrites of allocated blocks, which filesystems run concurrently. Best effort.
pub(in crate::storage) fn preallocate(fd: &File, off: u64, len: u64) {
    if len == 0 {
        return;
    }
    // SAFETY: fallocate on an fd we own, no pointers.
    let r = unsafe { libc::fallocate(fd.as_raw_fd(), 0, off as libc::off_t, len as libc::off_t) };
    if r != 0 {
        tracing::debug!(err = %io::Error::last_os_error(), "fallocate failed; writing without preallocation");
    }
}

/// About this many `mincore` calls sample one batch's ranges ([`cached_fractions`]; at least
/// one per range, so a batch of more ranges makes one call each): on the
/// H200 machine (a VM) a call cost about 0.6 µs, and 64 per range made a 221-tensor batch
/// spend 9 ms sampling before its engine job started (a `GPUDIRECT_TRACE=timing` owned
/// checkpoint load, 2026-12-01).
pub(in crate::storage) const SAMPLE_BUDGET: u64 = 512;

/// How many pages to sample of each range of `pages[i]` pages: `min(per_range, pages)` each
/// while their sum stays within `budget`; beyond, each range's share of `budget` by its pages,
/// at least one page for every range that has one.
pub(in crate::storage) fn sample_counts(pages: &[u64], per_range: u64, budget: u64) -> Vec<u64> {
    let full: Vec<u64> = pages.iter().map(|&p| p.min(per_range)).collect();
    if full.iter().sum::<u64>() <= budget {
        return full;
    }
    let all: u128 = pages.iter().map(|&p| u128::from(p)).sum();
    full.iter()
        .zip(pages)
        .map(|(&f, &p)| {
            let share = (u128::from(budget) * u128::from(p) / all.max(1)) as u64;
            share.clamp(1, f.max(1)).min(f)
        })
        .collect()
}

/// The fraction of each `(off, len)` range of one file found in the page cache, from up to
/// `samples` pages spread over each range, about [`SAMPLE_BUDGET`] pages in all (shared by the
/// ranges' sizes, at least one each: [`sample_counts`]) (`mmap` + `mincore`, no page is
/// touched; an empty range counts as cached; `None` for a range whose end overflows, and for
/// every range when the extent cannot be mapped), through one mapping of their extent: a
/// batch of hundreds of ranges (a checkpoint's tensors) pays one `mmap`/`munmap`, not one per
/// range (an `munmap` in a process whose engine workers run interrupts them all to flush their
/// TLBs).
pub(in crate::storage) fn cached_fractions(
    fd: &File,
    ranges: &[(u64, u64)],
    samples: usize,
) -> Vec<Option<f64>> {
    // An empty range counts as cached; one whose end overflows is never mapped (None).
    let mut out: Vec<Option<f64>> = ranges
        .iter()
        .map(|r| r.0.checked_add(r.1).map(|_| 1.0))
        .collect();
    let sampled = |r: &(u64, u64)| r.1 > 0 && r.0.checked_add(r.1).is_some();
    let live = || ranges.iter().filter(|r| sampled(r));
    let (Some(lo), Some(hi)) = (live().map(|r| r.0).min(), live().map(|r| r.0 + r.1).max()) else {
        return out;
    };
    let page = page_size() as u64;
    let map_off = lo / page * page;
    let Some(map_len) = usize::try_from((hi - map_off).div_ceil(page) * page).ok() else {
        return vec![None; ranges.len()];
    };
    // SAFETY: a fresh shared read-only mapping of our fd; unmapped below; never dereferenced.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            map_off as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return vec![None; ranges.len()];
    }
    let span = |&(off, len): &(u64, u64)| {
        let first = (off - map_off) / page;
        (first, (off + len - map_off).div_ceil(page) - first)
    };
    let pages: Vec<u64> = ranges
        .iter()
        .map(|r| if sampled(r) { span(r).1 } else { 0 })
        .collect();
    let counts = sample_counts(&pages, samples as u64, SAMPLE_BUDGET);
    for ((o, &(off, len)), &n) in out.iter_mut().zip(ranges).zip(&counts) {
        if !sampled(&(off, len)) {
            continue;
        }
        let (first, pages) = span(&(off, len));
        let n = n.clamp(1, pages);
        let mut resident = 0u64;
        let mut asked = 0u64;
        for i in 0..n {
            let pg = first + i * pages / n;
            let mut v = 0u8;
            // SAFETY: the address is page-aligned inside our mapping (pg < map_len / page);
            // `v` receives one byte for one page.
            let r = unsafe {
                libc::mincore(
                    p.cast::<u8>().add((pg * page) as usize).cast(),
                    page as usize,
                    &mut v,
                )
            };
            if r == 0 {
                asked += 1;
                resident += u64::from(v & 1);
            }
        }
        *o = (asked > 0).then(|| resident as f64 / asked as f64);
    }
    // SAFETY: unmapping exactly the mapping created above.
    unsafe { libc::munmap(p, map_len) };
    out
}

pub(in crate::storage) fn page_size() -> usize {
    // SAFETY: sysconf takes no pointer.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A file of `data`; reads at or past `short_at` (while `shorts` remain) return a short,
    /// unaligned count although the file goes on (what some NFS/FUSE O_DIRECT reads do).
    struct Fake<'a> {
        data: &'a [u8],
        short_at: u64,
        shorts: Cell<usize>,
        direct: bool,
    }

    impl PositionalRead for Fake<'_> {
        unsafe fn pread_once(&self, buf: *mut u8, len: usize, off: u64) -> io::Result<usize> {
            if self.direct
                && (!off.is_multiple_of(DIRECT_ALIGN as u64) || !len.is_multiple_of(DIRECT_ALIGN))
            {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            let off = off as usize;
            if off >= self.data.len() {
                return Ok(0);
            }
            let mut n = len.min(self.data.len() - off);
            if off as u64 >= self.short_at && self.shorts.get() > 0 {
                self.shorts.set(self.shorts.get() - 1);
                n = n.min(1000);
            }
            // SAFETY: buf holds len >= n bytes (contract).
            unsafe { std::ptr::copy_nonoverlapping(self.data[off..].as_ptr(), buf, n) };
            Ok(n)
        }
    }

    /// Many ranges sampled through one mapping give each range what sampling it alone gives,
    /// at any offset (unaligned, overlapping, empty, past the end of the file), and a range
    /// the page cache dropped (`POSIX_FADV_DONTNEED` after `fsync`, where the filesystem
    /// honours it) reads as uncached beside a cached one.
    #[test]
    fn many_ranges_sample_as_each_range_alone() {
        let dir = std::env::temp_dir().join(format!("gpudirect-residency-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f.bin");
        let mib = 1u64 << 20;
        let data: Vec<u8> = (0..8 * mib).map(|i| (i * 31 + 7) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let f = File::open(&p).unwrap();
        f.sync_all().unwrap();
        // SAFETY: advice on our own fd, no pointers.
        unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                (4 * mib) as libc::off_t,
                (4 * mib) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        let ranges = [
            (0, 4 * mib),
            (4 * mib, 4 * mib),
            (12_345, 3 * mib + 17),
            (3 * mib + 1, 2 * mib),
            (5 * mib, 0),
            (7 * mib + 4095, 1),
            (0, 8 * mib),
            (8 * mib + 99, mib),
            (u64::MAX - 10, 100),
        ];
        let many = cached_fractions(&f, &ranges, 64);
        for (k, &r) in ranges.iter().enumerate() {
            let alone = cached_fractions(&f, &[r], 64)[0];
            assert_eq!(many[k], alone, "range {k} {r:?}");
        }
        assert_eq!(many[4], Some(1.0), "an empty range counts as cached");
        assert_eq!(many[8], None, "a range whose end overflows is not sampled");
        let (head, tail) = (many[0].unwrap(), many[1].unwrap());
        assert!(head > 0.9, "the file was just written: {head}");
        if tail < 0.5 {
            // The filesystem dropped the pages (ext4, xfs): the whole file is in between.
            let whole = many[6].unwrap();
            assert!(
                whole > tail && whole < head,
                "{whole} not between {tail} and {head}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The sampling budget: under it every range gets `min(per_range, pages)` samples; over it
    /// the sum stays within the budget (plus one per range at most, as each range with pages
    /// gets one), no range gets more than it would alone, and larger ranges get no fewer.
    #[test]
    fn sample_counts_stay_within_the_budget_and_give_every_range_one() {
        use rand::{Rng, SeedableRng};
        assert_eq!(sample_counts(&[1000, 3, 0], 64, 512), vec![64, 3, 0]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..500 {
            let n = rng.random_range(0..2000);
            let pages: Vec<u64> = (0..n)
                .map(|_| match rng.random_range(0..4) {
                    0 => 0,
                    1 => rng.random_range(1..10),
                    _ => rng.random_range(1..100_000),
                })
                .collect();
            let c = sample_counts(&pages, 64, 512);
            let sum: u64 = c.iter().sum();
            let full: u64 = pages.iter().map(|&p| p.min(64)).sum();
            let with_pages = pages.iter().filter(|&&p| p > 0).count() as u64;
            if full <= 512 {
                assert_eq!(sum, full);
            } else {
                assert!(sum <= 512 + with_pages, "{sum} samples for {n} ranges");
            }
            for (&k, &p) in c.iter().zip(&pages) {
                assert!(k <= p.min(64));
                assert_eq!(k == 0, p == 0);
            }
            let mut by: Vec<(u64, u64)> = pages.iter().copied().zip(c.iter().copied()).collect();
            by.sort();
            assert!(
                by.windows(2).all(|w| w[0].1 <= w[1].1),
                "a larger range got fewer"
            );
        }
    }

    /// Issue 9 (smaller findings): a short O_DIRECT read before end of file must not be taken
    /// as end of file.
    #[test]
    fn a_short_direct_read_before_the_end_is_finished_not_truncated() {
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7 + 3) as u8).collect();
        for (short_at, shorts) in [(0u64, 1usize), (8192, 1), (8192, 3), (u64::MAX, 0)] {
            let direct = Fake {
                data: &data,
                short_at,
                shorts: Cell::new(shorts),
                direct: true,
            };
            let buffered = Fake {
                data: &data,
                short_at,
                shorts: Cell::new(shorts),
                direct: false,
            };
            let mut buf = vec![0u8; 32 * 1024];
            // SAFETY: buf holds its length.
            let got =
                unsafe { pread_direct_full(&direct, &buffered, buf.as_mut_ptr(), buf.len(), 4096) }
                    .unwrap();
            assert_eq!(got, buf.len(), "short_at {short_at} shorts {shorts}");
            assert!(buf[..] == data[4096..4096 + buf.len()], "data differs");
        }
        // Real end of file: short, and correct up to it.
        let direct = Fake {
            data: &data[..10_000],
            short_at: u64::MAX,
            shorts: Cell::new(0),
            direct: true,
        };
        let buffered = Fake {
            data: &data[..10_000],
            short_at: u64::MAX,
            shorts: Cell::new(0),
            direct: false,
        };
        let mut buf = vec![0u8; 16 * 1024];
        // SAFETY: buf holds its length.
        let got = unsafe { pread_direct_full(&direct, &buffered, buf.as_mut_ptr(), buf.len(), 0) }
            .unwrap();
        assert_eq!(got, 10_000);
        assert!(buf[..10_000] == data[..10_000]);
    }

    #[test]
    fn buffered_reads_loop_over_short_counts() {
        let data: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let f = Fake {
            data: &data,
            short_at: 0,
            shorts: Cell::new(10),
            direct: false,
        };
        let mut buf = vec![0u8; 40_000];
        assert_eq!(
            read_loop(&f, buf.as_mut_ptr(), buf.len(), 5).unwrap(),
            40_000
        );
        assert!(buf[..] == data[5..40_005]);
        assert_eq!(
            read_loop(&f, buf.as_mut_ptr(), buf.len(), 49_000).unwrap(),
            1000
        );
    }

    /// An opened file's descriptors are blocking again, keep the access mode asked for and
    /// close on exec, and carry the size and device an `fstat` gives now.
    #[test]
    fn opened_descriptors_are_blocking_with_their_access_mode_size_and_device() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("gpudirect-fds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        std::fs::write(&p, vec![7u8; 12_345]).unwrap();
        for write in [false, true] {
            let mode = OpenMode {
                write,
                create: false,
                truncate: false,
            };
            let fds = Fds::open(&p, mode).unwrap();
            let meta = std::fs::metadata(&p).unwrap();
            assert_eq!((fds.len_at_open, fds.dev), (12_345, meta.dev()));
            let files = std::iter::once(&fds.buffered).chain(fds.direct.as_ref());
            for (k, f) in files.enumerate() {
                // SAFETY: fcntl queries on descriptors we own.
                let (fl, fd) = unsafe {
                    (
                        libc::fcntl(f.as_raw_fd(), libc::F_GETFL),
                        libc::fcntl(f.as_raw_fd(), libc::F_GETFD),
                    )
                };
                assert!(fl >= 0 && fd >= 0);
                let want = if write { libc::O_RDWR } else { libc::O_RDONLY };
                assert_eq!(fl & libc::O_ACCMODE, want, "descriptor {k}, write {write}");
                assert_eq!(fl & libc::O_NONBLOCK, 0, "descriptor {k} is non-blocking");
                assert_ne!(
                    fd & libc::FD_CLOEXEC,
                    0,
                    "descriptor {k} is inherited by exec"
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

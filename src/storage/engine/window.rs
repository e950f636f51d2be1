//! A job's files opened as its pieces reach them, at most [`FdWindow::limit`] at once.
//!
//! A batch of 10,000 files by path cannot hold them all open: most systems give a process a
//! soft `RLIMIT_NOFILE` of 1024, and growing the descriptor table that far waits for an RCU
//! grace period in a multi-threaded process (`expand_fdtable` calls `synchronize_rcu`;
//! CONTRIBUTING.md, "Costs behind the storage engine's design"). So the batch checks its files
//! by path before the job ([`crate::storage::ReadBatch`]) and the job's workers open each file
//! when they are about to read a piece of it ([`FdWindow::acquire`]) and close it after its
//! last piece, as a loader of its own (open, read, close on each thread) would:
//!
//! - **Bounded.** At most `limit` files are open or being opened at once. A worker that needs a
//!   file when the window is full closes an open file no worker is reading (one whose later
//!   pieces come further on; it is opened again then), or, when every open file is being
//!   read, waits for a read to end. No deadlock: a worker holds a file only while it reads a
//!   piece of it (it waits for nothing else meanwhile), so every read ends and frees its file.
//! - **Checked.** Each open (and each reopen) is the open a `GpuFile` makes (`Fds::open_with`:
//!   non-blocking, so a FIFO that replaced the file cannot hang it; a type check; O_DIRECT when
//!   asked for) and must find the file the batch checked as it was (its `st_dev`, `st_ino` and
//!   `st_ctime`: `io::FileId`). A file that does not open, is no longer a regular file, is
//!   another file now or changed after the check (replaced, deleted and written again,
//!   rewritten, truncated: its ctime moved) fails its pieces with an [`Error::Io`] naming it
//!   (its items fail, never the job).
//! - **Descriptors run out.** An open that fails with `EMFILE`/`ENFILE` (another part of the
//!   process holds descriptors) closes an idle file of the window or waits for a read to end,
//!   and tries again, up to a number of tries for the whole window (reset by an open that
//!   succeeds): once spent, with no descriptor coming back, each open that runs out fails its
//!   piece at once.
//! - A task that is never read (its item failed, the job was cancelled or failed) leaves its
//!   file open until the window is dropped (by the caller, once the job returned).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::io::{Fds, FileId, OpenMode};
use crate::error::{Error, Result};

/// A file of a job that its window opens when a piece of it is about to be read.
#[derive(Debug, Clone)]
pub(in crate::storage) struct LazyFile {
    /// The path, opened as given (the batch checked it by this path).
    pub path: PathBuf,
    /// Open its O_DIRECT descriptor too (as the batch would have opened it).
    pub want_direct: bool,
    /// The file the batch checked, as it was then (its inode and `st_ctime`).
    pub id: FileId,
}

/// Where one file of the window stands.
enum Slot {
    /// Not open: never yet, or closed to make room while pieces of it remain.
    Closed { opened_before: bool },
    /// A worker is opening it (the others wait for it).
    Opening,
    /// Open; `users` workers are reading it.
    Open { fds: Arc<Fds>, users: usize },
    /// Its open failed: its later pieces fail the same way, without trying again.
    Failed(FailedOpen),
    /// Its last piece is done: closed for good.
    Done,
}

/// The error an open failed with, kept to give each of the file's pieces its own copy.
struct FailedOpen {
    op: &'static str,
    raw: Option<i32>,
    kind: std::io::ErrorKind,
    text: String,
}

impl FailedOpen {
    fn of(e: &Error) -> FailedOpen {
        match e {
            Error::Io { op, source, .. } => FailedOpen {
                op,
                raw: source.raw_os_error(),
                kind: source.kind(),
                text: source.to_string(),
            },
            other => FailedOpen {
                op: "open",
                raw: None,
                kind: std::io::ErrorKind::Other,
                text: other.to_string(),
            },
        }
    }

    fn error(&self, path: &Path) -> Error {
        let source = match self.raw {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(self.kind, self.text.clone()),
        };
        Error::io(self.op, Some(path.to_path_buf()), source)
    }
}

struct State {
    slots: Vec<Slot>,
    /// Pieces of each file not yet done (read, failed or skipped).
    left: Vec<usize>,
    /// Files open or being opened.
    open: usize,
    /// Files that were open with no reader when last seen (candidates to close for room;
    /// stale entries are skipped).
    idle: VecDeque<usize>,
    /// Workers waiting on the condition variable (a notification is a `futex` call: made only
    /// when someone waits).
    waiting: usize,
    /// Tries left to the opens that run out of descriptors, all together (see
    /// [`EMFILE_TRIES`]); reset by each open that succeeds.
    emfile_tries: usize,
}

/// What a window did (for the timing trace and the tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(in crate::storage) struct WindowStats {
    /// The most files open (or being opened) at once.
    pub peak: usize,
    /// Opens (reopens included).
    pub opens: usize,
    /// Opens of a file closed before to make room.
    pub reopens: usize,
    /// Times a worker waited for room (every open file being read).
    pub waits: usize,
    /// Opens that failed with `EMFILE`/`ENFILE` and were tried again.
    pub retries: usize,
    /// Time the opens and closes took, in all (µs; 0 unless tracing).
    pub open_us: u64,
    pub close_us: u64,
}

/// A job's lazily opened files (see the module docs).
pub(in crate::storage) struct FdWindow {
    files: Vec<LazyFile>,
    limit: usize,
    st: Mutex<State>,
    cv: Condvar,
    peak: AtomicUsize,
    opens: AtomicUsize,
    reopens: AtomicUsize,
    waits: AtomicUsize,
    retries: AtomicUsize,
    open_us: AtomicU64,
    close_us: AtomicU64,
    /// Test hook: runs on the opening worker right before each open, with the file's index
    /// (a test changes the file there, or counts the process's descriptors).
    #[cfg(test)]
    pub before_open: Option<Box<dyn Fn(usize) + Send + Sync>>,
}

// A job shares its window among its workers (the job's `Sync` relies on this).
const _: fn() = || {
    fn sync<T: Sync + Send>() {}
    sync::<FdWindow>();
};

/// How many times the window's opens that ran out of descriptors (`EMFILE`/`ENFILE`) are tried
/// again, in all, since its last open that succeeded (each try after closing an idle file of
/// its own or a nap of up to 5 ms: about 1 s on one worker). Once spent, such an open fails its
/// piece at once: with no descriptor coming back, 10,000 files fail in a moment, not in a
/// second of retries each.
const EMFILE_TRIES: usize = 200;

impl FdWindow {
    /// A window over `files`, file `k` read by `pieces[k]` pieces, holding at most `limit` (at
    /// least 1) open at once.
    pub fn new(files: Vec<LazyFile>, pieces: Vec<usize>, limit: usize) -> FdWindow {
        debug_assert_eq!(files.len(), pieces.len());
        let slots = files
            .iter()
            .map(|_| Slot::Closed {
                opened_before: false,
            })
            .collect();
        FdWindow {
            files,
            limit: limit.max(1),
            st: Mutex::new(State {
                slots,
                left: pieces,
                open: 0,
                idle: VecDeque::new(),
                waiting: 0,
                emfile_tries: EMFILE_TRIES,
            }),
            cv: Condvar::new(),
            peak: AtomicUsize::new(0),
            opens: AtomicUsize::new(0),
            reopens: AtomicUsize::new(0),
            waits: AtomicUsize::new(0),
            retries: AtomicUsize::new(0),
            open_us: AtomicU64::new(0),
            close_us: AtomicU64::new(0),
            #[cfg(test)]
            before_open: None,
        }
    }

    /// The most files this window holds open at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// File `k`'s path.
    pub fn path(&self, k: usize) -> &Path {
        &self.files[k].path
    }

    /// Files in the window.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn stats(&self) -> WindowStats {
        WindowStats {
            peak: self.peak.load(Ordering::Relaxed),
            opens: self.opens.load(Ordering::Relaxed),
            reopens: self.reopens.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            open_us: self.open_us.load(Ordering::Relaxed),
            close_us: self.close_us.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a change of the state (at most `timeout`, when given).
    fn wait<'g>(
        &self,
        mut g: MutexGuard<'g, State>,
        timeout: Option<Duration>,
    ) -> MutexGuard<'g, State> {
        g.waiting += 1;
        let mut g = match timeout {
            None => self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
            Some(t) => {
                self.cv
                    .wait_timeout(g, t)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
        g.waiting -= 1;
        g
    }

    /// Wakes the waiters, if any (the state changed under `g`).
    fn notify(&self, g: &State) {
        if g.waiting > 0 {
            self.cv.notify_all();
        }
    }

    /// Closes `fds` (outside the lock), timing it when tracing.
    fn close(&self, fds: Option<Arc<Fds>>) {
        if let Some(f) = fds {
            let t0 = super::trace::now_us();
            drop(f);
            if t0 != 0 {
                self.close_us
                    .fetch_add(super::trace::now_us() - t0, Ordering::Relaxed);
            }
        }
    }

    /// Takes an open file no worker is reading out of the window (it is closed by the caller,
    /// outside the lock, and opened again when a later piece needs it).
    fn evict(st: &mut State) -> Option<Arc<Fds>> {
        while let Some(k) = st.idle.pop_front() {
            if matches!(st.slots[k], Slot::Open { users: 0, .. }) {
                let Slot::Open { fds, .. } = std::mem::replace(
                    &mut st.slots[k],
                    Slot::Closed {
                        opened_before: true,
                    },
                ) else {
                    unreachable!("matched above")
                };
                st.open -= 1;
                return Some(fds);
            }
        }
        None
    }

    /// Counts one piece of file `k` done; the file is closed for good after its last (the
    /// caller closes what this returns, outside the lock).
    fn piece_done(st: &mut State, k: usize) -> Option<Arc<Fds>> {
        st.left[k] = st.left[k].saturating_sub(1);
        if st.left[k] > 0 {
            if matches!(st.slots[k], Slot::Open { users: 0, .. }) {
                st.idle.push_back(k);
            }
            return None;
        }
        match std::mem::replace(&mut st.slots[k], Slot::Done) {
            Slot::Open { fds, users } => {
                debug_assert_eq!(users, 0, "a file closed while a piece of it is read");
                st.open -= 1;
                Some(fds)
            }
            Slot::Opening => {
                // Not reachable (an open in flight belongs to a piece not yet done); keep it.
                st.slots[k] = Slot::Opening;
                None
            }
            _ => None,
        }
    }

    /// File `k`, opened (or already open) for one of its pieces: the piece is done (and the
    /// file closed when it was its last) when the returned guard drops. On `Err` (the file
    /// does not open, is not a regular file or is another file now: an [`Error::Io`] naming
    /// it) the piece counts as done.
    pub fn acquire(&self, k: usize) -> Result<Held<'_>> {
        let mut st = self.lock();
        loop {
            match &mut st.slots[k] {
                Slot::Open { fds, users } => {
                    *users += 1;
                    let fds = fds.clone();
                    return Ok(Held {
                        window: self,
                        k,
                        fds: Some(fds),
                    });
                }
                Slot::Failed(f) => {
                    let e = f.error(&self.files[k].path);
                    let close = Self::piece_done(&mut st, k);
                    drop(st);
                    self.close(close);
                    return Err(e);
                }
                Slot::Done => {
                    return Err(Error::io(
                        "IO engine",
                        Some(self.files[k].path.clone()),
                        std::io::Error::other(
                            "a piece read after its file's last piece (a bug in gpudirect: please report it)",
                        ),
                    ))
                }
                Slot::Opening => st = self.wait(st, None),
                Slot::Closed { opened_before } => {
                    let again = *opened_before;
                    if st.open >= self.limit {
                        match Self::evict(&mut st) {
                            Some(f) => {
                                drop(st);
                                self.close(Some(f));
                                st = self.lock();
                            }
                            None => {
                                self.waits.fetch_add(1, Ordering::Relaxed);
                                st = self.wait(st, None);
                            }
                        }
                        continue;
                    }
                    st.slots[k] = Slot::Opening;
                    st.open += 1;
                    self.peak.fetch_max(st.open, Ordering::Relaxed);
                    drop(st);
                    let unwinding = OpenUnwind { window: self, k };
                    let r = self.open(k);
                    std::mem::forget(unwinding);
                    st = self.lock();
                    match r {
                        Ok(fds) => {
                            st.emfile_tries = EMFILE_TRIES;
                            self.opens.fetch_add(1, Ordering::Relaxed);
                            if again {
                                self.reopens.fetch_add(1, Ordering::Relaxed);
                            }
                            let fds = Arc::new(fds);
                            st.slots[k] = Slot::Open {
                                fds: fds.clone(),
                                users: 1,
                            };
                            self.notify(&st);
                            return Ok(Held {
                                window: self,
                                k,
                                fds: Some(fds),
                            });
                        }
                        Err(e) if out_of_descriptors(&e) && st.emfile_tries > 0 => {
                            // Room elsewhere in the process ran out: give up an idle file of
                            // ours, or wait for a read to end, and try again.
                            st.emfile_tries -= 1;
                            self.retries.fetch_add(1, Ordering::Relaxed);
                            st.slots[k] = Slot::Closed {
                                opened_before: again,
                            };
                            st.open -= 1;
                            self.notify(&st);
                            match Self::evict(&mut st) {
                                Some(f) => {
                                    drop(st);
                                    self.close(Some(f));
                                    st = self.lock();
                                }
                                None if st.open > 0 => {
                                    st = self.wait(st, Some(Duration::from_millis(5)));
                                }
                                None => {
                                    drop(st);
                                    std::thread::sleep(Duration::from_millis(5));
                                    st = self.lock();
                                }
                            }
                        }
                        Err(e) => {
                            st.open -= 1;
                            st.slots[k] = Slot::Failed(FailedOpen::of(&e));
                            let close = Self::piece_done(&mut st, k);
                            self.notify(&st);
                            drop(st);
                            self.close(close);
                            return Err(e);
                        }
                    }
                }
            }
        }
    }

    /// A piece of file `k` that is not read (its item failed already) counts as done.
    pub fn skip(&self, k: usize) {
        let mut st = self.lock();
        let close = Self::piece_done(&mut st, k);
        self.notify(&st);
        drop(st);
        self.close(close);
    }

    fn release(&self, k: usize, fds: Arc<Fds>) {
        let mut st = self.lock();
        if let Slot::Open { users, .. } = &mut st.slots[k] {
            *users -= 1;
        }
        drop(fds);
        let close = Self::piece_done(&mut st, k);
        self.notify(&st);
        drop(st);
        self.close(close);
    }

    /// Opens file `k` as a `GpuFile` would and checks that it is the file the batch checked.
    fn open(&self, k: usize) -> Result<Fds> {
        let f = &self.files[k];
        #[cfg(test)]
        if let Some(h) = &self.before_open {
            h(k);
        }
        let t0 = super::trace::now_us();
        let mode = OpenMode {
            write: false,
            create: false,
            truncate: false,
        };
        let r = Fds::open_with(&f.path, mode, f.want_direct);
        if t0 != 0 {
            self.open_us
                .fetch_add(super::trace::now_us() - t0, Ordering::Relaxed);
        }
        let fds = r.map_err(|e| match e {
            Error::Io { .. } => e,
            // Not a regular file any more (a directory, a FIFO that replaced it): a file
            // error of its items, not of the job.
            other => Error::io(
                "open",
                Some(f.path.clone()),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("it changed after the batch checked it: {other}"),
                ),
            ),
        })?;
        if fds.id() != f.id {
            return Err(Error::io(
                "open",
                Some(f.path.clone()),
                std::io::Error::other(
                    "the path names another file, or the file changed, since the batch checked it (replaced, rewritten or truncated: its inode or ctime moved): run the batch again to read it as it is now",
                ),
            ));
        }
        Ok(fds)
    }
}

/// Armed around an open made outside the lock: should the open unwind (a panic), its drop
/// marks the file failed (its slot is not left "being opened": the workers waiting for it
/// would never wake), counts the piece done and wakes the waiters; the panic goes on.
struct OpenUnwind<'w> {
    window: &'w FdWindow,
    k: usize,
}

impl Drop for OpenUnwind<'_> {
    fn drop(&mut self) {
        let w = self.window;
        let mut st = w.lock();
        st.open -= 1;
        st.slots[self.k] = Slot::Failed(FailedOpen {
            op: "open",
            raw: None,
            kind: std::io::ErrorKind::Other,
            text: "the open of this file panicked (a bug in gpudirect: please report it)".into(),
        });
        let close = FdWindow::piece_done(&mut st, self.k);
        w.notify(&st);
        drop(st);
        w.close(close);
    }
}

fn out_of_descriptors(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. }
        if matches!(source.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)))
}

/// One piece's hold on an open file of a window (derefs to its descriptors); dropping it
/// counts the piece done.
pub(in crate::storage) struct Held<'w> {
    window: &'w FdWindow,
    k: usize,
    fds: Option<Arc<Fds>>,
}

impl std::ops::Deref for Held<'_> {
    type Target = Fds;
    fn deref(&self) -> &Fds {
        self.fds.as_deref().expect("held until dropped")
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.fds.take() {
            self.window.release(self.k, f);
        }
    }
}

#[cfg(test)]
impl FdWindow {
    /// Whether file `k` is open now.
    fn is_open(&self, k: usize) -> bool {
        matches!(self.lock().slots[k], Slot::Open { .. })
    }

    /// Whether every piece of every file is done and nothing is open.
    fn all_done(&self) -> bool {
        let st = self.lock();
        st.open == 0 && st.slots.iter().all(|s| matches!(s, Slot::Done))
    }
}

#[cfg(test)]
impl Held<'_> {
    /// The descriptors, weakly (they are closed once this is the only reference left).
    fn weak(&self) -> std::sync::Weak<Fds> {
        Arc::downgrade(self.fds.as_ref().expect("held"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::AtomicBool;

    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// `n` scratch files of random sizes (1 to `max` bytes) in a fresh directory: the
    /// directory, and each file as the window opens it with its bytes.
    fn files(name: &str, n: usize, max: usize, seed: u64) -> (PathBuf, Vec<(LazyFile, Vec<u8>)>) {
        let dir = crate::storage::testkit::scratch(&format!("window-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let v = (0..n)
            .map(|k| {
                let p = dir.join(format!("f{k}"));
                let data =
                    crate::storage::testkit::random(rng.random_range(1..=max), seed + k as u64);
                std::fs::write(&p, &data).unwrap();
                (lazy(&p), data)
            })
            .collect();
        (dir, v)
    }

    /// The window's record of the file at `p` as it is now.
    fn lazy(p: &Path) -> LazyFile {
        LazyFile {
            path: p.to_path_buf(),
            want_direct: false,
            id: FileId::of(&std::fs::metadata(p).unwrap()),
        }
    }

    /// Byte `off` of the file open in `fds` (every read checks the window gave the right file).
    fn byte_at(fds: &Fds, off: u64) -> u8 {
        let mut b = 0u8;
        // SAFETY: one byte of our stack.
        let n = unsafe { crate::storage::engine::io::pread_full(&fds.buffered, &mut b, 1, off) }
            .unwrap();
        assert_eq!(n, 1, "{}: short read at {off}", fds.path.display());
        b
    }

    /// A file read in several pieces is opened when its first piece is read (not before),
    /// once, and closed (its descriptors dropped) right after its last piece; the next file
    /// likewise; nothing is left open.
    #[test]
    fn a_file_read_in_several_pieces_is_opened_once_and_closed_after_its_last() {
        let (dir, f) = files("pieces", 2, 5000, 1);
        let w = FdWindow::new(f.iter().map(|(l, _)| l.clone()).collect(), vec![3, 2], 4);
        assert!(
            !w.is_open(0) && !w.is_open(1),
            "opened before its first piece"
        );
        let mut weak = None;
        for piece in 0..3 {
            let h = w.acquire(0).unwrap();
            assert_eq!(byte_at(&h, piece), f[0].1[piece as usize]);
            weak = Some(h.weak());
            drop(h);
            assert_eq!(w.is_open(0), piece < 2, "after piece {piece} of 3");
            assert!(!w.is_open(1), "file 1 opened before its first piece");
        }
        assert!(
            weak.unwrap().upgrade().is_none(),
            "file 0's descriptors outlived its last piece"
        );
        for piece in 0..2 {
            let h = w.acquire(1).unwrap();
            assert_eq!(byte_at(&h, piece), f[1].1[piece as usize]);
        }
        let s = w.stats();
        assert_eq!((s.opens, s.reopens, s.peak), (2, 0, 1), "{s:?}");
        assert!(w.all_done());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// 8 threads take 40 files' pieces (1 to 5 each) in random order through a window of 3:
    /// never more than 3 open (files that still have pieces are closed for room and opened
    /// again), every piece reads its own file, everything is closed at the end.
    #[test]
    fn the_window_never_holds_more_than_its_limit() {
        let (dir, f) = files("bound", 40, 64, 2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let pieces: Vec<usize> = f.iter().map(|_| rng.random_range(1..=5)).collect();
        let mut order: Vec<(usize, usize)> = pieces
            .iter()
            .enumerate()
            .flat_map(|(k, &n)| (0..n).map(move |p| (k, p)))
            .collect();
        order.shuffle(&mut rng);
        let w = FdWindow::new(
            f.iter().map(|(l, _)| l.clone()).collect(),
            pieces.clone(),
            3,
        );
        let next = AtomicUsize::new(0);
        let bad = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(k, p)) = order.get(i) else { break };
                    let h = w.acquire(k).unwrap();
                    let off = (p % f[k].1.len()) as u64;
                    if byte_at(&h, off) != f[k].1[off as usize] {
                        bad.store(true, Ordering::Relaxed);
                    }
                    std::thread::yield_now();
                });
            }
        });
        assert!(!bad.load(Ordering::Relaxed), "a piece read another file");
        let s = w.stats();
        assert!(
            s.peak <= 3,
            "{} files open at once in a window of 3",
            s.peak
        );
        assert!(s.opens >= 40 && s.reopens == s.opens - 40, "{s:?}");
        assert!(
            s.reopens > 0,
            "no file was closed for room: the test shows nothing: {s:?}"
        );
        assert!(w.all_done(), "files left open");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file that changed after the batch checked it (deleted, replaced by another file, by
    /// a FIFO, by a directory) fails each of its pieces with an `Error::Io` of `open` naming
    /// it, without hanging (a FIFO's open does not block) and without trying to open it again
    /// for its later pieces; the window then holds nothing.
    #[test]
    fn a_file_changed_after_the_check_fails_its_pieces_with_an_error_naming_it() {
        type Change = fn(&Path);
        let cases: [(&str, Change); 4] = [
            ("deleted", |p| std::fs::remove_file(p).unwrap()),
            ("replaced by another file", |p| {
                let other = p.with_extension("new");
                std::fs::write(&other, b"another file").unwrap();
                std::fs::rename(&other, p).unwrap();
            }),
            ("replaced by a FIFO", |p| {
                std::fs::remove_file(p).unwrap();
                let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }),
            ("replaced by a directory", |p| {
                std::fs::remove_file(p).unwrap();
                std::fs::create_dir(p).unwrap();
            }),
        ];
        for (what, change) in cases {
            let (dir, f) = files("changed", 1, 100, 3);
            let p = f[0].0.path.clone();
            let mut w = FdWindow::new(vec![f[0].0.clone()], vec![2], 4);
            let tries = Arc::new(AtomicUsize::new(0));
            let t = tries.clone();
            w.before_open = Some(Box::new(move |_| {
                t.fetch_add(1, Ordering::SeqCst);
            }));
            change(&p);
            for piece in 0..2 {
                match w.acquire(0) {
                    Err(Error::Io { op, path, source }) => {
                        assert_eq!(op, "open", "{what}, piece {piece}: {source}");
                        assert_eq!(path.as_deref(), Some(p.as_path()), "{what}");
                        if what == "deleted" {
                            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
                        }
                    }
                    Err(e) => panic!("{what}, piece {piece}: not an Error::Io: {e}"),
                    Ok(_) => panic!("{what}, piece {piece}: opened a file that changed"),
                }
            }
            assert_eq!(tries.load(Ordering::SeqCst), 1, "{what}: opened again");
            assert!(w.all_done(), "{what}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Deletes the file at `p` and writes `n` other random bytes at its path (ext4 gives the
    /// new file the freed inode number at once), after a pause longer than a tick of the
    /// filesystem's clock (so the new file's `st_ctime` differs on a kernel with coarse
    /// timestamps too).
    fn rewrite(p: &Path, n: usize, seed: u64) {
        std::thread::sleep(Duration::from_millis(25));
        std::fs::remove_file(p).unwrap();
        std::fs::write(p, crate::storage::testkit::random(n, seed)).unwrap();
    }

    /// A file deleted and written again at its path after the batch checked it (same length,
    /// other bytes; on ext4 the same inode number) is not the checked file: at its first open
    /// and at a reopen after the window closed it for room, its piece fails with an
    /// `Error::Io` of `open` naming it, never reads the new bytes.
    #[test]
    fn a_file_deleted_and_written_again_is_not_the_checked_file() {
        // First open.
        let (dir, f) = files("rewritten", 1, 4000, 5);
        let p = f[0].0.path.clone();
        let w = FdWindow::new(vec![f[0].0.clone()], vec![1], 4);
        rewrite(&p, f[0].1.len(), 50);
        match w.acquire(0) {
            Err(Error::Io { op, path, .. }) => {
                assert_eq!((op, path.as_deref()), ("open", Some(p.as_path())))
            }
            Err(e) => panic!("first open: not an Error::Io: {e}"),
            Ok(h) => panic!(
                "first open: opened the new file (byte 0 {} read, {} checked)",
                byte_at(&h, 0),
                f[0].1[0]
            ),
        }
        assert!(w.all_done());
        std::fs::remove_dir_all(&dir).unwrap();
        // Reopen after the window closed it for room (a window of 1, file 1 read between).
        let (dir, f) = files("rewritten-reopen", 2, 4000, 6);
        let p = f[0].0.path.clone();
        let w = FdWindow::new(f.iter().map(|(l, _)| l.clone()).collect(), vec![2, 1], 1);
        let h = w.acquire(0).unwrap();
        assert_eq!(byte_at(&h, 0), f[0].1[0]);
        drop(h);
        let h = w.acquire(1).unwrap();
        assert_eq!(byte_at(&h, 0), f[1].1[0]);
        drop(h);
        assert!(
            !w.is_open(0),
            "file 0 not closed for room: the test shows nothing"
        );
        rewrite(&p, f[0].1.len(), 60);
        match w.acquire(0) {
            Err(Error::Io { op, path, .. }) => {
                assert_eq!((op, path.as_deref()), ("open", Some(p.as_path())))
            }
            Err(e) => panic!("reopen: not an Error::Io: {e}"),
            Ok(h) => panic!(
                "reopen: opened the new file (byte 0 {} read, {} checked)",
                byte_at(&h, 0),
                f[0].1[0]
            ),
        }
        assert_eq!(w.stats().reopens, 0, "{:?}", w.stats());
        assert!(w.all_done());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An open that panics (a test hook, 300 ms into it) leaves no file "being opened" behind:
    /// a second worker waiting for the same file returns an error within 5 s (never hangs),
    /// the panicking piece counts as done, and the window ends with nothing open.
    #[test]
    fn a_panic_in_an_open_wakes_the_workers_waiting_for_that_file() {
        let (dir, f) = files("open-panics", 1, 100, 7);
        let mut w = FdWindow::new(vec![f[0].0.clone()], vec![2], 4);
        w.before_open = Some(Box::new(|_| {
            std::thread::sleep(Duration::from_millis(300));
            panic!("a test hook panics in the open");
        }));
        let w = Arc::new(w);
        let w1 = w.clone();
        let first = std::thread::spawn(move || {
            std::panic::catch_unwind(AssertUnwindSafe(|| w1.acquire(0).map(|_| ()))).is_err()
        });
        std::thread::sleep(Duration::from_millis(50));
        let (tx, rx) = std::sync::mpsc::channel();
        let w2 = w.clone();
        std::thread::spawn(move || {
            let r = w2.acquire(0).map(|_| ());
            let _ = tx.send(r);
        });
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Err(Error::Io { path, .. })) => {
                assert_eq!(path.as_deref(), Some(f[0].0.path.as_path()))
            }
            Ok(Err(e)) => panic!("not an Error::Io: {e}"),
            Ok(Ok(())) => panic!("the second piece opened a file whose open panicked"),
            Err(_) => panic!("the second worker still waits 5 s after the open panicked"),
        }
        assert!(first.join().unwrap(), "the hook did not panic");
        assert!(w.all_done(), "files left open or pieces not done");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Set in the child process of `with_no_descriptor_left_files_fail_at_once_not_each_after_retries`.
    const NO_FD_CHILD: &str = "GPUDIRECT_TEST_WINDOW_NO_FD_CHILD";

    /// With no descriptor left in the process (soft `RLIMIT_NOFILE` 64, every free one taken,
    /// in a child process that runs this test alone), 6 one-piece files read through a window
    /// of 1 by 4 threads all fail with `EMFILE`, in under 1 s in all: the window's retries are
    /// one budget, not a second of them for each file (10,000 files would take minutes). Run
    /// by the test harness, it starts that child and checks it.
    #[test]
    fn with_no_descriptor_left_files_fail_at_once_not_each_after_retries() {
        if std::env::var_os(NO_FD_CHILD).is_none() {
            let text = crate::storage::testkit::run_test_in_child(
                "storage::engine::window::tests::with_no_descriptor_left_files_fail_at_once_not_each_after_retries",
                &[(NO_FD_CHILD, "1")],
            );
            assert!(
                text.contains("no-fd child done") && text.contains("1 passed"),
                "{text}"
            );
            return;
        }
        let (dir, f) = files("no-fd", 6, 64, 8);
        // This child process runs this test alone.
        crate::storage::testkit::set_soft_nofile_limit(64);
        let w = FdWindow::new(f.iter().map(|(l, _)| l.clone()).collect(), vec![1; 6], 1);
        let next = AtomicUsize::new(0);
        let errors = Mutex::new(Vec::new());
        // The threads first (their stacks are no descriptors), then every descriptor taken.
        let start = std::sync::Barrier::new(5);
        let mut hogs = Vec::new();
        let t0 = std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    start.wait();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= 6 {
                            break;
                        }
                        match w.acquire(k) {
                            Ok(_) => panic!("file {k} opened with no descriptor left"),
                            Err(e) => errors.lock().unwrap().push((k, e)),
                        }
                    }
                });
            }
            while let Ok(f) = std::fs::File::open("/dev/null") {
                hogs.push(f);
            }
            let t0 = std::time::Instant::now();
            start.wait();
            t0
        });
        let took = t0.elapsed();
        drop(hogs);
        let errors = errors.into_inner().unwrap();
        assert_eq!(errors.len(), 6, "{errors:?}");
        for (k, e) in &errors {
            match e {
                Error::Io { source, .. } => {
                    assert_eq!(
                        source.raw_os_error(),
                        Some(libc::EMFILE),
                        "file {k}: {source}"
                    )
                }
                e => panic!("file {k}: not the EMFILE error: {e}"),
            }
        }
        assert!(
            took < Duration::from_secs(1),
            "6 files failed in {took:?}: {:?}",
            w.stats()
        );
        assert!(w.all_done(), "{:?}", w.stats());
        std::fs::remove_dir_all(&dir).unwrap();
        println!("no-fd child done in {took:?}: {:?}", w.stats());
    }

    /// Set in the child process of
    /// `a_window_that_runs_out_of_descriptors_closes_idle_files_and_tries_again`.
    const CHILD: &str = "GPUDIRECT_TEST_WINDOW_EMFILE_CHILD";

    /// A window whose process runs out of descriptors (soft `RLIMIT_NOFILE` 64 with all but 3
    /// taken by others, in a child process that runs this test alone): its opens that fail
    /// with `EMFILE` close files of its own no piece is reading, or wait for a read to end,
    /// and try again, so every piece of 12 files read through a window of 8 by 4 threads reads
    /// its own file; and with no descriptor left at all, a piece fails with the `EMFILE`
    /// error (no hang). Run by the test harness, it starts that child and checks it.
    #[test]
    fn a_window_that_runs_out_of_descriptors_closes_idle_files_and_tries_again() {
        if std::env::var_os(CHILD).is_none() {
            let text = crate::storage::testkit::run_test_in_child(
                "storage::engine::window::tests::a_window_that_runs_out_of_descriptors_closes_idle_files_and_tries_again",
                &[(CHILD, "1")],
            );
            assert!(
                text.contains("EMFILE child done") && text.contains("1 passed"),
                "{text}"
            );
            return;
        }
        let (dir, f) = files("emfile", 12, 64, 4);
        // This child process runs this test alone.
        crate::storage::testkit::set_soft_nofile_limit(64);
        // Take every free descriptor.
        let mut hogs = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hogs.push(f);
        }
        // 3 free for the window (and the threads' needs, none).
        hogs.truncate(hogs.len() - 3);
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let mut order: Vec<(usize, usize)> =
            (0..12).flat_map(|k| (0..3).map(move |p| (k, p))).collect();
        order.shuffle(&mut rng);
        let w = FdWindow::new(f.iter().map(|(l, _)| l.clone()).collect(), vec![3; 12], 8);
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(k, p)) = order.get(i) else { break };
                    let h = w
                        .acquire(k)
                        .unwrap_or_else(|e| panic!("piece {p} of file {k}: {e}"));
                    let off = (p % f[k].1.len()) as u64;
                    assert_eq!(byte_at(&h, off), f[k].1[off as usize], "file {k}");
                    std::thread::sleep(Duration::from_micros(200));
                });
            }
        });
        let s = w.stats();
        assert!(
            s.retries > 0,
            "no open ran out of descriptors: the test shows nothing: {s:?}"
        );
        assert!(s.peak <= 8 && w.all_done(), "{s:?}");
        // No descriptor at all: the piece fails with EMFILE.
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hogs.push(f);
        }
        let w = FdWindow::new(vec![f[0].0.clone()], vec![1], 8);
        let t0 = std::time::Instant::now();
        match w.acquire(0) {
            Err(Error::Io { source, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EMFILE), "{source}")
            }
            Err(e) => panic!("not the EMFILE error: {e}"),
            Ok(_) => panic!("opened with no descriptor left"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "gave up after {:?}",
            t0.elapsed()
        );
        drop(hogs);
        std::fs::remove_dir_all(&dir).unwrap();
        println!("EMFILE child done: {s:?}");
    }
}

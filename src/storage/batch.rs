//! Many transfers in one job: [`ReadBatch`] (files → device buffers), [`WriteBatch`] (device
//! buffers and host bytes → one file), and the sugar [`read_many`] and
//! [`GpuFile::read_ranges`].
//!
//! A batch is one engine job: the files it reads by path are checked by path in parallel on the
//! engine's workers (no descriptor held), then opened by the workers as the job reaches them and
//! closed after their last piece, a bounded window of them at once (so 100,000 files read
//! under the usual `RLIMIT_NOFILE` of 1024, and the descriptor table grows for them at most
//! once, when it lacks room for one file per worker);
//! every item's pieces are spread over the workers, reads are packed into the pinned segments so
//! that pieces contiguous in one destination share one host→device copy, and the call returns
//! once, with one [`BatchReport`].
//!
//! See [`ReadBatch`] for what a batch refuses and what it reports.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceSlice,
};
use serde::Serialize;

use super::backend;
use super::backend::cufile_glue;
use super::config::StorageConfig;
use super::cufile::CuFileHandle;
use super::engine::io::{self, Fds};
use super::engine::plan::{plan_item, Dir, Task};
use super::engine::window::{FdWindow, LazyFile};
use super::engine::{self, JobFile, Mem, Op, SegParams};
use super::file::{
    check_device, dst_bytes, eof_error, read_direct_many, seg_params_of, src_bytes, threads_for,
    DeviceDst, DeviceSrc, GpuFile, AUTO_DIRECT_MIN,
};
use super::options::{GpuFileOptions, Unopened};
use super::transfer::{Ctl, TransferControl};
use super::ODirect;
use crate::cuda::AnyBitPattern;
use crate::error::{Error, Result};
use crate::path::{PathReport, TransferPath};

/// A destination registered with [`ReadBatch::destination`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchDst(usize);

/// A device source registered with [`WriteBatch::source`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSrc(usize);

/// The items that took one path, in a [`BatchReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathShare {
    /// The path and, for a fallback, why.
    pub path: PathReport,
    /// Items that took it.
    pub items: usize,
    /// Their bytes.
    pub bytes: usize,
}

/// What a batch did. Returned only when every item was transferred completely.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BatchReport {
    /// Items in the batch.
    pub items: usize,
    /// Bytes moved (the sum of the items' lengths).
    pub bytes: usize,
    /// Wall time of the call, from `run` to its return (files opened and closed included).
    pub elapsed: Duration,
    /// The job's path: the path of the most bytes (see [`paths`](Self::paths) when items took
    /// different ones).
    pub path: PathReport,
    /// Every path taken, with its items and bytes.
    pub paths: Vec<PathShare>,
    /// Whether any byte went through O_DIRECT.
    pub odirect: bool,
    /// Distinct files.
    pub files: usize,
    /// Host↔device copies the engine issued for the job (one per run of payload contiguous in
    /// a pinned segment and in one buffer).
    pub copies: usize,
    /// Per item (in the order added): bytes moved, which is its length.
    pub item_bytes: Vec<usize>,
}

impl BatchReport {
    /// Throughput in GB/s (10⁹ bytes per second) over [`elapsed`](Self::elapsed).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-12) / 1e9
    }

    fn new(t0: Instant, item_bytes: Vec<usize>, paths: Vec<PathShare>, files: usize) -> Self {
        let path = paths
            .iter()
            .max_by_key(|p| p.bytes)
            .map(|p| p.path.clone())
            .unwrap_or_else(|| PathReport::direct(TransferPath::Unknown));
        BatchReport {
            items: item_bytes.len(),
            bytes: item_bytes.iter().sum(),
            elapsed: t0.elapsed(),
            path,
            paths,
            odirect: false,
            files,
            copies: 0,
            item_bytes,
        }
    }
}

impl std::fmt::Display for BatchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes in {} items from {} files in {:.3} s ({:.2} GB/s) via {}",
            self.bytes,
            self.items,
            self.files,
            self.elapsed.as_secs_f64(),
            self.gbps(),
            self.path
        )?;
        if self.paths.len() > 1 {
            write!(f, " and {} other paths", self.paths.len() - 1)?;
        }
        if self.odirect {
            f.write_str(" with O_DIRECT")?;
        }
        Ok(())
    }
}

/// Runs `prepare` (a preparation of the segment ring, which runs the `reserve` it is given
/// beside its own work) as best effort: an error is traced and logged, never returned, since
/// files that go through cuFile never use the ring and a job that does use it builds and locks
/// it itself and reports its own error. `reserve` (the caller's work beside it: checking the
/// batch's files, or making room in the descriptor table for files opened up front) runs
/// exactly once either way, also when `prepare` failed before running it.
fn prepare_best_effort(
    prepare: impl FnOnce(&mut dyn FnMut()) -> Result<()>,
    reserve: impl FnOnce(),
) {
    let mut reserve = Some(reserve);
    let r = prepare(&mut || {
        if let Some(f) = reserve.take() {
            f()
        }
    });
    if let Some(f) = reserve.take() {
        f();
    }
    if let Err(e) = r {
        engine::trace::mark(|| format!("ring preparation failed, left to the job: {e}"));
        tracing::debug!(error = %e, "could not prepare the segment ring beside the batch's opens; the job prepares it if it needs it");
    }
}

fn panicked() -> Error {
    Error::Io {
        op: "IO engine",
        path: None,
        source: std::io::Error::other(
            "an IO worker panicked (a bug in gpudirect: please report it)",
        ),
    }
}

/// [`Error::Cancelled`] for a batch: what moved in all, and the bytes of the leading items (in
/// the order added) that are complete.
fn cancelled<I>(
    items: &[I],
    moved: &[usize],
    complete: &[bool],
    len: impl Fn(&I) -> usize,
    total: usize,
) -> Error {
    Error::Cancelled {
        moved: moved.iter().sum(),
        prefix: items
            .iter()
            .zip(complete)
            .take_while(|(_, &c)| c)
            .map(|(it, _)| len(it))
            .sum(),
        total,
    }
}

fn refuse(index: usize, source: Error) -> Error {
    Error::BatchRefused {
        index,
        source: Box::new(source),
    }
}

fn check_range(off: u64, len: usize) -> Result<()> {
    match off.checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "file offset {off} + length {len} passes the largest file offset (2^63 - 1): use a smaller offset"
        ))),
    }
}

/// Adds the bytes of `items` to the share of `report`.
fn share(paths: &mut Vec<PathShare>, report: &PathReport, bytes: usize) {
    match paths.iter_mut().find(|p| p.path == *report) {
        Some(p) => {
            p.items += 1;
            p.bytes += bytes;
        }
        None => paths.push(PathShare {
            path: report.clone(),
            items: 1,
            bytes,
        }),
    }
}

/// The first pair of overlapping ranges `(buffer, start, end, item)`: the later item's index
/// and the other's. Empty ranges never overlap.
fn first_overlap(mut spans: Vec<(usize, u64, u64, usize)>) -> Option<(usize, usize)> {
    spans.retain(|s| s.2 > s.1);
    spans.sort_unstable();
    let mut worst: Option<(usize, usize)> = None;
    let mut prev: Option<(usize, u64, usize)> = None; // (buffer, furthest end, its item)
    for (b, start, end, item) in spans {
        if let Some((pb, pend, pitem)) = prev {
            if pb == b && start < pend {
                let pair = (item.max(pitem), item.min(pitem));
                if worst.is_none_or(|w| pair.0 < w.0) {
                    worst = Some(pair);
                }
            }
            if pb == b && pend >= end {
                continue;
            }
        }
        prev = Some((b, end, item));
    }
    worst
}

trait ErasedDst {
    fn bytes(&mut self) -> CudaViewMut<'_, u8>;
}

struct TypedDst<'a, T: AnyBitPattern>(CudaViewMut<'a, T>);

impl<T: AnyBitPattern> ErasedDst for TypedDst<'_, T> {
    fn bytes(&mut self) -> CudaViewMut<'_, u8> {
        dst_bytes(&mut self.0)
    }
}

trait ErasedSrc {
    fn bytes(&self) -> CudaView<'_, u8>;
}

struct TypedSrc<'a, T: cudarc::driver::DeviceRepr>(CudaView<'a, T>);

impl<T: cudarc::driver::DeviceRepr> ErasedSrc for TypedSrc<'_, T> {
    fn bytes(&self) -> CudaView<'_, u8> {
        src_bytes(&self.0)
    }
}

enum Source<'a> {
    Path(PathBuf),
    File(&'a GpuFile),
}

/// A destination of a [`ReadBatch`]: a caller's buffer, or one the batch allocates
/// ([`ReadBatch::new_destination`]).
enum Dst<'a> {
    Borrowed(Box<dyn ErasedDst + 'a>),
    New {
        stream: Arc<CudaStream>,
        len: usize,
    },
    /// Allocated by [`ReadBatch::run_with`]'s caller.
    Later {
        stream: Arc<CudaStream>,
        len: usize,
    },
}

/// Who allocates a destination the engine job waits for (a gate of the job).
enum Deferred {
    /// The batch's one new destination.
    New { stream: Arc<CudaStream>, len: usize },
    /// The caller's later destination of this index.
    Later(usize),
}

struct ReadItem_ {
    src: usize,
    file_offset: u64,
    len: usize,
    dst: usize,
    dst_offset: usize,
}

/// A [`ReadBatch::run_with`] that failed: its error, and whether copies into the later
/// destinations may still be queued.
#[derive(Debug)]
pub(crate) struct RunFailed {
    /// What failed.
    pub(crate) error: Error,
    /// No copy the batch issued can run any more: the later destinations may be freed. False
    /// only when a drain failed and the copies' state stayed unknown (the error is then the
    /// drain's [`Error::Cuda`]): they must be leaked.
    pub(crate) drained: bool,
}

/// Many reads into device buffers in one job.
///
/// Register each destination buffer once with [`destination`](Self::destination) (it stays
/// mutably borrowed until the batch is run or dropped), then add items: `len` bytes at
/// `file_offset` of a file into `dst` at byte `dst_offset`. Files named by path are read by the
/// batch with [`with_options`](Self::with_options)'s settings: checked by path before the job
/// (in parallel), then each opened (as [`GpuFile::open`] opens a file) when the job is about to
/// read its first piece and closed after its last, at most a few dozen at once (twice the
/// engine's workers, fewer when the process's descriptor table or `RLIMIT_NOFILE` has less
/// room), so a batch of any number of files holds about as many descriptors as a loader with
/// one file open per thread; [`read_file`](Self::read_file) takes an open [`GpuFile`], used as
/// it is. Items may share a file and a destination; their destination ranges must not overlap.
/// Destinations must be on one GPU.
///
/// Files that cuFile may move by DMA (their filesystem's cheap facts allow it: nvidia-fs or
/// P2PDMA, udev data, a supported filesystem; or [`Backend::CuFile`](super::Backend::CuFile),
/// [`CompatMode::CuFileRequired`](super::CompatMode::CuFileRequired)) and every file of a batch
/// whose options write are opened up front instead and held through the job, as before (on a
/// filesystem cuFile then turns down, only its first file is: the rest go through the window).
/// That path has not run on a machine with nvidia-fs.
///
/// # What a batch refuses, and what it reports
/// Before any byte moves, every item is checked; the **whole batch is refused** with
/// [`Error::BatchRefused`] naming the first bad item when one is bad: a path that does not
/// exist (the `stat`'s error), is not a regular file (directory, FIFO, socket, device) or that
/// this process may not read (the permission `open` would refuse), an item past end of file,
/// a file whose size is unknown (`fstat` says 0 but it has content, as on `/proc`), a
/// destination (or source) range outside its buffer, two items whose destination ranges overlap
/// (reads) or whose file ranges overlap (writes), offsets past the largest file offset,
/// destinations on different GPUs, a fallback refused by the policy. Nothing is moved then.
/// A destination (or, for a [`WriteBatch`], a source) whose stream is capturing a CUDA graph
/// is refused first, with [`Error::Unsupported`] naming the call: the batch waits for its
/// buffers' streams, which a capture does not run; no file is checked or opened then.
///
/// While the batch runs, a file error fails **its items only**: an IO error, or a file named by
/// path that changed between the check and the job's open of it (deleted, replaced by another
/// file, deleted and written again, rewritten or truncated: its inode or `st_ctime` moved; no
/// longer a regular file: an [`Error::Io`] of `open` naming it; a FIFO put in its place does
/// not block the open), or a file that passed the checks but does not open at the job (no
/// descriptor left, `EMFILE`/`ENFILE`, once the window has no file of its own to give up and
/// its retries are spent; `EACCES` from a security module; `EIO`: that open's [`Error::Io`]).
/// A file that shrank while it was open reads short (an end of file). The
/// others are completed, and the call returns [`Error::BatchFailed`] listing the failed items;
/// their destination ranges are unspecified, every other item is complete. A CUDA error fails
/// the whole job ([`Error::Cuda`]). `Ok` means every byte of every item is in place.
///
/// A file deleted before `run` refuses the batch (its check finds it missing). A file named by
/// path that is deleted while the batch runs fails its items when the job had not opened it
/// yet, and is read whole when it had (it stays open until its last piece), unless the window
/// closed it meanwhile to make room: the items of a file added far apart in a batch of more
/// files than the window holds may find it closed and open it again (the same checks apply).
/// A file passed open ([`read_file`](Self::read_file)) stays readable whatever happens to its
/// path.
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use gpudirect::storage::ReadBatch;
/// let stream = gpudirect::cuda::context(0)?.default_stream();
/// let files: Vec<std::path::PathBuf> = (0..10_000).map(|i| format!("data/{i}.bin").into()).collect();
/// let mut dst = stream.alloc_zeros::<u8>(files.len() * 100 << 10)?;
/// let mut batch = ReadBatch::new();
/// let d = batch.destination(&mut dst);
/// for (i, f) in files.iter().enumerate() {
///     batch.read(f, 0, 100 << 10, d, i * (100 << 10));
/// }
/// let report = batch.run()?;
/// println!("{report}");
/// # Ok(()) }
/// ```
///
/// A borrowed destination cannot go away while the batch holds it:
///
/// ```compile_fail
/// # fn f(stream: std::sync::Arc<cudarc::driver::CudaStream>) {
/// let mut buf = stream.alloc_zeros::<u8>(16).unwrap();
/// let mut batch = gpudirect::storage::ReadBatch::new();
/// let d = batch.destination(&mut buf);
/// drop(buf); // the batch borrows `buf` until it is run
/// batch.read("f", 0, 16, d, 0);
/// # }
/// ```
pub struct ReadBatch<'a> {
    options: GpuFileOptions,
    srcs: Vec<Source<'a>>,
    by_path: HashMap<PathBuf, usize>,
    by_file: HashMap<usize, usize>,
    dsts: Vec<Dst<'a>>,
    items: Vec<ReadItem_>,
    control: Option<TransferControl>,
    /// The entry point a refusal names (`ReadBatch::run`, `read_many`, ...).
    call: &'static str,
}

impl Default for ReadBatch<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ReadBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadBatch")
            .field("items", &self.items.len())
            .field("files", &self.srcs.len())
            .field("destinations", &self.dsts.len())
            .finish()
    }
}

impl<'a> ReadBatch<'a> {
    /// An empty batch; files it opens use [`GpuFile::options`]'s settings.
    pub fn new() -> Self {
        Self::with_options(GpuFile::options())
    }

    /// An empty batch whose files opened by path use `options` (engine settings, backend,
    /// fallback policy, device); the job's threads, piece and segment settings come from the
    /// first item's file.
    pub fn with_options(options: GpuFileOptions) -> Self {
        ReadBatch {
            options,
            srcs: Vec::new(),
            by_path: HashMap::new(),
            by_file: HashMap::new(),
            dsts: Vec::new(),
            items: Vec::new(),
            control: None,
            call: "ReadBatch::run",
        }
    }

    /// Counts the batch's progress in `control` and lets it cancel the batch from another
    /// thread: the engine stops between pieces, the pieces started finish and their copies
    /// drain, then [`run`](Self::run) returns [`Error::Cancelled`] (its `prefix` counts the
    /// leading items, in the order added, that are complete; other items' destination ranges
    /// are unspecified). A control cancelled before `run` refuses the batch before any byte
    /// moves.
    pub fn control(&mut self, control: &TransferControl) -> &mut Self {
        self.control = Some(control.clone());
        self
    }

    /// Registers a destination buffer (any [`DeviceDst`]: `CudaSlice<T>`, `CudaViewMut<T>`),
    /// borrowed until the batch is run; items address it by byte offset.
    pub fn destination<D>(&mut self, dst: &'a mut D) -> BatchDst
    where
        D: DeviceDst + ?Sized,
        D::Elem: 'a,
    {
        self.dsts
            .push(Dst::Borrowed(Box::new(TypedDst(dst.as_dst()))));
        BatchDst(self.dsts.len() - 1)
    }

    /// Registers a destination of `len` bytes that the batch allocates on `stream`
    /// (`crate::cuda::alloc_uninit`: `cuMemAlloc` from 64 MiB) and
    /// [`run_allocating`](Self::run_allocating) hands back: through the engine's segment ring
    /// it is allocated on the calling thread while the workers already read into the ring (the
    /// copies wait for it), as `GpuFile::read_to_gpu` does, so the allocation is
    /// not in front of the first read. At most one per batch. Bytes no item writes are left
    /// uninitialised: the caller must not expose them.
    pub(crate) fn new_destination(&mut self, stream: &Arc<CudaStream>, len: usize) -> BatchDst {
        self.dsts.push(Dst::New {
            stream: stream.clone(),
            len,
        });
        BatchDst(self.dsts.len() - 1)
    }

    /// Registers a destination of `len` bytes on `stream`'s device that the caller allocates
    /// while the batch reads: [`run_with`](Self::run_with)'s `alloc(k)` makes the `k`-th one
    /// registered. Only for items read by the engine (a file that goes through cuFile refuses
    /// the batch: allocate first and register the buffer with `destination`).
    pub(crate) fn later_destination(&mut self, stream: &Arc<CudaStream>, len: usize) -> BatchDst {
        self.dsts.push(Dst::Later {
            stream: stream.clone(),
            len,
        });
        BatchDst(self.dsts.len() - 1)
    }

    /// Adds an item: `len` bytes at `file_offset` of the file at `path` (opened by the batch)
    /// into `dst` at byte `dst_offset`.
    pub fn read(
        &mut self,
        path: impl AsRef<FsPath>,
        file_offset: u64,
        len: usize,
        dst: BatchDst,
        dst_offset: usize,
    ) -> &mut Self {
        let path = path.as_ref();
        let src = match self.by_path.get(path) {
            Some(&i) => i,
            None => {
                self.srcs.push(Source::Path(path.to_path_buf()));
                self.by_path.insert(path.to_path_buf(), self.srcs.len() - 1);
                self.srcs.len() - 1
            }
        };
        self.push(src, file_offset, len, dst, dst_offset)
    }

    /// Adds an item read from an open file.
    pub fn read_file(
        &mut self,
        file: &'a GpuFile,
        file_offset: u64,
        len: usize,
        dst: BatchDst,
        dst_offset: usize,
    ) -> &mut Self {
        let key = file as *const GpuFile as usize;
        let src = match self.by_file.get(&key) {
            Some(&i) => i,
            None => {
                self.srcs.push(Source::File(file));
                self.by_file.insert(key, self.srcs.len() - 1);
                self.srcs.len() - 1
            }
        };
        self.push(src, file_offset, len, dst, dst_offset)
    }

    fn push(
        &mut self,
        src: usize,
        file_offset: u64,
        len: usize,
        dst: BatchDst,
        dst_offset: usize,
    ) -> &mut Self {
        self.items.push(ReadItem_ {
            src,
            file_offset,
            len,
            dst: dst.0,
            dst_offset,
        });
        self
    }

    /// Items added.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when no item was added.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Runs the batch: returns when every item is in place (`Ok`), or when the batch was
    /// refused (nothing moved) or some items failed (see [`ReadBatch`]).
    ///
    /// The files named by path are checked in parallel on the engine's workers and the calling
    /// thread, and opened and closed by the workers as the job reads them; a panic while
    /// checking or opening one (a bug) is the same `Err` whichever thread took the file, never
    /// an unwind out of `run`. A panic while closing the files opened up front at the end is
    /// logged and leaves the result alone (the items are in place by then).
    pub fn run(self) -> Result<BatchReport> {
        self.run_allocating().map(|(r, _)| r)
    }

    /// [`run`](Self::run), handing back the buffer of [`new_destination`](Self::new_destination)
    /// (`None` when there was none). On `Err` the buffer is dropped, or leaked when copies
    /// into it may still be queued (a batch whose destinations are all its own does not wait
    /// for copies it could not drain).
    pub(crate) fn run_allocating(self) -> Result<(BatchReport, Option<CudaSlice<u8>>)> {
        self.run_inner(None, &mut true)
    }

    /// [`run`](Self::run) for a batch with [`later_destination`](Self::later_destination)s:
    /// `alloc(k)` is called once for each, in the order the engine's tasks first write them
    /// (the ones no item writes last), on the calling thread: through the segment ring while
    /// the workers already read (a segment's copies wait only for the destinations they write),
    /// otherwise before the job. It returns the destination's device address. When it fails
    /// the batch fails with its error, and the later destinations after it are not allocated.
    ///
    /// # Safety
    /// The address `alloc(k)` returns must be `len` (as registered) bytes of device memory in
    /// the context of the destination's stream that nothing else reads or writes until this
    /// returns, and that work on any stream may use at once (a stream-ordered allocation must
    /// have completed). It must stay allocated until this returns; when this fails with
    /// [`RunFailed::drained`] false, copies into it may still be queued: it must never be
    /// freed (leak it). (A batch with no borrowed destination does not wait for copies it
    /// could not drain; the error is then the drain's, an [`Error::Cuda`]. Every other failure
    /// leaves no copy in flight.)
    pub(crate) unsafe fn run_with(
        self,
        alloc: &mut dyn FnMut(usize) -> Result<sys::CUdeviceptr>,
    ) -> std::result::Result<BatchReport, RunFailed> {
        let mut drained = true;
        self.run_inner(Some(alloc), &mut drained)
            .map(|(r, _)| r)
            .map_err(|error| RunFailed { error, drained })
    }

    /// [`run_with`](Self::run_with)'s and [`run_allocating`](Self::run_allocating)'s body;
    /// sets `drained` to false when it fails with copies into the destinations possibly still
    /// queued ([`RunFailed::drained`]).
    fn run_inner(
        self,
        mut later_alloc: Option<&mut dyn FnMut(usize) -> Result<sys::CUdeviceptr>>,
        drained: &mut bool,
    ) -> Result<(BatchReport, Option<CudaSlice<u8>>)> {
        let t0 = Instant::now();
        let ReadBatch {
            options,
            srcs,
            mut dsts,
            items,
            control,
            call,
            ..
        } = self;
        // Each destination's length and stream (its view is taken again when the bytes move).
        let (dst_len, dst_stream): (Vec<usize>, Vec<Arc<CudaStream>>) = dsts
            .iter_mut()
            .map(|d| match d {
                Dst::Borrowed(b) => {
                    let v = b.bytes();
                    (v.len(), v.stream().clone())
                }
                Dst::New { stream, len } | Dst::Later { stream, len } => (*len, stream.clone()),
            })
            .unzip();
        // Before anything is allocated, opened or enqueued.
        crate::cuda::refuse_capturing_any(
            &dst_stream,
            &format!("{call}: a read into device memory"),
        )?;
        let new_dst: Vec<usize> = (0..dsts.len())
            .filter(|&k| matches!(dsts[k], Dst::New { .. }))
            .collect();
        if new_dst.len() > 1 {
            return Err(Error::InvalidArgument(
                "a batch allocates at most one destination (a bug in gpudirect: please report it)"
                    .into(),
            ));
        }
        let new_dst = new_dst.first().copied();
        // The later destinations, in registration order, and each destination's index there.
        let later: Vec<usize> = (0..dsts.len())
            .filter(|&k| matches!(dsts[k], Dst::Later { .. }))
            .collect();
        let mut later_of = vec![usize::MAX; dsts.len()];
        for (k, &d) in later.iter().enumerate() {
            later_of[d] = k;
        }
        if !later.is_empty() && later_alloc.is_none() {
            return Err(Error::InvalidArgument(
                "a batch with destinations the caller allocates run without its allocator (a bug in gpudirect: please report it)".into(),
            ));
        }
        // Allocates every later destination now (no engine job to overlap): their addresses.
        let alloc_later_now = |alloc: &mut Option<
            &mut dyn FnMut(usize) -> Result<sys::CUdeviceptr>,
        >|
         -> Result<Vec<sys::CUdeviceptr>> {
            match alloc {
                Some(f) => (0..later.len()).map(f).collect(),
                None => Ok(Vec::new()),
            }
        };
        // A new destination that no engine job can allocate while it reads is allocated now.
        let mut new_buf: Option<CudaSlice<u8>> = None;
        let alloc_new = |stream: &Arc<CudaStream>, len: usize| -> Result<CudaSlice<u8>> {
            // SAFETY: u8 accepts any bit pattern; the bytes no item writes stay unexposed
            // (new_destination's contract).
            unsafe { crate::cuda::alloc_uninit::<u8>(stream, len) }
        };
        if items.is_empty() {
            if let Some(Dst::New { stream, len }) = new_dst.map(|k| &dsts[k]) {
                new_buf = Some(alloc_new(stream, *len)?);
            }
            alloc_later_now(&mut later_alloc)?;
            return Ok((BatchReport::new(t0, Vec::new(), Vec::new(), 0), new_buf));
        }
        let counter = control.as_ref().map(|c| move |n: usize| c.add(n));
        let ctl = Ctl::blocking(
            t0,
            control.as_ref(),
            counter.as_ref().map(|f| f as &(dyn Fn(usize) + Sync)),
        );
        crate::cuda::driver_version()?;
        engine::trace::mark(|| {
            format!(
                "ReadBatch::run: {} items, {} sources",
                items.len(),
                srcs.len()
            )
        });
        // No destination is the caller's borrowed buffer: the engine's job need not wait for
        // copies it could not drain (their destinations are leaked instead).
        let owns_every_destination = !dsts.iter().any(|d| matches!(d, Dst::Borrowed(_)));
        // One context for every destination an item uses.
        for (i, it) in items.iter().enumerate() {
            if it.dst >= dsts.len() {
                return Err(refuse(
                    i,
                    Error::InvalidArgument(format!(
                        "destination {} was not registered with this batch: use the BatchDst its destination() returned",
                        it.dst
                    )),
                ));
            }
        }
        let ctx = dst_stream[items[0].dst].context().clone();
        for (i, it) in items.iter().enumerate() {
            let c = dst_stream[it.dst].context();
            if c.cu_ctx() != ctx.cu_ctx() {
                return Err(refuse(
                    i,
                    Error::InvalidArgument(format!(
                        "its destination is on GPU {} and the first item's on GPU {}: run one batch per GPU",
                        c.ordinal(),
                        ctx.ordinal()
                    )),
                ));
            }
        }
        let ordinal = ctx.ordinal();
        let numa_pin = options.config_ref().numa_pin;
        let eng = engine::engine(Some(ordinal), numa_pin)?;
        let threads = engine::default_threads(Some(ordinal), numa_pin);
        let ring = seg_params_of(options.config_ref()).map(|p| RingPrep {
            ctx: &ctx,
            piece: options.config_ref().piece_size(),
            p,
            total: items.iter().map(|it| it.len).sum(),
        });
        let sources = Sources::prepare(&srcs, &items, &options, &eng, threads, ring)?;
        // Check every item before any byte moves.
        check_items(&items, &sources, &dst_len, ordinal)?;
        let files: Vec<Src<'_>> = (0..srcs.len()).map(|s| sources.src(s)).collect();

        // Move the bytes.
        let total: usize = items.iter().map(|it| it.len).sum();
        ctl.start(total)?;
        engine::trace::mark(|| "ReadBatch: every item checked".into());
        let first = files[items[0].src];
        let piece = first.cfg().piece_size();
        let seg_params = seg_params_of(first.cfg());
        let engine_items: Vec<usize> = (0..items.len())
            .filter(|&i| files[items[i].src].cufile().is_none())
            .collect();
        // The new destination is allocated while the engine reads when the engine's segment
        // ring moves every item into it; otherwise now.
        let defer = new_dst.filter(|&k| {
            seg_params.is_some()
                && items
                    .iter()
                    .all(|it| it.dst != k || files[it.src].cufile().is_none())
                && engine_items.iter().any(|&i| items[i].dst == k)
        });
        if let (None, Some(k)) = (defer, new_dst) {
            new_buf = Some(alloc_new(&dst_stream[k], dst_len[k])?);
        }
        if let Some(i) = (0..items.len()).find(|&i| {
            later_of[items[i].dst] != usize::MAX && files[items[i].src].cufile().is_some()
        }) {
            return Err(refuse(
                i,
                Error::InvalidArgument(
                    "a cuFile read into a destination the caller allocates while the batch reads (a bug in gpudirect: please report it)".into(),
                ),
            ));
        }
        // The later destinations are allocated while the engine's segment ring reads (every
        // item into them is the engine's, checked above); otherwise now.
        let defer_later = !later.is_empty() && seg_params.is_some() && !engine_items.is_empty();
        let later_now = if defer_later {
            Vec::new()
        } else {
            alloc_later_now(&mut later_alloc)?
        };
        let mut deferred_out: Option<CudaSlice<u8>> = None;
        let mut views: Vec<Option<CudaViewMut<'_, u8>>> = dsts
            .iter_mut()
            .map(|d| match d {
                Dst::Borrowed(b) => Some(b.bytes()),
                Dst::New { .. } | Dst::Later { .. } => None,
            })
            .collect();
        if defer.is_none() {
            if let Some(k) = new_dst {
                views[k] = new_buf.as_mut().map(|b| b.as_view_mut());
            }
        }
        let mut failed: Vec<(usize, Error)> = Vec::new();
        // Per item, for a cancelled batch: bytes moved, and whether it is complete.
        let mut moved = vec![0usize; items.len()];
        let mut complete: Vec<bool> = items.iter().map(|it| it.len == 0).collect();
        let mut cut = false;
        let mut odirect = false;
        let mut copies = 0;
        if !engine_items.is_empty() {
            let mut plan = plan_engine_job(&items, &files, &engine_items, piece);
            let threads = threads_for(first.cfg(), Some(ordinal), plan.any_direct);
            // The files named by path, opened as the job reads them (see Sources).
            let window = window_for(&mut plan, threads);
            let streams = &dst_stream;
            // The job's gates: one per destination allocated while it reads, in the order the
            // tasks first write them (the first copies wait least), unwritten ones last.
            let mut gate_of = vec![u32::MAX; views.len()];
            let mut deferred: Vec<Deferred> = Vec::new();
            let is_deferred =
                |d: usize| Some(d) == defer || (defer_later && later_of[d] != usize::MAX);
            for d in engine_items
                .iter()
                .map(|&i| items[i].dst)
                .chain(0..views.len())
            {
                if is_deferred(d) && gate_of[d] == u32::MAX {
                    gate_of[d] = deferred.len() as u32;
                    deferred.push(if Some(d) == defer {
                        Deferred::New {
                            stream: dst_stream[d].clone(),
                            len: dst_len[d],
                        }
                    } else {
                        Deferred::Later(later_of[d])
                    });
                }
            }
            let mut bufs = Vec::with_capacity(views.len());
            let mut guards = Vec::with_capacity(views.len());
            for (d, (v, s)) in views.iter_mut().zip(streams).enumerate() {
                match v {
                    Some(v) => {
                        // Its waits made or the batch refused (ordered_access: an error stored
                        // in the stream's cudarc object skips them silently).
                        let (p, g) = crate::cuda::ordered::ordered_access(s, || v.device_ptr_mut(s))?;
                        bufs.push(Mem::Dev(p));
                        guards.push(g);
                    }
                    None if gate_of[d] != u32::MAX => bufs.push(Mem::Deferred(gate_of[d])),
                    None => match later_now.get(later_of[d]) {
                        Some(&p) => bufs.push(Mem::Dev(p)),
                        None => {
                            return Err(Error::InvalidArgument(
                                "a destination neither allocated nor deferred (a bug in gpudirect: please report it)".into(),
                            ))
                        }
                    },
                }
            }
            engine::trace::mark(|| format!("ReadBatch: {} destinations ordered", bufs.len()));
            // Instead of synchronizing the streams: an event on each (see stream_events).
            let after = stream_events(streams)?;
            ctl.wait_for(&after, total)?;
            engine::trace::mark(|| "ReadBatch: the destinations' streams reached".into());
            // SAFETY: every buffer is a destination view borrowed (mutably, for 'a) by this
            // batch, in `ctx`; each task lies inside its item's destination range, which was
            // checked to fit its buffer and to overlap no other item's; no copy starts before
            // the work pending on the buffers (`after`: device_ptr_mut made each stream wait
            // for its buffer's other users first); Engine::run returns only after every copy
            // completed. Each deferred buffer (the new destination, when `defer`; the later
            // destinations, when `defer_later`) gets its address from its gate, opened by
            // run_deferred_each's allocation of its `dst_len` bytes in `ctx` (the new one's is
            // kept in `deferred_out` until run_deferred_each returned; the later ones' are the
            // caller's, under run_with's contract); the later ones allocated now are
            // run_with's contract too. The window outlives the job.
            let mut job = unsafe {
                engine::Job::batch_windowed(
                    plan.files,
                    window.as_ref(),
                    bufs,
                    items.len(),
                    plan.tasks,
                    piece,
                    Op::Read,
                    Some(ctx.clone()),
                )
            }
            .with_control(ctl.engine(&after));
            if let Some(p) = seg_params {
                job = job.with_segments(p);
            }
            let gates: Vec<engine::DstGate> =
                deferred.iter().map(|_| engine::DstGate::new()).collect();
            if owns_every_destination {
                job = job.owning_destinations();
            }
            let r = match deferred.is_empty() {
                true => eng.run(job, threads),
                false => {
                    let out = &mut deferred_out;
                    let later_alloc = &mut later_alloc;
                    let r = eng.run_deferred_each(job.with_gates(&gates), threads, |j| {
                        match &deferred[j] {
                            Deferred::New { stream, len } => {
                                // The engine writes it on its own streams, and its copies
                                // complete before the buffer is handed out.
                                // SAFETY: as alloc_new's.
                                let (b, dptr) = unsafe {
                                    crate::cuda::alloc_uninit_ready::<u8>(stream, *len)
                                }?;
                                *out = Some(b);
                                Ok(dptr)
                            }
                            Deferred::Later(k) => match later_alloc {
                                Some(f) => f(*k),
                                None => Err(Error::InvalidArgument(
                                    "a later destination without its allocator (a bug in gpudirect: please report it)".into(),
                                )),
                            },
                        }
                    });
                    r
                }
            };
            let out = match r {
                Ok(o) => o,
                Err(f) => {
                    drop(guards);
                    drop(views);
                    // Undrained (only when the batch owns every destination): copies may
                    // still be queued into its own destination (the engine leaks its ring
                    // then), which is leaked, never freed under them; the later ones are
                    // run_with's caller's to leak (the error is the drain's Error::Cuda).
                    // Otherwise no copy can run any more, and it goes.
                    if !f.drained {
                        *drained = false;
                        for b in deferred_out.take().into_iter().chain(new_buf.take()) {
                            super::file::leak_dst(b);
                        }
                    }
                    return Err(f.error);
                }
            };
            drop(guards);
            engine::trace::mark(|| "ReadBatch: the engine job returned".into());
            if let Some(w) = &window {
                trace_window(w);
            }
            odirect = out.odirect;
            copies = out.copies;
            cut = out.cancelled;
            engine_results(
                out.items,
                &items,
                &files,
                cut,
                &mut moved,
                &mut complete,
                &mut failed,
            );
        }
        for (i, it) in items.iter().enumerate() {
            let f = files[it.src];
            let Some(cf) = f.cufile() else { continue };
            if it.len == 0 {
                continue;
            }
            if cut || ctl.cancelled() {
                cut = true;
                continue;
            }
            let Some(view) = views[it.dst].as_mut() else {
                return Err(Error::InvalidArgument(
                    "a cuFile read into a destination not allocated yet (a bug in gpudirect: please report it)".into(),
                ));
            };
            let mut v = view.slice_mut(it.dst_offset..it.dst_offset + it.len);
            let on = v.stream().clone();
            let r = cufile_glue::read_clamped(cf, &mut v, it.file_offset, it.len, &on);
            if let Ok(n) = r {
                (moved[i], complete[i]) = (n, n == it.len);
                ctl.moved(n);
            }
            match r {
                Ok(n) if n == it.len => {}
                Ok(n) => failed.push((i, f.eof(it.file_offset, it.len, n))),
                Err(e @ Error::Cuda { .. }) => return Err(e),
                Err(e) => failed.push((i, e)),
            }
        }
        drop(views);

        let mut paths = Vec::new();
        for it in &items {
            share(&mut paths, files[it.src].report(), it.len);
        }
        let nfiles = files.len();
        drop(files);
        // Close what the batch opened, in parallel.
        sources.close(&eng, threads);
        if cut {
            return Err(cancelled(&items, &moved, &complete, |it| it.len, total));
        }
        if !failed.is_empty() {
            failed.sort_by_key(|f| f.0);
            return Err(Error::BatchFailed {
                total: items.len(),
                failed,
            });
        }
        let mut r = BatchReport::new(t0, items.iter().map(|it| it.len).collect(), paths, nfiles);
        engine::trace::mark(|| {
            format!(
                "ReadBatch::run done in {:.3} ms",
                r.elapsed.as_secs_f64() * 1e3
            )
        });
        r.odirect = odirect;
        r.copies = copies;
        Ok((r, new_buf.or(deferred_out)))
    }
}

/// The segment ring a batch prepares beside checking its files (see [`Sources::prepare`]).
struct RingPrep<'c> {
    ctx: &'c Arc<CudaContext>,
    piece: usize,
    p: SegParams,
    /// The batch's bytes (how many slots its first pass fills).
    total: usize,
}

/// A file named by path that the batch checked and the engine's window opens when the first
/// piece of it is about to be read (see [`Sources::prepare`]).
struct LazySrc {
    path: PathBuf,
    /// The file at the check (its inode and `st_ctime`): the window's opens must find it so.
    id: io::FileId,
    /// Its size at the check, `None` when unknown (see `GpuFile::known_size`).
    size: Option<u64>,
    /// Opened with an O_DIRECT descriptor too (as `GpuFile::open` would for this batch).
    want_direct: bool,
    /// Whether each of its items (in the order added) reads with O_DIRECT, when deciding
    /// needed the file open (`ODirect::On`, or `Auto` for items of `AUTO_DIRECT_MIN` or more: the
    /// check opened it for a moment); `None`: none does.
    direct: Option<Vec<bool>>,
    /// The path its device reads take, and why (the engine's: decided from its filesystem).
    report: PathReport,
}

/// What the check of one file by path found.
struct Checked {
    stat: io::PathStat,
    size: Option<u64>,
    direct: Option<Vec<bool>>,
    /// The check opened it (for its size or its O_DIRECT decision).
    opened: bool,
}

/// Checks the file at `path` for a batch without holding it open: `stat` and `faccessat`
/// ([`io::stat_readable`]: a missing or unreadable file is the errno `open` would give, from
/// the call that found it; not a regular file, the error `open` gives); a file whose size is 0 (it may
/// have content all the same, as `/proc` files do) or whose O_DIRECT decision needs its
/// descriptor (`ranges`: its items' ranges, asked under `mode`) is opened as `GpuFile::open`
/// opens it, asked, and closed.
fn check_path(
    path: &FsPath,
    want_direct: bool,
    mode: ODirect,
    ranges: Option<&[(u64, usize)]>,
) -> Result<Checked> {
    let stat = io::stat_readable(path)?;
    if stat.len > 0 && ranges.is_none() {
        return Ok(Checked {
            stat,
            size: Some(stat.len),
            direct: None,
            opened: false,
        });
    }
    let read = io::OpenMode {
        write: false,
        create: false,
        truncate: false,
    };
    let fds = Fds::open_with(path, read, want_direct)?;
    if fds.id() != stat.id {
        return Err(Error::io(
            "open",
            Some(path.to_path_buf()),
            std::io::Error::other(
                "the path named another file, or the file changed, by the time it was opened (replaced, rewritten or truncated while the batch checked it): run the batch again",
            ),
        ));
    }
    let size = match fds.len_at_open {
        0 => {
            let mut probe = 0u8;
            // SAFETY: one byte of our stack.
            let got = unsafe { io::pread_full(&fds.buffered, &mut probe, 1, 0) }
                .map_err(|e| fds.err("pread", e))?;
            (got == 0).then_some(0)
        }
        n => Some(n),
    };
    let direct = ranges.map(|r| read_direct_many(&fds, mode, r));
    Ok(Checked {
        stat: io::PathStat {
            len: fds.len_at_open,
            ..stat
        },
        size,
        direct,
        opened: true,
    })
}

/// A batch's source as the checks and the plan see it.
#[derive(Clone, Copy)]
enum Src<'f> {
    /// An open file: the caller's ([`ReadBatch::read_file`]) or one the batch opened up front
    /// (cuFile may move it by DMA, or the options write).
    Open(&'f GpuFile),
    /// A file by path the engine's window opens, and the batch's settings for it.
    Lazy(&'f LazySrc, &'f Unopened),
}

impl<'f> Src<'f> {
    fn path(self) -> &'f FsPath {
        match self {
            Src::Open(f) => f.path(),
            Src::Lazy(l, _) => &l.path,
        }
    }

    fn report(self) -> &'f PathReport {
        match self {
            Src::Open(f) => f.path_report(),
            Src::Lazy(l, _) => &l.report,
        }
    }

    /// The cuFile handle its device reads go through (`None`: the engine reads it).
    fn cufile(self) -> Option<&'f CuFileHandle> {
        match self {
            Src::Open(f) => f.cufile.as_ref(),
            Src::Lazy(..) => None,
        }
    }

    fn cfg(self) -> &'f StorageConfig {
        match self {
            Src::Open(f) => &f.cfg,
            Src::Lazy(_, u) => &u.cfg,
        }
    }

    fn check_device(self, ordinal: usize) -> Result<()> {
        match self {
            Src::Open(f) => f.check_device(ordinal),
            Src::Lazy(l, u) => check_device(u.device, &l.path, ordinal),
        }
    }

    fn check_policy(self) -> Result<()> {
        match self {
            Src::Open(f) => f.check_policy(),
            Src::Lazy(l, u) => u.policy.check(&l.report),
        }
    }

    /// Its size as the checks use it (`None`: unknown).
    fn known_size(self) -> Result<Option<u64>> {
        match self {
            Src::Open(f) => f.known_size(),
            Src::Lazy(l, _) => Ok(l.size),
        }
    }

    fn eof(self, off: u64, want: usize, got: usize) -> Error {
        eof_error(self.path(), off, want, got)
    }

    /// The refusal of a file whose size is unknown.
    fn unknown_size(self) -> Error {
        Error::io(
            "fstat",
            Some(self.path().to_path_buf()),
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the file's size is unknown (fstat says 0 but it has content, as files on {} do): read it with GpuFile::read_to_device, which reads to end of file",
                    crate::storage::cufile::filesystem_type(self.path())
                        .unwrap_or_else(|| "this filesystem".into())
                ),
            ),
        )
    }
}

/// A batch's sources, ready for the checks and the engine job.
///
/// The files named by path are **checked by path, not opened** ([`check_path`], in parallel on
/// the engine's workers and the calling thread): a batch of 10,000 files holds no descriptor
/// until its job reads, and then at most its window's (`engine::window`): the table grows for
/// them (an RCU grace period in a multi-threaded process) at most once, when it lacks room for
/// one file per worker (`window_for`), and `RLIMIT_NOFILE` is no limit on the batch. Their path report comes from their filesystem's verdict
/// (`backend::engine_report_unopened`, one `statfs` per filesystem). Opened up front, as
/// `GpuFile::open` and held through the job, are only the files whose backend that cannot
/// decide (cuFile may move them by DMA: the first file of such a filesystem, and all of them
/// when cuFile registered it; `Backend::CuFile`; `CompatMode::CuFileRequired`), and every file
/// when the options write, create or truncate.
struct Sources<'s, 'a> {
    srcs: &'s [Source<'a>],
    /// The files opened up front.
    opened: Vec<OnceLock<Result<GpuFile>>>,
    /// Each file opened up front's size, from the `fstat` that checked its type on the worker
    /// that opened it (in parallel, not one after another in the checks).
    open_sizes: Vec<OnceLock<Option<u64>>>,
    /// The files the window opens.
    lazy: Vec<Option<LazySrc>>,
    /// The settings of the files the window opens.
    settings: Option<Unopened>,
    /// Files opened up front.
    up_front: usize,
}

impl<'s, 'a> Sources<'s, 'a> {
    /// Checks (or opens, see [`Sources`]) the files named by path, in parallel on `threads`
    /// workers of `eng` and the calling thread; with `ring` (64 files or more), while the
    /// engine prepares the segment ring: the workers fault it in first, then take files too.
    /// The first bad file (in the order added) refuses the batch at its first item.
    fn prepare(
        srcs: &'s [Source<'a>],
        items: &[ReadItem_],
        options: &GpuFileOptions,
        eng: &engine::Engine,
        threads: usize,
        ring: Option<RingPrep<'_>>,
    ) -> Result<Self> {
        let t0 = engine::trace::now_us();
        let first_item_of = |src: usize| items.iter().position(|it| it.src == src).unwrap_or(0);
        let mut longest = vec![0usize; srcs.len()];
        for it in items {
            longest[it.src] = longest[it.src].max(it.len);
        }
        let mode = options.config_ref().odirect_read;
        let want_direct = |s: usize| mode == ODirect::On || longest[s] >= AUTO_DIRECT_MIN;
        let mut me = Sources {
            srcs,
            opened: srcs.iter().map(|_| OnceLock::new()).collect(),
            open_sizes: srcs.iter().map(|_| OnceLock::new()).collect(),
            lazy: srcs.iter().map(|_| None).collect(),
            settings: None,
            up_front: 0,
        };
        let paths: Vec<usize> = (0..srcs.len())
            .filter(|&s| matches!(srcs[s], Source::Path(_)))
            .collect();
        let Some(&first_path) = paths.first() else {
            return Ok(me);
        };
        let path_of = |s: usize| match &srcs[s] {
            Source::Path(p) => p.as_path(),
            Source::File(f) => f.path(),
        };
        let Some(u) = options
            .unopened()
            .map_err(|e| refuse(first_item_of(first_path), e))?
        else {
            // The options write: every file is opened up front, as GpuFile::open.
            me.open_up_front(&paths, items, options, eng, threads, ring, &want_direct)?;
            return Ok(me);
        };
        // The ranges whose O_DIRECT decision needs the file open, per source.
        let sampled = |s: usize| {
            want_direct(s)
                && match mode {
                    ODirect::Off => false,
                    ODirect::On => true,
                    ODirect::Auto => longest[s] >= AUTO_DIRECT_MIN,
                }
        };
        let mut ranges: Vec<Vec<(u64, usize)>> = srcs.iter().map(|_| Vec::new()).collect();
        for it in items {
            if sampled(it.src) {
                ranges[it.src].push((it.file_offset, it.len));
            }
        }
        let checked: Vec<OnceLock<Result<Checked>>> =
            paths.iter().map(|_| OnceLock::new()).collect();
        let next = AtomicUsize::new(0);
        let take = || loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= paths.len() {
                break;
            }
            let s = paths[k];
            let r = check_path(
                path_of(s),
                want_direct(s),
                mode,
                sampled(s).then(|| ranges[s].as_slice()),
            );
            let _ = checked[k].set(r);
        };
        let beside_ring = match ring {
            // Many files read through the segment ring: while the files are checked, the
            // workers start and fault in and page-lock the ring the job will use (and take
            // files once they are done), so its first segment is copied as soon as it is read.
            // (For files that turn out to go through cuFile the locked ring is unused until
            // `release_engines`.) Best effort: a ring that cannot be built or locked now fails
            // no batch (see `prepare_best_effort`). A panic checking a file leaves its result
            // unset: the batch is refused below, never unwound.
            Some(r) if paths.len() >= 64 => {
                prepare_best_effort(
                    |caller| {
                        eng.prepare_segments_beside(
                            r.ctx,
                            r.piece,
                            r.p,
                            r.total,
                            threads,
                            caller,
                            &|| {
                                let _ = std::panic::catch_unwind(AssertUnwindSafe(&take));
                            },
                        )
                    },
                    || {
                        let _ = std::panic::catch_unwind(AssertUnwindSafe(&take));
                    },
                );
                true
            }
            _ => false,
        };
        // The files left (all of them without the ring), on the workers and the caller.
        if !eng.for_each(threads, threads, &|_| take()) {
            return Err(panicked());
        }
        let t_checked = engine::trace::now_us();
        let mut briefly = 0;
        let mut stats: Vec<Option<Checked>> = srcs.iter().map(|_| None).collect();
        for (k, c) in checked.into_iter().enumerate() {
            let s = paths[k];
            match c.into_inner() {
                Some(Ok(c)) => {
                    briefly += usize::from(c.opened);
                    stats[s] = Some(c);
                }
                Some(Err(e)) => return Err(refuse(first_item_of(s), e)),
                None => return Err(refuse(first_item_of(s), panicked())),
            }
        }
        // Each filesystem's path report, from one `statfs`; `None`: cuFile must be asked, by
        // opening (and registering) its first file here. When that file goes to the engine,
        // the verdict is cached for its filesystem and the others need not open.
        let mut by_dev: Vec<(u64, Option<PathReport>)> = Vec::new();
        let mut up = Vec::new();
        for &s in &paths {
            let dev = stats[s].as_ref().map_or(0, |c| c.stat.id.dev);
            let report = match by_dev.iter().find(|(d, _)| *d == dev) {
                Some((_, r)) => r.clone(),
                None => {
                    let magic = backend::fs_magic_of_path(path_of(s));
                    let mut r = backend::engine_report_unopened(u.backend, &u.cfg, dev, magic);
                    if r.is_none() {
                        me.open_up_front(&[s], items, options, eng, threads, None, &want_direct)?;
                        r = backend::engine_report_unopened(u.backend, &u.cfg, dev, magic);
                    }
                    by_dev.push((dev, r.clone()));
                    if me.opened[s].get().is_some() {
                        continue;
                    }
                    r
                }
            };
            match report {
                Some(report) => {
                    let c = stats[s].take().expect("checked above");
                    me.lazy[s] = Some(LazySrc {
                        path: path_of(s).to_path_buf(),
                        id: c.stat.id,
                        size: c.size,
                        want_direct: want_direct(s),
                        direct: c.direct,
                        report,
                    });
                }
                None => up.push(s),
            }
        }
        me.open_up_front(&up, items, options, eng, threads, None, &want_direct)?;
        me.settings = Some(u);
        engine::trace::mark(|| {
            format!(
                "ReadBatch: {} files checked by path in {:.3} ms on {threads} workers and the caller{} ({briefly} opened for a moment for their size or O_DIRECT decision); {} opened up front for cuFile in {:.3} ms; {} left to the job's descriptor window",
                paths.len(),
                (t_checked - t0) as f64 / 1e3,
                if beside_ring { ", beside the ring's preparation" } else { "" },
                me.up_front,
                (engine::trace::now_us() - t_checked) as f64 / 1e3,
                paths.len() - me.up_front,
            )
        });
        Ok(me)
    }

    /// Opens sources `which` as `GpuFile::open` does, in parallel on `threads` workers of `eng`
    /// and the calling thread, after making room for them in the descriptor table (with
    /// `ring`, beside the ring's preparation); they are held through the job. The first that
    /// does not open refuses the batch at its first item.
    #[allow(clippy::too_many_arguments)]
    fn open_up_front(
        &mut self,
        which: &[usize],
        items: &[ReadItem_],
        options: &GpuFileOptions,
        eng: &engine::Engine,
        threads: usize,
        ring: Option<RingPrep<'_>>,
        want_direct: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        let srcs = self.srcs;
        let fds: usize = which.iter().map(|&s| 1 + usize::from(want_direct(s))).sum();
        match ring {
            Some(r) if fds >= 64 => prepare_best_effort(
                |reserve| {
                    eng.prepare_segments_beside(
                        r.ctx,
                        r.piece,
                        r.p,
                        r.total,
                        threads,
                        reserve,
                        &|| {},
                    )
                },
                || io::reserve_fds(fds),
            ),
            _ => io::reserve_fds(fds),
        }
        let (opened, open_sizes) = (&self.opened, &self.open_sizes);
        let ok = eng.for_each(which.len(), threads, &|k| {
            let s = which[k];
            if let Source::Path(p) = &srcs[s] {
                let f = options.clone().open_with(p, want_direct(s));
                if let Some(size) = f.as_ref().ok().and_then(|f| f.known_size_at_open().ok()) {
                    let _ = open_sizes[s].set(size);
                }
                let _ = opened[s].set(f);
            }
        });
        if !ok {
            return Err(panicked());
        }
        self.up_front += which.len();
        let first_item_of = |src: usize| items.iter().position(|it| it.src == src).unwrap_or(0);
        for &s in which {
            match self.opened[s].get() {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(refuse(first_item_of(s), clone_open_error(e))),
                None => return Err(refuse(first_item_of(s), panicked())),
            }
        }
        Ok(())
    }

    /// Source `s`.
    fn src(&self, s: usize) -> Src<'_> {
        match &self.srcs[s] {
            Source::File(f) => Src::Open(f),
            Source::Path(_) => match (&self.lazy[s], &self.settings, self.opened[s].get()) {
                (Some(l), Some(u), _) => Src::Lazy(l, u),
                (None, _, Some(Ok(f))) => Src::Open(f),
                // `prepare` refused the batch for any other outcome.
                _ => unreachable!("a source neither checked nor opened past Sources::prepare"),
            },
        }
    }

    /// Source `s`'s size as its check or its open up front found it (`None` when neither
    /// did: the caller's files; `Some(None)`: not known, see `GpuFile::known_size`).
    fn checked_size(&self, s: usize) -> Option<Option<u64>> {
        match &self.lazy[s] {
            Some(l) => Some(l.size),
            None => self.open_sizes[s].get().copied(),
        }
    }

    /// Closes what [`prepare`](Self::prepare) opened up front, in parallel on `threads`
    /// workers of `eng`. A close that panicked (a bug) is logged: the batch's items are in
    /// place by then.
    fn close(self, eng: &engine::Engine, threads: usize) {
        let slots: Vec<Mutex<Option<GpuFile>>> = self
            .opened
            .into_iter()
            .map(|o| Mutex::new(o.into_inner().and_then(|r| r.ok())))
            .collect();
        if self.up_front > 0 {
            let closed = eng.for_each(slots.len(), threads, &|k| {
                drop(slots[k].lock().unwrap_or_else(|p| p.into_inner()).take());
            });
            if !closed {
                // The bytes are in place; a close that panicked (a bug) is reported, not
                // turned into a failed read.
                tracing::error!(
                    "closing a batch's files panicked (a bug in gpudirect: please report it); the batch's items are in place"
                );
            }
        }
    }
}

/// The checks a batch makes before any byte moves, in this order: each source's device, then
/// per item its file range, its destination range, its file's size (past end of file, size
/// unknown), then overlapping destinations, then the fallback policy once per distinct path.
/// The first bad item refuses the batch ([`Error::BatchRefused`]).
fn check_items(
    items: &[ReadItem_],
    sources: &Sources<'_, '_>,
    dst_len: &[usize],
    ordinal: usize,
) -> Result<()> {
    let nsrc = sources.srcs.len();
    let first_item_of = |src: usize| items.iter().position(|it| it.src == src).unwrap_or(0);
    for s in 0..nsrc {
        sources
            .src(s)
            .check_device(ordinal)
            .map_err(|e| refuse(first_item_of(s), e))?;
    }
    let mut sizes: Vec<Option<Option<u64>>> = (0..nsrc).map(|s| sources.checked_size(s)).collect();
    for (i, it) in items.iter().enumerate() {
        check_range(it.file_offset, it.len).map_err(|e| refuse(i, e))?;
        let room = dst_len[it.dst];
        if it
            .dst_offset
            .checked_add(it.len)
            .is_none_or(|end| end > room)
        {
            return Err(refuse(
                i,
                Error::InvalidArgument(format!(
                    "{} bytes at destination offset {} do not fit its {room}-byte destination: use a larger buffer or a smaller offset",
                    it.len, it.dst_offset
                )),
            ));
        }
        let f = sources.src(it.src);
        let size = match sizes[it.src] {
            Some(s) => s,
            None => {
                let s = f.known_size().map_err(|e| refuse(i, e))?;
                sizes[it.src] = Some(s);
                s
            }
        };
        let Some(size) = size else {
            return Err(refuse(i, f.unknown_size()));
        };
        if it.file_offset + it.len as u64 > size {
            return Err(refuse(
                i,
                f.eof(
                    it.file_offset,
                    it.len,
                    size.saturating_sub(it.file_offset) as usize,
                ),
            ));
        }
    }
    let spans = items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            (
                it.dst,
                it.dst_offset as u64,
                (it.dst_offset + it.len) as u64,
                i,
            )
        })
        .collect();
    if let Some((later, earlier)) = first_overlap(spans) {
        return Err(refuse(
            later,
            Error::InvalidArgument(format!(
                "its destination range overlaps item {earlier}'s: give every item its own bytes"
            )),
        ));
    }
    // The fallback policy, once per distinct path (a file opened by path warns once).
    let mut checked: Vec<&PathReport> = Vec::new();
    for s in 0..nsrc {
        let f = sources.src(s);
        if !checked.contains(&f.report()) {
            f.check_policy().map_err(|e| refuse(first_item_of(s), e))?;
            checked.push(f.report());
        }
    }
    Ok(())
}

/// A batch's engine job, planned: its files (the engine's, in first-use order: open ones, and
/// the window's, `lazy`, with the pieces that read each), its tasks, and whether any task
/// reads with O_DIRECT.
struct EnginePlan<'f> {
    files: Vec<JobFile<'f>>,
    lazy: Vec<LazyFile>,
    pieces: Vec<usize>,
    tasks: Vec<Task>,
    any_direct: bool,
}

/// Plans the engine's part of a batch: each of `engine_items` cut into pieces of `piece`
/// bytes ([`plan_item`]), in the order added, reading with O_DIRECT as [`direct_decisions`]
/// says.
fn plan_engine_job<'f>(
    items: &[ReadItem_],
    files: &[Src<'f>],
    engine_items: &[usize],
    piece: usize,
) -> EnginePlan<'f> {
    let mut job_file = vec![u32::MAX; files.len()];
    let mut plan = EnginePlan {
        files: Vec::new(),
        lazy: Vec::new(),
        pieces: Vec::new(),
        tasks: Vec::with_capacity(engine_items.len()),
        any_direct: false,
    };
    let direct_of = direct_decisions(items, files, engine_items);
    for &i in engine_items {
        let it = &items[i];
        if job_file[it.src] == u32::MAX {
            job_file[it.src] = plan.files.len() as u32;
            plan.files.push(match files[it.src] {
                Src::Open(f) => JobFile::Open(&f.fds),
                Src::Lazy(l, _) => {
                    plan.lazy.push(LazyFile {
                        path: l.path.clone(),
                        want_direct: l.want_direct,
                        id: l.id,
                    });
                    plan.pieces.push(0);
                    JobFile::Lazy(plan.lazy.len() - 1)
                }
            });
        }
        let direct = direct_of[i];
        plan.any_direct |= direct;
        let at = Task {
            file: job_file[it.src],
            buf: it.dst as u32,
            item: i as u32,
            buf_off: it.dst_offset,
            ..Task::default()
        };
        let before = plan.tasks.len();
        plan_item(
            &mut plan.tasks,
            at,
            it.file_offset,
            it.len,
            piece,
            Dir::Read,
            direct,
        );
        if let JobFile::Lazy(k) = plan.files[job_file[it.src] as usize] {
            plan.pieces[k] += plan.tasks.len() - before;
        }
    }
    plan
}

/// The window the engine job of `plan` opens its lazy files through, for `threads` workers
/// (`None` when it has none): as large as `io::window_size` allows in the descriptor table as
/// it is now (growing it once only when it has no room for one file per worker).
fn window_for(plan: &mut EnginePlan<'_>, threads: usize) -> Option<FdWindow> {
    if plan.lazy.is_empty() {
        return None;
    }
    let per_file = 1 + usize::from(plan.lazy.iter().any(|f| f.want_direct));
    let room = io::fd_room();
    let (limit, grow) = io::window_size(threads, per_file, room);
    if grow {
        io::grow_for_window(limit, per_file, room);
    }
    engine::trace::mark(|| {
        format!(
            "ReadBatch: descriptor window of {limit} files ({per_file} descriptors each) for {threads} workers and {} files; table {} slots, {} open, soft limit {}{}",
            plan.lazy.len(),
            room.table.map_or("?".to_string(), |t| t.to_string()),
            room.open,
            room.limit,
            if grow { "; the table grows once for it" } else { "" }
        )
    });
    Some(FdWindow::new(
        std::mem::take(&mut plan.lazy),
        std::mem::take(&mut plan.pieces),
        limit,
    ))
}

/// Traces what a job's window did.
fn trace_window(w: &FdWindow) {
    engine::trace::mark(|| {
        let s = w.stats();
        format!(
            "ReadBatch: window of {} files: {} opens ({} reopens after their file was closed for room), at most {} open at once, {} waits for room, {} retries after EMFILE; opens {:.3} ms and closes {:.3} ms in all, on the workers",
            w.limit(),
            s.opens,
            s.reopens,
            s.peak,
            s.waits,
            s.retries,
            s.open_us as f64 / 1e3,
            s.close_us as f64 / 1e3
        )
    });
}

/// Records what the engine job did for each of its items (the others, cuFile's and empty
/// ones, are left alone): bytes moved, whether complete, and the failed ones with their error
/// (a file error, or a short read: end of file); with `cut` (cancelled), an item without an
/// error is not a failure.
fn engine_results(
    outcomes: Vec<engine::ItemOutcome>,
    items: &[ReadItem_],
    files: &[Src<'_>],
    cut: bool,
    moved: &mut [usize],
    complete: &mut [bool],
    failed: &mut Vec<(usize, Error)>,
) {
    for (k, o) in outcomes.into_iter().enumerate() {
        if files[items[k].src].cufile().is_some() || items[k].len == 0 {
            continue;
        }
        moved[k] = o.moved;
        complete[k] = o.error.is_none() && o.complete && o.prefix == items[k].len;
        if cut && o.error.is_none() {
            continue;
        }
        match o.error {
            Some(e) => failed.push((k, e)),
            None if !o.complete || o.prefix < items[k].len => {
                let f = files[items[k].src];
                failed.push((k, f.eof(items[k].file_offset, items[k].len, o.prefix)));
            }
            None => {}
        }
    }
}

/// Whether each of `engine_items` reads with O_DIRECT (indexed by item; the others `false`):
/// per source file, its items' ranges in one page-cache sample. Items are grouped by source
/// with one sort, not one list per file, and a source whose answer needs no sample (every
/// range below `AUTO_DIRECT_MIN`, as 10k small files; O_DIRECT off, on or unavailable)
/// decides without allocating. With a list and two vectors per file, 6,000 one-item sources
/// took 1.1–1.5 ms on a 2-core build machine; this way 0.46–0.50 ms (not measured on a GPU
/// machine). A file the window opens was decided when it was checked ([`LazySrc::direct`]).
fn direct_decisions(items: &[ReadItem_], files: &[Src<'_>], engine_items: &[usize]) -> Vec<bool> {
    let mut direct_of = vec![false; items.len()];
    let mut order = engine_items.to_vec();
    // Stable: a source's items stay in their order.
    order.sort_by_key(|&i| items[i].src);
    let mut ranges = Vec::new();
    let mut k = 0;
    while k < order.len() {
        let src = items[order[k]].src;
        let e = k + order[k..]
            .iter()
            .take_while(|&&i| items[i].src == src)
            .count();
        let mine = &order[k..e];
        match files[src] {
            Src::Lazy(l, _) => {
                // Every item of a lazy source is the engine's: its decisions, in item order.
                if let Some(d) = &l.direct {
                    for (&i, &d) in mine.iter().zip(d) {
                        direct_of[i] = d;
                    }
                }
            }
            Src::Open(f) => {
                let longest = mine.iter().map(|&i| items[i].len).max().unwrap_or(0);
                match f.direct_unsampled(longest) {
                    // No sample for the longest range: none for the shorter ones either, and
                    // the same answer (no O_DIRECT descriptor, `Off` or `On`: whatever the
                    // length; `Auto`: every range is below the threshold).
                    Some(d) => {
                        for &i in mine {
                            direct_of[i] = d;
                        }
                    }
                    None => {
                        ranges.clear();
                        ranges.extend(mine.iter().map(|&i| (items[i].file_offset, items[i].len)));
                        for (&i, d) in mine.iter().zip(f.read_direct_many(&ranges)) {
                            direct_of[i] = d;
                        }
                    }
                }
            }
        }
        k = e;
    }
    direct_of
}

/// The errors `GpuFile::open` returns are not `Clone`; a batch reports the one it got for a
/// file at its first item (the `OnceLock` keeps the original, this is a faithful copy).
fn clone_open_error(e: &Error) -> Error {
    match e {
        Error::Io { op, path, source } => Error::Io {
            op,
            path: path.clone(),
            source: match source.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::new(source.kind(), source.to_string()),
            },
        },
        Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
        Error::Unsupported { what, cause } => Error::Unsupported {
            what: what.clone(),
            cause: cause.clone(),
        },
        Error::FallbackRefused { path, cause } => Error::FallbackRefused {
            path: *path,
            cause: cause.clone(),
        },
        other => Error::InvalidArgument(format!("the file could not be opened: {other}")),
    }
}

/// An event recorded now on every distinct stream of `streams` (pooled: the call makes none,
/// see `crate::cuda::events`). The caller waits for them before the job (the work queued on
/// the streams before now, not what other threads queue later: the engine runs one job per GPU
/// at a time, so its jobs must not wait for kernels on the device), and the engine's copies
/// wait for them too; the events go back to their pool when the result drops, after the job.
fn stream_events(streams: &[Arc<CudaStream>]) -> Result<crate::cuda::events::Recorded> {
    crate::cuda::events::record_each(streams)
}

/// One item of [`read_many`]: `len` bytes at `file_offset` of `path` into the destination at
/// byte `dst_offset`.
#[derive(Debug, Clone, Copy)]
pub struct ReadItem<'p> {
    /// The file.
    pub path: &'p FsPath,
    /// Where in the file.
    pub file_offset: u64,
    /// How many bytes.
    pub len: usize,
    /// Where in the destination, in bytes.
    pub dst_offset: usize,
}

/// Reads many file ranges into one device buffer in one job: [`ReadBatch`] with one
/// destination.
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use gpudirect::storage::{read_many, ReadItem};
/// let stream = gpudirect::cuda::context(0)?.default_stream();
/// let paths: Vec<std::path::PathBuf> = (0..10_000).map(|i| format!("shard/{i}").into()).collect();
/// let mut dst = stream.alloc_zeros::<f32>(paths.len() * 25_600)?;
/// let items: Vec<ReadItem> = paths.iter().enumerate()
///     .map(|(i, p)| ReadItem { path: p, file_offset: 0, len: 102_400, dst_offset: i * 102_400 })
///     .collect();
/// let report = read_many(&mut dst, &items)?;
/// println!("{report}");
/// # Ok(()) }
/// ```
pub fn read_many<D>(dst: &mut D, items: &[ReadItem<'_>]) -> Result<BatchReport>
where
    D: DeviceDst + ?Sized,
{
    let mut b = ReadBatch::new();
    b.call = "read_many";
    let d = b.destination(dst);
    for it in items {
        b.read(it.path, it.file_offset, it.len, d, it.dst_offset);
    }
    b.run()
}

impl GpuFile {
    /// Reads many ranges of this file into `dst` in one job: each `(file_offset, len,
    /// dst_offset)` moves `len` bytes at `file_offset` to byte `dst_offset` of `dst`. Refusals
    /// and failures as [`ReadBatch`].
    pub fn read_ranges<D>(&self, dst: &mut D, ranges: &[(u64, usize, usize)]) -> Result<BatchReport>
    where
        D: DeviceDst + ?Sized,
    {
        let mut b = ReadBatch::new();
        b.call = "GpuFile::read_ranges";
        let d = b.destination(dst);
        for &(off, len, at) in ranges {
            b.read_file(self, off, len, d, at);
        }
        b.run()
    }
}

enum WSource<'a> {
    Dev(usize),
    Host(&'a [u8]),
}

struct WriteItem_<'a> {
    src: WSource<'a>,
    src_offset: usize,
    len: usize,
    file_offset: u64,
}

/// Many writes into one file in one job: ranges of device buffers (any [`DeviceSrc`]) and host
/// byte slices (headers), each at its file offset. With [`durable`](Self::durable) (default: the
/// file's [`GpuFileOptions::durable`]) the job ends with one `fsync`, not one per item.
///
/// File ranges of two items must not overlap (the batch is refused: which one would win is
/// not defined). Refusals and failures as [`ReadBatch`]; a failed
/// item's file range is unspecified (partly written, see [`GpuFileOptions::durable`]).
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use gpudirect::storage::{GpuFile, WriteBatch};
/// let stream = gpudirect::cuda::context(0)?.default_stream();
/// let a = stream.alloc_zeros::<f32>(1 << 20)?;
/// let header = b"my header";
/// let out = GpuFile::create("out.bin")?;
/// let mut w = WriteBatch::new(&out);
/// let s = w.source(&a);
/// w.write_host(header, 0).write(s, 0, 4 << 20, 4096).durable(true);
/// w.run()?;
/// # Ok(()) }
/// ```
pub struct WriteBatch<'a> {
    file: &'a GpuFile,
    srcs: Vec<Box<dyn ErasedSrc + 'a>>,
    items: Vec<WriteItem_<'a>>,
    durable: Option<bool>,
    control: Option<TransferControl>,
}

impl std::fmt::Debug for WriteBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBatch")
            .field("file", &self.file.path())
            .field("items", &self.items.len())
            .field("sources", &self.srcs.len())
            .finish()
    }
}

impl<'a> WriteBatch<'a> {
    /// An empty batch of writes into `file` (opened writable).
    pub fn new(file: &'a GpuFile) -> Self {
        WriteBatch {
            file,
            srcs: Vec::new(),
            items: Vec::new(),
            durable: None,
            control: None,
        }
    }

    /// Counts the batch's progress in `control` and lets it cancel the batch, as
    /// [`ReadBatch::control`]; a cancelled write batch skips its `fsync`, and the file ranges
    /// of items not complete are partly written.
    pub fn control(&mut self, control: &TransferControl) -> &mut Self {
        self.control = Some(control.clone());
        self
    }

    /// Registers a device source (borrowed until the batch is run); items address it by byte
    /// offset.
    pub fn source<S>(&mut self, src: &'a S) -> BatchSrc
    where
        S: DeviceSrc + ?Sized,
        S::Elem: 'a,
    {
        self.srcs.push(Box::new(TypedSrc(src.as_src())));
        BatchSrc(self.srcs.len() - 1)
    }

    /// Adds an item: `len` bytes of `src` from byte `src_offset`, written at `file_offset`.
    pub fn write(
        &mut self,
        src: BatchSrc,
        src_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> &mut Self {
        self.items.push(WriteItem_ {
            src: WSource::Dev(src.0),
            src_offset,
            len,
            file_offset,
        });
        self
    }

    /// Adds an item of host bytes (a header, an index) written at `file_offset`.
    pub fn write_host(&mut self, bytes: &'a [u8], file_offset: u64) -> &mut Self {
        self.items.push(WriteItem_ {
            src: WSource::Host(bytes),
            src_offset: 0,
            len: bytes.len(),
            file_offset,
        });
        self
    }

    /// One `fsync` at the end of the job (default: the file's `durable` setting).
    pub fn durable(&mut self, yes: bool) -> &mut Self {
        self.durable = Some(yes);
        self
    }

    /// Items added.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when no item was added.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Runs the batch: returns when every item is in the file (and on stable storage when
    /// durable).
    pub fn run(self) -> Result<BatchReport> {
        let t0 = Instant::now();
        let WriteBatch {
            file,
            srcs,
            items,
            durable,
            control,
        } = self;
        // Before any file range is touched or anything enqueued.
        crate::cuda::refuse_capturing_any(
            srcs.iter().map(|s| s.bytes().stream().clone()),
            "WriteBatch::run: a write from device memory",
        )?;
        let counter = control.as_ref().map(|c| move |n: usize| c.add(n));
        let ctl = Ctl::blocking(
            t0,
            control.as_ref(),
            counter.as_ref().map(|f| f as &(dyn Fn(usize) + Sync)),
        );
        let durable = durable.unwrap_or(file.durable);
        if items.is_empty() {
            return Ok(BatchReport::new(t0, Vec::new(), Vec::new(), 1));
        }
        file.check_writable().map_err(|e| refuse(0, e))?;
        let views: Vec<CudaView<'_, u8>> = srcs.iter().map(|s| s.bytes()).collect();
        let mut ctx = None;
        for (i, it) in items.iter().enumerate() {
            check_range(it.file_offset, it.len).map_err(|e| refuse(i, e))?;
            if let WSource::Dev(s) = it.src {
                let Some(v) = views.get(s) else {
                    return Err(refuse(
                        i,
                        Error::InvalidArgument(format!(
                            "source {s} was not registered with this batch: use the BatchSrc its source() returned"
                        )),
                    ));
                };
                if it
                    .src_offset
                    .checked_add(it.len)
                    .is_none_or(|end| end > v.len())
                {
                    return Err(refuse(
                        i,
                        Error::InvalidArgument(format!(
                            "{} bytes at source offset {} are not inside its {}-byte source",
                            it.len,
                            it.src_offset,
                            v.len()
                        )),
                    ));
                }
                let c = v.stream().context().clone();
                match &ctx {
                    None => {
                        file.check_device(c.ordinal()).map_err(|e| refuse(i, e))?;
                        ctx = Some(c);
                    }
                    Some(c0) if c0.cu_ctx() != c.cu_ctx() => {
                        return Err(refuse(
                            i,
                            Error::InvalidArgument(format!(
                                "its source is on GPU {} and an earlier one on GPU {}: run one batch per GPU",
                                c.ordinal(),
                                c0.ordinal()
                            )),
                        ))
                    }
                    Some(_) => {}
                }
            }
        }
        let spans = items
            .iter()
            .enumerate()
            .map(|(i, it)| (0usize, it.file_offset, it.file_offset + it.len as u64, i))
            .collect();
        if let Some((later, earlier)) = first_overlap(spans) {
            return Err(refuse(
                later,
                Error::InvalidArgument(format!(
                    "its file range overlaps item {earlier}'s: which would win is undefined; write each byte once"
                )),
            ));
        }
        if ctx.is_some() {
            file.check_policy().map_err(|e| refuse(0, e))?;
        }
        let device_report = if ctx.is_some() {
            file.path_report().clone()
        } else {
            PathReport::fallback(TransferPath::Posix, crate::path::Cause::HostMemory)
        };

        let total: usize = items.iter().map(|it| it.len).sum();
        ctl.start(total)?;
        let mut failed: Vec<(usize, Error)> = Vec::new();
        let mut odirect = false;
        let mut copies = 0;
        let mut moved = vec![0usize; items.len()];
        let mut complete: Vec<bool> = items.iter().map(|it| it.len == 0).collect();
        let mut cut = false;
        if let Some(cf) = &file.cufile {
            if ctx.is_some() {
                let streams: Vec<Arc<CudaStream>> =
                    views.iter().map(|v| v.stream().clone()).collect();
                ctl.wait_for(&stream_events(&streams)?, total)?;
            }
            for (i, it) in items.iter().enumerate() {
                if it.len == 0 {
                    continue;
                }
                if ctl.cancelled() {
                    cut = true;
                    break;
                }
                let r = match it.src {
                    WSource::Dev(s) => cf
                        .write(
                            &views[s].slice(it.src_offset..it.src_offset + it.len),
                            it.file_offset,
                        )
                        .map(|_| ()),
                    // SAFETY: the slice is borrowed for 'a and holds len bytes.
                    WSource::Host(b) => unsafe {
                        io::pwrite_full(&file.fds.buffered, b.as_ptr(), b.len(), it.file_offset)
                    }
                    .map_err(|e| file.fds.err("pwrite", e)),
                };
                match r {
                    Ok(()) => {
                        (moved[i], complete[i]) = (it.len, true);
                        ctl.moved(it.len);
                    }
                    Err(e @ Error::Cuda { .. }) => return Err(e),
                    Err(e) => failed.push((i, e)),
                }
            }
        } else {
            let direct = file.write_direct();
            let (lo, hi) =
                items
                    .iter()
                    .filter(|it| it.len > 0)
                    .fold((u64::MAX, 0u64), |(lo, hi), it| {
                        (
                            lo.min(it.file_offset),
                            hi.max(it.file_offset + it.len as u64),
                        )
                    });
            if hi > lo {
                file.prepare_write(direct, lo, (hi - lo) as usize)?;
            }
            let piece = file.cfg.piece_size();
            // Buffers: the device sources, then one per host item.
            let streams: Vec<Arc<CudaStream>> = views.iter().map(|v| v.stream().clone()).collect();
            let mut bufs = Vec::with_capacity(views.len() + items.len());
            let mut guards = Vec::with_capacity(views.len());
            for (v, s) in views.iter().zip(&streams) {
                let (p, g) = v.device_ptr(s);
                bufs.push(Mem::Dev(p));
                guards.push(g);
            }
            let mut tasks = Vec::new();
            for (i, it) in items.iter().enumerate() {
                let (buf, buf_off) = match it.src {
                    WSource::Dev(s) => (s, it.src_offset),
                    WSource::Host(b) => {
                        bufs.push(Mem::Host(b.as_ptr().cast_mut()));
                        (bufs.len() - 1, 0)
                    }
                };
                let at = Task {
                    buf: buf as u32,
                    item: i as u32,
                    buf_off,
                    ..Task::default()
                };
                plan_item(
                    &mut tasks,
                    at,
                    it.file_offset,
                    it.len,
                    piece,
                    Dir::Write,
                    direct,
                );
            }
            let after = if ctx.is_some() {
                stream_events(&streams)?
            } else {
                crate::cuda::events::Recorded::none()
            };
            ctl.wait_for(&after, total)?;
            let dev = ctx.as_ref().map(|c| c.ordinal());
            let eng = engine::engine(dev, file.cfg.numa_pin)?;
            let threads = if ctx.is_some() {
                file.write_threads(dev, direct)
            } else {
                file.threads_for(dev, direct)
            };
            // SAFETY: device buffers are the sources borrowed for 'a by this batch, in `ctx`;
            // host buffers are slices borrowed for 'a (only read: a write job); each task lies
            // inside its item's source range (checked above); no copy starts before the
            // sources' pending writers (`after`); Engine::run returns only after every copy
            // completed.
            let job = unsafe {
                engine::Job::batch(
                    vec![&*file.fds],
                    bufs,
                    items.len(),
                    tasks,
                    piece,
                    Op::Write,
                    ctx.clone(),
                )
            }
            .with_control(ctl.engine(&after));
            let out = eng.run(job, threads).map_err(engine::Failed::into_error)?;
            drop(guards);
            odirect = out.odirect;
            copies = out.copies;
            cut = out.cancelled;
            for (k, o) in out.items.into_iter().enumerate() {
                moved[k] = o.moved;
                complete[k] = o.error.is_none() && o.complete;
                match o.error {
                    None if cut => {}
                    Some(e) => failed.push((k, e)),
                    None if !o.complete && items[k].len > 0 => failed.push((
                        k,
                        file.fds.err(
                            "pwrite",
                            std::io::Error::other("the item was not written completely"),
                        ),
                    )),
                    None => {}
                }
            }
        }
        if cut {
            return Err(cancelled(&items, &moved, &complete, |it| it.len, total));
        }
        if durable {
            file.sync_all()?;
        }
        if !failed.is_empty() {
            failed.sort_by_key(|f| f.0);
            return Err(Error::BatchFailed {
                total: items.len(),
                failed,
            });
        }
        let mut paths = Vec::new();
        for it in &items {
            match it.src {
                WSource::Dev(_) => share(&mut paths, &device_report, it.len),
                WSource::Host(_) => share(
                    &mut paths,
                    &PathReport::fallback(TransferPath::Posix, crate::path::Cause::HostMemory),
                    it.len,
                ),
            }
        }
        let mut r = BatchReport::new(t0, items.iter().map(|it| it.len).collect(), paths, 1);
        r.odirect = odirect;
        r.copies = copies;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch's host seam: what `ReadBatch::run` does for the items the engine reads, with
    /// host destinations instead of device ones. The sources are prepared and checked by the
    /// batch's own functions, the job planned by its planner and run by the engine (its host
    /// read path, on the host engine's workers), and the outcomes mapped as the batch maps
    /// them: `Ok` only when every item is in place. `items`: (path, file offset, length,
    /// destination, destination offset).
    fn host_batch(
        options: GpuFileOptions,
        items: &[(&FsPath, u64, usize, usize, usize)],
        dsts: &mut [Vec<u8>],
    ) -> Result<()> {
        host_batch_with(options, items, dsts, |_| {}, |_| {})
    }

    /// [`host_batch`], calling `checked` after the checks (before the job) and `window`
    /// with the job's window once it exists (a test installs its hooks there); the window's
    /// limit and what it did are left in `LAST_WINDOW`.
    fn host_batch_with(
        options: GpuFileOptions,
        items: &[(&FsPath, u64, usize, usize, usize)],
        dsts: &mut [Vec<u8>],
        checked: impl FnOnce(&Sources<'_, '_>),
        window: impl FnOnce(&mut FdWindow),
    ) -> Result<()> {
        let mut srcs: Vec<Source<'_>> = Vec::new();
        let mut by_path: HashMap<PathBuf, usize> = HashMap::new();
        let items: Vec<ReadItem_> = items
            .iter()
            .map(|&(p, file_offset, len, dst, dst_offset)| {
                let src = *by_path.entry(p.to_path_buf()).or_insert_with(|| {
                    srcs.push(Source::Path(p.to_path_buf()));
                    srcs.len() - 1
                });
                ReadItem_ {
                    src,
                    file_offset,
                    len,
                    dst,
                    dst_offset,
                }
            })
            .collect();
        let eng = engine::engine(None, false)?;
        let threads = engine::default_threads(None, false);
        let sources = Sources::prepare(&srcs, &items, &options, &eng, threads, None)?;
        let dst_len: Vec<usize> = dsts.iter().map(|d| d.len()).collect();
        check_items(&items, &sources, &dst_len, 0)?;
        checked(&sources);
        let files: Vec<Src<'_>> = (0..srcs.len()).map(|s| sources.src(s)).collect();
        let engine_items: Vec<usize> = (0..items.len())
            .filter(|&i| files[items[i].src].cufile().is_none())
            .collect();
        assert_eq!(
            engine_items.len(),
            items.len(),
            "a file went through cuFile"
        );
        let first = files[items[0].src];
        let piece = first.cfg().piece_size();
        let mut plan = plan_engine_job(&items, &files, &engine_items, piece);
        let threads = threads_for(first.cfg(), None, plan.any_direct);
        let mut win = window_for(&mut plan, threads);
        if let Some(w) = win.as_mut() {
            window(w);
        }
        let bufs = dsts.iter_mut().map(|d| Mem::Host(d.as_mut_ptr())).collect();
        // SAFETY: each buffer is a `dsts` vector, borrowed mutably until the job returned;
        // every task lies inside its item's destination range, which check_items checked to fit
        // its buffer and to overlap no other item's. The window outlives the job.
        let job = unsafe {
            engine::Job::batch_windowed(
                plan.files,
                win.as_ref(),
                bufs,
                items.len(),
                plan.tasks,
                piece,
                Op::Read,
                None,
            )
        };
        let out = eng.run(job, threads).map_err(engine::Failed::into_error)?;
        if let Some(w) = &win {
            LAST_WINDOW.with(|l| l.set(Some((w.limit(), w.stats()))));
        }
        drop(win);
        let (mut moved, mut complete, mut failed) =
            (vec![0; items.len()], vec![false; items.len()], Vec::new());
        engine_results(
            out.items,
            &items,
            &files,
            false,
            &mut moved,
            &mut complete,
            &mut failed,
        );
        drop(files);
        sources.close(&eng, threads);
        if !failed.is_empty() {
            failed.sort_by_key(|f| f.0);
            return Err(Error::BatchFailed {
                total: items.len(),
                failed,
            });
        }
        Ok(())
    }

    thread_local! {
        /// The window of this thread's last `host_batch` job that had one: its limit and
        /// what it did.
        static LAST_WINDOW: std::cell::Cell<Option<(usize, engine::window::WindowStats)>> =
            const { std::cell::Cell::new(None) };
    }

    /// Descriptors this process holds now (`/proc/self/fd`, less the one that lists them);
    /// `None` when the listing cannot be opened (no descriptor left).
    fn open_descriptors() -> Option<usize> {
        Some(std::fs::read_dir("/proc/self/fd").ok()?.count() - 1)
    }

    /// Set (to the soft `RLIMIT_NOFILE` to lower to) in the child process that
    /// `a_batch_reads_more_files_than_the_process_may_hold_open` starts.
    const FD_LIMIT_CHILD: &str = "GPUDIRECT_TEST_BATCH_FD_LIMIT";

    /// 2000 files of random sizes (1 byte to 24 KiB, pieces of 8 KiB: most files are read in
    /// several pieces, and every 50th file also as three items) through the batch's host seam,
    /// every byte checked, while a thread counts the descriptors the process holds. Run as it
    /// is, it checks the batch; in the child process of
    /// `a_batch_reads_more_files_than_the_process_may_hold_open` it first lowers the soft
    /// `RLIMIT_NOFILE` to the value of `FD_LIMIT_CHILD` (the test runs alone there).
    #[test]
    fn many_files_through_the_batch_seam_under_the_descriptor_limit() {
        use rand::{Rng, SeedableRng};
        let limit: Option<u64> = std::env::var(FD_LIMIT_CHILD)
            .ok()
            .map(|v| v.parse().unwrap());
        if let Some(n) = limit {
            // This child process runs this test alone.
            crate::storage::testkit::set_soft_nofile_limit(n);
        }
        let dir = crate::storage::testkit::scratch("batch-fdlimit");
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(34);
        let n = 2000;
        let mut files = Vec::new();
        for k in 0..n {
            let p = dir.join(format!("f{k}"));
            let data = crate::storage::testkit::random(rng.random_range(1..=24 << 10), k as u64);
            std::fs::write(&p, &data).unwrap();
            files.push((p, data));
        }
        // (file, offset, len) per item, into one destination back to back (a gap of 1 to 99
        // bytes after every 7th).
        let mut want: Vec<(usize, u64, usize, usize)> = Vec::new();
        let mut end = 0usize;
        for (k, (_, data)) in files.iter().enumerate() {
            let cuts = if k.is_multiple_of(50) && data.len() >= 3 {
                let a = rng.random_range(1..data.len() - 1);
                let b = rng.random_range(a + 1..data.len());
                vec![(0, a), (a, b - a), (b, data.len() - b)]
            } else {
                vec![(0, data.len())]
            };
            for (off, len) in cuts {
                want.push((k, off as u64, len, end));
                end += len
                    + if want.len().is_multiple_of(7) {
                        rng.random_range(1..100)
                    } else {
                        0
                    };
            }
        }
        let mut dsts = vec![vec![0xA5u8; end]];
        let items: Vec<(&FsPath, u64, usize, usize, usize)> = want
            .iter()
            .map(|&(k, off, len, at)| (files[k].0.as_path(), off, len, 0, at))
            .collect();
        let before = open_descriptors().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        // The most descriptors seen open during the batch (`None`: none left to count with).
        let most = std::thread::scope(|s| {
            let counter = s.spawn(|| {
                let mut most = Some(0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    most = most.zip(open_descriptors()).map(|(a, b)| a.max(b));
                }
                most
            });
            let r = host_batch(
                GpuFile::options()
                    .task_size(8 << 10)
                    .bounce_size(8 << 10)
                    .fallback(crate::path::FallbackPolicy::Allow),
                &items,
                &mut dsts,
            );
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let most = counter.join().unwrap();
            if let Err(e) = r {
                std::fs::remove_dir_all(&dir).unwrap();
                panic!(
                    "the batch of {n} files failed (soft RLIMIT_NOFILE {limit:?}, {before} descriptors open before, at most {most:?} during): {e}"
                );
            }
            most
        });
        let mut expect = vec![0xA5u8; end];
        for &(k, off, len, at) in &want {
            expect[at..at + len].copy_from_slice(&files[k].1[off as usize..off as usize + len]);
        }
        if let Some(i) = (0..end).find(|&i| dsts[0][i] != expect[i]) {
            panic!("destination byte {i} differs from the files");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        // Every file was opened when the job reached it, once (its pieces come one after
        // another: none is closed for room), and never more at once than the window holds.
        let (window, stats) = LAST_WINDOW
            .with(|l| l.get())
            .expect("the batch's files went through a window");
        assert!(stats.peak <= window, "{stats:?} in a window of {window}");
        assert_eq!((stats.opens, stats.reopens), (n, 0), "{stats:?}");
        if limit.is_some() {
            // Alone in this process: the descriptors it held are the window's (one per file).
            let most = most.expect("descriptors ran out during the batch");
            assert!(
                most <= before + window,
                "{most} descriptors open during the batch, {before} before, in a window of {window}"
            );
        }
        println!(
            "read {n} files ({} items, {end} bytes), soft RLIMIT_NOFILE {limit:?}: {before} descriptors open before, at most {most:?} during, window of {window}: {stats:?}",
            want.len()
        );
    }

    /// A batch whose files include a directory, a FIFO, a missing file, an unreadable one, a
    /// `/proc` file (size unknown) or an item past end of file is refused at the first bad
    /// item (in the order added) before any byte moves, with the errno `open` would give (from
    /// `stat` and `faccessat`: no file is held open), the file named; an empty file's empty
    /// item is fine. (Run as root, the unreadable file is readable: then the batch reads it.)
    #[test]
    fn a_batch_with_a_bad_file_among_its_files_is_refused_and_moves_nothing() {
        let dir = crate::storage::testkit::scratch("batch-bad");
        std::fs::create_dir_all(&dir).unwrap();
        let mut good = Vec::new();
        for k in 0..6 {
            let p = dir.join(format!("g{k}"));
            std::fs::write(&p, crate::storage::testkit::random(1000 + k, k as u64)).unwrap();
            good.push(p);
        }
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let sub = dir.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let locked = dir.join("locked");
        std::fs::write(&locked, b"no reading").unwrap();
        std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o000))
            .unwrap();
        let readable_anyway = std::fs::File::open(&locked).is_ok();
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        let missing = dir.join("missing");
        let proc_file = FsPath::new("/proc/version");
        let options = || GpuFile::options().fallback(crate::path::FallbackPolicy::Allow);
        // (what, the bad file, its item's offset and length, what the refusal says)
        let cases: [(&str, &FsPath, u64, usize, &str); 6] = [
            (
                "a directory",
                &sub,
                0,
                10,
                "is a directory, not a regular file",
            ),
            ("a FIFO", &fifo, 0, 10, "is a FIFO, not a regular file"),
            ("a missing file", &missing, 0, 10, "stat on"),
            ("an unreadable file", &locked, 0, 10, "faccessat on"),
            (
                "a file of unknown size",
                proc_file,
                0,
                10,
                "size is unknown",
            ),
            (
                "an item past end of file",
                &good[5],
                1000,
                10,
                "the file ends after 5",
            ),
        ];
        for (what, bad, off, len, says) in cases {
            // Three good files, the bad one as item 3, two more good ones, an empty item.
            let mut items: Vec<(&FsPath, u64, usize, usize, usize)> = good[..3]
                .iter()
                .enumerate()
                .map(|(k, p)| (p.as_path(), 0, 1000, 0, k * 1000))
                .collect();
            items.push((bad, off, len, 0, 3000));
            items.extend(
                good[3..5]
                    .iter()
                    .enumerate()
                    .map(|(k, p)| (p.as_path(), 0, 1000, 0, 4000 + k * 1000)),
            );
            items.push((&empty, 0, 0, 0, 6000));
            let mut dsts = vec![vec![0xA5u8; 7000]];
            let r = host_batch(options(), &items, &mut dsts);
            if what == "an unreadable file" && readable_anyway {
                r.unwrap_or_else(|e| panic!("{what}, readable by this process: {e}"));
                continue;
            }
            match r {
                Err(Error::BatchRefused { index: 3, source }) => {
                    let msg = source.to_string();
                    assert!(msg.contains(says), "{what}: {msg}");
                    assert!(
                        msg.contains(&bad.display().to_string()),
                        "{what}: the error does not name the file: {msg}"
                    );
                }
                other => panic!("{what}: {other:?}"),
            }
            assert!(
                dsts[0].iter().all(|&b| b == 0xA5),
                "{what}: a refused batch moved bytes"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Bad ranges refuse the whole batch at the first bad item (in the order added) before any
    /// byte moves, with an `Error::InvalidArgument` saying what is wrong: two destination ranges
    /// that overlap (the later item refused, the earlier one named; the same bytes of another
    /// buffer are fine), a destination too small (its end past the buffer, or an offset whose
    /// end overflows), a file offset past the largest. Every byte of both destinations is
    /// checked untouched; the same batch without its bad item reads every byte.
    #[test]
    fn a_batch_with_a_bad_range_is_refused_and_moves_nothing() {
        let dir = crate::storage::testkit::scratch("batch-bad-range");
        std::fs::create_dir_all(&dir).unwrap();
        let files: Vec<(PathBuf, Vec<u8>)> = (0..5)
            .map(|k| {
                let p = dir.join(format!("f{k}"));
                let data = crate::storage::testkit::random(1000, 40 + k as u64);
                std::fs::write(&p, &data).unwrap();
                (p, data)
            })
            .collect();
        let f = |k: usize| files[k].0.as_path();
        // Three good items: file 0 into buffer 0 at 0, file 1 into buffer 0 at 2000, file 2
        // into buffer 1 at 0 (the same offsets as file 0's, in another buffer).
        let good: Vec<(&FsPath, u64, usize, usize, usize)> = vec![
            (f(0), 0, 1000, 0, 0),
            (f(1), 0, 1000, 0, 2000),
            (f(2), 0, 1000, 1, 0),
        ];
        // (what, the bad item (added fourth), what the refusal says)
        type Item<'p> = (&'p FsPath, u64, usize, usize, usize);
        let cases: [(&str, Item<'_>, &str); 5] = [
            (
                "a destination range overlapping an earlier item's",
                (f(3), 0, 1000, 0, 2500),
                "overlaps item 1's",
            ),
            (
                "a destination range ending past its buffer",
                (f(3), 0, 1000, 1, 2500),
                "do not fit its 3000-byte destination",
            ),
            (
                "a destination offset past its buffer",
                (f(3), 0, 1, 1, 3000),
                "do not fit its 3000-byte destination",
            ),
            (
                "a destination offset whose end overflows",
                (f(3), 0, 10, 0, usize::MAX - 5),
                "do not fit its 7000-byte destination",
            ),
            (
                "a file offset past the largest",
                (f(3), u64::MAX - 5, 10, 0, 5000),
                "passes the largest file offset",
            ),
        ];
        let options = || GpuFile::options().fallback(crate::path::FallbackPolicy::Allow);
        for (what, bad, says) in cases {
            let mut items = good.clone();
            items.push(bad);
            items.push((f(4), 0, 1000, 0, 6000));
            let mut dsts = vec![vec![0xA5u8; 7000], vec![0xA5u8; 3000]];
            match host_batch(options(), &items, &mut dsts) {
                Err(Error::BatchRefused { index: 3, source }) => match *source {
                    Error::InvalidArgument(ref m) => assert!(m.contains(says), "{what}: {m}"),
                    ref e => panic!("{what}: not an InvalidArgument: {e:?}"),
                },
                other => panic!("{what}: {other:?}"),
            }
            for (b, d) in dsts.iter().enumerate() {
                assert!(
                    d.iter().all(|&x| x == 0xA5),
                    "{what}: a refused batch moved bytes into buffer {b}"
                );
            }
        }
        // Without the bad item: every byte in place, every other byte untouched.
        let mut items = good.clone();
        items.push((f(4), 0, 1000, 0, 6000));
        let mut dsts = vec![vec![0xA5u8; 7000], vec![0xA5u8; 3000]];
        host_batch(options(), &items, &mut dsts).unwrap();
        let mut want = vec![vec![0xA5u8; 7000], vec![0xA5u8; 3000]];
        for &(p, _, len, d, at) in &items {
            let k = files.iter().position(|(q, _)| q == p).unwrap();
            want[d][at..at + len].copy_from_slice(&files[k].1);
        }
        assert!(dsts == want, "the good batch's bytes differ");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Files that change between the batch's check and the job's read fail their items only,
    /// each with an error naming the file (deleted: `open`'s NotFound; replaced by another
    /// file; replaced by a FIFO, without blocking; truncated: changed, its ctime moved), every other item
    /// complete, every one of its bytes checked; a file split into pieces among them.
    #[test]
    fn files_changed_between_the_check_and_the_read_fail_their_items_only() {
        let dir = crate::storage::testkit::scratch("batch-changed");
        std::fs::create_dir_all(&dir).unwrap();
        let n = 12;
        let files: Vec<(PathBuf, Vec<u8>)> = (0..n)
            .map(|k| {
                let p = dir.join(format!("f{k}"));
                let data = crate::storage::testkit::random(20_000 + 37 * k, 90 + k as u64);
                std::fs::write(&p, &data).unwrap();
                (p, data)
            })
            .collect();
        let mut at = 0;
        let mut want = Vec::new();
        for (k, (_, data)) in files.iter().enumerate() {
            want.push((k, at));
            at += data.len();
        }
        let items: Vec<(&FsPath, u64, usize, usize, usize)> = want
            .iter()
            .map(|&(k, at)| (files[k].0.as_path(), 0, files[k].1.len(), 0, at))
            .collect();
        let mut dsts = vec![vec![0xA5u8; at]];
        let (deleted, replaced, fifo, truncated) = (2, 5, 7, 9);
        let r = host_batch_with(
            GpuFile::options()
                .task_size(4096)
                .bounce_size(4096)
                .fallback(crate::path::FallbackPolicy::Allow),
            &items,
            &mut dsts,
            |_| {
                // Past a tick of the filesystem's clock (coarse timestamps).
                std::thread::sleep(Duration::from_millis(25));
                std::fs::remove_file(&files[deleted].0).unwrap();
                let other = dir.join("other");
                std::fs::write(&other, &files[replaced].1).unwrap();
                std::fs::rename(&other, &files[replaced].0).unwrap();
                std::fs::remove_file(&files[fifo].0).unwrap();
                let c =
                    std::ffi::CString::new(files[fifo].0.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&files[truncated].0)
                    .unwrap()
                    .set_len(5000)
                    .unwrap();
            },
            |_| {},
        );
        let Err(Error::BatchFailed { total, failed }) = r else {
            panic!("not a failed batch: {r:?}");
        };
        assert_eq!(total, n);
        let which: Vec<usize> = failed.iter().map(|f| f.0).collect();
        assert_eq!(
            which,
            vec![deleted, replaced, fifo, truncated],
            "{failed:?}"
        );
        for (i, e) in &failed {
            let Error::Io { op, path, source } = e else {
                panic!("item {i}: not an Error::Io: {e}");
            };
            assert_eq!(
                path.as_deref(),
                Some(files[*i].0.as_path()),
                "item {i}: {e}"
            );
            let kind = source.kind();
            match *i {
                i if i == deleted => {
                    assert_eq!((*op, kind), ("open", std::io::ErrorKind::NotFound), "{e}")
                }
                i if i == replaced => assert!(e.to_string().contains("another file"), "{e}"),
                i if i == fifo => assert!(e.to_string().contains("a FIFO"), "{e}"),
                // Its ctime moved: the window's open finds it changed.
                _ => assert!(
                    *op == "open" && e.to_string().contains("the file changed"),
                    "{e}"
                ),
            }
        }
        for &(k, at) in &want {
            if !which.contains(&k) {
                let len = files[k].1.len();
                assert!(dsts[0][at..at + len] == files[k].1[..], "item {k} differs");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file deleted and written again at its path between the batch's check and the job's
    /// open (same length, other bytes: ext4 gives it the freed inode number at once) fails its
    /// item with an `Error::Io` of `open` naming it; no item reports the new bytes as read,
    /// the others are complete, every byte checked.
    #[test]
    fn a_file_deleted_and_written_again_after_the_check_fails_its_item() {
        let dir = crate::storage::testkit::scratch("batch-rewritten");
        std::fs::create_dir_all(&dir).unwrap();
        let files: Vec<(PathBuf, Vec<u8>)> = (0..3)
            .map(|k| {
                let p = dir.join(format!("f{k}"));
                let data = crate::storage::testkit::random(30_000 + 11 * k, 70 + k as u64);
                std::fs::write(&p, &data).unwrap();
                (p, data)
            })
            .collect();
        let mut at = 0;
        let mut items: Vec<(&FsPath, u64, usize, usize, usize)> = Vec::new();
        for (p, data) in &files {
            items.push((p.as_path(), 0, data.len(), 0, at));
            at += data.len();
        }
        let mut dsts = vec![vec![0xA5u8; at]];
        let rewritten = 1;
        let r = host_batch_with(
            GpuFile::options()
                .task_size(4096)
                .bounce_size(4096)
                .fallback(crate::path::FallbackPolicy::Allow),
            &items,
            &mut dsts,
            |_| {
                // Past a tick of the filesystem's clock (coarse timestamps).
                std::thread::sleep(Duration::from_millis(25));
                let p = &files[rewritten].0;
                std::fs::remove_file(p).unwrap();
                let other = crate::storage::testkit::random(files[rewritten].1.len(), 99);
                std::fs::write(p, other).unwrap();
            },
            |_| {},
        );
        let Err(Error::BatchFailed { total, failed }) = r else {
            panic!("the rewritten file's item did not fail: {r:?}");
        };
        assert_eq!(total, 3);
        assert_eq!(failed.len(), 1, "{failed:?}");
        let (i, e) = &failed[0];
        assert_eq!(*i, rewritten, "{e}");
        let Error::Io { op, path, .. } = e else {
            panic!("not an Error::Io: {e}");
        };
        assert_eq!(
            (*op, path.as_deref()),
            ("open", Some(files[rewritten].0.as_path())),
            "{e}"
        );
        let mut at = 0;
        for (k, (_, data)) in files.iter().enumerate() {
            if k != rewritten {
                assert!(dsts[0][at..at + data.len()] == data[..], "item {k} differs");
            }
            at += data.len();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file the batch checks by path (and leaves to the window) gets the path report
    /// `GpuFile::open` gives it with the same options: the default (`CompatMode` from the
    /// environment), `Backend::Engine`, `CompatMode::PosixOnly`; and its size and identity
    /// are the file's.
    #[test]
    fn a_file_checked_by_path_reports_the_path_an_open_would() {
        let (p, data) = crate::storage::testkit::random_file("batch-report", 5000, 12);
        let srcs = vec![Source::Path(p.clone())];
        let items = vec![ReadItem_ {
            src: 0,
            file_offset: 0,
            len: 5000,
            dst: 0,
            dst_offset: 0,
        }];
        let eng = engine::engine(None, false).unwrap();
        for (what, options) in [
            ("default", GpuFile::options()),
            (
                "Backend::Engine",
                GpuFile::options().backend(super::super::Backend::Engine),
            ),
            (
                "PosixOnly",
                GpuFile::options().compat_mode(super::super::CompatMode::PosixOnly),
            ),
        ] {
            let sources = Sources::prepare(&srcs, &items, &options, &eng, 4, None).unwrap();
            let opened = options.clone().open(&p).unwrap();
            let src = sources.src(0);
            assert_eq!(src.report(), opened.path_report(), "{what}");
            match src {
                Src::Lazy(l, _) => {
                    let m = std::fs::metadata(&p).unwrap();
                    assert_eq!(l.size, Some(data.len() as u64), "{what}");
                    assert_eq!(l.id, io::FileId::of(&m), "{what}");
                }
                // Opened up front: only where this filesystem's cheap facts allow cuFile DMA
                // (its report is then GpuFile::open's by construction).
                Src::Open(_) => {}
            }
        }
        std::fs::remove_file(&p).unwrap();
    }

    /// Files whose backend cannot be decided without opening them are opened up front, as
    /// before the window: with options that write, every file (opened by `GpuFile::open`, held
    /// through the job, no window; every byte read); with `Backend::CuFile`, the file is
    /// registered with cuFile up front or, where cuFile cannot take it, refuses the batch at
    /// its first item.
    #[test]
    fn files_the_batch_cannot_decide_unopened_are_opened_up_front() {
        let dir = crate::storage::testkit::scratch("batch-upfront");
        std::fs::create_dir_all(&dir).unwrap();
        let files: Vec<(PathBuf, Vec<u8>)> = (0..100)
            .map(|k| {
                let p = dir.join(format!("f{k}"));
                let d = crate::storage::testkit::random(300 + 7 * k, 500 + k as u64);
                std::fs::write(&p, &d).unwrap();
                (p, d)
            })
            .collect();
        let mut at = 0;
        let mut items = Vec::new();
        for (p, d) in &files {
            items.push((p.as_path(), 0, d.len(), 0, at));
            at += d.len();
        }
        let mut dsts = vec![vec![0xA5u8; at]];
        LAST_WINDOW.with(|l| l.set(None));
        host_batch(
            GpuFile::options()
                .write(true)
                .fallback(crate::path::FallbackPolicy::Allow),
            &items,
            &mut dsts,
        )
        .unwrap();
        assert!(
            LAST_WINDOW.with(|l| l.get()).is_none(),
            "files opened up front went through a window"
        );
        let want: Vec<u8> = files.iter().flat_map(|(_, d)| d.iter().copied()).collect();
        assert!(dsts[0] == want, "a byte differs");
        // Backend::CuFile: registered up front, or refused at the first item.
        let srcs = vec![Source::Path(files[0].0.clone())];
        let one = vec![ReadItem_ {
            src: 0,
            file_offset: 0,
            len: 10,
            dst: 0,
            dst_offset: 0,
        }];
        let eng = engine::engine(None, false).unwrap();
        let options = GpuFile::options().backend(super::super::Backend::CuFile);
        match Sources::prepare(&srcs, &one, &options, &eng, 4, None) {
            Ok(s) => match s.src(0) {
                Src::Open(f) => assert!(f.uses_cufile(), "not through cuFile"),
                Src::Lazy(..) => panic!("a Backend::CuFile file was left to the window"),
            },
            Err(Error::BatchRefused { index: 0, source }) => {
                eprintln!("cuFile refused here, as expected without it: {source}")
            }
            Err(e) => panic!("{e}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A batch of more files than the process may hold open at once (2000 files, soft
    /// `RLIMIT_NOFILE` lowered to 256 in a child process, which runs
    /// `many_files_through_the_batch_seam_under_the_descriptor_limit` alone): every byte in
    /// place.
    #[test]
    fn a_batch_reads_more_files_than_the_process_may_hold_open() {
        let text = crate::storage::testkit::run_test_in_child(
            "storage::batch::tests::many_files_through_the_batch_seam_under_the_descriptor_limit",
            &[(FD_LIMIT_CHILD, "256")],
        );
        assert!(
            text.contains("read 2000 files") && text.contains("1 passed"),
            "the child did not run the test:\n{text}"
        );
    }

    /// `direct_decisions` (items grouped by one sort, sources of one item or of an answer that
    /// needs no sample decided without allocating) answers exactly as asking each source's
    /// file for all its items' ranges at once: random items over files opened with O_DIRECT
    /// off, on and auto, ranges below and above `AUTO_DIRECT_MIN`, in random order, some items
    /// not the engine's.
    #[test]
    fn direct_decisions_match_asking_each_file_for_all_its_ranges() {
        use rand::{Rng, SeedableRng};
        let dir =
            std::env::temp_dir().join(format!("gpudirect-direct-decisions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(71);
        let modes = [ODirect::Off, ODirect::On, ODirect::Auto];
        let mut files = Vec::new();
        for k in 0..12 {
            let p = dir.join(format!("f{k}"));
            std::fs::write(&p, vec![k as u8; rng.random_range(1..3 * AUTO_DIRECT_MIN)]).unwrap();
            let f = GpuFile::options().odirect(modes[k % 3]).open(&p).unwrap();
            files.push(f);
        }
        let files: Vec<&GpuFile> = files.iter().collect();
        let srcs: Vec<Src<'_>> = files.iter().map(|f| Src::Open(f)).collect();
        for round in 0..20 {
            let items: Vec<ReadItem_> = (0..rng.random_range(1..60))
                .map(|_| {
                    let src = rng.random_range(0..files.len());
                    let size = files[src].len().unwrap() as usize;
                    let off = rng.random_range(0..size);
                    ReadItem_ {
                        src,
                        file_offset: off as u64,
                        len: rng.random_range(0..=size - off),
                        dst: 0,
                        dst_offset: 0,
                    }
                })
                .collect();
            let engine_items: Vec<usize> =
                (0..items.len()).filter(|_| rng.random_bool(0.8)).collect();
            let mut want = vec![false; items.len()];
            for (s, f) in files.iter().enumerate() {
                let mine: Vec<usize> = engine_items
                    .iter()
                    .copied()
                    .filter(|&i| items[i].src == s)
                    .collect();
                let ranges: Vec<(u64, usize)> = mine
                    .iter()
                    .map(|&i| (items[i].file_offset, items[i].len))
                    .collect();
                for (&i, d) in mine.iter().zip(f.read_direct_many(&ranges)) {
                    want[i] = d;
                }
            }
            assert_eq!(
                direct_decisions(&items, &srcs, &engine_items),
                want,
                "round {round}"
            );
        }
        assert!(
            files.iter().any(|f| f.direct_unsampled(1) == Some(true)),
            "no file reads with O_DIRECT: half the test checks nothing"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Review finding 4: a ring that cannot be built or locked fails no batch, and the
    /// descriptor table is still made room in, exactly once, whether the preparation failed
    /// before running `reserve` (a failed bind, `mmap`, `cuStreamCreate`), after it (a failed
    /// `cuMemHostRegister`, a worker panic), or succeeded.
    #[test]
    fn ring_preparation_is_best_effort_and_always_reserves_descriptors() {
        let fail = || Error::InvalidArgument("test: cuMemHostRegister refused".into());
        type Prep = fn(&mut dyn FnMut(), Error) -> Result<()>;
        let cases: [(&str, Prep); 4] = [
            ("fails before reserving", |_, e| Err(e)),
            ("fails after reserving", |r, e| {
                r();
                Err(e)
            }),
            ("succeeds", |r, _| {
                r();
                Ok(())
            }),
            ("reserve called twice", |r, _| {
                r();
                r();
                Ok(())
            }),
        ];
        for (what, prep) in cases {
            let reserved = std::cell::Cell::new(0);
            prepare_best_effort(|r| prep(r, fail()), || reserved.set(reserved.get() + 1));
            assert_eq!(
                reserved.get(),
                1,
                "{what}: reserve_fds ran {} times",
                reserved.get()
            );
        }
    }

    #[test]
    fn overlaps_are_found_per_buffer_and_name_both_items() {
        assert_eq!(first_overlap(vec![]), None);
        // Back to back: no overlap.
        assert_eq!(first_overlap(vec![(0, 0, 10, 0), (0, 10, 20, 1)]), None);
        // Same bytes in different buffers: no overlap.
        assert_eq!(first_overlap(vec![(0, 0, 10, 0), (1, 5, 20, 1)]), None);
        assert_eq!(
            first_overlap(vec![(0, 0, 10, 0), (0, 9, 20, 1)]),
            Some((1, 0))
        );
        // A long range swallowing later ones.
        assert_eq!(
            first_overlap(vec![(0, 0, 100, 3), (0, 10, 20, 5), (0, 30, 40, 1)]),
            Some((3, 1))
        );
        // Empty ranges never overlap.
        assert_eq!(first_overlap(vec![(0, 0, 10, 0), (0, 5, 5, 1)]), None);
    }

    #[test]
    fn failed_batches_say_how_many_and_which_first() {
        let e = Error::BatchFailed {
            total: 10,
            failed: vec![
                (3, Error::InvalidArgument("x".into())),
                (7, Error::InvalidArgument("y".into())),
            ],
        };
        let s = e.to_string();
        assert!(s.starts_with("2 of 10 batch items failed"), "{s}");
        assert!(s.contains("item 3"), "{s}");
        let r = refuse(4, Error::InvalidArgument("bad".into())).to_string();
        assert!(
            r.contains("batch item 4 refused, nothing was transferred"),
            "{r}"
        );
    }

    /// A destination the batch allocates (`new_destination`, what a one-allocation checkpoint
    /// load uses): through the segment ring (allocated while the engine reads) and through
    /// lanes (allocated first), two items with a gap between them land byte for byte, the
    /// buffer has the asked length, and a second new destination is refused.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_batch_new_destination_holds_every_item() {
        use crate::storage::Pipeline;
        let ctx = crate::storage::testkit::gpu();
        let stream = ctx.new_stream().unwrap();
        let len = (40 << 20) + 4096 + 17;
        let (p, data) = crate::storage::testkit::random_file("batch-new", len, 91);
        let (a, gap) = ((9 << 20) + 3, 4096 + 5);
        for pipe in [Pipeline::Segments, Pipeline::Lanes] {
            let f = GpuFile::options().pipeline(pipe).open(&p).unwrap();
            let mut b = ReadBatch::new();
            let d = b.new_destination(&stream, len + gap);
            b.read_file(&f, 0, a, d, 0);
            b.read_file(&f, a as u64, len - a, d, a + gap);
            let (r, buf) = b.run_allocating().unwrap();
            let buf = buf.expect("the new destination is handed back");
            assert_eq!((r.bytes, buf.len()), (len, len + gap), "{pipe:?}");
            let back = stream.clone_dtoh(&buf).unwrap();
            assert!(back[..a] == data[..a], "{pipe:?}: the first item");
            assert!(back[a + gap..] == data[a..], "{pipe:?}: the second item");
        }
        let mut b = ReadBatch::new();
        let d = b.new_destination(&stream, 16);
        b.new_destination(&stream, 16);
        b.read(&p, 0, 16, d, 0);
        assert!(matches!(b.run_allocating(), Err(Error::InvalidArgument(_))));
        std::fs::remove_file(&p).unwrap();
    }
}

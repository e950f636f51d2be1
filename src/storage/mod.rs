//! Files↔GPU: cuFile where it works, gpudirect's parallel POSIX engine where it can't.
//!
//! Start with [`read_to_gpu`] or [`GpuFile`]; settings are in [`config`].
//!
//! ```no_run
//! # fn main() -> gpudirect::Result<()> {
//! use gpudirect::storage::GpuFile;
//! let stream = gpudirect::cuda::context(0)?.default_stream();
//! // File → GPU in one call:
//! let (weights, report) = gpudirect::storage::read_to_gpu::<u8>("weights.bin", &stream)?;
//! println!("{report}"); // e.g. "… bytes via gpudirect POSIX engine … (because cuFile can't register files: udev data missing …)"
//! // GPU → file, durably:
//! let out = GpuFile::options().create(true).truncate(true).durable(true).open("copy.bin")?;
//! out.write_from_device(&weights, 0)?;
//! # Ok(()) }
//! ```
//!
//! # Which path did my bytes take
//! Each [`GpuFile`] decides at open (see [`Backend`], [`CompatMode`]): cuFile when it moves
//! bytes by DMA ([`TransferPath::Gds`](crate::TransferPath::Gds)); otherwise gpudirect's engine
//! ([`TransferPath::Posix`](crate::TransferPath::Posix)) with the [`Cause`](crate::Cause) that
//! ruled cuFile out (no nvidia-fs, udev data missing, filesystem unsupported, forced by config,
//! …). Under [`CompatMode::Auto`] that decision comes from cheap facts first (the filesystem, the udev
//! record of its block device, nvidia-fs or P2PDMA on the host), cached per device and
//! filesystem for the process: cuFile's driver is opened (about half a second) only where they
//! allow DMA, so an open on a known filesystem costs a few system calls. The doctor still runs
//! cuFile for the full diagnosis. Every
//! [`IoReport`] carries that [`PathReport`](crate::PathReport);
//! [`FallbackPolicy::Deny`](crate::FallbackPolicy::Deny) refuses a fallback before a byte moves.
//!
//! # Non-blocking and stream-ordered
//! Every device transfer orders itself after the work queued on the buffer's stream before the
//! call (and on the buffer elsewhere, through cudarc's events) by recording an event there and
//! waiting for that event, not for the stream (see [`GpuFile`], "Ordering").
//! [`GpuFile::read_async`], [`GpuFile::read_exact_async`], [`GpuFile::write_async`]
//! (and the host-memory [`GpuFile::pread_host_async`], [`GpuFile::pwrite_host_async`]) move an
//! owned buffer in and return a [`Transfer`] at once: `wait()`/`is_done()`, progress, cancel
//! ([`TransferControl`]), and with the `async` feature a `Future` for any executor:
//!
//! ```ignore
//! let file = std::sync::Arc::new(GpuFile::open("weights.bin")?);
//! let (result, buf) = file.read_exact_async(buf, 0).await; // the runtime thread never blocks
//! println!("{}", result?);
//! ```
//!
//! # The engine
//! One pool of workers per GPU (and one for host memory), pinned to the GPU's NUMA node: workers
//! `pread` pieces into a ring of large pinned segments and one host→device copy moves each run
//! of payload that is contiguous in a segment and in one destination buffer; writes overlap a
//! device→host copy with the `pwrite` of the previous piece. O_DIRECT is opportunistic
//! ([`ODirect`]): writes use it for their aligned part; reads when the range is not in the page
//! cache. Host-memory transfers ([`GpuFile::pread_host`], [`GpuFile::pwrite_host`]) run on the
//! host pool.
//!
//! - **First call at full speed**: threads start after the first job is published, the ring's
//!   memory is faulted in by the reads themselves and each slot page-locked by the worker that
//!   issues its first copy, so neither sits in front of the first byte
//!   ([`GpuFile::warm_up`] can still do it ahead).
//! - **Small transfers** (at most 1 MiB) take a fast path on the calling thread: a pooled pinned
//!   buffer, one copy on the buffer's own stream, no thread hand-off.
//! - **Many transfers in one job**: [`ReadBatch`] / [`read_many`] / [`GpuFile::read_ranges`]
//!   and [`WriteBatch`].
//! - **Bounded**: a transfer asks for its number of workers and the pool grows to the largest
//!   asked (at most 1024), whatever the `threads(n)` of each file; [`release_engines`] gives
//!   the threads and pinned memory back (and with `GPUDIRECT_ENGINE_IDLE_MS` set, the engine
//!   does so by itself after that long without a transfer; off by default).

mod backend;
mod batch;
pub mod config;
pub mod cufile;
pub(in crate::storage) mod engine;
mod file;
mod gate;
mod lent;
mod options;
#[cfg(test)]
pub(crate) mod testkit;
mod transfer;

/// Test hook (the crate's tests only, not API): faults injected into storage jobs.
#[cfg(test)]
pub(crate) use engine::faults;

pub use cufile::{CuFileStatus, IoReturn};

pub use backend::Backend;
pub use batch::{
    read_many, BatchDst, BatchReport, BatchSrc, PathShare, ReadBatch, ReadItem, WriteBatch,
};
pub use config::{CompatMode, ODirect, Pipeline, StorageConfig};
pub use file::{read_to_gpu, DeviceDst, DeviceSrc, GpuFile, IoReport, UNSIZED_READ_LIMIT};
pub use options::GpuFileOptions;
pub use transfer::{Progress, Transfer, TransferControl};

/// The engine's default worker count for `device` (`None`: host memory): the CPUs of the
/// GPU's NUMA node this process may use, 4 to 16 (see [`config`]).
pub fn default_threads(device: Option<usize>) -> usize {
    engine::default_threads(device, true)
}

/// What [`release_engines`] gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Released {
    /// Engine worker threads stopped.
    pub threads: usize,
    /// Bytes of the read rings and small-transfer buffers freed (page-locked or mapped). The
    /// workers' staging buffers are freed too, and not counted.
    pub ring_bytes: usize,
}

/// Gives back what the engine holds between transfers: stops its worker threads and frees its
/// pinned staging memory (waiting for transfers in progress first), and destroys the idle CUDA
/// events kept for transfers to order with (at most 64 per GPU). The non-blocking calls' flag
/// words (a 4 KiB page per GPU, at most 32 KiB) are kept for the process: a device write may
/// still be pending on a word a cancelled transfer gave back. Nothing else changes: the
/// next transfer starts the workers again and pins as it reads, without a warm-up pause (its
/// calls make events again until some are kept).
///
/// It waits for all the GPU's work, not only gpudirect's: CUDA's `cuMemHostUnregister`, which
/// frees the pinned memory, waits for every stream of the context, and other threads'
/// `cuEventCreate` waits for it meanwhile. Call it when the GPU is quiet (between phases of a
/// job, after loading a model), not from a thread whose kernels another stream is waiting for.
///
/// With `GPUDIRECT_ENGINE_IDLE_MS` set the engine also does this by itself after that many
/// milliseconds without a transfer. It is off by default (unset or `0`: threads and memory are
/// kept for the life of the process) because a release behind the caller's back waits for the
/// caller's kernels and stalls the caller's CUDA calls meanwhile. What is kept, pinned, with the
/// default settings: the read ring, 96 MiB per GPU (a job with larger segments builds a larger
/// one and the old one is kept too); each worker's two staging buffers of the largest size it
/// has used (a GPU write stages 128 MiB / threads per buffer, at most 32 MiB), plus the smaller
/// ones they replaced (each replacement at least doubles); at most 64 small-transfer buffers
/// of 1 MiB (more small transfers at once use unlocked memory). Nothing
/// of it is freed during a transfer: freeing pinned memory is the wait this avoids. There is
/// at most one engine per GPU (and one for host memory), whatever the thread counts asked for:
/// a transfer asks for its number of workers and the engine grows to the largest number asked
/// (at most 1024).
pub fn release_engines() -> Released {
    let r = engine::release_all();
    crate::cuda::events::release_idle();
    Released {
        threads: r.threads,
        ring_bytes: r.ring_bytes,
    }
}

/// The NUMA node of a GPU (from `/sys/bus/pci/devices/<bus id>/numa_node`), when the platform
/// reports one; the engine pins that device's workers there. The same as
/// [`cuda::device::numa_node`](crate::cuda::device::numa_node).
pub fn gpu_numa_node(ordinal: usize) -> Option<u32> {
    crate::cuda::device::numa_node(ordinal)
}

/// `GPUDIRECT_TRACE=timing`: prints a phase mark (for the rooms built on storage); `what` is
/// only built when tracing is on.
pub(crate) fn trace_mark(what: impl FnOnce() -> String) {
    engine::trace::mark(what)
}

/// Whether `GPUDIRECT_TRACE=timing` is on.
pub(crate) fn trace_on() -> bool {
    engine::trace::on()
}

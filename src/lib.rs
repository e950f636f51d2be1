//! Safe Rust for NVIDIA GPUDirect: bytes between GPUs, NICs and files without a CPU bounce, on
//! [`cudarc`] types — and every transfer says which path its bytes took.
//!
//! - [`p2p`]: GPU↔GPU over NVLink/PCIe — topology, [`p2p::PeerAccess`], peer copies of cudarc
//!   buffers that report whether they went direct.
//! - [`rdma`]: a NIC reading and writing GPU memory — verbs, GPU memory regions registered by
//!   dma-buf or a peer-memory client, the GDR probe.
//! - [`storage`]: files↔GPU — cuFile where it moves bytes by DMA, gpudirect's parallel POSIX
//!   engine everywhere else.
//! - `safetensors` (feature `safetensors`, on by default): the checkpoint room — load a
//!   safetensors file, shards or a model directory onto the GPU in one job, save GPU tensors
//!   atomically.
//! - [`diag`]: the findings the `doctor` example prints.
//! - [`cuda`]: the ground floor the rooms share — the checked door to libcuda, what a pointer
//!   is, `cuMemAlloc` buffers ([`cuda::DeviceBuffer`], [`cuda::GdrBuffer`]), dma-buf export, a
//!   GPU's PCI id and NUMA node.
//!
//! How the rooms stand on each other, and the walls between them: `ARCHITECTURE.md`.
//!
//! # Quick start
//!
//! A file into a `CudaSlice` in three lines, with the path printed:
//!
//! ```no_run
//! # fn main() -> gpudirect::Result<()> {
//! let stream = gpudirect::cuda::context(0)?.default_stream();
//! let (weights, report) = gpudirect::storage::read_to_gpu::<u8>("model.safetensors", &stream)?;
//! println!("{} bytes via {}", weights.len(), report.path); // e.g. "... via gpudirect POSIX engine (…) (because …)"
//! # Ok(()) }
//! ```
//!
//! Refuse any fallback for the whole process (or set `GPUDIRECT_REQUIRE_DIRECT=1`):
//!
//! ```
//! gpudirect::FallbackPolicy::set_global(gpudirect::FallbackPolicy::Deny);
//! # gpudirect::FallbackPolicy::set_global(gpudirect::FallbackPolicy::Warn);
//! ```
//!
//! # Which path did my bytes take
//!
//! GPUDirect rarely fails loudly: the bytes still arrive, through host memory, ten times slower.
//! So every transfer returns (or its handle records) a [`PathReport`]: a [`TransferPath`] —
//! [`TransferPath::PeerDirect`], [`TransferPath::Gds`], [`TransferPath::RdmaDmaBuf`],
//! [`TransferPath::RdmaPeerMem`] are direct; [`TransferPath::StagedThroughHost`],
//! [`TransferPath::CuFileCompat`], [`TransferPath::Posix`], [`TransferPath::RdmaHostMemory`] are
//! fallbacks; [`TransferPath::Unknown`] where nothing observable tells — and for fallbacks a
//! [`Cause`] whose `Display` names the fix ("pool memory lacks peer access", "cuFile can't
//! register files: udev data missing", "no peer-memory client"). How each room knows:
//!
//! - P2P: from the memory's kind and the access actually granted — `cuMemPoolGetAccess` for
//!   stream-ordered pool memory (what cudarc allocates), `cuMemGetAccess` for VMM memory, and the
//!   process-wide record [`p2p::PeerAccess`] keeps for `cuMemAlloc` memory.
//! - Storage: decided per file at open from cuFile's driver properties (nvidia-fs, P2PDMA), the
//!   filesystem and the registration outcome; cuFile's own statistics refine it per GPU.
//! - RDMA: the registration that succeeded (dma-buf or peer memory), and why the others failed.
//!
//! [`FallbackPolicy`] decides what a fallback does: `Allow`, `Warn` (default: a warning naming
//! the path, the cause and its fix, once per kind of cause per process; a `tracing` event when a
//! subscriber listens, else a line on stderr) or `Deny` ([`Error::FallbackRefused`] before any
//! byte moves).
//!
//! # Which allocation type for what
//!
//! Four kinds of device memory; they differ in what the driver lets other devices, NICs and
//! processes do with it. All four reach the storage room and cudarc's kernels and copies as
//! cudarc views (`as_view()`, `as_view_mut()`).
//!
//! - **cudarc's [`CudaSlice`](cudarc::driver::CudaSlice)** (`stream.alloc_zeros`,
//!   `clone_htod`: the device's stream-ordered pool, `cuMemAllocAsync`): the default for
//!   storage reads and writes, checkpoint loads and P2P copies, which go direct once a
//!   [`p2p::PeerAccess`] opened the pool to the peer (context peer access alone leaves pool
//!   copies staged through host memory). Not for GPUDirect RDMA: the driver reports pool memory
//!   as not GPUDirect-RDMA capable, and [`rdma::GpuMemoryRegion`] refuses it
//!   ([`Cause::PoolMemoryNotGdrCapable`]) unless forced. cudarc's pool cannot be shared with
//!   another process; a [`p2p::ipc::SharedPool`] can.
//! - **[`cuda::DeviceBuffer`]** (also `p2p::DeviceBuffer`; plain `cuMemAlloc`, zeroed): legacy
//!   CUDA IPC, since [`p2p::ipc::IpcMemHandle`] exports only `cuMemAlloc` memory; P2P needs only
//!   context peer access ([`p2p::PeerAccess`] grants it and records it, which is how a copy
//!   knows its path).
//! - **[`cuda::GdrBuffer`]** (also `rdma::GdrBuffer`; `cuMemAlloc` starting on a 64 KiB GPU page,
//!   size rounded up to one, `SYNC_MEMOPS` set): GPUDirect RDMA, registered with
//!   [`rdma::GpuMemoryRegion`] by dma-buf or a peer-memory client. The alignment keeps a
//!   peer-memory client (which pins whole GPU pages) and the dma-buf export off memory that is
//!   not the buffer's; `SYNC_MEMOPS` makes synchronous copies complete before a NIC reads.
//! - **[`p2p::VmmBuffer`]** (virtual memory management: `cuMemCreate` + `cuMemMap`, created
//!   exportable as a POSIX file descriptor): memory another process maps
//!   ([`VmmBuffer::export_fd`](p2p::VmmBuffer::export_fd), sent with [`p2p::ipc::send_fd`],
//!   mapped with [`p2p::ipc::VmmImport`]), and peer access per buffer
//!   ([`VmmBuffer::grant_access`](p2p::VmmBuffer::grant_access)) that the driver reports back.
//!   It is not a [`cuda::DeviceMemory`], so it cannot be registered for RDMA.
//!
//! # Configuration
//!
//! Every setting has an API (options structs, [`FallbackPolicy::set_global`]) and most have a
//! `GPUDIRECT_*` environment variable. The environment is read once per process; a value that
//! does not parse is [`Error::InvalidEnvironment`] naming the variable and the accepted values.
//! Every variable, its values and its default: the README's table, [Environment
//! variables](https://github.com/gpudirect-rs/gpudirect#environment-variables).
//!
//! # Library dependencies
//!
//! Nothing native is needed to build or to document: bindings are committed. At run time these
//! are opened lazily, and a missing one is [`Error::LibraryUnavailable`] naming every path tried,
//! never a panic:
//!
//! | library | for | found through |
//! |---|---|---|
//! | `libcuda.so.1` | everything on a GPU | cudarc's search (the NVIDIA driver installs it) |
//! | `libnvidia-ml.so.1` | P2P topology (link types, NVLink counts) | the loader path; optional |
//! | `libcufile.so.0` | cuFile | `GPUDIRECT_CUFILE_LIB`, else the loader path (CUDA toolkit or `pip install nvidia-cufile`) |
//! | `libibverbs.so.1`, `librdmacm.so.1` | RDMA | the loader path (rdma-core) |
//!
//! gpudirect checks for libcuda and a device before its first cudarc call (cudarc itself
//! panics when libcuda is missing), and never opens cuFile's driver without a GPU. CUDA version
//! and linking: the program's own cudarc features win. gpudirect's defaults let cudarc choose the
//! bindings (the program's `cuda-*` feature, `CUDARC_CUDA_VERSION`, nvcc, else its newest), and
//! it asks for `fallback-dynamic-loading`, which yields to `dynamic-linking` / `static-linking`;
//! `default-features = false, features = ["cuda-13000", "safetensors"]` pins a version (README:
//! "Already using cudarc?").
//!
//! # Thread safety
//!
//! Handles are `Send + Sync` where the C library documents thread safety (cuFile: "all APIs are
//! thread-safe"; verbs: objects may be used from any thread, a QP's posting is serialised by
//! gpudirect). Process-wide state — the cuFile driver, the peer-access registry, the loaders —
//! lives in `OnceLock`s and mutexes. cuFile must not be used across `fork()`. Non-blocking
//! storage transfers ([`storage::Transfer`]) run on transfer threads started on demand (they
//! exit when idle); a `Transfer` is `Send + Sync` when its buffer is `Send`.
//!
//! The calling thread's current CUDA context: the cuFile layer ([`storage::cufile`]) and the P2P
//! copy, peer-access, allocation and IPC calls ([`p2p`]) put back the context that was current
//! when they were called (cudarc itself binds a context and leaves it bound). The storage
//! engine's calls, the bandwidth measurements and the RDMA layer may leave the buffer's
//! context current. Code that mixes raw driver calls should set its context after those.
//!
//! # Resource cleanup
//!
//! Every registration is an RAII value: [`p2p::PeerAccess`] revokes what it granted when the
//! last holder drops, after the work queued in the accessor's context has run; cuFile handles and buffers deregister on drop; memory regions deregister
//! and close their dma-buf fd, and keep the GPU allocation alive until then. Anything the device
//! may still touch after a call returns (stream-ordered and batch cuFile IO, posted work
//! requests) is either an `unsafe fn` with a precise `# Safety` section or a guard that owns the
//! buffers and synchronises in `Drop`; a non-blocking storage transfer owns its buffer until it
//! is done, so dropping or forgetting its handle never frees the buffer under the IO. Device
//! memory gpudirect frees or unmaps itself ([`cuda::DeviceBuffer`], [`p2p::VmmBuffer`], the
//! [`p2p::ipc`] mappings) goes only after all the work queued in its context has run (cudarc
//! remembers only a slice's last read), so do not drop one while another stream of that context
//! waits for the dropping thread. Memory exported to another process must outlive the
//! importer's mapping: the legacy and pool exports are `unsafe fn`s that say so. `Drop`
//! never panics: failures are logged with `tracing`.
//! The cuFile driver is never closed (closing it at exit crashes in the wild).
//!
//! CUDA contexts: gpudirect keeps each device's primary context retained once it used it. A
//! context of your own (cudarc's `CudaContext::new_non_primary`) is not kept by the fence pages,
//! event pools and side streams of the non-blocking transfers: it is destroyed once you drop
//! its object and its transfers are over (a 4 KiB page of fence words stays allocated per such
//! context); the storage engine's segment ring and worker lanes, which larger device transfers
//! use, still keep it. gpudirect's transfer threads leave no such context current between
//! transfers. Its last reference may be the one a transfer thread holds for the top-up after a
//! transfer: the context is then destroyed there, and a thread of yours that still has it
//! current should bind another before its next CUDA call (cudarc's calls do).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub mod cuda;
pub mod diag;
mod env;
mod error;
pub mod ffi;
pub mod p2p;
mod path;
pub mod rdma;
#[cfg(feature = "safetensors")]
pub mod safetensors;
pub mod storage;

pub use cudarc;
pub use env::ParseValueError;
pub use error::{Error, Result};
/// The old name of [`TransferPath`] (deprecated).
#[allow(deprecated)]
pub use path::Path;
pub use path::{Cause, FallbackPolicy, Link, PathReport, TransferPath};

/// The README's code blocks, compiled as doctests so the front page cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

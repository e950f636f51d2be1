//! The checkpoint room: [safetensors](https://huggingface.co/docs/safetensors) files, sharded
//! checkpoints and model directories, loaded onto and saved from the GPU at the storage
//! wing's speed, with one report per job.
//!
//! ```no_run
//! # fn main() -> gpudirect::Result<()> {
//! use gpudirect::safetensors::{self, bf16};
//! let stream = gpudirect::cuda::context(0)?.default_stream();
//! let ckpt = safetensors::load("Qwen3-0.6B/", &stream)?; // a file, a directory or shards
//! let embed = ckpt.get::<bf16>("model.embed_tokens.weight")?; // CudaView<bf16>, no copy
//! println!("{}", ckpt.report()); // bytes, GB/s, the path per GPU and any fallback's cause
//! # let _ = embed;
//! # Ok(()) }
//! ```
//!
//! - [`load`] gives a [`Checkpoint`]: one device allocation, each tensor a typed view of it
//!   ([`Checkpoint::get`], [`Checkpoint::tensor`] with name, [`Dtype`] and shape). The file→GPU
//!   transfer is the only copy.
//! - [`load_owned`] gives an [`OwnedCheckpoint`]: a `CudaSlice<T>` per tensor, to keep and
//!   drop one by one, each read straight into its own allocation (no staging memory, no
//!   device-to-device copy).
//! - [`LoadOptions`] adds a tensor filter (exact names and `*`/`?` globs; excluded bytes are
//!   never read), storage settings, a fallback policy and a progress callback.
//! - [`load_replicated`] and [`load_placed`] load onto several GPUs ([`MultiCheckpoint`]: a
//!   [`Checkpoint`] per GPU and one report): every tensor everywhere, or as a [`Placement`]
//!   maps tensors or byte ranges of tensors (tensor parallelism) to GPUs. Each byte is read
//!   from storage once, into a GPU that wants it, and reaches the others by peer copies over
//!   NVLink; the report gives the path per GPU, and a staged copy names its cause. No staging
//!   memory; [`LoadOptions::plan_placed`] shows the plan without a GPU.
//! - [`save`] writes many GPU tensors into one file: atomic replace, one fsync when durable,
//!   `__metadata__` supported.
//! - [`inspect`] reads only the headers (no GPU).
//!
//! # What is checked
//! Headers are validated before any byte moves (our checks name the tensor and the reason,
//! then the `safetensors` crate's validation runs too, so we accept what it accepts, except a
//! name given twice in one header, which the crate resolves by keeping the last and we refuse):
//! truncated files, header lengths past the file or over the format's 100 MB limit, non-UTF-8
//! or invalid JSON, unknown dtypes, `shape × dtype ≠ bytes`, offsets out of range, overlapping
//! or leaving gaps, trailing bytes, duplicate names in a header or across shards, an index
//! naming a missing shard or disagreeing with it, a filter pattern matching nothing, not enough
//! device memory, a shard replaced or rewritten between reading its header and opening it for
//! its tensors.
//! Each is an [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file, the tensor when
//! one is to blame, and the [`Problem`].
//!
//! # How it reads
//! All shards are planned in one job: each selected tensor gets a device offset aligned for
//! its dtype; tensors adjacent in a file become one read, so a whole file written by torch or
//! the `safetensors` crate is one read; only a filter's gaps or a misaligned tensor split
//! reads. Every read of the load, across all shards, goes to the storage wing as one
//! [`storage::ReadBatch`](crate::storage::ReadBatch) (so shards overlap and the engine sees the
//! whole plan; cuFile where it moves bytes by DMA, else the parallel POSIX engine with O_DIRECT
//! when the file is not cached), and the [`LoadReport`] folds the batch's path shares per
//! device. With a progress callback the batch is cut into pieces of about 512 MiB.
//!
//! # Element types
//! [`Element`] maps dtypes to Rust types: `BF16` [`bf16`], `F16` [`f16`](struct@f16), `F32`, `F64`,
//! `I8`..`I64`, `U8`..`U64`, `F8_E4M3` [`F8E4M3`], `F8_E5M2` [`F8E5M2`]; `BOOL` is read as
//! `u8` (a file byte other than 0 or 1 would make `bool` unsound). The other dtypes (`C64`,
//! `F8_E8M0`, the FNUZ and sub-byte MX types) load and save as bytes.

mod dtype;
mod fanout;
mod fanout_plan;
mod filter;
mod header;
mod load;
mod placement;
mod plan;
mod pool;
mod save;
mod source;
#[cfg(test)]
pub(crate) mod testkit;

pub use crate::error::checkpoint::Problem;
pub use dtype::{Dtype, Element, F8E4M3, F8E5M2};
pub use fanout::{load_placed, load_replicated, DevicePlan, FanOutPlan, MultiCheckpoint};
pub use filter::Filter;
pub use half::{bf16, f16};
pub use header::{Header, TensorInfo, MAX_HEADER_LEN};
pub use load::{
    Checkpoint, DevicePath, FileInfo, Hop, LoadOptions, LoadPlan, LoadReport, Owned,
    OwnedCheckpoint, OwnedTensor, Progress, TensorData, TensorRef,
};
pub use placement::Placement;
pub use save::{save, SaveOptions, SaveReport, SaveTensor};
pub use source::{Index, Source, INDEX_FILE, SINGLE_FILE};

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::error::Result;

/// Loads a checkpoint (a `.safetensors` file, a model directory, an index file, or a list of
/// shards) into one device allocation on `stream`: see [`Checkpoint`].
///
/// Errors: [`Error::Checkpoint`](crate::Error::Checkpoint) for anything wrong with the files
/// (before any byte moves), [`Error::Io`](crate::Error::Io), storage and CUDA errors,
/// [`Error::FallbackRefused`](crate::Error::FallbackRefused),
/// [`Error::Unsupported`](crate::Error::Unsupported) for a stream that is capturing a CUDA graph
/// (before any file is opened; so for every load and save of this module).
pub fn load(src: impl Into<Source>, stream: &Arc<CudaStream>) -> Result<Checkpoint> {
    LoadOptions::new().load(src, stream)
}

/// Loads a checkpoint into one `CudaSlice<T>` per tensor on `stream`: see [`OwnedCheckpoint`].
pub fn load_owned(src: impl Into<Source>, stream: &Arc<CudaStream>) -> Result<OwnedCheckpoint> {
    LoadOptions::new().load_owned(src, stream)
}

/// A checkpoint's headers, without touching a GPU: per shard its path and [`Header`].
pub fn inspect(src: impl Into<Source>) -> Result<Vec<(std::path::PathBuf, Header)>> {
    let r = source::resolve(&src.into())?;
    Ok(source::read_shards(&r)?
        .into_iter()
        .map(|s| (s.path, s.header))
        .collect())
}

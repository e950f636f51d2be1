//! gpudirect: safe Rust for NVIDIA GPUDirect (P2P, RDMA, Storage) on top of cudarc.
//!
//! Every transfer reports the [`Path`] its bytes took and, when that path is not direct,
//! the [`Cause`] that chose it. A [`FallbackPolicy`] turns any fallback into an error.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub mod cuda;
pub mod diag;
mod error;
pub mod ffi;
pub mod p2p;
mod path;
pub mod rdma;
pub mod storage;

pub use cudarc;
pub use error::{Error, Result};
pub use path::{Cause, FallbackPolicy, Link, Path, PathReport};

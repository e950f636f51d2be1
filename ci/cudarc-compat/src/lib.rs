//! Compile-only: a program's own cudarc types go into gpudirect and come back out, so both
//! crates must resolve to the one cudarc with one set of bindings.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

/// A file into GPU memory on the caller's stream, returned as the caller's cudarc type.
pub fn load(
    path: &std::path::Path,
    stream: &Arc<CudaStream>,
) -> Result<CudaSlice<u8>, Box<dyn std::error::Error + Send + Sync>> {
    let (buf, report) = gpudirect::storage::read_to_gpu(path, stream)?;
    eprintln!("{} bytes via {}", buf.len(), report.path);
    Ok(buf)
}

/// gpudirect's checked door to a device, handing back cudarc's context.
pub fn context(ordinal: usize) -> gpudirect::Result<Arc<CudaContext>> {
    gpudirect::cuda::context(ordinal)
}

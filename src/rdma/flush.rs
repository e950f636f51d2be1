//! Making inbound GPUDirect RDMA writes visible to CUDA work: `cuFlushGPUDirectRDMAWrites`,
//! called only when the GPU's native write ordering is weaker than the consumer needs.
//!
//! `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` says how far a NIC's writes into this
//! GPU's memory are ordered natively: not at all (NONE), for the owning device's own work
//! (OWNER, H200 reports this), or for every device (ALL_DEVICES). A flush to a scope at or
//! inside the native ordering is a no-op, so [`RdmaWriteFlush::flush`] skips it.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use serde::Serialize;

use crate::cuda;
use crate::error::{Error, Result};
use crate::path::Cause;

/// The GPU's native ordering of inbound RDMA writes
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`), kept as the driver's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WritesOrdering(pub i32);

impl WritesOrdering {
    /// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE`: a flush is needed before any consumer.
    pub const NONE: WritesOrdering = WritesOrdering(0);
    /// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER`: the owning GPU sees the writes in order.
    pub const OWNER: WritesOrdering = WritesOrdering(100);
    /// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_ALL_DEVICES`: every GPU sees them in order.
    pub const ALL_DEVICES: WritesOrdering = WritesOrdering(200);

    /// True when a consumer in `scope` needs a flush (the native ordering does not cover it).
    pub fn needs_flush_for(self, scope: FlushScope) -> bool {
        self.0 < scope.value()
    }
}

impl fmt::Display for WritesOrdering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WritesOrdering::NONE => f.write_str("NONE"),
            WritesOrdering::OWNER => f.write_str("OWNER"),
            WritesOrdering::ALL_DEVICES => f.write_str("ALL_DEVICES"),
            WritesOrdering(v) => write!(f, "unknown ({v})"),
        }
    }
}

/// Which flushes the GPU supports (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`,
/// a bit mask kept as the driver's number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FlushOptions(pub i32);

impl FlushOptions {
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST`: `cuFlushGPUDirectRDMAWrites` works.
    pub const HOST: i32 = 1;
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS`: stream memory operations can flush.
    pub const MEMOPS: i32 = 2;

    /// True when `cuFlushGPUDirectRDMAWrites` is supported.
    pub fn host(self) -> bool {
        self.0 & Self::HOST != 0
    }

    /// True when the stream-memop flush is supported.
    pub fn memops(self) -> bool {
        self.0 & Self::MEMOPS != 0
    }
}

impl fmt::Display for FlushOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.host(), self.memops()) {
            (false, false) => f.write_str("none"),
            (true, false) => f.write_str("HOST"),
            (false, true) => f.write_str("MEMOPS"),
            (true, true) => f.write_str("HOST|MEMOPS"),
        }
    }
}

/// Who will consume the RDMA-written data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FlushScope {
    /// Work on the GPU that owns the memory (`CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER`).
    Owner,
    /// Work on any GPU (`CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES`).
    AllDevices,
}

impl FlushScope {
    fn value(self) -> i32 {
        match self {
            FlushScope::Owner => 100,
            FlushScope::AllDevices => 200,
        }
    }

    fn raw(self) -> sys::CUflushGPUDirectRDMAWritesScope {
        match self {
            FlushScope::Owner => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
            }
            FlushScope::AllDevices => {
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES
            }
        }
    }
}

/// What [`RdmaWriteFlush::flush`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FlushOutcome {
    /// The native ordering already covers the scope: nothing to do.
    NotNeeded,
    /// `cuFlushGPUDirectRDMAWrites` was called and returned.
    Flushed,
}

/// Flushes inbound GPUDirect RDMA writes for one GPU when, and only when, its ordering needs it.
///
/// Call [`RdmaWriteFlush::flush`] after learning that a NIC's writes have landed (a receive
/// completion for a write-with-immediate, or a trailing send) and before launching the CUDA
/// work that reads them.
#[derive(Debug, Clone)]
pub struct RdmaWriteFlush {
    ctx: Arc<CudaContext>,
    ordering: WritesOrdering,
    options: FlushOptions,
}

impl RdmaWriteFlush {
    /// Reads the GPU's ordering and flush options for `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let ordinal = ctx.ordinal();
        let ordering = cuda::device_attribute(
            ordinal,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
        )?;
        let options = cuda::device_attribute(
            ordinal,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
        )?;
        Ok(RdmaWriteFlush {
            ctx: ctx.clone(),
            ordering: WritesOrdering(ordering),
            options: FlushOptions(options),
        })
    }

    /// The GPU's native ordering.
    pub fn ordering(&self) -> WritesOrdering {
        self.ordering
    }

    /// The GPU's flush options.
    pub fn options(&self) -> FlushOptions {
        self.options
    }

    /// True when consumers in `scope` need a flush on this GPU.
    pub fn needed(&self, scope: FlushScope) -> bool {
        self.ordering.needs_flush_for(scope)
    }

    /// Makes inbound RDMA writes visible to consumers in `scope`
    /// (`cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, scope)`),
    /// skipped when the native ordering covers the scope.
    ///
    /// Errors: [`Error::Unsupported`] when a flush is needed but the GPU does not offer the
    /// host-side flush; [`Error::Cuda`] when the call fails.
    pub fn flush(&self, scope: FlushScope) -> Result<FlushOutcome> {
        if !self.needed(scope) {
            return Ok(FlushOutcome::NotNeeded);
        }
        if !self.options.host() {
            return Err(Error::Unsupported {
                what: "cuFlushGPUDirectRDMAWrites".into(),
                cause: Cause::Other {
                    message: format!(
                        "GPU {} needs a flush (writes ordering {}) but offers flush options {}",
                        self.ctx.ordinal(),
                        self.ordering,
                        self.options
                    ),
                    fix: "make the consumer wait for a completion on the GPU's own ordering (e.g. a stream memop flush) or use host memory".into(),
                },
            });
        }
        crate::cuda::bind(&self.ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: a context is current (bound above).
        unsafe { cuda::result::rdma::flush_gpudirect_rdma_writes(scope.raw()) }?;
        Ok(FlushOutcome::Flushed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_needed_only_outside_the_native_ordering() {
        assert!(WritesOrdering::NONE.needs_flush_for(FlushScope::Owner));
        assert!(WritesOrdering::NONE.needs_flush_for(FlushScope::AllDevices));
        assert!(!WritesOrdering::OWNER.needs_flush_for(FlushScope::Owner));
        assert!(WritesOrdering::OWNER.needs_flush_for(FlushScope::AllDevices));
        assert!(!WritesOrdering::ALL_DEVICES.needs_flush_for(FlushScope::AllDevices));
        assert_eq!(WritesOrdering(100).to_string(), "OWNER");
        assert_eq!(WritesOrdering(7).to_string(), "unknown (7)");
        assert_eq!(FlushOptions(1).to_string(), "HOST");
        assert!(FlushOptions(3).memops() && FlushOptions(3).host());
        assert_eq!(FlushOptions(0).to_string(), "none");
    }
}

//! What the driver says about a device address: one [`PointerInfo`] for every room (P2P copies
//! decide their path from it, RDMA registration whether the memory is GPUDirect-RDMA capable).
//!
//! One out-type rule for `cuPointerGetAttribute`: every attribute is read into a zeroed 8-byte
//! slot and then narrowed to the width cuda.h documents for it (`int`/`unsigned int`/`bool`,
//! `size_t`, `CUdeviceptr`, a handle). No attribute writes more than 8 bytes, so a slot can
//! never overflow, and on the little-endian targets CUDA supports (x86-64, aarch64) a 1-, 4- or
//! 8-byte value reads back unchanged.

use cudarc::driver::{sys, CudaContext};
use serde::Serialize;

use super::result;
use crate::error::{Error, Result};
use crate::path::Cause;

/// How a device buffer was allocated, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// A stream-ordered memory pool (`cuMemAllocAsync`, cudarc's default allocator).
    Pool,
    /// `cuMemAlloc` (legacy device memory).
    Legacy,
    /// Virtual memory management (`cuMemCreate` + `cuMemMap`).
    Vmm,
    /// Mapped from another process through IPC (set by [`crate::p2p`], which made the mapping).
    Imported,
    /// The driver did not say.
    Unknown,
}

/// What the driver says about one device address (`cuPointerGetAttribute`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PointerInfo {
    /// The address asked about.
    pub ptr: u64,
    /// The device whose memory this is: for VMM memory the device of its physical allocation,
    /// otherwise `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (0 when the driver names no device).
    pub device: usize,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` as the driver reports it.
    pub ordinal: i32,
    /// How the memory was allocated.
    pub kind: MemoryKind,
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` is `CU_MEMORYTYPE_DEVICE`.
    pub is_device: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`: managed memory is host memory on x86 (registering it
    /// measures the host path).
    pub is_managed: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` (1 for `cuMemAlloc`, 0 for default-pool
    /// `cuMemAllocAsync` memory: [CONTRIBUTING.md, "CUDA pointer
    /// facts"](https://github.com/gpudirect-rs/gpudirect/blob/main/CONTRIBUTING.md#cuda-pointer-facts)).
    pub gdr_capable: bool,
    /// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` is non-null: stream-ordered pool memory.
    pub from_pool: bool,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: start of the enclosing allocation.
    pub range_start: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: size of the enclosing allocation.
    pub range_size: u64,
    /// The pool handle (`CUmemoryPool`), as an address; 0 for non-pool memory.
    #[serde(skip)]
    pool: usize,
    /// The owning context (`CUcontext`), as an address; 0 when unknown.
    #[serde(skip)]
    ctx: usize,
}

/// One `cuPointerGetAttribute` by the module's out-type rule.
fn attr(
    ptr: sys::CUdeviceptr,
    a: sys::CUpointer_attribute,
) -> std::result::Result<u64, sys::CUresult> {
    // SAFETY: every attribute this module reads writes at most 8 bytes (the module docs); the
    // zeroed u64 has room for each and its low bytes hold the value on little-endian targets.
    // The driver only reads `ptr`'s value and validates it.
    unsafe { result::pointer::get_attribute(ptr, a, 0u64) }
}

fn strict(ptr: sys::CUdeviceptr, a: sys::CUpointer_attribute) -> Result<u64> {
    attr(ptr, a).map_err(|rc| Error::cuda("cuPointerGetAttribute", cudarc::driver::DriverError(rc)))
}

/// The facts the two queries share, each as the driver answered it.
struct Raw {
    memory_type: std::result::Result<u64, sys::CUresult>,
    ordinal: std::result::Result<u64, sys::CUresult>,
    pool: u64,
    ctx: u64,
    vmm: Option<i32>,
}

fn raw(ptr: sys::CUdeviceptr) -> Raw {
    use sys::CUpointer_attribute as A;
    Raw {
        memory_type: attr(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE),
        ordinal: attr(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL),
        // Non-pool memory may answer with an error rather than NULL: both mean "not a pool".
        pool: attr(ptr, A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE).unwrap_or(0),
        ctx: attr(ptr, A::CU_POINTER_ATTRIBUTE_CONTEXT).unwrap_or(0),
        // VMM memory (made here or imported from another process with a POSIX fd) names its
        // physical device in its allocation properties, also where DEVICE_ORDINAL says nothing.
        // SAFETY: `ptr` is a device address of this process; the call only retains/releases.
        vmm: unsafe { result::vmm::location(ptr) },
    }
}

impl Raw {
    fn is_device(&self) -> bool {
        self.memory_type
            .is_ok_and(|v| v as u32 == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32)
    }

    fn kind(&self, ptr: sys::CUdeviceptr) -> MemoryKind {
        if self.pool != 0 {
            MemoryKind::Pool
        } else if self.vmm.is_some() {
            MemoryKind::Vmm
        } else if attr(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        )
        .is_ok_and(|v| v as u32 != 0)
            || self.is_device()
        {
            // Device memory that is neither pool nor VMM memory: cuMemAlloc.
            MemoryKind::Legacy
        } else {
            MemoryKind::Unknown
        }
    }

    /// The device the memory lives on: the VMM allocation's, else DEVICE_ORDINAL.
    fn device(&self) -> Option<usize> {
        match self.vmm {
            Some(d) if d >= 0 => Some(d as usize),
            _ => self
                .ordinal
                .ok()
                .map(|v| v as u32 as i32)
                .filter(|&o| o >= 0)
                .map(|o| o as usize),
        }
    }
}

impl PointerInfo {
    /// Asks the driver about `ptr`: which device, how it was allocated, whether it is
    /// GPUDirect-RDMA capable, its enclosing allocation.
    ///
    /// Errors: the CUDA absence errors of [`driver_version`](super::driver_version);
    /// [`Error::Cuda`] naming `cuPointerGetAttribute` when the driver does not know the address
    /// (e.g. plain host memory).
    pub fn query(ptr: sys::CUdeviceptr) -> Result<PointerInfo> {
        use sys::CUpointer_attribute as A;
        super::driver_version()?;
        let r = raw(ptr);
        let memory_type = r
            .memory_type
            .map_err(|rc| Error::cuda("cuPointerGetAttribute", cudarc::driver::DriverError(rc)))?;
        let ordinal = r
            .ordinal
            .map_err(|rc| Error::cuda("cuPointerGetAttribute", cudarc::driver::DriverError(rc)))?
            as u32 as i32;
        let is_managed = strict(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED)? as u32 != 0;
        let gdr_capable =
            strict(ptr, A::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE)? as u32 != 0;
        let range_start = strict(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)?;
        let range_size = strict(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_SIZE)?;
        Ok(PointerInfo {
            ptr,
            device: r.device().unwrap_or(ordinal.max(0) as usize),
            ordinal,
            kind: r.kind(ptr),
            is_device: memory_type as u32 == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
            is_managed,
            gdr_capable,
            from_pool: r.pool != 0,
            range_start,
            range_size,
            pool: r.pool as usize,
            ctx: r.ctx as usize,
        })
    }

    /// Like [`query`](Self::query), but never fails: what the driver does not say comes from
    /// `ctx` (the buffer's cudarc context: its device, itself as owner) or defaults to
    /// false/0. For code that holds a live cudarc buffer at `ptr` (so libcuda is loaded).
    pub(crate) fn inspect(ptr: sys::CUdeviceptr, ctx: &CudaContext) -> PointerInfo {
        use sys::CUpointer_attribute as A;
        let r = raw(ptr);
        let flag = |a| attr(ptr, a).is_ok_and(|v| v as u32 != 0);
        PointerInfo {
            ptr,
            device: r.device().unwrap_or(ctx.ordinal()),
            ordinal: r.ordinal.map(|v| v as u32 as i32).unwrap_or(-1),
            kind: r.kind(ptr),
            is_device: r.is_device(),
            is_managed: flag(A::CU_POINTER_ATTRIBUTE_IS_MANAGED),
            gdr_capable: flag(A::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE),
            from_pool: r.pool != 0,
            range_start: attr(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR).unwrap_or(0),
            range_size: attr(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_SIZE).unwrap_or(0),
            pool: r.pool as usize,
            ctx: if r.ctx != 0 {
                r.ctx as usize
            } else {
                ctx.cu_ctx() as usize
            },
        }
    }

    /// The memory pool the allocation comes from (null for non-pool memory).
    pub(crate) fn pool(&self) -> sys::CUmemoryPool {
        self.pool as sys::CUmemoryPool
    }

    /// The context that owns the allocation (null when unknown).
    pub(crate) fn ctx(&self) -> sys::CUcontext {
        self.ctx as sys::CUcontext
    }

    /// Why this memory must not be registered for GPUDirect RDMA, or `None` when it may.
    pub fn gdr_refusal(&self) -> Option<Cause> {
        if !self.is_device || self.is_managed {
            Some(Cause::NotDeviceMemory {
                managed: self.is_managed,
            })
        } else if self.from_pool || !self.gdr_capable {
            Some(Cause::PoolMemoryNotGdrCapable)
        } else {
            None
        }
    }

    /// A device-memory record with the given facts, for tests of code that decides on them.
    #[cfg(test)]
    pub(crate) fn for_test(
        is_device: bool,
        is_managed: bool,
        gdr_capable: bool,
        from_pool: bool,
    ) -> Self {
        PointerInfo {
            ptr: 0,
            device: 0,
            ordinal: 0,
            kind: if from_pool {
                MemoryKind::Pool
            } else {
                MemoryKind::Legacy
            },
            is_device,
            is_managed,
            gdr_capable,
            from_pool,
            range_start: 0,
            range_size: 0,
            pool: 0,
            ctx: 0,
        }
    }
}

/// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation holding `ptr`
/// (`cuPointerSetAttribute`): synchronous copies and memsets complete before they return, so a
/// NIC reading right after sees the bytes. Idempotent.
pub fn set_sync_memops(ptr: sys::CUdeviceptr) -> Result<()> {
    super::driver_version()?;
    // SAFETY: libcuda is initialised (checked above); the driver validates `ptr`.
    unsafe { result::pointer::set_sync_memops(ptr) }
}

/// [`PointerInfo::query`]: which device `ptr` is on, whether it is GPUDirect-RDMA capable,
/// whether it comes from a stream-ordered pool (`cuPointerGetAttribute`).
pub fn pointer_info(ptr: sys::CUdeviceptr) -> Result<PointerInfo> {
    PointerInfo::query(ptr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_and_managed_memory_are_refused_with_their_cause() {
        let ok = PointerInfo::for_test(true, false, true, false);
        assert_eq!(ok.gdr_refusal(), None);
        let pool = PointerInfo::for_test(true, false, false, true);
        assert_eq!(pool.gdr_refusal(), Some(Cause::PoolMemoryNotGdrCapable));
        let not_capable = PointerInfo::for_test(true, false, false, false);
        assert_eq!(
            not_capable.gdr_refusal(),
            Some(Cause::PoolMemoryNotGdrCapable)
        );
        let managed = PointerInfo::for_test(true, true, true, false);
        assert_eq!(
            managed.gdr_refusal(),
            Some(Cause::NotDeviceMemory { managed: true })
        );
        let host = PointerInfo::for_test(false, false, false, false);
        assert_eq!(
            host.gdr_refusal(),
            Some(Cause::NotDeviceMemory { managed: false })
        );
    }
}

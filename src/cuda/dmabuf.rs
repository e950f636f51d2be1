//! dma-buf export of device memory (`cuMemGetHandleForAddressRange`): the half of dma-buf
//! GPUDirect RDMA registration that needs no NIC, so a GPU-only machine can prove it.

use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;
use serde::Serialize;

use super::DeviceMemory;
use crate::error::{Error, Result};
use crate::path::Cause;

/// The host page size, which `cuMemGetHandleForAddressRange` requires the exported range to be
/// aligned to (`sysconf(_SC_PAGESIZE)`, 4 KiB on x86-64).
pub fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Where a registration's bytes sit inside the exported dma-buf.
///
/// `cuMemGetHandleForAddressRange` wants a host-page-aligned range, so the export covers the
/// enclosing aligned range and `ibv_reg_dmabuf_mr` gets the offset inside it, with the CUDA
/// address as iova (remote peers then use CUDA addresses as `remote_addr`, as NCCL and
/// perftest do). iova and offset share their page offset, as `ibv_reg_dmabuf_mr(3)` requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DmaBufPlan {
    /// First byte of the exported range (aligned down to the page).
    pub export_start: u64,
    /// Length of the exported range (a multiple of the page).
    pub export_len: u64,
    /// Offset of the registration inside the dma-buf (`ibv_reg_dmabuf_mr`'s `offset`).
    pub offset: u64,
    /// Bytes registered.
    pub len: u64,
    /// The registration's iova: the CUDA address of its first byte.
    pub iova: u64,
}

impl DmaBufPlan {
    /// Plans the export of `len` bytes at device address `addr` with `page`-aligned bounds.
    ///
    /// Errors: [`Error::InvalidArgument`] for `len == 0`, a `page` that is not a power of two,
    /// or a range that wraps the address space.
    pub fn new(addr: u64, len: u64, page: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot export or register an empty range".into(),
            ));
        }
        if !page.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "page size {page} is not a power of two"
            )));
        }
        let end = addr.checked_add(len).ok_or_else(|| {
            Error::InvalidArgument(format!("range {addr:#x}+{len} wraps the address space"))
        })?;
        let start = addr & !(page - 1);
        let end_aligned = end
            .checked_add(page - 1)
            .map(|e| e & !(page - 1))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("range {addr:#x}+{len} wraps the address space"))
            })?;
        Ok(DmaBufPlan {
            export_start: start,
            export_len: end_aligned - start,
            offset: addr - start,
            len,
            iova: addr,
        })
    }
}

/// An exported dma-buf: the fd (closed on drop) and where the requested range sits in it.
#[derive(Debug)]
pub struct DmaBufExport {
    /// The dma-buf file descriptor from `cuMemGetHandleForAddressRange`.
    pub fd: OwnedFd,
    /// The aligned range and the offset inside it.
    pub plan: DmaBufPlan,
}

/// Exports `range` (bytes, relative to the memory's start) of `mem` as a dma-buf fd
/// (`cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` on the enclosing
/// host-page-aligned range), after setting `SYNC_MEMOPS`. Needs no NIC: this is the half of
/// dma-buf registration a GPU-only machine can prove.
///
/// The device must report `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 1` (NVIDIA's open kernel
/// module); otherwise [`Error::Unsupported`] with [`Cause::DmaBufUnsupported`].
pub fn export_dmabuf<M: DeviceMemory + ?Sized>(
    mem: &M,
    range: Range<usize>,
) -> Result<DmaBufExport> {
    check_range(mem, &range)?;
    let ctx = mem.context();
    let ordinal = ctx.ordinal();
    let supported = super::device_attribute(
        ordinal,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
    )?;
    if supported != 1 {
        return Err(Error::Unsupported {
            what: format!("dma-buf export of GPU {ordinal} memory"),
            cause: Cause::DmaBufUnsupported {
                detail: format!(
                    "GPU {ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED={supported} (the proprietary kernel module has no dma-buf export)"
                ),
            },
        });
    }
    crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
    let addr = mem.device_ptr() + range.start as u64;
    let plan = DmaBufPlan::new(addr, range.len() as u64, host_page_size() as u64)?;
    super::set_sync_memops(addr)?;
    // SAFETY: the range lies in memory `mem` owns (checked above), aligned to the host page as
    // the call requires; the context is current (bound above).
    let (rc, fd) =
        unsafe { super::result::mem::get_dmabuf_fd(plan.export_start, plan.export_len as usize) };
    match rc {
        sys::CUresult::CUDA_SUCCESS if fd >= 0 => Ok(DmaBufExport {
            // SAFETY: the driver returned a new fd that nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            plan,
        }),
        sys::CUresult::CUDA_SUCCESS => Err(Error::Cuda {
            op: "cuMemGetHandleForAddressRange",
            source: cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN),
        }),
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => Err(Error::Unsupported {
            what: format!("dma-buf export of GPU {ordinal} memory"),
            cause: Cause::DmaBufUnsupported {
                detail:
                    "cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED (driver or platform)"
                        .into(),
            },
        }),
        // The driver refuses some sub-allocations of the default stream-ordered pool with
        // INVALID_VALUE even when page-aligned (CONTRIBUTING.md, "CUDA pointer facts"). Pool
        // memory is not GDR-capable anyway: name that cause.
        sys::CUresult::CUDA_ERROR_INVALID_VALUE
            if super::pointer_info(mem.device_ptr()).is_ok_and(|i| i.from_pool) =>
        {
            Err(Error::Unsupported {
                what: format!(
                    "dma-buf export of {} bytes of stream-ordered pool memory on GPU {ordinal} (cuMemGetHandleForAddressRange: CUDA_ERROR_INVALID_VALUE)",
                    plan.export_len
                ),
                cause: Cause::PoolMemoryNotGdrCapable,
            })
        }
        rc => Err(Error::cuda(
            "cuMemGetHandleForAddressRange",
            cudarc::driver::DriverError(rc),
        )),
    }
}

pub(crate) fn check_range<M: DeviceMemory + ?Sized>(mem: &M, range: &Range<usize>) -> Result<()> {
    if range.start >= range.end || range.end > mem.num_bytes() {
        return Err(Error::InvalidArgument(format!(
            "byte range {}..{} is empty or outside the {}-byte allocation",
            range.start,
            range.end,
            mem.num_bytes()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmabuf_plan_aligned_range_is_exported_as_is() {
        let p = DmaBufPlan::new(0x7f00_0001_0000, 1 << 20, 4096).unwrap();
        assert_eq!(p.export_start, 0x7f00_0001_0000);
        assert_eq!(p.export_len, 1 << 20);
        assert_eq!(p.offset, 0);
        assert_eq!(p.iova, 0x7f00_0001_0000);
    }

    #[test]
    fn dmabuf_plan_unaligned_range_takes_the_enclosing_pages() {
        // 100 bytes in, 4096 long: spans two pages
        let p = DmaBufPlan::new(0x10000 + 100, 4096, 4096).unwrap();
        assert_eq!(p.export_start, 0x10000);
        assert_eq!(p.export_len, 8192);
        assert_eq!(p.offset, 100);
        assert_eq!(p.len, 4096);
        assert_eq!(
            p.iova % 4096,
            p.offset % 4096,
            "iova and offset share the page offset"
        );
        // odd size ending exactly on a boundary
        let p = DmaBufPlan::new(0x20000 + 4095, 1, 4096).unwrap();
        assert_eq!(
            (p.export_start, p.export_len, p.offset),
            (0x20000, 4096, 4095)
        );
        let p = DmaBufPlan::new(0x20000 + 4095, 2, 4096).unwrap();
        assert_eq!(
            (p.export_start, p.export_len, p.offset),
            (0x20000, 8192, 4095)
        );
    }

    #[test]
    fn dmabuf_plan_rejects_empty_wrapping_and_bad_pages() {
        assert!(matches!(
            DmaBufPlan::new(0x1000, 0, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(u64::MAX - 10, 100, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(u64::MAX - 4000, 100, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DmaBufPlan::new(0x1000, 1, 3000),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn host_page_is_a_power_of_two() {
        assert!(host_page_size().is_power_of_two());
    }
}

//! [`GpuMemoryRegion`]: GPU memory registered with a protection domain, so a NIC reads and
//! writes it directly, by dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`) or
//! a peer-memory client (`ibv_reg_mr` on the device pointer).
//!
//! The memory side needs no NIC and lives on the ground floor, [`crate::cuda`]: the allocation
//! ([`GdrBuffer`]), what a pointer is ([`PointerInfo`]) and the dma-buf export
//! ([`export_dmabuf`]); they are re-exported here under their old paths.

use std::fmt;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use cudarc::driver::CudaViewMut;
use serde::Serialize;

use crate::cuda::dmabuf::check_range;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::path::{Cause, PathReport, TransferPath};

use super::mr::{AccessFlags, MemoryRegion, RemoteMemory, Sge};
use super::pd::ProtectionDomain;

/// Device memory that can be registered with an RDMA protection domain: the ground floor's
/// [`DeviceMemory`](crate::cuda::DeviceMemory) trait under its RDMA name (implemented for
/// buffers of [`AnyBitPattern`](crate::cuda::AnyBitPattern) elements only: a peer's bytes land
/// in them).
pub use crate::cuda::DeviceMemory as GpuMemory;
pub use crate::cuda::{
    export_dmabuf, host_page_size, pointer_info, set_sync_memops, DmaBufExport, DmaBufPlan,
    GdrBuffer, PointerInfo, GPU_PAGE_SIZE,
};

// ---------------------------------------------------------------------------------------------
// GpuMemoryRegion
// ---------------------------------------------------------------------------------------------

/// How [`GpuMemoryRegion`] registers GPU memory with the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Strategy {
    /// dma-buf first, then the peer-memory client (as NCCL and UCX order them). The
    /// environment can rule a path out: `GPUDIRECT_DMABUF_ENABLE=0`, `GPUDIRECT_PEERMEM_ENABLE=0`.
    #[default]
    Auto,
    /// Only dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`).
    DmaBuf,
    /// Only the peer-memory client (`ibv_reg_mr` on the device pointer), tried even when no
    /// client is visible in sysfs.
    PeerMem,
}

/// Options for [`GpuMemoryRegion::register_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRegisterOptions {
    /// Which registration path(s) to try.
    pub strategy: Strategy,
    /// Access rights of the region.
    pub access: AccessFlags,
    /// Register memory the driver says is not GPUDirect-RDMA capable (stream-ordered pool
    /// memory, as cudarc allocates) instead of refusing it with
    /// [`Cause::PoolMemoryNotGdrCapable`]. Whether a NIC then reaches it is unverified.
    pub force_non_gdr_memory: bool,
}

impl Default for GpuRegisterOptions {
    fn default() -> Self {
        GpuRegisterOptions {
            strategy: Strategy::Auto,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            force_non_gdr_memory: false,
        }
    }
}

/// GPU memory registered with a protection domain, so a NIC reads and writes it directly.
///
/// Owns the memory `M` (a [`GdrBuffer`], an `Arc` of one, or a cudarc [`CudaSlice`](cudarc::driver::CudaSlice) when
/// forced) and, on the dma-buf path, the exported fd ([`GpuBacking`], the owner of its
/// [`MemoryRegion`]). Teardown: deregister, close the dma-buf, release the memory; if
/// `ibv_dereg_mr` fails, the fd and the memory are leaked rather than released under the NIC.
/// [`GpuMemoryRegion::path`] says which path registered it and [`GpuMemoryRegion::refused`]
/// why the others were not used.
///
/// # Ordering NIC access after GPU work
///
/// A kernel or an async copy (`memcpy_htod`) may still be writing the memory on its stream
/// when a work request is posted. The post-and-wait helpers that let the NIC read the region
/// ([`QueuePair::write`](super::QueuePair::write), `write_with_imm`, `send`, given
/// [`mr`](Self::mr)) first call [`prepare_for_nic`](Self::prepare_for_nic), which waits for
/// those writes. Work requests posted with the `unsafe` posting functions are not ordered:
/// call [`prepare_for_nic`](Self::prepare_for_nic) before posting one that reads the memory,
/// and [`prepare_for_nic_write`](Self::prepare_for_nic_write) before one that writes it (RDMA
/// read, receive) or before handing the rkey to a peer that writes it. The other direction,
/// GPU work after a NIC write, is ordered by waiting for the completion (or the peer's message)
/// and, where the GPU's write ordering needs it, [`RdmaWriteFlush`](super::RdmaWriteFlush).
pub struct GpuMemoryRegion<M: GpuMemory> {
    mr: MemoryRegion<GpuBacking<M>>,
    range: Range<usize>,
    path: TransferPath,
    refused: Vec<(TransferPath, Cause)>,
}

/// What a [`GpuMemoryRegion`]'s registration keeps alive, released (in this order) only after
/// the NIC lost access: the exported dma-buf fd, then the memory.
pub struct GpuBacking<M> {
    dmabuf: Option<DmaBufExport>,
    mem: M,
}

impl<M> fmt::Debug for GpuBacking<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuBacking")
            .field("dmabuf", &self.dmabuf.as_ref().map(|d| d.plan))
            .finish_non_exhaustive()
    }
}

/// The helpers' hook before a NIC read of GPU memory.
fn wait_for_gpu_writes<M: GpuMemory>(b: &GpuBacking<M>) -> Result<()> {
    b.mem.wait_for_writes()
}

impl<M: GpuMemory> fmt::Debug for GpuMemoryRegion<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMemoryRegion")
            .field("mr", &self.mr)
            .field("path", &self.path)
            .field("range", &self.range)
            .field("dmabuf", &self.dmabuf_plan())
            .finish()
    }
}

/// `Some("VAR=value")` when the environment turns a registration path off (`var` false by
/// the one boolean table); an unparsable value is [`Error::InvalidEnvironment`].
fn env_disabled(var: &'static str) -> Result<Option<String>> {
    let env = Env::process();
    Ok(match env.flag(var)? {
        Some(false) => env.raw(var).map(|v| format!("{var}={v}")),
        _ => None,
    })
}

impl<M: GpuMemory> GpuMemoryRegion<M> {
    /// Registers all of `mem` with [`Strategy::Auto`] and local-write, remote-write and
    /// remote-read access.
    pub fn register(pd: &Arc<ProtectionDomain>, mem: M) -> Result<Self> {
        let len = mem.num_bytes();
        Self::register_with(pd, mem, 0..len, GpuRegisterOptions::default())
    }

    /// Registers `range` (bytes from the start of `mem`) of `mem`.
    ///
    /// Errors: [`Error::Unsupported`] when no path works, with [`Cause::PoolMemoryNotGdrCapable`]
    /// (pool memory, not forced), [`Cause::DmaBufUnsupported`] (EOPNOTSUPP: the provider or
    /// kernel lacks dma-buf, as rxe does), [`Cause::NoPeerMemoryClient`] (EFAULT from
    /// `ibv_reg_mr`), [`Cause::Misaligned`] or, when both paths were tried,
    /// [`Cause::GdrPathsRefused`] carrying both causes. A forced strategy returns its own
    /// path's error as is.
    pub fn register_with(
        pd: &Arc<ProtectionDomain>,
        mem: M,
        range: Range<usize>,
        opts: GpuRegisterOptions,
    ) -> Result<Self> {
        check_range(&mem, &range)?;
        let ordinal = mem.context().ordinal();
        let what = format!(
            "GPUDirect RDMA registration of GPU {ordinal} memory on {}",
            pd.context().name()
        );
        crate::cuda::bind(mem.context()).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let addr = mem.device_ptr() + range.start as u64;
        let len = range.len();
        let info = pointer_info(addr)?;
        if let Some(cause) = info.gdr_refusal() {
            if !opts.force_non_gdr_memory {
                return Err(Error::Unsupported { what, cause });
            }
            tracing::warn!(%cause, "registering memory that is not GPUDirect-RDMA capable, as forced");
        }
        let mut refused: Vec<(TransferPath, Cause)> = Vec::new();
        let forced = opts.strategy != Strategy::Auto;
        let (dmabuf_off, peermem_off) = if forced {
            (None, None)
        } else {
            (
                env_disabled("GPUDIRECT_DMABUF_ENABLE")?,
                env_disabled("GPUDIRECT_PEERMEM_ENABLE")?,
            )
        };

        // ---- dma-buf ----
        if opts.strategy == Strategy::PeerMem {
            // not asked for
        } else if let Some(setting) = dmabuf_off {
            refused.push((TransferPath::RdmaDmaBuf, Cause::ForcedByConfig { setting }));
        } else {
            match Self::try_dmabuf(pd, &mem, &range, &info, opts.access) {
                Ok((mr, exp)) => {
                    tracing::info!(
                        addr = format_args!("{addr:#x}"),
                        len,
                        export_start = format_args!("{:#x}", exp.plan.export_start),
                        export_len = exp.plan.export_len,
                        offset = exp.plan.offset,
                        lkey = mr.lkey(),
                        rkey = mr.rkey(),
                        "GDR: registered via dma-buf (SYNC_MEMOPS set)"
                    );
                    return Ok(Self::new(
                        mr,
                        Some(exp),
                        mem,
                        range,
                        TransferPath::RdmaDmaBuf,
                        refused,
                    ));
                }
                Err(e) if forced => return Err(e),
                Err(e) => refused.push((TransferPath::RdmaDmaBuf, cause_of(e))),
            }
        }

        // ---- peer-memory client ----
        if opts.strategy == Strategy::DmaBuf {
            // not asked for
        } else if let Some(setting) = peermem_off {
            refused.push((TransferPath::RdmaPeerMem, Cause::ForcedByConfig { setting }));
        } else if !forced && !super::probe::PeerMemoryClient::detect().present() {
            refused.push((TransferPath::RdmaPeerMem, Cause::NoPeerMemoryClient));
        } else {
            if let Err(e) = set_sync_memops(addr) {
                tracing::warn!(error = %e, "GDR: could not set SYNC_MEMOPS before peermem registration");
            }
            // SAFETY: `addr..addr+len` lies inside `mem` (checked above), which becomes the
            // MR's owner (`GpuMemoryRegion::new`), released only after a successful
            // deregistration; until then `mem` (a parameter) outlives the MR local.
            let r = unsafe { pd.register_raw(addr as *mut std::ffi::c_void, len, opts.access) };
            match r {
                Ok(mr) => {
                    tracing::info!(
                        addr = format_args!("{addr:#x}"),
                        len,
                        lkey = mr.lkey(),
                        rkey = mr.rkey(),
                        "GDR: registered via peermem ibv_reg_mr"
                    );
                    return Ok(Self::new(
                        mr,
                        None,
                        mem,
                        range,
                        TransferPath::RdmaPeerMem,
                        refused,
                    ));
                }
                Err(Error::Verbs { source, .. }) if source.raw_os_error() == Some(libc::EFAULT) => {
                    if forced {
                        return Err(Error::Unsupported {
                            what,
                            cause: Cause::NoPeerMemoryClient,
                        });
                    }
                    refused.push((TransferPath::RdmaPeerMem, Cause::NoPeerMemoryClient));
                }
                Err(e) if forced => return Err(e),
                Err(e) => refused.push((TransferPath::RdmaPeerMem, cause_of(e))),
            }
        }

        let cause = match refused.len() {
            2 => {
                let peermem = refused.pop().map(|r| r.1);
                let dmabuf = refused.pop().map(|r| r.1);
                match (dmabuf, peermem) {
                    (Some(d), Some(p)) => Cause::GdrPathsRefused {
                        dmabuf: Box::new(d),
                        peermem: Box::new(p),
                    },
                    _ => unreachable_cause(),
                }
            }
            _ => refused.pop().map(|r| r.1).unwrap_or_else(unreachable_cause),
        };
        Err(Error::Unsupported { what, cause })
    }

    fn new(
        mr: MemoryRegion<()>,
        dmabuf: Option<DmaBufExport>,
        mem: M,
        range: Range<usize>,
        path: TransferPath,
        refused: Vec<(TransferPath, Cause)>,
    ) -> Self {
        GpuMemoryRegion {
            mr: mr
                .attach_owner(GpuBacking { dmabuf, mem })
                .with_before_nic_read(wait_for_gpu_writes::<M>),
            range,
            path,
            refused,
        }
    }

    fn try_dmabuf(
        pd: &Arc<ProtectionDomain>,
        mem: &M,
        range: &Range<usize>,
        info: &PointerInfo,
        access: AccessFlags,
    ) -> Result<(MemoryRegion<()>, DmaBufExport)> {
        let addr = mem.device_ptr() + range.start as u64;
        let page = host_page_size() as u64;
        let plan = DmaBufPlan::new(addr, range.len() as u64, page)?;
        // The aligned export must stay inside the allocation (pool slices at odd offsets may
        // not): otherwise the dma-buf would cover memory this region does not own.
        let alloc_end = info.range_start.saturating_add(info.range_size);
        if info.range_size > 0
            && (plan.export_start < info.range_start
                || plan.export_start + plan.export_len > alloc_end)
        {
            return Err(Error::Unsupported {
                what: "dma-buf export".into(),
                cause: Cause::Misaligned {
                    required: page as usize,
                },
            });
        }
        let exp = export_dmabuf(mem, range.clone())?;
        debug_assert_eq!(exp.plan, plan);
        // SAFETY: the fd is an open dma-buf of `export_len >= offset + len` bytes; it and the
        // memory behind it become the owner of this MR (`GpuMemoryRegion::new`), released only
        // after a successful deregistration (and leaked otherwise). Until then they are locals
        // of the caller that outlive the MR on every path, unwinding included.
        let mr = unsafe {
            pd.register_dmabuf_raw(
                exp.plan.offset,
                range.len(),
                exp.plan.iova,
                exp.fd.as_raw_fd(),
                access,
            )
        }?;
        Ok((mr, exp))
    }

    /// The path the registration took: [`TransferPath::RdmaDmaBuf`] or
    /// [`TransferPath::RdmaPeerMem`].
    pub fn path(&self) -> TransferPath {
        self.path
    }

    /// The paths tried before the one taken, and why each was refused.
    pub fn refused(&self) -> &[(TransferPath, Cause)] {
        &self.refused
    }

    /// The path taken as a report (always direct).
    pub fn report(&self) -> PathReport {
        PathReport::direct(self.path)
    }

    /// The verbs memory region (keys, address, scatter/gather entries), for the post-and-wait
    /// helpers of [`QueuePair`](super::QueuePair) (which call
    /// [`prepare_for_nic`](Self::prepare_for_nic) before letting the NIC read it).
    pub fn mr(&self) -> &MemoryRegion<GpuBacking<M>> {
        &self.mr
    }

    /// Blocks until the GPU work that cudarc ordered as writing the memory is done (work
    /// queued on its stream, and a write cudarc recorded from another stream), so a NIC that
    /// reads the memory next reads what the GPU wrote (`cuStreamWaitEvent` +
    /// `cuStreamSynchronize`). The post-and-wait helpers call it; call it yourself before an
    /// `unsafe` post that reads the memory. Work that cudarc does not see (raw driver calls,
    /// other libraries) is not covered: synchronize it yourself.
    pub fn prepare_for_nic(&self) -> Result<()> {
        self.memory().wait_for_writes()
    }

    /// Blocks until all GPU work of the memory's context is done (`cuCtxSynchronize`), so a NIC
    /// that writes the memory next (an RDMA read or receive into it, a peer holding the rkey)
    /// races with no kernel or copy that still reads or writes it. Call it before such an
    /// `unsafe` post, or before telling the peer to write.
    pub fn prepare_for_nic_write(&self) -> Result<()> {
        self.memory()
            .context()
            .synchronize()
            .map_err(|e| Error::cuda("cuCtxSynchronize", e))
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The region's address as the NIC sees it: the CUDA address of its first byte (the
    /// dma-buf path registers with iova = CUDA address, the peermem path with the pointer).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// True for an empty region (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// What a peer needs to RDMA-write or -read this region.
    pub fn remote(&self) -> RemoteMemory {
        self.mr.remote()
    }

    /// A scatter/gather entry for bytes `range` of the region (bounds-checked).
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        self.mr.sge(range)
    }

    /// The registered byte range of the memory.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The dma-buf plan, on the dma-buf path.
    pub fn dmabuf_plan(&self) -> Option<DmaBufPlan> {
        self.mr.owner_ref().dmabuf.as_ref().map(|d| d.plan)
    }

    /// The registered memory (read access; cudarc views come from it).
    pub fn memory(&self) -> &M {
        &self.mr.owner_ref().mem
    }

    /// Deregisters (`ibv_dereg_mr`), closes the dma-buf and returns the memory; if
    /// deregistration fails, the region comes back intact with the error (dropping it then
    /// leaks the memory).
    // The (Self, Error) shape is the convention for fallible teardown; it is returned rarely.
    #[allow(clippy::result_large_err)]
    pub fn close(self) -> std::result::Result<M, (Self, Error)> {
        let GpuMemoryRegion {
            mr,
            range,
            path,
            refused,
        } = self;
        match mr.close() {
            Ok(GpuBacking { dmabuf, mem }) => {
                drop(dmabuf);
                Ok(mem)
            }
            Err((mr, e)) => Err((
                GpuMemoryRegion {
                    mr,
                    range,
                    path,
                    refused,
                },
                e,
            )),
        }
    }
}

impl<T: crate::cuda::AnyBitPattern> GpuMemoryRegion<GdrBuffer<T>> {
    /// The registered buffer as a writable cudarc view (for kernels that fill or consume it).
    /// The NIC may write the same bytes whenever a peer holding the rkey does so: order the
    /// two with completions.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.mr.owner_mut().mem.as_view_mut()
    }
}

fn unreachable_cause() -> Cause {
    Cause::Other {
        message: "no registration path was tried".into(),
        fix: "pick Strategy::DmaBuf or Strategy::PeerMem".into(),
    }
}

/// The cause to report for a failed path (keeps typed causes, wraps anything else).
fn cause_of(e: Error) -> Cause {
    match e {
        Error::Unsupported { cause, .. } => cause,
        Error::Verbs { op, source } if source.raw_os_error() == Some(libc::EINVAL) => {
            Cause::RegistrationInvalid { op: op.into() }
        }
        other => Cause::Other {
            message: other.to_string(),
            fix: "see the error above".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_paths_refused_names_both_causes_and_fixes() {
        let c = Cause::GdrPathsRefused {
            dmabuf: Box::new(Cause::DmaBufUnsupported {
                detail: "the rxe0 provider does not implement dma-buf memory regions".into(),
            }),
            peermem: Box::new(Cause::NoPeerMemoryClient),
        };
        let s = c.to_string();
        assert!(s.starts_with("no GPUDirect RDMA registration path: dma-buf refused (dma-buf registration unsupported: the rxe0 provider"), "{s}");
        assert!(s.contains("peermem refused (no peer-memory client)"), "{s}");
        assert!(s.contains("load nvidia_peermem"), "{s}");
        assert!(s.contains("mlx5"), "{s}");
        assert!(!s.ends_with('.'), "{s}");
        // errors from a path keep their typed cause; others are wrapped with their text
        let e = Error::Unsupported {
            what: "x".into(),
            cause: Cause::PoolMemoryNotGdrCapable,
        };
        assert_eq!(cause_of(e), Cause::PoolMemoryNotGdrCapable);
        let e = Error::Verbs {
            op: "ibv_reg_dmabuf_mr",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert_eq!(
            cause_of(e),
            Cause::RegistrationInvalid {
                op: "ibv_reg_dmabuf_mr".into()
            }
        );
        assert_eq!(Strategy::default(), Strategy::Auto);
        let o = GpuRegisterOptions::default();
        assert!(o
            .access
            .contains(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE));
        assert!(!o.force_non_gdr_memory);
    }
}

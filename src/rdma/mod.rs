//! GPUDirect RDMA: verbs, GPU memory regions (dma-buf and peermem), the GDR probe.
//!
//! The verbs layer wraps rdma-core's libibverbs (loaded at run time through
//! [`ibverbs-gdr-sys`](crate::ffi::ibverbs)) in owned types whose parents are held by `Arc`:
//! [`Context`] → [`ProtectionDomain`] → [`MemoryRegion`] / [`QueuePair`] (which also holds its
//! [`CompletionQueue`]s). Connecting two processes: [`Exchange`] (TCP exchange of
//! [`ConnectionRecord`]s) or [`cm`] (librdmacm).
//!
//! ```no_run
//! use gpudirect::rdma::*;
//! let ctx = Context::open_first()?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 256)?;
//! let mut a = QueuePair::new(&pd, &cq, &cq, &QpOptions::default())?;
//! let mut b = QueuePair::new(&pd, &cq, &cq, &QpOptions::default())?;
//! let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
//! let src = pd.register_host(vec![42u8; 4096], access)?;
//! let dst = pd.register_host(vec![0u8; 4096], access)?;
//! let (ra, rb) = (a.local_record(None), b.local_record(Some(dst.remote())));
//! a.connect(&rb)?;
//! b.connect(&ra)?;
//! a.write(&src, 0..4096, rb.remote())?;
//! assert_eq!(dst.to_vec(), src.to_vec()); // volatile copies: a peer may write `dst` any time
//! # Ok::<(), gpudirect::Error>(())
//! ```

pub mod cm;
#[doc(hidden)]
pub mod connect;
mod context;
mod cq;
mod device;
mod mr;
mod pd;
mod qp;
mod result;
mod wc;

pub use connect::Exchange;
pub use context::{
    Context, DeviceAttributes, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttributes, PortState,
};
pub use cq::{CompletionChannel, CompletionQueue};
pub use device::{devices, DeviceInfo, Transport, Verbs};
pub use mr::{AccessFlags, Attached, HostMemory, MemoryRegion, RemoteMemory, Scoped, Sge};
pub use pd::ProtectionDomain;
/// For tests only: the wr_id bit the blocking helpers reserve; not part of the stable API.
#[doc(hidden)]
pub use qp::HELPER_WR_ID_BIT;
pub use qp::{ConnectOptions, ConnectionRecord, QpOptions, QpState, QueuePair};
pub use wc::{WcOpcode, WcStatus, WorkCompletion};

// One scheme: every item is re-exported flat at `rdma::` (the modules stay reachable, hidden,
// under their old paths); `cm` is the one public namespace (librdmacm's vocabulary).
#[doc(hidden)]
pub mod flush;
#[doc(hidden)]
pub mod gpu_mr;
#[doc(hidden)]
pub mod probe;

pub use flush::{FlushOptions, FlushOutcome, FlushScope, RdmaWriteFlush, WritesOrdering};
pub use gpu_mr::{
    export_dmabuf, host_page_size, pointer_info, set_sync_memops, DmaBufExport, DmaBufPlan,
    GdrBuffer, GpuBacking, GpuMemory, GpuMemoryRegion, GpuRegisterOptions, PointerInfo, Strategy,
    GPU_PAGE_SIZE,
};
pub use probe::{
    pci_distance, DriverFlavour, GdrLevel, GdrPair, GdrProbe, GpuGdr, NvidiaDriver, PciDistance,
    PeerMemoryClient, RdmaDeviceInfo, RdmaPort, RdmaStatus, GDR_LEVEL_ENV,
};

//! GPU↔GPU peer-to-peer: topology, peer access, peer copies that report their path, IPC across
//! processes, and nvbandwidth-style bandwidth and latency.
//!
//! # Quick start
//! ```no_run
//! use gpudirect::p2p::{copy_peer, PeerAccess, Topology};
//! println!("{}", Topology::probe()?);
//! let (a, b) = (gpudirect::cuda::context(0)?, gpudirect::cuda::context(1)?);
//! let (sa, sb) = (a.default_stream(), b.default_stream());
//! let src = sa.clone_htod(&vec![7u8; 1 << 20])?; // cudarc errors convert with `?`
//! let mut dst = sb.alloc_zeros::<u8>(1 << 20)?;
//! let _access = PeerAccess::both_ways(&a, &b)?; // context + default-pool access
//! let report = copy_peer(&src, &mut dst, &sb)?;
//! assert!(report.path.is_direct(), "{}", report.path);
//! # Ok::<(), gpudirect::Error>(())
//! ```
//!
//! # Which path did my bytes take
//! cudarc allocates from each device's default stream-ordered pool. Context peer access
//! (`cuCtxEnablePeerAccess`) alone does **not** open a pool to a peer: such copies are staged
//! through host memory, at a fraction of the direct rate ([BENCHMARKS.md, "P2P"](https://github.com/gpudirect-rs/gpudirect/blob/main/BENCHMARKS.md)).
//! [`PeerAccess`] grants
//! both; [`copy_peer`] reports [`TransferPath::PeerDirect`](crate::TransferPath::PeerDirect) or
//! [`TransferPath::StagedThroughHost`](crate::TransferPath::StagedThroughHost) with its
//! [`Cause`](crate::Cause), and [`timed_copy_peer`] checks the claim against the clock.

#[cfg(feature = "bench")]
mod bandwidth;
mod copy;
pub mod ipc;
mod peer_access;
mod topology;

pub use crate::cuda::vmm::VmmBuffer;
/// `cuMemAlloc` memory (legacy IPC, the context-peer-access path): the ground floor's
/// [`cuda::DeviceBuffer`](crate::cuda::DeviceBuffer).
pub use crate::cuda::DeviceBuffer;
/// The nvbandwidth-style harness (feature `bench`, on by default).
#[cfg(feature = "bench")]
pub use bandwidth::{
    measure, BandwidthMatrix, BandwidthOptions, PairBandwidth, PairBench, SmDirection,
};
pub use copy::{
    copy_peer, copy_peer_async, copy_peer_async_with, copy_peer_with, expected_gbps, plan_copy,
    timed_copy_peer, timed_copy_peer_with, CopyOptions, CopyReport, MemoryKind, TimedCopy,
};
/// For tests and diagnostics only: not part of the stable API.
#[doc(hidden)]
pub use peer_access::registry_state;
pub use peer_access::PeerAccess;
pub use topology::{
    nvml_status, parse_pci_bus_id, Connection, GpuInfo, NvmlP2p, NvmlStatus, P2pState, PairInfo,
    Topology,
};

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
//! through host memory (38 GB/s instead of 395 GB/s on 2×H200 NV18). [`PeerAccess`] grants
//! both; [`copy_peer`] reports [`Path::PeerDirect`](crate::Path::PeerDirect) or
//! [`Path::StagedThroughHost`](crate::Path::StagedThroughHost) with its
//! [`Cause`](crate::Cause), and [`timed_copy_peer`] checks the claim against the clock.

/// The accessors every raw-allocation wrapper of this module shares ([`VmmBuffer`] and the IPC
/// mappings): the memory as a cudarc slice, views, and length. The
/// type needs a `slice: CudaSlice<T>` field and cudarc's slice and view types in scope.
macro_rules! slice_accessors {
    () => {
        /// The memory as a cudarc slice (for `clone_dtoh`, `memcpy_dtod`, kernel arguments, ...).
        pub fn slice(&self) -> &CudaSlice<T> {
            &self.slice
        }

        /// An immutable view of the whole buffer.
        pub fn as_view(&self) -> CudaView<'_, T> {
            self.slice.as_view()
        }

        /// A mutable view of the whole buffer (`memcpy_htod`, `copy_peer` destinations, ...);
        /// for memory mapped from another process, writes land in the exporter's memory.
        pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
            self.slice.as_view_mut()
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.slice.len()
        }

        /// True when empty.
        pub fn is_empty(&self) -> bool {
            self.slice.len() == 0
        }
    };
}

#[cfg(feature = "bench")]
mod bandwidth;
mod copy;
pub mod ipc;
mod peer_access;
mod topology;
mod vmm;

use serde::Serialize;

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
pub use vmm::VmmBuffer;

use crate::error::{Error, Result};
use crate::path::PathReport;

/// Options for [`report`].
#[derive(Debug, Clone, Copy)]
pub struct ReportOptions {
    /// Time one copy per pair (with [`timed_copy_peer`]).
    pub measure: bool,
    /// Bytes per measured copy.
    pub measure_bytes: usize,
    /// Do not grant peer access: shows (and measures) the staged path, to prove detection.
    pub withhold_peer_access: bool,
}

impl Default for ReportOptions {
    fn default() -> Self {
        ReportOptions {
            measure: false,
            measure_bytes: 256 << 20,
            withhold_peer_access: false,
        }
    }
}

/// A measured copy in a [`P2pReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MeasuredCopy {
    /// The path reported for the measured copy.
    pub path: PathReport,
    /// GB/s achieved.
    pub gbps: f64,
    /// Expected GB/s from the topology, when known.
    pub expected_gbps: Option<f64>,
    /// True when the path is staged or the rate far below the expectation.
    pub flagged: bool,
}

/// One ordered pair in a [`P2pReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairReport {
    /// Source device.
    pub src: usize,
    /// Destination device.
    pub dst: usize,
    /// The path a copy of cudarc (pool) buffers takes without any [`PeerAccess`] held by the
    /// report (access enabled elsewhere in the process shows as direct).
    pub without_peer_access: Option<PathReport>,
    /// The path with a [`PeerAccess`] held both ways (`None` when withheld or refused).
    pub with_peer_access: Option<PathReport>,
    /// The measured copy, when asked for.
    pub measured: Option<MeasuredCopy>,
    /// What went wrong for this pair, if anything.
    pub error: Option<String>,
}

/// The P2P section of the doctor: topology plus, per pair, which path cudarc buffers take.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct P2pReport {
    /// The topology.
    pub topology: Topology,
    /// Every ordered pair.
    pub pairs: Vec<PairReport>,
    /// Whether peer access was deliberately withheld.
    pub peer_access_withheld: bool,
}

/// Builds the [`P2pReport`]: topology, and for each ordered pair the path of a copy between
/// cudarc-allocated buffers without and with [`PeerAccess`], optionally timing one copy (flagged
/// when staged or far below the topology's expectation).
///
/// Errors: [`Error::LibraryUnavailable`] / [`Error::NoDevice`] without CUDA or a GPU.
pub fn report(opts: &ReportOptions) -> Result<P2pReport> {
    let topology = Topology::probe()?;
    let mut pairs = Vec::new();
    for p in &topology.pairs {
        pairs.push(
            pair_report(p.src, p.dst, opts).unwrap_or_else(|e| PairReport {
                src: p.src,
                dst: p.dst,
                without_peer_access: None,
                with_peer_access: None,
                measured: None,
                error: Some(e.to_string()),
            }),
        );
    }
    Ok(P2pReport {
        topology,
        pairs,
        peer_access_withheld: opts.withhold_peer_access,
    })
}

fn pair_report(src: usize, dst: usize, opts: &ReportOptions) -> Result<PairReport> {
    let drv = |e| Error::cuda("cudarc allocation", e);
    let (a, b) = (crate::cuda::context(src)?, crate::cuda::context(dst)?);
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let n = if opts.measure {
        opts.measure_bytes.max(1)
    } else {
        4096
    };
    let s = sa.alloc_zeros::<u8>(n).map_err(drv)?;
    let mut d = sb.alloc_zeros::<u8>(n).map_err(drv)?;
    let without = plan_copy(&s, &mut d, &sb)?.path;
    let mut out = PairReport {
        src,
        dst,
        without_peer_access: Some(without),
        with_peer_access: None,
        measured: None,
        error: None,
    };
    let access = if opts.withhold_peer_access {
        None
    } else {
        match PeerAccess::both_ways(&a, &b) {
            Ok(pa) => Some(pa),
            Err(e) => {
                out.error = Some(e.to_string());
                None
            }
        }
    };
    if access.is_some() {
        out.with_peer_access = Some(plan_copy(&s, &mut d, &sb)?.path);
    }
    if opts.measure {
        let allow = CopyOptions {
            policy: Some(crate::FallbackPolicy::Allow),
            ..CopyOptions::default()
        };
        let t = timed_copy_peer_with(&s, &mut d, &sb, &allow)?;
        out.measured = Some(MeasuredCopy {
            flagged: t.suspect || !t.report.path.is_direct(),
            path: t.report.path,
            gbps: t.gbps,
            expected_gbps: t.expected_gbps,
        });
    }
    drop(access);
    Ok(out)
}

//! The doctor's P2P section: the topology matrix, and for each ordered pair whether cudarc
//! buffers copy directly without and with a [`PeerAccess`](crate::p2p::PeerAccess), optionally
//! proven by a short measured copy.

use serde::Serialize;

use super::{Report, Section, Status};
use crate::p2p::{plan_copy, timed_copy_peer_with, CopyOptions, PeerAccess, Topology};
use crate::path::PathReport;
use crate::{Cause, Error, Result};

impl Report {
    /// Checks P2P between every ordered pair of GPUs. `measure` times one 256 MiB copy per pair;
    /// `withhold_peer_access` grants no access, so the staged path shows (and is measured).
    pub fn check_p2p(&mut self, measure: bool, withhold_peer_access: bool) {
        let opts = P2pReportOptions {
            measure,
            withhold_peer_access,
            ..P2pReportOptions::default()
        };
        let rep = match p2p_report(&opts) {
            Ok(r) => r,
            Err(e) => {
                self.push_error(Section::P2p, "topology", &e);
                return;
            }
        };
        if rep.topology.devices.len() < 2 {
            self.push(
                Section::P2p,
                "peers",
                Status::Absent,
                "one GPU: no peer to copy to",
                None,
            );
        }
        for pair in &rep.pairs {
            let subject = format!("GPU{} -> GPU{}", pair.src, pair.dst);
            if let Some(err) = &pair.error {
                self.push(
                    Section::P2p,
                    subject.clone(),
                    Status::Failed,
                    err.clone(),
                    None,
                );
            }
            if let Some(w) = &pair.without_peer_access {
                // Without PeerAccess a staged path is expected; it is the users' path only when
                // access is withheld.
                let status = match (w.is_direct(), withhold_peer_access) {
                    (true, _) => Status::Direct,
                    (false, true) => Status::Fallback,
                    (false, false) => Status::Ok,
                };
                self.push(
                    Section::P2p,
                    format!("{subject} cudarc buffers, no PeerAccess"),
                    status,
                    w.to_string(),
                    w.cause
                        .as_ref()
                        .filter(|_| withhold_peer_access)
                        .map(Cause::fix),
                );
            }
            if let Some(with) = &pair.with_peer_access {
                let status = if with.is_direct() {
                    Status::Direct
                } else {
                    Status::Fallback
                };
                self.push(
                    Section::P2p,
                    format!("{subject} cudarc buffers, with PeerAccess"),
                    status,
                    with.to_string(),
                    with.cause.as_ref().map(Cause::fix),
                );
            }
            if let Some(m) = &pair.measured {
                let expected = m
                    .expected_gbps
                    .map(|e| format!(" (expected about {e:.0})"))
                    .unwrap_or_default();
                let status = if m.flagged {
                    Status::Fallback
                } else if m.path.is_direct() {
                    Status::Direct
                } else {
                    Status::Ok
                };
                let verdict = if m.flagged {
                    ": flagged, the bytes went through the host"
                } else {
                    ""
                };
                self.push(
                    Section::P2p,
                    format!("{subject} measured copy"),
                    status,
                    format!("{:.1} GB/s{expected} via {}{verdict}", m.gbps, m.path.path),
                    m.path.cause.as_ref().map(Cause::fix),
                );
            }
        }
        self.p2p = Some(rep);
    }
}

/// Options for [`p2p_report`].
#[derive(Debug, Clone, Copy)]
pub struct P2pReportOptions {
    /// Time one copy per pair (with [`timed_copy_peer`](crate::p2p::timed_copy_peer)).
    pub measure: bool,
    /// Bytes per measured copy.
    pub measure_bytes: usize,
    /// Do not grant peer access: shows (and measures) the staged path, to prove detection.
    pub withhold_peer_access: bool,
}

impl Default for P2pReportOptions {
    fn default() -> Self {
        P2pReportOptions {
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
    /// The path a copy of cudarc (pool) buffers takes without any [`PeerAccess`](crate::p2p::PeerAccess) held by the
    /// report (access enabled elsewhere in the process shows as direct).
    pub without_peer_access: Option<PathReport>,
    /// The path with a [`PeerAccess`](crate::p2p::PeerAccess) held both ways (`None` when withheld or refused).
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

/// Builds the [`P2pReport`] from the public P2P API: topology, and for each ordered pair the path of a copy between
/// cudarc-allocated buffers without and with [`PeerAccess`](crate::p2p::PeerAccess), optionally timing one copy (flagged
/// when staged or far below the topology's expectation).
///
/// Errors: [`Error::LibraryUnavailable`](crate::Error::LibraryUnavailable) / [`Error::NoDevice`](crate::Error::NoDevice) without CUDA or a GPU.
pub fn p2p_report(opts: &P2pReportOptions) -> Result<P2pReport> {
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

fn pair_report(src: usize, dst: usize, opts: &P2pReportOptions) -> Result<PairReport> {
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

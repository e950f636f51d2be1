//! The doctor's P2P section: the topology matrix, and for each ordered pair whether cudarc
//! buffers copy directly without and with a [`PeerAccess`](crate::p2p::PeerAccess), optionally
//! proven by a short measured copy.

use super::{Report, Section, Status};
use crate::p2p::{self, ReportOptions};
use crate::Cause;

impl Report {
    /// Checks P2P between every ordered pair of GPUs. `measure` times one 256 MiB copy per pair;
    /// `withhold_peer_access` grants no access, so the staged path shows (and is measured).
    pub fn check_p2p(&mut self, measure: bool, withhold_peer_access: bool) {
        let opts = ReportOptions {
            measure,
            withhold_peer_access,
            ..ReportOptions::default()
        };
        let rep = match p2p::report(&opts) {
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

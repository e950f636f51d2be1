//! Diagnostics: what the `doctor` example prints, as data.
//!
//! A [`Report`] is a list of [`Finding`]s grouped by [`Section`]. Each finding says what was
//! checked, what was found, whether it means a direct path, a fallback or an absence, and the
//! fix. The doctor prints it as text or JSON; programs can inspect it.

use std::fmt;

use serde::Serialize;

use crate::error::Error;

mod gdr;
mod gds;
mod p2p;

/// The part of GPUDirect a finding belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
pub enum Section {
    /// CUDA driver and devices.
    Cuda,
    /// GPU↔GPU peer-to-peer.
    P2p,
    /// GPUDirect RDMA (NIC↔GPU).
    Gdr,
    /// GPUDirect Storage (file↔GPU).
    Gds,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Section::Cuda => "CUDA",
            Section::P2p => "P2P",
            Section::Gdr => "GDR",
            Section::Gds => "GDS",
        })
    }
}

/// What a finding means for the promise of direct transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Status {
    /// Works, and transfers go direct.
    Direct,
    /// Works, informational (no transfer path involved).
    Ok,
    /// Works, but transfers fall back (staged / POSIX); the finding names the cause.
    Fallback,
    /// The hardware or library is not here.
    Absent,
    /// Something that is here failed.
    Failed,
}

impl Status {
    fn tag(self) -> &'static str {
        match self {
            Status::Direct => "direct",
            Status::Ok => "ok",
            Status::Fallback => "FALLBACK",
            Status::Absent => "absent",
            Status::Failed => "FAILED",
        }
    }
}

/// One checked fact.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// The section.
    pub section: Section,
    /// What was checked, e.g. `"libcufile"`, `"GPU0 -> GPU1 (cudarc pool buffers)"`.
    pub subject: String,
    /// The verdict.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do, for fallbacks, absences and failures.
    pub fix: Option<String>,
}

/// The doctor's report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Every finding, in the order checked.
    pub findings: Vec<Finding>,
    /// The P2P section's data (topology and per-pair paths), when it ran.
    pub p2p: Option<crate::p2p::P2pReport>,
    /// The GDR probe's data, when it ran.
    pub gdr: Option<crate::rdma::probe::GdrProbe>,
}

impl Report {
    /// Records a finding.
    pub fn push(
        &mut self,
        section: Section,
        subject: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
        fix: Option<String>,
    ) {
        self.findings.push(Finding {
            section,
            subject: subject.into(),
            status,
            detail: detail.into(),
            fix,
        });
    }

    /// Records an error as an absence (library/device missing) or a failure.
    pub fn push_error(&mut self, section: Section, subject: impl Into<String>, err: &Error) {
        let status = if err.is_absence() {
            Status::Absent
        } else {
            Status::Failed
        };
        self.push(section, subject, status, err.to_string(), None);
    }

    /// Findings whose transfers would fall back.
    pub fn fallbacks(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.status == Status::Fallback)
    }

    /// True when any finding is a fallback (what `--require-direct` checks).
    pub fn has_fallback(&self) -> bool {
        self.fallbacks().next().is_some()
    }

    /// True when any finding failed.
    pub fn has_failure(&self) -> bool {
        self.findings.iter().any(|f| f.status == Status::Failed)
    }

    /// Checks the CUDA driver and lists the devices (never panics without a driver).
    pub fn check_cuda(&mut self) -> Option<usize> {
        match crate::cuda::driver_version() {
            Ok(v) => self.push(
                Section::Cuda,
                "CUDA driver",
                Status::Ok,
                format!("driver API {}.{}", v / 1000, v % 1000 / 10),
                None,
            ),
            Err(e) => {
                self.push_error(Section::Cuda, "CUDA driver", &e);
                return None;
            }
        }
        match crate::cuda::device_count() {
            Ok(n) => {
                for i in 0..n {
                    let name = crate::cuda::context(i)
                        .and_then(|c| c.name().map_err(|e| Error::cuda("cuDeviceGetName", e)))
                        .unwrap_or_else(|e| format!("(name unavailable: {e})"));
                    self.push(Section::Cuda, format!("GPU{i}"), Status::Ok, name, None);
                }
                Some(n)
            }
            Err(e) => {
                self.push_error(Section::Cuda, "CUDA devices", &e);
                None
            }
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut current = None;
        for finding in &self.findings {
            if current != Some(finding.section) {
                writeln!(f, "\n== {} ==", finding.section)?;
                current = Some(finding.section);
                if finding.section == Section::P2p {
                    if let Some(p2p) = &self.p2p {
                        for line in p2p.topology.to_string().lines() {
                            writeln!(f, "  {line}")?;
                        }
                    }
                }
            }
            writeln!(
                f,
                "  [{:>8}] {}: {}",
                finding.status.tag(),
                finding.subject,
                finding.detail
            )?;
            if let Some(fix) = &finding.fix {
                writeln!(f, "             fix: {fix}")?;
            }
        }
        writeln!(f, "\n== Summary ==")?;
        let mut any = false;
        for finding in self
            .findings
            .iter()
            .filter(|f| matches!(f.status, Status::Fallback | Status::Failed))
        {
            any = true;
            write!(
                f,
                "  {} {}: {}",
                finding.section, finding.subject, finding.detail
            )?;
            match &finding.fix {
                Some(fix) => writeln!(f, " -> {fix}")?,
                None => writeln!(f)?,
            }
        }
        let no_gpu = self
            .findings
            .iter()
            .any(|f| f.section == Section::Cuda && f.status == Status::Absent);
        if no_gpu {
            writeln!(f, "  no usable CUDA GPU or driver here: GPUDirect cannot be used on this machine (see CUDA above)")?;
        } else if !any {
            writeln!(f, "  no fallback found among the paths checked")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lists_fallbacks_with_fixes_and_flags_them() {
        let mut r = Report::default();
        r.push(Section::Gds, "libcufile", Status::Ok, "version 1.15", None);
        assert!(!r.has_fallback());
        r.push(
            Section::P2p,
            "GPU0 -> GPU1",
            Status::Fallback,
            "staged through host memory",
            Some("hold a PeerAccess".into()),
        );
        assert!(r.has_fallback());
        assert!(!r.has_failure());
        let text = r.to_string();
        let summary = text.split("== Summary ==").nth(1).unwrap();
        assert!(
            summary.contains("P2P GPU0 -> GPU1: staged through host memory -> hold a PeerAccess"),
            "{text}"
        );
        assert!(!summary.contains("libcufile"), "{text}");
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"status\":\"Fallback\""), "{json}");
    }

    #[test]
    fn absence_of_a_library_is_absent_not_failed() {
        let mut r = Report::default();
        let err = Error::LibraryUnavailable {
            name: "libcufile.so.0",
            tried: vec!["libcufile.so.0".into()],
            hint: "x".into(),
        };
        r.push_error(Section::Gds, "libcufile", &err);
        assert_eq!(r.findings[0].status, Status::Absent);
        r.push_error(Section::Gds, "read", &Error::InvalidArgument("bad".into()));
        assert_eq!(r.findings[1].status, Status::Failed);
        assert!(r.has_failure());
    }
}

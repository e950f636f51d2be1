//! Diagnostics: what the `doctor` example prints, as data.
//!
//! A [`Report`] is a list of [`Finding`]s grouped by [`Section`]. Each finding says what was
//! checked, what was found, whether it means a direct path, a fallback or an absence, and the
//! fix. The doctor prints it as text or JSON; programs can inspect it.
//!
//! # JSON
//!
//! `Report`'s `Serialize` (what `doctor --json` prints) is an object with `schema_version`
//! ([`SCHEMA_VERSION`]), `gpudirect_version` (the crate version), `findings` (each finding once:
//! `section`, `subject`, `status`, `detail`, `fix`), and the sections' data `p2p` and `gdr`
//! (`null` when the section did not run). Every enum is a snake_case string (`"absent"`,
//! `"gds"`), or for enums carrying data an object keyed by the snake_case variant name
//! (`{"udev_data_missing": {"device": "nvme0n1"}}`). The shape is stable within a schema version:
//! a field is only added; removing or renaming one, or changing its meaning, bumps the version.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::error::Error;

mod gdr;
mod gds;
mod p2p;

pub use p2p::{p2p_report, MeasuredCopy, P2pReport, P2pReportOptions, PairReport};

/// The part of GPUDirect a finding belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
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
#[serde(rename_all = "snake_case")]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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

/// The version of the report's JSON shape (see the module docs): bumped when a field is
/// removed or renamed or changes meaning; adding a field keeps it.
pub const SCHEMA_VERSION: u32 = 1;

/// The doctor's report (its JSON shape: see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Every finding, in the order checked.
    pub findings: Vec<Finding>,
    /// The P2P section's data (topology and per-pair paths), when it ran.
    pub p2p: Option<P2pReport>,
    /// The GDR probe's data, when it ran.
    pub gdr: Option<crate::rdma::GdrProbe>,
}

impl Serialize for Report {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json<'a> {
            schema_version: u32,
            gpudirect_version: &'static str,
            findings: &'a [Finding],
            p2p: Option<&'a P2pReport>,
            gdr: Option<&'a crate::rdma::GdrProbe>,
        }
        Json {
            schema_version: SCHEMA_VERSION,
            gpudirect_version: env!("CARGO_PKG_VERSION"),
            findings: &self.findings,
            p2p: self.p2p.as_ref(),
            gdr: self.gdr.as_ref(),
        }
        .serialize(serializer)
    }
}

impl Report {
    /// Records a finding; one equal to a finding already recorded is dropped (a report states
    /// each fact once).
    pub fn push(
        &mut self,
        section: Section,
        subject: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
        fix: Option<String>,
    ) {
        let finding = Finding {
            section,
            subject: subject.into(),
            status,
            detail: detail.into(),
            fix,
        };
        if !self.findings.contains(&finding) {
            self.findings.push(finding);
        }
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
        assert!(json.contains("\"status\":\"fallback\""), "{json}");
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

    /// Every object key of a JSON value (field names and the names of data-carrying enum
    /// variants), recursively.
    fn keys(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    out.push(k.clone());
                    keys(v, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| keys(v, out)),
            _ => {}
        }
    }

    fn snake(s: &str) -> bool {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    }

    /// The doctor's report on this machine (no GPU here; CI runs it with and without libcufile).
    fn live_report() -> Report {
        let mut r = Report::default();
        let gpus = r.check_cuda();
        r.check_gdr();
        r.check_gds(std::path::Path::new("."), gpus.map(|_| 0), true);
        r
    }

    #[test]
    fn json_has_its_schema_version_and_snake_case_enums() {
        let r = live_report();
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["schema_version"], SCHEMA_VERSION);
        assert_eq!(v["gpudirect_version"], env!("CARGO_PKG_VERSION"));
        assert!(
            v["findings"].as_array().is_some_and(|f| !f.is_empty()),
            "{v}"
        );
        for f in v["findings"].as_array().unwrap() {
            let status = f["status"].as_str().unwrap();
            assert!(
                ["direct", "ok", "fallback", "absent", "failed"].contains(&status),
                "{f}"
            );
            let section = f["section"].as_str().unwrap();
            assert!(["cuda", "p2p", "gdr", "gds"].contains(&section), "{f}");
        }
        // The GDR probe's prose conclusions are findings once, not a second list.
        assert!(v["gdr"].get("findings").is_none(), "{}", v["gdr"]);
        // Enums with data: keyed by the snake_case variant; unit variants: snake_case strings.
        let samples = serde_json::json!({
            "cufile": crate::PathReport::fallback(
                crate::TransferPath::CuFileCompat,
                crate::Cause::GdrPathsRefused {
                    dmabuf: Box::new(crate::Cause::DmaBufUnsupported { detail: "x".into() }),
                    peermem: Box::new(crate::Cause::NoPeerMemoryClient),
                },
            ),
            "peer": crate::PathReport::direct(crate::TransferPath::PeerDirect {
                link: crate::Link::NvLink { links: 18 },
            }),
            "host": crate::Cause::HostMemory,
            "policy": crate::FallbackPolicy::Deny,
            "rdma": crate::rdma::RdmaStatus::NoDevices,
        });
        assert_eq!(samples["cufile"]["path"], "cufile_compat");
        assert_eq!(
            samples["cufile"]["cause"]["gdr_paths_refused"]["peermem"],
            "no_peer_memory_client"
        );
        assert_eq!(
            samples["peer"]["path"]["peer_direct"]["link"]["nvlink"]["links"],
            18
        );
        assert_eq!(samples["host"], "host_memory");
        assert_eq!(samples["policy"], "deny");
        assert_eq!(samples["rdma"], "no_devices");
        let mut all = Vec::new();
        keys(&v, &mut all);
        keys(&samples, &mut all);
        let bad: Vec<&String> = all.iter().filter(|k| !snake(k)).collect();
        assert!(bad.is_empty(), "keys not in snake_case: {bad:?}");
    }

    #[test]
    fn text_states_each_fact_once_and_no_absence_as_ok() {
        let r = live_report();
        let text = r.to_string();
        for (i, a) in r.findings.iter().enumerate() {
            for b in &r.findings[i + 1..] {
                assert!(a != b, "finding twice: {a:?}");
                // An absence or failure restated inside another finding (the old
                // "[ok] note: no GPU side: <the CUDA absence>").
                for (x, y) in [(a, b), (b, a)] {
                    if matches!(x.status, Status::Absent | Status::Failed) && x.detail.len() > 40 {
                        assert!(!y.detail.contains(&x.detail), "{y:?} restates {x:?}");
                    }
                }
            }
            assert_ne!(a.subject, "note", "{a:?}");
        }
        // Each "tried" list of a missing library is printed once.
        for f in &r.findings {
            if let Some(start) = f.detail.find("(tried ") {
                let tried = &f.detail[start..];
                assert_eq!(text.matches(tried).count(), 1, "{tried} in\n{text}");
            }
        }
        // Nothing here registers GPU memory, so no registration outcome may be stated.
        assert!(!text.contains("fails with EFAULT"), "{text}");
    }

    #[test]
    fn a_finding_is_recorded_once() {
        let mut r = Report::default();
        for _ in 0..3 {
            r.push(Section::Gdr, "RDMA devices", Status::Absent, "none", None);
        }
        r.push(
            Section::Gdr,
            "RDMA devices",
            Status::Absent,
            "none",
            Some("fix".into()),
        );
        assert_eq!(r.findings.len(), 2);
    }
}

//! The verbs work-completion status the core's [`Error::WorkCompletion`](super::Error) carries:
//! a boundary value, decoded here so the error type needs no room (the RDMA wing re-exports it
//! as `rdma::WcStatus`).

use std::fmt;

use ibverbs_gdr_sys as sys;

/// A work-completion status (`enum ibv_wc_status`), kept as its number so a status this crate
/// does not know (a newer rdma-core) still prints and compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WcStatus(pub u32);

/// Every status of rdma-core 44: (value, C name, what it means and what to do).
const STATUSES: &[(u32, &str, &str)] = &[
    (sys::IBV_WC_SUCCESS, "IBV_WC_SUCCESS", "success"),
    (sys::IBV_WC_LOC_LEN_ERR, "IBV_WC_LOC_LEN_ERR", "local length error: the message exceeds the posted receive buffer or the port's maximum message size"),
    (sys::IBV_WC_LOC_QP_OP_ERR, "IBV_WC_LOC_QP_OP_ERR", "local QP operation error: the work request is inconsistent with the QP (check opcode, SGE count, inline size; Soft-RoCE also reports a bad lkey this way)"),
    (sys::IBV_WC_LOC_EEC_OP_ERR, "IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error (RD transport)"),
    (sys::IBV_WC_LOC_PROT_ERR, "IBV_WC_LOC_PROT_ERR", "local protection error: an SGE is outside its memory region or the lkey/PD does not match"),
    (sys::IBV_WC_WR_FLUSH_ERR, "IBV_WC_WR_FLUSH_ERR", "work request flushed: the QP is in the error state (look for the first failed completion)"),
    (sys::IBV_WC_MW_BIND_ERR, "IBV_WC_MW_BIND_ERR", "memory window bind error"),
    (sys::IBV_WC_BAD_RESP_ERR, "IBV_WC_BAD_RESP_ERR", "bad response: the responder returned an unexpected transport opcode"),
    (sys::IBV_WC_LOC_ACCESS_ERR, "IBV_WC_LOC_ACCESS_ERR", "local access error: the local memory region lacks LOCAL_WRITE for an incoming read response or receive"),
    (sys::IBV_WC_REM_INV_REQ_ERR, "IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the responder rejected the request (message too long, or the remote QP lacks the access flag)"),
    (sys::IBV_WC_REM_ACCESS_ERR, "IBV_WC_REM_ACCESS_ERR", "remote access error: the rkey, address range or access flags of the remote memory region do not allow this operation"),
    (sys::IBV_WC_REM_OP_ERR, "IBV_WC_REM_OP_ERR", "remote operation error: the responder could not complete the operation (e.g. its receive buffer is too small)"),
    (sys::IBV_WC_RETRY_EXC_ERR, "IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded: the remote QP does not answer (wrong GID/LID, remote down, or RoCE traffic dropped)"),
    (sys::IBV_WC_RNR_RETRY_EXC_ERR, "IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retry counter exceeded: the remote side posted no receive in time"),
    (sys::IBV_WC_LOC_RDD_VIOL_ERR, "IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation (RD transport)"),
    (sys::IBV_WC_REM_INV_RD_REQ_ERR, "IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request (RD transport)"),
    (sys::IBV_WC_REM_ABORT_ERR, "IBV_WC_REM_ABORT_ERR", "remote aborted the operation"),
    (sys::IBV_WC_INV_EECN_ERR, "IBV_WC_INV_EECN_ERR", "invalid EE context number (RD transport)"),
    (sys::IBV_WC_INV_EEC_STATE_ERR, "IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state (RD transport)"),
    (sys::IBV_WC_FATAL_ERR, "IBV_WC_FATAL_ERR", "fatal error: the device hit an unrecoverable error (check dmesg)"),
    (sys::IBV_WC_RESP_TIMEOUT_ERR, "IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
    (sys::IBV_WC_GENERAL_ERR, "IBV_WC_GENERAL_ERR", "general error (provider specific; see vendor_err)"),
    (sys::IBV_WC_TM_ERR, "IBV_WC_TM_ERR", "tag matching error"),
    (sys::IBV_WC_TM_RNDV_INCOMPLETE, "IBV_WC_TM_RNDV_INCOMPLETE", "tag matching rendezvous incomplete"),
];

impl WcStatus {
    /// `IBV_WC_SUCCESS`.
    pub const SUCCESS: WcStatus = WcStatus(sys::IBV_WC_SUCCESS);
    /// `IBV_WC_LOC_QP_OP_ERR`.
    pub const LOC_QP_OP_ERR: WcStatus = WcStatus(sys::IBV_WC_LOC_QP_OP_ERR);
    /// `IBV_WC_LOC_PROT_ERR`.
    pub const LOC_PROT_ERR: WcStatus = WcStatus(sys::IBV_WC_LOC_PROT_ERR);
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub const WR_FLUSH_ERR: WcStatus = WcStatus(sys::IBV_WC_WR_FLUSH_ERR);
    /// `IBV_WC_REM_INV_REQ_ERR`.
    pub const REM_INV_REQ_ERR: WcStatus = WcStatus(sys::IBV_WC_REM_INV_REQ_ERR);
    /// `IBV_WC_REM_ACCESS_ERR`.
    pub const REM_ACCESS_ERR: WcStatus = WcStatus(sys::IBV_WC_REM_ACCESS_ERR);
    /// `IBV_WC_REM_OP_ERR`.
    pub const REM_OP_ERR: WcStatus = WcStatus(sys::IBV_WC_REM_OP_ERR);
    /// `IBV_WC_RETRY_EXC_ERR`.
    pub const RETRY_EXC_ERR: WcStatus = WcStatus(sys::IBV_WC_RETRY_EXC_ERR);
    /// `IBV_WC_RNR_RETRY_EXC_ERR`.
    pub const RNR_RETRY_EXC_ERR: WcStatus = WcStatus(sys::IBV_WC_RNR_RETRY_EXC_ERR);

    /// Every status rdma-core 44 defines.
    pub fn all() -> impl Iterator<Item = WcStatus> {
        STATUSES.iter().map(|s| WcStatus(s.0))
    }

    fn entry(self) -> Option<&'static (u32, &'static str, &'static str)> {
        STATUSES.iter().find(|s| s.0 == self.0)
    }

    /// The C name, e.g. `"IBV_WC_REM_ACCESS_ERR"`; `None` for a number this crate does not know.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|e| e.1)
    }

    /// What the status means and what to do, lowercase.
    pub fn message(self) -> &'static str {
        self.entry()
            .map(|e| e.2)
            .unwrap_or("unknown work completion status (newer rdma-core?)")
    }

    /// True for `IBV_WC_SUCCESS`.
    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{} ({n}, {})", self.message(), self.0),
            None => write!(f, "unknown work completion status {}", self.0),
        }
    }
}

impl std::error::Error for WcStatus {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_a_unique_name_and_lowercase_message() {
        let all: Vec<_> = WcStatus::all().collect();
        assert_eq!(all.len(), 24);
        for (i, s) in all.iter().enumerate() {
            assert_eq!(
                s.0 as usize, i,
                "statuses are contiguous from 0 in rdma-core 44"
            );
            let name = s.name().unwrap();
            assert!(name.starts_with("IBV_WC_"), "{name}");
            let m = s.message();
            assert!(m.chars().next().unwrap().is_lowercase(), "{m}");
            assert!(!m.ends_with('.'), "{m}");
            assert!(s.to_string().contains(name));
        }
        let mut names: Vec<_> = all.iter().map(|s| s.name().unwrap()).collect();
        names.dedup();
        assert_eq!(names.len(), 24);
    }

    #[test]
    fn unknown_status_is_kept_as_a_number() {
        let s = WcStatus(99);
        assert_eq!(s.name(), None);
        assert_eq!(s.to_string(), "unknown work completion status 99");
        assert!(!s.is_success());
    }
}

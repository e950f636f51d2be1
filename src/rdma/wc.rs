//! Work completions: [`WcStatus`] and [`WcOpcode`] decoding (numbers kept, never Rust enums
//! over C values) and [`WorkCompletion`], the owned copy of an `ibv_wc`.

use std::fmt;

use ibverbs_gdr_sys as sys;

use crate::error::{Error, Result};

pub use crate::error::WcStatus;

/// A work-completion opcode (`enum ibv_wc_opcode`), kept as its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WcOpcode(pub u32);

impl WcOpcode {
    /// `IBV_WC_SEND`.
    pub const SEND: WcOpcode = WcOpcode(sys::IBV_WC_SEND);
    /// `IBV_WC_RDMA_WRITE`.
    pub const RDMA_WRITE: WcOpcode = WcOpcode(sys::IBV_WC_RDMA_WRITE);
    /// `IBV_WC_RDMA_READ`.
    pub const RDMA_READ: WcOpcode = WcOpcode(sys::IBV_WC_RDMA_READ);
    /// `IBV_WC_RECV`.
    pub const RECV: WcOpcode = WcOpcode(sys::IBV_WC_RECV);
    /// `IBV_WC_RECV_RDMA_WITH_IMM`: a remote RDMA write with immediate landed.
    pub const RECV_RDMA_WITH_IMM: WcOpcode = WcOpcode(sys::IBV_WC_RECV_RDMA_WITH_IMM);

    /// The C name, `None` when unknown.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            sys::IBV_WC_SEND => "IBV_WC_SEND",
            sys::IBV_WC_RDMA_WRITE => "IBV_WC_RDMA_WRITE",
            sys::IBV_WC_RDMA_READ => "IBV_WC_RDMA_READ",
            sys::IBV_WC_COMP_SWAP => "IBV_WC_COMP_SWAP",
            sys::IBV_WC_FETCH_ADD => "IBV_WC_FETCH_ADD",
            sys::IBV_WC_BIND_MW => "IBV_WC_BIND_MW",
            sys::IBV_WC_LOCAL_INV => "IBV_WC_LOCAL_INV",
            sys::IBV_WC_TSO => "IBV_WC_TSO",
            sys::IBV_WC_ATOMIC_WRITE => "IBV_WC_ATOMIC_WRITE",
            sys::IBV_WC_RECV => "IBV_WC_RECV",
            sys::IBV_WC_RECV_RDMA_WITH_IMM => "IBV_WC_RECV_RDMA_WITH_IMM",
            _ => return None,
        })
    }

    /// True for receive-side completions (`opcode & IBV_WC_RECV`, as the header suggests).
    pub fn is_recv(self) -> bool {
        self.0 & sys::IBV_WC_RECV != 0
    }
}

impl fmt::Display for WcOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "opcode {}", self.0),
        }
    }
}

/// One completed work request: an owned copy of `struct ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The id given when posting.
    pub wr_id: u64,
    /// The status.
    pub status: WcStatus,
    /// The operation (valid for successful completions only, per the verbs spec).
    pub opcode: WcOpcode,
    /// Provider-specific error detail.
    pub vendor_err: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// The immediate value of a SEND/RDMA write with immediate, host byte order.
    pub imm_data: Option<u32>,
    /// The local QP number.
    pub qp_num: u32,
}

impl WorkCompletion {
    pub(in crate::rdma) fn from_raw(wc: &sys::ibv_wc) -> Self {
        let imm = if wc.wc_flags & sys::IBV_WC_WITH_IMM != 0 {
            // SAFETY: IBV_WC_WITH_IMM says the union holds imm_data (network byte order).
            Some(u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data }))
        } else {
            None
        };
        WorkCompletion {
            wr_id: wc.wr_id,
            status: WcStatus(wc.status),
            opcode: WcOpcode(wc.opcode),
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            imm_data: imm,
            qp_num: wc.qp_num,
        }
    }

    /// `Ok(self)` for a successful completion, [`Error::WorkCompletion`] otherwise.
    pub fn ok(self) -> Result<Self> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion {
                wr_id: self.wr_id,
                status: self.status,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_access_error_becomes_a_typed_error() {
        // SAFETY: ibv_wc is plain C data; all-zero is valid.
        let mut raw: sys::ibv_wc = unsafe { std::mem::zeroed() };
        raw.wr_id = 7;
        raw.status = sys::IBV_WC_REM_ACCESS_ERR;
        let wc = WorkCompletion::from_raw(&raw);
        let err = wc.ok().unwrap_err();
        assert!(matches!(
            err,
            Error::WorkCompletion {
                wr_id: 7,
                status: WcStatus::REM_ACCESS_ERR
            }
        ));
        let msg = err.to_string();
        assert!(msg.contains("work request 7"), "{msg}");
        assert!(msg.contains("IBV_WC_REM_ACCESS_ERR"), "{msg}");
        assert!(msg.contains("rkey"), "{msg}");
    }

    #[test]
    fn immediate_data_is_decoded_from_network_order() {
        // SAFETY: ibv_wc is plain C data; all-zero is valid.
        let mut raw: sys::ibv_wc = unsafe { std::mem::zeroed() };
        raw.opcode = sys::IBV_WC_RECV_RDMA_WITH_IMM;
        raw.wc_flags = sys::IBV_WC_WITH_IMM;
        raw.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        let wc = WorkCompletion::from_raw(&raw);
        assert_eq!(wc.imm_data, Some(0x1234_5678));
        assert!(wc.opcode.is_recv());
        assert_eq!(wc.opcode.to_string(), "IBV_WC_RECV_RDMA_WITH_IMM");
        assert!(!WcOpcode::RDMA_WRITE.is_recv());
    }
}

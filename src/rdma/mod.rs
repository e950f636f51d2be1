//! GPUDirect RDMA: verbs, GPU memory regions (dma-buf and peermem), the GDR probe.

/// A work-completion status (`enum ibv_wc_status`), kept as a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WcStatus(pub u32);

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "work completion status {}", self.0)
    }
}

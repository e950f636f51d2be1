//! cuFile's statistics (`cuFileSetStatsLevel`, `cuFileStatsStart`, `cuFileGetStatsL1/L3`;
//! cuFile 1.15+): the authoritative answer to "which path did my bytes take".
//!
//! The counters are **process-wide**: they count every cuFile IO of this process, not one
//! handle's. Use [`Stats::path_between`] on snapshots taken around your own IO, and keep other
//! cuFile users of the process in mind.
//!
//! The structs grew in 1.19 (readv/writev counters appended: L1 512 → 624 bytes, L3 5000 →
//! 5112); gpudirect passes an 8 KiB buffer to the library and reads the 1.15 prefix, whose
//! layout has not changed.

use std::sync::Arc;

use cufile_sys as sys;

use super::result::{self, StatsControl};
use super::Driver;
use crate::error::Result;
use crate::path::{Cause, PathReport, TransferPath};

/// Successful and failed operation counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounter {
    /// Successful operations.
    pub ok: u64,
    /// Failed operations.
    pub err: u64,
}

impl From<sys::CUfileOpCounter_t> for OpCounter {
    fn from(c: sys::CUfileOpCounter_t) -> Self {
        OpCounter {
            ok: c.ok,
            err: c.err,
        }
    }
}

/// Level-1 counters (`CUfileStatsLevel1_t`, the fields gpudirect reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsL1 {
    /// `cuFileRead` calls.
    pub read_ops: OpCounter,
    /// `cuFileWrite` calls.
    pub write_ops: OpCounter,
    /// `cuFileHandleRegister` calls.
    pub handle_register_ops: OpCounter,
    /// `cuFileBufRegister` calls.
    pub buf_register_ops: OpCounter,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Batch submissions.
    pub batch_submit_ops: OpCounter,
    /// Batch operations that went through POSIX.
    pub batch_posix_processed_ops: OpCounter,
}

/// Per-GPU counters (`CUfilePerGpuStats_t`, level 3): which path each GPU's IO took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerGpuStats {
    /// The GPU's UUID.
    pub uuid: [u8; 16],
    /// Reads in total.
    pub total_reads: u64,
    /// Reads through PCI P2PDMA.
    pub p2p_reads: u64,
    /// Reads through nvidia-fs.
    pub nvfs_reads: u64,
    /// Reads through POSIX (compatibility mode).
    pub posix_reads: u64,
    /// Unaligned reads.
    pub unaligned_reads: u64,
    /// Writes in total.
    pub total_writes: u64,
    /// Writes through PCI P2PDMA.
    pub p2p_writes: u64,
    /// Writes through nvidia-fs.
    pub nvfs_writes: u64,
    /// Writes through POSIX (compatibility mode).
    pub posix_writes: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
}

impl From<&sys::CUfilePerGpuStats_t> for PerGpuStats {
    fn from(g: &sys::CUfilePerGpuStats_t) -> Self {
        PerGpuStats {
            uuid: g.uuid.map(|c| c as u8),
            total_reads: g.n_total_reads,
            p2p_reads: g.n_p2p_reads,
            nvfs_reads: g.n_nvfs_reads,
            posix_reads: g.n_posix_reads,
            unaligned_reads: g.n_unaligned_reads,
            total_writes: g.n_total_writes,
            p2p_writes: g.n_p2p_writes,
            nvfs_writes: g.n_nvfs_writes,
            posix_writes: g.n_posix_writes,
            read_bytes: g.read_bytes,
            write_bytes: g.writes_bytes,
        }
    }
}

/// One reading of the counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Level-1 counters.
    pub l1: StatsL1,
    /// Per-GPU counters (empty unless the level is 3).
    pub per_gpu: Vec<PerGpuStats>,
}

impl StatsSnapshot {
    fn direct_ops(&self) -> u64 {
        self.per_gpu
            .iter()
            .map(|g| g.p2p_reads + g.nvfs_reads + g.p2p_writes + g.nvfs_writes)
            .sum()
    }

    fn posix_ops(&self) -> u64 {
        self.per_gpu
            .iter()
            .map(|g| g.posix_reads + g.posix_writes)
            .sum()
    }
}

/// cuFile's statistics for this process. Needs cuFile 1.15+ (the symbols are checked; an older
/// library gives [`Error::SymbolUnavailable`](crate::Error::SymbolUnavailable)).
#[derive(Debug, Clone)]
pub struct Stats {
    driver: Arc<Driver>,
}

impl Stats {
    /// Turns statistics on at `level` 1–3 (`cuFileSetStatsLevel` then `cuFileStatsStart`);
    /// level 3 adds the per-GPU counters.
    pub fn start(driver: Arc<Driver>, level: u8) -> Result<Stats> {
        let lib = driver.lib();
        result::set_stats_level(lib, i32::from(level.clamp(1, 3)))?;
        result::stats_control(lib, StatsControl::Start)?;
        if driver.exit_strategy() == super::driver::ExitStrategy::RetainContexts {
            // A process with statistics on segfaults at exit unless the driver is closed
            // first (see ExitStrategy::RetainContexts).
            super::driver::register_close_at_exit();
        }
        Ok(Stats { driver })
    }

    /// The current level (`cuFileGetStatsLevel`).
    pub fn level(&self) -> Result<i32> {
        result::get_stats_level(self.driver.lib())
    }

    /// Zeroes the counters (`cuFileStatsReset`).
    pub fn reset(&self) -> Result<()> {
        result::stats_control(self.driver.lib(), StatsControl::Reset)
    }

    /// Stops collecting (`cuFileStatsStop`).
    pub fn stop(self) -> Result<()> {
        result::stats_control(self.driver.lib(), StatsControl::Stop)
    }

    /// Reads the counters (`cuFileGetStatsL1`, and `cuFileGetStatsL3` when the level is 3).
    pub fn snapshot(&self) -> Result<StatsSnapshot> {
        let lib = self.driver.lib();
        let level = result::get_stats_level(lib).unwrap_or(1);
        let buf = result::get_stats(lib, if level >= 3 { 3 } else { 1 })?;
        // SAFETY: the buffer is 8 KiB and 8-aligned; the library filled (at least) the 1.15
        // prefix of the struct of the requested level, whose layout is CUfileStatsLevel1_t at
        // offset 0 for every level (L2 and L3 embed it first); all fields are integers.
        let l1: sys::CUfileStatsLevel1_t = unsafe { std::ptr::read(buf.0.as_ptr().cast()) };
        let mut snap = StatsSnapshot {
            l1: StatsL1 {
                read_ops: l1.read_ops.into(),
                write_ops: l1.write_ops.into(),
                handle_register_ops: l1.hdl_register_ops.into(),
                buf_register_ops: l1.buf_register_ops.into(),
                read_bytes: l1.read_bytes,
                write_bytes: l1.write_bytes,
                batch_submit_ops: l1.batch_submit_ops.into(),
                batch_posix_processed_ops: l1.batch_posix_processed_ops.into(),
            },
            per_gpu: Vec::new(),
        };
        if level >= 3 && self.driver.version() < 1190 {
            // SAFETY: as above, for the 1.15 CUfileStatsLevel3_t (5000 bytes < 8 KiB). From 1.19
            // the L1 part grew, shifting the per-GPU array; gpudirect reads it only for the
            // layout it was generated from.
            let l3: sys::CUfileStatsLevel3_t = unsafe { std::ptr::read(buf.0.as_ptr().cast()) };
            let n = (l3.num_gpus as usize).min(l3.per_gpu_stats.len());
            snap.per_gpu = l3.per_gpu_stats[..n]
                .iter()
                .map(PerGpuStats::from)
                .collect();
        }
        Ok(snap)
    }

    /// The path IO took between two snapshots, from the per-GPU counters: [`TransferPath::Gds`]
    /// when only nvidia-fs/P2PDMA counters grew, [`TransferPath::CuFileCompat`] when only POSIX
    /// ones did, `None` when nothing (or both) changed. Process-wide: other cuFile IO in the window is
    /// counted too.
    pub fn path_between(before: &StatsSnapshot, after: &StatsSnapshot) -> Option<PathReport> {
        let direct = after.direct_ops().saturating_sub(before.direct_ops());
        let posix = after.posix_ops().saturating_sub(before.posix_ops());
        match (direct > 0, posix > 0) {
            (true, false) => Some(PathReport::direct(TransferPath::Gds)),
            (false, true) => Some(PathReport::fallback(
                TransferPath::CuFileCompat,
                Cause::Other {
                    message: "cuFile's per-GPU counters show POSIX (compatibility-mode) IO".into(),
                    fix: "load nvidia-fs or enable PCI P2PDMA, on a GDS-capable filesystem".into(),
                },
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(direct: u64, posix: u64) -> StatsSnapshot {
        StatsSnapshot {
            l1: StatsL1::default(),
            per_gpu: vec![PerGpuStats {
                nvfs_reads: direct,
                posix_reads: posix,
                ..Default::default()
            }],
        }
    }

    #[test]
    fn path_from_counters() {
        assert_eq!(
            Stats::path_between(&snap(0, 0), &snap(3, 0)).map(|r| r.path),
            Some(TransferPath::Gds)
        );
        assert_eq!(
            Stats::path_between(&snap(1, 1), &snap(1, 5)).map(|r| r.path),
            Some(TransferPath::CuFileCompat)
        );
        assert_eq!(Stats::path_between(&snap(1, 1), &snap(1, 1)), None);
        assert_eq!(Stats::path_between(&snap(0, 0), &snap(1, 1)), None);
    }
}

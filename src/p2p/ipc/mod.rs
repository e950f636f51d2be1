//! Device memory shared across processes (communication layers run one process per GPU).
//!
//! - `cuMemAlloc` memory ([`DeviceBuffer`](crate::cuda::DeviceBuffer)): [`IpcMemHandle`] from
//!   `cuIpcGetMemHandle`, opened in the other process with `cuIpcOpenMemHandle` (with
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so a peer importer maps it directly) as an
//!   [`IpcMapping`].
//! - Pool memory: a [`SharedPool`] created exportable as a POSIX file descripter
//!   (`cuMemPoolExportToShareableHandle`); the fd travels over a Unix socket with
//!   [`send_fd`]/[`recv_fd`] (`SCM_RIGHTS`), is imported as an [`ImportedPool`], and each
//!   allocation travels as a [`PoolPointer`] (`cuMemPoolExportPointer` /
//!   `cuMemPoolImportPointer`). The importer grants its own device access to the imported pool.
//! - VMM memory ([`VmmBuffer`](super::VmmBuffer), `cuMemCreate`): the allocation itself
//!   travels as a POSIX fd (`cuMemExportToShareableHandle`, sent with [`send_fd`]) and is
//!   mapped as a [`VmmImport`] (`cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`
//!   for the importer's device); its path is observed with `cuMemGetAccess` like any VMM memory.
//!
//! Who frees first: legacy and pool memory must outlive every importer's mapping (CUDA leaves a
//! free before the importer's close undefined, and pool memory is reused), which nothing on the
//! exporting side can observe, so [`IpcMemHandle::export`] and [`SharedPool::export_pointer`]
//! are `unsafe fn`s whose caller promises it (keep the memory until the importer says its
//! mapping is gone). VMM memory is reference-counted by the driver: the importer keeps it alive,
//! and [`VmmBuffer::export_fd`](super::VmmBuffer::export_fd) is safe.
//!
//! Every mapping records the path its importer reaches the memory by, so
//! [`copy_peer`](super::copy_peer) reports it like any peer copy, and [`IpcMapping::path`]
//! tells it directly.

// One file per mechanism: legacy.rs (cuIpc* handles and IpcMapping, which pool imports return
// too), pool.rs (exportable pools), vmm.rs (VMM imports), fd.rs (SCM_RIGHTS). Here: the
// process-wide record of live mappings and the checks every import makes.

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext};

use crate::cuda::result as r;
use crate::error::{Error, Result};

mod fd;
mod legacy;
mod pool;
mod vmm;

pub use fd::{recv_fd, send_fd};
pub use legacy::{IpcMapping, IpcMemHandle};
pub use pool::{ImportedPool, PoolPointer, SharedPool};
pub use vmm::VmmImport;

// ---- process-wide record of mapped ranges ------------------------------------------------

/// One entry (start, end, direct) per live mapping in this process: a range mapped twice (CUDA
/// returns the same pointer for a legacy handle opened twice, and counts the opens) has two.
#[derive(Debug, Default)]
pub(super) struct Records(Vec<(u64, u64, bool)>);

impl Records {
    fn add(&mut self, start: u64, bytes: usize, direct: bool) {
        self.0.push((start, start + bytes as u64, direct));
    }

    /// Removes one entry of a mapping at `start`; returns how many mappings at `start` remain.
    pub(super) fn remove_one(&mut self, start: u64) -> usize {
        if let Some(i) = self.0.iter().position(|(s, _, _)| *s == start) {
            self.0.swap_remove(i);
        }
        self.count(start)
    }

    /// How many live mappings start at `start`.
    pub(super) fn count(&self, start: u64) -> usize {
        self.0.iter().filter(|(s, _, _)| *s == start).count()
    }
}

static MAPPINGS: Mutex<Records> = Mutex::new(Records(Vec::new()));

/// The record, locked. Pool imports hold it from `cuMemPoolImportPointer` to their entry and
/// from their entry's removal to `cuMemFree`, so an import that returns an address already
/// imported is counted before that address can be freed.
pub(super) fn records() -> MutexGuard<'static, Records> {
    MAPPINGS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `Some(direct)` when `ptr` lies in a live IPC mapping of this process.
pub(in crate::p2p) fn lookup_mapping(ptr: sys::CUdeviceptr) -> Option<bool> {
    records()
        .0
        .iter()
        .find(|(s, e, _)| ptr >= *s && ptr < (*e).max(*s + 1))
        .map(|(_, _, d)| *d)
}

fn add_mapping(records: &mut Records, start: u64, bytes: usize, direct: bool) {
    records.add(start, bytes, direct);
}

/// Removes one mapping's entry; returns how many mappings of `start` remain.
fn remove_mapping(start: u64) -> usize {
    records().remove_one(start)
}

// ---- checks every import makes -----------------------------------------------------------

/// Checks that `len_bytes` (from a handle: another process's word) fits the memory the driver
/// mapped at `ptr` (`cuMemGetAddressRange`), so a slice of that length stays inside it.
fn check_mapped_len(ptr: sys::CUdeviceptr, len_bytes: u64, what: &str) -> Result<()> {
    // SAFETY: a context is current (the caller just mapped `ptr` in it).
    let (base, size) = unsafe { r::mem::get_address_range(ptr) }?;
    let avail = (base + size as u64).saturating_sub(ptr);
    if len_bytes > avail {
        return Err(Error::InvalidArgument(format!(
            "the {what} claims {len_bytes} bytes, but the driver mapped {avail} bytes at this \
             address: send the exporter's {what} unchanged (a wrong length would let the slice \
             run past the shared memory)"
        )));
    }
    Ok(())
}

fn elements<T>(bytes: u64) -> Result<usize> {
    let size = std::mem::size_of::<T>().max(1) as u64;
    if !bytes.is_multiple_of(size) {
        return Err(Error::InvalidArgument(format!(
            "the shared range has {bytes} bytes, not a multiple of the element size {size}: import with the exporter's element type"
        )));
    }
    Ok((bytes / size) as usize)
}

fn owner_device(ptr: sys::CUdeviceptr, ctx: &CudaContext) -> usize {
    // SAFETY: DEVICE_ORDINAL writes an int; read from a zeroed u64 (see copy::inspect).
    unsafe {
        r::pointer::get_attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            0u64,
        )
    }
    .map(|v| (v & 0xffff_ffff) as usize)
    .unwrap_or(ctx.ordinal())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review of 2026-12-02, item 7: opening the same legacy handle twice gives the same
    /// pointer (CUDA counts the opens), so the record holds two mappings of one range; dropping
    /// one must leave the other's record, or `copy_peer` misreports the survivor's path (staged
    /// or `PeerAccessNotEnabled`, refused under `Deny`). On the code before the fix the first
    /// removal erased both records.
    #[test]
    fn a_range_mapped_twice_keeps_its_record_until_both_mappings_are_dropped() {
        // An address no test maps (device addresses of a real mapping are far below it).
        let start = 0x7eed_0000_0000_u64;
        add_mapping(&mut records(), start, 4096, true);
        add_mapping(&mut records(), start, 4096, true);
        assert_eq!(lookup_mapping(start + 100), Some(true));
        remove_mapping(start);
        assert_eq!(
            lookup_mapping(start + 100),
            Some(true),
            "dropping one of two mappings of a range erased the other's record"
        );
        remove_mapping(start);
        assert_eq!(lookup_mapping(start + 100), None);
    }
}

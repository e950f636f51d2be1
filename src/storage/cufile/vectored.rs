//! Scatter/gather IO (`cuFileReadv` / `cuFileWritev`, cuFile 1.19+).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cufile_sys as sys;

use super::{result, CuFileHandle};
use crate::error::{Error, Result};

impl CuFileHandle {
    /// Reads consecutive file bytes from `file_offset` into `bufs` in order (`cuFileReadv`).
    /// Returns the bytes read (short only at end of file). Each buffer's stream is
    /// synchronised first.
    ///
    /// Needs cuFile 1.19+: an older library gives [`Error::SymbolUnavailable`] before anything
    /// is read.
    pub fn readv(&self, bufs: &mut [CudaViewMut<'_, u8>], file_offset: u64) -> Result<usize> {
        let _restore = crate::cuda::CurrentContext::save();
        let lib = self.driver().lib();
        result::sym(lib.cuFileReadv, "cuFileReadv")?;
        let mut iov = Vec::with_capacity(bufs.len());
        let mut total = 0u64;
        for b in bufs.iter_mut() {
            let stream: Arc<CudaStream> = Arc::clone(b.stream());
            self.driver().enter(&stream, true)?;
            let len = b.len();
            let (p, _rec) = b.device_ptr_mut(&stream);
            iov.push(sys::CUfileIOVec_t {
                base: p as *mut c_void,
                len,
            });
            total += len as u64;
        }
        check_end(file_offset, total)?;
        // SAFETY: each element is a live device view borrowed mutably for this call, its stream
        // synchronised, its context current; the handle is registered; the call is synchronous.
        unsafe { result::readv(lib, self.inner().fh, &iov, file_offset as i64) }
    }

    /// Writes `bufs` in order to consecutive file bytes from `file_offset` (`cuFileWritev`,
    /// cuFile 1.19+). Returns the bytes written.
    pub fn writev(&self, bufs: &[CudaView<'_, u8>], file_offset: u64) -> Result<usize> {
        let _restore = crate::cuda::CurrentContext::save();
        let lib = self.driver().lib();
        result::sym(lib.cuFileWritev, "cuFileWritev")?;
        let mut iov = Vec::with_capacity(bufs.len());
        let mut total = 0u64;
        for b in bufs {
            let stream: Arc<CudaStream> = Arc::clone(b.stream());
            self.driver().enter(&stream, true)?;
            let len = b.len();
            let (p, _rec) = b.device_ptr(&stream);
            iov.push(sys::CUfileIOVec_t {
                base: p as *mut c_void,
                len,
            });
            total += len as u64;
        }
        check_end(file_offset, total)?;
        // SAFETY: as in readv, with the buffers only read.
        unsafe { result::writev(lib, self.inner().fh, &iov, file_offset as i64) }
    }
}

fn check_end(file_offset: u64, total: u64) -> Result<()> {
    if file_offset
        .checked_add(total)
        .is_none_or(|e| e > i64::MAX as u64)
    {
        return Err(Error::InvalidArgument(format!(
            "file offset {file_offset} + {total} bytes exceeds the largest file offset"
        )));
    }
    Ok(())
}

//! Scatter/gather IO (`cuFileReadv` / `cuFileWritev`, cuFile 1.19+).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cufile_sys as sys;

use super::{result, CuFileHandle};
use crate::error::{Error, Result};

impl CuFileHandle {
    /// Reads consecutive file bytes from `file_offset` into `bufs` in order (`cuFileReadv`).
    /// Returns the bytes read (short only at end of file). Each buffer's stream waits for the
    /// buffer's pending work on other streams and is synchronised first, as for
    /// [`read`](Self::read). The read is clamped to the file's size, and its last piece (up to
    /// 68 KiB) goes through [`read`](Self::read)'s scratch path, so no byte outside `bufs` and
    /// none past end of file is written.
    ///
    /// Needs cuFile 1.19+: an older library gives [`Error::SymbolUnavailable`] before anything
    /// is read. A buffer's stream capturing a CUDA graph → [`Error::Unsupported`], checked
    /// first (the call synchronises the streams, which a capture forbids).
    pub fn readv(&self, bufs: &mut [CudaViewMut<'_, u8>], file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing_any(bufs.iter().map(|b| b.stream()), "CuFileHandle::readv")?;
        let lib = self.driver().lib();
        result::sym(lib.cuFileReadv, "cuFileReadv")?;
        let _restore = crate::cuda::CurrentContext::save();
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_end(file_offset, total)?;
        let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| Arc::clone(b.stream())).collect();
        // Pointers first (each view's stream then waits for the view's pending work elsewhere),
        // then the streams are synchronised, so cuFile (ordered with no stream) comes after.
        let mut pieces = Vec::with_capacity(bufs.len());
        let mut records = Vec::with_capacity(bufs.len());
        for (b, stream) in bufs.iter_mut().zip(&streams) {
            let len = b.len();
            let (p, rec) = b.device_ptr_mut(stream);
            pieces.push((p, len));
            records.push(rec);
        }
        for stream in &streams {
            self.driver().enter(stream, true)?;
        }
        let n = super::file_handle::clamp_to_eof(
            self.file(),
            self.path(),
            file_offset,
            usize::try_from(total).unwrap_or(usize::MAX),
        )?;
        // The last piece goes through read_inside's scratch buffer (see CuFileHandle::read).
        let to_block = ((file_offset + n as u64) % 4096) as usize;
        let tail = n.min(super::file_handle::READ_OVERRUN + to_block);
        let body = n - tail;
        let mut iov = Vec::with_capacity(pieces.len());
        let mut left = body;
        for &(p, len) in &pieces {
            if left == 0 {
                break;
            }
            let take = len.min(left);
            iov.push(sys::CUfileIOVec_t {
                base: p as *mut c_void,
                len: take,
            });
            left -= take;
        }
        let mut done = 0;
        if body > 0 {
            // SAFETY: each element lies inside a live device view borrowed mutably for this call,
            // its stream synchronised after waiting for the view's other users, its context
            // current (enter); the elements stop at end of file as it is now; the handle is
            // registered; the call is synchronous.
            done = unsafe { result::readv(lib, self.inner().fh, &iov, file_offset as i64) }?;
            if done < body {
                return Ok(done);
            }
        }
        // The tail: the rest of the pieces from byte `body` to `n`, each through read_inside.
        let mut pos = 0usize;
        for ((p, len), stream) in pieces.iter().zip(&streams) {
            let (start, end) = (pos, pos + len);
            pos = end;
            let (from, to) = (start.max(body), end.min(n));
            if from >= to {
                continue;
            }
            self.driver().enter(stream, false)?;
            let got = self.read_inside(
                stream,
                p + (from - start) as u64,
                to - from,
                file_offset + from as u64,
            )?;
            done += got;
            if got < to - from {
                break;
            }
        }
        drop(records);
        Ok(done)
    }

    /// Writes `bufs` in order to consecutive file bytes from `file_offset` (`cuFileWritev`,
    /// cuFile 1.19+). Returns the bytes written. Each buffer's stream waits for the buffer's
    /// pending writes on other streams and is synchronised first. A buffer's stream capturing a
    /// CUDA graph → [`Error::Unsupported`], checked first (as for [`readv`](Self::readv)).
    pub fn writev(&self, bufs: &[CudaView<'_, u8>], file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing_any(bufs.iter().map(|b| b.stream()), "CuFileHandle::writev")?;
        let lib = self.driver().lib();
        result::sym(lib.cuFileWritev, "cuFileWritev")?;
        let _restore = crate::cuda::CurrentContext::save();
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_end(file_offset, total)?;
        let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| Arc::clone(b.stream())).collect();
        let mut iov = Vec::with_capacity(bufs.len());
        let mut records = Vec::with_capacity(bufs.len());
        for (b, stream) in bufs.iter().zip(&streams) {
            let len = b.len();
            let (p, rec) = b.device_ptr(stream);
            iov.push(sys::CUfileIOVec_t {
                base: p as *mut c_void,
                len,
            });
            records.push(rec);
        }
        for stream in &streams {
            self.driver().enter(stream, true)?;
        }
        // SAFETY: as in readv, with the buffers only read.
        let n = unsafe { result::writev(lib, self.inner().fh, &iov, file_offset as i64) };
        drop(records);
        n
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

//! Bounce buffers: page-aligned host memory, page-locked for the GPU when a device uses it.

use std::io;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A page-aligned anonymous mapping, optionally registered with CUDA
/// (`cuMemHostRegister`, portable to every context) so copies to and from it are DMA.
///
/// The pages are touched by the allocating thread, so under the kernel's default policy they
/// live on that thread's NUMA node: workers pinned to the GPU's node allocate their own.
#[derive(Debug)]
pub(in crate::storage) struct BounceBuf {
    ptr: NonNull<u8>,
    len: usize,
    registered: bool,
}

// SAFETY: the buffer is plain memory owned by this value; the pool hands each one to a single
// worker at a time, and CUDA registration is process-wide (no thread affinity).
unsafe impl Send for BounceBuf {}

impl BounceBuf {
    /// Maps `len` bytes (rounded up to pages) of zeroed, touched memory.
    pub fn new(len: usize) -> Result<BounceBuf> {
        let page = super::io::page_size();
        let len = len.max(1).div_ceil(page) * page;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::io("mmap", None, io::Error::last_os_error()));
        }
        // SAFETY: advice on our own mapping; failure only loses the hint.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap never returns null on success");
        // First touch from this thread places the pages on its NUMA node.
        for off in (0..len).step_by(page) {
            // SAFETY: off < len, inside the mapping we own.
            unsafe { ptr.as_ptr().add(off).write_volatile(0) };
        }
        Ok(BounceBuf {
            ptr,
            len,
            registered: false,
        })
    }

    /// Page-locks the buffer for the GPU (`cuMemHostRegister` with `PORTABLE`). Needs a
    /// current CUDA context (the caller bound one).
    pub fn register(&mut self) -> Result<()> {
        if self.registered {
            return Ok(());
        }
        // SAFETY: [ptr, ptr+len) is our live mapping; it stays mapped until Drop, which
        // unregisters first; the caller bound a context.
        unsafe { crate::cuda::result::mem::host_register(self.ptr.as_ptr(), self.len) }?;
        self.registered = true;
        Ok(())
    }

    pub fn is_registered(&self) -> bool {
        self.registered
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for BounceBuf {
    fn drop(&mut self) {
        if self.registered {
            // SAFETY: the pointer was registered by `register`; no copy uses it any more (the
            // engine synchronizes every stream before a job returns).
            if let Err(e) = unsafe { crate::cuda::result::mem::host_unregister(self.ptr.as_ptr()) }
            {
                tracing::warn!(%e, "leaking a bounce buffer that CUDA would not unregister");
                return;
            }
        }
        // SAFETY: unmapping exactly our mapping.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

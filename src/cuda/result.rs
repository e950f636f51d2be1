//! The thin private result layer for the CUDA driver: one function per C call, turning the raw
//! `CUresult` into [`Result`]; safe types in every room call only these (no other module calls
//! cudarc's `sys` or `result` functions). Grouped by C object as cudarc's `driver::result` is:
//! `device::get` is `cuDeviceGet`, `mem_pool::set_access` is `cuMemPoolSetAccess`.
//!
//! Every function here except those of [`driver`] may only be called after
//! [`crate::cuda::driver_version`] (or [`crate::cuda::context`]) succeeded in this process:
//! cudarc's loader panics otherwise.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Turns a raw `CUresult` into `Result`, naming the call.
pub(crate) fn check(op: &'static str, rc: sys::CUresult) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::cuda(op, cudarc::driver::DriverError(rc)))
    }
}

/// `CUmemLocation` as every cuda.h lays it out: the location type, then the `int id` (a plain
/// field up to CUDA 13.1; from 13.2 the first member of an anonymous union at the same offset,
/// which 13.4 shares with a pair of bytes). Reading and writing the id through this mirror works
/// with whichever bindings cudarc was built with; no `cfg` of ours can tell, because cudarc picks
/// its version itself (`cuda-version-from-build-system`, `CUDARC_CUDA_VERSION`, the program's
/// own cudarc feature).
#[repr(C)]
struct LocationLayout {
    type_: sys::CUmemLocationType,
    id: c_int,
}

// The mirror is exact: same size and alignment, the type first, so the 4 bytes after it are `id`.
const _: () = {
    assert!(std::mem::size_of::<LocationLayout>() == std::mem::size_of::<sys::CUmemLocation>());
    assert!(std::mem::align_of::<LocationLayout>() == std::mem::align_of::<sys::CUmemLocation>());
    assert!(std::mem::offset_of!(sys::CUmemLocation, type_) == 0);
    assert!(std::mem::offset_of!(LocationLayout, id) == 4);
};

/// `CUmemLocation { type = CU_MEM_LOCATION_TYPE_DEVICE, id = ordinal }`, for any CUDA bindings.
pub(crate) fn device_location(ordinal: i32) -> sys::CUmemLocation {
    // SAFETY: CUmemLocation is a plain C struct; all-zero is CU_MEM_LOCATION_TYPE_INVALID (0)
    // with id 0, a valid value of every field.
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    let mirror = (&raw mut loc).cast::<LocationLayout>();
    // SAFETY: `mirror` points to `loc`, whose layout LocationLayout matches exactly (asserted
    // above); writing the `int` at offset 4 sets `id` (or the union's `id` member).
    unsafe { (*mirror).id = ordinal };
    loc
}

/// The `id` of a `CUmemLocation` (the device ordinal for a device location), for any CUDA
/// bindings.
pub(crate) fn location_id(loc: &sys::CUmemLocation) -> i32 {
    let mirror = std::ptr::from_ref(loc).cast::<LocationLayout>();
    // SAFETY: `mirror` points to a live CUmemLocation whose layout LocationLayout matches exactly
    // (asserted above); the 4 bytes at offset 4 are the `int id` every location type writes
    // (cuda.h), initialised by whoever filled `loc` (the driver or `device_location`).
    unsafe { (*mirror).id }
}

/// The driver itself: whether libcuda loads, its version, `cuInit`. The probe in
/// [`crate::cuda`] calls these first; every other function of this layer runs only after it
/// succeeded.
pub(crate) mod driver {
    use super::*;

    /// The library names cudarc's loader tries: "cuda", and on Windows also "nvcuda" (the
    /// driver's name there; on Linux only libcuda exists, and listing libnvcuda* would double the
    /// "tried" list every absence reports).
    pub(crate) const LIBCUDA_NAMES: &[&str] = if cfg!(windows) {
        &["cuda", "nvcuda"]
    } else {
        &["cuda"]
    };

    /// The names cudarc's loader tries for libcuda, in its order and without repeats: its
    /// `get_lib_name_candidates` for [`LIBCUDA_NAMES`], rebuilt from [`sys::CUDA_VERSION`]
    /// because cudarc offers that function (and `is_culib_present`) only with `dynamic-loading`,
    /// while a program may build cudarc with `dynamic-linking` or `static-linking`. With dynamic
    /// loading, a name found here is one cudarc's loader finds too, so its first call cannot
    /// panic (a subset of its names keeps that true).
    pub(crate) fn libcuda_candidates() -> Vec<String> {
        use std::env::consts::{DLL_PREFIX as P, DLL_SUFFIX as S};
        let (major, minor) = (sys::CUDA_VERSION / 1000, sys::CUDA_VERSION % 1000 / 10);
        let w = usize::BITS;
        let mut names: Vec<String> = Vec::new();
        for lib in LIBCUDA_NAMES {
            for name in [
                format!("{P}{lib}{S}"),
                format!("{P}{lib}{w}{S}"),
                format!("{P}{lib}{w}_{major}{S}"),
                format!("{P}{lib}{w}_{major}{minor}{S}"),
                format!("{P}{lib}{w}_{major}{minor}_0{S}"),
                format!("{P}{lib}{w}_{major}0_{minor}{S}"),
                format!("{P}{lib}{w}_10{S}"),
                format!("{P}{lib}{w}_11{S}"),
                format!("{P}{lib}{w}_12{S}"),
                format!("{P}{lib}{w}_{major}0_0{S}"),
                format!("{P}{lib}{w}_9{S}"),
                format!("{P}{lib}{S}.{major}"),
                format!("{P}{lib}{S}.12"),
                format!("{P}{lib}{S}.11"),
                format!("{P}{lib}{S}.10"),
                format!("{P}{lib}{S}.9"),
                format!("{P}{lib}{S}.1"),
            ] {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        names
    }

    /// Whether one of `candidates` loads (dlopen through libloading; the handle is dropped again,
    /// cudarc's loader or the dynamic linker holds its own). The only call allowed before the
    /// probe in [`crate::cuda`] succeeded.
    pub(crate) fn is_present(candidates: &[String]) -> bool {
        candidates.iter().any(|name| {
            // SAFETY: loading libcuda runs the NVIDIA driver library's initialisers, which have
            // no preconditions (cudarc's loader does exactly this).
            unsafe { libloading::Library::new(name) }.is_ok()
        })
    }

    /// `cuDriverGetVersion`; call only after [`is_present`] found libcuda (cuDriverGetVersion exists since CUDA 2.2).
    pub(crate) fn version() -> Result<i32, sys::CUresult> {
        let mut version = 0;
        // SAFETY: `version` is a valid out-pointer for the call's duration.
        let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(version)
        } else {
            Err(rc)
        }
    }

    /// `cuInit(0)`; call only after [`is_present`].
    pub(crate) fn init() -> Result<(), sys::CUresult> {
        cudarc::driver::result::init().map_err(|e| e.0)
    }
}

/// `CUdevice`: `cuDeviceGet*`, peer capabilities, the default memory pool.
pub(crate) mod device {
    use super::*;
    use std::mem::MaybeUninit;

    /// `cuDeviceGet`.
    pub(crate) fn get(ordinal: usize) -> Result<sys::CUdevice> {
        cudarc::driver::result::device::get(ordinal as c_int)
            .map_err(|e| Error::cuda("cuDeviceGet", e))
    }

    /// `cuDeviceCanAccessPeer(&can, dev, peer)`.
    pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer; the device handles come from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, dev, peer)
        })?;
        Ok(can != 0)
    }

    /// `cuDeviceGetP2PAttribute(&v, attr, src, dst)`.
    pub(crate) fn p2p_attribute(
        attr: sys::CUdevice_P2PAttribute,
        src: sys::CUdevice,
        dst: sys::CUdevice,
    ) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; the device handles come from cuDeviceGet.
        check("cuDeviceGetP2PAttribute", unsafe {
            sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetPCIBusId`: the device's PCI address, e.g. `0000:18:00.0`.
    pub(crate) fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: `buf` holds 32 bytes and we pass that length; the driver NUL-terminates.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        // SAFETY: the driver wrote a NUL-terminated string into `buf` (len <= 32).
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().into_owned())
    }

    /// `cuDeviceGetDefaultMemPool`.
    pub(crate) fn default_mem_pool(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
        let mut pool = MaybeUninit::uninit();
        // SAFETY: `pool` is a valid out-pointer; `dev` comes from cuDeviceGet.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), dev)
        })?;
        // SAFETY: written by the successful call above.
        Ok(unsafe { pool.assume_init() })
    }

    /// `cuDeviceGetCount`.
    pub(crate) fn count() -> Result<c_int> {
        cudarc::driver::result::device::get_count().map_err(|e| Error::cuda("cuDeviceGetCount", e))
    }

    /// `cuDeviceGetAttribute`.
    pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        // SAFETY: `dev` is a valid device handle returned by cuDeviceGet after cuInit succeeded.
        unsafe { cudarc::driver::result::device::get_attribute(dev, attr) }
            .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))
    }

    /// `cuDeviceGetName`.
    pub(crate) fn name(dev: sys::CUdevice) -> Result<String> {
        cudarc::driver::result::device::get_name(dev).map_err(|e| Error::cuda("cuDeviceGetName", e))
    }
}

/// `CUcontext`: the current context, context peer access.
pub(crate) mod ctx {
    use super::*;

    /// What `cuCtxEnablePeerAccess` did.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Enabled {
        /// This call enabled access.
        Now,
        /// Access was already enabled (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`, 704).
        Already,
    }

    /// `cuCtxEnablePeerAccess(peer, 0)` for the *current* context.
    ///
    /// # Safety
    /// The current context must be the accessor's, and `peer` a live context.
    pub(crate) unsafe fn enable_peer_access(
        peer: sys::CUcontext,
    ) -> Result<Enabled, sys::CUresult> {
        // SAFETY: the caller guarantees a current context and a live peer context; flags must be 0.
        let rc = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(Enabled::Now),
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(Enabled::Already),
            other => Err(other),
        }
    }

    /// `cuCtxDisablePeerAccess(peer)` for the *current* context.
    ///
    /// # Safety
    /// The current context must be the accessor's, and `peer` a live context.
    pub(crate) unsafe fn disable_peer_access(peer: sys::CUcontext) -> Result<()> {
        // SAFETY: the caller guarantees a current context and a live peer context.
        check("cuCtxDisablePeerAccess", unsafe {
            sys::cuCtxDisablePeerAccess(peer)
        })
    }

    /// `cuCtxGetCurrent`: the calling thread's current context, `None` when there is none (or the
    /// call fails).
    pub(crate) fn current() -> Option<sys::CUcontext> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        let rc = unsafe { sys::cuCtxGetCurrent(&mut cur) };
        (rc == sys::CUresult::CUDA_SUCCESS && !cur.is_null()).then_some(cur)
    }

    /// `cuCtxGetDevice` for the current context.
    ///
    /// # Safety
    /// A context must be current on the calling thread.
    pub(crate) unsafe fn device() -> Result<sys::CUdevice, sys::CUresult> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: a context is current (the caller's contract); `dev` is a valid out-pointer.
        let rc = unsafe { sys::cuCtxGetDevice(&mut dev) };
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(dev)
        } else {
            Err(rc)
        }
    }

    /// `cuCtxSetCurrent`; the raw status (callers restoring a previous context ignore it).
    ///
    /// # Safety
    /// `ctx` must be a live context (or null, to unbind).
    pub(crate) unsafe fn set_current(ctx: sys::CUcontext) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe { sys::cuCtxSetCurrent(ctx) }
    }
}

/// `CUstream`.
pub(crate) mod stream {
    use super::*;

    /// `cuStreamIsCapturing`: `stream`'s capture status, or the raw status of a query that
    /// failed (the refusal's wording is [`crate::cuda::capture_refusal`]'s).
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context (or null: its legacy default
    /// stream).
    pub(crate) unsafe fn capture_status(
        stream: sys::CUstream,
    ) -> std::result::Result<sys::CUstreamCaptureStatus, sys::CUresult> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is alive (the caller's contract); `status` is a valid out-pointer.
        let rc = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(status)
        } else {
            Err(rc)
        }
    }

    /// `cuStreamCreate` with `CU_STREAM_DEFAULT`: a blocking stream (the legacy default stream
    /// and it wait for each other), which cudarc never makes (its streams are non-blocking);
    /// C code and other libraries do (tests of the legacy stream beside such a stream's
    /// capture). Destroy it with [`destroy`].
    ///
    /// # Safety
    /// A context must be current.
    #[cfg(test)]
    pub(crate) unsafe fn create_blocking() -> Result<sys::CUstream> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: a context is current (the caller's contract); `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_DEFAULT as u32)
        })?;
        Ok(s)
    }

    /// `cuStreamDestroy` of a stream [`create_blocking`] made.
    ///
    /// # Safety
    /// `stream` must be live, made by [`create_blocking`], destroyed once, and used by nothing
    /// after.
    #[cfg(test)]
    pub(crate) unsafe fn destroy(stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(stream)
        })
    }

    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture interaction mode
    /// to `mode` (which calls CUDA refuses on this thread while captures last) and returns the
    /// mode it had. Needs no context.
    pub(crate) fn exchange_capture_mode(
        mode: sys::CUstreamCaptureMode,
    ) -> Result<sys::CUstreamCaptureMode> {
        let mut m = mode;
        // SAFETY: `m` is a valid in/out pointer for the call.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(m)
    }

    /// `cuStreamEndCapture` of a capture this thread began on `stream`, then the number of
    /// nodes of the graph it made (`cuGraphGetNodes`; the graph is destroyed): what work was
    /// captured (tests of calls that must refuse a capturing stream).
    ///
    /// # Safety
    /// `stream` must be a live stream capturing a graph begun on this thread.
    #[cfg(test)]
    pub(crate) unsafe fn end_capture_node_count(stream: sys::CUstream) -> Result<usize> {
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the caller's contract; `g` is a valid out-pointer.
        check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream, &mut g)
        })?;
        if g.is_null() {
            return Ok(0);
        }
        let mut n = 0usize;
        // SAFETY: `g` is the graph just returned to us; a null array asks only for the count.
        let counted = check("cuGraphGetNodes", unsafe {
            sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n)
        });
        // SAFETY: ours (returned by cuStreamEndCapture), destroyed once.
        unsafe { sys::cuGraphDestroy(g) };
        counted.map(|()| n)
    }

    /// `cuStreamSynchronize`.
    ///
    /// # Safety
    /// `stream` must be a live stream (or null: the legacy default stream) of the current
    /// context.
    pub(crate) unsafe fn synchronize(stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream)
        })
    }

    /// `cuStreamQuery`: true when every piece of work on `stream` has completed.
    ///
    /// # Safety
    /// As [`synchronize`].
    #[allow(dead_code)] // the storage engine's next pipeline uses it
    pub(crate) unsafe fn is_idle(stream: sys::CUstream) -> bool {
        // SAFETY: the caller's contract.
        unsafe { query(stream) == sys::CUresult::CUDA_SUCCESS }
    }

    /// `cuStreamQuery`, its code returned raw: `CUDA_ERROR_NOT_READY` is no failure, and
    /// what the others mean for the queued work is [`crate::cuda::settle`]'s one
    /// classification.
    ///
    /// # Safety
    /// As [`synchronize`].
    pub(crate) unsafe fn query(stream: sys::CUstream) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe { sys::cuStreamQuery(stream) }
    }

    /// `cuStreamWriteValue32_v2(stream, addr, value, CU_STREAM_WRITE_VALUE_DEFAULT)`, its code
    /// raw (`CUDA_ERROR_NOT_SUPPORTED`: no stream memory operations on this device or driver).
    /// The device writes `value` to `addr` once the work queued on `stream` before the call
    /// completed, after a memory barrier (the default flag): what that work wrote is visible
    /// before the value is.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context (or null: its legacy default
    /// stream); `addr` a device address of 4 writable, 4-byte-aligned bytes (not managed
    /// memory) that stay allocated for as long as the write may still land.
    pub(crate) unsafe fn write_value32(
        stream: sys::CUstream,
        addr: sys::CUdeviceptr,
        value: u32,
    ) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe {
            sys::cuStreamWriteValue32_v2(
                stream,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
            )
        }
    }

    /// `cuLaunchHostFunc`: `f(data)` runs on a driver thread once the work before it on
    /// `stream` completed (tests hold or feed streams with it).
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context; `f` must make no CUDA call,
    /// and `data` must stay valid for it until it ran.
    #[cfg(test)]
    pub(crate) unsafe fn launch_host_func(
        stream: sys::CUstream,
        f: unsafe extern "C" fn(*mut c_void),
        data: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuLaunchHostFunc", unsafe {
            sys::cuLaunchHostFunc(stream, Some(f), data)
        })
    }
}

/// `CUevent`, raw: what the waits after a failed synchronize ([`crate::cuda::settle`]) need
/// without cudarc's binding.
pub(crate) mod event {
    use super::*;

    /// `cuEventCreate(CU_EVENT_DISABLE_TIMING)` in the current context, its code raw.
    ///
    /// # Safety
    /// A context must be current on the calling thread.
    pub(crate) unsafe fn create() -> Result<sys::CUevent, sys::CUresult> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer; a context is current (the caller's contract).
        let rc = unsafe {
            sys::cuEventCreate(
                &mut e,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
        };
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(e)
        } else {
            Err(rc)
        }
    }

    /// `cuEventRecord`, its code raw.
    ///
    /// # Safety
    /// `event` and `stream` must be live, of the same (current) context.
    pub(crate) unsafe fn record(event: sys::CUevent, stream: sys::CUstream) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe { sys::cuEventRecord(event, stream) }
    }

    /// `cuEventSynchronize`: waits until the work before the event's latest record completed.
    ///
    /// # Safety
    /// `event` must be live; its context current.
    pub(crate) unsafe fn synchronize(event: sys::CUevent) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event)
        })
    }

    /// `cuEventQuery`, its code raw (`CUDA_ERROR_NOT_READY`: the work before the record has
    /// not completed).
    ///
    /// # Safety
    /// `event` must be live.
    pub(crate) unsafe fn query(event: sys::CUevent) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe { sys::cuEventQuery(event) }
    }

    /// `cuEventDestroy`, its code raw (the event's resources go once its work completed).
    ///
    /// # Safety
    /// `event` must be live and not used again.
    pub(crate) unsafe fn destroy(event: sys::CUevent) -> sys::CUresult {
        // SAFETY: the caller's contract.
        unsafe { sys::cuEventDestroy_v2(event) }
    }
}

/// Linear device memory (`cuMemAlloc`), host registration, copies, dma-buf export.
pub(crate) mod mem {
    use super::*;

    /// `cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream)`.
    ///
    /// # Safety
    /// Both ranges must be live device memory of the named contexts for `bytes` bytes until the
    /// stream has executed the copy; `stream` must be live.
    pub(crate) unsafe fn memcpy_peer_async(
        dst: sys::CUdeviceptr,
        dst_ctx: sys::CUcontext,
        src: sys::CUdeviceptr,
        src_ctx: sys::CUcontext,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyPeerAsync", unsafe {
            sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream)
        })
    }

    /// `cuMemAlloc_v2` in the current context.
    ///
    /// # Safety
    /// A context must be current.
    pub(crate) unsafe fn alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the caller guarantees a current context.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut p, bytes.max(1))
        })?;
        Ok(p)
    }

    /// `cuMemAllocAsync` on `stream` (its device's default pool; the allocation exists for
    /// work ordered after it on `stream`).
    ///
    /// # Safety
    /// `stream` must be a live stream of the context current on this thread (or null: that
    /// context's legacy default stream), whose device supports memory pools.
    pub(crate) unsafe fn alloc_async(
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<sys::CUdeviceptr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the caller's contract.
        check("cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&mut p, bytes.max(1), stream)
        })?;
        Ok(p)
    }

    /// `cuMemFreeAsync` on `stream`.
    ///
    /// # Safety
    /// `p` must be a live allocation (from `cuMemAllocAsync` or `cuMemAlloc`) of the context
    /// current on this thread, `stream` a live stream of it, and every use of `p` not ordered
    /// before the free on `stream` finished.
    pub(crate) unsafe fn free_async(p: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(p, stream) })
    }

    /// `cuMemFree_v2`.
    ///
    /// # Safety
    /// `p` must come from `cuMemAlloc`, or from `cuMemPoolImportPointer` in the current context,
    /// and no work may still use it: for pool memory `cuMemFree` performs no implicit
    /// synchronization (CUDA driver API), so every use must have finished before the call.
    pub(crate) unsafe fn free(p: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(p) })
    }

    /// `cuMemGetAddressRange_v2`: the base and size of the allocation holding `ptr`.
    ///
    /// # Safety
    /// libcuda must be initialised (a cudarc buffer or context exists).
    pub(crate) unsafe fn get_address_range(
        ptr: sys::CUdeviceptr,
    ) -> Result<(sys::CUdeviceptr, usize)> {
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: both out-pointers are valid; the driver only reads `ptr`'s value.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        Ok((base, size))
    }

    /// `cuMemHostRegister_v2` with `CU_MEMHOSTREGISTER_PORTABLE` (usable from every context).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be mapped host memory that stays mapped until it is unregistered;
    /// a context must be current.
    pub(crate) unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        })
    }

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` must have been registered by [`host_register`] and no copy may still use it.
    pub(crate) unsafe fn host_unregister(ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.cast())
        })
    }

    /// `cuMemHostRegister_v2(ptr, len, CU_MEMHOSTREGISTER_DEVICEMAP)`: page-locks host memory
    /// of the caller's for the current context and maps it for its device
    /// ([`host_device_pointer`]).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be mapped host memory, page-aligned, that stays mapped for as long
    /// as the device may write it (for the fences' pages: the process's life); a context must be
    /// current.
    pub(crate) unsafe fn host_register_mapped(ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_DEVICEMAP)
        })
    }

    /// `cuMemHostGetDevicePointer_v2(p, 0)`: the device's address of mapped host memory.
    ///
    /// # Safety
    /// `p` must lie in memory registered by [`host_register_mapped`] in the current context.
    pub(crate) unsafe fn host_device_pointer(p: *mut c_void) -> Result<sys::CUdeviceptr> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: the caller's contract; `d` is a valid out-pointer; the flags must be 0.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0)
        })?;
        Ok(d)
    }

    /// `cuMemcpyHtoDAsync_v2`.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes until the copy completes (page-locked for the copy
    /// to be asynchronous), `dst` device memory writable for `len` bytes in the current context,
    /// `stream` a live stream of that context.
    pub(crate) unsafe fn memcpy_htod_async(
        dst: sys::CUdeviceptr,
        src: *const u8,
        len: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream)
        })
    }

    /// `cuMemcpyDtoDAsync_v2`.
    ///
    /// # Safety
    /// `src` readable and `dst` writable device memory for `len` bytes until the copy completes,
    /// both in the current context; `stream` a live stream of that context.
    pub(crate) unsafe fn memcpy_dtod_async(
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream)
        })
    }

    /// `cuMemcpyDtoHAsync_v2`.
    ///
    /// # Safety
    /// As [`memcpy_htod_async`], the other way: `dst` host memory writable for `len` bytes until
    /// the copy completes, `src` device memory readable for `len` bytes.
    pub(crate) unsafe fn memcpy_dtoh_async(
        dst: *mut u8,
        src: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream)
        })
    }

    /// `cuMemGetHandleForAddressRange(&fd, start, len, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`:
    /// the raw status and the fd the driver wrote (a new fd the caller owns on success).
    ///
    /// # Safety
    /// `[start, start + len)` must be host-page aligned device memory the caller keeps alive while
    /// the fd is in use; a context must be current.
    pub(crate) unsafe fn get_dmabuf_fd(
        start: sys::CUdeviceptr,
        len: usize,
    ) -> (sys::CUresult, c_int) {
        let mut fd: c_int = -1;
        // SAFETY: `fd` is a valid out-location for the `int` this handle type returns; the
        // caller's contract on the range.
        let rc = unsafe {
            sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut c_int as *mut c_void,
                start,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        (rc, fd)
    }
}

/// `cuPointerGetAttribute` / `cuPointerSetAttribute`.
pub(crate) mod pointer {
    use super::*;

    /// `cuPointerGetAttribute` for an attribute whose value is a plain `T` (int, pointer, handle).
    ///
    /// # Safety
    /// `T` must be the exact type the driver writes for `attr` (`c_int`/`u32` for ordinals and
    /// booleans, `CUcontext`, `CUmemoryPool`, `CUdeviceptr`, `usize` for sizes).
    pub(crate) unsafe fn get_attribute<T: Copy>(
        ptr: sys::CUdeviceptr,
        attr: sys::CUpointer_attribute,
        zero: T,
    ) -> Result<T, sys::CUresult> {
        let mut v = zero;
        // SAFETY: `v` has the type the attribute writes (caller's contract) and lives for the call.
        let rc = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, ptr) };
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(v)
        } else {
            Err(rc)
        }
    }

    /// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation holding `ptr`
    /// (`cuPointerSetAttribute`).
    ///
    /// # Safety
    /// libcuda must be initialised; the driver validates `ptr`.
    pub(crate) unsafe fn set_sync_memops(ptr: sys::CUdeviceptr) -> Result<()> {
        let one: u32 = 1;
        // SAFETY: `one` is a valid `unsigned int` for the call's duration, as SYNC_MEMOPS expects.
        check("cuPointerSetAttribute(SYNC_MEMOPS)", unsafe {
            sys::cuPointerSetAttribute(
                &one as *const u32 as *const c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                ptr,
            )
        })
    }
}

/// Virtual memory management: `cuMemCreate`, `cuMemMap`, access, shareable handles.
pub(crate) mod vmm {
    use super::*;

    /// `cuMemGetAccess(&flags, {DEVICE accessor}, ptr)` for VMM-mapped memory; the raw bits.
    ///
    /// # Safety
    /// `ptr` must lie in a live VMM mapping.
    pub(crate) unsafe fn get_access(ptr: sys::CUdeviceptr, accessor: i32) -> Result<u64> {
        let loc = device_location(accessor);
        let mut flags: std::ffi::c_ulonglong = 0;
        // SAFETY: out-pointer valid; the caller guarantees `ptr` is mapped.
        check("cuMemGetAccess", unsafe {
            sys::cuMemGetAccess(&mut flags, &loc, ptr)
        })?;
        Ok(flags as u64)
    }

    /// `cuMemSetAccess(p, size, {DEVICE accessor, flags}, 1)`.
    ///
    /// # Safety
    /// `p`/`size` must be a live VMM mapping.
    pub(crate) unsafe fn set_access(
        p: sys::CUdeviceptr,
        size: usize,
        accessor: i32,
        flags: sys::CUmemAccess_flags,
    ) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: device_location(accessor),
            flags,
        };
        // SAFETY: `desc` is one valid descriptor; the caller's contract on the range.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(p, size, &desc, 1)
        })
    }

    /// `cuMemRetainAllocationHandle`, `cuMemGetAllocationPropertiesFromHandle`, `cuMemRelease`:
    /// `Some(device ordinal of the physical memory)` when `ptr` lies in a VMM mapping (made here
    /// or imported from another process), `None` otherwise.
    ///
    /// # Safety
    /// `ptr` must be a device address of this process.
    pub(crate) unsafe fn location(ptr: sys::CUdeviceptr) -> Option<i32> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer valid; the driver only reads the address value.
        let rc = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut c_void) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        // SAFETY: `handle` was retained by the successful call above.
        let props = unsafe { allocation_props(handle) };
        // SAFETY: `handle` was retained above; release our reference.
        let _ = unsafe { sys::cuMemRelease(handle) };
        Some(props.map(|p| location_id(&p.location)).unwrap_or(-1))
    }

    /// Allocation properties of pinned device memory on `ordinal` exportable as a POSIX fd.
    pub(crate) fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct (ints, a null pointer) for which all-zero
        // is the documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = device_location(ordinal);
        prop
    }

    /// `cuMemGetAllocationGranularity(&g, prop, MINIMUM)`.
    pub(crate) fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
        let mut g: usize = 0;
        // SAFETY: out-pointer and `prop` valid for the call.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(g.max(1))
    }

    /// `cuMemCreate(&h, size, prop, 0)`: physical memory, released with [`release`].
    pub(crate) fn create(
        size: usize,
        prop: &sys::CUmemAllocationProp,
    ) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer and `prop` valid for the call.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, size, prop, 0)
        })?;
        Ok(h)
    }

    /// `cuMemRelease`.
    ///
    /// # Safety
    /// `h` must be a handle we own (from `cuMemCreate` or `cuMemImportFromShareableHandle`),
    /// released once.
    pub(crate) unsafe fn release(h: sys::CUmemGenericAllocationHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
    }

    /// `cuMemAddressReserve(&p, size, align, 0, 0)`: a virtual range, freed with
    /// [`address_free`].
    pub(crate) fn address_reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; no fixed address requested.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, size, align, 0, 0)
        })?;
        Ok(p)
    }

    /// `cuMemAddressFree(p, size)`.
    ///
    /// # Safety
    /// `p`/`size` must be a range from `cuMemAddressReserve` with nothing mapped in it.
    pub(crate) unsafe fn address_free(p: sys::CUdeviceptr, size: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(p, size)
        })
    }

    /// `cuMemMap(p, size, 0, h, 0)`.
    ///
    /// # Safety
    /// `p`/`size` must be an unmapped part of a reserved range and `h` a live handle of at least
    /// `size` bytes.
    pub(crate) unsafe fn map(
        p: sys::CUdeviceptr,
        size: usize,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemMap", unsafe { sys::cuMemMap(p, size, 0, h, 0) })
    }

    /// `cuMemUnmap(p, size)`.
    ///
    /// # Safety
    /// `p`/`size` must be a mapping made by `cuMemMap` that no queued work still uses.
    pub(crate) unsafe fn unmap(p: sys::CUdeviceptr, size: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(p, size) })
    }

    /// `cuMemExportToShareableHandle(&fd, h, POSIX_FILE_DESCRIPTOR, 0)`: a fresh fd the caller owns.
    ///
    /// # Safety
    /// `h` must be a live handle created with the POSIX fd handle type requested.
    pub(crate) unsafe fn export_fd(h: sys::CUmemGenericAllocationHandle) -> Result<c_int> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX fds the handle out-pointer points to an int; the caller's contract.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut c_int as *mut c_void,
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(fd)
    }

    /// `cuMemImportFromShareableHandle(&h, (void*)(uintptr_t)fd, POSIX_FILE_DESCRIPTOR)`.
    ///
    /// # Safety
    /// `fd` must be an open descriptor (the driver checks it is an exported allocation).
    pub(crate) unsafe fn import_fd(fd: c_int) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX fds the handle argument is the fd value cast to a pointer (cuda.h).
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(h)
    }

    /// `cuMemGetAllocationPropertiesFromHandle`.
    ///
    /// # Safety
    /// `h` must be a live allocation handle.
    pub(crate) unsafe fn allocation_props(
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<sys::CUmemAllocationProp> {
        // SAFETY: all-zero is a valid CUmemAllocationProp (see `vmm_prop`); the driver fills it.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer valid; the caller's contract on `h`.
        check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, h)
        })?;
        Ok(prop)
    }
}

/// `CUmemoryPool`: stream-ordered pools, their access and IPC.
pub(crate) mod mem_pool {
    use super::*;
    use std::mem::MaybeUninit;

    /// `cuMemPoolSetAccess(pool, {DEVICE accessor, flags}, 1)`.
    ///
    /// # Safety
    /// `pool` must be a live memory pool.
    pub(crate) unsafe fn set_access(
        pool: sys::CUmemoryPool,
        accessor: i32,
        flags: sys::CUmemAccess_flags,
    ) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: device_location(accessor),
            flags,
        };
        // SAFETY: `desc` is one valid descriptor; the caller guarantees `pool` is live.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool, &desc, 1)
        })
    }

    /// `cuMemPoolGetAccess(&flags, pool, {DEVICE accessor})`.
    ///
    /// # Safety
    /// `pool` must be a live memory pool.
    pub(crate) unsafe fn get_access(
        pool: sys::CUmemoryPool,
        accessor: i32,
    ) -> Result<sys::CUmemAccess_flags> {
        let mut loc = device_location(accessor);
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: out-pointers are valid; the caller guarantees `pool` is live.
        check("cuMemPoolGetAccess", unsafe {
            sys::cuMemPoolGetAccess(&mut flags, pool, &mut loc)
        })?;
        Ok(flags)
    }

    /// `cuMemPoolCreate` for a device pool exportable as a POSIX file descriptor.
    pub(crate) fn create_exportable(ordinal: i32) -> Result<sys::CUmemoryPool> {
        // SAFETY: CUmemPoolProps is a plain C struct for which all-zero is the documented default.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        props.location = device_location(ordinal);
        let mut pool = MaybeUninit::uninit();
        // SAFETY: out-pointer valid; `props` fully initialised.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props)
        })?;
        // SAFETY: written by the successful call.
        Ok(unsafe { pool.assume_init() })
    }

    /// `cuMemPoolDestroy`.
    ///
    /// # Safety
    /// `pool` must be a live pool created or imported by this process.
    pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
    }

    /// `cuMemAllocFromPoolAsync`.
    ///
    /// # Safety
    /// `pool` and `stream` must be live.
    pub(crate) unsafe fn alloc_async(
        bytes: usize,
        pool: sys::CUmemoryPool,
        stream: sys::CUstream,
    ) -> Result<sys::CUdeviceptr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the caller's contract.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(&mut p, bytes.max(1), pool, stream)
        })?;
        Ok(p)
    }

    /// `cuMemPoolExportToShareableHandle(&fd, pool, POSIX_FILE_DESCRIPTOR, 0)`.
    ///
    /// # Safety
    /// `pool` must be a live pool created with the POSIX fd handle type.
    pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<c_int> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX fds the handle out-pointer points to an int; the caller's contract.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                &mut fd as *mut c_int as *mut c_void,
                pool,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(fd)
    }

    /// `cuMemPoolImportFromShareableHandle(&pool, (void*)(uintptr_t)fd, POSIX_FILE_DESCRIPTOR, 0)`.
    ///
    /// # Safety
    /// `fd` must be an open pool fd exported by `cuMemPoolExportToShareableHandle`.
    pub(crate) unsafe fn import_fd(fd: c_int) -> Result<sys::CUmemoryPool> {
        let mut pool = MaybeUninit::uninit();
        // SAFETY: for POSIX fds the handle argument is the fd value cast to a pointer (cuda.h).
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                pool.as_mut_ptr(),
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: written by the successful call.
        Ok(unsafe { pool.assume_init() })
    }

    /// `cuMemPoolExportPointer`.
    ///
    /// # Safety
    /// `p` must be a live allocation from an exportable pool.
    pub(crate) unsafe fn export_pointer(p: sys::CUdeviceptr) -> Result<[u8; 64]> {
        let mut d = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: out-pointer valid; the caller's contract.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&mut d, p)
        })?;
        Ok(d.reserved)
    }

    /// `cuMemPoolImportPointer`.
    ///
    /// # Safety
    /// `pool` must be a live imported pool.
    pub(crate) unsafe fn import_pointer(
        pool: sys::CUmemoryPool,
        data: &[u8; 64],
    ) -> Result<sys::CUdeviceptr> {
        let mut d = sys::CUmemPoolPtrExportData { reserved: *data };
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: pointers valid for the call; the caller's contract on `pool`.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&mut p, pool, &mut d)
        })?;
        Ok(p)
    }

    /// `cuMemFreeAsync` (only tests free pool memory themselves; cudarc frees its slices).
    ///
    /// # Safety
    /// `p` must be pool memory (allocated or imported) no other work still uses.
    #[cfg(test)]
    pub(crate) unsafe fn free_async(p: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(p, stream) })
    }
}

/// Legacy CUDA IPC (`cuIpcGetMemHandle` and friends).
pub(crate) mod ipc {
    use super::*;
    use std::mem::MaybeUninit;

    /// `cuIpcGetMemHandle`.
    ///
    /// # Safety
    /// `p` must be the base of a live `cuMemAlloc` allocation.
    pub(crate) unsafe fn get_mem_handle(p: sys::CUdeviceptr) -> Result<[u8; 64]> {
        let mut h = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: out-pointer valid; the caller's contract on `p`.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(h.as_mut_ptr(), p)
        })?;
        // SAFETY: written by the successful call; the handle is 64 plain bytes.
        let h = unsafe { h.assume_init() };
        Ok(h.reserved.map(|c| c as u8))
    }

    /// `cuIpcOpenMemHandle_v2(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)` in the current context.
    ///
    /// # Safety
    /// A context must be current.
    pub(crate) unsafe fn open_mem_handle(handle: &[u8; 64]) -> Result<sys::CUdeviceptr> {
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the handle is passed by value; a context is current.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(p)
    }

    /// `cuIpcCloseMemHandle`.
    ///
    /// # Safety
    /// `p` must come from `cuIpcOpenMemHandle` and no work may still use it.
    pub(crate) unsafe fn close_mem_handle(p: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(p)
        })
    }
}

/// GPUDirect RDMA support calls.
pub(crate) mod rdma {
    use super::*;

    /// `cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, scope)`.
    ///
    /// # Safety
    /// A context must be current.
    pub(crate) unsafe fn flush_gpudirect_rdma_writes(
        scope: sys::CUflushGPUDirectRDMAWritesScope,
    ) -> Result<()> {
        // SAFETY: a context is current (the caller's contract); the call takes only enum values.
        check("cuFlushGPUDirectRDMAWrites", unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                scope,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mirror writes and reads the id where cuda.h has it, whichever bindings this build uses
    /// (CI checks the 12.x layout, the 13.2+ union and the 13.4 union-with-bytes).
    #[test]
    fn device_location_has_cudas_layout() {
        for ordinal in [0, 1, 7, 1234] {
            let loc = device_location(ordinal);
            assert_eq!(location_id(&loc), ordinal);
            let device = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
            assert_eq!(loc.type_ as u32, device);
            // SAFETY: `loc` is a live, fully initialised 8-byte C struct (size asserted above).
            let raw =
                unsafe { std::slice::from_raw_parts(std::ptr::from_ref(&loc).cast::<u8>(), 8) };
            let mut expect = [0u8; 8];
            expect[..4].copy_from_slice(&device.to_ne_bytes());
            expect[4..].copy_from_slice(&ordinal.to_ne_bytes());
            assert_eq!(raw, &expect[..]);
        }
    }
}

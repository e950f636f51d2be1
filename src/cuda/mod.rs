//! The ground floor: what every room needs from CUDA and the platform, in one place.
//!
//! - The door: [`driver_version`], [`device_count`], [`context`] check that libcuda and a
//!   device exist before any cudarc call (cudarc panics when libcuda or a symbol is missing),
//!   and turn absence into typed errors.
//! - The one CUDA result layer (private): every cudarc `sys`/`result` call the crate makes is a
//!   function there, called only after the door was passed.
//! - What a pointer is: [`PointerInfo`] ([`MemoryKind`], GPUDirect-RDMA capability, pool,
//!   owning context, enclosing allocation).
//! - Device memory of our own: [`DeviceBuffer`] (`cuMemAlloc`; [`GdrBuffer`] is its
//!   GPUDirect-RDMA layout) and the [`DeviceMemory`] trait; the allocation half of
//!   [`VmmBuffer`](crate::p2p::VmmBuffer) (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`).
//! - dma-buf export of device memory ([`export_dmabuf`]; needs no NIC).
//! - A GPU's PCI bus id, NUMA node and nearby CPUs ([`device`]).
//!
//! The wings ([`p2p`](crate::p2p), [`rdma`](crate::rdma), [`storage`](crate::storage)) build on
//! this floor and never on each other.

/// The accessors every raw-allocation wrapper shares (`VmmBuffer` here, the mappings of
/// `p2p::ipc`): the memory as a cudarc slice, views, and length. The type needs a
/// `slice: CudaSlice<T>` field and cudarc's slice and view types in scope.
macro_rules! slice_accessors {
    () => {
        /// The memory as a cudarc slice (for `clone_dtoh`, `memcpy_dtod`, kernel arguments, ...).
        pub fn slice(&self) -> &CudaSlice<T> {
            &self.slice
        }

        /// An immutable view of the whole buffer.
        pub fn as_view(&self) -> CudaView<'_, T> {
            self.slice.as_view()
        }

        /// A mutable view of the whole buffer (`memcpy_htod`, `copy_peer` destinations, ...);
        /// for memory mapped from another process, writes land in the exporter's memory.
        pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
            self.slice.as_view_mut()
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.slice.len()
        }

        /// True when empty.
        pub fn is_empty(&self) -> bool {
            self.slice.len() == 0
        }
    };
}
pub(crate) use slice_accessors;

mod bits;
pub(crate) mod contexts;
mod current;
pub mod device;
pub(crate) mod dmabuf;
pub(crate) mod events;
pub(crate) mod fences;
mod memory;
pub(crate) mod ordered;
mod pointer;
pub(crate) mod result;
pub(crate) mod settle;
pub(crate) mod vmm;

pub(crate) use current::{bind, CurrentContext};
pub(crate) use memory::{
    alloc_uninit, alloc_uninit_ready, release_slice_view, wait_for_slice_writes,
};

pub use bits::AnyBitPattern;
pub use dmabuf::{export_dmabuf, host_page_size, DmaBufExport, DmaBufPlan};
pub use memory::{
    DeviceBuffer, DeviceMemory, GdrBuffer, GpuPageAligned, Layout, Plain, GPU_PAGE_SIZE,
};
pub use pointer::{pointer_info, set_sync_memops, MemoryKind, PointerInfo};

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::error::{Error, Result};

/// The lowest driver API version gpudirect calls into (CUDA 12.0: `cuMemGetHandleForAddressRange`,
/// pools, `cuDeviceGetP2PAttribute` all present).
pub const MIN_DRIVER_VERSION: i32 = 12000;

// The CUDA API version of the bindings cudarc was built with. cudarc chooses it itself (the
// program's `cuda-*` feature, `CUDARC_CUDA_VERSION` or nvcc), so this constant, not a feature of
// ours, is what gpudirect knows. Headers before 11.7 lack the dma-buf export the RDMA room uses.
const _: () = assert!(
    sys::CUDA_VERSION >= 11070,
    "gpudirect needs cudarc's CUDA bindings 11.7 or newer (cuMemGetHandleForAddressRange): pick a newer `cuda-*` feature (cudarc's or gpudirect's) or set CUDARC_CUDA_VERSION, e.g. 12080"
);

/// The CUDA versions cudarc 0.19 has bindings for that gpudirect builds with: its `cuda-*`
/// features from 11.7 on, which gpudirect forwards (a test checks this list against Cargo.toml).
const BINDINGS: &[i32] = &[
    11070, 11080, 12000, 12010, 12020, 12030, 12040, 12050, 12060, 12080, 12090, 13000, 13010,
    13020, 13030, 13040,
];

/// What probing libcuda found, cached for the process.
#[derive(Debug, Clone)]
enum Probe {
    Ready {
        version: i32,
    },
    Missing {
        tried: Vec<String>,
    },
    TooOld {
        version: i32,
    },
    /// The driver's major version is below the bindings' (CUDA runs a program built for a newer
    /// minor release of its major, not for a newer major: cudarc would call symbols it lacks).
    OlderThanBindings {
        version: i32,
    },
    InitFailed {
        code: sys::CUresult,
    },
}

fn probe() -> &'static Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(|| {
        let tried = result::driver::libcuda_candidates();
        if !result::driver::is_present(&tried) {
            return Probe::Missing { tried };
        }
        // libcuda is loadable, so cudarc's own loader will not panic. cuDriverGetVersion has
        // existed since CUDA 2.2, cuInit since 2.0.
        let version = match result::driver::version() {
            Ok(v) => v,
            Err(code) => return Probe::InitFailed { code },
        };
        if version < MIN_DRIVER_VERSION {
            return Probe::TooOld { version };
        }
        if version / 1000 < sys::CUDA_VERSION as i32 / 1000 {
            return Probe::OlderThanBindings { version };
        }
        match result::driver::init() {
            Ok(()) => Probe::Ready { version },
            Err(code) => Probe::InitFailed { code },
        }
    })
}

/// The CUDA driver API version (`cuDriverGetVersion`, e.g. 13000 for CUDA 13.0), after checking
/// that libcuda loads and `cuInit` succeeds.
///
/// Errors: [`Error::LibraryUnavailable`] without libcuda, [`Error::NoDevice`] when the driver
/// finds no GPU, [`Error::Unsupported`] for a driver older than [`MIN_DRIVER_VERSION`].
pub fn driver_version() -> Result<i32> {
    match probe() {
        Probe::Ready { version } => Ok(*version),
        Probe::Missing { tried } => Err(Error::LibraryUnavailable {
            name: "libcuda.so.1",
            tried: tried.clone(),
            hint: "install the NVIDIA driver (libcuda ships with it) or add its directory to LD_LIBRARY_PATH".into(),
        }),
        Probe::TooOld { version } => Err(Error::Unsupported {
            what: "this CUDA driver".into(),
            cause: crate::Cause::Other {
                message: format!(
                    "driver API {}.{} is older than the {}.{} gpudirect needs",
                    version / 1000,
                    version % 1000 / 10,
                    MIN_DRIVER_VERSION / 1000,
                    MIN_DRIVER_VERSION % 1000 / 10
                ),
                fix: "update the NVIDIA driver".into(),
            },
        }),
        Probe::OlderThanBindings { version } => Err(Error::Unsupported {
            what: "this CUDA driver".into(),
            cause: crate::Cause::Other {
                message: format!(
                    "driver API {} is older than the major version of cudarc's CUDA {} bindings this program was built with",
                    version_text(*version),
                    version_text(sys::CUDA_VERSION as i32)
                ),
                fix: match BINDINGS.iter().rev().find(|&&b| b <= *version) {
                    Some(b) => format!(
                        "update the NVIDIA driver, or rebuild with CUDA {} bindings: CUDARC_CUDA_VERSION={b} or the cuda-{b} feature",
                        version_text(*b)
                    ),
                    None => "update the NVIDIA driver".into(),
                },
            },
        }),
        Probe::InitFailed { code } => {
            if *code == sys::CUresult::CUDA_ERROR_NO_DEVICE {
                Err(Error::NoDevice {
                    what: "CUDA GPU".into(),
                    detail: "cuInit found no device: check nvidia-smi and CUDA_VISIBLE_DEVICES".into(),
                })
            } else {
                Err(Error::cuda("cuInit", cudarc::driver::DriverError(*code)))
            }
        }
    }
}

/// `12080` -> `12.8`.
fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// Number of CUDA devices visible to this process (0 is an error: [`Error::NoDevice`]).
pub fn device_count() -> Result<usize> {
    driver_version()?;
    let n = result::device::count()?;
    if n <= 0 {
        return Err(Error::NoDevice {
            what: "CUDA GPU".into(),
            detail: "cuDeviceGetCount returned 0: check nvidia-smi and CUDA_VISIBLE_DEVICES".into(),
        });
    }
    Ok(n as usize)
}

/// Checks that `ordinal` names an existing device.
pub fn check_ordinal(ordinal: usize) -> Result<()> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: format!("CUDA GPU with ordinal {ordinal}"),
            detail: format!("this process sees {n} device(s), ordinals 0..{}", n - 1),
        });
    }
    Ok(())
}

/// cudarc's `CudaContext::new(ordinal)` (the device's primary context), behind the checks above:
/// never panics for a missing library or device.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    check_ordinal(ordinal)?;
    CudaContext::new(ordinal).map_err(|e| Error::cuda("cuDevicePrimaryCtxRetain", e))
}

/// A stream of `ctx`'s context for gpudirect's own work (the storage engine's ring and worker
/// lanes, small transfers' side streams, peer-copy lanes), created through [`own_object`].
/// cudarc's `CudaContext::new_stream` synchronizes the whole context (`cuCtxSynchronize`) when it creates
/// the first stream of an object that tracks events, as an object used only through
/// `default_stream()` is: inside a transfer that would wait for every other stream's work in
/// the process.
pub(crate) fn own_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    // cudarc binds the context it creates the stream in: put back what was.
    let _restore = CurrentContext::save();
    own_object(ctx)
        .new_stream()
        .map_err(|e| Error::cuda("cuStreamCreate", e))
}

/// gpudirect's own `CudaContext` object for `ctx`'s context, whose event tracking is off (made
/// once per context and kept for the process), for gpudirect's streams and events. The object
/// allocates no cudarc slice that is used on another stream than the one it was allocated on
/// (it does not track a slice's uses: cuFile's scratch buffer for a read on a storage transfer's
/// side stream is allocated, used and freed on that stream alone). `ctx` itself for a context
/// that is not its device's primary one (the per-context caches that must not keep such a
/// context alive use [`own_unpinned`]).
pub(crate) fn own_object(ctx: &Arc<CudaContext>) -> Arc<CudaContext> {
    primary_object(ctx).unwrap_or_else(|| ctx.clone())
}

/// gpudirect's own objects of device primary contexts ([`primary_object`]), each retaining its
/// context for the process.
static OWN: std::sync::Mutex<Vec<Arc<CudaContext>>> = std::sync::Mutex::new(Vec::new());

/// Unbinds the calling thread's current context (`cuCtxSetCurrent(NULL)`, through the result
/// layer) unless it is a device's primary context that gpudirect's own object retains (which
/// lives for the process). For gpudirect's own threads, once their work on a context is over
/// and before what kept the context alive for that work is dropped: a storage transfer thread
/// after each transfer ([`crate::storage::Transfer`]).
///
/// Why: cudarc's calls bind a context and leave it bound (`bind_to_thread`, as the small
/// transfers' copies, a fence's health check and the side stream's calls do on a transfer
/// thread), and a context that is not its device's primary one is destroyed by whichever thread
/// drops its last object (the caller's, once its transfers are over: gpudirect's caches no
/// longer keep it, see [`contexts`]). A thread of gpudirect's that still had it current then
/// held a destroyed context as its current one until its next transfer, whose first calls ran
/// on it: cudarc's `bind_to_thread` compares the thread's current handle with the new
/// context's and, the driver having given the new context the destroyed one's handle (it
/// commonly does), makes no `cuCtxSetCurrent`, so the calls went through the thread's binding
/// of the destroyed context; or, the handles differing, [`CurrentContext`]'s restore after
/// the side stream's creation made the destroyed handle current again, `cuCtxGetCurrent`
/// still answering it (`cuCtxSetCurrent` of a dead handle, which cuda.h leaves undefined: "no
/// API call issues using ctx"). That is how we read, from the code, the crash of a job in a new
/// non-primary context after an earlier one's died (SIGSEGV inside its first non-blocking read,
/// whatever its gate; H200, driver 580). A thread with no context current has nothing to go
/// stale: its next binding is a fresh `cuCtxSetCurrent`. A no-op without libcuda.
pub(crate) fn unbind_unretained() {
    #[cfg(test)]
    {
        let me = std::thread::current().id();
        let mut log = UNBINDS.lock().unwrap_or_else(|p| p.into_inner());
        *log.entry(me).or_insert(0) += 1;
    }
    if driver_version().is_err() {
        return;
    }
    let Some(cur) = result::ctx::current() else {
        return;
    };
    if retained_primary(cur) {
        return;
    }
    // SAFETY: null unbinds the thread's current context (cuCtxSetCurrent's documented use);
    // no handle is passed.
    let rc = unsafe { result::ctx::set_current(std::ptr::null_mut()) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        tracing::debug!(
            ?rc,
            "gpudirect: unbinding a transfer thread's context failed"
        );
    }
}

/// Whether `handle` is a device's primary context that gpudirect's own object retains (see
/// [`primary_object`]).
pub(crate) fn retained_primary(handle: sys::CUcontext) -> bool {
    OWN.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|c| c.cu_ctx() == handle)
}

/// Test hook: how many times each thread called [`unbind_unretained`].
#[cfg(test)]
static UNBINDS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<std::thread::ThreadId, usize>>,
> = std::sync::LazyLock::new(Default::default);

/// Test hook: how many times thread `id` called [`unbind_unretained`].
#[cfg(test)]
pub(crate) fn unbinds_on(id: std::thread::ThreadId) -> usize {
    UNBINDS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .copied()
        .unwrap_or(0)
}

/// gpudirect's own object for `ctx`'s context when that is its device's primary context (see
/// [`own_object`]), made once and kept for the process; `None` for any other context.
fn primary_object(ctx: &Arc<CudaContext>) -> Option<Arc<CudaContext>> {
    // cudarc's CudaContext::new binds the primary context to this thread: put back what was.
    let _restore = CurrentContext::save();
    let mut v = OWN.lock().unwrap_or_else(|p| p.into_inner());
    match v.iter().find(|c| c.cu_ctx() == ctx.cu_ctx()) {
        Some(c) => Some(c.clone()),
        // An inactive primary context cannot be `ctx`: never create one to find that out.
        None if !primary_active(ctx) => None,
        None => match CudaContext::new(ctx.ordinal()) {
            Ok(c) if c.cu_ctx() == ctx.cu_ctx() => {
                // SAFETY: a cudarc slice allocated through this object is used on the
                // stream it was allocated on alone (its allocation, uses and free are
                // ordered by that stream), so none needs cudarc's tracking across streams.
                unsafe { c.disable_event_tracking() };
                v.push(c.clone());
                Some(c)
            }
            // Not the primary context (or it could not be retained).
            _ => None,
        },
    }
}

/// gpudirect's object for a context, for a per-context cache that must not keep the context
/// alive ([`own_unpinned`]), and how the cache refers to the context.
pub(crate) struct Own {
    /// What the cache makes its events and streams through.
    pub(crate) obj: Arc<CudaContext>,
    /// The context, for the cache's [`contexts::Registry`].
    pub(crate) of: contexts::ContextRef,
}

impl Own {
    /// A stream of the context made through [`obj`](Self::obj) (the thread's current context
    /// put back; gpudirect's object tracks no events, so cudarc does not synchronize the
    /// context for its first stream).
    pub(crate) fn stream(&self) -> Result<Arc<CudaStream>> {
        let _restore = CurrentContext::save();
        self.obj
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate", e))
    }
}

/// gpudirect's object for `ctx`'s context for the caches that hold a context without keeping
/// it alive (fence pages, event pools, side streams; see [`contexts`]): for the device's
/// primary context its own object ([`own_object`]); for another context an object of
/// gpudirect's over the same handle (cudarc's `from_raw_context`, event tracking off) that
/// never destroys the context and does not touch the caller's object (its stored error, its
/// stream count: a stream made through the caller's object turns cudarc's multi-stream mode on
/// for the caller's slices, and the first one synchronizes the whole context), made once per
/// context while it lives. `ctx` may be that object itself (a side stream's context). Where
/// the object cannot be made (logged), the caller's: the caches then keep that context alive,
/// as they did before.
pub(crate) fn own_unpinned(ctx: &Arc<CudaContext>) -> Own {
    static WRAPPED: std::sync::Mutex<contexts::Registry<()>> =
        std::sync::Mutex::new(contexts::Registry::new());
    let wrapped = |r: &contexts::ContextRef| Own {
        obj: r.ours().expect("a wrapped context's").clone(),
        of: r.clone(),
    };
    if let Some((r, ())) = WRAPPED.lock().unwrap_or_else(|p| p.into_inner()).find(ctx) {
        return wrapped(r);
    }
    if let Some(obj) = primary_object(ctx) {
        return Own {
            of: contexts::ContextRef::primary(obj.cu_ctx() as usize),
            obj,
        };
    }
    let mut v = WRAPPED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((r, ())) = v.find(ctx) {
        return wrapped(r);
    }
    let obj = wrap_borrowed(ctx).unwrap_or_else(|e| {
        tracing::debug!(%e, "gpudirect: no object of its own for a non-primary context; its caches keep it alive");
        ctx.clone()
    });
    let (r, ()) = v.insert(contexts::ContextRef::other(ctx, obj), ());
    wrapped(r)
}

/// A cudarc object for `ctx`'s (live, borrowed) context that never destroys it: one strong
/// reference is leaked, so its drop (`cuCtxDestroy`, as for any object of cudarc's
/// `from_raw_context`) never runs, and the caller's object stays the context's one owner. Its
/// event tracking is off (see [`own_object`]). The thread's current context is put back.
fn wrap_borrowed(ctx: &Arc<CudaContext>) -> Result<Arc<CudaContext>> {
    let _restore = CurrentContext::save();
    // `from_raw_context` binds the context (`bind_to_thread`) once its object exists, and a
    // failed bind would drop that object, destroying the caller's context: make it current
    // first, so that its bind finds it current and changes nothing.
    // SAFETY: `ctx` (borrowed) holds its context alive.
    let rc = unsafe { result::ctx::set_current(ctx.cu_ctx()) };
    result::check("cuCtxSetCurrent", rc)?;
    if result::ctx::current() != Some(ctx.cu_ctx()) {
        return Err(Error::cuda(
            "cuCtxGetCurrent",
            cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_INVALID_CONTEXT),
        ));
    }
    // SAFETY: the handle is a live context (`ctx` holds it) of `ctx.cu_device()`. cudarc's
    // object takes it over as its owner (its drop would destroy it): it is never dropped, one
    // strong reference being leaked right below, so the caller's object stays the owner. Its
    // constructor's bind finds the context current and its own stored error none (a new
    // object), so it cannot fail after the object exists.
    let obj =
        unsafe { CudaContext::from_raw_context(ctx.ordinal(), ctx.cu_device(), ctx.cu_ctx()) }
            .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))?;
    std::mem::forget(obj.clone());
    // SAFETY: as for `own_object`'s: a slice allocated through this object is used on the
    // stream it was allocated on alone.
    unsafe { obj.disable_event_tracking() };
    Ok(obj)
}

/// Whether `ctx`'s device's primary context is active (`cuDevicePrimaryCtxGetState`; false
/// when that cannot be asked).
fn primary_active(ctx: &CudaContext) -> bool {
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: plain out-parameters for a device handle cudarc got from the driver.
    let rc = unsafe { sys::cuDevicePrimaryCtxGetState(ctx.cu_device(), &mut flags, &mut active) };
    rc == sys::CUresult::CUDA_SUCCESS && active != 0
}

/// Reads a device attribute (`cuDeviceGetAttribute`).
pub fn device_attribute(ordinal: usize, attr: sys::CUdevice_attribute) -> Result<i32> {
    check_ordinal(ordinal)?;
    result::device::attribute(result::device::get(ordinal)?, attr)
}

/// Refuses `stream` while it is capturing a CUDA graph (`cuStreamIsCapturing`):
/// [`Error::Unsupported`] naming `what`. Work enqueued on a capturing stream is captured into
/// the graph, not run, and synchronizing or querying the stream fails until the capture ends,
/// which only its owner (the caller) can do: a call that enqueues work there and waits for it
/// would wait for itself. Checked before anything is enqueued. The query runs with the
/// stream's context current (the thread's current context is put back after; an error stored
/// in the caller's cudarc object is left there, see [`CurrentContext::bind`]): a default stream
/// (a null handle) means the current context's, and the calling thread may have none. The
/// legacy default stream while a blocking stream of its context captures is refused too
/// ([`capture_refusal`]).
pub(crate) fn refuse_capturing(stream: &CudaStream, what: &str) -> Result<()> {
    let _current = CurrentContext::bind(stream.context())?;
    // SAFETY: the stream is alive (borrowed), in the current context.
    let status = unsafe { result::stream::capture_status(stream.cu_stream()) };
    capture_refusal(
        what,
        "the transfer waits for its own work on the stream, which a capture does not run",
        status,
    )
}

/// The fix a capture refusal gives. Another stream helps only as far as the capture's mode
/// allows, and CUDA does not say which mode a capture runs in (`cuStreamIsCapturing` and
/// `cuStreamGetCaptureInfo` give its status, id, graph and dependencies), so the fix names all
/// three (`cuThreadExchangeStreamCaptureMode`'s rules): during a relaxed capture nothing else
/// is restricted; during a thread-local one the capturing thread may not make the calls CUDA
/// deems unsafe in a capture (`cuMemAlloc` among them); during a global one no thread in
/// CUDA's default mode may (gpudirect's transfer and engine threads are), until it ends.
pub(crate) const CAPTURE_FIX: &str = "make the call before cuStreamBeginCapture or after \
    cuStreamEndCapture, or pass a stream that is not capturing: from any thread while the \
    capture is in CU_STREAM_CAPTURE_MODE_RELAXED, from a thread other than the capturing one \
    in CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, and not at all in CU_STREAM_CAPTURE_MODE_GLOBAL \
    (CUDA then refuses on every thread the calls it deems unsafe during a capture, such as \
    cuMemAlloc, which a transfer may make)";

/// What a call refusing capturing streams makes of a stream's capture status (`status`, from
/// `cuStreamIsCapturing`): `Ok` for a stream not capturing, else [`Error::Unsupported`] naming
/// `what`, whose cause says `message` and [`CAPTURE_FIX`]. The legacy default stream (a null handle)
/// queried while a blocking stream (one made without `CU_STREAM_NON_BLOCKING`: not cudarc's) of
/// its context captures answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and CUDA refuses work on
/// it until that capture ends: [`Error::Unsupported`] naming the legacy default stream, with
/// its own fix. Any other failed query is [`Error::Cuda`].
pub(crate) fn capture_refusal(
    what: &str,
    message: &str,
    status: std::result::Result<sys::CUstreamCaptureStatus, sys::CUresult>,
) -> Result<()> {
    match status {
        Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => Ok(()),
        Ok(_) => Err(Error::Unsupported {
            what: format!("{what} on a stream that is capturing a CUDA graph"),
            cause: crate::Cause::Other {
                message: message.into(),
                fix: CAPTURE_FIX.into(),
            },
        }),
        Err(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) => Err(Error::Unsupported {
            what: format!(
                "{what} on the legacy default stream while a blocking stream of its context is capturing a CUDA graph"
            ),
            cause: crate::Cause::Other {
                message: "work on the legacy default stream would wait for the capturing stream, \
                          which CUDA refuses until the capture ends \
                          (cuStreamIsCapturing: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)"
                    .into(),
                fix: "pass a stream of your own (CudaContext::new_stream makes non-blocking \
                      streams, which a capture leaves alone), or make the call before \
                      cuStreamBeginCapture or after cuStreamEndCapture on the capturing stream"
                    .into(),
            },
        }),
        Err(rc) => Err(Error::cuda(
            "cuStreamIsCapturing",
            cudarc::driver::DriverError(rc),
        )),
    }
}

/// Makes the calling thread, one of gpudirect's own (a storage transfer thread, an engine
/// worker), ignore CUDA graph captures that other threads run: its capture interaction mode
/// becomes thread-local (`cuThreadExchangeStreamCaptureMode`). A capture in global mode (CUDA's
/// default) otherwise makes CUDA refuse the calls it deems unsafe during a capture (event
/// queries, allocations and the like) on every other thread whose mode is global, and a refused
/// call invalidates that capture; this thread captures nothing and none of its work goes into
/// another thread's graph, so no such call of its can spoil one. Once per thread; a no-op
/// without libcuda, and a failure only logged (the thread then keeps CUDA's default mode).
pub(crate) fn ignore_other_threads_captures() {
    thread_local! {
        static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if SET.with(|s| s.get()) || driver_version().is_err() {
        return;
    }
    match result::stream::exchange_capture_mode(
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    ) {
        Ok(_) => SET.with(|s| s.set(true)),
        Err(e) => tracing::debug!(%e, "gpudirect: this thread keeps CUDA's capture mode"),
    }
}

/// [`refuse_capturing`] for each distinct stream of `streams` (a job's buffers' streams).
pub(crate) fn refuse_capturing_any<S: AsRef<CudaStream>>(
    streams: impl IntoIterator<Item = S>,
    what: &str,
) -> Result<()> {
    // By context too: every context's default stream is the null handle.
    let mut seen: Vec<(sys::CUcontext, sys::CUstream)> = Vec::new();
    for s in streams {
        let s = s.as_ref();
        let key = (s.context().cu_ctx(), s.cu_stream());
        if !seen.contains(&key) {
            refuse_capturing(s, what)?;
            seen.push(key);
        }
    }
    Ok(())
}

/// The stored-error tests' harness: on the calling thread, makes `ctx` current (no context
/// when not `bound`), stores `CUDA_ERROR_UNKNOWN` in the object (cudarc's `record_err`, any
/// error there taken first), runs `call`, and returns its result with what is wrong after it,
/// each line starting with `case`: the error gone from the object or another one stored there,
/// or the thread's current context not what it was before the call.
#[cfg(test)]
pub(crate) fn with_stored_error<R>(
    ctx: &CudaContext,
    bound: bool,
    case: &str,
    call: impl FnOnce() -> R,
) -> (R, Vec<String>) {
    use cudarc::driver::DriverError;
    // SAFETY: null unbinds; the context is alive (borrowed).
    let rc = unsafe {
        result::ctx::set_current(if bound {
            ctx.cu_ctx()
        } else {
            std::ptr::null_mut()
        })
    };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuCtxSetCurrent");
    let _ = ctx.check_err();
    ctx.record_err::<()>(Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)));
    let r = call();
    let left = ctx.check_err();
    let current = result::ctx::current();
    let mut bad = Vec::new();
    match left {
        Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)) => {}
        Err(e) => bad.push(format!("{case}: another error is stored now: {e:?}")),
        Ok(()) => bad.push(format!(
            "{case}: the caller's stored error is gone from its object"
        )),
    }
    let want = bound.then_some(ctx.cu_ctx());
    if current != want {
        bad.push(format!(
            "{case}: the thread's current context is {current:?} after the call, not {want:?}"
        ));
    }
    (r, bad)
}

/// A blocking stream of a context (`cuStreamCreate`, `CU_STREAM_DEFAULT`: the legacy default
/// stream and it wait for each other), as C code and other libraries make them and cudarc never
/// does, for tests of the legacy default stream beside its capture. Synchronized and destroyed
/// on drop; the [`CudaStream`] it lends borrows the handle (cudarc does not destroy it).
#[cfg(test)]
pub(crate) struct BlockingStream {
    stream: Arc<CudaStream>,
}

#[cfg(test)]
impl BlockingStream {
    /// A new blocking stream of `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<BlockingStream> {
        let _current = CurrentContext::bind(ctx)?;
        // SAFETY: `ctx` is current.
        let raw = unsafe { result::stream::create_blocking() }?;
        // SAFETY: `raw` is a live stream of `ctx`, alive until this value's drop, which first
        // waits for its work; the tests order their work on it themselves.
        let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok(BlockingStream { stream })
    }

    /// The stream, as cudarc's.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

#[cfg(test)]
impl Drop for BlockingStream {
    fn drop(&mut self) {
        let Ok(_current) = CurrentContext::bind(self.stream.context()) else {
            return; // leaked
        };
        let _ = self.stream.synchronize();
        // SAFETY: made by `create_blocking`, destroyed once here; the tests hold no clone of
        // the wrapper past this value (a leaked clone would only see a dead handle's errors).
        if let Err(e) = unsafe { result::stream::destroy(self.stream.cu_stream()) } {
            tracing::warn!("destroying a test's blocking stream: {e}");
        }
    }
}

/// Held by the unit tests that hold a stream with a host function (`cuLaunchHostFunc`) and
/// judge ordering by what completes meanwhile: CUDA may run every host function of the process
/// on one thread, so two such tests running at once can distort each other's timing.
#[cfg(test)]
pub(crate) static HOST_FUNCTION_GATES: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// Our libcuda probe tries exactly the libcuda names cudarc's loader tries (test builds use
    /// cudarc's dynamic loading, where its list exists), so "found" here means cudarc finds it.
    #[test]
    fn libcuda_candidates_are_cudarcs() {
        let mut theirs: Vec<String> = Vec::new();
        for name in result::driver::LIBCUDA_NAMES
            .iter()
            .flat_map(|l| cudarc::get_lib_name_candidates(l))
        {
            if !theirs.contains(&name) {
                theirs.push(name);
            }
        }
        assert_eq!(result::driver::libcuda_candidates(), theirs);
        assert!(theirs.iter().any(|n| n == "libcuda.so.1"), "{theirs:?}");
    }

    /// What a capture status makes of a call that refuses capturing streams (no driver call):
    /// a stream not capturing passes; an active or invalidated capture is `Unsupported` naming
    /// the call and the capture, with the caller's cause; a failed query is the driver's error,
    /// naming `cuStreamIsCapturing`.
    /// A refusal's result as text, through `Display` (an [`Error::Cuda`]'s `Debug` asks libcuda
    /// to describe its code, and this machine may have none).
    fn shown(r: &Result<()>) -> String {
        match r {
            Ok(()) => "Ok(())".into(),
            Err(e) => format!("Err({e})"),
        }
    }

    #[test]
    fn capture_statuses_make_their_refusals() {
        use sys::CUstreamCaptureStatus as S;
        let refusal = |status| capture_refusal("a call", "its message", status);
        assert!(refusal(Ok(S::CU_STREAM_CAPTURE_STATUS_NONE)).is_ok());
        for status in [
            S::CU_STREAM_CAPTURE_STATUS_ACTIVE,
            S::CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        ] {
            match refusal(Ok(status)) {
                Err(Error::Unsupported {
                    what,
                    cause: crate::Cause::Other { message, fix },
                }) => {
                    assert!(
                        what.starts_with("a call on a stream")
                            && what.contains("capturing a CUDA graph"),
                        "{status:?}: {what}"
                    );
                    assert_eq!(
                        (message.as_str(), fix.as_str()),
                        ("its message", CAPTURE_FIX)
                    );
                }
                other => panic!("{status:?}: {}", shown(&other)),
            }
        }
        match refusal(Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE)) {
            Err(Error::Cuda {
                op: "cuStreamIsCapturing",
                source,
            }) => assert_eq!(source.0, sys::CUresult::CUDA_ERROR_INVALID_VALUE),
            other => panic!("{}", shown(&other)),
        }
    }

    /// The legacy default stream (a null handle: cudarc's `default_stream()`) queried while a
    /// blocking stream of its context captures a graph: the driver answers
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (work there would wait for the capture, which CUDA
    /// refuses until it ends). That is a refusal of the legacy stream with a fix, not a raw
    /// driver error naming `cuStreamIsCapturing`, which does not say what to do.
    #[test]
    fn the_legacy_stream_beside_a_blocking_capture_is_refused_with_a_fix() {
        let r = capture_refusal(
            "a call",
            "its message",
            Err(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
        );
        match r {
            Err(Error::Unsupported { what, cause }) => {
                assert!(
                    what.starts_with("a call on the legacy default stream")
                        && what.contains("capturing a CUDA graph"),
                    "{what}"
                );
                let (message, fix) = (cause.what(), cause.fix());
                assert!(
                    message.contains("CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
                    "{message}"
                );
                assert!(
                    fix.contains("new_stream") && fix.contains("cuStreamEndCapture"),
                    "{fix}"
                );
            }
            other => panic!("{}", shown(&other)),
        }
    }

    /// What a capture refusal's fix must say to be right in every capture mode (CUDA does not
    /// say a capture's mode): before the capture or after it, or a stream that is not
    /// capturing, as the mode allows: any thread in relaxed mode, another thread than the
    /// capturing one in thread-local mode, and not in global mode. What it lacks, one line per
    /// finding.
    fn capture_fix_findings(fix: &str) -> Vec<String> {
        let mut bad = Vec::new();
        for (needed, why) in [
            ("before cuStreamBeginCapture", "the call before the capture"),
            ("after cuStreamEndCapture", "the call after the capture"),
            ("not capturing", "a stream that is not capturing"),
            ("CU_STREAM_CAPTURE_MODE_RELAXED", "the relaxed mode's rule"),
            (
                "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
                "the thread-local mode's rule",
            ),
            (
                "other than the capturing",
                "the thread-local mode's other thread",
            ),
            ("CU_STREAM_CAPTURE_MODE_GLOBAL", "the global mode's rule"),
            (
                "not at all",
                "that another stream does not help in global mode",
            ),
        ] {
            if !fix.contains(needed) {
                bad.push(format!("no {why} ({needed:?})"));
            }
        }
        bad
    }

    /// Review (capture modes): a capture refusal's fix used to send the caller to "another
    /// stream" unconditionally (refuse_capturing's "make the call before cuStreamBeginCapture
    /// or after cuStreamEndCapture, or on another stream"; the cuFile stream calls' "enqueue
    /// the IO outside the capture, or use synchronous reads", which a capture refuses as
    /// well), which during a global-mode capture fails on every thread and during a
    /// thread-local one on the capturing thread. The fix every refusal gives
    /// ([`CAPTURE_FIX`], through [`capture_refusal`]) names each mode's rule.
    #[test]
    fn a_capture_refusals_fix_holds_in_every_capture_mode() {
        let bad = capture_fix_findings(CAPTURE_FIX);
        assert!(bad.is_empty(), "{CAPTURE_FIX}:\n{}", bad.join("\n"));
        let r = capture_refusal(
            "a call",
            "its message",
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE),
        );
        match r {
            Err(Error::Unsupported { cause, .. }) => assert_eq!(cause.fix(), CAPTURE_FIX),
            other => panic!("{}", shown(&other)),
        }
    }

    #[test]
    fn version_text_reads_like_cuda() {
        assert_eq!(version_text(12080), "12.8");
        assert_eq!(version_text(13000), "13.0");
        assert_eq!(version_text(13040), "13.4");
    }

    /// BINDINGS lists exactly the `cuda-*` features Cargo.toml forwards, and this build's
    /// bindings are one of them.
    #[test]
    fn bindings_list_matches_the_forwarded_features() {
        let manifest = include_str!("../../Cargo.toml");
        let features: Vec<i32> = manifest
            .lines()
            .filter_map(|l| l.strip_prefix("cuda-")?.split_once(" = ")?.0.parse().ok())
            .collect();
        assert_eq!(features, BINDINGS);
        assert!(BINDINGS.contains(&(sys::CUDA_VERSION as i32)));
    }

    /// [`ignore_other_threads_captures`] leaves the calling thread in thread-local capture
    /// mode (read back by exchanging it for the global mode, then put back), on a thread of
    /// its own so that no other test's thread changes. Without libcuda it must return quietly
    /// (this test then fails in `context`, with the setup hint).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_own_threads_ignore_other_threads_captures() {
        use sys::CUstreamCaptureMode as M;
        let mode = std::thread::spawn(|| {
            ignore_other_threads_captures();
            let _ = context(0).unwrap_or_else(|e| {
                panic!("this test needs a CUDA GPU ({e}): run it on a GPU machine, see CONTRIBUTING.md")
            });
            let was = result::stream::exchange_capture_mode(M::CU_STREAM_CAPTURE_MODE_GLOBAL);
            // Called again: the thread is marked done, so it changes nothing.
            ignore_other_threads_captures();
            let now = result::stream::exchange_capture_mode(M::CU_STREAM_CAPTURE_MODE_GLOBAL);
            (was, now)
        })
        .join()
        .unwrap();
        assert_eq!(mode.0.unwrap(), M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        assert_eq!(mode.1.unwrap(), M::CU_STREAM_CAPTURE_MODE_GLOBAL);
    }

    /// Review (a stored error taken): [`refuse_capturing`] (every non-blocking call's capture
    /// check of the caller's stream, and the re-check after its fence) binds the stream's
    /// context without touching an error stored in the caller's cudarc object (one an earlier
    /// call of the caller's could not return, `record_err`): the check passes for a stream
    /// that is not capturing, and the error is still there for the caller (`check_err`), with
    /// no context current on the calling thread (the one put back is none) and with the
    /// context current already, each on a thread of its own. On the code before the fix
    /// (`CurrentContext::bind` through cudarc's `bind_to_thread`, which takes the error first)
    /// the first case failed with a `cuCtxSetCurrent` error carrying the stored code
    /// (`CUDA_ERROR_UNKNOWN`), and the error was gone from the object; the second passed.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_a_capture_check_leaves_the_callers_stored_error_alone() {
        let ctx = context(0).unwrap_or_else(|e| {
            panic!("this test needs a CUDA GPU ({e}): run it on a GPU machine, see CONTRIBUTING.md")
        });
        let stream = ctx.new_stream().unwrap();
        let mut bad = Vec::new();
        for bound in [false, true] {
            let (ctx, stream) = (ctx.clone(), stream.clone());
            let found = std::thread::spawn(move || {
                let case = if bound {
                    "the context current"
                } else {
                    "no context current"
                };
                let (r, left) =
                    with_stored_error(&ctx, bound, case, || refuse_capturing(&stream, "a call"));
                let mut bad = Vec::new();
                if let Err(e) = &r {
                    bad.push(format!(
                        "{case}: the check of a stream that is not capturing failed: {e}"
                    ));
                }
                bad.extend(left);
                bad
            })
            .join()
            .unwrap();
            bad.extend(found);
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    /// What this machine is told to have: `GPUDIRECT_EXPECT_CUDA=absent|present|nodevice`
    /// (absent by default: CI and the dev machine have no NVIDIA driver).
    #[test]
    fn probe_matches_expectation() {
        let expect = std::env::var("GPUDIRECT_EXPECT_CUDA").unwrap_or_else(|_| "absent".into());
        let got = driver_version();
        match expect.as_str() {
            "absent" => match got {
                Err(Error::LibraryUnavailable { name, tried, .. }) => {
                    assert_eq!(name, "libcuda.so.1");
                    assert!(tried.iter().any(|t| t.contains("libcuda.so")), "{tried:?}");
                    // No panic on the ordinal paths either.
                    assert!(matches!(context(0), Err(Error::LibraryUnavailable { .. })));
                    let msg = driver_version().unwrap_err().to_string();
                    assert!(msg.contains("install the NVIDIA driver"), "{msg}");
                }
                other => panic!(
                    "expected LibraryUnavailable (GPUDIRECT_EXPECT_CUDA=absent), got {other:?}"
                ),
            },
            "nodevice" => assert!(matches!(got, Err(Error::NoDevice { .. })), "{got:?}"),
            "present" => {
                let v = got.expect("GPUDIRECT_EXPECT_CUDA=present but the driver probe failed");
                assert!(v >= MIN_DRIVER_VERSION);
                let n = device_count().unwrap();
                assert!(matches!(check_ordinal(n), Err(Error::NoDevice { .. })));
            }
            other => panic!("GPUDIRECT_EXPECT_CUDA must be absent|present|nodevice, not {other}"),
        }
    }
}

//! What each worker owns across jobs: two bounce buffers and, per CUDA context it served, a
//! stream with one event per buffer.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::bounce::BounceBuf;
use crate::cuda::settle::{settle, Patience, Settled};
use crate::error::{Error, Result};

/// A worker's stream and buffer events in one CUDA context.
pub(in crate::storage) struct Lane {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// `events[i]` is recorded after the last copy that used bounce buffer `i`.
    pub events: [CudaEvent; 2],
    /// Whether `events[i]` guards a copy not yet waited for.
    pub busy: [bool; 2],
}

impl Lane {
    fn new(ctx: &Arc<CudaContext>) -> Result<Lane> {
        let stream = crate::cuda::own_stream(ctx)?;
        // Through gpudirect's own object, as the stream: cudarc's new_event binds through the
        // object it is called on (bind_to_thread), which would take an error stored in the
        // caller's.
        let own = crate::cuda::own_object(ctx);
        let ev = || {
            own.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| Error::cuda("cuEventCreate", e))
        };
        Ok(Lane {
            ctx: ctx.clone(),
            stream,
            events: [ev()?, ev()?],
            busy: [false; 2],
        })
    }

    /// Waits until bounce buffer `i` is free of in-flight copies.
    pub fn wait_slot(&mut self, i: usize) -> Result<()> {
        if self.busy[i] {
            self.events[i]
                .synchronize()
                .map_err(|e| Error::cuda("cuEventSynchronize", e))?;
            self.busy[i] = false;
        }
        Ok(())
    }

    /// Marks bounce buffer `i` as used by the copies enqueued so far.
    pub fn record_slot(&mut self, i: usize) -> Result<()> {
        self.events[i]
            .record(&self.stream)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        self.busy[i] = true;
        Ok(())
    }

    /// Waits for every copy on the lane's stream (binding its context itself, through the
    /// result layer: [`crate::cuda::settle::synchronize`], so that an error an earlier call
    /// left in a cudarc context object does not fail the drain).
    pub fn drain(&mut self) -> Result<()> {
        let r = crate::cuda::settle::synchronize(&self.stream);
        if r.is_ok() {
            self.busy = [false; 2];
        }
        r
    }

    /// After a failed [`drain`](Self::drain): what the copies on the lane's stream can still
    /// do, asked through `query(context, stream)` (`cuStreamQuery`;
    /// [`crate::cuda::settle::settle`] with `patience`). A lane found idle is free again.
    pub fn settle(
        &mut self,
        patience: Patience,
        mut query: impl FnMut(sys::CUcontext, sys::CUstream) -> sys::CUresult,
    ) -> Settled {
        let (ctx, stream) = (self.ctx.cu_ctx(), self.stream.cu_stream());
        let s = settle(
            1,
            |_| query(ctx, stream),
            patience,
            "an IO worker's copy stream",
        );
        if s == Settled::Complete {
            self.busy = [false; 2];
        }
        s
    }
}

/// `cuStreamQuery` of `stream` in `ctx` ([`crate::cuda::settle::query_stream`]).
///
/// # Safety
/// `stream` must be a live stream of the live context `ctx`.
pub(in crate::storage) unsafe fn query(
    ctx: sys::CUcontext,
    stream: sys::CUstream,
) -> sys::CUresult {
    // SAFETY: the caller's contract.
    unsafe { crate::cuda::settle::query_stream(ctx, stream) }
}

#[cfg(test)]
static LANES_DROPPED_BUSY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Test hook: lanes dropped while their stream still had work queued.
#[cfg(test)]
pub(in crate::storage) fn lanes_dropped_busy() -> usize {
    LANES_DROPPED_BUSY.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(test)]
impl Drop for Lane {
    fn drop(&mut self) {
        let _ = crate::cuda::bind(&self.ctx);
        // SAFETY: the lane's stream is alive (dropped after this) in its bound context.
        if !unsafe { crate::cuda::result::stream::is_idle(self.stream.cu_stream()) } {
            LANES_DROPPED_BUSY.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// State a worker keeps between jobs.
pub(in crate::storage) struct WorkerState {
    /// Index of the worker in its pool.
    pub id: usize,
    pub slots: [Option<BounceBuf>; 2],
    /// Page-locked bounce buffers replaced by larger ones, freed with the state (never during a
    /// job: `cuMemHostUnregister` waits for all the context's work). A replacement is at least
    /// twice the size it replaces (see `ensure_slot`), so this holds a few buffers of less than
    /// the current one's size in all.
    pub retired: Vec<BounceBuf>,
    pub lanes: Vec<Lane>,
    /// Test hook: stands for a copy enqueued and not yet waited for.
    #[cfg(test)]
    pub test_in_flight: bool,
    /// Test hook: [`quiesce`](Self::quiesce) fails.
    #[cfg(test)]
    pub test_drain_fails: bool,
}

#[cfg(test)]
static DROPPED_IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Test hook: worker states dropped while a (simulated) copy was in flight.
#[cfg(test)]
pub(in crate::storage) fn dropped_in_flight() -> usize {
    DROPPED_IN_FLIGHT.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(test)]
impl Drop for WorkerState {
    fn drop(&mut self) {
        if self.test_in_flight {
            DROPPED_IN_FLIGHT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl WorkerState {
    pub fn new(id: usize) -> Self {
        WorkerState {
            id,
            slots: [None, None],
            retired: Vec::new(),
            lanes: Vec::new(),
            #[cfg(test)]
            test_in_flight: false,
            #[cfg(test)]
            test_drain_fails: false,
        }
    }

    /// Waits for every copy on every lane (after a panic, before freeing or reusing the
    /// buffers); a lane whose synchronize fails is settled with `patience`
    /// ([`Lane::settle`]). The first drain error of a lane whose copies are not known complete
    /// (its context is dead, or they may still run: `UntilUnknown` only): a copy may still name the
    /// buffers, so the caller must leak this state.
    pub fn quiesce(&mut self, patience: Patience) -> Result<()> {
        #[cfg(test)]
        {
            if self.test_drain_fails {
                return Err(Error::cuda(
                    "cuStreamSynchronize",
                    cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED),
                ));
            }
            self.test_in_flight = false;
        }
        let mut first = None;
        for lane in &mut self.lanes {
            if let Err(e) = lane.drain() {
                // SAFETY: the lane's stream is alive (the lane owns it) in its live context.
                if lane.settle(patience, |c, s| unsafe { query(c, s) }) != Settled::Complete {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Makes bounce buffer `i` at least `size` bytes (and page-locked when `register`).
    pub fn ensure_slot(&mut self, i: usize, size: usize, register: bool) -> Result<()> {
        let fits = matches!(&self.slots[i], Some(b) if b.len() >= size && (b.is_registered() || !register));
        if !fits {
            // Never replace a buffer a copy may still read: lanes are drained at job end. A
            // page-locked one is kept until the state goes (unregistering it would wait for
            // all the context's work, other streams' kernels included).
            // A replacement rounds up to a power of two, so replacements at least double.
            let size = match self.slots[i].take() {
                Some(old) => {
                    let want = size.max(old.len()).next_power_of_two();
                    if old.is_registered() {
                        self.retired.push(old);
                    }
                    want
                }
                None => size,
            };
            let mut b = BounceBuf::new(size)?;
            if register {
                b.register()?;
            }
            self.slots[i] = Some(b);
        }
        Ok(())
    }

    /// Pointer to bounce buffer `i` (after [`ensure_slot`](Self::ensure_slot)).
    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
        self.slots[i]
            .as_ref()
            .map(|b| b.ptr())
            .unwrap_or(std::ptr::null_mut())
    }

    /// The lane for `ctx`, created on first use; binds `ctx` to the calling thread.
    pub fn lane(&mut self, ctx: &Arc<CudaContext>) -> Result<usize> {
        crate::cuda::bind(ctx).map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        if let Some(i) = self
            .lanes
            .iter()
            .position(|l| Arc::ptr_eq(&l.ctx, ctx) || l.ctx.cu_ctx() == ctx.cu_ctx())
        {
            return Ok(i);
        }
        self.lanes.push(Lane::new(ctx)?);
        Ok(self.lanes.len() - 1)
    }
}

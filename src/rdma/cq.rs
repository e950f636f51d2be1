//! Completion queues (`ibv_create_cq`) and completion channels (`ibv_create_comp_channel`).

use std::collections::VecDeque;
use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ibverbs_gdr_sys as sys;

use super::context::Context;
use super::qp::HELPER_WR_ID_BIT;
use super::result;
use super::wc::WorkCompletion;
use crate::error::{Error, Result};

/// A completion channel (`struct ibv_comp_channel`): a file descriptor that becomes readable
/// when a CQ attached to it, armed with [`CompletionQueue::req_notify`], gets a completion.
/// Use its fd with poll/epoll for event-driven waiting.
pub struct CompletionChannel {
    raw: NonNull<sys::ibv_comp_channel>,
    ctx: Arc<Context>,
}

// SAFETY: verbs are thread-safe (rdma-core libibverbs.md).
unsafe impl Send for CompletionChannel {}
// SAFETY: see Send.
unsafe impl Sync for CompletionChannel {}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

impl CompletionChannel {
    /// Creates a channel (`ibv_create_comp_channel`).
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompletionChannel>> {
        // SAFETY: the context is live (we hold an Arc).
        let raw = unsafe { result::create_comp_channel(ctx.lib(), ctx.as_ptr()) }?;
        Ok(Arc::new(CompletionChannel {
            raw,
            ctx: ctx.clone(),
        }))
    }

    /// Makes `ibv_get_cq_event` on this channel non-blocking (`O_NONBLOCK` on the fd), for use
    /// with an event loop.
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        let fd = self.as_raw_fd();
        // SAFETY: fcntl on an fd this channel owns.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(Error::io("fcntl", None, std::io::Error::last_os_error()));
        }
        let new = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, new) } < 0 {
            return Err(Error::io("fcntl", None, std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is live while `self` is; `fd` is never changed by libibverbs.
        unsafe { self.raw.as_ref().fd }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ on this channel holds an Arc of it, so none is left; destroyed once.
        if let Err(e) = unsafe { result::destroy_comp_channel(self.ctx.lib(), self.raw) } {
            tracing::warn!(error = %e, "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion queue (`struct ibv_cq`). Queue pairs hold an `Arc` of their CQs.
///
/// The post-and-wait helpers (e.g. [`QueuePair::write`](super::QueuePair::write)) and
/// [`poll`](Self::poll) may share a CQ, from any threads: each completion goes to whoever it
/// belongs to. A helper that reads a completion of someone else's work request keeps it for
/// the next [`poll`](Self::poll); `poll` never returns a helper's completion (its `wr_id` has
/// [`HELPER_WR_ID_BIT`] set) but keeps it for the helper waiting on it.
pub struct CompletionQueue {
    raw: NonNull<sys::ibv_cq>,
    parked: Mutex<Parked>,
    channel: Option<Arc<CompletionChannel>>,
    ctx: Arc<Context>,
    /// Test seam: the next this-many polls fail as `ibv_poll_cq` errors (EIO).
    #[cfg(test)]
    pub(in crate::rdma) fail_polls: std::sync::atomic::AtomicU32,
}

/// Completions read by one party but meant for another.
#[derive(Default)]
struct Parked {
    /// For [`CompletionQueue::poll`], in arrival order.
    user: VecDeque<WorkCompletion>,
    /// For the helpers, by work-request id (unique per process).
    helper: Vec<WorkCompletion>,
}

impl Parked {
    fn park(&mut self, wc: WorkCompletion) {
        if wc.wr_id & HELPER_WR_ID_BIT != 0 {
            self.helper.push(wc);
        } else {
            self.user.push_back(wc);
        }
    }
}

// SAFETY: libibverbs is thread-safe ("all verbs are thread safe", rdma-core
// Documentation/libibverbs.md; ibv_poll_cq takes the CQ's lock in every provider); the Rust
// state is behind a Mutex, and `cqe` (read by `capacity`) is written once at creation.
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send.
unsafe impl Sync for CompletionQueue {}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.capacity())
            .field("channel", &self.channel)
            .finish()
    }
}

impl CompletionQueue {
    /// Creates a CQ with room for at least `cqe` completions (`ibv_create_cq`).
    pub fn new(ctx: &Arc<Context>, cqe: u32) -> Result<Arc<CompletionQueue>> {
        Self::create(ctx, cqe, None)
    }

    /// Creates a CQ attached to a completion channel, for event-driven waiting.
    pub fn with_channel(
        ctx: &Arc<Context>,
        cqe: u32,
        channel: &Arc<CompletionChannel>,
    ) -> Result<Arc<CompletionQueue>> {
        Self::create(ctx, cqe, Some(channel.clone()))
    }

    fn create(
        ctx: &Arc<Context>,
        cqe: u32,
        channel: Option<Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let cqe = i32::try_from(cqe.max(1))
            .map_err(|_| Error::InvalidArgument("CQ size must fit in an int".into()))?;
        let ch = channel
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.raw.as_ptr());
        // SAFETY: the context and channel are live (we hold Arcs).
        let raw = unsafe { result::create_cq(ctx.lib(), ctx.as_ptr(), cqe, ch, 0) }?;
        Ok(Arc::new(CompletionQueue {
            raw,
            parked: Mutex::new(Parked::default()),
            channel,
            ctx: ctx.clone(),
            #[cfg(test)]
            fail_polls: std::sync::atomic::AtomicU32::new(0),
        }))
    }

    /// The number of entries the provider allocated (≥ the size asked for).
    pub fn capacity(&self) -> u32 {
        // SAFETY: the CQ is live; `cqe` is set at creation.
        unsafe { self.raw.as_ref().cqe.max(0) as u32 }
    }

    /// The completion channel, if any.
    pub fn channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.channel.as_ref()
    }

    pub(in crate::rdma) fn as_ptr(&self) -> NonNull<sys::ibv_cq> {
        self.raw
    }

    pub(in crate::rdma) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn parked(&self) -> std::sync::MutexGuard<'_, Parked> {
        // Nothing panics while holding the lock; a poisoned lock still holds consistent data.
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `ibv_poll_cq` into `raw`; the completions it read, decoded.
    fn poll_raw<'w>(
        &self,
        raw: &'w mut [MaybeUninit<sys::ibv_wc>],
    ) -> Result<impl Iterator<Item = WorkCompletion> + 'w> {
        #[cfg(test)]
        if self
            .fail_polls
            .fetch_update(
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
                |n| n.checked_sub(1),
            )
            .is_ok()
        {
            return Err(Error::Verbs {
                op: "ibv_poll_cq (injected)",
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        // SAFETY: the CQ is live while `self` is.
        let got = unsafe { result::poll_cq(self.raw, raw) }?;
        Ok(raw[..got].iter().map(|r| {
            // SAFETY: ibv_poll_cq initialised the first `got` entries.
            WorkCompletion::from_raw(unsafe { r.assume_init_ref() })
        }))
    }

    /// Reads up to `out.len()` completions without blocking (`ibv_poll_cq`); returns how many
    /// were written. Error statuses are returned as completions: check
    /// [`WorkCompletion::ok`]. Completions of the post-and-wait helpers are never returned
    /// (they stay for the helper), so this may return fewer than are queued, or 0.
    ///
    /// Errors: [`Error::Verbs`] when `ibv_poll_cq` fails before any completion was written
    /// (completions already written are returned first; the error comes with the next call).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut n = 0;
        {
            let mut p = self.parked();
            while n < out.len() {
                match p.user.pop_front() {
                    Some(wc) => {
                        out[n] = wc;
                        n += 1;
                    }
                    None => break,
                }
            }
        }
        let mut raw = [const { MaybeUninit::<sys::ibv_wc>::uninit() }; 64];
        while n < out.len() {
            let want = (out.len() - n).min(raw.len());
            let got = match self.poll_raw(&mut raw[..want]) {
                Ok(it) => it,
                Err(_) if n > 0 => break,
                Err(e) => return Err(e),
            };
            let mut read = 0;
            let mut p = None;
            for wc in got {
                read += 1;
                if wc.wr_id & HELPER_WR_ID_BIT != 0 {
                    p.get_or_insert_with(|| self.parked()).helper.push(wc);
                } else {
                    out[n] = wc;
                    n += 1;
                }
            }
            if read < want {
                break; // the CQ is empty
            }
        }
        Ok(n)
    }

    /// Waits (busy-polling, then yielding, then sleeping) until `deadline` for the completion
    /// of the helper work request `wr_id`, parking every other completion for its owner.
    /// `Ok(None)` at the deadline.
    pub(in crate::rdma) fn wait_helper(
        &self,
        wr_id: u64,
        deadline: Instant,
    ) -> Result<Option<WorkCompletion>> {
        debug_assert!(wr_id & HELPER_WR_ID_BIT != 0);
        let start = Instant::now();
        let mut raw = [const { MaybeUninit::<sys::ibv_wc>::uninit() }; 16];
        loop {
            {
                let mut p = self.parked();
                if let Some(i) = p.helper.iter().position(|w| w.wr_id == wr_id) {
                    return Ok(Some(p.helper.swap_remove(i)));
                }
            }
            let mut found = None;
            let mut p = None;
            for wc in self.poll_raw(&mut raw)? {
                if wc.wr_id == wr_id && found.is_none() {
                    found = Some(wc);
                } else {
                    p.get_or_insert_with(|| self.parked()).park(wc);
                }
            }
            if found.is_some() {
                return Ok(found);
            }
            drop(p);
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // Busy-poll first (completions usually come within microseconds), then yield the
            // core, and only sleep for waits that are long anyway: sleeping early costs a
            // timer tick of latency.
            let waited = now - start;
            if waited < Duration::from_micros(20) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion (or the next solicited one)
    /// raises an event on the channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is live while `self` is.
        unsafe { result::req_notify_cq(self.raw, solicited_only) }
    }

    /// Blocks until the channel reports an event for this CQ (`ibv_get_cq_event`), and
    /// acknowledges it (`ibv_ack_cq_events`). Arm the CQ with [`req_notify`](Self::req_notify)
    /// first, then poll after this returns, and re-arm. With a non-blocking channel, returns
    /// [`Error::Verbs`] with `EAGAIN` when no event is pending.
    pub fn wait_event(&self) -> Result<()> {
        let ch = self.channel.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "this CQ has no completion channel: create it with CompletionQueue::with_channel"
                    .into(),
            )
        })?;
        // SAFETY: the channel is live (we hold an Arc).
        let cq = unsafe { result::get_cq_event(self.ctx.lib(), ch.raw) }?;
        let cq = NonNull::new(cq).unwrap_or(self.raw);
        // SAFETY: the event names a CQ of this channel; ack exactly the one event we got.
        unsafe { result::ack_cq_events(self.ctx.lib(), cq, 1) };
        if cq != self.raw {
            return Err(Error::InvalidArgument(
                "the completion channel is shared: the event belonged to another CQ; wait on the channel's CQs from one place".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of it, so none is left; destroyed once.
        // All events obtained by wait_event were acknowledged there.
        if let Err(e) = unsafe { result::destroy_cq(self.ctx.lib(), self.raw) } {
            tracing::warn!(error = %e, "ibv_destroy_cq failed");
        }
    }
}

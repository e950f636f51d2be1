//! Bandwidth and latency between GPU pairs, measured like nvbandwidth: copy-engine (CE) copies
//! one way and both ways at once (one stream per GPU), SM copies (a kernel reading or writing
//! peer memory with 16-byte vector loads, grid-stride, enough blocks to fill every SM), and
//! small-transfer latency (8-byte CE copies back to back; an SM pointer chase through peer
//! memory). Rates are GB/s = 10^9 bytes/s, timed with CUDA events; results are medians.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use serde::Serialize;

use super::copy;
use super::peer_access::PeerAccess;
use crate::cuda::result as r;
use crate::error::{Error, Result};
use crate::path::Link;

/// The H200 NVLink limit per direction: 18 links × 26.5625 GB/s (nvidia-smi nvlink -s).
pub(in crate::p2p) const LINK_LIMIT_H200_GBPS: f64 = 18.0 * 26.5625;

/// The copy/latency kernels (src/p2p/kernels.cu compiled to PTX; see scripts/regen-p2p-ptx.py).
const KERNELS_PTX: &str = include_str!("kernels.ptx");

/// Which side of an SM copy runs the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SmDirection {
    /// The destination GPU's SMs read the source GPU's memory.
    Read,
    /// The source GPU's SMs write the destination GPU's memory.
    Write,
}

/// What to measure with.
#[derive(Debug, Clone, Copy)]
pub struct BandwidthOptions {
    /// Bytes per copy (a multiple of 16; nvbandwidth's default is 512 MiB).
    pub bytes: usize,
    /// Copies per timed sample.
    pub iterations: usize,
    /// Samples; the median is reported.
    pub repetitions: usize,
    /// Hops (SM pointer chase) or copies (CE) per latency sample.
    pub latency_iterations: usize,
}

impl Default for BandwidthOptions {
    fn default() -> Self {
        BandwidthOptions {
            bytes: 512 << 20,
            iterations: 8,
            repetitions: 3,
            latency_iterations: 10_000,
        }
    }
}

struct Kernels {
    copy: CudaFunction,
    chase: CudaFunction,
    blocks: u32,
}

fn load_kernels(ctx: &Arc<CudaContext>) -> Result<Kernels> {
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(KERNELS_PTX))
        .map_err(|e| Error::cuda("cuModuleLoadData", e))?;
    let copy = module
        .load_function("gd_copy_v4")
        .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
    let chase = module
        .load_function("gd_latency_chase")
        .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))?;
    Ok(Kernels {
        copy,
        chase,
        blocks: (sms.max(1) as u32) * 4,
    })
}

fn dptr<T>(s: &CudaSlice<T>) -> sys::CUdeviceptr {
    let (p, _sync) = s.device_ptr(s.stream());
    p
}

/// Buffers, streams and kernels for measuring one GPU pair (`a`, `b`), reusable so that a
/// benchmark can interleave repetitions of different methods. Buffers come from cudarc's
/// default pools, like users' buffers. Holding a [`PeerAccess`] is the caller's choice: the
/// CE methods run either way (staged without it); the SM methods refuse without access.
pub struct PairBench {
    a: Arc<CudaContext>,
    b: Arc<CudaContext>,
    sa: Arc<CudaStream>,
    sb: Arc<CudaStream>,
    /// a's source for a→b copies.
    a_src: CudaSlice<u8>,
    /// b's destination for a→b copies.
    b_dst: CudaSlice<u8>,
    /// b's source for b→a copies.
    b_src: CudaSlice<u8>,
    /// a's destination for b→a copies.
    a_dst: CudaSlice<u8>,
    bytes: usize,
    kernels: Option<(Kernels, Kernels)>,
}

impl PairBench {
    /// Allocates two `bytes`-byte buffers on each device (filled with a pattern) and one
    /// non-blocking stream per device.
    pub fn new(a: usize, b: usize, bytes: usize) -> Result<Self> {
        if bytes == 0 || !bytes.is_multiple_of(16) {
            return Err(Error::InvalidArgument(format!(
                "{bytes} bytes: use a positive multiple of 16 bytes"
            )));
        }
        if a == b {
            return Err(Error::InvalidArgument(format!(
                "GPU {a} with itself: pick two different devices"
            )));
        }
        let drv = |op| move |e| Error::cuda(op, e);
        let (ca, cb) = (crate::cuda::context(a)?, crate::cuda::context(b)?);
        let sa = ca.new_stream().map_err(drv("cuStreamCreate"))?;
        let sb = cb.new_stream().map_err(drv("cuStreamCreate"))?;
        let pattern: Vec<u8> = (0..bytes.min(1 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        let fill = |s: &Arc<CudaStream>| -> Result<CudaSlice<u8>> {
            let mut buf = s.alloc_zeros::<u8>(bytes).map_err(drv("cuMemAllocAsync"))?;
            let mut off = 0;
            while off < bytes {
                let n = pattern.len().min(bytes - off);
                let mut v = buf.slice_mut(off..off + n);
                s.memcpy_htod(&pattern[..n], &mut v)
                    .map_err(drv("cuMemcpyHtoDAsync"))?;
                off += n;
            }
            Ok(buf)
        };
        let a_src = fill(&sa)?;
        let b_src = fill(&sb)?;
        let a_dst = sa
            .alloc_zeros::<u8>(bytes)
            .map_err(drv("cuMemAllocAsync"))?;
        let b_dst = sb
            .alloc_zeros::<u8>(bytes)
            .map_err(drv("cuMemAllocAsync"))?;
        sa.synchronize().map_err(drv("cuStreamSynchronize"))?;
        sb.synchronize().map_err(drv("cuStreamSynchronize"))?;
        Ok(PairBench {
            a: ca,
            b: cb,
            sa,
            sb,
            a_src,
            b_dst,
            b_src,
            a_dst,
            bytes,
            kernels: None,
        })
    }

    /// True when b's destination buffer holds exactly a's source bytes (after an a→b copy by
    /// any method).
    pub fn destination_matches(&self) -> Result<bool> {
        let drv = |e| Error::cuda("cuMemcpyDtoH", e);
        let want = self.sa.clone_dtoh(&self.a_src).map_err(drv)?;
        let got = self.sb.clone_dtoh(&self.b_dst).map_err(drv)?;
        Ok(want == got)
    }

    /// Bytes per copy.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The two contexts (a, b).
    pub fn contexts(&self) -> (&Arc<CudaContext>, &Arc<CudaContext>) {
        (&self.a, &self.b)
    }

    fn gbps(&self, copies: usize, ms: f32) -> f64 {
        (self.bytes * copies) as f64 / (ms as f64 / 1e3).max(1e-12) / 1e9
    }

    fn timed(
        stream: &Arc<CudaStream>,
        iters: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<f32> {
        let ev = || {
            stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::cuda("cuEventRecord", e))
        };
        f()?; // warm-up
        let start = ev()?;
        for _ in 0..iters {
            f()?;
        }
        let end = ev()?;
        start
            .elapsed_ms(&end)
            .map_err(|e| Error::cuda("cuEventElapsedTime", e))
    }

    /// a→b with raw `cuMemcpyPeerAsync` on b's stream, `iters` copies; GB/s.
    pub fn ce_raw(&mut self, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let (s, d) = (dptr(&self.a_src), dptr(&self.b_dst));
        let (ca, cb, bytes) = (self.a.cu_ctx(), self.b.cu_ctx(), self.bytes);
        let sb = self.sb.clone();
        let ms = Self::timed(&sb, iters, || {
            // SAFETY: both buffers are owned by self and live until self drops, after the
            // event synchronization in `timed`.
            unsafe { r::mem::memcpy_peer_async(d, cb, s, ca, bytes, sb.cu_stream()) }
        })?;
        Ok(self.gbps(iters, ms))
    }

    /// a→b with gpudirect's [`copy_peer_async`](super::copy_peer_async) on b's stream; GB/s.
    pub fn ce_gpudirect(&mut self, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let sb = self.sb.clone();
        let (src, dst) = (&self.a_src, &mut self.b_dst);
        let ms = Self::timed(&sb, iters, || {
            // SAFETY: both buffers live in self; `timed` synchronizes on the end event.
            unsafe { copy::copy_peer_async_with(src, dst, &sb, &allow()) }.map(|_| ())
        })?;
        Ok(self.gbps(iters, ms))
    }

    /// a→b with cudarc's own `CudaStream::memcpy_dtod` on b's stream; GB/s.
    pub fn ce_cudarc(&mut self, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let sb = self.sb.clone();
        let (src, dst) = (&self.a_src, &mut self.b_dst);
        let ms = Self::timed(&sb, iters, || {
            sb.memcpy_dtod(src, dst)
                .map_err(|e| Error::cuda("cuMemcpyPeerAsync", e))
        })?;
        Ok(self.gbps(iters, ms))
    }

    /// a→b and b→a at once, raw `cuMemcpyPeerAsync`, one stream per GPU (each destination pulls);
    /// returns (a→b, b→a) GB/s, each timed on its own stream (nvbandwidth's convention).
    pub fn ce_bidirectional_raw(&mut self, iters: usize) -> Result<(f64, f64)> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let (a_src, b_dst) = (dptr(&self.a_src), dptr(&self.b_dst));
        let (b_src, a_dst) = (dptr(&self.b_src), dptr(&self.a_dst));
        let (ca, cb, bytes) = (self.a.cu_ctx(), self.b.cu_ctx(), self.bytes);
        let (sa, sb) = (self.sa.clone(), self.sb.clone());
        self.bidirectional(iters, |dir| match dir {
            // SAFETY: all buffers live in self; `bidirectional` synchronizes both streams.
            0 => unsafe { r::mem::memcpy_peer_async(b_dst, cb, a_src, ca, bytes, sb.cu_stream()) },
            // SAFETY: as above.
            _ => unsafe { r::mem::memcpy_peer_async(a_dst, ca, b_src, cb, bytes, sa.cu_stream()) },
        })
    }

    /// [`PairBench::ce_bidirectional_raw`] through gpudirect's `copy_peer_async`.
    pub fn ce_bidirectional_gpudirect(&mut self, iters: usize) -> Result<(f64, f64)> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let (sa, sb) = (self.sa.clone(), self.sb.clone());
        let PairBench {
            a_src,
            b_dst,
            b_src,
            a_dst,
            ..
        } = self;
        let (a_src, b_src) = (&*a_src, &*b_src);
        let mut cell = (b_dst, a_dst);
        let f = |dir: usize, cell: &mut (&mut CudaSlice<u8>, &mut CudaSlice<u8>)| -> Result<()> {
            // SAFETY: all buffers live in self; the streams are synchronized before return.
            unsafe {
                if dir == 0 {
                    copy::copy_peer_async_with(a_src, cell.0, &sb, &allow()).map(|_| ())
                } else {
                    copy::copy_peer_async_with(b_src, cell.1, &sa, &allow()).map(|_| ())
                }
            }
        };
        let bytes = self.bytes;
        bidirectional_on(&self.sa, &self.sb, bytes, iters, |dir| f(dir, &mut cell))
    }

    fn bidirectional(
        &self,
        iters: usize,
        f: impl FnMut(usize) -> Result<()>,
    ) -> Result<(f64, f64)> {
        bidirectional_on(&self.sa, &self.sb, self.bytes, iters, f)
    }

    fn kernels(&mut self) -> Result<&(Kernels, Kernels)> {
        if self.kernels.is_none() {
            self.kernels = Some((load_kernels(&self.a)?, load_kernels(&self.b)?));
        }
        Ok(self.kernels.as_ref().expect("set above"))
    }

    fn require_access(
        &self,
        executor: &Arc<CudaContext>,
        remote: &CudaSlice<u8>,
        write: bool,
    ) -> Result<()> {
        let info = copy::inspect(dptr(remote), remote.context());
        match copy::access(executor.ordinal(), executor.cu_ctx(), &info, write)? {
            Some(Ok(())) => Ok(()),
            Some(Err(cause)) => Err(Error::Unsupported {
                what: format!(
                    "an SM copy from GPU {} touching GPU {}'s memory",
                    executor.ordinal(),
                    info.device
                ),
                cause,
            }),
            None => Err(Error::InvalidArgument(
                "cannot tell whether the kernel may access the peer buffer".into(),
            )),
        }
    }

    /// a→b copied by a kernel: [`SmDirection::Read`] runs on b reading a's memory,
    /// [`SmDirection::Write`] on a writing b's memory; GB/s. Needs peer access (a kernel touching
    /// inaccessible peer memory would fault): refused with [`Error::Unsupported`] without it.
    pub fn sm_copy(&mut self, dir: SmDirection, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let (exec, remote, write) = match dir {
            SmDirection::Read => (self.b.clone(), &self.a_src, false),
            SmDirection::Write => (self.a.clone(), &self.b_dst, true),
        };
        self.require_access(&exec, remote, write)?;
        let (src, dst) = (dptr(&self.a_src), dptr(&self.b_dst));
        let n16 = (self.bytes / 16) as u64;
        let stream = match dir {
            SmDirection::Read => self.sb.clone(),
            SmDirection::Write => self.sa.clone(),
        };
        let k = self.kernels()?;
        let (kern, blocks) = match dir {
            SmDirection::Read => (&k.1.copy, k.1.blocks),
            SmDirection::Write => (&k.0.copy, k.0.blocks),
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let ms = Self::timed(&stream, iters, || {
            let mut lb = stream.launch_builder(kern);
            lb.arg(&src).arg(&dst).arg(&n16);
            // SAFETY: gd_copy_v4(const int4*, int4*, u64 n) reads/writes n 16-byte elements;
            // both buffers hold `bytes` = 16 n bytes, live in self, and the executing device
            // may access the remote one (checked above).
            unsafe { lb.launch(cfg) }
                .map(|_| ())
                .map_err(|e| Error::cuda("cuLaunchKernel", e))
        })?;
        let rate = self.gbps(iters, ms);
        Ok(rate)
    }

    /// Average time of one 8-byte a→b `cuMemcpyPeerAsync`, back to back (issue-rate bound,
    /// like p2pBandwidthLatencyTest's CE latency), in microseconds.
    pub fn ce_latency_us(&mut self, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        let (s, d) = (dptr(&self.a_src), dptr(&self.b_dst));
        let (ca, cb) = (self.a.cu_ctx(), self.b.cu_ctx());
        let sb = self.sb.clone();
        let ms = Self::timed(&sb, iters.max(1), || {
            // SAFETY: both buffers are live and hold at least 16 bytes.
            unsafe { r::mem::memcpy_peer_async(d, cb, s, ca, 8, sb.cu_stream()) }
        })?;
        Ok(ms as f64 * 1e3 / iters.max(1) as f64)
    }

    /// Dependent 8-byte loads by one GPU-b thread through a random chain in GPU a's memory
    /// (nvbandwidth's `device_to_device_latency_sm`), in nanoseconds per load. Needs peer access.
    pub fn sm_latency_ns(&mut self, iters: usize) -> Result<f64> {
        // No PeerAccess revokes the access these copies rely on until they have run.
        let _no_revocation = super::peer_access::no_revocation();
        const STRIDE: usize = 512; // bytes between chain nodes
        let nodes = (self.bytes / STRIDE).clamp(2, 16384);
        let b = self.b.clone();
        self.require_access(&b, &self.a_src, false)?;
        let drv = |op| move |e| Error::cuda(op, e);
        let mut chain = self
            .sa
            .alloc_zeros::<u64>(nodes * STRIDE / 8)
            .map_err(drv("cuMemAllocAsync"))?;
        let base = dptr(&chain);
        // A random cyclic permutation of the nodes (xorshift; no dependency).
        let mut order: Vec<usize> = (0..nodes).collect();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for i in (1..nodes).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let mut host = vec![0u64; nodes * STRIDE / 8];
        for w in 0..nodes {
            let from = order[w] * STRIDE / 8;
            let to = order[(w + 1) % nodes] * STRIDE;
            host[from] = base + to as u64;
        }
        self.sa
            .memcpy_htod(&host, &mut chain)
            .map_err(drv("cuMemcpyHtoDAsync"))?;
        self.sa.synchronize().map_err(drv("cuStreamSynchronize"))?;
        let out = self
            .sb
            .alloc_zeros::<u64>(1)
            .map_err(drv("cuMemAllocAsync"))?;
        let out_p = dptr(&out);
        let start_p = base + (order[0] * STRIDE) as u64;
        let hops = iters.max(1) as u64;
        let sb = self.sb.clone();
        let k = self.kernels()?;
        let chase = &k.1.chase;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let ms = Self::timed(&sb, 1, || {
            let mut lb = sb.launch_builder(chase);
            lb.arg(&start_p).arg(&hops).arg(&out_p);
            // SAFETY: gd_latency_chase follows `hops` pointers starting at `start_p`; every node
            // of `chain` (live until after the synchronization below) points to another node
            // of `chain`, which GPU b may read (checked above); it writes one u64 to `out`.
            unsafe { lb.launch(cfg) }
                .map(|_| ())
                .map_err(|e| Error::cuda("cuLaunchKernel", e))
        })?;
        sb.synchronize().map_err(drv("cuStreamSynchronize"))?;
        let _ = sb.clone_dtoh(&out).map_err(drv("cuMemcpyDtoH"))?;
        Ok(ms as f64 * 1e6 / hops as f64)
    }
}

fn allow() -> copy::CopyOptions {
    copy::CopyOptions {
        policy: Some(crate::FallbackPolicy::Allow),
        ..Default::default()
    }
}

/// Runs direction 0 (a→b, on `sb`) and 1 (b→a, on `sa`) `iters` times each, enqueued
/// alternately so both streams run concurrently; per-stream GB/s.
fn bidirectional_on(
    sa: &Arc<CudaStream>,
    sb: &Arc<CudaStream>,
    bytes: usize,
    iters: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<(f64, f64)> {
    let ev = |s: &Arc<CudaStream>| {
        s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::cuda("cuEventRecord", e))
    };
    f(0)?;
    f(1)?;
    // Start both streams from a common point: each waits for the other's warm-up.
    let wa = sa
        .record_event(None)
        .map_err(|e| Error::cuda("cuEventRecord", e))?;
    let wb = sb
        .record_event(None)
        .map_err(|e| Error::cuda("cuEventRecord", e))?;
    sa.wait(&wb)
        .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
    sb.wait(&wa)
        .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
    let (sa0, sb0) = (ev(sa)?, ev(sb)?);
    for _ in 0..iters {
        f(0)?;
        f(1)?;
    }
    let (sa1, sb1) = (ev(sa)?, ev(sb)?);
    let ms_b = sb0
        .elapsed_ms(&sb1)
        .map_err(|e| Error::cuda("cuEventElapsedTime", e))?;
    let ms_a = sa0
        .elapsed_ms(&sa1)
        .map_err(|e| Error::cuda("cuEventElapsedTime", e))?;
    let rate = |ms: f32| (bytes * iters) as f64 / (ms as f64 / 1e3).max(1e-12) / 1e9;
    Ok((rate(ms_b), rate(ms_a)))
}

/// Median of a sample (NaN for none).
pub(in crate::p2p) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Results for one ordered pair (src → dst).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairBandwidth {
    /// Source device.
    pub src: usize,
    /// Destination device.
    pub dst: usize,
    /// The link.
    pub link: Link,
    /// The raw one-direction link rate, when the topology knows it.
    pub link_limit_gbps: Option<f64>,
    /// CE copy src→dst (destination pulls), GB/s.
    pub ce_gbps: f64,
    /// CE copies src→dst and dst→src at once: this direction's GB/s.
    pub ce_bidirectional_gbps: f64,
    /// Both directions of the bidirectional run added (nvbandwidth's per-stream sum).
    pub ce_bidirectional_total_gbps: f64,
    /// SM copy, destination's SMs reading the source, GB/s.
    pub sm_read_gbps: f64,
    /// SM copy, source's SMs writing the destination, GB/s.
    pub sm_write_gbps: f64,
    /// 8-byte CE copies back to back, µs each.
    pub ce_latency_us: f64,
    /// Destination SM reading source memory, dependent loads, ns each.
    pub sm_latency_ns: f64,
}

/// Every pair's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BandwidthMatrix {
    /// Number of devices.
    pub devices: usize,
    /// Bytes per copy.
    pub bytes: usize,
    /// One entry per ordered pair whose devices can access each other.
    pub pairs: Vec<PairBandwidth>,
}

/// Measures every ordered pair of peer-capable devices, holding a [`PeerAccess`] both ways.
/// Pairs that cannot access each other are left out (printed `N/A`).
pub fn measure(opts: &BandwidthOptions) -> Result<BandwidthMatrix> {
    let n = crate::cuda::device_count()?;
    let mut pairs = Vec::new();
    for a in 0..n {
        for b in 0..n {
            if a == b {
                continue;
            }
            let (da, db) = (r::device::get(a)?, r::device::get(b)?);
            if !r::device::can_access_peer(da, db)? || !r::device::can_access_peer(db, da)? {
                continue;
            }
            let mut bench = PairBench::new(a, b, opts.bytes)?;
            let _access = PeerAccess::both_ways(bench.contexts().0, bench.contexts().1)?;
            let reps = opts.repetitions.max(1);
            let it = opts.iterations.max(1);
            let mut s: [Vec<f64>; 7] = Default::default();
            for _ in 0..reps {
                s[0].push(bench.ce_gpudirect(it)?);
                let (ab, ba) = bench.ce_bidirectional_gpudirect(it)?;
                s[1].push(ab);
                s[2].push(ab + ba);
                s[3].push(bench.sm_copy(SmDirection::Read, it)?);
                s[4].push(bench.sm_copy(SmDirection::Write, it)?);
                s[5].push(bench.ce_latency_us(opts.latency_iterations)?);
                s[6].push(bench.sm_latency_ns(opts.latency_iterations)?);
            }
            let pair = super::topology::cached().and_then(|t| t.pair(a, b).cloned());
            pairs.push(PairBandwidth {
                src: a,
                dst: b,
                link: pair.as_ref().map_or(Link::Unknown, |p| p.link()),
                link_limit_gbps: pair.as_ref().and_then(|p| p.link_limit_gbps()),
                ce_gbps: median(&mut s[0]),
                ce_bidirectional_gbps: median(&mut s[1]),
                ce_bidirectional_total_gbps: median(&mut s[2]),
                sm_read_gbps: median(&mut s[3]),
                sm_write_gbps: median(&mut s[4]),
                ce_latency_us: median(&mut s[5]),
                sm_latency_ns: median(&mut s[6]),
            });
        }
    }
    Ok(BandwidthMatrix {
        devices: n,
        bytes: opts.bytes,
        pairs,
    })
}

impl BandwidthMatrix {
    fn cell(&self, a: usize, b: usize, f: impl Fn(&PairBandwidth) -> f64) -> String {
        if a == b {
            return "N/A".into();
        }
        self.pairs
            .iter()
            .find(|p| p.src == a && p.dst == b)
            .map_or_else(|| "N/A".into(), |p| format!("{:.2}", f(p)))
    }

    fn table(
        &self,
        f: &mut fmt::Formatter<'_>,
        title: &str,
        value: impl Fn(&PairBandwidth) -> f64,
    ) -> fmt::Result {
        writeln!(f, "{title}")?;
        write!(f, "{:>6}", "")?;
        for j in 0..self.devices {
            write!(f, "{j:>10}")?;
        }
        writeln!(f)?;
        for i in 0..self.devices {
            write!(f, "{i:>6}")?;
            for j in 0..self.devices {
                write!(f, "{:>10}", self.cell(i, j, &value))?;
            }
            writeln!(f)?;
        }
        writeln!(f)
    }
}

impl fmt::Display for BandwidthMatrix {
    /// nvbandwidth-style matrices (row = source, column = destination), then ratios to the link.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} MiB per copy", self.bytes >> 20)?;
        self.table(
            f,
            "memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)",
            |p| p.ce_gbps,
        )?;
        self.table(
            f,
            "memcpy CE bidirectional GPU(row) <-> GPU(column), both directions summed (GB/s)",
            |p| p.ce_bidirectional_total_gbps,
        )?;
        self.table(
            f,
            "memcpy SM read: GPU(column) reads GPU(row) (GB/s)",
            |p| p.sm_read_gbps,
        )?;
        self.table(
            f,
            "memcpy SM write: GPU(row) writes GPU(column) (GB/s)",
            |p| p.sm_write_gbps,
        )?;
        self.table(f, "latency CE 8-byte copy, back to back (us)", |p| {
            p.ce_latency_us
        })?;
        self.table(f, "latency SM dependent load of peer memory (ns)", |p| {
            p.sm_latency_ns
        })?;
        writeln!(
            f,
            "ratio to the link limit (one direction; bidirectional vs 2x)"
        )?;
        for p in &self.pairs {
            let limit = p.link_limit_gbps.unwrap_or(LINK_LIMIT_H200_GBPS);
            let assumed = if p.link_limit_gbps.is_none() {
                " (limit assumed: H200 NV18)"
            } else {
                ""
            };
            writeln!(
                f,
                "GPU{} -> GPU{} over {}: limit {:.1} GB/s{assumed}; CE {:.3}x, CE bidir {:.3}x, SM read {:.3}x, SM write {:.3}x",
                p.src,
                p.dst,
                p.link,
                limit,
                p.ce_gbps / limit,
                p.ce_bidirectional_total_gbps / (2.0 * limit),
                p.sm_read_gbps / limit,
                p.sm_write_gbps / limit
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_samples() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn ptx_has_both_kernels() {
        assert!(KERNELS_PTX.contains(".entry gd_copy_v4"));
        assert!(KERNELS_PTX.contains(".entry gd_latency_chase"));
        assert!(
            KERNELS_PTX.contains("ld.global.nc.v4.u32"),
            "16-byte vector loads"
        );
    }

    /// The SM kernels on one GPU (source and destination in the same device's memory): the copy
    /// kernel over a size that runs both its unrolled loop and its remainder loop, every byte
    /// checked; the pointer chase through a random chain, its end checked. This is what
    /// `scripts/gpu-suite sanitize` runs under compute-sanitizer's racecheck and synccheck.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_sm_kernels_on_one_device() {
        let ctx = crate::cuda::context(0).unwrap_or_else(|e| {
            panic!("this test needs a CUDA GPU (run gpu_* tests on a GPU machine): {e}")
        });
        let s = ctx.new_stream().unwrap();
        let k = load_kernels(&ctx).unwrap();
        let cfg = LaunchConfig {
            grid_dim: (k.blocks, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let stride = k.blocks as usize * 512;
        let n16 = 4 * stride + 777;
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let data: Vec<u8> = (0..n16 * 16).map(|_| next() as u8).collect();
        let src = s.clone_htod(&data).unwrap();
        let junk: Vec<u8> = (0..n16 * 16 + 64).map(|_| next() as u8).collect();
        let dst = s.clone_htod(&junk).unwrap();
        let (sp, dp, n) = (dptr(&src), dptr(&dst), n16 as u64);
        let mut lb = s.launch_builder(&k.copy);
        lb.arg(&sp).arg(&dp).arg(&n);
        // SAFETY: gd_copy_v4 reads n 16-byte elements of `src` (n16 * 16 bytes) and writes as
        // many of `dst` (n16 * 16 + 64 bytes); both live until after the synchronisation below.
        unsafe { lb.launch(cfg) }.unwrap();
        s.synchronize().unwrap();
        let got = s.clone_dtoh(&dst).unwrap();
        assert!(
            got[..n16 * 16] == data[..],
            "the copy kernel's bytes differ"
        );
        assert!(
            got[n16 * 16..] == junk[n16 * 16..],
            "the copy kernel wrote past n"
        );

        const STRIDE: usize = 512;
        let nodes = 64;
        let mut order: Vec<usize> = (0..nodes).collect();
        for i in (1..nodes).rev() {
            order.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let mut chain = s.alloc_zeros::<u64>(nodes * STRIDE / 8).unwrap();
        let base = dptr(&chain);
        let mut host = vec![0u64; nodes * STRIDE / 8];
        for w in 0..nodes {
            host[order[w] * STRIDE / 8] = base + (order[(w + 1) % nodes] * STRIDE) as u64;
        }
        s.memcpy_htod(&host, &mut chain).unwrap();
        let out = s.alloc_zeros::<u64>(1).unwrap();
        let (start, hops, out_p) = (base + (order[0] * STRIDE) as u64, 1000u64, dptr(&out));
        let mut lb = s.launch_builder(&k.chase);
        lb.arg(&start).arg(&hops).arg(&out_p);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every node of `chain` points to a node of `chain`; `out` holds one u64; both
        // live until after the synchronisation below.
        unsafe { lb.launch(one) }.unwrap();
        s.synchronize().unwrap();
        let end = s.clone_dtoh(&out).unwrap()[0];
        assert_eq!(
            end,
            base + (order[1000 % nodes] * STRIDE) as u64,
            "the pointer chase ended at the wrong node"
        );
    }

    #[test]
    fn display_marks_missing_pairs() {
        let m = BandwidthMatrix {
            devices: 2,
            bytes: 1 << 30,
            pairs: vec![PairBandwidth {
                src: 0,
                dst: 1,
                link: Link::NvLink { links: 18 },
                link_limit_gbps: Some(LINK_LIMIT_H200_GBPS),
                ce_gbps: 395.0,
                ce_bidirectional_gbps: 392.0,
                ce_bidirectional_total_gbps: 784.0,
                sm_read_gbps: 360.0,
                sm_write_gbps: 370.0,
                ce_latency_us: 2.5,
                sm_latency_ns: 800.0,
            }],
        };
        let s = m.to_string();
        assert!(s.contains("395.00"), "{s}");
        assert!(s.contains("N/A"), "{s}");
        assert!(s.contains("CE 0.826x"), "{s}");
    }
}

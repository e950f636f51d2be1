//! Transfers awaited inside tokio (feature `async`, on for the crate's own tests): the runtime
//! thread is not stalled. `gpu_transfer_tokio_stall_is_below_1ms` is issue 12 item 3's
//! measurement (a 1 GiB page-cached read, blocking vs awaited); the host test runs anywhere.
//! A binary of its own: `.device/run` runs binaries one after another, so no other test loads
//! the CPUs while the stall is measured.
//!
//! Run on a GPU machine from the project root: `bash scripts/gpu-suite async`, or
//! `bash .device/run --include-ignored gpu_transfer_tokio --nocapture`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use gpudirect::storage::GpuFile;

fn gpu() -> Arc<CudaStream> {
    let ctx = common::need_gpu(common::test_gpu());
    ctx.new_stream().unwrap()
}

/// A task on the current runtime that yields in a loop and records in `worst` the largest gap
/// (ns) between two of its polls, until `stop` is set: how long the runtime thread was held.
fn ticker() -> (Arc<AtomicU64>, Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    let worst = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let task = {
        let (worst, stop) = (worst.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                tokio::task::yield_now().await;
                let now = Instant::now();
                worst.fetch_max((now - last).as_nanos() as u64, Ordering::Relaxed);
                last = now;
            }
        })
    };
    (worst, stop, task)
}

/// No GPU needed (runs everywhere): a host read awaited inside a current-thread tokio runtime
/// completes through its waker, and the runtime thread keeps running other tasks while it is
/// in flight: the largest gap between a ticker task's polls during an awaited read (the least
/// of three: a 2-CPU machine preempts the runtime thread now and then) is far below the
/// blocking call's.
#[test]
fn transfer_awaited_host_read_does_not_stall_a_tokio_runtime() {
    let p = common::scratch("xfer-tokio-host");
    let data = common::random_seeded(128 << 20, 7);
    std::fs::write(&p, &data).unwrap();
    let f = Arc::new(GpuFile::open(&p).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (blocking, waited) = rt.block_on(async {
        let (worst, stop, ticker) = ticker();
        let mut buf = vec![0u8; data.len()];
        tokio::task::yield_now().await;
        worst.store(0, Ordering::Relaxed);
        f.pread_host(&mut buf, 0).unwrap();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        let blocking = worst.swap(0, Ordering::Relaxed);
        let mut waited = u64::MAX;
        let mut results = Vec::new();
        for _ in 0..3 {
            let (r, back) = f.pread_host_async(buf, 0).await;
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            waited = waited.min(worst.swap(0, Ordering::Relaxed));
            results.push(r.map(|r| r.bytes));
            buf = back;
        }
        stop.store(true, Ordering::Relaxed);
        ticker.await.unwrap();
        for r in results {
            assert_eq!(r.unwrap(), data.len());
        }
        assert!(buf == data, "the awaited read differs from the file");
        (blocking, waited)
    });
    eprintln!(
        "tokio current-thread runtime, 128 MiB page-cached host read: blocking call stalls {:.3} ms, awaited transfer {:.3} ms",
        blocking as f64 / 1e6,
        waited as f64 / 1e6
    );
    assert!(
        waited * 2 < blocking,
        "awaiting the transfer stalled the runtime {waited} ns, the blocking call {blocking} ns"
    );
    std::fs::remove_file(&p).unwrap();
}

/// A future's largest single poll, on the thread that polls it.
struct Timed<F> {
    f: F,
    longest: Duration,
}

impl<F: std::future::Future + Unpin> std::future::Future for Timed<F> {
    type Output = (F::Output, Duration);
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let t0 = Instant::now();
        let r = std::pin::Pin::new(&mut self.f).poll(cx);
        self.longest = self.longest.max(t0.elapsed());
        let longest = self.longest;
        r.map(|v| (v, longest))
    }
}

/// What one round of the stall measurement saw.
struct Stall {
    /// The ticker's largest gap during the blocking call, and the call.
    blocking_gap: Duration,
    blocking_call: Duration,
    /// Per awaited read: the ticker's largest gap, and the longest the runtime thread spent in
    /// gpudirect (the `read_exact_async` call or one poll of its future).
    gaps: Vec<Duration>,
    in_api: Vec<Duration>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

/// Reads `buf`'s length from `f` inside a current-thread tokio runtime while a ticker task
/// measures the largest gap between its polls: once blocking, then five times awaited.
fn stall_round(f: &Arc<GpuFile>, buf: CudaSlice<u8>) -> (Stall, CudaSlice<u8>) {
    let len = buf.len();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let (worst, stop, ticker) = ticker();
        let mut buf = buf;
        tokio::task::yield_now().await;
        worst.store(0, Ordering::Relaxed);
        let t0 = Instant::now();
        f.read_exact_to_device(&mut buf, 0).unwrap();
        let blocking_call = t0.elapsed();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        let blocking_gap = Duration::from_nanos(worst.swap(0, Ordering::Relaxed));
        let (mut gaps, mut in_api) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let t0 = Instant::now();
            let t = f.read_exact_async(buf, 0);
            let call = t0.elapsed();
            let ((r, b), poll) = Timed {
                f: t,
                longest: Duration::ZERO,
            }
            .await;
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            gaps.push(Duration::from_nanos(worst.swap(0, Ordering::Relaxed)));
            in_api.push(call.max(poll));
            assert_eq!(r.unwrap().bytes, len);
            buf = b;
            worst.store(0, Ordering::Relaxed);
        }
        stop.store(true, Ordering::Relaxed);
        ticker.await.unwrap();
        (
            Stall {
                blocking_gap,
                blocking_call,
                gaps,
                in_api,
            },
            buf,
        )
    })
}

/// Issue 12 item 3: a 1 GiB read from a page-cached file inside a current-thread tokio
/// runtime, while a ticker task measures the largest gap between its polls. The blocking call
/// stalls the runtime thread for the whole read; awaiting `read_exact_async` must not: the
/// runtime thread spends under 1 ms in gpudirect per read (the call, or any one poll), and the
/// ticker's median gap is under 1 ms. Two rounds: the engine's default worker count, and one
/// that leaves the runtime two CPUs (a runtime thread that shares its CPU with a busy IO worker
/// is preempted for a scheduler slice, milliseconds, which no API can prevent; the first round
/// prints what that costs, the second asserts the ticker). Every byte is checked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_tokio_stall_is_below_1ms() {
    let s = gpu();
    let len = 1usize << 30;
    let p = common::scratch("xfer-tokio-1g");
    let data = common::random_seeded(len, 900);
    std::fs::write(&p, &data).unwrap();
    let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
    let default = gpudirect::storage::default_threads(Some(common::test_gpu()));
    let spare = default.min(cpus.saturating_sub(2)).max(1);
    let mut buf = s.alloc_zeros::<u8>(len).unwrap();
    let mut rounds = Vec::new();
    for threads in [default, spare] {
        let f = Arc::new(GpuFile::options().threads(threads).open(&p).unwrap());
        // Page cache, engine threads and pinned ring warm, as for any read after the first.
        f.read_exact_to_device(&mut buf, 0).unwrap();
        let (st, b) = stall_round(&f, buf);
        buf = b;
        assert!(
            s.clone_dtoh(&buf).unwrap() == data,
            "the awaited reads left bytes that differ from the file"
        );
        eprintln!(
            "tokio stall, 1 GiB page-cached read, current-thread runtime, {threads} engine workers on {cpus} CPUs: \
             blocking read_exact_to_device stalls {:.3} ms (call {:.3} ms); read_exact_async().await: ticker gap per read {:?} µs \
             (median {:.1} µs), time in gpudirect per read {:?} µs",
            st.blocking_gap.as_secs_f64() * 1e3,
            st.blocking_call.as_secs_f64() * 1e3,
            st.gaps.iter().map(|g| g.as_micros()).collect::<Vec<_>>(),
            median(&st.gaps).as_secs_f64() * 1e6,
            st.in_api.iter().map(|g| g.as_micros()).collect::<Vec<_>>(),
        );
        assert!(
            st.blocking_gap >= st.blocking_call.mul_f64(0.9),
            "the ticker missed the blocking call's stall ({:?} of {:?}): the measurement is broken",
            st.blocking_gap,
            st.blocking_call
        );
        let api = *st.in_api.iter().max().unwrap();
        assert!(
            api < Duration::from_millis(1),
            "{threads} workers: the runtime thread spent {api:?} inside read_exact_async or a poll of it"
        );
        rounds.push((threads, st));
    }
    let (threads, st) = &rounds[1];
    assert!(
        median(&st.gaps) < Duration::from_millis(1),
        "{threads} workers on {cpus} CPUs: awaiting read_exact_async stalled the runtime thread {:?} (median of {:?}): it must stay below 1 ms",
        median(&st.gaps),
        st.gaps
    );
    std::fs::remove_file(&p).unwrap();
}

//! `GPUDIRECT_TRACE=timing`: a timeline of what each storage call spends its time on, printed to
//! stderr (lines start with `gpudirect-trace`), for finding where a fresh process's first call
//! loses time to a warm one.
//!
//! Off by default. When off, every probe in the engine is one relaxed atomic load and a branch
//! (no clock is read, nothing is allocated). When on, each engine job collects, without printing
//! while it runs: per worker the time it entered the job, its first IO and its waits; per task
//! its IO start and end; per ring slot its page-locking; per segment the host time its copies
//! were issued and, from timing events on the copy stream, when the GPU finished them; and, for
//! a destination allocated while the job starts, when the allocation was done. The job prints one
//! block when it ends. Phase marks (`mark`) print at once. Times are milliseconds since the
//! process's first trace reading.
//!
//! The variable is read once per process by [`init`] (through [`crate::env`]); a value other than
//! `timing`, `off` or `0` is an [`Error::InvalidEnvironment`](crate::Error::InvalidEnvironment),
//! returned by the first storage call that creates an engine.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use crate::error::Result;

/// The variable.
pub(in crate::storage) const VAR: &str = "GPUDIRECT_TRACE";

static STATE: AtomicU8 = AtomicU8::new(0); // 0: not read yet, 1: off, 2: on, 3: unparsable
static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Parses a value of [`VAR`]: `Some(true)` for `timing`, `Some(false)` for `off`/`0`.
pub(in crate::storage) fn parse(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "timing" => Some(true),
        "off" | "0" | "none" => Some(false),
        _ => None,
    }
}

/// Reads [`VAR`] (once per process) and returns whether tracing is on.
pub(in crate::storage) fn init() -> Result<bool> {
    match STATE.load(Ordering::Relaxed) {
        1 => return Ok(false),
        2 => return Ok(true),
        _ => {}
    }
    let on = match crate::env::Env::process().parse(VAR, "timing, off or 0", parse) {
        Ok(v) => v.unwrap_or(false),
        Err(e) => {
            // Every init says so again; the probes read it as off.
            STATE.store(3, Ordering::Relaxed);
            return Err(e);
        }
    };
    if on {
        EPOCH.get_or_init(Instant::now);
    }
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    Ok(on)
}

/// Whether tracing is on (false until [`init`] ran; an unparsable value reads as off here and is
/// reported by [`init`]).
#[inline]
pub(in crate::storage) fn on() -> bool {
    match STATE.load(Ordering::Relaxed) {
        2 => true,
        0 => init().unwrap_or(false),
        _ => false,
    }
}

/// Microseconds since the trace epoch (0 when tracing is off), never 0 when on.
#[inline]
pub(in crate::storage) fn now_us() -> u64 {
    if !on() {
        return 0;
    }
    EPOCH.get_or_init(Instant::now).elapsed().as_micros().max(1) as u64
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

/// Prints a phase mark at once (when tracing is on); `what` is only built then.
pub(in crate::storage) fn mark(what: impl FnOnce() -> String) {
    if on() {
        let t = now_us();
        eprintln!("gpudirect-trace {:>10.3} ms  {}", ms(t), what());
    }
}

/// A worker's part of a job.
#[derive(Default)]
struct WorkerTrace {
    entered: AtomicU64,
    first_io: AtomicU64,
    tasks: AtomicU64,
    io_us: AtomicU64,
    wait_us: AtomicU64,
    waits: AtomicU64,
    gate_us: AtomicU64,
}

/// One page-locking of a ring slot: (slot, worker (`usize::MAX`: the calling thread), start,
/// end, bytes).
type Pin = (usize, usize, u64, u64, usize);

/// One segment's copies.
#[derive(Debug, Clone, Copy)]
pub(in crate::storage) struct CopyTrace {
    pub seg: usize,
    pub slot: usize,
    pub stream: usize,
    /// Host: when the segment's last task was done (the issue began), and when its copies
    /// were enqueued.
    pub ready: u64,
    pub issued: u64,
    pub bytes: usize,
    pub runs: usize,
    /// Parts the copies were issued in (a first-pass segment's copies go out as its reads
    /// come in; `issued` is then the first part's).
    pub parts: usize,
}

/// What one engine job did, collected while it runs and printed when it ends.
pub(in crate::storage) struct JobTrace {
    label: String,
    start: u64,
    /// Per task: IO start, IO end (µs since the epoch; 0: not done), worker + 1.
    io: Vec<[AtomicU64; 2]>,
    who: Vec<AtomicU32>,
    workers: Vec<WorkerTrace>,
    /// Each page-locking.
    pins: Mutex<Vec<Pin>>,
    copies: Mutex<Vec<CopyTrace>>,
    notes: Mutex<Vec<(u64, String)>>,
    /// Task index ranges of the ring's first pass (segments < ring slots), for the IO summary.
    first_pass_tasks: AtomicU64,
}

impl JobTrace {
    /// A trace for a job of `tasks` tasks on up to `workers` workers (None when tracing is off).
    pub fn new(label: impl FnOnce() -> String, tasks: usize, workers: usize) -> Option<Box<Self>> {
        if !on() {
            return None;
        }
        Some(Box::new(JobTrace {
            label: label(),
            start: now_us(),
            io: (0..tasks)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
            who: (0..tasks).map(|_| AtomicU32::new(0)).collect(),
            workers: (0..workers + 1).map(|_| WorkerTrace::default()).collect(),
            pins: Mutex::new(Vec::new()),
            copies: Mutex::new(Vec::new()),
            notes: Mutex::new(Vec::new()),
            first_pass_tasks: AtomicU64::new(0),
        }))
    }

    /// The job's start (µs since the epoch).
    pub fn start(&self) -> u64 {
        self.start
    }

    fn worker(&self, w: usize) -> &WorkerTrace {
        &self.workers[w.min(self.workers.len() - 1)]
    }

    /// Worker `w` entered the job.
    pub fn entered(&self, w: usize) {
        let _ = self.worker(w).entered.compare_exchange(
            0,
            now_us(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Task `i`'s IO ran from `t0` to now on worker `w`.
    pub fn io(&self, w: usize, i: usize, t0: u64) {
        let t1 = now_us();
        if let Some(x) = self.io.get(i) {
            x[0].store(t0, Ordering::Relaxed);
            x[1].store(t1, Ordering::Relaxed);
            self.who[i].store(w.min(u32::MAX as usize - 1) as u32 + 1, Ordering::Relaxed);
        }
        let wt = self.worker(w);
        let _ = wt
            .first_io
            .compare_exchange(0, t0, Ordering::Relaxed, Ordering::Relaxed);
        wt.tasks.fetch_add(1, Ordering::Relaxed);
        wt.io_us.fetch_add(t1 - t0, Ordering::Relaxed);
    }

    /// Worker `w` waited from `t0` to now for a ring slot (or, for lanes, a bounce buffer).
    pub fn waited(&self, w: usize, t0: u64) {
        let d = now_us().saturating_sub(t0);
        if d >= 10 {
            let wt = self.worker(w);
            wt.wait_us.fetch_add(d, Ordering::Relaxed);
            wt.waits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Worker `w` waited from `t0` to now for the destination to be allocated.
    pub fn gate_waited(&self, w: usize, t0: u64) {
        self.worker(w)
            .gate_us
            .fetch_add(now_us() - t0, Ordering::Relaxed);
    }

    /// Slot `slot` was page-locked (`bytes`) from `t0` to now by worker `w` (`usize::MAX`:
    /// the calling thread).
    pub fn pinned(&self, slot: usize, w: usize, t0: u64, bytes: usize) {
        let t1 = now_us();
        self.pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((slot, w, t0, t1, bytes));
    }

    /// A segment's copies were issued.
    pub fn copied(&self, c: CopyTrace) {
        self.copies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(c);
    }

    /// A note at the current time.
    pub fn note(&self, s: impl Into<String>) {
        let t = now_us();
        self.notes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((t, s.into()));
    }

    /// Tasks `[0, n)` are the ring's first pass.
    pub fn set_first_pass(&self, n: usize) {
        self.first_pass_tasks.store(n as u64, Ordering::Relaxed);
    }

    /// Prints the job's block; `gpu_done[k]`: when the GPU finished segment `k`'s copies
    /// (µs since the epoch), when timing events measured it.
    pub fn finish(&self, bytes: usize, gpu_done: &[Option<u64>]) {
        eprint!("{}", self.render(bytes, gpu_done, now_us()));
    }

    fn render(&self, bytes: usize, gpu_done: &[Option<u64>], end: u64) -> String {
        let rel = |t: u64| ms(t.saturating_sub(self.start));
        let mut s = String::new();
        let p = "gpudirect-trace";
        let total = end.saturating_sub(self.start).max(1);
        let _ = writeln!(
            s,
            "{p} {:>10.3} ms  job {}: {bytes} B in {:.3} ms ({:.2} GB/s); times below are ms after the job's start",
            ms(self.start),
            self.label,
            ms(total),
            bytes as f64 / total as f64 / 1e3
        );
        let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        notes.sort();
        for (t, n) in &notes {
            let _ = writeln!(s, "{p}   {:>9.3}  {n}", rel(*t));
        }
        // Workers.
        let mut line = String::new();
        let mut wait_total = 0u64;
        let mut gate_total = 0u64;
        for (w, wt) in self.workers.iter().enumerate() {
            let entered = wt.entered.load(Ordering::Relaxed);
            let tasks = wt.tasks.load(Ordering::Relaxed);
            if entered == 0 && tasks == 0 {
                continue;
            }
            wait_total += wt.wait_us.load(Ordering::Relaxed);
            gate_total += wt.gate_us.load(Ordering::Relaxed);
            let _ = write!(
                line,
                " w{}:in {:.2} io@{:.2} n{} io {:.1} wait {:.1}/{}{}",
                if w + 1 == self.workers.len() {
                    "caller".to_string()
                } else {
                    w.to_string()
                },
                rel(entered),
                rel(wt.first_io.load(Ordering::Relaxed)),
                tasks,
                ms(wt.io_us.load(Ordering::Relaxed)),
                ms(wt.wait_us.load(Ordering::Relaxed)),
                wt.waits.load(Ordering::Relaxed),
                match wt.gate_us.load(Ordering::Relaxed) {
                    0 => String::new(),
                    g => format!(" alloc-wait {:.1}", ms(g)),
                }
            );
        }
        let _ = writeln!(
            s,
            "{p}   workers (entered, first IO, tasks, IO ms, slot-wait ms/count):{line}"
        );
        let _ = writeln!(
            s,
            "{p}   waits in all: slot {:.3} ms, destination allocation {:.3} ms",
            ms(wait_total),
            ms(gate_total)
        );
        // IO durations: the ring's first pass against the rest.
        let fp = self.first_pass_tasks.load(Ordering::Relaxed) as usize;
        let durs: Vec<(usize, u64, u64)> = self
            .io
            .iter()
            .enumerate()
            .filter_map(|(i, x)| {
                let (a, b) = (x[0].load(Ordering::Relaxed), x[1].load(Ordering::Relaxed));
                (b > 0).then_some((i, a, b))
            })
            .collect();
        let stats = |sel: &mut dyn Iterator<Item = u64>| -> String {
            let mut v: Vec<u64> = sel.collect();
            if v.is_empty() {
                return "none".into();
            }
            v.sort_unstable();
            let sum: u64 = v.iter().sum();
            format!(
                "n {} mean {:.3} median {:.3} p90 {:.3} max {:.3} ms",
                v.len(),
                ms(sum) / v.len() as f64,
                ms(v[v.len() / 2]),
                ms(v[v.len() * 9 / 10]),
                ms(v[v.len() - 1])
            )
        };
        if !durs.is_empty() {
            let first = durs.iter().map(|d| d.1).min().unwrap_or(0);
            let last = durs.iter().map(|d| d.2).max().unwrap_or(0);
            let _ = writeln!(
                s,
                "{p}   task IO: first started {:.3}, last ended {:.3}; first pass of the ring: {}; later: {}",
                rel(first),
                rel(last),
                stats(&mut durs.iter().filter(|d| d.0 < fp).map(|d| d.2 - d.1)),
                stats(&mut durs.iter().filter(|d| d.0 >= fp).map(|d| d.2 - d.1)),
            );
            // The first few tasks in the order they started.
            let mut by_start = durs.clone();
            by_start.sort_by_key(|d| d.1);
            let mut l = String::new();
            for d in by_start.iter().take(24) {
                let _ = write!(
                    l,
                    " #{}(w{}) {:.2}-{:.2}",
                    d.0,
                    self.who[d.0].load(Ordering::Relaxed).saturating_sub(1),
                    rel(d.1),
                    rel(d.2)
                );
            }
            let _ = writeln!(s, "{p}   first tasks:{l}");
        }
        let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner()).clone();
        pins.sort_by_key(|x| x.2);
        for (slot, w, a, b, n) in &pins {
            let _ = writeln!(
                s,
                "{p}   slot {slot} page-locked {} MiB by {}: {:.3}-{:.3} ({:.3} ms)",
                n >> 20,
                if *w == usize::MAX {
                    "the caller".to_string()
                } else {
                    format!("w{w}")
                },
                rel(*a),
                rel(*b),
                ms(b - a)
            );
        }
        let mut copies = self
            .copies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        copies.sort_by_key(|c| c.seg);
        if !copies.is_empty() {
            let _ = writeln!(
                s,
                "{p}   copies (segment slot/stream: ready -> issued -> GPU done, bytes, GB/s of the GPU's span since the copy issued before it on its stream ended or this one was issued):"
            );
            let parts = |n: usize| {
                if n > 1 {
                    format!(" in {n} parts")
                } else {
                    String::new()
                }
            };
            // Each copy's GPU span, from when the one before it on its stream ended (a
            // stream runs its copies in the order they were issued, which is not the
            // segments' order: segments are read, and their copies issued, out of order) or
            // it was issued, to when it was done.
            let mut by_issue: Vec<&CopyTrace> = copies.iter().collect();
            by_issue.sort_by_key(|c| (c.stream, c.issued));
            let mut prev_end: Vec<u64> = Vec::new();
            let mut spans = std::collections::HashMap::new();
            for c in by_issue {
                if let Some(d) = gpu_done.get(c.seg).copied().flatten() {
                    if prev_end.len() <= c.stream {
                        prev_end.resize(c.stream + 1, 0);
                    }
                    let began = prev_end[c.stream].max(c.issued);
                    spans.insert(c.seg, d.saturating_sub(began).max(1));
                    prev_end[c.stream] = prev_end[c.stream].max(d);
                }
            }
            let mut busy = 0u64;
            let (mut first_issue, mut last_done) = (u64::MAX, 0u64);
            for c in &copies {
                first_issue = first_issue.min(c.issued);
                let done = gpu_done.get(c.seg).copied().flatten();
                let mut l = format!(
                    "{p}     seg {:>4} s{}/c{}: {:>9.3} -> {:>9.3}",
                    c.seg,
                    c.slot,
                    c.stream,
                    rel(c.ready),
                    rel(c.issued)
                );
                if let Some(d) = done {
                    let span = spans.get(&c.seg).copied().unwrap_or(1);
                    busy += span;
                    last_done = last_done.max(d);
                    let _ = write!(
                        l,
                        " -> {:>9.3}  {:>9} B in {} runs{}, {:.1} GB/s",
                        rel(d),
                        c.bytes,
                        c.runs,
                        parts(c.parts),
                        c.bytes as f64 / span as f64 / 1e3
                    );
                } else {
                    let _ = write!(l, "  {:>9} B in {} runs{}", c.bytes, c.runs, parts(c.parts));
                }
                let _ = writeln!(s, "{l}");
            }
            if last_done > 0 && first_issue < last_done {
                let span = last_done - first_issue;
                let _ = writeln!(
                    s,
                    "{p}   copy engine: first issue {:.3}, last done {:.3}, busy {:.3} of {:.3} ms ({:.0}%); before the first issue {:.3} ms, after the last done {:.3} ms",
                    rel(first_issue),
                    rel(last_done),
                    ms(busy),
                    ms(span),
                    busy as f64 * 100.0 / span as f64,
                    rel(first_issue),
                    ms(end.saturating_sub(last_done))
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_by_one_table() {
        assert_eq!(parse("timing"), Some(true));
        assert_eq!(parse(" TIMING "), Some(true));
        assert_eq!(parse("off"), Some(false));
        assert_eq!(parse("0"), Some(false));
        assert_eq!(parse("1"), None, "a bare 1 does not say what to trace");
        assert_eq!(parse("verbose"), None);
    }

    #[test]
    fn a_job_block_shows_workers_pins_and_copies_in_job_time() {
        let t = JobTrace {
            label: "test".into(),
            start: 1_000,
            io: (0..3)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
            who: (0..3).map(|_| AtomicU32::new(0)).collect(),
            workers: (0..3).map(|_| WorkerTrace::default()).collect(),
            pins: Mutex::new(vec![(0, usize::MAX, 1_500, 2_300, 32 << 20)]),
            copies: Mutex::new(vec![
                CopyTrace {
                    seg: 1,
                    slot: 1,
                    stream: 0,
                    ready: 3_000,
                    issued: 3_010,
                    bytes: 32 << 20,
                    runs: 1,
                    parts: 1,
                },
                CopyTrace {
                    seg: 0,
                    slot: 0,
                    stream: 0,
                    ready: 2_000,
                    issued: 2_300,
                    bytes: 32 << 20,
                    runs: 1,
                    parts: 1,
                },
            ]),
            notes: Mutex::new(vec![(1_200, "alloc done".into())]),
            first_pass_tasks: AtomicU64::new(2),
        };
        t.workers[0].entered.store(1_010, Ordering::Relaxed);
        for (i, (a, b)) in [(1_020u64, 1_520u64), (1_030, 1_600), (2_500, 2_900)]
            .into_iter()
            .enumerate()
        {
            t.io[i][0].store(a, Ordering::Relaxed);
            t.io[i][1].store(b, Ordering::Relaxed);
            t.who[i].store(1, Ordering::Relaxed);
        }
        let s = t.render(64 << 20, &[Some(2_900), Some(3_600)], 4_000);
        assert!(s.contains("job test: 67108864 B in 3.000 ms"), "{s}");
        assert!(s.contains("     0.200  alloc done"), "{s}");
        assert!(
            s.contains("slot 0 page-locked 32 MiB by the caller: 0.500-1.300 (0.800 ms)"),
            "{s}"
        );
        // Segment 0 ran on the GPU from its issue (1.300) to 1.900: 33554432 B in 0.6 ms.
        assert!(s.contains("55.9 GB/s"), "{s}");
        // Segment 1: from its issue (2.010) to 2.600.
        assert!(s.contains("56.9 GB/s"), "{s}");
        let seg0 = s.find("seg    0").unwrap();
        let seg1 = s.find("seg    1").unwrap();
        assert!(seg0 < seg1, "copies in segment order: {s}");
        assert!(s.contains("first pass of the ring: n 2 mean 0.535"), "{s}");
        assert!(s.contains("later: n 1 mean 0.400"), "{s}");
        assert!(s.lines().all(|l| l.starts_with("gpudirect-trace")), "{s}");
    }

    /// A stream runs its copies in issue order, which need not be the segments' order (a
    /// segment past the first pass may be read, and its copies issued, before an earlier
    /// one): each copy's span starts where the copy issued before it on its stream ended.
    /// Taken in segment order instead, segment 0 (issued second) got the span of both copies
    /// (28.4 GB/s) and segment 1 none ("33554.4 GB/s"), and the busy time counted both.
    #[test]
    fn copies_issued_out_of_segment_order_get_their_own_spans() {
        let copy = |seg: usize, issued: u64| CopyTrace {
            seg,
            slot: seg,
            stream: 0,
            ready: issued - 10,
            issued,
            bytes: 32 << 20,
            runs: 1,
            parts: 1,
        };
        let t = JobTrace {
            label: "test".into(),
            start: 1_000,
            io: Vec::new(),
            who: Vec::new(),
            workers: Vec::new(),
            pins: Mutex::new(Vec::new()),
            copies: Mutex::new(vec![copy(1, 2_010), copy(0, 2_020)]),
            notes: Mutex::new(Vec::new()),
            first_pass_tasks: AtomicU64::new(0),
        };
        // Segment 1 runs 2.010-2.600, segment 0 after it, 2.600-3.200.
        let s = t.render(64 << 20, &[Some(3_200), Some(2_600)], 4_000);
        assert_eq!(s.matches("56.9 GB/s").count(), 1, "{s}");
        assert_eq!(s.matches("55.9 GB/s").count(), 1, "{s}");
        assert!(!s.contains("33554.4"), "{s}");
        assert!(s.contains("busy 1.190 of 1.190 ms (100%)"), "{s}");
    }
}

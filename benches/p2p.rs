//! P2P benchmark on two GPUs (plain `main`, `harness = false`): 1 GiB copies GPU0 -> GPU1, medians
//! of interleaved repetitions (every method once per repetition, order alternating), each sample
//! `GPUDIRECT_BENCH_COPIES` (4) back-to-back copies timed with CUDA events:
//! - gpudirect `copy_peer_async` of cudarc-allocated (pool) buffers, holding a `PeerAccess`;
//! - plain cudarc `memcpy_dtod` without `PeerAccess` (host-staged) and with it;
//! - raw `cuMemcpyPeerAsync` one way, and both ways at once (one stream per GPU), raw and gpudirect;
//! - the SM path (copy kernel reading / writing peer memory).
//!
//! Ratios are printed to torch `copy_` (scripts/bench-p2p-torch.py, run by this program when
//! found, or `GPUDIRECT_TORCH_GBPS=<GB/s>`) and to the NVLink limit 18 x 26.5625 = 478 GB/s.
//! Targets: gpudirect one way >= 0.98x torch; gpudirect both ways >= 0.98x raw CUDA both ways.
//!
//! `cargo bench --bench p2p` (run from the repository root so scripts/ is found)

use std::process::Command;

use gpudirect::p2p::{PairBench, PeerAccess, SmDirection};

/// The H200 NVLink limit per direction: 18 links x 26.5625 GB/s (nvidia-smi nvlink -s).
const LINK_LIMIT_H200_GBPS: f64 = 18.0 * 26.5625;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn env_usize(name: &str, d: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(d)
}

fn torch_baseline(bytes: usize) -> Option<f64> {
    if let Some(g) = std::env::var("GPUDIRECT_TORCH_GBPS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return Some(g);
    }
    let script = std::env::var("GPUDIRECT_TORCH_SCRIPT")
        .unwrap_or_else(|_| "scripts/bench-p2p-torch.py".into());
    if !std::path::Path::new(&script).exists() {
        println!("torch baseline: {script} not found (run from the repository root or set GPUDIRECT_TORCH_GBPS)");
        return None;
    }
    let out = Command::new("python3")
        .arg(&script)
        .env("GPUDIRECT_BENCH_BYTES", bytes.to_string())
        .output();
    match out {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout);
            let line = text
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))?;
            println!("torch baseline: {line}");
            let v: serde_json::Value = serde_json::from_str(line).ok()?;
            v["torch_one_way_gbps"].as_f64()
        }
        Err(e) => {
            println!("torch baseline: cannot run python3 {script}: {e}");
            None
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    GdOneWay,
    CudarcDirect,
    RawOneWay,
    RawBidir,
    GdBidir,
    SmRead,
    SmWrite,
}

const CASES: [Case; 7] = [
    Case::GdOneWay,
    Case::CudarcDirect,
    Case::RawOneWay,
    Case::RawBidir,
    Case::GdBidir,
    Case::SmRead,
    Case::SmWrite,
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = match gpudirect::cuda::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("p2p bench skipped: {e}");
            return Ok(());
        }
    };
    if n < 2 {
        println!("p2p bench skipped: needs 2 GPUs, found {n}");
        return Ok(());
    }
    let bytes = env_usize("GPUDIRECT_BENCH_BYTES", 1 << 30);
    let reps = env_usize("GPUDIRECT_BENCH_REPS", 7);
    let copies = env_usize("GPUDIRECT_BENCH_COPIES", 4);
    let torch = torch_baseline(bytes);

    let mut bench = PairBench::new(0, 1, bytes)?;
    let (a, b) = (bench.contexts().0.clone(), bench.contexts().1.clone());
    let mut staged = Vec::new();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    for rep in 0..reps {
        // Without PeerAccess: cudarc's plain memcpy_dtod is host-staged (one copy: it is slow).
        staged.push(bench.ce_cudarc(1)?);
        let access = PeerAccess::both_ways(&a, &b)?;
        let order: Vec<usize> = if rep % 2 == 0 {
            (0..CASES.len()).collect()
        } else {
            (0..CASES.len()).rev().collect()
        };
        for i in order {
            let g = match CASES[i] {
                Case::GdOneWay => bench.ce_gpudirect(copies)?,
                Case::CudarcDirect => bench.ce_cudarc(copies)?,
                Case::RawOneWay => bench.ce_raw(copies)?,
                Case::RawBidir => {
                    let (x, y) = bench.ce_bidirectional_raw(copies)?;
                    x + y
                }
                Case::GdBidir => {
                    let (x, y) = bench.ce_bidirectional_gpudirect(copies)?;
                    x + y
                }
                Case::SmRead => bench.sm_copy(SmDirection::Read, copies)?,
                Case::SmWrite => bench.sm_copy(SmDirection::Write, copies)?,
            };
            samples[i].push(g);
        }
        assert!(
            bench.destination_matches()?,
            "GPU1 holds different bytes than GPU0 sent"
        );
        drop(access);
    }
    let med: Vec<f64> = samples.iter_mut().map(|v| median(v)).collect();
    let staged_m = median(&mut staged);
    let get = |c: Case| med[CASES.iter().position(|x| *x == c).expect("case")];
    let link = LINK_LIMIT_H200_GBPS;
    println!();
    println!(
        "p2p bench: {} MiB copies GPU0 -> GPU1, {copies} copies per sample, median of {reps} interleaved samples",
        bytes >> 20
    );
    println!(
        "{:<46}{:>10}{:>12}{:>12}",
        "method", "GB/s", "x link", "x torch"
    );
    let row = |name: &str, g: f64, link_mult: f64| {
        let t = torch.map_or_else(|| "-".to_string(), |t| format!("{:.3}", g / t));
        println!("{name:<46}{g:>10.1}{:>12.3}{t:>12}", g / (link * link_mult));
    };
    row(
        "gpudirect copy_peer (pool buffers, PeerAccess)",
        get(Case::GdOneWay),
        1.0,
    );
    row(
        "cudarc memcpy_dtod without PeerAccess (staged)",
        staged_m,
        1.0,
    );
    row(
        "cudarc memcpy_dtod with PeerAccess",
        get(Case::CudarcDirect),
        1.0,
    );
    row("raw cuMemcpyPeerAsync one way", get(Case::RawOneWay), 1.0);
    row(
        "raw cuMemcpyPeerAsync both ways (sum)",
        get(Case::RawBidir),
        2.0,
    );
    row(
        "gpudirect copy_peer both ways (sum)",
        get(Case::GdBidir),
        2.0,
    );
    row("SM copy kernel, GPU1 reads GPU0", get(Case::SmRead), 1.0);
    row("SM copy kernel, GPU0 writes GPU1", get(Case::SmWrite), 1.0);
    if let Some(t) = torch {
        row("torch copy_ (scripts/bench-p2p-torch.py)", t, 1.0);
    }
    println!("(both-ways rows: x link is against 2 x {link:.1} GB/s)");
    let one_way = torch.map(|t| get(Case::GdOneWay) / t);
    let both = get(Case::GdBidir) / get(Case::RawBidir);
    match one_way {
        Some(r) => println!(
            "target one way: gpudirect/torch = {r:.3} ({})",
            if r >= 0.98 {
                "MET >= 0.98"
            } else {
                "MISSED < 0.98"
            }
        ),
        None => println!("target one way: no torch baseline"),
    }
    println!(
        "target both ways: gpudirect/raw = {both:.3} ({})",
        if both >= 0.98 {
            "MET >= 0.98"
        } else {
            "MISSED < 0.98"
        }
    );
    let json = serde_json::json!({
        "bytes": bytes, "reps": reps, "copies": copies,
        "gpudirect_one_way_gbps": get(Case::GdOneWay),
        "cudarc_staged_gbps": staged_m,
        "cudarc_direct_gbps": get(Case::CudarcDirect),
        "raw_one_way_gbps": get(Case::RawOneWay),
        "raw_bidir_gbps": get(Case::RawBidir),
        "gpudirect_bidir_gbps": get(Case::GdBidir),
        "sm_read_gbps": get(Case::SmRead),
        "sm_write_gbps": get(Case::SmWrite),
        "torch_one_way_gbps": torch,
        "link_limit_gbps": link,
    });
    println!("{json}");
    Ok(())
}

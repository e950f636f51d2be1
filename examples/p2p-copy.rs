//! Shows a GPU→GPU copy of cudarc buffers reporting its path: first without peer access (the
//! driver stages it through host memory), then holding a `PeerAccess` (direct over NVLink/PCIe),
//! each timed so the claim can be checked against the clock; prints the topology first.
//!
//! Needs two peer-capable CUDA GPUs (without them it prints what it found and exits 0).
//!
//! `cargo run --release --example p2p-copy [MiB]` (default 256 MiB)

use std::process::ExitCode;

use gpudirect::p2p::{timed_copy_peer_with, CopyOptions, PeerAccess, Topology};
use gpudirect::FallbackPolicy;

const USAGE: &str = "\
usage: p2p-copy [MIB]

Copies MIB (default 256) of cudarc buffers GPU0 -> GPU1, first without peer access (staged
through host memory), then holding a PeerAccess (direct), each timed, with the path each copy
reports; prints the topology first. Without two GPUs it prints what it found and exits 0.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let mib = match args.as_slice() {
        [] => 256,
        [a] => match a.parse::<usize>() {
            Ok(v) if v > 0 => v,
            _ => {
                eprintln!("p2p-copy: {a:?} is not a positive number of MiB\n\n{USAGE}");
                return ExitCode::from(64);
            }
        },
        _ => {
            eprintln!("p2p-copy: too many arguments\n\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    match run(mib) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("p2p-copy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(mib: usize) -> Result<(), Box<dyn std::error::Error>> {
    let topo = match Topology::probe() {
        Ok(t) => t,
        Err(e) => {
            println!("no CUDA topology here: {e}");
            return Ok(());
        }
    };
    println!("{topo}");
    if topo.devices.len() < 2 {
        println!("this example needs two GPUs; found {}", topo.devices.len());
        return Ok(());
    }
    let (a, b) = (gpudirect::cuda::context(0)?, gpudirect::cuda::context(1)?);
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let n = mib << 20;
    let host: Vec<u8> = (0..n).map(|i| (i * 31 + 7) as u8).collect();
    let src = sa.clone_htod(&host)?;
    let mut dst = sb.alloc_zeros::<u8>(n)?;
    let allow = CopyOptions {
        policy: Some(FallbackPolicy::Allow),
        ..CopyOptions::default()
    };
    let t = timed_copy_peer_with(&src, &mut dst, &sb, &allow)?;
    println!(
        "without PeerAccess: {mib} MiB GPU0 -> GPU1 at {:.1} GB/s, path: {}{}",
        t.gbps,
        t.report.path,
        if t.suspect { " [slow: staged?]" } else { "" }
    );
    let _access = PeerAccess::both_ways(&a, &b)?;
    let _ = timed_copy_peer_with(&src, &mut dst, &sb, &allow)?; // warm-up
    let t = timed_copy_peer_with(&src, &mut dst, &sb, &allow)?;
    println!(
        "with PeerAccess:    {mib} MiB GPU0 -> GPU1 at {:.1} GB/s, path: {}{}",
        t.gbps,
        t.report.path,
        if t.suspect {
            " [far below the link's expectation]"
        } else {
            ""
        }
    );
    let back = sb.clone_dtoh(&dst)?;
    println!(
        "bytes checked: {}",
        if back == host {
            "all equal"
        } else {
            "MISMATCH"
        }
    );
    if back != host {
        return Err("copied bytes differ".into());
    }
    Ok(())
}

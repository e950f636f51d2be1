//! Prints nvbandwidth-style matrices for every pair of peer-capable GPUs: copy-engine bandwidth
//! one way and both ways at once, SM (kernel) read and write bandwidth, 8-byte CE and SM
//! pointer-chase latency, and each rate's ratio to the link limit.
//!
//! Needs two peer-capable CUDA GPUs (without them it prints what it found and exits 0).
//!
//! `cargo run --release --example p2p-bandwidth [MiB per copy] [copies per sample] [samples]`
//! (defaults: 512 MiB, 8, 3)

use std::process::ExitCode;

use gpudirect::p2p::{measure, BandwidthOptions, Topology};

const USAGE: &str = "\
usage: p2p-bandwidth [MIB [COPIES [SAMPLES]]]

Prints nvbandwidth-style matrices for every pair of peer-capable GPUs (copy-engine bandwidth
one way and both ways, SM read and write bandwidth, CE and SM latency, ratios to the link
limit). MIB per copy (default 512), COPIES per sample (default 8), SAMPLES (default 3).
Without two GPUs it prints what it found and exits 0.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let mut n = [512, 8, 3];
    if args.len() > n.len() {
        eprintln!("p2p-bandwidth: too many arguments\n\n{USAGE}");
        return ExitCode::from(64);
    }
    for (slot, a) in n.iter_mut().zip(&args) {
        match a.parse::<usize>() {
            Ok(v) if v > 0 => *slot = v,
            _ => {
                eprintln!("p2p-bandwidth: {a:?} is not a positive number\n\n{USAGE}");
                return ExitCode::from(64);
            }
        }
    }
    let opts = BandwidthOptions {
        bytes: n[0] << 20,
        iterations: n[1],
        repetitions: n[2],
        ..BandwidthOptions::default()
    };
    match run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("p2p-bandwidth: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(opts: &BandwidthOptions) -> gpudirect::Result<()> {
    let topo = match Topology::probe() {
        Ok(t) => t,
        Err(e) => {
            println!("no CUDA topology here: {e}");
            return Ok(());
        }
    };
    println!("{topo}");
    if topo.devices.len() < 2 {
        println!(
            "bandwidth between GPUs needs two GPUs; found {}",
            topo.devices.len()
        );
        return Ok(());
    }
    let m = measure(opts)?;
    if m.pairs.is_empty() {
        println!("no pair of these GPUs can access each other (cuDeviceCanAccessPeer = 0)");
        return Ok(());
    }
    println!("{m}");
    Ok(())
}

//! Prints nvbandwidth-style matrices for every pair of peer-capable GPUs: copy-engine bandwidth
//! one way and both ways at once, SM (kernel) read and write bandwidth, 8-byte CE and SM
//! pointer-chase latency, and each rate's ratio to the link limit.
//!
//! Needs two peer-capable CUDA GPUs (without them it prints what it found and exits 0).
//!
//! `cargo run --release --example p2p-bandwidth [MiB per copy] [copies per sample] [samples]`
//! (defaults: 512 MiB, 8, 3)

use gpudirect::p2p::{measure, BandwidthOptions, Topology};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, d: usize| -> Result<usize, std::num::ParseIntError> {
        std::env::args().nth(i).map_or(Ok(d), |s| s.parse())
    };
    let opts = BandwidthOptions {
        bytes: arg(1, 512)? << 20,
        iterations: arg(2, 8)?,
        repetitions: arg(3, 3)?,
        ..BandwidthOptions::default()
    };
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
    let m = measure(&opts)?;
    if m.pairs.is_empty() {
        println!("no pair of these GPUs can access each other (cuDeviceCanAccessPeer = 0)");
        return Ok(());
    }
    println!("{m}");
    Ok(())
}

//! Shows a GPU→GPU copy of cudarc buffers reporting its path: first without peer access (the
//! driver stages it through host memory), then holding a `PeerAccess` (direct over NVLink/PCIe),
//! each timed so the claim can be checked against the clock; prints the topology first.
//!
//! Needs two peer-capable CUDA GPUs (without them it prints what it found and exits 0).
//!
//! `cargo run --release --example p2p-copy [MiB]` (default 256 MiB)

use gpudirect::p2p::{timed_copy_peer_with, CopyOptions, PeerAccess, Topology};
use gpudirect::FallbackPolicy;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(256);
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

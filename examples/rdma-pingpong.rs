//! rdma-pingpong: two processes connect RC queue pairs through gpudirect's token-checked TCP
//! exchange and bounce a message back and forth with SEND/RECV, checking every byte, like
//! `ibv_rc_pingpong`. Shows `Exchange`, `QueuePair::connect`, pre-posted receives and the
//! post-and-wait helpers.
//!
//! Needs an RDMA device (a NIC, or Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`).
//! Without one it prints why and exits 0.
//!
//! ```text
//! server: cargo run --release --example rdma-pingpong -- --bind 10.0.0.1 [--dev rxe0] [--gid-index 1]
//! client: cargo run --release --example rdma-pingpong -- 10.0.0.1 [--dev rxe0] [--gid-index 1]
//! options: --port 18515 --iters 1000 --size 4096 --token T (or GPUDIRECT_RDMA_TOKEN)
//! ```
//! The exchange hands the peer an rkey: bind to the network meant for it and use a real token.

use std::time::{Duration, Instant};

use gpudirect::rdma::*;
use rand::RngCore;

struct Args {
    server: Option<String>,
    bind: String,
    dev: Option<String>,
    gid_index: Option<u32>,
    port: u16,
    iters: u32,
    size: usize,
    token: String,
}

const USAGE: &str = "\
usage: rdma-pingpong [--bind IP] [--dev NAME] [--gid-index N] [--port P] [--iters N]
                     [--size BYTES] [--token T] [SERVER_IP]

Bounces a message between two processes over RC queue pairs with SEND/RECV, checking every
byte, like ibv_rc_pingpong: without SERVER_IP it serves on --bind (default 127.0.0.1), with it
it connects. Defaults: --port 18515, --iters 1000, --size 4096, --token $GPUDIRECT_RDMA_TOKEN
or gpudirect-pingpong. Without an RDMA device it says why and exits 0.";

/// The parsed command line, or `None` when it asked for the usage text.
fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        server: None,
        bind: "127.0.0.1".into(),
        dev: std::env::var("GPUDIRECT_RDMA_DEV").ok(),
        gid_index: std::env::var("GPUDIRECT_RDMA_GIDX")
            .ok()
            .and_then(|v| v.parse().ok()),
        port: 18515,
        iters: 1000,
        size: 4096,
        token: std::env::var("GPUDIRECT_RDMA_TOKEN")
            .unwrap_or_else(|_| "gpudirect-pingpong".into()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().ok_or(format!("{x} needs a value"));
        match x.as_str() {
            "--bind" => a.bind = val()?,
            "--dev" => a.dev = Some(val()?),
            "--gid-index" => {
                a.gid_index = Some(val()?.parse().map_err(|e| format!("--gid-index: {e}"))?)
            }
            "--port" => a.port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--size" => a.size = val()?.parse().map_err(|e| format!("--size: {e}"))?,
            "--token" => a.token = val()?,
            "-h" | "--help" => return Ok(None),
            s if !s.starts_with('-') => a.server = Some(s.to_string()),
            s => return Err(format!("unknown option {s}")),
        }
    }
    if a.size == 0 {
        return Err("--size must be at least 1".into());
    }
    Ok(Some(a))
}

fn main() -> std::process::ExitCode {
    let args = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("rdma-pingpong: {msg}\n\n{USAGE}");
            return std::process::ExitCode::from(64);
        }
    };
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdma-pingpong: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = match &args.dev {
        Some(d) => Context::open(d),
        None => Context::open_first(),
    };
    let ctx = match ctx {
        Ok(c) => c,
        Err(e) if e.is_absence() => {
            println!("rdma-pingpong: no RDMA device to run on: {e}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 64)?;
    let opts = QpOptions {
        gid_index: args.gid_index,
        ..QpOptions::default()
    };
    let mut qp = QueuePair::new(&pd, &cq, &cq, &opts)?;
    let access = AccessFlags::LOCAL_WRITE;
    let mut payload = vec![0u8; args.size];
    rand::rng().fill_bytes(&mut payload);
    let mut send = pd.register_host(payload, access)?;
    let mut recv = pd.register_host(vec![0u8; args.size], access)?;
    let ex = Exchange::new(args.token.as_bytes())?.with_timeout(Duration::from_secs(60));
    let is_server = args.server.is_none();
    // Post the first receive before connecting, so the peer's first message finds it.
    let post_recv = |qp: &QueuePair, recv: &mut MemoryRegion<Vec<u8>>| -> gpudirect::Result<()> {
        let sge = recv.sge(0..args.size)?;
        // SAFETY: `recv` is not read or written until this receive completes (waited for with
        // wait_recv below before every access), and it outlives the QP's use of it.
        unsafe { qp.post_recv(1, &[sge]) }
    };
    post_recv(&qp, &mut recv)?;
    let remote = if let Some(server) = &args.server {
        ex.connect((server.as_str(), args.port), &qp.local_record(None))?
    } else {
        let l = ex.listen((args.bind.as_str(), args.port))?;
        println!(
            "rdma-pingpong: {} waiting on {}",
            ctx.name(),
            l.local_addr()?
        );
        ex.serve(&l, &qp.local_record(None))?.0
    };
    qp.connect(&remote)?;
    println!(
        "rdma-pingpong: {} QP {} <-> remote QP {} (gid {}), {} x {} bytes",
        ctx.name(),
        qp.qpn(),
        remote.qpn,
        remote.gid,
        args.iters,
        args.size
    );
    let wait_recv = |cq: &CompletionQueue| -> gpudirect::Result<WorkCompletion> {
        let t0 = Instant::now();
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if cq.poll(&mut wc)? == 1 && wc[0].wr_id == 1 {
                return wc[0].ok();
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(gpudirect::Error::InvalidArgument(
                    "no message from the peer in 30 s".into(),
                ));
            }
            // Let the kernel's RDMA work (Soft-RoCE runs in softirq context) have the core.
            std::thread::yield_now();
        }
    };
    let mut echo = vec![0u8; args.size];
    let t0 = Instant::now();
    for i in 0..args.iters {
        if is_server {
            wait_recv(&cq)?;
            // Echo what came in (copied out of the receive buffer, into the send buffer).
            recv.copy_out(0, &mut echo)?;
            send.copy_in(0, &echo)?;
            post_recv(&qp, &mut recv)?;
            qp.send(&send, 0..args.size, None)?;
        } else {
            qp.send(&send, 0..args.size, None)?;
            let wc = wait_recv(&cq)?;
            if wc.byte_len as usize != args.size || recv.to_vec() != send.to_vec() {
                return Err(format!("iteration {i}: the echo differs from what was sent").into());
            }
            if i + 1 < args.iters {
                post_recv(&qp, &mut recv)?;
            }
        }
    }
    let dt = t0.elapsed();
    println!(
        "rdma-pingpong: {} round trips in {:.3} s = {:.1} us/iter, every byte checked",
        args.iters,
        dt.as_secs_f64(),
        dt.as_secs_f64() * 1e6 / args.iters.max(1) as f64
    );
    Ok(())
}

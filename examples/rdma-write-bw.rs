//! rdma-write-bw: RDMA WRITE bandwidth, like perftest's `ib_write_bw`, on gpudirect's verbs
//! layer, with the target buffers in host memory or, with `--use-cuda DEV`, in GPU memory
//! (a `GdrBuffer` registered through `GpuMemoryRegion`: dma-buf, else peermem).
//!
//! Needs an RDMA device (a NIC, or Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`), and
//! for `--use-cuda` a CUDA GPU plus a GPUDirect RDMA path to it. Without them it prints what is
//! missing and why, and exits 0.
//!
//! ```text
//! cargo run --release --example rdma-write-bw -- [--dev rxe0] [--gid-index 1]          # server
//! cargo run --release --example rdma-write-bw -- [--dev rxe0] [--gid-index 1] HOST     # client
//! cargo run --release --example rdma-write-bw -- --loopback [--use-cuda 0]             # one process
//! ```
//! Options: `--sizes 4096,65536,1048576` (message size sweep), `--iters N` (writes per size,
//! default 1000), `--tx-depth N` (outstanding writes, default 128), `--cq-mod N` (signal every
//! Nth write, default 100, as perftest), `--port P` (TCP port of the out-of-band exchange,
//! default 18515), `--bind ADDR` (where the server listens, default 127.0.0.1), `--token T`
//! (shared secret of the exchange, default `$GPUDIRECT_EXCHANGE_TOKEN` or `rdma-write-bw`),
//! `--verify` (the server checks every byte of each size's last write), `--use-cuda DEV`. Each size prints a table row and a machine-readable
//! `RESULT size=.. iters=.. gbps=.. mpps=.. path=..` line.
//!
//! Connection records go through gpudirect's token-checked TCP exchange
//! (`gpudirect::rdma::Exchange`); the record hands the peer an rkey that lets it write the
//! buffer, so bind the server to the interface meant for it and use a real token.

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpudirect::rdma::{
    AccessFlags, CompletionChannel, CompletionQueue, Context, Exchange, GdrBuffer, GpuMemoryRegion,
    MemoryRegion, ProtectionDomain, QpOptions, QueuePair, RemoteMemory, Sge, WorkCompletion,
};
use gpudirect::{Error, Result, TransferPath};

#[derive(Debug, Clone)]
struct Args {
    server: Option<String>,
    dev: Option<String>,
    gid_index: Option<u32>,
    port: u16,
    sizes: Vec<usize>,
    iters: usize,
    tx_depth: u32,
    cq_mod: u32,
    loopback: bool,
    use_cuda: Option<usize>,
    verify: bool,
    bind: String,
    token: String,
}

const USAGE: &str = "\
usage: rdma-write-bw [--dev NAME] [--gid-index N] [--port P] [--sizes A,B,..] [--iters N]
                     [--tx-depth N] [--cq-mod N] [--use-cuda DEV] [--verify] [--bind ADDR]
                     [--token T] [--loopback | SERVER]

RDMA WRITE bandwidth like perftest's ib_write_bw: without SERVER it serves (listening on
--bind, default 127.0.0.1), with SERVER it writes to it, with --loopback it runs both sides in
one process. --use-cuda DEV puts the buffers in GPU memory (dma-buf, else peermem). Defaults:
--sizes 65536, --iters 1000, --tx-depth 128, --cq-mod 100, --port 18515, --token
$GPUDIRECT_EXCHANGE_TOKEN or rdma-write-bw. Without an RDMA device it says what is missing
and exits 0.";

/// The parsed command line, or `None` when it asked for the usage text.
fn parse_args() -> std::result::Result<Option<Args>, String> {
    let mut a = Args {
        server: None,
        dev: std::env::var("GPUDIRECT_RDMA_DEV").ok(),
        gid_index: std::env::var("GPUDIRECT_RDMA_GIDX")
            .ok()
            .and_then(|v| v.parse().ok()),
        port: 18515,
        sizes: vec![65536],
        iters: 1000,
        tx_depth: 128,
        cq_mod: 100,
        loopback: false,
        use_cuda: None,
        verify: false,
        bind: "127.0.0.1".into(),
        token: std::env::var("GPUDIRECT_EXCHANGE_TOKEN").unwrap_or_else(|_| "rdma-write-bw".into()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--dev" | "-d" => a.dev = Some(val("--dev")?),
            "--gid-index" | "-x" => {
                a.gid_index = Some(
                    val("--gid-index")?
                        .parse()
                        .map_err(|e| format!("--gid-index: {e}"))?,
                )
            }
            "--port" | "-p" => {
                a.port = val("--port")?.parse().map_err(|e| format!("--port: {e}"))?
            }
            "--sizes" | "-s" => {
                a.sizes = val("--sizes")?
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--sizes {s}: {e}"))
                    })
                    .collect::<std::result::Result<_, _>>()?
            }
            "--iters" | "-n" => {
                a.iters = val("--iters")?
                    .parse()
                    .map_err(|e| format!("--iters: {e}"))?
            }
            "--tx-depth" | "-t" => {
                a.tx_depth = val("--tx-depth")?
                    .parse()
                    .map_err(|e| format!("--tx-depth: {e}"))?
            }
            "--cq-mod" | "-Q" => {
                a.cq_mod = val("--cq-mod")?
                    .parse()
                    .map_err(|e| format!("--cq-mod: {e}"))?
            }
            "--use-cuda" => {
                a.use_cuda = Some(
                    val("--use-cuda")?
                        .parse()
                        .map_err(|e| format!("--use-cuda: {e}"))?,
                )
            }
            "--bind" => a.bind = val("--bind")?,
            "--token" => a.token = val("--token")?,
            "--loopback" => a.loopback = true,
            "--verify" => a.verify = true,
            "--help" | "-h" => return Ok(None),
            s if !s.starts_with('-') && a.server.is_none() => a.server = Some(s.to_string()),
            s => return Err(format!("unknown argument {s} (try --help)")),
        }
    }
    if a.sizes.is_empty() || a.sizes.contains(&0) || a.sizes.iter().any(|&s| s > u32::MAX as usize)
    {
        return Err("--sizes must be 1 or more positive sizes below 4 GiB".into());
    }
    if a.iters == 0 || a.tx_depth == 0 || a.cq_mod == 0 {
        return Err("--iters, --tx-depth and --cq-mod must be positive".into());
    }
    // an unsignaled run longer than the send queue would never complete (perftest clamps too)
    a.cq_mod = a.cq_mod.min(a.tx_depth);
    Ok(Some(a))
}

/// The message buffer: host memory, or GPU memory registered for GPUDirect RDMA.
enum Buffer {
    Host(MemoryRegion<&'static mut [u8]>),
    Gpu(GpuMemoryRegion<GdrBuffer<u8>>),
}

impl Buffer {
    fn new(pd: &Arc<ProtectionDomain>, len: usize, use_cuda: Option<usize>) -> Result<Buffer> {
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        match use_cuda {
            None => {
                // Page-aligned, as perftest allocates (a malloc'ed Vec starts 16 bytes into a
                // page, and every MTU-sized packet then straddles two pages). Leaked: the
                // buffer lives as long as the process, which is what lets the region own a
                // `&'static mut` borrow of it.
                let raw: &'static mut [u8] = Box::leak(vec![0u8; len + 4096].into_boxed_slice());
                let off = raw.as_ptr().align_offset(4096);
                Ok(Buffer::Host(
                    pd.register_host(&mut raw[off..off + len], access)?,
                ))
            }
            Some(dev) => {
                let ctx = gpudirect::cuda::context(dev)?;
                let stream = ctx.default_stream();
                let buf = GdrBuffer::<u8>::zeroed(&stream, len)?;
                Ok(Buffer::Gpu(GpuMemoryRegion::register(pd, buf)?))
            }
        }
    }

    fn path(&self) -> String {
        match self {
            Buffer::Host(_) => format!("{} (ibv_reg_mr)", TransferPath::RdmaHostMemory),
            Buffer::Gpu(r) => {
                let mut s = r.path().to_string();
                for (p, c) in r.refused() {
                    s.push_str(&format!("; {p} refused: {c}"));
                }
                s
            }
        }
    }

    fn path_tag(&self) -> &'static str {
        match self {
            Buffer::Host(_) => "host",
            Buffer::Gpu(r) if r.path() == TransferPath::RdmaDmaBuf => "dmabuf",
            Buffer::Gpu(_) => "peermem",
        }
    }

    fn sge(&self, len: usize) -> Result<Sge> {
        match self {
            Buffer::Host(m) => m.sge(0..len),
            Buffer::Gpu(r) => r.sge(0..len),
        }
    }

    fn remote(&self) -> RemoteMemory {
        match self {
            Buffer::Host(m) => m.remote(),
            Buffer::Gpu(r) => r.remote(),
        }
    }

    fn fill(&mut self, data: &[u8]) -> Result<()> {
        match self {
            Buffer::Host(m) => m.copy_in(0, data),
            Buffer::Gpu(r) => {
                let stream = r.memory().stream().clone();
                let mut view = r.as_view_mut();
                let mut dst = view.slice_mut(0..data.len());
                stream
                    .memcpy_htod(data, &mut dst)
                    .and_then(|_| stream.synchronize())
                    .map_err(gpudirect::Error::from)
            }
        }
    }

    fn read(&self, len: usize) -> Result<Vec<u8>> {
        match self {
            Buffer::Host(m) => {
                let mut v = vec![0u8; len];
                m.copy_out(0, &mut v)?;
                Ok(v)
            }
            Buffer::Gpu(r) => {
                let mut v = vec![0u8; len];
                r.memory().copy_to_host(&mut v)?;
                Ok(v)
            }
        }
    }
}

/// Deterministic, size-dependent, never-constant bytes (xorshift).
fn pattern(size: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (size as u64).wrapping_mul(0x1000_0000_01B3);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

struct Endpoint {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    buf: Buffer,
    /// Note completions polled while waiting for something else.
    stash: RefCell<Vec<WorkCompletion>>,
}

fn endpoint(
    ctx: &Arc<Context>,
    pd: &Arc<ProtectionDomain>,
    a: &Args,
    len: usize,
) -> Result<Endpoint> {
    let channel = CompletionChannel::new(ctx)?;
    let cq = CompletionQueue::with_channel(ctx, a.tx_depth * 2 + 16, &channel)?;
    let opts = QpOptions {
        gid_index: a.gid_index,
        max_send_wr: a.tx_depth,
        ..QpOptions::default()
    };
    let qp = QueuePair::new(pd, &cq, &cq, &opts)?;
    let buf = Buffer::new(pd, len, a.use_cuda)?;
    Ok(Endpoint {
        qp,
        cq,
        buf,
        stash: RefCell::new(Vec::new()),
    })
}

/// One size: `iters` writes of `size` bytes, up to `tx_depth` in flight, every `cq_mod`-th
/// (and the last) signaled. Returns the elapsed time.
fn run_size(ep: &Endpoint, remote: RemoteMemory, size: usize, a: &Args) -> Result<Duration> {
    let sge = [ep.buf.sge(size)?];
    let target = RemoteMemory {
        addr: remote.addr,
        len: size as u64,
        rkey: remote.rkey,
    };
    let mut posted = 0usize;
    let mut completed = 0usize;
    let mut wcs = [WorkCompletion::default(); 16];
    let cq_mod = a.cq_mod as usize;
    let t0 = Instant::now();
    while completed < a.iters {
        while posted < a.iters && posted - completed < a.tx_depth as usize {
            let signaled = (posted + 1).is_multiple_of(cq_mod) || posted + 1 == a.iters;
            // SAFETY: the buffer stays registered and unmodified until every write completed:
            // this loop returns only after the last (signaled) completion, which on an RC QP
            // follows every earlier write's completion.
            unsafe { ep.qp.post_write(posted as u64 + 1, &sge, target, signaled) }?;
            posted += 1;
        }
        let n = ep.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            let wc = wc.ok()?;
            if wc.wr_id >= NOTE_ID {
                ep.stash.borrow_mut().push(wc);
                continue;
            }
            // a signaled completion retires its id and every unsignaled write before it
            completed = completed.max(wc.wr_id as usize);
        }
        if n == 0 && t0.elapsed() > Duration::from_secs(120) {
            return Err(Error::InvalidArgument(format!(
                "timed out: {completed} of {} writes of {size} bytes completed in 120 s",
                a.iters
            )));
        }
    }
    Ok(t0.elapsed())
}

fn report(size: usize, a: &Args, dt: Duration, path: &str) {
    let secs = dt.as_secs_f64();
    let gbps = (size * a.iters) as f64 * 8.0 / secs / 1e9;
    let mpps = a.iters as f64 / secs / 1e6;
    println!(" {size:<10} {:<14} {gbps:<20.3} {mpps:.6}", a.iters);
    println!(
        "RESULT size={size} iters={} gbps={gbps:.4} mpps={mpps:.6} path={path}",
        a.iters
    );
}

// ---- after the exchange, each size ends with a zero-length SEND with immediate (client:
// size index; server: 1 = verified or not asked, 0 = mismatch); RC delivers it after the writes.

const NOTE_ID: u64 = 1 << 40;

/// Waits until the completion `id` arrives (successful), keeping other notes for later.
/// Notes are rare, so this sleeps in the kernel on the CQ's completion channel instead of
/// spinning (a spinning passive side steals the CPU that a software RDMA device, or a peer on
/// the same host, needs; ib_write_bw's server sleeps in a blocking read).
fn wait_wc(ep: &Endpoint, id: u64, what: &str) -> Result<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut wcs = [WorkCompletion::default(); 4];
    let mut drain = |ep: &Endpoint| -> Result<usize> {
        let n = ep.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            ep.stash.borrow_mut().push(wc.ok()?);
        }
        Ok(n)
    };
    loop {
        {
            let mut st = ep.stash.borrow_mut();
            if let Some(i) = st.iter().position(|w| w.wr_id == id) {
                return Ok(st.swap_remove(i));
            }
        }
        if drain(ep)? > 0 {
            continue;
        }
        ep.cq.req_notify(false)?;
        if drain(ep)? > 0 {
            continue; // landed between the poll and the arming
        }
        let fd = ep.cq.channel().map(|c| c.as_raw_fd()).unwrap_or(-1);
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the call's duration.
        let r = unsafe { libc::poll(&mut pfd, 1, 1000) };
        if r > 0 {
            ep.cq.wait_event()?; // readable: returns at once, and acknowledges the event
        }
        if Instant::now() > deadline {
            return Err(Error::InvalidArgument(format!(
                "timed out waiting for {what}"
            )));
        }
    }
}

fn note(ep: &Endpoint, value: u32) -> Result<()> {
    // SAFETY: no memory is named (zero scatter/gather entries).
    unsafe { ep.qp.post_send(NOTE_ID, &[], Some(value), true) }?;
    wait_wc(ep, NOTE_ID, "the send of a note").map(|_| ())
}

fn post_note_recv(ep: &Endpoint, id: u64) -> Result<()> {
    // SAFETY: no memory is named (zero scatter/gather entries).
    unsafe { ep.qp.post_recv(NOTE_ID + 1 + id, &[]) }
}

fn wait_note(ep: &Endpoint, id: u64) -> Result<u32> {
    let wc = wait_wc(ep, NOTE_ID + 1 + id, "the peer's note")?;
    Ok(wc.imm_data.unwrap_or(u32::MAX))
}

fn open(a: &Args) -> Result<(Arc<Context>, Arc<ProtectionDomain>)> {
    let ctx = match &a.dev {
        Some(d) => Context::open(d)?,
        None => Context::open_first()?,
    };
    let pd = ProtectionDomain::new(&ctx)?;
    Ok((ctx, pd))
}

fn header(ctx: &Context, ep: &Endpoint, a: &Args, role: &str) {
    println!(
        "---------------------------------------------------------------------------------------"
    );
    println!(
        " gpudirect rdma-write-bw ({role}), device {}, QPN {:#x}",
        ctx.name(),
        ep.qp.qpn()
    );
    println!(" buffer registration: {}", ep.buf.path());
    println!(
        " iterations {}, tx depth {}, signal every {}",
        a.iters, a.tx_depth, a.cq_mod
    );
    println!(
        "---------------------------------------------------------------------------------------"
    );
    println!(" #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]");
}

fn server(a: &Args) -> Result<()> {
    let max = *a.sizes.iter().max().unwrap_or(&1);
    let (ctx, pd) = open(a)?;
    let mut ep = endpoint(&ctx, &pd, a, max)?;
    let ex = Exchange::new(a.token.clone())?.with_timeout(Duration::from_secs(120));
    let listener = ex.listen((a.bind.as_str(), a.port))?;
    eprintln!("waiting for a client on {}:{} ...", a.bind, a.port);
    for i in 0..a.sizes.len() {
        post_note_recv(&ep, i as u64)?;
    }
    let (remote, peer) = ex.serve(&listener, &ep.qp.local_record(Some(ep.buf.remote())))?;
    ep.qp.connect(&remote)?;
    header(&ctx, &ep, a, &format!("server, client {peer}"));
    let mut bad = 0;
    for (i, &size) in a.sizes.iter().enumerate() {
        // the client's note says its writes of this size are done
        let idx = wait_note(&ep, i as u64)?;
        if idx != i as u32 {
            return Err(Error::InvalidArgument(format!(
                "out of step: note {idx}, expected {i}"
            )));
        }
        let ok = if a.verify {
            let got = ep.buf.read(size)?;
            let want = pattern(size, size);
            let diff = got.iter().zip(&want).filter(|(x, y)| x != y).count();
            if diff == 0 {
                println!("verify {size} bytes: OK (every byte)");
            } else {
                println!("verify {size} bytes: {diff} bytes differ");
                bad += 1;
            }
            ep.buf.fill(&vec![0u8; size])?; // cleared before the client may write the next size
            diff == 0
        } else {
            true
        };
        note(&ep, ok as u32)?;
    }
    if bad > 0 {
        return Err(Error::InvalidArgument(format!(
            "{bad} size(s) failed verification"
        )));
    }
    Ok(())
}

fn client(a: &Args, host: &str) -> Result<()> {
    let max = *a.sizes.iter().max().unwrap_or(&1);
    let (ctx, pd) = open(a)?;
    let mut ep = endpoint(&ctx, &pd, a, max)?;
    let ex = Exchange::new(a.token.clone())?.with_timeout(Duration::from_secs(120));
    for i in 0..a.sizes.len() {
        post_note_recv(&ep, i as u64)?;
    }
    let remote = ex.connect((host, a.port), &ep.qp.local_record(Some(ep.buf.remote())))?;
    ep.qp.connect(&remote)?;
    header(&ctx, &ep, a, &format!("client of {host}"));
    let tag = ep.buf.path_tag();
    let mut bad = 0;
    for (i, &size) in a.sizes.iter().enumerate() {
        if a.verify {
            ep.buf.fill(&pattern(size, size))?;
        }
        let dt = run_size(&ep, remote.remote(), size, a)?;
        report(size, a, dt, tag);
        note(&ep, i as u32)?;
        if wait_note(&ep, i as u64)? != 1 {
            println!("server reports a data mismatch at {size} bytes");
            bad += 1;
        }
    }
    if bad > 0 {
        return Err(Error::InvalidArgument(format!(
            "{bad} size(s) failed verification"
        )));
    }
    Ok(())
}

fn loopback(a: &Args) -> Result<()> {
    let max = *a.sizes.iter().max().unwrap_or(&1);
    let (ctx, pd) = open(a)?;
    let mut src = endpoint(&ctx, &pd, a, max)?;
    let mut dst = endpoint(&ctx, &pd, a, max)?;
    let rs = src.qp.local_record(Some(src.buf.remote()));
    let rd = dst.qp.local_record(Some(dst.buf.remote()));
    src.qp.connect(&rd)?;
    dst.qp.connect(&rs)?;
    header(&ctx, &src, a, "loopback");
    let tag = src.buf.path_tag();
    let mut bad = 0;
    for &size in &a.sizes {
        let want = pattern(size, size);
        src.buf.fill(&want)?;
        let dt = run_size(&src, rd.remote(), size, a)?;
        report(size, a, dt, tag);
        let got = dst.buf.read(size)?;
        if got != want {
            println!("verify {size} bytes: MISMATCH");
            bad += 1;
        }
    }
    if bad > 0 {
        return Err(Error::InvalidArgument(format!(
            "{bad} size(s) failed verification"
        )));
    }
    Ok(())
}

/// What can be shown without a NIC: the GPU side of `--use-cuda` (allocation, dma-buf export).
fn gpu_half(dev: usize) {
    let r = gpudirect::cuda::context(dev).and_then(|ctx| {
        let buf = GdrBuffer::<u8>::alloc(&ctx.default_stream(), 1 << 20)?;
        let info = gpudirect::rdma::pointer_info(buf.device_ptr())?;
        let exp = gpudirect::rdma::export_dmabuf(&buf, 0..buf.len())?;
        Ok((info, exp.plan))
    });
    match r {
        Ok((info, plan)) => println!(
            "rdma-write-bw: GPU {dev} half works: GdrBuffer gdr_capable={} pool={}, dma-buf exported (range {:#x}+{}, offset {})",
            info.gdr_capable, info.from_pool, plan.export_start, plan.export_len, plan.offset
        ),
        Err(e) => println!("rdma-write-bw: GPU {dev}: {e}"),
    }
}

fn main() -> std::process::ExitCode {
    let a = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("rdma-write-bw: {msg}\n\n{USAGE}");
            return std::process::ExitCode::from(64);
        }
    };
    let r = if a.loopback {
        loopback(&a)
    } else if let Some(host) = a.server.clone() {
        client(&a, &host)
    } else {
        server(&a)
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.is_absence() => {
            // The hardware (or a direct path to it) is not here: say what is missing and why.
            println!("rdma-write-bw: cannot run here: {e}");
            if let Some(dev) = a.use_cuda {
                gpu_half(dev);
                println!("rdma-write-bw: GPU buffers need an RDMA device plus a dma-buf- or peermem-capable path to the GPU (the GDR probe says which: cargo run --example doctor)");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rdma-write-bw: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

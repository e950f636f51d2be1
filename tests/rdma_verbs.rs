//! Tier-2 tests of the verbs layer on a real RDMA device (Soft-RoCE in the VM harness,
//! `scripts/rdma-vm-test`, or a NIC). Run with `cargo test --test rdma_verbs -- --ignored`.
//!
//! Environment: `GPUDIRECT_RDMA_DEV` (device name, default: the first), `GPUDIRECT_RDMA_GIDX`
//! (GID index, default: selected), and for the two-VM test `GPUDIRECT_RDMA_ROLE=server|client`,
//! `GPUDIRECT_RDMA_IP` (this side), `GPUDIRECT_RDMA_PEER` (the server).
//! Without a device every test fails with a setup hint.

use std::sync::Arc;
use std::time::Duration;

use gpudirect::rdma::*;
use gpudirect::{Cause, Error};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const HINT: &str = "needs an RDMA device: run scripts/rdma-vm-test (Soft-RoCE VM), or create one (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0) and set GPUDIRECT_RDMA_DEV / GPUDIRECT_RDMA_GIDX";

fn gid_index() -> Option<u32> {
    std::env::var("GPUDIRECT_RDMA_GIDX").ok().map(|v| {
        v.trim()
            .parse()
            .expect("GPUDIRECT_RDMA_GIDX must be a number")
    })
}

fn open() -> Arc<Context> {
    let r = match std::env::var("GPUDIRECT_RDMA_DEV") {
        Ok(d) if !d.is_empty() => Context::open(&d),
        _ => Context::open_first(),
    };
    r.unwrap_or_else(|e| panic!("{HINT}: {e}"))
}

fn qp_options() -> QpOptions {
    QpOptions {
        gid_index: gid_index(),
        wait_timeout: Duration::from_secs(20),
        ..QpOptions::default()
    }
}

const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);

struct Pair {
    pd: Arc<ProtectionDomain>,
    a: QueuePair,
    b: QueuePair,
}

/// Two RC QPs on one device, connected to each other (loopback), each with its own CQ.
fn pair() -> Pair {
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let (ca, cb) = (
        CompletionQueue::new(&ctx, 256).unwrap(),
        CompletionQueue::new(&ctx, 256).unwrap(),
    );
    let mut a = QueuePair::new(&pd, &ca, &ca, &qp_options()).unwrap();
    let mut b = QueuePair::new(&pd, &cb, &cb, &qp_options()).unwrap();
    let (ra, rb) = (a.local_record(None), b.local_record(None));
    a.connect(&rb).unwrap();
    b.connect(&ra).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Rts);
    assert_eq!(b.state().unwrap(), QpState::Rts);
    Pair { pd, a, b }
}

fn random_vec(rng: &mut impl RngCore, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

const SIZES: &[usize] = &[1, 7, 4096, 65_537, (1 << 20) + 3];

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_device_port_and_gid_queries() {
    let ctx = open();
    let devs = devices().unwrap();
    assert!(devs.iter().any(|d| d.name == ctx.name()), "{devs:?}");
    let dev = ctx.query_device().unwrap();
    assert!(
        dev.max_qp > 0 && dev.max_cqe > 0 && dev.phys_port_cnt >= 1,
        "{dev:?}"
    );
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active, "{port:?}");
    assert!(port.active_mtu.is_some(), "{port:?}");
    let table = ctx.gid_table(1).unwrap();
    assert!(!table.is_empty());
    let sel = ctx.select_gid(1).unwrap();
    println!(
        "{} port 1: {port:?}\nGIDs: {table:#?}\nselected: {sel:?}",
        ctx.name()
    );
    if port.link_layer == LinkLayer::Ethernet {
        assert_eq!(sel.gid_type, GidType::RoceV2, "{sel:?}");
        if table.iter().any(|e| e.gid.is_ipv4_mapped()) {
            assert!(sel.gid.is_ipv4_mapped(), "{sel:?}");
        }
        if let Some(i) = gid_index() {
            assert_eq!(sel.index, i, "the harness's GID index and ours differ");
        }
    }
    let e = ctx.query_gid(1, sel.index).unwrap();
    assert_eq!(e.gid, sel.gid);
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_write_and_read_byte_for_byte() {
    let p = pair();
    let mut rng = rand::rng();
    for &n in SIZES {
        let (off_src, off_dst) = (rng.random_range(0..64usize), rng.random_range(0..64usize));
        let src =
            p.pd.register_host(random_vec(&mut rng, n + off_src), ACCESS)
                .unwrap();
        let before = random_vec(&mut rng, n + off_dst + 17);
        let dst = p.pd.register_host(before.clone(), ACCESS).unwrap();
        let wc =
            p.a.write(
                &src,
                off_src..off_src + n,
                dst.remote().offset(off_dst as u64),
            )
            .unwrap();
        assert_eq!(wc.opcode, WcOpcode::RDMA_WRITE);
        let got = dst.to_vec();
        assert_eq!(
            first_diff(&got[off_dst..off_dst + n], &src.to_vec()[off_src..]),
            None,
            "RDMA write of {n} bytes"
        );
        assert_eq!(
            &got[..off_dst],
            &before[..off_dst],
            "bytes before the target changed"
        );
        assert_eq!(
            &got[off_dst + n..],
            &before[off_dst + n..],
            "bytes after the target changed"
        );

        // Read it back through the other QP into a third buffer.
        let mut back =
            p.pd.register_host(random_vec(&mut rng, n + 5), ACCESS)
                .unwrap();
        let wc =
            p.b.read(&mut back, 5..5 + n, dst.remote().offset(off_dst as u64))
                .unwrap();
        assert_eq!(wc.opcode, WcOpcode::RDMA_READ);
        assert_eq!(
            first_diff(&back.to_vec()[5..], &src.to_vec()[off_src..]),
            None,
            "RDMA read of {n} bytes"
        );
        // Explicit teardown gives the buffers back.
        let back = back.close().map_err(|(_, e)| e).unwrap();
        assert_eq!(back.len(), n + 5);
    }
    p.a.close().map_err(|(_, e)| e).unwrap();
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_send_and_recv_byte_for_byte() {
    let p = pair();
    let mut rng = rand::rng();
    for &n in SIZES {
        let src = p.pd.register_host(random_vec(&mut rng, n), ACCESS).unwrap();
        // Raw API: post the receive first (the buffer outlives the WR: we wait for it below).
        let dst =
            p.pd.register_host(random_vec(&mut rng, n + 100), ACCESS)
                .unwrap();
        let sge = dst.sge(0..n + 100).unwrap();
        // SAFETY: `dst` is not touched until the receive completes below.
        unsafe { p.b.post_recv(42, &[sge]) }.unwrap();
        p.a.send(&src, 0..n, None).unwrap();
        let wc = wait(&p.b, 42);
        assert_eq!(wc.opcode, WcOpcode::RECV);
        assert_eq!(wc.byte_len as usize, n);
        assert_eq!(
            first_diff(&dst.to_vec()[..n], &src.to_vec()),
            None,
            "send of {n} bytes"
        );

        // Safe API: the receiver blocks in recv on its own thread.
        let mut dst2 = p.pd.register_host(random_vec(&mut rng, n), ACCESS).unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| p.b.recv(&mut dst2, 0..n).unwrap());
            p.a.send(&src, 0..n, Some(0xabcd_0123)).unwrap();
            let wc = h.join().unwrap();
            assert_eq!(wc.imm_data, Some(0xabcd_0123));
            assert_eq!(wc.byte_len as usize, n);
        });
        assert_eq!(first_diff(&dst2.to_vec(), &src.to_vec()), None);
    }
}

fn wait(qp: &QueuePair, wr_id: u64) -> WorkCompletion {
    let t0 = std::time::Instant::now();
    let mut wc = [WorkCompletion::default(); 4];
    loop {
        let n = qp.recv_cq().poll(&mut wc).unwrap();
        if let Some(w) = wc[..n].iter().find(|w| w.wr_id == wr_id) {
            return w.ok().unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no completion for wr {wr_id}"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_write_with_immediate_notifies_the_peer() {
    let p = pair();
    let mut rng = rand::rng();
    for &n in &[1usize, 4099, 300_001] {
        let src = p.pd.register_host(random_vec(&mut rng, n), ACCESS).unwrap();
        let dst = p.pd.register_host(random_vec(&mut rng, n), ACCESS).unwrap();
        let mut note = p.pd.register_host(vec![0u8; 1], ACCESS).unwrap();
        let imm: u32 = rng.random();
        std::thread::scope(|s| {
            // An empty receive: write-with-immediate consumes it and carries only `imm`.
            let h = s.spawn(|| p.b.recv(&mut note, 0..0).unwrap());
            p.a.write_with_imm(&src, 0..n, dst.remote(), imm).unwrap();
            let wc = h.join().unwrap();
            assert_eq!(wc.opcode, WcOpcode::RECV_RDMA_WITH_IMM);
            assert_eq!(wc.imm_data, Some(imm));
            assert_eq!(wc.byte_len as usize, n);
        });
        assert_eq!(
            first_diff(&dst.to_vec(), &src.to_vec()),
            None,
            "write-with-imm of {n} bytes"
        );
    }
}

fn expect_wc_error(r: gpudirect::Result<WorkCompletion>, want: WcStatus) {
    match r {
        Err(Error::WorkCompletion { status, .. }) => {
            assert_eq!(status, want, "got {status}, want {want}")
        }
        other => panic!("expected a {want} completion, got {other:?}"),
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_bad_rkey_is_a_remote_access_error() {
    let p = pair();
    let mut rng = rand::rng();
    let src =
        p.pd.register_host(random_vec(&mut rng, 4096), ACCESS)
            .unwrap();
    let dst =
        p.pd.register_host(random_vec(&mut rng, 4096), ACCESS)
            .unwrap();
    let before = dst.to_vec();
    let mut bad = dst.remote();
    bad.rkey ^= 0x00ff_ff00;
    expect_wc_error(p.a.write(&src, 0..4096, bad), WcStatus::REM_ACCESS_ERR);
    assert_eq!(
        p.a.state().unwrap(),
        QpState::Err,
        "a failed RC work request moves the QP to ERR"
    );
    assert_eq!(&dst.to_vec(), &before[..], "a refused write changed memory");
    // Every later WR on the errored QP is flushed, as a typed error too.
    expect_wc_error(p.a.write(&src, 0..16, dst.remote()), WcStatus::WR_FLUSH_ERR);
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_out_of_bounds_write_and_read_are_remote_access_errors() {
    let mut rng = rand::rng();
    let p = pair();
    let src =
        p.pd.register_host(random_vec(&mut rng, 8192), ACCESS)
            .unwrap();
    let dst =
        p.pd.register_host(random_vec(&mut rng, 4096), ACCESS)
            .unwrap();
    let before = dst.to_vec();
    // 4096 bytes starting 100 bytes before the end of the 4096-byte region.
    expect_wc_error(
        p.a.write(&src, 0..4096, dst.remote().offset(4096 - 100)),
        WcStatus::REM_ACCESS_ERR,
    );
    assert_eq!(&dst.to_vec(), &before[..]);

    let mut p = pair();
    let ro =
        p.pd.register_host(
            random_vec(&mut rng, 4096),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    // Reading past the end is refused the same way.
    let mut back = p.pd.register_host(vec![0u8; 8192], ACCESS).unwrap();
    expect_wc_error(
        p.b.read(&mut back, 0..8192, ro.remote()),
        WcStatus::REM_ACCESS_ERR,
    );
    // And writing into a region without REMOTE_WRITE.
    p = pair();
    let ro =
        p.pd.register_host(
            random_vec(&mut rng, 4096),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    let src =
        p.pd.register_host(random_vec(&mut rng, 64), ACCESS)
            .unwrap();
    expect_wc_error(
        p.a.write(&src, 0..64, ro.remote()),
        WcStatus::REM_ACCESS_ERR,
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_queue_pair_misuse_is_typed() {
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let mut rng = rand::rng();
    let mr = pd
        .register_host(random_vec(&mut rng, 4096), ACCESS)
        .unwrap();
    let mut a = QueuePair::new(&pd, &cq, &cq, &qp_options()).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Init);

    // Posting a send before the QP is connected.
    match a.write(&mr, 0..64, mr.remote()) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("connect it first"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    // A local range outside the region.
    assert!(matches!(mr.sge(0..4097), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        a.write(&mr, 4000..5000, mr.remote()),
        Err(Error::InvalidArgument(_))
    ));
    // Too many scatter/gather entries.
    let sge = mr.sge(0..8).unwrap();
    // SAFETY: refused before anything is posted.
    let r = unsafe { a.post_recv(1, &[sge, sge]) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    // A record without a GID on RoCE, or with a 25-bit QPN.
    let mut b = QueuePair::new(&pd, &cq, &cq, &qp_options()).unwrap();
    let mut rb = b.local_record(None);
    if ctx.query_port(1).unwrap().link_layer == LinkLayer::Ethernet {
        let mut no_gid = rb;
        no_gid.gid = Gid::default();
        assert!(matches!(a.connect(&no_gid), Err(Error::InvalidArgument(_))));
    }
    let mut big = rb;
    big.qpn = 1 << 24;
    assert!(matches!(a.connect(&big), Err(Error::InvalidArgument(_))));
    // Connecting works once.
    a.connect(&rb).unwrap();
    match a.connect(&rb) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("connect works once"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    rb = a.local_record(None);
    b.connect(&rb).unwrap();
    // A GID index the port does not have: the errno from libibverbs.
    let bad = QpOptions {
        gid_index: Some(250),
        ..qp_options()
    };
    match QueuePair::new(&pd, &cq, &cq, &bad) {
        Err(Error::Verbs { op, source }) => println!("gid index 250: {op}: {source}"),
        other => panic!("expected Error::Verbs for GID index 250, got {other:?}"),
    }
    // Registration misuse.
    assert!(matches!(
        pd.register_host(Vec::new(), ACCESS),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pd.register_host(vec![1u8; 16], AccessFlags::REMOTE_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    // A wrong lkey: a local protection error, as a typed completion error.
    let src = pd.register_host(random_vec(&mut rng, 256), ACCESS).unwrap();
    let dst = pd.register_host(random_vec(&mut rng, 256), ACCESS).unwrap();
    let mut bad_sge = src.sge(0..256).unwrap();
    bad_sge.lkey ^= 0x00ff_ff00;
    // SAFETY: `src` outlives the wait below.
    unsafe { a.post_write(7, &[bad_sge], dst.remote(), true) }.unwrap();
    let t0 = std::time::Instant::now();
    let mut wc = [WorkCompletion::default(); 4];
    let got = loop {
        let n = cq.poll(&mut wc).unwrap();
        if let Some(w) = wc[..n].iter().find(|w| w.wr_id == 7) {
            break *w;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no completion for the bad lkey"
        );
    };
    match got.ok() {
        Err(Error::WorkCompletion { wr_id: 7, status }) => {
            println!("bad lkey: {status}");
            // NICs report LOC_PROT_ERR; rxe (Linux 6.1) reports LOC_QP_OP_ERR [measured in
            // the VM].
            assert!(
                [WcStatus::LOC_PROT_ERR, WcStatus::LOC_QP_OP_ERR].contains(&status),
                "{status}"
            );
        }
        other => panic!("expected a local protection error, got {other:?}"),
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_dmabuf_registration_on_soft_roce_is_unsupported() {
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let len = 1 << 20;
    // Any fd reaches the provider check first on rxe/siw (rdma-core 44 has no reg_dmabuf_mr op
    // for them); a memfd is not a dma-buf, so a provider that has the op refuses it otherwise.
    // SAFETY: memfd_create with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"gpudirect-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is ours.
    assert_eq!(unsafe { libc::ftruncate(fd, len as i64) }, 0);
    // SAFETY: the fd stays open until after the call; on success the region is dropped at once.
    let r = unsafe { pd.register_dmabuf_raw(0, len, 0x10_0000, fd, ACCESS) };
    // SAFETY: closing our own fd.
    unsafe { libc::close(fd) };
    let soft = ctx.name().starts_with("rxe") || ctx.name().starts_with("siw");
    match r {
        Err(Error::Unsupported {
            cause: Cause::DmaBufUnsupported { detail },
            what,
        }) => {
            println!("{what}: {detail}");
            assert!(soft || !ctx.name().is_empty());
            assert!(
                detail.contains("not supported") || detail.contains("95"),
                "{detail}"
            );
        }
        Err(e @ Error::Verbs { .. }) if !soft => println!("{}: memfd refused: {e}", ctx.name()),
        other => panic!(
            "{}: expected Unsupported(DmaBufUnsupported), got {other:?}",
            ctx.name()
        ),
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_completion_channel_signals_an_event() {
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let ch = CompletionChannel::new(&ctx).unwrap();
    ch.set_nonblocking(true).unwrap();
    let ca = CompletionQueue::with_channel(&ctx, 64, &ch).unwrap();
    let cb = CompletionQueue::new(&ctx, 64).unwrap();
    let mut a = QueuePair::new(&pd, &ca, &ca, &qp_options()).unwrap();
    let mut b = QueuePair::new(&pd, &cb, &cb, &qp_options()).unwrap();
    let (ra, rb) = (a.local_record(None), b.local_record(None));
    a.connect(&rb).unwrap();
    b.connect(&ra).unwrap();
    // Nothing pending yet.
    match ca.wait_event() {
        Err(Error::Verbs { source, .. }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EAGAIN), "{source}")
        }
        other => panic!("expected EAGAIN on an idle non-blocking channel, got {other:?}"),
    }
    let mut rng = rand::rng();
    let src = pd
        .register_host(random_vec(&mut rng, 1000), ACCESS)
        .unwrap();
    let dst = pd
        .register_host(random_vec(&mut rng, 1000), ACCESS)
        .unwrap();
    ca.req_notify(false).unwrap();
    a.write(&src, 0..1000, dst.remote()).unwrap();
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&*ch),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "the channel fd did not become readable");
    ca.wait_event().unwrap();
    assert_eq!(&dst.to_vec(), &src.to_vec());
}

/// The TCP exchange between two processes: this test re-runs itself as a child (env
/// `GPUDIRECT_RDMA_CHILD=<port>`), which RDMA-writes seeded data into the parent's region with
/// immediate; the parent checks every byte.
#[test]
#[ignore = "needs an RDMA device"]
fn rdma_two_process_exchange_and_write() {
    const TOKEN: &str = "gpudirect-two-process-test";
    const N: usize = 300_007;
    let seed: u64 = match std::env::var("GPUDIRECT_RDMA_SEED") {
        Ok(s) => s.parse().unwrap(),
        Err(_) => rand::rng().random(),
    };
    let expected = random_vec(&mut StdRng::seed_from_u64(seed), N);
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let mut qp = QueuePair::new(&pd, &cq, &cq, &qp_options()).unwrap();
    let ex = Exchange::new(TOKEN)
        .unwrap()
        .with_timeout(Duration::from_secs(60));

    if let Ok(port) = std::env::var("GPUDIRECT_RDMA_CHILD") {
        // Child: connect, write the seeded bytes with immediate, done.
        let src = pd.register_host(expected.clone(), ACCESS).unwrap();
        let remote = ex
            .connect(
                ("127.0.0.1", port.parse::<u16>().unwrap()),
                &qp.local_record(None),
            )
            .unwrap();
        qp.connect(&remote).unwrap();
        assert_eq!(remote.len as usize, N);
        qp.write_with_imm(&src, 0..N, remote.remote(), 0x600d)
            .unwrap();
        return;
    }

    let mut dst = pd
        .register_host(random_vec(&mut rand::rng(), N), ACCESS)
        .unwrap();
    let listener = ex.listen("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "rdma_two_process_exchange_and_write",
            "--exact",
            "--include-ignored",
            "--nocapture",
        ])
        .env("GPUDIRECT_RDMA_CHILD", port.to_string())
        .env("GPUDIRECT_RDMA_SEED", seed.to_string())
        .spawn()
        .unwrap();
    let (remote, _) = ex
        .serve(&listener, &qp.local_record(Some(dst.remote())))
        .unwrap();
    qp.connect(&remote).unwrap();
    let wc = qp.recv(&mut dst, 0..0).unwrap();
    assert_eq!(wc.imm_data, Some(0x600d));
    assert_eq!(wc.byte_len as usize, N);
    assert_eq!(
        first_diff(&dst.to_vec(), &expected),
        None,
        "bytes written by the child"
    );
    let st = child.wait().unwrap();
    assert!(st.success(), "child failed: {st}");
}

/// Two machines (the harness's two VMs): `GPUDIRECT_RDMA_ROLE=server` listens on
/// `GPUDIRECT_RDMA_IP`, `client` connects to `GPUDIRECT_RDMA_PEER`. The client reads the
/// server's seeded bytes, then writes its own with immediate; the server checks them.
#[test]
#[ignore = "needs an RDMA device"]
fn rdma_pair_exchange_read_and_write_across_machines() {
    const TOKEN: &str = "gpudirect-rdma-pair-test";
    const PORT: u16 = 18_517;
    const N: usize = 1_048_573;
    let role = std::env::var("GPUDIRECT_RDMA_ROLE").unwrap_or_else(|_| {
        panic!("{HINT}; this test also needs two machines: GPUDIRECT_RDMA_ROLE=server|client, GPUDIRECT_RDMA_IP, GPUDIRECT_RDMA_PEER (scripts/rdma-vm-test runs it in two VMs)")
    });
    let server_data = random_vec(&mut StdRng::seed_from_u64(1), N);
    let client_data = random_vec(&mut StdRng::seed_from_u64(2), N);
    let ctx = open();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let mut qp = QueuePair::new(&pd, &cq, &cq, &qp_options()).unwrap();
    let ex = Exchange::new(TOKEN)
        .unwrap()
        .with_timeout(Duration::from_secs(120));
    match role.as_str() {
        "server" => {
            let ip = std::env::var("GPUDIRECT_RDMA_IP").expect("GPUDIRECT_RDMA_IP");
            let mut mr = pd.register_host(server_data.clone(), ACCESS).unwrap();
            let listener = ex.listen((ip.as_str(), PORT)).unwrap();
            let (remote, peer) = ex
                .serve(&listener, &qp.local_record(Some(mr.remote())))
                .unwrap();
            println!("server: peer {peer}, qpn {}", remote.qpn);
            qp.connect(&remote).unwrap();
            let wc = qp.recv(&mut mr, 0..0).unwrap();
            assert_eq!(wc.imm_data, Some(0xc11e));
            assert_eq!(
                first_diff(&mr.to_vec(), &client_data),
                None,
                "client's write"
            );
        }
        "client" => {
            let peer = std::env::var("GPUDIRECT_RDMA_PEER").expect("GPUDIRECT_RDMA_PEER");
            let mut mr = pd.register_host(vec![0u8; N], ACCESS).unwrap();
            let remote = ex
                .connect((peer.as_str(), PORT), &qp.local_record(None))
                .unwrap();
            qp.connect(&remote).unwrap();
            qp.read(&mut mr, 0..N, remote.remote()).unwrap();
            assert_eq!(
                first_diff(&mr.to_vec(), &server_data),
                None,
                "server's bytes, read"
            );
            mr.copy_in(0, &client_data).unwrap();
            qp.write_with_imm(&mr, 0..N, remote.remote(), 0xc11e)
                .unwrap();
        }
        r => panic!("GPUDIRECT_RDMA_ROLE={r}: use server or client"),
    }
}

/// librdmacm end to end in one process: a listener thread and a client resolve, connect and
/// accept through `rdma_cm` (QPs moved by `rdma_init_qp_attr`), the records travel as private
/// data, and the client RDMA-writes with immediate into the server's region.
#[test]
#[ignore = "needs an RDMA device"]
fn rdma_cm_connect_accept_and_write() {
    use gpudirect::rdma::cm::{CmEventType, CmId, ConnParam, EventChannel};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    const N: usize = 200_003;
    const T: Duration = Duration::from_secs(30);
    let ctx = open();
    let ip: IpAddr = match std::env::var("GPUDIRECT_RDMA_IP") {
        Ok(ip) => ip.parse().expect("GPUDIRECT_RDMA_IP"),
        Err(_) => {
            let g = ctx.select_gid(1).unwrap_or_else(|e| panic!("{HINT}: {e}"));
            assert!(
                g.gid.is_ipv4_mapped(),
                "set GPUDIRECT_RDMA_IP: the GID {} is not an IPv4 address",
                g.gid
            );
            IpAddr::V4(Ipv4Addr::new(
                g.gid.0[12],
                g.gid.0[13],
                g.gid.0[14],
                g.gid.0[15],
            ))
        }
    };
    drop(ctx);
    let addr = SocketAddr::new(ip, 18_520);
    let data = random_vec(&mut rand::rng(), N);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();

    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let ch = EventChannel::new().unwrap();
            let listen = CmId::new(&ch).unwrap();
            listen.bind(addr).unwrap();
            listen.listen(4).unwrap();
            ready_tx.send(()).unwrap();
            let mut ev = ch.expect(CmEventType::CONNECT_REQUEST, T).unwrap();
            let id = ev.take_id().unwrap();
            let client = ConnectionRecord::from_prefix(&ev.private_data()).unwrap();
            drop(ev);
            let ctx = id.context().unwrap();
            let pd = ProtectionDomain::new(&ctx).unwrap();
            let cq = CompletionQueue::new(&ctx, 64).unwrap();
            let opts = QpOptions {
                port: id.port(),
                ..qp_options()
            };
            let qp = QueuePair::new(&pd, &cq, &cq, &opts).unwrap();
            let mut mr = pd
                .register_host(random_vec(&mut rand::rng(), N), ACCESS)
                .unwrap();
            id.transition(&qp, QpState::Rtr).unwrap();
            let rec = qp.local_record(Some(mr.remote()));
            let param = ConnParam {
                private_data: rec.to_bytes().to_vec(),
                ..ConnParam::default()
            };
            id.accept(&qp, &param).unwrap();
            drop(ch.expect(CmEventType::ESTABLISHED, T).unwrap());
            id.transition(&qp, QpState::Rts).unwrap();
            assert_eq!(qp.state().unwrap(), QpState::Rts);
            let wc = qp.recv(&mut mr, 0..0).unwrap();
            assert_eq!(wc.imm_data, Some(0xc0ffee));
            assert_eq!(
                first_diff(&mr.to_vec(), &data),
                None,
                "bytes written over rdma_cm"
            );
            drop(ch.expect(CmEventType::DISCONNECTED, T).unwrap());
            client.qpn
        });

        ready_rx
            .recv_timeout(T)
            .expect("the listener thread failed");
        let ch = EventChannel::new().unwrap();
        let id = CmId::new(&ch).unwrap();
        id.resolve_addr(None, addr, Duration::from_secs(5)).unwrap();
        drop(ch.expect(CmEventType::ADDR_RESOLVED, T).unwrap());
        id.resolve_route(Duration::from_secs(5)).unwrap();
        drop(ch.expect(CmEventType::ROUTE_RESOLVED, T).unwrap());
        let ctx = id.context().unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cq = CompletionQueue::new(&ctx, 64).unwrap();
        let opts = QpOptions {
            port: id.port(),
            ..qp_options()
        };
        let qp = QueuePair::new(&pd, &cq, &cq, &opts).unwrap();
        let src = pd.register_host(data.clone(), ACCESS).unwrap();
        let param = ConnParam {
            private_data: qp.local_record(None).to_bytes().to_vec(),
            ..ConnParam::default()
        };
        id.connect(&qp, &param).unwrap();
        let ev = ch.expect(CmEventType::CONNECT_RESPONSE, T).unwrap();
        let server_rec = ConnectionRecord::from_prefix(&ev.private_data()).unwrap();
        drop(ev);
        id.transition(&qp, QpState::Rtr).unwrap();
        id.transition(&qp, QpState::Rts).unwrap();
        id.establish().unwrap();
        qp.write_with_imm(&src, 0..N, server_rec.remote(), 0xc0ffee)
            .unwrap();
        // Let the server see the data before tearing down.
        std::thread::sleep(Duration::from_millis(200));
        id.disconnect().unwrap();
        drop(ch.expect(CmEventType::DISCONNECTED, T).unwrap());
        assert_eq!(
            server.join().unwrap(),
            qp.qpn(),
            "the server got our QPN as private data"
        );
    });
}

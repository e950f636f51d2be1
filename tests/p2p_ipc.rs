//! Tier 2: device memory shared between two processes, one per GPU. The test binary re-executes
//! itself as the child (GPU 1) with `GPUDIRECT_P2P_IPC_CHILD=<socket>`; the parent (GPU 0)
//! exports `cuMemAlloc` memory (legacy IPC handle) and pool memory (pool fd over SCM_RIGHTS +
//! exported pointer); the child maps both, checks the path, reads every byte and writes back at
//! an odd offset, which the parent checks. `multi_gpu_ipc_vmm_fd_across_processes` does the same
//! for VMM memory (`cuMemCreate`, exported as a POSIX fd with `cuMemExportToShareableHandle`).
//! Run:
//! `cargo test --release --test p2p_ipc -- --ignored --test-threads=1`

mod common;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use gpudirect::p2p::ipc::{
    self, ImportedPool, IpcMapping, IpcMemHandle, PoolPointer, SharedPool, VmmImport,
};
use gpudirect::p2p::{copy_peer, plan_copy, DeviceBuffer, MemoryKind, VmmBuffer};
use rand::{Rng, SeedableRng};

const CHILD_ENV: &str = "GPUDIRECT_P2P_IPC_CHILD";
const VMM_CHILD_ENV: &str = "GPUDIRECT_P2P_IPC_VMM_CHILD";
use common::{test_dir, TWO_GPU_HINT as HINT2};
const LEGACY_LEN: usize = 3 * (1 << 20) + 77;
const POOL_LEN: usize = 5 * (1 << 20) + 3;
const WB_OFF: usize = 5;
const VMM_LEN: usize = 3 * (1 << 20) + 12345;
const VMM_SEED: u64 = 0x5eed_0005;
const VMM_WB_SEED: u64 = 0x5eed_0006;

fn seeded(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill(&mut v[..]);
    v
}

fn send(s: &mut UnixStream, b: &[u8]) {
    s.write_all(&(b.len() as u32).to_le_bytes()).unwrap();
    s.write_all(b).unwrap();
}

fn recv(s: &mut UnixStream) -> Vec<u8> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)
        .expect("the other process went away: see its output above");
    let mut b = vec![0u8; u32::from_le_bytes(n) as usize];
    s.read_exact(&mut b).unwrap();
    b
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_ipc_two_process() {
    if let Ok(sock) = std::env::var(CHILD_ENV) {
        child(&sock);
        return;
    }
    let n = gpudirect::cuda::device_count().unwrap_or_else(|e| panic!("{HINT2}: {e}"));
    assert!(n >= 2, "{HINT2}: this process sees {n} device(s)");
    let a = gpudirect::cuda::context(0).unwrap();
    let sa = a.default_stream();

    let sock_path = test_dir().join(format!("gpudirect-p2p-ipc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock_path);
    let listener = UnixListener::bind(&sock_path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args([
            "multi_gpu_ipc_two_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &sock_path)
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(st) = kid.try_wait().unwrap() {
                    panic!("the child exited before connecting: {st}");
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "child never connected"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();

    // 1. cuMemAlloc memory through a legacy IPC handle.
    let data = seeded(1, LEGACY_LEN);
    let mut legacy = DeviceBuffer::<u8>::alloc_zeros(&sa, LEGACY_LEN).unwrap();
    sa.memcpy_htod(&data, &mut legacy.as_view_mut()).unwrap();
    sa.synchronize().unwrap();
    // SAFETY: `legacy` lives until after the child said "ok legacy", which it sends after
    // dropping its mapping.
    let handle = unsafe { IpcMemHandle::export(&legacy) }.unwrap();
    send(&mut conn, &handle.to_bytes());
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says {reply}");
    assert!(reply.starts_with("ok legacy"), "{reply}");
    let got = sa.clone_dtoh(legacy.slice()).unwrap();
    let wb = seeded(2, LEGACY_LEN - 2 * WB_OFF);
    assert_eq!(&got[..WB_OFF], &data[..WB_OFF]);
    assert_eq!(
        &got[WB_OFF..LEGACY_LEN - WB_OFF],
        &wb[..],
        "child's write-back"
    );
    assert_eq!(&got[LEGACY_LEN - WB_OFF..], &data[LEGACY_LEN - WB_OFF..]);

    // 2. Pool memory: pool fd over SCM_RIGHTS, then the exported pointer.
    let pool = SharedPool::new(&a).unwrap();
    let mut slice = pool.alloc_zeros::<u8>(&sa, POOL_LEN).unwrap();
    let pdata = seeded(3, POOL_LEN);
    sa.memcpy_htod(&pdata, &mut slice).unwrap();
    sa.synchronize().unwrap();
    let fd = pool.export_fd().unwrap();
    ipc::send_fd(&conn, fd.as_fd(), b"pool").unwrap();
    // SAFETY: `slice` lives until after the child said "ok pool", which it sends after
    // dropping its mapping.
    let ptr = unsafe { pool.export_pointer(&slice) }.unwrap();
    send(&mut conn, &ptr.to_bytes());
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says {reply}");
    assert!(reply.starts_with("ok pool"), "{reply}");
    let got = sa.clone_dtoh(&slice).unwrap();
    let wb = seeded(4, POOL_LEN - 2 * WB_OFF);
    assert_eq!(&got[..WB_OFF], &pdata[..WB_OFF]);
    assert_eq!(
        &got[WB_OFF..POOL_LEN - WB_OFF],
        &wb[..],
        "child's write-back"
    );
    assert_eq!(&got[POOL_LEN - WB_OFF..], &pdata[POOL_LEN - WB_OFF..]);
    drop(slice);
    drop(pool);
    send(&mut conn, b"bye");
    let st = kid.wait().unwrap();
    let _ = std::fs::remove_file(&sock_path);
    assert!(st.success(), "child failed: {st}");
}

fn child(sock: &str) {
    let b = gpudirect::cuda::context(1).unwrap_or_else(|e| panic!("child: {HINT2}: {e}"));
    let sb = b.default_stream();
    let mut conn = UnixStream::connect(sock).unwrap();

    // 1. Legacy handle.
    let h = IpcMemHandle::from_bytes(&recv(&mut conn)).unwrap();
    let mut m = IpcMapping::<u8>::open(&sb, &h).unwrap();
    println!(
        "child: legacy mapping of GPU {} memory: {}",
        m.owner_device(),
        m.path()
    );
    assert!(m.path().is_direct(), "{}", m.path());
    let legacy_msg = check_and_write_back(&sb, &mut m, 1, 2);
    drop(m);
    send(&mut conn, format!("ok legacy: {legacy_msg}").as_bytes());

    // 2. Pool fd and pointer.
    let mut tag = [0u8; 4]; // exactly the tag: never read into the next frame
    let (fd, n) = ipc::recv_fd(&conn, &mut tag).unwrap();
    assert_eq!(&tag[..n], b"pool");
    let pool = ImportedPool::from_fd(&b, fd).unwrap();
    let p = PoolPointer::from_bytes(&recv(&mut conn)).unwrap();
    let mut m = pool.import::<u8>(&sb, &p).unwrap();
    println!(
        "child: pool mapping of GPU {} memory: {}",
        m.owner_device(),
        m.path()
    );
    assert!(m.path().is_direct(), "{}", m.path());
    let pool_msg = check_and_write_back(&sb, &mut m, 3, 4);
    drop(m);
    drop(pool);
    send(&mut conn, format!("ok pool: {pool_msg}").as_bytes());
    assert_eq!(recv(&mut conn), b"bye");
}

/// Copies the mapping into local memory with copy_peer (checking the reported path and every
/// byte), then writes seeded bytes back into the mapping at an odd offset.
fn check_and_write_back(
    sb: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>,
    m: &mut IpcMapping<u8>,
    seed: u64,
    wb_seed: u64,
) -> String {
    let n = m.len();
    let want = seeded(seed, n);
    let mut local = sb.alloc_zeros::<u8>(n).unwrap();
    let rep = copy_peer(&m.as_view(), &mut local, sb).unwrap();
    assert_eq!(rep.src_memory, MemoryKind::Imported);
    assert!(rep.path.is_direct(), "read path: {}", rep.path);
    assert_eq!(
        sb.clone_dtoh(&local).unwrap(),
        want,
        "bytes read through IPC"
    );
    let wb = seeded(wb_seed, n - 2 * WB_OFF);
    let src = sb.clone_htod(&wb).unwrap();
    let mut dst = m.as_view_mut();
    let mut dst = dst.slice_mut(WB_OFF..n - WB_OFF);
    let rep2 = copy_peer(&src, &mut dst, sb).unwrap();
    assert!(rep2.path.is_direct(), "write path: {}", rep2.path);
    sb.synchronize().unwrap();
    format!(
        "read {} ({}), wrote back {} bytes ({})",
        n,
        rep.path,
        wb.len(),
        rep2.path
    )
}

/// Spawns this test binary as the child running `test` with `env=<socket>`; returns it and the
/// accepted connection.
fn spawn_child(test: &str, env: &str) -> (std::process::Child, UnixStream, std::path::PathBuf) {
    let sock_path = test_dir().join(format!(
        "gpudirect-p2p-ipc-{}-{}.sock",
        test.len(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&sock_path);
    let listener = UnixListener::bind(&sock_path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, &sock_path)
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(st) = kid.try_wait().unwrap() {
                    panic!("the child exited before connecting: {st}");
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "child never connected"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    (kid, conn, sock_path)
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_ipc_vmm_fd_across_processes() {
    if let Ok(sock) = std::env::var(VMM_CHILD_ENV) {
        vmm_child(&sock);
        return;
    }
    let n = gpudirect::cuda::device_count().unwrap_or_else(|e| panic!("{HINT2}: {e}"));
    assert!(n >= 2, "{HINT2}: this process sees {n} device(s)");
    let a = gpudirect::cuda::context(0).unwrap();
    let sa = a.default_stream();
    let b = gpudirect::cuda::context(1).unwrap();
    let sb = b.default_stream();

    // VMM memory on GPU 0 with random bytes (odd size: padded to the granularity inside).
    let g = VmmBuffer::granularity(0).unwrap();
    let data = seeded(VMM_SEED, VMM_LEN);
    let mut buf = VmmBuffer::<u8>::alloc_zeros(&sa, VMM_LEN).unwrap();
    assert_eq!(buf.len(), VMM_LEN);
    assert_eq!(buf.mapped_bytes() % g, 0);
    assert!(buf.mapped_bytes() >= VMM_LEN);
    sa.memcpy_htod(&data, &mut buf.as_view_mut()).unwrap();
    sa.synchronize().unwrap();
    assert_eq!(sa.clone_dtoh(buf.slice()).unwrap(), data, "VMM round trip");

    // In this process: GPU 1 reaches the mapping only after grant_access (cuMemGetAccess).
    let mut local = sb.alloc_zeros::<u8>(VMM_LEN).unwrap();
    let before = plan_copy(&buf.as_view(), &mut local, &sb).unwrap();
    println!(
        "parent: GPU0 VMM -> GPU1 before grant_access: {}",
        before.path
    );
    assert_eq!(before.src_memory, MemoryKind::Vmm);
    assert_eq!(before.src_device, 0);
    assert!(!before.path.is_direct(), "{}", before.path);
    buf.grant_access(1).unwrap();
    let rep = copy_peer(&buf.as_view(), &mut local, &sb).unwrap();
    println!("parent: GPU0 VMM -> GPU1 after grant_access: {}", rep.path);
    assert_eq!(rep.src_memory, MemoryKind::Vmm);
    assert!(rep.path.is_direct(), "{}", rep.path);
    assert_eq!(
        sb.clone_dtoh(&local).unwrap(),
        data,
        "in-process VMM peer copy"
    );
    drop(local);

    // Across processes: the allocation's fd over SCM_RIGHTS, then its length and data seed.
    let (mut kid, mut conn, sock_path) =
        spawn_child("multi_gpu_ipc_vmm_fd_across_processes", VMM_CHILD_ENV);
    let fd = buf.export_fd().unwrap();
    ipc::send_fd(&conn, fd.as_fd(), b"vmm!").unwrap();
    drop(fd);
    let mut meta = buf.len_bytes().to_le_bytes().to_vec();
    meta.extend_from_slice(&VMM_SEED.to_le_bytes());
    send(&mut conn, &meta);
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says {reply}");
    assert!(reply.starts_with("ok vmm"), "{reply}");
    let got = sa.clone_dtoh(buf.slice()).unwrap();
    let wb = seeded(VMM_WB_SEED, VMM_LEN - 2 * WB_OFF);
    assert_eq!(&got[..WB_OFF], &data[..WB_OFF]);
    assert_eq!(
        &got[WB_OFF..VMM_LEN - WB_OFF],
        &wb[..],
        "child's write-back"
    );
    assert_eq!(&got[VMM_LEN - WB_OFF..], &data[VMM_LEN - WB_OFF..]);
    println!("parent: all {VMM_LEN} bytes of the child's write-back verified");
    send(&mut conn, b"bye");
    let st = kid.wait().unwrap();
    let _ = std::fs::remove_file(&sock_path);
    drop(buf);
    assert!(st.success(), "child failed: {st}");
}

fn vmm_child(sock: &str) {
    let b = gpudirect::cuda::context(1).unwrap_or_else(|e| panic!("child: {HINT2}: {e}"));
    let sb = b.default_stream();
    let mut conn = UnixStream::connect(sock).unwrap();
    let mut tag = [0u8; 4]; // exactly the tag: never read into the next frame
    let (fd, n) = ipc::recv_fd(&conn, &mut tag).unwrap();
    assert_eq!(&tag[..n], b"vmm!");
    let meta = recv(&mut conn);
    assert_eq!(meta.len(), 16);
    let len_bytes = u64::from_le_bytes(meta[..8].try_into().unwrap());
    let seed = u64::from_le_bytes(meta[8..].try_into().unwrap());

    let mut m = VmmImport::<u8>::open(&sb, fd, len_bytes).unwrap();
    println!(
        "child: VMM import of GPU {} memory ({} bytes): {}",
        m.owner_device(),
        m.len(),
        m.path()
    );
    assert_eq!(m.owner_device(), 0);
    assert!(m.path().is_direct(), "{}", m.path());
    let n = m.len();
    assert_eq!(n as u64, len_bytes);

    // Read every byte through a peer copy that reports its path.
    let want = seeded(seed, n);
    let mut local = sb.alloc_zeros::<u8>(n).unwrap();
    let rep = copy_peer(&m.as_view(), &mut local, &sb).unwrap();
    assert_eq!(rep.src_memory, MemoryKind::Vmm);
    assert_eq!((rep.src_device, rep.dst_device), (0, 1));
    assert!(rep.path.is_direct(), "read path: {}", rep.path);
    let got = sb.clone_dtoh(&local).unwrap();
    let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert_eq!(
        bad, 0,
        "{bad} of {n} bytes differ when read through the VMM import"
    );

    // Write a pattern back at an odd offset.
    let wb = seeded(VMM_WB_SEED, n - 2 * WB_OFF);
    let src = sb.clone_htod(&wb).unwrap();
    let mut dst = m.as_view_mut();
    let mut dst = dst.slice_mut(WB_OFF..n - WB_OFF);
    let rep2 = copy_peer(&src, &mut dst, &sb).unwrap();
    assert_eq!(rep2.dst_memory, MemoryKind::Vmm);
    assert!(rep2.path.is_direct(), "write path: {}", rep2.path);
    sb.synchronize().unwrap();
    drop(src);
    drop(m);
    send(
        &mut conn,
        format!(
            "ok vmm: read {n} bytes, all equal ({}), wrote back {} bytes ({})",
            rep.path,
            wb.len(),
            rep2.path
        )
        .as_bytes(),
    );
    assert_eq!(recv(&mut conn), b"bye");
}

const LEN_CHILD_ENV: &str = "GPUDIRECT_P2P_IPC_LEN_CHILD";
const LEN_LEGACY: usize = 2 << 20;
const LEN_POOL: usize = (2 << 20) + 3;
const LIE: u64 = 1 << 30;

/// Issue 9 item 2: the length in an IPC handle comes from another process (or the wire) and is
/// checked against the mapping the driver made (`cuMemGetAddressRange`): a handle claiming
/// 1 GiB for a 2 MiB allocation is a typed `InvalidArgument` (seen on an H200 before the fix:
/// opened as a 1 GiB `CudaSlice`), a shorter length maps a prefix, the honest one maps it all.
/// Legacy (`cuMemAlloc`) handles and pool pointers; two processes on GPU 0 (one GPU suffices).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ipc_length_from_the_handle_is_checked() {
    let _serial = common::serial();
    if let Ok(sock) = std::env::var(LEN_CHILD_ENV) {
        len_child(&sock);
        return;
    }
    let a = gpudirect::cuda::context(0).unwrap_or_else(|e| {
        panic!("this test needs a CUDA GPU (run gpu_* tests on a GPU machine): {e}")
    });
    let sa = a.default_stream();
    let (mut kid, mut conn, sock_path) =
        spawn_child("gpu_ipc_length_from_the_handle_is_checked", LEN_CHILD_ENV);

    let data = seeded(21, LEN_LEGACY);
    let mut legacy = DeviceBuffer::<u8>::alloc_zeros(&sa, LEN_LEGACY).unwrap();
    sa.memcpy_htod(&data, &mut legacy.as_view_mut()).unwrap();
    sa.synchronize().unwrap();
    // SAFETY: `legacy` is dropped only after the child's "bye" exchange, after it dropped
    // every mapping.
    let handle = unsafe { IpcMemHandle::export(&legacy) }.unwrap();
    send(&mut conn, &handle.to_bytes());
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says {reply}");

    let pool = SharedPool::new(&a).unwrap();
    let mut slice = pool.alloc_zeros::<u8>(&sa, LEN_POOL).unwrap();
    sa.memcpy_htod(&seeded(22, LEN_POOL), &mut slice).unwrap();
    sa.synchronize().unwrap();
    let fd = pool.export_fd().unwrap();
    ipc::send_fd(&conn, fd.as_fd(), b"pool").unwrap();
    // SAFETY: as for `legacy`: `slice` is dropped after the child's last mapping is gone.
    let ptr = unsafe { pool.export_pointer(&slice) }.unwrap();
    send(&mut conn, &ptr.to_bytes());
    let reply2 = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says {reply2}");
    send(&mut conn, b"bye");
    let st = kid.wait().unwrap();
    let _ = std::fs::remove_file(&sock_path);
    drop(slice);
    drop(pool);
    drop(legacy);
    assert!(reply.starts_with("ok legacy"), "{reply}");
    assert!(reply2.starts_with("ok pool"), "{reply2}");
    assert!(st.success(), "child failed: {st}");
}

/// What the child found for one kind of handle: "ok ..." or the first failure.
fn len_checks(
    what: &str,
    n: usize,
    seed: u64,
    sb: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>,
    mut open: impl FnMut(u64) -> gpudirect::Result<IpcMapping<u8>>,
) -> String {
    match open(LIE) {
        Err(gpudirect::Error::InvalidArgument(msg)) => {
            println!("child: {what} with a lying length refused: {msg}")
        }
        Ok(m) => {
            return format!(
                "FAIL {what}: a handle claiming {LIE} bytes for a {n}-byte allocation was \
                 accepted (a {}-byte mapping)",
                m.len()
            )
        }
        Err(e) => return format!("FAIL {what}: lying length gave {e:?}, not InvalidArgument"),
    }
    let want = seeded(seed, n);
    for len in [n / 2, n] {
        match open(len as u64) {
            Ok(m) => {
                if m.len() != len {
                    return format!("FAIL {what}: asked {len} bytes, mapped {}", m.len());
                }
                if sb.clone_dtoh(m.slice()).unwrap() != want[..len] {
                    return format!("FAIL {what}: the {len} mapped bytes differ");
                }
            }
            Err(e) => return format!("FAIL {what}: honest length {len}: {e}"),
        }
    }
    format!("ok {what}")
}

fn len_child(sock: &str) {
    let b = gpudirect::cuda::context(0).unwrap();
    let sb = b.default_stream();
    let mut conn = UnixStream::connect(sock).unwrap();
    let h = IpcMemHandle::from_bytes(&recv(&mut conn)).unwrap();
    let legacy = len_checks("legacy", LEN_LEGACY, 21, &sb, |len| {
        IpcMapping::<u8>::open(
            &sb,
            &IpcMemHandle {
                len_bytes: len,
                ..h
            },
        )
    });
    send(&mut conn, legacy.as_bytes());
    let mut tag = [0u8; 4];
    let (fd, n) = ipc::recv_fd(&conn, &mut tag).unwrap();
    assert_eq!(&tag[..n], b"pool");
    let pool = ImportedPool::from_fd(&b, fd).unwrap();
    let p = PoolPointer::from_bytes(&recv(&mut conn)).unwrap();
    let pooled = len_checks("pool", LEN_POOL, 22, &sb, |len| {
        pool.import::<u8>(
            &sb,
            &PoolPointer {
                len_bytes: len,
                ..p
            },
        )
    });
    send(&mut conn, pooled.as_bytes());
    drop(pool);
    assert_eq!(recv(&mut conn), b"bye");
}

/// True when everything queued on `s` has run (`cuStreamQuery`).
fn stream_idle(s: &gpudirect::cudarc::driver::CudaStream) -> bool {
    use gpudirect::cudarc::driver::sys;
    // SAFETY: the stream is alive; the query has no other precondition.
    let rc = unsafe { sys::cuStreamQuery(s.cu_stream()) };
    match rc {
        sys::CUresult::CUDA_SUCCESS => true,
        sys::CUresult::CUDA_ERROR_NOT_READY => false,
        other => panic!("cuStreamQuery: {other:?}"),
    }
}

/// Review of 2026-12-02, item 6: CUDA says imported memory "must not be accessed before the
/// allocation operation completes in the exporting process", so an export returns only once the
/// allocation and its zeroing, queued on the buffer's stream, have run. The stream is held by a
/// host function for 500 ms while the buffer is allocated (control: the stream is still busy
/// when the allocation returns), then each export is timed: on the code before the fix each
/// returned at once with the zeroing still queued (`idle: false`, well under 500 ms); after it,
/// each waits for the gate (about 500 ms) and leaves the stream idle. One GPU, one process.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ipc_exports_wait_for_the_allocation_and_its_zeroing() {
    let _serial = common::serial();
    const HOLD: Duration = Duration::from_millis(500);
    const N: usize = (4 << 20) + 9;
    let ctx = common::need_gpu(0);
    common::grow_streams_past_the_drivers_first_growth(&ctx);
    let s = ctx.new_stream().unwrap();
    let pool = SharedPool::new(&ctx).unwrap();
    // cuMemPoolExportPointer shares an allocation of an already shared pool.
    let _pool_fd = pool.export_fd().unwrap();
    enum Held {
        Legacy(DeviceBuffer<u8>),
        Pool(gpudirect::cudarc::driver::CudaSlice<u8>),
        Vmm(VmmBuffer<u8>),
    }
    let mut failures = Vec::new();
    for case in [
        "DeviceBuffer::alloc_zeros + IpcMemHandle::export",
        "SharedPool::alloc_zeros + SharedPool::export_pointer",
        "VmmBuffer::alloc_zeros + VmmBuffer::export_fd",
    ] {
        let gate = common::StreamGate::block(&s);
        // The allocation (pool) and the zeroing are queued behind the gate.
        let t_alloc = Instant::now();
        let held = if case.starts_with("DeviceBuffer") {
            Held::Legacy(DeviceBuffer::<u8>::alloc_zeros(&s, N).unwrap())
        } else if case.starts_with("SharedPool") {
            Held::Pool(pool.alloc_zeros::<u8>(&s, N).unwrap())
        } else {
            Held::Vmm(VmmBuffer::<u8>::alloc_zeros(&s, N).unwrap())
        };
        let alloc_took = t_alloc.elapsed();
        assert!(
            alloc_took < HOLD && !stream_idle(&s),
            "{case}: control: the allocation took {alloc_took:?} and left the stream idle: {} \
             (the gate did not hold it, or the allocation waited for it)",
            stream_idle(&s)
        );
        let opened = gate.release_after(HOLD);
        let t0 = Instant::now();
        match &held {
            // SAFETY: the handle goes to no other process.
            Held::Legacy(b) => drop(unsafe { IpcMemHandle::export(b) }.unwrap()),
            // SAFETY: the pointer goes to no other process.
            Held::Pool(p) => drop(unsafe { pool.export_pointer(p) }.unwrap()),
            Held::Vmm(v) => drop(v.export_fd().unwrap()),
        }
        let took = t0.elapsed();
        let idle = stream_idle(&s);
        opened.join().unwrap();
        drop(held);
        s.synchronize().unwrap();
        println!("{case}: the export returned after {took:?}; the stream idle then: {idle}");
        if !idle || took < HOLD - Duration::from_millis(100) {
            failures.push(format!(
                "{case}: returned after {took:?} with the allocation's zeroing {}",
                if idle { "done" } else { "still queued" }
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

const DROP_CHILD_ENV: &str = "GPUDIRECT_P2P_IPC_DROP_CHILD";
const DROP_LEN: usize = (3 << 20) + 11;
const DROP_HOLD: Duration = Duration::from_millis(500);

/// Review of 2026-12-02, item 4: dropping a mapping of another process's memory must wait for
/// every reader, not only the mapping's own stream. The child (GPU 0, like the parent) imports
/// the parent's legacy buffer and pool slice on stream `s`, queues a read of each on stream `x`
/// behind a host function held 500 ms, reads again on `s` (cudarc keeps one read event per
/// slice: this read replaces `x`'s), and drops the mapping. On the code before the fix the drop
/// returned at once with `x`'s read still queued (pool memory freed with `cuMemFreeAsync` on `s`,
/// legacy memory closed with `cuIpcCloseMemHandle` at once), so `x` read an unmapped (or
/// reused) range: `x idle: false` and a drop under 500 ms, then a wrong byte count or an illegal
/// address error. After it the drop waits for `x` (about 500 ms, `x idle: true`) and every byte
/// read on both streams is the parent's. One GPU, two processes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ipc_mapping_drop_waits_for_readers_on_other_streams() {
    let _serial = common::serial();
    if let Ok(sock) = std::env::var(DROP_CHILD_ENV) {
        drop_child(&sock);
        return;
    }
    let a = common::need_gpu(0);
    let sa = a.default_stream();
    let (mut kid, mut conn, sock_path) = spawn_child(
        "gpu_ipc_mapping_drop_waits_for_readers_on_other_streams",
        DROP_CHILD_ENV,
    );
    let mut legacy = DeviceBuffer::<u8>::alloc_zeros(&sa, DROP_LEN).unwrap();
    sa.memcpy_htod(&seeded(41, DROP_LEN), &mut legacy.as_view_mut())
        .unwrap();
    let pool = SharedPool::new(&a).unwrap();
    let mut slice = pool.alloc_zeros::<u8>(&sa, DROP_LEN).unwrap();
    sa.memcpy_htod(&seeded(42, DROP_LEN), &mut slice).unwrap();
    sa.synchronize().unwrap();
    // SAFETY: `legacy` and `slice` are dropped only after the child's "bye", after it dropped
    // its mappings.
    // cuMemPoolExportPointer shares an allocation of an already shared pool: the pool first.
    let fd = pool.export_fd().unwrap();
    let (h, p) = unsafe {
        (
            IpcMemHandle::export(&legacy).unwrap(),
            pool.export_pointer(&slice).unwrap(),
        )
    };
    send(&mut conn, &h.to_bytes());
    ipc::send_fd(&conn, fd.as_fd(), b"pool").unwrap();
    send(&mut conn, &p.to_bytes());
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says:\n{reply}");
    send(&mut conn, b"bye");
    let st = kid.wait().unwrap();
    let _ = std::fs::remove_file(&sock_path);
    drop(slice);
    sa.synchronize().unwrap();
    drop(pool);
    drop(legacy);
    assert!(st.success(), "child failed: {st}");
    assert!(!reply.contains("FAIL"), "{reply}");
}

/// Reads `m` on `x` behind a held gate and on `s`, drops it, and says how that went.
fn drop_while_read_elsewhere(
    what: &str,
    m: IpcMapping<u8>,
    seed: u64,
    s: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>,
    x: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>,
) -> String {
    let n = m.len();
    let want = seeded(seed, n);
    let mut on_x = x.alloc_zeros::<u8>(n).unwrap();
    let mut on_s = s.alloc_zeros::<u8>(n).unwrap();
    x.synchronize().unwrap();
    s.synchronize().unwrap();
    let gate = common::StreamGate::block(x);
    x.memcpy_dtod(&m.as_view(), &mut on_x).unwrap();
    s.memcpy_dtod(&m.as_view(), &mut on_s).unwrap();
    s.synchronize().unwrap();
    if stream_idle(x) {
        return format!("FAIL {what}: control: x was idle before the drop (the gate did not hold)");
    }
    let opened = gate.release_after(DROP_HOLD);
    let t0 = Instant::now();
    drop(m);
    let took = t0.elapsed();
    let x_idle = stream_idle(x);
    opened.join().unwrap();
    let mut msg = format!("{what}: the drop returned after {took:?}; x idle then: {x_idle}");
    if !x_idle || took < DROP_HOLD - Duration::from_millis(100) {
        msg += " FAIL: the mapping was released while x's read was still queued";
    }
    for (stream, buf, name) in [(x, &on_x, "x"), (s, &on_s, "s")] {
        match stream.clone_dtoh(buf) {
            Ok(got) => {
                let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
                msg += &format!("; {bad} of {n} bytes read on {name} differ");
                if bad != 0 {
                    msg += " FAIL";
                }
            }
            Err(e) => msg += &format!("; FAIL reading back what {name} read: {e}"),
        }
    }
    msg
}

fn drop_child(sock: &str) {
    let ctx = gpudirect::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let x = ctx.new_stream().unwrap();
    let mut conn = UnixStream::connect(sock).unwrap();
    let h = IpcMemHandle::from_bytes(&recv(&mut conn)).unwrap();
    let mut tag = [0u8; 4];
    let (fd, n) = ipc::recv_fd(&conn, &mut tag).unwrap();
    assert_eq!(&tag[..n], b"pool");
    let pool = ImportedPool::from_fd(&ctx, fd).unwrap();
    let p = PoolPointer::from_bytes(&recv(&mut conn)).unwrap();
    let mut report = Vec::new();
    match pool.import::<u8>(&s, &p) {
        Ok(m) => report.push(drop_while_read_elsewhere("pool", m, 42, &s, &x)),
        Err(e) => report.push(format!("FAIL pool import: {e}")),
    }
    match IpcMapping::<u8>::open(&s, &h) {
        Ok(m) => report.push(drop_while_read_elsewhere("legacy", m, 41, &s, &x)),
        Err(e) => report.push(format!("FAIL legacy open: {e}")),
    }
    drop(pool);
    let report = report.join("\n");
    println!("child: {report}");
    send(&mut conn, report.as_bytes());
    assert_eq!(recv(&mut conn), b"bye");
}

const TWICE_CHILD_ENV: &str = "GPUDIRECT_P2P_IPC_TWICE_CHILD";
const TWICE_LEN: usize = (2 << 20) + 5;

/// Counts gpudirect's WARN events (a failed unmap or free is logged, not returned).
struct CountWarnings(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl tracing::Subscriber for CountWarnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let m = event.metadata();
        if m.target().starts_with("gpudirect") && *m.level() == tracing::Level::WARN {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            eprintln!("child: gpudirect warning: {event:?}");
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Review of 2026-12-02, item 7: a child (GPU 0, like the parent) opens the parent's legacy
/// handle twice and imports its pool pointer twice, and reports the two addresses of each.
/// Legacy: CUDA returns the same pointer with its count raised; after the first mapping's drop
/// the second must still read the parent's bytes and `copy_peer` must still see it as imported
/// memory (on the code before the fix the drop erased both records: `src_memory` not
/// `Imported`). Pool: if the driver returns the same address twice, the two mappings must not
/// both free it (a double `cuMemFree`, logged as a gpudirect warning; and the first free would
/// unmap the second's memory); if it returns two addresses, each is freed. Either way no
/// gpudirect warning may be logged and every byte read must be the parent's. The child prints
/// the addresses: the answer to "does cuMemPoolImportPointer return the same address for a
/// repeated import?".
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ipc_same_memory_mapped_twice_in_one_process() {
    let _serial = common::serial();
    if let Ok(sock) = std::env::var(TWICE_CHILD_ENV) {
        twice_child(&sock);
        return;
    }
    let a = common::need_gpu(0);
    let sa = a.default_stream();
    let (mut kid, mut conn, sock_path) = spawn_child(
        "gpu_ipc_same_memory_mapped_twice_in_one_process",
        TWICE_CHILD_ENV,
    );
    let mut legacy = DeviceBuffer::<u8>::alloc_zeros(&sa, TWICE_LEN).unwrap();
    sa.memcpy_htod(&seeded(51, TWICE_LEN), &mut legacy.as_view_mut())
        .unwrap();
    let pool = SharedPool::new(&a).unwrap();
    let mut slice = pool.alloc_zeros::<u8>(&sa, TWICE_LEN).unwrap();
    sa.memcpy_htod(&seeded(52, TWICE_LEN), &mut slice).unwrap();
    sa.synchronize().unwrap();
    // SAFETY: `legacy` and `slice` are dropped only after the child's "bye", after it dropped
    // its mappings.
    // cuMemPoolExportPointer shares an allocation of an already shared pool: the pool first.
    let fd = pool.export_fd().unwrap();
    let (h, p) = unsafe {
        (
            IpcMemHandle::export(&legacy).unwrap(),
            pool.export_pointer(&slice).unwrap(),
        )
    };
    send(&mut conn, &h.to_bytes());
    ipc::send_fd(&conn, fd.as_fd(), b"pool").unwrap();
    send(&mut conn, &p.to_bytes());
    let reply = String::from_utf8(recv(&mut conn)).unwrap();
    println!("parent: child says:\n{reply}");
    send(&mut conn, b"bye");
    let st = kid.wait().unwrap();
    let _ = std::fs::remove_file(&sock_path);
    drop(slice);
    sa.synchronize().unwrap();
    drop(pool);
    drop(legacy);
    assert!(st.success(), "child failed: {st}");
    assert!(!reply.contains("FAIL"), "{reply}");
}

/// The device address of a mapping.
fn addr(m: &IpcMapping<u8>) -> u64 {
    gpudirect::rdma::GpuMemory::device_ptr(m.slice())
}

/// Opens the same memory twice with `open`, drops the first, checks the second, drops it.
fn mapped_twice(
    what: &str,
    seed: u64,
    s: &std::sync::Arc<gpudirect::cudarc::driver::CudaStream>,
    mut open: impl FnMut() -> gpudirect::Result<IpcMapping<u8>>,
) -> String {
    let want = seeded(seed, TWICE_LEN);
    let (m1, m2) = match (open(), open()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) => return format!("FAIL {what}: first mapping: {e}"),
        (_, Err(e)) => return format!("{what}: the second mapping was refused: {e}"),
    };
    let (a1, a2) = (addr(&m1), addr(&m2));
    let mut msg = format!(
        "{what}: first mapping at {a1:#x}, second at {a2:#x} ({})",
        if a1 == a2 {
            "the same address"
        } else {
            "two addresses"
        }
    );
    drop(m1);
    let mut local = s.alloc_zeros::<u8>(TWICE_LEN).unwrap();
    match plan_copy(&m2.as_view(), &mut local, s) {
        Ok(r) if r.src_memory == MemoryKind::Imported => {
            msg += "; after the first drop the second is still imported memory"
        }
        Ok(r) => {
            msg += &format!(
                "; FAIL after the first drop copy_peer sees the second as {:?} memory ({})",
                r.src_memory, r.path
            )
        }
        Err(e) => msg += &format!("; FAIL plan_copy after the first drop: {e}"),
    }
    match s.clone_dtoh(m2.slice()) {
        Ok(got) => {
            let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            msg += &format!("; {bad} of {TWICE_LEN} bytes of the second differ");
            if bad != 0 {
                msg += " FAIL";
            }
        }
        Err(e) => msg += &format!("; FAIL reading the second after the first drop: {e}"),
    }
    drop(m2);
    // Informational: does the driver still know the address once both mappings are gone?
    // (If it returned the same address twice and still maps it, it counts imports, and
    // gpudirect's one free per address leaks one of them.)
    let known = |a: u64| {
        use gpudirect::cudarc::driver::sys;
        let mut ordinal = 0i32;
        // SAFETY: DEVICE_ORDINAL writes an int into `ordinal`; any address may be queried.
        let rc = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                a,
            )
        };
        rc == sys::CUresult::CUDA_SUCCESS
    };
    msg += &format!(
        "; after both drops the driver still knows the first address: {}, the second: {}",
        known(a1),
        known(a2)
    );
    msg
}

fn twice_child(sock: &str) {
    let warnings = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tracing::subscriber::set_global_default(CountWarnings(warnings.clone())).unwrap();
    let ctx = gpudirect::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let mut conn = UnixStream::connect(sock).unwrap();
    let h = IpcMemHandle::from_bytes(&recv(&mut conn)).unwrap();
    let mut tag = [0u8; 4];
    let (fd, n) = ipc::recv_fd(&conn, &mut tag).unwrap();
    assert_eq!(&tag[..n], b"pool");
    let pool = ImportedPool::from_fd(&ctx, fd).unwrap();
    let p = PoolPointer::from_bytes(&recv(&mut conn)).unwrap();
    let mut report = vec![mapped_twice("legacy", 51, &s, || {
        IpcMapping::<u8>::open(&s, &h)
    })];
    report.push(mapped_twice("pool", 52, &s, || pool.import::<u8>(&s, &p)));
    drop(pool);
    s.synchronize().unwrap();
    let w = warnings.load(std::sync::atomic::Ordering::Relaxed);
    report.push(format!(
        "gpudirect warnings (failed unmaps or frees) in the child: {w}{}",
        if w > 0 { " FAIL" } else { "" }
    ));
    let report = report.join("\n");
    println!("child: {report}");
    send(&mut conn, report.as_bytes());
    assert_eq!(recv(&mut conn), b"bye");
}

const VMM_DROP_CHILD_ENV: &str = "GPUDIRECT_P2P_VMM_DROP_CHILD";

/// Review of 2026-12-02, item 4's class for VMM memory: a `VmmBuffer` (and a `VmmImport`, which
/// unmaps the same way) dropped while another stream still reads it must wait for that read:
/// cudarc keeps one read event per slice, so a read on stream `x` held 500 ms by a host function,
/// then a read on the buffer's own stream, left the first unseen, and `cuMemUnmap` is not
/// documented to wait for queued work. The hazardous part runs in a child process (on the old
/// code `x`'s read hits an unmapped range, which would poison this process's context for the
/// other tests). On the code before the fix the child reports a drop under 500 ms with `x`
/// still busy (`x idle: false`) and then a failed or wrong read; after it the drop takes about
/// 500 ms and every byte read on both streams is right.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_vmm_buffer_drop_waits_for_readers_on_other_streams() {
    let _serial = common::serial();
    if std::env::var(VMM_DROP_CHILD_ENV).is_ok() {
        vmm_drop_child();
        return;
    }
    common::need_gpu(0);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "gpu_vmm_buffer_drop_waits_for_readers_on_other_streams",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(VMM_DROP_CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("child:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // With --nocapture and one thread, libtest prints "test NAME ... " and then the test's
    // own line on the same line.
    let line = stdout
        .lines()
        .find_map(|l| l.find("vmm-drop: ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("the child printed no result (status {})", out.status));
    assert!(!line.contains("FAIL"), "{line}");
    assert!(out.status.success(), "child failed: {}", out.status);
}

fn vmm_drop_child() {
    let ctx = gpudirect::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let x = ctx.new_stream().unwrap();
    let n = VMM_LEN;
    let want = seeded(61, n);
    let mut buf = VmmBuffer::<u8>::alloc_zeros(&s, n).unwrap();
    s.memcpy_htod(&want, &mut buf.as_view_mut()).unwrap();
    let mut on_x = x.alloc_zeros::<u8>(n).unwrap();
    let mut on_s = s.alloc_zeros::<u8>(n).unwrap();
    x.synchronize().unwrap();
    s.synchronize().unwrap();
    let gate = common::StreamGate::block(&x);
    x.memcpy_dtod(&buf.as_view(), &mut on_x).unwrap();
    s.memcpy_dtod(&buf.as_view(), &mut on_s).unwrap();
    s.synchronize().unwrap();
    assert!(!stream_idle(&x), "control: x was idle before the drop");
    let opened = gate.release_after(DROP_HOLD);
    let t0 = Instant::now();
    drop(buf);
    let took = t0.elapsed();
    let x_idle = stream_idle(&x);
    opened.join().unwrap();
    let mut msg = format!("vmm-drop: the drop returned after {took:?}; x idle then: {x_idle}");
    if !x_idle || took < DROP_HOLD - Duration::from_millis(100) {
        msg += " FAIL: the buffer was unmapped while x's read was still queued";
    }
    for (stream, dst, name) in [(&x, &on_x, "x"), (&s, &on_s, "s")] {
        match stream.clone_dtoh(dst) {
            Ok(got) => {
                let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
                msg += &format!("; {bad} of {n} bytes read on {name} differ");
                if bad != 0 {
                    msg += " FAIL";
                }
            }
            Err(e) => msg += &format!("; FAIL reading back what {name} read: {e}"),
        }
    }
    println!("{msg}");
}

/// `SharedPool::export_pointer` of a pool that was never exported: the driver refuses it
/// (`cuMemPoolExportPointer` shares an allocation of an already shared pool; on the H200 a bare
/// `CUDA_ERROR_INVALID_VALUE`), and the error says what to do: export the pool first. Once the
/// pool is exported, the same allocation exports.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ipc_pool_pointer_of_an_unexported_pool_says_to_export_the_pool_first() {
    let _serial = common::serial();
    let ctx = common::need_gpu(0);
    let s = ctx.new_stream().unwrap();
    let pool = SharedPool::new(&ctx).unwrap();
    let slice = pool.alloc_zeros::<u8>(&s, (1 << 20) + 7).unwrap();
    s.synchronize().unwrap();
    // SAFETY: the pointer goes to no other process.
    match unsafe { pool.export_pointer(&slice) } {
        Err(gpudirect::Error::InvalidArgument(m)) => {
            assert!(m.contains("export_fd"), "{m}");
            println!("before the pool's export: {m}");
        }
        r => panic!(
            "export_pointer of an unexported pool: {r:?}, not an InvalidArgument naming export_fd"
        ),
    }
    let _fd = pool.export_fd().unwrap();
    // SAFETY: as above.
    let p = unsafe { pool.export_pointer(&slice) }.unwrap();
    assert_eq!(p.len_bytes, (1 << 20) + 7);
    drop(slice);
    s.synchronize().unwrap();
}

//! Descriptor passing over a Unix stream socket (`SCM_RIGHTS`): how pool and VMM fds travel.
//!
//! One message carries one descriptor. The receiver owns every descriptor the kernel installs,
//! so anything else a peer sends (more descriptors, a truncated control message) is closed and
//! refused, never left open in this process.

use std::io::{IoSlice, IoSliceMut};
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::error::{Error, Result};

const INT: usize = size_of::<libc::c_int>();

/// `CMSG_SPACE(len)`: bytes a control message with `len` data bytes takes, padding included.
const fn cmsg_space(len: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE(len as u32) as usize }
}

/// `CMSG_LEN(len)`: the `cmsg_len` of a control message with `len` data bytes.
const fn cmsg_len(len: usize) -> usize {
    // SAFETY: CMSG_LEN is a pure size computation.
    unsafe { libc::CMSG_LEN(len as u32) as usize }
}

/// Descriptors [`recv_fd`] has room for in one message. [`send_fd`] sends one; the room for a few
/// more lets a misbehaving peer's message be counted and refused rather than truncated.
const FD_ROOM: usize = 8;

/// Control bytes [`recv_fd`] offers the kernel: the descriptors, plus what a socket may carry
/// beside them (credentials with `SO_PASSCRED`, a security label with `SO_PASSSEC`).
const RECV_CONTROL: usize =
    cmsg_space(FD_ROOM * INT) + cmsg_space(size_of::<libc::ucred>()) + cmsg_space(256);

/// A control-message buffer aligned for `cmsghdr`, as `CMSG_FIRSTHDR` and the kernel expect.
#[repr(C)]
struct ControlBuf<const N: usize> {
    _align: [libc::cmsghdr; 0],
    bytes: [u8; N],
}

impl<const N: usize> ControlBuf<N> {
    fn new() -> Self {
        ControlBuf {
            _align: [],
            bytes: [0; N],
        }
    }
}

/// Sends `payload` (at least one byte) and the descriptor `fd` over a Unix stream socket
/// (`sendmsg` with `SCM_RIGHTS`).
///
/// The descriptor travels with the first byte; the rest of the payload follows if the kernel
/// took only part of it. A peer that has closed the socket is an `Io` error (`EPIPE`), never a
/// `SIGPIPE` (`MSG_NOSIGNAL`); a call interrupted by a signal before anything was sent is
/// retried.
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> Result<()> {
    if payload.is_empty() {
        return Err(Error::InvalidArgument(
            "send at least one payload byte with the descriptor".into(),
        ));
    }
    let iov = [IoSlice::new(payload)];
    const SPACE: usize = cmsg_space(INT);
    let mut cbuf = ControlBuf::<SPACE>::new();
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.bytes.as_mut_ptr().cast();
    msg.msg_controllen = SPACE as _;
    // SAFETY: msg_control points to SPACE = CMSG_SPACE(sizeof(int)) bytes aligned for cmsghdr
    // (ControlBuf), room for one header carrying one int, so CMSG_FIRSTHDR is non-null and the
    // header and CMSG_DATA's int lie inside the buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = cmsg_len(INT) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd.as_raw_fd());
    }
    let mut sent = loop {
        // SAFETY: `msg` references live buffers (`iov`, `payload`, `cbuf`) for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("sendmsg", None, e));
        }
    };
    // The descriptor went with the first byte; send what the kernel did not take.
    while sent < payload.len() {
        let rest = &payload[sent..];
        // SAFETY: `rest` is a live buffer of rest.len() bytes.
        let n = unsafe {
            libc::send(
                sock.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        match n {
            0 => {
                return Err(Error::io(
                    "send",
                    None,
                    std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        "the socket took no more of the payload after the descriptor",
                    ),
                ))
            }
            n if n > 0 => sent += n as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::io("send", None, e));
                }
            }
        }
    }
    Ok(())
}

/// Takes ownership of every descriptor in the `SCM_RIGHTS` messages of `control` (the bytes the
/// kernel filled) and skips every other control message. Reads headers unaligned and checks
/// every length against `control`, so no header the kernel wrote can send it out of bounds.
fn take_descriptors(control: &[u8]) -> Vec<OwnedFd> {
    let hdr = size_of::<libc::cmsghdr>();
    let data_at = cmsg_len(0);
    let mut fds = Vec::new();
    let mut off = 0;
    while control.len() - off >= hdr {
        // SAFETY: `hdr` bytes from `off` lie inside `control` (checked above); read_unaligned
        // needs no alignment and cmsghdr is plain data.
        let h: libc::cmsghdr =
            unsafe { std::ptr::read_unaligned(control.as_ptr().add(off).cast()) };
        let len = h.cmsg_len as usize;
        if len < data_at || len > control.len() - off {
            break;
        }
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            for c in control[off + data_at..off + len].chunks_exact(INT) {
                let mut b = [0u8; INT];
                b.copy_from_slice(c);
                let fd = libc::c_int::from_ne_bytes(b);
                if fd >= 0 {
                    // SAFETY: the kernel installed `fd` in this process for this message and
                    // nothing else refers to it; it is taken once, here.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // CMSG_NXTHDR: the next header starts at CMSG_ALIGN(cmsg_len).
        off += cmsg_space(len) - cmsg_space(0);
        if off > control.len() {
            break;
        }
    }
    fds
}

/// Receives a payload of up to `buf.len()` bytes and one descriptor sent with [`send_fd`];
/// returns the descriptor and the payload length.
///
/// The descriptor is close-on-exec (`MSG_CMSG_CLOEXEC`): it does not leak into a child that
/// this process later executes. A call interrupted by a signal is retried.
///
/// # Errors
/// - [`Error::InvalidArgument`] if `buf` is empty, or if the message carried more than one
///   descriptor or its control data was truncated (`MSG_CTRUNC`): a peer not following
///   [`send_fd`]. Every descriptor that arrived is closed; the payload bytes are consumed.
/// - [`Error::Io`] with `op: "recvmsg"`: the call failed (its errno); the peer closed the socket
///   (`UnexpectedEof`); or bytes came without a descriptor (`InvalidData`).
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> Result<(OwnedFd, usize)> {
    if buf.is_empty() {
        return Err(Error::InvalidArgument(
            "recv_fd needs room for at least one payload byte".into(),
        ));
    }
    let mut iov = [IoSliceMut::new(buf)];
    let mut cbuf = ControlBuf::<RECV_CONTROL>::new();
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    let n = loop {
        msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.bytes.as_mut_ptr().cast();
        msg.msg_controllen = RECV_CONTROL as _;
        msg.msg_flags = 0;
        // SAFETY: `msg` references live, writable buffers (`iov`, `buf`, `cbuf`) of the
        // lengths given, for the call's duration.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("recvmsg", None, e));
        }
    };
    // Own every descriptor first, so each refusal below closes them all.
    let used = (msg.msg_controllen as usize).min(RECV_CONTROL);
    let mut fds = take_descriptors(&cbuf.bytes[..used]);
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::InvalidArgument(format!(
            "the control message was truncated (MSG_CTRUNC): the peer sent more descriptors \
             than one send_fd message carries, or the socket passes ancillary data recv_fd has \
             no room for (SO_PASSSEC); the {} descriptors that arrived were closed",
            fds.len()
        )));
    }
    match fds.len() {
        1 => Ok((fds.remove(0), n)),
        0 if n == 0 => Err(Error::io(
            "recvmsg",
            None,
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the peer closed the socket before sending a descriptor",
            ),
        )),
        0 => Err(Error::io(
            "recvmsg",
            None,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no SCM_RIGHTS descriptor in the message: the peer must send with send_fd",
            ),
        )),
        k => Err(Error::InvalidArgument(format!(
            "the peer sent {k} descriptors in one message, send_fd sends exactly one: \
             all were closed"
        ))),
    }
}

#[cfg(test)]
mod tests {
    //! Host tests: a `UnixStream::pair` in one process. Whether a received descriptor leaked is
    //! told by a pipe: the peer sends (copies of) the pipe's write end and closes its own, so the
    //! read end sees end-of-file exactly when every copy we received was closed. Unlike counting
    //! `/proc/self/fd`, this cannot be fooled by other tests opening files on other threads.

    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::net::UnixStream;

    use super::{recv_fd, send_fd};
    use crate::error::Error;

    /// A pipe whose read end does not block: (read, write).
    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut p = [0 as libc::c_int; 2];
        // SAFETY: `p` has room for the two descriptors pipe2 writes.
        let rc = unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
        // SAFETY: pipe2 succeeded, so both are fresh descriptors that we own.
        unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
    }

    /// True when no write end of the pipe is open anywhere (read gives EOF), false when one
    /// still is (read would block).
    fn write_ends_all_closed(read_end: &OwnedFd) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: `b` is a live one-byte buffer; the descriptor is ours.
        let n = unsafe { libc::read(read_end.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        match n {
            0 => true,
            -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => false,
            _ => panic!("unexpected read on the probe pipe: {n}"),
        }
    }

    /// Sends `payload` with one control message per entry of `groups`, each carrying the
    /// descriptors of that entry (what a peer that does not follow `send_fd` may send).
    fn send_raw(sock: &UnixStream, groups: &[&[RawFd]], payload: &[u8]) {
        let space: usize = groups
            .iter()
            .map(|g| super::cmsg_space(std::mem::size_of_val(*g)))
            .sum();
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        let iov = [std::io::IoSlice::new(payload)];
        // SAFETY: msghdr is plain data; all-zero is a valid initial state.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the buffer is 8-aligned and holds exactly the CMSG_SPACE of every group, so
        // each header and its data written below stay inside it.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            for g in groups {
                assert!(!c.is_null());
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = super::cmsg_len(std::mem::size_of_val(*g)) as _;
                let data = libc::CMSG_DATA(c) as *mut libc::c_int;
                for (i, fd) in g.iter().enumerate() {
                    std::ptr::write_unaligned(data.add(i), *fd);
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        // SAFETY: `msg` references live buffers for the call's duration.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        assert_eq!(
            n,
            payload.len() as isize,
            "sendmsg: {}",
            std::io::Error::last_os_error()
        );
    }

    #[test]
    fn extra_descriptors_are_refused_and_closed() {
        // Two descriptors in one control message, and one in each of two control messages.
        for two_cmsgs in [false, true] {
            let (r, w) = pipe();
            let (a, b) = UnixStream::pair().unwrap();
            let fds = [w.as_raw_fd(), w.as_raw_fd()];
            if two_cmsgs {
                send_raw(&a, &[&fds[..1], &fds[1..]], b"pool");
            } else {
                send_raw(&a, &[&fds], b"pool");
            }
            drop(w);
            assert_refused_and_closed(&r, &b, &format!("two_cmsgs={two_cmsgs}"), "2 descriptors");
        }
    }

    /// Receives on `b`, and asserts that every received copy of `r`'s write end was closed and
    /// that the result is an `InvalidArgument` naming `expect`.
    fn assert_refused_and_closed(r: &OwnedFd, b: &UnixStream, what: &str, expect: &str) {
        let mut buf = [0u8; 8];
        let got = recv_fd(b, &mut buf);
        let desc = format!("{got:?}");
        drop(got);
        assert!(
            write_ends_all_closed(r),
            "{what}: a received descriptor stayed open after recv_fd returned {desc}"
        );
        assert!(desc.starts_with("Err(InvalidArgument("), "{desc}");
        assert!(desc.contains(expect), "{desc}");
    }

    #[test]
    fn truncated_control_message_is_refused_and_nothing_leaks() {
        let (r, w) = pipe();
        let (a, b) = UnixStream::pair().unwrap();
        // More than recv_fd has room for: the kernel installs what fits, drops the rest and
        // sets MSG_CTRUNC. 253 is the most one message may carry (SCM_MAX_FD).
        let fds = [w.as_raw_fd(); 253];
        assert!(super::cmsg_len(fds.len() * super::INT) > super::RECV_CONTROL);
        send_raw(&a, &[&fds], b"pool");
        drop(w);
        assert_refused_and_closed(&r, &b, "253 descriptors", "MSG_CTRUNC");
    }

    #[test]
    fn received_descriptor_is_close_on_exec_and_the_only_one() {
        let (r, w) = pipe();
        // Make the sender's copy inheritable, so the flag on ours comes from recv_fd.
        // SAFETY: plain fcntl on a descriptor we own.
        assert_eq!(unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETFD, 0) }, 0);
        let (a, b) = UnixStream::pair().unwrap();
        send_fd(&a, w.as_fd(), b"vmm!").unwrap();
        drop(w);
        let mut buf = [0u8; 8];
        let (fd, n) = recv_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"vmm!");
        // SAFETY: plain fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(
            flags >= 0 && flags & libc::FD_CLOEXEC != 0,
            "F_GETFD = {flags}"
        );
        assert!(
            !write_ends_all_closed(&r),
            "the returned descriptor is open"
        );
        drop(fd);
        assert!(write_ends_all_closed(&r), "no other copy stayed open");
    }

    #[test]
    fn other_control_messages_are_skipped() {
        // With SO_PASSCRED every message also carries SCM_CREDENTIALS (before the descriptors):
        // recv_fd must walk past it to the SCM_RIGHTS message.
        let (r, w) = pipe();
        let (a, b) = UnixStream::pair().unwrap();
        let on: libc::c_int = 1;
        // SAFETY: `on` is a live c_int of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                b.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PASSCRED,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as _,
            )
        };
        assert_eq!(rc, 0, "SO_PASSCRED: {}", std::io::Error::last_os_error());
        send_fd(&a, w.as_fd(), b"pool").unwrap();
        drop(w);
        let mut buf = [0u8; 8];
        let (fd, n) = recv_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"pool");
        drop(fd);
        assert!(write_ends_all_closed(&r));
    }

    #[test]
    fn a_closed_peer_is_end_of_file() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut buf = [0u8; 8];
        let e = recv_fd(&b, &mut buf).unwrap_err();
        assert!(
            matches!(&e, Error::Io { op: "recvmsg", source, .. }
                if source.kind() == std::io::ErrorKind::UnexpectedEof),
            "{e:?}"
        );
        assert!(e.to_string().contains("closed"), "{e}");
        // An empty buffer could not tell a closed peer from a message: refused.
        let (_a, b) = UnixStream::pair().unwrap();
        assert!(matches!(
            recv_fd(&b, &mut []),
            Err(Error::InvalidArgument(_))
        ));
    }

    extern "C" fn on_sigusr1(_: libc::c_int) {}

    #[test]
    fn recv_fd_retries_when_interrupted() {
        // A handler installed without SA_RESTART makes a blocked recvmsg fail with EINTR.
        // SAFETY: sigaction is plain data; the handler does nothing, so it is async-signal-safe,
        // and no other test uses SIGUSR1.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigusr1 as *const () as usize;
            sa.sa_flags = 0;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
        let (r, w) = pipe();
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 8];
            recv_fd(&b, &mut buf).map(|(fd, n)| (fd, buf[..n].to_vec()))
        });
        let tid = std::os::unix::thread::JoinHandleExt::as_pthread_t(&t);
        for _ in 0..5 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            // SAFETY: the thread is alive until it is joined below.
            assert_eq!(unsafe { libc::pthread_kill(tid, libc::SIGUSR1) }, 0);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let sent = send_fd(&a, w.as_fd(), b"pool");
        drop(w);
        let (fd, payload) = t.join().unwrap().expect("recv_fd after EINTR");
        sent.unwrap();
        assert_eq!(payload, b"pool");
        drop(fd);
        assert!(write_ends_all_closed(&r));
    }

    #[test]
    fn send_fd_to_a_closed_peer_raises_no_sigpipe() {
        // Rust binaries ignore SIGPIPE, but a library may live in a host that does not. Blocking
        // it on this thread keeps a raised SIGPIPE pending, where sigpending sees it.
        let (r, w) = pipe();
        drop(r);
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before use; the mask change
        // is this thread's only and undone below.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            let mut old: libc::sigset_t = std::mem::zeroed();
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old), 0);
            let res = send_fd(&a, w.as_fd(), b"pool");
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut pending);
            let raised = libc::sigismember(&pending, libc::SIGPIPE) == 1;
            if raised {
                let mut sig = 0;
                libc::sigwait(&set, &mut sig);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            assert!(!raised, "send_fd raised SIGPIPE (returned {res:?})");
            assert!(
                matches!(&res, Err(Error::Io { op: "sendmsg", source, .. })
                    if source.raw_os_error() == Some(libc::EPIPE)),
                "{res:?}"
            );
        }
    }
}

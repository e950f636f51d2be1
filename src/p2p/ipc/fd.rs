//! Descriptor passing over a Unix stream socket (`SCM_RIGHTS`): how pool and VMM fds travel.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::error::{Error, Result};

/// Sends `payload` (at least one byte) and the descriptor `fd` over a Unix stream socket
/// (`sendmsg` with `SCM_RIGHTS`).
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> Result<()> {
    if payload.is_empty() {
        return Err(Error::InvalidArgument(
            "send at least one payload byte with the descriptor".into(),
        ));
    }
    let iov = [IoSlice::new(payload)];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to `space` bytes of 8-aligned buffer, enough for one cmsghdr
    // carrying one int (CMSG_SPACE); CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd.as_raw_fd());
    }
    // SAFETY: `msg` references live buffers for the call's duration.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    if n < 0 {
        return Err(Error::io("sendmsg", None, std::io::Error::last_os_error()));
    }
    if (n as usize) != payload.len() {
        return Err(Error::io(
            "sendmsg",
            None,
            std::io::Error::new(std::io::ErrorKind::WriteZero, "short write"),
        ));
    }
    Ok(())
}

/// Receives a payload of up to `buf.len()` bytes and one descriptor sent with [`send_fd`];
/// returns the descriptor and the payload length.
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> Result<(OwnedFd, usize)> {
    let mut iov = [IoSliceMut::new(buf)];
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: `msg` references live, writable buffers for the call's duration.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::io("recvmsg", None, std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_FIRSTHDR checks the length.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: `c` is checked for null first and otherwise points into `cbuf`.
    let ok = !c.is_null()
        && unsafe { (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS };
    if !ok {
        return Err(Error::io(
            "recvmsg",
            None,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no SCM_RIGHTS descriptor in the message: the peer must send with send_fd",
            ),
        ));
    }
    // SAFETY: an SCM_RIGHTS message carries at least one int after the header.
    let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int) };
    // SAFETY: the kernel installed `fd` in this process for us.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, n as usize))
}

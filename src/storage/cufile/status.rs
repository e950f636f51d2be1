//! The `ssize_t` returns of cuFile's data path, decoded ([`IoReturn`]); the status codes
//! themselves ([`CuFileStatus`]) are the core's (`crate::error`), re-exported here.
//!
//! The data-path calls (`cuFileRead`, `cuFileWrite`, `cuFileReadv`, `cuFileWritev`, the byte
//! counts of the stream-ordered calls and `CUfileIOEvents_t.ret`) return an `ssize_t`:
//! `>= 0` bytes moved, `-1` an OS error in `errno`, `< -5000` a negated cuFile code, and any
//! other negative value a negated errno. [`IoReturn::decode`] applies exactly that rule.

use crate::error::cufile::CUFILEOP_BASE_ERR;
pub(in crate::storage) use crate::error::cufile::{loaded_version, set_loaded_version};
pub use crate::error::CuFileStatus;

/// One decoded `ssize_t` return of a cuFile data-path call.
#[derive(Debug)]
pub enum IoReturn {
    /// `>= 0`: bytes transferred (0 at end of file).
    Bytes(usize),
    /// `-1` (errno) or another negative value that is not a cuFile code (`-errno`).
    Os(std::io::Error),
    /// `< -5000`: a negated cuFile code.
    CuFile(CuFileStatus),
}

impl IoReturn {
    /// Decodes `ret` by cuFile's rule: `>= 0` bytes, `-1` the OS error in `errno` (read through
    /// the `errno` closure, called only in that case and before anything else can change it),
    /// `< -5000` a cuFile code, other negatives `-errno`.
    pub fn decode(ret: isize, errno: impl FnOnce() -> i32) -> Self {
        if ret >= 0 {
            IoReturn::Bytes(ret as usize)
        } else if ret == -1 {
            IoReturn::Os(std::io::Error::from_raw_os_error(errno()))
        } else if ret < -(CUFILEOP_BASE_ERR as isize) {
            // cuFile codes fit an i32 by construction; saturate anything stranger.
            let code = (ret as i64)
                .checked_neg()
                .and_then(|c| i32::try_from(c).ok())
                .unwrap_or(i32::MAX);
            IoReturn::CuFile(CuFileStatus::new(code))
        } else {
            IoReturn::Os(std::io::Error::from_raw_os_error(-(ret as i32)))
        }
    }

    /// Decodes `CUfileIOEvents_t.ret`, a `size_t` that carries a negative value on error.
    /// A batch completion has no `errno` of its own, so `-1` decodes as `EPERM` there, which is
    /// what `-errno` means for it.
    pub fn decode_event(ret: usize) -> Self {
        let signed = ret as isize;
        if signed == -1 {
            IoReturn::Os(std::io::Error::from_raw_os_error(1))
        } else {
            Self::decode(signed, || 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssize_returns_decode_by_the_rule() {
        assert!(matches!(
            IoReturn::decode(0, || panic!()),
            IoReturn::Bytes(0)
        ));
        assert!(matches!(
            IoReturn::decode(4097, || panic!()),
            IoReturn::Bytes(4097)
        ));
        assert!(
            matches!(IoReturn::decode(isize::MAX, || panic!()), IoReturn::Bytes(n) if n == isize::MAX as usize)
        );
        // -1: errno, read only then.
        match IoReturn::decode(-1, || libc::EBADF) {
            IoReturn::Os(e) => assert_eq!(e.raw_os_error(), Some(libc::EBADF)),
            other => panic!("{other:?}"),
        }
        // Other small negatives: -errno.
        for errno in [
            libc::EIO,
            libc::EINVAL,
            libc::EFAULT,
            libc::ENOSPC,
            4999,
            5000,
        ] {
            match IoReturn::decode(-(errno as isize), || panic!("errno must not be read")) {
                IoReturn::Os(e) => assert_eq!(e.raw_os_error(), Some(errno)),
                other => panic!("{errno}: {other:?}"),
            }
        }
        // Below -5000: a cuFile code, known or not.
        for code in [5001, 5008, 5011, 5030, 5039, 5050, 5051, 6001] {
            match IoReturn::decode(-(code as isize), || panic!()) {
                IoReturn::CuFile(s) => assert_eq!(s.code(), code),
                other => panic!("{code}: {other:?}"),
            }
        }
        match IoReturn::decode(isize::MIN, || panic!()) {
            IoReturn::CuFile(s) => assert_eq!(s.code(), i32::MAX),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn batch_event_ret_is_reinterpreted_as_signed() {
        assert!(matches!(IoReturn::decode_event(123), IoReturn::Bytes(123)));
        match IoReturn::decode_event((-5008isize) as usize) {
            IoReturn::CuFile(s) => assert_eq!(s.code(), 5008),
            other => panic!("{other:?}"),
        }
        match IoReturn::decode_event((-(libc::EIO as isize)) as usize) {
            IoReturn::Os(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            IoReturn::decode_event(usize::MAX),
            IoReturn::Os(_)
        ));
    }
}

//! Task planning: how a file range is cut into work items for the pool.

use crate::storage::config::DIRECT_ALIGN;

/// One unit of work: a contiguous range of one file and where it lands in one of the job's
/// buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(in crate::storage) struct Task {
    /// Index of the file in the job.
    pub file: u32,
    /// Index of the buffer in the job.
    pub buf: u32,
    /// Index of the item (the caller's unit of success or failure) the task belongs to.
    pub item: u32,
    /// Offset in the file.
    pub file_off: u64,
    /// Offset in the caller's buffer.
    pub buf_off: usize,
    /// Bytes of payload.
    pub len: usize,
    /// Planned for O_DIRECT (reads: the aligned superset is read; writes: the task is aligned).
    pub direct: bool,
}

/// The direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::storage) enum Dir {
    /// File → memory.
    Read,
    /// Memory → file.
    Write,
}

pub(in crate::storage) fn align_down(x: u64) -> u64 {
    x / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64
}

pub(in crate::storage) fn align_up(x: u64) -> u64 {
    x.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

pub(in crate::storage) fn is_aligned(x: u64) -> bool {
    x.is_multiple_of(DIRECT_ALIGN as u64)
}

/// The aligned range an O_DIRECT read of `t` covers: `(io_off, io_len, head)` where the
/// payload starts `head` bytes into it. Always fits in `piece` bytes for tasks from [`plan`].
pub(in crate::storage) fn direct_read_span(t: &Task) -> (u64, usize, usize) {
    let io_off = align_down(t.file_off);
    let io_end = align_up(t.file_off + t.len as u64);
    (
        io_off,
        (io_end - io_off) as usize,
        (t.file_off - io_off) as usize,
    )
}

/// Cuts `[off, off + len)` into tasks whose boundaries are multiples of `piece` in file-offset
/// space (`piece` is a multiple of [`DIRECT_ALIGN`]), so that every task's aligned span fits
/// a `piece`-sized bounce buffer.
///
/// With `direct`, reads plan every task direct (over-reading the aligned span); writes split
/// an unaligned head and tail off as buffered tasks (O_DIRECT cannot write part of a block).
/// The caller guarantees `off + len` does not overflow.
pub(in crate::storage) fn plan(
    off: u64,
    len: usize,
    piece: usize,
    dir: Dir,
    direct: bool,
) -> Vec<Task> {
    let mut tasks = Vec::with_capacity(len / piece.max(1) + 3);
    plan_item(&mut tasks, Task::default(), off, len, piece, dir, direct);
    tasks
}

/// [`plan`] for one item of a job: appends the tasks of `[off, off + len)` of file `at.file`
/// landing in buffer `at.buf` from offset `at.buf_off`, all marked as item `at.item`.
pub(in crate::storage) fn plan_item(
    tasks: &mut Vec<Task>,
    at: Task,
    off: u64,
    len: usize,
    piece: usize,
    dir: Dir,
    direct: bool,
) {
    debug_assert!(piece >= DIRECT_ALIGN && piece.is_multiple_of(DIRECT_ALIGN));
    if len == 0 {
        return;
    }
    let end = off + len as u64;
    let piece = piece as u64;
    let mut push = |a: u64, b: u64, direct: bool| {
        if b > a {
            tasks.push(Task {
                file: at.file,
                buf: at.buf,
                item: at.item,
                file_off: a,
                buf_off: at.buf_off + (a - off) as usize,
                len: (b - a) as usize,
                direct,
            });
        }
    };
    let (mut a, body_end) = if direct && dir == Dir::Write {
        let head_end = align_up(off).min(end);
        let tail_start = align_down(end).max(head_end);
        push(off, head_end, false);
        (head_end, tail_start)
    } else {
        (off, end)
    };
    while a < body_end {
        let b = ((a / piece + 1) * piece).min(body_end);
        push(a, b, direct);
        a = b;
    }
    if direct && dir == Dir::Write {
        push(body_end, end, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn check(off: u64, len: usize, piece: usize, dir: Dir, direct: bool) {
        let t = plan(off, len, piece, dir, direct);
        // Contiguous, complete, in order.
        let mut pos = off;
        for x in &t {
            assert_eq!(x.file_off, pos, "{t:?}");
            assert_eq!(x.buf_off as u64, pos - off);
            assert!(x.len > 0 && x.len <= piece, "{x:?}");
            pos += x.len as u64;
            if x.direct {
                let (io_off, io_len, head) = direct_read_span(x);
                assert!(is_aligned(io_off) && io_len.is_multiple_of(DIRECT_ALIGN));
                assert!(io_len <= piece, "{x:?} span {io_len} > {piece}");
                assert_eq!(io_off + head as u64, x.file_off);
                if dir == Dir::Write {
                    assert!(
                        is_aligned(x.file_off) && x.len.is_multiple_of(DIRECT_ALIGN),
                        "{x:?}"
                    );
                }
            }
            if !direct {
                assert!(!x.direct);
            }
        }
        assert_eq!(pos, off + len as u64);
    }

    #[test]
    fn empty_range_has_no_tasks() {
        assert!(plan(123, 0, 4096, Dir::Read, true).is_empty());
    }

    #[test]
    fn aligned_ranges_split_on_piece_boundaries() {
        let t = plan(0, 10 << 20, 4 << 20, Dir::Read, false);
        assert_eq!(t.len(), 3);
        assert_eq!(t[2].len, 2 << 20);
        let t = plan(4096, 8192, 4096, Dir::Write, true);
        assert_eq!(t.len(), 2);
        assert!(t.iter().all(|x| x.direct));
    }

    #[test]
    fn unaligned_write_head_and_tail_are_buffered() {
        let t = plan(100, 10_000, 4096, Dir::Write, true);
        assert_eq!(t.first().unwrap().len, 3996);
        assert!(!t.first().unwrap().direct);
        assert!(!t.last().unwrap().direct);
        assert_eq!(t.last().unwrap().file_off, 8192);
        assert!(t[1].direct);
        // Inside one block: one buffered task.
        let t = plan(10, 20, 4096, Dir::Write, true);
        assert_eq!(
            t,
            vec![Task {
                file_off: 10,
                buf_off: 0,
                len: 20,
                direct: false,
                ..Task::default()
            }]
        );
    }

    #[test]
    fn random_plans_are_complete_and_fit_the_bounce_buffer() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..5000 {
            let off = rng.random_range(0..1u64 << 40);
            let len = rng.random_range(0..64 << 20);
            let piece = rng.random_range(1..=1024usize) * DIRECT_ALIGN;
            let dir = if rng.random() { Dir::Read } else { Dir::Write };
            check(off, len, piece, dir, rng.random());
        }
    }
}

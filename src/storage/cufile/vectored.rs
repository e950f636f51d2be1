//! Scatter/gather IO (`cuFileReadv` / `cuFileWritev`, cuFile 1.19+).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cufile_sys as sys;

use super::buffer::allocation_range;
use super::file_handle::{protected_tail, Scratch, READ_OVERRUN};
use super::{result, CuFileHandle};
use crate::error::{Error, Result};

impl CuFileHandle {
    /// Reads consecutive file bytes from `file_offset` into `bufs` in order (`cuFileReadv`).
    /// Returns the bytes read (short only at end of file). Each buffer's stream waits for the
    /// buffer's pending work on other streams and is synchronised first, as for
    /// [`read`](Self::read). The read is clamped to the file's size, and no byte outside `bufs`
    /// and none past end of file is written: buffers that follow each other in one allocation
    /// (sub-slices of one buffer, back to back) form a run, and the last bytes of every run (up
    /// to 68 KiB, as for [`read`](Self::read)) are read into a scratch device buffer in the same
    /// `cuFileReadv` call and copied into place after it; the rest of each run is read in place.
    ///
    /// Needs cuFile 1.19+: an older library gives [`Error::SymbolUnavailable`] before anything
    /// is read. A buffer's stream capturing a CUDA graph → [`Error::Unsupported`], checked
    /// first (the call synchronises the streams, which a capture forbids).
    pub fn readv(&self, bufs: &mut [CudaViewMut<'_, u8>], file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing_any(bufs.iter().map(|b| b.stream()), "CuFileHandle::readv")?;
        let lib = self.driver().lib();
        result::sym(lib.cuFileReadv, "cuFileReadv")?;
        let _restore = crate::cuda::CurrentContext::save();
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_end(file_offset, total)?;
        let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| Arc::clone(b.stream())).collect();
        // Pointers first (each view's stream then waits for the view's pending work elsewhere),
        // then the streams are synchronised, so cuFile (ordered with no stream) comes after.
        let mut pieces = Vec::with_capacity(bufs.len());
        let mut records = Vec::with_capacity(bufs.len());
        // One stream per context: where that context's scratch buffer and copies go.
        let mut groups: Vec<Arc<CudaStream>> = Vec::new();
        for (b, stream) in bufs.iter_mut().zip(&streams) {
            let len = b.len();
            // Its waits for the view's users elsewhere made, or the call fails before cuFile is
            // called (`ordered_access`).
            let (ptr, rec) =
                crate::cuda::ordered::ordered_access(stream, || b.device_ptr_mut(stream))?;
            records.push(rec);
            let ctx = stream.context().cu_ctx();
            let group = match groups.iter().position(|s| s.context().cu_ctx() == ctx) {
                Some(g) => g,
                None => {
                    groups.push(Arc::clone(stream));
                    groups.len() - 1
                }
            };
            let base = if len == 0 {
                ptr
            } else {
                self.driver().enter(stream, false)?;
                allocation_range(ptr)?.0
            };
            pieces.push(Piece {
                ptr,
                len,
                base,
                group,
            });
        }
        let n = super::file_handle::clamp_to_eof(
            self.file(),
            self.path(),
            file_offset,
            usize::try_from(total).unwrap_or(usize::MAX),
        )?;
        let plan = plan(&pieces, n, file_offset, groups.len());
        let mut scratch: Vec<Option<Scratch>> = Vec::with_capacity(groups.len());
        for (stream, &bytes) in groups.iter().zip(&plan.scratch) {
            scratch.push(if bytes == 0 {
                None
            } else {
                self.driver().enter(stream, false)?;
                Some(Scratch::alloc(stream, bytes)?)
            });
        }
        // After the scratch allocations: they are ordered on streams synchronised here.
        for stream in &streams {
            self.driver().enter(stream, true)?;
        }
        let scratch_at = |group: usize, at: usize| {
            scratch[group]
                .as_ref()
                .expect("the plan sized a scratch buffer for every group it uses")
                .ptr()
                + at as u64
        };
        let iov: Vec<sys::CUfileIOVec_t> = plan
            .elements
            .iter()
            .map(|e| sys::CUfileIOVec_t {
                base: match e.dest {
                    Dest::Device(p) => p,
                    Dest::Scratch { group, at } => scratch_at(group, at),
                } as *mut c_void,
                len: e.len,
            })
            .collect();
        if iov.is_empty() {
            return Ok(0);
        }
        // SAFETY: each element lies inside a live device view borrowed mutably for this call
        // or inside a scratch buffer of ours (`plan`), its stream synchronised after waiting
        // for the view's other users (and after the scratch allocation), its context current
        // (enter); the elements stop at end of file as it is now; the handle is registered;
        // the call is synchronous.
        let done = unsafe { result::readv(lib, self.inner().fh, &iov, file_offset as i64) }?;
        let done = done.min(n);
        // The runs' last bytes into place, as far as the read got.
        let mut failed = None;
        for c in &plan.copies {
            if done <= c.file_pos {
                break;
            }
            let len = c.len.min(done - c.file_pos);
            let stream = &groups[c.group];
            let copied = self.driver().enter(stream, false).and_then(|()| {
                // SAFETY: `dst .. + len` lies inside a run of the caller's views and `src .. +
                // len` inside the scratch buffer (`plan`), both in the stream's context, which
                // is current; the stream is synchronised below, before the scratch buffer is
                // freed or the call returns.
                unsafe {
                    crate::cuda::result::mem::memcpy_dtod_async(
                        c.dst,
                        scratch_at(c.group, c.at),
                        len,
                        stream.cu_stream(),
                    )
                }
            });
            if let Err(e) = copied {
                failed = Some(e);
                break;
            }
        }
        for (stream, s) in groups.iter().zip(&scratch) {
            if s.is_some() {
                // Through the result layer: cudarc's synchronize returns (and takes) an error
                // stored in the caller's object without synchronizing.
                if let Err(e) = crate::cuda::settle::synchronize(stream) {
                    failed.get_or_insert(e);
                }
            }
        }
        drop(records);
        match failed {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Writes `bufs` in order to consecutive file bytes from `file_offset` (`cuFileWritev`,
    /// cuFile 1.19+). Returns the bytes written. Each buffer's stream waits for the buffer's
    /// pending writes on other streams and is synchronised first. A buffer's stream capturing a
    /// CUDA graph → [`Error::Unsupported`], checked first (as for [`readv`](Self::readv)).
    pub fn writev(&self, bufs: &[CudaView<'_, u8>], file_offset: u64) -> Result<usize> {
        crate::cuda::refuse_capturing_any(bufs.iter().map(|b| b.stream()), "CuFileHandle::writev")?;
        let lib = self.driver().lib();
        result::sym(lib.cuFileWritev, "cuFileWritev")?;
        let _restore = crate::cuda::CurrentContext::save();
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_end(file_offset, total)?;
        let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| Arc::clone(b.stream())).collect();
        let mut iov = Vec::with_capacity(bufs.len());
        let mut records = Vec::with_capacity(bufs.len());
        for (b, stream) in bufs.iter().zip(&streams) {
            let len = b.len();
            // As in `readv`.
            let (p, rec) = crate::cuda::ordered::ordered_access(stream, || b.device_ptr(stream))?;
            iov.push(sys::CUfileIOVec_t {
                base: p as *mut c_void,
                len,
            });
            records.push(rec);
        }
        for stream in &streams {
            self.driver().enter(stream, true)?;
        }
        // SAFETY: as in readv, with the buffers only read.
        let n = unsafe { result::writev(lib, self.inner().fh, &iov, file_offset as i64) };
        drop(records);
        n
    }
}

fn check_end(file_offset: u64, total: u64) -> Result<()> {
    if file_offset
        .checked_add(total)
        .is_none_or(|e| e > i64::MAX as u64)
    {
        return Err(Error::InvalidArgument(format!(
            "file offset {file_offset} + {total} bytes exceeds the largest file offset"
        )));
    }
    Ok(())
}

/// One buffer of a vectored read, as [`plan`] sees it: where it starts, how long it is, the
/// start of the allocation holding it and its context's index (`group`).
#[derive(Debug, Clone, Copy)]
struct Piece {
    ptr: u64,
    len: usize,
    base: u64,
    group: usize,
}

/// Where an element of the read goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dest {
    /// Straight into a caller's buffer, at this device address.
    Device(u64),
    /// Into the scratch buffer of context `group`, `at` bytes from its start.
    Scratch { group: usize, at: usize },
}

/// One element of the `cuFileReadv` call.
#[derive(Debug, Clone, Copy)]
struct Element {
    dest: Dest,
    len: usize,
}

/// Scratch bytes to copy into a caller's buffer after the read: `len` bytes at `at` of
/// context `group`'s scratch buffer, holding the file's bytes from `file_pos` (counted from
/// the read's offset), go to `dst`.
#[derive(Debug, Clone, Copy)]
struct TailCopy {
    group: usize,
    at: usize,
    dst: u64,
    len: usize,
    file_pos: usize,
}

/// The layout of a protected vectored read.
#[derive(Debug, Default)]
struct Plan {
    /// In file order, covering the read's bytes exactly once.
    elements: Vec<Element>,
    /// In file order.
    copies: Vec<TailCopy>,
    /// Bytes of scratch buffer per context (0: none needed).
    scratch: Vec<usize>,
}

/// How a `cuFileReadv` of the first `n` bytes of `pieces` (in order, from `file_offset`)
/// writes no byte outside them, even when cuFile writes up to [`READ_OVERRUN`] bytes past each
/// element (what `CuFileHandle::read_inside` guards against for one view).
///
/// Pieces that follow each other in one allocation form a run (what a write past one of them
/// reaches is the next, which the same call fills). Each run is read as `read_inside` reads a
/// view: its body in place, its last [`protected_tail`] bytes into a scratch slot of its
/// context's scratch buffer, with [`READ_OVERRUN`] bytes to spare before the next slot (slots
/// start at 4 KiB), and copied into place after the call. A write past the body lands in the
/// run's tail, which the copy then writes; a write past a slot lands in its spare bytes.
/// Empty pieces take no element.
fn plan(pieces: &[Piece], n: usize, file_offset: u64, groups: usize) -> Plan {
    let mut plan = Plan {
        scratch: vec![0; groups],
        ..Plan::default()
    };
    // The pieces' bytes up to `n`, without empty pieces.
    let mut left = n;
    let pieces: Vec<Piece> = pieces
        .iter()
        .filter_map(|p| {
            let len = p.len.min(left);
            left -= len;
            (len > 0).then_some(Piece { len, ..*p })
        })
        .collect();
    let mut pos = 0usize;
    let mut i = 0;
    while i < pieces.len() {
        let first = pieces[i];
        let mut len = first.len;
        let mut j = i + 1;
        while j < pieces.len()
            && pieces[j].base == first.base
            && pieces[j].group == first.group
            && pieces[j].ptr == first.ptr + len as u64
        {
            len += pieces[j].len;
            j += 1;
        }
        let tail = protected_tail(file_offset + pos as u64, len);
        let body = len - tail;
        if body > 0 {
            plan.elements.push(Element {
                dest: Dest::Device(first.ptr),
                len: body,
            });
        }
        let group = first.group;
        let at = plan.scratch[group];
        plan.scratch[group] = (at + tail + READ_OVERRUN).next_multiple_of(4096);
        plan.elements.push(Element {
            dest: Dest::Scratch { group, at },
            len: tail,
        });
        plan.copies.push(TailCopy {
            group,
            at,
            dst: first.ptr + body as u64,
            len: tail,
            file_pos: pos + body,
        });
        pos += len;
        i = j;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Simulated device address of byte `off` of allocation `k` (allocations are 1 TiB apart).
    fn addr(k: usize, off: usize) -> u64 {
        ((k as u64 + 1) << 40) + off as u64
    }

    /// Allocation and offset of a simulated device address.
    fn place(a: u64) -> (usize, usize) {
        ((a >> 40) as usize - 1, (a & ((1 << 40) - 1)) as usize)
    }

    /// A caller's view: `len` bytes at `off` of allocation `alloc` (of context `alloc % 2`).
    #[derive(Debug, Clone, Copy)]
    struct V {
        alloc: usize,
        off: usize,
        len: usize,
    }

    fn pieces(views: &[V]) -> Vec<Piece> {
        views
            .iter()
            .map(|v| Piece {
                ptr: addr(v.alloc, v.off),
                len: v.len,
                base: addr(v.alloc, 0),
                group: v.alloc % 2,
            })
            .collect()
    }

    /// Runs `plan` against a cuFile that writes each element's file bytes and then
    /// `READ_OVERRUN` bytes of junk past the element (clipped to its allocation), the elements
    /// in order or in reverse, then does the plan's copies; checks that every view holds the
    /// file's bytes (its first `n` bytes from `file_offset`, in view order) and that no other
    /// byte of any allocation changed, and that no junk fell past a scratch buffer. Returns
    /// what went wrong.
    fn simulate(
        plan: &Plan,
        views: &[V],
        allocs: &[usize],
        file: &[u8],
        file_offset: usize,
        n: usize,
        reverse: bool,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        // Random bytes, cut from one pool (generating them per call is slow in debug builds).
        static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let pool = POOL.get_or_init(|| crate::storage::testkit::random(8 << 20, 7));
        let before: Vec<Vec<u8>> = allocs
            .iter()
            .enumerate()
            .map(|(k, &len)| {
                let at = (k * 4099) % (pool.len() - len);
                pool[at..at + len].to_vec()
            })
            .collect();
        let mut mem = before.clone();
        let mut scratch: Vec<Vec<u8>> = plan.scratch.iter().map(|&b| vec![0u8; b]).collect();
        let mut fpos = 0;
        let mut order: Vec<(usize, Element)> = plan
            .elements
            .iter()
            .map(|&e| {
                let at = fpos;
                fpos += e.len;
                (at, e)
            })
            .collect();
        if fpos != n {
            problems.push(format!("the elements cover {fpos} bytes, not {n}"));
        }
        if reverse {
            order.reverse();
        }
        for (fp, e) in order {
            let src = &file[file_offset + fp..file_offset + fp + e.len];
            let (buf, at) = match e.dest {
                Dest::Device(p) => {
                    let (k, off) = place(p);
                    (&mut mem[k], off)
                }
                Dest::Scratch { group, at } => (&mut scratch[group], at),
            };
            if at + e.len > buf.len() {
                problems.push(format!("element {e:?} runs past its buffer"));
                continue;
            }
            buf[at..at + e.len].copy_from_slice(src);
            let end = (at + e.len + READ_OVERRUN).min(buf.len());
            if matches!(e.dest, Dest::Scratch { .. }) && at + e.len + READ_OVERRUN > buf.len() {
                problems.push(format!(
                    "a write past element {e:?} leaves its scratch buffer"
                ));
            }
            buf[at + e.len..end].iter_mut().for_each(|b| *b ^= 0x5A);
        }
        for c in &plan.copies {
            let (k, off) = place(c.dst);
            let src = scratch[c.group][c.at..c.at + c.len].to_vec();
            mem[k][off..off + c.len].copy_from_slice(&src);
        }
        let mut expect = before.clone();
        let mut left = n;
        let mut fp = file_offset;
        for v in views {
            let k = v.len.min(left);
            expect[v.alloc][v.off..v.off + k].copy_from_slice(&file[fp..fp + k]);
            left -= k;
            fp += k;
        }
        for (k, (got, want)) in mem.iter().zip(&expect).enumerate() {
            if got == want {
                continue;
            }
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                let inside = views
                    .iter()
                    .any(|v| v.alloc == k && (v.off..v.off + v.len).contains(&i));
                problems.push(format!(
                    "allocation {k}: byte {i} ({} a view) differs",
                    if inside { "inside" } else { "outside" }
                ));
            }
        }
        problems
    }

    /// The protection before the fix: the whole read's last `protected_tail` bytes through
    /// scratch (piece by piece, as `read_inside` read each: its own body in place, its tail
    /// through a scratch buffer of its own), every piece before that read in place.
    fn old_plan(pieces: &[Piece], n: usize, file_offset: u64) -> Plan {
        let tail = protected_tail(file_offset, n);
        let body = n - tail;
        let mut plan = Plan {
            scratch: vec![0; 2],
            ..Plan::default()
        };
        let mut pos = 0;
        for p in pieces {
            let len = p.len.min(n - pos);
            let direct = len.min(body.saturating_sub(pos));
            if direct > 0 {
                plan.elements.push(Element {
                    dest: Dest::Device(p.ptr),
                    len: direct,
                });
            }
            let rest = len - direct;
            if rest > 0 {
                let fp = pos + direct;
                let t = protected_tail(file_offset + fp as u64, rest);
                if rest > t {
                    plan.elements.push(Element {
                        dest: Dest::Device(p.ptr + direct as u64),
                        len: rest - t,
                    });
                }
                let at = plan.scratch[p.group];
                plan.scratch[p.group] = (at + t + READ_OVERRUN).next_multiple_of(4096);
                plan.elements.push(Element {
                    dest: Dest::Scratch { group: p.group, at },
                    len: t,
                });
                plan.copies.push(TailCopy {
                    group: p.group,
                    at,
                    dst: p.ptr + (direct + rest - t) as u64,
                    len: t,
                    file_pos: fp + rest - t,
                });
            }
            pos += len;
        }
        plan
    }

    /// Review N2 (on the host, cuFile simulated): a `cuFileReadv` whose cuFile writes up to 64
    /// KiB of junk past each element, in either order, leaves every byte outside the views as
    /// it was and every view byte the file's, for the review's case (a 5000-byte view, then
    /// another allocation), views with gaps in one allocation, adjacent views (one run), views
    /// crossing end of file, empty views, and two contexts. The layout of the code before the
    /// fix fails the same simulation (the junk past the first view lands outside it).
    #[test]
    fn a_protected_readv_writes_nothing_outside_its_views() {
        let g = 128 << 10;
        let file = crate::storage::testkit::random(4 << 20, 31);
        // (allocation sizes, views, file offset, bytes the file has from there)
        let cases: Vec<(Vec<usize>, Vec<V>, usize, usize)> = vec![
            (
                vec![2 * g + 5000, 2 * g + 70_000],
                vec![
                    V {
                        alloc: 0,
                        off: g,
                        len: 5000,
                    },
                    V {
                        alloc: 1,
                        off: g,
                        len: 70_000,
                    },
                ],
                0,
                1 << 20,
            ),
            (
                vec![3 * g + 300_000],
                vec![
                    V {
                        alloc: 0,
                        off: g + 13,
                        len: 5000,
                    },
                    V {
                        alloc: 0,
                        off: 2 * g + 5013,
                        len: 200_000,
                    },
                ],
                4097,
                1 << 20,
            ),
            (
                vec![2 * g + 300_000],
                vec![
                    V {
                        alloc: 0,
                        off: g,
                        len: 5000,
                    },
                    V {
                        alloc: 0,
                        off: g + 5000,
                        len: 0,
                    },
                    V {
                        alloc: 0,
                        off: g + 5000,
                        len: 200_000,
                    },
                ],
                1,
                1 << 20,
            ),
            (
                vec![2 * g + 9000, 2 * g + 9000, 2 * g + 9000],
                vec![
                    V {
                        alloc: 0,
                        off: g,
                        len: 9000,
                    },
                    V {
                        alloc: 1,
                        off: g + 1,
                        len: 9000,
                    },
                    V {
                        alloc: 2,
                        off: g + 2,
                        len: 9000,
                    },
                ],
                8192,
                12_000,
            ),
        ];
        for (i, (allocs, views, off, avail)) in cases.iter().enumerate() {
            let total: usize = views.iter().map(|v| v.len).sum();
            let n = total.min(*avail);
            let p = pieces(views);
            let plan = plan(&p, n, *off as u64, 2);
            for reverse in [false, true] {
                let problems = simulate(&plan, views, allocs, &file, *off, n, reverse);
                assert!(
                    problems.is_empty(),
                    "case {i} (reverse {reverse}): {problems:?}"
                );
            }
        }
        // The review's case under the old layout: the junk past the first view lands outside.
        let (allocs, views, off, avail) = &cases[0];
        let n = avail.min(&75_000).to_owned();
        let old = old_plan(&pieces(views), n, *off as u64);
        let problems = simulate(&old, views, allocs, &file, *off, n, false);
        assert!(
            problems.iter().any(|p| p.contains("outside")),
            "the simulation does not catch the old layout: {problems:?}"
        );
    }

    /// Random layouts (views of up to 200 KiB, back to back in one allocation or not, empty
    /// ones, two contexts, any file offset, reads ending before the views do), in both orders:
    /// nothing outside the views changes, every view byte is the file's.
    #[test]
    fn random_readv_layouts_write_nothing_outside_their_views() {
        let file = crate::storage::testkit::random(8 << 20, 32);
        let mut rng = rand::rngs::StdRng::seed_from_u64(33);
        let g = 64 << 10;
        for round in 0..200 {
            let count = rng.random_range(1..8);
            let mut allocs: Vec<usize> = Vec::new();
            let mut views: Vec<V> = Vec::new();
            for _ in 0..count {
                let len = match rng.random_range(0..4) {
                    0 => rng.random_range(0..16),
                    1 => rng.random_range(0..8192),
                    _ => rng.random_range(0..200_000),
                };
                let adjacent = !views.is_empty() && rng.random_bool(0.4);
                let gap = if rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(1..3 * g)
                };
                match views.last().copied() {
                    Some(last) if adjacent => {
                        let off = last.off + last.len + gap;
                        allocs[last.alloc] = off + len + g + READ_OVERRUN;
                        views.push(V {
                            alloc: last.alloc,
                            off,
                            len,
                        });
                    }
                    _ => {
                        let off = g + rng.random_range(0..4096);
                        allocs.push(off + len + g + READ_OVERRUN);
                        views.push(V {
                            alloc: allocs.len() - 1,
                            off,
                            len,
                        });
                    }
                }
            }
            let total: usize = views.iter().map(|v| v.len).sum();
            let off = rng.random_range(0..(1 << 20));
            let n = if rng.random_bool(0.3) {
                rng.random_range(0..=total)
            } else {
                total
            };
            let plan = plan(&pieces(&views), n, off as u64, 2);
            for reverse in [false, true] {
                let problems = simulate(&plan, &views, &allocs, &file, off, n, reverse);
                assert!(
                    problems.is_empty(),
                    "round {round}: views {views:?}, offset {off}, {n} bytes (reverse \
                     {reverse}): {problems:?}"
                );
            }
        }
    }
}

//! The read plan: which bytes of which shard go where in device memory, as few and as large
//! reads as the layout allows.
//!
//! Rules:
//! - only selected tensors are read (a filter's excluded bytes are never read);
//! - a tensor's device offset is a multiple of its dtype's alignment, so typed views are
//!   aligned even when the file offset is not;
//! - tensors adjacent in a file whose device offsets keep that adjacency are one read; a new
//!   read starts at a device offset congruent to its file offset modulo 4 KiB where the dtype
//!   allows (DMA-friendly), else at a [`RUN_ALIGN`]-aligned one.

use super::dtype::Dtype;
use super::source::Shard;

/// Device alignment of a read that starts a run when its file offset's page phase does not suit
/// the dtype (cudarc allocations are at least 256-byte aligned, so these offsets are too in
/// absolute terms).
pub const RUN_ALIGN: u64 = 256;
/// The page size device offsets are matched to file offsets modulo.
pub const PAGE: u64 = 4096;

/// One selected tensor: where it is in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Selected {
    pub shard: usize,
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub file_offset: u64,
    pub len: u64,
}

/// One read: `len` bytes at `file_offset` of `shard` into the chunk's buffer at `dev_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Read {
    pub shard: usize,
    pub file_offset: u64,
    pub len: u64,
    pub dev_offset: u64,
}

/// A set of reads into one device buffer of `dev_len` bytes, and where each tensor lands in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub reads: Vec<Read>,
    /// (index into the selected tensors, device offset in this chunk's buffer).
    pub tensors: Vec<(usize, u64)>,
    pub dev_len: u64,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Where a read that starts a run goes in device memory, at or after `cursor`: congruent to its
/// file offset modulo [`PAGE`] when that keeps the dtype's alignment (so DMA paths can move
/// whole pages between file and device), else at the next [`RUN_ALIGN`] boundary.
fn run_start(cursor: u64, file_offset: u64, align: u64) -> u64 {
    let phase = file_offset % PAGE;
    if phase.is_multiple_of(align) {
        let base = align_up(cursor, PAGE);
        if base + phase >= cursor + PAGE {
            base + phase - PAGE
        } else {
            base + phase
        }
    } else {
        align_up(cursor, RUN_ALIGN)
    }
}

/// Selects tensors in load order (shard, then file offset).
pub(crate) fn select(shards: &[Shard], keep: impl Fn(&str) -> bool) -> Vec<Selected> {
    let mut v = Vec::new();
    for (i, s) in shards.iter().enumerate() {
        for t in &s.header.tensors {
            if keep(&t.name) {
                v.push(Selected {
                    shard: i,
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    file_offset: t.offset,
                    len: t.len,
                });
            }
        }
    }
    v
}

/// Plans `sel` (in load order) into one device buffer.
pub(crate) fn plan(sel: &[Selected]) -> Chunk {
    let mut cur = Chunk {
        reads: Vec::new(),
        tensors: Vec::new(),
        dev_len: 0,
    };
    for (i, t) in sel.iter().enumerate() {
        if t.len == 0 {
            // Nothing to read: an empty view at offset 0 (in bounds and aligned).
            cur.tensors.push((i, 0));
            continue;
        }
        let align = t.dtype.align() as u64;
        // Extend the last read when this tensor follows it in the same file and stays aligned.
        let extend = cur.reads.last().is_some_and(|r| {
            r.shard == t.shard
                && r.file_offset + r.len == t.file_offset
                && (r.dev_offset + r.len).is_multiple_of(align)
                && r.dev_offset + r.len == cur.dev_len
        });
        let dev = if extend {
            cur.dev_len
        } else {
            run_start(cur.dev_len, t.file_offset, align)
        };
        if extend {
            cur.reads.last_mut().expect("extend implies a read").len += t.len;
        } else {
            cur.reads.push(Read {
                shard: t.shard,
                file_offset: t.file_offset,
                len: t.len,
                dev_offset: dev,
            });
        }
        cur.tensors.push((i, dev));
        cur.dev_len = dev + t.len;
    }
    cur
}

/// Splits reads longer than `max` into pieces of at most `max` (for progress reports).
pub(crate) fn split(reads: &[Read], max: u64) -> Vec<Read> {
    let mut v = Vec::new();
    for r in reads {
        let mut done = 0;
        while done < r.len {
            let n = (r.len - done).min(max.max(1));
            v.push(Read {
                shard: r.shard,
                file_offset: r.file_offset + done,
                len: n,
                dev_offset: r.dev_offset + done,
            });
            done += n;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn t(shard: usize, name: &str, dtype: Dtype, off: u64, len: u64) -> Selected {
        Selected {
            shard,
            name: name.into(),
            dtype,
            shape: vec![],
            file_offset: off,
            len,
        }
    }

    #[test]
    fn an_aligned_file_is_one_read() {
        let sel = vec![
            t(0, "a", Dtype::F32, 128, 4096),
            t(0, "b", Dtype::BF16, 128 + 4096, 100),
            t(0, "e", Dtype::F64, 128 + 4196, 0),
            t(0, "c", Dtype::U8, 128 + 4196, 3),
        ];
        let c = [plan(&sel)];
        assert_eq!(
            c[0].reads,
            vec![Read {
                shard: 0,
                file_offset: 128,
                len: 4199,
                dev_offset: 128
            }]
        );
        assert_eq!(
            c[0].tensors,
            vec![(0, 128), (1, 128 + 4096), (2, 0), (3, 128 + 4196)]
        );
    }

    #[test]
    fn misaligned_tensors_start_new_reads_and_shards_never_merge() {
        // "b" follows a 3-byte tensor: at device offset 3 an F32 view would be misaligned.
        let sel = vec![
            t(0, "a", Dtype::U8, 8, 3),
            t(0, "b", Dtype::F32, 11, 8),
            t(1, "c", Dtype::U8, 8, 4),
            t(1, "d", Dtype::U8, 100, 4),
        ];
        let c = [plan(&sel)];
        let offs: Vec<u64> = c[0].reads.iter().map(|r| r.dev_offset).collect();
        // a: page phase 8; b: phase 11 does not suit F32, so 256-aligned; c, d: phases 8 and
        // 100, each the first such offset past the previous read.
        assert_eq!(offs, vec![8, 256, 4096 + 8, 4096 + 100]);
        assert_eq!(c[0].dev_len, 4096 + 104);
    }

    /// Random plans: every byte of every selected tensor is read exactly once, into the
    /// tensor's place; reads never overlap in device memory; offsets are aligned.
    #[test]
    fn random_plans_are_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let dts = [Dtype::U8, Dtype::BF16, Dtype::F32, Dtype::F64, Dtype::I16];
        for _ in 0..500 {
            let mut sel = Vec::new();
            for shard in 0..rng.random_range(1..4) {
                let mut off = rng.random_range(8..64u64);
                for k in 0..rng.random_range(0..12) {
                    let d = dts[rng.random_range(0..dts.len())];
                    let len = rng.random_range(0..40u64) * (d.bits() as u64 / 8);
                    if rng.random_bool(0.8) {
                        sel.push(t(shard, &format!("{shard}.{k}"), d, off, len));
                    }
                    off += len;
                }
            }
            let chunks = [plan(&sel)];
            let mut seen = vec![0; sel.len()];
            for c in &chunks {
                for r in &c.reads {
                    let phase = r.dev_offset % PAGE == r.file_offset % PAGE;
                    assert!(phase || r.dev_offset.is_multiple_of(RUN_ALIGN), "{r:?}");
                }
                let mut spans: Vec<(u64, u64)> = c
                    .reads
                    .iter()
                    .map(|r| (r.dev_offset, r.dev_offset + r.len))
                    .collect();
                spans.sort();
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0);
                }
                for r in &c.reads {
                    assert!(r.dev_offset + r.len <= c.dev_len);
                }
                for &(i, dev) in &c.tensors {
                    seen[i] += 1;
                    let s = &sel[i];
                    assert_eq!(dev % s.dtype.align() as u64, 0);
                    assert!(dev + s.len <= c.dev_len);
                    if s.len > 0 {
                        // Some read covers the tensor's bytes at the tensor's place.
                        let r = c
                            .reads
                            .iter()
                            .find(|r| {
                                r.shard == s.shard
                                    && r.file_offset <= s.file_offset
                                    && s.file_offset + s.len <= r.file_offset + r.len
                            })
                            .expect("covered");
                        assert_eq!(r.dev_offset + (s.file_offset - r.file_offset), dev);
                    }
                }
                // No byte read that no selected tensor owns.
                let owned: u64 = c.tensors.iter().map(|&(i, _)| sel[i].len).sum();
                let read: u64 = c.reads.iter().map(|r| r.len).sum();
                assert_eq!(owned, read);
            }
            assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
            let pieces = split(&chunks[0].reads, 7);
            assert_eq!(
                pieces.iter().map(|r| r.len).sum::<u64>(),
                chunks[0].reads.iter().map(|r| r.len).sum::<u64>()
            );
            assert!(pieces.iter().all(|r| r.len <= 7 && r.len > 0));
        }
    }
}

//! The fan-out plan (pure): where each GPU's pieces live in its one allocation, which GPU reads
//! which bytes of which shard, and which peer copies bring them to the other GPUs.
//!
//! Rules:
//! - each GPU's allocation is laid out as a single-GPU load lays out its tensors
//!   ([`plan::plan`]): pieces in load order, each aligned for its dtype, runs page-phased;
//! - every byte some GPU wants is read from storage exactly once, by one of the GPUs that want
//!   it, straight into its place there (no staging memory); the other GPUs that want it get it
//!   by a peer copy from that place;
//! - bytes are read in segments of at most `segment` bytes of the same set of wanting GPUs
//!   (a large tensor is cut at page boundaries of the file), so a reader reads segment `k+1`
//!   while segment `k` fans out;
//! - each segment goes to the wanting GPU with the fewest bytes to read so far (a GPU that alone
//!   wants bytes reads them), ties to the lowest position: a replicated checkpoint is read
//!   round-robin, every GPU's link busy;
//! - a segment's reads and copies merge what is contiguous (in the file and on the reader; on
//!   the reader and on the destination).

use super::placement::Want;
use super::plan::{self, Read, Selected, PAGE};

/// Default bytes per segment.
pub(crate) const DEFAULT_SEGMENT: u64 = 64 << 20;
/// The smallest segment the options allow.
pub(crate) const MIN_SEGMENT: u64 = 1 << 20;

/// One GPU's allocation: where each of its wanted pieces lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Device offset of each of the GPU's [`Want`]s, in their order.
    pub offsets: Vec<u64>,
    /// Bytes of the allocation.
    pub dev_len: u64,
}

/// A copy from the reader's allocation into another GPU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCopy {
    /// The destination's position among the load's GPUs.
    pub dst: usize,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// What one reader does for one segment: its reads, then the copies of what they read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Reads into the reader's allocation (`dev_offset` is the reader's).
    pub reads: Vec<Read>,
    /// Copies out of what the reads brought, in destination order from the reader's next GPU on.
    pub copies: Vec<PeerCopy>,
}

/// The whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Per GPU (position among the load's GPUs).
    pub layouts: Vec<Layout>,
    /// Per reader GPU (position), its segments in file order.
    pub segments: Vec<Vec<Segment>>,
}

impl Schedule {
    /// Bytes read from storage (each once).
    pub(crate) fn read_bytes(&self) -> u64 {
        self.segments
            .iter()
            .flatten()
            .flat_map(|s| &s.reads)
            .map(|r| r.len)
            .sum()
    }

    /// Bytes moved by peer copies.
    pub(crate) fn copied_bytes(&self) -> u64 {
        self.segments
            .iter()
            .flatten()
            .flat_map(|s| &s.copies)
            .map(|c| c.len)
            .sum()
    }

    /// The (reader, destination) position pairs that have copies, each once, in order.
    pub(crate) fn pairs(&self) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (r, segs) in self.segments.iter().enumerate() {
            for c in segs.iter().flat_map(|s| &s.copies) {
                if !v.contains(&(r, c.dst)) {
                    v.push((r, c.dst));
                }
            }
        }
        v
    }
}

/// Bytes `[file_offset, file_offset + len)` of `shard` that the GPUs in `needers` (position,
/// device offset of the first byte) want.
#[derive(Debug, Clone)]
struct Atom {
    shard: usize,
    file_offset: u64,
    len: u64,
    needers: Vec<(usize, u64)>,
}

impl Atom {
    fn split(&mut self, head: u64) -> Atom {
        let h = Atom {
            shard: self.shard,
            file_offset: self.file_offset,
            len: head,
            needers: self.needers.clone(),
        };
        self.file_offset += head;
        self.len -= head;
        for n in &mut self.needers {
            n.1 += head;
        }
        h
    }
}

/// Lays out each GPU's pieces as a single-GPU load would.
fn layout(sel: &[Selected], wants: &[Want]) -> Layout {
    let pieces: Vec<Selected> = wants
        .iter()
        .map(|w| {
            let t = &sel[w.sel];
            Selected {
                shard: t.shard,
                name: String::new(),
                dtype: t.dtype,
                shape: Vec::new(),
                file_offset: t.file_offset + w.start,
                len: w.len(),
            }
        })
        .collect();
    let chunk = plan::plan(&pieces);
    let mut offsets = vec![0; wants.len()];
    for &(k, dev) in &chunk.tensors {
        offsets[k] = dev;
    }
    Layout {
        offsets,
        dev_len: chunk.dev_len,
    }
}

/// The atoms of the load, in load order: each tensor cut at every wanted range's ends.
fn atoms(sel: &[Selected], wants: &[Vec<Want>], layouts: &[Layout]) -> Vec<Atom> {
    // Per tensor: (position, start, end, device offset of start).
    let mut by_sel: Vec<Vec<(usize, u64, u64, u64)>> = vec![Vec::new(); sel.len()];
    for (d, ws) in wants.iter().enumerate() {
        for (k, w) in ws.iter().enumerate() {
            if w.len() > 0 {
                by_sel[w.sel].push((d, w.start, w.end, layouts[d].offsets[k]));
            }
        }
    }
    let mut out = Vec::new();
    for (i, entries) in by_sel.iter().enumerate() {
        let mut cuts: Vec<u64> = entries.iter().flat_map(|e| [e.1, e.2]).collect();
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let (a, b) = (w[0], w[1]);
            let needers: Vec<(usize, u64)> = entries
                .iter()
                .filter(|e| e.1 <= a && b <= e.2)
                .map(|e| (e.0, e.3 + (a - e.1)))
                .collect();
            if needers.is_empty() {
                continue;
            }
            out.push(Atom {
                shard: sel[i].shard,
                file_offset: sel[i].file_offset + a,
                len: b - a,
                needers,
            });
        }
    }
    out
}

fn same_gpus(a: &[(usize, u64)], b: &[(usize, u64)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.0 == y.0)
}

/// Groups atoms into segments of at most `segment` (>= 1) bytes wanted by the same GPUs.
fn segments_of(atoms: Vec<Atom>, segment: u64) -> Vec<Vec<Atom>> {
    let mut segs: Vec<Vec<Atom>> = Vec::new();
    let mut cur: Vec<Atom> = Vec::new();
    let mut cur_len = 0u64;
    for mut a in atoms {
        loop {
            let fits_set = cur
                .first()
                .is_none_or(|f| same_gpus(&f.needers, &a.needers));
            if !fits_set || cur_len >= segment {
                segs.push(std::mem::take(&mut cur));
                cur_len = 0;
            }
            let room = segment - cur_len;
            if a.len <= room {
                cur_len += a.len;
                cur.push(a);
                break;
            }
            // Cut at a page boundary of the file (reads stay page-aligned) if one fits, else
            // (a segment smaller than a page) where the segment ends.
            let cut = (a.file_offset + room) / PAGE * PAGE;
            let head = if cut > a.file_offset {
                cut - a.file_offset
            } else if cur.is_empty() {
                room
            } else {
                0
            };
            if head > 0 {
                cur.push(a.split(head));
            }
            segs.push(std::mem::take(&mut cur));
            cur_len = 0;
        }
    }
    if !cur.is_empty() {
        segs.push(cur);
    }
    segs.retain(|s| !s.is_empty());
    segs
}

/// Plans the fan-out of `sel` to the GPUs whose wants are `wants` (one list per position).
pub(crate) fn schedule(sel: &[Selected], wants: &[Vec<Want>], segment: u64) -> Schedule {
    let segment = segment.max(1);
    let n = wants.len();
    let layouts: Vec<Layout> = wants.iter().map(|w| layout(sel, w)).collect();
    let segs = segments_of(atoms(sel, wants, &layouts), segment);
    let bytes = |s: &[Atom]| s.iter().map(|a| a.len).sum::<u64>();
    // Who reads: GPUs alone in wanting bytes read them; the rest goes to the least loaded.
    let mut load = vec![0u64; n];
    let mut reader = vec![usize::MAX; segs.len()];
    for (k, s) in segs.iter().enumerate() {
        if s[0].needers.len() == 1 {
            reader[k] = s[0].needers[0].0;
            load[reader[k]] += bytes(s);
        }
    }
    for (k, s) in segs.iter().enumerate() {
        if reader[k] == usize::MAX {
            let r = s[0]
                .needers
                .iter()
                .map(|x| x.0)
                .min_by_key(|&d| (load[d], d))
                .expect("a segment has a GPU that wants it");
            reader[k] = r;
            load[r] += bytes(s);
        }
    }
    let mut per_reader: Vec<Vec<Segment>> = vec![Vec::new(); n];
    for (k, s) in segs.iter().enumerate() {
        let r = reader[k];
        let at = |a: &Atom, d: usize| {
            a.needers
                .iter()
                .find(|x| x.0 == d)
                .map(|x| x.1)
                .expect("the GPU wants the atom")
        };
        let mut reads: Vec<Read> = Vec::new();
        for a in s {
            let dev = at(a, r);
            match reads.last_mut() {
                Some(p)
                    if p.shard == a.shard
                        && p.file_offset + p.len == a.file_offset
                        && p.dev_offset + p.len == dev =>
                {
                    p.len += a.len
                }
                _ => reads.push(Read {
                    shard: a.shard,
                    file_offset: a.file_offset,
                    len: a.len,
                    dev_offset: dev,
                }),
            }
        }
        let mut dsts: Vec<usize> = s[0]
            .needers
            .iter()
            .map(|x| x.0)
            .filter(|&d| d != r)
            .collect();
        dsts.sort_by_key(|&d| (d + n - r) % n);
        let mut copies: Vec<PeerCopy> = Vec::new();
        for d in dsts {
            let first = copies.len();
            for a in s {
                let (src, dst) = (at(a, r), at(a, d));
                match copies[first..].last_mut() {
                    Some(p) if p.src_offset + p.len == src && p.dst_offset + p.len == dst => {
                        p.len += a.len
                    }
                    _ => copies.push(PeerCopy {
                        dst: d,
                        src_offset: src,
                        dst_offset: dst,
                        len: a.len,
                    }),
                }
            }
        }
        per_reader[r].push(Segment { reads, copies });
    }
    Schedule {
        layouts,
        segments: per_reader,
    }
}

#[cfg(test)]
mod tests {
    use super::super::dtype::Dtype;
    use super::super::placement::{everything, Placement};
    use super::*;
    use rand::{Rng, SeedableRng};

    fn t(shard: usize, name: &str, dtype: Dtype, shape: Vec<usize>, off: u64) -> Selected {
        let len = (shape.iter().product::<usize>() * dtype.bits() / 8) as u64;
        Selected {
            shard,
            name: name.into(),
            dtype,
            shape,
            file_offset: off,
            len,
        }
    }

    /// Checks `s` by running it on a model of the GPUs: each device byte records which file
    /// byte it holds and which operation wrote it. Every wanted byte of every GPU ends up
    /// holding its file byte; no device byte is written twice; every copy reads bytes its own
    /// segment's reads wrote; no file byte is read twice; layouts are aligned and in bounds.
    fn check(sel: &[Selected], wants: &[Vec<Want>], s: &Schedule, segment: u64) {
        let n = wants.len();
        assert_eq!(s.layouts.len(), n);
        assert_eq!(s.segments.len(), n);
        // (shard, file offset, writer id) per device byte.
        let mut mem: Vec<Vec<Option<(usize, u64, usize)>>> = s
            .layouts
            .iter()
            .map(|l| vec![None; l.dev_len as usize])
            .collect();
        let mut read_once = std::collections::HashSet::new();
        let mut op = 0usize;
        for (r, segs) in s.segments.iter().enumerate() {
            for seg in segs {
                op += 1;
                let seg_bytes: u64 = seg.reads.iter().map(|x| x.len).sum();
                assert!(seg_bytes <= segment, "{seg:?}");
                assert!(!seg.reads.is_empty());
                for rd in &seg.reads {
                    for k in 0..rd.len {
                        assert!(
                            read_once.insert((rd.shard, rd.file_offset + k)),
                            "read twice"
                        );
                        let b = &mut mem[r][(rd.dev_offset + k) as usize];
                        assert!(b.is_none(), "device byte written twice");
                        *b = Some((rd.shard, rd.file_offset + k, op));
                    }
                }
                for c in &seg.copies {
                    assert_ne!(c.dst, r);
                    for k in 0..c.len {
                        let v = mem[r][(c.src_offset + k) as usize];
                        assert!(
                            v.is_some_and(|v| v.2 == op),
                            "a copy reads bytes its segment's reads did not write"
                        );
                        let b = &mut mem[c.dst][(c.dst_offset + k) as usize];
                        assert!(b.is_none(), "device byte written twice");
                        *b = v;
                    }
                }
            }
        }
        for (d, ws) in wants.iter().enumerate() {
            let l = &s.layouts[d];
            assert_eq!(l.offsets.len(), ws.len());
            for (k, w) in ws.iter().enumerate() {
                let tsel = &sel[w.sel];
                let off = l.offsets[k];
                assert_eq!(off % tsel.dtype.align() as u64, 0);
                assert!(off + w.len() <= l.dev_len);
                for j in 0..w.len() {
                    let got = mem[d][(off + j) as usize].map(|v| (v.0, v.1));
                    assert_eq!(
                        got,
                        Some((tsel.shard, tsel.file_offset + w.start + j)),
                        "GPU {d}, {}, byte {j}",
                        tsel.name
                    );
                }
            }
        }
        // Only wanted bytes were read.
        let mut wanted = std::collections::HashSet::new();
        for ws in wants {
            for w in ws {
                let t = &sel[w.sel];
                for j in w.start..w.end {
                    wanted.insert((t.shard, t.file_offset + j));
                }
            }
        }
        assert_eq!(wanted, read_once);
        assert_eq!(s.read_bytes(), wanted.len() as u64);
    }

    /// A torch-written file: tensors back to back from offset 128, on 4 GPUs, replicated.
    #[test]
    fn replicated_contiguous_file_is_read_round_robin_one_read_and_copy_per_segment() {
        let mut sel = Vec::new();
        let mut off = 128;
        for i in 0..20 {
            let x = t(0, &format!("w{i}"), Dtype::BF16, vec![10, 1024], off);
            off += x.len;
            sel.push(x);
        }
        let total: u64 = sel.iter().map(|x| x.len).sum();
        let wants = everything(&sel, 4);
        let seg = 8 * PAGE;
        let s = schedule(&sel, &wants, seg);
        check(&sel, &wants, &s, seg);
        // Identical layouts on every GPU, one run.
        assert!(s.layouts.windows(2).all(|w| w[0] == w[1]));
        let nsegs = total.div_ceil(seg) as usize;
        let all: Vec<&Segment> = s.segments.iter().flatten().collect();
        assert!(
            all.len() >= nsegs && all.len() <= nsegs + 1,
            "{}",
            all.len()
        );
        for (r, segs) in s.segments.iter().enumerate() {
            for g in segs {
                assert_eq!(g.reads.len(), 1, "one read per segment");
                assert_eq!(g.copies.len(), 3, "one copy per other GPU");
                let order: Vec<usize> = g.copies.iter().map(|c| c.dst).collect();
                let want: Vec<usize> = (1..4).map(|k| (r + k) % 4).collect();
                assert_eq!(order, want, "ring order from the reader's next GPU");
                // Segments after the first start page-aligned in the file.
                assert!(
                    g.reads[0].file_offset == 128 || g.reads[0].file_offset.is_multiple_of(PAGE)
                );
            }
        }
        let loads: Vec<u64> = s
            .segments
            .iter()
            .map(|v| v.iter().flat_map(|g| &g.reads).map(|r| r.len).sum())
            .collect();
        let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
        assert!(hi - lo <= seg, "balanced: {loads:?}");
        assert_eq!(s.copied_bytes(), 3 * total);
        assert_eq!(s.pairs().len(), 12);
    }

    #[test]
    fn one_gpu_has_no_copies_and_the_single_gpu_layout() {
        let sel = vec![
            t(0, "a", Dtype::U8, vec![3], 8),
            t(0, "b", Dtype::F32, vec![5], 11),
            t(1, "c", Dtype::F64, vec![2, 2], 64),
        ];
        let wants = everything(&sel, 1);
        let s = schedule(&sel, &wants, 1 << 20);
        check(&sel, &wants, &s, 1 << 20);
        assert_eq!(s.copied_bytes(), 0);
        assert!(s.pairs().is_empty());
        let single = plan::plan(&sel);
        assert_eq!(s.layouts[0].dev_len, single.dev_len);
        let offs: Vec<u64> = single.tensors.iter().map(|x| x.1).collect();
        assert_eq!(s.layouts[0].offsets, offs);
        let reads: Vec<Read> = s.segments[0].iter().flat_map(|g| g.reads.clone()).collect();
        assert_eq!(reads, single.reads);
    }

    /// Tensor parallelism: split tensors are read by their one GPU each (no copies), the
    /// replicated rest is spread over all of them.
    #[test]
    fn tensor_parallel_reads_splits_locally() {
        let mut sel = Vec::new();
        let mut off = 80;
        for i in 0..8 {
            let w = t(0, &format!("l{i}.proj"), Dtype::BF16, vec![64, 512], off);
            off += w.len;
            let nrm = t(0, &format!("l{i}.norm"), Dtype::F32, vec![512], off);
            off += nrm.len;
            sel.push(w);
            sel.push(nrm);
        }
        let devs = [0, 1, 2, 3];
        let wants = Placement::new()
            .split_rows("*.proj", devs)
            .replicate("*")
            .resolve(&sel, &devs)
            .unwrap();
        let s = schedule(&sel, &wants, 1 << 20);
        check(&sel, &wants, &s, 1 << 20);
        let split_bytes: u64 = sel.iter().step_by(2).map(|x| x.len).sum();
        let norm_bytes: u64 = sel.iter().skip(1).step_by(2).map(|x| x.len).sum();
        assert_eq!(s.read_bytes(), split_bytes + norm_bytes);
        assert_eq!(s.copied_bytes(), 3 * norm_bytes);
    }

    /// Bytes contiguous on the reader need not be on the destination: GPU 0's piece of `w`
    /// starts a run at a 256-byte boundary (its file offset's phase does not suit F32), so `z`
    /// cannot follow it there, while on GPU 1 (the reader: GPU 0 has more of its own to read) the
    /// two are back to back.
    #[test]
    fn copies_merge_only_what_is_contiguous_on_both_sides() {
        let sel = vec![
            t(0, "v", Dtype::U8, vec![100], 8),
            t(0, "w", Dtype::F32, vec![2], 110),
            t(0, "z", Dtype::F64, vec![1], 118),
        ];
        let devs = [0, 1];
        let wants = Placement::new()
            .put("v", [0])
            .put_ranges("w", [(0, 4..8), (1, 0..8)])
            .put("z", [0, 1])
            .resolve(&sel, &devs)
            .unwrap();
        let s = schedule(&sel, &wants, 1 << 20);
        check(&sel, &wants, &s, 1 << 20);
        assert_eq!(s.layouts[1].offsets, vec![0, 8]);
        assert_eq!(s.layouts[0].offsets, vec![8, 256, 512]);
        let shared = &s.segments[1]
            .iter()
            .find(|g| !g.copies.is_empty())
            .expect("GPU 1 reads the shared bytes")
            .copies;
        assert_eq!(
            shared,
            &vec![
                PeerCopy {
                    dst: 0,
                    src_offset: 4,
                    dst_offset: 256,
                    len: 4
                },
                PeerCopy {
                    dst: 0,
                    src_offset: 8,
                    dst_offset: 512,
                    len: 8
                }
            ]
        );
    }

    /// Random checkpoints, placements and segment sizes, checked on the model of the GPUs.
    #[test]
    fn random_fan_outs_are_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        let dts = [
            Dtype::U8,
            Dtype::BF16,
            Dtype::F32,
            Dtype::F64,
            Dtype::F6_E2M3,
        ];
        for _ in 0..200 {
            let mut sel = Vec::new();
            for shard in 0..rng.random_range(1..4) {
                let mut off = rng.random_range(8..5000u64);
                for k in 0..rng.random_range(0..10) {
                    let d = dts[rng.random_range(0..dts.len())];
                    let rows = rng.random_range(0..6usize);
                    let cols = if d == Dtype::F6_E2M3 {
                        4
                    } else {
                        rng.random_range(1..400usize)
                    };
                    let x = t(shard, &format!("s{shard}.t{k}"), d, vec![rows, cols], off);
                    off += x.len;
                    // Gaps stand for tensors a filter left out.
                    if rng.random_bool(0.2) {
                        off += rng.random_range(1..9000u64) * 2;
                        continue;
                    }
                    sel.push(x);
                }
            }
            if sel.is_empty() {
                continue;
            }
            let n = rng.random_range(1..5usize);
            let devs: Vec<usize> = (0..n).map(|i| i * 2 + 1).collect();
            let mut p = Placement::new();
            for x in &sel {
                p = match rng.random_range(0..4) {
                    0 => p.split_rows(
                        x.name.clone(),
                        devs.iter().copied().filter(|_| rng.random_bool(0.7)),
                    ),
                    1 => p.put(
                        x.name.clone(),
                        devs.iter().copied().filter(|_| rng.random_bool(0.5)),
                    ),
                    2 => {
                        let unit = super::super::placement::element_unit(x.dtype);
                        let units = x.len / unit;
                        let mut ranges: Vec<(usize, std::ops::Range<u64>)> = Vec::new();
                        for &d in &devs {
                            if rng.random_bool(0.6) {
                                let a = rng.random_range(0..=units);
                                let b = rng.random_range(a..=units);
                                ranges.push((d, a * unit..b * unit));
                            }
                        }
                        p.put_ranges(x.name.clone(), ranges)
                    }
                    _ => p,
                };
            }
            let p = p.replicate("*");
            let wants = match p.resolve(&sel, &devs) {
                Ok(w) => w,
                Err((_, crate::safetensors::Problem::NoDevices { .. })) => continue,
                Err(e) => panic!("{e:?}"),
            };
            let segment = match rng.random_range(0..3) {
                0 => MIN_SEGMENT,
                1 => PAGE * rng.random_range(1..5),
                _ => rng.random_range(1..20000),
            };
            let s = schedule(&sel, &wants, segment);
            check(&sel, &wants, &s, segment);
        }
    }
}

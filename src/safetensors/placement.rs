//! Where each tensor goes in a multi-GPU load: [`Placement`], and its validation into the byte
//! ranges each GPU gets.

use std::ops::Range;

use super::dtype::Dtype;
use super::filter::glob;
use super::plan::Selected;
use super::Problem;

/// Which tensors (or byte ranges of tensors) each GPU of a multi-GPU load gets.
///
/// A placement is a list of rules. Each tensor the load selects takes the **first** rule whose
/// pattern matches its name (exact names, or globs with `*` and `?` as in
/// [`LoadOptions::filter`](super::LoadOptions::filter)); later rules do not apply to it:
/// - [`replicate`](Placement::replicate): the whole tensor on every GPU of the load;
/// - [`put`](Placement::put): the whole tensor on the GPUs named;
/// - [`split_rows`](Placement::split_rows): its rows (first dimension) split in order over the
///   GPUs named, as tensor parallelism does; GPU `k` of `n` gets rows `[k·R/n, (k+1)·R/n)`
///   (rounded down, so the parts differ by at most one row; a part may be empty);
/// - [`put_ranges`](Placement::put_ranges): explicit byte ranges of one tensor, one per GPU.
///
/// ```
/// use gpudirect::safetensors::Placement;
/// // Tensor parallelism over GPUs 0-3: projections split by rows, the rest everywhere.
/// let p = Placement::new()
///     .split_rows("*.q_proj.weight", 0..4)
///     .put("lm_head.weight", [0])
///     .replicate("*");
/// # let _ = p;
/// ```
///
/// Checked before any byte moves, each an [`Error::Checkpoint`](crate::Error::Checkpoint) with
/// its [`Problem`]: a rule naming a GPU the load has no stream for
/// ([`Problem::UnknownDevice`]) or none ([`Problem::NoDevices`]); a pattern that matches no
/// loaded tensor ([`Problem::PlacementMatchedNothing`]); a tensor no rule places
/// ([`Problem::Unplaced`]: place it, or leave it out with a filter); a byte range outside the
/// tensor ([`Problem::RangeOutOfBounds`]) or cutting its elements
/// ([`Problem::RangeMisaligned`]); two different ranges of one tensor for one GPU
/// ([`Problem::PlacedTwice`]); rows of a 0-d tensor, or of a 4- or 6-bit tensor whose rows are
/// not whole bytes ([`Problem::NotSplittable`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    Replicate {
        pattern: String,
    },
    Put {
        pattern: String,
        devices: Vec<usize>,
    },
    SplitRows {
        pattern: String,
        devices: Vec<usize>,
    },
    Ranges {
        tensor: String,
        ranges: Vec<(usize, Range<u64>)>,
    },
}

impl Rule {
    fn pattern(&self) -> &str {
        match self {
            Rule::Replicate { pattern }
            | Rule::Put { pattern, .. }
            | Rule::SplitRows { pattern, .. } => pattern,
            Rule::Ranges { tensor, .. } => tensor,
        }
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Rule::Ranges { tensor, .. } => tensor == name,
            r => glob(r.pattern().as_bytes(), name.as_bytes()),
        }
    }

    fn devices(&self) -> Vec<usize> {
        match self {
            Rule::Replicate { .. } => Vec::new(),
            Rule::Put { devices, .. } | Rule::SplitRows { devices, .. } => devices.clone(),
            Rule::Ranges { ranges, .. } => ranges.iter().map(|r| r.0).collect(),
        }
    }
}

impl Placement {
    /// No rules yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every tensor on every GPU of the load (what
    /// [`LoadOptions::load_replicated`](super::LoadOptions::load_replicated) uses).
    pub fn replicated() -> Self {
        Self::new().replicate("*")
    }

    /// The tensors matching `pattern`, whole, on every GPU of the load.
    pub fn replicate(mut self, pattern: impl Into<String>) -> Self {
        self.rules.push(Rule::Replicate {
            pattern: pattern.into(),
        });
        self
    }

    /// The tensors matching `pattern`, whole, on the GPUs `devices` (CUDA ordinals).
    pub fn put(
        mut self,
        pattern: impl Into<String>,
        devices: impl IntoIterator<Item = usize>,
    ) -> Self {
        let mut devices: Vec<usize> = devices.into_iter().collect();
        let mut seen = Vec::new();
        devices.retain(|d| {
            let new = !seen.contains(d);
            seen.push(*d);
            new
        });
        self.rules.push(Rule::Put {
            pattern: pattern.into(),
            devices,
        });
        self
    }

    /// The rows (first dimension) of the tensors matching `pattern`, split in order over the
    /// GPUs `devices`: the `k`-th of `n` GPUs gets rows `[k·R/n, (k+1)·R/n)` of `R`, as a tensor
    /// of shape `[rows, rest of the shape]`. A row must be whole bytes: a 4- or 6-bit tensor
    /// whose rows are not is refused ([`Problem::NotSplittable`]; give byte ranges with
    /// [`put_ranges`](Self::put_ranges)).
    pub fn split_rows(
        mut self,
        pattern: impl Into<String>,
        devices: impl IntoIterator<Item = usize>,
    ) -> Self {
        self.rules.push(Rule::SplitRows {
            pattern: pattern.into(),
            devices: devices.into_iter().collect(),
        });
        self
    }

    /// Byte ranges of the tensor `tensor` (its exact name), each to one GPU: `(device, start..end)`
    /// in bytes from the tensor's start. Ranges may overlap across GPUs (their common bytes are
    /// still read once). A range that is whole rows is a tensor of shape `[rows, rest]`, any
    /// other a 1-D tensor of its elements.
    pub fn put_ranges(
        mut self,
        tensor: impl Into<String>,
        ranges: impl IntoIterator<Item = (usize, Range<u64>)>,
    ) -> Self {
        self.rules.push(Rule::Ranges {
            tensor: tensor.into(),
            ranges: ranges.into_iter().collect(),
        });
        self
    }

    /// True when this is [`Placement::replicated`] (one rule: every tensor everywhere).
    pub(crate) fn is_replicated(&self) -> bool {
        matches!(&self.rules[..], [Rule::Replicate { pattern }] if pattern == "*")
    }

    /// The byte ranges each GPU of `devices` gets of the selected tensors `sel`: one list per
    /// position in `devices`, in load order. Errors: the tensor to blame (if any) and why.
    pub(crate) fn resolve(
        &self,
        sel: &[Selected],
        devices: &[usize],
    ) -> Result<Vec<Vec<Want>>, (Option<String>, Problem)> {
        for r in &self.rules {
            let ds = r.devices();
            if ds.is_empty() && !matches!(r, Rule::Replicate { .. }) {
                return Err((
                    None,
                    Problem::NoDevices {
                        pattern: r.pattern().to_owned(),
                    },
                ));
            }
            if let Some(&d) = ds.iter().find(|d| !devices.contains(d)) {
                return Err((
                    None,
                    Problem::UnknownDevice {
                        device: d,
                        devices: devices.to_vec(),
                    },
                ));
            }
            if !sel.iter().any(|t| r.matches(&t.name)) {
                return Err((
                    None,
                    Problem::PlacementMatchedNothing {
                        pattern: r.pattern().to_owned(),
                        tensors: sel.len(),
                    },
                ));
            }
        }
        let pos = |d: usize| devices.iter().position(|&x| x == d).expect("checked above");
        let mut out: Vec<Vec<Want>> = vec![Vec::new(); devices.len()];
        for (i, t) in sel.iter().enumerate() {
            let Some(rule) = self.rules.iter().find(|r| r.matches(&t.name)) else {
                return Err((Some(t.name.clone()), Problem::Unplaced));
            };
            let mut got: Vec<(usize, Range<u64>)> = Vec::new();
            match rule {
                Rule::Replicate { .. } => {
                    got.extend(devices.iter().map(|&d| (d, 0..t.len)));
                }
                Rule::Put { devices: ds, .. } => got.extend(ds.iter().map(|&d| (d, 0..t.len))),
                Rule::SplitRows { devices: ds, .. } => {
                    let Some(&rows) = t.shape.first() else {
                        return Err((
                            Some(t.name.clone()),
                            Problem::NotSplittable {
                                shape: t.shape.clone(),
                            },
                        ));
                    };
                    let Some(row) = row_bytes(t) else {
                        return Err((
                            Some(t.name.clone()),
                            Problem::NotSplittable {
                                shape: t.shape.clone(),
                            },
                        ));
                    };
                    let rows = rows as u64;
                    let n = ds.len() as u64;
                    for (k, &d) in ds.iter().enumerate() {
                        let k = k as u64;
                        let (a, b) = (k * rows / n, (k + 1) * rows / n);
                        got.push((d, a * row..b * row));
                    }
                }
                Rule::Ranges { ranges, .. } => {
                    let unit = element_unit(t.dtype);
                    for (d, r) in ranges {
                        if r.start > r.end || r.end > t.len {
                            return Err((
                                Some(t.name.clone()),
                                Problem::RangeOutOfBounds {
                                    start: r.start,
                                    end: r.end,
                                    len: t.len,
                                },
                            ));
                        }
                        if !r.start.is_multiple_of(unit) || !r.end.is_multiple_of(unit) {
                            return Err((
                                Some(t.name.clone()),
                                Problem::RangeMisaligned {
                                    start: r.start,
                                    end: r.end,
                                    unit,
                                },
                            ));
                        }
                        got.push((*d, r.clone()));
                    }
                }
            }
            let mut mine: Vec<Option<Range<u64>>> = vec![None; devices.len()];
            for (d, r) in got {
                let p = pos(d);
                match &mine[p] {
                    Some(prev) if *prev != r => {
                        return Err((
                            Some(t.name.clone()),
                            Problem::PlacedTwice {
                                device: d,
                                first_start: prev.start,
                                first_end: prev.end,
                                second_start: r.start,
                                second_end: r.end,
                            },
                        ))
                    }
                    _ => mine[p] = Some(r),
                }
            }
            for (p, r) in mine.into_iter().enumerate() {
                if let Some(r) = r {
                    let shape = piece_shape(t, &r);
                    out[p].push(Want {
                        sel: i,
                        start: r.start,
                        end: r.end,
                        shape,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// One piece a GPU gets: bytes `[start, end)` of selected tensor `sel`, as a tensor of `shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Want {
    pub sel: usize,
    pub start: u64,
    pub end: u64,
    pub shape: Vec<usize>,
}

impl Want {
    pub(crate) fn len(&self) -> u64 {
        self.end - self.start
    }
}

/// Every tensor whole on every GPU.
#[cfg(test)]
pub(crate) fn everything(sel: &[Selected], devices: usize) -> Vec<Vec<Want>> {
    let all: Vec<Want> = sel
        .iter()
        .enumerate()
        .map(|(i, t)| Want {
            sel: i,
            start: 0,
            end: t.len,
            shape: t.shape.clone(),
        })
        .collect();
    vec![all; devices]
}

/// The fewest bytes that hold whole elements of `d` (the element size; 3 bytes for the 6-bit
/// types; 1 for the 4-bit one).
pub(crate) fn element_unit(d: Dtype) -> u64 {
    match d.bits() {
        4 => 1,
        6 => 3,
        b => (b / 8) as u64,
    }
}

/// The shape of bytes `r` of tensor `t`: its shape when whole; `[rows, rest]` when `r` is whole
/// rows; else 1-D, its elements.
fn piece_shape(t: &Selected, r: &Range<u64>) -> Vec<usize> {
    if r.start == 0 && r.end == t.len {
        return t.shape.clone();
    }
    if let Some(row) = row_bytes(t) {
        if row > 0 && r.start.is_multiple_of(row) && r.end.is_multiple_of(row) {
            let mut s = t.shape.clone();
            s[0] = ((r.end - r.start) / row) as usize;
            return s;
        }
    }
    vec![((r.end - r.start) * 8 / t.dtype.bits() as u64) as usize]
}

/// The bytes of one row (first dimension) of `t`: `None` when it has no rows (0-d) or a row is
/// not a whole number of bytes (4- and 6-bit dtypes with an odd count per row); 0 for a tensor
/// of no rows or empty rows.
fn row_bytes(t: &Selected) -> Option<u64> {
    let (&rows, rest) = t.shape.split_first()?;
    if rows == 0 {
        // No bytes at all; the rest of the shape may even overflow (the header only checks
        // the product, which is 0).
        return Some(0);
    }
    // Fits: the whole tensor's bits did (the header checked them), and a row is a part of it.
    let bits = rest.iter().product::<usize>() as u64 * t.dtype.bits() as u64;
    bits.is_multiple_of(8).then_some(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: Dtype, shape: &[usize]) -> Selected {
        let len = shape.iter().product::<usize>() * dtype.bits() / 8;
        Selected {
            shard: 0,
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            file_offset: 8,
            len: len as u64,
        }
    }

    fn sel() -> Vec<Selected> {
        vec![
            t("model.layers.0.q_proj.weight", Dtype::BF16, &[10, 4]),
            t("model.layers.0.norm.weight", Dtype::F32, &[4]),
            t("lm_head.weight", Dtype::BF16, &[3, 4]),
            t("scale", Dtype::F32, &[]),
        ]
    }

    type Got = (usize, u64, u64, Vec<usize>);

    fn ranges(w: &[Vec<Want>]) -> Vec<Vec<Got>> {
        w.iter()
            .map(|d| {
                d.iter()
                    .map(|w| (w.sel, w.start, w.end, w.shape.clone()))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn first_matching_rule_places_each_tensor() {
        let s = sel();
        let p = Placement::new()
            .split_rows("*.q_proj.weight", [0, 1, 2])
            .put("lm_head.weight", [2, 2])
            .replicate("*");
        let w = p.resolve(&s, &[0, 1, 2]).unwrap();
        // 10 rows of 8 bytes over 3 GPUs: rows [0,3) [3,6) [6,10).
        assert_eq!(
            ranges(&w),
            vec![
                vec![
                    (0, 0, 24, vec![3, 4]),
                    (1, 0, 16, vec![4]),
                    (3, 0, 4, vec![])
                ],
                vec![
                    (0, 24, 48, vec![3, 4]),
                    (1, 0, 16, vec![4]),
                    (3, 0, 4, vec![])
                ],
                vec![
                    (0, 48, 80, vec![4, 4]),
                    (1, 0, 16, vec![4]),
                    (2, 0, 24, vec![3, 4]),
                    (3, 0, 4, vec![])
                ],
            ]
        );
        assert!(Placement::replicated().is_replicated());
        assert!(!p.is_replicated());
        let all = Placement::replicated().resolve(&s, &[3, 5]).unwrap();
        assert_eq!(all, everything(&s, 2));
    }

    #[test]
    fn ranges_shapes_and_refusals() {
        let s = sel();
        // Whole rows keep the row shape; other ranges are 1-D.
        let p = Placement::new()
            .put_ranges("model.layers.0.q_proj.weight", [(0, 8..24), (1, 2..10)])
            .replicate("*");
        let w = p.resolve(&s, &[0, 1]).unwrap();
        assert_eq!(
            (w[0][0].start, w[0][0].end, &w[0][0].shape[..]),
            (8, 24, &[2, 4][..])
        );
        assert_eq!(
            (w[1][0].start, w[1][0].end, &w[1][0].shape[..]),
            (2, 10, &[4][..])
        );
        let bad = |p: Placement, devs: &[usize]| p.resolve(&s, devs).unwrap_err();
        let q = "model.layers.0.q_proj.weight";
        assert_eq!(
            bad(Placement::new().put("*", [0, 7]), &[0, 1]),
            (
                None,
                Problem::UnknownDevice {
                    device: 7,
                    devices: vec![0, 1]
                }
            )
        );
        assert_eq!(
            bad(Placement::new().put("*", []), &[0]),
            (
                None,
                Problem::NoDevices {
                    pattern: "*".into()
                }
            )
        );
        assert_eq!(
            bad(Placement::new().replicate("*").put("typo*", [0]), &[0]),
            (
                None,
                Problem::PlacementMatchedNothing {
                    pattern: "typo*".into(),
                    tensors: 4
                }
            )
        );
        assert_eq!(
            bad(Placement::new().replicate("model.*"), &[0]),
            (Some("lm_head.weight".into()), Problem::Unplaced)
        );
        assert_eq!(
            bad(
                Placement::new().put_ranges(q, [(0, 0..81)]).replicate("*"),
                &[0]
            ),
            (
                Some(q.into()),
                Problem::RangeOutOfBounds {
                    start: 0,
                    end: 81,
                    len: 80
                }
            )
        );
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 10..2;
        assert!(matches!(
            bad(
                Placement::new()
                    .put_ranges(q, [(0, reversed)])
                    .replicate("*"),
                &[0]
            )
            .1,
            Problem::RangeOutOfBounds { .. }
        ));
        assert_eq!(
            bad(
                Placement::new().put_ranges(q, [(0, 1..4)]).replicate("*"),
                &[0]
            ),
            (
                Some(q.into()),
                Problem::RangeMisaligned {
                    start: 1,
                    end: 4,
                    unit: 2
                }
            )
        );
        assert_eq!(
            bad(
                Placement::new()
                    .put_ranges(q, [(0, 0..8), (0, 8..16)])
                    .replicate("*"),
                &[0]
            ),
            (
                Some(q.into()),
                Problem::PlacedTwice {
                    device: 0,
                    first_start: 0,
                    first_end: 8,
                    second_start: 8,
                    second_end: 16
                }
            )
        );
        // The same range twice for one GPU is no conflict.
        assert!(Placement::new()
            .put_ranges(q, [(0, 0..8), (0, 0..8)])
            .replicate("*")
            .resolve(&s, &[0])
            .is_ok());
        assert_eq!(
            bad(
                Placement::new().split_rows("scale", [0]).replicate("*"),
                &[0]
            ),
            (
                Some("scale".into()),
                Problem::NotSplittable { shape: vec![] }
            )
        );
        // Splitting one GPU's rows twice is two ranges for it.
        assert!(matches!(
            bad(Placement::new().split_rows(q, [0, 0]).replicate("*"), &[0]).1,
            Problem::PlacedTwice { device: 0, .. }
        ));
    }

    /// 4- and 6-bit tensors: a row that is not whole bytes cannot be split (refused, naming
    /// the tensor); rows of whole bytes split exactly, every byte to one GPU; a byte range of
    /// such a tensor that is not whole rows is a 1-D piece of the elements it holds.
    #[test]
    fn sub_byte_rows_split_only_on_whole_bytes() {
        let two = [0, 1];
        let split = |dtype, shape: &[usize]| {
            let s = vec![t("w", dtype, shape)];
            Placement::new().split_rows("w", two).resolve(&s, &two)
        };
        for (dtype, shape) in [
            (Dtype::F4, &[2, 3][..]),
            (Dtype::F4, &[4, 1][..]),
            (Dtype::F6_E2M3, &[4, 1][..]),
            (Dtype::F6_E3M2, &[4, 2][..]),
        ] {
            assert_eq!(
                split(dtype, shape),
                Err((
                    Some("w".into()),
                    Problem::NotSplittable {
                        shape: shape.to_vec()
                    }
                )),
                "{dtype} {shape:?}"
            );
        }
        // F4 [2, 2]: rows of 1 byte; F6 [2, 4]: rows of 3 bytes; F4 [6, 4]: 2 bytes, 3 rows each.
        for (dtype, shape, row) in [
            (Dtype::F4, &[2, 2][..], 1),
            (Dtype::F6_E2M3, &[2, 4][..], 3),
            (Dtype::F4, &[6, 4][..], 2),
        ] {
            let w = split(dtype, shape).unwrap();
            let rows = shape[0] as u64;
            let mut next = 0;
            for (k, d) in w.iter().enumerate() {
                assert_eq!(d.len(), 1);
                assert_eq!(
                    (d[0].start, d[0].end),
                    (next, (k as u64 + 1) * rows / 2 * row)
                );
                assert_eq!(d[0].shape, [shape[0] / 2, shape[1]]);
                next = d[0].end;
            }
            assert_eq!(next, rows * row, "{dtype} {shape:?}: every byte placed");
        }
        // put_ranges on F4 [2, 3] (3 bytes, rows of 1.5): byte 0 holds 2 elements, not a row.
        let s = vec![t("w", Dtype::F4, &[2, 3])];
        let w = Placement::new()
            .put_ranges("w", [(0, 0..1), (1, 1..3)])
            .resolve(&s, &two)
            .unwrap();
        assert_eq!(
            ranges(&w),
            vec![vec![(0, 0, 1, vec![2])], vec![(0, 1, 3, vec![4])]]
        );
    }

    #[test]
    fn split_rows_covers_every_row_once() {
        for rows in 0..12usize {
            for n in 1..6usize {
                let s = vec![t("w", Dtype::F16, &[rows, 3])];
                let devs: Vec<usize> = (0..n).collect();
                let w = Placement::new()
                    .split_rows("w", devs.clone())
                    .resolve(&s, &devs)
                    .unwrap();
                let mut next = 0;
                for d in &w {
                    assert_eq!(d.len(), 1);
                    assert_eq!(d[0].start, next);
                    assert_eq!(d[0].shape[0] as u64 * 6, d[0].len());
                    next = d[0].end;
                }
                assert_eq!(next, s[0].len);
            }
        }
        assert_eq!(element_unit(Dtype::F6_E2M3), 3);
        assert_eq!(element_unit(Dtype::F4), 1);
        assert_eq!(element_unit(Dtype::C64), 8);
    }
}

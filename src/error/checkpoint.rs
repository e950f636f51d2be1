//! What can be wrong with a checkpoint: the `problem` of [`Error::Checkpoint`](crate::Error::Checkpoint),
//! and the format's element types ([`Dtype`]) its causes name. Both are re-exported as
//! `gpudirect::safetensors::{Problem, Dtype}`; they live in the core so that the core's `Error`
//! names no room.

use std::fmt;

use serde::Serialize;

/// Why a checkpoint could not be loaded or saved. Carried by
/// [`Error::Checkpoint`](crate::Error::Checkpoint) together with the file and, where one is to
/// blame, the tensor.
///
/// Every one is found before any byte moves to the GPU (except [`Problem::ChangedWhileLoading`]
/// and [`Problem::ReplacedWhileLoading`], found as the shards are opened, before any of their
/// bytes move), and none leaves a partial result that looks like success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// The file is shorter than the 8-byte header length.
    #[error("the file is {len} bytes, shorter than the 8-byte header length: it is truncated or not a safetensors file")]
    TooShort {
        /// The file's length.
        len: u64,
    },
    /// The header length is larger than the format allows (100,000,000 bytes).
    #[error("the header length {len} exceeds the format's limit of 100000000 bytes: the file is corrupt or not a safetensors file")]
    HeaderTooLarge {
        /// The header length the file claims.
        len: u64,
    },
    /// The header length points past the end of the file.
    #[error("the header length {len} runs past the end of the {file_len}-byte file: the file is truncated")]
    HeaderBeyondFile {
        /// The header length the file claims.
        len: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The header is not UTF-8.
    #[error("the header is not UTF-8 (byte {at} of the header): the file is corrupt")]
    NotUtf8 {
        /// Offset of the first invalid byte inside the header.
        at: usize,
    },
    /// The header (or the index file) is not valid JSON of the expected shape.
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    /// A tensor's dtype is not one the format defines.
    #[error("unknown dtype {0:?}: the safetensors format defines BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, C64, F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2")]
    UnknownDtype(String),
    /// The number of elements times the element size overflows.
    #[error("shape {shape:?} overflows the addressable size")]
    ShapeOverflow {
        /// The shape.
        shape: Vec<usize>,
    },
    /// Sub-byte elements that do not fill whole bytes.
    #[error("{dtype} tensor of shape {shape:?} does not end on a byte boundary")]
    NotWholeBytes {
        /// The dtype.
        dtype: Dtype,
        /// The shape.
        shape: Vec<usize>,
    },
    /// The tensor's byte range does not match its dtype and shape.
    #[error("{dtype} shape {shape:?} needs {expected} bytes but data_offsets give {actual}")]
    SizeMismatch {
        /// The dtype.
        dtype: Dtype,
        /// The shape.
        shape: Vec<usize>,
        /// dtype size × elements.
        expected: u64,
        /// end - start of `data_offsets`.
        actual: u64,
    },
    /// `data_offsets` end before they start.
    #[error("data_offsets [{start}, {end}] end before they start")]
    OffsetsReversed {
        /// Start.
        start: u64,
        /// End.
        end: u64,
    },
    /// Two tensors' byte ranges overlap.
    #[error("its bytes [{start}, {end}) overlap tensor {other:?}")]
    Overlap {
        /// The other tensor.
        other: String,
        /// This tensor's start.
        start: u64,
        /// This tensor's end.
        end: u64,
    },
    /// Bytes between tensors (or before the first) that no tensor covers; the format forbids it.
    #[error("bytes [{start}, {end}) of the data section belong to no tensor (the format requires tensors to cover it without gaps)")]
    Gap {
        /// First uncovered byte (relative to the data section).
        start: u64,
        /// End of the uncovered bytes.
        end: u64,
    },
    /// The tensor ends past the end of the file.
    #[error("its bytes end at file offset {end} but the file is {file_len} bytes: the file is truncated")]
    Truncated {
        /// Where the tensor ends in the file.
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// Bytes after the last tensor; the format forbids them.
    #[error("{extra} bytes follow the last tensor (the format forbids trailing bytes): the file was appended to or the header is wrong")]
    TrailingBytes {
        /// How many.
        extra: u64,
    },
    /// The `safetensors` crate's validation refused the header for a reason the checks above did
    /// not name.
    #[error("the safetensors crate refuses the header: {0}")]
    Refused(String),
    /// Two shards hold a tensor of the same name.
    #[error("the tensor is also in {other}: a checkpoint's tensor names must be unique")]
    Duplicate {
        /// The other file.
        other: std::path::PathBuf,
    },
    /// The index file is larger than a header may be ([`MAX_HEADER_LEN`](crate::safetensors::MAX_HEADER_LEN));
    /// it is refused from its size, or once that many bytes were read.
    #[error("the index is {len} bytes or more, over the limit of 100000000 bytes: it is not a model.safetensors.index.json")]
    IndexTooLarge {
        /// Its size (or the bytes read before the read stopped).
        len: u64,
    },
    /// The header gives a name (a tensor's, or `__metadata__`) more than once. The JSON of
    /// such a file is valid and the `safetensors` crate keeps the last entry; gpudirect refuses
    /// it, stricter than the crate: which entry is meant is ambiguous, and readers that keep
    /// the first see other tensors.
    #[error("the header gives this name more than once: which entry is meant is ambiguous (the safetensors crate keeps the last); write the file again with each name once")]
    DuplicateInHeader,
    /// The index's `weight_map` is empty: it names no shard, so a load would load nothing.
    #[error("the index's weight_map names no tensor and no shard: the index is incomplete (pass the .safetensors files themselves, or write the index again)")]
    EmptyIndex,
    /// The index names a shard that does not exist.
    #[error("the index names shard {shard:?}, which does not exist: copy the whole checkpoint directory")]
    MissingShard {
        /// The shard's file name as the index gives it.
        shard: String,
    },
    /// The index and a shard's header disagree.
    #[error("the index places it in {shard:?} but that shard's header does not have it")]
    NotInShard {
        /// The shard the index names.
        shard: String,
    },
    /// A directory without `model.safetensors.index.json` or `model.safetensors`.
    #[error("no model.safetensors.index.json or model.safetensors in the directory (found {found} other .safetensors files: pass them as a list of shards)")]
    NotAModelDirectory {
        /// How many `*.safetensors` files the directory holds.
        found: usize,
    },
    /// The filter selects no tensor.
    #[error("the tensor filter {filter} matches none of the {tensors} tensors")]
    FilterMatchedNothing {
        /// The filter, as written.
        filter: String,
        /// How many tensors the checkpoint has.
        tensors: usize,
    },
    /// No tensor of that name was loaded.
    #[error("no such tensor in the checkpoint{}", if *.filtered { " (or the tensor filter excluded it)" } else { "" })]
    NoSuchTensor {
        /// Whether a filter was applied.
        filtered: bool,
    },
    /// The tensor's dtype is not the element type asked for.
    #[error(
        "the tensor is {dtype}, not {asked}: ask for the matching element type or use bytes()"
    )]
    DtypeMismatch {
        /// The tensor's dtype.
        dtype: Dtype,
        /// The element type asked for (its Rust name).
        asked: &'static str,
    },
    /// The GPU lacks the memory the load needs.
    #[error("the load needs {needed} bytes of device memory but GPU {device} has {free} free: filter tensors, free memory or use another GPU")]
    NotEnoughDeviceMemory {
        /// The GPU.
        device: usize,
        /// Bytes needed.
        needed: u64,
        /// Bytes free when asked.
        free: u64,
    },
    /// The file changed size between reading its header and reading its tensors.
    #[error("the file changed while it was loaded ({was} bytes at open, now {now}): load it again once it is complete")]
    ChangedWhileLoading {
        /// Length at open.
        was: u64,
        /// Length now.
        now: u64,
    },
    /// The file opened for the tensors is not the one the header was read from, unchanged:
    /// another file took its name (a save to the same path renames a new file over it), or it
    /// was rewritten in place (its modification or change time moved) in between. Found when
    /// the shard is opened, before any of its bytes move.
    #[error("the file changed after its header was read ({what}): its tensors may not be where that header put them; load it again once the writer is done")]
    ReplacedWhileLoading {
        /// What changed.
        what: &'static str,
    },
    /// A tensor to save is described wrongly.
    #[error("cannot save it: {0}")]
    BadTensor(String),
    /// A placement rule's pattern matches no tensor that is loaded.
    #[error("the placement rule {pattern:?} matches none of the {tensors} tensors loaded (check the name, or the tensor filter)")]
    PlacementMatchedNothing {
        /// The rule's pattern, as written.
        pattern: String,
        /// How many tensors the load selects.
        tensors: usize,
    },
    /// No placement rule puts the tensor on any GPU.
    #[error("no placement rule puts it on a GPU: add a rule for it (e.g. replicate(\"*\") last), or leave it out with a tensor filter")]
    Unplaced,
    /// A placement rule names a GPU the load has no stream for.
    #[error("the placement puts it on GPU {device}, but the load's GPUs are {devices:?}: pass a stream for GPU {device} or fix the placement")]
    UnknownDevice {
        /// The GPU the rule names.
        device: usize,
        /// The GPUs of the load (one stream each), in order.
        devices: Vec<usize>,
    },
    /// A placement rule names no GPU.
    #[error("the placement rule {pattern:?} names no GPU: give it at least one")]
    NoDevices {
        /// The rule's pattern.
        pattern: String,
    },
    /// A byte range of a tensor lies outside it.
    #[error("bytes [{start}, {end}) are not within the tensor's {len} bytes")]
    RangeOutOfBounds {
        /// Start of the range (bytes into the tensor).
        start: u64,
        /// End of the range.
        end: u64,
        /// The tensor's length.
        len: u64,
    },
    /// A byte range of a tensor does not start and end on element boundaries.
    #[error(
        "bytes [{start}, {end}) cut its elements: start and end must be multiples of {unit} bytes"
    )]
    RangeMisaligned {
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
        /// The smallest whole number of bytes that holds whole elements (the element size; 3 for 6-bit types).
        unit: u64,
    },
    /// One GPU would get two different byte ranges of the same tensor.
    #[error("GPU {device} would get two different byte ranges of it ([{first_start}, {first_end}) and [{second_start}, {second_end})): give each GPU one range per tensor")]
    PlacedTwice {
        /// The GPU.
        device: usize,
        /// First range's start.
        first_start: u64,
        /// First range's end.
        first_end: u64,
        /// Second range's start.
        second_start: u64,
        /// Second range's end.
        second_end: u64,
    },
    /// Rows of a tensor that cannot be split by rows were asked for: a 0-d tensor (no rows), or
    /// a 4- or 6-bit tensor whose rows are not whole bytes.
    #[error("a tensor of shape {shape:?} cannot be split by rows (it has none, or a row of its 4- or 6-bit elements is not whole bytes): place it whole or give byte ranges")]
    NotSplittable {
        /// Its shape.
        shape: Vec<usize>,
    },
}

/// An element type of the safetensors format (the header's `"dtype"` string).
///
/// Every dtype the format defines (safetensors 0.8) is here, including the sub-byte and
/// micro-scaling ones; those without a Rust [`Element`](crate::safetensors::Element) type are
/// still loaded and saved as bytes
/// ([`TensorRef::bytes`](crate::safetensors::TensorRef::bytes)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // the format's own names
pub enum Dtype {
    /// `BOOL`: one byte per element, 0 or 1 (read as [`u8`]: a file byte that is neither would
    /// make a Rust `bool` unsound).
    BOOL,
    /// `F4`: 4-bit MX float (two per byte).
    F4,
    /// `F6_E2M3`: 6-bit MX float.
    F6_E2M3,
    /// `F6_E3M2`: 6-bit MX float.
    F6_E3M2,
    /// `U8`.
    U8,
    /// `I8`.
    I8,
    /// `F8_E5M2` ([`F8E5M2`](crate::safetensors::F8E5M2)).
    F8_E5M2,
    /// `F8_E4M3` ([`F8E4M3`](crate::safetensors::F8E4M3)).
    F8_E4M3,
    /// `F8_E8M0`: MX scale (bytes only).
    F8_E8M0,
    /// `F8_E4M3FNUZ` (bytes only).
    F8_E4M3FNUZ,
    /// `F8_E5M2FNUZ` (bytes only).
    F8_E5M2FNUZ,
    /// `I16`.
    I16,
    /// `U16`.
    U16,
    /// `F16` ([`half::f16`]).
    F16,
    /// `BF16` ([`half::bf16`]).
    BF16,
    /// `I32`.
    I32,
    /// `U32`.
    U32,
    /// `F32`.
    F32,
    /// `C64`: complex of two f32 (bytes only).
    C64,
    /// `F64`.
    F64,
    /// `I64`.
    I64,
    /// `U64`.
    U64,
}

/// Every dtype, in the format's order of increasing alignment.
pub(crate) const ALL: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

impl Dtype {
    /// The header's name for it, e.g. `"BF16"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parses the header's name (exact, case-sensitive, as the format requires).
    pub fn parse(s: &str) -> Option<Dtype> {
        ALL.into_iter().find(|d| d.as_str() == s)
    }

    /// Bits per element (4 and 6 for the sub-byte MX types).
    pub fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The alignment a typed view of this dtype needs in device memory, in bytes (1 for
    /// sub-byte types; C64's is its f32 parts').
    pub fn align(self) -> usize {
        match self {
            Dtype::C64 => 4,
            d => (d.bits() / 8).max(1),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

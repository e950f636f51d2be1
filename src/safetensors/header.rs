//! The safetensors header: parse and validate (reading only the header's bytes), and serialize
//! for saving.
//!
//! Format: 8 bytes little-endian `n`, then `n` bytes of UTF-8 JSON
//! `{"__metadata__": {str: str}?, NAME: {"dtype": D, "shape": [..], "data_offsets": [s, e]}, ..}`,
//! then the data section; offsets are relative to the data section, and the tensors cover it
//! exactly, without gaps, overlaps or trailing bytes.
//!
//! Validation is ours (so every refusal names the tensor and the reason) followed by the
//! `safetensors` crate's own (`Metadata::new`), so we accept exactly what the crate accepts,
//! with one exception, stricter: a name given twice in one header
//! ([`Problem::DuplicateInHeader`]), whose last entry the crate keeps. A differential test in
//! this module checks that on randomly mutated files.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};

use super::dtype::Dtype;
use super::Problem;
use crate::error::{Error, Result};

/// The format's limit on the header length (the `safetensors` crate's `MAX_HEADER_SIZE`).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor as a header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (empty for a 0-d scalar).
    pub shape: Vec<usize>,
    /// Where its bytes start in the file (absolute).
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The tensors in file order (by offset).
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map (empty when absent).
    pub metadata: BTreeMap<String, String>,
    /// Where the data section starts (8 + header length).
    pub data_start: u64,
    /// The file's length when the header was read.
    pub file_len: u64,
}

/// A refusal before it is tied to a file: the tensor to blame and why.
pub(crate) type Bad = (Option<String>, Problem);

fn bad<T>(tensor: Option<&str>, p: Problem) -> std::result::Result<T, Bad> {
    Err((tensor.map(str::to_owned), p))
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// What a file was when its header was read: which file (`st_dev`, `st_ino`), its length and
/// its modification and change times. A load compares it with the `fstat` of the descriptor it
/// reads the tensors through, so that a file replaced or rewritten in between is refused rather
/// than read with a layout that is no longer its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    pub(crate) fn of(md: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
        }
    }

    /// Why `now` (a later `fstat`) is not this file as it was, if it is not.
    pub(crate) fn changed(&self, now: &FileStamp) -> Option<Problem> {
        if (self.dev, self.ino) != (now.dev, now.ino) {
            return Some(Problem::ReplacedWhileLoading {
                what: "another file now has its name",
            });
        }
        if self.len != now.len {
            return Some(Problem::ChangedWhileLoading {
                was: self.len,
                now: now.len,
            });
        }
        if (self.mtime, self.ctime) != (now.mtime, now.ctime) {
            return Some(Problem::ReplacedWhileLoading {
                what: "it was rewritten in place: its modification or change time moved",
            });
        }
        None
    }
}

/// Reads and validates the header of the safetensors file at `path`; reads only the header's
/// bytes. Returns the file's [`FileStamp`] too. Errors: [`Error::Io`] (open, read),
/// [`Error::Checkpoint`] naming the tensor.
pub(crate) fn read(path: &Path) -> Result<(Header, FileStamp)> {
    let io = |op, e| Error::io(op, Some(path.to_owned()), e);
    let (f, md) = open_regular(
        path,
        "pass a .safetensors file, a model directory or a list of shards",
    )?;
    let file_len = md.len();
    let at = |(tensor, problem): Bad| Error::Checkpoint {
        file: path.to_owned(),
        tensor,
        problem,
    };
    let n = check_len_prefix(
        &read_prefix(&f, file_len).map_err(|e| io("pread", e))?,
        file_len,
    )
    .map_err(at)?;
    let mut header = vec![0u8; n as usize];
    f.read_exact_at(&mut header, 8)
        .map_err(|e| io("pread", e))?;
    let h = parse_header(n, &header, file_len).map_err(at)?;
    Ok((h, FileStamp::of(&md)))
}

/// Opens `path` for reading if it is a regular file (a link to one is followed), with its
/// `fstat`. Anything else (a directory, a FIFO, a socket, a device node) is an
/// [`Error::InvalidArgument`] naming it and what it is, ending with `hint`. The open is
/// non-blocking (a FIFO without a writer would block `open(2)` forever) and the flag is cleared
/// once the file is known to be regular.
pub(crate) fn open_regular(path: &Path, hint: &str) -> Result<(File, std::fs::Metadata)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let io = |op, e| Error::io(op, Some(path.to_owned()), e);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| io("open", e))?;
    let md = f.metadata().map_err(|e| io("fstat", e))?;
    let ft = md.file_type();
    if !ft.is_file() {
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_block_device() || ft.is_char_device() {
            "a device node"
        } else {
            "not a regular file"
        };
        return Err(Error::InvalidArgument(format!(
            "{} is {what}, not a regular file: {hint}",
            path.display()
        )));
    }
    // F_SETFL of no flags clears O_NONBLOCK, the only status flag the open set (the access
    // mode is not a status flag and stays).
    // SAFETY: fcntl on a descriptor this function owns; F_SETFL takes an integer, no pointer.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) } < 0 {
        return Err(io("fcntl", std::io::Error::last_os_error()));
    }
    Ok((f, md))
}

fn read_prefix(f: &File, file_len: u64) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; file_len.min(8) as usize];
    f.read_exact_at(&mut b, 0)?;
    Ok(b)
}

/// Checks the 8-byte length prefix against the file's length; returns the header length.
pub(crate) fn check_len_prefix(prefix: &[u8], file_len: u64) -> std::result::Result<u64, Bad> {
    let Ok(arr) = <[u8; 8]>::try_from(prefix.get(..8).unwrap_or(&[])) else {
        return bad(None, Problem::TooShort { len: file_len });
    };
    let n = u64::from_le_bytes(arr);
    if n > MAX_HEADER_LEN {
        return bad(None, Problem::HeaderTooLarge { len: n });
    }
    if 8 + n > file_len {
        return bad(None, Problem::HeaderBeyondFile { len: n, file_len });
    }
    Ok(n)
}

impl Header {
    /// Parses and validates a whole safetensors file held in memory (errors name the file as
    /// `<memory>`).
    pub fn from_bytes(buf: &[u8]) -> Result<Header> {
        parse_file_bytes(buf).map_err(|(tensor, problem)| Error::Checkpoint {
            file: "<memory>".into(),
            tensor,
            problem,
        })
    }
}

/// Parses a whole file held in memory.
pub(crate) fn parse_file_bytes(buf: &[u8]) -> std::result::Result<Header, Bad> {
    let n = check_len_prefix(buf, buf.len() as u64)?;
    parse_header(n, &buf[8..8 + n as usize], buf.len() as u64)
}

/// Parses and validates `header` (the `n` bytes after the length prefix) of a file of
/// `file_len` bytes.
pub(crate) fn parse_header(
    n: u64,
    header: &[u8],
    file_len: u64,
) -> std::result::Result<Header, Bad> {
    let text = match std::str::from_utf8(header) {
        Ok(t) => t,
        Err(e) => {
            return bad(
                None,
                Problem::NotUtf8 {
                    at: e.valid_up_to(),
                },
            )
        }
    };
    let Entries {
        metadata,
        tensors: raw,
    } = parse_entries(text)?;
    let data_start = 8 + n;
    let metadata = metadata.flatten().unwrap_or_default();
    // A name given twice is refused: which entry is meant is ambiguous (a JSON object read into
    // a map, as the crate reads it, keeps the last; a reader that keeps the first sees another
    // tensor).
    {
        let mut by_name: Vec<&str> = raw.iter().map(|t| t.0.as_str()).collect();
        by_name.sort_unstable();
        if let Some(w) = by_name.windows(2).find(|w| w[0] == w[1]) {
            return bad(Some(w[0]), Problem::DuplicateInHeader);
        }
    }
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, raw) in raw {
        let Some(dtype) = Dtype::parse(&raw.dtype) else {
            return bad(Some(&name), Problem::UnknownDtype(raw.dtype));
        };
        let (s, e) = raw.data_offsets;
        if e < s {
            return bad(
                Some(&name),
                Problem::OffsetsReversed {
                    start: s as u64,
                    end: e as u64,
                },
            );
        }
        let expected = byte_len(dtype, &raw.shape).map_err(|p| (Some(name.clone()), p))?;
        if (e - s) as u64 != expected {
            return bad(
                Some(&name),
                Problem::SizeMismatch {
                    dtype,
                    shape: raw.shape,
                    expected,
                    actual: (e - s) as u64,
                },
            );
        }
        tensors.push((name, dtype, raw.shape, s as u64, e as u64));
    }
    // The crate's order: by (start, end); ties (empty tensors) by name.
    tensors.sort_by(|a, b| (a.3, a.4).cmp(&(b.3, b.4)).then_with(|| a.0.cmp(&b.0)));
    let mut covered = 0u64;
    let mut last_nonempty: Option<usize> = None;
    for (i, t) in tensors.iter().enumerate() {
        let (s, e) = (t.3, t.4);
        if s < covered {
            let other = last_nonempty
                .map(|j| tensors[j].0.clone())
                .unwrap_or_default();
            return bad(
                Some(&t.0),
                Problem::Overlap {
                    other,
                    start: s,
                    end: e,
                },
            );
        }
        if s > covered {
            return bad(
                Some(&t.0),
                Problem::Gap {
                    start: covered,
                    end: s,
                },
            );
        }
        if e > s {
            last_nonempty = Some(i);
        }
        covered = e;
    }
    let end = data_start.checked_add(covered);
    match end {
        Some(end) if end == file_len => {}
        Some(end) if end < file_len => {
            return bad(
                None,
                Problem::TrailingBytes {
                    extra: file_len - end,
                },
            )
        }
        _ => {
            let t = tensors
                .iter()
                .find(|t| data_start.saturating_add(t.4) > file_len)
                .map(|t| t.0.as_str());
            return bad(
                t,
                Problem::Truncated {
                    end: data_start.saturating_add(covered),
                    file_len,
                },
            );
        }
    }
    // The reference validation. Its verdict on a shape depends only on the product of the
    // dimensions (element count times bits, in whole bytes, against the offsets), which
    // `byte_len` computed without overflow: so it is given the count as a 1-D shape, the same
    // verdict without a second copy of every shape.
    let crate_view: Vec<(String, ::safetensors::tensor::TensorInfo)> = tensors
        .iter()
        .map(|(name, d, shape, s, e)| {
            (
                name.clone(),
                ::safetensors::tensor::TensorInfo {
                    dtype: d.to_crate(),
                    shape: vec![shape.iter().product()],
                    data_offsets: (*s as usize, *e as usize),
                },
            )
        })
        .collect();
    if let Err(e) = ::safetensors::tensor::Metadata::new(None, crate_view) {
        return bad(None, Problem::Refused(e.to_string()));
    }
    Ok(Header {
        tensors: tensors
            .into_iter()
            .map(|(name, dtype, shape, s, e)| TensorInfo {
                name,
                dtype,
                shape,
                offset: data_start + s,
                len: e - s,
            })
            .collect(),
        metadata,
        data_start,
        file_len,
    })
}

/// A header's entries as its JSON gives them, in file order, each value parsed once, straight
/// into its final form (no `serde_json::Value` tree: that holds 32 bytes per number, ~20 times
/// the header's text for a long shape).
struct Entries {
    /// `__metadata__` (`Some(None)` when it is `null`).
    metadata: Option<Option<BTreeMap<String, String>>>,
    tensors: Vec<(String, RawInfo)>,
}

/// Parses the header's JSON object into [`Entries`]; a value that does not parse is blamed on
/// its key.
fn parse_entries(text: &str) -> std::result::Result<Entries, Bad> {
    let mut current: Option<String> = None;
    let mut twice = false;
    let mut de = serde_json::Deserializer::from_str(text);
    let r = serde::Deserializer::deserialize_map(
        &mut de,
        EntriesVisitor {
            current: &mut current,
            twice: &mut twice,
        },
    )
    .and_then(|e| de.end().map(|()| e));
    match r {
        Ok(e) => Ok(e),
        // A value of the wrong shape is its key's; broken JSON (syntax, end of text) is the
        // header's.
        Err(e) => match current.as_deref().filter(|_| e.is_data()) {
            Some("__metadata__") if twice => bad(Some("__metadata__"), Problem::DuplicateInHeader),
            Some("__metadata__") => bad(
                None,
                Problem::InvalidJson(format!("__metadata__ must map strings to strings: {e}")),
            ),
            Some(name) => bad(Some(name), Problem::InvalidJson(e.to_string())),
            None => bad(None, Problem::InvalidJson(format!("header: {e}"))),
        },
    }
}

/// Visits the header's object; `current` holds the key whose value is being parsed, so that a
/// failure can name it; `twice` is set when the failure is a second `__metadata__`.
struct EntriesVisitor<'a> {
    current: &'a mut Option<String>,
    twice: &'a mut bool,
}

impl<'de> serde::de::Visitor<'de> for EntriesVisitor<'_> {
    type Value = Entries;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object of tensors")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Entries, A::Error> {
        let mut e = Entries {
            metadata: None,
            tensors: Vec::new(),
        };
        while let Some(name) = map.next_key::<String>()? {
            let name = self.current.insert(name);
            if name == "__metadata__" {
                if e.metadata.is_some() {
                    *self.twice = true;
                    return Err(serde::de::Error::custom("__metadata__ is given twice"));
                }
                e.metadata = Some(map.next_value()?);
            } else {
                let raw: RawInfo = map.next_value()?;
                // Set above; taken back, not cloned.
                let name = self.current.take().unwrap_or_default();
                e.tensors.push((name, raw));
            }
            *self.current = None;
        }
        Ok(e)
    }
}

/// Bytes a tensor of `dtype` and `shape` occupies, as the format computes it.
pub(crate) fn byte_len(dtype: Dtype, shape: &[usize]) -> std::result::Result<u64, Problem> {
    let overflow = || Problem::ShapeOverflow {
        shape: shape.to_vec(),
    };
    let elems = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let bits = elems.checked_mul(dtype.bits()).ok_or_else(overflow)?;
    if !bits.is_multiple_of(8) {
        return Err(Problem::NotWholeBytes {
            dtype,
            shape: shape.to_vec(),
        });
    }
    Ok((bits / 8) as u64)
}

/// One tensor to save: name, dtype, shape, byte length.
pub(crate) struct OutTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub len: u64,
}

/// A serialized header for saving.
pub(crate) struct OutHeader {
    /// The 8-byte length followed by the JSON, padded with spaces to a multiple of 8.
    pub bytes: Vec<u8>,
    /// For each input tensor (in input order), its absolute file offset.
    pub offsets: Vec<u64>,
    /// The file's total length.
    pub file_len: u64,
}

struct HeaderOut<'a> {
    metadata: &'a BTreeMap<String, String>,
    tensors: &'a [(String, ::safetensors::tensor::TensorInfo)],
}

impl Serialize for HeaderOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let has_md = !self.metadata.is_empty();
        let mut map = s.serialize_map(Some(self.tensors.len() + usize::from(has_md)))?;
        if has_md {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

/// Lays out and serializes a header the way the `safetensors` crate's `serialize` does (tensors
/// by descending dtype alignment, then name, so every tensor is aligned in the file; JSON padded
/// with spaces to 8 bytes): byte-identical to it when there is at most one metadata entry
/// (the crate's metadata order is a hash map's).
pub(crate) fn serialize(
    tensors: &[OutTensor<'_>],
    metadata: &BTreeMap<String, String>,
) -> std::result::Result<OutHeader, Bad> {
    // Names first, whatever their dtypes (the layout's order below puts the dtype first, so two
    // tensors of one name need not be neighbours there).
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return bad(
            Some(w[0]),
            Problem::BadTensor("two tensors have this name".into()),
        );
    }
    drop(names);
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (l, r) = (&tensors[a], &tensors[b]);
        r.dtype.cmp(&l.dtype).then(l.name.cmp(r.name))
    });
    let mut rel = vec![0u64; tensors.len()];
    let mut entries = Vec::with_capacity(tensors.len());
    let mut off = 0u64;
    for &i in &order {
        let t = &tensors[i];
        if t.name.is_empty() || t.name == "__metadata__" {
            return bad(
                Some(t.name),
                Problem::BadTensor("the name is empty or reserved".into()),
            );
        }
        let need = byte_len(t.dtype, t.shape).map_err(|p| (Some(t.name.to_owned()), p))?;
        if need != t.len {
            return bad(
                Some(t.name),
                Problem::BadTensor(format!(
                    "{} shape {:?} needs {need} bytes but the buffer holds {}",
                    t.dtype, t.shape, t.len
                )),
            );
        }
        rel[i] = off;
        entries.push((
            t.name.to_owned(),
            ::safetensors::tensor::TensorInfo {
                dtype: t.dtype.to_crate(),
                shape: t.shape.to_vec(),
                data_offsets: (off as usize, (off + t.len) as usize),
            },
        ));
        off += t.len;
    }
    let json = serde_json::to_string(&HeaderOut {
        metadata,
        tensors: &entries,
    })
    .map_err(|e| (None, Problem::InvalidJson(e.to_string())))?;
    let mut json = json.into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let n = json.len() as u64;
    if n > MAX_HEADER_LEN {
        return bad(None, Problem::HeaderTooLarge { len: n });
    }
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&n.to_le_bytes());
    bytes.extend_from_slice(&json);
    let data_start = 8 + n;
    Ok(OutHeader {
        offsets: rel.iter().map(|r| data_start + r).collect(),
        file_len: data_start + off,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    type Made = (String, Dtype, Vec<usize>, Vec<u8>);

    /// A file the crate itself wrote, with random tensors (mixed dtypes, 0-d, empty).
    fn crate_file(rng: &mut impl Rng, n: usize) -> (Vec<u8>, Vec<Made>) {
        let dts = [
            Dtype::BF16,
            Dtype::F16,
            Dtype::F32,
            Dtype::F64,
            Dtype::I64,
            Dtype::I8,
            Dtype::U8,
            Dtype::BOOL,
            Dtype::F8_E4M3,
            Dtype::F8_E5M2,
            Dtype::I32,
        ];
        let mut ts = Vec::new();
        for i in 0..n {
            let d = dts[rng.random_range(0..dts.len())];
            let rank = rng.random_range(0..4);
            let shape: Vec<usize> = (0..rank).map(|_| rng.random_range(0..5)).collect();
            let len = byte_len(d, &shape).unwrap() as usize;
            let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            ts.push((format!("t{i}.w"), d, shape, data));
        }
        let views: Vec<(String, ::safetensors::tensor::TensorView<'_>)> = ts
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    ::safetensors::tensor::TensorView::new(d.to_crate(), s.clone(), b).unwrap(),
                )
            })
            .collect();
        (::safetensors::serialize(views, None).unwrap(), ts)
    }

    #[test]
    fn reads_what_the_crate_writes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for round in 0..50 {
            let (buf, ts) = crate_file(&mut rng, round % 9);
            let h = parse_file_bytes(&buf).unwrap();
            assert_eq!(h.tensors.len(), ts.len());
            for (name, d, shape, data) in &ts {
                let t = h.tensors.iter().find(|t| &t.name == name).unwrap();
                assert_eq!((t.dtype, &t.shape), (*d, shape));
                let o = t.offset as usize;
                assert_eq!(&buf[o..o + t.len as usize], &data[..], "{name}");
            }
            assert!(h.metadata.is_empty());
        }
    }

    #[test]
    fn our_header_is_the_crates_byte_for_byte() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for round in 0..40 {
            let (buf, ts) = crate_file(&mut rng, round % 7 + 1);
            let out: Vec<OutTensor<'_>> = ts
                .iter()
                .map(|(n, d, s, b)| OutTensor {
                    name: n,
                    dtype: *d,
                    shape: s,
                    len: b.len() as u64,
                })
                .collect();
            let mut md = BTreeMap::new();
            if round % 2 == 1 {
                md.insert("format".to_owned(), "pt".to_owned());
            }
            let h = serialize(&out, &md).unwrap();
            let mut file = h.bytes.clone();
            file.resize(h.file_len as usize, 0);
            for (i, (_, _, _, b)) in ts.iter().enumerate() {
                let o = h.offsets[i] as usize;
                file[o..o + b.len()].copy_from_slice(b);
            }
            if md.is_empty() {
                assert_eq!(file, buf);
            }
            let views: Vec<(String, ::safetensors::tensor::TensorView<'_>)> = ts
                .iter()
                .map(|(n, d, s, b)| {
                    (
                        n.clone(),
                        ::safetensors::tensor::TensorView::new(d.to_crate(), s.clone(), b).unwrap(),
                    )
                })
                .collect();
            let theirs = ::safetensors::serialize(
                views,
                (!md.is_empty()).then(|| md.clone().into_iter().collect()),
            )
            .unwrap();
            assert_eq!(file, theirs);
            let parsed = ::safetensors::SafeTensors::deserialize(&file).unwrap();
            assert_eq!(parsed.len(), ts.len());
            for (n, d, s, b) in &ts {
                let v = parsed.tensor(n).unwrap();
                assert_eq!(
                    (v.dtype(), v.shape(), v.data()),
                    (d.to_crate(), &s[..], &b[..])
                );
            }
            assert_eq!(parse_file_bytes(&file).unwrap().metadata, md);
        }
    }

    #[test]
    fn serialize_refuses_bad_tensors() {
        let t = |name, len| OutTensor {
            name,
            dtype: Dtype::F32,
            shape: &[2, 3],
            len,
        };
        let md = BTreeMap::new();
        let e = serialize(&[t("a", 24), t("a", 24)], &md).err().unwrap();
        assert_eq!(e.0.as_deref(), Some("a"));
        let e = serialize(&[t("a", 20)], &md).err().unwrap();
        assert!(
            matches!(e.1, Problem::BadTensor(ref m) if m.contains("needs 24 bytes")),
            "{e:?}"
        );
        assert!(serialize(&[t("", 24)], &md).is_err());
        assert!(serialize(&[t("__metadata__", 24)], &md).is_err());
    }

    /// A name given twice is refused whatever the two dtypes (the layout sorts by dtype first,
    /// so the two need not be neighbours), before any byte is laid out.
    #[test]
    fn serialize_refuses_a_name_twice_whatever_the_dtypes() {
        let t = |name, dtype, len| OutTensor {
            name,
            dtype,
            shape: &[2, 3],
            len,
        };
        let md = BTreeMap::new();
        for list in [
            vec![t("a", Dtype::F32, 24), t("a", Dtype::I8, 6)],
            vec![t("a", Dtype::I8, 6), t("a", Dtype::F32, 24)],
            vec![
                t("a", Dtype::F32, 24),
                t("b", Dtype::F16, 12),
                t("a", Dtype::U8, 6),
            ],
            vec![
                t("b", Dtype::F64, 48),
                t("a", Dtype::BF16, 12),
                t("c", Dtype::I64, 48),
                t("a", Dtype::BF16, 12),
            ],
        ] {
            let e = serialize(&list, &md)
                .err()
                .expect("a duplicate name is refused");
            assert_eq!(e.0.as_deref(), Some("a"));
            assert!(
                matches!(e.1, Problem::BadTensor(ref m) if m.contains("two tensors have this name")),
                "{e:?}"
            );
        }
    }

    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(7u8, data_len));
        v
    }

    fn problem(buf: &[u8]) -> Bad {
        let r = parse_file_bytes(buf).expect_err("refused");
        // The crate refuses it too.
        assert!(
            ::safetensors::SafeTensors::deserialize(buf).is_err(),
            "{r:?}"
        );
        r
    }

    #[test]
    fn each_bad_input_is_named() {
        let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(parse_file_bytes(&file(ok, 8)).is_ok());
        assert!(matches!(
            problem(&[1, 2, 3]),
            (None, Problem::TooShort { len: 3 })
        ));
        let mut huge = file(ok, 8);
        huge[..8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(
            problem(&huge),
            (None, Problem::HeaderTooLarge { .. })
        ));
        let mut beyond = file(ok, 8);
        beyond[..8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(matches!(
            problem(&beyond),
            (None, Problem::HeaderBeyondFile { len: 1000, .. })
        ));
        let mut utf = file(ok, 8);
        utf[10] = 0xff;
        assert!(matches!(problem(&utf), (None, Problem::NotUtf8 { at: 2 })));
        assert!(matches!(
            problem(&file("{\"a\":", 0)),
            (None, Problem::InvalidJson(_))
        ));
        assert!(matches!(
            problem(&file("[1]", 0)),
            (None, Problem::InvalidJson(_))
        ));
        let named = |h: &str, len: usize| {
            let (t, p) = problem(&file(h, len));
            (t.unwrap_or_default(), p)
        };
        let (t, p) = named(
            r#"{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}"#,
            8,
        );
        assert_eq!((t.as_str(), p), ("a", Problem::UnknownDtype("F33".into())));
        let (t, p) = named(
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        );
        assert_eq!(t, "a");
        assert!(matches!(
            p,
            Problem::SizeMismatch {
                expected: 12,
                actual: 8,
                ..
            }
        ));
        let (t, p) = named(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
            8,
        );
        assert_eq!(
            (t.as_str(), &p),
            (
                "b",
                &Problem::Overlap {
                    other: "a".into(),
                    start: 4,
                    end: 8
                }
            )
        );
        let (t, p) = named(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
            8,
        );
        assert_eq!((t.as_str(), p), ("a", Problem::Gap { start: 0, end: 4 }));
        let (t, p) = named(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            5,
        );
        assert_eq!(t, "a");
        assert!(matches!(p, Problem::Truncated { .. }), "{p:?}");
        assert!(matches!(
            named(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                9
            )
            .1,
            Problem::TrailingBytes { extra: 1 }
        ));
        let (t, p) = named(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}}"#,
            4,
        );
        assert_eq!(
            (t.as_str(), p),
            ("a", Problem::OffsetsReversed { start: 8, end: 4 })
        );
        let (t, p) = named(
            r#"{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
            8,
        );
        assert_eq!(t, "a");
        assert!(matches!(p, Problem::ShapeOverflow { .. }));
        let (t, p) = named(
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}"#,
            1,
        );
        assert_eq!(t, "a");
        assert!(matches!(p, Problem::NotWholeBytes { .. }));
        let (t, p) = named(
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}}"#,
            8,
        );
        assert_eq!(t, "a");
        assert!(matches!(p, Problem::InvalidJson(_)));
        assert!(matches!(
            named(r#"{"__metadata__":{"a":1}}"#, 0).1,
            Problem::InvalidJson(_)
        ));
    }

    /// A key given twice in the header is refused, naming it, even where keeping the last (as
    /// the crate does) would give a valid file: which entry is meant is ambiguous.
    #[test]
    fn a_name_twice_in_one_header_is_refused() {
        let u8x4 = |at: u32| {
            format!(
                r#"{{"dtype":"U8","shape":[4],"data_offsets":[{at},{}]}}"#,
                at + 4
            )
        };
        let f32x1 = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
        let empty = r#"{"dtype":"F32","shape":[0],"data_offsets":[0,0]}"#;
        for (h, name) in [
            // The same entry twice.
            (format!(r#"{{"a":{},"a":{}}}"#, u8x4(0), u8x4(0)), "a"),
            // Two dtypes for the same bytes.
            (format!(r#"{{"a":{f32x1},"a":{}}}"#, u8x4(0)), "a"),
            // An empty tensor first, then a real one of that name, with another between.
            (
                format!(r#"{{"b":{empty},"x":{},"b":{}}}"#, u8x4(0), u8x4(4)),
                "b",
            ),
            // The metadata twice.
            (
                format!(
                    r#"{{"__metadata__":{{"k":"v"}},"a":{},"__metadata__":{{"k":"w"}}}}"#,
                    u8x4(0)
                ),
                "__metadata__",
            ),
        ] {
            let data = if h.contains("[4,8]") { 8 } else { 4 };
            let buf = file(&h, data);
            let r = parse_file_bytes(&buf);
            match r {
                Err((tensor, p)) => {
                    assert_eq!(tensor.as_deref(), Some(name), "{h}: {p:?}");
                    assert_eq!(p, Problem::DuplicateInHeader, "{h}");
                }
                Ok(_) => panic!("{h}: accepted"),
            }
        }
    }

    #[test]
    fn edge_cases_the_format_allows() {
        // Empty tensors share an offset; a 0-d scalar; metadata; no tensors at all.
        let h = r#"{"__metadata__":{"format":"pt"},"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"e2":{"dtype":"BF16","shape":[3,0],"data_offsets":[0,0]},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"z":{"dtype":"U8","shape":[1],"data_offsets":[8,8]}}"#;
        let err = parse_file_bytes(&file(h, 8)).err();
        // z claims 0 bytes for 1 element: refused, by the crate too.
        assert!(err.is_some());
        assert!(::safetensors::SafeTensors::deserialize(&file(h, 8)).is_err());
        let h = h.replace(
            r#""z":{"dtype":"U8","shape":[1],"data_offsets":[8,8]}"#,
            r#""z":{"dtype":"U8","shape":[1,0],"data_offsets":[8,8]}"#,
        );
        let parsed = parse_file_bytes(&file(&h, 8)).unwrap();
        assert_eq!(parsed.tensors.len(), 4);
        assert_eq!(
            parsed.metadata.get("format").map(String::as_str),
            Some("pt")
        );
        let s = parsed.tensors.iter().find(|t| t.name == "s").unwrap();
        assert_eq!((s.len, s.shape.len()), (8, 0));
        assert!(parse_file_bytes(&file("{}", 0)).unwrap().tensors.is_empty());
        assert!(parse_file_bytes(&file(r#"{"__metadata__":null}"#, 0)).is_ok());
    }

    const PEAK_CHILD: &str = "GPUDIRECT_TEST_HEADER_PEAK_CHILD";

    /// The process's peak resident memory so far (`VmHWM`), in bytes.
    fn vm_hwm() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .expect("VmHWM in /proc/self/status");
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("VmHWM: N kB");
        kib << 10
    }

    /// A file whose header is one tensor with `zeros` dimensions of length 0 (no elements, no
    /// bytes: the format allows it), so the header is almost all `0,`.
    fn zeros_header_file(zeros: usize) -> Vec<u8> {
        let mut h = String::with_capacity(2 * zeros + 100);
        h.push_str(r#"{"w":{"dtype":"F32","shape":["#);
        for i in 0..zeros {
            h.push_str(if i == 0 { "0" } else { ",0" });
        }
        h.push_str(r#"],"data_offsets":[0,0]}}"#);
        let mut f = (h.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(h.as_bytes());
        f
    }

    /// Helper and test in one: with `GPUDIRECT_TEST_HEADER_PEAK_CHILD=FILE` set (by
    /// `a_large_header_costs_a_few_times_its_size`) it reads FILE's header and prints how much
    /// the process's peak memory grew; otherwise it parses a small header of the same kind.
    #[test]
    fn header_peak_child_or_zeros_header() {
        match std::env::var_os(PEAK_CHILD) {
            Some(file) => {
                let before = vm_hwm();
                let (h, _) = read(Path::new(&file)).unwrap();
                let after = vm_hwm();
                assert_eq!(h.tensors.len(), 1);
                println!(
                    "HEADER_PEAK_GROWTH={} DIMS={}",
                    after - before,
                    h.tensors[0].shape.len()
                );
            }
            None => {
                let h = parse_file_bytes(&zeros_header_file(1000)).unwrap();
                assert_eq!(h.tensors[0].shape, vec![0; 1000]);
            }
        }
    }

    /// A valid 16.8 MB header (2^23 dimensions of 0) parses, in a fresh process, with the peak
    /// memory growing by less than 8 times its size (the text once, each dimension one `usize`
    /// of 8 bytes for its 2 bytes of text, nothing parsed twice; a parse through
    /// `serde_json::Value` holds 32 bytes per number, ~20 times the text).
    #[test]
    fn a_large_header_costs_a_few_times_its_size() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("zeros.safetensors");
        let file = zeros_header_file(1 << 23);
        let header_len = file.len() as u64 - 8;
        std::fs::write(&path, &file).unwrap();
        drop(file);
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "safetensors::header::tests::header_peak_child_or_zeros_header",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(PEAK_CHILD, &path)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("HEADER_PEAK_GROWTH=").map(|x| x.1))
            .unwrap_or_else(|| panic!("no HEADER_PEAK_GROWTH line: {stdout}"));
        let (growth, dims) = line.split_once(" DIMS=").unwrap();
        let growth: u64 = growth.parse().unwrap();
        assert_eq!(dims, (1u64 << 23).to_string());
        eprintln!(
            "a {header_len}-byte header: peak memory grew by {growth} bytes ({:.1}x)",
            growth as f64 / header_len as f64
        );
        assert!(
            growth < 8 * header_len,
            "a {header_len}-byte header raised the peak by {growth} bytes ({:.1}x its size)",
            growth as f64 / header_len as f64
        );
    }

    /// Differential fuzzing, deterministic: random mutations of valid files (bytes flipped,
    /// truncated, extended, header text edited). We must accept exactly what the `safetensors`
    /// crate accepts, agree on every tensor when both accept, and never panic.
    #[test]
    fn mutations_agree_with_the_crate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5afe_7e45);
        let edits: [(&str, &str); 12] = [
            ("\"F32\"", "\"F31\""),
            ("\"BF16\"", "\"U16\""),
            ("[0,", "[1,"),
            ("]}", ",1]}"),
            ("shape\":[", "shape\":[2,"),
            ("shape\":[", "shape\":[0,"),
            ("\"dtype\"", "\"dtyp\""),
            (",\"", ",\"__metadata__\":{\"k\":\"v\"},\""),
            (
                "{",
                "{\"x\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]},",
            ),
            ("data_offsets\":[", "data_offsets\":[-"),
            ("}", "}}"),
            ("1", "9"),
        ];
        let (mut accepted, mut refused) = (0, 0);
        for _ in 0..3000 {
            let k = rng.random_range(0..6);
            let (mut buf, _) = crate_file(&mut rng, k);
            match rng.random_range(0..6) {
                0 => {
                    for _ in 0..rng.random_range(1..4) {
                        let i = rng.random_range(0..buf.len());
                        buf[i] ^= 1 << rng.random_range(0..8);
                    }
                }
                1 => buf.truncate(rng.random_range(0..buf.len())),
                2 => buf.extend((0..rng.random_range(1..16)).map(|_| rng.random::<u8>())),
                3 => {
                    let i = rng.random_range(0..8);
                    buf[i] = rng.random();
                }
                _ => {
                    let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
                    let text = String::from_utf8(buf[8..8 + n].to_vec()).unwrap();
                    let (from, to) = edits[rng.random_range(0..edits.len())];
                    let text = text.replacen(from, to, 1);
                    let mut nb = (text.len() as u64).to_le_bytes().to_vec();
                    nb.extend_from_slice(text.as_bytes());
                    nb.extend_from_slice(&buf[8 + n..]);
                    buf = nb;
                }
            }
            let ours = parse_file_bytes(&buf);
            let theirs = ::safetensors::SafeTensors::deserialize(&buf);
            match (&ours, &theirs) {
                (Ok(h), Ok(st)) => {
                    accepted += 1;
                    assert_eq!(h.tensors.len(), st.len());
                    for t in &h.tensors {
                        let v = st.tensor(&t.name).unwrap();
                        assert_eq!(v.dtype(), t.dtype.to_crate());
                        assert_eq!(v.shape(), &t.shape[..]);
                        let o = t.offset as usize;
                        assert_eq!(v.data(), &buf[o..o + t.len as usize]);
                    }
                }
                (Err(_), Err(_)) => refused += 1,
                // Stricter than the crate, on purpose: a name twice (a flipped bit can make one).
                (Err((_, Problem::DuplicateInHeader)), Ok(_)) => refused += 1,
                _ => panic!(
                    "disagreement on {:?}: ours {:?}, crate's {:?}",
                    String::from_utf8_lossy(&buf[..buf.len().min(400)]),
                    ours.map(|_| ()),
                    theirs.map(|_| ())
                ),
            }
        }
        assert!(
            accepted > 100 && refused > 1000,
            "{accepted} accepted, {refused} refused"
        );
    }
}

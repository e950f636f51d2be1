//! What to load: one file, a list of shards, or a model directory with
//! `model.safetensors.index.json` (Hugging Face's sharded layout).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::header::{self, FileStamp, Header};
use super::Problem;
use crate::error::{Error, Result};

/// The index file's name in a model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single-file checkpoint's name in a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";

/// What [`load`](super::load) reads: a path (a `.safetensors` file, a model directory, or a
/// `model.safetensors.index.json`) or a list of shard files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A file, a directory or an index file.
    Path(PathBuf),
    /// Shard files, loaded as one checkpoint (names must be unique across them).
    Shards(Vec<PathBuf>),
}

impl Source {
    /// The path errors about the checkpoint as a whole name.
    pub fn display_path(&self) -> PathBuf {
        match self {
            Source::Path(p) => p.clone(),
            Source::Shards(v) => v.first().cloned().unwrap_or_default(),
        }
    }
}

impl From<&str> for Source {
    fn from(p: &str) -> Self {
        Source::Path(p.into())
    }
}
impl From<String> for Source {
    fn from(p: String) -> Self {
        Source::Path(p.into())
    }
}
impl From<&Path> for Source {
    fn from(p: &Path) -> Self {
        Source::Path(p.to_owned())
    }
}
impl From<PathBuf> for Source {
    fn from(p: PathBuf) -> Self {
        Source::Path(p)
    }
}
impl From<&PathBuf> for Source {
    fn from(p: &PathBuf) -> Self {
        Source::Path(p.clone())
    }
}
impl<P: AsRef<Path>> From<Vec<P>> for Source {
    fn from(v: Vec<P>) -> Self {
        Source::Shards(v.iter().map(|p| p.as_ref().to_owned()).collect())
    }
}
impl<P: AsRef<Path>> From<&[P]> for Source {
    fn from(v: &[P]) -> Self {
        Source::Shards(v.iter().map(|p| p.as_ref().to_owned()).collect())
    }
}
impl<P: AsRef<Path>, const N: usize> From<[P; N]> for Source {
    fn from(v: [P; N]) -> Self {
        Source::Shards(v.iter().map(|p| p.as_ref().to_owned()).collect())
    }
}

/// A parsed `model.safetensors.index.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Index {
    /// The index file.
    pub path: PathBuf,
    /// Its `metadata` (values as JSON text when not strings, e.g. `total_size`).
    pub metadata: BTreeMap<String, String>,
    /// Tensor name → shard file name, as the index gives it.
    pub weight_map: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawIndex {
    #[serde(default)]
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
    weight_map: BTreeMap<String, String>,
}

/// Parses an index file's text. `path` is for errors.
pub(crate) fn parse_index(path: &Path, text: &[u8]) -> Result<Index> {
    let bad = |p| Error::Checkpoint {
        file: path.to_owned(),
        tensor: None,
        problem: p,
    };
    let text = std::str::from_utf8(text).map_err(|e| {
        bad(Problem::NotUtf8 {
            at: e.valid_up_to(),
        })
    })?;
    let raw: RawIndex =
        serde_json::from_str(text).map_err(|e| bad(Problem::InvalidJson(format!("index: {e}"))))?;
    if raw.weight_map.is_empty() {
        return Err(bad(Problem::EmptyIndex));
    }
    for (name, shard) in &raw.weight_map {
        let p = Path::new(shard);
        let plain = p.components().count() == 1
            && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
        if !plain {
            return Err(Error::Checkpoint {
                file: path.to_owned(),
                tensor: Some(name.clone()),
                problem: Problem::InvalidJson(format!(
                    "weight_map names shard {shard:?}, which is not a file name in the index's directory"
                )),
            });
        }
    }
    let metadata = raw
        .metadata
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (k, v)
        })
        .collect();
    Ok(Index {
        path: path.to_owned(),
        metadata,
        weight_map: raw.weight_map,
    })
}

/// The files of a checkpoint, in load order, with the index when there is one.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub files: Vec<PathBuf>,
    pub index: Option<Index>,
}

/// Reads an index file: a regular file (else [`Error::InvalidArgument`]) of at most
/// [`MAX_HEADER_LEN`](header::MAX_HEADER_LEN) bytes ([`Problem::IndexTooLarge`]).
fn read_index_text(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let (f, md) = header::open_regular(
        path,
        "pass a model.safetensors.index.json file, a model directory or .safetensors files",
    )?;
    let too_large = |len| Error::Checkpoint {
        file: path.to_owned(),
        tensor: None,
        problem: Problem::IndexTooLarge { len },
    };
    if md.len() > header::MAX_HEADER_LEN {
        return Err(too_large(md.len()));
    }
    // The size a regular file reports may be wrong (0 for /proc files) or grow: the read itself
    // stops past the limit.
    let mut text = Vec::with_capacity(md.len() as usize);
    f.take(header::MAX_HEADER_LEN + 1)
        .read_to_end(&mut text)
        .map_err(|e| Error::io("read", Some(path.to_owned()), e))?;
    if text.len() as u64 > header::MAX_HEADER_LEN {
        return Err(too_large(text.len() as u64));
    }
    Ok(text)
}

fn read_index(path: &Path) -> Result<Resolved> {
    let text = read_index_text(path)?;
    let index = parse_index(path, &text)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    let mut seen = HashMap::new();
    for (name, shard) in &index.weight_map {
        if seen.contains_key(shard.as_str()) {
            continue;
        }
        let p = dir.join(shard);
        // Exists (whatever it is: a shard that is not a regular file is refused by name when
        // its header is read).
        let exists = p
            .try_exists()
            .map_err(|e| Error::io("stat", Some(p.clone()), e))?;
        if !exists {
            return Err(Error::Checkpoint {
                file: path.to_owned(),
                tensor: Some(name.clone()),
                problem: Problem::MissingShard {
                    shard: shard.clone(),
                },
            });
        }
        seen.insert(shard.as_str(), ());
        files.push(p);
    }
    files.sort();
    Ok(Resolved {
        files,
        index: Some(index),
    })
}

/// Finds the files of `src`.
pub(crate) fn resolve(src: &Source) -> Result<Resolved> {
    match src {
        Source::Shards(v) => {
            if v.is_empty() {
                return Err(Error::InvalidArgument(
                    "an empty list of shards: pass at least one .safetensors file".into(),
                ));
            }
            Ok(Resolved {
                files: v.clone(),
                index: None,
            })
        }
        Source::Path(p) => {
            let md = std::fs::metadata(p).map_err(|e| Error::io("stat", Some(p.clone()), e))?;
            if md.is_dir() {
                // Present whatever they are: one that is not a regular file is refused by name
                // when it is read, not taken for absent.
                let present = |f: &Path| {
                    f.try_exists()
                        .map_err(|e| Error::io("stat", Some(f.to_owned()), e))
                };
                let idx = p.join(INDEX_FILE);
                if present(&idx)? {
                    return read_index(&idx);
                }
                let single = p.join(SINGLE_FILE);
                if present(&single)? {
                    return Ok(Resolved {
                        files: vec![single],
                        index: None,
                    });
                }
                let found = std::fs::read_dir(p)
                    .map_err(|e| Error::io("readdir", Some(p.clone()), e))?
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                    .count();
                return Err(Error::Checkpoint {
                    file: p.clone(),
                    tensor: None,
                    problem: Problem::NotAModelDirectory { found },
                });
            }
            if p.file_name().is_some_and(|n| n == INDEX_FILE)
                || p.extension().is_some_and(|x| x == "json")
            {
                return read_index(p);
            }
            Ok(Resolved {
                files: vec![p.clone()],
                index: None,
            })
        }
    }
}

/// One shard: its path and parsed header.
#[derive(Debug, Clone)]
pub(crate) struct Shard {
    pub path: PathBuf,
    pub header: Header,
    /// The file as its header was read: a load opens only this file, unchanged.
    pub stamp: FileStamp,
}

/// Reads every shard's header (in parallel for many shards) and checks the set: names unique
/// across shards, and the index (when there is one) agreeing with the headers.
pub(crate) fn read_shards(r: &Resolved) -> Result<Vec<Shard>> {
    // Two in turn; more on the room's capped pool (at most 16 headers in flight).
    let headers = super::pool::map_indexed(r.files.len(), 2, |i| header::read(&r.files[i]))?;
    let mut shards = Vec::with_capacity(r.files.len());
    for (path, (header, stamp)) in r.files.iter().zip(headers) {
        shards.push(Shard {
            path: path.clone(),
            header,
            stamp,
        });
    }
    check_set(&shards, r.index.as_ref())?;
    Ok(shards)
}

pub(crate) fn check_set(shards: &[Shard], index: Option<&Index>) -> Result<()> {
    let mut owner: HashMap<&str, usize> = HashMap::new();
    for (i, s) in shards.iter().enumerate() {
        for t in &s.header.tensors {
            if let Some(&j) = owner.get(t.name.as_str()) {
                return Err(Error::Checkpoint {
                    file: s.path.clone(),
                    tensor: Some(t.name.clone()),
                    problem: Problem::Duplicate {
                        other: shards[j].path.clone(),
                    },
                });
            }
            owner.insert(&t.name, i);
        }
    }
    if let Some(idx) = index {
        for (name, shard) in &idx.weight_map {
            let ok = owner.get(name.as_str()).is_some_and(|&i| {
                shards[i]
                    .path
                    .file_name()
                    .is_some_and(|n| n == shard.as_str())
            });
            if !ok {
                let dir = idx.path.parent().unwrap_or(Path::new("."));
                return Err(Error::Checkpoint {
                    file: dir.join(shard),
                    tensor: Some(name.clone()),
                    problem: Problem::NotInShard {
                        shard: shard.clone(),
                    },
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_parses_and_refuses_bad_shard_names() {
        let p = Path::new("/x/model.safetensors.index.json");
        let i = parse_index(
            p,
            br#"{"metadata":{"total_size":24,"format":"pt"},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(i.metadata["total_size"], "24");
        assert_eq!(i.metadata["format"], "pt");
        assert_eq!(i.weight_map["b"], "s2.safetensors");
        match parse_index(p, br#"{"metadata":{},"weight_map":{}}"#) {
            Err(Error::Checkpoint {
                file,
                tensor: None,
                problem: Problem::EmptyIndex,
            }) => assert_eq!(file, p),
            other => panic!("an index of no shard: {other:?}"),
        }
        for bad in [
            &br#"{"weight_map":{"a":"../s1.safetensors"}}"#[..],
            br#"{"weight_map":{"a":"/etc/passwd"}}"#,
            br#"{"weight_map":{"a":"d/s.safetensors"}}"#,
            br#"{"weight_map":{"a":""}}"#,
            br#"{"metadata":{}}"#,
            br#"{"weight_map":{"a":1}}"#,
            b"\xff{}",
            b"",
        ] {
            match parse_index(p, bad) {
                Err(Error::Checkpoint { file, .. }) => assert_eq!(file, p),
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bad)),
            }
        }
    }
}

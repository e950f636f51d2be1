//! The checkpoint room without a GPU: files written by the `safetensors` crate, model
//! directories with an index, shard lists, filters, and every bad input a load refuses before
//! touching the device (`LoadOptions::plan` and `inspect` do all of that on the host).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gpudirect::safetensors::{self as st, Dtype, LoadOptions, Problem};
use gpudirect::Error;
use rand::{Rng, RngCore, SeedableRng};
use safetensors::tensor::TensorView;

struct T {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn tensors(seed: u64, n: usize) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dts = [
        (safetensors::Dtype::BF16, 2),
        (safetensors::Dtype::F32, 4),
        (safetensors::Dtype::I64, 8),
        (safetensors::Dtype::U8, 1),
        (safetensors::Dtype::F8_E4M3, 1),
    ];
    (0..n)
        .map(|i| {
            let (dtype, size) = dts[i % dts.len()];
            let shape = match i % 4 {
                0 => vec![],
                1 => vec![rng.random_range(1..50)],
                2 => vec![rng.random_range(1..9), rng.random_range(0..9)],
                _ => vec![3, 5],
            };
            let mut data = vec![0u8; shape.iter().product::<usize>() * size];
            rng.fill_bytes(&mut data);
            T {
                name: format!("model.layers.{i}.w"),
                dtype,
                shape,
                data,
            }
        })
        .collect()
}

fn write(path: &Path, ts: &[T]) {
    let views: Vec<(String, TensorView<'_>)> = ts
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    let md = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(md), path).unwrap();
}

/// A model directory of `shards` files and an index, as transformers writes it.
fn model_dir(dir: &Path, ts: &[T], shards: usize) -> Vec<PathBuf> {
    let mut weight_map = serde_json::Map::new();
    let mut files = Vec::new();
    for (k, part) in ts.chunks(ts.len().div_ceil(shards)).enumerate() {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", k + 1);
        write(&dir.join(&name), part);
        for t in part {
            weight_map.insert(t.name.clone(), name.clone().into());
        }
        files.push(dir.join(name));
    }
    let index = serde_json::json!({"metadata": {"total_size": 1234}, "weight_map": weight_map});
    std::fs::write(dir.join(safetensors_index()), index.to_string()).unwrap();
    files
}

fn safetensors_index() -> &'static str {
    gpudirect::safetensors::INDEX_FILE
}

fn problem(e: Error) -> (PathBuf, Option<String>, Problem) {
    match e {
        Error::Checkpoint {
            file,
            tensor,
            problem,
        } => (file, tensor, problem),
        other => panic!("not a checkpoint error: {other}"),
    }
}

#[test]
fn a_crate_written_file_is_one_read_and_inspects_exactly() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.safetensors");
    let ts = tensors(1, 40);
    write(&p, &ts);
    let plan = LoadOptions::new().plan(&p).unwrap();
    let bytes: usize = ts.iter().map(|t| t.data.len()).sum();
    assert_eq!(
        (plan.tensors, plan.bytes, plan.files),
        (40, bytes as u64, 1)
    );
    assert_eq!(plan.reads, 1, "{plan:?}");
    // The tensors plus the file offset's page phase (device and file offsets agree mod 4 KiB).
    let data_start = 8 + u64::from_le_bytes(std::fs::read(&p).unwrap()[..8].try_into().unwrap());
    assert_eq!(plan.allocation_bytes, bytes as u64 + data_start % 4096);
    let file = std::fs::read(&p).unwrap();
    let shards = st::inspect(&p).unwrap();
    assert_eq!(shards.len(), 1);
    let h = &shards[0].1;
    assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
    for t in &ts {
        let i = h.tensors.iter().find(|i| i.name == t.name).unwrap();
        assert_eq!(i.dtype.as_str(), t.dtype.to_string());
        assert_eq!(i.shape, t.shape);
        let o = i.offset as usize;
        assert_eq!(&file[o..o + i.len as usize], &t.data[..], "{}", t.name);
    }
}

#[test]
fn model_directory_index_and_shard_list() {
    let d = tempfile::tempdir().unwrap();
    let ts = tensors(2, 30);
    let files = model_dir(d.path(), &ts, 3);
    let all = LoadOptions::new().plan(d.path()).unwrap();
    assert_eq!((all.tensors, all.files, all.reads), (30, 3, 3));
    // The index file itself, and the shard list, plan the same.
    assert_eq!(
        LoadOptions::new()
            .plan(d.path().join(safetensors_index()))
            .unwrap(),
        all
    );
    assert_eq!(LoadOptions::new().plan(files.clone()).unwrap(), all);
    // A filter reads only what it selects.
    let f = LoadOptions::new()
        .filter(["model.layers.1?.w", "model.layers.3.w"])
        .plan(d.path())
        .unwrap();
    assert_eq!(f.tensors, 11);
    let want: u64 = ts
        .iter()
        .filter(|t| {
            t.name == "model.layers.3.w"
                || (t.name.len() == 17 && t.name.starts_with("model.layers.1"))
        })
        .map(|t| t.data.len() as u64)
        .sum();
    assert_eq!(f.bytes, want);
    assert_eq!(f.bytes + f.skipped_bytes, all.bytes);
    // Owned mode reads each tensor with bytes into its own allocation.
    assert_eq!(
        all.owned_reads,
        ts.iter().filter(|t| !t.data.is_empty()).count()
    );
    assert!(all.owned_reads >= all.reads);
}

#[test]
fn directory_problems_are_named() {
    let d = tempfile::tempdir().unwrap();
    let ts = tensors(3, 12);
    let files = model_dir(d.path(), &ts, 3);
    // A missing shard: the index and the tensor are named.
    std::fs::rename(&files[1], d.path().join("moved")).unwrap();
    let (file, tensor, p) = problem(LoadOptions::new().plan(d.path()).unwrap_err());
    assert_eq!(file, d.path().join(safetensors_index()));
    assert!(tensor.is_some());
    assert!(
        matches!(p, Problem::MissingShard { ref shard } if shard.ends_with("00002-of-00003.safetensors")),
        "{p:?}"
    );
    std::fs::rename(d.path().join("moved"), &files[1]).unwrap();
    // The index places a tensor in the wrong shard.
    let idx = d.path().join(safetensors_index());
    let text = std::fs::read_to_string(&idx).unwrap();
    let mut j: serde_json::Value = serde_json::from_str(&text).unwrap();
    j["weight_map"]["model.layers.0.w"] = "model-00003-of-00003.safetensors".into();
    std::fs::write(&idx, j.to_string()).unwrap();
    let (file, tensor, p) = problem(LoadOptions::new().plan(d.path()).unwrap_err());
    assert_eq!(tensor.as_deref(), Some("model.layers.0.w"));
    assert_eq!(file, files[2]);
    assert!(matches!(p, Problem::NotInShard { .. }), "{p:?}");
    std::fs::write(&idx, &text).unwrap();
    // Invalid JSON in the index.
    std::fs::write(&idx, b"{\"weight_map\": ").unwrap();
    let (file, _, p) = problem(LoadOptions::new().plan(d.path()).unwrap_err());
    assert_eq!(file, idx);
    assert!(matches!(p, Problem::InvalidJson(_)));
    std::fs::remove_file(&idx).unwrap();
    // No index, no model.safetensors.
    let (_, _, p) = problem(LoadOptions::new().plan(d.path()).unwrap_err());
    assert_eq!(p, Problem::NotAModelDirectory { found: 3 });
    // The same tensor in two shards of a list.
    let (file, tensor, p) = problem(
        LoadOptions::new()
            .plan(vec![files[0].clone(), files[0].clone()])
            .unwrap_err(),
    );
    assert_eq!(file, files[0]);
    assert!(tensor.is_some());
    assert!(matches!(p, Problem::Duplicate { .. }));
    // A filter pattern that matches nothing.
    let (_, _, p) = problem(
        LoadOptions::new()
            .filter(["model.layers.0.w", "lm_head.*"])
            .plan(files.clone())
            .unwrap_err(),
    );
    assert_eq!(
        p,
        Problem::FilterMatchedNothing {
            filter: "\"lm_head.*\"".into(),
            tensors: 12
        }
    );
    // A missing file is an I/O error naming it.
    match LoadOptions::new()
        .plan(d.path().join("nope.safetensors"))
        .unwrap_err()
    {
        Error::Io { path, .. } => assert_eq!(path, Some(d.path().join("nope.safetensors"))),
        e => panic!("{e}"),
    }
}

#[test]
fn bad_files_on_disk_name_file_and_tensor() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.safetensors");
    let ts = tensors(4, 6);
    write(&p, &ts);
    let good = std::fs::read(&p).unwrap();
    // Truncated: the last tensor in the file is named.
    std::fs::write(&p, &good[..good.len() - 1]).unwrap();
    let (file, tensor, pr) = problem(LoadOptions::new().plan(&p).unwrap_err());
    assert_eq!(file, p);
    assert!(tensor.is_some());
    assert!(matches!(pr, Problem::Truncated { .. }), "{pr:?}");
    let msg = LoadOptions::new().plan(&p).unwrap_err().to_string();
    assert!(
        msg.contains("m.safetensors") && msg.contains("tensor") && msg.contains("truncated"),
        "{msg}"
    );
    // Shorter than the length prefix; header length past the file; absurd header length.
    std::fs::write(&p, &good[..5]).unwrap();
    assert_eq!(
        problem(LoadOptions::new().plan(&p).unwrap_err()).2,
        Problem::TooShort { len: 5 }
    );
    let mut b = good.clone();
    b[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(matches!(
        problem(LoadOptions::new().plan(&p).unwrap_err()).2,
        Problem::HeaderBeyondFile { .. }
    ));
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(matches!(
        problem(LoadOptions::new().plan(&p).unwrap_err()).2,
        Problem::HeaderTooLarge { .. }
    ));
    // Trailing bytes.
    let mut b = good.clone();
    b.push(0);
    std::fs::write(&p, &b).unwrap();
    assert!(matches!(
        problem(LoadOptions::new().plan(&p).unwrap_err()).2,
        Problem::TrailingBytes { extra: 1 }
    ));
    // A directory given as a shard.
    assert!(matches!(
        LoadOptions::new().plan(vec![d.path()]).unwrap_err(),
        Error::InvalidArgument(_)
    ));
}

#[test]
fn misaligned_tensors_in_the_file_get_aligned_device_offsets() {
    // U8[3] then F32[2] at file data offset 3: not 4-byte aligned in the file.
    let header = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]},"c":{"dtype":"BF16","shape":[],"data_offsets":[11,13]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend((0..13u8).map(|i| i * 17 + 3));
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("odd.safetensors");
    std::fs::write(&p, &file).unwrap();
    assert!(
        safetensors::SafeTensors::deserialize(&file).is_ok(),
        "the format allows it"
    );
    let plan = LoadOptions::new().plan(&p).unwrap();
    // a (at its page phase) | b (misaligned in the file: a new read at the next 256-byte
    // boundary) | c (2-aligned after b: the same read as b).
    let phase = (8 + header.len() as u64) % 4096;
    let b_start = (phase + 3).div_ceil(256) * 256;
    assert_eq!(
        (plan.reads, plan.allocation_bytes),
        (2, b_start + 10),
        "{plan:?}"
    );
    let h = &st::inspect(&p).unwrap()[0].1;
    assert_eq!(
        h.tensors.iter().map(|t| t.dtype).collect::<Vec<_>>(),
        vec![Dtype::U8, Dtype::F32, Dtype::BF16]
    );
}

/// Multi-GPU plans from real files (no GPU): every byte read once, the copies to the other
/// GPUs, per-GPU allocations, no staging; tensor parallelism reads splits locally.
#[test]
fn fan_out_plans_read_each_byte_once() {
    let d = tempfile::tempdir().unwrap();
    let ts = tensors(5, 40);
    let files = model_dir(d.path(), &ts, 4);
    let total: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    let one = LoadOptions::new().plan(d.path()).unwrap();
    for n in 1..=8usize {
        let devs: Vec<usize> = (0..n).collect();
        let p = LoadOptions::new()
            .segment_bytes(1)
            .plan_placed(d.path(), &st::Placement::replicated(), &devs)
            .unwrap();
        assert_eq!(p.bytes, total, "each byte read once");
        assert_eq!(p.copied_bytes, total * (n as u64 - 1));
        assert_eq!(p.staging_bytes, 0);
        assert_eq!(p.tensors, 40);
        assert_eq!(p.segment_bytes, 1 << 20, "segments are at least 1 MiB");
        for dp in &p.devices {
            assert_eq!(
                dp.allocation_bytes, one.allocation_bytes,
                "the single-GPU layout"
            );
            assert_eq!(dp.read_bytes + dp.received_bytes, total);
            assert_eq!(dp.tensors, 40);
        }
        assert_eq!(p.devices.iter().map(|x| x.read_bytes).sum::<u64>(), total);
        if n == 1 {
            assert_eq!((p.copies, p.reads), (0, one.reads));
        }
    }
    // Tensor parallelism over 4 GPUs: the tensors with rows split, the scalars replicated.
    let devs = [0, 1, 2, 3];
    let mut place = st::Placement::new();
    for t in ts.iter().filter(|t| !t.shape.is_empty()) {
        place = place.split_rows(t.name.clone(), devs);
    }
    let place = place.replicate("*");
    let p = LoadOptions::new()
        .plan_placed(files.clone(), &place, &devs)
        .unwrap();
    let scalars: u64 = ts
        .iter()
        .filter(|t| t.shape.is_empty())
        .map(|t| t.data.len() as u64)
        .sum();
    assert!(scalars > 0);
    assert_eq!(p.bytes, total);
    assert_eq!(
        p.copied_bytes,
        3 * scalars,
        "only the replicated scalars are copied"
    );
    for dp in &p.devices {
        assert!(dp.received_bytes + dp.read_bytes <= total);
    }
}

/// The shard that holds `name`.
fn shard_of(files: &[PathBuf], name: &str) -> PathBuf {
    files
        .iter()
        .find(|f| {
            st::inspect(f.as_path()).unwrap()[0]
                .1
                .tensors
                .iter()
                .any(|t| t.name == name)
        })
        .unwrap()
        .clone()
}

#[test]
fn fan_out_placement_problems_are_named() {
    let d = tempfile::tempdir().unwrap();
    let ts = tensors(6, 12);
    let files = model_dir(d.path(), &ts, 3);
    let plan =
        |p: &st::Placement, devs: &[usize]| LoadOptions::new().plan_placed(d.path(), p, devs);
    // A scalar (every fourth tensor of the fixture is 0-d) has no rows: it and its shard are
    // named.
    let (file, tensor, p) =
        problem(plan(&st::Placement::new().split_rows("*", [0, 1]), &[0, 1]).unwrap_err());
    let tensor = tensor.unwrap();
    assert!(
        ts.iter().any(|t| t.name == tensor && t.shape.is_empty()),
        "{tensor}"
    );
    assert_eq!(file, shard_of(&files, &tensor));
    assert_eq!(p, Problem::NotSplittable { shape: vec![] });
    // A GPU without a stream.
    let (_, tensor, p) =
        problem(plan(&st::Placement::new().put("*", [0, 3]), &[0, 1]).unwrap_err());
    assert_eq!(tensor, None);
    assert_eq!(
        p,
        Problem::UnknownDevice {
            device: 3,
            devices: vec![0, 1]
        }
    );
    // A tensor no rule places, and a rule that places nothing.
    let (file, tensor, p) =
        problem(plan(&st::Placement::new().put("model.layers.1*", [0]), &[0]).unwrap_err());
    assert_eq!(p, Problem::Unplaced);
    let tensor = tensor.unwrap();
    assert!(!tensor.starts_with("model.layers.1"), "{tensor}");
    assert_eq!(file, shard_of(&files, &tensor));
    let (_, _, p) =
        problem(plan(&st::Placement::replicated().put("lm_head.*", [0]), &[0]).unwrap_err());
    assert!(
        matches!(p, Problem::PlacementMatchedNothing { .. }),
        "{p:?}"
    );
    // A byte range past the tensor, and one cutting its elements.
    let w = ts
        .iter()
        .find(|t| t.dtype == safetensors::Dtype::F32 && t.data.len() >= 8)
        .unwrap();
    let len = w.data.len() as u64;
    let (_, tensor, p) = problem(
        plan(
            &st::Placement::new()
                .put_ranges(w.name.clone(), [(0, 0..len + 4)])
                .replicate("*"),
            &[0],
        )
        .unwrap_err(),
    );
    assert_eq!(tensor.as_deref(), Some(w.name.as_str()));
    assert_eq!(
        p,
        Problem::RangeOutOfBounds {
            start: 0,
            end: len + 4,
            len
        }
    );
    let (_, _, p) = problem(
        plan(
            &st::Placement::new()
                .put_ranges(w.name.clone(), [(1, 2..8)])
                .replicate("*"),
            &[0, 1],
        )
        .unwrap_err(),
    );
    assert_eq!(
        p,
        Problem::RangeMisaligned {
            start: 2,
            end: 8,
            unit: 4
        }
    );
    // The messages say what to do.
    let msg = plan(&st::Placement::new().put("*", [0, 3]), &[0, 1])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("GPU 3") && msg.contains("pass a stream"),
        "{msg}"
    );
    // Two streams of one GPU.
    assert!(matches!(
        LoadOptions::new().plan_placed(d.path(), &st::Placement::replicated(), &[1, 1]),
        Err(Error::InvalidArgument(_))
    ));
}

/// Runs `f` on a thread; `None` when it has not returned after `secs` (the thread is left
/// behind, blocked: `unblock` is then called to let it go).
fn within<R: Send + 'static>(
    secs: u64,
    f: impl FnOnce() -> R + Send + 'static,
    unblock: impl FnOnce(),
) -> Option<R> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(r) => Some(r),
        Err(_) => {
            unblock();
            None
        }
    }
}

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(
        rc,
        0,
        "mkfifo {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// Opens the FIFO's write end without blocking and closes it: a reader blocked in `open` then
/// proceeds (and sees end of file).
fn release(p: &Path) {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(p);
}

/// A FIFO (or a link to one) given as a shard, an index or a directory's index is refused
/// without blocking, naming it; nothing waits for a writer that never comes.
#[test]
fn fifos_are_refused_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let shard = d.path().join("m.safetensors");
    let index = d.path().join("x.safetensors.index.json");
    let linked = d.path().join("linked.json");
    let model = d.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let dir_index = model.join(st::INDEX_FILE);
    for f in [&shard, &index, &dir_index] {
        mkfifo(f);
    }
    std::os::unix::fs::symlink(&index, &linked).unwrap();
    write(
        &model.join("model-00001-of-00001.safetensors"),
        &tensors(9, 3),
    );
    let cases: Vec<(&str, st::Source, &Path)> = vec![
        ("a FIFO as the file", st::Source::from(&shard), &shard),
        (
            "a FIFO in a list of shards",
            st::Source::from(vec![shard.clone()]),
            &shard,
        ),
        ("a FIFO as the index", st::Source::from(&index), &index),
        (
            "a link to a FIFO as the index",
            st::Source::from(&linked),
            &linked,
        ),
        (
            "a FIFO as a directory's index",
            st::Source::from(&model),
            &dir_index,
        ),
    ];
    for (what, src, fifo) in cases {
        for planned in [false, true] {
            let s = src.clone();
            let r = within(
                5,
                move || {
                    if planned {
                        LoadOptions::new().plan(s).map(drop)
                    } else {
                        st::inspect(s).map(drop)
                    }
                },
                || release(fifo),
            );
            match r {
                None => panic!("{what} (plan: {planned}): still blocked after 5 s"),
                Some(Ok(())) => panic!("{what} (plan: {planned}): accepted"),
                Some(Err(Error::InvalidArgument(m))) => assert!(
                    m.contains("FIFO") && m.contains(&*fifo.to_string_lossy()),
                    "{what}: {m}"
                ),
                Some(Err(e)) => panic!("{what} (plan: {planned}): {e}"),
            }
        }
    }
}

/// An index file larger than a header may be is refused from its size, before it is read.
#[test]
fn an_oversized_index_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let index = d.path().join("big.safetensors.index.json");
    // Sparse: no disk space, and a read of it would be 100 MB of zeros.
    std::fs::File::create(&index)
        .unwrap()
        .set_len(st::MAX_HEADER_LEN + 2)
        .unwrap();
    let (file, tensor, p) = problem(st::inspect(&index).unwrap_err());
    assert_eq!((file, tensor), (index, None));
    assert_eq!(
        p,
        Problem::IndexTooLarge {
            len: st::MAX_HEADER_LEN + 2
        }
    );
    // A link named .json to a device that never ends is refused as a device, before any read.
    let zero = d.path().join("zero.json");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    match within(5, move || st::inspect(&zero).map(drop), || {}) {
        Some(Err(Error::InvalidArgument(m))) => assert!(m.contains("a device node"), "{m}"),
        None => panic!("/dev/zero as an index: still reading after 5 s"),
        Some(r) => panic!("/dev/zero as an index: {r:?}"),
    }
}

/// A filter of no patterns selects nothing: refused like a pattern that matches nothing, never
/// an empty load reported as success.
#[test]
fn an_empty_filter_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.safetensors");
    write(&p, &tensors(11, 5));
    let (file, tensor, pr) = problem(
        LoadOptions::new()
            .filter(Vec::<String>::new())
            .plan(&p)
            .unwrap_err(),
    );
    assert_eq!((file, tensor), (p.clone(), None));
    assert!(
        matches!(pr, Problem::FilterMatchedNothing { tensors: 5, ref filter } if filter.contains("no pattern")),
        "{pr:?}"
    );
    assert!(LoadOptions::new()
        .filter(Vec::<String>::new())
        .plan_placed(&p, &st::Placement::replicated(), &[0, 1])
        .is_err());
}

/// An index whose weight_map names no shard is refused, even with a shard beside it: it loads
/// nothing, which must not pass for a loaded model.
#[test]
fn an_index_naming_no_shard_is_refused() {
    let d = tempfile::tempdir().unwrap();
    write(
        &d.path().join("model-00001-of-00001.safetensors"),
        &tensors(12, 4),
    );
    let idx = d.path().join(st::INDEX_FILE);
    std::fs::write(&idx, br#"{"metadata":{"total_size":0},"weight_map":{}}"#).unwrap();
    for src in [st::Source::from(d.path()), st::Source::from(&idx)] {
        let (file, tensor, p) = problem(LoadOptions::new().plan(src.clone()).unwrap_err());
        assert_eq!((&file, &tensor, &p), (&idx, &None, &Problem::EmptyIndex));
        assert!(st::inspect(src).is_err());
    }
}

/// Every header problem of issue 11 in a file on disk (not only in memory) is an
/// `Error::Checkpoint` naming that file and, where one is to blame, the tensor, through
/// `plan` (what a load checks before it touches a GPU), `inspect`, and a list of shards whose
/// first shard is good (the bad one named, not the list's first): unknown dtype, shape × dtype
/// ≠ byte length, offsets reversed, out of range (past the data section), overlapping, leaving
/// a gap, a shape whose size overflows, non-UTF-8 header text, invalid JSON (syntax, and a
/// value of the wrong type, blamed on its key).
#[test]
fn header_problems_on_disk_name_file_and_tensor() {
    let d = tempfile::tempdir().unwrap();
    let good = d.path().join("good.safetensors");
    write(&good, &tensors(13, 4));
    let a = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
    // (file stem, header text (or raw bytes), data bytes, the tensor to blame, the problem)
    type Check = fn(&Problem) -> bool;
    type Case = (&'static str, Vec<u8>, usize, Option<&'static str>, Check);
    let cases: Vec<Case> = vec![
        (
            "unknown-dtype",
            format!(r#"{{{a},"b":{{"dtype":"F33","shape":[2],"data_offsets":[8,16]}}}}"#).into(),
            16,
            Some("b"),
            |p| matches!(p, Problem::UnknownDtype(d) if d == "F33"),
        ),
        (
            "size-mismatch",
            format!(r#"{{{a},"b":{{"dtype":"BF16","shape":[3,2],"data_offsets":[8,18]}}}}"#)
                .into(),
            18,
            Some("b"),
            |p| {
                matches!(
                    p,
                    Problem::SizeMismatch {
                        expected: 12,
                        actual: 10,
                        ..
                    }
                )
            },
        ),
        (
            "reversed",
            format!(r#"{{{a},"b":{{"dtype":"U8","shape":[0],"data_offsets":[8,4]}}}}"#).into(),
            8,
            Some("b"),
            |p| matches!(p, Problem::OffsetsReversed { start: 8, end: 4 }),
        ),
        (
            "out-of-range",
            format!(r#"{{{a},"b":{{"dtype":"U8","shape":[100],"data_offsets":[8,108]}}}}"#)
                .into(),
            16,
            Some("b"),
            |p| matches!(p, Problem::Truncated { .. }),
        ),
        (
            "overlap",
            format!(r#"{{{a},"b":{{"dtype":"U8","shape":[4],"data_offsets":[6,10]}}}}"#).into(),
            10,
            Some("b"),
            |p| matches!(p, Problem::Overlap { other, start: 6, end: 10 } if other == "a"),
        ),
        (
            "gap",
            format!(r#"{{{a},"b":{{"dtype":"U8","shape":[4],"data_offsets":[9,13]}}}}"#).into(),
            13,
            Some("b"),
            |p| matches!(p, Problem::Gap { start: 8, end: 9 }),
        ),
        (
            "shape-overflow",
            format!(
                r#"{{{a},"b":{{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[8,16]}}}}"#
            )
            .into(),
            16,
            Some("b"),
            |p| matches!(p, Problem::ShapeOverflow { .. }),
        ),
        (
            "not-utf8",
            {
                let mut h = format!("{{{a}}}").into_bytes();
                h[3] = 0xff;
                h
            },
            8,
            None,
            |p| matches!(p, Problem::NotUtf8 { at: 3 }),
        ),
        (
            "invalid-json",
            format!("{{{a},").into(),
            8,
            None,
            |p| matches!(p, Problem::InvalidJson(_)),
        ),
        (
            "wrong-type",
            format!(r#"{{{a},"b":{{"dtype":"U8","shape":"4","data_offsets":[8,12]}}}}"#).into(),
            12,
            Some("b"),
            |p| matches!(p, Problem::InvalidJson(_)),
        ),
    ];
    for (stem, header, data, tensor, check) in cases {
        let p = d.path().join(format!("{stem}.safetensors"));
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(&header);
        f.extend(random_bytes(data, stem.len() as u64));
        std::fs::write(&p, &f).unwrap();
        assert!(
            safetensors::SafeTensors::deserialize(&f).is_err(),
            "{stem}: the crate accepts it"
        );
        let tries: [(&str, Error); 3] = [
            ("plan", LoadOptions::new().plan(&p).unwrap_err()),
            ("inspect", st::inspect(&p).unwrap_err()),
            (
                "a list of shards",
                LoadOptions::new()
                    .plan(vec![good.clone(), p.clone()])
                    .unwrap_err(),
            ),
        ];
        for (how, e) in tries {
            let msg = e.to_string();
            let (file, t, pr) = problem(e);
            assert_eq!(file, p, "{stem} ({how}): {msg}");
            assert_eq!(t.as_deref(), tensor, "{stem} ({how}): {msg}");
            assert!(check(&pr), "{stem} ({how}): {pr:?}");
            assert!(msg.contains(&*p.to_string_lossy()), "{stem} ({how}): {msg}");
            if let Some(t) = tensor {
                assert!(
                    msg.contains(&format!("tensor {t:?}")),
                    "{stem} ({how}): {msg}"
                );
            }
        }
    }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

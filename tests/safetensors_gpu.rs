//! The checkpoint room on a GPU (`gpu_*`): save → file → load round trips on random data with
//! every byte checked, in both load modes; files written by the `safetensors` crate; shards with
//! an index; filters; misaligned tensors; not enough device memory; and interop with torch
//! (`gpu_safetensors_torch_*`: runs `python3 scripts/safetensors_interop.py`, which needs torch
//! and the `safetensors` Python package, as on the GPU machine).
//!
//! Run on the GPU machine from the project root: `.device/run --include-ignored gpu_safetensors`
//! (`bash scripts/gpu-suite safetensors` does that and keeps the logs). Scratch files go under
//! `GPUDIRECT_TEST_DIR`.

mod common;
mod safetensors_fanout;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream};
use gpudirect::safetensors::{
    self as st, bf16, Dtype, LoadOptions, Problem, SaveOptions, SaveTensor, F8E4M3,
};
use gpudirect::Error;

const HINT: &str =
    "needs a CUDA GPU: run on the GPU machine with `.device/run --include-ignored gpu_safetensors`";

fn stream() -> Arc<CudaStream> {
    let ctx = gpudirect::cuda::context(0).unwrap_or_else(|e| panic!("{HINT}: {e}"));
    ctx.new_stream().expect("cuStreamCreate")
}

use common::random_seeded as random;

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir(&format!("st-{name}"))
}

fn to_host(stream: &Arc<CudaStream>, v: &cudarc::driver::CudaView<'_, u8>) -> Vec<u8> {
    if v.is_empty() {
        return Vec::new();
    }
    stream.clone_dtoh(v).unwrap()
}

/// Host model of a tensor: name, dtype, shape, bytes.
struct Model {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Mixed dtypes, 0-d scalars, empty tensors, a large one; sizes that leave tensors unaligned
/// to 8 bytes unless the layout aligns them.
fn models(seed: u64, n: usize, big: usize) -> Vec<Model> {
    let dts = [
        Dtype::BF16,
        Dtype::F16,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U8,
        Dtype::BOOL,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
        Dtype::U16,
        Dtype::U32,
        Dtype::U64,
        Dtype::C64,
    ];
    (0..n)
        .map(|i| {
            let dtype = dts[i % dts.len()];
            let shape = match i % 5 {
                0 => vec![],
                1 => vec![0, 7],
                2 => vec![3, 11],
                3 => vec![big / (dtype.bits() / 8)],
                _ => vec![13],
            };
            let len = shape.iter().product::<usize>() * dtype.bits() / 8;
            let mut bytes = random(len, seed * 1000 + i as u64);
            if dtype == Dtype::BOOL {
                bytes.iter_mut().for_each(|b| *b &= 1);
            }
            Model {
                name: format!("layer.{i}.{}", dtype.as_str().to_lowercase()),
                dtype,
                shape,
                bytes,
            }
        })
        .collect()
}

fn upload(stream: &Arc<CudaStream>, ms: &[Model]) -> Vec<CudaSlice<u8>> {
    ms.iter()
        .map(|m| {
            if m.bytes.is_empty() {
                stream.null::<u8>().unwrap()
            } else {
                stream.clone_htod(&m.bytes).unwrap()
            }
        })
        .collect()
}

fn save_models(
    path: &Path,
    ms: &[Model],
    bufs: &[CudaSlice<u8>],
    opts: &SaveOptions,
) -> st::SaveReport {
    st::save(
        path,
        ms.iter().zip(bufs).map(|(m, b)| {
            (
                m.name.as_str(),
                SaveTensor::from_bytes(b.as_view(), m.dtype, &m.shape),
            )
        }),
        opts,
    )
    .unwrap()
}

fn check_checkpoint(stream: &Arc<CudaStream>, ck: &st::Checkpoint, ms: &[Model]) {
    assert_eq!(ck.len(), ms.len());
    for m in ms {
        let t = ck.tensor(&m.name).unwrap();
        assert_eq!(
            (t.dtype(), t.shape()),
            (m.dtype, &m.shape[..]),
            "{}",
            m.name
        );
        assert_eq!(to_host(stream, &t.bytes()), m.bytes, "{}", m.name);
    }
}

fn check_owned(stream: &Arc<CudaStream>, ck: &st::OwnedCheckpoint, ms: &[Model]) {
    assert_eq!(ck.len(), ms.len());
    for m in ms {
        let t = ck.tensor(&m.name).unwrap();
        assert_eq!(
            (t.dtype(), t.shape()),
            (m.dtype, &m.shape[..]),
            "{}",
            m.name
        );
        assert_eq!(to_host(stream, &t.bytes()), m.bytes, "{}", m.name);
    }
}

/// Load options, with a progress callback that records every call when `progress`.
fn options_recording_progress(progress: bool) -> (LoadOptions, Arc<Mutex<Vec<st::Progress>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let o = if progress {
        LoadOptions::new().progress(move |p| s2.lock().unwrap().push(p))
    } else {
        LoadOptions::new()
    };
    (o, seen)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_round_trip_mixed_dtypes_both_modes() {
    let s = stream();
    let d = scratch("round-trip");
    let ms = models(1, 48, 3 << 20);
    let bufs = upload(&s, &ms);
    let p = d.join("m.safetensors");
    std::fs::write(&p, b"the old file").unwrap();
    let r = save_models(&p, &ms, &bufs, &SaveOptions::new().metadata("format", "pt"));
    println!("save: {r}");
    let total: usize = ms.iter().map(|m| m.bytes.len()).sum();
    assert_eq!(r.bytes as usize, total);
    // The safetensors crate reads our file bit-exactly.
    let file = std::fs::read(&p).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&file).unwrap();
    for m in &ms {
        let v = parsed.tensor(&m.name).unwrap();
        assert_eq!(
            (v.dtype().to_string(), v.shape(), v.data()),
            (m.dtype.as_str().to_string(), &m.shape[..], &m.bytes[..])
        );
    }
    let ck = st::load(&p, &s).unwrap();
    println!("load: {}", ck.report());
    check_checkpoint(&s, &ck, &ms);
    assert_eq!(ck.report().reads, 1, "a file we wrote is one read");
    assert_eq!(
        ck.files()[0].metadata.get("format").map(String::as_str),
        Some("pt")
    );
    assert!(!ck.report().paths.is_empty());
    // Typed views and their refusals, on a non-empty 2-D bf16 tensor (the models also hold
    // empty 2-D ones, shape [0, 7]).
    let b = ms
        .iter()
        .find(|m| m.dtype == Dtype::BF16 && m.shape.len() == 2 && !m.bytes.is_empty())
        .unwrap();
    let v = ck.get::<bf16>(&b.name).unwrap();
    assert_eq!(v.len(), b.shape.iter().product::<usize>());
    assert_eq!(v.len(), 33, "{:?}", b.shape);
    let host: Vec<bf16> = s.clone_dtoh(&v).unwrap();
    let want: Vec<bf16> = b
        .bytes
        .chunks(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(host, want);
    match ck.get::<f32>(&b.name).unwrap_err() {
        Error::Checkpoint {
            tensor,
            problem: Problem::DtypeMismatch {
                dtype: Dtype::BF16, ..
            },
            ..
        } => {
            assert_eq!(tensor.as_deref(), Some(b.name.as_str()))
        }
        e => panic!("{e}"),
    }
    assert!(matches!(
        ck.get::<u8>("nope").unwrap_err(),
        Error::Checkpoint {
            problem: Problem::NoSuchTensor { filtered: false },
            ..
        }
    ));
    let f8 = ms
        .iter()
        .find(|m| m.dtype == Dtype::F8_E4M3 && !m.bytes.is_empty())
        .unwrap();
    let v: Vec<F8E4M3> = s.clone_dtoh(&ck.get::<F8E4M3>(&f8.name).unwrap()).unwrap();
    assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), f8.bytes);
    // Owned mode: each tensor straight into its own allocation (no staging, no device copy),
    // read as the allocations come (one round here: the checkpoint is under 64 MiB), and with
    // a progress callback in batches of about 512 MiB.
    let with_bytes = ms.iter().filter(|m| !m.bytes.is_empty()).count();
    for progress in [false, true] {
        let (o, seen) = options_recording_progress(progress);
        let own = o.load_owned(&p, &s).unwrap();
        println!("owned (progress {progress}): {}", own.report());
        check_owned(&s, &own, &ms);
        assert_eq!(own.report().staging_bytes, 0);
        assert_eq!(
            own.report().reads,
            with_bytes,
            "one read per tensor with bytes"
        );
        assert_eq!(own.report().bytes as usize, total);
        if progress {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.first().map(|p| p.done), Some(0));
            assert_eq!(seen.last().map(|p| p.done), Some(total as u64));
        }
        let mut own = own;
        let t = own.take(&b.name).unwrap();
        let slice: CudaSlice<bf16> = t.into_slice::<bf16>().unwrap();
        assert_eq!(s.clone_dtoh(&slice).unwrap(), want);
        assert!(own.take(&b.name).is_err());
    }
    // Save what we loaded (views of one allocation), load it again: identical.
    let p2 = d.join("again.safetensors");
    st::save(
        &p2,
        ck.tensors().map(|t| (t.name(), SaveTensor::from(t))),
        &SaveOptions::new().durable(false),
    )
    .unwrap();
    check_checkpoint(&s, &st::load(&p2, &s).unwrap(), &ms);
    std::fs::remove_dir_all(&d).unwrap();
}

/// An owned load of a checkpoint over 64 MiB reads while its tensors are still being allocated
/// (one engine job whose copies into each tensor wait for that tensor's allocation; the
/// engine's host tests `deferred_destinations_each_are_copied_into_only_once_they_exist` and
/// `a_failed_allocation_among_several_fails_the_job_and_writes_no_later_buffer` cover the
/// ordering): every tensor, empty and 0-d ones included, is read exactly
/// once into its own allocation, every byte right (over freed poisoned memory of the same
/// sizes), with and without a progress callback, and again in the same process.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_owned_load_reads_while_allocating() {
    let s = stream();
    let d = scratch("owned-rounds");
    let ms = models(9, 210, (4 << 20) + 3 * 16);
    let total: usize = ms.iter().map(|m| m.bytes.len()).sum();
    assert!(
        total > 128 << 20,
        "{total} bytes: the load must take more than one round"
    );
    let bufs = upload(&s, &ms);
    let p = d.join("big.safetensors");
    save_models(&p, &ms, &bufs, &SaveOptions::new().durable(false));
    drop(bufs);
    let with_bytes = ms.iter().filter(|m| !m.bytes.is_empty()).count();
    for (pass, progress) in [false, true, false].into_iter().enumerate() {
        // Memory of the same sizes, poisoned and freed on the same stream, so the load's
        // allocations likely reuse it: a tensor the load skipped would hold 0xA5, not its bytes.
        let poison: Vec<CudaSlice<u8>> = ms
            .iter()
            .filter(|m| !m.bytes.is_empty())
            .map(|m| s.clone_htod(&vec![0xA5u8; m.bytes.len()]).unwrap())
            .collect();
        s.synchronize().unwrap();
        drop(poison);
        let (o, seen) = options_recording_progress(progress);
        let own = o.load_owned(&p, &s).unwrap();
        println!("pass {pass} (progress {progress}): {}", own.report());
        check_owned(&s, &own, &ms);
        let moved: u64 = own.report().paths.iter().map(|p| p.bytes).sum();
        assert_eq!(
            (own.report().reads, moved as usize),
            (with_bytes, total),
            "pass {pass}: one read per tensor with bytes, every byte moved once"
        );
        if progress {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.first().map(|p| p.done), Some(0));
            assert!(seen.windows(2).all(|w| w[0].done <= w[1].done), "{seen:?}");
            assert_eq!(seen.last().map(|p| p.done), Some(total as u64));
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_shards_index_filter_and_progress() {
    let s = stream();
    let d = scratch("shards");
    let ms = models(2, 60, 1 << 20);
    let bufs = upload(&s, &ms);
    let mut weight_map = serde_json::Map::new();
    for k in 0..3 {
        let name = format!("model-{:05}-of-00003.safetensors", k + 1);
        let part: Vec<usize> = (0..ms.len()).filter(|i| i % 3 == k).collect();
        let pm: Vec<&Model> = part.iter().map(|&i| &ms[i]).collect();
        st::save(
            d.join(&name),
            part.iter().map(|&i| {
                (
                    ms[i].name.as_str(),
                    SaveTensor::from_bytes(bufs[i].as_view(), ms[i].dtype, &ms[i].shape),
                )
            }),
            &SaveOptions::new(),
        )
        .unwrap();
        for m in pm {
            weight_map.insert(m.name.clone(), name.clone().into());
        }
    }
    std::fs::write(
        d.join(st::INDEX_FILE),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    let (o, seen) = options_recording_progress(true);
    let ck = o.load(&d, &s).unwrap();
    println!("sharded: {}", ck.report());
    check_checkpoint(&s, &ck, &ms);
    assert_eq!((ck.report().files, ck.report().reads), (3, 3));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.first().map(|p| p.done), Some(0));
    assert_eq!(
        seen.last().map(|p| (p.done, p.total)),
        Some((ck.report().bytes, ck.report().bytes))
    );
    check_owned(&s, &st::load_owned(&d, &s).unwrap(), &ms);
    // A filter: only what it selects, and the rest never read.
    let f = LoadOptions::new()
        .filter(["layer.1?.*", "layer.3.f64"])
        .load(&d, &s)
        .unwrap();
    let want: Vec<&Model> = ms
        .iter()
        .filter(|m| {
            m.name == "layer.3.f64"
                || (m.name.starts_with("layer.1") && m.name.split('.').nth(1).unwrap().len() == 2)
        })
        .collect();
    assert_eq!(f.len(), want.len());
    for m in want {
        assert_eq!(to_host(&s, &f.tensor(&m.name).unwrap().bytes()), m.bytes);
    }
    assert!(f.report().skipped_bytes > 0);
    assert!(matches!(
        f.get::<u8>("layer.0.bf16").unwrap_err(),
        Error::Checkpoint {
            problem: Problem::NoSuchTensor { filtered: true },
            ..
        }
    ));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_crate_files_and_misaligned_tensors_load_bit_exactly() {
    let s = stream();
    let d = scratch("crate");
    // Written by the safetensors crate.
    let ms = models(3, 33, 1 << 16);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = ms
        .iter()
        .map(|m| {
            let dt: safetensors::Dtype = serde_json::from_value(m.dtype.as_str().into()).unwrap();
            (
                m.name.clone(),
                safetensors::tensor::TensorView::new(dt, m.shape.clone(), &m.bytes).unwrap(),
            )
        })
        .collect();
    let p = d.join("crate.safetensors");
    safetensors::serialize_to_file(views, Some(HashMap::from([("k".into(), "v".into())])), &p)
        .unwrap();
    check_checkpoint(&s, &st::load(&p, &s).unwrap(), &ms);
    check_owned(&s, &st::load_owned(&p, &s).unwrap(), &ms);
    // Hand-laid: tensors at odd file offsets (the format allows any order of bytes).
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    let odd = [
        (Dtype::U8, vec![3usize]),
        (Dtype::F32, vec![5]),
        (Dtype::F64, vec![2, 3]),
        (Dtype::BF16, vec![]),
        (Dtype::I64, vec![7]),
    ];
    let mut want = Vec::new();
    for (i, (dt, shape)) in odd.iter().enumerate() {
        let len = shape.iter().product::<usize>() * dt.bits() / 8;
        let b = random(len, 77 + i as u64);
        header.insert(format!("t{i}"), serde_json::json!({"dtype": dt.as_str(), "shape": shape, "data_offsets": [data.len(), data.len() + len]}));
        data.extend_from_slice(&b);
        want.push(Model {
            name: format!("t{i}"),
            dtype: *dt,
            shape: shape.clone(),
            bytes: b,
        });
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(h.as_bytes());
    file.extend_from_slice(&data);
    let p = d.join("odd.safetensors");
    std::fs::write(&p, &file).unwrap();
    let ck = st::load(&p, &s).unwrap();
    check_checkpoint(&s, &ck, &want);
    let f: Vec<f32> = s.clone_dtoh(&ck.get::<f32>("t1").unwrap()).unwrap();
    let w: Vec<f32> = want[1]
        .bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        w.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    check_owned(&s, &st::load_owned(&p, &s).unwrap(), &want);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_refusals_move_no_byte() {
    let s = stream();
    let d = scratch("refusals");
    // 1 TiB claimed by a sparse file: more than any GPU has.
    let p = common::huge_sparse_checkpoint(&d);
    for owned in [false, true] {
        let e = if owned {
            st::load_owned(&p, &s).map(|_| ())
        } else {
            st::load(&p, &s).map(|_| ())
        };
        match e.unwrap_err() {
            Error::Checkpoint {
                file,
                problem: Problem::NotEnoughDeviceMemory { needed, free, .. },
                ..
            } => {
                assert_eq!(file, p);
                assert!(needed >= 1 << 40 && free < needed);
            }
            e => panic!("{e}"),
        }
    }
    // A truncated file is refused with the tensor named, on the GPU path too.
    let ms = models(4, 5, 4096);
    let bufs = upload(&s, &ms);
    let p = d.join("t.safetensors");
    save_models(&p, &ms, &bufs, &SaveOptions::new());
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    match st::load(&p, &s).unwrap_err() {
        Error::Checkpoint {
            tensor: Some(_),
            problem: Problem::Truncated { .. },
            ..
        } => {}
        e => panic!("{e}"),
    }
    // A bad tensor to save leaves the old file.
    std::fs::write(&p, b"old").unwrap();
    let r = st::save(
        &p,
        [(
            "x",
            SaveTensor::from_bytes(bufs[2].as_view(), Dtype::F32, &[1, 2, 3, 4, 5]),
        )],
        &SaveOptions::new(),
    );
    assert!(matches!(
        r.unwrap_err(),
        Error::Checkpoint {
            problem: Problem::BadTensor(_),
            ..
        }
    ));
    assert_eq!(std::fs::read(&p).unwrap(), b"old");
    std::fs::remove_dir_all(&d).unwrap();
}

/// `save` end to end: two tensors of one name and different dtypes are refused and the old
/// file stays as it was; a replaced file keeps its permission bits (0600 stays 0600) and loads
/// back byte for byte.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_save_refuses_a_name_twice_and_keeps_the_mode() {
    use std::os::unix::fs::PermissionsExt;
    let s = stream();
    let d = scratch("save-mode");
    let p = d.join("m.safetensors");
    let ms = models(7, 8, 4096);
    let bufs = upload(&s, &ms);
    std::fs::write(&p, b"old checkpoint").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    // bufs[2] is F32 [3, 11] (132 bytes), bufs[7] I8 [3, 11] (33 bytes): one name for both.
    assert_eq!((ms[2].dtype, ms[7].dtype), (Dtype::F32, Dtype::I8));
    let r = st::save(
        &p,
        [
            (
                "w",
                SaveTensor::from_bytes(bufs[2].as_view(), ms[2].dtype, &ms[2].shape),
            ),
            (
                "w",
                SaveTensor::from_bytes(bufs[7].as_view(), ms[7].dtype, &ms[7].shape),
            ),
        ],
        &SaveOptions::new(),
    );
    match r.unwrap_err() {
        Error::Checkpoint {
            tensor,
            problem: Problem::BadTensor(m),
            ..
        } => assert_eq!(tensor.as_deref(), Some("w"), "{m}"),
        e => panic!("{e}"),
    }
    assert_eq!(std::fs::read(&p).unwrap(), b"old checkpoint");
    save_models(&p, &ms, &bufs, &SaveOptions::new());
    let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(
        mode, 0o600,
        "the saved file is {mode:o}, the old one was 600"
    );
    check_checkpoint(&s, &st::load(&p, &s).unwrap(), &ms);
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

fn interop(args: &[&str]) -> String {
    let out = std::process::Command::new("python3")
        .arg("scripts/safetensors_interop.py")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("needs python3 with torch and safetensors (the GPU machine has them), run from the project root: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/safetensors_interop.py {args:?} failed (needs torch and safetensors in python3, run from the project root):\n{text}");
    text
}

/// torch `save_file` writes mixed dtypes, scalars, empty tensors, shards with an index; we load
/// them and compare every byte with the raw bytes torch dumped next to them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_torch_files_load_bit_exactly() {
    let s = stream();
    let d = scratch("torch-in");
    println!("{}", interop(&["write", d.to_str().unwrap()]));
    let expect: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("expect.json")).unwrap()).unwrap();
    for (src, tensors) in expect.as_object().unwrap() {
        let ck = st::load(d.join(src), &s).unwrap();
        let own = st::load_owned(d.join(src), &s).unwrap();
        println!("{src}: {}", ck.report());
        let tensors = tensors.as_object().unwrap();
        assert_eq!(ck.len(), tensors.len(), "{src}");
        for (name, e) in tensors {
            let raw = std::fs::read(d.join(e["raw"].as_str().unwrap())).unwrap();
            let t = ck.tensor(name).unwrap();
            assert_eq!(
                t.dtype().as_str(),
                e["dtype"].as_str().unwrap(),
                "{src} {name}"
            );
            let shape: Vec<usize> = serde_json::from_value(e["shape"].clone()).unwrap();
            assert_eq!(t.shape(), &shape[..], "{src} {name}");
            assert_eq!(to_host(&s, &t.bytes()), raw, "{src} {name}");
            assert_eq!(
                to_host(&s, &own.tensor(name).unwrap().bytes()),
                raw,
                "{src} {name}"
            );
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Files we write load in torch (`safetensors.torch.load_file`) and in the `safetensors` numpy
/// loader bit-exactly: the script compares against raw bytes we dump next to them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_torch_loads_our_files_bit_exactly() {
    let s = stream();
    let d = scratch("torch-out");
    // The dtypes every torch with float8 has (no unsigned 16/32/64, no complex).
    let torch_has = [
        Dtype::BF16,
        Dtype::F16,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U8,
        Dtype::BOOL,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
    ];
    let ms: Vec<Model> = models(5, 64, 1 << 18)
        .into_iter()
        .filter(|m| torch_has.contains(&m.dtype))
        .take(40)
        .collect();
    assert_eq!(ms.len(), 40);
    let bufs = upload(&s, &ms);
    save_models(
        &d.join("ours.safetensors"),
        &ms,
        &bufs,
        &SaveOptions::new().metadata("format", "pt"),
    );
    let mut expect = serde_json::Map::new();
    for (i, m) in ms.iter().enumerate() {
        let raw = format!("raw-{i}.bin");
        std::fs::write(d.join(&raw), &m.bytes).unwrap();
        expect.insert(
            m.name.clone(),
            serde_json::json!({"dtype": m.dtype.as_str(), "shape": m.shape, "raw": raw}),
        );
    }
    std::fs::write(
        d.join("expect.json"),
        serde_json::json!({"ours.safetensors": expect}).to_string(),
    )
    .unwrap();
    let out = interop(&["check", d.to_str().unwrap()]);
    println!("{out}");
    assert!(out.contains("checked 40 tensors"), "{out}");
    std::fs::remove_dir_all(&d).unwrap();
}

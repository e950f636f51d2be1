//! The checkpoint room onto several GPUs (`multi_gpu_fanout_*`: two or more GPUs, every
//! visible GPU up to 8 is used) and its one-GPU case (`gpu_safetensors_fanout_*`). Random
//! checkpoints (mixed dtypes, a tensor misaligned in its file, a large tensor cut across
//! segments, shards with an index) are written on the host with the `safetensors` crate,
//! loaded, and every byte on every GPU is compared with the file's; the report's path per GPU is
//! checked: peer copies direct with `PeerAccess`, staged through the host with the cause named
//! without it. (A module of the safetensors_gpu test binary, so the GPU machine stages one
//! binary fewer.)
//!
//! Run on a GPU machine from the project root: `bash scripts/gpu-suite fanout` (the one-GPU
//! test anywhere; on fewer than 2 GPUs it refuses the `multi_gpu_fanout_*` ones with a message),
//! or `bash .device/run --include-ignored fanout`. Scratch files go under `GPUDIRECT_TEST_DIR`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaStream;
use gpudirect::safetensors::{self as st, Hop, LoadOptions, Placement, Problem};
use gpudirect::{Cause, Error, FallbackPolicy, TransferPath};
use rand::{Rng, RngCore, SeedableRng};
use safetensors::tensor::TensorView;

use super::common;

/// Peer access is process-wide state: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn one_stream() -> Arc<CudaStream> {
    common::need_gpu(0).new_stream().expect("cuStreamCreate")
}

/// One stream on each visible GPU (at most 8), in ordinal order.
fn gpu_streams() -> Vec<Arc<CudaStream>> {
    common::need_two_gpus();
    let n = gpudirect::cuda::device_count().unwrap();
    (0..n.min(8))
        .map(|i| common::need_gpu(i).new_stream().expect("cuStreamCreate"))
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir(&format!("fanout-{name}"))
}

/// A host tensor.
struct T {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Mixed dtypes and shapes; one large tensor (cut across 1 MiB segments); every fifth a 0-d
/// scalar; some empty.
fn tensors(seed: u64, n: usize, big: usize) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dts = [
        (safetensors::Dtype::BF16, 2),
        (safetensors::Dtype::F32, 4),
        (safetensors::Dtype::I64, 8),
        (safetensors::Dtype::U8, 1),
        (safetensors::Dtype::F16, 2),
        (safetensors::Dtype::F8_E4M3, 1),
    ];
    (0..n)
        .map(|i| {
            let (dtype, size) = dts[i % dts.len()];
            let shape = match i % 5 {
                0 => vec![],
                1 if i == 1 => vec![big / size / 256, 256],
                1 => vec![0, 9],
                2 => vec![rng.random_range(1..300), rng.random_range(1..700)],
                3 => vec![rng.random_range(1..5000)],
                _ => vec![7, 3],
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
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A model directory of `shards` files and an index.
fn model_dir(dir: &Path, ts: &[T], shards: usize) {
    let mut weight_map = serde_json::Map::new();
    for (k, part) in ts.chunks(ts.len().div_ceil(shards)).enumerate() {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", k + 1);
        write(&dir.join(&name), part);
        for t in part {
            weight_map.insert(t.name.clone(), name.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join(st::INDEX_FILE), index.to_string()).unwrap();
}

/// A file with a U8 tensor of odd length first, so the F32 one after it is misaligned in the
/// file (the format allows it); bytes random.
fn misaligned_file(path: &Path, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let header = r#"{"odd.a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"odd.b":{"dtype":"F32","shape":[1000,3],"data_offsets":[3,12003]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    let mut data = vec![0u8; 12003];
    rng.fill_bytes(&mut data);
    file.extend_from_slice(&data);
    std::fs::write(path, &file).unwrap();
    vec![
        T {
            name: "odd.a".into(),
            dtype: safetensors::Dtype::U8,
            shape: vec![3],
            data: data[..3].to_vec(),
        },
        T {
            name: "odd.b".into(),
            dtype: safetensors::Dtype::F32,
            shape: vec![1000, 3],
            data: data[3..].to_vec(),
        },
    ]
}

fn host(stream: &Arc<CudaStream>, v: &cudarc::driver::CudaView<'_, u8>) -> Vec<u8> {
    if v.is_empty() {
        return Vec::new();
    }
    stream.clone_dtoh(v).unwrap()
}

/// Every GPU holds every tensor, every byte equal to the file's.
fn check_replicated(m: &st::MultiCheckpoint, streams: &[Arc<CudaStream>], ts: &[T]) {
    assert_eq!(m.devices().len(), streams.len());
    for (s, (dev, ck)) in streams.iter().zip(m.iter()) {
        assert_eq!(s.context().ordinal(), dev);
        assert_eq!(ck.len(), ts.len(), "GPU {dev}");
        for t in ts {
            let r = ck.tensor(&t.name).unwrap();
            assert_eq!(r.shape(), &t.shape[..], "GPU {dev} {}", t.name);
            assert!(!r.is_piece());
            assert_eq!(host(s, &r.bytes()), t.data, "GPU {dev} {}", t.name);
        }
    }
}

/// The report's entries for GPU `dev`: bytes from storage, and bytes from each other GPU with
/// the paths they took.
fn hops(r: &st::LoadReport, dev: usize) -> (u64, Vec<(usize, u64, gpudirect::PathReport)>) {
    let mut storage = 0;
    let mut peers = Vec::new();
    for p in r.paths_of(dev) {
        match p.hop {
            Hop::Storage => storage += p.bytes,
            Hop::Peer { from } => peers.push((from, p.bytes, p.path.clone())),
        }
    }
    (storage, peers)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_safetensors_fanout_on_one_gpu_is_the_plain_load() {
    let _g = serial();
    let s = one_stream();
    let d = scratch("one");
    let p = d.join("m.safetensors");
    let ts = tensors(1, 40, 3 << 20);
    write(&p, &ts);
    let plain = st::load(&p, &s).unwrap();
    let m = st::load_replicated(&p, std::slice::from_ref(&s)).unwrap();
    println!(
        "plain: {}\nfan-out, one GPU: {}",
        plain.report(),
        m.report()
    );
    check_replicated(&m, std::slice::from_ref(&s), &ts);
    let (a, b) = (plain.report(), m.report());
    assert_eq!(
        (b.bytes, b.reads, b.copies, b.copied_bytes),
        (a.bytes, a.reads, 0, 0)
    );
    assert_eq!(b.staging_bytes, 0);
    assert!(b
        .paths
        .iter()
        .all(|p| p.hop == Hop::Storage && p.device == 0));
    assert_eq!(
        a.paths
            .iter()
            .map(|p| (&p.path, p.bytes))
            .collect::<Vec<_>>(),
        b.paths
            .iter()
            .map(|p| (&p.path, p.bytes))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        m.on(0).unwrap().allocation_bytes(),
        plain.allocation_bytes()
    );
    // A placement on one GPU: pieces are exact, and there is nothing to copy.
    let rows = &ts[2];
    let part = ts
        .iter()
        .find(|t| t.shape.len() == 1 && t.data.len() >= 64)
        .unwrap();
    let unit = part.data.len() as u64 / part.shape[0] as u64;
    let place = Placement::new()
        .split_rows(rows.name.clone(), [0])
        .put_ranges(part.name.clone(), [(0, 2 * unit..4 * unit)])
        .replicate("*");
    let m = LoadOptions::new()
        .segment_bytes(1 << 20)
        .load_placed(&p, &place, std::slice::from_ref(&s))
        .unwrap();
    println!("placed, one GPU: {}", m.report());
    assert_eq!(m.report().copies, 0);
    let ck = m.on(0).unwrap();
    let r = ck.tensor(&rows.name).unwrap();
    assert!(!r.is_piece(), "all rows of one GPU are the whole tensor");
    assert_eq!(host(&s, &r.bytes()), rows.data);
    let r = ck.tensor(&part.name).unwrap();
    assert!(r.is_piece());
    assert_eq!(r.byte_range(), 2 * unit..4 * unit);
    assert_eq!((r.shape(), r.full_shape()), (&[2][..], &part.shape[..]));
    assert_eq!(
        host(&s, &r.bytes()),
        part.data[(2 * unit) as usize..(4 * unit) as usize]
    );
    // Refusals before any byte moves.
    match st::load_replicated(&p, &[s.clone(), s.clone()]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("appears twice"), "{m}"),
        other => panic!("{other:?}"),
    }
    match st::load_placed(
        &p,
        &Placement::new().put("*", [0, 1]),
        std::slice::from_ref(&s),
    ) {
        Err(Error::Checkpoint {
            problem: Problem::UnknownDevice { device: 1, .. },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(m.on(1).is_err());
}

/// Replicated onto every GPU with peer access: each byte read once, fanned out by copies that
/// report a direct path (or, for a pair without P2P, staged with that cause).
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_fanout_replicated_reads_each_byte_once() {
    let _g = serial();
    let streams = gpu_streams();
    let n = streams.len();
    let topo = gpudirect::p2p::Topology::probe().unwrap();
    let d = scratch("replicated");
    let mut ts = tensors(2, 60, 9 << 20);
    model_dir(&d, &ts, 3);
    for (label, src, opts) in [
        (
            "dir+index, 1 MiB segments",
            d.clone(),
            LoadOptions::new().segment_bytes(1 << 20),
        ),
        ("dir+index, default segments", d.clone(), LoadOptions::new()),
    ] {
        let progress = Arc::new(Mutex::new(Vec::new()));
        let pr = progress.clone();
        let m = opts
            .progress(move |p| pr.lock().unwrap().push(p))
            .load_replicated(&src, &streams)
            .unwrap();
        let r = m.report();
        println!("{label}: {r}");
        check_replicated(&m, &streams, &ts);
        let total: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
        assert_eq!(r.bytes, total, "each byte read once");
        assert_eq!(r.copied_bytes, total * (n as u64 - 1));
        assert_eq!(r.staging_bytes, 0);
        let mut read = 0;
        for dev in 0..n {
            let (storage, peers) = hops(r, dev);
            read += storage;
            let got: u64 = storage + peers.iter().map(|p| p.1).sum::<u64>();
            assert_eq!(got, total, "GPU {dev} got every byte");
            for (from, _, path) in &peers {
                let can = topo.pair(dev, *from).is_some_and(|p| p.can_access_peer);
                if can {
                    assert!(
                        matches!(path.path, TransferPath::PeerDirect { .. }),
                        "GPU {from} -> GPU {dev}: {path}"
                    );
                } else {
                    assert_eq!(path.path, TransferPath::StagedThroughHost);
                    assert!(
                        matches!(path.cause, Some(Cause::PeerUnsupported { .. })),
                        "{path}"
                    );
                }
            }
        }
        assert_eq!(read, total);
        let seen = progress.lock().unwrap();
        let last = seen.last().unwrap();
        assert_eq!(
            (last.done, last.total),
            (total * n as u64, total * n as u64)
        );
        assert!(seen.windows(2).all(|w| w[0].done <= w[1].done));
    }
    // A misaligned tensor in a single file, as a list of one shard.
    let p = d.join("odd.safetensors");
    ts = misaligned_file(&p, 3);
    let m = st::load_replicated(vec![p.clone()], &streams).unwrap();
    println!("misaligned: {}", m.report());
    check_replicated(&m, &streams, &ts);
}

/// Without peer access the driver stages the copies through host memory: the bytes are still
/// exact, and every peer hop says staged, naming the option that withheld the access; with
/// `Deny` the load is refused before any byte moves.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_fanout_without_peer_access_reports_the_staged_path() {
    let _g = serial();
    let streams = gpu_streams();
    let d = scratch("staged");
    let p = d.join("m.safetensors");
    let ts = tensors(4, 30, 5 << 20);
    write(&p, &ts);
    let m = LoadOptions::new()
        .segment_bytes(1 << 20)
        .peer_access(false)
        .load_replicated(&p, &streams)
        .unwrap();
    println!("without peer access: {}", m.report());
    check_replicated(&m, &streams, &ts);
    let mut staged = 0;
    for p in &m.report().paths {
        if let Hop::Peer { .. } = p.hop {
            staged += 1;
            assert_eq!(p.path.path, TransferPath::StagedThroughHost, "{}", p.path);
            assert_eq!(
                p.path.cause,
                Some(Cause::ForcedByConfig {
                    setting: "LoadOptions::peer_access(false)".into()
                }),
                "{}",
                p.path
            );
        }
    }
    assert!(staged >= streams.len() - 1);
    assert!(m.report().fallback_cause().is_some());
    assert!(m
        .report()
        .to_string()
        .contains("staged through host memory"));
    // Under Deny the load is refused before any byte moves: for the staged copies, or first
    // for the storage path where that is not direct either (no nvidia-fs).
    match LoadOptions::new()
        .peer_access(false)
        .fallback(FallbackPolicy::Deny)
        .load_replicated(&p, &streams)
    {
        Err(Error::FallbackRefused { path, cause }) => {
            println!("refused under Deny: {path} because {cause}");
            if path == TransferPath::StagedThroughHost {
                assert_eq!(
                    cause,
                    Cause::ForcedByConfig {
                        setting: "LoadOptions::peer_access(false)".into()
                    }
                );
            } else {
                let storage = gpudirect::storage::GpuFile::open(&p).unwrap();
                assert!(!storage.path_report().is_direct());
                assert_eq!(path, storage.path_report().path);
            }
        }
        other => panic!("a staged copy under Deny must be refused: {other:?}"),
    }
    // With the access granted again, the same load is direct.
    let m = st::load_replicated(&p, &streams).unwrap();
    check_replicated(&m, &streams, &ts);
    let topo = gpudirect::p2p::Topology::probe().unwrap();
    if topo.pairs.iter().all(|p| p.can_access_peer) {
        assert!(
            m.report()
                .paths
                .iter()
                .all(|p| p.hop == Hop::Storage || p.path.path.is_direct()),
            "{}",
            m.report()
        );
    }
}

/// Tensor parallelism: rows split over the GPUs, one tensor in overlapping byte ranges, the
/// rest replicated; every piece exact, its shape and range right; only the bytes several GPUs
/// want are copied, as the host plan says.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_fanout_placed_pieces_are_exact() {
    let _g = serial();
    let streams = gpu_streams();
    let n = streams.len();
    let devs: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
    let d = scratch("placed");
    let ts = tensors(5, 45, 6 << 20);
    model_dir(&d, &ts, 2);
    let by_name: HashMap<&str, &T> = ts.iter().map(|t| (t.name.as_str(), t)).collect();
    let split: Vec<&T> = ts.iter().filter(|t| t.shape.len() == 2).collect();
    let ov = ts
        .iter()
        .find(|t| t.shape.len() == 1 && t.data.len() >= 64)
        .unwrap();
    let unit = (ov.data.len() / ov.shape[0]) as u64;
    let elems = ov.shape[0] as u64;
    // GPU k gets elements [k*e/(n+1), (k+2)*e/(n+1)): neighbours overlap.
    let ranges: Vec<(usize, std::ops::Range<u64>)> = devs
        .iter()
        .enumerate()
        .map(|(k, &dv)| {
            let k = k as u64;
            let e = n as u64 + 1;
            (
                dv,
                k * elems / e * unit..((k + 2) * elems / e).min(elems) * unit,
            )
        })
        .collect();
    let mut place = Placement::new().put_ranges(ov.name.clone(), ranges.clone());
    for t in &split {
        place = place.split_rows(t.name.clone(), devs.clone());
    }
    let place = place.put("model.layers.0.w", [devs[n - 1]]).replicate("*");
    let opts = LoadOptions::new().segment_bytes(1 << 20);
    let plan = opts.plan_placed(&d, &place, &devs).unwrap();
    let m = opts.load_placed(&d, &place, &streams).unwrap();
    println!("placed: {}", m.report());
    assert_eq!(m.report().bytes, plan.bytes);
    assert_eq!(m.report().copied_bytes, plan.copied_bytes);
    assert_eq!(m.report().copies, plan.copies);
    for (k, (s, (dev, ck))) in streams.iter().zip(m.iter()).enumerate() {
        assert_eq!(
            ck.allocation_bytes() as u64,
            plan.devices[k].allocation_bytes
        );
        let mut want = 0;
        for r in ck.tensors() {
            let t = by_name[r.name()];
            let br = r.byte_range();
            assert_eq!(r.full_shape(), &t.shape[..]);
            assert_eq!(
                host(s, &r.bytes()),
                t.data[br.start as usize..br.end as usize],
                "GPU {dev} {}",
                t.name
            );
            if t.shape.len() == 2 && t.shape[0] > 0 {
                let rows = t.shape[0];
                let (a, b) = (k * rows / n, (k + 1) * rows / n);
                let row = t.data.len() / rows;
                assert_eq!(br, (a * row) as u64..(b * row) as u64);
                if b - a < rows {
                    assert_eq!(r.shape(), &[b - a, t.shape[1]][..]);
                }
            }
            if t.name == ov.name {
                assert_eq!(br, ranges[k].1);
            }
            want += 1;
        }
        let expected = if k == n - 1 { ts.len() } else { ts.len() - 1 };
        assert_eq!(
            want, expected,
            "GPU {dev}: model.layers.0.w only on the last GPU"
        );
        assert_eq!(ck.contains("model.layers.0.w"), k == n - 1);
    }
}

/// A checkpoint larger than any GPU (1 TiB claimed by a sparse file) replicated onto every GPU
/// is refused before any allocation or read with `Problem::NotEnoughDeviceMemory`, naming the
/// file and a GPU of the load (the first one asked, GPU 0's stream); no partial
/// `MultiCheckpoint` is returned.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn multi_gpu_fanout_not_enough_device_memory_is_refused() {
    let _g = serial();
    let streams = gpu_streams();
    let d = scratch("huge");
    let p = common::huge_sparse_checkpoint(&d);
    match st::load_replicated(&p, &streams) {
        Err(Error::Checkpoint {
            file,
            problem:
                Problem::NotEnoughDeviceMemory {
                    device,
                    needed,
                    free,
                },
            ..
        }) => {
            assert_eq!(file, p);
            assert_eq!(device, streams[0].context().ordinal());
            assert!(needed >= 1 << 40 && free < needed, "{needed} {free}");
        }
        Err(e) => panic!("not NotEnoughDeviceMemory: {e}"),
        Ok(_) => panic!("a 1 TiB checkpoint loaded"),
    }
    std::fs::remove_dir_all(&d).unwrap();
}

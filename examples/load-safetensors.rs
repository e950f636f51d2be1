//! Loads a safetensors checkpoint (a file, a model directory with
//! `model.safetensors.index.json`, or several shard files) onto GPU 0 in one job and prints
//! its tensors, the speed, the path the bytes took and the cause of any fallback.
//!
//! With `--devices` it loads onto several GPUs in one job instead: every tensor on every GPU, or
//! tensor-parallel (`--rows`: tensors of 2+ dimensions split by rows, the rest replicated). Each
//! byte is read from storage once and fanned out by peer copies; it prints the time until the
//! last GPU held its bytes, the aggregate rate, and per GPU where its bytes came from and by
//! which path (a staged copy names its cause).
//!
//! Needs a CUDA GPU to load (two or more for a fan-out; with one it is the plain load); without
//! one it reads and checks the headers, prints the tensors (or the fan-out plan) and says why it
//! did not load them. Progress goes to stderr for single-GPU checkpoints over 1 GiB.
//!
//!     cargo run --release --example load-safetensors -- PATH|DIR [SHARD...] [--owned]
//!         [--filter PATTERN]... [--summary] [--json]
//!     cargo run --release --example load-safetensors -- PATH|DIR [SHARD...] --devices all|0,1,...
//!         [--rows] [--no-peer-access] [--segment-mib N] [--verify] [--filter PATTERN]... [--json]

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use gpudirect::cudarc::driver::CudaStream;
use gpudirect::p2p::PeerAccess;
use gpudirect::safetensors::{self as st, Hop, LoadOptions, Placement};

const USAGE: &str = "usage: load-safetensors PATH|DIR [SHARD...] [--owned] [--filter PATTERN]... [--summary] [--json]
       load-safetensors PATH|DIR [SHARD...] --devices all|0,1,... [--rows] [--no-peer-access] [--segment-mib N] [--verify] [--filter PATTERN]... [--json]

Loads a safetensors file, a model directory (model.safetensors.index.json or model.safetensors)
or a list of shard files onto GPU 0 and prints each tensor (name, dtype, shape), the bytes, the
time and GB/s, the path the bytes took and the cause of any fallback.

  --owned            one CudaSlice per tensor instead of views into one allocation
  --filter PATTERN   load only matching tensors (exact name, or a glob with * and ?); repeatable
  --summary          do not list the tensors
  --json             print one JSON line with the report (for scripts)
  -h, --help         this text

Onto several GPUs (each byte read from storage once, fanned out over NVLink by peer copies;
prints the time until the last GPU holds its tensors, the aggregate GB/s, and per GPU the bytes
from storage and from each other GPU with their paths):
  --devices LIST     the GPUs (CUDA ordinals, comma-separated) or all
  --rows             tensor parallel: tensors of 2 or more dimensions split by rows over the
                     GPUs, the rest replicated (default: every tensor on every GPU)
  --no-peer-access   do not grant peer access: the driver stages the copies through host
                     memory, and the report says so with the cause
  --segment-mib N    bytes one GPU reads before its copies start (default 64)
  --verify           after the timed load, compare every byte on every GPU with the files
  --json             one JSON line; CUDA and peer access are set up before the clock, as the
                     peers' process groups are (setup_seconds says how long)";

struct Args {
    paths: Vec<String>,
    owned: bool,
    filter: Vec<String>,
    summary: bool,
    json: bool,
    /// `Some` for a multi-GPU load (`None` inside: all GPUs).
    devices: Option<Option<Vec<usize>>>,
    rows: bool,
    peer_access: bool,
    segment_mib: Option<u64>,
    verify: bool,
}

fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        paths: vec![],
        owned: false,
        filter: vec![],
        summary: false,
        json: false,
        devices: None,
        rows: false,
        peer_access: true,
        segment_mib: None,
        verify: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "-h" | "--help" => return Ok(None),
            "--owned" => a.owned = true,
            "--summary" => a.summary = true,
            "--json" => a.json = true,
            "--filter" => a.filter.push(it.next().ok_or("--filter needs a pattern")?),
            "--rows" => a.rows = true,
            "--no-peer-access" => a.peer_access = false,
            "--verify" => a.verify = true,
            "--devices" => {
                let v = it.next().ok_or("--devices needs a list or all")?;
                a.devices = Some(if v == "all" {
                    None
                } else {
                    let list: Result<Vec<usize>, _> = v.split(',').map(str::parse).collect();
                    Some(list.map_err(|e| format!("--devices {v}: {e}"))?)
                });
            }
            "--segment-mib" => {
                let v = it.next().ok_or("--segment-mib needs a number")?;
                a.segment_mib = Some(v.parse().map_err(|e| format!("--segment-mib {v}: {e}"))?);
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            _ => a.paths.push(x),
        }
    }
    if a.paths.is_empty() {
        return Err("give a .safetensors file, a model directory or shard files".into());
    }
    if a.devices.is_none() && (a.rows || !a.peer_access || a.segment_mib.is_some() || a.verify) {
        return Err(
            "--rows, --no-peer-access, --segment-mib and --verify go with --devices".into(),
        );
    }
    if a.devices.is_some() && a.owned {
        return Err("--owned loads onto one GPU: leave out --devices".into());
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    let r = if args.devices.is_some() {
        run_fanout(&args)
    } else {
        run(&args).map_err(Into::into)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if args.json && args.devices.is_some() {
                println!("{}", serde_json::json!({ "error": e.to_string() }));
            }
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn source(args: &Args) -> st::Source {
    if args.paths.len() == 1 {
        st::Source::from(args.paths[0].as_str())
    } else {
        st::Source::from(args.paths.clone())
    }
}

fn run(args: &Args) -> gpudirect::Result<()> {
    let mut opts = LoadOptions::new();
    if !args.filter.is_empty() {
        opts = opts.filter(args.filter.clone());
    }
    // CUDA is initialised before the load is timed (the report's clock starts in the load).
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) if e.is_absence() => {
            let plan = opts.plan(source(args))?;
            for (path, h) in st::inspect(source(args))? {
                println!("{}: {} tensors", path.display(), h.tensors.len());
                if !args.summary {
                    for t in &h.tensors {
                        println!("  {:<60} {:<8} {:?}", t.name, t.dtype.as_str(), t.shape);
                    }
                }
            }
            println!(
                "headers are valid: {} tensors, {} bytes in {} reads; not loaded: {e}",
                plan.tensors, plan.bytes, plan.reads
            );
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let stream = ctx.default_stream();
    if args.json {
        // Benchmarks initialise CUDA before the clock as the peers' harness does
        // (`torch.cuda.init()` and `torch.empty(1, device="cuda:0")` there): the context, and
        // the allocator an owned load's tensors come from (cudarc's stream-ordered pool, whose
        // first allocation in a process took ~11 ms on the H200 machine).
        drop(stream.alloc_zeros::<u8>(1)?);
        stream.synchronize()?;
    }
    // With --json (benchmarks) nothing touches the files before the timed load.
    if !args.json && opts.plan(source(args))?.bytes > 1 << 30 {
        opts = opts.progress(|p| {
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\rloading {:.2} / {:.2} GB ({:.0}%)",
                p.done as f64 / 1e9,
                p.total as f64 / 1e9,
                100.0 * p.done as f64 / p.total.max(1) as f64
            );
            if p.done == p.total {
                let _ = writeln!(err);
            }
        });
    }
    let (report, listing) = if args.owned {
        let ck = opts.load_owned(source(args), &stream)?;
        let l: Vec<String> = ck
            .tensors()
            .map(|t| {
                format!(
                    "  {:<60} {:<8} {:?}",
                    t.name(),
                    t.dtype().as_str(),
                    t.shape()
                )
            })
            .collect();
        (ck.report().clone(), l)
    } else {
        let ck = opts.load(source(args), &stream)?;
        let l: Vec<String> = ck
            .tensors()
            .map(|t| {
                format!(
                    "  {:<60} {:<8} {:?}",
                    t.name(),
                    t.dtype().as_str(),
                    t.shape()
                )
            })
            .collect();
        (ck.report().clone(), l)
    };
    if !args.summary && !args.json {
        for l in &listing {
            println!("{l}");
        }
    }
    let mode = if args.owned {
        "owned"
    } else {
        "one-allocation"
    };
    if args.json {
        let paths: Vec<String> = report.paths.iter().map(|p| p.path.to_string()).collect();
        // serde_json writes the strings (paths, causes: any character) as JSON; a number that
        // is not finite becomes null.
        println!(
            "{}",
            serde_json::json!({
                "mode": mode,
                "bytes": report.bytes,
                "tensors": report.tensors,
                "files": report.files,
                "reads": report.reads,
                "seconds": report.elapsed.as_secs_f64(),
                "gbps": report.gb_per_s(),
                "odirect": report.odirect,
                "paths": paths,
                "fallback": report.fallback_cause().map(|c| c.to_string()).unwrap_or_default(),
            })
        );
        return Ok(());
    }
    println!(
        "loaded {} tensors, {:.3} GB from {} files in {} reads ({mode}) in {:.1} ms: {:.2} GB/s",
        report.tensors,
        report.bytes as f64 / 1e9,
        report.files,
        report.reads,
        report.elapsed.as_secs_f64() * 1e3,
        report.gb_per_s()
    );
    for p in &report.paths {
        println!(
            "path (GPU {}, {} bytes): {}",
            p.device, p.bytes, p.path.path
        );
    }
    match report.fallback_cause() {
        Some(c) => println!("fallback cause: {c}"),
        None => println!("fallback cause: none (direct)"),
    }
    if report.odirect {
        println!("O_DIRECT: yes (not in the page cache)");
    }
    if report.skipped_bytes > 0 {
        println!("filtered out (not read): {} bytes", report.skipped_bytes);
    }
    Ok(())
}

/// The tensor-parallel placement: every tensor of 2+ dimensions split by rows, the rest
/// everywhere. A row must be whole bytes (4- and 6-bit tensors whose rows are not stay whole).
///
/// Rules take patterns, and a name with `*` or `?` is a glob that would match other tensors
/// too: such a tensor gets its rows as explicit byte ranges (`put_ranges`, which names one
/// tensor exactly), the same split `split_rows` makes.
fn rows_placement(args: &Args, devices: &[usize]) -> gpudirect::Result<Placement> {
    let mut p = Placement::new();
    let keep = st::Filter::new(args.filter.clone());
    for (_, h) in st::inspect(source(args))? {
        for t in h
            .tensors
            .iter()
            .filter(|t| t.shape.len() >= 2 && (args.filter.is_empty() || keep.matches(&t.name)))
        {
            let row_bits = t.shape[1..].iter().product::<usize>() as u64 * t.dtype.bits() as u64;
            if !row_bits.is_multiple_of(8) {
                continue;
            }
            if t.name.contains(['*', '?']) {
                let (rows, row, n) = (t.shape[0] as u64, row_bits / 8, devices.len() as u64);
                let ranges = devices.iter().enumerate().map(|(k, &d)| {
                    let k = k as u64;
                    (d, k * rows / n * row..(k + 1) * rows / n * row)
                });
                p = p.put_ranges(t.name.clone(), ranges);
            } else {
                p = p.split_rows(t.name.clone(), devices.iter().copied());
            }
        }
    }
    Ok(p.replicate("*"))
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run_fanout(args: &Args) -> Res<()> {
    let setup = Instant::now();
    let mut opts = LoadOptions::new().peer_access(args.peer_access);
    if !args.filter.is_empty() {
        opts = opts.filter(args.filter.clone());
    }
    if let Some(m) = args.segment_mib {
        opts = opts.segment_bytes(m << 20);
    }
    let n = match gpudirect::cuda::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => return no_gpu_fanout(args, &opts, "no CUDA GPU in this process".into()),
        Err(e) if e.is_absence() => return no_gpu_fanout(args, &opts, e.to_string()),
        Err(e) => return Err(e.into()),
    };
    let devices: Vec<usize> = args
        .devices
        .clone()
        .flatten()
        .unwrap_or_else(|| (0..n).collect());
    let streams: Vec<Arc<CudaStream>> = devices
        .iter()
        .map(|&d| gpudirect::cuda::context(d).map(|c| c.default_stream()))
        .collect::<gpudirect::Result<_>>()?;
    let placement = if args.rows {
        Some(rows_placement(args, &devices)?)
    } else {
        None
    };
    // For --json (benchmarks), peer access is granted before the clock, as the peers' NCCL
    // groups are set up before theirs; the load's own grants then only count references.
    let mut held = Vec::new();
    if args.json && args.peer_access {
        for (i, &a) in devices.iter().enumerate() {
            for &b in &devices[i + 1..] {
                match PeerAccess::between(a, b) {
                    Ok(g) => held.push(g),
                    Err(e) => eprintln!("peer access GPU {a} <-> GPU {b}: {e}"),
                }
            }
        }
    }
    if args.json {
        // As for one GPU: each GPU's stream-ordered pool is initialised before the clock.
        for s in &streams {
            drop(s.alloc_zeros::<u8>(1)?);
            s.synchronize()?;
        }
    }
    let setup_seconds = setup.elapsed().as_secs_f64();
    let m = match &placement {
        Some(p) => opts.load_placed(source(args), p, &streams)?,
        None => opts.load_replicated(source(args), &streams)?,
    };
    let r = m.report();
    let verified = if args.verify { Some(verify(&m)?) } else { None };
    drop(held);
    if args.json {
        let per: Vec<serde_json::Value> = r
            .paths
            .iter()
            .map(|p| {
                serde_json::json!({
                    "device": p.device,
                    "from": match p.hop { Hop::Storage => "storage".to_string(), Hop::Peer { from } => format!("GPU {from}") },
                    "bytes": p.bytes,
                    "path": p.path.to_string(),
                })
            })
            .collect();
        let held_bytes: u64 = m
            .iter()
            .map(|(_, ck)| ck.tensors().map(|t| t.bytes().len() as u64).sum::<u64>())
            .sum();
        println!(
            "{}",
            serde_json::json!({
                "mode": if args.rows { "rows" } else { "replicated" },
                "devices": devices,
                "seconds": r.elapsed.as_secs_f64(),
                "gbps": r.gb_per_s(),
                "bytes": r.bytes,
                "held_bytes": held_bytes,
                "copied_bytes": r.copied_bytes,
                "reads": r.reads,
                "copies": r.copies,
                "staging_bytes": r.staging_bytes,
                "setup_seconds": setup_seconds,
                "paths": per,
                "fallback": r.fallback_cause().map(|c| c.to_string()),
                "verified": verified,
            })
        );
        return Ok(());
    }
    println!(
        "{} onto GPUs {devices:?}: {:.3} GB read once in {} reads, {:.3} GB in {} peer copies; the last GPU held its bytes after {:.1} ms = {:.2} GB/s aggregate",
        if args.rows { "tensor parallel" } else { "replicated" },
        r.bytes as f64 / 1e9,
        r.reads,
        r.copied_bytes as f64 / 1e9,
        r.copies,
        r.elapsed.as_secs_f64() * 1e3,
        r.gb_per_s()
    );
    for (d, ck) in m.iter() {
        println!(
            "GPU {d}: {} tensors, {} bytes allocated",
            ck.len(),
            ck.allocation_bytes()
        );
        for p in r.paths_of(d) {
            println!("  {} bytes {} via {}", p.bytes, p.hop, p.path);
        }
    }
    match r.fallback_cause() {
        Some(c) => println!("fallback cause: {c}"),
        None => println!("fallback cause: none (direct)"),
    }
    println!("staging device memory: {} bytes", r.staging_bytes);
    if let Some(v) = verified {
        println!("verified: {v} bytes on the GPUs equal the files'");
    }
    Ok(())
}

/// Compares every byte on every GPU with the file's; returns the bytes compared.
fn verify(m: &st::MultiCheckpoint) -> Res<u64> {
    let mut files: std::collections::HashMap<std::path::PathBuf, (Vec<u8>, st::Header)> =
        std::collections::HashMap::new();
    let mut n = 0;
    for (d, ck) in m.iter() {
        let stream = gpudirect::cuda::context(d)?.default_stream();
        for t in ck.tensors() {
            if !files.contains_key(t.file()) {
                let bytes = std::fs::read(t.file())?;
                let header = st::inspect(vec![t.file()])?.remove(0).1;
                files.insert(t.file().to_owned(), (bytes, header));
            }
            let (file, header) = &files[t.file()];
            let info = header
                .tensors
                .iter()
                .find(|x| x.name == t.name())
                .ok_or("a tensor is not in its file")?;
            let r = t.byte_range();
            let want = &file[(info.offset + r.start) as usize..(info.offset + r.end) as usize];
            let got = if want.is_empty() {
                Vec::new()
            } else {
                stream.clone_dtoh(&t.bytes())?
            };
            if got != want {
                return Err(format!(
                    "GPU {d} holds different bytes for {} than {} ({r:?} of the tensor)",
                    t.name(),
                    t.file().display()
                )
                .into());
            }
            n += want.len() as u64;
        }
    }
    Ok(n)
}

fn no_gpu_fanout(args: &Args, opts: &LoadOptions, why: String) -> Res<()> {
    let devices = args.devices.clone().flatten().unwrap_or_else(|| vec![0, 1]);
    let placement = if args.rows {
        rows_placement(args, &devices)?
    } else {
        Placement::replicated()
    };
    let p = opts.plan_placed(source(args), &placement, &devices)?;
    println!(
        "headers are valid; onto GPUs {devices:?} the load would read {} bytes once in {} reads and copy {} bytes in {} peer copies (segments of {} bytes, no staging memory)",
        p.bytes, p.reads, p.copied_bytes, p.copies, p.segment_bytes
    );
    for d in &p.devices {
        println!(
            "  GPU {}: {} tensors, {} bytes allocated, reads {} bytes, receives {} bytes",
            d.device, d.tensors, d.allocation_bytes, d.read_bytes, d.received_bytes
        );
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "error": format!("not loaded: {why}") })
        );
    } else {
        println!("not loaded: {why}");
    }
    Ok(())
}

//! Loads a safetensors checkpoint (a file, a model directory with
//! `model.safetensors.index.json`, or several shard files) onto GPU 0 in one job and prints
//! its tensors, the speed, the path the bytes took and the cause of any fallback.
//!
//! Needs a CUDA GPU to load; without one it reads and checks the headers, prints the tensors
//! and says why it did not load them. Progress goes to stderr for checkpoints over 1 GiB.
//!
//!     cargo run --release --example load-safetensors -- PATH|DIR [SHARD...] [--owned]
//!         [--filter PATTERN]... [--summary] [--json]

use std::io::Write;
use std::process::ExitCode;

use gpudirect::safetensors::{self as st, LoadOptions};

const USAGE: &str = "usage: load-safetensors PATH|DIR [SHARD...] [--owned] [--filter PATTERN]... [--summary] [--json]

Loads a safetensors file, a model directory (model.safetensors.index.json or model.safetensors)
or a list of shard files onto GPU 0 and prints each tensor (name, dtype, shape), the bytes, the
time and GB/s, the path the bytes took and the cause of any fallback.

  --owned            one CudaSlice per tensor instead of views into one allocation
  --filter PATTERN   load only matching tensors (exact name, or a glob with * and ?); repeatable
  --summary          do not list the tensors
  --json             print one JSON line with the report (for scripts)
  -h, --help         this text";

struct Args {
    paths: Vec<String>,
    owned: bool,
    filter: Vec<String>,
    summary: bool,
    json: bool,
}

fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        paths: vec![],
        owned: false,
        filter: vec![],
        summary: false,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "-h" | "--help" => return Ok(None),
            "--owned" => a.owned = true,
            "--summary" => a.summary = true,
            "--json" => a.json = true,
            "--filter" => a.filter.push(it.next().ok_or("--filter needs a pattern")?),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            _ => a.paths.push(x),
        }
    }
    if a.paths.is_empty() {
        return Err("give a .safetensors file, a model directory or shard files".into());
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
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
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
        println!(
            "{{\"mode\":\"{mode}\",\"bytes\":{},\"tensors\":{},\"files\":{},\"reads\":{},\"seconds\":{},\"gbps\":{},\"odirect\":{},\"paths\":{:?},\"fallback\":{:?}}}",
            report.bytes,
            report.tensors,
            report.files,
            report.reads,
            report.elapsed.as_secs_f64(),
            report.gb_per_s(),
            report.odirect,
            paths,
            report.fallback_cause().map(|c| c.to_string()).unwrap_or_default()
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

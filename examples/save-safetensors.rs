//! Saves GPU tensors into a safetensors file (atomic replace, one fsync when durable), loads it
//! back and checks every byte: the checkpoint round trip, with its speed and path.
//!
//! Needs a CUDA GPU (without one it says so and exits cleanly). By default 64 bf16/f32/i64
//! tensors of random data, 256 MiB in all, saved under `GPUDIRECT_TEST_DIR` (default: the temp
//! dir) and removed afterwards.
//!
//!     cargo run --release --example save-safetensors -- [PATH] [--tensors N] [--size-mib M]
//!         [--no-durable] [--no-verify] [--keep] [--json]

use std::process::ExitCode;

use gpudirect::safetensors::{self as st, Dtype, SaveOptions, SaveTensor};

const USAGE: &str =
    "usage: save-safetensors [PATH] [--tensors N] [--size-mib M] [--no-durable] [--keep] [--json]

Creates N tensors of random data on GPU 0 (M MiB in all; bf16, f32, i64, a 0-d scalar and an
empty tensor among them), saves them to PATH as one safetensors file, loads the file back and
checks every byte; prints save and load speed and the path the bytes took.

  --tensors N     how many tensors (default 64)
  --size-mib M    total size (default 256)
  --no-durable    skip the fsyncs
  --no-verify     do not load the file back (benchmarks time the save alone)
  --keep          keep the file (default: removed unless PATH was given)
  --json          print one JSON line with the save and load reports (for scripts)
  -h, --help      this text";

struct Args {
    path: Option<String>,
    tensors: usize,
    mib: usize,
    durable: bool,
    verify: bool,
    keep: bool,
    json: bool,
}

fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        path: None,
        tensors: 64,
        mib: 256,
        durable: true,
        verify: true,
        keep: false,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, what: &str| -> Result<usize, String> {
        v.ok_or(format!("{what} needs a number"))?
            .parse()
            .map_err(|e| format!("{what}: {e}"))
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "-h" | "--help" => return Ok(None),
            "--tensors" => a.tensors = num(it.next(), "--tensors")?.max(3),
            "--size-mib" => a.mib = num(it.next(), "--size-mib")?,
            "--no-durable" => a.durable = false,
            "--no-verify" => a.verify = false,
            "--keep" => a.keep = true,
            "--json" => a.json = true,
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            _ => a.path = Some(x),
        }
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

/// Fast random bytes (xorshift64*), never all zeros.
fn fill(buf: &mut [u8], mut x: u64) {
    x |= 1;
    for c in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

fn cuda<T>(r: Result<T, gpudirect::cudarc::driver::DriverError>) -> gpudirect::Result<T> {
    r.map_err(gpudirect::Error::from)
}

fn run(args: &Args) -> gpudirect::Result<()> {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) if e.is_absence() => {
            println!("no GPU here, nothing saved: {e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let stream = ctx.default_stream();
    let path = match &args.path {
        Some(p) => std::path::PathBuf::from(p),
        None => std::env::var_os("GPUDIRECT_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("gpudirect-save-{}.safetensors", std::process::id())),
    };
    // Tensors: a 0-d scalar, an empty one, then bf16 / f32 / i64 sharing the rest.
    let total = args.mib << 20;
    let n = args.tensors - 2;
    let dts = [Dtype::BF16, Dtype::F32, Dtype::I64];
    let mut specs: Vec<(String, Dtype, Vec<usize>)> = vec![
        ("scalar".into(), Dtype::F32, vec![]),
        ("empty".into(), Dtype::BF16, vec![0, 16]),
    ];
    for i in 0..n {
        let dt = dts[i % 3];
        let elems = (total / n) / (dt.bits() / 8);
        let cols = 1024.min(elems.max(1));
        specs.push((
            format!("model.layers.{i}.weight"),
            dt,
            vec![elems / cols, cols],
        ));
    }
    let mut host = Vec::with_capacity(specs.len());
    let mut dev = Vec::with_capacity(specs.len());
    for (i, (_, dt, shape)) in specs.iter().enumerate() {
        let len = shape.iter().product::<usize>() * dt.bits() / 8;
        let mut b = vec![0u8; len];
        fill(&mut b, 0x9E37_79B9_7F4A_7C15 ^ i as u64);
        dev.push(if len == 0 {
            cuda(stream.null::<u8>())?
        } else {
            cuda(stream.clone_htod(&b))?
        });
        host.push(b);
    }
    cuda(stream.synchronize())?;
    let opts = SaveOptions::new()
        .durable(args.durable)
        .metadata("format", "pt");
    let saved = st::save(
        &path,
        specs.iter().zip(&dev).map(|((name, dt, shape), d)| {
            (
                name.as_str(),
                SaveTensor::from_bytes(d.as_view(), *dt, shape),
            )
        }),
        &opts,
    )?;
    let mut bad = 0;
    let ck = if args.verify {
        let ck = st::load(&path, &stream)?;
        for ((name, dt, shape), want) in specs.iter().zip(&host) {
            let t = ck.tensor(name)?;
            let got = if want.is_empty() {
                Vec::new()
            } else {
                cuda(stream.clone_dtoh(&t.bytes()))?
            };
            if t.dtype() != *dt || t.shape() != &shape[..] || &got != want {
                bad += 1;
                eprintln!("MISMATCH {name}");
            }
        }
        Some(ck)
    } else {
        None
    };
    let loaded = ck.as_ref().map(|c| c.report().clone());
    if args.json {
        // serde_json writes the strings (paths: any character) as JSON; a number that is not
        // finite becomes null.
        println!(
            "{}",
            serde_json::json!({
                "tensors": saved.tensors,
                "bytes": saved.bytes,
                "durable": args.durable,
                "save_seconds": saved.elapsed.as_secs_f64(),
                "save_gbps": saved.gb_per_s(),
                "load_seconds": loaded.as_ref().map_or(0.0, |l| l.elapsed.as_secs_f64()),
                "load_gbps": loaded.as_ref().map_or(0.0, |l| l.gb_per_s()),
                "save_path": saved.paths.first().map(|p| p.path.to_string()).unwrap_or_default(),
                "load_path": loaded
                    .as_ref()
                    .and_then(|l| l.paths.first())
                    .map(|p| p.path.to_string())
                    .unwrap_or_default(),
                "mismatches": bad,
            })
        );
    } else {
        println!(
            "saved {} ({}durable): {saved}",
            path.display(),
            if args.durable { "" } else { "not " }
        );
        match &loaded {
            Some(l) => println!(
                "loaded back: {l}\nchecked {} tensors, {} bytes: {}",
                specs.len(),
                saved.bytes,
                if bad == 0 {
                    "every byte matches".to_string()
                } else {
                    format!("{bad} MISMATCHES")
                }
            ),
            None => println!("not loaded back (--no-verify)"),
        }
    }
    drop(ck);
    if args.path.is_none() && !args.keep {
        let _ = std::fs::remove_file(&path);
    }
    if bad > 0 {
        return Err(gpudirect::Error::InvalidArgument(format!(
            "{bad} tensors did not round-trip"
        )));
    }
    Ok(())
}

//! doctor: says whether GPUDirect works on this machine, and why not.
//!
//! Shows: the CUDA driver and GPUs, P2P (topology and whether cudarc buffers copy directly),
//! GDR (peer-memory client, dma-buf, RDMA devices, GPU↔NIC distance) and GDS (libcufile,
//! nvidia-fs, whether a file in `--dir` registers with cuFile), then a summary of every
//! fallback with its cause and fix.
//!
//! Needs: nothing. Without a GPU, driver or library it says so plainly and exits 0.
//!
//! ```text
//! cargo run --release --example doctor                     # full report (short measurements)
//! cargo run --release --example doctor -- --quick          # no measurements
//! cargo run --release --example doctor -- --json           # machine-readable
//! cargo run --release --example doctor -- --require-direct # exit 2 if any path falls back
//! cargo run --release --example doctor -- --dir /data      # where to test file registration
//! cargo run --release --example doctor -- --withhold-peer-access  # prove staged detection
//! ```
//!
//! Exit codes: 0 report printed (fallbacks included, unless `--require-direct`);
//! 1 a check failed on hardware that is present; 2 `--require-direct` and a path falls back;
//! 64 bad command line.

use std::path::PathBuf;
use std::process::ExitCode;

use gpudirect::diag::Report;

const USAGE: &str = "\
usage: doctor [--json] [--quick] [--require-direct] [--dir PATH] [--withhold-peer-access]

Says whether GPUDirect (P2P, RDMA, Storage) works on this machine, and why not: every finding
with its cause and fix, then a summary of the fallbacks. --json prints the report as JSON
(schema_version 1), --quick skips the measurements, --require-direct exits 2 if any path falls
back, --dir is where to test file registration (default: .), --withhold-peer-access shows the
staged P2P path. Exit codes: 0 report printed, 1 a check failed on present hardware,
2 --require-direct and a fallback, 64 bad command line.";

struct Options {
    json: bool,
    quick: bool,
    require_direct: bool,
    withhold_peer_access: bool,
    dir: PathBuf,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        json: false,
        quick: false,
        require_direct: false,
        withhold_peer_access: false,
        dir: PathBuf::from("."),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => o.json = true,
            "--quick" => o.quick = true,
            "--require-direct" => o.require_direct = true,
            "--withhold-peer-access" => o.withhold_peer_access = true,
            "--dir" => o.dir = args.next().ok_or("--dir needs a path")?.into(),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("doctor: {e}\n\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    let mut report = Report::default();
    let progress = |what: &str| {
        if !opts.json {
            eprintln!("doctor: checking {what}...");
        }
    };
    progress("CUDA");
    let gpus = report.check_cuda();
    if gpus.is_some() {
        progress("P2P");
        report.check_p2p(!opts.quick, opts.withhold_peer_access);
    }
    progress("GDR");
    report.check_gdr();
    progress("GDS");
    report.check_gds(&opts.dir, gpus.map(|_| 0), opts.quick);

    if opts.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("doctor: cannot serialize the report: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        println!("gpudirect doctor {}", env!("CARGO_PKG_VERSION"));
        print!("{report}");
    }
    if opts.require_direct && report.has_fallback() {
        return ExitCode::from(2);
    }
    if report.has_failure() {
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

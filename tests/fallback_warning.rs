//! The `Warn` fallback policy is visible without `tracing`, once per kind of cause per process.
//!
//! Each test re-runs this test binary as a child process (the same test, with
//! `GPUDIRECT_TEST_FALLBACK_CHILD` naming the role) and checks the child's stderr, because the
//! warning is process-wide state and goes to the real stderr, past libtest's capture.
//! `gpu_fallback_warns_once_for_many_files` needs a CUDA GPU (run it on the GPU machine with
//! `.device/run --include-ignored gpu_fallback`).

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gpudirect::{Cause, FallbackPolicy, PathReport, TransferPath};

const ROLE: &str = "GPUDIRECT_TEST_FALLBACK_CHILD";
const PREFIX: &str = "gpudirect: warning: a transfer falls back";

/// Runs `test` (this binary's test of that exact name) as a child in `role`, with the fallback
/// environment cleared and `env` added.
fn child(test: &str, role: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        test,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ])
    .env(ROLE, role)
    .env_remove("GPUDIRECT_FALLBACK")
    .env_remove("GPUDIRECT_REQUIRE_DIRECT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the child test process");
    assert!(
        out.status.success(),
        "child {role} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn warning_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with(PREFIX))
        .map(str::to_owned)
        .collect()
}

/// Three kinds of cause: 10,000 POSIX fallbacks for udev data (on three devices, from four
/// threads), 10 staged peer copies, one host-memory read. Returns the three first reports.
fn fallbacks(policy: impl Fn() -> FallbackPolicy + Sync) -> [PathReport; 3] {
    let udev = |i: usize| {
        PathReport::fallback(
            TransferPath::Posix,
            Cause::UdevDataMissing {
                device: format!("nvme{}n1", i % 3),
            },
        )
    };
    let peer = PathReport::fallback(
        TransferPath::StagedThroughHost,
        Cause::PeerAccessNotEnabled {
            accessor: 1,
            owner: 0,
        },
    );
    let host = PathReport::fallback(TransferPath::Posix, Cause::HostMemory);
    policy().check(&udev(0)).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (policy, udev) = (&policy, &udev);
            s.spawn(move || {
                for i in 0..2500 {
                    policy().check(&udev(t * 2500 + i)).unwrap();
                }
            });
        }
    });
    for _ in 0..10 {
        policy().check(&peer).unwrap();
    }
    policy().check(&host).unwrap();
    // Direct paths never warn.
    policy()
        .check(&PathReport::direct(TransferPath::Gds))
        .unwrap();
    [udev(0), peer, host]
}

#[test]
fn warn_reaches_stderr_once_per_cause_without_tracing() {
    let name = "warn_reaches_stderr_once_per_cause_without_tracing";
    match std::env::var(ROLE).as_deref() {
        Ok("plain") => {
            fallbacks(|| FallbackPolicy::Warn);
        }
        Ok(other) => panic!("unknown child role {other}"),
        Err(_) => {
            let out = child(name, "plain", &[]);
            let lines = warning_lines(&out);
            let firsts = fallbacks_text();
            assert_eq!(lines.len(), 3, "one line per kind of cause, got {lines:#?}");
            for (line, (path, cause)) in lines.iter().zip(&firsts) {
                assert!(line.contains(path), "{line:?} should name {path:?}");
                assert!(line.contains(cause), "{line:?} should name {cause:?}");
                assert!(line.contains("GPUDIRECT_FALLBACK=allow"), "{line:?}");
            }
        }
    }
}

/// The texts the three warnings must carry: path, and the first instance's cause with its fix.
fn fallbacks_text() -> Vec<(String, String)> {
    let reports = [
        PathReport::fallback(
            TransferPath::Posix,
            Cause::UdevDataMissing {
                device: "nvme0n1".into(),
            },
        ),
        PathReport::fallback(
            TransferPath::StagedThroughHost,
            Cause::PeerAccessNotEnabled {
                accessor: 1,
                owner: 0,
            },
        ),
        PathReport::fallback(TransferPath::Posix, Cause::HostMemory),
    ];
    reports
        .iter()
        .map(|r| (r.path.to_string(), r.cause.as_ref().unwrap().to_string()))
        .collect()
}

#[test]
fn allow_from_the_environment_silences_the_warning() {
    let name = "allow_from_the_environment_silences_the_warning";
    match std::env::var(ROLE).as_deref() {
        Ok("allow") => {
            fallbacks(|| FallbackPolicy::global().unwrap());
        }
        Ok(other) => panic!("unknown child role {other}"),
        Err(_) => {
            let out = child(name, "allow", &[("GPUDIRECT_FALLBACK", "allow")]);
            assert_eq!(warning_lines(&out), Vec::<String>::new());
            // The control: the same child without the variable warns (global() is Warn).
            let out = child(name, "allow", &[]);
            assert_eq!(warning_lines(&out).len(), 3, "{out:?}");
        }
    }
}

/// Counts gpudirect's WARN events; takes every event, so `tracing::enabled!` is true.
struct Counting(Arc<AtomicUsize>);

impl tracing::Subscriber for Counting {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let m = event.metadata();
        if m.target().starts_with("gpudirect") && *m.level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn a_tracing_subscriber_gets_the_warning_instead_of_stderr() {
    let name = "a_tracing_subscriber_gets_the_warning_instead_of_stderr";
    match std::env::var(ROLE).as_deref() {
        Ok("tracing") => {
            let events = Arc::new(AtomicUsize::new(0));
            tracing::subscriber::set_global_default(Counting(events.clone())).unwrap();
            fallbacks(|| FallbackPolicy::Warn);
            println!("\ngpudirect-warn-events={}", events.load(Ordering::Relaxed));
        }
        Ok(other) => panic!("unknown child role {other}"),
        Err(_) => {
            let out = child(name, "tracing", &[]);
            assert_eq!(warning_lines(&out), Vec::<String>::new());
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                stdout.lines().any(|l| l == "gpudirect-warn-events=3"),
                "three events, one per kind of cause:\n{stdout}"
            );
        }
    }
}

/// On a GPU: 200 files read into device memory by `GpuFile` in a child process. Every read's
/// report is printed; the child's stderr must hold exactly one warning per distinct
/// (path, cause) kind among the fallbacks (one on a machine without nvidia-fs, none where every
/// read is direct), never one per file.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fallback_warns_once_for_many_files() {
    let name = "gpu_fallback_warns_once_for_many_files";
    const FILES: usize = 200;
    match std::env::var(ROLE).as_deref() {
        Ok("gpu") => {
            let ctx = gpudirect::cuda::context(0).unwrap_or_else(|e| {
                panic!("needs a CUDA GPU: run on the GPU machine with `.device/run --include-ignored gpu_fallback`: {e}")
            });
            let stream = ctx.default_stream();
            let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(std::env::temp_dir)
                .join(format!("gpudirect-fallback-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
            for i in 0..FILES {
                let data: Vec<u8> = (0..4096 + i)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        seed as u8
                    })
                    .collect();
                let p = dir.join(format!("f{i}"));
                std::fs::write(&p, &data).unwrap();
                let f = gpudirect::storage::GpuFile::open(&p).unwrap();
                let mut dst = stream.alloc_zeros::<u8>(data.len()).unwrap();
                let r = f.read_to_device(&mut dst, 0).unwrap();
                assert_eq!(r.bytes, data.len());
                assert_eq!(stream.clone_dtoh(&dst).unwrap(), data, "file {i}");
                let kind = match &r.path.cause {
                    None => "direct".to_string(),
                    Some(c) => format!("{:?}/{}", std::mem::discriminant(&r.path.path), kind_of(c)),
                };
                println!("\nreport-kind={kind}");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
        Ok(other) => panic!("unknown child role {other}"),
        Err(_) => {
            let out = child(name, "gpu", &[]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            let kinds: Vec<&str> = stdout
                .lines()
                .filter_map(|l| l.strip_prefix("report-kind="))
                .collect();
            assert_eq!(kinds.len(), FILES, "{stdout}");
            let mut fallback_kinds: Vec<&str> =
                kinds.iter().copied().filter(|k| *k != "direct").collect();
            fallback_kinds.sort_unstable();
            fallback_kinds.dedup();
            let lines = warning_lines(&out);
            println!("fallback kinds: {fallback_kinds:?}; warnings: {lines:#?}");
            assert_eq!(lines.len(), fallback_kinds.len(), "{lines:#?}");
        }
    }
}

/// The variant name of a cause (its Debug text up to the first brace or space).
fn kind_of(c: &Cause) -> String {
    let d = format!("{c:?}");
    d.split([' ', '{', '('])
        .next()
        .unwrap_or_default()
        .to_string()
}

//! Opening the cuFile driver: refused by gpudirect's own check when libcuda or a GPU is
//! missing (no call into `cuFileDriverOpen`, no `cufile.log` in the working directory, no
//! hang); opened on a GPU machine from a second thread, so without touching the environment
//! (`set_var` with other threads running is undefined behaviour): a log target only the
//! environment can reach (`LogTarget::Dir`) is refused before anything reaches cuFile, and with
//! the default target cuFile logs (at level INFO, so that it certainly writes at open) where it
//! does by itself — `CUFILE_LOGFILE_PATH`, its `cufile.json` log directory, or `cufile.log` in
//! the working directory — and `Driver::log_file` names that very file.
//!
//! The only test in this binary, because it changes the process's working directory.
//! Expectations: `GPUDIRECT_EXPECT_CUFILE` (absent|present) and `GPUDIRECT_EXPECT_CUDA`
//! (absent|nodevice|present), both `absent` by default.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpudirect::ffi::cufile as sys;
use gpudirect::storage::cufile::{Driver, LogTarget};
use gpudirect::Error;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "absent".into())
}

#[test]
fn cufile_driver_open_is_gated_on_cuda() {
    let cufile = env("GPUDIRECT_EXPECT_CUFILE");
    let cuda = env("GPUDIRECT_EXPECT_CUDA");
    let base = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let cwd = base.join(format!("gpudirect-cufile-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&cwd).unwrap();
    std::env::set_current_dir(&cwd).unwrap();

    let env_before = std::env::var_os("CUFILE_LOGFILE_PATH");
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    let logs = cwd.join("logs");
    std::thread::spawn(move || {
        // With this thread and the test's running, a directory of our choosing is refused.
        let refused = Driver::builder().log(LogTarget::Dir(logs)).open().err();
        let _ = tx.send((
            refused,
            Driver::builder()
                .parameter_string(sys::CUFILE_PARAM_LOGGING_LEVEL, "INFO")
                .open()
                .map(|d| (d.version(), d.log_file().map(|p| p.to_path_buf()))),
        ));
    });
    let (refused, got) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("Driver::open did not return within 60 s (cuFile hang?)");
    let listing = |d: &std::path::Path| -> Vec<String> {
        std::fs::read_dir(d)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let stray = cwd.join("cufile.log");
    let elapsed = started.elapsed();

    match (cufile.as_str(), cuda.as_str()) {
        ("absent", _) => {
            assert!(
                matches!(
                    got,
                    Err(Error::LibraryUnavailable {
                        name: "libcufile.so.0",
                        ..
                    })
                ),
                "{got:?}"
            );
        }
        ("present", "absent") | ("present", "nodevice") => {
            match &got {
                Err(Error::LibraryUnavailable {
                    name: "libcuda.so.1",
                    ..
                }) if cuda == "absent" => {}
                Err(Error::NoDevice { .. }) if cuda == "nodevice" => {}
                other => panic!("expected gpudirect's own CUDA check to refuse, got {other:?}"),
            }
            let msg = got.as_ref().unwrap_err().to_string();
            assert!(
                msg.contains("install the NVIDIA driver") || msg.contains("no CUDA GPU"),
                "{msg}"
            );
            // Our check ran before cuFile's driver: its use count is still 0.
            let lib = sys::library().expect("libcufile loads");
            let count = lib.cuFileUseCount.expect("cuFileUseCount");
            // SAFETY: cuFileUseCount takes no arguments and reads a counter.
            assert_eq!(
                unsafe { count() },
                0,
                "cuFileDriverOpen must not have been called"
            );
            assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
        }
        ("present", "present") => {
            match &refused {
                Some(Error::Unsupported { cause, .. }) => {
                    let c = cause.to_string();
                    assert!(c.contains("CUFILE_LOGFILE_PATH"), "{c}");
                }
                other => panic!("LogTarget::Dir with threads running must be refused: {other:?}"),
            }
            let (version, log) = got.expect("Driver::open on a GPU machine");
            assert!(version >= 1150, "{version}");
            assert_eq!(
                std::env::var_os("CUFILE_LOGFILE_PATH"),
                env_before,
                "the driver changed the environment while other threads were running"
            );
            let log = log.expect("Driver::log_file names cuFile's log");
            eprintln!("cuFile's log: {}", log.display());
            if let Some(user) = &env_before {
                assert_eq!(log.as_os_str(), user.as_os_str());
            }
            let same = |a: &std::path::Path, b: &std::path::Path| {
                std::fs::canonicalize(a)
                    .ok()
                    .is_some_and(|a| Some(a) == std::fs::canonicalize(b).ok())
            };
            assert!(
                log.exists(),
                "cuFile wrote no log at {} (the place Driver::log_file reports); that directory \
                 holds {:?}, the working directory {:?}",
                log.display(),
                log.parent().map(listing).unwrap_or_default(),
                listing(&cwd)
            );
            let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
            eprintln!("{} bytes", len);
            // Any log in the working directory is the one reported: nothing is hidden.
            assert!(
                !stray.exists() || same(&log, &stray),
                "cuFile wrote {} but the driver reports {}",
                stray.display(),
                log.display()
            );
        }
        other => panic!("unknown expectation {other:?}"),
    }
    if cuda != "present" {
        assert!(
            !stray.exists(),
            "cuFile wrote {} into the working directory although its driver was never opened",
            stray.display()
        );
    }
    std::env::set_current_dir(&base).unwrap();
    let _ = std::fs::remove_dir_all(&cwd);
}

//! Opening the cuFile driver: refused by gpudirect's own check when libcuda or a GPU is
//! missing (no call into `cuFileDriverOpen`, no `cufile.log` in the working directory, no
//! hang); opened, with the log directed away from the working directory, on a GPU machine —
//! from a second thread, so without touching the environment (`set_var` with other threads
//! running is undefined behaviour): the log goes through cuFile's log directory parameter, at
//! level INFO so that cuFile certainly writes it at open.
//!
//! The only test in this binary, because it changes the process's working directory.
//! Expectations: `GPUDIRECT_EXPECT_CUFILE` (absent|present) and `GPUDIRECT_EXPECT_CUDA`
//! (absent|nodevice|present), both `absent` by default.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpudirect::ffi::cufile as sys;
use gpudirect::storage::cufile::Driver;
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
    std::thread::spawn(move || {
        let _ = tx.send(
            Driver::builder()
                .parameter_string(sys::CUFILE_PARAM_LOGGING_LEVEL, "INFO")
                .open()
                .map(|d| (d.version(), d.log_file().map(|p| p.to_path_buf()))),
        );
    });
    let got = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("Driver::open did not return within 60 s (cuFile hang?)");
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
            let (version, log) = got.expect("Driver::open on a GPU machine");
            assert!(version >= 1150, "{version}");
            assert_eq!(
                std::env::var_os("CUFILE_LOGFILE_PATH"),
                env_before,
                "the driver changed the environment while other threads were running"
            );
            let log = log.expect("gpudirect directs cuFile's log");
            eprintln!("cuFile's log: {}", log.display());
            if env_before.is_none() {
                assert!(log.starts_with(std::env::temp_dir()), "{}", log.display());
                assert!(!log.starts_with(&cwd), "{}", log.display());
                let listing = |d: &std::path::Path| -> Vec<String> {
                    std::fs::read_dir(d)
                        .map(|r| {
                            r.filter_map(|e| e.ok())
                                .map(|e| e.file_name().to_string_lossy().into_owned())
                                .collect()
                        })
                        .unwrap_or_default()
                };
                let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
                assert!(
                    len > 0,
                    "cuFile wrote no INFO log at {} (CUFILE_PARAM_LOG_DIR not honoured, or another \
                     file name?); that directory holds {:?}, the working directory {:?}",
                    log.display(),
                    log.parent().map(listing).unwrap_or_default(),
                    listing(&cwd)
                );
            }
        }
        other => panic!("unknown expectation {other:?}"),
    }
    let stray = cwd.join("cufile.log");
    assert!(
        !stray.exists(),
        "cuFile wrote {} into the working directory",
        stray.display()
    );
    std::env::set_current_dir(&base).unwrap();
    let _ = std::fs::remove_dir_all(&cwd);
}

//! Tier-1 tests of the verbs layer on the real libibverbs (or its absence).
//!
//! `GPUDIRECT_EXPECT_VERBS` says what this machine has, and the test asserts it:
//! - `absent`: libibverbs.so.1 is not installed → `LibraryUnavailable` naming what was tried;
//! - `enosys`: libibverbs loads but the kernel has no RDMA subsystem (our dev/CI machines) →
//!   `NoRdmaSubsystem`;
//! - `nodevice`: RDMA subsystem without devices → `NoDevice`;
//! - `present`: at least one RDMA device.
//!
//! Unset, the expectation is derived from the machine without going through gpudirect's loader
//! (is `libibverbs.so.1` known to the dynamic linker? does `/sys/class/infiniband` list
//! devices?), because several people share the development machine; CI sets it explicitly.

use gpudirect::rdma::{self, Verbs};
use gpudirect::Error;

fn libibverbs_installed() -> bool {
    let out = std::process::Command::new("/sbin/ldconfig")
        .arg("-p")
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).contains("libibverbs.so.1 "),
        Err(_) => [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
        ]
        .iter()
        .any(|d| std::path::Path::new(d).join("libibverbs.so.1").exists()),
    }
}

fn expectation() -> String {
    if let Ok(v) = std::env::var("GPUDIRECT_EXPECT_VERBS") {
        return v;
    }
    if !libibverbs_installed() {
        return "absent".into();
    }
    match std::fs::read_dir("/sys/class/infiniband") {
        Ok(d) => {
            if d.count() > 0 {
                "present".into()
            } else {
                "nodevice".into()
            }
        }
        Err(_) => "enosys".into(),
    }
}

#[test]
fn verbs_devices_match_expectation() {
    let expect = expectation();
    let r = rdma::devices();
    match expect.as_str() {
        "absent" => match r {
            Err(Error::LibraryUnavailable { name, tried, .. }) => {
                assert_eq!(name, "libibverbs.so.1");
                assert!(
                    tried.iter().any(|t| t.starts_with("libibverbs.so.1")),
                    "{tried:?}"
                );
            }
            other => {
                panic!("expected LibraryUnavailable (GPUDIRECT_EXPECT_VERBS=absent), got {other:?}")
            }
        },
        "enosys" => match r {
            Err(e @ Error::NoRdmaSubsystem { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("no RDMA subsystem"), "{msg}");
                assert!(msg.contains("rdma_rxe"), "{msg}");
                assert!(e.is_absence());
                // The library itself loaded.
                let v = Verbs::get().expect("libibverbs loads when ENOSYS is expected");
                assert!(v.path().contains("libibverbs"), "{}", v.path());
            }
            other => {
                panic!("expected NoRdmaSubsystem (GPUDIRECT_EXPECT_VERBS=enosys), got {other:?}")
            }
        },
        "nodevice" => match r {
            Err(Error::NoDevice { what, .. }) => assert_eq!(what, "RDMA device"),
            other => panic!("expected NoDevice (GPUDIRECT_EXPECT_VERBS=nodevice), got {other:?}"),
        },
        "present" => {
            let d = r.expect("GPUDIRECT_EXPECT_VERBS=present but devices() failed");
            assert!(!d.is_empty());
            assert!(d.iter().all(|d| !d.name.is_empty()));
        }
        other => panic!("GPUDIRECT_EXPECT_VERBS={other}: use absent, enosys, nodevice or present"),
    }
}

#[test]
fn verbs_opening_a_device_fails_the_same_typed_way() {
    match expectation().as_str() {
        "absent" => assert!(matches!(
            rdma::Context::open_first(),
            Err(Error::LibraryUnavailable { .. })
        )),
        "enosys" => assert!(matches!(
            rdma::Context::open("rxe0"),
            Err(Error::NoRdmaSubsystem { .. })
        )),
        "nodevice" => assert!(matches!(
            rdma::Context::open_first(),
            Err(Error::NoDevice { .. })
        )),
        _ => {
            let e = rdma::Context::open("no-such-rdma-device-xyz").unwrap_err();
            assert!(matches!(e, Error::NoDevice { .. }), "{e:?}");
        }
    }
}

#[test]
fn verbs_load_from_a_bogus_path_is_library_unavailable() {
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let bogus = dir.join("gpudirect-no-such-dir/libibverbs.so.1");
    // SAFETY: the path does not exist, so nothing is loaded.
    let e = unsafe { Verbs::load_from(&bogus) }.unwrap_err();
    match &e {
        Error::LibraryUnavailable { name, tried, hint } => {
            assert_eq!(*name, "libibverbs.so.1");
            assert_eq!(tried.len(), 1);
            assert!(tried[0].contains("gpudirect-no-such-dir"), "{tried:?}");
            assert!(hint.contains("apt-get install libibverbs1"), "{hint}");
        }
        other => panic!("expected LibraryUnavailable, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.starts_with("libibverbs.so.1 is not available (tried "),
        "{msg}"
    );
}

#[test]
fn verbs_sys_loader_resolves_symbols_when_the_library_is_installed() {
    use gpudirect::ffi::ibverbs::{Ibverbs, Rdmacm};
    match expectation().as_str() {
        "absent" => {
            let e = Ibverbs::get().unwrap_err();
            assert_eq!(e.library, "libibverbs.so.1");
        }
        _ => {
            let lib = Ibverbs::get().expect("libibverbs.so.1 loads");
            // Present since rdma-core 1.x / 34 / 32: the calls gpudirect needs.
            assert!(lib.ibv_get_device_list.is_some());
            assert!(lib.ibv_reg_mr.is_some());
            assert!(lib.ibv_reg_mr_iova2.is_some());
            assert!(
                lib.ibv_reg_dmabuf_mr.is_some(),
                "rdma-core >= 34 exports ibv_reg_dmabuf_mr"
            );
            assert!(lib._ibv_query_gid_ex.is_some());
            assert!(lib._ibv_query_gid_table.is_some());
            // The static-inline equivalents dispatch on a loaded table; ibv_query_port's compat
            // fallback symbol is exported too.
            assert!(lib.ibv_query_port.is_some());
            if let Ok(cm) = Rdmacm::get() {
                assert!(cm.rdma_create_event_channel.is_some());
                assert!(cm.rdma_get_cm_event.is_some());
            }
        }
    }
}

#[test]
fn verbs_rdma_cm_event_channel_fails_the_same_typed_way() {
    let r = rdma::cm::EventChannel::new();
    match expectation().as_str() {
        "absent" => match r {
            Err(Error::LibraryUnavailable { name, .. }) => {
                assert!(
                    name == "librdmacm.so.1" || name == "libibverbs.so.1",
                    "{name}"
                )
            }
            other => panic!("expected LibraryUnavailable, got {other:?}"),
        },
        "enosys" => assert!(
            matches!(r, Err(Error::NoRdmaSubsystem { .. })),
            "expected NoRdmaSubsystem, got {r:?}"
        ),
        "nodevice" => assert!(matches!(r, Err(Error::NoDevice { .. })), "{r:?}"),
        _ => {
            r.expect("rdma_create_event_channel with an RDMA device present");
        }
    }
}

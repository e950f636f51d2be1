//! libcufile's loader against the real library (or its real absence).
//!
//! `GPUDIRECT_EXPECT_CUFILE=absent|present` (default `absent`: a fresh machine has no
//! libcufile); with `present`, `GPUDIRECT_CUFILE_LIB` names the library (`.ci/run` installs the
//! `nvidia-cufile==1.15.1.6` wheel with `scripts/fetch-cufile-wheel`) and
//! `GPUDIRECT_EXPECT_CUFILE_VERSION` (default 1150) the version `cuFileGetVersion` must answer.

use gpudirect::ffi::cufile as sys;
use gpudirect::storage::cufile::{self, Driver};
use gpudirect::Error;

fn expect() -> String {
    std::env::var("GPUDIRECT_EXPECT_CUFILE").unwrap_or_else(|_| "absent".into())
}

#[test]
fn cufile_library_matches_expectation() {
    // In the same process as whatever `library()` found: an explicit absent path is an error
    // that names the path and the loader's reason.
    let missing =
        sys::Library::load_from("/nonexistent/gpudirect-test/libcufile.so.0").unwrap_err();
    assert_eq!(missing.tried.len(), 1);
    assert_eq!(
        missing.tried[0].0,
        "/nonexistent/gpudirect-test/libcufile.so.0"
    );
    assert!(missing.tried[0].1.contains("No such file"), "{missing}");

    match expect().as_str() {
        "absent" => {
            let err = sys::library().unwrap_err();
            assert!(
                err.tried.iter().any(|(name, _)| name == sys::LIBRARY_NAME),
                "the default soname must be tried: {err}"
            );
            if let Some(p) = std::env::var_os(sys::LIBRARY_ENV) {
                let p = p.to_string_lossy().into_owned();
                assert_eq!(
                    err.tried[0].0,
                    p,
                    "{} must be tried first",
                    sys::LIBRARY_ENV
                );
            }
            match cufile::library_version() {
                Err(Error::LibraryUnavailable { name, tried, hint }) => {
                    assert_eq!(name, "libcufile.so.0");
                    assert!(
                        tried.iter().any(|t| t.starts_with("libcufile.so.0 (")),
                        "{tried:?}"
                    );
                    assert!(hint.contains("GPUDIRECT_CUFILE_LIB"), "{hint}");
                }
                other => panic!("expected LibraryUnavailable, got {other:?}"),
            }
            let msg = Driver::open().unwrap_err().to_string();
            assert!(
                msg.starts_with("libcufile.so.0 is not available (tried "),
                "{msg}"
            );
        }
        "present" => {
            let lib = sys::library().unwrap_or_else(|e| {
                panic!("GPUDIRECT_EXPECT_CUFILE=present but libcufile did not load: {e}")
            });
            if let Some(p) = std::env::var_os(sys::LIBRARY_ENV) {
                assert_eq!(lib.path(), std::path::Path::new(&p));
            }
            // A 1.15 library exports every symbol of its header; newer ones are optional.
            let missing = lib.missing_symbols();
            for m in &missing {
                assert!(
                    matches!(
                        *m,
                        "cuFileReadv"
                            | "cuFileWritev"
                            | "cuFileDriverGetP2PFlags"
                            | "cuFileDriverSetP2PFlags"
                    ),
                    "libcufile lacks {m} (all missing: {missing:?})"
                );
            }
            let want: i32 = std::env::var("GPUDIRECT_EXPECT_CUFILE_VERSION")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1150);
            let v = cufile::library_version().expect("cuFileGetVersion");
            assert_eq!(v, want, "cuFileGetVersion answered {v}");
            // The loaded library and an absent one coexist in this process.
            assert!(sys::Library::load_from("/nonexistent/libcufile.so.0").is_err());
            let again =
                sys::Library::load_from(lib.path()).expect("loading the same library twice");
            assert!(again.cuFileGetVersion.is_some());
        }
        other => panic!("GPUDIRECT_EXPECT_CUFILE must be absent|present, not {other}"),
    }
}

#[test]
fn cufile_status_errors_read_well() {
    let e = Error::CuFile {
        op: "cuFileHandleRegister",
        source: gpudirect::storage::CuFileStatus::for_version(5030, 1150),
    };
    assert_eq!(
        e.to_string(),
        "cuFileHandleRegister failed: cuFile CU_FILE_INTERNAL_ERROR (5030): internal cuFile error; \
         fix: read cufile.log (see CUFILE_LOGFILE_PATH); in a container, bind-mount the host's /run/udev"
    );
    let src = std::error::Error::source(&e).expect("the raw status is the source");
    assert!(src.to_string().contains("5030"));
}

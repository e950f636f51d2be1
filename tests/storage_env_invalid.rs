//! An unparsable `GPUDIRECT_*` value is a typed error naming the variable and the accepted
//! values, for every open, until the program replaces the environment's settings; fixing the
//! variable later has no effect (the environment is read once per process). One test: the
//! environment is process-wide.

use gpudirect::storage::{Backend, GpuFile, StorageConfig};
use gpudirect::{Error, FallbackPolicy};

#[test]
fn unparsable_environment_is_a_typed_error_for_every_open() {
    std::env::set_var("GPUDIRECT_SEGMENTS", "100");
    std::env::set_var("GPUDIRECT_FALLBACK", "dney");
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let p = dir.join(format!("gpudirect-env-invalid-{}.bin", std::process::id()));
    std::fs::write(&p, b"0123456789").unwrap();

    let named = |r: gpudirect::Result<GpuFile>, var: &str, accepted: &str| match r {
        Err(e @ Error::InvalidEnvironment { variable, .. }) => {
            assert_eq!(variable, var);
            let m = e.to_string();
            assert!(m.contains(accepted), "{m}");
        }
        other => panic!("{var}: {other:?}"),
    };
    named(GpuFile::open(&p), "GPUDIRECT_SEGMENTS", "2 to 64");
    named(
        GpuFile::options().threads(4).open(&p),
        "GPUDIRECT_SEGMENTS",
        "2 to 64",
    );
    assert!(matches!(
        StorageConfig::from_env(),
        Err(Error::InvalidEnvironment {
            variable: "GPUDIRECT_SEGMENTS",
            ..
        })
    ));
    // Fixing the variable later changes nothing: the environment was read once.
    std::env::set_var("GPUDIRECT_SEGMENTS", "4");
    named(GpuFile::open(&p), "GPUDIRECT_SEGMENTS", "2 to 64");

    // Explicit storage settings bypass the storage variables; the fallback policy still comes
    // from the environment, and its typo is refused, not read as "warn".
    let explicit = || {
        GpuFile::options()
            .config(StorageConfig::default())
            .backend(Backend::Engine)
    };
    named(
        explicit().open(&p),
        "GPUDIRECT_FALLBACK",
        "allow, warn or deny",
    );
    match FallbackPolicy::global() {
        Err(Error::InvalidEnvironment { variable, .. }) => {
            assert_eq!(variable, "GPUDIRECT_FALLBACK")
        }
        other => panic!("{other:?}"),
    }
    let f = explicit().fallback(FallbackPolicy::Allow).open(&p).unwrap();
    let mut b = [0u8; 10];
    assert_eq!(f.pread_host(&mut b, 0).unwrap().bytes, 10);
    assert_eq!(&b, b"0123456789");
    // A policy set by the program wins over the environment.
    FallbackPolicy::set_global(FallbackPolicy::Deny);
    assert_eq!(FallbackPolicy::global().unwrap(), FallbackPolicy::Deny);
    explicit().open(&p).unwrap();
    std::fs::remove_file(&p).unwrap();
}

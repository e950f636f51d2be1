//! `GPUDIRECT_*` storage settings from the environment (one test: the environment is
//! process-wide).

use gpudirect::storage::{Backend, CompatMode, GpuFile, ODirect, Pipeline, StorageConfig};
use gpudirect::{Cause, Error, Path};

#[test]
fn environment_sets_mode_and_engine_knobs_and_rejects_garbage() {
    let vars = [
        "GPUDIRECT_COMPAT_MODE",
        "GPUDIRECT_NTHREADS",
        "GPUDIRECT_TASK_SIZE",
        "GPUDIRECT_BOUNCE_SIZE",
        "GPUDIRECT_ODIRECT",
        "GPUDIRECT_ODIRECT_READ",
        "GPUDIRECT_ODIRECT_WRITE",
        "GPUDIRECT_NUMA_PIN",
        "GPUDIRECT_PIPELINE",
        "GPUDIRECT_SEGMENT_SIZE",
        "GPUDIRECT_SEGMENTS",
        "GPUDIRECT_COPY_STREAMS",
    ];
    for v in vars {
        std::env::remove_var(v);
    }
    let d = StorageConfig::from_env().unwrap();
    assert_eq!(d, StorageConfig::default());
    assert_eq!((d.task_size, d.bounce_size), (4 << 20, 2 << 20));
    assert_eq!(
        (d.pipeline, d.segment_size, d.segments, d.copy_streams),
        (Pipeline::Segments, 32 << 20, 4, 1)
    );
    std::env::set_var("GPUDIRECT_PIPELINE", "lanes");
    std::env::set_var("GPUDIRECT_SEGMENT_SIZE", "16M");
    std::env::set_var("GPUDIRECT_SEGMENTS", "8");
    std::env::set_var("GPUDIRECT_COPY_STREAMS", "2");
    let c = StorageConfig::from_env().unwrap();
    assert_eq!(
        (c.pipeline, c.segment_size, c.segments, c.copy_streams),
        (Pipeline::Lanes, 16 << 20, 8, 2)
    );
    for (v, bad) in [
        ("GPUDIRECT_PIPELINE", "fast"),
        ("GPUDIRECT_SEGMENTS", "1"),
        ("GPUDIRECT_COPY_STREAMS", "0"),
        ("GPUDIRECT_SEGMENT_SIZE", "huge"),
    ] {
        let keep = std::env::var(v).unwrap();
        std::env::set_var(v, bad);
        match StorageConfig::from_env() {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(v), "{m}"),
            other => panic!("{v}={bad}: {other:?}"),
        }
        std::env::set_var(v, keep);
    }
    for v in &vars[8..] {
        std::env::remove_var(v);
    }

    std::env::set_var("GPUDIRECT_COMPAT_MODE", "on");
    std::env::set_var("GPUDIRECT_NTHREADS", "12");
    std::env::set_var("GPUDIRECT_TASK_SIZE", "8M");
    std::env::set_var("GPUDIRECT_BOUNCE_SIZE", "1000");
    std::env::set_var("GPUDIRECT_ODIRECT", "off");
    std::env::set_var("GPUDIRECT_ODIRECT_WRITE", "on");
    std::env::set_var("GPUDIRECT_NUMA_PIN", "0");
    let c = StorageConfig::from_env().unwrap();
    assert_eq!(c.compat_mode, CompatMode::On);
    assert_eq!(c.threads, Some(12));
    assert_eq!(c.task_size, 8 << 20);
    assert_eq!(c.bounce_size, 4096, "rounded up to 4 KiB");
    assert_eq!(
        (c.odirect_read, c.odirect_write),
        (ODirect::Off, ODirect::On)
    );
    assert!(!c.numa_pin);

    // Mode ON: the engine, with the variable named as the cause.
    let dir = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let p = dir.join(format!("gpudirect-config-{}.bin", std::process::id()));
    std::fs::write(&p, b"0123456789").unwrap();
    let f = GpuFile::open(&p).unwrap();
    assert_eq!(f.path_report().path, Path::Posix);
    match &f.path_report().cause {
        Some(Cause::ForcedByConfig { setting }) => {
            assert!(setting.contains("GPUDIRECT_COMPAT_MODE"), "{setting}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(f.config().threads, Some(12));
    let mut b = [0u8; 10];
    assert_eq!(f.pread_host(&mut b, 0).unwrap().bytes, 10);
    assert_eq!(&b, b"0123456789");
    // Mode OFF without a usable cuFile: open fails, naming the cause.
    std::env::set_var("GPUDIRECT_COMPAT_MODE", "off");
    match GpuFile::open(&p) {
        Err(Error::Unsupported { what, .. }) => {
            assert!(what.contains("GPUDIRECT_COMPAT_MODE=off"), "{what}")
        }
        Ok(f) if std::env::var("GPUDIRECT_EXPECT_CUDA").is_ok_and(|v| v == "present") => {
            assert!(f.uses_cufile())
        }
        other => panic!("mode OFF without cuFile: {other:?}"),
    }
    // The API overrides the environment.
    let f = GpuFile::options()
        .backend(Backend::Engine)
        .compat_mode(CompatMode::Auto)
        .threads(3)
        .open(&p)
        .unwrap();
    assert_eq!(f.config().threads, Some(3));

    // Garbage is an error naming the variable.
    for (var, val) in [
        ("GPUDIRECT_COMPAT_MODE", "sometimes"),
        ("GPUDIRECT_NTHREADS", "0"),
        ("GPUDIRECT_NTHREADS", "many"),
        ("GPUDIRECT_TASK_SIZE", "4Q"),
        ("GPUDIRECT_ODIRECT", "maybe"),
        ("GPUDIRECT_NUMA_PIN", "2"),
    ] {
        std::env::set_var(var, val);
        match StorageConfig::from_env() {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(var), "{m}"),
            other => panic!("{var}={val}: {other:?}"),
        }
        assert!(matches!(GpuFile::open(&p), Err(Error::InvalidArgument(_))));
        std::env::remove_var(var);
    }
    for v in vars {
        std::env::remove_var(v);
    }
    std::fs::remove_file(&p).unwrap();
}

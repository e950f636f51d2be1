//! `GPUDIRECT_*` storage settings from the environment, read once per process, and the builder
//! checked by the same rules. One test per file: the environment is process-wide, and the
//! variables are set before gpudirect's first look at it (no other thread exists yet).

mod common;

use gpudirect::storage::{Backend, CompatMode, GpuFile, StorageConfig};
use gpudirect::{Cause, Error, TransferPath};

use common::scratch;

#[test]
fn environment_is_read_once_and_the_builder_is_checked_like_it() {
    std::env::set_var("GPUDIRECT_COMPAT_MODE", "on");
    std::env::set_var("GPUDIRECT_NTHREADS", "12");
    std::env::set_var("GPUDIRECT_BOUNCE_SIZE", "1000");
    let c = StorageConfig::from_env().unwrap();
    assert_eq!(c.compat_mode, CompatMode::PosixOnly);
    assert_eq!(c.threads, Some(12));
    assert_eq!(c.bounce_size, 4096, "rounded up to 4 KiB");

    // GPUDIRECT_COMPAT_MODE=on (PosixOnly): the engine, with the variable named as the cause.
    let p = scratch("env");
    std::fs::write(&p, b"0123456789").unwrap();
    let check_forced = |f: &GpuFile| {
        assert_eq!(f.path_report().path, TransferPath::Posix);
        match &f.path_report().cause {
            Some(Cause::ForcedByConfig { setting }) => {
                assert_eq!(setting, "GPUDIRECT_COMPAT_MODE=on")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.config().threads, Some(12));
    };
    let f = GpuFile::open(&p).unwrap();
    check_forced(&f);
    let mut b = [0u8; 10];
    assert_eq!(f.pread_host(&mut b, 0).unwrap().bytes, 10);
    assert_eq!(&b, b"0123456789");

    // Read once: later changes, even garbage, have no effect.
    std::env::set_var("GPUDIRECT_COMPAT_MODE", "sometimes");
    std::env::set_var("GPUDIRECT_NTHREADS", "many");
    check_forced(&GpuFile::open(&p).unwrap());
    assert_eq!(StorageConfig::from_env().unwrap(), c);

    // The API overrides the environment.
    let f = GpuFile::options()
        .backend(Backend::Engine)
        .compat_mode(CompatMode::Auto)
        .threads(3)
        .open(&p)
        .unwrap();
    assert_eq!(f.config().threads, Some(3));
    // A whole config replaces the environment's.
    let f = GpuFile::options()
        .config(StorageConfig::default())
        .backend(Backend::Engine)
        .open(&p)
        .unwrap();
    assert_eq!(f.config(), &StorageConfig::default());

    // CuFileRequired (mode OFF) without a usable cuFile: open fails, naming the setting.
    match GpuFile::options()
        .compat_mode(CompatMode::CuFileRequired)
        .open(&p)
    {
        Err(Error::Unsupported { what, .. }) => {
            assert!(what.contains("GpuFileOptions::compat_mode"), "{what}")
        }
        Ok(f) if std::env::var("GPUDIRECT_EXPECT_CUDA").is_ok_and(|v| v == "present") => {
            assert!(f.uses_cufile())
        }
        other => panic!("CuFileRequired without cuFile: {other:?}"),
    }

    // The builder is checked by the environment's ranges: an error naming the setter, never a
    // clamp, and nothing created.
    let fresh = scratch("env-fresh");
    for (opts, setter) in [
        (GpuFile::options().segments(100), "segments"),
        (GpuFile::options().segments(1), "segments"),
        (GpuFile::options().copy_streams(0), "copy_streams"),
        (GpuFile::options().copy_streams(17), "copy_streams"),
        (GpuFile::options().threads(0), "threads"),
        (GpuFile::options().task_size(usize::MAX), "task_size"),
        (GpuFile::options().bounce_size(0), "bounce_size"),
        (GpuFile::options().bounce_size(usize::MAX), "bounce_size"),
        (GpuFile::options().segment_size(2 << 30), "segment_size"),
        (GpuFile::options().segment_size(usize::MAX), "segment_size"),
    ] {
        match opts.create(true).open(&fresh) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(setter), "{setter}: {m}"),
            other => panic!("{setter}: {other:?}"),
        }
        assert!(!fresh.exists(), "{setter}: a refused open created the file");
    }
    std::fs::remove_file(&p).unwrap();
}

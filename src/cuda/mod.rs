//! The one audited door to CUDA: checks that libcuda and a device exist before any cudarc call
//! (cudarc panics when libcuda or a symbol is missing), and turns absence into typed errors.
//!
//! Every other module reaches cudarc's `sys`/`result` layer only after [`driver_version`] or
//! [`context`] succeeded in this process.

pub(crate) mod result;

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};

/// The lowest driver API version gpudirect calls into (CUDA 12.0: `cuMemGetHandleForAddressRange`,
/// pools, `cuDeviceGetP2PAttribute` all present).
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// What probing libcuda found, cached for the process.
#[derive(Debug, Clone)]
enum Probe {
    Ready { version: i32 },
    Missing { tried: Vec<String> },
    TooOld { version: i32 },
    InitFailed { code: sys::CUresult },
}

fn probe() -> &'static Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(|| {
        if !result::driver::is_present() {
            let mut tried: Vec<String> = Vec::new();
            for name in cudarc::get_lib_name_candidates("cuda") {
                if !tried.contains(&name) {
                    tried.push(name);
                }
            }
            return Probe::Missing { tried };
        }
        // libcuda is loadable, so cudarc's own loader will not panic. cuDriverGetVersion has
        // existed since CUDA 2.2, cuInit since 2.0.
        let version = match result::driver::version() {
            Ok(v) => v,
            Err(code) => return Probe::InitFailed { code },
        };
        if version < MIN_DRIVER_VERSION {
            return Probe::TooOld { version };
        }
        match result::driver::init() {
            Ok(()) => Probe::Ready { version },
            Err(code) => Probe::InitFailed { code },
        }
    })
}

/// The CUDA driver API version (`cuDriverGetVersion`, e.g. 13000 for CUDA 13.0), after checking
/// that libcuda loads and `cuInit` succeeds.
///
/// Errors: [`Error::LibraryUnavailable`] without libcuda, [`Error::NoDevice`] when the driver
/// finds no GPU, [`Error::Unsupported`] for a driver older than [`MIN_DRIVER_VERSION`].
pub fn driver_version() -> Result<i32> {
    match probe() {
        Probe::Ready { version } => Ok(*version),
        Probe::Missing { tried } => Err(Error::LibraryUnavailable {
            name: "libcuda.so.1",
            tried: tried.clone(),
            hint: "install the NVIDIA driver (libcuda ships with it) or add its directory to LD_LIBRARY_PATH".into(),
        }),
        Probe::TooOld { version } => Err(Error::Unsupported {
            what: "this CUDA driver".into(),
            cause: crate::Cause::Other {
                message: format!(
                    "driver API {}.{} is older than the {}.{} gpudirect needs",
                    version / 1000,
                    version % 1000 / 10,
                    MIN_DRIVER_VERSION / 1000,
                    MIN_DRIVER_VERSION % 1000 / 10
                ),
                fix: "update the NVIDIA driver".into(),
            },
        }),
        Probe::InitFailed { code } => {
            if *code == sys::CUresult::CUDA_ERROR_NO_DEVICE {
                Err(Error::NoDevice {
                    what: "CUDA GPU".into(),
                    detail: "cuInit found no device: check nvidia-smi and CUDA_VISIBLE_DEVICES".into(),
                })
            } else {
                Err(Error::cuda("cuInit", cudarc::driver::DriverError(*code)))
            }
        }
    }
}

/// Number of CUDA devices visible to this process (0 is an error: [`Error::NoDevice`]).
pub fn device_count() -> Result<usize> {
    driver_version()?;
    let n = result::device::count()?;
    if n <= 0 {
        return Err(Error::NoDevice {
            what: "CUDA GPU".into(),
            detail: "cuDeviceGetCount returned 0: check nvidia-smi and CUDA_VISIBLE_DEVICES".into(),
        });
    }
    Ok(n as usize)
}

/// Checks that `ordinal` names an existing device.
pub fn check_ordinal(ordinal: usize) -> Result<()> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: format!("CUDA GPU with ordinal {ordinal}"),
            detail: format!("this process sees {n} device(s), ordinals 0..{}", n - 1),
        });
    }
    Ok(())
}

/// cudarc's `CudaContext::new(ordinal)` (the device's primary context), behind the checks above:
/// never panics for a missing library or device.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    check_ordinal(ordinal)?;
    CudaContext::new(ordinal).map_err(|e| Error::cuda("cuDevicePrimaryCtxRetain", e))
}

/// Reads a device attribute (`cuDeviceGetAttribute`).
pub fn device_attribute(ordinal: usize, attr: sys::CUdevice_attribute) -> Result<i32> {
    check_ordinal(ordinal)?;
    result::device::attribute(result::device::get(ordinal)?, attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What this machine is told to have: `GPUDIRECT_EXPECT_CUDA=absent|present|nodevice`
    /// (absent by default: CI and the dev machine have no NVIDIA driver).
    #[test]
    fn probe_matches_expectation() {
        let expect = std::env::var("GPUDIRECT_EXPECT_CUDA").unwrap_or_else(|_| "absent".into());
        let got = driver_version();
        match expect.as_str() {
            "absent" => match got {
                Err(Error::LibraryUnavailable { name, tried, .. }) => {
                    assert_eq!(name, "libcuda.so.1");
                    assert!(tried.iter().any(|t| t.contains("libcuda.so")), "{tried:?}");
                    // No panic on the ordinal paths either.
                    assert!(matches!(context(0), Err(Error::LibraryUnavailable { .. })));
                    let msg = driver_version().unwrap_err().to_string();
                    assert!(msg.contains("install the NVIDIA driver"), "{msg}");
                }
                other => panic!(
                    "expected LibraryUnavailable (GPUDIRECT_EXPECT_CUDA=absent), got {other:?}"
                ),
            },
            "nodevice" => assert!(matches!(got, Err(Error::NoDevice { .. })), "{got:?}"),
            "present" => {
                let v = got.expect("GPUDIRECT_EXPECT_CUDA=present but the driver probe failed");
                assert!(v >= MIN_DRIVER_VERSION);
                let n = device_count().unwrap();
                assert!(matches!(check_ordinal(n), Err(Error::NoDevice { .. })));
            }
            other => panic!("GPUDIRECT_EXPECT_CUDA must be absent|present|nodevice, not {other}"),
        }
    }
}

//! The RDMA device list (`ibv_get_device_list`) and the loaded libibverbs ([`Verbs`]).

use std::ffi::CStr;
use std::ptr::NonNull;

use ibverbs_gdr_sys as sys;
use sys::Ibverbs;

use super::result;
use crate::error::{Error, Result};

/// A loaded libibverbs: the process-wide one ([`Verbs::get`]) or one opened from an explicit
/// path ([`Verbs::load_from`]). Cheap to copy.
#[derive(Debug, Clone, Copy)]
pub struct Verbs {
    lib: &'static Ibverbs,
}

impl Verbs {
    /// The process-wide libibverbs (`GPUDIRECT_IBVERBS_LIB`, then `libibverbs.so.1`), opened on
    /// first use. [`Error::LibraryUnavailable`] names every path tried.
    pub fn get() -> Result<Verbs> {
        Ok(Verbs {
            lib: result::ibverbs()?,
        })
    }

    /// Opens libibverbs from `path`, independently of the process-wide instance. The library
    /// stays loaded for the life of the process (rdma-core providers cannot be unloaded safely).
    ///
    /// # Safety
    ///
    /// `path` must be rdma-core's libibverbs (or not loadable at all): its initialisers run and
    /// its symbols are called with the types of rdma-core 44's headers.
    pub unsafe fn load_from(path: impl AsRef<std::path::Path>) -> Result<Verbs> {
        // SAFETY: forwarded from the caller.
        let lib = unsafe { Ibverbs::load_from(path.as_ref().as_os_str()) }
            .map_err(|e| result::unavailable(e, result::IBVERBS_HINT))?;
        Ok(Verbs {
            lib: Box::leak(Box::new(lib)),
        })
    }

    /// The name or path the library was opened from.
    pub fn path(&self) -> &str {
        self.lib.path()
    }

    pub(in crate::rdma) fn lib(&self) -> &'static Ibverbs {
        self.lib
    }

    /// The RDMA devices (`ibv_get_device_list`).
    ///
    /// Errors: [`Error::NoRdmaSubsystem`] when the kernel has no RDMA support (ENOSYS),
    /// [`Error::NoDevice`] when the list is empty, [`Error::Verbs`] for other errnos.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let list = DeviceList::get(self.lib)?;
        Ok(list
            .iter()
            // SAFETY: `d` is an entry of `list`, alive until the end of this statement.
            .map(|d| unsafe { DeviceInfo::from_raw(self.lib, d) })
            .collect())
    }
}

/// The RDMA devices of the process-wide libibverbs; see [`Verbs::devices`].
///
/// ```no_run
/// for d in gpudirect::rdma::devices()? {
///     println!("{} ({:?}, guid {:016x})", d.name, d.transport, d.guid);
/// }
/// # Ok::<(), gpudirect::Error>(())
/// ```
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Verbs::get()?.devices()
}

/// The hint for machines without devices.
pub(in crate::rdma) const NO_DEVICE_HINT: &str = "ibv_get_device_list found none: load the NIC's RDMA driver (e.g. mlx5_ib) or create a Soft-RoCE device (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0)";

/// An `ibv_get_device_list` result, freed on drop.
pub(in crate::rdma) struct DeviceList {
    lib: &'static Ibverbs,
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    pub(in crate::rdma) fn get(lib: &'static Ibverbs) -> Result<DeviceList> {
        // SAFETY: plain call; the list is freed in Drop.
        let (list, len) = unsafe { result::get_device_list(lib) }.map_err(|e| match e {
            Error::Verbs { source, .. } if source.raw_os_error() == Some(libc::ENOSYS) => {
                Error::NoRdmaSubsystem { source }
            }
            e => e,
        })?;
        let list = DeviceList { lib, list, len };
        if len == 0 {
            return Err(Error::NoDevice {
                what: "RDMA device".into(),
                detail: NO_DEVICE_HINT.into(),
            });
        }
        Ok(list)
    }

    pub(in crate::rdma) fn iter(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
        // SAFETY: the list holds `len` valid entries while it is alive.
        (0..self.len).map(move |i| unsafe { *self.list.as_ptr().add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { result::free_device_list(self.lib, self.list) }
    }
}

/// How a device moves data (`enum ibv_transport_type`); unknown values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum Transport {
    /// InfiniBand transport (InfiniBand and RoCE NICs, Soft-RoCE).
    Ib,
    /// iWARP (e.g. siw): QPs connect through rdma_cm only.
    Iwarp,
    /// Cisco usNIC.
    Usnic,
    /// Cisco usNIC over UDP.
    UsnicUdp,
    /// A generic device (EFA and others).
    Unspecified,
    /// A value this crate does not know.
    Other(i32),
}

impl From<i32> for Transport {
    fn from(v: i32) -> Self {
        match v {
            sys::IBV_TRANSPORT_IB => Transport::Ib,
            sys::IBV_TRANSPORT_IWARP => Transport::Iwarp,
            sys::IBV_TRANSPORT_USNIC => Transport::Usnic,
            sys::IBV_TRANSPORT_USNIC_UDP => Transport::UsnicUdp,
            sys::IBV_TRANSPORT_UNSPECIFIED => Transport::Unspecified,
            v => Transport::Other(v),
        }
    }
}

/// What `ibv_get_device_list` says about one device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// The device name, e.g. `mlx5_0` or `rxe0` (`ibv_get_device_name`).
    pub name: String,
    /// The node GUID in host byte order (`ibv_get_device_guid`); 0 when unknown.
    pub guid: u64,
    /// The transport.
    pub transport: Transport,
    /// The uverbs device, e.g. `/dev/infiniband/uverbs0`.
    pub dev_path: String,
    /// The sysfs directory, e.g. `/sys/class/infiniband/mlx5_0`.
    pub ibdev_path: String,
}

fn c_array(a: &[std::ffi::c_char]) -> String {
    // SAFETY: c_char and u8 have the same layout.
    let bytes = unsafe { std::slice::from_raw_parts(a.as_ptr().cast::<u8>(), a.len()) };
    CStr::from_bytes_until_nul(bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned())
}

impl DeviceInfo {
    /// # Safety
    ///
    /// `d` must be a live device: an entry of a device list that is not freed yet, or the
    /// device of an open context.
    pub(in crate::rdma) unsafe fn from_raw(
        lib: &'static Ibverbs,
        d: *mut sys::ibv_device,
    ) -> DeviceInfo {
        // SAFETY: `d` is live (the caller's contract); only read here.
        let dev = unsafe { &*d };
        DeviceInfo {
            name: c_array(&dev.name),
            // SAFETY: as above.
            guid: unsafe { result::get_device_guid(lib, d) },
            transport: Transport::from(dev.transport_type),
            dev_path: c_array(&dev.dev_path),
            ibdev_path: c_array(&dev.ibdev_path),
        }
    }
}

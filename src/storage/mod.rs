//! Files↔GPU: cuFile where it works, gpudirect's parallel POSIX engine where it can't.
//!
//! Start with [`read_to_gpu`] or [`GpuFile`]; settings are in [`config`].

pub mod config;
pub(crate) mod engine;
mod file;
mod status;
pub use status::{CuFileStatus, IoReturn};
pub mod cufile;

pub use config::{CompatMode, ODirect, StorageConfig};
pub use file::{read_to_gpu, Backend, DeviceDst, DeviceSrc, GpuFile, GpuFileOptions, IoReport};

/// The engine's default worker count for `device` (`None`: host memory): the CPUs of the
/// GPU's NUMA node this process may use, 4 to 64 (see [`config`]).
pub fn default_threads(device: Option<usize>) -> usize {
    engine::default_threads(device, true)
}

/// The NUMA node of a GPU (from `/sys/bus/pci/devices/<bus id>/numa_node`), when the platform
/// reports one; the engine pins that device's workers there.
pub fn gpu_numa_node(ordinal: usize) -> Option<u32> {
    engine::numa::placement(ordinal).node
}

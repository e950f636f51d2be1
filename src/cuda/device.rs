//! A GPU's place in the machine: its PCI bus id, its NUMA node and the CPUs of that node this
//! process may use. The one answer for every room (P2P topology, the GDR probe, the storage
//! engine's thread placement).

use std::collections::HashMap;
use std::sync::Mutex;

use super::result::device;
use crate::error::Result;

/// The PCI bus id of CUDA device `ordinal` as the driver spells it (`cuDeviceGetPCIBusId`, e.g.
/// `0000:18:00.0`).
///
/// Errors: the CUDA absence errors of [`check_ordinal`](super::check_ordinal),
/// [`Error::Cuda`](crate::Error::Cuda).
pub fn pci_bus_id(ordinal: usize) -> Result<String> {
    super::check_ordinal(ordinal)?;
    device::pci_bus_id(device::get(ordinal)?)
}

/// The PCI bus id of CUDA device `ordinal` as sysfs spells it (lowercase, 4-digit domain), the
/// name of its directory under `/sys/bus/pci/devices`.
pub fn sysfs_bus_id(ordinal: usize) -> Result<String> {
    Ok(normalize_bdf(&pci_bus_id(ordinal)?))
}

/// Normalizes a PCI bus id (`00000000:3B:00.0`, `0000:3B:00.0`) to sysfs's spelling
/// (`0000:3b:00.0`).
pub fn normalize_bdf(id: &str) -> String {
    let id = id.trim().trim_end_matches('\0').to_ascii_lowercase();
    match id.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => id,
    }
}

/// Parses a PCI bus ID (`0000:18:00.0` or NVML's `00000000:18:00.0`) into
/// (domain, bus, device, function).
pub fn parse_pci_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let s = s.trim().trim_end_matches('\0');
    let mut parts = s.rsplitn(3, ':');
    let devfn = parts.next()?;
    let bus = parts.next()?;
    let domain = parts.next().unwrap_or("0");
    let (dev, func) = devfn.split_once('.').unwrap_or((devfn, "0"));
    Some((
        u32::from_str_radix(domain, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(dev, 16).ok()?,
        u32::from_str_radix(func, 16).ok()?,
    ))
}

/// The sysfs directory of the PCI device with this bus id (any spelling), when it parses.
pub(crate) fn sysfs_dir(bus_id: &str) -> Option<String> {
    let (d, b, dev, f) = parse_pci_bus_id(bus_id)?;
    Some(format!(
        "/sys/bus/pci/devices/{d:04x}:{b:02x}:{dev:02x}.{f:x}"
    ))
}

/// The NUMA node sysfs reports for the PCI device with this bus id (`numa_node`; `None` when
/// unknown or -1).
pub(crate) fn sysfs_numa_node(bus_id: &str) -> Option<u32> {
    std::fs::read_to_string(format!("{}/numa_node", sysfs_dir(bus_id)?))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&n| n >= 0)
        .and_then(|n| u32::try_from(n).ok())
}

/// The NUMA node of CUDA device `ordinal` (from `/sys/bus/pci/devices/<bus id>/numa_node`),
/// when the platform reports one.
pub fn numa_node(ordinal: usize) -> Option<u32> {
    placement(ordinal).node
}

/// The CPUs of device `ordinal`'s NUMA node this process may run on (empty: unknown or none
/// allowed).
pub fn local_cpus(ordinal: usize) -> Vec<usize> {
    placement(ordinal).cpus
}

/// What is known about a GPU's placement.
#[derive(Debug, Clone, Default)]
pub(crate) struct Placement {
    /// NUMA node of the GPU, when the platform reports one.
    pub node: Option<u32>,
    /// CPUs of that node this process may use (empty: unknown or none allowed).
    pub cpus: Vec<usize>,
}

/// The NUMA node of a device and its usable CPUs, looked up once per device. Never fails:
/// unknown pieces are left empty.
pub(crate) fn placement(ordinal: usize) -> Placement {
    static CACHE: Mutex<Option<HashMap<usize, Placement>>> = Mutex::new(None);
    let mut g = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    g.get_or_insert_with(HashMap::new)
        .entry(ordinal)
        .or_insert_with(|| lookup(ordinal))
        .clone()
}

fn lookup(ordinal: usize) -> Placement {
    let Ok(bus) = pci_bus_id(ordinal) else {
        return Placement::default();
    };
    let node = sysfs_numa_node(&bus);
    let cpus = match node {
        Some(n) => {
            let allowed = allowed_cpus();
            std::fs::read_to_string(format!("/sys/devices/system/node/node{n}/cpulist"))
                .map(|s| parse_cpulist(&s))
                .unwrap_or_default()
                .into_iter()
                .filter(|c| allowed.contains(c))
                .collect()
        }
        None => Vec::new(),
    };
    Placement { node, cpus }
}

/// Parses a kernel cpulist such as `0-15,32-47`.
pub(crate) fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    if b >= a && b - a < 1 << 16 {
                        out.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(a) = part.trim().parse() {
                    out.push(a)
                }
            }
        }
    }
    out
}

/// The CPUs this thread may run on (`sched_getaffinity`).
pub(crate) fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most sizeof(cpu_set_t).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(parse_cpulist("5"), vec![5]);
        assert_eq!(parse_cpulist("3-1,x"), Vec::<usize>::new());
    }

    #[test]
    fn this_thread_has_cpus() {
        assert!(!allowed_cpus().is_empty());
    }

    #[test]
    fn bus_ids_normalize_to_sysfs_spelling() {
        assert_eq!(normalize_bdf("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bdf("0000:C1:00.0\0"), "0000:c1:00.0");
        assert_eq!(
            sysfs_dir("00000000:1B:00.0").as_deref(),
            Some("/sys/bus/pci/devices/0000:1b:00.0")
        );
        assert_eq!(sysfs_dir("garbage"), None);
    }
}

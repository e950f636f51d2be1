//! Where a GPU sits: its NUMA node and the CPUs this process may use there.

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

/// Pins the calling thread to `cpus` (best effort; false when the kernel refused).
pub(crate) fn pin_current_thread(cpus: &[usize]) -> bool {
    if cpus.is_empty() {
        return false;
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET bounds-checks against CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            if c < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(c, &mut set);
            }
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The PCI bus id of a CUDA device (`cuDeviceGetPCIBusId`), lowercased as sysfs spells it.
pub(crate) fn pci_bus_id(ordinal: usize) -> crate::Result<String> {
    use crate::cuda::result::device;
    crate::cuda::check_ordinal(ordinal)?;
    Ok(device::pci_bus_id(device::get(ordinal)?)?.to_ascii_lowercase())
}

/// What the engine knows about a GPU's placement.
#[derive(Debug, Clone, Default)]
pub(crate) struct Placement {
    /// NUMA node of the GPU, when the platform reports one.
    pub node: Option<u32>,
    /// CPUs of that node this process may use (empty: unknown or none allowed).
    pub cpus: Vec<usize>,
}

/// The NUMA node of a device (from `/sys/bus/pci/devices/<bus id>/numa_node`) and its usable
/// CPUs, looked up once per device. Never fails: unknown pieces are left empty.
pub(crate) fn placement(ordinal: usize) -> Placement {
    use std::collections::HashMap;
    use std::sync::Mutex;
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
    let read = |p: String| std::fs::read_to_string(p).ok();
    // sysfs spells the domain with 4 hex digits; some drivers report 8 ("00000000:1b:00.0").
    let bus = match bus.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => bus,
    };
    let node = read(format!("/sys/bus/pci/devices/{bus}/numa_node"))
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&n| n >= 0)
        .map(|n| n as u32);
    let cpus = match node {
        Some(n) => {
            let allowed = allowed_cpus();
            read(format!("/sys/devices/system/node/node{n}/cpulist"))
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
}

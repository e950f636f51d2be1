//! Thread pinning for the engine's workers. Where a GPU sits (its NUMA node and the CPUs this
//! process may use there) is the ground floor's: [`crate::cuda::device`].

pub(in crate::storage) use crate::cuda::device::{allowed_cpus, placement};

/// Pins the calling thread to `cpus` (best effort; false when the kernel refused).
pub(in crate::storage) fn pin_current_thread(cpus: &[usize]) -> bool {
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

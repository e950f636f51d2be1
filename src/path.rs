//! The vocabulary of the promise: which path bytes took, why, and whether falling back is allowed.

use std::collections::HashSet;
use std::fmt;
use std::io::Write as _;
use std::mem::Discriminant;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

use serde::Serialize;

use crate::env::{Env, ParseValueError};
use crate::error::{Error, Result};

/// The kind of link a direct GPU↔GPU path runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
#[allow(clippy::enum_variant_names)] // NvLink is the product name
#[serde(rename_all = "snake_case")]
pub enum Link {
    /// NVLink, with the number of links between the two GPUs when known.
    #[serde(rename = "nvlink")]
    NvLink {
        /// Active NVLink links between the pair (0 when unknown).
        links: u32,
    },
    /// PCIe peer-to-peer.
    Pcie,
    /// The driver says direct access works, but the link type is unknown (no NVML).
    Unknown,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::NvLink { links: 0 } => f.write_str("NVLink"),
            Link::NvLink { links } => write!(f, "NVLink x{links}"),
            Link::Pcie => f.write_str("PCIe"),
            Link::Unknown => f.write_str("unknown link"),
        }
    }
}

/// The path a transfer's bytes took (or would take).
///
/// Direct paths move bytes between the device and its peer without host memory; every other
/// path is a fallback and comes with a [`Cause`] in a [`PathReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
#[serde(rename_all = "snake_case")]
pub enum TransferPath {
    /// GPU↔GPU without the host, over the given link.
    PeerDirect {
        /// The link.
        link: Link,
    },
    /// GPU↔GPU copied by the driver through host memory.
    StagedThroughHost,
    /// Storage↔GPU by DMA (nvidia-fs or the kernel's PCI P2PDMA): GPUDirect Storage proper.
    Gds,
    /// cuFile's own compatibility path: POSIX IO into cuFile's bounce buffers, then a copy.
    #[serde(rename = "cufile_compat")]
    CuFileCompat,
    /// gpudirect's parallel POSIX engine: file IO into pinned host buffers, then a copy.
    Posix,
    /// A NIC reads/writes GPU memory registered through dma-buf.
    RdmaDmaBuf,
    /// A NIC reads/writes GPU memory registered through a peer-memory client (nvidia-peermem).
    RdmaPeerMem,
    /// A NIC reads/writes host memory (the GPU side needs a separate copy).
    RdmaHostMemory,
    /// The library cannot observe which path was taken.
    Unknown,
}

/// The old name of [`TransferPath`], kept for a release so code written against the old name
/// keeps compiling (with a deprecation warning), variant paths included.
///
/// It was renamed because a user file that imports it cannot also import `std::path::Path`.
///
/// ```
/// #![allow(deprecated)]
/// use gpudirect::{Path, PathReport, TransferPath};
/// let old: Path = Path::Posix;
/// assert_eq!(old, TransferPath::Posix);
/// assert!(matches!(PathReport::direct(Path::Gds).path, Path::Gds));
/// let direct = |p: Path| match p {
///     Path::PeerDirect { .. } | Path::Gds | Path::RdmaDmaBuf | Path::RdmaPeerMem => true,
///     _ => false,
/// };
/// assert!(direct(TransferPath::Gds) && !direct(Path::StagedThroughHost));
/// ```
///
/// Using it warns (here an error, so this example fails to compile):
///
/// ```compile_fail
/// #![deny(deprecated)]
/// let _ = gpudirect::Path::Posix;
/// ```
#[deprecated(note = "renamed to TransferPath (it collided with std::path::Path)")]
pub type Path = TransferPath;

impl TransferPath {
    /// True for paths on which no host memory carries the payload.
    pub fn is_direct(&self) -> bool {
        matches!(
            self,
            TransferPath::PeerDirect { .. }
                | TransferPath::Gds
                | TransferPath::RdmaDmaBuf
                | TransferPath::RdmaPeerMem
        )
    }
}

impl fmt::Display for TransferPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferPath::PeerDirect { link } => write!(f, "direct peer access over {link}"),
            TransferPath::StagedThroughHost => f.write_str("staged through host memory"),
            TransferPath::Gds => f.write_str("GPUDirect Storage (DMA)"),
            TransferPath::CuFileCompat => f.write_str("cuFile compatibility mode (POSIX, staged)"),
            TransferPath::Posix => {
                f.write_str("gpudirect POSIX engine (staged through pinned host memory)")
            }
            TransferPath::RdmaDmaBuf => f.write_str("GPUDirect RDMA via dma-buf"),
            TransferPath::RdmaPeerMem => f.write_str("GPUDirect RDMA via peer-memory client"),
            TransferPath::RdmaHostMemory => f.write_str("RDMA into host memory"),
            TransferPath::Unknown => f.write_str("unknown path"),
        }
    }
}

/// Why a transfer did not take a direct path, and what would fix it.
///
/// `Display` gives one lowercase sentence with the fix; [`Cause::fix`] gives the fix alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    // ---- P2P -----------------------------------------------------------------------------
    /// The driver reports that these two devices cannot access each other.
    PeerUnsupported {
        /// Source device ordinal.
        src: usize,
        /// Destination device ordinal.
        dst: usize,
    },
    /// Context peer access (`cuCtxEnablePeerAccess`) is not enabled for this pair.
    PeerAccessNotEnabled {
        /// Device that would access the memory.
        accessor: usize,
        /// Device that owns the memory.
        owner: usize,
    },
    /// The memory comes from a stream-ordered pool that grants the peer no access
    /// (`cuMemPoolSetAccess` missing).
    PoolAccessNotGranted {
        /// Device that would access the memory.
        accessor: usize,
        /// Device that owns the pool.
        owner: usize,
    },
    /// Both buffers are on the same device (not a peer transfer).
    SameDevice,
    /// The GPU has no hardware resources left for another peer (`CUDA_ERROR_TOO_MANY_PEERS`).
    TooManyPeers {
        /// Device that would access the memory.
        accessor: usize,
        /// Device that owns the memory.
        owner: usize,
    },

    // ---- Storage -------------------------------------------------------------------------
    /// libcufile cannot be loaded or its driver cannot be opened.
    #[serde(rename = "cufile_unavailable")]
    CuFileUnavailable {
        /// Why.
        reason: String,
    },
    /// The nvidia-fs kernel module is not loaded (and no P2PDMA path exists).
    NoNvidiaFs,
    /// cuFile cannot register files on this block device: udev has no data for it.
    UdevDataMissing {
        /// The device, e.g. `"259:1"`.
        device: String,
    },
    /// The filesystem does not support GPUDirect Storage.
    FilesystemUnsupported {
        /// The filesystem type, e.g. `"tmpfs"`.
        fs: String,
    },
    /// The file could not be opened with O_DIRECT.
    ODirectRefused {
        /// The errno text.
        reason: String,
    },
    /// The registration of the file handle with cuFile failed for another reason.
    #[serde(rename = "cufile_registration_failed")]
    CuFileRegistrationFailed {
        /// The cuFile status or errno text.
        reason: String,
    },
    /// The memory is host memory: there is no GPU side to go direct to.
    HostMemory,

    // ---- RDMA ----------------------------------------------------------------------------
    /// No peer-memory client (`nvidia_peermem`) is loaded.
    NoPeerMemoryClient,
    /// The RDMA provider or kernel does not implement dma-buf registration (EOPNOTSUPP).
    DmaBufUnsupported {
        /// Detail, e.g. which side lacks it.
        detail: String,
    },
    /// The memory is stream-ordered pool memory, which is not GPUDirect-RDMA capable.
    PoolMemoryNotGdrCapable,
    /// The pointer is not device memory (host or managed memory): a NIC would reach host
    /// memory, not the GPU.
    NotDeviceMemory {
        /// True for managed (unified) memory, false for host memory.
        managed: bool,
    },
    /// The NIC's driver rejected the registration as invalid (`EINVAL`): the range's alignment,
    /// its access flags or the kind of memory (e.g. a VMM range) does not suit it.
    RegistrationInvalid {
        /// The verb that refused, e.g. `"ibv_reg_dmabuf_mr"`.
        op: String,
    },
    /// The range is not aligned as the registration path requires.
    Misaligned {
        /// The alignment required, in bytes.
        required: usize,
    },
    /// Every GPUDirect RDMA registration path was refused, each for its own cause.
    GdrPathsRefused {
        /// Why dma-buf registration was refused.
        dmabuf: Box<Cause>,
        /// Why peer-memory (`ibv_reg_mr` on the device pointer) registration was refused.
        peermem: Box<Cause>,
    },
    /// The GPU and NIC are too far apart on PCIe for GDR to pay off.
    PcieDistance {
        /// The distance, e.g. `"SYS"`.
        distance: String,
        /// The most distant level allowed.
        allowed: String,
    },

    // ---- Any room ------------------------------------------------------------------------
    /// A setting chose the path (API call or environment variable).
    ForcedByConfig {
        /// The setting, e.g. `"GPUDIRECT_COMPAT_MODE=ON"`.
        setting: String,
    },
    /// The needed library or symbol is missing.
    LibraryMissing {
        /// Which one, and why.
        detail: String,
    },
    /// Anything else, with its own fix.
    Other {
        /// What happened.
        message: String,
        /// What to do.
        fix: String,
    },
}

impl Cause {
    /// What a user can do about this cause.
    pub fn fix(&self) -> String {
        match self {
            Cause::PeerUnsupported { .. } => {
                "the devices have no P2P path (check `nvidia-smi topo -p2p r`, PCIe ACS and IOMMU settings)".into()
            }
            Cause::PeerAccessNotEnabled { .. } => "hold a gpudirect::p2p::PeerAccess for the pair".into(),
            Cause::PoolAccessNotGranted { .. } => {
                "hold a gpudirect::p2p::PeerAccess for the pair (it calls cuMemPoolSetAccess on the pools)".into()
            }
            Cause::SameDevice => "nothing to fix: this is an on-device copy".into(),
            Cause::TooManyPeers { .. } => {
                "drop other peer access holders for this GPU (non-NVSwitch systems allow 8 peers per GPU)".into()
            }
            Cause::CuFileUnavailable { .. } => {
                "install libcufile (pip install nvidia-cufile or the CUDA toolkit's gds package) or set GPUDIRECT_CUFILE_LIB".into()
            }
            Cause::NoNvidiaFs => "load the nvidia-fs kernel module (modprobe nvidia-fs) or use a P2PDMA-capable kernel".into(),
            Cause::UdevDataMissing { .. } => {
                "run udev in this container or bind-mount the host's /run/udev".into()
            }
            Cause::FilesystemUnsupported { .. } => "place the file on ext4/xfs on NVMe or a GDS-capable filesystem".into(),
            Cause::ODirectRefused { .. } => "use a filesystem that supports O_DIRECT".into(),
            Cause::CuFileRegistrationFailed { .. } => "run gdscheck -p and read cufile.log".into(),
            Cause::HostMemory => "pass device memory to go direct".into(),
            Cause::NoPeerMemoryClient => "load nvidia_peermem or use the dma-buf path".into(),
            Cause::DmaBufUnsupported { .. } => {
                "use an RDMA provider and kernel with dma-buf support (mlx5, rdma-core >= 34, Linux >= 5.12) and NVIDIA's open kernel module".into()
            }
            Cause::PoolMemoryNotGdrCapable => {
                "allocate with gpudirect::rdma::GdrBuffer (cuMemAlloc) instead of the stream-ordered pool".into()
            }
            Cause::NotDeviceMemory { .. } => {
                "register device memory (a gpudirect::rdma::GdrBuffer), or host memory with ProtectionDomain::register_host".into()
            }
            Cause::RegistrationInvalid { .. } => {
                "register a gpudirect::rdma::GdrBuffer (64 KiB aligned cuMemAlloc memory) with the default access flags".into()
            }
            Cause::Misaligned { required } => format!("align the range to {required} bytes"),
            Cause::GdrPathsRefused { dmabuf, peermem } => {
                format!("for dma-buf: {}; or for peermem: {}", dmabuf.fix(), peermem.fix())
            }
            Cause::PcieDistance { .. } => "set GPUDIRECT_GDR_LEVEL to allow a longer distance, or pick a closer NIC".into(),
            Cause::ForcedByConfig { setting } => format!("change {setting}"),
            Cause::LibraryMissing { .. } => "install the library named above".into(),
            Cause::Other { fix, .. } => fix.clone(),
        }
    }

    fn describe(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::PeerUnsupported { src, dst } => write!(
                f,
                "GPU {src} cannot access GPU {dst} (cuDeviceCanAccessPeer = 0)"
            ),
            Cause::PeerAccessNotEnabled { accessor, owner } => {
                write!(
                    f,
                    "GPU {accessor} has no peer access to GPU {owner}'s context"
                )
            }
            Cause::PoolAccessNotGranted { accessor, owner } => {
                write!(f, "pool memory lacks peer access: GPU {owner}'s memory pool grants GPU {accessor} no access")
            }
            Cause::SameDevice => f.write_str("both buffers are on the same device"),
            Cause::TooManyPeers { accessor, owner } => write!(
                f,
                "GPU {accessor} has no peer slots left for GPU {owner} (CUDA_ERROR_TOO_MANY_PEERS)"
            ),
            Cause::CuFileUnavailable { reason } => write!(f, "cuFile is unavailable: {reason}"),
            Cause::NoNvidiaFs => f.write_str("the nvidia-fs kernel module is not loaded"),
            Cause::UdevDataMissing { device } => {
                write!(
                    f,
                    "cuFile can't register files: udev data missing for block device {device}"
                )
            }
            Cause::FilesystemUnsupported { fs } => {
                write!(f, "filesystem {fs} does not support GPUDirect Storage")
            }
            Cause::ODirectRefused { reason } => write!(f, "O_DIRECT was refused: {reason}"),
            Cause::CuFileRegistrationFailed { reason } => {
                write!(f, "cuFile could not register the file: {reason}")
            }
            Cause::HostMemory => f.write_str("the buffer is host memory"),
            Cause::NoPeerMemoryClient => f.write_str("no peer-memory client"),
            Cause::DmaBufUnsupported { detail } => {
                write!(f, "dma-buf registration unsupported: {detail}")
            }
            Cause::PoolMemoryNotGdrCapable => {
                f.write_str("stream-ordered pool memory is not GPUDirect-RDMA capable")
            }
            Cause::NotDeviceMemory { managed: true } => f.write_str(
                "the pointer is managed memory, which is host memory to a NIC, not the GPU's",
            ),
            Cause::NotDeviceMemory { managed: false } => {
                f.write_str("the pointer is host memory, not device memory")
            }
            Cause::RegistrationInvalid { op } => write!(
                f,
                "{op} rejected the range as invalid (EINVAL: its alignment, access flags or kind of memory)"
            ),
            Cause::Misaligned { required } => write!(f, "the range is not {required}-byte aligned"),
            Cause::GdrPathsRefused { dmabuf, peermem } => {
                f.write_str("no GPUDirect RDMA registration path: dma-buf refused (")?;
                dmabuf.describe(f)?;
                f.write_str("), peermem refused (")?;
                peermem.describe(f)?;
                f.write_str(")")
            }
            Cause::PcieDistance { distance, allowed } => {
                write!(
                    f,
                    "GPU and NIC are {distance} apart, beyond the allowed {allowed}"
                )
            }
            Cause::ForcedByConfig { setting } => write!(f, "forced by {setting}"),
            Cause::LibraryMissing { detail } => write!(f, "library missing: {detail}"),
            Cause::Other { message, .. } => f.write_str(message),
        }
    }
}

impl Cause {
    /// What happened, without the fix (`Display` gives both).
    pub fn what(&self) -> String {
        struct What<'a>(&'a Cause);
        impl fmt::Display for What<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.describe(f)
            }
        }
        What(self).to_string()
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f)?;
        write!(f, "; fix: {}", self.fix())
    }
}

/// What a transfer reports: the path its bytes took and, for fallbacks, why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathReport {
    /// The path taken.
    pub path: TransferPath,
    /// Why the path is not direct (`None` for direct paths).
    pub cause: Option<Cause>,
}

impl PathReport {
    /// A direct path.
    pub fn direct(path: TransferPath) -> Self {
        PathReport { path, cause: None }
    }

    /// A fallback path with its cause.
    pub fn fallback(path: TransferPath, cause: Cause) -> Self {
        PathReport {
            path,
            cause: Some(cause),
        }
    }

    /// True when the bytes took a direct path.
    pub fn is_direct(&self) -> bool {
        self.path.is_direct()
    }
}

impl fmt::Display for PathReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cause {
            None => write!(f, "{}", self.path),
            Some(c) => write!(f, "{} (because {c})", self.path),
        }
    }
}

/// What to do when a transfer would not take a direct path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FallbackPolicy {
    /// Fall back silently (the report still names the path and cause).
    Allow,
    /// Fall back and warn, naming the path and the cause with its fix, **once per kind of cause
    /// per process** (10,000 files falling back for one reason warn once; every report still
    /// names its own cause). The warning is a `tracing` event (target `gpudirect`, level WARN)
    /// when a subscriber listens to it, else one line on stderr, so a plain binary sees it too.
    /// `GPUDIRECT_FALLBACK=allow` (or [`FallbackPolicy::Allow`]) silences it.
    #[default]
    Warn,
    /// Refuse: return [`Error::FallbackRefused`] before moving any byte.
    Deny,
}

static GLOBAL_POLICY: AtomicU8 = AtomicU8::new(u8::MAX);

impl std::str::FromStr for FallbackPolicy {
    type Err = ParseValueError;
    /// Parses `allow`, `warn` or `deny` (any case).
    fn from_str(s: &str) -> std::result::Result<Self, ParseValueError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "allow" => Ok(FallbackPolicy::Allow),
            "warn" => Ok(FallbackPolicy::Warn),
            "deny" => Ok(FallbackPolicy::Deny),
            _ => Err(ParseValueError::new(s, "allow, warn or deny")),
        }
    }
}

impl FallbackPolicy {
    /// The environment's choice (read once per process): `GPUDIRECT_REQUIRE_DIRECT` true
    /// (`1`, `true`, `yes`, `on`) means `Deny`; otherwise `GPUDIRECT_FALLBACK=allow|warn|deny`
    /// names a policy; `Ok(None)` when neither decides. Errors:
    /// [`Error::InvalidEnvironment`] for a value of either that does not parse (e.g.
    /// `GPUDIRECT_FALLBACK=dney`): a typo must not turn a refusal into a fallback.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_source(Env::process())
    }

    fn from_source(env: Env<'_>) -> Result<Option<Self>> {
        let require = env.flag("GPUDIRECT_REQUIRE_DIRECT")?;
        let named = env.var::<FallbackPolicy>("GPUDIRECT_FALLBACK")?;
        Ok(if require == Some(true) {
            Some(FallbackPolicy::Deny)
        } else {
            named
        })
    }

    /// The process-wide policy: the one set with [`FallbackPolicy::set_global`], else the
    /// environment's ([`FallbackPolicy::from_env`]), else `Warn`. Errors: as `from_env`, only
    /// while no policy was set with `set_global`.
    pub fn global() -> Result<Self> {
        Ok(match GLOBAL_POLICY.load(Ordering::Relaxed) {
            0 => FallbackPolicy::Allow,
            1 => FallbackPolicy::Warn,
            2 => FallbackPolicy::Deny,
            _ => FallbackPolicy::from_env()?.unwrap_or_default(),
        })
    }

    /// Sets the process-wide policy (overrides the environment).
    pub fn set_global(policy: FallbackPolicy) {
        let v = match policy {
            FallbackPolicy::Allow => 0,
            FallbackPolicy::Warn => 1,
            FallbackPolicy::Deny => 2,
        };
        GLOBAL_POLICY.store(v, Ordering::Relaxed);
    }

    /// Applies the policy to a planned transfer: `Ok` to proceed, `Err(FallbackRefused)` when
    /// the policy is `Deny` and the path is not direct. `Warn` logs the cause.
    pub fn check(self, report: &PathReport) -> Result<()> {
        if report.is_direct() {
            return Ok(());
        }
        let cause = report.cause.clone().unwrap_or(Cause::Other {
            message: "the library cannot tell which path the bytes take".into(),
            fix: "check with gpudirect's doctor example".into(),
        });
        match self {
            FallbackPolicy::Allow => Ok(()),
            FallbackPolicy::Warn => {
                warn_once(report.path, &cause);
                Ok(())
            }
            FallbackPolicy::Deny => Err(Error::FallbackRefused {
                path: report.path,
                cause,
            }),
        }
    }
}

/// The (path, cause) kinds already warned about in this process. Bounded: one entry per pair of
/// enum variants at most, whatever the data in them (device names, file errors).
fn first_warning(path: &TransferPath, cause: &Cause) -> bool {
    type Key = (Discriminant<TransferPath>, Discriminant<Cause>);
    static WARNED: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    let key = (std::mem::discriminant(path), std::mem::discriminant(cause));
    WARNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert(key)
}

/// The `Warn` policy's one warning per kind of cause: to `tracing` when a subscriber takes
/// gpudirect's warnings, else to stderr (never a panic, even with stderr closed).
fn warn_once(path: TransferPath, cause: &Cause) {
    if !first_warning(&path, cause) {
        return;
    }
    if tracing::enabled!(tracing::Level::WARN) {
        tracing::warn!(%path, %cause, "gpudirect transfer falls back (warned once per cause in this process)");
    } else {
        let _ = writeln!(
            std::io::stderr().lock(),
            "gpudirect: warning: a transfer falls back to {path} because {cause} \
             (warned once per cause in this process; GPUDIRECT_FALLBACK=allow silences this, \
             GPUDIRECT_FALLBACK=deny refuses fallbacks)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_paths_are_direct_and_fallbacks_are_not() {
        assert!(TransferPath::PeerDirect {
            link: Link::NvLink { links: 18 }
        }
        .is_direct());
        assert!(TransferPath::Gds.is_direct());
        assert!(TransferPath::RdmaDmaBuf.is_direct());
        assert!(!TransferPath::StagedThroughHost.is_direct());
        assert!(!TransferPath::Posix.is_direct());
        assert!(!TransferPath::CuFileCompat.is_direct());
        assert!(!TransferPath::Unknown.is_direct());
    }

    #[test]
    fn deny_refuses_fallback_and_names_cause() {
        let r = PathReport::fallback(
            TransferPath::StagedThroughHost,
            Cause::PoolAccessNotGranted {
                accessor: 1,
                owner: 0,
            },
        );
        let err = FallbackPolicy::Deny.check(&r).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("pool memory lacks peer access"), "{msg}");
        assert!(msg.contains("PeerAccess"), "{msg}");
        assert!(matches!(
            err,
            Error::FallbackRefused {
                path: TransferPath::StagedThroughHost,
                ..
            }
        ));
        FallbackPolicy::Allow.check(&r).unwrap();
        FallbackPolicy::Warn.check(&r).unwrap();
        FallbackPolicy::Deny
            .check(&PathReport::direct(TransferPath::Gds))
            .unwrap();
    }

    fn policy_from(pairs: &[(&str, &str)]) -> Result<Option<FallbackPolicy>> {
        let m = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        FallbackPolicy::from_source(Env::from_map(&m))
    }

    #[test]
    fn policy_from_environment_is_strict() {
        assert_eq!(policy_from(&[]).unwrap(), None);
        assert_eq!(
            policy_from(&[("GPUDIRECT_REQUIRE_DIRECT", "TRUE")]).unwrap(),
            Some(FallbackPolicy::Deny)
        );
        assert_eq!(
            policy_from(&[("GPUDIRECT_REQUIRE_DIRECT", "0")]).unwrap(),
            None
        );
        assert_eq!(
            policy_from(&[("GPUDIRECT_FALLBACK", "Allow")]).unwrap(),
            Some(FallbackPolicy::Allow)
        );
        assert_eq!(
            policy_from(&[
                ("GPUDIRECT_REQUIRE_DIRECT", "1"),
                ("GPUDIRECT_FALLBACK", "allow")
            ])
            .unwrap(),
            Some(FallbackPolicy::Deny)
        );
        for (var, val) in [
            ("GPUDIRECT_FALLBACK", "dney"),
            ("GPUDIRECT_REQUIRE_DIRECT", "please"),
        ] {
            match policy_from(&[(var, val)]) {
                Err(e @ Error::InvalidEnvironment { variable, .. }) => {
                    assert_eq!(variable, var);
                    assert!(e.to_string().contains(val), "{e}");
                }
                other => panic!("{var}={val}: {other:?}"),
            }
        }
    }

    #[test]
    fn cause_messages_are_lowercase_without_trailing_period() {
        let causes = [
            Cause::NoPeerMemoryClient,
            Cause::UdevDataMissing {
                device: "259:1".into(),
            },
            Cause::PoolMemoryNotGdrCapable,
            Cause::Misaligned { required: 4096 },
            Cause::NotDeviceMemory { managed: true },
            Cause::NotDeviceMemory { managed: false },
            Cause::RegistrationInvalid {
                op: "ibv_reg_dmabuf_mr".into(),
            },
        ];
        for c in causes {
            let s = c.to_string();
            assert!(s.chars().next().unwrap().is_lowercase(), "{s}");
            assert!(!s.ends_with('.'), "{s}");
        }
        assert_eq!(
            Cause::NoPeerMemoryClient.to_string(),
            "no peer-memory client; fix: load nvidia_peermem or use the dma-buf path"
        );
    }
}

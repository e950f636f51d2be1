//! Saving GPU tensors into one safetensors file: atomic replace, one fsync when durable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaView, DeviceSlice};

use super::dtype::{dtype_of, Dtype, Element};
use super::header::{self, OutTensor};
use super::load::{unbatch, LoadReport, TensorRef};
use crate::error::{Error, Result};
use crate::storage::{GpuFile, GpuFileOptions, WriteBatch};

/// One tensor to save: its bytes on the device, dtype and shape.
#[derive(Debug)]
pub struct SaveTensor<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: CudaView<'a, u8>,
}

impl<'a> SaveTensor<'a> {
    /// A typed device view with its shape (elements must equal the shape's product).
    pub fn new<T: Element>(data: CudaView<'a, T>, shape: &[usize]) -> Self {
        let n = data.len() * std::mem::size_of::<T>();
        // SAFETY: viewing initialised elements of a plain-number type (the `Element` contract:
        // no padding) as bytes, for reading; the view covers exactly the same bytes.
        let bytes = unsafe { data.transmute::<u8>(n) }.expect("a view's bytes fit in it");
        SaveTensor {
            dtype: dtype_of::<T>(),
            shape: shape.to_vec(),
            bytes,
        }
    }

    /// A whole slice as a 1-D tensor.
    pub fn from_slice<T: Element>(data: &'a CudaSlice<T>) -> Self {
        Self::new(data.as_view(), &[data.len()])
    }

    /// Raw bytes with an explicit dtype (for dtypes without a Rust element type, or `BOOL`).
    pub fn from_bytes(bytes: CudaView<'a, u8>, dtype: Dtype, shape: &[usize]) -> Self {
        SaveTensor {
            dtype,
            shape: shape.to_vec(),
            bytes,
        }
    }

    /// Its dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
}

impl<'a> From<TensorRef<'a>> for SaveTensor<'a> {
    fn from(t: TensorRef<'a>) -> Self {
        SaveTensor::from_bytes(t.bytes(), t.dtype(), t.shape())
    }
}

impl<'a> From<&'a super::OwnedTensor> for SaveTensor<'a> {
    fn from(t: &'a super::OwnedTensor) -> Self {
        SaveTensor::from_bytes(t.bytes(), t.dtype(), t.shape())
    }
}

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    durable: bool,
    metadata: BTreeMap<String, String>,
    file: Option<GpuFileOptions>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            durable: true,
            metadata: BTreeMap::new(),
            file: None,
        }
    }
}

impl SaveOptions {
    /// Durable (one fsync of the file and one of its directory), with no metadata.
    pub fn new() -> Self {
        Self::default()
    }
    /// Whether the save is on stable storage when it returns (default true): one `fsync` of
    /// the data at the end, then the rename, then one `fsync` of the directory.
    ///
    /// `durable(false)` skips both. The replace is still atomic for other processes (they see
    /// the old file or the new one), but not across a power loss or a kernel crash: the rename
    /// can reach the disk before the data does, and on some filesystems (XFS; ext4 mounted
    /// with `noauto_da_alloc`; others that do not flush a renamed file's data first) the file
    /// can then be found zero-length or partly written after the reboot, so neither the old
    /// checkpoint nor the new one survives. Use it for scratch files, or when the caller syncs
    /// (`sync(1)`, `syncfs`) before it relies on the file.
    pub fn durable(mut self, yes: bool) -> Self {
        self.durable = yes;
        self
    }
    /// Adds an entry to the header's `__metadata__` (e.g. `"format" = "pt"`, which torch's
    /// loaders expect).
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }
    /// Storage settings for the file (backend, threads, O_DIRECT, ...); `durable` and
    /// `create`/`truncate` are the save's own.
    pub fn file_options(mut self, o: GpuFileOptions) -> Self {
        self.file = Some(o);
        self
    }
}

/// What a save did.
pub type SaveReport = LoadReport;

/// Writes `tensors` into the safetensors file `path`, replacing it atomically.
///
/// The header is laid out as the `safetensors` crate lays it out (tensors by descending
/// alignment, then name), so files load in torch, candle and the crate. The bytes go to a
/// temporary file in the same directory, which is renamed over `path` only once complete (and,
/// when durable, after its one `fsync`; the directory is synced after the rename). Any error,
/// or a crash, before the rename leaves `path` as it was. A crash can leave the temporary file
/// (`.NAME.*.tmp`) behind.
///
/// The temporary file is created exclusively (`O_EXCL`, `O_NOFOLLOW`: never an existing file or
/// a link's target) with mode 0600 while it is written; before the rename it takes the
/// permission bits of the file `path` names (a 0600 checkpoint stays 0600), or, for a new
/// path, what a plain create gives (0666 less the umask). Its owner is the saving user.
///
/// When `path` is a symbolic link, the rename replaces the link itself with the new regular
/// file; the file the link pointed to is left as it was (and keeps the old bytes). A Hugging
/// Face cache snapshot (`snapshots/REV/model.safetensors`) is such a link to a blob: saving to
/// it leaves the blob, and any other snapshot linking to it, unchanged. Save to the link's
/// target (`std::fs::canonicalize`) to replace the file it names.
///
/// Errors: [`Problem::BadTensor`](super::Problem::BadTensor) (a shape that does not match the bytes, a duplicate or
/// empty name; nothing written), [`Error::Unsupported`](crate::Error::Unsupported) (a tensor's
/// stream is capturing a CUDA graph; refused before the temporary file is created),
/// [`Error::Io`], [`Error::Cuda`], storage errors.
pub fn save<'a, I, N>(path: impl AsRef<Path>, tensors: I, opts: &SaveOptions) -> Result<SaveReport>
where
    I: IntoIterator<Item = (N, SaveTensor<'a>)>,
    N: AsRef<str>,
{
    let t0 = Instant::now();
    let path = path.as_ref();
    let list: Vec<(String, SaveTensor<'a>)> = tensors
        .into_iter()
        .map(|(n, t)| (n.as_ref().to_owned(), t))
        .collect();
    let out: Vec<OutTensor<'_>> = list
        .iter()
        .map(|(n, t)| OutTensor {
            name: n,
            dtype: t.dtype,
            shape: &t.shape,
            len: t.bytes.len() as u64,
        })
        .collect();
    let h =
        header::serialize(&out, &opts.metadata).map_err(|(tensor, problem)| Error::Checkpoint {
            file: path.to_owned(),
            tensor,
            problem,
        })?;
    let mut report = LoadReport {
        bytes: out.iter().map(|t| t.len).sum(),
        tensors: out.len(),
        files: 1,
        writes: true,
        ..LoadReport::empty()
    };
    // Before the temporary file is created (the batch would refuse a capturing stream only
    // then): the streams of the tensors the save reads.
    crate::cuda::refuse_capturing_any(
        list.iter()
            .filter(|(_, t)| !t.bytes.is_empty())
            .map(|(_, t)| t.bytes.stream()),
        "safetensors::save",
    )?;
    // File order, so writes advance through the file.
    let mut order: Vec<usize> = (0..list.len()).collect();
    order.sort_by_key(|&i| h.offsets[i]);
    atomic_replace(path, opts.durable, |tmp, created| {
        // The temporary exists (created exclusively, with its mode, by atomic_replace): open
        // it, and only it.
        let o = opts.file.clone().unwrap_or_default();
        let f = o
            .write(true)
            .create(false)
            .truncate(false)
            .durable(false)
            .open(tmp)?;
        let same = |m: &std::fs::Metadata| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        };
        let ours = created
            .metadata()
            .map_err(|e| Error::io("fstat", Some(tmp.to_owned()), e))?;
        if same(&f.metadata()?) != same(&ours) {
            return Err(Error::io(
                "open",
                Some(tmp.to_owned()),
                std::io::Error::other(
                    "the temporary file was replaced by another between its creation and its open: something else writes in the directory",
                ),
            ));
        }
        write_all(
            &f,
            &h.bytes,
            &list,
            &h.offsets,
            &order,
            opts.durable,
            &mut report,
        )?;
        let len = f.len()?;
        if len != h.file_len {
            return Err(Error::io(
                "write",
                Some(tmp.to_owned()),
                std::io::Error::other(format!(
                    "the file is {len} bytes after the save, not the {} its header describes",
                    h.file_len
                )),
            ));
        }
        Ok(())
    })?;
    report.elapsed = t0.elapsed();
    Ok(report)
}

/// The room's one door to storage writes: the header and every tensor as
/// [`storage::WriteBatch`](crate::storage::WriteBatch)es into `f`, one per GPU the tensors are
/// on (a batch's device sources share a GPU; one batch for the usual save from one GPU), the
/// header in the first, and, when `durable`, the save's one `fsync` at the end of the last.
fn write_all(
    f: &GpuFile,
    header: &[u8],
    list: &[(String, SaveTensor<'_>)],
    offsets: &[u64],
    order: &[usize],
    durable: bool,
    report: &mut LoadReport,
) -> Result<()> {
    let device = |i: usize| list[i].1.bytes.stream().context().ordinal();
    let mut devices: Vec<usize> = Vec::new();
    for &i in order {
        if !list[i].1.bytes.is_empty() && !devices.contains(&device(i)) {
            devices.push(device(i));
        }
    }
    let batches = devices.len().max(1);
    for k in 0..batches {
        let mut b = WriteBatch::new(f);
        if k == 0 {
            b.write_host(header, 0);
        }
        let mut items = 0;
        for &i in order {
            let t = &list[i].1;
            if t.bytes.is_empty() || Some(&device(i)) != devices.get(k) {
                continue;
            }
            let src = b.source(&t.bytes);
            b.write(src, 0, t.bytes.len(), offsets[i]);
            items += 1;
        }
        b.durable(durable && k + 1 == batches);
        let rep = b.run().map_err(unbatch)?;
        if let Some(&dev) = devices.get(k) {
            report.add_write_batch(dev, &rep);
        }
        report.reads += items;
    }
    Ok(())
}

static TMP_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The temporary file's name for `target`: same directory, hidden, unique per process and call.
fn temp_path(target: &Path) -> Result<PathBuf> {
    let name = target.file_name().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} names no file: give a file path to save to",
            target.display()
        ))
    })?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let seq = TMP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".{}.{seq}.{nanos:x}.tmp", std::process::id()));
    Ok(dir.join(tmp))
}

/// Creates the temporary file `tmp` for writing: exclusively (`O_CREAT|O_EXCL`: never a file
/// that exists, never through a symbolic link) and with `O_NOFOLLOW`, with mode `mode` (less the
/// umask, as any create).
fn create_temp(tmp: &Path, mode: u32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)
}

/// The process's umask (`Umask:` of `/proc/self/status`, Linux 4.7 and later), read without
/// changing it (`umask(2)` can only set it, and setting it races with other threads' creates).
fn umask() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let v = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
    u32::from_str_radix(v.trim(), 8).ok()
}

/// Runs `write` on a temporary file next to `target`, then renames it over `target` (and, when
/// `durable`, fsyncs the directory). `write` is responsible for the file's own fsync. On any
/// error the temporary file is removed and `target` is untouched.
///
/// The temporary file is created here, exclusively (never an existing file or a link's target)
/// and handed to `write` with its path. It is mode 0600 while it is written, then (`fchmod`,
/// before the rename) `target`'s permission bits when `target` exists, else the mode a plain
/// create gives (0666 less the umask).
pub(crate) fn atomic_replace<R>(
    target: &Path,
    durable: bool,
    write: impl FnOnce(&Path, &std::fs::File) -> Result<R>,
) -> Result<R> {
    use std::os::unix::fs::PermissionsExt;
    // The mode of the file the path names now (through a link: the file it points to), else a
    // new file's. Without the umask (no /proc), the create applies it: 0666 at create.
    let final_mode = std::fs::metadata(target)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.permissions().mode() & 0o777)
        .or_else(|| umask().map(|u| 0o666 & !u));
    let (tmp, created) = {
        let mut tries = 0;
        loop {
            let tmp = temp_path(target)?;
            match create_temp(&tmp, if final_mode.is_some() { 0o600 } else { 0o666 }) {
                Ok(f) => break (tmp, f),
                // A name another process made (the names are unique per process and call):
                // take the next one.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
                Err(e) => return Err(Error::io("create", Some(tmp), e)),
            }
        }
    };
    let cleanup = |e: Error| {
        if let Err(rm) = std::fs::remove_file(&tmp) {
            if rm.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(
                    "could not remove the temporary file {}: {rm}",
                    tmp.display()
                );
            }
        }
        e
    };
    let r = write(&tmp, &created).map_err(cleanup)?;
    if let Some(m) = final_mode {
        // fchmod: the file just written, whatever its name names now.
        created
            .set_permissions(std::fs::Permissions::from_mode(m))
            .map_err(|e| cleanup(Error::io("fchmod", Some(tmp.clone()), e)))?;
    }
    drop(created);
    std::fs::rename(&tmp, target)
        .map_err(|e| cleanup(Error::io("rename", Some(target.to_owned()), e)))?;
    if durable {
        let dir = tmp.parent().unwrap_or(Path::new("."));
        let d = std::fs::File::open(dir).map_err(|e| Error::io("open", Some(dir.to_owned()), e))?;
        d.sync_all()
            .map_err(|e| Error::io("fsync", Some(dir.to_owned()), e))?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_host(p: &Path, bytes: &[u8], fail_after: Option<usize>) -> Result<()> {
        let mut f = std::fs::File::create(p).map_err(|e| Error::io("create", Some(p.into()), e))?;
        let n = fail_after.unwrap_or(bytes.len()).min(bytes.len());
        f.write_all(&bytes[..n])
            .map_err(|e| Error::io("write", Some(p.into()), e))?;
        if fail_after.is_some() {
            return Err(Error::InvalidArgument("injected failure".into()));
        }
        f.sync_all()
            .map_err(|e| Error::io("fsync", Some(p.into()), e))
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn replace_and_injected_failures() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("m.safetensors");
        let old: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let new: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + 1) as u8).collect();
        atomic_replace(&target, true, |t, _| write_host(t, &old, None)).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), old);
        for cut in [0, 1, 8, 9_999, 19_999] {
            let e =
                atomic_replace(&target, true, |t, _| write_host(t, &new, Some(cut))).unwrap_err();
            assert!(e.to_string().contains("injected"), "{e}");
            assert_eq!(std::fs::read(&target).unwrap(), old, "cut at {cut}");
            assert!(leftovers(d.path()).is_empty());
        }
        atomic_replace(&target, false, |t, _| write_host(t, &new, None)).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), new);
        assert!(leftovers(d.path()).is_empty());
        // A rename that fails (the target is a non-empty directory) cleans up too.
        let dir_target = d.path().join("sub");
        std::fs::create_dir(&dir_target).unwrap();
        std::fs::write(dir_target.join("x"), b"x").unwrap();
        assert!(atomic_replace(&dir_target, true, |t, _| write_host(t, &new, None)).is_err());
        assert!(leftovers(d.path()).is_empty());
        assert!(temp_path(Path::new("/")).is_err());
        let rel = temp_path(Path::new("x.safetensors")).unwrap();
        assert_eq!(rel.parent(), Some(Path::new(".")));
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// A replaced file keeps its permission bits (a 0600 checkpoint stays 0600); a new one gets
    /// what a plain create gives (0666 less the umask).
    #[test]
    fn a_replace_keeps_the_targets_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("m.safetensors");
        for (k, m) in [0o600, 0o640, 0o604, 0o444, 0o755].into_iter().enumerate() {
            std::fs::write(&target, b"old").unwrap();
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(m)).unwrap();
            let new = vec![k as u8 + 1; 1000 + k];
            atomic_replace(&target, false, |t, _| write_host(t, &new, None)).unwrap();
            assert_eq!(std::fs::read(&target).unwrap(), new);
            assert_eq!(mode(&target), m, "{m:o} became {:o}", mode(&target));
            assert!(leftovers(d.path()).is_empty());
        }
        let fresh = d.path().join("fresh.safetensors");
        atomic_replace(&fresh, false, |t, _| write_host(t, b"abc", None)).unwrap();
        let plain = d.path().join("plain");
        std::fs::File::create(&plain).unwrap();
        assert_eq!(mode(&fresh), mode(&plain));
    }

    /// A target that is a symbolic link: the link is replaced by the new file, the file it
    /// pointed to keeps its bytes (as `save`'s docs say).
    #[test]
    fn a_link_as_the_target_is_replaced_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let blob = d.path().join("blob");
        std::fs::write(&blob, b"the blob").unwrap();
        let link = d.path().join("m.safetensors");
        std::os::unix::fs::symlink(&blob, &link).unwrap();
        atomic_replace(&link, false, |t, _| write_host(t, b"new bytes", None)).unwrap();
        assert!(!std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read(&link).unwrap(), b"new bytes");
        assert_eq!(std::fs::read(&blob).unwrap(), b"the blob");
    }

    /// The temporary file is created exclusively: never an existing file, never through a link
    /// (a link planted at its name is not followed; the file it points to is untouched).
    #[test]
    fn the_temporary_is_created_exclusively() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let link = d.path().join(".m.tmp");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let dangling = d.path().join(".n.tmp");
        std::os::unix::fs::symlink(d.path().join("nothing"), &dangling).unwrap();
        for p in [&link, &dangling, &victim] {
            let e = create_temp(p, 0o600).unwrap_err();
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::AlreadyExists,
                "{}",
                p.display()
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert!(!d.path().join("nothing").exists());
        let fresh = d.path().join(".o.tmp");
        create_temp(&fresh, 0o600).unwrap();
        assert_eq!(
            std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let u = umask().expect("Umask: in /proc/self/status");
        assert_eq!(u & !0o777, 0, "{u:o}");
    }

    const CHILD: &str = "GPUDIRECT_TEST_SAVE_CHILD";

    /// Helper and test in one: with `GPUDIRECT_TEST_SAVE_CHILD=DIR` set (by
    /// `a_killed_save_leaves_the_old_file`) it starts replacing `DIR/m.safetensors`, writes half,
    /// signals and waits to be killed; otherwise it checks a replace of a fresh file.
    #[test]
    fn save_child_or_plain_replace() {
        match std::env::var_os(CHILD) {
            Some(dir) => {
                let dir = PathBuf::from(dir);
                let target = dir.join("m.safetensors");
                let _: Result<()> = atomic_replace(&target, true, |t, _| {
                    let mut f = std::fs::File::create(t).unwrap();
                    f.write_all(&[0xEE; 50_000]).unwrap();
                    f.sync_all().unwrap();
                    std::fs::write(dir.join("ready"), b"1").unwrap();
                    std::thread::sleep(std::time::Duration::from_secs(60));
                    std::process::exit(3)
                });
            }
            None => {
                let d = tempfile::tempdir().unwrap();
                let target = d.path().join("fresh.safetensors");
                atomic_replace(&target, true, |t, _| write_host(t, b"abc", None)).unwrap();
                assert_eq!(std::fs::read(&target).unwrap(), b"abc");
            }
        }
    }

    #[test]
    fn a_killed_save_leaves_the_old_file() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("m.safetensors");
        let old: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&target, &old).unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut child = std::process::Command::new(exe)
            .args([
                "--exact",
                "safetensors::save::tests::save_child_or_plain_replace",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD, d.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let ready = d.path().join("ready");
        let t0 = Instant::now();
        while !ready.exists() {
            assert!(
                t0.elapsed().as_secs() < 60,
                "the child never started writing"
            );
            if let Some(st) = child.try_wait().unwrap() {
                panic!("the child exited early: {st}");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), old);
        // The crash left its (half-written) temporary file, never the target.
        let left = leftovers(d.path());
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(
            std::fs::metadata(d.path().join(&left[0])).unwrap().len(),
            50_000
        );
    }
}

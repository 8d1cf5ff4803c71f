//! Shared mappings between processes: files named `gsc-<32 hex>` in a directory (by default the
//! tmpfs /dev/shm), mapped `MAP_SHARED`.
//!
//! Every segment starts with a 64-byte header naming its kind and the process that created it, so
//! `cleanup_stale` can remove segments left behind by processes that died without cleaning up.
//! The header magic is written last (Release), so a valid magic means a complete header.
//!
//! Ownership rule: the creator unlinks the file when its `Segment` is dropped (a missing file is
//! fine: the peer may have unlinked it first); an opener unlinks only by calling `unlink`.

use std::fs::{File, OpenOptions};
use std::mem::{offset_of, size_of};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result, Status};
use crate::transport::ProcessIdentity;
use crate::transport::proc_identity;

/// "GSCSEGv1" as a little-endian u64.
const MAGIC: u64 = u64::from_le_bytes(*b"GSCSEGv1");
const VERSION: u32 = 1;
const NAME_PREFIX: &str = "gsc-";
const NAME_HEX_LEN: usize = 32;

/// A file with our name pattern but no valid header is only removed after this long, so that a
/// segment being created right now (header not yet written) is never taken for debris.
const HEADERLESS_GRACE: Duration = Duration::from_secs(60);

/// Bytes before the payload; the payload starts cache-line aligned.
pub const HEADER_SIZE: usize = 64;

/// What a segment holds; checked on open so a path for one kind is never mapped as another.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// A listener's accept slots.
    Worker = 1,
    /// One connection's rings and control block.
    Connection = 2,
    /// Raw payload, for tests and tools.
    Raw = 3,
    /// A prepared pair's shared words (`shm::words`).
    PrepWords = 4,
    /// A communicator's exchange board (`collectives::host_board`).
    Board = 5,
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: u32,
    kind: u32,
    total_len: u64,
    creator_pid: u32,
    _pad: u32,
    creator_start_time: u64,
    creator_pid_ns: u64,
    _reserved: [u64; 2],
}

const _: () = assert!(size_of::<Header>() == HEADER_SIZE);

/// The header fields, decoded from bytes (as `cleanup_stale` reads them with pread).
struct HeaderInfo {
    kind: u32,
    total_len: u64,
    creator: ProcessIdentity,
    creator_pid_ns: u64,
}

fn decode_header(b: &[u8; HEADER_SIZE]) -> Option<HeaderInfo> {
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
    if u64_at(offset_of!(Header, magic)) != MAGIC || u32_at(offset_of!(Header, version)) != VERSION {
        return None;
    }
    Some(HeaderInfo {
        kind: u32_at(offset_of!(Header, kind)),
        total_len: u64_at(offset_of!(Header, total_len)),
        creator: ProcessIdentity {
            pid: u32_at(offset_of!(Header, creator_pid)),
            start_time: u64_at(offset_of!(Header, creator_start_time)),
        },
        creator_pid_ns: u64_at(offset_of!(Header, creator_pid_ns)),
    })
}

/// One mapping of a segment file.
#[derive(Debug)]
pub struct Segment {
    base: NonNull<u8>,
    len: usize,
    path: PathBuf,
    creator: ProcessIdentity,
    /// Unlink the file on drop (we created it).
    owner: bool,
}

// SAFETY: `Segment` owns its mapping (nothing else unmaps it) and exposes it only as raw
// pointers; every structure placed in it synchronizes through atomics, so moving the handle to
// another thread or sharing it is no different from sharing it with another process.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` methods only read immutable fields or call unlink(2).
unsafe impl Sync for Segment {}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    let status = match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::ENOMEM) => Status::NoResource,
        Some(libc::EACCES) | Some(libc::EPERM) => Status::Rejected,
        _ => Status::IoError,
    };
    Error::new(status, format!("{what} {}: {e}", path.display()))
}

fn random_name() -> Result<String> {
    let mut r = [0u8; NAME_HEX_LEN / 2];
    getrandom::getrandom(&mut r).map_err(|e| Error::new(Status::Internal, format!("no randomness for segment name: {e}")))?;
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{NAME_PREFIX}{hex}"))
}

fn is_segment_name(name: &str) -> bool {
    name.strip_prefix(NAME_PREFIX)
        .is_some_and(|h| h.len() == NAME_HEX_LEN && h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)))
}

fn map(file: &File, len: usize, path: &Path) -> Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of `len` bytes of an open file; the kernel picks the address,
    // so no existing memory is affected. The fd may be closed afterwards; the mapping persists.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io_err("mmap", path, std::io::Error::last_os_error()));
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::new(Status::Internal, "mmap returned a null mapping"))
}

impl Segment {
    /// Create a new segment with `payload_len` zeroed bytes after the header, in `dir`.
    ///
    /// The file is created exclusively with mode 0600 and its space is reserved up front
    /// (posix_fallocate), so a full /dev/shm is reported here as `NoResource` rather than as a
    /// SIGBUS on first touch of a page.
    pub fn create(dir: &Path, kind: SegmentKind, payload_len: usize) -> Result<Segment> {
        let len = HEADER_SIZE.checked_add(payload_len).ok_or_else(|| Error::invalid_param("segment size overflows"))?;
        let path = dir.join(random_name()?);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io_err("create", &path, e))?;
        // From here on, an error must not leave the file behind.
        let unlink_on_err = |e: Error| {
            let _ = std::fs::remove_file(&path);
            e
        };
        file.set_len(len as u64).map_err(|e| unlink_on_err(io_err("ftruncate", &path, e)))?;
        let len_off = libc::off_t::try_from(len).map_err(|_| unlink_on_err(Error::invalid_param("segment too large")))?;
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_off) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(unlink_on_err(io_err("reserve space for", &path, e)));
        }
        let base = map(&file, len, &path).map_err(unlink_on_err)?;
        let creator = proc_identity::current();
        let seg = Segment { base, len, path, creator, owner: true };
        // SAFETY: the mapping is `len >= HEADER_SIZE` bytes, page aligned, and nobody else can
        // have it mapped yet validly (the magic is still 0), so writing the header is race-free.
        unsafe {
            let h = seg.base.as_ptr().cast::<Header>();
            (*h).version = VERSION;
            (*h).kind = kind as u32;
            (*h).total_len = len as u64;
            (*h).creator_pid = creator.pid;
            (*h).creator_start_time = creator.start_time;
            (*h).creator_pid_ns = proc_identity::pid_namespace();
            (*h).magic.store(MAGIC, Ordering::Release);
        }
        tracing::debug!(target: "gsc::shm", path = %seg.path.display(), len, ?kind, "segment created");
        Ok(seg)
    }

    /// Map an existing segment of the given kind, checking owner, size and header.
    pub fn open(path: &Path, kind: SegmentKind) -> Result<Segment> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io_err("open", path, e))?;
        let meta = file.metadata().map_err(|e| io_err("fstat", path, e))?;
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid {
            return Err(Error::new(Status::Rejected, format!("{} belongs to uid {}, not to us (uid {euid})", path.display(), meta.uid())));
        }
        let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
        if len < HEADER_SIZE || len == usize::MAX {
            return Err(Error::new(Status::InvalidAddress, format!("{} is {} bytes, too small for a segment", path.display(), meta.len())));
        }
        let base = map(&file, len, path)?;
        // Build the handle first so an error below unmaps on drop (owner = false: not ours).
        let mut seg = Segment { base, len, path: path.to_path_buf(), creator: ProcessIdentity { pid: 0, start_time: 0 }, owner: false };
        let mut raw = [0u8; HEADER_SIZE];
        // SAFETY: the mapping is at least HEADER_SIZE bytes. The magic is read with Acquire first
        // so the rest of the header, written before the creator's Release store, is visible.
        unsafe {
            let h = seg.base.as_ptr().cast::<Header>();
            let magic = (*h).magic.load(Ordering::Acquire);
            std::ptr::copy_nonoverlapping(seg.base.as_ptr(), raw.as_mut_ptr(), HEADER_SIZE);
            raw[..8].copy_from_slice(&magic.to_le_bytes());
        }
        let info = decode_header(&raw).ok_or_else(|| {
            Error::new(Status::InvalidAddress, format!("{} is not a gscomm segment of version {VERSION}", path.display()))
        })?;
        if info.kind != kind as u32 {
            return Err(Error::new(
                Status::InvalidAddress,
                format!("{} holds segment kind {}, expected {kind:?}", path.display(), info.kind),
            ));
        }
        if info.total_len != len as u64 {
            return Err(Error::new(
                Status::InvalidAddress,
                format!("{}: header says {} bytes, file has {len}", path.display(), info.total_len),
            ));
        }
        seg.creator = info.creator;
        Ok(seg)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The process that created the segment.
    pub fn creator(&self) -> ProcessIdentity {
        self.creator
    }

    /// Start of the payload (after the header), 64-byte aligned.
    pub fn payload(&self) -> *mut u8 {
        // SAFETY: the mapping is at least HEADER_SIZE bytes, so this stays inside it (or one past
        // its end when the payload is empty).
        unsafe { self.base.as_ptr().add(HEADER_SIZE) }
    }

    pub fn payload_len(&self) -> usize {
        self.len - HEADER_SIZE
    }

    /// The whole mapping (header included): page aligned, `len` bytes. What
    /// `cuMemHostRegister` needs.
    pub fn mapping(&self) -> (*mut u8, usize) {
        (self.base.as_ptr(), self.len)
    }

    /// Remove the file name. Mappings stay valid; `Ok(false)` if it was already gone.
    pub fn unlink(&self) -> Result<bool> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("unlink", &self.path, e)),
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner
            && let Err(e) = self.unlink()
        {
            tracing::warn!(target: "gsc::shm", error = %e, "segment left behind");
        }
        // SAFETY: `base`/`len` describe the mapping made in create/open, unmapped only here.
        // Every pointer into it is owned by a structure that holds this Segment, so none outlives
        // the mapping.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            tracing::warn!(target: "gsc::shm", path = %self.path.display(), error = %e, "munmap failed");
        }
    }
}

/// Remove segment files in `dir` whose creator has died; returns how many were removed.
///
/// Only files named like ours, owned by us, are considered. A file with a valid header is removed
/// when its creator, in our pid namespace, is no longer alive (creators in other pid namespaces
/// cannot be judged and are left alone). A file without a valid header is removed only once it is
/// older than a minute (its creator died between creating and initializing it).
pub fn cleanup_stale(dir: &Path) -> usize {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            tracing::debug!(target: "gsc::shm", dir = %dir.display(), error = %e, "cannot scan");
            return 0;
        }
    };
    let my_ns = proc_identity::pid_namespace();
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_segment_name) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.file_type().is_file() || meta.uid() != euid {
            continue;
        }
        let stale = match read_header(&path) {
            Some(info) => info.creator_pid_ns == my_ns && !proc_identity::is_alive(&info.creator),
            None => meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok()).is_some_and(|age| age > HEADERLESS_GRACE),
        };
        if stale {
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(target: "gsc::shm", path = %path.display(), "removed stale segment");
                    removed += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(target: "gsc::shm", path = %path.display(), error = %e, "stale segment not removed")
                }
            }
        }
    }
    removed
}

fn read_header(path: &Path) -> Option<HeaderInfo> {
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path).ok()?;
    let mut raw = [0u8; HEADER_SIZE];
    file.read_exact_at(&mut raw, 0).ok()?;
    decode_header(&raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::testutil::{ChildProc, TestDir, role};

    #[test]
    fn create_open_share_and_unlink() {
        let dir = TestDir::new("seg");
        let a = Segment::create(dir.path(), SegmentKind::Raw, 4096).unwrap();
        let name = a.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(is_segment_name(&name), "{name}");
        let mode = std::fs::metadata(a.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(a.payload() as usize % 64, 0);
        assert_eq!(a.creator(), proc_identity::current());

        let b = Segment::open(a.path(), SegmentKind::Raw).unwrap();
        assert_eq!(b.payload_len(), 4096);
        assert_eq!(b.creator(), a.creator());
        // SAFETY: both mappings are 4096 payload bytes of the same file.
        unsafe {
            a.payload().add(100).write(0x5a);
            assert_eq!(b.payload().add(100).read(), 0x5a);
        }
        let wrong = Segment::open(a.path(), SegmentKind::Worker).unwrap_err();
        assert_eq!(wrong.status(), Status::InvalidAddress, "{wrong:?}");
        drop(b); // an opener does not unlink
        assert_eq!(dir.entries(), vec![name]);
        drop(a); // the creator does
        assert!(dir.entries().is_empty());
    }

    #[test]
    fn open_rejects_foreign_files() {
        let dir = TestDir::new("segbad");
        let p = dir.path().join("gsc-00000000000000000000000000000000");
        std::fs::write(&p, [7u8; 200]).unwrap();
        let e = Segment::open(&p, SegmentKind::Raw).unwrap_err();
        assert_eq!(e.status(), Status::InvalidAddress, "{e:?}");
        std::fs::write(&p, [7u8; 10]).unwrap();
        let e = Segment::open(&p, SegmentKind::Raw).unwrap_err();
        assert_eq!(e.status(), Status::InvalidAddress, "{e:?}");
        let e = Segment::open(&dir.path().join("gsc-missing"), SegmentKind::Raw).unwrap_err();
        assert_eq!(e.status(), Status::IoError, "{e:?}");
        // A fresh header-less file is young, so it is not debris yet.
        assert_eq!(cleanup_stale(dir.path()), 0);
    }

    /// A child creates a segment and exits without dropping it (as if killed); cleanup removes it
    /// while leaving the live process's segment alone.
    #[test]
    fn cleanup_removes_segments_of_dead_creators() {
        const NAME: &str = "transport::shm::segment::tests::cleanup_removes_segments_of_dead_creators";
        if role().is_some() {
            let dir = PathBuf::from(crate::transport::shm::testutil::env("SEG_DIR"));
            let seg = Segment::create(&dir, SegmentKind::Raw, 64).unwrap();
            std::mem::forget(seg); // leak it: no unlink
            std::process::exit(0);
        }
        let dir = TestDir::new("segclean");
        let mine = Segment::create(dir.path(), SegmentKind::Raw, 64).unwrap();
        let mut child = ChildProc::spawn(NAME, "leak", &[("SEG_DIR", dir.path().to_string_lossy().into_owned())]);
        child.wait_success();
        assert_eq!(dir.entries().len(), 2);
        assert_eq!(cleanup_stale(dir.path()), 1);
        let left = dir.entries();
        assert_eq!(left, vec![mine.path().file_name().unwrap().to_string_lossy().into_owned()]);
        assert_eq!(cleanup_stale(dir.path()), 0);
    }
}

//! The disk cache of compiled kernels (`GSC_KERNEL_CACHE_DIR`, by default
//! `~/.cache/gscomm/kernels`): one cubin per source, options and architecture, named
//! `<digest of them>-sm_<arch>.cubin`. A damaged entry (not an ELF file) is compiled again.
//!
//! The processes of a machine share it, and the ranks of a job start together: on a fresh
//! machine every rank would otherwise compile every module at once — eight ranks, eight times
//! the work on the same cores. So an entry is compiled under a lock, `flock` on
//! `<entry>.lock` beside it: the process that takes it compiles and stores the cubin; the others
//! read it once the lock is released. `Entry::try_get` does not wait for another process's
//! compile: a caller with other entries to build builds those first, so the ranks share the
//! modules out between them, and then comes back with `Entry::get`, which waits. It waits at
//! most `LOCK_WAIT`: the lock dies with its holder's process, and a holder that is stuck costs
//! one compile of our own, not a hang. Where the directory cannot be written or `flock` is not
//! supported (some network file systems), each process compiles on its own, as it would
//! without the lock.
//!
//! Every build of gscomm with other kernel sources adds its own entries, so the cache is
//! bounded (`CACHE_MAX_BYTES`): storing an entry past the bound removes the least recently used
//! ones, by modification time, which a read renews. Removing an entry another process is about
//! to read only makes that process compile it again.

use crate::error::Result;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// How long `Entry::get` waits for another process's compile of the same entry before
/// compiling it itself. One module compiles in seconds even on a loaded machine.
const LOCK_WAIT: Duration = Duration::from_secs(120);
/// How often a waiting `Entry::get` tries the lock again.
const LOCK_POLL: Duration = Duration::from_millis(20);
/// The bytes of cubins the cache keeps: a type's collective module for sm_90 is 2.0–2.6 MB as
/// NVRTC 12.9 compiles it (f32, bf16, i8, e4m3 measured, 2026-11-23), about 25 MB a build, so
/// this holds some twenty builds.
const CACHE_MAX_BYTES: u64 = 512 << 20;
/// A read renews an entry's time for `prune` once it is this old.
const RENEW_AFTER: Duration = Duration::from_secs(24 * 3600);
/// A temporary file this old was left by a writer that died before renaming it.
const STALE_TMP: Duration = Duration::from_secs(3600);

/// One cache entry: where its cubin is (none without a cache directory).
pub(crate) struct Entry {
    dir: Option<PathBuf>,
    name: String,
}

/// What `Entry::try_get` found.
pub(crate) enum Found {
    Cubin(Vec<u8>),
    /// Another process is compiling this entry now.
    Busy,
}

/// A held lock on an entry; released when dropped (closing the file releases the `flock`).
struct Lock(#[allow(dead_code)] File);

enum Locked {
    Held(Lock),
    Busy,
    /// Locking is not possible here (no directory, a read-only one, no `flock`): compile alone.
    Unavailable,
}

impl Entry {
    /// The entry of `source` compiled with `options` for `arch`, under `dir` (else the default
    /// directory, if there is one).
    pub(crate) fn new(source: &str, options: &[String], arch: (i32, i32), dir: Option<&Path>) -> Entry {
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        for o in options {
            h.update(o.as_bytes());
        }
        let digest: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
        let dir = dir.map(Path::to_path_buf).or_else(crate::config::default_kernel_cache_dir);
        Entry { dir, name: format!("{digest}-sm_{}{}", arch.0, arch.1) }
    }

    /// The cubin, from the cache or from `compile` (stored for next time), without waiting for
    /// another process that is compiling it (`Found::Busy`).
    pub(crate) fn try_get(&self, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Found> {
        if let Some(c) = self.read() {
            return Ok(Found::Cubin(c));
        }
        match self.lock(false) {
            Locked::Busy => Ok(Found::Busy),
            Locked::Held(lock) => self.fill(compile, Some(lock)).map(Found::Cubin),
            Locked::Unavailable => self.fill(compile, None).map(Found::Cubin),
        }
    }

    /// The cubin, from the cache or from `compile` (stored for next time); while another
    /// process compiles it, waits for that (at most `LOCK_WAIT`).
    pub(crate) fn get(&self, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
        if let Some(c) = self.read() {
            return Ok(c);
        }
        let lock = match self.lock(true) {
            Locked::Held(lock) => Some(lock),
            Locked::Busy => {
                tracing::warn!(target: "gsc::cuda", entry = %self.name, waited = ?LOCK_WAIT, "another process has held the kernel cache entry's lock this long; compiling it here too");
                None
            }
            Locked::Unavailable => None,
        };
        self.fill(compile, lock)
    }

    /// Under the lock (or without one): the entry may have been stored since we looked.
    fn fill(&self, compile: impl FnOnce() -> Result<Vec<u8>>, lock: Option<Lock>) -> Result<Vec<u8>> {
        if lock.is_some()
            && let Some(c) = self.read()
        {
            return Ok(c);
        }
        let cubin = compile()?;
        self.store(&cubin);
        drop(lock);
        Ok(cubin)
    }

    fn path(&self, suffix: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{}{suffix}", self.name)))
    }

    fn read(&self) -> Option<Vec<u8>> {
        let path = self.path(".cubin")?;
        let bytes = std::fs::read(&path).ok()?;
        // A cubin is an ELF file; anything else is a damaged entry, compiled again.
        if !bytes.starts_with(b"\x7fELF") {
            return None;
        }
        // Used now, for `prune`; at most once a day, so that the ranks of a large job reading a
        // cache on a shared file system do not each write its metadata (a read-only cache keeps
        // its times: nothing is pruned there).
        let now = SystemTime::now();
        let modified = std::fs::metadata(&path).and_then(|m| m.modified());
        if modified.is_ok_and(|m| now.duration_since(m).is_ok_and(|age| age > RENEW_AFTER)) {
            let _ = File::options().write(true).open(&path).and_then(|f| f.set_modified(now));
        }
        Some(bytes)
    }

    fn store(&self, cubin: &[u8]) {
        let (Some(d), Some(p)) = (&self.dir, self.path(".cubin")) else { return };
        // Written to a temporary name and renamed, so a concurrent reader never sees half a
        // file (the name is the thread's too: two threads of a process may store one entry).
        let tmp = d.join(format!(".{}.{}.{:?}.tmp", self.name, std::process::id(), std::thread::current().id()));
        let stored = std::fs::create_dir_all(d).and_then(|_| std::fs::write(&tmp, cubin)).and_then(|_| std::fs::rename(&tmp, &p));
        if let Err(e) = stored {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(target: "gsc::cuda", dir = %d.display(), error = %e, "cannot write the kernel cache; compiling again next time");
            return;
        }
        let removed = prune(d, CACHE_MAX_BYTES);
        if removed > 0 {
            tracing::debug!(target: "gsc::cuda", dir = %d.display(), removed, "kernel cache over its bound: least recently used entries removed");
        }
    }

    /// Take the entry's lock; `wait`: for at most `LOCK_WAIT` while another holds it.
    fn lock(&self, wait: bool) -> Locked {
        let (Some(d), Some(p)) = (&self.dir, self.path(".lock")) else { return Locked::Unavailable };
        let file = std::fs::create_dir_all(d).and_then(|_| File::options().create(true).truncate(false).write(true).open(&p));
        let Ok(file) = file else { return Locked::Unavailable };
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            // SAFETY: `flock` on a descriptor we own and keep open for the call; it touches no
            // memory. The lock belongs to this open file: two opens conflict even in one process.
            let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if r == 0 {
                return Locked::Held(Lock(file));
            }
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EWOULDBLOCK) => {}
                Some(libc::EINTR) => continue,
                _ => return Locked::Unavailable,
            }
            if !wait || Instant::now() >= deadline {
                return Locked::Busy;
            }
            std::thread::sleep(LOCK_POLL);
        }
    }
}

/// While the cubins in `dir` take more than `max` bytes, remove the least recently used
/// (oldest modification time) with their lock files, down to three quarters of `max`; also
/// temporary files older than `STALE_TMP`. Returns how many cubins went.
fn prune(dir: &Path, max: u64) -> usize {
    let Ok(listing) = std::fs::read_dir(dir) else { return 0 };
    let now = SystemTime::now();
    let mut cubins: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for e in listing.filter_map(|e| e.ok()) {
        let (path, Ok(meta)) = (e.path(), e.metadata()) else { continue };
        let Ok(modified) = meta.modified() else { continue };
        match path.extension().and_then(|x| x.to_str()) {
            Some("cubin") => cubins.push((modified, meta.len(), path)),
            Some("tmp") if now.duration_since(modified).is_ok_and(|age| age > STALE_TMP) => {
                let _ = std::fs::remove_file(&path);
            }
            _ => {}
        }
    }
    let mut total: u64 = cubins.iter().map(|c| c.1).sum();
    if total <= max {
        return 0;
    }
    cubins.sort();
    let mut removed = 0;
    for (_, len, path) in cubins {
        if total <= max / 4 * 3 {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            let _ = std::fs::remove_file(path.with_extension("lock"));
            total -= len;
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, Status};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gsc-kernel-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn elf(tag: u8) -> Vec<u8> {
        let mut v = b"\x7fELF".to_vec();
        v.push(tag);
        v
    }

    #[test]
    fn concurrent_getters_compile_an_entry_once() {
        let dir = temp_dir("once");
        let compiles = AtomicUsize::new(0);
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let jobs: Vec<_> = (0..6)
                .map(|_| {
                    s.spawn(|| {
                        Entry::new("src", &["-a".into()], (9, 0), Some(&dir))
                            .get(|| {
                                compiles.fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(100));
                                Ok(elf(1))
                            })
                            .unwrap()
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()).collect()
        });
        assert_eq!(compiles.load(Ordering::SeqCst), 1, "one compile, the others read it");
        assert!(got.iter().all(|c| *c == elf(1)));
        // Another source, options or architecture is another entry.
        for (src, opt, arch) in [("src2", "-a", (9, 0)), ("src", "-b", (9, 0)), ("src", "-a", (8, 0))] {
            let c = Entry::new(src, &[opt.into()], arch, Some(&dir)).get(|| Ok(elf(2))).unwrap();
            assert_eq!(c, elf(2), "{src} {opt} {arch:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn try_get_leaves_an_entry_being_compiled_to_its_compiler() {
        let dir = temp_dir("busy");
        let e = Entry::new("src", &[], (9, 0), Some(&dir));
        let Locked::Held(held) = e.lock(false) else { panic!("an unheld lock") };
        assert!(matches!(e.try_get(|| panic!("must not compile a busy entry")).unwrap(), Found::Busy));
        // The holder stores it and lets go: now it is read, not compiled.
        e.store(&elf(3));
        drop(held);
        match e.try_get(|| panic!("must read the stored entry")).unwrap() {
            Found::Cubin(c) => assert_eq!(c, elf(3)),
            Found::Busy => panic!("busy after the holder let go"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_entry_is_compiled_again_and_a_failed_compile_stores_nothing() {
        let dir = temp_dir("damaged");
        let e = Entry::new("src", &[], (9, 0), Some(&dir));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(e.path(".cubin").unwrap(), b"half a file").unwrap();
        let err = e.get(|| Err(Error::new(Status::DeviceError, "no compiler"))).unwrap_err();
        assert!(err.message().contains("no compiler"));
        assert_eq!(std::fs::read(e.path(".cubin").unwrap()).unwrap(), b"half a file", "a failure changes nothing");
        assert_eq!(e.get(|| Ok(elf(4))).unwrap(), elf(4));
        assert_eq!(e.get(|| panic!("cached now")).unwrap(), elf(4));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_directory_still_compiles() {
        // A directory that cannot be made (its parent is a file): no lock, no store, a cubin.
        let file = temp_dir("file");
        std::fs::write(&file, b"").unwrap();
        let e = Entry::new("src", &[], (9, 0), Some(&file.join("sub")));
        assert!(matches!(e.lock(true), Locked::Unavailable));
        assert_eq!(e.get(|| Ok(elf(5))).unwrap(), elf(5));
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn past_its_bound_the_cache_drops_the_least_recently_used_entries() {
        let dir = temp_dir("prune");
        std::fs::create_dir_all(&dir).unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(1000);
        let entry = |i: u64| dir.join(format!("e{i}.cubin"));
        for i in 0..6u64 {
            std::fs::write(entry(i), vec![0u8; 100]).unwrap();
            std::fs::write(dir.join(format!("e{i}.lock")), b"").unwrap();
            let f = File::options().write(true).open(entry(i)).unwrap();
            f.set_modified(t0 + Duration::from_secs(10 * i)).unwrap();
        }
        // A read makes e0, the oldest (older than a day), the most recently used.
        let e0 = Entry { dir: Some(dir.clone()), name: "e0".into() };
        std::fs::write(entry(0), elf(0).into_iter().chain([0u8; 95]).collect::<Vec<u8>>()).unwrap();
        File::options().write(true).open(entry(0)).unwrap().set_modified(t0 - RENEW_AFTER).unwrap();
        assert!(e0.read().is_some());
        let renewed = std::fs::metadata(entry(0)).unwrap().modified().unwrap();
        assert!(renewed > t0 + Duration::from_secs(60), "the read renewed e0's time");
        // A read of an entry used within the day leaves its time alone.
        let e5 = Entry { dir: Some(dir.clone()), name: "e5".into() };
        std::fs::write(entry(5), elf(5).into_iter().chain([0u8; 95]).collect::<Vec<u8>>()).unwrap();
        File::options().write(true).open(entry(5)).unwrap().set_modified(t0 + Duration::from_secs(50)).unwrap();
        assert!(e5.read().is_some());
        assert_eq!(std::fs::metadata(entry(5)).unwrap().modified().unwrap(), t0 + Duration::from_secs(50));
        let stale = dir.join(".x.1.tmp");
        std::fs::write(&stale, b"half").unwrap();
        File::options().write(true).open(&stale).unwrap().set_modified(t0 - STALE_TMP).unwrap();
        assert_eq!(prune(&dir, 10_000), 0, "under the bound nothing goes");
        assert!(!stale.exists(), "a stale temporary file goes anyway");
        // 600 bytes against 350: the oldest go until at most 262 are left.
        assert_eq!(prune(&dir, 350), 4);
        let left: Vec<bool> = (0..6).map(|i| entry(i).exists()).collect();
        assert_eq!(left, [true, false, false, false, false, true], "e0 (just read) and e5 (newest) stay");
        for i in 1..5 {
            assert!(!dir.join(format!("e{i}.lock")).exists(), "e{i}'s lock goes with it");
        }
        assert!(dir.join("e5.lock").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

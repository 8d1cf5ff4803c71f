//! Cross-memory attach: reading and writing another process's memory with
//! process_vm_readv/writev, and the probe that tells whether the kernel allows it to a given peer.
//!
//! The kernel permits CMA when the caller may ptrace the target (same uid and, with Yama, a
//! suitable ptrace_scope; containers and seccomp may forbid it). The only reliable test is to try:
//! each process exposes a random cookie at a known address, and a peer reads it back. Reading the
//! expected value also proves the pid still names the process that published the address.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result, Status};
use crate::transport::shm::CmaMode;

/// This process's probe cookie; its address and value go into addresses and connection segments.
static COOKIE: AtomicU64 = AtomicU64::new(0);

/// Largest single transfer handed to the kernel (it caps one call at MAX_RW_COUNT anyway).
const CHUNK: usize = 1 << 30;

/// (address, value) of this process's probe cookie; the value is random and never 0.
pub fn cookie() -> (u64, u64) {
    let mut v = COOKIE.load(Ordering::Acquire);
    if v == 0 {
        let mut r = [0u8; 8];
        // Randomness failure only weakens the probe (a guessable value), it does not break it.
        if let Err(e) = getrandom::getrandom(&mut r) {
            tracing::warn!(target: "gsc::shm", error = %e, "CMA cookie not random");
        }
        let fresh = u64::from_ne_bytes(r) | 1;
        v = match COOKIE.compare_exchange(0, fresh, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => fresh,
            Err(existing) => existing,
        };
    }
    (COOKIE.as_ptr() as u64, v)
}

/// Can we read process `pid`'s memory? Reads its cookie at `addr` and compares with `expect`.
/// `Err` carries the reason, for logs and for the error when CMA is required.
pub fn probe(pid: u32, addr: u64, expect: u64) -> std::result::Result<(), String> {
    let mut got = 0u64;
    // SAFETY: `got` is valid for 8 bytes of writes for the duration of the call.
    let r = unsafe { transfer(pid, (&raw mut got).cast(), addr, 8, Dir::Read) };
    match r {
        Ok(()) if got == expect => Ok(()),
        Ok(()) => Err(format!("pid {pid} has a different cookie at {addr:#x} (not the same process)")),
        Err(e) => Err(e.message().to_string()),
    }
}

/// Whether a link to process `pid` (whose cookie is `addr`/`value`) gets remote memory access.
/// `Auto`: if the probe succeeds. `On`: the probe must succeed, else `Unsupported`. `Off`: never.
pub fn decide(mode: CmaMode, pid: u32, addr: u64, value: u64) -> Result<bool> {
    match mode {
        CmaMode::Off => Ok(false),
        CmaMode::Auto => match probe(pid, addr, value) {
            Ok(()) => Ok(true),
            Err(why) => {
                tracing::debug!(target: "gsc::shm", pid, %why, "no cross-memory attach; frames only");
                Ok(false)
            }
        },
        CmaMode::On => probe(pid, addr, value).map(|()| true).map_err(|why| {
            Error::new(Status::Unsupported, format!("cross-memory attach required (cma=on) but unavailable to pid {pid}: {why}"))
        }),
    }
}

#[derive(Copy, Clone, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

fn os_error(pid: u32, remote: u64, len: usize, err: std::io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::EFAULT) => {
            Error::new(Status::OutOfRange, format!("remote address range not accessible: [{remote:#x}, +{len}) in pid {pid}"))
        }
        Some(libc::ESRCH) => Error::new(Status::PeerFailed, format!("peer process {pid} is gone")),
        Some(libc::EPERM) => {
            Error::new(Status::Unsupported, format!("cross-memory attach to pid {pid} not permitted (ptrace policy): {err}"))
        }
        Some(libc::ENOSYS) => Error::new(Status::Unsupported, "process_vm_readv/writev not available in this kernel"),
        Some(libc::ENOMEM) => Error::new(Status::NoMemory, format!("cross-memory attach: {err}")),
        _ => Error::new(Status::IoError, format!("cross-memory attach to pid {pid}: {err}")),
    }
}

/// Copy `len` bytes between `local` and `remote` in process `pid`, looping over partial
/// transfers; chunks of at most 1 GiB.
///
/// # Safety
/// `local` must be valid for `len` bytes of writes (`Dir::Read`) or reads (`Dir::Write`).
pub unsafe fn transfer(pid: u32, local: *mut u8, remote: u64, len: usize, dir: Dir) -> Result<()> {
    let Ok(pid_t) = libc::pid_t::try_from(pid) else {
        return Err(Error::invalid_param(format!("pid {pid} out of range")));
    };
    if remote.checked_add(len as u64).is_none() {
        return Err(Error::new(Status::OutOfRange, format!("remote range [{remote:#x}, +{len}) wraps the address space")));
    }
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        let liov = libc::iovec {
            // SAFETY: `done < len`, so this stays inside the caller's buffer.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: n,
        };
        let riov = libc::iovec { iov_base: (remote + done as u64) as *mut libc::c_void, iov_len: n };
        // SAFETY: one local iovec inside the caller's valid buffer (contract); the remote iovec
        // is checked by the kernel against the target's address space, never dereferenced here.
        let rc = unsafe {
            match dir {
                Dir::Read => libc::process_vm_readv(pid_t, &liov, 1, &riov, 1, 0),
                Dir::Write => libc::process_vm_writev(pid_t, &liov, 1, &riov, 1, 0),
            }
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(os_error(pid, remote + done as u64, len - done, err));
        }
        if rc == 0 {
            // No progress without an error: treat the rest as inaccessible rather than spin.
            return Err(os_error(pid, remote + done as u64, len - done, std::io::Error::from_raw_os_error(libc::EFAULT)));
        }
        done += rc as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_and_transfer_within_this_process() {
        let (addr, value) = cookie();
        assert_ne!(value, 0);
        assert_eq!(cookie(), (addr, value), "stable");
        let me = std::process::id();
        probe(me, addr, value).expect("CMA to self works on this host");
        assert!(probe(me, addr, value ^ 1).unwrap_err().contains("different cookie"));

        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: dst is valid for its length; src is a live buffer in this process.
        unsafe { transfer(me, dst.as_mut_ptr(), src.as_ptr() as u64, src.len(), Dir::Read).unwrap() };
        assert_eq!(dst, src);
        let mut back = vec![0u8; 1000];
        // SAFETY: src readable for 1000 bytes; back is a live 1000-byte buffer.
        unsafe { transfer(me, src.as_ptr().cast_mut(), back.as_mut_ptr() as u64, 1000, Dir::Write).unwrap() };
        assert_eq!(back[..], src[..1000]);

        // Address 8 is never mapped.
        // SAFETY: dst is valid for 16 bytes.
        let e = unsafe { transfer(me, dst.as_mut_ptr(), 8, 16, Dir::Read) }.unwrap_err();
        assert_eq!(e.status(), Status::OutOfRange, "{e:?}");
        assert!(e.message().contains("remote address range not accessible"));
        // SAFETY: as above.
        let e = unsafe { transfer(me, dst.as_mut_ptr(), u64::MAX - 4, 16, Dir::Read) }.unwrap_err();
        assert_eq!(e.status(), Status::OutOfRange, "{e:?}");
        // SAFETY: zero-length transfers touch nothing.
        unsafe { transfer(me, dst.as_mut_ptr(), 8, 0, Dir::Read) }.unwrap();

        assert!(decide(CmaMode::Auto, me, addr, value).unwrap());
        assert!(!decide(CmaMode::Auto, me, addr, value ^ 1).unwrap());
        assert!(!decide(CmaMode::Off, me, addr, value).unwrap());
        assert!(decide(CmaMode::On, me, addr, value).unwrap());
        let e = decide(CmaMode::On, me, 8, value).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e:?}");
    }

    #[test]
    fn partial_transfer_then_fault_is_reported() {
        // Map two pages and unmap the second: a read across the boundary transfers the first
        // page, then must report the fault instead of looping.
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
        // SAFETY: a fresh anonymous mapping of two pages.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), 2 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the second page belongs to the mapping just made; nothing refers to it.
        let rc = unsafe { libc::munmap(p.cast::<u8>().add(page).cast(), page) };
        assert_eq!(rc, 0);
        let mut dst = vec![0u8; 2 * page];
        // SAFETY: dst is valid for 2 pages; the remote range is checked by the kernel.
        let e = unsafe { transfer(std::process::id(), dst.as_mut_ptr(), p as u64, 2 * page, Dir::Read) }.unwrap_err();
        assert_eq!(e.status(), Status::OutOfRange, "{e:?}");
        // SAFETY: unmapping the first page we still own.
        unsafe { libc::munmap(p, page) };
    }

    #[test]
    fn dead_pid_is_peer_failed() {
        let mut child =
            std::process::Command::new(std::env::current_exe().unwrap()).arg("--list").stdout(std::process::Stdio::null()).spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let mut v = 0u64;
        // SAFETY: v is valid for 8 bytes.
        let e = unsafe { transfer(pid, (&raw mut v).cast(), 4096, 8, Dir::Read) }.unwrap_err();
        assert_eq!(e.status(), Status::PeerFailed, "{e:?}");
    }
}

//! Who a process is, in a way that survives pid reuse, and whether two processes share a host.
//!
//! A pid alone does not name a process: once it exits, the kernel may hand the same number to an
//! unrelated process. `ProcessIdentity` pairs the pid with the process start time (field 22 of
//! `/proc/<pid>/stat`, in clock ticks since boot), which together are unique for the life of a
//! boot. Liveness checks compare both, so a recycled pid is never taken for the original peer.

use std::io::ErrorKind;

use crate::error::{Error, Result, Status};
use crate::transport::ProcessIdentity;

/// What one read of `/proc/<pid>/stat` tells us.
struct Stat {
    /// One-letter process state (R, S, D, T, t, Z, X, ...).
    state: u8,
    start_time: u64,
}

/// Parse the text of `/proc/<pid>/stat`.
///
/// The second field (`comm`) is the executable name in parentheses and may itself contain spaces
/// and parentheses, so the fixed fields are only found after the *last* `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let close = text.rfind(')')?;
    let mut rest = text[close + 1..].split_ascii_whitespace();
    // After the comm field: field 3 is the state, field 22 the start time (19 fields later).
    let state = rest.next()?.bytes().next()?;
    let start_time = rest.nth(18)?.parse::<u64>().ok()?;
    Some(Stat { state, start_time })
}

/// `Ok(None)` when the process does not exist.
fn read_stat(pid: u32) -> Result<Option<Stat>> {
    let path = format!("/proc/{pid}/stat");
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_stat(&text).map(Some).ok_or_else(|| Error::new(Status::IoError, format!("{path}: unexpected format"))),
        // ESRCH shows up when the process exits between open and read.
        Err(e) if e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// The state letters of a process that has exited: only its table entry (if anything) remains.
fn is_exited_state(state: u8) -> bool {
    state == b'Z' || state == b'X' || state == b'x'
}

/// This process. Read fresh on every call (it is cheap and only used at setup) so that a forked
/// child reports itself, not its parent.
///
/// If `/proc` cannot be read the start time is reported as 0, which liveness checks treat as
/// "unknown" and fall back to comparing the pid alone.
pub fn current() -> ProcessIdentity {
    let pid = std::process::id();
    match read_stat(pid) {
        Ok(Some(stat)) => ProcessIdentity { pid, start_time: stat.start_time },
        Ok(None) => {
            tracing::warn!(target: "gsc::shm", pid, "/proc/self/stat missing; start time unknown");
            ProcessIdentity { pid, start_time: 0 }
        }
        Err(e) => {
            tracing::warn!(target: "gsc::shm", pid, error = %e, "start time unknown");
            ProcessIdentity { pid, start_time: 0 }
        }
    }
}

/// The identity of process `pid`, or `None` if there is no such process or it has exited (a
/// zombie waiting to be reaped counts as gone).
pub fn read(pid: u32) -> Result<Option<ProcessIdentity>> {
    if pid == 0 {
        return Ok(None);
    }
    Ok(read_stat(pid)?.filter(|s| !is_exited_state(s.state)).map(|s| ProcessIdentity { pid, start_time: s.start_time }))
}

/// Is the process named by `id` still running? False when the pid is gone, is a zombie, or now
/// belongs to a different process (different start time).
///
/// When `/proc` cannot be read, falls back to `kill(pid, 0)` and answers "alive" unless the kernel
/// says there is no such process: wrongly declaring a peer dead is worse than noticing late.
pub fn is_alive(id: &ProcessIdentity) -> bool {
    match read(id.pid) {
        Ok(Some(now)) => id.start_time == 0 || now.start_time == id.start_time,
        Ok(None) => false,
        Err(e) => {
            tracing::debug!(target: "gsc::shm", pid = id.pid, error = %e, "falling back to kill(0)");
            let Ok(pid) = libc::pid_t::try_from(id.pid) else {
                return false;
            };
            // SAFETY: signal 0 performs only the existence and permission check; nothing is sent.
            let rc = unsafe { libc::kill(pid, 0) };
            rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

/// The pid namespace this process lives in (inode of `/proc/self/ns/pid`), or 0 when unknown.
///
/// Pids, liveness checks and cross-memory attach only mean something between processes of one
/// pid namespace; two containers on one host can share /dev/shm yet not see each other's pids.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/ns/pid") {
        Ok(m) => m.ino(),
        Err(e) => {
            tracing::debug!(target: "gsc::shm", error = %e, "pid namespace unknown");
            0
        }
    }
}

/// The network namespace this process lives in (inode of `/proc/self/ns/net`), or 0 when unknown.
pub fn net_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/ns/net") {
        Ok(m) => m.ino(),
        Err(e) => {
            tracing::debug!(target: "gsc::shm", error = %e, "network namespace unknown");
            0
        }
    }
}

/// FNV-1a: a hash whose value is fixed by its definition, so every build of every worker on a host
/// computes the same identifier (std's `DefaultHasher` makes no such promise across releases).
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// A stable identifier of this host and boot, as gscomm counts hosts: a hash of the kernel boot
/// id, the host name and the network namespace.
///
/// Two workers with equal `host_id` are on the same machine since the same boot, which is the
/// precondition for the shared-memory lane (it still verifies that the segment is reachable).
/// The network namespace is part of it so that two namespaces of one machine count as two hosts
/// (containers with their own network usually have their own /dev/shm too): their workers talk
/// over the UCX lane, which is also how the multi-host tests run on one machine.
pub fn host_id() -> u64 {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_else(|e| {
        tracing::debug!(target: "gsc::shm", error = %e, "boot_id unreadable; host id from hostname");
        String::new()
    });
    let hostname = hostname();
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, boot_id.trim().as_bytes());
    h = fnv1a(h, &[0]);
    h = fnv1a(h, hostname.as_bytes());
    h = fnv1a(h, &[0]);
    fnv1a(h, &net_namespace().to_le_bytes())
}

/// `host_id`, with a `GSC_FAKE_HOST` label mixed in when there is one: processes of one machine
/// with different labels count as different hosts (the way tests make one machine look like
/// several, for the UCX lane and hierarchical collectives).
pub fn host_id_labelled(label: Option<&str>) -> u64 {
    match label {
        None => host_id(),
        Some(l) => fnv1a(fnv1a(host_id(), b"\0fake-host\0"), l.as_bytes()),
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for `buf.len()` bytes of writes; the kernel NUL-terminates within it
    // when the name fits, and the last byte stays 0 because we pass one byte less.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::testutil::{self, ChildProc};
    use std::time::{Duration, Instant};

    #[test]
    fn parses_comm_with_spaces_and_parens() {
        // 52 fields as on Linux 6.x; comm is "a) (b c" which contains both parens and spaces.
        let mut fields: Vec<String> = (4..=52).map(|i| i.to_string()).collect();
        fields[22 - 4] = "987654321".into();
        let text = format!("1234 (a) (b c) S {}\n", fields.join(" "));
        let stat = parse_stat(&text).expect("parses");
        assert_eq!(stat.state, b'S');
        assert_eq!(stat.start_time, 987_654_321);
        assert!(parse_stat("1234 (x) S 1 2").is_none(), "too few fields must not parse");
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn self_is_alive_and_stable() {
        let me = current();
        assert_eq!(me.pid, std::process::id());
        assert_ne!(me.start_time, 0, "/proc is mounted in the test environment");
        assert_eq!(read(me.pid).unwrap(), Some(me));
        assert!(is_alive(&me));
        assert_eq!(current(), me);
        // A different start time with the same pid is a different process (pid reuse).
        assert!(!is_alive(&ProcessIdentity { pid: me.pid, start_time: me.start_time + 1 }));
        assert!(!is_alive(&ProcessIdentity { pid: me.pid, start_time: me.start_time - 1 }));
        assert_eq!(read(0).unwrap(), None);
    }

    #[test]
    fn host_id_is_stable_and_namespace_known() {
        assert_eq!(host_id(), host_id());
        assert_ne!(host_id(), 0);
        assert_ne!(pid_namespace(), 0);
        assert_ne!(net_namespace(), 0);
        assert_ne!(fnv1a(1, b"a"), fnv1a(1, b"b"));
        assert_eq!(host_id_labelled(None), host_id());
        assert_eq!(host_id_labelled(Some("a")), host_id_labelled(Some("a")));
        assert_ne!(host_id_labelled(Some("a")), host_id_labelled(Some("b")));
        assert_ne!(host_id_labelled(Some("a")), host_id());
    }

    /// The child waits for its stdin to close; the parent watches it live, exit (zombie), and be
    /// reaped (gone).
    #[test]
    fn exited_child_is_not_alive() {
        const NAME: &str = "transport::proc_identity::tests::exited_child_is_not_alive";
        if testutil::role().is_some() {
            let mut sink = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink).unwrap();
            return;
        }
        let mut child = ChildProc::spawn(NAME, "wait-stdin", &[]);
        let id = read(child.pid()).unwrap().expect("child exists");
        assert!(is_alive(&id));
        child.close_stdin();
        // Not reaped yet: the child becomes a zombie, which must already count as dead.
        let deadline = Instant::now() + testutil::TIME_LIMIT;
        while is_alive(&id) {
            assert!(Instant::now() < deadline, "child still alive after stdin closed");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(read(id.pid).unwrap(), None);
        child.wait_success();
        assert!(!is_alive(&id));
        assert_eq!(read(id.pid).unwrap(), None);
    }
}

//! Passing file descriptors between processes of one host: a per-process exporter service on an
//! abstract Unix socket, and a client that fetches one descriptor from it (SCM_RIGHTS).
//!
//! What it is for: a CUDA VMM allocation is shared with another process as a POSIX file
//! descriptor (`cuMemExportToShareableHandle`), and a descriptor only crosses a process boundary
//! through a Unix socket. The sender publishes the descriptor here and puts the service's name and
//! the export id in the rendezvous key; the receiver connects, asks for that id and gets a
//! duplicate of the descriptor.
//!
//! Design:
//! - One service per process, started on first use: one listening socket, one thread that
//!   accepts connections one at a time and answers one request per connection. Requests are rare
//!   (one per peer allocation and GPU: the importer caches its mapping), so one thread is enough.
//! - The name is in the abstract namespace (`@gscomm-fd.<pid>.<32 hex>`): nothing in the file
//!   system to clean up after a crash (it disappears with the last descriptor of the socket), and
//!   the 128-bit random token means it cannot collide with another process's name, a reused pid
//!   included. Abstract names are scoped by network namespace: processes in different network
//!   namespaces cannot reach each other's service, and the fetch then fails (the caller falls back).
//! - Anyone in the namespace can connect to an abstract socket (there are no file permissions), so
//!   the service checks the connecting process's uid (SO_PEERCRED) and refuses other users. The
//!   client checks the service's uid too, so a squatter of another user cannot hand it a
//!   descriptor. Same-uid processes are trusted (they could ptrace us anyway).
//! - Every step of a fetch is bounded by its timeout (SO_RCVTIMEO/SO_SNDTIMEO set to the time
//!   left before each step, connect included): a dead exporter is a refused connection at once, a
//!   stuck one an error after the timeout, never a hang. The service bounds each client the same
//!   way, so a client that connects and says nothing cannot block it for long.
//!
//! Wire (little-endian): request `"GSFD"`, version u16 = 1, reserved u16 = 0, export id u64
//! (16 bytes); reply `"GSFD"`, code u32 (8 bytes), with the descriptor as SCM_RIGHTS when the code
//! is 0.
//!
//! Not done: more than one request per connection; a service that survives `fork` (a forked
//! child that exports gets an error: the service thread is not in it).

use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"GSFD";
const VERSION: u16 = 1;
const REQUEST_LEN: usize = 16;
const REPLY_LEN: usize = 8;
/// Random bytes in a service name.
pub(crate) const TOKEN_LEN: usize = 16;
/// How long the service gives one client to send its request and take the answer.
const SERVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Descriptors a reply may carry that the client still reads (to close extras rather than leak).
const MAX_FDS: usize = 4;
/// Room for one SCM_RIGHTS message of MAX_FDS descriptors, as u64s (cmsghdr alignment).
const CMSG_WORDS: usize = 8;
// SAFETY: CMSG_SPACE is pure arithmetic.
const _: () = assert!(unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize <= CMSG_WORDS * 8);

/// Reply codes.
const OK: u32 = 0;
const UNKNOWN_ID: u32 = 1;
const BAD_REQUEST: u32 = 2;
const DENIED: u32 = 3;
const EXPORTER_ERROR: u32 = 4;

/// The name of one process's service: its pid (as that process sees it) and a random token.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SocketName {
    pub pid: u32,
    pub token: [u8; TOKEN_LEN],
}

impl SocketName {
    fn fresh() -> Result<SocketName> {
        let mut token = [0u8; TOKEN_LEN];
        getrandom::getrandom(&mut token)
            .map_err(|e| Error::new(Status::Internal, format!("no randomness for the fd exporter's name: {e}")))?;
        Ok(SocketName { pid: std::process::id(), token })
    }

    /// The abstract name, without the leading NUL.
    fn text(&self) -> String {
        let hex: String = self.token.iter().map(|b| format!("{b:02x}")).collect();
        format!("gscomm-fd.{}.{hex}", self.pid)
    }

    fn sockaddr(&self) -> (libc::sockaddr_un, libc::socklen_t) {
        // SAFETY: all-zero is a valid sockaddr_un.
        let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        a.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let text = self.text();
        // sun_path[0] stays 0: the abstract namespace. The name is < 60 bytes, the path 108.
        for (d, s) in a.sun_path[1..].iter_mut().zip(text.bytes()) {
            *d = s as libc::c_char;
        }
        let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + text.len();
        (a, len as libc::socklen_t)
    }
}

impl std::fmt::Display for SocketName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "@{}", self.text())
    }
}

struct Shared {
    name: SocketName,
    fds: Mutex<HashMap<u64, OwnedFd>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    serve_timeout: Duration,
}

/// A running exporter service. Dropping it stops the thread and unbinds the name.
pub(crate) struct FdServer {
    shared: Arc<Shared>,
    listener: Arc<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdServer {
    pub(crate) fn start() -> Result<FdServer> {
        FdServer::start_with(SERVE_TIMEOUT)
    }

    fn start_with(serve_timeout: Duration) -> Result<FdServer> {
        let name = SocketName::fresh()?;
        let listener = Arc::new(bind_listener(&name)?);
        let shared = Arc::new(Shared {
            name,
            fds: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            serve_timeout,
        });
        let (s, l) = (shared.clone(), listener.clone());
        let thread = std::thread::Builder::new()
            .name("gsc-fd-export".into())
            .spawn(move || serve(&s, &l))
            .map_err(|e| Error::io("starting the fd exporter thread", e))?;
        tracing::debug!(target: "gsc::cuda", name = %name, "fd exporter listening");
        Ok(FdServer { shared, listener, thread: Some(thread) })
    }

    pub(crate) fn name(&self) -> SocketName {
        self.shared.name
    }

    /// Serve `fd` from now on; the id names it in requests (never reused in this process).
    pub(crate) fn publish(&self, fd: OwnedFd) -> u64 {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.fds.lock().unwrap_or_else(|e| e.into_inner()).insert(id, fd);
        id
    }

    /// Stop serving `id` and close our descriptor (true if it was there). Descriptors already
    /// handed out stay valid in their receivers.
    pub(crate) fn withdraw(&self, id: u64) -> bool {
        self.shared.fds.lock().unwrap_or_else(|e| e.into_inner()).remove(&id).is_some()
    }

    /// Descriptors being served.
    #[cfg(test)]
    fn published(&self) -> usize {
        self.shared.fds.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // SAFETY: our listening socket, still open (we hold a reference). On Linux, shutting a
        // listening socket down wakes a thread blocked in accept (it returns EINVAL).
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

fn socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::io("socket(AF_UNIX)", last_error()));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn bind_listener(name: &SocketName) -> Result<OwnedFd> {
    let fd = socket()?;
    let (addr, len) = name.sockaddr();
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(Error::io(&format!("binding the fd exporter socket {name}"), last_error()));
    }
    // SAFETY: a bound socket of ours.
    if unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0 {
        return Err(Error::io(&format!("listening on {name}"), last_error()));
    }
    Ok(fd)
}

/// Set both socket timeouts to `d` (at least 1 us: zero would mean "never time out").
fn set_timeouts(fd: RawFd, d: Duration) -> io::Result<()> {
    let d = d.max(Duration::from_micros(1));
    let tv = libc::timeval { tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t, tv_usec: d.subsec_micros() as libc::suseconds_t };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: `tv` is a valid timeval of the size given.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &tv as *const _ as *const libc::c_void,
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(last_error());
        }
    }
    Ok(())
}

fn peer_cred(fd: RawFd) -> io::Result<libc::ucred> {
    // SAFETY: all-zero is a valid ucred.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a writable ucred of `len` bytes.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, &mut c as *mut _ as *mut libc::c_void, &mut len) };
    if r != 0 {
        return Err(last_error());
    }
    Ok(c)
}

fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Send all of `buf` (and, with the first byte, `fd` as SCM_RIGHTS).
fn send_all(sock: RawFd, buf: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let mut sent = 0;
    let mut cmsg = [0u64; CMSG_WORDS];
    while sent < buf.len() {
        let mut iov = libc::iovec { iov_base: buf[sent..].as_ptr() as *mut libc::c_void, iov_len: buf.len() - sent };
        // SAFETY: all-zero is a valid msghdr (no name, no control).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let (Some(fd), 0) = (fd, sent) {
            // SAFETY: pure arithmetic.
            let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
            msg.msg_control = cmsg.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            // SAFETY: `msg` has a control buffer of `space` bytes (checked to fit at compile
            // time), aligned for cmsghdr; the first header lies inside it.
            unsafe {
                let h = libc::CMSG_FIRSTHDR(&msg);
                (*h).cmsg_level = libc::SOL_SOCKET;
                (*h).cmsg_type = libc::SCM_RIGHTS;
                (*h).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(h) as *mut libc::c_int, fd);
            }
        }
        // SAFETY: `msg` points at live buffers for the call; MSG_NOSIGNAL: no SIGPIPE.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = last_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

/// Receive exactly `buf.len()` bytes; descriptors that come with them are collected in `fds`.
/// Ok(false): the peer closed the connection first.
fn recv_exact(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let mut cmsg = [0u64; CMSG_WORDS];
        let mut iov = libc::iovec { iov_base: buf[got..].as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() - got };
        // SAFETY: all-zero is a valid msghdr.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = (CMSG_WORDS * 8) as _;
        // SAFETY: `msg` points at live, writable buffers of the sizes given. MSG_CMSG_CLOEXEC:
        // received descriptors are close-on-exec from the start.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = last_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the kernel filled `msg.msg_control`/`msg_controllen`; the CMSG_* walk stays
        // inside it, and every SCM_RIGHTS payload holds whole c_ints that are now our
        // descriptors (each is owned exactly once, so none leaks and none is closed twice).
        unsafe {
            let mut h = libc::CMSG_FIRSTHDR(&msg);
            while !h.is_null() {
                if (*h).cmsg_level == libc::SOL_SOCKET && (*h).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(h);
                    let bytes = (*h).cmsg_len as usize - (data as usize - h as usize);
                    for i in 0..bytes / size_of::<libc::c_int>() {
                        let fd = std::ptr::read_unaligned((data as *const libc::c_int).add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                h = libc::CMSG_NXTHDR(&msg, h);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "descriptors were cut off (more than expected)"));
        }
        if n == 0 {
            return Ok(false);
        }
        got += n as usize;
    }
    Ok(true)
}

fn reply(code: u32) -> [u8; REPLY_LEN] {
    let mut r = [0u8; REPLY_LEN];
    r[..4].copy_from_slice(&MAGIC);
    r[4..].copy_from_slice(&code.to_le_bytes());
    r
}

/// The service thread: accept, answer, repeat, until the server is dropped.
fn serve(shared: &Shared, listener: &OwnedFd) {
    loop {
        // SAFETY: accept4 on our listening socket, without the peer address.
        let c = unsafe { libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
        if shared.stop.load(Ordering::SeqCst) {
            if c >= 0 {
                // SAFETY: a descriptor accept4 just gave us; closed once.
                drop(unsafe { OwnedFd::from_raw_fd(c) });
            }
            return;
        }
        if c < 0 {
            let e = last_error();
            match e.raw_os_error() {
                Some(libc::EINTR | libc::ECONNABORTED) => continue,
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                    // Out of descriptors or memory for now: let the pending client wait a bit.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                _ => {
                    tracing::warn!(target: "gsc::cuda", error = %e, name = %shared.name, "fd exporter: accept failed; the service stops");
                    return;
                }
            }
        }
        // SAFETY: a descriptor accept4 just gave us.
        let conn = unsafe { OwnedFd::from_raw_fd(c) };
        if let Err(e) = serve_one(shared, conn.as_raw_fd()) {
            tracing::debug!(target: "gsc::cuda", error = %e, "fd exporter: a request failed");
        }
    }
}

fn serve_one(shared: &Shared, conn: RawFd) -> io::Result<()> {
    set_timeouts(conn, shared.serve_timeout)?;
    let cred = peer_cred(conn)?;
    if cred.uid != own_uid() {
        let _ = send_all(conn, &reply(DENIED), None);
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("refused pid {} of uid {}", cred.pid, cred.uid)));
    }
    let mut req = [0u8; REQUEST_LEN];
    let mut stray = Vec::new();
    if !recv_exact(conn, &mut req, &mut stray)? {
        return Ok(()); // the client gave up
    }
    let valid = req[..4] == MAGIC && u16::from_le_bytes([req[4], req[5]]) == VERSION && req[6..8] == [0, 0] && stray.is_empty();
    if !valid {
        return send_all(conn, &reply(BAD_REQUEST), None);
    }
    let id = u64::from_le_bytes(req[8..16].try_into().expect("8 bytes"));
    // Duplicate under the lock, send without it: a slow client never holds up `publish`.
    let dup = shared.fds.lock().unwrap_or_else(|e| e.into_inner()).get(&id).map(|fd| fd.try_clone());
    match dup {
        None => send_all(conn, &reply(UNKNOWN_ID), None),
        Some(Err(e)) => {
            let _ = send_all(conn, &reply(EXPORTER_ERROR), None);
            Err(e)
        }
        Some(Ok(fd)) => send_all(conn, &reply(OK), Some(fd.as_raw_fd())),
    }
}

/// Ask the service `name` for its descriptor `export_id`; every step bounded by `timeout`.
pub(crate) fn fetch_fd(name: &SocketName, export_id: u64, timeout: Duration) -> Result<OwnedFd> {
    let deadline = Instant::now() + timeout;
    let fail = |status: Status, what: &str, e: &dyn std::fmt::Display| {
        Error::new(status, format!("fetching fd {export_id} from {name}: {what}: {e}"))
    };
    let timed_out =
        |what: &str| Error::new(Status::TimedOut, format!("fetching fd {export_id} from {name}: {what}: no answer within {timeout:?}"));
    let left = |what: &str| deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or_else(|| timed_out(what));
    let is_timeout = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINPROGRESS | libc::ETIMEDOUT));

    let sock = socket()?;
    let fd = sock.as_raw_fd();
    let (addr, len) = name.sockaddr();
    loop {
        set_timeouts(fd, left("connect")?).map_err(|e| fail(Status::IoError, "setting socket timeouts", &e))?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes; SO_SNDTIMEO bounds the wait
        // when the service's backlog is full.
        if unsafe { libc::connect(fd, &addr as *const _ as *const libc::sockaddr, len) } == 0 {
            break;
        }
        let e = last_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ECONNREFUSED | libc::ENOENT) => {
                return Err(fail(
                    Status::PeerFailed,
                    "connect",
                    &format_args!("{e} (no such exporter: the process is gone or in another network namespace)"),
                ));
            }
            _ if is_timeout(&e) => return Err(timed_out("connect")),
            _ => return Err(fail(Status::IoError, "connect", &e)),
        }
    }
    let server = peer_cred(fd).map_err(|e| fail(Status::IoError, "SO_PEERCRED", &e))?;
    if server.uid != own_uid() {
        return Err(fail(
            Status::Rejected,
            "exporter check",
            &format_args!("the socket belongs to uid {}, not ours ({})", server.uid, own_uid()),
        ));
    }

    let mut req = [0u8; REQUEST_LEN];
    req[..4].copy_from_slice(&MAGIC);
    req[4..6].copy_from_slice(&VERSION.to_le_bytes());
    req[8..].copy_from_slice(&export_id.to_le_bytes());
    set_timeouts(fd, left("send request")?).map_err(|e| fail(Status::IoError, "setting socket timeouts", &e))?;
    send_all(fd, &req, None)
        .map_err(|e| if is_timeout(&e) { timed_out("send request") } else { fail(Status::PeerFailed, "send request", &e) })?;

    let mut rep = [0u8; REPLY_LEN];
    let mut fds = Vec::new();
    set_timeouts(fd, left("receive reply")?).map_err(|e| fail(Status::IoError, "setting socket timeouts", &e))?;
    match recv_exact(fd, &mut rep, &mut fds) {
        Ok(true) => {}
        Ok(false) => return Err(fail(Status::PeerFailed, "receive reply", &"the exporter closed the connection without answering")),
        Err(e) if is_timeout(&e) => return Err(timed_out("receive reply")),
        Err(e) => return Err(fail(Status::PeerFailed, "receive reply", &e)),
    }
    if rep[..4] != MAGIC {
        return Err(fail(Status::ConnectionReset, "reply", &"not an fd exporter's answer (bad magic)"));
    }
    let code = u32::from_le_bytes(rep[4..].try_into().expect("4 bytes"));
    match code {
        OK if fds.len() == 1 => Ok(fds.pop().expect("one fd")),
        OK => Err(fail(Status::ConnectionReset, "reply", &format_args!("{} descriptors came with the answer, expected 1", fds.len()))),
        UNKNOWN_ID => Err(fail(Status::InvalidHandle, "reply", &"unknown export id (withdrawn: the exporter's allocation was freed?)")),
        BAD_REQUEST => Err(fail(Status::ConnectionReset, "reply", &"the exporter did not understand the request (version mismatch?)")),
        DENIED => Err(fail(Status::Rejected, "reply", &"the exporter refused us (different uid)")),
        EXPORTER_ERROR => Err(fail(Status::NoResource, "reply", &"the exporter could not duplicate the descriptor (out of descriptors?)")),
        c => Err(fail(Status::ConnectionReset, "reply", &format_args!("unknown answer code {c}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    const T: Duration = Duration::from_secs(5);

    fn memfd(text: &[u8]) -> File {
        let name = std::ffi::CString::new("gsc-fd-test").unwrap();
        // SAFETY: a valid name; the result is checked before it is owned.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", last_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        f.write_all_at(text, 0).unwrap();
        f
    }

    fn read(f: &File, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    }

    #[test]
    fn fetched_fd_is_the_same_file() {
        let server = FdServer::start().unwrap();
        let ours = memfd(b"hello from the exporter");
        let id = server.publish(OwnedFd::from(ours.try_clone().unwrap()));
        let theirs = File::from(fetch_fd(&server.name(), id, T).unwrap());
        assert_eq!(read(&theirs, 23), b"hello from the exporter");
        theirs.write_all_at(b"HELLO", 0).unwrap();
        assert_eq!(read(&ours, 5), b"HELLO");
        // Fetch again (another duplicate); withdrawing keeps fetched copies working.
        let again = File::from(fetch_fd(&server.name(), id, T).unwrap());
        assert!(server.withdraw(id));
        assert!(!server.withdraw(id));
        assert_eq!(server.published(), 0);
        again.write_all_at(b"x", 22).unwrap();
        assert_eq!(read(&ours, 23), b"HELLO from the exportex");
        let e = fetch_fd(&server.name(), id, T).unwrap_err();
        assert_eq!(e.status(), Status::InvalidHandle, "{e}");
    }

    #[test]
    fn unknown_id_is_a_clear_error() {
        let server = FdServer::start().unwrap();
        let e = fetch_fd(&server.name(), 12345, T).unwrap_err();
        assert_eq!(e.status(), Status::InvalidHandle);
        assert!(e.message().contains("unknown export id") && e.message().contains("12345"), "{e}");
    }

    #[test]
    fn exporter_gone_fails_at_once() {
        let server = FdServer::start().unwrap();
        let name = server.name();
        let id = server.publish(OwnedFd::from(memfd(b"x")));
        drop(server);
        let t0 = Instant::now();
        let e = fetch_fd(&name, id, T).unwrap_err();
        assert_eq!(e.status(), Status::PeerFailed, "{e}");
        assert!(e.message().contains("connect"), "{e}");
        assert!(t0.elapsed() < T, "took {:?}", t0.elapsed());
    }

    #[test]
    fn stuck_exporter_times_out() {
        // Bound and listening, but nobody ever accepts or answers.
        let name = SocketName::fresh().unwrap();
        let _listener = bind_listener(&name).unwrap();
        let t0 = Instant::now();
        let e = fetch_fd(&name, 1, Duration::from_millis(300)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.status(), Status::TimedOut, "{e}");
        assert!(e.message().contains("receive reply"), "{e}");
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "took {took:?}");
    }

    /// Connect by hand and send `bytes`; the reply code, if any.
    fn raw_request(name: &SocketName, bytes: &[u8]) -> Option<u32> {
        let s = socket().unwrap();
        let (addr, len) = name.sockaddr();
        // SAFETY: a valid address of `len` bytes.
        assert_eq!(unsafe { libc::connect(s.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) }, 0);
        set_timeouts(s.as_raw_fd(), T).unwrap();
        send_all(s.as_raw_fd(), bytes, None).unwrap();
        let mut rep = [0u8; REPLY_LEN];
        let mut fds = Vec::new();
        match recv_exact(s.as_raw_fd(), &mut rep, &mut fds) {
            Ok(true) => Some(u32::from_le_bytes(rep[4..].try_into().unwrap())),
            _ => None,
        }
    }

    #[test]
    fn malformed_and_silent_clients_do_not_break_the_service() {
        let server = FdServer::start_with(Duration::from_millis(200)).unwrap();
        let name = server.name();
        let id = server.publish(OwnedFd::from(memfd(b"ok")));
        assert_eq!(raw_request(&name, &[0xAB; REQUEST_LEN]), Some(BAD_REQUEST));
        let mut wrong_version = [0u8; REQUEST_LEN];
        wrong_version[..4].copy_from_slice(&MAGIC);
        wrong_version[4..6].copy_from_slice(&99u16.to_le_bytes());
        assert_eq!(raw_request(&name, &wrong_version), Some(BAD_REQUEST));
        // A client that connects and says nothing holds the service for its timeout at most.
        let silent = socket().unwrap();
        let (addr, len) = name.sockaddr();
        // SAFETY: a valid address of `len` bytes.
        assert_eq!(unsafe { libc::connect(silent.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) }, 0);
        let t0 = Instant::now();
        let f = File::from(fetch_fd(&name, id, T).unwrap());
        assert_eq!(read(&f, 2), b"ok");
        assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
    }

    const CHILD_ENV: &str = "GSC_FD_PASS_TEST_CHILD";

    /// Child role of `fetch_from_another_process`: fetch the fd named in the environment and
    /// write through it. Does nothing in a normal run.
    #[test]
    fn child_role_fetch_and_write() {
        let Ok(spec) = std::env::var(CHILD_ENV) else { return };
        let parts: Vec<&str> = spec.split(':').collect();
        let pid: u32 = parts[0].parse().unwrap();
        let token: Vec<u8> = (0..TOKEN_LEN).map(|i| u8::from_str_radix(&parts[1][2 * i..2 * i + 2], 16).unwrap()).collect();
        let id: u64 = parts[2].parse().unwrap();
        let name = SocketName { pid, token: token.try_into().unwrap() };
        let f = File::from(fetch_fd(&name, id, T).unwrap());
        assert_eq!(read(&f, 6), b"parent");
        f.write_all_at(b"child!", 0).unwrap();
        let e = fetch_fd(&name, id + 1000, T).unwrap_err();
        assert_eq!(e.status(), Status::InvalidHandle);
    }

    #[test]
    fn fetch_from_another_process() {
        if std::env::var(CHILD_ENV).is_ok() {
            return;
        }
        let server = FdServer::start().unwrap();
        let ours = memfd(b"parent");
        let id = server.publish(OwnedFd::from(ours.try_clone().unwrap()));
        let name = server.name();
        let token: String = name.token.iter().map(|b| format!("{b:02x}")).collect();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "transport::fd_pass::tests::child_role_fetch_and_write", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{}:{token}:{id}", name.pid))
            .output()
            .unwrap();
        assert!(out.status.success(), "child failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran no test");
        assert_eq!(read(&ours, 6), b"child!");
    }

    #[test]
    fn names_are_abstract_and_distinct() {
        let (a, b) = (SocketName::fresh().unwrap(), SocketName::fresh().unwrap());
        assert_ne!(a, b);
        let (addr, len) = a.sockaddr();
        assert_eq!(addr.sun_path[0], 0);
        assert!((len as usize) < size_of::<libc::sockaddr_un>());
        assert!(a.to_string().starts_with(&format!("@gscomm-fd.{}.", std::process::id())));
        assert_eq!(a.text().len(), "gscomm-fd.".len() + a.pid.to_string().len() + 1 + 2 * TOKEN_LEN);
    }
}

//! Wire format, deadline-bounded socket I/O and the challenge–response handshake shared by the
//! root service and the rank-to-rank connections.
//!
//! Every frame is `[u32 LE payload length][u8 frame type][payload]`. The reader checks the length
//! against a cap *before* allocating, so a garbage header cannot make us allocate gigabytes.

use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result, Status};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of the shared secret (an HMAC-SHA256 key).
pub(crate) const SECRET_BYTES: usize = 32;
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;

/// "GSCB" — first field of every HELLO so a stray client of another protocol is told apart early.
const PROTO_MAGIC: u32 = 0x4753_4342;
/// Bumped whenever a frame layout or the MAC input changes; mismatches are rejected by name.
pub(crate) const PROTO_VERSION: u16 = 1;
/// Cap for frames exchanged before authentication completes: they are all tiny, and anything
/// larger is someone who does not speak the protocol.
const HANDSHAKE_FRAME_MAX: usize = 256;
/// The `target` a client names when it connects to the root service rather than to a rank.
pub(crate) const ROOT_TARGET: u32 = u32::MAX;

pub(crate) mod ft {
    pub const HELLO: u8 = 1;
    pub const CHALLENGE: u8 = 2;
    pub const RESPONSE: u8 = 3;
    pub const ACCEPT: u8 = 4;
    pub const REJECT: u8 = 5;
    pub const REGISTER: u8 = 6;
    pub const TABLE: u8 = 7;
    pub const ERROR: u8 = 8;
    pub const DATA: u8 = 9;
}

/// Who the connecting side is; bound into the MAC so a proof for one role cannot be replayed as
/// another.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Role {
    /// A rank registering with the root service.
    Rank = 1,
    /// A rank opening its send connection to another rank.
    Peer = 2,
}

/// What a server learns from a successful handshake.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Hello {
    pub rank: u32,
}

/// `now + d`, saturating: a caller may pass `Duration::MAX` to mean "no practical limit", and
/// `Instant + Duration` would panic on overflow.
pub(crate) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400))).unwrap_or(now)
}

/// Time left until `deadline`, or `None` once it has passed.
pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    let now = Instant::now();
    if now >= deadline { None } else { Some(deadline - now) }
}

pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| Error::new(Status::Internal, format!("getrandom failed: {e}")))?;
    Ok(b)
}

/// Map a socket error to a status: a vanished peer is the peer's failure, not ours.
pub(crate) fn io_error(what: &str, e: io::Error) -> Error {
    let status = match e.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted => Status::ConnectionReset,
        io::ErrorKind::ConnectionRefused => Status::Unreachable,
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Status::TimedOut,
        _ => Status::IoError,
    };
    Error::new(status, format!("{what}: {e}"))
}

fn timed_out(what: &str) -> Error {
    Error::new(Status::TimedOut, format!("{what}: timed out"))
}

/// Socket timeouts of zero mean "block forever" to the OS; never hand it one.
fn sock_timeout(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

/// Fill `buf` from `stream`, giving up at `deadline`. Each `read` is bounded by the time left, so
/// a peer that drips one byte per second still cannot hold us past the deadline.
pub(crate) fn read_exact_until(stream: &TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<()> {
    read_exact_with(stream, buf, what, || {
        let rem = remaining(deadline).ok_or_else(|| timed_out(what))?;
        stream.set_read_timeout(Some(sock_timeout(rem))).map_err(|e| io_error(what, e))
    })
}

/// Like [`read_exact_until`] but with no deadline: waits until data arrives, the peer goes away or
/// `stop` is raised (checked every `poll` interval). Used by the long-lived receive threads.
pub(crate) fn read_exact_stoppable(stream: &TcpStream, buf: &mut [u8], stop: &AtomicBool, poll: Duration, what: &str) -> Result<()> {
    stream.set_read_timeout(Some(sock_timeout(poll))).map_err(|e| io_error(what, e))?;
    read_exact_with(stream, buf, what, || {
        if stop.load(Ordering::Acquire) {
            return Err(Error::new(Status::Canceled, format!("{what}: bootstrap shut down")));
        }
        Ok(())
    })
}

/// Fill `buf` from `stream`; `before_read` runs before every read and decides whether to go on
/// (a deadline, a stop flag). A socket read timeout only returns control to `before_read`.
fn read_exact_with(stream: &TcpStream, buf: &mut [u8], what: &str, mut before_read: impl FnMut() -> Result<()>) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        before_read()?;
        match (&*stream).read(&mut buf[off..]) {
            Ok(0) => return Err(Error::new(Status::PeerFailed, format!("{what}: connection closed"))),
            Ok(n) => off += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(io_error(what, e)),
        }
    }
    Ok(())
}

/// `send(2)` with MSG_NOSIGNAL: gscomm is also a C library, and a host program that has not
/// ignored SIGPIPE would otherwise be killed when a peer dies mid-write.
fn send_nosignal(stream: &TcpStream, buf: &[u8]) -> io::Result<usize> {
    #[cfg(target_os = "linux")]
    let flags = libc::MSG_NOSIGNAL;
    #[cfg(not(target_os = "linux"))]
    let flags = 0;
    // SAFETY: the pointer and length come from a live slice; the fd is owned by `stream`.
    let rc = unsafe { libc::send(stream.as_raw_fd(), buf.as_ptr().cast(), buf.len(), flags) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc as usize) }
}

pub(crate) fn write_all_until(stream: &TcpStream, buf: &[u8], deadline: Instant, what: &str) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let rem = remaining(deadline).ok_or_else(|| timed_out(what))?;
        stream.set_write_timeout(Some(sock_timeout(rem))).map_err(|e| io_error(what, e))?;
        match send_nosignal(stream, &buf[off..]) {
            Ok(0) => {
                return Err(Error::new(Status::ConnectionReset, format!("{what}: wrote 0 bytes")));
            }
            Ok(n) => off += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(io_error(what, e)),
        }
    }
    Ok(())
}

/// Write one frame whose payload is the concatenation of `parts`, in a single buffer so the
/// header and payload leave in one segment (we also set TCP_NODELAY).
pub(crate) fn write_frame(stream: &TcpStream, ty: u8, parts: &[&[u8]], deadline: Instant, what: &str) -> Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len32 = u32::try_from(len).map_err(|_| Error::invalid_param(format!("{what}: message of {len} bytes is too large for a frame")))?;
    let mut buf = Vec::with_capacity(5 + len);
    buf.extend_from_slice(&len32.to_le_bytes());
    buf.push(ty);
    for p in parts {
        buf.extend_from_slice(p);
    }
    write_all_until(stream, &buf, deadline, what)
}

fn check_len(len: usize, max: usize, what: &str) -> Result<()> {
    if len > max {
        return Err(Error::new(Status::Rejected, format!("{what}: frame of {len} bytes exceeds the limit of {max} bytes")));
    }
    Ok(())
}

pub(crate) fn read_frame(stream: &TcpStream, max: usize, deadline: Instant, what: &str) -> Result<(u8, Vec<u8>)> {
    let mut hdr = [0u8; 5];
    read_exact_until(stream, &mut hdr, deadline, what)?;
    let len = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) as usize;
    check_len(len, max, what)?;
    let mut payload = vec![0u8; len];
    read_exact_until(stream, &mut payload, deadline, what)?;
    Ok((hdr[4], payload))
}

pub(crate) fn read_frame_stoppable(stream: &TcpStream, max: usize, stop: &AtomicBool, poll: Duration, what: &str) -> Result<(u8, Vec<u8>)> {
    let mut hdr = [0u8; 5];
    read_exact_stoppable(stream, &mut hdr, stop, poll, what)?;
    let len = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) as usize;
    check_len(len, max, what)?;
    let mut payload = vec![0u8; len];
    read_exact_stoppable(stream, &mut payload, stop, poll, what)?;
    Ok((hdr[4], payload))
}

/// Wait until `fd` is readable (for a listener: a connection is pending) or `timeout` passes.
pub(crate) fn wait_readable(fd: &impl AsRawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

/// Accept one pending connection, if any. The listener is non-blocking so a connection that was
/// reset between `poll` and `accept` cannot block the accept loop.
pub(crate) fn accept_nonblocking(listener: &TcpListener) -> io::Result<Option<TcpStream>> {
    match listener.accept() {
        Ok((s, _)) => {
            // Accepted sockets do not inherit O_NONBLOCK on Linux, but other systems differ and
            // all our I/O relies on per-call timeouts over blocking sockets.
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            Ok(Some(s))
        }
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(None),
        // The connection died before we took it (ECONNABORTED): not the listener's failure.
        Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => Ok(None),
        Err(e) => Err(e),
    }
}

/// Connect to `addr` before `deadline`. With `retry_refused` a refused connection is retried with
/// backoff, because the root service may legitimately start after the ranks (launcher mode).
pub(crate) fn connect_until(addr: SocketAddr, deadline: Instant, retry_refused: bool, what: &str) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let rem = remaining(deadline).ok_or_else(|| timed_out(what))?;
        match TcpStream::connect_timeout(&addr, sock_timeout(rem)) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| io_error(what, e))?;
                return Ok(s);
            }
            Err(e)
                if retry_refused
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
                    ) =>
            {
                let Some(rem) = remaining(deadline) else {
                    return Err(Error::new(Status::TimedOut, format!("{what}: timed out; last connect error: {e}")));
                };
                std::thread::sleep(backoff.min(rem));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(Error::new(Status::TimedOut, format!("{what}: connect timed out")));
            }
            Err(e) => return Err(io_error(what, e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Addresses

/// Encoded size of a socket address: family, port, 16 address bytes, IPv6 scope id.
pub(crate) const ADDR_BYTES: usize = 1 + 2 + 16 + 4;

pub(crate) fn encode_addr(addr: &SocketAddr, out: &mut Vec<u8>) {
    match addr {
        SocketAddr::V4(a) => {
            out.push(4);
            out.extend_from_slice(&a.port().to_le_bytes());
            let mut ip = [0u8; 16];
            ip[..4].copy_from_slice(&a.ip().octets());
            out.extend_from_slice(&ip);
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        SocketAddr::V6(a) => {
            out.push(6);
            out.extend_from_slice(&a.port().to_le_bytes());
            out.extend_from_slice(&a.ip().octets());
            out.extend_from_slice(&a.scope_id().to_le_bytes());
        }
    }
}

pub(crate) fn decode_addr(b: &[u8]) -> Result<SocketAddr> {
    if b.len() < ADDR_BYTES {
        return Err(Error::new(Status::InvalidAddress, "truncated socket address"));
    }
    let port = u16::from_le_bytes([b[1], b[2]]);
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&b[3..19]);
    let scope = u32::from_le_bytes([b[19], b[20], b[21], b[22]]);
    match b[0] {
        4 => Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3])), port)),
        6 => Ok(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope))),
        f => Err(Error::new(Status::InvalidAddress, format!("unknown address family tag {f}"))),
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake
//
//   client → HELLO     magic u32, version u16, role u8, rank u32, target u32, client nonce[32]
//   server → CHALLENGE server nonce[32]                         (or REJECT reason)
//   client → RESPONSE  HMAC(secret, "client" ‖ transcript)
//   server → ACCEPT    HMAC(secret, "server" ‖ transcript)      (or REJECT reason)
//
// transcript = version ‖ role ‖ rank ‖ target ‖ client nonce ‖ server nonce. The fresh server
// nonce defeats replay of a recorded RESPONSE; the client nonce lets the client check that the
// server, too, knows the secret (so a squatter on the root's port cannot feed ranks a bogus
// table). The secret itself never crosses the wire.

const HELLO_BYTES: usize = 4 + 2 + 1 + 4 + 4 + NONCE_BYTES;

fn proof(secret: &[u8; SECRET_BYTES], label: &[u8], role: u8, rank: u32, target: u32, cnonce: &[u8], snonce: &[u8]) -> HmacSha256 {
    // new_from_slice accepts any key length for HMAC; the Err arm is unreachable but must not panic.
    let mut mac = match HmacSha256::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => <HmacSha256 as hmac::digest::KeyInit>::new(&Default::default()),
    };
    mac.update(b"gscomm-bootstrap ");
    mac.update(label);
    mac.update(&PROTO_VERSION.to_le_bytes());
    mac.update(&[role]);
    mac.update(&rank.to_le_bytes());
    mac.update(&target.to_le_bytes());
    mac.update(cnonce);
    mac.update(snonce);
    mac
}

fn reject_error(what: &str, payload: &[u8]) -> Error {
    let reason = String::from_utf8_lossy(&payload[..payload.len().min(HANDSHAKE_FRAME_MAX)]);
    Error::new(
        Status::Rejected,
        format!(
            "{what}: rejected by the other side: {reason} (do all ranks use the same unique id / \
             GSC_BOOTSTRAP_SECRET?)"
        ),
    )
}

/// Connecting side of the handshake.
pub(crate) fn client_handshake(
    stream: &TcpStream,
    secret: &[u8; SECRET_BYTES],
    role: Role,
    rank: u32,
    target: u32,
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let cnonce: [u8; NONCE_BYTES] = random_bytes()?;
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&PROTO_MAGIC.to_le_bytes());
    hello.extend_from_slice(&PROTO_VERSION.to_le_bytes());
    hello.push(role as u8);
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&target.to_le_bytes());
    hello.extend_from_slice(&cnonce);
    write_frame(stream, ft::HELLO, &[&hello], deadline, what)?;

    let (ty, snonce) = read_frame(stream, HANDSHAKE_FRAME_MAX, deadline, what)?;
    match ty {
        ft::CHALLENGE if snonce.len() == NONCE_BYTES => {}
        ft::REJECT => return Err(reject_error(what, &snonce)),
        _ => {
            return Err(Error::new(
                Status::Rejected,
                format!("{what}: expected a challenge, got frame type {ty} ({} bytes)", snonce.len()),
            ));
        }
    }
    let resp = proof(secret, b"client", role as u8, rank, target, &cnonce, &snonce).finalize();
    write_frame(stream, ft::RESPONSE, &[&resp.into_bytes()], deadline, what)?;

    let (ty, payload) = read_frame(stream, HANDSHAKE_FRAME_MAX, deadline, what)?;
    match ty {
        ft::ACCEPT => {
            let mac = proof(secret, b"server", role as u8, rank, target, &cnonce, &snonce);
            mac.verify_slice(&payload)
                .map_err(|_| Error::new(Status::Rejected, format!("{what}: the other side failed to prove knowledge of the secret")))
        }
        ft::REJECT => Err(reject_error(what, &payload)),
        _ => Err(Error::new(Status::Rejected, format!("{what}: expected accept or reject, got frame type {ty}"))),
    }
}

/// Accepting side of the handshake. `target` is the identity the server expects to be addressed
/// as (its rank, or [`ROOT_TARGET`]); a mismatch means a stale address or a misrouted client.
pub(crate) fn server_handshake(
    stream: &TcpStream,
    secret: &[u8; SECRET_BYTES],
    expect_role: Role,
    target: u32,
    deadline: Instant,
    what: &str,
) -> Result<Hello> {
    let (ty, h) = read_frame(stream, HANDSHAKE_FRAME_MAX, deadline, what)?;
    if ty != ft::HELLO || h.len() != HELLO_BYTES {
        return Err(Error::new(
            Status::Rejected,
            format!("{what}: not a gscomm bootstrap client (first frame type {ty}, {} bytes)", h.len()),
        ));
    }
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    if u32_at(0) != PROTO_MAGIC {
        return Err(Error::new(Status::Rejected, format!("{what}: bad protocol magic")));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    let role = h[6];
    let rank = u32_at(7);
    let claimed_target = u32_at(11);
    let cnonce = &h[15..15 + NONCE_BYTES];
    let refuse = |reason: String| -> Error {
        // Best effort: tell the client why, so its error names the cause instead of a reset.
        let _ = write_frame(stream, ft::REJECT, &[reason.as_bytes()], deadline, what);
        Error::new(Status::Rejected, format!("{what}: {reason}"))
    };
    if version != PROTO_VERSION {
        return Err(refuse(format!("bootstrap protocol version {version} is not the supported version {PROTO_VERSION}")));
    }
    if role != expect_role as u8 {
        return Err(refuse(format!("unexpected role {role} (expected {})", expect_role as u8)));
    }
    if claimed_target != target {
        return Err(refuse(format!("client addressed {claimed_target} but this endpoint is {target} (stale address?)")));
    }
    let snonce: [u8; NONCE_BYTES] = random_bytes()?;
    write_frame(stream, ft::CHALLENGE, &[&snonce], deadline, what)?;
    let (ty, resp) = read_frame(stream, HANDSHAKE_FRAME_MAX, deadline, what)?;
    if ty != ft::RESPONSE || resp.len() != MAC_BYTES {
        return Err(Error::new(Status::Rejected, format!("{what}: malformed response frame")));
    }
    // verify_slice compares in constant time.
    if proof(secret, b"client", role, rank, target, cnonce, &snonce).verify_slice(&resp).is_err() {
        return Err(refuse(format!("authentication failed for rank {rank}")));
    }
    let mine = proof(secret, b"server", role, rank, target, cnonce, &snonce).finalize();
    write_frame(stream, ft::ACCEPT, &[&mine.into_bytes()], deadline, what)?;
    Ok(Hello { rank })
}

/// Encode an error for an ERROR frame: status code then message.
pub(crate) fn encode_error(e: &Error) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + e.message().len());
    v.extend_from_slice(&e.status().code().to_le_bytes());
    v.extend_from_slice(e.message().as_bytes());
    v
}

pub(crate) fn decode_error(b: &[u8], what: &str) -> Error {
    if b.len() < 4 {
        return Error::new(Status::Internal, format!("{what}: malformed error frame"));
    }
    let code = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let msg = String::from_utf8_lossy(&b[4..]);
    match Status::from_code(code) {
        Some(s) if s.is_error() => Error::new(s, format!("{what}: {msg}")),
        _ => Error::new(Status::Internal, format!("{what}: error frame with unknown status {code}: {msg}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_round_trip() {
        for a in ["10.1.2.3:4567", "[fe80::1%3]:9", "[::1]:65535"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut v = Vec::new();
            encode_addr(&a, &mut v);
            assert_eq!(v.len(), ADDR_BYTES);
            assert_eq!(decode_addr(&v).unwrap(), a);
        }
        let mut v = Vec::new();
        encode_addr(&"1.2.3.4:5".parse().unwrap(), &mut v);
        v[0] = 9;
        assert_eq!(decode_addr(&v).unwrap_err().status(), Status::InvalidAddress);
        assert_eq!(decode_addr(&v[..5]).unwrap_err().status(), Status::InvalidAddress);
    }

    #[test]
    fn proofs_bind_every_field() {
        let s = [7u8; SECRET_BYTES];
        let base = proof(&s, b"client", 1, 2, 3, &[1; 32], &[2; 32]).finalize().into_bytes();
        let variants = [
            proof(&[8u8; SECRET_BYTES], b"client", 1, 2, 3, &[1; 32], &[2; 32]),
            proof(&s, b"server", 1, 2, 3, &[1; 32], &[2; 32]),
            proof(&s, b"client", 2, 2, 3, &[1; 32], &[2; 32]),
            proof(&s, b"client", 1, 3, 3, &[1; 32], &[2; 32]),
            proof(&s, b"client", 1, 2, 4, &[1; 32], &[2; 32]),
            proof(&s, b"client", 1, 2, 3, &[9; 32], &[2; 32]),
            proof(&s, b"client", 1, 2, 3, &[1; 32], &[9; 32]),
        ];
        for v in variants {
            assert_ne!(v.finalize().into_bytes(), base);
        }
    }

    #[test]
    fn error_frames_round_trip() {
        let e = Error::new(Status::InvalidParam, "rank 3 announced nranks=4");
        let d = decode_error(&encode_error(&e), "root");
        assert_eq!(d.status(), Status::InvalidParam);
        assert_eq!(d.message(), "root: rank 3 announced nranks=4");
        let mut bogus = encode_error(&e);
        bogus[..4].copy_from_slice(&0i32.to_le_bytes());
        assert_eq!(decode_error(&bogus, "root").status(), Status::Internal);
        assert_eq!(decode_error(&[1], "root").status(), Status::Internal);
    }
}

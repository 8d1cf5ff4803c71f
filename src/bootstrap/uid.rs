//! The unique id: everything a rank needs to join a job — where the root rendezvous service
//! listens and the secret that proves membership.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::str::FromStr;

use sha2::{Digest, Sha256};

use super::root::{self, RootOptions};
use super::wire::{self, ADDR_BYTES, SECRET_BYTES};
use crate::error::{Error, Result, Status};

/// Size of the binary form of a [`UniqueId`]; fixed so C callers can use a plain byte array.
pub const UNIQUE_ID_BYTES: usize = 128;

/// "GSCU"
const UID_MAGIC: [u8; 4] = *b"GSCU";
const UID_VERSION: u16 = 1;
// Layout of the binary form (all integers little endian):
//   0..4    magic "GSCU"
//   4..6    layout version
//   6..8    reserved, zero
//   8..31   root socket address (wire::encode_addr)
//   31..32  reserved, zero
//   32..64  secret
//   64..124 reserved, zero (a later version may use them; this one insists they are zero)
//   124..128 first 4 bytes of SHA-256 over bytes 0..124, to catch truncation or corruption in
//            transit (e.g. an environment variable cut short) with a clear message
const ADDR_OFF: usize = 8;
const SECRET_OFF: usize = 32;
const CHECK_OFF: usize = 124;

/// Identity of one bootstrap job: the root service's address plus a 256-bit secret.
///
/// The secret is what authenticates ranks to the root and to each other, so treat the id like a
/// password: [`Debug`](fmt::Debug) redacts it, but the binary and hex forms (which exist to be
/// handed to the other ranks) contain it.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    root: SocketAddr,
    secret: [u8; SECRET_BYTES],
}

impl UniqueId {
    /// Start a root rendezvous service on a background thread and return the id that names it.
    ///
    /// It binds an ephemeral port on `bind`, else on the first non-loopback IPv4 address of the
    /// host, else on 127.0.0.1. The service serves one job and exits, or gives up after
    /// [`RootOptions::default`]'s timeout.
    pub fn create(bind: Option<IpAddr>) -> Result<UniqueId> {
        UniqueId::create_with(bind, &RootOptions::default())
    }

    /// [`create`](UniqueId::create) with explicit service options.
    pub fn create_with(bind: Option<IpAddr>, opts: &RootOptions) -> Result<UniqueId> {
        let ip = match bind {
            Some(ip) => ip,
            None => default_bind_ip(),
        };
        let secret: [u8; SECRET_BYTES] = wire::random_bytes()?;
        UniqueId::start(SocketAddr::new(ip, 0), secret, opts)
    }

    /// Start the root service at a fixed `addr` with a secret derived from `secret` (any length,
    /// not empty). This is rank 0's side of launcher mode, where every rank knows the address and
    /// secret in advance; the others use [`with_root`](UniqueId::with_root) with the same values.
    pub fn create_at(addr: SocketAddr, secret: &[u8], opts: &RootOptions) -> Result<UniqueId> {
        let secret = derive_secret(secret)?;
        UniqueId::start(addr, secret, opts)
    }

    /// The id of a root service started elsewhere with [`create_at`](UniqueId::create_at).
    /// Starts nothing.
    pub fn with_root(addr: SocketAddr, secret: &[u8]) -> Result<UniqueId> {
        Ok(UniqueId { root: addr, secret: derive_secret(secret)? })
    }

    /// [`with_root`](UniqueId::with_root) at `host_port` (`host:port`, `[ipv6]:port`; a name
    /// resolves IPv4 first, so every rank picks the same address). `origin` names where the
    /// address came from, for errors. Starts nothing: one rank then [`serve`](UniqueId::serve)s it.
    pub fn with_root_at(host_port: &str, secret: &[u8], origin: &str) -> Result<UniqueId> {
        UniqueId::with_root(super::launcher::resolve(host_port, origin)?, secret)
    }

    /// Start the root service of this id, at its address: the rank that serves an id made by
    /// [`with_root`](UniqueId::with_root) (NCCL's rank 0 under `NCCL_COMM_ID`). The other ranks
    /// may already be connecting; they retry until it is up.
    pub fn serve(&self, opts: &RootOptions) -> Result<()> {
        UniqueId::start(self.root, self.secret, opts).map(|_| ())
    }

    fn start(addr: SocketAddr, secret: [u8; SECRET_BYTES], opts: &RootOptions) -> Result<UniqueId> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io(&format!("bootstrap root: cannot listen on {addr}"), e))?;
        let root = listener.local_addr().map_err(|e| Error::io("bootstrap root: local_addr of the listener", e))?;
        root::spawn(listener, secret, opts.clone())?;
        tracing::debug!(target: "gsc::bootstrap", %root, "root rendezvous service started");
        Ok(UniqueId { root, secret })
    }

    /// Where the root rendezvous service listens.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    /// An id from its parts, serving nothing (fuzz seeds).
    pub(crate) fn from_parts(root: SocketAddr, secret: [u8; SECRET_BYTES]) -> UniqueId {
        UniqueId { root, secret }
    }

    pub(crate) fn secret(&self) -> &[u8; SECRET_BYTES] {
        &self.secret
    }

    /// The fixed-size binary form (contains the secret).
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(&UID_MAGIC);
        b[4..6].copy_from_slice(&UID_VERSION.to_le_bytes());
        let mut addr = Vec::with_capacity(ADDR_BYTES);
        wire::encode_addr(&self.root, &mut addr);
        b[ADDR_OFF..ADDR_OFF + ADDR_BYTES].copy_from_slice(&addr);
        b[SECRET_OFF..SECRET_OFF + SECRET_BYTES].copy_from_slice(&self.secret);
        let check = Sha256::digest(&b[..CHECK_OFF]);
        b[CHECK_OFF..].copy_from_slice(&check[..4]);
        b
    }

    /// Parse the binary form. Any problem is `InvalidParam` naming what was wrong.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bad = |what: String| Error::invalid_param(format!("unique id: {what}"));
        if b.len() != UNIQUE_ID_BYTES {
            return Err(bad(format!("{} bytes, expected {UNIQUE_ID_BYTES}", b.len())));
        }
        if b[0..4] != UID_MAGIC {
            return Err(bad("bad magic (not a gscomm unique id)".into()));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != UID_VERSION {
            return Err(bad(format!("layout version {version}, this library reads {UID_VERSION}")));
        }
        let check = Sha256::digest(&b[..CHECK_OFF]);
        if b[CHECK_OFF..] != check[..4] {
            return Err(bad("checksum mismatch (corrupted or truncated in transit)".into()));
        }
        let reserved_zero =
            b[6..8].iter().chain(&b[ADDR_OFF + ADDR_BYTES..SECRET_OFF]).chain(&b[SECRET_OFF + SECRET_BYTES..CHECK_OFF]).all(|&x| x == 0);
        if !reserved_zero {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let root = wire::decode_addr(&b[ADDR_OFF..ADDR_OFF + ADDR_BYTES]).map_err(|e| bad(format!("root address: {}", e.message())))?;
        if root.port() == 0 || root.ip().is_unspecified() {
            return Err(bad(format!("root address {root} cannot be connected to")));
        }
        let mut secret = [0u8; SECRET_BYTES];
        secret.copy_from_slice(&b[SECRET_OFF..SECRET_OFF + SECRET_BYTES]);
        Ok(UniqueId { root, secret })
    }
}

/// Map a secret of any length to the 256-bit HMAC key. Hashing (with a domain label) keeps the key
/// size fixed and means a short human-chosen secret is never used raw.
fn derive_secret(secret: &[u8]) -> Result<[u8; SECRET_BYTES]> {
    if secret.is_empty() {
        return Err(Error::invalid_param("bootstrap secret is empty"));
    }
    let mut h = Sha256::new();
    h.update(b"gscomm-bootstrap-secret-v1\0");
    h.update(secret);
    Ok(h.finalize().into())
}

/// First up, non-loopback IPv4 address of the host, else 127.0.0.1. Other hosts must be able to
/// reach the root, so a loopback address is only the last resort (single-node jobs).
fn default_bind_ip() -> IpAddr {
    first_non_loopback_ipv4().map(IpAddr::V4).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn first_non_loopback_ipv4() -> Option<Ipv4Addr> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        tracing::debug!(target: "gsc::bootstrap", err = %std::io::Error::last_os_error(),
            "getifaddrs failed; binding the root to 127.0.0.1");
        return None;
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let flags = ifa.ifa_flags;
        if ifa.ifa_addr.is_null() || flags & libc::IFF_UP as libc::c_uint == 0 || flags & libc::IFF_LOOPBACK as libc::c_uint != 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr of the family it names.
        if unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int != libc::AF_INET {
            continue;
        }
        // SAFETY: the family is AF_INET, so this is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        if !ip.is_loopback() && !ip.is_unspecified() && !ip.is_link_local() {
            found = Some(ip);
            break;
        }
    }
    // SAFETY: `ifap` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(ifap) };
    found
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId").field("root", &self.root).field("secret", &"<redacted>").finish()
    }
}

/// Lower-case hex of the binary form (256 characters), e.g. for `GSC_UNIQUE_ID`.
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.to_bytes() {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Parse the hex form; surrounding whitespace is ignored, either case accepted.
    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * UNIQUE_ID_BYTES {
            return Err(Error::invalid_param(format!(
                "unique id string has {} characters, expected {} hex digits",
                s.len(),
                2 * UNIQUE_ID_BYTES
            )));
        }
        let mut b = [0u8; UNIQUE_ID_BYTES];
        let digits = s.as_bytes();
        for (i, out) in b.iter_mut().enumerate() {
            let hi = hex_val(digits[2 * i], 2 * i)?;
            let lo = hex_val(digits[2 * i + 1], 2 * i + 1)?;
            *out = (hi << 4) | lo;
        }
        UniqueId::from_bytes(&b)
    }
}

fn hex_val(c: u8, pos: usize) -> Result<u8> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(Error::new(Status::InvalidParam, format!("unique id string: character {pos} ({:?}) is not a hex digit", c as char))),
    }
}

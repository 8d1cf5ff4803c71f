//! [`Bootstrap`]: one rank's view of a bootstrapped job, with small out-of-band collectives and
//! tagged point-to-point messages over authenticated TCP connections.
//!
//! Connections are one-way and made lazily: the first `send` to a peer connects to the peer's
//! listener and authenticates; the peer's receive thread for that connection reads every frame
//! as soon as it arrives into a mailbox keyed by (sender, tag space, tag). Because receivers
//! drain eagerly, a send never waits for the peer to call `recv`, so "everyone sends, then
//! everyone receives" patterns (the ring allgather) cannot deadlock on full socket buffers.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::root::ACCEPT_POLL;
use super::uid::{UNIQUE_ID_BYTES, UniqueId};
use super::wire::{self, ADDR_BYTES, ROOT_TARGET, Role, SECRET_BYTES, ft};
use crate::error::{Error, Result, Status};

/// Largest single message (`send` payload, allgather contribution, broadcast). Bootstrap data is
/// addresses and small blobs; the cap bounds what a peer can make us buffer per frame.
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;
/// A peer's incoming connection must authenticate within this time.
const PEER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_PENDING_HANDSHAKES: usize = 256;
/// Frame header we put in front of DATA payloads: tag space + tag.
const DATA_HDR: usize = 5;

/// Tag spaces keep user tags and collective sequence numbers from ever matching each other.
const SPACE_USER: u8 = 1;
const SPACE_COLL: u8 = 2;
/// `shrink`'s hand-over of the new group's id: apart from `SPACE_COLL`, whose sequence numbers
/// count collectives of every rank, which a shrink (excluded ranks take no part) is not.
const SPACE_SHRINK: u8 = 3;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding the lock leaves plain data behind; keep going with it
    // rather than turning one failure into a panic cascade.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct PeerIn {
    open: u32,
    closed: Option<Error>,
}

struct Mailbox {
    queues: HashMap<(u32, u8, u32), VecDeque<Vec<u8>>>,
    peers: Vec<PeerIn>,
}

struct Shared {
    rank: u32,
    nranks: u32,
    secret: [u8; SECRET_BYTES],
    mail: Mutex<Mailbox>,
    arrived: Condvar,
    stop: AtomicBool,
    /// Clones of the incoming streams, so `Drop` can shut them down and the receive threads exit
    /// at once instead of at their next poll.
    incoming: Mutex<Vec<TcpStream>>,
}

/// One rank's view of a bootstrapped job.
///
/// All methods take `&self` and lock internally, so a `Bootstrap` can be shared between threads
/// and used from several of them *in sequence*. Collective calls (`allgather`, `barrier`,
/// `broadcast`) must be made in the same order on every rank and never concurrently on one
/// rank: they are matched across ranks by call order. `send`/`recv` with distinct tags may be
/// used from several threads at once.
pub struct Bootstrap {
    rank: u32,
    nranks: u32,
    timeout: Duration,
    peers: Vec<SocketAddr>,
    out: Vec<Mutex<Option<TcpStream>>>,
    shared: Arc<Shared>,
    coll_seq: AtomicU32,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Bootstrap {
    /// Join the job named by `uid` as `rank` of `nranks`: register with the root service, wait
    /// for every rank's address, and return. `timeout` bounds this call and, from then on, each
    /// operation.
    pub fn init(uid: &UniqueId, rank: u32, nranks: u32, timeout: Duration) -> Result<Bootstrap> {
        if nranks == 0 || rank >= nranks {
            return Err(Error::invalid_param(format!("bootstrap init: rank {rank} is not below nranks {nranks}")));
        }
        if timeout.is_zero() {
            return Err(Error::invalid_param("bootstrap init: timeout is zero"));
        }
        let deadline = wire::deadline_after(timeout);
        let root = uid.root_addr();
        let what = format!("bootstrap rank {rank}/{nranks}: rendezvous with root {root}");

        // Connect to the root first: the local address of that connection is the interface that
        // reaches the root, and therefore the one the other ranks can most likely reach us on.
        let stream = wire::connect_until(root, deadline, true, &what)?;
        wire::client_handshake(&stream, uid.secret(), Role::Rank, rank, ROOT_TARGET, deadline, &what)?;
        let local_ip = stream.local_addr().map_err(|e| Error::io(&what, e))?.ip();
        let listener =
            TcpListener::bind(SocketAddr::new(local_ip, 0)).map_err(|e| Error::io(&format!("{what}: listen on {local_ip}"), e))?;
        let listen = listener.local_addr().map_err(|e| Error::io(&what, e))?;

        let shared = Arc::new(Shared {
            rank,
            nranks,
            secret: *uid.secret(),
            mail: Mutex::new(Mailbox { queues: HashMap::new(), peers: (0..nranks).map(|_| PeerIn::default()).collect() }),
            arrived: Condvar::new(),
            stop: AtomicBool::new(false),
            incoming: Mutex::new(Vec::new()),
        });
        // Listen before registering: once the root publishes the table, peers may connect.
        start_accept(listener, &shared)?;
        // From here on an early return must stop the accept thread we just started.
        let mut guard = StopOnDrop { shared: Arc::clone(&shared), armed: true };

        let mut reg = Vec::with_capacity(8 + ADDR_BYTES);
        reg.extend_from_slice(&rank.to_le_bytes());
        reg.extend_from_slice(&nranks.to_le_bytes());
        wire::encode_addr(&listen, &mut reg);
        wire::write_frame(&stream, ft::REGISTER, &[&reg], deadline, &what)?;

        let max_table = 4 + nranks as usize * ADDR_BYTES;
        let (ty, p) = wire::read_frame(&stream, max_table.max(1 << 16), deadline, &what).map_err(|e| {
            if e.status() == Status::TimedOut {
                Error::new(
                    Status::TimedOut,
                    format!(
                        "{what}: no address table within {timeout:?}; not every rank reached \
                             the root (a rank missing, or still starting?)"
                    ),
                )
            } else {
                e
            }
        })?;
        let peers = match ty {
            ft::TABLE => decode_table(&p, nranks, &what)?,
            ft::ERROR => return Err(wire::decode_error(&p, &format!("bootstrap root {root}"))),
            _ => {
                return Err(Error::new(Status::Internal, format!("{what}: unexpected frame type {ty} from the root")));
            }
        };
        guard.armed = false;
        tracing::debug!(target: "gsc::bootstrap", rank, nranks, %listen, "bootstrap ready");
        Ok(Bootstrap {
            rank,
            nranks,
            timeout,
            peers,
            out: (0..nranks).map(|_| Mutex::new(None)).collect(),
            shared,
            coll_seq: AtomicU32::new(0),
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn nranks(&self) -> u32 {
        self.nranks
    }

    /// The bound on each operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where `peer`'s bootstrap listener is (as published by the root).
    pub fn peer_addr(&self, peer: u32) -> Option<SocketAddr> {
        self.peers.get(peer as usize).copied()
    }

    /// Every rank's contribution, indexed by rank. Contributions may differ in size.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        check_size(mine.len(), "allgather")?;
        let n = self.nranks;
        let seq = self.next_seq();
        let deadline = wire::deadline_after(self.timeout);
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); n as usize];
        out[self.rank as usize] = mine.to_vec();
        // Ring: at step s pass on the block that arrived at step s-1 (our own at s=0).
        let next = (self.rank + 1) % n;
        let prev = (self.rank + n - 1) % n;
        for step in 0..n - 1 {
            let send_idx = (self.rank + n - step) % n;
            let recv_idx = (self.rank + 2 * n - step - 1) % n;
            let block = &out[send_idx as usize];
            self.send_raw(next, SPACE_COLL, seq, &[&send_idx.to_le_bytes(), block], deadline, "allgather")?;
            let msg = self.recv_raw(prev, SPACE_COLL, seq, deadline, "allgather")?;
            let (idx, data) = split_u32(&msg, "allgather", prev)?;
            if idx != recv_idx {
                return Err(Error::new(
                    Status::Internal,
                    format!("allgather: rank {prev} sent block {idx}, expected {recv_idx} (collective calls out of order?)"),
                ));
            }
            out[recv_idx as usize] = data.to_vec();
        }
        Ok(out)
    }

    /// Return once every rank has entered the barrier (dissemination: ⌈log2 n⌉ rounds).
    pub fn barrier(&self) -> Result<()> {
        let n = self.nranks;
        let seq = self.next_seq();
        let deadline = wire::deadline_after(self.timeout);
        let mut dist = 1u32;
        let mut round = 0u32;
        while dist < n {
            let to = (self.rank + dist) % n;
            let from = (self.rank + n - dist) % n;
            self.send_raw(to, SPACE_COLL, seq, &[&round.to_le_bytes()], deadline, "barrier")?;
            let msg = self.recv_raw(from, SPACE_COLL, seq, deadline, "barrier")?;
            let (got, _) = split_u32(&msg, "barrier", from)?;
            if got != round {
                return Err(Error::new(
                    Status::Internal,
                    format!("barrier: rank {from} is in round {got}, expected {round} (collective calls out of order?)"),
                ));
            }
            dist = dist.saturating_mul(2);
            round += 1;
        }
        Ok(())
    }

    /// `root`'s `data` on every rank (binomial tree). `data` is ignored on the other ranks.
    pub fn broadcast(&self, root: u32, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.nranks {
            return Err(Error::invalid_param(format!("broadcast: root {root} is not below nranks {}", self.nranks)));
        }
        let n = self.nranks;
        let seq = self.next_seq();
        let deadline = wire::deadline_after(self.timeout);
        let vr = (self.rank + n - root) % n; // rank relative to the root
        let mut buf = if vr == 0 {
            check_size(data.len(), "broadcast")?;
            data.to_vec()
        } else {
            Vec::new()
        };
        // Receive from the parent: the relative rank with our lowest set bit cleared.
        let mut mask = 1u32;
        while mask < n {
            if vr & mask != 0 {
                let parent = (vr - mask + root) % n;
                buf = self.recv_raw(parent, SPACE_COLL, seq, deadline, "broadcast")?;
                break;
            }
            mask <<= 1;
        }
        // Forward to the children below that bit.
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                let child = (vr + mask + root) % n;
                self.send_raw(child, SPACE_COLL, seq, &[&buf], deadline, "broadcast")?;
            }
            mask >>= 1;
        }
        Ok(buf)
    }

    /// Send `data` to `peer` with `tag`. Returns once the data is handed to the kernel; the peer
    /// buffers it until a matching `recv`. Messages from one rank with one tag arrive in order.
    pub fn send(&self, peer: u32, tag: u32, data: &[u8]) -> Result<()> {
        self.check_peer(peer, "send")?;
        check_size(data.len(), "send")?;
        let deadline = wire::deadline_after(self.timeout);
        self.send_raw(peer, SPACE_USER, tag, &[data], deadline, "send")
    }

    /// Receive the next message `peer` sent with `tag`.
    pub fn recv(&self, peer: u32, tag: u32) -> Result<Vec<u8>> {
        self.check_peer(peer, "recv")?;
        let deadline = wire::deadline_after(self.timeout);
        self.recv_raw(peer, SPACE_USER, tag, deadline, "recv")
    }

    /// `exclude` sorted, if `shrink` would take it from this rank: not empty, every rank below
    /// nranks, none twice, and not this rank (an excluded rank does not call shrink).
    pub fn check_shrink(&self, exclude: &[u32]) -> Result<Vec<u32>> {
        shrink_list(exclude, self.rank, self.nranks)
    }

    /// A new group of this group's ranks except `exclude`, numbered in their order here, made
    /// by those ranks alone (NCCL's ncclCommShrink): an excluded rank takes no part, so it may
    /// be dead. Every remaining rank gives the same ranks, in any order; the lowest remaining
    /// rank hosts the new rendezvous and hands its id to the others, with its list, so a rank
    /// whose list differs fails naming both (the others then time out in the rendezvous).
    pub fn shrink(&self, exclude: &[u32]) -> Result<Bootstrap> {
        let excluded = self.check_shrink(exclude)?;
        let members: Vec<u32> = (0..self.nranks).filter(|r| excluded.binary_search(r).is_err()).collect();
        let lead = members[0]; // not empty: this rank is a member
        let deadline = wire::deadline_after(self.timeout);
        let mine: Vec<u8> = excluded.iter().flat_map(|r| r.to_le_bytes()).collect();
        let uid = if lead == self.rank {
            let uid = UniqueId::create(Some(self.peers[self.rank as usize].ip()))?;
            let id = uid.to_bytes();
            for &m in &members[1..] {
                self.send_raw(m, SPACE_SHRINK, 0, &[&id, &mine], deadline, "shrink")?;
            }
            uid
        } else {
            let msg = self.recv_raw(lead, SPACE_SHRINK, 0, deadline, "shrink")?;
            if msg.len() < UNIQUE_ID_BYTES || !(msg.len() - UNIQUE_ID_BYTES).is_multiple_of(4) {
                return Err(Error::new(Status::Internal, format!("shrink: a message of {} bytes from rank {lead}", msg.len())));
            }
            let (id, theirs) = msg.split_at(UNIQUE_ID_BYTES);
            if theirs != mine.as_slice() {
                let theirs: Vec<u32> = theirs.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                return Err(Error::invalid_param(format!(
                    "shrink: rank {lead} excludes ranks {theirs:?}, rank {} excludes {excluded:?}: every remaining rank must \
                     exclude the same ranks",
                    self.rank
                )));
            }
            UniqueId::from_bytes(id)?
        };
        let new_rank = members.iter().position(|&r| r == self.rank).expect("this rank is a member");
        Bootstrap::init(&uid, new_rank as u32, members.len() as u32, self.timeout)
    }

    fn check_peer(&self, peer: u32, op: &str) -> Result<()> {
        if peer >= self.nranks {
            return Err(Error::invalid_param(format!("{op}: peer {peer} is not below nranks {}", self.nranks)));
        }
        Ok(())
    }

    fn next_seq(&self) -> u32 {
        self.coll_seq.fetch_add(1, Ordering::Relaxed)
    }

    fn send_raw(&self, peer: u32, space: u8, tag: u32, parts: &[&[u8]], deadline: Instant, op: &str) -> Result<()> {
        if peer == self.rank {
            let data = parts.concat();
            let mut mail = lock(&self.shared.mail);
            mail.queues.entry((peer, space, tag)).or_default().push_back(data);
            self.shared.arrived.notify_all();
            return Ok(());
        }
        let what = format!("bootstrap rank {}: {op} to rank {peer}", self.rank);
        let mut slot = lock(&self.out[peer as usize]);
        if slot.is_none() {
            let addr = self.peers[peer as usize];
            // No retry on refusal: the peer listened before the table existed, so a refusal means
            // it is gone.
            let s = wire::connect_until(addr, deadline, false, &what).map_err(|e| peer_err(e, peer))?;
            wire::client_handshake(&s, &self.shared.secret, Role::Peer, self.rank, peer, deadline, &what)?;
            *slot = Some(s);
        }
        let Some(stream) = slot.as_ref() else {
            return Err(Error::new(Status::Internal, format!("{what}: connection slot empty")));
        };
        let mut hdr = [0u8; DATA_HDR];
        hdr[0] = space;
        hdr[1..5].copy_from_slice(&tag.to_le_bytes());
        let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        all.push(&hdr);
        all.extend_from_slice(parts);
        if let Err(e) = wire::write_frame(stream, ft::DATA, &all, deadline, &what) {
            // The stream may hold half a frame: never reuse it. A later send reconnects.
            *slot = None;
            return Err(peer_err(e, peer));
        }
        Ok(())
    }

    fn recv_raw(&self, peer: u32, space: u8, tag: u32, deadline: Instant, op: &str) -> Result<Vec<u8>> {
        let mut mail = lock(&self.shared.mail);
        loop {
            if let Some(msg) = mail.queues.get_mut(&(peer, space, tag)).and_then(|q| q.pop_front()) {
                return Ok(msg);
            }
            let st = &mail.peers[peer as usize];
            if st.open == 0
                && let Some(e) = &st.closed
            {
                return Err(e.clone().context(format!("bootstrap rank {}: {op} waiting for rank {peer}", self.rank)));
            }
            let Some(rem) = wire::remaining(deadline) else {
                return Err(Error::new(
                    Status::TimedOut,
                    format!("bootstrap rank {}: {op} timed out after {:?} waiting for rank {peer}", self.rank, self.timeout),
                ));
            };
            mail = self.shared.arrived.wait_timeout(mail, rem).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

impl Shared {
    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        for s in lock(&self.incoming).drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.arrived.notify_all();
    }
}

/// Raises `stop` if `init` fails after the accept thread started.
struct StopOnDrop {
    shared: Arc<Shared>,
    armed: bool,
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.shared.shutdown();
        }
    }
}

/// A connection failure while talking to `peer` is that peer's failure: say which.
fn peer_err(e: Error, peer: u32) -> Error {
    match e.status() {
        Status::Unreachable => Error::new(Status::PeerFailed, format!("rank {peer} no longer accepts connections: {}", e.message())),
        _ => e,
    }
}

fn check_size(len: usize, op: &str) -> Result<()> {
    if len > MAX_MESSAGE_BYTES {
        return Err(Error::invalid_param(format!("{op}: {len} bytes exceed the bootstrap message limit of {MAX_MESSAGE_BYTES}")));
    }
    Ok(())
}

/// `exclude` sorted, once it is checked: not empty, every rank below `nranks`, none twice, and
/// not `me` (an excluded rank does not call shrink).
fn shrink_list(exclude: &[u32], me: u32, nranks: u32) -> Result<Vec<u32>> {
    if exclude.is_empty() {
        return Err(Error::invalid_param("shrink: the list of ranks to exclude is empty"));
    }
    let mut sorted = exclude.to_vec();
    sorted.sort_unstable();
    if let Some(&r) = sorted.iter().find(|&&r| r >= nranks) {
        return Err(Error::invalid_param(format!("shrink: rank {r} to exclude is not below nranks {nranks}")));
    }
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid_param(format!("shrink: rank {} is listed twice to exclude", w[0])));
    }
    if sorted.binary_search(&me).is_ok() {
        return Err(Error::invalid_param(format!(
            "shrink: this rank ({me}) is in the list to exclude: an excluded rank does not call shrink"
        )));
    }
    Ok(sorted)
}

fn split_u32<'a>(msg: &'a [u8], op: &str, from: u32) -> Result<(u32, &'a [u8])> {
    if msg.len() < 4 {
        return Err(Error::new(Status::Internal, format!("{op}: short message from rank {from} (collective calls out of order?)")));
    }
    Ok((u32::from_le_bytes([msg[0], msg[1], msg[2], msg[3]]), &msg[4..]))
}

pub(crate) fn decode_table(p: &[u8], nranks: u32, what: &str) -> Result<Vec<SocketAddr>> {
    if p.len() != 4 + nranks as usize * ADDR_BYTES {
        return Err(Error::new(Status::Internal, format!("{what}: table of {} bytes for {nranks} ranks", p.len())));
    }
    let n = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
    if n != nranks {
        return Err(Error::new(Status::Internal, format!("{what}: table for {n} ranks, expected {nranks}")));
    }
    p[4..].chunks_exact(ADDR_BYTES).map(|c| wire::decode_addr(c).map_err(|e| e.context(what))).collect()
}

fn start_accept(listener: TcpListener, shared: &Arc<Shared>) -> Result<()> {
    listener.set_nonblocking(true).map_err(|e| Error::io("bootstrap: set_nonblocking on the rank listener", e))?;
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name(format!("gsc-boot-accept-{}", shared.rank))
        .spawn(move || accept_loop(listener, shared))
        .map(|_| ())
        .map_err(|e| Error::new(Status::NoResource, format!("bootstrap: spawn accept thread: {e}")))
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let pending = Arc::new(AtomicUsize::new(0));
    while !shared.stop.load(Ordering::Acquire) {
        match wire::wait_readable(&listener, ACCEPT_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::error!(target: "gsc::bootstrap", rank = shared.rank, err = %e,
                    "poll on the rank listener failed; no more incoming connections");
                return;
            }
        }
        let stream = match wire::accept_nonblocking(&listener) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(target: "gsc::bootstrap", rank = shared.rank, err = %e, "accept failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        if pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES {
            tracing::warn!(target: "gsc::bootstrap", rank = shared.rank,
                "too many connections mid-handshake; dropping one");
            continue;
        }
        pending.fetch_add(1, Ordering::AcqRel);
        let (sh, pend) = (Arc::clone(&shared), Arc::clone(&pending));
        let spawned =
            std::thread::Builder::new().name(format!("gsc-boot-recv-{}", shared.rank)).spawn(move || serve_incoming(stream, sh, pend));
        if let Err(e) = spawned {
            pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(target: "gsc::bootstrap", err = %e, "cannot spawn a receive thread");
        }
    }
}

/// Authenticate an incoming connection, then move its frames into the mailbox until it closes.
fn serve_incoming(stream: TcpStream, shared: Arc<Shared>, pending: Arc<AtomicUsize>) {
    let me = shared.rank;
    let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let what = format!("bootstrap rank {me}: incoming connection from {from}");
    let deadline = wire::deadline_after(PEER_HANDSHAKE_TIMEOUT);
    let hs = wire::server_handshake(&stream, &shared.secret, Role::Peer, me, deadline, &what);
    pending.fetch_sub(1, Ordering::AcqRel);
    let peer = match hs {
        Ok(h) if h.rank < shared.nranks && h.rank != me => h.rank,
        Ok(h) => {
            tracing::warn!(target: "gsc::bootstrap", rank = me, claimed = h.rank, %from,
                "authenticated connection claims an impossible rank; dropped");
            return;
        }
        Err(e) => {
            tracing::info!(target: "gsc::bootstrap", rank = me, err = %e, "dropped incoming connection");
            return;
        }
    };
    if let Ok(c) = stream.try_clone() {
        lock(&shared.incoming).push(c);
    }
    // Re-check after registering the clone: a Drop that ran before the push would not shut it down.
    if shared.stop.load(Ordering::Acquire) {
        return;
    }
    lock(&shared.mail).peers[peer as usize].open += 1;
    let what = format!("bootstrap rank {me}: connection from rank {peer}");
    let end = loop {
        match wire::read_frame_stoppable(&stream, DATA_HDR + MAX_MESSAGE_BYTES + 4, &shared.stop, ACCEPT_POLL, &what) {
            Ok((ft::DATA, mut p)) if p.len() >= DATA_HDR => {
                let space = p[0];
                let tag = u32::from_le_bytes([p[1], p[2], p[3], p[4]]);
                p.drain(..DATA_HDR); // in place: no second allocation of a large payload
                let mut mail = lock(&shared.mail);
                mail.queues.entry((peer, space, tag)).or_default().push_back(p);
                shared.arrived.notify_all();
            }
            Ok((ty, p)) => {
                break Error::new(Status::IoError, format!("{what}: protocol violation (frame type {ty}, {} bytes)", p.len()));
            }
            Err(e) if e.status() == Status::PeerFailed => {
                break Error::new(Status::PeerFailed, format!("rank {peer} closed its bootstrap connection"));
            }
            Err(e) => break e,
        }
    };
    tracing::debug!(target: "gsc::bootstrap", rank = me, peer, err = %end, "incoming connection ended");
    let mut mail = lock(&shared.mail);
    let st = &mut mail.peers[peer as usize];
    st.open = st.open.saturating_sub(1);
    st.closed = Some(end);
    shared.arrived.notify_all();
}

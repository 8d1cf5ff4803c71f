//! The root rendezvous service: collects (rank, nranks, listening address) from every rank of one
//! job, validates them and answers every rank with the full address table — or with one error.
//!
//! Threads: an accept thread hands each connection to its own short-lived handshake thread, so a
//! silent or malicious connection only ever costs its own thread until the handshake deadline;
//! authenticated registrations flow over a channel to the coordinator (the thread started by
//! [`spawn`]), which owns all the state and is the only one to answer ranks.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};

use super::wire::{self, ADDR_BYTES, ROOT_TARGET, Role, SECRET_BYTES, ft};
use crate::error::{Error, Result, Status};

/// How often the accept loops re-check their stop flag.
pub(crate) const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// Handshake threads alive at once; beyond that new connections are closed at once, so a flood
/// of connections cannot exhaust threads (it can still delay ranks: see the module docs).
const MAX_PENDING_HANDSHAKES: usize = 256;
/// Stack for handshake threads: they only parse a few small frames.
const SMALL_STACK: usize = 128 << 10;

/// Options of the root rendezvous service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootOptions {
    /// The service gives up (answering every connected rank with `TimedOut`) if the job is not
    /// complete this long after it started.
    pub timeout: Duration,
    /// A connection must authenticate and register within this time or it is dropped.
    pub handshake_timeout: Duration,
    /// Largest frame accepted from a client after authentication.
    pub max_frame: usize,
}

impl Default for RootOptions {
    fn default() -> RootOptions {
        RootOptions { timeout: Duration::from_secs(300), handshake_timeout: Duration::from_secs(5), max_frame: 1 << 20 }
    }
}

struct Registration {
    rank: u32,
    nranks: u32,
    listen: SocketAddr,
    from: SocketAddr,
    stream: TcpStream,
}

/// Start the service on `listener` (already bound) in the background.
pub(crate) fn spawn(listener: TcpListener, secret: [u8; SECRET_BYTES], opts: RootOptions) -> Result<()> {
    listener.set_nonblocking(true).map_err(|e| Error::io("bootstrap root: set_nonblocking on the listener", e))?;
    let addr = listener.local_addr().map_err(|e| Error::io("bootstrap root: local_addr of the listener", e))?;
    let deadline = wire::deadline_after(opts.timeout);
    let (tx, rx) = crossbeam_channel::unbounded::<Registration>();
    let stop = Arc::new(AtomicBool::new(false));

    let stop_a = Arc::clone(&stop);
    let opts_a = opts.clone();
    let accept = std::thread::Builder::new()
        .name("gsc-boot-root-accept".into())
        .spawn(move || accept_loop(listener, secret, opts_a, tx, stop_a))
        .map_err(|e| Error::new(Status::NoResource, format!("bootstrap root: spawn thread: {e}")))?;

    let stop_c = Arc::clone(&stop);
    let spawned = std::thread::Builder::new().name("gsc-boot-root".into()).spawn(move || {
        // Once every rank registered, the listening socket is closed before any rank gets the
        // table: the ranks may start their next rendezvous at this same address at once
        // (launcher mode, NCCL_COMM_ID), and must find it free to bind, and no finished root
        // to connect to.
        let close_listener = || {
            stop_c.store(true, Ordering::Release);
            wake(addr);
            let _ = accept.join();
        };
        coordinate(addr, &opts, deadline, rx, close_listener);
        // Other endings: the accept thread sees this within ACCEPT_POLL and closes the socket.
        stop_c.store(true, Ordering::Release);
    });
    if let Err(e) = spawned {
        stop.store(true, Ordering::Release); // no coordinator: let the accept thread go too
        return Err(Error::new(Status::NoResource, format!("bootstrap root: spawn thread: {e}")));
    }
    Ok(())
}

/// Make the accept loop's wait return now (a connection it will not accept: `stop` is up).
fn wake(addr: SocketAddr) {
    let to = match addr.ip().is_unspecified() {
        true => SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port()),
        false => addr,
    };
    // A failure only leaves the loop to notice `stop` at its next poll.
    let _ = TcpStream::connect_timeout(&to, ACCEPT_POLL);
}

fn accept_loop(listener: TcpListener, secret: [u8; SECRET_BYTES], opts: RootOptions, tx: Sender<Registration>, stop: Arc<AtomicBool>) {
    let pending = Arc::new(AtomicUsize::new(0));
    // Runs until the coordinator raises `stop` (it always does, on success, failure or its
    // deadline). Exiting on our own would drop `tx` and look like a listener failure to it.
    while !stop.load(Ordering::Acquire) {
        match wire::wait_readable(&listener, ACCEPT_POLL) {
            Ok(false) => continue,
            // The coordinator's wake-up (or a connection after the job was complete): not taken.
            Ok(true) if stop.load(Ordering::Acquire) => break,
            Ok(true) => {}
            Err(e) => {
                tracing::error!(target: "gsc::bootstrap", err = %e, "root: poll on listener failed");
                return; // dropping `tx` tells the coordinator
            }
        }
        let stream = match wire::accept_nonblocking(&listener) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(e) => {
                // EMFILE and friends are transient: back off instead of spinning or dying.
                tracing::warn!(target: "gsc::bootstrap", err = %e, "root: accept failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let from = stream.peer_addr().ok();
        if pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES {
            tracing::warn!(target: "gsc::bootstrap", ?from,
                "root: too many connections mid-handshake; dropping this one");
            continue;
        }
        pending.fetch_add(1, Ordering::AcqRel);
        let (tx, pending_t, opts_t) = (tx.clone(), Arc::clone(&pending), opts.clone());
        let spawned = std::thread::Builder::new().name("gsc-boot-root-hs".into()).stack_size(SMALL_STACK).spawn(move || {
            match handshake(stream, &secret, &opts_t) {
                Ok(reg) => {
                    // Send fails only if the coordinator is gone; the rank then sees EOF.
                    let _ = tx.send(reg);
                }
                Err(e) => tracing::info!(target: "gsc::bootstrap", ?from, err = %e,
                        "root: dropped a connection that did not complete the handshake"),
            }
            pending_t.fetch_sub(1, Ordering::AcqRel);
        });
        if let Err(e) = spawned {
            pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(target: "gsc::bootstrap", err = %e, "root: cannot spawn handshake thread");
        }
    }
}

/// Authenticate one connection and read its registration, all within the handshake timeout.
fn handshake(stream: TcpStream, secret: &[u8; SECRET_BYTES], opts: &RootOptions) -> Result<Registration> {
    let deadline = wire::deadline_after(opts.handshake_timeout);
    let from = stream.peer_addr().map_err(|e| Error::io("bootstrap root: peer_addr of a new connection", e))?;
    let what = format!("bootstrap root: connection from {from}");
    wire::server_handshake(&stream, secret, Role::Rank, ROOT_TARGET, deadline, &what)?;
    let (ty, p) = wire::read_frame(&stream, opts.max_frame, deadline, &what)?;
    if ty != ft::REGISTER || p.len() != 8 + ADDR_BYTES {
        return Err(Error::new(Status::Rejected, format!("{what}: expected a registration, got frame type {ty} ({} bytes)", p.len())));
    }
    let rank = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
    let nranks = u32::from_le_bytes([p[4], p[5], p[6], p[7]]);
    let listen = wire::decode_addr(&p[8..]).map_err(|e| e.context(&what))?;
    Ok(Registration { rank, nranks, listen, from, stream })
}

/// Deadline for answering one rank: a rank that does not read must not hold up the others long.
fn answer_deadline(opts: &RootOptions) -> Instant {
    wire::deadline_after(opts.handshake_timeout.min(Duration::from_secs(2)))
}

fn send_error(reg: &Registration, err: &Error, opts: &RootOptions) {
    let what = format!("bootstrap root: error answer to rank {} at {}", reg.rank, reg.from);
    let payload = wire::encode_error(err);
    if let Err(e) = wire::write_frame(&reg.stream, ft::ERROR, &[&payload], answer_deadline(opts), &what) {
        tracing::debug!(target: "gsc::bootstrap", err = %e, "root: could not deliver the error");
    }
}

fn validate(regs: &BTreeMap<u32, Registration>, new: &Registration) -> Result<()> {
    if new.nranks == 0 {
        return Err(Error::invalid_param(format!("rank {} announced nranks=0", new.rank)));
    }
    if new.rank >= new.nranks {
        return Err(Error::invalid_param(format!("rank {} announced nranks={}: rank out of range", new.rank, new.nranks)));
    }
    if let Some(first) = regs.values().next()
        && first.nranks != new.nranks
    {
        return Err(Error::invalid_param(format!(
            "rank {} announced nranks={} but rank {} announced nranks={}",
            new.rank, new.nranks, first.rank, first.nranks
        )));
    }
    if let Some(prev) = regs.get(&new.rank) {
        return Err(Error::invalid_param(format!("rank {} registered twice (from {} and from {})", new.rank, prev.from, new.from)));
    }
    Ok(())
}

fn missing_ranks(regs: &BTreeMap<u32, Registration>, nranks: u32) -> String {
    const SHOWN: usize = 16;
    let missing: Vec<u32> = (0..nranks).filter(|r| !regs.contains_key(r)).collect();
    let mut s: Vec<String> = missing.iter().take(SHOWN).map(|r| r.to_string()).collect();
    if missing.len() > SHOWN {
        s.push(format!("… {} more", missing.len() - SHOWN));
    }
    s.join(", ")
}

/// Collect the job's registrations and answer them; `close_listener` runs once every rank is in,
/// before the table goes out.
fn coordinate(
    addr: SocketAddr,
    opts: &RootOptions,
    deadline: Instant,
    rx: crossbeam_channel::Receiver<Registration>,
    close_listener: impl FnOnce(),
) {
    let mut regs: BTreeMap<u32, Registration> = BTreeMap::new();
    // After a validation failure we keep answering latecomers with the same error until the
    // deadline, so every rank of the job learns why instead of timing out.
    let mut failed: Option<Error> = None;
    loop {
        match rx.recv_deadline(deadline) {
            Ok(reg) => {
                if let Some(err) = &failed {
                    send_error(&reg, err, opts);
                    continue;
                }
                tracing::debug!(target: "gsc::bootstrap", rank = reg.rank, nranks = reg.nranks,
                    listen = %reg.listen, "root: rank registered");
                if let Err(err) = validate(&regs, &reg) {
                    tracing::warn!(target: "gsc::bootstrap", %addr, err = %err,
                        "root: job rejected; telling every rank");
                    send_error(&reg, &err, opts);
                    for r in regs.values() {
                        send_error(r, &err, opts);
                    }
                    regs.clear();
                    failed = Some(err);
                    continue;
                }
                let nranks = reg.nranks;
                regs.insert(reg.rank, reg);
                if regs.len() as u64 == u64::from(nranks) {
                    close_listener();
                    send_table(&regs, nranks, opts);
                    tracing::debug!(target: "gsc::bootstrap", %addr, nranks,
                        "root: table sent; service done");
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if failed.is_none()
                    && let Some(first) = regs.values().next()
                {
                    let err = Error::new(
                        Status::TimedOut,
                        format!(
                            "root {addr} gave up after {:?} with {} of {} ranks registered; \
                                 missing ranks: {}",
                            opts.timeout,
                            regs.len(),
                            first.nranks,
                            missing_ranks(&regs, first.nranks)
                        ),
                    );
                    tracing::warn!(target: "gsc::bootstrap", err = %err, "root: timed out");
                    for r in regs.values() {
                        send_error(r, &err, opts);
                    }
                }
                return;
            }
            Err(RecvTimeoutError::Disconnected) => {
                let err = Error::new(Status::IoError, format!("root {addr}: the listening socket failed; rendezvous aborted"));
                for r in regs.values() {
                    send_error(r, &err, opts);
                }
                return;
            }
        }
    }
}

fn send_table(regs: &BTreeMap<u32, Registration>, nranks: u32, opts: &RootOptions) {
    let mut table = Vec::with_capacity(4 + regs.len() * ADDR_BYTES);
    table.extend_from_slice(&nranks.to_le_bytes());
    for r in regs.values() {
        wire::encode_addr(&r.listen, &mut table);
    }
    for r in regs.values() {
        let what = format!("bootstrap root: table to rank {} at {}", r.rank, r.from);
        if let Err(e) = wire::write_frame(&r.stream, ft::TABLE, &[&table], answer_deadline(opts), &what) {
            // That rank will fail on its own (its read fails or times out); the others go on.
            tracing::warn!(target: "gsc::bootstrap", err = %e, "root: could not send the table");
        }
    }
}

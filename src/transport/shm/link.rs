//! `ShmLink`: one side of a connection segment, as a `Link`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::transport::shm::cma::{self, Dir};
use crate::transport::shm::layout::{self, ConnCtrl, SIDE_CLOSED, SIDE_OPEN, SIDE_REJECTED};
use crate::transport::shm::ring::{RingConsumer, RingProducer};
use crate::transport::shm::segment::Segment;
use crate::transport::{LaneKind, Link, LinkCaps, ProcessIdentity, proc_identity};

/// Which end of a connection segment a link is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Side {
    Connector = 0,
    Acceptor = 1,
}

pub struct ShmLink {
    // Field order: the rings point into `seg`'s mapping, which is unmapped when `seg` drops; they
    // have no drop code, so order does not matter for soundness, but keep `seg` last anyway.
    tx: RingProducer,
    rx: RingConsumer,
    side: Side,
    peer: ProcessIdentity,
    max_frame: usize,
    cma: bool,
    /// `close()` was called: no more sends.
    closed: bool,
    /// A failure already seen (dead peer, corrupt ring); reported once the ring is drained.
    failure: Option<Error>,
    /// How long a peer that promised a heartbeat may stay silent; `None`: never judged by it.
    heartbeat_timeout: Option<Duration>,
    /// The peer's heartbeat count as last seen, and when (our clock) it was first seen at that
    /// value; `None` while the peer promises nothing.
    peer_beat: Option<(u64, Instant)>,
    /// Our own beats so far (we are the only writer of our heartbeat word).
    beats: u64,
    seg: Segment,
}

impl ShmLink {
    /// Attach to the rings of connection segment `seg` as `side`. The geometry is read from the
    /// segment (written by the connector) so both sides agree on it.
    pub fn new(seg: Segment, side: Side, peer: ProcessIdentity, cma: bool, heartbeat_timeout: Option<Duration>) -> Result<ShmLink> {
        if seg.payload_len() < layout::CTRL_SIZE {
            return Err(Error::new(Status::InvalidAddress, "connection segment too small"));
        }
        // SAFETY: the payload holds a ConnCtrl (checked just above), 64-byte aligned; its fields
        // are all atomics; the reference does not outlive this function, while `seg` is alive.
        let ctrl = unsafe { &*seg.payload().cast::<ConnCtrl>() };
        let (cap, max_frame) = layout::geometry(ctrl, seg.payload_len())?;
        let (tx_ring, rx_ring) = match side {
            Side::Connector => (0, 1),
            Side::Acceptor => (1, 0),
        };
        // SAFETY: `geometry` checked that the payload holds both ring regions at these offsets,
        // which are 64-byte aligned (CTRL_SIZE and region sizes are multiples of 64, the payload
        // is 64-aligned). Each ring has exactly one producer (the side it leaves from) and one
        // consumer (the other side). The rings live in `self` next to `seg`, which keeps the
        // mapping alive.
        let (tx, rx) = unsafe {
            (
                RingProducer::attach(seg.payload().add(layout::ring_offset(cap, tx_ring)), cap, max_frame)?,
                RingConsumer::attach(seg.payload().add(layout::ring_offset(cap, rx_ring)), cap, max_frame)?,
            )
        };
        Ok(ShmLink { tx, rx, side, peer, max_frame, cma, closed: false, failure: None, heartbeat_timeout, peer_beat: None, beats: 0, seg })
    }

    fn ctrl(&self) -> &ConnCtrl {
        // SAFETY: checked in `new` that the payload holds a ConnCtrl; all its fields are atomics,
        // so a shared reference is sound while the peer writes them.
        unsafe { &*self.seg.payload().cast::<ConnCtrl>() }
    }

    /// Has a peer that promised a heartbeat stayed silent for longer than we allow? Judged by
    /// whether its count moves between our checks, timed on our own clock from when we first saw
    /// the count at its present value. That instant is never earlier than the peer's last beat,
    /// so a pause of *ours* (we were stopped, or not progressed) cannot make a live peer look
    /// silent: it beat meanwhile, and we see a new count. The limit is ours, but never less than
    /// four of the peer's promised periods, so a peer configured to beat rarely is not failed by
    /// a process configured to judge quickly.
    fn heartbeat_silence(&mut self) -> Option<Error> {
        let timeout = self.heartbeat_timeout?;
        let beat = &self.ctrl().beats[1 - self.side as usize];
        // Relaxed: each word is read on its own; a promise seen with an older count only starts
        // the watch one beat early, and the next beat moves the count.
        let period_ms = beat.period_ms.load(Ordering::Relaxed);
        if period_ms == 0 {
            // No promise (no proxy thread on the peer, or it runs with GSC_HEARTBEAT_TIMEOUT=inf):
            // its silence proves nothing, so it is never judged by it.
            self.peer_beat = None;
            return None;
        }
        let count = beat.count.load(Ordering::Relaxed);
        let now = Instant::now();
        match self.peer_beat {
            Some((seen, since)) if seen == count => {
                let silent = now.saturating_duration_since(since);
                let limit = timeout.max(Duration::from_millis(period_ms.saturating_mul(4)));
                (silent > limit).then(|| {
                    Error::new(
                        Status::TimedOut,
                        format!(
                            "shm peer pid {} is alive but its heartbeat stopped: silent for {} ms \
                             (GSC_HEARTBEAT_TIMEOUT {} ms; it promised a beat every {period_ms} ms) \
                             — stopped, hung or starved",
                            self.peer.pid,
                            silent.as_millis(),
                            timeout.as_millis(),
                        ),
                    )
                })
            }
            _ => {
                self.peer_beat = Some((count, now));
                None
            }
        }
    }

    fn my_state(&self) -> &std::sync::atomic::AtomicU32 {
        &self.ctrl().sides[self.side as usize].state
    }

    fn peer_state(&self) -> u32 {
        self.ctrl().sides[1 - self.side as usize].state.load(Ordering::Acquire)
    }

    fn peer_state_error(&self, state: u32) -> Option<Error> {
        match state {
            SIDE_OPEN => None,
            SIDE_REJECTED => {
                Some(Error::new(Status::Rejected, format!("peer pid {} rejected the shm connection (see its log)", self.peer.pid)))
            }
            _ => Some(Error::new(Status::ConnectionReset, format!("peer pid {} closed the shm link", self.peer.pid))),
        }
    }

    /// Why the link is dead, if it is.
    fn dead_reason(&self) -> Option<Error> {
        self.failure.clone().or_else(|| self.peer_state_error(self.peer_state()))
    }

    fn drain(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut n = 0;
        while n < max {
            match self.rx.pop(|f| deliver(f)) {
                Ok(true) => n += 1,
                Ok(false) => break,
                Err(e) => {
                    tracing::error!(target: "gsc::shm", peer = self.peer.pid, error = %e, "link failed");
                    self.failure = Some(e.clone());
                    return if n > 0 { Ok(n) } else { Err(e) };
                }
            }
        }
        Ok(n)
    }

    fn remote_op(&self, local: *mut u8, remote: u64, len: usize, dir: Dir) -> Result<()> {
        if let Some(e) = &self.failure {
            // A dead peer's pid may be reused; never touch memory by pid after a failure.
            return Err(e.clone());
        }
        if !self.cma {
            return Err(Error::unsupported(format!("no cross-memory attach to peer pid {} on this shm link", self.peer.pid)));
        }
        if let Some(e) = self.peer_state_error(self.peer_state()) {
            return Err(e);
        }
        // SAFETY: forwarded from read_remote/write_remote's contract on `local`.
        unsafe { cma::transfer(self.peer.pid, local, remote, len, dir)? };
        if matches!(dir, Dir::Read) {
            // A rendezvous read names a buffer the peer lends us until it completes its send. A
            // peer that gives up on the send (force close, timeout, exit) marks its side closed
            // *before* completing it and reusing the buffer; so if its side is still open after
            // the read, the buffer was valid for the whole read. The fence orders our load after
            // the copy. Liveness guards against the pid being reused by another process mid-read.
            std::sync::atomic::fence(Ordering::SeqCst);
            if let Some(e) = self.peer_state_error(self.peer_state()) {
                return Err(e.context("the peer closed its side during a remote read; the data may be stale"));
            }
            if !proc_identity::is_alive(&self.peer) {
                return Err(Error::new(Status::PeerFailed, format!("peer pid {} died during a remote read", self.peer.pid)));
            }
        }
        Ok(())
    }
}

impl Link for ShmLink {
    fn lane(&self) -> LaneKind {
        LaneKind::Shm
    }

    fn max_frame(&self) -> usize {
        self.max_frame
    }

    fn caps(&self) -> LinkCaps {
        LinkCaps { remote_memory: self.cma }
    }

    fn try_send(&mut self, parts: &[&[u8]]) -> Result<bool> {
        if self.closed {
            return Err(Error::new(Status::NotConnected, "shm link was closed by this side"));
        }
        let len = parts.iter().fold(0usize, |a, p| a.saturating_add(p.len()));
        if len > self.max_frame {
            return Err(Error::invalid_param(format!("frame of {len} bytes exceeds the shm link's max_frame {}", self.max_frame)));
        }
        if let Some(e) = self.dead_reason() {
            return Err(e);
        }
        Ok(self.tx.try_push(parts))
    }

    fn poll_recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let n = self.drain(max, deliver)?;
        if n > 0 || max == 0 {
            return Ok(n);
        }
        let Some(e) = self.dead_reason() else {
            return Ok(0);
        };
        // The peer's state was read (Acquire) after its last frame was published, so a second
        // drain sees everything it ever sent; only an empty ring makes the failure visible.
        let n = self.drain(max, deliver)?;
        if n > 0 { Ok(n) } else { Err(e) }
    }

    fn may_have_news(&mut self) -> bool {
        // The peer's state word is read-mostly (written once, at close), so this stays a
        // cache hit until something happens.
        !self.rx.is_empty() || self.failure.is_some() || self.peer_state() != SIDE_OPEN
    }

    unsafe fn read_remote(&self, local: *mut u8, remote: u64, len: usize) -> Result<()> {
        self.remote_op(local, remote, len, Dir::Read)
    }

    unsafe fn write_remote(&self, local: *const u8, remote: u64, len: usize) -> Result<()> {
        // process_vm_writev only reads the local buffer; the cast is for the shared helper.
        self.remote_op(local.cast_mut(), remote, len, Dir::Write)
    }

    fn check_peer(&mut self) -> Result<()> {
        if let Some(e) = self.dead_reason() {
            // A peer that closed after publishing frames: `poll_recv` delivers them, then
            // fails (see there). Failing here first would drop them, and with them a receive
            // the peer saw complete (a flush close).
            if self.failure.is_none() && !self.rx.is_empty() {
                return Ok(());
            }
            return Err(e);
        }
        if !proc_identity::is_alive(&self.peer) {
            let e =
                Error::new(Status::PeerFailed, format!("peer process pid {} (start time {}) is gone", self.peer.pid, self.peer.start_time));
            tracing::warn!(target: "gsc::shm", peer = self.peer.pid, "shm peer died");
            self.failure = Some(e.clone());
            return Err(e);
        }
        if let Some(e) = self.heartbeat_silence() {
            tracing::warn!(target: "gsc::shm", peer = self.peer.pid, error = %e, "shm peer silent");
            self.failure = Some(e.clone());
            return Err(e);
        }
        Ok(())
    }

    fn heartbeat(&mut self, promise: Option<Duration>) {
        self.beats = self.beats.wrapping_add(1);
        let mine = &self.ctrl().beats[self.side as usize];
        // Relaxed: the peer only looks for a change of the count (see `heartbeat_silence`).
        mine.count.store(self.beats, Ordering::Relaxed);
        // A promise of less than a millisecond still reads as one (0 would mean "none").
        let period_ms = promise.map_or(0, |p| u64::try_from(p.as_millis()).unwrap_or(u64::MAX).max(1));
        mine.period_ms.store(period_ms, Ordering::Relaxed);
    }

    fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            // Release: every frame pushed before is visible to a peer that sees the flag.
            self.my_state().store(SIDE_CLOSED, Ordering::Release);
            tracing::debug!(target: "gsc::shm", peer = self.peer.pid, "shm link closed");
        }
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        // A link dropped without close() is gone all the same; say so. Keep a REJECTED mark.
        let _ = self.my_state().compare_exchange(SIDE_OPEN, SIDE_CLOSED, Ordering::Release, Ordering::Relaxed);
        // The segment's own drop unlinks the file if we created it and the peer has not yet.
    }
}

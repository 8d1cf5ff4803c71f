//! `UcxLink`: one side of a link over UCX active messages, as a `Link`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::engine::{Engine, Ep, Flushing, InFlight, RkeyHandle, Sent};
use super::inbox::{Key, Next};
use super::wire::{self, CloseReason, HEADER_LEN, Header, Kind, Side};
use crate::error::{Error, Result, Status};
use crate::transport::{Exposed, LaneKind, Link, LinkCaps};

/// Most frames one link keeps in flight (sent to UCX, not yet completed).
const MAX_SENDS: usize = 1024;
/// Most unpacked peer keys one link caches. A peer registers each send buffer anew, so over TCP
/// the packed bytes repeat (and hit) while on NICs with per-registration keys they change; past
/// this many the cache starts over rather than grow without bound.
const MAX_RKEYS: usize = 256;

pub struct UcxLink {
    engine: Arc<Engine>,
    /// `None` only during drop.
    ep: Option<Ep>,
    /// The channel this side receives on.
    key: Key,
    side: Side,
    /// The peer worker's uuid, for messages.
    peer: u128,
    next_seq: u64,
    sends: VecDeque<InFlight>,
    in_flight_bytes: usize,
    /// A frame was handed to UCX since the last flush started: UCX may complete its send with
    /// bytes still in this process (`Engine::flush`), so the link is not done sending until a
    /// flush issued after it completes.
    unflushed: bool,
    /// The flush in progress, started once `sends` emptied (`reap`).
    flushing: Option<Flushing>,
    /// `close()` was called: no more sends.
    closed: bool,
    /// A failure this side saw (a send failed); the inbox holds the ones UCX reported.
    failure: Option<Error>,
    /// The peer's packed UCX keys unpacked on `ep`, by their bytes (`read_remote_keyed`).
    rkeys: Mutex<HashMap<Vec<u8>, RkeyHandle>>,
}

impl UcxLink {
    pub(crate) fn new(engine: Arc<Engine>, ep: Ep, key: Key, peer: u128) -> UcxLink {
        UcxLink {
            engine,
            ep: Some(ep),
            key,
            side: key.to,
            peer,
            next_seq: 0,
            sends: VecDeque::new(),
            in_flight_bytes: 0,
            unflushed: false,
            flushing: None,
            closed: false,
            failure: None,
            rkeys: Mutex::new(HashMap::new()),
        }
    }

    fn peer_name(&self) -> String {
        format!("UCX peer worker {:032x}", self.peer)
    }

    /// Send a frame of `kind` whose body follows the header space at the front of `buf`.
    pub(crate) fn post(&mut self, kind: Kind, mut buf: Vec<u8>) -> Result<()> {
        let header = Header { kind, from: self.side, link: self.key.link, seq: self.next_seq };
        buf[..HEADER_LEN].copy_from_slice(&header.encode());
        let ep = self.ep.as_ref().expect("endpoint present until drop");
        // Done or not, UCX may still hold some of its bytes (`Engine::flush`).
        self.unflushed = true;
        match self.engine.send(ep, buf) {
            Ok(Sent::Done) => {}
            Ok(Sent::Pending(f)) => {
                self.in_flight_bytes += f.len();
                self.sends.push_back(f);
            }
            Err(e) => {
                let e = e.context(self.peer_name());
                self.failure.get_or_insert(e.clone());
                return Err(e);
            }
        }
        self.next_seq += 1;
        Ok(())
    }

    /// A buffer (from the engine's pool) with room for the header, then `body`.
    fn framed(&self, body: &[&[u8]]) -> Vec<u8> {
        let len = body.iter().map(|p| p.len()).sum::<usize>();
        let mut buf = self.engine.buffer(HEADER_LEN + len);
        buf.resize(HEADER_LEN, 0);
        for p in body {
            buf.extend_from_slice(p);
        }
        buf
    }

    /// Release the sends UCX finished; a failed one makes the link dead. Once none is left,
    /// flush the endpoint so that `sending` stays true until the frames' bytes really left
    /// this process (`Engine::flush`).
    fn reap(&mut self) {
        if !self.sends.is_empty() {
            match self.engine.poll_sends(&mut self.sends) {
                Ok(bytes) => self.in_flight_bytes -= bytes,
                Err(e) => {
                    self.in_flight_bytes = self.sends.iter().map(InFlight::len).sum();
                    self.failure.get_or_insert(e.context(self.peer_name()));
                }
            }
        }
        if let Some(f) = &self.flushing {
            match self.engine.flush_done(f) {
                None => return,
                Some(r) => {
                    self.flushing = None;
                    if let Err(e) = r {
                        self.failure.get_or_insert(e.context(self.peer_name()));
                    }
                }
            }
        }
        // Only with no send in flight: a flush then covers every frame posted so far, and one
        // flush per burst of frames, not per frame, keeps the cost off the message path.
        if self.unflushed && self.sends.is_empty() && self.failure.is_none() {
            self.unflushed = false;
            let ep = self.ep.as_ref().expect("endpoint present until drop");
            match self.engine.flush(ep) {
                Ok(f) => self.flushing = f,
                Err(e) => {
                    self.failure.get_or_insert(e.context(self.peer_name()));
                }
            }
        }
    }

    /// Why sending is impossible, if it is.
    fn dead_reason(&self) -> Option<Error> {
        self.failure.clone().or_else(|| self.engine.with_inbox(|ib| ib.failure(&self.key)))
    }

    /// Hand out up to `max` frames the inbox holds; the end of the link (close or failure) is an
    /// error only when no frame came before it in this call.
    fn deliver(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut n = 0;
        while n < max {
            let next = self.engine.with_inbox(|ib| ib.next(&self.key));
            let end = match next {
                Next::Frame(f) => {
                    deliver(&f);
                    self.engine.recycle(f);
                    n += 1;
                    continue;
                }
                Next::Empty => return Ok(n),
                Next::Closed(CloseReason::Closed, why) => {
                    Error::new(Status::ConnectionReset, format!("{} closed the UCX link{}", self.peer_name(), suffix(&why)))
                }
                Next::Closed(CloseReason::Rejected, why) => {
                    Error::new(Status::Rejected, format!("{} rejected the UCX connection{}", self.peer_name(), suffix(&why)))
                }
                Next::Failed(e) => e,
            };
            return if n > 0 { Ok(n) } else { Err(end) };
        }
        Ok(n)
    }
}

fn suffix(why: &str) -> String {
    if why.is_empty() { String::new() } else { format!(": {why}") }
}

impl Link for UcxLink {
    fn lane(&self) -> LaneKind {
        LaneKind::Ucx
    }

    fn max_frame(&self) -> usize {
        self.engine.cfg.max_frame
    }

    /// Remote memory by key (`expose` / `read_remote_keyed`): rendezvous reads by get.
    fn caps(&self) -> LinkCaps {
        LinkCaps { remote_memory: true }
    }

    fn try_send(&mut self, parts: &[&[u8]]) -> Result<bool> {
        if self.closed {
            return Err(Error::new(Status::NotConnected, "UCX link was closed by this side"));
        }
        let len = parts.iter().fold(0usize, |a, p| a.saturating_add(p.len()));
        let max = self.engine.cfg.max_frame;
        if len > max {
            return Err(Error::invalid_param(format!("frame of {len} bytes exceeds the UCX link's max_frame {max}")));
        }
        self.reap();
        if let Some(e) = self.dead_reason() {
            return Err(e);
        }
        // Back-pressure: UCX would queue without bound; a full link says so instead.
        if !self.sends.is_empty()
            && (self.sends.len() >= MAX_SENDS || self.in_flight_bytes + len + HEADER_LEN > self.engine.cfg.max_in_flight)
        {
            return Ok(false);
        }
        let buf = self.framed(parts);
        self.post(Kind::Data, buf)?;
        Ok(true)
    }

    fn poll_recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize> {
        self.reap();
        let n = self.deliver(max, deliver)?;
        if n > 0 {
            return Ok(n);
        }
        // Also for `max == 0`: the caller may poll only to keep this worker's UCP moving.
        self.engine.progress();
        self.reap();
        let n = self.deliver(max, deliver)?;
        if n == 0
            && let Some(e) = &self.failure
        {
            return Err(e.clone());
        }
        Ok(n)
    }

    fn describe(&self) -> String {
        format!(
            "UCX: {} sends in flight ({} bytes), unflushed: {}, flushing: {}, failure: {:?}",
            self.sends.len(),
            self.in_flight_bytes,
            self.unflushed,
            self.flushing.is_some(),
            self.failure.as_ref().map(|e| e.to_string())
        )
    }

    /// Frames in UCX, or bytes of completed ones not yet out of this process (a flush not done).
    fn sending(&self) -> bool {
        self.failure.is_none() && (!self.sends.is_empty() || self.unflushed || self.flushing.is_some())
    }

    unsafe fn read_remote(&self, _local: *mut u8, _remote: u64, _len: usize) -> Result<()> {
        Err(Error::unsupported("a UCX remote read needs the peer's key (read_remote_keyed)"))
    }

    fn expose(&self, addr: usize, len: usize) -> Result<Option<Exposed>> {
        let reg = Engine::register(&self.engine, addr, len)?;
        Ok(Some(Exposed { key: reg.key.clone(), hold: Box::new(reg) }))
    }

    unsafe fn read_remote_keyed(&self, local: *mut u8, remote: u64, len: usize, key: &[u8]) -> Result<()> {
        let k = super::rkey::RemoteKey::decode(key)?;
        // UCX would serve any address of the peer for some transports: the key's range is the
        // bound the peer gave.
        if !k.covers(remote, len) {
            return Err(Error::new(
                Status::OutOfRange,
                format!("remote read {remote:#x}+{len} outside the range {:#x}+{} the peer opened", k.base, k.len),
            ));
        }
        if let Some(e) = self.dead_reason() {
            return Err(e);
        }
        let ep = self.ep.as_ref().expect("endpoint present until drop");
        let mut rkeys = self.rkeys.lock().unwrap_or_else(|e| e.into_inner());
        if !rkeys.contains_key(k.ucx) {
            if rkeys.len() >= MAX_RKEYS {
                for (_, r) in rkeys.drain() {
                    self.engine.rkey_destroy(r);
                }
            }
            let r = self.engine.rkey_unpack(ep, k.ucx).map_err(|e| e.context(self.peer_name()))?;
            rkeys.insert(k.ucx.to_vec(), r);
        }
        let rkey = &rkeys[k.ucx];
        // SAFETY: the caller's promise (`local` writable for `len` bytes) is what `get` needs.
        unsafe { self.engine.get(ep, rkey, local, remote, len, &self.key) }.map_err(|e| e.context(self.peer_name()))
    }

    unsafe fn write_remote(&self, _local: *const u8, _remote: u64, _len: usize) -> Result<()> {
        Err(Error::unsupported("UCX remote writes (put) are not built yet; prepared rounds and one-sided puts use frames"))
    }

    /// Progresses UCX, so a failure is noticed even while nothing is polled. A failure is only
    /// reported here once every frame received before it was delivered (by `poll_recv`).
    fn check_peer(&mut self) -> Result<()> {
        self.engine.progress();
        self.reap();
        if self.engine.with_inbox(|ib| ib.has_ready(&self.key)) {
            return Ok(()); // the next poll delivers what is there, then reports the end
        }
        match self.dead_reason() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if self.dead_reason().is_some() {
            return;
        }
        // Sequenced after every frame sent before it, so the peer delivers those first.
        let body = wire::encode_close(CloseReason::Closed, "");
        let buf = self.framed(&[&body]);
        if let Err(e) = self.post(Kind::Close, buf) {
            tracing::debug!(target: "gsc::ucx", error = %e, "close notice not sent");
        }
        tracing::debug!(target: "gsc::ucx", peer = %format_args!("{:032x}", self.peer), "UCX link closed");
    }
}

impl Drop for UcxLink {
    fn drop(&mut self) {
        // A link dropped without close() is gone all the same; the peer must hear of it (its
        // endpoint to us stays healthy while this process lives).
        self.close();
        self.reap();
        let force = self.dead_reason().is_some();
        self.engine.with_inbox(|ib| ib.remove(&self.key));
        // The endpoint's close flushes (or is forced) anyway: the flush request only goes back.
        if let Some(f) = self.flushing.take() {
            self.engine.flush_abandon(f);
        }
        // Keys unpacked on the endpoint go before it does.
        for (_, r) in self.rkeys.get_mut().unwrap_or_else(|e| e.into_inner()).drain() {
            self.engine.rkey_destroy(r);
        }
        if let Some(ep) = self.ep.take() {
            self.engine.retire(ep, std::mem::take(&mut self.sends), force);
        }
    }
}

//! Where received frames wait until their link polls: one channel per (link, receiving side),
//! restored to sending order, plus the failures UCX reported for endpoints.
//!
//! UCX calls our active-message handler for every message of every link of a worker, during
//! `ucp_worker_progress`, whichever link asked for progress. The handler files the message here
//! by the link name in its header; each link takes only its own. UCP does not promise that active
//! messages on one endpoint arrive in the order they were sent (multi-rail, adaptive routing), so
//! every frame carries a sequence number and a channel hands frames out strictly in order.
//!
//! Channels appear when their first frame arrives: an acceptor learns of a link from its hello
//! (sequence 0). Frames of links this side no longer knows (late frames after a drop, a peer that
//! never sent its hello) are kept for `ORPHAN_TTL` in case their hello is only late, then removed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::wire::{self, CloseReason, Header, Hello, Kind, LinkName, Side};
use crate::error::{Error, Result, Status};

/// A channel: the frames one side of one link receives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub link: LinkName,
    /// The side that receives these frames.
    pub to: Side,
}

/// How long frames of a link nobody claimed are kept.
pub(crate) const ORPHAN_TTL: Duration = Duration::from_secs(30);
/// Most frames a channel holds back while an earlier one is missing; more means the sender is
/// broken (or frames were lost), and the channel fails.
const MAX_EARLY: usize = 4096;

enum Item {
    Hello(Hello),
    Data(Vec<u8>),
    Close(CloseReason, String),
}

struct Channel {
    next_seq: u64,
    ready: VecDeque<Item>,
    early: BTreeMap<u64, Item>,
    /// Sticky: the endpoint failed or the peer broke the protocol. Reported after `ready`.
    failed: Option<Error>,
    /// Sticky: the peer's close was handed out.
    closed: Option<(CloseReason, String)>,
    /// A link owns this channel (the connector's from the start, the acceptor's once its hello
    /// was taken).
    linked: bool,
    first_seen: Instant,
}

impl Channel {
    fn new(now: Instant, linked: bool) -> Channel {
        Channel { next_seq: 0, ready: VecDeque::new(), early: BTreeMap::new(), failed: None, closed: None, linked, first_seen: now }
    }

    fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
    }
}

/// What a link's next poll of its channel finds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    Frame(Vec<u8>),
    /// The peer closed the link (every frame before the close was handed out).
    Closed(CloseReason, String),
    Failed(Error),
    Empty,
}

#[derive(Default)]
pub(crate) struct Inbox {
    channels: HashMap<Key, Channel>,
    /// Endpoint (its address) → the channel of the link that owns it.
    eps: HashMap<usize, Key>,
    /// Failures reported for endpoints not (yet) registered.
    unclaimed: HashMap<usize, Error>,
    /// Channels whose hello is ready to be taken by the listener.
    hellos: VecDeque<Key>,
}

fn violation(link: &LinkName, what: String) -> Error {
    Error::new(Status::PeerFailed, format!("UCX link {:032x}/{}: protocol violation: {what}", link.connector, link.number))
}

impl Inbox {
    /// File one received message (header already decoded; `body` copied out of UCX's buffer).
    pub(crate) fn arrive(&mut self, h: Header, body: Vec<u8>, now: Instant) {
        let key = Key { link: h.link, to: h.from.other() };
        let item = match h.kind {
            Kind::Data => Item::Data(body),
            Kind::Hello => match Hello::decode(&body) {
                Ok(hello) => Item::Hello(hello),
                Err(e) => {
                    tracing::warn!(target: "gsc::ucx", error = %e, "malformed hello dropped");
                    return;
                }
            },
            Kind::Close => match wire::decode_close(&body) {
                Ok((reason, why)) => Item::Close(reason, why),
                Err(e) => Item::Close(CloseReason::Closed, format!("(malformed close: {e})")),
            },
        };
        let ch = self.channels.entry(key).or_insert_with(|| Channel::new(now, false));
        if ch.failed.is_some() || ch.closed.is_some() {
            return; // nothing after the end is looked at
        }
        if h.seq < ch.next_seq || ch.early.contains_key(&h.seq) {
            ch.fail(violation(&h.link, format!("frame {} arrived twice", h.seq)));
            return;
        }
        if h.seq > ch.next_seq {
            if ch.early.len() >= MAX_EARLY {
                ch.fail(violation(&h.link, format!("{MAX_EARLY} frames arrived while frame {} is missing", ch.next_seq)));
            } else {
                ch.early.insert(h.seq, item);
            }
            return;
        }
        let mut item = item;
        loop {
            if matches!(item, Item::Hello(_)) && !ch.linked {
                self.hellos.push_back(key);
            }
            ch.ready.push_back(item);
            ch.next_seq += 1;
            match ch.early.remove(&ch.next_seq) {
                Some(next) => item = next,
                None => break,
            }
        }
    }

    /// Make the channel of a link this side connects: owned from the start.
    pub(crate) fn open(&mut self, key: Key, now: Instant) -> Result<()> {
        if self.channels.contains_key(&key) {
            return Err(Error::new(Status::AlreadyExists, format!("UCX link number {} is in use", key.link.number)));
        }
        self.channels.insert(key, Channel::new(now, true));
        Ok(())
    }

    /// The next hello waiting for the listener, its channel now owned by the link being made.
    pub(crate) fn take_hello(&mut self) -> Option<(Key, Hello)> {
        while let Some(key) = self.hellos.pop_front() {
            let Some(ch) = self.channels.get_mut(&key) else { continue };
            if ch.linked {
                continue;
            }
            if let Some(Item::Hello(_)) = ch.ready.front() {
                let Some(Item::Hello(hello)) = ch.ready.pop_front() else { unreachable!("front is a hello") };
                ch.linked = true;
                return Some((key, hello));
            }
        }
        None
    }

    /// What the link owning `key` receives next.
    pub(crate) fn next(&mut self, key: &Key) -> Next {
        let Some(ch) = self.channels.get_mut(key) else {
            return Next::Failed(Error::new(Status::NotConnected, "UCX link state is gone"));
        };
        if let Some((reason, why)) = &ch.closed {
            return Next::Closed(*reason, why.clone());
        }
        match ch.ready.pop_front() {
            Some(Item::Data(f)) => Next::Frame(f),
            Some(Item::Close(reason, why)) => {
                ch.closed = Some((reason, why.clone()));
                Next::Closed(reason, why)
            }
            Some(Item::Hello(_)) => {
                let e = violation(&key.link, "a second hello".into());
                ch.fail(e.clone());
                ch.ready.clear();
                Next::Failed(e)
            }
            None => ch.failed.clone().map_or(Next::Empty, Next::Failed),
        }
    }

    /// Does the channel hold frames (or a close) not yet handed out?
    pub(crate) fn has_ready(&self, key: &Key) -> bool {
        self.channels.get(key).is_some_and(|ch| !ch.ready.is_empty())
    }

    /// Why the channel ended, if it did: a recorded failure, or the peer's close once it was
    /// handed out (without consuming frames).
    pub(crate) fn failure(&self, key: &Key) -> Option<Error> {
        let ch = self.channels.get(key)?;
        ch.failed.clone().or_else(|| {
            ch.closed.as_ref().map(|(reason, _)| match reason {
                CloseReason::Closed => Error::new(Status::ConnectionReset, "the peer closed the UCX link"),
                CloseReason::Rejected => Error::new(Status::Rejected, "the peer rejected the UCX connection"),
            })
        })
    }

    pub(crate) fn fail(&mut self, key: &Key, e: Error) {
        if let Some(ch) = self.channels.get_mut(key) {
            ch.fail(e);
        }
    }

    /// Route failures of endpoint `ep` to the channel of `key`.
    pub(crate) fn register_ep(&mut self, ep: usize, key: Key) {
        if let Some(e) = self.unclaimed.remove(&ep) {
            self.fail(&key, e);
        }
        self.eps.insert(ep, key);
    }

    pub(crate) fn forget_ep(&mut self, ep: usize) {
        self.eps.remove(&ep);
        self.unclaimed.remove(&ep);
    }

    /// UCX reported endpoint `ep` as failed.
    pub(crate) fn ep_failed(&mut self, ep: usize, e: Error) {
        match self.eps.get(&ep).copied() {
            Some(key) => self.fail(&key, e),
            None => {
                self.unclaimed.insert(ep, e);
            }
        }
    }

    /// Forget a channel whose link is gone.
    pub(crate) fn remove(&mut self, key: &Key) {
        self.channels.remove(key);
    }

    /// Remove channels nobody claimed within `ttl`; returns how many.
    pub(crate) fn collect_orphans(&mut self, now: Instant, ttl: Duration) -> usize {
        let before = self.channels.len();
        let hellos = &self.hellos;
        self.channels.retain(|key, ch| ch.linked || hellos.contains(key) || now.duration_since(ch.first_seen) < ttl);
        before - self.channels.len()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.channels.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ucx::wire::encode_close;

    const LINK: LinkName = LinkName { connector: 0xabc, number: 1 };

    fn h(kind: Kind, from: Side, seq: u64) -> Header {
        Header { kind, from, link: LINK, seq }
    }

    fn hello() -> Vec<u8> {
        Hello { listener: 9, connector_address: vec![1, 2] }.encode()
    }

    const AT_ACCEPTOR: Key = Key { link: LINK, to: Side::Acceptor };
    const AT_CONNECTOR: Key = Key { link: LINK, to: Side::Connector };

    #[test]
    fn frames_come_out_in_sequence_order() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        ib.open(AT_CONNECTOR, now).unwrap();
        for seq in [2, 0, 3, 1] {
            ib.arrive(h(Kind::Data, Side::Acceptor, seq), vec![seq as u8], now);
        }
        for seq in 0..4u8 {
            assert_eq!(ib.next(&AT_CONNECTOR), Next::Frame(vec![seq]));
        }
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Empty);
        assert!(!ib.has_ready(&AT_CONNECTOR));
    }

    #[test]
    fn the_acceptor_takes_the_hello_then_the_frames() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        // A data frame overtakes the hello: nothing for the listener until the hello arrives.
        ib.arrive(h(Kind::Data, Side::Connector, 1), vec![7], now);
        assert!(ib.take_hello().is_none());
        ib.arrive(h(Kind::Hello, Side::Connector, 0), hello(), now);
        let (key, got) = ib.take_hello().expect("a hello");
        assert_eq!(key, AT_ACCEPTOR);
        assert_eq!(got.listener, 9);
        assert!(ib.take_hello().is_none(), "taken once");
        assert_eq!(ib.next(&AT_ACCEPTOR), Next::Frame(vec![7]));
    }

    #[test]
    fn both_directions_of_a_self_connection_stay_apart() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        ib.open(AT_CONNECTOR, now).unwrap();
        ib.arrive(h(Kind::Hello, Side::Connector, 0), hello(), now);
        ib.arrive(h(Kind::Data, Side::Connector, 1), b"to acceptor".to_vec(), now);
        ib.arrive(h(Kind::Data, Side::Acceptor, 0), b"to connector".to_vec(), now);
        assert_eq!(ib.take_hello().unwrap().0, AT_ACCEPTOR);
        assert_eq!(ib.next(&AT_ACCEPTOR), Next::Frame(b"to acceptor".to_vec()));
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Frame(b"to connector".to_vec()));
        assert!(ib.open(AT_CONNECTOR, now).is_err(), "a number in use is refused");
    }

    #[test]
    fn close_and_failure_come_after_the_frames_before_them() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        ib.open(AT_CONNECTOR, now).unwrap();
        ib.arrive(h(Kind::Data, Side::Acceptor, 0), vec![1], now);
        ib.arrive(h(Kind::Close, Side::Acceptor, 1), encode_close(CloseReason::Closed, "bye"), now);
        ib.arrive(h(Kind::Data, Side::Acceptor, 2), vec![2], now);
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Frame(vec![1]));
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Closed(CloseReason::Closed, "bye".into()));
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Closed(CloseReason::Closed, "bye".into()), "sticky");
        assert_eq!(ib.failure(&AT_CONNECTOR).unwrap().status(), Status::ConnectionReset);

        let other = Key { link: LinkName { connector: 1, number: 2 }, to: Side::Connector };
        ib.open(other, now).unwrap();
        ib.arrive(Header { kind: Kind::Data, from: Side::Acceptor, link: other.link, seq: 0 }, vec![3], now);
        ib.ep_failed(0x1000, Error::new(Status::PeerFailed, "reset"));
        ib.register_ep(0x1000, other);
        assert!(ib.has_ready(&other));
        assert!(ib.failure(&other).is_some());
        assert_eq!(ib.next(&other), Next::Frame(vec![3]));
        assert!(matches!(ib.next(&other), Next::Failed(e) if e.status() == Status::PeerFailed));
        assert!(ib.failure(&other).is_some());
    }

    #[test]
    fn protocol_violations_fail_the_channel() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        ib.open(AT_CONNECTOR, now).unwrap();
        ib.arrive(h(Kind::Data, Side::Acceptor, 0), vec![1], now);
        ib.arrive(h(Kind::Data, Side::Acceptor, 0), vec![1], now);
        assert_eq!(ib.next(&AT_CONNECTOR), Next::Frame(vec![1]));
        assert!(matches!(ib.next(&AT_CONNECTOR), Next::Failed(e) if e.message().contains("twice")));

        let mut ib = Inbox::default();
        ib.open(AT_CONNECTOR, now).unwrap();
        for seq in 1..=MAX_EARLY as u64 + 1 {
            ib.arrive(h(Kind::Data, Side::Acceptor, seq), vec![], now);
        }
        assert!(matches!(ib.next(&AT_CONNECTOR), Next::Failed(e) if e.message().contains("missing")));
    }

    #[test]
    fn unclaimed_channels_expire() {
        let mut ib = Inbox::default();
        let now = Instant::now();
        ib.open(AT_CONNECTOR, now).unwrap();
        // A late frame of a link the acceptor already dropped.
        ib.arrive(h(Kind::Data, Side::Connector, 5), vec![], now);
        assert_eq!(ib.len(), 2);
        assert_eq!(ib.collect_orphans(now + ORPHAN_TTL / 2, ORPHAN_TTL), 0);
        assert_eq!(ib.collect_orphans(now + ORPHAN_TTL, ORPHAN_TTL), 1);
        assert_eq!(ib.len(), 1, "the owned channel stays");
        ib.remove(&AT_CONNECTOR);
        assert!(matches!(ib.next(&AT_CONNECTOR), Next::Failed(_)));
    }
}

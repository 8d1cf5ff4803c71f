//! MPI-grade tag matching: posted receives and unexpected messages.
//!
//! A message matches a receive when `(msg_tag & mask) == (recv_tag & mask)`. Among several
//! candidates the *oldest* wins on both sides, which gives MPI's non-overtaking rule: two messages
//! from one link that both match a receive are taken in the order they arrived, and two receives
//! that both match a message are satisfied in the order they were posted.
//!
//! Exact receives (mask = all ones, the common MPI case) are kept in a hash bucket per tag;
//! wildcard receives in one list in post order. Both carry a global sequence number so the oldest
//! candidate across the two wins. Posting and matching an exact receive is one hash lookup and a
//! deque push/pop (ordered maps here cost a visible share of the small-message path).

use super::idmap::IdMap;
use std::collections::{BTreeMap, VecDeque};

pub const FULL_MASK: u64 = u64::MAX;

/// Empty exact-tag buckets kept allocated (for the next receive with that tag) before they are
/// swept.
const MAX_IDLE_BUCKETS: usize = 256;

#[inline]
pub fn tag_matches(msg_tag: u64, recv_tag: u64, mask: u64) -> bool {
    (msg_tag & mask) == (recv_tag & mask)
}

/// A wildcard receive: sequence number, tag, mask, receive.
type Wild<R> = (u64, u64, u64, R);

/// Receives waiting for a message, in post order.
pub struct PostedQueue<R> {
    /// Exact receives by tag, each bucket in post order: (sequence number, receive).
    exact: IdMap<u64, VecDeque<(u64, R)>>,
    /// Buckets in `exact` that are empty.
    idle_buckets: usize,
    /// Wildcard receives in post order.
    wild: VecDeque<Wild<R>>,
    len: usize,
    next_seq: u64,
}

impl<R: Copy + PartialEq> Default for PostedQueue<R> {
    fn default() -> Self {
        PostedQueue { exact: IdMap::default(), idle_buckets: 0, wild: VecDeque::new(), len: 0, next_seq: 0 }
    }
}

impl<R: Copy + PartialEq> PostedQueue<R> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn post(&mut self, tag: u64, mask: u64, r: R) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.len += 1;
        if mask == FULL_MASK {
            let bucket = self.exact.entry(tag).or_default();
            // An emptied bucket keeps its allocation; a new one has none.
            if bucket.is_empty() && bucket.capacity() > 0 {
                self.idle_buckets = self.idle_buckets.saturating_sub(1);
            }
            bucket.push_back((seq, r));
        } else {
            self.wild.push_back((seq, tag, mask, r));
        }
    }

    /// Remove and return the oldest receive that matches `msg_tag`.
    pub fn take_match(&mut self, msg_tag: u64) -> Option<R> {
        let exact_seq = self.exact.get(&msg_tag).and_then(|b| b.front()).map(|&(seq, _)| seq);
        // Only wildcards older than the exact candidate can win, so stop the scan there.
        let limit = exact_seq.unwrap_or(u64::MAX);
        let wild = self.wild.iter().take_while(|w| w.0 < limit).position(|&(_, tag, mask, _)| tag_matches(msg_tag, tag, mask));
        let r = match wild {
            Some(i) => self.wild.remove(i).map(|w| w.3),
            None => {
                let bucket = self.exact.get_mut(&msg_tag)?;
                let r = bucket.pop_front().map(|(_, r)| r);
                if bucket.is_empty() {
                    self.bucket_emptied();
                }
                r
            }
        };
        self.len -= r.is_some() as usize;
        r
    }

    /// An exact bucket became empty. It is kept for the next receive with its tag (the common
    /// case is a few tags used over and over); only when many are idle are they dropped.
    fn bucket_emptied(&mut self) {
        self.idle_buckets += 1;
        if self.idle_buckets > MAX_IDLE_BUCKETS {
            self.exact.retain(|_, b| !b.is_empty());
            self.idle_buckets = 0;
        }
    }

    /// The tag of the receive `which` picks, if it is posted (wildcards: their tag as posted).
    pub fn tag_of(&self, which: impl Fn(&R) -> bool) -> Option<u64> {
        if let Some(w) = self.wild.iter().find(|w| which(&w.3)) {
            return Some(w.1);
        }
        self.exact.iter().find(|(_, b)| b.iter().any(|e| which(&e.1))).map(|(tag, _)| *tag)
    }

    /// Remove the receive `which` picks (cancel, by its unique request id) and return it.
    pub fn remove(&mut self, which: impl Fn(&R) -> bool) -> Option<R> {
        if let Some(i) = self.wild.iter().position(|w| which(&w.3)) {
            self.len -= 1;
            return self.wild.remove(i).map(|w| w.3);
        }
        let found = self.exact.values_mut().find_map(|b| b.iter().position(|e| which(&e.1)).map(|i| (b, i)));
        let (bucket, i) = found?;
        let r = bucket.remove(i).map(|e| e.1);
        let emptied = bucket.is_empty();
        self.len -= 1;
        if emptied {
            self.bucket_emptied();
        }
        r
    }
}

/// Messages that arrived before a matching receive, in arrival order.
///
/// The ordered map is the source of truth (wildcard receives scan it in arrival order); the
/// per-tag buckets hold sequence numbers and are cleaned lazily: stale ones are skipped when met.
pub struct UnexpectedQueue<M> {
    entries: BTreeMap<u64, (u64, M)>,
    by_tag: IdMap<u64, VecDeque<u64>>,
    next_seq: u64,
}

impl<M> Default for UnexpectedQueue<M> {
    fn default() -> Self {
        UnexpectedQueue { entries: BTreeMap::new(), by_tag: IdMap::default(), next_seq: 0 }
    }
}

impl<M> UnexpectedQueue<M> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Append a message; returns its handle (a sequence number, never reused).
    pub fn push(&mut self, tag: u64, m: M) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries.insert(seq, (tag, m));
        self.by_tag.entry(tag).or_default().push_back(seq);
        seq
    }

    /// The oldest message matching `(tag, mask)`.
    pub fn find(&mut self, tag: u64, mask: u64) -> Option<u64> {
        if mask == FULL_MASK {
            let bucket = self.by_tag.get_mut(&tag)?;
            while bucket.front().is_some_and(|s| !self.entries.contains_key(s)) {
                bucket.pop_front();
            }
            let front = bucket.front().copied();
            if bucket.is_empty() {
                self.by_tag.remove(&tag);
            }
            front
        } else {
            self.entries.iter().find(|(_, (t, _))| tag_matches(*t, tag, mask)).map(|(s, _)| *s)
        }
    }

    pub fn get(&self, seq: u64) -> Option<&(u64, M)> {
        self.entries.get(&seq)
    }

    pub fn get_mut(&mut self, seq: u64) -> Option<&mut (u64, M)> {
        self.entries.get_mut(&seq)
    }

    pub fn take(&mut self, seq: u64) -> Option<(u64, M)> {
        self.entries.remove(&seq)
    }

    /// Remove every message for which `drop_it` says so (e.g. those from a failed peer).
    pub fn retain(&mut self, mut keep: impl FnMut(&M) -> bool) {
        self.entries.retain(|_, (_, m)| keep(m));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_receives_match_in_post_order() {
        let mut q = PostedQueue::default();
        q.post(5, FULL_MASK, 1);
        q.post(5, FULL_MASK, 2);
        q.post(6, FULL_MASK, 3);
        assert_eq!(q.take_match(5), Some(1));
        assert_eq!(q.take_match(6), Some(3));
        assert_eq!(q.take_match(5), Some(2));
        assert_eq!(q.take_match(5), None);
        assert!(q.is_empty());
    }

    #[test]
    fn oldest_of_wildcard_and_exact_wins() {
        let mut q = PostedQueue::default();
        q.post(0, 0, 10); // matches anything
        q.post(7, FULL_MASK, 11);
        q.post(0x70, 0xF0, 12); // matches 0x7?
        assert_eq!(q.take_match(7), Some(10), "the wildcard was posted first");
        assert_eq!(q.take_match(0x71), Some(12), "exact bucket for 0x71 is empty");
        assert_eq!(q.take_match(7), Some(11));
        assert_eq!(q.take_match(0x72), None);
    }

    #[test]
    fn masked_bits_are_ignored_and_others_compared() {
        assert!(tag_matches(0xAB_CD, 0xAB_00, 0xFF_00));
        assert!(!tag_matches(0xAC_CD, 0xAB_00, 0xFF_00));
        assert!(tag_matches(u64::MAX, 0, 0));
    }

    #[test]
    fn cancel_removes_only_that_receive() {
        let mut q = PostedQueue::default();
        q.post(1, FULL_MASK, 1);
        q.post(1, FULL_MASK, 2);
        q.post(2, 0, 3);
        assert_eq!(q.remove(|&r| r == 1), Some(1));
        assert_eq!(q.remove(|&r| r == 1), None);
        assert_eq!(q.remove(|&r| r == 3), Some(3));
        assert_eq!(q.take_match(1), Some(2));
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn many_tags_keep_matching_after_idle_buckets_are_swept() {
        let mut q = PostedQueue::default();
        for round in 0..3u64 {
            for t in 0..(3 * MAX_IDLE_BUCKETS as u64) {
                q.post(t, FULL_MASK, round * 10_000 + t);
            }
            q.post(1 << 40, FULL_MASK, 7); // stays posted across the sweeps
            for t in 0..(3 * MAX_IDLE_BUCKETS as u64) {
                assert_eq!(q.take_match(t), Some(round * 10_000 + t));
            }
            assert!(q.exact.len() <= MAX_IDLE_BUCKETS + 2, "idle buckets were swept ({})", q.exact.len());
            assert_eq!(q.remove(|&r| r == 7), Some(7));
            assert_eq!(q.len(), 0);
        }
    }

    #[test]
    fn unexpected_messages_are_found_oldest_first() {
        let mut u = UnexpectedQueue::default();
        let a = u.push(3, "a");
        let b = u.push(4, "b");
        let c = u.push(3, "c");
        assert_eq!(u.find(3, FULL_MASK), Some(a));
        assert_eq!(u.find(0, 0), Some(a));
        assert_eq!(u.take(a).unwrap().1, "a");
        assert_eq!(u.find(3, FULL_MASK), Some(c));
        assert_eq!(u.find(0, 0), Some(b));
        assert_eq!(u.find(4, 0xF), Some(b));
        u.retain(|m| *m != "b");
        assert_eq!(u.find(4, FULL_MASK), None);
        assert_eq!(u.len(), 1);
    }

    #[test]
    fn ten_thousand_posted_receives_stay_ordered() {
        let mut q = PostedQueue::default();
        for i in 0..10_000u64 {
            q.post(i % 10, if i % 3 == 0 { 0 } else { FULL_MASK }, i);
        }
        let mut last_per_tag = [None::<u64>; 10];
        while let Some(r) = (0..10).find_map(|t| q.take_match(t).map(|r| (t, r))) {
            let (t, r) = r;
            if let Some(prev) = last_per_tag[t as usize] {
                assert!(r > prev, "tag {t}: {r} after {prev}");
            }
            last_per_tag[t as usize] = Some(r);
        }
        assert!(q.is_empty());
    }
}

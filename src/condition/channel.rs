//! A channel: one trigger word, one completion word, and the bookkeeping between them.
//!
//! The producer (a CUDA stream, a kernel, a host stream) writes the *trigger word*; the proxy
//! reads it. The proxy writes the *done word*; the producer's later work waits on it. Both words
//! are 64-bit and only ever grow, so a CUDA graph can replay the same write/wait nodes forever:
//!
//! - A sequenced channel (stream, host stream) numbers its operations 1, 2, 3, ... in issue
//!   order. Operation `k` starts once `trigger >= k`; the stream after it waits for `done >= k`.
//! - A persistent channel (a graph node pair, a kernel trigger) performs its operation once per
//!   *epoch*: the device bumps its own epoch counter and writes it to the trigger word, the proxy
//!   starts one operation per new epoch and writes the epoch to the done word when it completes.
//!
//! `done` is the longest prefix of completed operations (an operation issued without a stream
//! wait may complete before an earlier one). A failure sets [`DONE_ERROR_BIT`]: every `>=` wait
//! is then satisfied, so nothing on the GPU hangs behind a failed peer, and the error stays
//! readable (sticky) through [`Channel::error`].

use super::stage::Stage;
use super::words::Words;
use crate::error::{Error, Status};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Set in the done word when an operation of the channel failed; it releases every waiter.
pub const DONE_ERROR_BIT: u64 = 1 << 63;

pub(crate) struct Channel {
    pub(crate) words: Words,
    /// A persistent channel's staged operation (see `stage`): every epoch uses the same slot.
    pub(crate) stage: Option<Arc<Stage>>,
    /// A persistent channel's operation needs a system fence before its trigger
    /// (`Condition::issue`'s `orders`).
    pub(crate) orders: bool,
    tracker: Mutex<Tracker>,
    /// Host-side waiters (host streams, `wait_done`) sleep here; CUDA waiters poll the word.
    advanced: Condvar,
    /// Issue order: taken while an operation is numbered *and* enqueued on its stream, so the
    /// numbers match the stream order even when several threads issue on one condition.
    pub(crate) issue: Mutex<u64>,
    /// Where counting starts: reused words keep their old values (a late wait on one of them
    /// must still pass), so a channel continues from them instead of resetting them.
    pub(crate) base: u64,
}

#[derive(Default)]
struct Tracker {
    /// Every operation up to this one completed.
    done: u64,
    /// Completed operations beyond `done` (out of order).
    ahead: BTreeSet<u64>,
    /// The first failure, kept for the condition's lifetime.
    error: Option<Error>,
}

impl Channel {
    pub(crate) fn new(words: Words) -> Arc<Channel> {
        Arc::new(Channel::continuing(words))
    }

    /// A channel for one persistent operation, its device handle pointing at its words with the
    /// epoch where counting starts; the handle is in GPU memory of `gpu_ctx` when given.
    pub(crate) fn persistent(
        words: Words,
        gpu_ctx: Option<usize>,
        stage: Option<Arc<Stage>>,
        orders: bool,
    ) -> crate::error::Result<Arc<Channel>> {
        let mut c = Channel::continuing(words);
        c.words.init_device_handle(c.base, gpu_ctx)?;
        c.stage = stage;
        c.orders = orders;
        Ok(Arc::new(c))
    }

    fn continuing(words: Words) -> Channel {
        let trigger = words.trigger().load(Ordering::Acquire);
        let done = words.done().load(Ordering::Acquire) & !DONE_ERROR_BIT;
        let base = trigger.max(done);
        words.trigger().store(base, Ordering::Release);
        words.done().store(base, Ordering::Release);
        let tracker = Tracker { done: base, ..Default::default() };
        Channel { words, stage: None, orders: false, tracker: Mutex::new(tracker), advanced: Condvar::new(), issue: Mutex::new(base), base }
    }

    /// The value the producer last wrote.
    pub(crate) fn trigger(&self) -> u64 {
        self.words.trigger().load(Ordering::Acquire)
    }

    /// The completion word as the producer sees it (error bit included).
    pub(crate) fn done_word(&self) -> u64 {
        self.words.done().load(Ordering::Acquire)
    }

    /// How many operations completed, in order, whatever their status (the done word without
    /// its error bit). The proxy watches its started operations by this: after one failure the
    /// done word satisfies every wait, but the operations after it may still be running and
    /// still need their `GSC_TIMEOUT`.
    pub(crate) fn completed_through(&self) -> u64 {
        self.done_word() & !DONE_ERROR_BIT
    }

    /// The first failure of an operation on this channel, if any.
    pub(crate) fn error(&self) -> Option<Error> {
        self.lock().error.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Operation `seq` finished with `status`: advance the done word over every completed prefix.
    pub(crate) fn complete(&self, seq: u64, status: Status) {
        let mut t = self.lock();
        if status != Status::Ok && t.error.is_none() {
            t.error = Some(Error::new(status, format!("operation {seq} of a condition failed")));
        }
        if seq <= t.done {
            return;
        }
        if seq == t.done + 1 {
            t.done = seq;
            loop {
                let next = t.done + 1;
                if !t.ahead.remove(&next) {
                    break;
                }
                t.done = next;
            }
        } else {
            t.ahead.insert(seq);
        }
        let word = t.done | if t.error.is_some() { DONE_ERROR_BIT } else { 0 };
        // Release: the data the operation delivered is visible to whoever sees the new value.
        self.words.done().store(word, Ordering::Release);
        drop(t);
        self.advanced.notify_all();
    }

    /// Mark the channel failed without an operation (its owner is going away): releases waiters.
    pub(crate) fn fail(&self, error: Error) {
        let mut t = self.lock();
        if t.error.is_none() {
            t.error = Some(error);
        }
        self.words.done().store(t.done | DONE_ERROR_BIT, Ordering::Release);
        drop(t);
        self.advanced.notify_all();
    }

    /// For a channel whose done word the device advances itself (a kernel-triggered
    /// collective's graph ends with a kernel that does, `collectives::triggered`): take the
    /// word into the tracker — how far it got, and a failure the device marked there as the
    /// sticky error, so that `Condition::query` reports it as for any other operation and a
    /// later `fail` keeps the count. `what` names the operation.
    pub(crate) fn adopt_device_done(&self, what: &str) {
        let word = self.done_word();
        let mut t = self.lock();
        t.done = t.done.max(word & !DONE_ERROR_BIT);
        if word & DONE_ERROR_BIT != 0 && t.error.is_none() {
            t.error = Some(Error::new(
                Status::TimedOut,
                format!("{what} failed by trigger {} (a peer did not answer within GSC_TIMEOUT, or the communicator was aborted)", t.done),
            ));
        }
    }

    /// Block the calling host thread until `done >= seq` (or the error bit is set). Returns
    /// false when `deadline` passed first.
    pub(crate) fn wait_done(&self, seq: u64, deadline: Option<Instant>) -> bool {
        let reached = |c: &Channel| c.done_word() >= seq;
        // A short spin first: host-stream round trips are microseconds when the proxy is busy.
        for _ in 0..2000 {
            if reached(self) {
                return true;
            }
            std::hint::spin_loop();
        }
        let mut t = self.lock();
        loop {
            if reached(self) {
                return true;
            }
            let slice = std::time::Duration::from_millis(10);
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    (d - now).min(slice)
                }
                None => slice,
            };
            t = self.advanced.wait_timeout(t, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        if self.tracker.get_mut().unwrap_or_else(|e| e.into_inner()).error.is_some() {
            self.words.poison();
        }
    }
}

/// Completes one operation of a channel. Dropped without `fire` (its request vanished with its
/// worker), it reports the operation canceled, so no stream waits on it forever.
pub(crate) struct Signal {
    channel: Arc<Channel>,
    seq: u64,
    /// A staged operation of a sequenced channel (persistent ones keep theirs in the channel).
    stage: Option<Arc<Stage>>,
    fired: bool,
}

impl Signal {
    pub(crate) fn new(channel: Arc<Channel>, seq: u64) -> Signal {
        Signal { channel, seq, stage: None, fired: false }
    }

    pub(crate) fn with_stage(mut self, stage: Option<Arc<Stage>>) -> Signal {
        self.stage = stage;
        self
    }

    /// The operation ended with `status`, having received `len` bytes (receives).
    pub(crate) fn fire(mut self, status: Status, len: usize) {
        self.fired = true;
        if status == Status::Ok {
            // The staged receive's length goes before the done word that lets the kernel read it.
            if let Some(stage) = self.stage.as_ref().or(self.channel.stage.as_ref()) {
                stage.received(len);
            }
        }
        self.channel.complete(self.seq, status);
    }
}

impl Drop for Signal {
    fn drop(&mut self) {
        if !self.fired {
            self.channel.complete(self.seq, Status::Canceled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel() -> Arc<Channel> {
        Channel::new(Words::host())
    }

    #[test]
    fn done_is_the_completed_prefix() {
        let c = channel();
        c.complete(2, Status::Ok);
        assert_eq!(c.done_word(), 0, "2 done but 1 not: nothing may pass yet");
        c.complete(3, Status::Ok);
        c.complete(1, Status::Ok);
        assert_eq!(c.done_word(), 3);
        c.complete(1, Status::Ok);
        assert_eq!(c.done_word(), 3, "a repeated completion changes nothing");
        assert!(c.error().is_none());
    }

    #[test]
    fn a_failure_releases_every_waiter_and_sticks() {
        let c = channel();
        c.complete(1, Status::PeerFailed);
        let w = c.done_word();
        assert_ne!(w & DONE_ERROR_BIT, 0);
        assert!(w >= 1_000_000, "the error bit satisfies any >= wait");
        c.complete(2, Status::Ok);
        assert_ne!(c.done_word() & DONE_ERROR_BIT, 0, "error stays set");
        assert_eq!(c.error().unwrap().status(), Status::PeerFailed);
    }

    #[test]
    fn after_a_failure_the_operations_still_running_stay_visible() {
        let c = channel();
        c.complete(1, Status::TimedOut);
        assert!(c.done_word() >= 2, "waiters are released");
        assert_eq!(c.completed_through(), 1, "but operation 2 has not completed");
        c.complete(2, Status::Ok);
        assert_eq!(c.completed_through(), 2);
    }

    #[test]
    fn a_dropped_signal_completes_as_canceled() {
        let c = channel();
        drop(Signal::new(c.clone(), 1));
        assert_eq!(c.error().unwrap().status(), Status::Canceled);
        assert!(c.wait_done(1, None));
    }

    #[test]
    fn wait_done_wakes_on_completion_and_times_out_otherwise() {
        let c = channel();
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.wait_done(1, Some(Instant::now() + std::time::Duration::from_secs(10))));
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.complete(1, Status::Ok);
        assert!(t.join().unwrap());
        assert!(!c.wait_done(2, Some(Instant::now() + std::time::Duration::from_millis(30))));
    }
}

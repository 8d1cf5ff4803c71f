//! How many stream-ordered operations this process's proxies hold (being issued, handed over,
//! or started and not yet complete): while there are any, a GPU stream may be waiting for a
//! proxy thread.
//!
//! Why it matters: a proxy moving GPU memory calls the driver (`cuMemcpyAsync`, `cuEventQuery`,
//! core/device_mem.rs), and every driver call takes the driver's internal lock. Some calls hold
//! that lock while they wait for work already on the device: on the device,
//! `cuGraphInstantiate` on the application thread waited for a stream that was waiting for
//! the proxy, and the proxy waited in `cuMemcpyAsync` for the instantiation's lock, until
//! `GSC_TIMEOUT` failed the exchange (issue #7, session 20: the "heartbeat stopped" stall of
//! `fake_hosts_two_by_two`). gscomm's own issue path makes such a call only through `quiet`
//! (`cuda::replay` instantiates a graph only then).
//!
//! Counting: a thread issuing an operation holds an `Issuing` from before it puts the trigger
//! and wait on the stream until the operation is handed to the proxy, which counts it and, for
//! that whole time, holds the issue gate shared so that `quiet` cannot pass in between. The
//! message then carries the count: the engine adopts it when it takes the message and publishes
//! what it holds (armed, in flight, persistent) after each pass. Persistent operations (graph
//! nodes, kernel triggers) count for as long as they exist: their next trigger may come at any
//! moment. A count that is too high only costs speed (no instantiation); it is never too low
//! while a stream may be waiting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);
/// Shared by threads issuing operations, exclusive for `quiet`'s holder.
static GATE: RwLock<()> = RwLock::new(());

/// Whether any proxy of this process holds a stream-ordered operation (or one is being issued
/// or handed over).
pub(crate) fn any() -> bool {
    OUTSTANDING.load(Ordering::Acquire) > 0
}

/// Exclusive use of the driver for a call that may wait for the device: `Some` while nothing is
/// outstanding, and until the guard is dropped nothing can start being issued. `None` when
/// something is outstanding or being issued (then make no such call).
pub(crate) fn quiet() -> Option<RwLockWriteGuard<'static, ()>> {
    let gate = GATE.try_write().ok()?;
    (!any()).then_some(gate)
}

/// One operation being issued: counted, and the gate held shared, until it is handed to the
/// proxy (`handed`: the message carries the count from then on) or dropped (it never was).
pub(crate) struct Issuing {
    _gate: RwLockReadGuard<'static, ()>,
    handed: bool,
}

/// Start issuing one operation: before anything of it reaches the stream.
pub(crate) fn issuing() -> Issuing {
    let gate = GATE.read().unwrap_or_else(|e| e.into_inner());
    OUTSTANDING.fetch_add(1, Ordering::AcqRel);
    Issuing { _gate: gate, handed: false }
}

impl Issuing {
    /// The operation's message reached its proxy, which counts it from now on.
    pub(crate) fn handed(mut self) {
        self.handed = true;
    }
}

impl Drop for Issuing {
    fn drop(&mut self) {
        if !self.handed {
            OUTSTANDING.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One engine's part of the count.
pub(crate) struct Share {
    counter: &'static AtomicUsize,
    published: usize,
}

impl Default for Share {
    fn default() -> Share {
        Share { counter: &OUTSTANDING, published: 0 }
    }
}

impl Share {
    /// The engine took a message counted by `issuing`: from now on it is this engine's to
    /// publish.
    pub(crate) fn adopt(&mut self) {
        self.published += 1;
    }

    /// The engine now holds `now` operations.
    pub(crate) fn publish(&mut self, now: usize) {
        if now > self.published {
            self.counter.fetch_add(now - self.published, Ordering::AcqRel);
        } else if now < self.published {
            self.counter.fetch_sub(self.published - now, Ordering::AcqRel);
        }
        self.published = now;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.publish(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_waits_for_the_device_while_an_operation_is_being_issued() {
        // Other tests' proxies move the process-wide count; the gate is what this checks.
        let one = issuing();
        assert!(any());
        assert!(quiet().is_none(), "an issue in progress holds the gate");
        drop(one);
        let two = issuing();
        two.handed(); // the message now carries the count; let it go again
        OUTSTANDING.fetch_sub(1, Ordering::AcqRel);
    }

    #[test]
    fn a_share_moves_the_count_by_what_it_publishes() {
        // A counter of its own: the process-wide one moves with other tests' proxies.
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let read = || COUNT.load(Ordering::Acquire);
        COUNT.fetch_add(2, Ordering::AcqRel); // two messages sent
        let mut share = Share { counter: &COUNT, published: 0 };
        share.adopt();
        share.adopt();
        assert_eq!(read(), 2, "adopting moves nothing");
        share.publish(5);
        assert_eq!(read(), 5);
        share.publish(1);
        assert_eq!(read(), 1);
        drop(share);
        assert_eq!(read(), 0, "a dropped engine holds nothing");
    }
}

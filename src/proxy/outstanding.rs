//! How many stream-ordered operations this process's proxies hold (handed over and not yet
//! complete): while there are any, a GPU stream may be waiting for a proxy thread.
//!
//! Why it matters: a proxy staging GPU memory calls the driver (`cuMemcpyAsync`,
//! `cuEventQuery`, core/device_mem.rs), and every driver call takes the driver's internal lock.
//! Some calls hold that lock while they wait for work already on the device: on the device,
//! `cuGraphInstantiate` on the application thread waited for a stream that was waiting for
//! the proxy, and the proxy waited in `cuMemcpyAsync` for the instantiation's lock, until
//! `GSC_TIMEOUT` failed the exchange (issue #7, session 20: the "heartbeat stopped" stall of
//! `fake_hosts_two_by_two`). gscomm's own issue path asks `any()` before such a call
//! (`cuda::replay` instantiates a graph only while no operation is outstanding).
//!
//! Counting: `Proxy::send` counts a message as it leaves; the engine adopts it when it takes
//! it and publishes what it holds (armed, in flight, persistent) after each pass, so a
//! message is counted without a gap from its sending to its completion.

use std::sync::atomic::{AtomicUsize, Ordering};

static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);

/// Whether any proxy of this process holds a stream-ordered operation (or one is on its way).
pub(crate) fn any() -> bool {
    OUTSTANDING.load(Ordering::Acquire) > 0
}

/// An operation handed to a proxy (`Proxy::send`).
pub(crate) fn sent() {
    OUTSTANDING.fetch_add(1, Ordering::AcqRel);
}

/// An operation whose handing over failed: it never reached a proxy.
pub(crate) fn unsent() {
    OUTSTANDING.fetch_sub(1, Ordering::AcqRel);
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
    /// The engine took a message counted by `sent`: from now on it is this engine's to publish.
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

//! Frame buffers, reused.
//!
//! Every frame the lane sends is copied into one buffer (header then body) that UCX reads until
//! the send completes, and every frame it receives lands in one buffer until its link takes it.
//! At 256 KiB and more per frame, a fresh `Vec` each time was a measurable part of a transfer:
//! the allocator hands such sizes back to the kernel when they are freed (`brk` shrinks, or an
//! `mmap` is unmapped), so every frame paid page faults and page clearing on first touch
//! (perf on the dev VM, 4 MiB tag-bw over UCX TCP: ~10% of the samples in `exc_page_fault`,
//! `clear_page_erms` and `brk`). The pool keeps a bounded number of buffers for reuse.
//!
//! A buffer keeps its length when it is returned: `take_len` then only has to zero what lies
//! beyond it, and a sender's `take_empty` clears the length without touching the bytes.

use std::sync::Mutex;

pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Most buffers kept.
    max_count: usize,
    /// Buffers with more capacity than this are not kept (a rare huge frame must not stay
    /// resident for the worker's lifetime).
    max_capacity: usize,
}

impl BufPool {
    pub(crate) fn new(max_count: usize, max_capacity: usize) -> BufPool {
        BufPool { free: Mutex::new(Vec::new()), max_count, max_capacity }
    }

    fn pop(&self) -> Option<Vec<u8>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// An empty buffer with room for at least `capacity` bytes.
    pub(crate) fn take_empty(&self, capacity: usize) -> Vec<u8> {
        match self.pop() {
            Some(mut v) => {
                v.clear();
                v.reserve(capacity);
                v
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// A buffer of exactly `len` bytes (contents unspecified: the caller overwrites them all).
    pub(crate) fn take_len(&self, len: usize) -> Vec<u8> {
        let mut v = self.pop().unwrap_or_default();
        // Zeroes only what lies beyond the length the buffer had.
        v.resize(len, 0);
        v
    }

    /// Give a buffer back (dropped if the pool is full or the buffer is too large).
    pub(crate) fn give(&self, v: Vec<u8>) {
        if v.capacity() == 0 || v.capacity() > self.max_capacity {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.max_count {
            free.push(v);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.free.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::BufPool;

    #[test]
    fn buffers_are_reused_up_to_the_bounds() {
        let pool = BufPool::new(2, 1 << 20);
        let a = pool.take_len(1000);
        assert_eq!(a.len(), 1000);
        let p = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.len(), 1);
        // The same allocation comes back, cleared or resized as asked.
        let b = pool.take_empty(500);
        assert_eq!((b.as_ptr(), b.len()), (p, 0));
        pool.give(b);
        let c = pool.take_len(2000);
        assert_eq!(c.len(), 2000);
        assert!(c[1000..].iter().all(|&x| x == 0), "growth is zeroed");
        // Bounds: a too-large buffer and a third buffer are dropped.
        pool.give(vec![0u8; 2 << 20]);
        assert_eq!(pool.len(), 0);
        pool.give(c);
        pool.give(vec![1u8; 10]);
        pool.give(vec![2u8; 10]);
        assert_eq!(pool.len(), 2);
        pool.give(Vec::new());
        assert_eq!(pool.len(), 2);
    }
}

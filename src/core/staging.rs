//! Pipelined host staging of GPU data for links that cannot reach GPU memory (the UCX lane,
//! whose UCX build may not be CUDA-aware, and shm/loopback with `GSC_CUDA_IPC=off`): the
//! bookkeeping, with no CUDA in it, so that it is tested on any machine.
//!
//! Sending: the protocols queue frames whose payload is a range of a GPU buffer
//! (`Payload::Device`). Instead of copying each frame's bytes to host memory synchronously when
//! it is queued (what the worker did: a whole 64 MiB message was copied out, 256 KiB at a time,
//! each copy waited for, before its first frame could leave), the worker copies *chunks* of a
//! few MiB — runs of queued frames whose bytes are contiguous in the GPU buffer — into
//! page-locked bounce buffers with the copy engine, several chunks ahead of the frame being
//! sent (`GSC_CUDA_PIPELINE_DEPTH`), and sends each frame from its chunk once the chunk's copy
//! is done. So the copy of chunk k+1 runs while the lane moves chunk k. `next_chunk` picks the
//! frames of the next chunk; the frames are then rewritten to `Payload::Staged`.
//!
//! Receiving: bytes for a GPU buffer arrive in frames that are valid only during their
//! delivery. They are copied (a host memcpy) into an open bounce buffer while the frames keep
//! filling it contiguously; a full buffer (or a frame that does not follow on) is handed to the
//! copy engine (host to device) and the next frame opens another. `Accumulator` decides which.
//! A request's completion must wait for the copies of its bytes: copies on one stream finish in
//! order, so `Holds` keeps each completion that arrives while copies are outstanding until every
//! copy issued before it is done (conservative: it may also wait for another message's copies,
//! which are microseconds to a millisecond).

use std::collections::VecDeque;

use crate::error::Status;
use crate::protocols::{OutFrame, Payload, RecvInfo, ReqId};

/// The frames of one send chunk: `frames` queued frames from `start` (an index into the queue),
/// whose payloads are the contiguous GPU range `addr..addr+len`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    pub start: usize,
    pub frames: usize,
    pub addr: usize,
    pub len: usize,
}

/// The next chunk to stage: skips frames from `from` that carry no GPU payload, then takes the
/// run of GPU frames that continue each other in memory, up to `max` bytes (at least one frame,
/// whatever its size), and within the allocation of the first (`end_of(addr)`: where the GPU
/// allocation holding `addr` ends; one copy cannot span two allocations, and separately
/// allocated send buffers may be adjacent). `None` when no GPU frame follows `from`. The caller
/// keeps `from` past every frame already looked at (`ChunkPlan::start + frames`), so a long
/// queue is walked once.
pub(crate) fn next_chunk(queue: &VecDeque<OutFrame>, from: usize, max: usize, end_of: impl Fn(usize) -> usize) -> Option<ChunkPlan> {
    let start = (from..queue.len()).find(|&i| matches!(queue[i].payload, Payload::Device { .. }))?;
    let Payload::Device { addr, len } = queue[start].payload else { unreachable!("found above") };
    let mut plan = ChunkPlan { start, frames: 1, addr, len };
    let mut end = None;
    for f in queue.iter().skip(start + 1) {
        match f.payload {
            Payload::Device { addr, len }
                if addr == plan.addr + plan.len && plan.len + len <= max && addr + len <= *end.get_or_insert_with(|| end_of(plan.addr)) =>
            {
                plan.frames += 1;
                plan.len += len;
            }
            _ => break,
        }
    }
    Some(plan)
}

/// Where the receive side puts `len` bytes bound for GPU address `dst`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Into the open buffer at this offset.
    Append { offset: usize },
    /// Hand the buffer that was open (`closed`: its GPU range, if one was open) to the copy
    /// engine first, then open a new one for `dst` and put the bytes at its start.
    Open { closed: Option<(usize, usize)> },
    /// More than a buffer holds and nothing open to join: hand the buffer that was open over,
    /// then copy these bytes straight (synchronously, from the frame).
    Direct { closed: Option<(usize, usize)> },
}

/// The receive side's open bounce buffer: the GPU range it will be copied to.
#[derive(Debug, Default)]
pub(crate) struct Accumulator {
    /// (GPU address of the buffer's first byte, bytes in it).
    open: Option<(usize, usize)>,
    /// End of the GPU allocation the open range lies in (`set_limit`): one copy cannot span two
    /// allocations (`cuMemcpyAsync` refuses it), and two receive buffers allocated separately may
    /// well be adjacent (small `cuMemAlloc`s share a 2 MiB block), so frames that follow on in
    /// address but land in the next allocation open a buffer of their own.
    limit: usize,
    capacity: usize,
}

impl Accumulator {
    pub(crate) fn new(capacity: usize) -> Accumulator {
        Accumulator { open: None, limit: 0, capacity }
    }

    /// The open range lies in an allocation ending at `end` (called after `Place::Open`; until
    /// then nothing is appended to a range).
    pub(crate) fn set_limit(&mut self, end: usize) {
        self.limit = end;
    }

    /// Decide where `len` bytes for `dst` go, and account for them.
    pub(crate) fn place(&mut self, dst: usize, len: usize) -> Place {
        if let Some((start, filled)) = &mut self.open
            && dst == *start + *filled
            && *filled + len <= self.capacity
            && dst + len <= self.limit
        {
            let offset = *filled;
            *filled += len;
            return Place::Append { offset };
        }
        let closed = self.open.take();
        if len > self.capacity {
            return Place::Direct { closed };
        }
        self.open = Some((dst, len));
        self.limit = dst + len;
        Place::Open { closed }
    }

    /// The open buffer's range, if any, closed: it goes to the copy engine now.
    pub(crate) fn close(&mut self) -> Option<(usize, usize)> {
        self.open.take()
    }

    /// The open buffer's range (still filling).
    pub(crate) fn open(&self) -> Option<(usize, usize)> {
        self.open
    }

    /// Is the open buffer full (nothing more can be appended)?
    pub(crate) fn is_full(&self) -> bool {
        self.open.is_some_and(|(_, filled)| filled >= self.capacity)
    }
}

/// Completions held until the copies issued before them are done.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    /// Copies issued so far, and copies finished (in order: one stream).
    issued: u64,
    finished: u64,
    /// (copies that must be finished, request, status, info), in arrival order.
    held: VecDeque<(u64, ReqId, Status, RecvInfo)>,
}

impl Holds {
    /// A copy was issued.
    pub(crate) fn issued(&mut self) {
        self.issued += 1;
    }

    /// The oldest outstanding copy finished.
    pub(crate) fn finished(&mut self) {
        debug_assert!(self.finished < self.issued, "more copies finished than issued");
        self.finished = (self.finished + 1).min(self.issued);
    }

    pub(crate) fn outstanding(&self) -> u64 {
        self.issued - self.finished
    }

    /// Hold `req`'s completion if copies are outstanding (true: held).
    pub(crate) fn hold(&mut self, req: ReqId, status: Status, info: RecvInfo) -> bool {
        if self.outstanding() == 0 {
            return false;
        }
        self.held.push_back((self.issued, req, status, info));
        true
    }

    /// The held completions whose copies are all done, in the order they arrived.
    pub(crate) fn release(&mut self, out: &mut Vec<(ReqId, Status, RecvInfo)>) {
        while let Some(&(need, req, status, info)) = self.held.front() {
            if self.finished < need {
                break;
            }
            self.held.pop_front();
            out.push((req, status, info));
        }
    }

    /// Whether any completion is held.
    pub(crate) fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    pub(crate) fn is_holding(&self, req: ReqId) -> bool {
        self.held.iter().any(|h| h.1 == req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::wire::Header;

    fn frame(payload: Payload) -> OutFrame {
        OutFrame { header: Header::Close.encode(), payload, on_sent: None, copy_if_queued: false }
    }

    fn dev(addr: usize, len: usize) -> OutFrame {
        frame(Payload::Device { addr, len })
    }

    #[test]
    fn chunks_take_contiguous_gpu_frames_up_to_the_limit() {
        const K: usize = 1 << 10;
        // A 1 MiB message pushed in 256 KiB frames after a control frame, then a second message.
        let mut q: VecDeque<OutFrame> = VecDeque::new();
        q.push_back(frame(Payload::None));
        for i in 0..4 {
            q.push_back(dev(0x10_0000 + i * 256 * K, 256 * K));
        }
        q.push_back(frame(Payload::Owned(vec![1, 2, 3])));
        q.push_back(dev(0x90_0000, 100));
        // Up to 512 KiB a chunk: two frames each, then the lone frame after the host frame.
        let a = next_chunk(&q, 0, 512 * K, |_| usize::MAX).unwrap();
        assert_eq!(a, ChunkPlan { start: 1, frames: 2, addr: 0x10_0000, len: 512 * K });
        let b = next_chunk(&q, a.start + a.frames, 512 * K, |_| usize::MAX).unwrap();
        assert_eq!(b, ChunkPlan { start: 3, frames: 2, addr: 0x10_0000 + 512 * K, len: 512 * K });
        let c = next_chunk(&q, b.start + b.frames, 512 * K, |_| usize::MAX).unwrap();
        assert_eq!(c, ChunkPlan { start: 6, frames: 1, addr: 0x90_0000, len: 100 });
        assert_eq!(next_chunk(&q, 7, 512 * K, |_| usize::MAX), None);
        // A frame larger than the limit still makes a chunk of its own.
        assert_eq!(next_chunk(&q, 0, 1000, |_| usize::MAX).unwrap(), ChunkPlan { start: 1, frames: 1, addr: 0x10_0000, len: 256 * K });
        // Frames that do not continue each other in memory split chunks.
        let q2: VecDeque<OutFrame> = [dev(0, 10), dev(20, 10)].into_iter().collect();
        assert_eq!(next_chunk(&q2, 0, 1 << 20, |_| usize::MAX).unwrap().frames, 1);
        // Frames that continue each other in address but not in allocation split chunks too:
        // two 256 KiB send buffers side by side, the first allocation ending where the second
        // begins.
        let alloc_end = |a: usize| if a < 0x10_0000 + 256 * K { 0x10_0000 + 256 * K } else { usize::MAX };
        let a = next_chunk(&q, 0, 1 << 20, alloc_end).unwrap();
        assert_eq!(a, ChunkPlan { start: 1, frames: 1, addr: 0x10_0000, len: 256 * K });
    }

    #[test]
    fn the_accumulator_fills_a_buffer_while_frames_follow_on() {
        let mut a = Accumulator::new(100);
        assert_eq!(a.open(), None);
        assert_eq!(a.place(1000, 40), Place::Open { closed: None });
        a.set_limit(1 << 20);
        assert_eq!(a.place(1040, 40), Place::Append { offset: 40 });
        assert!(!a.is_full());
        assert_eq!(a.place(1080, 20), Place::Append { offset: 80 });
        assert!(a.is_full());
        assert_eq!(a.open(), Some((1000, 100)));
        // Full: the next frame opens another buffer, closing the full one.
        assert_eq!(a.place(1100, 10), Place::Open { closed: Some((1000, 100)) });
        assert_eq!(a.open(), Some((1100, 10)));
        // Following on in address but past the end of the allocation: another buffer.
        a.set_limit(1110);
        assert_eq!(a.place(1110, 10), Place::Open { closed: Some((1100, 10)) });
        // Without a limit set after opening, nothing is appended.
        assert_eq!(a.place(1120, 10), Place::Open { closed: Some((1110, 10)) });
        a.set_limit(1 << 20);
        assert_eq!(a.place(1130, 10), Place::Append { offset: 10 });
        assert_eq!(a.place(5000, 10), Place::Open { closed: Some((1120, 20)) });
        assert_eq!(a.close(), Some((5000, 10)));
        assert_eq!(a.place(1100, 10), Place::Open { closed: None });
        a.set_limit(1 << 20);
        // Not following on (another message): a new buffer.
        assert_eq!(a.place(5000, 10), Place::Open { closed: Some((1100, 10)) });
        assert_eq!(a.close(), Some((5000, 10)));
        assert_eq!(a.close(), None);
        // Too big for any buffer: copied directly, closing what was open.
        assert_eq!(a.place(0, 10), Place::Open { closed: None });
        assert_eq!(a.place(0, 101), Place::Direct { closed: Some((0, 10)) });
        assert_eq!(a.open(), None);
    }

    #[test]
    fn completions_wait_for_the_copies_issued_before_them() {
        let ok = |r: ReqId| (r, Status::Ok, RecvInfo::default());
        let mut h = Holds::default();
        assert!(!h.hold(1, Status::Ok, RecvInfo::default()), "nothing outstanding: not held");
        h.issued();
        h.issued();
        assert!(h.hold(2, Status::Ok, RecvInfo::default()));
        h.issued();
        assert!(h.hold(3, Status::Ok, RecvInfo::default()));
        assert!(h.is_holding(2) && h.is_holding(3));
        let mut out = Vec::new();
        h.finished();
        h.release(&mut out);
        assert!(out.is_empty(), "request 2 needs both copies issued before it");
        h.finished();
        h.release(&mut out);
        assert_eq!(out, [ok(2)]);
        h.finished();
        h.release(&mut out);
        assert_eq!(out, [ok(2), ok(3)]);
        assert_eq!(h.outstanding(), 0);
        assert!(!h.is_holding(3));
    }
}

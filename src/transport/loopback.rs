//! The loopback lane: links between workers of one process (including a worker and itself).
//!
//! Frames go through an in-process queue with a byte budget (so a slow receiver pushes back like
//! a full ring would), and remote memory is the same address space, so `read_remote` /
//! `write_remote` are plain copies. Listeners register in a process-wide table keyed by the
//! worker's uuid; `connect` finds the peer there.

use super::{LaneKind, Link, LinkCaps, Listener};
use crate::error::{Error, Result, Status};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Per-direction queue budget, in bytes of payload.
const QUEUE_BUDGET: usize = 8 << 20;
/// Largest frame on the loopback lane.
pub const MAX_FRAME: usize = 64 << 10;

#[derive(Default)]
struct Queue {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
}

struct Channel {
    /// Index 0: connector → acceptor, 1: acceptor → connector.
    queues: [Mutex<Queue>; 2],
    closed: [AtomicBool; 2],
    /// Held shared by `read_remote`/`write_remote` and exclusively while a side closes: once
    /// `close` returns, no access to the closing side's memory is in progress or can start (its
    /// user may complete the rendezvous send naming that memory and free the buffer).
    mem: RwLock<()>,
}

impl Channel {
    fn set_closed(&self, side: usize) {
        let _g = self.mem.write().unwrap_or_else(|e| e.into_inner());
        self.closed[side].store(true, Ordering::Release);
    }

    fn peer_memory(&self) -> Result<std::sync::RwLockReadGuard<'_, ()>> {
        let g = self.mem.read().unwrap_or_else(|e| e.into_inner());
        if self.closed[0].load(Ordering::Acquire) || self.closed[1].load(Ordering::Acquire) {
            return Err(Error::new(Status::ConnectionReset, "loopback link closed; the peer's memory is no longer exposed"));
        }
        Ok(g)
    }
}

type Pending = Vec<(u128, Box<dyn Link>)>;

fn registry() -> &'static Mutex<HashMap<u128, Arc<Mutex<Pending>>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u128, Arc<Mutex<Pending>>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

pub struct LoopbackListener {
    uuid: u128,
    pending: Arc<Mutex<Pending>>,
}

impl LoopbackListener {
    pub fn new(worker_uuid: u128) -> LoopbackListener {
        let pending = Arc::new(Mutex::new(Vec::new()));
        registry().lock().unwrap_or_else(|e| e.into_inner()).insert(worker_uuid, pending.clone());
        LoopbackListener { uuid: worker_uuid, pending }
    }
}

impl Drop for LoopbackListener {
    fn drop(&mut self) {
        registry().lock().unwrap_or_else(|e| e.into_inner()).remove(&self.uuid);
    }
}

impl Listener for LoopbackListener {
    fn lane(&self) -> LaneKind {
        LaneKind::Loopback
    }

    fn address_blob(&self) -> Vec<u8> {
        // The worker uuid in the address is all a same-process peer needs.
        Vec::new()
    }

    fn accept(&mut self) -> Result<Option<(u128, Box<dyn Link>)>> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        Ok(if p.is_empty() { None } else { Some(p.remove(0)) })
    }
}

/// Is there a worker with this uuid in this process?
pub fn is_local(target_uuid: u128) -> bool {
    registry().lock().unwrap_or_else(|e| e.into_inner()).contains_key(&target_uuid)
}

/// Connect to the worker `target_uuid` of this process.
pub fn connect(target_uuid: u128, my_uuid: u128) -> Result<Box<dyn Link>> {
    let pending = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&target_uuid)
        .cloned()
        .ok_or_else(|| Error::new(Status::Unreachable, "no worker with that address in this process (destroyed?)"))?;
    let ch = Arc::new(Channel {
        queues: [Mutex::new(Queue::default()), Mutex::new(Queue::default())],
        closed: [AtomicBool::new(false), AtomicBool::new(false)],
        mem: RwLock::new(()),
    });
    let theirs: Box<dyn Link> = Box::new(LoopbackLink { ch: ch.clone(), side: 1 });
    pending.lock().unwrap_or_else(|e| e.into_inner()).push((my_uuid, theirs));
    Ok(Box::new(LoopbackLink { ch, side: 0 }))
}

pub struct LoopbackLink {
    ch: Arc<Channel>,
    /// 0 = connector, 1 = acceptor. We send on queue `side` and receive on `1 - side`.
    side: usize,
}

impl Drop for LoopbackLink {
    fn drop(&mut self) {
        self.ch.set_closed(self.side);
    }
}

impl Link for LoopbackLink {
    fn lane(&self) -> LaneKind {
        LaneKind::Loopback
    }

    fn max_frame(&self) -> usize {
        MAX_FRAME
    }

    fn caps(&self) -> LinkCaps {
        LinkCaps { remote_memory: true }
    }

    fn try_send(&mut self, parts: &[&[u8]]) -> Result<bool> {
        if self.ch.closed[1 - self.side].load(Ordering::Acquire) {
            return Err(Error::new(Status::ConnectionReset, "loopback peer closed the link"));
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > MAX_FRAME {
            return Err(Error::invalid_param(format!("frame of {len} bytes exceeds the loopback frame limit {MAX_FRAME}")));
        }
        let mut q = self.ch.queues[self.side].lock().unwrap_or_else(|e| e.into_inner());
        if q.bytes + len > QUEUE_BUDGET && !q.frames.is_empty() {
            return Ok(false);
        }
        q.frames.push_back(parts.concat());
        q.bytes += len;
        Ok(true)
    }

    fn poll_recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut n = 0;
        while n < max {
            // Take one frame at a time so `deliver` runs without the queue lock held.
            let frame = {
                let mut q = self.ch.queues[1 - self.side].lock().unwrap_or_else(|e| e.into_inner());
                let f = q.frames.pop_front();
                if let Some(f) = &f {
                    q.bytes -= f.len();
                }
                f
            };
            let Some(frame) = frame else { break };
            deliver(&frame);
            n += 1;
        }
        if n == 0 && self.ch.closed[1 - self.side].load(Ordering::Acquire) {
            return Err(Error::new(Status::ConnectionReset, "loopback peer closed the link"));
        }
        Ok(n)
    }

    unsafe fn read_remote(&self, local: *mut u8, remote: u64, len: usize) -> Result<()> {
        if len > 0 {
            let _g = self.ch.peer_memory()?;
            // SAFETY: same address space; the caller guarantees `local` is writable for `len` and
            // validated `remote..remote+len` against a buffer the peer exposed (an RTS buffer or
            // a registered region); `copy` tolerates overlap.
            unsafe { std::ptr::copy(remote as usize as *const u8, local, len) };
        }
        Ok(())
    }

    unsafe fn write_remote(&self, local: *const u8, remote: u64, len: usize) -> Result<()> {
        if len > 0 {
            let _g = self.ch.peer_memory()?;
            // SAFETY: as in `read_remote`, with the roles of the buffers swapped.
            unsafe { std::ptr::copy(local, remote as usize as *mut u8, len) };
        }
        Ok(())
    }

    fn check_peer(&mut self) -> Result<()> {
        // Frames the peer queued before it closed are still delivered (`poll_recv`, which fails
        // only on an empty queue): a close seen here before they were read would drop them
        // and fail a receive the peer saw complete (a flush close). The peer queues before it
        // closes, so an empty queue after the Acquire load is empty for good.
        if self.ch.closed[1 - self.side].load(Ordering::Acquire)
            && self.ch.queues[1 - self.side].lock().unwrap_or_else(|e| e.into_inner()).frames.is_empty()
        {
            Err(Error::new(Status::ConnectionReset, "loopback peer closed the link"))
        } else {
            Ok(())
        }
    }

    fn close(&mut self) {
        self.ch.set_closed(self.side);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_flow_both_ways_in_order_and_close_is_seen() {
        let mut l = LoopbackListener::new(0xA);
        assert!(is_local(0xA));
        let mut a = connect(0xA, 0xB).unwrap();
        let (peer, mut b) = l.accept().unwrap().unwrap();
        assert_eq!(peer, 0xB);
        for i in 0..100u32 {
            assert!(a.try_send(&[&i.to_le_bytes(), b"x"]).unwrap());
        }
        let mut got = Vec::new();
        b.poll_recv(1000, &mut |f| got.push(u32::from_le_bytes(f[..4].try_into().unwrap()))).unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(b.try_send(&[b"back"]).unwrap());
        let mut back = Vec::new();
        a.poll_recv(10, &mut |f| back.push(f.to_vec())).unwrap();
        assert_eq!(back, vec![b"back".to_vec()]);
        drop(b);
        assert_eq!(a.check_peer().unwrap_err().status(), Status::ConnectionReset);
        assert!(a.try_send(&[b"late"]).is_err());
        drop(l);
        assert!(!is_local(0xA));
        assert_eq!(connect(0xA, 0xB).err().map(|e| e.status()), Some(Status::Unreachable));
    }

    #[test]
    fn a_closed_peers_queued_frames_come_before_its_close() {
        let mut l = LoopbackListener::new(0xE);
        let mut a = connect(0xE, 0xF).unwrap();
        let (_, mut b) = l.accept().unwrap().unwrap();
        assert!(a.try_send(&[b"last words"]).unwrap());
        drop(a);
        b.check_peer().expect("a frame is still queued: the close is not news yet");
        let mut got = Vec::new();
        assert_eq!(b.poll_recv(10, &mut |f| got.push(f.to_vec())).unwrap(), 1);
        assert_eq!(got, vec![b"last words".to_vec()]);
        assert_eq!(b.check_peer().unwrap_err().status(), Status::ConnectionReset);
        assert_eq!(b.poll_recv(10, &mut |_| {}).unwrap_err().status(), Status::ConnectionReset);
    }

    #[test]
    fn a_full_queue_pushes_back_instead_of_growing() {
        let _l = LoopbackListener::new(0xC);
        let mut a = connect(0xC, 0xD).unwrap();
        let frame = vec![0u8; MAX_FRAME];
        let mut sent = 0;
        while a.try_send(&[&frame]).unwrap() {
            sent += 1;
            assert!(sent < 1000, "budget never reached");
        }
        assert!(sent * MAX_FRAME <= QUEUE_BUDGET + MAX_FRAME);
    }
}

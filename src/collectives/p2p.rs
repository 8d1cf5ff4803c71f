//! Point-to-point between the ranks of a communicator (NCCL's send/recv, and what groups build
//! on them: all-to-all, scatter, gather, neighbour exchanges).
//!
//! The collectives' workspaces carry rounds every rank takes part in; a send/recv involves two
//! ranks and any number of them may be in flight between any pairs, in any order, so they go
//! through the point-to-point engine instead (issue #3): each rank of a communicator has a
//! worker of its own, the ranks exchange worker addresses when the communicator is made, and a
//! send is a tagged send on a condition — matching, protocol choice (staged small messages,
//! copy-engine reads through CUDA IPC for large ones) and completion are the engine's.
//!
//! Matching follows NCCL: the k-th send from rank a to rank b pairs with the k-th receive on b
//! from a. The tag is the sender's rank and the mask is full, and the engine matches messages
//! from one link in order, so FIFO per pair is what it does anyway. The worker belongs to the
//! communicator, so no other traffic shares its tags.
//!
//! Endpoints are made at a rank's first send to a peer (making one is local: the peer's worker
//! accepts it in its own progress), so a communicator that never sends pays for none. Dropping
//! the worker closes its links; frames already queued are still delivered.

use crate::bootstrap::Bootstrap;
use crate::condition::Condition;
use crate::config::Config;
use crate::core::{Context, Endpoint, RequestParams, Started, Worker};
use crate::error::{Error, Result, Status};
use std::sync::{Arc, Mutex};

/// A communicator's point-to-point side: its worker and the way to every peer.
pub struct PeerLinks {
    rank: usize,
    worker: Worker,
    /// Every rank's packed worker address, by rank.
    addresses: Vec<Vec<u8>>,
    /// By rank; made at the first send to that rank.
    endpoints: Mutex<Vec<Option<Arc<Endpoint>>>>,
}

/// Which way a point-to-point transfer goes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PeerOp {
    Send,
    Recv,
}

impl PeerLinks {
    /// Make this rank's worker and learn every rank's address. Collective over `bootstrap`.
    ///
    /// The worker always has its proxy thread, whatever `GSC_PROXY_THREAD` says: communicator
    /// users never call progress, so nothing else would move a stream-triggered transfer
    /// forward (the knob is for workers the application drives itself).
    pub fn new(bootstrap: &Bootstrap, config: &Config) -> Result<PeerLinks> {
        let (rank, nranks) = (bootstrap.rank() as usize, bootstrap.nranks() as usize);
        let config = Config { proxy_thread: true, ..config.clone() };
        // Made before the exchange and failing only after it, so one rank's failure reaches
        // the others as an error instead of leaving them in the allgather.
        let made = Context::new(config).and_then(|ctx| ctx.create_worker());
        let mine = match &made {
            Ok(w) => w.address().to_vec(),
            Err(_) => Vec::new(),
        };
        let all = bootstrap.allgather(&mine).map_err(|e| e.context("exchanging worker addresses for send/recv"))?;
        let worker = made?;
        if let Some(r) = all.iter().position(|a| a.is_empty()) {
            return Err(Error::new(Status::PeerFailed, format!("rank {r} could not make its send/recv worker")));
        }
        Ok(PeerLinks { rank, worker, endpoints: Mutex::new((0..nranks).map(|_| None).collect()), addresses: all })
    }

    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Send (`PeerOp::Send`) `bytes` at `buf` to `peer`, or receive them from it, when `on`
    /// reaches this call; `on`'s producer waits for completion (inside a group: at its end).
    /// Zero bytes is a no-op.
    ///
    /// # Safety
    /// `buf` is valid for `bytes` bytes (GPU or host memory) until the transfer completed on
    /// `on`, and a receive buffer is not read or written by anything else until then.
    pub unsafe fn transfer(&self, op: PeerOp, buf: u64, bytes: usize, peer: usize, on: &Condition) -> Result<()> {
        let nranks = self.addresses.len();
        if peer >= nranks {
            return Err(Error::invalid_param(format!("peer {peer} of a communicator of {nranks} ranks")));
        }
        if bytes == 0 {
            return Ok(());
        }
        if buf == 0 {
            return Err(Error::invalid_param(format!("a NULL buffer for {bytes} bytes")));
        }
        let params = RequestParams { condition: Some(on.clone()), ..Default::default() };
        let started = match op {
            // SAFETY: the caller's contract on `buf`.
            PeerOp::Recv => unsafe { self.worker.tag_recv_nbx(buf as *mut u8, bytes, peer as u64, u64::MAX, params) }?,
            PeerOp::Send => {
                let ep = self.endpoint(peer)?;
                // SAFETY: as above.
                unsafe { ep.tag_send_nbx(buf as *const u8, bytes, self.rank as u64, params) }?
            }
        };
        // The condition's producer waits for it; failures show in `Condition::query` (sticky).
        if let Started::Pending(handle) = started {
            self.worker.request_release(handle)?;
        }
        Ok(())
    }

    /// The lane this rank's transfers to `peer` take (connecting first if need be).
    pub fn lane_to(&self, peer: usize) -> Result<crate::transport::LaneKind> {
        if peer >= self.addresses.len() {
            return Err(Error::invalid_param(format!("peer {peer} of a communicator of {} ranks", self.addresses.len())));
        }
        self.endpoint(peer)?.lane()
    }

    /// The endpoint to `peer`, made at the first use.
    fn endpoint(&self, peer: usize) -> Result<Arc<Endpoint>> {
        let mut eps = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ep) = &eps[peer] {
            return Ok(ep.clone());
        }
        let ep = self.worker.connect(&self.addresses[peer]).map_err(|e| e.context(format!("connecting to rank {peer}")))?;
        let ep = Arc::new(ep);
        eps[peer] = Some(ep.clone());
        Ok(ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::UniqueId;
    use crate::condition::HostStream;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(30);

    /// Rank `from`'s `k`-th message to rank `to`, `len` bytes.
    fn message(from: usize, to: usize, k: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + from * 31 + to * 17 + k * 101) as u8).collect()
    }

    /// Every rank sends two messages to every rank (itself included) and receives theirs, all
    /// in one group on a host stream, the receives posted in reverse order of the sends.
    fn all_to_all(rank: usize, nranks: usize, uid: &UniqueId, len: usize) -> std::result::Result<(), String> {
        let boot = Bootstrap::init(uid, rank as u32, nranks as u32, T).map_err(|e| e.to_string())?;
        let links = PeerLinks::new(&boot, &Config::default()).map_err(|e| e.to_string())?;
        let stream = HostStream::new().map_err(|e| e.to_string())?;
        let on = Condition::host_stream(&stream);
        let sends: Vec<Vec<u8>> = (0..nranks * 2).map(|i| message(rank, i / 2, i % 2, len)).collect();
        let mut recvs: Vec<Vec<u8>> = (0..nranks * 2).map(|_| vec![0u8; len]).collect();
        on.group_start().map_err(|e| e.to_string())?;
        for (i, r) in recvs.iter_mut().enumerate().rev() {
            // SAFETY: the buffers outlive the stream's synchronize below.
            unsafe { links.transfer(PeerOp::Recv, r.as_mut_ptr() as u64, len, i / 2, &on) }.map_err(|e| e.to_string())?;
        }
        for (i, s) in sends.iter().enumerate() {
            // SAFETY: as above.
            unsafe { links.transfer(PeerOp::Send, s.as_ptr() as u64, len, i / 2, &on) }.map_err(|e| e.to_string())?;
        }
        on.group_end().map_err(|e| e.to_string())?;
        stream.synchronize(Some(T)).map_err(|e| e.to_string())?;
        on.query().map_err(|e| e.to_string())?;
        for (i, r) in recvs.iter().enumerate() {
            // Receives from one peer were posted second message first: pairing is still FIFO.
            let (from, k) = (i / 2, 1 - i % 2);
            if *r != message(from, rank, k, len) {
                return Err(format!("rank {rank}: receive {i} from rank {from} does not hold message {k}"));
            }
        }
        boot.barrier().map_err(|e| e.to_string())
    }

    fn run(nranks: usize, len: usize) {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..nranks)
                .map(|r| {
                    s.spawn({
                        let uid = uid.clone();
                        move || all_to_all(r, nranks, &uid, len)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            r.unwrap();
        }
    }

    #[test]
    fn all_to_all_small_messages_in_one_group() {
        run(3, 8);
    }

    #[test]
    fn all_to_all_rendezvous_messages_in_one_group() {
        run(3, 1 << 20);
    }

    #[test]
    fn bad_peers_and_buffers_are_named() {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        let boot = Bootstrap::init(&uid, 0, 1, T).unwrap();
        let links = PeerLinks::new(&boot, &Config::default()).unwrap();
        let stream = HostStream::new().unwrap();
        let on = Condition::host_stream(&stream);
        let buf = [0u8; 8];
        let e = unsafe { links.transfer(PeerOp::Send, buf.as_ptr() as u64, 8, 1, &on) }.unwrap_err();
        assert!(e.to_string().contains("peer 1 of a communicator of 1 ranks"), "{e}");
        let e = unsafe { links.transfer(PeerOp::Recv, 0, 8, 0, &on) }.unwrap_err();
        assert!(e.to_string().contains("NULL buffer"), "{e}");
        unsafe { links.transfer(PeerOp::Recv, 0, 0, 0, &on) }.unwrap();
        on.query().unwrap();
    }

    /// `GSC_PROXY_THREAD=off` is for workers the application progresses; a communicator's
    /// transfers still run (its worker keeps its proxy thread).
    #[test]
    fn transfers_run_with_the_proxy_thread_knob_off() {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        let boot = Bootstrap::init(&uid, 0, 1, T).unwrap();
        let links = PeerLinks::new(&boot, &Config { proxy_thread: false, ..Config::default() }).unwrap();
        let stream = HostStream::new().unwrap();
        let on = Condition::host_stream(&stream);
        let (out, mut back) = (*b"to myself", [0u8; 9]);
        on.group_start().unwrap();
        unsafe { links.transfer(PeerOp::Recv, back.as_mut_ptr() as u64, 9, 0, &on) }.unwrap();
        unsafe { links.transfer(PeerOp::Send, out.as_ptr() as u64, 9, 0, &on) }.unwrap();
        on.group_end().unwrap();
        stream.synchronize(Some(T)).unwrap();
        assert_eq!(&back, b"to myself");
    }
}

//! Collectives on host memory between ranks on any hosts, over the point-to-point engine.
//!
//! A `Communicator` (comm.rs) needs its ranks on the GPUs of one host: its kernels write into
//! every peer's workspace over NVLink. Ranks on different hosts reach each other only through
//! the point-to-point engine (shm on one host, UCX between hosts: issue #7), and `HostComm`
//! runs NCCL's collectives on host buffers there — the leg between hosts that hierarchical
//! collectives will use, and collectives for CPU data in their own right.
//!
//! **Algorithm: direct exchange, reduced in rank order.** An all-reduce is a reduce-scatter
//! then an all-gather. In the first, every rank sends part q of its input to rank q and gets
//! part `rank` from everyone; it reduces the n copies in rank order (`types::reduce_reference`,
//! the GPU kernels' own order and rounding, so host and GPU collectives give identical bits); in
//! the second, every rank sends its reduced part to everyone. Each rank moves 2(n-1)/n of the
//! buffer each way, as a ring does, with every transfer of a step posted at once in one group
//! (no step waits for a neighbour's step); it suits the few ranks of the hosts one job spans,
//! not hundreds (n² messages per step).
//!
//! **Blocking, bounded.** Each call returns when its data is in place: the transfers go on a
//! host stream of the communicator's own and the call waits for it. The engine ends transfers
//! to a dead or silent peer within `GSC_TIMEOUT` (issue #8); should the stream still hold any
//! past that plus a margin, the communicator's worker is aborted (which completes every
//! transfer, so no buffer of the caller is written after the call returned) and the call fails.
//! A failure is sticky: the communicator refuses later calls with the first error, since the
//! ranks' sequences of messages no longer line up.

use super::p2p::{PeerLinks, PeerOp};
use super::types::{DataType, RedOp, reduce_reference};
use crate::bootstrap::Bootstrap;
use crate::condition::{Condition, HostStream};
use crate::config::Config;
use crate::error::{Error, Result, Status};
use std::sync::Mutex;
use std::time::Duration;

/// How long past `GSC_TIMEOUT` a call waits for its stream before it aborts the worker.
const MARGIN: Duration = Duration::from_secs(5);

/// A communicator of host-memory collectives over the point-to-point engine.
pub struct HostComm {
    links: PeerLinks,
    rank: usize,
    nranks: usize,
    stream: HostStream,
    on: Condition,
    /// `GSC_TIMEOUT` (`None`: no limit, so the wait has none either).
    timeout: Option<Duration>,
    /// The first failure (sticky).
    failed: Mutex<Option<Error>>,
}

/// One transfer of a step: `PeerOp`, peer, and the byte range of a buffer. Receive ranges
/// come from `as_mut_ptr` of their buffer (the engine writes through them); send ranges are
/// only read.
type Transfer = (PeerOp, usize, *mut u8, usize);

impl HostComm {
    /// Make this rank's side of the communicator: a worker and a host stream of its own, and
    /// every rank's worker address. Collective over `bootstrap` (every rank calls it).
    pub fn new(bootstrap: &Bootstrap, config: &Config) -> Result<HostComm> {
        let links = PeerLinks::new(bootstrap, config)?;
        let stream = HostStream::new()?;
        let on = Condition::host_stream(&stream);
        Ok(HostComm {
            links,
            rank: bootstrap.rank() as usize,
            nranks: bootstrap.nranks() as usize,
            stream,
            on,
            timeout: config.timeout,
            failed: Mutex::new(None),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The lane the transfers to `peer` take (shm, UCX, ...).
    pub fn lane_to(&self, peer: usize) -> Result<crate::transport::LaneKind> {
        self.links.lane_to(peer)
    }

    /// `recv` = the element-wise `op` over every rank's `send`, in rank order. `recv` may not
    /// alias `send` (Rust's borrows see to it); in place, pass a copy.
    pub fn all_reduce(&self, send: &[u8], recv: &mut [u8], dtype: DataType, op: RedOp) -> Result<()> {
        self.check_usable()?;
        whole_elements(send.len(), dtype, "all_reduce's send buffer")?;
        same_len(send.len(), recv.len(), "all_reduce's receive buffer")?;
        let parts = self.parts(send.len() / dtype.size(), dtype.size());
        let mine = self.reduce_part(send, &parts, dtype, op)?;
        self.gather_parts(&mine, recv, &parts)
    }

    /// `recv` (one part of `send.len() / nranks` bytes) = the `op` over every rank's part
    /// `rank` of `send`, in rank order.
    pub fn reduce_scatter(&self, send: &[u8], recv: &mut [u8], dtype: DataType, op: RedOp) -> Result<()> {
        self.check_usable()?;
        whole_elements(recv.len(), dtype, "reduce_scatter's receive buffer")?;
        same_len(send.len(), recv.len() * self.nranks, "reduce_scatter's send buffer (nranks parts)")?;
        let part = recv.len();
        let parts: Vec<(usize, usize)> = (0..self.nranks).map(|q| (q * part, part)).collect();
        let mine = self.reduce_part(send, &parts, dtype, op)?;
        recv.copy_from_slice(&mine);
        Ok(())
    }

    /// `recv` = every rank's `send`, in rank order (`nranks × send.len()` bytes).
    pub fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.check_usable()?;
        same_len(send.len() * self.nranks, recv.len(), "all_gather's receive buffer (nranks parts)")?;
        let parts: Vec<(usize, usize)> = (0..self.nranks).map(|q| (q * send.len(), send.len())).collect();
        self.gather_parts(send, recv, &parts)
    }

    /// Every rank's `buf` = `root`'s. The root sends to each rank directly.
    pub fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        self.check_usable()?;
        if root >= self.nranks {
            return Err(Error::invalid_param(format!("root {root} of a communicator of {} ranks", self.nranks)));
        }
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let steps: Vec<Transfer> = if self.rank == root {
            (0..self.nranks).filter(|&q| q != root).map(|q| (PeerOp::Send, q, ptr, len)).collect()
        } else {
            vec![(PeerOp::Recv, root, ptr, len)]
        };
        // SAFETY: every range lies in `buf`, borrowed mutably for the whole call (`run` returns
        // only once every transfer ended).
        unsafe { self.run(&steps) }
    }

    /// The reduce-scatter half: part `rank` (per `parts`, byte ranges of `send`) reduced over
    /// every rank's copy, in rank order.
    fn reduce_part(&self, send: &[u8], parts: &[(usize, usize)], dtype: DataType, op: RedOp) -> Result<Vec<u8>> {
        let (_, my_len) = parts[self.rank];
        let mut copies: Vec<Vec<u8>> = (0..self.nranks).map(|_| vec![0u8; my_len]).collect();
        let mut steps: Vec<Transfer> = Vec::with_capacity(2 * self.nranks);
        for (q, copy) in copies.iter_mut().enumerate().filter(|(q, _)| *q != self.rank) {
            steps.push((PeerOp::Recv, q, copy.as_mut_ptr(), my_len));
            let (at, len) = parts[q];
            steps.push((PeerOp::Send, q, send[at..at + len].as_ptr() as *mut u8, len));
        }
        // SAFETY: each range lies in `send` (borrowed for the call) or in a `copies` buffer,
        // which lives to the end of this function; `run` returns only once every transfer ended.
        unsafe { self.run(&steps) }?;
        let (at, len) = parts[self.rank];
        copies[self.rank].copy_from_slice(&send[at..at + len]);
        if my_len == 0 {
            return Ok(Vec::new());
        }
        let inputs: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
        Ok(reduce_reference(dtype, op, &inputs))
    }

    /// The all-gather half: `mine` goes to every rank's part `rank` of `recv`, and every rank's
    /// part comes into ours.
    fn gather_parts(&self, mine: &[u8], recv: &mut [u8], parts: &[(usize, usize)]) -> Result<()> {
        let mut steps: Vec<Transfer> = Vec::with_capacity(2 * self.nranks);
        // One base pointer for every part, so no later borrow of `recv` invalidates another's.
        let base = recv.as_mut_ptr();
        for q in (0..self.nranks).filter(|&q| q != self.rank) {
            let (at, len) = parts[q];
            // SAFETY: `at + len <= recv.len()` (the parts cover `recv`).
            steps.push((PeerOp::Recv, q, unsafe { base.add(at) }, len));
            steps.push((PeerOp::Send, q, mine.as_ptr() as *mut u8, mine.len()));
        }
        // SAFETY: each range lies in `recv` (borrowed mutably for the call; the ranges of
        // different peers do not overlap) or in `mine`; `run` returns once every transfer ended.
        unsafe { self.run(&steps) }?;
        let (at, len) = parts[self.rank];
        recv[at..at + len].copy_from_slice(mine);
        Ok(())
    }

    /// `elements` elements of `size` bytes cut into `nranks` parts as even as whole elements
    /// allow: (byte offset, bytes) per rank.
    fn parts(&self, elements: usize, size: usize) -> Vec<(usize, usize)> {
        let n = self.nranks;
        (0..n).map(|q| (elements * q / n * size, (elements * (q + 1) / n - elements * q / n) * size)).collect()
    }

    /// Post `steps` in one group on the stream and wait for them; see the module note on bounds.
    ///
    /// # Safety
    /// Every range is valid for its length until this returns (receives: writable, and read by
    /// nothing else meanwhile).
    unsafe fn run(&self, steps: &[Transfer]) -> Result<()> {
        let posted = (|| {
            self.on.group_start()?;
            let mut result = Ok(());
            for &(op, peer, ptr, len) in steps {
                // SAFETY: the caller's contract; the group is closed and waited for below, even
                // when a later transfer fails to post.
                result = unsafe { self.links.transfer(op, ptr as u64, len, peer, &self.on) };
                if result.is_err() {
                    break;
                }
            }
            let ended = self.on.group_end();
            result.and(ended)
        })();
        let waited = match self.stream.synchronize(self.timeout.map(|t| t + MARGIN)) {
            Err(e) if e.status() == Status::TimedOut => {
                // Transfers still hold our buffers: end them all before returning.
                let _ = self.links.worker().abort("a host collective outlived GSC_TIMEOUT");
                let _ = self.stream.synchronize(None);
                Err(e)
            }
            other => other,
        };
        let result = posted.and(waited).and_then(|()| self.on.query());
        if let Err(e) = &result {
            self.failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| e.clone());
        }
        result
    }

    fn check_usable(&self) -> Result<()> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(Error::new(e.status(), format!("an earlier collective of this host communicator failed: {e}"))),
            None => Ok(()),
        }
    }
}

fn whole_elements(bytes: usize, dtype: DataType, what: &str) -> Result<()> {
    if !bytes.is_multiple_of(dtype.size()) {
        return Err(Error::invalid_param(format!("{what}: {bytes} bytes is not a whole number of {} elements", dtype.name())));
    }
    Ok(())
}

fn same_len(want: usize, got: usize, what: &str) -> Result<()> {
    if want != got {
        return Err(Error::invalid_param(format!("{what}: {got} bytes, expected {want}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::UniqueId;

    const T: Duration = Duration::from_secs(30);

    /// Rank `rank`'s input of `len` bytes for case `case`.
    fn input(rank: usize, case: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 13 + rank * 71 + case * 29 + 5) as u8).collect()
    }

    /// Every collective on `nranks` ranks (threads), several types, operators and sizes
    /// (0, 1 element, odd, not a multiple of nranks, large enough for the rendezvous), each
    /// checked against the reference on every rank.
    fn all_collectives(rank: usize, nranks: usize, uid: &UniqueId) -> std::result::Result<(), String> {
        let boot = Bootstrap::init(uid, rank as u32, nranks as u32, T).map_err(|e| e.to_string())?;
        let comm = HostComm::new(&boot, &Config::default()).map_err(|e| e.to_string())?;
        let cases = [
            (DataType::Int32, RedOp::Sum, 0usize),
            (DataType::Int32, RedOp::Sum, 1),
            (DataType::Float32, RedOp::Sum, 1001),
            (DataType::Float16, RedOp::Max, 77),
            (DataType::Bfloat16, RedOp::Avg, 4099),
            (DataType::Uint8, RedOp::Prod, 3),
            (DataType::Float64, RedOp::Min, (300 << 10) + 1),
        ];
        for (case, &(dtype, op, count)) in cases.iter().enumerate() {
            let len = count * dtype.size();
            let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| input(r, case, len)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let mut out = vec![0u8; len];
            comm.all_reduce(&inputs[rank], &mut out, dtype, op).map_err(|e| format!("all_reduce {case}: {e}"))?;
            if len > 0 && out != reduce_reference(dtype, op, &refs) {
                return Err(format!("rank {rank}: all_reduce case {case} ({} {} x{count}) differs", dtype.name(), op.name()));
            }
            // Reduce-scatter of nranks parts of `count` elements each.
            let big: Vec<Vec<u8>> = (0..nranks).map(|r| input(r, case + 100, len * nranks)).collect();
            let mut part = vec![0u8; len];
            comm.reduce_scatter(&big[rank], &mut part, dtype, op).map_err(|e| format!("reduce_scatter {case}: {e}"))?;
            let slices: Vec<&[u8]> = big.iter().map(|b| &b[rank * len..(rank + 1) * len]).collect();
            if len > 0 && part != reduce_reference(dtype, op, &slices) {
                return Err(format!("rank {rank}: reduce_scatter case {case} differs"));
            }
            let mut all = vec![0u8; len * nranks];
            comm.all_gather(&inputs[rank], &mut all).map_err(|e| format!("all_gather {case}: {e}"))?;
            if all != inputs.concat() {
                return Err(format!("rank {rank}: all_gather case {case} differs"));
            }
            let root = case % nranks;
            let mut b = if rank == root { inputs[root].clone() } else { vec![0u8; len] };
            comm.broadcast(&mut b, root).map_err(|e| format!("broadcast {case}: {e}"))?;
            if b != inputs[root] {
                return Err(format!("rank {rank}: broadcast case {case} from {root} differs"));
            }
        }
        // Bad arguments are named and change nothing: the communicator still works after them.
        let mut small = vec![0u8; 3];
        let e = comm.all_reduce(&[0u8; 4], &mut small, DataType::Int32, RedOp::Sum).unwrap_err();
        if !e.to_string().contains("expected 4") {
            return Err(format!("bad length: {e}"));
        }
        let e = comm.all_reduce(&[0u8; 6], &mut [0u8; 6], DataType::Int32, RedOp::Sum).unwrap_err();
        if !e.to_string().contains("not a whole number") {
            return Err(format!("bad element count: {e}"));
        }
        if !comm.broadcast(&mut small, nranks).unwrap_err().to_string().contains("root") {
            return Err("a bad root was not named".into());
        }
        let mut one = [0u8; 4];
        comm.all_reduce(&1i32.to_le_bytes(), &mut one, DataType::Int32, RedOp::Sum).map_err(|e| format!("after bad arguments: {e}"))?;
        if i32::from_le_bytes(one) != nranks as i32 {
            return Err(format!("rank {rank}: the sum of ones is {}", i32::from_le_bytes(one)));
        }
        boot.barrier().map_err(|e| e.to_string())
    }

    fn run(nranks: usize) {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..nranks)
                .map(|r| {
                    s.spawn({
                        let uid = uid.clone();
                        move || all_collectives(r, nranks, &uid)
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
    fn every_collective_on_one_rank() {
        run(1);
    }

    #[test]
    fn every_collective_on_three_ranks() {
        run(3);
    }

    #[test]
    fn parts_cover_the_buffer_in_whole_elements() {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        let boot = Bootstrap::init(&uid, 0, 1, T).unwrap();
        let mut comm = HostComm::new(&boot, &Config::default()).unwrap();
        for n in [1usize, 2, 3, 7] {
            comm.nranks = n;
            for elements in [0usize, 1, 2, 5, 1000, 1001] {
                let p = comm.parts(elements, 4);
                assert_eq!(p.len(), n);
                assert_eq!(p[0].0, 0);
                for w in p.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0, "parts are contiguous");
                }
                assert_eq!(p[n - 1].0 + p[n - 1].1, elements * 4, "parts cover the buffer");
                assert!(p.iter().all(|&(at, len)| at % 4 == 0 && len % 4 == 0), "whole elements");
            }
        }
    }
}

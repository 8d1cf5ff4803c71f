//! Every rank of a communicator in this process, one call each, issued by one thread: NCCL's
//! `ncclCommInitAll` and a thread driving several GPUs in a group (nccl-tests' `-g`).
//!
//! Ranks that share a process cannot exchange buffers inside a call: the exchange would wait
//! on the host for a call the same thread makes later (`Communicator::new`). Alone, their calls
//! therefore take only the workspace kernels, or the direct kernel on symmetric windows.
//! Issued together, every rank's buffers are known before any rank's call is issued: the paths
//! on the peers' buffers (the direct kernel, the copy engines, the copy-engine ring) take them
//! as they take windows', without an exchange, and choose exactly as ranks in separate
//! processes do. Nothing waits on the host: each rank's work waits for its peers on its GPU.
//!
//! What makes the calls one call of the communicator: one of each rank, of one communicator,
//! the same collective, size, type, operator and root on each, on conditions of one kind
//! (streams, all captured or none; or graphs). Where that does not hold, or a peer's buffer is
//! not reachable by address from a rank's GPU, every call is issued on its own, as it would
//! have been without this (and a mismatch fails as it would have: by the timeout).

use super::comm::{Communicator, PremulKind};
use super::types::{DataType, PreMulScalar, RedOp};
use crate::condition::{ArmedOutputs, Condition};
use crate::cuda::coll::CollKind;
use crate::error::Result;

/// One collective call of any kind, as `Communicator`'s methods of the same names take it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Coll {
    AllReduce { send: u64, recv: u64, count: usize, dtype: DataType, op: RedOp },
    AllGather { send: u64, recv: u64, count: usize, dtype: DataType },
    ReduceScatter { send: u64, recv: u64, recv_count: usize, dtype: DataType, op: RedOp },
    Broadcast { send: u64, recv: u64, count: usize, dtype: DataType, root: usize },
    Reduce { send: u64, recv: u64, count: usize, dtype: DataType, op: RedOp, root: usize },
    PremulSum { kind: PremulKind, send: u64, recv: u64, count: usize, dtype: DataType, scalar: PreMulScalar, root: usize },
}

/// A rank's call in `issue_group` and `issue_together`.
#[derive(Copy, Clone)]
pub struct RankCall<'a> {
    pub comm: &'a Communicator,
    pub call: Coll,
    pub on: &'a Condition,
}

/// Every rank's buffers for one call, known without an exchange: (send, recv) by rank, and
/// each rank's copy-engine ring scratch where the ring may take the call.
pub(crate) struct Known {
    pub(crate) bufs: Vec<(u64, u64)>,
    pub(crate) ring_scratch: Option<Vec<u64>>,
}

/// What tells the communicators whose ranks all live in this process apart
/// (`Communicator::family_here`).
pub type Family = (u32, u64);

/// What must be alike on every rank's call for them to be one call of the communicator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The communicator (`Communicator::family`) and its size.
    pub(crate) family: Family,
    pub(crate) nranks: usize,
    pub(crate) kind: CollKind,
    pub(crate) part_bytes: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: RedOp,
    /// A graph condition (else a stream), and whether the stream is being captured.
    pub(crate) graph: bool,
    pub(crate) replayed: bool,
}

/// The index of each rank's call, rank by rank, when `entries` (rank, shape) are one call of
/// the communicator: every rank once, every shape alike.
pub(crate) fn by_rank(entries: &[(usize, Shape)]) -> Option<Vec<usize>> {
    let (_, first) = entries.first()?;
    if entries.len() != first.nranks || entries.iter().any(|(_, s)| s != first) {
        return None;
    }
    let mut at = vec![usize::MAX; first.nranks];
    for (i, &(rank, _)) in entries.iter().enumerate() {
        match at.get_mut(rank) {
            Some(slot) if *slot == usize::MAX => *slot = i,
            _ => return None,
        }
    }
    Some(at)
}

/// Issue a group's collectives, given in the order the program made them (NCCL's
/// `ncclGroupStart` … `ncclGroupEnd` on several communicators of one thread): for each
/// communicator whose ranks all live in this process and each made as many calls, the k-th
/// call of every rank together (`issue_together`); every other call on its own. Each
/// communicator's calls are issued in their order. A result per call, in `calls`' order.
///
/// # Safety
/// Each call's buffers as its `Communicator` method requires.
pub unsafe fn issue_group(calls: &[RankCall]) -> Vec<Result<ArmedOutputs>> {
    let mut results: Vec<Option<Result<ArmedOutputs>>> = calls.iter().map(|_| None).collect();
    // Each communicator's calls (indices into `calls`), by rank.
    let mut families: Vec<(Family, Vec<Vec<usize>>)> = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let Some(family) = c.comm.family_here() else { continue };
        let at = match families.iter().position(|(f, _)| *f == family) {
            Some(at) => at,
            None => {
                families.push((family, vec![Vec::new(); c.comm.nranks()]));
                families.len() - 1
            }
        };
        families[at].1[c.comm.rank()].push(i);
    }
    for (_, ranks) in &families {
        let rounds = ranks[0].len();
        if ranks.iter().any(|r| r.len() != rounds) {
            continue;
        }
        for k in 0..rounds {
            let batch: Vec<usize> = ranks.iter().map(|r| r[k]).collect();
            let these: Vec<RankCall> = batch.iter().map(|&i| calls[i]).collect();
            // SAFETY: the caller's promise.
            for (i, r) in batch.into_iter().zip(unsafe { issue_together(&these) }) {
                results[i] = Some(r);
            }
        }
    }
    for (i, c) in calls.iter().enumerate() {
        if results[i].is_none() {
            // SAFETY: the caller's promise.
            results[i] = Some(unsafe { c.comm.collective(&c.call, c.on) });
        }
    }
    results.into_iter().map(|r| r.expect("every call issued")).collect()
}

/// Issue `calls`, one per rank of a communicator whose ranks all live in this process, with
/// every rank's buffers known to every rank's call (see the module's notes); otherwise each
/// on its own. A result per call, in `calls`' order.
///
/// # Safety
/// Each call's buffers as its `Communicator` method requires.
pub unsafe fn issue_together(calls: &[RankCall]) -> Vec<Result<ArmedOutputs>> {
    // SAFETY: the caller's promise.
    let alone = |c: &RankCall| unsafe { c.comm.collective(&c.call, c.on) };
    let Some((order, checked, known)) = known_buffers(calls) else { return calls.iter().map(alone).collect() };
    let mut results: Vec<Option<Result<ArmedOutputs>>> = calls.iter().map(|_| None).collect();
    for &i in &order {
        let c = &calls[i];
        // SAFETY: the caller's promise; `known` holds every rank's buffers of this call.
        results[i] = Some(unsafe { c.comm.run_known(checked[i], c.on, &known) });
    }
    results.into_iter().map(|r| r.expect("every rank's call issued")).collect()
}

/// Every rank's buffers, when `calls` are one call of the communicator that can take them:
/// the order of the calls by rank, each call checked, and the buffers.
fn known_buffers(calls: &[RankCall]) -> Option<(Vec<usize>, Vec<super::comm::Call>, Known)> {
    let mut checked = Vec::with_capacity(calls.len());
    let mut entries = Vec::with_capacity(calls.len());
    for c in calls {
        let (call, shape) = c.comm.together_shape(&c.call, c.on).ok()??;
        checked.push(call);
        entries.push((c.comm.rank(), shape));
    }
    let order = by_rank(&entries)?;
    let bufs: Vec<(u64, u64)> = order.iter().map(|&i| (checked[i].send, checked[i].recv)).collect();
    // Every peer's buffers reachable from every rank's GPU by address (peer access; VMM
    // memory granted to that GPU), or none of the calls takes them.
    let (send_len, recv_len) = checked[0].buffer_bytes(calls.len())?;
    for &i in &order {
        let (me, device) = (calls[i].comm.rank(), calls[i].comm.device());
        for (q, &(send, recv)) in bufs.iter().enumerate().filter(|&(q, _)| q != me) {
            let reach =
                crate::cuda::ipc::reach_own(send, send_len, device).and_then(|()| crate::cuda::ipc::reach_own(recv, recv_len, device));
            if let Err(e) = reach {
                tracing::debug!(target: "gsc::coll", error = %e, rank = q, from = me, "a peer's buffer is out of reach: each rank's call issued on its own");
                return None;
            }
        }
    }
    // The ring's scratch, made on every rank where the ring may take the call (all or none).
    let ring_scratch: Option<Vec<u64>> = order.iter().map(|&i| calls[i].comm.ring_scratch_for(&checked[i], &entries[i].1)).collect();
    Some((order, checked, Known { bufs, ring_scratch }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nranks: usize) -> Shape {
        Shape {
            family: (7, 0x7000),
            nranks,
            kind: CollKind::AllReduce,
            part_bytes: 1 << 24,
            dtype: DataType::Float32,
            op: RedOp::Sum,
            graph: false,
            replayed: false,
        }
    }

    #[test]
    fn calls_are_one_call_only_with_every_rank_once_and_alike() {
        let s = shape(3);
        assert_eq!(by_rank(&[(2, s), (0, s), (1, s)]), Some(vec![1, 2, 0]));
        assert_eq!(by_rank(&[]), None);
        assert_eq!(by_rank(&[(0, s), (1, s)]), None, "a rank missing");
        assert_eq!(by_rank(&[(0, s), (1, s), (1, s)]), None, "a rank twice");
        assert_eq!(by_rank(&[(0, s), (1, s), (3, s)]), None, "a rank past the communicator");
        for other in [
            Shape { family: (7, 0x8000), ..s },
            Shape { part_bytes: 1 << 20, ..s },
            Shape { kind: CollKind::AllGather, ..s },
            Shape { dtype: DataType::Float16, ..s },
            Shape { op: RedOp::Max, ..s },
            Shape { graph: true, ..s },
            Shape { replayed: true, ..s },
        ] {
            assert_eq!(by_rank(&[(0, s), (1, other), (2, s)]), None, "{other:?}");
        }
    }
}

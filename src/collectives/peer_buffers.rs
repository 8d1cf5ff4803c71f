//! Collectives on the peers' own buffers — the copy engines (`copy_engine`) and the direct SM
//! kernel (`direct`): the call, what it needs from its communicator, and the exchange that
//! maps every rank's buffers into this process.
//!
//! The ranks exchange their buffers' addresses and IPC keys during the call, on the
//! communicator's shared-memory board (`host_board`; through the bootstrap where a rank could
//! not map it; under capture once per capture, which is NCCL's "registration by graph
//! capture"), map the peers' buffers (cached by allocation in `cuda::ipc`), and agree on
//! the outcome: a rank that cannot share or map its buffers makes every rank fall back to the
//! workspace kernels, decided from what all ranks report, so they all take the same path.

use super::host_board::HostBoard;
use super::types::{DataType, RedOp};
use crate::bootstrap::Bootstrap;
use crate::cuda::coll::{CollKind, MAX_RANKS, Workspace};
use crate::cuda::{ipc, memory};
use crate::error::{Error, Result, Status};
use std::path::Path;

/// The collectives that run on the peers' buffers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum DirectKind {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl DirectKind {
    /// The kind a collective of `kind` would be on the peers' buffers, if it has one.
    pub(crate) fn of(kind: CollKind) -> Option<DirectKind> {
        match kind {
            CollKind::AllGather => Some(DirectKind::AllGather),
            CollKind::ReduceScatter => Some(DirectKind::ReduceScatter),
            CollKind::AllReduce => Some(DirectKind::AllReduce),
            _ => None,
        }
    }

    /// (send, recv) bytes of a call with `part` bytes per part on `n` ranks.
    pub(crate) fn buffer_bytes(self, n: usize, part: usize) -> (usize, usize) {
        match self {
            DirectKind::AllGather => (part, n * part),
            DirectKind::ReduceScatter => (n * part, part),
            DirectKind::AllReduce => (part, part),
        }
    }
}

/// What one call needs from its communicator.
pub(crate) struct DirectContext<'a> {
    pub(crate) workspace: &'a Workspace,
    pub(crate) bootstrap: &'a Bootstrap,
    /// The communicator's shared-memory board, where every rank has it (`host_board`).
    pub(crate) board: Option<&'a HostBoard>,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) device: i32,
    pub(crate) kernel_cache: Option<&'a Path>,
    pub(crate) timeout_ns: u64,
}

impl DirectContext<'_> {
    /// An allgather of the call's ranks: on the board where there is one.
    fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        match self.board {
            Some(b) => b.allgather(self.bootstrap, mine),
            None => self.bootstrap.allgather(mine),
        }
    }
}

/// One call: `part_bytes` per rank's part (an all-reduce: its whole buffer).
#[derive(Copy, Clone, Debug)]
pub(crate) struct DirectCall {
    pub(crate) kind: DirectKind,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) part_bytes: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: RedOp,
}

impl DirectCall {
    /// The call is in place as NCCL defines it: the send buffer is our part of the receive
    /// buffer (all-gather), the receive buffer our part of the send buffer (reduce-scatter), or
    /// both are one (all-reduce).
    pub(crate) fn in_place(&self, rank: usize) -> bool {
        match self.kind {
            DirectKind::AllGather => self.send == self.recv + (rank * self.part_bytes) as u64,
            DirectKind::ReduceScatter => self.recv == self.send + (rank * self.part_bytes) as u64,
            DirectKind::AllReduce => self.send == self.recv,
        }
    }
}

/// What every path on the peers' buffers asks of a call besides its own rules (each path's
/// `wanted`): the path is `on` for it, 2 to `MAX_RANKS` ranks, not a pre-multiplied sum (the
/// workspace kernels apply the scalar), not empty, and at least the path's `min` bytes.
pub(crate) fn eligible(on: bool, min: usize, part_bytes: usize, nranks: usize, premul: bool) -> bool {
    on && (2..=MAX_RANKS).contains(&nranks) && !premul && part_bytes != 0 && part_bytes >= min
}

/// Every rank's (send, recv) buffers as this rank addresses them (its own at `rank`, the
/// peers' mapped), or `None` when some rank cannot share, map, or (`usable` false on it) use
/// its buffers for this path: then no rank takes it. Collective: every rank calls it for the
/// same call. `path` names the path in errors and logs.
pub(crate) fn exchange(cx: &DirectContext, call: &DirectCall, usable: bool, path: &str) -> Result<Option<Vec<(u64, u64)>>> {
    let (n, me) = (cx.nranks, cx.rank);
    let (send_len, recv_len) = call.kind.buffer_bytes(n, call.part_bytes);
    // 1. Addresses and keys, from every rank.
    // Exporting and mapping are "potentially unsafe" calls under a stream capture in the
    // default global mode (they would invalidate it): relaxed for this thread meanwhile.
    use crate::cuda::with_relaxed_capture as relaxed;
    let shared = match usable {
        false => Err(Error::invalid_param("the buffers do not suit this path")),
        true => relaxed(|| -> Result<Shared> {
            let key = |addr: u64| -> Result<Vec<u8>> {
                let ptr = memory::device_ptr(addr as usize)?.ok_or_else(|| Error::invalid_param("not GPU memory"))?;
                Ok(ipc::export(addr as usize, ptr)?.encode())
            };
            Ok(Shared { send: call.send, send_key: key(call.send)?, recv: call.recv, recv_key: key(call.recv)? })
        }),
    };
    if let Err(e) = &shared {
        tracing::debug!(target: "gsc::coll", error = %e, path, "this rank's buffers cannot be shared; every rank runs the workspace kernels");
    }
    let all = cx.allgather(&encode_shared(shared.as_ref().ok())).map_err(|e| e.context(format!("exchanging buffers for {path}")))?;
    let all = all.iter().map(|b| decode_shared(b)).collect::<Result<Vec<_>>>()?;
    if all.iter().any(Option::is_none) {
        return Ok(None);
    }
    let all: Vec<Shared> = all.into_iter().map(|s| s.expect("checked above")).collect();
    // 2. Every peer's buffers mapped here; whether every rank managed, from every rank.
    let map = |addr: u64, key: &[u8], len: usize| ipc::map_peer(&ipc::DeviceKey::decode(key)?, addr, len, cx.device);
    let mut bufs = vec![(0u64, 0u64); n];
    let mapped = relaxed(|| {
        (0..n).filter(|&q| q != me).try_for_each(|q| -> Result<()> {
            bufs[q] = (map(all[q].send, &all[q].send_key, send_len)?, map(all[q].recv, &all[q].recv_key, recv_len)?);
            Ok(())
        })
    });
    if let Err(e) = &mapped {
        tracing::debug!(target: "gsc::coll", error = %e, path, "a peer's buffer cannot be mapped here; every rank runs the workspace kernels");
    }
    bufs[me] = (call.send, call.recv);
    let verdicts = cx.allgather(&[u8::from(mapped.is_ok())]).map_err(|e| e.context(format!("agreeing on {path}")))?;
    if verdicts.iter().any(|v| v.as_slice() != [1]) {
        return Ok(None);
    }
    Ok(Some(bufs))
}

/// Every rank's `len` bytes at `addr` — a buffer of the communicator's own, such as scratch —
/// as this rank addresses them (its own at `rank`), or `None` when some rank cannot share or
/// map it, or has none (`usable` false: `addr` is not looked at). Collective, like `exchange`,
/// which does the work: the buffer stands for both halves of an all-reduce's entry (the second
/// mapping of one allocation is a cache hit).
pub(crate) fn exchange_buffer(cx: &DirectContext, addr: u64, len: usize, usable: bool, path: &str) -> Result<Option<Vec<u64>>> {
    let call = DirectCall { kind: DirectKind::AllReduce, send: addr, recv: addr, part_bytes: len, dtype: DataType::Int8, op: RedOp::Sum };
    Ok(exchange(cx, &call, usable, path)?.map(|bufs| bufs.into_iter().map(|(at, _)| at).collect()))
}

/// What a rank tells the others about its buffers: whether it can share them, their addresses
/// and the keys that open them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shared {
    pub(crate) send: u64,
    pub(crate) send_key: Vec<u8>,
    pub(crate) recv: u64,
    pub(crate) recv_key: Vec<u8>,
}

/// The largest key `ipc` makes is far below this; a longer one is a corrupt entry.
const MAX_KEY: usize = 1024;

/// `None`: this rank cannot share its buffers (every rank then falls back).
pub(crate) fn encode_shared(s: Option<&Shared>) -> Vec<u8> {
    let Some(s) = s else { return vec![0] };
    let mut v = vec![1];
    for (addr, key) in [(s.send, &s.send_key), (s.recv, &s.recv_key)] {
        v.extend_from_slice(&addr.to_le_bytes());
        v.extend_from_slice(&(key.len() as u32).to_le_bytes());
        v.extend_from_slice(key);
    }
    v
}

/// The inverse of `encode_shared`; a malformed entry is an error naming what is wrong.
pub(crate) fn decode_shared(b: &[u8]) -> Result<Option<Shared>> {
    let bad = |what: &str| Error::new(Status::ConnectionReset, format!("a peer buffer entry {what}"));
    match b.first() {
        Some(0) if b.len() == 1 => return Ok(None),
        Some(1) => {}
        _ => return Err(bad("with an unknown flag or trailing bytes")),
    }
    let mut at = 1;
    let mut take = |n: usize| -> Result<&[u8]> {
        let s = b.get(at..at + n).ok_or_else(|| bad("cut short"))?;
        at += n;
        Ok(s)
    };
    let mut half = || -> Result<(u64, Vec<u8>)> {
        let addr = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
        if len > MAX_KEY {
            return Err(bad("with an oversized key"));
        }
        Ok((addr, take(len)?.to_vec()))
    };
    let (send, send_key) = half()?;
    let (recv, recv_key) = half()?;
    if at != b.len() {
        return Err(bad("with trailing bytes"));
    }
    Ok(Some(Shared { send, send_key, recv, recv_key }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_entries_round_trip_and_malformed_ones_are_named() {
        let s = Shared { send: 0x7000, send_key: vec![1; 88], recv: 0x9000, recv_key: vec![2; 120] };
        assert_eq!(decode_shared(&encode_shared(Some(&s))).unwrap(), Some(s.clone()));
        assert_eq!(decode_shared(&encode_shared(None)).unwrap(), None);
        let good = encode_shared(Some(&s));
        for bad in [vec![], vec![2], vec![0, 0], good[..good.len() - 1].to_vec(), [good.clone(), vec![0]].concat()] {
            let e = decode_shared(&bad).unwrap_err().to_string();
            assert!(e.contains("peer buffer entry"), "{e}");
        }
        let mut huge = vec![1];
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&(u32::MAX).to_le_bytes());
        assert!(decode_shared(&huge).unwrap_err().to_string().contains("oversized"));
    }
}

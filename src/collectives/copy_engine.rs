//! Large all-gather, reduce-scatter and all-reduce by the copy engines (`GSC_COLL_CE`).
//!
//! Every rank *pulls*: its copy engines read the peers' parts straight out of the peers' own
//! buffers (mapped through CUDA IPC, or VMM file descriptors for `mem_alloc` memory) into its
//! own buffers or scratch, one side stream per peer so the copies run on several engines at
//! once; a reduction kernel adds up what was pulled; barriers in the communicator's workspace
//! (`gsc_coll_barrier`) separate the phases. Pulling rather than pushing means a rank only ever
//! writes its own memory: a peer that never arrives at a barrier (dead, stopped) costs a
//! timeout and an error, never a write into a buffer that peer still uses.
//!
//! - all-gather: barrier · pull every peer's part into its place · barrier
//! - reduce-scatter: barrier · pull our part of every peer's input into scratch · reduce (own
//!   part and the pulled ones, in rank order) into the receive buffer · barrier
//! - all-reduce: the reduce-scatter on shard `rank` of the buffer, into the receive buffer ·
//!   barrier · the all-gather of the reduced shards, in place · barrier
//!
//! A barrier is passed once every rank reached it, so what precedes it on every rank's stream
//! is done: after the first, every peer's input is there to read and its receive buffer free to
//! change; after the last, no peer reads our buffers any more. `plan` writes these steps down
//! as data (unit-tested: every byte written once, no rank writes memory a peer reads in the
//! same phase, in place or not); `CopyEngine::try_run` issues them.
//!
//! The buffers' addresses and keys are exchanged through the bootstrap during the call, which
//! costs a host round trip: with `GSC_COLL_CE=auto` this happens only when the call is being
//! captured (once per capture; every replay pulls from the same buffers, the "registration by
//! graph capture" of NCCL), and only where the copy engines measured faster than the kernels
//! on H200s (docs/PERF.md, session 17): all-gathers, and all-reduces between two ranks. When
//! four GPUs copy at once the engines move only ~200–220 GB/s per GPU, against ~383 for one GPU
//! copying alone (docs/probes/ce_allgather.py), so on four the reduce-scatter and the 128 MiB
//! all-reduce stay with the kernels. `on` takes all three, eager calls too. A rank that cannot share or map a buffer makes every rank fall back
//! to the kernels — decided from what all ranks report, so they all take the same path.

use super::types::{DataType, RedOp};
use crate::bootstrap::Bootstrap;
use crate::config::Tristate;
use crate::cuda::coll::{CollKind, NetReduceArgs, Workspace, launch_net_reduce, stream_copy};
use crate::cuda::lanes::{GrowingScratch, Lanes};
use crate::cuda::{ipc, memory};
use crate::error::{Error, Result, Status};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Which of our buffers a step reads or writes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Buf {
    Send,
    Recv,
    Scratch,
}

/// Copy `bytes` from peer `from`'s buffer `src` at `src_off` into our `dst` at `dst_off`
/// (`from` may be this rank: a local copy).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pull {
    pub(crate) from: usize,
    pub(crate) src: Buf,
    pub(crate) src_off: usize,
    pub(crate) dst: Buf,
    pub(crate) dst_off: usize,
    pub(crate) bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Barrier,
    /// Copies that run side by side.
    Pulls(Vec<Pull>),
    /// Our `bytes` of send at `own_off` and the peers' copies in scratch (in rank order without
    /// us, `bytes` apart) reduced into recv at `out_off`.
    Reduce {
        own_off: usize,
        out_off: usize,
        bytes: usize,
    },
}

/// The collectives the copy engines run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum CeKind {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl CeKind {
    /// (send, recv) bytes of a call with `part` bytes per part on `n` ranks.
    pub(crate) fn buffer_bytes(self, n: usize, part: usize) -> (usize, usize) {
        match self {
            CeKind::AllGather => (part, n * part),
            CeKind::ReduceScatter => (n * part, part),
            CeKind::AllReduce => (part, part),
        }
    }

    /// Scratch bytes the call pulls into.
    pub(crate) fn scratch_bytes(self, n: usize, part: usize) -> usize {
        match self {
            CeKind::AllGather => 0,
            CeKind::ReduceScatter => (n - 1) * part,
            CeKind::AllReduce => (n - 1) * (part / n),
        }
    }
}

/// Whether a call goes to the copy engines: a function of the configuration, the call and
/// whether it is being captured, so every rank decides alike when they capture alike.
/// `part_bytes`: as `Call::part_bytes` (an all-reduce's whole buffer).
#[allow(clippy::too_many_arguments)]
pub(crate) fn wanted(
    mode: Tristate,
    min: usize,
    kind: CollKind,
    part_bytes: usize,
    nranks: usize,
    elem: usize,
    premul: bool,
    capturing: bool,
) -> Option<CeKind> {
    let on = match mode {
        Tristate::Off => false,
        Tristate::On => true,
        // Where the copy engines measured faster than the kernels (docs/PERF.md, session 17):
        // all-gather, and all-reduce between two ranks. On four, reduce-scatter and the 128 MiB
        // all-reduce were slower.
        Tristate::Auto => capturing && (kind == CollKind::AllGather || (kind == CollKind::AllReduce && nranks == 2)),
    };
    if !on || nranks < 2 || premul || part_bytes == 0 || part_bytes < min {
        return None;
    }
    match kind {
        CollKind::AllGather => Some(CeKind::AllGather),
        CollKind::ReduceScatter => Some(CeKind::ReduceScatter),
        // Shards of whole elements, the same size on every rank.
        CollKind::AllReduce if part_bytes.is_multiple_of(nranks * elem) => Some(CeKind::AllReduce),
        _ => None,
    }
}

/// The steps of `kind` for `rank` of `n`, parts of `part` bytes (an all-reduce: the whole
/// buffer, a multiple of `n` elements); `in_place`: the call's send buffer is its part of the
/// receive buffer (all-gather), or the receive buffer is its part of the send buffer
/// (reduce-scatter), or both are one (all-reduce).
pub(crate) fn plan(kind: CeKind, rank: usize, n: usize, part: usize, in_place: bool) -> Vec<Step> {
    let peers = || (0..n).filter(move |&q| q != rank);
    // Where peer q's copy goes in scratch: rank order without us (the reduction kernel's layout).
    let slot = |q: usize| q - usize::from(q > rank);
    // Every peer's `bytes` of its send buffer at `src_off` into its scratch slot.
    let into_scratch = |src_off: usize, bytes: usize| -> Vec<Pull> {
        peers().map(|q| Pull { from: q, src: Buf::Send, src_off, dst: Buf::Scratch, dst_off: slot(q) * bytes, bytes }).collect()
    };
    match kind {
        CeKind::AllGather => {
            let mut pulls: Vec<Pull> =
                peers().map(|q| Pull { from: q, src: Buf::Send, src_off: 0, dst: Buf::Recv, dst_off: q * part, bytes: part }).collect();
            if !in_place {
                pulls.push(Pull { from: rank, src: Buf::Send, src_off: 0, dst: Buf::Recv, dst_off: rank * part, bytes: part });
            }
            vec![Step::Barrier, Step::Pulls(pulls), Step::Barrier]
        }
        CeKind::ReduceScatter => vec![
            Step::Barrier,
            Step::Pulls(into_scratch(rank * part, part)),
            Step::Reduce { own_off: rank * part, out_off: 0, bytes: part },
            Step::Barrier,
        ],
        CeKind::AllReduce => {
            let shard = part / n;
            let gather_pulls =
                peers().map(|q| Pull { from: q, src: Buf::Recv, src_off: q * shard, dst: Buf::Recv, dst_off: q * shard, bytes: shard });
            vec![
                Step::Barrier,
                Step::Pulls(into_scratch(rank * shard, shard)),
                Step::Reduce { own_off: rank * shard, out_off: rank * shard, bytes: shard },
                Step::Barrier,
                Step::Pulls(gather_pulls.collect()),
                Step::Barrier,
            ]
        }
    }
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
    let bad = |what: &str| Error::new(Status::ConnectionReset, format!("a copy-engine buffer entry {what}"));
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

/// What one call needs from its communicator.
pub(crate) struct CeContext<'a> {
    pub(crate) workspace: &'a Workspace,
    pub(crate) bootstrap: &'a Bootstrap,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) device: i32,
    pub(crate) kernel_cache: Option<&'a Path>,
    pub(crate) timeout_ns: u64,
}

/// One call: `part_bytes` as in `plan`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct CeCall {
    pub(crate) kind: CeKind,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) part_bytes: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: RedOp,
}

impl CeCall {
    fn in_place(&self, rank: usize) -> bool {
        match self.kind {
            CeKind::AllGather => self.send == self.recv + (rank * self.part_bytes) as u64,
            CeKind::ReduceScatter => self.recv == self.send + (rank * self.part_bytes) as u64,
            CeKind::AllReduce => self.send == self.recv,
        }
    }
}

/// A communicator's copy-engine state: side streams (made at the first call) and scratch.
pub(crate) struct CopyEngine {
    state: Mutex<CeState>,
    /// Calls run here so far (tests and benchmarks check the path was taken).
    runs: AtomicU64,
}

struct CeState {
    lanes: Option<Lanes>,
    scratch: GrowingScratch,
}

impl CopyEngine {
    pub(crate) fn new(device: i32) -> CopyEngine {
        CopyEngine { state: Mutex::new(CeState { lanes: None, scratch: GrowingScratch::new(device) }), runs: AtomicU64::new(0) }
    }

    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// Run `call` on `stream` by the copy engines. `Ok(false)`: some rank cannot share or map
    /// the buffers, every rank learnt it, nothing was issued — run the kernels instead.
    /// Collective: every rank whose `wanted` said yes calls it.
    ///
    /// # Safety
    /// The call's buffers are GPU memory of this rank's device, valid for the call's sizes until
    /// the work completed on `stream`.
    pub(crate) unsafe fn try_run(&self, cx: &CeContext, call: &CeCall, stream: usize) -> Result<bool> {
        let (n, me) = (cx.nranks, cx.rank);
        let (send_len, recv_len) = call.kind.buffer_bytes(n, call.part_bytes);
        // 1. Addresses and keys, from every rank.
        // Exporting and mapping are "potentially unsafe" calls under a stream capture in the
        // default global mode (they would invalidate it): relaxed for this thread meanwhile.
        use crate::cuda::with_relaxed_capture as relaxed;
        let shared = relaxed(|| -> Result<Shared> {
            let key = |addr: u64| -> Result<Vec<u8>> {
                let ptr = memory::device_ptr(addr as usize)?.ok_or_else(|| Error::invalid_param("not GPU memory"))?;
                Ok(ipc::export(addr as usize, ptr)?.encode())
            };
            Ok(Shared { send: call.send, send_key: key(call.send)?, recv: call.recv, recv_key: key(call.recv)? })
        });
        if let Err(e) = &shared {
            tracing::debug!(target: "gsc::coll", error = %e, "copy engines: this rank's buffers cannot be shared; every rank runs the kernels");
        }
        let all = cx
            .bootstrap
            .allgather(&encode_shared(shared.as_ref().ok()))
            .map_err(|e| e.context("exchanging buffers for the copy engines"))?;
        let all = all.iter().map(|b| decode_shared(b)).collect::<Result<Vec<_>>>()?;
        if all.iter().any(Option::is_none) {
            return Ok(false);
        }
        let all: Vec<Shared> = all.into_iter().map(|s| s.expect("checked above")).collect();
        // 2. Every peer's buffers mapped here; whether every rank managed, from every rank.
        let map = |q: usize, buf: Buf| -> Result<u64> {
            let (addr, key, len) = match buf {
                Buf::Send => (all[q].send, &all[q].send_key, send_len),
                _ => (all[q].recv, &all[q].recv_key, recv_len),
            };
            ipc::map_peer(&ipc::DeviceKey::decode(key)?, addr, len, cx.device)
        };
        let mut peer_bufs = vec![(0u64, 0u64); n];
        let mapped = relaxed(|| {
            (0..n).filter(|&q| q != me).try_for_each(|q| -> Result<()> {
                peer_bufs[q] = (map(q, Buf::Send)?, map(q, Buf::Recv)?);
                Ok(())
            })
        });
        if let Err(e) = &mapped {
            tracing::debug!(target: "gsc::coll", error = %e, "copy engines: a peer's buffer cannot be mapped here; every rank runs the kernels");
        }
        peer_bufs[me] = (call.send, call.recv);
        let verdicts = cx.bootstrap.allgather(&[u8::from(mapped.is_ok())]).map_err(|e| e.context("agreeing on the copy engines"))?;
        if verdicts.iter().any(|v| v.as_slice() != [1]) {
            return Ok(false);
        }
        // 3. The steps, on the caller's stream and the side streams.
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.lanes.as_ref().is_none_or(|l| l.len() < n - 1) {
            st.lanes = Some(relaxed(|| Lanes::new(cx.device, n - 1))?);
        }
        let scratch = match call.kind.scratch_bytes(n, call.part_bytes) {
            0 => 0,
            bytes => st.scratch.at_least(bytes)?,
        };
        let lanes = st.lanes.as_ref().expect("made above");
        let local = |buf: Buf| match buf {
            Buf::Send => call.send,
            Buf::Recv => call.recv,
            Buf::Scratch => scratch,
        };
        for step in plan(call.kind, me, n, call.part_bytes, call.in_place(me)) {
            match step {
                Step::Barrier => cx.workspace.launch_barrier(stream, cx.kernel_cache, n, me, cx.timeout_ns)?,
                Step::Pulls(pulls) => {
                    lanes.fork(stream)?;
                    for (i, p) in pulls.iter().enumerate() {
                        let src = match p.src {
                            Buf::Send => peer_bufs[p.from].0,
                            _ => peer_bufs[p.from].1,
                        } + p.src_off as u64;
                        let dst = local(p.dst) + p.dst_off as u64;
                        // A local copy runs on the caller's stream, beside the side streams.
                        let on = if p.from == me { stream } else { lanes.stream(i % lanes.len()) };
                        // SAFETY: mapped peer buffers and our own, each `bytes` long at these
                        // offsets (`plan`, checked against the buffers' sizes by its tests);
                        // the barriers keep them valid and unchanged while the copy runs.
                        unsafe { stream_copy(cx.device, on, dst, src, p.bytes) }?;
                    }
                    lanes.join(stream)?;
                }
                Step::Reduce { own_off, out_off, bytes } => {
                    let elem = call.dtype.size();
                    let args = NetReduceArgs {
                        own: call.send + own_off as u64,
                        copies: scratch,
                        stride: bytes as u64,
                        out: call.recv + out_off as u64,
                        count: (bytes / elem) as u64,
                        n: n as u64,
                        me: me as u64,
                        divisor: if call.op == RedOp::Avg { n as u64 } else { 0 },
                    };
                    let op_tag = if call.op == RedOp::Avg { RedOp::Sum.kernel_tag() } else { call.op.kernel_tag() };
                    launch_net_reduce(cx.device, stream, call.dtype.kernel_tag(), op_tag, cx.kernel_cache, args)?;
                }
            }
        }
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's memory as one line of bytes: send at 0, recv after it (or aliased into send
    /// in place), scratch after both. Returns (buffer, offset) -> address for `rank`.
    fn layout(kind: CeKind, rank: usize, n: usize, part: usize, in_place: bool) -> impl Fn(Buf, usize) -> usize {
        let (send_len, _) = kind.buffer_bytes(n, part);
        let send_base = 1 << 30;
        let recv_base = match (in_place, kind) {
            (false, _) => send_base + send_len,
            // The send buffer is our part of the receive buffer.
            (true, CeKind::AllGather) => send_base - rank * part,
            // The receive buffer is our part of the send buffer.
            (true, CeKind::ReduceScatter) => send_base + rank * part,
            (true, CeKind::AllReduce) => send_base,
        };
        let scratch_base = 1 << 40;
        move |buf, off| match buf {
            Buf::Send => send_base + off,
            Buf::Recv => recv_base + off,
            Buf::Scratch => scratch_base + off,
        }
    }

    fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
        a.0 < b.0 + b.1 && b.0 < a.0 + a.1
    }

    #[test]
    fn every_byte_is_written_once_and_no_phase_writes_what_a_peer_reads() {
        for kind in [CeKind::AllGather, CeKind::ReduceScatter, CeKind::AllReduce] {
            for n in 2..=8 {
                let part = 16 * n * 3;
                for in_place in [false, true] {
                    let plans: Vec<Vec<Step>> = (0..n).map(|r| plan(kind, r, n, part, in_place)).collect();
                    let phases = plans[0].iter().filter(|s| **s == Step::Barrier).count();
                    assert!(plans.iter().all(|p| p.iter().filter(|s| **s == Step::Barrier).count() == phases));
                    assert_eq!(plans[0].first(), Some(&Step::Barrier), "{kind:?}: peers' buffers are read only after a barrier");
                    assert_eq!(plans[0].last(), Some(&Step::Barrier), "{kind:?}: no rank returns while a peer still reads it");
                    let (send_len, recv_len) = kind.buffer_bytes(n, part);
                    for rank in 0..n {
                        let mut written = vec![0u32; recv_len];
                        let mut note = |buf: Buf, off: usize, bytes: usize| {
                            if buf == Buf::Recv {
                                assert!(off + bytes <= recv_len, "{kind:?} {n} {in_place}: past recv");
                                written[off..off + bytes].iter_mut().for_each(|w| *w += 1);
                            }
                        };
                        for step in &plans[rank] {
                            match step {
                                Step::Pulls(pulls) => pulls.iter().for_each(|p| {
                                    let len = match p.src {
                                        Buf::Send => send_len,
                                        _ => recv_len,
                                    };
                                    assert!(p.src_off + p.bytes <= len, "{kind:?}: a pull reads past the peer's buffer");
                                    if p.dst == Buf::Scratch {
                                        assert!(p.dst_off + p.bytes <= kind.scratch_bytes(n, part));
                                    }
                                    note(p.dst, p.dst_off, p.bytes)
                                }),
                                Step::Reduce { own_off, out_off, bytes } => {
                                    assert!(own_off + bytes <= send_len && (n - 1) * bytes <= kind.scratch_bytes(n, part));
                                    note(Buf::Recv, *out_off, *bytes)
                                }
                                Step::Barrier => {}
                            }
                        }
                        // In place the send part of an all-gather is already there.
                        let skip = if in_place && kind == CeKind::AllGather { rank * part..(rank + 1) * part } else { 0..0 };
                        for (i, w) in written.iter().enumerate() {
                            let want = u32::from(!skip.contains(&i));
                            assert_eq!(*w, want, "{kind:?} n={n} rank {rank} in_place={in_place}: byte {i} of recv");
                        }
                    }
                    // Per phase: no rank writes memory of its own that a peer reads in that phase
                    // (peers read only through pulls), nor memory it reads itself in a reduction.
                    for phase in 0..phases - 1 {
                        let steps_of = |r: usize| -> Vec<Step> {
                            let mut b = 0;
                            plans[r]
                                .iter()
                                .filter(|s| {
                                    if **s == Step::Barrier {
                                        b += 1;
                                        false
                                    } else {
                                        b == phase + 1
                                    }
                                })
                                .cloned()
                                .collect()
                        };
                        for owner in 0..n {
                            let at = layout(kind, owner, n, part, in_place);
                            let mut writes = Vec::new();
                            for s in steps_of(owner) {
                                match s {
                                    Step::Pulls(p) => writes.extend(p.iter().map(|p| (at(p.dst, p.dst_off), p.bytes))),
                                    Step::Reduce { out_off, bytes, .. } => writes.push((at(Buf::Recv, out_off), bytes)),
                                    Step::Barrier => {}
                                }
                            }
                            for reader in (0..n).filter(|&r| r != owner) {
                                for s in steps_of(reader) {
                                    if let Step::Pulls(p) = s {
                                        for p in p.iter().filter(|p| p.from == owner) {
                                            let read = (at(p.src, p.src_off), p.bytes);
                                            assert!(
                                                writes.iter().all(|w| !overlaps(*w, read)),
                                                "{kind:?} n={n} in_place={in_place} phase {phase}: rank {reader} reads what rank {owner} writes"
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn only_large_calls_of_the_right_kind_go_to_the_copy_engines() {
        let w = |mode, kind, bytes, premul, capturing| wanted(mode, 4 << 20, kind, bytes, 4, 4, premul, capturing);
        assert_eq!(w(Tristate::Auto, CollKind::AllGather, 8 << 20, false, true), Some(CeKind::AllGather));
        assert_eq!(w(Tristate::Auto, CollKind::AllGather, 8 << 20, false, false), None, "auto: captured calls only");
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 8 << 20, false, true), None, "auto: all-reduce between two ranks only");
        assert_eq!(
            wanted(Tristate::Auto, 4 << 20, CollKind::AllReduce, 8 << 20, 2, 4, false, true),
            Some(CeKind::AllReduce),
            "auto: all-reduce between two ranks"
        );
        assert_eq!(w(Tristate::Auto, CollKind::ReduceScatter, 8 << 20, false, true), None, "auto: no reduce-scatter");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, false, true), Some(CeKind::AllReduce));
        assert_eq!(w(Tristate::On, CollKind::ReduceScatter, 8 << 20, false, false), Some(CeKind::ReduceScatter));
        assert_eq!(w(Tristate::Off, CollKind::AllReduce, 8 << 20, false, true), None);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (4 << 20) - 16, false, false), None, "below the threshold");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (8 << 20) + 4, false, false), None, "shards of whole elements");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, true, false), None, "pre-multiplied sums run the kernels");
        assert_eq!(w(Tristate::On, CollKind::Broadcast, 8 << 20, false, false), None);
        assert_eq!(wanted(Tristate::On, 0, CollKind::AllGather, 64, 1, 4, false, false), None, "one rank");
    }

    #[test]
    fn shared_entries_round_trip_and_malformed_ones_are_named() {
        let s = Shared { send: 0x7000, send_key: vec![1; 88], recv: 0x9000, recv_key: vec![2; 120] };
        assert_eq!(decode_shared(&encode_shared(Some(&s))).unwrap(), Some(s.clone()));
        assert_eq!(decode_shared(&encode_shared(None)).unwrap(), None);
        let good = encode_shared(Some(&s));
        for bad in [vec![], vec![2], vec![0, 0], good[..good.len() - 1].to_vec(), [good.clone(), vec![0]].concat()] {
            let e = decode_shared(&bad).unwrap_err().to_string();
            assert!(e.contains("copy-engine buffer entry"), "{e}");
        }
        let mut huge = vec![1];
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&(u32::MAX).to_le_bytes());
        assert!(decode_shared(&huge).unwrap_err().to_string().contains("oversized"));
    }
}

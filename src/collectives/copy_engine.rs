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
//! The buffers' addresses and keys are exchanged through the bootstrap during the call
//! (`peer_buffers::exchange`, shared with the direct kernel), which costs a host round trip:
//! with `GSC_COLL_CE=auto` this happens only when the call is being captured (once per
//! capture; every replay pulls from the same buffers, the "registration by graph capture" of
//! NCCL), and only where the copy engines measured faster than the kernels on H200s
//! (docs/PERF.md, session 17): all-gathers, and all-reduces between two ranks. When four GPUs
//! copy at once the engines move only ~200–220 GB/s per GPU, against ~383 for one GPU copying
//! alone (docs/probes/ce_allgather.py), so on four the all-gather goes to the direct kernel
//! (`direct`, first) and the reduce-scatter and all-reduce to a ring of copy engines, one
//! copy to the next GPU at a time (`ce_ring`, before this path). `on` takes all three, eager
//! calls too.

use super::peer_buffers::{self, DirectCall, DirectContext, DirectKind};
use super::types::RedOp;
use crate::config::Tristate;
use crate::cuda::coll::{CollKind, NetReduceArgs, launch_net_reduce, stream_copy};
use crate::cuda::lanes::{GrowingScratch, Lanes};
use crate::error::Result;
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

/// Scratch bytes a call of `kind` pulls into (`part` as in `plan`).
pub(crate) fn scratch_bytes(kind: DirectKind, n: usize, part: usize) -> usize {
    match kind {
        DirectKind::AllGather => 0,
        DirectKind::ReduceScatter => (n - 1) * part,
        DirectKind::AllReduce => (n - 1) * (part / n),
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
) -> Option<DirectKind> {
    let on = match mode {
        Tristate::Off => false,
        Tristate::On => true,
        // Where the copy engines measured faster than the kernels: the all-gather of more than
        // two ranks (docs/PERF.md, session 17; on four, reduce-scatter and the 128 MiB
        // all-reduce were slower). Between two they lost to the phased and the direct kernel
        // at every size from 4 MiB parts, in graphs (session 32: all-gather of 4 MiB parts
        // 27.6 µs against 19.1, all-reduce of 4 MiB 46.0 against 20.4).
        Tristate::Auto => capturing && kind == CollKind::AllGather && nranks > 2,
    };
    if !peer_buffers::eligible(on, min, part_bytes, nranks, premul) {
        return None;
    }
    match kind {
        CollKind::AllGather => Some(DirectKind::AllGather),
        CollKind::ReduceScatter => Some(DirectKind::ReduceScatter),
        // Shards of whole elements, the same size on every rank.
        CollKind::AllReduce if part_bytes.is_multiple_of(nranks * elem) => Some(DirectKind::AllReduce),
        _ => None,
    }
}

/// The steps of `kind` for `rank` of `n`, parts of `part` bytes (an all-reduce: the whole
/// buffer, a multiple of `n` elements); `in_place`: the call's send buffer is its part of the
/// receive buffer (all-gather), or the receive buffer is its part of the send buffer
/// (reduce-scatter), or both are one (all-reduce).
pub(crate) fn plan(kind: DirectKind, rank: usize, n: usize, part: usize, in_place: bool) -> Vec<Step> {
    let peers = || (0..n).filter(move |&q| q != rank);
    // Where peer q's copy goes in scratch: rank order without us (the reduction kernel's layout).
    let slot = |q: usize| q - usize::from(q > rank);
    // Every peer's `bytes` of its send buffer at `src_off` into its scratch slot.
    let into_scratch = |src_off: usize, bytes: usize| -> Vec<Pull> {
        peers().map(|q| Pull { from: q, src: Buf::Send, src_off, dst: Buf::Scratch, dst_off: slot(q) * bytes, bytes }).collect()
    };
    match kind {
        DirectKind::AllGather => {
            let mut pulls: Vec<Pull> =
                peers().map(|q| Pull { from: q, src: Buf::Send, src_off: 0, dst: Buf::Recv, dst_off: q * part, bytes: part }).collect();
            if !in_place {
                pulls.push(Pull { from: rank, src: Buf::Send, src_off: 0, dst: Buf::Recv, dst_off: rank * part, bytes: part });
            }
            vec![Step::Barrier, Step::Pulls(pulls), Step::Barrier]
        }
        DirectKind::ReduceScatter => vec![
            Step::Barrier,
            Step::Pulls(into_scratch(rank * part, part)),
            Step::Reduce { own_off: rank * part, out_off: 0, bytes: part },
            Step::Barrier,
        ],
        DirectKind::AllReduce => {
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
    /// Collective: every rank whose `wanted` said yes calls it. `known`: every rank's buffers,
    /// known without an exchange (symmetric windows, or every rank's call issued together).
    ///
    /// # Safety
    /// The call's buffers are GPU memory of this rank's device, valid for the call's sizes until
    /// the work completed on `stream`.
    pub(crate) unsafe fn try_run(
        &self,
        cx: &DirectContext,
        call: &DirectCall,
        stream: usize,
        known: Option<&[(u64, u64)]>,
    ) -> Result<bool> {
        let peer_bufs = match known {
            Some(bufs) => bufs.to_vec(),
            None => match peer_buffers::exchange(cx, call, true, "the copy engines")? {
                Some(bufs) => bufs,
                None => return Ok(false),
            },
        };
        // SAFETY: the caller's promise; `peer_bufs` every rank's buffers, mapped here.
        if let Err(e) = unsafe { self.issue(cx, call, stream, &peer_bufs) } {
            // Every peer issues its part and would wait for ours until the timeout; our round
            // counter is behind theirs now: this rank's collectives give up for good.
            cx.workspace.abort();
            return Err(e.context("issuing the copy engines' steps after every rank agreed to (this rank's collectives are now aborted)"));
        }
        Ok(true)
    }

    /// `try_run`'s steps, on the caller's stream and the side streams.
    ///
    /// # Safety
    /// As `try_run`; `peer_bufs[q]`: rank q's (send, recv) as this rank addresses them.
    unsafe fn issue(&self, cx: &DirectContext, call: &DirectCall, stream: usize, peer_bufs: &[(u64, u64)]) -> Result<()> {
        let (n, me) = (cx.nranks, cx.rank);
        use crate::cuda::with_relaxed_capture as relaxed;
        // The steps, on the caller's stream and the side streams.
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.lanes.as_ref().is_none_or(|l| l.len() < n - 1) {
            st.lanes = Some(relaxed(|| Lanes::new(cx.device, n - 1))?);
        }
        let scratch = match scratch_bytes(call.kind, n, call.part_bytes) {
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's memory as one line of bytes: send at 0, recv after it (or aliased into send
    /// in place), scratch after both. Returns (buffer, offset) -> address for `rank`.
    fn layout(kind: DirectKind, rank: usize, n: usize, part: usize, in_place: bool) -> impl Fn(Buf, usize) -> usize {
        let (send_len, _) = kind.buffer_bytes(n, part);
        let send_base = 1 << 30;
        let recv_base = match (in_place, kind) {
            (false, _) => send_base + send_len,
            // The send buffer is our part of the receive buffer.
            (true, DirectKind::AllGather) => send_base - rank * part,
            // The receive buffer is our part of the send buffer.
            (true, DirectKind::ReduceScatter) => send_base + rank * part,
            (true, DirectKind::AllReduce) => send_base,
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
        for kind in [DirectKind::AllGather, DirectKind::ReduceScatter, DirectKind::AllReduce] {
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
                                        assert!(p.dst_off + p.bytes <= scratch_bytes(kind, n, part));
                                    }
                                    note(p.dst, p.dst_off, p.bytes)
                                }),
                                Step::Reduce { own_off, out_off, bytes } => {
                                    assert!(own_off + bytes <= send_len && (n - 1) * bytes <= scratch_bytes(kind, n, part));
                                    note(Buf::Recv, *out_off, *bytes)
                                }
                                Step::Barrier => {}
                            }
                        }
                        // In place the send part of an all-gather is already there.
                        let skip = if in_place && kind == DirectKind::AllGather { rank * part..(rank + 1) * part } else { 0..0 };
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
        assert_eq!(w(Tristate::Auto, CollKind::AllGather, 8 << 20, false, true), Some(DirectKind::AllGather));
        assert_eq!(w(Tristate::Auto, CollKind::AllGather, 8 << 20, false, false), None, "auto: captured calls only");
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 8 << 20, false, true), None, "auto: no all-reduce");
        for kind in [CollKind::AllReduce, CollKind::AllGather] {
            assert_eq!(wanted(Tristate::Auto, 4 << 20, kind, 8 << 20, 2, 4, false, true), None, "auto: nothing between two ranks");
        }
        assert_eq!(w(Tristate::Auto, CollKind::ReduceScatter, 8 << 20, false, true), None, "auto: no reduce-scatter");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, false, true), Some(DirectKind::AllReduce));
        assert_eq!(w(Tristate::On, CollKind::ReduceScatter, 8 << 20, false, false), Some(DirectKind::ReduceScatter));
        assert_eq!(w(Tristate::Off, CollKind::AllReduce, 8 << 20, false, true), None);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (4 << 20) - 16, false, false), None, "below the threshold");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (8 << 20) + 4, false, false), None, "shards of whole elements");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, true, false), None, "pre-multiplied sums run the kernels");
        assert_eq!(w(Tristate::On, CollKind::Broadcast, 8 << 20, false, false), None);
        assert_eq!(wanted(Tristate::On, 0, CollKind::AllGather, 64, 1, 4, false, false), None, "one rank");
    }
}

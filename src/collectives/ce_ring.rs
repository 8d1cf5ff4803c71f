//! Large reduce-scatter and all-reduce by a ring of copy engines, the SMs only reducing
//! (`GSC_COLL_RING`).
//!
//! Through the NVSwitch of four H200s the copy engines move ~373 GB/s per GPU when each GPU
//! copies to the next one, but only ~200–220 when every GPU copies to every other, and SM
//! kernels reach ~337 (stores) or ~303–316 (loads) all-to-all (docs/PERF.md, session 21): a ring
//! of copies is the fastest way to move data between these GPUs. Rank d's engines copy into
//! rank d + 1's memory; nothing else crosses NVLink but flags.
//!
//! - reduce-scatter, step s = 0 .. n-2: rank d copies part (d - s - 1) mod n — its own input at
//!   step 0, afterwards the sum it made at step s - 1 — into slot s of the next rank's scratch;
//!   a reduction kernel there waits for the copy's flag and adds its own input of that part
//!   (into the slot, or at the last step into the receive buffer: part d is then complete);
//! - all-reduce: the reduce-scatter on shards, the last step's sums into the receive buffer's
//!   shard d, then the all-gather step t = 0 .. n-2: rank d copies shard (d - t) mod n of its
//!   receive buffer into the next rank's, once it has it (t = 0: its own reduction; later:
//!   a wait kernel for the flag of the copy that brought it).
//!
//! Each step is cut into `pieces`, so the copy of a piece overlaps the reduction of the
//! previous one; the copies of a rank run in order on a side stream (`Lanes`), the reductions
//! on the caller's stream, events order a copy after the reduction that made its data. A copy
//! raises the receiver's flag with a stream memop after it (the memop's system-wide barrier
//! makes the copy visible first); the kernel that consumed a flag clears it (`coll_ring`'s
//! source says why that is safe to replay). Every copy costs the engines a few microseconds
//! (docs/PERF.md, session 22), so few large pieces beat many small ones.
//!
//! A call starts with a barrier of every rank (`gsc_coll_barrier`), after which every rank's
//! buffers are in the call; no barrier ends it: a rank's call completes once its own copies
//! are done and every flag addressed to it arrived, i.e. once no peer writes its memory any
//! more, and no peer ever reads it. Unlike the pulling copy-engine path (`copy_engine`), a rank
//! writes into a peer's memory (scratch; an all-reduce's receive buffer), so a peer that gave up
//! on a call (timeout, abort) may still see this rank's copies land in its buffers after its
//! call failed; the failure marks every rank's error word, and the communicator's results are
//! undefined from then on, as for any collective that failed.
//!
//! Reductions run in ring order (part c: ranks c+1, c+2, …, c), not rank order: floating-point
//! sums may differ in their last bits from the other paths' (as NCCL's ring does), but every
//! rank of an all-reduce gets the same bits, since each part is reduced once and then copied.

use super::peer_buffers::{self, DirectCall, DirectContext, DirectKind};
use super::types::RedOp;
use crate::config::Tristate;
use crate::cuda::Grid;
use crate::cuda::coll::{CollArgs, CollKind, RING_PIECES_MAX, stream_copy};
use crate::cuda::coll_ring::{RING_THREADS, RingArgs};
use crate::cuda::lanes::{Events, GrowingScratch, Lanes};
use crate::error::Result;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// `auto` takes the ring from this many ranks: it measured ahead on four (docs/PERF.md,
/// session 22); two are better served by the direct kernel and the pulling copy engines.
const AUTO_MIN_RANKS: usize = 4;

/// `auto`'s smallest call (as `wanted`'s `part_bytes`: an all-reduce's whole buffer), from
/// docs/PERF.md, session 22 (four H200s, graphs): the all-reduce from 64 MiB, where the ring
/// (254.8 GB/s, 300.1 at 128 MiB) passed the workspace kernels (249.7; 32 MiB: 187.9 against
/// 238.4); the reduce-scatter from 32 MiB parts (128 MiB calls: 289.4 against the workspace
/// kernels' 201.2, NCCL 291.5).
pub(crate) fn auto_floor(kind: CollKind) -> usize {
    match kind {
        CollKind::AllReduce => 64 << 20,
        _ => 32 << 20,
    }
}

/// Blocks of a reduction, at most: a piece is reduced while the engines copy the next one, so
/// it needs to keep up with NVLink (~373 GB/s in, three times that in memory traffic), not to
/// take the whole GPU.
const REDUCE_BLOCKS_MAX: usize = 132;

/// Whether a call goes to the ring: a function of the configuration and the call, so every
/// rank decides alike (`replayed`: captured into a graph, as for the copy engines).
#[allow(clippy::too_many_arguments)]
pub(crate) fn wanted(
    mode: Tristate,
    min: usize,
    kind: CollKind,
    part_bytes: usize,
    nranks: usize,
    pieces: usize,
    premul: bool,
    replayed: bool,
) -> Option<DirectKind> {
    let on = match mode {
        Tristate::Off => false,
        Tristate::On => true,
        Tristate::Auto => replayed && nranks >= AUTO_MIN_RANKS && part_bytes >= auto_floor(kind),
    };
    if !peer_buffers::eligible(on, min, part_bytes, nranks, premul) {
        return None;
    }
    // Pieces of whole 16 bytes (the reduction's loads).
    match kind {
        CollKind::ReduceScatter if part_bytes.is_multiple_of(16 * pieces) => Some(DirectKind::ReduceScatter),
        CollKind::AllReduce if part_bytes.is_multiple_of(16 * pieces * nranks) => Some(DirectKind::AllReduce),
        _ => None,
    }
}

/// Every rank's (send, recv) and ring scratch, known without an exchange (`try_run`).
pub(crate) type RingKnown<'a> = (&'a [(u64, u64)], &'a [u64]);

/// Which of a rank's buffers, and where in it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Buf {
    Send,
    Recv,
    Scratch,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct At {
    pub(crate) buf: Buf,
    pub(crate) off: usize,
}

const fn at(buf: Buf, off: usize) -> At {
    At { buf, off }
}

/// What a copy waits for on its side stream.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Nothing more than the call's start.
    Start,
    /// Our reduction of this piece at reduce-scatter step `s` (an event).
    Reduced(usize),
    /// The previous rank's copy of this piece at all-gather step `t` (our flag, a wait kernel).
    Arrived(usize),
}

/// Copy `bytes` of our `from` into the next rank's `to`, after `gate`; then raise the next
/// rank's flag (the step's phase, step, piece).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) piece: usize,
    pub(crate) gate: Gate,
    pub(crate) from: At,
    pub(crate) to: At,
    pub(crate) bytes: usize,
}

/// Once our flag (reduce-scatter, this step, piece) is raised: out = acc (op) own, all ours.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reduce {
    pub(crate) piece: usize,
    pub(crate) acc: At,
    pub(crate) own: At,
    pub(crate) out: At,
    pub(crate) bytes: usize,
    /// The part is complete after this one (an average divides here).
    pub(crate) last: bool,
}

/// One step of the ring on one rank: `phase` 0 reduce-scatter, 1 all-gather.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) phase: usize,
    pub(crate) index: usize,
    pub(crate) copies: Vec<Copy>,
    pub(crate) reduces: Vec<Reduce>,
}

/// Scratch bytes of a call: a slot per reduce-scatter step, a part (all-reduce: shard) each.
pub(crate) fn scratch_bytes(kind: DirectKind, n: usize, part: usize) -> usize {
    match kind {
        DirectKind::ReduceScatter => (n - 1) * part,
        DirectKind::AllReduce => (n - 1) * (part / n),
        DirectKind::AllGather => 0,
    }
}

/// Rank `d`'s steps of a call of `kind` on `n` ranks, `part` bytes as in `DirectCall` (an
/// all-reduce: the whole buffer), each step cut into `pieces`. The copies go to rank d + 1.
/// In place or not, the offsets are the same: in place, the receive buffer is part d of the
/// send buffer (reduce-scatter) or the send buffer itself (all-reduce), and every element is
/// read before it is overwritten (the tests below follow every byte).
pub(crate) fn plan(kind: DirectKind, d: usize, n: usize, part: usize, pieces: usize) -> Vec<Step> {
    let chunk = match kind {
        DirectKind::AllReduce => part / n,
        _ => part,
    };
    let piece = chunk / pieces;
    let prev = |c: isize| (c.rem_euclid(n as isize)) as usize;
    let mut steps = Vec::new();
    if kind == DirectKind::AllGather {
        return steps;
    }
    for s in 0..n - 1 {
        let sent = prev(d as isize - s as isize - 1);
        let got = prev(d as isize - s as isize - 2);
        let last = s == n - 2;
        let copies = (0..pieces)
            .map(|k| {
                let (gate, from) = match s {
                    0 => (Gate::Start, at(Buf::Send, sent * chunk + k * piece)),
                    _ => (Gate::Reduced(s - 1), at(Buf::Scratch, (s - 1) * chunk + k * piece)),
                };
                Copy { piece: k, gate, from, to: at(Buf::Scratch, s * chunk + k * piece), bytes: piece }
            })
            .collect();
        let reduces = (0..pieces)
            .map(|k| {
                let acc = at(Buf::Scratch, s * chunk + k * piece);
                let out = match (last, kind) {
                    (false, _) => acc,
                    (true, DirectKind::AllReduce) => at(Buf::Recv, d * chunk + k * piece),
                    (true, _) => at(Buf::Recv, k * piece),
                };
                Reduce { piece: k, acc, own: at(Buf::Send, got * chunk + k * piece), out, bytes: piece, last }
            })
            .collect();
        steps.push(Step { phase: 0, index: s, copies, reduces });
    }
    if kind == DirectKind::AllReduce {
        for t in 0..n - 1 {
            let c = prev(d as isize - t as isize);
            let copies = (0..pieces)
                .map(|k| {
                    let gate = if t == 0 { Gate::Reduced(n - 2) } else { Gate::Arrived(t - 1) };
                    let off = c * chunk + k * piece;
                    Copy { piece: k, gate, from: at(Buf::Recv, off), to: at(Buf::Recv, off), bytes: piece }
                })
                .collect();
            steps.push(Step { phase: 1, index: t, copies, reduces: Vec::new() });
        }
    }
    steps
}

/// A communicator's ring state: the side stream, events and scratch (made at the first call).
pub(crate) struct Ring {
    pieces: usize,
    state: Mutex<RingState>,
    /// Calls run here so far (tests and benchmarks check the path was taken).
    runs: AtomicU64,
}

struct RingState {
    lanes: Option<Lanes>,
    events: Option<Events>,
    scratch: GrowingScratch,
}

impl Ring {
    pub(crate) fn new(device: i32, pieces: usize) -> Ring {
        let pieces = pieces.clamp(1, RING_PIECES_MAX);
        Ring {
            pieces,
            state: Mutex::new(RingState { lanes: None, events: None, scratch: GrowingScratch::new(device) }),
            runs: AtomicU64::new(0),
        }
    }

    pub(crate) fn pieces(&self) -> usize {
        self.pieces
    }

    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// The scratch a call of `kind` with `part` bytes (as `DirectCall`) uses, made now: what
    /// `try_run`'s `known` gives for this rank when every rank's call is issued together.
    pub(crate) fn scratch_for(&self, kind: DirectKind, n: usize, part: usize) -> Result<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.scratch.at_least(scratch_bytes(kind, n, part))
    }

    /// Run `call` on `stream` around the ring. `Ok(false)`: some rank cannot share or map its
    /// buffers or scratch, or load the kernels, or has buffers off 16 bytes (the reductions'
    /// loads); every rank learnt it and nothing was issued. Collective: every rank whose
    /// `wanted` said yes calls it. `known`: every rank's (send, recv) and scratch (made by
    /// `scratch_for`), known without an exchange (every rank's call issued together).
    ///
    /// # Safety
    /// The call's buffers are GPU memory of this rank's device, valid for the call's sizes until
    /// the work completed on `stream`.
    pub(crate) unsafe fn try_run(&self, cx: &DirectContext, call: &DirectCall, stream: usize, known: Option<RingKnown>) -> Result<bool> {
        let (n, me, k) = (cx.nranks, cx.rank, self.pieces);
        let ws = cx.workspace;
        let op_tag = if call.op == RedOp::Avg { RedOp::Sum.kernel_tag() } else { call.op.kernel_tag() };
        let name = format!("gsc_ring_reduce_{}_{op_tag}", call.dtype.kernel_tag());
        // What can fail on this rank alone, settled before the ranks agree.
        let kernels =
            ws.direct_kernel(&name, cx.kernel_cache, None).and_then(|r| Ok((r, ws.direct_kernel("gsc_ring_wait", cx.kernel_cache, None)?)));
        let scratch_len = scratch_bytes(call.kind, n, call.part_bytes);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let scratch = st.scratch.at_least(scratch_len);
        use crate::cuda::with_relaxed_capture as relaxed;
        if st.lanes.is_none() {
            st.lanes = relaxed(|| Lanes::new(cx.device, 1)).ok();
        }
        if st.events.as_ref().is_none_or(|e| e.len() < (n - 1) * k) {
            st.events = relaxed(|| Events::new(cx.device, (n - 1) * k)).ok();
        }
        let on_16 = |bufs: &[(u64, u64)]| bufs.iter().all(|&(send, recv)| send.is_multiple_of(16) && recv.is_multiple_of(16));
        let usable = kernels.is_ok() && scratch.is_ok() && st.lanes.is_some() && st.events.is_some();
        let (bufs, scratches, (reduce_k, wait_k)) = match known {
            // Every rank sees the same buffers, so every rank falls back alike.
            Some((bufs, _)) if !on_16(bufs) => return Ok(false),
            Some((bufs, scratches)) => {
                // No rank can tell the others this one cannot: its collectives give up.
                let ready = match (scratch, kernels) {
                    (Ok(at), Ok(k)) if usable && scratches.get(me) == Some(&at) => Ok(k),
                    (_, Err(e)) | (Err(e), _) => Err(e),
                    _ => Err(crate::error::Error::invalid_param("the ring's side stream, events or scratch are not ready")),
                };
                let k = ready.map_err(|e| {
                    cx.workspace.abort();
                    e.context("preparing the copy-engine ring for calls issued together (this rank's collectives are now aborted)")
                })?;
                (bufs.to_vec(), scratches.to_vec(), k)
            }
            None => {
                let usable = usable && on_16(&[(call.send, call.recv)]);
                let Some(bufs) = peer_buffers::exchange(cx, call, usable, "the copy-engine ring")? else {
                    return Ok(false);
                };
                let (scratch, kernels) = (scratch?, kernels?);
                let Some(scratches) = peer_buffers::exchange_buffer(cx, scratch, scratch_len, true, "the copy-engine ring's scratch")?
                else {
                    return Ok(false);
                };
                (bufs, scratches, kernels)
            }
        };
        let (lanes, events) = (st.lanes.as_ref().expect("usable"), st.events.as_ref().expect("usable"));
        let lane = lanes.stream(0);
        let next = (me + 1) % n;
        let addr = |rank: usize, a: At| {
            a.off as u64
                + match a.buf {
                    Buf::Send => bufs[rank].0,
                    Buf::Recv => bufs[rank].1,
                    Buf::Scratch => scratches[rank],
                }
        };
        let coll = CollArgs { nranks: n as u64, rank: me as u64, timeout_ns: cx.timeout_ns, ..Default::default() };
        let divisor = if call.op == RedOp::Avg { n as u64 } else { 0 };
        let issue = || -> Result<()> {
            ws.launch_barrier(stream, cx.kernel_cache, n, me, cx.timeout_ns)?;
            lanes.fork(stream)?;
            for step in plan(call.kind, me, n, call.part_bytes, k) {
                for c in &step.copies {
                    match c.gate {
                        Gate::Start => {}
                        Gate::Reduced(s) => events.wait(lane, s * k + c.piece)?,
                        Gate::Arrived(t) => {
                            let (flag, _) = ws.ring_flag(me, 1, t, c.piece);
                            ws.launch_ring(
                                lane,
                                wait_k,
                                RingArgs { coll, flag, nflags: 1, ..Default::default() },
                                Grid { blocks: 1, threads: 32 },
                            )?;
                        }
                    }
                    // SAFETY: our buffer and the next rank's, mapped, each `bytes` long at these
                    // offsets (`plan`, checked against the buffers by its tests); the barrier
                    // put both in this call, and the next rank's call ends only after the flag
                    // raised below.
                    unsafe { stream_copy(cx.device, lane, addr(next, c.to), addr(me, c.from), c.bytes) }?;
                    crate::cuda::enqueue_write_value(lane, ws.ring_flag(next, step.phase, step.index, c.piece).0, 1)?;
                }
                for r in &step.reduces {
                    let (flag, blocks_done) = ws.ring_flag(me, 0, step.index, r.piece);
                    let n16 = (r.bytes / 16) as u64;
                    let args = RingArgs {
                        coll,
                        flag,
                        nflags: 1,
                        blocks_done,
                        acc: addr(me, r.acc),
                        own: addr(me, r.own),
                        out: addr(me, r.out),
                        n16,
                        divisor: if r.last { divisor } else { 0 },
                    };
                    let blocks = (n16.div_ceil(u64::from(RING_THREADS)) as usize).clamp(1, REDUCE_BLOCKS_MAX) as u32;
                    ws.launch_ring(stream, reduce_k, args, Grid { blocks, threads: RING_THREADS })?;
                    events.record(step.index * k + r.piece, stream)?;
                }
            }
            lanes.join(stream)?;
            if call.kind == DirectKind::AllReduce {
                // Every piece of the last all-gather step has landed here: no peer writes our
                // buffers any more.
                let (flag, _) = ws.ring_flag(me, 1, n - 2, 0);
                ws.launch_ring(
                    stream,
                    wait_k,
                    RingArgs { coll, flag, nflags: k as u64, ..Default::default() },
                    Grid { blocks: 1, threads: 32 },
                )?;
            }
            Ok(())
        };
        if let Err(e) = issue() {
            // Our peers are in this call already: a partly issued one leaves us out of step.
            ws.abort();
            return Err(e.context("issuing the copy-engine ring after every rank agreed to (this rank's collectives are now aborted)"));
        }
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::coll::MAX_RANKS;

    /// Every rank's buffers as cells of 16 bytes, each holding the set of ranks whose input
    /// it sums (a bit each). Send at 0, recv after it or aliased into it (in place), scratch
    /// after both.
    struct Memory {
        cells: Vec<u32>,
        send_len: usize,
        recv: usize,
        scratch: usize,
    }

    impl Memory {
        fn new(kind: DirectKind, rank: usize, n: usize, part: usize, in_place: bool) -> Memory {
            let (send_len, recv_len) = kind.buffer_bytes(n, part);
            let recv = match (in_place, kind) {
                (false, _) => send_len,
                (true, DirectKind::ReduceScatter) => rank * part,
                (true, _) => 0,
            };
            let scratch = send_len + if in_place { 0 } else { recv_len };
            let mut cells = vec![0u32; (scratch + scratch_bytes(kind, n, part)) / 16];
            cells[..send_len / 16].iter_mut().for_each(|c| *c = 1 << rank);
            Memory { cells, send_len, recv, scratch }
        }

        fn cell(&self, a: At, kind: DirectKind, n: usize, part: usize, i: usize) -> usize {
            let (send_len, recv_len) = kind.buffer_bytes(n, part);
            let (base, len) = match a.buf {
                Buf::Send => (0, send_len),
                Buf::Recv => (self.recv, recv_len),
                Buf::Scratch => (self.scratch, scratch_bytes(kind, n, part)),
            };
            assert!(a.off + 16 * (i + 1) <= len, "{a:?} cell {i} is past the buffer");
            assert_eq!(self.send_len, send_len);
            (base + a.off) / 16 + i
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)] // step i of every rank's plan
    fn the_ring_brings_every_rank_every_input_once() {
        for kind in [DirectKind::ReduceScatter, DirectKind::AllReduce] {
            for n in 2..=MAX_RANKS {
                for pieces in [1, 2, 3] {
                    for in_place in [false, true] {
                        let part = 16 * pieces * n * 2;
                        let plans: Vec<Vec<Step>> = (0..n).map(|d| plan(kind, d, n, part, pieces)).collect();
                        let mut mem: Vec<Memory> = (0..n).map(|d| Memory::new(kind, d, n, part, in_place)).collect();
                        let what = format!("{kind:?} n={n} pieces={pieces} in_place={in_place}");
                        // Step by step, every rank's copies, then every rank's reductions: the
                        // order the gates and flags allow.
                        for i in 0..plans[0].len() {
                            for d in 0..n {
                                let q = (d + 1) % n;
                                for c in &plans[d][i].copies {
                                    assert_eq!(c.to.buf == Buf::Scratch, plans[d][i].phase == 0, "{what}");
                                    for j in 0..c.bytes / 16 {
                                        let v = mem[d].cells[mem[d].cell(c.from, kind, n, part, j)];
                                        let to = mem[q].cell(c.to, kind, n, part, j);
                                        mem[q].cells[to] = v;
                                    }
                                }
                            }
                            for (d, m) in mem.iter_mut().enumerate() {
                                for r in &plans[d][i].reduces {
                                    for j in 0..r.bytes / 16 {
                                        let (acc, own) =
                                            (m.cells[m.cell(r.acc, kind, n, part, j)], m.cells[m.cell(r.own, kind, n, part, j)]);
                                        assert_eq!(own, 1 << d, "{what}: rank {d} reduces an input it overwrote");
                                        assert_eq!(acc & own, 0, "{what}: rank {d}'s input twice in one sum");
                                        let out = m.cell(r.out, kind, n, part, j);
                                        m.cells[out] = acc | own;
                                    }
                                }
                            }
                        }
                        let all = (1u32 << n) - 1;
                        let (_, recv_len) = kind.buffer_bytes(n, part);
                        for (d, m) in mem.iter().enumerate() {
                            for j in 0..recv_len / 16 {
                                assert_eq!(m.cells[m.cell(at(Buf::Recv, 0), kind, n, part, j)], all, "{what}: rank {d}'s result cell {j}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_piece_is_gated_on_what_made_its_data() {
        let (n, pieces) = (4, 2);
        let steps = plan(DirectKind::AllReduce, 1, n, 16 * pieces * n, pieces);
        assert_eq!(steps.len(), 2 * (n - 1));
        assert!(steps[0].copies.iter().all(|c| c.gate == Gate::Start && c.from.buf == Buf::Send));
        assert!(steps[1].copies.iter().all(|c| c.gate == Gate::Reduced(0)));
        assert!(steps[3].copies.iter().all(|c| c.gate == Gate::Reduced(n - 2)), "the all-gather starts from the last reduction");
        assert!(steps[4].copies.iter().all(|c| c.gate == Gate::Arrived(0)));
        assert!(steps[2].reduces.iter().all(|r| r.last && r.out.buf == Buf::Recv));
        assert!(steps[..2].iter().all(|s| s.reduces.iter().all(|r| !r.last && r.out == r.acc)));
    }

    #[test]
    fn only_calls_that_cut_into_whole_pieces_go_around_the_ring() {
        let w = |mode, kind, bytes, n, replayed| wanted(mode, 1 << 20, kind, bytes, n, 2, false, replayed);
        assert_eq!(w(Tristate::Auto, CollKind::ReduceScatter, 32 << 20, 4, true), Some(DirectKind::ReduceScatter));
        assert_eq!(w(Tristate::Auto, CollKind::ReduceScatter, 16 << 20, 4, true), None, "auto: from 32 MiB parts");
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 64 << 20, 4, true), Some(DirectKind::AllReduce));
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 32 << 20, 4, true), None, "auto: all-reduces from 64 MiB");
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 64 << 20, 4, false), None, "auto: captured calls only");
        assert_eq!(w(Tristate::Auto, CollKind::AllReduce, 64 << 20, 2, true), None, "auto: four ranks and more");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 64 << 20, 2, false), Some(DirectKind::AllReduce));
        assert_eq!(w(Tristate::On, CollKind::AllGather, 64 << 20, 4, false), None);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (1 << 20) - 128, 4, false), None, "below the floor");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (64 << 20) + 64, 4, false), None, "pieces of whole 16 bytes");
        assert_eq!(w(Tristate::On, CollKind::ReduceScatter, (64 << 20) + 32, 4, false), Some(DirectKind::ReduceScatter));
        assert_eq!(w(Tristate::On, CollKind::ReduceScatter, (64 << 20) + 16, 4, false), None);
        assert_eq!(w(Tristate::Off, CollKind::AllReduce, 64 << 20, 4, true), None);
        assert_eq!(wanted(Tristate::On, 0, CollKind::AllReduce, 64 << 20, 4, 2, true, false), None, "pre-multiplied sums run the kernels");
        assert_eq!(wanted(Tristate::On, 0, CollKind::AllReduce, 1 << 20, 1, 2, false, false), None, "one rank");
    }
}

//! Large all-gather, reduce-scatter and all-reduce by one SM kernel working on the peers' own
//! buffers (`GSC_COLL_SM`; the kernel is `cuda::coll_direct`).
//!
//! The workspace kernels (phased, pipelined) copy every byte into a peer's workspace, wait for
//! a flag and copy it out again, in rounds, with NVLink idle while the flags travel. With the
//! peers' buffers mapped (`peer_buffers::exchange`), one launch can do the whole call with
//! two meetings of the ranks, at its start and its end, and NVLink busy in between:
//!
//! - all-gather: each rank writes its part into every rank's receive buffer (push: stores
//!   measured faster than loads over NVLink, docs/PERF.md session 13's copy-kernel probe);
//! - reduce-scatter: each rank reads its part of every rank's send buffer, reduces them in rank
//!   order and writes its receive buffer;
//! - all-reduce ("two-shot" fused): each rank reads its shard of every rank's send buffer,
//!   reduces them and writes the sum into that shard of every rank's receive buffer.
//!
//! Each byte of a receive buffer is written by exactly one rank, and no rank writes memory any
//! rank reads in the same launch, in place or not (`job`'s tests check both on a model of the
//! ranks' memory). `auto` takes this path between two ranks, and all-gathers of up to four,
//! from the sizes where it measured faster (`auto_floor`).

use super::peer_buffers::{self, DirectCall, DirectContext, DirectKind};
use crate::config::Tristate;
use crate::cuda::Grid;
use crate::cuda::coll::{CollArgs, CollKind};
use crate::cuda::coll_direct::{DIRECT_THREADS, DirectArgs};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether a call goes to the direct kernel: a function of the configuration and the call, so
/// every rank decides alike. `part_bytes`: as `Call::part_bytes` (an all-reduce's whole buffer);
/// `replayed`: the call is captured into a graph or added to one (its buffers are exchanged
/// once, when the graph is built, instead of at every call).
pub(crate) fn wanted(
    mode: Tristate,
    min: usize,
    kind: CollKind,
    part_bytes: usize,
    nranks: usize,
    premul: bool,
    replayed: bool,
) -> Option<DirectKind> {
    let on = match mode {
        Tristate::Off => false,
        Tristate::On => true,
        // Two ranks: every kind; up to four: the all-gather, ahead of NCCL and of every other
        // path from a 1 MiB call on four H200s (docs/PERF.md, session 22), where the
        // reduce-scatter and all-reduce lose to the copy-engine ring (`ce_ring`).
        Tristate::Auto => {
            (nranks == 2 || (kind == CollKind::AllGather && nranks <= AUTO_MAX_GATHER_RANKS))
                && part_bytes >= auto_floor(kind, replayed, nranks)
        }
    };
    if !peer_buffers::eligible(on, min, part_bytes, nranks, premul) {
        return None;
    }
    // The kernel moves whole 16-byte pieces.
    match kind {
        CollKind::AllGather if part_bytes.is_multiple_of(16) => Some(DirectKind::AllGather),
        CollKind::ReduceScatter if part_bytes.is_multiple_of(16) => Some(DirectKind::ReduceScatter),
        CollKind::AllReduce if part_bytes.is_multiple_of(16 * nranks) => Some(DirectKind::AllReduce),
        _ => None,
    }
}

/// The most ranks `auto` gives an all-gather to the direct kernel: measured on four.
const AUTO_MAX_GATHER_RANKS: usize = 4;

/// `auto`'s smallest call (as `wanted`'s `part_bytes`) where the direct kernel measured ahead
/// of NCCL and of every other path, on `nranks` H200s.
///
/// Two ranks (docs/PERF.md, session 32, against the phased kernel at 512 threads per block): the
/// all-reduce from 1 MiB replayed from a graph and from 16 MiB on a stream, the all-gather from
/// 8 MiB parts and the reduce-scatter from 16 MiB parts either way. Below these the phased
/// kernel won (all-gather of 4 MiB parts in graphs: 19.1 µs against 20.2; reduce-scatter of
/// 8 MiB parts: 32.8 against 34.4). A stream call exchanges its buffers twice, on the
/// shared-memory board (`host_board`), which is why the all-reduce's floors differ; a call on
/// symmetric windows (`windows`) exchanges nothing, and still the workspace kernels tied or won
/// below the stream floors (session 29): they hold for it too.
///
/// Up to four ranks, the all-gather (session 22, against the phased kernel at 256 threads):
/// replayed from 512 KiB parts, on a stream from 8 MiB.
pub(crate) fn auto_floor(kind: CollKind, replayed: bool, nranks: usize) -> usize {
    const MIB: usize = 1 << 20;
    match (kind, nranks) {
        (CollKind::AllReduce, _) if replayed => MIB,
        (CollKind::AllReduce, _) => 16 * MIB,
        (CollKind::ReduceScatter, _) => 16 * MIB,
        (_, 2) => 8 * MIB,
        _ if replayed => MIB / 2,
        _ => 8 * MIB,
    }
}

/// The offset from 16 bytes every buffer of `bufs` (every rank's send and receive, each as
/// one rank addresses them) lies at, if they share one and it is whole elements of `elem`
/// bytes: the direct kernel then moves the first 16-byte piece of every source and destination
/// together, and the elements before and after the pieces one by one. Buffers off 16 bytes
/// alike are what a program gets from one offset into its allocations on every rank
/// (nccl-tests' `-u`, slices of one tensor).
pub(crate) fn common_offset(bufs: &[(u64, u64)], elem: usize) -> Option<u64> {
    let at = bufs.first()?.0 % 16;
    let alike = bufs.iter().all(|&(send, recv)| send % 16 == at && recv % 16 == at);
    (alike && at.is_multiple_of(elem as u64)).then_some(at)
}

/// What one rank's kernel does: reduce `bytes` of every source (in this order) into every
/// destination. Addresses as this rank sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Job {
    pub(crate) srcs: Vec<u64>,
    pub(crate) dsts: Vec<u64>,
    pub(crate) bytes: usize,
}

/// Rank `rank`'s job in a call of `kind` on `n` ranks, `part` as in `DirectCall`; `bufs`: every
/// rank's (send, recv) as `peer_buffers::exchange` gives them.
pub(crate) fn job(kind: DirectKind, rank: usize, n: usize, part: usize, in_place: bool, bufs: &[(u64, u64)]) -> Job {
    let (send, recv) = (|q: usize| bufs[q].0, |q: usize| bufs[q].1);
    match kind {
        DirectKind::AllGather => Job {
            srcs: vec![send(rank)],
            // In place our part is already in our receive buffer.
            dsts: (0..n).filter(|&q| !(in_place && q == rank)).map(|q| recv(q) + (rank * part) as u64).collect(),
            bytes: part,
        },
        DirectKind::ReduceScatter => {
            Job { srcs: (0..n).map(|q| send(q) + (rank * part) as u64).collect(), dsts: vec![recv(rank)], bytes: part }
        }
        DirectKind::AllReduce => {
            let shard = part / n;
            let at = (rank * shard) as u64;
            Job { srcs: (0..n).map(|q| send(q) + at).collect(), dsts: (0..n).map(|q| recv(q) + at).collect(), bytes: shard }
        }
    }
}

/// Where a direct call goes: launched on a stream (a stream condition, captured or not), or
/// added to a graph as a node (a graph condition: the CUgraph and its context).
#[derive(Copy, Clone, Debug)]
pub(crate) enum Placement {
    Stream(usize),
    Graph((usize, usize)),
}

/// A communicator's direct-kernel state.
pub(crate) struct Direct {
    /// Blocks per launch (`GSC_COLL_SM_BLOCKS`; `None`: two per SM).
    blocks: Option<usize>,
    /// Calls run here so far (tests and benchmarks check the path was taken).
    runs: AtomicU64,
}

impl Direct {
    pub(crate) fn new(blocks: Option<usize>) -> Direct {
        Direct { blocks, runs: AtomicU64::new(0) }
    }

    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// Run `call` by the direct kernel, at `at`. `Ok(None)`: some rank cannot share, map or use
    /// its buffers here, every rank learnt it, nothing was issued — run the workspace kernels
    /// instead. `Ok(Some(node))`: issued; for a graph, its node (0 for a stream). Collective:
    /// every rank whose `wanted` said yes calls it. `known`: every rank's buffers, found in
    /// symmetric windows (`windows`) or given by every rank's call issued together
    /// (`together`) — nothing is exchanged, and every rank decides alone, from the same buffers.
    ///
    /// # Safety
    /// The call's buffers are GPU memory of this rank's device, valid for the call's sizes until
    /// the work completed (for a graph: while it can be launched).
    pub(crate) unsafe fn try_run(
        &self,
        cx: &DirectContext,
        call: &DirectCall,
        at: Placement,
        known: Option<&[(u64, u64)]>,
    ) -> Result<Option<usize>> {
        let (n, me) = (cx.nranks, cx.rank);
        // Everything that can fail on this rank alone comes before the ranks agree: after it,
        // every peer launches and would wait for this rank until the timeout.
        // The kernel's 16-byte loads and stores need every address of the call at one offset
        // from 16 bytes (`common_offset`); the parts' offsets are whole 16 bytes (`wanted`),
        // and the peers' mappings keep an address's place in its allocation. Our own two
        // buffers must agree before the peers' are worth asking for.
        let own = common_offset(&[(call.send, call.recv)], call.dtype.size()).is_some();
        // Pre-multiplied sums never come here (`wanted`); the others have a kernel each.
        let name = format!("gsc_direct_{}_{}", call.dtype.kernel_tag(), call.op.kernel_tag());
        let ready = (|| -> Result<_> {
            let per_gpu = match self.blocks {
                None => 2 * crate::cuda::sm_count(cx.device)?,
                Some(b) => b,
            };
            let graph = match at {
                Placement::Graph(g) => Some(g),
                Placement::Stream(_) => None,
            };
            Ok((cx.workspace.direct_kernel(&name, cx.kernel_cache, graph)?, per_gpu))
        })();
        if let Err(e) = &ready {
            tracing::debug!(target: "gsc::coll", error = %e, "the direct kernel cannot run here; every rank runs the workspace kernels");
        }
        let (bufs, (kernel, per_gpu)) = match known {
            // Every rank sees the same buffers (windows: bases on 16 bytes everywhere and the
            // same offsets), so every rank falls back alike.
            Some(bufs) if common_offset(bufs, call.dtype.size()).is_none() => return Ok(None),
            // No rank can tell the others this one failed: like a failed launch below.
            Some(bufs) => (
                bufs.to_vec(),
                ready.map_err(|e| Self::give_up(cx, e, "loading the direct kernel for a call whose buffers every rank knew"))?,
            ),
            None => {
                let Some(bufs) = peer_buffers::exchange(cx, call, own && ready.is_ok(), "the direct kernel")? else {
                    return Ok(None);
                };
                // Every rank has every rank's buffers (mapped: at the same offsets from 16
                // bytes), so every rank decides alike.
                if common_offset(&bufs, call.dtype.size()).is_none() {
                    return Ok(None);
                }
                (bufs, ready?)
            }
        };
        let job = job(call.kind, me, n, call.part_bytes, call.in_place(me), &bufs);
        let mut args = DirectArgs {
            coll: CollArgs {
                bytes: job.bytes as u64,
                rounds: 2,
                nranks: n as u64,
                rank: me as u64,
                timeout_ns: cx.timeout_ns,
                ..Default::default()
            },
            nsrc: job.srcs.len() as u64,
            ndst: job.dsts.len() as u64,
            ..Default::default()
        };
        args.src[..job.srcs.len()].copy_from_slice(&job.srcs);
        args.dst[..job.dsts.len()].copy_from_slice(&job.dsts);
        // No more blocks than there are pieces for a thread each (`GSC_COLL_SM_BLOCKS` is at
        // most 4096, so the count fits the grid).
        let blocks = per_gpu.min(job.bytes.div_ceil(16 * DIRECT_THREADS as usize)).max(1);
        let grid = Grid { blocks: blocks as u32, threads: DIRECT_THREADS };
        let issued = match at {
            Placement::Stream(stream) => cx.workspace.launch_direct(stream, kernel, args, grid).map(|()| 0),
            Placement::Graph(graph) => cx.workspace.add_direct_node(graph, kernel, args, grid),
        };
        let node = issued.map_err(|e| Self::give_up(cx, e, "issuing the direct kernel after every rank agreed to"))?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(Some(node))
    }

    /// This rank cannot run a call every peer runs: the peers issued theirs and will time out,
    /// and this rank's round counter would now be behind theirs, so its kernels must not wait
    /// on flags again — its collectives give up for good.
    fn give_up(cx: &DirectContext, e: crate::error::Error, doing: &str) -> crate::error::Error {
        cx.workspace.abort();
        e.context(format!("{doing} (this rank's collectives are now aborted)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::coll::MAX_RANKS;
    use std::collections::HashMap;

    /// Rank r's (send, recv) in a model of every rank's memory (one address space, as the
    /// mappings give each rank): send at its own base, recv after it or aliased in place.
    fn buffers(kind: DirectKind, n: usize, part: usize, in_place: bool) -> Vec<(u64, u64)> {
        let (send_len, _) = kind.buffer_bytes(n, part);
        (0..n)
            .map(|r| {
                let send = ((r as u64) + 1) << 32;
                let recv = match (in_place, kind) {
                    (false, _) => send + send_len as u64,
                    (true, DirectKind::AllGather) => send - (r * part) as u64,
                    (true, DirectKind::ReduceScatter) => send + (r * part) as u64,
                    (true, DirectKind::AllReduce) => send,
                };
                (send, recv)
            })
            .collect()
    }

    /// Byte i of rank r's input.
    fn input(r: usize, i: usize) -> u8 {
        (r * 37 + i * 11 + 1) as u8
    }

    #[test]
    fn every_rank_gets_the_collective_and_no_byte_is_both_written_and_read_by_another() {
        for kind in [DirectKind::AllGather, DirectKind::ReduceScatter, DirectKind::AllReduce] {
            for n in 2..=MAX_RANKS {
                let part = 16 * n * 3;
                for in_place in [false, true] {
                    let bufs = buffers(kind, n, part, in_place);
                    let (send_len, recv_len) = kind.buffer_bytes(n, part);
                    let mut mem: HashMap<u64, u8> = HashMap::new();
                    for (r, &(send, _)) in bufs.iter().enumerate() {
                        (0..send_len).for_each(|i| _ = mem.insert(send + i as u64, input(r, i)));
                    }
                    let before = mem.clone();
                    // Who reads and writes each byte: (rank, piece index in its job).
                    let mut reads: HashMap<u64, Vec<(usize, usize)>> = HashMap::new();
                    let mut writes: HashMap<u64, Vec<(usize, usize)>> = HashMap::new();
                    let jobs: Vec<Job> = (0..n).map(|r| job(kind, r, n, part, in_place, &bufs)).collect();
                    for (r, j) in jobs.iter().enumerate() {
                        assert!(j.bytes > 0 && j.bytes.is_multiple_of(16) && j.srcs.len() <= MAX_RANKS && j.dsts.len() <= MAX_RANKS);
                        for i in 0..j.bytes {
                            j.srcs.iter().for_each(|s| reads.entry(s + i as u64).or_default().push((r, i)));
                            j.dsts.iter().for_each(|d| writes.entry(d + i as u64).or_default().push((r, i)));
                        }
                    }
                    let what = format!("{kind:?} n={n} in_place={in_place}");
                    for (addr, w) in &writes {
                        assert_eq!(w.len(), 1, "{what}: byte {addr:#x} written {} times", w.len());
                        for reader in reads.get(addr).into_iter().flatten() {
                            // Only the thread that writes the byte may read it (before, in place).
                            assert_eq!(reader, &w[0], "{what}: byte {addr:#x} written by {:?} and read by {reader:?}", w[0]);
                        }
                    }
                    // Run the ranks' jobs on the model, all reads from the memory as it was
                    // before (no byte is both read and written by different threads, above).
                    for j in &jobs {
                        for i in 0..j.bytes {
                            let v = j.srcs.iter().map(|s| before[&(s + i as u64)]).fold(0u8, u8::wrapping_add);
                            j.dsts.iter().for_each(|d| _ = mem.insert(d + i as u64, v));
                        }
                    }
                    for (r, &(_, recv)) in bufs.iter().enumerate() {
                        for i in 0..recv_len {
                            let want = match kind {
                                DirectKind::AllGather => input(i / part, i % part),
                                DirectKind::ReduceScatter => (0..n).map(|q| input(q, r * part + i)).fold(0u8, u8::wrapping_add),
                                DirectKind::AllReduce => (0..n).map(|q| input(q, i)).fold(0u8, u8::wrapping_add),
                            };
                            assert_eq!(mem.get(&(recv + i as u64)), Some(&want), "{what}: rank {r}, byte {i} of recv");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn reductions_list_the_ranks_in_order() {
        let bufs = buffers(DirectKind::AllReduce, 4, 4 * 64, false);
        let j = job(DirectKind::AllReduce, 2, 4, 4 * 64, false, &bufs);
        assert_eq!(j.srcs, (0..4).map(|q| bufs[q].0 + 128).collect::<Vec<_>>(), "rank order, shard 2");
        let j = job(DirectKind::ReduceScatter, 1, 4, 64, false, &buffers(DirectKind::ReduceScatter, 4, 64, false));
        assert_eq!(j.srcs.len(), 4);
        assert!(j.srcs.windows(2).all(|w| w[0] < w[1]), "rank order: the model's bases grow with the rank");
    }

    #[test]
    fn buffers_off_sixteen_bytes_alike_on_whole_elements_share_an_offset() {
        assert_eq!(common_offset(&[(0x1000, 0x2000), (0x7000, 0x9010)], 4), Some(0));
        assert_eq!(common_offset(&[(0x1004, 0x2004), (0x7014, 0x9004)], 4), Some(4));
        assert_eq!(common_offset(&[(0x1005, 0x2005)], 1), Some(5));
        assert_eq!(common_offset(&[(0x1004, 0x2004), (0x7008, 0x9008)], 4), None, "ranks at different offsets");
        assert_eq!(common_offset(&[(0x1004, 0x2008)], 4), None, "send and receive at different offsets");
        assert_eq!(common_offset(&[(0x1002, 0x2002)], 4), None, "off whole elements");
        assert_eq!(common_offset(&[(0x1008, 0x2008)], 8), Some(8));
        assert_eq!(common_offset(&[], 4), None);
    }

    #[test]
    fn only_on_and_whole_pieces_take_the_direct_kernel() {
        let w = |mode, kind, bytes, n, premul| wanted(mode, 1 << 20, kind, bytes, n, premul, false);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, 4, false), Some(DirectKind::AllReduce));
        assert_eq!(w(Tristate::On, CollKind::AllGather, (1 << 20) + 16, 4, false), Some(DirectKind::AllGather));
        assert_eq!(w(Tristate::On, CollKind::ReduceScatter, 1 << 20, 3, false), Some(DirectKind::ReduceScatter));
        assert_eq!(w(Tristate::Off, CollKind::AllReduce, 8 << 20, 4, false), None);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (1 << 20) - 16, 4, false), None, "below the threshold");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, (1 << 20) + 16, 4, false), None, "shards of whole 16 bytes");
        assert_eq!(w(Tristate::On, CollKind::AllGather, (1 << 20) + 4, 4, false), None, "parts of whole 16 bytes");
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, 4, true), None, "pre-multiplied sums run the kernels");
        assert_eq!(w(Tristate::On, CollKind::Broadcast, 8 << 20, 4, false), None);
        assert_eq!(w(Tristate::On, CollKind::AllReduce, 8 << 20, 1, false), None, "one rank");
    }

    #[test]
    fn auto_takes_the_measured_rank_counts_from_the_measured_sizes() {
        let auto = |kind, bytes, n, replayed| wanted(Tristate::Auto, 512 << 10, kind, bytes, n, false, replayed);
        // Two ranks, replayed: 8 MiB all-gather parts, 16 MiB reduce-scatter parts, 1 MiB
        // all-reduces.
        assert_eq!(auto(CollKind::AllGather, 8 << 20, 2, true), Some(DirectKind::AllGather));
        assert_eq!(auto(CollKind::AllGather, 4 << 20, 2, true), None);
        assert_eq!(auto(CollKind::ReduceScatter, 16 << 20, 2, true), Some(DirectKind::ReduceScatter));
        assert_eq!(auto(CollKind::ReduceScatter, (16 << 20) - 16, 2, true), None);
        assert_eq!(auto(CollKind::AllReduce, 1 << 20, 2, true), Some(DirectKind::AllReduce));
        assert_eq!(auto(CollKind::AllReduce, 512 << 10, 2, true), None);
        // On a stream: the same parts, 16 MiB all-reduces.
        assert_eq!(auto(CollKind::AllGather, 4 << 20, 2, false), None);
        assert_eq!(auto(CollKind::AllGather, 8 << 20, 2, false), Some(DirectKind::AllGather));
        assert_eq!(auto(CollKind::ReduceScatter, 8 << 20, 2, false), None);
        assert_eq!(auto(CollKind::ReduceScatter, 16 << 20, 2, false), Some(DirectKind::ReduceScatter));
        assert_eq!(auto(CollKind::AllReduce, 8 << 20, 2, false), None);
        assert_eq!(auto(CollKind::AllReduce, 16 << 20, 2, false), Some(DirectKind::AllReduce));
        // Beyond two ranks the all-gather only, up to four.
        assert_eq!(auto(CollKind::AllReduce, 256 << 20, 4, true), None);
        assert_eq!(auto(CollKind::ReduceScatter, 256 << 20, 4, true), None);
        assert_eq!(auto(CollKind::AllGather, 512 << 10, 4, true), Some(DirectKind::AllGather));
        assert_eq!(auto(CollKind::AllGather, 512 << 10, 3, true), Some(DirectKind::AllGather));
        assert_eq!(auto(CollKind::AllGather, 4 << 20, 4, false), None);
        assert_eq!(auto(CollKind::AllGather, 8 << 20, 4, false), Some(DirectKind::AllGather));
        assert_eq!(auto(CollKind::AllGather, 256 << 20, 8, true), None, "not measured on eight");
        // GSC_COLL_SM_MIN still bounds it from below.
        assert_eq!(wanted(Tristate::Auto, 64 << 20, CollKind::AllReduce, 32 << 20, 2, false, true), None);
    }
}

//! Send/recv between the ranks of a communicator by SMs (`cuda::coll_p2p`): a group's sends
//! and receives of up to `GSC_COLL_P2P_MAX` bytes each are one kernel on the caller's stream
//! (or one node of its graph), moving chunks through FIFOs in the receivers' workspaces. No
//! host takes part once it is launched, no buffer is exchanged, and a captured group replays
//! any number of times: "receiver ready + direct write" per chunk, nothing per message.
//!
//! Larger messages go through the point-to-point engine (`p2p`: the copy engines read the
//! sender's buffer through CUDA IPC, the fastest way for large ones). The choice is made per
//! message from its length alone, which sender and receiver agree on — a message's two sides
//! must take the same path — and `GSC_COLL_P2P_MAX` is one of the settings every rank must
//! share.
//!
//! A send to this rank and its receive from this rank in the same group are one copy in the
//! kernel (`fuse_self`; while every group's messages to itself balance), not a trip through
//! the rank's own FIFO: two ranks' all-to-all of 64 B took 6.5 µs in graphs with the trip and
//! 6.15 without the pair (docs/PERF.md, session 25).
//!
//! This module plans the launches; the kernel and its protocol are in `cuda::coll_p2p`.

use super::p2p::PeerOp;
use crate::cuda::coll_p2p::{P2P_COPY, P2P_MAX_OPS, P2P_RECV, P2P_SEND, P2pOp, chunk_bytes, chunks};
use crate::error::{Error, Result};

/// One send or receive of a group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PeerTransfer {
    pub op: PeerOp,
    /// GPU memory of the rank's device.
    pub buf: u64,
    pub bytes: usize,
    pub peer: usize,
}

/// What the kernel does for one entry of a group: a transfer through a FIFO, or a copy that is
/// a send to this rank and its receive from this rank at once.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum KernelOp {
    Fifo(PeerTransfer),
    SelfCopy { src: u64, dst: u64, bytes: usize },
}

/// The kernel's operations for the entries of `group` that `on_kernel` picks, in order, on
/// rank `me` (errors name entries by their index in the whole group). `self_fifo` says whether
/// this rank's messages to itself have ever gone through its own FIFO; it is set (for good) by
/// the first group whose sends to itself and receives from itself do not balance.
///
/// The k-th send to itself pairs with the k-th receive from itself. In a group where they
/// balance, and while none ever went through the FIFO, the pairs are known: each becomes one
/// copy (a pair whose lengths differ is refused here, naming both entries). Otherwise they go
/// through the FIFO, from then on always: a replayed graph repeats its group, so counting what
/// waits in the FIFO on the host could not say which later receive takes which send.
pub(crate) fn fuse_self(
    group: &[PeerTransfer],
    on_kernel: impl Fn(&PeerTransfer) -> bool,
    me: usize,
    self_fifo: &mut bool,
) -> Result<Vec<KernelOp>> {
    let kernel: Vec<usize> = (0..group.len()).filter(|&i| on_kernel(&group[i])).collect();
    let to_self = |op: PeerOp| -> Vec<usize> { kernel.iter().copied().filter(|&i| group[i].peer == me && group[i].op == op).collect() };
    let (sends, recvs) = (to_self(PeerOp::Send), to_self(PeerOp::Recv));
    let mut ops: Vec<(usize, KernelOp)> = kernel.iter().map(|&i| (i, KernelOp::Fifo(group[i]))).collect();
    if *self_fifo || sends.len() != recvs.len() {
        *self_fifo |= !sends.is_empty() || !recvs.is_empty();
        return Ok(ops.into_iter().map(|(_, k)| k).collect());
    }
    for (&si, &ri) in sends.iter().zip(&recvs) {
        let (send, recv) = (&group[si], &group[ri]);
        if send.bytes != recv.bytes {
            return Err(Error::invalid_param(format!(
                "transfer {si} (a send to this rank, {} bytes) pairs with transfer {ri} (a receive from this rank, {} bytes): \
                 a send and its receive must have the same length",
                send.bytes, recv.bytes
            )));
        }
        // The copy takes the place of the pair's first entry; the second is dropped.
        let (first, second) = (si.min(ri), si.max(ri));
        for op in ops.iter_mut().filter(|(i, _)| *i == first) {
            op.1 = KernelOp::SelfCopy { src: send.buf, dst: recv.buf, bytes: send.bytes };
        }
        ops.retain(|(i, _)| *i != second);
    }
    Ok(ops.into_iter().map(|(_, k)| k).collect())
}

/// One launch of a group: its operations and its grid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Launch {
    pub(crate) ops: Vec<P2pOp>,
    pub(crate) blocks: usize,
}

/// The launches that carry `transfers` (all of them for the kernel: empty ones left out), in
/// order: at most `P2P_MAX_OPS` operations and `max_blocks` blocks each (every block must be
/// resident at once: a waiting block would otherwise hold an SM a peer's progress needs), an
/// operation getting up to `blocks_per_op` blocks, one per chunk at most.
///
/// A group of more operations than one launch carries is cut in launch order; a message whose
/// other side is in a later launch of its rank then waits for it, which is fine while every
/// launch's sends fit in the FIFOs (`P2P_SLOTS` chunks per pair) and may stall otherwise, as
/// in any FIFO of bounded depth.
pub(crate) fn plan(kernel_ops: &[KernelOp], me: usize, blocks_per_op: usize, max_blocks: usize) -> Vec<Launch> {
    let bytes = |k: &KernelOp| match k {
        KernelOp::Fifo(t) => t.bytes,
        KernelOp::SelfCopy { bytes, .. } => *bytes,
    };
    let live: Vec<&KernelOp> = kernel_ops.iter().filter(|k| bytes(k) > 0).collect();
    let mut launches = Vec::new();
    for group in live.chunks(P2P_MAX_OPS.min(max_blocks.max(1))) {
        let per_op = blocks_per_op.clamp(1, (max_blocks / group.len()).max(1));
        let mut ops = Vec::with_capacity(group.len());
        let mut next_block = 0;
        for k in group {
            let n = chunks(bytes(k) as u64);
            let blocks = per_op.min(n as usize);
            let shape = P2pOp { bytes: bytes(k) as u64, chunks: n, chunk: chunk_bytes(bytes(k) as u64) as u32, ..Default::default() };
            let op = match **k {
                KernelOp::Fifo(t) => {
                    let kind = if t.op == PeerOp::Send { P2P_SEND } else { P2P_RECV };
                    // Chunks of this launch's earlier operations with the same peer and
                    // direction: the launch's counters advance only when it ends.
                    let skip: u64 = ops.iter().filter(|o: &&P2pOp| o.peer == t.peer as u32 && o.kind == kind).map(|o| o.chunks).sum();
                    P2pOp { buf: t.buf, peer: t.peer as u32, kind, skip, ..shape }
                }
                KernelOp::SelfCopy { src, dst, .. } => P2pOp { buf: dst, src, peer: me as u32, kind: P2P_COPY, ..shape },
            };
            ops.push(P2pOp { first_block: next_block as u32, blocks: blocks as u32, ..op });
            next_block += blocks;
        }
        launches.push(Launch { ops, blocks: next_block });
    }
    launches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(op: PeerOp, bytes: usize, peer: usize) -> PeerTransfer {
        PeerTransfer { op, buf: 0x1000, bytes, peer }
    }

    fn fifo(group: &[PeerTransfer]) -> Vec<KernelOp> {
        group.iter().map(|t| KernelOp::Fifo(*t)).collect()
    }

    /// A transfer of `bytes` at `buf`.
    fn at(op: PeerOp, buf: u64, bytes: usize, peer: usize) -> PeerTransfer {
        PeerTransfer { op, buf, bytes, peer }
    }

    #[test]
    fn sends_to_self_pair_with_receives_from_self_in_order_into_copies() {
        use PeerOp::{Recv, Send};
        // Rank 1: a receive from itself before its send, a send to rank 0 between them, then
        // a send and a receive of 16 bytes.
        let group = [at(Recv, 0xa0, 8, 1), at(Send, 0xb0, 64, 0), at(Send, 0xc0, 8, 1), at(Send, 0xd0, 16, 1), at(Recv, 0xf0, 16, 1)];
        let mut self_fifo = false;
        let ops = fuse_self(&group, |_| true, 1, &mut self_fifo).unwrap();
        assert_eq!(
            ops,
            [
                KernelOp::SelfCopy { src: 0xc0, dst: 0xa0, bytes: 8 },
                KernelOp::Fifo(group[1]),
                KernelOp::SelfCopy { src: 0xd0, dst: 0xf0, bytes: 16 }
            ]
        );
        assert!(!self_fifo);
        // A group without messages to itself changes nothing.
        assert_eq!(fuse_self(&group[1..2], |_| true, 1, &mut self_fifo).unwrap(), fifo(&group[1..2]));
        assert!(!self_fifo);
        // Two sends and one receive: all through the FIFO, and so is every later group's.
        let unbalanced = [at(Send, 0x10, 4, 1), at(Send, 0x20, 32, 1), at(Recv, 0x30, 4, 1)];
        assert_eq!(fuse_self(&unbalanced, |_| true, 1, &mut self_fifo).unwrap(), fifo(&unbalanced));
        assert!(self_fifo);
        let pair = [at(Recv, 0x40, 32, 1), at(Send, 0x50, 4, 1), at(Recv, 0x60, 4, 1)];
        assert_eq!(fuse_self(&pair, |_| true, 1, &mut self_fifo).unwrap(), fifo(&pair));
    }

    #[test]
    fn a_copy_is_its_own_operation_and_moves_no_fifo_counter() {
        let ops = [
            KernelOp::Fifo(t(PeerOp::Send, 8, 2)),
            KernelOp::SelfCopy { src: 0x2000, dst: 0x3000, bytes: 1 << 20 },
            KernelOp::Fifo(t(PeerOp::Send, 8, 2)),
        ];
        let launch = &plan(&ops, 2, 8, 132)[0];
        let copy = launch.ops[1];
        assert_eq!((copy.kind, copy.buf, copy.src, copy.peer, copy.skip, copy.blocks), (P2P_COPY, 0x3000, 0x2000, 2, 0, 8));
        assert_eq!((copy.chunk, copy.chunks), (32 << 10, 32));
        // The second send to rank 2 (itself through its FIFO) skips the first's chunk only.
        assert_eq!(launch.ops[2].skip, 1);
    }

    #[test]
    fn a_self_pair_of_different_lengths_is_refused_and_changes_nothing() {
        // Entry 0 is not the kernel's (the engine's, say): the indices are still the group's.
        let group = [t(PeerOp::Send, 8, 0), t(PeerOp::Send, 100, 3), t(PeerOp::Recv, 12, 3)];
        let mut self_fifo = false;
        let err = fuse_self(&group, |t| t.peer == 3, 3, &mut self_fifo).unwrap_err();
        assert_eq!(err.status(), crate::Status::InvalidParam);
        assert!(err.message().contains("transfer 1 (a send to this rank, 100 bytes) pairs with transfer 2"), "{err}");
        assert!(!self_fifo);
    }

    #[test]
    fn messages_are_cut_into_up_to_32_chunks_of_16_to_64_kib() {
        let k = 1u64 << 10;
        for (bytes, chunk, n) in [(1, 16 * k, 1), (16 * k, 16 * k, 1), (16 * k + 1, 16 * k, 2), (128 * k, 16 * k, 8), (512 * k, 16 * k, 32)]
        {
            assert_eq!((chunk_bytes(bytes), chunks(bytes)), (chunk, n), "{bytes} bytes");
        }
        // Past 512 KiB the chunk grows in 16 KiB steps to keep 32 chunks, up to a whole slot.
        assert_eq!((chunk_bytes(512 * k + 1), chunks(512 * k + 1)), (32 * k, 17));
        assert_eq!((chunk_bytes(1024 * k), chunks(1024 * k)), (32 * k, 32));
        assert_eq!((chunk_bytes(2048 * k), chunks(2048 * k)), (64 * k, 32));
        assert_eq!((chunk_bytes(8192 * k + 1), chunks(8192 * k + 1)), (64 * k, 129));
    }

    #[test]
    fn operations_get_blocks_by_chunks_and_skips_by_pair_and_direction() {
        let (a, b, d) = (40 << 10, (1 << 20) + 1, 20 << 20);
        let group = [t(PeerOp::Send, a, 1), t(PeerOp::Recv, 8, 1), t(PeerOp::Send, 0, 2), t(PeerOp::Send, b, 1), t(PeerOp::Recv, d, 1)];
        let launches = plan(&fifo(&group), 0, 8, 132);
        assert_eq!(launches.len(), 1);
        let ops = &launches[0].ops;
        // The empty send is left out; the rest keep their order.
        assert_eq!(ops.len(), 4);
        let (ca, cb) = (chunks(a as u64), chunks(b as u64));
        assert!(ca > 1 && ca < 8 && cb >= 8, "{ca} {cb}");
        assert_eq!(ops.iter().map(|o| o.blocks as u64).collect::<Vec<_>>(), [ca, 1, 8, 8]);
        assert_eq!(ops.iter().map(|o| o.first_block as u64).collect::<Vec<_>>(), [0, ca, ca + 1, ca + 9]);
        assert_eq!(launches[0].blocks as u64, ca + 17);
        // The second send to rank 1 comes after the first's chunks; the second receive from
        // rank 1 after the first's one.
        assert_eq!(ops.iter().map(|o| o.skip).collect::<Vec<_>>(), [0, 0, ca, 1]);
        assert_eq!(ops.iter().map(|o| o.kind).collect::<Vec<_>>(), [P2P_SEND, P2P_RECV, P2P_SEND, P2P_RECV]);
    }

    #[test]
    fn blocks_shrink_to_keep_a_launch_resident() {
        let group: Vec<_> = (0..16).map(|i| t(if i % 2 == 0 { PeerOp::Send } else { PeerOp::Recv }, 4 << 20, i / 2)).collect();
        let launches = plan(&fifo(&group), 0, 8, 66);
        assert_eq!(launches.len(), 1);
        assert!(launches[0].ops.iter().all(|o| o.blocks == 4), "{:?}", launches[0].ops);
        assert_eq!(launches[0].blocks, 64);
        // One block per operation is the floor, however small the GPU.
        let launches = plan(&fifo(&group), 0, 8, 4);
        assert_eq!(launches.len(), 4);
        assert!(launches.iter().all(|l| l.ops.len() == 4 && l.blocks == 4));
    }

    #[test]
    fn large_groups_are_cut_and_skips_restart_per_launch() {
        let group: Vec<_> = (0..P2P_MAX_OPS + 3).map(|_| t(PeerOp::Send, 10, 0)).collect();
        let launches = plan(&fifo(&group), 0, 8, 132);
        assert_eq!(launches.iter().map(|l| l.ops.len()).collect::<Vec<_>>(), [P2P_MAX_OPS, 3]);
        assert_eq!(launches[0].ops.last().unwrap().skip, (P2P_MAX_OPS - 1) as u64);
        assert_eq!(launches[1].ops.iter().map(|o| o.skip).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(plan(&fifo(&[t(PeerOp::Recv, 0, 0)]), 0, 8, 132).is_empty());
    }
}

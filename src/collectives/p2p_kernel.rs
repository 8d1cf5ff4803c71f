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
//! This module plans the launches; the kernel and its protocol are in `cuda::coll_p2p`.

use super::p2p::PeerOp;
use crate::cuda::coll_p2p::{P2P_MAX_OPS, P2pOp, chunks};

/// One send or receive of a group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PeerTransfer {
    pub op: PeerOp,
    /// GPU memory of the rank's device.
    pub buf: u64,
    pub bytes: usize,
    pub peer: usize,
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
pub(crate) fn plan(transfers: &[PeerTransfer], blocks_per_op: usize, max_blocks: usize) -> Vec<Launch> {
    let live: Vec<&PeerTransfer> = transfers.iter().filter(|t| t.bytes > 0).collect();
    let mut launches = Vec::new();
    for group in live.chunks(P2P_MAX_OPS.min(max_blocks.max(1))) {
        let per_op = blocks_per_op.clamp(1, (max_blocks / group.len()).max(1));
        let mut ops = Vec::with_capacity(group.len());
        let mut next_block = 0;
        for t in group {
            let op_chunks = chunks(t.bytes as u64) as usize;
            // Chunks of this launch's earlier operations with the same peer and direction: the
            // launch's counters advance only when it ends.
            let skip: u64 = ops
                .iter()
                .filter(|o: &&P2pOp| o.peer == t.peer as u64 && o.send == (t.op == PeerOp::Send) as u64)
                .map(|o| chunks(o.bytes))
                .sum();
            let blocks = per_op.min(op_chunks);
            ops.push(P2pOp {
                buf: t.buf,
                bytes: t.bytes as u64,
                peer: t.peer as u64,
                send: (t.op == PeerOp::Send) as u64,
                skip,
                first_block: next_block as u64,
                blocks: blocks as u64,
            });
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

    #[test]
    fn messages_are_cut_into_up_to_32_chunks_of_16_to_64_kib() {
        use crate::cuda::coll_p2p::chunk_bytes;
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
        let launches = plan(&group, 8, 132);
        assert_eq!(launches.len(), 1);
        let ops = &launches[0].ops;
        // The empty send is left out; the rest keep their order.
        assert_eq!(ops.len(), 4);
        let (ca, cb) = (chunks(a as u64), chunks(b as u64));
        assert!(ca > 1 && ca < 8 && cb >= 8, "{ca} {cb}");
        assert_eq!(ops.iter().map(|o| o.blocks).collect::<Vec<_>>(), [ca, 1, 8, 8]);
        assert_eq!(ops.iter().map(|o| o.first_block).collect::<Vec<_>>(), [0, ca, ca + 1, ca + 9]);
        assert_eq!(launches[0].blocks as u64, ca + 17);
        // The second send to rank 1 comes after the first's chunks; the second receive from
        // rank 1 after the first's one.
        assert_eq!(ops.iter().map(|o| o.skip).collect::<Vec<_>>(), [0, 0, ca, 1]);
        assert_eq!(ops.iter().map(|o| o.send).collect::<Vec<_>>(), [1, 0, 1, 0]);
    }

    #[test]
    fn blocks_shrink_to_keep_a_launch_resident() {
        let group: Vec<_> = (0..16).map(|i| t(if i % 2 == 0 { PeerOp::Send } else { PeerOp::Recv }, 4 << 20, i / 2)).collect();
        let launches = plan(&group, 8, 66);
        assert_eq!(launches.len(), 1);
        assert!(launches[0].ops.iter().all(|o| o.blocks == 4), "{:?}", launches[0].ops);
        assert_eq!(launches[0].blocks, 64);
        // One block per operation is the floor, however small the GPU.
        let launches = plan(&group, 8, 4);
        assert_eq!(launches.len(), 4);
        assert!(launches.iter().all(|l| l.ops.len() == 4 && l.blocks == 4));
    }

    #[test]
    fn large_groups_are_cut_and_skips_restart_per_launch() {
        let group: Vec<_> = (0..P2P_MAX_OPS + 3).map(|_| t(PeerOp::Send, 10, 0)).collect();
        let launches = plan(&group, 8, 132);
        assert_eq!(launches.iter().map(|l| l.ops.len()).collect::<Vec<_>>(), [P2P_MAX_OPS, 3]);
        assert_eq!(launches[0].ops.last().unwrap().skip, (P2P_MAX_OPS - 1) as u64);
        assert_eq!(launches[1].ops.iter().map(|o| o.skip).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(plan(&[t(PeerOp::Recv, 0, 0)], 8, 132).is_empty());
    }
}

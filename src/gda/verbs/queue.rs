//! The send-queue ring and the completion-queue reader of one mlx5 queue pair, as plain
//! bookkeeping over caller-provided buffers.
//!
//! `SendQueue` writes WQEs into a ring of 64-byte basic blocks (the QP's send buffer, which
//! `mlx5dv_init_obj` exposes), keeps the producer counter, and hands out the two doorbell values
//! that make the NIC fetch what was written: the doorbell *record* (host memory the NIC reads)
//! and the 8-byte *UAR* write (a device register, the BlueFlame page). Prepared operations
//! write their WQEs here at prepare time; a stream later stores the doorbell values with
//! `cuStreamWriteValue32/64` — the stream rings the doorbell, no CPU on the path.
//!
//! `CompletionQueue` follows the hardware's writes into the CQ ring with the owner-bit rule,
//! advances the consumer counter, and says which word a stream must wait on for the k-th CQE.
//!
//! Neither type touches a device: tests run them over byte vectors, the verbs engine over the
//! rings of a real QP and CQ (reading CQEs with volatile loads; see `CompletionQueue::peek`).

use super::mlx5::{
    self, CQE_SIZE, Cqe, CqeFault, CtrlSeg, DS_UNIT, DataSeg, MAX_DS, Opcode, RaddrSeg, SEND_WQE_BB, cqe_offset, ctrl_flags,
};
use crate::error::{Error, Result, Status};

/// The local side of a transfer: registered memory (`lkey`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LocalSge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// The remote side of a transfer: registered memory of the peer (or of this process, on a
/// loopback QP), named by its `rkey`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RemoteRef {
    pub addr: u64,
    pub rkey: u32,
}

/// What a work request does.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WorkOp {
    /// RDMA write of `local` to `remote`.
    Write { local: LocalSge, remote: RemoteRef },
    /// RDMA write with immediate: the receiver also gets a completion carrying `imm`.
    WriteImm { local: LocalSge, remote: RemoteRef, imm: u32 },
    /// RDMA read of `remote` into `local`.
    Read { local: LocalSge, remote: RemoteRef },
    /// No transfer; completes in order with the rest.
    Nop,
}

/// One send work request, the engine's own `ibv_send_wr` for a single scatter entry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned by `SendQueue::complete` for the CQE of this WQE (libmlx5's `wrid[idx]`).
    pub wr_id: u64,
    pub op: WorkOp,
    /// Ask for a CQE on success (`CQ_UPDATE`). A failing WQE writes an error CQE either way.
    pub signalled: bool,
    /// Start only after earlier RDMA reads and atomics on this QP completed.
    pub fence: bool,
}

/// Where a posted WQE went.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Posted {
    /// The WQE index (producer counter mod 2^16): what its CQE's `wqe_counter` will say.
    pub wqe_index: u16,
    /// The WQE's first basic block in the ring.
    pub first_bb: u32,
    /// Basic blocks it occupies.
    pub bbs: u32,
}

/// The two stores that ring the send doorbell, in this order (`post_send_db`):
/// 1. the doorbell record: `dbrec` (4 bytes) at byte offset `DBREC_OFFSET` of the QP's doorbell
///    record (`dbrec[MLX5_SND_DBR]`), then
/// 2. the UAR: `uar` (8 bytes, the first 8 of the last WQE's control segment) at byte offset
///    `bf_offset` of the QP's BlueFlame register (`mlx5dv_qp.bf.reg`).
///
/// The WQEs must be visible to the NIC before the first store and the record before the
/// second (the CPU path uses `udma_to_device_barrier` and a write-combining flush; a stream's
/// `cuStreamWriteValue` without `NO_MEMORY_BARRIER` orders its writes). `dbrec_word` and
/// `uar_word` are the values to give a little-endian 32- and 64-bit store (for example
/// `cuStreamWriteValue32` / `cuStreamWriteValue64`) so that memory holds these bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Doorbell {
    pub dbrec: [u8; 4],
    pub uar: [u8; 8],
    pub bf_offset: u32,
    /// The producer counter this doorbell publishes.
    pub producer: u32,
}

impl Doorbell {
    /// Byte offset of the send counter in the QP's doorbell record (`MLX5_SND_DBR` * 4).
    pub const DBREC_OFFSET: usize = mlx5::SND_DBR * 4;

    pub fn dbrec_word(&self) -> u32 {
        mlx5::le_word32(self.dbrec)
    }

    pub fn uar_word(&self) -> u64 {
        mlx5::le_word64(self.uar)
    }
}

/// What `SendQueue::complete` retired.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Retired {
    /// The `wr_id` of the WQE the CQE named.
    pub wr_id: u64,
    /// Basic blocks freed: this WQE's and those of every unsignalled WQE before it.
    pub freed_bbs: u32,
}

/// Shape of a QP's send queue, from `mlx5dv_qp` and the QP's capabilities.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SendQueueShape {
    /// QP number (24 bits).
    pub qpn: u32,
    /// Ring size in basic blocks (`mlx5dv_qp.sq.wqe_cnt`; a power of two). `sq.stride` must
    /// be 64.
    pub wqe_cnt: u32,
    /// Size of one BlueFlame buffer (`mlx5dv_qp.bf.size`): the UAR doorbell alternates between
    /// offset 0 and this offset on every ring (`bf->offset ^= bf->buf_size`).
    pub bf_size: u32,
}

/// Producer side of one mlx5 send queue.
#[derive(Debug)]
pub struct SendQueue {
    shape: SendQueueShape,
    /// Producer counter in basic blocks (`sq.cur_post`); wraps at 2^32, the ring index is the
    /// low bits and the WQE index the low 16.
    producer: u32,
    /// Every basic block before this counter has completed.
    consumer: u32,
    /// Producer counter published by the last doorbell.
    rung: u32,
    /// First 8 bytes of the control segment of the last WQE posted since the last doorbell.
    last_ctrl: Option<[u8; 8]>,
    bf_offset: u32,
    /// Per ring slot where a WQE starts: its `wr_id` and size in basic blocks.
    slots: Vec<(u64, u32)>,
}

impl SendQueue {
    pub fn new(shape: SendQueueShape) -> Result<SendQueue> {
        if shape.wqe_cnt == 0 || !shape.wqe_cnt.is_power_of_two() {
            return Err(Error::invalid_param(format!("send queue of {} basic blocks: not a power of two", shape.wqe_cnt)));
        }
        if shape.wqe_cnt > 1 << 15 {
            // The CQE's 16-bit wqe_counter must name a WQE unambiguously among those in flight.
            return Err(Error::invalid_param(format!("send queue of {} basic blocks: more than 32768", shape.wqe_cnt)));
        }
        if shape.qpn >= 1 << 24 {
            return Err(Error::invalid_param(format!("QP number {:#x} has more than 24 bits", shape.qpn)));
        }
        Ok(SendQueue {
            shape,
            producer: 0,
            consumer: 0,
            rung: 0,
            last_ctrl: None,
            bf_offset: 0,
            slots: vec![(0, 0); shape.wqe_cnt as usize],
        })
    }

    pub fn shape(&self) -> SendQueueShape {
        self.shape
    }

    /// Bytes the ring buffer must have.
    pub fn ring_len(&self) -> usize {
        self.shape.wqe_cnt as usize * SEND_WQE_BB
    }

    /// Producer counter (basic blocks posted since creation, mod 2^32).
    pub fn producer(&self) -> u32 {
        self.producer
    }

    /// Basic blocks posted and not yet known complete.
    pub fn in_flight(&self) -> u32 {
        self.producer.wrapping_sub(self.consumer)
    }

    /// Basic blocks free for new WQEs.
    pub fn free_bbs(&self) -> u32 {
        self.shape.wqe_cnt - self.in_flight()
    }

    /// Write `wr` as a WQE into `ring` at the producer position (wrapping around the end of
    /// the ring like `_mlx5_post_send`) and advance the producer. Nothing is rung: call
    /// `doorbell` after the last WQE of a batch.
    pub fn post(&mut self, ring: &mut [u8], wr: &WorkRequest) -> Result<Posted> {
        if let WorkOp::Write { local, .. } | WorkOp::WriteImm { local, .. } | WorkOp::Read { local, .. } = wr.op
            && local.len & mlx5::INLINE_SEG != 0
        {
            // Bit 31 of a data segment's byte_count is the inline flag: the NIC would take the
            // pointer segment for inline data.
            return Err(Error::invalid_param(format!("a transfer of {} bytes: at most 2^31 - 1 in one WQE", local.len)));
        }
        let mut wqe = [0u8; MAX_DS * DS_UNIT];
        let mut len = CtrlSeg::LEN;
        let (opcode, imm, remote, local) = match wr.op {
            WorkOp::Write { local, remote } => (Opcode::RdmaWrite, 0, Some(remote), Some(local)),
            WorkOp::WriteImm { local, remote, imm } => (Opcode::RdmaWriteImm, imm, Some(remote), Some(local)),
            WorkOp::Read { local, remote } => (Opcode::RdmaRead, 0, Some(remote), Some(local)),
            WorkOp::Nop => (Opcode::Nop, 0, None, None),
        };
        if let Some(remote) = remote {
            wqe[len..len + RaddrSeg::LEN].copy_from_slice(&RaddrSeg { raddr: remote.addr, rkey: remote.rkey }.encode());
            len += RaddrSeg::LEN;
        }
        // A zero-length entry gets no data segment, as in `_mlx5_post_send`.
        if let Some(local) = local.filter(|l| l.len > 0) {
            wqe[len..len + DataSeg::LEN].copy_from_slice(&DataSeg { byte_count: local.len, lkey: local.lkey, addr: local.addr }.encode());
            len += DataSeg::LEN;
        }
        self.place(ring, wr.wr_id, &mut wqe[..len], opcode, imm, wr.signalled, wr.fence)
    }

    /// An RDMA write whose data travels inside the WQE (`IBV_SEND_INLINE`): no local key, and
    /// `data` may be reused as soon as this returns. `max_inline` is the QP's
    /// `cap.max_inline_data`.
    pub fn post_inline_write(
        &mut self,
        ring: &mut [u8],
        wr_id: u64,
        data: &[u8],
        remote: RemoteRef,
        max_inline: usize,
        signalled: bool,
    ) -> Result<Posted> {
        if data.len() > max_inline {
            return Err(Error::invalid_param(format!("inline write of {} bytes: the QP inlines at most {max_inline}", data.len())));
        }
        let inline_ds = mlx5::inline_ds(data.len());
        let len = CtrlSeg::LEN + RaddrSeg::LEN + inline_ds * DS_UNIT;
        if len > MAX_DS * DS_UNIT {
            return Err(Error::invalid_param(format!("inline write of {} bytes does not fit one WQE", data.len())));
        }
        let mut wqe = [0u8; MAX_DS * DS_UNIT];
        wqe[CtrlSeg::LEN..CtrlSeg::LEN + RaddrSeg::LEN].copy_from_slice(&RaddrSeg { raddr: remote.addr, rkey: remote.rkey }.encode());
        if !data.is_empty() {
            let at = CtrlSeg::LEN + RaddrSeg::LEN;
            wqe[at..at + 4].copy_from_slice(&mlx5::inline_header(data.len() as u32));
            wqe[at + 4..at + 4 + data.len()].copy_from_slice(data);
        }
        self.place(ring, wr_id, &mut wqe[..len], Opcode::RdmaWrite, 0, signalled, false)
    }

    /// Fill in the control segment of `wqe` (segments after it already written) and copy it
    /// into the ring.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        ring: &mut [u8],
        wr_id: u64,
        wqe: &mut [u8],
        opcode: Opcode,
        imm: u32,
        signalled: bool,
        fence: bool,
    ) -> Result<Posted> {
        if ring.len() != self.ring_len() {
            return Err(Error::invalid_param(format!(
                "send ring of {} bytes; this queue has {} basic blocks ({} bytes)",
                ring.len(),
                self.shape.wqe_cnt,
                self.ring_len()
            )));
        }
        let ds = wqe.len() / DS_UNIT;
        let bbs = mlx5::wqe_bbs(ds) as u32;
        if bbs > self.free_bbs() {
            return Err(Error::new(
                Status::NoResource,
                format!(
                    "send queue of QP {:#x} full: a {bbs}-block WQE with {} of {} blocks in flight",
                    self.shape.qpn,
                    self.in_flight(),
                    self.shape.wqe_cnt
                ),
            ));
        }
        let mut fm_ce_se = 0;
        if signalled {
            fm_ce_se |= ctrl_flags::CQ_UPDATE;
        }
        if fence {
            fm_ce_se |= ctrl_flags::FENCE;
        }
        let wqe_index = (self.producer & 0xffff) as u16;
        let ctrl = CtrlSeg { wqe_index, opcode, opmod: 0, qpn: self.shape.qpn, ds: ds as u8, fm_ce_se, imm }.encode();
        wqe[..CtrlSeg::LEN].copy_from_slice(&ctrl);

        let first_bb = self.producer & (self.shape.wqe_cnt - 1);
        let ring_len = ring.len();
        let start = first_bb as usize * SEND_WQE_BB;
        let head = wqe.len().min(ring_len - start);
        ring[start..start + head].copy_from_slice(&wqe[..head]);
        ring[..wqe.len() - head].copy_from_slice(&wqe[head..]);

        self.slots[first_bb as usize] = (wr_id, bbs);
        let mut uar = [0u8; 8];
        uar.copy_from_slice(&ctrl[..8]);
        self.last_ctrl = Some(uar);
        self.producer = self.producer.wrapping_add(bbs);
        Ok(Posted { wqe_index, first_bb, bbs })
    }

    /// The doorbell that publishes every WQE posted since the previous one, or `None` when there
    /// is nothing new. Each call moves to the other BlueFlame buffer, as `post_send_db` does, so
    /// doorbells must be rung in the order they were taken.
    pub fn doorbell(&mut self) -> Option<Doorbell> {
        let uar = self.last_ctrl.take()?;
        let bell = Doorbell { dbrec: mlx5::sq_dbrec(self.producer), uar, bf_offset: self.bf_offset, producer: self.producer };
        self.bf_offset ^= self.shape.bf_size;
        self.rung = self.producer;
        Some(bell)
    }

    /// Producer counter published by the last doorbell.
    pub fn rung(&self) -> u32 {
        self.rung
    }

    /// Retire the WQE a CQE (good or error) named by `wqe_counter`, and with it every WQE posted
    /// before it. Errs if no WQE in flight has that index (a CQE from another QP, or twice).
    pub fn complete(&mut self, wqe_counter: u16) -> Result<Retired> {
        // The full counter of the WQE: the first counter at or after `consumer` whose low 16
        // bits are `wqe_counter`. In flight is at most 2^15 blocks, so this is unambiguous.
        let ahead = u32::from(wqe_counter.wrapping_sub(self.consumer as u16));
        let index = self.consumer.wrapping_add(ahead);
        let slot = self.slots[(index & (self.shape.wqe_cnt - 1)) as usize];
        if ahead >= self.in_flight() || slot.1 == 0 {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "CQE for WQE {wqe_counter} of QP {:#x}, which is not in flight (blocks {}..{} are)",
                    self.shape.qpn,
                    self.consumer & 0xffff,
                    self.producer & 0xffff
                ),
            ));
        }
        let end = index.wrapping_add(slot.1);
        let freed_bbs = end.wrapping_sub(self.consumer);
        let mut c = self.consumer;
        while c != end {
            // Forget retired WQEs so that a repeated CQE is caught.
            let s = &mut self.slots[(c & (self.shape.wqe_cnt - 1)) as usize];
            let n = s.1.max(1);
            s.1 = 0;
            c = c.wrapping_add(n);
        }
        self.consumer = end;
        Ok(Retired { wr_id: slot.0, freed_bbs })
    }
}

/// How a stream waits on one bit of a 32-bit word.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WaitCondition {
    /// Until `word & mask != 0`: `cuStreamWaitValue32(addr, mask, CU_STREAM_WAIT_VALUE_AND)`.
    BitSet { mask: u32 },
    /// Until `word & mask == 0`: `cuStreamWaitValue32(addr, !mask, CU_STREAM_WAIT_VALUE_NOR)`
    /// (NOR waits until `!(word | value) != 0`, i.e. some bit clear in both).
    BitClear { mask: u32 },
}

impl WaitCondition {
    /// Whether `word` (read little-endian) satisfies the condition.
    pub fn holds(self, word: u32) -> bool {
        match self {
            WaitCondition::BitSet { mask } => word & mask != 0,
            WaitCondition::BitClear { mask } => word & mask == 0,
        }
    }
}

/// The wait that tells a stream the k-th CQE of a CQ has arrived: a 32-bit word at `offset`
/// bytes into the CQ buffer (`wqe_counter`, `signature`, `op_own`) and the owner-bit condition.
/// An error CQE satisfies it too: the stream is released either way, and the host (the proxy
/// or the flush machine) reads the CQE to find out which.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CqeWait {
    pub offset: usize,
    pub condition: WaitCondition,
}

/// One memory operation of a stream, on a host address (translate it through the CUDA
/// registration of its page: `cuMemHostGetDevicePointer`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamOp {
    /// `cuStreamWriteValue32(addr, value, 0)`.
    Write32 { addr: u64, value: u32 },
    /// `cuStreamWriteValue64(addr, value, 0)`.
    Write64 { addr: u64, value: u64 },
    /// `cuStreamWaitValue32` with the condition's flag and value.
    Wait32 { addr: u64, condition: WaitCondition },
}

/// What a stream does to run WQEs posted at prepare time and wait for their completion: store
/// the doorbell record (`dbrec_addr`: the send counter's word, `Mlx5Qp::dbrec_addr`), store the
/// UAR doorbell (`bf_addr`: `Mlx5Qp::bf_addr`, a page registered with
/// `CU_MEMHOSTREGISTER_IOMEMORY`), then wait on the CQE word (`cq_buf`: start of the CQ ring).
/// Default memop flags keep the stores ordered after earlier work and after each other.
pub fn stream_ops(bell: &Doorbell, dbrec_addr: u64, bf_addr: u64, cq_buf: u64, wait: CqeWait) -> [StreamOp; 3] {
    [
        StreamOp::Write32 { addr: dbrec_addr, value: bell.dbrec_word() },
        StreamOp::Write64 { addr: bf_addr + u64::from(bell.bf_offset), value: bell.uar_word() },
        StreamOp::Wait32 { addr: cq_buf + wait.offset as u64, condition: wait.condition },
    ]
}

/// `op_own` of an entry that `CompletionQueue::prepare_buffer` marked: opcode INVALID, owner 1.
pub const PREPARED_OP_OWN: u8 = mlx5::CQE_INVALID_OP_OWN | 1;

/// Consumer side of one mlx5 CQ (CQEs of 64 bytes, or 128 with the CQE in the second half).
#[derive(Debug)]
pub struct CompletionQueue {
    log_size: u32,
    cqe_size: usize,
    consumer: u32,
}

impl CompletionQueue {
    /// A reader for a CQ of `cqe_cnt` entries (`mlx5dv_cq.cqe_cnt`, a power of two) of
    /// `cqe_size` bytes (`mlx5dv_cq.cqe_size`: 64 or 128).
    pub fn new(cqe_cnt: u32, cqe_size: usize) -> Result<CompletionQueue> {
        if cqe_cnt == 0 || !cqe_cnt.is_power_of_two() {
            return Err(Error::invalid_param(format!("CQ of {cqe_cnt} entries: not a power of two")));
        }
        if cqe_size != 64 && cqe_size != 128 {
            return Err(Error::invalid_param(format!("CQE size {cqe_size}: expected 64 or 128")));
        }
        Ok(CompletionQueue { log_size: cqe_cnt.trailing_zeros(), cqe_size, consumer: 0 })
    }

    pub fn entries(&self) -> u32 {
        1 << self.log_size
    }

    pub fn log_size(&self) -> u32 {
        self.log_size
    }

    /// Bytes the ring buffer has.
    pub fn ring_len(&self) -> usize {
        self.entries() as usize * self.cqe_size
    }

    /// CQEs consumed since creation (mod 2^32).
    pub fn consumer(&self) -> u32 {
        self.consumer
    }

    /// Byte offset of the 64-byte CQE of entry `index` (any counter value: it wraps).
    pub fn cqe_offset(&self, index: u32) -> usize {
        (index & (self.entries() - 1)) as usize * self.cqe_size + (self.cqe_size - CQE_SIZE)
    }

    /// Mark every entry of a new, empty CQ "invalid, owner 1" (libmlx5 writes owner 0). The
    /// hardware writes owner 0 on the first pass, 1 on the second, and so on; with this marking
    /// an entry of the current pass is new exactly when its owner bit is the pass's, so a
    /// stream can wait on that one bit (`stream_wait`). Call before anything is posted.
    pub fn prepare_buffer(&self, buf: &mut [u8]) -> Result<()> {
        self.check_len(buf.len())?;
        for i in 0..self.entries() {
            buf[self.cqe_offset(i) + cqe_offset::OP_OWN] = PREPARED_OP_OWN;
        }
        Ok(())
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len != self.ring_len() {
            return Err(Error::invalid_param(format!(
                "CQ buffer of {len} bytes; this CQ has {} entries of {} bytes",
                self.entries(),
                self.cqe_size
            )));
        }
        Ok(())
    }

    /// Look at the CQE of the consumer position, copied out of the ring by the caller (on real
    /// memory: `op_own` first, then a read barrier, then the rest, as `mlx5_get_next_cqe`
    /// does). `None` while the hardware has not written it. Does not consume it.
    pub fn peek(&self, cqe: &[u8; CQE_SIZE]) -> Option<Result<Cqe, CqeFault>> {
        if !mlx5::cqe_is_ready(cqe[cqe_offset::OP_OWN], self.consumer, self.log_size) {
            return None;
        }
        Some(mlx5::decode_cqe(cqe))
    }

    /// Consume the CQE `peek` returned. Publish `ci_dbrec` to the CQ's doorbell record
    /// (`dbrec[CQ_SET_CI]`) now and then so the NIC knows the entries are free again.
    pub fn advance(&mut self) {
        self.consumer = self.consumer.wrapping_add(1);
    }

    /// `peek` + `advance` over a CQ buffer held as bytes.
    pub fn poll(&mut self, buf: &[u8]) -> Result<Option<Result<Cqe, CqeFault>>> {
        self.check_len(buf.len())?;
        let at = self.cqe_offset(self.consumer);
        let mut cqe = [0u8; CQE_SIZE];
        cqe.copy_from_slice(&buf[at..at + CQE_SIZE]);
        let got = self.peek(&cqe);
        if got.is_some() {
            self.advance();
        }
        Ok(got)
    }

    /// The CQ doorbell record value for the current consumer counter (`update_cons_index`).
    pub fn ci_dbrec(&self) -> [u8; 4] {
        mlx5::cq_ci_dbrec(self.consumer)
    }

    /// What a stream waits on for CQE number `index` (counted from the CQ's creation). Needs a
    /// buffer marked by `prepare_buffer`.
    pub fn stream_wait(&self, index: u32) -> CqeWait {
        let offset = self.cqe_offset(index) + cqe_offset::TAIL_WORD;
        // op_own is the last byte of the little-endian tail word: the owner bit is bit 24.
        let mask = 1u32 << 24;
        let condition =
            if mlx5::cqe_owner_for(index, self.log_size) { WaitCondition::BitSet { mask } } else { WaitCondition::BitClear { mask } };
        CqeWait { offset, condition }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gda::verbs::mlx5::{CqeOpcode, Syndrome};

    const QPN: u32 = 0x00_0abc;

    fn sq(wqe_cnt: u32) -> (SendQueue, Vec<u8>) {
        let q = SendQueue::new(SendQueueShape { qpn: QPN, wqe_cnt, bf_size: 256 }).unwrap();
        let ring = vec![0u8; q.ring_len()];
        (q, ring)
    }

    fn write(wr_id: u64, signalled: bool) -> WorkRequest {
        WorkRequest {
            wr_id,
            op: WorkOp::Write { local: LocalSge { addr: 0x1000, len: 8, lkey: 0x11 }, remote: RemoteRef { addr: 0x2000_0000, rkey: 0x22 } },
            signalled,
            fence: false,
        }
    }

    #[test]
    fn rdma_write_wqe_bytes() {
        let (mut q, mut ring) = sq(4);
        let posted = q.post(&mut ring, &write(7, true)).unwrap();
        assert_eq!(posted, Posted { wqe_index: 0, first_bb: 0, bbs: 1 });
        #[rustfmt::skip]
        let expected: [u8; 48] = [
            // ctrl: opmod 0 | index 0 | RDMA_WRITE; qpn 0xabc | ds 3; fm_ce_se CQ_UPDATE; imm 0
            0x00, 0x00, 0x00, 0x08,  0x00, 0x0a, 0xbc, 0x03,  0x00, 0x00, 0x00, 0x08,  0x00, 0x00, 0x00, 0x00,
            // raddr 0x20000000, rkey 0x22
            0x00, 0x00, 0x00, 0x00, 0x20, 0x00, 0x00, 0x00,  0x00, 0x00, 0x00, 0x22,  0x00, 0x00, 0x00, 0x00,
            // data: 8 bytes, lkey 0x11, addr 0x1000
            0x00, 0x00, 0x00, 0x08,  0x00, 0x00, 0x00, 0x11,  0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00,
        ];
        assert_eq!(&ring[..48], &expected);
        assert!(ring[48..].iter().all(|b| *b == 0));
    }

    #[test]
    fn rdma_read_wqe_unsignalled_fenced() {
        let (mut q, mut ring) = sq(4);
        q.post(&mut ring, &WorkRequest { op: WorkOp::Nop, ..write(1, false) }).unwrap();
        let wr = WorkRequest {
            wr_id: 2,
            op: WorkOp::Read { local: LocalSge { addr: 0xaa00, len: 4, lkey: 0x33 }, remote: RemoteRef { addr: 0xbb00, rkey: 0x44 } },
            signalled: false,
            fence: true,
        };
        let posted = q.post(&mut ring, &wr).unwrap();
        assert_eq!(posted.wqe_index, 1);
        // NOP at block 0: ctrl only, ds 1, unsignalled.
        assert_eq!(&ring[..16], &[0, 0, 0, 0x00, 0x00, 0x0a, 0xbc, 0x01, 0, 0, 0, 0, 0, 0, 0, 0]);
        #[rustfmt::skip]
        let expected: [u8; 48] = [
            0x00, 0x00, 0x01, 0x10,  0x00, 0x0a, 0xbc, 0x03,  0x00, 0x00, 0x00, 0x80,  0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xbb, 0x00,  0x00, 0x00, 0x00, 0x44,  0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x04,  0x00, 0x00, 0x00, 0x33,  0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xaa, 0x00,
        ];
        assert_eq!(&ring[64..112], &expected);
    }

    #[test]
    fn write_with_immediate_and_zero_length() {
        let (mut q, mut ring) = sq(2);
        let wr = WorkRequest {
            wr_id: 3,
            op: WorkOp::WriteImm {
                local: LocalSge { addr: 0, len: 0, lkey: 0 },
                remote: RemoteRef { addr: 0x10, rkey: 0x20 },
                imm: 0x0102_0304,
            },
            signalled: true,
            fence: false,
        };
        q.post(&mut ring, &wr).unwrap();
        // No data segment for a zero-length entry: ds 2.
        assert_eq!(&ring[..16], &[0, 0, 0, 0x09, 0x00, 0x0a, 0xbc, 0x02, 0, 0, 0, 0x08, 0x01, 0x02, 0x03, 0x04]);
        assert!(ring[32..64].iter().all(|b| *b == 0));
    }

    #[test]
    fn inline_write_wqe_bytes() {
        let (mut q, mut ring) = sq(4);
        let data: Vec<u8> = (1..=20).collect();
        let posted = q.post_inline_write(&mut ring, 5, &data, RemoteRef { addr: 0x40, rkey: 0x50 }, 64, false).unwrap();
        // ctrl + raddr + align(4 + 20, 16) = 16 + 16 + 32 bytes: ds 4, one block.
        assert_eq!(posted.bbs, 1);
        assert_eq!(&ring[4..8], &[0x00, 0x0a, 0xbc, 0x04]);
        assert_eq!(&ring[32..36], &[0x80, 0x00, 0x00, 20]);
        assert_eq!(&ring[36..56], &data[..]);
        assert!(ring[56..64].iter().all(|b| *b == 0));
        let err = q.post_inline_write(&mut ring, 6, &[0; 65], RemoteRef { addr: 0, rkey: 0 }, 64, false).unwrap_err();
        assert_eq!(err.status(), Status::InvalidParam);
    }

    #[test]
    fn ring_wraparound_splits_a_wqe_at_the_end() {
        let (mut q, mut ring) = sq(4);
        for i in 0..3 {
            q.post(&mut ring, &write(i, false)).unwrap();
        }
        q.complete(2).unwrap(); // blocks 0..3 done
        // A 2-block inline WQE at block 3 continues at block 0.
        let data = [0xeeu8; 60];
        let posted = q.post_inline_write(&mut ring, 9, &data, RemoteRef { addr: 0x40, rkey: 0x50 }, 128, true).unwrap();
        assert_eq!(posted, Posted { wqe_index: 3, first_bb: 3, bbs: 2 });
        // Control at block 3: index 3, ds = 2 + align(64, 16) / 16 = 6.
        assert_eq!(&ring[192..200], &[0x00, 0x00, 0x03, 0x08, 0x00, 0x0a, 0xbc, 0x06]);
        // Inline header at bytes 32..36 of the WQE, data from 36 to the end of block 3 ...
        assert_eq!(&ring[224..228], &[0x80, 0x00, 0x00, 60]);
        assert_eq!(&ring[228..256], &data[..28]);
        // ... and the rest at the start of the ring.
        assert_eq!(&ring[..32], &data[28..]);
        assert_eq!(q.producer(), 5);
        // The next WQE goes to block 1 with index 5.
        let posted = q.post(&mut ring, &write(10, true)).unwrap();
        assert_eq!(posted, Posted { wqe_index: 5, first_bb: 1, bbs: 1 });
        assert_eq!(&ring[64..68], &[0x00, 0x00, 0x05, 0x08]);
    }

    #[test]
    fn wqe_index_is_the_counter_mod_65536() {
        let (mut q, mut ring) = sq(4);
        for i in 0..70_000u32 {
            let posted = q.post(&mut ring, &write(u64::from(i), true)).unwrap();
            assert_eq!(u32::from(posted.wqe_index), i & 0xffff);
            assert_eq!(posted.first_bb, i & 3);
            assert_eq!(q.complete(posted.wqe_index).unwrap().wr_id, u64::from(i));
        }
        assert_eq!(&ring[((69_999 & 3) * 64)..][..4], &[0x00, 0x11, 0x6f, 0x08]); // 69999 & 0xffff = 0x116f
    }

    #[test]
    fn full_queue_is_refused_until_a_completion() {
        let (mut q, mut ring) = sq(2);
        q.post(&mut ring, &write(1, false)).unwrap();
        q.post(&mut ring, &write(2, true)).unwrap();
        let err = q.post(&mut ring, &write(3, true)).unwrap_err();
        assert_eq!(err.status(), Status::NoResource);
        assert!(err.message().contains("full"), "{err:?}");
        // One signalled CQE retires the unsignalled WQE before it too.
        let retired = q.complete(1).unwrap();
        assert_eq!(retired, Retired { wr_id: 2, freed_bbs: 2 });
        assert_eq!(q.free_bbs(), 2);
        q.post(&mut ring, &write(3, true)).unwrap();
    }

    #[test]
    fn completion_for_a_wqe_not_in_flight_is_an_error() {
        let (mut q, mut ring) = sq(4);
        q.post(&mut ring, &write(1, true)).unwrap();
        assert_eq!(q.complete(1).unwrap_err().status(), Status::Internal);
        q.complete(0).unwrap();
        let err = q.complete(0).unwrap_err();
        assert!(err.message().contains("not in flight"), "{err:?}");
    }

    #[test]
    fn a_length_with_the_inline_bit_is_refused() {
        let (mut q, mut ring) = sq(4);
        let mut wr = write(1, true);
        wr.op = WorkOp::Read { local: LocalSge { addr: 0x1000, len: 0x8000_0000, lkey: 0x11 }, remote: RemoteRef { addr: 0, rkey: 0 } };
        assert_eq!(q.post(&mut ring, &wr).unwrap_err().status(), Status::InvalidParam);
        assert_eq!(q.producer(), 0);
        assert!(ring.iter().all(|b| *b == 0));
    }

    #[test]
    fn wrong_ring_size_is_refused() {
        let (mut q, _) = sq(4);
        let mut small = vec![0u8; 128];
        assert_eq!(q.post(&mut small, &write(1, true)).unwrap_err().status(), Status::InvalidParam);
        assert!(SendQueue::new(SendQueueShape { qpn: 1, wqe_cnt: 3, bf_size: 0 }).is_err());
        assert!(SendQueue::new(SendQueueShape { qpn: 1 << 24, wqe_cnt: 4, bf_size: 0 }).is_err());
    }

    #[test]
    fn doorbell_values_and_blueflame_alternation() {
        let (mut q, mut ring) = sq(8);
        assert_eq!(q.doorbell(), None);
        q.post(&mut ring, &write(1, false)).unwrap();
        q.post(&mut ring, &write(2, true)).unwrap();
        let bell = q.doorbell().unwrap();
        // Record: be32(producer 2); UAR: the first 8 bytes of the *last* WQE's control.
        assert_eq!(bell.dbrec, [0, 0, 0, 2]);
        assert_eq!(bell.uar, [0x00, 0x00, 0x01, 0x08, 0x00, 0x0a, 0xbc, 0x03]);
        assert_eq!(bell.uar, ring[64..72]);
        assert_eq!(bell.bf_offset, 0);
        assert_eq!(Doorbell::DBREC_OFFSET, 4);
        assert_eq!(bell.dbrec_word().to_le_bytes(), bell.dbrec);
        assert_eq!(bell.uar_word().to_le_bytes(), bell.uar);
        assert_eq!(q.doorbell(), None);
        q.post(&mut ring, &write(3, true)).unwrap();
        assert_eq!(q.doorbell().unwrap().bf_offset, 256);
        q.post(&mut ring, &write(4, true)).unwrap();
        let bell = q.doorbell().unwrap();
        assert_eq!(bell.bf_offset, 0);
        assert_eq!(bell.dbrec, [0, 0, 0, 4]);
        assert_eq!(q.rung(), 4);
    }

    #[test]
    fn a_prepared_write_becomes_three_stream_operations() {
        let (mut q, mut ring) = sq(8);
        let cq = CompletionQueue::new(16, 64).unwrap();
        q.post(&mut ring, &write(1, false)).unwrap();
        q.post(&mut ring, &write(2, true)).unwrap();
        let bell = q.doorbell().unwrap();
        let ops = stream_ops(&bell, 0x1004, 0x2800, 0x9000, cq.stream_wait(0));
        assert_eq!(
            ops,
            [
                // be32(2) as a little-endian word
                StreamOp::Write32 { addr: 0x1004, value: 0x0200_0000 },
                // ctrl bytes 00 00 01 08 00 0a bc 03 as a little-endian word
                StreamOp::Write64 { addr: 0x2800, value: 0x03bc_0a00_0801_0000 },
                // entry 0's tail word, owner bit (bit 24) clear on the first pass
                StreamOp::Wait32 { addr: 0x9000 + 60, condition: WaitCondition::BitClear { mask: 1 << 24 } },
            ]
        );
        q.post(&mut ring, &write(3, true)).unwrap();
        let bell = q.doorbell().unwrap();
        let StreamOp::Write64 { addr, .. } = stream_ops(&bell, 0x1004, 0x2800, 0x9000, cq.stream_wait(1))[1] else { panic!() };
        assert_eq!(addr, 0x2800 + 256, "the second doorbell goes to the other BlueFlame buffer");
    }

    /// Write a CQE into a CQ ring as the hardware would for completion number `n`.
    fn hw_write(cq: &CompletionQueue, buf: &mut [u8], n: u32, opcode: u8, wqe_counter: u16) {
        let at = cq.cqe_offset(n);
        let owner = u8::from(mlx5::cqe_owner_for(n, cq.log_size()));
        buf[at..at + 64].fill(0);
        buf[at + 56..at + 60].copy_from_slice(&(0x1000_0000 | QPN).to_be_bytes());
        buf[at + 60..at + 62].copy_from_slice(&wqe_counter.to_be_bytes());
        buf[at + 63] = opcode << 4 | owner;
    }

    #[test]
    fn completion_queue_follows_the_owner_bit_across_wraps() {
        let cq = CompletionQueue::new(4, 64).unwrap();
        let mut buf = vec![0u8; cq.ring_len()];
        let mut cq = cq;
        cq.prepare_buffer(&mut buf).unwrap();
        assert_eq!(cq.poll(&buf).unwrap(), None);
        for n in 0..12u32 {
            // Not yet written for this pass: the previous pass's entry (or the marking) is there.
            assert_eq!(cq.poll(&buf).unwrap(), None, "entry {n} before the hardware wrote it");
            let wait = cq.stream_wait(n);
            let word = |buf: &[u8]| u32::from_le_bytes(buf[wait.offset..wait.offset + 4].try_into().unwrap());
            assert!(!wait.condition.holds(word(&buf)), "stream released early for CQE {n}");
            hw_write(&cq, &mut buf, n, 0, n as u16);
            assert!(wait.condition.holds(word(&buf)), "stream not released for CQE {n}");
            let cqe = cq.poll(&buf).unwrap().unwrap().unwrap();
            assert_eq!(cqe.opcode, CqeOpcode::Req);
            assert_eq!(cqe.wqe_counter, n as u16);
            assert_eq!(cqe.owner, (n / 4) % 2 == 1);
            assert_eq!(cq.consumer(), n + 1);
        }
        assert_eq!(cq.ci_dbrec(), [0, 0, 0, 12]);
    }

    #[test]
    fn stream_wait_words_and_conditions() {
        let cq = CompletionQueue::new(8, 64).unwrap();
        // Entry 3: tail word at 3 * 64 + 60; pass 0 expects owner 0 (bit 24 clear).
        assert_eq!(cq.stream_wait(3), CqeWait { offset: 252, condition: WaitCondition::BitClear { mask: 1 << 24 } });
        assert_eq!(cq.stream_wait(11), CqeWait { offset: 252, condition: WaitCondition::BitSet { mask: 1 << 24 } });
        // 128-byte CQEs: the 64-byte CQE is the second half.
        let cq = CompletionQueue::new(8, 128).unwrap();
        assert_eq!(cq.cqe_offset(1), 192);
        assert_eq!(cq.stream_wait(1).offset, 252);
        // The prepared marking does not satisfy a first-pass wait; libmlx5's would.
        let marked = u32::from_le_bytes([0, 0, 0, PREPARED_OP_OWN]);
        assert!(!cq.stream_wait(0).condition.holds(marked));
        assert!(cq.stream_wait(0).condition.holds(u32::from_le_bytes([0, 0, 0, mlx5::CQE_INVALID_OP_OWN])));
    }

    #[test]
    fn error_cqe_is_consumed_and_names_the_wqe() {
        let mut cq = CompletionQueue::new(2, 64).unwrap();
        let mut buf = vec![0u8; cq.ring_len()];
        cq.prepare_buffer(&mut buf).unwrap();
        hw_write(&cq, &mut buf, 0, 13, 4);
        buf[55] = 0x15; // transport retry exceeded
        buf[54] = 0x81;
        let Some(Err(CqeFault::Error(e))) = cq.poll(&buf).unwrap() else { panic!("expected an error CQE") };
        assert_eq!(e.syndrome, Syndrome::TransportRetryExceeded);
        assert_eq!(e.wqe_counter, 4);
        assert_eq!(e.vendor_syndrome, 0x81);
        assert_eq!(cq.consumer(), 1);
    }

    #[test]
    fn send_and_completion_queues_together() {
        let (mut sq, mut ring) = sq(4);
        let mut cq = CompletionQueue::new(4, 64).unwrap();
        let mut cqbuf = vec![0u8; cq.ring_len()];
        cq.prepare_buffer(&mut cqbuf).unwrap();
        for (completions, round) in (0..10u64).enumerate() {
            sq.post(&mut ring, &write(round * 2, false)).unwrap();
            let last = sq.post(&mut ring, &write(round * 2 + 1, true)).unwrap();
            sq.doorbell().unwrap();
            // The NIC executes both and writes one CQE for the signalled one.
            hw_write(&cq, &mut cqbuf, completions as u32, 0, last.wqe_index);
            let cqe = cq.poll(&cqbuf).unwrap().unwrap().unwrap();
            let retired = sq.complete(cqe.wqe_counter).unwrap();
            assert_eq!(retired, Retired { wr_id: round * 2 + 1, freed_bbs: 2 });
            assert_eq!(sq.in_flight(), 0);
        }
    }
}

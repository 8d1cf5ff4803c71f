//! mlx5 (ConnectX) work-queue and completion-queue formats, byte for byte.
//!
//! The GPU cannot call `ibv_post_send` or `ibv_poll_cq`: it can only store words and wait on
//! words. So the verbs engine writes the send WQEs itself, gives the stream the two doorbell
//! words to store, and tells it which CQE word to wait on. That needs the hardware formats,
//! which this module encodes and decodes without touching any device, so that every format is
//! unit-tested on machines with no NIC.
//!
//! Source of the layouts: the mlx5 Programmer's Reference Manual as rdma-core implements it in
//! `providers/mlx5` (`mlx5dv.h`: `struct mlx5_wqe_ctrl_seg`, `mlx5_wqe_raddr_seg`,
//! `mlx5_wqe_data_seg`, `mlx5_cqe64`, `mlx5_err_cqe`; `wqe.h`: `mlx5_wqe_inline_seg`; `qp.c`:
//! `_mlx5_post_send`, `set_data_inl_seg`, `post_send_db`; `cq.c`: `get_sw_cqe`,
//! `mlx5_handle_error_cqe`, `update_cons_index`). Every multi-byte field is big-endian.
//!
//! What is here: the segment encoders, the doorbell-record and UAR doorbell values, and the
//! CQE decoder with the ownership test. The ring bookkeeping built on them (producer index,
//! wraparound, BlueFlame offset, consumer index) is in `super::queue`.

use std::fmt;

use crate::error::{Error, Status};

/// A send WQE is built of 64-byte basic blocks (`MLX5_SEND_WQE_BB`).
pub const SEND_WQE_BB: usize = 64;
/// log2 of `SEND_WQE_BB` (`MLX5_SEND_WQE_SHIFT`).
pub const SEND_WQE_SHIFT: u32 = 6;
/// Segments are counted in 16-byte units: the `ds` field of the control segment.
pub const DS_UNIT: usize = 16;
/// Largest `ds` the 6-bit field can hold (63 units = 1008 bytes, just under 16 basic blocks).
pub const MAX_DS: usize = 0x3f;

/// Index of the receive-queue counter in a QP's doorbell record (`MLX5_RCV_DBR`).
pub const RCV_DBR: usize = 0;
/// Index of the send-queue counter in a QP's doorbell record (`MLX5_SND_DBR`): the 32-bit
/// word at byte offset 4.
pub const SND_DBR: usize = 1;
/// Index of the consumer counter in a CQ's doorbell record (`MLX5_CQ_SET_CI`).
pub const CQ_SET_CI: usize = 0;
/// Index of the arm word in a CQ's doorbell record (`MLX5_CQ_ARM_DB`).
pub const CQ_ARM_DB: usize = 1;

/// The `byte_count` bit that marks an inline data segment (`MLX5_INLINE_SEG`).
pub const INLINE_SEG: u32 = 0x8000_0000;
/// The lkey of an empty scatter entry (`MLX5_INVALID_LKEY`).
pub const INVALID_LKEY: u32 = 0x100;

/// `fm_ce_se` bits of the control segment (`MLX5_WQE_CTRL_*`).
pub mod ctrl_flags {
    /// Write a CQE when this WQE completes (`MLX5_WQE_CTRL_CQ_UPDATE`, 2 << 2): the WQE is
    /// *signalled*. Without it a successful WQE completes silently; a failing one still
    /// writes an error CQE.
    pub const CQ_UPDATE: u8 = 2 << 2;
    /// Solicited event (`MLX5_WQE_CTRL_SOLICITED`).
    pub const SOLICITED: u8 = 1 << 1;
    /// Wait for earlier RDMA reads and atomics to finish (`MLX5_WQE_CTRL_FENCE`, 4 << 5).
    pub const FENCE: u8 = 4 << 5;
    /// `MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE`.
    pub const INITIATOR_SMALL_FENCE: u8 = 1 << 5;
}

/// The send opcodes this engine posts (`MLX5_OPCODE_*`), the low byte of `opmod_idx_opcode`.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Does nothing; useful to pad a ring or to get a completion without traffic.
    Nop = 0x00,
    RdmaWrite = 0x08,
    RdmaWriteImm = 0x09,
    RdmaRead = 0x10,
}

impl Opcode {
    pub fn name(self) -> &'static str {
        opcode_name(self as u8)
    }
}

/// The PRM name of a send opcode byte, as it appears in CQEs (also ones we never post).
pub fn opcode_name(opcode: u8) -> &'static str {
    match opcode {
        0x00 => "NOP",
        0x01 => "SEND_INVAL",
        0x08 => "RDMA_WRITE",
        0x09 => "RDMA_WRITE_IMM",
        0x0a => "SEND",
        0x0b => "SEND_IMM",
        0x0e => "TSO",
        0x10 => "RDMA_READ",
        0x11 => "ATOMIC_CS",
        0x12 => "ATOMIC_FA",
        0x14 => "ATOMIC_MASKED_CS",
        0x15 => "ATOMIC_MASKED_FA",
        0x1b => "LOCAL_INVAL",
        0x25 => "UMR",
        _ => "unknown opcode",
    }
}

/// The control segment (`struct mlx5_wqe_ctrl_seg`, 16 bytes), first in every send WQE.
///
/// | bytes  | field                 | contents                                           |
/// |--------|-----------------------|----------------------------------------------------|
/// | 0..4   | `opmod_idx_opcode`    | opmod << 24 \| WQE index (16 bits) << 8 \| opcode   |
/// | 4..8   | `qpn_ds`              | QP number (24 bits) << 8 \| ds (6 bits)             |
/// | 8      | `signature`           | 0 unless the QP was created with WQE signatures     |
/// | 9..11  | `dci_stream_channel_id` | 0 (DC only)                                      |
/// | 11     | `fm_ce_se`            | fence mode, CQ update, solicited (`ctrl_flags`)     |
/// | 12..16 | `imm`                 | immediate data (RDMA_WRITE_IMM), else 0             |
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CtrlSeg {
    /// The producer counter of the WQE's first basic block, modulo 2^16 (`sq.cur_post`).
    pub wqe_index: u16,
    pub opcode: Opcode,
    pub opmod: u8,
    /// 24 bits.
    pub qpn: u32,
    /// Size of the whole WQE, this segment included, in 16-byte units.
    pub ds: u8,
    pub fm_ce_se: u8,
    /// The immediate value as the receiver will read it (stored big-endian, i.e. in network
    /// order: `ibv_send_wr.imm_data` is already `__be32`, this is the host value before
    /// `htonl`).
    pub imm: u32,
}

impl CtrlSeg {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; 16] {
        debug_assert!(self.qpn < 1 << 24, "QP number {:#x} has more than 24 bits", self.qpn);
        debug_assert!(usize::from(self.ds) <= MAX_DS, "ds {} does not fit 6 bits", self.ds);
        let mut b = [0u8; 16];
        let opmod_idx_opcode = (u32::from(self.opmod) << 24) | (u32::from(self.wqe_index) << 8) | u32::from(self.opcode as u8);
        b[0..4].copy_from_slice(&opmod_idx_opcode.to_be_bytes());
        b[4..8].copy_from_slice(&(((self.qpn & 0xff_ffff) << 8) | u32::from(self.ds & 0x3f)).to_be_bytes());
        // b[8] signature and b[9..11] dci_stream_channel_id stay 0 (qp.c clears bytes 8..12).
        b[11] = self.fm_ce_se;
        b[12..16].copy_from_slice(&self.imm.to_be_bytes());
        b
    }
}

/// The remote-address segment (`struct mlx5_wqe_raddr_seg`, 16 bytes) of RDMA read/write.
///
/// | bytes  | field      |
/// |--------|------------|
/// | 0..8   | `raddr`    |
/// | 8..12  | `rkey`     |
/// | 12..16 | reserved 0 |
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RaddrSeg {
    pub raddr: u64,
    pub rkey: u32,
}

impl RaddrSeg {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.raddr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }
}

/// A data (gather/scatter pointer) segment (`struct mlx5_wqe_data_seg`, 16 bytes): the local
/// side of a write (gather) or a read (scatter).
///
/// | bytes  | field        |
/// |--------|--------------|
/// | 0..4   | `byte_count` |
/// | 4..8   | `lkey`       |
/// | 8..16  | `addr`       |
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DataSeg {
    pub byte_count: u32,
    pub lkey: u32,
    pub addr: u64,
}

impl DataSeg {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.byte_count.to_be_bytes());
        b[4..8].copy_from_slice(&self.lkey.to_be_bytes());
        b[8..16].copy_from_slice(&self.addr.to_be_bytes());
        b
    }
}

/// The 4-byte header of an inline data segment (`struct mlx5_wqe_inline_seg`): the length
/// with `INLINE_SEG` set. The data follows at once, and the segment is padded to 16 bytes.
pub fn inline_header(len: u32) -> [u8; 4] {
    debug_assert!(len & INLINE_SEG == 0, "inline length {len} too large");
    (len | INLINE_SEG).to_be_bytes()
}

/// 16-byte units an inline segment of `len` data bytes takes (`set_data_inl_seg`'s `sz`):
/// `align(len + 4, 16) / 16`, and 0 for no data (no segment at all).
pub fn inline_ds(len: usize) -> usize {
    if len == 0 { 0 } else { (len + 4).div_ceil(DS_UNIT) }
}

/// Basic blocks a WQE of `ds` 16-byte units occupies (`DIV_ROUND_UP(size * 16, MLX5_SEND_WQE_BB)`).
pub fn wqe_bbs(ds: usize) -> usize {
    (ds * DS_UNIT).div_ceil(SEND_WQE_BB)
}

/// The send-queue doorbell record value: the producer counter after the last posted WQE,
/// low 16 bits, stored big-endian in the 32-bit word `dbrec[SND_DBR]` (`post_send_db`:
/// `qp->db[MLX5_SND_DBR] = htobe32(qp->sq.cur_post & 0xffff)`).
pub fn sq_dbrec(producer: u32) -> [u8; 4] {
    (producer & 0xffff).to_be_bytes()
}

/// The CQ doorbell record value: the consumer counter, low 24 bits, stored big-endian in
/// `dbrec[CQ_SET_CI]` (`update_cons_index`). The NIC uses it to detect CQ overrun.
pub fn cq_ci_dbrec(consumer: u32) -> [u8; 4] {
    (consumer & 0xff_ffff).to_be_bytes()
}

/// The value a little-endian 32-bit store (the CPU's, or `cuStreamWriteValue32`) must be given
/// so that memory holds `bytes` in order.
pub fn le_word32(bytes: [u8; 4]) -> u32 {
    u32::from_le_bytes(bytes)
}

/// The value a little-endian 64-bit store (`cuStreamWriteValue64`) must be given so that memory
/// holds `bytes` in order.
pub fn le_word64(bytes: [u8; 8]) -> u64 {
    u64::from_le_bytes(bytes)
}

/// Size of the CQE format this engine reads (`struct mlx5_cqe64`). A CQ created with 128-byte
/// CQEs holds the same 64 bytes in the second half of each entry.
pub const CQE_SIZE: usize = 64;

/// Byte offsets in a 64-byte CQE (`struct mlx5_cqe64` and, for errors, `struct mlx5_err_cqe`).
pub mod cqe_offset {
    /// `srqn_uidx` (user index of the QP when CQE version 1 is used), big-endian, 24 bits.
    pub const SRQN_UIDX: usize = 32;
    /// `imm_inval_pkey`: immediate data of a RESP_WR_IMM / RESP_SEND_IMM.
    pub const IMM: usize = 36;
    /// `byte_cnt`: bytes transferred (for a requester CQE of an RDMA read: bytes read).
    pub const BYTE_CNT: usize = 44;
    /// `timestamp`, 64 bits.
    pub const TIMESTAMP: usize = 48;
    /// `mlx5_err_cqe.vendor_err_synd`.
    pub const VENDOR_ERR_SYND: usize = 54;
    /// `mlx5_err_cqe.syndrome`.
    pub const SYNDROME: usize = 55;
    /// `sop_drop_qpn` / `s_wqe_opcode_qpn`: send-WQE opcode << 24 | QP number (24 bits).
    pub const SOP_DROP_QPN: usize = 56;
    /// `wqe_counter`, 16 bits: the WQE index of the completed (or failed) send WQE.
    pub const WQE_COUNTER: usize = 60;
    /// `signature`.
    pub const SIGNATURE: usize = 62;
    /// `op_own`: CQE opcode << 4 | format << 2 | solicited << 1 | owner.
    pub const OP_OWN: usize = 63;
    /// The 32-bit word that holds `wqe_counter`, `signature` and `op_own`: what a stream waits
    /// on (little-endian load: `op_own` is bits 24..32, the owner bit is bit 24).
    pub const TAIL_WORD: usize = 60;
}

/// The `op_own` value libmlx5 gives an entry nobody wrote (`MLX5_CQE_INVALID << 4`).
pub const CQE_INVALID_OP_OWN: u8 = 0xf0;

/// The CQE opcode, the high nibble of `op_own` (`MLX5_CQE_*`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CqeOpcode {
    /// A send WQE (ours: write, read, nop) completed.
    Req,
    RespWrImm,
    RespSend,
    RespSendImm,
    RespSendInv,
    ResizeCq,
    NoPacket,
    SigErr,
    /// A send WQE failed (`MLX5_CQE_REQ_ERR`).
    ReqErr,
    /// A receive failed (`MLX5_CQE_RESP_ERR`).
    RespErr,
    /// Never written by the hardware (`MLX5_CQE_INVALID`).
    Invalid,
    Other(u8),
}

impl CqeOpcode {
    pub fn from_nibble(n: u8) -> CqeOpcode {
        match n & 0xf {
            0 => CqeOpcode::Req,
            1 => CqeOpcode::RespWrImm,
            2 => CqeOpcode::RespSend,
            3 => CqeOpcode::RespSendImm,
            4 => CqeOpcode::RespSendInv,
            5 => CqeOpcode::ResizeCq,
            6 => CqeOpcode::NoPacket,
            12 => CqeOpcode::SigErr,
            13 => CqeOpcode::ReqErr,
            14 => CqeOpcode::RespErr,
            15 => CqeOpcode::Invalid,
            n => CqeOpcode::Other(n),
        }
    }
}

/// The CQE format, bits 2..4 of `op_own`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CqeFormat {
    /// Data (if any) went to the scatter list.
    Plain,
    /// Up to 32 bytes of data were scattered into the CQE itself (`MLX5_INLINE_SCATTER_32`):
    /// for a small RDMA read the local buffer is *not* written.
    Inline32,
    /// Up to 64 bytes scattered into the (128-byte) CQE (`MLX5_INLINE_SCATTER_64`).
    Inline64,
    /// A compressed CQE block (mini-CQEs). We create CQs without compression and refuse these.
    Compressed,
}

/// Error syndromes of an error CQE (`MLX5_CQE_SYNDROME_*`), with the `ibv_wc_status` each
/// maps to in `mlx5_handle_error_cqe`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Syndrome {
    LocalLength,
    LocalQpOp,
    LocalProtection,
    /// The QP was already in the error state: this WQE was flushed, not executed.
    WrFlush,
    MwBind,
    BadResponse,
    LocalAccess,
    RemoteInvalidRequest,
    RemoteAccess,
    RemoteOperation,
    TransportRetryExceeded,
    RnrRetryExceeded,
    RemoteAborted,
    Other(u8),
}

impl Syndrome {
    pub fn from_byte(b: u8) -> Syndrome {
        match b {
            0x01 => Syndrome::LocalLength,
            0x02 => Syndrome::LocalQpOp,
            0x04 => Syndrome::LocalProtection,
            0x05 => Syndrome::WrFlush,
            0x06 => Syndrome::MwBind,
            0x10 => Syndrome::BadResponse,
            0x11 => Syndrome::LocalAccess,
            0x12 => Syndrome::RemoteInvalidRequest,
            0x13 => Syndrome::RemoteAccess,
            0x14 => Syndrome::RemoteOperation,
            0x15 => Syndrome::TransportRetryExceeded,
            0x16 => Syndrome::RnrRetryExceeded,
            0x22 => Syndrome::RemoteAborted,
            b => Syndrome::Other(b),
        }
    }

    pub fn byte(self) -> u8 {
        match self {
            Syndrome::LocalLength => 0x01,
            Syndrome::LocalQpOp => 0x02,
            Syndrome::LocalProtection => 0x04,
            Syndrome::WrFlush => 0x05,
            Syndrome::MwBind => 0x06,
            Syndrome::BadResponse => 0x10,
            Syndrome::LocalAccess => 0x11,
            Syndrome::RemoteInvalidRequest => 0x12,
            Syndrome::RemoteAccess => 0x13,
            Syndrome::RemoteOperation => 0x14,
            Syndrome::TransportRetryExceeded => 0x15,
            Syndrome::RnrRetryExceeded => 0x16,
            Syndrome::RemoteAborted => 0x22,
            Syndrome::Other(b) => b,
        }
    }

    /// Human text, as `ibv_wc_status_str` words the matching `ibv_wc_status`.
    pub fn description(self) -> &'static str {
        match self {
            Syndrome::LocalLength => "local length error",
            Syndrome::LocalQpOp => "local QP operation error",
            Syndrome::LocalProtection => "local protection error",
            Syndrome::WrFlush => "work request flushed (QP in error state)",
            Syndrome::MwBind => "memory window bind error",
            Syndrome::BadResponse => "bad response error",
            Syndrome::LocalAccess => "local access error",
            Syndrome::RemoteInvalidRequest => "remote invalid request error",
            Syndrome::RemoteAccess => "remote access error",
            Syndrome::RemoteOperation => "remote operation error",
            Syndrome::TransportRetryExceeded => "transport retry counter exceeded",
            Syndrome::RnrRetryExceeded => "RNR retry counter exceeded",
            Syndrome::RemoteAborted => "remote aborted error",
            Syndrome::Other(_) => "general error",
        }
    }
}

/// A successful CQE, decoded.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Cqe {
    pub opcode: CqeOpcode,
    pub format: CqeFormat,
    pub owner: bool,
    /// For a requester CQE: the WQE index (producer counter mod 2^16) of the signalled WQE.
    /// Every WQE posted before it on the same send queue has completed too.
    pub wqe_counter: u16,
    /// For a requester CQE: the opcode of the completed send WQE (`sop_drop_qpn >> 24`).
    pub wqe_opcode: u8,
    pub qpn: u32,
    pub byte_cnt: u32,
    pub imm: u32,
    pub timestamp: u64,
}

/// An error CQE (`MLX5_CQE_REQ_ERR` / `MLX5_CQE_RESP_ERR`), decoded: what failed and why.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CqeError {
    /// `true` for a send WQE (REQ_ERR), `false` for a receive (RESP_ERR).
    pub requester: bool,
    pub syndrome: Syndrome,
    /// The vendor syndrome (`vendor_err_synd`, `ibv_wc.vendor_err`): the firmware's own reason
    /// code, what a NIC vendor asks for.
    pub vendor_syndrome: u8,
    /// The WQE index of the failed WQE.
    pub wqe_counter: u16,
    /// Opcode of the failed send WQE (`s_wqe_opcode_qpn >> 24`; meaningful for REQ_ERR).
    pub wqe_opcode: u8,
    pub qpn: u32,
}

impl CqeError {
    /// The crate error for this CQE: `Canceled` for a WQE flushed because the QP had already
    /// failed, `PeerFailed` when retries to the peer ran out, `DeviceError` otherwise; the
    /// message is the decoded CQE.
    pub fn to_error(&self) -> Error {
        let status = match self.syndrome {
            Syndrome::WrFlush => Status::Canceled,
            Syndrome::TransportRetryExceeded | Syndrome::RnrRetryExceeded => Status::PeerFailed,
            _ => Status::DeviceError,
        };
        Error::new(status, self.to_string())
    }
}

impl fmt::Display for CqeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = if self.requester { "requester" } else { "responder" };
        write!(
            f,
            "{side} error CQE: {} (syndrome {:#04x}, vendor syndrome {:#04x}) on WQE {}",
            self.syndrome.description(),
            self.syndrome.byte(),
            self.vendor_syndrome,
            self.wqe_counter
        )?;
        if self.requester {
            write!(f, " ({} {:#04x})", opcode_name(self.wqe_opcode), self.wqe_opcode)?;
        }
        write!(f, " of QP {:#x}", self.qpn)
    }
}

/// Why a CQE that the software owns could not be used.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CqeFault {
    /// The hardware reported a failed work request.
    Error(CqeError),
    /// A CQE this reader does not handle (compressed block, resize, signature error, ...):
    /// the CQ was created with features this engine does not use.
    Unsupported { op_own: u8 },
}

impl fmt::Display for CqeFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CqeFault::Error(e) => e.fmt(f),
            CqeFault::Unsupported { op_own } => {
                let opcode = CqeOpcode::from_nibble(op_own >> 4);
                write!(f, "unsupported CQE (op_own {op_own:#04x}: {opcode:?}")?;
                if (op_own >> 2) & 3 == 3 {
                    f.write_str(", compressed: create the CQ without CQE compression")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// The owner bit the hardware writes into CQE number `index` (counting from 0 since the CQ was
/// created, not wrapped): it flips on every pass over a CQ of `2^log_cq_size` entries, starting
/// at 0 (`get_sw_cqe`: `!!(n & (cq->cqe + 1))`).
pub fn cqe_owner_for(index: u32, log_cq_size: u32) -> bool {
    // `checked_shr`: a `log_cq_size` of 32 or more (no such CQ) must not panic.
    index.checked_shr(log_cq_size).unwrap_or(0) & 1 == 1
}

/// Whether entry `index` holds a CQE the hardware has written for this pass: its opcode is not
/// `INVALID` and its owner bit is the one of the pass (`get_sw_cqe`).
pub fn cqe_is_ready(op_own: u8, index: u32, log_cq_size: u32) -> bool {
    op_own >> 4 != 0xf && (op_own & 1 == 1) == cqe_owner_for(index, log_cq_size)
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(w)
}

/// Decode a 64-byte CQE that `cqe_is_ready` said the software owns.
pub fn decode_cqe(b: &[u8; CQE_SIZE]) -> Result<Cqe, CqeFault> {
    let op_own = b[cqe_offset::OP_OWN];
    let opcode = CqeOpcode::from_nibble(op_own >> 4);
    let format = match (op_own >> 2) & 3 {
        0 => CqeFormat::Plain,
        1 => CqeFormat::Inline32,
        2 => CqeFormat::Inline64,
        _ => CqeFormat::Compressed,
    };
    let sop_drop_qpn = be32(b, cqe_offset::SOP_DROP_QPN);
    let wqe_counter = be16(b, cqe_offset::WQE_COUNTER);
    match opcode {
        CqeOpcode::ReqErr | CqeOpcode::RespErr => Err(CqeFault::Error(CqeError {
            requester: opcode == CqeOpcode::ReqErr,
            syndrome: Syndrome::from_byte(b[cqe_offset::SYNDROME]),
            vendor_syndrome: b[cqe_offset::VENDOR_ERR_SYND],
            wqe_counter,
            wqe_opcode: (sop_drop_qpn >> 24) as u8,
            qpn: sop_drop_qpn & 0xff_ffff,
        })),
        _ if format == CqeFormat::Compressed => Err(CqeFault::Unsupported { op_own }),
        CqeOpcode::Req | CqeOpcode::RespWrImm | CqeOpcode::RespSend | CqeOpcode::RespSendImm | CqeOpcode::RespSendInv => Ok(Cqe {
            opcode,
            format,
            owner: op_own & 1 == 1,
            wqe_counter,
            wqe_opcode: (sop_drop_qpn >> 24) as u8,
            qpn: sop_drop_qpn & 0xff_ffff,
            byte_cnt: be32(b, cqe_offset::BYTE_CNT),
            imm: be32(b, cqe_offset::IMM),
            timestamp: be64(b, cqe_offset::TIMESTAMP),
        }),
        _ => Err(CqeFault::Unsupported { op_own }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_segment_matches_mlx5_wqe_ctrl_seg() {
        let seg = CtrlSeg {
            wqe_index: 0x1234,
            opcode: Opcode::RdmaWrite,
            opmod: 0,
            qpn: 0x00ab_cdef,
            ds: 3,
            fm_ce_se: ctrl_flags::CQ_UPDATE,
            imm: 0,
        };
        #[rustfmt::skip]
        let expected: [u8; 16] = [
            // 0..4 opmod_idx_opcode = be32(0 << 24 | 0x1234 << 8 | 0x08)
            0x00, 0x12, 0x34, 0x08,
            // 4..8 qpn_ds = be32(0xabcdef << 8 | 3)
            0xab, 0xcd, 0xef, 0x03,
            // 8 signature, 9..11 dci_stream_channel_id, 11 fm_ce_se = CQ_UPDATE (0x08)
            0x00, 0x00, 0x00, 0x08,
            // 12..16 imm
            0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(seg.encode(), expected);
    }

    #[test]
    fn ctrl_segment_unsignalled_with_immediate_and_opmod() {
        let seg =
            CtrlSeg { wqe_index: 0xffff, opcode: Opcode::RdmaWriteImm, opmod: 0x5a, qpn: 0x000102, ds: 63, fm_ce_se: 0, imm: 0xdead_beef };
        #[rustfmt::skip]
        let expected: [u8; 16] = [
            0x5a, 0xff, 0xff, 0x09, // opmod 0x5a, index 0xffff, RDMA_WRITE_IMM
            0x00, 0x01, 0x02, 0x3f, // QP 0x000102, ds 63
            0x00, 0x00, 0x00, 0x00, // unsignalled: fm_ce_se 0
            0xde, 0xad, 0xbe, 0xef, // imm, network order
        ];
        assert_eq!(seg.encode(), expected);
    }

    #[test]
    fn flag_values_match_mlx5dv() {
        assert_eq!(ctrl_flags::CQ_UPDATE, 0x08);
        assert_eq!(ctrl_flags::SOLICITED, 0x02);
        assert_eq!(ctrl_flags::FENCE, 0x80);
        assert_eq!(ctrl_flags::INITIATOR_SMALL_FENCE, 0x20);
        assert_eq!(Opcode::Nop as u8, 0x00);
        assert_eq!(Opcode::RdmaWrite as u8, 0x08);
        assert_eq!(Opcode::RdmaWriteImm as u8, 0x09);
        assert_eq!(Opcode::RdmaRead as u8, 0x10);
        assert_eq!(1usize << SEND_WQE_SHIFT, SEND_WQE_BB);
    }

    #[test]
    fn raddr_segment_matches_mlx5_wqe_raddr_seg() {
        let seg = RaddrSeg { raddr: 0x0011_2233_4455_6677, rkey: 0x8899_aabb };
        #[rustfmt::skip]
        let expected: [u8; 16] = [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, // 0..8 raddr
            0x88, 0x99, 0xaa, 0xbb,                         // 8..12 rkey
            0x00, 0x00, 0x00, 0x00,                         // 12..16 reserved
        ];
        assert_eq!(seg.encode(), expected);
    }

    #[test]
    fn data_segment_matches_mlx5_wqe_data_seg() {
        let seg = DataSeg { byte_count: 0x0000_1000, lkey: 0x0102_0304, addr: 0x7f00_dead_beef_0000 };
        #[rustfmt::skip]
        let expected: [u8; 16] = [
            0x00, 0x00, 0x10, 0x00,                         // 0..4 byte_count
            0x01, 0x02, 0x03, 0x04,                         // 4..8 lkey
            0x7f, 0x00, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x00, // 8..16 addr
        ];
        assert_eq!(seg.encode(), expected);
    }

    #[test]
    fn inline_segment_header_and_size() {
        // byte_count = be32(len | MLX5_INLINE_SEG)
        assert_eq!(inline_header(5), [0x80, 0x00, 0x00, 0x05]);
        assert_eq!(inline_header(0x1234), [0x80, 0x00, 0x12, 0x34]);
        // sz = align(len + 4, 16) / 16
        assert_eq!(inline_ds(0), 0);
        assert_eq!(inline_ds(1), 1);
        assert_eq!(inline_ds(12), 1);
        assert_eq!(inline_ds(13), 2);
        assert_eq!(inline_ds(60), 4);
        assert_eq!(inline_ds(61), 5);
    }

    #[test]
    fn wqe_sizes_in_basic_blocks() {
        assert_eq!(wqe_bbs(1), 1); // NOP: control only
        assert_eq!(wqe_bbs(3), 1); // write/read: ctrl + raddr + data = 48 bytes
        assert_eq!(wqe_bbs(4), 1);
        assert_eq!(wqe_bbs(5), 2);
        assert_eq!(wqe_bbs(MAX_DS), 16);
    }

    #[test]
    fn doorbell_record_values() {
        // htobe32(cur_post & 0xffff)
        assert_eq!(sq_dbrec(0x0001_0005), [0x00, 0x00, 0x00, 0x05]);
        assert_eq!(sq_dbrec(0xabcd), [0x00, 0x00, 0xab, 0xcd]);
        // htobe32(cons_index & 0xffffff)
        assert_eq!(cq_ci_dbrec(0x0123_4567), [0x00, 0x23, 0x45, 0x67]);
        // The word a little-endian store writes so that memory holds those bytes.
        assert_eq!(le_word32([0x00, 0x00, 0xab, 0xcd]), 0xcdab_0000);
        assert_eq!(le_word32(sq_dbrec(0xabcd)).to_le_bytes(), sq_dbrec(0xabcd));
        let ctrl8 = [0x00, 0x12, 0x34, 0x08, 0xab, 0xcd, 0xef, 0x03];
        assert_eq!(le_word64(ctrl8).to_le_bytes(), ctrl8);
    }

    /// A CQE as the hardware would write it: only the fields named are set.
    fn cqe_bytes(op_own: u8, wqe_counter: u16, sop_drop_qpn: u32, byte_cnt: u32) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[44..48].copy_from_slice(&byte_cnt.to_be_bytes()); // byte_cnt
        b[56..60].copy_from_slice(&sop_drop_qpn.to_be_bytes()); // sop_drop_qpn
        b[60..62].copy_from_slice(&wqe_counter.to_be_bytes()); // wqe_counter
        b[63] = op_own; // op_own
        b
    }

    #[test]
    fn requester_cqe_of_an_rdma_read() {
        let mut b = cqe_bytes(0x00 /* REQ, plain, owner 0 */, 0x0102, 0x1000_0abc, 4);
        b[48..56].copy_from_slice(&0x0000_0001_0000_0002u64.to_be_bytes());
        let cqe = decode_cqe(&b).unwrap();
        assert_eq!(cqe.opcode, CqeOpcode::Req);
        assert_eq!(cqe.format, CqeFormat::Plain);
        assert!(!cqe.owner);
        assert_eq!(cqe.wqe_counter, 0x0102);
        assert_eq!(cqe.wqe_opcode, Opcode::RdmaRead as u8);
        assert_eq!(cqe.qpn, 0xabc);
        assert_eq!(cqe.byte_cnt, 4);
        assert_eq!(cqe.timestamp, 0x0000_0001_0000_0002);

        // Owner bit set, small read scattered into the CQE (format 1).
        let cqe = decode_cqe(&cqe_bytes(0x05, 7, 0x1000_0abc, 4)).unwrap();
        assert!(cqe.owner);
        assert_eq!(cqe.format, CqeFormat::Inline32);
    }

    #[test]
    fn error_cqe_decodes_into_a_clear_error() {
        // mlx5_err_cqe: vendor_err_synd at 54, syndrome at 55, s_wqe_opcode_qpn at 56.
        let mut b = cqe_bytes(0xd1 /* REQ_ERR, owner 1 */, 9, 0x1000_1234, 0);
        b[54] = 0x88;
        b[55] = 0x13;
        let err = match decode_cqe(&b) {
            Err(CqeFault::Error(e)) => e,
            other => panic!("expected an error CQE, got {other:?}"),
        };
        assert!(err.requester);
        assert_eq!(err.syndrome, Syndrome::RemoteAccess);
        assert_eq!(err.vendor_syndrome, 0x88);
        assert_eq!(err.wqe_counter, 9);
        assert_eq!(err.qpn, 0x1234);
        assert_eq!(
            err.to_string(),
            "requester error CQE: remote access error (syndrome 0x13, vendor syndrome 0x88) on WQE 9 (RDMA_READ 0x10) of QP 0x1234"
        );

        let mut b = cqe_bytes(0xe0 /* RESP_ERR */, 3, 0x0000_0042, 0);
        b[55] = 0x05;
        let Err(CqeFault::Error(err)) = decode_cqe(&b) else { panic!("expected an error") };
        assert!(!err.requester);
        assert_eq!(err.syndrome, Syndrome::WrFlush);
        assert_eq!(
            err.to_string(),
            "responder error CQE: work request flushed (QP in error state) (syndrome 0x05, vendor syndrome 0x00) on WQE 3 of QP 0x42"
        );

        let mut b = cqe_bytes(0xd0, 0, 0, 0);
        b[55] = 0x77;
        let Err(CqeFault::Error(err)) = decode_cqe(&b) else { panic!("expected an error") };
        assert_eq!(err.syndrome, Syndrome::Other(0x77));
        assert!(err.to_string().contains("general error (syndrome 0x77"), "{err}");
    }

    #[test]
    fn error_cqe_maps_to_a_status() {
        let e = |syndrome| CqeError { requester: true, syndrome, vendor_syndrome: 0, wqe_counter: 0, wqe_opcode: 8, qpn: 1 };
        assert_eq!(e(Syndrome::WrFlush).to_error().status(), Status::Canceled);
        assert_eq!(e(Syndrome::TransportRetryExceeded).to_error().status(), Status::PeerFailed);
        assert_eq!(e(Syndrome::RnrRetryExceeded).to_error().status(), Status::PeerFailed);
        let err = e(Syndrome::LocalProtection).to_error();
        assert_eq!(err.status(), Status::DeviceError);
        assert_eq!(err.message(), e(Syndrome::LocalProtection).to_string());
    }

    #[test]
    fn every_named_syndrome_round_trips() {
        for b in [0x01, 0x02, 0x04, 0x05, 0x06, 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x22] {
            let s = Syndrome::from_byte(b);
            assert!(!matches!(s, Syndrome::Other(_)), "{b:#x}");
            assert_eq!(s.byte(), b);
        }
    }

    #[test]
    fn compressed_and_unknown_cqes_are_refused() {
        let fault = decode_cqe(&cqe_bytes(0x0c /* REQ, format 3 */, 0, 0, 0)).unwrap_err();
        assert_eq!(fault, CqeFault::Unsupported { op_own: 0x0c });
        assert!(fault.to_string().contains("without CQE compression"), "{fault}");
        let fault = decode_cqe(&cqe_bytes(0x50 /* RESIZE_CQ */, 0, 0, 0)).unwrap_err();
        assert!(fault.to_string().contains("ResizeCq"), "{fault}");
    }

    #[test]
    fn ownership_flips_on_every_pass() {
        let log = 2; // 4 entries
        for i in 0..4 {
            assert!(!cqe_owner_for(i, log));
            assert!(cqe_owner_for(i + 4, log));
            assert!(!cqe_owner_for(i + 8, log));
        }
        // Never written (libmlx5's initial 0xf0): not ready, whatever the pass.
        assert!(!cqe_is_ready(CQE_INVALID_OP_OWN, 0, log));
        assert!(!cqe_is_ready(CQE_INVALID_OP_OWN | 1, 4, log));
        // Written in pass 0 (owner 0): ready as entry 1, stale when read as entry 5.
        assert!(cqe_is_ready(0x00, 1, log));
        assert!(!cqe_is_ready(0x00, 5, log));
        // Written in pass 1 (owner 1).
        assert!(cqe_is_ready(0x01, 5, log));
        assert!(!cqe_is_ready(0x01, 9, log));
        // Error CQEs follow the same rule.
        assert!(cqe_is_ready(0xd1, 6, log));
        // The largest CQ (2^31 entries): the second pass starts at 2^31.
        assert!(!cqe_owner_for(0x7fff_ffff, 31));
        assert!(cqe_owner_for(0x8000_0000, 31));
        assert!(!cqe_owner_for(u32::MAX, 32));
    }
}

//! `GSC_COLL_CHECK`: before each collective the ranks compare what they were asked to do, over
//! the bootstrap, and a mismatch fails the call on every rank with a message that names the rank
//! that differs — instead of a hang or wrong data, which is what mismatched collectives give in
//! NCCL. Off by default: it costs a host round trip through the bootstrap per call.

use super::types::{DataType, RedOp};
use crate::cuda::coll::CollKind;
use crate::error::{Error, Result};

/// What one rank was asked to do.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Signature {
    kind: u8,
    /// `ncclDataType_t` and `ncclRedOp_t` values (compact and already defined).
    dtype: i32,
    op: i32,
    count: u64,
    root: u64,
}

const ENCODED: usize = 1 + 4 + 4 + 8 + 8;

/// `op` of a pre-multiplied sum. NCCL numbers those operators per communicator
/// (`ncclRedOpCreatePreMulSum`), so the number itself may differ between ranks for the same call;
/// what must agree is that every rank multiplies (each by its own scalar).
const PREMUL_OP: i32 = -2;

fn kind_name(kind: u8) -> &'static str {
    match kind {
        k if k == CollKind::AllReduce as u8 => "all_reduce",
        k if k == CollKind::AllGather as u8 => "all_gather",
        k if k == CollKind::ReduceScatter as u8 => "reduce_scatter",
        k if k == CollKind::Broadcast as u8 => "broadcast",
        k if k == CollKind::Reduce as u8 => "reduce",
        _ => "unknown collective",
    }
}

impl Signature {
    /// `count` elements per rank's part (what the caller passed as count or recv_count).
    pub(crate) fn new(kind: CollKind, dtype: DataType, op: RedOp, count: usize, root: usize) -> Signature {
        let reduces = matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce);
        let rooted = matches!(kind, CollKind::Broadcast | CollKind::Reduce);
        // Fields a collective ignores are left out, so they cannot make a false mismatch.
        Signature {
            kind: kind as u8,
            dtype: dtype.nccl(),
            op: if reduces { op.nccl() } else { -1 },
            count: count as u64,
            root: if rooted { root as u64 } else { 0 },
        }
    }

    /// The same call as a pre-multiplied sum (`Communicator::premul_sum`).
    pub(crate) fn premul(self) -> Signature {
        Signature { op: PREMUL_OP, ..self }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ENCODED);
        b.push(self.kind);
        b.extend_from_slice(&self.dtype.to_le_bytes());
        b.extend_from_slice(&self.op.to_le_bytes());
        b.extend_from_slice(&self.count.to_le_bytes());
        b.extend_from_slice(&self.root.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Signature> {
        if b.len() != ENCODED {
            return Err(Error::invalid_param(format!("collective check: a peer sent {} bytes, expected {ENCODED}", b.len())));
        }
        let i32_at = |at: usize| i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Ok(Signature { kind: b[0], dtype: i32_at(1), op: i32_at(5), count: u64_at(9), root: u64_at(17) })
    }

    fn describe(&self) -> String {
        let dtype = DataType::from_nccl(self.dtype).map(|d| d.name()).unwrap_or("unknown type");
        let mut s = format!("{} of {} {dtype} elements", kind_name(self.kind), self.count);
        if self.op == PREMUL_OP {
            s += ", pre-multiplied sum";
        } else if self.op >= 0 {
            s += &format!(", {}", RedOp::from_nccl(self.op).map(|o| o.name()).unwrap_or("unknown operator"));
        }
        if matches!(self.kind, k if k == CollKind::Broadcast as u8 || k == CollKind::Reduce as u8) {
            s += &format!(", root {}", self.root);
        }
        s
    }
}

/// Ok when every rank made the same call. Otherwise an error, the same on every rank (all see
/// the same list), naming the ranks outside the largest group of equal calls (ties: the group
/// of rank 0) and what they and the others called.
pub(crate) fn check(all: &[Signature]) -> Result<()> {
    let Some(first) = all.first() else { return Ok(()) };
    if all.iter().all(|s| s == first) {
        return Ok(());
    }
    // The reference call: the most common one; among equally common ones, rank 0's wins
    // because it is counted first and only a strictly larger group replaces it.
    let mut reference = *first;
    let mut best = 0;
    for s in all {
        let n = all.iter().filter(|t| *t == s).count();
        if n > best {
            (reference, best) = (*s, n);
        }
    }
    let odd: Vec<String> =
        all.iter().enumerate().filter(|(_, s)| **s != reference).map(|(r, s)| format!("rank {r} called {}", s.describe())).collect();
    Err(Error::invalid_param(format!(
        "collective mismatch (GSC_COLL_CHECK): {}, while the other ranks called {}; nothing was started",
        odd.join("; "),
        reference.describe()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ar(count: usize) -> Signature {
        Signature::new(CollKind::AllReduce, DataType::Float32, RedOp::Sum, count, 0)
    }

    #[test]
    fn equal_calls_pass_and_ignored_fields_do_not_count() {
        assert!(check(&[]).is_ok());
        assert!(check(&[ar(8), ar(8), ar(8)]).is_ok());
        // An all-gather has no operator and no root: different values there are not a mismatch.
        let ag = |op, root| Signature::new(CollKind::AllGather, DataType::Int8, op, 5, root);
        assert!(check(&[ag(RedOp::Sum, 0), ag(RedOp::Max, 3)]).is_ok());
        for s in [ar(8), ag(RedOp::Sum, 0), Signature::new(CollKind::Reduce, DataType::Bfloat16, RedOp::Avg, 1 << 40, 3)] {
            assert_eq!(Signature::decode(&s.encode()).unwrap(), s);
        }
        assert!(Signature::decode(&[0u8; 3]).is_err());
    }

    #[test]
    fn a_premul_sum_does_not_match_a_plain_sum() {
        let m = check(&[ar(8), ar(8).premul(), ar(8)]).unwrap_err().message().to_string();
        assert!(m.contains("rank 1 called all_reduce of 8 float elements, pre-multiplied sum"), "{m}");
        assert!(check(&[ar(8).premul(), ar(8).premul()]).is_ok());
        assert_eq!(Signature::decode(&ar(8).premul().encode()).unwrap(), ar(8).premul());
    }

    #[test]
    fn a_mismatch_names_the_rank_that_differs() {
        let e = check(&[ar(8), ar(8), ar(8), ar(16)]).unwrap_err();
        let m = e.message().to_string();
        assert!(m.contains("rank 3 called all_reduce of 16 float elements, sum"), "{m}");
        assert!(m.contains("other ranks called all_reduce of 8 float elements, sum"), "{m}");
        assert!(!m.contains("rank 0 called"), "{m}");
        // Two ranks: a tie, decided for rank 0's call.
        let m = check(&[ar(8), ar(16)]).unwrap_err().message().to_string();
        assert!(m.contains("rank 1 called all_reduce of 16"), "{m}");
        // Rooted collectives: a different root is a mismatch, and it is shown.
        let bc = |root| Signature::new(CollKind::Broadcast, DataType::Float64, RedOp::Sum, 4, root);
        let m = check(&[bc(0), bc(1), bc(0)]).unwrap_err().message().to_string();
        assert!(m.contains("rank 1 called broadcast of 4 double elements, root 1"), "{m}");
        // Different collectives altogether.
        let rs = Signature::new(CollKind::ReduceScatter, DataType::Float32, RedOp::Sum, 8, 0);
        let m = check(&[ar(8), rs]).unwrap_err().message().to_string();
        assert!(m.contains("rank 1 called reduce_scatter"), "{m}");
    }
}

//! The collectives' algorithm table: which kernel runs a call, decided in one place from the
//! collective, its bytes per rank and the ranks (the buffers' alignment picks only between a
//! large kernel's twins, `large_kernel`), and printed by
//! `gsc-info -p`. The kernels are in `cuda::coll`; measurements behind the thresholds are in
//! docs/PERF.md.

use super::large::LargeShape;
use crate::config::LargeAlgo;
use std::fmt::Write;

/// The collectives a communicator runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
}

impl Collective {
    pub const ALL: [Collective; 5] =
        [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast, Collective::Reduce];

    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
        }
    }

    /// Data flows one way (from or to a root): no all-pairs exchange keeps the ranks in step.
    pub fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Every rank writes its part as LL words into every peer's slot and reads its own slots;
    /// rounds of 64 KiB per rank, all in one launch (rooted collectives: the readers
    /// acknowledge each round to the writers).
    OneShotLl,
    /// Reduce-scatter then all-gather by NVLink writes, `GSC_COLL_LARGE_BLOCKS` channels,
    /// rounds of `GSC_COLL_LARGE_ROUND`, each block's phases one after the other; a tail under
    /// 16 bytes by `OneShotLl`. All-gather and reduce-scatter run its halves; broadcast and
    /// reduce its pattern (only the root pushes; the sums go to the root only).
    TwoShotPush,
    /// The same data movement with each block's warps in roles (push, reduce, copy out) on
    /// different rounds at once (`GSC_COLL_LARGE_ALGO=pipelined`; `cuda::coll_pipelined`).
    TwoShotPipelined,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneShotLl => "one-shot LL (all pairs, flags in the data)",
            Algorithm::TwoShotPush => "NVLink writes into every rank's workspace, phased (all-reduce: reduce-scatter + all-gather)",
            Algorithm::TwoShotPipelined => {
                "NVLink writes into every rank's workspace, pipelined warp roles (all-reduce: reduce-scatter + all-gather)"
            }
        }
    }

    /// One of the large kernels.
    pub fn is_large(self) -> bool {
        self != Algorithm::OneShotLl
    }
}

/// Where a call's addresses sit: every buffer address and, for all-gather and reduce-scatter,
/// the bytes of a part (which stride the buffers), OR-ed together.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// On 16 bytes: every kernel's 16-byte accesses.
    Sixteen,
    /// On whole elements, not on 16 bytes: the large kernels' narrow twins move such calls in
    /// narrower accesses (`cuda::coll`'s `gsc_align_of`).
    Elements,
    /// Not even on whole elements (a buffer at any byte): the narrow twins move such calls
    /// too, element by element through single bytes where they must reduce.
    Bytes,
}

impl Alignment {
    /// The alignment of `bits` (addresses and strides OR-ed) for elements of `elem` bytes.
    pub fn of(bits: u64, elem: usize) -> Alignment {
        if bits.is_multiple_of(16) {
            Alignment::Sixteen
        } else if bits.is_multiple_of(elem as u64) {
            Alignment::Elements
        } else {
            Alignment::Bytes
        }
    }
}

/// The algorithm of a call moving `bytes` per rank; `large_min`: `GSC_COLL_LARGE_MIN`; `algo`:
/// `GSC_COLL_LARGE_ALGO`.
///
/// Every rank of a call chooses alone, from its own addresses, with no exchange. The choice
/// therefore does not depend on them: ranks whose buffers sit differently (one on 16 bytes, one
/// an element or a byte off) would otherwise run different kernels against each other's flags,
/// and fail the call after `GSC_TIMEOUT` (until session 35 the phased kernel's calls off 16
/// bytes, and until session 36 the pipelined one's, went one-shot). The alignment only picks a
/// large kernel's twin (`large_kernel`).
pub fn choose(coll: Collective, bytes: usize, large_min: usize, algo: LargeAlgo) -> Algorithm {
    let large = bytes >= large_min.max(16);
    let large_algo = match algo {
        LargeAlgo::Phased => Algorithm::TwoShotPush,
        LargeAlgo::Pipelined => Algorithm::TwoShotPipelined,
    };
    match coll {
        Collective::AllReduce | Collective::AllGather | Collective::ReduceScatter if large => large_algo,
        // On the all-reduce's pattern in the phased kernel only (`cuda::coll`).
        Collective::Broadcast | Collective::Reduce if large && algo == LargeAlgo::Phased => Algorithm::TwoShotPush,
        _ => Algorithm::OneShotLl,
    }
}

/// The family of the large kernel (`gsc_coll_<family>_<type>_<op>`) that runs a large call
/// under `algo` whose addresses are at `align`: the 16-byte kernel, or its narrow twin with the
/// same roles, rounds and flags, so ranks whose buffers sit differently still meet.
pub fn large_kernel(algo: LargeAlgo, align: Alignment) -> &'static str {
    match (algo, align) {
        (LargeAlgo::Phased, Alignment::Sixteen) => "big",
        (LargeAlgo::Phased, _) => "bign",
        (LargeAlgo::Pipelined, Alignment::Sixteen) => "pipe",
        (LargeAlgo::Pipelined, _) => "pipen",
    }
}

/// The table as `gsc-info -p` prints it; `shape`: the large kernels' (`GSC_COLL_LARGE_*`).
/// `sm`, `ring` and `ce`: `GSC_COLL_SM`/`GSC_COLL_SM_MIN` (`direct`), `GSC_COLL_RING`/
/// `GSC_COLL_RING_MIN` (`ce_ring`) and `GSC_COLL_CE`/`GSC_COLL_CE_MIN` (`copy_engine`), which
/// come before the table, in that order; `trigger_max`: `GSC_COLL_TRIGGER_MAX`; `p2p`:
/// `GSC_COLL_P2P_MAX`, `GSC_COLL_P2P_BLOCKS` (`p2p_kernel`) and `GSC_COLL_P2P_HEAD`, a line
/// after the table.
pub fn describe(
    large_min: usize,
    shape: &LargeShape,
    sm: (crate::config::Tristate, usize),
    ring: (crate::config::Tristate, usize),
    ce: (crate::config::Tristate, usize),
    trigger_max: usize,
    p2p: (usize, usize, usize),
) -> String {
    use crate::config::Tristate;
    let mut out = String::new();
    let _ = writeln!(out, "# collectives (GSC_COLL_LARGE_MIN={}), bytes per rank", crate::config::format_size(large_min as u64));
    let _ = writeln!(out, "# large kernels: {}", shape.describe());
    let sm_min = crate::config::format_size(sm.1 as u64);
    let _ = match sm.0 {
        Tristate::On => writeln!(
            out,
            "# direct kernel (GSC_COLL_SM=on): all_gather, reduce_scatter (parts of whole 16 bytes) and all_reduce (shards of whole 16 bytes) from {sm_min} per rank on stream and graph conditions, buffers on 16 bytes, first"
        ),
        Tristate::Auto => {
            use crate::cuda::coll::CollKind;
            let floor = |kind, replayed, n| crate::config::format_size(super::direct::auto_floor(kind, replayed, n) as u64);
            let at = |kind, n| format!("{} replayed, {} on a stream", floor(kind, true, n), floor(kind, false, n));
            writeln!(
                out,
                "# direct kernel (GSC_COLL_SM=auto): as on, from {sm_min} per rank and from these: 2 ranks all_gather {}, reduce_scatter {}, all_reduce {}; 3-4 ranks all_gather {}",
                at(CollKind::AllGather, 2),
                at(CollKind::ReduceScatter, 2),
                at(CollKind::AllReduce, 2),
                at(CollKind::AllGather, 4),
            )
        }
        Tristate::Off => writeln!(out, "# direct kernel (GSC_COLL_SM=off): never"),
    };
    if sm.0 != Tristate::Off {
        let _ = writeln!(
            out,
            "#   calls on symmetric windows (ncclCommWindowRegister), and the calls of every rank of a one-process communicator issued together (ncclGroupEnd), know the peers' buffers without exchanging them; where ranks share a process, only those calls take the direct kernel, the ring or the copy engines"
        );
    }
    let ring_min = crate::config::format_size(ring.1 as u64);
    let _ = match ring.0 {
        Tristate::Off => writeln!(out, "# copy-engine ring (GSC_COLL_RING=off): never"),
        Tristate::Auto => {
            use crate::cuda::coll::CollKind;
            let floor = |kind| crate::config::format_size(super::ce_ring::auto_floor(kind) as u64);
            let (rs, ar) = (floor(CollKind::ReduceScatter), floor(CollKind::AllReduce));
            writeln!(
                out,
                "# copy-engine ring (GSC_COLL_RING=auto): reduce_scatter from max({ring_min}, {rs}) per rank and all_reduce from max({ring_min}, {ar}) (pieces of whole 16 bytes), of 4 and more ranks, when captured into a graph (stream conditions), after the direct kernel"
            )
        }
        Tristate::On => writeln!(
            out,
            "# copy-engine ring (GSC_COLL_RING=on): reduce_scatter and all_reduce (pieces of whole 16 bytes) from {ring_min} per rank on stream conditions, after the direct kernel"
        ),
    };
    let ce_min = crate::config::format_size(ce.1 as u64);
    let _ = match ce.0 {
        Tristate::Off => writeln!(out, "# copy engines (GSC_COLL_CE=off): never"),
        Tristate::Auto => writeln!(
            out,
            "# copy engines (GSC_COLL_CE=auto): all_gather of 3 and more ranks, from {ce_min} per rank when captured into a graph (stream conditions), before the table"
        ),
        Tristate::On => writeln!(
            out,
            "# copy engines (GSC_COLL_CE=on): all_gather, reduce_scatter and all_reduce (whole shards) from {ce_min} per rank on stream conditions, before the table"
        ),
    };
    let _ = match trigger_max {
        0 => writeln!(
            out,
            "# kernel-triggered conditions (GSC_COLL_TRIGGER_MAX=0): every collective captured once, as on a stream, and launched by gscomm's thread per trigger"
        ),
        max => writeln!(
            out,
            "# kernel-triggered conditions (GSC_COLL_TRIGGER_MAX={}): all_reduce of 1 to {} bytes (not 16-bit floats, not pre-multiplied sums) run by the triggering thread itself; the rest captured once, as on a stream, and launched by gscomm's thread per trigger",
            crate::config::format_size(max as u64),
            crate::config::format_size(max as u64)
        ),
    };
    for coll in Collective::ALL {
        let line = match choose(coll, usize::MAX & !15, large_min, shape.algo) {
            Algorithm::OneShotLl if coll.rooted() => format!(
                "{} at every size (the pipelined kernel has no rooted collectives), rounds of 64 KiB acknowledged by the readers",
                Algorithm::OneShotLl.name()
            ),
            Algorithm::OneShotLl => format!("{} at every size", Algorithm::OneShotLl.name()),
            large => format!(
                "{} below {}, {} from there{} (buffers at any byte, in 16-byte accesses where they and the parts are on 16 bytes)",
                Algorithm::OneShotLl.name(),
                crate::config::format_size(large_min.max(16) as u64),
                large.name(),
                match coll {
                    Collective::Broadcast => ", the root pushing slices the others forward (two ranks: the root pushing it whole)",
                    Collective::Reduce => ", the sums to the root only (two ranks: a reduce-scatter to the root)",
                    _ => "",
                },
            ),
        };
        let _ = writeln!(out, "[{}] {line}", coll.name());
    }
    let _ = match p2p.0 {
        0 => writeln!(out, "# send/recv groups (GSC_COLL_P2P_MAX=0): every message through the point-to-point engine"),
        max => writeln!(
            out,
            "# send/recv groups (GSC_COLL_P2P_MAX={}): messages of up to {} by the send/recv kernel, {} blocks each (GSC_COLL_P2P_BLOCKS), one launch per group; larger ones through the point-to-point engine{}",
            crate::config::format_size(max as u64),
            crate::config::format_size(max as u64),
            p2p.1,
            match p2p.2.min(max) {
                0 => String::new(),
                head => format!(
                    ", the first {} of those to a peer by the kernel beside it (GSC_COLL_P2P_HEAD)",
                    crate::config::format_size(head as u64)
                ),
            }
        ),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_calls_switch_at_the_threshold() {
        let (min, p, pipe) = (256 << 10, LargeAlgo::Phased, LargeAlgo::Pipelined);
        assert_eq!(choose(Collective::AllReduce, min - 1, min, p), Algorithm::OneShotLl);
        assert_eq!(choose(Collective::AllReduce, min, min, p), Algorithm::TwoShotPush);
        assert_eq!(choose(Collective::AllReduce, min, min, pipe), Algorithm::TwoShotPipelined);
        // A threshold of 0 still leaves calls under one 16-byte piece to the one-shot kernel.
        assert_eq!(choose(Collective::AllReduce, 8, 0, p), Algorithm::OneShotLl);
        for coll in [Collective::AllGather, Collective::ReduceScatter] {
            assert_eq!(choose(coll, (1 << 30) + 4, min, p), Algorithm::TwoShotPush, "{}", coll.name());
            assert_eq!(choose(coll, (1 << 30) + 4, min, pipe), Algorithm::TwoShotPipelined, "{}", coll.name());
        }
        for coll in [Collective::Broadcast, Collective::Reduce] {
            assert_eq!(choose(coll, 1 << 30, min, pipe), Algorithm::OneShotLl, "{}: no pipelined rooted kernel", coll.name());
            assert_eq!(choose(coll, min, min, p), Algorithm::TwoShotPush, "{}: the all-reduce's pattern", coll.name());
            assert_eq!(choose(coll, min - 1, min, p), Algorithm::OneShotLl, "{}", coll.name());
        }
    }

    #[test]
    fn alignment_picks_only_the_twin_of_the_same_kernel() {
        // Ranks whose buffers sit differently must run kernels with one layout of flags.
        for algo in [LargeAlgo::Phased, LargeAlgo::Pipelined] {
            let twins: Vec<&str> = [Alignment::Sixteen, Alignment::Elements, Alignment::Bytes].map(|a| large_kernel(algo, a)).into();
            let wide = twins[0];
            assert_eq!(twins[1..], [format!("{wide}n"), format!("{wide}n")], "{algo:?}");
        }
        assert_eq!(large_kernel(LargeAlgo::Phased, Alignment::Sixteen), "big");
        assert_eq!(large_kernel(LargeAlgo::Pipelined, Alignment::Sixteen), "pipe");
    }

    #[test]
    fn alignment_reads_addresses_and_strides_for_the_element_size() {
        assert_eq!(Alignment::of(0x7000_0000, 4), Alignment::Sixteen);
        assert_eq!(Alignment::of(0x7000_0004, 4), Alignment::Elements);
        assert_eq!(Alignment::of(0x7000_0002, 4), Alignment::Bytes);
        assert_eq!(Alignment::of(0x7000_0001, 1), Alignment::Elements);
        assert_eq!(Alignment::of(0x7000_0008, 8), Alignment::Elements);
        assert_eq!(Alignment::of(0x7000_0004, 8), Alignment::Bytes);
    }

    #[test]
    fn the_table_names_every_collective() {
        let config = crate::config::Config { coll_large_algo: LargeAlgo::Pipelined, ..Default::default() };
        let t = describe(
            256 << 10,
            &LargeShape::from_config(&config).unwrap(),
            (crate::config::Tristate::On, 1 << 20),
            (crate::config::Tristate::Auto, 32 << 20),
            (crate::config::Tristate::Auto, 4 << 20),
            64,
            (8 << 20, 32, 4 << 20),
        );
        for coll in Collective::ALL {
            assert!(t.contains(&format!("[{}]", coll.name())), "{t}");
        }
        assert!(t.contains("256K") || t.contains("256 KiB"), "{t}");
        assert!(t.contains("[all_gather] one-shot LL (all pairs, flags in the data) below 256K"), "the large halves are listed: {t}");
        assert!(t.contains("pipelined, 128 blocks of 512 threads, 4 stages, warps push:reduce:copy 6:6:4 all-reduce"), "{t}");
        assert!(
            t.contains("[broadcast] one-shot LL (all pairs, flags in the data) at every size (the pipelined kernel has no rooted"),
            "{t}"
        );
        let phased = describe(
            256 << 10,
            &LargeShape::from_config(&Default::default()).unwrap(),
            (crate::config::Tristate::Auto, 1 << 20),
            (crate::config::Tristate::Auto, 32 << 20),
            (crate::config::Tristate::Auto, 4 << 20),
            64,
            (8 << 20, 32, 4 << 20),
        );
        assert!(
            phased.contains(
                "[reduce] one-shot LL (all pairs, flags in the data) below 256K, NVLink writes into every rank's workspace, phased"
            ),
            "{phased}"
        );
        assert!(phased.contains(", the sums to the root only"), "{phased}");
        assert!(
            phased.contains(
                "# direct kernel (GSC_COLL_SM=auto): as on, from 1M per rank and from these: 2 ranks all_gather 8M replayed, 8M on a stream, reduce_scatter 16M replayed, 16M on a stream, all_reduce 1M replayed, 16M on a stream; 3-4 ranks all_gather 512K replayed, 8M on a stream"
            ),
            "{phased}"
        );
        assert!(t.contains("# copy engines (GSC_COLL_CE=auto): all_gather of 3 and more ranks, from 4M"), "{t}");
        assert!(t.contains("# direct kernel (GSC_COLL_SM=on): all_gather, reduce_scatter"), "{t}");
        assert!(t.contains("# kernel-triggered conditions (GSC_COLL_TRIGGER_MAX=64): all_reduce of 1 to 64 bytes"), "{t}");
        assert!(
            t.contains("# send/recv groups (GSC_COLL_P2P_MAX=8M): messages of up to 8M by the send/recv kernel, 32 blocks each"),
            "{t}"
        );
        assert!(t.contains("engine, the first 4M of those to a peer by the kernel beside it (GSC_COLL_P2P_HEAD)"), "{t}");
        assert!(
            t.contains(
                "# copy-engine ring (GSC_COLL_RING=auto): reduce_scatter from max(32M, 32M) per rank and all_reduce from max(32M, 64M)"
            ),
            "{t}"
        );
    }
}

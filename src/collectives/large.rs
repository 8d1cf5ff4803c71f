//! The large collectives' launch geometry: how many blocks and threads, how a call is cut into
//! rounds and regions, how the pipelined kernel's areas are cut into stages and its warps into
//! roles. Pure functions of the configuration and the call, so every rank computes the same
//! shape (block b of every rank meets only block b of the others) and the tests check them
//! without a GPU. The kernels are in `cuda::coll` (phased) and `cuda::coll_pipelined`.

use crate::config::{Config, LargeAlgo};
use crate::error::{Error, Result};

/// Threads per block when `GSC_COLL_LARGE_THREADS` is `auto`. Phased: 512, which moved every
/// collective it runs faster than 256 from 16–64 MiB on two H200s and tied below (the reduce
/// 512 MiB 349.4 → 359.5 GB/s, all-reduce 64 MiB 264.8 → 292.4; docs/PERF.md, session 32).
const PHASED_THREADS: usize = 512;
const PIPELINED_THREADS: usize = 512;
/// The most threads each kernel can run per block (the phased kernel's registers, measured
/// with NVRTC for sm_90: at most 72 for `gsc_coll_big`; its narrow twin `gsc_coll_bign` and the
/// pipelined kernel are compiled for these counts, `GSC_BIG_MAX_THREADS` and
/// `GSC_PIPE_MAX_THREADS`).
pub(crate) const PHASED_MAX_THREADS: usize = 768;
pub(crate) const PIPELINED_MAX_THREADS: usize = 512;

/// The collectives the large kernels run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum LargeKind {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// The large kernels' shape for one communicator's life (`GSC_COLL_LARGE_*`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LargeShape {
    pub algo: LargeAlgo,
    pub blocks: usize,
    pub threads: usize,
    /// Pipelined only.
    pub stages: usize,
    /// Pipelined only: push:reduce:copy shares, `None` for the split per collective.
    pub warps: Option<[u32; 3]>,
}

impl LargeShape {
    /// The shape the configuration asks for, or why it cannot run.
    pub fn from_config(c: &Config) -> Result<LargeShape> {
        let algo = c.coll_large_algo;
        let (auto, max, min) = match algo {
            LargeAlgo::Phased => (PHASED_THREADS, PHASED_MAX_THREADS, 64),
            // One warp per role at least: all-reduce has three.
            LargeAlgo::Pipelined => (PIPELINED_THREADS, PIPELINED_MAX_THREADS, 96),
        };
        let threads = c.coll_large_threads.unwrap_or(auto);
        if !(min..=max).contains(&threads) {
            return Err(Error::invalid_param(format!(
                "GSC_COLL_LARGE_THREADS={threads} with GSC_COLL_LARGE_ALGO={}: that kernel runs {min} to {max} threads per block",
                algo.name()
            )));
        }
        Ok(LargeShape { algo, blocks: c.coll_large_blocks, threads, stages: c.coll_large_stages, warps: c.coll_large_warps })
    }

    /// One line for `gsc-info -p`.
    pub fn describe(&self) -> String {
        match self.algo {
            LargeAlgo::Phased => format!("phased, {} blocks of {} threads", self.blocks, self.threads),
            LargeAlgo::Pipelined => {
                let split = |k| {
                    let (p, r, c) = role_threads(self, k);
                    format!("{}:{}:{}", p / 32, r / 32, c / 32)
                };
                format!(
                    "pipelined, {} blocks of {} threads, {} stages, warps push:reduce:copy {} all-reduce, {} reduce-scatter, {} all-gather",
                    self.blocks,
                    self.threads,
                    self.stages,
                    split(LargeKind::AllReduce),
                    split(LargeKind::ReduceScatter),
                    split(LargeKind::AllGather)
                )
            }
        }
    }
}

/// What one launch of a large kernel needs besides the buffers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct LargeLaunch {
    /// Bytes per block and round (all-reduce: n slices; the halves: per part).
    pub(crate) region: usize,
    pub(crate) rounds: usize,
    /// Pipelined only (0 for phased): stages of each area, bytes of one stage, threads that
    /// push and that reduce.
    pub(crate) stages: usize,
    pub(crate) stage_bytes: usize,
    pub(crate) push_threads: usize,
    pub(crate) reduce_threads: usize,
}

/// The launch of `kind` over `bytes` per part (all-reduce: its whole buffer, whole 16-byte
/// pieces; all-gather and reduce-scatter parts on the phased kernel: any whole elements, the
/// last region shorter) on `nranks` ranks; `round_max`: `GSC_COLL_LARGE_ROUND` (the workspace
/// holds four areas of it, from 1 MiB).
pub(crate) fn launch(shape: &LargeShape, kind: LargeKind, nranks: usize, bytes: usize, round_max: usize) -> LargeLaunch {
    debug_assert!(bytes > 0);
    debug_assert!(bytes.is_multiple_of(16) || (kind != LargeKind::AllReduce && shape.algo == LargeAlgo::Phased));
    // The area a round may fill per rank: a parity (phased) or a stage (pipelined: the four
    // areas cut into `stages` of "in" and `stages` of "out"), on 16 bytes.
    let (area, stages) = match shape.algo {
        LargeAlgo::Phased => (round_max, 0),
        LargeAlgo::Pipelined => (2 * round_max / shape.stages / 16 * 16, shape.stages),
    };
    let blocks = shape.blocks;
    let region = match kind {
        // Regions of whole slices (16 bytes × nranks), as even as the size allows.
        LargeKind::AllReduce => {
            let unit = 16 * nranks;
            bytes.div_ceil(blocks).next_multiple_of(unit).min(area / blocks / unit * unit)
        }
        // n regions per block and round; the phased reduce-scatter n - 1 (its own part is
        // read where it is, `cuda::coll`).
        LargeKind::ReduceScatter | LargeKind::AllGather => {
            let parts = if kind == LargeKind::ReduceScatter && shape.algo == LargeAlgo::Phased { nranks - 1 } else { nranks };
            bytes.div_ceil(blocks).next_multiple_of(16).min(area / (parts.max(1) * blocks) / 16 * 16)
        }
    };
    debug_assert!(region > 0, "knob ranges keep a region at 16 bytes or more");
    let (push_threads, reduce_threads, _) = match shape.algo {
        LargeAlgo::Phased => (0, 0, 0),
        LargeAlgo::Pipelined => role_threads(shape, kind),
    };
    LargeLaunch { region, rounds: bytes.div_ceil(region * blocks), stages, stage_bytes: area, push_threads, reduce_threads }
}

/// The pipelined kernel's roles for `kind`: threads that push, reduce, copy out (whole warps,
/// at least one for each role the collective has, none for the others, all of the block).
pub(crate) fn role_threads(shape: &LargeShape, kind: LargeKind) -> (usize, usize, usize) {
    let mut shares = shape.warps.unwrap_or(match kind {
        LargeKind::AllReduce => [3, 3, 2],
        LargeKind::ReduceScatter => [5, 3, 0],
        LargeKind::AllGather => [5, 0, 3],
    });
    let used = match kind {
        LargeKind::AllReduce => [true, true, true],
        LargeKind::ReduceScatter => [true, true, false],
        LargeKind::AllGather => [true, false, true],
    };
    for (s, u) in shares.iter_mut().zip(used) {
        // A role the collective has gets a share even if it was given none; one it lacks none.
        *s = if u { (*s).max(1) } else { 0 };
    }
    let warps = shape.threads / 32;
    let total: u32 = shares.iter().sum();
    let mut w = shares.map(|s| if s == 0 { 0 } else { (warps * s as usize / total as usize).max(1) });
    // Rounding: the pushers take what is left, or give back what is too much (the block has a
    // warp for every role: at least 3 warps, `LargeShape::from_config`).
    let sum: usize = w.iter().sum();
    if sum <= warps {
        w[0] += warps - sum;
    } else {
        let mut over = sum - warps;
        for i in [0, 1, 2] {
            let give = over.min(w[i].saturating_sub(1));
            w[i] -= give;
            over -= give;
        }
    }
    (w[0] * 32, w[1] * 32, w[2] * 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(algo: LargeAlgo, blocks: usize, threads: usize, stages: usize, warps: Option<[u32; 3]>) -> LargeShape {
        LargeShape { algo, blocks, threads, stages, warps }
    }

    #[test]
    fn phased_geometry_is_the_old_one() {
        let s = shape(LargeAlgo::Phased, 128, 256, 4, None);
        let l = launch(&s, LargeKind::AllReduce, 4, 128 << 20, 8 << 20);
        assert_eq!((l.region, l.rounds), (64 << 10, 16));
        let l = launch(&s, LargeKind::AllGather, 4, 128 << 20, 8 << 20);
        assert_eq!((l.region, l.rounds), (16 << 10, 64));
        assert_eq!((l.stages, l.push_threads), (0, 0));
        // The reduce-scatter keeps n - 1 regions per block: two ranks take the all-reduce's.
        let l = launch(&s, LargeKind::ReduceScatter, 4, 128 << 20, 8 << 20);
        assert_eq!(l.region, 21_840, "8 MiB / (3 × 128), on 16 bytes");
        let l = launch(&s, LargeKind::ReduceScatter, 2, 128 << 20, 8 << 20);
        assert_eq!((l.region, l.rounds), (64 << 10, 16));
    }

    #[test]
    fn phased_halves_cover_parts_off_sixteen_bytes() {
        let s = shape(LargeAlgo::Phased, 128, 512, 4, None);
        for n in 2..=8 {
            for kind in [LargeKind::AllGather, LargeKind::ReduceScatter] {
                for bytes in [3, 4097 * 4, (64 << 20) + 4, (1 << 30) + 2] {
                    let l = launch(&s, kind, n, bytes, 8 << 20);
                    let parts = if kind == LargeKind::ReduceScatter { n - 1 } else { n };
                    assert!(l.region > 0 && l.region.is_multiple_of(16), "{kind:?} {l:?}");
                    assert!(l.region * parts * 128 <= 8 << 20, "{kind:?} {l:?}: the area holds a round");
                    assert!(l.rounds * l.region * 128 >= bytes && (l.rounds - 1) * l.region * 128 < bytes, "{kind:?} {l:?}");
                }
            }
        }
    }

    #[test]
    fn pipelined_rounds_fit_their_stage() {
        for stages in 2..=8 {
            for blocks in [1, 7, 128, 1024] {
                for n in 1..=8 {
                    for round_max in [1 << 20, 8 << 20, 64 << 20] {
                        let s = shape(LargeAlgo::Pipelined, blocks, 512, stages, None);
                        for (kind, per_block_parts) in [(LargeKind::AllReduce, 1), (LargeKind::ReduceScatter, n), (LargeKind::AllGather, n)]
                        {
                            for bytes in [16, 4096, 3 << 20, (512 << 20) + 48] {
                                let l = launch(&s, kind, n, bytes, round_max);
                                assert!(l.region > 0 && l.region.is_multiple_of(16));
                                if kind == LargeKind::AllReduce {
                                    assert!(l.region.is_multiple_of(16 * n), "whole slices");
                                }
                                assert!(l.region * per_block_parts * blocks <= l.stage_bytes, "{kind:?} {l:?}");
                                assert!(2 * l.stages * l.stage_bytes <= 4 * round_max, "the stages fit the workspace");
                                assert!(l.stage_bytes.is_multiple_of(16));
                                assert!(l.rounds * l.region * blocks >= bytes && (l.rounds - 1) * l.region * blocks < bytes);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn roles_take_whole_warps_and_the_whole_block() {
        for threads in (96..=512).step_by(32) {
            for warps in [None, Some([3, 3, 2]), Some([1, 0, 0]), Some([32, 1, 32]), Some([5, 0, 3])] {
                let s = shape(LargeAlgo::Pipelined, 128, threads, 4, warps);
                for kind in [LargeKind::AllReduce, LargeKind::ReduceScatter, LargeKind::AllGather] {
                    let (p, r, c) = role_threads(&s, kind);
                    assert_eq!(p + r + c, threads, "{kind:?} {warps:?} {threads}");
                    assert!(p >= 32 && [p, r, c].iter().all(|t| t.is_multiple_of(32)));
                    assert_eq!(r > 0, kind != LargeKind::AllGather, "{kind:?}: reducers");
                    assert_eq!(c > 0, kind != LargeKind::ReduceScatter, "{kind:?}: copiers");
                }
            }
        }
        let s = shape(LargeAlgo::Pipelined, 128, 512, 4, None);
        assert_eq!(role_threads(&s, LargeKind::AllReduce), (6 * 32, 6 * 32, 4 * 32));
        assert_eq!(role_threads(&s, LargeKind::ReduceScatter), (10 * 32, 6 * 32, 0));
        assert_eq!(role_threads(&s, LargeKind::AllGather), (10 * 32, 0, 6 * 32));
    }

    #[test]
    fn threads_out_of_a_kernel_range_are_refused_by_name() {
        let mut c = Config { coll_large_algo: LargeAlgo::Pipelined, coll_large_threads: Some(1024), ..Config::default() };
        let e = LargeShape::from_config(&c).unwrap_err().to_string();
        assert!(e.contains("GSC_COLL_LARGE_THREADS=1024") && e.contains("pipelined"), "{e}");
        c.coll_large_threads = Some(64);
        assert!(LargeShape::from_config(&c).is_err(), "three roles need three warps");
        c.coll_large_threads = None;
        assert_eq!(LargeShape::from_config(&c).unwrap().threads, 512);
        c.coll_large_algo = LargeAlgo::Phased;
        assert_eq!(LargeShape::from_config(&c).unwrap().threads, 512);
    }
}

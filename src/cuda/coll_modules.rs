//! How the collective kernels are cut into modules, and how a context's modules are built.
//!
//! A module holds every typed kernel of one element type (`TYPES`; each family of them comes
//! from one instantiation macro, `MACROS`), and one more module, `Module::Common`, the
//! type-less kernels (the copy-engine barrier, the triggered collectives' last node, the
//! point-to-point kernels, the ring's wait), which the source compiles only where
//! `GSC_COMMON_KERNELS` is defined, so that the twelve typed modules do not each compile them.
//!
//! A context builds every module before its first collective (modules cannot be loaded later:
//! `kernels::load_module`). `build` compiles them on a pool of one thread per core and shares
//! the work with the other processes of the machine, since the ranks of a job start together:
//! through `kernel_cache`'s lock, a module another process is compiling is left to it and read
//! once the rest are done, so each module is compiled once per machine, not once per rank.
//!
//! Measured on `nvidia-h100-x1` (16 cores), 2026-11-23, an emptied cache, seconds to the
//! kernels per process (docs/ARCHITECTURE.md, "Kernel compilation"): a module per type with nothing shared
//! (before) 3.0 alone, 3.0–3.4 four processes at once, 3.3–3.9 eight; this layout 2.9, 2.3–2.7,
//! 2.5–3.4. A module per type and family (73 modules) took 4.9 alone, 2.0–2.1 and 2.3–2.4:
//! more modules parse the sources more often, which one process pays for. (The first CUDA
//! process on a freshly started machine is another matter: 40–50 s, whatever the layout.)

use super::kernels::{compile_cached, try_compile_cached};
use crate::error::{Error, Result, Status};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The element types the kernels are instantiated for: (C type, tag in kernel names).
pub(super) const TYPES: [(&str, &str); 12] = [
    ("signed char", "i8"),
    ("unsigned char", "u8"),
    ("int", "i32"),
    ("unsigned", "u32"),
    ("long long", "i64"),
    ("unsigned long long", "u64"),
    ("gsc_f16", "f16"),
    ("float", "f32"),
    ("double", "f64"),
    ("gsc_bf16", "bf16"),
    ("gsc_e4m3", "e4m3"),
    ("gsc_e5m2", "e5m2"),
];

/// The source's instantiation macros, each declaring one family of a type's kernels: the
/// one-shot kernel (`gsc_coll_<tag>_<op>`, with `gsc_net_reduce_<tag>_<op>`), the phased large
/// kernel and its narrow twin (`gsc_coll_big_`, `gsc_coll_bign_`), the pipelined one and its
/// twin (`gsc_coll_pipe_`, `gsc_coll_pipen_`), the direct and ring kernels on the peers'
/// buffers (`gsc_direct_`, `gsc_ring_reduce_`).
pub(super) const MACROS: [&str; 7] =
    ["GSC_COLL_LL", "GSC_COLL_BIG", "GSC_COLL_BIGN", "GSC_COLL_PIPE", "GSC_COLL_PIPEN", "GSC_COLL_DIRECT", "GSC_COLL_RING"];

/// One module of the collective kernels.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Module {
    /// The type-less kernels.
    Common,
    /// Every typed kernel of `TYPES[t]`.
    Typed { t: usize },
}

/// Every module, in the order `build` returns their cubins (and `module_of` counts).
pub(super) fn modules() -> Vec<Module> {
    std::iter::once(Module::Common).chain((0..TYPES.len()).map(|t| Module::Typed { t })).collect()
}

/// Where in `modules()` kernel `name` is: its type's module, or the common one for a name
/// without a type tag (`gsc_coll_<tag>_<op>`, `gsc_coll_big_<tag>_<op>`, ...).
pub(super) fn module_of(name: &str) -> usize {
    TYPES.iter().position(|(_, tag)| name.contains(&format!("_{tag}_"))).map_or(0, |t| 1 + t)
}

/// The cubin of every module for `arch`, in `modules()` order, from the disk cache or compiled
/// (`source` gives a module's text) on a pool of one thread per core. A module that another
/// process is compiling is skipped at first and read (or, past the cache's wait, compiled)
/// after the others.
pub(super) fn build(arch: (i32, i32), cache_dir: Option<&Path>, source: &(dyn Fn(Module) -> String + Sync)) -> Vec<Result<Vec<u8>>> {
    let all = modules();
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    build_with(all.len(), threads, &|i| try_compile_cached(&source(all[i]), arch, cache_dir), &|i| {
        compile_cached(&source(all[i]), arch, cache_dir)
    })
}

/// Jobs `0..n` on a pool of `threads`: `first(i)` for each; those it leaves to another process
/// (`Ok(None)`) then get `then(i)`. Results in job order; a job whose thread panicked is an
/// internal error.
fn build_with(
    n: usize,
    threads: usize,
    first: &(dyn Fn(usize) -> Result<Option<Vec<u8>>> + Sync),
    then: &(dyn Fn(usize) -> Result<Vec<u8>> + Sync),
) -> Vec<Result<Vec<u8>>> {
    let slots: Vec<Mutex<Option<Result<Vec<u8>>>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let put = |i: usize, r: Result<Vec<u8>>| *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    let left = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    run_on(threads.clamp(1, n.max(1)), &|| {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            match first(i) {
                Ok(Some(cubin)) => put(i, Ok(cubin)),
                Ok(None) => left.lock().unwrap_or_else(|e| e.into_inner()).push(i),
                Err(e) => put(i, Err(e)),
            }
        }
    });
    let left = left.into_inner().unwrap_or_else(|e| e.into_inner());
    let next = AtomicUsize::new(0);
    run_on(threads.clamp(1, left.len().max(1)), &|| {
        while let Some(&i) = left.get(next.fetch_add(1, Ordering::Relaxed)) {
            put(i, then(i));
        }
    });
    slots
        .into_iter()
        .map(|s| {
            s.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(Error::new(Status::Internal, "a kernel compile thread panicked")))
        })
        .collect()
}

/// Run `work` on `threads` threads and wait for them all; a thread's panic stays in it (its
/// jobs' results are missing, which the caller reports).
fn run_on(threads: usize, work: &(dyn Fn() + Sync)) {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
        for h in handles {
            let _ = h.join();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_typed_kernel_name_finds_its_module_and_untyped_ones_the_common_module() {
        let all = modules();
        assert_eq!(all.len(), 1 + TYPES.len());
        assert_eq!(all[0], Module::Common);
        for (t, (_, tag)) in TYPES.iter().enumerate() {
            for prefix in [
                "gsc_coll_",
                "gsc_net_reduce_",
                "gsc_coll_big_",
                "gsc_coll_bign_",
                "gsc_coll_pipe_",
                "gsc_coll_pipen_",
                "gsc_direct_",
                "gsc_ring_reduce_",
            ] {
                for op in ["sum", "prod", "max", "min", "avg", "premul"] {
                    let name = format!("{prefix}{tag}_{op}");
                    assert_eq!(all[module_of(&name)], Module::Typed { t }, "{name}");
                }
            }
        }
        for name in ["gsc_coll_barrier", "gsc_coll_triggered_done", "gsc_p2p", "gsc_p2p_self_copy", "gsc_ring_wait"] {
            assert_eq!(module_of(name), 0, "{name}");
        }
    }

    #[test]
    fn build_keeps_job_order_and_finishes_what_other_processes_had() {
        use std::sync::atomic::AtomicUsize;
        let thens = AtomicUsize::new(0);
        let got = build_with(
            20,
            3,
            &|i| match i {
                5 => Err(Error::new(Status::DeviceError, "job 5 does not compile")),
                7 => panic!("job 7's thread panics"),
                i if i % 4 == 0 => Ok(None),
                i => Ok(Some(vec![i as u8])),
            },
            &|i| {
                thens.fetch_add(1, Ordering::SeqCst);
                assert_eq!(i % 4, 0, "only jobs left to another process come back");
                Ok(vec![100 + i as u8])
            },
        );
        assert_eq!(got.len(), 20);
        for (i, r) in got.iter().enumerate() {
            match i {
                5 => assert_eq!(r.as_ref().unwrap_err().status(), Status::DeviceError),
                7 => assert_eq!(r.as_ref().unwrap_err().status(), Status::Internal),
                i if i % 4 == 0 => assert_eq!(r.as_ref().unwrap(), &vec![100 + i as u8]),
                i => assert_eq!(r.as_ref().unwrap(), &vec![i as u8]),
            }
        }
        assert_eq!(thens.load(Ordering::SeqCst), 5);
        assert!(build_with(0, 4, &|_| unreachable!(), &|_| unreachable!()).is_empty());
    }
}

//! How the collective kernels are cut into modules, and how a context's modules are built.
//!
//! Every typed kernel belongs to one element type (`TYPES`) and one family (`Family`: the
//! one-shot kernel, the phased large kernel and its narrow twin, the pipelined one and its
//! twin, the kernels on the peers' buffers), and a module holds one (type, family). The
//! type-less kernels (the copy-engine barrier, the triggered collectives' last node, the
//! point-to-point kernels, the ring's wait) make one more module, `Module::Common`; the
//! source compiles them only where `GSC_COMMON_KERNELS` is defined.
//!
//! Why so fine: the time to the first communicator on a fresh machine. A context builds every
//! module before its first collective (modules cannot be loaded later: `kernels::load_module`).
//! With one module per type, NVRTC 12.9 took 15–19 s per module on this project's CI machine
//! (f32 15.5 s, of which the one-shot and phased kernels 9.6 s, the pipelined 5.1 s, the peer
//! kernels 1.0 s), and the twelve compiled side by side could never take less than the slowest.
//! Cut by family, no module takes more than a few seconds, and `build` spreads them over one
//! thread per core. It shares the work with the other processes of the machine too (the ranks
//! of a job start together): through `kernel_cache`'s lock, a module another process is
//! compiling is left to it and read once the rest are done.

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

/// A family of typed kernels: what one instantiation macro (or two) of the source declares.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Family {
    /// `gsc_coll_<tag>_<op>` (the one-shot kernel) and `gsc_net_reduce_<tag>_<op>`.
    OneShot,
    /// `gsc_coll_big_<tag>_<op>`.
    Phased,
    /// `gsc_coll_bign_<tag>_<op>`.
    PhasedNarrow,
    /// `gsc_coll_pipe_<tag>_<op>`.
    Pipelined,
    /// `gsc_coll_pipen_<tag>_<op>`.
    PipelinedNarrow,
    /// `gsc_direct_<tag>_<op>` and `gsc_ring_reduce_<tag>_<op>`.
    PeerBuffers,
}

impl Family {
    pub(super) const ALL: [Family; 6] =
        [Family::OneShot, Family::Phased, Family::PhasedNarrow, Family::Pipelined, Family::PipelinedNarrow, Family::PeerBuffers];

    /// The source's instantiation macros that declare this family's kernels for one type.
    pub(super) fn macros(self) -> &'static [&'static str] {
        match self {
            Family::OneShot => &["GSC_COLL_LL"],
            Family::Phased => &["GSC_COLL_BIG"],
            Family::PhasedNarrow => &["GSC_COLL_BIGN"],
            Family::Pipelined => &["GSC_COLL_PIPE"],
            Family::PipelinedNarrow => &["GSC_COLL_PIPEN"],
            Family::PeerBuffers => &["GSC_COLL_DIRECT", "GSC_COLL_RING"],
        }
    }

    /// The family of a typed kernel, from its name's prefix.
    fn of_kernel(name: &str) -> Option<Family> {
        // A prefix before any it starts with: `gsc_coll_bign_` before `gsc_coll_big_`, and
        // `gsc_coll_` (the one-shot kernel) last.
        const PREFIXES: [(&str, Family); 8] = [
            ("gsc_coll_bign_", Family::PhasedNarrow),
            ("gsc_coll_big_", Family::Phased),
            ("gsc_coll_pipen_", Family::PipelinedNarrow),
            ("gsc_coll_pipe_", Family::Pipelined),
            ("gsc_direct_", Family::PeerBuffers),
            ("gsc_ring_reduce_", Family::PeerBuffers),
            ("gsc_net_reduce_", Family::OneShot),
            ("gsc_coll_", Family::OneShot),
        ];
        PREFIXES.iter().find(|(prefix, _)| name.starts_with(prefix)).map(|&(_, f)| f)
    }
}

/// One module of the collective kernels.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Module {
    /// The type-less kernels.
    Common,
    /// One family's kernels for `TYPES[t]`.
    Typed { t: usize, family: Family },
}

/// Every module, in the order `build` returns their cubins (and `module_of` counts).
pub(super) fn modules() -> Vec<Module> {
    let typed = (0..TYPES.len()).flat_map(|t| Family::ALL.into_iter().map(move |family| Module::Typed { t, family }));
    std::iter::once(Module::Common).chain(typed).collect()
}

/// Where in `modules()` kernel `name` is: the module of its type and family, or the common one
/// for a name with neither.
pub(super) fn module_of(name: &str) -> usize {
    let t = TYPES.iter().position(|(_, tag)| name.contains(&format!("_{tag}_")));
    match (t, Family::of_kernel(name)) {
        (Some(t), Some(family)) => 1 + t * Family::ALL.len() + Family::ALL.iter().position(|f| *f == family).expect("a family of ALL"),
        _ => 0,
    }
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
        assert_eq!(all.len(), 1 + TYPES.len() * Family::ALL.len());
        assert_eq!(all[0], Module::Common);
        for (t, (_, tag)) in TYPES.iter().enumerate() {
            for (prefix, family) in [
                ("gsc_coll_", Family::OneShot),
                ("gsc_net_reduce_", Family::OneShot),
                ("gsc_coll_big_", Family::Phased),
                ("gsc_coll_bign_", Family::PhasedNarrow),
                ("gsc_coll_pipe_", Family::Pipelined),
                ("gsc_coll_pipen_", Family::PipelinedNarrow),
                ("gsc_direct_", Family::PeerBuffers),
                ("gsc_ring_reduce_", Family::PeerBuffers),
            ] {
                for op in ["sum", "prod", "max", "min", "avg", "premul"] {
                    let name = format!("{prefix}{tag}_{op}");
                    assert_eq!(all[module_of(&name)], Module::Typed { t, family }, "{name}");
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

//! The collectives: `all-reduce`, `all-gather`, `reduce-scatter`, `broadcast` and `reduce` of
//! a gscomm `Communicator`, in nccl-tests' style: `-g` ranks, one process and one GPU each
//! (rank r on GPU r), every rank calling the same collective on its own buffers; and its
//! groups of sends and receives as nccl-tests' sendrecv and alltoall issue them
//! (`Communicator::transfers`; NCCL's twin: ncclSend/ncclRecv in ncclGroupStart/End):
//! `sendrecv` (each rank sends its buffer to the next rank and receives the previous one's)
//! and `all-to-all` (part q of each rank's buffer to rank q, self included).
//!
//! Sizes are nccl-tests' `size`: the bytes of the whole buffer, i.e. `count × element size` for
//! all-reduce, broadcast, reduce and sendrecv, and the total of all ranks' parts for all-gather
//! (what each rank receives), reduce-scatter and all-to-all (what each rank sends), so a rank's
//! part is size / nranks.
//! A size is rounded down to whole elements (whole parts of every rank), and skipped when it
//! holds none. Calls are out of place, from a send buffer into a separate receive buffer.
//!
//! Time is per call: wall clock over the timed iterations, from the first enqueue to the end
//! of the stream, after a host barrier of all ranks; the larger over the ranks is shown.
//! algbw = size / time; busbw = algbw × nccl-tests' factor for the collective (all-reduce
//! 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast, reduce and
//! sendrecv 1).
//!
//! How each mode starts the calls:
//! - stream: one gscomm call per iteration on the stream's condition (its kernels launched on
//!   the stream).
//! - graph: `-G` calls captured into one CUDA graph, replayed (nccl-tests' `-G`; time is per
//!   captured call).
//! - kernel: the call armed once on a kernel-triggered condition; one thread of a kernel
//!   triggers it and waits for it (`gsc_trigger` / `gsc_wait`), once per iteration, all
//!   iterations in one launch: the time per call is the whole round trip from the trigger
//!   (gscomm's thread sees it, launches the collective's graph, whose last node releases the
//!   wait). Its NCCL twin is nccl (NCCL has no kernel trigger).
//! - nccl, nccl-graph (`--nccl`, one beside each mode of `-m`): NCCL's ncclAllReduce, ... on
//!   the same buffers, the same way.
//!
//! `#wrong` (nccl-tests' column): after the timed loop of the first gscomm mode of each size,
//! one more call on inputs every rank can compute (small integers, depending on the rank and
//! the element, so float sums are exact), its result compared element by element with the host
//! reference (`reduce_reference`, which computes what the kernels compute; the ranks' parts or
//! the root's data for all-gather and broadcast); elements wrong, summed over the ranks. With
//! `--nccl`, `nccl #wrong` is the same check of NCCL's first mode, on the same inputs (NCCL's
//! `avg` may round differently from gscomm's sum-then-divide on non-power-of-two ranks).

use crate::nccl::{self, Nccl};
use crate::{Control, Sweep, config, die, hex, parse_size, spawn_peer, unhex};
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::types::reduce_reference;
use gscomm::collectives::{Communicator, DataType, PeerOp, PeerTransfer, RedOp};
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{DeviceBuf, Function, Module, PinnedBuf, Stream, device_count, set_device};
use std::cell::RefCell;
use std::net::Ipv4Addr;
use std::ops::Range;
use std::time::{Duration, Instant};

/// The collective of the subcommand.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    SendRecv,
    AllToAll,
}

impl Coll {
    /// The collective a subcommand names.
    pub(crate) fn parse(s: &str) -> Option<Coll> {
        match s {
            "all-reduce" => Some(Coll::AllReduce),
            "all-gather" => Some(Coll::AllGather),
            "reduce-scatter" => Some(Coll::ReduceScatter),
            "broadcast" => Some(Coll::Broadcast),
            "reduce" => Some(Coll::Reduce),
            "sendrecv" => Some(Coll::SendRecv),
            "all-to-all" => Some(Coll::AllToAll),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all-reduce",
            Coll::AllGather => "all-gather",
            Coll::ReduceScatter => "reduce-scatter",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::SendRecv => "sendrecv",
            Coll::AllToAll => "all-to-all",
        }
    }

    /// nccl-tests' busbw / algbw for `n` ranks.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// Whether the size is split into one part per rank (the count argument is a part).
    fn split(self) -> bool {
        matches!(self, Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll)
    }

    /// Sends and receives rather than a collective call.
    fn point_to_point(self) -> bool {
        matches!(self, Coll::SendRecv | Coll::AllToAll)
    }

    fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Stream,
    Graph,
    Kernel,
    Nccl,
    NcclGraph,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Stream => "stream",
            Mode::Graph => "graph",
            Mode::Kernel => "kernel",
            Mode::Nccl => "nccl",
            Mode::NcclGraph => "nccl-graph",
        }
    }

    fn is_nccl(self) -> bool {
        matches!(self, Mode::Nccl | Mode::NcclGraph)
    }

    fn is_graph(self) -> bool {
        matches!(self, Mode::Graph | Mode::NcclGraph)
    }

    /// NCCL's mode started the same way.
    fn nccl_twin(self) -> Mode {
        if self.is_graph() { Mode::NcclGraph } else { Mode::Nccl }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    coll: Coll,
    sweep: Sweep,
    /// Ranks, one GPU each (`-g`).
    nranks: usize,
    graph_iters: usize,
    dtype: DataType,
    op: RedOp,
    /// Broadcast's and reduce's root (`-r`).
    root: usize,
    /// gscomm's modes, then NCCL's with `--nccl`.
    modes: Vec<Mode>,
    nccl: bool,
    /// `-R 2`: the buffers are VMM memory registered as symmetric windows, with gscomm and
    /// with NCCL (nccl-tests' `-R 2`).
    windows: bool,
}

/// The options after the subcommand (`args` does not hold it).
pub(crate) fn parse_args(coll: Coll, args: &[String]) -> Option<Opts> {
    let mut o = Opts {
        coll,
        sweep: Sweep { min: 8, max: 128 << 20, factor: 2, iters: 1000, warmup: 100 },
        nranks: 2,
        graph_iters: 100,
        dtype: DataType::Float32,
        op: RedOp::Sum,
        root: 0,
        modes: vec![Mode::Stream, Mode::Graph],
        nccl: false,
        windows: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned();
        if o.sweep.apply(a, &mut val)? {
            continue;
        }
        match a.as_str() {
            "-g" => o.nranks = val()?.parse().ok().filter(|n| *n >= 1)?,
            "-G" => o.graph_iters = parse_size(&val()?).max(1),
            "-d" => {
                let v = val()?;
                o.dtype = DataType::parse(&v).or_else(|| {
                    let names: Vec<&str> = DataType::ALL.iter().map(|t| t.name()).collect();
                    eprintln!("gsc-bench: unknown datatype {v:?} (one of {})", names.join(", "));
                    None
                })?;
            }
            "-o" => {
                let v = val()?;
                o.op = RedOp::parse(&v).or_else(|| {
                    let names: Vec<&str> = RedOp::ALL.iter().map(|op| op.name()).collect();
                    eprintln!("gsc-bench: unknown operator {v:?} (one of {})", names.join(", "));
                    None
                })?;
            }
            "-r" => o.root = val()?.parse().ok()?,
            "-m" => {
                o.modes = val()?
                    .split(',')
                    .map(|m| match m {
                        "stream" => Some(Mode::Stream),
                        "graph" => Some(Mode::Graph),
                        "kernel" => Some(Mode::Kernel),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?
            }
            "--nccl" => o.nccl = true,
            "-R" => {
                o.windows = match val()?.as_str() {
                    "0" => false,
                    "2" => true,
                    v => {
                        eprintln!(
                            "gsc-bench: -R {v}: 0 (no registration) or 2 (symmetric windows); local registration (1) changes no path in gscomm"
                        );
                        return None;
                    }
                }
            }
            _ => return None,
        }
    }
    if coll.point_to_point() && o.modes.contains(&Mode::Kernel) {
        eprintln!("gsc-bench: {} has no kernel mode (sends and receives take stream and graph conditions)", coll.name());
        return None;
    }
    if coll.rooted() && o.root >= o.nranks {
        eprintln!("gsc-bench: root {} is not one of the {} ranks", o.root, o.nranks);
        return None;
    }
    if o.nccl {
        let twins: Vec<Mode> = o.modes.iter().map(|m| m.nccl_twin()).collect();
        for t in twins {
            // stream and kernel share NCCL's stream mode.
            if !o.modes.contains(&t) {
                o.modes.push(t);
            }
        }
    }
    Some(o)
}

/// One size of the sweep, as the calls take it.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// nccl-tests' size: bytes of the whole buffer (all-gather: what a rank receives;
    /// reduce-scatter: what a rank sends).
    bytes: usize,
    /// The count argument of one call, in elements (all-gather: sendcount; reduce-scatter:
    /// recvcount; the others: count).
    count: usize,
}

/// The sweep's sizes rounded down to whole elements (whole parts of every rank for
/// all-gather and reduce-scatter); those holding none are left out.
fn shapes(o: &Opts) -> Vec<Shape> {
    let ts = o.dtype.size();
    let parts = if o.coll.split() { o.nranks } else { 1 };
    let mut v: Vec<Shape> = o
        .sweep
        .sizes()
        .into_iter()
        .filter_map(|size| {
            let count = size / ts / parts;
            (count > 0).then_some(Shape { bytes: count * parts * ts, count })
        })
        .collect();
    // Rounding can make neighbours equal (-b 8 -e 15 on double: both hold one element).
    v.dedup_by_key(|s| s.bytes);
    v
}

/// Iterations for one size: `-n`, fewer for large sizes (at most ~4 GiB per rank's buffer),
/// a multiple of the graph's captured calls for the graph modes. (timed, warmup)
fn iterations(o: &Opts, bytes: usize, mode: Mode) -> (usize, usize) {
    let budget = ((4usize << 30) / bytes.max(1)).max(5);
    let n = o.sweep.iters.min(budget);
    let w = o.sweep.warmup.min(n);
    if mode.is_graph() {
        let g = o.graph_iters.min(n);
        (n.div_ceil(g) * g, w.div_ceil(g).max(1) * g)
    } else {
        (n, w)
    }
}

/// Rank `rank`'s input element `i`: a small integer in -2..=2 (exact in every datatype, and
/// any sum or product of up to 8 of them is too), mixed so that a shifted or swapped element
/// shows.
fn value(rank: usize, i: usize) -> i64 {
    let h = (i as u64 ^ ((rank as u64) << 48)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((h >> 32) % 5) as i64 - 2
}

/// Rank `rank`'s input elements `range`, little-endian in `dtype` (negative values wrap in the
/// unsigned types, as `reduce_reference` expects).
fn input(dtype: DataType, rank: usize, range: Range<usize>) -> Vec<u8> {
    let mut out = Vec::with_capacity(range.len() * dtype.size());
    for i in range {
        dtype.push_integer(value(rank, i), &mut out);
    }
    out
}

/// Where a stretch of the expected result comes from.
#[derive(Clone, Copy)]
enum Source {
    /// Every rank's input elements from `base` on, reduced.
    Reduced { base: usize },
    /// Rank `rank`'s input elements from `base` on.
    Rank { rank: usize, base: usize },
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the machine.
fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Elements compared at a time (bounds the host memory of the check: nranks inputs of this
/// many elements).
const CHECK_CHUNK: usize = 1 << 20;

/// Rank 0's control channels to ranks 1..n-1, or a child's to rank 0.
enum Link {
    Root(Vec<Control>),
    Child(Control),
}

impl Link {
    /// Every rank calls it; returns when all have. Rank 0 hears from every child before it
    /// answers any, so no rank leaves before the last one has arrived.
    fn barrier(&mut self) {
        match self {
            Link::Root(peers) => {
                peers.iter_mut().for_each(|c| drop(c.expect("BARRIER")));
                peers.iter_mut().for_each(|c| c.send("BARRIER", ""));
            }
            Link::Child(c) => c.barrier(),
        }
    }
}

/// One rank's state.
struct Rank<'a> {
    o: &'a Opts,
    rank: usize,
    comm: Communicator,
    nccl: Option<nccl::Comm<'a>>,
    /// gscomm's condition of `stream` (declared first: dropped first).
    cond: Condition,
    stream: Stream,
    /// Both of the sweep's largest size: every call of the sweep fits (see `shapes`).
    send: DeviceBuf,
    recv: DeviceBuf,
    /// The kernel mode: its condition, the triggering kernel, and the call armed for the size
    /// being measured (bytes, device handle).
    triggered: Option<Triggering>,
}

/// What the kernel mode needs on a rank.
struct Triggering {
    cond: Condition,
    trigger_loop: Function,
    _module: Module,
    armed: RefCell<Option<(usize, u64)>>,
    failed: PinnedBuf,
}

/// The kernel mode's kernel: one thread triggers the call `n` times, each after the last
/// completed.
const TRIGGER_LOOP: &str = r#"
extern "C" __global__ void trigger_loop(gsc_device_handle_t *h, unsigned long long n, unsigned long long *failed) {
    for (unsigned long long i = 0; i < n; i++) {
        gsc_trigger(h);
        if (gsc_wait(h) != 0) { *failed = 1; return; }
    }
}
"#;

impl Triggering {
    fn new() -> Triggering {
        let module = Module::compile(&format!("{}\n{TRIGGER_LOOP}", include_str!("../../../include/gsc_device.cuh")))
            .unwrap_or_else(|e| die("compile", e));
        Triggering {
            cond: Condition::cuda(Category::KernelTriggered, 0, None).unwrap_or_else(|e| die("condition", e)),
            trigger_loop: module.function("trigger_loop").unwrap_or_else(|e| die("kernel", e)),
            _module: module,
            armed: RefCell::new(None),
            failed: PinnedBuf::new(8).unwrap_or_else(|e| die("pinned buffer", e)),
        }
    }
}

impl Rank<'_> {
    fn sync(&self) {
        self.stream.synchronize().unwrap_or_else(|e| die("stream synchronize", e));
    }

    /// Enqueue one call of `mode`'s library on `stream` (`cond`: gscomm's condition of it; the
    /// kernel mode: `n` triggers of the call armed for `s`, from one kernel on `stream`).
    fn call(&self, mode: Mode, s: Shape, stream: &Stream, cond: &Condition) {
        if mode == Mode::Kernel {
            return self.trigger(s, 1);
        }
        let o = self.o;
        let (send, recv, count) = (self.send.ptr(), self.recv.ptr(), s.count);
        if mode.is_nccl() {
            let c = self.nccl.as_ref().expect("nccl modes come with a communicator");
            let (dt, op, root, st) = (o.dtype.nccl(), o.op.nccl(), o.root as i32, stream.raw());
            // SAFETY: our device buffers on this rank's GPU, each of the sweep's largest size,
            // which holds every call of the sweep; every run ends with a stream synchronize,
            // and the buffers live until the end of `rank_main`.
            let r = unsafe {
                match o.coll {
                    Coll::AllReduce => c.all_reduce(send, recv, count, dt, op, st),
                    Coll::AllGather => c.all_gather(send, recv, count, dt, st),
                    Coll::ReduceScatter => c.reduce_scatter(send, recv, count, dt, op, st),
                    Coll::Broadcast => c.broadcast(send, recv, count, dt, root, st),
                    Coll::Reduce => c.reduce(send, recv, count, dt, op, root, st),
                    Coll::SendRecv | Coll::AllToAll => {
                        let (sends, recvs) = self.peer_group(s);
                        c.group(&sends, &recvs, st)
                    }
                }
            };
            r.unwrap_or_else(|e| die("nccl", e));
        } else {
            let (c, dt, op, root) = (&self.comm, o.dtype, o.op, o.root);
            // SAFETY: as above.
            let r = unsafe {
                match o.coll {
                    Coll::AllReduce => c.all_reduce(send, recv, count, dt, op, cond),
                    Coll::AllGather => c.all_gather(send, recv, count, dt, cond),
                    Coll::ReduceScatter => c.reduce_scatter(send, recv, count, dt, op, cond),
                    Coll::Broadcast => c.broadcast(send, recv, count, dt, root, cond),
                    Coll::Reduce => c.reduce(send, recv, count, dt, op, root, cond),
                    Coll::SendRecv | Coll::AllToAll => {
                        let (sends, recvs) = self.peer_group(s);
                        let op = |(buf, bytes, peer): (u64, usize, i32), op| PeerTransfer { op, buf, bytes, peer: peer as usize };
                        let group: Vec<PeerTransfer> =
                            sends.into_iter().map(|t| op(t, PeerOp::Send)).chain(recvs.into_iter().map(|t| op(t, PeerOp::Recv))).collect();
                        c.transfers(&group, cond)
                    }
                }
            };
            if let Err(e) = r {
                die(o.coll.name(), e);
            }
        }
    }

    /// The kernel mode: `n` triggers of the call for `s` (armed on the first use of the size)
    /// from one thread of one kernel on the stream.
    fn trigger(&self, s: Shape, n: usize) {
        let t = self.triggered.as_ref().expect("the kernel mode comes with its kernel");
        let mut armed = t.armed.borrow_mut();
        if armed.is_none_or(|(bytes, _)| bytes != s.bytes) {
            let (send, recv, count) = (self.send.ptr(), self.recv.ptr(), s.count);
            let (c, dt, op, root, on) = (&self.comm, self.o.dtype, self.o.op, self.o.root, &t.cond);
            // SAFETY: as in `call`; the armed call is triggered only while the buffers live
            // (the kernels end with a stream synchronize before `rank_main` returns).
            let r = unsafe {
                match self.o.coll {
                    Coll::AllReduce => c.all_reduce(send, recv, count, dt, op, on),
                    Coll::AllGather => c.all_gather(send, recv, count, dt, on),
                    Coll::ReduceScatter => c.reduce_scatter(send, recv, count, dt, op, on),
                    Coll::Broadcast => c.broadcast(send, recv, count, dt, root, on),
                    Coll::Reduce => c.reduce(send, recv, count, dt, op, root, on),
                    Coll::SendRecv | Coll::AllToAll => unreachable!("refused by parse_args"),
                }
            };
            let handle = r.unwrap_or_else(|e| die(self.o.coll.name(), e)).device_handle;
            *armed = Some((s.bytes, handle));
        }
        let handle = armed.expect("armed above").1;
        t.trigger_loop.launch(1, 1, &self.stream, &[handle, n as u64, t.failed.device_ptr()]).unwrap_or_else(|e| die("launch", e));
    }

    /// Run `warmup` then `iters` calls of `mode`, timing the latter; seconds per call.
    fn run(&self, link: &mut Link, mode: Mode, s: Shape) -> f64 {
        let (iters, warmup) = iterations(self.o, s.bytes, mode);
        let elapsed = if mode == Mode::Kernel {
            self.trigger(s, warmup);
            self.sync();
            link.barrier();
            let t0 = Instant::now();
            let left_barrier = monotonic_ns();
            self.trigger(s, iters);
            let enqueued = t0.elapsed();
            self.sync();
            self.trace(mode, s, left_barrier, enqueued, t0.elapsed(), iters);
            let failed = self.triggered.as_ref().expect("kernel mode").failed.to_vec();
            if failed.iter().any(|&b| b != 0) {
                self.comm.async_error().unwrap_or_else(|e| die(self.o.coll.name(), e));
                die(self.o.coll.name(), "a triggered call failed (gsc_wait returned -1)");
            }
            t0.elapsed()
        } else if mode.is_graph() {
            // `g` calls captured once, the graph replayed: per replay one launch, no host work
            // per call.
            let g = self.o.graph_iters.min(iters);
            let cap = Stream::new().unwrap_or_else(|e| die("stream", e));
            let cond = Condition::cuda(Category::Stream, cap.raw(), None).unwrap_or_else(|e| die("condition", e));
            cap.begin_capture().unwrap_or_else(|e| die("begin capture", e));
            (0..g).for_each(|_| self.call(mode, s, &cap, &cond));
            let graph = cap.end_capture().unwrap_or_else(|e| die("end capture", e));
            let exec = graph.instantiate().unwrap_or_else(|e| die("instantiate", e));
            let launch = |times: usize| (0..times).for_each(|_| exec.launch(&self.stream).unwrap_or_else(|e| die("graph launch", e)));
            launch(warmup / g);
            self.sync();
            link.barrier();
            let t0 = Instant::now();
            let left_barrier = monotonic_ns();
            launch(iters / g);
            let enqueued = t0.elapsed();
            self.sync();
            self.trace(mode, s, left_barrier, enqueued, t0.elapsed(), iters);
            t0.elapsed()
        } else {
            (0..warmup).for_each(|_| self.call(mode, s, &self.stream, &self.cond));
            self.sync();
            link.barrier();
            let t0 = Instant::now();
            let left_barrier = monotonic_ns();
            (0..iters).for_each(|_| self.call(mode, s, &self.stream, &self.cond));
            let enqueued = t0.elapsed();
            self.sync();
            self.trace(mode, s, left_barrier, enqueued, t0.elapsed(), iters);
            t0.elapsed()
        };
        if !mode.is_nccl() {
            // A kernel that gave up waiting for a peer leaves wrong results and a stream that
            // still completes: say so rather than print its time.
            self.comm.async_error().unwrap_or_else(|e| die(self.o.coll.name(), e));
        }
        elapsed.as_secs_f64() / iters as f64
    }

    /// `GSC_BENCH_TRACE`: this rank's side of one measurement on stderr — when it left the
    /// barrier (the system's monotonic clock, comparable between the ranks' processes), how
    /// long enqueueing took and the whole time — to tell a slow rank from a late one.
    fn trace(&self, mode: Mode, s: Shape, left_barrier: u64, enqueued: Duration, total: Duration, iters: usize) {
        if std::env::var_os("GSC_BENCH_TRACE").is_none() {
            return;
        }
        eprintln!(
            "# trace rank {} {} {} B: left barrier at {} us, enqueued in {:.1} us, {:.2} us per call",
            self.rank,
            mode.label(),
            s.bytes,
            left_barrier / 1000,
            enqueued.as_secs_f64() * 1e6,
            total.as_secs_f64() * 1e6 / iters as f64
        );
    }

    /// The sends and receives of one call of sendrecv or all-to-all for `s`: (buffer, bytes,
    /// peer) each, in nccl-tests' order (sends, then receives).
    #[allow(clippy::type_complexity)]
    fn peer_group(&self, s: Shape) -> (Vec<(u64, usize, i32)>, Vec<(u64, usize, i32)>) {
        let (me, n) = (self.rank, self.o.nranks);
        let bytes = s.count * self.o.dtype.size();
        let (send, recv) = (self.send.ptr(), self.recv.ptr());
        match self.o.coll {
            Coll::SendRecv => (vec![(send, bytes, ((me + 1) % n) as i32)], vec![(recv, bytes, ((me + n - 1) % n) as i32)]),
            _ => {
                let at = |base: u64, q: usize| base + (q * bytes) as u64;
                ((0..n).map(|q| (at(send, q), bytes, q as i32)).collect(), (0..n).map(|q| (at(recv, q), bytes, q as i32)).collect())
            }
        }
    }

    /// Where this rank's expected result comes from: (first element of the receive buffer,
    /// elements, source) stretches. The send buffer holds `input(rank, 0..)` (see `rank_main`).
    fn expected(&self, s: Shape) -> Vec<(usize, usize, Source)> {
        let (me, count) = (self.rank, s.count);
        match self.o.coll {
            Coll::AllReduce => vec![(0, count, Source::Reduced { base: 0 })],
            // Our part of the reduction of every rank's nranks parts.
            Coll::ReduceScatter => vec![(0, count, Source::Reduced { base: me * count })],
            // Only the root's receive buffer is written.
            Coll::Reduce if me == self.o.root => vec![(0, count, Source::Reduced { base: 0 })],
            Coll::Reduce => Vec::new(),
            Coll::Broadcast => vec![(0, count, Source::Rank { rank: self.o.root, base: 0 })],
            // Rank q's part at q × count.
            Coll::AllGather => (0..self.o.nranks).map(|q| (q * count, count, Source::Rank { rank: q, base: 0 })).collect(),
            // The previous rank's buffer.
            Coll::SendRecv => vec![(0, count, Source::Rank { rank: (me + self.o.nranks - 1) % self.o.nranks, base: 0 })],
            // Rank q's part for us, at q × count.
            Coll::AllToAll => (0..self.o.nranks).map(|q| (q * count, count, Source::Rank { rank: q, base: me * count })).collect(),
        }
    }

    /// One call of `mode` on the known inputs, checked exactly: the elements of this rank's
    /// result that differ from the host reference.
    fn wrong(&self, mode: Mode, s: Shape) -> usize {
        let (dtype, ts) = (self.o.dtype, self.o.dtype.size());
        // A pattern no result has (small integers), so an element never written shows.
        self.recv.fill(0xab).unwrap_or_else(|e| die("memset", e));
        self.call(mode, s, &self.stream, &self.cond);
        self.sync();
        if !mode.is_nccl() {
            self.comm.async_error().unwrap_or_else(|e| die(self.o.coll.name(), e));
        }
        let got = self.recv.download().unwrap_or_else(|e| die("download", e));
        let mut bad = 0;
        for (at, len, source) in self.expected(s) {
            // In chunks: the inputs of every rank for the whole buffer would be nranks × size
            // on the host, in every rank's process.
            for a in (0..len).step_by(CHECK_CHUNK) {
                let b = (a + CHECK_CHUNK).min(len);
                let want = match source {
                    Source::Rank { rank, base } => input(dtype, rank, base + a..base + b),
                    Source::Reduced { base } => {
                        let ins: Vec<Vec<u8>> = (0..self.o.nranks).map(|q| input(dtype, q, base + a..base + b)).collect();
                        let refs: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
                        reduce_reference(dtype, self.o.op, &refs)
                    }
                };
                let got = &got[(at + a) * ts..(at + b) * ts];
                bad += got.chunks_exact(ts).zip(want.chunks_exact(ts)).filter(|(x, y)| x != y).count();
            }
        }
        bad
    }
}

/// One size's results on one rank: seconds per call for each mode, then the #wrong of each
/// library checked (gscomm, then NCCL with `--nccl`).
struct Row {
    secs: Vec<f64>,
    wrong: Vec<usize>,
}

impl Row {
    /// "secs,secs,...;wrong,wrong" for the control channel.
    fn encode(&self) -> String {
        let secs: Vec<String> = self.secs.iter().map(f64::to_string).collect();
        let wrong: Vec<String> = self.wrong.iter().map(usize::to_string).collect();
        format!("{};{}", secs.join(","), wrong.join(","))
    }

    /// Fold in another rank's row (`encode`d): the larger time, the sum of the wrong elements.
    fn merge(&mut self, theirs: &str) {
        let bad = || -> ! { die("control channel", format!("bad row {theirs:?}")) };
        let (secs, wrong) = theirs.split_once(';').unwrap_or_else(|| bad());
        let secs: Vec<f64> = secs.split(',').map(|t| t.parse().unwrap_or_else(|_| bad())).collect();
        let wrong: Vec<usize> = wrong.split(',').filter(|w| !w.is_empty()).map(|w| w.parse().unwrap_or_else(|_| bad())).collect();
        if secs.len() != self.secs.len() || wrong.len() != self.wrong.len() {
            bad();
        }
        self.secs.iter_mut().zip(secs).for_each(|(a, b)| *a = a.max(b));
        self.wrong.iter_mut().zip(wrong).for_each(|(a, b)| *a += b);
    }
}

fn print_header(o: &Opts, nccl_version: Option<String>) {
    let what = if o.coll.reduces() { format!("type {} op {}", o.dtype.name(), o.op.name()) } else { format!("type {}", o.dtype.name()) };
    println!(
        "# gsc-bench {} | gscomm {} | {} ranks on GPUs 0..{}, one process each | {what}{} | -n {} -w {} -G {}{}{}",
        o.coll.name(),
        gscomm::VERSION,
        o.nranks,
        o.nranks - 1,
        if o.coll.rooted() { format!(" root {}", o.root) } else { String::new() },
        o.sweep.iters,
        o.sweep.warmup,
        o.graph_iters,
        nccl_version.map(|v| format!(" | NCCL {v}")).unwrap_or_default(),
        if o.windows { " | buffers in symmetric windows (-R 2)" } else { "" }
    );
    println!(
        "# out of place; time per call (us), the largest over the ranks; algbw = size / time (GB/s); busbw = algbw x {:.3}",
        o.coll.bus_factor(o.nranks)
    );
    println!("# #wrong: elements of one checked call that differ from the host reference, summed over the ranks");
    let mut head = format!("{:>12} {:>12} {:>8} {:>6} {:>6}", "size(B)", "count", "type", "redop", "root");
    for m in &o.modes {
        head += &format!(" {:>14} {:>8} {:>8}", format!("{}(us)", m.label()), "algbw", "busbw");
    }
    head += &format!(" {:>7}", "#wrong");
    if o.nccl {
        head += &format!(" {:>11}", "nccl #wrong");
    }
    println!("{head}");
}

fn print_row(o: &Opts, s: Shape, row: &Row) {
    let op = if o.coll.reduces() { o.op.name() } else { "none" };
    let root = if o.coll.rooted() { o.root as i64 } else { -1 };
    let mut line = format!("{:>12} {:>12} {:>8} {op:>6} {root:>6}", s.bytes, s.bytes / o.dtype.size(), o.dtype.name());
    for t in &row.secs {
        let algbw = s.bytes as f64 / t / 1e9;
        line += &format!(" {:>14.2} {:>8.2} {:>8.2}", t * 1e6, algbw, algbw * o.coll.bus_factor(o.nranks));
    }
    line += &format!(" {:>7}", row.wrong[0]);
    if let Some(w) = row.wrong.get(1) {
        line += &format!(" {w:>11}");
    }
    println!("{line}");
}

/// Everything every rank does: set up, then every (size, mode) in the same order; rank 0
/// prints a row per size as the ranks report them.
fn rank_main(o: &Opts, rank: usize, link: &mut Link, uid: &UniqueId, nccl: Option<(&Nccl, nccl::UniqueId)>, cfg: &gscomm::Config) {
    set_device(rank as i32).unwrap_or_else(|e| die("set_device", e));
    let boot = Bootstrap::init(uid, rank as u32, o.nranks as u32, cfg.bootstrap_timeout).unwrap_or_else(|e| die("bootstrap", e));
    let comm = Communicator::new(boot, rank as i32, cfg).unwrap_or_else(|e| die("communicator", e));
    // After gscomm's on every rank, so the two collective set-ups come in the same order.
    let mut nccl = nccl.map(|(lib, id)| lib.comm(id, rank as i32, o.nranks as i32).unwrap_or_else(|e| die("nccl", e)));
    let shapes = shapes(o);
    let max = shapes.iter().map(|s| s.bytes).max().unwrap_or(1);
    // Windows need memory the peers can map as a whole: VMM, as ncclMemAlloc makes.
    let buf = |what| if o.windows { DeviceBuf::new_vmm(max) } else { DeviceBuf::new(max) }.unwrap_or_else(|e| die(what, e));
    let (send, recv) = (buf("send buffer"), buf("receive buffer"));
    if o.windows {
        // Collective, in the same order on every rank: gscomm's, then NCCL's.
        for b in [&send, &recv] {
            comm.register_window(b.ptr(), max, true).unwrap_or_else(|e| die("window", e));
        }
        if let Some(n) = nccl.as_mut() {
            n.register_windows(&[(send.ptr(), max), (recv.ptr(), max)]).unwrap_or_else(|e| die("nccl window", e));
        }
    }
    let stream = Stream::new().unwrap_or_else(|e| die("stream", e));
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap_or_else(|e| die("condition", e));
    let triggered = o.modes.contains(&Mode::Kernel).then(Triggering::new);
    let r = Rank { o, rank, comm, nccl, cond, stream, send, recv, triggered };
    // The checked inputs, once: calls are out of place, so the send buffer keeps them, and
    // every size reads a prefix of them (reduce-scatter: all nranks parts).
    r.send.upload(&input(o.dtype, rank, 0..max / o.dtype.size())).unwrap_or_else(|e| die("upload", e));
    for s in shapes {
        let mut row = Row { secs: Vec::new(), wrong: Vec::new() };
        for (i, &mode) in o.modes.iter().enumerate() {
            row.secs.push(r.run(link, mode, s));
            // The first mode of each library is checked, after its timed loop.
            if !o.modes[..i].iter().any(|m| m.is_nccl() == mode.is_nccl()) {
                row.wrong.push(r.wrong(mode, s));
            }
        }
        match link {
            Link::Child(c) => c.send("ROW", &row.encode()),
            Link::Root(peers) => {
                peers.iter_mut().for_each(|c| row.merge(&c.expect("ROW")));
                print_row(o, s, &row);
            }
        }
    }
    if matches!(link, Link::Root(_)) {
        // Which path the large calls took (`GSC_COLL_SM`, `GSC_COLL_RING`, `GSC_COLL_CE`): a
        // knob that did not apply shows here, not as a puzzling number.
        println!(
            "# rank 0 ran {} calls by the direct kernel ({} on windows, without an exchange), {} by the copy-engine ring, {} by the copy engines (the rest: workspace kernels)",
            r.comm.direct_calls(),
            r.comm.window_calls(),
            r.comm.ring_calls(),
            r.comm.copy_engine_calls()
        );
    }
    // Nobody tears down before everyone is done.
    match link {
        Link::Child(c) => drop(c.expect("BYE")),
        Link::Root(peers) => peers.iter_mut().for_each(|c| c.send("BYE", "")),
    }
}

/// Ranks 1..n-1: started by rank 0 (`spawn_peer`), which sends the rank and the unique ids.
pub(crate) fn server(o: &Opts) {
    let cfg = config();
    let mut ctl = Control::of_parent_stdout_to_stderr();
    let rank: usize = ctl.expect("RANK").parse().unwrap_or_else(|e| die("control channel", e));
    let uid = UniqueId::from_bytes(&unhex(&ctl.expect("UID"))).unwrap_or_else(|e| die("unique id", e));
    let lib = o.nccl.then(|| Nccl::load().unwrap_or_else(|e| die("nccl", e)));
    let nccl_id = o.nccl.then(|| {
        let b = unhex(&ctl.expect("NCCLID"));
        nccl::UniqueId { internal: b.try_into().unwrap_or_else(|_| die("nccl", "bad unique id")) }
    });
    rank_main(o, rank, &mut Link::Child(ctl), &uid, lib.as_ref().zip(nccl_id), &cfg);
}

/// Rank 0: start the other ranks, run with them, print the table.
pub(crate) fn client(o: &Opts, args: &[String]) {
    let cfg = config();
    let gpus = device_count();
    if gpus < o.nranks as i32 {
        die("GPUs", format!("-g {} needs {} GPUs, this machine has {gpus}", o.nranks, o.nranks));
    }
    if shapes(o).is_empty() {
        die("sizes", format!("no size from -b {} to -e {} holds one {} per rank", o.sweep.min, o.sweep.max, o.dtype.name()));
    }
    let lib = o.nccl.then(|| Nccl::load().unwrap_or_else(|e| die("nccl", e)));
    // Every rank runs on this host: the rendezvous listens on loopback.
    let uid = UniqueId::create(Some(Ipv4Addr::LOCALHOST.into())).unwrap_or_else(|e| die("unique id", e));
    let nccl_id = lib.as_ref().map(|l| l.unique_id().unwrap_or_else(|e| die("nccl", e)));
    let (mut children, mut peers) = (Vec::new(), Vec::new());
    for rank in 1..o.nranks {
        let (child, mut ctl) = spawn_peer(args);
        ctl.send("RANK", &rank.to_string());
        ctl.send("UID", &hex(&uid.to_bytes()));
        if let Some(id) = &nccl_id {
            ctl.send("NCCLID", &hex(&id.internal));
        }
        children.push(child);
        peers.push(ctl);
    }
    print_header(o, lib.as_ref().map(Nccl::version));
    rank_main(o, 0, &mut Link::Root(peers), &uid, lib.as_ref().zip(nccl_id), &cfg);
    for (i, mut child) in children.into_iter().enumerate() {
        match child.wait() {
            Ok(st) if st.success() => {}
            Ok(st) => die(&format!("rank {}", i + 1), st),
            Err(e) => die(&format!("rank {}", i + 1), e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(coll: &str, args: &[&str]) -> Option<Opts> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse_args(Coll::parse(coll)?, &args)
    }

    #[test]
    fn options() {
        let o = opts("all-reduce", &["-g", "4", "-d", "half", "-o", "max", "--nccl", "-m", "graph"]).unwrap();
        assert_eq!((o.nranks, o.dtype, o.op), (4, DataType::Float16, RedOp::Max));
        assert_eq!(o.modes, vec![Mode::Graph, Mode::NcclGraph], "one NCCL mode beside each of -m");
        let o = opts("all-reduce", &["--nccl", "-m", "stream,kernel,graph"]).unwrap();
        assert_eq!(
            o.modes,
            vec![Mode::Stream, Mode::Kernel, Mode::Graph, Mode::Nccl, Mode::NcclGraph],
            "stream and kernel share one NCCL mode"
        );
        assert!(opts("all-reduce", &["-d", "float8"]).is_none(), "an unknown datatype is a usage error");
        assert!(opts("all-reduce", &["-o", "xor"]).is_none(), "an unknown operator is a usage error");
        assert!(opts("all-reduce", &["-R", "2"]).unwrap().windows, "nccl-tests' symmetric registration");
        assert!(!opts("all-reduce", &["-R", "0"]).unwrap().windows);
        assert!(opts("all-reduce", &["-R", "1"]).is_none(), "local registration changes no path: refused, not ignored");
        assert!(opts("all-reduce", &["-g", "0"]).is_none());
        assert!(opts("broadcast", &["-g", "2", "-r", "2"]).is_none(), "the root is one of the ranks");
        assert!(opts("all-reduce", &["-r", "2"]).is_some(), "no root to check");
        assert!(Coll::parse("alltoall").is_none(), "gsc-bench spells it all-to-all");
        let o = opts("sendrecv", &["--nccl", "-m", "stream,graph"]).unwrap();
        assert_eq!(o.modes, vec![Mode::Stream, Mode::Graph, Mode::Nccl, Mode::NcclGraph]);
        assert!(opts("all-to-all", &["-m", "kernel"]).is_none(), "sends and receives have no kernel mode");
    }

    #[test]
    fn an_all_to_all_size_is_what_a_rank_sends_in_parts_for_every_rank() {
        let o = opts("all-to-all", &["-g", "4", "-b", "64", "-e", "64", "-d", "uint8"]).unwrap();
        let s: Vec<(usize, usize)> = shapes(&o).iter().map(|s| (s.bytes, s.count)).collect();
        assert_eq!(s, vec![(64, 16)], "16 bytes to each of 4 ranks");
        assert_eq!(Coll::AllToAll.bus_factor(4), 0.75);
        assert_eq!(Coll::SendRecv.bus_factor(4), 1.0);
        let o = opts("sendrecv", &["-g", "4", "-b", "64", "-e", "64", "-d", "uint8"]).unwrap();
        assert_eq!(shapes(&o).iter().map(|s| (s.bytes, s.count)).collect::<Vec<_>>(), vec![(64, 64)], "the whole buffer to the next rank");
    }

    #[test]
    fn sizes_as_nccl_tests_counts_them() {
        let o = opts("all-gather", &["-g", "4", "-b", "8", "-e", "100", "-f", "2"]).unwrap();
        // float, 4 ranks: a size holds whole parts of 4 floats (16 bytes); 8 holds none.
        let s: Vec<(usize, usize)> = shapes(&o).iter().map(|s| (s.bytes, s.count)).collect();
        assert_eq!(s, vec![(16, 1), (32, 2), (64, 4), (96, 6)]);
        let o = opts("all-reduce", &["-b", "4", "-e", "24", "-f", "3", "-d", "double"]).unwrap();
        let s: Vec<(usize, usize)> = shapes(&o).iter().map(|s| (s.bytes, s.count)).collect();
        assert_eq!(s, vec![(8, 1), (24, 3)], "4 holds no double; 12 rounds down to 8, 36 is past -e 24");
        let o = opts("all-reduce", &["-b", "8", "-e", "15", "-d", "double"]).unwrap();
        assert_eq!(shapes(&o).len(), 1, "8 and 15 both hold one double: one row");
    }

    #[test]
    fn inputs_are_small_integers() {
        let f: Vec<f32> = input(DataType::Float32, 3, 0..1000).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert!(f.iter().all(|v| (-2.0..=2.0).contains(v) && v.fract() == 0.0));
        assert_ne!(input(DataType::Int8, 0, 0..64), input(DataType::Int8, 1, 0..64), "ranks differ");
        assert_eq!(input(DataType::Float64, 2, 10..20).len(), 80);
    }

    #[test]
    fn rows_merge_max_time_and_sum_wrong() {
        let mut row = Row { secs: vec![1e-6, 3e-6], wrong: vec![0, 2] };
        row.merge(&Row { secs: vec![2e-6, 1e-6], wrong: vec![5, 1] }.encode());
        assert_eq!(row.secs, vec![2e-6, 3e-6]);
        assert_eq!(row.wrong, vec![5, 3]);
    }
}

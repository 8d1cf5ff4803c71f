//! `gpu-sendrecv`: GPU buffers between two GPUs, one process per GPU, in nccl-tests' sendrecv
//! pattern: every iteration each rank sends `size` bytes to the other and receives `size` bytes
//! from it, both in flight together. Time is per iteration (wall clock over the timed
//! iterations, from the first enqueue to the end of the stream); busbw = algbw = size / time, as
//! nccl-tests defines it for sendrecv. `#wrong` counts bytes of the last iteration's receive
//! that differ from what the peer sent (nccl-tests' column of the same name).
//!
//! How each mode starts the operations, all through the proxy:
//! - stream: receive and send issued on the stream (`no_stream_wait`), then `Condition::wait`,
//!   in one condition group: per iteration one batch of a trigger write and a wait, enqueued by
//!   the host.
//! - graph: `-G` iterations of the stream sequence captured into one CUDA graph, replayed
//!   (nccl-tests' `-G`; time is per captured iteration).
//! - kernel: one kernel runs every iteration, triggering both operations and waiting for them
//!   from the device (`gsc_trigger` / `gsc_wait`).
//! - pstream, pgraph: stream and graph with prepared transfers (a send and a receive prepared
//!   once per size; each iteration is one round of each: receiver ready, then data written
//!   into the receive buffer, by the copy engine for GPU buffers).
//! - gstream, ggraph: the same with the rounds run on the GPU (`gpu_rounds`): one kernel per
//!   round on the stream writes into the peer's buffer over NVLink and raises its flag.
//! - gkernel: GPU rounds driven by one kernel for all iterations (`gsc_prep_cursor_ready`,
//!   `_send`, `_wait` from include/gsc_device.cuh): no launch per iteration.
//! - gping: gkernel as a ping-pong (rank 0 sends then waits, rank 1 waits then sends); the time
//!   shown is HALF an iteration: one put+signal from a user kernel, one way.
//! - nccl (`--nccl`): ncclSend + ncclRecv in a group per iteration on a stream, and the same
//!   captured `-G` per graph.
//!
//! `proxy ops/iter` beside each time: operations the proxy thread started over the timed
//! iterations (`WorkerStats::proxy_started`), per iteration, the larger of the two ranks. The
//! proxy modes start about two (the send and the receive); the g* modes and NCCL none, which
//! shows that the host does no work per iteration for them.

use crate::nccl::{Comm, Nccl, UniqueId};
use crate::{Control, Sweep, config, die, hex, parse_size, spawn_peer, unhex};
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{DeviceBuf, Function, Module, PinnedBuf, Stream, device_count, set_device};
use gscomm::{Context, Endpoint, Engine, RequestParams, Started, Worker};
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Stream,
    Graph,
    Kernel,
    /// `Stream` and `Graph` with prepared transfers (matching and protocol resolved once).
    PStream,
    PGraph,
    /// `PStream` and `PGraph` with the rounds run on the GPU (no proxy).
    GStream,
    GGraph,
    /// GPU rounds driven by one user kernel (`gsc_prep_cursor_*`): no launch per round.
    GKernel,
    /// `GKernel` as a ping-pong (rank 0 sends then waits, rank 1 waits then sends): the time
    /// reported is half a round trip, i.e. one kernel-initiated put+signal, one way.
    GPing,
    Nccl,
    NcclGraph,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Stream => "stream",
            Mode::Graph => "graph",
            Mode::Kernel => "kernel",
            Mode::PStream => "pstream",
            Mode::PGraph => "pgraph",
            Mode::GStream => "gstream",
            Mode::GGraph => "ggraph",
            Mode::GKernel => "gkernel",
            Mode::GPing => "gping",
            Mode::Nccl => "nccl",
            Mode::NcclGraph => "nccl-graph",
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    sweep: Sweep,
    graph_iters: usize,
    modes: Vec<Mode>,
    devices: [i32; 2],
    nccl: bool,
}

pub(crate) fn parse_args(args: &[String]) -> Option<Opts> {
    let mut o = Opts {
        sweep: Sweep { min: 8, max: 128 << 20, factor: 2, iters: 1000, warmup: 100 },
        graph_iters: 100,
        modes: vec![Mode::Stream, Mode::Graph, Mode::Kernel],
        devices: [0, 1],
        nccl: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned();
        if o.sweep.apply(a, &mut val)? {
            continue;
        }
        match a.as_str() {
            "-G" => o.graph_iters = parse_size(&val()?).max(1),
            "-m" => {
                o.modes = val()?
                    .split(',')
                    .map(|m| match m {
                        "stream" => Some(Mode::Stream),
                        "graph" => Some(Mode::Graph),
                        "kernel" => Some(Mode::Kernel),
                        "pstream" => Some(Mode::PStream),
                        "pgraph" => Some(Mode::PGraph),
                        "gstream" => Some(Mode::GStream),
                        "ggraph" => Some(Mode::GGraph),
                        "gkernel" => Some(Mode::GKernel),
                        "gping" => Some(Mode::GPing),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?
            }
            "-d" => {
                let v: Vec<i32> = val()?.split(',').map(|d| d.parse().ok()).collect::<Option<_>>()?;
                o.devices = v.try_into().ok()?;
            }
            "--nccl" => o.nccl = true,
            _ => return None,
        }
    }
    if o.nccl {
        o.modes.extend([Mode::Nccl, Mode::NcclGraph]);
    }
    Some(o)
}

/// Iterations for one size: `-n`, fewer for large sizes (at most ~4 GiB moved per direction),
/// a multiple of the graph's captured iterations for the graph modes.
fn iterations(o: &Opts, size: usize, mode: Mode) -> (usize, usize) {
    let budget = ((4usize << 30) / size.max(1)).max(5);
    let n = o.sweep.iters.min(budget);
    let w = o.sweep.warmup.min(n);
    match mode {
        Mode::Graph | Mode::NcclGraph | Mode::PGraph | Mode::GGraph => {
            let g = o.graph_iters.min(n);
            (n.div_ceil(g) * g, w.div_ceil(g).max(1) * g)
        }
        _ => (n, w),
    }
}

const TAG: u64 = 77;

/// The device kernel of the kernel mode: one thread runs `rounds` exchanges.
const KERNEL_SRC: &str = r#"
/* gkernel: `rounds` prepared exchanges with GPU rounds, all from this one block (cursors: the
 * round counts stay in registers for the whole kernel). */
extern "C" __global__ void prep_rounds(const gsc_prepared_device_t *send, const gsc_prepared_device_t *recv,
                                       unsigned long long rounds, unsigned long long *errors) {
    gsc_prep_cursor_t tx = gsc_prep_open(send), rx = gsc_prep_open(recv);
    for (unsigned long long r = 0; r < rounds; r++) {
        gsc_prep_cursor_ready(&rx);
        if ((gsc_prep_cursor_send(&tx) | gsc_prep_cursor_wait(&rx)) != 0) {
            if (threadIdx.x == 0) atomicAdd(errors, 1ULL);
            break;
        }
    }
    gsc_prep_close(&tx);
    gsc_prep_close(&rx);
}
/* gping: the same as a ping-pong; `first`: this rank sends first. */
extern "C" __global__ void prep_pingpong(const gsc_prepared_device_t *send, const gsc_prepared_device_t *recv,
                                         unsigned long long rounds, unsigned long long first, unsigned long long *errors) {
    gsc_prep_cursor_t tx = gsc_prep_open(send), rx = gsc_prep_open(recv);
    for (unsigned long long r = 0; r < rounds; r++) {
        gsc_prep_cursor_ready(&rx);
        int rc = first ? (gsc_prep_cursor_send(&tx) | gsc_prep_cursor_wait(&rx))
                       : (gsc_prep_cursor_wait(&rx) | gsc_prep_cursor_send(&tx));
        if (rc != 0) {
            if (threadIdx.x == 0) atomicAdd(errors, 1ULL);
            break;
        }
    }
    gsc_prep_close(&tx);
    gsc_prep_close(&rx);
}
extern "C" __global__ void exchange_rounds(gsc_device_handle_t *send, gsc_device_handle_t *recv,
                                           unsigned long long rounds, unsigned long long *errors) {
    for (unsigned long long r = 0; r < rounds; r++) {
        gsc_trigger(recv);
        gsc_trigger(send);
        if (gsc_wait(send) != 0 || gsc_wait(recv) != 0) { atomicAdd(errors, 1ULL); return; }
    }
}
"#;

/// One rank's state.
struct Rank {
    rank: i32,
    w: Worker,
    ep: Endpoint,
    send: DeviceBuf,
    recv: DeviceBuf,
    stream: Stream,
    /// Host time in `issue_prepared`: (group_start to wait, group_end), for GSC_BENCH_HOST_TIME.
    host_split: std::cell::Cell<(std::time::Duration, std::time::Duration)>,
    exchange_rounds: Function,
    prep_rounds: Function,
    prep_pingpong: Function,
    _module: Module,
}

/// One (size, mode) run, over its timed iterations.
#[derive(Clone, Copy)]
struct Measured {
    secs_per_iter: f64,
    /// Operations this rank's proxy thread started, per iteration.
    proxy_ops_per_iter: f64,
}

/// The start of a timed stretch: its clock and the proxy's count of started operations.
struct Timing {
    t0: Instant,
    proxy_ops: u64,
}

fn on(c: &Condition) -> RequestParams {
    RequestParams { condition: Some(c.clone()), no_stream_wait: true, ..Default::default() }
}

fn release(w: &Worker, s: Started) {
    if let Started::Pending(h) = s {
        // A pending request still completes after release; its slot is recycled then.
        w.request_release(h).unwrap_or_else(|e| die("request_release", e));
    }
}

impl Rank {
    /// Operations this rank's proxy thread has started so far.
    fn proxy_ops(&self) -> u64 {
        self.w.stats().proxy_started
    }

    /// Meet the peer, then start the clock. The proxy count is read first: taking the worker's
    /// lock is no part of what is timed.
    fn start_timing(&self, ctl: &mut Control) -> Timing {
        let proxy_ops = self.proxy_ops();
        ctl.barrier();
        Timing { t0: Instant::now(), proxy_ops }
    }

    /// Stop the clock of `iters` iterations (the stream synchronized: everything they started
    /// has been counted).
    fn stop_timing(&self, timing: Timing, iters: usize) -> Measured {
        let secs = timing.t0.elapsed().as_secs_f64();
        let ops = self.proxy_ops() - timing.proxy_ops;
        Measured { secs_per_iter: secs / iters as f64, proxy_ops_per_iter: ops as f64 / iters as f64 }
    }

    /// Issue one exchange of `n` bytes on `cond` (a stream condition, maybe capturing).
    fn issue(&self, cond: &Condition, n: usize) {
        // One group, like NCCL's group around its send and receive: one trigger and one wait.
        cond.group_start().unwrap_or_else(|e| die("group_start", e));
        // SAFETY: both buffers live as long as `self`, and every issued operation has completed
        // before `self` is dropped (each run ends with a stream synchronize).
        let r = unsafe { self.w.tag_recv_nbx(self.recv.ptr() as *mut u8, n, TAG, u64::MAX, on(cond)) };
        release(&self.w, r.unwrap_or_else(|e| die("tag_recv_nbx", e)));
        let s = unsafe { self.ep.tag_send_nbx(self.send.ptr() as *const u8, n, TAG, on(cond)) };
        release(&self.w, s.unwrap_or_else(|e| die("tag_send_nbx", e)));
        cond.wait().unwrap_or_else(|e| die("Condition::wait", e));
        cond.group_end().unwrap_or_else(|e| die("group_end", e));
    }

    /// `issue` with a prepared pair: one round of each.
    fn issue_prepared(&self, cond: &Condition, tx: &gscomm::Prepared, rx: &gscomm::Prepared) {
        let t0 = Instant::now();
        cond.group_start().unwrap_or_else(|e| die("group_start", e));
        release(&self.w, rx.start(on(cond)).unwrap_or_else(|e| die("prepared start", e)));
        release(&self.w, tx.start(on(cond)).unwrap_or_else(|e| die("prepared start", e)));
        cond.wait().unwrap_or_else(|e| die("Condition::wait", e));
        let t1 = Instant::now();
        cond.group_end().unwrap_or_else(|e| die("group_end", e));
        self.host_split.set((self.host_split.get().0 + (t1 - t0), self.host_split.get().1 + t1.elapsed()));
    }

    /// A prepared send of our send buffer and receive into our receive buffer, `n` bytes.
    fn prepare(&self, n: usize, gpu_rounds: bool) -> (gscomm::Prepared, gscomm::Prepared) {
        use gscomm::{Direction, PrepareParams};
        let engine = if gpu_rounds { Engine::Gpu } else { Engine::Proxy };
        let p = |dir| PrepareParams { dir, tag: TAG + 1 + gpu_rounds as u64, partitions: None, memory_type: None, engine };
        // SAFETY: both buffers live as long as `self`; each run drops its preparations after
        // its last round completed (a stream synchronize).
        unsafe {
            (
                self.ep.prepare(self.send.ptr() as *mut u8, n, p(Direction::Send)).unwrap_or_else(|e| die("prepare", e)),
                self.ep.prepare(self.recv.ptr() as *mut u8, n, p(Direction::Recv)).unwrap_or_else(|e| die("prepare", e)),
            )
        }
    }

    /// One kernel running `rounds(k)` exchanges: `warmup` of them, a barrier with the peer, then
    /// `iters` timed.
    fn time_rounds(&self, ctl: &mut Control, warmup: usize, iters: usize, rounds: impl Fn(usize)) -> Measured {
        let sync = || self.stream.synchronize().unwrap_or_else(|e| die("stream synchronize", e));
        rounds(warmup);
        sync();
        let timing = self.start_timing(ctl);
        rounds(iters);
        sync();
        self.stop_timing(timing, iters)
    }

    /// Run `warmup` then `iters` iterations of `mode`, timing the latter.
    fn run(&self, ctl: &mut Control, nccl: Option<&Comm>, mode: Mode, n: usize, o: &Opts) -> Measured {
        let (iters, warmup) = iterations(o, n, mode);
        let prepared = match mode {
            Mode::PStream | Mode::PGraph => Some(self.prepare(n, false)),
            Mode::GStream | Mode::GGraph | Mode::GKernel | Mode::GPing => {
                let (tx, rx) = self.prepare(n, true);
                // Pairing and mapping happen at the first start: one round outside the timing
                // (and outside any capture).
                let warm = Condition::cuda(Category::Stream, self.stream.raw(), None).unwrap_or_else(|e| die("condition", e));
                self.issue_prepared(&warm, &tx, &rx);
                self.stream.synchronize().unwrap_or_else(|e| die("stream synchronize", e));
                Some((tx, rx))
            }
            _ => None,
        };
        let peer = 1 - self.rank;
        let sync = || self.stream.synchronize().unwrap_or_else(|e| die("stream synchronize", e));
        let nccl_step = |stream: &Stream| {
            let c = nccl.expect("nccl modes need a communicator");
            // SAFETY: our device buffers of at least `n` bytes, on this rank's GPU; every run
            // ends with a stream synchronize.
            unsafe { c.sendrecv(self.send.ptr(), self.recv.ptr(), n, peer, stream.raw()) }.unwrap_or_else(|e| die("nccl", e));
        };
        match mode {
            Mode::Stream | Mode::Nccl | Mode::PStream | Mode::GStream => {
                let cond = Condition::cuda(Category::Stream, self.stream.raw(), None).unwrap_or_else(|e| die("condition", e));
                let step = || match (mode, &prepared) {
                    (Mode::Stream, _) => self.issue(&cond, n),
                    (Mode::PStream | Mode::GStream, Some((tx, rx))) => self.issue_prepared(&cond, tx, rx),
                    _ => nccl_step(&self.stream),
                };
                (0..warmup).for_each(|_| step());
                sync();
                let timing = self.start_timing(ctl);
                (0..iters).for_each(|_| step());
                let enqueued = timing.t0.elapsed();
                sync();
                if std::env::var_os("GSC_BENCH_HOST_TIME").is_some() {
                    // Host time to enqueue an iteration: when it is the whole iteration, the
                    // host, not the GPUs, sets the pace. Prepared modes: issuing vs group_end.
                    let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / (iters + warmup) as f64;
                    let (issue, end) = self.host_split.take();
                    eprintln!(
                        "# host enqueue {} {n} B: {:.2} us per iteration (prepared: starts {:.2}, group_end {:.2})",
                        mode.label(),
                        enqueued.as_secs_f64() * 1e6 / iters as f64,
                        per(issue),
                        per(end)
                    );
                }
                self.stop_timing(timing, iters)
            }
            Mode::Graph | Mode::NcclGraph | Mode::PGraph | Mode::GGraph => {
                let g = o.graph_iters.min(iters);
                let cap = Stream::new().unwrap_or_else(|e| die("stream", e));
                let cond = Condition::cuda(Category::Stream, cap.raw(), None).unwrap_or_else(|e| die("condition", e));
                cap.begin_capture().unwrap_or_else(|e| die("begin capture", e));
                for _ in 0..g {
                    match (mode, &prepared) {
                        (Mode::Graph, _) => self.issue(&cond, n),
                        (Mode::PGraph | Mode::GGraph, Some((tx, rx))) => self.issue_prepared(&cond, tx, rx),
                        _ => nccl_step(&cap),
                    }
                }
                let graph = cap.end_capture().unwrap_or_else(|e| die("end capture", e));
                let exec = graph.instantiate().unwrap_or_else(|e| die("instantiate", e));
                let launch = |times: usize| (0..times).for_each(|_| exec.launch(&self.stream).unwrap_or_else(|e| die("graph launch", e)));
                launch(warmup / g);
                sync();
                let timing = self.start_timing(ctl);
                launch(iters / g);
                sync();
                self.stop_timing(timing, iters)
            }
            Mode::GKernel | Mode::GPing => {
                let (tx, rx) = prepared.as_ref().expect("prepared above");
                let handle = |p: &gscomm::Prepared| p.device_handle().unwrap_or_else(|e| die("device handle", e));
                let (hs, hr) = (handle(tx), handle(rx));
                let err = PinnedBuf::new(8).unwrap_or_else(|e| die("pinned", e));
                let first = u64::from(self.rank == 0);
                let m = self.time_rounds(ctl, warmup, iters, |k| {
                    let launched = match mode {
                        Mode::GKernel => self.prep_rounds.launch(1, 256, &self.stream, &[hs, hr, k as u64, err.device_ptr()]),
                        _ => self.prep_pingpong.launch(1, 256, &self.stream, &[hs, hr, k as u64, first, err.device_ptr()]),
                    };
                    launched.unwrap_or_else(|e| die("launch", e))
                });
                // gping: one way is half a round trip (the proxy count stays per round).
                let m = if mode == Mode::GPing { Measured { secs_per_iter: m.secs_per_iter / 2.0, ..m } } else { m };
                if err.to_vec().iter().any(|b| *b != 0) {
                    die("gkernel exchange", "a round gave up");
                }
                m
            }
            Mode::Kernel => {
                let kc = Condition::cuda(Category::KernelTriggered, 0, None).unwrap_or_else(|e| die("condition", e));
                let handle = |s: gscomm::Result<Started>, what: &str| match s {
                    Ok(Started::Armed(a)) => a.device_handle,
                    other => die(what, format!("expected an armed operation, got {other:?}")),
                };
                let params = || RequestParams { condition: Some(kc.clone()), ..Default::default() };
                // SAFETY: as in `issue`; the kernels below end before `self` is dropped.
                let hr = handle(unsafe { self.w.tag_recv_nbx(self.recv.ptr() as *mut u8, n, TAG, u64::MAX, params()) }, "recv");
                let hs = handle(unsafe { self.ep.tag_send_nbx(self.send.ptr() as *const u8, n, TAG, params()) }, "send");
                let err = PinnedBuf::new(8).unwrap_or_else(|e| die("pinned", e));
                let m = self.time_rounds(ctl, warmup, iters, |k| {
                    self.exchange_rounds
                        .launch(1, 1, &self.stream, &[hs, hr, k as u64, err.device_ptr()])
                        .unwrap_or_else(|e| die("launch", e))
                });
                if err.to_vec().iter().any(|b| *b != 0) || kc.query().is_err() {
                    die("kernel-triggered exchange", format!("{:?}", kc.query()));
                }
                m
            }
        }
    }
}

fn pattern(rank: i32, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u64).wrapping_mul(2654435761).wrapping_add(rank as u64 * 97 + 13) as u8 ^ (i >> 12) as u8).collect()
}

/// Bytes of the receive buffer's first `n` that are not what the peer sent.
fn wrong(r: &Rank, n: usize, expect: &[u8]) -> usize {
    let got = r.recv.download().unwrap_or_else(|e| die("download", e));
    got[..n].iter().zip(&expect[..n]).filter(|(a, b)| a != b).count()
}

/// Everything both ranks do: set up, then every (size, mode) in the same order.
fn rank_main(
    rank: i32,
    o: &Opts,
    ctl: &mut Control,
    nccl_id: impl FnOnce(&mut Control, &Nccl) -> UniqueId,
) -> Vec<(usize, Mode, Measured, usize)> {
    let dev = o.devices[rank as usize];
    if device_count() <= dev {
        die("devices", format!("GPU {dev} is not there ({} GPUs)", device_count()));
    }
    set_device(dev).unwrap_or_else(|e| die("set_device", e));
    let ctx = Context::new(config()).unwrap_or_else(|e| die("context", e));
    let w = ctx.create_worker().unwrap_or_else(|e| die("worker", e));
    ctl.send("ADDR", &hex(w.address()));
    let ep = w.connect(&unhex(&ctl.expect("ADDR"))).unwrap_or_else(|e| die("connect", e));
    let module = Module::compile(&format!("{}\n{KERNEL_SRC}", include_str!("../../../include/gsc_device.cuh")))
        .unwrap_or_else(|e| die("compile", e));
    let exchange_rounds = module.function("exchange_rounds").unwrap_or_else(|e| die("kernel", e));
    let prep_rounds = module.function("prep_rounds").unwrap_or_else(|e| die("kernel", e));
    let prep_pingpong = module.function("prep_pingpong").unwrap_or_else(|e| die("kernel", e));
    let nccl = o.nccl.then(|| Nccl::load().unwrap_or_else(|e| die("nccl", e)));
    let comm = nccl.as_ref().map(|l| {
        let id = nccl_id(ctl, l);
        l.comm(id, rank, 2).unwrap_or_else(|e| die("nccl", e))
    });
    let buf = |what| DeviceBuf::new(o.sweep.max.max(1)).unwrap_or_else(|e| die(what, e));
    let stream = Stream::new().unwrap_or_else(|e| die("stream", e));
    let r = Rank {
        rank,
        w,
        ep,
        send: buf("send buffer"),
        recv: buf("receive buffer"),
        stream,
        host_split: Default::default(),
        exchange_rounds,
        prep_rounds,
        prep_pingpong,
        _module: module,
    };
    r.send.upload(&pattern(rank, o.sweep.max)).unwrap_or_else(|e| die("upload", e));
    let expect = pattern(1 - rank, o.sweep.max);
    let mut out = Vec::new();
    for n in o.sweep.sizes() {
        for &mode in &o.modes {
            r.recv.fill(0).unwrap_or_else(|e| die("memset", e));
            ctl.barrier();
            let m = r.run(ctl, comm.as_ref(), mode, n, o);
            out.push((n, mode, m, wrong(&r, n, &expect)));
        }
    }
    drop(comm);
    let _ = r.ep.close();
    out
}

pub(crate) fn server(o: &Opts) {
    let mut ctl = Control::of_parent();
    let res = rank_main(1, o, &mut ctl, |ctl, _| {
        let b = unhex(&ctl.expect("NCCLID"));
        UniqueId { internal: b.try_into().unwrap_or_else(|_| die("nccl", "bad unique id")) }
    });
    // The peer's #wrong and proxy work count too: hand them to the client, which prints the table.
    ctl.send("WRONG", &res.iter().map(|r| r.3.to_string()).collect::<Vec<_>>().join(","));
    ctl.send("PROXY", &res.iter().map(|r| r.2.proxy_ops_per_iter.to_string()).collect::<Vec<_>>().join(","));
    ctl.expect("BYE");
}

pub(crate) fn client(o: &Opts, args: &[String]) {
    let (mut child, mut ctl) = spawn_peer(args);
    let mut nccl_version = String::new();
    let res = rank_main(0, o, &mut ctl, |ctl, l| {
        let id = l.unique_id().unwrap_or_else(|e| die("nccl", e));
        ctl.send("NCCLID", &hex(&id.internal));
        nccl_version = l.version();
        id
    });
    let theirs: Vec<usize> = ctl.expect("WRONG").split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap_or(usize::MAX)).collect();
    let their_proxy: Vec<f64> = ctl.expect("PROXY").split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap_or(f64::NAN)).collect();
    ctl.send("BYE", "");
    let _ = child.wait();
    let cfg = config();
    println!(
        "# gsc-bench gpu-sendrecv | gscomm {} | GPUs {},{} | GSC_CUDA_IPC={} | -n {} -w {} -G {}{}",
        gscomm::VERSION,
        o.devices[0],
        o.devices[1],
        cfg.cuda_ipc.name(),
        o.sweep.iters,
        o.sweep.warmup,
        o.graph_iters,
        if o.nccl { format!(" | NCCL {nccl_version}") } else { String::new() }
    );
    println!("# time per iteration (us), busbw (GB/s) = size / time; #wrong: bytes wrong on either rank");
    println!("# proxy ops/iter: operations a proxy thread started per timed iteration, the larger of the two ranks");
    let mut head = format!("{:>12}", "size(B)");
    for m in &o.modes {
        head += &format!(" {:>12} {:>9} {:>14}", format!("{}(us)", m.label()), "busbw", "proxy ops/iter");
    }
    println!("{head} {:>7}", "#wrong");
    for (row, chunk) in res.chunks(o.modes.len()).enumerate() {
        let mut line = format!("{:>12}", chunk[0].0);
        let mut bad = 0;
        for (i, (n, _, m, w)) in chunk.iter().enumerate() {
            let t = m.secs_per_iter;
            // A missing peer value reads as NaN, which `max` skips: ours is shown then.
            let proxy = m.proxy_ops_per_iter.max(their_proxy.get(row * o.modes.len() + i).copied().unwrap_or(f64::NAN));
            line += &format!(" {:>12.2} {:>9.2} {:>14.2}", t * 1e6, *n as f64 / t / 1e9, proxy);
            bad += w + theirs.get(row * o.modes.len() + i).copied().unwrap_or(0);
        }
        println!("{line} {bad:>7}");
    }
}

//! CUDA conditions between two processes, one per GPU: stream-, graph-, capture- and
//! kernel-triggered operations, with the data made and checked by kernels on the GPU.
//!
//! Buffers are page-locked host memory mapped into the GPUs (GPU-memory buffers need the CUDA
//! IPC lane, not built yet). Skips with a printed reason unless `GSC_TEST_GPU=1` and a GPU is
//! there; the device machines run it through `.gpu/run.sh`.
mod common;

use common::*;
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{Function, Graph, Module, PinnedBuf, Stream, device_count, gpu_test_skip_reason, set_device};
use gscomm::{Context, Endpoint, Started, Status, Worker};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

const KERNELS: &str = r#"
extern "C" __global__ void fill(unsigned char *b, unsigned long long n, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        b[i] = (unsigned char)(i * 131 + seed * 7 + 1);
}
extern "C" __global__ void xor5a(unsigned char *b, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        b[i] ^= 0x5A;
}
extern "C" __global__ void check(const unsigned char *b, unsigned long long n, unsigned long long seed,
                                 unsigned long long x, unsigned long long *errors) {
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (b[i] != (unsigned char)((unsigned char)(i * 131 + seed * 7 + 1) ^ (unsigned char)x)) { atomicAdd(errors, 1ULL); return; }
}
/* One block. Bumps the round counter (thread 0) and fills for (round, side). */
extern "C" __global__ void fill_round(unsigned char *b, unsigned long long n, unsigned long long *round, unsigned long long side) {
    __shared__ unsigned long long r;
    if (threadIdx.x == 0) { r = *(volatile unsigned long long *)round + 1; *round = r; }
    __syncthreads();
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) b[i] = (unsigned char)(i + r * 3 + side * 101);
}
/* One block. Checks the peer's data of the current round. */
extern "C" __global__ void check_round(const unsigned char *b, unsigned long long n, unsigned long long *round,
                                       unsigned long long side, unsigned long long *errors) {
    unsigned long long r = *(volatile unsigned long long *)round;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
        if (b[i] != (unsigned char)(i + r * 3 + side * 101)) { atomicAdd(errors, 1ULL); return; }
}
/* One block: `rounds` halo exchanges driven from inside the kernel. */
extern "C" __global__ void kernel_rounds(gsc_device_handle_t *send, gsc_device_handle_t *recv, unsigned char *src,
                                         const unsigned char *dst, unsigned long long n, unsigned long long rounds,
                                         unsigned long long side, unsigned long long *errors) {
    for (unsigned long long r = 1; r <= rounds; r++) {
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) src[i] = (unsigned char)(i + r * 5 + side * 77);
        __syncthreads();
        if (threadIdx.x == 0) {
            gsc_trigger(recv);
            gsc_trigger(send);
            if (gsc_wait(send) != 0 || gsc_wait(recv) != 0) atomicAdd(errors, 1000000ULL);
        }
        __syncthreads();
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
            if (dst[i] != (unsigned char)(i + r * 5 + (1 - side) * 77)) { atomicAdd(errors, 1ULL); break; }
        __syncthreads();
    }
}
"#;

struct Kern {
    fill: Function,
    xor5a: Function,
    check: Function,
    fill_round: Function,
    check_round: Function,
    kernel_rounds: Function,
    _m: Module,
}

fn kernels() -> Kern {
    let src = format!("{}\n{KERNELS}", include_str!("../include/gsc_device.cuh"));
    let m = Module::compile(&src).expect("compile test kernels");
    let f = |n| m.function(n).unwrap();
    Kern {
        fill: f("fill"),
        xor5a: f("xor5a"),
        check: f("check"),
        fill_round: f("fill_round"),
        check_round: f("check_round"),
        kernel_rounds: f("kernel_rounds"),
        _m: m,
    }
}

fn grid(n: usize) -> u32 {
    (n.div_ceil(256)).clamp(1, 1024) as u32
}

const SIZES: [usize; 9] = [0, 1, 128, 129, 65_535, 65_536, 65_537, 1 << 20, 64 << 20];
const GRAPH_ROUNDS: usize = 10_000;
const CAPTURE_ROUNDS: usize = 1_000;
const KERNEL_ROUNDS: u64 = 500;

const ROUND_BYTES: usize = 4096;

/// One side's scenario list; `side` 0 is the test process, 1 the child.
fn scenarios(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, report: &mut dyn FnMut(&str, String)) {
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();

    // 1. Stream-ordered echo: side 0 fills on the GPU, sends, receives the echo and checks it on
    //    the GPU; side 1 receives, transforms on the GPU and sends back. All on one stream each.
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let bufs: Vec<(PinnedBuf, PinnedBuf)> = SIZES.iter().map(|&n| (PinnedBuf::new(n).unwrap(), PinnedBuf::new(n).unwrap())).collect();
    let mut reqs = Vec::new();
    for (i, (a, b)) in bufs.iter().enumerate() {
        let n = a.len();
        if side == 0 {
            k.fill.launch(grid(n), 256, &stream, &[a.device_ptr(), n as u64, i as u64]).unwrap();
            reqs.push(pending(unsafe { ep.tag_send_nbx(a.host_ptr(), n, i as u64, on(&cond, true)).unwrap() }));
            reqs.push(pending(unsafe { w.tag_recv_nbx(b.host_ptr(), n, 1000 + i as u64, u64::MAX, on(&cond, true)).unwrap() }));
            k.check.launch(grid(n), 256, &stream, &[b.device_ptr(), n as u64, i as u64, 0x5A, err.device_ptr()]).unwrap();
        } else {
            reqs.push(pending(unsafe { w.tag_recv_nbx(a.host_ptr(), n, i as u64, u64::MAX, on(&cond, true)).unwrap() }));
            k.xor5a.launch(grid(n), 256, &stream, &[a.device_ptr(), n as u64]).unwrap();
            reqs.push(pending(unsafe { ep.tag_send_nbx(a.host_ptr(), n, 1000 + i as u64, on(&cond, true)).unwrap() }));
        }
    }
    let st = wait_all(w, reqs);
    stream.synchronize().unwrap();
    report(
        "stream",
        if st.iter().all(|s| *s == Status::Ok) && pinned_u64(&err) == 0 {
            String::new()
        } else {
            format!("{st:?} errors={}", pinned_u64(&err))
        },
    );
    drop(bufs);

    // 2. Graph: a halo exchange as graph nodes (fill -> send; recv; both done -> check),
    //    replayed GRAPH_ROUNDS times with new data each round.
    let err = PinnedBuf::new(8).unwrap();
    let round = PinnedBuf::new(8).unwrap();
    let (src, dst) = (PinnedBuf::new(ROUND_BYTES).unwrap(), PinnedBuf::new(ROUND_BYTES).unwrap());
    let g = Graph::new().unwrap();
    let gc = Condition::cuda(Category::Graph, g.raw(), None).unwrap();
    let n = ROUND_BYTES as u64;
    let fill = g.add_kernel(k.fill_round, 1, 256, &[src.device_ptr(), n, round.device_ptr(), side], &[]).unwrap();
    let s = armed(unsafe { ep.tag_send_nbx(src.host_ptr(), ROUND_BYTES, 7, on(&gc, true)).unwrap() });
    let r = armed(unsafe { w.tag_recv_nbx(dst.host_ptr(), ROUND_BYTES, 7, u64::MAX, on(&gc, true)).unwrap() });
    g.add_dependency(fill, s.start_node).unwrap();
    // The receive of round k+1 may only start once round k was checked: the next replay's
    // start nodes come after this replay's check in stream order anyway (graph launches of one
    // executable are ordered).
    let check = g
        .add_kernel(
            k.check_round,
            1,
            256,
            &[dst.device_ptr(), n, round.device_ptr(), 1 - side, err.device_ptr()],
            &[s.done_node, r.done_node],
        )
        .unwrap();
    let _ = check;
    let exec = g.instantiate().unwrap();
    let t0 = Instant::now();
    let graph_rounds = rounds(GRAPH_ROUNDS);
    for _ in 0..graph_rounds {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    let dt = t0.elapsed();
    report(
        "graph",
        if pinned_u64(&err) == 0 && gc.query().is_ok() {
            String::new()
        } else {
            format!("errors={} query={:?}", pinned_u64(&err), gc.query())
        },
    );
    eprintln!("side {side}: {graph_rounds} graph replays in {dt:?} ({:.1} us/replay)", dt.as_secs_f64() * 1e6 / graph_rounds as f64);
    drop(exec);
    drop(g);

    // 3. Stream capture: the same exchange issued on a capturing stream (no stream wait, then
    //    one condition wait), replayed CAPTURE_ROUNDS times.
    let err = PinnedBuf::new(8).unwrap();
    let round = PinnedBuf::new(8).unwrap();
    let cap = Stream::new().unwrap();
    let cc = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
    cap.begin_capture().unwrap();
    k.fill_round.launch(1, 256, &cap, &[src.device_ptr(), n, round.device_ptr(), side]).unwrap();
    let a = unsafe { w.tag_recv_nbx(dst.host_ptr(), ROUND_BYTES, 9, u64::MAX, on(&cc, false)).unwrap() };
    let b = unsafe { ep.tag_send_nbx(src.host_ptr(), ROUND_BYTES, 9, on(&cc, false)).unwrap() };
    assert!(matches!(a, Started::Armed(_)) && matches!(b, Started::Armed(_)), "captured operations are persistent");
    cc.wait().unwrap();
    k.check_round.launch(1, 256, &cap, &[dst.device_ptr(), n, round.device_ptr(), 1 - side, err.device_ptr()]).unwrap();
    let cg = cap.end_capture().unwrap();
    let cexec = cg.instantiate().unwrap();
    for _ in 0..rounds(CAPTURE_ROUNDS) {
        cexec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    report("capture", if pinned_u64(&err) == 0 && cc.query().is_ok() { String::new() } else { format!("errors={}", pinned_u64(&err)) });
    drop(cexec);
    drop(cg);

    // 4. Kernel-triggered: one kernel runs KERNEL_ROUNDS exchanges, triggering and waiting
    //    from the device.
    let err = PinnedBuf::new(8).unwrap();
    let kc = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let hs = armed(unsafe { ep.tag_send_nbx(src.host_ptr(), ROUND_BYTES, 11, on(&kc, true)).unwrap() });
    let hr = armed(unsafe { w.tag_recv_nbx(dst.host_ptr(), ROUND_BYTES, 11, u64::MAX, on(&kc, true)).unwrap() });
    k.kernel_rounds
        .launch(
            1,
            256,
            &stream,
            &[
                hs.device_handle,
                hr.device_handle,
                src.device_ptr(),
                dst.device_ptr(),
                n,
                rounds(KERNEL_ROUNDS as usize) as u64,
                side,
                err.device_ptr(),
            ],
        )
        .unwrap();
    stream.synchronize().unwrap();
    report("kernel", if pinned_u64(&err) == 0 && kc.query().is_ok() { String::new() } else { format!("errors={}", pinned_u64(&err)) });
}

fn device_for(side: u64) -> i32 {
    if device_count() >= 2 { side as i32 } else { 0 }
}

fn roles(role: &str, chan: &dyn Chan, ctx: Context) {
    assert_eq!(role, "peer");
    set_device(device_for(1)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("ready", w.address());
    let mut results = Vec::new();
    scenarios(1, &w, &ep, &k, &mut |name, r| results.push(format!("{name}:{r}")));
    chan.put("results", results.join(";").as_bytes());
    chan.get("bye");
    ep.close().unwrap();
}

#[test]
fn stream_graph_capture_and_kernel_conditions_between_two_gpus() {
    if run_child_role(roles) {
        return;
    }
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    let k = kernels();
    let dir = ShmDir::new("gpu_conditions");
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "120s")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let mut p = start_peer(Lane::Shm, "stream_graph_capture_and_kernel_conditions_between_two_gpus", "peer", &cfg, roles);
    p.put("addr", w.address());
    let addr = p.get_progress("ready", T, &w);
    let ep = w.connect(&addr).unwrap();
    let mut mine = Vec::new();
    scenarios(0, &w, &ep, &k, &mut |name, r| mine.push((name.to_string(), r)));
    let theirs = String::from_utf8(p.get_progress("results", T, &w)).unwrap();
    for (name, r) in &mine {
        eprintln!("side 0 {name}: {}", if r.is_empty() { "ok" } else { r });
    }
    eprintln!("side 1: {theirs}");
    for (name, r) in mine {
        assert!(r.is_empty(), "side 0 {name}: {r}");
    }
    for part in theirs.split(';') {
        let (name, r) = part.split_once(':').unwrap();
        assert!(r.is_empty(), "side 1 {name}: {r}");
    }
    p.put("bye", &[]);
    ep.close().unwrap();
    let deadline = Instant::now() + T;
    while !p.is_finished() {
        assert!(Instant::now() < deadline);
        w.progress();
    }
    p.finish(T);
}

/// Issue #8: abort during CUDA stream capture, from another thread at seeded random moments
/// (10 rounds). Two workers of this process (loopback lane); the main thread captures sends and
/// receives on a stream condition (receives nobody answers, so a replay would wait on them)
/// until the abort makes an issue fail. Then: the capture ends cleanly and instantiates; the
/// graph replayed after the abort completes within seconds (its waits are released by the
/// error mark) three times over; the condition reports Aborted; operations issued afterwards
/// fail at once. Any hang fails the test through `bounded`.
#[test]
fn abort_during_stream_capture_then_replays_fail_fast() {
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(0).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..10 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_micros(seed % 20_000);
        let ctx = ctx_with(&[("GSC_TLS", "loopback"), ("GSC_TIMEOUT", "60s")]);
        let (a, b) = (ctx.create_worker().unwrap(), ctx.create_worker().unwrap());
        let ep_ba = b.connect(a.address()).unwrap();
        let (src, dst) = (PinnedBuf::new(ROUND_BYTES).unwrap(), PinnedBuf::new(ROUND_BYTES).unwrap());
        let cap = Stream::new().unwrap();
        let cc = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
        cap.begin_capture().unwrap();
        let aborter = {
            let b = b.clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let t0 = Instant::now();
                b.abort("abort during capture").unwrap();
                t0.elapsed()
            })
        };
        let mut captured = 0u32;
        let stop = loop {
            let r = unsafe { b.tag_recv_nbx(dst.host_ptr(), ROUND_BYTES, 1000 + captured as u64, u64::MAX, on(&cc, false)) };
            let s = r.and_then(|_| unsafe { ep_ba.tag_send_nbx(src.host_ptr(), ROUND_BYTES, 5, on(&cc, true)) });
            match s {
                Ok(st) => assert!(matches!(st, Started::Armed(_)), "captured operations are persistent"),
                Err(e) => break e,
            }
            captured += 1;
            if captured >= 2000 {
                // Enough nodes: the next issue comes after the abort.
                std::thread::sleep(delay);
            }
        };
        let abort_took = aborter.join().unwrap();
        assert_eq!(stop.status(), Status::Aborted, "round {round}: the issue that met the abort: {stop}");
        assert!(abort_took < slowed(Duration::from_secs(3)), "round {round}: abort took {abort_took:?}");
        // The capture ends cleanly: the abort made no call on the capturing stream.
        let graph = cap.end_capture().unwrap_or_else(|e| panic!("round {round}: ending the capture after abort: {e}"));
        let exec = std::sync::Arc::new(graph.instantiate().unwrap());
        let run = std::sync::Arc::new(Stream::new().unwrap());
        for replay in 0..3 {
            let (r, took) = bounded(&format!("round {round}: replay {replay} after abort"), slowed(Duration::from_secs(20)), {
                let (exec, run) = (exec.clone(), run.clone());
                move || exec.launch(&run).and_then(|()| run.synchronize())
            });
            r.unwrap();
            assert!(took < slowed(Duration::from_secs(5)), "round {round}: replay {replay} after abort took {took:?}");
        }
        assert_eq!(cc.query().unwrap_err().status(), Status::Aborted, "round {round}: the capture's condition");
        let t0 = Instant::now();
        let e = unsafe { b.tag_recv_nbx(dst.host_ptr(), 8, 1, u64::MAX, on(&cc, true)) }.unwrap_err();
        assert_eq!(e.status(), Status::Aborted);
        assert!(e.to_string().contains("abort during capture"), "the first reason stays: {e}");
        assert!(t0.elapsed() < Duration::from_millis(100));
        eprintln!("round {round}: {captured} exchanges captured before the abort ({delay:?}); replays after it completed");
        drop(exec);
        drop(graph);
    }
}

fn kill_roles(role: &str, chan: &dyn Chan, ctx: Context) {
    assert_eq!(role, "victim");
    set_device(device_for(1)).unwrap();
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("ready", w.address());
    // Keep the link up (and answer nothing) until the parent kills this process.
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        w.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(ep);
}

/// Issue #8: SIGKILL of the peer under every GPU condition kind. The survivor (GPU 0) has, each
/// on a stream of its own, operations the victim never answers, on GPU memory: a stream-ordered
/// receive and a 64 MiB rendezvous send; a graph whose send node waits for the victim; a
/// captured receive replayed once; a kernel that triggers a send and a receive and waits for
/// both from the device. After the victim is SIGKILLed (waitpid must say so), every stream
/// must be released with an error on its condition: the graph's send, tied to the dead link, by
/// the peer check within 3 s; streams that also wait for a receive no message matched, by the
/// timeout, within GSC_TIMEOUT (5 s) + 5 s. Streams are polled, never waited on, so a hang fails
/// the test at the deadline.
#[test]
fn a_killed_peer_releases_stream_graph_capture_and_kernel_waits() {
    killed_peer_releases_every_wait("a_killed_peer_releases_stream_graph_capture_and_kernel_waits", "shm");
}

/// The same over the UCX lane (`GSC_TLS=ucx`; GPU buffers go through the page-locked staging
/// pipeline). UCX's transports come from the environment: run it with `UCX_TLS=tcp` for the
/// network transport between the two processes (the children inherit it). The dead peer is
/// found by UCX's peer error handling instead of the shm lane's process check.
#[test]
fn a_killed_peer_on_the_ucx_lane_releases_stream_graph_capture_and_kernel_waits() {
    if !run_child_role(kill_roles)
        && let Err(e) = gscomm::transport::ucx::availability()
    {
        eprintln!("skipped: the UCX lane cannot load here: {e}");
        return;
    }
    killed_peer_releases_every_wait("a_killed_peer_on_the_ucx_lane_releases_stream_graph_capture_and_kernel_waits", "ucx");
}

fn killed_peer_releases_every_wait(test: &str, lane: &str) {
    use gscomm::cuda::api::DeviceBuf;
    if run_child_role(kill_roles) {
        return;
    }
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    let k = kernels();
    let dir = ShmDir::new("gpu_kill");
    let cfg = [("GSC_TLS", lane), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "5s")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let mut victim = spawn_child(test, "victim", &cfg);
    victim.put("addr", w.address());
    let addr = victim.get("ready", T);
    let ep = w.connect(&addr).unwrap();
    assert_eq!(ep.lane().unwrap().name(), lane, "the lane under test");
    const BIG: usize = 64 << 20;
    let (big, small) = (DeviceBuf::new(BIG).unwrap(), DeviceBuf::new(1 << 20).unwrap());
    let streams: Vec<std::sync::Arc<Stream>> = (0..4).map(|_| std::sync::Arc::new(Stream::new().unwrap())).collect();

    // Stream: a receive and a rendezvous send, each with a stream wait.
    let sc = Condition::cuda(Category::Stream, streams[0].raw(), None).unwrap();
    let r0 = unsafe { w.tag_recv_nbx(small.ptr() as *mut u8, 1 << 20, 1, u64::MAX, on(&sc, true)) }.unwrap();
    let s0 = unsafe { ep.tag_send_nbx(big.ptr() as *const u8, BIG, 2, on(&sc, true)) }.unwrap();
    // Graph: a send node; the graph launched once.
    let g = Graph::new().unwrap();
    let gc = Condition::cuda(Category::Graph, g.raw(), None).unwrap();
    armed(unsafe { ep.tag_send_nbx(big.ptr() as *const u8, BIG, 3, on(&gc, true)) }.unwrap());
    let exec = g.instantiate().unwrap();
    exec.launch(&streams[1]).unwrap();
    // Capture: a receive and the condition's wait, captured and replayed once.
    let cap = Stream::new().unwrap();
    let cc = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
    cap.begin_capture().unwrap();
    let a = unsafe { w.tag_recv_nbx(small.ptr() as *mut u8, 1 << 20, 4, u64::MAX, on(&cc, false)) }.unwrap();
    assert!(matches!(a, Started::Armed(_)), "captured operations are persistent");
    cc.wait().unwrap();
    let cexec = cap.end_capture().unwrap().instantiate().unwrap();
    cexec.launch(&streams[2]).unwrap();
    // Kernel-triggered: one round of `kernel_rounds` (trigger both, wait both on the device).
    let kc = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let hs = armed(unsafe { ep.tag_send_nbx(big.ptr() as *const u8, BIG, 5, on(&kc, true)) }.unwrap());
    let hr = armed(unsafe { w.tag_recv_nbx(small.ptr() as *mut u8, 1 << 20, 6, u64::MAX, on(&kc, true)) }.unwrap());
    let err = PinnedBuf::new(8).unwrap();
    let scratch = DeviceBuf::new(4096).unwrap();
    k.kernel_rounds
        .launch(1, 256, &streams[3], &[hs.device_handle, hr.device_handle, scratch.ptr(), small.ptr(), 4096, 1, 0, err.device_ptr()])
        .unwrap();

    // Everything is waiting on the victim now.
    std::thread::sleep(Duration::from_millis(300));
    for (i, s) in streams.iter().enumerate() {
        assert!(!s.query().unwrap(), "stream {i} finished before the kill: the victim was supposed to answer nothing");
    }
    let killed_at = Instant::now();
    victim.sigkill_proven();
    // Each stream's release time, polled together (a synchronize per stream in turn would charge
    // a later stream with an earlier one's wait).
    let limit = slowed(Duration::from_secs(5 + 5));
    let names = ["stream", "graph", "capture", "kernel"];
    let mut released: Vec<Option<Duration>> = vec![None; streams.len()];
    while released.iter().any(Option::is_none) {
        assert!(killed_at.elapsed() < limit + Duration::from_secs(20), "streams still held after the kill: {released:?} ({names:?})");
        for (i, s) in streams.iter().enumerate() {
            if released[i].is_none() && s.query().unwrap_or_else(|e| panic!("{} stream: {e}", names[i])) {
                released[i] = Some(killed_at.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for (i, took) in released.iter().enumerate() {
        let took = took.expect("all released");
        eprintln!("{}: released {took:?} after the kill", names[i]);
        // The graph holds only a send, tied to the dead link: the peer check ends it, well
        // before the timeout that ends the receives nothing matched.
        let bound = if names[i] == "graph" { slowed(Duration::from_secs(3)) } else { limit };
        assert!(took < bound, "the {} stream was released {took:?} after the kill (bound {bound:?})", names[i]);
    }
    for (name, c) in [("stream", &sc), ("graph", &gc), ("capture", &cc), ("kernel", &kc)] {
        let q = c.query().map_err(|e| e.status());
        assert!(
            matches!(q, Err(Status::PeerFailed | Status::ConnectionReset | Status::TimedOut | Status::NotConnected)),
            "the {name} condition after the peer died: {q:?}"
        );
        eprintln!("{name}: {q:?}");
    }
    assert_ne!(pinned_u64(&err), 0, "the kernel's gsc_wait must report the failure");
    for h in [pending(r0), pending(s0)] {
        let c = w.request_wait(h).unwrap();
        assert_ne!(c.status, Status::Ok, "a stream operation on the dead peer completed Ok");
        w.request_release(h).unwrap();
    }
    drop(exec);
    drop(g);
    drop(cexec);
}

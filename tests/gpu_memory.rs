//! GPU-memory buffers between processes, one per GPU: rendezvous reads through CUDA IPC by the
//! copy engine (`GSC_CUDA_IPC=on`), and the host-staged path (`GSC_CUDA_IPC=off`). Data is pseudo-random, made and
//! checked by kernels; every condition kind; sizes up to 1 GiB; a receive posted long after its
//! send; tags received out of order; the seed's graph broadcast (one receive, two sends) across
//! three GPUs; a VMM send buffer (`cuMemCreate`) read by another process through a POSIX file
//! descriptor passed over a Unix socket; one `gscomm::mem_alloc` allocation per process carved
//! into send and receive buffers, exchanged both ways.
//!
//! Skips with a printed reason unless `GSC_TEST_GPU=1` and enough GPUs are there; the device
//! machines run it through `.gpu/run.sh gpu_memory`.
mod common;

use common::*;
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{
    DeviceBuf, Function, Graph, Module, PinnedBuf, Stream, device_count, gpu_test_skip_reason, ipc_export_kind, mem_get_info,
    release_retired_peer_mappings, set_device, vmm_counters,
};
use gscomm::{Context, Direction, Endpoint, Engine, PrepareParams, RequestParams, Started, Status, Worker};
use std::time::{Duration, Instant};

/// The tests of this binary share the GPUs, and one of them reads the device's free memory
/// (`vmm_send_buffer_read_by_another_process_through_fd_passing`): they run one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static GPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPUS.lock().unwrap_or_else(|e| e.into_inner())
}

const T: Duration = Duration::from_secs(300);

const KERNELS: &str = r#"
__device__ unsigned char val(unsigned long long i, unsigned long long seed) {
    unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ULL ^ (seed + 1) * 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 31; x *= 0x94D049BB133111EBULL; x ^= x >> 29;
    return (unsigned char)x;
}
extern "C" __global__ void fill(unsigned char *b, unsigned long long n, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        b[i] = val(i, seed);
}
extern "C" __global__ void xor5a(unsigned char *b, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        b[i] ^= 0x5A;
}
extern "C" __global__ void check(const unsigned char *b, unsigned long long n, unsigned long long seed,
                                 unsigned long long x, unsigned long long *errors) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        if (b[i] != (unsigned char)(val(i, seed) ^ (unsigned char)x)) { atomicAdd(errors, 1ULL); return; }
}
/* Bumps the round counter (one thread of the grid) after reading it; fills for (round, tag). */
extern "C" __global__ void fill_round(unsigned char *b, unsigned long long n, unsigned long long *round, unsigned long long tag) {
    unsigned long long r = *(volatile unsigned long long *)round + 1;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        b[i] = val(i, r * 1000 + tag);
}
extern "C" __global__ void bump(unsigned long long *round) { *round += 1; }
/* Checks data of the current round (after `bump`). */
extern "C" __global__ void check_round(const unsigned char *b, unsigned long long n, unsigned long long *round,
                                       unsigned long long tag, unsigned long long *errors) {
    unsigned long long r = *(volatile unsigned long long *)round;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        if (b[i] != val(i, r * 1000 + tag)) { atomicAdd(errors, 1ULL); return; }
}
/* A partitioned prepared send from a kernel: block b fills partition parts-1-b (so they are
 * readied in reverse, and concurrently) with this round's data, then sends it. */
extern "C" __global__ void pready_reverse(const gsc_prepared_device_t *d, unsigned char *src, unsigned long long seed) {
    unsigned long long part = d->parts - 1 - blockIdx.x, n = d->part_len;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) src[part * n + i] = val(part * n + i, seed);
    __syncthreads();
    gsc_pready(d, part);
}
/* Exchanges with GPU rounds driven from this one block: new data every round, checked. The
 * first half of the rounds one call at a time (gsc_prep_ready/send/wait), the rest through
 * cursors (gsc_prep_open ... gsc_prep_close), which continue the same round count. */
extern "C" __global__ void prep_kernel_rounds(const gsc_prepared_device_t *send, const gsc_prepared_device_t *recv,
                                              unsigned char *src, const unsigned char *dst, unsigned long long n,
                                              unsigned long long rounds, unsigned long long side, unsigned long long *errors) {
    gsc_prep_cursor_t tx, rx;
    for (unsigned long long r = 1; r <= rounds; r++) {
        int cursor = r > rounds / 2;
        if (r == rounds / 2 + 1) {
            tx = gsc_prep_open(send);
            rx = gsc_prep_open(recv);
        }
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) src[i] = val(i, r * 1000 + side);
        int rc;
        if (cursor) {
            gsc_prep_cursor_ready(&rx);
            rc = gsc_prep_cursor_send(&tx) | gsc_prep_cursor_wait(&rx);
        } else {
            gsc_prep_ready(recv);
            rc = gsc_prep_send(send) | gsc_prep_wait(recv);
        }
        int bad = rc != 0;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
            if (dst[i] != val(i, r * 1000 + 1 - side)) bad = 1;
        if (__syncthreads_or(bad)) {
            if (threadIdx.x == 0) atomicAdd(errors, 1ULL);
            return;
        }
    }
    gsc_prep_close(&tx); /* opened: rounds / 2 + 1 <= rounds */
    gsc_prep_close(&rx);
}
/* After a receive round: every partition reports arrived. */
extern "C" __global__ void parrived_all(const gsc_prepared_device_t *d, unsigned long long *errors) {
    if (threadIdx.x == 0)
        for (unsigned long long p = 0; p < d->parts; p++)
            if (!gsc_parrived(d, p)) atomicAdd(errors, 1ULL);
}
/* One block: `rounds` exchanges triggered and awaited from inside the kernel. */
extern "C" __global__ void kernel_rounds(gsc_device_handle_t *send, gsc_device_handle_t *recv, unsigned char *src,
                                         const unsigned char *dst, unsigned long long n, unsigned long long rounds,
                                         unsigned long long side, unsigned long long *errors) {
    for (unsigned long long r = 1; r <= rounds; r++) {
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) src[i] = val(i, r * 10 + side);
        __syncthreads();
        if (threadIdx.x == 0) {
            gsc_trigger(recv);
            gsc_trigger(send);
            if (gsc_wait(send) != 0 || gsc_wait(recv) != 0) atomicAdd(errors, 1000000ULL);
        }
        __syncthreads();
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
            if (dst[i] != val(i, r * 10 + (1 - side))) { atomicAdd(errors, 1ULL); break; }
        __syncthreads();
    }
}
"#;

struct Kern {
    fill: Function,
    xor5a: Function,
    check: Function,
    fill_round: Function,
    bump: Function,
    check_round: Function,
    kernel_rounds: Function,
    pready_reverse: Function,
    parrived_all: Function,
    prep_kernel_rounds: Function,
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
        bump: f("bump"),
        check_round: f("check_round"),
        kernel_rounds: f("kernel_rounds"),
        pready_reverse: f("pready_reverse"),
        parrived_all: f("parrived_all"),
        prep_kernel_rounds: f("prep_kernel_rounds"),
        _m: m,
    }
}

fn grid(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 4096) as u32
}

fn verdict(statuses: &[Status], errors: u64) -> String {
    if statuses.iter().all(|s| *s == Status::Ok) && errors == 0 { String::new() } else { format!("{statuses:?} errors={errors}") }
}

const IPC_SIZES: &[usize] = &[0, 1, 8, 4096, 65_535, 65_536, 1 << 20, 16 << 20, 256 << 20, 1 << 30];
/// The host-staged pair also stages messages up to 64 KiB through kernel slots.
const STAGED_SIZES: &[usize] = &[1, 8, 129, 65_536, 65_537, 4 << 20];
const GRAPH_ROUNDS: usize = 10_000;
fn graph_rounds() -> usize {
    rounds(GRAPH_ROUNDS)
}
const KERNEL_ROUNDS: u64 = 500;
const ROUND_BYTES: usize = 4096;
const PREPARED_ROUNDS: u64 = 100;
const PREPARED_SIZES: &[usize] = &[8, 4096, 65_536, 1 << 20, 16 << 20];

/// Stream-ordered echo: side 0 fills on the GPU, sends, receives the echo and checks it on the
/// GPU; side 1 receives, transforms (xor) on the GPU and sends it back. One buffer pair at a time
/// (1 GiB each at the top).
fn stream_echo(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, sizes: &[usize]) -> String {
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let mut statuses = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let (a, b) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        let (t, seed) = (i as u64, 77 + i as u64);
        let mut reqs = Vec::new();
        if side == 0 {
            k.fill.launch(grid(n), 256, &stream, &[a.ptr(), n as u64, seed]).unwrap();
            reqs.push(pending(unsafe { ep.tag_send_nbx(a.ptr() as *const u8, n, t, on(&cond, true)).unwrap() }));
            reqs.push(pending(unsafe { w.tag_recv_nbx(b.ptr() as *mut u8, n, 1000 + t, u64::MAX, on(&cond, true)).unwrap() }));
            k.check.launch(grid(n), 256, &stream, &[b.ptr(), n as u64, seed, 0x5A, err.device_ptr()]).unwrap();
        } else {
            reqs.push(pending(unsafe { w.tag_recv_nbx(a.ptr() as *mut u8, n, t, u64::MAX, on(&cond, true)).unwrap() }));
            k.xor5a.launch(grid(n), 256, &stream, &[a.ptr(), n as u64]).unwrap();
            reqs.push(pending(unsafe { ep.tag_send_nbx(a.ptr() as *const u8, n, 1000 + t, on(&cond, true)).unwrap() }));
        }
        statuses.extend(wait_all(w, reqs));
        stream.synchronize().unwrap();
        if std::env::var("GSC_TEST_LOG_LEVEL").is_ok() {
            eprintln!("side {side}: echo of {n} B done");
        }
    }
    verdict(&statuses, pinned_u64(&err))
}

/// A halo exchange as graph nodes (fill -> send; recv; both done -> bump, check) on GPU
/// buffers, replayed GRAPH_ROUNDS times with new data every round.
fn graph_halo(side: u64, w: &Worker, ep: &Endpoint, k: &Kern) -> String {
    let stream = Stream::new().unwrap();
    let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
    let (src, dst) = (DeviceBuf::new(ROUND_BYTES).unwrap(), DeviceBuf::new(ROUND_BYTES).unwrap());
    let n = ROUND_BYTES as u64;
    let g = Graph::new().unwrap();
    let gc = Condition::cuda(Category::Graph, g.raw(), None).unwrap();
    let fill = g.add_kernel(k.fill_round, grid(ROUND_BYTES), 256, &[src.ptr(), n, round.device_ptr(), side], &[]).unwrap();
    let s = armed(unsafe { ep.tag_send_nbx(src.ptr() as *const u8, ROUND_BYTES, 7, on(&gc, true)).unwrap() });
    let r = armed(unsafe { w.tag_recv_nbx(dst.ptr() as *mut u8, ROUND_BYTES, 7, u64::MAX, on(&gc, true)).unwrap() });
    g.add_dependency(fill, s.start_node).unwrap();
    let bump = g.add_kernel(k.bump, 1, 1, &[round.device_ptr()], &[s.done_node, r.done_node]).unwrap();
    g.add_kernel(k.check_round, grid(ROUND_BYTES), 256, &[dst.ptr(), n, round.device_ptr(), 1 - side, err.device_ptr()], &[bump]).unwrap();
    let exec = g.instantiate().unwrap();
    let t0 = Instant::now();
    for i in 0..graph_rounds() {
        exec.launch(&stream).unwrap();
        if sync_every() > 0 && (i + 1) % sync_every() == 0 {
            stream.synchronize().unwrap();
        }
    }
    stream.synchronize().unwrap();
    let dt = t0.elapsed();
    eprintln!(
        "side {side}: {} graph replays on GPU buffers in {dt:?} ({:.1} us/replay)",
        graph_rounds(),
        dt.as_secs_f64() * 1e6 / graph_rounds() as f64
    );
    let rounds = pinned_u64(&round);
    let mut v = verdict(&[], pinned_u64(&err));
    if rounds != graph_rounds() as u64 || gc.query().is_err() {
        v += &format!(" rounds={rounds} query={:?}", gc.query());
    }
    v
}

/// KERNEL_ROUNDS exchanges of GPU buffers triggered and awaited from inside one kernel.
fn kernel_triggered(side: u64, w: &Worker, ep: &Endpoint, k: &Kern) -> String {
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let (src, dst) = (DeviceBuf::new(ROUND_BYTES).unwrap(), DeviceBuf::new(ROUND_BYTES).unwrap());
    let kc = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let hs = armed(unsafe { ep.tag_send_nbx(src.ptr() as *const u8, ROUND_BYTES, 11, on(&kc, true)).unwrap() });
    let hr = armed(unsafe { w.tag_recv_nbx(dst.ptr() as *mut u8, ROUND_BYTES, 11, u64::MAX, on(&kc, true)).unwrap() });
    let args = [
        hs.device_handle,
        hr.device_handle,
        src.ptr(),
        dst.ptr(),
        ROUND_BYTES as u64,
        rounds(KERNEL_ROUNDS as usize) as u64,
        side,
        err.device_ptr(),
    ];
    k.kernel_rounds.launch(1, 256, &stream, &args).unwrap();
    stream.synchronize().unwrap();
    let mut v = verdict(&[], pinned_u64(&err));
    if kc.query().is_err() {
        v += &format!(" query={:?}", kc.query());
    }
    v
}

/// Side 0 sends 1 MiB (tag 50) and 8 B (tag 51) from GPU buffers at once, without conditions;
/// side 1 posts its receives 300 ms later and in the other order.
fn late_and_reordered(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, chan: &mut dyn FnMut(&str)) -> String {
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let sizes = [(50u64, 1usize << 20), (51, 8)];
    let bufs: Vec<DeviceBuf> = sizes.iter().map(|&(_, n)| DeviceBuf::new(n).unwrap()).collect();
    let mut reqs = Vec::new();
    if side == 0 {
        for (b, &(tag, n)) in bufs.iter().zip(&sizes) {
            k.fill.launch(grid(n), 256, &stream, &[b.ptr(), n as u64, tag]).unwrap();
        }
        stream.synchronize().unwrap();
        for (b, &(tag, n)) in bufs.iter().zip(&sizes) {
            let s = unsafe { ep.tag_send_nbx(b.ptr() as *const u8, n, tag, RequestParams::default()).unwrap() };
            if let Started::Pending(h) = s {
                reqs.push(h);
            }
        }
        chan("sent");
    } else {
        chan("sent");
        std::thread::sleep(Duration::from_millis(300));
        for (b, &(tag, n)) in bufs.iter().zip(&sizes).rev() {
            let s = unsafe { w.tag_recv_nbx(b.ptr() as *mut u8, n, tag, u64::MAX, RequestParams::default()).unwrap() };
            match s {
                Started::Pending(h) => reqs.push(h),
                Started::Done(info) => assert_eq!(info.length, n),
                other => panic!("{other:?}"),
            }
        }
    }
    let statuses = wait_all(w, reqs);
    if side == 1 {
        for (b, &(tag, n)) in bufs.iter().zip(&sizes) {
            k.check.launch(grid(n), 256, &stream, &[b.ptr(), n as u64, tag, 0, err.device_ptr()]).unwrap();
        }
        stream.synchronize().unwrap();
    }
    verdict(&statuses, pinned_u64(&err))
}

/// Sizes of the grouped exchanges: staged (up to `GSC_CUDA_STAGE_MAX`, 4 KiB by default) and
/// one byte past it (a copy-engine read).
const GROUPED_SIZES: &[usize] = &[8, 4096, 4097];
const GROUPED_ROUNDS: usize = 600;
const GROUPED_PER_GRAPH: usize = 50;
/// Whole graphs' worth of grouped rounds, at least one graph.
fn grouped_round_count() -> usize {
    rounds(GROUPED_ROUNDS / GROUPED_PER_GRAPH) * GROUPED_PER_GRAPH
}

/// The exchange gsc-bench times, checked: every round fills the send buffer for the round,
/// issues the receive and the send without stream waits in one group with a `wait`, then
/// checks what arrived. On a plain stream (`captured` false) or captured into a graph of
/// GROUPED_PER_GRAPH rounds replayed until GROUPED_ROUNDS.
fn grouped_rounds(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, captured: bool) -> String {
    let stream = Stream::new().unwrap();
    let mut v = String::new();
    for &n in GROUPED_SIZES {
        let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
        let (src, dst) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        // Captured: a stream of its own to capture on; the graph is launched on `stream`.
        let on_stream = Stream::new().unwrap();
        let cond = Condition::cuda(Category::Stream, on_stream.raw(), None).unwrap();
        let round_of = |s: &Stream| {
            k.fill_round.launch(grid(n), 256, s, &[src.ptr(), n as u64, round.device_ptr(), side]).unwrap();
            cond.group_start().unwrap();
            let r = unsafe { w.tag_recv_nbx(dst.ptr() as *mut u8, n, 90, u64::MAX, on(&cond, false)).unwrap() };
            let s_ = unsafe { ep.tag_send_nbx(src.ptr() as *const u8, n, 90, on(&cond, false)).unwrap() };
            cond.wait().unwrap();
            cond.group_end().unwrap();
            for st in [r, s_] {
                if let Started::Pending(h) = st {
                    w.request_release(h).unwrap();
                }
            }
            k.bump.launch(1, 1, s, &[round.device_ptr()]).unwrap();
            k.check_round.launch(grid(n), 256, s, &[dst.ptr(), n as u64, round.device_ptr(), 1 - side, err.device_ptr()]).unwrap();
        };
        if captured {
            on_stream.begin_capture().unwrap();
            (0..GROUPED_PER_GRAPH).for_each(|_| round_of(&on_stream));
            let exec = on_stream.end_capture().unwrap().instantiate().unwrap();
            for _ in 0..grouped_round_count() / GROUPED_PER_GRAPH {
                exec.launch(&stream).unwrap();
            }
            stream.synchronize().unwrap();
        } else {
            (0..grouped_round_count()).for_each(|_| round_of(&on_stream));
            on_stream.synchronize().unwrap();
        }
        let (rounds, errors) = (pinned_u64(&round), pinned_u64(&err));
        if rounds != grouped_round_count() as u64 || errors != 0 || cond.query().is_err() {
            v += &format!(" {n}B: rounds={rounds} errors={errors} query={:?}", cond.query());
        }
    }
    v
}

/// A staged receive fed by a send that is not staged (no condition: a copy-engine read into the
/// slot), and a staged send received without a condition (eager frames into a GPU buffer). Both
/// receive buffers are twice the message: the bytes past it must stay as they were.
fn mixed_staging(side: u64, w: &Worker, ep: &Endpoint, k: &Kern) -> String {
    const N: usize = 1000;
    let stream = Stream::new().unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let (src, dst) = (DeviceBuf::new(N).unwrap(), DeviceBuf::new(2 * N).unwrap());
    let tail = dst.ptr() + N as u64;
    k.fill.launch(grid(N), 256, &stream, &[src.ptr(), N as u64, 60 + side]).unwrap();
    k.fill.launch(grid(N), 256, &stream, &[tail, N as u64, 99]).unwrap();
    stream.synchronize().unwrap();
    let (peer_tag, my_tag) = (60 + (1 - side), 60 + side);
    let mut reqs = Vec::new();
    if side == 0 {
        // Plain (unconditioned) send and receive on this side.
        reqs.push(pending_or_done(unsafe { ep.tag_send_nbx(src.ptr() as *const u8, N, my_tag, RequestParams::default()).unwrap() }));
        reqs.push(pending_or_done(unsafe {
            w.tag_recv_nbx(dst.ptr() as *mut u8, 2 * N, peer_tag, u64::MAX, RequestParams::default()).unwrap()
        }));
    } else {
        // Staged receive and send, each with its stream wait.
        reqs.push(pending_or_done(unsafe { w.tag_recv_nbx(dst.ptr() as *mut u8, 2 * N, peer_tag, u64::MAX, on(&cond, true)).unwrap() }));
        reqs.push(pending_or_done(unsafe { ep.tag_send_nbx(src.ptr() as *const u8, N, my_tag, on(&cond, true)).unwrap() }));
    }
    let statuses = wait_all(w, reqs.into_iter().flatten().collect());
    k.check.launch(grid(N), 256, &stream, &[dst.ptr(), N as u64, peer_tag, 0, err.device_ptr()]).unwrap();
    k.check.launch(grid(N), 256, &stream, &[tail, N as u64, 99, 0, err.device_ptr()]).unwrap();
    stream.synchronize().unwrap();
    verdict(&statuses, pinned_u64(&err))
}

/// Staged messages of awkward shapes: sizes around the kernels' 32-byte head and 16-byte loads,
/// buffers at odd offsets, receives 16 bytes longer than the message (those bytes must stay as
/// they were). Each size once with its own stream waits (one `gsc_seq_kernel` per operation),
/// then all of them in one group (receive lists longer than one kernel takes).
fn staged_shapes(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, sizes: &[usize]) -> String {
    const SLACK: usize = 16;
    let stream = Stream::new().unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let mut statuses = Vec::new();
    for grouped in [false, true] {
        // (source buffer, its offset, destination buffer, its offset) per size.
        let bufs: Vec<(DeviceBuf, u64, DeviceBuf, u64)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let (so, dof) = if i % 2 == 0 { (0, 0) } else { (1, 5) };
                (DeviceBuf::new(n + 8).unwrap(), so, DeviceBuf::new(n + SLACK + 8).unwrap(), dof)
            })
            .collect();
        let seed = |i: usize, from: u64| 500 + 10 * i as u64 + from + if grouped { 5000 } else { 0 };
        for (i, (&n, (src, so, dst, dof))) in sizes.iter().zip(&bufs).enumerate() {
            k.fill.launch(grid(n), 256, &stream, &[src.ptr() + so, n as u64, seed(i, side)]).unwrap();
            k.fill.launch(1, 256, &stream, &[dst.ptr() + dof + n as u64, SLACK as u64, 7]).unwrap();
        }
        let mut reqs = Vec::new();
        if grouped {
            cond.group_start().unwrap();
        }
        for (i, (&n, (src, so, dst, dof))) in sizes.iter().zip(&bufs).enumerate() {
            let t = 400 + i as u64 + if grouped { 100 } else { 0 };
            let (rbuf, sbuf) = ((dst.ptr() + dof) as *mut u8, (src.ptr() + so) as *const u8);
            // Side 0 sends first, side 1 receives first: with stream waits each operation holds
            // the stream until it completes, and a rendezvous send completes only once received.
            let recv = || pending(unsafe { w.tag_recv_nbx(rbuf, n + SLACK, t, u64::MAX, on(&cond, !grouped)).unwrap() });
            let send = || pending(unsafe { ep.tag_send_nbx(sbuf, n, t, on(&cond, !grouped)).unwrap() });
            if side == 0 {
                reqs.extend([send(), recv()]);
            } else {
                reqs.extend([recv(), send()]);
            }
        }
        if grouped {
            cond.wait().unwrap();
            cond.group_end().unwrap();
        }
        for (i, (&n, (_, _, dst, dof))) in sizes.iter().zip(&bufs).enumerate() {
            k.check.launch(grid(n), 256, &stream, &[dst.ptr() + dof, n as u64, seed(i, 1 - side), 0, err.device_ptr()]).unwrap();
            k.check.launch(1, 256, &stream, &[dst.ptr() + dof + n as u64, SLACK as u64, 7, 0, err.device_ptr()]).unwrap();
        }
        statuses.extend(wait_all(w, reqs));
        stream.synchronize().unwrap();
    }
    verdict(&statuses, pinned_u64(&err))
}

/// Sizes for `staged_shapes`: with the default `GSC_CUDA_STAGE_MAX` (4K) and with 64K.
const SHAPES: &[usize] = &[1, 7, 31, 32, 33, 47, 48, 100, 1000, 4079, 4080, 4095];
const SHAPES_64K: &[usize] = &[1, 33, 4095, 16_000, 16_384, 40_000, 65_519, 65_520];

/// Prepared transfers on GPU buffers, started on a CUDA stream: each side prepares a send and a
/// receive once per size, then PREPARED_ROUNDS rounds move new data (side 0 fills and checks,
/// side 1 transforms and echoes).
fn prepared_stream(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, sizes: &[usize], engine: Engine) -> String {
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let mut statuses = Vec::new();
    let mut failure: Option<String> = None;
    for (i, &n) in sizes.iter().enumerate() {
        let (a, b) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        let tag = 100 + i as u64 + 1000 * engine as u64;
        let pp = |dir| PrepareParams { dir, tag, partitions: None, memory_type: None, engine };
        // SAFETY: the buffers outlive the preparations (dropped first, at the end of the size,
        // after the stream finished every round).
        let (tx, rx) = unsafe {
            if side == 0 {
                (
                    ep.prepare(a.ptr() as *mut u8, n, pp(Direction::Send)).unwrap(),
                    ep.prepare(b.ptr() as *mut u8, n, pp(Direction::Recv)).unwrap(),
                )
            } else {
                (
                    ep.prepare(a.ptr() as *mut u8, n, pp(Direction::Send)).unwrap(),
                    ep.prepare(a.ptr() as *mut u8, n, pp(Direction::Recv)).unwrap(),
                )
            }
        };
        // The engine the pair runs on (fixed at pairing): what was asked, or what the table
        // chose for `Auto`: the GPU unless GSC_ENGINE=proxy (every size here is within the
        // default GSC_ENGINE_GPU_MAX), except for a receive written in place (over 64 KiB) in
        // an allocation under 2 MiB, which the peer may not be able to open (`shares_a_block`).
        let gpu_rounds = tx.runs_on_gpu().unwrap();
        let expected = match engine {
            Engine::Auto => std::env::var("GSC_ENGINE").map_or(true, |e| e != "proxy") && !(65_536 < n && n < 2 << 20),
            e => e == Engine::Gpu,
        };
        if gpu_rounds != expected || rx.runs_on_gpu().unwrap() != gpu_rounds {
            failure.get_or_insert(format!("size {n}: {engine:?} ran on the GPU: {gpu_rounds} (expected {expected})"));
        }
        let mut reqs = Vec::new();
        // A start that fails ends the scenario with its error (not a panic: the rounds already
        // issued are still waited for, so nothing is freed under the GPU).
        let mut start = |p: &gscomm::Prepared, what: &str, r: u64| match p.start(on(&cond, true)) {
            Ok(Started::Armed(_)) if gpu_rounds => true,
            Ok(s) => {
                reqs.push(pending(s));
                true
            }
            Err(e) => {
                failure.get_or_insert(format!("size {n} round {r}: {what} start: {e}"));
                false
            }
        };
        for r in 0..rounds(PREPARED_ROUNDS as usize) as u64 {
            let seed = 1000 * r + i as u64;
            let ok = if side == 0 {
                k.fill.launch(grid(n), 256, &stream, &[a.ptr(), n as u64, seed]).unwrap();
                let ok = start(&tx, "send", r) && start(&rx, "receive", r);
                k.check.launch(grid(n), 256, &stream, &[b.ptr(), n as u64, seed, 0x5A, err.device_ptr()]).unwrap();
                ok
            } else {
                let ok = start(&rx, "receive", r);
                k.xor5a.launch(grid(n), 256, &stream, &[a.ptr(), n as u64]).unwrap();
                ok && start(&tx, "send", r)
            };
            if !ok {
                break;
            }
        }
        statuses.extend(wait_all(w, reqs));
        stream.synchronize().unwrap();
        if gpu_rounds {
            for (what, p) in [("send", &tx), ("receive", &rx)] {
                match p.gpu_error() {
                    Ok(0) => {}
                    other => {
                        failure.get_or_insert(format!("size {n}: {what} side's GPU rounds: {other:?}"));
                    }
                }
            }
        }
        if !gpu_rounds && failure.is_none() {
            // Proxy rounds between two processes signal through shared words unless
            // GSC_PREP_WORDS=off (the frame fallback, for A/B runs).
            let words = std::env::var("GSC_PREP_WORDS").map_or(true, |v| v != "off");
            for (what, p) in [("send", &tx), ("receive", &rx)] {
                match p.shared_words() {
                    Ok(Some(w)) if w == words => {}
                    other => {
                        failure.get_or_insert(format!("size {n}: {what} side's shared words: {other:?} (expected {words})"));
                    }
                }
            }
        }
        drop((tx, rx));
        if failure.is_some() {
            break;
        }
    }
    failure.unwrap_or_default() + &verdict(&statuses, pinned_u64(&err))
}

/// Prepared transfers started from the host (no condition) with the engine the table picks:
/// both sides exchange HOST_ROUNDS rounds, each side's send and receive waited for on the host,
/// the data checked by a kernel after each. With GPU rounds a host start runs our kernel on a
/// stream of the transfer's own and completes when it ended.
fn prepared_host_starts(side: u64, w: &Worker, ep: &Endpoint, k: &Kern) -> String {
    const HOST_ROUNDS: u64 = 50;
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let mut out = String::new();
    for (i, n) in [8usize, 4096, 1 << 20].into_iter().enumerate() {
        let (src, dst) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        let pp = |dir| PrepareParams { dir, tag: 9100 + i as u64, partitions: None, memory_type: None, engine: Engine::Auto };
        // SAFETY: both buffers outlive the pair (dropped after its last round was waited for).
        let (tx, rx) = unsafe {
            (
                ep.prepare(src.ptr() as *mut u8, n, pp(Direction::Send)).unwrap(),
                ep.prepare(dst.ptr() as *mut u8, n, pp(Direction::Recv)).unwrap(),
            )
        };
        let on_gpu = tx.runs_on_gpu().unwrap();
        for r in 0..HOST_ROUNDS {
            k.fill.launch(grid(n), 256, &stream, &[src.ptr(), n as u64, 10 * r + side]).unwrap();
            stream.synchronize().unwrap();
            let (hr, hs) = match (rx.start(RequestParams::default()), tx.start(RequestParams::default())) {
                (Ok(a), Ok(b)) => (pending_or_done(a), pending_or_done(b)),
                other => {
                    out += &format!("{n} B round {r}: starts {other:?}; ");
                    break;
                }
            };
            // A second start while the first is in flight is refused, like any unconditioned start.
            if let (Some(_), Err(e)) = (hs, tx.start(RequestParams::default()))
                && e.status() != Status::Busy
            {
                out += &format!("{n} B: second start gave {e}; ");
            }
            let statuses = wait_all(w, hr.into_iter().chain(hs).collect());
            if statuses.iter().any(|s| *s != Status::Ok) {
                out += &format!("{n} B round {r}: {statuses:?}; ");
                break;
            }
            k.check.launch(grid(n), 256, &stream, &[dst.ptr(), n as u64, 10 * r + (1 - side), 0, err.device_ptr()]).unwrap();
            stream.synchronize().unwrap();
        }
        eprintln!("side {side}: {HOST_ROUNDS} host-started rounds of {n} B, on the GPU: {on_gpu}");
        drop((tx, rx));
    }
    out + &verdict(&[], pinned_u64(&err))
}

/// A prepared send of `src` on `to` and receive into `dst` on `from`, `len` bytes, `tag`. Every
/// caller keeps both buffers alive, untouched outside rounds, until it drops the pair after its
/// last round.
fn prepare_pair(
    to: &Endpoint,
    from: &Endpoint,
    src: &DeviceBuf,
    dst: &DeviceBuf,
    len: usize,
    tag: u64,
    gpu_rounds: bool,
) -> (gscomm::Prepared, gscomm::Prepared) {
    let engine = if gpu_rounds { Engine::Gpu } else { Engine::Proxy };
    let pp = |dir| PrepareParams { dir, tag, partitions: None, memory_type: None, engine };
    // SAFETY: the callers' contract above.
    unsafe {
        (
            to.prepare(src.ptr() as *mut u8, len, pp(Direction::Send)).unwrap(),
            from.prepare(dst.ptr() as *mut u8, len, pp(Direction::Recv)).unwrap(),
        )
    }
}

/// A halo exchange with GPU rounds captured from a stream (fill -> receive ready -> send ->
/// wait -> bump -> check), replayed GRAPH_ROUNDS times with new data each time.
fn prepared_gpu_rounds_captured(side: u64, k: &Kern, ep: &Endpoint) -> String {
    let stream = Stream::new().unwrap();
    let cap = Stream::new().unwrap();
    let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
    let (src, dst) = (DeviceBuf::new(ROUND_BYTES).unwrap(), DeviceBuf::new(ROUND_BYTES).unwrap());
    let n = ROUND_BYTES as u64;
    let (tx, rx) = prepare_pair(ep, ep, &src, &dst, ROUND_BYTES, 5000, true);
    let cond = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
    // Pairing and mapping happen at the first start: do one uncaptured round pair first.
    let warm = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    rx.start(on(&warm, false)).unwrap();
    tx.start(on(&warm, false)).unwrap();
    warm.wait().unwrap();
    stream.synchronize().unwrap();
    cap.begin_capture().unwrap();
    k.fill_round.launch(grid(ROUND_BYTES), 256, &cap, &[src.ptr(), n, round.device_ptr(), side]).unwrap();
    rx.start(on(&cond, false)).unwrap();
    tx.start(on(&cond, false)).unwrap();
    cond.wait().unwrap();
    k.bump.launch(1, 1, &cap, &[round.device_ptr()]).unwrap();
    k.check_round.launch(grid(ROUND_BYTES), 256, &cap, &[dst.ptr(), n, round.device_ptr(), 1 - side, err.device_ptr()]).unwrap();
    let exec = cap.end_capture().unwrap().instantiate().unwrap();
    let t0 = Instant::now();
    for _ in 0..graph_rounds() {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    let dt = t0.elapsed();
    eprintln!(
        "side {side}: {} captured GPU-round replays in {dt:?} ({:.1} us/replay)",
        graph_rounds(),
        dt.as_secs_f64() * 1e6 / graph_rounds() as f64
    );
    let mut v = verdict(&[], pinned_u64(&err));
    let rounds = pinned_u64(&round);
    if rounds != graph_rounds() as u64 {
        v += &format!(" rounds={rounds}");
    }
    for p in [&tx, &rx] {
        if p.gpu_error().ok() != Some(0) {
            v += &format!(" gpu_error={:?}", p.gpu_error());
        }
    }
    drop((tx, rx));
    v
}

/// A partitioned transfer with GPU rounds, side 0 to side 1: each round side 0's kernel fills
/// and readies the partitions in reverse order from concurrent blocks (`gsc_pready`); side 1
/// checks the data and that every partition reports arrived (`gsc_parrived`).
fn prepared_gpu_partitions(side: u64, ep: &Endpoint, k: &Kern) -> String {
    const PARTS: usize = 8;
    const N: usize = 4 << 20;
    let rounds = rounds(200) as u64;
    let stream = Stream::new().unwrap();
    let err = PinnedBuf::new(8).unwrap();
    let buf = DeviceBuf::new(N).unwrap();
    let dir = if side == 0 { Direction::Send } else { Direction::Recv };
    let pp = PrepareParams { dir, tag: 6000, partitions: Some(PARTS), memory_type: None, engine: Engine::Gpu };
    // SAFETY: `buf` outlives the preparation (dropped first, after the stream finished).
    let p = unsafe { ep.prepare(buf.ptr() as *mut u8, N, pp).unwrap() };
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let d = match p.device_handle() {
        Ok(d) => d,
        Err(e) => return format!("device handle: {e}"),
    };
    for r in 0..rounds {
        let seed = 7000 + r;
        if let Err(e) = p.start(on(&cond, true)) {
            return format!("round {r}: start: {e}");
        }
        if side == 0 {
            k.pready_reverse.launch(PARTS as u32, 256, &stream, &[d, buf.ptr(), seed]).unwrap();
        } else {
            k.check.launch(grid(N), 256, &stream, &[buf.ptr(), N as u64, seed, 0, err.device_ptr()]).unwrap();
            k.parrived_all.launch(1, 32, &stream, &[d, err.device_ptr()]).unwrap();
        }
    }
    stream.synchronize().unwrap();
    let mut v = verdict(&[], pinned_u64(&err));
    if p.gpu_error().ok() != Some(0) {
        v += &format!(" gpu_error={:?}", p.gpu_error());
    }
    drop(p);
    v
}

/// GPU rounds driven by one user kernel on each side (`gsc_prep_ready/send/wait`, then
/// cursors), new data every round checked inside the kernel: LL words (1001 B), staged bytes
/// (4 KiB), in place.
fn prepared_gpu_kernel_rounds(side: u64, ep: &Endpoint, k: &Kern) -> String {
    let mut out = String::new();
    for (n, rounds) in [(1001usize, 2000u64), (4096, 2000), (4 << 20, 50)] {
        let rounds = common::rounds(rounds as usize) as u64;
        let stream = Stream::new().unwrap();
        let err = PinnedBuf::new(8).unwrap();
        let (src, dst) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        let (tx, rx) = prepare_pair(ep, ep, &src, &dst, n, 7000 + n as u64, true);
        let (hs, hr) = match (tx.device_handle(), rx.device_handle()) {
            (Ok(a), Ok(b)) => (a, b),
            other => return format!("device handles: {other:?}"),
        };
        let t0 = Instant::now();
        k.prep_kernel_rounds.launch(1, 256, &stream, &[hs, hr, src.ptr(), dst.ptr(), n as u64, rounds, side, err.device_ptr()]).unwrap();
        stream.synchronize().unwrap();
        eprintln!("side {side}: {rounds} kernel-driven rounds of {n} B, {:.2} us/round", t0.elapsed().as_secs_f64() * 1e6 / rounds as f64);
        let v = verdict(&[], pinned_u64(&err));
        if !v.is_empty() {
            out += &format!("{n} B: {v} gpu_error={:?}/{:?}; ", tx.gpu_error(), rx.gpu_error());
        }
        drop((tx, rx));
    }
    out
}

/// Prepared transfers started on a kernel-triggered condition and driven by `kernel_rounds`
/// (gsc_trigger / gsc_wait from one thread, new data every round, checked): with GPU rounds the
/// handle's calls run each round in that thread, with the proxy engine the proxy does. LL words
/// (8 B), staged bytes (4 KiB), in place (4 MiB: a buffer of its own allocation).
fn prepared_kernel_triggered(side: u64, ep: &Endpoint, k: &Kern, gpu_rounds: bool) -> String {
    let mut out = String::new();
    for (i, (n, rounds)) in [(8usize, 500u64), (4096, 300), (4 << 20, 10)].into_iter().enumerate() {
        let rounds = common::rounds(rounds as usize) as u64;
        let stream = Stream::new().unwrap();
        let err = PinnedBuf::new(8).unwrap();
        let (src, dst) = (DeviceBuf::new(n).unwrap(), DeviceBuf::new(n).unwrap());
        let (tx, rx) = prepare_pair(ep, ep, &src, &dst, n, 12_000 + 10 * i as u64 + u64::from(gpu_rounds), gpu_rounds);
        let kc = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
        let (hs, hr) = (armed(tx.start(on(&kc, true)).unwrap()), armed(rx.start(on(&kc, true)).unwrap()));
        let args = [hs.device_handle, hr.device_handle, src.ptr(), dst.ptr(), n as u64, rounds, side, err.device_ptr()];
        let t0 = Instant::now();
        k.kernel_rounds.launch(1, 256, &stream, &args).unwrap();
        stream.synchronize().unwrap();
        eprintln!(
            "side {side}: {rounds} kernel-triggered prepared rounds of {n} B, gpu_rounds={gpu_rounds}, {:.2} us/round",
            t0.elapsed().as_secs_f64() * 1e6 / rounds as f64
        );
        let mut v = verdict(&[], pinned_u64(&err));
        if tx.runs_on_gpu().ok() != Some(gpu_rounds) {
            v += &format!(" runs_on_gpu={:?}", tx.runs_on_gpu());
        }
        if kc.query().is_err() || (gpu_rounds && (tx.gpu_error().ok() != Some(0) || rx.gpu_error().ok() != Some(0))) {
            v += &format!(" query={:?} gpu_error={:?}/{:?}", kc.query(), tx.gpu_error(), rx.gpu_error());
        }
        if !v.is_empty() {
            out += &format!("{n} B: {v}; ");
        }
        drop((tx, rx));
    }
    out
}

/// `graph_halo` with prepared transfers: armed once on the graph, GRAPH_ROUNDS replays. With
/// `gpu_rounds` each side's send and receive are one `gsc_prep_kernel` node each (start and done
/// node alike) with no edge between them: the receive's node must announce readiness while the
/// send's may be waiting for the peer's, as on a stream where the receive starts first.
fn prepared_graph(side: u64, ep: &Endpoint, k: &Kern, gpu_rounds: bool) -> String {
    let stream = Stream::new().unwrap();
    let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
    let (src, dst) = (DeviceBuf::new(ROUND_BYTES).unwrap(), DeviceBuf::new(ROUND_BYTES).unwrap());
    let n = ROUND_BYTES as u64;
    let (tx, rx) = prepare_pair(ep, ep, &src, &dst, ROUND_BYTES, if gpu_rounds { 9009 } else { 9 }, gpu_rounds);
    let g = Graph::new().unwrap();
    let gc = Condition::cuda(Category::Graph, g.raw(), None).unwrap();
    let fill = g.add_kernel(k.fill_round, grid(ROUND_BYTES), 256, &[src.ptr(), n, round.device_ptr(), side], &[]).unwrap();
    let s = armed(tx.start(on(&gc, true)).unwrap());
    let r = armed(rx.start(on(&gc, true)).unwrap());
    g.add_dependency(fill, s.start_node).unwrap();
    let bump = g.add_kernel(k.bump, 1, 1, &[round.device_ptr()], &[s.done_node, r.done_node]).unwrap();
    g.add_kernel(k.check_round, grid(ROUND_BYTES), 256, &[dst.ptr(), n, round.device_ptr(), 1 - side, err.device_ptr()], &[bump]).unwrap();
    let exec = g.instantiate().unwrap();
    let t0 = Instant::now();
    for _ in 0..graph_rounds() {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    let dt = t0.elapsed();
    eprintln!(
        "side {side}: {} prepared graph replays, gpu_rounds={gpu_rounds}, in {dt:?} ({:.1} us/replay)",
        graph_rounds(),
        dt.as_secs_f64() * 1e6 / graph_rounds() as f64
    );
    let rounds = pinned_u64(&round);
    let mut v = verdict(&[], pinned_u64(&err));
    if rounds != graph_rounds() as u64 || gc.query().is_err() {
        v += &format!(" rounds={rounds} query={:?}", gc.query());
    }
    if gpu_rounds && (tx.gpu_error().ok() != Some(0) || rx.gpu_error().ok() != Some(0)) {
        v += &format!(" gpu_error={:?}/{:?}", tx.gpu_error(), rx.gpu_error());
    }
    drop((tx, rx));
    v
}

fn pending_or_done(s: Started) -> Option<u64> {
    match s {
        Started::Pending(h) => Some(h),
        Started::Done(_) => None,
        other => panic!("{other:?}"),
    }
}

/// `GSC_TEST_SYNC_EVERY=k`: synchronize the stream after every k graph launches (0: only at
/// the end), to tell launch-queue effects from transfer costs.
fn sync_every() -> usize {
    std::env::var("GSC_TEST_SYNC_EVERY").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn device_for(rank: u64) -> i32 {
    (rank as i32) % device_count().max(1)
}

/// Runs every two-process scenario; `ep2`/`w2` are the staged (IPC off) pair.
fn scenarios(
    side: u64,
    pair: (&Worker, &Endpoint),
    staged: (&Worker, &Endpoint),
    k: &Kern,
    sync: &mut dyn FnMut(&str),
) -> Vec<(String, String)> {
    let (w, ep) = pair;
    let mut out = Vec::new();
    let mut run = |name: &str, f: &mut dyn FnMut() -> String| {
        let t0 = Instant::now();
        let r = f();
        eprintln!("side {side}: {name} {} in {:?}", if r.is_empty() { "ok" } else { &r }, t0.elapsed());
        out.push((name.to_string(), r));
    };
    run("stream_ipc", &mut || stream_echo(side, w, ep, k, IPC_SIZES));
    run("stream_staged", &mut || stream_echo(side, staged.0, staged.1, k, STAGED_SIZES));
    run("graph", &mut || graph_halo(side, w, ep, k));
    run("kernel", &mut || kernel_triggered(side, w, ep, k));
    run("late_reordered", &mut || late_and_reordered(side, w, ep, k, sync));
    run("grouped_stream", &mut || grouped_rounds(side, w, ep, k, false));
    run("grouped_captured", &mut || grouped_rounds(side, w, ep, k, true));
    run("mixed_staging", &mut || mixed_staging(side, w, ep, k));
    run("staged_shapes", &mut || staged_shapes(side, w, ep, k, SHAPES));
    run("staged_shapes_64k", &mut || staged_shapes(side, staged.0, staged.1, k, SHAPES_64K));
    run("prepared_stream_ipc", &mut || prepared_stream(side, w, ep, k, PREPARED_SIZES, Engine::Proxy));
    run("prepared_stream_staged", &mut || prepared_stream(side, staged.0, staged.1, k, PREPARED_SIZES, Engine::Proxy));
    // The engine the table picks by default (GSC_ENGINE, run with =gpu and =proxy too).
    run("prepared_stream_auto", &mut || prepared_stream(side, w, ep, k, PREPARED_SIZES, Engine::Auto));
    run("prepared_host_starts", &mut || prepared_host_starts(side, w, ep, k));
    // Receives above 64 KiB are written in place: a buffer of its own allocation (16 MiB).
    // 8 B and 1001 B travel as LL words, 4 KiB and 64 KiB staged as bytes.
    run("prepared_gpu_rounds", &mut || prepared_stream(side, w, ep, k, &[8, 1001, 4096, 65_536, 16 << 20], Engine::Gpu));
    run("prepared_gpu_rounds_captured", &mut || prepared_gpu_rounds_captured(side, k, ep));
    run("prepared_gpu_partitions", &mut || prepared_gpu_partitions(side, ep, k));
    run("prepared_gpu_kernel_rounds", &mut || prepared_gpu_kernel_rounds(side, ep, k));
    run("prepared_kernel_triggered", &mut || prepared_kernel_triggered(side, ep, k, false));
    run("prepared_gpu_kernel_triggered", &mut || prepared_kernel_triggered(side, ep, k, true));
    run("prepared_graph", &mut || prepared_graph(side, ep, k, false));
    run("prepared_gpu_graph", &mut || prepared_graph(side, ep, k, true));
    out
}

fn two_roles(role: &str, chan: &dyn Chan, ctx: Context) {
    assert_eq!(role, "peer");
    set_device(device_for(1)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    let staged_ctx = child_ctx_plus(&[("GSC_CUDA_IPC", "off"), ("GSC_CUDA_STAGE_MAX", "64K")]);
    let w2 = staged_ctx.create_worker().unwrap();
    let ep2 = w2.connect(&chan.get("addr2")).unwrap();
    chan.put("ready", w.address());
    chan.put("ready2", w2.address());
    let mut sync = |key: &str| {
        let _ = chan.get(key);
    };
    let results = scenarios(1, (&w, &ep), (&w2, &ep2), &k, &mut sync);
    let text: Vec<String> = results.iter().map(|(n, r)| format!("{n}:{r}")).collect();
    chan.put("results", text.join(";").as_bytes());
    chan.get("bye");
    ep.close().unwrap();
    ep2.close().unwrap();
}

fn child_ctx_plus(extra: &[(&str, &str)]) -> Context {
    let mut o = child_overrides();
    o.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let refs: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    ctx_with(&refs)
}

fn gpu_skip(needed: i32) -> Option<String> {
    if let Some(why) = gpu_test_skip_reason() {
        return Some(why);
    }
    (device_count() < needed).then(|| format!("needs {needed} GPUs, found {}", device_count()))
}

#[test]
fn gpu_buffers_between_two_gpus_ipc_and_staged() {
    if run_child_role(two_roles) {
        return;
    }
    let _gpus = one_at_a_time();
    if let Some(why) = gpu_skip(2) {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    let k = kernels();
    let dir = ShmDir::new("gpu_memory");
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "300s"), ("GSC_CUDA_IPC", "on")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let staged_cfg = [cfg[0], cfg[1], cfg[2], ("GSC_CUDA_IPC", "off"), ("GSC_CUDA_STAGE_MAX", "64K")];
    let w2 = ctx_with(&staged_cfg).create_worker().unwrap();
    let mut p = start_peer(Lane::Shm, "gpu_buffers_between_two_gpus_ipc_and_staged", "peer", &cfg, two_roles);
    p.put("addr", w.address());
    p.put("addr2", w2.address());
    let ep = w.connect(&p.get_progress("ready", T, &w)).unwrap();
    let ep2 = w2.connect(&p.get_progress("ready2", T, &w2)).unwrap();
    let mine = {
        let mut sync = |key: &str| p.put(key, &[]);
        scenarios(0, (&w, &ep), (&w2, &ep2), &k, &mut sync)
    };
    let theirs = String::from_utf8(p.get_progress("results", T, &w)).unwrap();
    eprintln!("side 1: {theirs}");
    for (name, r) in &mine {
        assert!(r.is_empty(), "side 0 {name}: {r}");
    }
    for part in theirs.split(';') {
        let (name, r) = part.split_once(':').unwrap();
        assert!(r.is_empty(), "side 1 {name}: {r}");
    }
    p.put("bye", &[]);
    ep.close().unwrap();
    ep2.close().unwrap();
    let deadline = Instant::now() + T;
    while !p.is_finished() {
        assert!(Instant::now() < deadline, "peer did not finish");
        w.progress();
    }
    p.finish(T);
}

// ---------------------------------------------------------------------------------------------
// The seed's graph broadcast across three GPUs: rank 0 sends to rank 1; rank 1's graph has one
// receive and two sends wired by dependencies (to rank 2, and back to rank 0 so the root checks
// the data too); every replay moves new data.

const BCAST: &[(usize, usize)] = &[(8, 1000), (65_536, 1000), (4 << 20, 100), (256 << 20, 10), (1 << 30, 3)];

fn bcast_rank(rank: u64, w: &Worker, to: &[(u64, &Endpoint)], k: &Kern) -> String {
    let stream = Stream::new().unwrap();
    let mut v = String::new();
    for (i, &(n, replays)) in BCAST.iter().enumerate() {
        let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
        let buf = DeviceBuf::new(n).unwrap();
        let back = DeviceBuf::new(n).unwrap();
        let (nn, t) = (n as u64, 100 * i as u64);
        let g = Graph::new().unwrap();
        let gc = Condition::cuda(Category::Graph, g.raw(), None).unwrap();
        let ep = |r: u64| to.iter().find(|(x, _)| *x == r).unwrap().1;
        let send = |e: &Endpoint, tag: u64| armed(unsafe { e.tag_send_nbx(buf.ptr() as *const u8, n, tag, on(&gc, true)).unwrap() });
        let recv = |b: &DeviceBuf, tag: u64| armed(unsafe { w.tag_recv_nbx(b.ptr() as *mut u8, n, tag, u64::MAX, on(&gc, true)).unwrap() });
        let g_args = |b: &DeviceBuf| [b.ptr(), nn, round.device_ptr(), t, err.device_ptr()];
        match rank {
            0 => {
                let fill = g.add_kernel(k.fill_round, grid(n), 256, &[buf.ptr(), nn, round.device_ptr(), t], &[]).unwrap();
                let s = send(ep(1), t + 1);
                let r = recv(&back, t + 3);
                g.add_dependency(fill, s.start_node).unwrap();
                let bump = g.add_kernel(k.bump, 1, 1, &[round.device_ptr()], &[s.done_node, r.done_node]).unwrap();
                g.add_kernel(k.check_round, grid(n), 256, &g_args(&back), &[bump]).unwrap();
            }
            1 => {
                let r = recv(&buf, t + 1);
                let s2 = send(ep(2), t + 2);
                let s0 = send(ep(0), t + 3);
                g.add_dependency(r.done_node, s2.start_node).unwrap();
                g.add_dependency(r.done_node, s0.start_node).unwrap();
                let bump = g.add_kernel(k.bump, 1, 1, &[round.device_ptr()], &[s2.done_node, s0.done_node]).unwrap();
                // Checked after the bump: the data of round r is for r = round.
                g.add_kernel(k.check_round, grid(n), 256, &g_args(&buf), &[bump]).unwrap();
            }
            _ => {
                let r = recv(&buf, t + 2);
                let bump = g.add_kernel(k.bump, 1, 1, &[round.device_ptr()], &[r.done_node]).unwrap();
                g.add_kernel(k.check_round, grid(n), 256, &g_args(&buf), &[bump]).unwrap();
            }
        }
        let exec = g.instantiate().unwrap();
        let t0 = Instant::now();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let monitor = {
            let (stop, w, round_ptr) = (stop.clone(), w.clone(), round.host_ptr() as usize);
            std::thread::spawn(move || {
                let mut waited = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    waited += 1;
                    if waited % 50 == 0 {
                        // SAFETY (test): a live pinned counter the GPU bumps.
                        let r = unsafe { std::ptr::read_volatile(round_ptr as *const u64) };
                        eprintln!("rank {rank}: {n} B still running after {}s: round {r}, {:?}", waited / 10, w.stats());
                    }
                }
            })
        };
        for i in 0..replays {
            exec.launch(&stream).unwrap();
            if sync_every() > 0 && (i + 1) % sync_every() == 0 {
                stream.synchronize().unwrap();
            }
        }
        stream.synchronize().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        monitor.join().unwrap();
        let dt = t0.elapsed();
        eprintln!("rank {rank}: broadcast {n} B x {replays} replays in {dt:?} ({:.1} us/replay)", dt.as_secs_f64() * 1e6 / replays as f64);
        let (e, r) = (pinned_u64(&err), pinned_u64(&round));
        if e != 0 || r != replays as u64 || gc.query().is_err() {
            v += &format!("[{n} B: errors={e} rounds={r} query={:?}]", gc.query());
        }
    }
    v
}

fn bcast_roles(role: &str, chan: &dyn Chan, ctx: Context) {
    let rank: u64 = role.strip_prefix("rank").unwrap().parse().unwrap();
    set_device(device_for(rank)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    chan.put("addr", w.address());
    let addrs: Vec<Vec<u8>> = (0..3).map(|r| chan.get(&format!("addr{r}"))).collect();
    let targets: &[u64] = if rank == 1 { &[0, 2] } else { &[] };
    let eps: Vec<(u64, Endpoint)> = targets.iter().map(|&r| (r, w.connect(&addrs[r as usize]).unwrap())).collect();
    chan.put("ready", &[]);
    let to: Vec<(u64, &Endpoint)> = eps.iter().map(|(r, e)| (*r, e)).collect();
    let v = bcast_rank(rank, &w, &to, &k);
    chan.put("result", v.as_bytes());
    chan.get("bye");
    for (_, e) in eps {
        e.close().unwrap();
    }
}

#[test]
fn seed_graph_broadcast_across_three_gpus() {
    if run_child_role(bcast_roles) {
        return;
    }
    let _gpus = one_at_a_time();
    if let Some(why) = gpu_skip(3) {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    let k = kernels();
    let dir = ShmDir::new("gpu_bcast");
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "300s"), ("GSC_CUDA_IPC", "on")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let test = "seed_graph_broadcast_across_three_gpus";
    let mut peers = [start_peer(Lane::Shm, test, "rank1", &cfg, bcast_roles), start_peer(Lane::Shm, test, "rank2", &cfg, bcast_roles)];
    let mut addrs = vec![w.address().to_vec()];
    for p in peers.iter_mut() {
        addrs.push(p.get("addr", T));
    }
    for p in peers.iter_mut() {
        for (r, a) in addrs.iter().enumerate() {
            p.put(&format!("addr{r}"), a);
        }
    }
    let ep1 = w.connect(&addrs[1]).unwrap();
    for p in peers.iter_mut() {
        p.get_progress("ready", T, &w);
    }
    let mine = bcast_rank(0, &w, &[(1, &ep1)], &k);
    let mut theirs = Vec::new();
    for p in peers.iter_mut() {
        theirs.push(String::from_utf8(p.get_progress("result", T, &w)).unwrap());
    }
    eprintln!("rank 0: {mine:?}; rank 1: {:?}; rank 2: {:?}", theirs[0], theirs[1]);
    assert!(mine.is_empty(), "rank 0: {mine}");
    assert!(theirs.iter().all(|t| t.is_empty()), "{theirs:?}");
    for p in peers.iter_mut() {
        p.put("bye", &[]);
    }
    ep1.close().unwrap();
    let deadline = Instant::now() + T;
    for p in peers.iter_mut() {
        while !p.is_finished() {
            assert!(Instant::now() < deadline, "peer did not finish");
            w.progress();
        }
        p.finish(T);
    }
}

// ---------------------------------------------------------------------------------------------
// A VMM send buffer (`cuMemCreate`, as PyTorch's expandable segments and NCCL's cuMem allocator
// make them) read by a receiver in another process (on another GPU when there are two) through
// a POSIX file descriptor passed over the sender's Unix socket, not pushed through host memory.

/// (allocation bytes, offset of the sent range in it, bytes sent, sends of that range). The
/// allocation outside the range holds other data, so a wrong offset is caught; the case sent
/// twice checks that a second send reuses the export and the mapping.
const VMM_CASES: &[(usize, usize, usize, u64)] = &[
    (1, 0, 1, 1),
    (8, 0, 8, 1),
    (4095, 0, 4095, 1),
    (65_536, 0, 65_536, 1),
    (1 << 20, 0, 1 << 20, 2),
    (4 << 20, 12_345, 1 << 20, 1),
    ((2 << 20) + 3, 0, (2 << 20) + 3, 1),
    (16 << 20, 0, 16 << 20, 1),
    (64 << 20, 0, 64 << 20, 1),
];

/// Bytes of the last two messages: the first from a VMM allocation, the second from a new
/// allocation mapped at the same address after the first was freed (PyTorch's expandable
/// segments reuse their ranges so). The receiver must read the new memory, and its mapping of
/// the old is unmapped (after a grace of 2 s: `VmmCounters::replaced`), not retired.
const VMM_REPLACED_BYTES: usize = 1 << 20;

/// Then a freed allocation, VMM and legacy (`cuMemAlloc`): one message of this size from it,
/// after which the sender frees it and sends `FREED_LATER` messages of `FREED_LATER_BYTES`
/// from another buffer. Its exports look at a few earlier allocations each and tell the
/// receiver which are gone (`export_life`); the receiver lets go of its mapping of the freed
/// one (a VMM one unmapped, `VmmCounters::freed`; a legacy one closed by
/// `release_retired_peer_mappings`), and the sender gets the memory back.
const FREED_BYTES: usize = 1 << 30;
const FREED_LATER: u64 = 8;
const FREED_LATER_BYTES: usize = 1 << 20;

fn vmm_seed(case: usize, send: u64) -> u64 {
    0x5EED_0000 + 16 * case as u64 + send
}

fn vmm_sends() -> u64 {
    VMM_CASES.iter().map(|c| c.3).sum()
}

/// The receiving process: a plain `cuMemAlloc` buffer per message, checked on its GPU.
fn vmm_receiver(role: &str, chan: &dyn Chan, ctx: Context) {
    assert_eq!(role, "receiver");
    set_device(device_for(1)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("ready", w.address());
    let (stream, err) = (Stream::new().unwrap(), PinnedBuf::new(8).unwrap());
    let before = vmm_counters();
    let (mut problems, mut tag) = (String::new(), 0u64);
    // The cases, then the two messages of the replaced allocation (case `VMM_CASES.len()`), then
    // the freed allocations (VMM, legacy), each a message and the later ones.
    let freed = [(FREED_BYTES, 1), (FREED_LATER_BYTES, FREED_LATER)];
    let receives = VMM_CASES.iter().map(|&(_, _, n, sends)| (n, sends)).chain([(VMM_REPLACED_BYTES, 2)]).chain(freed).chain(freed);
    for (i, (n, sends)) in receives.enumerate() {
        for s in 0..sends {
            let dst = DeviceBuf::new(n).unwrap();
            dst.fill(0xEE).unwrap();
            let started = unsafe { w.tag_recv_nbx(dst.ptr() as *mut u8, n, tag, u64::MAX, RequestParams::default()).unwrap() };
            let c = wait_release(&w, started);
            if c.status != Status::Ok || c.info.length != n {
                problems += &format!("[case {i}, {n} B send {s}: {:?}, {} B]", c.status, c.info.length);
            }
            let e0 = pinned_u64(&err);
            k.check.launch(grid(n), 256, &stream, &[dst.ptr(), n as u64, vmm_seed(i, s), 0, err.device_ptr()]).unwrap();
            stream.synchronize().unwrap();
            if pinned_u64(&err) != e0 {
                problems += &format!("[case {i}, {n} B send {s}: wrong data]");
            }
            tag += 1;
        }
    }
    // The sender's thread finds its frees, and ours unmaps the freed VMM mappings 2 s later (the
    // grace for reads of a round a peer gave up on), with no call of ours: wait (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    while vmm_counters().freed == before.freed && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = vmm_counters();
    // Every stream is idle: a safe point to close retired legacy mappings: the freed legacy
    // allocation's, once the sender has found it freed (replaced and freed VMM mappings were
    // unmapped at once).
    let mut released = Ok(0);
    while let Ok(closed) = released {
        released = release_retired_peer_mappings().map(|n| closed + n).map_err(|e| e.to_string());
        if released.as_ref().is_ok_and(|&n| n >= 1) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = format!(
        "problems={problems};imported={};reads={};replaced={};freed={};released={released:?}",
        after.imported - before.imported,
        after.reads - before.reads,
        after.replaced - before.replaced,
        after.freed - before.freed
    );
    chan.put("results", report.as_bytes());
    chan.get("bye");
    ep.close().unwrap();
}

#[test]
fn vmm_send_buffer_read_by_another_process_through_fd_passing() {
    if run_child_role(vmm_receiver) {
        return;
    }
    let _gpus = one_at_a_time();
    if let Some(why) = gpu_skip(1) {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    eprintln!("sender on GPU {}, receiver on GPU {}", device_for(0), device_for(1));
    let k = kernels();
    let dir = ShmDir::new("gpu_vmm");
    // IPC on: a read through the key that fails is an error, never a silent push.
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "300s"), ("GSC_CUDA_IPC", "on")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let test = "vmm_send_buffer_read_by_another_process_through_fd_passing";
    let mut p = start_peer(Lane::Shm, test, "receiver", &cfg, vmm_receiver);
    p.put("addr", w.address());
    let ep = w.connect(&p.get_progress("ready", T, &w)).unwrap();
    let stream = Stream::new().unwrap();
    let before = vmm_counters();
    let mut tag = 0u64;
    for (i, &(alloc, off, n, sends)) in VMM_CASES.iter().enumerate() {
        let buf = DeviceBuf::new_vmm(alloc).unwrap();
        assert!(buf.is_vmm());
        let src = buf.ptr() + off as u64;
        for s in 0..sends {
            let seed = vmm_seed(i, s);
            k.fill.launch(grid(alloc), 256, &stream, &[buf.ptr(), alloc as u64, !seed]).unwrap();
            k.fill.launch(grid(n), 256, &stream, &[src, n as u64, seed]).unwrap();
            stream.synchronize().unwrap();
            // What the send's RTS will carry: a VMM key, or the reason there is none.
            match ipc_export_kind(src) {
                Ok(kind) => assert_eq!(kind, "vmm", "{alloc} B VMM allocation"),
                Err(e) => panic!("a {alloc} B VMM allocation cannot be shared with another process: {e}"),
            }
            let t0 = Instant::now();
            let started = unsafe { ep.tag_send_nbx(src as *const u8, n, tag, RequestParams::default()).unwrap() };
            let c = wait_release(&w, started);
            assert_eq!(c.status, Status::Ok, "send of {n} B (case {i}, send {s})");
            eprintln!("sender: {n} B from a {alloc} B VMM allocation (+{off}) sent in {:?}", t0.elapsed());
            tag += 1;
        }
    }
    // The replaced allocation: freed after its send completed, then new memory at its address.
    let first = DeviceBuf::new_vmm(VMM_REPLACED_BYTES).unwrap();
    let at = first.ptr();
    let mut replaced = Some(first);
    for s in 0..2 {
        if s == 1 {
            drop(replaced.take());
            let again = DeviceBuf::new_vmm_at(VMM_REPLACED_BYTES, at).unwrap();
            assert_eq!(again.ptr(), at, "the driver did not map the new allocation where the freed one was");
            replaced = Some(again);
        }
        let buf = replaced.as_ref().unwrap();
        k.fill.launch(grid(buf.len()), 256, &stream, &[buf.ptr(), buf.len() as u64, vmm_seed(VMM_CASES.len(), s)]).unwrap();
        stream.synchronize().unwrap();
        let started = unsafe { ep.tag_send_nbx(buf.ptr() as *const u8, buf.len(), tag, RequestParams::default()).unwrap() };
        let c = wait_release(&w, started);
        assert_eq!(c.status, Status::Ok, "send {s} of the replaced allocation");
        tag += 1;
    }
    // The freed allocations: VMM, then legacy. The sender's free memory is read while each big
    // one is allocated; once the receiver let go of them, it must have that memory back.
    let mut send = |buf: &DeviceBuf, case: usize, s: u64| {
        k.fill.launch(grid(buf.len()), 256, &stream, &[buf.ptr(), buf.len() as u64, vmm_seed(case, s)]).unwrap();
        stream.synchronize().unwrap();
        let started = unsafe { ep.tag_send_nbx(buf.ptr() as *const u8, buf.len(), tag, RequestParams::default()).unwrap() };
        let c = wait_release(&w, started);
        assert_eq!(c.status, Status::Ok, "send {s} of case {case}");
        tag += 1;
    };
    // The baseline: nothing of this part allocated yet (the receiver's buffers of earlier
    // messages were freed when it read them).
    let free_before = mem_get_info().unwrap().0;
    let (mut free_with_big, mut kept) = (Vec::new(), Vec::new());
    for (vmm, case) in [(true, VMM_CASES.len() + 1), (false, VMM_CASES.len() + 3)] {
        let alloc = |n| if vmm { DeviceBuf::new_vmm(n) } else { DeviceBuf::new(n) }.unwrap();
        let big = alloc(FREED_BYTES);
        // Made before the big one is freed, so that it cannot take its addresses (the receiver
        // would then let go of the big one as replaced), and kept until the receiver has
        // reported: the big ones are the only allocations freed here.
        let later = alloc(FREED_LATER_BYTES);
        send(&big, case, 0);
        free_with_big.push(mem_get_info().unwrap().0);
        drop(big);
        for s in 0..FREED_LATER {
            send(&later, case + 1, s);
        }
        kept.push(later);
    }
    let exported = vmm_counters().exported - before.exported;
    let theirs = String::from_utf8(p.get_progress("results", T, &w)).unwrap();
    eprintln!("receiver: {theirs}");
    let field =
        |name: &str| theirs.split(';').find_map(|f| f.strip_prefix(&format!("{name}="))).unwrap_or_else(|| panic!("no {name} in {theirs}"));
    assert_eq!(field("problems"), "", "receiver");
    let allocations = VMM_CASES.len() as u64 + 4;
    assert_eq!(exported, allocations, "one export per VMM allocation (a repeated send reuses it)");
    assert_eq!(field("imported"), allocations.to_string(), "one import per allocation: the data was read through the VMM mapping");
    let reads = vmm_sends() + 2 + 1 + FREED_LATER;
    assert_eq!(field("reads"), reads.to_string(), "every message read through a VMM mapping, none pushed through host memory");
    // At least the one made here; earlier cases' allocations may have reused a range too.
    assert!(field("replaced").parse::<u64>().unwrap() >= 1, "the mapping of the replaced allocation was not unmapped: {theirs}");
    // The big one at least; earlier cases' allocations too unless the driver reused their ranges
    // first (then they count as replaced).
    assert!(field("freed").parse::<u64>().unwrap() >= 1, "no mapping of a freed VMM allocation was unmapped: {theirs}");
    assert_eq!(field("released"), "Ok(1)", "VMM mappings are unmapped, the freed legacy one retired and closed: {theirs}");
    // Both big allocations' memory must come back (the receiver unmaps the VMM one by itself
    // after a grace of 2 s, and closed the legacy one before it reported): all but the later
    // buffers' few MiB and some slack for the driver, within a bound.
    let slack = 64 << 20;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut free_now = mem_get_info().unwrap().0;
    while free_now + slack < free_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        free_now = mem_get_info().unwrap().0;
    }
    eprintln!("sender: free memory {free_before} before, {free_with_big:?} with each big allocation, {free_now} after the receiver let go");
    assert!(
        free_now + slack >= free_before,
        "the freed allocations' memory did not come back: {free_now} free now, {free_before} before them ({free_with_big:?} with each)"
    );
    p.put("bye", &[]);
    ep.close().unwrap();
    let deadline = Instant::now() + T;
    while !p.is_finished() {
        assert!(Instant::now() < deadline, "receiver did not finish");
        w.progress();
    }
    p.finish(T);
}

// ---------------------------------------------------------------------------------------------
// Prepared transfers around a ring of four GPUs: each rank sends to the next and receives from
// the previous one, a captured iteration (fill, receive, send, wait, check) replayed
// GRAPH_ROUNDS times with new data each time, through the proxy and with GPU rounds.

const RING: u64 = 4;

fn ring_rank(rank: u64, w: &Worker, next: &Endpoint, prev: &Endpoint, k: &Kern) -> String {
    let mut out = String::new();
    for gpu_rounds in [false, true] {
        let stream = Stream::new().unwrap();
        let cap = Stream::new().unwrap();
        let (err, round) = (PinnedBuf::new(8).unwrap(), PinnedBuf::new(8).unwrap());
        let (src, dst) = (DeviceBuf::new(ROUND_BYTES).unwrap(), DeviceBuf::new(ROUND_BYTES).unwrap());
        let n = ROUND_BYTES as u64;
        let (tx, rx) = prepare_pair(next, prev, &src, &dst, ROUND_BYTES, 300 + gpu_rounds as u64, gpu_rounds);
        let cond = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
        if gpu_rounds {
            // Pairing and mapping at the first start, outside the capture.
            let warm = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
            warm.group_start().unwrap();
            rx.start(on(&warm, false)).unwrap();
            tx.start(on(&warm, false)).unwrap();
            warm.wait().unwrap();
            warm.group_end().unwrap();
            stream.synchronize().unwrap();
        }
        cap.begin_capture().unwrap();
        k.fill_round.launch(grid(ROUND_BYTES), 256, &cap, &[src.ptr(), n, round.device_ptr(), rank]).unwrap();
        cond.group_start().unwrap();
        let r = rx.start(on(&cond, false)).unwrap();
        let s = tx.start(on(&cond, false)).unwrap();
        cond.wait().unwrap();
        cond.group_end().unwrap();
        k.bump.launch(1, 1, &cap, &[round.device_ptr()]).unwrap();
        let from = (rank + RING - 1) % RING;
        k.check_round.launch(grid(ROUND_BYTES), 256, &cap, &[dst.ptr(), n, round.device_ptr(), from, err.device_ptr()]).unwrap();
        let exec = cap.end_capture().unwrap().instantiate().unwrap();
        let t0 = Instant::now();
        for _ in 0..graph_rounds() {
            exec.launch(&stream).unwrap();
        }
        stream.synchronize().unwrap();
        eprintln!(
            "rank {rank}: ring, gpu_rounds={gpu_rounds}: {} replays, {:.1} us/replay",
            graph_rounds(),
            t0.elapsed().as_secs_f64() * 1e6 / graph_rounds() as f64
        );
        let _ = (r, s, w);
        let mut v = verdict(&[], pinned_u64(&err));
        if pinned_u64(&round) != graph_rounds() as u64 || cond.query().is_err() {
            v += &format!(" rounds={} query={:?}", pinned_u64(&round), cond.query());
        }
        if gpu_rounds && (tx.gpu_error().ok() != Some(0) || rx.gpu_error().ok() != Some(0)) {
            v += &format!(" gpu_error={:?}/{:?}", tx.gpu_error(), rx.gpu_error());
        }
        if !v.is_empty() {
            out += &format!("gpu_rounds={gpu_rounds}: {v}; ");
        }
        drop((tx, rx));
    }
    out
}

fn ring_roles(role: &str, chan: &dyn Chan, ctx: Context) {
    let rank: u64 = role.strip_prefix("rank").unwrap().parse().unwrap();
    set_device(device_for(rank)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    chan.put("addr", w.address());
    let addrs: Vec<Vec<u8>> = (0..RING).map(|r| chan.get(&format!("addr{r}"))).collect();
    let next = w.connect(&addrs[((rank + 1) % RING) as usize]).unwrap();
    let prev = w.connect(&addrs[((rank + RING - 1) % RING) as usize]).unwrap();
    chan.put("ready", &[]);
    let v = ring_rank(rank, &w, &next, &prev, &k);
    chan.put("result", v.as_bytes());
    chan.get("bye");
    next.close().unwrap();
    prev.close().unwrap();
}

#[test]
fn prepared_ring_across_four_gpus() {
    if run_child_role(ring_roles) {
        return;
    }
    let _gpus = one_at_a_time();
    if let Some(why) = gpu_skip(RING as i32) {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    let k = kernels();
    let dir = ShmDir::new("gpu_ring");
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "60s")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let test = "prepared_ring_across_four_gpus";
    let mut peers: Vec<Peer> = (1..RING).map(|r| start_peer(Lane::Shm, test, &format!("rank{r}"), &cfg, ring_roles)).collect();
    let mut addrs = vec![w.address().to_vec()];
    for p in peers.iter_mut() {
        addrs.push(p.get("addr", T));
    }
    for p in peers.iter_mut() {
        for (r, a) in addrs.iter().enumerate() {
            p.put(&format!("addr{r}"), a);
        }
    }
    let next = w.connect(&addrs[1]).unwrap();
    let prev = w.connect(&addrs[RING as usize - 1]).unwrap();
    for p in peers.iter_mut() {
        p.get_progress("ready", T, &w);
    }
    let mine = ring_rank(0, &w, &next, &prev, &k);
    let mut theirs = Vec::new();
    for p in peers.iter_mut() {
        theirs.push(String::from_utf8(p.get_progress("result", T, &w)).unwrap());
    }
    assert!(mine.is_empty(), "rank 0: {mine}");
    assert!(theirs.iter().all(|t| t.is_empty()), "{theirs:?}");
    for p in peers.iter_mut() {
        p.put("bye", &[]);
    }
    next.close().unwrap();
    prev.close().unwrap();
    let deadline = Instant::now() + T;
    for p in peers.iter_mut() {
        while !p.is_finished() {
            assert!(Instant::now() < deadline, "peer did not finish");
            w.progress();
        }
        p.finish(T);
    }
}

// ---------------------------------------------------------------------------------------------
// gscomm's own allocator (`gscomm::mem_alloc`, what `ncclMemAlloc` returns) between two
// processes, with the seed's rule of one large allocation carved into send and receive buffers:
// each side makes one VMM allocation, sends from messages at several offsets of its first part
// and receives into the same offsets of its second part. Every message is read by the peer
// through its one mapping of the whole allocation (imported once), none pushed through host
// memory; then the allocation is freed and a second free is refused.

/// (offset in the send and in the receive part, bytes)
const CARVED: &[(usize, usize)] = &[(0, 8), (4096, 65_536), (12_345, 1 << 20), (0, 4 << 20), ((1 << 20) + 7, (3 << 20) + 1)];
/// Bytes of each part; the receive part starts 64 bytes past the end of the send part, so its
/// buffers are not aligned to the allocation granularity.
const CARVED_PART: usize = 8 << 20;
const CARVED_RECV_AT: usize = CARVED_PART + 64;

fn carved_seed(side: u64, case: usize) -> u64 {
    0xCA2E_0000 + 16 * case as u64 + side
}

/// One side: allocate, exchange every `CARVED` message with the peer, free. Returns problems
/// ("" when none) and this side's counter deltas.
fn carved_side(side: u64, w: &Worker, ep: &Endpoint, k: &Kern, sync: &mut dyn FnMut(&str)) -> String {
    let (stream, err) = (Stream::new().unwrap(), PinnedBuf::new(8).unwrap());
    let live_before = gscomm::cuda::api::mem_alloc_live();
    let total = CARVED_RECV_AT + CARVED_PART;
    let base = gscomm::mem_alloc(total).unwrap();
    let (send, recv) = (base, base + CARVED_RECV_AT as u64);
    let mut problems = String::new();
    let info = gscomm::mem_alloc_info(recv + 5).expect("mem_alloc knows its allocation");
    if (info.base, info.offset, info.bytes, info.device) != (base, CARVED_RECV_AT as u64 + 5, total, device_for(side)) {
        problems += &format!("[info {info:?}]");
    }
    if !info.vmm {
        problems += "[not VMM memory: the device lacks VMM or POSIX-fd handles (see the log)]";
    }
    if info.mapped < total {
        problems += &format!("[{} B mapped for {total} B]", info.mapped);
    }
    let before = vmm_counters();
    for (i, &(off, n)) in CARVED.iter().enumerate() {
        let (src, dst) = (send + off as u64, recv + off as u64);
        // Junk around and in the receive range, this round's data in the send range.
        k.fill.launch(grid(CARVED_PART), 256, &stream, &[recv, CARVED_PART as u64, !carved_seed(side, i)]).unwrap();
        k.fill.launch(grid(n), 256, &stream, &[src, n as u64, carved_seed(side, i)]).unwrap();
        stream.synchronize().unwrap();
        match ipc_export_kind(src) {
            Ok("vmm") => {}
            other => problems += &format!("[{n} B at +{off}: exported as {other:?}]"),
        }
        sync(&format!("filled{i}"));
        let tag = i as u64;
        let r = unsafe { w.tag_recv_nbx(dst as *mut u8, n, tag, u64::MAX, RequestParams::default()).unwrap() };
        let s = unsafe { ep.tag_send_nbx(src as *const u8, n, tag, RequestParams::default()).unwrap() };
        let (cs, cr) = (wait_release(w, s), wait_release(w, r));
        if cs.status != Status::Ok || cr.status != Status::Ok || cr.info.length != n {
            problems += &format!("[{n} B at +{off}: send {:?}, recv {:?} {} B]", cs.status, cr.status, cr.info.length);
        }
        let e0 = pinned_u64(&err);
        k.check.launch(grid(n), 256, &stream, &[dst, n as u64, carved_seed(1 - side, i), 0, err.device_ptr()]).unwrap();
        stream.synchronize().unwrap();
        if pinned_u64(&err) != e0 {
            problems += &format!("[{n} B at +{off}: wrong data]");
        }
    }
    let after = vmm_counters();
    // The peer has read everything it will read from us (its receives are done) before we free.
    sync("exchanged");
    // SAFETY: every transfer on the allocation is complete and the stream is idle.
    if let Err(e) = unsafe { gscomm::mem_free(base) } {
        problems += &format!("[free: {e}]");
    }
    // SAFETY: refused before any driver call (a double free).
    match unsafe { gscomm::mem_free(base) } {
        Err(e) if e.status() == Status::InvalidParam && e.message().contains("double free") => {}
        other => problems += &format!("[second free: {other:?}]"),
    }
    if gscomm::mem_alloc_info(send).is_some() || gscomm::cuda::api::mem_alloc_live() != live_before {
        problems += "[the allocation is still booked after its free]";
    }
    format!(
        "problems={problems};exported={};imported={};reads={}",
        after.exported - before.exported,
        after.imported - before.imported,
        after.reads - before.reads
    )
}

fn carved_peer(role: &str, chan: &dyn Chan, ctx: Context) {
    assert_eq!(role, "peer");
    set_device(device_for(1)).unwrap();
    let k = kernels();
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("ready", w.address());
    let mut sync = |key: &str| {
        let _ = chan.get(key);
    };
    let report = carved_side(1, &w, &ep, &k, &mut sync);
    chan.put("results", report.as_bytes());
    chan.get("bye");
    ep.close().unwrap();
}

#[test]
fn mem_alloc_carved_into_send_and_receive_buffers_between_two_processes() {
    if run_child_role(carved_peer) {
        return;
    }
    let _gpus = one_at_a_time();
    if let Some(why) = gpu_skip(1) {
        eprintln!("skipped: {why}");
        return;
    }
    set_device(device_for(0)).unwrap();
    eprintln!("side 0 on GPU {}, side 1 on GPU {}", device_for(0), device_for(1));
    let k = kernels();
    let dir = ShmDir::new("gpu_carved");
    // IPC on: a read through the key that fails is an error, never a silent push.
    let cfg = [("GSC_TLS", "shm"), ("GSC_SHM_DIR", dir.as_str()), ("GSC_TIMEOUT", "300s"), ("GSC_CUDA_IPC", "on")];
    let w = ctx_with(&cfg).create_worker().unwrap();
    let test = "mem_alloc_carved_into_send_and_receive_buffers_between_two_processes";
    let mut p = start_peer(Lane::Shm, test, "peer", &cfg, carved_peer);
    p.put("addr", w.address());
    let ep = w.connect(&p.get_progress("ready", T, &w)).unwrap();
    let mine = {
        let mut sync = |key: &str| p.put(key, &[]);
        carved_side(0, &w, &ep, &k, &mut sync)
    };
    let theirs = String::from_utf8(p.get_progress("results", T, &w)).unwrap();
    eprintln!("side 0: {mine}\nside 1: {theirs}");
    for (who, report) in [("side 0", &mine), ("side 1", &theirs)] {
        let field = |name: &str| {
            report.split(';').find_map(|f| f.strip_prefix(&format!("{name}="))).unwrap_or_else(|| panic!("no {name} in {report}"))
        };
        assert_eq!(field("problems"), "", "{who}");
        assert_eq!(field("exported"), "1", "{who}: one export for the whole allocation, whatever the offsets");
        assert_eq!(field("imported"), "1", "{who}: the peer's allocation mapped once for every carved buffer");
        assert_eq!(field("reads"), CARVED.len().to_string(), "{who}: every message read through the VMM mapping, none pushed");
    }
    p.put("bye", &[]);
    ep.close().unwrap();
    let deadline = Instant::now() + T;
    while !p.is_finished() {
        assert!(Instant::now() < deadline, "peer did not finish");
        w.progress();
    }
    p.finish(T);
}

//! `staged-bw`: one-way tag bandwidth of GPU buffers and of host buffers over the same link, in
//! one run, so the host-staging pipeline (GPU → page-locked host → lane → page-locked host →
//! GPU, src/core/staging.rs) can be read against the plain host transfer it is built on.
//!
//! Two processes: this one sends from GPU `--gpus A,B`'s A (or host memory), the peer it starts
//! receives into B. Each iteration the sender posts a window (`-W`) of sends, the receiver a
//! window of receives, then the receiver acknowledges; time per iteration from the sender's
//! side. Columns as nccl-tests prints them: size, count and type (bytes, uint8), then per
//! memory kind time (µs per message), algbw (GB/s) and `#wrong` (bytes of the last
//! iteration's receive that differ from what was sent, checked on every message of the
//! window). busbw equals algbw for point-to-point, so it is not repeated.
//!
//! Which lane runs is the worker's choice (`GSC_TLS`): `GSC_TLS=ucx` forces UCX, and the
//! header line names the lane. Without a GPU (or CUDA) the GPU column says why and the host
//! column is still measured.

use crate::host::{ncpus, pin_to, wait};
use crate::{Control, Sweep, config, die, hex, parse_size, spawn_peer, unhex};
use gscomm::cuda::api::{DeviceBuf, device_count, set_device};
use gscomm::protocols::MemType;
use gscomm::{Context, Endpoint, RequestParams, Started, Worker};
use std::time::Instant;

const TAG_DATA: u64 = 21;
const TAG_ACK: u64 = 22;

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    sweep: Sweep,
    window: usize,
    gpus: (i32, i32),
    pin: bool,
    /// Which memory kinds to measure, in order.
    kinds: Vec<MemType>,
}

pub(crate) fn parse_args(args: &[String]) -> Option<Opts> {
    let mut o = Opts {
        sweep: Sweep { min: 64 << 10, max: 64 << 20, factor: 4, iters: 20, warmup: 2 },
        window: 4,
        gpus: (0, 1),
        pin: true,
        kinds: vec![MemType::Cuda, MemType::Host],
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned();
        if o.sweep.apply(a, &mut val)? {
            continue;
        }
        match a.as_str() {
            "-W" => o.window = parse_size(&val()?).max(1),
            "--gpus" => {
                let v = val()?;
                let (a, b) = v.split_once(',')?;
                o.gpus = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            }
            "--no-pin" => o.pin = false,
            "--mem" => {
                o.kinds = val()?
                    .split(',')
                    .map(|k| match k.trim() {
                        "cuda" | "gpu" => Some(MemType::Cuda),
                        "host" => Some(MemType::Host),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?;
            }
            _ => return None,
        }
    }
    Some(o)
}

/// The byte at `i` of message `k` of a window (different per message, so a message written
/// into the wrong buffer is counted wrong).
fn pattern(k: usize, i: usize) -> u8 {
    (i.wrapping_mul(131) ^ k.wrapping_mul(17) ^ (i >> 12)) as u8
}

/// One message buffer: GPU memory or host memory.
enum Buf {
    Gpu(DeviceBuf),
    Host(Vec<u8>),
}

impl Buf {
    fn new(kind: MemType, len: usize) -> Buf {
        match kind {
            MemType::Cuda => Buf::Gpu(DeviceBuf::new(len.max(1)).unwrap_or_else(|e| die("cuMemAlloc", e))),
            MemType::Host => Buf::Host(vec![0u8; len.max(1)]),
        }
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            Buf::Gpu(d) => d.ptr() as usize as *mut u8,
            Buf::Host(v) => v.as_mut_ptr(),
        }
    }

    fn set(&mut self, data: &[u8]) {
        match self {
            Buf::Gpu(d) => d.upload(data).unwrap_or_else(|e| die("upload", e)),
            Buf::Host(v) => v[..data.len()].copy_from_slice(data),
        }
    }

    fn get(&self, len: usize) -> Vec<u8> {
        match self {
            Buf::Gpu(d) => d.download().unwrap_or_else(|e| die("download", e))[..len].to_vec(),
            Buf::Host(v) => v[..len].to_vec(),
        }
    }
}

fn params(kind: MemType) -> RequestParams {
    RequestParams { memory_type: Some(kind), ..RequestParams::default() }
}

/// Why GPU buffers cannot be measured in this process, if they cannot.
fn gpu_unavailable(device: i32) -> Option<String> {
    if let Err(e) = gscomm::cuda::init() {
        return Some(format!("no CUDA ({e})"));
    }
    let n = device_count();
    if device >= n {
        return Some(format!("GPU {device} asked for, {n} present"));
    }
    set_device(device).err().map(|e| format!("GPU {device}: {e}"))
}

/// One size and kind; returns seconds for `iters` timed iterations and the wrong bytes of the
/// last one (receiver's count, sent back in the acknowledgement).
fn run(o: &Opts, w: &Worker, ep: &Endpoint, size: usize, kind: MemType, sender: bool) -> (f64, u64) {
    let mut bufs: Vec<Buf> = (0..o.window).map(|_| Buf::new(kind, size)).collect();
    let mut ack = [0u8; 8];
    if sender {
        for (k, b) in bufs.iter_mut().enumerate() {
            b.set(&(0..size).map(|i| pattern(k, i)).collect::<Vec<u8>>());
        }
    }
    let total = o.sweep.warmup + o.sweep.iters;
    let mut start = Instant::now();
    let mut wrong = 0u64;
    for it in 0..total {
        if it == o.sweep.warmup {
            start = Instant::now();
        }
        if sender {
            let reqs: Vec<Started> = bufs
                .iter_mut()
                .map(|b| {
                    // SAFETY: every request is waited for before the buffer is touched again.
                    unsafe { ep.tag_send_nbx(b.ptr(), size, TAG_DATA, params(kind)) }.unwrap_or_else(|e| die("tag_send_nbx", e))
                })
                .collect();
            for r in reqs {
                wait(w, r);
            }
            // SAFETY: waited for at once.
            let r = unsafe { w.tag_recv_nbx(ack.as_mut_ptr(), ack.len(), TAG_ACK, u64::MAX, RequestParams::default()) }
                .unwrap_or_else(|e| die("tag_recv_nbx", e));
            wait(w, r);
            wrong = u64::from_le_bytes(ack);
        } else {
            let reqs: Vec<Started> = bufs
                .iter_mut()
                .map(|b| {
                    // SAFETY: as above.
                    unsafe { w.tag_recv_nbx(b.ptr(), size, TAG_DATA, u64::MAX, params(kind)) }.unwrap_or_else(|e| die("tag_recv_nbx", e))
                })
                .collect();
            for r in reqs {
                wait(w, r);
            }
            if it + 1 == total {
                // Checked once, after the timed part: downloading is not part of the transfer.
                wrong = bufs
                    .iter()
                    .enumerate()
                    .map(|(k, b)| b.get(size).iter().enumerate().filter(|&(i, &x)| x != pattern(k, i)).count() as u64)
                    .sum();
            }
            ack = wrong.to_le_bytes();
            // SAFETY: waited for at once.
            let r = unsafe { ep.tag_send_nbx(ack.as_ptr(), ack.len(), TAG_ACK, RequestParams::default()) }
                .unwrap_or_else(|e| die("tag_send_nbx", e));
            wait(w, r);
        }
    }
    (start.elapsed().as_secs_f64(), wrong)
}

fn setup() -> Worker {
    let ctx = Context::new(config()).unwrap_or_else(|e| die("context", e));
    ctx.create_worker().unwrap_or_else(|e| die("worker", e))
}

/// The kinds both sides measure: GPU only where both have one (agreed over the control channel).
fn agree(o: &Opts, mine: &Option<String>, ctl: &mut Control, theirs_first: bool) -> (Vec<MemType>, Option<String>) {
    let send_mine = |ctl: &mut Control| ctl.send("GPU", mine.as_deref().unwrap_or("ok"));
    let theirs = if theirs_first {
        let t = ctl.expect("GPU");
        send_mine(ctl);
        t
    } else {
        send_mine(ctl);
        ctl.expect("GPU")
    };
    let why = mine.clone().or(if theirs == "ok" { None } else { Some(format!("peer: {theirs}")) });
    let kinds = o.kinds.iter().copied().filter(|k| *k == MemType::Host || why.is_none()).collect();
    (kinds, why)
}

pub(crate) fn server(o: &Opts) {
    if o.pin {
        pin_to(1 % ncpus());
    }
    let mine = if o.kinds.contains(&MemType::Cuda) { gpu_unavailable(o.gpus.1) } else { None };
    let w = setup();
    let mut ctl = Control::of_parent();
    ctl.send("ADDR", &hex(w.address()));
    let peer = ctl.expect("ADDR");
    let ep = w.connect(&unhex(&peer)).unwrap_or_else(|e| die("connect", e));
    let (kinds, _) = agree(o, &mine, &mut ctl, true);
    for size in o.sweep.sizes() {
        for &k in &kinds {
            run(o, &w, &ep, size, k, false);
        }
    }
    let _ = ep.close();
}

pub(crate) fn client(o: &Opts, args: &[String]) {
    if o.pin {
        pin_to(0);
    }
    let mine = if o.kinds.contains(&MemType::Cuda) { gpu_unavailable(o.gpus.0) } else { None };
    let (mut child, mut ctl) = spawn_peer(args);
    let w = setup();
    let ep = w.connect(&unhex(&ctl.expect("ADDR"))).unwrap_or_else(|e| die("connect", e));
    ctl.send("ADDR", &hex(w.address()));
    let (kinds, why) = agree(o, &mine, &mut ctl, false);
    let lane = ep.lane().map(|l| l.name()).unwrap_or("?");
    let cfg = w.context().config();
    println!(
        "# gsc-bench staged-bw | gscomm {} | lane {} | GPUs {} -> {} | GSC_CUDA_PIPELINE_CHUNK={} DEPTH={} GSC_UCX_MAX_FRAME={} | {} iters, {} warmup, window {}",
        gscomm::VERSION,
        lane,
        o.gpus.0,
        o.gpus.1,
        cfg.cuda_pipeline_chunk,
        cfg.cuda_pipeline_depth,
        cfg.ucx_max_frame,
        o.sweep.iters,
        o.sweep.warmup,
        o.window
    );
    if let Some(why) = &why
        && o.kinds.contains(&MemType::Cuda)
    {
        println!("# GPU buffers skipped: {why}");
    }
    let mut head = format!("{:>12} {:>12} {:>6}", "size", "count", "type");
    for k in &o.kinds {
        let name = if *k == MemType::Cuda { "gpu" } else { "host" };
        head += &format!(" | {:>10} {:>9} {:>7}", format!("{name} us"), "algbw", "#wrong");
    }
    if o.kinds.len() == 2 {
        head += &format!(" | {:>9}", "gpu/host");
    }
    println!("{head}");
    for size in o.sweep.sizes() {
        let mut line = format!("{size:>12} {size:>12} {:>6}", "uint8");
        let mut bw = Vec::new();
        for k in &o.kinds {
            if !kinds.contains(k) {
                line += &format!(" | {:>10} {:>9} {:>7}", "n/a", "", "");
                bw.push(None);
                continue;
            }
            let (secs, wrong) = run(o, &w, &ep, size, *k, true);
            let msgs = (o.sweep.iters * o.window) as f64;
            let us = secs / msgs * 1e6;
            let algbw = size as f64 * msgs / secs / 1e9;
            line += &format!(" | {us:>10.1} {algbw:>9.2} {wrong:>7}");
            bw.push(Some(algbw));
        }
        if let [Some(g), Some(h)] = bw[..] {
            line += &format!(" | {:>9.2}", g / h);
        } else if o.kinds.len() == 2 {
            line += &format!(" | {:>9}", "");
        }
        println!("{line}");
    }
    let _ = ep.close();
    let _ = child.wait();
    println!("# algbw in GB/s (10^9 B/s), one way; gpu/host: the staged GPU transfer's share of the host one over the same lane");
}

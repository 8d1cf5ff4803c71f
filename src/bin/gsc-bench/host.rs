//! Host point-to-point between two processes: tag-lat and tag-bw, optionally beside UCX's
//! ucx_perftest on the same sizes.

use crate::{Control, Sweep, config, die, hex, parse_size, spawn_peer, unhex};
use gscomm::{Context, Endpoint, RequestParams, Started, Worker};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Test {
    Lat,
    Bw,
}

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    test: Test,
    sweep: Sweep,
    window: usize,
    ucx: bool,
    pin: bool,
    /// tag-lat: also time a prepared (persistent) ping-pong of each size, in the same run.
    prepared: bool,
    /// tag-bw: a buffer per message of the window instead of one shared buffer.
    buffer_per_send: bool,
}

const TAG_DATA: u64 = 1;
const TAG_ACK: u64 = 2;

pub(crate) fn parse_args(args: &[String]) -> Option<Opts> {
    let test = match args.first().map(String::as_str) {
        Some("tag-lat") => Test::Lat,
        Some("tag-bw") => Test::Bw,
        _ => return None,
    };
    let mut o = Opts {
        test,
        sweep: Sweep {
            min: 8,
            max: 4 << 20,
            factor: 2,
            iters: if test == Test::Lat { 10_000 } else { 200 },
            warmup: if test == Test::Lat { 1000 } else { 20 },
        },
        window: 32,
        ucx: false,
        pin: true,
        prepared: false,
        buffer_per_send: false,
    };
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned();
        if o.sweep.apply(a, &mut val)? {
            continue;
        }
        match a.as_str() {
            "-W" => o.window = parse_size(&val()?).max(1),
            "--ucx" => o.ucx = true,
            "--no-pin" => o.pin = false,
            "--prepared" if test == Test::Lat => o.prepared = true,
            "--buffer-per-send" if test == Test::Bw => o.buffer_per_send = true,
            _ => return None,
        }
    }
    Some(o)
}

pub(crate) fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call only
    // affects the calling thread's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Online CPUs of the machine. Not `available_parallelism`: that follows the affinity mask, and
/// the peer process inherits the mask of a client that already pinned itself.
pub(crate) fn ncpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as usize } else { 1 }
}

/// Wait for a pending request by spinning on progress (no yields: this is a benchmark).
pub(crate) fn wait(w: &Worker, s: Started) {
    if let Started::Pending(h) = s {
        loop {
            match w.progress_and_test(h) {
                Ok((_, Some(c))) => {
                    if c.status != gscomm::Status::Ok {
                        die("request failed", c.status);
                    }
                    break;
                }
                Ok((_, None)) => {}
                Err(e) => die("progress_and_test", e),
            }
        }
        let _ = w.request_release(h);
    }
}

fn recv_nb(w: &Worker, buf: &mut [u8], tag: u64) -> Started {
    // SAFETY: every caller waits for the request before the buffer is touched or dropped.
    unsafe { w.tag_recv_nbx(buf.as_mut_ptr(), buf.len(), tag, u64::MAX, RequestParams::default()) }
        .unwrap_or_else(|e| die("tag_recv_nbx", e))
}

fn send_nb(ep: &Endpoint, buf: &[u8], tag: u64) -> Started {
    // SAFETY: as for recv_nb.
    unsafe { ep.tag_send_nbx(buf.as_ptr(), buf.len(), tag, RequestParams::default()) }.unwrap_or_else(|e| die("tag_send_nbx", e))
}

/// The prepared ping-pong of one size: each side prepares a send and a receive once, then
/// every iteration is one round of each. Returns seconds for `iters` iterations.
fn run_prepared(o: &Opts, w: &Worker, ep: &Endpoint, size: usize, client: bool) -> f64 {
    use gscomm::{Direction, PrepareParams};
    let (mut sbuf, mut rbuf) = (vec![0x5Au8; size], vec![0u8; size]);
    let (out_tag, in_tag) = if client { (11, 12) } else { (12, 11) };
    let p = |dir, tag| PrepareParams { dir, tag, partitions: None, memory_type: None, engine: gscomm::Engine::Auto };
    // SAFETY: both buffers outlive the preparations (dropped at the end of this function, after
    // the last round was waited for).
    let (tx, rx) = unsafe {
        (
            ep.prepare(sbuf.as_mut_ptr(), size, p(Direction::Send, out_tag)).unwrap_or_else(|e| die("prepare", e)),
            ep.prepare(rbuf.as_mut_ptr(), size, p(Direction::Recv, in_tag)).unwrap_or_else(|e| die("prepare", e)),
        )
    };
    let start_round = |x: &gscomm::Prepared| x.start(RequestParams::default()).unwrap_or_else(|e| die("prepared start", e));
    let mut start = Instant::now();
    for i in 0..o.sweep.warmup + o.sweep.iters {
        if i == o.sweep.warmup {
            start = Instant::now();
        }
        if client {
            let r = start_round(&rx);
            wait(w, start_round(&tx));
            wait(w, r);
        } else {
            let r = start_round(&rx);
            wait(w, r);
            wait(w, start_round(&tx));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The peer may still need our progress to finish its last round before both release.
    drop((tx, rx));
    secs
}

/// One measured size. Returns seconds for `iters` iterations (client side).
fn run_size(o: &Opts, w: &Worker, ep: &Endpoint, size: usize, client: bool) -> f64 {
    let mut buf = vec![0x5Au8; size.max(1)];
    let buf = &mut buf[..size];
    let mut ack = [0u8; 1];
    let total = o.sweep.warmup + o.sweep.iters;
    let mut start = Instant::now();
    match o.test {
        Test::Lat => {
            for i in 0..total {
                if i == o.sweep.warmup {
                    start = Instant::now();
                }
                if client {
                    let r = recv_nb(w, buf, TAG_DATA);
                    wait(w, send_nb(ep, buf, TAG_DATA));
                    wait(w, r);
                } else {
                    let r = recv_nb(w, buf, TAG_DATA);
                    wait(w, r);
                    wait(w, send_nb(ep, buf, TAG_DATA));
                }
            }
        }
        Test::Bw => {
            // ucx_perftest sends the whole window from one buffer and receives it into one; so
            // do we by default, so that both measure the same cache behaviour.
            let mut bufs: Vec<Vec<u8>> = (0..if o.buffer_per_send { o.window } else { 1 }).map(|_| vec![0x5Au8; size]).collect();
            for i in 0..total {
                if i == o.sweep.warmup {
                    start = Instant::now();
                }
                if client {
                    let reqs: Vec<Started> = (0..o.window).map(|k| send_nb(ep, &bufs[k % bufs.len()], TAG_DATA)).collect();
                    for r in reqs {
                        wait(w, r);
                    }
                    wait(w, recv_nb(w, &mut ack, TAG_ACK));
                } else {
                    let n = bufs.len();
                    let reqs: Vec<Started> = (0..o.window).map(|k| recv_nb(w, &mut bufs[k % n], TAG_DATA)).collect();
                    for r in reqs {
                        wait(w, r);
                    }
                    wait(w, send_nb(ep, &ack, TAG_ACK));
                }
            }
        }
    }
    start.elapsed().as_secs_f64()
}

fn setup() -> Worker {
    let ctx = Context::new(config()).unwrap_or_else(|e| die("context", e));
    ctx.create_worker().unwrap_or_else(|e| die("worker", e))
}

/// The peer process: swap addresses, then serve every size in the same order as the client.
pub(crate) fn server(o: &Opts) {
    if o.pin {
        pin_to(1 % ncpus());
    }
    let w = setup();
    let mut ctl = Control::of_parent();
    ctl.send("ADDR", &hex(w.address()));
    let peer = ctl.expect("ADDR");
    let ep = w.connect(&unhex(&peer)).unwrap_or_else(|e| die("connect", e));
    for size in o.sweep.sizes() {
        run_size(o, &w, &ep, size, false);
        if o.prepared {
            run_prepared(o, &w, &ep, size, false);
        }
    }
    let _ = ep.close();
}

/// Run ucx_perftest for one size; returns (latency µs, bandwidth MB/s as printed by UCX).
fn ucx_perftest(o: &Opts, size: usize) -> Option<(f64, f64)> {
    let port = 13337 + (std::process::id() % 1000) as u16;
    let test = if o.test == Test::Lat { "tag_lat" } else { "tag_bw" };
    let iters = (o.sweep.warmup + o.sweep.iters).to_string();
    let common = |c: &mut Command| {
        c.args(["-t", test, "-s", &size.to_string(), "-n", &iters, "-p", &port.to_string()]);
        if o.test == Test::Bw {
            c.args(["-w", &o.sweep.warmup.to_string()]);
        }
        c.stdout(Stdio::piped()).stderr(Stdio::null());
    };
    let mut srv = Command::new("ucx_perftest");
    common(&mut srv);
    if o.pin {
        srv.args(["-c", &(1 % ncpus()).to_string()]);
    }
    let mut srv = srv.spawn().ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let mut cli = Command::new("ucx_perftest");
    cli.arg("127.0.0.1");
    common(&mut cli);
    if o.pin {
        cli.args(["-c", "0"]);
    }
    let out = cli.output().ok()?;
    let _ = srv.wait();
    // The "Final:" line: iterations, then latency typical/avg/overall (µs), bandwidth avg/overall
    // (MB/s), message rate avg/overall. We take overall latency and overall bandwidth.
    let text = String::from_utf8_lossy(&out.stdout);
    let fin = text.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let nums: Vec<f64> = fin.split_whitespace().filter_map(|t| t.parse().ok()).collect();
    if nums.len() < 6 {
        return None;
    }
    Some((nums[3], nums[5]))
}

pub(crate) fn client(o: &Opts, args: &[String]) {
    let o = o.clone();
    if o.pin {
        pin_to(0);
    }
    let (mut child, mut ctl) = spawn_peer(args);
    let w = setup();
    let ep = w.connect(&unhex(&ctl.expect("ADDR"))).unwrap_or_else(|e| die("connect", e));
    ctl.send("ADDR", &hex(w.address()));
    let lane = ep.lane().map(|l| l.name()).unwrap_or("?");
    let cfg = w.context().config();
    println!(
        "# gsc-bench {} | gscomm {} | lane {} | GSC_EAGER_SHORT_MAX={} GSC_RNDV_THRESH={} GSC_RNDV_SCHEME={:?} | {} iters, {} warmup{}",
        if o.test == Test::Lat { "tag-lat (half round trip)" } else { "tag-bw" },
        gscomm::VERSION,
        lane,
        cfg.eager_short_max,
        cfg.rndv_thresh,
        cfg.rndv_scheme,
        o.sweep.iters,
        o.sweep.warmup,
        if o.test == Test::Bw { format!(", window {}", o.window) } else { String::new() }
    );
    let mut results = Vec::new();
    let mut prepared = Vec::new();
    for size in o.sweep.sizes() {
        let secs = run_size(&o, &w, &ep, size, true);
        results.push((size, secs));
        if o.prepared {
            prepared.push(run_prepared(&o, &w, &ep, size, true) / o.sweep.iters as f64 / 2.0 * 1e6);
        }
    }
    let _ = ep.close();
    let _ = child.wait();
    let ucx: Vec<Option<(f64, f64)>> = if o.ucx { o.sweep.sizes().iter().map(|s| ucx_perftest(&o, *s)).collect() } else { vec![] };
    match o.test {
        Test::Lat => println!("{:>12} {:>14} {:>14} {:>8} {:>14}", "size(B)", "gscomm(us)", "ucx(us)", "ratio", "prepared(us)"),
        Test::Bw => println!("{:>12} {:>14} {:>14} {:>8}", "size(B)", "gscomm(GB/s)", "ucx(GB/s)", "ratio"),
    }
    for (i, (size, secs)) in results.iter().enumerate() {
        let (ours, theirs) = match o.test {
            Test::Lat => (secs / o.sweep.iters as f64 / 2.0 * 1e6, ucx.get(i).copied().flatten().map(|u| u.0)),
            Test::Bw => (
                (*size * o.window * o.sweep.iters) as f64 / secs / 1e9,
                // ucx_perftest prints MB/s with MB = 2^20 bytes.
                ucx.get(i).copied().flatten().map(|u| u.1 * (1 << 20) as f64 / 1e9),
            ),
        };
        let (t, ratio) = match theirs {
            Some(t) if o.test == Test::Lat => (format!("{t:.3}"), format!("{:.2}", ours / t)),
            Some(t) => (format!("{t:.2}"), format!("{:.2}", t / ours)),
            None if o.ucx => ("n/a".into(), "".into()),
            None => ("".into(), "".into()),
        };
        match o.test {
            Test::Lat => {
                let p = prepared.get(i).map(|p| format!("{p:.3}")).unwrap_or_default();
                println!("{size:>12} {ours:>14.3} {t:>14} {ratio:>8} {p:>14}")
            }
            Test::Bw => println!("{size:>12} {ours:>14.2} {t:>14} {ratio:>8}"),
        }
    }
    if o.ucx {
        println!("# ratio = how many times slower gscomm is than UCX (1.00 = equal, < 1 = gscomm faster)");
    }
}

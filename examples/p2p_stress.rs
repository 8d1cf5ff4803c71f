//! Stress for the point-to-point exchange NetComm's steps make, on host memory (issue #7 stall):
//! N processes, every round one condition group in which every rank sends a part to every other
//! rank and receives theirs, data checked, a deadline per round that names the stuck requests.
//!
//!   GSC_TLS=ucx UCX_TLS=tcp cargo run --release --example p2p_stress -- [nranks] [rounds] [mode]
//!
//! `STRESS_BARRIER=1` adds a bootstrap barrier after every round (a rank that finished waits
//! there without progressing), `STRESS_DEADLINE` (seconds, 10) is when a round is reported as
//! stalled. What reproduced issue #7's stall before the fix (3 runs in 5 stalled in round 0):
//! `UCX_TCP_SNDBUF=64k UCX_TCP_RCVBUF=64k GSC_RNDV_SCHEME=pipeline STRESS_BARRIER=1` with 4
//! ranks (docs/UCX.md, "Sends need progress to leave").
//!
//! mode: `stream` (a host-stream condition, the proxy thread drives), `none` (no condition, the
//! calling thread progresses). Rank 0 starts the others (this same program).
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::condition::{Condition, HostStream};
use gscomm::{Config, Context, RequestParams, Started};
use std::process::Command;
use std::time::{Duration, Instant};

const SIZES: &[usize] = &[4, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, (1 << 20) + 2, 3, 256 << 10, (1 << 20) + 2];
const BIG: usize = 16 << 20;

fn size(round: usize, from: usize, to: usize) -> usize {
    let k = round * 7 + from * 3 + to * 5;
    if k.is_multiple_of(13) { BIG } else { SIZES[k % SIZES.len()] }
}

fn fill(buf: &mut [u8], round: usize, from: usize, to: usize) {
    let s = (round * 131 + from * 31 + to * 17) as u32;
    for (i, c) in buf.chunks_mut(4).enumerate() {
        let v = (i as u32).wrapping_mul(2654435761).wrapping_add(s).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nranks: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100);
    let mode = args.get(3).cloned().unwrap_or_else(|| "stream".into());
    let deadline: u64 = std::env::var("STRESS_DEADLINE").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let (rank, uid, children) = match std::env::var("STRESS_UID") {
        Ok(hex) => (std::env::var("STRESS_RANK").unwrap().parse::<usize>().unwrap(), hex.parse::<UniqueId>().unwrap(), Vec::new()),
        Err(_) => {
            let uid = UniqueId::create(Some("127.0.0.1".parse().unwrap())).unwrap();
            let kids: Vec<_> = (1..nranks)
                .map(|r| {
                    Command::new(std::env::current_exe().unwrap())
                        .args(&args[1..])
                        .env("STRESS_UID", uid.to_string())
                        .env("STRESS_RANK", r.to_string())
                        .spawn()
                        .unwrap()
                })
                .collect();
            (0, uid, kids)
        }
    };
    let ok = run(rank, nranks, rounds, &mode, &uid, Duration::from_secs(deadline));
    let mut all_ok = ok;
    for mut c in children {
        all_ok &= c.wait().map(|s| s.success()).unwrap_or(false);
    }
    if rank == 0 {
        println!("p2p_stress: {}", if all_ok { "OK" } else { "FAILED" });
    }
    std::process::exit(if all_ok { 0 } else { 1 });
}

fn run(rank: usize, n: usize, rounds: usize, mode: &str, uid: &UniqueId, deadline: Duration) -> bool {
    let boot = Bootstrap::init(uid, rank as u32, n as u32, Duration::from_secs(30)).unwrap();
    let cfg = Config { proxy_thread: true, ..Config::from_env().unwrap() };
    let ctx = Context::new(cfg).unwrap();
    let worker = ctx.create_worker().unwrap();
    let addrs = boot.allgather(worker.address()).unwrap();
    let eps: Vec<_> = (0..n).map(|p| if p == rank { None } else { Some(worker.connect(&addrs[p]).unwrap()) }).collect();
    let stream = HostStream::new().unwrap();
    let on = Condition::host_stream(&stream);
    let t0 = Instant::now();
    let mut worst = Duration::ZERO;
    for round in 0..rounds {
        let tr = Instant::now();
        let sends: Vec<Vec<u8>> = (0..n)
            .map(|p| {
                let mut v = vec![0u8; if p == rank { 0 } else { size(round, rank, p) }];
                fill(&mut v, round, rank, p);
                v
            })
            .collect();
        let mut recvs: Vec<Vec<u8>> = (0..n).map(|p| vec![0u8; if p == rank { 0 } else { size(round, p, rank) }]).collect();
        // (what, peer, handle)
        let mut handles: Vec<(&str, usize, u64)> = Vec::new();
        let params = || {
            if mode == "stream" { RequestParams { condition: Some(on.clone()), ..Default::default() } } else { RequestParams::default() }
        };
        if mode == "stream" {
            on.group_start().unwrap();
        }
        for (p, r) in recvs.iter_mut().enumerate() {
            if p == rank {
                continue;
            }
            // SAFETY: the buffers live until the round's end, after every request completed.
            if let Started::Pending(h) = unsafe { worker.tag_recv_nbx(r.as_mut_ptr(), r.len(), p as u64, u64::MAX, params()) }.unwrap() {
                handles.push(("recv", p, h));
            }
        }
        for p in 0..n {
            if p == rank {
                continue;
            }
            let s = &sends[p];
            // SAFETY: as above.
            if let Started::Pending(h) =
                unsafe { eps[p].as_ref().unwrap().tag_send_nbx(s.as_ptr(), s.len(), rank as u64, params()) }.unwrap()
            {
                handles.push(("send", p, h));
            }
        }
        if mode == "stream" {
            on.group_end().unwrap();
        }
        let mut reported = false;
        loop {
            let done = if mode == "stream" {
                match stream.synchronize(Some(Duration::from_millis(200))) {
                    Ok(()) => true,
                    Err(e) if e.status() == gscomm::Status::TimedOut => false,
                    Err(e) => {
                        eprintln!("rank {rank} round {round}: {e}");
                        return false;
                    }
                }
            } else {
                for _ in 0..64 {
                    worker.progress();
                }
                handles.iter().all(|&(_, _, h)| worker.request_test(h).unwrap().is_some())
            };
            if done {
                break;
            }
            if !reported && tr.elapsed() > deadline {
                reported = true;
                let stuck: Vec<String> = handles
                    .iter()
                    .filter(|&&(_, _, h)| worker.request_test(h).unwrap().is_none())
                    .map(|&(w, p, _)| {
                        let len = if w == "send" { sends[p].len() } else { recvs[p].len() };
                        format!("{w} {} {p} ({len} B)", if w == "send" { "to" } else { "from" })
                    })
                    .collect();
                eprintln!("rank {rank} round {round}: STALL {:?}: stuck {stuck:?}; stats {:?}", tr.elapsed(), worker.stats());
            }
            if tr.elapsed() > Duration::from_secs(120) {
                eprintln!("rank {rank} round {round}: giving up");
                return false;
            }
        }
        let took = tr.elapsed();
        if reported {
            eprintln!("rank {rank} round {round}: went on after {took:?}");
        }
        worst = worst.max(took);
        for (_, _, h) in handles {
            let c = worker.request_test(h).unwrap().unwrap();
            if c.status != gscomm::Status::Ok {
                eprintln!("rank {rank} round {round}: status {:?}", c.status);
                return false;
            }
            worker.request_release(h).unwrap();
        }
        // A rank that finished its part waits here for the others without progressing its
        // worker (the proxy has nothing in flight): what its peers still need from its process
        // must already be on the wire.
        if std::env::var_os("STRESS_BARRIER").is_some() {
            boot.barrier().unwrap();
        }
        for (p, got) in recvs.iter().enumerate() {
            if p == rank {
                continue;
            }
            let mut want = vec![0u8; got.len()];
            fill(&mut want, round, p, rank);
            if want != *got {
                eprintln!("rank {rank} round {round}: data from {p} wrong");
                return false;
            }
        }
    }
    println!("rank {rank}: {rounds} rounds in {:?}, worst round {worst:?}", t0.elapsed());
    boot.barrier().unwrap();
    true
}

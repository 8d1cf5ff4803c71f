//! The main demo: two processes on this machine, host memory only (no GPU needed).
//!
//!   cargo run --release --example host_pingpong
//!
//! Rank 0 creates a unique id and starts rank 1 (this same program) with it. Both join the
//! bootstrap, swap packed worker addresses with an allgather, connect endpoints, and then:
//! a tagged ping-pong over every protocol (eager-short, eager-copy, rendezvous), a probe, and a
//! one-sided put/get through a remote key, each checked. It prints what it measured.

use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::{Config, Context, MapRequest, RequestParams, Status};
use std::process::Command;
use std::time::{Duration, Instant};

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(131).wrapping_add(seed)) as u8).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (rank, uid, child) = match std::env::var("GSC_DEMO_UID") {
        Ok(hex) => (1u32, hex.parse::<UniqueId>()?, None),
        Err(_) => {
            let uid = UniqueId::create(Some("127.0.0.1".parse()?))?;
            let child = Command::new(std::env::current_exe()?).env("GSC_DEMO_UID", uid.to_string()).spawn()?;
            (0, uid, Some(child))
        }
    };
    let boot = Bootstrap::init(&uid, rank, 2, Duration::from_secs(30))?;
    let ctx = Context::new(Config::from_env()?)?;
    let worker = ctx.create_worker()?;
    let addrs = boot.allgather(worker.address())?;
    let peer = 1 - rank as usize;
    let ep = worker.connect(&addrs[peer])?;
    println!("rank {rank}: connected to rank {peer} over the {} lane", ep.lane()?.name());

    // Tagged ping-pong across the protocol boundaries (see `gsc-info -p`).
    let cfg = ctx.config();
    let sizes = [0, 8, cfg.eager_short_max + 1, cfg.rndv_thresh - 1, cfg.rndv_thresh, 4 << 20];
    for (i, &size) in sizes.iter().enumerate() {
        let data = pattern(size, i);
        let mut buf = vec![0u8; size];
        let iters = if size >= 1 << 20 { 20 } else { 2000 };
        let start = Instant::now();
        for _ in 0..iters {
            if rank == 0 {
                ep.tag_send(&data, i as u64)?;
                let c = worker.tag_recv(&mut buf, i as u64, u64::MAX)?;
                assert_eq!(c.status, Status::Ok);
            } else {
                let c = worker.tag_recv(&mut buf, i as u64, u64::MAX)?;
                assert_eq!(c.status, Status::Ok);
                ep.tag_send(&buf, i as u64)?;
            }
        }
        if buf != data {
            return Err(format!("rank {rank}: data mismatch at {size} bytes").into());
        }
        if rank == 0 {
            let half_rtt = start.elapsed().as_secs_f64() / iters as f64 / 2.0;
            println!(
                "  {size:>9} B  {:>9.2} us half round trip  {:>8.2} GB/s   data checked",
                half_rtt * 1e6,
                size as f64 / half_rtt / 1e9
            );
        }
    }

    // Probe: rank 1 sends a message with a tag in a range; rank 0 finds it by mask first.
    if rank == 1 {
        ep.tag_send(b"probe me", 0xAB00 | 7)?;
    } else {
        let info = loop {
            if let Some(info) = worker.tag_probe(0xAB00, 0xFF00, false) {
                break info;
            }
        };
        let mut buf = vec![0u8; info.length];
        worker.tag_recv(&mut buf, info.tag, u64::MAX)?;
        println!("  probe found tag {:#x} ({} bytes): {:?}", info.tag, info.length, String::from_utf8_lossy(&buf));
    }

    // One-sided: rank 1 exposes a region; rank 0 puts into it and gets it back.
    let region = ctx.mem_map(MapRequest::Allocate { len: 1 << 20 })?;
    let my_key = ctx.rkey_pack(&region)?;
    let mut key_and_addr = (region.address() as u64).to_le_bytes().to_vec();
    key_and_addr.extend_from_slice(&my_key);
    let theirs = boot.allgather(&key_and_addr)?;
    let remote_addr = u64::from_le_bytes(theirs[peer][..8].try_into()?);
    let rkey = ep.rkey_unpack(&theirs[peer][8..])?;
    if rank == 0 {
        let data = pattern(1 << 20, 99);
        let mut back = vec![0u8; 1 << 20];
        // SAFETY: both buffers outlive the requests, which are waited for right here.
        unsafe {
            let put = ep.put_nbx(data.as_ptr(), data.len(), remote_addr, &rkey, RequestParams::default())?;
            if let gscomm::Started::Pending(h) = put {
                worker.request_wait(h)?.into_result()?;
                worker.request_release(h)?;
            }
            ep.flush()?;
            let get = ep.get_nbx(back.as_mut_ptr(), back.len(), remote_addr, &rkey, RequestParams::default())?;
            if let gscomm::Started::Pending(h) = get {
                worker.request_wait(h)?.into_result()?;
                worker.request_release(h)?;
            }
        }
        if back != data {
            return Err("put/get round trip mismatch".into());
        }
        println!("  put 1 MiB into rank 1's region, flushed, got it back: data checked");
    }
    // Keep serving (emulated RMA needs the target to progress) until rank 0 is done.
    let done = std::thread::scope(|s| {
        let h = s.spawn(|| boot.barrier());
        while !h.is_finished() {
            worker.progress();
        }
        h.join().expect("barrier thread")
    });
    done?;
    ctx.mem_unmap(region)?;
    ep.close()?;
    if let Some(mut c) = child {
        let status = c.wait()?;
        if !status.success() {
            return Err(format!("rank 1 failed: {status}").into());
        }
        println!("demo OK: both ranks checked every transfer");
    }
    Ok(())
}

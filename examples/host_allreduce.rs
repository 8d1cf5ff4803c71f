//! An all-reduce of host memory across the processes of a job, started by any launcher
//! (issue #7): the rank and size come from mpirun (Open MPI, MPICH), srun, torchrun or
//! `GSC_RANK`/`GSC_NRANKS`, the rendezvous from `GSC_BOOTSTRAP_ADDR` (+ `GSC_BOOTSTRAP_SECRET`),
//! `GSC_UNIQUE_ID` or torchrun's `MASTER_ADDR`; ranks on other hosts are reached over UCX.
//!
//!   cargo build --release --example host_allreduce
//!   GSC_BOOTSTRAP_ADDR=node0:29600 GSC_BOOTSTRAP_SECRET=$(openssl rand -hex 16) \
//!       mpirun -np 4 -x GSC_BOOTSTRAP_ADDR -x GSC_BOOTSTRAP_SECRET target/release/examples/host_allreduce
//!
//! Every rank contributes `(rank + 1) * (i % 7 + 1)` at element i of 1 Mi 32-bit integers; each
//! checks every element of the sum and prints one line. Exit status 0 only if all were right.
use gscomm::bootstrap::{Bootstrap, BootstrapOptions, detect};
use gscomm::collectives::{DataType, HostComm, RedOp};
use std::time::Instant;

const ELEMENTS: usize = 1 << 20;

fn main() {
    if let Err(e) = run() {
        eprintln!("host_allreduce: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let info = detect()
        .map_err(|e| e.to_string())?
        .ok_or("no launcher found: start it with mpirun, srun, torchrun, or set GSC_RANK and GSC_NRANKS")?;
    let opts = BootstrapOptions::from_env().map_err(|e| e.to_string())?;
    let boot = Bootstrap::from_launcher(&opts, &info).map_err(|e| e.to_string())?;
    let config = gscomm::Config::load_env().map_err(|e| e.to_string())?.config;
    let comm = HostComm::new(&boot, &config).map_err(|e| e.to_string())?;
    let (rank, n) = (comm.rank(), comm.nranks());
    let send: Vec<u8> = (0..ELEMENTS).flat_map(|i| (((rank + 1) * (i % 7 + 1)) as i32).to_le_bytes()).collect();
    let mut recv = vec![0u8; send.len()];
    let t0 = Instant::now();
    comm.all_reduce(&send, &mut recv, DataType::Int32, RedOp::Sum).map_err(|e| e.to_string())?;
    let took = t0.elapsed();
    let ranks_sum = (n * (n + 1) / 2) as i32;
    let wrong = recv
        .chunks_exact(4)
        .enumerate()
        .filter(|(i, b)| i32::from_le_bytes((*b).try_into().unwrap()) != ranks_sum * (i % 7 + 1) as i32)
        .count();
    let lane = if n > 1 { comm.lane_to((rank + 1) % n).map(|l| l.name()).unwrap_or("?") } else { "none" };
    println!(
        "rank {rank}/{n} ({:?}): all-reduce of {ELEMENTS} int32 in {:.2} ms, peers over {lane}: {}",
        info.launcher,
        took.as_secs_f64() * 1e3,
        if wrong == 0 { "OK".to_string() } else { format!("{wrong} elements wrong") }
    );
    boot.barrier().map_err(|e| e.to_string())?;
    if wrong == 0 { Ok(()) } else { Err(format!("{wrong} elements wrong")) }
}

//! Collectives on GPU buffers between ranks on several hosts (issue #7): `NetComm`.
//!
//! A `Communicator` (comm.rs) needs every rank on one host's GPUs: its kernels write into the
//! peers' workspaces over NVLink. `NetComm` takes ranks anywhere. It groups them by host —
//! ranks whose peers are reachable by the NVLink/CUDA IPC path form a group (`GroupPlan`) —
//! runs the steps inside a group on the NVLink kernels (a `Communicator` of the group), and the
//! step between groups over the point-to-point engine with GPU buffers (UCX between hosts, its
//! host-staging pipeline moving the bytes: docs/UCX.md).
//!
//! **All-reduce, hierarchical.** With L ranks per group and G groups, rank (g, l) — group g,
//! local index l — does, all on the caller's stream:
//! 1. inside the group, a reduce-scatter: shard l (count / L elements) of the group's sum lands
//!    in its receive buffer at shard l's place; the count % L elements left over (the tail)
//!    are all-reduced inside the group, so every rank of the group holds them;
//! 2. between groups, among the G ranks of local index l (its *column*): a direct all-reduce of
//!    the shard and of the tail, as `HostComm` does — every rank sends part q of the region to
//!    column member q and receives the G - 1 copies of its own part into scratch GPU memory; a
//!    small kernel (`gsc_net_reduce_*`, cuda/coll.rs) reduces the G copies in group order; then
//!    every rank sends its reduced part to every column member;
//! 3. inside the group, an all-gather of the shards (in place).
//!
//! So element i is `op` over the groups, in group order, of `op` over each group's ranks, in
//! their rank order (`hierarchical_reference` computes the same). Integers are therefore equal
//! to a flat all-reduce; floats may round differently from a flat one, but identically on every
//! rank and every run. An average sums at every level and divides once, by the number of
//! ranks, at the end of step 2.
//!
//! **All-gather, reduce-scatter, broadcast: direct over the point-to-point engine.** Every rank
//! sends to every rank that needs its data, in one group on the stream (within a host the
//! engine copies GPU to GPU through CUDA IPC; between hosts it stages through UCX); a
//! reduce-scatter reduces the n copies of its part in rank order (exactly the flat order of
//! `types::reduce_reference`). Meant for the few hosts of a job: n² messages per step.
//!
//! **Stream order, nothing waits.** The point-to-point operations go on the caller's stream
//! condition (a group of them: the stream triggers them together and waits for all), the
//! kernels on its stream, in that order (the scratch the copies land in is kept between calls,
//! ordered across streams by an event: `cuda::coll::StreamScratch`); the call returns after enqueueing. No host thread waits for the
//! stream, so the proxy that serves the stream's waits is never held up by us. A dead or silent
//! peer ends the waiting operations within `GSC_TIMEOUT` (the proxy's expiry, issue #8) and
//! releases the stream with the condition's sticky error (`Condition::query`), or a kernel of
//! the group gives up at its timeout (`async_error`).
//!
//! What is refused, with an error that changes nothing: graph conditions and streams being
//! captured (the point-to-point operations and the scratch would have to become replayable
//! nodes: not built), a condition with a group open (our exchange must be on the stream before
//! the reduction kernel that follows it, which a group would defer), pre-multiplied sums, and
//! so fp8 averages (NCCL's is a pre-multiplied sum: `types::fp8_avg_scalar`).
//!
//! Matching: the inter-group steps use a worker of their own (`links`), so their messages never
//! mix with the user's send/recv (`p2p`, another worker); as in NCCL every rank must issue the
//! same collectives in the same order.

use super::agreement::{self, Signature};
use super::comm::Communicator;
use super::p2p::{PeerLinks, PeerOp};
use super::types::{DataType, RedOp, reduce_reference};
#[cfg(test)]
use super::types::{f16_to_f32, f32_to_f16};
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::condition::{Category, Condition};
use crate::config::{Config, Tristate};
use crate::cuda::coll::{CollKind, MAX_RANKS, NetReduceArgs, StreamScratch};
use crate::error::{Error, Result, Status};
use crate::transport::LaneKind;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// How the ranks of a `NetComm` are grouped: by host where the NVLink path can join them,
/// every rank alone otherwise. Pure: built from one key per rank (`GroupPlan::new`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    /// The groups, in order of their first rank; each lists its ranks in rank order.
    pub groups: Vec<Vec<usize>>,
    /// Why the ranks were not grouped although some shared a key (`None`: grouped as keyed).
    pub ungrouped_because: Option<String>,
}

impl GroupPlan {
    /// `keys[r]`: rank r's group key (its host identity where the NVLink path is usable, `None`
    /// where it is not: then it is a group of its own). Groups must be the same size, and at
    /// most `MAX_RANKS` (one host's communicator); otherwise every rank is its own group —
    /// still correct, every step then goes over the point-to-point engine.
    pub fn new(keys: &[Option<u64>]) -> GroupPlan {
        let mut groups: Vec<(Option<u64>, Vec<usize>)> = Vec::new();
        for (r, key) in keys.iter().enumerate() {
            match key.and_then(|k| groups.iter_mut().find(|(g, _)| *g == Some(k))) {
                Some((_, members)) => members.push(r),
                None => groups.push((*key, vec![r])),
            }
        }
        let groups: Vec<Vec<usize>> = groups.into_iter().map(|(_, m)| m).collect();
        let singles = || (0..keys.len()).map(|r| vec![r]).collect();
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        if sizes.iter().any(|&s| s != sizes[0]) {
            return GroupPlan {
                groups: singles(),
                ungrouped_because: Some(format!(
                    "hosts have different numbers of ranks ({sizes:?}): hierarchical steps need the same number on every host"
                )),
            };
        }
        if sizes.first().is_some_and(|&s| s > MAX_RANKS) {
            return GroupPlan {
                groups: singles(),
                ungrouped_because: Some(format!("{} ranks on one host: a host's NVLink communicator takes at most {MAX_RANKS}", sizes[0])),
            };
        }
        GroupPlan { groups, ungrouped_because: None }
    }

    pub fn ngroups(&self) -> usize {
        self.groups.len()
    }

    /// Ranks per group (every group has as many).
    pub fn local_size(&self) -> usize {
        self.groups.first().map_or(0, Vec::len)
    }

    /// (group, local index) of `rank`.
    pub fn place(&self, rank: usize) -> (usize, usize) {
        for (g, members) in self.groups.iter().enumerate() {
            if let Some(l) = members.iter().position(|&r| r == rank) {
                return (g, l);
            }
        }
        panic!("rank {rank} is in no group of the plan (a bug: plans cover every rank)")
    }

    /// The ranks of local index `local`, in group order: a column of the step between groups.
    pub fn column(&self, local: usize) -> Vec<usize> {
        self.groups.iter().map(|m| m[local]).collect()
    }
}

/// `elements` cut into `n` parts as even as whole elements allow: (first element, elements).
pub fn parts(elements: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n).map(|q| (elements * q / n, elements * (q + 1) / n - elements * q / n)).collect()
}

/// The all-reduce's regions for local index `local` of `local_size`: its shard (count / L
/// elements at `local` × that) and the tail (count % L elements after every shard), each as
/// (first element, elements).
pub fn all_reduce_regions(count: usize, local_size: usize, local: usize) -> [(usize, usize); 2] {
    let shard = count / local_size;
    [(local * shard, shard), (local_size * shard, count - local_size * shard)]
}

/// The hierarchical all-reduce's result, computed on the host the way `NetComm::all_reduce`
/// computes it: `inputs[g]` are group g's ranks' inputs in rank order; each group is reduced
/// in rank order, then the groups in group order; an average divides the total sum once, by
/// the number of ranks, with the kernels' arithmetic (`reduce_reference`'s).
pub fn hierarchical_reference(dtype: DataType, op: RedOp, inputs: &[Vec<&[u8]>]) -> Vec<u8> {
    let level = if op == RedOp::Avg { RedOp::Sum } else { op };
    let per_group: Vec<Vec<u8>> = inputs.iter().map(|g| reduce_reference(dtype, level, g)).collect();
    let refs: Vec<&[u8]> = per_group.iter().map(Vec::as_slice).collect();
    let total = reduce_reference(dtype, level, &refs);
    if op != RedOp::Avg {
        return total;
    }
    let n: usize = inputs.iter().map(Vec::len).sum();
    divide_reference(dtype, &total, n)
}

/// Every element of `sum` divided by `n` as the kernels' average does (`reduce_reference`'s
/// finish: truncating for integers, in `f32` for 16-bit floats).
fn divide_reference(dtype: DataType, sum: &[u8], n: usize) -> Vec<u8> {
    // reduce_reference's Avg of one input is exactly its finishing division by 1; for n, feed
    // the sum and n - 1 zeros: sum + 0 + ... = sum (exact in every type), then / n.
    let zeros = vec![0u8; sum.len()];
    let mut inputs: Vec<&[u8]> = vec![sum];
    inputs.extend(std::iter::repeat_n(zeros.as_slice(), n.saturating_sub(1)));
    reduce_reference(dtype, RedOp::Avg, &inputs)
}

/// One rank of a communicator for GPU buffers across hosts.
pub struct NetComm {
    rank: usize,
    nranks: usize,
    device: i32,
    plan: GroupPlan,
    /// (group, local index) of this rank.
    place: (usize, usize),
    /// The NVLink communicator of this rank's group (`None`: the group is this rank alone).
    intra: Option<Communicator>,
    /// The collectives' point-to-point steps.
    links: PeerLinks,
    /// The user's send/recv: another worker, so their order never interleaves with ours.
    p2p: PeerLinks,
    bootstrap: Bootstrap,
    kernel_cache: Option<PathBuf>,
    check_calls: bool,
    /// Set by `abort`, or by a failure that left the ranks' message sequences out of step
    /// (a point-to-point step that could not be posted completely): later calls fail with it.
    failed: OnceLock<Error>,
    /// Serializes calls (a call's point-to-point steps must reach the engine in one piece), and
    /// holds where peers' parts land before they are reduced, kept between calls.
    issue: Mutex<StreamScratch>,
}

impl NetComm {
    /// Join a communicator of `bootstrap.nranks()` ranks, this one on CUDA device `device`, on
    /// any hosts. Collective over `bootstrap`. `config`: `GSC_TLS` and `GSC_CUDA_IPC` decide
    /// whether ranks of one host may be grouped (shm, the lane that carries CUDA IPC, enabled
    /// and IPC not off — so `GSC_TLS=ucx` makes every rank its own group), `GSC_FAKE_HOST`
    /// makes processes of one machine different hosts, `GSC_TIMEOUT` bounds every wait.
    pub fn new(bootstrap: Bootstrap, device: i32, config: &Config) -> Result<NetComm> {
        crate::cuda::init().map_err(|e| e.context("GPU communicators need the CUDA driver"))?;
        let (rank, nranks) = (bootstrap.rank() as usize, bootstrap.nranks() as usize);
        // A key of our own only where a host's ranks can run the NVLink communicator.
        let nvlink = config.tls.contains(&LaneKind::Shm) && config.cuda_ipc != Tristate::Off;
        let key = match nvlink {
            true => match crate::cuda::peer_access_everywhere() {
                Ok(true) => Some(crate::transport::proc_identity::host_id_labelled(config.fake_host.as_deref())),
                Ok(false) => None,
                Err(e) => {
                    tracing::warn!(target: "gsc::coll", error = %e, "peer access unknown; this rank forms a group of its own");
                    None
                }
            },
            false => None,
        };
        let mut mine = vec![u8::from(key.is_some())];
        mine.extend_from_slice(&key.unwrap_or(0).to_le_bytes());
        let all = bootstrap.allgather(&mine).map_err(|e| e.context("exchanging host identities"))?;
        let mut keys = Vec::with_capacity(nranks);
        for (r, e) in all.iter().enumerate() {
            let e: &[u8; 9] = e
                .as_slice()
                .try_into()
                .map_err(|_| Error::new(Status::ConnectionReset, format!("rank {r} sent a host entry of {} bytes", e.len())))?;
            keys.push((e[0] != 0).then(|| u64::from_le_bytes(e[1..9].try_into().expect("8 bytes"))));
        }
        let plan = GroupPlan::new(&keys);
        if let Some(why) = &plan.ungrouped_because {
            tracing::warn!(target: "gsc::coll", "every rank forms a group of its own: {why}");
        }
        let place = plan.place(rank);
        tracing::debug!(target: "gsc::coll", groups = plan.ngroups(), per_group = plan.local_size(), group = place.0, local = place.1, "GPU communicator across hosts");
        let intra = Self::group_communicator(&bootstrap, &plan, place, device, config)?;
        let links = PeerLinks::new(&bootstrap, config)?;
        let p2p = PeerLinks::new(&bootstrap, config)?;
        // Endpoints to every rank now (making one is local; the peer accepts in its progress),
        // not at the first transfer: a GPU receive reserves its staging buffers on the user's
        // thread only when its worker already has a UCX link (core/worker.rs), and a broadcast's
        // receivers post receives and send nothing; the first call is also spared the connects.
        for q in (0..nranks).filter(|&q| q != rank) {
            links.lane_to(q)?;
            p2p.lane_to(q)?;
        }
        // The reduction kernels are loaded now, before any call puts a wait for the proxy on a
        // stream: loading one later, behind such a wait, can deadlock (cuda/kernels.rs,
        // `load_module`).
        crate::cuda::coll::preload(device, config.kernel_cache_dir.as_deref())?;
        bootstrap.barrier()?;
        Ok(NetComm {
            rank,
            nranks,
            device,
            plan,
            place,
            intra,
            links,
            p2p,
            bootstrap,
            kernel_cache: config.kernel_cache_dir.clone(),
            check_calls: config.coll_check,
            failed: OnceLock::new(),
            issue: Mutex::new(StreamScratch::new(device)),
        })
    }

    /// The NVLink communicator of this rank's group: its first rank starts a rendezvous and
    /// every rank learns its id through one exchange over the whole group (so a leader's
    /// failure reaches its members as an error, never a wait).
    fn group_communicator(
        boot: &Bootstrap,
        plan: &GroupPlan,
        place: (usize, usize),
        device: i32,
        config: &Config,
    ) -> Result<Option<Communicator>> {
        let leads = place.1 == 0 && plan.local_size() > 1;
        let uid = if leads {
            let ip = boot.peer_addr(boot.rank()).map(|a| a.ip());
            UniqueId::create(ip).map(|u| u.to_bytes().to_vec()).unwrap_or_else(|e| {
                tracing::warn!(target: "gsc::coll", error = %e, "no rendezvous for this host's group");
                Vec::new()
            })
        } else {
            Vec::new()
        };
        let ids = boot.allgather(&uid).map_err(|e| e.context("exchanging the groups' rendezvous ids"))?;
        if plan.local_size() <= 1 {
            return Ok(None);
        }
        let lead = plan.groups[place.0][0];
        if ids[lead].is_empty() {
            return Err(Error::new(Status::NoResource, format!("rank {lead} could not start its host group's rendezvous")));
        }
        let uid = UniqueId::from_bytes(&ids[lead])?;
        let group_boot = Bootstrap::init(&uid, place.1 as u32, plan.local_size() as u32, boot.timeout())?;
        // The whole communicator's calls are compared once, over the world (`agree`).
        let config = Config { coll_check: false, ..config.clone() };
        Communicator::new(group_boot, device, &config).map(Some)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// How the ranks were grouped.
    pub fn plan(&self) -> &GroupPlan {
        &self.plan
    }

    /// The lane the collectives' point-to-point steps take to `peer` (connecting first).
    pub fn lane_to(&self, peer: usize) -> Result<LaneKind> {
        self.links.lane_to(peer)
    }

    /// Abort this rank's side from any thread (see `Communicator::abort`): the group's
    /// communicator and both workers are aborted, so work waiting on them is released with
    /// `Aborted`, and later calls fail. Idempotent.
    pub fn abort(&self, reason: &str) -> Result<()> {
        // The first failure stays the one later calls report; every part is aborted either way
        // (each abort is idempotent).
        let _ = self.failed.set(Error::new(Status::Aborted, format!("the communicator was aborted: {reason}")));
        if let Some(intra) = &self.intra {
            intra.abort(reason)?;
        }
        self.links.worker().abort(reason)?;
        self.p2p.worker().abort(reason)
    }

    /// Ok, or the error a kernel of the group's communicator recorded (it gave up waiting for
    /// a peer), or the failure that made this communicator unusable. Point-to-point failures
    /// show on the caller's condition (`Condition::query`).
    pub fn async_error(&self) -> Result<()> {
        self.check_usable()?;
        self.intra.as_ref().map_or(Ok(()), Communicator::async_error)
    }

    /// Send `count` elements of `buf` to rank `peer` on `on` (NCCL's ncclSend; see
    /// `Communicator::send`). Between hosts GPU buffers are staged through host memory.
    ///
    /// # Safety
    /// As `Communicator::send`.
    pub unsafe fn send(&self, buf: u64, count: usize, dtype: DataType, peer: usize, on: &Condition) -> Result<()> {
        self.check_usable()?;
        let bytes = bytes(count, dtype)?;
        // SAFETY: the caller's contract.
        unsafe { self.p2p.transfer(PeerOp::Send, buf, bytes, peer, on) }
    }

    /// Receive `count` elements from rank `peer` into `buf` on `on` (NCCL's ncclRecv).
    ///
    /// # Safety
    /// As `Communicator::recv`.
    pub unsafe fn recv(&self, buf: u64, count: usize, dtype: DataType, peer: usize, on: &Condition) -> Result<()> {
        self.check_usable()?;
        let bytes = bytes(count, dtype)?;
        // SAFETY: the caller's contract.
        unsafe { self.p2p.transfer(PeerOp::Recv, buf, bytes, peer, on) }
    }

    /// `count` elements of `send` reduced with `op` across the ranks into `recv` of every rank
    /// (`send == recv`: in place), hierarchically (module note: the order of the reduction).
    /// Returns once everything is on `on`'s stream.
    ///
    /// # Safety
    /// `send` and `recv` are GPU memory of this rank's device, valid for `count` elements until
    /// the stream passed the operation.
    pub unsafe fn all_reduce(&self, send: u64, recv: u64, count: usize, dtype: DataType, op: RedOp, on: &Condition) -> Result<()> {
        let size = dtype.size();
        let total = bytes(count, dtype)?;
        let mut scratch = self.begin(CollKind::AllReduce, dtype, op, count, 0, on)?;
        if count == 0 {
            return Ok(());
        }
        self.check_buffer(send, "send")?;
        self.check_buffer(recv, "receive")?;
        let stream = on.cuda_stream()?;
        let (ngroups, local_size) = (self.plan.ngroups(), self.plan.local_size());
        if ngroups == 1 {
            return match &self.intra {
                // SAFETY: the caller's contract.
                Some(intra) => unsafe { intra.all_reduce(send, recv, count, dtype, op, on) }.map(|_| ()),
                // One rank: the sum of one input (an average divides by 1) is the input.
                // SAFETY: the caller's contract; in place is a no-op.
                None => unsafe { crate::cuda::coll::stream_copy(self.device, stream, recv, send, total) },
            };
        }
        let level = if op == RedOp::Avg { RedOp::Sum } else { op };
        let divisor = if op == RedOp::Avg { self.nranks as u64 } else { 0 };
        let (src, regions) = match &self.intra {
            Some(intra) => {
                let [(shard_at, shard), (tail_at, tail)] = all_reduce_regions(count, local_size, self.place.1);
                if shard > 0 {
                    // SAFETY: the caller's contract; shard `local` of `recv` is NCCL's in-place
                    // place for a reduce-scatter of `send` (or equal to it when in place).
                    unsafe { intra.reduce_scatter(send, recv + (shard_at * size) as u64, shard, dtype, level, on) }?;
                }
                if tail > 0 {
                    let at = (tail_at * size) as u64;
                    // SAFETY: as above, the last `tail` elements of both buffers.
                    unsafe { intra.all_reduce(send + at, recv + at, tail, dtype, level, on) }?;
                }
                (recv, vec![(shard_at, shard), (tail_at, tail)])
            }
            None => (send, vec![(0, count)]),
        };
        // SAFETY: the regions lie in both buffers (the caller's contract covers them).
        unsafe { self.column_all_reduce(&mut scratch, stream, on, src, recv, &regions, dtype, level, divisor) }?;
        if let Some(intra) = &self.intra {
            let [(shard_at, shard), _] = all_reduce_regions(count, local_size, self.place.1);
            if shard > 0 {
                // SAFETY: in place: our shard sits at its place in `recv`.
                unsafe { intra.all_gather(recv + (shard_at * size) as u64, recv, shard, dtype, on) }?;
            }
        }
        Ok(())
    }

    /// Every rank's `count` elements of `send` into `recv`, rank r's at element r × count (in
    /// place: `send == recv + rank × count elements`). Direct over the point-to-point engine.
    ///
    /// # Safety
    /// As `all_reduce`; `recv` holds `nranks × count` elements.
    pub unsafe fn all_gather(&self, send: u64, recv: u64, count: usize, dtype: DataType, on: &Condition) -> Result<()> {
        let part = bytes(count, dtype)?;
        bytes(count.checked_mul(self.nranks).ok_or_else(too_large)?, dtype)?;
        let _issue = self.begin(CollKind::AllGather, dtype, RedOp::Sum, count, 0, on)?;
        if count == 0 {
            return Ok(());
        }
        self.check_buffer(send, "send")?;
        self.check_buffer(recv, "receive")?;
        let stream = on.cuda_stream()?;
        let mine = recv + (self.rank * part) as u64;
        // SAFETY: the caller's contract; in place the copy is skipped.
        unsafe { crate::cuda::coll::stream_copy(self.device, stream, mine, send, part) }?;
        let mut steps = Vec::with_capacity(2 * self.nranks);
        for q in (0..self.nranks).filter(|&q| q != self.rank) {
            steps.push((PeerOp::Recv, q, recv + (q * part) as u64, part));
            steps.push((PeerOp::Send, q, send, part));
        }
        // SAFETY: every range lies in the caller's buffers.
        unsafe { self.exchange(on, &steps) }
    }

    /// `recv` (`recv_count` elements) = part `rank` of every rank's `send` (`nranks ×
    /// recv_count` elements) reduced with `op` in rank order. In place: `recv == send + rank ×
    /// recv_count elements`.
    ///
    /// # Safety
    /// As `all_reduce`; `send` holds `nranks × recv_count` elements.
    pub unsafe fn reduce_scatter(&self, send: u64, recv: u64, recv_count: usize, dtype: DataType, op: RedOp, on: &Condition) -> Result<()> {
        let part = bytes(recv_count, dtype)?;
        bytes(recv_count.checked_mul(self.nranks).ok_or_else(too_large)?, dtype)?;
        let mut scratch = self.begin(CollKind::ReduceScatter, dtype, op, recv_count, 0, on)?;
        if recv_count == 0 {
            return Ok(());
        }
        self.check_buffer(send, "send")?;
        self.check_buffer(recv, "receive")?;
        let stream = on.cuda_stream()?;
        let n = self.nranks;
        let base = scratch.take(stream, part * (n - 1))?;
        let mut steps = Vec::with_capacity(2 * n);
        for (k, q) in (0..n).filter(|&q| q != self.rank).enumerate() {
            steps.push((PeerOp::Recv, q, base + (k * part) as u64, part));
            steps.push((PeerOp::Send, q, send + (q * part) as u64, part));
        }
        // SAFETY: the ranges lie in the caller's buffers and in the scratch, which the next call
        // reuses only after this one's kernel read it (`StreamScratch`).
        let exchanged = unsafe { self.exchange(on, &steps) };
        let reduced = exchanged.and_then(|()| {
            let args = NetReduceArgs {
                own: send + (self.rank * part) as u64,
                copies: base,
                stride: part as u64,
                out: recv,
                count: recv_count as u64,
                n: n as u64,
                me: self.rank as u64,
                divisor: if op == RedOp::Avg { n as u64 } else { 0 },
            };
            self.reduce(stream, dtype, op, args)
        });
        reduced.and(scratch.queued(stream))
    }

    /// Every rank's `recv` = `root`'s `send` (`send` is read on the root only). The root sends
    /// to every rank directly.
    ///
    /// # Safety
    /// As `all_reduce`.
    pub unsafe fn broadcast(&self, send: u64, recv: u64, count: usize, dtype: DataType, root: usize, on: &Condition) -> Result<()> {
        let len = bytes(count, dtype)?;
        if root >= self.nranks {
            return Err(Error::invalid_param(format!("root {root} of a communicator of {} ranks", self.nranks)));
        }
        let _issue = self.begin(CollKind::Broadcast, dtype, RedOp::Sum, count, root, on)?;
        if count == 0 {
            return Ok(());
        }
        self.check_buffer(recv, "receive")?;
        let steps: Vec<Step> = if self.rank == root {
            self.check_buffer(send, "send")?;
            // SAFETY: the caller's contract; in place the copy is skipped.
            unsafe { crate::cuda::coll::stream_copy(self.device, on.cuda_stream()?, recv, send, len) }?;
            (0..self.nranks).filter(|&q| q != root).map(|q| (PeerOp::Send, q, send, len)).collect()
        } else {
            vec![(PeerOp::Recv, root, recv, len)]
        };
        // SAFETY: every range lies in the caller's buffers.
        unsafe { self.exchange(on, &steps) }
    }

    /// The checks every collective makes first, in an order that keeps ranks in step: the
    /// cross-rank comparison (`GSC_COLL_CHECK`) before anything that could fail on one rank
    /// alone. Returns the issue lock.
    fn begin(
        &self,
        kind: CollKind,
        dtype: DataType,
        op: RedOp,
        count: usize,
        root: usize,
        on: &Condition,
    ) -> Result<std::sync::MutexGuard<'_, StreamScratch>> {
        self.check_usable()?;
        if dtype.fp8().is_some() && kind.reduces() {
            // Every rank refuses alike: the call decides, not the rank.
            if op == RedOp::Avg {
                return Err(Error::unsupported(
                    "an fp8 average across hosts: NCCL's is a pre-multiplied sum, which collectives across hosts do not take yet",
                ));
            }
            let (major, minor) = crate::cuda::device_arch(self.device)?;
            if major < 9 {
                return Err(Error::invalid_param(format!(
                    "fp8 reductions need a GPU of compute capability 9.0 or later, as in NCCL; device {} is {major}.{minor}",
                    self.device
                )));
            }
        }
        let guard = self.issue.lock().unwrap_or_else(|e| e.into_inner());
        if self.check_calls {
            let mine = Signature::new(kind, dtype, op, count, root);
            let all = self.bootstrap.allgather(&mine.encode()).map_err(|e| e.context("comparing the collective call (GSC_COLL_CHECK)"))?;
            let all = all.iter().map(|b| Signature::decode(b)).collect::<Result<Vec<_>>>()?;
            agreement::check(&all)?;
        }
        if on.category() != Category::Stream {
            return Err(Error::unsupported(format!(
                "collectives across hosts start on CUDA stream conditions (not on {} conditions)",
                on.category().name()
            )));
        }
        if crate::cuda::capture_graph(on.cuda_stream()?)?.is_some() {
            return Err(Error::unsupported(
                "collectives across hosts cannot be captured into a CUDA graph yet (their point-to-point steps and scratch are not replayable nodes)",
            ));
        }
        if on.in_group() {
            return Err(Error::invalid_param(
                "a collective across hosts inside a group open on the same condition: its exchange must reach the stream before the kernel that reduces it; end the group first",
            ));
        }
        Ok(guard)
    }

    /// Step 2 of the all-reduce: for each region (first element, elements) of `src`, the
    /// column's all-reduce into the same region of `dst`, reduced in group order with `op`,
    /// divided by `divisor` when it is not 0.
    ///
    /// # Safety
    /// The regions lie in `src` and `dst` (GPU memory of this device, valid until the stream
    /// passed the operation); `src` is not written by anything else meanwhile.
    #[allow(clippy::too_many_arguments)] // the region list, its buffers and its arithmetic
    unsafe fn column_all_reduce(
        &self,
        scratch: &mut StreamScratch,
        stream: usize,
        on: &Condition,
        src: u64,
        dst: u64,
        regions: &[(usize, usize)],
        dtype: DataType,
        op: RedOp,
        divisor: u64,
    ) -> Result<()> {
        let (size, g, me) = (dtype.size(), self.plan.ngroups(), self.place.0);
        let column = self.plan.column(self.place.1);
        // Per region: its parts over the column, and where the copies of ours go in the scratch
        // (G - 1 of them, each 256-byte aligned so every region's copies start aligned).
        let mut layout = Vec::with_capacity(regions.len());
        let mut scratch_bytes = 0usize;
        for &(at, count) in regions.iter().filter(|r| r.1 > 0) {
            let p = parts(count, g);
            let stride = p[me].1 * size;
            layout.push((at, p, scratch_bytes, stride));
            scratch_bytes += (stride * (g - 1)).next_multiple_of(256);
        }
        let base = scratch.take(stream, scratch_bytes)?;
        let addr = |base: u64, element: usize| base + (element * size) as u64;
        let mut steps = Vec::new();
        for (at, p, off, stride) in &layout {
            for (k, q) in (0..g).filter(|&q| q != me).enumerate() {
                steps.push((PeerOp::Recv, column[q], base + (off + k * stride) as u64, *stride));
                steps.push((PeerOp::Send, column[q], addr(src, at + p[q].0), p[q].1 * size));
            }
        }
        // SAFETY: the caller's contract for `src`; the scratch lives until after the kernels.
        let mut result = unsafe { self.exchange(on, &steps) };
        for (at, p, off, stride) in &layout {
            let args = NetReduceArgs {
                own: addr(src, at + p[me].0),
                copies: base + *off as u64,
                stride: *stride as u64,
                out: addr(dst, at + p[me].0),
                count: p[me].1 as u64,
                n: g as u64,
                me: me as u64,
                divisor,
            };
            result = result.and_then(|()| self.reduce(stream, dtype, op, args));
        }
        result = result.and(scratch.queued(stream));
        result?;
        let mut steps = Vec::new();
        for (at, p, _, _) in &layout {
            for q in (0..g).filter(|&q| q != me) {
                steps.push((PeerOp::Send, column[q], addr(dst, at + p[me].0), p[me].1 * size));
                steps.push((PeerOp::Recv, column[q], addr(dst, at + p[q].0), p[q].1 * size));
            }
        }
        // SAFETY: the caller's contract for `dst`.
        unsafe { self.exchange(on, &steps) }
    }

    /// Launch the reduction kernel for `args` on `stream`.
    fn reduce(&self, stream: usize, dtype: DataType, op: RedOp, args: NetReduceArgs) -> Result<()> {
        let op_tag = if op == RedOp::Avg { RedOp::Sum.kernel_tag() } else { op.kernel_tag() };
        crate::cuda::coll::launch_net_reduce(self.device, stream, dtype.kernel_tag(), op_tag, self.kernel_cache.as_deref(), args)
    }

    /// Post `steps` in one group on `on`: the stream triggers them together when it gets there
    /// and waits for all of them. A step that cannot be posted leaves the ranks' message
    /// sequences out of step, so the communicator fails for good (the steps posted before it
    /// still run, and end at the peers' or at `GSC_TIMEOUT`).
    ///
    /// # Safety
    /// Every range is valid GPU memory until the stream passed the group (receives: written by
    /// nothing else meanwhile).
    unsafe fn exchange(&self, on: &Condition, steps: &[Step]) -> Result<()> {
        if steps.is_empty() {
            return Ok(());
        }
        on.group_start()?;
        let mut result = Ok(());
        for &(op, peer, buf, len) in steps {
            // SAFETY: the caller's contract; the group is closed below whatever happens.
            result = unsafe { self.links.transfer(op, buf, len, peer, on) };
            if result.is_err() {
                break;
            }
        }
        let result = result.and(on.group_end());
        if let Err(e) = &result {
            let _ = self.failed.set(Error::new(e.status(), format!("an earlier collective of this communicator failed: {e}")));
        }
        result
    }

    fn check_usable(&self) -> Result<()> {
        self.failed.get().map_or(Ok(()), |e| Err(e.clone()))
    }

    fn check_buffer(&self, addr: u64, what: &str) -> Result<()> {
        super::check_device_buffer(addr, self.device, what)
    }
}

/// One point-to-point step: direction, peer, GPU address, bytes.
type Step = (PeerOp, usize, u64, usize);

fn bytes(count: usize, dtype: DataType) -> Result<usize> {
    count.checked_mul(dtype.size()).filter(|b| *b <= isize::MAX as usize).ok_or_else(too_large)
}

fn too_large() -> Error {
    Error::invalid_param("a collective's size in bytes overflows")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_group_by_host_in_order_of_their_first_rank() {
        // Ranks 0 and 2 on host 7, 1 and 3 on host 5: groups [0, 2] then [1, 3].
        let plan = GroupPlan::new(&[Some(7), Some(5), Some(7), Some(5)]);
        assert_eq!(plan.groups, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(plan.ungrouped_because, None);
        assert_eq!((plan.ngroups(), plan.local_size()), (2, 2));
        assert_eq!(plan.place(2), (0, 1));
        assert_eq!(plan.place(1), (1, 0));
        assert_eq!(plan.column(0), vec![0, 1]);
        assert_eq!(plan.column(1), vec![2, 3]);
    }

    #[test]
    fn ranks_without_a_key_are_alone() {
        // GSC_TLS=ucx: nobody has a key, every rank is a group (and a column of its own local 0).
        let plan = GroupPlan::new(&[None, None, None, None]);
        assert_eq!(plan.groups, vec![vec![0], vec![1], vec![2], vec![3]]);
        assert_eq!(plan.column(0), vec![0, 1, 2, 3]);
        assert_eq!(plan.ungrouped_because, None);
        let one = GroupPlan::new(&[Some(1)]);
        assert_eq!((one.ngroups(), one.local_size()), (1, 1));
        let host = GroupPlan::new(&[Some(1), Some(1), Some(1)]);
        assert_eq!(host.groups, vec![vec![0, 1, 2]]);
    }

    #[test]
    fn uneven_or_oversized_hosts_fall_back_to_single_ranks() {
        let plan = GroupPlan::new(&[Some(1), Some(1), Some(2)]);
        assert_eq!(plan.groups, vec![vec![0], vec![1], vec![2]]);
        assert!(plan.ungrouped_because.as_deref().unwrap().contains("[2, 1]"), "{plan:?}");
        // A rank without a key beside a host of two: sizes differ too.
        let plan = GroupPlan::new(&[Some(1), None, Some(1)]);
        assert_eq!(plan.ngroups(), 3);
        let keys = vec![Some(9); MAX_RANKS + 1];
        let plan = GroupPlan::new(&keys);
        assert_eq!(plan.ngroups(), MAX_RANKS + 1);
        assert!(plan.ungrouped_because.as_deref().unwrap().contains("at most"), "{plan:?}");
    }

    #[test]
    fn parts_and_regions_cover_the_buffer() {
        for n in [1usize, 2, 3, 4, 7] {
            for count in [0usize, 1, 2, 5, 1000, 1001, (1 << 20) + 1] {
                let p = parts(count, n);
                assert_eq!(p.len(), n);
                assert_eq!(p[0].0, 0);
                for w in p.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0);
                }
                assert_eq!(p[n - 1].0 + p[n - 1].1, count);
                assert!(p.iter().all(|x| x.1 <= count.div_ceil(n)), "as even as whole elements allow");
                // The all-reduce's shards of every local index and the tail tile the buffer.
                let mut covered = vec![0u8; count];
                for l in 0..n {
                    let [(at, len), (tail_at, tail)] = all_reduce_regions(count, n, l);
                    assert_eq!((len, tail_at, tail), (count / n, n * (count / n), count % n));
                    covered[at..at + len].iter_mut().for_each(|c| *c += 1);
                    if l == 0 {
                        covered[tail_at..tail_at + tail].iter_mut().for_each(|c| *c += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "n={n} count={count}");
            }
        }
    }

    fn ints(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn the_hierarchical_reference_reduces_groups_then_across() {
        let (a, b, c, d) = (ints(&[1, -7, 100]), ints(&[2, 3, 1]), ints(&[10, 5, -2]), ints(&[4, 4, 4]));
        let groups = vec![vec![a.as_slice(), b.as_slice()], vec![c.as_slice(), d.as_slice()]];
        let flat = [a.as_slice(), b.as_slice(), c.as_slice(), d.as_slice()];
        // Integers: the same as the flat reduction, for every operator, average included.
        for op in RedOp::ALL {
            assert_eq!(hierarchical_reference(DataType::Int32, op, &groups), reduce_reference(DataType::Int32, op, &flat), "{op:?}");
        }
        // Floats: the grouping shows, the same way every time. In f32, 1e8 + 1 rounds back to
        // 1e8 (its spacing there is 8): groups (1e8, 1) and (-1e8, 1) sum to 1e8 and -1e8, so 0;
        // the flat rank order gives ((1e8 + 1) - 1e8) + 1 = 1.
        let f = |v: f32| v.to_le_bytes().to_vec();
        let (w, x, y, z) = (f(1e8), f(1.0), f(-1e8), f(1.0));
        let groups = vec![vec![w.as_slice(), x.as_slice()], vec![y.as_slice(), z.as_slice()]];
        let sum = f32::from_le_bytes(hierarchical_reference(DataType::Float32, RedOp::Sum, &groups).try_into().unwrap());
        assert_eq!(sum, 0.0);
        let flat = [w.as_slice(), x.as_slice(), y.as_slice(), z.as_slice()];
        assert_eq!(f32::from_le_bytes(reduce_reference(DataType::Float32, RedOp::Sum, &flat).try_into().unwrap()), 1.0);
        // The average divides the total once, by the number of ranks.
        let avg = f32::from_le_bytes(
            hierarchical_reference(DataType::Float32, RedOp::Avg, &[vec![&f(3.0)[..], &f(5.0)[..]], vec![&f(8.0)[..], &f(0.0)[..]]])
                .try_into()
                .unwrap(),
        );
        assert_eq!(avg, 4.0);
        let h = hierarchical_reference(
            DataType::Float16,
            RedOp::Avg,
            &[vec![&f32_to_f16(6.0).to_le_bytes()[..]], vec![&f32_to_f16(0.0).to_le_bytes()[..]]],
        );
        assert_eq!(f16_to_f32(u16::from_le_bytes(h.try_into().unwrap())), 3.0);
    }
}

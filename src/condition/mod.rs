//! Conditions: when an operation starts and what waits for its completion.
//!
//! Every operation's request parameters have a condition slot. With no condition the operation
//! starts at once on the calling thread. With one, the operation is *armed*: its producer (a CUDA
//! stream, a CUDA graph, a user kernel, a host stream) is given a write of a trigger word at the
//! operation's position, the worker's proxy (src/proxy/) starts the operation when the word
//! reaches it, and the operation's completion advances a done word the producer's later work
//! waits on. See `channel` for the words and why they only grow.
//!
//! Two shapes:
//! - *Sequenced* (stream, host stream): one channel per condition; operations are numbered in
//!   issue order and each runs once.
//! - *Persistent* (graph, kernel-triggered, and stream capture): one channel per operation; the
//!   device advances an epoch, and the operation runs again for every epoch, so an instantiated
//!   graph or a kernel loop can replay it any number of times.

mod channel;
mod host_stream;
mod stage;
mod words;

pub use channel::DONE_ERROR_BIT;
pub(crate) use channel::{Channel, Signal};
pub use host_stream::HostStream;
pub(crate) use stage::{LATE_LIMIT, Stage, StageDir};
pub(crate) use words::Words;

use crate::cuda::OpDesc;
use crate::error::{Error, Result, Status};
use host_stream::Item;
use std::sync::{Arc, Mutex, Weak};

/// The kind of a condition (`gsc_condition_category_t`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Category {
    /// A position in a CUDA stream (context: the CUstream).
    Stream,
    /// A node in a CUDA graph (context: the CUgraph the nodes are added to).
    Graph,
    /// A trigger fired by a user kernel through a device handle.
    KernelTriggered,
    /// An ordered host queue with stream semantics (for machines without GPUs and for CI).
    HostStream,
}

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::Stream => "stream",
            Category::Graph => "graph",
            Category::KernelTriggered => "kernel-triggered",
            Category::HostStream => "host stream",
        }
    }
}

/// What an armed persistent operation hands back (graph nodes, a device handle).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArmedOutputs {
    /// Graph conditions: the node that triggers the operation (wire its dependencies to it) and
    /// the node that completes when the operation did (wire later work after it). CUgraphNode.
    pub start_node: usize,
    pub done_node: usize,
    /// Kernel-triggered conditions: the device address of the `gsc_device_handle` a kernel passes
    /// to `gsc_trigger` / `gsc_wait`.
    pub device_handle: u64,
}

/// A condition (`gsc_condition_h`). Cloning gives another handle to the same condition.
#[derive(Clone)]
pub struct Condition {
    pub(crate) inner: Arc<CondInner>,
}

pub(crate) struct CondInner {
    category: Category,
    producer: Producer,
    /// Sequenced conditions: the one channel every operation on it shares.
    channel: Option<Arc<Channel>>,
    /// Persistent operations armed on it, for `query`. Their lifetime is their graph's (a CUDA
    /// user object holds them) or, for kernel triggers, the condition's (`keep`).
    armed: Mutex<Vec<Weak<Channel>>>,
    keep: Mutex<Vec<Arc<Channel>>>,
    /// Operations captured from a stream without a stream wait, for the next `wait`.
    captured_unwaited: Mutex<Vec<Arc<Channel>>>,
    /// An open group (`group_start`): what its end puts on the stream.
    group: Mutex<Group>,
    /// Staged receives of the sequenced channel (operation number, kernel view) whose bytes the
    /// next stream wait covering them copies into the user's buffer.
    pending_in: Mutex<Vec<(u64, OpDesc)>>,
    /// Kernel cache directory (`GSC_KERNEL_CACHE_DIR`) for the replay-safe nodes.
    kernel_cache: Option<std::path::PathBuf>,
    /// Rounds of prepared transfers run on the GPU without a stream wait: their waits, put on
    /// the stream by the next `wait` (at the end of its group when it is called in one).
    device_waits: Mutex<Vec<crate::cuda::PrepArgs>>,
}

/// A stream condition's CUDA stream, its context, and gscomm's kernels there.
pub(crate) struct StreamKernels {
    pub(crate) stream: usize,
    pub(crate) kernels: crate::cuda::Kernels,
}

/// Operations issued between `group_start` and `group_end` are put on the stream together, at
/// the end: their trigger writes become one (the last number covers every earlier one) and the
/// waits one, in a single batch of stream memops; captured ones share one trigger node and one
/// wait node. That saves a memop (about 3 µs on H200) or a kernel node per extra operation.
#[derive(Default)]
struct Group {
    depth: u32,
    /// Sequenced: the highest operation number issued in the group, and the highest to wait for.
    trigger: Option<u64>,
    wait: Option<u64>,
    /// Sequenced: staged sends, copied into their slots before the trigger.
    out: Vec<OpDesc>,
    /// Sequenced: an operation of the group sends data with no flags of its own (`issue`'s
    /// `orders`): the kernel fences before the trigger.
    fence: bool,
    /// Captured: channels to trigger, and to wait for, at the end; the graph they belong to.
    captured_triggers: Vec<Arc<Channel>>,
    captured_waits: Vec<Arc<Channel>>,
    graph: Option<usize>,
    /// `wait` was called in the group: deferred device waits go on the stream at its end.
    device_wait: bool,
    /// Prepared transfers' GPU rounds issued in the group: one fused launch at its end.
    gpu_rounds: Vec<crate::cuda::PrepArgs>,
}

enum Producer {
    Host(HostStream),
    /// A CUstream and its context.
    CudaStream {
        stream: usize,
        ctx: usize,
    },
    /// A CUgraph; nodes are built in the context current when the condition was created.
    Graph {
        graph: usize,
        ctx: usize,
    },
    KernelTriggered {
        ctx: usize,
    },
}

/// How the worker must arm an operation on this condition.
pub(crate) enum Issued {
    /// Operation `seq` of the condition's channel.
    Sequenced(Arc<Channel>, u64),
    /// A channel of its own, with what the caller gets back.
    Persistent(Arc<Channel>, ArmedOutputs),
}

impl Condition {
    /// A condition on a host stream: operations start in the stream's order.
    pub fn host_stream(stream: &HostStream) -> Condition {
        Condition::build(Category::HostStream, Producer::Host(stream.clone()), Some(Channel::new(Words::host())), None)
    }

    /// A condition of `category` on the CUDA object at `context`: a CUstream for `Stream`, a
    /// CUgraph for `Graph` (nodes are built for the context current on the calling thread),
    /// nothing for `KernelTriggered` (the current context's kernels use it). `kernel_cache`:
    /// where compiled kernels are kept (`None`: the default place).
    pub fn cuda(category: Category, context: usize, kernel_cache: Option<std::path::PathBuf>) -> Result<Condition> {
        crate::cuda::init().map_err(|e| e.context(format!("{} conditions need the CUDA driver", category.name())))?;
        let (producer, channel) = match category {
            Category::Stream => {
                // The legacy default stream (0) is a valid CUstream; only the context lookup
                // tells whether the handle is one.
                let ctx = crate::cuda::stream_context(context)? as usize;
                let _scope = crate::cuda::CtxScope::enter(crate::cuda::raw(ctx))?;
                (Producer::CudaStream { stream: context, ctx }, Some(Channel::new(Words::pinned(crate::cuda::PinnedSlot::take()?))))
            }
            Category::Graph => {
                if context == 0 {
                    return Err(Error::invalid_param("a graph condition needs its CUgraph as context"));
                }
                (Producer::Graph { graph: context, ctx: crate::cuda::current_context()? as usize }, None)
            }
            Category::KernelTriggered => (Producer::KernelTriggered { ctx: crate::cuda::current_context()? as usize }, None),
            Category::HostStream => return Err(Error::invalid_param("use Condition::host_stream for host streams")),
        };
        Ok(Condition::build(category, producer, channel, kernel_cache))
    }

    fn build(category: Category, producer: Producer, channel: Option<Arc<Channel>>, kernel_cache: Option<std::path::PathBuf>) -> Condition {
        Condition {
            inner: Arc::new(CondInner {
                category,
                producer,
                channel,
                armed: Mutex::default(),
                keep: Mutex::default(),
                captured_unwaited: Mutex::default(),
                group: Mutex::default(),
                pending_in: Mutex::default(),
                kernel_cache,
                device_waits: Mutex::default(),
            }),
        }
    }

    /// Whether `other` is a handle to this same condition.
    pub fn same(&self, other: &Condition) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub fn category(&self) -> Category {
        self.inner.category
    }

    /// The first failure of any operation on this condition (sticky), or Ok.
    pub fn query(&self) -> Result<()> {
        if let Some(e) = self.inner.channel.as_ref().and_then(|c| c.error()) {
            return Err(e);
        }
        let armed = self.inner.armed.lock().unwrap_or_else(|e| e.into_inner());
        match armed.iter().filter_map(Weak::upgrade).find_map(|c| c.error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Make the producer wait, at its current position, for every operation issued on this
    /// condition so far (for operations issued with `no_stream_wait`).
    pub fn wait(&self) -> Result<()> {
        let channel = self.sequenced_channel("wait")?;
        {
            // The issue lock is never taken inside the group lock (`issue` nests them the other way).
            let issued = *channel.issue.lock().unwrap_or_else(|e| e.into_inner());
            let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
            if group.depth > 0 {
                group.device_wait = true;
                let mut unwaited = self.inner.captured_unwaited.lock().unwrap_or_else(|e| e.into_inner());
                group.captured_waits.append(&mut unwaited);
                // Under capture the sequenced channel is not used: only captured waits count.
                if group.graph.is_none() && issued > channel.base {
                    group.wait = Some(issued);
                }
                return Ok(());
            }
        }
        self.launch_device_waits()?;
        if let Producer::CudaStream { stream, ctx } = self.inner.producer
            && crate::cuda::capture_graph(stream)?.is_some()
        {
            // Captured operations have a channel each: wait for each with a kernel node.
            let kernels = self.kernels(ctx)?;
            let mut pending = self.inner.captured_unwaited.lock().unwrap_or_else(|e| e.into_inner());
            crate::cuda::launch_ops(&kernels, stream, &[], &descs(&pending, StageDir::Recv), false)?;
            pending.clear();
            return Ok(());
        }
        let issued = channel.issue.lock().unwrap_or_else(|e| e.into_inner());
        self.enqueue(&channel, None, Some(*issued), &[], false)
    }

    /// Open a group (they nest): operations issued on this condition until the matching
    /// `group_end` go on the stream together at the end (see `Group`). Only stream and host
    /// stream conditions have groups. The group belongs to the condition, not to a thread.
    pub fn group_start(&self) -> Result<()> {
        self.sequenced_channel("group_start")?;
        let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
        group.depth = group.depth.checked_add(1).ok_or_else(|| Error::invalid_param("group_start: groups nested too deep"))?;
        Ok(())
    }

    /// Whether a group is open on this condition (`group_start` without its end yet): what is
    /// issued now reaches the stream only at the group's end.
    pub(crate) fn in_group(&self) -> bool {
        self.inner.group.lock().unwrap_or_else(|e| e.into_inner()).depth > 0
    }

    /// Close a group; the outermost end puts what was issued in it on the stream. If that fails,
    /// the group's operations can never start: they fail, and so does the condition (sticky).
    pub fn group_end(&self) -> Result<()> {
        let channel = self.sequenced_channel("group_end")?;
        let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
        match group.depth {
            0 => return Err(Error::invalid_param("group_end without group_start")),
            1 => {}
            _ => {
                group.depth -= 1;
                return Ok(());
            }
        }
        let g = std::mem::take(&mut *group);
        let mut result = self.flush_group(&channel, &g);
        if result.is_ok() && (!g.gpu_rounds.is_empty() || g.device_wait) {
            result = self.launch_group_gpu_rounds(&g.gpu_rounds, g.device_wait);
        }
        if let Err(e) = &result {
            channel.fail(e.clone());
            for c in g.captured_triggers.iter().chain(&g.captured_waits) {
                c.fail(e.clone());
            }
        }
        result
    }

    fn flush_group(&self, channel: &Arc<Channel>, g: &Group) -> Result<()> {
        if let Producer::CudaStream { stream, ctx } = self.inner.producer
            && (!g.captured_triggers.is_empty() || !g.captured_waits.is_empty())
        {
            let now = crate::cuda::capture_graph(stream)?.map(|gr| gr as usize);
            if now != g.graph {
                return Err(Error::invalid_param("group_end: the stream's capture ended (or began) inside the group"));
            }
            // One node: every trigger of the group, then every wait.
            let kernels = self.kernels(ctx)?;
            let (trig, wait) = (descs(&g.captured_triggers, StageDir::Send), descs(&g.captured_waits, StageDir::Recv));
            let fence = g.captured_triggers.iter().any(|c| c.orders);
            crate::cuda::launch_ops(&kernels, stream, &trig, &wait, fence)?;
        }
        match (g.trigger, g.wait) {
            (None, None) => Ok(()),
            (t, w) => self.enqueue(channel, t, w, &g.out, g.fence),
        }
    }

    /// For a CUDA stream condition: its CUstream.
    pub(crate) fn cuda_stream(&self) -> Result<usize> {
        match self.inner.producer {
            Producer::CudaStream { stream, .. } => Ok(stream),
            _ => Err(Error::invalid_param(format!("a {} condition has no CUDA stream", self.inner.category.name()))),
        }
    }

    /// For a graph condition: its CUgraph (nodes are added in the condition's context).
    pub(crate) fn cuda_graph(&self) -> Result<(usize, usize)> {
        match self.inner.producer {
            Producer::Graph { graph, ctx } => Ok((graph, ctx)),
            _ => Err(Error::invalid_param(format!("a {} condition has no CUDA graph", self.inner.category.name()))),
        }
    }

    /// For a CUDA stream condition: the stream and gscomm's kernels in its context (where
    /// prepared transfers' GPU rounds are launched, alone or as a group's; graph conditions add
    /// theirs as nodes instead, see `gpu_round`).
    pub(crate) fn stream_kernels(&self) -> Result<StreamKernels> {
        match self.inner.producer {
            Producer::CudaStream { stream, ctx } => Ok(StreamKernels { stream, kernels: self.kernels(ctx)? }),
            _ => Err(Error::unsupported(format!("a {} condition has no CUDA stream to launch GPU rounds on", self.inner.category.name()))),
        }
    }

    /// A prepared transfer's round on the GPU (`round`). On a stream condition see
    /// `stream_gpu_round` (no outputs). On a graph condition: one node that both starts and
    /// completes the round, handed back as the start and the done node for the user to wire (a
    /// receive's node announces readiness, waits and copies out, so there is no wait to defer:
    /// `deferred` is refused).
    pub(crate) fn gpu_round(&self, round: crate::cuda::PrepArgs, deferred: Option<crate::cuda::PrepArgs>) -> Result<ArmedOutputs> {
        match self.inner.producer {
            Producer::CudaStream { .. } => self.stream_gpu_round(round, deferred).map(|()| ArmedOutputs::default()),
            Producer::Graph { graph, ctx } => {
                if deferred.is_some() {
                    return Err(Error::invalid_param(
                        "a graph round has no stream wait to defer: a receive on a graph condition waits in its node (start it without no_stream_wait)",
                    ));
                }
                let kernels = self.kernels(ctx)?;
                // The graph's nodes are built in its condition's context (see `Producer::Graph`).
                let _scope = crate::cuda::CtxScope::enter(crate::cuda::raw(ctx))?;
                let node = crate::cuda::add_prep_node(&kernels, crate::cuda::raw(graph), &round)? as usize;
                Ok(ArmedOutputs { start_node: node, done_node: node, device_handle: 0 })
            }
            // Started by `prepared_kernel_handle` instead.
            Producer::KernelTriggered { .. } => Err(Error::new(Status::Internal, "a kernel-triggered GPU round has no node or launch")),
            Producer::Host(_) => Err(Error::unsupported(
                "a prepared transfer with GPU rounds cannot start on a host-stream condition: start it with no condition, on a \
                 CUDA stream, graph or kernel-triggered condition, or prepare it with the proxy engine (GSC_ENGINE=proxy)",
            )),
        }
    }

    /// For a kernel-triggered condition: a device handle, in the condition's context, on which
    /// the user's kernels run a prepared transfer's GPU rounds with `gsc_trigger` / `gsc_wait`
    /// (`descriptor`: that side's `gsc_prepared_device_t`). None for other categories.
    pub(crate) fn prepared_kernel_handle(&self, descriptor: u64, recv: bool) -> Result<Option<crate::cuda::DeviceHandleSlot>> {
        match self.inner.producer {
            Producer::KernelTriggered { ctx } => crate::cuda::DeviceHandleSlot::prepared(crate::cuda::raw(ctx), descriptor, recv).map(Some),
            _ => Ok(None),
        }
    }

    /// For a kernel-triggered condition: a device handle, in the condition's context, of a
    /// small collective the triggering thread runs itself (`coll`: its `gsc_coll_device_t`;
    /// `collectives::triggered`). An error for other categories.
    pub(crate) fn collective_kernel_handle(&self, coll: u64) -> Result<crate::cuda::DeviceHandleSlot> {
        match self.inner.producer {
            Producer::KernelTriggered { ctx } => crate::cuda::DeviceHandleSlot::collective(crate::cuda::raw(ctx), coll),
            _ => Err(Error::invalid_param(format!(
                "a collective's device handle is for kernel-triggered conditions, not {} ones",
                self.category().name()
            ))),
        }
    }

    /// A GPU round on this stream: launched now, or, in an open group, at its end together with
    /// the group's other rounds (one launch: every receive's readiness, then the sends, then the
    /// waits). `deferred`: a receive's wait that goes on the stream at the next `wait` instead.
    fn stream_gpu_round(&self, round: crate::cuda::PrepArgs, deferred: Option<crate::cuda::PrepArgs>) -> Result<()> {
        let sk = self.stream_kernels()?;
        if round.role != crate::cuda::PREP_SEND
            && round.role != crate::cuda::PREP_BEGIN
            && self.inner.device_waits.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|w| w.ctl == round.ctl)
        {
            // Its next readiness would let the sender overwrite a round nobody has waited for.
            return Err(Error::new(
                Status::Busy,
                "a round of this prepared receive still waits for Condition::wait (started without a stream wait)",
            ));
        }
        {
            let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
            if group.depth > 0 {
                group.gpu_rounds.push(round);
                if let Some(w) = deferred {
                    self.inner.device_waits.lock().unwrap_or_else(|e| e.into_inner()).push(w);
                }
                return Ok(());
            }
        }
        crate::cuda::launch_prep(&sk.kernels, sk.stream, &round)?;
        if let Some(w) = deferred {
            self.inner.device_waits.lock().unwrap_or_else(|e| e.into_inner()).push(w);
        }
        Ok(())
    }

    /// A group's GPU rounds (and, when `wait` was called in it, the deferred waits), ordered so
    /// that no side waits before it has said it is ready and sent: readies, sends, waits.
    fn launch_group_gpu_rounds(&self, rounds: &[crate::cuda::PrepArgs], with_waits: bool) -> Result<()> {
        use crate::cuda::{PREP_BEGIN, PREP_READY, PREP_READY_WAIT, PREP_SEND, PREP_WAIT};
        let mut deferred = Vec::new();
        if with_waits {
            deferred = std::mem::take(&mut *self.inner.device_waits.lock().unwrap_or_else(|e| e.into_inner()));
        }
        if rounds.is_empty() && deferred.is_empty() {
            return Ok(());
        }
        let begins = rounds.iter().filter(|r| r.role == PREP_BEGIN).copied();
        let readies = rounds
            .iter()
            .filter(|r| r.role == PREP_READY || r.role == PREP_READY_WAIT)
            .map(|r| crate::cuda::PrepArgs { role: PREP_READY, ..*r });
        let sends = rounds.iter().filter(|r| r.role == PREP_SEND).copied();
        let waits = rounds.iter().filter(|r| r.role == PREP_READY_WAIT).map(|r| crate::cuda::PrepArgs { role: PREP_WAIT, ..*r });
        let ops: Vec<crate::cuda::PrepArgs> = begins.chain(readies).chain(sends).chain(waits).chain(deferred).collect();
        let sk = self.stream_kernels()?;
        crate::cuda::launch_prep_group(&sk.kernels, sk.stream, &ops)
    }

    fn launch_device_waits(&self) -> Result<()> {
        let waits = std::mem::take(&mut *self.inner.device_waits.lock().unwrap_or_else(|e| e.into_inner()));
        if waits.is_empty() {
            return Ok(());
        }
        let sk = self.stream_kernels()?;
        crate::cuda::launch_prep_group(&sk.kernels, sk.stream, &waits)
    }

    fn kernels(&self, ctx: usize) -> Result<crate::cuda::Kernels> {
        crate::cuda::Kernels::of(crate::cuda::raw(ctx), self.inner.kernel_cache.as_deref())
    }

    /// The kernels for a plain trigger and wait, or `None` for stream memops
    /// (`GSC_CUDA_WAIT_KERNEL`). Why a kernel: its one thread sees the completion word about 2 µs
    /// after the proxy writes it, where a memop wait that has lasted a while takes 4–12 µs (the
    /// GPU's front end polls host memory less often the longer it waits; docs/probes/
    /// wait_latency.py), and for a long transfer that is most of the proxy's cost per iteration.
    /// Under `auto` a compiler failure (no NVRTC) means memops, reported once.
    fn wait_kernels(&self, ctx: usize) -> Result<Option<crate::cuda::Kernels>> {
        use crate::config::Tristate;
        match crate::cuda::wait_kernel_mode() {
            Tristate::Off => Ok(None),
            Tristate::On => self.kernels(ctx).map(Some),
            Tristate::Auto => match self.kernels(ctx) {
                Ok(k) => Ok(Some(k)),
                Err(e) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| tracing::info!(target: "gsc::cuda", error = %e, "stream waits use memops: no kernels"));
                    Ok(None)
                }
            },
        }
    }

    /// A fresh channel of its own for one persistent operation, its device handle in GPU memory
    /// of `ctx` (kernels read and bump its epoch there, not over PCIe; allocating it is allowed
    /// even while the stream is being captured: `cuda::with_relaxed_capture`).
    fn persistent_channel(&self, ctx: usize, stage: Option<&Arc<Stage>>, orders: bool) -> Result<Arc<Channel>> {
        let _scope = crate::cuda::CtxScope::enter(crate::cuda::raw(ctx))?;
        let slot = crate::cuda::PinnedSlot::take()?;
        Channel::persistent(Words::pinned(slot), Some(ctx), stage.cloned(), orders)
    }

    /// A staging slot for an operation of this condition on the GPU buffer `addr..addr+len`, if
    /// it is staged (see `stage`): 1 to `max` bytes, on a stream or graph condition.
    pub(crate) fn stage_for(&self, dir: StageDir, addr: usize, len: usize, max: usize) -> Result<Option<Arc<Stage>>> {
        let ctx = match self.inner.producer {
            Producer::CudaStream { ctx, .. } | Producer::Graph { ctx, .. } => ctx,
            Producer::KernelTriggered { .. } | Producer::Host(_) => return Ok(None),
        };
        let room = Stage::room(dir, len);
        if len == 0 || len > max || room > crate::config::CUDA_STAGE_LIMIT {
            return Ok(None);
        }
        let zero = room - len;
        let slot = crate::cuda::StageSlot::take(room, zero, crate::cuda::raw(ctx))?;
        Ok(Some(Arc::new(Stage::new(slot, dir, addr, len))))
    }

    fn sequenced_channel(&self, what: &str) -> Result<Arc<Channel>> {
        self.inner.channel.clone().ok_or_else(|| {
            Error::invalid_param(format!(
                "{what}: a {} condition has no stream order (each operation has its own nodes)",
                self.inner.category.name()
            ))
        })
    }

    /// Arm one operation: number it and give the producer its trigger (and, unless
    /// `stream_wait` is false, the wait for its completion), with the copies of its staging
    /// slot if it has one (`stage_for`). Nothing is changed on error.
    ///
    /// `orders`: the operation sends data from memory the producer's earlier work may have
    /// written and that carries no flags of its own (a send or put that is not staged): a
    /// kernel of ours that triggers it fences at system scope first. (Stream memops order
    /// themselves; staged sends are ordered by their kernel.)
    pub(crate) fn issue(&self, stream_wait: bool, stage: Option<&Arc<Stage>>, orders: bool) -> Result<Issued> {
        match self.inner.producer {
            Producer::CudaStream { stream, ctx } => {
                if let Some(graph) = crate::cuda::capture_graph(stream)? {
                    return self.issue_captured(stream, ctx, graph as usize, stream_wait, stage, orders);
                }
            }
            Producer::Graph { graph, ctx } => return self.issue_graph(graph, ctx, stage, orders),
            Producer::KernelTriggered { ctx } if stage.is_none() => return self.issue_kernel_triggered(ctx),
            Producer::KernelTriggered { .. } => return Err(Error::new(Status::Internal, "kernel-triggered operations are never staged")),
            Producer::Host(_) => {}
        }
        match &self.inner.channel {
            Some(channel) => {
                let mut issued = channel.issue.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(e) = channel.error() {
                    return Err(e.context("the condition failed earlier; no further operation is issued on it"));
                }
                let seq = *issued + 1;
                let out: Vec<OpDesc> = stage.filter(|s| s.dir == StageDir::Send).map(|s| s.desc(0)).into_iter().collect();
                let staged_in = stage.filter(|s| s.dir == StageDir::Recv).map(|s| (seq, s.desc(0)));
                // Waits find staged receives here, this operation's own wait included.
                let pending_in = |add: bool| {
                    let mut p = self.inner.pending_in.lock().unwrap_or_else(|e| e.into_inner());
                    match staged_in {
                        Some(e) if add => p.push(e),
                        Some((seq, _)) => p.retain(|(s, _)| *s != seq),
                        None => {}
                    }
                };
                pending_in(true);
                let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
                if group.depth > 0 {
                    group.trigger = Some(seq);
                    group.out.extend(out);
                    group.fence |= orders;
                    if stream_wait {
                        group.wait = Some(seq);
                    }
                } else if let Err(e) = self.enqueue(channel, Some(seq), stream_wait.then_some(seq), &out, orders) {
                    pending_in(false);
                    return Err(e);
                }
                *issued = seq;
                Ok(Issued::Sequenced(channel.clone(), seq))
            }
            None => Err(Error::new(Status::Internal, "a sequenced producer without a channel")),
        }
    }

    /// Put a trigger write and/or a done wait on the producer, with the staged sends `out`
    /// copied before the trigger and the staged receives the wait covers copied after it
    /// (`fence`: see `issue`'s `orders`).
    fn enqueue(&self, channel: &Arc<Channel>, trigger: Option<u64>, wait: Option<u64>, out: &[OpDesc], fence: bool) -> Result<()> {
        match &self.inner.producer {
            Producer::Host(stream) => {
                let items = trigger.map(|k| Item::Trigger(channel.clone(), k)).into_iter();
                stream.push_all(items.chain(wait.map(|k| Item::Wait(channel.clone(), k))));
                Ok(())
            }
            Producer::CudaStream { stream, ctx } => {
                let (t, d) = channel.words.device.expect("stream channels use mapped words");
                let inn = wait.map(|w| self.take_pending_in(w)).unwrap_or_default();
                let kernels = if out.is_empty() && inn.is_empty() { self.wait_kernels(*ctx) } else { self.kernels(*ctx).map(Some) };
                let result = kernels.and_then(|kernels| match kernels {
                    // Nothing staged and no kernel wanted (or none to be had): stream memops.
                    None => match trigger {
                        Some(k) => crate::cuda::enqueue_trigger_wait(*stream, t, k, wait.map(|w| (d, w))),
                        None => wait.map_or(Ok(()), |w| crate::cuda::enqueue_wait(*stream, d, w)),
                    },
                    Some(k) if out.is_empty() && inn.is_empty() => {
                        crate::cuda::launch_sync(&k, *stream, trigger.map(|k| (t, k)), wait.map(|w| (d, w)), fence)
                    }
                    Some(k) => {
                        let descs: Vec<OpDesc> = inn.iter().map(|(_, op)| *op).collect();
                        crate::cuda::launch_seq(&k, *stream, trigger.map(|k| (t, k)), wait.map(|w| (d, w)), out, &descs, fence)
                    }
                });
                if result.is_err() {
                    // Not enqueued: a later wait must still copy them.
                    self.inner.pending_in.lock().unwrap_or_else(|e| e.into_inner()).extend(inn);
                }
                result
            }
            Producer::Graph { .. } | Producer::KernelTriggered { .. } => {
                Err(Error::new(Status::Internal, "graph and kernel conditions have no stream to enqueue on"))
            }
        }
    }

    /// The staged receives of the sequenced channel numbered up to `upto`, taken for a wait.
    fn take_pending_in(&self, upto: u64) -> Vec<(u64, OpDesc)> {
        let mut pending = self.inner.pending_in.lock().unwrap_or_else(|e| e.into_inner());
        let (covered, later): (Vec<_>, Vec<_>) = pending.drain(..).partition(|(seq, _)| *seq <= upto);
        *pending = later;
        covered
    }

    /// An operation issued on a stream under capture: a replay-safe `gsc_ops_kernel` node that
    /// bumps the device epoch and fires the trigger, then (with a stream wait) waits for that
    /// epoch; in a group, the group's one node at `group_end` does both for all its operations.
    fn issue_captured(
        &self,
        stream: usize,
        ctx: usize,
        graph: usize,
        stream_wait: bool,
        stage: Option<&Arc<Stage>>,
        orders: bool,
    ) -> Result<Issued> {
        let kernels = self.kernels(ctx)?;
        let channel = self.persistent_channel(ctx, stage, orders)?;
        let mut group = self.inner.group.lock().unwrap_or_else(|e| e.into_inner());
        if group.depth > 0 {
            if group.graph.is_some_and(|g| g != graph) {
                return Err(Error::invalid_param("a group's operations must all be captured into one graph"));
            }
            group.graph = Some(graph);
            group.captured_triggers.push(channel.clone());
            if stream_wait {
                group.captured_waits.push(channel.clone());
            } else {
                self.inner.captured_unwaited.lock().unwrap_or_else(|e| e.into_inner()).push(channel.clone());
            }
        } else {
            let one = std::slice::from_ref(&channel);
            let wait = if stream_wait { descs(one, StageDir::Recv) } else { Vec::new() };
            crate::cuda::launch_ops(&kernels, stream, &descs(one, StageDir::Send), &wait, orders)?;
            if !stream_wait {
                self.inner.captured_unwaited.lock().unwrap_or_else(|e| e.into_inner()).push(channel.clone());
            }
        }
        drop(group);
        crate::cuda::tie_to_graph(crate::cuda::raw(graph), channel.clone())?;
        self.remember(&channel, false);
        Ok(Issued::Persistent(channel, ArmedOutputs::default()))
    }

    /// A graph operation: a trigger node and a done node after it, owned by the graph.
    fn issue_graph(&self, graph: usize, ctx: usize, stage: Option<&Arc<Stage>>, orders: bool) -> Result<Issued> {
        let kernels = self.kernels(ctx)?;
        let channel = self.persistent_channel(ctx, stage, orders)?;
        let one = std::slice::from_ref(&channel);
        let g = crate::cuda::raw(graph);
        let (start, start_last) = crate::cuda::add_ops_nodes(&kernels, g, &descs(one, StageDir::Send), &[], &[], orders)?;
        let (_, done) = crate::cuda::add_ops_nodes(&kernels, g, &[], &descs(one, StageDir::Recv), &[start_last], false)?;
        crate::cuda::tie_to_graph(g, channel.clone())?;
        self.remember(&channel, false);
        Ok(Issued::Persistent(channel, ArmedOutputs { start_node: start as usize, done_node: done as usize, device_handle: 0 }))
    }

    /// A kernel-triggered operation: the device handle, kept alive by the condition.
    fn issue_kernel_triggered(&self, ctx: usize) -> Result<Issued> {
        let (channel, handle) = self.device_handle_channel(ctx)?;
        Ok(Issued::Persistent(channel, ArmedOutputs { device_handle: handle, ..Default::default() }))
    }

    /// For an operation another part of gscomm performs on every trigger of a kernel-triggered
    /// condition (a collective: `collectives::triggered`, not the worker's proxy): a channel of
    /// its own, kept alive by the condition as the worker's are, and its device handle.
    pub(crate) fn arm_device_handle(&self) -> Result<(Arc<Channel>, u64)> {
        match self.inner.producer {
            Producer::KernelTriggered { ctx } => self.device_handle_channel(ctx),
            _ => Err(Error::invalid_param(format!(
                "a device handle is armed on kernel-triggered conditions, not {} ones",
                self.category().name()
            ))),
        }
    }

    fn device_handle_channel(&self, ctx: usize) -> Result<(Arc<Channel>, u64)> {
        // The user's kernel triggers it: ordering its data is the user's `gsc_trigger`'s job.
        let channel = self.persistent_channel(ctx, None, false)?;
        let handle = channel.words.device_handle().expect("pinned");
        self.remember(&channel, true);
        Ok((channel, handle))
    }

    fn remember(&self, channel: &Arc<Channel>, keep: bool) {
        let mut armed = self.inner.armed.lock().unwrap_or_else(|e| e.into_inner());
        armed.retain(|w| w.strong_count() > 0);
        armed.push(Arc::downgrade(channel));
        if keep {
            self.inner.keep.lock().unwrap_or_else(|e| e.into_inner()).push(channel.clone());
        }
    }
}

/// Persistent operations as the kernels see them at their trigger (`Send`: a staged send's slot
/// is filled there) or at their wait (`Recv`: a staged receive's slot is emptied there).
fn descs(channels: &[Arc<Channel>], at: StageDir) -> Vec<OpDesc> {
    channels
        .iter()
        .map(|c| {
            let handle = c.words.device_handle().expect("persistent channels have a device handle");
            match &c.stage {
                Some(s) if s.dir == at => s.desc(handle),
                _ => OpDesc { handle, ..Default::default() },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;

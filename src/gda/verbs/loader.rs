//! libibverbs and libmlx5, opened at run time, and the thin safe layer over the verbs the engine
//! calls. Every `unsafe` block of the verbs engine is in this file (the generated declarations
//! are in `sys`).
//!
//! Why at run time: building gscomm must not need rdma-core, and a machine without a NIC must
//! run everything else. `libibverbs.so.1` is opened with `dlopen` the first time verbs are
//! used (`verbs()`); if it is absent that is an error value, `LibraryMissing`, which discovery
//! reports as "no RDMA NIC". Every symbol is looked up once; a missing one is an `Unsupported`
//! error when the verb is called (and a capability bit), never a failure at load.
//! `libmlx5.so.1` is optional the same way: without it there is no `mlx5dv_init_obj`, so no
//! direct WQE/doorbell access, but discovery and registration still work.
//!
//! Function *types* come from bindgen (`sys::*_fn`); the pointers from `dlsym`. Two verbs are
//! `static inline` in verbs.h and are not symbols at all:
//! - `ibv_post_send` calls `qp->context->ops.post_send`: `Qp::post_send` does the same through
//!   the context's ops table.
//! - `ibv_reg_mr` is a macro that picks the exported `ibv_reg_mr` unless the access flags use
//!   the optional range (`IBV_ACCESS_RELAXED_ORDERING`), in which case it calls
//!   `ibv_reg_mr_iova2(pd, addr, len, addr, access)`: `ProtectionDomain::register` does the same.
//! - `ibv_query_port` is a macro over the exported `ibv_query_port`, which takes the older,
//!   shorter `_compat_ibv_port_attr`; like the macro's fallback we zero a full
//!   `ibv_port_attr` and pass it (the exported function fills the common prefix).
//!
//! None of the resource code here (contexts, PDs, MRs, CQs, QPs, the mlx5 views, the host
//! doorbell) has run against a NIC: see docs/GDA.md, "Not yet run on hardware".

use std::collections::HashMap;
use std::ffi::{CStr, c_int, c_void};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, OnceLock};

use super::discover::{DeviceInfo, LinkLayer, PortInfo, PortState};
use super::flush::{Buffer, FlushMemory, Place, Registration};
use super::mlx5::{self, CQE_SIZE, Cqe, CqeFault, cqe_offset};
use super::queue::{CompletionQueue, Doorbell, PREPARED_OP_OWN, SendQueue, SendQueueShape, WorkOp, WorkRequest};
use super::sys;
use crate::dynlib::Library;
use crate::error::{Error, Result, Status};

/// The verbs library, by its ABI soname.
pub const LIBIBVERBS: &str = "libibverbs.so.1";
/// The mlx5 provider, for the `mlx5dv_*` direct-verbs entry points.
pub const LIBMLX5: &str = "libmlx5.so.1";

/// `Library::function` typed with bindgen's `sys::NAME_fn` for the C function `NAME`: the
/// name looked up and the signature come from one identifier, so they cannot disagree.
macro_rules! sym {
    ($lib:expr, $fn_type:ident) => {
        $lib.function::<sys::$fn_type>(stringify!($fn_type).strip_suffix("_fn").expect("a sys::*_fn type"))
    };
}

/// libibverbs entry points. All optional at load; `need` turns a missing one into an error.
struct IbvFns {
    get_device_list: Option<sys::ibv_get_device_list_fn>,
    free_device_list: Option<sys::ibv_free_device_list_fn>,
    get_device_name: Option<sys::ibv_get_device_name_fn>,
    open_device: Option<sys::ibv_open_device_fn>,
    close_device: Option<sys::ibv_close_device_fn>,
    query_device: Option<sys::ibv_query_device_fn>,
    query_port: Option<sys::ibv_query_port_fn>,
    query_gid: Option<sys::ibv_query_gid_fn>,
    alloc_pd: Option<sys::ibv_alloc_pd_fn>,
    dealloc_pd: Option<sys::ibv_dealloc_pd_fn>,
    reg_mr: Option<sys::ibv_reg_mr_fn>,
    reg_mr_iova2: Option<sys::ibv_reg_mr_iova2_fn>,
    reg_dmabuf_mr: Option<sys::ibv_reg_dmabuf_mr_fn>,
    dereg_mr: Option<sys::ibv_dereg_mr_fn>,
    create_cq: Option<sys::ibv_create_cq_fn>,
    destroy_cq: Option<sys::ibv_destroy_cq_fn>,
    create_qp: Option<sys::ibv_create_qp_fn>,
    modify_qp: Option<sys::ibv_modify_qp_fn>,
    destroy_qp: Option<sys::ibv_destroy_qp_fn>,
}

/// libmlx5 direct-verbs entry points.
struct Mlx5Fns {
    init_obj: Option<sys::mlx5dv_init_obj_fn>,
    is_supported: Option<sys::mlx5dv_is_supported_fn>,
}

/// What the loaded rdma-core offers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `ibv_reg_dmabuf_mr` (rdma-core 34+): GPU memory registration through a dmabuf.
    pub dmabuf: bool,
    /// `ibv_reg_mr_iova2` (rdma-core 30+): registration with relaxed ordering.
    pub relaxed_ordering: bool,
    /// libmlx5 with `mlx5dv_init_obj`: direct access to WQE rings, doorbells and CQ buffers.
    pub mlx5dv: bool,
}

/// The loaded verbs libraries.
pub struct Verbs {
    ibverbs: Library,
    mlx5: Result<(Library, Mlx5Fns), String>,
    f: IbvFns,
}

/// The process's verbs, loaded on first use. `Err(LibraryMissing)` where rdma-core is absent.
pub fn verbs() -> Result<&'static Verbs> {
    static VERBS: OnceLock<Result<Verbs>> = OnceLock::new();
    VERBS.get_or_init(|| Verbs::load(LIBIBVERBS, LIBMLX5)).as_ref().map_err(Clone::clone)
}

fn need<T>(f: Option<T>, lib: &str, symbol: &str) -> Result<T> {
    f.ok_or_else(|| Error::unsupported(format!("{lib} has no {symbol} (rdma-core too old?)")))
}

/// An error from a verb that returned NULL and set errno.
fn os_error(what: &str) -> Error {
    errno_error(what, std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// An error from a verb that returned a status: an errno value, or -1 with errno set.
fn rc_error(what: &str, rc: c_int) -> Error {
    let errno = if rc > 0 { rc } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) };
    errno_error(what, errno)
}

fn errno_error(what: &str, errno: i32) -> Error {
    let io = std::io::Error::from_raw_os_error(errno);
    let hint = if errno == libc::ENOMEM && what.contains("reg") { " (locked-memory limit? see ulimit -l)" } else { "" };
    let status = match errno {
        libc::ENOMEM => Status::NoMemory,
        libc::EOPNOTSUPP | libc::ENOSYS => Status::Unsupported,
        _ => Status::DeviceError,
    };
    Error::new(status, format!("{what}: {io}{hint}"))
}

impl Verbs {
    /// Open `ibverbs` (and, if present, `mlx5`) by name. `verbs()` uses the sonames; tests
    /// pass names that do not exist.
    pub fn load(ibverbs: &str, mlx5: &str) -> Result<Verbs> {
        let lib = Library::open(ibverbs).map_err(|why| Error::new(Status::LibraryMissing, format!("{ibverbs} not found: {why}")))?;
        // SAFETY (each `sym!`): the type is bindgen's pointer type generated for that very name.
        let f = unsafe {
            IbvFns {
                get_device_list: sym!(lib, ibv_get_device_list_fn),
                free_device_list: sym!(lib, ibv_free_device_list_fn),
                get_device_name: sym!(lib, ibv_get_device_name_fn),
                open_device: sym!(lib, ibv_open_device_fn),
                close_device: sym!(lib, ibv_close_device_fn),
                query_device: sym!(lib, ibv_query_device_fn),
                query_port: sym!(lib, ibv_query_port_fn),
                query_gid: sym!(lib, ibv_query_gid_fn),
                alloc_pd: sym!(lib, ibv_alloc_pd_fn),
                dealloc_pd: sym!(lib, ibv_dealloc_pd_fn),
                reg_mr: sym!(lib, ibv_reg_mr_fn),
                reg_mr_iova2: sym!(lib, ibv_reg_mr_iova2_fn),
                reg_dmabuf_mr: sym!(lib, ibv_reg_dmabuf_mr_fn),
                dereg_mr: sym!(lib, ibv_dereg_mr_fn),
                create_cq: sym!(lib, ibv_create_cq_fn),
                destroy_cq: sym!(lib, ibv_destroy_cq_fn),
                create_qp: sym!(lib, ibv_create_qp_fn),
                modify_qp: sym!(lib, ibv_modify_qp_fn),
                destroy_qp: sym!(lib, ibv_destroy_qp_fn),
            }
        };
        let mlx5 = Library::open(mlx5).map(|m| {
            // SAFETY: as above, for libmlx5's header.
            let fns = unsafe { Mlx5Fns { init_obj: sym!(m, mlx5dv_init_obj_fn), is_supported: sym!(m, mlx5dv_is_supported_fn) } };
            (m, fns)
        });
        Ok(Verbs { ibverbs: lib, mlx5, f })
    }

    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            dmabuf: self.f.reg_dmabuf_mr.is_some(),
            relaxed_ordering: self.f.reg_mr_iova2.is_some(),
            mlx5dv: matches!(&self.mlx5, Ok((_, fns)) if fns.init_obj.is_some()),
        }
    }

    /// Why libmlx5 is not usable, if it is not.
    pub fn mlx5_missing(&self) -> Option<String> {
        match &self.mlx5 {
            Ok((_, fns)) if fns.init_obj.is_some() => None,
            Ok((m, _)) => Some(format!("{} has no mlx5dv_init_obj", m.name)),
            Err(why) => Some(why.clone()),
        }
    }

    fn ibv<T>(&self, f: Option<T>, symbol: &str) -> Result<T> {
        need(f, &self.ibverbs.name, symbol)
    }

    /// Every RDMA device with its ports, each opened and closed again. `Ok(vec![])` when the
    /// library is there but there are no devices.
    pub fn devices(&'static self) -> Result<Vec<DeviceInfo>> {
        let list = DeviceList::get(self)?;
        let mut out = Vec::with_capacity(list.len());
        for &dev in list.devices() {
            out.push(self.describe(dev));
        }
        Ok(out)
    }

    fn device_name(&self, dev: *mut sys::ibv_device) -> Result<String> {
        let get_name = self.ibv(self.f.get_device_name, "ibv_get_device_name")?;
        // SAFETY: `dev` is an entry of a live device list; the name is NUL-terminated and owned
        // by the device.
        let name = unsafe { get_name(dev) };
        if name.is_null() {
            return Err(Error::new(Status::DeviceError, "ibv_get_device_name returned NULL"));
        }
        // SAFETY: non-null, NUL-terminated (above).
        Ok(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
    }

    fn describe(&'static self, dev: *mut sys::ibv_device) -> DeviceInfo {
        let name = self.device_name(dev).unwrap_or_else(|e| format!("<{e}>"));
        let mut info = DeviceInfo { name, fw_ver: None, mlx5: None, ports: Vec::new(), error: None };
        if let Ok((_, fns)) = &self.mlx5
            && let Some(is_supported) = fns.is_supported
        {
            // SAFETY: `dev` is an entry of a live device list.
            info.mlx5 = Some(unsafe { is_supported(dev) });
        }
        match self.open_raw(dev) {
            Ok(ctx) => {
                if let Err(e) = self.fill_ports(&ctx, &mut info) {
                    info.error = Some(e.to_string());
                }
            }
            Err(e) => info.error = Some(e.to_string()),
        }
        info
    }

    fn fill_ports(&self, ctx: &Context, info: &mut DeviceInfo) -> Result<()> {
        let query_device = self.ibv(self.f.query_device, "ibv_query_device")?;
        // SAFETY: plain C data; all-zero is a valid value.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { query_device(ctx.raw.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(rc_error("ibv_query_device", rc));
        }
        // SAFETY: fw_ver is a NUL-terminated array filled by the provider (zeroed before).
        let fw: Vec<u8> = attr.fw_ver.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
        info.fw_ver = Some(String::from_utf8_lossy(&fw).into_owned());
        for port in 1..=attr.phys_port_cnt {
            info.ports.push(ctx.query_port(port)?);
        }
        Ok(())
    }

    /// Open device `dev` (an entry of a live device list).
    fn open_raw(&'static self, dev: *mut sys::ibv_device) -> Result<Context> {
        let open = self.ibv(self.f.open_device, "ibv_open_device")?;
        self.ibv(self.f.close_device, "ibv_close_device")?;
        let name = self.device_name(dev)?;
        // SAFETY: `dev` is an entry of a live device list; the context outlives the list.
        let raw = unsafe { open(dev) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error(&format!("ibv_open_device({name})")))?;
        Ok(Context { verbs: self, raw, name })
    }

    /// Open the RDMA device called `name` (as `ibv_devices` lists it, e.g. `mlx5_0`).
    pub fn open(&'static self, name: &str) -> Result<Arc<Context>> {
        let list = DeviceList::get(self)?;
        let mut names = Vec::new();
        for &dev in list.devices() {
            let n = self.device_name(dev)?;
            if n == name {
                return self.open_raw(dev).map(Arc::new);
            }
            names.push(n);
        }
        let have = if names.is_empty() { "none".to_string() } else { names.join(", ") };
        Err(Error::new(Status::NoDevice, format!("no RDMA device named {name} (devices: {have})")))
    }
}

/// The array `ibv_get_device_list` returns, freed on drop.
struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl<'a> DeviceList<'a> {
    fn get(verbs: &'a Verbs) -> Result<DeviceList<'a>> {
        let get = verbs.ibv(verbs.f.get_device_list, "ibv_get_device_list")?;
        verbs.ibv(verbs.f.free_device_list, "ibv_free_device_list")?;
        let mut n: c_int = 0;
        // SAFETY: a valid out-pointer.
        let list = unsafe { get(&mut n) };
        let list = NonNull::new(list).ok_or_else(|| {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            let e = errno_error("ibv_get_device_list", errno);
            if errno == libc::ENOSYS {
                // libibverbs says ENOSYS when /sys/class/infiniband_verbs is absent.
                e.context("the kernel has no RDMA verbs support (ib_uverbs not loaded, or no RDMA driver)")
            } else {
                e
            }
        })?;
        Ok(DeviceList { verbs, list, len: usize::try_from(n).unwrap_or(0) })
    }

    fn len(&self) -> usize {
        self.len
    }

    fn devices(&self) -> &[*mut sys::ibv_device] {
        // SAFETY: libibverbs returns an array of `n` device pointers (NULL-terminated), valid
        // until ibv_free_device_list, which only our Drop calls.
        unsafe { std::slice::from_raw_parts(self.list.as_ptr(), self.len) }
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if let Some(free) = self.verbs.f.free_device_list {
            // SAFETY: the list came from ibv_get_device_list and is freed once. Opened
            // contexts stay valid (libibverbs keeps devices referenced while open).
            unsafe { free(self.list.as_ptr()) };
        }
    }
}

fn port_info(port: u8, a: &sys::ibv_port_attr) -> PortInfo {
    use sys::ibv_port_state as st;
    let state = match a.state {
        st::IBV_PORT_DOWN => PortState::Down,
        st::IBV_PORT_INIT => PortState::Init,
        st::IBV_PORT_ARMED => PortState::Armed,
        st::IBV_PORT_ACTIVE => PortState::Active,
        st::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
        other => PortState::Other(other),
    };
    let link_layer = match u32::from(a.link_layer) {
        sys::_bindgen_ty_13::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
        sys::_bindgen_ty_13::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
        _ => LinkLayer::Unspecified,
    };
    PortInfo {
        port,
        state,
        link_layer,
        active_mtu: mtu_bytes(a.active_mtu),
        lid: a.lid,
        active_width: a.active_width,
        active_speed: a.active_speed,
    }
}

/// Bytes of an `ibv_mtu` value (0 for an unknown one).
fn mtu_bytes(mtu: sys::ibv_mtu::Type) -> u32 {
    match mtu {
        1..=5 => 128 << mtu,
        _ => 0,
    }
}

fn mtu_enum(bytes: u32) -> Result<sys::ibv_mtu::Type> {
    match bytes {
        256 => Ok(sys::ibv_mtu::IBV_MTU_256),
        512 => Ok(sys::ibv_mtu::IBV_MTU_512),
        1024 => Ok(sys::ibv_mtu::IBV_MTU_1024),
        2048 => Ok(sys::ibv_mtu::IBV_MTU_2048),
        4096 => Ok(sys::ibv_mtu::IBV_MTU_4096),
        _ => Err(Error::invalid_param(format!("path MTU {bytes}: expected 256, 512, 1024, 2048 or 4096"))),
    }
}

/// An open RDMA device (`ibv_context`), closed when the last holder drops it.
pub struct Context {
    verbs: &'static Verbs,
    raw: NonNull<sys::ibv_context>,
    name: String,
}

// SAFETY: verbs objects may be used from any thread: the verbs API is thread-safe and the
// providers lock what they share.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn verbs(&self) -> &'static Verbs {
        self.verbs
    }

    pub fn query_port(&self, port: u8) -> Result<PortInfo> {
        let query = self.verbs.ibv(self.verbs.f.query_port, "ibv_query_port")?;
        // SAFETY: plain C data; all-zero is valid (and what the header's macro passes).
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context; the exported ibv_query_port fills the `_compat_ibv_port_attr`
        // prefix of the larger `ibv_port_attr` (verbs.h's `___ibv_query_port` fallback does the
        // same cast).
        let rc = unsafe { query(self.raw.as_ptr(), port, (&mut attr as *mut sys::ibv_port_attr).cast()) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_query_port({}, {port})", self.name), rc));
        }
        Ok(port_info(port, &attr))
    }

    /// GID `index` of `port` (RoCE addressing), as 16 bytes in network order.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        let query = self.verbs.ibv(self.verbs.f.query_gid, "ibv_query_gid")?;
        // SAFETY: plain C data.
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { query(self.raw.as_ptr(), port, c_int::from(index), &mut gid) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_query_gid({}, {port}, {index})", self.name), rc));
        }
        // SAFETY: every bit pattern of the union is a valid `raw`.
        Ok(unsafe { gid.raw })
    }

    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        let alloc = self.verbs.ibv(self.verbs.f.alloc_pd, "ibv_alloc_pd")?;
        self.verbs.ibv(self.verbs.f.dealloc_pd, "ibv_dealloc_pd")?;
        // SAFETY: a live context.
        let raw = unsafe { alloc(self.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error(&format!("ibv_alloc_pd({})", self.name)))?;
        Ok(Arc::new(ProtectionDomain { ctx: self.clone(), raw }))
    }

    /// A completion queue of at least `entries` CQEs, with no completion channel.
    pub fn create_cq(self: &Arc<Self>, entries: u32) -> Result<Arc<Cq>> {
        let create = self.verbs.ibv(self.verbs.f.create_cq, "ibv_create_cq")?;
        self.verbs.ibv(self.verbs.f.destroy_cq, "ibv_destroy_cq")?;
        let n = c_int::try_from(entries).map_err(|_| Error::invalid_param(format!("CQ of {entries} entries")))?;
        // SAFETY: a live context; no user context, no channel, vector 0.
        let raw = unsafe { create(self.raw.as_ptr(), n, ptr::null_mut(), ptr::null_mut(), 0) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error(&format!("ibv_create_cq({}, {entries})", self.name)))?;
        Ok(Arc::new(Cq { ctx: self.clone(), raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(close) = self.verbs.f.close_device {
            // SAFETY: opened by ibv_open_device, closed once; every child holds an Arc to it, so
            // none is alive.
            let rc = unsafe { close(self.raw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(target: "gsc::gda", error = %rc_error("ibv_close_device", rc), device = %self.name, "closing an RDMA device failed");
            }
        }
    }
}

/// Memory access rights of a registration (`ibv_access_flags`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE);
    pub const REMOTE_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE);
    pub const REMOTE_READ: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ);
    /// PCIe relaxed ordering for the NIC's accesses (an "optional" flag: see `register`).
    pub const RELAXED_ORDERING: Access = Access(sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING);
    /// What flush buffers and RDMA targets need: local write, remote read and write.
    pub const RDMA: Access = Access(
        sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ,
    );

    pub fn bits(self) -> u32 {
        self.0
    }

    fn is_optional(self) -> bool {
        self.0 & sys::ib_uverbs_access_flags::IB_UVERBS_ACCESS_OPTIONAL_RANGE != 0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A protection domain (`ibv_pd`).
pub struct ProtectionDomain {
    ctx: Arc<Context>,
    raw: NonNull<sys::ibv_pd>,
}

// SAFETY: see `Context`.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Context`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn verbs(&self) -> &'static Verbs {
        self.ctx.verbs
    }

    /// Register host memory (`ibv_reg_mr`, or `ibv_reg_mr_iova2` for optional access flags,
    /// as verbs.h's `ibv_reg_mr` macro does).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay allocated until the region is deregistered or dropped;
    /// with remote access rights, the NIC may write it at any time until then.
    pub unsafe fn register(self: &Arc<Self>, addr: *mut c_void, len: usize, access: Access) -> Result<MemoryRegion> {
        let v = self.verbs();
        v.ibv(v.f.dereg_mr, "ibv_dereg_mr")?;
        let raw = if access.is_optional() {
            let reg = v.ibv(v.f.reg_mr_iova2, "ibv_reg_mr_iova2")?;
            // SAFETY: a live PD; the range is valid (caller).
            unsafe { reg(self.raw.as_ptr(), addr, len, addr as u64, access.0) }
        } else {
            let reg = v.ibv(v.f.reg_mr, "ibv_reg_mr")?;
            // SAFETY: a live PD; the range is valid (caller).
            unsafe { reg(self.raw.as_ptr(), addr, len, access.0 as c_int) }
        };
        let raw = NonNull::new(raw).ok_or_else(|| os_error(&format!("ibv_reg_mr({addr:p}, {len})")))?;
        Ok(MemoryRegion::new(self.clone(), raw))
    }

    /// Register GPU memory exported as a dmabuf (`ibv_reg_dmabuf_mr`): `len` bytes at `offset`
    /// in the dmabuf `fd`, addressed by the NIC as `iova` (pass the device pointer, so remote
    /// addresses are device pointers). The fd may be closed afterwards: the registration holds
    /// its own reference.
    ///
    /// # Safety
    /// The GPU memory must stay allocated until the region is deregistered or dropped.
    pub unsafe fn register_dmabuf(self: &Arc<Self>, fd: RawFd, offset: u64, len: usize, iova: u64, access: Access) -> Result<MemoryRegion> {
        let v = self.verbs();
        let reg = v.ibv(v.f.reg_dmabuf_mr, "ibv_reg_dmabuf_mr")?;
        v.ibv(v.f.dereg_mr, "ibv_dereg_mr")?;
        // SAFETY: a live PD; the fd and range are valid (caller).
        let raw = unsafe { reg(self.raw.as_ptr(), offset, len, iova, fd, access.0 as c_int) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error(&format!("ibv_reg_dmabuf_mr(fd {fd}, {len} bytes at {iova:#x})")))?;
        Ok(MemoryRegion::new(self.clone(), raw))
    }

    /// A reliable-connected QP whose send and receive completions go to `cq`. It only sends
    /// (RDMA read/write): one receive entry is reserved because some providers refuse zero.
    pub fn create_rc_qp(self: &Arc<Self>, cq: &Arc<Cq>, caps: QpCaps) -> Result<Arc<Qp>> {
        let v = self.verbs();
        let create = v.ibv(v.f.create_qp, "ibv_create_qp")?;
        v.ibv(v.f.destroy_qp, "ibv_destroy_qp")?;
        v.ibv(v.f.modify_qp, "ibv_modify_qp")?;
        // SAFETY: plain C data; zero is "no SRQ, no context, defaults".
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw.as_ptr();
        init.recv_cq = cq.raw.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = caps.max_send_wr;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = caps.max_inline;
        // SAFETY: a live PD and CQ of the same context; `init` is fully initialized.
        let raw = unsafe { create(self.raw.as_ptr(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("ibv_create_qp(RC)"))?;
        Ok(Arc::new(Qp { pd: self.clone(), cq: cq.clone(), raw, max_inline: init.cap.max_inline_data }))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        if let Some(dealloc) = self.verbs().f.dealloc_pd {
            // SAFETY: allocated by ibv_alloc_pd, freed once; MRs and QPs hold an Arc to it.
            let rc = unsafe { dealloc(self.raw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(target: "gsc::gda", error = %rc_error("ibv_dealloc_pd", rc), "freeing a protection domain failed");
            }
        }
    }
}

/// A registered memory region (`ibv_mr`). `deregister` reports failure; dropping deregisters
/// too and logs a failure.
pub struct MemoryRegion {
    pd: Arc<ProtectionDomain>,
    raw: Option<NonNull<sys::ibv_mr>>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
}

// SAFETY: see `Context`.
unsafe impl Send for MemoryRegion {}
// SAFETY: see `Context`.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    fn new(pd: Arc<ProtectionDomain>, raw: NonNull<sys::ibv_mr>) -> MemoryRegion {
        // SAFETY: a region just returned by the provider; these fields are set and constant.
        let mr = unsafe { raw.as_ref() };
        MemoryRegion { addr: mr.addr as u64, len: mr.length, lkey: mr.lkey, rkey: mr.rkey, pd, raw: Some(raw) }
    }

    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// `ibv_mr.addr` as the library set it: the start address for host memory, but the dmabuf
    /// *offset* for a dmabuf registration (libibverbs stores the offset there; the NIC-visible
    /// address is the `iova` given at registration).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn deregister(mut self) -> Result<()> {
        self.dereg()
    }

    fn dereg(&mut self) -> Result<()> {
        let Some(raw) = self.raw.take() else { return Ok(()) };
        let dereg = self.pd.verbs().ibv(self.pd.verbs().f.dereg_mr, "ibv_dereg_mr")?;
        // SAFETY: registered by ibv_reg_*mr, deregistered once (`raw` was taken).
        let rc = unsafe { dereg(raw.as_ptr()) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_dereg_mr({:#x}, {} bytes)", self.addr, self.len), rc));
        }
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            tracing::warn!(target: "gsc::gda", error = %e, "deregistering a memory region failed");
        }
    }
}

/// A completion queue (`ibv_cq`).
pub struct Cq {
    ctx: Arc<Context>,
    raw: NonNull<sys::ibv_cq>,
}

// SAFETY: see `Context`.
unsafe impl Send for Cq {}
// SAFETY: see `Context`.
unsafe impl Sync for Cq {}

impl Cq {
    /// The CQ's buffer and doorbell record (`mlx5dv_init_obj`), for reading CQEs directly
    /// and for a stream to wait on them.
    pub fn mlx5(self: &Arc<Self>) -> Result<Mlx5Cq> {
        let init_obj = mlx5_init_obj(self.ctx.verbs)?;
        // SAFETY: plain C data.
        let mut dv: sys::mlx5dv_cq = unsafe { std::mem::zeroed() };
        // SAFETY: plain C data; only the CQ part is read for MLX5DV_OBJ_CQ.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.cq.in_ = self.raw.as_ptr();
        obj.cq.out = &mut dv;
        // SAFETY: a live CQ and valid out-pointers.
        let rc = unsafe { init_obj(&mut obj, u64::from(sys::mlx5dv_obj_type::MLX5DV_OBJ_CQ)) };
        if rc != 0 {
            return Err(rc_error("mlx5dv_init_obj(CQ) (not an mlx5 device?)", rc));
        }
        let buf = NonNull::new(dv.buf.cast::<u8>()).ok_or_else(|| Error::new(Status::DeviceError, "mlx5dv_cq.buf is NULL"))?;
        let dbrec = NonNull::new(dv.dbrec).ok_or_else(|| Error::new(Status::DeviceError, "mlx5dv_cq.dbrec is NULL"))?;
        let reader = CompletionQueue::new(dv.cqe_cnt, dv.cqe_size as usize)?;
        Ok(Mlx5Cq { cq: self.clone(), buf, dbrec, len: reader.ring_len(), cqe_cnt: dv.cqe_cnt, cqn: dv.cqn })
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if let Some(destroy) = self.ctx.verbs.f.destroy_cq {
            // SAFETY: created by ibv_create_cq, destroyed once; QPs using it hold an Arc.
            let rc = unsafe { destroy(self.raw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(target: "gsc::gda", error = %rc_error("ibv_destroy_cq", rc), "destroying a CQ failed");
            }
        }
    }
}

fn mlx5_init_obj(verbs: &Verbs) -> Result<sys::mlx5dv_init_obj_fn> {
    match &verbs.mlx5 {
        Ok((m, fns)) => need(fns.init_obj, &m.name, "mlx5dv_init_obj"),
        Err(why) => Err(Error::new(Status::LibraryMissing, format!("{LIBMLX5} not loaded: {why}"))),
    }
}

/// Direct view of an mlx5 CQ: its CQE ring and doorbell record.
pub struct Mlx5Cq {
    cq: Arc<Cq>,
    buf: NonNull<u8>,
    dbrec: NonNull<u32>,
    len: usize,
    cqe_cnt: u32,
    cqn: u32,
}

// SAFETY: the pointers stay valid while `cq` is held; reads and writes through them are
// volatile and to memory the provider hands to the consumer of this CQ.
unsafe impl Send for Mlx5Cq {}

impl Mlx5Cq {
    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    pub fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// Address and length of the CQE ring (to register it for stream waits).
    pub fn buffer(&self) -> (u64, usize) {
        (self.buf.as_ptr() as u64, self.len)
    }

    /// Address of the CQ's doorbell record (the consumer counter is its word `CQ_SET_CI`).
    pub fn dbrec_addr(&self) -> u64 {
        self.dbrec.as_ptr() as u64
    }

    /// Mark a new CQ's entries for stream waits (`CompletionQueue::prepare_buffer`). Only on a
    /// CQ nothing has completed on yet.
    pub fn prepare(&mut self, reader: &CompletionQueue) -> Result<()> {
        self.check_reader(reader)?;
        for i in 0..reader.entries() {
            let at = reader.cqe_offset(i) + cqe_offset::OP_OWN;
            // SAFETY: `at < len` (the reader has this CQ's shape: checked above); a volatile
            // byte store, because the NIC may write this memory too (nothing may have been
            // posted yet: caller), so no Rust reference to the ring is formed.
            unsafe { ptr::write_volatile(self.buf.as_ptr().add(at), PREPARED_OP_OWN) };
        }
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// A reader with a shape other than this CQ's would index past the ring: refuse it.
    fn check_reader(&self, reader: &CompletionQueue) -> Result<()> {
        if reader.entries() != self.cqe_cnt || reader.ring_len() != self.len {
            return Err(Error::invalid_param(format!(
                "CQ reader of {} entries ({} bytes) for CQ {:#x} of {} entries ({} bytes)",
                reader.entries(),
                reader.ring_len(),
                self.cqn,
                self.cqe_cnt,
                self.len
            )));
        }
        Ok(())
    }

    /// A reader (`CompletionQueue`) of this CQ's shape.
    pub fn reader(&self) -> CompletionQueue {
        CompletionQueue::new(self.cqe_cnt, self.len / self.cqe_cnt as usize).expect("shape checked in Cq::mlx5")
    }

    /// Copy the CQE at the reader's consumer position: `op_own` first, then (after a read
    /// barrier) the rest, so a CQE the owner bit says is ready is read whole. Errs if `reader`
    /// does not have this CQ's shape.
    pub fn read_cqe(&self, reader: &CompletionQueue) -> Result<[u8; CQE_SIZE]> {
        self.check_reader(reader)?;
        let at = reader.cqe_offset(reader.consumer());
        let mut out = [0u8; CQE_SIZE];
        // SAFETY: `at + 64 <= len`: the reader has this CQ's shape (checked above), so
        // `cqe_offset` stays in the ring; volatile because the NIC writes this memory.
        unsafe {
            let cqe = self.buf.as_ptr().add(at);
            out[CQE_SIZE - 1] = ptr::read_volatile(cqe.add(CQE_SIZE - 1));
            // udma_from_device_barrier: op_own before the rest of the CQE.
            device_load_barrier();
            for (i, b) in out.iter_mut().enumerate().take(CQE_SIZE - 1) {
                *b = ptr::read_volatile(cqe.add(i));
            }
        }
        Ok(out)
    }

    /// Take the next CQE if the hardware has written it. Errs if `reader` does not have this
    /// CQ's shape.
    pub fn poll(&self, reader: &mut CompletionQueue) -> Result<Option<Result<Cqe, CqeFault>>> {
        let cqe = self.read_cqe(reader)?;
        let Some(got) = reader.peek(&cqe) else { return Ok(None) };
        reader.advance();
        Ok(Some(got))
    }

    /// Publish the reader's consumer counter to the NIC (`update_cons_index`).
    pub fn update_consumer(&self, reader: &CompletionQueue) {
        // udma_to_device_barrier: the CQEs were read before the NIC may reuse them.
        device_store_barrier();
        // SAFETY: the doorbell record has two 32-bit words, alive while the CQ is.
        unsafe { ptr::write_volatile(self.dbrec.as_ptr().add(mlx5::CQ_SET_CI), u32::from_ne_bytes(reader.ci_dbrec())) };
    }
}

/// Send-queue capacity of a QP.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Work requests that may be outstanding.
    pub max_send_wr: u32,
    /// Bytes of inline data a WQE may carry.
    pub max_inline: u32,
}

/// What a peer needs to connect to a QP (exchanged out of band, e.g. through the bootstrap).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpAddress {
    pub qpn: u32,
    pub psn: u32,
    /// InfiniBand LID (0 on RoCE).
    pub lid: u16,
    /// GID in network order (required on RoCE, optional on InfiniBand).
    pub gid: Option<[u8; 16]>,
}

/// The local end of a connection.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LocalPath {
    pub port: u8,
    /// GID table index to send from; `Some` whenever the peer's GID is used (always on RoCE).
    pub gid_index: Option<u8>,
    /// Path MTU in bytes (256..=4096).
    pub mtu: u32,
}

/// A reliable-connected queue pair (`ibv_qp`).
pub struct Qp {
    pd: Arc<ProtectionDomain>,
    cq: Arc<Cq>,
    raw: NonNull<sys::ibv_qp>,
    max_inline: u32,
}

// SAFETY: see `Context`.
unsafe impl Send for Qp {}
// SAFETY: see `Context`.
unsafe impl Sync for Qp {}

impl Qp {
    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP; qp_num is set at creation and constant.
        unsafe { self.raw.as_ref().qp_num }
    }

    /// Inline capacity the provider granted.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    pub fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// This QP's address for the peer: its number, `psn`, and the port's LID and GID.
    pub fn address(&self, path: LocalPath, psn: u32) -> Result<QpAddress> {
        let ctx = &self.pd.ctx;
        let port = ctx.query_port(path.port)?;
        let gid = match path.gid_index {
            Some(i) => Some(ctx.query_gid(path.port, i)?),
            None => None,
        };
        Ok(QpAddress { qpn: self.qpn(), psn: psn & 0xff_ffff, lid: port.lid, gid })
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, what: &str) -> Result<()> {
        let v = self.pd.verbs();
        let modify = v.ibv(v.f.modify_qp, "ibv_modify_qp")?;
        // SAFETY: a live QP and a fully initialized attribute block.
        let rc = unsafe { modify(self.raw.as_ptr(), attr, mask as c_int) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_modify_qp({what}) of QP {:#x}", self.qpn()), rc));
        }
        Ok(())
    }

    /// RESET -> INIT -> RTR -> RTS towards `remote` (this QP's own address for a loopback QP,
    /// such as the flush QP). Access: remote read and write.
    pub fn connect(&self, path: LocalPath, local_psn: u32, remote: &QpAddress) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mtu = mtu_enum(path.mtu)?;

        // SAFETY (each zeroed attr): plain C data; zero is the neutral value of every field.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = path.port;
        a.qp_access_flags = Access::RDMA.bits();
        self.modify(&mut a, m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS, "INIT")?;

        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0xff_ffff;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = path.port;
        if let (Some(gid), Some(index)) = (remote.gid, path.gid_index) {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = gid;
            a.ah_attr.grh.sgid_index = index;
            a.ah_attr.grh.hop_limit = 255;
        } else if remote.lid == 0 {
            return Err(Error::invalid_param("connecting a QP: the peer has no LID and no GID/gid_index pair was given (RoCE needs GIDs)"));
        }
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;

        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = local_psn & 0xff_ffff;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 16;
        self.modify(
            &mut a,
            m::IBV_QP_STATE | m::IBV_QP_SQ_PSN | m::IBV_QP_TIMEOUT | m::IBV_QP_RETRY_CNT | m::IBV_QP_RNR_RETRY | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Post one work request through the provider (the inline `ibv_post_send`: the context's
    /// `ops.post_send`). For a QP driven this way only: never mix with a `SendQueue` writing
    /// the same QP's ring, which would desynchronize the provider's producer counter.
    pub fn post_send(&self, wr: &WorkRequest) -> Result<()> {
        use sys::ibv_wr_opcode as op;
        // SAFETY: a live QP; its context pointer and ops table are set at creation.
        let post = unsafe { (*self.raw.as_ref().context).ops.post_send }
            .ok_or_else(|| Error::unsupported("the provider has no post_send in its ops table"))?;
        let (opcode, local, remote, imm) = match wr.op {
            WorkOp::Write { local, remote } => (op::IBV_WR_RDMA_WRITE, local, remote, 0),
            WorkOp::WriteImm { local, remote, imm } => (op::IBV_WR_RDMA_WRITE_WITH_IMM, local, remote, imm),
            WorkOp::Read { local, remote } => (op::IBV_WR_RDMA_READ, local, remote, 0),
            WorkOp::Nop => return Err(Error::unsupported("NOP is posted through SendQueue only (ibv_post_send has no NOP)")),
        };
        let mut sge = sys::ibv_sge { addr: local.addr, length: local.len, lkey: local.lkey };
        // SAFETY: plain C data; zero is "no next, no flags".
        let mut swr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        swr.wr_id = wr.wr_id;
        swr.sg_list = &mut sge;
        swr.num_sge = c_int::from(local.len > 0);
        swr.opcode = opcode;
        let mut flags = 0;
        if wr.signalled {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED;
        }
        if wr.fence {
            flags |= sys::ibv_send_flags::IBV_SEND_FENCE;
        }
        swr.send_flags = flags;
        swr.__bindgen_anon_1.imm_data = imm.to_be();
        swr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: remote.addr, rkey: remote.rkey };
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: a live QP; `swr` and `sge` outlive the call (the provider copies them).
        let rc = unsafe { post(self.raw.as_ptr(), &mut swr, &mut bad) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_post_send on QP {:#x}", self.qpn()), rc));
        }
        Ok(())
    }

    /// The QP's send ring, doorbell record and BlueFlame register (`mlx5dv_init_obj`).
    pub fn mlx5(self: &Arc<Self>) -> Result<Mlx5Qp> {
        let init_obj = mlx5_init_obj(self.pd.verbs())?;
        // SAFETY: plain C data.
        let mut dv: sys::mlx5dv_qp = unsafe { std::mem::zeroed() };
        // SAFETY: plain C data; only the QP part is read for MLX5DV_OBJ_QP.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.qp.in_ = self.raw.as_ptr();
        obj.qp.out = &mut dv;
        // SAFETY: a live QP and valid out-pointers.
        let rc = unsafe { init_obj(&mut obj, u64::from(sys::mlx5dv_obj_type::MLX5DV_OBJ_QP)) };
        if rc != 0 {
            return Err(rc_error("mlx5dv_init_obj(QP) (not an mlx5 device?)", rc));
        }
        if dv.sq.stride as usize != mlx5::SEND_WQE_BB {
            return Err(Error::unsupported(format!("mlx5 send queue stride {} (expected 64)", dv.sq.stride)));
        }
        let missing = |what: &str| Error::new(Status::DeviceError, format!("mlx5dv_qp.{what} is NULL"));
        let sq = NonNull::new(dv.sq.buf.cast::<u8>()).ok_or_else(|| missing("sq.buf"))?;
        let dbrec = NonNull::new(dv.dbrec).ok_or_else(|| missing("dbrec"))?;
        let bf = NonNull::new(dv.bf.reg.cast::<u8>()).ok_or_else(|| missing("bf.reg"))?;
        let shape = SendQueueShape { qpn: self.qpn(), wqe_cnt: dv.sq.wqe_cnt, bf_size: dv.bf.size };
        SendQueue::new(shape)?; // checks the shape
        Ok(Mlx5Qp { qp: self.clone(), sq, dbrec, bf, shape })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if let Some(destroy) = self.pd.verbs().f.destroy_qp {
            // SAFETY: created by ibv_create_qp, destroyed once.
            let rc = unsafe { destroy(self.raw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(target: "gsc::gda", error = %rc_error("ibv_destroy_qp", rc), "destroying a QP failed");
            }
        }
    }
}

/// Direct view of an mlx5 QP's send side: where `SendQueue` writes WQEs and where doorbells
/// go. A stream rings it by storing `Doorbell::dbrec_word` at `dbrec_addr()` and
/// `Doorbell::uar_word` at `bf_addr() + bell.bf_offset`, after registering the doorbell record's
/// page with `cuMemHostRegister` and the UAR page (`uar_page()`) with
/// `CU_MEMHOSTREGISTER_IOMEMORY`.
pub struct Mlx5Qp {
    qp: Arc<Qp>,
    sq: NonNull<u8>,
    dbrec: NonNull<u32>,
    bf: NonNull<u8>,
    shape: SendQueueShape,
}

// SAFETY: the pointers stay valid while `qp` is held; the ring is written only through
// `&mut self`, the registers with volatile stores.
unsafe impl Send for Mlx5Qp {}

impl Mlx5Qp {
    pub fn qp(&self) -> &Arc<Qp> {
        &self.qp
    }

    /// A fresh producer for this ring. Only for a QP nothing was posted on through the
    /// provider (its producer counter starts at 0 like ours).
    pub fn send_queue(&self) -> SendQueue {
        SendQueue::new(self.shape).expect("shape checked in Qp::mlx5")
    }

    /// The send ring, for `SendQueue::post`.
    pub fn sq_ring(&mut self) -> &mut [u8] {
        // SAFETY: `wqe_cnt * 64` bytes allocated by the provider for this QP's send queue, alive
        // while `self.qp` is; the NIC only reads it; `&mut self` makes this the only writer.
        unsafe { std::slice::from_raw_parts_mut(self.sq.as_ptr(), self.shape.wqe_cnt as usize * mlx5::SEND_WQE_BB) }
    }

    /// Address of the send counter in the doorbell record (`dbrec[MLX5_SND_DBR]`).
    pub fn dbrec_addr(&self) -> u64 {
        self.dbrec.as_ptr() as u64 + Doorbell::DBREC_OFFSET as u64
    }

    /// Address of the BlueFlame register; doorbells go to `bf_addr() + bf_offset`.
    pub fn bf_addr(&self) -> u64 {
        self.bf.as_ptr() as u64
    }

    /// The 4 KiB UAR page holding the BlueFlame register, as `(page address, length)`: what a
    /// stream needs mapped (`cuMemHostRegister(.., CU_MEMHOSTREGISTER_IOMEMORY)`).
    pub fn uar_page(&self) -> (u64, usize) {
        const UAR_PAGE: u64 = 4096;
        (self.bf_addr() & !(UAR_PAGE - 1), UAR_PAGE as usize)
    }

    /// Ring the doorbell from the CPU, as `post_send_db` does (8-byte doorbell, no BlueFlame
    /// copy): WQEs, then the record, then the UAR write, each ordered by a barrier.
    /// Errs (ringing nothing) if `bell.bf_offset` is neither 0 nor `bf.size`, or the register
    /// address is not 8-byte aligned: `Doorbell`'s fields are public, and any other offset
    /// would store outside the BlueFlame register pair.
    pub fn ring_from_host(&self, bell: &Doorbell) -> Result<()> {
        let target = self.bf_addr().wrapping_add(u64::from(bell.bf_offset));
        if (bell.bf_offset != 0 && bell.bf_offset != self.shape.bf_size) || target % 8 != 0 {
            return Err(Error::invalid_param(format!(
                "doorbell at BlueFlame offset {} of QP {:#x} (expected 0 or {}, 8-byte aligned)",
                bell.bf_offset, self.shape.qpn, self.shape.bf_size
            )));
        }
        // udma_to_device_barrier: the WQEs before the record.
        device_store_barrier();
        // SAFETY: the doorbell record has two 32-bit words, alive while the QP is.
        unsafe { ptr::write_volatile(self.dbrec.as_ptr().add(mlx5::SND_DBR), u32::from_ne_bytes(bell.dbrec)) };
        // mmio_wc_start: the record before the UAR write.
        mmio_flush_barrier();
        // SAFETY: `bf_offset` is 0 or bf.size (checked above), both inside the QP's BlueFlame
        // register pair, which stays mapped while the QP is; the address is 8-byte aligned
        // (checked above).
        unsafe { ptr::write_volatile(self.bf.as_ptr().add(bell.bf_offset as usize).cast::<u64>(), u64::from_ne_bytes(bell.uar)) };
        // mmio_flush_writes: push the write-combining buffer out.
        mmio_flush_barrier();
        Ok(())
    }
}

/// A full store barrier that also orders stores to write-combining and device memory. On
/// x86-64 a SeqCst fence is `mfence`, which orders WC stores too.
#[cfg(not(target_arch = "aarch64"))]
fn device_store_barrier() {
    fence(Ordering::SeqCst);
}

/// On AArch64 a SeqCst fence is `dmb ish`, which does not reach the outer-shareable domain the
/// NIC sits in; rdma-core's `udma_to_device_barrier` is `dmb oshst` there.
#[cfg(target_arch = "aarch64")]
fn device_store_barrier() {
    fence(Ordering::SeqCst);
    // SAFETY: a barrier instruction: no memory or register effects beyond ordering.
    unsafe { std::arch::asm!("dmb oshst", options(nostack, preserves_flags)) };
}

/// `udma_from_device_barrier`: loads of DMA-written memory stay in order. On x86-64 loads are
/// not reordered with loads; an Acquire fence keeps the compiler from doing it.
#[cfg(not(target_arch = "aarch64"))]
fn device_load_barrier() {
    fence(Ordering::Acquire);
}

/// On AArch64 rdma-core uses `dmb oshld` (`dmb ishld`, an Acquire fence, is inner-shareable only).
#[cfg(target_arch = "aarch64")]
fn device_load_barrier() {
    fence(Ordering::Acquire);
    // SAFETY: a barrier instruction: no memory or register effects beyond ordering.
    unsafe { std::arch::asm!("dmb oshld", options(nostack, preserves_flags)) };
}

/// `mmio_wc_start` / `mmio_flush_writes`: order (and push out) stores to write-combining
/// memory. On x86-64 `mfence` (a SeqCst fence) does it, as `sfence` does for rdma-core.
#[cfg(not(target_arch = "aarch64"))]
fn mmio_flush_barrier() {
    fence(Ordering::SeqCst);
}

/// On AArch64 rdma-core uses `dsb st` for both: a `dmb` orders but does not wait for the
/// write-combining buffer to drain.
#[cfg(target_arch = "aarch64")]
fn mmio_flush_barrier() {
    fence(Ordering::SeqCst);
    // SAFETY: a barrier instruction: no memory or register effects beyond ordering.
    unsafe { std::arch::asm!("dsb st", options(nostack, preserves_flags)) };
}

/// GPU memory for the GPU flush buffer: allocated by the CUDA side (src/cuda) and exported as
/// a dmabuf (`cuMemGetHandleForAddressRange(.., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ..)`).
pub trait DmabufAllocator {
    fn alloc(&mut self, len: usize) -> Result<DmabufMemory>;
    fn free(&mut self, mem: &DmabufMemory) -> Result<()>;
}

/// A GPU allocation and its dmabuf: `len` bytes at device pointer `dptr`, found at `offset` in
/// dmabuf `fd` (owned by the allocator, which closes it in `free`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DmabufMemory {
    pub dptr: u64,
    pub len: usize,
    pub fd: RawFd,
    pub offset: u64,
}

/// `FlushMemory` over verbs: host flush buffers are anonymous pages registered with
/// `ibv_reg_mr`; GPU flush buffers come from a `DmabufAllocator` and are registered with
/// `ibv_reg_dmabuf_mr` (so remote addresses are device pointers).
pub struct VerbsFlushMemory<G: DmabufAllocator> {
    pd: Arc<ProtectionDomain>,
    gpu: G,
    next: u64,
    host: HashMap<u64, (NonNull<c_void>, usize)>,
    dmabufs: HashMap<u64, DmabufMemory>,
    regions: HashMap<u64, MemoryRegion>,
}

// SAFETY: the host pointers are private anonymous mappings owned by this value.
unsafe impl<G: DmabufAllocator + Send> Send for VerbsFlushMemory<G> {}

impl<G: DmabufAllocator> VerbsFlushMemory<G> {
    pub fn new(pd: Arc<ProtectionDomain>, gpu: G) -> VerbsFlushMemory<G> {
        VerbsFlushMemory { pd, gpu, next: 1, host: HashMap::new(), dmabufs: HashMap::new(), regions: HashMap::new() }
    }

    fn unknown(what: &str, handle: u64) -> Error {
        Error::new(Status::InvalidHandle, format!("{what}: flush buffer {handle} is not held"))
    }
}

impl<G: DmabufAllocator> FlushMemory for VerbsFlushMemory<G> {
    fn alloc(&mut self, place: Place, len: usize) -> Result<Buffer> {
        let handle = self.next;
        self.next += 1;
        match place {
            Place::Host => {
                let len = len.max(1).next_multiple_of(4096);
                // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
                let p = unsafe {
                    libc::mmap(ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
                };
                if p == libc::MAP_FAILED {
                    return Err(Error::io("mmap of the host flush buffer", std::io::Error::last_os_error()));
                }
                let p = NonNull::new(p).expect("mmap never returns NULL on success");
                self.host.insert(handle, (p, len));
                Ok(Buffer { place, addr: p.as_ptr() as u64, len, handle })
            }
            Place::Gpu => {
                let mem = self.gpu.alloc(len)?;
                self.dmabufs.insert(handle, mem);
                Ok(Buffer { place, addr: mem.dptr, len: mem.len, handle })
            }
        }
    }

    fn register(&mut self, buf: &Buffer) -> Result<Registration> {
        let mr = match buf.place {
            Place::Host => {
                let &(p, len) = self.host.get(&buf.handle).ok_or_else(|| Self::unknown("register", buf.handle))?;
                // SAFETY: our own mapping, unmapped only by `free`. `FlushBuffers` deregisters
                // before it frees; and should a free come first, the pages stay pinned for the
                // NIC until deregistration, so the NIC never writes memory reused by others.
                unsafe { self.pd.register(p.as_ptr(), len, Access::RDMA)? }
            }
            Place::Gpu => {
                let mem = *self.dmabufs.get(&buf.handle).ok_or_else(|| Self::unknown("register", buf.handle))?;
                // SAFETY: the allocator keeps the GPU memory until `free`; as for host memory, the
                // dmabuf registration holds its own reference to the pages.
                unsafe { self.pd.register_dmabuf(mem.fd, mem.offset, mem.len, mem.dptr, Access::RDMA)? }
            }
        };
        let reg = Registration { lkey: mr.lkey(), rkey: mr.rkey(), handle: buf.handle };
        self.regions.insert(buf.handle, mr);
        Ok(reg)
    }

    fn deregister(&mut self, buf: &Buffer, _reg: &Registration) -> Result<()> {
        let mr = self.regions.remove(&buf.handle).ok_or_else(|| Self::unknown("deregister", buf.handle))?;
        mr.deregister()
    }

    fn free(&mut self, buf: &Buffer) -> Result<()> {
        match buf.place {
            Place::Host => {
                let (p, len) = self.host.remove(&buf.handle).ok_or_else(|| Self::unknown("free", buf.handle))?;
                // SAFETY: a mapping we made, unmapped once (removed from the table).
                if unsafe { libc::munmap(p.as_ptr(), len) } != 0 {
                    return Err(Error::io("munmap of the host flush buffer", std::io::Error::last_os_error()));
                }
                Ok(())
            }
            Place::Gpu => {
                let mem = self.dmabufs.remove(&buf.handle).ok_or_else(|| Self::unknown("free", buf.handle))?;
                self.gpu.free(&mem)
            }
        }
    }
}

impl<G: DmabufAllocator> Drop for VerbsFlushMemory<G> {
    fn drop(&mut self) {
        // Whatever `FlushBuffers` did not release: regions first (their Drop logs failures).
        self.regions.clear();
        for (_, (p, len)) in self.host.drain() {
            // SAFETY: a mapping we made and still hold.
            if unsafe { libc::munmap(p.as_ptr(), len) } != 0 {
                tracing::warn!(target: "gsc::gda", error = %std::io::Error::last_os_error(), "munmap of a host flush buffer failed");
            }
        }
        for (_, mem) in self.dmabufs.drain() {
            if let Err(e) = self.gpu.free(&mem) {
                tracing::warn!(target: "gsc::gda", error = %e, "freeing a GPU flush buffer failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_as_missing() {
        let Err(err) = Verbs::load("libgscomm-test-no-such-verbs.so.1", "libgscomm-test-no-such-mlx5.so.1") else {
            panic!("a library that does not exist loaded")
        };
        assert_eq!(err.status(), Status::LibraryMissing);
        assert!(err.message().starts_with("libgscomm-test-no-such-verbs.so.1 not found: "), "{err:?}");
    }

    /// Runs the dlopen/dlsym path for real where rdma-core is installed (it is on the
    /// development machine, without a NIC); elsewhere checks the missing-library error.
    #[test]
    fn the_installed_library_if_any_has_the_discovery_symbols() {
        match Verbs::load(LIBIBVERBS, LIBMLX5) {
            Err(e) => assert_eq!(e.status(), Status::LibraryMissing, "{e:?}"),
            Ok(v) => {
                assert!(v.f.get_device_list.is_some());
                assert!(v.f.free_device_list.is_some());
                assert!(v.f.open_device.is_some());
                assert!(v.f.query_port.is_some());
                assert!(v.f.reg_mr.is_some());
                assert!(v.f.create_qp.is_some());
                eprintln!("{LIBIBVERBS}: {:?}, libmlx5: {:?}", v.capabilities(), v.mlx5_missing());
            }
        }
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_bytes(sys::ibv_mtu::IBV_MTU_256), 256);
        assert_eq!(mtu_bytes(sys::ibv_mtu::IBV_MTU_4096), 4096);
        assert_eq!(mtu_bytes(0), 0);
        for bytes in [256, 512, 1024, 2048, 4096] {
            assert_eq!(mtu_bytes(mtu_enum(bytes).unwrap()), bytes);
        }
        assert!(mtu_enum(9000).is_err());
    }

    #[test]
    fn access_flags_and_the_optional_range() {
        assert_eq!(Access::RDMA.bits(), 0x7);
        assert!(!Access::RDMA.is_optional());
        assert!((Access::RDMA | Access::RELAXED_ORDERING).is_optional());
    }

    #[test]
    fn port_attributes_are_decoded() {
        // SAFETY: plain C data.
        let mut a: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        a.state = sys::ibv_port_state::IBV_PORT_ACTIVE;
        a.link_layer = sys::_bindgen_ty_13::IBV_LINK_LAYER_ETHERNET as u8;
        a.active_mtu = sys::ibv_mtu::IBV_MTU_1024;
        a.active_width = 2;
        a.active_speed = 64;
        let p = port_info(1, &a);
        assert_eq!(p.state, PortState::Active);
        assert_eq!(p.link_layer, LinkLayer::Ethernet);
        assert_eq!(p.active_mtu, 1024);
    }
}

//! gscomm's own kernels, compiled at run time with NVRTC and cached on disk.
//!
//! The source is include/gsc_device.cuh (the same header users compile into their kernels) plus
//! two one-thread kernels: `gsc_trigger_kernel` and `gsc_wait_kernel`, the replay-safe trigger
//! and completion nodes of graph and captured-stream conditions. The cubin is kept under
//! `GSC_KERNEL_CACHE_DIR` as `<hash of source and options>-sm_<arch>.cubin`, so only the first
//! run on a machine pays for compilation; a damaged cache file is replaced.

use super::{CtxScope, check, context_arch, cu};
use crate::error::{Error, Result, Status};
use cudarc::nvrtc::sys as nvrtc;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

const DEVICE_HEADER: &str = include_str!("../../include/gsc_device.cuh");

const KERNELS: &str = r#"
extern "C" __global__ void gsc_trigger_kernel(gsc_device_handle_t *h) { gsc_trigger(h); }
extern "C" __global__ void gsc_wait_kernel(gsc_device_handle_t *h) { (void)gsc_wait(h); }

/* Several operations at one stream position (a condition group): one thread per handle, so
 * their reads of pinned epochs and done words go over PCIe together instead of one after
 * another, and one fence before all the triggers. */
#define GSC_GROUP_MAX 8
typedef struct { unsigned long long n; gsc_device_handle_t *h[GSC_GROUP_MAX]; } gsc_handle_group_t;

extern "C" __global__ void gsc_trigger_group_kernel(gsc_handle_group_t g)
{
    unsigned i = threadIdx.x;
    unsigned long long e = 0;
    if (i < g.n) {
        volatile unsigned long long *ep = &g.h[i]->epoch;
        e = *ep + 1;
        *ep = e;
    }
    __syncthreads();
    if (i == 0) asm volatile("fence.acq_rel.sys;" ::: "memory");
    __syncthreads();
    if (i < g.n) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(g.h[i]->trigger), "l"(e) : "memory");
}

extern "C" __global__ void gsc_wait_group_kernel(gsc_handle_group_t g)
{
    if (threadIdx.x < g.n) (void)gsc_wait(g.h[threadIdx.x]);
    __syncthreads();
}
"#;

/// Most handles one group kernel takes (`GSC_GROUP_MAX` above).
pub(crate) const GROUP_MAX: usize = 8;

/// The kernels' `gsc_handle_group_t`, passed by value.
#[repr(C)]
#[derive(Copy, Clone, Default)]
pub(crate) struct HandleGroup {
    pub(crate) n: u64,
    pub(crate) h: [u64; GROUP_MAX],
}

/// The kernels of one context.
#[derive(Copy, Clone)]
pub(crate) struct Kernels {
    pub(crate) trigger: cu::CUfunction,
    pub(crate) wait: cu::CUfunction,
    pub(crate) trigger_group: cu::CUfunction,
    pub(crate) wait_group: cu::CUfunction,
}

// SAFETY: CUfunction handles are plain driver handles, valid from any thread while their module
// is loaded; modules are never unloaded.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// The kernels for context `ctx`, compiling or loading them the first time.
    pub(crate) fn of(ctx: cu::CUcontext, cache_dir: Option<&Path>) -> Result<Kernels> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Kernels>>> = OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = loaded.get(&(ctx as usize)) {
            return Ok(*k);
        }
        let arch = context_arch(ctx)?;
        let source = format!("{DEVICE_HEADER}\n{KERNELS}");
        let cubin = compile_cached(&source, arch, cache_dir)?;
        let _scope = CtxScope::enter(ctx)?;
        let module = load_module(&cubin)?;
        let k = Kernels {
            trigger: function(module, "gsc_trigger_kernel")?,
            wait: function(module, "gsc_wait_kernel")?,
            trigger_group: function(module, "gsc_trigger_group_kernel")?,
            wait_group: function(module, "gsc_wait_group_kernel")?,
        };
        loaded.insert(ctx as usize, k);
        Ok(k)
    }
}

/// Load a cubin into the current context.
pub(crate) fn load_module(cubin: &[u8]) -> Result<cu::CUmodule> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: `cubin` is a complete cubin image, read by the driver during the call.
    check(unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) }, "cuModuleLoadData")?;
    Ok(module)
}

pub(crate) fn function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction> {
    let cname = CString::new(name).expect("no NUL in kernel names");
    let mut f: cu::CUfunction = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    check(unsafe { cu::cuModuleGetFunction(&mut f, module, cname.as_ptr()) }, "cuModuleGetFunction")?;
    Ok(f)
}

/// The cubin of `source` for `arch`, from the disk cache or freshly compiled.
pub(crate) fn compile_cached(source: &str, arch: (i32, i32), cache_dir: Option<&Path>) -> Result<Vec<u8>> {
    let options = [format!("--gpu-architecture=sm_{}{}", arch.0, arch.1), "-std=c++17".to_string(), "-default-device".to_string()];
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in &options {
        h.update(o.as_bytes());
    }
    let digest: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let dir: Option<PathBuf> = cache_dir.map(Path::to_path_buf).or_else(crate::config::default_kernel_cache_dir);
    let path = dir.as_ref().map(|d| d.join(format!("{digest}-sm_{}{}.cubin", arch.0, arch.1)));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            // A cubin is an ELF file; anything else is a damaged entry, compiled again below.
            if bytes.starts_with(b"\x7fELF") {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile(source, &options)?;
    if let (Some(d), Some(p)) = (&dir, &path) {
        // Written to a temporary name and renamed, so a concurrent reader never sees half a file.
        let tmp = d.join(format!(".{digest}.{}.tmp", std::process::id()));
        let stored = std::fs::create_dir_all(d).and_then(|_| std::fs::write(&tmp, &cubin)).and_then(|_| std::fs::rename(&tmp, p));
        if let Err(e) = stored {
            tracing::warn!(target: "gsc::cuda", dir = %d.display(), error = %e, "cannot write the kernel cache; compiling again next time");
        }
    }
    Ok(cubin)
}

fn nvrtc_check(r: nvrtc::nvrtcResult, what: &str) -> Result<()> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS { Ok(()) } else { Err(Error::new(Status::DeviceError, format!("{what} failed: {r:?}"))) }
}

fn compile(source: &str, options: &[String]) -> Result<Vec<u8>> {
    // SAFETY: probing for the library has no preconditions.
    if !unsafe { nvrtc::is_culib_present() } {
        return Err(Error::new(Status::LibraryMissing, "NVRTC (libnvrtc.so) cannot be loaded; it compiles gscomm's kernels"));
    }
    let src = CString::new(source).map_err(|_| Error::invalid_param("kernel source contains NUL"))?;
    let name = CString::new("gscomm.cu").expect("no NUL");
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings that outlive the call; no headers.
    nvrtc_check(
        unsafe { nvrtc::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
        "nvrtcCreateProgram",
    )?;
    let opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).expect("no NUL")).collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `prog` was created above; `ptrs` points at live NUL-terminated options.
    let compiled = unsafe { nvrtc::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let result = if compiled == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        let mut size = 0usize;
        // SAFETY: a compiled program and valid out-pointers; `cubin` has `size` bytes.
        nvrtc_check(unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut size) }, "nvrtcGetCUBINSize").and_then(|_| {
            let mut cubin = vec![0u8; size];
            nvrtc_check(unsafe { nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _) }, "nvrtcGetCUBIN").map(|_| cubin)
        })
    } else {
        let mut size = 0usize;
        // SAFETY: as above, for the log.
        unsafe { nvrtc::nvrtcGetProgramLogSize(prog, &mut size) };
        let mut log = vec![0u8; size.max(1)];
        unsafe { nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut _) };
        let text = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        Err(Error::new(Status::DeviceError, format!("NVRTC could not compile gscomm's kernels: {compiled:?}\n{text}")))
    };
    // SAFETY: destroys the program created above, once.
    unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    result
}

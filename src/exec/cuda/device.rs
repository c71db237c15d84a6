//! The process-wide GPU: one CUDA context on one device (0 unless
//! [`select_device`] chose another before first use) and the NVRTC-compiled
//! kernels, compiled once per process and cached. Programs create their own
//! streams on top of it and share one cuBLAS and one cuDNN handle
//! (`handles.rs`). A process serves one GPU:
//! several GPUs are several processes (docs/multi-gpu.md).

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::elem::Elem;
use super::CudaInfo;
use crate::exec::ExecError;

/// The element types and their load/store helpers, compiled in front of
/// every source (a `#line` directive after it keeps NVRTC's line numbers
/// those of the source file).
const PRELUDE: &str = include_str!("kernels/dtype.cuh");

/// CUDA C sources, one module each.
const SOURCES: [(&str, &str); 3] = [
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("reduce", include_str!("kernels/reduce.cu")),
    ("nn", include_str!("kernels/nn.cu")),
];

/// Kernel entry points of [`SOURCES`], by module.
const FUNCTIONS: [(&str, &[&str]); 3] = [
    (
        "elementwise",
        &[
            "unary4",
            "binary_same4",
            "strided_copy16",
            "strided_copy32",
            "strided_copy64",
            "strided_copy128",
            "batchnorm_infer",
            "batchnorm_planes",
            "fused_planes",
            "fused_flat",
            "fused_mixed_planes",
            "fused_mixed_flat",
            "fused_row",
            "fused_row4",
            "sgd_update",
            "adam_update",
            "step_incr",
            "amp_found_init",
            "amp_unscale",
            "amp_scale_update",
            "where_bcast",
            "where_flat",
            "where_flat4",
            "cast_f32_i64",
            "dropout_mask",
            "cast_i64_f32",
            "cast_f32_f16",
            "cast_f32_bf16",
            "cast_f16_f32",
            "cast_bf16_f32",
            "cast_f16_bf16",
            "cast_bf16_f16",
            "cast_i64_f16",
            "cast_i64_bf16",
            "hold_until",
        ],
    ),
    (
        "reduce",
        &[
            "reduce_max_grad",
            "softmax",
            "softmax_grad",
            "softmax_mixed",
            "softmax_grad_mixed",
            "layernorm",
            "layernorm_grad",
            "layernorm_grad_reg",
            "layernorm_grad_wide",
            "cross_entropy",
            "cross_entropy_grad",
            "mse_loss",
        ],
    ),
    (
        "nn",
        &[
            "maxpool",
            "maxpool_grad",
            "avgpool",
            "avgpool_grad",
            "row_mean",
            "embedding",
            "embedding_grad",
            "bn_stats",
            "bn_plane_stats",
            "bn_stats_finish",
            "bn_apply",
            "bn_apply_planes",
            "bn_grad_reduce",
            "bn_grad_plane",
            "bn_grad_finish",
            "bn_grad_dx",
            "bn_grad_dx_planes",
        ],
    ),
];

/// Kernels written once over the element type, by module, one entry point
/// per [`Elem`] (the name plus [`Elem::suffix`]); the f32 one is also
/// reachable by its plain name through [`Gpu::kernel`].
const TYPED: [(&str, &[&str]); 2] = [
    (
        "elementwise",
        &[
            "unary",
            "binary_same",
            "binary_row",
            "binary_bcast",
            "binary_rows",
            "clip",
            "fill",
            "unary_grad",
            "channel_bias",
        ],
    ),
    ("reduce", &["reduce_warp", "reduce_cols", "reduce_block"]),
];

/// Whether `name` is an entry point [`open`] loads (for tests of the
/// call sites' kernel names).
#[cfg(test)]
pub(crate) fn loads(name: &str) -> bool {
    let typed = TYPED.iter().flat_map(|(_, fns)| fns.iter()).any(|t| {
        Elem::ALL
            .iter()
            .any(|e| format!("{t}{}", e.suffix()) == name)
    });
    typed || FUNCTIONS.iter().any(|(_, fns)| fns.contains(&name))
}

/// The context and the loaded kernels.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub info: CudaInfo,
    kernels: HashMap<&'static str, CudaFunction>,
    typed: HashMap<(&'static str, Elem), CudaFunction>,
}

impl Gpu {
    pub fn kernel(&self, name: &'static str) -> Result<&CudaFunction, ExecError> {
        self.kernels.get(name).ok_or_else(|| ExecError::NoDevice {
            reason: format!("kernel `{name}` was not loaded"),
        })
    }

    /// The instance of typed kernel `name` (one of [`TYPED`]'s) for `elem`.
    pub fn typed(&self, name: &'static str, elem: Elem) -> Result<&CudaFunction, ExecError> {
        self.typed
            .get(&(name, elem))
            .ok_or_else(|| ExecError::NoDevice {
                reason: format!("kernel `{name}{}` was not loaded", elem.suffix()),
            })
    }
}

fn no_device(reason: impl Into<String>) -> ExecError {
    ExecError::NoDevice {
        reason: reason.into(),
    }
}

/// Checks that the driver, cuBLAS, cuDNN and NVRTC libraries can be opened,
/// without touching any cudarc entry point that panics when they cannot.
pub(crate) fn libraries_present() -> Result<(), ExecError> {
    // SAFETY: these only try `dlopen` on the candidate library names and
    // report whether one succeeded; no symbol is called.
    let found = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcudnn", cudarc::cudnn::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = found
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(no_device(format!(
            "cannot load {} (no NVIDIA driver or CUDA libraries on this machine)",
            missing.join(", ")
        )))
    }
}

/// Runs `f`, turning a panic inside cudarc into an error, with the default
/// panic message silenced for the duration.
pub(crate) fn contain<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, ExecError> {
    static HOOK_LOCK: Mutex<()> = Mutex::new(());
    let _guard = HOOK_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let prev = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let r = panic::catch_unwind(AssertUnwindSafe(f));
    panic::set_hook(prev);
    r.map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        no_device(format!("{what}: {msg}"))
    })
}

fn arch_for(cc: (i32, i32)) -> Option<&'static str> {
    Some(match cc {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

/// The ordinal [`open`] uses (`--device cuda:N`).
static ORDINAL: AtomicUsize = AtomicUsize::new(0);
/// Set once the GPU has been opened: the ordinal can no longer change.
static OPENED: AtomicBool = AtomicBool::new(false);

/// How many CUDA devices this host has (`cuDeviceGetCount`), without
/// creating a context on any of them; an error when the driver or the CUDA
/// libraries are missing.
pub fn device_count() -> Result<usize, ExecError> {
    libraries_present()?;
    let n = contain("CUDA initialisation", CudaContext::device_count)?
        .map_err(|e| no_device(format!("counting CUDA devices: {e:?}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Chooses the GPU this process opens: device `ordinal`, checked against
/// the host's count (`no GPU 3: this host has 2`). Must come before the
/// first use of the GPU (probe, memory info, a program); choosing again
/// after that is an error unless it is the same device.
pub fn select_device(ordinal: usize) -> Result<(), ExecError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(no_device(format!(
            "no GPU {ordinal}: this host has {count}"
        )));
    }
    if OPENED.load(Ordering::SeqCst) && ORDINAL.load(Ordering::SeqCst) != ordinal {
        return Err(no_device(format!(
            "GPU {} is already open in this process; it cannot serve GPU {ordinal} too",
            ORDINAL.load(Ordering::SeqCst)
        )));
    }
    ORDINAL.store(ordinal, Ordering::SeqCst);
    Ok(())
}

/// The ordinal of the GPU this process uses (or will open).
pub fn selected_device() -> usize {
    ORDINAL.load(Ordering::SeqCst)
}

fn open() -> Result<Arc<Gpu>, ExecError> {
    libraries_present()?;
    OPENED.store(true, Ordering::SeqCst);
    let ordinal = ORDINAL.load(Ordering::SeqCst);
    let ctx = contain("CUDA initialisation", || CudaContext::new(ordinal))?
        .map_err(|e| no_device(format!("no CUDA device {ordinal}: {e:?}")))?;
    // Programs address tensors by raw pointers into their own arena and run on
    // one stream each, so cudarc's per-slice event tracking is not needed.
    // SAFETY: no slice of this context exists yet, and every program
    // synchronises its own stream before reading results.
    unsafe { ctx.disable_event_tracking() };
    let name = ctx.name().map_err(|e| no_device(format!("{e:?}")))?;
    let total_memory = ctx.total_mem().map_err(|e| no_device(format!("{e:?}")))? as u64;
    let cc = ctx
        .compute_capability()
        .map_err(|e| no_device(format!("{e:?}")))?;
    let mut kernels = HashMap::new();
    let mut typed = HashMap::new();
    for ((module_name, src), (_, fns)) in SOURCES.iter().zip(FUNCTIONS.iter()) {
        let opts = CompileOptions {
            arch: arch_for(cc),
            name: Some(format!("{module_name}.cu")),
            ..Default::default()
        };
        let full = format!("{PRELUDE}\n#line 1 \"{module_name}.cu\"\n{src}");
        let ptx = contain("NVRTC", || compile_ptx_with_opts(full, opts))?
            .map_err(|e| no_device(format!("compiling {module_name}.cu: {e:?}")))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| no_device(format!("loading {module_name}.cu: {e:?}")))?;
        for f in fns.iter() {
            let func = module
                .load_function(f)
                .map_err(|e| no_device(format!("kernel {f} in {module_name}.cu: {e:?}")))?;
            kernels.insert(*f, func);
        }
        for (_, fns) in TYPED.iter().filter(|(m, _)| m == module_name) {
            for &f in fns.iter() {
                for e in Elem::ALL {
                    let entry = format!("{f}{}", e.suffix());
                    let func = module.load_function(&entry).map_err(|err| {
                        no_device(format!("kernel {entry} in {module_name}.cu: {err:?}"))
                    })?;
                    if e == Elem::F32 {
                        kernels.insert(f, func.clone());
                    }
                    typed.insert((f, e), func);
                }
            }
        }
    }
    Ok(Arc::new(Gpu {
        ctx,
        info: CudaInfo { name, total_memory },
        kernels,
        typed,
    }))
}

/// The process's GPU, opened (and its kernels compiled) on first use.
pub(crate) fn gpu() -> Result<Arc<Gpu>, ExecError> {
    static GPU: OnceLock<Result<Arc<Gpu>, ExecError>> = OnceLock::new();
    GPU.get_or_init(open).clone()
}

/// Launch geometry for a grid-stride loop over `n` elements.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch geometry for one warp per row.
pub(crate) fn warps(rows: usize) -> LaunchConfig {
    let blocks = (rows * 32).div_ceil(256).max(1) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch geometry for one block per item.
pub(crate) fn blocks(items: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `f` with `args` on `stream`.
///
/// # Safety
/// The arguments must match the kernel's parameter list in number, order and
/// type, and every device address must point into live memory large enough
/// for the indices the kernel computes from the other arguments.
pub(crate) unsafe fn launch(
    stream: &Arc<cudarc::driver::CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[&dyn ArgRef],
) -> Result<(), ExecError> {
    let mut b = stream.launch_builder(f);
    for a in args {
        a.push(&mut b);
    }
    // SAFETY: forwarded to the caller (see above).
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| no_device(format!("kernel launch failed: {e:?}")))
}

/// Object-safe view of a kernel argument.
pub(crate) trait ArgRef {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T: DeviceRepr> ArgRef for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

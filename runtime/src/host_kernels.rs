//! Kernels of our own that a host (XLA:CPU) plugin calls as typed-FFI custom calls, registered
//! through the plugin's PJRT FFI extension when a client is created.
//!
//! f32 attention as one kernel (`attention`), f32 3×3 convolutions (`conv`), f32 LayerNorm and
//! RMSNorm as one each (`layer_norm`), and two products, each with the matrix stored `[N, K]`
//! (`nn.Linear`'s weight) or `[K, N]` (GPT-2's `Conv1D`): f32 products of short contractions split over XLA's
//! threads (`gemm`, on AMX tiles where the CPU has them: `amx`, which also take bf16 rows times a
//! resident bf16 matrix), and here a bf16 vector times a bf16 matrix,
//! the products of every decode step of a bf16 model. XLA:CPU's own ways run at half the rate
//! of its f32 products (YNNPACK packs the whole weight on every call; its own dot emitter has
//! no bf16 kernel), so a bf16 decode step was slower than an f32 one although it reads half
//! the bytes. This one streams the weight once, with f32 sums as
//! PyTorch's CPU kernels keep them.

mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod bf16_dots;
mod conv;
mod epilogue;
mod gemm;
#[cfg(target_arch = "x86_64")]
mod layer_norm;
mod pool;
#[cfg(target_arch = "x86_64")]
mod rotary;
#[cfg(target_arch = "x86_64")]
mod tile_attention;
pub mod unchanging;
#[cfg(target_arch = "x86_64")]
mod vector_math;

use crate::plugin::Plugin;
use epilogue::{Activation, Epilogue, Factor};
use pjrt_sys::PJRT_Extension_Base;
use std::ffi::{c_char, c_int, c_void};

/// The custom call targets of a bf16 vector times a weight stored `[N, K]` and `[K, N]`, as
/// the compiler names them in StableHLO.
pub const BF16_MATVEC_TARGET: &str = "tpu_dynamo.bf16_matvec";
pub const BF16_VECMAT_TARGET: &str = "tpu_dynamo.bf16_vecmat";
/// The custom call targets of bf16 rows times a weight so stored, on AMX tiles.
pub const BF16_MATMUL_NT_TARGET: &str = "tpu_dynamo.bf16_matmul_nt";
pub const BF16_MATMUL_NN_TARGET: &str = "tpu_dynamo.bf16_matmul_nn";
/// The same adding a bf16 bias `[N]` to the f32 sums before they are rounded.
pub const BF16_MATMUL_NT_BIAS_TARGET: &str = "tpu_dynamo.bf16_matmul_nt_bias";
pub const BF16_MATMUL_NN_BIAS_TARGET: &str = "tpu_dynamo.bf16_matmul_nn_bias";
/// The same with the tanh GELU after the bias (diffusers' `FeedForward`), of the rounded sums.
pub const BF16_MATMUL_NT_BIAS_GELU_TANH_TARGET: &str = "tpu_dynamo.bf16_matmul_nt_bias_gelu_tanh";
pub const BF16_MATMUL_NN_BIAS_GELU_TANH_TARGET: &str = "tpu_dynamo.bf16_matmul_nn_bias_gelu_tanh";
/// The same with SiLU of the rounded sums, times a bf16 factor shaped as the result (Llama's MLP).
pub const BF16_MATMUL_NT_SILU_TIMES_TARGET: &str = "tpu_dynamo.bf16_matmul_nt_silu_times";
pub const BF16_MATMUL_NN_SILU_TIMES_TARGET: &str = "tpu_dynamo.bf16_matmul_nn_silu_times";
/// The custom call targets of a bf16 convolution as a product on the tiles: its windows `[N·P,
/// T·C]` (a row per output position: the T kernel offsets' C channels each, offset-major) times
/// its weight as it lies, `[O, C, *kernel]` (T = the kernel's positions), and the same adding a
/// bias `[O]` to the f32 sums before they are rounded.
pub const BF16_CONV_WINDOWS_TARGET: &str = "tpu_dynamo.bf16_conv_windows";
pub const BF16_CONV_WINDOWS_BIAS_TARGET: &str = "tpu_dynamo.bf16_conv_windows_bias";
/// The custom call targets of an f32 product with a matrix stored `[N, K]` and `[K, N]`.
pub const F32_MATMUL_NT_TARGET: &str = "tpu_dynamo.f32_matmul_nt";
pub const F32_MATMUL_NN_TARGET: &str = "tpu_dynamo.f32_matmul_nn";
/// The same products with a bias `[N]` added to each row, and then the tanh GELU.
pub const F32_MATMUL_NT_BIAS_TARGET: &str = "tpu_dynamo.f32_matmul_nt_bias";
pub const F32_MATMUL_NN_BIAS_TARGET: &str = "tpu_dynamo.f32_matmul_nn_bias";
pub const F32_MATMUL_NT_BIAS_GELU_TANH_TARGET: &str = "tpu_dynamo.f32_matmul_nt_bias_gelu_tanh";
pub const F32_MATMUL_NN_BIAS_GELU_TANH_TARGET: &str = "tpu_dynamo.f32_matmul_nn_bias_gelu_tanh";
/// The same products with SiLU applied, times a factor of the result's shape (a gated MLP's
/// other product).
pub const F32_MATMUL_NT_SILU_TIMES_TARGET: &str = "tpu_dynamo.f32_matmul_nt_silu_times";
pub const F32_MATMUL_NN_SILU_TIMES_TARGET: &str = "tpu_dynamo.f32_matmul_nn_silu_times";
/// The same products with a residual of the result's shape added last, after a bias `[N]` in
/// the `_bias_` ones (a transformer block's `x + proj(h)`).
pub const F32_MATMUL_NT_PLUS_TARGET: &str = "tpu_dynamo.f32_matmul_nt_plus";
pub const F32_MATMUL_NN_PLUS_TARGET: &str = "tpu_dynamo.f32_matmul_nn_plus";
pub const F32_MATMUL_NT_BIAS_PLUS_TARGET: &str = "tpu_dynamo.f32_matmul_nt_bias_plus";
pub const F32_MATMUL_NN_BIAS_PLUS_TARGET: &str = "tpu_dynamo.f32_matmul_nn_bias_plus";
/// The custom call targets of f32 attention without a mask and with the causal one.
pub const F32_ATTENTION_TARGET: &str = "tpu_dynamo.f32_attention";
pub const F32_CAUSAL_ATTENTION_TARGET: &str = "tpu_dynamo.f32_causal_attention";
/// The same for bf16 attention on AMX tiles.
pub const BF16_ATTENTION_TARGET: &str = "tpu_dynamo.bf16_attention";
pub const BF16_CAUSAL_ATTENTION_TARGET: &str = "tpu_dynamo.bf16_causal_attention";
/// The custom call target of an f32 convolution of 3×3 windows, stride 1, padding 1 (NCHW, OIHW).
pub const F32_CONV3X3_TARGET: &str = "tpu_dynamo.f32_conv3x3";
/// The same in bf16 on AVX-512 BF16, the input's channels in pairs (`[N, C/2, H, W, 2]`), with a
/// bias `[O]` or none, rounded once.
pub const BF16_CONV3X3_TARGET: &str = "tpu_dynamo.bf16_conv3x3";
/// The custom call target of f32 LayerNorm over the last dim.
pub const F32_LAYER_NORM_TARGET: &str = "tpu_dynamo.f32_layer_norm";
/// The same over bf16 rows into bf16 results (computed in f32, rounded once), as eager's.
pub const BF16_LAYER_NORM_TARGET: &str = "tpu_dynamo.bf16_layer_norm";
/// The custom call target of f32 RMSNorm over the last dim.
pub const F32_RMS_NORM_TARGET: &str = "tpu_dynamo.f32_rms_norm";
/// The same over bf16 rows into bf16, rounded where transformers' bf16 RMSNorm rounds.
pub const BF16_RMS_NORM_TARGET: &str = "tpu_dynamo.bf16_rms_norm";
/// The custom call target of f32 rotary position embeddings (transformers' `rotate_half` form).
pub const F32_ROTARY_TARGET: &str = "tpu_dynamo.f32_rotary";

const PJRT_EXTENSION_FFI: u32 = 5;
const XLA_FFI_EXTENSION_METADATA: c_int = 1;
const XLA_FFI_STAGE_EXECUTE: c_int = 3;
const XLA_FFI_BF16: c_int = 16;
const XLA_FFI_F32: c_int = 11;
const XLA_FFI_S64: c_int = 5;

/// `PJRT_FFI_Extension` with `register_handler`, the slot added after `user_data_add`.
#[repr(C)]
struct PjrtFfiExtension {
    base: PJRT_Extension_Base,
    type_id_register: *const c_void,
    user_data_add: *const c_void,
    register_handler: Option<unsafe extern "C" fn(*mut RegisterHandlerArgs) -> *mut pjrt_sys::PJRT_Error>,
}

/// `PJRT_FFI_Register_Handler_Args` as plugins of PJRT API 0.115 lay it out (52 bytes; later
/// headers add an `api_version` field after the name, which such a plugin reads as garbage).
#[repr(C)]
struct RegisterHandlerArgs {
    struct_size: usize,
    target_name: *const c_char,
    target_name_size: usize,
    handler: *const c_void,
    platform_name: *const c_char,
    platform_name_size: usize,
    traits: u32,
}
const REGISTER_HANDLER_ARGS_SIZE: usize = 52;

#[repr(C)]
struct FfiExtensionBase {
    struct_size: usize,
    kind: c_int,
    next: *mut FfiExtensionBase,
}

#[repr(C)]
struct FfiApiVersion {
    struct_size: usize,
    extension_start: *mut c_void,
    major: c_int,
    minor: c_int,
}

#[repr(C)]
struct FfiMetadata {
    struct_size: usize,
    api_version: FfiApiVersion,
    traits: u32,
}

#[repr(C)]
struct FfiMetadataExtension {
    base: FfiExtensionBase,
    metadata: *mut FfiMetadata,
}

#[repr(C)]
struct FfiList {
    struct_size: usize,
    extension_start: *mut c_void,
    size: i64,
    types: *const c_int,
    items: *const *mut FfiBuffer,
}

#[repr(C)]
struct FfiBuffer {
    struct_size: usize,
    extension_start: *mut c_void,
    dtype: c_int,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

#[repr(C)]
struct FfiCallFrame {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    api: *const c_void,
    ctx: *mut c_void,
    stage: c_int,
    args: FfiList,
    rets: FfiList,
}

/// Registers with `plugin`, for the host platform, the handlers this CPU runs fast and returns
/// their targets: none where the plugin has no FFI extension that can register handlers (then
/// the compiler must not emit the calls).
pub fn register(plugin: &Plugin) -> Vec<&'static str> {
    let mut handlers: Vec<(&'static str, *const c_void)> = vec![];
    if fast_on_this_cpu() {
        handlers.extend([(BF16_MATVEC_TARGET, bf16_matvec as *const c_void), (BF16_VECMAT_TARGET, bf16_vecmat as *const c_void)]);
    }
    if gemm::available() {
        handlers.extend([(F32_MATMUL_NT_TARGET, f32_matmul_nt as *const c_void), (F32_MATMUL_NN_TARGET, f32_matmul_nn as *const c_void)]);
        handlers.extend([
            (F32_MATMUL_NT_BIAS_TARGET, f32_matmul_nt_bias as *const c_void),
            (F32_MATMUL_NN_BIAS_TARGET, f32_matmul_nn_bias as *const c_void),
            (F32_MATMUL_NT_BIAS_GELU_TANH_TARGET, f32_matmul_nt_bias_gelu_tanh as *const c_void),
            (F32_MATMUL_NN_BIAS_GELU_TANH_TARGET, f32_matmul_nn_bias_gelu_tanh as *const c_void),
            (F32_MATMUL_NT_SILU_TIMES_TARGET, f32_matmul_nt_silu_times as *const c_void),
            (F32_MATMUL_NN_SILU_TIMES_TARGET, f32_matmul_nn_silu_times as *const c_void),
            (F32_MATMUL_NT_PLUS_TARGET, f32_matmul_nt_plus as *const c_void),
            (F32_MATMUL_NN_PLUS_TARGET, f32_matmul_nn_plus as *const c_void),
            (F32_MATMUL_NT_BIAS_PLUS_TARGET, f32_matmul_nt_bias_plus as *const c_void),
            (F32_MATMUL_NN_BIAS_PLUS_TARGET, f32_matmul_nn_bias_plus as *const c_void),
        ]);
        handlers.extend([(F32_ATTENTION_TARGET, f32_attention as *const c_void), (F32_CAUSAL_ATTENTION_TARGET, f32_causal_attention as *const c_void)]);
        #[cfg(target_arch = "x86_64")]
        handlers.extend([
            (F32_LAYER_NORM_TARGET, f32_layer_norm as *const c_void),
            (F32_RMS_NORM_TARGET, f32_rms_norm as *const c_void),
            (F32_ROTARY_TARGET, f32_rotary as *const c_void),
        ]);
        handlers.push((F32_CONV3X3_TARGET, f32_conv3x3 as *const c_void));
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl") {
            handlers.extend([(BF16_LAYER_NORM_TARGET, bf16_layer_norm as *const c_void), (BF16_RMS_NORM_TARGET, bf16_rms_norm as *const c_void)]);
        }
        if amx::bf16_products() {
            handlers.extend([(BF16_MATMUL_NT_TARGET, bf16_matmul_nt as *const c_void), (BF16_MATMUL_NN_TARGET, bf16_matmul_nn as *const c_void)]);
            handlers.extend([(BF16_MATMUL_NT_BIAS_TARGET, bf16_matmul_nt_bias as *const c_void), (BF16_MATMUL_NN_BIAS_TARGET, bf16_matmul_nn_bias as *const c_void)]);
            handlers.extend([
                (BF16_MATMUL_NT_BIAS_GELU_TANH_TARGET, bf16_matmul_nt_bias_gelu_tanh as *const c_void),
                (BF16_MATMUL_NN_BIAS_GELU_TANH_TARGET, bf16_matmul_nn_bias_gelu_tanh as *const c_void),
                (BF16_MATMUL_NT_SILU_TIMES_TARGET, bf16_matmul_nt_silu_times as *const c_void),
                (BF16_MATMUL_NN_SILU_TIMES_TARGET, bf16_matmul_nn_silu_times as *const c_void),
            ]);
            handlers.extend([(BF16_CONV_WINDOWS_TARGET, bf16_conv_windows as *const c_void), (BF16_CONV_WINDOWS_BIAS_TARGET, bf16_conv_windows_bias as *const c_void)]);
            if conv::bf16_available() {
                handlers.push((BF16_CONV3X3_TARGET, bf16_conv3x3 as *const c_void));
            }
            #[cfg(target_arch = "x86_64")]
            if tile_attention::available() {
                handlers.extend([(BF16_ATTENTION_TARGET, bf16_attention as *const c_void), (BF16_CAUSAL_ATTENTION_TARGET, bf16_causal_attention as *const c_void)]);
            }
        }
    }
    // The argument layout below is the one of PJRT API 0.115; later headers differ.
    if handlers.is_empty() || plugin.api_version().1 > 115 {
        return vec![];
    }
    let mut ext = plugin.extension_start();
    // SAFETY: the plugin's extension chain is a list of structs it owns for its lifetime, each
    // starting with a `PJRT_Extension_Base` whose size covers the struct.
    unsafe {
        while !ext.is_null() {
            if (*ext).type_ == PJRT_EXTENSION_FFI && (*ext).struct_size >= std::mem::size_of::<PjrtFfiExtension>() {
                let ffi = &*(ext as *const PjrtFfiExtension);
                let Some(register) = ffi.register_handler else { return vec![] };
                let registered = handlers.iter().all(|&(name, handler)| {
                    let platform = "Host";
                    let mut args = RegisterHandlerArgs {
                        struct_size: REGISTER_HANDLER_ARGS_SIZE,
                        target_name: name.as_ptr().cast(),
                        target_name_size: name.len(),
                        handler,
                        platform_name: platform.as_ptr().cast(),
                        platform_name_size: platform.len(),
                        traits: 0,
                    };
                    plugin.status(register(&mut args)).is_ok()
                });
                return if registered { handlers.into_iter().map(|(name, _)| name).collect() } else { vec![] };
            }
            ext = (*ext).next;
        }
    }
    vec![]
}

#[repr(C)]
struct FfiErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    message: *const c_char,
    code: c_int,
}
/// `XLA_FFI_Error_Create`'s slot in `XLA_FFI_Api`: after its size, extension list,
/// `XLA_FFI_Api_Version` (24 bytes) and internal API pointer.
const ERROR_CREATE_OFFSET: usize = 48;
const XLA_FFI_INTERNAL: c_int = 13;

/// An XLA FFI error saying `message` (the plugin turns it into the execute's error), or null
/// where the API table is too old to make one.
unsafe fn error(frame: &FfiCallFrame, target: &str, message: &str) -> *mut c_void {
    type Create = unsafe extern "C" fn(*mut FfiErrorCreateArgs) -> *mut c_void;
    let api = frame.api as *const u8;
    if api.is_null() || *(api as *const usize) < ERROR_CREATE_OFFSET + std::mem::size_of::<usize>() {
        return std::ptr::null_mut();
    }
    let Some(create) = *(api.add(ERROR_CREATE_OFFSET) as *const Option<Create>) else { return std::ptr::null_mut() };
    let message = std::ffi::CString::new(format!("tpu_dynamo host kernel {target}: {message}")).unwrap_or_default();
    let mut args = FfiErrorCreateArgs {
        struct_size: std::mem::size_of::<FfiErrorCreateArgs>() - 4,
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        code: XLA_FFI_INTERNAL,
    };
    create(&mut args)
}

/// XLA's own thread pool, as a handler's call frame offers it (`XLA_FFI_ThreadPool_Schedule`):
/// its workers run the rest of the executable, so work handed to them finds them awake, where
/// a thread of ours would leave them to park and be woken again after our kernel.
#[derive(Clone, Copy)]
struct XlaPool {
    api: *const u8,
    schedule: unsafe extern "C" fn(*mut ScheduleArgs) -> *mut c_void,
    ctx: *mut c_void,
    threads: usize,
}

#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    error: *mut c_void,
}

#[repr(C)]
struct ScheduleArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    ctx: *mut c_void,
    task: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
}

#[repr(C)]
struct NumThreadsArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    ctx: *mut c_void,
    num_threads: *mut i64,
}

/// `XLA_FFI_Error_Destroy`'s slot, after `_Create` and `_GetMessage`; `XLA_FFI_ThreadPool_Schedule`
/// and `_NumThreads`' slots, after `XLA_FFI_DeviceMemory_Free`.
const ERROR_DESTROY_OFFSET: usize = 64;
const THREAD_POOL_SCHEDULE_OFFSET: usize = 136;
const THREAD_POOL_NUM_THREADS_OFFSET: usize = 144;

impl XlaPool {
    /// The pool of the execute `frame` belongs to: `None` where the API table predates it or
    /// the execute has none.
    unsafe fn of(frame: &FfiCallFrame) -> Option<Self> {
        type NumThreads = unsafe extern "C" fn(*mut NumThreadsArgs) -> *mut c_void;
        let api = frame.api as *const u8;
        if api.is_null() || *(api as *const usize) < THREAD_POOL_NUM_THREADS_OFFSET + std::mem::size_of::<usize>() {
            return None;
        }
        let schedule = (*(api.add(THREAD_POOL_SCHEDULE_OFFSET) as *const Option<unsafe extern "C" fn(*mut ScheduleArgs) -> *mut c_void>))?;
        let num_threads = (*(api.add(THREAD_POOL_NUM_THREADS_OFFSET) as *const Option<NumThreads>))?;
        let mut threads = 0i64;
        let mut args = NumThreadsArgs { struct_size: std::mem::size_of::<NumThreadsArgs>(), extension_start: std::ptr::null_mut(), ctx: frame.ctx, num_threads: &mut threads };
        let ok = destroy(api, num_threads(&mut args));
        (ok && threads > 0).then_some(XlaPool { api, schedule, ctx: frame.ctx, threads: threads as usize })
    }

    /// `of(frame)`, and the threads the work may take: the pool's, or ours where it has none.
    unsafe fn with_threads(frame: &FfiCallFrame) -> (Option<Self>, usize) {
        let xla = Self::of(frame);
        (xla, xla.map_or_else(pool::threads, |xla| xla.threads))
    }

    /// Hands `task(data)` to a worker; false where the pool refused it (the caller then runs
    /// the work itself, so the error is dropped unread).
    fn schedule(&self, task: unsafe extern "C" fn(*mut c_void), data: *mut c_void) -> bool {
        let mut args = ScheduleArgs { struct_size: std::mem::size_of::<ScheduleArgs>(), extension_start: std::ptr::null_mut(), ctx: self.ctx, task, data };
        // SAFETY: the slots were read from the API table of the running execute, with its context.
        unsafe { destroy(self.api, (self.schedule)(&mut args)) }
    }
}

/// Frees `error` (if any) through `api`'s `XLA_FFI_Error_Destroy`; true where there was none.
unsafe fn destroy(api: *const u8, error: *mut c_void) -> bool {
    type Destroy = unsafe extern "C" fn(*mut ErrorDestroyArgs);
    if error.is_null() {
        return true;
    }
    if let Some(destroy) = *(api.add(ERROR_DESTROY_OFFSET) as *const Option<Destroy>) {
        destroy(&mut ErrorDestroyArgs { struct_size: std::mem::size_of::<ErrorDestroyArgs>(), extension_start: std::ptr::null_mut(), error });
    }
    false
}

/// Whether the f32 products run on AMX tiles here (`amx`).
pub fn products_on_tiles() -> bool {
    amx::available()
}

/// Whether our vector kernel, from a weight kept as panels, beats XLA's products of long
/// contractions and of few rows: with AVX-512 (an AMD Zen 4: 1.1-1.4 times as fast), not with
/// AVX2's half-width vectors (a Zen 3: SmolLM-135M's forward 324-340 ms on XLA's, 361 on ours).
pub fn kept_panels_beat_xla() -> bool {
    gemm::avx512()
}

/// The weight's layout: `[N, K]` (`y = x @ w.T`) or `[K, N]` (`y = x @ w`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    RowPerOutput,
    RowPerInput,
}

/// Whether `frame` asks a handler to run: false for XLA's metadata query at registration
/// (answered here) and for stages other than execution.
unsafe fn executes(frame: &mut FfiCallFrame) -> bool {
    let mut ext = frame.extension_start;
    while !ext.is_null() {
        if (*ext).kind == XLA_FFI_EXTENSION_METADATA {
            let metadata = &mut *(*(ext as *mut FfiMetadataExtension)).metadata;
            metadata.api_version.major = 0;
            metadata.api_version.minor = 1;
            metadata.traits = 0;
            return false;
        }
        ext = (*ext).next;
    }
    frame.stage == XLA_FFI_STAGE_EXECUTE
}

/// How a product handler reads its weight: a matrix stored `[N, K]` or `[K, N]`, or a
/// convolution's `[O, C, *kernel]` against its windows (the matrix `[O, T·C]`, its K reordered
/// by `gemm::tap_major`).
#[derive(Clone, Copy, PartialEq)]
enum Weight {
    RowPerOutput,
    RowPerInput,
    Windows,
}

/// What a product handler's operands after `x` and `w` are, and what its kernel does with them.
#[derive(Clone, Copy, PartialEq)]
enum Finish {
    /// None: the product as it is.
    Product,
    /// A bias `[N]` added, then the activation.
    Bias(Activation),
    /// SiLU applied, then times a factor shaped as `y`.
    SiluTimes,
    /// A residual shaped as `y` added last (f32), after a bias `[N]` where `bias`.
    Plus { bias: bool },
}

impl Finish {
    fn operands(self) -> usize {
        match self {
            Finish::Product => 2,
            Finish::Bias(_) | Finish::SiluTimes | Finish::Plus { bias: false } => 3,
            Finish::Plus { bias: true } => 4,
        }
    }
}

/// The product handlers XLA calls, each `handle` for its target, weight, operands and finish.
macro_rules! product_handlers {
    ($($name:ident: $target:ident, $weight:ident, $operands:ident, $finish:expr;)*) => {
        $(unsafe extern "C" fn $name(frame: *mut FfiCallFrame) -> *mut c_void {
            handle(&mut *frame, $target, Weight::$weight, $operands, $finish)
        })*
    };
}

product_handlers! {
    bf16_matvec: BF16_MATVEC_TARGET, RowPerOutput, XLA_FFI_BF16, Finish::Product;
    bf16_vecmat: BF16_VECMAT_TARGET, RowPerInput, XLA_FFI_BF16, Finish::Product;
    bf16_matmul_nt: BF16_MATMUL_NT_TARGET, RowPerOutput, XLA_FFI_BF16, Finish::Product;
    bf16_matmul_nn: BF16_MATMUL_NN_TARGET, RowPerInput, XLA_FFI_BF16, Finish::Product;
    bf16_matmul_nt_bias: BF16_MATMUL_NT_BIAS_TARGET, RowPerOutput, XLA_FFI_BF16, Finish::Bias(Activation::Identity);
    bf16_matmul_nn_bias: BF16_MATMUL_NN_BIAS_TARGET, RowPerInput, XLA_FFI_BF16, Finish::Bias(Activation::Identity);
    bf16_matmul_nt_bias_gelu_tanh: BF16_MATMUL_NT_BIAS_GELU_TANH_TARGET, RowPerOutput, XLA_FFI_BF16, Finish::Bias(Activation::GeluTanh);
    bf16_matmul_nn_bias_gelu_tanh: BF16_MATMUL_NN_BIAS_GELU_TANH_TARGET, RowPerInput, XLA_FFI_BF16, Finish::Bias(Activation::GeluTanh);
    bf16_matmul_nt_silu_times: BF16_MATMUL_NT_SILU_TIMES_TARGET, RowPerOutput, XLA_FFI_BF16, Finish::SiluTimes;
    bf16_matmul_nn_silu_times: BF16_MATMUL_NN_SILU_TIMES_TARGET, RowPerInput, XLA_FFI_BF16, Finish::SiluTimes;
    bf16_conv_windows: BF16_CONV_WINDOWS_TARGET, Windows, XLA_FFI_BF16, Finish::Product;
    bf16_conv_windows_bias: BF16_CONV_WINDOWS_BIAS_TARGET, Windows, XLA_FFI_BF16, Finish::Bias(Activation::Identity);
    f32_matmul_nt: F32_MATMUL_NT_TARGET, RowPerOutput, XLA_FFI_F32, Finish::Product;
    f32_matmul_nn: F32_MATMUL_NN_TARGET, RowPerInput, XLA_FFI_F32, Finish::Product;
    f32_matmul_nt_bias: F32_MATMUL_NT_BIAS_TARGET, RowPerOutput, XLA_FFI_F32, Finish::Bias(Activation::Identity);
    f32_matmul_nn_bias: F32_MATMUL_NN_BIAS_TARGET, RowPerInput, XLA_FFI_F32, Finish::Bias(Activation::Identity);
    f32_matmul_nt_bias_gelu_tanh: F32_MATMUL_NT_BIAS_GELU_TANH_TARGET, RowPerOutput, XLA_FFI_F32, Finish::Bias(Activation::GeluTanh);
    f32_matmul_nn_bias_gelu_tanh: F32_MATMUL_NN_BIAS_GELU_TANH_TARGET, RowPerInput, XLA_FFI_F32, Finish::Bias(Activation::GeluTanh);
    f32_matmul_nt_silu_times: F32_MATMUL_NT_SILU_TIMES_TARGET, RowPerOutput, XLA_FFI_F32, Finish::SiluTimes;
    f32_matmul_nn_silu_times: F32_MATMUL_NN_SILU_TIMES_TARGET, RowPerInput, XLA_FFI_F32, Finish::SiluTimes;
    f32_matmul_nt_plus: F32_MATMUL_NT_PLUS_TARGET, RowPerOutput, XLA_FFI_F32, Finish::Plus { bias: false };
    f32_matmul_nn_plus: F32_MATMUL_NN_PLUS_TARGET, RowPerInput, XLA_FFI_F32, Finish::Plus { bias: false };
    f32_matmul_nt_bias_plus: F32_MATMUL_NT_BIAS_PLUS_TARGET, RowPerOutput, XLA_FFI_F32, Finish::Plus { bias: true };
    f32_matmul_nn_bias_plus: F32_MATMUL_NN_BIAS_PLUS_TARGET, RowPerInput, XLA_FFI_F32, Finish::Plus { bias: true };
}

/// The typed-FFI handlers: `y[m, n] = sum_k x[m, k] * w[n, k]` (or `w[k, n]`) for `x` `[.., K]`
/// into `y` `[.., N]`: bf16 `x` and `w` (leading dims of one or a few rows, or for the tiles'
/// targets many) into bf16 or f32 `y`, or f32 throughout, then as `finish` says: a bias `[N]`
/// added (f32; a bf16 product's bf16, to its f32 sums before they are rounded) and the activation
/// applied, or SiLU applied and the result multiplied by a factor, or (f32) a residual added
/// after the bias, if any. Answers XLA's metadata query at registration; never unwinds into the
/// plugin.
unsafe fn handle(frame: &mut FfiCallFrame, target: &'static str, weight: Weight, operands: c_int, finish: Finish) -> *mut c_void {
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    let arguments = finish.operands();
    if frame.args.size as usize != arguments || frame.rets.size != 1 {
        return error(frame, target, &format!("expects {arguments} operands and one result"));
    }
    let (x, w, y) = (&**frame.args.items, &**frame.args.items.add(1), &**frame.rets.items);
    let (xd, wd, yd) = (dims(x), dims(w), dims(y));
    // `taps`: a convolution's kernel positions, the T of its `[O, T·C]`.
    let convolution = weight == Weight::Windows;
    let layout = if weight == Weight::RowPerInput { Layout::RowPerInput } else { Layout::RowPerOutput };
    let (w_matrix, taps) = match (convolution, wd) {
        (false, &[rows_w, cols_w]) => (Some((rows_w, cols_w)), 1),
        (true, &[outputs, channels, ref kernel @ ..]) if !kernel.is_empty() => {
            let taps: i64 = kernel.iter().product();
            (Some((outputs, channels * taps)), taps as usize)
        }
        _ => (None, 1),
    };
    let (Some((&k, lead)), Some((rows_w, cols_w))) = (xd.split_last(), w_matrix) else {
        let expects = if convolution { "windows x [.., K] and a weight w [O, C, *kernel]" } else { "x [.., K] and a matrix w" };
        return error(frame, target, &format!("expects {expects}, got {xd:?} and {wd:?}"));
    };
    let (n, kw) = if layout == Layout::RowPerOutput { (rows_w, cols_w) } else { (cols_w, rows_w) };
    let rows: i64 = lead.iter().product();
    let shapes_agree = kw == k && yd.iter().product::<i64>() == rows * n;
    // The third operand: a bias `[N]`, or for SiLU the factor, shaped as `y`. A bf16 product's
    // bias is bf16, widened for its f32 sums here (`n` values): a convert of XLA's before the
    // call made the call itself slower.
    let mut widened = vec![];
    let epilogue = if finish == Finish::Product {
        None
    } else {
        let third = &**frame.args.items.add(2);
        let mut data = third.data as *const f32;
        let half = operands == XLA_FFI_BF16 && third.dtype == XLA_FFI_BF16;
        if half && dims(third) == [n] {
            widened = f32_values(third, n as usize);
            data = widened.as_ptr();
        }
        let shaped_as_y = operands == XLA_FFI_F32 || half;
        let (epilogue, fits, expects) = match finish {
            // A bf16 product's factor is bf16 (read as it is: `[M, N]` values).
            Finish::SiluTimes => {
                let times = if half { Factor::Bf16(third.data as *const u16) } else { Factor::F32(data) };
                let epilogue = Epilogue { activation: Activation::Silu, times, ..Epilogue::NONE };
                (epilogue, dims(third) == yd && shaped_as_y, "a factor shaped as y")
            }
            Finish::Plus { bias: false } => (Epilogue { plus: data, ..Epilogue::NONE }, dims(third) == yd && shaped_as_y, "a residual shaped as y"),
            Finish::Plus { bias: true } => {
                let residual = &**frame.args.items.add(3);
                let fits = dims(third) == [n] && dims(residual) == yd && residual.dtype == XLA_FFI_F32;
                (Epilogue { bias: data, plus: residual.data as *const f32, ..Epilogue::NONE }, fits, "a bias [N] and a residual shaped as y")
            }
            Finish::Bias(activation) => (Epilogue { bias: data, activation, ..Epilogue::NONE }, dims(third) == [n], "a bias [N]"),
            Finish::Product => unreachable!("a product has no third operand"),
        };
        let plus_on_f32 = epilogue.plus.is_null() || operands == XLA_FFI_F32;
        if !(third.dtype == XLA_FFI_F32 || half) || !fits || !plus_on_f32 {
            let name = if operands == XLA_FFI_BF16 { "bf16 or f32" } else { "f32" };
            return error(frame, target, &format!("expects {expects} ({name}) for y {yd:?}, got {:?} of XLA type {}", dims(third), third.dtype));
        }
        Some(epilogue)
    };
    let ran = if operands == XLA_FFI_F32 {
        if [x.dtype, w.dtype, y.dtype] != [XLA_FFI_F32; 3] || !shapes_agree {
            return error(frame, target, &format!("expects f32 x [.., K], w and y [.., N], got {xd:?}, {wd:?}, {yd:?}"));
        }
        let shape = (rows as usize, n as usize, k as usize);
        let (xla, threads) = XlaPool::with_threads(frame);
        std::panic::catch_unwind(|| {
            let operands = (x.data as *const u8, w.data as *const u8, Out::F32(y.data as *mut f32));
            let (product, chunks) = gemm::Gemm::new(operands, amx::Values::F32, shape, (layout, 1), threads, epilogue);
            run_units(xla, product, chunks, threads.saturating_sub(1));
        })
    } else {
        let out = match y.dtype {
            XLA_FFI_F32 => Out::F32(y.data as *mut f32),
            XLA_FFI_BF16 => Out::Bf16(y.data as *mut u16),
            other => return error(frame, target, &format!("expects a bf16 or f32 result, got XLA type {other}")),
        };
        if x.dtype != XLA_FFI_BF16 || w.dtype != XLA_FFI_BF16 || !shapes_agree {
            return error(frame, target, &format!("expects bf16 x [.., K], w and y [.., N], got {xd:?}, {wd:?}, {yd:?}"));
        }
        let (k, n, rows) = (k as usize, n as usize, rows as usize);
        // The tiles' targets (a bias and GELU are applied on the tiles' way out only); the
        // matrix-vector ones below.
        if (epilogue.is_some() || convolution || [BF16_MATMUL_NT_TARGET, BF16_MATMUL_NN_TARGET].contains(&target)) && amx::bf16_products() {
            let (xla, threads) = XlaPool::with_threads(frame);
            let ran = std::panic::catch_unwind(|| {
                let operands = (x.data as *const u8, w.data as *const u8, out);
                let (product, chunks) = gemm::Gemm::new(operands, amx::Values::Bf16, (rows, n, k), (layout, taps), threads, epilogue);
                run_units(xla, product, chunks, threads.saturating_sub(1));
            });
            return answer(frame, target, ran);
        }
        // A few rows, or (where the tiles are not) any number of them.
        std::panic::catch_unwind(|| {
            let xb = std::slice::from_raw_parts(x.data as *const u16, rows * k).to_vec();
            let xf = xb.iter().map(|&v| bf16_to_f32(v)).collect();
            let job = MatVec { w: w.data as *const u16, layout, x: xb, x_f32: xf, out, k, n, rows };
            pool::run(&job, n.div_ceil(OUTPUTS_PER_CHUNK));
        })
    };
    answer(frame, target, ran)
}

/// Runs `job`'s `units` on this thread and on up to `helpers` tasks handed to XLA's pool, or
/// on our own threads where the plugin lends none (alone where `helpers` is 0).
///
/// # Safety
/// As `Chunked::chunk`: the job's pointers cover its units, which write disjoint memory.
unsafe fn run_units<T: pool::Chunked + 'static>(xla: Option<XlaPool>, job: T, units: usize, helpers: usize) {
    match xla {
        Some(xla) => pool::run_scheduled(job, units, helpers, |task, data| xla.schedule(task, data)),
        None if helpers == 0 => (0..units).for_each(|u| job.chunk(u)),
        None => pool::run(&job, units),
    }
}

/// A handler's answer: none where it ran, its error where it panicked.
unsafe fn answer(frame: &mut FfiCallFrame, target: &str, ran: std::thread::Result<()>) -> *mut c_void {
    match ran {
        Ok(()) => std::ptr::null_mut(),
        Err(_) => error(frame, target, "panicked"),
    }
}

unsafe extern "C" fn f32_attention(frame: *mut FfiCallFrame) -> *mut c_void {
    attend(&mut *frame, F32_ATTENTION_TARGET, false)
}

unsafe extern "C" fn f32_causal_attention(frame: *mut FfiCallFrame) -> *mut c_void {
    attend(&mut *frame, F32_CAUSAL_ATTENTION_TARGET, true)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn bf16_attention(frame: *mut FfiCallFrame) -> *mut c_void {
    attend(&mut *frame, BF16_ATTENTION_TARGET, false)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn bf16_causal_attention(frame: *mut FfiCallFrame) -> *mut c_void {
    attend(&mut *frame, BF16_CAUSAL_ATTENTION_TARGET, true)
}

/// The attention handlers: `q` `[B, H, L, E]`, `k` and `v` `[B, Hkv, S, E]`, the scale (a 0-d
/// f32, by which `q` is multiplied as it is read) and, where given, what a mask adds to the
/// scores (f32 `[B or 1, H or 1, L, S]`), the count of keys that are not padding (a 0-d i64) and
/// where `q`, `k`, `v` and `out` are (`AttentionLayout`), into `out` `[B, H, L, E]`
/// (or as the layout says), its f32 logsumexp `[B, H, L]` and, where the layout asks for them,
/// copies of `k` and `v` as `[B, Hkv, S, E]`, on XLA's threads. f32, or bf16 on AMX tiles.
/// Where the layout appends (`AttentionLayout::appended`), `k` and `v` are a step's new rows,
/// the cache's keys and values before them follow (packed, `[B, Hkv, S - rows, E]`), and the
/// copies are the grown cache, packed.
unsafe fn attend(frame: &mut FfiCallFrame, target: &'static str, causal: bool) -> *mut c_void {
    let bf16 = target == BF16_ATTENTION_TARGET || target == BF16_CAUSAL_ATTENTION_TARGET;
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    if !(4..=9).contains(&frame.args.size) || !(2..=4).contains(&frame.rets.size) {
        return error(frame, target, "expects q, k, v, the scale, and a mask's bias, a key count and a layout where given; out, lse, and the keys' and values' copies the layout asks for");
    }
    let buffer = |list: &FfiList, i: usize| &**list.items.add(i);
    let [q, k, v] = [0, 1, 2].map(|i| buffer(&frame.args, i));
    // After them, an appended attention's cache (two 4-d), then a mask's bias (4-d), a key
    // count (0-d i64), the scale (0-d f32) and a layout (1-d i64), each where given.
    let extra = |from: usize, rank: i64, dtype: Option<c_int>| (from..frame.args.size as usize).map(|i| buffer(&frame.args, i)).find(|b| b.rank == rank && dtype.is_none_or(|d| b.dtype == d));
    let layout = extra(3, 1, Some(XLA_FFI_S64));
    let [out, lse] = [0, 1].map(|i| buffer(&frame.rets, i));
    let (qd, kd, vd, od, ld) = (dims(q), dims(k), dims(v), dims(out), dims(lse));
    let placed = match layout {
        Some(layout) => match AttentionLayout::read(layout, od, ld, [q, k, v].map(|b| numel(b))) {
            Some(placed) => placed,
            None => {
                let values = std::slice::from_raw_parts(layout.data as *const i64, dims(layout).iter().product::<i64>().max(0) as usize);
                return error(frame, target, &format!("layout {values:?} does not fit out {od:?}, lse {ld:?} and q, k, v {qd:?}, {kd:?}, {vd:?}"));
            }
        },
        None => match AttentionLayout::packed(qd, kd, vd, od, ld) {
            Some(placed) => placed,
            None => {
                let name = if bf16 { "bf16" } else { "f32" };
                return error(frame, target, &format!("expects {name} q [B, H, L, E], k and v [B, Hkv, S, E], out [B, H, L, E] and f32 lse [B, H, L], got {qd:?}, {kd:?}, {vd:?}, {od:?}, {ld:?}"));
            }
        },
    };
    let after = if placed.appended == 0 { 3 } else { 5 };
    let (bias, count, scale) = (extra(after, 4, None), extra(after, 0, Some(XLA_FFI_S64)), extra(after, 0, Some(XLA_FFI_F32)));
    let given = after + [bias.is_some(), count.is_some(), scale.is_some(), layout.is_some()].iter().filter(|&&g| g).count();
    let (Some(scale), true) = (scale, frame.args.size as usize == given) else {
        return error(frame, target, "expects the scale (0-d f32), and at most one mask bias, one key count (0-d i64) and one layout (1-d i64), after an appended attention's cache");
    };
    let shape = placed.shape;
    let values = if bf16 { XLA_FFI_BF16 } else { XLA_FFI_F32 };
    // The copies asked for, in the results after `lse`.
    let asked = placed.presents.iter().filter(|&&asked| asked).count();
    if 2 + asked != frame.rets.size as usize {
        return error(frame, target, &format!("the layout asks for {asked} copies of the keys and values, the call has {} results", frame.rets.size));
    }
    let mut copies = (2..2 + asked).map(|i| buffer(&frame.rets, i));
    let presents = placed.presents.map(|asked| if asked { copies.next() } else { None });
    let kv_dims = [shape.batch, shape.kv_heads, shape.len_kv, shape.dim].map(|d| d as i64);
    if ![q, k, v, out].iter().chain(presents.iter().flatten()).all(|b| b.dtype == values) || lse.dtype != XLA_FFI_F32 {
        return error(frame, target, &format!("expects q, k, v, out (and the copies) of one type ({}) and an f32 lse", if bf16 { "bf16" } else { "f32" }));
    }
    if let Some(copy) = presents.iter().flatten().find(|b| dims(b) != kv_dims) {
        return error(frame, target, &format!("expects the keys' and values' copies as {kv_dims:?}, got {:?}", dims(copy)));
    }
    let bias = match bias.map(|b| (b, dims(b))) {
        None => None,
        Some((b, bd)) => match <[i64; 4]>::try_from(bd).map(|d| d.map(|d| d as usize)) {
            Ok([mb, mh, l, s]) if b.dtype == XLA_FFI_F32 && [1, shape.batch].contains(&mb) && [1, shape.heads].contains(&mh) && [l, s] == [shape.len_q, shape.len_kv] => {
                let head_stride = if mh == 1 { 0 } else { l * s };
                Some(attention::Bias { data: b.data as *const f32, batch_stride: if mb == 1 { 0 } else { mh * l * s }, head_stride })
            }
            _ => return error(frame, target, &format!("expects an f32 mask bias [B or 1, H or 1, L, S] for q {qd:?} and k {kd:?}, got {bd:?}")),
        },
    };
    let valid = count.map_or(shape.len_kv, |c| (*(c.data as *const i64)).max(0) as usize);
    // An appended attention's cache: `before` rows a head, the key count less the new rows.
    let cache = match placed.appended {
        0 => None,
        rows => {
            let pasts = [3, 4].map(|i| buffer(&frame.args, i));
            let capacity = [shape.batch, shape.kv_heads, shape.len_kv - rows, shape.dim].map(|d| d as i64);
            match valid.checked_sub(rows).filter(|&before| count.is_some() && before <= shape.len_kv - rows) {
                Some(before) if pasts.iter().all(|p| p.dtype == values && dims(p) == capacity) => Some((pasts, before, rows)),
                _ => return error(frame, target, &format!("expects the cache's keys and values as {capacity:?} and a key count of {rows} to {}, got {:?}, {:?} and {valid}", shape.len_kv, dims(pasts[0]), dims(pasts[1]))),
            }
        }
    };
    let scale = *(scale.data as *const f32);
    let (xla, threads) = XlaPool::with_threads(frame);
    let [qs, ks, vs, os] = placed.strides;
    let lse = lse.data as *mut f32;
    /// The operands of element type `T` as the kernels take them: `k` and `v` read where they
    /// are, or for an appended attention where the grown cache was written (first, here), which
    /// then needs no other copy.
    unsafe fn operands<T: Copy + 'static>(
        xla: Option<XlaPool>,
        (threads, shape): (usize, attention::Shape),
        [k, v]: [attention::Placed<T>; 2],
        presents: [Option<&FfiBuffer>; 2],
        cache: Option<([&FfiBuffer; 2], usize, usize)>,
    ) -> ([attention::Placed<T>; 2], attention::Presents<T>) {
        let presents = presents.map(|p| p.map(|b| b.data as *mut T));
        let Some((pasts, before, rows)) = cache else { return ([k, v], presents) };
        let to = presents.map(|p| p.expect("an appended layout asks for both copies"));
        let grow = attention::Appended { past: pasts.map(|p| p.data as *const T), new: [k, v], to, kv_heads: shape.kv_heads, before, rows, dim: shape.dim };
        let grown = grow.grown();
        let units = 2 * shape.batch * shape.kv_heads;
        let helpers = if units * (before + rows) * shape.dim * std::mem::size_of::<T>() >= ALONE_MAX_COPY_BYTES { threads.saturating_sub(1) } else { 0 };
        run_units(xla, grow, units, helpers.min(units - 1));
        (grown, [None, None])
    }
    #[cfg(target_arch = "x86_64")]
    if bf16 {
        let at = |b: &FfiBuffer, strides| attention::Placed { data: b.data as *mut u16, strides };
        let ran = std::panic::catch_unwind(|| {
            let ([k, v], presents) = operands(xla, (threads, shape), [at(k, ks), at(v, vs)], presents, cache);
            let (job, units, parts) = tile_attention::TileAttention::new((at(q, qs), k, v, scale), (bias, valid), (at(out, os), lse, presents), shape, causal, threads);
            run_units(xla, job, units, parts - 1)
        });
        return answer(frame, target, ran);
    }
    let at = |b: &FfiBuffer, strides| attention::Placed { data: b.data as *mut f32, strides };
    let ran = std::panic::catch_unwind(|| {
        let ([k, v], presents) = operands(xla, (threads, shape), [at(k, ks), at(v, vs)], presents, cache);
        let (job, units, parts) = attention::Attention::new((at(q, qs), k, v, scale), (bias, valid), (at(out, os), lse, presents), shape, causal, threads);
        run_units(xla, job, units, parts - 1)
    });
    answer(frame, target, ran)
}

/// The fewest bytes an appended attention's copy of its grown cache splits between threads at:
/// below, the copy takes a few µs, less than handing half of it to a helper costs. Above, two
/// threads copy SmolLM-135M's caches after a 1024-token prompt (1.6 MB a layer) a little
/// faster than one: its step 25.8-34.9 against 29.2-41.9 ms in turns (AMD EPYC, noisy).
const ALONE_MAX_COPY_BYTES: usize = 256 << 10;

/// An attention's shape, where its `q`, `k`, `v` and `out` are, and whether the keys and the
/// values are copied out. Given to the kernels as an i64 `[18]`: the key/value heads, the keys,
/// 1 where `out` is `[B, L, H, E]` (0: `[B, H, L, E]`), each of `q`, `k` and `v`'s `Strides`
/// (offset, batch, head, row), then 1 for each of `k` and `v` copied (as results after `lse`,
/// in that order), then `appended`; the queries' batch, heads and count come from `lse`
/// `[B, H, L]`, the head size from `out`.
struct AttentionLayout {
    shape: attention::Shape,
    strides: [attention::Strides; 4],
    presents: [bool; 2],
    /// 0, or how many new rows `k` and `v` hold (their strides place that many): a padded
    /// decode step's keys are its cache's (packed, before them) grown by these, written packed
    /// into both copies (`attention::Appended`), the key count's last rows.
    appended: usize,
}

impl AttentionLayout {
    /// Operands as their dims say, row-major.
    fn packed(qd: &[i64], kd: &[i64], vd: &[i64], od: &[i64], ld: &[i64]) -> Option<AttentionLayout> {
        let (&[batch, heads, len_q, dim], &[kb, kv_heads, len_kv, kdim]) = (qd, kd) else { return None };
        if !(kb == batch && kdim == dim && kv_heads > 0 && heads % kv_heads == 0 && len_kv > 0 && vd == kd && od == qd && ld == &qd[..3]) {
            return None;
        }
        let [batch, heads, kv_heads, len_q, len_kv, dim] = [batch, heads, kv_heads, len_q, len_kv, dim].map(|d| d as usize);
        let (queries, keys) = (attention::Strides::packed(heads, len_q, dim), attention::Strides::packed(kv_heads, len_kv, dim));
        Some(AttentionLayout { shape: attention::Shape { batch, heads, kv_heads, len_q, len_kv, dim }, strides: [queries, keys, keys, queries], presents: [false; 2], appended: 0 })
    }

    /// The layout operand `layout`, where every row it places lies within its operand
    /// (`elements` of `q`, `k` and `v`) and `out` and `lse` are as it says.
    unsafe fn read(layout: &FfiBuffer, od: &[i64], ld: &[i64], elements: [usize; 3]) -> Option<AttentionLayout> {
        if dims(layout) != [18] {
            return None;
        }
        let values = std::slice::from_raw_parts(layout.data as *const i64, 18);
        let values: Vec<usize> = values.iter().map(|&x| usize::try_from(x).ok()).collect::<Option<_>>()?;
        let (&[batch, heads, len_q], &[.., dim]) = (ld, od) else { return None };
        let [batch, heads, len_q, dim] = [batch, heads, len_q, dim].map(|d| d as usize);
        let (kv_heads, len_kv, interleaved) = (values[0], values[1], values[2]);
        let out_dims = match interleaved {
            0 => [batch, heads, len_q, dim],
            1 => [batch, len_q, heads, dim],
            _ => return None,
        };
        let appended = values[17];
        let presents = [values[15] == 1, values[16] == 1];
        if od.iter().map(|&d| d as usize).ne(out_dims) || kv_heads == 0 || heads % kv_heads != 0 || len_kv == 0 || values[15..17].iter().any(|&p| p > 1) {
            return None;
        }
        if appended > len_kv || (appended > 0 && presents != [true; 2]) {
            return None;
        }
        let rows = if appended > 0 { appended } else { len_kv };
        let strides = |i: usize| attention::Strides { offset: values[3 + 4 * i], batch: values[4 + 4 * i], head: values[5 + 4 * i], row: values[6 + 4 * i] };
        let out = if interleaved == 1 { attention::Strides::interleaved(heads, len_q, dim) } else { attention::Strides::packed(heads, len_q, dim) };
        let spans = [[batch, heads, len_q, dim], [batch, kv_heads, rows, dim], [batch, kv_heads, rows, dim]];
        let fits = (0..3).all(|i| strides(i).extent(spans[i]).is_some_and(|e| e <= elements[i]));
        fits.then(|| AttentionLayout { shape: attention::Shape { batch, heads, kv_heads, len_q, len_kv, dim }, strides: [strides(0), strides(1), strides(2), out], presents, appended })
    }
}

/// How many elements a buffer holds.
unsafe fn numel(b: &FfiBuffer) -> usize {
    dims(b).iter().map(|&d| d.max(0) as usize).product()
}

/// The convolution handler: f32 `x` `[N, C, H, W]` and `w` `[O, C, 3, 3]` into `y` `[N, O, H,
/// W]` (stride 1, padding 1), on XLA's threads.
unsafe extern "C" fn f32_conv3x3(frame: *mut FfiCallFrame) -> *mut c_void {
    let (frame, target) = (&mut *frame, F32_CONV3X3_TARGET);
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    if frame.args.size != 2 || frame.rets.size != 1 {
        return error(frame, target, "expects x and w, and one result");
    }
    let (x, w, y) = (&**frame.args.items, &**frame.args.items.add(1), &**frame.rets.items);
    let (xd, wd, yd) = (dims(x), dims(w), dims(y));
    let shape = match (xd, wd) {
        (&[batch, channels, height, width], &[outputs, wc, 3, 3]) if wc == channels && yd == [batch, outputs, height, width] => {
            let [batch, channels, outputs, height, width] = [batch, channels, outputs, height, width].map(|d| d as usize);
            Some(conv::Shape { batch, channels, outputs, height, width })
        }
        _ => None,
    };
    let (Some(shape), true) = (shape, [x, w, y].iter().all(|b| b.dtype == XLA_FFI_F32)) else {
        return error(frame, target, &format!("expects f32 x [N, C, H, W], w [O, C, 3, 3] and y [N, O, H, W], got {xd:?}, {wd:?}, {yd:?}"));
    };
    let (xla, threads) = XlaPool::with_threads(frame);
    let ran = std::panic::catch_unwind(|| {
        let operands = conv::Operands::F32 { x: x.data as *const f32, w: w.data as *const f32, y: y.data as *mut f32 };
        let (job, units) = conv::Conv::new(operands, shape, threads);
        run_units(xla, job, units, threads.saturating_sub(1));
    });
    answer(frame, target, ran)
}

/// The bf16 convolution handler: `x` `[N, C/2, H, W, 2]` (channels in pairs) and `w` `[O, C, 3,
/// 3]`, then a bias `[O]` (bf16 or f32) or none, into bf16 `y` `[N, O, H, W]` (stride 1, padding
/// 1), on XLA's threads.
unsafe extern "C" fn bf16_conv3x3(frame: *mut FfiCallFrame) -> *mut c_void {
    let (frame, target) = (&mut *frame, BF16_CONV3X3_TARGET);
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    if !(2..=3).contains(&frame.args.size) || frame.rets.size != 1 {
        return error(frame, target, "expects x, w and perhaps a bias, and one result");
    }
    let (x, w, y) = (&**frame.args.items, &**frame.args.items.add(1), &**frame.rets.items);
    let bias = (frame.args.size == 3).then(|| &**frame.args.items.add(2));
    let (xd, wd, yd) = (dims(x), dims(w), dims(y));
    let shape = match (xd, wd) {
        (&[batch, pairs, height, width, 2], &[outputs, channels, 3, 3]) if (channels + 1) / 2 == pairs && yd == [batch, outputs, height, width] => {
            let [batch, channels, outputs, height, width] = [batch, pairs, outputs, height, width].map(|d| d as usize);
            Some(conv::Shape { batch, channels, outputs, height, width })
        }
        _ => None,
    };
    let bias_fits = bias.is_none_or(|b| dims(b) == [yd[1]] && [XLA_FFI_BF16, XLA_FFI_F32].contains(&b.dtype));
    let (Some(shape), true, true) = (shape, [x, w, y].iter().all(|b| b.dtype == XLA_FFI_BF16), bias_fits) else {
        return error(frame, target, &format!("expects bf16 x [N, C/2, H, W, 2], w [O, C, 3, 3] and y [N, O, H, W], a bias [O] (bf16 or f32) or none, got {xd:?}, {wd:?}, {yd:?}"));
    };
    let (outputs, channels) = (wd[0] as usize, wd[1] as usize);
    let bias = bias.map_or(vec![], |b| f32_values(b, shape.outputs));
    let (xla, threads) = XlaPool::with_threads(frame);
    let ran = std::panic::catch_unwind(|| {
        // The weight's channels paired once per version where it is declared unchanging, else here.
        let pair = || conv::paired_weight(w.data as *const u16, outputs, channels);
        let key = (w.data as usize, outputs, channels * 9, true, 9, unchanging::Packed::ChannelPairs);
        let lines = conv::paired_weight_u32s(outputs, shape.channels).div_ceil(16);
        let kept = unchanging::panels(key, (outputs * channels * 18, lines * 16), pair);
        let paired: std::sync::Arc<[gemm::Line]> = kept.unwrap_or_else(|| pair().into());
        let bias = if bias.is_empty() { std::ptr::null() } else { bias.as_ptr() };
        let operands = conv::Operands::Bf16Pairs { x: x.data as *const u32, w: paired.as_ptr() as *const u32, y: y.data as *mut u16, bias };
        let (job, units) = conv::Conv::new(operands, shape, threads);
        run_units(xla, job, units, threads.saturating_sub(1));
    });
    answer(frame, target, ran)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn f32_layer_norm(frame: *mut FfiCallFrame) -> *mut c_void {
    layer_norm(&mut *frame, F32_LAYER_NORM_TARGET, false)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn bf16_layer_norm(frame: *mut FfiCallFrame) -> *mut c_void {
    layer_norm(&mut *frame, BF16_LAYER_NORM_TARGET, true)
}

/// The LayerNorm handlers: `x` `[rows, N]` (f32, or bf16 with `half`), f32 `weight` and `bias`
/// `[N]` and `eps` (0-d), and for a modulated norm f32 `factor` and `shift` `[batches, N]`
/// (`layer_norm::Modulation`), into `y` `[rows, N]` (as `x`), each row's f32 mean and rstd
/// `[rows]`, on XLA's threads.
#[cfg(target_arch = "x86_64")]
unsafe fn layer_norm(frame: &mut FfiCallFrame, target: &'static str, half: bool) -> *mut c_void {
    let expects = if half {
        "expects bf16 x [rows, N], f32 weight and bias [N], f32 eps [] (then f32 factor and shift [batches, N]), bf16 y [rows, N], f32 mean and rstd [rows]"
    } else {
        "expects f32 x [rows, N], weight and bias [N], eps [] (then factor and shift [batches, N]), y [rows, N], mean and rstd [rows]"
    };
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    let (args, [y, mean, rstd]): (Vec<&FfiBuffer>, _) = match frame.args.size {
        6 => match norm_buffers::<6, 3>(frame, target, expects, half) {
            Ok((args, rets)) => (args.to_vec(), rets),
            Err(answer) => return answer,
        },
        _ => match norm_buffers::<4, 3>(frame, target, expects, half) {
            Ok((args, rets)) => (args.to_vec(), rets),
            Err(answer) => return answer,
        },
    };
    // Every buffer, for an error's message.
    let all = || -> Vec<&FfiBuffer> { args.iter().copied().chain([y, mean, rstd]).collect() };
    let (x, weight, bias, eps) = (args[0], args[1], args[2], args[3]);
    let &[rows, n] = dims(x) else { return shapes_error(frame, target, expects, &all()) };
    if !(dims(y) == [rows, n] && dims(weight) == [n] && dims(bias) == [n] && eps.rank == 0 && dims(mean) == [rows] && dims(rstd) == [rows]) {
        return shapes_error(frame, target, expects, &all());
    }
    let modulation = match args[4..] {
        [factor, shift] => match dims(factor) {
            &[batches, width] if width == n && dims(shift) == [batches, n] && batches > 0 && rows % batches == 0 => {
                Some(layer_norm::Modulation { factor: factor.data as *const f32, shift: shift.data as *const f32, per_batch: (rows / batches) as usize })
            }
            _ => return shapes_error(frame, target, expects, &all()),
        },
        _ => None,
    };
    let (rows, n) = (rows as usize, n as usize);
    let norm = layer_norm::LayerNorm {
        x: x.data as *const u8,
        weight: weight.data as *const f32,
        bias: bias.data as *const f32,
        y: y.data as *mut u8,
        half,
        mean: mean.data as *mut f32,
        rstd: rstd.data as *mut f32,
        rows,
        n,
        eps: *(eps.data as *const f32),
        modulation,
    };
    run_norm(frame, target, norm)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn f32_rms_norm(frame: *mut FfiCallFrame) -> *mut c_void {
    rms_norm(&mut *frame, F32_RMS_NORM_TARGET, false)
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn bf16_rms_norm(frame: *mut FfiCallFrame) -> *mut c_void {
    rms_norm(&mut *frame, BF16_RMS_NORM_TARGET, true)
}

/// The RMSNorm handlers: `x` `[rows, N]` (f32, or bf16 with `half`), f32 `weight` `[N]` and
/// `eps` (0-d) into `y` `[rows, N]` (as `x`), on XLA's threads.
#[cfg(target_arch = "x86_64")]
unsafe fn rms_norm(frame: &mut FfiCallFrame, target: &'static str, half: bool) -> *mut c_void {
    let expects = if half {
        "expects bf16 x [rows, N], f32 weight [N] and eps [], bf16 y [rows, N]"
    } else {
        "expects f32 x [rows, N], weight [N], eps [] and y [rows, N]"
    };
    let ([x, weight, eps], [y]) = match norm_buffers(frame, target, expects, half) {
        Ok(buffers) => buffers,
        Err(answer) => return answer,
    };
    let &[rows, n] = dims(x) else { return shapes_error(frame, target, expects, &[x, weight, eps, y]) };
    if !(dims(y) == [rows, n] && dims(weight) == [n] && eps.rank == 0) {
        return shapes_error(frame, target, expects, &[x, weight, eps, y]);
    }
    let (rows, n) = (rows as usize, n as usize);
    let norm = layer_norm::RmsNorm { x: x.data as *const u8, weight: weight.data as *const f32, y: y.data as *mut u8, half, rows, n, eps: *(eps.data as *const f32) };
    run_norm(frame, target, norm)
}

/// The rotary handler: f32 `x` `[B, H, L, D]`, or `[B, L, H, D]` where `rows_first` (a 0-d s64)
/// is 1, `cos` and `sin` `[B or 1, L, D]` into `out` `[B, H, L, D]` (`D` even), on XLA's threads.
#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn f32_rotary(frame: *mut FfiCallFrame) -> *mut c_void {
    let (frame, target) = (&mut *frame, F32_ROTARY_TARGET);
    let expects = "expects f32 x [B, H, L, D] or [B, L, H, D], cos and sin [B or 1, L, D], s64 rows_first [], f32 out [B, H, L, D], D even";
    if !executes(frame) {
        return std::ptr::null_mut();
    }
    if frame.args.size != 4 || frame.rets.size != 1 {
        return error(frame, target, &format!("{expects}: 4 arguments and 1 result"));
    }
    let [x, cos, sin, rows_first] = std::array::from_fn(|i| &**frame.args.items.add(i));
    let out = &**frame.rets.items;
    let all = [x, cos, sin, rows_first, out];
    let f32s = [x, cos, sin, out].iter().all(|b| b.dtype == XLA_FFI_F32);
    let (&[batches, heads, tokens, width], true) = (dims(out), f32s && rows_first.dtype == XLA_FFI_S64 && rows_first.rank == 0) else {
        return shapes_error(frame, target, expects, &all);
    };
    let rows_first = *(rows_first.data as *const i64) != 0;
    let read = if rows_first { [batches, tokens, heads, width] } else { [batches, heads, tokens, width] };
    let table = dims(cos);
    if !(dims(x) == read && dims(sin) == table && table.len() == 3 && (table[0] == 1 || table[0] == batches) && table[1..] == [tokens, width] && width % 2 == 0) {
        return shapes_error(frame, target, expects, &all);
    }
    let dims = [batches, heads, tokens, width].map(|d| d as usize);
    let (xla, threads) = XlaPool::with_threads(frame);
    let units = rotary::Rotary::units(dims, threads);
    let job = rotary::Rotary {
        x: x.data as *const f32,
        cos: cos.data as *const f32,
        sin: sin.data as *const f32,
        out: out.data as *mut f32,
        dims,
        per_batch: table[0] != 1,
        rows_first,
        units,
    };
    answer(frame, target, std::panic::catch_unwind(|| run_units(xla, job, units, units - 1)))
}

/// A norm handler's `A` arguments and `R` results, all f32 but for the first of each, bf16 with
/// `half`; where it is not the execute stage or they are not, what the handler answers instead
/// (nothing, or the error `expects` describes).
#[cfg(target_arch = "x86_64")]
unsafe fn norm_buffers<const A: usize, const R: usize>(
    frame: &mut FfiCallFrame,
    target: &str,
    expects: &str,
    half: bool,
) -> Result<([&'static FfiBuffer; A], [&'static FfiBuffer; R]), *mut c_void> {
    if !executes(frame) {
        return Err(std::ptr::null_mut());
    }
    if frame.args.size as usize != A || frame.rets.size as usize != R {
        return Err(error(frame, target, &format!("{expects}: {A} arguments and {R} results")));
    }
    let args: [&FfiBuffer; A] = std::array::from_fn(|i| &**frame.args.items.add(i));
    let rets: [&FfiBuffer; R] = std::array::from_fn(|i| &**frame.rets.items.add(i));
    let rows = if half { XLA_FFI_BF16 } else { XLA_FFI_F32 };
    let typed = |list: &[&FfiBuffer]| list.iter().enumerate().all(|(i, b)| b.dtype == if i == 0 { rows } else { XLA_FFI_F32 });
    if !typed(&args) || !typed(&rets) {
        return Err(shapes_error(frame, target, expects, &[args.as_slice(), rets.as_slice()].concat()));
    }
    Ok((args, rets))
}

/// A buffer's dims.
unsafe fn dims(b: &FfiBuffer) -> &[i64] {
    std::slice::from_raw_parts(b.dims, b.rank as usize)
}

/// The first `n` values of a bf16 or f32 buffer (a bias), as f32.
unsafe fn f32_values(b: &FfiBuffer, n: usize) -> Vec<f32> {
    if b.dtype == XLA_FFI_BF16 {
        std::slice::from_raw_parts(b.data as *const u16, n).iter().map(|&v| bf16_to_f32(v)).collect()
    } else {
        std::slice::from_raw_parts(b.data as *const f32, n).to_vec()
    }
}

/// The error for `buffers` not of the types and shapes `expects` describes.
#[cfg(target_arch = "x86_64")]
unsafe fn shapes_error(frame: &FfiCallFrame, target: &str, expects: &str, buffers: &[&FfiBuffer]) -> *mut c_void {
    let got: Vec<(&[i64], c_int)> = buffers.iter().map(|&b| (dims(b), b.dtype)).collect();
    error(frame, target, &format!("{expects}, got (dims, XLA type) {got:?}"))
}

/// A norm's rows split over XLA's threads.
#[cfg(target_arch = "x86_64")]
unsafe fn run_norm<T: layer_norm::Rows + std::panic::UnwindSafe + 'static>(frame: &mut FfiCallFrame, target: &str, norm: T) -> *mut c_void {
    let (xla, threads) = XlaPool::with_threads(frame);
    let units = norm.units(threads);
    answer(frame, target, std::panic::catch_unwind(|| run_units(xla, layer_norm::RowRuns(norm, units), units, units - 1)))
}

/// Outputs per unit of work: 64 rows of a 576-wide `[N, K]` weight are 72 KiB, within L2; a
/// `[K, N]` weight's 64 columns are 128 bytes of each row, two cache lines.
const OUTPUTS_PER_CHUNK: usize = 64;

/// A product's result: f32, or bf16 rounded from its f32 sums.
#[derive(Clone, Copy)]
enum Out {
    F32(*mut f32),
    Bf16(*mut u16),
}

impl Out {
    /// The result from element `offset` on.
    ///
    /// # Safety
    /// As `pointer::add`.
    unsafe fn add(self, offset: usize) -> Out {
        match self {
            Out::F32(y) => Out::F32(y.add(offset)),
            Out::Bf16(y) => Out::Bf16(y.add(offset)),
        }
    }

    /// The address of element `offset`, for a prefetch.
    fn address(self, offset: usize) -> *const i8 {
        match self {
            Out::F32(y) => y.wrapping_add(offset) as *const i8,
            Out::Bf16(y) => y.wrapping_add(offset) as *const i8,
        }
    }
}

/// One product: `w` `[n, k]` or `[k, n]`, `x` `[rows, k]` (and widened to f32), `out` `[rows, n]`.
struct MatVec {
    w: *const u16,
    layout: Layout,
    x: Vec<u16>,
    x_f32: Vec<f32>,
    out: Out,
    k: usize,
    n: usize,
    rows: usize,
}

impl pool::Chunked for MatVec {
    /// Outputs `chunk * OUTPUTS_PER_CHUNK ..` for every row of `x`.
    ///
    /// # Safety
    /// The pointers must cover the shapes; chunks are disjoint, so threads may run different
    /// ones at once.
    unsafe fn chunk(&self, chunk: usize) {
        let (k, n, first) = (self.k, self.n, chunk * OUTPUTS_PER_CHUNK);
        let last = (first + OUTPUTS_PER_CHUNK).min(n);
        let put = |r: usize, i: usize, v: f32| match self.out {
            Out::F32(y) => *y.add(r * n + first + i) = v,
            Out::Bf16(y) => *y.add(r * n + first + i) = f32_to_bf16(v),
        };
        let x = |r: usize| (&self.x[r * k..(r + 1) * k], &self.x_f32[r * k..(r + 1) * k]);
        if self.layout == Layout::RowPerInput {
            let w = std::slice::from_raw_parts(self.w, k * n);
            for r in 0..self.rows {
                vecmat(w, n, first..last, x(r).1, |i, v| put(r, i, v));
            }
            return;
        }
        let w = std::slice::from_raw_parts(self.w.add(first * k), (last - first) * k);
        let mut r = 0;
        #[cfg(target_arch = "x86_64")]
        if self.rows > 1 && std::arch::is_x86_feature_detected!("avx512bf16") {
            // Rows in fours, then twos: each weight row is read once for all of them.
            while r + 4 <= self.rows {
                let xs = [r, r + 1, r + 2, r + 3].map(&x);
                x86::matvec_rows_avx512_bf16(w, xs.map(|x| x.0), xs.map(|x| x.1), &mut |j, i, v| put(r + j, i, v));
                r += 4;
            }
            while r + 2 <= self.rows {
                let xs = [r, r + 1].map(&x);
                x86::matvec_rows_avx512_bf16(w, xs.map(|x| x.0), xs.map(|x| x.1), &mut |j, i, v| put(r + j, i, v));
                r += 2;
            }
        }
        for r in r..self.rows {
            matvec(w, x(r), |i, v| put(r, i, v));
        }
    }
}

fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

/// Round to nearest even, NaN kept NaN (as PyTorch rounds).
fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Whether this CPU runs one of the bf16 vector kernels below; elsewhere XLA's own products
/// are faster than the scalar loop, so they are not registered.
fn fast_on_this_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            || (std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `put(n, sum_k w[n, k] * x[k])` for every row `n` of `w` (`[N, K]` bf16); `x` `[K]` as bf16
/// and as f32.
fn matvec(w: &[u16], (xb, x): (&[u16], &[f32]), mut put: impl FnMut(usize, f32)) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            // SAFETY: the CPU has AVX-512 BF16; every read lies inside `w` and `x`.
            return unsafe { x86::matvec_avx512_bf16(w, xb, x, &mut put) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA; every read lies inside `w` and `x`.
            return unsafe { x86::matvec_avx2(w, x, &mut put) };
        }
    }
    for (n, row) in w.chunks_exact(x.len()).enumerate() {
        put(n, row.iter().zip(x).map(|(&a, &b)| bf16_to_f32(a) * b).sum());
    }
}

/// `put(j, sum_k x[k] * w[k, c])` for the columns `c = cols.start + j` of `w` (`[K, n]` bf16),
/// 64 at a time as independent f32 sums (vectorized by the compiler, 64 columns being 128 bytes
/// of each row), the rest one by one.
fn vecmat(w: &[u16], n: usize, cols: std::ops::Range<usize>, x: &[f32], mut put: impl FnMut(usize, f32)) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { x86::vecmat_avx512(w, n, cols, x, &mut put) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { x86::vecmat_avx2(w, n, cols, x, &mut put) };
        }
    }
    vecmat_columns(w, n, cols, x, &mut put)
}

#[inline(always)]
fn vecmat_columns(w: &[u16], n: usize, cols: std::ops::Range<usize>, x: &[f32], put: &mut impl FnMut(usize, f32)) {
    const BLOCK: usize = 64;
    let start = cols.start;
    let mut c = start;
    while c + BLOCK <= cols.end {
        let mut acc = [0f32; BLOCK];
        for (kk, &xk) in x.iter().enumerate() {
            let row = &w[kk * n + c..kk * n + c + BLOCK];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a = xk.mul_add(bf16_to_f32(v), *a);
            }
        }
        for (j, &a) in acc.iter().enumerate() {
            put(c - start + j, a);
        }
        c += BLOCK;
    }
    for col in c..cols.end {
        put(col - start, x.iter().enumerate().map(|(kk, &xk)| xk * bf16_to_f32(w[kk * n + col])).sum());
    }
}

/// The `[N, K]` kernels read the weight one row after another, front to back, as one stream (four rows
/// at a time, four streams, ran at a third of the memory's rate), into four independent sums.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{bf16_to_f32, vecmat_columns};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn vecmat_avx512(w: &[u16], n: usize, cols: std::ops::Range<usize>, x: &[f32], put: &mut impl FnMut(usize, f32)) {
        vecmat_columns(w, n, cols, x, put)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn vecmat_avx2(w: &[u16], n: usize, cols: std::ops::Range<usize>, x: &[f32], put: &mut impl FnMut(usize, f32)) {
        vecmat_columns(w, n, cols, x, put)
    }

    /// 32 columns per `vdpbf16ps` (products of bf16 pairs summed into f32 lanes, as oneDNN's
    /// bf16 kernels for PyTorch do); the tail of K in scalar code from `x`, `xb` widened.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn matvec_avx512_bf16(w: &[u16], xb: &[u16], x: &[f32], put: &mut impl FnMut(usize, f32)) {
        let k = x.len();
        let body = k - k % 32;
        let load = |p: *const u16| -> __m512bh { std::mem::transmute(_mm512_loadu_si512(p as *const __m512i)) };
        for (n, row) in w.chunks_exact(k).enumerate() {
            let (w, xp) = (row.as_ptr(), xb.as_ptr());
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut at = 0;
            while at + 128 <= body {
                for (j, a) in acc.iter_mut().enumerate() {
                    let o = at + 32 * j;
                    *a = _mm512_dpbf16_ps(*a, load(w.add(o)), load(xp.add(o)));
                }
                at += 128;
            }
            while at < body {
                acc[0] = _mm512_dpbf16_ps(acc[0], load(w.add(at)), load(xp.add(at)));
                at += 32;
            }
            let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            let tail: f32 = (body..k).map(|i| bf16_to_f32(row[i]) * x[i]).sum();
            put(n, _mm512_reduce_add_ps(sum) + tail);
        }
    }

    /// `M` rows of `x` at once, one sum each: every 64 bytes of a weight row, read once, go
    /// into all of them (`put(row, output, value)`).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn matvec_rows_avx512_bf16<const M: usize>(
        w: &[u16],
        xb: [&[u16]; M],
        x: [&[f32]; M],
        put: &mut impl FnMut(usize, usize, f32),
    ) {
        let k = x[0].len();
        let body = k - k % 32;
        let load = |p: *const u16| -> __m512bh { std::mem::transmute(_mm512_loadu_si512(p as *const __m512i)) };
        for (n, row) in w.chunks_exact(k).enumerate() {
            let mut acc = [_mm512_setzero_ps(); M];
            let mut at = 0;
            while at < body {
                let wv = load(row.as_ptr().add(at));
                for (a, xr) in acc.iter_mut().zip(&xb) {
                    *a = _mm512_dpbf16_ps(*a, wv, load(xr.as_ptr().add(at)));
                }
                at += 32;
            }
            for (r, (a, xr)) in acc.iter().zip(&x).enumerate() {
                let tail: f32 = (body..k).map(|i| bf16_to_f32(row[i]) * xr[i]).sum();
                put(r, n, _mm512_reduce_add_ps(*a) + tail);
            }
        }
    }

    /// 8 columns per step, widened to f32 by a shift, fused multiply-adds; the tail of K in
    /// scalar code.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn matvec_avx2(w: &[u16], x: &[f32], put: &mut impl FnMut(usize, f32)) {
        let k = x.len();
        let body = k - k % 8;
        let load = |p: *const u16| {
            let raw = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
        };
        for (n, row) in w.chunks_exact(k).enumerate() {
            let (w, xp) = (row.as_ptr(), x.as_ptr());
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut at = 0;
            while at + 32 <= body {
                for (j, a) in acc.iter_mut().enumerate() {
                    let o = at + 8 * j;
                    *a = _mm256_fmadd_ps(load(w.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
                }
                at += 32;
            }
            while at < body {
                acc[0] = _mm256_fmadd_ps(load(w.add(at)), _mm256_loadu_ps(xp.add(at)), acc[0]);
                at += 8;
            }
            let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
            let lanes: [f32; 4] = std::mem::transmute(half);
            let tail: f32 = (body..k).map(|i| bf16_to_f32(row[i]) * x[i]).sum();
            put(n, lanes.iter().sum::<f32>() + tail);
        }
    }
}

/// Test values in [-0.5, 0.5), the same for a seed on every run.
#[cfg(test)]
fn uniform(mut seed: u32) -> impl FnMut() -> f32 {
    move || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel this CPU has gives the scalar loop's sums to f32 summation's rounding.
    #[test]
    fn vector_kernels_agree_with_the_scalar_loop() {
        let (k, n) = (200, 37);
        let mut next = uniform(1);
        let w: Vec<u16> = (0..n * k).map(|_| f32_to_bf16(next())).collect();
        let xb: Vec<u16> = (0..k).map(|_| f32_to_bf16(next())).collect();
        let x: Vec<f32> = xb.iter().map(|&v| bf16_to_f32(v)).collect();
        let scalar: Vec<f32> = w.chunks_exact(k).map(|r| r.iter().zip(&x).map(|(&a, &b)| bf16_to_f32(a) * b).sum()).collect();
        let check = |got: &[f32]| {
            for (g, s) in got.iter().zip(&scalar) {
                assert!((g - s).abs() <= 1e-5, "{g} vs {s}");
            }
        };
        #[cfg(target_arch = "x86_64")]
        {
            let mut got = vec![0.0; n];
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                unsafe { x86::matvec_avx512_bf16(&w, &xb, &x, &mut |i, v| got[i] = v) };
                check(&got);
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                unsafe { x86::matvec_avx2(&w, &x, &mut |i, v| got[i] = v) };
                check(&got);
            }
        }
        let mut got = vec![0.0; n];
        matvec(&w, (&xb, &x), |i, v| got[i] = v);
        check(&got);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            // Several rows at once: every row of x the same vector, so each must give `scalar`.
            let mut rows = vec![vec![0.0; n]; 4];
            unsafe { x86::matvec_rows_avx512_bf16(&w, [&xb[..]; 4], [&x[..]; 4], &mut |r, i, v| rows[r][i] = v) };
            rows.iter().for_each(|row| check(row));
            unsafe { x86::matvec_rows_avx512_bf16(&w, [&xb[..]; 2], [&x[..]; 2], &mut |r, i, v| rows[r][i] = v + 1.0) };
            rows[..2].iter().for_each(|row| check(&row.iter().map(|v| v - 1.0).collect::<Vec<_>>()));
        }
    }

    /// The `[K, N]` kernels against the scalar sum, columns off the 64-column blocks included.
    #[test]
    fn vecmat_agrees_with_the_scalar_sum() {
        let (k, n, cols) = (70, 203, 3..200);
        let w: Vec<u16> = (0..k * n).map(|i| f32_to_bf16(((i * 7919) % 1000) as f32 / 1000.0 - 0.5)).collect();
        let x: Vec<f32> = (0..k).map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5).collect();
        let mut got = vec![0.0; cols.len()];
        vecmat(&w, n, cols.clone(), &x, |j, v| got[j] = v);
        for (j, c) in cols.enumerate() {
            let want: f32 = (0..k).map(|i| x[i] * bf16_to_f32(w[i * n + c])).sum();
            assert!((got[j] - want).abs() <= 1e-5, "column {c}: {} vs {want}", got[j]);
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }
}

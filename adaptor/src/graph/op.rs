//! The op set: what each node computes, with its attributes.
//!
//! Forward ops (v1) cover MLPs, CNNs and transformers; `*Grad` ops are the
//! backward rules that cannot be written as compositions of forward ops;
//! optimizer ops update variables in place. Shape and dtype rules live in
//! [`super::infer`].

use crate::tensor::{DType, Tensor, TensorType};
use serde::{Deserialize, Serialize};

/// Attributes of a 2-D convolution on NCHW tensors (weights OIHW, I = C / groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Conv2dAttrs {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for Conv2dAttrs {
    fn default() -> Self {
        Conv2dAttrs {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// Attributes of a 2-D pooling window on NCHW tensors (floor mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pool2dAttrs {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

/// What a node computes. Input order is fixed per op and documented on each
/// variant; `(mut)` marks inputs the op updates in place (they must be wired
/// straight from a `Variable`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- sources -------------------------------------------------------
    /// Per-iteration input fed by the job on each Run; the node name is the feed key.
    Placeholder(TensorType),
    /// Persistent tensor (weights, optimizer state, running statistics); its
    /// initial value comes with LoadGraph under the node name.
    Variable(TensorType),
    /// A constant embedded in the graph (small: scalars, masks).
    Constant(Tensor),

    // ---- elementwise, with numpy broadcasting (f32) -----------------------
    /// (a, b)
    Add,
    /// (a, b)
    Sub,
    /// (a, b)
    Mul,
    /// (a, b)
    Div,
    /// (x)
    Relu,
    /// (x) exact (erf) GELU, as PyTorch's default.
    Gelu,
    /// (x)
    Sigmoid,
    /// (x)
    Tanh,
    /// (x)
    Exp,
    /// (x)
    Log,
    /// (x)
    Sqrt,
    /// (x) -> x * factor
    Scale(f32),

    // ---- softmax family ----------------------------------------------------
    /// (x)
    Softmax { axis: usize },
    /// (x)
    LogSoftmax { axis: usize },

    // ---- shape ---------------------------------------------------------------
    /// (x) same elements, new shape.
    Reshape { shape: Vec<usize> },
    /// (x) output axis i is input axis perm[i].
    Transpose { perm: Vec<usize> },
    /// (x0, x1, ...) joined along `axis`.
    Concat { axis: usize },
    /// (x) the range start..end of one axis.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// (x) numpy broadcast to `shape`.
    BroadcastTo { shape: Vec<usize> },
    /// (x) sum over the axes that broadcasting `shape` to x's shape would add
    /// or stretch: the adjoint of BroadcastTo.
    SumTo { shape: Vec<usize> },

    // ---- reductions ----------------------------------------------------------
    /// (x)
    ReduceSum { axes: Vec<usize>, keep_dims: bool },
    /// (x)
    ReduceMean { axes: Vec<usize>, keep_dims: bool },
    /// (x)
    ReduceMax { axes: Vec<usize>, keep_dims: bool },

    // ---- linear algebra ------------------------------------------------------
    /// (a, b): a [..., m, k] (or [..., k, m] transposed), b [..., k, n] (or
    /// [..., n, k]); batch dimensions broadcast.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
    },

    // ---- neural-network ops --------------------------------------------------
    /// (x [N,C,H,W], w [O,C/g,kh,kw], bias [O] optional)
    Conv2d(Conv2dAttrs),
    /// (x [N,C,H,W])
    MaxPool2d(Pool2dAttrs),
    /// (x [N,C,H,W])
    AvgPool2d {
        pool: Pool2dAttrs,
        count_include_pad: bool,
    },
    /// (x [N,C,H,W]) -> [N,C]
    GlobalAvgPool,
    /// Inference form. (x [N,C,...], gamma [C], beta [C], mean [C], var [C])
    BatchNorm { eps: f32 },
    /// Training form: normalises with batch statistics and updates the
    /// running statistics in place (PyTorch's unbiased variance for the
    /// running value). (x [N,C,...], gamma [C], beta [C], running_mean [C] (mut),
    /// running_var [C] (mut)) -> (y, saved_mean [C], saved_invstd [C])
    BatchNormTrain { eps: f32, momentum: f32 },
    /// Normalises over the last axis. (x [..., D], gamma [D], beta [D])
    LayerNorm { eps: f32 },
    /// (table [V, D] f32, indices [...] i64) -> [..., D]
    Embedding,
    /// Mean cross-entropy of logits against class labels.
    /// (logits [N, C], labels [N] i64) -> scalar
    CrossEntropy,
    /// Mean squared error. (prediction, target) same shape -> scalar
    MseLoss,

    // ---- backward rules --------------------------------------------------------
    /// (x, dy) -> dx
    ReluGrad,
    /// (x, dy) -> dx
    GeluGrad,
    /// (y, dy) -> dx, y the op's output
    SigmoidGrad,
    /// (y, dy) -> dx, y the op's output
    TanhGrad,
    /// (y, dy) -> dx, y the softmax output
    SoftmaxGrad { axis: usize },
    /// (y, dy) -> dx, y the log-softmax output
    LogSoftmaxGrad { axis: usize },
    /// (x, y, dy) -> dx: dy routed to the (first) maximum of each reduced group.
    ReduceMaxGrad { axes: Vec<usize>, keep_dims: bool },
    /// (dy) -> dx of the input's length `input_dim` along `axis`, zero outside start..end.
    SliceGrad {
        axis: usize,
        start: usize,
        input_dim: usize,
    },
    /// (dy, w) -> dx [N,C,H,W] = input_shape
    Conv2dGradInput {
        attrs: Conv2dAttrs,
        input_shape: [usize; 4],
    },
    /// (x, dy) -> dw [O,C/g,kh,kw] = filter_shape
    Conv2dGradFilter {
        attrs: Conv2dAttrs,
        filter_shape: [usize; 4],
    },
    /// (x, dy) -> dx
    MaxPool2dGrad(Pool2dAttrs),
    /// (x, dy) -> dx; x gives the shape only.
    AvgPool2dGrad {
        pool: Pool2dAttrs,
        count_include_pad: bool,
    },
    /// (x, gamma, saved_mean, saved_invstd, dy) -> (dx, dgamma, dbeta)
    BatchNormTrainGrad,
    /// (x, gamma, dy) -> (dx, dgamma, dbeta)
    LayerNormGrad { eps: f32 },
    /// (indices, dy) -> dtable [num_embeddings, D]
    EmbeddingGrad { num_embeddings: usize },
    /// (logits, labels, dloss scalar) -> dlogits
    CrossEntropyGrad,

    // ---- in-place updates --------------------------------------------------------
    /// PyTorch's SGD: (param (mut), grad, momentum_buf (mut), lr_scale [1]
    /// optional, skip [1] optional after lr_scale); no outputs. With
    /// `lr_scale` the step uses `lr * lr_scale`, so a job changes its
    /// learning rate by writing that variable. A non-zero `skip` (the found
    /// flag of [`Op::AmpUnscale`]) leaves the parameter and the buffer as
    /// they were.
    SgdUpdate {
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        nesterov: bool,
    },
    /// Adam, or AdamW when `decoupled`: (param (mut), grad, m (mut), v (mut),
    /// step (mut) f32 [1], lr_scale [1] optional, skip [1] optional after
    /// lr_scale); no outputs. With `lr_scale` the step uses `lr * lr_scale`
    /// (decoupled decay included). A non-zero `skip` leaves the parameter,
    /// the moments and the step count as they were.
    AdamUpdate {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        decoupled: bool,
    },
    /// (target (mut), value): copies value into the variable; no outputs.
    Assign,

    // ---- added for imported models (ONNX); appended so that the wire
    // ---- indices of the ops above stay as they were --------------------------
    /// (x) the error function.
    Erf,
    /// (x) -> min(max(x, min), max).
    Clip { min: f32, max: f32 },
    /// (cond, a, b), numpy broadcasting: a where cond != 0, else b (f32;
    /// conditions are 0/1 f32 masks).
    Where,
    /// (x) -> 1 where x is NaN, else 0.
    IsNan,
    /// (x) -> the same values as `to` (f32 to i64 truncates toward zero).
    Cast { to: DType },
    /// (seed i64 [1]) -> f32 `shape`: a dropout mask, each element 0 with
    /// probability `p`, else 1 / (1 - p); a pure function of the seed, the
    /// salt and the element's index ([`dropout_keep`]), the same on every
    /// backend. A job feeds a new seed each iteration; `salt` tells a
    /// graph's dropout ops apart.
    DropoutMask {
        p: f32,
        salt: u32,
        shape: Vec<usize>,
    },
    /// (x) -> relu6(x + 3) / 6, PyTorch's `hardsigmoid`.
    HardSigmoid,
    /// (x) -> x · relu6(x + 3) / 6, PyTorch's `hardswish`.
    HardSwish,
    /// (x, dy) -> dx: dy / 6 where -3 < x < 3, else 0.
    HardSigmoidGrad,
    /// (x, dy) -> dx: 0 below -3, dy · (x / 3 + 1/2) up to 3, dy above (as PyTorch).
    HardSwishGrad,

    // ---- loss scaling (fp16 training, docs/precision.md); appended ------------
    /// (grad f32, scale f32 [1], found_in f32 [1] optional) -> (grad · (1 /
    /// scale), found f32 [1]): the gradient of a scaled loss unscaled, and
    /// 1 where `found_in` is non-zero or any element of `grad` is NaN or
    /// infinite, else 0 (chained through a training graph's gradients, the
    /// last `found` says whether any overflowed).
    AmpUnscale,
    /// (scale (mut) f32 [1], growth_tracker (mut) f32 [1], found f32 [1]); no
    /// outputs. `GradScaler.update`: on a non-zero `found` the scale is
    /// multiplied by `backoff_factor` and the tracker set to 0; otherwise the
    /// tracker counts the clean step and, reaching `growth_interval`, is set
    /// to 0 while the scale is multiplied by `growth_factor` (kept when that
    /// product is not finite).
    AmpScaleUpdate {
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u32,
    },
}

/// The 24-bit threshold below which [`dropout_keep`]'s draw drops an element.
pub fn dropout_threshold(p: f32) -> u32 {
    ((f64::from(p) * f64::from(1u32 << 24)).round() as u32).min(1 << 24)
}

/// Whether element `i` of a [`Op::DropoutMask`] with `seed` and `salt`
/// is kept: a 24-bit draw (SplitMix64's finaliser of a combination of the
/// three) at or above `threshold` ([`dropout_threshold`]). The CUDA kernel
/// computes the same integers.
pub fn dropout_keep(seed: i64, salt: u32, i: u64, threshold: u32) -> bool {
    let mut z = (seed as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(salt).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(i);
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as u32) >= threshold
}

impl Op {
    /// Stable lower-case name, used in errors, logs and node names.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Placeholder(_) => "placeholder",
            Op::Variable(_) => "variable",
            Op::Constant(_) => "constant",
            Op::Add => "add",
            Op::Sub => "sub",
            Op::Mul => "mul",
            Op::Div => "div",
            Op::Relu => "relu",
            Op::Gelu => "gelu",
            Op::Sigmoid => "sigmoid",
            Op::Tanh => "tanh",
            Op::Exp => "exp",
            Op::Log => "log",
            Op::Sqrt => "sqrt",
            Op::Scale(_) => "scale",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::SumTo { .. } => "sum_to",
            Op::ReduceSum { .. } => "reduce_sum",
            Op::ReduceMean { .. } => "reduce_mean",
            Op::ReduceMax { .. } => "reduce_max",
            Op::MatMul { .. } => "matmul",
            Op::Conv2d(_) => "conv2d",
            Op::MaxPool2d(_) => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::GlobalAvgPool => "global_avg_pool",
            Op::BatchNorm { .. } => "batch_norm",
            Op::BatchNormTrain { .. } => "batch_norm_train",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Embedding => "embedding",
            Op::CrossEntropy => "cross_entropy",
            Op::MseLoss => "mse_loss",
            Op::ReluGrad => "relu_grad",
            Op::GeluGrad => "gelu_grad",
            Op::SigmoidGrad => "sigmoid_grad",
            Op::TanhGrad => "tanh_grad",
            Op::SoftmaxGrad { .. } => "softmax_grad",
            Op::LogSoftmaxGrad { .. } => "log_softmax_grad",
            Op::ReduceMaxGrad { .. } => "reduce_max_grad",
            Op::SliceGrad { .. } => "slice_grad",
            Op::Conv2dGradInput { .. } => "conv2d_grad_input",
            Op::Conv2dGradFilter { .. } => "conv2d_grad_filter",
            Op::MaxPool2dGrad(_) => "max_pool2d_grad",
            Op::AvgPool2dGrad { .. } => "avg_pool2d_grad",
            Op::BatchNormTrainGrad => "batch_norm_train_grad",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::CrossEntropyGrad => "cross_entropy_grad",
            Op::SgdUpdate { .. } => "sgd_update",
            Op::AdamUpdate { .. } => "adam_update",
            Op::Assign => "assign",
            Op::Erf => "erf",
            Op::Clip { .. } => "clip",
            Op::Where => "where",
            Op::IsNan => "is_nan",
            Op::Cast { .. } => "cast",
            Op::DropoutMask { .. } => "dropout_mask",
            Op::HardSigmoid => "hard_sigmoid",
            Op::HardSwish => "hard_swish",
            Op::HardSigmoidGrad => "hard_sigmoid_grad",
            Op::HardSwishGrad => "hard_swish_grad",
            Op::AmpUnscale => "amp_unscale",
            Op::AmpScaleUpdate { .. } => "amp_scale_update",
        }
    }

    /// Input positions this op updates in place.
    pub fn mutated_inputs(&self) -> &'static [usize] {
        match self {
            Op::BatchNormTrain { .. } => &[3, 4],
            Op::SgdUpdate { .. } => &[0, 2],
            Op::AdamUpdate { .. } => &[0, 2, 3, 4],
            Op::Assign => &[0],
            Op::AmpScaleUpdate { .. } => &[0, 1],
            _ => &[],
        }
    }

    /// True for sources (no inputs): placeholders, variables, constants.
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Placeholder(_) | Op::Variable(_) | Op::Constant(_))
    }
}

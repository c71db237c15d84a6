"""One rule per ATen op (overload packet name): how it becomes Lanes ops.
A rule takes the translator and the node, then the op's arguments as torch
passes them (Lanes tensors as `_Out`, known values as Python/torch values)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from ._ir import _Buffer, _Out, _feed_dtype, _float_name, _norm_axis, _pair

# ---------------------------------------------------------------------------
# rules: one function per ATen op (overload packet), args as torch passes them

_RULES: Dict[str, Callable[..., Any]] = {}

#: What masked attention scores become: float32's lowest value, as Hugging
#: Face's masks use (finite, so a saved job's JSON holds it; softmax gives 0).
_MASKED = float(torch.finfo(torch.float32).min)


def _rule(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        for n in names:
            _RULES[n] = f
        return f

    return deco


def _val_shape(node: torch.fx.Node) -> List[int]:
    val = node.meta.get("val")
    return [int(d) for d in val.shape]


@_rule("conv2d", "convolution")
def _conv2d(t, node, x, w, b=None, stride=1, padding=0, dilation=1, groups=1, *rest):
    if node.target.__name__.startswith("convolution"):
        # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        transposed = rest[0] if rest else False
        groups = rest[2] if len(rest) > 2 else 1
        if transposed:
            raise t.fail("transposed convolutions are not supported yet")
    x, w = t.lanes(x), t.lanes(w)
    if x.rank != 4:
        raise t.fail(f"only 2-D convolutions on NCHW inputs are supported (input rank {x.rank})")
    kh, kw = w.shape[2], w.shape[3]
    dil = _pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            pad = [0, 0]
        else:  # same, stride 1
            tot = [dil[0] * (kh - 1), dil[1] * (kw - 1)]
            if tot[0] % 2 or tot[1] % 2:
                raise t.fail("padding='same' with an even kernel needs asymmetric padding, not supported")
            pad = [tot[0] // 2, tot[1] // 2]
    else:
        pad = _pair(padding)
    ins = [x, w] + ([b] if b is not None else [])
    return t.emit("Conv2d", ins, stride=_pair(stride), padding=pad, dilation=dil, groups=int(groups))


@_rule("linear")
def _linear(t, node, x, w, b=None):
    y = t.emit("MatMul", [x, w], transpose_a=False, transpose_b=True)
    return t.emit("Add", [y, b]) if b is not None else y


@_rule("addmm")
def _addmm(t, node, bias, a, b, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise t.fail("addmm with beta or alpha other than 1 is not supported")
    y = t.emit("MatMul", [a, b], transpose_a=False, transpose_b=False)
    return t.emit("Add", [y, bias])


@_rule("matmul", "mm", "bmm")
def _matmul(t, node, a, b):
    a, b = t.lanes(a), t.lanes(b)
    if a.rank < 2 or b.rank < 2:
        raise t.fail("matmul of a vector is not supported (reshape it to a matrix)")
    return t.emit("MatMul", [a, b], transpose_a=False, transpose_b=False)


def _bn_affine(t, x, w, b):
    c = t.lanes(x).shape[1]
    w = w if w is not None else torch.ones(c)
    b = b if b is not None else torch.zeros(c)
    return w, b


@_rule("batch_norm")
def _batch_norm(t, node, x, w, b, rm, rv, training, momentum, eps, cudnn_enabled=True):
    w, b = _bn_affine(t, x, w, b)
    if training:
        if rm is None or rv is None:
            raise t.fail("BatchNorm without running statistics (track_running_stats=False) is not supported in training")
        if momentum is None:
            raise t.fail("BatchNorm with momentum=None (cumulative average) is not supported")
        if not isinstance(rm, _Buffer) or not isinstance(rv, _Buffer):
            raise t.fail("BatchNorm's running statistics must be module buffers")
        t.updates_buffers = True
        if t.bn_updates is not None:
            return t.batch_norm_accumulating(x, w, b, rm, rv, float(eps), float(momentum))
        return t.emit("BatchNormTrain", [x, w, b, rm, rv], n_out=1, eps=float(eps), momentum=float(momentum))
    return t.emit("BatchNorm", [x, w, b, rm, rv], eps=float(eps))


@_rule("_native_batch_norm_legit_no_training")
def _bn_no_training(t, node, x, w, b, rm, rv, momentum, eps):
    w, b = _bn_affine(t, x, w, b)
    y = t.emit("BatchNorm", [x, w, b, rm, rv], eps=float(eps))
    return (y, None, None)


@_rule("layer_norm")
def _layer_norm(t, node, x, shape, w=None, b=None, eps=1e-5, cudnn_enable=True):
    if len(shape) != 1:
        raise t.fail("LayerNorm over more than the last axis is not supported")
    d = int(shape[0])
    w = w if w is not None else torch.ones(d)
    b = b if b is not None else torch.zeros(d)
    return t.emit("LayerNorm", [x, w, b], eps=float(eps))


@_rule("index")
def _index(t, node, x, indices):
    """x[idx] with one integer index tensor on the first axis (a table
    lookup, e.g. a relative-position bias): an embedding."""
    x = t.lanes(x)
    if len(indices) != 1 or indices[0] is None:
        raise t.fail("only indexing the first axis with one integer tensor is supported")
    idx = indices[0]
    if isinstance(idx, torch.Tensor):
        if idx.dtype == torch.bool:
            raise t.fail("indexing with a boolean mask is not supported")
        idx = t.constant(idx.to(torch.int64))
    idx = t.lanes(idx)
    if idx.dtype != "int64":
        raise t.fail("the index must be an integer tensor")
    rest = math.prod(x.shape[1:])
    table = x if x.rank == 2 else t.emit("Reshape", [x], shape=[x.shape[0], rest])
    y = t.emit("Embedding", [table, idx])
    return _reshape_to(t, y, _val_shape(node))


@_rule("embedding")
def _embedding(t, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise t.fail("embedding with scale_grad_by_freq or sparse gradients is not supported")
    if isinstance(indices, torch.Tensor):
        indices = t.constant(indices.to(torch.int64))
    return t.emit("Embedding", [weight, indices])


# -- elementwise ---------------------------------------------------------------


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) or (isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() == 0)


def _sval(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


@_rule("add", "add_")
def _add(t, node, a, b, alpha=1):
    if alpha != 1:
        b = _mul(t, node, b, alpha)
    if _scalar(b) and _sval(b) == 0.0 and isinstance(a, _Out):
        return a
    return t.emit("Add", [a, b])


@_rule("sub", "sub_")
def _sub(t, node, a, b, alpha=1):
    if alpha != 1:
        b = _mul(t, node, b, alpha)
    return t.emit("Sub", [a, b])


@_rule("rsub")
def _rsub(t, node, a, b, alpha=1):
    return _sub(t, node, b, a if alpha == 1 else _mul(t, node, a, alpha))


@_rule("mul", "mul_")
def _mul(t, node, a, b):
    if _scalar(b) and isinstance(a, _Out):
        return t.emit_scale(a, _sval(b))
    if _scalar(a) and isinstance(b, _Out):
        return t.emit_scale(b, _sval(a))
    return t.emit("Mul", [a, b])


@_rule("div", "div_")
def _div(t, node, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise t.fail("division with a rounding mode is not supported")
    if _scalar(b) and isinstance(a, _Out):
        return t.emit_scale(a, 1.0 / _sval(b))
    return t.emit("Div", [a, b])


@_rule("neg")
def _neg(t, node, x):
    return t.emit_scale(x, -1.0)


def _unary(op: str) -> Callable[..., Any]:
    def f(t, node, x, *rest, **kw):
        return t.emit(op, [x])

    return f


for _n, _o in [
    ("relu", "Relu"),
    ("relu_", "Relu"),
    ("sigmoid", "Sigmoid"),
    ("sigmoid_", "Sigmoid"),
    ("tanh", "Tanh"),
    ("tanh_", "Tanh"),
    ("exp", "Exp"),
    ("log", "Log"),
    ("sqrt", "Sqrt"),
    ("erf", "Erf"),
]:
    _RULES[_n] = _unary(_o)


@_rule("rsqrt")
def _rsqrt(t, node, x):
    return t.emit("Div", [1.0, t.emit("Sqrt", [x])])


@_rule("gelu", "gelu_")
def _gelu(t, node, x, approximate="none"):
    if approximate == "none":
        return t.emit("Gelu", [x])
    # tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    x3 = t.emit("Mul", [t.emit("Mul", [x, x]), x])
    inner = t.emit("Add", [x, t.emit_scale(x3, 0.044715)])
    th = t.emit("Tanh", [t.emit_scale(inner, math.sqrt(2.0 / math.pi))])
    return t.emit("Mul", [t.emit_scale(x, 0.5), t.emit("Add", [th, 1.0])])


@_rule("silu", "silu_")
def _silu(t, node, x):
    return t.emit("Mul", [x, t.emit("Sigmoid", [x])])


def _clamp_out(t, x, lo, hi):
    """lo + relu(x − lo) − relu(x − hi): clamp built from ReLUs, which the
    service differentiates (gradient 1 inside, 0 outside)."""
    y = x
    if lo is not None:
        y = t.emit("Add", [t.emit("Relu", [t.emit("Add", [x, -float(lo)])]), float(lo)])
    if hi is not None:
        over = t.emit("Relu", [t.emit("Add", [x if lo is None else y, -float(hi)])])
        y = t.emit("Sub", [y, over])
    return y


@_rule("clamp", "clamp_", "clip", "hardtanh", "hardtanh_")
def _clamp(t, node, x, lo=None, hi=None):
    if node.target.__name__.startswith("hardtanh"):
        lo = -1.0 if lo is None else lo
        hi = 1.0 if hi is None else hi
    return _clamp_out(t, x, lo, hi)


@_rule("relu6", "relu6_")
def _relu6(t, node, x):
    return _clamp_out(t, x, 0.0, 6.0)


_RULES["hardsigmoid"] = _RULES["hardsigmoid_"] = _unary("HardSigmoid")
_RULES["hardswish"] = _RULES["hardswish_"] = _unary("HardSwish")


@_rule("pow")
def _pow(t, node, x, e):
    if not _scalar(e) or not isinstance(x, _Out):
        raise t.fail("only powers of a tensor by a constant are supported")
    e = _sval(e)
    if e == 1.0:
        return x
    if e == 2.0:
        return t.emit("Mul", [x, x])
    if e == 3.0:
        return t.emit("Mul", [t.emit("Mul", [x, x]), x])
    if e == 0.5:
        return t.emit("Sqrt", [x])
    if e == -0.5:
        return t.emit("Div", [1.0, t.emit("Sqrt", [x])])
    if e == -1.0:
        return t.emit("Div", [1.0, x])
    raise t.fail(f"x ** {e} is not supported (exponents 0.5, -0.5, -1, 1, 2, 3 are)")


@_rule("where")
def _where(t, node, cond, a, b):
    return t.emit("Where", [cond, a, b])


@_rule("masked_fill", "masked_fill_")
def _masked_fill(t, node, x, mask, value):
    return t.emit("Where", [mask, value, x])


# -- softmax, reductions ------------------------------------------------------


@_rule("softmax", "_softmax")
def _softmax(t, node, x, dim, *rest, **kw):
    x = t.lanes(x)
    return t.emit("Softmax", [x], axis=_norm_axis(int(dim), x.rank))


@_rule("log_softmax", "_log_softmax")
def _log_softmax(t, node, x, dim, *rest, **kw):
    x = t.lanes(x)
    return t.emit("LogSoftmax", [x], axis=_norm_axis(int(dim), x.rank))


def _reduce(op: str) -> Callable[..., Any]:
    def f(t, node, x, dims=None, keepdim=False, dtype=None):
        x = t.lanes(x)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            axes = list(range(x.rank))
        elif isinstance(dims, int):
            axes = [_norm_axis(dims, x.rank)]
        else:
            axes = sorted(_norm_axis(int(d), x.rank) for d in dims)
        return t.emit(op, [x], axes=axes, keep_dims=bool(keepdim))

    return f


_RULES["mean"] = _reduce("ReduceMean")
_RULES["sum"] = _reduce("ReduceSum")
_RULES["amax"] = _reduce("ReduceMax")


# -- shapes -----------------------------------------------------------------


def _reshape_to(t, x, shape):
    x = t.lanes(x)
    shape = [int(d) for d in shape]
    if tuple(shape) == x.shape:
        return x
    return t.emit("Reshape", [x], shape=shape)


@_rule(
    "view",
    "reshape",
    "_unsafe_view",
    "flatten",
    "unflatten",
    "squeeze",
    "squeeze_",
    "unsqueeze",
    "unsqueeze_",
    "view_as",
    "reshape_as",
)
def _reshape(t, node, x, *rest, **kw):
    return _reshape_to(t, x, _val_shape(node))


@_rule("permute")
def _permute(t, node, x, dims):
    x = t.lanes(x)
    perm = [_norm_axis(int(d), x.rank) for d in dims]
    if perm == list(range(x.rank)):
        return x
    return t.emit("Transpose", [x], perm=perm)


@_rule("transpose", "swapaxes")
def _transpose(t, node, x, a, b):
    x = t.lanes(x)
    a, b = _norm_axis(int(a), x.rank), _norm_axis(int(b), x.rank)
    perm = list(range(x.rank))
    perm[a], perm[b] = perm[b], perm[a]
    if a == b:
        return x
    return t.emit("Transpose", [x], perm=perm)


@_rule("t")
def _t(t, node, x):
    x = t.lanes(x)
    if x.rank < 2:
        return x
    return t.emit("Transpose", [x], perm=[1, 0])


@_rule("contiguous", "clone", "alias", "detach", "detach_", "lift_fresh_copy", "lift_fresh", "identity")
def _identity(t, node, x, *rest, **kw):
    return x


@_rule("to", "_to_copy", "type_as")
def _to(t, node, x, *rest, **kw):
    """A dtype conversion: a Lanes `Cast` (between float32, float16 and
    bfloat16, or to and from int64; booleans are float32 0/1)."""
    val = node.meta.get("val")
    x = t.lanes(x)
    want = x.dtype
    if isinstance(val, torch.Tensor):
        want = _float_name(val.dtype) or _feed_dtype(val.dtype)
    if want is None:
        raise t.fail(f"conversion to {val.dtype} is not supported (float32, float16, bfloat16 and integers are)")
    return t.cast(x, want)


@_rule("expand", "expand_as", "broadcast_to")
def _expand(t, node, x, *rest, **kw):
    x = t.lanes(x)
    shape = _val_shape(node)
    if tuple(shape) == x.shape:
        return x
    return t.emit("BroadcastTo", [x], shape=shape)


@_rule("select")
def _select(t, node, x, dim, index):
    x = t.lanes(x)
    d = _norm_axis(int(dim), x.rank)
    i = int(index)
    i = i + x.shape[d] if i < 0 else i
    y = t.emit("Slice", [x], axis=d, start=i, end=i + 1)
    return _reshape_to(t, y, _val_shape(node))


@_rule("slice")
def _slice(t, node, x, dim=0, start=None, end=None, step=1):
    x = t.lanes(x)
    d = _norm_axis(int(dim), x.rank)
    n = x.shape[d]
    s = 0 if start is None else int(start)
    e = n if end is None else int(end)
    s = max(0, s + n if s < 0 else s)
    e = min(n, e + n if e < 0 else e)
    step = int(step)
    if step < 1:
        raise t.fail("slices with a step below 1 are not supported")
    if step == 1:
        if s == 0 and e == n:
            return x
        return t.emit("Slice", [x], axis=d, start=s, end=max(e, s))
    # Every step-th element: the range as [count, step] (zero-padded to a
    # whole number of steps), then the first of each step.
    count = max(0, -(-(e - s) // step))
    y = t.emit("Slice", [x], axis=d, start=s, end=min(n, s + count * step))
    short = count * step - y.shape[d]
    if short > 0:
        shape = list(y.shape)
        shape[d] = short
        y = t.emit("Concat", [y, torch.zeros(shape)], axis=d)
    split = list(y.shape[:d]) + [count, step] + list(y.shape[d + 1 :])
    y = t.emit("Reshape", [y], shape=split)
    y = t.emit("Slice", [y], axis=d + 1, start=0, end=1)
    return _reshape_to(t, y, _val_shape(node))


@_rule("split", "split_with_sizes")
def _split(t, node, x, sizes, dim=0):
    x = t.lanes(x)
    d = _norm_axis(int(dim), x.rank)
    n = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    outs, s = [], 0
    for k in sizes:
        outs.append(x if k == n else t.emit("Slice", [x], axis=d, start=s, end=s + int(k)))
        s += int(k)
    return tuple(outs)


@_rule("chunk")
def _chunk(t, node, x, chunks, dim=0):
    x = t.lanes(x)
    n = x.shape[_norm_axis(int(dim), x.rank)]
    size = -(-n // int(chunks))
    return _split(t, node, x, size, dim)


@_rule("pad", "constant_pad_nd")
def _pad(t, node, x, pad, mode="constant", value=None):
    """Constant padding (F.pad's default mode): blocks of the value joined on
    along each padded axis, last axis first; negative amounts crop."""
    if mode != "constant":
        raise t.fail(f"padding mode {mode!r} is not supported (constant is)")
    x = t.lanes(x)
    fill = 0.0 if value is None else float(value)
    for i in range(0, len(pad), 2):
        axis = x.rank - 1 - i // 2
        before, after = int(pad[i]), int(pad[i + 1])
        if before < 0 or after < 0:
            n = x.shape[axis]
            x = t.emit("Slice", [x], axis=axis, start=max(0, -before), end=n - max(0, -after))
            before, after = max(0, before), max(0, after)
        parts = []
        for amount in (before, None, after):
            if amount is None:
                parts.append(x)
            elif amount > 0:
                shape = list(x.shape)
                shape[axis] = amount
                parts.append(torch.full(shape, fill))
        if len(parts) > 1:
            x = t.emit("Concat", parts, axis=axis)
    return x


@_rule("new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like",
       "empty_like")
def _like(t, node, x, *args, **kwargs):
    """A tensor that depends only on another's shape: known at capture
    (computed by torch from the shape torch.export recorded)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise t.fail("no recorded shape for this tensor")
    name = node.target.__name__.split(".")[0]
    if name in ("new_full", "full_like"):
        fill = args[1] if name == "new_full" else args[0]
    elif name in ("new_ones", "ones_like"):
        fill = 1
    else:
        fill = 0
    return torch.full(tuple(int(d) for d in val.shape), fill, dtype=val.dtype)


@_rule("roll")
def _roll(t, node, x, shifts, dims=()):
    """torch.roll: per axis, the last `shift` elements moved to the front
    (two slices joined)."""
    x = t.lanes(x)
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        raise t.fail("roll of the flattened tensor (no dims) is not supported")
    for shift, d in zip(shifts, dims):
        axis = _norm_axis(int(d), x.rank)
        n = x.shape[axis]
        s = int(shift) % n if n else 0
        if s:
            tail = t.emit("Slice", [x], axis=axis, start=n - s, end=n)
            head = t.emit("Slice", [x], axis=axis, start=0, end=n - s)
            x = t.emit("Concat", [tail, head], axis=axis)
    return x


@_rule("cat", "concat")
def _cat(t, node, xs, dim=0):
    xs = [t.lanes(x) for x in xs]
    xs = [x for x in xs if not (x.rank == 1 and x.shape[0] == 0)]
    if len(xs) == 1:
        return xs[0]
    return t.emit("Concat", xs, axis=_norm_axis(int(dim), xs[0].rank))


# -- pooling ------------------------------------------------------------------


@_rule("max_pool2d")
def _max_pool2d(t, node, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    if _pair(dilation) != [1, 1]:
        raise t.fail("max pooling with dilation is not supported")
    k = _pair(kernel)
    s = _pair(stride) if stride else k
    p = _pair(padding)
    if ceil_mode:
        # The windows that ceil_mode adds overhang the bottom and right
        # edges: extend those edges with the lowest float (max pooling never
        # picks it, its gradient is sliced away) so that floor mode counts them.
        x = t.lanes(x)
        want = _val_shape(node)[2:]
        for axis in (2, 3):
            a = axis - 2
            size = x.shape[axis]
            extra = (want[a] - 1) * s[a] + k[a] - 2 * p[a] - size
            if extra > 0:
                shape = list(x.shape)
                shape[axis] = extra
                fill = torch.full(shape, _MASKED)
                x = t.emit("Concat", [x, fill], axis=axis)
    return t.emit("MaxPool2d", [x], kernel=k, stride=s, padding=p)


@_rule("avg_pool2d")
def _avg_pool2d(t, node, x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    if ceil_mode or divisor_override is not None:
        raise t.fail("average pooling with ceil_mode or divisor_override is not supported")
    k = _pair(kernel)
    s = _pair(stride) if stride else k
    pool = {"kernel": k, "stride": s, "padding": _pair(padding)}
    return t.emit("AvgPool2d", [x], pool=pool, count_include_pad=bool(count_include_pad))


@_rule("adaptive_avg_pool2d", "_adaptive_avg_pool2d")
def _adaptive_avg_pool2d(t, node, x, size):
    x = t.lanes(x)
    oh, ow = _pair(size)
    n, c, h, w = x.shape
    if (oh, ow) == (h, w):
        return x
    if (oh, ow) == (1, 1):
        y = t.emit("GlobalAvgPool", [x])
        return _reshape_to(t, y, [n, c, 1, 1])
    if h % oh or w % ow:
        raise t.fail(f"adaptive pooling of {h}x{w} to {oh}x{ow} (not a divisor) is not supported")
    k = [h // oh, w // ow]
    pool = {"kernel": k, "stride": k, "padding": [0, 0]}
    return t.emit("AvgPool2d", [x], pool=pool, count_include_pad=True)


# -- attention, dropout, losses -------------------------------------------------


@_rule("scaled_dot_product_attention")
def _sdpa(t, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    q, k, v = t.lanes(q), t.lanes(k), t.lanes(v)
    if enable_gqa:
        raise t.fail("grouped-query attention is not supported yet")
    e = q.shape[-1]
    # (c·q)·kᵀ = c·(q·kᵀ): scaling q costs lk/e times less than scaling
    # the scores (a [b, h, 512, 512] pass for GPT-2, forward and backward).
    q = t.emit_scale(q, float(scale) if scale is not None else 1.0 / math.sqrt(e))
    s = t.emit("MatMul", [q, k], transpose_a=False, transpose_b=True)
    lq, lk = q.shape[-2], k.shape[-2]
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool).tril()
        s = t.emit("Where", [mask, s, _MASKED])
    if attn_mask is not None:
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
            s = t.emit("Where", [attn_mask, s, _MASKED])
        else:
            s = t.emit("Add", [s, attn_mask])
    p = t.emit("Softmax", [s], axis=s.rank - 1)
    if dropout_p and float(dropout_p) > 0.0:
        p = t.emit("Mul", [p, t.dropout_mask(p.shape, float(dropout_p))])
    return t.emit("MatMul", [p, v], transpose_a=False, transpose_b=False)


@_rule("dropout", "dropout_", "native_dropout")
def _dropout(t, node, x, p=0.5, train=None, *rest):
    active = bool(train) if train is not None else t.training
    y = x
    if active and float(p) > 0.0:
        x = t.lanes(x)
        if float(p) >= 1.0:
            y = t.emit_scale(x, 0.0)
        else:
            y = t.emit("Mul", [x, t.dropout_mask(x.shape, float(p))])
    if node.target.__name__.startswith("native_dropout"):
        return (y, None)
    return y


@_rule("feature_dropout", "alpha_dropout", "feature_alpha_dropout")
def _other_dropout(t, node, x, p=0.5, train=None, *rest):
    if (bool(train) if train is not None else t.training) and float(p) > 0.0:
        raise t.fail("only elementwise dropout (nn.Dropout) is supported in training")
    return x


@_rule("cross_entropy_loss")
def _cross_entropy(t, node, x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    x = t.lanes(x)
    if weight is not None or label_smoothing:
        raise t.fail("cross entropy with class weights or label smoothing is not supported")
    if reduction != 1:
        raise t.fail("only reduction='mean' cross entropy is supported")
    if x.rank != 2:
        raise t.fail(f"cross entropy takes logits [N, C] (got rank {x.rank}): flatten them first")
    if isinstance(target, torch.Tensor):
        target = t.constant(target.to(torch.int64))
    return t.emit("CrossEntropy", [x, target])


@_rule("mse_loss")
def _mse_loss(t, node, a, b, reduction=1):
    if reduction != 1:
        raise t.fail("only reduction='mean' MSE is supported")
    return t.emit("MseLoss", [a, b])

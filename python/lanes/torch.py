"""PyTorch models on Lanes: training and inference jobs captured with torch.export.

    import torch, lanes, lanes.torch
    with lanes.Client("tcp://127.0.0.1:5555") as client:
        job = lanes.torch.training_job(client, model, example=(x, y),
                                       loss=torch.nn.CrossEntropyLoss(),
                                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in loader:
            loss = job.step(x, y)          # one Run: forward, loss, backward, update
        model.load_state_dict(job.state_dict())

The model (with its loss, for training) is captured with ``torch.export.export``
at the example's shapes; this module translates the captured ATen graph into
Lanes' graph IR, op by op (the only place that knows torch's op set), and the
service differentiates it and runs the optimizer next to the weights. What is
supported, and what not yet: docs/torch.md in the repository.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import _lanes
from ._lanes import ModelError

__all__ = [
    "TorchImportError",
    "TrainingJob",
    "InferenceJob",
    "training_job",
    "inference_job",
    "translate",
    "MIN_TORCH",
]

#: Oldest torch release this module is tested with (its training IR).
MIN_TORCH = (2, 9)


class TorchImportError(ModelError):
    """A captured model could not be translated: an ATen op Lanes lacks, or a
    use of one it does not handle. ``op`` is the ATen op, ``module`` the
    module path (``layer1.0.conv1``) and ``source`` the user's source line
    that made it, when torch.export kept them."""

    def __init__(self, message: str, op: str = "", module: str = "", source: str = ""):
        super().__init__(message)
        self.op = op
        self.module = module
        self.source = source
        self.code = None
        self.code_name = None


def _torch_version() -> Tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# ---------------------------------------------------------------------------
# values


@dataclass
class _Out:
    """A tensor computed in the Lanes graph."""

    outlet: Tuple[int, int]
    shape: Tuple[int, ...]
    dtype: str  # "float32" | "int64"

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass
class _Buffer:
    """A module buffer: folded where only known values use it, a variable
    where the graph reads it at run time (BatchNorm's running statistics)."""

    name: str
    tensor: torch.Tensor


def _op(name: str, **attrs: Any) -> str:
    if not attrs:
        return json.dumps(name)
    return json.dumps({name: attrs})


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _pair(v: Any) -> List[int]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            return [int(v[0]), int(v[0])]
        return [int(v[0]), int(v[1])]
    return [int(v), int(v)]


def _has_out(v: Any) -> bool:
    if isinstance(v, _Out):
        return True
    if isinstance(v, (list, tuple)):
        return any(_has_out(x) for x in v)
    if isinstance(v, dict):
        return any(_has_out(x) for x in v.values())
    return False


def _unwrap_known(v: Any) -> Any:
    if isinstance(v, _Buffer):
        return v.tensor
    if isinstance(v, list):
        return [_unwrap_known(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_unwrap_known(x) for x in v)
    if isinstance(v, dict):
        return {k: _unwrap_known(x) for k, x in v.items()}
    return v


def _where_from(node: torch.fx.Node) -> Tuple[str, str]:
    """(module path, the user's source line) of a node, when known."""
    module = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        module = path.split(".", 1)[1] if path.startswith("model.") else path
        module = "" if path == "model" else module
    source = ""
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
        # The innermost frame outside torch, and its code line.
        frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        for i in reversed(frames):
            if "/torch/" not in lines[i]:
                code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
                source = lines[i] + (": " + code if code else "")
                break
    return module, source


# ---------------------------------------------------------------------------
# the translator


class _Translator:
    def __init__(self, ep: "torch.export.ExportedProgram", *, training: bool, prefix: str):
        self.ep = ep
        self.training = training
        self.prefix = prefix
        self.b = _lanes.GraphBuilder()
        self.env: Dict[torch.fx.Node, Any] = {}
        #: Lanes variable name → the torch tensor it started from.
        self.variables: Dict[str, torch.Tensor] = {}
        self._var_of_tensor: Dict[int, _Out] = {}
        self._buffer_vars: Dict[str, _Out] = {}
        #: Integer buffers counted on the client (num_batches_tracked): name → increment per step.
        self.counters: Dict[str, int] = {}
        self.inputs: List[Tuple[str, Tuple[int, ...], str]] = []
        self.outputs: List[_Out] = []
        self.node: Optional[torch.fx.Node] = None
        self._constants: Dict[int, Tuple[torch.Tensor, _Out]] = {}
        self._n_big = 0

    # -- errors --------------------------------------------------------------

    def fail(self, message: str, node: Optional[torch.fx.Node] = None) -> TorchImportError:
        node = node or self.node
        op = str(node.target) if node is not None else ""
        module, source = _where_from(node) if node is not None else ("", "")
        where = []
        if module:
            where.append(f"in module `{module}`")
        if source:
            where.append(f"at {source}")
        text = f"{op}: {message}" if op else message
        if where:
            text += " (" + ", ".join(where) + ")"
        return TorchImportError(text, op=op, module=module, source=source)

    # -- emitting ------------------------------------------------------------

    def emit(self, op: str, inputs: Sequence[Any], n_out: int = 1, **attrs: Any) -> Any:
        ins = [self.lanes(x) for x in inputs]
        try:
            outs = self.b.op(_op(op, **attrs), [i.outlet for i in ins])
        except ModelError as e:
            raise self.fail(f"Lanes refused the translated op {op}: {e}") from None
        res = []
        for o in outs[: max(n_out, 1)]:
            shape, dtype = self.b.type_of(o)
            res.append(_Out(o, tuple(shape), dtype))
        return res[0] if n_out == 1 else tuple(res)

    def emit_scale(self, x: Any, factor: float) -> _Out:
        """x · factor (one `Scale` op; nothing for 1)."""
        if factor == 1.0:
            return self.lanes(x)
        x = self.lanes(x)
        try:
            outs = self.b.op(json.dumps({"Scale": float(factor)}), [x.outlet])
        except ModelError as e:
            raise self.fail(f"Lanes refused the translated op Scale: {e}") from None
        shape, dtype = self.b.type_of(outs[0])
        return _Out(outs[0], tuple(shape), dtype)

    def constant(self, value: Any, like_dtype: str = "float32") -> _Out:
        """A known value as a tensor of the graph. A tensor broadcast along
        some axes (an expanded mask) is sent once, at its compact size, and
        broadcast in the graph; one above `_BIG_CONSTANT` bytes travels as a
        variable (a tensor frame of its own, not inside the graph message)."""
        if not isinstance(value, torch.Tensor):
            arr = np.asarray(value, dtype=np.float32 if like_dtype == "float32" else np.int64)
            o = self.b.constant(np.ascontiguousarray(arr))
            shape, dtype = self.b.type_of(o)
            return _Out(o, tuple(shape), dtype)
        t = value.detach()
        full = tuple(int(d) for d in t.shape)
        if t.dtype == torch.bool or t.is_floating_point():
            # Axes along which every element is the same (stride 0): keep
            # one (BroadcastTo takes float32 tensors).
            for d in range(t.dim()):
                if t.stride(d) == 0 and t.shape[d] > 1:
                    t = t.narrow(d, 0, 1)
            t = t.to(torch.float32)
        else:
            t = t.to(torch.int64)
        arr = np.ascontiguousarray(t.contiguous().numpy())
        if arr.nbytes > _BIG_CONSTANT:
            self._n_big += 1
            o = self.b.variable(f"const/{self._n_big}", arr)
        else:
            o = self.b.constant(arr)
        shape, dtype = self.b.type_of(o)
        out = _Out(o, tuple(shape), dtype)
        if out.shape != full:
            out = self.emit("BroadcastTo", [out], shape=list(full))
        return out

    def variable(self, name: str, tensor: torch.Tensor) -> _Out:
        key = id(tensor)
        if key in self._var_of_tensor:
            return self._var_of_tensor[key]
        t = tensor.detach()
        if t.is_floating_point():
            if t.dtype != torch.float32:
                raise self.fail(
                    f"`{name}` is {t.dtype}: Lanes computes in float32 for now (call model.float())"
                )
            arr = t.contiguous().numpy()
        elif t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            arr = t.to(torch.int64).contiguous().numpy()
        elif t.dtype == torch.bool:
            arr = t.to(torch.float32).contiguous().numpy()
        else:
            raise self.fail(f"`{name}` has dtype {t.dtype}, which Lanes does not hold")
        o = self.b.variable(name, np.ascontiguousarray(arr))
        shape, dtype = self.b.type_of(o)
        out = _Out(o, tuple(shape), dtype)
        self._var_of_tensor[key] = out
        self.variables[name] = tensor
        return out

    def lanes(self, v: Any) -> _Out:
        """`v` as a tensor of the Lanes graph."""
        if isinstance(v, _Out):
            return v
        if isinstance(v, _Buffer):
            if v.name not in self._buffer_vars:
                self._buffer_vars[v.name] = self.variable(v.name, v.tensor)
            return self._buffer_vars[v.name]
        if isinstance(v, (bool, int, float)):
            return self.constant(float(v))
        if isinstance(v, torch.Tensor):
            # One node per known tensor, however many ops read it (the
            # tensor is kept so that its id stays its own).
            hit = self._constants.get(id(v))
            if hit is None:
                hit = (v, self.constant(v))
                self._constants[id(v)] = hit
            return hit[1]
        raise self.fail(f"cannot use {type(v).__name__} as a tensor")

    # -- the walk ------------------------------------------------------------

    def run(self) -> None:
        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        state = self.ep.state_dict
        consts = getattr(self.ep, "constants", {}) or {}
        n_user = 0
        for node in self.ep.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                spec = specs.get(node.name)
                kind = spec.kind.name if spec is not None else "USER_INPUT"
                if kind == "PARAMETER":
                    self.env[node] = _Param(self._name(spec.target), state[spec.target])
                elif kind == "BUFFER":
                    t = state[spec.target] if spec.target in state else consts[spec.target]
                    self.env[node] = _Buffer(self._name(spec.target), t)
                elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
                    self.env[node] = consts[spec.target]
                elif kind == "USER_INPUT":
                    val = node.meta.get("val")
                    if not isinstance(val, torch.Tensor):
                        raise self.fail("only tensor inputs are supported", node)
                    dtype = _feed_dtype(val.dtype)
                    if dtype is None:
                        raise self.fail(f"input of dtype {val.dtype}: Lanes takes float32 and integer inputs", node)
                    name = f"input_{n_user}"
                    n_user += 1
                    shape = tuple(int(d) for d in val.shape)
                    o = self.b.placeholder(name, list(shape), dtype)
                    self.inputs.append((name, shape, dtype))
                    self.env[node] = _Out(o, shape, dtype)
                else:
                    raise self.fail(f"graph input of kind {kind} is not supported", node)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                outs = node.args[0]
                user = [o for o, s in zip(outs, sig.output_specs) if s.kind.name == "USER_OUTPUT"]
                for s in sig.output_specs:
                    if s.kind.name not in ("USER_OUTPUT",):
                        raise self.fail(f"output of kind {s.kind.name} is not supported", node)
                for o in user:
                    v = self.env[o] if isinstance(o, torch.fx.Node) else o
                    if isinstance(v, _Param):
                        v = self.param(v)
                    self.outputs.append(self.lanes(v))
            else:
                raise self.fail(f"graph node kind {node.op} is not supported", node)

    def _name(self, target: str) -> str:
        return target[len(self.prefix):] if target.startswith(self.prefix) else target

    def param(self, p: "_Param") -> _Out:
        return self.variable(p.name, p.tensor)

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            return self.param(v) if isinstance(v, _Param) else v
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self.arg(x) for k, x in a.items()}
        return a

    def call(self, node: torch.fx.Node) -> Any:
        target = node.target
        if target is operator.getitem:
            seq, i = self.arg(node.args[0]), node.args[1]
            return seq[i]
        name = getattr(getattr(target, "_overloadpacket", None), "__name__", None) or getattr(target, "__name__", str(target))
        if name in _IGNORED:
            return None
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        # Counted on the client: BatchNorm's num_batches_tracked += 1.
        if name == "add_" and isinstance(args[0], _Buffer) and not _has_out(args[1:]):
            t = args[0].tensor
            if not t.is_floating_point():
                self.counters[args[0].name] = self.counters.get(args[0].name, 0) + int(args[1])
                return args[0]
        if not _has_out(args) and not _has_out(kwargs):
            # Known at import: shapes, masks, positions. torch computes it.
            return self.fold(node, name, args, kwargs)
        rule = _RULES.get(name)
        if rule is None:
            raise self.fail(
                "Lanes has no translation for this op yet (docs/torch.md lists the supported ones)"
            )
        out = rule(self, node, *args, **kwargs)
        self.check_shape(node, out)
        return out

    def fold(self, node: torch.fx.Node, name: str, args: List[Any], kwargs: Dict[str, Any]) -> Any:
        a = _unwrap_known(args)
        k = _unwrap_known(kwargs)
        if name.endswith("_") and a and isinstance(a[0], torch.Tensor):
            a = [a[0].clone()] + list(a[1:])  # never mutate the user's tensors
        if name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout"):
            return a[0]
        try:
            with torch.no_grad():
                return node.target(*a, **k)
        except Exception as e:  # torch's own error, kept
            raise self.fail(f"evaluating this constant at import failed: {e}") from None

    def check_shape(self, node: torch.fx.Node, out: Any) -> None:
        val = node.meta.get("val")
        if isinstance(out, _Out) and isinstance(val, torch.Tensor):
            want = tuple(int(d) for d in val.shape)
            if out.shape != want:
                raise self.fail(f"translated to shape {list(out.shape)}, torch says {list(want)}")


@dataclass
class _Param:
    name: str
    tensor: torch.Tensor


def _feed_dtype(dt: torch.dtype) -> Optional[str]:
    if dt == torch.float32:
        return "float32"
    if dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return "int64"
    if dt == torch.bool:
        return "float32"
    return None


#: Known tensors larger than this travel as variables, not inside the graph.
_BIG_CONSTANT = 1 << 20

_IGNORED = {
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "_set_grad_enabled",
}

# ---------------------------------------------------------------------------
# rules: one function per ATen op (overload packet), args as torch passes them

_RULES: Dict[str, Callable[..., Any]] = {}


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


@_rule("hardsigmoid", "hardsigmoid_")
def _hardsigmoid(t, node, x):
    return t.emit_scale(_clamp_out(t, t.emit("Add", [x, 3.0]), 0.0, 6.0), 1.0 / 6.0)


@_rule("hardswish", "hardswish_")
def _hardswish(t, node, x):
    return t.emit("Mul", [x, _hardsigmoid(t, node, x)])


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
    val = node.meta.get("val")
    x = t.lanes(x)
    want = _feed_dtype(val.dtype) if isinstance(val, torch.Tensor) else x.dtype
    if want is None:
        raise t.fail(f"conversion to {val.dtype} is not supported: Lanes computes in float32 for now")
    if want == x.dtype:
        return x
    return t.emit("Cast", [x], to="F32" if want == "float32" else "I64")


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
    if step != 1:
        raise t.fail("slices with a step other than 1 are not supported")
    if s == 0 and e == n:
        return x
    return t.emit("Slice", [x], axis=d, start=s, end=max(e, s))


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
    if _pair(dilation) != [1, 1] or ceil_mode:
        raise t.fail("max pooling with dilation or ceil_mode is not supported")
    k = _pair(kernel)
    s = _pair(stride) if stride else k
    return t.emit("MaxPool2d", [x], kernel=k, stride=s, padding=_pair(padding))


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
    if dropout_p and t.training:
        raise t.fail("attention dropout is not supported yet (set dropout to 0)")
    if enable_gqa:
        raise t.fail("grouped-query attention is not supported yet")
    e = q.shape[-1]
    s = t.emit("MatMul", [q, k], transpose_a=False, transpose_b=True)
    s = t.emit_scale(s, float(scale) if scale is not None else 1.0 / math.sqrt(e))
    lq, lk = q.shape[-2], k.shape[-2]
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool).tril()
        s = t.emit("Where", [mask, s, float("-inf")])
    if attn_mask is not None:
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
            s = t.emit("Where", [attn_mask, s, float("-inf")])
        else:
            s = t.emit("Add", [s, attn_mask])
    p = t.emit("Softmax", [s], axis=s.rank - 1)
    return t.emit("MatMul", [p, v], transpose_a=False, transpose_b=False)


@_rule("dropout", "dropout_", "native_dropout", "feature_dropout", "alpha_dropout")
def _dropout(t, node, x, p=0.5, train=None, *rest):
    active = bool(train) if train is not None else t.training
    if active and float(p) > 0.0:
        raise t.fail(
            f"dropout (p={p}) in training is not supported by the service yet: "
            "set the model's dropout probabilities to 0 (for Hugging Face models, "
            "the config's *_dropout / *_pdrop fields) or pass dropout='ignore'",
        )
    if node.target.__name__.startswith("native_dropout"):
        return (x, None)
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


# ---------------------------------------------------------------------------
# capture


def _check_torch() -> None:
    if _torch_version() < MIN_TORCH:
        raise ModelError(
            f"lanes.torch needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later (torch.export's training IR); "
            f"this is torch {torch.__version__}"
        )


def _export(module: torch.nn.Module, args: Sequence[Any], what: str) -> "torch.export.ExportedProgram":
    _check_torch()
    try:
        return torch.export.export(module, tuple(args))
    except Exception as e:  # torch.export's own message, with what to do about it
        hint = (
            "hint: torch.export captures one graph per shape; control flow that depends on a "
            "tensor's values cannot be captured (rewrite it with torch.where or torch.cond), "
            "and Hugging Face models need use_cache=False"
        )
        raise TorchImportError(f"torch.export could not capture the {what}: {e}\n{hint}", op="torch.export") from e


class _WithLoss(torch.nn.Module):
    """The user's model followed by its loss: one graph whose output is the loss."""

    def __init__(self, model: torch.nn.Module, loss: Callable[..., Any], n_inputs: int):
        super().__init__()
        self.model = model
        self.loss = loss
        self.n_inputs = n_inputs

    def forward(self, *args: Any) -> Any:
        out = self.model(*args[: self.n_inputs])
        if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
            out = out.logits
        return self.loss(out, *args[self.n_inputs :])


def translate(ep: "torch.export.ExportedProgram", *, training: bool = False, prefix: str = "") -> _Translator:
    """Translates a captured program into a `lanes.GraphBuilder` (the
    translator's `b`), its feeds (`inputs`) and outputs (`outputs`).
    Variables are named by their state_dict key less `prefix`."""
    t = _Translator(ep, training=training, prefix=prefix)
    t.run()
    return t


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bool:
            x = x.to(torch.float32)
        elif x.is_floating_point():
            x = x.to(torch.float32)
        else:
            x = x.to(torch.int64)
        return np.ascontiguousarray(x.cpu().numpy())
    a = np.asarray(x)
    if a.dtype.kind == "f" or a.dtype == np.bool_:
        return np.ascontiguousarray(a, dtype=np.float32)
    if a.dtype.kind in "iu":
        return np.ascontiguousarray(a, dtype=np.int64)
    raise TypeError(f"input {name}: expected a tensor or array, got {type(x).__name__}")


def _feeds(inputs: Sequence[Tuple[str, Tuple[int, ...], str]], args: Sequence[Any], what: str) -> Dict[str, np.ndarray]:
    if len(args) != len(inputs):
        raise TypeError(f"{what} takes {len(inputs)} tensors (as in the example), got {len(args)}")
    feeds = {}
    for (name, shape, _), a in zip(inputs, args):
        arr = _to_numpy(a, name)
        if tuple(arr.shape) != tuple(shape):
            raise _lanes.FeedError(
                f"{what}: input {name[len('input_'):]} has shape {list(arr.shape)}; the job was captured at "
                f"{list(shape)} (capture another job for another batch size)"
            )
        feeds[name] = arr
    return feeds


# ---------------------------------------------------------------------------
# optimizers


def _lanes_optimizer(opt: "torch.optim.Optimizer", group: Dict[str, Any]) -> Any:
    kind = type(opt).__name__
    if group.get("maximize"):
        raise ModelError(f"{kind}(maximize=True) is not supported")
    if kind == "SGD":
        if group.get("dampening", 0):
            raise ModelError("SGD with dampening is not supported")
        return _lanes.SGD(
            lr=float(group["lr"]),
            momentum=float(group.get("momentum", 0.0)),
            weight_decay=float(group.get("weight_decay", 0.0)),
            nesterov=bool(group.get("nesterov", False)),
        )
    if kind in ("Adam", "AdamW"):
        if group.get("amsgrad"):
            raise ModelError(f"{kind}(amsgrad=True) is not supported")
        if kind == "Adam" and group.get("decoupled_weight_decay"):
            kind = "AdamW"
        cls = _lanes.Adam if kind == "Adam" else _lanes.AdamW
        b1, b2 = group.get("betas", (0.9, 0.999))
        return cls(
            lr=float(group["lr"]),
            betas=(float(b1), float(b2)),
            eps=float(group.get("eps", 1e-8)),
            weight_decay=float(group.get("weight_decay", 0.0)),
        )
    raise ModelError(f"optimizer {kind} is not supported (SGD, Adam and AdamW are)")


# ---------------------------------------------------------------------------
# jobs


class TrainingJob:
    """A PyTorch model training in the service: weights, optimizer state and
    BatchNorm statistics live there; `step` is one Run."""

    def __init__(self, session: Any, t: _Translator, model: torch.nn.Module,
                 optimizer: "torch.optim.Optimizer", groups: List[List[str]]):
        self.session = session
        self.inputs = t.inputs
        self._model = model
        self._optimizer = optimizer
        self._counters = dict(t.counters)
        self._steps = 0
        self._lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._group_names = groups
        # state_dict key → Lanes variable (tied weights share one).
        var_of_id = {id(tensor): name for name, tensor in t.variables.items()}
        self._key_var: Dict[str, str] = {}
        self._counter_start: Dict[str, torch.Tensor] = {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in var_of_id:
                self._key_var[key] = var_of_id[id(tensor)]
            elif key in self._counters:
                self._counter_start[key] = tensor.detach().clone()

    @property
    def steps(self) -> int:
        """Steps taken through this job."""
        return self._steps

    def _sync_lr(self) -> None:
        # A scheduler changes optimizer.param_groups[k]["lr"]: the service's
        # group rate follows before the next step.
        changed = {}
        for k, g in enumerate(self._optimizer.param_groups[: len(self._lrs)]):
            lr = float(g["lr"])
            if lr != self._lrs[k]:
                changed[f"opt/group{k}/lr"] = np.array([lr], dtype=np.float32)
                self._lrs[k] = lr
        if changed:
            self.session.write_variables(changed)

    def step(self, *args: Any) -> float:
        """One training iteration on a batch (the model's inputs, then the
        loss's targets, as in `example`); returns the loss."""
        self._sync_lr()
        feeds = _feeds(self.inputs, args, "step")
        loss = self.session.run(feeds, fetch="loss")
        self._steps += 1
        # The optimizer's step ran in the service: tell torch's learning-rate
        # schedulers so (they warn of a scheduler step before any optimizer
        # step otherwise).
        self._optimizer._opt_called = True  # type: ignore[attr-defined]
        return float(np.asarray(loss).reshape(-1)[0])

    def set_lr(self, lr: float, group: Optional[int] = None) -> None:
        """Sets the learning rate of one parameter group (all when None), in
        the service and in the torch optimizer."""
        ks = range(len(self._lrs)) if group is None else [group]
        for k in ks:
            self._optimizer.param_groups[k]["lr"] = float(lr)
        self._sync_lr()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The model's state_dict with the service's current values."""
        values = self.session.read_variables(sorted(set(self._key_var.values())))
        out: Dict[str, torch.Tensor] = {}
        for key, tensor in self._model.state_dict().items():
            if key in self._key_var:
                v = torch.from_numpy(np.array(values[self._key_var[key]]))
                out[key] = v.to(tensor.dtype).reshape(tensor.shape)
            elif key in self._counter_start:
                out[key] = self._counter_start[key] + self._counters[key] * self._steps
            else:
                out[key] = tensor.detach().clone()
        return out

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Overwrites the service's weights and buffers from a state_dict
        (a checkpoint); optimizer state is kept."""
        values = {}
        for key, var in self._key_var.items():
            if key in state:
                values[var] = _to_numpy(state[key], key)
        missing = [k for k in self._key_var if k not in state]
        if missing:
            raise KeyError(f"state_dict lacks {missing[:5]}")
        self.session.write_variables(values)
        for key in self._counter_start:
            if key in state:
                self._counter_start[key] = state[key].detach().clone() - self._counters[key] * self._steps

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "TrainingJob":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False


class InferenceJob:
    """A PyTorch model served by the service; calling it is one Run."""

    def __init__(self, session: Any, t: _Translator, names: List[str]):
        self.session = session
        self.inputs = t.inputs
        self.outputs = names

    def __call__(self, *args: Any) -> Any:
        feeds = _feeds(self.inputs, args, "the model")
        outs = self.session.run(feeds, fetch=self.outputs)
        ts = [torch.from_numpy(np.asarray(o)) for o in outs]
        return ts[0] if len(ts) == 1 else tuple(ts)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "InferenceJob":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False


def training_job(
    client: Any,
    model: torch.nn.Module,
    example: Sequence[Any],
    loss: Callable[..., Any],
    optimizer: "torch.optim.Optimizer",
    *,
    targets: int = 1,
    max_grad_norm: Optional[float] = None,
    name: Optional[str] = None,
    priority: int = 0,
    expected_iterations: Optional[int] = None,
) -> TrainingJob:
    """Captures `loss(model(*inputs), *targets)` at the example's shapes and
    loads it as a training session: the example is the model's inputs
    followed by `targets` loss targets. `optimizer` is a torch.optim SGD,
    Adam or AdamW over the model's parameters (its parameter groups, learning
    rates and weight decays are used; the service keeps its state).
    `max_grad_norm` clips gradients by their global norm each step, as
    `torch.nn.utils.clip_grad_norm_`."""
    example = tuple(example)
    if targets < 0 or targets >= len(example):
        raise ValueError(f"example has {len(example)} tensors; targets={targets} leaves no model input")
    n_inputs = len(example) - targets
    model.train()
    ep = _export(_WithLoss(model, loss, n_inputs), example, "training step")
    t = translate(ep, training=True, prefix="model.")
    if len(t.outputs) != 1 or t.outputs[0].shape not in ((), (1,)):
        raise ModelError("the loss must be one scalar tensor")
    t.b.set_name(t.outputs[0].outlet, "loss")
    var_of_id = {id(tensor): name for name, tensor in t.variables.items()}
    groups = []
    group_names = []
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            n = var_of_id.get(id(p))
            if n is not None and n not in names and p.requires_grad:
                names.append(n)
        groups.append((names, _lanes_optimizer(optimizer, g)))
        group_names.append(names)
    session = client.session(
        name or f"torch-{type(model).__name__}",
        kind="training",
        priority=priority,
        expected_iterations=expected_iterations,
    )
    try:
        session.load_training(t.b, "loss", groups, max_grad_norm=max_grad_norm)
    except BaseException:
        session.close()
        raise
    return TrainingJob(session, t, model, optimizer, group_names)


def inference_job(
    client: Any,
    model: torch.nn.Module,
    example: Any,
    *,
    name: Optional[str] = None,
    priority: int = 0,
) -> InferenceJob:
    """Captures `model` (as it is: call `model.eval()` first for inference
    behaviour) at the example's shapes and loads it as an inference session.
    `example` is one tensor or a tuple of the model's inputs."""
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    ep = _export(model, example, "model")
    t = translate(ep, training=model.training)
    names = ["output"] if len(t.outputs) == 1 else [f"output_{k}" for k in range(len(t.outputs))]
    for o, n in zip(t.outputs, names):
        t.b.set_name(o.outlet, n)
    session = client.session(name or f"torch-{type(model).__name__}", kind="inference", priority=priority)
    try:
        session.load_graph(t.b, names)
    except BaseException:
        session.close()
        raise
    return InferenceJob(session, t, names)

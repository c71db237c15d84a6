"""The walk over a captured program: placeholders become feeds, variables
and known values; each call is folded by torch (when all its inputs are
known) or translated by its rule; the outputs are the job's fetches."""

from __future__ import annotations

import json
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _lanes
from .._lanes import ModelError
from ._ir import (
    _CAST_TO,
    _FLOATS,
    _HALF_NAMES,
    DROPOUT_SEED,
    TorchImportError,
    _Buffer,
    _feed_dtype,
    _float_name,
    _has_out,
    _op,
    _Out,
    _Param,
    _unwrap_known,
    _where_from,
)
from ._rules import _RULES

#: Known tensors larger than this travel as variables, not inside the graph.
_BIG_CONSTANT = 1 << 20

class _Submodule:
    """A region graph (`get_attr` of a higher-order op's submodule)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module


#: Higher-order ops whose region is inlined (see `_Translator.inline`).
_INLINED = {"wrap_with_autocast", "wrap_with_set_grad_enabled"}

_IGNORED = {
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "_set_grad_enabled",
}


# ---------------------------------------------------------------------------
# the translator


class _Translator:
    def __init__(self, ep: "torch.export.ExportedProgram", *, training: bool, prefix: str):
        self.ep = ep
        self.training = training
        self.prefix = prefix
        self.b = _lanes.GraphBuilder()
        self.env: Dict[torch.fx.Node, Any] = {}
        self._user_storages: Optional[set] = None
        #: Lanes variable name → the torch tensor it started from.
        self.variables: Dict[str, torch.Tensor] = {}
        self._var_of_tensor: Dict[int, _Out] = {}
        #: Prefix of the names of large constants held as variables
        #: (`const/{n}`): a step captured at another batch size joins the
        #: job's graph, variables shared by name, so its own are named apart.
        self.const_prefix = ""
        #: Variables by name: a later walk of another program of the same
        #: model (its evaluation forward) finds them by name too.
        self._var_of_name: Dict[str, _Out] = {}
        self._buffer_vars: Dict[str, _Out] = {}
        #: Integer buffers counted on the client (num_batches_tracked): name → increment per step.
        self.counters: Dict[str, int] = {}
        self.inputs: List[Tuple[str, Tuple[int, ...], str]] = []
        self.outputs: List[_Out] = []
        self.node: Optional[torch.fx.Node] = None
        self._constants: Dict[int, Tuple[torch.Tensor, _Out]] = {}
        self._n_big = 0
        #: A BatchNorm in training mode updates running statistics in place.
        self.updates_buffers = False
        #: Gradient accumulation: each walk's BatchNorm batch statistics,
        #: (running mean, running var, momentum, eps, count) → [(mean, invstd)]
        #: in walk order, for `finish_batch_norms`; None when not accumulating.
        self.bn_updates: Optional[Dict[Tuple[str, str], Any]] = None
        self._walk = ""
        #: The dropout seed's placeholder, once a dropout op needs it.
        self.seed: Optional[_Out] = None
        self._salt = 0
        #: The float dtype torch computed the node being translated in (its
        #: recorded output's): the Lanes ops made for it take their float
        #: inputs in it, or in float32 where Lanes has no half kernel.
        self._want: Optional[str] = None
        #: One cast per value and dtype.
        self._casts: Dict[Tuple[Tuple[int, int], str], _Out] = {}
        #: The torch dtype of each output that Lanes sends back as float32
        #: (a half output, cast in the graph); None where it keeps its own.
        self.output_dtypes: List[Optional[torch.dtype]] = []

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
        """The Lanes op `op` with `attrs` on `inputs`; its output (a tuple of
        `n_out` when several)."""
        return self._emit_json(op, _op(op, **attrs), inputs, n_out)

    def _emit_json(self, label: str, op_json: str, inputs: Sequence[Any], n_out: int = 1) -> Any:
        ins = [self.lanes(x) for x in inputs]
        if self._want is not None and label != "Cast":
            # In torch's dtype where Lanes runs the op in it (the amp pass's
            # rule, `amp::takes_half`), else in float32.
            target = self._want
            if target != "float32" and not _lanes.GraphBuilder.takes_half(op_json):
                target = "float32"
            ins = [self.cast(i, target) if i.dtype in _FLOATS else i for i in ins]
        try:
            outs = self.b.op(op_json, [i.outlet for i in ins])
        except ModelError as e:
            raise self.fail(f"Lanes refused the translated op {label}: {e}") from None
        res = []
        for o in outs[: max(n_out, 1)]:
            shape, dtype = self.b.type_of(o)
            res.append(_Out(o, tuple(shape), dtype))
        return res[0] if n_out == 1 else tuple(res)

    def cast(self, x: Any, dtype: str) -> _Out:
        """`x` in `dtype` (a Lanes `Cast`, made once per value and dtype)."""
        x = self.lanes(x)
        if x.dtype == dtype:
            return x
        key = (tuple(x.outlet), dtype)
        hit = self._casts.get(key)
        if hit is None:
            hit = self._emit_json("Cast", _op("Cast", to=_CAST_TO[dtype]), [x])
            self._casts[key] = hit
        return hit

    def settle(self, node: torch.fx.Node, out: Any) -> Any:
        """A rule's float results in the dtypes torch recorded for `node`
        (a half result of an op Lanes ran in float32 is rounded back, as
        torch's own half kernels round theirs)."""
        val = node.meta.get("val")
        if isinstance(out, tuple) and isinstance(val, (list, tuple)) and len(val) == len(out):
            return tuple(self._settle_one(o, v) for o, v in zip(out, val))
        return self._settle_one(out, val)

    def _settle_one(self, out: Any, val: Any) -> Any:
        if isinstance(out, _Out) and isinstance(val, torch.Tensor):
            want = _float_name(val.dtype)
            if want is not None and out.dtype in _FLOATS and out.dtype != want:
                return self.cast(out, want)
        return out

    def dropout_mask(self, shape: Tuple[int, ...], p: float) -> _Out:
        """A fresh dropout mask (0, or 1 / (1 − p)) of `shape`, drawn in the
        service from the seed fed with each Run (`DROPOUT_SEED`)."""
        if self.seed is None:
            o = self.b.placeholder(DROPOUT_SEED, [1], "int64")
            self.seed = _Out(o, (1,), "int64")
        self._salt += 1
        return self.emit("DropoutMask", [self.seed], p=p, salt=self._salt, shape=list(shape))

    def emit_scale(self, x: Any, factor: float) -> _Out:
        """x · factor (one `Scale` op; nothing for 1)."""
        if factor == 1.0:
            return self.lanes(x)
        return self._emit_json("Scale", json.dumps({"Scale": float(factor)}), [x])

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
            o = self.b.variable(f"{self.const_prefix}const/{self._n_big}", arr)
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
        if name in self._var_of_name:
            known = self.variables[name]
            if tuple(known.shape) != tuple(tensor.shape) or known.dtype != tensor.dtype:
                raise self.fail(
                    f"`{name}` is {list(tensor.shape)} {tensor.dtype} here and was "
                    f"{list(known.shape)} {known.dtype} in the earlier capture"
                )
            self._var_of_tensor[key] = self._var_of_name[name]
            return self._var_of_name[name]
        t = tensor.detach().cpu()
        if t.dtype in _HALF_NAMES:
            out = self._half_variable(name, t)
            self._var_of_tensor[key] = out
            self._var_of_name[name] = out
            self.variables[name] = tensor
            return out
        if t.is_floating_point():
            if t.dtype != torch.float32:
                raise self.fail(f"`{name}` is {t.dtype}: Lanes holds float32, float16 and bfloat16 weights")
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
        self._var_of_name[name] = out
        self.variables[name] = tensor
        return out

    def _half_variable(self, name: str, t: torch.Tensor) -> _Out:
        """A float16/bfloat16 weight held in its dtype (2 bytes an element).
        NumPy has no bfloat16: its bits travel as ml_dtypes' bfloat16; without
        ml_dtypes the variable is float32 (the same values) and cast."""
        t = t.contiguous()
        dtype = _HALF_NAMES[t.dtype]
        if t.dtype == torch.float16:
            arr = t.numpy()
        else:
            try:
                import ml_dtypes  # type: ignore[import-not-found]
            except ImportError:
                o = self.b.variable(name, np.ascontiguousarray(t.to(torch.float32).numpy()))
                shape, dt = self.b.type_of(o)
                return self.cast(_Out(o, tuple(shape), dt), dtype)
            arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        o = self.b.variable(name, np.ascontiguousarray(arr))
        shape, dt = self.b.type_of(o)
        return _Out(o, tuple(shape), dt)

    def batch_norm_accumulating(self, x: Any, w: Any, b: Any, rm: _Buffer, rv: _Buffer, eps: float,
                                momentum: float) -> _Out:
        """A training BatchNorm of one micro-batch's walk. Every walk's
        BatchNorm normalises with its own batch statistics; the running
        statistics must see the micro-batches one after the other, as k
        PyTorch forwards do, but a variable has one writer: each walk's op
        updates a scratch pair of its own, and `finish_batch_norms` updates
        the real ones once from every walk's saved batch statistics."""
        x = self.lanes(x)
        c = x.shape[1]
        scratch = []
        for buf in (rm, rv):
            name = f"{self._walk}bn_scratch/{buf.name}"
            o = self.b.variable(name, np.zeros(c, dtype=np.float32))
            shape, dt = self.b.type_of(o)
            scratch.append(_Out(o, tuple(shape), dt))
        y, mean, invstd = self.emit("BatchNormTrain", [x, w, b, scratch[0], scratch[1]], n_out=3, eps=eps,
                                    momentum=momentum)
        count = int(np.prod(x.shape)) // c
        key = (rm.name, rv.name)
        entry = self.bn_updates.setdefault(key, {"bufs": (rm, rv), "momentum": momentum, "eps": eps,
                                                 "count": count, "stats": []})
        entry["stats"].append((mean, invstd))
        return y

    def finish_batch_norms(self) -> None:
        """The running statistics after every walk's batch, in walk order:
        r ← (1 − m)·r + m·s for each walk's s, folded into one update,
        r·(1 − m)^k + Σ_j m·(1 − m)^(k−1−j)·s_j (`Assign`); the variance's s
        is the unbiased batch variance, n/(n − 1)·(1/invstd² − eps)."""
        if not self.bn_updates:
            return
        self._want = None
        for entry in self.bn_updates.values():
            rm, rv = entry["bufs"]
            m, eps, n, stats = entry["momentum"], entry["eps"], entry["count"], entry["stats"]
            k = len(stats)
            means = [s[0] for s in stats]
            variances = []
            for _, invstd in stats:
                biased = self.emit("Add", [self.emit("Div", [1.0, self.emit("Mul", [invstd, invstd])]), -eps])
                variances.append(self.emit_scale(biased, n / (n - 1) if n > 1 else 1.0))
            for buf, batch in ((rm, means), (rv, variances)):
                var = self.lanes(buf)
                total = self.emit_scale(var, (1.0 - m) ** k)
                for j, s in enumerate(batch):
                    total = self.emit("Add", [total, self.emit_scale(s, m * (1.0 - m) ** (k - 1 - j))])
                self.b.op(_op("Assign"), [var.outlet, total.outlet])

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

    def walk(self, ep: "torch.export.ExportedProgram", *, training: bool, prefix: str,
             state_prefix: str = "") -> None:
        """Translates another program of the same model (its evaluation
        forward) into the same graph: its weights and buffers are the
        variables of the earlier walks (by tensor, else by name: its
        state_dict keys less `state_prefix`), its feeds
        `{prefix}input_{i}`."""
        self.ep = ep
        self.training = training
        self.prefix = state_prefix
        self._user_storages = None
        self.run(prefix=prefix)

    def run(self, prefix: str = "") -> None:
        """Translates the program once more into the same graph: its feeds
        are named `{prefix}input_{i}`; weights, buffers and constants are
        shared with the earlier walks (gradient accumulation walks once per
        micro-batch)."""
        self.env = {}
        self._walk = prefix
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
                    half = _HALF_NAMES.get(val.dtype)
                    dtype = "float32" if half else _feed_dtype(val.dtype)
                    if dtype is None:
                        raise self.fail(
                            f"input of dtype {val.dtype}: Lanes takes float32, float16, bfloat16 and integer inputs",
                            node,
                        )
                    name = f"{prefix}input_{n_user}"
                    n_user += 1
                    shape = tuple(int(d) for d in val.shape)
                    o = self.b.placeholder(name, list(shape), dtype)
                    self.inputs.append((name, shape, dtype))
                    # A half input is fed as float32 (the same values) and
                    # cast to its dtype as the graph's first op.
                    self.env[node] = self.cast(_Out(o, shape, dtype), half) if half else _Out(o, shape, dtype)
                else:
                    raise self.fail(f"graph input of kind {kind} is not supported", node)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "get_attr":
                # A submodule of a higher-order op (a region under
                # torch.autocast or set_grad_enabled), inlined where called.
                self.env[node] = _Submodule(getattr(self.ep.graph_module, node.target))
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
                    out = self.lanes(v)
                    # A half result is sent back as float32 (exact) and
                    # made the recorded dtype again on the client.
                    val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
                    half = isinstance(val, torch.Tensor) and val.dtype in _HALF_NAMES
                    if out.dtype != "float32" and out.dtype in _FLOATS:
                        out = self.cast(out, "float32")
                    self.outputs.append(out)
                    self.output_dtypes.append(val.dtype if half else None)
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

    def inline(self, node: torch.fx.Node) -> Any:
        """A higher-order op that only sets a mode around a region
        (`wrap_with_autocast`, `wrap_with_set_grad_enabled`): the region's
        graph translated in place. Under autocast, torch recorded each of the
        region's results in the dtype it computed it in, and `call` keeps
        those dtypes; in training, a no_grad region is taken only when its
        results are known at capture."""
        args = [self.arg(a) for a in node.args]
        name = getattr(node.target, "__name__", "")
        no_grad = name == "wrap_with_set_grad_enabled" and not args[0] and self.training
        subs = [i for i, a in enumerate(args) if isinstance(a, _Submodule)]
        if len(subs) != 1:
            raise self.fail("a higher-order op without exactly one region graph")
        region, inputs = args[subs[0]].module, args[subs[0] + 1 :]
        placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise self.fail("the region's inputs do not match the op's arguments")
        outer = self.node
        result: Any = None
        for n in region.graph.nodes:
            self.node = n
            if n.op == "placeholder":
                self.env[n] = inputs[placeholders.index(n)]
            elif n.op == "call_function":
                self.env[n] = self.call(n)
            elif n.op == "get_attr":
                self.env[n] = _Submodule(getattr(region, n.target))
            elif n.op == "output":
                result = self.arg(n.args[0])
            else:
                raise self.fail(f"graph node kind {n.op} is not supported inside a region", n)
        self.node = outer
        if no_grad and _has_out(result):
            # The service differentiates the whole step: it has no way yet to
            # keep a run-time result of the region out of the gradients (a
            # region of known values only, e.g. rotary tables, is fine).
            raise self.fail("a torch.no_grad() region computing run-time tensors inside a training step is not supported yet")
        return tuple(result) if isinstance(result, list) else result

    def call(self, node: torch.fx.Node) -> Any:
        target = node.target
        if target is operator.getitem:
            seq, i = self.arg(node.args[0]), node.args[1]
            return seq[i]
        name = getattr(getattr(target, "_overloadpacket", None), "__name__", None) or getattr(target, "__name__", str(target))
        if name in _IGNORED:
            return None
        if name in _INLINED:
            return self.inline(node)
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
        outer, val = self._want, node.meta.get("val")
        if isinstance(val, (list, tuple)):
            val = next((v for v in val if isinstance(v, torch.Tensor) and _float_name(v.dtype)), None)
        self._want = _float_name(val.dtype) if isinstance(val, torch.Tensor) else None
        try:
            out = rule(self, node, *args, **kwargs)
            out = self.settle(node, out)
        finally:
            self._want = outer
        self.check_shape(node, out)
        return out

    def _users(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) one of the module's own tensors."""
        if self._user_storages is None:
            owned = list(self.ep.state_dict.values()) + list((getattr(self.ep, "constants", {}) or {}).values())
            self._user_storages = {
                x.untyped_storage().data_ptr() for x in owned if isinstance(x, torch.Tensor)
            }
        return t.untyped_storage().data_ptr() in self._user_storages

    def fold(self, node: torch.fx.Node, name: str, args: List[Any], kwargs: Dict[str, Any]) -> Any:
        a = _unwrap_known(args)
        k = _unwrap_known(kwargs)
        if name.endswith("_") and a and isinstance(a[0], torch.Tensor) and self._users(a[0]):
            # Never mutate the user's weights, buffers or constants. A
            # tensor made during capture (a mask filled slice by slice) is
            # mutated in place, through its views, as in eager.
            a = [a[0].clone()] + list(a[1:])
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
            # A scalar is [] in torch and may be [1] in Lanes (reductions to
            # one element): the same value under broadcasting.
            scalars = {(), (1,)}
            if out.shape != want and not (out.shape in scalars and want in scalars):
                raise self.fail(f"translated to shape {list(out.shape)}, torch says {list(want)}")

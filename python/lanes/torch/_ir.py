"""The translator's values and helpers: tensors of the Lanes graph (`_Out`),
module buffers and parameters, argument normalisation, error locations."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from .._lanes import ModelError

#: The feed that seeds a graph's dropout masks; the jobs send a new one with
#: every Run (drawn from torch's generator, so `torch.manual_seed` repeats a run).
DROPOUT_SEED = "dropout_seed"


def _new_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


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


# ---------------------------------------------------------------------------
# values


@dataclass
class _Out:
    """A tensor computed in the Lanes graph."""

    outlet: Tuple[int, int]
    shape: Tuple[int, ...]
    dtype: str  # "float32" | "int64" | "bfloat16" | "float16"

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


@dataclass
class _Param:
    name: str
    tensor: torch.Tensor


#: Lanes' float dtypes by the names `GraphBuilder.type_of` gives.
_FLOATS = ("float32", "bfloat16", "float16")

#: A dtype name as `Op::Cast`'s JSON spells it.
_CAST_TO = {"float32": "F32", "int64": "I64", "float16": "F16", "bfloat16": "BF16"}

_HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _float_name(dt: Any) -> Optional[str]:
    """A torch float dtype as a Lanes float dtype's name (None for others:
    integers, booleans, float64)."""
    if dt == torch.float32:
        return "float32"
    return _HALF_NAMES.get(dt)


def _feed_dtype(dt: torch.dtype) -> Optional[str]:
    if dt == torch.float32:
        return "float32"
    if dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return "int64"
    if dt == torch.bool:
        return "float32"
    return None

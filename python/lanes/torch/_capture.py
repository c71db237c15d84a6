"""Capturing a PyTorch model for `lanes.torch`: torch.export with its
errors explained, the step's module (model and loss), and the feeds a
job's Runs send (checked shapes, any batch in Runs of the captured one)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

from .. import _lanes
from .._lanes import ModelError
from ._ir import DROPOUT_SEED, TorchImportError
from ._translate import _Translator

#: Oldest torch release this module is tested with (its training IR).
MIN_TORCH = (2, 9)


def _torch_version() -> Tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


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


_OTHER_BATCH_HINT = {
    "step": "training_job(..., other_batches=[n]) captures the step at batch n too; other_batches=True takes any"
}


def _feeds(inputs: Sequence[Tuple[str, Tuple[int, ...], str]], args: Sequence[Any], what: str) -> Dict[str, np.ndarray]:
    if len(args) != len(inputs):
        raise TypeError(f"{what} takes {len(inputs)} tensors (as in the example), got {len(args)}")
    feeds = {}
    for (name, shape, _), a in zip(inputs, args):
        arr = _to_numpy(a, name)
        if tuple(arr.shape) != tuple(shape):
            raise _lanes.FeedError(
                f"{what}: input {name[len('input_'):]} has shape {list(arr.shape)}; the job was captured at "
                f"{list(shape)} ({_OTHER_BATCH_HINT.get(what, 'capture another job for another batch size')})"
            )
        feeds[name] = arr
    return feeds


def _example_feeds(t: _Translator, example: Sequence[Any]) -> Dict[str, np.ndarray]:
    n = len(example)
    feeds: Dict[str, np.ndarray] = {}
    for j in range(0, len(t.inputs), n):  # each micro-batch of an accumulating job
        feeds.update(_feeds(t.inputs[j : j + n], example, "example"))
    if t.seed is not None:
        feeds[DROPOUT_SEED] = np.array([0], dtype=np.int64)
    return feeds


def _in_batches(run: Callable[[Dict[str, np.ndarray]], List[np.ndarray]],
                inputs: Sequence[Tuple[str, Tuple[int, ...], str]], n_outputs: int, batch: int,
                args: Sequence[Any], what: str, option: str) -> List[np.ndarray]:
    """`args` (any number N of samples, the captured shapes otherwise) in
    Runs of the captured `batch`, the last padded with zeros; each output's
    rows of the real samples, in order."""
    if len(args) != len(inputs):
        raise TypeError(f"{what} takes {len(inputs)} tensors (as in the example), got {len(args)}")
    arrays = [_to_numpy(a, name) for (name, _, _), a in zip(inputs, args)]
    n = arrays[0].shape[0] if arrays[0].ndim else 0
    for k, ((_, shape, _), a) in enumerate(zip(inputs, arrays)):
        if a.ndim != len(shape) or tuple(a.shape[1:]) != tuple(shape[1:]) or a.shape[0] != n:
            raise _lanes.FeedError(
                f"{what}: input {k} has shape {list(a.shape)}; the job takes "
                f"[N, {', '.join(str(d) for d in shape[1:])}] (any N, the same in every input)"
            )
    if n == 0:
        raise _lanes.FeedError(f"{what}: an empty batch (N = 0)")
    parts: List[List[np.ndarray]] = []
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        feeds = {}
        for (name, _, _), a in zip(inputs, arrays):
            chunk = a[start:start + rows]
            if rows < batch:
                pad = np.zeros((batch - rows,) + a.shape[1:], dtype=a.dtype)
                chunk = np.concatenate([chunk, pad])
            feeds[name] = np.ascontiguousarray(chunk)
        outs = run(feeds)
        for o in outs:
            if o.ndim == 0 or o.shape[0] != batch:
                raise _lanes.ModelError(
                    f"{option}: an output of shape {list(o.shape)} does not have the batch "
                    f"({batch}) first, so the samples' rows cannot be told apart"
                )
        parts.append([o[:rows] for o in outs])
    return [np.concatenate([p[k] for p in parts]) for k in range(n_outputs)]

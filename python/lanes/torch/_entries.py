"""Entries of a training job's graph (docs/protocol.md, *Entries*):
its evaluation-mode forward (`training_job(..., eval_example=x)`) walked
into the step's graph on the same variables, and its step at other batch
sizes declared ahead (`other_batches=[n]`), captured on their own and
joined by the service client's `load_training(..., batches=...)`."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._lanes import ModelError
from ._capture import _WithLoss, _export
from ._translate import _Translator

#: The names of a training job's evaluation forward's feeds and outputs
#: begin with this (`eval/input_0`, `eval/output`).
EVAL_PREFIX = "eval/"


class _Evaluation:
    """A training job's evaluation-mode forward, an entry of its graph: its
    feeds, output names, batch and the torch dtypes of its half outputs."""

    def __init__(self, inputs: List[Tuple[str, Tuple[int, ...], str]], outputs: List[str],
                 dtypes: List[Optional[torch.dtype]]):
        self.inputs = inputs
        self.outputs = outputs
        self.dtypes = dtypes
        self.batch = inputs[0][1][0] if inputs and inputs[0][1] else 1


def _capture_evaluation(t: _Translator, model: torch.nn.Module, eval_example: Any) -> _Evaluation:
    """Walks `model`'s evaluation-mode forward at `eval_example`'s shapes
    into the training step's graph `t.b`, on the same variables (weights by
    tensor, BatchNorm statistics by name), and declares its outputs the
    graph's `eval` entry. `t`'s inputs and outputs stay the step's."""
    example = tuple(eval_example) if isinstance(eval_example, (tuple, list)) else (eval_example,)
    if not example or any(not isinstance(a, torch.Tensor) or a.dim() == 0 for a in example):
        raise ValueError("eval_example: the model's input tensors, each with the batch first")
    if len({int(a.shape[0]) for a in example}) != 1:
        raise ValueError("eval_example: every input must have the same batch (first dimension)")
    was_training = model.training
    model.eval()
    try:
        ep = _export(model, example, "evaluation forward")
    finally:
        model.train(was_training)
    step_inputs, step_outputs, step_dtypes = t.inputs, t.outputs, t.output_dtypes
    t.inputs, t.outputs, t.output_dtypes = [], [], []
    try:
        t.walk(ep, training=False, prefix=EVAL_PREFIX)
        inputs, outs, dtypes = t.inputs, t.outputs, t.output_dtypes
    finally:
        t.inputs, t.outputs, t.output_dtypes = step_inputs, step_outputs, step_dtypes
    names = [f"{EVAL_PREFIX}output"] if len(outs) == 1 else [f"{EVAL_PREFIX}output_{k}" for k in range(len(outs))]
    for o, n in zip(outs, names):
        t.b.set_name(o.outlet, n)
    t.b.entry("eval", [o.outlet for o in outs])
    return _Evaluation(inputs, names, dtypes)


def _declared_batches(other_batches: Any, example: Sequence[Any]) -> List[int]:
    """`other_batches` as the batch sizes to capture ahead (none for a bool)."""
    if isinstance(other_batches, bool):
        return []
    try:
        sizes = sorted({int(n) for n in other_batches})
    except (TypeError, ValueError):
        raise TypeError("other_batches must be True/False or a list of batch sizes") from None
    captured = int(np.shape(example[0])[0]) if np.ndim(example[0]) else 0
    for n in sizes:
        if n < 1 or n == captured:
            raise ValueError(f"other_batches: {n} is not another batch size (the example's is {captured})")
    if len(sizes) > 8:
        raise ValueError(f"other_batches: {len(sizes)} sizes, at most 8 are captured ahead")
    return sizes


def _capture_batch(model: torch.nn.Module, loss: Callable[..., Any], n_inputs: int,
                   example: Sequence[Any], n: int) -> _Translator:
    """The training step at batch `n` (the example's rows repeated to n,
    only their shapes matter), translated into a graph of its own whose
    variables are named as the job's; `load_training` joins it as the
    entry `batch{n}`."""
    def rows(a: Any) -> torch.Tensor:
        a = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
        reps = -(-n // a.shape[0])
        return torch.cat([a] * reps)[:n]

    ep = _export(_WithLoss(model, loss, n_inputs), tuple(rows(a) for a in example), f"training step at batch {n}")
    t = _Translator(ep, training=True, prefix="model.")
    t.const_prefix = f"batch{n}/"
    t.run()
    if len(t.outputs) != 1 or t.outputs[0].shape not in ((), (1,)):
        raise ModelError("the loss must be one scalar tensor")
    t.b.set_name(t.outputs[0].outlet, "loss")
    return t

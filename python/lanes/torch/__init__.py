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

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _lanes
from .._lanes import ModelError
from ._capture import MIN_TORCH, _WithLoss, _example_feeds, _export, _feeds, _in_batches, _to_numpy, translate
from ._entries import EVAL_PREFIX, _capture_batch, _capture_evaluation, _declared_batches, _Evaluation
from ._ir import DROPOUT_SEED, TorchImportError, _new_seed
from ._translate import _Translator

__all__ = [
    "TorchImportError",
    "TrainingJob",
    "InferenceJob",
    "training_job",
    "inference_job",
    "translate",
    "MIN_TORCH",
    "DROPOUT_SEED",
    "EVAL_PREFIX",
]

#: The loss-scaling variables of an fp16-mixed training job (docs/precision.md).
_SCALE, _TRACKER = "amp/scale", "amp/growth_tracker"


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
                 optimizer: "torch.optim.Optimizer", groups: List[List[str]], accumulate: int = 1,
                 scaled: bool = False, other_batch: Optional[Callable[[Sequence[Any]], "TrainingJob"]] = None,
                 evaluation: Optional["_Evaluation"] = None,
                 batches: Optional[Dict[int, List[Tuple[str, Tuple[int, ...], str]]]] = None):
        self.session = session
        #: Steps of other batch sizes captured into the job's graph
        #: (`other_batches=[n, ...]`): size → that step's feeds
        #: (`batch{n}/input_{i}`), run as the graph's entry `batch{n}`.
        self._batches = batches or {}
        #: The evaluation-mode forward captured into the job's graph (an
        #: entry of it), when `training_job(..., eval_example=...)`.
        self._evaluation = evaluation
        #: Captures a job like this one at another batch size
        #: (`training_job(..., other_batches=True)`); its jobs by batch size.
        self._other_batch = other_batch
        self._others: Dict[int, "TrainingJob"] = {}
        self._scaled = scaled
        self.accumulate = accumulate
        #: One micro-batch's feeds (the first walk's names).
        self.inputs = t.inputs[: len(t.inputs) // accumulate]
        self._all_inputs = t.inputs
        self._pending: Dict[str, np.ndarray] = {}
        self._micro = 0
        self._model = model
        self._optimizer = optimizer
        self._counters = dict(t.counters)
        self._dropout = t.seed is not None
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

    def step(self, *args: Any) -> Optional[float]:
        """One training iteration on a batch (the model's inputs, then the
        loss's targets, as in `example`); returns the loss. With
        `accumulate=k`, one micro-batch: the first k − 1 calls keep theirs
        (and return None), the k-th sends all k in one Run, whose update
        uses their summed gradients, and returns their mean loss."""
        n = len(self.inputs)
        part = self._all_inputs[self._micro * n : (self._micro + 1) * n]
        other = self._batch_of(part, args)
        if other is not None and other in self._batches:
            return self._step_declared_batch(other, args)
        if other is not None and self._other_batch is not None:
            return self._step_other_batch(other, args)
        self._pending.update(_feeds(part, args, "step"))
        self._micro += 1
        if self._micro < self.accumulate:
            return None
        feeds, self._pending, self._micro = self._pending, {}, 0
        return self._run_step(feeds)

    def _run_step(self, feeds: Dict[str, np.ndarray], prefix: str = "") -> float:
        """One step's Run: the main iteration's feeds, or with `prefix` an
        entry's (`batch{n}/`, its names prefixed); returns the loss."""
        self._sync_lr()
        if self._dropout:
            feeds[prefix + DROPOUT_SEED] = np.array([_new_seed()], dtype=np.int64)
        loss = self.session.run(feeds, fetch=prefix + "loss")
        self._steps += 1
        # The optimizer's step ran in the service: tell torch's learning-rate
        # schedulers so (they warn of a scheduler step before any optimizer
        # step otherwise).
        self._optimizer._opt_called = True  # type: ignore[attr-defined]
        return float(np.asarray(loss).reshape(-1)[0])

    def _batch_of(self, part: Sequence[Tuple[str, Tuple[int, ...], str]], args: Sequence[Any]) -> Optional[int]:
        """The batch size of `args` when the job takes other batch sizes and
        they differ from the captured one in their first axis only (all by
        the same size); None otherwise (`_feeds` then checks them)."""
        if (self._other_batch is None and not self._batches) or self.accumulate != 1 \
                or len(args) != len(part) or not args:
            return None
        shapes = [tuple(np.shape(a)) for a in args]
        captured = [tuple(shape) for _, shape, _ in part]
        if shapes == captured or any(len(s) == 0 or len(s) != len(c) for s, c in zip(shapes, captured)):
            return None
        if any(s[1:] != c[1:] for s, c in zip(shapes, captured)):
            return None
        sizes = {s[0] for s in shapes}
        if len(sizes) != 1 or 0 in sizes:
            return None
        return sizes.pop()

    def _step_declared_batch(self, batch: int, args: Sequence[Any]) -> float:
        # The graph's entry for this size: the same variables, trained in
        # place; nothing is copied.
        prefix = f"batch{batch}/"
        feeds = {prefix + name: v for name, v in _feeds(self._batches[batch], args, "step").items()}
        return self._run_step(feeds, prefix)

    def _step_other_batch(self, batch: int, args: Sequence[Any]) -> Optional[float]:
        # A job captured at this batch size (once, kept), given this job's
        # current state (weights, buffers, optimizer state, learning
        # rates), one step there, and its state back.
        self._sync_lr()
        other = self._others.get(batch)
        if other is None:
            other = self._other_batch(tuple(args))  # type: ignore[misc]
            self._others[batch] = other
        other.session.write_variables(self.session.read_variables())
        loss = other.step(*args)
        self.session.write_variables(other.session.read_variables())
        self._steps += 1
        return loss

    def evaluate(self, *inputs: Any) -> Any:
        """The model's forward in evaluation mode (`model.eval()`: BatchNorm
        with its running statistics, no dropout) on the job's current
        weights and statistics in the service, without copying them: the
        graph's `eval` entry, captured by `training_job(...,
        eval_example=...)`. Takes any number N of samples (the example's
        shapes but the first dimension), in Runs of the example's batch,
        the last padded with zeros; returns what the model returns for
        them (one tensor or a tuple). Updates nothing: the next `step`
        is the one it would have been."""
        ev = self._evaluation
        if ev is None:
            raise ValueError(
                "this job has no evaluation forward: make it with training_job(..., eval_example=x), "
                "x the model's inputs at the batch to evaluate in"
            )

        def run(feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
            return [np.asarray(o) for o in self.session.run(feeds, fetch=ev.outputs)]

        outs = _in_batches(run, ev.inputs, len(ev.outputs), ev.batch, inputs, "evaluate", "evaluate")
        ts = [torch.from_numpy(o) for o in outs]
        ts = [x if d is None else x.to(d) for x, d in zip(ts, ev.dtypes)]
        return ts[0] if len(ts) == 1 else tuple(ts)

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

    def scaler_state(self) -> Optional[Dict[str, Any]]:
        """fp16-mixed's loss scaling, read from the service:
        ``{"scale": float, "growth_tracker": int}`` (the clean steps since
        the scale last changed; a scale that halved, or a tracker back at 0,
        shows skipped steps). None for a job that does not scale its loss."""
        if not self._scaled:
            return None
        v = self.session.read_variables([_SCALE, _TRACKER])
        return {
            "scale": float(np.asarray(v[_SCALE]).reshape(-1)[0]),
            "growth_tracker": int(np.asarray(v[_TRACKER]).reshape(-1)[0]),
        }

    def load_scaler_state(self, state: Dict[str, Any]) -> None:
        """Restores the loss scaling from `scaler_state()`'s dict (or a
        `GradScaler.state_dict()`: its ``scale`` and ``_growth_tracker``);
        a key that is absent keeps the service's value."""
        if not self._scaled:
            raise ValueError("this job does not scale its loss (only precision=\"fp16-mixed\" does)")
        current = self.session.read_variables([_SCALE, _TRACKER])
        values = {}
        if "scale" in state:
            scale = float(state["scale"])
            if not (np.isfinite(scale) and scale > 0):
                raise ValueError(f"scale {scale} must be positive and finite")
            values[_SCALE] = np.full(np.shape(current[_SCALE]), scale, dtype=np.float32)
        tracker = state.get("growth_tracker", state.get("_growth_tracker"))
        if tracker is not None:
            if int(tracker) < 0:
                raise ValueError(f"growth_tracker {tracker} must not be negative")
            values[_TRACKER] = np.full(np.shape(current[_TRACKER]), int(tracker), dtype=np.float32)
        if values:
            self.session.write_variables(values)

    def close(self) -> None:
        for other in self._others.values():
            other.close()
        self._others.clear()
        self.session.close()

    def __enter__(self) -> "TrainingJob":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False


class InferenceJob:
    """A PyTorch model served by the service; calling it is one Run (with
    `dynamic_batch`, one Run per captured batch of the call's samples)."""

    def __init__(self, session: Any, t: _Translator, names: List[str], dynamic_batch: bool = False):
        self.session = session
        self.inputs = t.inputs
        self.outputs = names
        self._dropout = t.seed is not None
        #: Outputs torch computes in half come back float32 and are made
        #: that dtype again (exactly).
        self._dtypes = t.output_dtypes
        #: The captured batch when calls may bring another (None: only it).
        self.batch: Optional[int] = t.inputs[0][1][0] if dynamic_batch else None
        self._bufs: Optional[_lanes.Buffers] = None
        self._no_bufs = False
        #: Calls from several threads take turns on the buffers.
        self._lock = threading.Lock()

    def _run(self, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
        if self._dropout:  # a model captured in training mode
            feeds[DROPOUT_SEED] = np.array([_new_seed()], dtype=np.int64)
        return [np.asarray(o) for o in self.session.run(feeds, fetch=self.outputs)]

    @property
    def buffers(self) -> Optional[_lanes.Buffers]:
        """The session's feed buffers that calls write their inputs into
        (`lanes.Buffers`, docs/python.md): made at the first use; None
        where the service cannot share memory (calls then send their
        inputs with each Run)."""
        if self._bufs is None and not self._no_bufs:
            try:
                self._bufs = self.session.buffers()
            except _lanes.SessionClosedError:
                raise
            except _lanes.LanesError:
                self._no_bufs = True
        return self._bufs

    def _run_buffered(self, args: Sequence[Any]) -> Optional[List[np.ndarray]]:
        """One Run from the feed buffers, each input copied once from the
        caller's tensor (any device, dtype converted) straight into its
        buffer; None where there are no buffers."""
        if len(args) != len(self.inputs):
            raise TypeError(f"the model takes {len(self.inputs)} tensors (as in the example), got {len(args)}")
        with self._lock:
            bufs = self.buffers
            if bufs is None:
                return None
            for (name, shape, _), a in zip(self.inputs, args):
                if not isinstance(a, torch.Tensor):
                    a = _to_numpy(a, name)
                if tuple(a.shape) != tuple(shape):
                    raise _lanes.FeedError(
                        f"the model: input {name[len('input_'):]} has shape {list(a.shape)}; the job was "
                        f"captured at {list(shape)} (capture another job for another batch size)"
                    )
                dst = bufs[name]
                if not isinstance(a, torch.Tensor):
                    dst[...] = a
                elif dst.dtype.name == "bfloat16":  # ml_dtypes', unknown to torch
                    torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).copy_(a.detach())
                else:
                    torch.from_numpy(dst).copy_(a.detach())
            if self._dropout:
                bufs[DROPOUT_SEED][...] = _new_seed()
            return [np.asarray(o) for o in bufs.run(self.outputs)]

    def __call__(self, *args: Any) -> Any:
        if self.batch is None:
            outs = self._run_buffered(args)
            if outs is None:
                outs = self._run(_feeds(self.inputs, args, "the model"))
        else:
            outs = self._run_any_batch(args)
        ts = [torch.from_numpy(o) for o in outs]
        ts = [x if d is None else x.to(d) for x, d in zip(ts, self._dtypes)]
        return ts[0] if len(ts) == 1 else tuple(ts)

    def _run_any_batch(self, args: Sequence[Any]) -> List[np.ndarray]:
        """Samples in runs of the captured batch, the last padded with
        zeros; each output's rows of the real samples, in order."""
        return _in_batches(self._run, self.inputs, len(self.outputs), self.batch or 1, args,
                           "the model", "dynamic_batch")

    def close(self) -> None:
        if self._bufs is not None:
            self._bufs.close()
        self.session.close()

    def __enter__(self) -> "InferenceJob":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False


def _loss_scale(scaler: Any) -> Tuple[Optional[Dict[str, Any]], int]:
    """`training_job`'s `scaler=` as `load_training`'s `loss_scale=` (which
    checks it against the precision) and the growth tracker to start from
    (a GradScaler that has stepped)."""
    if scaler is None or isinstance(scaler, dict):
        return scaler, 0
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or a dict, not {type(scaler).__name__}")
    if not scaler.is_enabled():
        return {"enabled": False}, 0
    settings = {
        "init_scale": float(scaler.get_scale()),
        "growth_factor": float(scaler.get_growth_factor()),
        "backoff_factor": float(scaler.get_backoff_factor()),
        "growth_interval": int(scaler.get_growth_interval()),
    }
    return settings, int(scaler.state_dict().get("_growth_tracker", 0))


def _refuse_half_weights(model: torch.nn.Module) -> None:
    """A training job's weights are float32: one whose parameters or buffers
    are float16/bfloat16 (`model.half()`) is refused, as `precision="bf16"`
    is (docs/precision.md)."""
    for key, v in list(model.named_parameters()) + list(model.named_buffers()):
        if v.is_floating_point() and v.dtype != torch.float32:
            raise ModelError(
                f"`{key}` is {v.dtype}: a training job keeps its weights in float32 (a step's update "
                "smaller than half a unit in the last place of a half weight would be lost). Train the "
                "float32 model (model.float()) with torch.autocast inside forward, or with "
                "precision=\"bf16-mixed\"; half weights are for inference_job"
            )


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
    save_to: Optional[str] = None,
    accumulate: int = 1,
    precision: Optional[str] = None,
    scaler: Any = None,
    other_batches: Union[bool, Sequence[int]] = False,
    eval_example: Any = None,
) -> TrainingJob:
    """Captures `loss(model(*inputs), *targets)` at the example's shapes and
    loads it as a training session: the example is the model's inputs
    followed by `targets` loss targets. `optimizer` is a torch.optim SGD,
    Adam or AdamW over the model's parameters (its parameter groups, learning
    rates and weight decays are used; the service keeps its state).
    `max_grad_norm` clips gradients by their global norm each step, as
    `torch.nn.utils.clip_grad_norm_`. `accumulate=k` accumulates gradients
    over k micro-batches (each of the example's shapes) before an update, as
    a PyTorch loop that steps the optimizer every k backward passes of
    `loss / k` (a BatchNorm in training mode normalises each micro-batch
    with its own statistics and updates its running statistics k times, in
    order, as those k forwards do).
    `save_to` (a directory) also saves
    the job with the example batch, to time and profile it on its own:
    `lanes bench train --job DIR --op-profile`. `precision="bf16-mixed"`
    trains as under `torch.autocast("cuda", torch.bfloat16)`: matrix
    products and convolutions in bf16, weights, gradients and optimizer
    state in float32 (docs/precision.md). `precision="fp16-mixed"` the same
    in fp16 with a `torch.amp.GradScaler`'s loss scaling (initial scale
    2^16, halved on an overflow, whose step is skipped; doubled after 2000
    clean steps): the scale and the clean-step count are the session's
    variables `amp/scale` and `amp/growth_tracker`, read with
    `job.scaler_state()`. `scaler` sets that scaling: a
    `torch.amp.GradScaler` (its current scale, growth and backoff factors,
    growth interval and growth tracker) or a dict of any of `init_scale`,
    `growth_factor`, `backoff_factor` and `growth_interval`; a ValueError
    with another precision. A disabled GradScaler (`enabled=False`) trains
    unscaled with fp32 or bf16-mixed, and is refused with fp16-mixed.
    `other_batches=True` lets `step` take a batch of another size (every
    tensor's first axis, the rest as captured; e.g. an epoch's last, smaller
    batch, without `drop_last`): the step runs in a second job captured at
    that size the first time, kept for later ones, into which this job's
    state (weights, buffers, optimizer state) is copied before the step and
    from which it is copied back after. That job takes as much service
    memory as this one while it lives, and each such step moves the state
    both ways; not with `accumulate`. `other_batches=[n, ...]` (sizes known
    ahead, e.g. `[len(dataset) % batch]`) instead captures the step at each
    size n into this job's graph (an entry `batch{n}`, docs/torch.md), on
    the same weights, buffers and optimizer state: a step of size n runs
    there with nothing copied, and the service holds the state once.
    Without it another batch size is refused (`lanes.FeedError` with the
    captured shape).
    `eval_example` (the model's inputs, one tensor or a tuple, at the batch
    to evaluate in) also captures the model's evaluation-mode forward into
    the job's graph, on the same weights: `job.evaluate(x)` then runs it on
    the job's current weights and BatchNorm statistics in the service, with
    no copy of them and no update (docs/torch.md, *Evaluating a training
    job*)."""
    loss_scale, tracker = _loss_scale(scaler)
    example = tuple(example)
    if targets < 0 or targets >= len(example):
        raise ValueError(f"example has {len(example)} tensors; targets={targets} leaves no model input")
    if accumulate < 1:
        raise ValueError(f"accumulate must be at least 1, got {accumulate}")
    if other_batches and accumulate != 1:
        raise ValueError("other_batches does not go with accumulate (micro-batches are of the captured size)")
    declared = _declared_batches(other_batches, example)
    n_inputs = len(example) - targets
    _refuse_half_weights(model)
    job_name = name or f"torch-{type(model).__name__}"

    def other(batch_example: Sequence[Any]) -> TrainingJob:
        batch_example = tuple(a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
                              for a in batch_example)
        n = batch_example[0].shape[0]
        return training_job(client, model, batch_example, loss, optimizer, targets=targets,
                            max_grad_norm=max_grad_norm, name=f"{job_name}-batch{n}", priority=priority,
                            precision=precision, scaler=scaler)

    model.train()
    ep = _export(_WithLoss(model, loss, n_inputs), example, "training step")
    t = _Translator(ep, training=True, prefix="model.")
    if accumulate > 1:
        t.bn_updates = {}
    t.run()
    if len(t.outputs) != 1 or t.outputs[0].shape not in ((), (1,)):
        raise ModelError("the loss must be one scalar tensor")
    if accumulate > 1:
        # One walk per micro-batch into the same graph, weights shared; the
        # loss is their mean, so the gradients are their summed loss / k.
        # BatchNorm's running statistics see the micro-batches in turn.
        for j in range(1, accumulate):
            t.run(prefix=f"m{j}/")
        t.finish_batch_norms()
        total = t.outputs[0]
        for o in t.outputs[1:]:
            total = t.emit("Add", [total, o])
        t.outputs = [t.emit_scale(total, 1.0 / accumulate)]
    t.b.set_name(t.outputs[0].outlet, "loss")
    evaluation = _capture_evaluation(t, model, eval_example) if eval_example is not None else None
    batches = [_capture_batch(model, loss, n_inputs, example, n) for n in declared]
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
        job_name,
        kind="training",
        priority=priority,
        expected_iterations=expected_iterations,
    )
    try:
        _, state = session.load_training(t.b, "loss", groups, max_grad_norm=max_grad_norm,
                                         save_to=save_to,
                                         example=_example_feeds(t, example) if save_to else None,
                                         precision=precision, loss_scale=loss_scale,
                                         batches=[(f"batch{n}", tn.b, "loss") for n, tn in zip(declared, batches)])
        if tracker:
            session.write_variables({_TRACKER: np.array([tracker], dtype=np.float32)})
    except BaseException:
        session.close()
        raise
    return TrainingJob(session, t, model, optimizer, group_names, accumulate,
                       scaled=_SCALE in state, other_batch=other if other_batches is True else None,
                       evaluation=evaluation, batches={n: tn.inputs for n, tn in zip(declared, batches)})


def inference_job(
    client: Any,
    model: torch.nn.Module,
    example: Any,
    *,
    name: Optional[str] = None,
    priority: int = 0,
    save_to: Optional[str] = None,
    precision: Optional[str] = None,
    dynamic_batch: bool = False,
) -> InferenceJob:
    """Captures `model` (as it is: call `model.eval()` first for inference
    behaviour) at the example's shapes and loads it as an inference session.
    `example` is one tensor or a tuple of the model's inputs.
    `precision="fp16"` or `"bf16"` serves it as `model.half()` would
    (weights stored in half, inputs and outputs float32);
    `"bf16-mixed"`/`"fp16-mixed"` as under `torch.autocast`. A model
    already in float16/bfloat16 (`model.half()`), or with `torch.autocast`
    regions in its forward, keeps the dtypes torch recorded: half weights
    held in half, half outputs returned in their dtype.

    `dynamic_batch=True`: calls may bring any number N of samples (the
    example's shapes but the first dimension). They run as Runs of the
    example's batch, the last padded with zeros, and each output keeps the
    rows of the real samples. Only for a model whose samples do not mix
    (evaluation mode: BatchNorm with running statistics); a model in
    training mode is refused. Without it, another batch size is refused
    with the captured shape."""
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    if dynamic_batch and model.training:
        raise ValueError(
            "dynamic_batch needs a model in evaluation mode (call model.eval()): in training mode "
            "BatchNorm and dropout would see the padding rows"
        )
    ep = _export(model, example, "model")
    t = translate(ep, training=model.training)
    names = ["output"] if len(t.outputs) == 1 else [f"output_{k}" for k in range(len(t.outputs))]
    for o, n in zip(t.outputs, names):
        t.b.set_name(o.outlet, n)
    session = client.session(name or f"torch-{type(model).__name__}", kind="inference", priority=priority)
    try:
        session.load_graph(t.b, names, save_to=save_to,
                           example=_example_feeds(t, example) if save_to else None,
                           precision=precision)
    except BaseException:
        session.close()
        raise
    return InferenceJob(session, t, names, dynamic_batch)

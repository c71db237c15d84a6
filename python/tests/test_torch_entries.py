"""Entries of a training job's graph, on the same variables as its step:
its evaluation-mode forward (`training_job(..., eval_example=x)`,
`job.evaluate(x)`), run on the job's current weights and BatchNorm
statistics in the service without copying them and without updating
anything; and its step at other batch sizes declared ahead
(`other_batches=[n]`), which trains the same weights in place.

Tolerances: the reference is PyTorch's eval() forward of the job's
state_dict; both sides compute in float32 in different summation orders
(~1e-6 relative per op on the CPU backend; TF32 convolutions on an H100,
~1e-3), so outputs are compared within 1e-3 of their range on the CPU and
1e-2 on the GPU. Whether an evaluation disturbs training is compared
exactly on the CPU backend (the same kernels in the same order must give
the same bits) and within 1e-5 relative on the GPU.
"""

import copy
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lanes  # noqa: E402
import lanes.torch as lt  # noqa: E402
from test_torch import _BnMlp, _last_smaller_batch  # noqa: E402

CUDA = os.environ.get("LANES_TEST_DEVICE", "cpu") == "cuda"


class _Net(torch.nn.Module):
    """Convolution, BatchNorm (batch statistics in training, running ones
    in eval()), dropout (on in training, off in eval()), a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.25)
        self.fc = torch.nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.drop(h).flatten(1))


def _batch(k, n=16):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _job(client, model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return lt.training_job(client, model, example=_batch(0), loss=torch.nn.CrossEntropyLoss(), optimizer=opt,
                           **kw)


def _close(got, want, rel):
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= rel * scale, (got, want)


def test_evaluate_runs_the_eval_forward_of_the_current_weights(client):
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    probe = torch.randn(13, 3, 8, 8)  # not a multiple of the captured 6: padded
    with _job(client, model, eval_example=torch.randn(6, 3, 8, 8), name="eval-job") as job:
        assert model.training  # left as the step needs it
        for k in range(4):
            job.step(*_batch(k))
            out = job.evaluate(probe)
            assert out.shape == (13, 5)
            reference.load_state_dict(job.state_dict())
            reference.eval()
            with torch.no_grad():
                want = reference(probe)
            _close(out, want, 1e-2 if CUDA else 1e-3)
        # The running statistics moved from their start: the entry read them
        # as the steps left them, not as captured.
        assert float(job.state_dict()["bn.running_mean"].abs().sum()) > 0
        # Evaluation takes any N, tuples of one tensor too, and refuses
        # another sample shape with the expected one.
        assert job.evaluate(probe[:1]).shape == (1, 5)
        with pytest.raises(lanes.FeedError, match=r"\[N, 3, 8, 8\]"):
            job.evaluate(torch.randn(4, 3, 9, 8))


def test_evaluating_between_steps_changes_no_step(client):
    torch.manual_seed(1)
    a, b = _Net(), None
    b = copy.deepcopy(a)
    # Dropout draws its masks from seeds the client sends; the same seeds
    # on both sides (lanes.torch draws them from torch's generator).
    with _job(client, a, eval_example=torch.randn(8, 3, 8, 8), name="with-eval") as ja, \
            _job(client, b, name="without-eval") as jb:
        for k in range(5):
            torch.manual_seed(10 + k)
            la = ja.step(*_batch(k))
            torch.manual_seed(10 + k)
            lb = jb.step(*_batch(k))
            if CUDA:
                assert abs(la - lb) <= 1e-5 * max(abs(lb), 1.0), (k, la, lb)
            else:
                assert la == lb, (k, la, lb)
            ja.evaluate(torch.randn(8, 3, 8, 8))
        sa, sb = ja.state_dict(), jb.state_dict()
        for key in sb:
            if CUDA:
                _close(sa[key].float(), sb[key].float(), 1e-4)
            else:
                assert torch.equal(sa[key], sb[key]), key
        # No second copy: the job that evaluates holds the same persistent
        # bytes (weights, statistics, optimizer state) as the one that does
        # not.
        status = client.status()
        ids = {s["session"]: s["spec"]["name"] for s in status["sessions"]}
        p = {ids[j["job"]]: j["p"] for lane in json.loads(status["lanes_json"])["lanes"] for j in lane["jobs"]
             if j["job"] in ids}
        assert p["with-eval"] == p["without-eval"], p


def test_a_job_without_an_eval_example_says_how_to_get_one(client):
    with _job(client, _Net(), name="no-eval") as job:
        with pytest.raises(ValueError, match="eval_example"):
            job.evaluate(torch.randn(2, 3, 8, 8))


def test_declared_batch_sizes_train_in_the_same_job_like_pytorch(client):
    # The last batch of 8 declared ahead (`_last_smaller_batch`): its steps
    # run as the graph's entry `batch8` on the same weights, BatchNorm
    # statistics and AdamW state (nothing copied, no second session).
    def check(job):
        assert job.steps == 8
        assert not job._others  # no second job was made
        sessions = [s for s in client.status()["sessions"] if s["spec"]["name"].startswith("batches")]
        assert len(sessions) == 1, sessions
        # A size not declared is refused, naming the captured shape.
        with pytest.raises(lanes.FeedError, match=r"\[16, 8\]"):
            job.step(torch.randn(4, 8), torch.randint(0, 4, (4,)))

    first, loss, make_opt = _last_smaller_batch(client, check, other_batches=[8], name="batches")
    m = _BnMlp()
    with pytest.raises(ValueError, match="not another batch size"):
        lt.training_job(client, m, example=first, loss=loss, optimizer=make_opt(m), other_batches=[16])

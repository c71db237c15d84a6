"""Precision captured from PyTorch (docs/torch.md, docs/precision.md): a
forward with a `torch.autocast` region, and a model whose weights are
bfloat16 or float16, keep their dtypes through `lanes.torch` — each torch
op in the dtype torch recorded for it, a Lanes `Cast` where torch casts, and
float32 where Lanes has no half kernel (softmax, norms, pooling, losses),
rounded back to torch's dtype after it.

Tolerances: bf16 keeps 8 significant bits (one rounding is 2^-9 ≈ 2e-3
relative), fp16 11 (2^-12 ≈ 2.4e-4). Lanes rounds every op's output where
PyTorch's CPU kernels fuse some (a linear layer's bias into its product, a
batch norm into its scale and shift) and sum in another order, so outputs
differ by a few roundings per layer: served outputs are compared within
3e-2 (bf16) and 5e-3 (fp16) of the output's range, about ten roundings,
where a value computed in the wrong dtype shows at once (float32 where torch
rounds to bf16 differs from it by the roundings themselves: the tests also
assert that Lanes is nearer PyTorch's half result than PyTorch's float32
one). A training curve compounds the roundings: 1e-2 relative, as
test_precision.py argues (a gradient not cast back, or an f32-only op fed
half values, stops the learning or parts the curves by whole units).
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lanes  # noqa: E402
import lanes.torch as lt  # noqa: E402


class _AutocastCnn(torch.nn.Module):
    """conv → BatchNorm → ReLU → max pool → mean → linear, under a bf16
    autocast region, and a softmax and layer norm over its logits."""

    def __init__(self, autocast=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)
        self.autocast = autocast

    def body(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.nn.functional.max_pool2d(h, 2).mean((2, 3))
        y = self.fc(h)
        return y, torch.softmax(y, -1), torch.nn.functional.layer_norm(y, (5,))

    def forward(self, x):
        if not self.autocast:
            return self.body(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.body(x)


def _range_err(got, want):
    return (got.double() - want.double()).abs().max().item() / max(1e-6, want.double().abs().max().item())


def test_an_autocast_region_serves_like_pytorch_autocast(client):
    torch.manual_seed(0)
    m = _AutocastCnn().eval()
    with torch.no_grad():  # running statistics that are not the defaults
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = m(x)
        f32 = _AutocastCnn(autocast=False).eval()
        f32.load_state_dict(m.state_dict())
        exact = f32(x)
    job = lt.inference_job(client, m, example=x)
    try:
        got = job(x)
    finally:
        job.close()
    for k, (g, w, e) in enumerate(zip(got, want, exact)):
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        ours, f32_err = _range_err(g, w), _range_err(e, w)
        print(f"output {k} ({w.dtype}): lanes {ours:.2e}, pytorch float32 {f32_err:.2e} from pytorch autocast")
        assert ours <= 3e-2, (k, ours)
    # The logits are computed in bf16: Lanes is nearer PyTorch's bf16
    # logits than PyTorch's float32 ones are.
    assert _range_err(got[0], want[0]) < _range_err(exact[0], want[0])


class _AutocastMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.l2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.bn(self.l1(x)))
            return self.l2(h)


def test_an_autocast_region_trains_like_pytorch(client):
    """20 SGD steps with momentum of an MLP with a BatchNorm in training
    mode whose forward is under CPU bf16 autocast; the loss (outside the
    region, on bf16 logits) follows PyTorch eager's within 1e-2 relative,
    the weights stay float32, and the BatchNorm statistics follow too."""
    torch.manual_seed(0)
    m = _AutocastMlp()
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    job = lt.training_job(client, m, example=(x, y), loss=loss, optimizer=opt)
    ours, theirs = [], []
    try:
        for _ in range(20):
            ours.append(job.step(x, y))
            ref_opt.zero_grad()
            rl = loss(ref(x), y)
            rl.backward()
            ref_opt.step()
            theirs.append(rl.item())
        sd = job.state_dict()
    finally:
        job.close()
    print("autocast region loss, lanes:", np.round(ours, 4).tolist(), "pytorch:", np.round(theirs, 4).tolist())
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (i, ours, theirs)
    assert ours[-1] < 0.5 * ours[0], "it must learn the batch"
    rsd = ref.state_dict()
    for k, v in sd.items():
        assert v.dtype == rsd[k].dtype, k
        if v.is_floating_point():
            assert _range_err(v, rsd[k]) <= 5e-2, (k, _range_err(v, rsd[k]))
    assert sd["bn.num_batches_tracked"].item() == 20


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_a_half_model_serves_like_pytorch(client, dtype, tol):
    """`model.to(dtype)` served as it is: its weights held in the half dtype
    (2 bytes an element in the service), a half input, a half output, like
    PyTorch's forward of the half model on the CPU."""
    torch.manual_seed(2)
    m = _AutocastCnn(autocast=False).eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    half = copy.deepcopy(m).to(dtype)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = half(x.to(dtype))
        exact = m(x)
    job = lt.inference_job(client, half, example=x.to(dtype))
    try:
        got = job(x.to(dtype))
        held = job.session.read_variables()
    finally:
        job.close()
    names = {np.asarray(v).dtype.name for k, v in held.items() if k.startswith(("conv.", "fc."))}
    assert names == {"float16" if dtype == torch.float16 else "bfloat16"}, names
    for k, (g, w, e) in enumerate(zip(got, want, exact)):
        assert g.dtype == dtype, (k, g.dtype)
        ours = _range_err(g, w)
        print(f"output {k} at {dtype}: lanes {ours:.2e}, pytorch float32 {_range_err(e, w):.2e} from pytorch's")
        assert ours <= tol, (k, ours)


def test_explicit_casts_in_forward_are_kept(client):
    """`x.to(torch.bfloat16)` and `.float()` in a forward over bf16 weights:
    the casts are Lanes Casts, the output float32 as in PyTorch."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(x.to(torch.bfloat16)).float() * 2

    torch.manual_seed(4)
    m = Net().to(torch.bfloat16).eval()
    x = torch.randn(4, 6)
    with torch.no_grad():
        want = m(x)
    job = lt.inference_job(client, m, example=x)
    try:
        got = job(x)
    finally:
        job.close()
    assert got.dtype == torch.float32
    assert _range_err(got, want) <= 1e-2, _range_err(got, want)


def test_half_weights_do_not_train(client):
    m = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    x, y = torch.randn(2, 8, dtype=torch.bfloat16), torch.randint(0, 4, (2,))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(lanes.ModelError, match=r"`0.weight` is torch.bfloat16.*float32.*autocast"):
        lt.training_job(client, m, example=(x, y), loss=torch.nn.CrossEntropyLoss(), optimizer=opt)

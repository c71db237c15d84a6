"""Mixed and half precision from PyTorch (docs/precision.md): a model
trained with `precision="bf16-mixed"` follows PyTorch's bf16 autocast, one
trained with `precision="fp16-mixed"` follows PyTorch's fp32 training and
skips an overflowing step (loss scaling, with a `GradScaler`'s settings:
its scale steps as PyTorch's), one served with
`precision="fp16"`/`"bf16"` answers like `model.half()`, and what cannot
work is refused before anything is sent.

Tolerances: bf16 keeps 8 significant bits (a relative rounding of 2^-9),
fp16 11 (2^-12). Two programs that round the same products at different
places (Lanes rounds each op's output; PyTorch's autocast fuses a linear
layer's bias into its product) differ by a few roundings per layer, and a
training run compounds them: the curves are compared within 1e-2 relative
(one bf16 rounding is 4e-3; measured: 2e-3 on the CPU and on an H200 over
20 steps), where a wrong cast (an f32-only op fed half
values, a gradient not cast back to the f32 weight) shows as a curve that
stops learning or parts by whole units.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

import lanes  # noqa: E402
import lanes.torch as lt  # noqa: E402


def _vit():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10, dropout=0.0, attention_dropout=0.0)


def test_bf16_mixed_training_follows_pytorch_autocast(client):
    m = _vit()
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(100)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    loss = torch.nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.05)
    job = lt.training_job(client, m, example=(x, y), loss=loss, optimizer=opt, precision="bf16-mixed")
    ours, theirs = [], []
    try:
        for _ in range(20):
            ours.append(job.step(x, y))
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rl = loss(ref(x), y)
            rl.backward()
            ref_opt.step()
            theirs.append(rl.item())
        sd = job.state_dict()
    finally:
        job.close()
    print("bf16-mixed loss, lanes:", np.round(ours, 4).tolist(), "pytorch autocast:", np.round(theirs, 4).tolist())
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (i, ours, theirs)
    assert ours[-1] < 0.75 * ours[0], "it must learn the batch"
    # Master weights stay float32 and come back as such.
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())


def _scaler(job):
    v = job.session.read_variables(["amp/scale", "amp/growth_tracker"])
    return np.asarray(v["amp/scale"]).item(), np.asarray(v["amp/growth_tracker"]).item(), v["amp/scale"].shape


def test_fp16_mixed_training_scales_the_loss_and_skips_overflows(client):
    """fp16-mixed (fp16 products, float32 master weights, the loss scaled by
    2^16) follows PyTorch's float32 curve within 1e-2 relative (fp16 keeps
    11 significant bits, a rounding of 2^-12 per product); the scaler's
    variables count the clean steps; a scale written so large that the fp16
    gradients overflow makes the next step a skipped one: the weights stay
    as they were and the scale halves."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    job = lt.training_job(client, m, example=(x, y), loss=loss, optimizer=opt, precision="fp16-mixed")
    ours, theirs = [], []
    try:
        for _ in range(10):
            ours.append(job.step(x, y))
            ref_opt.zero_grad()
            rl = loss(ref(x), y)
            rl.backward()
            ref_opt.step()
            theirs.append(rl.item())
        scale, tracker, shape = _scaler(job)
        assert (scale, tracker) == (65536.0, 10.0), "ten clean steps at PyTorch's initial scale"
        before = job.state_dict()
        job.session.write_variables({"amp/scale": np.full(shape, 2.0**40, dtype=np.float32)})
        job.step(x, y)
        after = job.state_dict()
        scale, tracker, _ = _scaler(job)
    finally:
        job.close()
    print("fp16-mixed loss, lanes:", np.round(ours, 4).tolist(), "pytorch fp32:", np.round(theirs, 4).tolist())
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (i, ours, theirs)
    assert ours[-1] < 0.75 * ours[0], "it must learn the batch"
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed in a skipped step"
    assert (scale, tracker) == (2.0**39, 0.0), "an overflow halves the scale and resets the tracker"


@pytest.mark.parametrize("precision, dtype, tol", [("fp16", torch.float16, 5e-3), ("bf16", torch.bfloat16, 4e-2)])
def test_half_serving_answers_like_model_half(client, precision, dtype, tol):
    torch.manual_seed(1)
    m = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = m(x)
        half = copy.deepcopy(m).to(dtype)(x.to(dtype)).float()
    job = lt.inference_job(client, m, example=x, precision=precision)
    try:
        got = torch.as_tensor(job(x))
    finally:
        job.close()
    assert got.dtype == torch.float32, "outputs come back float32"
    scale = want.abs().max().item()
    ours = (got - want).abs().max().item() / scale
    theirs = (half - want).abs().max().item() / scale
    print(f"resnet18 at {precision}: lanes {ours:.2e}, pytorch .to({dtype}) {theirs:.2e} of the logits' range")
    assert ours <= tol, (ours, theirs)
    assert ours > 0, "half weights must round something"


def test_precisions_that_cannot_work_are_refused(client):
    m = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ce = torch.nn.CrossEntropyLoss()
    with pytest.raises(lanes.ModelError, match="bf16-mixed"):
        lt.training_job(client, m, example=(x, y), loss=ce, optimizer=opt, precision="bf16")
    with pytest.raises(ValueError, match="unknown precision"):
        lt.inference_job(client, m.eval(), example=x, precision="int8")


def _mlp_job(client, scaler, seed=0, lr=0.1):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    job = lt.training_job(client, m, example=(x, y), loss=torch.nn.CrossEntropyLoss(), optimizer=opt,
                          precision="fp16-mixed", scaler=scaler)
    return job, ref, x, y


def test_a_gradscaler_sets_the_loss_scaling(client):
    """A GradScaler(init_scale=2^40) makes the first step overflow: skipped
    (weights unchanged) and the scale halved, as `scaler_state()` reads."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=2)
    job, _, x, y = _mlp_job(client, scaler)
    try:
        assert job.scaler_state() == {"scale": 2.0**40, "growth_tracker": 0}
        before = job.state_dict()
        job.step(x, y)
        after = job.state_dict()
        state = job.scaler_state()
    finally:
        job.close()
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed in a skipped step"
    assert state == {"scale": 2.0**39, "growth_tracker": 0}


def test_growth_interval_doubles_the_scale_after_clean_steps(client):
    """GradScaler's documented rule: each clean step counts; after
    `growth_interval` of them the scale is multiplied by `growth_factor`
    and the count restarts."""
    job, _, x, y = _mlp_job(client, {"init_scale": 16.0, "growth_interval": 2, "growth_factor": 4.0})
    states = []
    try:
        for _ in range(4):
            job.step(x, y)
            states.append(job.scaler_state())
        # Restoring (a checkpoint): the scale and the count come back.
        job.load_scaler_state({"scale": 8.0, "growth_tracker": 1})
        job.step(x, y)
        states.append(job.scaler_state())
    finally:
        job.close()
    assert states == [
        {"scale": 16.0, "growth_tracker": 1},
        {"scale": 64.0, "growth_tracker": 0},
        {"scale": 64.0, "growth_tracker": 1},
        {"scale": 256.0, "growth_tracker": 0},
        {"scale": 32.0, "growth_tracker": 0},
    ]


def test_the_scale_follows_torch_gradscaler_in_eager(client):
    """From 2^40 the scale backs off through skipped steps to one whose fp16
    gradients fit, then grows every 2 clean steps until it overflows again:
    step by step the same scales as `torch.amp.GradScaler` on the same model
    under CPU fp16 autocast (both overflow where a gradient times the scale
    passes fp16's 65504, a threshold that powers of two cross far apart),
    and losses within 1e-2."""
    kw = dict(init_scale=2.0**40, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    job, ref, x, y = _mlp_job(client, torch.amp.GradScaler("cpu", **kw))
    ref_scaler = torch.amp.GradScaler("cpu", **kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ce = torch.nn.CrossEntropyLoss()
    ours, theirs, our_loss, their_loss = [], [], [], []
    try:
        for _ in range(40):
            our_loss.append(job.step(x, y))
            ours.append(job.scaler_state()["scale"])
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                rl = ce(ref(x), y)
            ref_scaler.scale(rl).backward()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            theirs.append(ref_scaler.get_scale())
            their_loss.append(rl.item())
    finally:
        job.close()
    print("scales, lanes:", [int(np.log2(s)) for s in ours], "pytorch:", [int(np.log2(s)) for s in theirs])
    assert ours == theirs
    assert min(ours) < 2.0**30, "it must back off"
    assert any(b > a for a, b in zip(ours, ours[1:])), "and grow again"
    for i, (a, b) in enumerate(zip(our_loss, their_loss)):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (i, our_loss, their_loss)


def test_scaler_settings_that_cannot_work_are_refused(client):
    m = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ce = torch.nn.CrossEntropyLoss()

    def job(**kw):
        return lt.training_job(client, m, example=(x, y), loss=ce, optimizer=opt, **kw)

    with pytest.raises(ValueError, match="fp16-mixed"):
        job(precision="bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="fp16-mixed"):
        job(scaler={"init_scale": 8.0})
    with pytest.raises(ValueError, match="disabled GradScaler"):
        job(precision="fp16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match="no setting"):
        job(precision="fp16-mixed", scaler={"init_scale": 8.0, "growth": 2.0})
    with pytest.raises(ValueError, match="backoff_factor"):
        job(precision="fp16-mixed", scaler={"backoff_factor": 1.5})
    with pytest.raises(ValueError, match="growth_interval"):
        job(precision="fp16-mixed", scaler={"growth_interval": 0})
    with pytest.raises(TypeError, match="GradScaler"):
        job(precision="fp16-mixed", scaler=2.0**16)
    # A disabled scaler with an unscaled precision changes nothing, as in PyTorch.
    with job(precision="bf16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False)) as j:
        assert j.scaler_state() is None
        with pytest.raises(ValueError, match="does not scale"):
            j.load_scaler_state({"scale": 2.0})
    # The loader below refuses the same before it reads the graph.
    with client.session("ls-refusal", kind="training") as s:
        with pytest.raises(ValueError, match="fp16-mixed"):
            s.load_training(lanes.GraphBuilder(), "loss", [], precision="bf16-mixed",
                            loss_scale={"init_scale": 8.0})
        with pytest.raises(ValueError, match="no setting `scale`"):
            s.load_training(lanes.GraphBuilder(), "loss", [], precision="fp16-mixed",
                            loss_scale={"scale": 8.0})

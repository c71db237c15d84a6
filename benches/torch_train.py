#!/usr/bin/env python3
"""Training steps of PyTorch models through Lanes (`lanes.torch.training_job`)
against PyTorch eager on the same GPU, side by side in one run.

For each model: the loss curves of both over --steps steps from the same
initial weights on one fixed batch (dropout off), and the median step time of
each (PyTorch: input resident on the GPU, synchronised per step; Lanes: one
`job.step` from host tensors, the loss back). Prints one JSON object per
model and a summary; needs a `lanes serve` at --endpoint (on the GPU:
`lanes serve --device cuda`).

    python3 benches/torch_train.py --endpoint ipc:///tmp/lanes.sock
    python3 benches/torch_train.py --models resnet50,bert --steps 50 --compile
    python3 benches/torch_train.py --save-jobs /tmp/jobs   # then: lanes bench train --job /tmp/jobs/bert --op-profile
    python3 benches/torch_train.py --precision bf16-mixed  # Lanes bf16-mixed against torch.autocast(bfloat16)

With --precision bf16-mixed, Lanes trains with `precision="bf16-mixed"` and
PyTorch's step runs its forward and loss under
`torch.autocast("cuda", dtype=torch.bfloat16)`.
"""
import contextlib

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import lanes
import lanes.torch as lt


def _ce():
    return torch.nn.CrossEntropyLoss()


def resnet50(small):
    import torchvision

    b, s = (4, 32) if small else (32, 224)
    m = torchvision.models.resnet50(num_classes=1000)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, s, s, generator=g)
    y = torch.randint(0, 1000, (b,), generator=g)
    return m, (x,), y, _ce(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4)


def mobilenet_v3_large(small):
    import torchvision

    b, s = (4, 64) if small else (64, 224)
    m = torchvision.models.mobilenet_v3_large(num_classes=1000, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, s, s, generator=g)
    y = torch.randint(0, 1000, (b,), generator=g)
    return m, (x,), y, _ce(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-5)


def vit_b_16(small):
    import torchvision
    from torchvision.models.vision_transformer import VisionTransformer

    if small:
        m = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                              mlp_dim=64, num_classes=10)
        b, s, c = 4, 32, 10
    else:
        m = torchvision.models.vit_b_16()
        b, s, c = 32, 224, 1000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, s, s, generator=g)
    y = torch.randint(0, c, (b,), generator=g)
    return m, (x,), y, _ce(), lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.05)


def bert(small):
    import transformers

    if small:
        cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, num_labels=2)
        b, s = 4, 16
    else:
        cfg = transformers.BertConfig(num_labels=2)  # bert-base sizes
        b, s = 16, 128
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    cfg._attn_implementation = "eager"
    m = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    y = torch.randint(0, 2, (b,), generator=g)
    return m, (x,), y, _ce(), lambda p: torch.optim.AdamW(p, lr=2e-5, weight_decay=0.01)


def gpt2(small):
    import transformers

    if small:
        cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        b, s = 4, 16
    else:
        cfg = transformers.GPT2Config()  # gpt2 small sizes
        b, s = 8, 512
    cfg.use_cache = False
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    cfg._attn_implementation = "eager"
    m = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    ce = _ce()

    def loss(logits, labels):
        return ce(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return m, (x,), y, loss, lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01)


MODELS = {
    "resnet50": resnet50,
    "mobilenet_v3_large": mobilenet_v3_large,
    "vit_b_16": vit_b_16,
    "bert": bert,
    "gpt2": gpt2,
}


def _logits(o):
    return o if isinstance(o, torch.Tensor) else o.logits


def torch_steps(model, xs, y, loss, make_opt, steps, device, compiled=False, precision="fp32"):
    m = model.to(device).train()
    cast = (torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed"
            else contextlib.nullcontext())
    opt = make_opt(m.parameters())
    xs = tuple(x.to(device) for x in xs)
    y = y.to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with cast:
            out = loss(_logits(m(*xs)), y)
        out.backward()
        opt.step()
        return out

    fn = torch.compile(step) if compiled else step
    losses, times = [], []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(out.item())
    return losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="ipc:///tmp/lanes.sock")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the step")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"),
                    help="both sides: fp32, or bf16 products with f32 weights (torch.autocast)")
    ap.add_argument("--save-jobs", metavar="DIR",
                    help="also save each job in DIR/<model> (profile it with `lanes bench train --job`)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    with lanes.Client(args.endpoint) as client:
        for name in args.models.split(","):
            torch.manual_seed(0)
            model, xs, y, loss, make_opt = MODELS[name](args.small)
            ref = copy.deepcopy(model)
            r = {"model": name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "torch": torch.__version__, "steps": args.steps, "precision": args.precision}
            t0 = time.perf_counter()
            save = f"{args.save_jobs}/{name}" if args.save_jobs else None
            job = lt.training_job(client, model, example=(*xs, y), loss=loss,
                                  optimizer=make_opt(model.parameters()), name=f"bench-{name}", save_to=save,
                                  precision=None if args.precision == "fp32" else args.precision)
            r["load_s"] = round(time.perf_counter() - t0, 2)
            print(f"{name}: loaded in {r['load_s']} s", file=sys.stderr, flush=True)
            ours, ours_t = [], []
            try:
                for _ in range(args.steps):
                    t = time.perf_counter()
                    ours.append(job.step(*xs, y))
                    ours_t.append(time.perf_counter() - t)
            finally:
                job.close()
            theirs, theirs_t = torch_steps(ref, xs, y, loss, make_opt, args.steps, device,
                                           precision=args.precision)
            w = args.warmup
            r["lanes_ms"] = round(1e3 * statistics.median(ours_t[w:]), 2)
            r["torch_eager_ms"] = round(1e3 * statistics.median(theirs_t[w:]), 2)
            r["ratio"] = round(r["lanes_ms"] / r["torch_eager_ms"], 3)
            rel = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, theirs)]
            r["max_rel_loss_diff"] = float(f"{max(rel):.3g}")
            r["loss_first_last"] = {"lanes": [ours[0], ours[-1]], "torch": [theirs[0], theirs[-1]]}
            if args.compile:
                torch.manual_seed(0)
                m2, xs2, y2, loss2, mk2 = MODELS[name](args.small)
                _, ct = torch_steps(m2, xs2, y2, loss2, mk2, args.steps, device, compiled=True,
                                    precision=args.precision)
                r["torch_compile_ms"] = round(1e3 * statistics.median(ct[w:]), 2)
            del ref
            if device == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            results.append(r)
    print(json.dumps({"summary": [{k: r[k] for k in ("model", "lanes_ms", "torch_eager_ms", "ratio", "max_rel_loss_diff")}
                                  for r in results]}), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Entries of a training job's graph against the ways there were before
them, side by side in one run on one service: its evaluation forward
(`training_job(..., eval_example=x)`, `job.evaluate(x)`), and a step at
another batch size (`other_batches=[n]` against `other_batches=True`).

For each model, with a batch of --batch evaluation samples from host memory:
- `evaluate`: `job.evaluate(x)` on the training job's weights in the
  service (the graph's `eval` entry; no copy of the weights);
- `copy_then_infer`: the state copied out (`job.state_dict()`) into the
  model, an inference job captured from it (`inference_job(model.eval())`,
  a second copy of the weights in the service), then one call; reported
  as the copy and capture once, then the call's median;
- `torch_eval`: PyTorch eager `model.eval()` forward on the GPU, input
  copied from host memory, output back.
Also the training job's persistent bytes P with and without the entry and
the inference job's (what a second copy costs).

With --last-batch N, the step at batch N (an epoch's last, smaller batch)
instead: `other_batches=[N]` (the graph's entry `batchN`, nothing copied)
against `other_batches=True` (a second job, the state copied in and back
each step), median step time of each, and PyTorch eager's step at N.
Prints one JSON object per model; needs a `lanes serve` at --endpoint.

    python3 benches/torch_entries.py --endpoint ipc:///tmp/lanes.sock --models resnet50
    python3 benches/torch_entries.py --endpoint ipc:///tmp/lanes.sock --models resnet18_cifar --last-batch 80
"""
import argparse
import copy
import json
import statistics
import time

import torch

import lanes
import lanes.torch as lt
import torch_train  # beside this script


def resnet50(small):
    # benches/torch_train.py's model and batch.
    m, (x,), y, _, _ = torch_train.resnet50(small)
    return m, x, y


def resnet18(small):
    import torchvision

    b, s = (4, 16) if small else (128, 32)
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    g = torch.Generator().manual_seed(0)
    return m, torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)


MODELS = {"resnet50": resnet50, "resnet18_cifar": resnet18}


def _median_ms(f, reps, warmup):
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        f()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _p_of(client, name):
    status = client.status()
    ids = {s["session"]: s["spec"]["name"] for s in status["sessions"]}
    for lane in json.loads(status["lanes_json"])["lanes"]:
        for j in lane["jobs"]:
            if ids.get(j["job"]) == name:
                return j["p"]
    return None


def bench(client, name, small, batch, reps, warmup):
    model, x, y = MODELS[name](small)
    ex = torch.randn(batch, *x.shape[1:])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = torch.nn.CrossEntropyLoss()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
    out = {"model": name, "train_batch": int(x.shape[0]), "eval_batch": batch}
    with lt.training_job(client, model, example=(x, y), loss=loss, optimizer=opt, eval_example=ex,
                         name=f"{name}-eval") as job, \
            lt.training_job(client, twin, example=(x, y), loss=loss, optimizer=twin_opt,
                            name=f"{name}-plain") as plain:
        for _ in range(3):
            job.step(x, y)
            plain.step(x, y)
        out["p_with_entry"] = _p_of(client, f"{name}-eval")
        out["p_without"] = _p_of(client, f"{name}-plain")
        out["evaluate_ms"] = _median_ms(lambda: job.evaluate(ex), reps, warmup)
        t0 = time.perf_counter()
        ref = copy.deepcopy(model)
        ref.load_state_dict(job.state_dict())
        ref.eval()
        with lt.inference_job(client, ref, example=ex, name=f"{name}-infer") as inf:
            out["copy_and_capture_ms"] = (time.perf_counter() - t0) * 1e3
            out["p_inference_copy"] = _p_of(client, f"{name}-infer")
            out["copy_then_infer_call_ms"] = _median_ms(lambda: inf(ex), reps, warmup)
            a, b = job.evaluate(ex), inf(ex)
            out["max_abs_diff_vs_inference_job"] = float((a - b).abs().max())
        if torch.cuda.is_available():
            dev = ref.cuda()

            def torch_eval():
                with torch.no_grad():
                    dev(ex.cuda()).cpu()

            out["torch_eval_ms"] = _median_ms(torch_eval, reps, warmup)
    return out


def bench_last_batch(client, name, small, n, reps, warmup):
    model, x, y = MODELS[name](small)
    reps_ = -(-n // x.shape[0])
    xs, ys = torch.cat([x] * reps_)[:n], torch.cat([y] * reps_)[:n]
    loss = torch.nn.CrossEntropyLoss()
    out = {"model": name, "train_batch": int(x.shape[0]), "last_batch": n}
    twin = copy.deepcopy(model)
    with lt.training_job(client, model, example=(x, y), loss=loss, other_batches=[n], name=f"{name}-declared",
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)) as declared, \
            lt.training_job(client, twin, example=(x, y), loss=loss, other_batches=True, name=f"{name}-copied",
                            optimizer=torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)) as copied:
        out["p_declared"] = _p_of(client, f"{name}-declared")
        out["declared_step_ms"] = _median_ms(lambda: declared.step(xs, ys), reps, warmup)
        out["copied_step_ms"] = _median_ms(lambda: copied.step(xs, ys), reps, warmup)
        out["p_copied_both_jobs"] = (_p_of(client, f"{name}-copied") or 0) + (
            _p_of(client, f"{name}-copied-batch{n}") or 0)
        out["full_batch_step_ms"] = _median_ms(lambda: declared.step(x, y), reps, warmup)
    if torch.cuda.is_available():
        m = copy.deepcopy(model).cuda().train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        xg, yg = xs.cuda(), ys.cuda()

        def torch_step():
            opt.zero_grad()
            loss(m(xg), yg).backward()
            opt.step()
            torch.cuda.synchronize()

        out["torch_eager_step_ms"] = _median_ms(torch_step, reps, warmup)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="ipc:///tmp/lanes.sock")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=32, help="evaluation batch")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--last-batch", type=int, metavar="N", help="time steps at batch N instead (see above)")
    args = ap.parse_args()
    with lanes.Client(args.endpoint) as client:
        for name in args.models.split(","):
            if args.last_batch:
                r = bench_last_batch(client, name, args.small, args.last_batch, args.reps, args.warmup)
            else:
                r = bench(client, name, args.small, args.batch, args.reps, args.warmup)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

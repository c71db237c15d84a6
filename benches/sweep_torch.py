#!/usr/bin/env python3
"""PyTorch twin of `lanes bench sweep`: a hyper-parameter sweep of --jobs
training jobs of the CIFAR ResNet-18 (torchvision resnet18 with a 3x3
stride-1 stem and no max-pool, 10 classes: the zoo's resnet18_cifar),
batch --batch, SGD momentum 0.9 with learning rates geometric from
--lr-min to --lr-max, --steps steps each, inputs resident on the GPU.

--mode together: N processes started at once on one GPU (the GPU
time-slices between their contexts; with --mps under the Multi-Process
Service). --mode sequential: the same jobs one after another in one
process. Each job's completion time is measured from the common start,
model building and moving to the GPU included (as a job submitted to
`lanes serve` loads its graph). Prints one JSON object.
"""
import argparse
import json
import multiprocessing as mp
import subprocess
import time


def job(lr, args, start, out):
    import torch
    import torchvision

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    m = torchvision.models.resnet18(weights=None, num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    m = m.cuda().train()
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(13)
    x = torch.rand(args.batch, 3, 32, 32, generator=g).mul_(2).sub_(1).cuda()
    y = torch.randint(0, 10, (args.batch,), generator=g).cuda()
    loss = None
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
    final = loss.item()
    out.put((lr, time.monotonic() - start, final))


def lrs(args):
    n = args.jobs
    if n == 1:
        return [args.lr_min]
    return [args.lr_min * (args.lr_max / args.lr_min) ** (i / (n - 1)) for i in range(n)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["together", "sequential"], default="together")
    p.add_argument("--mps", action="store_true")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr-min", type=float, default=0.001)
    p.add_argument("--lr-max", type=float, default=0.1)
    args = p.parse_args()
    if args.mps:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
        time.sleep(1)
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        start = time.monotonic()
        results = []
        if args.mode == "together":
            ps = [ctx.Process(target=job, args=(lr, args, start, out)) for lr in lrs(args)]
            for q in ps:
                q.start()
            results = [out.get() for _ in ps]
            for q in ps:
                q.join()
        else:
            for lr in lrs(args):
                q = ctx.Process(target=job, args=(lr, args, start, out))
                q.start()
                results.append(out.get())
                q.join()
    finally:
        if args.mps:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", timeout=30)
    results.sort()
    jcts = [r[1] for r in results]
    print(
        json.dumps(
            {
                "bench": "sweep_torch",
                "mode": args.mode + (" (MPS)" if args.mps else ""),
                "jobs": args.jobs,
                "steps": args.steps,
                "batch": args.batch,
                "makespan_s": max(jcts),
                "mean_jct_s": sum(jcts) / len(jcts),
                "runs": [{"lr": lr, "jct_s": t, "final_loss": l} for lr, t, l in results],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch eager latency of the architectures `lanes bench infer` runs.

Same shapes as src/cli/bench/models.rs: torchvision resnet50 / resnet152 /
inception_v3 (eval, no aux head, no input transform, 299x299) at 224x224, and
transformers BertModel with the bert-base config (no attention mask, pooler
included) at sequence length --seq. FP32 with PyTorch's default precision
settings, printed in the output: cuDNN convolutions may use TF32
(torch.backends.cudnn.allow_tf32 = True), matrix products do not
(torch.backends.cuda.matmul.allow_tf32 = False), cudnn.benchmark = False.

Two timings per model, median over --iters after --warmup:
  host:     input copied host -> GPU, forward, output copied GPU -> host
            (what `lanes bench infer` times through CudaProgram::run);
  resident: input already on the GPU, forward, synchronize.
Prints one JSON object per line.
"""
import argparse
import json
import statistics
import time

import torch


def build(name, seq, bert_attn):
    if name in ("resnet50", "resnet152", "inception_v3"):
        import torchvision

        if name == "inception_v3":
            m = torchvision.models.inception_v3(
                weights=None, aux_logits=False, init_weights=False, transform_input=False
            )
            shape = (3, 299, 299)
        else:
            m = getattr(torchvision.models, name)(weights=None)
            shape = (3, 224, 224)
        return m, lambda b: torch.randn(b, *shape)
    if name == "bert_base":
        from transformers import BertConfig, BertModel

        cfg = BertConfig()
        cfg._attn_implementation = bert_attn
        m = BertModel(cfg, add_pooling_layer=True)
        return m, lambda b: torch.randint(0, cfg.vocab_size, (b, seq))
    raise SystemExit(f"unknown model {name}")


def time_it(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,resnet152,inception_v3,bert_base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bert-attn", default="sdpa", help="sdpa (transformers default) or eager")
    ap.add_argument(
        "--train",
        action="store_true",
        help="time one training step instead (cross-entropy, SGD momentum 0.9)",
    )
    a = ap.parse_args()
    dev = torch.device("cuda")
    settings = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    if a.train:
        for name in a.models.split(","):
            train_step(name, a, settings, dev)
        return
    for name in a.models.split(","):
        model, make = build(name, a.seq, a.bert_attn)
        model = model.eval().to(dev)
        x_host = make(a.batch)
        x_dev = x_host.to(dev)

        def out_of(y):
            if isinstance(y, torch.Tensor):
                return y
            return y.pooler_output

        with torch.inference_mode():
            def resident():
                out_of(model(x_dev))
                torch.cuda.synchronize()

            def host():
                out_of(model(x_host.to(dev))).cpu()

            tr = time_it(resident, a.iters, a.warmup)
            th = time_it(host, a.iters, a.warmup)
        rec = {
            "bench": "infer",
            "impl": "pytorch-eager",
            "model": name,
            "batch": a.batch,
            "seq": a.seq if name == "bert_base" else None,
            "bert_attn": getattr(model.config, "_attn_implementation", None)
            if name == "bert_base"
            else None,
            "iters": a.iters,
            "host_median_ms": statistics.median(th),
            "resident_median_ms": statistics.median(tr),
            "host_min_ms": th[0],
            "resident_min_ms": tr[0],
            **settings,
        }
        print(json.dumps(rec), flush=True)
        del model
        torch.cuda.empty_cache()


def train_step(name, a, settings, dev):
    """One SGD step of an image model: forward in train mode (batch-norm batch
    statistics), cross-entropy, backward, update; input and labels resident."""
    model, make = build(name, a.seq, a.bert_attn)
    model = model.train().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = make(a.batch).to(dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    ts = time_it(step, a.iters, a.warmup)
    print(
        json.dumps(
            {
                "bench": "train",
                "impl": "pytorch-eager",
                "model": name,
                "batch": a.batch,
                "iters": a.iters,
                "median_ms": statistics.median(ts),
                "min_ms": ts[0],
                **settings,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

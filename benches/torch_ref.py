#!/usr/bin/env python3
"""PyTorch eager latency of the architectures `lanes bench infer` runs.

Same shapes as src/cli/bench/models.rs: torchvision resnet50 / resnet152 /
inception_v3 (eval, no aux head, no input transform, 299x299) at 224x224, and
transformers BertModel with the bert-base config (no attention mask, pooler
included) at sequence length --seq. FP32 with PyTorch's default precision
settings, printed in the output: cuDNN convolutions may use TF32
(torch.backends.cudnn.allow_tf32 = True), matrix products do not
(torch.backends.cuda.matmul.allow_tf32 = False, unless --tf32-matmul),
cudnn.benchmark = False.

Two timings per model, median over --iters after --warmup:
  host:     input copied host -> GPU, forward, output copied GPU -> host
            (what `lanes bench infer` times through CudaProgram::run);
  resident: input already on the GPU, forward, synchronize.
With --cuda-graph, a third (what a latency-minded PyTorch user does):
  graph:    torch.cuda.CUDAGraph captured around the forward after three
            warm-up calls on a side stream; each call copies the input from
            pinned host memory into the captured input (non_blocking),
            replays the graph and synchronizes (output left on the GPU).

With --train, one training step instead (what `lanes bench train` times):
forward in train mode (batch-norm batch statistics), loss, backward,
torch.optim.SGD(lr 0.1, momentum 0.9) step, defaults --models resnet50
--batch 32. The losses are those of Lanes' zoo training graphs:
cross-entropy for the image models (Inception-v3 with its auxiliary head,
aux_logits=True, weighted 0.4), MSE of BERT's pooled output against a
random target. Timings:
  host:     input and labels copied host -> GPU, step, loss copied back
            (what `lanes bench train` times through the executor);
  resident: input and labels already on the GPU, step, synchronize.

--precision (as `lanes bench --precision`): fp32 (the default); bf16 or
fp16: the model and its float input converted with `.to(dtype)` (what
`model.half()` users run; inference only); bf16-mixed or fp16-mixed: the
forward (and the loss) under `torch.autocast("cuda", dtype)`, weights f32
(training with fp16-mixed also scales the loss with a GradScaler).

Prints one JSON object per line.
"""
import contextlib
import argparse
import json
import statistics
import time

import torch


def build(name, seq, bert_attn, train=False):
    if name in ("resnet50", "resnet152", "inception_v3"):
        import torchvision

        if name == "inception_v3":
            m = torchvision.models.inception_v3(
                weights=None,
                aux_logits=train,
                init_weights=False,
                transform_input=False,
                # Lanes has no dropout op; its zoo leaves dropout out.
                dropout=0.0,
            )
            shape = (3, 299, 299)
        else:
            m = getattr(torchvision.models, name)(weights=None)
            shape = (3, 224, 224)
        return m, lambda b: torch.randn(b, *shape)
    if name == "bert_base":
        from transformers import BertConfig, BertModel

        cfg = BertConfig()
        if train:
            # Lanes has no dropout op; its zoo leaves dropout out.
            cfg.hidden_dropout_prob = 0.0
            cfg.attention_probs_dropout_prob = 0.0
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
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated; default resnet50,resnet152,inception_v3,bert_base "
        "(with --train: resnet50)",
    )
    ap.add_argument("--batch", type=int, default=None, help="default 8 (with --train: 32)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bert-attn", default="sdpa", help="sdpa (transformers default) or eager")
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time CUDA-graph replay with the input copied from pinned host memory",
    )
    ap.add_argument(
        "--train",
        action="store_true",
        help="time one training step instead (the zoo's loss, SGD lr 0.1 momentum 0.9)",
    )
    ap.add_argument(
        "--tf32-matmul",
        action="store_true",
        help="matrix products on TF32 tensor cores (matmul.allow_tf32 = True), "
        "as `lanes bench --tf32-matmul`",
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="fp32 | bf16-mixed | fp16-mixed (torch.autocast) | bf16 | fp16 (model.to(dtype), inference)",
    )
    a = ap.parse_args()
    if a.train and a.precision in ("bf16", "fp16"):
        ap.error("--precision bf16/fp16 converts the weights: inference only (train with bf16-mixed)")
    if a.models is None:
        a.models = "resnet50" if a.train else "resnet50,resnet152,inception_v3,bert_base"
    if a.batch is None:
        a.batch = 32 if a.train else 8
    if a.batch < 1 or a.iters < 1 or a.warmup < 0 or a.seq < 1:
        ap.error("--batch, --iters and --seq must be positive, --warmup not negative")
    known = ("resnet50", "resnet152", "inception_v3", "bert_base")
    for name in a.models.split(","):
        if name not in known:
            ap.error(f"unknown model {name!r} (one of {', '.join(known)})")
    # PyTorch's defaults, set explicitly so the comparison does not depend on
    # the environment: TF32 for cuDNN convolutions, full FP32 matmul.
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = a.tf32_matmul
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    settings = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "precision": a.precision,
    }
    if a.train:
        for name in a.models.split(","):
            train_step(name, a, settings, dev)
        return
    for name in a.models.split(","):
        model, make = build(name, a.seq, a.bert_attn)
        model = model.eval().to(dev)
        x_host = make(a.batch)
        if a.precision in ("bf16", "fp16"):
            dtype = HALF[a.precision]
            model = model.to(dtype)
            if x_host.is_floating_point():
                x_host = x_host.to(dtype)
        x_dev = x_host.to(dev)

        def out_of(y):
            if isinstance(y, torch.Tensor):
                return y
            return y.pooler_output

        with torch.inference_mode(), autocast(a.precision):
            def resident():
                out_of(model(x_dev))
                torch.cuda.synchronize()

            def host():
                out_of(model(x_host.to(dev))).cpu()

            tr = time_it(resident, a.iters, a.warmup)
            th = time_it(host, a.iters, a.warmup)
            tg = graph_replay(model, out_of, x_host, a) if a.cuda_graph else None
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
        if tg is not None:
            rec["graph_median_ms"] = statistics.median(tg)
            rec["graph_min_ms"] = tg[0]
        print(json.dumps(rec), flush=True)
        del model
        torch.cuda.empty_cache()


PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision):
    """torch.autocast for the mixed precisions, else nothing."""
    if precision.endswith("-mixed"):
        return torch.autocast("cuda", dtype=HALF[precision.split("-")[0]])
    return contextlib.nullcontext()


def graph_replay(model, out_of, x_host, a):
    """Latency of replaying a CUDA graph of the forward, the input copied
    in from pinned host memory each time."""
    pinned = x_host.pin_memory()
    static_x = pinned.to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out_of(model(static_x))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = out_of(model(static_x))
    del static_y

    def replay():
        static_x.copy_(pinned, non_blocking=True)
        graph.replay()
        torch.cuda.synchronize()

    ts = time_it(replay, a.iters, a.warmup)
    del graph
    return ts


def train_step(name, a, settings, dev):
    """One SGD step: forward in train mode (batch-norm batch statistics), the
    zoo's loss, backward, update."""
    model, make = build(name, a.seq, a.bert_attn, train=True)
    model = model.train().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ce = torch.nn.CrossEntropyLoss()
    x_host = make(a.batch)
    if name == "bert_base":
        y_host = torch.rand(a.batch, model.config.hidden_size) * 2 - 1
    else:
        y_host = torch.randint(0, 1000, (a.batch,))
    x_dev, y_dev = x_host.to(dev), y_host.to(dev)

    def loss_of(out, y):
        if name == "bert_base":
            return torch.nn.functional.mse_loss(out.pooler_output, y)
        if name == "inception_v3":
            return ce(out.logits, y) + 0.4 * ce(out.aux_logits, y)
        return ce(out, y)

    scaler = torch.amp.GradScaler("cuda") if a.precision == "fp16-mixed" else None

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast(a.precision):
            loss = loss_of(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    def resident():
        step(x_dev, y_dev)
        torch.cuda.synchronize()

    losses = []

    def host():
        losses.append(step(x_host.to(dev), y_host.to(dev)).item())

    tr = time_it(resident, a.iters, a.warmup)
    th = time_it(host, a.iters, a.warmup)
    print(
        json.dumps(
            {
                "bench": "train",
                "impl": "pytorch-eager",
                "model": name,
                "batch": a.batch,
                "seq": a.seq if name == "bert_base" else None,
                "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
                "iters": a.iters,
                "warmup": a.warmup,
                "host_median_ms": statistics.median(th),
                "resident_median_ms": statistics.median(tr),
                "host_min_ms": th[0],
                "resident_min_ms": tr[0],
                "loss_last": losses[-1],
                **settings,
            }
        ),
        flush=True,
    )
    del model, opt
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

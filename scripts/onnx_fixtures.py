#!/usr/bin/env python3
"""Writes the small ONNX files the ONNX importer's tests use.

Each model is a tiny, randomly initialised version of an architecture users
export from PyTorch (built from torchvision's and transformers' own blocks,
so the exported op patterns are the real ones), exported with
`torch.onnx.export` (TorchScript exporter, opset 17, a dynamic batch axis),
with its input and PyTorch's output saved beside it as `.npy`:

    OUT/NAME.onnx  OUT/NAME.<input>.npy ...  OUT/NAME.<output>.npy ...
    OUT/manifest.json   {name: {"inputs": [...], "outputs": [...], "params": N}}

Needs torch, torchvision, transformers and numpy:
    python3 scripts/onnx_fixtures.py tests/data/onnx
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torchvision
from torchvision.models import densenet, inception, mobilenetv2, resnet, vgg

torch.manual_seed(0)


def tiny_resnet18():
    # torchvision's BasicBlock: conv-bn-relu-conv-bn + identity/downsample.
    down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        resnet.BasicBlock(8, 8),
        resnet.BasicBlock(8, 16, 2, down),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def tiny_resnet50():
    # Bottleneck blocks (1x1-3x3-1x1, expansion 4), like resnet50/152.
    d1 = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
    d2 = nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32))
    return nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        resnet.Bottleneck(8, 4, 1, d1),
        resnet.Bottleneck(16, 4),
        resnet.Bottleneck(16, 8, 2, d2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(32, 10))


class TinyInception(nn.Module):
    # torchvision's InceptionA block (four branches, concatenated) behind a
    # BasicConv2d stem, as inception_v3 has them.
    def __init__(self):
        super().__init__()
        self.stem = inception.BasicConv2d(3, 4, kernel_size=3, stride=2)
        self.mixed = inception.InceptionA(4, pool_features=4)
        self.fc = nn.Linear(64 + 64 + 96 + 4, 10)

    def forward(self, x):
        x = self.mixed(self.stem(x))
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = nn.functional.dropout(x, training=self.training)
        return self.fc(torch.flatten(x, 1))


def tiny_mobilenet_v2():
    # InvertedResidual blocks (expand 1x1, depthwise 3x3, project), ReLU6.
    return nn.Sequential(
        mobilenetv2.Conv2dNormActivation(3, 8, stride=2, activation_layer=nn.ReLU6),
        mobilenetv2.InvertedResidual(8, 8, 1, 1),
        mobilenetv2.InvertedResidual(8, 12, 2, 6),
        mobilenetv2.InvertedResidual(12, 12, 1, 6),
        mobilenetv2.Conv2dNormActivation(12, 32, kernel_size=1, activation_layer=nn.ReLU6),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Dropout(0.2), nn.Linear(32, 10))


def tiny_vgg16():
    return nn.Sequential(
        vgg.make_layers([8, 8, "M", 16, 16, "M"], batch_norm=False),
        nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(1),
        nn.Linear(16 * 4, 32), nn.ReLU(True), nn.Dropout(),
        nn.Linear(32, 32), nn.ReLU(True), nn.Dropout(),
        nn.Linear(32, 10))


def tiny_densenet121():
    return densenet.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                             bn_size=2, num_classes=10)


class TinyBert(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)
        self.bert = BertModel(cfg)

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, out.pooler_output


def randomize_bn(model):
    # Fresh batch-norm statistics are 0/1; give them real values so a wrong
    # folding or epsilon shows in the outputs.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)


def export_with_references(model, inputs, outputs, out, name):
    """Exports `model` (in eval mode) to OUT/NAME.onnx as users do (TorchScript
    exporter, opset 17, a dynamic batch axis on every input and output) and
    saves its inputs and PyTorch's outputs beside it as OUT/NAME.<tensor>.npy.
    Returns the ONNX file's path."""
    args = tuple(inputs.values())
    with torch.no_grad():
        ref = model(*args)
    if not isinstance(ref, tuple):
        ref = (ref,)
    dyn = {k: {0: "batch"} for k in list(inputs) + outputs}
    path = os.path.join(out, f"{name}.onnx")
    kwargs = dict(input_names=list(inputs), output_names=outputs,
                  dynamic_axes=dyn, opset_version=17, do_constant_folding=True)
    try:
        torch.onnx.export(model, args, path, dynamo=False, **kwargs)
    except TypeError:  # torch without the dynamo switch
        torch.onnx.export(model, args, path, **kwargs)
    for k, v in inputs.items():
        np.save(os.path.join(out, f"{name}.{k}.npy"), v.numpy())
    for k, v in zip(outputs, ref):
        np.save(os.path.join(out, f"{name}.{k}.npy"), v.numpy())
    return path


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/onnx"
    os.makedirs(out, exist_ok=True)
    image = torch.randn(2, 3, 32, 32)
    models = {
        "resnet18": (tiny_resnet18(), {"input": image}, ["output"]),
        "resnet50": (tiny_resnet50(), {"input": image}, ["output"]),
        "inception_v3": (TinyInception(), {"input": torch.randn(2, 3, 35, 35)}, ["output"]),
        "mobilenet_v2": (tiny_mobilenet_v2(), {"input": image}, ["output"]),
        "vgg16": (tiny_vgg16(), {"input": image}, ["output"]),
        "densenet121": (tiny_densenet121(), {"input": image}, ["output"]),
    }
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 11:] = 0  # the second sequence is padded
    models["bert"] = (TinyBert(), {"input_ids": ids, "attention_mask": mask},
                      ["last_hidden_state", "pooler_output"])
    manifest = {}
    for name, (model, inputs, outputs) in models.items():
        randomize_bn(model)
        model.eval()
        path = export_with_references(model, inputs, outputs, out, name)
        params = sum(p.numel() for p in model.parameters())
        manifest[name] = {"inputs": list(inputs), "outputs": outputs, "params": params,
                          "bytes": os.path.getsize(path)}
        print(f"{name}: {params} parameters, {os.path.getsize(path)} bytes", flush=True)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"torch": torch.__version__, "torchvision": torchvision.__version__,
                   "opset": 17, "models": manifest}, f, indent=1)


if __name__ == "__main__":
    main()

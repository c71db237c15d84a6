#!/usr/bin/env python3
"""Exports full-size models (random weights, no downloads) the way users do,
with references at batch 2 in the layout `lanes import --check` reads:

    OUT/NAME.onnx  OUT/NAME.<input>.npy ...  OUT/NAME.<output>.npy ...

Models: torchvision resnet50, resnet152, inception_v3, mobilenet_v2, vgg16,
densenet121 (224x224; inception 299x299) and Hugging Face bert-base-uncased's
architecture (BertConfig() defaults, sequence 128, second sequence padded).
For the GPU machine (needs torch, torchvision, transformers, numpy):

    python3 scripts/onnx_export_full.py /tmp/onnx-full [NAME ...]
    lanes import /tmp/onnx-full/resnet50.onnx --batch 2 --check /tmp/onnx-full

Written without torch at hand: the tiny fixtures (scripts/onnx_fixtures.py)
are what the tests check; this script reuses their export settings.
"""
import os
import sys

import torch
import torchvision

from onnx_fixtures import export_with_references  # same folder: one export recipe


class Bert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel
        self.bert = BertModel(BertConfig())

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, out.pooler_output


def models():
    tv = torchvision.models
    image = torch.randn(2, 3, 224, 224)
    yield "resnet50", lambda: tv.resnet50(weights=None), {"input": image}, ["output"]
    yield "resnet152", lambda: tv.resnet152(weights=None), {"input": image}, ["output"]
    yield ("inception_v3", lambda: tv.inception_v3(weights=None, aux_logits=False, init_weights=True),
           {"input": torch.randn(2, 3, 299, 299)}, ["output"])
    yield "mobilenet_v2", lambda: tv.mobilenet_v2(weights=None), {"input": image}, ["output"]
    yield "vgg16", lambda: tv.vgg16(weights=None), {"input": image}, ["output"]
    yield "densenet121", lambda: tv.densenet121(weights=None), {"input": image}, ["output"]
    ids = torch.randint(0, 30522, (2, 128))
    mask = torch.ones(2, 128, dtype=torch.int64)
    mask[1, 100:] = 0
    yield ("bert_base", Bert, {"input_ids": ids, "attention_mask": mask},
           ["last_hidden_state", "pooler_output"])


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "onnx-full"
    only = set(sys.argv[2:])
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    for name, build, inputs, outputs in models():
        if only and name not in only:
            continue
        model = build().eval()
        path = export_with_references(model, inputs, outputs, out, name)
        print(f"{name}: {os.path.getsize(path)} bytes", flush=True)


if __name__ == "__main__":
    main()

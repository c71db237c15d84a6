"""Python client of Lanes: run PyTorch, ONNX and zoo models on a shared ``lanes serve``.

    import numpy as np, lanes
    with lanes.Client("tcp://127.0.0.1:5555") as client:
        with client.session("resnet50", kind="inference") as s:
            s.load_onnx("resnet50.onnx", batch=8)
            out = s.run({"input": np.zeros((8, 3, 224, 224), np.float32)})

PyTorch models (training and inference, captured with torch.export):
``lanes.torch`` (imported on its own, as it needs torch). See docs/python.md
and docs/torch.md in the repository.
"""

from ._lanes import (
    PROTOCOL_VERSION,
    ZOO_MODELS,
    Adam,
    AdamW,
    Buffers,
    Client,
    FeedError,
    GraphBuilder,
    LanesError,
    LanesTimeoutError,
    ModelError,
    NoServiceError,
    RunHandle,
    SGD,
    ServiceGoneError,
    Session,
    SessionClosedError,
    __version__,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ZOO_MODELS",
    "Adam",
    "AdamW",
    "Buffers",
    "Client",
    "FeedError",
    "GraphBuilder",
    "LanesError",
    "LanesTimeoutError",
    "ModelError",
    "NoServiceError",
    "RunHandle",
    "SGD",
    "ServiceGoneError",
    "Session",
    "SessionClosedError",
    "__version__",
]

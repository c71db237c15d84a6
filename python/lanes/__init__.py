"""Python client of Lanes: run ONNX and zoo models on a shared ``lanes serve``.

    import numpy as np, lanes
    with lanes.Client("tcp://127.0.0.1:5555") as client:
        with client.session("resnet50", kind="inference") as s:
            s.load_onnx("resnet50.onnx", batch=8)
            out = s.run({"input": np.zeros((8, 3, 224, 224), np.float32)})

See docs/python.md in the repository.
"""

from ._lanes import (
    PROTOCOL_VERSION,
    ZOO_MODELS,
    Adam,
    AdamW,
    Client,
    FeedError,
    LanesError,
    LanesTimeoutError,
    ModelError,
    NoServiceError,
    RunHandle,
    SGD,
    Session,
    SessionClosedError,
    __version__,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ZOO_MODELS",
    "Adam",
    "AdamW",
    "Client",
    "FeedError",
    "LanesError",
    "LanesTimeoutError",
    "ModelError",
    "NoServiceError",
    "RunHandle",
    "SGD",
    "Session",
    "SessionClosedError",
    "__version__",
]

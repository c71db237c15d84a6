"""Type stubs of the native module ``lanes._lanes`` (see docs/python.md)."""

from os import PathLike
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

__version__: str
PROTOCOL_VERSION: int
ZOO_MODELS: List[str]

Array = npt.NDArray[Any]
Feeds = Mapping[str, npt.NDArray[Any]]

class LanesError(Exception):
    code: Optional[int]
    code_name: Optional[str]

class NoServiceError(LanesError): ...
class LanesTimeoutError(LanesError): ...
class SessionClosedError(LanesError): ...
class ServiceGoneError(LanesError): ...
class ModelError(LanesError): ...
class FeedError(LanesError): ...

class SGD:
    def __init__(
        self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
    ) -> None: ...

class Adam:
    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None: ...

class AdamW:
    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None: ...

Outlet = Tuple[int, int]

class GraphBuilder:
    def __init__(self) -> None: ...
    # dtype: "float32", "float16", "bfloat16" (ml_dtypes' for arrays) or "int64".
    @staticmethod
    def takes_half(op: str) -> bool: ...
    def placeholder(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Outlet: ...
    def variable(self, name: str, value: Array) -> Outlet: ...
    def constant(self, value: Array) -> Outlet: ...
    def op(self, op: str, inputs: Sequence[Outlet], name: Optional[str] = None) -> List[Outlet]: ...
    def set_name(self, outlet_: Outlet, name: str) -> None: ...
    def name_of(self, outlet_: Outlet) -> str: ...
    def type_of(self, outlet_: Outlet) -> Tuple[List[int], str]: ...
    def __len__(self) -> int: ...

class RunHandle:
    @property
    def done(self) -> bool: ...

class Session:
    @property
    def name(self) -> str: ...
    @property
    def id(self) -> int: ...
    @property
    def inputs(self) -> List[Tuple[str, List[int], str]]: ...
    @property
    def outputs(self) -> List[str]: ...
    @property
    def closed(self) -> bool: ...
    def load_onnx(
        self,
        path: Union[str, "PathLike[str]"],
        batch: int = 1,
        dims: Optional[Mapping[str, int]] = None,
        precision: Optional[str] = None,
    ) -> None: ...
    def load_zoo(
        self,
        name: str,
        batch: int = 1,
        optimizer: Optional[Union[SGD, Adam, AdamW]] = None,
        seed: int = 0,
        **params: Any,
    ) -> None: ...
    def load_graph(
        self,
        builder: GraphBuilder,
        outputs: Sequence[str],
        save_to: Optional[Union[str, "PathLike[str]"]] = None,
        example: Optional[Feeds] = None,
        precision: Optional[str] = None,
    ) -> None: ...
    def load_training(
        self,
        builder: GraphBuilder,
        loss: str,
        groups: Sequence[Tuple[Sequence[str], Union[SGD, Adam, AdamW]]],
        max_grad_norm: Optional[float] = None,
        outputs: Optional[Sequence[str]] = None,
        save_to: Optional[Union[str, "PathLike[str]"]] = None,
        example: Optional[Feeds] = None,
        precision: Optional[str] = None,
        loss_scale: Optional[Dict[str, float]] = None,
    ) -> Tuple[List[str], List[str]]: ...
    @overload
    def run(self, feeds: Feeds, fetch: None = None) -> Dict[str, Array]: ...
    @overload
    def run(self, feeds: Feeds, fetch: str) -> Array: ...
    @overload
    def run(self, feeds: Feeds, fetch: Sequence[str]) -> List[Array]: ...
    def submit_run(
        self, feeds: Feeds, fetch: Optional[Union[str, Sequence[str]]] = None
    ) -> RunHandle: ...
    def wait(self, handle: RunHandle) -> Any: ...
    def read_variables(self, names: Optional[Sequence[str]] = None) -> Dict[str, Array]: ...
    def write_variables(self, values: Feeds) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Session": ...
    def __exit__(self, ty: Any, value: Any, tb: Any) -> bool: ...

class Client:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        name: Optional[str] = None,
        shared_memory: bool = True,
        busy_poll: float = 0.0,
        adaptive_wait: bool = True,
    ) -> None: ...
    @staticmethod
    def connect_best(
        endpoints: Optional[Sequence[str]] = None,
        *,
        directory: Optional[Union[str, "PathLike[str]"]] = None,
        persistent: Optional[int] = None,
        ephemeral: Optional[int] = None,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        name: Optional[str] = None,
    ) -> "Client": ...
    @property
    def endpoint(self) -> str: ...
    def session(
        self,
        name: str,
        kind: str = "inference",
        priority: int = 0,
        expected_iterations: Optional[int] = None,
        slo_ms: Optional[float] = None,
    ) -> Session: ...
    def status(self) -> Dict[str, Any]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, ty: Any, value: Any, tb: Any) -> bool: ...

"""``WeightTransferEngineFactory``: the backend registry, with vLLM's error semantics (vLLM 0.32
``distributed/weight_transfer/factory.py:29-121``).

- ``register_engine(name, module_path_or_cls, class_name=None)`` raises ``ValueError`` on a duplicate name
  or a module path without a class name.
- ``create_engine(backend, parallel)`` raises ``ValueError`` for an unknown backend, listing known names.
- The built-ins ``nccl`` (broadcast; gloo on CPU) and ``ipc`` are imported lazily, on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.impl.transfer.base import ParallelInfo, WeightTransferEngine

_Loader = Callable[[], type[WeightTransferEngine]]


def _lazy(module: str, cls: str) -> _Loader:
    def load() -> type[WeightTransferEngine]:
        obj = getattr(importlib.import_module(module), cls)
        if not (isinstance(obj, type) and issubclass(obj, WeightTransferEngine)):
            raise ValueError(f"{module}.{cls} is not a WeightTransferEngine subclass")
        return obj

    return load


class WeightTransferEngineFactory:
    """Registry of weight-transfer backends (class-level, like vLLM's)."""

    _registry: dict[str, _Loader] = {}  # noqa: RUF012 - the registry is deliberately class-level

    @classmethod
    def register_engine(
        cls, name: str, module_path_or_cls: str | type[WeightTransferEngine], class_name: str | None = None
    ) -> None:
        """Register backend ``name``: a class, or a module path plus ``class_name`` (imported lazily).

        Raises:
            ValueError: ``name`` is already registered (listing what exists), or a module path was given
                without ``class_name``, or a class that is not a WeightTransferEngine.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty str, got {name!r}")
        if name in cls._registry:
            raise ValueError(
                f"weight transfer engine {name!r} is already registered; registered: {', '.join(cls.names())}"
            )
        if isinstance(module_path_or_cls, str):
            if not class_name:
                raise ValueError(
                    f"register_engine({name!r}, {module_path_or_cls!r}): class_name is required with a module path"
                )
            cls._registry[name] = _lazy(module_path_or_cls, class_name)
            return
        if not (
            isinstance(module_path_or_cls, type) and issubclass(module_path_or_cls, WeightTransferEngine)
        ):
            raise ValueError(
                f"register_engine({name!r}, ...): {module_path_or_cls!r} is not a WeightTransferEngine"
            )
        engine_cls = module_path_or_cls
        cls._registry[name] = lambda: engine_cls

    @classmethod
    def unregister_engine(cls, name: str) -> None:
        """Remove ``name`` (for tests). Raises ValueError if it is not registered."""
        if name not in cls._registry:
            raise ValueError(
                f"weight transfer engine {name!r} is not registered; registered: {', '.join(cls.names())}"
            )
        del cls._registry[name]

    @classmethod
    def names(cls) -> list[str]:
        """Registered backend names, sorted."""
        return sorted(cls._registry)

    @classmethod
    def engine_class(cls, backend: str) -> type[WeightTransferEngine]:
        """The class of ``backend`` (importing it on first use).

        Raises:
            ValueError: unknown backend, listing the known names.
        """
        loader = cls._registry.get(backend) if isinstance(backend, str) else None
        if loader is None:
            raise ValueError(
                f"unknown weight transfer backend {backend!r}; known backends: {', '.join(cls.names())}"
            )
        return loader()

    @classmethod
    def create_engine(
        cls, config: str | Mapping[str, Any], parallel: ParallelInfo | None = None, **kwargs: Any
    ) -> WeightTransferEngine:
        """Create an engine for ``config`` (a backend name, or a ``WeightTransferConfig``-like dict with
        ``backend``; vLLM's default backend is ``"nccl"``).

        Raises:
            ValueError: unknown backend (listing the known names) or a malformed config.
        """
        backend = config.get("backend", "nccl") if isinstance(config, Mapping) else config
        if not isinstance(backend, str):
            raise ValueError(f"weight transfer backend must be a str, got {type(backend).__name__}")
        return cls.engine_class(backend)(parallel, **kwargs)


WeightTransferEngineFactory.register_engine(
    "nccl", "weightsync.impl.transfer.broadcast", "BroadcastWeightTransferEngine"
)
WeightTransferEngineFactory.register_engine("ipc", "weightsync.impl.transfer.ipc", "IPCWeightTransferEngine")

__all__ = ["WeightTransferEngineFactory"]

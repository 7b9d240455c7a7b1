"""Classes that subclass vLLM's, built on first use so that importing rl_specdec does not import vLLM.

vLLM (and pickle, in the engine-core process) finds such a class by its
qualified name: ``importlib`` on the module, then ``getattr``. A module that
defines one sets ``__getattr__ = lazy_classes(__name__, globals(), {name: factory})``.
"""

from __future__ import annotations

from typing import Any, Callable


def lazy_classes(module: str, namespace: dict[str, Any], factories: dict[str, Callable[[], type]]):
    """A module ``__getattr__`` that builds ``factories[name]()`` once, names it ``module.name`` and caches it."""

    def __getattr__(name: str):
        if name not in factories:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        cls = factories[name]()
        cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
        namespace[name] = cls
        return cls

    return __getattr__

"""Import SGLang's CPU-safe modules (config parsing, model classes) inside tests.

SGLang 0.5.23 is installed with --no-deps beside the CPU torch wheel. `sglang.srt.configs`
imports torchvision at module level, and PyPI's torchvision cannot import beside this
torch. `import_sglang` therefore:
1. lets transformers decide (and cache) that torchvision is NOT available, so none of its
   own code tries to use the stand-in below;
2. registers an inert `torchvision` module tree: any `torchvision.*` submodule imports as
   an empty package whose unknown attributes are placeholder classes, plus a real
   `InterpolationMode` enum (used in SGLang's module-level defaults);
3. imports the requested SGLang module.
Besides the `sglang` extra of pyproject.toml, `import sglang` needs `triton`,
`apache-tvm-ffi==0.1.11` and `compressed-tensors==0.18.0`; `SglangUnavailable` says which
import failed.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types


class SglangUnavailable(ImportError):
    """SGLang (or one of its light dependencies) cannot be imported here."""


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        module.InterpolationMode = InterpolationMode
        return module

    def exec_module(self, module) -> None:
        return None


def import_sglang(name: str) -> types.ModuleType:
    """Import `sglang...` module `name`; raise SglangUnavailable when that cannot work here."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stand-in exists
    if not any(isinstance(f, _InertTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _InertTorchvision())
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise SglangUnavailable(f"cannot import {name}: {e}") from e

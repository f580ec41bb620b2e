"""Import SGLang's CPU-safe modules (config parsing, model classes) inside tests.

SGLang 0.5.23 is installed with --no-deps beside the CPU torch wheel. `sglang.srt.configs`
imports torchvision at module level, and PyPI's torchvision cannot import beside this
torch. `import_sglang` therefore:
1. lets transformers decide (and cache) that torchvision is NOT available, so none of its
   own code tries to use the stand-in below;
2. registers an inert `torchvision` (tests/inert_torchvision.py; SGLang's own venv, where its
   servers run, has the real one): any
   `torchvision.*` submodule imports as an empty package whose unknown attributes are
   placeholder classes, plus a real `InterpolationMode` enum (used in SGLang's defaults);
3. imports the requested SGLang module.
Besides the `sglang` extra of pyproject.toml, `import sglang` needs `triton`,
`apache-tvm-ffi==0.1.11` and `compressed-tensors==0.18.0`; `SglangUnavailable` says which
import failed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

INERT_TORCHVISION = Path(__file__).with_name("inert_torchvision.py")


class SglangUnavailable(ImportError):
    """SGLang (or one of its light dependencies) cannot be imported here."""


def _install_inert_torchvision() -> None:
    """tests/inert_torchvision.py, loaded under the name `torchvision`."""
    if "torchvision" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "torchvision", INERT_TORCHVISION, submodule_search_locations=[]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchvision"] = module
    spec.loader.exec_module(module)


def import_sglang(name: str) -> types.ModuleType:
    """Import `sglang...` module `name`; raise SglangUnavailable when that cannot work here."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stand-in exists
    _install_inert_torchvision()
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise SglangUnavailable(f"cannot import {name}: {e}") from e

"""Import SGLang's CPU-safe modules (config parsing, model classes) inside tests.

SGLang 0.5.23 is installed with --no-deps beside the CPU torch wheel. `sglang.srt.configs`
imports torchvision at module level, and PyPI's torchvision cannot import beside this
torch. `import_sglang` therefore:
1. lets transformers decide (and cache) that torchvision is NOT available, so none of its
   own code tries to use the stand-in below;
2. registers the inert `torchvision` of the CPU-engine servers (engines/cpu_shims/): any
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

from specforge_dspark.engines.sglang import CPU_SHIMS


class SglangUnavailable(ImportError):
    """SGLang (or one of its light dependencies) cannot be imported here."""


def _install_inert_torchvision() -> None:
    """The CPU-engine server's inert torchvision (engines/cpu_shims/torchvision), loaded
    under its own name; the shim folder is not put on sys.path, so this process does
    not see the server's sgl_kernel stand-in."""
    if "torchvision" in sys.modules:
        return
    init = CPU_SHIMS / "torchvision" / "__init__.py"
    spec = importlib.util.spec_from_file_location("torchvision", init)
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

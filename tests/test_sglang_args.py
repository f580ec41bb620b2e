"""Our SGLang launch arguments and plugin hooks against the installed sglang==0.5.23 (CPU).

Imports sglang through tests/sglang_shim.py (an inert torchvision); slow to import, so
everything that needs sglang itself lives in this one module.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, load_recipe
from specforge_dspark.engines import sglang_plugin as plugin
from specforge_dspark.engines.sglang import launch_args, request_body
from specforge_dspark.transport.shm import DTYPE_CODES, ShmSlot
from specforge_dspark.transport.tickets import DONE, Ticket
from tests.sglang_shim import import_sglang

import_sglang("sglang.srt.server_args")  # make setup installs sglang: missing or broken fails


def validate_launch_args(args: list[str]) -> Any:
    """Run SGLang's own argument parsing and its model-independent resolution hooks
    (`prepare_server_args` + `ServerArgs.resolve_once`, which includes
    `handle_aux_hidden_state_capture`) on `args`; returns the resolved view. The model
    path is swapped for "dummy" so that the checks run without the weights (the server
    repeats all of them, model-dependent ones included, when it starts)."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    argv = list(args)
    argv[argv.index("--model-path") + 1] = "dummy"
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return resolved_view(server_args)


@pytest.fixture(scope="module")
def production(repo):
    return load_recipe(repo / "recipes" / "inkling_nvfp4.yaml")


def test_production_launch_args_pass_sglang_validation(production):
    cfg = validate_launch_args(launch_args(production))
    assert cfg.enable_return_aux_hidden_states is True
    assert cfg.aux_hidden_state_capture == "dspark"  # the capture convention...
    assert cfg.speculative_algorithm is None  # ...and no draft is loaded
    assert list(cfg.return_aux_hidden_state_layer_ids) == [5, 17, 35, 47, 59]
    assert cfg.return_hidden_states_mode == "full"
    # SGLang's Inkling asserts the radix cache on (models/inkling.py ~975): our plugin
    # keeps feature requests off it (sglang_plugin.max_prefix_len)
    assert cfg.disable_radix_cache is False and cfg.tp_size == 8
    assert cfg.quantization == "modelopt_fp4" and cfg.mem_fraction_static == 0.55


def test_repeated_aux_layer_is_refused(repo, production):
    with pytest.raises(RecipeError, match=r"target_layer_ids repeats layer\(s\) \[47\]"):
        load_recipe(
            repo / "recipes" / "inkling_nvfp4.yaml", ["draft.target_layer_ids=[5, 17, 35, 47, 47]"]
        )
    args = launch_args(production)  # and sglang's own check, should ours be bypassed
    i = args.index("--return-aux-hidden-state-layer-ids")
    args[i + 1 : i + 6] = ["5", "17", "35", "47", "47"]
    with pytest.raises(ValueError, match="must not repeat a layer"):
        validate_launch_args(args)


def test_unknown_server_arg_is_refused_by_sglang(production):
    production.target.sglang.server_args["no_such_option"] = 1
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        validate_launch_args(launch_args(production))


def test_request_body_meets_sglang_generate_contract():
    from sglang.api.v1.api_types import GenerateRequest

    req = GenerateRequest.from_json_value(request_body(["a", "b"], [[1, 2], [3]]))
    assert req.return_hidden_states is True and req.sampling_params.max_new_tokens == 1


def test_hooked_sglang_code_has_the_expected_signatures():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.runtime_context import _parallel_fields

    owner, name = plugin.APPEND_PREFILL.rsplit(".", 1)
    target = getattr(pkgutil.resolve_name(owner), name)
    params = inspect.signature(target).parameters
    assert tuple(params) == plugin.APPEND_PREFILL_PARAMS
    assert all(
        params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in plugin.APPEND_PREFILL_PARAMS[1:]
    )
    assert params["store"].default is True
    fields = {f.name for f in dataclasses.fields(LogitsProcessorOutput)}
    assert {"hidden_states", "last_hidden_states"} <= fields
    assert callable(CaptureHiddenMode.FULL.is_full) and callable(CaptureHiddenMode.LAST.is_last)
    assert "attn_tp_rank" in _parallel_fields()
    init = inspect.getsource(Req.__init__)
    assert "self.rid = rid" in init and "self.inflight_middle_chunks = 0" in init
    register = list(inspect.signature(HookRegistry.register).parameters)  # a classmethod
    assert register[:3] == ["target", "hook", "hook_type"]
    assert HookType.AROUND.value == "around" and GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"


def test_registered_hook_wraps_the_real_method(monkeypatch):
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as Processor,
    )
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    original = Processor.__dict__["_append_prefill_hidden_states"]
    HookRegistry.reset()
    monkeypatch.setattr(plugin, "_in_sglang", False)  # register() sets it; restored after
    plugin.register()
    HookRegistry.apply_hooks()
    slot = ShmSlot("hooktest", aux_width=6, hidden=2, dtype=torch.float32)
    # the ranks a one-GPU server publishes (this process publishes none)
    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0):
        try:
            assert Processor._append_prefill_hidden_states.__wrapped__ is original
            out = SimpleNamespace(
                hidden_states=torch.arange(30.0).view(5, 6), last_hidden_states=-torch.ones(5, 2)
            )
            theirs = SimpleNamespace(rid="user", return_hidden_states=True, hidden_states=[])
            end = Processor._append_prefill_hidden_states(
                None,
                req=theirs,
                logits_output=out,
                hidden_state_offset=0,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                extend_input_len=2,
            )
            assert end == 2 and theirs.hidden_states == [out.hidden_states[:2].tolist()]

            views = slot.prepare([3])
            lay = slot.layout
            code = DTYPE_CODES[torch.float32]
            slot.write_ticket(0, Ticket(0, 3, 0, lay.aux_off, lay.last_off, 6, 2, code, nonce=1))
            ours = SimpleNamespace(rid=plugin.make_rid(1, 0, str(slot.path)), hidden_states=[])
            end = Processor._append_prefill_hidden_states(
                None,
                req=ours,
                logits_output=out,
                hidden_state_offset=2,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                extend_input_len=3,
            )
            assert end == 5 and ours.hidden_states == []  # no JSON lists for ours
            assert slot.read_ticket(0).status == DONE
            assert torch.equal(views.aux, out.hidden_states[2:5])
            assert torch.equal(views.last, out.last_hidden_states[2:5])
        finally:
            Processor._append_prefill_hidden_states = original
            HookRegistry.reset()
            slot.close()

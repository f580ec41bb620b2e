"""Checkpoint bookkeeping: completeness, keep-last-k, resume selection, refusals."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.training import checkpoint as ck
from specforge_dspark.training import fingerprint


def _fake(root, step, complete=True):
    p = ck.step_dir(root, step)
    p.mkdir(parents=True)
    (p / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (p / ck.MARKER).write_text("")
    return p


def test_latest_complete_skips_partial_saves(tmp_path):
    _fake(tmp_path, 10)
    _fake(tmp_path, 20)
    _fake(tmp_path, 30, complete=False)  # killed while saving
    assert ck.latest_complete(tmp_path) == ck.step_dir(tmp_path, 20)
    assert ck.resolve_resume("auto", tmp_path) == ck.step_dir(tmp_path, 20)
    assert ck.resolve_resume("none", tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path / "nothing") is None
    with pytest.raises(ck.ResumeError, match="incomplete"):
        ck.resolve_resume(str(ck.step_dir(tmp_path, 30)), tmp_path)
    with pytest.raises(ck.ResumeError, match="no such checkpoint"):
        ck.resolve_resume(str(tmp_path / "step-99"), tmp_path)


def test_prune_keeps_last_k_complete(tmp_path):
    for s in (1, 2, 3, 4):
        _fake(tmp_path, s)
    _fake(tmp_path, 5, complete=False)  # newer than all: a save in progress, kept
    _fake(tmp_path, 0, complete=False)  # stale partial, dropped
    ck.prune(tmp_path, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4, 5]


def _meta(recipe, world=2, version=ck.FORMAT_VERSION):
    return {"format_version": version, "world_size": world, "recipe": recipe.to_dict()}


def test_compatible_resume_allows_logging_and_path_changes(tmp_path):
    a = recipe_from_dict({})
    b = recipe_from_dict(
        {
            "train": {"log_interval": 3},
            "checkpoint": {"keep_last": 9},
            "target": {"prefetch": 5},
            "tracking": {"run_name": "x"},
        }
    )
    ck.check_compatible(_meta(a), b, 2, tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"objective": {"num_anchors": 7}}, "objective.num_anchors: 512 -> 7"),
        ({"optim": {"lr": 1e-3}}, "optim.lr"),
        ({"draft": {"block_size": 4}}, "draft.block_size"),
        ({"train": {"seed": 3}}, "train.seed"),
        ({"train": {"max_steps": 5}}, "train.max_steps"),
        ({"data": {"max_length": 100}}, "data.max_length"),
        ({"data": {"pack": True}}, "data.pack: False -> True"),
    ],
)
def test_resume_refuses_training_changes_naming_the_field(tmp_path, change, field):
    saved = recipe_from_dict({})
    with pytest.raises(ck.ResumeError) as e:
        ck.check_compatible(_meta(saved), recipe_from_dict(change), 2, tmp_path)
    assert field in str(e.value)


def test_a_checkpoint_older_than_a_recipe_key_resumes_at_its_default(tmp_path):
    meta = _meta(recipe_from_dict({}))
    del meta["recipe"]["data"]["pack"]  # saved before data.pack existed: it did not pack
    ck.check_compatible(meta, recipe_from_dict({}), 2, tmp_path)
    with pytest.raises(ck.ResumeError, match="data.pack: None -> True"):
        ck.check_compatible(meta, recipe_from_dict({"data": {"pack": True}}), 2, tmp_path)


def test_resume_refuses_other_world_size_and_format(tmp_path):
    r = recipe_from_dict({})
    with pytest.raises(ck.ResumeError, match="world_size 2, resuming with 4"):
        ck.check_compatible(_meta(r, world=2), r, 4, tmp_path)
    with pytest.raises(ck.ResumeError, match="format_version 0"):
        ck.check_compatible(_meta(r, version=0), r, 2, tmp_path)


def test_rng_state_round_trip():
    import random

    import numpy as np
    import torch

    s = ck.rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    ck.set_rng_state(s)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2]


class _OneGPU:
    """torch.cuda as a host with `visible` GPUs shows it: set_rng_state refuses a device
    that is not there, as CUDA does (issue 34: a checkpoint from 8 GPUs, 1 visible)."""

    def __init__(self, visible: int, current: int):
        self.visible, self.current, self.restored = visible, current, []

    def is_available(self):
        return True

    def device_count(self):
        return self.visible

    def current_device(self):
        return self.current

    def get_rng_state(self):
        return torch_mod().full((4,), self.current, dtype=torch_mod().uint8)

    def set_rng_state(self, state, device=None):
        device = self.current if device is None else device
        if not 0 <= device < self.visible:
            raise RuntimeError(f"invalid device ordinal {device}")
        self.restored.append((device, state.clone()))

    def set_rng_state_all(self, states):  # what checkpoints used to restore with
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def torch_mod():
    import torch

    return torch


@pytest.mark.parametrize("current", [0, 3])
def test_cuda_rng_of_eight_devices_resumes_where_fewer_are_visible(monkeypatch, current):
    """Rank files of format 2 before the fix hold one CUDA state per device then visible
    (8): the restore takes this rank's own device's entry and touches no other device."""
    torch = torch_mod()
    fake = _OneGPU(visible=1 if current == 0 else 4, current=current)
    monkeypatch.setattr(torch, "cuda", fake)
    saved = [torch.full((4,), d, dtype=torch.uint8) for d in range(8)]  # 8 devices' states
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        fake.set_rng_state_all(saved)  # the old restore path: fails with fewer visible
    fake.restored.clear()
    ck.restore_cuda_rng(saved)
    assert [(d, int(s[0])) for d, s in fake.restored] == [(current, current)]
    # a new rank file holds only its own device's state, and round-trips
    state = ck.rng_state()["cuda"]
    fake.restored.clear()
    ck.restore_cuda_rng(state)
    assert [(d, int(s[0])) for d, s in fake.restored] == [(current, current)]


# --------------------------------------------------------------------------- fingerprint


@pytest.fixture
def setup(tmp_path, tiny_target_dir):
    """A copy of the tiny target and a small train file: (target dir, train file)."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    train = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i}+{i}?", "answer": f"It is {2 * i}."} for i in range(6)]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, train


def _recipe(setup, **target):
    path, train = setup
    data = {"train_files": [str(train)], "cache_dir": str(path.parent / "cache"), "max_length": 64}
    return recipe_from_dict({"target": {"path": str(path), **target}, "data": data})


def _fingerprint(recipe):
    from data_pipelines.prepare import prepare_dataset

    dataset = prepare_dataset(recipe, split="train", progress=False)
    return {
        "features": fingerprint.features_fingerprint(recipe),
        "data": fingerprint.data_fingerprint(dataset),
    }


def _saved(tmp_path, recipe):
    """A checkpoint saved by `ck.save` (its train_state.json as written) for `recipe`."""

    def save_checkpoint(root, tag, save_latest):  # DeepSpeed's files: not needed here
        Path(root, tag).mkdir(parents=True)

    engine = types.SimpleNamespace(save_checkpoint=save_checkpoint)
    state = ck.TrainState(step=3)
    return ck.save(engine, tmp_path / "ckpt", state, recipe, 2, _fingerprint(recipe))


def _refusal(path, recipe) -> str:
    with pytest.raises(ck.ResumeError) as e:
        ck.check_saved(path, recipe, 1, _fingerprint(recipe))
    return str(e.value)


def test_unchanged_target_and_data_resume_also_on_another_backend(tmp_path, setup):
    recipe = _recipe(setup)
    path = _saved(tmp_path, recipe)
    features = json.loads((path / "train_state.json").read_text())["fingerprint"]["features"]
    assert features["target_weights"].keys() == {"model.safetensors"}
    assert features["dtype"] == "float32" and features["tap_convention"]
    ck.check_saved(path, recipe, 1, _fingerprint(recipe))
    # the hf and sglang backends serve the same features: a resume may switch between them
    sglang = _recipe(setup, backend="sglang")
    ck.check_saved(path, sglang, 1, _fingerprint(sglang))


def test_changed_target_weights_are_refused(tmp_path, setup):
    recipe = _recipe(setup)
    path = _saved(tmp_path, recipe)
    weights = setup[0] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(255 - b for b in data[-64:])  # same header and shapes, other values
    weights.write_bytes(bytes(data))
    assert "features.target_weights.model.safetensors changed: '" in _refusal(path, recipe)


def test_changed_dtype_and_quantization_are_refused(tmp_path, setup):
    path = _saved(tmp_path, _recipe(setup))
    message = _refusal(path, _recipe(setup, dtype="bfloat16"))
    assert "target.dtype: 'float32' -> 'bfloat16'" in message
    # target.sglang.* may change on resume, but not the quantization the server runs
    message = _refusal(path, _recipe(setup, sglang={"server_args": {"quantization": "fp8"}}))
    assert "features.quantization.server_args changed: None -> 'fp8'" in message


def test_changed_train_file_content_is_refused(tmp_path, setup):
    recipe = _recipe(setup)
    path = _saved(tmp_path, recipe)
    train = setup[1]
    train.write_text(train.read_text().replace("What is 3+3?", "What is 3*3?"))  # same size
    assert "data.content changed: '" in _refusal(path, recipe)


def test_fingerprint_compares_only_the_sections_given(tmp_path):
    r = recipe_from_dict({})
    saved = {**_meta(r), "fingerprint": {"features": {"dtype": "float32"}, "data": {"x": 1}}}
    ck.check_compatible(saved, r, 2, tmp_path, {"features": {"dtype": "float32"}})
    with pytest.raises(ck.ResumeError, match="features.dtype changed: 'float32' -> 'bfloat16'"):
        ck.check_compatible(saved, r, 2, tmp_path, {"features": {"dtype": "bfloat16"}})

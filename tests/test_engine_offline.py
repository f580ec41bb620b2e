"""Offline feature shards: round trip, and every corruption/mismatch refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specforge_dspark.cli.capture import read_samples_jsonl
from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.offline import MANIFEST, ShardWriter, target_fingerprint
from specforge_dspark.training.stream import FeatureStream

H, LAYERS = 16, [0, 2]


def fake_target(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": H, "num_hidden_layers": 4}))
    g = torch.Generator().manual_seed(seed)
    save_file({"lm_head.weight": torch.randn(64, H, generator=g)}, str(root / "model.safetensors"))
    return root


def features(sample_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sample_id)
    ids = torch.randint(0, 64, (n,), generator=g)
    return ids, torch.randn(n, H * len(LAYERS), generator=g), torch.randn(n, H, generator=g)


LENGTHS = {7: 5, 3: 9, 11: 4}


@pytest.fixture()
def capture_dir(tmp_path) -> Path:
    target = fake_target(tmp_path / "target", seed=0)
    meta = {"path": str(target), "weights_hash": target_fingerprint(target), "hidden_size": H}
    writer = ShardWriter(tmp_path / "cap", meta, LAYERS, "float32", shard_bytes=500)
    for sid, n in LENGTHS.items():
        writer.add(sid, *features(sid, n))
    writer.close()
    return tmp_path / "cap"


def offline_recipe(capture_dir: Path, target: Path, layers=LAYERS):
    return recipe_from_dict(
        {
            "target": {"path": str(target), "backend": "offline", "offline_dir": str(capture_dir)},
            "draft": {"target_layer_ids": layers, "num_target_layers": 4, "vocab_size": 64},
        }
    )


class S:
    def __init__(self, sid: int):
        self.sample_id = sid
        self.input_ids = features(sid, LENGTHS[sid])[0]
        self.loss_mask = torch.ones(LENGTHS[sid], dtype=torch.long)


def read_all(recipe, batches):
    with FeatureStream(recipe) as stream:
        return [
            (f.sample_ids, f.aux_hidden.clone(), f.last_hidden.clone())
            for f in stream.iterate(batches)
        ]


def test_round_trip_is_exact_and_padded(capture_dir):
    manifest = json.loads((capture_dir / MANIFEST).read_text())
    assert len(manifest["shards"]) >= 2, "shard_bytes=500 should split the capture"
    recipe = offline_recipe(capture_dir, capture_dir.parent / "target")
    out = read_all(recipe, [[S(3), S(7)], [S(11)]])
    assert [ids for ids, _, _ in out] == [[3, 7], [11]]
    _, aux, last = out[0]
    assert aux.shape == (2, 9, H * 2) and last.shape == (2, 9, H)
    _, want_aux, want_last = features(7, 5)
    assert torch.equal(aux[1, :5], want_aux) and torch.equal(last[1, :5], want_last)
    assert aux[1, 5:].abs().sum() == 0


def test_truncated_shard_is_refused_naming_it(capture_dir):
    shard = capture_dir / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-40])
    recipe = offline_recipe(capture_dir, capture_dir.parent / "target")
    with pytest.raises(ValueError, match=r"shard-00000\.safetensors: truncated"):
        read_all(recipe, [[S(7)], [S(3)], [S(11)]])


def test_corrupt_shard_bytes_are_refused_naming_it(capture_dir):
    shard = capture_dir / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    recipe = offline_recipe(capture_dir, capture_dir.parent / "target")
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: corrupt shard"):
        read_all(recipe, [[S(7)], [S(3)], [S(11)]])


def test_manifest_with_other_layer_ids_is_refused(capture_dir):
    recipe = offline_recipe(capture_dir, capture_dir.parent / "target", layers=[0, 1])
    with pytest.raises(ValueError, match=r"manifest\.json: .*aux layer ids \[0, 2\].*\[0, 1\]"):
        FeatureStream(recipe)


def test_features_of_another_target_are_refused(capture_dir, tmp_path):
    other = fake_target(tmp_path / "other_target", seed=1)
    with pytest.raises(ValueError, match=r"manifest\.json: features of another target"):
        FeatureStream(offline_recipe(capture_dir, other))


def test_features_of_another_aux_tap_are_refused(tmp_path):
    """Captures without a recorded tap took hidden_states[k+1]: wrong for an Inkling target."""
    target = fake_target(tmp_path / "target", seed=0)
    config = {"model_type": "inkling_text", "hidden_size": H, "num_hidden_layers": 4}
    (target / "config.json").write_text(json.dumps(config))
    meta = {"path": str(target), "weights_hash": target_fingerprint(target), "hidden_size": H}
    for name, tap in [("old", None), ("new", "pre_mlp_sconv")]:
        writer = ShardWriter(
            tmp_path / name, meta if tap is None else {**meta, "tap": tap}, LAYERS, "float32"
        )
        writer.add(7, *features(7, LENGTHS[7]))
        writer.close()
    with pytest.raises(ValueError, match=r"features of the layer_output aux tap.*pre_mlp_sconv"):
        FeatureStream(offline_recipe(tmp_path / "old", target))
    [(ids, aux, _)] = read_all(offline_recipe(tmp_path / "new", target), [[S(7)]])
    assert ids == [7] and torch.equal(aux[0], features(7, LENGTHS[7])[1])


def test_corrupt_manifest_and_changed_data_are_refused(capture_dir):
    target = capture_dir.parent / "target"
    changed = S(7)
    changed.input_ids = changed.input_ids.flip(0)
    with pytest.raises(ValueError, match=r"sample 7 was captured for other token ids"):
        read_all(offline_recipe(capture_dir, target), [[changed]])
    (capture_dir / MANIFEST).write_text('{"format": ')
    with pytest.raises(ValueError, match=r"manifest\.json: corrupt manifest"):
        FeatureStream(offline_recipe(capture_dir, target))
    (capture_dir / MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"manifest\.json not found"):
        FeatureStream(offline_recipe(capture_dir, target))


def test_fingerprint_sees_a_changed_weight(tmp_path):
    a = fake_target(tmp_path / "a", seed=0)
    before = target_fingerprint(a)
    f = a / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # the last sampled chunk ends at the file's end
    f.write_bytes(bytes(data))
    assert target_fingerprint(a) != before


def test_samples_jsonl_names_the_bad_line(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"sample_id": 1, "input_ids": [1, 2], "loss_mask": [0, 1]}\n{"sample_id": 2}\n')
    rows = read_samples_jsonl(p)
    assert next(rows).input_ids == [1, 2]
    with pytest.raises(ValueError, match=r"s\.jsonl:2: not a sample row"):
        next(rows)

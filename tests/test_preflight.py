"""Preflight of the features (specforge_dspark/training/preflight.py): passes on the hf, offline and
live sglang backends; each check fails, by name, on an engine broken on purpose (wrappers
here, around a real engine: a shifted aux layer, the hidden before the final norm as
last_hidden, a perturbation that grows with the batch)."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.cli.capture import capture
from specforge_dspark.cli.preflight import main
from specforge_dspark.engines.hf import HFTarget
from specforge_dspark.objective.frozen_head import load_frozen_head
from specforge_dspark.training.preflight import PreflightError, preflight
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import Sample, TargetFeatures
from tests.live_sglang import LAYERS, tiny_sglang_recipe

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = (21, 40, 9, 33)  # prompt lengths: the batch check pads them against each other


def rows(lengths=PROMPTS, answer: int = 12) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for sid, n in enumerate(lengths):
        ids = torch.randint(10, 1000, (n + answer,), generator=g)
        mask = torch.cat([torch.zeros(n), torch.ones(answer)]).long()
        out.append(Sample(sid, ids, mask))
    return out


def hf_recipe(target_dir):
    recipe = tiny_sglang_recipe(target_dir)
    recipe.target.backend = "hf"
    return recipe


def verdicts(checks) -> dict[str, bool | None]:
    return {c.name: c.ok for c in checks}


@pytest.fixture(scope="module")
def hf_stream(tiny_qwen3_dir):
    with FeatureStream(hf_recipe(tiny_qwen3_dir)) as stream:
        yield stream


@pytest.fixture(scope="module")
def head(tiny_qwen3_dir):
    return load_frozen_head(tiny_qwen3_dir)


def test_hf_backend_passes(hf_stream, head, tiny_qwen3_dir, capsys):
    checks = verdicts(preflight(hf_recipe(tiny_qwen3_dir), hf_stream, rows(), head))
    assert checks.pop("split prefill") is None  # the hf engine prefills whole
    assert all(checks.values()), checks
    assert {"reference L0", "reference L2", "reference last", "greedy argmax"} <= set(checks)
    print(capsys.readouterr().out)


def test_offline_backend_passes(hf_stream, tiny_qwen3_dir, head, tmp_path):
    data = rows()
    capture(hf_recipe(tiny_qwen3_dir), data, tmp_path / "cap", stream=hf_stream, log=print)
    recipe = hf_recipe(tiny_qwen3_dir)
    recipe.target.backend, recipe.target.offline_dir = "offline", str(tmp_path / "cap")
    with FeatureStream(recipe) as stream:
        checks = verdicts(preflight(recipe, stream, data, head, log=None))
    assert checks.pop("split prefill") is None
    assert all(checks.values()), checks


class Broken:
    """A real engine whose answers `spoil(batch, features)` rewrites."""

    def __init__(self, inner, spoil):
        self.inner, self.spoil, self.name = inner, spoil, f"broken {inner.name}"

    def wait_ready(self) -> None:
        self.inner.wait_ready()

    def submit(self, seq, batch) -> None:
        self.inner.submit(seq, batch)

    def result(self, seq, batch, deadline) -> TargetFeatures:
        f = self.inner.result(seq, batch, deadline)
        aux, last = self.spoil(batch, f.aux_hidden.clone(), f.last_hidden.clone())
        return TargetFeatures(f.sample_ids, f.input_ids, f.loss_mask, f.lengths, aux, last)

    def close(self) -> None:
        self.inner.close()


def shifted_layers(target_dir):
    """Aux layers k+1 where k was asked (the off-by-one of DSPARK_SPEC section 7)."""
    shifted = HFTarget(str(target_dir), "float32", "cpu", [k + 1 for k in LAYERS], chunk=1)

    def spoil(batch, aux, last):
        return shifted.forward(batch, last.shape[-1]).aux_hidden, last

    return spoil


def pre_norm_last(target_dir):
    """last_hidden taken before the target's final norm."""
    target = HFTarget(str(target_dir), "float32", "cpu", LAYERS, chunk=1)
    seen = {}
    target.decoder.norm.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))

    def spoil(batch, aux, last):
        for b, n in enumerate(batch.lengths.tolist()):
            target.decoder(input_ids=batch.input_ids[b : b + 1, :n])
            last[b, :n] = seen["h"][0]
        return aux, last

    return spoil


def batch_dependent(batch, aux, last):
    """Features nudged by 1e-3 per other sequence in the batch (none when alone)."""
    nudge = 1e-3 * (batch.shape[0] - 1)
    for b, n in enumerate(batch.lengths.tolist()):
        aux[b, :n] += nudge
        last[b, :n] += nudge
    return aux, last


@pytest.mark.parametrize(
    ("broken", "failing"),
    [
        ("shifted layer", {"reference L0", "reference L1", "reference L2"}),
        ("pre-norm last hidden", {"greedy logprob", "reference last"}),
        ("batch-dependent", {"batch"}),
    ],
)
def test_each_check_fails_on_its_broken_engine(broken, failing, hf_stream, head, tiny_qwen3_dir):
    spoil = {
        "shifted layer": lambda: shifted_layers(tiny_qwen3_dir),
        "pre-norm last hidden": lambda: pre_norm_last(tiny_qwen3_dir),
        "batch-dependent": lambda: batch_dependent,
    }[broken]()
    inner = hf_stream.engine
    hf_stream.engine = Broken(inner, spoil)
    try:
        with pytest.raises(PreflightError) as err:
            preflight(hf_recipe(tiny_qwen3_dir), hf_stream, rows(), head, log=print)
    finally:
        hf_stream.engine = inner
    message = str(err.value)
    named = {part.split(": ")[0] for part in message.removeprefix("preflight failed: ").split("; ")}
    assert named == failing, message


def test_cli_prints_the_table_and_exits_zero(tiny_qwen3_dir, capsys):
    code = main(
        ["--recipe", "recipes/tiny_cpu_sglang.yaml", "--rows", "2", "target.backend=hf",
         f"target.path={tiny_qwen3_dir}"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "preflight: hf engine" in out and "greedy argmax" in out


def test_live_sglang_server_passes(sglang_server, tiny_qwen3_dir, head, capsys):
    recipe = tiny_sglang_recipe(tiny_qwen3_dir, url=sglang_server.url)
    with FeatureStream(recipe) as stream:
        checks = verdicts(preflight(recipe, stream, rows(), head))
    print(capsys.readouterr().out)
    assert all(checks.values()), checks  # split prefill included: chunked_prefill_size 4096

"""The loop's in-place swap (`loop.swap: reload`) and a deployment it did not start
(`loop.attach`), against a stand-in vLLM engine whose starts, stops and in-place updates are
recorded. vLLM itself taking a drafter in place: tests/test_serve_vllm.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from specforge_dspark.config.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_cpu_sglang.yaml"


@pytest.fixture
def engine(monkeypatch, tmp_path) -> SimpleNamespace:
    """started (export dir name, keywords), stopped ports, updates (url, export, version),
    exports [v0, v1] (sglang layout dirs, the speculators beside them)."""
    from specforge_dspark.loop import serve

    rec = SimpleNamespace(started=[], stopped=[], updates=[], exports=[])

    def start(target, export, port, log, device, dtype, python, **kw):
        rec.started.append((Path(export).name, kw))
        return SimpleNamespace(stop=lambda: rec.stopped.append(port)), f"http://127.0.0.1:{port}"

    def update(url, export, version):
        rec.updates.append((url, export, version))

    vllm = serve.ENGINES["vllm"]
    fake = serve.Engine(start, vllm.ask, vllm.layout, vllm.python, update)
    monkeypatch.setitem(serve.ENGINES, "vllm", fake)
    for v in (0, 1):
        rec.exports.append(tmp_path / f"v{v}" / "export" / "sglang")
        rec.exports[-1].mkdir(parents=True)
        _weights(rec.exports[-1].parent / "speculators", 128)
    return rec


def _weights(spec: Path, width: int) -> None:
    """A speculators export's tensors (what the in-place update compares), `width` wide."""
    import torch
    from safetensors.torch import save_file

    spec.mkdir(parents=True, exist_ok=True)
    save_file({"fc.weight": torch.zeros(width, 2 * width), "norm.weight": torch.ones(width)},
              spec / "model.safetensors")  # fmt: skip


def _two_replicas(engine, tiny_qwen3_dir: Path, tmp_path: Path):
    """The tiny recipe with two vLLM replicas swapped in place, v0 serving."""
    return load_recipe(RECIPE, [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={tmp_path / 'loop'}",
        f"loop.serve_from={engine.exports[0]}", "loop.engine=vllm", "loop.replicas=2",
        "loop.swap=reload",
    ])  # fmt: skip


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_reload_swap_updates_every_serving_member_in_place(engine, tiny_qwen3_dir, tmp_path):
    """loop.swap: reload: the loop's vLLM servers start reloadable; a promotion hands the
    new version's speculators export to each serving member through the engine's in-place
    update (in member order, named v<version>), the members keep their addresses behind the
    front, and only the candidate's own server stops. SGLang has no such update: refused."""
    from specforge_dspark.loop.round import Loop

    recipe = _two_replicas(engine, tiny_qwen3_dir, tmp_path)
    loop = Loop(recipe, log=lambda s: None)
    try:
        loop.serve(loop.start(0))
        members = [m.url for m in loop.pool]
        version = loop.lineage.add(str(engine.exports[1]), 0, None, round=0)
        candidate = loop.start(version, engine.exports[1])
        loop.serve(candidate)
    finally:
        loop.front.close()
    assert engine.started == [("speculators", {"reloadable": True})] * 3
    spec = engine.exports[1].parent / "speculators"
    assert engine.updates == [(members[0], spec, "v1"), (members[1], spec, "v1")]
    assert [m.url for m in loop.pool] == members and {m.version for m in loop.pool} == {1}
    assert engine.stopped == [_port(candidate.url)]
    with pytest.raises(RecipeError, match="loop.swap: reload needs loop.engine: vllm"):
        load_recipe(RECIPE, ["loop.swap=reload"])


def test_an_attached_deployment_is_loaded_swapped_in_place_and_never_stopped(
    engine, tiny_qwen3_dir, tmp_path
):
    """loop.attach: two vLLM servers the loop did not start serve its front; on attach each
    is loaded with the serving version, a promotion loads the new one into each, and at the
    end neither is stopped (only the candidate's server, which the loop started). Attaching
    without loop.swap: reload is refused, naming both keys."""
    from specforge_dspark.loop.round import Loop

    urls = ["http://10.0.0.7:8000", "http://10.0.0.8:8000/"]
    recipe = load_recipe(RECIPE, [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={tmp_path / 'loop'}",
        f"loop.serve_from={engine.exports[0]}", "loop.engine=vllm", "loop.swap=reload",
        f"loop.attach=[{','.join(urls)}]",
    ])  # fmt: skip
    said: list[str] = []
    loop = Loop(recipe, log=said.append)
    attached = [u.rstrip("/") for u in urls]
    spec = [e.parent / "speculators" for e in engine.exports]
    try:
        serving = loop.ensure_serving()
        assert serving.url == attached[0] and not engine.started
        assert engine.updates == [(attached[0], spec[0], "v0"), (attached[1], spec[0], "v0")]
        version = loop.lineage.add(str(engine.exports[1]), 0, None, round=0)
        candidate = loop.start(version, engine.exports[1])
        loop.serve(candidate)
        assert engine.updates[2:] == [(attached[0], spec[1], "v1"), (attached[1], spec[1], "v1")]
        assert loop.ensure_serving().url == attached[0]  # nothing started for the version
    finally:
        loop.close()
    assert len(engine.started) == 1 and engine.stopped == [_port(candidate.url)]
    assert any("2 attached server(s)" in s for s in said), said
    with pytest.raises(RecipeError, match="loop.attach.*loop.swap: reload"):
        load_recipe(RECIPE, ["loop.engine=vllm", f"loop.attach=[{urls[0]}]"])


def test_a_candidate_whose_tensors_differ_is_refused_before_any_update(
    engine, tiny_qwen3_dir, tmp_path
):
    """An in-place update whose tensors differ in shape from the serving drafter's (vLLM's
    worker would fail the load and stop its engine) is refused naming the tensor and both
    shapes, before any member is touched; the members keep serving their version."""
    from specforge_dspark.loop.round import Loop

    _weights(engine.exports[1].parent / "speculators", 96)  # another draft width
    recipe = _two_replicas(engine, tiny_qwen3_dir, tmp_path)
    loop = Loop(recipe, log=lambda s: None)
    try:
        loop.serve(loop.start(0))
        version = loop.lineage.add(str(engine.exports[1]), 0, None, round=0)
        with pytest.raises(ValueError, match=r"first fc.weight: \('F32', \[128, 256\]\) serving"):
            loop.serve(loop.start(version, engine.exports[1]))
    finally:
        loop.front.close()
    assert engine.updates == [] and {m.version for m in loop.pool} == {0}

"""prepare end to end: fuzz rows, real shared data, cache, CLI outputs, file kinds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipelines import prepare as prep
from data_pipelines.prepare import load_prepared, main, prepare_dataset
from data_pipelines.render import load_tokenizer
from specforge_dspark.config.recipe import load_recipe as load_any_recipe
from specforge_dspark.config.recipe import recipe_from_dict

DATA = Path(__file__).parent / "data"


def write_recipe(tmp: Path, target: Path, **data) -> Path:
    data = {"cache_dir": str(tmp / "cache"), "max_length": 256, **data}
    lines = [f"target:\n  path: {json.dumps(str(target))}\ndata:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in data.items()]
    path = tmp / "recipe.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fuzz_file_is_in_sync_with_its_generator(tmp_path):
    sys.path.insert(0, str(DATA))
    try:
        import make_fuzz
    finally:
        sys.path.remove(str(DATA))
    data, expected = make_fuzz.build()
    assert (DATA / "fuzz.jsonl").read_bytes() == data
    assert json.loads((DATA / "fuzz_expected.json").read_text()) == expected
    bad_kinds = {what for what in expected.values() if what not in ("keep", "blank")}
    assert len(make_fuzz.BAD) >= 25 and len(bad_kinds) >= 25


def test_fuzz_every_good_row_kept_every_bad_row_rejected(tmp_path, tiny_target_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_target_dir)
    fuzz = DATA / "fuzz.jsonl"
    out = tmp_path / "out"
    assert main(["--recipe", str(recipe), "--input", str(fuzz), "--out", str(out), "--quiet"]) == 0
    expected = json.loads((DATA / "fuzz_expected.json").read_text())
    good = [int(n) for n, w in expected.items() if w == "keep"]
    bad = {int(n): w for n, w in expected.items() if w not in ("keep", "blank")}

    report = json.loads((out / "prepare_report.json").read_text())
    assert report["rows_read"] == len(good) + len(bad)
    assert report["rows_kept"] == len(good)
    assert report["blank_lines"] == 1
    assert sum(report["rejected"].values()) == len(bad)

    rejects = read_jsonl(out / "rejects.jsonl")
    assert {r["line"]: r["reason"] for r in rejects} == bad
    for r in rejects:
        assert r["file"] == str(fuzz) and r["row"] == r["line"] - 1 and r["raw"] is not None

    ds = load_prepared(out)
    assert ds["sample_id"] == list(range(len(good)))
    assert ds["source"] == [f"{fuzz}:{n - 1}" for n in good]
    assert all(n >= 2 for n in ds["num_supervised"])
    lengths = [(len(a), len(b)) for a, b in zip(ds["input_ids"], ds["loss_mask"], strict=True)]
    assert all(a == b <= 256 for a, b in lengths)
    assert any(ds["truncated"])
    text = capsys.readouterr().out
    assert f"{len(good)}/{len(good) + len(bad)} rows kept" in text and "bad_json: 4" in text


def test_shared_sharegpt_and_gsm8k(tmp_path, tiny_target_dir, shared_data):
    files = [
        str(shared_data / "train" / "sharegpt_sample.json"),
        str(shared_data / "train" / "gsm8k_train.jsonl"),
    ]
    recipe = load_recipe(write_recipe(tmp_path, tiny_target_dir, max_rows=150, max_length=512))
    ds = prepare_dataset(recipe, files=files, progress=False)
    assert len(ds) == 300 and ds.num_rows == len(set(ds["source"]))
    assert ds["source"][0] == f"{files[0]}:0" and ds["source"][150] == f"{files[1]}:0"
    tok = load_tokenizer(tiny_target_dir)
    first = ds[0]  # identity_0: two answers, each followed by <|im_end|>
    ids = [t for t, m in zip(first["input_ids"], first["loss_mask"], strict=True) if m]
    assert tok.decode(ids).startswith("I am Vicuna") and tok.decode(ids).count("<|im_end|>") == 2


def test_cache_hit_and_invalidation(tmp_path, tiny_target_dir, monkeypatch):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"question": "q?", "answer": "the answer"}) + "\n")
    recipe = load_recipe(write_recipe(tmp_path, tiny_target_dir, train_files=[str(data)]))
    ds = prepare_dataset(recipe, progress=False)
    assert len(ds) == 1 and ds.column_names[:5] == [
        "sample_id", "source", "input_ids", "loss_mask", "num_supervised"
    ]  # fmt: skip
    builds = []
    real_build = prep.build
    monkeypatch.setattr(prep, "build", lambda *a: builds.append(a) or real_build(*a))
    assert prepare_dataset(recipe, progress=False)["input_ids"] == ds["input_ids"]
    assert builds == []  # cache hit
    recipe.data.max_length = 128
    prepare_dataset(recipe, progress=False)
    assert len(builds) == 1  # parameters are in the key
    data.write_text(json.dumps({"question": "q?", "answer": "another answer"}) + "\n")
    os.utime(data, ns=(1, 1))
    assert "another" in load_tokenizer(tiny_target_dir).decode(
        prepare_dataset(recipe, progress=False)[0]["input_ids"]
    )
    assert len(builds) == 2  # input content (size / mtime) is in the key
    recipe.data.chat_template_kwargs = {"enable_thinking": False}
    prepare_dataset(recipe, progress=False)
    assert len(builds) == 3
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert len(cached) == 4 and all(name.startswith("train-") for name in cached)


def test_eval_split_json_array_and_parquet(tmp_path, tiny_target_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(3)
    ]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    files = [str(tmp_path / "a.json"), str(tmp_path / "b.parquet")]
    recipe = load_recipe(write_recipe(tmp_path, tiny_target_dir, eval_files=files))
    ds = prepare_dataset(recipe, split="eval", progress=False)
    assert ds["source"] == [f"{f}:{i}" for f in files for i in range(3)]
    assert len({tuple(x) for x in ds["input_ids"]}) == 3  # q0..q2, same from both files
    with pytest.raises(ValueError, match="data.train_files"):
        prepare_dataset(recipe, split="train")


def test_recipe_errors_name_the_key(tmp_path, tiny_target_dir):
    recipe = recipe_from_dict(
        {"target": {"path": str(tiny_target_dir)}, "data": {"train_files": ["missing.jsonl"]}}
    )
    with pytest.raises(ValueError, match=r"data.train_files: input file not found"):
        prepare_dataset(recipe)
    recipe.data.train_files = [str(DATA / "fuzz.jsonl")]
    recipe.target.path = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="target.path"):
        prepare_dataset(recipe, progress=False)


def test_cli_module_runs_with_progress_and_num_proc(tmp_path, tiny_target_dir, repo):
    data = tmp_path / "in.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": f"a{i} ok"}) + "\n" for i in range(9))
    )
    recipe = write_recipe(tmp_path, tiny_target_dir, train_files=[str(data)], num_proc=2)
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_pipelines.prepare",
            "--recipe",
            str(recipe),
            "--out",
            str(out),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "9/9 rows kept" in proc.stdout
    assert "row/s" in proc.stderr or "s/row" in proc.stderr  # tqdm rate (and ETA) shown
    single = prepare_dataset(load_recipe(recipe, ["data.num_proc=1"]), progress=False)
    assert load_prepared(out)["input_ids"] == single["input_ids"]


def load_recipe(path, overrides=None):
    """A data-preparation recipe (target and data sections), read as the data pipelines
    read it: without the sections only training needs."""
    return load_any_recipe(path, overrides, required={})

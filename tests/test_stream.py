"""FeatureStream over a live hf worker: order, ids, exact features, bounds, failures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from data_pipelines.ingest import batched
from specforge_dspark.cli.capture import capture
from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.hf import HFTarget, worker_threads
from specforge_dspark.engines.offline import ShardWriter, target_fingerprint
from specforge_dspark.engines.tap import read_target_config, tap_convention
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import Sample, pad_batch
from specforge_dspark.transport.shm import FILE_PREFIX, SHM_DIR, ShmSlot
from specforge_dspark.transport.slot_budget import sweep_stale_slots

REPO = Path(__file__).resolve().parents[1]


def tiny_recipe(target_dir, **target):
    raw = {
        "target": {"path": str(target_dir), "prefetch": 2, "batch_size": 2, "timeout_s": 60}
        | target,
        "draft": {"target_layer_ids": [0, 1, 2], "num_target_layers": 4, "vocab_size": 1088},
    }
    return recipe_from_dict(raw)


def make_samples(lengths: list[int], seed: int = 0, first_id: int = 100) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = (torch.rand(n, generator=g) > 0.3).long()
        out.append(Sample(first_id + i, torch.randint(10, 1000, (n,), generator=g).tolist(), mask))
    return out


def slot_files(pid: int) -> list[str]:
    """Slot files of process `pid` (named <prefix><job>-<pid>-<tag>-..., slot_budget.py)."""
    return [p.name for p in SHM_DIR.glob(f"{FILE_PREFIX}*-{pid}-r*")]


@pytest.fixture(scope="module")
def recipe(tiny_target_dir):
    return tiny_recipe(tiny_target_dir)


@pytest.fixture(scope="module")
def stream(recipe):
    s = FeatureStream(recipe)  # the worker loads while the reference model loads below
    with s:
        yield s
    assert not slot_files(os.getpid()), "closing the stream must unlink its slots"
    assert not s.engine.proc.is_alive(), "closing the stream must stop its worker"


@pytest.fixture(scope="module")
def reference(tiny_target_dir, stream):
    """The same model in this process, run with the worker's thread count (CPU kernels
    may sum in another order with another thread count)."""
    model = HFTarget(str(tiny_target_dir), "float32", "cpu", [0, 1, 2], chunk=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads(world_size=1))
    yield model
    torch.set_num_threads(threads)


BATCHES = [[0, 1], [2], [3, 4], [5, 6], [7]]  # indices into SAMPLES
SAMPLES = make_samples([17, 30, 9, 41, 25, 25, 12, 50])


def test_stream_yields_in_order_and_equals_in_process_forward(stream, reference):
    batches = [[SAMPLES[i] for i in b] for b in BATCHES]
    got = list(
        (f.sample_ids, f.aux_hidden.clone(), f.last_hidden.clone(), f)
        for f in stream.iterate(batches)
    )
    assert [ids for ids, *_ in got] == [[s.sample_id for s in b] for b in batches]
    for (ids, aux, last, f), samples in zip(got, batches, strict=True):
        want = reference.forward(pad_batch(samples), hidden=128)
        assert aux.dtype == torch.float32 and aux.shape == want.aux_hidden.shape
        assert torch.equal(aux, want.aux_hidden), f"aux differs for samples {ids}"
        assert torch.equal(last, want.last_hidden), f"last differs for samples {ids}"
        assert torch.equal(f.input_ids, want.input_ids) and torch.equal(f.loss_mask, want.loss_mask)
    assert stream.wait_seconds > 0 and stream.bytes_out > 0


def test_memory_is_bounded_to_prefetch_plus_one_slots(stream):
    batches = [make_samples([n, n + 3], seed=n) for n in range(5, 60, 6)]
    seen = set()
    for _ in stream.iterate(batches):
        seen.update(slot_files(os.getpid()))
        assert len(slot_files(os.getpid())) == stream.prefetch + 1
    # a ramp of ever larger requests: each slot regrows (doubling) at most twice
    assert len(seen) <= 3 * (stream.prefetch + 1)


def test_abandoned_iteration_does_not_leak_into_the_next(stream, reference):
    batches = [[s] for s in SAMPLES]
    for _ in stream.iterate(batches):
        break  # leaves `prefetch` requests in flight
    first = next(iter(stream.iterate([[SAMPLES[7]]])))
    want = reference.forward(pad_batch([SAMPLES[7]]), hidden=128)
    assert first.sample_ids == [SAMPLES[7].sample_id]
    assert torch.equal(first.aux_hidden, want.aux_hidden)


def test_stalled_worker_hits_the_timeout(stream):
    pid = stream.engine.proc.pid
    stream.timeout_s, stream.max_restarts = 1.5, 0  # restarts: tests/test_faults_worker.py
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"hf target worker for rank 0 \(pid \d+\)"):
            list(stream.iterate([[SAMPLES[0]]]))
        waited = time.monotonic() - t0
        # the worker is stopped, so only a timeout ends the wait: the 1.5 s one set here,
        # not the stream's default 60 s
        assert waited < 60, f"waited {waited:.0f}s: the 1.5 s timeout was not the one applied"
    finally:
        os.kill(pid, signal.SIGCONT)
        stream.timeout_s, stream.max_restarts = 60, 3


def test_hf_features_equal_offline_features_read_back(stream, recipe, tmp_path, tiny_target_dir):
    samples = SAMPLES[:5]
    manifest = capture(recipe, samples, tmp_path / "cap", stream=stream, log=lambda *a: None)
    assert manifest.is_file()
    offline = tiny_recipe(tiny_target_dir, backend="offline", offline_dir=str(tmp_path / "cap"))
    # the capture's own batching: padding to another length moves the last bits
    batches = list(batched(samples, recipe.target.batch_size))
    with FeatureStream(offline) as off:
        read = [(f.aux_hidden.clone(), f.last_hidden.clone()) for f in off.iterate(batches)]
    live = [(f.aux_hidden.clone(), f.last_hidden.clone()) for f in stream.iterate(batches)]
    for (a1, l1), (a2, l2) in zip(read, live, strict=True):
        assert torch.equal(a1, a2) and torch.equal(l1, l2)


TRAINER = textwrap.dedent(
    """
    import sys, time, itertools
    from specforge_dspark.config.recipe import recipe_from_dict
    from specforge_dspark.training.stream import FeatureStream
    from specforge_dspark.transport.features import Sample

    recipe = recipe_from_dict({
        "target": {"path": sys.argv[1], "prefetch": 2, "timeout_s": 60, "max_restarts": 0},
        "draft": {"target_layer_ids": [0, 1], "num_target_layers": 4, "vocab_size": 1088},
    })
    batches = ([Sample(i, [5 + i % 50] * 16, [1] * 16)] for i in itertools.count())
    if __name__ == "__main__":
        with FeatureStream(recipe) as stream:
            for n, feats in enumerate(stream.iterate(batches)):
                if n == 0:
                    print("WORKER", stream.engine.proc.pid, flush=True)
                time.sleep(0.05)  # the simulated training step
    """
)


def test_killed_worker_fails_the_trainer_within_30s(tmp_path, tiny_target_dir):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(script), str(tiny_target_dir)]
    trainer = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = trainer.stdout.readline()
        assert line.startswith("WORKER"), trainer.stderr.read()
        worker = int(line.split()[1])
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        code = trainer.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        err = trainer.stderr.read()
        assert code != 0, err
        assert re.search(r"hf target worker for rank 0 \(pid \d+\) died", err), err
        assert "target.max_restarts=0" in err
        assert not slot_files(trainer.pid), "the failing trainer must still unlink its slots"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_sigterm_unwinds_the_stream_and_restores_the_handler(tmp_path, tiny_target_dir):
    samples = make_samples([8, 9])
    writer = ShardWriter(
        tmp_path / "cap",
        {
            "weights_hash": target_fingerprint(tiny_target_dir),
            "hidden_size": 128,
            "tap": tap_convention(read_target_config(tiny_target_dir)),
        },
        [0, 1, 2],
        "float32",
    )
    for s in samples:
        n = len(s.input_ids)
        writer.add(s.sample_id, s.input_ids, torch.zeros(n, 384), torch.zeros(n, 128))
    writer.close()
    recipe = tiny_recipe(tiny_target_dir, backend="offline", offline_dir=str(tmp_path / "cap"))
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # other open streams' handler
    try:
        stream = FeatureStream(recipe)
        with pytest.raises(SystemExit) as stop:
            with stream:
                for _ in stream.iterate([[s] for s in samples]):
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises before this ends
        assert stop.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_stale_slots_of_dead_processes_of_this_job_only_are_swept():
    """Two jobs share /dev/shm (docker --ipc=host): a live process of the other job, in
    its own pid namespace, looks dead from here; only this job's files are judged."""
    files = {
        (job, state): SHM_DIR / f"{FILE_PREFIX}{job}-{pid}-r0s0-test"
        for job in ("aaaa000001", "bbbb000002")
        for state, pid in (("dead", 999999999), ("live", os.getpid()))  # above any pid_max
    }
    for p in files.values():
        p.write_bytes(b"x")
    try:
        swept = sweep_stale_slots("aaaa000001")
        assert swept == [files["aaaa000001", "dead"]]
        assert [k for k, p in files.items() if p.exists()] == [
            ("aaaa000001", "live"),
            ("bbbb000002", "dead"),
            ("bbbb000002", "live"),
        ]
    finally:
        for p in files.values():
            p.unlink(missing_ok=True)


def test_the_sweep_leaves_a_locked_slot_of_a_dead_looking_process_alone():
    """Two containers with the same host name and output_dir share /dev/shm: a live slot
    of the other (its pid dead from here) holds a shared flock, as every ShmSlot does, and
    is not swept; once nothing holds it, it is."""
    job = "cccc000003"
    slot = ShmSlot("r0s0", aux_width=6, hidden=4, dtype=torch.float32, job=job)
    slot.prepare([3])
    other = SHM_DIR / f"{FILE_PREFIX}{job}-999999999-r0s0-live"  # above any pid_max
    os.rename(slot.path, other)  # the other container's live slot: its lock goes with it
    try:
        assert sweep_stale_slots(job) == [] and other.exists()
        slot.close()  # the slot ends: its lock too
        assert sweep_stale_slots(job) == [other] and not other.exists()
    finally:
        slot.close()
        other.unlink(missing_ok=True)

"""The Mooncake transport without a server: a trainer's slot registered with this
process's Transfer Engine (127.0.0.1), written by slot_writer in another process on
127.0.0.2 through its own engine (TCP). The ticket protocol holds as over /dev/shm: rows
land at their offsets (whole or in chunks), a reissued ticket's late writer writes
nothing, a failure reaches the ticket, an offset outside the slot is refused; fp8 rows
quantized into the staging buffer arrive as over /dev/shm (the last hidden bitwise bf16);
the staging buffer is page-locked exactly where CUDA is available; a location
round-trips; an environment without Mooncake is told what to install; the recipe refuses
the transport where no writer uses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, recipe_from_dict
from specforge_dspark.transport import mooncake
from specforge_dspark.transport.features import TargetLost
from specforge_dspark.transport.fp8_rows import FP8, dequantize, quantize
from specforge_dspark.transport.mooncake import Exposer, Remote
from specforge_dspark.transport.shm import DTYPE_CODES, ShmSlot
from specforge_dspark.transport.tickets import DONE, FAILED, PENDING, Ticket

REPO = Path(__file__).resolve().parents[1]
D, H = 6, 3


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D + H, generator=torch.Generator().manual_seed(seed))


def _write_from_elsewhere(location: str, calls: list[dict], version: str = "") -> str:
    env = {**os.environ, mooncake.HOST_ENV: "127.0.0.2", "PYTHONPATH": str(REPO)}  # this tree
    cmd = [sys.executable, str(REPO / "tests" / "mooncake_writer.py"), location]
    cmd += [json.dumps(calls), str(D), str(H)] + ([version] if version else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


def test_a_writer_on_another_address_fills_the_tickets_through_mooncake():
    exposer = Exposer("http://127.0.0.2:1", "tcp")
    assert exposer.host == "127.0.0.1"  # the route to the server's address
    slot = ShmSlot("mctest", aux_width=D, hidden=H, dtype=torch.float32, exposer=exposer)
    lengths = [5, 7, 4, 3]
    views = slot.prepare(lengths)
    remote = Remote.parse(slot.location)
    assert remote is not None and str(remote) == slot.location and remote.nbytes == len(slot.buf)
    assert Remote.parse(str(slot.path)) is None  # a /dev/shm path is no Mooncake location
    code = DTYPE_CODES[torch.float32]
    for b, n in enumerate(lengths):
        slot.write_ticket(b, Ticket(PENDING, n, 0, *views.offsets(b), D, H, code, nonce=10 + b))
    fp8 = ShmSlot("mcfp8", aux_width=D, hidden=H, dtype=FP8, exposer=exposer)
    fp8_views = fp8.prepare([7])
    fp8_code = DTYPE_CODES[FP8]
    fp8.write_ticket(0, Ticket(PENDING, 7, 0, *fp8_views.offsets(0), D, H, fp8_code, nonce=4))
    calls = [
        {"op": "write", "ticket": 0, "nonce": 10, "row0": 0, "rows": 5, "seed": 0},
        {"op": "write", "ticket": 1, "nonce": 11, "row0": 0, "rows": 4, "seed": 1},  # chunk 1
        {"op": "write", "ticket": 1, "nonce": 11, "row0": 4, "rows": 3, "seed": 2},  # chunk 2
        {"op": "write", "ticket": 2, "nonce": 99, "row0": 0, "rows": 4, "seed": 3},  # reissued
        {"op": "fail", "ticket": 3, "nonce": 13, "message": "no hidden states here"},
        *(  # fp8 rows, in two chunks
            {"op": "write", "ticket": 0, "nonce": 4, "row0": r, "rows": n, "seed": 5 + r}
            | {"location": fp8.location}
            for r, n in ((0, 4), (4, 3))
        ),
    ]
    log = _write_from_elsewhere(slot.location, calls)
    assert "listening on 127.0.0.2" in log  # the writer's own engine, on its own address

    t0, t1, t2, t3 = (slot.read_ticket(b) for b in range(4))
    assert (t0.status, t0.written, t1.status, t1.written) == (DONE, 5, DONE, 7)
    aux0, last0 = views.rows(0)
    assert torch.equal(torch.cat([aux0, last0], 1), _rows(5, 0))
    aux1, last1 = views.rows(1)
    assert torch.equal(torch.cat([aux1, last1], 1), torch.cat([_rows(4, 1), _rows(3, 2)]))
    assert (t2.status, t2.written) == (PENDING, 0) and not views.rows(2)[0].any()
    assert "reissued" in log
    assert (t3.status, t3.error) == (FAILED, "no hidden states here")
    assert (fp8.read_ticket(0).status, fp8.read_ticket(0).written) == (DONE, 7)
    sent = torch.cat([_rows(4, 5), _rows(3, 9)])
    q, scale = quantize(sent[:, :D].reshape(7, D // H, H))  # as over /dev/shm
    aux_q, last = fp8_views.rows(0)
    assert torch.equal(aux_q.view(torch.uint8), q.view(7, D).view(torch.uint8))
    assert torch.equal(fp8_views.aux_scale, scale)
    assert torch.equal(last, sent[:, D:].to(torch.bfloat16))
    assert dequantize(aux_q, fp8_views.aux_scale, torch.float32).isfinite().all()
    fp8.close()

    # rows past the ticket's sequence: refused by the ticket's checks, nothing written
    slot.write_ticket(2, Ticket(PENDING, 4, 0, *views.offsets(2), D, H, code, nonce=12))
    _write_from_elsewhere(
        slot.location, [{"op": "write", "ticket": 2, "nonce": 12, "row0": 0, "rows": 6, "seed": 4}]
    )
    t2 = slot.read_ticket(2)
    assert t2.status == FAILED and "rows [0, 6) of a 4-token sequence" in t2.error
    assert not views.rows(2)[0].any()
    slot.close()
    assert slot.location == ""


def test_a_writer_with_a_mooncake_older_than_0_3_12_fails_the_ticket_over_tcp():
    """The server's environment holds Mooncake 0.3.11: the writer writes no rows and
    fails the ticket naming the version it has and the one it needs."""
    exposer = Exposer("http://127.0.0.2:1", "tcp")
    slot = ShmSlot("mcold", aux_width=D, hidden=H, dtype=torch.float32, exposer=exposer)
    views = slot.prepare([4])
    code = DTYPE_CODES[torch.float32]
    slot.write_ticket(0, Ticket(PENDING, 4, 0, *views.offsets(0), D, H, code, nonce=21))
    call = {"op": "write", "ticket": 0, "nonce": 21, "row0": 0, "rows": 4, "seed": 5}
    _write_from_elsewhere(slot.location, [call], version="0.3.11")
    t = slot.read_ticket(0)
    assert t.status == FAILED and not views.rows(0)[0].any()
    assert t.error.startswith(
        "the server's Mooncake (mooncake-transfer-engine-non-cuda 0.3.11) is older than "
        "0.3.12, the oldest whose tcp transport writes features: pip install"
    )
    slot.close()


def test_a_late_writer_to_a_renewed_slot_changes_none_of_its_bytes():
    """The trainer gave up on a request and re-sent it: the slot's next request got a new
    registration. A writer of the old request, still holding the old location, writes: not
    a byte of the slot's live mapping changes, and the trainer process stays up."""
    exposer = Exposer("http://127.0.0.2:1", "tcp")
    slot = ShmSlot("mcrenew", aux_width=D, hidden=H, dtype=torch.float32, exposer=exposer)
    views = slot.prepare([4])
    code = DTYPE_CODES[torch.float32]
    slot.write_ticket(0, Ticket(PENDING, 4, 0, *views.offsets(0), D, H, code, nonce=31))
    old = slot.location
    views = slot.prepare([4], fresh=True)
    slot.write_ticket(0, Ticket(PENDING, 4, 0, *views.offsets(0), D, H, code, nonce=32))
    assert slot.location != old and len(slot.retired) == 1
    before = bytes(slot.buf)
    call = {"op": "write", "ticket": 0, "nonce": 31, "row0": 0, "rows": 4, "seed": 6}
    _write_from_elsewhere(old, [call])
    assert bytes(slot.buf) == before
    slot.close()


def test_bytes_outside_the_slot_are_refused_before_any_transfer():
    remote = Remote("tcp", "127.0.0.1:1", 4096, 1000)
    slot = mooncake.RemoteSlot.__new__(mooncake.RemoteSlot)
    slot.remote = remote
    with pytest.raises(RuntimeError, match=r"bytes \[990, 1010\) lie outside the slot"):
        slot._check(990, 20)


def test_the_staging_buffer_is_page_locked_where_cuda_is_available(monkeypatch):
    registered = []
    engine = type("Engine", (), {"register_memory": lambda self, a, n: registered.append(n) or 0})
    stage = mooncake._Staging().fit(engine(), 1000)
    assert stage.is_pinned() == torch.cuda.is_available() and registered == [1 << 16]
    if torch.cuda.is_available():  # and where it is not, pageable memory
        monkeypatch.setattr(mooncake.torch.cuda, "is_available", lambda: False)
        assert not mooncake._Staging().fit(engine(), 1000).is_pinned()


def test_an_environment_without_mooncake_is_told_what_to_install(repo):
    """The vLLM venv has no Mooncake: the transport names the wheel and the Debian packages."""
    code = (
        "from specforge_dspark.transport import mooncake as m\nm.transfer_engine('::1', 'tcp', '')"
    )
    r = subprocess.run(
        [str(repo / ".venv-vllm" / "bin" / "python"), "-c", code], capture_output=True, text=True
    )
    assert r.returncode != 0
    assert "mooncake-transfer-engine-non-cuda" in r.stderr and "libibverbs1" in r.stderr


def test_the_recipe_refuses_mooncake_where_no_writer_uses_it():
    base = {"draft": {"target_layer_ids": [0, 1], "num_target_layers": 4}}
    ok = recipe_from_dict({**base, "target": {"backend": "sglang", "transport": "mooncake"}})
    assert ok.target.mooncake.protocol == "tcp"
    with pytest.raises(RecipeError, match="target.transport=mooncake: only the sglang backend"):
        recipe_from_dict({**base, "target": {"backend": "hf", "transport": "mooncake"}})
    with pytest.raises(RecipeError, match="target.mooncake.protocol"):
        recipe_from_dict(
            {**base, "target": {"transport": "mooncake", "mooncake": {"protocol": "udp"}}}
        )


def test_the_server_command_for_a_capture_node(capsys):
    from specforge_dspark.cli.server_command import main

    args = ["--recipe", "recipes/tiny_cpu_sglang.yaml", "--host", "10.1.2.3"]
    assert main([*args, "target.transport=mooncake"]) == 0
    out = capsys.readouterr().out
    assert f"# {mooncake.HOST_ENV}=" in out
    assert "# SFDSPARK_API_KEY=<the API key the trainers hold in $<target.sglang" in out
    command = out.strip().splitlines()[-1]
    keyed = "python -m specforge_dspark.engines.keyed_launch sglang.launch_server --model-path "
    assert command.startswith(keyed) and "--api-key" not in command
    assert "--host 10.1.2.3" in command and "--enable-return-aux-hidden-states" in command
    assert main([*args, "target.backend=hf"]) == 2
    assert "this prints SGLang's" in capsys.readouterr().err


def test_a_server_that_writes_nothing_is_told_where_it_had_to_write():
    """Nothing arrives (a server that cannot reach the trainer's engine): the wait ends at
    its deadline naming the address the server had to write to, and the key that sets it."""
    from specforge_dspark.engines.served import ServedEngine

    exposer = Exposer("http://127.0.0.2:1", "tcp")
    slot = ShmSlot("mcsilent", aux_width=D, hidden=H, dtype=torch.float32, exposer=exposer)
    views = slot.prepare([4])
    code = DTYPE_CODES[torch.float32]
    slot.write_ticket(0, Ticket(PENDING, 4, 0, *views.offsets(0), D, H, code, nonce=5))
    engine = ServedEngine.__new__(ServedEngine)
    engine.engine, engine.url, engine.keeper, engine.timeout_s = "sglang", "http://x:1", None, 1.0
    engine.pid_file, engine._server_pid, engine._wrote = None, None, True
    with pytest.raises(TargetLost) as e:
        engine._wait_ticket(slot, 0, 4, 0.0, "batch 3")
    assert (
        f"answered batch 3 but wrote no features into slot {slot.location} within "
        "target.timeout_s=1s: it wrote features before" in str(e.value)
    )
    assert f"writes to this rank at {exposer.peer} (tcp)" in str(e.value)
    assert "target.mooncake.host" in str(e.value)
    slot.close()

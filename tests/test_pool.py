"""ServerPool's routing without servers (engines/pool.py): requests go to the live server
with the fewest outstanding tokens, a lost server's requests in flight are sent again to
the others while those in flight elsewhere are not sent twice, and the run stops naming
the pool once every server is lost; servers the node starts get their own ports and GPUs,
and a lost one rejoins once it answers again. The pool against live servers, one of them killed
mid-run: tests/test_sglang_live.py."""

from __future__ import annotations

import os

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, recipe_from_dict
from specforge_dspark.engines import pool as pool_module
from specforge_dspark.engines.pool import PORT_STRIDE, ServerPool, check_node_fits, started_servers
from specforge_dspark.engines.sglang import SGLangEngine, node_share
from specforge_dspark.transport.features import PaddedBatch, TargetGone, TargetLost

URLS = ["http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"]


class FakeServer:
    """A member: records what it was sent; `dead` makes its results fail."""

    engine = "sglang"
    identity_path = ""  # no model check unless a test sets one
    identity_fields = SGLangEngine.identity_fields

    def __init__(self, recipe, rank, world_size, num_slots, shared=None, index=0):
        s = recipe.target.sglang
        self.url = s.url or f"http://{s.host}:{s.port}"
        self.name, self.index, self.args = f"sglang server {self.url}", index, s.server_args
        self.shared, self.sent, self.dead, self.closed = shared, [], False, False
        self.released = self.restarted = 0
        self.up = True  # what answering() (and restart()) find after a release
        self.futures = {}
        self.api_key = os.environ.get("SFDSPARK_TEST_KEY")  # what an attached one reads

    def release(self):
        self.released += 1

    def answering(self):
        return self.up

    def restart(self):  # an attached one that stays down: TargetGone, as served.py says
        if not self.up:
            raise TargetGone(f"{self.name} did not answer again")
        self.restarted += 1
        self.dead = False

    def wait_ready(self):
        pass

    def submit(self, seq, batch):
        self.sent.append(seq)
        self.futures[seq] = batch

    def result(self, seq, batch, deadline):
        if self.dead:
            raise TargetLost(f"{self.name}: connection refused")
        return (self.url, seq)

    def close(self):
        self.closed = True


def _recipe(device: str = "cpu", **sglang):
    return recipe_from_dict(
        {
            "target": {
                "backend": "sglang",
                "device": device,
                # URLS are off the loopback: a key is named (FakeServer never reads it)
                "sglang": {"api_key_env": "SFDSPARK_TEST_KEY", **sglang},
            },
            "draft": {"target_layer_ids": [0, 1], "num_target_layers": 4},
        }
    )


def _batch(n: int) -> PaddedBatch:
    ids = torch.ones(1, n, dtype=torch.long)
    return PaddedBatch([n], ids, ids, torch.tensor([n]))


def test_requests_go_to_the_fewest_outstanding_tokens_and_a_lost_servers_move():
    pool = ServerPool(FakeServer, _recipe(urls=URLS), 0, 1, 4)
    a, b, c = pool.members
    assert a.shared is None and b.shared is a and c.shared is a  # one set of slots
    lengths = {0: 100, 1: 10, 2: 30, 3: 50}
    for seq, n in lengths.items():
        pool.submit(seq, _batch(n))
    # 0 -> a (all empty); 1 -> b; 2 -> c; 3 -> b (10 outstanding, fewest)
    assert (a.sent, b.sent, c.sent) == ([0], [1, 3], [2])
    assert pool.result(0, _batch(100), 0.0) == (URLS[0], 0)
    pool.submit(4, _batch(20))  # a now holds nothing
    assert a.sent == [0, 4]

    b.dead, b.up = True, False  # and it stays down
    with pytest.raises(TargetLost):
        pool.result(1, _batch(10), 0.0)
    pool.restart()  # the stream then re-sends every pending request, in order
    assert b.futures == {} and pool.resting == [b]  # its 1 and 3 are awaited elsewhere now
    for seq in (1, 2, 3, 4):
        pool.submit(seq, _batch(lengths.get(seq, 20)))
    assert pool.live == [a, c]
    # 2 (on c) and 4 (on a) are not sent again; b's 1 and 3 move: 1 -> a (20 outstanding
    # against c's 30), then 3 -> a (30 against 30: the first listed)
    assert (a.sent, c.sent) == ([0, 4, 1, 3], [2])
    assert [pool.result(s, _batch(1), 0.0)[0] for s in (1, 2, 3, 4)] == [
        URLS[0], URLS[2], URLS[0], URLS[0]
    ]  # fmt: skip

    a.dead = c.dead = True
    pool.submit(5, _batch(5))
    with pytest.raises(TargetLost):
        pool.result(5, _batch(5), 0.0)
    pool.restart()
    pool.submit(5, _batch(5))
    with pytest.raises(TargetLost):
        pool.result(5, _batch(5), 0.0)
    with pytest.raises(TargetGone, match=f"sglang server {URLS[1]} did not answer again"):
        pool.restart()  # every server lost: the wait for the first lost one, b, which stays down
    pool.close()
    assert a.closed and b.closed and c.closed


def test_a_pool_is_attached_and_named_once():
    with pytest.raises(RecipeError, match="set url .one server. or urls .a pool., not both"):
        _recipe(url=URLS[0], urls=URLS[1:])
    r = _recipe(urls=URLS, startup_timeout_s=10**6)  # attached: no restart budget applies
    assert r.target.sglang.urls == URLS


def test_started_servers_get_their_own_ports_and_gpus_and_a_lost_one_comes_back(monkeypatch):
    recipe = _recipe("cuda", servers_per_node=3, port=31000, server_args={"tp_size": 2})
    gpus = [m.args.get("base_gpu_id", 0) for m in ServerPool(FakeServer, recipe, 0, 1, 4).members]
    assert gpus == [0, 2, 4]  # tp 2 each
    assert recipe.target.sglang.server_args == {"tp_size": 2}  # the caller's recipe as it was
    recipe = _recipe(servers_per_node=3, port=31000, server_args={"tp_size": 2})
    pool = ServerPool(FakeServer, recipe, 0, 1, 4)
    a, b, c = pool.members
    assert [m.url for m in pool.members] == [
        f"http://127.0.0.1:{31000 + i * PORT_STRIDE}" for i in range(3)
    ]
    assert [m.args.get("base_gpu_id", 0) for m in pool.members] == [0, 0, 0]  # CPU: cores
    assert [m.index for m in pool.members] == [0, 1, 2] and b.shared is a

    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    for seq in range(3):
        pool.submit(seq, _batch(10))
    b.dead, b.up = True, False
    with pytest.raises(TargetLost):
        pool.result(1, _batch(10), 0.0)
    pool.restart()
    assert pool.live == [a, c] and pool.resting == [b] and b.released == 1
    pool.submit(1, _batch(10))  # b's request goes to another: b does not answer yet
    assert b.sent == [1] and a.sent == [0, 1]
    b.up = True
    pool.submit(3, _batch(1))  # within READMIT_S of the last look: not looked at again
    assert pool.live == [a, c]
    clock[0] += pool_module.READMIT_S
    pool.submit(4, _batch(1))  # b answers again: back, in its place, and the least loaded
    assert pool.live == [a, b, c] and pool.resting == [] and b.sent == [1, 4]

    for m in (a, b, c):  # every server lost: the run waits for the first to come back
        m.dead = True
        pool.lost = m
        pool.restart()
    assert a.restarted == 1 and pool.live == [a] and pool.resting == [b, c]
    assert (a.released, b.released, c.released) == (1, 2, 1)


def test_servers_per_node_is_for_started_servers(monkeypatch):
    with pytest.raises(RecipeError, match="servers_per_node: servers the trainer starts"):
        _recipe(servers_per_node=2, urls=URLS)
    with pytest.raises(RecipeError, match="servers_per_node must be >= 1"):
        _recipe(servers_per_node=0)
    r = _recipe("cuda", servers_per_node=2, port=30000, server_args={"tp_size": 4})
    assert started_servers(r) == (  # the dry run's line
        "servers each node starts (target.sglang.servers_per_node=2): port 30000 on GPUs 0-3; "
        "port 30016 on GPUs 4-7"
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert [node_share(i, 2) for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [node_share(i, 7) for i in (0, 6)] == [[0], [1]]  # fewer cores than servers


def test_an_attached_server_rejoins_and_a_server_of_another_model_is_refused(monkeypatch):
    monkeypatch.setenv("SFDSPARK_TEST_KEY", "k3y")
    said = {url: {"model_path": "/m/x", "dtype": "bfloat16", "quantization": None} for url in URLS}
    said[URLS[2]] = {**said[URLS[2]], "quantization": "fp8", "served_model_name": "x"}
    asked = []  # the key each GET carried
    get = lambda url, key: asked.append(key) or said[url.rsplit("/", 1)[0]]  # noqa: E731
    monkeypatch.setattr(pool_module, "_get_json", get)
    monkeypatch.setattr(FakeServer, "identity_path", "/server_info")
    pool = ServerPool(FakeServer, _recipe(urls=URLS), 0, 1, 4)
    with pytest.raises(ValueError) as e:
        pool.wait_ready()
    assert str(e.value) == (
        f"target.sglang.urls: every server must serve the same model; {URLS[2]} serves "
        "{'model_path': '/m/x', 'dtype': 'bfloat16', 'quantization': 'fp8'}, "
        f"{URLS[0]} serves {{'model_path': '/m/x', 'dtype': 'bfloat16', 'quantization': None}}"
    )
    said[URLS[2]]["quantization"] = None
    pool = ServerPool(FakeServer, _recipe(urls=URLS), 0, 1, 4)
    pool.wait_ready()
    a, b, c = pool.members
    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    pool.submit(0, _batch(10))
    a.dead = True
    with pytest.raises(TargetLost):
        pool.result(0, _batch(10), 0.0)
    pool.restart()
    assert pool.live == [b, c] and pool.resting == [a] and a.futures == {}
    said[URLS[0]]["dtype"] = "float16"  # it came back serving something else
    clock[0] += pool_module.READMIT_S
    with pytest.raises(ValueError, match=f"{URLS[0]} serves .*'float16'"):
        pool.submit(1, _batch(1))
    said[URLS[0]]["dtype"] = "bfloat16"
    clock[0] += pool_module.READMIT_S
    pool.submit(2, _batch(1))  # the attached server answers again: back in the pool
    assert pool.live == [a, b, c] and pool.resting == [] and a.sent == [0, 2]
    assert asked and set(asked) == {"k3y"}  # every look carried the servers' key


def test_the_dry_run_refuses_more_started_servers_than_the_node_has_gpus(tmp_path, capsys):
    import train

    fits = _recipe("cuda", servers_per_node=2, server_args={"tp_size": 4})
    check_node_fits(fits, 8)
    check_node_fits(_recipe(servers_per_node=3, server_args={"tp_size": 4}), 8)  # CPU: cores
    over = _recipe("cuda", servers_per_node=2, server_args={"tp_size": 4, "base_gpu_id": 4})
    with pytest.raises(ValueError, match=r"servers_per_node=2 servers of 4 GPU\(s\) each "
                       r".* from base_gpu_id 4 need GPUs 4-11; a node has 8"):  # fmt: skip
        check_node_fits(over, 8)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "target: {backend: sglang, device: cuda, sglang: {servers_per_node: 3, "
        "server_args: {tp_size: 4}}}\ndraft: {target_layer_ids: [0, 1], num_target_layers: 4}\n"
    )
    assert train.main(["--recipe", str(recipe), "--dry-run", "--gpus-per-node", "8"]) == 2
    assert "need GPUs 0-11; a node has 8" in capsys.readouterr().err

"""A pool of target servers feeding one trainer rank: attached (`target.sglang.urls`) or
started by the node (`target.sglang.servers_per_node`).

N servers (attached ones anywhere: with `target.transport: mooncake` they write into this
rank's slots over the network) serve M trainer ranks in any ratio: every rank holds a
`ServerPool` of one engine per server, all writing to the rank's one set of slots (a
member built with `shared=` the first), so the stream's slot discipline is the single
server's. Started servers: the node's local rank 0 starts server i on port + 16 i
(PORT_STRIDE: SGLang derives ports of its own above a server's port) with the GPUs from
base_gpu_id + i x (tp x dp x pp), or on the CPU engine its share of the cores (CPU_BIND).

Balancing: each request goes to the live server with the fewest outstanding tokens
(its requests sent and not yet taken back), ties to the one listed first.

A lost server: the member whose request failed (TargetLost: unreachable, gone, its writer
failed, no features by the deadline; TimeoutError: no answer within target.timeout_s) is
dropped by `restart()`, which the stream calls before it re-sends its pending requests
in order (training/stream.py); a request still in flight on a live server is not sent
twice (`submit` skips it), those of the lost server go to the others (their futures on
the lost one dropped), each in a fresh slot file or registration (served.py `submit`),
so the rank trains every sample once, in order and never from a late write of the lost
server. A lost server is released (a started one killed if hung, for its keeper to start
again) and rejoins once it answers (looked at every READMIT_S, no probe: the same
command, or the same attached server, came back). Once every server is lost the run
waits for the first lost one as a single server's run does: a started one within
target.max_restarts, an attached one within startup_timeout_s, then stops (TargetGone,
resumable: run_status.json) naming it.

One model: every member must serve what the first serves (the engine's `identity_fields`:
SGLang's model path, dtype and quantization from /server_info), checked when the pool
starts and when a member rejoins; a member that serves another is refused, naming both.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import urllib.request
from typing import Any

import torch

from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.transport.features import PaddedBatch, TargetFeatures, TargetGone, TargetLost

PORT_STRIDE = 16
READMIT_S = 2.0
CPU_BIND = """On SGLang's CPU engine a rank's gpu id picks its entry of SGLANG_CPU_OMP_THREADS_BIND
(utils/numa_utils.py `init_threads_binding`): each started CPU server keeps base_gpu_id 0
and gets a bind list of its own share of the cores (sglang.node_share) instead."""


def member_recipes(recipe, engine: str) -> list:
    """One recipe per server of the pool: each attached URL, or each started server's
    port and GPUs (module docstring)."""
    section = getattr(recipe.target, engine)
    if section.urls:
        return [_with(recipe, engine, url=url) for url in section.urls]
    gpus, base = gpus_per_server(section), int(section.server_args.get("base_gpu_id", 0))
    gpus = 0 if recipe.target.device == "cpu" else gpus  # SGLang's CPU engine: see CPU_BIND
    return [
        _with(recipe, engine, port=section.port + i * PORT_STRIDE, base_gpu_id=base + i * gpus)
        for i in range(section.servers_per_node)
    ]


def gpus_per_server(section) -> int:
    """tp x dp x pp of a server section's server_args (sglang.server_ranks of its flags)."""
    from specforge_dspark.engines.launch import cli_flag
    from specforge_dspark.engines.sglang import server_ranks

    return server_ranks([f for k, v in section.server_args.items() for f in cli_flag(k, v)])


def check_node_fits(recipe, gpus_per_node: int, engine: str = "sglang") -> None:
    """ValueError when the servers a node starts (target.<engine>.servers_per_node, each
    on tp x dp x pp GPUs from base_gpu_id) need more GPUs than the node has."""
    section = getattr(recipe.target, engine, None)
    if recipe.target.device == "cpu" or section is None or recipe.target.backend != engine:
        return
    if section.url or getattr(section, "urls", None):
        return  # attached: not started on this node
    servers, gpus = getattr(section, "servers_per_node", 1), gpus_per_server(section)
    base = int(section.server_args.get("base_gpu_id", 0))
    if base + servers * gpus > gpus_per_node:
        raise ValueError(
            f"target.{engine}.servers_per_node={servers} servers of {gpus} GPU(s) each "
            f"(tp x dp x pp of server_args) from base_gpu_id {base} need GPUs {base}-"
            f"{base + servers * gpus - 1}; a node has {gpus_per_node}"
        )


def started_servers(recipe, engine: str = "sglang") -> str:
    """The dry run's line for the servers a node starts (target.<engine>.servers_per_node)."""
    members = member_recipes(recipe, engine)
    gpus, where = gpus_per_server(getattr(recipe.target, engine)), []
    cpu = recipe.target.device == "cpu"
    for one in members:
        s = getattr(one.target, engine)
        first = int(s.server_args.get("base_gpu_id", 0))
        place = "a share of the cores" if cpu else f"GPUs {first}-{first + gpus - 1}"
        where.append(f"port {s.port} on {place}")
    return (
        f"servers each node starts (target.{engine}.servers_per_node={len(members)}): "
        + "; ".join(where)
    )


def _with(recipe, engine: str, base_gpu_id: int | None = None, **fields):
    one = copy.deepcopy(recipe)
    section = getattr(one.target, engine)
    for key, value in fields.items():
        setattr(section, key, value)
    if base_gpu_id:
        section.server_args["base_gpu_id"] = base_gpu_id
    return one


class ServerPool:
    """The stream's engine (training/stream.Engine) over several servers of one engine."""

    def __init__(self, engine_cls, recipe, rank: int, world_size: int, num_slots: int):
        engine = engine_cls.engine
        section = getattr(recipe.target, engine)
        self.rank = rank
        self.key = f"target.{engine}." + ("urls" if section.urls else "servers_per_node")
        if not section.urls and recipe.target.device != "cpu" and torch.cuda.is_available():
            check_node_fits(recipe, torch.cuda.device_count(), engine)
        self.members = []
        for i, one in enumerate(member_recipes(recipe, engine)):
            shared = self.members[0] if self.members else None
            member = engine_cls(one, rank, world_size, num_slots, shared=shared, index=i)
            self.members.append(member)
        self.live = list(self.members)
        self.resting = []  # servers lost, until they answer again
        self.model: dict[str, Any] | None = None  # what the first member serves
        self._look_at = 0.0  # when readmit() next looks at them
        self.assigned: dict[int, tuple[object, int]] = {}  # seq -> (member, tokens)
        self.lost = None  # the member whose request failed last
        self.sent = [0] * len(self.members)  # requests sent to each member

    @property
    def name(self) -> str:
        urls = ", ".join(m.url for m in self.live)
        return f"{self.members[0].engine} pool of {len(self.live)} live server(s) ({urls})"

    @property
    def url(self) -> str:
        """A live server's URL (the preflight's rollouts go there)."""
        return self.live[0].url

    @property
    def api_key(self) -> str | None:
        """That server's API key."""
        return self.live[0].api_key

    def outstanding(self, member) -> int:
        return sum(tokens for m, tokens in self.assigned.values() if m is member)

    def wait_ready(self) -> None:
        for member in self.live:
            member.wait_ready()
            self.same_model(member)

    def same_model(self, member) -> None:
        """ValueError when `member` serves another model than the pool's first member."""
        if not member.identity_path:
            return
        info = _get_json(f"{member.url}{member.identity_path}", member.api_key)
        said = {key: info.get(key) for key in member.identity_fields}
        if self.model is None:
            self.model = {"server": member.url, **said}
            return
        want = {k: v for k, v in self.model.items() if k != "server"}
        if said != want:
            raise ValueError(
                f"{self.key}: every server must serve the same model; {member.url} serves "
                f"{said}, {self.model['server']} serves {want}"
            )

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        if seq in self.assigned:  # in flight on a live server: a re-send after a loss
            return
        self.readmit()
        member = min(self.live, key=self.outstanding)  # min: the first listed on ties
        member.submit(seq, batch)
        self.assigned[seq] = (member, int(batch.lengths.sum()))
        self.sent[self.members.index(member)] += 1

    def readmit(self) -> None:
        """Started servers that answer again rejoin (at most every READMIT_S)."""
        now = time.monotonic()
        if not self.resting or now < self._look_at:
            return
        self._look_at = now + READMIT_S
        for member in [m for m in self.resting if m.answering()]:
            self.same_model(member)
            self.resting.remove(member)
            self.live = [m for m in self.members if m in self.live or m is member]
            _say(f"[rank {self.rank}] {member.name} answers again: back in {self.key}")

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        member = self.assigned[seq][0]
        try:
            feats = member.result(seq, batch, deadline)
        except (TargetLost, TimeoutError):
            self.lost = member
            raise
        del self.assigned[seq]
        return feats

    def restart(self) -> None:
        """Drop the server whose request failed; its requests are sent again (module
        docstring). With every server lost: the wait for the first lost one to answer
        again (a started one: TargetLost or TimeoutError when it does not, and the
        stream tries again within target.max_restarts; an attached one: TargetGone)."""
        lost, self.lost = self.lost, None
        if lost in self.live:
            self.live.remove(lost)
            moved = [seq for seq, (m, _) in self.assigned.items() if m is lost]
            for seq in moved:
                del self.assigned[seq]
                lost.futures.pop(seq, None)  # its reply, if any, is no longer awaited
            lost.release()  # a hung started one is killed: its keeper starts it again
            self.resting.append(lost)
            self._look_at = time.monotonic() + READMIT_S  # not back before it had the time
            _say(
                f"[rank {self.rank}] {lost.name} is lost: dropped from {self.key} until it "
                f"answers again; its {len(moved)} request(s) in flight go to the "
                f"{len(self.live)} other(s)"
            )
        if self.live:
            return
        if not self.resting:
            raise TargetGone(f"every server of {self.key} is lost ({lost and lost.name})")
        back = self.resting[0]
        back.restart()
        self.same_model(back)
        self.resting.remove(back)
        self.live = [back]

    def close(self) -> None:
        for member in reversed(self.members):  # the first owns the slots: closed last
            member.close()


def _get_json(url: str, key: str | None) -> dict[str, Any]:
    """A server's JSON answer to a GET carrying `key` (TargetLost when it cannot be
    reached)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers(key)),
                                    timeout=30.0) as r:  # fmt: skip
            return json.loads(r.read())
    except OSError as e:
        raise TargetLost(f"GET {url}: {type(e).__name__}: {e}") from None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

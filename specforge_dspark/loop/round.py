"""Rounds of the closed loop, every phase resumable (state.json names the phases done):

  record  the serving engine answers this round's traffic, and the gateway's logs of the
          users' requests are read (logs.py); each request journaled once
  mine    the next mix: lowest served acceptance first, plus a replay share (mine.py)
  train   train.py from the serving drafter's weights on the mix, `steps_per_round` steps
  gate    the engine decodes the held-out requests (and the guard workloads) with the
          serving drafter and with the candidate: promoted only on a paired gain, with
          every answer equal on both (lossless) and no workload losing more than the
          margin (gate.py)
  swap    the candidate's server, already up and judged, takes an old server's place
          behind the loop's stable address (front.py), the old one stopping once it has
          none in flight, then the other `replicas` one at a time (a rolling restart: no
          request dropped); a refused candidate's server stops and the serving drafter
          keeps serving

Under loop.dir: records.jsonl, lineage.json, state.json, servers/*.log and
rounds/<r>/{mix.jsonl, mine.json, train/, gate.json, round.json}."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge_dspark.decoding.intervals import paired_difference, unpaired_difference
from specforge_dspark.decoding.prompts import render
from specforge_dspark.engines.launch import free_port
from specforge_dspark.engines.sglang import ServerProcess
from specforge_dspark.loop.front import Front
from specforge_dspark.loop.gate import Lineage, gate, gate_items, positions
from specforge_dspark.loop.logs import ingest_logs
from specforge_dspark.loop.mine import held_out, mine, replay_rows
from specforge_dspark.loop.records import Journal
from specforge_dspark.loop.serve import ENGINES, record_traffic, stop_token_ids, traffic_requests
from specforge_dspark.serving.vllm import check_same_layout

PHASES = ("record", "mine", "train", "gate", "swap")
REPO = Path(__file__).resolve().parents[2]


def _units(served: dict) -> tuple[int, int]:
    """A served request's (committed tokens, verify steps), as the engine counts them."""
    return served["completion_tokens"] - 1, max(served["verify_ct"], 1)


def write_json(path: Path, obj: Any) -> None:
    """`obj` as JSON at `path`, whole or not at all (rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


@dataclass
class Served:
    """A live drafter-serving server: which version, its process and URL."""

    version: int
    proc: ServerProcess | None  # None: attached (loop.attach), not the loop's to stop
    url: str


@dataclass
class Loop:
    recipe: Any
    overrides: list[str] = field(default_factory=list)
    nproc: int = 2
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        lp, t = self.recipe.loop, self.recipe.target
        self.root = Path(lp.dir or Path(self.recipe.train.output_dir) / "loop")
        (self.root / "servers").mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.root / "records.jsonl")
        self.lineage = Lineage(self.root / "lineage.json")
        if not self.lineage.versions:
            first = lp.serve_from or self.recipe.draft.init_from
            if not first or not Path(first).is_dir():
                raise ValueError(
                    f"loop: no serving drafter: set loop.serve_from (or draft.init_from) to an "
                    f"exported drafter directory (got {first!r})"
                )
            self.lineage.add(str(first), None, None, round=None)
        state = self.root / "state.json"
        self.state = json.loads(state.read_text()) if state.is_file() else {
            "round": 0, "done": [], "used": []}  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(t.path)
        self.stop_ids = stop_token_ids(t.path, self.tokenizer)
        self.pool: list[Served] = []  # the serving version's replicas behind the front
        host, _, port = lp.listen.rpartition(":")
        self.front = Front(host, int(port))  # the address users keep through swaps (front.py)
        write_json(self.root / "front.json", {"url": self.front.url, "pid": os.getpid()})
        self.log(f"loop: the serving address is {self.front.url}")
        self.candidate: Served | None = None  # judged by the gate, served or stopped by the swap

    # -- bookkeeping ----------------------------------------------------------------
    def round_dir(self) -> Path:
        d = self.root / "rounds" / str(self.state["round"])
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _done(self, phase: str, **update) -> None:
        self.state.update(update)
        self.state["done"].append(phase)
        if phase == PHASES[-1]:
            self.state.update(round=self.state["round"] + 1, done=[])
        write_json(self.root / "state.json", self.state)

    def start(self, version: int, export: str | Path | None = None) -> Served:
        """A server for `version` (its export, or `export` for a candidate not yet in the
        lineage); a reaper stops it if this process dies."""
        export = Path(export or self.lineage.versions[version]["export"])
        t, engine = self.recipe.target, ENGINES[self.recipe.loop.engine]
        port = free_port()
        log = self.root / "servers" / f"v{version}-{port}.log"
        t0 = time.monotonic()
        served = export.parent / engine.layout  # the lineage names the sglang layout
        kw = {"reloadable": True} if self.recipe.loop.swap == "reload" else {}
        proc, url = engine.start(t.path, served, port, log, t.device, t.dtype, engine.python(t),
                                 **kw)  # fmt: skip
        self.log(
            f"loop: version {version} serving at {url} ({time.monotonic() - t0:.0f}s to start)"
        )
        return Served(version, proc, url)

    def ensure_serving(self) -> Served:
        version = self.lineage.serving()["version"]
        if not self.pool and self.recipe.loop.attach:
            # a deployment the loop did not start: loaded with the serving version (what it
            # serves unless a kill landed between a promotion and its swap), then kept
            self.pool = [Served(version, None, url.rstrip("/")) for url in self.recipe.loop.attach]
            self.serve(self.pool[0], force=True)
            for member in self.pool:
                self.front.add(member.url)
            self.log(f"loop: version {version} serves at {len(self.pool)} attached server(s)")
        if not self.pool or self.pool[0].version != version:
            self.serve(self.start(version))
        return self.pool[0]

    def serve(self, new: Served, force: bool = False) -> None:
        """`new` and `loop.replicas` - 1 more servers of its version take the front's
        requests one member at a time (a rolling restart): each old member stops once it
        has none in flight, and the pool never has fewer members than before. With
        `loop.swap: reload` the serving members load `new`'s drafter in place instead
        (the engine's draft weight update; `force`: even where the version is the same)
        and `new`'s own server stops."""
        if self.recipe.loop.swap == "reload" and self.pool:
            engine = ENGINES[self.recipe.loop.engine]
            export = Path(self.lineage.versions[new.version]["export"]).parent / engine.layout
            for member in self.pool:  # before any update: a failed load stops vLLM's engine
                serving = self.lineage.versions[member.version]["export"]
                check_same_layout(Path(serving).parent / engine.layout, export)
            for member in self.pool:
                if force or member.version != new.version:
                    engine.update(member.url, export, f"v{new.version}")
                member.version = new.version
            if new not in self.pool and new.proc is not None:
                new.proc.stop()
            return
        old, members = self.pool, []
        for i in range(self.recipe.loop.replicas):
            member = new if i == 0 else self.start(new.version)
            members.append(member)
            if i < len(old):
                self.front.replace(old[i].url, member.url)
                old[i].proc.stop()
            else:
                self.front.add(member.url)
            self.pool = members + old[i + 1 :]

    def close(self) -> None:
        self.front.close()  # the requests in flight are answered before their servers stop
        for member in self.pool:
            if member.proc is not None:  # an attached server serves on
                member.proc.stop()
        self.pool = []

    # -- one round ----------------------------------------------------------------
    def run_round(self, stop_after: str | None = None) -> dict | None:
        """The current round's remaining phases (up to `stop_after`); its round.json once
        the swap is done."""
        rd, times_path = self.round_dir(), self.round_dir() / "times.json"
        times = json.loads(times_path.read_text()) if times_path.is_file() else {}
        seconds, windows = times.setdefault("seconds", {}), times.setdefault("windows", {})
        for phase in PHASES:
            if phase in self.state["done"]:
                continue
            t0, wall = time.monotonic(), time.time()
            getattr(self, f"_{phase}")(rd)
            seconds[phase] = round(seconds.get(phase, 0) + time.monotonic() - t0, 1)
            windows[phase] = [round(wall, 3), round(time.time(), 3)]  # its last run's
            write_json(times_path, times)
            self._done(phase)
            if phase == stop_after and phase != PHASES[-1]:
                return None
        summary = {
            "round": int(rd.name),
            "seconds": seconds,
            "windows": windows,  # wall-clock [start, end] of each phase
            "front": dict(self.front.counts),  # requests through the address since start
            "mine": json.loads((rd / "mine.json").read_text()),
            "gate": json.loads((rd / "gate.json").read_text()),
            "serving_after": self.lineage.serving()["version"],
        }
        write_json(rd / "round.json", summary)
        return summary

    def _record(self, rd: Path) -> None:
        lp, rnd = self.recipe.loop, self.state["round"]
        if lp.request_logs:
            counts = ingest_logs(lp.request_logs, self.journal,
                                 f"v{self.lineage.serving()['version']}")  # fmt: skip
            self.log(f"loop: round {rnd}: {counts['recorded']} logged requests journaled, "
                     f"{counts['already']} already journaled")  # fmt: skip
        if lp.traffic:
            served = self.ensure_serving()
            reqs = traffic_requests(lp.traffic, lp.requests_per_round, rnd)
            counts = record_traffic(self.front.url, self.tokenizer, self.stop_ids, reqs,
                                    self.journal, f"v{served.version}", lp.max_new_tokens,
                                    lp.engine)  # fmt: skip
            self.log(f"loop: round {rnd}: {counts['recorded']} requests recorded, "
                     f"{counts['already']} already journaled")  # fmt: skip
        self._watch(rd)

    def _watch(self, rd: Path) -> None:
        """A promoted drafter's served accept length against its parent's, each on the
        traffic it served (unpaired: different requests). A drop whose interval lies
        wholly below -forget_margin is put to the engine: it decodes the held-out requests
        the new version served with both drafters, and only if the parent is better there
        (paired interval above 0) is the new version rolled back and the parent serves
        again. rounds/<r>/watch.json says what was seen."""
        path, serving = rd / "watch.json", self.lineage.serving()
        if not path.is_file():
            if serving["parent"] is None:
                return  # the first version: nothing to compare with
            rows = self.journal.rows()
            now = [r for r in rows if r["drafter"] == f"v{serving['version']}"]
            before = [r for r in rows if r["drafter"] == f"v{serving['parent']}"]
            if not now or not before:
                return
            served = unpaired_difference(*([_units(r["served"]) for r in x] for x in (now, before)))
            seen = {"version": serving["version"], "parent": serving["parent"],
                    "served": served, "confirmed": None, "roll_back": False}  # fmt: skip
            if served["ci"][1] < -self.recipe.loop.forget_margin:
                held = [r for r in now if held_out(r["id"], self.recipe.loop.holdout_share)]
                items = [(r["id"], r["messages"][:-1]) for r in held or now]
                parent = self.start(serving["parent"])
                try:
                    figs = [self.decode(u, items) for u in (parent.url, self.ensure_serving().url)]
                except BaseException:
                    parent.proc.stop()
                    raise
                paired = paired_difference(*({k: _units(f) for k, f in d.items()} for d in figs))
                seen.update(confirmed=paired, roll_back=paired["better"] == "a")
                if seen["roll_back"]:
                    self.candidate = parent  # up and judged: it takes the requests below
                else:
                    parent.proc.stop()
            write_json(path, seen)
        seen = json.loads(path.read_text())
        if not seen["roll_back"]:
            return
        if self.lineage.versions[seen["version"]]["promoted"]:
            d, ci = seen["confirmed"]["difference"], seen["confirmed"]["ci"]
            self.lineage.roll_back(seen["version"], f"served regression: parent v"
                                   f"{seen['parent']} better by {d:+.3f} {ci} paired")  # fmt: skip
        parent, self.candidate = self.candidate, None
        if parent is not None:
            self.serve(parent)
        self.ensure_serving()
        self.log(f"loop: version {seen['version']} rolled back; version "
                 f"{self.lineage.serving()['version']} serves again")  # fmt: skip

    def _mine(self, rd: Path) -> None:
        lp = self.recipe.loop
        mix, report = mine(self.journal.rows(), replay_rows(self.recipe), lp.rows_per_round,
                           lp.replay_share, lp.holdout_share, set(self.state["used"]),
                           seed=self.state["round"],
                           position_weights=lp.position_weights)  # fmt: skip
        if not report["mined"]:
            raise RuntimeError(
                f"loop: round {self.state['round']}: no recorded request left to train on "
                f"({report['traffic_records']} recorded; raise loop.requests_per_round)"
            )
        tmp = rd / "mix.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in mix))
        os.replace(tmp, rd / "mix.jsonl")
        write_json(rd / "mine.json", report)
        fresh = [r["id"] for r in mix if not r["id"].startswith("replay:")]
        self.state["used"] = sorted(set(self.state["used"]) | set(fresh))
        self.log(f"loop: mined {report['mined']} requests + {report['replayed']} replayed rows; "
                 f"served accept length {report['served_accept_length']}")  # fmt: skip

    def train_command(self, rd: Path) -> list[str]:
        lp = self.recipe.loop
        serving = self.lineage.serving()["export"]
        formats = sorted({"sglang", ENGINES[lp.engine].layout})  # the lineage names sglang's
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
            "--master_port", str(free_port()), str(REPO / "train.py"),
            "--recipe", self.recipe.source, "--resume", "auto", *self.overrides,
            f"train.output_dir={rd / 'train'}", f"train.max_steps={lp.steps_per_round}",
            "train.epochs=100000",  # the step budget ends the round, not the mix's size
            f"draft.init_from={serving}", f"data.train_files=[{rd / 'mix.jsonl'}]",
            "data.format=messages", "data.eval_files=[]", "data.max_rows=0",
            "train.eval_interval=0", f"export.formats=[{','.join(formats)}]",
        ]  # fmt: skip

    def _train(self, rd: Path) -> None:
        cmd = self.train_command(rd)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with (rd / "train.log").open("a") as out:
            code = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            ).returncode
        if code != 0:
            raise RuntimeError(f"loop: training exited {code}; see {rd / 'train.log'}")

    def decode(self, url: str, items: list[tuple[str, list[dict]]]) -> dict[str, dict]:
        out = {}
        ask = ENGINES[self.recipe.loop.engine].ask
        for rid, messages in items:
            ids = render(self.tokenizer, messages)
            tokens, figures = ask(url, ids, self.recipe.loop.max_new_tokens, self.stop_ids)
            out[rid] = {**figures, "tokens": tokens}
        return out

    def gate_items(self) -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
        return gate_items(self.journal.rows(), self.recipe.loop)

    def _gate(self, rd: Path) -> None:
        export = rd / "train" / "export" / "sglang"
        items, workload_of = self.gate_items()
        serving = self.ensure_serving()
        cand = self.start(len(self.lineage.versions), export)  # the version it would become
        try:
            old = self.decode(serving.url, items)
            new = self.decode(cand.url, items)
        except BaseException:
            cand.proc.stop()
            raise
        self.candidate = cand
        differ = sorted(k for k in old if old[k]["tokens"] != new[k]["tokens"])

        decision = gate(*({k: _units(f) for k, f in d.items()} for d in (new, old)), workload_of,
                        self.recipe.loop.forget_margin)  # fmt: skip
        if differ:
            decision.promote = False
            decision.why = (
                f"not lossless: {len(differ)} answers differ ({differ[:3]}); {decision.why}"
            )
        write_json(rd / "gate.json", {
            "candidate": str(export), "serving_version": serving.version,
            "promote": decision.promote, "why": decision.why, "overall": decision.overall,
            "workloads": decision.workloads, "requests": len(items), "answers_differ": len(differ),
            "serving_figures": old, "candidate_figures": new, "positions": positions(old, new),
        })  # fmt: skip
        self.log(f"loop: gate: {'PROMOTE' if decision.promote else 'keep serving'}: {decision.why}")

    def _swap(self, rd: Path) -> None:
        from specforge_dspark.loop.gate import Decision

        g = json.loads((rd / "gate.json").read_text())
        rnd = int(rd.name)
        if any(v.get("round") == rnd for v in self.lineage.versions):  # added before a kill
            version = next(v["version"] for v in self.lineage.versions if v.get("round") == rnd)
        else:
            decision = Decision(g["promote"], g["why"], g["overall"], g["workloads"])
            version = self.lineage.add(g["candidate"], g["serving_version"], decision, round=rnd)
        cand, self.candidate = self.candidate, None
        if not g["promote"]:
            if cand is not None:
                cand.proc.stop()
            self.log(f"loop: version {version} kept, not serving; version "
                     f"{self.lineage.serving()['version']} serves on")  # fmt: skip
            return
        # blue/green: the candidate's server is up and judged; it serves before the old stops
        new = cand if cand is not None else self.start(version)
        new.version = version
        self.serve(new)
        at = ", ".join(m.url for m in self.pool)  # in place (reload): the same servers
        self.log(f"loop: version {version} now serves at {at} (behind {self.front.url})")

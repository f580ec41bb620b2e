"""A pool of target servers feeding one trainer rank (`target.sglang.urls`).

N attached servers (anywhere: with `target.transport: mooncake` they write into this
rank's slots over the network) serve M trainer ranks in any ratio: every rank holds a
`ServerPool` of one engine per URL, all writing to the rank's one set of slots (a member
built with `shared=` the first), so the stream's slot discipline is the single server's.

Balancing: each request goes to the live server with the fewest outstanding tokens
(its requests sent and not yet taken back), ties to the one listed first.

A lost server: the member whose request failed (TargetLost: unreachable; TimeoutError:
no answer within target.timeout_s) is dropped by `restart()`, which the stream calls
before it re-sends its pending requests in order (training/stream.py); a request still in
flight on a live server is not sent twice (`submit` skips it), those of the lost server
go to the others, so the rank trains every sample once, in order. Once every server is
lost the run stops (TargetGone) naming them.
"""

from __future__ import annotations

import copy
import sys

from specforge_dspark.engines.features import PaddedBatch, TargetFeatures, TargetGone, TargetLost


class ServerPool:
    """The stream's engine (training/stream.Engine) over several servers of one engine."""

    def __init__(self, engine_cls, recipe, rank: int, world_size: int, num_slots: int):
        section = getattr(recipe.target, engine_cls.engine)
        self.rank, self.key = rank, f"target.{engine_cls.engine}.urls"
        self.members = []
        for url in section.urls:
            one = copy.deepcopy(recipe)
            getattr(one.target, engine_cls.engine).url = url
            shared = self.members[0] if self.members else None
            self.members.append(engine_cls(one, rank, world_size, num_slots, shared=shared))
        self.live = list(self.members)
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

    def outstanding(self, member) -> int:
        return sum(tokens for m, tokens in self.assigned.values() if m is member)

    def wait_ready(self) -> None:
        for member in self.live:
            member.wait_ready()

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        if seq in self.assigned:  # in flight on a live server: a re-send after a loss
            return
        member = min(self.live, key=self.outstanding)  # min: the first listed on ties
        member.submit(seq, batch)
        self.assigned[seq] = (member, int(batch.lengths.sum()))
        self.sent[self.members.index(member)] += 1

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
        docstring). TargetGone once none is left."""
        lost, self.lost = self.lost, None
        if lost in self.live:
            self.live.remove(lost)
            moved = [seq for seq, (m, _) in self.assigned.items() if m is lost]
            for seq in moved:
                del self.assigned[seq]
            print(
                f"[rank {self.rank}] {lost.name} is lost: dropped from {self.key}; its "
                f"{len(moved)} request(s) in flight go to the {len(self.live)} other(s)",
                file=sys.stderr,
                flush=True,
            )
        if not self.live:
            raise TargetGone(f"every server of {self.key} is lost ({lost and lost.name})")

    def close(self) -> None:
        for member in reversed(self.members):  # the first owns the slots: closed last
            member.close()

"""What regeneration asks the target: input rows -> jobs, one per answer to make.

A row's id is its `id` field, else "file:row"; with `data.regenerate.samples` N > 1 the
further answers to a row are jobs "<id>#1" .. "<id>#N-1", so `check_ids` refuses input
ids containing SEPARATOR before anything is generated (an input id "a#1" beside "a"
would be written twice and abort the run).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from data_pipelines.formats import (
    ROLE_ALIASES,
    FormatConfig,
    Message,
    RowError,
    detect_format,
    parse_turn,
)
from data_pipelines.ingest import RawRow, read_rows
from data_pipelines.journal import Journal

SEPARATOR = "#"
"""Between a row's id and its sample number: "<id>#k"."""


def row_id(raw: RawRow) -> str:
    """The id of an input row: its `id` field (str or int), else "file:row"."""
    value = raw.value
    if raw.error is None and isinstance(value, dict):
        if isinstance(value.get("id"), str | int) and not isinstance(value["id"], bool):
            return str(value["id"])
    return raw.source


def input_rows(files: list[str], max_rows: int) -> Iterator[RawRow]:
    """The rows regenerated: the non-blank rows of each file, at most `max_rows` of each
    (0: all)."""
    for path in files:
        taken = 0
        for raw in read_rows(path):
            if raw.blank:
                continue
            if max_rows and taken >= max_rows:
                break
            taken += 1
            yield raw


def check_ids(files: list[str], max_rows: int, samples: int) -> str | None:
    """With samples > 1, the first row whose `id` field contains SEPARATOR, said naming
    the row and the id; None when every id is safe (or samples == 1)."""
    if samples < 2:
        return None
    for raw in input_rows(files, max_rows):
        rid = row_id(raw)
        if rid != raw.source and SEPARATOR in rid:
            return (
                f"row {raw.source}: id {rid!r} contains {SEPARATOR!r}, which "
                f"--answers-per-prompt > 1 uses for the further answers ('<id>{SEPARATOR}k'); "
                "rename the id"
            )
    return None


@dataclass
class Job:
    id: str
    source: str
    prompts: list[Message]
    """An optional system turn, then the user turns, in order."""
    opening: int = 0
    """Tokens of each answer sampled at the opening temperature before the configured
    decoding takes over (0: all of it as configured)."""


def prompts_of(value, cfg: FormatConfig) -> list[Message]:
    """The system and user turns of one input row; RowError if there is no user turn."""
    if not isinstance(value, dict):
        raise RowError("row_not_object", f"got {type(value).__name__}")
    if cfg.format == "auto" and isinstance(value.get("turns"), list):
        turns = [{"role": "user", "content": t} for t in value["turns"]]
    elif detect_format(value, cfg) == "pairs":
        if cfg.prompt_field not in value:
            raise RowError("missing_field", cfg.prompt_field)
        turns = [{"role": "user", "content": value[cfg.prompt_field]}]
    else:
        key = "conversations" if "conversations" in value else "messages"
        turns = value.get(key)
        if not isinstance(turns, list):
            raise RowError("conversation_not_list", f"{key} is {type(turns).__name__}")
    keep = []
    for i, t in enumerate(turns):
        role = t.get("role", t.get("from")) if isinstance(t, dict) else None
        if isinstance(role, str) and ROLE_ALIASES.get(role.strip().lower()) == "assistant":
            continue  # the target writes its own answers
        m = parse_turn(t, i)
        if m["role"] == "tool":
            raise RowError("tool_turns_unsupported", f"turn {i}")
        keep.append({"role": m["role"], "content": m["content"]})
    if any(m["role"] == "system" for m in keep[1:]):
        raise RowError("misplaced_system")
    system = value.get("system")
    if not (keep and keep[0]["role"] == "system"):
        text = system if isinstance(system, str) and system.strip() else cfg.system_prompt
        if text:
            keep.insert(0, {"role": "system", "content": text})
    if not any(m["role"] == "user" for m in keep):
        raise RowError("no_user_turn")
    return keep


def jobs(files: list[str], cfg: FormatConfig, journal: Journal, max_rows: int, rc) -> Iterator[Job]:
    """Answers still to do: per input row, `rc.samples` of them (the first as configured,
    the others opened by `rc.opening_tokens` sampled tokens, ids "<id>#k"). Unusable
    rows go to the errors file (once) and are skipped."""
    seen: set[str] = set()
    for raw in input_rows(files, max_rows):
        value, rid = raw.value, row_id(raw)
        if rid in seen:  # report under a distinct id so the first row stays valid
            rid, dup = f"{rid}@{raw.source}", rid
            if not journal.is_done(rid):
                journal.error(rid, raw.source, "duplicate_id", f"id {dup!r}")
            continue
        seen.add(rid)
        ids = [rid] + [f"{rid}{SEPARATOR}{k}" for k in range(1, rc.samples)]
        todo = [i for i in ids if not journal.is_done(i)]
        if not todo:
            continue
        try:
            problem, prompts = raw.error, prompts_of(value, cfg) if not raw.error else []
        except RowError as e:
            problem = (e.reason, e.detail)
        if problem:  # reported once, under the row's own id
            if not journal.is_done(rid):
                journal.error(rid, raw.source, *problem)
            continue
        for i in todo:
            yield Job(i, raw.source, prompts, 0 if i == rid else rc.opening_tokens)

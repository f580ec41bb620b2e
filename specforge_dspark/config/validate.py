"""Cross-field checks of a recipe: every problem a user can fix, naming its keys."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from specforge_dspark.config.rope import rope_scaling_problems
from specforge_dspark.config.sections import Recipe


def validate(r: Recipe) -> list[str]:
    """Cross-field checks; returns a list of problems naming the recipe keys."""
    e: list[str] = []
    d, o = r.draft, r.objective

    def need(cond: bool, msg: str) -> None:
        if not cond:
            e.append(msg)

    need(d.hidden_size > 0, f"draft.hidden_size must be > 0, got {d.hidden_size}")
    need(d.num_hidden_layers >= 1, "draft.num_hidden_layers must be >= 1")
    need(d.num_attention_heads >= 1, "draft.num_attention_heads must be >= 1")
    need(
        d.num_key_value_heads >= 1 and d.num_attention_heads % max(d.num_key_value_heads, 1) == 0,
        f"draft.num_attention_heads ({d.num_attention_heads}) must be a multiple of "
        f"draft.num_key_value_heads ({d.num_key_value_heads})",
    )
    need(d.head_dim > 0 and d.head_dim % 2 == 0, "draft.head_dim must be even and > 0 (RoPE)")
    need(d.intermediate_size > 0, "draft.intermediate_size must be > 0")
    need(d.block_size >= 2, f"draft.block_size must be >= 2, got {d.block_size}")
    need(d.vocab_size > 0, "draft.vocab_size must be > 0")
    need(
        0 <= d.mask_token_id < d.vocab_size,
        f"draft.mask_token_id ({d.mask_token_id}) must be in [0, draft.vocab_size={d.vocab_size})",
    )
    need(d.markov_rank > 0, f"draft.markov_rank must be > 0, got {d.markov_rank}")
    need(len(d.target_layer_ids) >= 1, "draft.target_layer_ids must name at least one layer")
    for i, k in enumerate(d.target_layer_ids):
        need(
            0 <= k <= d.num_target_layers - 2,
            f"draft.target_layer_ids[{i}]={k} is outside the target's layers: aux layers "
            f"must be in [0, draft.num_target_layers-2={d.num_target_layers - 2}] "
            "(the last layer's output cannot be captured)",
        )
    dupes = sorted({k for k in d.target_layer_ids if d.target_layer_ids.count(k) > 1})
    need(not dupes, f"draft.target_layer_ids repeats layer(s) {dupes}")
    need(
        dupes or d.target_layer_ids == sorted(d.target_layer_ids),
        f"draft.target_layer_ids must be ascending (SGLang captures them in order), got "
        f"{d.target_layer_ids}",
    )
    need(
        not d.layer_types or len(d.layer_types) == d.num_hidden_layers,
        f"draft.layer_types has {len(d.layer_types)} entries, draft.num_hidden_layers is "
        f"{d.num_hidden_layers}",
    )
    for problem in rope_scaling_problems(d.rope_scaling, "draft.rope_scaling"):
        need(False, problem)
    sliding = "sliding_attention" in d.layer_types
    if d.kind == "dspark":
        need(
            not sliding, "draft.layer_types: sliding_attention needs draft.kind: dflash or dflash2"
        )
    else:
        need(
            not sliding or d.sliding_window >= d.block_size,
            f"draft.sliding_window ({d.sliding_window}) must be >= draft.block_size "
            f"({d.block_size}) for sliding_attention layers",
        )
        need(
            o.bce_weight == 0,
            f"objective.bce_weight must be 0 for draft.kind: {d.kind} (it has no confidence head)",
        )
    if d.kind == "dflash2":
        need(d.selector_rank > 0, "draft.selector_rank must be > 0 for draft.kind: dflash2")
        need(
            0 < d.selector_top_k <= d.vocab_size,
            f"draft.selector_top_k must be in [1, draft.vocab_size={d.vocab_size}]",
        )
        need(o.selector_weight >= 0, "objective.selector_weight must be >= 0")
    need(d.sliding_window >= 0, "draft.sliding_window must be >= 0")
    need(d.rms_norm_eps > 0, "draft.rms_norm_eps must be > 0")
    need(d.rope_theta > 0, "draft.rope_theta must be > 0")

    need(o.num_anchors >= 1, f"objective.num_anchors must be >= 1, got {o.num_anchors}")
    for name in ("ce_weight", "l1_weight", "bce_weight"):
        w = getattr(o, name)
        need(w >= 0, f"objective.{name} must be >= 0, got {w}")
    need(
        o.ce_weight + o.l1_weight + o.bce_weight > 0,
        "objective: at least one of ce_weight, l1_weight, bce_weight must be > 0",
    )
    need(o.gamma > 0, f"objective.gamma must be > 0, got {o.gamma}")
    need(o.chunk_size >= 0, f"objective.chunk_size must be >= 0, got {o.chunk_size}")
    need(o.decode_chunk_size >= 0, "objective.decode_chunk_size must be >= 0")
    need(0 <= o.dpace_alpha <= 1, f"objective.dpace_alpha must be in [0, 1], got {o.dpace_alpha}")

    p = r.optim
    need(p.lr > 0, f"optim.lr must be > 0, got {p.lr}")
    need(0 <= p.warmup_ratio < 1, f"optim.warmup_ratio must be in [0, 1), got {p.warmup_ratio}")
    need(0 <= p.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]")
    need(p.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 disables clipping)")
    need(len(p.betas) == 2 and all(0 <= b < 1 for b in p.betas), "optim.betas: two in [0, 1)")
    need(p.weight_decay >= 0, "optim.weight_decay must be >= 0")

    t = r.train
    need(t.epochs >= 1 or t.max_steps >= 1, "train: set train.epochs >= 1 or train.max_steps >= 1")
    need(t.max_steps >= 0, "train.max_steps must be >= 0")
    need(t.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
    need(t.grad_accum >= 1, "train.grad_accum must be >= 1")
    need(t.log_interval >= 1, "train.log_interval must be >= 1")
    need(t.eval_interval >= 0, "train.eval_interval must be >= 0")
    need(t.preflight_samples >= 0, "train.preflight_samples must be >= 0 (0 = off)")
    need(r.export.calibrate_prompts >= 0, "export.calibrate_prompts must be >= 0")
    need(
        r.export.calibrate_prompts == 0
        or (
            r.draft.kind == "dspark"
            and r.draft.enable_confidence_head
            and "sglang" in r.export.formats
        ),
        "export.calibrate_prompts > 0 needs draft.kind dspark with a confidence head and the "
        "sglang export format",
    )
    se = t.served_eval
    need(se.num_prompts >= 0, "train.served_eval.num_prompts must be >= 0")
    need(se.max_new_tokens >= 1, "train.served_eval.max_new_tokens must be >= 1")
    need(se.max_seconds > 0, "train.served_eval.max_seconds must be > 0")
    need(
        se.num_prompts == 0 or bool(se.workloads),
        "train.served_eval.workloads: give at least one workload",
    )
    need(
        t.max_nonfinite_steps >= 1,
        f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}",
    )
    need(
        t.eval_interval == 0 or bool(r.data.eval_files),
        "train.eval_interval > 0 needs data.eval_files (set one or set the interval to 0)",
    )

    need(
        r.dist.zero_stage in (0, 1, 2),
        f"dist.zero_stage must be 0, 1 or 2, got {r.dist.zero_stage}: ZeRO-3 partitions "
        "parameters that the Markov head and the fused vocab loss read directly",
    )
    sp = r.dist.sequence_parallel
    need(sp >= 1, f"dist.sequence_parallel must be >= 1, got {sp}")
    need(
        d.num_attention_heads % max(sp, 1) == 0,
        f"dist.sequence_parallel={sp} must divide draft.num_attention_heads "
        f"({d.num_attention_heads}): DeepSpeed's Ulysses gives each rank whole heads",
    )
    need(r.dist.timeout_s >= 0, f"dist.timeout_s must be >= 0 (0 = auto), got {r.dist.timeout_s}")
    need(r.checkpoint.save_interval >= 1, "checkpoint.save_interval must be >= 1")
    need(r.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    need(len(r.export.formats) == len(set(r.export.formats)), "export.formats has duplicates")
    need(
        d.markov_head_type == "vanilla" or "speculators" not in r.export.formats,
        f"export.formats: vLLM's DSpark (the speculators format) has only the vanilla Markov "
        f"head, draft.markov_head_type is {d.markov_head_type}: drop speculators",
    )

    g = r.target
    need(g.prefetch >= 1, f"target.prefetch must be >= 1, got {g.prefetch}")
    need(g.batch_size >= 1, "target.batch_size must be >= 1")
    need(g.timeout_s > 0, "target.timeout_s must be > 0")
    need(g.max_restarts >= 0, f"target.max_restarts must be >= 0, got {g.max_restarts}")
    need(g.restart_backoff_s >= 0, "target.restart_backoff_s must be >= 0")
    need(
        g.backend != "offline" or bool(g.offline_dir),
        "target.offline_dir must be set when target.backend is offline",
    )
    need(
        g.transport == "shm" or g.backend == "sglang",
        f"target.transport=mooncake: only the sglang backend writes through Mooncake "
        f"(target.backend is {g.backend}); use target.transport=shm",
    )
    need(
        g.transport_dtype == "auto" or g.backend == "sglang",
        f"target.transport_dtype={g.transport_dtype}: only the sglang backend's writer "
        f"quantizes rows (target.backend is {g.backend}); use target.transport_dtype=auto",
    )
    s = g.sglang
    need(not (s.url and s.urls), "target.sglang: set url (one server) or urls (a pool), not both")
    need(all(s.urls), "target.sglang.urls: an empty URL")
    need(s.servers_per_node >= 1, "target.sglang.servers_per_node must be >= 1")
    need(
        s.servers_per_node == 1 or not (s.url or s.urls),
        "target.sglang.servers_per_node: servers the trainer starts; with url or urls the "
        "servers run elsewhere (list each one in target.sglang.urls)",
    )
    problem = restart_budget_problem(r)
    need(not problem, problem)
    for problem in api_key_problems(r):
        need(False, problem)
    for problem in server_topology_problems(r):
        need(False, problem)
    need(r.data.max_length >= d.block_size + 1, "data.max_length must exceed draft.block_size")
    need(r.data.max_rows >= 0, "data.max_rows must be >= 0")
    need(r.data.regenerate.concurrency >= 1, "data.regenerate.concurrency must be >= 1")
    lp = r.loop
    need(lp.rows_per_round >= 1, f"loop.rows_per_round must be >= 1, got {lp.rows_per_round}")
    need(0 <= lp.replay_share <= 1, f"loop.replay_share must be in [0, 1], got {lp.replay_share}")
    need(0 <= lp.holdout_share < 1, f"loop.holdout_share must be in [0, 1), got {lp.holdout_share}")
    need(lp.forget_margin >= 0, f"loop.forget_margin must be >= 0, got {lp.forget_margin}")
    for key in ("requests_per_round", "max_new_tokens", "steps_per_round", "guard_prompts",
                "replicas"):  # fmt: skip
        need(getattr(lp, key) >= 1, f"loop.{key} must be >= 1, got {getattr(lp, key)}")
    need(lp.swap != "reload" or lp.engine == "vllm",
         f"loop.swap: reload needs loop.engine: vllm (its draft weight update); {lp.engine} "
         "swaps by restart")  # fmt: skip
    host, _, port = lp.listen.rpartition(":")
    need(bool(host) and port.isdigit() and int(port) < 65536,
         f"loop.listen must be host:port (port 0: any free one), got {lp.listen!r}")  # fmt: skip
    w = lp.position_weights
    need(not w or (min(w) >= 0 and sum(w) > 0),
         f"loop.position_weights must be >= 0, not all 0, got {lp.position_weights}")  # fmt: skip
    need(not lp.attach or lp.swap == "reload",
         "loop.attach: a deployment the loop did not start is swapped in place only: set "
         "loop.swap: reload (and loop.engine: vllm)")  # fmt: skip
    return e


def attached(g) -> bool:
    """Whether target `g`'s servers run elsewhere (url, or a pool of urls): none is started."""
    section = getattr(g, g.backend, None)
    return bool(section is not None and (section.url or getattr(section, "urls", None)))


def api_key_problems(r: Recipe) -> list[str]:
    """Attached servers off this host's loopback with no API key (target.<engine>.
    api_key_env): anyone on their network could use them. Servers the run starts always
    listen with a key (engines/api_key.py)."""
    g = r.target
    section = getattr(g, g.backend, None)
    if section is None or section.api_key_env:
        return []
    urls = [section.url] if section.url else list(getattr(section, "urls", []))
    return [
        f"target.{g.backend}.api_key_env: the attached server {url} is not on this host's "
        "loopback; name the environment variable holding its API key (the server started "
        "with --api-key, docs/production.md)"
        for url in urls
        if url and not is_loopback(url)
    ]


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this host's loopback (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url if "//" in url else f"//{url}").hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


RESTARTED_SERVERS = ("sglang",)
"""Backends whose server the run restarts mid-run (vLLM's fails the run: engines/vllm.py)."""


def restart_budget_s(r: Recipe) -> float:
    """Longest a rank may spend on a lost server while its peers wait in a collective:
    target.timeout_s to see it lost, then target.max_restarts restarts in a row, each
    after its backoff (target.restart_backoff_s * 2**(k-1)), within
    target.<engine>.startup_timeout_s to answer, then the probe request (within
    target.timeout_s). 0 when the run restarts no server (another backend, an attached
    url, max_restarts 0)."""
    g = r.target
    if g.backend not in RESTARTED_SERVERS or attached(g) or g.max_restarts == 0:
        return 0.0
    n, startup = g.max_restarts, getattr(g, g.backend).startup_timeout_s
    return g.timeout_s + n * (startup + g.timeout_s) + g.restart_backoff_s * (2**n - 1)


DIST_TIMEOUT_FLOOR_S = 7200.0
DIST_TIMEOUT_MARGIN_S = 600.0


def dist_timeout_s(r: Recipe) -> float:
    """The process-group timeout of the run: dist.timeout_s, or when it is 0 (auto) the
    longer of DIST_TIMEOUT_FLOOR_S and the restart budget plus DIST_TIMEOUT_MARGIN_S."""
    if r.dist.timeout_s:
        return r.dist.timeout_s
    return max(DIST_TIMEOUT_FLOOR_S, restart_budget_s(r) + DIST_TIMEOUT_MARGIN_S)


def restart_budget_problem(r: Recipe) -> str:
    """The message when server restarts may outlast a dist.timeout_s the recipe sets ("" when
    they cannot, or when it is auto)."""
    g, budget = r.target, restart_budget_s(r)
    if not r.dist.timeout_s or budget <= r.dist.timeout_s:
        return ""
    key, n = f"target.{g.backend}.startup_timeout_s", g.max_restarts
    startup = getattr(g, g.backend).startup_timeout_s
    return (
        f"dist.timeout_s={r.dist.timeout_s:g} is shorter than a lost server may keep its "
        f"peers waiting in a collective: target.timeout_s={g.timeout_s:g} (detection) + "
        f"target.max_restarts={n} x ({key}={startup:g} + target.timeout_s={g.timeout_s:g} "
        f"for the probe) + backoff {g.restart_backoff_s * (2**n - 1):g} "
        f"(target.restart_backoff_s) = {budget:g}s; raise dist.timeout_s to at least "
        f"{budget:g}, or lower {key}, target.timeout_s or target.max_restarts"
    )


UNTESTED_TOPOLOGY = {
    "enable_dp_attention": "DP attention",
    "dp_size": "data parallelism inside the server",
    "pp_size": "pipeline parallelism",
}
"""SGLang server layouts the feature handoff has not run with (the writers are spread over
attention-TP ranks only; tests/test_sglang_tp2.py runs TP 2): refused until they have."""


def server_topology_problems(r: Recipe) -> list[str]:
    """target.sglang.server_args that ask for a server layout no test has run."""
    if r.target.backend != "sglang":
        return []
    out = []
    for key, what in UNTESTED_TOPOLOGY.items():
        value = r.target.sglang.server_args.get(key)
        if value is True or (not isinstance(value, bool) and isinstance(value, int) and value > 1):
            out.append(
                f"target.sglang.server_args.{key}={value}: {what} has not run with our feature "
                "handoff (only tensor parallelism, tp_size, has); remove it"
            )
    return out


def check_data_files(r: Recipe) -> None:
    """ValueError naming the key and path of the first data file that does not exist (the
    dry run refuses what the run's data preparation would)."""
    import os
    from pathlib import Path

    for key in ("train_files", "eval_files"):
        for i, name in enumerate(getattr(r.data, key)):
            if not Path(name).is_file():
                raise ValueError(
                    f"data.{key}[{i}]: no such file {name} (from {os.getcwd()}); point the key "
                    f"at your data, or make it first (python -m data_pipelines.regenerate "
                    f"--recipe {r.source} for on-policy answers: docs/data.md)"
                )

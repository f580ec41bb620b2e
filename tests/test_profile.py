"""The speculation profile's figures (decoding/profile.py) on hand-made verify steps."""

from __future__ import annotations

import json

import pytest

from specforge_dspark.decoding.profile import PROFILE_FILE, profile_of, read_profile, write_profile
from specforge_dspark.decoding.spec_decode import Step


def _steps(accepted: list[int]) -> list[Step]:
    return [Step(accepted=a, committed=a + 1, confidence=[]) for a in accepted]


def test_the_profile_counts_positions_as_defined(tmp_path):
    steps = _steps([0, 1, 3, 3, 2, 0, 3, 1])  # D = 3 drafts per step
    p = profile_of(steps, 3)
    assert p["steps"] == 8 and p["accept_length"] == pytest.approx(21 / 8)
    assert p["marginal_acceptance"] == [6 / 8, 4 / 8, 3 / 8]  # accepted > 0, > 1, > 2
    assert p["conditional_acceptance"] == [6 / 8, 4 / 6, 3 / 4]  # given the slots before
    assert p["accept_length_histogram"] == [2, 2, 1, 3]  # committed 1, 2, 3, 4
    assert profile_of(_steps([0, 0]), 2)["conditional_acceptance"] == [0.0, None]

    path = write_profile(tmp_path, {"gsm8k": steps[:4], "mt_bench": steps[4:]}, 3, {"t": 0})
    back = read_profile(tmp_path)
    assert back["overall"] == json.loads(json.dumps(p)) and path.name == PROFILE_FILE
    back["workloads"]["gsm8k"]["steps"] = 5
    (tmp_path / PROFILE_FILE).write_text(json.dumps(back))
    with pytest.raises(ValueError, match="gsm8k: the histogram does not count its 5 steps"):
        read_profile(tmp_path)


def test_positions_from_an_engines_histogram_match_the_steps():
    """SGLang's spec_correct_drafts_histogram (steps by drafts accepted, as long as the most
    any step accepted) gives the same per-position figures as the steps themselves; the
    loop's gate pools it over requests and names the positions where a candidate's paired
    gain is separated from 0, either way."""
    from specforge_dspark.decoding.profile import acceptance_by_position
    from specforge_dspark.loop.gate import positions

    steps = _steps([0, 1, 3, 3, 2, 0, 3, 1])
    got = acceptance_by_position([2, 2, 1, 3], 3)
    want = profile_of(steps, 3)
    assert got["marginal_acceptance"] == want["marginal_acceptance"]
    assert got["conditional_acceptance"] == want["conditional_acceptance"]
    assert acceptance_by_position([2, 2], 3)["marginal_acceptance"] == [0.5, 0.0, 0.0]

    serving = {"a": {"accepted_hist": [3, 1]}, "b": {"accepted_hist": [2, 2]}}  # 8 steps
    candidate = {"a": {"accepted_hist": [1, 1, 2]}, "b": {"accepted_hist": [4, 1, 0]}}
    p = positions(serving, candidate)
    assert p["serving"] == [3 / 8, 0.0] and p["candidate"] == [4 / 9, 2 / 9]
    # the two requests disagree at position 1 (a gains, b loses): no interval clears 0
    assert p["paired_gain"][0]["difference"] == round(4 / 9 - 3 / 8, 4)
    assert p["improved"] == [] and p["worse"] == []
    # twelve requests, each better at position 1 and worse at 2 (by different amounts)
    serving = {f"r{i}": {"accepted_hist": [3 + i % 3, 1, 2]} for i in range(12)}
    candidate = {f"r{i}": {"accepted_hist": [1, 4 + i % 2, 0]} for i in range(12)}
    p = positions(serving, candidate)
    assert (p["improved"], p["worse"]) == ([1], [2])
    assert positions(candidate, serving)["improved"] == [2]

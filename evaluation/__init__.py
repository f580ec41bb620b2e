"""Acceptance-length evaluation of DSpark drafters by real greedy speculative decoding.

Entry points: `python -m evaluation.acceptance ...` and `evaluation.acceptance.evaluate`.
"""

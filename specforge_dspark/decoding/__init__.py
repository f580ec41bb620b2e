"""Speculative decoding core: the hf target as verifier, one greedy loop for every
drafter kind, sampling at T > 0, the n-gram drafter, held-out prompts, loading a drafter
for decoding, and the STS confidence calibration (fit, metrics, file, export bias).

Imports: drafters, engines, objective
"""

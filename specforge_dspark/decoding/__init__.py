"""Speculative decoding core: the hf target as verifier, one greedy loop for every
drafter kind, sampling at T > 0, the n-gram drafter, held-out prompts."""

"""Evaluation on top of decoding/: accept length by real speculative decoding
(acceptance.py), the serving engine as the judge (serve_check.py), calibration, verify
budget, drift, compute, figures and reports. A consumer of the library: nothing in it
imports this package.

Entry points: `python -m evaluation.acceptance ...` and `evaluation.acceptance.evaluate`.

Imports: config, decoding, drafters, engines, export, loop, objective, serving
"""

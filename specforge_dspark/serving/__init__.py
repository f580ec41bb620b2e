"""Serving our drafters: SGLang (sglang.py, DSPARK / DFLASH) or vLLM (vllm.py, DSpark; its
in-place draft update through vllm_draft_weights.py, a plugin vLLM loads) started with one
of our exports, to judge it against our harness (evaluation.serve_check) or to serve the
loop's traffic. Above the drafters and decoding it serves; the processes are engines/'.

Imports: config, decoding, drafters, engines
"""

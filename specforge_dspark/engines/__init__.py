"""Where features come from: the target engines as feature sources, by `target.backend`
(training/stream.py picks one): hf.py (a transformers worker per rank); sglang.py with its
server-side plugin sglang_plugin.py (inkling_layout.py: SGLang's Inkling layout); vllm.py
with its KV connector vllm_connector.py; offline.py (shards of cli/capture.py). tap.py: what
a target is to the trainer (sizes, aux layer ids, the aux tap); quant_*.py: quantized
copies. The served engines share server.py, launch.py, reaper.py (the server process),
api_key.py, keyed_launch.py, redact.py (its key), served.py (the trainer side) and pool.py
(several servers); cpu/ holds the CPU-engine bridges, never imported by a GPU server.

Imports: config, transport
"""

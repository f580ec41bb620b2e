"""The engine seam: `TargetFeatures` and the backends that produce them.

hf (hf.py, a transformers worker per rank), sglang (sglang.py + the server-side plugin
sglang_plugin.py), vllm (vllm.py + the server-side KV connector vllm_connector.py), offline
(offline.py, shards written by `specforge_dspark.cli.capture`);
shm.py is the shared memory they write into. `specforge_dspark.training.stream.FeatureStream`
picks one by `target.backend`.
"""

from specforge_dspark.engines.features import Sample, TargetFeatures

__all__ = ["Sample", "TargetFeatures"]

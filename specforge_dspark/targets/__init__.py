"""The targets we build or install: the embedded default, small Inkling and Qwen3 models
pre-trained on CPU from the shared corpus and cached by build key (target.py, model.py,
corpus.py, pretrain.py), and their quantized copies (`python -m specforge_dspark.targets`).

Imports: config, decoding, engines
"""

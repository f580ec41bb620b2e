"""What the training loop composes: feature stream, checkpoints, lifecycle, non-finite
guard, tracking, memory estimate, served evaluation.

Imports: config, data_pipelines, decoding, drafters, engines, objective, targets, transport
"""

"""The training objective: anchors and blocks (`blocks`), the one chunked vocab loss and its
metrics (`vocab_loss`, `metrics`), the frozen target head (`frozen_head`), and per kind the
slot convention on top of it (`loss`, `selector_loss`).

Imports: config, engines
"""

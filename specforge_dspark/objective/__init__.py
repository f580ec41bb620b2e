"""The training objective: anchors and blocks (`blocks`), the one chunked vocab loss and its
metrics (`vocab_loss`), and per kind the slot convention on top of it (`dspark`, `dflash`)."""

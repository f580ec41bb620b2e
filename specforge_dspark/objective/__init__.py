"""The training objective: anchors and blocks, the one chunked vocab loss, and the
per-kind slot terms on top of it."""

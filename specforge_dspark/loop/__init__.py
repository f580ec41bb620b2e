"""The closed loop from the serving engine's traffic back into the drafter: serve and
record (records.py), mine the next round's mix (mine.py), train, gate the candidate on
held-out recorded traffic with the engine as the judge (gate.py), and keep every version
with its parent and figures (gate.Lineage). The recipe's `loop` section sets the shares.

Imports: data_pipelines, decoding, engines, serving
"""

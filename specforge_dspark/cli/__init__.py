"""The commands a user runs: preflight, init_recipe, capture, export, loop, the server
command line, and the benchmarks (bench/). The top layer of the library.

Imports: config, data_pipelines, drafters, engines, export, loop, objective, targets, training,
transport
"""

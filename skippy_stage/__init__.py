"""skippy-stage: one pipeline stage of a large language model, served over gRPC."""

import os

# llama-cpp-python's CPU backend runs on OpenMP, whose idle workers spin for ~300k
# iterations after each graph (and at every barrier inside one). Several stages (and the
# stages' own Python threads) share the cores of one host, and a stage that just finished
# spins on the cores the next stage needs. Measured with a 3-stage SmolLM2 pipeline on 2
# cores (single-stream decode vs the unsplit model, same run): spin count 0: 0.31x, 200:
# 0.52x, 1000: 0.68x, 2000: 0.69x, 5000: 0.67x, 20000: 0.64x, libgomp's default: 0.32x
# (an AMD EPYC; an Intel Xeon gave its best at 1000-3000 too). It must be set before libgomp
# loads, i.e. before llama_cpp is imported; an operator's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

__version__ = "0.1.0"

"""skippy-stage: one pipeline stage of a large language model, served over gRPC."""

import os

# llama-cpp-python's CPU backend runs on OpenMP, whose idle workers spin for ~300k
# iterations after each graph. Several stages (and gRPC's own threads) share the cores of
# one host, and that spinning starved them: a served 0:30 model decoded at 17 tok/s with
# 2 threads, 115 tok/s with a spin count of 20000 (in-process decode is unchanged). It must
# be set before libgomp loads, i.e. before llama_cpp is imported; an operator's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

__version__ = "0.1.0"

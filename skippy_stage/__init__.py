"""skippy-stage: one pipeline stage of a large language model, served over gRPC."""

__version__ = "0.1.0"

"""The server layer: a stage as a process — the gRPC servicer and server, the watch on the
chain below, and the OpenAI-compatible HTTP API at the head."""

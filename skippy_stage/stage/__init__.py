"""The stage layer: one stage's domain (steps, the Stage) and its edges — the hop transports,
direct returns, the TCP frame listener, the protobuf codec and the error-to-status map."""

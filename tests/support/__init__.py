"""What the tests share: in-process chains of runtimes (``chain``), the compiled frame path's bench
(``frames``), an importance matrix computed as llama-imatrix computes one (``imatrix``), mutations
of protobuf bytes for fuzzing (``mutations``), clients of real stage processes (``pipeline``),
certificates for TLS and token tests (``pki``), and checks of the deployment files (``deploy``)."""

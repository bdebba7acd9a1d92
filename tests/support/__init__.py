"""What the tests share: in-process chains of runtimes (``chain``), clients of real stage
processes (``pipeline``), certificates for TLS and token tests (``pki``), and checks of the
deployment files (``deploy``)."""

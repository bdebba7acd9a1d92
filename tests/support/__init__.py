"""What the tests share: in-process chains of runtimes (``chain``), clients of real stage
processes (``pipeline``), and checks of the deployment files (``deploy``)."""

"""The ``skippy-stage`` command: its subcommands, local pipelines, a Generate client, the benchmark."""

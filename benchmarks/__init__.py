"""The project's benchmarks as one tool: ``python -m benchmarks <subcommand>`` (see
``__main__``). Shared machinery lives in :mod:`benchmarks.harness`; what the demo shares with
the benchmarks lives in ``mla_backend.testing``."""

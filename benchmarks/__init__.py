"""Reproducible measurements. Each module runs as ``python -m benchmarks.<name> --json``;
its last stdout line is one JSON object (results per configuration under ``rows``)."""

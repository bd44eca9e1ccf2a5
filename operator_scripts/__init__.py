"""The operator's tools: benchmarks now; render, submit, status, logs and local runs to come."""

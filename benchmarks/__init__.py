"""Benchmarks that print ratios measured side by side in one run (`python -m benchmarks.NAME`),
the baselines they compare against, fault trials and the GPU check."""

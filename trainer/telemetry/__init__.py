"""What a run tells: logs, Prometheus metrics, progress lines gathered from every rank, the
step split into parts and the straggler."""

"""The Kubernetes API as ddp-ops uses it: submit, status, logs and delete, and the one-line status summary."""

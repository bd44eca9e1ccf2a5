"""The Helm chart, rendered in-process as `helm install --dry-run=client` would, and the code
bundle shipped at submit."""

"""Where a local pod's processes run: a process tree in a sandbox of its own namespaces, or a container."""

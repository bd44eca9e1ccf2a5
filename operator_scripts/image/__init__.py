"""The CUDA image: its locked requirements, its build, and the container engine both use."""

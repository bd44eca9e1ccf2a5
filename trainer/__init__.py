"""Data-parallel PyTorch training under torchrun, from a laptop CPU to a Kubeflow PyTorchJob."""

__version__ = "0.1.0"

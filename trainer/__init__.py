"""Data-parallel PyTorch training under torchrun, from a laptop CPU to a Kubeflow PyTorchJob."""

import os

# Before torch loads (c10 reads it once): c10d's TCPStore client logs every failed send or
# receive as a WARNING with a C++ stack trace (torch/csrc/distributed/c10d/TCPStore.cpp:106,
# 115: `C10D_WARNING("sendBytes failed on ...")`), dozens of lines each time a peer's store
# goes away, which is how every lost node ends. The error itself still reaches the caller as
# an exception; ERROR and FATAL logs still print. TORCH_CPP_LOG_LEVEL=WARNING brings them back.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

__version__ = "0.1.0"

"""The controllers' rules at their pinned versions, as pure functions: the training
operator's v1 PyTorchJob, and Trainer v2's TrainJob on a JobSet."""

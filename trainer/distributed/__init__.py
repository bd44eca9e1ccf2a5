"""Processes and their group: torchrun's environment and the process group (`process_group`),
`ddp-launch` around torchrun (`launch`), and stopping together at a signal (`preemption`)."""

"""Processes and their group: torchrun's environment and the process group (`process_group`),
`ddp-launch` around torchrun (`launch`), stopping together at a signal (`preemption`),
finding a rank that stops making progress: each rank's record (`heartbeat`), the node's
watchdog that reads them (`watchdog`) and the pod's `/healthz` (`liveness`); restarted
workers forked from a warm server (`forkserver`)."""

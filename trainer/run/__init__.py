"""One run of the trainer, from its arguments to its exit code: what `python -m trainer`
(trainer/cli.py) and `ddp-launch` check first (`arguments`, `startup`), who owns the
checkpoint location (`ownership`), and the processes and threads a run starts and ends
around the loop (`lifecycle`)."""

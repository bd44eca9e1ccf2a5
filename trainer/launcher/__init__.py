"""`ddp-launch`, what each pod runs above torchrun: checks before it starts, the rendezvous
host awaited, torchrun relaunched within bounds, its output passed on in one-line errors,
and restarted workers forked warm by the fork server."""

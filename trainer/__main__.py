"""Entry point for `python -m trainer` and `torchrun -m trainer`: a restarted worker runs as
a child of its agent's fork server where there is one (trainer/launcher/forkserver.py),
and as itself otherwise."""

import sys

from trainer.collection import uncollected_imports
from trainer.launcher.fork_client import forked_run

code = forked_run(sys.argv)
if code is None:
    with uncollected_imports():
        from trainer.cli import main

    code = main()
raise SystemExit(code)

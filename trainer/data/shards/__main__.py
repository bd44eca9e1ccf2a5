"""`python -m trainer.data.shards write ...` (see `trainer.data.shards.write`)."""

from trainer.data.shards.write import main

raise SystemExit(main())

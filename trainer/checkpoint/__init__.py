"""Checkpoints: a store interface (local directory, S3: `store`, `s3`, `location`), the
commit protocol over it (`manager`), and rank 0's background writer (`writer`). Import from
the module itself: `ddp-launch` opens a store without the torch that the manager imports."""

"""Processes and their group, inside a pod: torchrun's environment and the process group
(`process_group`); finding a rank that stops making progress: each rank's record
(`heartbeat`), the node's watchdog that reads them (`watchdog`) and the pod's `/healthz`
(`liveness`); finding a node that is lost (`node_watch`: its threads, `node_judge`: its
rules, `node_exchange`: what the nodes say through the store; `elastic_bounds`); a crash
that recurs (`recurrence`). What runs torchrun itself is `trainer.launcher`."""

"""The operator's tools: `ddp-ops` (render, submit, status, logs, delete, local runs of a
rendered job, the scaling estimate), the chart's generated files, the run report."""

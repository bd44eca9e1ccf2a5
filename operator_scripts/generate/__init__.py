"""Files generated from code: the plain manifests in k8s/, the chart's values table and
trainer schema, the dashboard and the alerts. `python -m operator_scripts.generate write`
rewrites them; `check` (in the tests) names any that drifted."""

"""Grafana dashboards and Prometheus alert rules, generated from the metric catalog."""

# Where runbooks/<AlertName>.md are served from, unless the export is told otherwise; here, not in
# alerts.py, so the CLI can show it as a default without importing the rules and the analyzers.
DEFAULT_RUNBOOK_BASE_URL = "https://github.com/gpudiag/gpudiag/blob/main"

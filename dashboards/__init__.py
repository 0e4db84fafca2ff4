"""Grafana dashboards and Prometheus alert rules, generated from the metric catalog."""

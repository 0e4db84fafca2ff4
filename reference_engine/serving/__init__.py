"""Serving the real-tensor engine over HTTP: the server and its /metrics, admission control, the frontend
model of a serving stack, and OpenTelemetry request tracing.
"""

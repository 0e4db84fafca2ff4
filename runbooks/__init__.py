"""One Markdown runbook per alert, shipped as package data."""

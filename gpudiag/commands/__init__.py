"""CLI command modules. Each module defines ``register(app)``; gpudiag.cli loads every one."""

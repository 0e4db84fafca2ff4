"""Triton kernels of the reference engine, each with a pure-torch reference."""

"""A paged-KV reference LLM engine that runs on a real GPU or a simulated one."""

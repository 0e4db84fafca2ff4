"""A paged-KV reference LLM engine that runs on a real GPU or a simulated one.

Where things live:

- :mod:`.core`: what every engine shares, whatever computes a step — the
  sequence, the scheduler (one file), the KV managers and prefix cache, the
  model of PyTorch's caching allocator, and the leak faults that go through it.
- :mod:`.sim`: the simulated GPU — device specs, the roofline cost model, the
  engine loop on a virtual clock, kernel launches, host-side preprocessing.
- :mod:`.model`: real tensors — the Llama-shaped model, its Triton kernels,
  model configs, safetensors, the tokenizer, and ``LLMEngine`` that runs them.
- :mod:`.serving`: the HTTP server of the real-tensor engine, admission
  control, the frontend of a serving stack, OpenTelemetry tracing.
- :mod:`.scenarios`: the field incidents as scenarios (workload, engine
  configuration, fixes) and the workload generator.
"""

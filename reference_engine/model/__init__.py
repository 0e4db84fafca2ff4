"""The real-tensor model: a Llama-shaped transformer in torch, its Triton kernels, safetensors I/O, the
tokenizer, model configs and presets, and the engine that runs it (``LLMEngine``).
"""

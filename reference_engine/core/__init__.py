"""The engine core: sequences, the scheduler, the KV managers (contiguous, reserve-max, paged, prefix-caching) and
the model of PyTorch's caching allocator they draw memory from. Device-independent.
"""

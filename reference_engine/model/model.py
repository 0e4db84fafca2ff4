"""A Llama-style decoder in torch: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names are Llama's (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so a
local safetensors checkpoint of a Llama/Mistral model loads as it is. Without
one, weights are drawn from a seed: each tensor from its own generator,
seeded by (seed, tensor name), so a weight does not change when the model
gains a layer, and the same seed gives the same weights on every device.

Two forward paths compute the same function:

* :meth:`LlamaForCausalLM.forward_dense` -- the plain reference: a padded
  ``[batch, seq]`` of tokens, full causal attention, pure torch, no cache.
* :meth:`LlamaForCausalLM.forward_paged` -- what the engine runs: a packed
  batch of new tokens (whole prompts, prompt chunks after a prefix-cache hit,
  or one token per sequence in decode), K/V written into and read from a
  paged KV cache (layout in :mod:`.kernels.paged_attention`, pool in
  :class:`PagedKVCache`). Kernels are chosen by
  :mod:`.kernels.dispatch`: Triton on CUDA, the torch path on the CPU.

Both keep the residual stream the way vLLM does (the add fused into the next
RMSNorm), compute attention softmax in float32, and return float32 logits.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpudiag.errors import GpudiagError

from .kernels import dispatch
from .model_config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Llama's initializer_range: the std of every weight matrix at init.
INIT_STD = 0.02
# Checkpoint tensors that are derived, not learned (older Llama exports carry them).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class PagedKVCache:
    """The KV pool: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    ``cache[layer]`` is ``(k_cache, v_cache)``, each a contiguous
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` view: the layout every
    kernel reads. Block ``b`` of every layer belongs to the same sequence, so
    one block table serves all layers.
    """

    storage: torch.Tensor

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[layer, 0], self.storage[layer, 1]

    def __len__(self) -> int:
        return self.storage.shape[0]

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.storage.shape[2]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.storage.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool."""
        return self.storage.numel() * self.storage.element_size()


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                      device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> PagedKVCache:
    """Preallocate the paged KV pool for ``config`` (zero-filled, so unused rows are finite)."""
    if num_blocks <= 0 or block_size <= 0:
        raise GpudiagError(f"KV cache needs positive num_blocks and block_size, got {num_blocks}, {block_size}")
    dtype = dtype or TORCH_DTYPES[config.dtype]
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return PagedKVCache(torch.zeros(shape, dtype=dtype, device=device))


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotary convention: the head's two halves form the (real, imaginary) pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (see :mod:`.kernels.rmsnorm`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: str = "torch"):
        """Normalised ``x``; with ``residual``, ``(normalised x + residual, x + residual)``."""
        return dispatch.rms_norm(x, self.weight, self.eps, residual, backend=backend)


class Attention(nn.Module):
    """Grouped-query self-attention projections (no biases, as in Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward of ``x``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention block and pre-norm SwiGLU block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)


class LlamaBackbone(nn.Module):
    """Embedding, decoder layers and final norm (``model.*`` in a Llama checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head; weights from a seed or a safetensors checkpoint."""

    def __init__(self, config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        self.checkpoint_paths: tuple[str, ...] = ()
        self._fingerprint = None
        # Build on the meta device, then materialise once on the target: a 7B
        # model never exists twice (fp32 on the host, then cast and copied).
        with torch.device("meta"):
            self.model = LlamaBackbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(TORCH_DTYPES[config.dtype])
        self.to_empty(device=device)
        self.init_weights(seed)
        self._build_rope()

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return self.lm_head.weight.dtype

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Draw every weight from N(0, 0.02) (norm weights: 1), each from its own (seed, name) generator.

        Draws happen on the CPU in float32, so the weights are the same on every device.
        """
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * INIT_STD)
        self.seed = seed
        self.checkpoint_paths = ()
        self._fingerprint = None

    def _build_rope(self) -> None:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Non-persistent: derived from the config, not part of the checkpoint or the fingerprint.
        self.register_buffer("rope_cos", emb.cos().float().to(self.device), persistent=False)
        self.register_buffer("rope_sin", emb.sin().float().to(self.device), persistent=False)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., tokens, heads, head_dim]`` by ``positions [..., tokens]`` (in float32)."""
        cos = self.rope_cos[positions].unsqueeze(-2)
        sin = self.rope_sin[positions].unsqueeze(-2)
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    # ---- the dense reference ------------------------------------------------

    @torch.no_grad()
    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (float32) of ``tokens [batch, seq]`` (or ``[seq]``), no cache.

        Full causal attention from position 0, pure torch. Prompts of mixed
        lengths may be right-padded to one length: causality keeps padding
        from reaching the real positions, whose logits are exact.
        """
        squeeze = tokens.dim() == 1
        if squeeze:
            tokens = tokens[None]
        c = self.config
        b, s = tokens.shape
        if s > c.max_position:
            raise GpudiagError(f"{s} tokens exceed the model's max_position {c.max_position}")
        tokens = tokens.to(self.device)
        positions = torch.arange(s, device=self.device)
        causal = torch.ones(s, s, dtype=torch.bool, device=self.device).triu(1)
        scale = 1.0 / math.sqrt(c.head_dim)
        g = c.queries_per_kv_head
        x = self.model.embed_tokens(tokens)
        residual = None
        for layer in self.model.layers:
            if residual is None:
                residual = x
                h = layer.input_layernorm(x, backend="torch")
            else:
                h, residual = layer.input_layernorm(x, residual, backend="torch")
            attn = layer.self_attn
            q = self.apply_rope(attn.q_proj(h).view(b, s, c.num_heads, c.head_dim), positions)
            k = self.apply_rope(attn.k_proj(h).view(b, s, c.num_kv_heads, c.head_dim), positions)
            v = attn.v_proj(h).view(b, s, c.num_kv_heads, c.head_dim)
            qf = q.float().transpose(1, 2)  # [B, H, S, D]
            kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
            vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            o = torch.matmul(probs, vf).transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim).to(x.dtype)
            x = attn.o_proj(o)
            h, residual = layer.post_attention_layernorm(x, residual, backend="torch")
            x = layer.mlp(h)
        x, _ = self.model.norm(x, residual, backend="torch")
        logits = self.lm_head(x).float()
        return logits[0] if squeeze else logits

    # ---- the paged path -----------------------------------------------------

    @torch.no_grad()
    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, slot_mapping: torch.Tensor,
                      is_prefill: bool, cu_seqlens_q: torch.Tensor | None = None,
                      max_query_len: int | None = None, max_context_len: int | None = None,
                      logits_indices: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
        """One engine step over a packed batch; returns float32 logits ``[len(logits_indices), vocab]``.

        For ``B`` sequences and ``T`` new tokens in all:

        * ``input_ids [T]`` (int64): the new tokens, sequence after sequence;
        * ``positions [T]`` (int64): each token's absolute position;
        * ``kv_cache``: indexable by layer, ``kv_cache[i]`` -> ``(k_cache,
          v_cache)`` of ``[num_blocks, block_size, num_kv_heads, head_dim]``
          (a :class:`PagedKVCache`, or a list of pairs);
        * ``block_tables [B, max_blocks]`` (int32): each sequence's physical
          blocks in order; entries past its context are ignored;
        * ``context_lens [B]`` (int32): tokens in the cache for each sequence
          *after* this step (cached prefix + new tokens);
        * ``slot_mapping [T]`` (int64): cache slot (``block * block_size +
          offset``) each new token's K/V is written to; negative skips a token;
        * ``is_prefill``: prefill (``cu_seqlens_q`` required; every sequence
          has >= 1 new token, its last ``q_len`` positions) or decode (one
          token per sequence, ``T == B``);
        * ``cu_seqlens_q [B + 1]`` (int32): where each sequence's tokens start
          in the packed batch, then ``T``;
        * ``max_query_len`` / ``max_context_len``: host-side bounds that spare
          the Triton path a device sync (default: derived);
        * ``logits_indices``: which rows to return logits for (default: each
          sequence's last new token, i.e. ``[B, vocab]``);
        * ``backend``: ``auto``, ``torch`` or ``triton`` (:mod:`.kernels.dispatch`).

        New K/V is written into the cache before attention, so attention sees
        the cached prefix and the new tokens alike.
        """
        backend = dispatch.check_backend(backend)
        c = self.config
        t = input_ids.shape[0]
        nseq = context_lens.shape[0]
        if is_prefill:
            if cu_seqlens_q is None or cu_seqlens_q.shape[0] != nseq + 1:
                raise ValueError("prefill needs cu_seqlens_q with one entry per sequence plus one")
        elif t != nseq:
            raise ValueError(f"decode takes one token per sequence: {t} tokens for {nseq} sequences")
        if len(kv_cache) != c.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {c.num_layers}")
        scale = 1.0 / math.sqrt(c.head_dim)
        if is_prefill and max_query_len is None and t:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        x = self.model.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv_cache[i]
            if residual is None:
                residual = x
                h = layer.input_layernorm(x, backend=backend)
            else:
                h, residual = layer.input_layernorm(x, residual, backend=backend)
            attn = layer.self_attn
            q = self.apply_rope(attn.q_proj(h).view(t, c.num_heads, c.head_dim), positions)
            k = self.apply_rope(attn.k_proj(h).view(t, c.num_kv_heads, c.head_dim), positions)
            v = attn.v_proj(h).view(t, c.num_kv_heads, c.head_dim)
            dispatch.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, backend=backend)
            if is_prefill:
                o = dispatch.prefill_attention_paged(q, k_cache, v_cache, block_tables, context_lens,
                                                     cu_seqlens_q, scale, max_query_len, backend=backend)
            else:
                o = dispatch.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                              max_context_len, backend=backend)
            x = attn.o_proj(o.reshape(t, c.num_heads * c.head_dim))
            h, residual = layer.post_attention_layernorm(x, residual, backend=backend)
            x = layer.mlp(h)
        if logits_indices is None:
            logits_indices = (cu_seqlens_q[1:].long() - 1) if is_prefill else torch.arange(nseq, device=x.device)
        x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.model.norm(x, residual, backend=backend)
        return self.lm_head(x).float()

    # ---- checkpoints and identity -------------------------------------------

    @torch.no_grad()
    def load_safetensors(self, paths: str | os.PathLike | Iterable[str | os.PathLike]) -> None:
        """Load weights from safetensors files with Llama names (a file, several shards, or a directory).

        Every parameter must be present with its exact shape (dtype is
        converted); a missing ``lm_head.weight`` ties the head to the
        embedding, as checkpoints with ``tie_word_embeddings`` do. Unknown
        tensors are an error: they usually mean a different architecture.
        """
        from gpudiag.reference_engine.model.safetensors_io import SafetensorsFile

        files = _checkpoint_files(paths)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for path in files:
            with SafetensorsFile(path) as f:
                for name, e in f.entries.items():
                    if name.endswith(_DERIVED_SUFFIXES):
                        continue
                    p = params.get(name)
                    if p is None:
                        raise GpudiagError(f"{path}: tensor {name!r} is not a parameter of this "
                                           f"{self.config.name} model (different architecture?)")
                    if tuple(e.shape) != tuple(p.shape):
                        raise GpudiagError(f"{path}: {name} has shape {list(e.shape)}, "
                                           f"the model config expects {list(p.shape)}")
                    p.copy_(f.tensor(name, copy=False))
                    loaded.add(name)
        missing = [n for n in params if n not in loaded]
        if missing == ["lm_head.weight"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        elif missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise GpudiagError(f"checkpoint lacks {', '.join(missing[:5])}{more}")
        self.checkpoint_paths = tuple(str(p) for p in files)
        self._fingerprint = None

    def save_safetensors(self, path: str | os.PathLike) -> None:
        """Write the weights with Llama names (what :meth:`load_safetensors` reads)."""
        from gpudiag.reference_engine.model.safetensors_io import write_safetensors

        write_safetensors(path, self.state_dict(), metadata={"format": "pt", "gpudiag_model": self.config.name})

    def fingerprint(self):
        """The model's :class:`~gpudiag.reference_engine.model.fingerprint.Fingerprint` (computed once).

        Of the checkpoint files if weights came from files (it identifies the
        file on disk), else of the weights in memory (equal to the digest of
        the file :meth:`save_safetensors` would write).
        """
        if self._fingerprint is None:
            from gpudiag.reference_engine.model.fingerprint import fingerprint_files, fingerprint_model

            self._fingerprint = (fingerprint_files(self.checkpoint_paths) if self.checkpoint_paths
                                 else fingerprint_model(self))
        return self._fingerprint


def _checkpoint_files(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            shards = sorted(p.glob("*.safetensors"))
            if not shards:
                raise GpudiagError(f"no .safetensors files in {p}")
            files.extend(shards)
        else:
            files.append(p)
    if not files:
        raise GpudiagError("no checkpoint files given")
    return files


def build_model(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None) -> LlamaForCausalLM:
    """A model in eval mode: weights from ``checkpoint`` if given, else drawn from ``seed``."""
    model = LlamaForCausalLM(config, seed=seed, device=device)
    if checkpoint is not None:
        model.load_safetensors(checkpoint)
    return model.eval()

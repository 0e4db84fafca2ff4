"""The shape of a Llama-style decoder: one dataclass, a few named presets.

The same config drives the real model (:mod:`gpudiag.reference_engine.model.model`)
and the simulated GPU's cost model (through :meth:`ModelConfig.weight_bytes`
and :meth:`ModelConfig.kv_bytes_per_token`), so a scenario sized for
``llama-7b`` on the simulator moves the bytes the real model would.

A config is given as a preset name or as a JSON file. The JSON file may use
this dataclass's field names or the names of a Hugging Face Llama/Mistral
``config.json`` (``num_hidden_layers``, ``num_attention_heads``,
``rms_norm_eps``, ``torch_dtype``, ...), so the config next to a local
checkpoint can be used as it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from gpudiag.errors import GpudiagError

# Storage dtypes the model and the kernels support, with their sizes in bytes.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Hugging Face config.json key -> ModelConfig field.
_HF_KEYS = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "rms_norm_eps": "rms_eps",
    "max_position_embeddings": "max_position",
    "torch_dtype": "dtype",
    "model_type": "name",
}
# Hugging Face keys that describe things this model does not have or does not need.
_HF_IGNORED = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    "initializer_range", "pretraining_tp", "tie_word_embeddings", "transformers_version",
    "use_cache", "attention_bias", "attention_dropout", "mlp_bias", "rope_scaling",
    "sliding_window", "_name_or_path",
}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 4096
    dtype: str = "float32"
    name: str = "custom"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise GpudiagError naming the first field that makes the shape impossible."""
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise GpudiagError(f"model config: {f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise GpudiagError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise GpudiagError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        for f in ("rope_theta", "rms_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise GpudiagError(f"model config: {f} must be a positive number, got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise GpudiagError(f"model config: dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.name, str) or not self.name:
            raise GpudiagError(f"model config: name must be a non-empty string, got {self.name!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the model's storage dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def queries_per_kv_head(self) -> int:
        """The GQA ratio: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        """Parameters of the model (untied embedding and LM head, no biases)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        return 2 * self.vocab_size * h + self.num_layers * per_layer + h

    def weight_bytes(self, dtype_bytes: int | None = None) -> int:
        """Bytes of all weights at ``dtype_bytes`` per element (default: the config's dtype)."""
        return self.param_count() * (dtype_bytes or self.dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """Bytes of K and V that one token holds across all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (dtype_bytes or self.dtype_bytes)

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (the format :meth:`from_json` reads)."""
        return dataclasses.asdict(self)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named preset: tiny, small, llama-7b, mistral-7b."""
        try:
            return PRESETS[name]
        except KeyError:
            raise GpudiagError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None

    @classmethod
    def from_dict(cls, data: dict, source: str = "model config") -> ModelConfig:
        """Build from this dataclass's field names or a Hugging Face config.json's names."""
        if not isinstance(data, dict):
            raise GpudiagError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("rope_scaling"):
            # Llama-3.1-style scaled rotary frequencies: loading such a model
            # with plain RoPE would run and silently compute the wrong thing.
            raise GpudiagError(f"{source}: rope_scaling {data['rope_scaling']!r} is not supported "
                               "(plain rotary embeddings only)")
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict = {}
        unknown = []
        for key, value in data.items():
            target = _HF_KEYS.get(key, key)
            if target in fields:
                values[target] = value
            elif key not in _HF_IGNORED:
                unknown.append(key)
        if unknown:
            raise GpudiagError(f"{source}: unknown keys {', '.join(sorted(unknown))}; "
                               f"expected {', '.join(sorted(fields))}")
        if "head_dim" not in values and "hidden_size" in values and "num_heads" in values:
            hs, nh = values["hidden_size"], values["num_heads"]
            if isinstance(hs, int) and isinstance(nh, int) and nh > 0:
                values["head_dim"] = hs // nh
        if "num_kv_heads" not in values and "num_heads" in values:
            values["num_kv_heads"] = values["num_heads"]  # Llama-1/2 configs omit it: no GQA
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in values and f.default is dataclasses.MISSING]
        if missing:
            raise GpudiagError(f"{source}: missing {', '.join(missing)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise GpudiagError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a config from a JSON file (field names or Hugging Face config.json names)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise GpudiagError(f"cannot read model config {p}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise GpudiagError(f"model config {p} is not UTF-8 text") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GpudiagError(f"model config {p} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        return cls.from_dict(data, source=f"model config {p}")


def load_model_config(spec: str) -> ModelConfig:
    """A preset name or the path of a JSON config (what ``--model-config`` takes)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith(".json") or Path(spec).exists():
        return ModelConfig.from_json(spec)
    raise GpudiagError(f"model config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")


PRESETS: dict[str, ModelConfig] = {
    # For tests: runs a forward in milliseconds on a CPU; GQA ratio 2 so the
    # grouped path is exercised. The vocabulary holds the byte tokenizer's 259
    # ids, padded to a multiple of 16 as real checkpoints pad theirs.
    "tiny": ModelConfig(vocab_size=272, hidden_size=64, intermediate_size=176, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=1024,
                        dtype="float32", name="tiny"),
    # For CPU benchmarks: ~25 M parameters, GQA ratio 2, head_dim 64.
    "small": ModelConfig(vocab_size=272, hidden_size=512, intermediate_size=1408, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, max_position=4096,
                         dtype="float32", name="small"),
    # Llama-2-7B: 32 layers, 32 heads of 128, no GQA; 6.74 B parameters; 512 KiB KV/token at fp16.
    "llama-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                            num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0,
                            rms_eps=1e-5, max_position=4096, dtype="float16", name="llama-7b"),
    # Mistral-7B-v0.2: GQA with 8 KV heads (128 KiB KV/token at bf16), rope_theta 1e6,
    # 32k context; no sliding window (v0.2 dropped it). 7.24 B parameters.
    "mistral-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                              rms_eps=1e-5, max_position=32768, dtype="bfloat16", name="mistral-7b"),
    # Llama-3.3-70B-Instruct: meta-llama/Llama-3.3-70B-Instruct config.json (hidden_size 8192,
    # intermediate_size 28672, num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8,
    # vocab_size 128256, rope_theta 500000, rms_norm_eps 1e-5, max_position_embeddings 131072,
    # torch_dtype bfloat16, untied embeddings): 70.55 B parameters; 320 KiB KV/token at bf16.
    "llama-3.3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                 rms_eps=1e-5, max_position=131072, dtype="bfloat16", name="llama-3.3-70b"),
}

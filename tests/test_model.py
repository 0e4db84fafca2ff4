"""The Llama-style model: seeded weights, paged forward equal to the dense one, checkpoints, config, tokenizer.

The paged forward here runs the torch path (the CPU default); the Triton
kernels inside the same forward are checked in tests/test_kernels.py.
Tolerance for paged vs dense logits in float32: 1e-5 absolute. The
seeded model's logits are small (|logit| < ~0.7, closest top-2 gap ~7e-5 in
these prompts); the two paths differ by ~2e-7 (summation order, masked
padding), well inside both.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.model.fingerprint import fingerprint_file
from gpudiag.reference_engine.model.kernels import dispatch
from gpudiag.reference_engine.model.model import allocate_kv_cache, build_model
from gpudiag.reference_engine.model.model_config import PRESETS, ModelConfig, load_model_config
from gpudiag.reference_engine.model.safetensors_io import SafetensorsFile, write_safetensors
from gpudiag.reference_engine.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer

TINY = ModelConfig.preset("tiny")
LOGIT_ATOL = 1e-5


class PagedSequences:
    """A minimal block manager: sequences get blocks from a shuffled pool, as an engine would hand them out."""

    def __init__(self, model, num_blocks: int = 24, block_size: int = 8, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.cache = allocate_kv_cache(model.config, num_blocks, block_size)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def _slot(self, seq: int, pos: int) -> int:
        while len(self.tables[seq]) <= pos // self.block_size:
            self.tables[seq].append(self.free.pop())
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def _tables(self, seqs):
        width = max(len(self.tables[s]) for s in seqs)
        return torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs], dtype=torch.int32)

    def prefill(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Append ``chunks[seq]`` tokens to each sequence in one packed prefill; last-token logits."""
        seqs = list(chunks)
        ids, pos, slots, cu = [], [], [], [0]
        for s in seqs:
            for tok in chunks[s]:
                ids.append(tok)
                pos.append(self.lens[s])
                slots.append(self._slot(s, self.lens[s]))
                self.lens[s] += 1
            cu.append(len(ids))
        return self.model.forward_paged(
            torch.tensor(ids), torch.tensor(pos), self.cache, self._tables(seqs),
            torch.tensor([self.lens[s] for s in seqs], dtype=torch.int32), torch.tensor(slots), True,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        """One decode step: one token per sequence."""
        seqs = list(tokens)
        pos = [self.lens[s] for s in seqs]
        slots = [self._slot(s, self.lens[s]) for s in seqs]
        for s in seqs:
            self.lens[s] += 1
        return self.model.forward_paged(
            torch.tensor([tokens[s] for s in seqs]), torch.tensor(pos), self.cache, self._tables(seqs),
            torch.tensor([self.lens[s] for s in seqs], dtype=torch.int32), torch.tensor(slots), False)


def _dense_last_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    width = max(map(len, sequences))
    padded = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    logits = model.forward_dense(padded)
    return torch.stack([logits[i, len(s) - 1] for i, s in enumerate(sequences)])


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(TINY, seed=1234)


def test_same_seed_gives_the_same_weights_and_another_seed_does_not():
    a, b, c = build_model(TINY, seed=7), build_model(TINY, seed=7), build_model(TINY, seed=8)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    tokens = torch.tensor([BOS_ID, 10, 20, 30])
    assert torch.equal(a.forward_dense(tokens), b.forward_dense(tokens))


def test_a_weight_does_not_depend_on_how_many_layers_follow_it():
    two = build_model(TINY, seed=5)
    three = build_model(TINY.replace(num_layers=3), seed=5)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(two.state_dict()[name], three.state_dict()[name])
    assert torch.equal(two.model.embed_tokens.weight, three.model.embed_tokens.weight)


def test_paged_generation_equals_dense_for_mixed_length_prompts(tiny_model):
    # Prompt lengths 11, 3 and 17 over blocks of 8: partial last blocks, one
    # prompt shorter than a block, blocks scattered over the pool.
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (11, 3, 17)]
    paged = PagedSequences(tiny_model, seed=1)
    seqs = [paged.add() for _ in prompts]
    logits = paged.prefill(dict(zip(seqs, prompts)))
    history = [list(p) for p in prompts]
    dense = _dense_last_logits(tiny_model, history)
    torch.testing.assert_close(logits, dense, atol=LOGIT_ATOL, rtol=0)
    for _ in range(7):  # 17 + 7 = 24: the longest crosses into its fourth block
        greedy = logits.argmax(-1)
        assert torch.equal(greedy, dense.argmax(-1))
        for h, t in zip(history, greedy.tolist()):
            h.append(t)
        logits = paged.decode(dict(zip(seqs, greedy.tolist())))
        dense = _dense_last_logits(tiny_model, history)
        torch.testing.assert_close(logits, dense, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), dense.argmax(-1))


def test_prompt_prefilled_on_a_cached_prefix_equals_dense(tiny_model):
    # The second chunk attends to the first chunk's K/V already in the cache:
    # what a prefix-cache hit, a chunked prefill and a recompute all rely on.
    prompt = list(range(100, 130))
    other = list(range(50, 59))
    paged = PagedSequences(tiny_model, seed=2)
    a, b = paged.add(), paged.add()
    paged.prefill({a: prompt[:12]})
    logits = paged.prefill({b: other, a: prompt[12:]})
    dense = _dense_last_logits(tiny_model, [other, prompt])
    torch.testing.assert_close(logits, dense, atol=LOGIT_ATOL, rtol=0)


def test_paged_forward_in_bfloat16_stays_close_to_dense():
    model = build_model(TINY.replace(dtype="bfloat16"), seed=3)
    prompts = [list(range(30, 43)), list(range(70, 75))]
    paged = PagedSequences(model, seed=3)
    seqs = [paged.add() for _ in prompts]
    logits = paged.prefill(dict(zip(seqs, prompts)))
    dense = _dense_last_logits(model, prompts)
    assert paged.cache.storage.dtype == torch.bfloat16
    # bf16 activations: both paths round at the same points except inside
    # attention (gathered vs dense summation order, in float32 on both);
    # allowed: ~2 bf16 ulps of logits of ~0.5 (equal on this machine).
    torch.testing.assert_close(logits, dense, atol=1e-2, rtol=0)


def test_auto_backend_on_cpu_is_the_torch_path_and_triton_needs_a_gpu_or_the_interpreter():
    x = torch.randn(4, TINY.hidden_size)
    w = torch.randn(TINY.hidden_size)
    from gpudiag.reference_engine.model.kernels.rmsnorm import rms_norm_reference

    assert torch.equal(dispatch.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    with pytest.raises(GpudiagError, match="unknown kernel backend"):
        dispatch.check_backend("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":  # under the interpreter "triton" does run on the CPU
        with pytest.raises(GpudiagError, match="CUDA device"):
            dispatch.rms_norm(x, w, 1e-5, backend="triton")


def test_checkpoint_with_llama_names_round_trips(tiny_model, tmp_path):
    path = tmp_path / "model.safetensors"
    tiny_model.save_safetensors(path)
    with SafetensorsFile(path) as f:
        names = set(f.names())
    for expected in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                     "model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"):
        assert expected in names
    assert not any("rope" in n for n in names)
    loaded = build_model(TINY, seed=999, checkpoint=path)
    for name, t in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    tokens = torch.tensor([BOS_ID, 1, 2, 3, 4])
    assert torch.equal(loaded.forward_dense(tokens), tiny_model.forward_dense(tokens))
    # The file's fingerprint identifies the weights: same digest from memory and from disk.
    assert loaded.fingerprint() == fingerprint_file(path)
    assert loaded.fingerprint().sha256 == tiny_model.fingerprint().sha256


def test_sharded_checkpoint_without_lm_head_ties_it_to_the_embedding(tiny_model, tmp_path):
    sd = tiny_model.state_dict()
    names = [n for n in sd if n != "lm_head.weight"]
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {n: sd[n] for n in names[:7]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {n: sd[n].to(torch.bfloat16) for n in names[7:]} | {
                          "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    loaded = build_model(TINY, seed=1, checkpoint=tmp_path)  # a directory of shards
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    n = names[-1]
    assert torch.equal(loaded.state_dict()[n], sd[n].to(torch.bfloat16).float())  # dtype converted
    assert len(loaded.checkpoint_paths) == 2


@pytest.mark.parametrize("damage,message", [
    (lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"), "lacks model.layers.1.mlp.down_proj.weight"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)), "has shape"),
    (lambda sd: sd.__setitem__("model.layers.7.self_attn.q_proj.weight", torch.zeros(3)), "not a parameter"),
], ids=["missing", "wrong-shape", "unknown-tensor"])
def test_checkpoint_that_does_not_fit_the_config_is_refused(tiny_model, tmp_path, damage, message):
    sd = dict(tiny_model.state_dict())
    damage(sd)
    write_safetensors(tmp_path / "bad.safetensors", sd)
    with pytest.raises(GpudiagError, match=message):
        build_model(TINY, checkpoint=tmp_path / "bad.safetensors")


def test_presets_and_cost_model_figures():
    llama = PRESETS["llama-7b"]
    assert llama.param_count() == 6_738_415_616  # Llama-2-7B's published count
    assert llama.kv_bytes_per_token() == 512 * 1024  # fp16: 2 * 32 layers * 32 heads * 128 * 2 B
    assert llama.weight_bytes() == 2 * llama.param_count()
    mistral = PRESETS["mistral-7b"]
    assert mistral.num_kv_heads == 8 and mistral.queries_per_kv_head == 4
    assert mistral.kv_bytes_per_token(dtype_bytes=2) == 128 * 1024
    assert mistral.param_count() == 7_241_732_096
    tiny = PRESETS["tiny"]
    assert sum(p.numel() for p in build_model(tiny).parameters()) == tiny.param_count()


def test_config_from_hugging_face_json_and_from_own_fields(tmp_path):
    hf = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
          "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
          "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
          "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    assert cfg.replace(name="mistral-7b") == PRESETS["mistral-7b"]
    (tmp_path / "own.json").write_text(json.dumps(TINY.to_dict()))
    assert load_model_config(str(tmp_path / "own.json")) == TINY
    assert load_model_config("tiny") is PRESETS["tiny"]


@pytest.mark.parametrize("change,message", [
    ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
    ({"head_dim": 15}, "even"),
    ({"hidden_size": 0}, "positive integer"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"rms_eps": -1.0}, "positive number"),
    ({"colour": "red"}, "unknown keys colour"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
])
def test_impossible_config_is_refused_with_the_field_named(tmp_path, change, message):
    data = TINY.to_dict() | change
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(GpudiagError, match=message):
        ModelConfig.from_json(tmp_path / "c.json")


def test_config_file_errors_are_one_clear_message(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(GpudiagError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "broken.json")
    with pytest.raises(GpudiagError, match="cannot read"):
        ModelConfig.from_json(tmp_path / "absent.json")
    with pytest.raises(GpudiagError, match="neither a preset"):
        load_model_config("llama-70b")


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode("a", add_bos=False, add_eos=True) == [97, EOS_ID]
    assert tok.decode([BOS_ID, 104, 105, EOS_ID], skip_special=False) == "<bos>hi<eos>"
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # a truncated character from a random model never raises
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in "東".encode()]
    assert pieces == ["", "", "東"]
    with pytest.raises(GpudiagError, match="lone surrogate"):
        tok.encode("\ud800")
    assert tok.vocab_size <= TINY.vocab_size

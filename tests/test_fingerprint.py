"""A model fingerprint identifies the weights: any changed byte shows, file layout does not."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest
import torch

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.model.fingerprint import (
    FINGERPRINT_TAG,
    fingerprint_file,
    fingerprint_files,
    fingerprint_tensors,
)
from gpudiag.reference_engine.model.safetensors_io import SafetensorsFile, write_safetensors


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).half(),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.randn(16, 8, generator=g),
        "step": torch.tensor(3),
    }


def _write_header(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_one_changed_byte_in_one_tensor_changes_the_digest(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, _weights())
    before = fingerprint_file(path)
    with SafetensorsFile(path) as f:
        offset = f.entries["model.layers.0.self_attn.q_proj.weight"].start + 37
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    after = fingerprint_file(path)
    assert after.sha256 != before.sha256
    assert (after.tensor_count, after.tensor_bytes) == (before.tensor_count, before.tensor_bytes)
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    assert fingerprint_file(path) == before


def test_order_of_tensors_in_the_file_does_not_matter(tmp_path):
    w = _weights()
    write_safetensors(tmp_path / "a.safetensors", w)
    write_safetensors(tmp_path / "b.safetensors", dict(reversed(list(w.items()))), metadata={"note": "reordered"})
    assert (tmp_path / "a.safetensors").read_bytes() != (tmp_path / "b.safetensors").read_bytes()
    assert fingerprint_file(tmp_path / "a.safetensors").sha256 == fingerprint_file(tmp_path / "b.safetensors").sha256


def test_name_dtype_and_shape_are_part_of_the_identity(tmp_path):
    data = torch.arange(12, dtype=torch.int32)
    variants = {
        "base": {"w": data.reshape(3, 4)},
        "renamed": {"v": data.reshape(3, 4)},
        "reshaped": {"w": data.reshape(4, 3)},
        "same bytes, other dtype": {"w": data.reshape(3, 4).view(torch.float32)},
    }
    digests = {}
    for label, tensors in variants.items():
        p = tmp_path / f"{label}.safetensors"
        write_safetensors(p, tensors)
        digests[label] = fingerprint_file(p).sha256
    assert len(set(digests.values())) == len(variants), digests


def test_digest_is_the_documented_encoding(tmp_path):
    p = tmp_path / "one.safetensors"
    write_safetensors(p, {"w": torch.tensor([1.0, 2.0])})
    def u64(n):
        return struct.pack("<Q", n)

    expected = hashlib.sha256(FINGERPRINT_TAG + u64(1) + b"w" + u64(3) + b"F32" + u64(1) + u64(2) + u64(8)
                              + struct.pack("<2f", 1.0, 2.0)).hexdigest()
    assert fingerprint_file(p).sha256 == expected


def test_chunking_shards_and_memory_give_the_same_digest(tmp_path):
    w = _weights()
    write_safetensors(tmp_path / "whole.safetensors", w)
    names = sorted(w)
    write_safetensors(tmp_path / "part1.safetensors", {n: w[n] for n in names[:2]})
    write_safetensors(tmp_path / "part2.safetensors", {n: w[n] for n in names[2:]})
    whole = fingerprint_file(tmp_path / "whole.safetensors")
    assert fingerprint_file(tmp_path / "whole.safetensors", chunk_bytes=7).sha256 == whole.sha256
    shards = fingerprint_files([tmp_path / "part2.safetensors", tmp_path / "part1.safetensors"])
    assert shards.sha256 == whole.sha256 and shards.tensor_count == len(w)
    assert fingerprint_tensors(w).sha256 == whole.sha256
    with pytest.raises(GpudiagError, match="not shards of one model"):
        fingerprint_files([tmp_path / "whole.safetensors", tmp_path / "part1.safetensors"])


def test_a_large_file_is_hashed_in_little_memory(tmp_path):
    # A sparse 1 GiB tensor (no disk used): the hashing process must stay far
    # below the file's size. Measured in a fresh interpreter (no torch in it).
    n = 1 << 30
    p = tmp_path / "big.safetensors"
    blob = json.dumps({"big": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    blob += b" " * (-len(blob) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + n)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked
    # pytest process, which holds torch.
    script = ("import sys, json\n"
              "from gpudiag.reference_engine.model.fingerprint import fingerprint_file\n"
              "fp = fingerprint_file(sys.argv[1])\n"
              "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
              "print(json.dumps({'bytes': fp.tensor_bytes, 'torch': 'torch' in sys.modules, 'peak_rss_kib': hwm}))\n")
    out = subprocess.run([sys.executable, "-c", script, str(p)], check=False, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bytes"] == n and not result["torch"]
    assert result["peak_rss_kib"] * 1024 < 128 * 2**20, result  # ~1 chunk + the interpreter, not 1 GiB


def test_cli_prints_digests_and_json(cli, tmp_path):
    w = _weights()
    names = sorted(w)
    write_safetensors(tmp_path / "whole.safetensors", w)
    write_safetensors(tmp_path / "s1.safetensors", {n: w[n] for n in names[:3]})
    write_safetensors(tmp_path / "s2.safetensors", {n: w[n] for n in names[3:]})
    whole = fingerprint_file(tmp_path / "whole.safetensors").sha256
    r = cli("fingerprint", tmp_path / "whole.safetensors")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(whole) and "5 tensors" in r.stdout
    r = cli("fingerprint", tmp_path / "s1.safetensors", tmp_path / "s2.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [f["tensor_count"] for f in doc["files"]] == [3, 2]
    assert doc["combined"]["sha256"] == whole


def _hostile_files(tmp_path):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"a": torch.zeros(4), "b": torch.ones(2)})
    raw = good.read_bytes()
    cases = {"missing": tmp_path / "absent.safetensors", "directory": tmp_path}
    (tmp_path / "short").write_bytes(b"\x01\x02")
    cases["shorter than the length field"] = tmp_path / "short"
    (tmp_path / "truncated").write_bytes(raw[:-3])
    cases["truncated data"] = tmp_path / "truncated"
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    cases["header length beyond the limit"] = tmp_path / "huge"
    (tmp_path / "past").write_bytes(struct.pack("<Q", 1000) + b"{}")
    cases["header length past the end"] = tmp_path / "past"
    (tmp_path / "notjson").write_bytes(struct.pack("<Q", 5) + b"{nope")
    cases["header not JSON"] = tmp_path / "notjson"
    _write_header(tmp_path / "overlap", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    cases["overlapping tensors"] = tmp_path / "overlap"
    _write_header(tmp_path / "gap", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))
    cases["gap in the buffer"] = tmp_path / "gap"
    _write_header(tmp_path / "dtype", {"a": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, bytes(1))
    cases["unknown dtype"] = tmp_path / "dtype"
    _write_header(tmp_path / "size", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    cases["shape and byte range disagree"] = tmp_path / "size"
    _write_header(tmp_path / "neg", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8))
    cases["negative dimension"] = tmp_path / "neg"
    _write_header(tmp_path / "list", ["not", "an", "object"])
    cases["header not an object"] = tmp_path / "list"
    return cases


def test_bad_files_are_one_error_line_and_exit_2(cli, tmp_path):
    cases = _hostile_files(tmp_path)
    for path in cases.values():
        with pytest.raises(GpudiagError, match=r"^[^\n]+$"):
            fingerprint_file(path)
    # Through the CLI (a process start each): one case of each kind of failure.
    for label in ("missing", "directory", "truncated data", "header length beyond the limit", "unknown dtype"):
        r = cli("fingerprint", cases[label])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (label, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("gpudiag: error:"), (label, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", label

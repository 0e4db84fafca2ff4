"""A byte-level tokenizer: every UTF-8 byte is a token, plus BOS, EOS and PAD.

It needs no vocabulary file and no download, encodes any text, and decodes
any id sequence (invalid UTF-8 from a randomly initialised model becomes
U+FFFD, never an exception). Ids 0-255 are the bytes themselves.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from gpudiag.errors import GpudiagError

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


class ByteTokenizer:
    """Text <-> token ids, one token per UTF-8 byte."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """The ids of ``text``'s UTF-8 bytes, optionally framed by BOS/EOS."""
        if not isinstance(text, str):
            raise GpudiagError(f"tokenizer: expected text, got {type(text).__name__}")
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise GpudiagError(f"tokenizer: text is not valid Unicode at position {exc.start} "
                               "(a lone surrogate)") from None
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special ids are dropped (or spelled ``<bos>``...), bad UTF-8 becomes U+FFFD.

        Ids beyond the byte range that are not special (a model's padded
        vocabulary) are dropped like special ids.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < NUM_BYTES:
                out.append(i)
            elif not skip_special:
                out += _special_name(i).encode()
        return out.decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        """A decoder for one generation that returns text as soon as its bytes are complete."""
        return StreamDecoder()


class StreamDecoder:
    """Incremental decoding: a multi-byte character is emitted once all its bytes arrived."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes (often '')."""
        token_id = int(token_id)
        if 0 <= token_id < NUM_BYTES:
            return self._decoder.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        """Text of any incomplete trailing character (as U+FFFD)."""
        return self._decoder.decode(b"", final=True)


def _special_name(i: int) -> str:
    return {BOS_ID: "<bos>", EOS_ID: "<eos>", PAD_ID: "<pad>"}.get(i, f"<unk:{i}>")

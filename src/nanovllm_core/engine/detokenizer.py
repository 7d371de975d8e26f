"""Incremental detokenization: the text each new token adds, without decoding everything again.

A token is not always a whole character (byte-level BPE splits multi-byte characters over
several tokens) and decoding a token alone can lose a leading space (SentencePiece). So the
new text is found by decoding a short window twice, as vLLM does: the window up to the
previous token and the window including the new one; their difference is the new text,
held back while it ends in an incomplete character (U+FFFD).

What is handed to listeners (``release_text``) also waits while the text's end could be the
start of a stop string, so streamed pieces never show text that the stop string later cuts.
"""

from __future__ import annotations

from typing import Any

from nanovllm_core.engine.sequence import Sequence

_WINDOW = 5  # tokens of left context for each decode


def start_detokenizer(seq: Sequence) -> None:
    """Point the window just before the first generated token (a few prompt tokens as context)."""
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)


def detokenize_new_token(tokenizer: Any, seq: Sequence) -> str:
    """Advance ``seq``'s window over its newest token; return the text it completes ("" if none yet).

    Text pieces returned over a sequence's life concatenate to its output text.
    """
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return full_text[len(prefix_text):]
    return ""


class TokenBytes:
    """A token's own bytes, as OpenAI's chat logprobs give them: ``token_bytes(token_id, text)``.

    Decoding one token alone gives U+FFFD for a token holding part of a UTF-8 character, so the
    bytes come from the vocabulary entry: byte-level BPE (GPT-2's alphabet, SmolLM's and LLaMA 3's
    tokenizers) maps each character of the entry to one byte; SentencePiece's byte fallback
    writes a byte as ``<0xE5>``. Other tokens: ``text`` (the token decoded alone) as UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._bytes = _byte_decoder()

    def __call__(self, token_id: int, text: str) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(ch in self._bytes for ch in piece):
                return bytes(self._bytes[ch] for ch in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return text.encode("utf-8", errors="replace")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def byte_text(data: bytes) -> str:
    """``data`` as text, each byte that is not part of a whole UTF-8 character written ``<0xE3>``
    (SentencePiece's name of a byte token): ``b" \xe3\x81"`` -> ``" <0xE3><0x81>"``."""
    text = data.decode("utf-8", errors="surrogateescape")  # a stray byte b -> U+DC00 + b
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


class TokenPieces:
    """A token's text on its own, for showing it (a top-k candidate, a prompt's pieces, a draft):
    ``pieces(token_id)``. The token decoded alone, except a token holding only part of a character's
    bytes: decoded alone it is U+FFFD, the same for every such token (trial 14a: five top-k rows of a
    Japanese reply all read "�"), so those bytes are written ``<0xE3>`` (:func:`byte_text`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self._bytes = TokenBytes(tokenizer)

    def __call__(self, token_id: int) -> str:
        text = self._decode([token_id])
        if "\ufffd" not in text:
            return text
        return byte_text(self._bytes(token_id, text))


def find_stop_string(seq: Sequence, new_text_len: int) -> tuple[str, int] | None:
    """The first stop string that appears in the output text's newest part, and where it starts.

    Only the last ``new_text_len + len(stop) - 1`` characters can hold a new match, so a stop
    string spanning two tokens is found when its last piece arrives.
    """
    text = seq.output_text
    best: tuple[str, int] | None = None
    for stop in seq.params.stop:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best


def release_text(seq: Sequence, finished: bool) -> str:
    """The part of ``seq.output_text`` that became final since the last call (for streaming).

    While a request has stop strings (and does not keep them in its output), the last
    ``max(len(stop)) - 1`` characters are held back: they might be the start of a stop
    string that the next token completes and that will be cut. When the sequence finishes,
    the rest is released. The pieces concatenate to the final ``output_text`` (vLLM V1's
    ``stop_buffer_length``).
    """
    p = seq.params
    hold = 0
    if not finished and p.stop and not p.include_stop_str_in_output:
        hold = max(len(s) for s in p.stop) - 1
    end = max(seq.num_streamed_chars, len(seq.output_text) - hold)
    piece = seq.output_text[seq.num_streamed_chars:end]
    seq.num_streamed_chars = end
    return piece


def streamed_text(seq: Sequence) -> str:
    """The output text released so far (what a streaming client has seen)."""
    return seq.output_text[: seq.num_streamed_chars]

"""Text in and out of a generative model: tokenizers, and the text of tokens as they come.

A `Tokenizer` turns a prompt into ids and ids back into text. Two kinds: `ByteTokenizer`
(UTF-8 bytes, the built-in GPT's default: ``partrain train --dataset text``) and
`HFTokenizer` (a Hugging Face tokenizer from a local directory or the local cache;
nothing downloads).

`TextStream` follows one sequence's new tokens: it hands out text only once it is
whole (a UTF-8 character split over byte tokens, a word piece that the next token
changes) and holds back the tail that could still become a stop string, so that a
streamed answer never shows text the final answer leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ...errors import UsageError


class Tokenizer(Protocol):
    name: str
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes: token ``b`` is the byte ``b`` (256 ids, no end-of-text token)."""

    name = "bytes"
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer``), local files only.

    ``encode`` adds no special tokens (the prompt is taken as written); the model's
    end-of-text ids (``eos_token_id``, one or several) end a generation.
    """

    def __init__(self, source: str, eos_token_ids: Sequence[int] = ()) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UsageError(f"Expected the Python package transformers for tokenizer {source!r}. Received: "
                             "transformers is not installed (pip install 'partrain[hf]')") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UsageError(f"Expected a tokenizer saved in {source!r} or in the local Hugging Face cache "
                             f"(partrain downloads nothing). Received: {str(exc).splitlines()[0]}") from None
        self.name = source
        own = self._tok.eos_token_id
        ids = list(eos_token_ids) or ([] if own is None else [own])
        self.eos_token_ids = tuple(int(i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class TextStream:
    """The text of one sequence's generated tokens, handed out as it becomes final.

    ``push(token)`` returns the new final text (may be ""); ``stopped`` says whether a
    stop string appeared (the text then ends before it); ``finish()`` returns what was
    held back once the sequence ends for another reason. Decoding re-reads a window of
    recent tokens (as vLLM's incremental detokenizer does), so a tokenizer whose text
    for a token depends on its neighbours is followed exactly.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may begin a stop string
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far, final up to `sent` + held back
        self._decoded_upto = 0  # ids whose text is in self.text
        self._window = 0  # first id of the window decoded again each time
        self._prefix = ""  # the window's text up to _decoded_upto (decoded once, when it changes)
        self.sent = 0  # chars of self.text handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""  # the text ended at its stop string
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids[self._window:])
        if full.endswith("\ufffd") or not full.startswith(self._prefix):
            return ""  # a character or word still incomplete: wait for the next token
        self.text += full[len(self._prefix):]
        self._decoded_upto = len(self.ids)
        self._prefix = full  # the window's text up to here: the next token's prefix
        if len(self.ids) - self._window > 8:
            self._window = len(self.ids) - 4
            self._prefix = self.tokenizer.decode(self.ids[self._window:])
        return self._release(final=False)

    def finish(self) -> str:
        """Everything not handed out yet (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        if self._decoded_upto < len(self.ids):  # an incomplete character at the end: as the tokenizer reads it
            self.text += self.tokenizer.decode(self.ids[self._window:])[len(self._prefix):]
            self._decoded_upto = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.sent - self.hold)  # a stop string may straddle what was already sent
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self.text = self.text[:min(hits)]
                final = True
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def load_tokenizer(name: str | None, vocab_size: int) -> Any:
    """The tokenizer a checkpoint names (``None`` or ``"bytes"``: bytes, for a 256-token vocabulary)."""
    if name in (None, "bytes"):
        if vocab_size < 256:
            return None  # ids only: bytes would name tokens the model does not have
        return ByteTokenizer()
    return HFTokenizer(name)

"""Instruction data for fine-tuning: prompt/completion and chat `messages` jsonl, the chat template,
the loss mask and the packing of whole examples into the trainer's sequences.

Inputs, one JSON object a line:
    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Rendering. With a chat template (`--chat-template FILE`, else the `chat_template` of the
tokenizer's tokenizer_config.json or its chat_template.jinja) the conversation is rendered with
Jinja as transformers' `apply_chat_template` does (a sandboxed environment, trim_blocks and
lstrip_blocks, `raise_exception`, `tojson`, bos_token/eos_token from tokenizer_config.json); a
prompt/completion example is then the conversation [user: prompt, assistant: completion]. Without
a template a prompt/completion example is bos + prompt + completion + eos (`--bos/--eos`, else the
tokenizer's), and `messages` are refused (no template to render them with).

Loss mask. Only the assistant's tokens are trained (completion-only loss): each assistant turn is
the text between the conversation rendered up to it with `add_generation_prompt=True` and the
conversation rendered with it, so its end-of-turn token is trained too and every prompt token is
not. The pieces are tokenized apart (without the tokenizer's own specials: the template writes
them), so the mask falls on token boundaries exactly.

Packing (the token file's `packed_seq_len` L). The trainer's sample i is the window of L+1 tokens
at i*L (dslurm/data/tokenize.py); examples are laid end to end so that none crosses a window: one
that does not fit the rest of the window starts the next, after pad tokens (loss 0, a document of
their own); one longer than L+1 tokens is cut to L+1 (counted, and said). `doc_start` marks the
first token of each example, from which the trainer builds the attention mask that keeps every
example to itself (train/packing.py). A shard ends on a window boundary, so shards concatenate in
a manifest; the last one has the one token more that its last window needs.

Torch-free (numpy, jinja2, tokenizers).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dslurm.errors import UserError

log = logging.getLogger(__name__)
MASK = "loss_mask"
DOC_START = "doc_start"
CONFIG = "tokenizer_config.json"


# ---------------------------------------------------------------- the chat template


def find_template(template_file: str | None, tokenizer_path: Path) -> tuple[str | None, dict[str, Any]]:
    """(the template's text or None, tokenizer_config.json's contents or {}): `template_file` when
    given, else the tokenizer folder's chat_template.jinja or tokenizer_config.json's chat_template."""
    folder = tokenizer_path.parent
    cfg: dict[str, Any] = {}
    if (folder / CONFIG).is_file():
        try:
            cfg = json.loads((folder / CONFIG).read_text())
        except ValueError as exc:
            raise UserError(f"{folder / CONFIG}: not JSON ({exc}). Fix: copy the model's own {CONFIG}") from None
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise UserError(f"--chat-template {path}: no such file. Fix: give a Jinja chat template file")
        return path.read_text(), cfg
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), cfg
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # several named templates: transformers takes "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return (tpl if isinstance(tpl, str) else None), cfg


def _special_text(value: Any) -> str:
    if isinstance(value, dict):  # tokenizer_config.json may hold an AddedToken as a dict
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def renderer(template: str, cfg: dict[str, Any], where: str) -> Callable[[list[dict[str, Any]], bool], str]:
    """render(messages, add_generation_prompt) -> text, with transformers' Jinja settings."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise UserError(f"{where}: the chat template does not parse ({exc}). Fix: give a valid Jinja template "
                        "with --chat-template") from None
    specials = {k: _special_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
        except TemplateError as exc:
            raise UserError(f"{where}: the chat template refused the conversation ({exc})") from None

    return render


# ---------------------------------------------------------------- one example -> tokens + mask


@dataclass(frozen=True, slots=True)
class Encoder:
    """Turns one example into (token ids, loss mask)."""

    tok: Any
    bos: int | None
    eos: int | None
    render: Callable[[list[dict[str, Any]], bool], str] | None

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids) if text else []

    def encode(self, ex: Any, where: str) -> tuple[list[int], list[int]]:
        if not isinstance(ex, dict):
            raise UserError(f"{where}: not a JSON object. Fix: one {{\"prompt\", \"completion\"}} or "
                            "{\"messages\"} object a line")
        if "messages" in ex:
            return self._chat(_messages(ex["messages"], where), where)
        if "prompt" in ex and "completion" in ex:
            prompt, completion = ex["prompt"], ex["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UserError(f"{where}: fields 'prompt' and 'completion' must be strings")
            if self.render is not None:
                return self._chat([{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": completion}], where)
            pre = [self.bos] if self.bos is not None else []
            post = [self.eos] if self.eos is not None else []
            p, c = pre + self.ids(prompt), self.ids(completion) + post
            return p + c, [0] * len(p) + [1] * len(c)
        raise UserError(f"{where}: no 'messages' and no 'prompt' + 'completion' fields (it has "
                        f"{', '.join(sorted(ex)) or 'none'}). Fix: one of the two forms (docs/data.md)")

    def _chat(self, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[int]]:
        if self.render is None:
            raise UserError(f"{where}: a 'messages' example needs a chat template, and the tokenizer's "
                            f"{CONFIG} has none. Fix: give --chat-template FILE")
        ids: list[int] = []
        mask: list[int] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix, full = self.render(messages[:i], True), self.render(messages[:i + 1], False)
            if not (prefix.startswith(done) and full.startswith(prefix)):
                raise UserError(f"{where}: the chat template does not render a conversation as the start of its "
                                "continuation, so the assistant's tokens cannot be told apart. Fix: give a "
                                "template that does, with --chat-template")
            for text, trained in ((prefix[len(done):], 0), (full[len(prefix):], 1)):
                piece = self.ids(text)
                ids += piece
                mask += [trained] * len(piece)
            done = full
        rest = self.ids(self.render(messages, False)[len(done):])
        return ids + rest, mask + [0] * len(rest)


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UserError(f"{where}: field 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects "
                        "with string values")
    if not any(m["role"] == "assistant" for m in value):
        raise UserError(f"{where}: field 'messages' has no assistant turn, so nothing would be trained. Fix: drop "
                        "the example or add the assistant's reply")
    return list(value)


def examples(paths: list[Path]) -> Iterator[tuple[Any, str]]:
    """(the parsed object, 'file:line') of every non-blank line of the jsonl inputs, in order."""
    for path in paths:
        if path.suffix != ".jsonl":
            raise UserError(f"{path}: instruction data is jsonl (one example a line). Fix: give .jsonl files")
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line), f"{path}:{n}"
                    except ValueError as exc:
                        raise UserError(f"{path}:{n}: not JSON ({exc}). Fix: one JSON object a line") from None


# ---------------------------------------------------------------- packing


@dataclass
class Packer:
    """Lays examples into windows of L+1 tokens at stride L (see the module docstring)."""

    seq_len: int
    pad_id: int
    pos: int = 0
    truncated: int = 0
    examples: int = 0
    trained: int = 0

    def place(self, ids: list[int], mask: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, loss mask, doc starts) to append for one example, pads before it included."""
        L = self.seq_len
        if not ids:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint8)
        if len(ids) > L + 1:
            ids, mask = ids[:L + 1], mask[:L + 1]
            self.truncated += 1
        room = (self.pos // L) * L + L + 1 - self.pos
        pad = ((self.pos // L) + 1) * L - self.pos if len(ids) > room else 0
        tokens = np.array([self.pad_id] * pad + ids, dtype=np.int64)
        loss = np.array([0] * pad + [0] + mask[1:], dtype=np.uint8)  # a first token has no context to learn from
        start = np.zeros(len(tokens), dtype=np.uint8)
        start[0] = 1
        start[pad] = 1
        self.pos += len(tokens)
        self.examples += 1
        self.trained += int(loss.sum())
        return tokens, loss, start

    def end(self, last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pads to the next window boundary (+1 token on the last shard: its last window's end)."""
        n = (-self.pos) % self.seq_len + (1 if last else 0)
        start = np.zeros(n, dtype=np.uint8)
        if n:
            start[0] = 1
        self.pos += n
        return np.full(n, self.pad_id, dtype=np.int64), np.zeros(n, dtype=np.uint8), start


def packed_chunks(paths: list[Path], enc: Encoder, packer: Packer, *, last: bool,
                  batch: int = 1024) -> Iterator[dict[str, np.ndarray]]:
    """The arrays of one shard (tokens, loss_mask, doc_start), in chunks of about `batch` examples."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for ex, where in examples(paths):
        parts.append(packer.place(*enc.encode(ex, where)))
        if len(parts) >= batch:
            yield _join(parts)
            parts = []
    parts.append(packer.end(last))
    yield _join(parts)
    if packer.truncated:
        log.warning("%d of %d examples were longer than seq_len+1 = %d tokens and were cut", packer.truncated,
                    packer.examples, packer.seq_len + 1)


def _join(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    return {"tokens": np.concatenate([p[0] for p in parts]), MASK: np.concatenate([p[1] for p in parts]),
            DOC_START: np.concatenate([p[2] for p in parts])}

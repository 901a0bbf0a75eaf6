"""A Hugging Face `tokenizers` tokenizer from a local tokenizer.json, and how documents join.

Never a hub download: `load` takes a tokenizer.json or a folder holding one.

Document separators. Each document becomes
    [bos]  +  tokenizer.encode(doc).ids  +  [eos]
where `tokenizer.encode` applies the tokenizer's own post-processor (a TemplateProcessing that
adds `<s>` ... `</s>` does so for every document), and `[bos]` / `[eos]` are present only when
given explicitly (`--bos TOKEN`, `--eos TOKEN`). The ids recorded as bos_id / eos_id are the
explicit ones, else those the post-processor adds (found by encoding a probe text). With
neither, documents run into each other (a warning says so).
"""

from __future__ import annotations

import array
import hashlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dslurm.errors import UserError

log = logging.getLogger(__name__)
FILENAME = "tokenizer.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerInfo:
    """What a token file and a manifest record about the tokenizer."""

    path: str
    hash: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    add_bos: int | None = None
    """Explicit BOS id put before every document (None: only the post-processor's)."""
    add_eos: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    f = p / FILENAME if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"{f}: no tokenizer file. Fix: give a tokenizer.json (or a folder "
                        f"holding one, e.g. a Hugging Face model folder); nothing is downloaded")
    return f.resolve()


def load(path: str | Path, *, bos: str | None = None, eos: str | None = None,
         warn: bool = True) -> tuple[Any, TokenizerInfo]:
    """(tokenizers.Tokenizer, TokenizerInfo) for `path`; a file that does not parse is a UserError.
    `warn`: say so when neither the tokenizer nor `bos`/`eos` separates documents."""
    from tokenizers import Tokenizer

    f = tokenizer_file(path)
    data = f.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise UserError(f"{f}: does not parse as a `tokenizers` tokenizer.json ({exc}). Fix: give "
                        f"the file written by Tokenizer.save() or a model folder's "
                        f"tokenizer.json") from exc

    def special(token: str | None, flag: str) -> int | None:
        if token is None:
            return None
        tid = tok.token_to_id(token)
        if tid is None:
            raise UserError(f"{flag} {token!r}: not a token of {f}. Fix: give a token of its "
                            f"vocabulary, e.g. its EOS token such as '</s>' or '<|endoftext|>'")
        return int(tid)

    add_bos, add_eos = special(bos, "--bos"), special(eos, "--eos")
    probe = tok.encode("a")
    mask, ids = probe.special_tokens_mask, probe.ids
    lead = ids[0] if ids and mask[0] else None
    trail = ids[-1] if len(ids) > 1 and mask[-1] else None
    info = TokenizerInfo(path=str(f), hash=hashlib.sha256(data).hexdigest(),
                         vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                         bos_id=add_bos if add_bos is not None else lead,
                         eos_id=add_eos if add_eos is not None else trail,
                         add_bos=add_bos, add_eos=add_eos)
    if warn and info.bos_id is None and info.eos_id is None:
        log.warning("%s adds no BOS/EOS and none was given: documents run into each other "
                    "(give --eos TOKEN to separate them)", f)
    return tok, info


def encode_batch(tok: Any, info: TokenizerInfo, docs: list[str]) -> np.ndarray:
    """The documents' tokens, concatenated with the separators above (uint32)."""
    encs = tok.encode_batch_fast(docs, add_special_tokens=True)
    out = array.array("I")  # extend() from lists is ~2x np.fromiter over a chain
    if info.add_bos is None and info.add_eos is None:
        for e in encs:
            out.extend(e.ids)
    else:
        pre = [info.add_bos] if info.add_bos is not None else []
        post = [info.add_eos] if info.add_eos is not None else []
        for e in encs:
            out.extend(pre)
            out.extend(e.ids)
            out.extend(post)
    return np.frombuffer(out, dtype=np.uint32)

"""Instruction data (dslurm/data/instruct.py, train/packing.py) with a real `tokenizers` BPE trained
here and a chat template in its tokenizer_config.json: the loss mask falls on the completions'
tokens exactly, examples are packed whole into the trainer's windows, the trainer's targets skip
the prompts and its attention stays inside an example. Rendering against transformers' own
apply_chat_template: tests/integration/test_instruct_train.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dslurm.config.models import PRESETS
from dslurm.data import cli as data_cli
from dslurm.data import instruct
from dslurm.data import tokenize as tk
from dslurm.data.manifest import token_sources
from dslurm.errors import UserError
from train import packing
from train.model import build_model

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEXT = ["what is the capital of france", "paris is the capital", "add two and two", "four is the answer",
        "say hello", "hello there friend"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    return d


def _cli(argv):
    parser = argparse.ArgumentParser(prog="dslurm")
    data_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _tokenize(tmp, tok_dir, rows, *extra, seq_len=16):
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "out"
    assert _cli(["data", "tokenize", str(src), "--tokenizer", str(tok_dir), "--out", str(out), "--instruct",
                 "--seq-len", str(seq_len), *extra]) == 0
    (shard,) = token_sources(out)
    f = tk.TokenFile(shard.path)
    n = f.n_tokens
    return f, f.window(0, n), f.window(0, n, instruct.MASK), f.window(0, n, instruct.DOC_START)


def _decode(tok_dir, ids):
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).decode(list(ids), skip_special_tokens=False)


def test_messages_train_only_the_assistants_turns_with_their_end_tokens(tmp_path, tok_dir):
    conv = [{"role": "user", "content": TEXT[0]}, {"role": "assistant", "content": TEXT[1]},
            {"role": "user", "content": TEXT[2]}, {"role": "assistant", "content": TEXT[3]}]
    f, tokens, mask, start = _tokenize(tmp_path, tok_dir, [{"messages": conv}], seq_len=64)
    assert f.info.packed_seq_len == 64 and start[0] == 1
    assert "instruct    examples packed for seq_len 64" in data_cli.format_info(f.info)
    doc = tokens[:int(np.flatnonzero(start)[1]) if start[1:].any() else len(tokens)]
    rendered = instruct.renderer(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}, "t")(conv, False)
    assert _decode(tok_dir, doc) == rendered  # the pieces tokenized apart join to the whole conversation
    trained = _decode(tok_dir, tokens[mask == 1]).replace(" ", "")
    assert trained == f"{TEXT[1]}<|end|>\n{TEXT[3]}<|end|>\n".replace(" ", "")
    assert TEXT[0].replace(" ", "") in _decode(tok_dir, tokens[mask == 0]).replace(" ", "")


def test_prompt_completion_without_a_template_is_bos_prompt_completion_eos(tmp_path, tok_dir):
    rows = [{"prompt": TEXT[4], "completion": " " + TEXT[5]}]
    (tmp_path / "tpl").mkdir()
    bare = tmp_path / "tpl" / "tokenizer.json"
    bare.write_bytes((tok_dir / "tokenizer.json").read_bytes())  # no tokenizer_config.json: no template
    _, tokens, mask, _ = _tokenize(tmp_path, bare, rows, "--bos", "<s>", "--eos", "</s>")
    ref = Tokenizer.from_file(str(bare))
    p, c = ref.encode(TEXT[4], add_special_tokens=False).ids, ref.encode(" " + TEXT[5], add_special_tokens=False).ids
    n = 2 + len(p) + len(c)
    assert tokens[:n].tolist() == [1, *p, *c, 2]
    assert mask[:n].tolist() == [0] * (1 + len(p)) + [1] * (len(c) + 1)


def test_examples_are_packed_whole_into_windows_and_the_too_long_are_cut():
    p = instruct.Packer(seq_len=8, pad_id=0)
    lens = [5, 5, 12, 3, 9, 1]
    spans, out = [], []
    for n in lens:
        t, m, s = p.place(list(range(1, n + 1)), [1] * n)
        out.append((t, m, s))
        spans.append((p.pos - min(n, 9), p.pos))
    out.append(p.end(last=True))
    tokens = np.concatenate([o[0] for o in out])
    assert p.truncated == 1 and len(tokens) % 8 == 1  # the last shard: one token more than whole windows
    for a, b in spans:  # [a, b) inside one window [iL, iL + L]
        assert (b - 1) - (a // 8) * 8 <= 8, (a, b)
    mask = np.concatenate([o[1] for o in out])
    starts = np.concatenate([o[2] for o in out])
    assert all(mask[a] == 0 and starts[a] == 1 for a, _ in spans)  # a first token is never a target


def test_bad_examples_are_named_by_file_and_line(tmp_path, tok_dir):
    bare = tmp_path / "t" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_bytes((tok_dir / "tokenizer.json").read_bytes())
    src = tmp_path / "x.jsonl"
    cases = [({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
              "x.jsonl:2: a 'messages' example needs a chat template"),
             ({"text": "plain"}, "x.jsonl:2: no 'messages' and no 'prompt' + 'completion' fields (it has text)")]
    for row, want in cases:
        src.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(UserError, match=re.escape(want)):
            _cli(["data", "tokenize", str(src), "--tokenizer", str(bare), "--out", str(tmp_path / "o"),
                  "--instruct", "--seq-len", "16"])
    with pytest.raises(UserError, match="--instruct: give --seq-len"):
        _cli(["data", "tokenize", str(src), "--tokenizer", str(bare), "--out", str(tmp_path / "o"), "--instruct"])


def test_targets_skip_the_prompts_and_a_window_of_prompts_only_has_loss_zero():
    tokens = np.array([[5, 6, 7, 8, 9]])
    w = packing.Windows(tokens, np.array([[0, 0, 1, 1, 0]]), np.array([[1, 0, 0, 1, 0]]))
    inputs, targets, docs = packing.to_tensors(w, "cpu")
    assert inputs.tolist() == [[5, 6, 7, 8]] and targets.tolist() == [[packing.IGNORE, 7, 8, packing.IGNORE]]
    assert docs.tolist() == [[1, 1, 1, 2]]
    logits = torch.randn(1, 4, 10)
    want = torch.nn.functional.cross_entropy(logits[0, 1:3], targets[0, 1:3], reduction="sum")
    assert torch.allclose(packing.masked_sum(logits, targets), want)
    assert packing.masked_sum(logits, torch.full((1, 4), packing.IGNORE)).item() == 0.0


def test_a_packed_example_sees_nothing_of_the_one_before_it():
    model = build_model(dataclasses.replace(PRESETS["tiny"], seq_len=32), seed=0)
    a = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 10 + [1] * 12])
    with torch.no_grad():
        got, alone, leaky = model(packed, docs)[:, 10:], model(b), model(packed)[:, 10:]
    assert (got - alone).abs().max().item() < 1e-5  # RoPE is relative: the offset does not matter
    assert (leaky - alone).abs().max().item() > 1e-3  # without the documents, b would see a

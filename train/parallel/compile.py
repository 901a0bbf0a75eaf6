"""Optional per-block torch.compile.

Per block (not the whole model): blocks share one graph (compiled once, reused), and
whole-model compile of FSDP+TP fails on torch 2.13 ("Mixing fake modes NYI"). `module.compile()`
compiles in place, so parameter names do not gain an `_orig_mod.` prefix.

Trap (reproduced on torch 2.13 CPU): per-block compile with TP silently zeroes the
token-embedding gradient (AOTAutograd + DTensor, the embedding output aliases into the first
compiled graph). A forward hook on the embedding that returns `out.clone()` breaks the alias.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from train.model import Transformer


def _clone_output(_module: nn.Module, _inputs: Any, output: Any) -> Any:
    return output.clone()


def apply_compile(model: Transformer) -> None:
    """Compile each transformer block in place; guard the embedding gradient."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_clone_output)

"""Sharded tokenization: the plan, one shard per task, the manifest once all are done.

The submitting side (`dslurm data tokenize ... --out DIR`) groups the input files, in order,
into N contiguous groups of about equal bytes and freezes that into DIR/plan.json. Task i
(a Slurm array task, or a loop on this machine) tokenizes group i into DIR/shard-0000i.h5:
a temp file, fsynced, renamed (tokenize._write_atomic), so a killed task leaves no
finished-looking shard. Each shard carries the `key` of its group (tokenizer hash,
separators, options, its inputs' paths, sizes and mtimes): a shard counts as done only when
its key matches the plan's, so a re-run redoes exactly the missing, partial or stale ones.

The manifest (dslurm.data.manifest) is written by whichever task finds every shard done after
its own rename (the last one; two finishing together write the same bytes), and again by the
submitting side after `--wait` or a re-run with nothing left to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dslurm.data import hf, manifest, sources
from dslurm.data.progress import Reporter
from dslurm.data.sources import TxtDocs
from dslurm.durable import atomic_write_text
from dslurm.errors import UserError

log = logging.getLogger(__name__)
PLAN = "plan.json"
PLAN_FORMAT = "dslurm-tokenize-plan"


def fingerprint(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime": st.st_mtime}


def group_files(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of `sizes` cut into `n` contiguous, non-empty groups of about equal total.
    Pure, linear in len(sizes) (a running prefix sum)."""
    if n < 1:
        raise UserError(f"--shards {n}: must be at least 1 (one shard per array task). Fix: --shards 1 or more")
    if n > len(sizes):
        raise UserError(f"--shards {n}: must be in 1..{len(sizes)} (the inputs make {len(sizes)} pieces: "
                        f"whole .txt/.json/compressed files, plain .jsonl and parquet files cut at lines and "
                        f"row groups). Fix: lower --shards, or give .jsonl/.parquet (with more row groups)")
    total = sum(sizes) or 1
    groups: list[list[int]] = [[] for _ in range(n)]
    last, before = -1, 0
    for i, size in enumerate(sizes):
        g = int((before + size / 2) * n / total)  # the group the piece's middle falls in
        g = max(g, last, n - (len(sizes) - i))  # in order; the pieces left fill the groups left
        last = min(g, last + 1, n - 1)  # no group skipped
        groups[last].append(i)
        before += size
    return groups


def pieces(prints: list[dict[str, Any]], n_shards: int) -> list[dict[str, Any]]:
    """The inputs as pieces to group: a file larger than 1/n_shards of all the bytes (or, with
    more shards than files, every file) is cut into byte or row-group ranges where its type allows
    (`sources.split_points`); each piece is the file's fingerprint plus `range` when cut."""
    total = sum(f["size"] for f in prints) or 1
    out: list[dict[str, Any]] = []
    for f in prints:
        k = -(-f["size"] * n_shards // total) if n_shards > 1 else 1
        ranges = sources.split_points(Path(f["path"]), k)
        if ranges is None:
            out.append(f)
            continue
        span = [b - a for a, b in ranges]
        for (a, b), w in zip(ranges, span):  # parquet: bytes by the ranges' share of row groups
            size = f["size"] * w // max(1, sum(span)) if sources.kind(Path(f["path"])) == ".parquet" else b - a
            out.append({**f, "range": [a, b], "piece_size": size})
    return out


def input_files(shard: dict[str, Any]) -> list[dict[str, Any]]:
    """A shard's inputs as file fingerprints (path, size, mtime), each file once."""
    seen: dict[str, dict[str, Any]] = {}
    for f in shard["inputs"]:
        seen.setdefault(f["path"], {k: f[k] for k in ("path", "size", "mtime")})
    return list(seen.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    field: str = "text"
    txt_docs: TxtDocs = "blank"
    seq_len: int = 0
    instruct: dict[str, Any] | None = None
    """instruction data (dslurm/data/instruct.py): {"template": text or None, "specials": {...}}"""


def make_plan(inputs: list[Path], tok: hf.TokenizerInfo, n_shards: int, opts: Options) -> dict[str, Any]:
    """The frozen description of a tokenization (JSON-able). Pure but for the inputs' stat."""
    prints = [fingerprint(p) for p in inputs]
    if not opts.instruct:  # an example is packed whole into one shard's windows: whole files only
        prints = pieces(prints, n_shards)
    shards = []
    for i, grp in enumerate(group_files([f.get("piece_size", f["size"]) for f in prints], n_shards)):
        ins = [{k: v for k, v in prints[j].items() if k != "piece_size"} for j in grp]
        key_src = json.dumps([tok.hash, tok.add_bos, tok.add_eos, opts.field, opts.txt_docs,
                              opts.seq_len, ins, *([opts.instruct] if opts.instruct else [])], sort_keys=True)
        shards.append({"path": f"shard-{i:05d}.h5", "inputs": ins,
                       "key": hashlib.sha256(key_src.encode()).hexdigest()[:32]})
    return {"format": PLAN_FORMAT, "version": 1, "tokenizer": tok.to_json(),
            "field": opts.field, "txt_docs": opts.txt_docs, "seq_len": opts.seq_len,
            "shards": shards, **({"instruct": opts.instruct} if opts.instruct else {})}


def write_plan(out: Path, plan: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / PLAN, json.dumps(plan, indent=1, sort_keys=True) + "\n")


def read_plan(out: Path) -> dict[str, Any]:
    try:
        plan: dict[str, Any] = json.loads((out / PLAN).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{out / PLAN}: unreadable ({exc}). Fix: re-run `dslurm data tokenize` "
                        f"with --out {out}") from exc
    return plan


def shard_done(out: Path, shard: dict[str, Any]) -> bool:
    """The shard file exists (so it is complete: it was renamed into place) with the plan's key."""
    import h5py

    path = out / shard["path"]
    if not path.is_file():
        return False
    try:
        with h5py.File(path, "r") as f:
            return bool(str(f.attrs.get("plan_key", "")) == shard["key"])
    except OSError:
        return False


def missing(out: Path, plan: dict[str, Any]) -> list[int]:
    return [i for i, s in enumerate(plan["shards"]) if not shard_done(out, s)]


def remove_temps(out: Path, plan: dict[str, Any], tasks: list[int]) -> None:
    """Temp files a killed task left behind for the shards about to be redone."""
    for i in tasks:
        for tmp in out.glob(f".{plan['shards'][i]['path']}.*.tmp"):
            tmp.unlink(missing_ok=True)


def _kill_knob(task: int) -> bool:
    from dslurm import faults

    return faults.tokenize_kill_task() == task


def encode_threads() -> int:
    """Encode threads of this task: its Slurm CPUs (`--cpus-per-task`), else 1. The array script
    exports RAYON_NUM_THREADS (the `tokenizers` pool) to the same number."""
    return max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", "1") or 1))


def _ahead(it: Iterator[list[str]], depth: int = 2) -> Iterator[list[str]]:
    """`it` run in a thread `depth` batches ahead: reading and parsing (Python, under the GIL)
    overlap the encoding (Rust, which releases it) when the task has more than one CPU."""
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)

    def run() -> None:
        try:
            for item in it:
                q.put((True, item))
            q.put((False, None))
        except BaseException as exc:  # raised again in the consumer
            q.put((False, exc))

    threading.Thread(target=run, daemon=True, name="dslurm-tokenize-read").start()
    while True:
        ok, item = q.get()
        if not ok:
            if item is not None:
                raise item
            return
        yield item


def _chunks(tok: Any, info: hf.TokenizerInfo, plan: dict[str, Any], task: int,
            report: Reporter) -> Iterator[np.ndarray]:
    ins = plan["shards"][task]["inputs"]
    paths = [Path(f["path"]) for f in ins]
    ranges: list[sources.Range | None] = [(f["range"][0], f["range"][1]) if "range" in f else None for f in ins]
    kill = _kill_knob(task)
    docs = sources.batches(paths, field=plan["field"], txt_docs=plan["txt_docs"], ranges=ranges)
    for batch in (_ahead(docs) if encode_threads() > 1 else docs):
        ids = hf.encode_batch(tok, info, batch)
        report.add(int(ids.size), len(batch), sum(map(len, batch)))
        yield ids
        if kill:  # the first chunk is in the temp file: die mid-shard (DSLURM_FAULT_TOKENIZE_KILL)
            log.warning("DSLURM_FAULT_TOKENIZE_KILL: task %d kills itself mid-shard", task)
            os.kill(os.getpid(), signal.SIGKILL)


def _instruct_chunks(tok: Any, info: hf.TokenizerInfo, plan: dict[str, Any], task: int,
                     report: Reporter) -> Iterator[Any]:
    from dslurm.data import instruct

    spec = plan["instruct"]
    render = instruct.renderer(spec["template"], spec["specials"], "chat template") if spec["template"] else None
    enc = instruct.Encoder(tok, info.bos_id, info.eos_id, render)
    packer = instruct.Packer(seq_len=plan["seq_len"], pad_id=info.eos_id if info.eos_id is not None else 0)
    paths = [Path(f["path"]) for f in plan["shards"][task]["inputs"]]
    for chunk in instruct.packed_chunks(paths, enc, packer, last=task == len(plan["shards"]) - 1):
        report.add(int(len(chunk["tokens"])), 0, 0)
        yield chunk


def run_task(out: Path, task: int) -> Path:
    """Tokenize group `task` of the plan in `out` into its shard; then the manifest if complete."""
    from dslurm.data.tokenize import _write_atomic

    plan = read_plan(out)
    if not 0 <= task < len(plan["shards"]):
        raise UserError(f"task {task}: the plan in {out} has {len(plan['shards'])} shards")
    shard = plan["shards"][task]
    want = plan["tokenizer"]
    tok, info = hf.load(want["path"], warn=False)  # the plan's BOS/EOS are used; tokenize warned when planning
    if info.hash != want["hash"]:
        raise UserError(f"{want['path']}: changed since the plan was made (sha256 {info.hash[:12]} "
                        f"!= {want['hash'][:12]}). Fix: re-run `dslurm data tokenize`")
    info = hf.TokenizerInfo(**want)
    for f in input_files(shard):
        if fingerprint(Path(f["path"])) != f:
            raise UserError(f"{f['path']}: changed since the plan was made (size/mtime). Fix: "
                            f"re-run `dslurm data tokenize`; it re-plans and redoes this shard")
    attrs = {"tokenizer_hash": info.hash, "bos_id": -1 if info.bos_id is None else info.bos_id,
             "eos_id": -1 if info.eos_id is None else info.eos_id, "plan_key": shard["key"],
             "inputs": json.dumps(shard["inputs"])}
    report = Reporter(out, task, shard)
    report.write("running")
    chunks: Iterator[Any] = _chunks(tok, info, plan, task, report)
    if plan.get("instruct"):  # prompt/completion or messages, packed for seq_len, with a loss mask
        chunks, attrs = _instruct_chunks(tok, info, plan, task, report), {**attrs, "packed_seq_len": plan["seq_len"]}
    path = _write_atomic(out / shard["path"], chunks,
                         vocab_size=info.vocab_size, seq_len=plan["seq_len"],
                         source=f"tokenizer {info.hash[:12]} over {len(shard['inputs'])} files",
                         attrs=attrs)
    report.write("done")
    finish(out, plan)
    return path


def finish(out: Path, plan: dict[str, Any]) -> Path | None:
    """Write the manifest when every shard is done; None (nothing written) otherwise."""
    from dslurm.data.tokenize import dtype_for, read_info

    if missing(out, plan):
        return None
    tok = plan["tokenizer"]
    shards = [{"path": s["path"], "n_tokens": read_info(out / s["path"]).n_tokens,
               "inputs": s["inputs"]} for s in plan["shards"]]
    if not any(s["n_tokens"] for s in shards):  # no manifest: an empty corpus is not a dataset
        raise UserError(f"{out}: the inputs hold no documents (0 tokens in {len(shards)} shard(s)), so no "
                        f"manifest was written. Fix: check the inputs are not empty and that --field "
                        f"{plan['field']!r} names the text of each line")
    raw = {"format": manifest.FORMAT, "version": manifest.VERSION, "vocab_size": tok["vocab_size"],
           "dtype": str(dtype_for(tok["vocab_size"])), "n_tokens": sum(s["n_tokens"] for s in shards),
           "tokenizer": {k: tok[k] for k in ("hash", "vocab_size", "bos_id", "eos_id", "path")},
           "shards": shards, "inputs": input_files({"inputs": [f for s in plan["shards"] for f in s["inputs"]]}),
           "field": plan["field"], "txt_docs": plan["txt_docs"]}
    return manifest.write_manifest(out, raw)


def run_local(out: Path, tasks: list[int]) -> None:
    """The tasks one after another in this process (no Slurm)."""
    for t in tasks:
        log.info("shard %d", t)
        run_task(out, t)

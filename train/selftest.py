"""`python -m train.selftest`: the in-job half of `dslurm selftest --gpu` (dslurm/selftest/cli.py
starts it, bounds it in time and prints its report). One process, a world of one.

It lives here, not in dslurm/, because it drives the trainer and the toolkit never imports
`train`. The parts run in the order of dslurm.selftest.report.PARTS; each is timed, and one
that raises leaves its error in the report while the others still run. The trainer parts build
the real `Trainer` (meta-device init on GPU, FSDP2 on a shard group of one, selective activation
checkpointing, torch.compile off then on, bf16 on GPU) on a Llama sized from the device's memory
(dslurm.selftest.sizing) and measure with the trainer's own metrics (train/metrics.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dslurm.config import SiteConfig, load_job, load_site
from dslurm.config.models import shape_from
from dslurm.config.resolve import resolve
from dslurm.errors import UserError
from dslurm.preflight.thresholds import Thresholds
from dslurm.selftest import parts, sizing
from dslurm.selftest.report import Report, new_report

if TYPE_CHECKING:
    from train.loop import Trainer  # imported where it is built: the self-check starts light

# Llama 3 8B's block with Llama 2's 32k vocabulary: a 128k vocabulary would put most of a
# checkpoint-sized model into the embedding and the output layer, not into the blocks.
GPU_BASE = ("8b", {"vocab_size": 32000, "seq_len": 4096})
DRY_BASE: tuple[str, dict[str, int]] = ("tiny", {})
DRY_MEMORY = 256e6
"""The pretend device memory the dry run sizes its tiny model for (the same code as on GPU)."""
MAX_OOM_RETRIES = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m train.selftest",
                                description=__doc__.splitlines()[0])
    p.add_argument("--site", required=True)
    p.add_argument("--out", required=True, type=Path, help="JSON report, rewritten after every part")
    p.add_argument("--dir", required=True, type=Path, help="work directory: trainer run dirs, checkpoints")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--steps", type=int, required=True, help="measured trainer steps")
    p.add_argument("--warmup", type=int, required=True, help="trainer steps before measuring (compile)")
    p.add_argument("--budget-s", type=float, required=True, help="no part starts after this")
    p.add_argument("--ckpt-gb", type=float, required=True, help="cap on one checkpoint's size")
    return p.parse_args(argv)


def job_data(base: tuple[str, dict[str, int]], sz: sizing.Sizing, *, dtype: str, compile: bool,
             run_dir: Path) -> dict[str, Any]:
    """The job the trainer parts run: one process, the sized model, no burn-in, no requeue."""
    seq = sz.shape.seq_len
    return {"name": "selftest", "nodes": 1, "procs_per_node": 1,
            "model": {"preset": base[0], **base[1], "n_layers": sz.shape.n_layers},
            "train": {"steps": 1_000_000, "global_batch": sz.micro_batch, "lr": 3e-4, "warmup_steps": 2,
                      "dtype": dtype, "activation_checkpoint": "selective", "compile": compile,
                      "log_every": 1_000_000, "straggler_every": 1_000_000},
            "data": {"synthetic_tokens": 2 * sz.micro_batch * (seq + 1)},
            "checkpoint": {"run_dir": str(run_dir)}, "preflight": {"enabled": False},
            "requeue": {"enabled": False}, "health": {"watchdog": False}}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_trainer(site_path: str, base: tuple[str, dict[str, int]], sz: sizing.Sizing, device: torch.device, *,
                    compile: bool, steps: int, warmup: int, work: Path) -> tuple[dict[str, Any], Trainer]:
    """Build the trainer, run `warmup` steps (compile happens in the first), then `steps` measured
    ones; returns (numbers, the trainer) -- its state is what the checkpoint part saves."""
    from train.loop import Trainer
    from train.parallel.build import meta_init

    dtype = "bf16" if device.type == "cuda" else "fp32"
    name = f"trainer-{'compiled' if compile else 'eager'}-mb{sz.micro_batch}"
    data = job_data(base, sz, dtype=dtype, compile=compile, run_dir=work / name)
    r = resolve(load_site(site_path), load_job(data=data), site_path=site_path, job_path="selftest job")
    assert r.shape == sz.shape, (r.shape, sz.shape)  # the sized shape is the one the trainer builds
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    trainer = Trainer(r, device=device, rank=0, world_size=1, fsdp=True, checkpoint=False)
    build_s = time.perf_counter() - t
    losses = []
    t = time.perf_counter()
    for i in range(warmup):
        losses.append(trainer.train_step().loss)
        if i == 0:
            first_step_s = time.perf_counter() - t
    warmup_s = time.perf_counter() - t
    trainer.metrics.summary()  # drop the warm-up window
    trainer.metrics.start()
    for _ in range(steps):
        res = trainer.train_step()
        trainer.metrics.end_step(res.step, res.loss)
        losses.append(res.loss)
    win = trainer.metrics.summary()
    assert win is not None  # steps >= 1
    mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {"dtype": dtype, "compile": compile, "activation_checkpoint": "selective", "meta_init": meta_init(device),
           "fsdp": "fully_shard on a shard group of one", "shape": dataclasses.asdict(sz.shape),
           "params": sz.shape.num_params(), "micro_batch": sz.micro_batch,
           "tokens_per_step": r.job.train.global_batch * sz.shape.seq_len,
           "flops_per_token": trainer.metrics.flops_per_token, "peak_flops": trainer.metrics.peak.flops_per_device,
           "build_s": build_s, "first_step_s": first_step_s if warmup else None, "warmup_s": warmup_s,
           "warmup_steps": warmup, "steps": steps, "step_time_s": win.step_time_s,
           "tokens_per_s": win.tokens_per_s,
           "achieved_tflops": win.tokens_per_s * trainer.metrics.flops_per_token / 1e12,
           "mfu": win.mfu, "mfu_label": win.mfu_label, "breakdown": win.breakdown, "losses": losses,
           "memory_bytes": mem, "peak_memory_bytes": peak,
           "peak_memory_fraction": peak / mem if mem and peak is not None else None}
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss in the self-check's trainer: {losses}")
    return out, trainer


def trainer_part(site_path: str, base: tuple[str, dict[str, int]], sz: sizing.Sizing, device: torch.device,
                 *, keep: bool = False, **kw: Any) -> tuple[dict[str, Any], Trainer | None]:
    """`measure_trainer`, halving the micro-batch after an out-of-memory error (the sizing is an
    estimate); each retry is recorded. The trainer is freed unless `keep`."""
    ooms: list[dict[str, Any]] = []
    while True:
        error = None
        try:
            out, trainer = measure_trainer(site_path, base, sz, device, **kw)
        except torch.cuda.OutOfMemoryError as exc:  # the same class as torch.OutOfMemoryError
            if len(ooms) >= MAX_OOM_RETRIES or sz.micro_batch == 1:
                raise
            error = str(exc).splitlines()[0][:300]
        if error is None:
            break
        ooms.append({"micro_batch": sz.micro_batch, "error": error})
        _free(device)  # the failed trainer is garbage once the exception is gone
        sz = dataclasses.replace(sz, micro_batch=max(1, sz.micro_batch // 2))
    out.update(sizing=sz.to_dict(), oom_retries=ooms)
    if keep:
        return out, trainer
    del trainer
    _free(device)
    return out, None


def _probe(trainer: Trainer) -> torch.Tensor:
    """The smallest parameter's local tensor (a norm weight), fetched anew on each call: changed
    before the restore, compared after."""
    p = min(trainer.params, key=lambda q: q.numel())
    local: torch.Tensor = p.to_local() if hasattr(p, "to_local") else p.data
    return local


def start(args: argparse.Namespace) -> tuple[SiteConfig, torch.device, Report]:
    """Site, process group (a world of one) and the empty report; a UserError if either is wrong."""
    from dslurm.health.process_group import init_process_group

    site, dry = load_site(args.site), args.dry_run
    device = init_process_group("gloo" if dry else site.network.backend, require_cuda=not dry, cpu_only=dry,
                                where=f"{args.site}: site {site.name!r}")
    notes = [] if not dry else [
        "dry run on CPU: gloo, fp32 (bf16 training needs a GPU, dslurm/config/resolve.py), the tiny preset "
        f"sized for a pretend {DRY_MEMORY / 1e6:.0f} MB device, fp32 GEMM 512; meta-device init is GPU-only "
        "(train/parallel/build.py builds real weights on CPU so every layout starts bit-identical); "
        "torch.compile with the aot_eager backend (dynamo + AOTAutograd, no inductor code generation: "
        "minutes of C++ compiling on 2 shared cores). No number here is a GPU number."]
    data = new_report(mode="dry-run" if dry else "gpu", chip=parts.chip_name(device), device=str(device),
                      site={"name": site.name, "path": args.site, "gpu_model": site.node.gpu_model,
                            "peak_tflops_bf16": site.node.peak_tflops_bf16},
                      notes=notes, env=parts.env_info(device))
    return site, device, Report(data, args.out, args.budget_s)


def run_parts(args: argparse.Namespace, site: SiteConfig, device: torch.device, report: Report) -> None:
    from dslurm.runtime.state import train_state

    dry = args.dry_run
    # One GPU is checked, whatever the node holds: the GPU count is the burn-in's question.
    th = dataclasses.replace(Thresholds.from_site(site), expected_gpus_per_node=None)
    report.run("nvml", lambda: parts.nvml_part(th))
    report.run("gemm", lambda: parts.gemm_part(device, th))
    base = DRY_BASE if dry else GPU_BASE
    mem = DRY_MEMORY if dry else torch.cuda.get_device_properties(device).total_memory
    sz = _size(mem, shape_from(base[0], **base[1]), dry,
               min(args.ckpt_gb * 1e9, 0.3 * shutil.disk_usage(args.dir).free))
    report.data["sizing"] = sz.to_dict() if isinstance(sz, sizing.Sizing) else {"error": sz}
    kw = {"steps": args.steps, "warmup": args.warmup, "work": args.dir}
    held: list[Trainer] = []

    def eager() -> dict[str, Any]:
        out, trainer = trainer_part(args.site, base, _sized(sz), device, compile=False, keep=True, **kw)
        assert trainer is not None  # keep=True
        held.append(trainer)
        return out

    eager_out = report.run("trainer_eager", eager)
    if held:
        trainer = held.pop()
        state = train_state(trainer.built.parts, trainer.optimizers)
        report.run("checkpoint", lambda: parts.checkpoint_part(state, lambda: _probe(trainer), args.dir / "ckpt"))
        del trainer, state
        _free(device)
    else:
        report.run("checkpoint", _needs_trainer)
    if eager_out and isinstance(sz, sizing.Sizing):  # after an out-of-memory retry, start where eager ended
        sz = dataclasses.replace(sz, micro_batch=eager_out["micro_batch"])
    report.run("trainer_compiled", lambda: trainer_part(args.site, base, _sized(sz), device, compile=True, **kw)[0])


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if args.dry_run:
        _cheap_compile()
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        site, device, report = start(args)
    except UserError as exc:  # a wrong site or no GPU: a clear line, and a report that says it
        print(f"dslurm selftest: error: {exc}", file=sys.stderr)
        data = new_report(mode="dry-run" if args.dry_run else "gpu", chip="unknown", device="", site={},
                          notes=[], env={})
        data["error"] = str(exc)
        Report(data, args.out, 0.0).save()
        return exc.exit_code
    try:
        run_parts(args, site, device, report)
    finally:
        report.save()
        dist.destroy_process_group()
    return 0


def _size(mem: float, base: Any, dry: bool, max_saved: float) -> sizing.Sizing | str:
    """The sized model, or why none fits (then both trainer parts fail with that reason). A
    checkpoint may take at most 30% of the free disk: the async part keeps two generations."""
    try:
        return sizing.size_model(mem, base=base, bytes_per_value=4.0 if dry else 2.0,
                                 layout=sizing.FP32 if dry else sizing.BF16_WORLD_OF_ONE,
                                 max_saved_bytes=max_saved, max_micro_batch=4 if dry else 256)
    except UserError as exc:
        return str(exc)


def _sized(sz: sizing.Sizing | str) -> sizing.Sizing:
    if isinstance(sz, str):
        raise RuntimeError(f"no model fits: {sz}")
    return sz


def _cheap_compile() -> None:
    """Dry run: compile through dynamo and AOTAutograd (the graph capture, the SAC and FSDP hooks,
    fullgraph) but without inductor's code generation, which takes minutes of C++ compiling on
    2 shared cores. Only this process, only the dry run."""
    import functools

    orig = torch.nn.Module.compile

    @functools.wraps(orig)
    def compile_(self: torch.nn.Module, *a: Any, **kw: Any) -> None:
        kw.setdefault("backend", "aot_eager")
        orig(self, *a, **kw)

    torch.nn.Module.compile = compile_  # type: ignore[method-assign]


def _needs_trainer() -> dict[str, Any]:
    raise RuntimeError("not run: it saves the eager trainer's state, and that part failed")


if __name__ == "__main__":
    sys.exit(main())

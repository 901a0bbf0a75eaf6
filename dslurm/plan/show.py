"""What `dslurm plan` prints for a person (rich); the numbers come computed from `cli._details`.

Every number names the schedule or formula it assumes, so a reader can tell a 1F1B bubble
from an interleaved one and model FLOPs from executed FLOPs.
"""

from __future__ import annotations

from typing import Any

from dslurm.config.layout import stages_per_rank
from dslurm.observe.table import print_table

GB = 1e9


def print_plan(out: dict[str, Any], primary: str) -> None:
    """The model line, one table per layout, then the collectives and the MFU conversion of `primary`."""
    from dslurm.observe.table import console as wide_console

    console = wide_console()
    m, c = out["model"], out["cluster"]
    console.print(f"model {m['params'] / 1e9:.2f}B params, {m['layers']} layers, seq {m['seq_len']}; "
                  f"{out['model_flops_per_token'] / 1e9:.1f} GFLOP/token (6N + 12LHQT)")
    if c.get("memory_note"):
        console.print(f"memory per process: {c['memory_note']}")
    for key, title in (("job_layout", "job's layout"), ("proposal", "proposed layout")):
        if key in out:
            _layout_table(console, out[key], title)
    plan = out[primary]
    name = "the job's layout" if primary == "job_layout" else "the proposed layout"
    _pipeline_lines(console, plan, name)
    _collectives(console, plan, name)
    _mfu(console, plan, name)


def _layout_table(console: Any, plan: dict[str, Any], title: str) -> None:
    from rich.table import Table

    table = Table(title=f"{title}: {'fits' if plan['fits'] else 'DOES NOT FIT'}")
    for col in ("item", "value", "why"):
        table.add_column(col)
    lay = plan["layout"]
    for name in ("tp", "pp", "dp_shard", "dp_replicate", "cp", "recompute", "microbatches", "grad_accum"):
        reason = plan["reasons"].get({"dp_shard": "dp", "dp_replicate": "dp"}.get(name, name), "")
        table.add_row(name, str(lay[name]), reason if name != "dp_replicate" else "")
    if lay["pp"] > 1:
        table.add_row("schedule", lay["schedule"], f"v={stages_per_rank(lay['schedule'])} stage(s) per rank")
    for name, gb in plan["memory_gb"].items():
        table.add_row(f"memory {name}", f"{gb:.1f} GB", f"usable {plan['budget_gb']:.1f} GB" if name == "total" else "")
    table.add_row("bubble", f"{plan['bubble']:.1%}", f"of the step, {lay['schedule']}: (p-1)/(v*m+p-1)"
                  if lay["pp"] > 1 else "no pipeline")
    print_table(console, table)
    for line in plan["problems"]:
        console.print(f"[red]problem:[/red] {line}")
    for line in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {line}")


def _pipeline_lines(console: Any, plan: dict[str, Any], name: str) -> None:
    lay = plan["layout"]
    if lay["pp"] == 1:
        return
    p, m, sched = lay["pp"], lay["microbatches"], lay["schedule"]
    v = stages_per_rank(sched)
    console.print(f"pipeline of {name}: {sched}, p={p} stages, v={v} virtual stage(s) per rank, m={m} microbatches")
    console.print(f"  bubble {plan['bubble']:.1%} of the step = (p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1}; "
                  f"{plan['bubble_overhead']:.1%} of compute = (p-1)/(v*m) = {p - 1}/{v * m} "
                  "(Narayanan et al. 2021; GPipe and 1F1B: v=1)")
    if v > 1:
        rule = f"interleaved: min(p + (p-1)/v, m), Korthikanti et al. 2022; 1F1B would hold min(p, m) = {min(p, m)}"
    else:
        rule = "GPipe: m" if sched == "GPipe" else "1F1B: min(p, m)"
    held = plan["first_stage_in_flight"]
    console.print(f"  first stage holds {held:g} microbatches of L/p layers in flight ({rule})")


def _fmt_time(t: float | None) -> str:
    return "?" if t is None else f"{t * 1e3:,.0f} ms" if t < 1 else f"{t:,.2f} s"


_OPS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "send_recv": "p2p"}


def _collectives(console: Any, plan: dict[str, Any], name: str) -> None:
    from rich.table import Table

    rows = plan["collectives"]
    if not rows:
        console.print(f"collectives of {name}: none (one GPU per group on every dimension)")
        return
    table = Table(title=f"collectives per optimizer step, one GPU, {name}")
    for col in ("dim", "op", "tensor", "n", "calls", "size", "sent", "link", "busbw", "time"):
        table.add_column(col, no_wrap=col != "tensor")
    for r in rows:
        table.add_row(r["dim"], _OPS[r["op"]], r["what"], str(r["ranks"]), f"{r['calls']:,}",
                      f"{r['size_bytes'] / GB:.3g}G", f"{r['sent_bytes'] / GB:,.1f}G", r["link"],
                      f"{r['busbw_gbytes_per_s']:g}" if r["busbw_gbytes_per_s"] else "?", _fmt_time(r["time_s"]))
    print_table(console, table)
    console.print("  size = one call's buffer; sent = calls x size x bus factor, what one GPU sends; busbw in GB/s as "
                  "nccl-tests (AR: algbw x 2(n-1)/n, AG/RS: x (n-1)/n, p2p: x 1); time = sent / busbw, "
                  "bandwidth-bound, no latency, no overlap with compute; net k/g = k of a node's g GPUs' "
                  "share of its inter-node bandwidth")
    totals = "; ".join(f"{dim} {v['sent_bytes'] / GB:,.1f} GB in {_fmt_time(v['time_s'])}"
                       for dim, v in plan["collectives_by_dim"].items())
    console.print(f"  per dimension: {totals}")


def _mfu(console: Any, plan: dict[str, Any], name: str) -> None:
    if "mfu" not in plan:
        console.print("MFU: no peak TFLOP/s given (pass --peak-tflops, or set node.peak_tflops_bf16 in the site)")
        return
    f = plan["mfu"]
    model, executed = f["model_flops_per_token"], f["executed_flops_per_token"]
    extra = {"full": "full recomputation re-runs the forward: +2N + 4LHQT",
             "selective": "selective (op-level) recomputation re-runs no matmul: +0",
             "none": "no recomputation"}[f["recompute"]]
    console.print(f"MFU of {name}: model {model / 1e9:.1f} GFLOP/token (6N + 12LHQT, PaLM app. B, no "
                  f"recomputation); executed {executed / 1e9:.1f} GFLOP/token ({extra}); "
                  f"peak {f['peak_flops'] / 1e15:,.1f} PFLOP/s")
    console.print(f"  1,000 tokens/s = {f['mfu_per_1000_tokens_per_s']:.3%} MFU; MFU = tokens/s x "
                  f"{model / 1e9:.1f} GFLOP / peak, HFU = tokens/s x {executed / 1e9:.1f} GFLOP / peak")
    for row in f["at"]:
        console.print(f"  {row['mfu']:.0%} MFU = {row['tokens_per_s']:,.0f} tokens/s = {row['step_s']:,.1f} s "
                      f"per step (HFU {row['mfu'] * executed / model:.0%})")
    console.print(f"  ceiling at peak arithmetic: (1 - bubble {plan['bubble']:.1%}) x {model / 1e9:.1f}/"
                  f"{executed / 1e9:.1f} = {f['mfu_ceiling']:.1%} MFU")
    if "measured" in f:
        meas = f["measured"]
        console.print(f"  measured {meas['tokens_per_s']:,.0f} tokens/s = {meas['mfu']:.1%} MFU, {meas['hfu']:.1%} HFU")

"""Tables never cut a value (dslurm/observe/table.py, issue 40): piped, `dslurm plan simulate --gpus 16384`
printed `reque…` and `81.0…` at 80 columns. Every name and number of the --json form must appear
whole in the text form, piped or in a terminal narrower than the table. Pure (rich, no Slurm)."""

from __future__ import annotations

import io
import json

from dslurm.cli import main
from dslurm.observe.table import console, print_table, render
from dslurm.site.check import as_json, fail, ok, skip, table


def _wide_table():
    from rich.table import Table

    t = Table(title="wide")
    for col in ("mechanism", "goodput", "p5-p95", "why"):
        t.add_column(col)
    t.add_row("two_tier_async_with_spares", "81.0123%", "80.1%-82.0%", "a long explanation " * 6)
    t.add_row("requeue", "12345678.9", "0.1%-0.2%", "short")
    return t


def test_plan_simulate_piped_shows_every_name_and_value_whole(capsys):
    args = ["plan", "simulate", "--gpus", "16384", "--trials", "10"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(args) == 0  # capsys: stdout is not a terminal, like `| cat`
    text = capsys.readouterr().out
    assert "…" not in text
    for r in out["results"]:
        row = next(line for line in text.splitlines()
                   if line.split("│")[1:2] and line.split("│")[1].strip() == r["mechanism"]
                   and r["save"] in line)
        for cell in (r["mechanism"], f"{r['goodput_mean']:.1%}", f"{r['goodput_p05']:.1%}-{r['goodput_p95']:.1%}",
                     f"{r['best_interval_s'] / 60:.1f} min", f"{r['requeues_per_run']:.1f}"):
            assert cell in row, (cell, row)
    for name, v in out["inputs"].items():
        assert any(name in line and f"{v['value']:g}" in line for line in text.splitlines()), name


def test_a_table_wider_than_the_terminal_is_printed_whole_not_cut():
    buf = io.StringIO()
    narrow = console(file=buf, width=40, force_terminal=True, color_system=None)
    print_table(narrow, _wide_table())
    text = buf.getvalue()
    assert "…" not in text
    for cell in ("two_tier_async_with_spares", "81.0123%", "80.1%-82.0%", "12345678.9"):
        assert cell in text
    assert max(len(line) for line in text.splitlines()) > 40  # the terminal wraps it; rich cut nothing


def test_a_piped_console_is_wide_and_a_rendered_table_whole():
    c = console(file=io.StringIO())
    assert not c.is_terminal and c.width >= 10_000
    text = render(_wide_table())
    assert "…" not in text and "a long explanation " * 5 in text


def test_site_check_json_holds_every_row_and_the_verdict():
    rows = [ok("partition exists and is up", "batch: up"), skip("GPUs visible", "no GPU promised"),
            fail("slurm.conf allows requeue", "JobRequeue=0", "set JobRequeue=1")]
    d = json.loads(as_json(rows))
    assert d["holds"] is False
    assert [(r["promise"], r["status"], r["holds"], r["fix"]) for r in d["rows"]] == [
        ("partition exists and is up", "ok", True, ""), ("GPUs visible", "skip", True, ""),
        ("slurm.conf allows requeue", "fail", False, "set JobRequeue=1")]
    assert "fix: set JobRequeue=1" in table(rows)
    assert json.loads(as_json(rows[:2]))["holds"] is True

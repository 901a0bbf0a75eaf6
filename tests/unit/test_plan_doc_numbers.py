"""docs/plan.md's failure-simulation numbers are what its own `dslurm plan simulate` commands print.

The commands are read from the doc's code blocks (`$R` expanded, a `# F = 1, 0.5` placeholder run once
per value) and run in-process from the repository root; every table cell and the prose numbers under
the tables are compared with the JSON, rounded as the doc shows them. So the test fails when the doc or
the simulator changes alone: fix the doc to what the command prints, never the other way round.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dslurm.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "plan.md").read_text()
Out = dict[str, Any]


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]  # after `dslurm`
    comment: str  # what follows `#` on the command's last line
    binding: dict[str, str] = field(default_factory=dict)  # placeholder -> the value in argv


def section(title: str) -> str:
    """The text under the heading that starts with `title`, up to the next heading of any level."""
    m = re.search(rf"^#+ {re.escape(title)}[^\n]*\n(.*?)(?=^#+ |\Z)", DOC, re.M | re.S)
    assert m, f"docs/plan.md has no heading starting {title!r}"
    return m[1]


def commands(text: str) -> list[Command]:
    """Every `dslurm` command of the code blocks in `text`, as the shell would run it."""
    env: dict[str, str] = {}
    out = []
    for block in re.findall(r"^```\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("#")
            if m := re.fullmatch(r'\s*(\w+)="([^"]*)"\s*', code):
                env[m[1]] = m[2]
                continue
            if not code.startswith("dslurm "):
                continue
            words = shlex.split(re.sub(r"\$(\w+)", lambda v: env[v[1]], code))[1:]
            # --from-run paths are relative to the repository root, where the doc's commands run.
            words = [str(ROOT / w) if prev == "--from-run" else w for prev, w in zip(["", *words], words)]
            # `# F = 1, 0.5`: a placeholder word of the command, run once per value.
            if m := re.search(r"\b([A-Z]) = ([^\s,]+(?:, [^\s,]+)*)", comment):
                out += [Command(tuple(v if w == m[1] else w for w in words), comment.strip(), {m[1]: v})
                        for v in m[2].split(", ")]
            else:
                out.append(Command(tuple(words), comment.strip()))
    return out


def table(text: str, *first: str) -> list[dict[str, str]]:
    """The rows of the markdown table in `text` whose header starts with the columns `first`."""
    for block in re.findall(r"(?:^\|.*\n)+", text, re.M):
        lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()]
        if tuple(lines[0][:len(first)]) == first:
            return [dict(zip(lines[0], row)) for row in lines[2:]]
    raise AssertionError(f"no table with columns {first} in the section")


def numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)


def shown(value: float, claim: str) -> str:
    """`value` rounded to the decimals the doc's `claim` shows."""
    return f"{value:.{len(claim.partition('.')[2])}f}"


def check(text: str, *values: float) -> None:
    """The numbers in a doc cell are `values` as the doc rounds them; a cell may show fewer (a mean
    without its range), never none."""
    claims = numbers(text)
    assert 0 < len(claims) <= len(values), f"doc {text!r} vs simulator {values}"
    assert claims == [shown(v, c) for v, c in zip(values, claims)], f"doc {text!r} vs simulator {values}"


def result(out: Out, mechanism: str, save: str) -> Out:
    """The JSON result a table row claims: its mechanism and save mode in that command's output."""
    (r,) = [r for r in out["results"] if (r["mechanism"], r["save"]) == (mechanism, save)]
    return r


def goodput(r: Out) -> tuple[float, float, float]:
    """Mean (p5, p95) in percent, the order the doc's cells show them."""
    return 100 * r["goodput_mean"], 100 * r["goodput_p05"], 100 * r["goodput_p95"]


def minutes(seconds: float) -> float:
    return seconds / 60


def find(pattern: str, text: str) -> re.Match[str]:
    """`pattern` in `text`, a space matching any whitespace (the doc wraps its lines anywhere)."""
    m = re.search(pattern.replace(" ", r"\s+"), text, re.S)
    assert m, f"docs/plan.md no longer says {pattern!r}: the doc's sentence or this test's pattern changed"
    return m


def same_as_shown(a: Out, b: Out) -> bool:
    """Two results whose goodput cells read the same at the doc's one decimal ("= spare")."""
    return [f"{x:.1f}" for x in goodput(a)] == [f"{x:.1f}" for x in goodput(b)]


def points(a: Out, b: Out) -> str:
    """b - a in goodput points, signed as the doc writes it (+2.5, −0.2)."""
    d = 100 * (b["goodput_mean"] - a["goodput_mean"])
    return f"{'+' if d >= 0 else '−'}{abs(d):.1f}"


@pytest.fixture(scope="module")
def simulate() -> Callable[[Command], Out]:
    """Runs a command once per module (~2 s each) and shares its JSON between the tests."""
    done: dict[tuple[str, ...], Out] = {}

    def run(cmd: Command) -> Out:
        if cmd.argv not in done:
            buf = io.StringIO()
            with redirect_stdout(buf):
                assert main(list(cmd.argv)) == 0, cmd.argv
            done[cmd.argv] = json.loads(buf.getvalue())
        return done[cmd.argv]

    return run


# --- Goodput at 16,384 GPUs ------------------------------------------------------------------

SIXTEEN_K = section("Goodput at 16,384 GPUs")


def test_the_16k_sync_and_async_table(simulate):
    cmds = [c for c in commands(SIXTEEN_K) if "16384" in c.argv]
    rows = table(SIXTEEN_K, "Save")
    assert len(rows) == len(cmds) == 2  # row i is command i; the table predates mechanisms: requeue
    for row, cmd in zip(rows, cmds):
        save = row["Save"].split(",")[0]
        assert ("--async" in cmd.argv) == (save == "async"), (row["Save"], cmd.argv)
        out = simulate(cmd)
        r = result(out, "requeue", save)
        (at_young_daly,) = [i["mean"] for i in r["intervals"] if i["interval_s"] == r["young_daly_s"]]
        stalls = [out["inputs"][n]["value"] for n in (("save_s",) if save == "sync" else ("async_stall_s", "save_s"))]
        check(row["Save"], *stalls)  # "async, 10 s stall, durable 240 s later"
        check(row["Job MTBF"], r["job_mtbf_h"])
        check(row["Failures / 30 days"], r["failures_per_run"])
        check(row["Young/Daly"], minutes(r["young_daly_s"]))
        check(row["Best interval"], minutes(r["best_interval_s"]))
        check(row["Mean goodput at best (p5–p95)"], *goodput(r))
        check(row["At Young/Daly"], 100 * at_young_daly)


def test_the_16k_defaults_and_prose(simulate):
    sync_cmd, async_cmd = [c for c in commands(SIXTEEN_K) if "16384" in c.argv]
    out = simulate(sync_cmd)
    sync, async_ = result(out, "requeue", "sync"), result(simulate(async_cmd), "requeue", "async")
    defaults = find(r"\(defaults: `([^`]*)`\)", SIXTEEN_K)[1].split()
    for flag, value in zip(defaults[::2], defaults[1::2]):
        name = flag[2:].replace("-", "_")
        if name == "horizon_days":
            assert sync["horizon_h"] == 24 * float(value)
        else:
            assert out["inputs"][name] == {"value": float(value), "source": "default"}, flag
    check(find(r"Async saving wins (\d+) points", SIXTEEN_K)[1], 100 * (async_["goodput_mean"] - sync["goodput_mean"]))
    m = find(r"(\d+) failures × (\d+) min of restart and requeue is ([\d.]+)% of the month", SIXTEEN_K)
    check(f"{m[1]} {m[2]}", sync["failures_per_run"],
          minutes(out["inputs"]["restart_s"]["value"] + out["inputs"]["requeue_s"]["value"]))
    check(m[3], 100 * int(m[1]) * int(m[2]) / (60 * sync["horizon_h"]))  # the sentence's own arithmetic


def test_the_1000_gpu_line(simulate):
    (cmd,) = [c for c in commands(SIXTEEN_K) if "1000" in c.argv]
    r = result(simulate(cmd), "requeue", "sync")
    m = find(r"At 1,000 GPUs \(([\d.]+) h MTBF, (\d+) failures a month\) the same sync save gives ([\d.]+)% "
             r"at (\d+) min", SIXTEEN_K)
    check(" ".join(m.groups()), r["job_mtbf_h"], r["failures_per_run"], 100 * r["goodput_mean"],
          minutes(r["best_interval_s"]))


# --- Recovery mechanisms, save modes and spares (A, B, C) -------------------------------------

ABC = section("Recovery mechanisms, save modes and spares")
COLUMNS = {"A": "A: all assumed", "B": "B: measured recovery, assumed saves", "C": "C: all measured locally"}


@pytest.fixture(scope="module")
def abc_runs(simulate) -> dict[str, Out]:
    """The output of the A, B and C commands, by the letter their comment starts with."""
    runs = {c.comment.split(":")[0]: simulate(c) for c in commands(ABC)}
    assert set(runs) == set(COLUMNS)
    return runs


def test_the_abc_goodput_table(abc_runs):
    rows = table(ABC, "mechanism", "save")
    assert [r["mechanism"] for r in rows] == ["requeue"] * 3 + ["spare"] * 3 + ["shrink"]
    for row in rows[:-1]:  # shrink's "= spare": the next test
        for letter, column in COLUMNS.items():
            check(row[column], *goodput(result(abc_runs[letter], row["mechanism"], row["save"])))


def test_shrink_equals_spare_with_the_spares_the_doc_names(abc_runs):
    row = table(ABC, "mechanism", "save")[-1]
    for letter, column in COLUMNS.items():
        out = abc_runs[letter]
        assert row[column].startswith("= spare")
        for save in row["save"].split(" / "):
            assert same_as_shown(result(out, "shrink", save), result(out, "spare", save)), (letter, save)
    a = result(abc_runs["A"], "shrink", "sync")  # "(21 spares: 0.01 shrinks a month, ...)"
    check(row[COLUMNS["A"]], abc_runs["A"]["spares"]["used"], a["shrinks_per_run"])


def test_the_abc_prose_above_the_table(abc_runs):
    every = [r for out in abc_runs.values() for r in out["results"]]
    m = find(r"job MTBF ([\d.]+) h \((\d+)–(\d+) failures per 30 days\), node_loss_fraction ([\d.]+), "
             r"repair (\d+) h", ABC)
    assert {shown(r["job_mtbf_h"], m[1]) for r in every} == {m[1]}
    assert all(out["assumed"]["node_loss_fraction"] == float(m[4]) and out["assumed"]["repair_h"] == float(m[5])
               for out in abc_runs.values())
    check(f"{m[2]} {m[3]}", min(r["failures_per_run"] for r in every), max(r["failures_per_run"] for r in every))
    # "spares for 99%: **21** (A) / **22** (B, C) nodes (16.5–17.8 under repair at once ...)"
    m = find(r"spares for (\d+)%: (.*?) nodes \(([\d.]+)–([\d.]+) under repair at once", ABC)
    claimed = {letter: n for n, letters in re.findall(r"\*\*(\d+)\*\* \(([A-C, ]+)\)", m[2])
               for letter in letters.split(", ")}
    assert claimed == {k: str(out["spares"]["spares"]) for k, out in abc_runs.items()}
    assert {100 * out["spares"]["probability"] for out in abc_runs.values()} == {float(m[1])}
    in_repair = [out["spares"]["mean_most_in_repair"] for out in abc_runs.values()]
    check(f"{m[3]} {m[4]}", min(in_repair), max(in_repair))


def test_the_abc_best_intervals(abc_runs):
    m = find(r"Best intervals \(every mechanism\): sync ([\d.]+) min, async ([\d.]+) min .*?, two-tier ([\d.]+) min; "
             r"C: ([\d.]+)–([\d.]+) min", ABC)
    for letter in "AB":
        for save, claim in zip(("sync", "async", "two_tier"), m.groups()):
            got = [minutes(r["best_interval_s"]) for r in abc_runs[letter]["results"] if r["save"] == save]
            assert {shown(g, claim) for g in got} == {claim}, (letter, save)
    c = [minutes(r["best_interval_s"]) for r in abc_runs["C"]["results"]]
    check(f"{m[4]} {m[5]}", min(c), max(c))


def test_the_abc_conclusions(abc_runs):
    a, b, c = abc_runs["A"], abc_runs["B"], abc_runs["C"]
    m = find(r"as measured on the local cluster \(B\), async saves reach ([\d.]+)%", ABC)
    check(m[1], 100 * result(b, "requeue", "async")["goodput_mean"])
    assert find(r"\(A: ([+−][\d.]+) points for async", ABC)[1] == points(result(a, "requeue", "async"),
                                                                         result(a, "spare", "async"))
    assert find(r"\(B: ([+−][\d.]+) points\)", ABC)[1] == points(result(b, "requeue", "async"),
                                                                 result(b, "spare", "async"))
    floor = find(r"every combination is above (\d+)%", ABC)[1]
    assert min(r["goodput_mean"] for r in c["results"]) > int(floor) / 100


def test_the_measured_inputs_table(abc_runs, simulate):
    """The 'measured locally' column is what C (all measured) reads from the ledgers; the probed swap, D's."""
    d_swap = simulate(commands(D)[0])["inputs"]["swap_s"]
    rows = table(ABC, "input", "measured locally")
    assert len(rows) == 7
    for row in rows:
        names = [n.split()[0] for n in row["input"].split(" / ")]
        claims = re.findall(r"([\d.]+) s\b", row["measured locally"])
        extra = [d_swap] if names == ["swap_s"] else []
        for v, claim in zip([abc_runs["C"]["inputs"][n] for n in names] + extra, claims, strict=True):
            assert shown(v["value"], claim) == claim, (row["input"], v)
            assert "default" not in v["source"], (row["input"], v)


# --- After the probe and the overlapped staging (D) -------------------------------------------

D = section("After the probe and the overlapped staging")


@pytest.fixture(scope="module")
def d_runs(simulate) -> dict[str, Out]:
    """The output of the D command, by the node-loss share its `F` placeholder took."""
    return {c.binding["F"]: simulate(c) for c in commands(D)}


def test_the_d_table(d_runs):
    rows = table(D, "node-loss share")
    assert {r["node-loss share"] for r in rows} == set(d_runs) and len(rows) == 8
    for row in rows:
        r = result(d_runs[row["node-loss share"]], row["mechanism"], row["save"])
        assert row["spares"] == str(r["spares"])
        check(row["mean goodput (p5–p95)"], *goodput(r))
        check(row["best interval"], minutes(r["best_interval_s"]))


def test_the_d_prose(d_runs, abc_runs):
    find("Shrink equals spare", D)
    for out in d_runs.values():
        for save in ("async", "two_tier"):
            assert same_as_shown(result(out, "shrink", save), result(out, "spare", save))
    staged = [r["goodput_mean"] for out in d_runs.values() for r in out["results"] if r["save"] != "sync"]
    check(find(r"reach ≥ (\d+)% \(([\d.]+)%\) with any recovery mechanism", D)[2], 100 * min(staged))
    assert min(staged) >= int(find(r"reach ≥ (\d+)%", D)[1]) / 100
    check(find(r"\*\*Spares with two tiers reach ([\d.]+)%\*\* when half", D)[1],
          100 * result(d_runs["0.5"], "spare", "two_tier")["goodput_mean"])
    a = abc_runs["A"]
    assert find(r"\(table A: ([+−][\d.]+) points\)", D)[1] == points(result(a, "requeue", "async"),
                                                                     result(a, "spare", "async"))


# --- With warm restarts (E) -------------------------------------------------------------------

E = section("With warm restarts")


@pytest.fixture(scope="module")
def e_runs(simulate) -> dict[str, Out]:
    """The output of the E command (D's runs plus the warm ledgers), by its `F` placeholder."""
    return {c.binding["F"]: simulate(c) for c in commands(E)}


def test_e_is_d_with_the_warm_runs_appended():
    for d_cmd, e_cmd in zip(commands(D), commands(E), strict=True):
        words = list(e_cmd.argv)
        warm = [words[i + 1] for i, w in enumerate(words) if w == "--from-run" and "warm" in words[i + 1]]
        for run_dir in warm:
            i = words.index(run_dir)
            del words[i - 1:i + 1]
        assert len(warm) == 2 and words == list(d_cmd.argv) and e_cmd.binding == d_cmd.binding


def test_the_e_table(e_runs):
    rows = table(E, "node-loss share")
    assert {r["node-loss share"] for r in rows} == set(e_runs) and len(rows) == 8
    for row in rows:
        r = result(e_runs[row["node-loss share"]], row["mechanism"], row["save"])
        assert row["spares"] == str(r["spares"])
        check(row["mean goodput (p5–p95)"], *goodput(r))
        check(row["best interval"], minutes(r["best_interval_s"]))


def test_the_e_inputs_warm_in_the_allocation_cold_for_the_requeue(e_runs, d_runs):
    m = find(r"relaunch_s \*\*([\d.]+) s\*\* warm \(D: ([\d.]+) s cold\), swap_s \*\*([\d.]+) s\*\* warm "
             r"\(D: ([\d.]+) s cold\), restart_s ([\d.]+) s and requeue_s ([\d.]+) s cold as in D", E)
    for out, d in zip(e_runs.values(), d_runs.values()):
        e_in, d_in = out["inputs"], d["inputs"]
        check(" ".join(m.groups()), e_in["relaunch_s"]["value"], d_in["relaunch_s"]["value"],
              e_in["swap_s"]["value"], d_in["swap_s"]["value"], e_in["restart_s"]["value"], e_in["requeue_s"]["value"])
        assert ": median of 1 warm same-node recoveries" in e_in["relaunch_s"]["source"]
        assert ": median of 1 warm spare swaps" in e_in["swap_s"]["source"]
        assert "cold same-node" in d_in["relaunch_s"]["source"] and "cold spare swaps" in d_in["swap_s"]["source"]
        for name in ("restart_s", "requeue_s"):  # the requeue's costs: D's, cold
            assert e_in[name] == d_in[name], name
        assert "cold restarts" in e_in["restart_s"]["source"]


def test_the_e_prose(e_runs, d_runs):
    for out in e_runs.values():
        for save in ("async", "two_tier"):
            assert same_as_shown(result(out, "shrink", save), result(out, "spare", save))
    d, e = result(d_runs["1"], "spare", "async"), result(e_runs["1"], "spare", "async")
    assert find(r"Warm restarts add \*\*([+−][\d.]+) points\*\*", E)[1] == points(d, e)
    m = find(r"share 1: D ([\d.]+)%, E ([\d.]+)%", E)
    check(f"{m[1]} {m[2]}", 100 * d["goodput_mean"], 100 * e["goodput_mean"])
    m = find(r"(\d+) failures × ([\d.]+) s saved per node loss is ([\d.]+)% of the month", E)
    saved = d_runs["1"]["inputs"]["swap_s"]["value"] - e_runs["1"]["inputs"]["swap_s"]["value"]
    check(f"{m[1]} {m[2]}", e["failures_per_run"], saved)
    check(m[3], 100 * e["failures_per_run"] * saved / (3600 * e["horizon_h"]))


# --- Replica groups (F) --------------------------------------------------------------------------

F = section("Replica groups: train on through a loss")


@pytest.fixture(scope="module")
def f_runs(simulate) -> dict[str, Out]:
    """The output of the F commands, by the run's name in their comments (F1..F4)."""
    return {c.comment.split(":")[0]: simulate(c) for c in commands(F)}


def test_the_f_table(f_runs):
    rows = table(F, "run", "mechanism")
    assert {r["run"] for r in rows} == set(f_runs) == {"F1", "F2", "F3", "F4"} and len(rows) == 10
    for row in rows:
        r = result(f_runs[row["run"]], row["mechanism"], "async")
        assert row["spares"] == str(r["spares"])
        check(row["mean goodput (p5–p95)"], *goodput(r))
        check(row["best interval"], minutes(r["best_interval_s"]))


def test_the_f_prose(f_runs):
    f1, f3, f4 = (result(f_runs[k], "replica", "async") for k in ("F1", "F3", "F4"))
    m = find(r"at (\d+)–(\d+) failures a month \(one every ~([\d.]+) hours", F)
    fails = [r["failures_per_run"] for out in f_runs.values() for r in out["results"]]
    check(" ".join(m.groups()), min(fails), max(fails), f1["job_mtbf_h"])
    check(find(r"in all ([\d.]+) h of the whole job's training a month", F)[1], f1["lost_to_groups_out_h"])
    check(find(r"the batch node's loss \(([\d.]+) a month\)", F)[1], f1["requeues_per_run"])
    check(find(r"([\d.]+) h of the whole job's training lost a month", F)[1], f3["lost_to_groups_out_h"])
    inputs = f4["groups"], f_runs["F4"]["inputs"]
    m = find(r"quorum ([\d.]+) s, group restart ([\d.]+) s, heal ([\d.]+) s", F)
    check(" ".join(m.groups()), *(inputs[1][k]["value"] for k in ("quorum_s", "group_restart_s", "heal_s")))
    assert f1["groups"] == inputs[0] == 128 and "replicas-6083894" in inputs[1]["heal_s"]["source"]

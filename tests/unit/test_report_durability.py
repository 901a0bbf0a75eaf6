"""`dslurm report`'s two-tier lines (dslurm/observe/durability.py) from fixture ledgers whose every
number is worked out by hand in the comments."""

from __future__ import annotations

import argparse
import json

from dslurm.observe.durability import durability
from dslurm.observe.events import decode_all
from dslurm.observe.report import run, summarize
from dslurm.observe.starts import split_starts


def _rec(name: str, t: float, restart: int = 0, **fields) -> dict:
    return {"event": name, "t": t, "job_id": "77", "restart": restart, "host": "node1", **fields}


def two_tier_run() -> list[dict]:
    """One start training from t=100 to its exit at t=170, saving every 10 steps."""
    return [
        _rec("ckpt_fresh_start", 99.9), _rec("train_start", 100.0, step=0),
        _rec("ckpt_local_commit", 110.0, step=10, generation="g10", local_s=0.5),
        _rec("ckpt_save", 115.2, step=10, generation="g10", tier="two_tier", stall_s=0.01, total_s=5.5,
             local_commit_t=110.0, lag_s=5.0),  # durable at 115
        _rec("ckpt_local_commit", 130.0, step=20, generation="g20", local_s=0.5, lag_wait_s=2.5),
        _rec("ckpt_save", 138.5, step=20, generation="g20", tier="two_tier", stall_s=2.51, total_s=8.5,
             local_commit_t=130.0, lag_s=8.0),  # durable at 138
        _rec("ckpt_local_commit", 150.0, step=30, generation="g30", local_s=0.5),
        _rec("ckpt_durable_skipped", 150.1, step=30, generation="g30", reason="copier busy"),
        _rec("ckpt_save_skipped", 165.0, step=40, reason="lag"),
        _rec("ckpt_save_skipped", 166.0, step=41, reason="in_flight"),  # on_inflight, not the lag policy
        _rec("exit", 170.0, reason="completed", step=45, code=0),
    ]


def test_lag_rpo_and_policy_cost_from_a_two_tier_ledger():
    d = durability(split_starts(decode_all(two_tier_run())))
    assert d is not None
    assert (d.local_commits, d.durable_commits) == (3, 2)
    assert (d.lag_median_s, d.lag_max_s) == (6.5, 8.0)
    # process restart: restorable from each local commit, 110, 130, 150 (the durable copies of
    # the same generations add nothing): gaps from 100 to 170: 10, 20, 20, 20
    assert (d.rpo_restart_median_s, d.rpo_restart_max_s) == (20.0, 20.0)
    # node loss: durable at 115 and 138 only: gaps 15, 23, 32
    assert (d.rpo_node_loss_median_s, d.rpo_node_loss_max_s) == (23.0, 32.0)
    assert (d.lag_waits, d.lag_wait_s) == (1, 2.5)
    assert d.skipped_local == [40] and d.skipped_durable == [30]


def test_partner_copies_shorten_the_node_loss_rpo():
    """Partner commits at 111, 131 and 151 (the third generation was never copied to durable):
    a node loss restores each from then on."""
    partner = [_rec("ckpt_partner_commit", t, step=st, generation=f"g{st}", ok=True, bytes=10, partner_s=1.0)
               for t, st in ((111.0, 10), (131.0, 20), (151.0, 30))]
    failed = [_rec("ckpt_partner_commit", 160.0, step=35, generation="g35", ok=False, reason="peer gone")]
    d = durability(split_starts(decode_all(sorted(two_tier_run() + partner + failed, key=lambda r: r["t"]))))
    assert d is not None and d.partner_commits == 3
    # node loss: partner at 111, 131, 151, durable at 115, 138 (the failed copy at 160 is none):
    # gaps 11, 4, 16, 7, 13, 19 (without partner copies: 15, 23, 32)
    assert (d.rpo_node_loss_median_s, d.rpo_node_loss_max_s) == (12.0, 19.0)


def test_each_start_is_measured_from_its_own_train_start():
    """A second start resumed at t=300: the time between the starts (queue, start-up) is not
    training that a failure could lose, and a start that never trained adds nothing."""
    second = [_rec("job_start", 290.0, 1), _rec("ckpt_restore", 299.9, 1, step=20, tier="local"),
              _rec("train_start", 300.0, 1, step=20),
              _rec("ckpt_local_commit", 304.0, 1, step=30, generation="h30", local_s=0.5),
              _rec("ckpt_save", 306.0, 1, step=30, generation="h30", tier="two_tier", local_commit_t=304.0,
                   lag_s=2.0),
              _rec("exit", 307.0, 1, reason="completed", step=30, code=0)]
    never = [_rec("job_start", 400.0, 2), _rec("ckpt_restore_failed", 401.0, 2, reason="x")]
    d = durability(split_starts(decode_all(two_tier_run() + second + never)))
    assert d is not None and d.durable_commits == 3 and d.lag_max_s == 8.0
    # node loss gaps: 15, 23, 32 (first start), then 6 and 1 (second start: 300 -> 306 -> 307)
    assert (d.rpo_node_loss_median_s, d.rpo_node_loss_max_s) == (15.0, 32.0)


def test_durable_only_run_has_no_two_tier_section():
    recs = [_rec("train_start", 100.0, step=0),
            _rec("ckpt_save", 110.0, step=10, generation="g", stall_s=1.0, total_s=1.0),
            _rec("exit", 120.0, reason="completed", step=20, code=0)]
    assert durability(split_starts(decode_all(recs))) is None
    assert summarize(decode_all(recs)).durability is None


def test_report_prints_the_two_tier_lines_and_json(tmp_path, capsys):
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in two_tier_run()))
    assert run(argparse.Namespace(run_dir=tmp_path, json=False, png=None, no_png=True)) == 0
    out = capsys.readouterr().out
    assert "3 local commit(s), 2 durable; durable lag median 6.5s, max 8.0s" in out
    assert "process restart median 20.0s, max 20.0s; node loss median 23.0s, max 32.0s" in out
    assert ("lag policy cost (on_lag): waited 1x, 2.5s; skip_local 1 save(s) not taken; "
            "skip_durable 1 left local only") in out
    assert run(argparse.Namespace(run_dir=tmp_path, json=True, png=None, no_png=True)) == 0
    d = json.loads(capsys.readouterr().out)["durability"]
    assert d["rpo_node_loss_max_s"] == 32.0 and d["skipped_local"] == [40]


def test_a_durable_only_save_also_serves_a_process_restart():
    recs = two_tier_run()[:4] + [  # g10 two-tier; then a blocking durable-only save at t=160
        _rec("ckpt_save", 160.0, step=50, generation="g50", stall_s=1.0, total_s=1.0),
        _rec("exit", 170.0, reason="completed", step=50, code=0)]
    d = durability(split_starts(decode_all(recs)))
    assert d is not None
    assert (d.rpo_restart_median_s, d.rpo_restart_max_s) == (10.0, 50.0)  # 100 -> 110 -> 160 -> 170
    assert (d.rpo_node_loss_median_s, d.rpo_node_loss_max_s) == (15.0, 45.0)  # 100 -> 115 -> 160 -> 170

"""Pipeline schedules: bubble and in-flight activations per schedule, against hand-computed values.

Narayanan et al. 2021 (arXiv 2104.04473, sec. 2.2.2): bubble / ideal compute = (p-1)/m for
GPipe and 1F1B, (p-1)/(v*m) interleaved. Korthikanti et al. 2022 (arXiv 2205.05198, sec.
4.2.3): the interleaved first stage holds (1 + (p-1)/(p*v)) times 1F1B's p microbatches, which
is Megatron's warmup 2(p-1) + (v-1)p forward chunks plus the one in flight.
"""

import pytest

from dslurm.config.layout import Layout
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.plan.choose import validate_layout
from dslurm.plan.layout import Cluster, Workload, memory_per_gpu
from dslurm.plan.pipeline import (
    bubble_fraction,
    bubble_overhead,
    logits_in_flight,
    microbatches_for_bubble,
    schedule_bubble,
    stage_in_flight,
)


def test_interleaving_divides_the_bubble_by_v():
    # p=2, m=8, v=2 (the shipped 70B example): 1/(2*8) of compute, 1/(16+1) of the step.
    assert bubble_overhead(2, 8, 2) == pytest.approx(1 / 16)
    assert bubble_fraction(2, 8, 2) == pytest.approx(1 / 17)
    # Without interleaving: 1/8 of compute, 1/9 of the step.
    assert bubble_overhead(2, 8) == pytest.approx(1 / 8) and bubble_fraction(2, 8) == pytest.approx(1 / 9)
    # p=4, m=16: 3/16 and 3/19 (seed 000's 16%); interleaved v=2: 3/32 and 3/35.
    assert schedule_bubble("1F1B", 4, 16) == pytest.approx((3 / 19, 3 / 16))
    assert schedule_bubble("GPipe", 4, 16) == pytest.approx((3 / 19, 3 / 16))  # same bubble as 1F1B
    assert schedule_bubble("Interleaved1F1B", 4, 16) == pytest.approx((3 / 35, 3 / 32))


@pytest.mark.parametrize("p, m, v", [(2, 8, 1), (4, 16, 2), (8, 32, 2), (3, 5, 4)])
def test_the_two_bubble_measures_are_one_bubble(p, m, v):
    f = bubble_fraction(p, m, v)
    assert bubble_overhead(p, m, v) == pytest.approx(f / (1 - f))


def test_microbatches_for_a_bubble_under_interleaving():
    # 4 stages, v=2, <= 10% of the step: m >= 3 * 0.9 / (0.1 * 2) = 13.5 -> 14 (3/31 = 9.7%; 13 gives 3/29 = 10.3%).
    assert microbatches_for_bubble(4, 0.10, 2) == 14
    assert bubble_fraction(4, 14, 2) <= 0.10 < bubble_fraction(4, 13, 2)


def test_in_flight_microbatches_per_schedule():
    # 1F1B: rank r holds p - r microbatches; GPipe every one of them.
    assert [stage_in_flight("1F1B", 4, 16, r) for r in range(4)] == [4, 3, 2, 1]
    assert stage_in_flight("1F1B", 4, 2, 0) == 2  # capped by m
    assert stage_in_flight("GPipe", 4, 16, 0) == 16 == stage_in_flight("GPipe", 4, 16, 3)
    # Interleaved, p=2, v=2: rank 0 runs 2*1 + 1*2 = 4 warmup chunks, 5 in flight = 2.5 microbatches
    # of L/p layers = p(1 + (p-1)/(p*v)) = 2 * 1.25; the last rank 0 + 2 + 1 = 3 chunks = 1.5.
    assert stage_in_flight("Interleaved1F1B", 2, 8, 0) == 2.5
    assert stage_in_flight("Interleaved1F1B", 2, 8, 1) == 1.5
    # p=4, v=2: 2*3 + 4 + 1 = 11 chunks = 5.5 = 4 * (1 + 3/8); capped at m=4 when all 8 chunks fit.
    assert stage_in_flight("Interleaved1F1B", 4, 16, 0) == 5.5 == 4 * (1 + 3 / 8)
    assert stage_in_flight("Interleaved1F1B", 4, 4, 0) == 4
    assert logits_in_flight("GPipe", 8) == 8 and logits_in_flight("1F1B", 8) == 1


def test_unknown_schedule_and_rank_are_refused():
    with pytest.raises(UserError, match="pp_schedule='ZB'"):
        stage_in_flight("ZB", 2, 8)
    with pytest.raises(UserError, match=r"rank=2 must be in \[0, 2\)"):
        stage_in_flight("1F1B", 2, 8, 2)
    with pytest.raises(UserError, match="schedule='x'"):
        Workload(schedule="x")


# Llama-3-8B at s=8192, b=1, tp=1: per token 12h + 4kv + 6f = 49,152 + 4,096 + 86,016 = 139,264 bytes
# per layer; a layer holds 8192 x 139,264 bytes, a full-recompute layer input 2 x 8192 x 4096.
LAYER = 8192 * 139_264
LAYER_INPUT = 2 * 8192 * 4096
LOGITS = 4 * 8192 * 128_256


@pytest.mark.parametrize("schedule, first_microbatches", [("1F1B", 2), ("Interleaved1F1B", 2.5), ("GPipe", 8)])
def test_first_stage_activations_follow_the_schedule(schedule, first_microbatches):
    lay = Layout(pp=2, dp_shard=4, microbatches=8)
    mem = memory_per_gpu(PRESETS["8b"], lay, Workload(schedule=schedule))
    # 16 layers per stage; the first stage outweighs the last (one microbatch + logits) except under GPipe,
    # whose last stage holds all 8 microbatches and 8 logits.
    first = first_microbatches * 16 * LAYER
    last = (8 * 16 * LAYER + 8 * LOGITS) if schedule == "GPipe" else 16 * LAYER + LOGITS
    assert mem["activations"] == pytest.approx(max(first, last))


def test_full_recompute_rebuilds_one_layer_per_gpu_not_per_microbatch():
    lay = Layout(pp=2, dp_shard=4, microbatches=8)
    mem = memory_per_gpu(PRESETS["8b"], lay, Workload(schedule="Interleaved1F1B"), recompute="full")
    first = 2.5 * 16 * LAYER_INPUT + LAYER
    last = 1.5 * 16 * LAYER_INPUT + LAYER + LOGITS
    assert mem["activations"] == pytest.approx(max(first, last))


def test_validate_checks_microbatches_per_virtual_stage_and_reports_the_schedule():
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_mem_gb=80)
    plan = validate_layout(PRESETS["8b"], cluster, Layout(pp=2, dp_shard=8, microbatches=3),
                           Workload(schedule="Interleaved1F1B"))
    assert any("microbatches(3) < pipeline stages(4)" in p for p in plan.problems)
    ok = validate_layout(PRESETS["8b"], cluster, Layout(pp=2, dp_shard=8, microbatches=8),
                         Workload(schedule="Interleaved1F1B"))
    assert ok.schedule == "Interleaved1F1B" and ok.bubble == pytest.approx(1 / 17)
    assert ok.as_dict()["bubble_overhead"] == pytest.approx(1 / 16)

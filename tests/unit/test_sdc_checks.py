"""Silent data corruption across replicas and the periodic device poll (issue 18): the pure rules
(majority, naming, blocklist), the fingerprint on real tensors, the bit-flip knob, the config
fields, the report lines and doctor's findings. NVML is mocked with pytest-mock (patching the
real pynvml module's functions) because this machine has no GPU; everything else is real."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest
import torch
from test_report import Ledger

from dslurm import faults, health
from dslurm.config import load_job
from dslurm.errors import UserError
from dslurm.observe.doctor import diagnose
from dslurm.observe.report import summarize
from train.sdc import DevicePoll, fingerprint, flip_bit

# ------------------------------------------------------------------ majority and naming


def test_three_replicas_name_the_one_that_disagrees():
    v = health.sdc_verdict([(1, 2), (1, 3), (1, 2)])
    assert not v.ok and v.named and v.odd == [1], v
    assert "[1] disagree with the majority [0, 2]" in v.why


def test_agreeing_replicas_are_ok_and_a_single_replica_trivially_agrees():
    assert health.sdc_verdict([(5, 6)] * 4).ok
    assert health.sdc_verdict([(5,)]).ok


def test_two_replicas_cannot_name_one_both_are_suspects():
    v = health.sdc_verdict([(1,), (2,)])
    assert not v.ok and not v.named and v.odd == [0, 1]
    assert "2 replicas cannot name one" in v.why


def test_no_strict_majority_names_nobody():
    v = health.sdc_verdict([(1,), (1,), (2,), (2,)])  # 2 against 2
    assert not v.ok and not v.named and v.odd == [0, 1, 2, 3]
    v = health.sdc_verdict([(1,), (2,), (3,)])  # all different
    assert not v.named and v.odd == [0, 1, 2]


def test_two_bad_replicas_out_of_five_are_both_named():
    v = health.sdc_verdict([(0,), (9,), (0,), (8,), (0,)])
    assert v.named and v.odd == [1, 3]


def test_summary_blocklists_only_hosts_a_majority_named():
    named = {"suspect": True, "named": True, "why": "replica(s) [1] disagree", "params": ["w2", "w1"]}
    reports = [{"rank": 0, "host": "node1", "suspect": False, "named": True, "why": "", "params": []},
               {"rank": 1, "host": "node2", **named},
               {"rank": 2, "host": "node3", "suspect": False, "named": True, "why": "replica(s) [1] disagree",
                "params": []}]
    s = health.sdc_summary(reports)
    assert s.suspects == [1] and s.hosts == ["node2"] and s.named and s.blocklist == ["node2"]
    assert s.params == ["w1", "w2"] and s.why == "replica(s) [1] disagree"
    unnamed = [{"rank": r, "host": f"node{r + 1}", "suspect": True, "named": False, "why": "no majority",
                "params": ["w"]} for r in range(2)]
    s = health.sdc_summary(unnamed)
    assert s.suspects == [0, 1] and not s.named and s.blocklist == []


def test_due_every_n_steps_and_zero_is_off():
    assert [s for s in range(1, 11) if health.due(s, 5)] == [5, 10]
    assert not any(health.due(s, 0) for s in range(1, 11))


def test_mismatched_params_names_the_differing_ones():
    assert health.mismatched_params([1, 2, 3], [1, 7, 3], ["a", "b", "c"]) == ["b"]


# ------------------------------------------------------------------ fingerprint and the knob


def test_fingerprint_sees_any_single_bit_flip_of_fp32_and_bf16():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.randn(64, 8, dtype=dtype)
        base = fingerprint([p]).clone()
        words = p.view({4: torch.int32, 2: torch.int16}[p.element_size()]).reshape(-1)
        for bit in range(8 * p.element_size()):
            words[17] ^= (1 << bit) if bit < 8 * p.element_size() - 1 else -(1 << bit)  # the sign bit too
            assert not torch.equal(fingerprint([p]), base), (dtype, bit)
            words[17] ^= (1 << bit) if bit < 8 * p.element_size() - 1 else -(1 << bit)
        assert torch.equal(fingerprint([p]), base)


def test_fingerprint_is_exact_whatever_the_summation_order():
    x = torch.randn(1000)
    # the same bits reached through a different memory layout: a float sum might round differently
    assert torch.equal(fingerprint([x]), fingerprint([x.flip(0).flip(0).contiguous()]))
    assert fingerprint([x, x[:10]]).shape == (2,)


def test_flip_bit_changes_one_element_slightly_and_is_seen():
    p = torch.nn.Parameter(torch.ones(4, 4))
    before = fingerprint([p]).clone()
    assert flip_bit([torch.nn.Parameter(torch.empty(0)), p]) == "param #1"
    assert torch.isfinite(p).all() and (p != 1).sum() == 1 and abs(float(p.detach().flatten()[0]) - 1) < 0.01
    assert not torch.equal(fingerprint([p]), before)


def test_bitflip_knob_is_scoped_like_the_others():
    assert "DSLURM_FAULT_BITFLIP" in faults.KNOBS
    env = {"DSLURM_FAULT_BITFLIP": "3:1,2@0", "RANK": "2", "SLURM_RESTART_COUNT": "0"}
    assert faults.step_fault("DSLURM_FAULT_BITFLIP", env) == 3
    assert faults.step_fault("DSLURM_FAULT_BITFLIP", {**env, "RANK": "0"}) is None
    assert faults.step_fault("DSLURM_FAULT_BITFLIP", {**env, "SLURM_RESTART_COUNT": "1"}) is None


def test_health_fields_default_and_reject_negatives():
    h = load_job(data={"name": "j", "nodes": 1}).health
    assert (h.sdc_every, h.sdc_max, h.device_poll_every) == (50, 2, 50)
    assert load_job(data={"name": "j", "nodes": 1}, overrides=["health.sdc_every=0"]).health.sdc_every == 0
    with pytest.raises(UserError, match=r"health\.sdc_every.*-1 must not be negative.*0 \(off\)"):
        load_job(data={"name": "j", "nodes": 1}, overrides=["health.sdc_every=-1"])


# ------------------------------------------------------------------ device poll (NVML mocked)


def test_device_findings_rules():
    now = [health.GpuReading(0, temp_c=91, ecc_uncorrected=3, xids=[79]),
           health.GpuReading(1, temp_c=50, throttle=["HW slowdown"], ecc_uncorrected=0, xids=[13])]
    found = health.device_findings(now, {0: 1, 1: 0}, max_temp_c=85, hardware_xids=frozenset({79}))
    assert found == ["gpu0: temperature 91 C > 85 C", "gpu0: 2 new uncorrected ECC error(s)",
                     "gpu0: hardware Xid [79]", "gpu1: clock throttled: HW slowdown", "gpu1: Xid [13]"]
    assert health.device_findings([health.GpuReading(0, temp_c=40)], {}, max_temp_c=85,
                                  hardware_xids=frozenset()) == []


def test_device_poll_without_nvml_is_off(mocker):
    mocker.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    poll = DevicePoll(SimpleNamespace(max_temp_c=85.0))
    assert not poll.on and poll.poll() == []
    poll.close()


def test_device_poll_reports_new_findings_once(mocker):
    """NVML mocked: one GPU whose temperature climbs and whose ECC count grows once."""
    mocker.patch.object(pynvml, "nvmlInit")
    mocker.patch.object(pynvml, "nvmlShutdown")
    mocker.patch.object(pynvml, "nvmlDeviceGetCount", return_value=1)
    mocker.patch.object(pynvml, "nvmlDeviceGetHandleByIndex", side_effect=lambda i: i)
    mocker.patch.object(pynvml, "nvmlEventSetCreate", return_value="set")
    mocker.patch.object(pynvml, "nvmlDeviceRegisterEvents")
    mocker.patch.object(pynvml, "nvmlEventSetFree")
    mocker.patch.object(pynvml, "nvmlEventSetWait_v2", side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT))
    temps, ecc = iter([40, 90, 90]), iter([0, 0, 2, 2])
    mocker.patch.object(pynvml, "nvmlDeviceGetTemperature", side_effect=lambda *a: next(temps))
    mocker.patch.object(pynvml, "nvmlDeviceGetTotalEccErrors", side_effect=lambda *a: next(ecc))
    mocker.patch.object(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", return_value=0)
    poll = DevicePoll(SimpleNamespace(max_temp_c=85.0))
    assert poll.on and poll.poll() == []  # baseline ECC 0, 40 C
    assert poll.poll() == ["gpu0: temperature 90 C > 85 C", "gpu0: 2 new uncorrected ECC error(s)"]
    assert poll.poll() == []  # still hot: already reported; ECC did not grow again
    poll.close()


# ------------------------------------------------------------------ report and doctor


def _sdc_run(named: bool = True) -> Ledger:
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 39, 0)
    led.ev("ckpt_restore", t + 1, 0, step=20, generation="step-00000020-x")
    led.ev("sdc", t + 1.1, 0, step=40, last_clean_step=20, suspects=[1] if named else [0, 1],
           suspect_hosts=["node2"] if named else ["node1", "node2"], named=named,
           why="replica(s) [1] disagree with the majority [0, 2]" if named else "no majority among 2 replicas",
           params=["layers.0.w"], blocklisted=["node2"] if named else [], action="rollback",
           generation="step-00000020-x", resumed_step=20)
    t = led.train(t + 2, 20, 59, 0)
    led.ev("device_health", t, 0, step=60, findings=["gpu0: hardware Xid [79]"])
    led.ev("exit", t + 1, 0, reason="completed", step=60, code=0)
    return led


def test_report_keeps_an_in_process_rollback_in_its_start_and_prints_the_sdc_line():
    sm = summarize(_sdc_run().events)
    assert len(sm.starts) == 1 and sm.restarts == 0
    text = "\n".join(sm.health)
    assert "silent data corruption in start 0 at step 40" in text and "rolled back to step 20" in text
    assert "20 step(s) redone; blocklisted node2" in text
    assert "device health on node1 at step 60: gpu0: hardware Xid [79]" in text


def test_report_shows_a_hangs_cost_detection_plus_recovery():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 29, 0)
    led.ev("hang", t + 25, 0, step=30, idle_s=21.0, bound_s=20.0, suspects=[1], suspect_hosts=["node2"])
    t2 = led.start(t + 60, 1, 20)
    led.train(t2, 20, 49, 1)
    line = next(x for x in summarize(led.events).health if x.startswith("hang"))
    back = t2 + 10 - (t + 25)  # the first window of the next start ends 10 steps of 1 s after it began
    assert "detected after 21 s without progress (bound 20 s)" in line
    assert f"back to training {back:.0f} s later; cost {21 + back:.0f} s" in line


def test_doctor_names_the_corrupting_node_and_the_device_findings():
    found = diagnose(_sdc_run().events)
    sdc = next(f for f in found if f.symptom.startswith("silent data corruption"))
    assert "node2 disagreed with the majority" in sdc.symptom
    text = "\n".join(sdc.evidence)
    assert "layers.0.w" in text and "rolled back to step-00000020-x (step 20)" in text
    assert "wrong numbers with no error" in sdc.cause and "blocklisted node2" in sdc.action
    dev = next(f for f in found if f.symptom.startswith("device health on node1"))
    assert "Xid" in dev.cause and "drain it" in dev.action
    unnamed = next(f for f in diagnose(_sdc_run(named=False).events) if f.symptom.startswith("silent"))
    assert "every one of node1, node2 is a suspect" in unnamed.symptom and "3 or more" in unnamed.action

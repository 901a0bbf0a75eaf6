"""`dslurm selftest --gpu`: one command that checks one GPU end to end in minutes (issue 20).

NVML health and bf16 GEMM through the burn-in's checks, the built-in trainer on a Llama sized
to fill the GPU (compile off and on, tokens/s, MFU), a DCP save and restore of its state against
a raw write to the same disk, and the async save's stall; one JSON report with the chip's name
on every part and the issue's goals as pass/fail fields. `--dry-run` runs the same code on CPU
with tiny sizes. cli (torch-free: starts the in-job process `python -m train.selftest`, bounds it
in time, prints the report), report (parts, goals), sizing (the model from the memory; pure),
parts (NVML, GEMM, checkpoint; in-job).
"""

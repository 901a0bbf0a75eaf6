"""The hybrid-parallel trainer: `torchrun ... -m train --site FILE --job FILE [--set k=v ...]`.

`train.model` (the Llama-style decoder), `train.parallel` (one module per parallelism),
`train.loop` (the step, the stop flag, the exit codes), `train.data`, `train.lr`,
`train.metrics`. Importing the package imports no torch; the modules do.
"""

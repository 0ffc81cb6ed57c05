"""The benchmarks as package code.

Training benchmark (`gem-bench`, `gem bench`, `python -m gem.bench`, `python scripts/bench_train.py`): training
throughput and MFU of one experiment, measured through the real trainer (gem.train.Trainer).

    python scripts/bench_train.py [--warmup 10] [--steps 30] [--json out.json] [HYDRA OVERRIDES...]
    python scripts/bench_train.py --warmup 10 --steps 20 --profile-steps 5 [--profile-dir traces/] experiment=gpu_base
    torchrun --nproc_per_node=2 scripts/bench_train.py --single-gpu-json one_gpu.json experiment=gpu_base ...

The config is composed as `python -m gem.train` composes it (configs/, same overrides). The trainer runs
`warmup + steps` steps (a `train.steps=N` override sets that total instead); evaluation and checkpoints are
switched off. Each step's end is marked with a CUDA event on the compute stream (no host sync), so the timed
steps' time is the GPU timeline between the last warmup step and the last step, idle gaps included. Model FLOPs
come from the model's own accounting (`GEMModel.flops`) on the very batches the trainer consumed (the data stream
is deterministic per rank and is replayed afterwards; the trainer's own window figures cross-check it).

Printed: step ms, samples/s, tokens/s, model TFLOP/s per device, E2E MFU vs the vendor bf16 peak and vs a bf16
matmul measured in this run (8192^3 by default), local MFU and the scaling ratio (E2E / local; local leaves out the
exposed communication, measured by profiling the last `--comm-probe-steps` warmup steps on N > 1 ranks), the
step-time breakdown (input, forward, backward, optimizer, exposed communication), peak memory per rank and, with
`--single-gpu-tflops` or a 1-GPU run's `--single-gpu-json`, the weak-scaling efficiency against that run.

`--profile-steps K` runs the last K steps under torch.profiler (CPU, plus CUDA when present) and prints, per rank,
the top ops by self device time (self CPU time without CUDA) and the device time grouped into matmul / attention /
communication / embedding / other. Those steps stay in the timing (the profiler slows them; the report compares
them with the other timed steps). `--profile-dir DIR` also writes each rank's chrome trace there.
`--profile-sources 'aten::copy_,...'` also splits those ops' time by the gem source lines that called them.

`--processes N` runs all of that in N fresh single-rank processes, one after another, and prints min / median / max
per figure; `--baseline CHECKOUT` alternates them with another gem checkout's bench_train (its own code) and prints
the ratio of the two trees' median steps.

Modules: options (arguments), config (composition as gem-train does it), recorder (step marks and window figures
through the trainer's hooks), profiler (torch.profiler buckets), report (figures and tables), runner (one run),
processes (fresh-process runs, A/B against another checkout). Kernel benchmarks: kernels (timing helpers and
tables), attention (scripts/bench_attention.py), dispatch (scripts/bench_dispatch.py); balance (data.balance's
simulated straggler factor and one-device rehearsal: scripts/balance_sim.py, scripts/bench_balance.py); tuned
writes the shipped tuning data (gem/ops/tuned/*.json) and the plan's reference step (gem/plan/reference.json).
"""

"""Parallelism: the pieces every layout is made of, and (one layer up) the data-parallel strategies.

The layers of the code base, bottom first (tests/test_layering.py enforces them; a module imports only from
its own layer or below, and the graph has no cycles):

  config/, kernels/, data/         schema and validation; quantization kernels; tokenizers and datasets
  parallel/ primitives              launch, layout, mesh, comm, random, schedule, pipeline
  fp8/ numerics                     formats, scaling, FP8 linear, FP8 gradient communication, FP8 AdamW
  parallel/ layers                  tensor_parallel, cross_entropy, optim_rules, cpu_gemm, expert_parallel, context, ulysses
  model/                            the GPT built from those layers
  parallel/ strategies, accounting  data_parallel (stage 0), zero/ (1-3, ZeRO++), fp8/zero.py, volume
  training/                         engine, loop, checkpoints, metrics, memory estimate
  train.py, scripts/                entry points and tools

What lives here:

  primitives (import config/ and each other only)
    launch.py          the launcher's environment (torchrun, srun), process-group init, device choice
    restart.py         restarts inside one launch: who restarts (supervisor, torchrun, sbatch), exit codes, attempt
    layout.py          world = PP x DP x CP x TP, simulated nodes, dp_intra / dp_inter, CP chunks; validated
    mesh.py            the one mesh object: every process group, built once, with the configured timeout
    comm.py            the one door: every collective and p2p, byte ledger by kind / link / group, timeouts
    hang.py            a collective timed out: every rank's Python stack into <run_dir>/stacks/, the stuck one ends
    random.py          seeds derived from names; the TP/SP RNG tracker
    schedule.py        1F1B and interleaved 1F1B as plain action lists, with a deadlock checker
    pipeline.py        the p2p executor of a schedule
  layers (may also import fp8/ numerics, which sit between: FP8 GEMMs need comm, TP linears need FP8 GEMMs)
    tensor_parallel.py column / row / vocab-parallel layers, f and g, the SP conjugates
    cross_entropy.py   vocab-parallel cross entropy
    optim_rules.py     what every data-parallel strategy shares: compute dtypes, AdamW, norm ownership, clipping
    cpu_gemm.py        16-bit linears and attention in fp32 on CPUs without bf16/fp16 instructions (50x there)
    expert_parallel.py expert parallelism's token exchange: the dispatch and combine all-to-alls of MoE layers
    context.py         context parallelism's attention: ring (p2p) and all-gather forms, log-sum-exp merge
    ulysses.py         context parallelism's all-to-all form (DeepSpeed-Ulysses): heads scattered, sequence gathered
    context_mask.py    document masks under CP: each attention pair's slice of the mask, the empty pairs skipped
  strategies and accounting (may also import model/: units, tied embeddings and parameter counts need shapes)
    data_parallel.py   ZeRO stage 0: bucketed all-reduce overlapped with the last backward
    zero/              ZeRO stages 1-3 and ZeRO++ (see parallel/zero/__init__.py)
    volume.py          the analytic bytes of a step, to compare with the ledger

Nothing here imports training/ or the entry points.
"""

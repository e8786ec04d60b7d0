#!/usr/bin/env bash
# Every CUDA path checked in one command on a GPU machine, and the trainer's speed measured there.
#
#   bash scripts/gpu_check.sh OUTDIR            # run everything; OUTDIR/report.md is the one report
#   bash scripts/gpu_check.sh --fetch-wheels    # on a machine with PyPI: put the pure-Python wheels this project
#                                               # needs beyond a CUDA torch image into .whl/ (bring that folder)
#
# Steps (each under its own time limit, so one that hangs cannot take the others with it):
#   0. prepare: if the Python here lacks a package the trainer needs (omegaconf, ...) and .whl/ holds wheels,
#      install them into a private folder and put it on PYTHONPATH (nothing is fetched; nothing system-wide
#      changes); the repository root goes on PYTHONPATH too.
#   1. the machine: GPU, driver, torch / CUDA / Triton versions.
#   2. the GPU tier: python -m pytest tests/gpu (marker gpu).
#   3. kernel bandwidth: python scripts/bench_quant.py --device cuda.
#   3b. the FP8 cast-and-transpose kernels against the same casts compiled by inductor: scripts/bench_fp8_cast.py.
#   4. speed: python scripts/bench_fp8.py (tokens/s, TFLOP/s, MFU of gpt_1.3b, bf16 and fp8, recompute off,
#      micro-batch 4 x 4, train.compile on), beside its peers in the same invocation: the same shape as a plain
#      PyTorch script compiled per block, and that script with torchao float8 (ratio columns). Its rows also go to
#      OUTDIR/bench_fp8.json: python scripts/plan.py --calibrate OUTDIR fits the planner's GEMM rates to them.
#   4b. the fp8 row again with fp8.cast_transpose=true (kernels/fp8_transpose.py instead of inductor's casts).
#   4c. the fp8 row again with fp8.scaling=current (whether current scaling should be the default).
#   4d. FP8-LM's 16-bit GEMM paths forced on this GPU (fp8.gemm=bf16: an A100's, fp8.gemm=fp16: a V100's, under the
#      loss scaler) beside bf16, fp16 and fp8 GEMMs: what the A100 / V100 path costs against 16-bit training.
#   5. where the time goes: python scripts/profile_step.py for gpt_1.3b in bf16 and fp8 (compiled, 4 x 4), with the
#      40 kernels that take the most device time by full name.
#   6. the fp8 step's memory peak by allocation site (profile_step.py --memory-peak: the allocator's history).
# Environment knobs: GPU_CHECK_STEPS (bench steps, default 12), GPU_CHECK_SKIP (space-separated step
# numbers to skip, e.g. "4 5"), GPU_CHECK_PRESETS (default "gpt_1.3b"), GPU_CHECK_RECOMPUTE (default "off"),
# GPU_CHECK_PROFILE (precisions profiled, default "bf16 fp8"), GPU_CHECK_TESTS (pytest -k expression for step 2),
# GPU_CHECK_TRACE (non-empty: step 5 also writes OUTDIR/trace_<precision>.json.gz, a Chrome trace of the step:
# gaps between kernels and the host work behind them; ~1-2 MB each).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS=(omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 torchao==0.18.0)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$ROOT/.whl"
    # omegaconf's own wheel; antlr4-python3-runtime 4.9.3 is published as a source archive only: build its
    # (pure-Python) wheel here; torchao's abi3 wheel (the float8 peer row; imports on torch 2.11 and 2.13)
    python3 -m pip download --no-deps --only-binary=:all: -d "$ROOT/.whl" "${WHEELS[0]}" "${WHEELS[2]}" &&
        python3 -m pip wheel --no-deps -w "$ROOT/.whl" "${WHEELS[1]}" || exit 1
    ls -l "$ROOT/.whl"
    exit 0
fi

OUT="${1:?usage: bash scripts/gpu_check.sh OUTDIR   (or --fetch-wheels)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STEPS="${GPU_CHECK_STEPS:-12}"
SKIP=" ${GPU_CHECK_SKIP:-} "
PRESETS="${GPU_CHECK_PRESETS:-gpt_1.3b}"
RECOMPUTE="${GPU_CHECK_RECOMPUTE:-off}"
PROFILE="${GPU_CHECK_PROFILE:-bf16 fp8}"
TESTS="${GPU_CHECK_TESTS:-}"
TRACE="${GPU_CHECK_TRACE:-}"
REPORT="$OUT/report.md"
status=0

section() { printf '\n## %s\n\n' "$1" | tee -a "$REPORT"; }
# run STEP TIMEOUT LOGFILE CMD...: the output goes to the log and the report (fenced), failures are counted
run() {
    local step="$1" limit="$2" log="$OUT/$3"; shift 3
    if [[ "$SKIP" == *" $step "* ]]; then echo "(skipped: GPU_CHECK_SKIP)" | tee -a "$REPORT"; return 0; fi
    local t0=$SECONDS
    echo '```' >> "$REPORT"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    cat "$log" >> "$REPORT"
    echo '```' >> "$REPORT"
    echo "step $step: rc $rc in $((SECONDS - t0)) s ($*)" | tee -a "$REPORT"
    [[ $rc -eq 0 ]] || status=1
    return $rc
}

{
    echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown))"
} > "$REPORT"

section "0. preparation"
site="${TMPDIR:-/tmp}/gpu_check_site"
if ! "$PY" -c "import omegaconf, torchao" 2>/dev/null; then
    if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$ROOT"/.whl/*.whl 2>&1 | tail -3 | tee -a "$REPORT"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        echo "installed $(ls "$ROOT"/.whl | tr '\n' ' ') into $site" | tee -a "$REPORT"
    else
        echo "omegaconf or torchao is missing and .whl/ holds no wheels: run 'bash scripts/gpu_check.sh" \
             "--fetch-wheels' on a machine with PyPI and bring .whl/ along" | tee -a "$REPORT"
        "$PY" -c "import omegaconf" 2>/dev/null || exit 2  # torchao alone only costs the float8 peer row
    fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import omegaconf, sentencepiece, tokenizers, numpy, triton, torch" 2>&1 | tee -a "$REPORT" ||
    { echo "a package the trainer needs is missing (above)" | tee -a "$REPORT"; exit 2; }

section "1. machine"
run 1 60 machine.log "$PY" - <<'EOF'
import platform, subprocess, torch, triton
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if not torch.cuda.is_available():
    raise SystemExit("CUDA is not available: nothing here can run")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB")
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
EOF
[[ $? -eq 0 ]] || { echo "no usable GPU: stopping" | tee -a "$REPORT"; exit 2; }

section "2. GPU tier (tests/gpu)"
run 2 420 gpu_tier.log "$PY" -m pytest tests/gpu -p no:cacheprovider -rA -q -s --timeout 400 ${TESTS:+-k "$TESTS"}

section "3. quantization kernels on the GPU"
run 3 120 bench_kernels.log "$PY" scripts/bench_quant.py --device cuda --repeats 10

section "3b. FP8 backward operand casts: the cast-and-transpose kernels against inductor's form"
run 3b 120 bench_fp8_cast.log "$PY" scripts/bench_fp8_cast.py

section "4. speed: tokens/s, TFLOP/s and MFU on one GPU"
# shellcheck disable=SC2086
run 4 480 bench_fp8.log "$PY" scripts/bench_fp8.py --presets $PRESETS --recompute $RECOMPUTE \
    --steps "$STEPS" --warmup 4 --micro-batch 4 --accum 4 --json "$OUT/bench_fp8.json"

section "4b. speed: fp8 with the cast-and-transpose kernels (fp8.cast_transpose=true)"
# shellcheck disable=SC2086
run 4b 300 bench_fp8_cast_transpose.log "$PY" scripts/bench_fp8.py --presets $PRESETS --recompute $RECOMPUTE \
    --steps "$STEPS" --warmup 4 --micro-batch 4 --accum 4 --precisions fp8 --no-peers fp8.cast_transpose=true

section "4c. speed: fp8 with current scaling (fp8.scaling=current; the default is delayed)"
# shellcheck disable=SC2086
run 4c 300 bench_fp8_current.log "$PY" scripts/bench_fp8.py --presets $PRESETS --recompute $RECOMPUTE \
    --steps "$STEPS" --warmup 4 --micro-batch 4 --accum 4 --precisions fp8 --no-peers fp8.scaling=current

section "4d. speed: FP8-LM with 16-bit GEMMs (fp8.gemm=bf16 / fp16, the A100 and V100 paths) beside bf16 and fp16"
# shellcheck disable=SC2086
run 4d 480 bench_fp8_gemm.log "$PY" scripts/bench_fp8.py --presets $PRESETS --recompute $RECOMPUTE \
    --steps "$STEPS" --warmup 4 --micro-batch 4 --accum 4 --precisions bf16 fp16 fp8 fp8:bf16 fp8:fp16 --no-peers

section "5. where one step's time goes"
for prec in $PROFILE; do
    run 5 180 "profile_${prec}.log" "$PY" scripts/profile_step.py --preset gpt_1.3b --precision "$prec" \
        --micro-batch 4 --accum 4 --warmup 3 --kernels 40 ${TRACE:+--trace "$OUT/trace_${prec}.json"} \
        model.activation_checkpointing=off
    [[ -n "$TRACE" && -f "$OUT/trace_${prec}.json" ]] && gzip -f "$OUT/trace_${prec}.json"
done

section "6. what the fp8 step's memory peak holds"
run 6 240 memory_fp8.log "$PY" scripts/profile_step.py --preset gpt_1.3b --precision fp8 --micro-batch 4 --accum 4 \
    --warmup 2 --memory-peak 25 model.activation_checkpointing=off

echo | tee -a "$REPORT"
echo "overall: $([[ $status -eq 0 ]] && echo 'every step passed' || echo 'SOME STEPS FAILED (above)')" | tee -a "$REPORT"
exit $status

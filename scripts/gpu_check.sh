#!/usr/bin/env bash
# The GPU check: what a user with an NVIDIA GPU runs first, and what this project runs
# whenever it is lent one. Sized for one 8-minute call on a fresh machine, fairseq's
# import included: every stage has a time box (T_<STAGE> seconds, e.g. T_LOSS=75; the
# defaults add up to 7m00s, 8m00s with WHEELS's set-up), a stage that runs out is cut (its
# processes killed), reported as timed out, and the next one starts.
#
#   bash scripts/gpu_check.sh            # results in OUT (default work/gpu-check)
#   WHEELS=.whl bash scripts/gpu_check.sh   # a machine without network: see below
#   FULL=1 bash scripts/gpu_check.sh     # the whole grid (more sizes and methods, 4x the boxes)
#   DRY_RUN=1 bash scripts/gpu_check.sh  # print the commands only
#   CPU_SMOKE=1 bash scripts/gpu_check.sh   # every stage at toy sizes on the CPU (a test)
#
# First the measurements, each alone on the machine, each table in one process (the
# allocator's peak reset per method):
#   loss       the loss alone (benchmarks/bench_rdrop.py), bf16 and fp16, V = 32,000 and
#              267,744, 8192 tokens per pass, logits from D = 1024 features: floor (fairseq's
#              cross-entropy on the doubled batch), upstream (fairseq's R-Drop), ours-triton,
#              ours-fused-linear, and fused-linear's chunk sweep (--rdrop-chunk-mb 64 to
#              4096: row pairs per chunk in the table), which sets its CUDA default;
#   step       whole fp16 training steps of transformer_iwslt_de_en and
#              transformer_vaswani_wmt_en_de_big, floor (the doubled-batch step) / upstream /
#              ours-triton, and torch.profiler tables of each (profile.txt);
#   attendout  benchmarks/bench_attendout.py at roberta-base's shape in fp16 (12 x 768,
#              batch 16 x 256): each method's step, pruned inference, and the pruning
#              step's memory for T = 1 and 8 cached batches;
#   hf         benchmarks/bench_hf.py: RDropTrainer under bf16 autocast at a Llama-3-8B
#              head's shape (hidden 4,096, V = 128,256, one layer), 8,192 tokens per pass,
#              through the logits (impl auto: the Triton kernel) and the fused path,
#              against a plain Trainer step on the doubled batch: time and peak memory;
# then, side by side (correctness and memory, not timing):
#   cuda_tests pytest -m cuda;
#   fp16       the LibreOffice corpus prepared, FP16_UPDATES (300) fp16 updates of R-Drop
#              with the run's final validation: every loss, nll_loss and rdrop_kl finite;
#   fast_tier  the suite's core tier (scripts/test.sh --fast) where CUDA is visible;
#   recipe_memory  each recipe's fp16 training step at its per-GPU tokens
#              (benchmarks/bench_recipe_memory.py: the allocator's peak, a figure of its
#              own process, so other processes on the GPU do not change it).
# OUT gets 8 files: summary.md (the versions, each stage's status and time, every table),
# gpu-check.log (every stage's output), bench_rdrop.json (with the recipes' memory rows,
# for bench_recipe_memory.py record), profile.txt,
# bench_attendout.json, cuda-tests.xml, fast-tier.xml, fp16-train.log. Scratch in WORK.
#
# Environment: torch for CUDA, fairseq and this plugin (pip install -e '.[test,recipes]';
# scripts/setup.sh installs the CPU torch); PYTHON picks the interpreter. On a GPU machine
# without network: bash scripts/lib/gpu_wheels.sh where pip works, carry .whl there, and
# WHEELS=.whl makes a venv (GPU_VENV, default
# WORK/venv) that sees the machine's torch and triton, with those wheels and this checkout
# (scripts/lib/gpu_venv.sh; a stage of its own). Without a CUDA device it says so and
# exits with 1. The exit status is 1 if a stage failed or timed out.
source "$(dirname "$0")/lib/common.sh"
cd "$REPO"

OUT=$(realpath -m "${OUT:-work/gpu-check}")
WORK=$(realpath -m "${WORK:-${TMPDIR:-/tmp}/rdrop-gpu-check}")
SMOKE=${CPU_SMOKE:-0}
FULL=${FULL:-0}
DRY=${DRY_RUN:-0}
FP16_UPDATES=${FP16_UPDATES:-$([ "$SMOKE" = 1 ] && echo 4 || echo 300)}
[[ $FP16_UPDATES =~ ^[1-9][0-9]*$ ]] || die "FP16_UPDATES must be a whole number >= 1"
for var in T_SETUP T_LOSS T_STEP T_ATTENDOUT T_ATTENDOUT_PRUNING T_HF T_CUDA_TESTS T_PREPARE \
           T_FP16_TRAIN T_FAST_TIER T_RECIPE_MEMORY; do
  [ -z "${!var:-}" ] || [[ ${!var} =~ ^[1-9][0-9]*$ ]] ||
    die "$var must be a whole number of seconds >= 1 (the stage's time box), not '${!var}'"
done
SCALE=$([ "$FULL" = 1 ] && echo 4 || echo 1)
# box STAGE DEFAULT: the stage's time box in seconds: T_STAGE, else DEFAULT (x4 with FULL=1)
box() { local var=T_$1; echo $(( ${!var:-$2} * SCALE )); }

STAGES=$WORK/stages.tsv
# WORK made, its list of stages emptied: once, before the first stage
start_work() { [ "$DRY" = 1 ] || { mkdir -p "$WORK" && : >"$STAGES"; }; }

# stage NAME SECONDS COMMAND...: run COMMAND time-boxed, its output in WORK/NAME.log, its
# status (ok, failed (code), timed out) and time in WORK/stages.tsv
stage() {
  local name=$1 limit=$2 line code=0 status=ok start=$SECONDS
  shift 2
  printf -v line ' %q' "$@"
  echo "+ [$name, ${limit} s]$line"
  [ "$DRY" = 1 ] && return 0
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1 || code=$?
  case $code in 0) ;; 124|137) status="timed out" ;; *) status="failed ($code)" ;; esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( SECONDS - start ))" "$limit" >>"$STAGES"
  say "$name: $status, $(( SECONDS - start )) s"
  return "$code"
}

if [ -n "${WHEELS:-}" ]; then
  GPU_VENV=$(realpath -m "${GPU_VENV:-$WORK/venv}")
  start_work
  stage setup "$(box SETUP 60)" bash "$REPO/scripts/lib/gpu_venv.sh" "$GPU_VENV" \
    "$(realpath -m "$WHEELS")" "$PYTHON" || die "set-up failed: $(tail -n 3 "$WORK/setup.log")"
  PYTHON=$GPU_VENV/bin/python
fi

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu
  say "CPU_SMOKE: every stage at toy sizes on the CPU"
elif ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  [ "$DRY" = 1 ] || die "no CUDA device visible to $PYTHON's torch: gpu_check.sh" \
      "measures on an NVIDIA GPU (CPU figures: benchmarks/*.py without 'gpu')"
  say "(dry run: no CUDA device here)"
  DEVICE=cuda
else
  DEVICE=cuda
fi
[ -n "${WHEELS:-}" ] || start_work
[ "$DRY" = 1 ] || mkdir -p "$OUT"

# the stages' commands, at the GPU's sizes or CPU_SMOKE's toy ones
BENCH=("$PYTHON" "$REPO/benchmarks/bench_rdrop.py")
ATTENDOUT=("$PYTHON" "$REPO/benchmarks/bench_attendout.py")
MEMORY=("$PYTHON" "$REPO/benchmarks/bench_recipe_memory.py")
HF=("$PYTHON" "$REPO/benchmarks/bench_hf.py" --heads causal-lm --bf16 --rounds 1 --one-process)
if [ "$SMOKE" = 1 ]; then
  # ours-triton in Triton's interpreter (a program per row, each ~35 ms: 16 tokens in the
  # loss, one 16-token sentence in the step); each table in this process as on CUDA
  BENCH=(env TRITON_INTERPRET=1 "${BENCH[@]}" --device cpu --threads 1 --repeats 1 --one-process)
  LOSS=(--dtype float32 --vocab 256 --tokens 16 --projection 32
        --methods floor upstream ours-triton ours-fused-linear --fused-chunk-mb 0.01 0.1)
  STEP=(--step-tiny --step-vocab 256 --step-tokens 16 --methods floor upstream ours-triton)
  SHAPE=(--layers 2 --dim 32 --heads 2 --length 16)
  # two arms: each is a process of its own that imports fairseq
  ATTENDOUT_STEP=(all "${SHAPE[@]}" --batch 2 --interval 2 --intervals 1 --repeats 1
                  --methods baseline attendout)
  ATTENDOUT_PRUNING=(pruning "${SHAPE[@]}" --pruning-batch 2 --prune-t 1 --prune-part step)
  CUDA_TESTS=("$REPO/tests/test_fused_linear.py")
  FAST=(-k test_bad_input_is_refused)
  FAST_WORKERS=0
  MEMORY+=(--device cpu --tiny --recipes iwslt14)  # the path, at a 1-layer model's size
  HF+=(--device cpu --shape tiny --batch 1 --length 16 --steps 1)
else
  BENCH+=(--device cuda)
  LOSS=(--dtype bfloat16 float16 --vocab 32000 267744 --tokens 8192 --projection 1024
        --methods floor upstream ours-triton ours-fused-linear
        --fused-chunk-mb 64 256 1024 4096)
  STEP=(--step-vocab 32000 --step-tokens 4096 --methods floor upstream ours-triton)
  SHAPE=(--device cuda --dtype float16 --layers 12 --dim 768 --heads 12 --length 256)
  ATTENDOUT_STEP=(all "${SHAPE[@]}" --batch 16 --interval 5 --intervals 1 --repeats 3)
  ATTENDOUT_PRUNING=(pruning "${SHAPE[@]}" --pruning-batch 16 --prune-t 1 8 --prune-part step)
  if [ "$FULL" = 1 ]; then
    LOSS=(--dtype bfloat16 float16 --vocab 32000 267744 --tokens 4096 8192 --projection 1024
          --methods floor upstream ours-torch ours-triton ours-fused-linear
          ours-fused-linear-torch --fused-chunk-mb 16 64 256 1024 4096)
    STEP=(--step-vocab 32000 --step-tokens 4096 --methods floor upstream ours-torch ours-triton)
    ATTENDOUT_STEP=(gpu)
    ATTENDOUT_PRUNING=()
  fi
  CUDA_TESTS=("$REPO/tests")
  FAST=()
  FAST_WORKERS=8
  MEMORY+=(--device cuda)
  HF+=(--device cuda --shape llama3-8b-head --batch 1 --length 8192 --steps 2)
fi
ARCHS=(--step-arch transformer_iwslt_de_en transformer_vaswani_wmt_en_de_big)

say "1/2 measurements, one at a time"
stage loss "$(box LOSS 75)" "${BENCH[@]}" loss "${LOSS[@]}" \
  --json "$WORK/loss.json" --markdown "$WORK/loss.md" || true
stage step "$(box STEP 85)" "${BENCH[@]}" step "${ARCHS[@]}" "${STEP[@]}" \
  --profile "$OUT/profile.txt" --json "$WORK/step.json" --markdown "$WORK/step.md" || true
stage attendout "$(box ATTENDOUT 60)" "${ATTENDOUT[@]}" "${ATTENDOUT_STEP[@]}" \
  --work "$WORK/attendout" --json "$WORK/attendout.json" || true
[ ${#ATTENDOUT_PRUNING[@]} = 0 ] ||
  stage attendout_pruning "$(box ATTENDOUT_PRUNING 30)" "${ATTENDOUT[@]}" \
    "${ATTENDOUT_PRUNING[@]}" --work "$WORK/attendout" --json "$WORK/attendout_pruning.json" ||
  true
stage hf "$(box HF 20)" "${HF[@]}" --json "$WORK/hf.json" || true

say "2/2 side by side: the CUDA tests, fp16 training, the core tier, the recipes' memory"
fp16_run() {
  local data=$WORK/libreoffice train=(--fp16) log=$WORK/fp16_train.log
  local prepare=("$PYTHON" -m rdrop_fairseq.recipes.prepare_translation --out "$data")
  if [ "$SMOKE" = 1 ]; then  # 300 pairs, a 1 + 1-layer model on the CPU in float32
    prepare+=(--raw "$WORK/raw" --bpe-merges 300)
    train=(--cpu --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32
           --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
           --max-tokens 512)
    [ "$DRY" = 1 ] || "$PYTHON" -c "import sys; from pathlib import Path
from rdrop_fairseq.recipes.prepare_translation import export_libreoffice
export_libreoffice(Path(sys.argv[1]), train_pairs=300, valid_pairs=40, test_pairs=20)" \
      "$WORK/raw"
  else
    prepare+=(--libreoffice --workers 8)
    train+=(--max-tokens 4096)
  fi
  [ -f "$data/bin/dict.de.txt" ] || stage prepare "$(box PREPARE 50)" "${prepare[@]}" || return
  stage fp16_train "$(box FP16_TRAIN 100)" "$(fairseq_cli fairseq-train)" "$data/bin" \
    --user-dir "$USER_DIR" --task translation --source-lang de --target-lang en \
    --arch transformer_iwslt_de_en --share-all-embeddings --dropout 0.3 \
    --criterion label_smoothed_cross_entropy_rdrop --rdrop-alpha 5 --label-smoothing 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr 5e-4 --lr-scheduler inverse_sqrt \
    --warmup-updates 100 "${train[@]}" --max-update "$FP16_UPDATES" --log-format simple \
    --log-interval 1 --no-progress-bar --no-save --seed 1 || true
  [ "$DRY" = 1 ] && return 0
  # the run's own output: fairseq's --log-file gets only fairseq_cli.train's lines, not the
  # train_inner lines checked here
  cp "$log" "$OUT/fp16-train.log"
  local lines status=ok
  lines=$(grep -c "train_inner" "$log" || true)
  if (( lines < FP16_UPDATES * 9 / 10 )); then
    status="failed: $lines of $FP16_UPDATES updates logged (overflow skips?)"
  elif grep -qE "[[:space:],](loss|nll_loss|rdrop_kl)=(nan|inf|-inf)" "$log"; then
    status="failed: a NaN/inf loss or rdrop_kl"
  elif ! grep -q "valid on 'valid' subset" "$log"; then
    status="failed: no validation"
  fi
  printf '%s\t%s\t-\t-\n' fp16_check "$status ($lines updates logged)" >>"$STAGES"
  say "fp16 run: $status ($lines updates logged)"
}
stage cuda_tests "$(box CUDA_TESTS 150)" "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
  "${CUDA_TESTS[@]}" --junitxml "$OUT/cuda-tests.xml" &
fp16_run &
stage fast_tier "$(box FAST_TIER 150)" env TEST_PYTHON="$PYTHON" TEST_WORKERS=$FAST_WORKERS \
  bash "$REPO/scripts/test.sh" --fast -q -p no:cacheprovider --junitxml "$OUT/fast-tier.xml" \
  "${FAST[@]}" &
stage recipe_memory "$(box RECIPE_MEMORY 150)" "${MEMORY[@]}" --json "$WORK/recipe_memory.json" &
wait
[ "$DRY" = 1 ] && exit 0

"$PYTHON" "$REPO/scripts/lib/gpu_report.py" "$WORK" "$OUT" "$DEVICE"
cat "$OUT/summary.md"
! grep -qv $'\tok' "$STAGES"  # 1 if a stage failed or timed out

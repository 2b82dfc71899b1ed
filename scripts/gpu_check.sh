#!/usr/bin/env bash
# What a user with an NVIDIA GPU runs first, and what this project runs whenever it has one:
#
#   bash scripts/gpu_check.sh             # results in OUT (default work/gpu-check)
#   DRY_RUN=1 bash scripts/gpu_check.sh   # print the commands only
#
# 1. the CUDA-marked tests (pytest -m cuda): the Triton kernel against the torch path in
#    fp16/bf16, the fused-linear loss against the unfused one, --amp;
# 2. an fp16 training run (FP16_UPDATES, default 300) of the IWSLT transformer with R-Drop
#    on the committed LibreOffice de-en corpus: every logged loss and rdrop_kl finite;
# 3. the loss and whole-step benchmarks against fairseq's label_smoothed_cross_entropy on
#    the doubled batch (time, peak memory; V = 32k and 267,744), and AttendOut's step,
#    pruned-inference and pruning-step memory benchmark (roberta-base, fp16; the pruning
#    step at 16 x 256 with T = 1, 4, 8, 25 cached batches): tables in OUT/*.md, JSON in
#    OUT/*.json.
# Run it in an environment with torch for CUDA, fairseq and this plugin (pip install -e
# '.[test,recipes]'; scripts/setup.sh installs the CPU torch); PYTHON picks the interpreter.
# Without a CUDA device it says so and exits with 1.
source "$(dirname "$0")/lib/common.sh"

OUT=$(realpath -m "${OUT:-work/gpu-check}")
FP16_UPDATES=${FP16_UPDATES:-300}
[[ $FP16_UPDATES =~ ^[1-9][0-9]*$ ]] || die "FP16_UPDATES must be a whole number >= 1"

if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  [ "${DRY_RUN:-0}" = 1 ] || die "no CUDA device visible to $PYTHON's torch: gpu_check.sh" \
      "measures on an NVIDIA GPU (CPU figures: benchmarks/*.py without 'gpu')"
  say "(dry run: no CUDA device here)"
fi
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$OUT"

say "1/3 the CUDA-marked tests"
run "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider "$REPO/tests" \
    --junitxml "$OUT/cuda-tests.xml"

say "2/3 fp16 training with R-Drop, $FP16_UPDATES updates"
DATA=$OUT/libreoffice
# the run's own output: fairseq's --log-file gets only fairseq_cli.train's lines, not the
# train_inner lines that are checked below
FP16_LOG=$OUT/fp16-train.log
[ "${DRY_RUN:-0}" != 1 ] || FP16_LOG=/dev/stdout
[ -f "$DATA/bin/dict.de.txt" ] ||
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_translation --libreoffice --out "$DATA"
run "$(fairseq_cli fairseq-train)" "$DATA/bin" --user-dir "$USER_DIR" \
    --task translation --source-lang de --target-lang en \
    --arch transformer_iwslt_de_en --share-all-embeddings --dropout 0.3 \
    --criterion label_smoothed_cross_entropy_rdrop --rdrop-alpha 5 --label-smoothing 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr 5e-4 --lr-scheduler inverse_sqrt \
    --warmup-updates 100 --max-tokens 4096 --fp16 --max-update "$FP16_UPDATES" \
    --log-format simple --log-interval 1 --no-progress-bar --no-save --seed 1 \
    >"$FP16_LOG" 2>&1 || die "fp16 run failed: $(tail -n 5 "$FP16_LOG")"
if [ "${DRY_RUN:-0}" != 1 ]; then
  lines=$(grep -c "train_inner" "$OUT/fp16-train.log" || true)
  (( lines >= FP16_UPDATES * 9 / 10 )) ||
    die "fp16 run: $lines of $FP16_UPDATES updates logged (overflow skips?): $OUT/fp16-train.log"
  ! grep -E "[[:space:],](loss|nll_loss|rdrop_kl)=(nan|inf|-inf)" "$OUT/fp16-train.log" ||
    die "fp16 run: a NaN/inf loss or rdrop_kl (lines above): $OUT/fp16-train.log"
  say "fp16 run: $lines updates, loss and rdrop_kl finite"
fi

say "3/3 benchmarks against fairseq's criterion on the doubled batch, and AttendOut"
run "$PYTHON" "$REPO/benchmarks/bench_rdrop.py" gpu --vocab 32000 267744 --projection 1024 \
    --methods floor upstream ours-torch ours-triton ours-fused-linear \
    --markdown "$OUT/bench_rdrop.md" --json "$OUT/bench_rdrop.json"
run "$PYTHON" "$REPO/benchmarks/bench_attendout.py" gpu --json "$OUT/bench_attendout.json"
say "done: $OUT (cuda-tests.xml, fp16-train.log, bench_rdrop.md/.json, bench_attendout.json)"

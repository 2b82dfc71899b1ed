#!/usr/bin/env bash
# GLUE with R-Drop on BERT-base through Hugging Face, the paper's BERT-base row: fine-tuned
# with RDropTrainer (rdrop_fairseq.hf) on one GPU per task, with the task's max updates,
# batch (sentences) and alpha (the paper's appendix table 1: rdrop_fairseq/recipes/
# glue_tasks.tsv), the paper's optimiser, and a linear warm-up over 6 % of the updates with
# linear decay (fairseq's RoBERTa GLUE schedule, as the paper's settings); where the paper is
# silent, Hugging Face's run_glue defaults (docs/glue.md lists each).
#
#   TASK=RTE bash scripts/glue_bert.sh [prepare|train|evaluate|all] [extra arguments]
#   TASK=MRPC MODE=baseline SEED=2 bash scripts/glue_bert.sh train
#   TASK=CoLA DRY_RUN=1 bash scripts/glue_bert.sh train     # print the commands only
#
# Inputs, each fetched into its default place unless set (docs/data.md; OFFLINE=1: none):
# GLUE_DIR (the GLUE tasks' TSVs; default work/glue_data), BERT_DIR (a Hugging Face
# bert-base-uncased folder: config.json, model.safetensors or pytorch_model.bin,
# tokenizer.json or vocab.txt; default work/bert-base-uncased), DOWNLOADS. Environment: TASK (CoLA, MRPC, RTE,
# SST-2, MNLI, QNLI, QQP, STS-B), DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl,
# doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, AUTHORS_CODE (1: alpha = 0.5 x the per-device batch, the KL scale
# of the authors' Hugging Face code), WARMUP (the warm-up's fraction of the updates; default
# 0.06, 0 for none), SEED, MAX_UPDATE, UPDATE_FREQ (the batch as UPDATE_FREQ steps of
# batch/UPDATE_FREQ sentences), GPUS (0 or 1), CPU, BF16, FP16, PYTHON, DRY_RUN.
# Arguments after train are Hugging Face TrainingArguments (--learning_rate 2e-5); after
# prepare / evaluate, options of the Python module. Rerunning train resumes from the last
# checkpoint-N of SAVE_DIR.
source "$(dirname "$0")/lib/common.sh"

# the paper's per-task settings (rdrop_fairseq/recipes/glue_tasks.tsv): max updates, batch
# (sentences), alpha, classes, the best checkpoint's metric and its report flag
glue_task
PAPER_MAX_UPDATE=${SETTINGS[0]} BATCH=${SETTINGS[1]}
GLUE_DIR=${GLUE_DIR:-work/glue_data}
BERT_DIR=${BERT_DIR:-work/bert-base-uncased}
DATA_DIR=${DATA_DIR:-work/glue-bert}
SAVE_DIR=${SAVE_DIR:-checkpoints/glue_bert.$TASK.$MODE.seed$SEED}
parse_stage "$@"
make_absolute GLUE_DIR BERT_DIR
BIN=$DATA_DIR/$TASK  # the tokenised task (run_stages: all skips prepare when it is there)
detect_devices
set_mode "${SETTINGS[2]}"  # checks MODE and ALPHA; BATCH_FACTOR 2 for doubled-batch

BERT_FILES="a local copy of Hugging Face's bert-base-uncased (config.json, model.safetensors or pytorch_model.bin, tokenizer.json or vocab.txt); docs/data.md says where it comes from"

prepare() {
  # the inputs given are checked first, then the others are fetched
  WANTED=()
  input GLUE_DIR "$TASK/train.tsv" "GLUE_DIR must hold the GLUE tasks as the GLUE download script writes them ($TASK/train.tsv, dev.tsv)" \
        "glue-$TASK=$GLUE_DIR/$TASK"
  input BERT_DIR config.json "BERT_DIR must be $BERT_FILES" "bert-base-uncased=$BERT_DIR"
  fetch "${WANTED[@]}"
  need "$GLUE_DIR/$TASK/train.tsv" "GLUE_DIR must hold $TASK/train.tsv"
  need "$BERT_DIR/config.json" "BERT_DIR must be $BERT_FILES"
  run "$PYTHON" -m rdrop_fairseq.recipes.glue_bert prepare "$TASK" --glue-dir "$GLUE_DIR" \
      --bert-dir "$BERT_DIR" --out "$BIN" "${EXTRA[@]}"
}

train() {
  need "$BIN/meta.json" "run: TASK=$TASK bash scripts/glue_bert.sh prepare"
  need "$BERT_DIR/config.json" "BERT_DIR must be $BERT_FILES"
  # one GPU, as the paper and the authors' run.sh (several would be DataParallel)
  (( DEVICES == 1 )) || die "glue_bert.sh fine-tunes on one GPU, as the paper: set GPUS=1" \
                            "(CUDA_VISIBLE_DEVICES picks it; one task per GPU)"
  UPDATE_FREQ=${UPDATE_FREQ:-1}
  (( BATCH % UPDATE_FREQ == 0 )) ||
    die "UPDATE_FREQ=$UPDATE_FREQ does not divide $TASK's batch of $BATCH sentences"
  local batch_size=$(( BATCH / UPDATE_FREQ * BATCH_FACTOR )) mode_args=(--mode "$MODE")
  local alpha=${ALPHA:-${SETTINGS[2]}}
  if [ "${AUTHORS_CODE:-0}" = 1 ]; then
    [ "$MODE" = rdrop ] || die "AUTHORS_CODE=1 sets R-Drop's alpha: it goes with MODE=rdrop"
    [ -z "${ALPHA:-}" ] || die "AUTHORS_CODE=1 sets alpha (0.5 x the per-device batch): leave out ALPHA=$ALPHA"
    # their KL, weighted 0.5 and summed over the batch beside mean cross-entropies, is
    # alpha = 0.5 x B here (docs/huggingface.md)
    alpha=$(awk -v b="$batch_size" 'BEGIN { print 0.5 * b }')
    say "AUTHORS_CODE=1: alpha = 0.5 x $batch_size sentences per device = $alpha"
  fi
  [ "$MODE" != rdrop ] || mode_args+=(--alpha "$alpha")
  mode_args+=(--warmup "${WARMUP:-0.06}")
  [ "$RDROP_EVERY" = 1 ] || mode_args+=(--rdrop-every "$RDROP_EVERY")
  [ "$RDROP_PASS_MEAN" = 0 ] || mode_args+=(--rdrop-pass-mean)
  every_line
  # fp16 on GPUs as the authors' run.sh
  trainer_device_args
  say "batch: 1 device x $UPDATE_FREQ steps x $batch_size sentences" \
      "= $(( batch_size * UPDATE_FREQ )) sentences per update (the paper's: $BATCH)"
  # the paper's optimiser (Adam, betas 0.9 / 0.98, eps 1e-6, weight decay 0.01, lr 1e-5) and
  # warm-up (--warmup, above: 6 % of the updates, then linear decay to 0); the rest is
  # TrainingArguments' defaults, as run_glue's (gradient clipping at 1.0; dropout 0.1 is
  # BERT's config)
  run "$PYTHON" -m rdrop_fairseq.recipes.glue_bert train "$TASK" --data "$BIN" \
      --bert-dir "$BERT_DIR" "${mode_args[@]}" -- \
      --output_dir "$SAVE_DIR" --seed "$SEED" --max_steps "${MAX_UPDATE:-$PAPER_MAX_UPDATE}" \
      --per_device_train_batch_size "$batch_size" --gradient_accumulation_steps "$UPDATE_FREQ" \
      --learning_rate 1e-5 --adam_beta1 0.9 --adam_beta2 0.98 --adam_epsilon 1e-6 \
      --weight_decay 0.01 "${HF_DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/final/glue.json" "train first: TASK=$TASK bash scripts/glue_bert.sh train"
  # the dev set(s) with the task's metric (MNLI: matched and mismatched)
  run "$PYTHON" -m rdrop_fairseq.recipes.glue_bert evaluate "$TASK" --data "$BIN" \
      --save-dir "$SAVE_DIR" --json "$SAVE_DIR/dev.json" "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

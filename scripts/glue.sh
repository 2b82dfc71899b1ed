#!/usr/bin/env bash
# GLUE with R-Drop, the paper's table 3: RoBERTa large fine-tuned with the task's max
# updates, batch (sentences) and alpha (the paper's appendix table 1), on one GPU (the
# paper's) or several (GPUS=4: the batch split over them).
# MODE=attendout: AttendOut (docs/attendout.md) on RoBERTa base, fairseq's roberta.base
# settings per task (configs/roberta_glue_attendout.yaml); MODE=attendout_rdrop: both;
# TARGET_LAYERS=K: AttendOut's budget (prune exactly K of 12 layers, validated from the
# deadline on, so that checkpoint_best.pt has them all).
#
#   TASK=RTE bash scripts/glue.sh [prepare|train|evaluate|all] [extra arguments]
#   TASK=MNLI MODE=baseline SEED=2 bash scripts/glue.sh train
#   TASK=CoLA DRY_RUN=1 bash scripts/glue.sh train          # print the commands only
#
# Inputs, each fetched into its default place unless set (docs/data.md; OFFLINE=1: none):
# GLUE_DIR (the GLUE tasks' TSVs; default work/glue_data), BPE_DIR (GPT-2's encoder.json,
# vocab.bpe, dict.txt; default work/gpt2_bpe), ROBERTA_DIR (roberta.large, or roberta.base
# for AttendOut: model.pt; default work/roberta.*; fetched by train; FROM_SCRATCH=1: none, a
# randomly initialised model), DOWNLOADS (default work/downloads). Environment: TASK (CoLA, MRPC, RTE,
# SST-2, MNLI, QNLI, QQP, STS-B), DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl,
# doubled-batch, attendout, attendout_rdrop), TARGET_LAYERS (AttendOut modes), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, SEED,
# MAX_UPDATE, UPDATE_FREQ (the batch as GPUS x UPDATE_FREQ batches of
# batch/(GPUS x UPDATE_FREQ) sentences), GPUS (any number that divides the batch with
# UPDATE_FREQ), CPU, BF16, FP16, FAIRSEQ_BIN, PYTHON, DRY_RUN.
# Arguments after train are fairseq-hydra-train overrides (after prepare / evaluate: options
# of the Python module). A SAVE_DIR holding checkpoint_last.pt is resumed, not restarted.
source "$(dirname "$0")/lib/common.sh"

# the paper's per-task settings (rdrop_fairseq/recipes/glue_tasks.tsv): max updates, batch
# (sentences), alpha, classes, the best checkpoint's metric and its report flag
glue_task
PAPER_MAX_UPDATE=${SETTINGS[0]} BATCH=${SETTINGS[1]} CLASSES=${SETTINGS[3]}
CONFIG=roberta_glue_rdrop LR_ARGS=() CHECKPOINT_NAME=roberta.large
case ${MODE:-} in
  attendout|attendout_rdrop)
    # fairseq's roberta.base GLUE table (examples/roberta/README.glue.md): updates, batch, lr
    case $TASK in
      CoLA) AO=(5336 16 1e-05) ;;   MRPC) AO=(2296 16 1e-05) ;;  RTE) AO=(2036 16 2e-05) ;;
      SST-2) AO=(20935 32 1e-05) ;; MNLI) AO=(123873 32 1e-05) ;; QNLI) AO=(33112 32 1e-05) ;;
      QQP) AO=(113272 32 1e-05) ;;  STS-B) AO=(3598 16 2e-05) ;;
    esac
    PAPER_MAX_UPDATE=${AO[0]} BATCH=${AO[1]} LR_ARGS=("optimization.lr=[${AO[2]}]")
    CONFIG=roberta_glue_attendout CHECKPOINT_NAME=roberta.base ;;
esac
GLUE_DIR=${GLUE_DIR:-work/glue_data}
BPE_DIR=${BPE_DIR:-work/gpt2_bpe}
ROBERTA_DIR=${ROBERTA_DIR:-work/$CHECKPOINT_NAME}
DATA_DIR=${DATA_DIR:-work/glue-bin}
SAVE_DIR=${SAVE_DIR:-checkpoints/glue.$TASK.$MODE.seed$SEED}
parse_stage "$@"
make_absolute GLUE_DIR BPE_DIR ROBERTA_DIR
BIN=$DATA_DIR/$TASK-bin
detect_devices
ATTENDOUT=0
case $MODE in  # the R-Drop part of an AttendOut mode
  attendout) ATTENDOUT=1 MODE=baseline ;;
  attendout_rdrop) ATTENDOUT=1 MODE=rdrop ;;
esac
set_mode "${SETTINGS[2]}"

prepare() {
  # the inputs given are checked first, then the others are fetched
  WANTED=()
  input GLUE_DIR "$TASK/train.tsv" "GLUE_DIR must hold the GLUE tasks ($TASK/train.tsv, dev.tsv)" \
        "glue-$TASK=$GLUE_DIR/$TASK"
  input BPE_DIR encoder.json "BPE_DIR must hold GPT-2's encoder.json, vocab.bpe and dict.txt" \
        "gpt2-bpe=$BPE_DIR"
  fetch "${WANTED[@]}"
  # GPT-2 BPE, fairseq-preprocess --only-source (fairseq's preprocess_GLUE_tasks.sh)
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_glue "$TASK" --glue-dir "$GLUE_DIR" \
      --out "$DATA_DIR" --bpe-dir "$BPE_DIR" "${EXTRA[@]}"
}

train() {
  need "$BIN/input0/dict.txt" "run: TASK=$TASK bash scripts/glue.sh prepare"
  # every mode on one GPU (the paper's) or several: the plugin has fairseq gather the MCC /
  # F1 / Pearson prediction lists from the GPUs (docs/distributed.md)
  UPDATE_FREQ=${UPDATE_FREQ:-1}
  if (( DEVICES == 1 )); then
    (( BATCH % UPDATE_FREQ == 0 )) ||
      die "UPDATE_FREQ=$UPDATE_FREQ does not divide $TASK's batch of $BATCH sentences"
  else  # the batch split over the GPUs: GPUs x update-freq x batch-size
    (( BATCH % (DEVICES * UPDATE_FREQ) == 0 )) ||
      die "$DEVICES GPUs x UPDATE_FREQ=$UPDATE_FREQ do not divide $TASK's batch of" \
          "$BATCH sentences"
  fi
  local batch_size=$(( BATCH / (DEVICES * UPDATE_FREQ) * BATCH_FACTOR )) regression=false
  local max_update=${MAX_UPDATE:-$PAPER_MAX_UPDATE}
  local warmup=$(( max_update * 6 / 100 ))  # 6% of the updates, as fairseq's GLUE configs
  (( CLASSES > 1 )) || regression=true
  say "batch: $DEVICES device(s) x update-freq $UPDATE_FREQ x $batch_size sentences" \
      "= $(( DEVICES * batch_size * UPDATE_FREQ )) sentences per update (the paper's: $BATCH)"
  # RoBERTa large's measured memory: the config's max-tokens 4400 caps a batch of 512-token
  # sentences at 8, whatever the task's batch
  [ "$CONFIG" != roberta_glue_rdrop ] || memory_line 4400
  every_line
  local restore task_args=()
  if [ -f "$SAVE_DIR/checkpoint_last.pt" ] || [ "${FROM_SCRATCH:-0}" = 1 ]; then
    # resume (fairseq's default: checkpoint_last.pt, if any), nothing reset
    restore=(checkpoint.restore_file=checkpoint_last.pt checkpoint.reset_optimizer=false
             checkpoint.reset_dataloader=false checkpoint.reset_meters=false)
  else
    given ROBERTA_DIR || fetch "$CHECKPOINT_NAME=$ROBERTA_DIR"
    need "$ROBERTA_DIR/model.pt" \
         "ROBERTA_DIR must hold $CHECKPOINT_NAME/model.pt (or FROM_SCRATCH=1)"
    restore=(checkpoint.restore_file="$(realpath -m "$ROBERTA_DIR/model.pt")")
  fi
  [ -z "${SETTINGS[5]:-}" ] || task_args+=(criterion.${SETTINGS[5]}=true)
  if [ -n "${SETTINGS[5]:-}" ] && (( DEVICES > 1 )); then
    # fairseq gathers the GPUs' logging outputs (the metric's predictions) through 16 KiB
    # per GPU: about 5 KiB per batch here, times the batches of an update
    task_args+=(common.all_gather_list_size=$(( 16384 * UPDATE_FREQ )))
  fi
  if [ -n "${TARGET_LAYERS:-}" ]; then
    (( ATTENDOUT )) || die "TARGET_LAYERS is AttendOut's budget: set MODE=attendout"
    # validated from the deadline (the task's default: 40 % of the updates) on; the price
    # rises slower than the default for 12 layers (docs/attendout.md, the controls)
    task_args+=(task.attendout_target_layers="$TARGET_LAYERS"
                task.attendout_price_step=0.03
                dataset.validate_after_updates=$(( max_update * 2 / 5 )))
  fi
  # MNLI: valid = dev_matched, valid1 = dev_mismatched (quoted: hydra reads a,b as a sweep)
  [ "$TASK" != MNLI ] || task_args+=("dataset.valid_subset='valid,valid1'")
  run "$(fairseq_cli fairseq-hydra-train)" \
      --config-dir "$CONFIGS" --config-name $CONFIG \
      common.user_dir="$USER_DIR" task.data="$BIN" \
      checkpoint.save_dir="$SAVE_DIR" hydra.run.dir="$SAVE_DIR/hydra" common.seed="$SEED" \
      "${restore[@]}" task.num_classes="$CLASSES" criterion.regression_target=$regression \
      dataset.batch_size=$batch_size "optimization.update_freq=[$UPDATE_FREQ]" \
      optimization.max_update="$max_update" lr_scheduler.warmup_updates=$warmup \
      checkpoint.best_checkpoint_metric="${SETTINGS[4]}" "${LR_ARGS[@]}" \
      "${task_args[@]}" "${MODE_ARGS[@]}" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/checkpoint_best.pt" "train first: TASK=$TASK bash scripts/glue.sh train"
  local checkpoint=$SAVE_DIR/checkpoint_best.pt
  if (( ATTENDOUT )); then  # the attacker alone, its pruned layers as a mean of V
    run "$PYTHON" -m rdrop_fairseq.recipes.export_attendout --checkpoint "$checkpoint" \
        --output "$SAVE_DIR/exported.pt"
    checkpoint=$SAVE_DIR/exported.pt
  fi
  # the dev set(s) with the task's metrics (MNLI: matched and mismatched)
  run "$PYTHON" -m rdrop_fairseq.recipes.evaluate_glue "$TASK" --data "$BIN" \
      --checkpoint "$checkpoint" --glue-dir "$GLUE_DIR" --bpe-dir "$BPE_DIR" \
      --json "$SAVE_DIR/dev.json" "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

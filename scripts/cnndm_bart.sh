#!/usr/bin/env bash
# CNN/DailyMail summarization with R-Drop, the paper's table 4: BART large fine-tuned with
# alpha 0.7, 4 GPUs x 1024 tokens x update-freq 16, 20k updates.
#
#   bash scripts/cnndm_bart.sh [prepare|train|evaluate|all] [extra arguments]
#   RAW=cnn_dm BPE_DIR=gpt2_bpe BART_DIR=bart.large bash scripts/cnndm_bart.sh
#   GPUS=8 DRY_RUN=1 bash scripts/cnndm_bart.sh train       # print the commands only
#
# Inputs, each fetched into its default place unless set (docs/data.md; OFFLINE=1: none):
# RAW ({train,val,test}.{source,target}; default work/cnn_dm, made from Hugging Face's
# CNN/DailyMail 3.0.0), BPE_DIR (GPT-2's encoder.json, vocab.bpe; default work/gpt2_bpe),
# BART_DIR (bart.large: model.pt, dict.txt; default work/bart.large), DOWNLOADS (default
# work/downloads). Environment: DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl,
# doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, SEED, GPUS, CPU, BF16, FP16, UPDATE_FREQ, MAX_TOKENS, NODES,
# NODE_RANK, MASTER_ADDR, MASTER_PORT, FAIRSEQ_BIN, PYTHON, DRY_RUN.
# Arguments after train are fairseq-hydra-train overrides (after prepare / evaluate: options
# of the Python module). A SAVE_DIR holding checkpoint_last.pt is resumed, not restarted.
source "$(dirname "$0")/lib/common.sh"

RAW=${RAW:-work/cnn_dm}
BPE_DIR=${BPE_DIR:-work/gpt2_bpe}
BART_DIR=${BART_DIR:-work/bart.large}
DATA_DIR=${DATA_DIR:-work/cnn_dm-bin}
SAVE_DIR=${SAVE_DIR:-checkpoints/cnndm_bart.$MODE.seed$SEED}
parse_stage "$@"
make_absolute RAW BPE_DIR BART_DIR
BIN=$DATA_DIR/bin
detect_devices
set_mode 0.7

prepare() {
  # the inputs given are checked first, then the others are fetched
  WANTED=()
  input RAW train.source "RAW must hold the CNN/DM text: {train,val,test}.{source,target}" \
        "cnn_dailymail=$RAW"
  input BPE_DIR encoder.json "BPE_DIR must hold GPT-2's encoder.json and vocab.bpe" \
        "gpt2-bpe=$BPE_DIR"
  input BART_DIR dict.txt "BART_DIR must hold bart.large (model.pt, dict.txt)" \
        "bart.large=$BART_DIR"
  fetch "${WANTED[@]}"
  # GPT-2 BPE, then fairseq-preprocess with bart.large's dictionary (fairseq's BART README)
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_cnndm --raw "$RAW" --out "$DATA_DIR" \
      --encoder-json "$BPE_DIR/encoder.json" --vocab-bpe "$BPE_DIR/vocab.bpe" \
      --dict "$BART_DIR/dict.txt" "${EXTRA[@]}"
}

train() {
  need "$BIN/dict.source.txt" "run: bash scripts/cnndm_bart.sh prepare"
  split_batch $(( 4 * 16 * 1024 )) 1024  # the authors: 4 GPUs x 1024 tokens x update-freq 16
  loss_path bart_large_cnn_rdrop
  local restore
  if [ -f "$SAVE_DIR/checkpoint_last.pt" ]; then  # resume: fairseq's default, nothing reset
    restore=(checkpoint.restore_file=checkpoint_last.pt checkpoint.reset_optimizer=false
             checkpoint.reset_dataloader=false checkpoint.reset_meters=false)
  else  # start from bart.large, optimizer, dataloader and meters reset (the config's)
    given BART_DIR || fetch "bart.large=$BART_DIR"
    need "$BART_DIR/model.pt" "BART_DIR must hold bart.large (model.pt, dict.txt)"
    restore=(checkpoint.restore_file="$(realpath -m "$BART_DIR/model.pt")")
  fi
  # fairseq-hydra-train, run as rdrop_fairseq.fairseq_fixes: fairseq 0.12 cannot restore a
  # checkpoint into a BART built from a hydra config (the module fixes that, nothing else)
  run "$PYTHON" -m rdrop_fairseq.fairseq_fixes \
      --config-dir "$CONFIGS" --config-name bart_large_cnn_rdrop \
      common.user_dir="$USER_DIR" task.data="$BIN" \
      checkpoint.save_dir="$SAVE_DIR" hydra.run.dir="$SAVE_DIR/hydra" common.seed="$SEED" \
      dataset.max_tokens="$MAX_TOKENS" "optimization.update_freq=[$UPDATE_FREQ]" \
      "${restore[@]}" "${MODE_ARGS[@]}" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/checkpoint_best.pt" "train first: bash scripts/cnndm_bart.sh train"
  # as the authors: checkpoint_best.pt through BART's hub interface (fp16 on a GPU), beam 4,
  # lenpen 2.0, max_len_b 140, min_len 55, no repeated trigrams; ROUGE-1/2/L
  local precision=()
  [ "$GPUS" = 0 ] || [ "${FP16:-1}" = 0 ] || precision=(--fp16)
  run "$PYTHON" -m rdrop_fairseq.recipes.evaluate_summarization --data "$BIN" --raw "$RAW" \
      --checkpoint "$SAVE_DIR/checkpoint_best.pt" --encoder-json "$BPE_DIR/encoder.json" \
      --vocab-bpe "$BPE_DIR/vocab.bpe" --json "$SAVE_DIR/rouge.json" \
      "${EVAL_DEVICE[@]}" "${precision[@]}" "${EXTRA[@]}"
}

run_stages

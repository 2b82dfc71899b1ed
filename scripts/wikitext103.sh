#!/usr/bin/env bash
# WikiText-103 language modelling with R-Drop, the paper's table 5, alpha 1:
#   ARCH=gpt       transformer_lm_gpt, 8 GPUs x 2000 tokens x update-freq 16 (the authors)
#   ARCH=adaptive  adaptive input transformer_lm_wiki103, 8 GPUs x 3072 tokens x update-freq 3
#
#   bash scripts/wikitext103.sh [prepare|train|evaluate|all] [extra arguments]
#   ARCH=adaptive MODE=baseline bash scripts/wikitext103.sh train
#   GPUS=2 DRY_RUN=1 bash scripts/wikitext103.sh train      # print the commands only
#
# Environment: ARCH (gpt or adaptive; default gpt), SOURCE (wikitext-103-v1.zip or its
# directory; default: fetched into DOWNLOADS, default work/downloads: docs/data.md),
# OFFLINE, DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl, doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, SEED,
# GPUS, CPU, BF16, FP16, UPDATE_FREQ, MAX_TOKENS, NODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT, FAIRSEQ_BIN, PYTHON, DRY_RUN (docs/language-modeling.md). Arguments after train are fairseq-hydra-train overrides
# (after prepare / evaluate: options of the Python module).
source "$(dirname "$0")/lib/common.sh"

ARCH=${ARCH:-gpt}
case $ARCH in
  gpt) CONFIG=transformer_lm_gpt_rdrop ;;
  adaptive) CONFIG=transformer_lm_wiki103_rdrop ;;
  *) die "ARCH must be gpt or adaptive, not '$ARCH'" ;;
esac
MEMORY_RECIPE=wikitext103-$ARCH  # its rows of the measured memory (split_batch)
DATA_DIR=${DATA_DIR:-work/wikitext-103}
SAVE_DIR=${SAVE_DIR:-checkpoints/wikitext103.$ARCH.$MODE.seed$SEED}
parse_stage "$@"
BIN=$DATA_DIR/bin
detect_devices
set_mode 1

prepare() {
  local source=${SOURCE:-$DOWNLOADS/wikitext-103-v1.zip}
  given SOURCE || fetch wikitext-103
  # fairseq's prepare-wikitext-103.sh + fairseq-preprocess --only-source, in Python
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_wikitext --out "$DATA_DIR" \
      --source "$source" "${EXTRA[@]}"
}

train() {
  need "$BIN/dict.txt" "run: bash scripts/wikitext103.sh prepare"
  if [ "$ARCH" = gpt ]; then
    split_batch $(( 8 * 16 * 2000 )) 2000 512  # the authors: 8 GPUs x 2000 x 16
  else
    split_batch $(( 8 * 3 * 3072 )) 3072 3072  # 8 GPUs x 3072 x 3; a sample is 3072 tokens
    # the config's adaptive cut-offs (20000, 60000) need more words than that
    if [ -f "$BIN/dict.txt" ] && (( $(wc -l < "$BIN/dict.txt") + 4 <= 60000 )) &&
       [[ " ${EXTRA[*]} " != *adaptive_softmax_cutoff=* ]]; then
      die "ARCH=adaptive's cut-offs 20000,60000 need more than 60000 words;" \
          "$BIN/dict.txt has fewer: override model.adaptive_input_cutoff=\"'A,B'\"" \
          "model.adaptive_softmax_cutoff=\"'A,B'\""
    fi
  fi
  loss_path "$CONFIG"
  run "$(fairseq_cli fairseq-hydra-train)" \
      --config-dir "$CONFIGS" --config-name "$CONFIG" \
      common.user_dir="$USER_DIR" task.data="$BIN" \
      checkpoint.save_dir="$SAVE_DIR" hydra.run.dir="$SAVE_DIR/hydra" common.seed="$SEED" \
      dataset.max_tokens="$MAX_TOKENS" "optimization.update_freq=[$UPDATE_FREQ]" \
      "${MODE_ARGS[@]}" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/checkpoint_best.pt" "train first: bash scripts/wikitext103.sh train"
  # test perplexity of checkpoint_best.pt with fairseq-eval-lm. The authors' protocol
  # (their evaluate_lm_wiki103.sh: --batch-size 2 --tokens-per-sample 512 --context-window
  # 400: 112-token blocks after up to 400 tokens of context) for both models; for
  # ARCH=adaptive the model's standard protocol first (--tokens-per-sample 3072
  # --context-window 2560: blocks of at most 512 tokens after up to 2560 tokens of context;
  # the headline, test_ppl.json), the authors' beside it (test_ppl.authors.json). A --json
  # among the arguments moves both (PATH, PATH's stem.authors.json); a --protocol is an error
  local protocols=(authors)
  [ "$ARCH" = gpt ] || protocols=(adaptive authors)
  run_module "$PYTHON" -m rdrop_fairseq.recipes.evaluate_lm --protocol "${protocols[@]}" \
      --data "$BIN" --checkpoint "$SAVE_DIR/checkpoint_best.pt" --json "$SAVE_DIR/test_ppl.json" \
      "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

#!/usr/bin/env bash
# WMT14 translation with R-Drop, the paper's table 2: En->De and En->Fr with
# transformer_vaswani_wmt_en_de_big, alpha 5, 8 GPUs x 4096 tokens x update-freq 16.
#
#   bash scripts/wmt14.sh [prepare|train|evaluate|all] [extra arguments]
#   GOOGLE=wmt16_en_de_bpe32k bash scripts/wmt14.sh    # En-De on the authors' data
#   GOOGLE=regenerate bash scripts/wmt14.sh            # that data made again from statmt.org
#   PAIR=en-fr bash scripts/wmt14.sh prepare
#   GPUS=4 DRY_RUN=1 bash scripts/wmt14.sh train     # fp16, update-freq 32: print only
#
# Environment: PAIR (en-de or en-fr; default en-de), GOOGLE (En-De: the folder Google's
# preprocessed WMT'16 En-De, wmt16_en_de.tar.gz, was extracted in: the authors' data, no live
# source; or "regenerate": made again from its statmt.org archives with google/seq2seq's
# steps, which docs/data.md compares; set it for every stage), ORIG (the folder holding the
# official archives, used as it is; default: wmt14-orig beside DATA_DIR, shared by both
# pairs, where they are fetched), OFFLINE, DATA_DIR, SAVE_DIR, MODE
# (rdrop, baseline, no-kl, doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, SEED, GPUS, CPU, BF16, FP16, UPDATE_FREQ,
# MAX_TOKENS, NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, AVERAGE (default 0: test
# checkpoint_best.pt, as the authors; N: the average of the last N epoch checkpoints, as
# fairseq's Scaling NMT recipe with 10), FAIRSEQ_BIN, PYTHON, DRY_RUN (docs/translation.md).
# Arguments after train are fairseq-hydra-train overrides (after prepare / evaluate: options
# of the Python module).
source "$(dirname "$0")/lib/common.sh"

PAIR=${PAIR:-en-de}
case $PAIR in
  en-de|en-fr) ;;
  *) die "PAIR must be en-de or en-fr (the paper's WMT14 directions), not '$PAIR'" ;;
esac
SRC=${PAIR%-*} TGT=${PAIR#*-}
DATA_NAME=wmt14.$PAIR
if [ -n "${GOOGLE:-}" ]; then
  [ "$PAIR" = en-de ] || die "GOOGLE is Google's WMT'16 En-De: PAIR=en-de, not $PAIR"
  DATA_NAME=wmt16-google.en-de
  [ "$GOOGLE" != regenerate ] || DATA_NAME=wmt16-regenerated.en-de
fi
DATA_DIR=${DATA_DIR:-work/$DATA_NAME}
SAVE_DIR=${SAVE_DIR:-checkpoints/$DATA_NAME.$MODE.seed$SEED}
AVERAGE=${AVERAGE:-0}  # 0: checkpoint_best.pt
[[ $AVERAGE =~ ^[0-9]+$ ]] || die "AVERAGE must be a number of epoch checkpoints (0: none)," \
                                  "not '$AVERAGE'"
parse_stage "$@"
BIN=$DATA_DIR/bin
detect_devices
set_mode 5

prepare() {
  local orig=${ORIG:-$(dirname "$DATA_DIR")/wmt14-orig} into=()
  ! given ORIG || into=(--extract-to "$(dirname "$DATA_DIR")/wmt14-extracted")
  if [ "${GOOGLE:-}" = regenerate ]; then
    # Google's WMT'16 En-De made again (tokenised, cleaned, BPE'd text in Google's file
    # names beside DATA_DIR), then binarised as below
    given ORIG || fetch_into "$orig" europarl-v7-de-en wmt13-commoncrawl wmt16-nc-v11 \
                                     wmt16-dev wmt16-test
    run "$PYTHON" -m rdrop_fairseq.recipes.prepare_wmt14 \
        --google "$(dirname "$DATA_DIR")/wmt16_en_de_regenerated" --regenerate-from "$orig" \
        "${into[@]}" --out "$DATA_DIR" "${EXTRA[@]}"
    return
  fi
  if [ -n "${GOOGLE:-}" ]; then
    # the authors' data: Google's WMT'16 En-De binarised as fairseq's Scaling NMT recipe
    need "$GOOGLE" "GOOGLE must be the folder wmt16_en_de.tar.gz was extracted in"
    run "$PYTHON" -m rdrop_fairseq.recipes.prepare_wmt14 --google "$GOOGLE" \
        --out "$DATA_DIR" "${EXTRA[@]}"
    return
  fi
  if ! given ORIG; then  # the archives from statmt.org (their checksums are TFDS's)
    local archives=(wmt13-europarl-v7 wmt13-commoncrawl wmt17-nc-v12 wmt14-test-full)
    [[ " ${EXTRA[*]} " != *" --icml17 "* ]] || archives[2]=wmt14-nc-v9
    [ "$PAIR" = en-de ] || archives=(wmt13-europarl-v7 wmt13-commoncrawl wmt13-un wmt14-nc-v9
                                     wmt10-giga-fren wmt14-test-full)
    fetch_into "$orig" "${archives[@]}"
  fi
  # fairseq's prepare-wmt14en2{de,fr}.sh in Python: Moses normalisation and tokenisation
  # (aggressive hyphen splitting), ~32k joint BPE, newstest2014 as the test set
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_wmt14 --pair "$PAIR" \
      --orig "$orig" "${into[@]}" --out "$DATA_DIR" "${EXTRA[@]}"
}

train() {
  need "$BIN/dict.$SRC.txt" "run: PAIR=$PAIR bash scripts/wmt14.sh prepare"
  split_batch $(( 8 * 16 * 4096 )) 4096  # the paper: 8 GPUs x 4096 tokens x update-freq 16
  loss_path transformer_wmt14_big_rdrop
  run "$(fairseq_cli fairseq-hydra-train)" \
      --config-dir "$CONFIGS" --config-name transformer_wmt14_big_rdrop \
      common.user_dir="$USER_DIR" task.data="$BIN" \
      task.source_lang="$SRC" task.target_lang="$TGT" \
      checkpoint.save_dir="$SAVE_DIR" hydra.run.dir="$SAVE_DIR/hydra" common.seed="$SEED" \
      dataset.max_tokens="$MAX_TOKENS" "optimization.update_freq=[$UPDATE_FREQ]" \
      "${MODE_ARGS[@]}" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  local checkpoint=$SAVE_DIR/checkpoint_best.pt
  if [ "$AVERAGE" -gt 0 ]; then
    # the average of the last epoch checkpoints (fairseq's Scaling NMT recipe: 10)
    checkpoint=$SAVE_DIR/checkpoint.avg$AVERAGE.pt
    need "$SAVE_DIR" "train first: PAIR=$PAIR bash scripts/wmt14.sh train"
    run "$PYTHON" -m rdrop_fairseq.recipes.average_checkpoints --inputs "$SAVE_DIR" \
        --num-epoch-checkpoints "$AVERAGE" --output "$checkpoint"
  fi
  need "$checkpoint" "train first: PAIR=$PAIR bash scripts/wmt14.sh train"
  # fairseq-generate --remove-bpe, En->De beam 4 / lenpen 0.6 (the paper; the authors in
  # their issue #19), En->Fr beam 5 / lenpen 1.0 (the paper's setting for the other tasks);
  # tokenized BLEU (En->De with compound splitting, fairseq's compound_split_bleu.sh), the
  # other BLEUs of the same output beside it
  run_module "$PYTHON" -m rdrop_fairseq.recipes.evaluate_translation wmt14 --data "$BIN" \
      --src "$SRC" --tgt "$TGT" --checkpoint "$checkpoint" "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

#!/usr/bin/env bash
# IWSLT translation with R-Drop, the paper's table 1: IWSLT14 De<->En, En<->Fr, En<->Es and
# IWSLT17 En<->Zh; transformer_iwslt_de_en, alpha 5, 1 GPU x 4096 tokens per update.
#
#   bash scripts/iwslt14.sh [prepare|train|evaluate|all] [extra arguments]
#   SRC=en TGT=de bash scripts/iwslt14.sh                 # En->De, from the same archive
#   SRC=en TGT=fr ARCHIVE=en-fr.tgz bash scripts/iwslt14.sh prepare
#   MODE=baseline SEED=2 bash scripts/iwslt14.sh train optimization.max_update=100000
#   GPUS=4 DRY_RUN=1 bash scripts/iwslt14.sh train        # print the commands only
#
# Environment: SRC, TGT (default de, en), ARCHIVE (the pair's IWSLT archive, a path or URL;
# default for De<->En: fetched from fairseq's IWSLT14 mirror into DOWNLOADS, for En<->Zh from
# the Hugging Face hub's IWSLT17 zip; En<->Fr and En<->Es have no live source: docs/data.md),
# OFFLINE, DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl, doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN, SEED,
# GPUS, CPU, BF16, FP16, UPDATE_FREQ, MAX_TOKENS, NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# FAIRSEQ_BIN, PYTHON, DRY_RUN (docs/translation.md).
# Arguments after train are fairseq-hydra-train overrides (after prepare / evaluate: options
# of the Python module).
source "$(dirname "$0")/lib/common.sh"

SRC=${SRC:-de}
TGT=${TGT:-en}
case "$SRC-$TGT" in
  de-en|en-de|en-fr|fr-en|en-es|es-en) YEAR=14 ;;
  en-zh|zh-en) YEAR=17 ;;  # separate dictionaries (sentencepiece per language)
  *) die "SRC=$SRC TGT=$TGT is not one of the paper's IWSLT directions:" \
         "de-en, en-fr, en-es, en-zh (either way)" ;;
esac
DATA_DIR=${DATA_DIR:-work/iwslt$YEAR.$SRC-$TGT}
SAVE_DIR=${SAVE_DIR:-checkpoints/iwslt$YEAR.$SRC-$TGT.$MODE.seed$SEED}
parse_stage "$@"
BIN=$DATA_DIR/bin
detect_devices
set_mode 5

prepare() {
  local archive=${ARCHIVE:-}
  if [ -z "$archive" ]; then
    # the table's archive of the pair (De<->En: fairseq's mirror; En<->Zh: the Hugging Face
    # hub's zip; the others are manual)
    local pair=$SRC-$TGT ext=tgz
    [[ $pair == en-* ]] || pair=$TGT-$SRC
    [ "$pair" != en-de ] || pair=de-en
    [ "$YEAR" != 17 ] || ext=zip
    fetch "iwslt$YEAR-$pair"
    archive=$DOWNLOADS/$pair.$ext
  fi
  # Moses tokenisation, lower-casing (De<->En only), joint BPE (10k merges),
  # fairseq-preprocess (En-Zh: sentencepiece, separate dictionaries)
  run "$PYTHON" -m rdrop_fairseq.recipes.prepare_iwslt --archive "$archive" \
      --src "$SRC" --tgt "$TGT" --out "$DATA_DIR" "${EXTRA[@]}"
}

train() {
  need "$BIN/dict.$SRC.txt" "run: bash scripts/iwslt14.sh prepare"
  split_batch 4096 4096  # the paper: 1 GPU x 4096 tokens x update-freq 1
  loss_path transformer_iwslt_de_en_rdrop
  local data_args=()
  if [ "$YEAR" = 17 ]; then
    # separate dictionaries cannot share all embeddings; sentencepiece decoding for the
    # validation BLEU; sacreBLEU's default tokenisation cannot score Chinese, so a Chinese
    # target picks checkpoint_best.pt by validation loss
    data_args+=(++model.share_all_embeddings=false ++model.share_decoder_input_output_embed=true
                ++task.eval_bleu_remove_bpe=sentencepiece ++task.eval_bleu_detok=space)
    [ "$TGT" != zh ] || data_args+=(++task.eval_bleu=false ++checkpoint.best_checkpoint_metric=loss
                                    ++checkpoint.maximize_best_checkpoint_metric=false)
  fi
  run "$(fairseq_cli fairseq-hydra-train)" \
      --config-dir "$CONFIGS" --config-name transformer_iwslt_de_en_rdrop \
      common.user_dir="$USER_DIR" task.data="$BIN" \
      task.source_lang="$SRC" task.target_lang="$TGT" \
      checkpoint.save_dir="$SAVE_DIR" hydra.run.dir="$SAVE_DIR/hydra" common.seed="$SEED" \
      dataset.max_tokens="$MAX_TOKENS" "optimization.update_freq=[$UPDATE_FREQ]" \
      "${MODE_ARGS[@]}" "${DEVICE_ARGS[@]}" "${data_args[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/checkpoint_best.pt" "train first: bash scripts/iwslt14.sh train"
  # as the authors' run_inference.sh: checkpoint_best.pt, fairseq-generate --beam 5
  # --remove-bpe (lenpen 1), De<->En scored as their compound_split_bleu.sh (tokenized BLEU
  # with compound splitting: the headline); the other pairs with sacreBLEU against the
  # original references in DATA_DIR/raw (case-sensitive, unless the data was prepared
  # lower-cased, as De<->En by default: the data-bin's prepared.json says so)
  run_module "$PYTHON" -m rdrop_fairseq.recipes.evaluate_translation iwslt --data "$BIN" \
      --src "$SRC" --tgt "$TGT" --checkpoint "$SAVE_DIR/checkpoint_best.pt" \
      "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

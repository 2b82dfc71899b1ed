#!/usr/bin/env bash
# Image classification with R-Drop on ViT through Hugging Face, the paper's appendix A.5:
# ViT-B/16 or ViT-L/16 pre-trained on ImageNet-21k fine-tuned on CIFAR-100 or ImageNet with
# RDropTrainer (rdrop_fairseq.hf), on all of the node's GPUs (torchrun), with the ViT
# paper's fine-tuning (SGD with momentum 0.9, 512 images per update, a cosine schedule after
# 500 warm-up updates, the gradients clipped at norm 1, no weight decay, 384 x 384 images)
# and the R-Drop paper's dropout 0.1; scored by top-1 accuracy on the test split (ImageNet's:
# val). The settings: rdrop_fairseq/recipes/vit_settings.tsv (docs/vision.md says whose
# each is).
#
#   bash scripts/vit.sh [prepare|train|evaluate|all] [extra arguments]
#   MODEL=large MODE=baseline SEED=2 bash scripts/vit.sh train
#   DATASET=imagenet IMAGENET_DIR=/data/imagenet bash scripts/vit.sh prepare
#   GPUS=4 DRY_RUN=1 bash scripts/vit.sh train      # print the commands only
#
# Inputs, each fetched into its default place unless set (docs/data.md; OFFLINE=1: none):
# CIFAR_DIR (CIFAR-100's train, test and meta: the tarball's cifar-100-python folder;
# default work/cifar-100-python),
# IMAGENET_DIR (DATASET=imagenet: a folder holding train/ and val/, one folder of images
# per class in each; never fetched: ImageNet needs an account), VIT_DIR (a Hugging Face ViT
# folder, config.json and model.safetensors; default work/vit-MODEL-patch16-224-in21k,
# fetched by train), DOWNLOADS. Environment: DATASET (cifar100, imagenet), MODEL (base,
# large), DATA_DIR, SAVE_DIR, MODE (rdrop, baseline, no-kl, doubled-batch), ALPHA, RDROP_EVERY, RDROP_PASS_MEAN,
# AUTHORS_CODE (1: alpha = 0.6 x the per-device batch, the KL scale of the R-Drop authors'
# ViT code), SEED, MAX_UPDATE, IMAGE_SIZE, UPDATE_FREQ and DEVICE_BATCH (the batch as
# UPDATE_FREQ steps of DEVICE_BATCH images on each GPU), GPUS, NODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, CPU, BF16, FP16, PYTHON, DRY_RUN. Arguments after train are
# Hugging Face TrainingArguments (--learning_rate 0.01); after prepare / evaluate, options
# of the Python module. Rerunning train resumes from the last checkpoint-N of SAVE_DIR.
source "$(dirname "$0")/lib/common.sh"

DATASET=${DATASET:-cifar100}
MODEL=${MODEL:-base}

# SET[column]: the row of rdrop_fairseq/recipes/vit_settings.tsv for DATASET and MODEL
declare -A SET
vit_settings() {
  local table=$REPO/rdrop_fairseq/recipes/vit_settings.tsv names values datasets i
  datasets=$(awk -F'\t' '!/^#/ && $1 != "dataset" { print $1 }' "$table" | sort -u | paste -sd' ')
  [[ " $datasets " == *" $DATASET "* ]] ||
    die "DATASET must be ${datasets// / or }, not '$DATASET'"
  IFS=$'\t' read -r -a names < <(grep -v '^#' "$table" | head -n 1)
  IFS=$'\t' read -r -a values < <(awk -F'\t' '$1 == d && $2 == m' d="$DATASET" m="$MODEL" \
                                       "$table") || true
  (( ${#values[@]} )) || die "MODEL must be base or large (ViT-B/16, ViT-L/16), not '$MODEL'"
  for i in "${!names[@]}"; do SET[${names[$i]}]=${values[$i]}; done
}
vit_settings

CIFAR_DIR=${CIFAR_DIR:-work/cifar-100-python}
IMAGENET_DIR=${IMAGENET_DIR:-work/imagenet}  # no source serves it: prepare says what to do
VIT_DIR=${VIT_DIR:-work/${SET[source]}}
DATA_DIR=${DATA_DIR:-work/vit}
SAVE_DIR=${SAVE_DIR:-checkpoints/vit.$DATASET.$MODEL.$MODE.seed$SEED}
IMAGE_SIZE=${IMAGE_SIZE:-${SET[image_size]}}
[[ $IMAGE_SIZE =~ ^[1-9][0-9]*$ ]] ||
  die "IMAGE_SIZE must be a whole number >= 1, not '$IMAGE_SIZE'"
parse_stage "$@"
make_absolute CIFAR_DIR IMAGENET_DIR VIT_DIR
BIN=$DATA_DIR/$DATASET  # the prepared dataset (run_stages: all skips prepare when it is there)
detect_devices
set_mode "${SET[alpha]}"  # checks MODE and ALPHA; BATCH_FACTOR 2 for doubled-batch

VIT_FILES="a Hugging Face ViT folder (config.json, model.safetensors or pytorch_model.bin)"
VIT_FILES+=" such as ${SET[source]}; docs/data.md says where it comes from"
IMAGENET_LAYOUT="a folder holding train/ and val/, one folder of images per class in each"
IMAGENET_LAYOUT+=" (val/ sorted into the classes' folders)"
CIFAR_FILES="CIFAR-100's train, test and meta (the tarball's cifar-100-python folder)"

prepare() {
  # the input given is checked first, then fetched if not given (ImageNet never is)
  WANTED=()
  if [ "$DATASET" = cifar100 ]; then
    input CIFAR_DIR train "CIFAR_DIR must hold $CIFAR_FILES" "cifar-100=$CIFAR_DIR"
  else
    input IMAGENET_DIR train "IMAGENET_DIR must be $IMAGENET_LAYOUT" "imagenet-2012=$IMAGENET_DIR"
  fi
  fetch "${WANTED[@]}"
  local source_args=(--cifar-dir "$CIFAR_DIR")
  if [ "$DATASET" = imagenet ]; then
    need "$IMAGENET_DIR/val" "IMAGENET_DIR must be $IMAGENET_LAYOUT"
    source_args=(--imagenet-dir "$IMAGENET_DIR")
  fi
  run "$PYTHON" -m rdrop_fairseq.recipes.vit prepare "$DATASET" "${source_args[@]}" \
      --out "$BIN" "${EXTRA[@]}"
}

train() {
  need "$BIN/meta.json" "run: DATASET=$DATASET bash scripts/vit.sh prepare"
  given VIT_DIR || fetch "${SET[source]}=$VIT_DIR"
  need "$VIT_DIR/config.json" "VIT_DIR must be $VIT_FILES"
  # the recipe's 512 images per update over the GPUs: DEVICES x UPDATE_FREQ x DEVICE_BATCH
  split_examples "${SET[batch]}" "${SET[device_batch]}"
  local mode_args=(--mode "$MODE") alpha=${ALPHA:-${SET[alpha]}}
  if [ "${AUTHORS_CODE:-0}" = 1 ]; then
    [ "$MODE" = rdrop ] || die "AUTHORS_CODE=1 sets R-Drop's alpha: it goes with MODE=rdrop"
    [ -z "${ALPHA:-}" ] ||
      die "AUTHORS_CODE=1 sets alpha (0.6 x the per-device batch): leave out ALPHA=$ALPHA"
    # their KL, weighted 0.3 in each direction and summed over each GPU's batch beside
    # mean cross-entropies, is alpha = 2 x 0.3 x B here (docs/vision.md)
    alpha=$(awk -v b="$DEVICE_BATCH" 'BEGIN { print 0.6 * b }')
    say "AUTHORS_CODE=1: alpha = 0.6 x $DEVICE_BATCH images per device = $alpha"
  fi
  [ "$MODE" != rdrop ] || mode_args+=(--alpha "$alpha")
  [ "$RDROP_EVERY" = 1 ] || mode_args+=(--rdrop-every "$RDROP_EVERY")
  [ "$RDROP_PASS_MEAN" = 0 ] || mode_args+=(--rdrop-pass-mean)
  every_line
  # fp16 on GPUs as the authors' ViT code offers (apex AMP, O2)
  trainer_device_args
  # one process per GPU (torchrun); one GPU or the CPU: this process
  local launch=("$PYTHON")
  if (( DEVICES > 1 )); then
    launch+=(-m torch.distributed.run --nproc_per_node "$GPUS")
    if (( NODES > 1 )); then
      launch+=(--nnodes "$NODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
               --master_port "$MASTER_PORT")
    else
      launch+=(--standalone)
    fi
  fi
  run "${launch[@]}" -m rdrop_fairseq.recipes.vit train "$DATASET" --data "$BIN" \
      --vit-dir "$VIT_DIR" "${mode_args[@]}" --image-size "$IMAGE_SIZE" \
      --dropout "${SET[dropout]}" --attention-dropout "${SET[attention_dropout]}" \
      --momentum "${SET[momentum]}" -- \
      --output_dir "$SAVE_DIR" --seed "$SEED" --max_steps "${MAX_UPDATE:-${SET[max_update]}}" \
      --per_device_train_batch_size "$DEVICE_BATCH" --gradient_accumulation_steps "$UPDATE_FREQ" \
      --learning_rate "${SET[lr]}" --lr_scheduler_type "${SET[schedule]}" \
      --warmup_steps "${SET[warmup]}" --weight_decay "${SET[weight_decay]}" \
      --max_grad_norm "${SET[clip]}" "${HF_DEVICE_ARGS[@]}" "${EXTRA[@]}"
}

evaluate() {
  need "$SAVE_DIR/final/vit.json" \
       "train first: DATASET=$DATASET MODEL=$MODEL bash scripts/vit.sh train"
  # top-1 accuracy on the test split (ImageNet: val), each image resized whole
  run "$PYTHON" -m rdrop_fairseq.recipes.vit evaluate "$DATASET" --data "$BIN" \
      --save-dir "$SAVE_DIR" --json "$SAVE_DIR/top1.json" "${EVAL_DEVICE[@]}" "${EXTRA[@]}"
}

run_stages

# What the recipe scripts (scripts/*.sh) share; sourced by them, not run on its own. It
# holds no fairseq command line: those stay in each recipe script, readable. Here: the
# stage argument, the environment (GPUs, precision, MODE, seed), the split of the paper's
# batch over the GPUs, DRY_RUN, and the checks of a stage's inputs.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONFIGS=$REPO/configs
USER_DIR=$REPO/rdrop_fairseq  # the plugin, for --user-dir
# the Python of the recipes' modules, resolved once: a dry run prints what a real run runs
PYTHON=$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")
[[ $PYTHON != */* ]] || PYTHON=$(realpath -ms "$PYTHON")  # absolute, symlinks kept (a venv's)
RECIPE=$(basename "$0" .sh)
MODE=${MODE:-rdrop}
SEED=${SEED:-1}
NODES=${NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}

# -h / --help: the recipe script's header comment
case ${1:-} in -h|--help) sed -n '2,/^source/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac

die() { echo "error: $*" >&2; exit 1; }
say() { echo "[$RECIPE] $*"; }

# The numeric variables, checked before anything runs or is created (not by hydra, after
# its run directory exists): ALPHA a finite number >= 0; SEED, MAX_UPDATE, UPDATE_FREQ,
# DEVICE_BATCH, RDROP_EVERY whole numbers (all but SEED >= 1).
[ -z "${ALPHA:-}" ] || [[ $ALPHA =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] ||
  die "ALPHA must be a number >= 0 (R-Drop's KL weight), not '$ALPHA'"
[[ $SEED =~ ^[0-9]+$ ]] || die "SEED must be a whole number, not '$SEED'"
for var in MAX_UPDATE UPDATE_FREQ DEVICE_BATCH RDROP_EVERY; do
  [ -z "${!var:-}" ] || [[ ${!var} =~ ^[1-9][0-9]*$ ]] ||
    die "$var must be a whole number >= 1, not '${!var}'"
done

# RDROP_EVERY K: R-Drop on one optimizer update in K (the paper's k-step R-Drop), the
# others one pass with the task's own loss; 1 (default): every update
RDROP_EVERY=${RDROP_EVERY:-1}
# RDROP_PASS_MEAN 1: an R-Drop update's loss is the mean of its two passes' (a one-pass
# update's scale) instead of their sum (0, the default: the paper's)
RDROP_PASS_MEAN=${RDROP_PASS_MEAN:-0}
[[ $RDROP_PASS_MEAN =~ ^[01]$ ]] || die "RDROP_PASS_MEAN must be 0 or 1, not '$RDROP_PASS_MEAN'"

# Print a command (as it could be pasted into a shell); run it unless DRY_RUN=1.
run() {
  local line
  printf -v line ' %q' "$@"
  echo "+${line}"
  [ "${DRY_RUN:-0}" = 1 ] || "$@"
}

# run for a recipe module that runs fairseq's CLIs (the evaluate stages): with DRY_RUN=1
# the module runs too, in its own dry run: it checks its arguments, prints the commands it
# would run, "++ " first, and runs none (so the dry run needs $PYTHON's environment).
run_module() {
  run "$@"
  [ "${DRY_RUN:-0}" = 1 ] || return 0
  DRY_RUN=1 "$@" || die "the dry run of $3 failed (its messages are above)"
}

# The path of fairseq's CLI $1: in $FAIRSEQ_BIN if set, else beside $PYTHON (the
# environment of the recipe modules), else found on PATH; the dry run prints the same path
# as the real run. The recipe modules find their CLIs by the same rule
# (rdrop_fairseq/recipes/common.py), so training and evaluation run the same fairseq.
fairseq_cli() {
  if [ -n "${FAIRSEQ_BIN:-}" ]; then
    echo "$FAIRSEQ_BIN/$1"
  elif [ -x "$(dirname "$PYTHON")/$1" ]; then
    echo "$(dirname "$PYTHON")/$1"
  elif command -v "$1" >/dev/null; then
    command -v "$1"
  elif [ "${DRY_RUN:-0}" = 1 ]; then
    echo "$1"
  else
    die "$1 not found on PATH: activate the environment fairseq is installed in, or set FAIRSEQ_BIN"
  fi
}

# The inputs the user set (SOURCE, ARCHIVE, ORIG, RAW, GLUE_DIR, ...) are used as they are:
# nothing is ever downloaded into them. The others are fetched into their default places
# by the stage that needs them, through the source table (rdrop_fairseq/recipes/
# sources.json; RDROP_SOURCES replaces it): resumed after a cut, checksum-verified, with
# progress. OFFLINE=1 fetches nothing and names what is missing; a dry run prints the URLs.
GIVEN=" "
for var in SOURCE ARCHIVE ORIG RAW GLUE_DIR BPE_DIR ROBERTA_DIR BART_DIR BERT_DIR CIFAR_DIR \
           IMAGENET_DIR VIT_DIR; do
  [ -z "${!var:-}" ] || GIVEN+="$var "
done
given() { [[ $GIVEN == *" $1 "* ]]; }
DOWNLOADS=$(realpath -m "${DOWNLOADS:-work/downloads}")

# fetch_into DIR NAME[=DEST] ...: the named sources' files into DIR (and DEST made from them)
fetch_into() {
  local dir=$1
  shift
  (( $# )) || return 0
  run_module "$PYTHON" -m rdrop_fairseq.recipes.fetch --dir "$dir" "$@"
}
# fetch NAME[=DEST] ...: the same, the downloads kept in $DOWNLOADS (default work/downloads)
fetch() { fetch_into "$DOWNLOADS" "$@"; }

# input VAR FILE ADVICE NAME=DEST: a VAR the user set must hold FILE (else a one-line error
# with ADVICE, before anything is fetched); an unset one is added to WANTED, for fetch
input() {
  if given "$1"; then need "${!1}/$2" "$3"; else WANTED+=("$4"); fi
}

# A stage's input $1 must exist; $2 says how to make it. A dry run only notes it.
need() {
  [ -e "$1" ] && return 0
  [ "${DRY_RUN:-0}" = 1 ] && { echo "[$RECIPE] (dry run: $1 missing)" >&2; return 0; }
  die "$1 not found: $2"
}

# Stages: the first argument (prepare, train, evaluate or all; default all). The arguments
# after it (EXTRA) go to that stage's command: hydra overrides for fairseq-hydra-train in
# train (and all), options of the Python module in prepare and evaluate. Makes DATA_DIR
# and SAVE_DIR absolute.
parse_stage() {
  STAGE=${1:-all}
  case $STAGE in
    prepare|train|evaluate|all) ;;
    *) die "unknown stage '$STAGE': give prepare, train, evaluate or all (default)" ;;
  esac
  shift $(( $# > 0 ? 1 : 0 ))
  EXTRA=("$@")
  # absolute: fairseq-hydra-train runs in its hydra.run.dir
  DATA_DIR=$(realpath -m "$DATA_DIR")
  SAVE_DIR=$(realpath -m "$SAVE_DIR")
}

# Make the variables named $@ absolute paths (what the commands print is what they use).
make_absolute() {
  local var
  for var; do printf -v "$var" '%s' "$(realpath -ms "${!var}")"; done
}

# Run the stages asked for, with the recipe's prepare / train / evaluate functions; all
# skips prepare when the data-bin (BIN) is there already.
run_stages() {
  case $STAGE in
    all) local extra=("${EXTRA[@]}")
         EXTRA=()
         if [ -e "$BIN" ]; then
           say "prepare: $BIN is there already (the prepare stage alone makes it again)"
         else
           prepare
         fi
         EXTRA=("${extra[@]}"); train; EXTRA=(); evaluate ;;
    *) "$STAGE" ;;
  esac
}

# GPUS: the GPUs per node (default: CUDA_VISIBLE_DEVICES's, else nvidia-smi's count; 0 or
# CPU=1: the CPU). Sets DEVICE_ARGS (hydra overrides: device, precision, distributed
# training), EVAL_DEVICE (--cpu or nothing) and DEVICES (the data-parallel workers over all
# nodes).
# fp16 on GPUs as the authors trained (BF16=1: bf16; FP16=0: fp32): PRECISION (fp16, bf16,
# fp32; empty on the CPU). GPU_MEMORY_MIB: the smallest GPU's memory (nvidia-smi), if known.
# Several nodes: fairseq's own --distributed-* (fairseq spawns one process per GPU of the
# node), the same command on every node with its NODE_RANK.
detect_devices() {
  if [ -z "${GPUS:-}" ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
      GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)
    elif command -v nvidia-smi >/dev/null; then
      GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    else
      GPUS=0
    fi
  fi
  [[ $GPUS =~ ^[0-9]+$ ]] || die "GPUS must be a number of GPUs (0: the CPU), not '$GPUS'"
  [ "${CPU:-0}" = 1 ] && GPUS=0
  PRECISION="" GPU_MEMORY_MIB=""
  if [ "$GPUS" = 0 ]; then
    [ "$NODES" = 1 ] || die "NODES=$NODES needs GPUs (GPUS=0 or CPU=1 trains on this CPU only)"
    DEVICES=1
    DEVICE_ARGS=(common.cpu=true distributed_training.distributed_world_size=1)
    EVAL_DEVICE=(--cpu)  # for the evaluation modules
    return
  fi
  if [ "${DRY_RUN:-0}" != 1 ] && ! "$PYTHON" -c "import sys, torch
sys.exit(torch.cuda.device_count() < $GPUS)" 2>/dev/null; then
    die "GPUS=$GPUS but $PYTHON's torch sees fewer CUDA devices" \
        "($("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo "no torch"));" \
        "GPUS=0 trains on the CPU"
  fi
  DEVICES=$(( GPUS * NODES ))
  EVAL_DEVICE=()
  DEVICE_ARGS=(distributed_training.distributed_world_size=$DEVICES)
  PRECISION=fp32
  if [ "${BF16:-0}" = 1 ]; then
    DEVICE_ARGS+=(common.bf16=true) PRECISION=bf16
  elif [ "${FP16:-1}" = 1 ]; then
    DEVICE_ARGS+=(common.fp16=true) PRECISION=fp16
  fi
  if command -v nvidia-smi >/dev/null; then
    GPU_MEMORY_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
                     2>/dev/null | grep -E '^ *[0-9]+ *$' | sort -n | head -n 1 | tr -d ' ' || true)
  fi
  if [ "$NODES" -gt 1 ]; then
    [ -n "${MASTER_ADDR:-}" ] || die "NODES=$NODES needs MASTER_ADDR (the address of node 0)"
    (( NODE_RANK >= 0 && NODE_RANK < NODES )) || die "NODE_RANK must be 0 to $(( NODES - 1 ))"
    DEVICE_ARGS+=("distributed_training.distributed_init_method=tcp://$MASTER_ADDR:$MASTER_PORT"
                  distributed_training.distributed_rank=$(( NODE_RANK * GPUS )))
  fi
}

# trainer_device_args: HF_DEVICE_ARGS, Hugging Face TrainingArguments' flags for the device
# and precision detect_devices chose (--use_cpu on the CPU; --bf16 or --fp16 on GPUs, as
# PRECISION says): the Hugging Face recipes' counterpart of DEVICE_ARGS.
trainer_device_args() {
  case ${PRECISION:-} in
    "") HF_DEVICE_ARGS=(--use_cpu) ;;
    bf16) HF_DEVICE_ARGS=(--bf16) ;;
    fp16) HF_DEVICE_ARGS=(--fp16) ;;
    *) HF_DEVICE_ARGS=() ;;
  esac
}

# MODE: rdrop (the paper's alpha, or ALPHA), baseline (alpha 0: exactly fairseq's parent
# criterion), no-kl (alpha 0, two passes: appendix C.2), doubled-batch (the baseline with
# twice the batch: R-Drop's compute without the KL, appendix C.1). $1: the paper's alpha.
# Sets MODE_ARGS (hydra overrides; RDROP_EVERY's where it is not 1, RDROP_PASS_MEAN's
# where it is 1) and BATCH_FACTOR.
set_mode() {
  BATCH_FACTOR=1
  if [ "$MODE" != rdrop ] && [ -n "${ALPHA:-}" ] && [ "${ALPHA}" != 0 ]; then
    die "ALPHA=$ALPHA contradicts MODE=$MODE, which has no KL term"
  fi
  case $MODE in
    rdrop) MODE_ARGS=(criterion.rdrop_alpha=${ALPHA:-$1}) ;;
    baseline) MODE_ARGS=(criterion.rdrop_alpha=0) ;;
    no-kl) MODE_ARGS=(criterion.rdrop_alpha=0 ++criterion.rdrop_two_passes=true) ;;
    doubled-batch) MODE_ARGS=(criterion.rdrop_alpha=0); BATCH_FACTOR=2 ;;
    *) die "MODE must be rdrop, baseline, no-kl or doubled-batch, not '$MODE'" ;;
  esac
  if [ "$RDROP_EVERY" != 1 ]; then
    case $MODE in
      rdrop|no-kl) MODE_ARGS+=(++criterion.rdrop_every=$RDROP_EVERY) ;;
      *) die "RDROP_EVERY=$RDROP_EVERY is R-Drop's period, and MODE=$MODE runs no R-Drop" ;;
    esac
  fi
  if [ "$RDROP_PASS_MEAN" = 1 ]; then
    case $MODE in
      rdrop|no-kl) MODE_ARGS+=(++criterion.rdrop_pass_mean=true) ;;
      *) die "RDROP_PASS_MEAN=1 scales R-Drop's updates, and MODE=$MODE runs no R-Drop" ;;
    esac
  fi
}

# every_line: say, in the train stage's output (dry run too), how often R-Drop runs
every_line() {
  case $MODE in baseline|doubled-batch) return ;; esac
  if [ "$RDROP_EVERY" = 1 ]; then
    say "R-Drop on every update (RDROP_EVERY=1)"
  else
    say "R-Drop on one update in $RDROP_EVERY (RDROP_EVERY=$RDROP_EVERY): updates 0," \
        "$RDROP_EVERY, $(( 2 * RDROP_EVERY )), ... run both passes, the others one pass" \
        "with the task's own loss (docs/rdrop-every.md)"
  fi
  if [ "$RDROP_PASS_MEAN" = 1 ]; then
    say "an R-Drop update's loss: the mean of its two passes' (RDROP_PASS_MEAN=1)"
  fi
}

# loss_path CONFIG: say which R-Drop loss path the training runs, and why: the config's
# rdrop_fused_linear (configs/CONFIG.yaml; the recipes' default is false, the logits path,
# the one measured on a GPU) or the user's override among the train arguments (EXTRA).
# The logits path: the fused loss over the 2N x V logits (rdrop_impl auto: the Triton
# kernel on CUDA, chunked torch ops elsewhere). The fused-linear path: the loss from the
# decoder's features and output projection, no logits (docs/benchmarks.md).
loss_path() {
  local config=$CONFIGS/$1.yaml arg criterion fused impl=auto why="the recipe's default"
  every_line
  # the criterion section's _name and rdrop_fused_linear (default false)
  read -r criterion fused < <(awk '/^[^ #]/ { in_c = ($1 == "criterion:") }
    in_c && $1 == "_name:" { name = $2 } in_c && $1 == "rdrop_fused_linear:" { f = $2 }
    END { print name, (f == "" ? "false" : f) }' "$config")
  for arg in "${EXTRA[@]}"; do
    case $arg in
      criterion.rdrop_fused_linear=*|+criterion.rdrop_fused_linear=*|++criterion.rdrop_fused_linear=*)
        fused=${arg#*=} why="your override $arg" ;;
      criterion.rdrop_impl=*|+criterion.rdrop_impl=*|++criterion.rdrop_impl=*) impl=${arg#*=} ;;
    esac
  done
  case $MODE in
    baseline|doubled-batch)
      say "loss: ${criterion%_rdrop} as fairseq computes it (MODE=$MODE: alpha 0, one pass)"
      return ;;
  esac
  if [ "$criterion" = adaptive_loss_rdrop ]; then
    say "loss: the adaptive softmax's R-Drop loss (adaptive_loss_rdrop: chunks of the" \
        "vocabulary, no fused-linear path)"
    return
  fi
  case ${fused,,} in
    true|yes|on|1)
      say "loss: the fused-linear path ($why): the R-Drop loss from the decoder's features," \
          "no 2N x V logits, rdrop_impl $impl; not measured on a GPU since its rework" \
          "(docs/benchmarks.md#which-loss-path-the-recipes-run)" ;;
    false|no|off|0)
      [ "$impl" != auto ] || impl="auto (the Triton kernel on CUDA)"
      say "loss: the logits path ($why): the fused R-Drop loss over the 2N x V logits," \
          "rdrop_impl $impl; criterion.rdrop_fused_linear=true computes it from the" \
          "decoder's features instead (docs/benchmarks.md#which-loss-path-the-recipes-run)" ;;
    *) say "loss: rdrop_fused_linear=$fused ($why), as hydra reads it" ;;
  esac
}

# split_batch TOTAL PAPER_MAX_TOKENS [MIN_TOKENS]: MAX_TOKENS and UPDATE_FREQ with
# DEVICES x UPDATE_FREQ x MAX_TOKENS = TOTAL, the paper's tokens per update: the paper's
# tokens per GPU batch and more update-freq on fewer GPUs; fewer tokens per batch where
# more GPUs than the paper's hold the whole batch (not below MIN_TOKENS). UPDATE_FREQ /
# MAX_TOKENS from the environment win. Where the recipe's memory was measured, a split of
# our own is halved (MAX_TOKENS / 2, UPDATE_FREQ x 2) until it fits the GPUs (memory_fit).
# doubled-batch then doubles MAX_TOKENS.
split_batch() {
  local total=$1 paper=$2 min=${3:-1} ours=0
  [ -n "${MAX_TOKENS:-}" ] || [ -n "${UPDATE_FREQ:-}" ] || ours=1
  local fix="set UPDATE_FREQ and/or MAX_TOKENS (GPUS x NODES x UPDATE_FREQ x MAX_TOKENS = $total)"
  if [ -n "${MAX_TOKENS:-}" ] && [ -z "${UPDATE_FREQ:-}" ]; then
    (( total % (DEVICES * MAX_TOKENS) == 0 )) ||
      die "$DEVICES GPUs x MAX_TOKENS=$MAX_TOKENS do not divide" \
          "the paper's $total tokens per update: $fix"
    UPDATE_FREQ=$(( total / (DEVICES * MAX_TOKENS) ))
  elif [ -z "${MAX_TOKENS:-}" ] && [ -n "${UPDATE_FREQ:-}" ]; then
    (( total % (DEVICES * UPDATE_FREQ) == 0 )) ||
      die "$DEVICES GPUs x UPDATE_FREQ=$UPDATE_FREQ do not divide" \
          "the paper's $total tokens per update: $fix"
    MAX_TOKENS=$(( total / (DEVICES * UPDATE_FREQ) ))
  elif [ -z "${MAX_TOKENS:-}" ]; then
    if (( total % (DEVICES * paper) == 0 )); then
      MAX_TOKENS=$paper UPDATE_FREQ=$(( total / (DEVICES * paper) ))
    elif (( DEVICES * paper > total && total % DEVICES == 0 && total / DEVICES >= min )); then
      MAX_TOKENS=$(( total / DEVICES )) UPDATE_FREQ=1
    else
      die "$DEVICES GPUs do not divide the paper's $total tokens per update" \
          "into batches of $paper: $fix"
    fi
  fi
  memory_fit "$ours" "$min"
  local per_update=$(( DEVICES * UPDATE_FREQ * MAX_TOKENS * BATCH_FACTOR )) note=""
  MAX_TOKENS=$(( MAX_TOKENS * BATCH_FACTOR ))
  (( BATCH_FACTOR == 1 )) || note=", doubled by MODE=doubled-batch"
  case $MODE in rdrop|no-kl) note+="; R-Drop runs each batch twice" ;; esac
  say "batch: $DEVICES device(s) x update-freq $UPDATE_FREQ x max-tokens $MAX_TOKENS" \
      "= $per_update tokens per update (the paper's: $total$note)"
}

# split_examples TOTAL MOST: DEVICE_BATCH and UPDATE_FREQ with DEVICES x UPDATE_FREQ x
# DEVICE_BATCH = TOTAL, a recipe's examples per update (the Hugging Face recipes, whose
# batches count examples, not tokens): the fewest accumulation steps whose per-device batch
# is at most MOST. DEVICE_BATCH / UPDATE_FREQ from the environment win: one of them given,
# the other is what makes TOTAL (a one-line error where it does not divide); both, they are
# used as they are. doubled-batch then doubles DEVICE_BATCH. Says the batch.
split_examples() {
  local total=$1 most=$2 note=""
  local fix="set UPDATE_FREQ and/or DEVICE_BATCH (GPUS x NODES x UPDATE_FREQ x DEVICE_BATCH = $total)"
  if [ -n "${DEVICE_BATCH:-}" ] && [ -z "${UPDATE_FREQ:-}" ]; then
    (( total % (DEVICES * DEVICE_BATCH) == 0 )) ||
      die "$DEVICES device(s) x DEVICE_BATCH=$DEVICE_BATCH do not divide the recipe's $total" \
          "examples per update: $fix"
    UPDATE_FREQ=$(( total / (DEVICES * DEVICE_BATCH) ))
  elif [ -z "${DEVICE_BATCH:-}" ] && [ -n "${UPDATE_FREQ:-}" ]; then
    (( total % (DEVICES * UPDATE_FREQ) == 0 )) ||
      die "$DEVICES device(s) x UPDATE_FREQ=$UPDATE_FREQ do not divide the recipe's $total" \
          "examples per update: $fix"
    DEVICE_BATCH=$(( total / (DEVICES * UPDATE_FREQ) ))
  elif [ -z "${DEVICE_BATCH:-}" ]; then
    (( total % DEVICES == 0 )) ||
      die "$DEVICES devices do not divide the recipe's $total examples per update: $fix"
    UPDATE_FREQ=1  # up to total / DEVICES, where the batch is 1 (<= MOST): it ends
    while (( total % (DEVICES * UPDATE_FREQ) || total / (DEVICES * UPDATE_FREQ) > most )); do
      UPDATE_FREQ=$(( UPDATE_FREQ + 1 ))
    done
    DEVICE_BATCH=$(( total / (DEVICES * UPDATE_FREQ) ))
  fi
  local per_update=$(( DEVICES * UPDATE_FREQ * DEVICE_BATCH * BATCH_FACTOR ))
  DEVICE_BATCH=$(( DEVICE_BATCH * BATCH_FACTOR ))
  (( BATCH_FACTOR == 1 )) || note=", doubled by MODE=doubled-batch"
  case $MODE in rdrop|no-kl) note+="; R-Drop runs each batch twice" ;; esac
  say "batch: $DEVICES device(s) x $UPDATE_FREQ steps x $DEVICE_BATCH examples" \
      "= $per_update examples per update (the recipe's: $total$note)"
}

# The recipes' measured memory (benchmarks/bench_recipe_memory.py; RECIPE_MEMORY: another
# table). MEMORY_RECIPE: the recipe's rows (default the script's name). Only rows measured
# in this run's precision count; without one nothing here prints or changes anything.
RECIPE_MEMORY=${RECIPE_MEMORY:-$REPO/benchmarks/results/recipe_memory.tsv}

# memory_need TOKENS: "GIB<tab>DEVICE": what one GPU needs for a training step at TOKENS per
# GPU: the allocator's peak (reserved_gib) at TOKENS, or on the line through the two nearest
# measured rows (one row: its figure, for at most its tokens), + 1 GiB for the CUDA context
# and libraries, + the fp16 gradients once more on several GPUs (DDP's buckets). Nothing
# without a figure.
memory_need() {
  [ -n "${PRECISION:-}" ] && [ -r "$RECIPE_MEMORY" ] || return 0
  awk -F'\t' -v key="${MEMORY_RECIPE:-$RECIPE}" -v prec="$PRECISION" -v t="$1" \
      -v devices="${DEVICES:-1}" '
    !/^#/ && $1 == key && $3 == prec && $2 ~ /^[0-9]+$/ && $6 ~ /^[0-9.]+$/ {
      n++; tok[n] = $2 + 0; gib[n] = $6 + 0; par[n] = $8 + 0; dev[n] = $9 }
    END {
      if (!n) exit
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (tok[j] < tok[i]) {
        x = tok[i]; tok[i] = tok[j]; tok[j] = x; x = gib[i]; gib[i] = gib[j]; gib[j] = x
        x = par[i]; par[i] = par[j]; par[j] = x; x = dev[i]; dev[i] = dev[j]; dev[j] = x }
      a = 1; while (a < n && tok[a + 1] <= t) a++  # the row at or below t (or the first)
      if (tok[a] == t || (n == 1 && t < tok[1])) est = gib[a]
      else if (n == 1) exit  # above the only row: no figure
      else {
        if (a == n) a = n - 1
        est = gib[a] + (gib[a + 1] - gib[a]) * (t - tok[a]) / (tok[a + 1] - tok[a])
      }
      if (est < 0) est = 0
      need = est + 1 + (devices > 1 ? par[a] * 2 / 2^30 : 0)
      printf "%.1f\t%s\n", need, dev[a]
    }' "$RECIPE_MEMORY"
}

# memory_cards GIB: which card sizes (GB: 10^9 bytes) hold GIB
memory_cards() {
  awk -v need="$1" 'BEGIN {
    split("16 24 32 40 48 80", gb, " ")
    for (i = 1; i <= 6; i++)
      if (need <= gb[i] * 1e9 / 2^30) fit = fit (fit ? ", " : "") gb[i]
      else no = no (no ? ", " : "") gb[i]
    if (!fit) print "fits none of the 16 to 80 GB cards"
    else print "fits " fit " GB cards" (no ? "; not " no " GB" : "")
  }'
}

# memory_line TOKENS: say what a step at TOKENS per GPU needs and which cards hold it
memory_line() {
  local need device
  IFS=$'\t' read -r need device < <(memory_need "$1") || true
  [ -n "$need" ] || return 0
  say "memory: about $need GiB per GPU at max-tokens $1 ($PRECISION, measured on $device:" \
      "benchmarks/bench_recipe_memory.py): $(memory_cards "$need")"
}

# memory_fit OURS MIN_TOKENS: where the GPUs' memory (nvidia-smi) would not hold a step at
# MAX_TOKENS and the split is ours (OURS=1: the user set neither MAX_TOKENS nor
# UPDATE_FREQ), halve MAX_TOKENS and double UPDATE_FREQ (the tokens per update stay) while
# that fits MIN_TOKENS; then memory_line. Nothing without a figure.
memory_fit() {
  local ours=$1 min=$2 need device tokens=$MAX_TOKENS freq=$UPDATE_FREQ
  IFS=$'\t' read -r need device < <(memory_need "$MAX_TOKENS") || true
  [ -n "$need" ] || return 0
  if [ -n "${GPU_MEMORY_MIB:-}" ]; then
    local gpu_gib
    gpu_gib=$(awk -v m="$GPU_MEMORY_MIB" 'BEGIN { printf "%.1f", m / 1024 }')
    local less
    while [ "$ours" = 1 ] && awk -v n="$need" -v g="$gpu_gib" 'BEGIN { exit !(n > g) }' &&
          (( MAX_TOKENS % 2 == 0 && MAX_TOKENS / 2 >= min )); do
      IFS=$'\t' read -r less device < <(memory_need $(( MAX_TOKENS / 2 ))) || true
      # a figure below the last one (not a single row's upper bound)
      [ -n "$less" ] && awk -v l="$less" -v n="$need" 'BEGIN { exit !(l < n) }' || break
      MAX_TOKENS=$(( MAX_TOKENS / 2 )) UPDATE_FREQ=$(( UPDATE_FREQ * 2 )) need=$less
    done
    [ "$MAX_TOKENS" = "$tokens" ] ||
      say "memory: max-tokens $tokens -> $MAX_TOKENS, update-freq $freq -> $UPDATE_FREQ:" \
          "the GPUs have $gpu_gib GiB (nvidia-smi)"
    if awk -v n="$need" -v g="$gpu_gib" 'BEGIN { exit !(n > g) }'; then
      say "memory: warning: about $need GiB per GPU at max-tokens $MAX_TOKENS, more than" \
          "the GPUs' $gpu_gib GiB (nvidia-smi): a lower MAX_TOKENS, UPDATE_FREQ keeping the" \
          "tokens per update, fits"
    fi
  fi
  memory_line "$MAX_TOKENS"
}

# glue_task: TASK in the GLUE table's spelling (any case accepted), and SETTINGS its row of
# rdrop_fairseq/recipes/glue_tasks.tsv (the paper's appendix table 1): max updates, batch
# (sentences), alpha, classes, best-checkpoint metric, its report flag ('-': none)
glue_task() {
  local table row
  table="$(dirname "${BASH_SOURCE[0]}")/../../rdrop_fairseq/recipes/glue_tasks.tsv"
  row=$(awk -F'\t' -v t="${TASK:-}" '!/^#/ && $1 != "task" && toupper($1) == toupper(t)' "$table")
  [ -n "$row" ] || die "TASK must be one of $(awk -F'\t' '!/^#/ && $1 != "task" {printf "%s%s", s, $1; s = ", "}' "$table"), not '${TASK:-}'"
  read -r TASK SETTINGS_ROW <<<"$row"
  read -r -a SETTINGS <<<"$SETTINGS_ROW"
  [ "${SETTINGS[5]}" != - ] || unset 'SETTINGS[5]'
}


"""``sentence_prediction_attendout``: fine-tuning with AttendOut (Algorithm 1 of Wu, Zhao,
Zhang, arXiv 2104.04692), on fairseq's ``sentence_prediction`` task.

Every training batch:

1. the generator (no gradient) gives each attention unit of the attacker a drop probability
   and, with ``--attendout-decision layer``, each layer a gate that drops the whole layer
   (Eq. 3) for an example; a mask is sampled from a seeded generator and cached as bits
   with its batch; layers already pruned (sticky, see AttendOutGenerator) are dropped for
   every example;
2. the criterion is applied twice on the same batch: to the attacker with the masks, and to
   the defender (``attendout_role="defender"``), each loss backpropagated after its forward
   (one network's graph at a time); fairseq's optimizer updates both copies (never the
   generator).

Every ``--attendout-interval`` T *updates* (the pruning step, in ``optimizer_step``):

3. attacker (with each batch's masks) and defender are evaluated on the cached batches,
   in evaluation mode; reward per example = defender loss - attacker loss (or attacker
   correct - defender correct), so the generator is rewarded when the attacker wins;
4. REINFORCE with a baseline (Eq. 4) updates the generator with its own Adam, one backward
   per cached batch (the memory of one batch's graph, whatever T);
5. the defender is overwritten by the attacker (D <- A), fp32 master copies included.

A batch enters the cache only once its update is applied: an update that fairseq skips (an
fp16 overflow; AMP's overflow, retried on the same batch) leaves no action to reward. The
cache is saved with the checkpoint, so a run resumed between two pruning steps rewards the
whole interval.

This module is the schedule (when masks are drawn, what the cache holds, when a pruning
step runs, D <- A); the masks, the rewards and the generator's side of the pruning step
(steps 1, 3 and 4) are :class:`~rdrop_fairseq.tasks.attendout_pruning.AttendOutPruning`'s.
Under fairseq's data-parallel training every process runs all of it on its own batches and
takes the same decisions (:mod:`~rdrop_fairseq.tasks.attendout_processes`). What D <- A
needs of fairseq's optimizer (its fp32 masters and state) is
:mod:`~rdrop_fairseq.tasks.attendout_plumbing`'s; the log's columns
:mod:`~rdrop_fairseq.tasks.attendout_logs`'.

The criterion is any sentence-prediction criterion: ``sentence_prediction`` or
``sentence_prediction_rdrop`` (AttendOut + R-Drop: the mask is part of ``net_input``, so
R-Drop's duplicated batch carries the same mask in both passes).
"""

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask
from omegaconf import II

from ..models.attendout_generator import (
    SEARCH_DEFAULTS,
    check_search_options,
    pack_mask,
    search_option,
)
from .attendout_logs import log_attendout_metrics
from .attendout_plumbing import HeadOutputs, copy_optimizer_state, fp32_master_views, no_sync
from .attendout_processes import check_distributed_options, search_state, unwrap_model
from .attendout_pruning import AttendOutPruning, describe_step
from .gathered_metrics import check_gathered_metrics, logging_outputs_can_be_summed

logger = logging.getLogger(__name__)


@dataclass
class SentencePredictionAttendOutConfig(SentencePredictionConfig):
    attendout_interval: int = field(
        default=25,
        metadata={"help": "pruning step T: every T updates the generator is rewarded and the "
                  "defender overwritten by the attacker (paper: 10, 15 or 25)"},
    )
    attendout_generator_lr: float = field(
        default=5e-5, metadata={"help": "learning rate of the generator's Adam (paper: 5e-5)"}
    )
    attendout_reward: ChoiceEnum(["loss", "accuracy"]) = field(
        default="loss",
        metadata={"help": "reward per example: defender loss - attacker loss, or attacker "
                  "correct - defender correct (the paper names both, uses neither explicitly)"},
    )
    attendout_reward_per_batch: bool = field(
        default=False,
        metadata={"help": "one reward per cached batch (its mean), as the paper's r_t, instead "
                  "of one per example (ours, lower variance)"},
    )
    attendout_baseline: ChoiceEnum(["moving_average", "leave_one_out"]) = field(
        default="moving_average",
        metadata={"help": "REINFORCE baseline b (the paper's is unspecified): a moving average "
                  "of past mean rewards, or, per example, the mean reward of the other "
                  "examples of its batch"},
    )
    attendout_baseline_decay: float = field(
        default=0.95,
        metadata={"help": "decay of the moving-average baseline, in [0, 1)"},
    )
    attendout_decision: ChoiceEnum(["layer", "unit"]) = field(
        default="layer",
        metadata={"help": "how a layer gets pruned: 'layer', a per-example gate per layer "
                  "from the generator's scores, which drops the whole layer (Eq. 3) where it "
                  "fires (ours, the default, provisional); 'unit', per-unit masks only (the "
                  "paper's literal reading)"},
    )
    attendout_prune_threshold: float = field(
        default=0.5,
        metadata={"help": "a layer is pruned, for good (mean of V in training from then on, "
                  "in validation and in the export), when its moving average over training "
                  "batches reaches this, in (0, 1): the gate's probability (--attendout-"
                  "decision layer) or the fraction of examples whose greedy mask (p > 0.5) "
                  "drops all its units (unit)"},
    )
    attendout_sync_optimizer_state: bool = field(
        default=False,
        metadata={"help": "also copy the attacker's Adam moments to the defender at D <- A "
                  "(default: the defender keeps its own)"},
    )
    attendout_drop_price: float = field(
        default=SEARCH_DEFAULTS["attendout_drop_price"],
        metadata={"help": "reward per layer that ran as Eq. 3 for an example, in units of "
                  "the task reward's running standard deviation, >= 0 (ours: the paper's "
                  "reward never pays for dropping; 0 = the paper's reward). With "
                  "--attendout-target-layers it is the price's starting value"},
    )
    attendout_target_layers: int = field(
        default=SEARCH_DEFAULTS["attendout_target_layers"],
        metadata={"help": "a budget: prune exactly K layers, 1..layers-1 (ours; 0 = no "
                  "budget). The price rises by --attendout-price-step per pruning step for "
                  "each layer still missing; no more than K are pruned; at the deadline the "
                  "K layers with the highest gate statistic are; from then on the attacker "
                  "trains as exported (no masks, no defender). Needs --max-update and "
                  "--attendout-decision layer"},
    )
    attendout_deadline: float = field(
        default=SEARCH_DEFAULTS["attendout_deadline"],
        metadata={"help": "with --attendout-target-layers: the update, as a fraction of "
                  "--max-update in (0, 1), by which the budget is filled"},
    )
    attendout_price_step: float = field(
        default=SEARCH_DEFAULTS["attendout_price_step"],
        metadata={"help": "with --attendout-target-layers: how much the price rises per "
                  "pruning step for each layer missing from the budget (dual ascent), >= 0"},
    )
    attendout_gate_lr: float = field(
        default=SEARCH_DEFAULTS["attendout_gate_lr"],
        metadata={"help": "learning rate of the per-layer gate biases (plain SGD; a bias "
                  "moves by this times the mean over the interval's examples of (reward - "
                  "baseline) x d log P / d bias), >= 0 (ours)"},
    )
    attendout_reward_timing: ChoiceEnum(["interval", "step"]) = field(
        default="interval",
        metadata={"help": "when the rewards are measured: 'interval', Algorithm 1's "
                  "evaluation of both networks on the cached batches after the interval "
                  "(evaluation mode, the attacker with its masks); 'step', each batch's own "
                  "training losses, at the step that drew its masks (r_t as the loss at "
                  "training step t; no re-scoring)"},
    )
    max_update: int = II("optimization.max_update")
    # fairseq's data-parallel options, read where several processes cannot run them
    ddp_backend: str = II("distributed_training.ddp_backend")
    find_unused_parameters: bool = II("distributed_training.find_unused_parameters")
    zero_sharding: str = II("distributed_training.zero_sharding")
    use_bmuf: bool = II("optimization.use_bmuf")
    cpu: bool = II("common.cpu")


@register_task("sentence_prediction_attendout", dataclass=SentencePredictionAttendOutConfig)
class SentencePredictionAttendOutTask(SentencePredictionTask):
    def __init__(self, cfg, data_dictionary, label_dictionary):
        super().__init__(cfg, data_dictionary, label_dictionary)
        check_task_options(cfg)
        # the masks, the rewards and the generator's side of the pruning step
        self.pruning = AttendOutPruning(cfg, data_dictionary.pad())
        check_distributed_options(cfg, self.pruning.processes.world_size)
        # (sample, its attacker mask as bits, its rewards with the step timing, else None)
        # of the applied updates since the last pruning step: B * layers * T^2 / 8 bytes
        # each; _pending: those of the update in progress
        self._cache = []
        self._pending = []
        self._cache_restored = False

    def build_criterion(self, cfg):
        criterion = super().build_criterion(cfg)
        if not hasattr(criterion, "classification_head_name"):
            raise ValueError(f"{_NEEDS_HEAD_CRITERION}, got {type(criterion).__name__}")
        check_gathered_metrics(criterion, self.cfg, self.pruning.processes.world_size)
        return criterion

    # GLUE's list metrics (--report-mcc, ...) gathered from the processes, as the plugin
    # makes fairseq's sentence_prediction do (tasks/gathered_metrics.py)
    logging_outputs_can_be_summed = staticmethod(logging_outputs_can_be_summed)

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if from_checkpoint and getattr(model, "inference_only", False):
            return model  # an exported model, loaded for inference
        if getattr(cfg, "attendout_static_prune_layers", ""):
            raise ValueError("--attendout-static-prune-layers fine-tunes without AttendOut (no "
                             "defender, no generator): use --task sentence_prediction")
        if not hasattr(model, "generator") or getattr(model, "inference_only", True):
            raise ValueError(
                "--task sentence_prediction_attendout trains a roberta_attendout model "
                "(--arch roberta_attendout_base / _large / roberta_attendout); got "
                f"{type(model).__name__}")
        check_search_options(self.cfg, model.args.encoder_layers if hasattr(model, "args")
                             else len(model.encoder.sentence_encoder.layers),
                             getattr(self.cfg, "max_update", 0))
        model.generator.configure(self.cfg.attendout_decision, self.cfg.attendout_prune_threshold)
        if self.budget and not model.generator.pruning_steps:
            model.generator.price = search_option(self.cfg, "attendout_drop_price")
        return model

    @property
    def budget(self):
        """K of --attendout-target-layers (0: no budget)."""
        return self.pruning.budget

    @property
    def deadline_update(self):
        """The update (1-based) by which the budget is filled."""
        return max(1, round(search_option(self.cfg, "attendout_deadline")
                            * getattr(self.cfg, "max_update", 0)))

    def search_finished(self, model):
        """The budget is filled: from now on the attacker trains as exported (its pruned
        layers as Eq. 3, the others in full), without masks, generator or defender."""
        return bool(self.budget) and len(model.pruned_layers) >= self.budget

    # -- training --------------------------------------------------------------------
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        if self.search_finished(model):
            # trained as exported: fairseq's plain step (the pruned layers are the model's)
            return super().train_step(sample, model, criterion, optimizer, update_num,
                                      ignore_grad)
        model.train()
        model.set_num_updates(update_num)
        tokens = sample["net_input"]["src_tokens"]
        drop, drop_rate = self.pruning.draw_masks(model, tokens)
        attacker = dict(sample, net_input=dict(sample["net_input"], attendout_drop=drop))
        defender = dict(sample, net_input=dict(sample["net_input"], attendout_role="defender"))
        step_timing = self.cfg.attendout_reward_timing == "step"
        heads = HeadOutputs(model, self.cfg.classification_head_name) if step_timing else None
        if model.encoder.sentence_encoder.embed_tokens.weight.grad is None:
            # the first batch of an update (fairseq zeroes the gradients to None before it):
            # a batch still pending belongs to an update that was skipped (fp16 overflow)
            self._pending = []
        # the attacker's forward and backward, then the defender's: one network's graph at
        # a time, and one forward per backward, as torch's DDP reduces the gradients (it
        # holds the attacker's back until the defender's backward, which reduces both)
        with heads or nullcontext():
            with no_sync(model):
                loss, sample_size, logging_output = self.forward_backward(
                    criterion, model, attacker, optimizer, ignore_grad)
            _, _, defender_log = self.forward_backward(criterion, model, defender, optimizer,
                                                       ignore_grad)
        if not ignore_grad:
            rewards = None
            if step_timing:  # r_t: this step's own training losses, attacker over defender
                with torch.no_grad():
                    rewards = self.pruning.step_rewards(model, sample, *heads.outputs)
            self._pending.append((sample, pack_mask(drop), rewards))
        logging_output["defender_loss"] = defender_log["loss"]
        for i, rate in enumerate(drop_rate.unbind()):  # 0-dim tensors: no host sync
            logging_output[f"attendout_drop_L{i}"] = rate * sample_size
        return loss, sample_size, logging_output

    @staticmethod
    def forward_backward(criterion, model, sample, optimizer, ignore_grad):
        """The criterion on ``sample`` (autocast under --amp), and its backward (times 0
        for fairseq's dummy batches): ``criterion``'s ``(loss, sample_size, log)``."""
        amp = isinstance(optimizer, _amp_optimizer_types())
        device = sample["net_input"]["src_tokens"].device.type
        with torch.autograd.profiler.record_function("forward"):
            with torch.autocast(device, enabled=amp):
                loss, sample_size, logging_output = criterion(model, sample)
        with torch.autograd.profiler.record_function("backward"):
            optimizer.backward(loss * 0 if ignore_grad else loss)
        return loss, sample_size, logging_output

    def optimizer_step(self, optimizer, model, update_num):
        scale = _amp_scale(optimizer)
        super().optimizer_step(optimizer, model, update_num)
        pending, self._pending = self._pending, []
        if scale is not None and optimizer.scaler.get_scale() < scale:
            return  # AMP skipped the update (overflow): fairseq retries it, same update_num
        if self.search_finished(model):
            return
        self._cache.extend(pending)
        model.generator.cached_batches = len(self._cache)
        update = update_num + 1
        # the deadline's step (or the first applied update after it: an fp16 overflow
        # skips optimizer_step) fills the budget
        deadline = bool(self.budget) and update >= self.deadline_update
        if update % self.cfg.attendout_interval == 0 or deadline:
            self.pruning_step(model, optimizer, update)

    # the cache in the checkpoint (fairseq's task hooks; not restored with --reset-dataloader)
    def get_checkpoint_dict(self):
        processes = self.pruning.processes.world_size
        if processes > 1:  # fairseq writes the checkpoint from process 0 alone
            return {type(self).__name__: {"attendout_cache": [], "attendout_processes": processes,
                                          "attendout_cache_not_saved": len(self._cache)}}
        cache = [(utils.apply_to_sample(lambda t: t.cpu(), sample), (bits.cpu(), shape),
                  None if rewards is None else rewards.cpu())
                 for sample, (bits, shape), rewards in self._cache]
        return {type(self).__name__: {"attendout_cache": cache}}

    def set_checkpoint_dict(self, state):
        # (entries of checkpoints written before the step timing have no rewards)
        self._cache = [tuple(entry) if len(entry) == 3 else (*entry, None)
                       for entry in state.get("attendout_cache", [])]
        self._cache_restored = True
        if self.pruning.processes.rank > 0:  # a one-process run's batches: process 0 has them
            self._cache = []
        if state.get("attendout_cache_not_saved"):
            logger.warning(
                f"AttendOut: the checkpoint was written by {state['attendout_processes']} "
                f"processes, each with {state['attendout_cache_not_saved']} batch(es) since the "
                "last pruning step, which it does not keep: the next pruning step rewards only "
                "the batches trained from now on")
        if self._cache:
            logger.info(f"AttendOut: {len(self._cache)} batches since the last pruning step "
                        "restored from the checkpoint")

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        generator = getattr(model, "generator", None)
        lost = getattr(generator, "cached_batches", 0)
        if lost and not self._cache_restored and not self._cache:
            # fairseq restores a task's state only with the data iterator
            logger.warning(f"AttendOut: the checkpoint held {lost} batches since the last "
                           "pruning step, not restored (--reset-dataloader): the next "
                           "pruning step rewards only the batches trained from now on")
        self._cache_restored = True  # said once
        if generator is not None:
            generator.cached_batches = len(self._cache)

    def pruning_step(self, model, optimizer, update=None):
        """Reward the generator for the cached batches (REINFORCE, Eq. 4), decide which
        layers are pruned, adapt the price to the budget, then D <- A. Under several
        processes, every process runs it on its own batches and leaves it with the same
        search state (checked), the model's copies unwrapped from fairseq's DDP."""
        model = unwrap_model(model)
        generator = model.generator
        cache, self._cache = self._cache, []
        generator.cached_batches = 0
        force = bool(self.budget) and update is not None and update >= self.deadline_update
        statistic, now, batches = self.pruning.step(model, cache, force)
        self.pruning.processes.check_same(search_state(generator),
                                          "the search's state after a pruning step")
        if now:
            model.set_pruned_layers(generator.pruned_layers())
        finished = self.search_finished(model)
        if batches or now:
            logger.info(describe_step(generator, statistic, now, update=update,
                                      batches=batches, force=force, finished=finished))
        if not finished:
            self.copy_attacker_to_defender(model, optimizer)

    def copy_attacker_to_defender(self, model, optimizer):
        """D <- A in the model and, under --fp16/--bf16, in fairseq's fp32 master copies
        (which would otherwise overwrite the copy at the next step)."""
        model.copy_attacker_to_defender()
        pairs = model.defender_pairs()
        masters = fp32_master_views(optimizer)
        if masters is not None:
            with torch.no_grad():
                for a, d in pairs:
                    masters[id(d)].copy_(masters[id(a)])
        if self.cfg.attendout_sync_optimizer_state:
            copy_optimizer_state(optimizer, pairs)

    # -- validation ------------------------------------------------------------------
    def valid_step(self, sample, model, criterion):
        """Exactly the model the export writes (its pruned layers as a mean of V), then the
        same weights unpruned (``loss_unpruned``, ``accuracy_unpruned``; the gaps
        ``loss_pruning_gap`` = loss - loss_unpruned, ``accuracy_pruning_gap`` likewise)."""
        if model.generator is None:  # an exported model: its pruning is fixed
            return super().valid_step(sample, model, criterion)
        model.eval()
        pruned = model.pruned_layers
        with torch.no_grad():
            loss, sample_size, logging_output = criterion(model, sample)
            model.set_pruned_layers(())
            try:
                _, _, unpruned = criterion(model, sample)
            finally:
                model.set_pruned_layers(pruned)
        logging_output["loss_unpruned"] = unpruned["loss"]
        if "ncorrect" in unpruned:
            logging_output["ncorrect_unpruned"] = unpruned["ncorrect"]
        logging_output["attendout_num_pruned"] = len(pruned)
        # (fairseq sums the logs of several processes: the count tells by how many)
        logging_output["attendout_valid_batches"] = 1
        return loss, sample_size, logging_output

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        log_attendout_metrics(logging_outputs)


def check_task_options(cfg):
    """Refuse the task's options that cannot run together, before anything is built."""
    if cfg.attendout_interval < 1:
        raise ValueError(f"--attendout-interval must be >= 1, got {cfg.attendout_interval}")
    if not cfg.attendout_generator_lr > 0:
        raise ValueError("--attendout-generator-lr must be > 0, got "
                         f"{cfg.attendout_generator_lr}")
    if not 0 <= cfg.attendout_baseline_decay < 1:
        raise ValueError("--attendout-baseline-decay must be in [0, 1), got "
                         f"{cfg.attendout_baseline_decay}")
    check_search_options(cfg, None, getattr(cfg, "max_update", 0))
    if cfg.regression_target and cfg.attendout_reward == "accuracy":
        raise ValueError("--attendout-reward accuracy needs classification; regression "
                         "(--regression-target) is rewarded by the MSE: use loss")
    if cfg.attendout_baseline == "leave_one_out" and cfg.attendout_reward_per_batch:
        raise ValueError("--attendout-baseline leave_one_out compares the examples of a "
                         "batch, which --attendout-reward-per-batch gives one reward: use "
                         "--attendout-baseline moving_average")


_NEEDS_HEAD_CRITERION = (
    "sentence_prediction_attendout needs a sentence-prediction criterion with a "
    "classification head: --criterion sentence_prediction or sentence_prediction_rdrop")


def _amp_optimizer_types():
    from fairseq.optim.amp_optimizer import AMPOptimizer

    return (AMPOptimizer,)


def _amp_scale(optimizer):
    """AMP's loss scale before a step (None without --amp): a step that finds inf/NaN
    gradients is skipped and lowers it. (get_scale() reads the device; AMP's step has just
    synchronised with it anyway, to decide whether to skip.)"""
    return optimizer.scaler.get_scale() if isinstance(optimizer, _amp_optimizer_types()) else None

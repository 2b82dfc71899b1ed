"""AttendOut across fairseq's data-parallel processes (``--distributed-world-size N``).

Each process trains the attacker and the defender on its own batches, and fairseq's DDP
wrapper averages their gradients, so both copies stay identical on every process (and
D <- A, a local copy of identical weights, keeps them so). The generator is trained
outside fairseq's optimizer, at the pruning step, so the search is made global here:

* the masks: a batch's seed counts the masks drawn by all processes, so that the process
  of rank r draws, for its i-th batch, the masks one process draws for batch ``i x N + r``
  of the union (:meth:`AttendOutPruning.next_seed`): fairseq deals the batches to the
  processes in that order;
* the pruning step: the sums behind the rewards' scale and the baseline, the generator's
  gradient, its batch count and the interval's decision statistic are summed over the
  processes (:meth:`Processes.sum`), so that every process updates the generator with
  the gradient of the whole interval and takes the decision from the whole interval's
  statistic, as one process does with ``--update-freq N``;
* then :meth:`Processes.check_same` verifies that every process holds the same search
  state (the pruned layers, the price, the baseline, the generator's weights).

With one process every method here is local and costs nothing.
"""

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.models import BaseFairseqModel

# --ddp-backend values whose wrapper this task supports (torch's DDP and fairseq's own)
SUPPORTED_BACKENDS = ("pytorch_ddp", "c10d", "legacy_ddp", "no_c10d")


class Processes:
    """fairseq's data-parallel processes, as AttendOut's search sees them."""

    @property
    def world_size(self):
        return distributed_utils.get_data_parallel_world_size()

    @property
    def rank(self):
        return distributed_utils.get_data_parallel_rank() if self.world_size > 1 else 0

    def sum(self, tensors):
        """The sums over the processes of ``tensors`` (each of the same shape on every
        process), in one all-reduce of float32; ``tensors`` themselves with one process."""
        tensors = list(tensors)
        if self.world_size == 1:
            return tensors
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        distributed_utils.all_reduce(flat, group=distributed_utils.get_data_parallel_group())
        parts = flat.split([t.numel() for t in tensors])
        return [part.view_as(t).to(t.dtype) for part, t in zip(parts, tensors)]

    def check_same(self, values, what):
        """Raise, on every process, unless ``values`` (a 1-D tensor) are equal on all of
        them: one all-reduce of a ``processes x values`` float64 table, each process its
        own row."""
        world = self.world_size
        if world == 1:
            return
        table = torch.zeros(world, values.numel(), dtype=torch.float64, device=values.device)
        table[self.rank] = values.detach().double()
        distributed_utils.all_reduce(table, group=distributed_utils.get_data_parallel_group())
        differ = [r for r in range(1, world) if not torch.equal(table[r], table[0])]
        if differ:
            raise RuntimeError(
                f"AttendOut: the data-parallel processes disagree on {what} (processes "
                f"{', '.join(map(str, differ))} against process 0): their searches diverged")


def search_state(generator):
    """What every process must hold the same after a pruning step, as one float64 vector:
    the generator's buffers (the pruned layers, the interval's statistics), the price, the
    counters, the baseline and the reward's variance, and a checksum of each of its
    parameters (their sums)."""
    device = generator.drop_bias.device

    def scalar(value):
        value = 0.0 if value is None else value
        return torch.as_tensor(value, dtype=torch.float64, device=device).reshape(1)

    return torch.cat([*(b.double().reshape(-1) for b in generator.buffers()),
                      *(scalar(v) for v in (generator.price, generator.pruning_steps,
                                            generator.masks_drawn, generator.baseline,
                                            generator.reward_var)),
                      *(p.detach().double().sum().reshape(1) for p in generator.parameters())])


def check_distributed_options(cfg, world_size):
    """The options that cannot run with ``world_size`` data-parallel processes, refused
    before training (``cfg``: the task's config, whose ``distributed_*`` fields fairseq
    fills in from its own options)."""
    if world_size <= 1:
        return
    backend = getattr(cfg, "ddp_backend", None)
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"sentence_prediction_attendout under {world_size} processes needs --ddp-backend "
            f"pytorch_ddp or legacy_ddp (its defender is a copy of the attacker, its "
            f"generator trained by its own optimizer), got {backend}")
    if backend in ("pytorch_ddp", "c10d") and getattr(cfg, "find_unused_parameters",
                                                     True) is False:
        raise ValueError(
            f"sentence_prediction_attendout under {world_size} processes with --ddp-backend "
            f"{backend} needs --find-unused-parameters (the LM head, a pruned layer's Q and K "
            "and, once a budget is filled, the defender get no gradient), or --ddp-backend "
            "legacy_ddp")
    if getattr(cfg, "use_bmuf", False):
        raise ValueError(
            "sentence_prediction_attendout cannot run with --use-bmuf: the processes' "
            "attackers would differ between BMUF's synchronisations, and so their masks and "
            "rewards; use plain data-parallel training")
    if getattr(cfg, "zero_sharding", "none") != "none" and cfg.attendout_sync_optimizer_state:
        raise ValueError(
            "--attendout-sync-optimizer-state cannot copy Adam's moments that --zero-sharding "
            "os spreads over the processes: drop one of them")


def unwrap_model(model):
    """The model inside fairseq's data-parallel wrappers (its ModuleProxyWrapper, torch's or
    fairseq's DDP, its DistributedTimeoutWrapper: each holds it as ``module``)."""
    while not isinstance(model, BaseFairseqModel) and isinstance(
            getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


"""AttendOut's columns of fairseq's training and validation logs, beside the criterion's
(the task's ``reduce_metrics``)."""

import math

from fairseq import utils
from fairseq.logging import metrics


def log_attendout_metrics(logging_outputs):
    """AttendOut's columns of the training and validation logs, beside the criterion's: the
    defender's loss, each layer's drop rate, the unpruned model's loss and accuracy and the
    gaps to them, the number of pruned layers."""
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    nsentences = sum(log.get("nsentences", 0) for log in logging_outputs)
    if any("defender_loss" in log for log in logging_outputs):
        total = utils.item(sum(log.get("defender_loss", 0) for log in logging_outputs))
        metrics.log_scalar("defender_loss", total / max(sample_size, 1) / math.log(2),
                           sample_size, round=3)
    drop_keys = sorted({k for log in logging_outputs for k in log
                        if k.startswith("attendout_drop_L")}, key=lambda k: int(k[16:]))
    for key in drop_keys:
        rate = utils.item(sum(log.get(key, 0) for log in logging_outputs))
        metrics.log_scalar(key, rate / max(sample_size, 1), sample_size, round=3)
    if any("loss_unpruned" in log for log in logging_outputs):
        total = utils.item(sum(log.get("loss_unpruned", 0) for log in logging_outputs))
        unpruned = total / max(sample_size, 1) / math.log(2)
        metrics.log_scalar("loss_unpruned", unpruned, sample_size, round=3)
        loss = utils.item(sum(log.get("loss", 0) for log in logging_outputs))
        metrics.log_scalar("loss_pruning_gap", loss / max(sample_size, 1) / math.log(2)
                           - unpruned, sample_size, round=3)
    if any("ncorrect_unpruned" in log for log in logging_outputs):
        correct = utils.item(sum(log.get("ncorrect_unpruned", 0) for log in logging_outputs))
        metrics.log_scalar("accuracy_unpruned", 100.0 * correct / max(nsentences, 1),
                           nsentences, round=1)
        pruned = utils.item(sum(log.get("ncorrect", 0) for log in logging_outputs))
        metrics.log_scalar("accuracy_pruning_gap",
                           100.0 * (pruned - correct) / max(nsentences, 1), nsentences,
                           round=1)
    if any("attendout_num_pruned" in log for log in logging_outputs):
        # the same in every batch: the sum over the batches (and processes) / their number
        total = sum(log.get("attendout_num_pruned", 0) for log in logging_outputs)
        batches = sum(log.get("attendout_valid_batches", 1) for log in logging_outputs)
        metrics.log_scalar("attendout_num_pruned", utils.item(total) / max(utils.item(batches), 1),
                           weight=0, round=0)

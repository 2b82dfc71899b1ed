"""GLUE's metrics under fairseq's data-parallel training (``--distributed-world-size N``).

fairseq's ``sentence_prediction`` criterion computes ``--report-mcc`` (CoLA),
``--report-acc-and-f1`` (MRPC, QQP) and ``--report-pearson-and-spearman`` (STS-B) from the
lists of predictions and targets in its logging outputs. With several processes the trainer
adds the processes' logging outputs up before the metrics, by a fast sum of numbers when the
task says they can be summed, which fairseq's ``sentence_prediction`` task always says: the
lists break that sum, and the job stops at its first validation. Such outputs must be
gathered instead (fairseq's ``all_gather_list``), after which every process's predictions
count, and the metrics are those of one process over the same examples.

:func:`gather_sentence_prediction_metrics` (applied when the plugin is loaded) makes
``sentence_prediction`` and every task built on it (``sentence_prediction_attendout``) say
so whenever the criterion reports one of those metrics: fairseq's ``sentence_prediction``
criterion and ``sentence_prediction_rdrop`` alike. One process is not affected (nothing is
summed nor gathered).
"""

from fairseq.tasks.sentence_prediction import SentencePredictionTask

# fairseq's sentence_prediction options whose metrics (GLUE's MCC, F1, Pearson and
# Spearman) are computed from lists of predictions in the logging outputs
PREDICTION_REPORTS = ("report_mcc", "report_acc_and_f1", "report_pearson_and_spearman")


def reports_predictions(criterion):
    """Whether ``criterion`` logs lists of predictions, which fairseq cannot sum over the
    processes (its fast sum fails on them), only gather."""
    return any(getattr(criterion, flag, False) for flag in PREDICTION_REPORTS)


def logging_outputs_can_be_summed(criterion):
    """fairseq sums the processes' logging outputs before the metrics where it can; the
    GLUE metrics' lists of predictions it cannot, so with them it gathers the outputs."""
    return criterion.logging_outputs_can_be_summed() and not reports_predictions(criterion)


def gather_sentence_prediction_metrics():
    """Make fairseq's ``sentence_prediction`` task (and its subclasses) gather the logging
    outputs of a criterion that reports GLUE's list metrics. Idempotent."""
    SentencePredictionTask.logging_outputs_can_be_summed = staticmethod(
        logging_outputs_can_be_summed)


def check_gathered_metrics(criterion, cfg, world_size):
    """Refuse what fairseq cannot gather: lists of predictions from several processes on
    the CPU (its ``all_gather_list`` goes through a CUDA tensor)."""
    if world_size > 1 and reports_predictions(criterion) and getattr(cfg, "cpu", False):
        flags = ", ".join("--" + f.replace("_", "-") for f in PREDICTION_REPORTS
                          if getattr(criterion, f, False))
        raise ValueError(
            f"{flags} under {world_size} processes on the CPU: fairseq gathers those "
            "predictions from the processes through CUDA; run one process, or leave the "
            "flag out")

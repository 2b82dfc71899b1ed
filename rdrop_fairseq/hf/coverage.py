"""What R-Drop's loss covers among Hugging Face heads, and what it refuses and why: read by
:func:`~rdrop_fairseq.hf.kind.read_kind` when a trainer is made."""

from .model import is_task

__all__ = ["COVERED", "UNCOVERED_HEADS", "UNCOVERED_MODELS", "ENCODER_HEADS",
           "refuse_uncovered"]

COVERED = ("Covered: sequence classification (single- and multi-label) and regression, token "
           "classification, question answering (start and end positions), multiple choice, "
           "masked LM, causal LM (vision-language models included), encoder-decoder LM")
# Heads refused whatever kind is stated, each with why R-Drop's loss is not theirs
UNCOVERED_HEADS = {
    "NEXT_SENTENCE_PREDICTION": "a next-sentence-prediction head (a pre-training "
                                "objective)",
    "CTC": "a CTC head (its loss aligns the labels with the frames, summing over the "
           "alignments: not one class per frame)",
    "OBJECT_DETECTION": "an object-detection head (its loss matches predicted boxes with "
                        "the labelled ones)",
    "ZERO_SHOT_OBJECT_DETECTION": "an object-detection head (its loss matches predicted "
                                  "boxes with the labelled ones)",
    "SEMANTIC_SEGMENTATION": "a segmentation head (its logits are at a lower resolution "
                             "than the label map, which its loss upsamples them to)",
    "UNIVERSAL_SEGMENTATION": "a segmentation head (its loss matches predicted masks with "
                              "the labelled ones)",
    "INSTANCE_SEGMENTATION": "a segmentation head (its loss matches predicted masks with "
                             "the labelled ones)",
    "TABLE_QUESTION_ANSWERING": "a table question-answering head (its loss adds cell "
                                "selection and aggregation terms)",
    "": "a bare model, without a head"}
# Models refused by name: a head R-Drop's loss covers in form but not in scale
UNCOVERED_MODELS = {
    "ViltForQuestionAnswering": "a visual question-answering head whose own loss is the "
                                "binary cross-entropy of its answer scores times the number "
                                "of answers (3,129 for VQAv2); R-Drop's multi-label loss is "
                                "per label entry, so the two would differ by that factor "
                                "(and, under rdrop_every, its plain updates from its R-Drop "
                                "ones)"}
# Heads whose kind needs no probe (their logits against their labels as they are)
ENCODER_HEADS = {"QUESTION_ANSWERING": "a question-answering head",
                  "MULTIPLE_CHOICE": "a multiple-choice head"}


def refuse_uncovered(model):
    """A ValueError naming what ``model`` (unwrapped) is and why R-Drop's loss does not
    cover it, and what is covered; nothing for a head that may be covered."""
    name = type(model).__name__
    for task, what in UNCOVERED_HEADS.items():
        if is_task(model, task):
            raise ValueError(f"{name} is {what}, which R-Drop's loss here does not cover. "
                             f"{COVERED}")
    if name in UNCOVERED_MODELS:
        raise ValueError(f"{name} is {UNCOVERED_MODELS[name]}: not covered here. {COVERED}")

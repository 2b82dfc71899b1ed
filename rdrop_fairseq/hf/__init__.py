"""R-Drop for Hugging Face models: :class:`RDropTrainer` (a ``transformers.Trainer``),
:class:`RDropSeq2SeqTrainer` (a ``Seq2SeqTrainer``), :class:`RDropMixin`, which gives any
Trainer subclass (TRL's ``SFTTrainer``, say) R-Drop's training loss, and
:func:`rdrop_hf_loss`, the same loss for an Accelerate or plain-PyTorch loop. The loss is
computed by this project's core (:func:`rdrop_fairseq.core.rdrop_loss`, or
:func:`rdrop_fairseq.fused_linear.fused_linear_rdrop_loss` from the hidden states).

    from rdrop_fairseq.hf import RDropTrainer
    trainer = RDropTrainer(model=model, args=training_args, train_dataset=train, rdrop_alpha=1.0)
    trainer.train()

Each training batch ``x`` goes through the model once as ``[x; x]`` (dropout draws a
different mask for each half), as the fairseq criteria do. The loss of a labelled item:

* classification (sequence or token heads, masked LM), and the tokens of a causal LM or of
  an encoder-decoder model's target: ``CE(P1) + CE(P2) + alpha * 1/2 (KL(P1||P2) +
  KL(P2||P1))``, the cross-entropy label-smoothed with ``label_smoothing_factor`` as
  Hugging Face smooths it (``eps / V`` on every class);
* regression (one output): ``(y1 - y)^2 + (y2 - y)^2 + alpha * (y1 - y2)^2``;
* multi-label classification, per label entry: both passes' binary cross-entropy plus
  ``alpha`` times the symmetric KL of their Bernoulli distributions, halved;
* question answering: the start and the end position each a classification over the
  sequence, the two averaged; multiple choice: a classification over the choices;

summed over the items and divided by the number of labelled items of one pass in the whole
accumulated batch (examples for sequence heads, tokens not labelled -100 otherwise; for a
model that shifts its labels, the tokens after the first). A mixture of experts adds its
router loss to each pass, as its own loss does. Whether a model shifts its labels is read
from what it does (:func:`model_kind`), not from its class name. So ``alpha`` means what
``--rdrop-alpha`` means in fairseq, ``gradient_accumulation_steps = k`` gives the gradient
of one batch k times as large, and at ``alpha = 0`` with dropout off the loss is twice the
model's own. Evaluation, prediction and generation run one pass, with the model's own
loss. Needs the ``hf`` extra; importing ``rdrop_fairseq`` alone does not import
transformers.

Where things are: :mod:`.trainers` (the mixin and the trainers, and their checks),
:mod:`.loss` (everything a training batch touches), :mod:`.kind` (the probe that reads how
a model's logits line up with its labels), :mod:`.model` (what they read off a model and
its output, and the decoder inputs made from labels) and :mod:`.fused_head` (what the
fused path installs on a language-model head). Import the public names from here:
``from rdrop_fairseq.hf import ...``.
"""

from ..core import RDropBatchError
from .kind import model_kind
from .loss import (RDropHFLoss, batch_labels, doubled_batch, labelled_items, plain_hf_loss,
                   rdrop_hf_loss)
from .trainers import (TRANSFORMERS_RANGE, RDropMixin, RDropOptions, RDropSeq2SeqTrainer,
                       RDropTrainer, check_transformers_version, declare_loss_scaling,
                       warmup_arguments)

__all__ = ["RDropMixin", "RDropTrainer", "RDropSeq2SeqTrainer", "rdrop_hf_loss", "model_kind",
           "labelled_items", "declare_loss_scaling", "warmup_arguments", "TRANSFORMERS_RANGE",
           "RDropHFLoss", "RDropOptions", "RDropBatchError", "doubled_batch",
           "check_transformers_version", "batch_labels", "plain_hf_loss"]

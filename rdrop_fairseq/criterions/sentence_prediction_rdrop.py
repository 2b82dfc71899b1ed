"""R-Drop over fairseq's ``sentence_prediction`` (RoBERTa / BART classification, regression).

Classification: symmetric KL between the two passes' class distributions. Regression
(``--regression-target``, e.g. STS-B): the paper's consistency term for real-valued
outputs, the squared difference of the two predictions (appendix eq. 1-2), next to the MSE
task loss of both passes.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from fairseq.criterions import register_criterion
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
    SentencePredictionCriterion,
)

from ..core import mse_consistency
from .rdrop import RDropConfig, RDropCriterionMixin


@dataclass
class SentencePredictionRDropConfig(SentencePredictionConfig, RDropConfig):
    pass


@register_criterion("sentence_prediction_rdrop", dataclass=SentencePredictionRDropConfig)
class SentencePredictionRDropCriterion(RDropCriterionMixin, SentencePredictionCriterion):
    def __init__(self, cfg: SentencePredictionRDropConfig, task):
        super().__init__(cfg, task)
        self.init_rdrop_from(cfg, "sentence_prediction")

    def rdrop_forward(self, model, sample):
        assert (
            hasattr(model, "classification_heads")
            and self.classification_head_name in model.classification_heads
        ), "model must provide sentence classification head for --criterion=sentence_prediction_rdrop"
        for option in ("mha_reg_scale_factor", "ffn_reg_scale_factor"):
            if getattr(getattr(model, "args", None), option, 0.0):
                raise ValueError(f"--{option.replace('_', '-')} is not supported with R-Drop")

        pair = self.duplicate_sample(model, sample)
        logits, _ = model(
            **pair["net_input"],
            features_only=True,
            classification_head_name=self.classification_head_name,
        )
        targets = model.get_targets(pair, [logits]).view(-1)
        logging_output = {}
        sample_size = targets.numel() // 2
        if not self.regression_target:
            # before the loss, which may write the gradient into the logits' buffer
            logging_output["ncorrect"] = (logits.argmax(dim=1) == targets).sum() / 2
            # NLL of both passes (sentence_prediction's loss) + alpha * KL, from the logits
            out = self.rdrop_loss(logits, targets[:sample_size],
                                  grad_in_scores=self.grad_in_logits)
            total, task_loss = out.total, out.loss
            logging_output["rdrop_kl"] = out.kl
        else:
            predictions = logits.view(-1).float()
            task_loss = F.mse_loss(predictions, targets.float(), reduction="sum")
            consistency = mse_consistency(predictions)
            total = task_loss + self.rdrop_alpha * consistency
            logging_output["rdrop_mse"] = consistency.data

        logging_output.update(
            {
                "loss": task_loss.data / 2,
                "ntokens": sample["ntokens"],
                "nsentences": sample_size,
                "sample_size": sample_size,
            }
        )
        return total, sample_size, logging_output

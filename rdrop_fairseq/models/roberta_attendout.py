"""``roberta_attendout``: RoBERTa (or a converted BERT) fine-tuned with AttendOut.

The model *is* the attacker (A-Net): its own parameters keep the state-dict keys of
fairseq's ``roberta`` (``encoder.*``, ``classification_heads.*``), so a stock
``roberta.base/model.pt`` loads into it strictly and its exported weights load into a
plain ``roberta``. Two children complete the method: ``defender`` (D-Net, a plain
``RobertaModel`` that starts as a copy of the attacker) and ``generator`` (G-Net). The
training loop is the task ``sentence_prediction_attendout``.

With ``--attendout-inference-only`` (what the export writes) the model has no defender and
no generator, and the layers in ``--attendout-pruned-layers`` run as a mean of V.

``--attendout-static-prune-layers I,J`` is static pruning: that model (no defender, no
generator) fine-tuned by the plain ``sentence_prediction`` task with layers I, J as a mean
of V from the start, at a baseline step's cost. Its checkpoint loads as the export does.
"""

import logging

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta import RobertaEncoder, RobertaModel
from fairseq.models.roberta.model import (
    base_architecture,
    roberta_base_architecture,
    roberta_large_architecture,
)
from fairseq.modules.transformer_sentence_encoder import init_bert_params

from .attendout_generator import AttendOutGenerator, check_search_options
from .attendout_layers import AttendOutTransformerEncoder

logger = logging.getLogger(__name__)

ROLES = ("attacker", "defender")


def parse_pruned_layers(value, num_layers, flag="--attendout-pruned-layers"):
    """``"10,11"`` (or a list) -> sorted tuple of layer indices, each in [0, num_layers)."""
    if value is None or value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        layers = sorted({int(i) for i in items})
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated layer indices, "
                         f"got {value!r}") from None
    if layers and not (0 <= layers[0] and layers[-1] < num_layers):
        raise ValueError(f"{flag} {value!r}: layers are 0..{num_layers - 1}")
    return tuple(layers)


STATIC_FLAG = "--attendout-static-prune-layers"


def check_static_pruning(args):
    """Static pruning's options, checked at start-up (``fairseq-train`` runs this while
    parsing, before it creates the save dir); sets the export's two fields from them."""
    static = getattr(args, "attendout_static_prune_layers", "") or ""
    if not static:
        return
    layers = parse_pruned_layers(static, args.encoder_layers, STATIC_FLAG)
    if getattr(args, "task", None) == "sentence_prediction_attendout":
        raise ValueError(f"{STATIC_FLAG} fine-tunes without AttendOut (no defender, no "
                         "generator): use --task sentence_prediction, not "
                         "sentence_prediction_attendout")
    pruned = parse_pruned_layers(getattr(args, "attendout_pruned_layers", ""),
                                 args.encoder_layers)
    if pruned and pruned != layers:
        raise ValueError(f"{STATIC_FLAG} {static!r} and --attendout-pruned-layers "
                         f"{args.attendout_pruned_layers!r} disagree: give only {STATIC_FLAG}")
    args.attendout_pruned_layers = ",".join(map(str, layers))
    args.attendout_inference_only = True


class AttendOutRobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        pruned = parse_pruned_layers(getattr(args, "attendout_pruned_layers", ""),
                                     args.encoder_layers)
        encoder = AttendOutTransformerEncoder(args, dictionary, embed_tokens, pruned)
        encoder.apply(init_bert_params)
        return encoder

    def forward(self, src_tokens, features_only=False, return_all_hiddens=False,
                masked_tokens=None, attendout_drop=None, **unused):
        encoder_out = self.sentence_encoder(src_tokens, return_all_hiddens=return_all_hiddens,
                                            attendout_drop=attendout_drop)
        x = encoder_out["encoder_out"][0].transpose(0, 1)
        extra = {"inner_states": encoder_out["encoder_states"] if return_all_hiddens else None}
        if not features_only:
            x = self.output_layer(x, masked_tokens=masked_tokens)
        return x, extra


@register_model("roberta_attendout")
class RobertaAttendOutModel(RobertaModel):
    def __init__(self, args, encoder, defender=None, generator=None):
        super().__init__(args, encoder)
        self.defender = defender
        self.generator = generator

    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        parser.add_argument("--attendout-init-drop", type=float, metavar="P",
                            help="generator's initial drop probability, on average over the "
                            "attention units, in (0, 1) (ours: the paper does not say; "
                            "default 0.1)")
        parser.add_argument("--attendout-pruned-layers", type=str, metavar="I,J",
                            help="encoder layers (0-based) whose self-attention is pruned to a "
                            "mean of V (Eq. 3); set by the export")
        parser.add_argument("--attendout-inference-only", action="store_true",
                            help="the attacker alone, without defender and generator (the "
                            "exported model)")
        parser.add_argument(STATIC_FLAG, type=str, metavar="I,J",
                            help="static pruning: fine-tune with these encoder layers "
                            "(0-based) as a mean of V (Eq. 3) from the start, without "
                            "defender and generator, with --task sentence_prediction; the "
                            "checkpoint is already the export")

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        check_static_pruning(args)
        if not hasattr(args, "max_positions"):
            args.max_positions = getattr(args, "tokens_per_sample", task.max_positions())
        encoder = AttendOutRobertaEncoder(args, task.source_dictionary)
        if getattr(args, "attendout_inference_only", False):
            return cls(args, encoder)
        # built without touching the global random state: the attacker (encoder, then the
        # classification head fairseq registers next) draws what a plain roberta draws
        # with the same --seed, so the arms of a comparison start from the same head
        with torch.random.fork_rng(devices=[]):
            defender = RobertaModel(args, AttendOutRobertaEncoder(args, task.source_dictionary))
            generator = AttendOutGenerator(args.encoder_embed_dim, args.encoder_layers,
                                           args.attendout_init_drop)
        model = cls(args, encoder, defender, generator)
        model.copy_attacker_to_defender()
        return model

    @property
    def inference_only(self):
        return self.defender is None

    def forward(self, src_tokens, features_only=False, return_all_hiddens=False,
                classification_head_name=None, attendout_drop=None,
                attendout_role="attacker", **kwargs):
        if attendout_role not in ROLES:
            raise ValueError(f"attendout_role must be one of {ROLES}, got {attendout_role!r}")
        if attendout_role == "defender":
            return self.defender(src_tokens, features_only, return_all_hiddens,
                                 classification_head_name, **kwargs)
        if classification_head_name is not None:
            features_only = True
        x, extra = self.encoder(src_tokens, features_only, return_all_hiddens,
                                attendout_drop=attendout_drop, **kwargs)
        if classification_head_name is not None:
            x = self.classification_heads[classification_head_name](x)
        return x, extra

    def register_classification_head(self, name, num_classes=None, inner_dim=None, **kwargs):
        super().register_classification_head(name, num_classes, inner_dim, **kwargs)
        if self.defender is not None:
            with torch.random.fork_rng(devices=[]):  # (overwritten below)
                self.defender.register_classification_head(name, num_classes, inner_dim,
                                                           **kwargs)
            self.defender.classification_heads[name].load_state_dict(
                self.classification_heads[name].state_dict())

    def attacker_parameters(self):
        """``(name, parameter)`` of the attacker: everything but defender and generator."""
        return [(n, p) for n, p in self.named_parameters()
                if not n.startswith(("defender.", "generator."))]

    def defender_pairs(self):
        """``(attacker parameter, defender parameter)`` pairs, matched by name."""
        defender = dict(self.defender.named_parameters())
        pairs = []
        for name, p in self.attacker_parameters():
            if name not in defender:
                raise RuntimeError(f"the defender has no parameter {name}")
            pairs.append((p, defender[name]))
        return pairs

    @torch.no_grad()
    def copy_attacker_to_defender(self):
        """D <- A (parameters; buffers are not trained)."""
        for a, d in self.defender_pairs():
            d.copy_(a)

    def set_pruned_layers(self, layers):
        """Run ``layers`` as a mean of V (Eq. 3), in the attacker and the defender."""
        for net in (self, self.defender):
            if net is not None:
                net.encoder.sentence_encoder.pruned_layers = tuple(layers)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        result = super().load_state_dict(state_dict, strict, model_cfg, args)
        if self.generator is not None:  # the run's pruned layers, from the generator's buffer
            self.set_pruned_layers(self.generator.pruned_layers())
        return result

    @property
    def pruned_layers(self):
        return self.encoder.sentence_encoder.pruned_layers

    def upgrade_state_dict_named(self, state_dict, name):
        """Make a plain ``roberta`` checkpoint (``roberta.base/model.pt``, or an exported
        AttendOut model) load strictly: the defender starts as the attacker, the generator
        and its statistics as built."""
        prefix = name + "." if name != "" else ""
        if not any(k.startswith((prefix + "encoder.sentence_encoder.",
                                 prefix + "decoder.sentence_encoder."))
                   for k in state_dict):
            example = next(iter(state_dict), "(none)")
            raise ValueError(
                "roberta_attendout loads RoBERTa-format checkpoints (keys "
                f"'encoder.sentence_encoder.*'); this one has e.g. {example!r}. Convert BERT "
                "weights with python -m rdrop_fairseq.recipes.convert_hf_bert")
        positions = prefix + "encoder.sentence_encoder.embed_positions.weight"
        rows = self.encoder.sentence_encoder.embed_positions.weight.size(0)
        if positions in state_dict and state_dict[positions].size(0) > rows:
            # a shorter model (the paper's length 256 from a 512-position checkpoint): the
            # first rows are the positions it uses; the rest could never be reached
            logger.info(f"keeping the first {rows} of {state_dict[positions].size(0)} "
                        "position embeddings (--max-positions)")
            state_dict[positions] = state_dict[positions][:rows].clone()
        incoming = set(state_dict)
        super().upgrade_state_dict_named(state_dict, name)
        if self.inference_only:
            return
        own = self.state_dict()
        for key, value in own.items():
            full = prefix + key
            if full in incoming:
                continue
            if key.startswith("defender."):
                source = prefix + key[len("defender."):]
                if source in state_dict:
                    state_dict[full] = state_dict[source].clone()
                    continue
            if key.startswith(("defender.", "generator.")):
                state_dict[full] = value


@register_model_architecture("roberta_attendout", "roberta_attendout")
def attendout_base_architecture(args):
    if getattr(args, "attendout_init_drop", None) is None:
        args.attendout_init_drop = 0.1
    if getattr(args, "attendout_pruned_layers", None) is None:
        args.attendout_pruned_layers = ""
    args.attendout_inference_only = getattr(args, "attendout_inference_only", False)
    if getattr(args, "attendout_static_prune_layers", None) is None:
        args.attendout_static_prune_layers = ""
    base_architecture(args)
    check_static_pruning(args)
    if getattr(args, "task", None) == "sentence_prediction_attendout":
        # the task's options too, so that fairseq-train stops before it creates anything
        check_search_options(args, args.encoder_layers, getattr(args, "max_update", 0))


@register_model_architecture("roberta_attendout", "roberta_attendout_base")
def attendout_roberta_base_architecture(args):
    roberta_base_architecture(args)
    attendout_base_architecture(args)


@register_model_architecture("roberta_attendout", "roberta_attendout_large")
def attendout_roberta_large_architecture(args):
    roberta_large_architecture(args)
    attendout_base_architecture(args)

"""RDropTrainer at the edges of where Hugging Face users train: a compiled model
(``torch_compile=True``, or compiled before the trainer is made) on both paths; heads that
soft-cap or scale their logits inside a multimodal model's text config; a kind given by
hand that contradicts what the model's own loss does; Liger-Kernel's patched forward; the
random state the reading of a model leaves; two overlapping calls of the fused path from
two threads. Tiny random models, dropout off where a loss is compared with twice the
model's own."""

import os
import threading
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
from transformers import (LlamaConfig, LlamaForCausalLM, PretrainedConfig,  # noqa: E402
                          TrainingArguments)

from rdrop_fairseq import hf  # noqa: E402
from rdrop_fairseq.hf import RDropTrainer  # noqa: E402
from rdrop_fairseq.hf.model import takes, unwrap  # noqa: E402
from tests.tiny_hf_models import causal, classifier, examples  # noqa: E402


def arguments(tmp_path, **overrides):
    return TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 2, "max_steps": 2, "learning_rate": 0.0,
        "save_strategy": "no", "disable_tqdm": True, "logging_steps": 1, **overrides})


class Recorded(RDropTrainer):
    """R-Drop's training loss of each step beside the model's own on the same batch."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training:
            with torch.no_grad():
                self.seen.append((float(loss), float(model(**inputs).loss)))
        return loss


def train(model, tmp_path, data=None, **options):
    """The (R-Drop's loss, the model's own) of each step of a trainer made with ``options``
    (TrainingArguments' among them, by name), and the warnings it gave."""
    names = {field for field in TrainingArguments.__dataclass_fields__}
    overrides = {k: options.pop(k) for k in list(options) if k in names}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Recorded(model=model, args=arguments(tmp_path, **overrides),
                           train_dataset=data or examples("causal"), **options)
        trainer.seen = []
        trainer.train()
    return trainer.seen, [str(w.message) for w in caught]


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=0.0))


# ------------------------------------------------------------------------ compiled models

@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_a_compiled_model_trains_at_twice_its_own_loss_on_both_paths(tmp_path, fused):
    """``torch_compile=True``: the Trainer compiles the model in train(); the fused head
    runs outside the compiled graphs (a graph break), and every step's loss at alpha 0
    with dropout off is exactly twice the model's own."""
    torch.manual_seed(0)
    steps, _ = train(causal(), tmp_path, rdrop_alpha=0.0, rdrop_fused_linear=fused,
                     torch_compile=True, torch_compile_backend="aot_eager", max_steps=3)
    assert len(steps) == 3
    for ours, own in steps:
        assert ours == pytest.approx(2 * own, rel=1e-6)


def test_a_model_compiled_before_the_trainer_is_read_through_its_wrapper(tmp_path):
    """torch.compile's wrapper (OptimizedModule) is seen through: the kind of the model
    inside, its forward's arguments (no key/value cache is made for [x; x]), its head."""
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3))
    assert hf.model_kind(torch.compile(vit, backend="aot_eager")) == "encoder"
    model = causal()
    compiled = torch.compile(model, backend="aot_eager")
    assert unwrap(compiled) is model and takes(compiled, "use_cache")
    kind, seen = hf.model_kind(compiled), []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("use_cache")),
                                           with_kwargs=True)
    batch = {"input_ids": torch.randint(3, 99, (2, 6)), "labels": torch.randint(3, 99, (2, 6))}
    hf.rdrop_hf_loss(compiled, batch, kind=kind, fused_linear=True)
    hook.remove()
    assert (kind, seen) == ("causal", [False])
    # (the Trainer reads the columns a model takes from its forward's signature, which a
    # compiled model's wrapper hides: remove_unused_columns=False, as for any such model)
    steps, _ = train(compiled, tmp_path, rdrop_alpha=0.0, rdrop_fused_linear=True,
                     remove_unused_columns=False)
    assert len(steps) == 2
    assert all(ours == pytest.approx(2 * own, rel=1e-6) for ours, own in steps)


# ------------------------------------------------------- heads that do more than a layer

def tiny_paligemma(softcapping):
    from transformers import (Gemma2Config, PaliGemmaConfig,
                              PaliGemmaForConditionalGeneration, SiglipVisionConfig)

    text = Gemma2Config(vocab_size=128, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, final_logit_softcapping=softcapping,
                        attn_logit_softcapping=None)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=8, patch_size=4)
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(PaliGemmaConfig(
        text_config=text, vision_config=vision, image_token_index=127, projection_dim=16))


def test_a_soft_capped_head_inside_a_multimodal_model_is_refused_by_the_fused_path(tmp_path):
    """PaliGemma's Gemma2 text model soft-caps its logits (its text_config says so): the
    fused path, which computes the logits as a linear layer's, refuses it when the trainer
    is made; without the cap the same model is taken."""
    with pytest.raises(ValueError, match=r"soft-caps the logits \(final_logit_softcapping = "
                                         r"30.0, in its text_config\)"):
        RDropTrainer(model=tiny_paligemma(30.0), args=arguments(tmp_path),
                     rdrop_fused_linear=True, rdrop_model_kind="causal")
    trainer = RDropTrainer(model=tiny_paligemma(None), args=arguments(tmp_path),
                           rdrop_fused_linear=True, rdrop_model_kind="causal")
    assert trainer.rdrop.fused_linear
    assert list((tmp_path / "out").glob("*")) == []


@pytest.mark.parametrize("attribute, what", [
    ("logit_scale", "scales the logits"), ("logits_scaling", "divides the logits"),
    ("final_logit_softcapping", "soft-caps the logits")])
def test_each_head_extra_nested_in_a_text_config_is_refused(tmp_path, attribute, what):
    """AyaVision's logit_scale and Granite's logits_scaling sit in the text config of
    their multimodal models as the soft cap does: each is found there."""
    model = causal()
    model.config.text_config = PretrainedConfig(**{attribute: 0.5})
    with pytest.raises(ValueError, match=f"{what}.*{attribute} = 0.5, in its text_config"):
        RDropTrainer(model=model, args=arguments(tmp_path), rdrop_fused_linear=True)


# -------------------------------------------------------------------- a kind given by hand

@pytest.mark.parametrize("make, stated, read", [
    (causal, "encoder", "'causal'"), (classifier, "causal", "'encoder'")])
def test_a_kind_given_by_hand_that_contradicts_the_models_loss_is_warned_of_once(
        tmp_path, make, stated, read):
    """The first training batch's own loss (dropout as it is) against the stated kind: one
    warning naming both; a kind that agrees, or 'auto', says nothing."""
    data = examples("classifier" if make is classifier else "causal")
    _, said = train(make(), tmp_path, data=data, rdrop_model_kind=stated, max_steps=2)
    contradictions = [w for w in said if "contradicts" in w]
    assert len(contradictions) == 1, said
    assert f"rdrop_model_kind {stated!r}" in contradictions[0]
    assert f"as kind {read}" in contradictions[0]
    right = read.strip("'")
    _, said = train(make(), tmp_path, data=data, rdrop_model_kind=right)
    assert not [w for w in said if "contradicts" in w]


# ------------------------------------------------------------------------ Liger-Kernel

def liger_config():
    """Liger's patched forward alone (its fused linear cross-entropy): its RoPE, RMSNorm and
    SwiGLU are Triton kernels that need a GPU."""
    return {"rope": False, "rms_norm": False, "swiglu": False,
            "fused_linear_cross_entropy": True}


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_ligers_patched_forward_gives_rdrops_loss_on_both_paths(tmp_path, fused):
    """``use_liger_kernel=True``: the Trainer patches the model's forward in train(), after
    R-Drop's checks. Called without labels (R-Drop's loss replaces Liger's in training), it
    makes the logits, or on the fused path hands the hidden states to R-Drop's head (a
    1-element stand-in comes back); each step is twice the unpatched model's own loss."""
    import liger_kernel  # noqa: F401 (the test extra's: its absence fails, as a skip would not)

    if "liger_kernel_config" not in TrainingArguments.__dataclass_fields__:
        pytest.skip(f"transformers {transformers.__version__} has no liger_kernel_config, and "
                    "Liger's default kernels need a GPU")

    model = tiny_llama()
    data = examples("causal")
    model.eval()
    with torch.no_grad():
        own = [float(model(**{k: torch.stack([d[k] for d in data[i:i + 2]])
                              for k in ("input_ids", "labels")}).loss) for i in (0, 2)]
    shapes = []
    model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RDropTrainer(model=model, train_dataset=data, rdrop_alpha=0.0,
                               rdrop_fused_linear=fused, args=arguments(
                                   tmp_path, use_liger_kernel=True,
                                   liger_kernel_config=liger_config(),
                                   train_sampling_strategy="sequential"))
        shapes.clear()  # (the trainer's reading of the model)
        losses = []
        original = trainer.compute_loss
        trainer.compute_loss = lambda *a, **k: losses.append(original(*a, **k)) or losses[-1]
        trainer.train()
    assert model.forward.__func__.__module__.startswith("liger_kernel")  # patched
    assert [float(x) for x in losses] == pytest.approx([2 * o for o in own], rel=1e-6)
    assert shapes == ([(1, 1, 1)] * 2 if fused else [(4, 6, 99)] * 2)
    note = [str(w.message) for w in caught if "Liger" in str(w.message)]
    assert (note == []) if fused else ("rdrop_fused_linear=True" in note[0] and len(note) == 1)


# ---------------------------------------------------- what reading a model leaves behind

def test_reading_a_model_leaves_the_random_state_as_it_was(tmp_path):
    """The kind probe and the fused head's check run the model; with ``model_init`` they
    run in train(), after the Trainer seeds. A model that draws from the global generator
    even in evaluation mode (Reformer's LSH attention) must find its first training step's
    random state as under a plain Trainer: the same dropout masks and data order."""
    def model_init():
        model = causal()
        model.register_forward_pre_hook(draw)
        return model

    def draw(*args):  # as LSH attention does
        torch.rand(1)

    states = {}

    def first_step_state(base, name):
        class Recording(base):
            def compute_loss(self, model, inputs, *args, **kwargs):
                states.setdefault(name, torch.get_rng_state())
                return super().compute_loss(model, inputs, *args, **kwargs)
        return Recording

    options = dict(args=arguments(tmp_path, max_steps=1), train_dataset=examples("causal"),
                   model_init=model_init)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first_step_state(transformers.Trainer, "plain")(**options).train()
        first_step_state(RDropTrainer, "rdrop")(rdrop_fused_linear=True, **options).train()
    assert torch.equal(states["rdrop"], states["plain"])


def test_two_overlapping_fused_calls_from_threads_keep_to_their_own_path():
    """A fused R-Drop forward in one thread, and meanwhile a plain call of the same model in
    another: the plain call gets the model's logits, the fused one its loss as alone, and
    afterwards the model's own forward is untouched."""
    model = causal()
    batch = {"input_ids": torch.randint(3, 99, (2, 6)), "labels": torch.randint(3, 99, (2, 6))}
    alone = hf.rdrop_hf_loss(model, batch, kind="causal", fused_linear=True).loss
    inside, plain_done, results = threading.Event(), threading.Event(), {}

    def wait_for_the_plain_call(module, args):
        if threading.current_thread().name == "fused":
            inside.set()
            assert plain_done.wait(30)

    hook = model.lm_head.register_forward_pre_hook(wait_for_the_plain_call)

    def fused():
        results["fused"] = hf.rdrop_hf_loss(model, batch, kind="causal", fused_linear=True).loss

    def plain():
        assert inside.wait(30)
        with torch.no_grad():
            results["plain"] = model(input_ids=batch["input_ids"]).logits
        plain_done.set()

    threads = [threading.Thread(target=fused, name="fused"), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    hook.remove()
    assert results["plain"].shape == (2, 6, 99)
    assert torch.equal(results["fused"], alone)
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch["input_ids"]).logits, results["plain"])


def test_the_options_are_kept_checked_and_alpha_may_change_between_steps(tmp_path):
    """``trainer.rdrop`` holds the options as checked; ``trainer.rdrop_alpha`` is the KL's
    weight of the next step (a schedule), refused when it is not a finite number >= 0."""
    trainer = RDropTrainer(model=causal(), args=arguments(tmp_path), rdrop_alpha="0.5")
    assert trainer.rdrop == hf.RDropOptions(alpha=0.5, model_kind="auto")
    batch = {"input_ids": torch.randint(3, 99, (2, 6)), "labels": torch.randint(3, 99, (2, 6))}
    trainer.model.train()
    trainer.rdrop_alpha = 0.0
    both = float(trainer.compute_loss(trainer.model, dict(batch)))
    with torch.no_grad():
        own = float(trainer.model(**batch).loss)
    assert trainer.rdrop.alpha == 0.0 and both == pytest.approx(2 * own, rel=1e-6)  # no dropout
    with pytest.raises(ValueError, match="rdrop_alpha must be a finite number >= 0, got -1"):
        trainer.rdrop_alpha = -1

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


# ------------------------------------------- what the checks of a model must not be fooled by

def tiny_ctc():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    return Wav2Vec2ForCTC(Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(4, 2),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0))


def test_a_ctc_head_is_refused_even_with_a_stated_kind(tmp_path):
    """CTC's loss aligns the labels with the frames (8 frames for 64 samples here; 8 equal
    labels need 15: its loss is infinite): no reading of one class per position is it,
    whatever kind is stated."""
    model = tiny_ctc()
    audio = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float(model(input_values=audio, labels=torch.full((2, 8), 3)).loss) == \
            float("inf")
    with pytest.raises(ValueError, match="Wav2Vec2ForCTC is a CTC head .* not one class per "
                                         "frame"):
        RDropTrainer(model=model, args=arguments(tmp_path), rdrop_model_kind="encoder")


class Infinite(transformers.GPT2LMHeadModel):
    """GPT-2 whose own loss is infinite while ``infinite`` is set."""
    infinite = True

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        if outputs.loss is not None and self.infinite:
            outputs.loss = outputs.loss + float("inf")
        return outputs


@pytest.mark.parametrize("stated", ["causal", "encoder"])
def test_an_infinite_own_loss_is_never_taken_for_the_stated_kind(tmp_path, stated):
    """The tolerance of a reading grows with the model's own loss: an infinite one passed
    every reading. It is said (one warning) and the kind is checked on the next batch,
    where a finite loss agrees with the right kind and contradicts the wrong one."""
    model = Infinite(causal().config)
    batch = {"input_ids": torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"].clone()
    trainer = RDropTrainer(model=model, args=arguments(tmp_path), rdrop_alpha=0.0,
                           rdrop_model_kind=stated)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.compute_loss(model, dict(batch))
        first = [str(w.message) for w in caught]
        model.infinite = False
        trainer.compute_loss(model, dict(batch))
        said = [str(w.message) for w in caught]
    assert len(first) == 1 and "own loss on this training batch is inf" in first[0], first
    assert "checked on the next" in first[0]
    assert len(said) == (1 if stated == "causal" else 2), said
    assert stated == "causal" or f"rdrop_model_kind {stated!r} contradicts" in said[1]


def test_the_probe_takes_no_infinite_own_loss_for_a_match():
    """A model whose own loss is infinite on every probe batch matches no reading of its
    logits (the tolerance grows with the loss: an infinite one passed any reading)."""
    from transformers import MarianMTModel

    class InfiniteLoss(MarianMTModel):
        def forward(self, *args, **kwargs):
            outputs = super().forward(*args, **kwargs)
            if outputs.loss is not None:
                outputs.loss = outputs.loss + float("inf")
            return outputs

    from tests.tiny_hf_models import seq2seq

    with pytest.raises(ValueError, match=r"InfiniteLoss's own loss on probe batches is "
                                         r"inf.*pass rdrop_model_kind"):
        hf.model_kind(InfiniteLoss(seq2seq().config))


def test_a_first_batch_without_labels_defers_the_check_of_the_stated_kind(tmp_path):
    """Every label -100: the model's own loss and both readings are NaN, which tells
    nothing; the kind is checked on the next batch with labelled tokens."""
    batch = {"input_ids": torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))}
    empty = {**batch, "labels": torch.full((2, 6), -100)}
    labelled = {**batch, "labels": batch["input_ids"].clone()}
    for stated, warned in (("causal", []), ("encoder", ["contradicts"])):
        model = causal()
        trainer = RDropTrainer(model=model, args=arguments(tmp_path), rdrop_alpha=0.0,
                               rdrop_model_kind=stated)
        model.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.compute_loss(model, dict(empty))
            assert [str(w.message) for w in caught] == []
            trainer.compute_loss(model, dict(labelled))
        said = [str(w.message) for w in caught]
        assert [w for w in warned if not any(w in s for s in said)] == [] and \
            len(said) == len(warned), said


def test_dropout_that_no_forward_applies_is_not_counted(tmp_path):
    """GPT-2's configuration holds summary_first_dropout (0.1), which only its
    double-heads model's summary uses: a GPT-2 LM with every dropout it applies at 0 is
    warned of; one dropout it applies (resid_pdrop), or a Llama's attention dropout
    (given to the attention function, no dropout module), is counted."""
    def warned(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RDropTrainer(model=model, args=arguments(tmp_path))
        return [str(w.message) for w in caught if "KL is always 0" in str(w.message)]

    model = causal()
    assert model.config.summary_first_dropout == 0.1
    assert len(warned(model)) == 1
    model.config.resid_pdrop = 0.1
    model.transformer.h[0].mlp.dropout.p = 0.1
    assert warned(model) == []
    llama = tiny_llama()
    assert warned(llama) != []
    llama.config.attention_dropout = 0.1
    for layer in llama.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert warned(llama) == []


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def test_whisper_with_its_kind_stated_takes_the_fused_path(tmp_path):
    """The fused head's check runs the model on its own inputs (Whisper's input_features),
    not on token ids: a stated seq2seq Whisper trains on the fused path at twice its own
    loss (alpha 0, dropout off)."""
    model = tiny_whisper()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RDropTrainer(model=model, args=arguments(tmp_path), rdrop_alpha=0.0,
                               rdrop_model_kind="seq2seq", rdrop_fused_linear=True)
    g = torch.Generator().manual_seed(0)
    batch = {"input_features": torch.randn(2, 8, 16, generator=g),
             "labels": torch.randint(3, 99, (2, 5), generator=g)}
    model.train()
    ours = float(trainer.compute_loss(model, dict(batch)))
    with torch.no_grad():
        own = float(model(**batch).loss)
    assert ours == pytest.approx(2 * own, rel=1e-6)


def test_neftune_noise_is_no_false_warning_of_identical_passes(tmp_path):
    """NEFTune's noise on the input embeddings differs between the halves of [x; x]: a
    model without dropout trains with a KL above 0, and no warning says it is always 0."""
    model = tiny_llama()  # no dropout, none in its configuration either
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RDropTrainer(model=model, train_dataset=examples("causal"),
                               args=arguments(tmp_path, neftune_noise_alpha=5.0))
        trainer.train()
    assert not [w for w in caught if "KL is always 0" in str(w.message)]
    kls = [log["rdrop_kl"] for log in trainer.state.log_history if "rdrop_kl" in log]
    assert len(kls) == 2 and min(kls) > 0


def test_a_bool_is_no_alpha(tmp_path):
    with pytest.raises(ValueError, match="rdrop_alpha must be a finite number >= 0, got True"):
        RDropTrainer(model=causal(), args=arguments(tmp_path), rdrop_alpha=True)
    trainer = RDropTrainer(model=causal(), args=arguments(tmp_path))
    with pytest.raises(ValueError, match="rdrop_alpha must be a finite number >= 0, got False"):
        trainer.rdrop_alpha = False

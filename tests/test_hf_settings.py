"""RDropTrainer where Hugging Face users train: what the model does decides its kind (a
mixture of experts' router loss included), the settings in which [x; x] or the item count
would be wrong are refused before anything is made, evaluation reports the model's own
loss, the logs carry the cross-entropy of one pass and the KL, PEFT's trainable copy of
the head goes through the fused path, the fused path's products follow autocast, and
:func:`rdrop_hf_loss` is the trainers' loss for a loop of one's own. Tiny random models
built from configurations (offline)."""

import math
import os
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
from transformers import (GPT2Config, Trainer, TrainingArguments,  # noqa: E402
                          XLNetConfig, XLNetLMHeadModel)

from rdrop_fairseq import hf  # noqa: E402
from rdrop_fairseq.hf import rdrop_hf_loss  # noqa: E402
from tests.test_hf_lm import NoLossKwargsLM, batch, formula, imported_trl, make, tiny  # noqa: E402

V = 50_000


def args(tmp_path, **overrides):
    return TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 3, "max_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, **overrides})


def quiet(factory, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(*a, **k)


# ------------------------------------------------------------------ the kind, read

def test_a_masked_lm_that_names_itself_an_lm_head_is_not_shifted(tmp_path):
    """XLNet's LM head computes its own loss unshifted: read from what it does, it is an
    "encoder" (labels as they are), and at alpha 0 with dropout off R-Drop's loss is twice
    the model's own; GPT-2 shifts."""
    torch.manual_seed(0)
    xlnet = XLNetLMHeadModel(XLNetConfig(vocab_size=99, d_model=16, n_layer=1, n_head=2,
                                         d_inner=32, dropout=0.0))
    assert hf.model_kind(xlnet) == "encoder"
    assert hf.model_kind(tiny("gpt2")) == "causal"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 99, (2, 7), generator=g)
    labels = torch.randint(0, 99, (2, 7), generator=g)
    labels[0, :2] = -100
    xlnet.eval()
    with torch.no_grad():
        own = xlnet(input_ids=ids, labels=labels).loss
        ours = rdrop_hf_loss(xlnet, {"input_ids": ids, "labels": labels}, kind="encoder",
                             alpha=0.0).loss
    assert float(ours) == pytest.approx(2 * float(own), rel=1e-6)


def test_the_mixture_of_experts_router_loss_is_in_each_pass():
    """Mixtral with output_router_logits and coefficient 0.5: at alpha 0 and dropout off,
    R-Drop's loss is twice the model's own, router term included (which is not small)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5))
    assert hf.model_kind(model) == "causal"
    inputs = {"input_ids": torch.randint(0, 99, (2, 9), generator=torch.Generator()
                                         .manual_seed(1))}
    inputs["labels"] = inputs["input_ids"].clone()
    model.eval()
    with torch.no_grad():
        out = model(**inputs)
        plain = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:]
                                .flatten())
        ours = rdrop_hf_loss(model, inputs, kind="causal", alpha=0.0).loss
    assert float(out.loss - plain) > 0.5  # 0.5 x the load-balancing loss (about 2)
    assert float(ours) == pytest.approx(2 * float(out.loss), rel=1e-6)
    # accumulated over 2 micro-batches (the count of both): the router term, a mean per
    # micro-batch, is divided by the steps, not summed over them
    halves = [{k: v[i:i + 1] for k, v in inputs.items()} for i in (0, 1)]
    count = hf.labelled_items(inputs["labels"], causal=True)
    with torch.no_grad():
        whole = rdrop_hf_loss(model, inputs, kind="causal", alpha=0.0, num_items_in_batch=count)
        summed = sum(rdrop_hf_loss(model, half, kind="causal", alpha=0.0,
                                   num_items_in_batch=count, accumulation_steps=2).loss
                     for half in halves)
    router = float(whole.loss) - 2 * float(plain)
    assert abs(float(summed) - float(whole.loss)) < 0.1 * router


def test_a_model_that_says_its_kind_is_not_probed(tmp_path):
    """rdrop_model_kind names the kind; an unknown one is refused before anything is made."""
    model = tiny("gpt2")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(module.training))
    trainer = make(model, tmp_path, kind="causal")
    # the kind probe runs in evaluation mode; the one training-mode forward is the check of
    # which dropout the model applies
    assert trainer._rdrop_kind == "causal" and calls == [True]
    with pytest.raises(ValueError, match="rdrop_model_kind must be 'auto' or one of causal, "
                                         "seq2seq, encoder, got 'decoder'"):
        make(model, tmp_path / "bad", kind="decoder")
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------ settings refused early

def test_data_parallel_in_one_process_is_refused_saying_how_to_launch(tmp_path, monkeypatch):
    """Several GPUs visible to one process: the Trainer would wrap the model in
    nn.DataParallel, which splits [x; x] into its copies with the same dropout masks."""
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="2 GPUs are visible to one process.*nn.DataParallel"
                                         ".*torchrun --nproc_per_node N"):
        make(tiny("gpt2"), tmp_path)
    assert not (tmp_path / "out").exists()


def test_data_parallel_is_refused_where_the_trainer_makes_the_arguments(tmp_path,
                                                                        monkeypatch):
    """No args given: the Trainer makes its own, which the same check reads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="2 GPUs are visible to one process"):
        quiet(hf.RDropTrainer, model=tiny("gpt2"))


@pytest.mark.parametrize("field", ["tp_size", "cp_size", "sp_size"])
def test_tensor_context_and_sequence_parallelism_are_refused(field):
    config = types.SimpleNamespace(tp_size=None, cp_size=None, sp_size=None)
    setattr(config, field, 2)
    training = types.SimpleNamespace(n_gpu=1, parallelism_config=config)
    with pytest.raises(ValueError, match=f"parallelism \\({field} 2\\) are not supported"):
        hf.trainers.check_parallelism("RDropTrainer", training)
    hf.trainers.check_parallelism("RDropTrainer", types.SimpleNamespace(
        n_gpu=1, parallelism_config=types.SimpleNamespace(tp_size=1, cp_size=None, sp_size=1)))


def test_trl_loss_types_other_than_nll_are_refused(tmp_path):
    trl = imported_trl()

    class RDropSFTTrainer(hf.RDropMixin, trl.SFTTrainer):
        pass

    config = quiet(trl.SFTConfig, output_dir=str(tmp_path / "out"), use_cpu=True,
                   report_to="none", loss_type="dft")
    with pytest.raises(ValueError, match="TRL's loss_type 'dft' is not R-Drop's cross-entropy"
                                         ".*set loss_type='nll'"):
        RDropSFTTrainer(model=tiny("gpt2"), args=config)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------- evaluation and logs

def test_evaluation_of_a_model_without_loss_arguments_is_the_plain_trainers(tmp_path):
    """The item count the training loop passes is not passed to a forward that takes no
    loss arguments in evaluation (a TypeError before), and eval_loss is the plain
    Trainer's: the model's own mean loss."""
    torch.manual_seed(0)
    model = NoLossKwargsLM(GPT2Config(vocab_size=99, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=32))
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 99, (5, 6),
                                                                        generator=g)]
    ours = make(model, tmp_path, per_device_eval_batch_size=2).evaluate(data)["eval_loss"]
    plain = quiet(Trainer, model=model, args=args(tmp_path, per_device_eval_batch_size=2))
    assert ours == pytest.approx(plain.evaluate(data)["eval_loss"], rel=1e-6)


def test_the_log_has_one_passs_cross_entropy_and_the_kl(tmp_path):
    """logging_steps 1: each training log has rdrop_ce and rdrop_kl, and its loss is
    2 rdrop_ce + alpha rdrop_kl (per labelled token, label smoothing off); the KL is > 0
    (dropout 0.2). rdrop_ce is the cross-entropy of the logits, computed here."""
    model = tiny("gpt2")
    data = [{k: v[i] for k, v in batch("gpt2", seed).items()} for seed in (1, 2)
            for i in range(3)]
    trainer = make(model, tmp_path, alpha=2.0, max_steps=2, logging_steps=1,
                   learning_rate=0.0)
    trainer.train_dataset = data
    quiet(trainer.train)
    logs = [entry for entry in trainer.state.log_history if "rdrop_ce" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["rdrop_kl"] > 0
        assert entry["loss"] == pytest.approx(2 * entry["rdrop_ce"] + 2.0 * entry["rdrop_kl"],
                                              abs=2e-3)
        assert 10.0 < entry["rdrop_ce"] < 11.5  # about log(50,000) = 10.8 for random weights


# --------------------------------------------------------------- the fused head

def test_peft_modules_to_save_head_goes_through_the_fused_path(tmp_path):
    """LoRA with modules_to_save=["lm_head"]: the trainable copy is the head the fused path
    uses, and its loss and gradients are the logits path's."""
    import peft

    results = {}
    for fused in (False, True):
        model = tiny("llama")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
            modules_to_save=["lm_head"]))
        trainer = make(model, tmp_path, fused=fused)
        model.train()
        torch.manual_seed(7)
        loss = trainer.compute_loss(model, batch("llama"))
        loss.backward()
        results[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None})
    (loss0, grads0), (loss1, grads1) = results[False], results[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    copy = [n for n in grads0 if "modules_to_save" in n and "lm_head" in n]
    assert copy and grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-7)


def test_a_head_with_a_forward_of_its_own_is_refused_by_the_fused_path(tmp_path):
    """accelerate's device hooks (device_map, offload) set the head's forward on the
    instance: the fused path would bypass it, so it is refused; the logits path keeps it,
    and the head's forward is the same object after an R-Drop step."""
    model = tiny("gpt2")
    calls = []
    original = model.lm_head.forward

    def hooked(hidden):
        calls.append(1)
        return original(hidden)

    model.lm_head.forward = hooked
    with pytest.raises(ValueError, match="output embedding carries a forward of its own"):
        make(model, tmp_path, fused=True)
    trainer = make(model, tmp_path)
    trainer.compute_loss(model.train(), batch("gpt2"))
    assert model.lm_head.forward is hooked and calls


def test_the_fused_paths_products_follow_bf16_autocast(tmp_path):
    """Under bf16 autocast (CPU) the fused path multiplies in bf16 as the head would: its
    loss is the logits path's under autocast within bf16's precision, not float32's."""
    model = tiny("llama", dropout=0.0)
    inputs = batch("llama")

    def loss(fused, autocast):
        trainer = make(model, tmp_path, fused=fused, alpha=1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
            return float(trainer.compute_loss(model.train(), dict(inputs)))

    float32, fused_bf16, logits_bf16 = loss(True, False), loss(True, True), loss(False, True)
    assert fused_bf16 != float32
    assert fused_bf16 == pytest.approx(logits_bf16, rel=1e-2)
    assert abs(fused_bf16 - float32) > 1e-6 * float32


# ------------------------------------------------------------ a loop of one's own

def test_rdrop_hf_loss_in_a_plain_loop_is_the_trainers_loss(tmp_path):
    """The documented loop (model_kind once, rdrop_hf_loss per batch) gives the trainer's
    loss and gradient, and the formula's, on a causal LM with dropout."""
    model = tiny("gpt2")
    inputs = batch("gpt2")
    kind = hf.model_kind(model)
    trainer = make(model, tmp_path, alpha=1.5)  # (the Trainer seeds torch when it is made)
    model.train()
    torch.manual_seed(7)
    out = rdrop_hf_loss(model, inputs, kind=kind, alpha=1.5, grad_in_scores=False)
    logits = out.outputs.logits.detach()  # (read: their buffer must not take the gradient)
    out.loss.backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch.manual_seed(7)
    trainer_loss = trainer.compute_loss(model, dict(inputs))
    trainer_loss.backward()
    assert float(out.loss) == float(trainer_loss)
    for name, grad in mine.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad)
    want = formula(logits[:, :-1], inputs["labels"][:, 1:], 1.5)
    assert float(out.loss) == pytest.approx(float(want), rel=1e-5)
    assert int(out.items) == int(inputs["labels"][:, 1:].ne(-100).sum())
    assert math.isfinite(float(out.kl)) and float(out.kl) > 0


# ------------------------------------------------------------- vision-language batches

def tiny_llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, \
        LlavaForConditionalGeneration

    torch.manual_seed(0)
    return LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       image_size=8, patch_size=4, projection_dim=16),
        text_config=LlamaConfig(vocab_size=99, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, pad_token_id=0),
        image_token_index=98, vision_feature_layer=-1))


def assert_twice_its_own_and_in_order(model, inputs):
    """At alpha 0 (evaluation mode: no dropout) R-Drop's loss is twice the model's own, and
    the images in another order give another loss (so the order is what made it equal)."""
    with torch.no_grad():
        own = model(**inputs).loss
        ours = rdrop_hf_loss(model, inputs, kind="causal", alpha=0.0).loss
        swapped = rdrop_hf_loss(model, {**inputs, "pixel_values": inputs["pixel_values"]
                                        .flip(0)}, kind="causal", alpha=0.0).loss
    assert float(ours) == pytest.approx(2 * float(own), rel=1e-6)
    assert abs(float(swapped) - float(ours)) > 1e-4


def test_image_batches_are_doubled_in_their_order_of_appearance():
    """LLaVA: 3 images for 2 examples (2 in the first, 4 image tokens each), so the images
    are not a batch dimension; repeated in their order they meet [x; x]'s image tokens,
    and at alpha 0 (evaluation mode: no dropout) R-Drop's loss is twice the model's own.
    The images differ: the wrong order would change the loss."""
    model = tiny_llava().eval()
    assert hf.model_kind(model) == "causal"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 14), generator=g)
    ids[0, 1:9] = 98  # two images
    ids[1, 2:6] = 98  # one image
    pixels = torch.randn(3, 3, 8, 8, generator=g)
    labels = torch.where(ids.eq(98), -100, ids)
    assert_twice_its_own_and_in_order(model, {"input_ids": ids, "pixel_values": pixels,
                                              "labels": labels})


def test_multimodal_position_ids_are_doubled_along_their_batch_dimension():
    """Qwen-VL's (3, B, L) rotary positions: [x; x] along dim 1; flattened patches and
    their grids repeated in order; any other entry whose dim 0 is not the batch refused."""
    positions = torch.arange(3 * 2 * 5).view(3, 2, 5)
    patches, grid = torch.randn(7, 4), torch.tensor([[1, 1, 7]])
    out = hf.doubled_batch({"input_ids": torch.ones(2, 5, dtype=torch.long),
                            "position_ids": positions, "pixel_values": patches,
                            "image_grid_thw": grid}, 2)
    assert torch.equal(out["position_ids"], torch.cat([positions, positions], dim=1))
    assert torch.equal(out["pixel_values"], torch.cat([patches, patches]))
    assert torch.equal(out["image_grid_thw"], torch.cat([grid, grid]))
    with pytest.raises(hf.RDropBatchError, match="cannot duplicate inputs\\['cache_position'\\]"):
        hf.doubled_batch({"input_ids": torch.ones(2, 5), "cache_position": torch.arange(5)}, 2)
    with pytest.raises(hf.RDropBatchError, match="position_ids'\\] of shape \\(3, 4, 5\\)"):
        hf.doubled_batch({"position_ids": torch.zeros(3, 4, 5)}, 2)


def test_token_accuracy_counts_both_passes_highest_logits():
    """accuracy=True (what TRL's mean_token_accuracy and entropy are made from): the labelled
    positions of both passes whose highest logit is the target, the same through the fused
    head, and their summed entropy through the logits."""
    model = tiny("gpt2", dropout=0.0)
    inputs = batch("gpt2")
    with torch.no_grad():  # some labels made what the model predicts, so that some count
        guess = model(input_ids=inputs["input_ids"]).logits.argmax(-1)
    inputs["labels"][:, 3:5] = guess[:, 2:4]
    model.train()
    torch.manual_seed(7)
    out = rdrop_hf_loss(model, inputs, kind="causal", accuracy=True, grad_in_scores=False)
    target = inputs["labels"][:, 1:]
    argmax = out.outputs.logits[:, :-1].argmax(-1).view(2, *target.shape)
    want = int(((argmax == target) & target.ne(-100)).sum())
    assert int(out.correct) == want and want > 0
    # the entropy of both passes' predicted distributions at the labelled positions
    log_p = torch.log_softmax(out.outputs.logits[:, :-1].double(), -1)
    per_row = -(log_p.exp() * log_p).sum(-1).view(2, *target.shape)
    entropy = float(torch.where(target.ne(-100), per_row, 0).sum())
    assert float(out.entropy) == pytest.approx(entropy, rel=1e-5) and entropy > 0
    torch.manual_seed(7)
    fused = rdrop_hf_loss(model, inputs, kind="causal", accuracy=True, fused_linear=True)
    assert int(fused.correct) == want and fused.entropy is None


def test_qwen2_vl_flattened_patches_are_doubled_with_their_grids():
    """Qwen2-VL: two examples' images as one (20, 12) block of patches with their grids
    (16 and 4 patches) and the multimodal rotary positions it computes from them: at
    alpha 0 R-Drop's loss is twice the model's own; the patches in another order give
    another loss. Its text-only probe reads it as causal."""
    from packaging.version import Version
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if Version(transformers.__version__) < Version("5"):
        pytest.skip("Qwen2-VL's configuration and inputs (text_config, mm_token_type_ids) "
                    "as transformers 5 has them")
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                           patch_size=2, temporal_patch_size=1, spatial_merge_size=1),
        image_token_id=97, video_token_id=96, vision_start_token_id=95,
        vision_end_token_id=94)
    torch.manual_seed(0)
    model = quiet(Qwen2VLForConditionalGeneration, config).eval()
    assert hf.model_kind(model) == "causal"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 24), generator=g)
    ids[0, 1], ids[0, 2:18], ids[0, 18] = 95, 97, 94  # a 4 x 4 image
    ids[1, 3], ids[1, 4:8], ids[1, 8] = 95, 97, 94  # a 2 x 2 image
    patches = torch.randn(20, 12, generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": ids.eq(97).long(), "pixel_values": patches,
              "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 2]]),
              "labels": torch.where(ids.ge(94), -100, ids)}
    assert_twice_its_own_and_in_order(model, inputs)


def test_eval_loss_is_the_models_mean_over_the_tokens_it_predicts(tmp_path):
    """GPT-2 (its forward takes loss arguments) in batches of unequal labelled tokens:
    RDropTrainer's eval_loss is the mean, over the evaluation batches, of the model's
    cross-entropy per predicted token, computed here; no item count reaches the model (a
    count of every label would make it 1/L low) and nothing multiplies it."""
    model = tiny("gpt2", dropout=0.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (4, 7), generator=g)
    labels = ids.clone()
    labels[2:, 4:] = -100
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]
    got = make(model, tmp_path, per_device_eval_batch_size=2).evaluate(data)["eval_loss"]
    model.eval()
    means = []
    with torch.no_grad():
        for rows in (slice(0, 2), slice(2, 4)):
            logits = model(input_ids=ids[rows]).logits[:, :-1].double()
            means.append(F.cross_entropy(logits.flatten(0, 1), labels[rows, 1:].flatten()))
    assert got == pytest.approx(float(sum(means) / 2), rel=1e-5)

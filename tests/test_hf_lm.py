"""RDropTrainer on the paper's own kinds of model, in Hugging Face: encoder-decoder LMs
(Marian, BART, T5, EncoderDecoderModel) and causal LMs (GPT-2, Llama-style, tied and
untied), from the logits and through the fused linear path; Seq2SeqTrainer, TRL's
SFTTrainer and PEFT LoRA; gradient accumulation on a model whose forward takes no loss
arguments.

Every expected loss comes from one forward of the same model on [x; x] under the same seed
(the same dropout masks as the trainer's forward), written here in float64 from the
definitions: per labelled target token of one pass, the label-smoothed cross-entropy of
both passes as Hugging Face smooths it ((1 - f) on the target, f / V on every class) plus
alpha / 2 (KL(P1||P2) + KL(P2||P1)); a causal LM's logits at t against its labels at t + 1
(sliced, not the trainer's shift). Gradients are autograd's, of that loss. Models: tiny
random ones built from configurations, V = 50,000 and widths of 16 (offline).
"""

import inspect
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
from transformers import (BartConfig, BartForConditionalGeneration, BertConfig,  # noqa: E402
                          BertLMHeadModel, BertModel, EncoderDecoderModel, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MarianConfig,
                          MarianMTModel, T5Config, T5ForConditionalGeneration,
                          TrainingArguments)

from rdrop_fairseq import hf  # noqa: E402
from rdrop_fairseq.hf import RDropSeq2SeqTrainer, RDropTrainer  # noqa: E402
from tests.test_hf import accumulated_gradients  # noqa: E402

V = 50_000
D = 16


def tiny(name, dropout=0.2, tied=True):
    """A tiny random model of each kind, with dropout everywhere it has one."""
    torch.manual_seed(0)
    if name == "marian":
        model = MarianMTModel(MarianConfig(
            vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, dropout=dropout, attention_dropout=dropout))
        # Marian adds final_logits_bias after its head (zeros when made): make it count
        model.final_logits_bias.normal_(0, 0.5)
        return model
    if name == "bart":
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, dropout=dropout,
            attention_dropout=dropout))
        model.final_logits_bias.normal_(0, 0.5)
        return model
    if name == "t5":  # tied: the decoder's output is scaled by d_model ** -0.5 before the head
        return T5ForConditionalGeneration(T5Config(
            vocab_size=V, d_model=D, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, dropout_rate=dropout, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, tie_word_embeddings=True))
    if name == "encoder-decoder":  # BERT encoder, BERT decoder with an MLP before its head
        small = dict(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = EncoderDecoderModel(encoder=BertModel(BertConfig(**small)),
                                    decoder=BertLMHeadModel(BertConfig(
                                        **small, is_decoder=True, add_cross_attention=True)))
        model.config.decoder_start_token_id, model.config.pad_token_id = 2, 0
        return model
    if name == "gpt2":  # tied, and its head has no bias
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2,
                                          n_positions=32, resid_pdrop=dropout,
                                          embd_pdrop=dropout, attn_pdrop=dropout))
    assert name == "llama"
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attention_dropout=dropout, tie_word_embeddings=tied, pad_token_id=0))


SEQ2SEQ = ["marian", "bart", "t5", "encoder-decoder"]
CAUSAL = ["gpt2", "llama", "llama-tied"]


def model_for(case, **kwargs):
    name, tied = (case[:-len("-tied")], True) if case.endswith("-tied") else (case, False)
    return tiny(name, tied=tied, **kwargs)


def batch(case, seed=1):
    """Inputs of 3 examples, some padding, labels with -100 where nothing is predicted."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = mask[2, 3:] = 0
    if case in SEQ2SEQ:
        labels = torch.randint(3, V, (3, 6), generator=g)
        labels[1, 4:] = labels[2, 2:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    labels = torch.where(mask.bool(), ids, -100)
    labels[0, :2] = -100  # a prompt, as completion-only masking leaves it
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_args(tmp_path, **overrides):
    return TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 3, "max_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, **overrides})


def make(model, tmp_path, alpha=1.0, fused=False, chunk_mb=0.0, kind="auto", **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's own notes about the tiny models
        return RDropTrainer(model=model, args=training_args(tmp_path, **overrides),
                            rdrop_alpha=alpha, rdrop_fused_linear=fused, rdrop_chunk_mb=chunk_mb,
                            rdrop_model_kind=kind)


def doubled_logits(model, inputs):
    """The logits of [x; x] in one forward, and the targets they are scored against."""
    features = {k: v for k, v in inputs.items() if k != "labels"}
    labels = inputs["labels"]
    if model.config.is_encoder_decoder:
        features["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    logits = model(**{k: torch.cat([v, v]) for k, v in features.items()}, use_cache=False).logits
    if not model.config.is_encoder_decoder:  # t predicts t + 1
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


def formula(logits, labels, alpha, smoothing=0.0):
    """R-Drop's loss per labelled token of one pass (float64), Hugging Face's smoothing."""
    lp1, lp2 = F.log_softmax(logits.double(), -1).chunk(2)
    kept = labels.ne(-100)
    t = torch.where(kept, labels, 0).unsqueeze(-1)
    vocab = logits.size(-1)

    def ce(lp):
        nll = -lp.gather(-1, t).squeeze(-1)
        return (1 - smoothing) * nll + smoothing / vocab * -lp.sum(-1)

    kl = 0.5 * ((lp1.exp() * (lp1 - lp2)).sum(-1) + (lp2.exp() * (lp2 - lp1)).sum(-1))
    per_token = ce(lp1) + ce(lp2) + alpha * kl
    return torch.where(kept, per_token, 0).sum() / kept.sum()


def gradients(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def trainer_loss(trainer, model, inputs, seed=7):
    model.train()
    torch.manual_seed(seed)
    loss = trainer.compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), gradients(model)


def assert_same_gradients(got, want, rtol=1e-4, atol=1e-8):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name].double(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def assert_norm_close(mine, theirs, name, rel=1e-5):
    """Within ``rel`` of the tensor's norm; 1e-9 absolute for gradients that are 0 in exact
    arithmetic (an attention key's bias: the softmax ignores a shift) and float32 noise."""
    err = float((mine.double() - theirs.double()).norm())
    assert err <= rel * float(theirs.double().norm()) + 1e-9, (name, err, float(theirs.norm()))


# ------------------------------------------------------------------- the loss, both paths

@pytest.mark.parametrize("case", SEQ2SEQ + CAUSAL)
def test_training_loss_and_gradient_are_the_formulas(tmp_path, case):
    """Label smoothing 0.1 (Hugging Face's convention), alpha 0.7, padding and -100."""
    model = model_for(case)
    inputs = batch(case)
    trainer = make(model, tmp_path, alpha=0.7, label_smoothing_factor=0.1)
    model.train()
    torch.manual_seed(7)
    logits, labels = doubled_logits(model, inputs)
    expected = formula(logits, labels, 0.7, smoothing=0.1)
    expected.backward()
    want = gradients(model)
    loss, got = trainer_loss(trainer, model, inputs)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    assert_same_gradients(got, want)
    first, second = logits.detach().chunk(2)
    assert not torch.allclose(first, second)  # dropout made the passes differ
    assert float(loss) > float(formula(logits.detach(), labels, 0.0, smoothing=0.1)) + 1e-6


@pytest.mark.parametrize("case", SEQ2SEQ + CAUSAL)
def test_fused_linear_equals_the_logits_path(tmp_path, case):
    """rdrop_fused_linear: the loss from the hidden states and the output embedding (tied
    or not, with the head's bias and BART/Marian's final_logits_bias): the same loss, and
    the same gradients of every parameter (the output embedding's included) and of the
    hidden states the head receives, to 1e-5 in float32."""
    results = []
    for fused in (False, True):
        model = model_for(case)
        inputs = batch(case)
        trainer = make(model, tmp_path / str(fused), alpha=0.7, fused=fused,
                       label_smoothing_factor=0.1)
        head = model.get_output_embeddings()
        hidden = []
        handle = head.register_forward_pre_hook(
            lambda module, args: hidden.append(args[0]) or args[0].retain_grad())
        loss, grads = trainer_loss(trainer, model, inputs)
        handle.remove()
        assert len(hidden) == 1
        results.append((loss, grads, hidden[0].grad))
    (loss, grads, hidden_grad), (fused_loss, fused_grads, fused_hidden_grad) = results
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-7)
    assert fused_grads.keys() == grads.keys()
    for name in grads:  # each tensor within 1e-5 of its norm (single entries near 0 vary)
        assert_norm_close(fused_grads[name], grads[name], name)
    assert_norm_close(fused_hidden_grad, hidden_grad, "hidden states")


def test_fused_linear_never_makes_the_logits(tmp_path):
    """No tensor of 2N x V elements is allocated in a fused step (the logits path makes the
    logits, N = 3 x 6 target positions per pass here)."""
    from tests.test_fused_linear import LargestTensor

    largest = {}
    for fused in (False, True):
        model = model_for("llama")
        trainer = make(model, tmp_path / str(fused), fused=fused, chunk_mb=0.25)
        model.train()
        with LargestTensor() as seen:
            trainer.compute_loss(model, batch("llama")).backward()
        largest[fused] = seen.largest
    assert largest[False] >= 2 * 3 * 7 * V
    assert largest[True] < 2 * 3 * 7 * V / 2, largest


@pytest.mark.parametrize("fused", [False, True])
def test_a_batch_without_labelled_tokens_adds_nothing(tmp_path, fused):
    model = model_for("gpt2")
    inputs = batch("gpt2")
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    loss, grads = trainer_loss(make(model, tmp_path, fused=fused), model, inputs)
    assert float(loss) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads.values())


class TupleLM(GPT2LMHeadModel):
    """A model whose forward returns a tuple (as with ``return_dict=False``)."""

    def forward(self, *args, **kwargs):
        return (super().forward(*args, **kwargs).logits,)


def test_a_model_returning_a_tuple_is_read_by_its_first_element(tmp_path):
    torch.manual_seed(0)
    model = TupleLM(tiny("gpt2").config)
    inputs = batch("gpt2")
    # it returns no loss, so its kind cannot be read from it: the user says it
    with pytest.raises(ValueError, match="TupleLM returned no loss for labels, so how its "
                                         "logits line up .* pass rdrop_model_kind"):
        make(model, tmp_path)
    loss, _ = trainer_loss(make(model, tmp_path, kind="causal"), model, inputs)
    model.train()
    torch.manual_seed(7)
    with torch.no_grad():
        (logits,) = model(input_ids=torch.cat([inputs["input_ids"]] * 2),
                          attention_mask=torch.cat([inputs["attention_mask"]] * 2),
                          use_cache=False)
    want = formula(logits[:, :-1], inputs["labels"][:, 1:], 1.0)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def test_bf16_autocast_on_the_cpu_is_float32s_loss_within_bf16(tmp_path):
    """TrainingArguments(bf16=True) on the CPU runs the forward under bf16 autocast; the
    loss and gradients are float32's to bf16's precision (the loss's sums stay float32)."""
    results = []  # (tests/conftest.py keeps bf16 from reaching later trainers)
    for bf16 in (False, True):
        model = model_for("llama")
        trainer = make(model, tmp_path / str(bf16), bf16=bf16)
        with trainer.compute_loss_context_manager(), trainer.autocast_smart_context_manager():
            results.append(trainer_loss(trainer, model, batch("llama")))
    (loss, grads), (bf16_loss, bf16_grads) = results
    assert float(bf16_loss) == pytest.approx(float(loss), rel=2e-2)
    total = torch.cat([g.flatten() for g in grads.values()])
    total_bf16 = torch.cat([g.flatten() for g in bf16_grads.values()])
    assert float((total_bf16 - total).norm() / total.norm()) < 5e-2


# ----------------------------------------------------------- gradient accumulation

class NoLossKwargsLM(GPT2LMHeadModel):
    """GPT-2 whose forward names its arguments and takes no ``**kwargs``: the Trainer then
    counts it as not normalising its loss over the accumulated batch, and its own rule
    (divide by the accumulation steps) cannot coincide with RDropTrainer's."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               labels=labels, use_cache=use_cache)


def test_gradient_accumulation_gives_the_gradient_of_one_batch_k_times_as_large(tmp_path):
    """2 steps of 2 examples accumulate the gradient of one step of 4, although the two
    micro-batches hold different numbers of labelled tokens; dropout is off and a hook
    makes the second pass differ, so that both runs see the same passes and the KL counts."""
    torch.manual_seed(0)
    model = NoLossKwargsLM(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, V, (4, 6), generator=g)
    labels = ids.clone()
    labels[2:, 3:] = -100  # the second micro-batch: 2 predicted tokens an example, not 5
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]

    signature = inspect.signature(model.forward).parameters.values()
    assert not any(p.kind == p.VAR_KEYWORD for p in signature)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every dropout is 0: the hook stands in for it
        grads = accumulated_gradients(model, model.transformer.ln_f, data, tmp_path,
                                      ((4, 1), (2, 2)))
    torch.testing.assert_close(grads[2], grads[1], rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------- the other trainers

def test_seq2seq_trainer_trains_and_generates_with_one_pass(tmp_path):
    """10 steps of RDropSeq2SeqTrainer on Marian, then evaluation with
    predict_with_generate: the generation sees the batches as they are (not doubled)."""
    from transformers import Seq2SeqTrainingArguments

    model = tiny("marian")
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(3, V, (6,), generator=g),
             "labels": torch.randint(3, V, (5,), generator=g)} for _ in range(8)]
    seen = []
    model.model.encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].size(0), module.training)),
        with_kwargs=True)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                    report_to="none", per_device_train_batch_size=4,
                                    per_device_eval_batch_size=4, max_steps=10,
                                    save_strategy="no", disable_tqdm=True,
                                    predict_with_generate=True, generation_max_length=8,
                                    learning_rate=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RDropSeq2SeqTrainer(model=model, args=args, train_dataset=data,
                                      eval_dataset=data[:4], rdrop_alpha=1.0)
        seen.clear()  # the probe that read the model's kind
        result = trainer.train()
    assert result.global_step == 10 and math.isfinite(result.training_loss)
    assert seen and all(size == 8 and training for size, training in seen)  # [x; x]
    seen.clear()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert seen and all(size == 4 and not training for size, training in seen)
    predictions = trainer.predict(data[:4]).predictions
    assert predictions.shape[0] == 4


def imported_trl():
    try:
        import trl
        trl.SFTTrainer  # imported lazily
    except Exception as error:  # trl 1.16 needs transformers >= 4.56.2: not the floor's
        pytest.skip(f"trl does not import with transformers {transformers.__version__}: {error}")
    return trl


def test_sft_trainer_with_completion_only_loss(tmp_path):
    """TRL's SFTTrainer with RDropMixin first, on prompt/completion data: 10 steps, the
    prompt tokens labelled -100 by TRL's collator, R-Drop's loss on the completion."""
    trl = imported_trl()
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(60)]
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>",
                                        eos_token="<eos>")
    g = torch.Generator().manual_seed(5)
    rows = [{"prompt": " ".join(words[j] for j in torch.randint(0, 60, (4,), generator=g)),
             "completion": " " + " ".join(words[j] for j in torch.randint(0, 60, (3,),
                                                                          generator=g))}
            for _ in range(12)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=D,
                                         intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32, attention_dropout=0.1,
                                         pad_token_id=0, eos_token_id=1))

    class RDropSFTTrainer(hf.RDropMixin, trl.SFTTrainer):
        pass

    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("labels")), with_kwargs=True)
    config = trl.SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                           per_device_train_batch_size=4, max_steps=10, save_strategy="no",
                           disable_tqdm=True, completion_only_loss=True, learning_rate=1e-3,
                           max_length=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RDropSFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                                  processing_class=tokenizer, rdrop_alpha=1.0)
        seen.clear()  # the probe that read the model's kind
        batches, tokens = [], []
        original = trainer.compute_loss

        def spy(model, inputs, *args, **kwargs):
            batches.append(inputs["labels"].clone())
            tokens.append(int(inputs["attention_mask"].sum()))
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = spy
        result = trainer.train()
    assert result.global_step == 10 and math.isfinite(result.training_loss)
    assert all(labels is None for labels in seen)  # the loss is ours, not the model's
    logged = [e for e in trainer.state.log_history if "rdrop_ce" in e]
    assert logged and all(0 <= e["mean_token_accuracy"] <= 1
                          and 0 < e["entropy"] <= math.log(model.config.vocab_size) + 1e-3
                          for e in logged)
    assert logged[-1]["num_tokens"] == sum(tokens)  # the batches' tokens, not the doubled
    first = batches[0]
    assert (first[:, :4] == -100).all() and (first != -100).any()  # the prompt is masked


def test_a_padding_free_batch_is_refused_saying_what_to_set(tmp_path):
    """TRL's padding_free packs a batch's sequences into one row with cu_seq_lens_*."""
    model = model_for("llama")
    inputs = {"input_ids": torch.arange(3, 13).view(1, 10),
              "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]),
              "labels": torch.arange(3, 13).view(1, 10),
              "cu_seq_lens_q": torch.tensor([0, 4, 7, 10], dtype=torch.int32)}
    trainer = make(model, tmp_path)
    model.train()
    with pytest.raises(ValueError, match="padding-free batch .* set padding_free=False"):
        trainer.compute_loss(model, inputs)


def test_lora_trains_only_the_adapters_and_their_dropout_makes_the_kl(tmp_path):
    peft = pytest.importorskip("peft")
    results = {}
    for lora_dropout in (0.1, 0.0):
        base = model_for("llama", dropout=0.0)
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM", init_lora_weights=False))  # B = 0 would add nothing yet
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=1.0)
        ours = [w for w in caught if "every dropout" in str(w.message)]
        model.train()
        torch.manual_seed(3)
        inputs = batch("llama")
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        assert with_grad and all("lora_" in n for n in with_grad), with_grad
        # the KL alone: alpha 1 minus alpha 0 on the same masks
        trainer.rdrop_alpha = 0.0
        torch.manual_seed(3)
        without = trainer.compute_loss(model, dict(inputs))
        results[lora_dropout] = (float(loss) - float(without), len(ours))
    assert results[0.1][0] > 1e-7 and results[0.1][1] == 0
    assert abs(results[0.0][0]) < 1e-9 and results[0.0][1] == 1


# ------------------------------------------------------------------------ bad input

def files_in(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_a_head_the_fused_path_cannot_reproduce_is_refused_when_the_trainer_is_made(tmp_path):
    """Named where the configuration says so (soft-capping), found by comparing a small
    forward's logits with the head's product otherwise (a scale the code does not know)."""
    model = model_for("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"soft-caps the logits \(final_logit_softcapping = 30.0\)"):
        make(model, tmp_path, fused=True)

    class ScaledLogits(GPT2LMHeadModel):  # its own loss is of the scaled logits
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = out.logits * 0.5
            if labels is not None:  # (an item: older ModelOutputs drop a new attribute)
                out["loss"] = F.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                           labels[:, 1:].flatten())
            return out

    torch.manual_seed(0)
    scaled = ScaledLogits(tiny("gpt2").config)
    with pytest.raises(ValueError, match="logits are not its output embedding applied"):
        make(scaled, tmp_path, fused=True)
    make(scaled, tmp_path)  # the logits path takes it

    class ScaledAfterLoss(GPT2LMHeadModel):  # its own loss is of the logits before the scale
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    with pytest.raises(ValueError, match="ScaledAfterLoss's own loss on a probe batch .* is not "
                                         "the cross-entropy of its logits read as any kind"):
        make(ScaledAfterLoss(tiny("gpt2").config), tmp_path)
    assert not (tmp_path / "out").exists() or files_in(tmp_path / "out") == []


def test_uncovered_models_and_versions_are_refused_before_anything_is_made(tmp_path, monkeypatch):
    from transformers import BertForNextSentencePrediction

    qa = BertForNextSentencePrediction(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32))
    with pytest.raises(ValueError, match="next-sentence-prediction head.*Covered: sequence "
                                         "classification"):
        make(qa, tmp_path)
    with pytest.raises(ValueError, match="a bare model, without a head"):
        make(BertModel(qa.config), tmp_path)
    monkeypatch.setattr(hf.trainers.transformers, "__version__", "4.48.3")
    with pytest.raises(RuntimeError, match="supports transformers >= 4.49.0, < 6; this is 4.48.3"):
        make(tiny("gpt2"), tmp_path)
    monkeypatch.setattr(hf.trainers.transformers, "__version__", "6.0.0")
    with pytest.raises(RuntimeError, match="this is 6.0.0"):
        make(tiny("gpt2"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_model_init_gets_the_checks_a_model_gets(tmp_path):
    def scaled_llama():
        model = model_for("llama")
        model.config.final_logit_softcapping = 30.0
        return model

    with pytest.raises(ValueError, match="soft-caps the logits"):
        RDropTrainer(model_init=scaled_llama, args=training_args(tmp_path),
                     rdrop_fused_linear=True)
    trainer = RDropTrainer(model_init=lambda: model_for("gpt2"), args=training_args(tmp_path))
    assert trainer._rdrop_kind == "causal"


def test_the_setup_floor_is_the_admitted_range():
    """setup.py's hf extra admits exactly TRANSFORMERS_RANGE."""
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    low, high = hf.TRANSFORMERS_RANGE
    assert re.search(rf'"transformers>={re.escape(low)},<{high}"', setup)

"""Which R-Drop loss path each recipe trains through: the config its script's own command
composes (as fairseq-hydra-train composes it) and the line its train stage prints first.
The recipes run the logits path, the one measured on a GPU (docs/benchmarks.md#which-loss-
path-the-recipes-run); ``criterion.rdrop_fused_linear=true`` among the train arguments wins."""

import pytest

from benchmarks import bench_recipe_memory as bench
from tests.recipe_helpers import dry_run

# the recipes whose criterion has a vocabulary for the fused-linear path to project onto
TOKEN_LEVEL = ["iwslt14", "wmt14", "wikitext103-gpt", "cnndm_bart"]


def loss_line(recipe, *args, **env):
    """The line the recipe's train stage prints about its loss (a dry run on one GPU)."""
    r = bench.RECIPES[recipe]
    _, proc = dry_run(r.script, "train", *args, GPUS=1, BART_DIR="/nonexistent",
                      **{**r.env, **env})
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"[{r.script}] loss:")]
    return line


def criterion_of(recipe, *args):
    return bench.compose(bench.script_command(recipe, args=args), "/nonexistent").criterion


@pytest.mark.parametrize("recipe", TOKEN_LEVEL)
def test_the_recipes_default_is_the_logits_path_and_they_say_so(recipe):
    criterion = criterion_of(recipe)
    assert criterion.rdrop_alpha > 0  # R-Drop on: the path matters
    assert (criterion.rdrop_fused_linear, criterion.rdrop_impl) == (False, "auto")
    line = loss_line(recipe)
    assert "loss: the logits path (the recipe's default)" in line
    assert "rdrop_impl auto (the Triton kernel on CUDA)" in line


@pytest.mark.parametrize("recipe", TOKEN_LEVEL)
@pytest.mark.parametrize("override", ["criterion.rdrop_fused_linear=true",
                                      "++criterion.rdrop_fused_linear=True"])
def test_the_users_override_turns_the_fused_linear_path_on(recipe, override):
    assert criterion_of(recipe, override).rdrop_fused_linear is True
    line = loss_line(recipe, override)
    assert f"loss: the fused-linear path (your override {override})" in line
    assert "not measured on a GPU since its rework" in line


def test_an_impl_override_is_named_and_false_stays_the_logits_path():
    criterion = criterion_of("iwslt14", "++criterion.rdrop_impl=torch",
                             "criterion.rdrop_fused_linear=false")
    assert (criterion.rdrop_fused_linear, criterion.rdrop_impl) == (False, "torch")
    line = loss_line("iwslt14", "++criterion.rdrop_impl=torch", "criterion.rdrop_fused_linear=false")
    assert "the logits path (your override criterion.rdrop_fused_linear=false)" in line
    assert "rdrop_impl torch;" in line


def test_the_baseline_and_the_adaptive_softmax_say_what_they_run():
    assert "loss: label_smoothed_cross_entropy as fairseq computes it (MODE=baseline" in (
        loss_line("iwslt14", MODE="baseline"))
    line = loss_line("wikitext103-adaptive")
    assert "adaptive_loss_rdrop: chunks of the vocabulary, no fused-linear path" in line
    assert criterion_of("wikitext103-adaptive").rdrop_fused_linear is False


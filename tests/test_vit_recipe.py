"""The ViT image-classification recipe (scripts/vit.sh, rdrop_fairseq.recipes.vit and
vit_data) on stand-ins built here: a tiny CIFAR-100 tarball in the real python layout and a
tiny ViT's hub files, served by a loopback server standing in for the CIFAR site and the
Hugging Face hub; tiny ImageNet class folders of PNG images. CIFAR-100 runs prepare ->
train (fetching the weights) -> a rerun resumed from the last checkpoint -> the test
split's top-1 accuracy through the script, checked against predictions made here. The
script's settings are checked against the settings table in dry runs on 1, 2, 4 and 8
GPUs; the training command through the real TrainingArguments and trainer; a tiny ViT
through RDropTrainer at alpha 0 against its own loss; the images against torch and scipy
computations made here."""

import csv
import hashlib
import io
import json
import math
import pickle
import re
import shlex
import tarfile
import threading
from pathlib import Path

import numpy
import pytest
import torch

from rdrop_fairseq.recipes import vit, vit_data
from tests.recipe_helpers import REPO, dry_run
from tests.recipe_helpers import script as script_here
from tests.test_fetch import REVISION, Route, Server
from tests.test_fetch_recipes import script

pytest.importorskip("transformers")

TABLE = REPO / "rdrop_fairseq" / "recipes" / "vit_settings.tsv"
CLASSES = ["apple", "bear", "cup"]


def settings():
    """``{(dataset, model): row}`` of the settings table, read here."""
    with open(TABLE, encoding="utf-8") as f:
        rows = csv.DictReader((line for line in f if not line.startswith("#")),
                              delimiter="\t")
        return {(row["dataset"], row["model"]): row for row in rows}


# ------------------------------------------------------------------ stand-ins


def cifar_batches(seed=0, sizes=(("train", 24), ("test", 9))):
    """CIFAR-100's python files (pickles of dicts of bytes keys, as the real ones load):
    ``{name: bytes}`` and the images and labels in them."""
    rng = numpy.random.default_rng(seed)
    files, content = {}, {}
    for split, n in sizes:
        data = rng.integers(0, 256, (n, 3072), dtype=numpy.uint8)
        labels = [int(x) for x in rng.integers(0, len(CLASSES), n)]
        files[split] = pickle.dumps({b"batch_label": split.encode(), b"data": data,
                                     b"fine_labels": labels, b"coarse_labels": labels}, 3)
        content[split] = (torch.from_numpy(data).reshape(n, 3, 32, 32), labels)
    files["meta"] = pickle.dumps({b"fine_label_names": [c.encode() for c in CLASSES]}, 3)
    return files, content


def tgz(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tiny_vit_files(folder):
    """A tiny ViT in the hub's ImageNet-21k layout (a ViTModel with its pooler, no head):
    16 x 16 images in 4 x 4 patches. ``{file name: bytes}``."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, image_size=16, patch_size=4)).save_pretrained(folder)
    return {name: (Path(folder) / name).read_bytes()
            for name in ("config.json", "model.safetensors")}


@pytest.fixture
def sources(tmp_path):
    """A loopback server holding the CIFAR tarball (as the CIFAR site) and the tiny ViT's
    files (as the hub serves a repository at a commit), and a source table for them."""
    server = Server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    batches, content = cifar_batches()
    tarball = tgz(batches)
    server.routes["/cifar-100-python.tar.gz"] = Route(data=tarball)
    weights = tiny_vit_files(tmp_path / "vit-src")
    for name, data in weights.items():  # the hub's resolve URL, here the file itself
        server.routes[f"/org/vit/resolve/{REVISION}/{name}"] = Route(data=data)
    table = {"cifar-100": {
        "files": [{"name": "cifar-100-python.tar.gz",
                   "urls": [server.url("/cifar-100-python.tar.gz")],
                   "size": len(tarball), "md5": hashlib.md5(tarball).hexdigest()}],
        "make": "unpack", "local": "set CIFAR_DIR to yours"},
        "vit-base-patch16-224-in21k": {
        "hub": {"repo": "org/vit", "revision": REVISION},
        "files": [{"name": f"vit-base-patch16-224-in21k/{name}", "path": name, "size": len(data),
                   "sha256": hashlib.sha256(data).hexdigest()} for name, data in weights.items()],
        "make": "copy", "local": "set VIT_DIR to yours"}}
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(table))
    # PYTHONPATH: this checkout's modules, run from tmp_path, whatever copy is installed
    yield {"server": server, "table": path, "content": content, "env": {
        "RDROP_SOURCES": path, "HF_ENDPOINT": server.base, "HF_HUB_CACHE": tmp_path / "hf",
        "PYTHONPATH": REPO}}
    server.shutdown()
    server.server_close()


def predict_here(model_dir, images, size):
    """Classes the fine-tuned model predicts for uint8 images, each resized here with torch's
    bilinear interpolation and scaled to [-1, 1], one at a time, dropout off."""
    from transformers import ViTForImageClassification

    model = ViTForImageClassification.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for image in images:
            pixels = torch.nn.functional.interpolate(image[None].double(), size=(size, size),
                                                     mode="bilinear", antialias=True)
            out.append(int(model(pixel_values=(pixels / 127.5 - 1).float()).logits.argmax()))
    return out


# ------------------------------------------------------------------ through the script


def test_cifar100_prepare_train_resume_evaluate_through_the_script(sources, tmp_path):
    env = {**sources["env"], "IMAGE_SIZE": 24, "DEVICE_BATCH": 8, "UPDATE_FREQ": 1}
    fast = ["--save_steps", "2", "--logging_steps", "2", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0"]
    log = script(tmp_path, "vit", "prepare", **env).output
    work = tmp_path / "work"
    meta = json.loads((work / "vit" / "cifar100" / "meta.json").read_text())
    assert (meta["classes"], meta["eval_split"], meta["examples"]) == (
        CLASSES, "test", {"train": 24, "test": 9})
    stored = torch.load(work / "vit" / "cifar100" / "test.pt", weights_only=True)
    images, labels = sources["content"]["test"]
    assert torch.equal(stored["images"], images) and stored["labels"].tolist() == labels
    assert "cifar-100-python.tar.gz fetched, md5 verified" in log
    assert [r["path"] for r in sources["server"].log] == ["/cifar-100-python.tar.gz"]

    proc = script(tmp_path, "vit", "train", *fast, MAX_UPDATE=4, **env)
    assert "batch: 1 device(s) x 1 steps x 8 examples = 8 examples per update (the recipe's: " \
           "512; R-Drop runs each batch twice)" in proc.output
    assert "MODE=rdrop, alpha 1.0: 24 images at 24 x 24, 4 updates of 8 x 1 x 1 images" \
        in proc.output
    assert [r["path"].rsplit("/", 1)[-1] for r in sources["server"].log[1:]] == [
        "config.json", "model.safetensors"]  # the weights, from the hub at the commit
    save = tmp_path / "checkpoints" / "vit.cifar100.base.rdrop.seed1"
    assert sorted(p.name for p in save.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    # rerun to 6 updates: prepare skipped (its output is there), training resumed
    proc = script(tmp_path, "vit", "all", *fast, MAX_UPDATE=6, **env)
    assert "is there already" in proc.output
    assert f"resuming from {save / 'checkpoint-4'}" in proc.output
    state = json.loads((save / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and len(sources["server"].log) == 3  # nothing fetched
    from transformers import ViTConfig

    config = ViTConfig.from_pretrained(save / "final")
    assert (config.image_size, config.hidden_dropout_prob, config.num_labels) == (24, 0.1, 3)
    result = json.loads((save / "top1.json").read_text())
    pred = predict_here(save / "final", images, 24)
    correct = sum(p == g for p, g in zip(pred, labels))
    assert (result["split"], result["correct"], result["examples"]) == ("test", correct, 9)
    assert result["accuracy"] == pytest.approx(100 * correct / 9)
    assert f"CIFAR-100 test: top-1 accuracy {100 * correct / 9:.2f} (9 images)" in proc.output


def test_offline_names_the_missing_downloads_and_fetches_nothing(sources, tmp_path):
    proc = script(tmp_path, "vit", "prepare", ok=False, OFFLINE=1, **sources["env"])
    url = sources["server"].url("/cifar-100-python.tar.gz")
    assert proc.returncode != 0 and sources["server"].log == []
    assert f"work/downloads/cifar-100-python.tar.gz is missing: it comes from {url}" in proc.stderr
    assert f"--out {tmp_path}/work/downloads/cifar-100-python.tar.gz {url}" in proc.stderr
    assert "or set CIFAR_DIR to yours" in proc.stderr
    assert not (tmp_path / "work").exists()
    # the weights, fetched by train
    (tmp_path / "work" / "vit" / "cifar100").mkdir(parents=True)
    (tmp_path / "work" / "vit" / "cifar100" / "meta.json").write_text("{}")
    proc = script(tmp_path, "vit", "train", ok=False, OFFLINE=1, **sources["env"])
    assert proc.returncode != 0 and sources["server"].log == []
    for name in ("config.json", "model.safetensors"):
        assert (f"vit-base-patch16-224-in21k/{name} is missing: it comes from "
                f"{sources['server'].base}/org/vit/resolve/{REVISION}/{name}") in proc.stderr
    assert "or set VIT_DIR to yours" in proc.stderr


def test_train_runs_as_the_script_launches_it_on_two_processes(tmp_path):
    """The train stage's launcher on several GPUs (torchrun, one process per device), here
    2 CPU processes (gloo): DDP over both, each its share of the batch, one final model."""
    import subprocess
    import sys

    from tests.torchrun_launch import child_env, failure

    batches, _ = cifar_batches()
    (tmp_path / "cifar").mkdir()
    for name, data in batches.items():
        (tmp_path / "cifar" / name).write_bytes(data)
    vit_data.prepare_cifar(tmp_path / "cifar", tmp_path / "data")
    tiny_vit_files(tmp_path / "vit")
    launcher, _, _, _, _ = train_command(GPUS=2)
    proc = subprocess.run(
        [sys.executable, *launcher[1:], "-m", "rdrop_fairseq.recipes.vit", "train", "cifar100",
         "--data", tmp_path / "data", "--vit-dir", tmp_path / "vit", "--alpha", "1",
         "--image-size", "24", "--", "--output_dir", tmp_path / "save", "--max_steps", "2",
         "--per_device_train_batch_size", "4", "--use_cpu", "--dataloader_num_workers", "0",
         "--save_steps", "2", "--disable_tqdm", "true"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)
    assert "2 updates of 4 x 1 x 2 images" in proc.stdout
    state = json.loads((tmp_path / "save" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["train_batch_size"] == 4
    assert json.loads((tmp_path / "save" / "final" / "vit.json").read_text())["classes"] == \
        CLASSES
    assert proc.stdout.count("[train] the fine-tuned model:") == 1  # rank 0 alone


@pytest.mark.parametrize("make, message", [
    ((), "imagenet-2012 has no live source known to us: ImageNet cannot be downloaded without "
         "an account"),
    (("train",), "val not found: IMAGENET_DIR must be a folder holding train/ and val/"),
    (("val",), "train not found: IMAGENET_DIR must be a folder holding train/ and val/"),
])
def test_a_missing_imagenet_is_refused_in_one_line(tmp_path, make, message):
    imagenet = tmp_path / "imagenet"
    for split in make:
        (imagenet / split / "n01").mkdir(parents=True)
    env = {"IMAGENET_DIR": imagenet} if make else {}
    before = sorted(tmp_path.rglob("*"))
    proc = script_here("vit", "prepare", ok=False, DATASET="imagenet", GPUS=0,
                       DOWNLOADS=tmp_path / "dl", DATA_DIR=tmp_path / "data", **env)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("stage, message", [
    ("prepare", "cifar/train not found: CIFAR_DIR must hold CIFAR-100's train, test and "
                "meta"),
    ("train", "cifar100/meta.json not found: run: DATASET=cifar100 bash scripts/vit.sh prepare"),
    ("evaluate", "final/vit.json not found: train first: DATASET=cifar100 MODEL=base bash "
                 "scripts/vit.sh train"),
])
def test_missing_inputs_say_what_to_put_where_and_make_nothing(tmp_path, stage, message):
    proc = script_here("vit", stage, ok=False, GPUS=0, CIFAR_DIR=tmp_path / "cifar",
                       VIT_DIR=tmp_path / "vit", DATA_DIR=tmp_path / "data",
                       SAVE_DIR=tmp_path / "save")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the script's settings


def train_command(**env):
    """The train stage's command (a dry run, the weights given): ``(launcher, ours,
    {TrainingArguments option: value}, TrainingArguments argv, the run)``."""
    commands, proc = dry_run("vit", "train", **{"VIT_DIR": "/nonexistent", **env})
    (cmd,) = commands
    split = cmd.index("rdrop_fairseq.recipes.vit")
    hf = cmd[cmd.index("--") + 1:]
    options = {k: v for k, v in zip(hf, hf[1:]) if k.startswith("--") and not v.startswith("--")}
    return cmd[:split - 1], cmd[split + 1:cmd.index("--")], options, hf, proc


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("model", ["base", "large"])
def test_gpus_x_device_batch_x_accumulation_is_the_recipes_batch(gpus, model):
    row = settings()["cifar100", model]
    launcher, _, options, hf, proc = train_command(GPUS=gpus, MODEL=model)
    per_device, steps = (int(options["--per_device_train_batch_size"]),
                         int(options["--gradient_accumulation_steps"]))
    assert gpus * per_device * steps == int(row["batch"]) == 512
    assert per_device <= int(row["device_batch"])
    assert per_device == min(int(row["device_batch"]), 512 // gpus)  # the fewest steps
    if gpus == 1:  # one process
        assert launcher[1:] == []
    else:  # one process per GPU
        assert launcher[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
                                "--standalone"]
    assert hf[-1] == "--fp16"
    line = f"batch: {gpus} device(s) x {steps} steps x {per_device} examples = 512 examples"
    assert line in proc.stdout and proc.stdout.index(line) < proc.stdout.index("--output_dir")


@pytest.mark.parametrize("dataset, model", list(settings()))
def test_train_uses_the_settings_table(dataset, model):
    row = settings()[dataset, model]
    _, ours, options, _, _ = train_command(GPUS=8, DATASET=dataset, MODEL=model)
    assert ours[:3] == ["train", dataset, "--data"]
    assert {k: ours[ours.index(k) + 1] for k in (
        "--mode", "--alpha", "--image-size", "--dropout", "--attention-dropout",
        "--momentum")} == {
        "--mode": "rdrop", "--alpha": row["alpha"], "--image-size": row["image_size"],
        "--dropout": row["dropout"], "--attention-dropout": row["attention_dropout"],
        "--momentum": row["momentum"]}
    assert ours[ours.index("--vit-dir") + 1] == "/nonexistent"
    assert {k: options[k] for k in ("--max_steps", "--learning_rate", "--lr_scheduler_type",
                                    "--warmup_steps", "--weight_decay", "--max_grad_norm")} == {
        "--max_steps": row["max_update"], "--learning_rate": row["lr"],
        "--lr_scheduler_type": row["schedule"], "--warmup_steps": row["warmup"],
        "--weight_decay": row["weight_decay"], "--max_grad_norm": row["clip"]}
    assert options["--output_dir"].endswith(f"/checkpoints/vit.{dataset}.{model}.rdrop.seed1")
    # the R-Drop paper's, the ViT paper's (its code's) and the sizes of the two models
    assert (row["dropout"], row["batch"], row["momentum"], row["image_size"]) == (
        "0.1", "512", "0.9", "384")
    assert (row["classes"], row["max_update"]) == (
        {"cifar100": ("100", "10000"), "imagenet": ("1000", "20000")}[dataset])
    assert row["source"] == f"vit-{model}-patch16-224-in21k"


def test_modes_devices_and_the_authors_alpha():
    _, ours, options, hf, _ = train_command(GPUS=1, ALPHA=0.3)
    assert ours[ours.index("--alpha") + 1] == "0.3"
    for mode in ("baseline", "no-kl"):
        _, ours, options, _, _ = train_command(GPUS=1, MODE=mode)
        assert ours[ours.index("--mode") + 1] == mode and "--alpha" not in ours
        assert options["--per_device_train_batch_size"] == "32"
    _, ours, options, _, proc = train_command(GPUS=1, MODE="doubled-batch")
    assert (options["--per_device_train_batch_size"], options["--gradient_accumulation_steps"]
            ) == ("64", "16")
    assert "= 1024 examples per update (the recipe's: 512, doubled by MODE=doubled-batch)" \
        in proc.stdout
    # the R-Drop authors' ViT code: 0.3 x a KL summed over each GPU's batch, both directions
    for env, alpha in (({"GPUS": 1}, "19.2"), ({"GPUS": 8, "MODEL": "large"}, "4.8"),
                       ({"GPUS": 2, "DEVICE_BATCH": 16}, "9.6")):
        _, ours, options, _, _ = train_command(AUTHORS_CODE=1, **env)
        assert float(ours[ours.index("--alpha") + 1]) == pytest.approx(
            0.6 * int(options["--per_device_train_batch_size"]))
        assert ours[ours.index("--alpha") + 1] == alpha
    _, _, options, _, _ = train_command(GPUS=4, UPDATE_FREQ=8)
    assert options["--per_device_train_batch_size"] == "16"
    _, _, options, _, proc = train_command(GPUS=1, UPDATE_FREQ=2, DEVICE_BATCH=64)
    assert "= 128 examples per update (the recipe's: 512" in proc.stdout  # as given
    launcher, _, _, hf, _ = train_command(GPUS=0)
    assert launcher[1:] == [] and hf[-1] == "--use_cpu"
    assert train_command(GPUS=2, BF16=1)[3][-1] == "--bf16"
    hf = train_command(GPUS=2, FP16=0)[3]
    assert "--fp16" not in hf and "--use_cpu" not in hf
    launcher, _, options, _, _ = train_command(GPUS=4, NODES=2, NODE_RANK=1, MASTER_ADDR="h0",
                                               MASTER_PORT=1234)
    assert launcher[3:] == ["--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1",
                            "--master_addr", "h0", "--master_port", "1234"]
    assert options["--gradient_accumulation_steps"] == "2"  # 8 GPUs x 2 x 32
    _, ours, options, hf, _ = train_command(GPUS=1, IMAGE_SIZE=224, SEED=3, MAX_UPDATE=7)
    assert (options["--seed"], options["--max_steps"]) == ("3", "7")
    assert ours[ours.index("--image-size") + 1] == "224"
    (cmd,), _ = dry_run("vit", "train", "--learning_rate", "0.01", GPUS=1, VIT_DIR="/v")
    assert cmd[-2:] == ["--learning_rate", "0.01"]  # after the script's: it wins
    (cmd,), _ = dry_run("vit", "evaluate", GPUS=0)
    assert cmd[cmd.index("--json") + 1].endswith("vit.cifar100.base.rdrop.seed1/top1.json")
    assert cmd[-1] == "--cpu"


@pytest.mark.parametrize("env, message", [
    ({"DATASET": "cifar10"}, "DATASET must be cifar100 or imagenet, not 'cifar10'"),
    ({"MODEL": "huge"}, "MODEL must be base or large"),
    ({"GPUS": 3}, "3 devices do not divide the recipe's 512 examples per update"),
    ({"GPUS": 2, "DEVICE_BATCH": 3}, "DEVICE_BATCH=3 do not divide the recipe's 512"),
    ({"DEVICE_BATCH": 0}, "DEVICE_BATCH must be a whole number >= 1"),
    ({"IMAGE_SIZE": "big"}, "IMAGE_SIZE must be a whole number >= 1"),
    ({"MODE": "baseline", "ALPHA": 1}, "ALPHA=1 contradicts MODE=baseline"),
    ({"AUTHORS_CODE": 1, "ALPHA": 2}, "AUTHORS_CODE=1 sets alpha"),
    ({"AUTHORS_CODE": 1, "MODE": "no-kl"}, "AUTHORS_CODE=1 sets R-Drop's alpha"),
])
def test_bad_settings_are_one_line_errors(env, message):
    _, proc = dry_run("vit", "train", ok=False, **{"GPUS": 1, "VIT_DIR": "/v", **env})
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[vit]")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert message in errors[0]


def vit_pytorch_rate(step, lr, warmup, total):
    """ViT-pytorch's WarmupCosineSchedule (utils/scheduler.py): linear to ``lr`` over
    ``warmup`` updates, then half a cosine to 0 at ``total``."""
    if step < warmup:
        return lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return lr * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def test_the_training_command_is_sgd_with_the_vit_schedule(tmp_path):
    """The script's whole command through the module's parsing, the real TrainingArguments
    and the trainer: SGD with momentum 0.9 at the table's learning rate, no weight decay,
    clipping at 1, and each update's learning rate ViT-pytorch's (its warm-up and cosine),
    stepped for all 10,000 updates."""
    _, ours, _, hf, _ = train_command(GPUS=1)
    a = vit.make_parser().parse_args(ours)
    args = vit.training_arguments(vit.make_parser(), [x for x in hf if x != "--fp16"]
                                  + ["--use_cpu", "--output_dir", str(tmp_path / "out")])
    assert (args.max_grad_norm, args.weight_decay, args.dataloader_num_workers) == (1.0, 0.0, 4)
    assert (args.save_steps, args.save_total_limit) == (1000, 2)
    trainer = vit.make_trainer(a.mode, a.alpha, args, tiny_classifier(0.1), [], a.momentum)
    assert (trainer.rdrop.every, trainer.rdrop.pass_mean) == (1, False)
    trainer.create_optimizer_and_scheduler(args.max_steps)
    opt = trainer.optimizer
    assert isinstance(opt, torch.optim.SGD)
    assert {(g["momentum"], g["weight_decay"], g["initial_lr"]) for g in opt.param_groups} == {
        (0.9, 0.0, 0.03)}
    rates = []
    for _ in range(args.max_steps):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        opt.step()
        trainer.lr_scheduler.step()
    expected = [vit_pytorch_rate(s, 0.03, 500, 10000) for s in range(10000)]
    assert rates == pytest.approx(expected, abs=1e-12)
    assert max(rates) == pytest.approx(0.03) and rates.index(max(rates)) == 500


# ------------------------------------------------------------------ the trainer and model


def tiny_classifier(dropout=0.0, size=8, classes=3):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        image_size=size, patch_size=4, num_labels=classes, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout))


def image_examples(n, size=8, classes=3):
    g = torch.Generator().manual_seed(3)
    return [{"pixel_values": torch.rand(3, size, size, generator=g) * 2 - 1,
             "labels": i % classes} for i in range(n)]


def test_a_tiny_vit_trains_with_twice_its_own_loss_at_alpha_0(tmp_path):
    """RDropTrainer on ViTForImageClassification (no token ids: read as a sequence head),
    alpha 0, dropout off: every training step's loss is exactly twice the model's own loss
    on that batch, at that step's weights."""
    from transformers import TrainingArguments

    from rdrop_fairseq.hf import RDropTrainer

    seen = []

    class Checked(RDropTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with torch.no_grad():
                own = model(**inputs).loss
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            seen.append((float(loss.detach()), float(own)))
            return loss

    model = tiny_classifier()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             per_device_train_batch_size=4, max_steps=3, save_strategy="no",
                             learning_rate=0.1, disable_tqdm=True)
    trainer = Checked(model=model, args=args, train_dataset=image_examples(12),
                      data_collator=vit_data.collate, rdrop_alpha=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert len(seen) == 3 and len({own for _, own in seen}) == 3  # it trained
    for loss, own in seen:
        assert loss == pytest.approx(2 * own, rel=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_baseline_accumulates_as_one_batch_and_rdrop_uses_rdroptrainer(tmp_path):
    """MODE baseline: a one-pass Trainer whose gradient over 2 steps of 4 is that of one
    batch of 8 (the Trainer alone would double it: ViT's forward takes **kwargs); rdrop
    and no-kl: RDropTrainer with the alpha."""
    from transformers import TrainerCallback, TrainingArguments

    from rdrop_fairseq.hf import RDropTrainer
    from tests.test_hf import sequential

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grad = torch.cat([p.grad.flatten().clone() for p in model.parameters()
                                   if p.grad is not None])

    def trainer(mode, batch, steps, alpha=None, dropout=0.0):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                 report_to="none", per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=steps, max_steps=1,
                                 max_grad_norm=0.0, save_strategy="no", disable_tqdm=True,
                                 **sequential())
        grab = Grab()
        return vit.make_trainer(mode, alpha, args, tiny_classifier(dropout), image_examples(8),
                                callbacks=[grab]), grab

    grads = []
    for batch, steps in ((8, 1), (4, 2)):
        t, grab = trainer("baseline", batch, steps)
        assert not isinstance(t, RDropTrainer)
        t.train()
        grads.append(grab.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    assert trainer("rdrop", 8, 1, 0.3, dropout=0.1)[0].rdrop_alpha == 0.3
    assert trainer("no-kl", 8, 1, dropout=0.1)[0].rdrop_alpha == 0.0


def test_position_embeddings_are_resized_as_the_vit_code_resizes_them(tmp_path):
    """The 4 x 4 grid of a 16 x 16 model to 6 x 6 for 24 x 24 images: scipy's linear zoom
    (order 1, the ViT paper's code and ViT-pytorch), [CLS]'s kept; the model runs at the new
    size and is saved and loaded at it."""
    from scipy import ndimage
    from transformers import ViTForImageClassification

    model = tiny_classifier(size=16)
    old = model.vit.embeddings.position_embeddings.detach().clone()
    vit.resize_positions(model, 24)
    new = model.vit.embeddings.position_embeddings.detach()
    grid = old[0, 1:].reshape(4, 4, -1).double().numpy()
    zoomed = ndimage.zoom(grid, (6 / 4, 6 / 4, 1), order=1)
    assert new.shape == (1, 37, 16) and torch.equal(new[0, 0], old[0, 0])
    assert numpy.allclose(new[0, 1:].reshape(6, 6, -1).numpy(), zoomed, atol=1e-6)
    logits = model.eval()(pixel_values=torch.zeros(1, 3, 24, 24)).logits
    model.save_pretrained(tmp_path / "m")
    again = ViTForImageClassification.from_pretrained(tmp_path / "m").eval()
    assert torch.equal(again(pixel_values=torch.zeros(1, 3, 24, 24)).logits, logits)
    same = vit.resize_positions(tiny_classifier(size=16), 16)
    assert torch.equal(same.vit.embeddings.position_embeddings, old)
    with pytest.raises(ValueError, match="not a multiple of the patch size 4"):
        vit.resize_positions(model, 30)


def test_the_head_is_new_zero_and_the_dropout_the_recipes(tmp_path):
    folder = tmp_path / "vit"
    tiny_vit_files(folder)
    model = vit.load_model(folder, CLASSES, 24, 0.1, 0.0)
    assert model.config.id2label == dict(enumerate(CLASSES))
    assert model.classifier.weight.abs().sum() == 0 and model.classifier.bias.abs().sum() == 0
    assert (model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob) == (
        0.1, 0.0)
    assert model.vit.embeddings.position_embeddings.shape[1] == 37


# ------------------------------------------------------------------ images


def test_crops_are_torchvisions_random_resized_crops():
    torch.manual_seed(0)
    for height, width in ((32, 32), (20, 50), (7, 3)):
        for _ in range(300):
            top, left, h, w = vit_data.crop_box(height, width)
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
            assert h >= 1 and w >= 1
    # large images: the area within the scale, the ratio within 3/4-4/3 (rounding aside)
    fractions, ratios = [], []
    for _ in range(2000):
        _, _, h, w = vit_data.crop_box(400, 400)
        fractions.append(h * w / 400 ** 2)
        ratios.append(w / h)
    assert 0.05 * 0.97 < min(fractions) < 0.07 and 0.9 < max(fractions) <= 1.0
    assert 0.74 < min(ratios) < 0.78 and 1.3 < max(ratios) < 1.34
    # no crop of the scale fits: the central crop of the nearest ratio
    assert vit_data.crop_box(10, 40, scale=(2, 3)) == (0, 13, 10, 13)
    assert vit_data.crop_box(12, 12, scale=(2, 3)) == (0, 0, 12, 12)


def test_images_reach_the_model_in_minus_one_to_one():
    image = torch.randint(0, 256, (3, 10, 12), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))
    whole = vit_data.to_model(image, 10)  # 10 x 12, resized (antialiased) to 10 x 10
    expected = torch.nn.functional.interpolate(image[None].double(), size=(10, 10),
                                               mode="bilinear", antialias=True)[0] / 127.5 - 1
    torch.testing.assert_close(whole.double(), expected, atol=1e-5, rtol=0)
    cut = vit_data.to_model(image, 16, box=(2, 3, 5, 6))
    expected = torch.nn.functional.interpolate(image[None, :, 2:7, 3:9].double(), size=(16, 16),
                                               mode="bilinear")[0] / 127.5 - 1
    torch.testing.assert_close(cut.double(), expected, atol=1e-5, rtol=0)
    square = image[:, :10, :10]
    assert torch.equal(vit_data.to_model(square, 10), square.float() / 127.5 - 1)
    assert vit_data.to_model(torch.full((3, 4, 4), 255, dtype=torch.uint8), 4).eq(1).all()


def test_a_pickle_naming_anything_but_arrays_is_refused(tmp_path):
    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    for name in ("train", "test", "meta"):
        (tmp_path / name).write_bytes(pickle.dumps({b"data": Boom()}))
    with pytest.raises(vit_data.ImageDataError, match="names pathlib.*not a CIFAR batch"):
        vit_data.prepare_cifar(tmp_path, tmp_path / "out")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def write_imagenet(root, classes=("n02", "n01"), per_class=2):
    """Class folders of small PNG images (varied sizes, one grey), and the images."""
    from PIL import Image

    rng = numpy.random.default_rng(4)
    images = {}
    for split in ("train", "val"):
        for k, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                array = rng.integers(0, 256, (5 + i, 7 + k, 3), dtype=numpy.uint8)
                path = root / split / name / f"{name}_{i}.png"
                mode = "L" if i == 1 else "RGB"
                Image.fromarray(array[:, :, 0] if mode == "L" else array, mode).save(path)
                images[f"{split}/{name}/{path.name}"] = (
                    numpy.repeat(array[:, :, :1], 3, 2) if mode == "L" else array)
        (root / split / classes[0] / "notes.txt").write_text("not an image")
    return images


def test_imagenet_class_folders_are_indexed_and_read(tmp_path):
    images = write_imagenet(tmp_path / "imagenet")
    vit.main(["prepare", "imagenet", "--imagenet-dir", str(tmp_path / "imagenet"),
              "--out", str(tmp_path / "data")])
    meta = vit_data.load_meta(tmp_path / "data")
    assert (meta["classes"], meta["eval_split"], meta["examples"]) == (
        ["n01", "n02"], "val", {"train": 4, "val": 4})
    val = vit_data.load_split(tmp_path / "data", "val", 6, train=False)
    rows = (tmp_path / "data" / "val.tsv").read_text().splitlines()
    assert [r.split("\t")[1] for r in rows] == ["0", "0", "1", "1"]
    for i, row in enumerate(rows):
        path = row.split("\t")[0]
        expected = vit_data.to_model(torch.from_numpy(images[path]).permute(2, 0, 1), 6)
        example = val[i]
        assert torch.equal(example["pixel_values"], expected)
        assert example["labels"] == int(row.split("\t")[1])
    train = vit_data.load_split(tmp_path / "data", "train", 6, train=True)
    assert train[0]["pixel_values"].shape == (3, 6, 6)


def test_imagenet_with_other_classes_in_val_is_refused(tmp_path):
    write_imagenet(tmp_path / "imagenet")
    (tmp_path / "imagenet" / "val" / "n03").mkdir()
    with pytest.raises(SystemExit, match="val's class folders are not train's \\(3 and 2\\)"):
        vit.main(["prepare", "imagenet", "--imagenet-dir", str(tmp_path / "imagenet"),
                  "--out", str(tmp_path / "data")])
    assert not (tmp_path / "data").exists()


def test_module_errors_name_what_is_missing(tmp_path, capsys):
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text(json.dumps({"dataset": "cifar100"}))
    data = ["--data", str(tmp_path / "data")]
    for argv, message in [
        (["train", "cifar100", *data, "--vit-dir", str(tmp_path / "vit"), "--alpha", "1"],
         "no model.safetensors or pytorch_model.bin (weights): VIT_DIR must be a Hugging Face "
         "ViT folder"),
        (["train", "cifar100", *data, "--vit-dir", str(tmp_path), "--mode", "baseline"],
         "no config.json"),
        (["train", "imagenet", *data, "--vit-dir", str(tmp_path / "vit")],
         "holds cifar100, not imagenet"),
        (["evaluate", "cifar100", *data], "--save-dir is required for evaluate"),
        (["evaluate", "cifar100", *data, "--save-dir", str(tmp_path)],
         "final/vit.json not found: train first: DATASET=cifar100 bash scripts/vit.sh train"),
        (["prepare", "cifar100", "--out", "o"], "--cifar-dir is required for prepare"),
        (["prepare", "cifar10", "--cifar-dir", "c"], "invalid choice: 'cifar10'"),
        (["evaluate", "cifar100", *data, "--save-dir", "s", "--", "--seed", "1"],
         "arguments after -- are TrainingArguments, for train"),
    ]:
        with pytest.raises(SystemExit):
            vit.main(argv)
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit, match="lacks train, test, meta: CIFAR_DIR must hold"):
        vit.main(["prepare", "cifar100", "--cifar-dir", str(tmp_path), "--out",
                  str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the docs


def test_every_command_docs_vision_md_gives_runs_as_a_dry_run():
    """Each ``bash scripts/vit.sh`` line of docs/vision.md's code blocks, its variables and
    arguments as written (a dry run, on 8 GPUs where it names none)."""
    doc = (REPO / "docs" / "vision.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.S)
    lines = [shlex.split(line, comments=True) for block in blocks
             for line in block.replace("\\\n", " ").splitlines() if "scripts/vit.sh" in line]
    assert len(lines) == 10
    for words in lines:
        at = words.index("bash")
        env = dict(w.split("=", 1) for w in words[:at])
        assert env.pop("DRY_RUN", "1") == "1" and words[at + 1] == "scripts/vit.sh"
        commands, _ = dry_run("vit", *words[at + 2:], **{"GPUS": 8, "VIT_DIR": "/v", **env})
        assert any("rdrop_fairseq.recipes.vit" in c for c in commands), words


def test_docs_vision_md_gives_the_settings_tables_values_and_splits():
    doc = (REPO / "docs" / "vision.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Settings, and whose they are"):]
    section = section[:section.index("\n## ", 1)]
    value = {row.split(" | ")[0][2:]: row.split(" | ")[1] for row in section.splitlines()
             if row.startswith("| ") and not row.startswith(("| setting", "|---"))}
    rows = settings()
    base, large = rows["cifar100", "base"], rows["cifar100", "large"]
    same = [k for k in base if k not in ("dataset", "model", "source", "classes",
                                         "max_update", "device_batch")]
    assert all(row[k] == base[k] for row in rows.values() for k in same)
    assert value["dropout"] == (f"{base['dropout']} on the hidden states, "
                                f"{base['attention_dropout']} on the attention weights")
    assert base["weight_decay"] == "0"
    assert value["optimiser"] == f"SGD, momentum {base['momentum']}, no weight decay"
    assert value["batch"] == f"{base['batch']} images per update"
    assert value["updates"] == (f"{int(base['max_update']):,} (CIFAR-100), "
                                f"{int(rows['imagenet', 'base']['max_update']):,} (ImageNet)")
    assert value["learning rate"] == (f"{base['lr']}, linear warm-up over {base['warmup']} "
                                      f"updates, then a {base['schedule']} decay to 0")
    assert value["gradient clipping"] == f"global norm {float(base['clip']):g}"
    assert value["image size"].startswith(f"{base['image_size']} x {base['image_size']}, ")
    assert value["alpha"].startswith(f"{base['alpha']} (`ALPHA`")
    assert value["per-GPU batch"] == (f"at most {base['device_batch']} (ViT-B/16) or "
                                      f"{large['device_batch']} (ViT-L/16) images a step")
    # the split on 1, 2, 4 and 8 GPUs, as the script makes it
    for model, name in (("base", "ViT-B/16"), ("large", "ViT-L/16")):
        (row,) = [line for line in doc.splitlines() if line.startswith(f"| {name} | ")]
        cells = []
        for gpus in (1, 2, 4, 8):
            _, _, options, _, _ = train_command(GPUS=gpus, MODEL=model)
            cells.append(f"{options['--per_device_train_batch_size']} x "
                         f"{options['--gradient_accumulation_steps']}")
        assert row == f"| {name} | " + " | ".join(cells) + " |"

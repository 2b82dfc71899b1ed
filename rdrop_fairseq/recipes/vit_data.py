"""The images of the ViT recipe (rdrop_fairseq.recipes.vit, scripts/vit.sh): CIFAR-100 as
its python tarball unpacks and ImageNet as class folders, prepared into the recipe's data
folder; then each image as ViT-pytorch (the public code the R-Drop authors fine-tuned with)
gives it to the model, in torch ops (no torchvision): for training a random-resized crop
(scale 0.05-1 of the image, aspect ratio 3/4-4/3, torchvision's sampling) resized to the
model's image size, for evaluation the whole image resized; bilinear, scaled from
[0, 255] to [-1, 1] (mean 0.5, std 0.5 per channel).

Prepared folder: ``meta.json`` (the dataset, its class names in label order, the split
scored and the examples per split) and, for CIFAR-100, ``train.pt`` and ``test.pt`` (the
images as one uint8 tensor N x 3 x 32 x 32 and their labels); for ImageNet, ``train.tsv``
and ``val.tsv`` (each image's path under the ImageNet folder and its label), the images
read from there when trained on."""

import json
import math
import pickle
from pathlib import Path

import torch

from .common import made_or_removed, write_json

CROP_SCALE = (0.05, 1.0)  # ViT-pytorch's RandomResizedCrop(scale=(0.05, 1.0))
CROP_RATIO = (3 / 4, 4 / 3)  # torchvision's default aspect ratios
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
IMAGENET_LAYOUT = ("a folder holding train/ and val/, one folder of images per class in "
                   "each (n01440764/..., as torchvision's ImageFolder reads them; val/ sorted "
                   "into the classes' folders)")
# what the evaluate stage scores: the test split, as the paper reports (ImageNet's: val)
EVAL_SPLIT = {"cifar100": "test", "imagenet": "val"}


class ImageDataError(Exception):
    """Input data that is not what the recipe reads; the message says what is wrong."""


# ------------------------------------------------------------------------------ CIFAR-100

class NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR's batches are Python 2 pickles of dicts, lists and NumPy arrays: those are
    built, any other object a pickle names is refused (a pickle can run code)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),  # NumPy 2's name
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # bytes in a protocol-2 pickle written by Python 3

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise ImageDataError(f"{self.path} names {module}.{name}: not a CIFAR batch")
        return super().find_class(module, name)


def read_pickle(path):
    with open(path, "rb") as f:
        unpickler = NumpyOnlyUnpickler(f, encoding="bytes")
        unpickler.path = path
        try:
            return unpickler.load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ImageDataError(f"{path} is not a CIFAR batch ({e})") from None


def cifar_folder(cifar_dir):
    """``cifar_dir``, unless it lacks one of CIFAR-100's ``train``, ``test`` and ``meta``
    (the files of the tarball's ``cifar-100-python`` folder)."""
    folder = Path(cifar_dir)
    missing = [name for name in ("train", "test", "meta") if not (folder / name).is_file()]
    if missing:
        raise ImageDataError(f"{folder} lacks {', '.join(missing)}: CIFAR_DIR must hold "
                             "CIFAR-100's train, test and meta (cifar-100-python.tar.gz's "
                             "cifar-100-python folder)")
    return folder


def read_cifar(folder, split):
    """``(images, labels)`` of a CIFAR-100 split: uint8 N x 3 x 32 x 32 and int64 N (the 100
    fine classes)."""
    batch = read_pickle(Path(folder) / split)
    try:
        data, labels = batch[b"data"], batch[b"fine_labels"]
        images = torch.as_tensor(data, dtype=torch.uint8).reshape(-1, 3, 32, 32).clone()
    except (KeyError, TypeError, RuntimeError) as e:
        raise ImageDataError(f"{Path(folder) / split}: no CIFAR-100 images and fine labels "
                             f"({e.__class__.__name__}: {e})") from None
    labels = torch.as_tensor(labels, dtype=torch.int64)
    if len(labels) != len(images):
        raise ImageDataError(f"{Path(folder) / split}: {len(images)} images, {len(labels)} "
                             "labels")
    return images, labels


def cifar_classes(folder):
    names = read_pickle(Path(folder) / "meta").get(b"fine_label_names")
    if not names:
        raise ImageDataError(f"{Path(folder) / 'meta'}: no fine_label_names")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def prepare_cifar(cifar_dir, out):
    folder = cifar_folder(cifar_dir)
    classes = cifar_classes(folder)
    splits = {split: read_cifar(folder, split) for split in ("train", "test")}
    for split, (_, labels) in splits.items():
        if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < len(classes):
            raise ImageDataError(f"{folder / split}: labels outside the {len(classes)} classes")
    with made_or_removed(out):
        out.mkdir(parents=True, exist_ok=True)
        for split, (images, labels) in splits.items():
            torch.save({"images": images, "labels": labels}, out / f"{split}.pt")
        write_meta(out, "cifar100", classes, {s: len(v[1]) for s, v in splits.items()},
                   source=folder)


# ------------------------------------------------------------------------------ ImageNet

def class_folders(root, split):
    """``(classes, [(path under root, label), ...])`` of ``root/split``'s class folders."""
    folder = Path(root) / split
    if not folder.is_dir():
        raise ImageDataError(f"{folder} not found: IMAGENET_DIR must be {IMAGENET_LAYOUT}")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise ImageDataError(f"{folder} holds no class folders: IMAGENET_DIR must be "
                             f"{IMAGENET_LAYOUT}")
    images = [(f"{split}/{name}/{p.name}", label) for label, name in enumerate(classes)
              for p in sorted((folder / name).iterdir())
              if p.suffix.lower() in IMAGE_SUFFIXES]
    return classes, images


def prepare_imagenet(imagenet_dir, out):
    root = Path(imagenet_dir).resolve()
    classes, train = class_folders(root, "train")
    val_classes, val = class_folders(root, "val")
    if val_classes != classes:
        raise ImageDataError(f"{root}/val's class folders are not train's "
                             f"({len(val_classes)} and {len(classes)}): sort val/ into the "
                             "training classes' folders")
    with made_or_removed(out):
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in (("train", train), ("val", val)):
            (out / f"{split}.tsv").write_text("".join(f"{p}\t{label}\n" for p, label in rows))
        write_meta(out, "imagenet", classes, {"train": len(train), "val": len(val)},
                   source=root)


def write_meta(out, dataset, classes, examples, source):
    write_json(out / "meta.json", {"dataset": dataset, "classes": classes,
                                   "eval_split": EVAL_SPLIT[dataset], "examples": examples,
                                   "source": str(Path(source).resolve())})


def load_meta(data):
    return json.loads((Path(data) / "meta.json").read_text())


# ------------------------------------------------------------------------------ images

def crop_box(height, width, scale=CROP_SCALE, ratio=CROP_RATIO):
    """``(top, left, h, w)`` of a random crop as torchvision's RandomResizedCrop draws it:
    an area of ``scale`` of the image's and an aspect ratio (w / h) of ``ratio``, log-uniform;
    after 10 draws that do not fit, the central crop of the nearest allowed ratio. From
    torch's global random state (each DataLoader worker seeds its own)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio.tolist()).item())
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,)))
            left = int(torch.randint(0, width - w + 1, (1,)))
            return top, left, h, w
    if width / height < min(ratio):
        w, h = width, round(width / min(ratio))
    elif width / height > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def to_model(image, size, box=None):
    """A uint8 image C x H x W (cut to ``box``, ``(top, left, h, w)``, first) as the model
    reads it: bilinear to ``size`` x ``size`` (antialiased when shrinking), in [-1, 1]."""
    if box is not None:
        top, left, h, w = box
        image = image[:, top:top + h, left:left + w]
    pixels = image.unsqueeze(0).float()
    if pixels.shape[-2:] != (size, size):
        pixels = torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear",
                                                 align_corners=False, antialias=True)
    return (pixels[0] / 127.5 - 1.0).clamp_(-1.0, 1.0)


class ImageFiles:
    """Images read from files on demand (Pillow), RGB, as uint8 tensors C x H x W."""

    def __init__(self, root, paths):
        self.root, self.paths = Path(root), paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import numpy
        from PIL import Image

        with Image.open(self.root / self.paths[i]) as image:
            array = numpy.asarray(image.convert("RGB"), dtype=numpy.uint8)
        return torch.from_numpy(array.copy()).permute(2, 0, 1)


class ImageSet(torch.utils.data.Dataset):
    """Examples ``{"pixel_values", "labels"}`` of ``images`` (anything indexable giving
    uint8 C x H x W tensors) at ``size``: a random-resized crop each time with ``train``,
    else the whole image."""

    def __init__(self, images, labels, size, train):
        self.images, self.labels, self.size, self.train = images, labels, size, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        box = crop_box(*image.shape[-2:]) if self.train else None
        return {"pixel_values": to_model(image, self.size, box), "labels": int(self.labels[i])}


def load_split(data, split, size, train):
    """The prepared ``split`` of ``data`` (prepare's folder) as an :class:`ImageSet`."""
    meta = load_meta(data)
    if meta["dataset"] == "cifar100":
        stored = torch.load(Path(data) / f"{split}.pt", weights_only=True)
        return ImageSet(stored["images"], stored["labels"], size, train)
    rows = [line.split("\t") for line in
            (Path(data) / f"{split}.tsv").read_text().splitlines() if line]
    return ImageSet(ImageFiles(meta["source"], [p for p, _ in rows]),
                    [int(label) for _, label in rows], size, train)


def collate(examples):
    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["labels"] for e in examples])}

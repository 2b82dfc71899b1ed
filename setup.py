from setuptools import find_packages, setup

setup(
    name="rdrop-fairseq",
    version="0.1.0",
    description="R-Drop (Regularized Dropout, NeurIPS 2021) as a fairseq plugin: --user-dir + criteria",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.9",
    packages=find_packages(include=["rdrop_fairseq", "rdrop_fairseq.*"]),
    # the recipes' source table (read by rdrop_fairseq/recipes/fetch/table.py)
    package_data={"rdrop_fairseq.recipes": ["sources.json", "glue_tasks.tsv",
                                            "vit_settings.tsv"]},
    # fairseq itself is deliberately not a requirement: the PyPI distribution named
    # "fairseq" (0.12.2) does not import on Python 3.11 and would replace a user's own
    # fairseq. Install one yourself (see README: requirements/fairseq.txt).
    install_requires=["torch>=1.13", "numpy"],
    extras_require={
        # triton: tests/test_triton_kernel.py runs the fused kernel in Triton's CPU
        # interpreter (verified with 3.0.0, 3.2.0 and 3.9.0); wheels exist for Linux only.
        # threadpoolctl: a warm test command's thread count (tests/warm_process.py)
        # liger-kernel: RDropTrainer with use_liger_kernel (tests/test_hf_edges.py, its
        # patched forward on a CPU; 0.8.5 tested)
        "test": ["pytest>=7", "pytest-xdist>=3", 'triton>=3.0; platform_system == "Linux"',
                 "threadpoolctl>=3", 'liger-kernel>=0.8.5; platform_system == "Linux"'],
        # rdrop_fairseq.recipes, run by scripts/*.sh (tokenisation, BPE, sentencepiece for
        # Chinese, ROUGE, plots,
        # a GPT-2-format byte-level BPE learnt for the LibreOffice summarization check;
        # safetensors + tokenizers: the Hugging Face BERT converter, convert_hf_bert;
        # pyarrow: CNN/DailyMail's parquet files (the suite runs with 25);
        # pillow: ImageNet's images for scripts/vit.sh (matplotlib needs it too);
        # the downloader, rdrop_fairseq.recipes.fetch: requests and urllib3 (retries,
        # time-outs, resumes; tested with requests 2.34.2, urllib3 2.8.0), filelock (runs take
        # turns; 4.3.1), tqdm (progress); huggingface_hub, which the "hf" extra brings with
        # transformers, lets it use a hub file already in the Hugging Face cache)
        "recipes": ["sacremoses>=0.1", "subword-nmt>=0.3.8", "sentencepiece>=0.1.99",
                    "rouge-score>=0.1.2", "matplotlib>=3.5", "tokenizers>=0.13",
                    "safetensors>=0.4", "pyarrow>=12,<26", "tqdm>=4", "requests>=2.34",
                    "urllib3>=2.8", "filelock>=4.3", "pillow>=8"],
        # fairseq's --tensorboard-logdir; without it every fairseq command logs
        # "Please install tensorboardX" (fairseq/tasks/text_to_speech.py, at import)
        "tensorboard": ["tensorboardX>=2.1"],
        # rdrop_fairseq.hf (RDropTrainer) and scripts/glue_bert.sh: Hugging Face's Trainer,
        # which needs accelerate. The suite runs with transformers 5.25.0 and accelerate
        # 1.16.0 on torch 2.13 (5.24.0 and 1.15.0 before), and its Hugging Face tests with
        # transformers 4.49.0 (the floor: tests/test_transformers_floor.py); before 4.48 the Trainer's
        # gradient-accumulation rules differ between patch releases (docs/huggingface.md)
        "hf": ["transformers>=4.49.0,<6", "accelerate>=1.0.1", "scikit-learn", "scipy"],
        # RDropMixin with TRL's SFTTrainer and PEFT's LoRA (docs/huggingface.md), tested
        # with trl 1.16.0 and peft 0.21.2, and pandas 2 (pandas 3 not yet tried)
        "hf-sft": ["trl>=1.16", "peft>=0.21.2", "pandas<3"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: MIT License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

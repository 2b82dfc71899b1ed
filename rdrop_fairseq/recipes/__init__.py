"""The Python the paper's recipes need (scripts/*.sh run these): data preparation,
evaluation and scoring, checkpoint averaging, and the LibreOffice demo. Each module has a
command line: ``python -m rdrop_fairseq.recipes.<name> --help``.

Not imported by ``import rdrop_fairseq`` (the plugin): these modules need fairseq and the
``recipes`` extra (``pip install -e ".[recipes]"``).
"""

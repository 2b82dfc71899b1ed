"""Let fairseq 0.12 run under NumPy 2, without changing NumPy for anyone else.

fairseq 0.12 calls names and arguments that NumPy has removed since:

* ``np.compat.long`` (NumPy 1 defined it as ``int``; NumPy 2.0 removed ``numpy.compat``), in
  ``TokenBlockDataset`` with ``break_mode="eos"`` (``--sample-break-mode eos``: language
  models, masked-LM pretraining) and ``LanguagePairDataset`` with ``num_buckets > 0``
  (``--num-batch-buckets``: translation): ``AttributeError: module 'numpy' has no
  attribute 'compat'``;
* ``np.percentile(..., interpolation=)`` (NumPy 2.4 removed the argument; ``method=``
  since 1.22), in ``data_utils.get_buckets``: the same ``num_buckets > 0`` path, and
  ``--num-batch-buckets`` of the other tasks: ``TypeError: percentile() got an unexpected
  keyword argument 'interpolation'``;
* ``np.float`` (the builtin; removed in NumPy 1.24, so broken under every NumPy the set-up
  has installed), in the non-autoregressive models' ``DynamicCRF`` (``nacrf_transformer``).

Not repaired: ``np.int`` in ``data_utils.compute_mask_indices`` and
``compute_block_mask_1d`` with ``no_overlap=True`` (wav2vec, data2vec), code that calls
``randint`` on a ``numpy.random.Generator`` (which has none) first and never worked; and
the examples shipped inside fairseq (``fairseq/examples``), which no fairseq tool imports.

Each of those fairseq modules gets, as its ``np``, a view of NumPy that adds what it calls
and this NumPy lacks; ``numpy`` itself, and every other module, is left unchanged. Where
NumPy still has a name (``numpy.compat`` in NumPy 1), it is not replaced.

:func:`rdrop_fairseq.register` applies the fix, that is: loading the plugin (``--user-dir``,
``import rdrop_fairseq``) once fairseq is imported.
"""

import builtins
import functools
import importlib
import inspect
import types

import numpy


def compat():
    """``numpy.compat`` as far as fairseq uses it; None where NumPy has it."""
    return None if hasattr(numpy, "compat") else types.SimpleNamespace(long=int)


def percentile():
    """``numpy.percentile`` that takes ``interpolation=``; None where NumPy's does."""
    if "interpolation" in inspect.signature(numpy.percentile).parameters:
        return None

    @functools.wraps(numpy.percentile)
    def with_interpolation(*args, interpolation=None, **kwargs):
        if interpolation is not None:
            kwargs["method"] = interpolation
        return numpy.percentile(*args, **kwargs)

    return with_interpolation


def builtin(name):
    """A function giving what ``numpy.NAME`` was before NumPy 1.24 (the builtin NAME), or
    None where NumPy has it."""
    return lambda: None if hasattr(numpy, name) else getattr(builtins, name)


# fairseq module -> {name: a function giving its replacement, or None where NumPy has it}
REMOVED_NAMES = {
    "fairseq.data.token_block_dataset": {"compat": compat},
    "fairseq.data.language_pair_dataset": {"compat": compat},
    "fairseq.data.data_utils": {"percentile": percentile},
    "fairseq.modules.dynamic_crf_layer": {"float": builtin("float")},
}


def numpy_with(names):
    """A module that is ``numpy`` plus ``names`` (a copy of its namespace: no slower)."""
    view = types.ModuleType(numpy.__name__, numpy.__doc__)
    vars(view).update(vars(numpy))  # numpy's __getattr__ too, for its lazy submodules
    vars(view).update(names)
    return view


def repair_fairseq_numpy():
    """Give the fairseq modules of :data:`REMOVED_NAMES` what this NumPy lacks.

    Imports those modules (``import fairseq`` has already). Idempotent.
    """
    for module_name, replacements in REMOVED_NAMES.items():
        missing = {name: value for name, value in
                   ((name, make()) for name, make in replacements.items())
                   if value is not None}
        module = importlib.import_module(module_name)
        if missing and module.np is numpy:
            module.np = numpy_with(missing)

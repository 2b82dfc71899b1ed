"""Let fairseq 0.12's data paths run under NumPy 2, without changing NumPy for anyone else.

NumPy 2.0 removed ``numpy.compat``. fairseq 0.12 reads ``np.compat.long`` (which NumPy 1
defines as ``int``) in two datasets that the recipes and criteria run:

* ``TokenBlockDataset`` with ``break_mode="eos"`` (``--sample-break-mode eos``: language
  models, masked-LM pretraining);
* ``LanguagePairDataset`` with ``num_buckets > 0`` (``--num-batch-buckets``: translation).

Under NumPy 2 both stop with ``AttributeError: module 'numpy' has no attribute 'compat'``.
The fix gives exactly those two fairseq modules, as their ``np``, a view of NumPy that also
holds ``compat.long = int``; ``numpy`` itself, and every other module, is left unchanged.
Where NumPy still has ``numpy.compat`` (NumPy 1) nothing is done.

Other names fairseq 0.12 calls that NumPy no longer has were removed in NumPy 1.24, before
NumPy 2, and lie outside the text tasks: ``np.int`` in ``data_utils.compute_mask_indices``
(``no_overlap=True``, wav2vec) and ``compute_block_mask_1d`` (data2vec), ``np.float`` in
the non-autoregressive models' ``DynamicCRF``. They are not repaired here.

:func:`rdrop_fairseq.register` applies the fix, that is: loading the plugin (``--user-dir``,
``import rdrop_fairseq``) once fairseq is imported.
"""

import importlib
import types

import numpy

# fairseq module -> the names NumPy removed that it calls, with NumPy 1's values
REMOVED_NAMES = {
    "fairseq.data.token_block_dataset": {"compat": types.SimpleNamespace(long=int)},
    "fairseq.data.language_pair_dataset": {"compat": types.SimpleNamespace(long=int)},
}


def numpy_with(names):
    """A module that is ``numpy`` plus ``names`` (a copy of its namespace: no slower)."""
    view = types.ModuleType(numpy.__name__, numpy.__doc__)
    vars(view).update(vars(numpy))  # numpy's __getattr__ too, for its lazy submodules
    vars(view).update(names)
    return view


def repair_fairseq_numpy():
    """Give the fairseq modules of :data:`REMOVED_NAMES` the names this NumPy lacks.

    Imports those modules (``import fairseq`` has already). Idempotent.
    """
    for module_name, names in REMOVED_NAMES.items():
        missing = {name: value for name, value in names.items()
                   if not hasattr(numpy, name)}
        module = importlib.import_module(module_name)
        if missing and module.np is numpy:
            module.np = numpy_with(missing)

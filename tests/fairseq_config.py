"""fairseq's training config from a command line, as fairseq-train makes it, converted once
per command line in a test process.

fairseq's conversion of the parsed arguments into its config (hydra's compose) takes
0.2-0.35 s; argparse and a copy of the result take 5 ms each. The criteria's tests build
models from a handful of command lines 150 times (45 of their 50 s went to the conversion).
The conversion is a function of the parsed arguments alone (the registries it reads only
grow in a test process), so its result is kept per namespace and each caller gets a copy
of its own to change. One thing the copies share: a legacy model's config (roberta,
transformer) is an argparse.Namespace inside the DictConfig, and omegaconf's deepcopy
keeps that object; a test that changes ``cfg.model`` copies it first (as
test_attendout.py's do). Copying by pickle instead made an fp16 test of test_attendout.py
fail after test_criteria.py in the same process (PYTHONHASHSEED=0): not understood, so
not done."""
import copy

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

_CONVERTED = {}


def training_config(argv):
    """(args, cfg) for `fairseq-train ARGV`: a fresh namespace and a fresh copy of the
    config on every call."""
    args = options.parse_args_and_arch(options.get_training_parser(), list(argv))
    key = repr(sorted(vars(args).items()))
    if key not in _CONVERTED:
        _CONVERTED[key] = convert_namespace_to_omegaconf(args)
    return args, copy.deepcopy(_CONVERTED[key])

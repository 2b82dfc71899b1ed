"""``python -m rdrop_fairseq`` prints the directory to pass to fairseq's ``--user-dir``;
``--options`` prints every option the plugin adds to fairseq, with its default and help."""

import argparse
import os
import sys
import textwrap

PACKAGE = __package__ or "rdrop_fairseq"
USER_DIR = os.path.dirname(os.path.abspath(__file__))


def plugin_components():
    """``(kind, name, class)`` of everything the plugin registers with fairseq."""
    try:
        import fairseq  # noqa: F401  (registers the plugin: rdrop_fairseq/__init__.py)
    except ImportError as e:
        sys.exit(f"error: --options reads fairseq's registries, and fairseq does not import "
                 f"in this Python ({sys.executable}: {e}); install it (README, Compatibility)")
    from fairseq.models import MODEL_REGISTRY
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_REGISTRY

    registries = {kind: r["registry"] for kind, r in REGISTRIES.items()}
    registries.update(model=MODEL_REGISTRY, task=TASK_REGISTRY)
    for kind, registry in registries.items():
        for name, cls in registry.items():
            if cls.__module__.startswith(PACKAGE + "."):
                yield kind, name, cls


def added_options(kind, name, cls):
    """The argparse actions of ``cls`` that its fairseq parent does not have, each with
    its default as fairseq resolves it (for a model: after its architecture function)."""
    parser = argparse.ArgumentParser(add_help=False)
    cls.add_args(parser)
    parent = next(c for c in cls.__mro__[1:]
                  if hasattr(c, "add_args") and not c.__module__.startswith(PACKAGE + "."))
    inherited = argparse.ArgumentParser(add_help=False)
    parent.add_args(inherited)
    known = {s for action in inherited._actions for s in action.option_strings}
    actions = [a for a in parser._actions if a.option_strings and not known & set(a.option_strings)]
    defaults = argparse.Namespace(**{a.dest: a.default for a in parser._actions})
    if kind == "model":
        from fairseq.models import ARCH_CONFIG_REGISTRY

        ARCH_CONFIG_REGISTRY[name](defaults)  # the architecture fills in what add_args leaves
    return [(a, getattr(defaults, a.dest)) for a in actions]


def describe(action, default):
    if action.choices:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    elif action.nargs == 0:
        value = ""
    else:
        value = action.metavar or getattr(action.type, "__name__", "VALUE").upper()
    if isinstance(default, bool):
        default = "on" if default else "off"
    elif default in ("", None):
        default = "(none)"
    head = f"  {action.option_strings[0]} {value}".rstrip()
    help_text = textwrap.fill(action.help or "", width=88, initial_indent=" " * 6,
                              subsequent_indent=" " * 6)
    return f"{head:<40} default: {default}\n{help_text}"


def print_options():
    groups = {}  # components with the same options are listed together (the criteria)
    for kind, name, cls in plugin_components():
        lines = tuple(describe(a, d) for a, d in added_options(kind, name, cls))
        if lines:
            groups.setdefault((kind, lines), []).append(name)
    print("Options the rdrop_fairseq plugin adds to fairseq (with --user-dir); each criterion, "
          "model and task\nkeeps every option of its fairseq parent too.\n")
    for (kind, lines), names in groups.items():
        if kind == "model":
            from fairseq.models import ARCH_MODEL_INV_REGISTRY

            archs = [a for n in names for a in ARCH_MODEL_INV_REGISTRY[n]]
            head = f"model {', '.join(names)} (--arch {', '.join(archs)})"
        else:
            kinds = kind if len(names) == 1 else {"criterion": "criteria"}.get(kind, kind + "s")
            head = f"{kinds} {', '.join(names)} (--{kind})"
        print(head, *lines, "", sep="\n")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m rdrop_fairseq", allow_abbrev=False,
        description="Without arguments: print the plugin's directory, for fairseq's "
                    "--user-dir (fairseq-train ... --user-dir $(python -m rdrop_fairseq)).")
    p.add_argument("--options", action="store_true",
                   help="print every option the plugin adds to fairseq (the criteria's "
                        "--rdrop-*, the AttendOut model's and task's --attendout-*) with its "
                        "default and help: fairseq-train --help does not list them")
    a = p.parse_args(argv)
    if a.options:
        print_options()
    else:
        print(USER_DIR)


if __name__ == "__main__":
    sys.exit(main())

"""Models named on the command line: :func:`load_model` calls the factory a ``FILE.py:FACTORY`` /
``package.module:FACTORY`` spec names (the ``--model`` of ``shardflow check``, ``plan`` and ``train``) and checks that
it returns ``(module, batch)``; :class:`ModelSpecError` says what to change when it does not.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Mapping

import torch
from torch import nn


class ModelSpecError(ValueError):
    """A ``--model`` spec that yields no ``(module, batch)``: not ``WHERE:NAME``, no such file or module, no such
    factory, a module or factory that raises or exits (``SystemExit``), or one that returns something else."""


def load_model(spec: str, seed: int = 0, vocab_size: int | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Call the factory that ``spec`` names and check what it returns.

    ``spec``: ``FILE.py:NAME`` (a Python file, imported as ``python FILE.py`` would: its directory first on
    ``sys.path``) or ``package.module:NAME`` (imported from ``sys.path``); ``NAME`` may be dotted
    (``Builder.tiny``). The factory takes no argument and returns ``(module, batch)``: an ``nn.Module`` and a dict
    of input name → tensor such that ``module(**batch)`` returns the loss (a scalar tensor, or an object with
    ``.loss`` as Hugging Face models do when given ``labels``). It is called after ``torch.manual_seed(seed)``, so
    every process that loads the spec builds the same weights. ``vocab_size`` (``shardflow train``: the
    tokenizer's) is passed to a factory whose signature takes ``vocab_size``.

    Raises:
        ModelSpecError: naming the spec and what to change.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ModelSpecError(
            f"--model {spec!r}: write FILE.py:FACTORY or package.module:FACTORY (a function that "
            f"returns (module, batch)), or name a built-in model (llama, gpt2 or another Hugging Face "
            f"causal-LM model type; gpt, mlp)"
        )
    module = _import(spec, where)
    factory = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            found = sorted(
                n
                for n, f in vars(module).items()
                if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == module.__name__
            )
            raise ModelSpecError(
                f"--model {spec}: {where} has no {name!r}; its functions: {', '.join(found) or 'none'}"
            )
    if not callable(factory):
        raise ModelSpecError(
            f"--model {spec}: {name!r} ({type(factory).__name__}) is not a function returning (module, batch)"
        )
    kwargs = {"vocab_size": vocab_size} if vocab_size is not None and _takes(factory, "vocab_size") else {}
    torch.manual_seed(seed)
    try:
        made = factory(**kwargs)
    except SystemExit as e:  # sys.exit() or an argparse in the factory: no model, and no error of its own
        raise ModelSpecError(
            f"--model {spec}: calling {name}() exited ({_exited(e)}) instead of returning (module, batch); remove "
            f'the exit from {name}() (a command line it parses belongs under if __name__ == "__main__":)'
        ) from None
    except Exception as e:
        raise ModelSpecError(f"--model {spec}: calling {name}() raised {_raised(e)}") from None
    return _checked(spec, name, made)


def _takes(factory, name: str) -> bool:
    """Whether ``factory``'s signature has a parameter ``name``."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or a class without a readable signature
        return False


def _import(spec: str, where: str) -> ModuleType:
    """The module of a spec's ``WHERE``: a ``.py`` file (as ``python FILE.py`` imports it) or a dotted module."""
    try:
        if not where.endswith(".py"):
            return importlib.import_module(where)
        path = Path(where).resolve()
        if not path.is_file():
            raise ModelSpecError(
                f"--model {spec}: no file {where} (from {Path.cwd()}); give the path of a Python "
                f"file, or a module importable as package.module"
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # its sibling modules import as they do under `python FILE.py`
        name = f"shardflow_model_{path.stem}"
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # dataclasses and pickling look their module up there
        loader.loader.exec_module(module)
        return module
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise ModelSpecError(f"--model {spec}: no module named {where!r} (a file needs its .py suffix)") from None
        raise ModelSpecError(f"--model {spec}: importing {where} raised {_raised(e)}") from None
    except ModelSpecError:
        raise
    except SystemExit as e:  # a script's sys.exit() or argparse run on import
        raise ModelSpecError(
            f"--model {spec}: importing {where} exited ({_exited(e)}) instead of defining the factory; move the "
            f'code that exits under if __name__ == "__main__": (it runs on import)'
        ) from None
    except Exception as e:
        raise ModelSpecError(f"--model {spec}: importing {where} raised {_raised(e)}") from None


def _raised(e: BaseException) -> str:
    """``Type: message (at FILE:LINE)``, the line being the innermost frame of the traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def _exited(e: SystemExit) -> str:
    """``SystemExit: CODE, at FILE:LINE``, the line being the innermost frame of the traceback (the exit's)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"SystemExit: {e.code}" + (f", at {frames[-1].filename}:{frames[-1].lineno}" if frames else "")


def _checked(spec: str, name: str, made: object) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``made`` as ``(module, batch)``, or a ModelSpecError saying what the factory returned instead."""
    fix = f"{name}() must return (module, batch): an nn.Module and a dict of input name → tensor"
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        got = f"a {type(made).__name__} of {len(made)}" if isinstance(made, (tuple, list)) else type(made).__name__
        raise ModelSpecError(f"--model {spec}: {fix}; it returned {got}")
    module, batch = made
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"--model {spec}: {fix}; its first item is a {type(module).__name__}")
    if not isinstance(batch, Mapping) or not batch:
        got = "an empty dict" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        raise ModelSpecError(f"--model {spec}: {fix}; its second item is {got}")
    bad = [
        f"{k!r} ({type(v).__name__})"
        for k, v in batch.items()
        if not isinstance(k, str) or not isinstance(v, torch.Tensor)
    ]
    if bad:
        raise ModelSpecError(
            f"--model {spec}: {fix}; the batch has non-tensor entries {', '.join(bad)} (settings "
            f"such as use_cache=False belong in the model's config)"
        )
    return module, dict(batch)

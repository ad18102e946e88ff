"""A checkpoint outside training: the plain module with its weights (for ``shardflow generate``), and the weights
as one safetensors file (``shardflow export``). One process reads the full tensors, whatever strategy wrote them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shardflow.train.checkpoint.dcp import Checkpoint, model_entries, read
from shardflow.train.checkpoint.model import ModelAdapter
from shardflow.train.checkpoint.store import CheckpointError, find


def load_model(path: str | os.PathLike, adapter: ModelAdapter) -> tuple[torch.nn.Module, Checkpoint]:
    """The plain module (``adapter.build``) with the weights of the checkpoint at ``path`` (see
    :func:`~shardflow.train.checkpoint.store.find`), in eval mode."""
    ck = read(find(path))
    config = ck.config(adapter)
    torch.manual_seed(0)
    model = adapter.build(config)
    names = [n for n, _ in model.named_parameters()]
    tensors = ck.load(model_entries(model, names))
    model.load_state_dict({n: tensors[f"model/{n}"] for n in names}, strict=True)
    return model.eval(), ck


def export(path: str | os.PathLike, out: str | os.PathLike, adapter: ModelAdapter) -> tuple[Path, Checkpoint]:
    """Write the checkpoint's weights as one safetensors file under the module's parameter names, with the model
    config as JSON in the metadata key ``config`` and the run's ``tokenizer.json`` in the key ``tokenizer``. Written to a
    temporary name and renamed, so ``out`` is whole or untouched."""
    from safetensors.torch import save_file

    out = Path(out)
    if not out.parent.is_dir():
        raise CheckpointError(f"--out {out}: directory {out.parent} does not exist; create it or write elsewhere")
    if out.is_dir():
        raise CheckpointError(f"--out {out} is a directory; pass a file name such as {out / 'model.safetensors'}")
    model, ck = load_model(path, adapter)
    metadata = {"format": "pt", "config": json.dumps(adapter.to_json(ck.config(adapter))),
                "tokenizer": ck.tokenizer.to_json(), "step": str(ck.step), "source": str(ck.path)}
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write --out {out} ({e.strerror or e}); choose a writable location") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, ck

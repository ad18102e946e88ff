"""What ``shardflow train --model`` builds: a :class:`Family` — how to size, build, feed, record and export a model.

* ``llama`` (the default) — Hugging Face ``LlamaForCausalLM`` (RMSNorm, rotary embeddings, SwiGLU, grouped-query
  attention) built from a config with random weights (nothing is downloaded);
* ``gpt2`` — Hugging Face ``GPT2LMHeadModel`` likewise;
* any other causal-LM ``model_type`` of ``transformers`` (``mistral``, ``qwen2``, ...) through ``--model-config``;
* ``FILE.py:FACTORY`` / ``package.module:FACTORY`` — the factory ``shardflow check`` takes
  (:func:`shardflow.model_spec.load_model`), fed from the data pipeline.

Sizes: the family's defaults (:data:`DEFAULT_SIZES`) < ``--model-config config.json`` (a Hugging Face config) <
the flags ``--layers --heads --kv-heads --embd --mlp`` (``--seq-len`` sets the positions, the tokenizer the
vocabulary). ``shardflow plan`` and ``check`` take the same flags and size a model the same way (:meth:`Sizes.of`).

How a model takes a batch (:class:`Feed`): the data pipeline makes token ids ``idx`` [B, T] and their next tokens
``targets`` [B, T]. A Hugging Face causal LM gets ``input_ids=idx, labels=targets, shift_labels=targets``: with
``shift_labels`` given, transformers' ``ForCausalLMLoss`` does not shift again, so the loss is the mean
cross-entropy over all B·T positions — the same as ``forward(idx, targets)`` of a model that takes the targets
already shifted.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from shardflow.model_spec import load_model


class ModelError(ValueError):
    """``--model`` / ``--model-config`` / size flags that make no model; the message names the setting and the fix."""


class Feed(StrEnum):
    """How a model takes the pipeline's batch (``idx``, ``targets``: int64 [B, T])."""

    NEXT_TOKEN = "idx,targets"  # forward(idx, targets) → loss (targets already shifted)
    CAUSAL_LM = "input_ids,labels"  # a Hugging Face causal LM: forward(input_ids, labels, shift_labels) → .loss

    def inputs(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``model(**inputs)`` for one batch."""
        if self is Feed.NEXT_TOKEN:
            return {"idx": idx, "targets": targets}
        return {"input_ids": idx, "labels": targets, "shift_labels": targets}

    @classmethod
    def of_batch(cls, spec: str, keys: set[str], module: nn.Module) -> Feed:
        """The feed a factory's example batch asks for (its keys). Raises ModelError for other keys, or
        ``input_ids``/``labels`` on a module that is not a Hugging Face model (which alone shifts the labels)."""
        if keys == {"idx", "targets"}:
            return cls.NEXT_TOKEN
        if keys == {"input_ids", "labels"} and is_hf(module):
            return cls.CAUSAL_LM
        hf = " (a Hugging Face PreTrainedModel)" if keys == {"input_ids", "labels"} else ""
        raise ModelError(
            f"--model {spec}: shardflow train feeds token batches as idx and targets (the next tokens, "
            f"for forward(idx, targets) → loss) or as input_ids and labels{hf}; the factory's batch has "
            f"{', '.join(sorted(keys))}: return one of those two batches"
        )


def is_hf(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``PreTrainedModel`` (without importing transformers when it is not)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


@dataclass(frozen=True)
class Sizes:
    """The sizes the flags set (None: the family's default or ``--model-config``'s). ``mlp``: the MLP's width
    (``intermediate_size``; default: the family's ratio to ``embd``, :data:`_HF_TYPES`)."""

    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    embd: int | None = None
    mlp: int | None = None

    @classmethod
    def of(cls, settings: Any) -> Sizes:
        """The sizes ``settings`` names by the flags' names (a TrainConfig, or the parsed flags of ``shardflow
        plan`` and ``check``): one reading, so every command sizes a model from the same flags alike."""
        return cls(**{k: getattr(settings, k, None) for k in asdict(cls())})


# `make train`'s model: about two minutes on 2 cores at tp=2 (see docs/execution.md); the MLP by the family's rule
DEFAULT_SIZES = Sizes(layers=2, heads=4, kv_heads=2, embd=128)

# Hugging Face config attributes per size flag (the standard names: GPT2Config maps them onto n_layer, ...)
_ATTRS = {
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "embd": "hidden_size",
}


@dataclass(frozen=True)
class _HFType:
    """How ``shardflow train`` sizes one Hugging Face ``model_type`` without ``--model-config``: the MLP width
    attribute (what ``--mlp`` sets) and, without ``--mlp``, its ratio to the width (SwiGLU's 8/3, rounded up to a multiple of 64, as Llama; GPT-2's 4); its
    dropout attributes (``--dropout``) and its attention dropout (always 0: the fused attention kernel draws its
    mask inside, where shardflow cannot draw the same mask on every strategy; a config file that asks for more is
    refused)."""

    ffn: str
    ffn_ratio: float
    dropouts: tuple[str, ...]
    attention_dropout: str


_HF_TYPES = {
    "llama": _HFType("intermediate_size", 8 / 3, (), "attention_dropout"),
    "mistral": _HFType("intermediate_size", 8 / 3, (), "attention_dropout"),
    "qwen2": _HFType("intermediate_size", 8 / 3, (), "attention_dropout"),
    "gpt2": _HFType("n_inner", 4, ("resid_pdrop", "embd_pdrop"), "attn_pdrop"),
}


@dataclass(frozen=True)
class Family:
    """A model family as ``shardflow train``, its checkpoints, ``export`` and ``generate`` see it.

    * ``name``: ``llama``, ``gpt2``, a model type, or the factory's spec; ``feed``: how it takes batches;
    * ``build``: the module of a config (the caller seeds); ``to_json``/``from_json``: the config as a checkpoint
      records it; ``describe``: one line of sizes;
    * ``must_match``: (config attribute, flag) pairs a run resuming from a checkpoint must share with it.
    """

    name: str
    feed: Feed
    build: Callable[[Any], nn.Module]
    to_json: Callable[[Any], dict[str, Any]]
    from_json: Callable[[Mapping[str, Any]], Any]
    describe: Callable[[Any], str]
    must_match: tuple[tuple[str, str], ...] = ()

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of token ids ``idx`` [B, T] (for sampling). Raises ModelError for a model that only
        returns its loss."""
        if self.feed is Feed.CAUSAL_LM:
            return model(input_ids=idx).logits
        if hasattr(model, "logits"):
            return model.logits(idx)
        raise ModelError(
            f"model {self.name} ({type(model).__name__}) has no logits(idx) method: shardflow "
            f"generate samples from Hugging Face models and from models with logits(idx) → [B, T, V]"
        )


# --- Hugging Face families ---------------------------------------------------------------------------------------


def _hf_build(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def _hf_from_json(saved: Mapping[str, Any]):
    from transformers import AutoConfig

    saved = dict(saved)
    model_type = saved.pop("model_type", None)
    if model_type is None:
        raise ValueError("the model config has no model_type")
    return AutoConfig.for_model(model_type, **saved)


def _hf_describe(config) -> str:
    kv = getattr(config, "num_key_value_heads", None)
    kv = f" ({kv} key/value)" if kv and kv != config.num_attention_heads else ""
    return (
        f"{type(config).__name__.removesuffix('Config')} ({config.model_type}): {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads{kv}, width {config.hidden_size}"
    )


def hf_family(model_type: str) -> Family:
    """The family of a Hugging Face causal LM ``model_type``."""
    match = tuple((a, f"--{k.replace('_', '-')}") for k, a in _ATTRS.items()) + (
        (_ffn(model_type), "--mlp"),
        ("vocab_size", "--vocab-size"),
    )
    return Family(model_type, Feed.CAUSAL_LM, _hf_build, lambda c: c.to_dict(), _hf_from_json, _hf_describe, match)


def _ffn(model_type: str) -> str:
    """The config attribute of a model type's MLP width (``--mlp``): GPT-2's ``n_inner``, else ``intermediate_size``."""
    kind = _HF_TYPES.get(model_type)
    return kind.ffn if kind else "intermediate_size"


def layers_of(family: Family, config: Any) -> Callable[[int], nn.Module]:
    """``family``'s model of ``config`` with k layers, for :func:`check_model_size`."""
    import copy

    def build(k: int) -> nn.Module:
        small = copy.deepcopy(config)
        small.num_hidden_layers = k
        return family.build(small)

    return build


def hf_config(
    model: str | None,
    config_file: str | None,
    sizes: Sizes,
    vocab_size: int,
    seq_len: int,
    dropout: float,
    keep_vocab: bool = False,
):
    """The Hugging Face config of ``--model`` (a model type; None: ``--model-config``'s, else llama) sized by
    ``--model-config`` and the flags (``sizes``; ``--mlp`` sets the MLP width, else the family's ratio to the width
    or the config file's), with the tokenizer's ``vocab_size`` (``keep_vocab``: the config's, which must
    hold the tokenizer's ids — a pretrained model's embedding), at least ``seq_len`` positions, the given dropout
    and no KV cache (the training forward is captured). Raises ModelError."""
    from transformers import CONFIG_MAPPING, AutoConfig

    base: dict[str, Any] = {}
    if config_file:
        try:
            base = json.loads(Path(config_file).read_text())
        except (OSError, ValueError) as e:
            raise ModelError(
                f"--model-config {config_file}: cannot read it as JSON ({e}); pass a Hugging Face config.json"
            ) from None
        if not isinstance(base, dict) or "model_type" not in base:
            raise ModelError(
                f"--model-config {config_file}: no model_type in it; pass a Hugging Face config.json "
                f"(as save_pretrained writes)"
            )
    if base and not (isinstance(base["model_type"], str) and base["model_type"] in CONFIG_MAPPING):
        raise ModelError(
            f"--model-config {config_file}: model_type {json.dumps(base['model_type'])} is not a model type of "
            f'transformers; give one as a string, such as "llama", "gpt2" or "qwen2"'
        )
    model_type = model or base.get("model_type", "llama")
    if base:
        check_model_config(config_file or "", base)
    if base and base["model_type"] != model_type:
        raise ModelError(
            f"--model {model} but --model-config {config_file} is of model_type "
            f"{base['model_type']!r}; drop --model, or pass a config of {model_type}"
        )
    if model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"--model {model_type}: not a model type of transformers, nor FILE.py:FACTORY; use llama, "
            f"gpt2, another causal-LM type (mistral, qwen2, ...) or a factory"
        )
    try:
        config = AutoConfig.for_model(**(base or {"model_type": model_type}))
    except Exception as e:  # transformers' own checks of the file's other fields (types, values)
        raise ModelError(
            f"--model-config {config_file}: transformers refuses it ({type(e).__name__}: {one_line(e)}); fix "
            f"that field, or drop it to take the {model_type} default"
        ) from None
    gqa = hasattr(config, "num_key_value_heads")
    if sizes.kv_heads is not None and not gqa:
        raise ModelError(
            f"--kv-heads {sizes.kv_heads}: {model_type} has no grouped-query attention (every head has "
            f"its own keys and values); drop --kv-heads"
        )
    kind = _HF_TYPES.get(model_type)
    for flag, attr in _ATTRS.items():
        v = getattr(sizes, flag)
        if v is None and not base and (flag != "kv_heads" or gqa):
            v = getattr(DEFAULT_SIZES, flag)
        if v is not None:
            setattr(config, attr, v)
    if getattr(config, "head_dim", None) is not None and (sizes.embd or sizes.heads or not base):
        # a config computes its head size from its width and heads when it is made: again for the new ones
        config.head_dim = config.hidden_size // config.num_attention_heads
    if sizes.mlp is not None:
        if not hasattr(config, _ffn(model_type)):
            raise ModelError(
                f"--mlp {sizes.mlp}: {model_type}'s config has no {_ffn(model_type)} (the MLP width --mlp sets); "
                f"drop --mlp, or size its MLP in a --model-config"
            )
        setattr(config, _ffn(model_type), sizes.mlp)
    elif kind is not None and not base:  # a --model-config keeps its own MLP width
        setattr(config, kind.ffn, -(-int(config.hidden_size * kind.ffn_ratio) // 64) * 64)
    if dropout and not (kind and kind.dropouts):
        with_dropout = [t for t, k in _HF_TYPES.items() if k.dropouts]
        raise ModelError(
            f"--dropout {dropout}: {model_type} has dropout only inside attention, which shardflow "
            f"does not support (the fused kernel draws its mask); drop --dropout, or train "
            f"{' or '.join(with_dropout)} (residual and embedding dropout)"
        )
    if kind is not None:
        asked = base.get(kind.attention_dropout) if base else None
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked != 0:
            # refused, not zeroed without a word: the fused attention kernel draws its dropout mask inside, where
            # shardflow cannot draw the same mask on every rank of every strategy
            raise ModelError(
                f"--model-config {config_file}: {kind.attention_dropout} {asked} asks for dropout inside "
                f"attention, which shardflow does not support (the fused attention kernel draws its mask, which "
                f"cannot be the same on every strategy); set {kind.attention_dropout} to 0 in it"
                + (
                    f", and use --dropout for the {' and '.join(kind.dropouts)} dropout"
                    if kind.dropouts
                    else " (this model has no other dropout)"
                )
            )
        for attr in kind.dropouts:
            # a config file's own residual or embedding dropout is kept unless --dropout gives another (it is not
            # zeroed without a word; set it to 0 in the file to train without it)
            given = base.get(attr) if base else None
            kept = dropout == 0 and isinstance(given, (int, float)) and not isinstance(given, bool) and given != 0
            setattr(config, attr, given if kept else dropout)
        setattr(config, kind.attention_dropout, 0.0)
    if not keep_vocab:
        config.vocab_size = vocab_size
    elif config.vocab_size < vocab_size:
        raise ModelError(
            f"the tokenizer has {vocab_size} tokens but the model's embedding only {config.vocab_size}: "
            f"pass the tokenizer the model was trained with"
        )
    # GPT-2 learns a position embedding per position: as many as --seq-len (a --model-config may hold more)
    config.max_position_embeddings = max(seq_len, config.max_position_embeddings) if base else seq_len
    config.use_cache = False
    heads, embd = config.num_attention_heads, config.hidden_size
    if embd % heads:
        fits = largest_divisor(embd, heads)
        raise ModelError(
            f"--embd {embd} is not a multiple of --heads {heads} (every head gets --embd / --heads "
            f"features); change one of them, e.g. --heads {fits}"
        )
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and heads % kv:
        raise ModelError(
            f"--heads {heads} is not a multiple of --kv-heads {kv} (each key/value head serves "
            f"--heads / --kv-heads query heads); change one of them, e.g. --kv-heads 1"
        )
    return config


def largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most`` (both ≥ 1): what an error suggests in place of ``most``,
    found without counting to ``most`` (which a hostile config makes huge)."""
    if most >= n:
        return n
    # the divisor pairs (k, n // k) up to √n, the search bounded: a suggestion, 1 where a hostile size leaves none
    top = min(math.isqrt(n), most, 10**6)
    return max((d for k in range(1, top + 1) if n % k == 0 for d in (k, n // k) if d <= most), default=1)


def one_line(e: BaseException) -> str:
    """An exception's message as one line (its lines joined; a traceback's frames, as torch appends them, dropped)."""
    lines = [line.strip() for line in str(e).split("Exception raised from")[0].splitlines() if line.strip()]
    return "; ".join(lines) or type(e).__name__


@contextlib.contextmanager
def buildable(what: str) -> Iterator[None]:
    """Turn what torch (or transformers) raises while it makes a model or batch of sizes it cannot hold into one
    ModelError naming ``what`` (the flags or file that sized it): sizes past int64 (``Overflow when unpacking``), a
    storage whose size overflows, memory that cannot be allocated."""
    try:
        yield
    except (RuntimeError, TypeError, OverflowError, MemoryError) as e:
        text = str(e)
        if not (isinstance(e, (OverflowError, MemoryError)) or "verflow" in text or "allocate" in text):
            raise
        raise ModelError(
            f"{what}: a model or batch of these sizes cannot be made ({one_line(e)}); give smaller sizes"
        ) from None


# a model deeper than this is sized before it is built (check_model_size): building it layer by layer takes long
PROBED_LAYERS = 64
# the most bytes any one device (accelerator or host) of a run holds: a model whose weights alone exceed this many
# per process cannot run anywhere, and building it would not end
MAX_DEVICE_BYTES = 2**41


def check_model_size(build: Callable[[int], nn.Module], layers: Any, what: str, devices: int) -> None:
    """Refuse (ModelError naming ``what``, the flags or file that sized it) a model of more than
    :data:`PROBED_LAYERS` ``layers`` whose weights alone, at 2 bytes each, exceed ``devices`` ×
    :data:`MAX_DEVICE_BYTES`: its parameters are counted on copies of 1 and 2 layers (``build(k)``: the model with k
    layers, built here on the meta device) and drawn as a line to its depth (every layer alike), before anything of
    its own size is built."""
    if not isinstance(layers, int) or layers <= PROBED_LAYERS:
        return
    counts = []
    for k in (1, 2):
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in build(k).parameters()))
    params = counts[0] + (counts[1] - counts[0]) * (layers - 1)
    if 2 * params > devices * MAX_DEVICE_BYTES:
        per_layer = max(counts[1] - counts[0], 1)
        fits = max((devices * MAX_DEVICE_BYTES // 2 - counts[0]) // per_layer, 1)
        raise ModelError(
            f"{what}: {layers:,} layers make a model of about {params:.3g} parameters ({2 * params / 2**40:.3g} TiB "
            f"in bf16, counted on 1 and 2 layers), more than {devices} device(s) of at most "
            f"{MAX_DEVICE_BYTES / 2**40:.0f} TiB each hold; give at most {fits:,} layers, or more devices"
        )


# the config attributes (standard names: a config's attribute_map gives its own) that size a model: integers ≥ 1
_SIZE_ATTRS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "n_inner",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def check_model_config(config_file: str, values: Mapping[str, Any]) -> None:
    """Check a ``--model-config`` file's own values (``values``: its JSON, of a ``model_type`` of transformers)
    before a config is made of them, so that every way it makes no model is one ModelError naming the field, its
    value and the fix — not a traceback of transformers or torch, nor a model that trains as something else:

    * the sizes (:data:`_SIZE_ATTRS`, under the config's own names) are integers ≥ 1 (null where the config's
      default is: GPT-2's ``n_inner``, a ``head_dim`` the config derives);
    * the heads divide the width (unless the config gives its ``head_dim``), the key/value heads the heads;
    * the model type has a causal LM in transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), its
      ``architectures`` (where given) are causal LMs, and an encoder (a model type with a masked LM, such as
      bert) is a decoder (``is_decoder``: its attention is causal only then);
    * the rope type (``rope_parameters`` / ``rope_scaling``) is one transformers knows.
    """
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    where = f"--model-config {config_file}"
    model_type = values["model_type"]
    cls = CONFIG_MAPPING[model_type]
    names = {std: cls.attribute_map.get(std, std) for std in _SIZE_ATTRS}
    defaults = cls()
    got: dict[str, int] = {}
    for std, name in names.items():
        if name not in values:
            continue
        v = values[name]
        if v is None and getattr(defaults, name, None) is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(
                f"{where}: {name} {json.dumps(v)} is not a size: give an integer ≥ 1 (a JSON number without quotes "
                f"or a fraction), e.g. {name} {1 if std == 'num_key_value_heads' else getattr(defaults, name, None) or 1}"
            )
        if v >= 2**63:  # past int64: no tensor (nor loop over layers) of it
            raise ModelError(
                f"{where}: {name} {v} is not a size: give an integer from 1 to {2**63 - 1} (torch's sizes are int64)"
            )
        got[std] = v
    heads, kv, width = (
        got.get(k, getattr(defaults, names[k], None))
        for k in ("num_attention_heads", "num_key_value_heads", "hidden_size")
    )
    if "num_key_value_heads" not in got and "num_attention_heads" in got and names["num_key_value_heads"] not in values:
        # a config derives its key/value heads from its heads where the file gives none (Llama: as many), not from
        # the default config's heads
        given: dict[str, Any] = {names["num_attention_heads"]: heads}
        kv = getattr(cls(**given), names["num_key_value_heads"], None)
    if "head_dim" not in got and isinstance(heads, int) and isinstance(width, int) and width % heads:
        fits = largest_divisor(width, heads)
        raise ModelError(
            f"{where}: {names['hidden_size']} {width} is not a multiple of {names['num_attention_heads']} {heads} "
            f"(every head gets {names['hidden_size']} / {names['num_attention_heads']} features); change one of "
            f"them, e.g. {names['num_attention_heads']} {fits}"
        )
    if isinstance(kv, int) and isinstance(heads, int) and heads % kv:
        fits = largest_divisor(heads, kv)
        raise ModelError(
            f"{where}: {names['num_attention_heads']} {heads} is not a multiple of {names['num_key_value_heads']} "
            f"{kv} (each key/value head serves {names['num_attention_heads']} / {names['num_key_value_heads']} "
            f"query heads); change one of them, e.g. {names['num_key_value_heads']} {fits}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"{where}: model_type {model_type!r} has no causal language model in transformers (shardflow train "
            f"trains next-token prediction); pass the config of a causal LM (llama, gpt2, qwen2, mistral, ...)"
        )
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = values.get("architectures") or []
    other = [a for a in archs if a not in causal] if isinstance(archs, list) else [archs]
    if other:
        raise ModelError(
            f"{where}: architectures {json.dumps(archs)}: {', '.join(map(str, other))} is not a causal language "
            f"model, but shardflow train trains one ({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}); pass a "
            f"causal LM's config, or drop architectures to train {model_type} as a causal LM"
        )
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and values.get("is_decoder") is not True:
        raise ModelError(
            f"{where}: model_type {model_type!r} is an encoder whose attention sees the whole sequence unless "
            f"the config makes it a decoder (is_decoder {json.dumps(values.get('is_decoder', False))}), so it would "
            f'learn to copy the next token; set "is_decoder": true to train it as a causal LM, or pass a '
            f"decoder's config (llama, gpt2, qwen2, ...)"
        )
    known = {"default", *ROPE_INIT_FUNCTIONS}
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if not isinstance(rope, dict):
            continue
        per_layer = rope.values() if all(isinstance(r, dict) for r in rope.values()) and rope else [rope]
        for r in per_layer:
            kind = r.get("rope_type", r.get("type", "default"))
            if kind not in known:
                raise ModelError(
                    f"{where}: {key} has rope_type {json.dumps(kind)}, which transformers does not know; give one "
                    f"of {', '.join(sorted(known))}, or drop {key} (the default rotary embedding)"
                )


# --- factories (FILE.py:FACTORY) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactoryConfig:
    """A factory model's config: the spec, and the tokenizer's vocabulary size (passed to a factory that takes
    ``vocab_size``)."""

    spec: str
    vocab_size: int


def _factory_build(config: FactoryConfig) -> nn.Module:
    return _call_factory(config)[0]


def _call_factory(config: FactoryConfig) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return load_model(config.spec, seed=torch.initial_seed(), vocab_size=config.vocab_size)


def factory_family(spec: str, vocab_size: int) -> tuple[Family, FactoryConfig]:
    """The family of a ``FILE.py:FACTORY`` spec and its config; calls the factory once to learn its feed. Raises
    ModelSpecError (the factory) or ModelError (its batch)."""
    config = FactoryConfig(spec, vocab_size)
    module, batch = _call_factory(config)
    feed = Feed.of_batch(spec, set(batch), module)
    inputs_of = getattr(module, "get_input_embeddings", None)  # a Hugging Face model's
    embedding = inputs_of() if callable(inputs_of) else None
    if isinstance(embedding, nn.Embedding) and embedding.num_embeddings < vocab_size:
        raise ModelError(
            f"--model {spec}: its input embedding has {embedding.num_embeddings} rows but the tokenizer has "
            f"{vocab_size} tokens, so a token id would index past it; make the factory take vocab_size (shardflow "
            f"train passes the tokenizer's), or give a --tokenizer of at most {embedding.num_embeddings} tokens"
        )
    return Family(
        spec,
        feed,
        _factory_build,
        asdict,
        lambda saved: FactoryConfig(**saved),
        lambda c: f"{type(module).__name__} from {c.spec}",
    ), config


def is_factory(model: str | None) -> bool:
    """Whether ``--model`` names a factory (``WHERE:NAME``) rather than a model type."""
    return model is not None and ":" in model


def is_model_type(model: str) -> bool:
    """Whether ``model`` is a model type of transformers (llama, gpt2, qwen2, ...)."""
    from transformers import CONFIG_MAPPING

    return model in CONFIG_MAPPING


def family_of(saved: Mapping[str, Any]) -> Family:
    """The family of a checkpoint's recorded model (``{"family": name, "config": {...}}``; a factory is called once
    to learn its feed). Raises ModelError for a record without a family."""
    name = saved.get("family")
    if not name:
        raise ModelError("the checkpoint records no model family")
    if is_factory(name):
        return factory_family(name, saved["config"]["vocab_size"])[0]
    return hf_family(name)

"""The model checked at load, before any request: what bulkgen's attention and paged KV cache do not compute is
refused with the model's class and the reason (invariant 4: refused, never run to other outputs than the model's).

- `check_loaded`: the model takes bulkgen's attention through transformers' interface, and has no layers of a kind
  bulkgen does not compute (state carried from token to token, attention of another kind);
- `probe`: two tokens through the model's own modules: every layer's attention must reach bulkgen's once, causal,
  with K/V shaped as the cache (attention.paged_attention_forward checks each call), and each layer's window is
  read off the mask the model's own code builds for it (`mask_span`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from bulkgen.config import SamplingParams
from bulkgen.engine.metadata import ATTENTION_NAME, MaskSpan, ProbeRecord
from bulkgen.engine.scheduler import ScheduledSeq
from bulkgen.engine.sequence import Sequence
from bulkgen.errors import ModelError

log = logging.getLogger(__name__)

# Layers that carry a state from token to token instead of (or beside) attention: state-space mixers,
# linear attention, short convolutions, recurrences. The engine runs each step on the new tokens alone
# (use_cache=False) and keeps only paged K/V, so such a layer would see no past at all.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
STATEFUL_MODULES = ("mamba", "gateddeltanet", "shortconv", "rwkv", "linearattention", "recurrent", "lstm")
STATEFUL_LAYER_WORDS = ("linear", "mamba", "conv", "recurrent", "rwkv", "hybrid", "ssm", "delta")  # in layer_types


def unsupported_features(model: torch.nn.Module) -> str | None:
    """What of the model our attention and KV cache do not compute yet (None: nothing). A model that
    needs it is refused at load: run by bulkgen it would give other outputs than the model's."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    stateful = sorted({type(m).__name__ for m in model.modules()
                       if any(name in type(m).__name__.lower() for name in STATEFUL_MODULES)})
    carries_state = bool(stateful) or any(word in kind for kind in other for word in STATEFUL_LAYER_WORDS)
    if not other and not stateful:
        return None
    what = f"layers of type {', '.join(other)}" if other else f"{stateful[0]} layers"
    if carries_state:
        return f"{what} (a state carried from token to token, which bulkgen's paged KV cache does not hold)"
    return f"{what} (attention of another kind than the full and sliding-window attention bulkgen computes)"


def check_loaded(loaded: torch.nn.Module) -> torch.nn.Module:
    """The model, where bulkgen's attention reaches it and it uses nothing bulkgen does not compute."""
    if loaded.config._attn_implementation != ATTENTION_NAME:
        raise ModelError(f"{type(loaded).__name__} does not use transformers' attention interface; "
                         "bulkgen cannot plug its paged attention into it")
    missing = unsupported_features(loaded)
    if missing is not None:
        raise ModelError(f"{type(loaded).__name__} uses {missing}, which bulkgen does not compute "
                         "yet: it cannot run this model exactly")
    return loaded


def mask_span(batch_size: int, cache_position: torch.Tensor | None = None, kv_length: int = 0, kv_offset: int = 0,
              mask_function: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> object:
    """transformers' mask interface, registered only while the runner probes a model at load: instead of a
    mask, the span its mask function gives a query far into a sequence, which then reaches each layer's
    attention call as its attention_mask. So each layer's window is read from what the model's own code
    builds, not from a guess at what its config means. A mask that is not a causal window (bidirectional,
    chunked) is refused."""
    far = _PROBE_POSITION
    kv = torch.arange(far + 2)
    seen = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(far), kv)
    seen = torch.as_tensor(seen, dtype=torch.bool).expand(kv.shape)
    if bool(seen[far + 1]):
        raise ModelError("the model's mask lets a token see the tokens after it (an encoder's or a prefix-LM's "
                         "attention): bulkgen generates with causal attention only")
    first = int(seen[:far + 1].nonzero()[0]) if bool(seen[:far + 1].any()) else far + 1
    if first > far or not bool(seen[first:far + 1].all()):
        raise ModelError("the model's mask is not a causal window over the last tokens (chunked attention, say): "
                         "bulkgen's attention computes full and sliding-window attention only")
    return MaskSpan(window=0 if first == 0 else far - first + 1)


_PROBE_POSITION = 2**20  # a window of a million tokens or more reads as the whole context


@contextmanager
def reading_masks() -> Iterator[None]:
    """While the runner probes a model: transformers builds each mask through `mask_span` (MaskSpan values)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionMaskInterface.register(ATTENTION_NAME, mask_span)
    try:
        yield
    finally:  # unregistered, transformers builds no mask for bulkgen's attention (it needs none)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)


def probe(model: torch.nn.Module, num_layers: int, windows: tuple[int, ...],
          execute: Callable[[list[ScheduledSeq], ProbeRecord], object]) -> tuple[int, ...]:
    """Two tokens through the model's own modules (execute: the runner's step, in a cache whose block 0 nothing
    holds yet); returns each layer's window as its own mask gives it (windows: as the config reads them; () where
    every layer sees the whole context). A model whose attention goes elsewhere (written into its modules, shared
    between layers, an encoder's) would run to other outputs than its own: refused here (ModelError)."""
    name = type(model).__name__

    def step(read_masks: bool) -> ProbeRecord:
        seq = Sequence("probe", [0, 0], SamplingParams(max_new_tokens=1))
        seq.block_table = [0]
        record = ProbeRecord()
        if read_masks:
            with reading_masks():
                execute([ScheduledSeq(seq, 2)], record)
        else:
            execute([ScheduledSeq(seq, 2)], record)
        return record

    try:
        try:
            record = step(read_masks=True)
        except ModelError:
            raise
        except Exception:  # a module that reads its mask itself: probe again, windows read from the config
            record = step(read_masks=False)
    except ModelError as exc:
        if str(exc).startswith(name):
            raise
        raise ModelError(f"{name}: {exc}") from exc
    except Exception as exc:  # a model's modules may fail in any way on bulkgen's inputs
        raise ModelError(f"{name} fails on a first step through bulkgen's attention ({type(exc).__name__}: "
                         f"{exc}): bulkgen cannot run this model") from exc
    if sorted(record.calls) != list(range(num_layers)):
        raise ModelError(f"{name} calls bulkgen's attention {len(record.calls)} times for its {num_layers} "
                         f"layers (from layers {sorted(set(record.calls))}), where the paged KV cache holds one call's "
                         "K/V a layer: its attention does not run through transformers' attention interface as "
                         "bulkgen needs, so bulkgen cannot run it exactly")
    if len(record.windows) != num_layers:
        return windows
    read = tuple(record.windows[i] for i in range(num_layers))  # each layer's mask, as the model's code built it
    if read != (windows or (0,) * num_layers):
        log.info("bulkgen: %s's masks give windows %s where its config reads %s; the masks are the model's",
                 name, read, windows)
    return read if any(read) else ()

"""Which models the engine computes exactly: what a model uses that bulkgen's attention and paged KV cache
do not compute is named here, and the runner refuses such a model at load (invariant 4: refused, never run
to other outputs than the model's).
"""

from __future__ import annotations

import torch

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

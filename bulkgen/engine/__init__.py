"""bulkgen's continuous-batching engine: independent of the job store (never imports bulkgen.store).

The core, device-free: `sequence`, `block_manager` and `scheduler` are plain Python and import without
torch; `protocol` is the typed hand-off (RequestOutput, EngineStats) the worker sees. `engine` joins the
core to a `runner` (loads the model, owns torch and the `kv_cache`, runs a step through `llama`'s lean
forward or Hugging Face's modules with our `attention` plugged in), the `sampler` (with `draws`), the
JSON-schema `grammar` and the `detokenizer`. Kernels live in rooms by device: `cpu/` and `gpu/`.
"""

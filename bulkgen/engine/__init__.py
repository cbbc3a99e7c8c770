"""bulkgen's continuous-batching engine: independent of the job store (never imports bulkgen.store).

`sequence`, `block_manager` and `scheduler` are plain Python and import without torch; `runner`,
`attention` and `sampler` own torch; `engine` joins them behind `Engine`.
"""
